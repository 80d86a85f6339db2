//! Progress while a run's load is driven, and the run's timeline for the report's charts.
//!
//! Every 100 ms the apiservers are sampled; every second (a tick) the highest memory each
//! replica reached since the tick before, its OOM kills and each class's 429s go into the
//! timeline. The progress line shows each class's counts and each replica's *peak so far*:
//! a sample every few seconds would miss the spikes that kill an apiserver. On a terminal
//! the line is rewritten in place every tick; otherwise one line is printed every 5 ticks.

use std::io::{IsTerminal, Write as _};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::Classes;
use crate::report::Timeline;

pub use crate::sample::{ReplicaNow, Sampler};

/// How often the replicas are sampled.
const SAMPLE: Duration = Duration::from_millis(100);
/// Samples per tick.
const SAMPLES_PER_TICK: u32 = 10;
/// Ticks per printed line where the output is not a terminal.
const TICKS_PER_LINE: u64 = 5;

/// Starts the progress line and records into `timeline` until the handle is aborted.
/// `mode` heads the line; `limit` is each replica's memory limit (0: none).
pub fn start(
    mode: &'static str,
    classes: &Classes,
    limit: u64,
    sample: Sampler,
    timeline: Arc<Mutex<Timeline>>,
) -> JoinHandle<()> {
    let classes = classes.clone();
    let live = std::io::stderr().is_terminal();
    tokio::spawn(async move {
        // Ends the live line when the task is aborted, so the next line starts clean.
        let _newline = EndLine(live);
        let started = Instant::now();
        let mut interval = tokio::time::interval(SAMPLE);
        let mut last = sample();
        let mut tick_max: Vec<u64> = last.iter().map(|r| r.memory_bytes).collect();
        let mut peak_so_far = tick_max.clone();
        let mut rejected_before: Vec<u64> = classes.iter().map(|_| 0).collect();
        {
            let mut t = timeline.lock().unwrap_or_else(|e| e.into_inner());
            t.replica_memory_bytes = vec![Vec::new(); last.len()];
            t.oom_kills_at_s = vec![Vec::new(); last.len()];
        }
        let mut n = 0u32;
        let mut ticks = 0u64;
        loop {
            interval.tick().await;
            let now = sample();
            let at = started.elapsed().as_secs_f64();
            let mut t = timeline.lock().unwrap_or_else(|e| e.into_inner());
            for (i, r) in now.iter().enumerate() {
                let before = last.get(i).copied().unwrap_or_default();
                let mut high = r.memory_bytes;
                if r.peak_bytes > before.peak_bytes {
                    high = high.max(r.peak_bytes);
                }
                if i >= tick_max.len() {
                    tick_max.resize(i + 1, 0);
                    peak_so_far.resize(i + 1, 0);
                    t.replica_memory_bytes.resize(i + 1, Vec::new());
                    t.oom_kills_at_s.resize(i + 1, Vec::new());
                }
                tick_max[i] = tick_max[i].max(high);
                peak_so_far[i] = peak_so_far[i].max(high);
                for _ in before.ooms..r.ooms {
                    t.oom_kills_at_s[i].push(at);
                }
            }
            last = now;
            n += 1;
            if n < SAMPLES_PER_TICK {
                continue;
            }
            n = 0;
            ticks += 1;
            t.seconds.push(at);
            for (i, high) in tick_max.iter_mut().enumerate() {
                t.replica_memory_bytes[i].push(*high);
                *high = last.get(i).map_or(0, |r| r.memory_bytes);
            }
            let mut line = format!("  [{mode} {:>3}s] ok/429/err", at.round() as u64);
            for ((name, c), before) in classes.iter().zip(&mut rejected_before) {
                let l = &c.live;
                let rejected = l.rejected.load(Ordering::Relaxed);
                t.rejected
                    .entry(name.clone())
                    .or_default()
                    .push(rejected - *before);
                *before = rejected;
                line.push_str(&format!(
                    " {name} {}/{rejected}/{};",
                    l.ok.load(Ordering::Relaxed),
                    l.errors.load(Ordering::Relaxed)
                ));
            }
            let peaks: Vec<String> = peak_so_far.iter().map(|b| (b >> 20).to_string()).collect();
            let ooms: u64 = last.iter().map(|r| r.ooms).sum();
            line.push_str(&format!(" peak MiB [{}]", peaks.join(", ")));
            if limit > 0 {
                line.push_str(&format!(" of {}", limit >> 20));
            }
            line.push_str(&format!(", OOM kills {ooms}"));
            drop(t);
            if live {
                let width = std::env::var("COLUMNS")
                    .ok()
                    .and_then(|c| c.parse::<usize>().ok())
                    .unwrap_or(160);
                let shown: String = line.chars().take(width.saturating_sub(1)).collect();
                let mut err = std::io::stderr().lock();
                let _ = write!(err, "\r\x1b[2K{shown}");
                let _ = err.flush();
            } else if ticks.is_multiple_of(TICKS_PER_LINE) {
                eprintln!("{line}");
            }
        }
    })
}

/// Ends a live line (one rewritten in place) when dropped.
struct EndLine(bool);

impl Drop for EndLine {
    fn drop(&mut self) {
        if self.0 {
            eprintln!();
        }
    }
}

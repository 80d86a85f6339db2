//! A file of lines that rotates by size and keeps a bounded number of old files, so a log
//! cannot fill the volume it lives on (and get the pod evicted).
//!
//! Callers hand over whole lines; a thread of its own writes them, so the request path never
//! waits on the disk. The queue between them is bounded in bytes: a line that does not fit is
//! dropped and counted, never buffered without bound. The file rotates only between lines
//! (`path` → `path.1` → … → `path.N`, the oldest deleted), so no line is ever split across two
//! files, and every line taken is written once. [`LineFile::reopen`] serves external rotation
//! (logrotate moves the file, then sends SIGHUP): lines taken after it go to a new file at
//! `path`.
//!
//! On disk a log takes at most `maxSize × (maxFiles + 1)` bytes (a single line longer than
//! `maxSize` gets a file to itself).

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};

use prometheus::IntCounter;

use crate::metrics::Metrics;

/// How big a log may grow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Bytes per file: the file rotates before a line that would take it past this.
    pub max_size: u64,
    /// Rotated files kept beside the current one (`path.1` … `path.N`); 0 keeps none.
    pub max_files: u32,
    /// Bytes of lines waiting for the writer thread; lines beyond are dropped and counted.
    pub queue_bytes: usize,
}

impl Limits {
    /// The queue a log gets unless told otherwise: a few seconds of a busy access log.
    pub const DEFAULT_QUEUE_BYTES: usize = 8 * 1024 * 1024;

    /// `max_size` bytes per file, `max_files` old files, the default queue.
    pub fn new(max_size: u64, max_files: u32) -> Limits {
        Limits {
            max_size,
            max_files,
            queue_bytes: Self::DEFAULT_QUEUE_BYTES,
        }
    }
}

/// A size-rotated file of lines written by a thread of its own. Cheap to clone; the thread
/// ends (having written everything taken) when the last clone is dropped.
#[derive(Clone)]
pub struct LineFile {
    send: mpsc::Sender<Message>,
    queued: Arc<AtomicUsize>,
    queue_bytes: usize,
    dropped_queue_full: IntCounter,
}

enum Message {
    Line(Vec<u8>),
    Reopen,
    Flush(mpsc::SyncSender<()>),
}

impl LineFile {
    /// Opens (creating) `path` for appending and starts its writer thread. `name` labels
    /// the log in `bulwark_log_lines_dropped_total{log}` and names the thread. Fails only if
    /// the file cannot be opened.
    pub fn open(
        path: &Path,
        limits: Limits,
        name: &str,
        metrics: &Metrics,
    ) -> io::Result<LineFile> {
        let file = open_append(path)?;
        let size = file.metadata()?.len();
        let dropped = |reason| {
            metrics
                .log_lines_dropped_total
                .with_label_values(&[name, reason])
        };
        let writer = Writer {
            path: path.to_owned(),
            limits,
            file: Some(file),
            size,
            pending: Vec::new(),
            pending_lines: 0,
            failing: false,
            dropped_write_failed: dropped("write_failed"),
        };
        let (send, receive) = mpsc::channel();
        let queued = Arc::new(AtomicUsize::new(0));
        let taken = queued.clone();
        std::thread::Builder::new()
            .name(format!("log-{name}"))
            .spawn(move || writer.run(receive, &taken))?;
        Ok(LineFile {
            send,
            queued,
            queue_bytes: limits.queue_bytes,
            dropped_queue_full: dropped("queue_full"),
        })
    }

    /// Queues one line (a newline is added unless it ends with one; it must hold no other).
    /// Never blocks: when the queue is full the line is dropped, counted, and `false` is
    /// returned.
    pub fn write_line(&self, mut line: Vec<u8>) -> bool {
        if line.last() != Some(&b'\n') {
            line.push(b'\n');
        }
        let len = line.len();
        if self.queued.fetch_add(len, Ordering::AcqRel) + len > self.queue_bytes {
            self.queued.fetch_sub(len, Ordering::AcqRel);
            self.dropped_queue_full.inc();
            return false;
        }
        if self.send.send(Message::Line(line)).is_err() {
            // The writer thread is gone (it panicked): nothing will write this line.
            self.queued.fetch_sub(len, Ordering::AcqRel);
            self.dropped_queue_full.inc();
            return false;
        }
        true
    }

    /// Closes the file and opens `path` afresh, after the lines queued before this call are
    /// written: for external rotation, which moves the file away and then asks for this
    /// (SIGHUP). Never blocks.
    pub fn reopen(&self) {
        let _ = self.send.send(Message::Reopen);
    }

    /// Blocks until every line queued before this call is written to the file (not synced
    /// to the disk). Call from a thread that may block (`spawn_blocking` on a runtime).
    pub fn flush(&self) {
        let (done, wait) = mpsc::sync_channel(1);
        if self.send.send(Message::Flush(done)).is_ok() {
            let _ = wait.recv();
        }
    }
}

/// Lines are gathered into writes of about this many bytes while more are queued.
const BATCH_BYTES: usize = 64 * 1024;

/// The writer thread's side: the open file, its size and the lines not yet written.
struct Writer {
    path: PathBuf,
    limits: Limits,
    /// `None` after a failure to open; opening is tried again before the next write.
    file: Option<File>,
    /// Bytes in the current file.
    size: u64,
    /// Whole lines gathered for one write.
    pending: Vec<u8>,
    pending_lines: u64,
    /// Whether the last write failed (its error is logged once, not per line).
    failing: bool,
    dropped_write_failed: IntCounter,
}

impl Writer {
    fn run(mut self, receive: mpsc::Receiver<Message>, queued: &AtomicUsize) {
        // Block for the first message, then take whatever else is queued without blocking,
        // and write when the queue runs dry.
        while let Ok(first) = receive.recv() {
            let mut next = Some(first);
            while let Some(message) = next {
                match message {
                    Message::Line(line) => {
                        queued.fetch_sub(line.len(), Ordering::AcqRel);
                        self.push(&line);
                    }
                    Message::Reopen => {
                        self.write_pending();
                        self.reopen();
                    }
                    Message::Flush(done) => {
                        self.write_pending();
                        let _ = done.send(());
                    }
                }
                next = receive.try_recv().ok();
            }
            self.write_pending();
        }
        self.write_pending();
    }

    /// Adds a line, rotating first if it would take the file past `max_size`.
    fn push(&mut self, line: &[u8]) {
        let used = self.size + self.pending.len() as u64;
        if used > 0 && used + line.len() as u64 > self.limits.max_size {
            self.write_pending();
            self.rotate();
        }
        self.pending.extend_from_slice(line);
        self.pending_lines += 1;
        if self.pending.len() >= BATCH_BYTES {
            self.write_pending();
        }
    }

    /// Appends the gathered lines in one write. A failed write is cut back to the last
    /// whole line, and its lines are counted as dropped.
    fn write_pending(&mut self) {
        if self.pending.is_empty() {
            return;
        }
        if self.file.is_none() {
            self.reopen();
        }
        let result = match &mut self.file {
            Some(file) => file.write_all(&self.pending).inspect_err(|_| {
                // Part of the batch may be in the file: no torn line stays behind.
                let _ = file.set_len(self.size);
            }),
            None => Err(io::Error::other("not open")),
        };
        match result {
            Ok(()) => {
                self.size += self.pending.len() as u64;
                if self.failing {
                    self.failing = false;
                    tracing::info!(path = %self.path.display(), "writing the log again");
                }
            }
            Err(e) => {
                self.dropped_write_failed.inc_by(self.pending_lines);
                if !self.failing {
                    self.failing = true;
                    tracing::error!(path = %self.path.display(), error = %e,
                        "writing the log; its lines are dropped until a write succeeds");
                }
            }
        }
        self.pending.clear();
        self.pending_lines = 0;
    }

    /// `path.N` is deleted, `path.i` becomes `path.i+1`, `path` becomes `path.1`, and a new
    /// `path` is started.
    fn rotate(&mut self) {
        self.file = None;
        let numbered = |n: u32| {
            let mut name = self.path.clone().into_os_string();
            name.push(format!(".{n}"));
            PathBuf::from(name)
        };
        let result = if self.limits.max_files == 0 {
            std::fs::remove_file(&self.path)
        } else {
            ignore_missing(std::fs::remove_file(numbered(self.limits.max_files)))
                .and_then(|()| {
                    (1..self.limits.max_files).rev().try_for_each(|n| {
                        ignore_missing(std::fs::rename(numbered(n), numbered(n + 1)))
                    })
                })
                .and_then(|()| std::fs::rename(&self.path, numbered(1)))
        };
        if let Err(e) = ignore_missing(result) {
            tracing::error!(path = %self.path.display(), error = %e, "rotating the log");
        }
        self.reopen();
    }

    /// Opens `path` for appending, creating it; its size is what is already there.
    fn reopen(&mut self) {
        self.file = None;
        match open_append(&self.path).and_then(|f| Ok((f.metadata()?.len(), f))) {
            Ok((size, file)) => {
                self.size = size;
                self.file = Some(file);
            }
            Err(e) => {
                if !self.failing {
                    self.failing = true;
                    tracing::error!(path = %self.path.display(), error = %e, "opening the log");
                }
            }
        }
    }
}

fn open_append(path: &Path) -> io::Result<File> {
    OpenOptions::new().create(true).append(true).open(path)
}

fn ignore_missing(result: io::Result<()>) -> io::Result<()> {
    match result {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// Every `*.log*` file in `dir`, by name, with its contents.
    fn files(dir: &Path) -> BTreeMap<String, String> {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap())
            .map(|e| {
                let name = e.file_name().into_string().unwrap();
                (name, std::fs::read_to_string(e.path()).unwrap())
            })
            .collect()
    }

    fn line(n: usize) -> Vec<u8> {
        // Lines of varied length, so rotation points fall anywhere.
        format!("{{\"seq\":{n},\"pad\":\"{}\"}}", "x".repeat(n % 97)).into_bytes()
    }

    fn seq(line: &str) -> usize {
        let value: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("torn line ({e}): {line:?}"));
        let n = value["seq"].as_u64().unwrap() as usize;
        assert_eq!(value["pad"].as_str().unwrap().len(), n % 97, "torn line");
        n
    }

    #[test]
    fn past_the_limit_the_files_stay_bounded_and_every_line_is_written_once_whole() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.log");
        let metrics = Metrics::new();
        // About 2.4 MB of lines through 4 KiB files: some 600 rotations, all kept.
        let (max_size, max_files, lines) = (4096, 1000, 30_000);
        let log =
            LineFile::open(&path, Limits::new(max_size, max_files), "test", &metrics).unwrap();
        for n in 0..lines {
            assert!(log.write_line(line(n)), "line {n} dropped");
        }
        log.flush();

        let on_disk = files(dir.path());
        assert!(on_disk.len() > 500, "{} files", on_disk.len());
        assert!(on_disk.len() <= max_files as usize + 1);
        let mut seen = vec![0u32; lines];
        for (name, text) in &on_disk {
            assert!(
                text.len() as u64 <= max_size,
                "{name}: {} bytes",
                text.len()
            );
            assert!(
                text.is_empty() || text.ends_with('\n'),
                "{name} ends mid-line"
            );
            for l in text.lines() {
                seen[seq(l)] += 1;
            }
        }
        let wrong: Vec<_> = (0..lines).filter(|&n| seen[n] != 1).collect();
        assert!(
            wrong.is_empty(),
            "lines not written exactly once: {wrong:?}"
        );
        // The oldest lines are in the highest number, the newest in the file itself.
        let oldest = format!("audit.log.{}", on_disk.len() - 1);
        assert_eq!(seq(on_disk[&oldest].lines().next().unwrap()), 0);
        assert_eq!(seq(on_disk["audit.log"].lines().last().unwrap()), lines - 1);
    }

    #[test]
    fn only_max_files_old_files_are_kept_and_they_hold_the_newest_lines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("access.log");
        let metrics = Metrics::new();
        let (max_size, max_files, lines) = (2048, 3, 10_000);
        let log =
            LineFile::open(&path, Limits::new(max_size, max_files), "test", &metrics).unwrap();
        for n in 0..lines {
            assert!(log.write_line(line(n)));
        }
        log.flush();

        let on_disk = files(dir.path());
        let names: Vec<&str> = on_disk.keys().map(String::as_str).collect();
        assert_eq!(
            names,
            ["access.log", "access.log.1", "access.log.2", "access.log.3"]
        );
        // What remains is the tail of the sequence, oldest file first, with no gap.
        let mut kept = Vec::new();
        for name in ["access.log.3", "access.log.2", "access.log.1", "access.log"] {
            let text = &on_disk[name];
            assert!(text.len() as u64 <= max_size, "{name}");
            kept.extend(text.lines().map(seq));
        }
        let first = kept[0];
        assert_eq!(kept, (first..lines).collect::<Vec<_>>());
        // Each rotated file was full: the next line would not have fitted.
        for name in ["access.log.3", "access.log.2", "access.log.1"] {
            assert!(on_disk[name].len() as u64 > max_size - 200, "{name}");
        }
    }

    #[test]
    fn a_moved_file_is_let_go_on_reopen_and_new_lines_go_to_a_fresh_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let moved = dir.path().join("audit.jsonl-20260615");
        let metrics = Metrics::new();
        let log = LineFile::open(&path, Limits::new(1 << 20, 5), "test", &metrics).unwrap();
        log.write_line(b"before".to_vec());
        log.flush();
        // logrotate's move, then its SIGHUP.
        std::fs::rename(&path, &moved).unwrap();
        log.write_line(b"after the move, before the reopen".to_vec());
        log.reopen();
        log.write_line(b"after the reopen".to_vec());
        log.flush();

        assert_eq!(
            std::fs::read_to_string(&moved).unwrap(),
            "before\nafter the move, before the reopen\n"
        );
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "after the reopen\n"
        );
    }

    #[test]
    fn a_full_queue_drops_and_counts_instead_of_growing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let metrics = Metrics::new();
        let limits = Limits {
            queue_bytes: 100,
            ..Limits::new(1 << 20, 1)
        };
        let log = LineFile::open(&path, limits, "audit", &metrics).unwrap();
        // One line larger than the whole queue can never be taken.
        assert!(!log.write_line(vec![b'x'; 200]));
        assert!(log.write_line(b"fits".to_vec()));
        log.flush();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "fits\n");
        let dropped = metrics
            .log_lines_dropped_total
            .with_label_values(&["audit", "queue_full"])
            .get();
        assert_eq!(dropped, 1);
    }

    #[test]
    fn lines_already_in_the_file_count_toward_its_size() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        std::fs::write(&path, "x".repeat(90) + "\n").unwrap();
        let metrics = Metrics::new();
        let log = LineFile::open(&path, Limits::new(100, 2), "test", &metrics).unwrap();
        log.write_line(b"0123456789".to_vec());
        log.flush();
        let old = dir.path().join("audit.jsonl.1");
        assert_eq!(std::fs::read_to_string(&old).unwrap().len(), 91);
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "0123456789\n");
    }
}

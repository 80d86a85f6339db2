//! How fast the machine is right now: a fixed amount of CPU and memory work, timed.
//!
//! On a shared (virtual) machine the same work takes a different time from one minute to
//! the next: its cores' other hyperthreads, caches and memory bandwidth belong to other
//! tenants too. On the development machine this work took between 300 and 490 ms within
//! half a minute. `passthrough` runs it on the proxy's core just before each saturation
//! phase (`__calibrate`, a process of its own, pinned), so that a proxy's CPU time per
//! request can be read against how fast the core was at the time, and the swing of the
//! figures from one run to the next is seen for what it is.

use std::time::{Duration, Instant};

/// The work's memory: 8 MiB, larger than a core's own caches, as a proxy's connections,
/// buffers and allocator are.
const WORDS: usize = 1 << 20;
/// Random reads and writes over it.
const STEPS: u32 = 20_000_000;

/// Does the fixed work once and says how long it took.
pub fn run() -> Duration {
    let mut memory = vec![0u64; WORDS];
    // xorshift64: the same sequence of addresses every time.
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let started = Instant::now();
    for _ in 0..STEPS {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let i = (x as usize) & (WORDS - 1);
        memory[i] = memory[i].wrapping_add(x);
    }
    std::hint::black_box(&memory);
    started.elapsed()
}

/// `cpu_us` as it would have been on a core as fast as the fastest calibration, `fastest_ms`,
/// given that this one took `ms`.
pub fn at_speed(cpu_us: f64, ms: f64, fastest_ms: f64) -> f64 {
    if ms <= 0.0 {
        return cpu_us;
    }
    cpu_us * fastest_ms / ms
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_work_takes_time_and_slower_cores_scale_down() {
        assert!(run() > Duration::ZERO);
        assert_eq!(at_speed(30.0, 450.0, 300.0), 20.0);
        assert_eq!(at_speed(30.0, 300.0, 300.0), 30.0);
        assert_eq!(at_speed(30.0, 0.0, 300.0), 30.0);
    }
}

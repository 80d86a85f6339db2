//! How fast the machine is right now: a fixed amount of CPU and memory work, timed.
//!
//! On a shared (virtual) machine the same work takes a different time from one minute to
//! the next: its cores' other hyperthreads, caches and memory bandwidth belong to other
//! tenants too. On the development machine this work took between 300 and 490 ms within
//! half a minute, and between 52 and 187 ms on an idle core within ten seconds.
//! `passthrough` runs it on the proxy's core just before and just after each saturation
//! phase (`__calibrate`, a process of its own, pinned), so that the swing of the figures
//! from one run to the next is seen for what it is. Two samples of a tenth of a second
//! cannot correct a phase of several seconds: they show the machine's state, they do not
//! rescale the figures.

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

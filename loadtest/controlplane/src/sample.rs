//! What a scenario samples of the apiserver replicas it runs over, whoever runs them (the
//! simulator's fleet in this process, or the real control plane's processes in their
//! cgroups): each replica's memory and OOM kills, for progress lines and the report's
//! timeline.

use std::sync::Arc;

/// One replica as sampled now.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReplicaNow {
    /// Its memory now, bytes.
    pub memory_bytes: u64,
    /// The highest memory it has reached since it started, bytes (catches spikes between
    /// samples).
    pub peak_bytes: u64,
    /// Its OOM kills so far.
    pub ooms: u64,
}

/// Samples every replica.
pub type Sampler = Arc<dyn Fn() -> Vec<ReplicaNow> + Send + Sync>;

//! The per-replica memory model (accounting only): heap = base + live object bytes + 5x the
//! bytes each in-flight LIST reads, held while the LIST is served. Past the limit the
//! replica "OOMs".

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// How a replica's heap is modelled.
#[derive(Clone, Debug, PartialEq)]
pub struct HeapModel {
    /// Heap of an idle replica with an empty store.
    pub base_bytes: u64,
    /// The heap at which the replica OOMs (`None` = never).
    pub limit_bytes: Option<u64>,
    /// How long an OOMed replica refuses connections before it is back.
    pub restart: Duration,
}

impl Default for HeapModel {
    fn default() -> Self {
        HeapModel {
            base_bytes: 64 << 20,
            limit_bytes: None,
            restart: Duration::from_secs(2),
        }
    }
}

/// The temporary memory a LIST costs: this many times the bytes it reads.
pub const LIST_AMPLIFICATION: u64 = 5;

/// One replica's transient heap and its peak.
#[derive(Debug, Default)]
pub struct Heap {
    transient: AtomicU64,
    peak: AtomicU64,
}

/// Transient bytes held until dropped (attached to a response body).
#[derive(Debug)]
pub struct HeapGuard {
    heap: Arc<Heap>,
    bytes: u64,
}

impl Drop for HeapGuard {
    fn drop(&mut self) {
        self.heap.transient.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// The charge would push the heap past its limit.
#[derive(Debug, thiserror::Error)]
#[error("heap {would_be} bytes would exceed the limit {limit}")]
pub struct Oom {
    /// The heap the charge would have made.
    pub would_be: u64,
    /// The limit.
    pub limit: u64,
}

impl Heap {
    /// Current heap given the store's live bytes.
    pub fn current(&self, model: &HeapModel, live: u64) -> u64 {
        model.base_bytes + live + self.transient.load(Ordering::Acquire)
    }

    /// Peak heap seen so far.
    pub fn peak(&self) -> u64 {
        self.peak.load(Ordering::Acquire)
    }

    /// Records the current heap in the peak (for changes in live bytes).
    pub fn observe(&self, model: &HeapModel, live: u64) {
        self.peak
            .fetch_max(self.current(model, live), Ordering::AcqRel);
    }

    /// Charges `bytes` of transient heap, or reports an OOM (nothing is charged then).
    pub fn charge(
        self: &Arc<Self>,
        model: &HeapModel,
        live: u64,
        bytes: u64,
    ) -> Result<HeapGuard, Oom> {
        let before = self.transient.fetch_add(bytes, Ordering::AcqRel);
        let now = model.base_bytes + live + before + bytes;
        if let Some(limit) = model.limit_bytes
            && now > limit
        {
            self.transient.fetch_sub(bytes, Ordering::AcqRel);
            self.peak.fetch_max(now.min(limit), Ordering::AcqRel);
            return Err(Oom {
                would_be: now,
                limit,
            });
        }
        self.peak.fetch_max(now, Ordering::AcqRel);
        Ok(HeapGuard {
            heap: self.clone(),
            bytes,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charges_are_held_until_dropped_and_limit_is_enforced() {
        let m = HeapModel {
            base_bytes: 100,
            limit_bytes: Some(1000),
            restart: Duration::ZERO,
        };
        let h = Arc::new(Heap::default());
        let g = h.charge(&m, 50, 500).unwrap();
        assert_eq!(h.current(&m, 50), 650);
        assert!(h.charge(&m, 50, 400).is_err());
        assert_eq!(h.current(&m, 50), 650);
        drop(g);
        assert_eq!(h.current(&m, 50), 150);
        assert_eq!(h.peak(), 1000);
    }
}

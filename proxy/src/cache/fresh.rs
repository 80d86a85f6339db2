//! The freshness proof of consistent reads: a consistent `limit=1` LIST upstream gives the
//! apiserver's current version R; the cache may answer once it has reached R.
//!
//! Probes are shared like a group commit: a request joins the probe that has not been sent
//! yet, never one already in flight (that one may have read R before the request arrived,
//! and a write acknowledged in between would be missed). At most one probe per resource
//! runs at a time, and at most one more is queued behind it for everyone who came later.

use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;
use tokio::sync::watch;

/// Something that reads the apiserver's current version of a resource.
pub type Probe = Arc<dyn Fn() -> BoxFuture<'static, Result<u64, String>> + Send + Sync>;

#[derive(Default)]
struct State {
    /// Probes started so far; the running one, if any, has this number.
    started: u64,
    running: bool,
    /// The running probe has been sent: later arrivals need the next one.
    sent: bool,
    /// Someone arrived while a probe ran and needs the next one.
    wanted: bool,
}

/// The shared consistent-read probe of one resource.
pub struct Freshness {
    probe: Probe,
    state: Mutex<State>,
    results: watch::Sender<(u64, Result<u64, String>)>,
}

impl Freshness {
    /// A prober over `probe`.
    pub fn new(probe: Probe) -> Arc<Freshness> {
        Arc::new(Freshness {
            probe,
            state: Mutex::new(State::default()),
            results: watch::channel((0, Err(String::new()))).0,
        })
    }

    /// The apiserver's current version, from a probe sent after this call began.
    pub async fn current(self: &Arc<Self>) -> Result<u64, String> {
        let mut results = self.results.subscribe();
        let need = {
            let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
            if state.running && !state.sent {
                state.started
            } else if state.running {
                state.wanted = true;
                state.started + 1
            } else {
                state.running = true;
                state.sent = false;
                state.started += 1;
                let number = state.started;
                let this = self.clone();
                tokio::spawn(async move { this.run(number).await });
                number
            }
        };
        let answer = results
            .wait_for(|(number, _)| *number >= need)
            .await
            .map_err(|_| "the freshness probe stopped".to_owned())?;
        answer.1.clone()
    }

    async fn run(self: Arc<Self>, mut number: u64) {
        loop {
            self.state.lock().unwrap_or_else(|p| p.into_inner()).sent = true;
            let result = (self.probe)().await;
            let _previous = self.results.send_replace((number, result));
            let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
            if state.wanted {
                state.wanted = false;
                state.sent = false;
                state.started += 1;
                number = state.started;
            } else {
                state.running = false;
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::Duration;

    use futures::FutureExt;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn waiting_requests_share_a_probe_and_late_ones_get_the_next() {
        let calls = Arc::new(AtomicU64::new(0));
        let counter = calls.clone();
        let fresh = Freshness::new(Arc::new(move || {
            let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
            async move {
                tokio::time::sleep(Duration::from_millis(100)).await;
                Ok(n * 10)
            }
            .boxed()
        }));
        let first: Vec<_> = (0..5)
            .map(|_| {
                let f = fresh.clone();
                tokio::spawn(async move { f.current().await })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(50)).await;
        let late: Vec<_> = (0..5)
            .map(|_| {
                let f = fresh.clone();
                tokio::spawn(async move { f.current().await })
            })
            .collect();
        for task in first {
            assert_eq!(task.await.unwrap(), Ok(10));
        }
        for task in late {
            assert_eq!(task.await.unwrap(), Ok(20));
        }
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    }
}

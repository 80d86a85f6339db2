//! A keyed cache of answers that are costly to get: each is remembered for a while, and
//! concurrent lookups of one key share one fetch.
//!
//! Positive and negative answers are kept apart, each with its own lifetime and its own
//! bound (least recently used out first), so that a flood of negative answers cannot push
//! the positive ones out. A fetch that fails is remembered by neither: the next lookup
//! fetches again. The TokenReview cache ([`crate::identity::TokenCache`]) and the
//! SubjectAccessReview cache ([`crate::cache::authz::AccessCache`]) are two of these.

use std::collections::HashMap;
use std::hash::Hash;
use std::num::NonZeroUsize;
use std::sync::Mutex;
use std::time::Duration;

use futures::FutureExt;
use futures::future::{BoxFuture, Shared};
use tokio::time::Instant;

/// Where a fetched answer is remembered, and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Keep {
    /// Among the positive answers.
    Positive(Duration),
    /// Among the negative answers.
    Negative(Duration),
    /// Not at all (a failed fetch).
    Not,
}

/// How a lookup was answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup<V, E> {
    /// A remembered answer.
    Cached(V),
    /// A fetch, started by this lookup or shared with concurrent ones.
    Fetched {
        /// What the fetch returned.
        result: Result<V, E>,
        /// True for exactly one of the lookups that shared the fetch: the one that
        /// remembered its answer (and so is the one to count it).
        recorded: bool,
    },
}

type Pending<V, E> = Shared<BoxFuture<'static, Result<V, E>>>;

struct Entry<V> {
    value: V,
    expires: Instant,
}

struct State<K: Hash + Eq, V, E> {
    positive: lru::LruCache<K, Entry<V>>,
    negative: lru::LruCache<K, Entry<V>>,
    pending: HashMap<K, Pending<V, E>>,
}

/// The cache: keys `K`, answers `V`, fetch failures `E`.
pub struct Coalescing<K: Hash + Eq, V, E> {
    state: Mutex<State<K, V, E>>,
    /// The runtime fetches run on: the one the cache was made on. Lookups come from every
    /// worker thread's runtime, and a shared fetch must not live on one of them (its
    /// timers and connections would die with that worker, under the others' feet).
    home: Option<tokio::runtime::Handle>,
}

impl<K, V, E> Coalescing<K, V, E>
where
    K: Hash + Eq + Clone,
    V: Clone + Send + 'static,
    E: Clone + Send + 'static,
{
    /// A cache that keeps at most `positive` positive and `negative` negative answers (at
    /// least one each).
    pub fn new(positive: usize, negative: usize) -> Self {
        let bound = |n: usize| NonZeroUsize::new(n.max(1)).expect("at least one");
        Self {
            state: Mutex::new(State {
                positive: lru::LruCache::new(bound(positive)),
                negative: lru::LruCache::new(bound(negative)),
                pending: HashMap::new(),
            }),
            home: tokio::runtime::Handle::try_current().ok(),
        }
    }

    /// `fetch` as a task on the cache's runtime, where there is one.
    fn at_home(&self, fetch: BoxFuture<'static, Result<V, E>>) -> BoxFuture<'static, Result<V, E>> {
        let Some(home) = &self.home else {
            return fetch;
        };
        let task = home.spawn(fetch);
        async move {
            match task.await {
                Ok(result) => result,
                Err(failed) if failed.is_panic() => std::panic::resume_unwind(failed.into_panic()),
                // Cancelled: the home runtime is shutting down, and the process with it.
                Err(_) => std::future::pending().await,
            }
        }
        .boxed()
    }

    /// The answer for `key`: remembered, or from the fetch under way for it, or from a new
    /// fetch that `start` makes. `start` is called only when there is neither; it may
    /// refuse to fetch (its `Err` is returned and nothing is started). `keep` says where
    /// the answer of a fetch is remembered; it is called once per fetch.
    pub async fn get<X>(
        &self,
        key: K,
        start: impl FnOnce() -> Result<BoxFuture<'static, Result<V, E>>, X>,
        keep: impl FnOnce(&Result<V, E>) -> Keep,
    ) -> Result<Lookup<V, E>, X> {
        let pending = {
            let mut state = self.lock();
            if let Some(value) = state.remembered(&key, Instant::now()) {
                return Ok(Lookup::Cached(value));
            }
            match state.pending.get(&key) {
                Some(pending) => pending.clone(),
                None => {
                    let pending = self.at_home(start()?).shared();
                    state.pending.insert(key.clone(), pending.clone());
                    pending
                }
            }
        };
        let result = pending.await;
        let mut state = self.lock();
        // The first lookup back records the answer; the others find it gone.
        let recorded = state.pending.remove(&key).is_some();
        if recorded && let Ok(value) = &result {
            let kept = match keep(&result) {
                Keep::Positive(ttl) => Some((&mut state.positive, ttl)),
                Keep::Negative(ttl) => Some((&mut state.negative, ttl)),
                Keep::Not => None,
            };
            if let Some((cache, ttl)) = kept {
                let entry = Entry {
                    value: value.clone(),
                    expires: Instant::now() + ttl,
                };
                cache.put(key, entry);
            }
        }
        Ok(Lookup::Fetched { result, recorded })
    }

    /// Remembers an answer learnt other than by a fetch of this cache (a re-review made
    /// elsewhere), as `keep` says.
    pub fn remember(&self, key: K, value: V, keep: Keep) {
        let mut state = self.lock();
        let (cache, ttl) = match keep {
            Keep::Positive(ttl) => (&mut state.positive, ttl),
            Keep::Negative(ttl) => (&mut state.negative, ttl),
            Keep::Not => return,
        };
        let entry = Entry {
            value,
            expires: Instant::now() + ttl,
        };
        cache.put(key, entry);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State<K, V, E>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl<K: Hash + Eq, V: Clone, E> State<K, V, E> {
    /// The remembered answer for `key`, dropping it when it has expired.
    fn remembered(&mut self, key: &K, now: Instant) -> Option<V> {
        for cache in [&mut self.positive, &mut self.negative] {
            if let Some(entry) = cache.get(key) {
                if entry.expires > now {
                    return Some(entry.value.clone());
                }
                cache.pop(key);
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// Fetches count themselves and take 10 ms; a key starting with `-` is a negative
    /// answer, one starting with `!` a failure.
    struct Fetcher(Arc<AtomicUsize>);

    impl Fetcher {
        fn start(
            &self,
            key: &str,
        ) -> Result<BoxFuture<'static, Result<String, String>>, Infallible> {
            let (calls, key) = (self.0.clone(), key.to_owned());
            Ok(async move {
                calls.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(10)).await;
                if key.starts_with('!') {
                    Err(key)
                } else {
                    Ok(key)
                }
            }
            .boxed())
        }

        fn calls(&self) -> usize {
            self.0.load(Ordering::SeqCst)
        }
    }

    fn keep(result: &Result<String, String>) -> Keep {
        match result {
            Ok(v) if v.starts_with('-') => Keep::Negative(Duration::from_secs(2)),
            Ok(_) => Keep::Positive(Duration::from_secs(10)),
            Err(_) => Keep::Not,
        }
    }

    async fn get(
        cache: &Coalescing<String, String, String>,
        fetcher: &Fetcher,
        key: &str,
    ) -> Lookup<String, String> {
        let Ok(lookup) = cache.get(key.to_owned(), || fetcher.start(key), keep).await;
        lookup
    }

    #[tokio::test(start_paused = true)]
    async fn concurrent_lookups_share_one_fetch_and_one_records_it() {
        let (cache, fetcher) = (Coalescing::new(10, 10), Fetcher(Default::default()));
        let all = futures::future::join_all((0..10).map(|_| get(&cache, &fetcher, "a"))).await;
        assert_eq!(fetcher.calls(), 1);
        let recorded = all
            .iter()
            .filter(|l| matches!(l, Lookup::Fetched { recorded: true, .. }))
            .count();
        assert_eq!(recorded, 1);
        assert_eq!(
            get(&cache, &fetcher, "a").await,
            Lookup::Cached("a".to_owned())
        );
    }

    #[tokio::test(start_paused = true)]
    async fn answers_live_for_their_own_ttl_and_failures_not_at_all() {
        let (cache, fetcher) = (Coalescing::new(10, 10), Fetcher(Default::default()));
        for key in ["a", "-b", "!c"] {
            get(&cache, &fetcher, key).await;
        }
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(matches!(
            get(&cache, &fetcher, "a").await,
            Lookup::Cached(_)
        ));
        assert!(matches!(
            get(&cache, &fetcher, "-b").await,
            Lookup::Cached(_)
        ));
        assert!(matches!(
            get(&cache, &fetcher, "!c").await,
            Lookup::Fetched { .. }
        ));
        assert_eq!(fetcher.calls(), 4);
        tokio::time::advance(Duration::from_secs(2)).await;
        assert!(matches!(
            get(&cache, &fetcher, "a").await,
            Lookup::Cached(_)
        ));
        assert!(matches!(
            get(&cache, &fetcher, "-b").await,
            Lookup::Fetched { .. }
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn negative_answers_cannot_push_positive_ones_out() {
        let (cache, fetcher) = (Coalescing::new(2, 2), Fetcher(Default::default()));
        get(&cache, &fetcher, "a").await;
        for i in 0..10 {
            get(&cache, &fetcher, &format!("-{i}")).await;
        }
        assert!(matches!(
            get(&cache, &fetcher, "a").await,
            Lookup::Cached(_)
        ));
        // Each side is bounded: the oldest negative answers are gone.
        assert!(matches!(
            get(&cache, &fetcher, "-0").await,
            Lookup::Fetched { .. }
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn a_refused_start_fetches_nothing() {
        let cache: Coalescing<String, String, String> = Coalescing::new(1, 1);
        let refused = cache
            .get("a".to_owned(), || Err("not now"), |_| Keep::Not)
            .await;
        assert_eq!(refused, Err("not now"));
    }
}

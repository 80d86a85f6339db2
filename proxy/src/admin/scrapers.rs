//! Who may scrape `/metrics` when `admin.metricsAccess` is `authorized`: each decision is
//! remembered per user for `cache.accessReviewTtl` (as the cache remembers its readers'),
//! and calls are bounded per source address and per user, so that a flood of scrapes
//! with a token that may not read the metrics costs one SubjectAccessReview a TTL, not one
//! a call.

use std::net::IpAddr;
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use lru::LruCache;
use tokio::time::Instant;

use crate::identity::User;

/// Sources and users whose rate and decision are remembered; the least recently seen
/// beyond this start again.
const REMEMBERED: usize = 1024;

/// Scrapes a second from one source, or as one user, sustained: Prometheus scrapes every
/// 15 s or so, a pair of them twice that.
const PER_SECOND: u32 = 5;

/// Scrapes at once on a full bucket.
const BURST: u32 = 20;

/// A decision and when the authorizer made it: `Err` says why it denied.
type Remembered = (Instant, Result<(), String>);

/// The decisions and buckets of `/metrics` callers.
pub struct Scrapers {
    ttl: Duration,
    decisions: Mutex<LruCache<Arc<str>, Remembered>>,
    sources: Mutex<LruCache<IpAddr, DefaultDirectRateLimiter>>,
    users: Mutex<LruCache<Arc<str>, DefaultDirectRateLimiter>>,
}

/// Which bound refused a scrape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limited {
    /// The caller's address scraped too often.
    Source,
    /// The caller's user scraped too often.
    User,
}

impl Scrapers {
    /// Decisions remembered for `ttl`.
    pub fn new(ttl: Duration) -> Scrapers {
        let remembered = std::num::NonZeroUsize::new(REMEMBERED).expect("non-zero");
        Scrapers {
            ttl,
            decisions: Mutex::new(LruCache::new(remembered)),
            sources: Mutex::new(LruCache::new(remembered)),
            users: Mutex::new(LruCache::new(remembered)),
        }
    }

    /// Takes a scrape from `source`'s bucket (an IPv6 source by its /64).
    pub fn allow_source(&self, source: IpAddr) -> Result<(), Limited> {
        take(&self.sources, crate::net::source_of(source)).map_err(|()| Limited::Source)
    }

    /// Takes a scrape from `user`'s bucket.
    pub fn allow_user(&self, user: &User) -> Result<(), Limited> {
        take(&self.users, Arc::from(user.username.as_str())).map_err(|()| Limited::User)
    }

    /// The decision for `user` made less than a TTL ago: `Err` says why it was denied.
    pub fn remembered(&self, user: &User) -> Option<Result<(), String>> {
        let mut decisions = self.decisions.lock().unwrap_or_else(|p| p.into_inner());
        let (at, decision) = decisions.get(&key(user))?;
        (at.elapsed() < self.ttl).then(|| decision.clone())
    }

    /// Remembers the authorizer's decision for `user`.
    pub fn remember(&self, user: &User, decision: Result<(), String>) {
        self.decisions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .put(key(user), (Instant::now(), decision));
    }
}

/// A user as the authorizer sees it: name and groups.
fn key(user: &User) -> Arc<str> {
    let mut key = user.username.clone();
    for group in &user.groups {
        key.push('\0');
        key.push_str(group);
    }
    Arc::from(key)
}

fn take<K: std::hash::Hash + Eq>(
    buckets: &Mutex<LruCache<K, DefaultDirectRateLimiter>>,
    key: K,
) -> Result<(), ()> {
    let mut buckets = buckets.lock().unwrap_or_else(|p| p.into_inner());
    let bucket = buckets.get_or_insert(key, || {
        RateLimiter::direct(
            Quota::per_second(NonZeroU32::new(PER_SECOND).expect("non-zero"))
                .allow_burst(NonZeroU32::new(BURST).expect("non-zero")),
        )
    });
    bucket.check().map_err(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn user(name: &str, groups: &[&str]) -> User {
        User {
            username: name.into(),
            groups: groups.iter().map(|g| g.to_string()).collect(),
            ..User::default()
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_decision_is_remembered_per_user_for_its_ttl() {
        let scrapers = Scrapers::new(Duration::from_secs(10));
        let tina = user("tina", &["ops"]);
        assert_eq!(scrapers.remembered(&tina), None);
        scrapers.remember(&tina, Err("no".into()));
        assert_eq!(scrapers.remembered(&tina), Some(Err("no".into())));
        assert_eq!(
            scrapers.remembered(&user("tina", &["ops", "admins"])),
            None,
            "other groups, another decision"
        );
        tokio::time::advance(Duration::from_secs(11)).await;
        assert_eq!(scrapers.remembered(&tina), None);
    }

    #[test]
    fn a_source_and_a_user_are_bounded_apart() {
        let scrapers = Scrapers::new(Duration::from_secs(10));
        let a: IpAddr = "192.0.2.1".parse().unwrap();
        for _ in 0..BURST {
            scrapers.allow_source(a).unwrap();
        }
        assert_eq!(scrapers.allow_source(a), Err(Limited::Source));
        assert!(scrapers.allow_source("192.0.2.2".parse().unwrap()).is_ok());
        let tina = user("tina", &[]);
        for _ in 0..BURST {
            scrapers.allow_user(&tina).unwrap();
        }
        assert_eq!(scrapers.allow_user(&tina), Err(Limited::User));
        assert!(scrapers.allow_user(&user("carol", &[])).is_ok());
    }
}

//! Bearer tokens resolved by TokenReview, cached by the token's hash and coalesced.
//!
//! An accepted token is trusted for min(ttl, the token's own expiry). A request that comes
//! in the last `refreshAhead` of that starts the token's re-review in the background and is
//! answered at once, so a token in use never waits for a review; a request after the ttl
//! waits for the re-review. Re-reviews have a budget and in-flight slots of their own
//! ([`ReviewLimits::take_refresh`]), which unknown tokens cannot spend. A re-review that
//! rejects the token ends it at once; one without an answer leaves the token served as it
//! was until `maxAge` after the review that last accepted it (never past its own expiry),
//! and after that the token is unknown again.
//!
//! A rejected token is remembered for `failure_ttl` in a smaller cache of its own, so that
//! a client retrying a bad token cannot flood the apiserver with reviews and a flood of bad
//! tokens cannot push good ones out. A review that could not be made is not remembered: the
//! request is refused (never passed on) and the next one tries again. Concurrent requests
//! with the same token share one review. A token in neither cache needs a review, and
//! reviews are bounded per client prefix, overall and in flight ([`ReviewLimits`]): over a
//! bound, the request gets [`IdentityError::ReviewLimited`] (429 with `Retry-After`) and no
//! review is made.

use std::net::IpAddr;
use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine;
use futures::FutureExt;
use futures::future::{BoxFuture, Shared};
use lru::LruCache;
use sha2::{Digest, Sha256};
use tokio::time::Instant;

use super::limits::{Limited, ReviewLimits};
use super::{IdentityError, User};
use crate::coalesce::{Coalescing, Keep, Lookup};
use crate::config;
use crate::metrics::Metrics;
use crate::own;
pub use crate::own::ReviewError;

/// What a TokenReview said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReviewOutcome {
    /// The token belongs to this user.
    Authenticated(User),
    /// The token is not valid; the message is the review's error, if any.
    Rejected(String),
}

/// Something that can review a token: the apiserver through the upstream pool, or a test
/// double.
pub trait TokenReviewer: Send + Sync + 'static {
    /// Reviews one token. An `Err` means no answer could be had.
    fn review(&self, token: &str) -> BoxFuture<'static, Result<ReviewOutcome, ReviewError>>;
}

type Key = [u8; 32];

/// Why a shared review has no outcome.
#[derive(Debug, Clone)]
enum NoOutcome {
    /// No slot among the reviews in flight came free in time; nothing was sent.
    Limited(Limited),
    /// The review was sent and no answer could be had.
    Failed(Arc<ReviewError>),
}

/// What a re-review of an accepted token came to.
#[derive(Debug, Clone)]
enum Refreshed {
    /// The review said yes again.
    Accepted(Arc<User>),
    /// The review said no: the token is refused from now on.
    Rejected(String),
    /// No answer, or no slot to ask in: the token is served as it was, within `maxAge`.
    NoAnswer,
}

type Refresh = Shared<BoxFuture<'static, Refreshed>>;

/// An accepted token, and when it is to be reviewed again.
struct Known {
    user: Arc<User>,
    /// From here, a request starts the token's re-review in the background.
    refresh_from: Instant,
    /// Until here, the review that accepted it is trusted as it is.
    fresh_until: Instant,
    /// After `fresh_until` and until here, it is served while its re-reviews have no
    /// answer.
    hard_until: Instant,
    /// The re-review under way.
    refresh: Option<Refresh>,
    /// Whether the last re-review had no answer.
    failed: bool,
}

impl Known {
    /// A token accepted now for `user`, under the configured lifetimes and its own expiry.
    fn accepted(settings: &config::TokenReview, token: &str, user: Arc<User>) -> Known {
        let now = Instant::now();
        let left = token_lifetime(token);
        let (fresh, refresh, hard) = match left {
            // The token ends before the ttl: nothing to re-review it for.
            Some(left) if left <= settings.ttl => (left, left, left),
            _ => {
                let ahead = settings.refresh_ahead.min(settings.ttl / 2);
                let hard = left.map_or(settings.max_age, |left| left.min(settings.max_age));
                (settings.ttl, settings.ttl - ahead, hard.max(settings.ttl))
            }
        };
        Known {
            user,
            refresh_from: now + refresh,
            fresh_until: now + fresh,
            hard_until: now + hard,
            refresh: None,
            failed: false,
        }
    }
}

/// What a request with an accepted token does.
enum Step {
    /// It is answered with this user now; until the time given, so is every request with
    /// the token (its re-review is not due before).
    Serve(Arc<User>, Option<Instant>),
    /// It waits for the re-review, and is answered with this user if that has no answer.
    Await(Refresh, Arc<User>),
}

/// The last token a connection presented and the user it was accepted for. The
/// connection's next requests with the same token are answered from here, without the
/// cache's hash and its lock shared by every worker, until the cache would start the
/// token's re-review; a request then goes through the cache again. One per connection.
#[derive(Default)]
pub struct TokenMemo(Mutex<Option<Remembered>>);

/// Never shows the token.
impl std::fmt::Debug for TokenMemo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let memo = self.0.lock().unwrap_or_else(|p| p.into_inner());
        f.debug_struct("TokenMemo")
            .field("user", &memo.as_ref().map(|m| &m.user.username))
            .field("until", &memo.as_ref().map(|m| m.until))
            .finish()
    }
}

struct Remembered {
    token: Box<str>,
    user: Arc<User>,
    until: Instant,
}

impl TokenMemo {
    /// The user `token` was accepted for, if it is the token remembered and `now` is
    /// before its re-review is due.
    fn recall(&self, token: &str, now: Instant) -> Option<Arc<User>> {
        let memo = self.0.lock().unwrap_or_else(|p| p.into_inner());
        memo.as_ref()
            .filter(|m| now < m.until && *m.token == *token)
            .map(|m| m.user.clone())
    }

    /// Remembers `token` as `user`'s until `until`, in place of any other.
    fn remember(&self, token: &str, user: Arc<User>, until: Instant) {
        let mut memo = self.0.lock().unwrap_or_else(|p| p.into_inner());
        match memo.as_mut() {
            Some(m) if *m.token == *token => {
                m.user = user;
                m.until = until;
            }
            _ => {
                *memo = Some(Remembered {
                    token: token.into(),
                    user,
                    until,
                })
            }
        }
    }
}

type KnownTokens = Arc<Mutex<LruCache<Key, Known>>>;
type Outcomes = Arc<Coalescing<Key, ReviewOutcome, NoOutcome>>;

/// The TokenReview cache in front of a [`TokenReviewer`].
pub struct TokenCache {
    reviewer: Arc<dyn TokenReviewer>,
    settings: config::TokenReview,
    limits: Arc<ReviewLimits>,
    /// Accepted tokens, with their re-reviews.
    known: KnownTokens,
    /// Rejected tokens, and the reviews of unknown tokens under way (accepted ones go to
    /// `known`, so its positive side stays empty).
    outcomes: Outcomes,
    metrics: Metrics,
    /// `bulwark_authz_reviews_total{kind="token",result="cached"}`, which nearly every
    /// request counts.
    cached: prometheus::IntCounter,
    /// Where background refreshes run: the runtime the cache was made on, not a worker
    /// thread's (see [`Coalescing`]).
    home: Option<tokio::runtime::Handle>,
}

impl TokenCache {
    /// The bounds on reviews, for saving and loading the prefixes they trust.
    pub fn review_limits(&self) -> &Arc<ReviewLimits> {
        &self.limits
    }

    /// A cache with the configured lifetimes, bounds and review limits.
    pub fn new(
        reviewer: Arc<dyn TokenReviewer>,
        settings: config::TokenReview,
        metrics: Metrics,
    ) -> Self {
        let entries = NonZeroUsize::new(settings.max_entries.max(1)).expect("at least 1");
        Self {
            reviewer,
            limits: Arc::new(ReviewLimits::new(&settings)),
            known: Arc::new(Mutex::new(LruCache::new(entries))),
            outcomes: Arc::new(Coalescing::new(1, settings.max_rejected_entries)),
            settings,
            cached: metrics
                .authz_reviews_total
                .with_label_values(&["token", "cached"]),
            metrics,
            home: tokio::runtime::Handle::try_current().ok(),
        }
    }

    /// The user a token belongs to, from the cache or a (shared) review. `source` is the
    /// client's address, whose review rate is bounded.
    pub async fn authenticate(
        &self,
        token: &str,
        source: Option<IpAddr>,
    ) -> Result<Arc<User>, IdentityError> {
        self.authenticate_on(token, source, None).await
    }

    /// [`TokenCache::authenticate`] for a request on a connection that remembers its last
    /// token in `memo`.
    pub async fn authenticate_on(
        &self,
        token: &str,
        source: Option<IpAddr>,
        memo: Option<&TokenMemo>,
    ) -> Result<Arc<User>, IdentityError> {
        if token.len() > self.settings.max_token_bytes {
            return Err(IdentityError::TokenTooLong(self.settings.max_token_bytes));
        }
        let now = Instant::now();
        if let Some(user) = memo.and_then(|memo| memo.recall(token, now)) {
            self.cached.inc();
            return Ok(user);
        }
        let key: Key = Sha256::digest(token.as_bytes()).into();
        match self.known_step(key, token, now) {
            Some(Step::Serve(user, until)) => {
                if let (Some(memo), Some(until)) = (memo, until) {
                    memo.remember(token, user.clone(), until);
                }
                self.cached.inc();
                return Ok(user);
            }
            Some(Step::Await(refresh, user)) => {
                return match refresh.await {
                    Refreshed::Accepted(user) => Ok(user),
                    Refreshed::Rejected(why) => Err(IdentityError::TokenRejected(why)),
                    Refreshed::NoAnswer => Ok(user),
                };
            }
            None => {}
        }
        let start = || -> Result<_, Limited> {
            self.limits.take(source)?;
            Ok(self.review(key, token))
        };
        let keep = |result: &Result<ReviewOutcome, NoOutcome>| match result {
            Ok(ReviewOutcome::Rejected(_)) => Keep::Negative(self.settings.failure_ttl),
            // An accepted token went to `known` with its review.
            Ok(ReviewOutcome::Authenticated(_)) | Err(_) => Keep::Not,
        };
        let result = match self.outcomes.get(key, start, keep).await {
            Err(limited) => {
                self.count("limited");
                return Err(IdentityError::ReviewLimited(limited));
            }
            Ok(Lookup::Cached(outcome)) => {
                self.cached.inc();
                return into_result(outcome);
            }
            Ok(Lookup::Fetched { result, recorded }) => {
                if recorded {
                    self.count(match &result {
                        Ok(ReviewOutcome::Authenticated(_)) => "allowed",
                        Ok(ReviewOutcome::Rejected(_)) => "denied",
                        Err(NoOutcome::Limited(_)) => "limited",
                        Err(NoOutcome::Failed(_)) => "error",
                    });
                }
                result
            }
        };
        if let (Ok(ReviewOutcome::Authenticated(_)), Some(source)) = (&result, source) {
            // Its prefix is trusted for new tokens' reviews from now on.
            self.limits.accepted(source);
        }
        match result {
            Ok(outcome) => into_result(outcome),
            Err(NoOutcome::Limited(limited)) => Err(IdentityError::ReviewLimited(limited)),
            Err(NoOutcome::Failed(why)) => Err(IdentityError::ReviewFailed(why)),
        }
    }

    /// What a request does with a token accepted before, starting its re-review when due;
    /// `None` for a token not (or no longer) accepted.
    fn known_step(&self, key: Key, token: &str, now: Instant) -> Option<Step> {
        let mut known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        let entry = known.get_mut(&key)?;
        if now >= entry.hard_until {
            known.pop(&key);
            return None;
        }
        let user = entry.user.clone();
        if now < entry.fresh_until {
            if now < entry.refresh_from {
                return Some(Step::Serve(user, Some(entry.refresh_from)));
            }
            if entry.refresh.is_none() {
                entry.refresh = self.start_refresh(key, token);
            }
            return Some(Step::Serve(user, None));
        }
        // Past the ttl: wait for a re-review, unless the last one had no answer (then
        // another is tried in the background) or none may be made now.
        if entry.refresh.is_none() {
            entry.refresh = self.start_refresh(key, token);
        }
        match &entry.refresh {
            Some(refresh) if !entry.failed => Some(Step::Await(refresh.clone(), user)),
            _ => Some(Step::Serve(user, None)),
        }
    }

    /// Starts a re-review of an accepted token, driven by a task of its own so that it
    /// finishes whether or not anyone waits for it; `None` when the re-review budget is
    /// spent.
    fn start_refresh(&self, key: Key, token: &str) -> Option<Refresh> {
        if self.limits.take_refresh().is_err() {
            self.count("limited");
            return None;
        }
        let (reviewer, limits, known, outcomes, settings, metrics) = (
            self.reviewer.clone(),
            self.limits.clone(),
            self.known.clone(),
            self.outcomes.clone(),
            self.settings.clone(),
            self.metrics.clone(),
        );
        let token = token.to_owned();
        let work = async move {
            let answer = match limits.refresh_slot().await {
                Ok(_slot) => reviewer.review(&token).await.map_err(|_| "error"),
                Err(_) => Err("limited"),
            };
            let (result, refreshed) = match answer {
                Ok(ReviewOutcome::Authenticated(user)) => {
                    ("allowed", Refreshed::Accepted(Arc::new(user)))
                }
                Ok(ReviewOutcome::Rejected(why)) => ("denied", Refreshed::Rejected(why)),
                Err(result) => (result, Refreshed::NoAnswer),
            };
            metrics
                .authz_reviews_total
                .with_label_values(&["token", result])
                .inc();
            let mut tokens = known.lock().unwrap_or_else(|p| p.into_inner());
            match &refreshed {
                Refreshed::Accepted(user) => {
                    tokens.put(key, Known::accepted(&settings, &token, user.clone()));
                }
                Refreshed::Rejected(why) => {
                    tokens.pop(&key);
                    drop(tokens);
                    let rejected = ReviewOutcome::Rejected(why.clone());
                    outcomes.remember(key, rejected, Keep::Negative(settings.failure_ttl));
                }
                Refreshed::NoAnswer => {
                    if let Some(entry) = tokens.peek_mut(&key) {
                        entry.refresh = None;
                        entry.failed = true;
                    }
                }
            }
            refreshed
        };
        // Runs on the cache's own runtime; waiters on any worker's only wait for its end.
        let task = match &self.home {
            Some(home) => home.spawn(work),
            None => tokio::spawn(work),
        };
        let refresh = async move { task.await.unwrap_or(Refreshed::NoAnswer) }
            .boxed()
            .shared();
        Some(refresh)
    }

    /// One review of an unknown token, sent once a slot among the reviews in flight is
    /// free; an accepted token goes to `known` before the review's waiters hear of it.
    fn review(
        &self,
        key: Key,
        token: &str,
    ) -> BoxFuture<'static, Result<ReviewOutcome, NoOutcome>> {
        let (reviewer, limits, known, settings, token) = (
            self.reviewer.clone(),
            self.limits.clone(),
            self.known.clone(),
            self.settings.clone(),
            token.to_owned(),
        );
        async move {
            let _slot = limits.slot().await.map_err(NoOutcome::Limited)?;
            let outcome = reviewer
                .review(&token)
                .await
                .map_err(|e| NoOutcome::Failed(Arc::new(e)))?;
            if let ReviewOutcome::Authenticated(user) = &outcome {
                let accepted = Known::accepted(&settings, &token, Arc::new(user.clone()));
                known
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .put(key, accepted);
            }
            Ok(outcome)
        }
        .boxed()
    }

    fn count(&self, result: &str) {
        self.metrics
            .authz_reviews_total
            .with_label_values(&["token", result])
            .inc();
    }
}

fn into_result(outcome: ReviewOutcome) -> Result<Arc<User>, IdentityError> {
    match outcome {
        ReviewOutcome::Authenticated(user) => Ok(Arc::new(user)),
        ReviewOutcome::Rejected(why) => Err(IdentityError::TokenRejected(why)),
    }
}

/// Time left until a JWT's `exp`, read without verifying (the review did that); `None` for
/// tokens that are not JWTs or carry no expiry.
fn token_lifetime(token: &str) -> Option<Duration> {
    let payload = token.split('.').nth(1)?;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .ok()?;
    let claims: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
    let exp = claims.get("exp")?.as_u64()?;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .ok()?
        .as_secs();
    Some(Duration::from_secs(exp.saturating_sub(now)))
}

/// Reviews tokens with `POST /apis/authentication.k8s.io/v1/tokenreviews`, one of
/// Bulwark's own calls.
pub struct UpstreamReviewer {
    client: own::Client,
}

impl UpstreamReviewer {
    /// A reviewer through Bulwark's own client.
    pub fn new(client: own::Client) -> Self {
        Self { client }
    }
}

impl TokenReviewer for UpstreamReviewer {
    fn review(&self, token: &str) -> BoxFuture<'static, Result<ReviewOutcome, ReviewError>> {
        let client = self.client.clone();
        let body = serde_json::json!({
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": {"token": token},
        });
        async move {
            let review = client
                .review("/apis/authentication.k8s.io/v1/tokenreviews", &body)
                .await?;
            let status = &review["status"];
            if status["authenticated"].as_bool() != Some(true) {
                let why = status["error"].as_str().unwrap_or("not authenticated");
                return Ok(ReviewOutcome::Rejected(why.to_string()));
            }
            let user: User =
                serde_json::from_value(status["user"].clone()).map_err(ReviewError::User)?;
            if user.username.is_empty() {
                return Ok(ReviewOutcome::Rejected("empty user name".into()));
            }
            Ok(ReviewOutcome::Authenticated(
                user.with_authenticated_group(),
            ))
        }
        .boxed()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    use super::*;

    /// Reviews by the token's first word: `good…` is alice (until `revoked`), `fail…` gets
    /// no answer, anything else is rejected; while `down`, nothing gets an answer. Counts
    /// the reviews made and the most at once.
    struct Counting {
        calls: AtomicUsize,
        in_flight: AtomicUsize,
        most_in_flight: AtomicUsize,
        delay: Duration,
        revoked: AtomicBool,
        down: AtomicBool,
    }

    impl TokenReviewer for Arc<Counting> {
        fn review(&self, token: &str) -> BoxFuture<'static, Result<ReviewOutcome, ReviewError>> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            let answer = if self.down.load(Ordering::SeqCst) {
                Err(ReviewError::NoStatus)
            } else if token.starts_with("good") && self.revoked.load(Ordering::SeqCst) {
                Ok(ReviewOutcome::Rejected("revoked".into()))
            } else if token.starts_with("good") {
                Ok(ReviewOutcome::Authenticated(alice()))
            } else if token.starts_with("fail") {
                Err(ReviewError::NoStatus)
            } else {
                Ok(ReviewOutcome::Rejected("expired".into()))
            };
            let this = self.clone();
            async move {
                let now = this.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                this.most_in_flight.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(this.delay).await;
                this.in_flight.fetch_sub(1, Ordering::SeqCst);
                answer
            }
            .boxed()
        }
    }

    impl Counting {
        fn calls(&self) -> usize {
            self.calls.load(Ordering::SeqCst)
        }
    }

    fn alice() -> User {
        User {
            username: "alice".into(),
            groups: vec!["dev".into()],
            ..User::default()
        }
    }

    fn cache_with(tweak: impl FnOnce(&mut config::TokenReview)) -> (Arc<Counting>, TokenCache) {
        let reviewer = Arc::new(Counting {
            calls: AtomicUsize::new(0),
            in_flight: AtomicUsize::new(0),
            most_in_flight: AtomicUsize::new(0),
            delay: Duration::from_millis(50),
            revoked: AtomicBool::new(false),
            down: AtomicBool::new(false),
        });
        let mut settings = config::TokenReview::default();
        tweak(&mut settings);
        let cache = TokenCache::new(Arc::new(reviewer.clone()), settings, Metrics::new());
        (reviewer, cache)
    }

    fn cache() -> (Arc<Counting>, TokenCache) {
        cache_with(|_| {})
    }

    const HERE: Option<IpAddr> = Some(IpAddr::V4(std::net::Ipv4Addr::LOCALHOST));

    #[tokio::test(start_paused = true)]
    async fn a_connection_remembers_its_token_until_its_re_review_is_due() {
        let (reviewer, cache) = cache();
        let memo = TokenMemo::default();
        let on = |token| cache.authenticate_on(token, HERE, Some(&memo));
        assert_eq!(on("good").await.unwrap().username, "alice");
        // Remembered from the second request, which found it in the cache.
        on("good").await.unwrap();
        tokio::time::advance(Duration::from_secs(6)).await;
        assert_eq!(on("good").await.unwrap().username, "alice");
        assert_eq!(reviewer.calls(), 1);
        // Due for its re-review: the connection's request starts it, as any other would.
        tokio::time::advance(Duration::from_secs(2)).await;
        on("good").await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(reviewer.calls(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_remembered_token_answers_for_no_other() {
        let (_, cache) = cache();
        let memo = TokenMemo::default();
        cache
            .authenticate_on("good", HERE, Some(&memo))
            .await
            .unwrap();
        cache
            .authenticate_on("good", HERE, Some(&memo))
            .await
            .unwrap();
        let other = cache.authenticate_on("bad", HERE, Some(&memo)).await;
        assert!(
            matches!(&other, Err(IdentityError::TokenRejected(why)) if why == "expired"),
            "{other:?}"
        );
        let longer = cache.authenticate_on("goodbye", HERE, Some(&memo)).await;
        assert_eq!(
            longer.unwrap().username,
            "alice",
            "reviewed as its own token"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_idle_token_is_cached_for_the_ttl_then_reviewed_again() {
        let (reviewer, cache) = cache();
        assert_eq!(
            cache.authenticate("good", HERE).await.unwrap().username,
            "alice"
        );
        tokio::time::advance(Duration::from_secs(6)).await;
        cache.authenticate("good", HERE).await.unwrap();
        assert_eq!(reviewer.calls(), 1);
        tokio::time::advance(Duration::from_secs(5)).await;
        let started = Instant::now();
        cache.authenticate("good", HERE).await.unwrap();
        assert_eq!(reviewer.calls(), 2);
        assert_eq!(started.elapsed(), Duration::from_millis(50), "it waited");
    }

    /// Unknown tokens from up to 50 prefixes until the global bucket refuses one.
    async fn flood(cache: &TokenCache) {
        for i in 0..50u8 {
            let source = Some(IpAddr::from([10, 1, i, 1]));
            if let Err(IdentityError::ReviewLimited(limited)) =
                cache.authenticate(&format!("bad-{i}"), source).await
            {
                assert_eq!(limited.bound, super::super::limits::Bound::Global);
                return;
            }
        }
        panic!("the flood never emptied the global bucket");
    }

    fn small_global(s: &mut config::TokenReview) {
        s.rate = config::ReviewRate { qps: 0.1, burst: 5 };
    }

    #[tokio::test(start_paused = true)]
    async fn a_token_in_use_is_re_reviewed_in_the_background_during_a_flood() {
        let (reviewer, cache) = cache_with(small_global);
        cache.authenticate("good", HERE).await.unwrap();
        tokio::time::advance(Duration::from_secs(8)).await;
        flood(&cache).await;
        let calls = reviewer.calls();
        // Due for its re-review: answered at once, reviewed behind it.
        let started = Instant::now();
        assert_eq!(
            cache.authenticate("good", HERE).await.unwrap().username,
            "alice"
        );
        assert_eq!(started.elapsed(), Duration::ZERO);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(reviewer.calls(), calls + 1);
        // Past the ttl of its first review, the re-review is what it is trusted on.
        tokio::time::advance(Duration::from_secs(4)).await;
        flood(&cache).await;
        let calls = reviewer.calls();
        cache.authenticate("good", HERE).await.unwrap();
        assert_eq!(reviewer.calls(), calls);
    }

    #[tokio::test(start_paused = true)]
    async fn an_idle_token_past_its_ttl_is_re_reviewed_on_a_budget_the_flood_cannot_spend() {
        let (reviewer, cache) = cache_with(small_global);
        cache.authenticate("good", HERE).await.unwrap();
        tokio::time::advance(Duration::from_secs(11)).await;
        flood(&cache).await;
        let calls = reviewer.calls();
        assert_eq!(
            cache.authenticate("good", HERE).await.unwrap().username,
            "alice"
        );
        assert_eq!(reviewer.calls(), calls + 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_token_its_re_review_rejects_is_refused_from_then_on() {
        let (reviewer, cache) = cache();
        cache.authenticate("good", HERE).await.unwrap();
        reviewer.revoked.store(true, Ordering::SeqCst);
        tokio::time::advance(Duration::from_secs(8)).await;
        // The request that starts the re-review is answered from before it.
        cache.authenticate("good", HERE).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        let answer = cache.authenticate("good", HERE).await;
        assert!(
            matches!(&answer, Err(IdentityError::TokenRejected(why)) if why == "revoked"),
            "{answer:?}"
        );
        // Remembered as rejected: no review for each retry.
        assert_eq!(reviewer.calls(), 2);
        assert!(cache.authenticate("good", HERE).await.is_err());
        assert_eq!(reviewer.calls(), 2);

        // A token idle past its ttl waits for its re-review, and hears no.
        let (reviewer, cache) = cache_with(|_| {});
        cache.authenticate("good-2", HERE).await.unwrap();
        reviewer.revoked.store(true, Ordering::SeqCst);
        tokio::time::advance(Duration::from_secs(11)).await;
        assert!(matches!(
            cache.authenticate("good-2", HERE).await,
            Err(IdentityError::TokenRejected(_))
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn a_token_whose_re_reviews_get_no_answer_is_served_until_max_age() {
        let (reviewer, cache) = cache_with(|s| s.max_age = Duration::from_secs(30));
        cache.authenticate("good", HERE).await.unwrap();
        reviewer.down.store(true, Ordering::SeqCst);
        tokio::time::advance(Duration::from_secs(11)).await;
        assert_eq!(
            cache.authenticate("good", HERE).await.unwrap().username,
            "alice"
        );
        assert_eq!(reviewer.calls(), 2);
        // The last re-review failed: served at once while another is tried.
        tokio::time::advance(Duration::from_secs(18)).await;
        let started = Instant::now();
        cache.authenticate("good", HERE).await.unwrap();
        assert_eq!(started.elapsed(), Duration::ZERO);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(reviewer.calls(), 3);
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(matches!(
            cache.authenticate("good", HERE).await,
            Err(IdentityError::ReviewFailed(_))
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn re_reviews_are_bounded_by_their_own_budget() {
        let (reviewer, cache) = cache_with(|s| {
            s.refresh_rate = config::ReviewRate { qps: 0.1, burst: 3 };
            s.per_source = config::ReviewRate {
                qps: 100.0,
                burst: 100,
            };
        });
        for i in 0..10 {
            cache
                .authenticate(&format!("good-{i}"), HERE)
                .await
                .unwrap();
        }
        tokio::time::advance(Duration::from_secs(8)).await;
        for i in 0..10 {
            cache
                .authenticate(&format!("good-{i}"), HERE)
                .await
                .unwrap();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(reviewer.calls(), 13);
    }

    #[tokio::test(start_paused = true)]
    async fn concurrent_requests_share_one_review() {
        let (reviewer, cache) = cache();
        let results =
            futures::future::join_all((0..20).map(|_| cache.authenticate("good", HERE))).await;
        assert!(results.iter().all(|r| r.is_ok()));
        assert_eq!(reviewer.calls(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn rejections_are_remembered_briefly() {
        let (reviewer, cache) = cache();
        assert!(matches!(
            cache.authenticate("bad", HERE).await,
            Err(IdentityError::TokenRejected(why)) if why == "expired"
        ));
        tokio::time::advance(Duration::from_secs(9)).await;
        assert!(cache.authenticate("bad", HERE).await.is_err());
        assert_eq!(reviewer.calls(), 1);
        tokio::time::advance(Duration::from_secs(2)).await;
        assert!(cache.authenticate("bad", HERE).await.is_err());
        assert_eq!(reviewer.calls(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn failed_reviews_refuse_the_request_and_are_not_cached() {
        let (reviewer, cache) = cache();
        assert!(matches!(
            cache.authenticate("fail", HERE).await,
            Err(IdentityError::ReviewFailed(_))
        ));
        assert!(cache.authenticate("fail", HERE).await.is_err());
        assert_eq!(reviewer.calls(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn rejected_tokens_cannot_push_accepted_ones_out() {
        let (reviewer, cache) = cache_with(|s| {
            s.max_entries = 10;
            s.max_rejected_entries = 5;
        });
        cache.authenticate("good", HERE).await.unwrap();
        for i in 0..50 {
            let source = Some(IpAddr::from([10, 0, 0, i]));
            assert!(
                cache
                    .authenticate(&format!("bad-{i}"), source)
                    .await
                    .is_err()
            );
        }
        assert_eq!(reviewer.calls(), 51);
        cache.authenticate("good", HERE).await.unwrap();
        assert_eq!(
            reviewer.calls(),
            51,
            "the accepted token was reviewed again"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_token_over_the_length_limit_is_refused_without_a_review() {
        let (reviewer, cache) = cache();
        let long = format!("good{}", "a".repeat(16 * 1024));
        assert!(matches!(
            cache.authenticate(&long, HERE).await,
            Err(IdentityError::TokenTooLong(16_384))
        ));
        assert_eq!(reviewer.calls(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn unknown_tokens_past_the_source_rate_are_refused_without_a_review() {
        let (reviewer, cache) = cache_with(|s| {
            s.per_source = config::ReviewRate { qps: 1.0, burst: 2 };
        });
        cache.authenticate("good", HERE).await.unwrap();
        assert!(matches!(
            cache.authenticate("bad-1", HERE).await,
            Err(IdentityError::TokenRejected(_))
        ));
        let Err(IdentityError::ReviewLimited(limited)) = cache.authenticate("bad-2", HERE).await
        else {
            panic!("a third review from one address within a second");
        };
        assert!(limited.retry_after <= Duration::from_secs(1));
        assert_eq!(reviewer.calls(), 2);
        // Known tokens need no review and are still answered.
        cache.authenticate("good", HERE).await.unwrap();
        assert!(matches!(
            cache.authenticate("bad-1", HERE).await,
            Err(IdentityError::TokenRejected(_))
        ));
        // Another address has its own bucket.
        let other = Some(IpAddr::from([10, 9, 9, 9]));
        assert!(matches!(
            cache.authenticate("bad-2", other).await,
            Err(IdentityError::TokenRejected(_))
        ));
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(cache.authenticate("bad-3", HERE).await.is_err());
        assert_eq!(reviewer.calls(), 4);
    }

    #[tokio::test(start_paused = true)]
    async fn reviews_in_flight_are_capped_and_the_excess_waits_briefly_then_gets_429() {
        let (reviewer, cache) = cache_with(|s| {
            s.max_concurrent = 2;
            s.max_wait = Duration::from_millis(120);
        });
        // Reviews take 50 ms: of six at once, two run, two wait 50 ms, two wait 100 ms;
        // all are answered within the wait.
        let tokens: Vec<String> = (0..6).map(|i| format!("bad-{i}")).collect();
        let results =
            futures::future::join_all(tokens.iter().map(|t| cache.authenticate(t, HERE))).await;
        assert!(
            results
                .iter()
                .all(|r| matches!(r, Err(IdentityError::TokenRejected(_))))
        );
        assert_eq!(reviewer.most_in_flight.load(Ordering::SeqCst), 2);
        // Of eight more, the last two would wait 150 ms: they get ReviewLimited unreviewed.
        let tokens: Vec<String> = (0..8).map(|i| format!("more-{i}")).collect();
        let results =
            futures::future::join_all(tokens.iter().map(|t| cache.authenticate(t, HERE))).await;
        let limited = results
            .iter()
            .filter(|r| matches!(r, Err(IdentityError::ReviewLimited(_))))
            .count();
        assert_eq!(limited, 2, "{results:?}");
        assert_eq!(reviewer.calls(), 12);
    }

    #[test]
    fn jwt_expiry_caps_the_lifetime() {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        let claims = serde_json::json!({"exp": now + 30});
        let payload = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .encode(serde_json::to_vec(&claims).unwrap());
        let left = token_lifetime(&format!("h.{payload}.s")).unwrap();
        assert!(left <= Duration::from_secs(30) && left >= Duration::from_secs(28));
        assert_eq!(token_lifetime("opaque-static-token"), None);
    }
}

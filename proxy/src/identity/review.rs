//! Bearer tokens resolved by TokenReview, cached by the token's hash and coalesced.
//!
//! An accepted token is trusted for min(ttl, the token's own expiry); a rejected one is
//! remembered for `failure_ttl` so that a client retrying a bad token cannot flood the
//! apiserver with reviews. A review that could not be made is not remembered: the request
//! is refused (never passed on) and the next one tries again. Concurrent requests with the
//! same token share one review.

use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine;
use futures::FutureExt;
use futures::future::{BoxFuture, Shared};
use sha2::{Digest, Sha256};
use tokio::time::Instant;

use super::forward::OwnToken;
use super::{IdentityError, User};
use crate::config;
use crate::metrics::Metrics;
use crate::upstream::{self, RetryPolicy, Route, Upstream};

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
    fn review(&self, token: &str) -> BoxFuture<'static, Result<ReviewOutcome, String>>;
}

type Key = [u8; 32];
type Pending = Shared<BoxFuture<'static, Result<ReviewOutcome, String>>>;

struct Entry {
    outcome: ReviewOutcome,
    expires: Instant,
}

struct State {
    entries: lru::LruCache<Key, Entry>,
    pending: HashMap<Key, Pending>,
}

/// The TokenReview cache in front of a [`TokenReviewer`].
pub struct TokenCache {
    reviewer: Arc<dyn TokenReviewer>,
    settings: config::TokenReview,
    state: Mutex<State>,
    metrics: Metrics,
}

impl TokenCache {
    /// A cache with the configured lifetimes and bound.
    pub fn new(
        reviewer: Arc<dyn TokenReviewer>,
        settings: config::TokenReview,
        metrics: Metrics,
    ) -> Self {
        let capacity = NonZeroUsize::new(settings.max_entries.max(1)).expect("at least one");
        Self {
            reviewer,
            settings,
            state: Mutex::new(State {
                entries: lru::LruCache::new(capacity),
                pending: HashMap::new(),
            }),
            metrics,
        }
    }

    /// The user a token belongs to, from the cache or a (shared) review.
    pub async fn authenticate(&self, token: &str) -> Result<User, IdentityError> {
        let key: Key = Sha256::digest(token.as_bytes()).into();
        let pending = {
            let mut state = self.state.lock().expect("token cache lock");
            if let Some(entry) = state.entries.get(&key) {
                if entry.expires > Instant::now() {
                    self.count("cached");
                    return into_result(entry.outcome.clone());
                }
                state.entries.pop(&key);
            }
            state
                .pending
                .entry(key)
                .or_insert_with(|| self.reviewer.review(token).shared())
                .clone()
        };
        let result = pending.await;
        let mut state = self.state.lock().expect("token cache lock");
        // The first waiter to get here records the result; the others find it gone.
        if state.pending.remove(&key).is_some() {
            match &result {
                Ok(outcome @ ReviewOutcome::Authenticated(_)) => {
                    let ttl = token_lifetime(token)
                        .map_or(self.settings.ttl, |left| left.min(self.settings.ttl));
                    self.count("allowed");
                    state.entries.put(
                        key,
                        Entry {
                            outcome: outcome.clone(),
                            expires: Instant::now() + ttl,
                        },
                    );
                }
                Ok(outcome @ ReviewOutcome::Rejected(_)) => {
                    self.count("denied");
                    state.entries.put(
                        key,
                        Entry {
                            outcome: outcome.clone(),
                            expires: Instant::now() + self.settings.failure_ttl,
                        },
                    );
                }
                Err(_) => self.count("error"),
            }
        }
        drop(state);
        match result {
            Ok(outcome) => into_result(outcome),
            Err(why) => Err(IdentityError::ReviewFailed(why)),
        }
    }

    fn count(&self, result: &str) {
        self.metrics
            .authz_reviews_total
            .with_label_values(&["token", result])
            .inc();
    }
}

fn into_result(outcome: ReviewOutcome) -> Result<User, IdentityError> {
    match outcome {
        ReviewOutcome::Authenticated(user) => Ok(user),
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

/// Reviews tokens with `POST /apis/authentication.k8s.io/v1/tokenreviews`, sent upstream
/// with Bulwark's own identity.
pub struct UpstreamReviewer {
    upstream: Upstream,
    own_token: Option<Arc<OwnToken>>,
}

impl UpstreamReviewer {
    /// A reviewer over the upstream pool.
    pub fn new(upstream: Upstream, own_token: Option<Arc<OwnToken>>) -> Self {
        Self {
            upstream,
            own_token,
        }
    }
}

impl TokenReviewer for UpstreamReviewer {
    fn review(&self, token: &str) -> BoxFuture<'static, Result<ReviewOutcome, String>> {
        let upstream = self.upstream.clone();
        let own_token = self.own_token.clone();
        let body = serde_json::json!({
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": {"token": token},
        });
        async move {
            let review = post_json(
                &upstream,
                own_token.as_deref(),
                "/apis/authentication.k8s.io/v1/tokenreviews",
                &body,
            )
            .await?;
            let status = &review["status"];
            if status["authenticated"].as_bool() != Some(true) {
                let why = status["error"].as_str().unwrap_or("not authenticated");
                return Ok(ReviewOutcome::Rejected(why.to_string()));
            }
            let user: User = serde_json::from_value(status["user"].clone())
                .map_err(|e| format!("TokenReview status.user: {e}"))?;
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

/// Largest review answer Bulwark reads.
const MAX_REVIEW_BYTES: usize = 1 << 20;

/// Posts a review object with Bulwark's own identity and returns the answer, or why there
/// is none. Reviews change nothing, so the pool may retry them like reads.
pub async fn post_json(
    upstream: &Upstream,
    own_token: Option<&OwnToken>,
    path: &str,
    body: &serde_json::Value,
) -> Result<serde_json::Value, String> {
    let bytes = serde_json::to_vec(body).map_err(|e| e.to_string())?;
    let mut request = http::Request::post(path)
        .header(http::header::CONTENT_TYPE, "application/json")
        .header(http::header::ACCEPT, "application/json")
        .body(crate::full(bytes))
        .map_err(|e| e.to_string())?;
    if let Some(own) = own_token {
        let value = own.header().map_err(|e| e.to_string())?;
        request
            .headers_mut()
            .insert(http::header::AUTHORIZATION, value);
    }
    let route = Route {
        credential: upstream::Credential::Own,
        retry: RetryPolicy::Read,
        long_running: false,
        watch: false,
        timeout: Some(REVIEW_TIMEOUT),
    };
    let response = upstream
        .send(request, route)
        .await
        .map_err(|e| format!("{path}: {e}"))?;
    let status = response.status();
    let body = crate::read_to_limit(response.into_body(), MAX_REVIEW_BYTES)
        .await
        .map_err(|e| format!("{path}: reading the answer: {e}"))?;
    if !status.is_success() {
        let message = serde_json::from_slice::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| v["message"].as_str().map(str::to_string))
            .unwrap_or_default();
        return Err(format!("{path} answered {status}: {message}"));
    }
    serde_json::from_slice(&body).map_err(|e| format!("{path}: {e}"))
}

/// How long a review may take.
const REVIEW_TIMEOUT: Duration = Duration::from_secs(10);

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    struct Counting {
        calls: AtomicUsize,
        answer: Result<ReviewOutcome, String>,
        delay: Duration,
    }

    impl TokenReviewer for Arc<Counting> {
        fn review(&self, _token: &str) -> BoxFuture<'static, Result<ReviewOutcome, String>> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            let answer = self.answer.clone();
            let delay = self.delay;
            async move {
                tokio::time::sleep(delay).await;
                answer
            }
            .boxed()
        }
    }

    fn alice() -> User {
        User {
            username: "alice".into(),
            groups: vec!["dev".into()],
            ..User::default()
        }
    }

    fn cache(answer: Result<ReviewOutcome, String>) -> (Arc<Counting>, TokenCache) {
        let reviewer = Arc::new(Counting {
            calls: AtomicUsize::new(0),
            answer,
            delay: Duration::from_millis(50),
        });
        let cache = TokenCache::new(
            Arc::new(reviewer.clone()),
            config::TokenReview::default(),
            Metrics::new(),
        );
        (reviewer, cache)
    }

    #[tokio::test(start_paused = true)]
    async fn accepted_tokens_are_cached_for_the_ttl_then_reviewed_again() {
        let (reviewer, cache) = cache(Ok(ReviewOutcome::Authenticated(alice())));
        assert_eq!(cache.authenticate("t").await.unwrap().username, "alice");
        tokio::time::advance(Duration::from_secs(119)).await;
        cache.authenticate("t").await.unwrap();
        assert_eq!(reviewer.calls.load(Ordering::SeqCst), 1);
        tokio::time::advance(Duration::from_secs(2)).await;
        cache.authenticate("t").await.unwrap();
        assert_eq!(reviewer.calls.load(Ordering::SeqCst), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn concurrent_requests_share_one_review() {
        let (reviewer, cache) = cache(Ok(ReviewOutcome::Authenticated(alice())));
        let results = futures::future::join_all((0..20).map(|_| cache.authenticate("t"))).await;
        assert!(results.iter().all(|r| r.is_ok()));
        assert_eq!(reviewer.calls.load(Ordering::SeqCst), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn rejections_are_remembered_briefly() {
        let (reviewer, cache) = cache(Ok(ReviewOutcome::Rejected("expired".into())));
        assert_eq!(
            cache.authenticate("bad").await,
            Err(IdentityError::TokenRejected("expired".into()))
        );
        tokio::time::advance(Duration::from_secs(9)).await;
        assert!(cache.authenticate("bad").await.is_err());
        assert_eq!(reviewer.calls.load(Ordering::SeqCst), 1);
        tokio::time::advance(Duration::from_secs(2)).await;
        assert!(cache.authenticate("bad").await.is_err());
        assert_eq!(reviewer.calls.load(Ordering::SeqCst), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn failed_reviews_refuse_the_request_and_are_not_cached() {
        let (reviewer, cache) = cache(Err("connection refused".into()));
        assert!(matches!(
            cache.authenticate("t").await,
            Err(IdentityError::ReviewFailed(_))
        ));
        assert!(cache.authenticate("t").await.is_err());
        assert_eq!(reviewer.calls.load(Ordering::SeqCst), 2);
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

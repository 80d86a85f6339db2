//! Authorization of cache answers: a SubjectAccessReview per user and request attributes,
//! made with Bulwark's own identity, cached briefly (allowed and denied apart), bounded and
//! coalesced.
//!
//! The apiserver never sees a cache read, so Bulwark asks it, for that user, exactly what
//! its authorizer would decide: user, groups (always with `system:authenticated`), extra,
//! uid, verb, group, version, resource, namespace and name. A review that cannot be made is
//! never taken as an answer: the request gets an error, never data.

use std::collections::{BTreeMap, HashMap};
use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::FutureExt;
use futures::future::{BoxFuture, Shared};
use serde_json::json;
use tokio::time::Instant;

use crate::identity::forward::OwnToken;
use crate::identity::{AUTHENTICATED, User};
use crate::metrics::Metrics;
use crate::upstream::Upstream;

/// What a request wants to do, in the authorizer's words.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Attributes {
    /// `get`, `list` or `watch`.
    pub verb: String,
    /// API group.
    pub group: String,
    /// API version.
    pub version: String,
    /// Resource.
    pub resource: String,
    /// Namespace; `""` for cluster scope.
    pub namespace: String,
    /// Object name; `""` for a collection.
    pub name: String,
}

/// What a review decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Allowed.
    Allowed,
    /// Denied (or not allowed), with the authorizer's reason if it gave one.
    Denied(String),
}

/// Something that answers SubjectAccessReviews: the apiserver, or a test double.
pub trait AccessReviewer: Send + Sync + 'static {
    /// Reviews one request. `Err` means no answer could be had.
    fn review(
        &self,
        user: &User,
        attrs: &Attributes,
    ) -> BoxFuture<'static, Result<Decision, String>>;
}

/// Reviews with `POST /apis/authorization.k8s.io/v1/subjectaccessreviews` upstream.
pub struct UpstreamAccessReviewer {
    upstream: Upstream,
    own_token: Option<Arc<OwnToken>>,
}

impl UpstreamAccessReviewer {
    /// A reviewer over the upstream pool, with Bulwark's own identity.
    pub fn new(upstream: Upstream, own_token: Option<Arc<OwnToken>>) -> Self {
        Self {
            upstream,
            own_token,
        }
    }
}

/// The review body for a user and request.
pub fn review_body(user: &User, attrs: &Attributes) -> serde_json::Value {
    let mut groups = user.groups.clone();
    if !groups.iter().any(|g| g == AUTHENTICATED) {
        groups.push(AUTHENTICATED.to_owned());
    }
    let mut resource = json!({
        "verb": attrs.verb,
        "group": attrs.group,
        "version": attrs.version,
        "resource": attrs.resource,
    });
    if !attrs.namespace.is_empty() {
        resource["namespace"] = json!(attrs.namespace);
    }
    if !attrs.name.is_empty() {
        resource["name"] = json!(attrs.name);
    }
    let mut spec = json!({
        "resourceAttributes": resource,
        "user": user.username,
        "groups": groups,
    });
    if !user.extra.is_empty() {
        spec["extra"] = json!(user.extra);
    }
    if let Some(uid) = &user.uid {
        spec["uid"] = json!(uid);
    }
    json!({
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SubjectAccessReview",
        "spec": spec,
    })
}

impl AccessReviewer for UpstreamAccessReviewer {
    fn review(
        &self,
        user: &User,
        attrs: &Attributes,
    ) -> BoxFuture<'static, Result<Decision, String>> {
        let upstream = self.upstream.clone();
        let own_token = self.own_token.clone();
        let body = review_body(user, attrs);
        async move {
            let review = crate::identity::review::post_json(
                &upstream,
                own_token.as_deref(),
                "/apis/authorization.k8s.io/v1/subjectaccessreviews",
                &body,
            )
            .await?;
            let status = &review["status"];
            if status["allowed"].as_bool() == Some(true) {
                return Ok(Decision::Allowed);
            }
            if status.is_null() {
                return Err("the SubjectAccessReview has no status".into());
            }
            let reason = status["reason"].as_str().unwrap_or_default();
            let error = status["evaluationError"].as_str().unwrap_or_default();
            Ok(Decision::Denied(
                [reason, error]
                    .into_iter()
                    .filter(|s| !s.is_empty())
                    .collect::<Vec<_>>()
                    .join("; "),
            ))
        }
        .boxed()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Key {
    username: String,
    uid: Option<String>,
    groups: Vec<String>,
    extra: BTreeMap<String, Vec<String>>,
    attrs: Attributes,
}

type Pending = Shared<BoxFuture<'static, Result<Decision, String>>>;

struct Entry {
    decision: Decision,
    expires: Instant,
}

struct State {
    entries: lru::LruCache<Key, Entry>,
    pending: HashMap<Key, Pending>,
}

/// The decision cache in front of an [`AccessReviewer`].
pub struct AccessCache {
    reviewer: Arc<dyn AccessReviewer>,
    allowed_ttl: Duration,
    denied_ttl: Duration,
    state: Mutex<State>,
    metrics: Metrics,
}

/// Decisions kept at most.
const MAX_DECISIONS: usize = 20_000;

impl AccessCache {
    /// Allowed answers are reused for `ttl`, denials for at most half of it (so that a
    /// grant shows soon), failures not at all.
    pub fn new(reviewer: Arc<dyn AccessReviewer>, ttl: Duration, metrics: Metrics) -> Self {
        Self {
            reviewer,
            allowed_ttl: ttl,
            denied_ttl: (ttl / 2).min(Duration::from_secs(5)),
            state: Mutex::new(State {
                entries: lru::LruCache::new(NonZeroUsize::new(MAX_DECISIONS).expect("nonzero")),
                pending: HashMap::new(),
            }),
            metrics,
        }
    }

    /// The decision for this user and request, from the cache or a shared review.
    pub async fn check(&self, user: &User, attrs: &Attributes) -> Result<Decision, String> {
        let key = Key {
            username: user.username.clone(),
            uid: user.uid.clone(),
            groups: user.groups.clone(),
            extra: user.extra.clone(),
            attrs: attrs.clone(),
        };
        let pending = {
            let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(entry) = state.entries.get(&key) {
                if entry.expires > Instant::now() {
                    self.count("cached");
                    return Ok(entry.decision.clone());
                }
                state.entries.pop(&key);
            }
            state
                .pending
                .entry(key.clone())
                .or_insert_with(|| self.reviewer.review(user, attrs).shared())
                .clone()
        };
        let result = pending.await;
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        // The first waiter back records the answer; the others find it gone.
        if state.pending.remove(&key).is_some() {
            let (label, ttl) = match &result {
                Ok(Decision::Allowed) => ("allowed", Some(self.allowed_ttl)),
                Ok(Decision::Denied(_)) => ("denied", Some(self.denied_ttl)),
                Err(_) => ("error", None),
            };
            self.count(label);
            if let (Some(ttl), Ok(decision)) = (ttl, &result) {
                state.entries.put(
                    key,
                    Entry {
                        decision: decision.clone(),
                        expires: Instant::now() + ttl,
                    },
                );
            }
        }
        result
    }

    fn count(&self, result: &str) {
        self.metrics
            .authz_reviews_total
            .with_label_values(&["access", result])
            .inc();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    struct Counting {
        calls: AtomicUsize,
        answer: Mutex<Result<Decision, String>>,
    }

    impl AccessReviewer for Arc<Counting> {
        fn review(&self, _: &User, _: &Attributes) -> BoxFuture<'static, Result<Decision, String>> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            let answer = self.answer.lock().unwrap().clone();
            async move {
                tokio::time::sleep(Duration::from_millis(20)).await;
                answer
            }
            .boxed()
        }
    }

    fn attrs() -> Attributes {
        Attributes {
            verb: "get".into(),
            group: String::new(),
            version: "v1".into(),
            resource: "secrets".into(),
            namespace: "ns".into(),
            name: "a".into(),
        }
    }

    fn user() -> User {
        User {
            username: "alice".into(),
            ..User::default()
        }
    }

    fn cache(answer: Result<Decision, String>) -> (Arc<Counting>, AccessCache) {
        let reviewer = Arc::new(Counting {
            calls: AtomicUsize::new(0),
            answer: Mutex::new(answer),
        });
        let cache = AccessCache::new(
            Arc::new(reviewer.clone()),
            Duration::from_secs(10),
            Metrics::new(),
        );
        (reviewer, cache)
    }

    #[test]
    fn the_review_names_the_user_with_authenticated_and_the_object() {
        let mut u = user();
        u.uid = Some("u-1".into());
        u.extra.insert("scopes".into(), vec!["a".into()]);
        let body = review_body(&u, &attrs());
        assert_eq!(body["kind"], "SubjectAccessReview");
        assert_eq!(body["spec"]["user"], "alice");
        assert_eq!(body["spec"]["uid"], "u-1");
        assert_eq!(body["spec"]["groups"], json!([AUTHENTICATED]));
        assert_eq!(body["spec"]["extra"]["scopes"], json!(["a"]));
        let ra = &body["spec"]["resourceAttributes"];
        assert_eq!(ra["verb"], "get");
        assert_eq!(ra["resource"], "secrets");
        assert_eq!(ra["namespace"], "ns");
        assert_eq!(ra["name"], "a");
    }

    #[tokio::test(start_paused = true)]
    async fn allowed_is_cached_for_the_ttl_and_concurrent_checks_share_a_review() {
        let (reviewer, cache) = cache(Ok(Decision::Allowed));
        let (u, a) = (user(), attrs());
        let all = futures::future::join_all((0..10).map(|_| cache.check(&u, &a))).await;
        assert!(all.iter().all(|d| *d == Ok(Decision::Allowed)));
        assert_eq!(reviewer.calls.load(Ordering::SeqCst), 1);
        tokio::time::advance(Duration::from_secs(9)).await;
        cache.check(&user(), &attrs()).await.unwrap();
        assert_eq!(reviewer.calls.load(Ordering::SeqCst), 1);
        tokio::time::advance(Duration::from_secs(2)).await;
        cache.check(&user(), &attrs()).await.unwrap();
        assert_eq!(reviewer.calls.load(Ordering::SeqCst), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn denials_are_kept_shorter_and_failures_not_at_all() {
        let (reviewer, cache) = cache(Ok(Decision::Denied(String::new())));
        cache.check(&user(), &attrs()).await.unwrap();
        tokio::time::advance(Duration::from_secs(4)).await;
        cache.check(&user(), &attrs()).await.unwrap();
        assert_eq!(reviewer.calls.load(Ordering::SeqCst), 1);
        tokio::time::advance(Duration::from_secs(2)).await;
        cache.check(&user(), &attrs()).await.unwrap();
        assert_eq!(reviewer.calls.load(Ordering::SeqCst), 2);

        *reviewer.answer.lock().unwrap() = Err("connection refused".into());
        tokio::time::advance(Duration::from_secs(6)).await;
        assert!(cache.check(&user(), &attrs()).await.is_err());
        assert!(cache.check(&user(), &attrs()).await.is_err());
        assert_eq!(reviewer.calls.load(Ordering::SeqCst), 4);
    }
}

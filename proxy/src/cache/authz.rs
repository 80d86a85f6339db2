//! Authorization of cache answers: a SubjectAccessReview per user and request attributes,
//! made with Bulwark's own identity, cached briefly (allowed and denied apart), bounded and
//! coalesced.
//!
//! The apiserver never sees a cache read, so Bulwark asks it, for that user, exactly what
//! its authorizer would decide: user, groups (always with `system:authenticated`), extra,
//! uid, verb, group, version, resource, namespace and name. A review that cannot be made is
//! never taken as an answer: the request gets an error, never data.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use serde_json::json;

use crate::coalesce::{Coalescing, Keep, Lookup};
use crate::metrics::Metrics;
use crate::own::{self, ReviewError};
use crate::user::{AUTHENTICATED, User};

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
    ) -> BoxFuture<'static, Result<Decision, ReviewError>>;
}

/// The path of SubjectAccessReviews.
const SUBJECT_ACCESS_REVIEWS: &str = "/apis/authorization.k8s.io/v1/subjectaccessreviews";

/// Reviews with `POST /apis/authorization.k8s.io/v1/subjectaccessreviews`, one of Bulwark's
/// own calls.
pub struct UpstreamAccessReviewer {
    client: own::Client,
}

impl UpstreamAccessReviewer {
    /// A reviewer through Bulwark's own client.
    pub fn new(client: own::Client) -> Self {
        Self { client }
    }
}

/// The review body for a user and request.
pub fn review_body(user: &User, attrs: &Attributes) -> serde_json::Value {
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
    review_of(user, "resourceAttributes", resource)
}

/// Whether `user` may `verb` the non-resource URL `path` (`get /metrics`), asked upstream
/// with Bulwark's own identity. Not cached: its one caller, a scrape, comes every few
/// seconds at most.
pub async fn review_non_resource(
    client: &own::Client,
    user: &User,
    verb: &str,
    path: &str,
) -> Result<Decision, ReviewError> {
    let body = review_of(
        user,
        "nonResourceAttributes",
        json!({ "verb": verb, "path": path }),
    );
    let review = client.review(SUBJECT_ACCESS_REVIEWS, &body).await?;
    decision(&review)
}

/// A SubjectAccessReview of `user` for `attributes` under `kind`.
fn review_of(user: &User, kind: &str, attributes: serde_json::Value) -> serde_json::Value {
    let mut groups = user.groups.clone();
    if !groups.iter().any(|g| g == AUTHENTICATED) {
        groups.push(AUTHENTICATED.to_owned());
    }
    let mut spec = json!({
        kind: attributes,
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
    ) -> BoxFuture<'static, Result<Decision, ReviewError>> {
        let client = self.client.clone();
        let body = review_body(user, attrs);
        async move {
            let review = client.review(SUBJECT_ACCESS_REVIEWS, &body).await?;
            decision(&review)
        }
        .boxed()
    }
}

/// What an answered SubjectAccessReview decided.
fn decision(review: &serde_json::Value) -> Result<Decision, ReviewError> {
    let status = &review["status"];
    if status["allowed"].as_bool() == Some(true) {
        return Ok(Decision::Allowed);
    }
    if status.is_null() {
        return Err(ReviewError::NoStatus);
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

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Key {
    username: String,
    uid: Option<String>,
    groups: Vec<String>,
    extra: BTreeMap<String, Vec<String>>,
    attrs: Attributes,
}

/// The decision cache in front of an [`AccessReviewer`].
pub struct AccessCache {
    reviewer: Arc<dyn AccessReviewer>,
    allowed_ttl: Duration,
    denied_ttl: Duration,
    /// Allowed is the positive answer, denied the negative.
    decisions: Coalescing<Key, Decision, Arc<ReviewError>>,
    metrics: Metrics,
}

/// Allowed decisions kept at most.
const MAX_ALLOWED: usize = 20_000;

/// Denials kept at most, apart so that they cannot push allowed decisions out.
const MAX_DENIED: usize = 5_000;

impl AccessCache {
    /// Allowed answers are reused for `ttl`, denials for at most half of it (so that a
    /// grant shows soon), failures not at all.
    pub fn new(reviewer: Arc<dyn AccessReviewer>, ttl: Duration, metrics: Metrics) -> Self {
        Self {
            reviewer,
            allowed_ttl: ttl,
            denied_ttl: (ttl / 2).min(Duration::from_secs(5)),
            decisions: Coalescing::new(MAX_ALLOWED, MAX_DENIED),
            metrics,
        }
    }

    /// The decision for this user and request, from the cache or a shared review.
    pub async fn check(
        &self,
        user: &User,
        attrs: &Attributes,
    ) -> Result<Decision, Arc<ReviewError>> {
        let key = Key {
            username: user.username.clone(),
            uid: user.uid.clone(),
            groups: user.groups.clone(),
            extra: user.extra.clone(),
            attrs: attrs.clone(),
        };
        let start = || -> Result<_, std::convert::Infallible> {
            Ok(self
                .reviewer
                .review(user, attrs)
                .map(|r| r.map_err(Arc::new))
                .boxed())
        };
        let keep = |result: &Result<Decision, Arc<ReviewError>>| match result {
            Ok(Decision::Allowed) => Keep::Positive(self.allowed_ttl),
            Ok(Decision::Denied(_)) => Keep::Negative(self.denied_ttl),
            Err(_) => Keep::Not,
        };
        let Ok(lookup) = self.decisions.get(key, start, keep).await;
        match lookup {
            Lookup::Cached(decision) => {
                self.count("cached");
                Ok(decision)
            }
            Lookup::Fetched { result, recorded } => {
                if recorded {
                    self.count(match &result {
                        Ok(Decision::Allowed) => "allowed",
                        Ok(Decision::Denied(_)) => "denied",
                        Err(_) => "error",
                    });
                }
                result
            }
        }
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
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    struct Counting {
        calls: AtomicUsize,
        /// The decision to answer, or none (a failed review).
        answer: Mutex<Option<Decision>>,
    }

    impl AccessReviewer for Arc<Counting> {
        fn review(
            &self,
            _: &User,
            _: &Attributes,
        ) -> BoxFuture<'static, Result<Decision, ReviewError>> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            let answer = self
                .answer
                .lock()
                .unwrap()
                .clone()
                .ok_or(ReviewError::NoStatus);
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

    fn cache(answer: Option<Decision>) -> (Arc<Counting>, AccessCache) {
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
        let (reviewer, cache) = cache(Some(Decision::Allowed));
        let (u, a) = (user(), attrs());
        let all = futures::future::join_all((0..10).map(|_| cache.check(&u, &a))).await;
        assert!(all.iter().all(|d| matches!(d, Ok(Decision::Allowed))));
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
        let (reviewer, cache) = cache(Some(Decision::Denied(String::new())));
        cache.check(&user(), &attrs()).await.unwrap();
        tokio::time::advance(Duration::from_secs(4)).await;
        cache.check(&user(), &attrs()).await.unwrap();
        assert_eq!(reviewer.calls.load(Ordering::SeqCst), 1);
        tokio::time::advance(Duration::from_secs(2)).await;
        cache.check(&user(), &attrs()).await.unwrap();
        assert_eq!(reviewer.calls.load(Ordering::SeqCst), 2);

        *reviewer.answer.lock().unwrap() = None;
        tokio::time::advance(Duration::from_secs(6)).await;
        assert!(cache.check(&user(), &attrs()).await.is_err());
        assert!(cache.check(&user(), &attrs()).await.is_err());
        assert_eq!(reviewer.calls.load(Ordering::SeqCst), 4);
    }
}

//! Unit tests of the cache's answers: the store is fed directly (as the informer feeds it),
//! reviews come from a test double, and time is paused where the behaviour is timed.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};

use futures::FutureExt;
use futures::future::BoxFuture;
use http_body_util::BodyExt;
use serde_json::Value;

use apimachinery::continue_token;

use http::{HeaderValue, StatusCode};

use super::store::{EventType, Kind, Obj, Writer};
use super::*;
use crate::own::ReviewError;

/// Allows everyone except the denied users; names, when set, limit what may be read.
#[derive(Default)]
struct Policy {
    denied: Mutex<HashSet<String>>,
    only_names: Mutex<Option<(String, HashSet<String>)>>,
    failing: AtomicBool,
    seen: Mutex<Vec<(User, Attributes)>>,
}

impl AccessReviewer for Arc<Policy> {
    fn review(
        &self,
        user: &User,
        attrs: &Attributes,
    ) -> BoxFuture<'static, Result<Decision, ReviewError>> {
        self.seen
            .lock()
            .unwrap()
            .push((user.clone(), attrs.clone()));
        let answer = if self.failing.load(Ordering::SeqCst) {
            Err(ReviewError::NoStatus)
        } else if self.denied.lock().unwrap().contains(&user.username) {
            Ok(Decision::Denied(String::new()))
        } else if let Some((who, names)) = &*self.only_names.lock().unwrap()
            && *who == user.username
            && !names.contains(&attrs.name)
        {
            Ok(Decision::Denied(String::new()))
        } else {
            Ok(Decision::Allowed)
        };
        async move { answer }.boxed()
    }
}

struct Setup {
    cache: Arc<Cache>,
    store: Writer,
    policy: Arc<Policy>,
    metrics: Metrics,
}

fn config() -> config::Cache {
    config::Cache {
        enabled: true,
        resources: vec![config::GroupResource::core("secrets")],
        ring_size: 100,
        watcher_buffer: 100,
        reauthorize_interval: Duration::from_secs(60),
        access_review_ttl: Duration::from_secs(10),
        bookmark_interval: Duration::from_secs(60),
        ..config::Cache::default()
    }
}

fn setup_with(cfg: config::Cache, audit: Option<AuditLog>) -> Setup {
    let policy = Arc::new(Policy::default());
    let metrics = Metrics::new();
    let cache = Cache::build(&cfg, Arc::new(policy.clone()), metrics.clone(), audit);
    let store = Writer::new(
        Kind::new("", "v1", "secrets", "Secret", true),
        cfg.ring_size,
        cfg.watcher_buffer,
    );
    let _ = cache.resources[0].store.set(store.as_reader());
    Setup {
        cache,
        store,
        policy,
        metrics,
    }
}

/// An audit log at `path`; its lines are on disk once `file().flush()` returns.
fn audit_log(path: &std::path::Path) -> AuditLog {
    let limits = crate::logs::rotate::Limits::new(1 << 20, 1);
    AuditLog::open(path, limits, &Metrics::new()).unwrap()
}

/// A reader whose address is not known (its audit lines name only what its headers give).
fn reader<'a>(user: &'a User, headers: &'a HeaderMap) -> Reader<'a> {
    Reader {
        user,
        headers,
        peer: None,
    }
}

/// The apiserver's answer a refused cached read carries: its `Status` and `Audit-Id` (which
/// reason and headers Bulwark adds is `stages::error`'s, tested there).
fn refused(error: CacheError) -> Response<Body> {
    error
        .status_response()
        .unwrap_or_else(|| panic!("{error} is not an answer in the apiserver's words"))
}

fn setup() -> Setup {
    setup_with(config(), None)
}

fn secret(ns: &str, name: &str, rv: u64, app: &str) -> Obj {
    let raw = format!(
        "{{\"kind\":\"Secret\",\"apiVersion\":\"v1\",\"metadata\":{{\"name\":\"{name}\",\"namespace\":\"{ns}\",\"uid\":\"u-{name}\",\"resourceVersion\":\"{rv}\",\"labels\":{{\"app\":\"{app}\"}}}},\"data\":{{\"k\":\"dmFsdWU=\"}},\"type\":\"Opaque\"}}"
    );
    Obj::parse(raw.as_bytes()).unwrap()
}

/// Three secrets at version 10: ns-a/one (web), ns-a/two (db), ns-b/three (web).
fn seeded() -> Setup {
    let mut s = setup();
    s.store.replace(
        vec![
            secret("ns-a", "one", 3, "web"),
            secret("ns-a", "two", 4, "db"),
            secret("ns-b", "three", 5, "web"),
        ],
        10,
    );
    s
}

fn user(name: &str) -> User {
    User {
        username: name.into(),
        groups: vec!["dev".into(), crate::user::AUTHENTICATED.into()],
        ..User::default()
    }
}

fn info(path_and_query: &str) -> RequestInfo {
    crate::classify::classify(&http::Method::GET, &path_and_query.parse().unwrap()).unwrap()
}

async fn ask(s: &Setup, who: &str, uri: &str) -> Result<Option<Response<Body>>, CacheError> {
    s.cache
        .serve(&info(uri), reader(&user(who), &HeaderMap::new()), None)
        .await
}

async fn json(response: Response<Body>) -> (StatusCode, Value) {
    let status = response.status();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, serde_json::from_slice(&body).unwrap())
}

/// Reads a watch body until `n` lines have arrived (or the stream ends).
async fn lines(body: &mut Body, n: usize) -> Vec<Value> {
    let mut out = Vec::new();
    let mut buffer = Vec::new();
    while out.len() < n {
        let Some(frame) = body.frame().await else {
            break;
        };
        let Ok(data) = frame.unwrap().into_data() else {
            continue;
        };
        buffer.extend_from_slice(&data);
        while let Some(end) = buffer.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = buffer.drain(..=end).collect();
            out.push(serde_json::from_slice(&line).unwrap());
        }
    }
    out
}

fn names(list: &Value) -> Vec<String> {
    list["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["metadata"]["name"].as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test]
async fn list_and_get_at_version_zero_have_the_apiserver_shape() {
    let s = seeded();
    let response = ask(
        &s,
        "alice",
        "/api/v1/namespaces/ns-a/secrets?resourceVersion=0",
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(
        response.extensions().get::<crate::metrics::ServedBy>(),
        Some(&crate::metrics::ServedBy::Cache)
    );
    assert_eq!(response.headers()["content-type"], "application/json");
    assert!(response.headers().contains_key("audit-id"));
    let (status, list) = json(response).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(list["kind"], "SecretList");
    assert_eq!(list["apiVersion"], "v1");
    assert_eq!(list["metadata"]["resourceVersion"], "10");
    assert_eq!(names(&list), ["one", "two"]);
    assert!(
        list["items"][0].get("kind").is_none(),
        "list items carry no kind, as the apiserver's"
    );

    let response = ask(
        &s,
        "alice",
        "/api/v1/namespaces/ns-b/secrets/three?resourceVersion=0",
    )
    .await
    .unwrap()
    .unwrap();
    let (status, obj) = json(response).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(obj["kind"], "Secret");
    assert_eq!(obj["metadata"]["resourceVersion"], "5");
    assert_eq!(obj["data"]["k"], "dmFsdWU=");

    let response = ask(
        &s,
        "alice",
        "/api/v1/namespaces/ns-b/secrets/nope?resourceVersion=0",
    )
    .await
    .unwrap()
    .unwrap();
    let (status, error) = json(response).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(error["reason"], "NotFound");
    assert_eq!(error["message"], "secrets \"nope\" not found");
}

#[tokio::test]
async fn selectors_filter_lists() {
    let s = seeded();
    let ask_names = |uri: &'static str| {
        let s = &s;
        async move { names(&json(ask(s, "alice", uri).await.unwrap().unwrap()).await.1) }
    };
    assert_eq!(
        ask_names("/api/v1/secrets?resourceVersion=0&labelSelector=app%3Dweb").await,
        ["one", "three"]
    );
    assert_eq!(
        ask_names("/api/v1/secrets?resourceVersion=0&labelSelector=app+notin+(web)").await,
        ["two"]
    );
    assert_eq!(
        ask_names("/api/v1/secrets?resourceVersion=0&fieldSelector=metadata.name%3Dtwo").await,
        ["two"]
    );
    assert_eq!(
        ask_names("/api/v1/secrets?resourceVersion=0&fieldSelector=metadata.namespace%3Dns-b")
            .await,
        ["three"]
    );
    // A field the cache does not index goes upstream, where the apiserver decides.
    assert!(
        ask(
            &s,
            "alice",
            "/api/v1/secrets?resourceVersion=0&fieldSelector=type%3DOpaque"
        )
        .await
        .unwrap()
        .is_none()
    );
}

#[tokio::test]
async fn a_user_without_access_gets_403_and_never_data() {
    let s = seeded();
    s.policy.denied.lock().unwrap().insert("mallory".into());
    for uri in [
        "/api/v1/namespaces/ns-a/secrets/one?resourceVersion=0",
        "/api/v1/namespaces/ns-a/secrets?resourceVersion=0",
        "/api/v1/secrets?resourceVersion=0",
        "/api/v1/namespaces/ns-a/secrets?watch=1&resourceVersion=0",
        "/api/v1/secrets?watch=1&resourceVersion=10",
    ] {
        let Err(error) = ask(&s, "mallory", uri).await else {
            panic!("{uri} was answered for a denied user");
        };
        let response = refused(error);
        let (status, body) = json(response).await;
        assert_eq!(status, StatusCode::FORBIDDEN);
        assert_eq!(body["kind"], "Status");
        assert_eq!(body["reason"], "Forbidden");
        assert!(!body.to_string().contains("dmFsdWU="));
    }
    let Err(error) = ask(
        &s,
        "mallory",
        "/api/v1/namespaces/ns-a/secrets/one?resourceVersion=0",
    )
    .await
    else {
        unreachable!()
    };
    let (_, body) = json(refused(error)).await;
    assert_eq!(
        body["message"],
        "secrets \"one\" is forbidden: User \"mallory\" cannot get resource \"secrets\" in API group \"\" in the namespace \"ns-a\""
    );
}

#[tokio::test]
async fn the_review_names_user_groups_verb_and_the_field_selector_name() {
    let s = seeded();
    s.policy
        .only_names
        .lock()
        .unwrap()
        .replace(("system:node:n1".into(), HashSet::from(["one".to_owned()])));
    let own = "/api/v1/namespaces/ns-a/secrets?resourceVersion=0&fieldSelector=metadata.name%3Done";
    let (_, list) = json(ask(&s, "system:node:n1", own).await.unwrap().unwrap()).await;
    assert_eq!(names(&list), ["one"]);
    let watch = "/api/v1/namespaces/ns-a/secrets?watch=1&resourceVersion=0&fieldSelector=metadata.name%3Done";
    assert!(ask(&s, "system:node:n1", watch).await.unwrap().is_some());
    for other in [
        "/api/v1/namespaces/ns-a/secrets?resourceVersion=0&fieldSelector=metadata.name%3Dtwo",
        "/api/v1/namespaces/ns-a/secrets?resourceVersion=0",
        "/api/v1/namespaces/ns-a/secrets/two?resourceVersion=0",
        "/api/v1/namespaces/ns-a/secrets?watch=1&resourceVersion=0&fieldSelector=metadata.name%3Dtwo",
        // The legacy watch path is authorized without the selector's name, as the
        // apiserver's RequestInfoFactory has it.
        "/api/v1/watch/namespaces/ns-a/secrets?resourceVersion=0&fieldSelector=metadata.name%3Done",
    ] {
        assert!(ask(&s, "system:node:n1", other).await.is_err(), "{other}");
    }
    let seen = s.policy.seen.lock().unwrap();
    let (who, attrs) = &seen[0];
    assert!(who.groups.iter().any(|g| g == crate::user::AUTHENTICATED));
    assert_eq!(attrs.verb, "list");
    assert_eq!(attrs.name, "one");
    assert_eq!(attrs.namespace, "ns-a");
    assert!(seen.iter().any(|(_, a)| a.verb == "watch"));
}

#[tokio::test]
async fn a_review_that_cannot_be_made_is_an_error_never_data() {
    let s = seeded();
    s.policy.failing.store(true, Ordering::SeqCst);
    let error = ask(
        &s,
        "alice",
        "/api/v1/namespaces/ns-a/secrets?resourceVersion=0",
    )
    .await
    .unwrap_err();
    // The error holds no object; the client gets a 502 for it (`stages::error`).
    assert!(matches!(error, CacheError::ReviewFailed(_)));
    assert!(error.status_response().is_none());
}

#[tokio::test]
async fn impersonation_other_forms_and_writes_go_upstream() {
    let s = seeded();
    let uri = "/api/v1/namespaces/ns-a/secrets?resourceVersion=0";
    let mut headers = HeaderMap::new();
    headers.insert("impersonate-user", "bob".parse().unwrap());
    assert!(
        s.cache
            .serve(&info(uri), reader(&user("alice"), &headers), None)
            .await
            .unwrap()
            .is_none()
    );
    let mut headers = HeaderMap::new();
    headers.insert(
        "accept",
        "application/json;as=Table;v=v1;g=meta.k8s.io,application/json"
            .parse()
            .unwrap(),
    );
    assert!(
        s.cache
            .serve(&info(uri), reader(&user("alice"), &headers), None)
            .await
            .unwrap()
            .is_none()
    );
    // YAML first: the apiserver would answer YAML, which the cache does not write.
    headers.insert(
        "accept",
        "application/yaml, application/json".parse().unwrap(),
    );
    assert!(
        s.cache
            .serve(&info(uri), reader(&user("alice"), &headers), None)
            .await
            .unwrap()
            .is_none()
    );
    headers.insert(
        "accept",
        "application/vnd.kubernetes.protobuf, application/json"
            .parse()
            .unwrap(),
    );
    assert!(
        s.cache
            .serve(&info(uri), reader(&user("alice"), &headers), None)
            .await
            .unwrap()
            .is_some()
    );
    let post = crate::classify::classify(
        &http::Method::POST,
        &"/api/v1/namespaces/ns-a/secrets".parse().unwrap(),
    )
    .unwrap();
    assert!(
        s.cache
            .serve(&post, reader(&user("alice"), &HeaderMap::new()), None)
            .await
            .unwrap()
            .is_none()
    );
    // A watch of one object by its path name goes upstream.
    assert!(
        ask(&s, "alice", "/api/v1/watch/namespaces/ns-a/secrets/one")
            .await
            .unwrap()
            .is_none()
    );
    // An exact list goes upstream.
    assert!(
        ask(&s, "alice", "/api/v1/secrets?resourceVersion=10&limit=5")
            .await
            .unwrap()
            .is_none()
    );
    assert!(
        ask(
            &s,
            "alice",
            "/api/v1/secrets?resourceVersion=10&resourceVersionMatch=Exact"
        )
        .await
        .unwrap()
        .is_none()
    );
    assert!(
        s.policy.seen.lock().unwrap().len() <= 1,
        "bypassed requests are not reviewed"
    );
}

#[tokio::test]
async fn nothing_is_answered_before_the_first_list() {
    let mut s = setup();
    assert!(!s.cache.synced());
    assert!(
        ask(&s, "alice", "/api/v1/secrets?resourceVersion=0")
            .await
            .unwrap()
            .is_none()
    );
    s.store.replace(Vec::new(), 3);
    assert!(s.cache.synced());
    assert!(
        ask(&s, "alice", "/api/v1/secrets?resourceVersion=0")
            .await
            .unwrap()
            .is_some()
    );
    let text = s.metrics.render();
    assert!(text.contains(
        "bulwark_cache_requests_total{resource=\"secrets\",result=\"miss\",verb=\"list\"} 1"
    ));
    assert!(text.contains(
        "bulwark_cache_requests_total{resource=\"secrets\",result=\"hit\",verb=\"list\"} 1"
    ));
}

#[tokio::test]
async fn excluded_namespaces_and_names_go_upstream() {
    let mut cfg = config();
    cfg.exclude_names = vec!["ns-a/two".parse().unwrap()];
    let mut s = setup_with(cfg, None);
    s.store.replace(vec![secret("ns-a", "one", 3, "web")], 10);
    assert!(
        ask(
            &s,
            "alice",
            "/api/v1/namespaces/ns-a/secrets/two?resourceVersion=0"
        )
        .await
        .unwrap()
        .is_none()
    );
    assert!(
        ask(
            &s,
            "alice",
            "/api/v1/namespaces/ns-a/secrets?resourceVersion=0"
        )
        .await
        .unwrap()
        .is_none()
    );
    assert!(
        ask(
            &s,
            "alice",
            "/api/v1/namespaces/ns-a/secrets/one?resourceVersion=0"
        )
        .await
        .unwrap()
        .is_some()
    );
    assert!(
        ask(
            &s,
            "alice",
            "/api/v1/namespaces/ns-b/secrets?resourceVersion=0"
        )
        .await
        .unwrap()
        .is_some()
    );
}

/// kube-apiserver v1.36 answers a `resourceVersion=0` LIST whole from its watch cache,
/// whatever its `limit`, and so does the cache.
#[tokio::test]
async fn a_version_zero_list_ignores_its_limit_as_the_apiserver_does() {
    let s = seeded();
    let (_, list) = json(
        ask(&s, "alice", "/api/v1/secrets?resourceVersion=0&limit=1")
            .await
            .unwrap()
            .unwrap(),
    )
    .await;
    assert_eq!(names(&list), ["one", "two", "three"]);
    assert!(list["metadata"].get("continue").is_none());
}

#[tokio::test]
async fn pages_follow_each_other_over_a_fixed_snapshot() {
    let mut s = seeded();
    let (_, first) = json(
        ask(
            &s,
            "alice",
            "/api/v1/secrets?resourceVersion=10&resourceVersionMatch=NotOlderThan&limit=2",
        )
        .await
        .unwrap()
        .unwrap(),
    )
    .await;
    assert_eq!(names(&first), ["one", "two"]);
    assert_eq!(first["metadata"]["remainingItemCount"], 1);
    let token = first["metadata"]["continue"].as_str().unwrap().to_owned();
    // Changes after the first page do not show in the next one.
    s.store
        .apply(EventType::Added, secret("ns-c", "four", 11, "web"));
    s.store
        .apply(EventType::Deleted, secret("ns-b", "three", 12, "web"));
    let next = format!("/api/v1/secrets?limit=2&continue={token}");
    let (_, second) = json(ask(&s, "alice", &next).await.unwrap().unwrap()).await;
    assert_eq!(names(&second), ["three"]);
    assert_eq!(second["metadata"]["resourceVersion"], "10");
    assert!(second["metadata"].get("continue").is_none());
}

/// Secrets at version 10 in namespaces `team` and `team-a`, whose keys etcd orders
/// `team-a/…` first (`-` sorts before `/`).
fn teams() -> Setup {
    let mut s = setup();
    s.store.replace(
        vec![
            secret("team", "a", 3, "web"),
            secret("team", "x", 4, "web"),
            secret("team-a", "b", 5, "web"),
            secret("team-a", "x", 6, "web"),
        ],
        10,
    );
    s
}

/// `namespace/name` of a list's items.
fn keys(list: &Value) -> Vec<String> {
    list["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| {
            format!(
                "{}/{}",
                i["metadata"]["namespace"].as_str().unwrap(),
                i["metadata"]["name"].as_str().unwrap()
            )
        })
        .collect()
}

/// Pages through `first` (a LIST with `limit=1`) and its continues: every item, the start
/// key each continue token carries, and each page's `remainingItemCount`.
async fn page_through(s: &Setup, first: &str) -> (Vec<String>, Vec<String>, Vec<u64>) {
    let base = first.split('?').next().unwrap();
    let (mut items, mut starts, mut remaining) = (Vec::new(), Vec::new(), Vec::new());
    let mut uri = first.to_owned();
    loop {
        let (status, page) = json(ask(s, "alice", &uri).await.unwrap().unwrap()).await;
        assert_eq!(status, StatusCode::OK, "{page}");
        items.extend(keys(&page));
        let Some(token) = page["metadata"]["continue"].as_str() else {
            assert!(page["metadata"].get("remainingItemCount").is_none());
            return (items, starts, remaining);
        };
        starts.push(continue_token::decode(token).unwrap().start);
        remaining.push(page["metadata"]["remainingItemCount"].as_u64().unwrap());
        uri = format!("{base}?limit=1&continue={token}");
    }
}

#[tokio::test]
async fn pages_across_namespaces_follow_the_apiservers_key_order() {
    let s = teams();
    let (items, starts, remaining) = page_through(
        &s,
        "/api/v1/secrets?resourceVersion=10&resourceVersionMatch=NotOlderThan&limit=1",
    )
    .await;
    assert_eq!(items, ["team-a/b", "team-a/x", "team/a", "team/x"]);
    assert_eq!(starts, ["team-a/b\0", "team-a/x\0", "team/a\0"]);
    assert_eq!(remaining, [3, 2, 1]);
}

#[tokio::test]
async fn a_namespaced_lists_tokens_carry_names_relative_to_the_namespace() {
    let s = teams();
    let (items, starts, remaining) = page_through(
        &s,
        "/api/v1/namespaces/team/secrets?resourceVersion=10&resourceVersionMatch=NotOlderThan&limit=1",
    )
    .await;
    assert_eq!(items, ["team/a", "team/x"]);
    assert_eq!(starts, ["a\0"]);
    assert_eq!(remaining, [1]);
}

#[tokio::test]
async fn tokens_an_apiserver_wrote_continue_in_the_cache() {
    let s = teams();
    let page = |uri: String| {
        let s = &s;
        async move { json(ask(s, "alice", &uri).await.unwrap().unwrap()).await.1 }
    };
    // In a namespace the token carries the name alone.
    let token = continue_token::encode_after(10, "a");
    let list = page(format!(
        "/api/v1/namespaces/team/secrets?limit=5&continue={token}"
    ))
    .await;
    assert_eq!(keys(&list), ["team/x"]);
    // Across namespaces, `namespace/name`: `team-a/x` is followed by `team/…`.
    let token = continue_token::encode_after(10, "team-a/x");
    let list = page(format!("/api/v1/secrets?limit=1&continue={token}")).await;
    assert_eq!(keys(&list), ["team/a"]);
    assert_eq!(list["metadata"]["remainingItemCount"], 1);
    assert_eq!(list["metadata"]["resourceVersion"], "10");
    // A start without the NUL includes its own key; a leading `/` is the same key.
    for start in ["team/a", "/team/a"] {
        let token = continue_token::encode(10, start);
        let list = page(format!("/api/v1/secrets?limit=5&continue={token}")).await;
        assert_eq!(keys(&list), ["team/a", "team/x"], "{start}");
    }
}

#[tokio::test]
async fn a_token_the_apiserver_refuses_goes_to_the_apiserver_for_its_400() {
    let s = teams();
    let good = continue_token::encode_after(10, "team/a");
    let json_of = |j: &str| {
        use base64::Engine;
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(j)
    };
    for token in [
        format!("{good}="),
        json_of(r#"{"v":"meta.k8s.io/v1","rv":10,"start":"team/../x"}"#),
        json_of(r#"{"v":"meta.k8s.io/v1","rv":0,"start":"team/a"}"#),
        json_of(r#"{"v":"meta.k8s.io/v2","rv":10,"start":"team/a"}"#),
        "garbage".to_owned(),
    ] {
        let uri = format!("/api/v1/secrets?limit=1&continue={token}");
        assert!(ask(&s, "alice", &uri).await.unwrap().is_none(), "{token}");
    }
    assert_eq!(
        s.policy.seen.lock().unwrap().len(),
        0,
        "refused before any review"
    );
}

#[tokio::test]
async fn an_inconsistent_continue_reads_the_latest_state_after_its_key() {
    // The apiserver hands out `rv: -1` with the 410 for a continue it compacted away: the
    // rest of the list at the latest version.
    let mut s = teams();
    s.store
        .apply(EventType::Added, secret("team", "b", 11, "web"));
    s.store
        .apply(EventType::Deleted, secret("team-a", "x", 12, "web"));
    let token = continue_token::encode_after(-1, "team-a/b");
    let uri = format!("/api/v1/secrets?limit=2&continue={token}");
    // A consistent read: upstream, unless the reader's rule accepts staleness.
    assert!(ask(&s, "alice", &uri).await.unwrap().is_none());
    s.store.set_connected(true);
    let answer = s
        .cache
        .serve(
            &info(&uri),
            reader(&user("alice"), &HeaderMap::new()),
            Some(Duration::from_secs(2)),
        )
        .await
        .unwrap()
        .unwrap();
    let (_, list) = json(answer).await;
    assert_eq!(keys(&list), ["team/a", "team/b"]);
    assert_eq!(list["metadata"]["resourceVersion"], "12");
    let next = continue_token::decode(list["metadata"]["continue"].as_str().unwrap()).unwrap();
    assert_eq!((next.rv, next.start.as_str()), (12, "team/b\0"));
    assert_eq!(list["metadata"]["remainingItemCount"], 1);
}

#[tokio::test(start_paused = true)]
async fn a_read_the_cache_cannot_prove_fresh_goes_upstream_at_once() {
    let s = seeded();
    // A consistent LIST, WATCH and WatchList, and a version the cache has not reached:
    // upstream, without waiting for the cache's watch to catch up.
    for uri in [
        "/api/v1/secrets",
        "/api/v1/namespaces/ns-a/secrets?limit=1",
        "/api/v1/secrets?watch=1",
        "/api/v1/secrets?watch=1&sendInitialEvents=true&resourceVersionMatch=NotOlderThan&allowWatchBookmarks=true",
        "/api/v1/secrets?resourceVersion=11",
        "/api/v1/secrets?resourceVersion=11&resourceVersionMatch=NotOlderThan",
        "/api/v1/secrets?watch=1&resourceVersion=500",
        "/api/v1/namespaces/ns-a/secrets/one?resourceVersion=11",
    ] {
        let started = Instant::now();
        assert!(ask(&s, "alice", uri).await.unwrap().is_none(), "{uri}");
        assert_eq!(started.elapsed(), Duration::ZERO, "{uri}");
    }
    // What the cache has reached, it answers.
    for uri in [
        "/api/v1/secrets?resourceVersion=0",
        "/api/v1/secrets?resourceVersion=10",
        "/api/v1/secrets?resourceVersion=10&resourceVersionMatch=NotOlderThan",
        "/api/v1/namespaces/ns-a/secrets/one?resourceVersion=3",
    ] {
        assert!(ask(&s, "alice", uri).await.unwrap().is_some(), "{uri}");
    }
}

#[tokio::test(start_paused = true)]
async fn bounded_staleness_serves_a_recently_connected_cache_only() {
    let mut s = seeded();
    let staleness = Some(Duration::from_secs(2));
    let request = info("/api/v1/secrets");
    s.store.set_connected(true);
    assert!(
        s.cache
            .serve(
                &request,
                reader(&user("alice"), &HeaderMap::new()),
                staleness
            )
            .await
            .unwrap()
            .is_some()
    );
    s.store.set_connected(false);
    tokio::time::advance(Duration::from_secs(1)).await;
    assert!(
        s.cache
            .serve(
                &request,
                reader(&user("alice"), &HeaderMap::new()),
                staleness
            )
            .await
            .unwrap()
            .is_some()
    );
    tokio::time::advance(Duration::from_secs(2)).await;
    assert!(
        s.cache
            .serve(
                &request,
                reader(&user("alice"), &HeaderMap::new()),
                staleness
            )
            .await
            .unwrap()
            .is_none()
    );
}

#[tokio::test(start_paused = true)]
async fn a_watch_streams_the_ring_then_live_events() {
    let mut s = seeded();
    s.store
        .apply(EventType::Modified, secret("ns-a", "one", 11, "web"));
    let mut body = ask(&s, "alice", "/api/v1/secrets?watch=1&resourceVersion=10")
        .await
        .unwrap()
        .unwrap()
        .into_body();
    s.store
        .apply(EventType::Deleted, secret("ns-a", "two", 12, "db"));
    let got = lines(&mut body, 2).await;
    assert_eq!(got[0]["type"], "MODIFIED");
    assert_eq!(got[0]["object"]["kind"], "Secret");
    assert_eq!(got[0]["object"]["metadata"]["resourceVersion"], "11");
    assert_eq!(got[1]["type"], "DELETED");
    assert_eq!(got[1]["object"]["metadata"]["name"], "two");
}

/// Watches of secrets that went upstream as misses so far.
fn watch_misses(s: &Setup) -> u64 {
    s.metrics
        .cache_requests_total
        .with_label_values(&["secrets", "watch", "miss"])
        .get()
}

#[tokio::test(start_paused = true)]
async fn a_watch_older_or_newer_than_the_cache_goes_upstream_never_410() {
    let mut s = setup_with(
        config::Cache {
            ring_size: 2,
            ..config()
        },
        None,
    );
    s.store.replace(vec![secret("ns-a", "one", 3, "web")], 10);
    for rv in 11..15 {
        s.store
            .apply(EventType::Modified, secret("ns-a", "one", rv, "web"));
    }
    // The ring holds 13 and 14: a watch from 12 on is the cache's, one from before is the
    // apiserver's to stream (its watch cache reaches further back) or to answer 410.
    for rv in [5, 10, 11] {
        let uri = format!("/api/v1/secrets?watch=1&resourceVersion={rv}");
        assert!(ask(&s, "alice", &uri).await.unwrap().is_none(), "{uri}");
    }
    assert_eq!(watch_misses(&s), 3);
    let mut body = ask(&s, "alice", "/api/v1/secrets?watch=1&resourceVersion=12")
        .await
        .unwrap()
        .unwrap()
        .into_body();
    let got = lines(&mut body, 2).await;
    let versions: Vec<&Value> = got
        .iter()
        .map(|e| &e["object"]["metadata"]["resourceVersion"])
        .collect();
    assert_eq!(versions, ["13", "14"]);
    assert_eq!(got[0]["type"], "MODIFIED");

    // Newer than the cache: upstream at once, where the apiserver decides between
    // waiting for it and 504 ResourceVersionTooLarge.
    assert!(
        ask(&s, "alice", "/api/v1/secrets?watch=1&resourceVersion=500")
            .await
            .unwrap()
            .is_none()
    );
    assert_eq!(watch_misses(&s), 4);
}

#[tokio::test(start_paused = true)]
async fn after_a_relist_a_watch_or_a_page_from_before_it_goes_upstream() {
    // What every client sees after Bulwark restarts: the new cache starts at the version it
    // listed, later than the version each client resumes from.
    let mut s = seeded();
    s.store.replace(
        vec![
            secret("ns-a", "one", 12, "web"),
            secret("ns-b", "three", 5, "web"),
        ],
        20,
    );
    assert!(
        ask(&s, "alice", "/api/v1/secrets?watch=1&resourceVersion=10")
            .await
            .unwrap()
            .is_none()
    );
    // So does a page of a list from before it (from etcd, or the apiserver's own 410
    // once compacted).
    let token = continue_token::encode_after(10, "ns-a/one");
    let uri = format!("/api/v1/secrets?limit=1&continue={token}");
    assert!(ask(&s, "alice", &uri).await.unwrap().is_none());
    // No review was asked for: the apiserver authorizes what goes to it.
    assert!(s.policy.seen.lock().unwrap().is_empty());
    // From the version listed on, the cache streams.
    let mut body = ask(&s, "alice", "/api/v1/secrets?watch=1&resourceVersion=20")
        .await
        .unwrap()
        .unwrap()
        .into_body();
    s.store
        .apply(EventType::Deleted, secret("ns-b", "three", 21, "web"));
    let got = lines(&mut body, 1).await;
    assert_eq!(got[0]["type"], "DELETED");
    assert_eq!(got[0]["object"]["metadata"]["resourceVersion"], "21");
}

#[tokio::test(start_paused = true)]
async fn a_planned_watch_keeps_its_events_while_admission_decides() {
    // Between the plan and the answer the ring moves on past the watch's version: the
    // answer still streams every event after it, not a 410.
    let mut s = setup_with(
        config::Cache {
            ring_size: 2,
            ..config()
        },
        None,
    );
    s.store.replace(vec![secret("ns-a", "one", 3, "web")], 10);
    s.store
        .apply(EventType::Modified, secret("ns-a", "one", 11, "web"));
    let request = info("/api/v1/secrets?watch=1&resourceVersion=10");
    let headers = HeaderMap::new();
    let plan = s.cache.plan(&request, &headers, None).expect("planned");
    for rv in 12..16 {
        s.store
            .apply(EventType::Modified, secret("ns-a", "one", rv, "web"));
    }
    let alice = user("alice");
    let response = s
        .cache
        .answer(plan, &request, reader(&alice, &headers), None)
        .await
        .unwrap();
    let mut body = response.into_body();
    let got = lines(&mut body, 5).await;
    let versions: Vec<&Value> = got
        .iter()
        .map(|e| &e["object"]["metadata"]["resourceVersion"])
        .collect();
    assert_eq!(versions, ["11", "12", "13", "14", "15"]);
}

#[tokio::test(start_paused = true)]
async fn a_selector_watch_sees_an_object_leave_as_deleted() {
    let mut s = seeded();
    let mut body = ask(
        &s,
        "alice",
        "/api/v1/secrets?watch=1&resourceVersion=10&labelSelector=app%3Dweb",
    )
    .await
    .unwrap()
    .unwrap()
    .into_body();
    s.store
        .apply(EventType::Modified, secret("ns-a", "one", 11, "db"));
    s.store
        .apply(EventType::Modified, secret("ns-a", "two", 12, "web"));
    let got = lines(&mut body, 2).await;
    assert_eq!(got[0]["type"], "DELETED");
    assert_eq!(got[0]["object"]["metadata"]["name"], "one");
    assert_eq!(got[0]["object"]["metadata"]["resourceVersion"], "11");
    assert_eq!(got[0]["object"]["metadata"]["labels"]["app"], "web");
    assert_eq!(got[1]["type"], "ADDED");
    assert_eq!(got[1]["object"]["metadata"]["name"], "two");
}

#[tokio::test(start_paused = true)]
async fn a_watch_list_ends_its_initial_state_with_the_annotated_bookmark() {
    let s = seeded();
    let uri = "/api/v1/namespaces/ns-a/secrets?watch=1&sendInitialEvents=true&resourceVersionMatch=NotOlderThan&resourceVersion=0&allowWatchBookmarks=true";
    let mut body = ask(&s, "alice", uri).await.unwrap().unwrap().into_body();
    let got = lines(&mut body, 3).await;
    assert_eq!(got[0]["type"], "ADDED");
    assert_eq!(got[1]["type"], "ADDED");
    assert_eq!(got[2]["type"], "BOOKMARK");
    assert_eq!(got[2]["object"]["metadata"]["resourceVersion"], "10");
    assert_eq!(
        got[2]["object"]["metadata"]["annotations"]["k8s.io/initial-events-end"],
        "true"
    );
}

/// Alice's watch of every Secret from version 10 of an empty store, with bookmarks every
/// 5 s (over `cfg`'s interval) and a timeout of `timeout_seconds`.
async fn bookmarked_watch(cfg: config::Cache, timeout_seconds: u64) -> (Setup, Body) {
    let mut s = setup_with(
        config::Cache {
            bookmark_interval: Duration::from_secs(5),
            ..cfg
        },
        None,
    );
    s.store.replace(Vec::new(), 10);
    let path = format!(
        "/api/v1/secrets?watch=1&resourceVersion=10&allowWatchBookmarks=true&timeoutSeconds={timeout_seconds}"
    );
    let body = ask(&s, "alice", &path).await.unwrap().unwrap().into_body();
    (s, body)
}

#[tokio::test(start_paused = true)]
async fn bookmarks_come_when_allowed_and_the_stream_ends_at_its_timeout() {
    let (mut s, mut body) = bookmarked_watch(config(), 7).await;
    s.store.advance(15);
    let got = lines(&mut body, 1).await;
    assert_eq!(got[0]["type"], "BOOKMARK");
    assert_eq!(got[0]["object"]["metadata"]["resourceVersion"], "15");
    let started = Instant::now();
    assert!(body.frame().await.is_none());
    assert_eq!(started.elapsed(), Duration::from_secs(2));
}

/// The watch's one timer is set to the earliest of its bookmark, its re-authorization and
/// its deadline: events delivered meanwhile move none of them.
#[tokio::test(start_paused = true)]
async fn a_bookmark_and_the_end_come_on_time_while_events_keep_coming() {
    let cfg = config::Cache {
        reauthorize_interval: Duration::from_secs(3),
        ..config()
    };
    let (mut s, mut body) = bookmarked_watch(cfg, 12).await;
    let started = Instant::now();
    // Each line with when it arrived, read as it comes.
    let reader = tokio::spawn(async move {
        let mut seen = Vec::new();
        loop {
            let got = lines(&mut body, 1).await;
            let Some(line) = got.first() else {
                return (seen, started.elapsed());
            };
            let kind = line["type"].as_str().unwrap_or_default().to_owned();
            seen.push((started.elapsed(), kind));
        }
    });
    // An event every second, between the timer's ends (0.7 s, 1.7 s, ...).
    tokio::time::sleep(Duration::from_millis(700)).await;
    for (i, rv) in (11..22).enumerate() {
        s.store.apply(
            EventType::Added,
            secret("ns-a", &format!("s-{i}"), rv, "web"),
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let (seen, ended) = reader.await.unwrap();
    let at = |kind: &str| -> Vec<Duration> {
        seen.iter()
            .filter(|(_, k)| k == kind)
            .map(|(at, _)| *at)
            .collect()
    };
    assert_eq!(
        at("BOOKMARK"),
        [Duration::from_secs(5), Duration::from_secs(10)]
    );
    assert_eq!(at("ADDED").len(), 11);
    assert_eq!(ended, Duration::from_secs(12));
}

#[tokio::test(start_paused = true)]
async fn a_zero_watch_timeout_is_unset_and_a_negative_one_ends_the_watch_at_once() {
    let mut s = seeded();
    let uri = |t: &str| format!("/api/v1/secrets?watch=1&resourceVersion=11&timeoutSeconds={t}");
    // 0 is "unset" to the apiserver: a random 30 to 60 minutes, not an immediate end.
    let zero = "/api/v1/secrets?watch=1&resourceVersion=10&timeoutSeconds=0";
    let mut body = ask(&s, "alice", zero).await.unwrap().unwrap().into_body();
    tokio::time::sleep(Duration::from_secs(29 * 60)).await;
    s.store
        .apply(EventType::Added, secret("ns-a", "four", 11, "web"));
    assert_eq!(lines(&mut body, 1).await[0]["type"], "ADDED");
    let started = Instant::now();
    assert!(body.frame().await.is_none());
    assert!(started.elapsed() <= Duration::from_secs(31 * 60));
    // A negative value is a deadline already past; so is i64::MAX, whose product in
    // nanoseconds wraps negative in Go. Both are 200s that end at once, never a 400 (after
    // the events the watch starts with: none here, from the current version).
    for t in ["-1", "9223372036854775807"] {
        let response = ask(&s, "alice", &uri(t)).await.unwrap().unwrap();
        assert_eq!(response.status(), StatusCode::OK, "{t}");
        let mut body = response.into_body();
        let started = Instant::now();
        assert!(body.frame().await.is_none(), "{t}");
        assert_eq!(started.elapsed(), Duration::ZERO, "{t}");
    }
    // The longest timeout Go can count (292 years) is kept without overflowing a clock.
    let mut body = ask(&s, "alice", &uri("9223372036"))
        .await
        .unwrap()
        .unwrap()
        .into_body();
    let hour = Duration::from_secs(3600);
    assert!(tokio::time::timeout(hour, body.frame()).await.is_err());
}

#[tokio::test(start_paused = true)]
async fn revoking_access_closes_an_open_watch_but_a_failing_review_does_not() {
    let cfg = config::Cache {
        reauthorize_interval: Duration::from_secs(30),
        access_review_ttl: Duration::from_secs(1),
        ..config()
    };
    let mut s = setup_with(cfg, None);
    s.store.replace(Vec::new(), 10);
    let mut body = ask(&s, "alice", "/api/v1/secrets?watch=1&resourceVersion=10")
        .await
        .unwrap()
        .unwrap()
        .into_body();
    // A failing review keeps the watch open: events still arrive after several rounds.
    s.policy.failing.store(true, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(120)).await;
    s.store
        .apply(EventType::Added, secret("ns-a", "one", 11, "web"));
    assert_eq!(lines(&mut body, 1).await[0]["type"], "ADDED");
    // A deny closes it within a round.
    s.policy.failing.store(false, Ordering::SeqCst);
    s.policy.denied.lock().unwrap().insert("alice".into());
    let started = Instant::now();
    assert!(body.frame().await.is_none());
    assert!(started.elapsed() <= Duration::from_secs(37));
}

#[tokio::test(start_paused = true)]
async fn a_relist_ends_every_open_watch() {
    let mut s = seeded();
    let mut body = ask(&s, "alice", "/api/v1/secrets?watch=1&resourceVersion=10")
        .await
        .unwrap()
        .unwrap()
        .into_body();
    s.store.replace(Vec::new(), 20);
    assert!(body.frame().await.is_none());
}

#[tokio::test(start_paused = true)]
async fn a_slow_watcher_is_disconnected_while_the_others_keep_receiving() {
    let mut s = setup_with(
        config::Cache {
            watcher_buffer: 8,
            ..config()
        },
        None,
    );
    s.store.replace(Vec::new(), 10);
    let uri = "/api/v1/secrets?watch=1&resourceVersion=10";
    let mut slow = ask(&s, "alice", uri).await.unwrap().unwrap().into_body();
    let mut fast = ask(&s, "alice", uri).await.unwrap().unwrap().into_body();
    for rv in 11..41 {
        s.store
            .apply(EventType::Added, secret("ns", &format!("s{rv}"), rv, "web"));
        // The fast one reads every event as it comes.
        assert_eq!(lines(&mut fast, 1).await.len(), 1);
    }
    // The slow one fell 30 events behind a buffer of 8: it gets what it had, then its
    // stream ends (long before its timeout).
    let started = Instant::now();
    while let Some(frame) = slow.frame().await {
        frame.unwrap();
    }
    assert!(started.elapsed() < Duration::from_secs(1));
    s.store
        .apply(EventType::Added, secret("ns", "late", 41, "web"));
    assert_eq!(
        lines(&mut fast, 1).await[0]["object"]["metadata"]["name"],
        "late"
    );
    assert!(
        s.metrics
            .render()
            .contains("bulwark_cache_slow_watchers_total{resource=\"secrets\"} 1")
    );
}

#[tokio::test(start_paused = true)]
async fn one_encoding_per_event_for_a_thousand_watchers() {
    let mut s = setup_with(
        config::Cache {
            watcher_buffer: 16,
            ..config()
        },
        None,
    );
    s.store.replace(Vec::new(), 10);
    let mut bodies = Vec::new();
    for _ in 0..1000 {
        bodies.push(
            ask(&s, "alice", "/api/v1/secrets?watch=1&resourceVersion=10")
                .await
                .unwrap()
                .unwrap()
                .into_body(),
        );
    }
    let before = s.cache.event_encodings();
    s.store
        .apply(EventType::Added, secret("ns", "x", 11, "web"));
    for body in &mut bodies {
        assert_eq!(lines(body, 1).await[0]["type"], "ADDED");
    }
    assert_eq!(s.cache.event_encodings() - before, 1);
}

#[tokio::test]
async fn gzip_is_honoured_for_large_answers() {
    let mut s = setup();
    let objects = (0..100)
        .map(|i| {
            let raw = format!(
                "{{\"metadata\":{{\"name\":\"s{i:03}\",\"namespace\":\"ns\",\"resourceVersion\":\"{}\"}},\"data\":{{\"k\":\"{}\"}}}}",
                i + 1,
                "A".repeat(4000)
            );
            Obj::parse(raw.as_bytes()).unwrap()
        })
        .collect();
    s.store.replace(objects, 200);
    let mut headers = HeaderMap::new();
    headers.insert("accept-encoding", "gzip".parse().unwrap());
    let response = s
        .cache
        .serve(
            &info("/api/v1/secrets?resourceVersion=0"),
            reader(&user("alice"), &headers),
            None,
        )
        .await
        .unwrap()
        .unwrap();
    assert_eq!(response.headers()["content-encoding"], "gzip");
    let zipped = response.into_body().collect().await.unwrap().to_bytes();
    let mut plain = Vec::new();
    std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&zipped[..]), &mut plain).unwrap();
    let list: Value = serde_json::from_slice(&plain).unwrap();
    assert_eq!(list["items"].as_array().unwrap().len(), 100);
    // The second answer comes from the LRU of encoded lists.
    let again = s
        .cache
        .serve(
            &info("/api/v1/secrets?resourceVersion=0"),
            reader(&user("alice"), &headers),
            None,
        )
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        again.into_body().collect().await.unwrap().to_bytes(),
        zipped
    );
}

#[tokio::test]
async fn a_small_answer_to_a_gzip_reader_is_plain_every_time() {
    // Under the gzip threshold the answer is sent as it is: its reuse from the LRU of
    // encoded lists must not say it is gzipped (it once did, and clients failed to read it).
    let mut s = setup();
    s.store.replace(vec![secret("ns", "a", 1, "web")], 1);
    let mut headers = HeaderMap::new();
    headers.insert("accept-encoding", "gzip".parse().unwrap());
    let mut bodies = Vec::new();
    for _ in 0..2 {
        let response = s
            .cache
            .serve(
                &info("/api/v1/secrets?resourceVersion=0"),
                reader(&user("alice"), &headers),
                None,
            )
            .await
            .unwrap()
            .unwrap();
        assert!(
            response.headers().get("content-encoding").is_none(),
            "a plain answer labelled {:?}",
            response.headers().get("content-encoding")
        );
        let body = response.into_body().collect().await.unwrap().to_bytes();
        let list: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(list["items"].as_array().unwrap().len(), 1);
        bodies.push(body);
    }
    assert_eq!(bodies[0], bodies[1]);
}

#[tokio::test]
async fn secret_reads_are_audited() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("audit.jsonl");
    let audit = audit_log(&path);
    let mut s = setup_with(config(), Some(audit.clone()));
    s.store.replace(vec![secret("ns-a", "one", 3, "web")], 10);
    let mut headers = HeaderMap::new();
    headers.insert("audit-id", "given-id".parse().unwrap());
    let response = s
        .cache
        .serve(
            &info("/api/v1/namespaces/ns-a/secrets/one?resourceVersion=0"),
            reader(&user("alice"), &headers),
            None,
        )
        .await
        .unwrap()
        .unwrap();
    assert_eq!(response.headers()["audit-id"], "given-id");
    ask(&s, "alice", "/api/v1/secrets?resourceVersion=0")
        .await
        .unwrap()
        .unwrap();
    audit.file().flush();
    let text = std::fs::read_to_string(&path).unwrap();
    let events: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(events.len(), 2);
    assert_eq!(events[0]["auditID"], "given-id");
    assert_eq!(events[0]["verb"], "get");
    assert_eq!(events[0]["objectRef"]["name"], "one");
    assert_eq!(events[0]["user"]["username"], "alice");
    assert_eq!(events[1]["verb"], "list");
    assert_ne!(events[1]["auditID"], "given-id");
}

#[tokio::test]
async fn refused_secret_reads_are_audited_with_the_clients_address() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("audit.jsonl");
    let audit = audit_log(&path);
    let mut s = setup_with(config(), Some(audit.clone()));
    s.store.replace(vec![secret("ns-a", "one", 3, "web")], 10);
    s.policy.denied.lock().unwrap().insert("mallory".into());
    let mut headers = HeaderMap::new();
    headers.insert("x-forwarded-for", "10.9.9.9".parse().unwrap());
    let peer = Some("192.0.2.7".parse().unwrap());
    let mut audit_ids = Vec::new();
    for uri in [
        "/api/v1/namespaces/ns-a/secrets/one?resourceVersion=0",
        "/api/v1/namespaces/ns-a/secrets?watch=1&resourceVersion=0",
    ] {
        let error = s
            .cache
            .serve(
                &info(uri),
                Reader {
                    user: &user("mallory"),
                    headers: &headers,
                    peer,
                },
                None,
            )
            .await
            .unwrap_err();
        let response = refused(error);
        assert_eq!(response.status(), StatusCode::FORBIDDEN);
        audit_ids.push(response.headers()["audit-id"].to_str().unwrap().to_owned());
    }
    s.cache
        .serve(
            &info("/api/v1/secrets?resourceVersion=0"),
            Reader {
                user: &user("alice"),
                headers: &HeaderMap::new(),
                peer,
            },
            None,
        )
        .await
        .unwrap()
        .unwrap();
    audit.file().flush();
    let text = std::fs::read_to_string(&path).unwrap();
    let events: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(events.len(), 3);
    let (get, watch, list) = (&events[0], &events[1], &events[2]);
    assert_eq!(get["verb"], "get");
    assert_eq!(get["objectRef"]["name"], "one");
    assert_eq!(get["user"]["username"], "mallory");
    assert_eq!(get["responseStatus"]["code"], 403);
    assert_eq!(get["stage"], "ResponseComplete");
    assert_eq!(get["auditID"], audit_ids[0].as_str());
    assert_eq!(
        get["sourceIPs"],
        serde_json::json!(["10.9.9.9", "192.0.2.7"])
    );
    assert_eq!(watch["verb"], "watch");
    assert_eq!(watch["responseStatus"]["code"], 403);
    assert_eq!(watch["stage"], "ResponseComplete");
    assert_eq!(watch["auditID"], audit_ids[1].as_str());
    assert_eq!(list["responseStatus"]["code"], 200);
    assert_eq!(list["sourceIPs"], serde_json::json!(["192.0.2.7"]));
}

/// The recorded apiserver exchanges of `fixtures/kube-apiserver-v1.36/`.
fn fixture(name: &str) -> Vec<Value> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../fixtures/kube-apiserver-v1.36/"
    );
    serde_json::from_str(&std::fs::read_to_string(format!("{path}{name}")).unwrap()).unwrap()
}

fn key_order(value: &str) -> Vec<String> {
    // Top-level keys in the order they appear.
    let map: serde_json::Map<String, Value> = serde_json::from_str(value).unwrap();
    let mut keys: Vec<(usize, String)> = map
        .keys()
        .map(|k| (value.find(&format!("\"{k}\":")).unwrap(), k.clone()))
        .collect();
    keys.sort();
    keys.into_iter().map(|(_, k)| k).collect()
}

#[tokio::test(start_paused = true)]
async fn answers_have_the_shape_of_the_recorded_apiserver() {
    // A cache of Pods, fed with the recorded list, answers like the recorded apiserver.
    let recorded = fixture("pod-list.json");
    let list_text = recorded[0]["response_body"].as_str().unwrap();
    let list: Value = serde_json::from_str(list_text).unwrap();
    let cfg = config::Cache {
        resources: vec![config::GroupResource::core("pods")],
        ..config()
    };
    let s = setup_with(cfg, None);
    let mut store = Writer::new(Kind::new("", "v1", "pods", "Pod", true), 100, 100);
    let cache = Cache::build(
        &config::Cache {
            resources: vec![config::GroupResource::core("pods")],
            ..config()
        },
        Arc::new(s.policy.clone()),
        Metrics::new(),
        None,
    );
    let _ = cache.resources[0].store.set(store.as_reader());
    let rv: u64 = list["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    #[derive(serde::Deserialize)]
    struct Raw<'a> {
        #[serde(borrow)]
        items: Vec<&'a serde_json::value::RawValue>,
    }
    let raw: Raw<'_> = serde_json::from_str(list_text).unwrap();
    let items = raw
        .items
        .iter()
        .map(|i| Obj::parse(i.get().as_bytes()).unwrap())
        .collect();
    store.replace(items, rv);
    let request = info("/api/v1/namespaces/kube-system/pods?resourceVersion=0");
    let response = cache
        .serve(&request, reader(&user("alice"), &HeaderMap::new()), None)
        .await
        .unwrap()
        .unwrap();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    let ours = std::str::from_utf8(&body).unwrap();
    assert_eq!(key_order(ours), key_order(list_text));
    assert!(ours.ends_with("]}\n") && list_text.ends_with("]}\n"));
    assert_eq!(ours, list_text, "the same objects give the same bytes");

    // WatchList framing and the initial-events-end bookmark, byte for byte but the version.
    let recorded = fixture("watch_event-watch_pods_without_initial_events.json");
    let stream = recorded[0]["response_body"].as_str().unwrap();
    let their_lines: Vec<&str> = stream.lines().collect();
    let uri = "/api/v1/namespaces/kube-system/pods?&allowWatchBookmarks=true&resourceVersion=0&resourceVersionMatch=NotOlderThan&sendInitialEvents=true&watch=true";
    let mut body = cache
        .serve(&info(uri), reader(&user("alice"), &HeaderMap::new()), None)
        .await
        .unwrap()
        .unwrap()
        .into_body();
    let mut text = Vec::new();
    while text.iter().filter(|b| **b == b'\n').count() < their_lines.len() {
        let frame = body.frame().await.unwrap().unwrap();
        text.extend_from_slice(frame.data_ref().unwrap());
    }
    let text = String::from_utf8(text).unwrap();
    let our_lines: Vec<&str> = text.lines().collect();
    assert_eq!(our_lines.len(), their_lines.len());
    for (ours, theirs) in our_lines.iter().zip(&their_lines) {
        assert_eq!(key_order(ours), key_order(theirs));
        let (a, b): (Value, Value) = (
            serde_json::from_str(ours).unwrap(),
            serde_json::from_str(theirs).unwrap(),
        );
        assert_eq!(a["type"], b["type"]);
        assert_eq!(
            a["object"]["metadata"]["name"],
            b["object"]["metadata"]["name"]
        );
        assert_eq!(a["object"]["kind"], b["object"]["kind"]);
    }
    let their_bookmark = their_lines.last().unwrap();
    let their_rv = serde_json::from_str::<Value>(their_bookmark).unwrap()["object"]["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(
        our_lines
            .last()
            .unwrap()
            .replace(&format!("\"{rv}\""), &format!("\"{their_rv}\"")),
        *their_bookmark
    );
    // Added objects carry kind and apiVersion first, as the recorded ones.
    assert!(our_lines[0].starts_with(
        "{\"type\":\"ADDED\",\"object\":{\"kind\":\"Pod\",\"apiVersion\":\"v1\",\"metadata\""
    ));
    assert!(their_lines[0].starts_with(
        "{\"type\":\"ADDED\",\"object\":{\"kind\":\"Pod\",\"apiVersion\":\"v1\",\"metadata\""
    ));
}

/// Alice's answer from the cache to `uri`, asked as a client-go reader that prefers
/// protobuf (kubelet's `Accept`); panics when the cache does not answer.
async fn ask_protobuf(s: &Setup, uri: &str) -> Response<Body> {
    let mut headers = HeaderMap::new();
    headers.insert(
        "accept",
        "application/vnd.kubernetes.protobuf,application/json"
            .parse()
            .unwrap(),
    );
    s.cache
        .serve(&info(uri), reader(&user("alice"), &headers), None)
        .await
        .unwrap()
        .expect("a protobuf reader is answered from the cache")
}

/// The message inside a `k8s\0` + `runtime.Unknown` body, with the envelope's kind.
fn unwrap_protobuf(bytes: &[u8]) -> (String, Vec<u8>) {
    use prost::Message;
    assert_eq!(&bytes[..4], b"k8s\0", "the protobuf magic");
    let unknown = k8s_pb::apimachinery::pkg::runtime::Unknown::decode(&bytes[4..]).unwrap();
    let kind = unknown.type_meta.unwrap().kind.unwrap();
    (kind, unknown.raw.unwrap())
}

#[tokio::test]
async fn protobuf_readers_get_the_same_list_and_object_in_protobuf() {
    use k8s_pb::api::core::v1 as pb;
    use prost::Message;
    let s = seeded();
    let uri = "/api/v1/namespaces/ns-a/secrets?resourceVersion=0";
    let response = ask_protobuf(&s, uri).await;
    assert_eq!(
        response.headers()["content-type"],
        "application/vnd.kubernetes.protobuf"
    );
    let body = response.into_body().collect().await.unwrap().to_bytes();
    let (kind, raw) = unwrap_protobuf(&body);
    assert_eq!(kind, "SecretList");
    let list = pb::SecretList::decode(raw.as_slice()).unwrap();
    assert_eq!(
        list.metadata.unwrap().resource_version.as_deref(),
        Some("10")
    );
    // The same objects as the JSON answer, field for field where it matters.
    let (_, json_list) = json(ask(&s, "alice", uri).await.unwrap().unwrap()).await;
    let json_items = json_list["items"].as_array().unwrap();
    assert_eq!(list.items.len(), json_items.len());
    for (item, expected) in list.items.iter().zip(json_items) {
        let meta = item.metadata.as_ref().unwrap();
        assert_eq!(meta.name.as_deref(), expected["metadata"]["name"].as_str());
        assert_eq!(
            meta.resource_version.as_deref(),
            expected["metadata"]["resourceVersion"].as_str()
        );
        assert_eq!(meta.labels["app"], expected["metadata"]["labels"]["app"]);
        assert_eq!(item.data["k"], b"value", "data as bytes, not base64");
    }

    let one = "/api/v1/namespaces/ns-a/secrets/one?resourceVersion=0";
    let response = ask_protobuf(&s, one).await;
    let body = response.into_body().collect().await.unwrap().to_bytes();
    let (kind, raw) = unwrap_protobuf(&body);
    assert_eq!(kind, "Secret");
    let secret = pb::Secret::decode(raw.as_slice()).unwrap();
    assert_eq!(secret.metadata.unwrap().uid.as_deref(), Some("u-one"));
}

#[tokio::test]
async fn a_protobuf_page_carries_the_continue_token_and_remaining_count() {
    use prost::Message;
    let s = seeded();
    let uri = "/api/v1/secrets?resourceVersion=10&resourceVersionMatch=NotOlderThan&limit=2";
    let response = ask_protobuf(&s, uri).await;
    let body = response.into_body().collect().await.unwrap().to_bytes();
    let (_, raw) = unwrap_protobuf(&body);
    let list = k8s_pb::api::core::v1::SecretList::decode(raw.as_slice()).unwrap();
    let (_, json_page) = json(ask(&s, "alice", uri).await.unwrap().unwrap()).await;
    let meta = list.metadata.unwrap();
    assert_eq!(list.items.len(), 2);
    assert_eq!(
        meta.r#continue.as_deref(),
        json_page["metadata"]["continue"].as_str(),
        "the same token as the JSON page"
    );
    assert_eq!(meta.remaining_item_count, Some(1));
}

/// The protobuf watch events in `body` until `n` are read: (type, the object's message).
async fn frames(body: &mut Body, n: usize) -> Vec<(String, Vec<u8>)> {
    use prost::Message;
    let mut buffer = Vec::new();
    let mut events = Vec::new();
    while events.len() < n {
        let frame = body.frame().await.expect("the stream goes on").unwrap();
        buffer.extend_from_slice(&frame.into_data().unwrap());
        while buffer.len() >= 4 {
            let len = u32::from_be_bytes(buffer[..4].try_into().unwrap()) as usize;
            if buffer.len() < 4 + len {
                break;
            }
            let event =
                k8s_pb::apimachinery::pkg::apis::meta::v1::WatchEvent::decode(&buffer[4..4 + len])
                    .unwrap();
            let object = event.object.unwrap().raw.unwrap();
            let (_, raw) = unwrap_protobuf(&object);
            events.push((event.r#type.unwrap(), raw));
            buffer.drain(..4 + len);
        }
    }
    events
}

#[tokio::test(start_paused = true)]
async fn a_protobuf_watch_list_sends_frames_and_ends_with_the_annotated_bookmark() {
    use k8s_pb::api::core::v1 as pb;
    use prost::Message;
    let mut s = seeded();
    let uri = "/api/v1/namespaces/ns-a/secrets?watch=1&sendInitialEvents=true&resourceVersionMatch=NotOlderThan&resourceVersion=0&allowWatchBookmarks=true";
    let response = ask_protobuf(&s, uri).await;
    assert_eq!(
        response.headers()["content-type"],
        "application/vnd.kubernetes.protobuf;stream=watch"
    );
    let mut body = response.into_body();
    let got = frames(&mut body, 3).await;
    let types: Vec<&str> = got.iter().map(|(t, _)| t.as_str()).collect();
    assert_eq!(types, ["ADDED", "ADDED", "BOOKMARK"]);
    let first = pb::Secret::decode(got[0].1.as_slice()).unwrap();
    assert_eq!(first.metadata.unwrap().name.as_deref(), Some("one"));
    let bookmark = pb::Secret::decode(got[2].1.as_slice()).unwrap();
    let meta = bookmark.metadata.unwrap();
    assert_eq!(meta.resource_version.as_deref(), Some("10"));
    assert_eq!(meta.annotations["k8s.io/initial-events-end"], "true");

    // A change after the initial state: one MODIFIED frame, encoded once for every
    // protobuf watcher.
    s.store
        .apply(EventType::Modified, secret("ns-a", "two", 11, "db"));
    let got = frames(&mut body, 1).await;
    assert_eq!(got[0].0, "MODIFIED");
    let two = pb::Secret::decode(got[0].1.as_slice()).unwrap();
    assert_eq!(
        two.metadata.unwrap().resource_version.as_deref(),
        Some("11")
    );
}

#[tokio::test]
async fn a_cached_object_that_does_not_convert_is_a_500_audited_never_a_different_object() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("audit.jsonl");
    let audit = audit_log(&path);
    let mut s = setup_with(config(), Some(audit.clone()));
    // The store reads only metadata; `data` that is not base64 is no Secret.
    let broken = br#"{"metadata":{"name":"bad","namespace":"ns-a","resourceVersion":"3"},"data":{"k":"not base64!"}}"#;
    s.store.replace(vec![Obj::parse(broken).unwrap()], 10);
    let mut headers = HeaderMap::new();
    headers.insert(
        "accept",
        "application/vnd.kubernetes.protobuf,application/json"
            .parse()
            .unwrap(),
    );
    for uri in [
        "/api/v1/namespaces/ns-a/secrets/bad?resourceVersion=0",
        "/api/v1/namespaces/ns-a/secrets?resourceVersion=0",
    ] {
        let error = s
            .cache
            .serve(&info(uri), reader(&user("alice"), &headers), None)
            .await
            .unwrap_err();
        let CacheError::Status(status, _) = &error else {
            panic!("{uri}: {error:?}");
        };
        assert_eq!(
            (status.code, status.reason.as_str()),
            (500, "InternalError")
        );
        assert!(status.message.contains("Secret"), "{}", status.message);
    }
    audit.file().flush();
    let text = std::fs::read_to_string(&path).unwrap();
    let codes: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap()["responseStatus"]["code"].clone())
        .collect();
    assert_eq!(codes, [500, 500], "each failed read audited");
    // JSON readers still get the object as it is.
    let response = ask(
        &s,
        "alice",
        "/api/v1/namespaces/ns-a/secrets/bad?resourceVersion=0",
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
}

#[tokio::test]
async fn what_the_apiserver_refuses_goes_to_it_for_its_400_or_406() {
    let s = seeded();
    // A label key with a name over 63 bytes, or a prefix over 253: the apiserver's 400.
    let long_name = "x".repeat(64);
    let long_prefix = format!("{}/x", "a".repeat(254));
    for key in [&long_name, &long_prefix] {
        for uri in [
            format!("/api/v1/secrets?resourceVersion=0&labelSelector={key}%3Da"),
            format!("/api/v1/secrets?watch=1&resourceVersion=0&labelSelector={key}"),
        ] {
            assert!(ask(&s, "alice", &uri).await.unwrap().is_none(), "{uri}");
        }
    }
    // The longest valid key is answered.
    let longest = format!("{}/{}", "a".repeat(253), "x".repeat(63));
    let uri = format!("/api/v1/secrets?resourceVersion=0&labelSelector=!{longest}");
    let (status, list) = json(ask(&s, "alice", &uri).await.unwrap().unwrap()).await;
    assert_eq!(status, 200);
    assert_eq!(names(&list).len(), 3);
    // An Accept of empty ranges accepts nothing: the apiserver's 406, not JSON.
    for accept in [",", ", ,"] {
        let mut headers = HeaderMap::new();
        headers.insert(http::header::ACCEPT, HeaderValue::from_static(accept));
        for uri in [
            "/api/v1/secrets?resourceVersion=0",
            "/api/v1/namespaces/ns-a/secrets/one?resourceVersion=0",
        ] {
            let answer = s
                .cache
                .serve(&info(uri), reader(&user("alice"), &headers), None)
                .await
                .unwrap();
            assert!(answer.is_none(), "{accept:?} {uri}");
        }
    }
}

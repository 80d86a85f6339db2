//! The requests of the differential suite, in order: each target gets the same sequence,
//! so their states move in step. A path may name values of an earlier answer of the same
//! target as `{case-id:/json/pointer}` (a continue token, a resourceVersion), since those
//! differ between the two apiservers.

use http::Method;
use serde_json::{Value, json};

/// The namespace the suite works in; nothing else in it.
pub const NS: &str = "differential";

pub struct Case {
    pub id: &'static str,
    pub method: Method,
    pub path: String,
    pub body: Option<Value>,
    /// Content-Type of the body, when not `application/json`.
    pub content_type: Option<&'static str>,
    /// A finite watch (`timeoutSeconds` set): read to its end, compared event by event.
    pub watch: bool,
    /// `Accept`, when not `application/json`.
    pub accept: Option<&'static str>,
    /// Compare only these JSON pointers of the body (a body that is not JSON: its length),
    /// for documents too large to read in a difference.
    pub fields: Option<&'static [&'static str]>,
}

fn case(id: &'static str, method: Method, path: impl Into<String>) -> Case {
    Case {
        id,
        method,
        path: path.into(),
        body: None,
        content_type: None,
        watch: false,
        accept: None,
        fields: None,
    }
}

fn get(id: &'static str, path: impl Into<String>) -> Case {
    case(id, Method::GET, path)
}

fn watch(id: &'static str, path: impl Into<String>) -> Case {
    Case {
        watch: true,
        ..get(id, path)
    }
}

fn with_accept(mut c: Case, accept: &'static str) -> Case {
    c.accept = Some(accept);
    c
}

fn with_fields(mut c: Case, fields: &'static [&'static str]) -> Case {
    c.fields = Some(fields);
    c
}

fn merge_patch(c: Case, body: Value) -> Case {
    Case {
        content_type: Some("application/merge-patch+json"),
        ..with_body(c, body)
    }
}

fn with_body(mut c: Case, body: Value) -> Case {
    c.body = Some(body);
    c
}

/// A Secret of the suite; every labelled one also carries `suite`, so that cluster-wide
/// lists can select the suite's objects alone.
fn secret(name: &str, mut labels: Value) -> Value {
    if let Some(map) = labels.as_object_mut().filter(|m| !m.is_empty()) {
        map.insert("suite".into(), json!("differential"));
    }
    json!({
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": NS, "labels": labels},
        "data": {"k": "dmFsdWU="},
    })
}

pub fn all() -> Vec<Case> {
    let ns = format!("/api/v1/namespaces/{NS}");
    let secrets = format!("{ns}/secrets");
    let mut cases = writes_that_set_up(&secrets);
    cases.extend(reads(&secrets));
    cases.extend(pages_and_versions(&ns, &secrets));
    cases.extend(updates_and_deletes(&secrets));
    cases.extend(dry_run(&secrets));
    cases.extend(watches(&secrets));
    cases.extend(openapi());
    cases
}

/// Writes that set up the state, compared like every other answer.
fn writes_that_set_up(secrets: &str) -> Vec<Case> {
    let mut cases = vec![
        with_body(
            case("create-namespace", Method::POST, "/api/v1/namespaces"),
            json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}),
        ),
        get("list-empty", secrets),
    ];
    let labelled = [
        ("a-0", json!({"app": "a"})),
        ("a-1", json!({"app": "a", "tier": "x"})),
        ("a-2", json!({"app": "a"})),
        ("b-0", json!({"app": "b", "tier": "x"})),
        ("b-1", json!({"app": "b"})),
        ("b-10", json!({"app": "b"})),
        ("c", json!({})),
    ];
    for (i, (name, labels)) in labelled.into_iter().enumerate() {
        const IDS: [&str; 7] = [
            "create-a-0",
            "create-a-1",
            "create-a-2",
            "create-b-0",
            "create-b-1",
            "create-b-10",
            "create-c",
        ];
        cases.push(with_body(
            case(IDS[i], Method::POST, secrets),
            secret(name, labels),
        ));
    }
    cases.extend([
        with_body(
            case("create-duplicate", Method::POST, secrets),
            secret("a-0", json!({})),
        ),
        with_body(
            case("create-invalid-name", Method::POST, secrets),
            secret("Not_A_Name", json!({})),
        ),
        with_body(
            case(
                "create-missing-namespace",
                Method::POST,
                "/api/v1/namespaces/nowhere/secrets",
            ),
            json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "x"}}),
        ),
        with_body(
            case("create-namespace-mismatch", Method::POST, secrets),
            json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "x", "namespace": "other"}}),
        ),
    ]);
    cases
}

/// GETs, and LISTs with their selectors.
// Over 120 lines: a table of cases in the order the suite sends them, each a few lines.
fn reads(secrets: &str) -> Vec<Case> {
    vec![
        get("get", format!("{secrets}/a-1")),
        get("get-rv0", format!("{secrets}/a-1?resourceVersion=0")),
        get("get-missing", format!("{secrets}/nope")),
        get(
            "get-missing-namespace",
            "/api/v1/namespaces/nowhere/secrets/x",
        ),
        get(
            "get-watch-param-ignored",
            format!("{secrets}/a-1?watch=true"),
        ),
        // LIST and its query parameters.
        get("list", secrets),
        get("list-rv0", format!("{secrets}?resourceVersion=0")),
        get("list-label-eq", format!("{secrets}?labelSelector=app%3Da")),
        get(
            "list-label-neq",
            format!("{secrets}?labelSelector=app!%3Da"),
        ),
        get(
            "list-label-in",
            format!("{secrets}?labelSelector=app+in+(a,b)"),
        ),
        get(
            "list-label-notin",
            format!("{secrets}?labelSelector=app+notin+(a)"),
        ),
        get("list-label-exists", format!("{secrets}?labelSelector=tier")),
        get(
            "list-label-not-exists",
            format!("{secrets}?labelSelector=!tier"),
        ),
        get(
            "list-label-and",
            format!("{secrets}?labelSelector=app%3Da,tier%3Dx"),
        ),
        get(
            "list-label-double-eq",
            format!("{secrets}?labelSelector=app%3D%3Db"),
        ),
        get(
            "list-label-bad",
            format!("{secrets}?labelSelector=app+in+("),
        ),
        get(
            "list-label-bad-value",
            format!("{secrets}?labelSelector=app%3D-bad-"),
        ),
        // Label keys: a name of at most 63 bytes, a DNS-1123 subdomain prefix of at most
        // 253; values of at most 63.
        get(
            "list-label-key-longest",
            format!(
                "{secrets}?labelSelector={}%2F{}%3Da",
                "a".repeat(253),
                "x".repeat(63)
            ),
        ),
        get(
            "list-label-key-long-name",
            format!("{secrets}?labelSelector={}%3Da", "x".repeat(64)),
        ),
        get(
            "list-label-key-long-prefix",
            format!("{secrets}?labelSelector={}%2Fx%3Da", "a".repeat(254)),
        ),
        get(
            "list-label-key-upper-prefix",
            format!("{secrets}?labelSelector=Example.com%2Fx"),
        ),
        get(
            "list-label-key-two-slashes",
            format!("{secrets}?labelSelector=a%2Fb%2Fc"),
        ),
        get(
            "list-label-key-empty-name",
            format!("{secrets}?labelSelector=!a%2F"),
        ),
        get(
            "list-label-value-long",
            format!("{secrets}?labelSelector=app%3D{}", "x".repeat(64)),
        ),
        get(
            "list-label-key-and-value-bad",
            format!("{secrets}?labelSelector={}%3D-v", "x".repeat(64)),
        ),
        // An Accept of empty ranges accepts nothing.
        with_accept(get("list-accept-empty-ranges", secrets), ","),
        with_accept(get("list-accept-empty-ranges-2", secrets), ", ,"),
        with_accept(
            get("get-accept-empty-ranges", format!("{secrets}/a-1")),
            ",",
        ),
        get(
            "list-field-name",
            format!("{secrets}?fieldSelector=metadata.name%3Da-1"),
        ),
        get(
            "list-field-name-neq",
            format!("{secrets}?fieldSelector=metadata.name!%3Da-1"),
        ),
        get(
            "list-field-namespace",
            format!("{secrets}?fieldSelector=metadata.namespace%3D{NS}"),
        ),
        get(
            "list-field-type",
            format!("{secrets}?fieldSelector=type%3DOpaque"),
        ),
        get(
            "list-field-unknown",
            format!("{secrets}?fieldSelector=spec.nodeName%3Dx"),
        ),
        get(
            "list-field-and-label",
            format!("{secrets}?fieldSelector=metadata.name!%3Da-0&labelSelector=app%3Da"),
        ),
    ]
}

/// LISTs by page, across namespaces, at resource versions, and malformed.
fn pages_and_versions(ns: &str, secrets: &str) -> Vec<Case> {
    vec![
        get("list-limit-3", format!("{secrets}?limit=3")),
        get(
            "list-limit-3-page-2",
            format!("{secrets}?limit=3&continue={{list-limit-3:/metadata/continue}}"),
        ),
        get(
            "list-limit-3-page-3",
            format!("{secrets}?limit=3&continue={{list-limit-3-page-2:/metadata/continue}}"),
        ),
        get(
            "list-limit-selector",
            format!("{secrets}?limit=1&labelSelector=tier"),
        ),
        get(
            "list-limit-selector-page-2",
            format!(
                "{secrets}?limit=1&labelSelector=tier&continue={{list-limit-selector:/metadata/continue}}"
            ),
        ),
        get(
            "list-limit-rv0",
            format!("{secrets}?limit=2&resourceVersion=0"),
        ),
        get(
            "list-all-namespaces-selected",
            "/api/v1/secrets?labelSelector=suite",
        ),
        get(
            "list-all-namespaces-limit",
            "/api/v1/secrets?labelSelector=suite&limit=2",
        ),
        get(
            "list-all-namespaces-page-2",
            "/api/v1/secrets?labelSelector=suite&limit=2&continue={list-all-namespaces-limit:/metadata/continue}",
        ),
        get("list-limit-0", format!("{secrets}?limit=0")),
        get("list-limit-negative", format!("{secrets}?limit=-1")),
        get("list-limit-not-a-number", format!("{secrets}?limit=abc")),
        get(
            "list-continue-garbage",
            format!("{secrets}?limit=2&continue=garbage"),
        ),
        get(
            "list-continue-with-rv",
            format!(
                "{secrets}?limit=2&resourceVersion=0&continue={{list-limit-3:/metadata/continue}}"
            ),
        ),
        get(
            "list-rv-not-older",
            format!(
                "{secrets}?resourceVersion={{list:/metadata/resourceVersion}}&resourceVersionMatch=NotOlderThan"
            ),
        ),
        get(
            "list-rv-exact",
            format!(
                "{secrets}?resourceVersion={{list:/metadata/resourceVersion}}&resourceVersionMatch=Exact"
            ),
        ),
        get(
            "list-rv-exact-limit",
            format!(
                "{secrets}?resourceVersion={{list:/metadata/resourceVersion}}&resourceVersionMatch=Exact&limit=2"
            ),
        ),
        get(
            "list-rv-match-without-rv",
            format!("{secrets}?resourceVersionMatch=NotOlderThan"),
        ),
        get(
            "list-rv-match-unknown",
            format!("{secrets}?resourceVersion=0&resourceVersionMatch=Newest"),
        ),
        get(
            "list-rv-exact-zero",
            format!("{secrets}?resourceVersion=0&resourceVersionMatch=Exact"),
        ),
        get(
            "list-rv-not-a-number",
            format!("{secrets}?resourceVersion=abc"),
        ),
        get(
            "list-semicolon-query",
            format!("{secrets}?limit=1;labelSelector=app%3Da"),
        ),
        get("list-unknown-resource", format!("{ns}/notaresource")),
        get(
            "list-missing-namespace",
            "/api/v1/namespaces/nowhere/secrets",
        ),
    ]
}

/// Updates and deletes, which the watches then replay.
fn updates_and_deletes(secrets: &str) -> Vec<Case> {
    vec![
        with_body(
            case("update", Method::PUT, format!("{secrets}/a-2")),
            secret("a-2", json!({"app": "b"})),
        ),
        with_body(
            case(
                "update-name-mismatch",
                Method::PUT,
                format!("{secrets}/a-2"),
            ),
            secret("a-0", json!({})),
        ),
        Case {
            content_type: Some("application/merge-patch+json"),
            ..with_body(
                case("patch-merge", Method::PATCH, format!("{secrets}/b-1")),
                json!({"metadata": {"labels": {"tier": "y"}}}),
            )
        },
        Case {
            content_type: Some("text/plain"),
            ..with_body(
                case(
                    "patch-bad-content-type",
                    Method::PATCH,
                    format!("{secrets}/b-1"),
                ),
                json!({}),
            )
        },
        case("delete", Method::DELETE, format!("{secrets}/c")),
        case("delete-missing", Method::DELETE, format!("{secrets}/c")),
    ]
}

/// Watches that replay the writes, watch-lists, and the reads after the writes.
fn watches(secrets: &str) -> Vec<Case> {
    vec![
        watch(
            "watch-replay",
            format!(
                "{secrets}?watch=1&resourceVersion={{list-empty:/metadata/resourceVersion}}&timeoutSeconds=1"
            ),
        ),
        watch(
            "watch-replay-selector",
            format!(
                "{secrets}?watch=1&labelSelector=app%3Da&resourceVersion={{list-empty:/metadata/resourceVersion}}&timeoutSeconds=1"
            ),
        ),
        watch(
            "watch-replay-field",
            format!(
                "{secrets}?watch=1&fieldSelector=metadata.name%3Da-2&resourceVersion={{list-empty:/metadata/resourceVersion}}&timeoutSeconds=1"
            ),
        ),
        watch(
            "watch-rv0",
            format!("{secrets}?watch=1&resourceVersion=0&timeoutSeconds=1"),
        ),
        watch(
            "watch-empty-value",
            format!("{secrets}?watch=&resourceVersion=0&timeoutSeconds=1"),
        ),
        watch(
            "watch-legacy-path",
            format!("/api/v1/watch/namespaces/{NS}/secrets?resourceVersion=0&timeoutSeconds=1"),
        ),
        watch(
            "watch-legacy-path-name",
            format!("/api/v1/watch/namespaces/{NS}/secrets/a-1?resourceVersion=0&timeoutSeconds=1"),
        ),
        watch(
            "watchlist",
            format!(
                "{secrets}?watch=1&sendInitialEvents=true&resourceVersionMatch=NotOlderThan&allowWatchBookmarks=true&timeoutSeconds=1"
            ),
        ),
        watch(
            "watchlist-rv0",
            format!(
                "{secrets}?watch=1&sendInitialEvents=true&resourceVersionMatch=NotOlderThan&resourceVersion=0&allowWatchBookmarks=true&timeoutSeconds=1"
            ),
        ),
        watch(
            "watchlist-without-bookmarks",
            format!(
                "{secrets}?watch=1&sendInitialEvents=true&resourceVersionMatch=NotOlderThan&timeoutSeconds=1"
            ),
        ),
        watch(
            "watchlist-without-match",
            format!(
                "{secrets}?watch=1&sendInitialEvents=true&allowWatchBookmarks=true&timeoutSeconds=1"
            ),
        ),
        watch(
            "watch-send-initial-false",
            format!(
                "{secrets}?watch=1&sendInitialEvents=false&resourceVersionMatch=NotOlderThan&resourceVersion={{list:/metadata/resourceVersion}}&allowWatchBookmarks=true&timeoutSeconds=1"
            ),
        ),
        watch(
            "watch-rv-not-a-number",
            format!("{secrets}?watch=1&resourceVersion=abc&timeoutSeconds=1"),
        ),
        watch(
            "watch-timeout-not-a-number",
            format!("{secrets}?watch=1&resourceVersion=0&timeoutSeconds=soon"),
        ),
        watch(
            "watch-label-bad",
            format!("{secrets}?watch=1&labelSelector=app+in+(&timeoutSeconds=1"),
        ),
        watch(
            "watch-label-key-long-name",
            format!(
                "{secrets}?watch=1&labelSelector={}&timeoutSeconds=1",
                "x".repeat(64)
            ),
        ),
        with_accept(
            watch(
                "watch-accept-empty-ranges",
                format!("{secrets}?watch=1&resourceVersion=0&timeoutSeconds=1"),
            ),
            ",",
        ),
        watch(
            "watch-rv-match-exact",
            format!(
                "{secrets}?watch=1&resourceVersion=0&resourceVersionMatch=Exact&timeoutSeconds=1"
            ),
        ),
        get("list-after-writes", secrets),
        watch(
            "watch-after-dry-runs",
            format!(
                "{secrets}?watch=1&resourceVersion={{dry-run-list-before:/metadata/resourceVersion}}&timeoutSeconds=1"
            ),
        ),
        get("list-after-writes-limit", format!("{secrets}?limit=4")),
        get(
            "list-after-writes-page-2",
            format!("{secrets}?limit=4&continue={{list-after-writes-limit:/metadata/continue}}"),
        ),
    ]
}

/// Server-side dry runs (`dryRun=All`): each answers as the write would, and nothing is
/// stored (the GETs and lists after them, and the watches of the main sequence, which replay
/// every change, would show it). A delete takes its options from its body when it has one.
fn dry_run(secrets: &str) -> Vec<Case> {
    vec![
        get("dry-run-list-before", secrets),
        with_body(
            case(
                "dry-run-create",
                Method::POST,
                format!("{secrets}?dryRun=All"),
            ),
            secret("dry", json!({"app": "dry"})),
        ),
        get("dry-run-create-not-stored", format!("{secrets}/dry")),
        with_body(
            case(
                "dry-run-create-existing",
                Method::POST,
                format!("{secrets}?dryRun=All"),
            ),
            secret("a-0", json!({})),
        ),
        with_body(
            case(
                "dry-run-update",
                Method::PUT,
                format!("{secrets}/a-1?dryRun=All"),
            ),
            secret("a-1", json!({"app": "changed"})),
        ),
        merge_patch(
            case(
                "dry-run-patch",
                Method::PATCH,
                format!("{secrets}/a-1?dryRun=All"),
            ),
            json!({"data": {"k": null, "other": "eA=="}}),
        ),
        get("dry-run-update-not-stored", format!("{secrets}/a-1")),
        case(
            "dry-run-delete",
            Method::DELETE,
            format!("{secrets}/a-1?dryRun=All"),
        ),
        with_body(
            case(
                "dry-run-delete-options",
                Method::DELETE,
                format!("{secrets}/a-1?dryRun=bogus"),
            ),
            json!({"kind": "DeleteOptions", "apiVersion": "v1", "dryRun": ["All"]}),
        ),
        case(
            "dry-run-delete-collection",
            Method::DELETE,
            format!("{secrets}?dryRun=All&labelSelector=app%3Da"),
        ),
        get("dry-run-delete-not-stored", format!("{secrets}/a-1")),
        get("dry-run-list-after", secrets),
        // Any value but All, even beside it, is the options' 422.
        with_body(
            case(
                "dry-run-invalid-create",
                Method::POST,
                format!("{secrets}?dryRun=All&dryRun=Yes"),
            ),
            secret("dry", json!({})),
        ),
        with_body(
            case(
                "dry-run-invalid-update",
                Method::PUT,
                format!("{secrets}/a-1?dryRun=true"),
            ),
            secret("a-1", json!({})),
        ),
        merge_patch(
            case(
                "dry-run-invalid-patch",
                Method::PATCH,
                format!("{secrets}/a-1?dryRun="),
            ),
            json!({}),
        ),
        case(
            "dry-run-invalid-delete",
            Method::DELETE,
            format!("{secrets}/a-1?dryRun=Server"),
        ),
        with_body(
            case(
                "dry-run-invalid-delete-options",
                Method::DELETE,
                format!("{secrets}/a-1"),
            ),
            json!({"kind": "DeleteOptions", "apiVersion": "v1", "dryRun": ["x"]}),
        ),
    ]
}

/// The OpenAPI documents, as served (the simulator's are recorded from the real one): a
/// few stable fields of each, content types, and the v3 redirect of a stale hash.
pub fn openapi() -> Vec<Case> {
    vec![
        with_fields(
            get("openapi-v2", "/openapi/v2"),
            &[
                "/swagger",
                "/info",
                "/definitions/io.k8s.api.core.v1.Secret",
            ],
        ),
        with_fields(
            with_accept(
                get("openapi-v2-protobuf", "/openapi/v2"),
                "application/com.github.proto-openapi.spec.v2@v1.0+protobuf",
            ),
            &[],
        ),
        with_accept(get("openapi-v2-yaml", "/openapi/v2"), "application/yaml"),
        with_fields(
            get("openapi-v3-index", "/openapi/v3"),
            &[
                "/paths/api~1v1/serverRelativeURL",
                "/paths/apis~1coordination.k8s.io~1v1/serverRelativeURL",
            ],
        ),
        with_fields(
            get("openapi-v3-core", "/openapi/v3/api/v1"),
            &[
                "/openapi",
                "/info",
                "/components/schemas/io.k8s.api.core.v1.Secret",
                "/paths/~1api~1v1~1namespaces~1{namespace}~1secrets/post/parameters",
            ],
        ),
        with_fields(
            get(
                "openapi-v3-leases",
                "/openapi/v3/apis/coordination.k8s.io/v1",
            ),
            &[
                "/openapi",
                "/components/schemas/io.k8s.api.coordination.v1.Lease",
            ],
        ),
        get("openapi-v3-stale-hash", "/openapi/v3/api/v1?hash=0"),
        get("openapi-v3-unknown", "/openapi/v3/apis/example.com/v1"),
    ]
}

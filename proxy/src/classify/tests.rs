//! Classification tests: a table of real API paths, the malformed shapes, and a fuzz-style
//! property run.

use super::*;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn uri(text: &str) -> http::Uri {
    text.parse().expect("test URIs parse")
}

fn info(method: &str, target: &str) -> RequestInfo {
    let method = Method::from_bytes(method.as_bytes()).expect("test methods parse");
    classify(&method, &uri(target)).unwrap_or_else(|e| panic!("{method} {target}: {e}"))
}

fn error(method: &str, target: &str) -> ClassifyError {
    let method = Method::from_bytes(method.as_bytes()).expect("test methods parse");
    match classify(&method, &uri(target)) {
        Ok(info) => panic!("{method} {target} classified as {info:?}"),
        Err(e) => e,
    }
}

/// One expected classification: method, target, verb, group, version, namespace,
/// resource, subresource, name. A `None` version marks a non-resource request.
type Row = (
    &'static str,
    &'static str,
    &'static str,
    &'static str,
    Option<&'static str>,
    Option<&'static str>,
    &'static str,
    Option<&'static str>,
    Option<&'static str>,
);

#[rustfmt::skip]
const TABLE: &[Row] = &[
    // Core group, cluster-scoped and namespaced, every verb.
    ("GET", "/api/v1/pods", "list", "", Some("v1"), None, "pods", None, None),
    ("GET", "/api/v1/nodes/node-1", "get", "", Some("v1"), None, "nodes", None, Some("node-1")),
    ("HEAD", "/api/v1/nodes/node-1", "get", "", Some("v1"), None, "nodes", None, Some("node-1")),
    ("GET", "/api/v1/namespaces/default/pods", "list", "", Some("v1"), Some("default"), "pods", None, None),
    ("GET", "/api/v1/namespaces/kube-system/pods?&watch=true", "watch", "", Some("v1"), Some("kube-system"), "pods", None, None),
    ("GET", "/api/v1/namespaces/default/pods/web-0", "get", "", Some("v1"), Some("default"), "pods", None, Some("web-0")),
    ("POST", "/api/v1/namespaces/default/pods", "create", "", Some("v1"), Some("default"), "pods", None, None),
    ("PUT", "/api/v1/namespaces/default/pods/web-0", "update", "", Some("v1"), Some("default"), "pods", None, Some("web-0")),
    ("PATCH", "/api/v1/namespaces/default/pods/web-0", "patch", "", Some("v1"), Some("default"), "pods", None, Some("web-0")),
    ("DELETE", "/api/v1/namespaces/default/pods/web-0", "delete", "", Some("v1"), Some("default"), "pods", None, Some("web-0")),
    ("DELETE", "/api/v1/namespaces/default/pods?&labelSelector=job-name%3Dk8s-openapi-tests-create-job", "deletecollection", "", Some("v1"), Some("default"), "pods", None, None),
    ("GET", "/api/v1/namespaces/kube-public/configmaps/cluster-info", "get", "", Some("v1"), Some("kube-public"), "configmaps", None, Some("cluster-info")),
    ("GET", "/api/v1/secrets?resourceVersion=0", "list", "", Some("v1"), None, "secrets", None, None),
    // Namespaces themselves: the namespace is the object's own name.
    ("GET", "/api/v1/namespaces", "list", "", Some("v1"), None, "namespaces", None, None),
    ("GET", "/api/v1/namespaces/team-a", "get", "", Some("v1"), Some("team-a"), "namespaces", None, Some("team-a")),
    ("DELETE", "/api/v1/namespaces/team-a", "delete", "", Some("v1"), Some("team-a"), "namespaces", None, Some("team-a")),
    ("PUT", "/api/v1/namespaces/team-a/status", "update", "", Some("v1"), Some("team-a"), "namespaces", Some("status"), Some("team-a")),
    ("PUT", "/api/v1/namespaces/team-a/finalize", "update", "", Some("v1"), Some("team-a"), "namespaces", Some("finalize"), Some("team-a")),
    // Subresources.
    ("PUT", "/api/v1/namespaces/default/pods/web-0/status", "update", "", Some("v1"), Some("default"), "pods", Some("status"), Some("web-0")),
    ("PATCH", "/api/v1/nodes/node-1/status", "patch", "", Some("v1"), None, "nodes", Some("status"), Some("node-1")),
    ("GET", "/api/v1/namespaces/default/pods/web-0/log?follow=true&container=app", "get", "", Some("v1"), Some("default"), "pods", Some("log"), Some("web-0")),
    ("GET", "/api/v1/namespaces/default/pods/web-0/exec?command=sh&stdin=true", "get", "", Some("v1"), Some("default"), "pods", Some("exec"), Some("web-0")),
    ("POST", "/api/v1/namespaces/default/pods/web-0/exec?command=sh", "create", "", Some("v1"), Some("default"), "pods", Some("exec"), Some("web-0")),
    ("POST", "/api/v1/namespaces/default/pods/web-0/attach?stdout=true", "create", "", Some("v1"), Some("default"), "pods", Some("attach"), Some("web-0")),
    ("POST", "/api/v1/namespaces/default/pods/web-0/portforward?ports=8080", "create", "", Some("v1"), Some("default"), "pods", Some("portforward"), Some("web-0")),
    ("GET", "/api/v1/namespaces/default/pods/web-0/proxy", "get", "", Some("v1"), Some("default"), "pods", Some("proxy"), Some("web-0")),
    ("GET", "/api/v1/namespaces/default/pods/web-0:8080/proxy/metrics/cadvisor", "get", "", Some("v1"), Some("default"), "pods", Some("proxy"), Some("web-0:8080")),
    ("POST", "/api/v1/namespaces/default/services/https:web:443/proxy/api/v2/items", "create", "", Some("v1"), Some("default"), "services", Some("proxy"), Some("https:web:443")),
    ("GET", "/api/v1/nodes/node-1/proxy/stats/summary", "get", "", Some("v1"), None, "nodes", Some("proxy"), Some("node-1")),
    ("POST", "/api/v1/namespaces/default/serviceaccounts/builder/token", "create", "", Some("v1"), Some("default"), "serviceaccounts", Some("token"), Some("builder")),
    ("POST", "/api/v1/namespaces/default/pods/web-0/eviction", "create", "", Some("v1"), Some("default"), "pods", Some("eviction"), Some("web-0")),
    // Named groups.
    ("GET", "/apis/apps/v1/namespaces/kube-system/deployments", "list", "apps", Some("v1"), Some("kube-system"), "deployments", None, None),
    ("POST", "/apis/batch/v1/namespaces/default/jobs", "create", "batch", Some("v1"), Some("default"), "jobs", None, None),
    ("PUT", "/apis/apps/v1/namespaces/default/deployments/web/scale", "update", "apps", Some("v1"), Some("default"), "deployments", Some("scale"), Some("web")),
    ("GET", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/foobars.k8s-openapi-tests-custom-resource-definition.com", "get", "apiextensions.k8s.io", Some("v1"), None, "customresourcedefinitions", None, Some("foobars.k8s-openapi-tests-custom-resource-definition.com")),
    ("GET", "/apis/k8s-openapi-tests-custom-resource-definition.com/v1/namespaces/default/foobars?&watch=true", "watch", "k8s-openapi-tests-custom-resource-definition.com", Some("v1"), Some("default"), "foobars", None, None),
    ("GET", "/apis/discovery.k8s.io/v1/endpointslices?resourceVersion=0", "list", "discovery.k8s.io", Some("v1"), None, "endpointslices", None, None),
    ("PUT", "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/node-1", "update", "coordination.k8s.io", Some("v1"), Some("kube-node-lease"), "leases", None, Some("node-1")),
    ("DELETE", "/apis/rbac.authorization.k8s.io/v1/clusterroles", "deletecollection", "rbac.authorization.k8s.io", Some("v1"), None, "clusterroles", None, None),
    ("POST", "/apis/authorization.k8s.io/v1/subjectaccessreviews", "create", "authorization.k8s.io", Some("v1"), None, "subjectaccessreviews", None, None),
    // Legacy watch paths.
    ("GET", "/api/v1/watch/pods", "watch", "", Some("v1"), None, "pods", None, None),
    ("GET", "/api/v1/watch/namespaces/default/pods", "watch", "", Some("v1"), Some("default"), "pods", None, None),
    ("GET", "/api/v1/watch/namespaces/default/pods/web-0", "watch", "", Some("v1"), Some("default"), "pods", None, Some("web-0")),
    ("GET", "/api/v1/watch/namespaces/default", "watch", "", Some("v1"), Some("default"), "namespaces", None, Some("default")),
    ("GET", "/apis/apps/v1/watch/namespaces/default/deployments", "watch", "apps", Some("v1"), Some("default"), "deployments", None, None),
    // `watch` parameter values: the first wins; only absent, 0 and false (any case) are false.
    ("GET", "/api/v1/pods?watch=1", "watch", "", Some("v1"), None, "pods", None, None),
    ("GET", "/api/v1/pods?watch=yes", "watch", "", Some("v1"), None, "pods", None, None),
    ("GET", "/api/v1/pods?watch=", "watch", "", Some("v1"), None, "pods", None, None),
    ("GET", "/api/v1/pods?watch", "watch", "", Some("v1"), None, "pods", None, None),
    ("GET", "/api/v1/pods?watch=0", "list", "", Some("v1"), None, "pods", None, None),
    ("GET", "/api/v1/pods?watch=false", "list", "", Some("v1"), None, "pods", None, None),
    ("GET", "/api/v1/pods?watch=FALSE", "list", "", Some("v1"), None, "pods", None, None),
    ("GET", "/api/v1/pods?watch=false&watch=true", "list", "", Some("v1"), None, "pods", None, None),
    ("GET", "/api/v1/pods?watch=true&watch=false", "watch", "", Some("v1"), None, "pods", None, None),
    ("GET", "/api/v1/pods?watch=&watch=1", "watch", "", Some("v1"), None, "pods", None, None),
    ("GET", "/api/v1/pods?watch=&watch=false", "watch", "", Some("v1"), None, "pods", None, None),
    ("GET", "/api/v1/pods?watch=0&watch=", "list", "", Some("v1"), None, "pods", None, None),
    ("GET", "/api/v1/pods?%77atch=true", "watch", "", Some("v1"), None, "pods", None, None),
    ("GET", "/api/v1/pods?Watch=true", "list", "", Some("v1"), None, "pods", None, None),
    // A named GET ignores `watch`, as the apiserver's get handler does.
    ("GET", "/api/v1/namespaces/default/pods/web-0?watch=true", "get", "", Some("v1"), Some("default"), "pods", None, Some("web-0")),
    // Trailing slash: ignored, as the apiserver's path split does.
    ("GET", "/api/v1/pods/", "list", "", Some("v1"), None, "pods", None, None),
    // Percent-encodings other than '/' and '.' decode into the fields.
    ("GET", "/api/v1/namespaces/default/configmaps/a%3Ab", "get", "", Some("v1"), Some("default"), "configmaps", None, Some("a:b")),
    // Discovery and non-resource URLs: the verb is the method.
    ("GET", "/", "get", "", None, None, "", None, None),
    ("GET", "/api", "get", "", None, None, "", None, None),
    ("GET", "/api/v1", "get", "", None, None, "", None, None),
    ("GET", "/apis", "get", "", None, None, "", None, None),
    ("GET", "/apis/apps", "get", "", None, None, "", None, None),
    ("GET", "/apis/apps/v1", "get", "", None, None, "", None, None),
    ("GET", "/apis/apps/v1/", "get", "", None, None, "", None, None),
    ("GET", "/healthz", "get", "", None, None, "", None, None),
    ("GET", "/readyz?verbose", "get", "", None, None, "", None, None),
    ("GET", "/livez/etcd", "get", "", None, None, "", None, None),
    ("GET", "/version", "get", "", None, None, "", None, None),
    ("GET", "/openapi/v2", "get", "", None, None, "", None, None),
    ("GET", "/openapi/v3", "get", "", None, None, "", None, None),
    ("GET", "/openapi/v3/apis/apps/v1?hash=0123abcd", "get", "", None, None, "", None, None),
    ("GET", "/metrics", "get", "", None, None, "", None, None),
    ("GET", "/.well-known/openid-configuration", "get", "", None, None, "", None, None),
    ("GET", "/openid/v1/jwks", "get", "", None, None, "", None, None),
    ("HEAD", "/healthz", "head", "", None, None, "", None, None),
    ("POST", "/logs", "post", "", None, None, "", None, None),
    ("OPTIONS", "/version", "options", "", None, None, "", None, None),
    // Not an API prefix: non-resource however long.
    ("GET", "/apix/apps/v1/deployments", "get", "", None, None, "", None, None),
];

#[test]
fn real_api_paths_classify_like_the_apiserver() {
    for &(method, target, verb, group, version, namespace, resource, subresource, name) in TABLE {
        let got = info(method, target);
        let at = format!("{method} {target}");
        assert_eq!(got.verb.to_string(), verb, "verb of {at}");
        assert_eq!(
            got.resource_request,
            version.is_some(),
            "resource_request of {at}"
        );
        assert_eq!(got.api_group, group, "group of {at}");
        assert_eq!(got.api_version, version.unwrap_or(""), "version of {at}");
        assert_eq!(got.namespace.as_deref(), namespace, "namespace of {at}");
        assert_eq!(got.resource, resource, "resource of {at}");
        assert_eq!(
            got.subresource.as_deref(),
            subresource,
            "subresource of {at}"
        );
        assert_eq!(got.name.as_deref(), name, "name of {at}");
        assert_eq!(got.path, uri(target).path(), "path of {at}");
        assert_eq!(
            got.query.raw,
            uri(target).query().unwrap_or(""),
            "raw query of {at}"
        );
    }
}

/// Every request recorded from a real v1.36 apiserver classifies, and into the resource the
/// recorded response is about.
#[test]
fn recorded_fixture_requests_classify() {
    let dir = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../fixtures/kube-apiserver-v1.36"
    );
    let mut seen = 0;
    for entry in std::fs::read_dir(dir).expect("fixtures folder") {
        let path = entry.expect("fixture entry").path();
        if path.extension().is_none_or(|e| e != "json") {
            continue;
        }
        let text = std::fs::read_to_string(&path).expect("fixture reads");
        let exchanges: Vec<serde_json::Value> = serde_json::from_str(&text).expect("fixture JSON");
        for exchange in exchanges {
            let (Some(url), Some(method)) = (
                exchange["request_url"].as_str(),
                exchange["request_method"].as_str(),
            ) else {
                continue;
            };
            let got = info(method, url);
            seen += 1;
            if url == "/apis" {
                assert!(!got.resource_request);
                continue;
            }
            assert!(got.resource_request, "{method} {url}");
            // The resource (or its name) appears in the path the fixture was recorded for.
            assert!(
                url.contains(&format!("/{}", got.resource)),
                "{method} {url}"
            );
            let verb = got.verb.to_string();
            let expected = match (method, got.name.is_some()) {
                ("GET", false) if url.contains("watch=true") => "watch",
                ("GET", false) => "list",
                ("GET", true) => "get",
                ("POST", _) => "create",
                ("PATCH", _) => "patch",
                ("DELETE", true) => "delete",
                ("DELETE", false) => "deletecollection",
                _ => panic!("unexpected fixture request {method} {url}"),
            };
            assert_eq!(verb, expected, "{method} {url}");
        }
    }
    assert!(seen >= 20, "only {seen} recorded requests found");
}

#[test]
fn the_watchlist_query_of_the_fixture_is_read_in_full() {
    let got = info(
        "GET",
        "/api/v1/namespaces/kube-system/pods?&allowWatchBookmarks=true&resourceVersion=0&resourceVersionMatch=NotOlderThan&sendInitialEvents=true&watch=true",
    );
    assert_eq!(got.verb, Verb::Watch);
    let q = &got.query;
    assert!(q.watch && q.allow_watch_bookmarks);
    assert_eq!(q.resource_version.as_deref(), Some("0"));
    assert_eq!(q.resource_version_match.as_deref(), Some("NotOlderThan"));
    assert_eq!(q.send_initial_events, Some(true));
    assert!(got.is_long_running() && got.is_read() && !got.is_list());
}

#[test]
fn list_parameters_are_decoded_and_the_first_value_wins() {
    let got = info(
        "GET",
        "/api/v1/secrets?limit=500&limit=7&continue=abc%3D%3D&labelSelector=app+in+(a%2Cb)&fieldSelector=metadata.namespace%3Dx&resourceVersion=42&resourceVersion=43&timeoutSeconds=30",
    );
    let q = &got.query;
    assert_eq!(q.limit, Some(500));
    assert_eq!(q.continue_token.as_deref(), Some("abc=="));
    assert_eq!(q.label_selector.as_deref(), Some("app in (a,b)"));
    assert_eq!(q.field_selector.as_deref(), Some("metadata.namespace=x"));
    assert_eq!(q.resource_version.as_deref(), Some("42"));
    assert_eq!(q.timeout_seconds, Some(30));
    assert!(!q.watch && q.send_initial_events.is_none());
    assert!(got.is_list() && got.is_read() && !got.is_long_running());
}

#[test]
fn empty_and_non_positive_values_mean_what_they_mean_to_the_apiserver() {
    let q = info(
        "GET",
        "/api/v1/pods?resourceVersion=&limit=0&continue=&labelSelector=&fieldSelector=",
    )
    .query;
    assert_eq!(q.resource_version, None);
    assert_eq!(q.limit, None);
    assert_eq!(q.continue_token, None);
    assert_eq!(q.label_selector, None);
    assert_eq!(q.field_selector, None);
    assert_eq!(info("GET", "/api/v1/pods?limit=-5").query.limit, None);
    assert_eq!(info("GET", "/api/v1/pods?limit=%2B5").query.limit, Some(5));
    assert_eq!(
        info("GET", "/api/v1/pods?watch=1&sendInitialEvents=false")
            .query
            .send_initial_events,
        Some(false)
    );
}

#[test]
fn bad_numbers_in_a_list_or_watch_are_refused() {
    for target in [
        "/api/v1/pods?limit=abc",
        "/api/v1/pods?limit=",
        "/api/v1/pods?limit=1.5",
        "/api/v1/pods?limit=99999999999999999999",
        "/api/v1/pods?watch=1&timeoutSeconds=soon",
        "/api/v1/watch/pods?timeoutSeconds=",
    ] {
        let e = error("GET", target);
        assert!(
            matches!(e, ClassifyError::InvalidParameter { .. }),
            "{target}: {e}"
        );
    }
    let e = error("GET", "/api/v1/pods?limit=abc");
    assert_eq!(
        e.to_string(),
        "invalid value \"abc\" for query parameter limit: a decimal integer"
    );
    // Outside lists and watches the apiserver never reads them, so neither does Bulwark.
    let got = info("GET", "/api/v1/namespaces/default/pods/web-0?limit=abc");
    assert_eq!(got.query.limit, None);
    let got = info("POST", "/api/v1/namespaces/default/pods?timeoutSeconds=x");
    assert_eq!(got.query.timeout_seconds, None);
}

#[test]
fn any_int64_timeout_is_accepted_as_the_apiserver_accepts_it() {
    // The apiserver's ListOptions validation has no rule for timeoutSeconds: 0 means unset
    // and a negative value ends the watch at once, but neither is a 400.
    for (value, expected) in [
        ("0", 0),
        ("-1", -1),
        ("9223372036854775807", i64::MAX),
        ("-9223372036854775808", i64::MIN),
    ] {
        for target in [
            format!("/api/v1/pods?watch=1&timeoutSeconds={value}"),
            format!("/api/v1/watch/namespaces/a/secrets?timeoutSeconds={value}"),
            format!("/api/v1/pods?timeoutSeconds={value}"),
        ] {
            assert_eq!(info("GET", &target).query.timeout_seconds, Some(expected));
        }
    }
}

#[test]
fn malformed_paths_are_refused_with_their_reason() {
    type Check = fn(&ClassifyError) -> bool;
    let cases: &[(&str, Check)] = &[
        ("/api/v1/namespaces/default%2Fother/pods", |e| {
            matches!(e, ClassifyError::EncodedSeparator { .. })
        }),
        ("/api/v1/namespaces/default%2fother/pods", |e| {
            matches!(e, ClassifyError::EncodedSeparator { .. })
        }),
        ("/api/v1/namespaces/%2E%2E/pods", |e| {
            matches!(e, ClassifyError::EncodedSeparator { .. })
        }),
        ("/api/v1/namespaces/%2e/secrets", |e| {
            matches!(e, ClassifyError::EncodedSeparator { .. })
        }),
        ("/api/v1/namespaces/a.%2ex/secrets", |e| {
            matches!(e, ClassifyError::EncodedSeparator { .. })
        }),
        ("/api/v1//pods", |e| {
            matches!(e, ClassifyError::EmptySegment { .. })
        }),
        ("//api/v1/pods", |e| {
            matches!(e, ClassifyError::EmptySegment { .. })
        }),
        ("//", |e| matches!(e, ClassifyError::EmptySegment { .. })),
        ("/api/v1/pods//", |e| {
            matches!(e, ClassifyError::EmptySegment { .. })
        }),
        ("/api/v1/namespaces/../secrets", |e| {
            matches!(e, ClassifyError::DotSegment { .. })
        }),
        ("/api/v1/./pods", |e| {
            matches!(e, ClassifyError::DotSegment { .. })
        }),
        ("/..", |e| matches!(e, ClassifyError::DotSegment { .. })),
        ("/api/v1/namespaces/a%zz/pods", |e| {
            matches!(e, ClassifyError::BadPathEncoding { .. })
        }),
        ("/api/v1/pods/web%2", |e| {
            matches!(e, ClassifyError::BadPathEncoding { .. })
        }),
        ("/api/v1/pods/%ff%fe", |e| {
            matches!(e, ClassifyError::BadPathEncoding { .. })
        }),
        ("/api/v1/watch", |e| {
            matches!(e, ClassifyError::MissingResource { .. })
        }),
        ("/apis/apps/v1/watch/", |e| {
            matches!(e, ClassifyError::MissingResource { .. })
        }),
        ("/api/v1/proxy/namespaces/default/pods/web-0", |e| {
            matches!(e, ClassifyError::LegacyProxy { .. })
        }),
    ];
    for (target, check) in cases {
        let e = error("GET", target);
        assert!(check(&e), "{target}: {e:?}");
        assert!(
            e.to_string().contains(target),
            "the message names the path: {e}"
        );
    }
}

#[test]
fn a_non_absolute_request_target_is_refused() {
    let e = error("OPTIONS", "*");
    assert!(matches!(e, ClassifyError::NotAbsolute { .. }), "{e:?}");
    let e = classify_parts(&Method::GET, "api/v1/pods", None).unwrap_err();
    assert!(matches!(e, ClassifyError::NotAbsolute { .. }), "{e:?}");
}

#[test]
fn an_encoded_percent_is_not_an_encoded_slash() {
    // `%252F` is a literal "%2F" in a name, not a separator.
    let got = info("GET", "/api/v1/namespaces/default/configmaps/a%252Fb");
    assert_eq!(got.name.as_deref(), Some("a%2Fb"));
    assert_eq!(got.path, "/api/v1/namespaces/default/configmaps/a%252Fb");
}

#[test]
fn malformed_queries_are_refused() {
    for target in [
        "/api/v1/pods?watch=%zz",
        "/api/v1/pods?pretty=true&x=%4",
        "/api/v1/pods?watch=1;limit=5",
        "/healthz?verbose;x",
        "/api/v1/pods?labelSelector=%ff",
    ] {
        let e = error("GET", target);
        assert!(
            matches!(e, ClassifyError::BadQuery { .. }),
            "{target}: {e:?}"
        );
    }
    // Invalid UTF-8 in a parameter Bulwark does not read is the apiserver's business.
    assert_eq!(info("GET", "/api/v1/pods?other=%ff").verb, Verb::List);
}

#[test]
fn methods_the_apiserver_does_not_serve_are_refused() {
    for (method, target) in [
        ("OPTIONS", "/api/v1/pods"),
        ("CONNECT", "/api/v1/namespaces/default/pods/web-0/exec"),
        ("TRACE", "/healthz"),
        ("PURGE", "/version"),
        ("POST", "/api/v1/watch/pods"),
        ("DELETE", "/apis/apps/v1/watch/deployments"),
    ] {
        let e = error(method, target);
        assert!(
            matches!(e, ClassifyError::MethodNotAllowed { .. }),
            "{method} {target}: {e:?}"
        );
        assert!(e.to_string().contains(method));
    }
}

#[test]
fn long_running_and_upgrade_requests_are_recognised() {
    let cases = [
        // (method, target, long_running, upgrade, read)
        ("GET", "/api/v1/pods?watch=true", true, false, true),
        (
            "GET",
            "/api/v1/watch/namespaces/default/pods",
            true,
            false,
            true,
        ),
        (
            "GET",
            "/api/v1/namespaces/d/pods/p/log?follow=true",
            true,
            false,
            true,
        ),
        (
            "GET",
            "/api/v1/namespaces/d/pods/p/log?follow=false",
            false,
            false,
            true,
        ),
        ("GET", "/api/v1/namespaces/d/pods/p/log", false, false, true),
        (
            "GET",
            "/api/v1/namespaces/d/pods/p/exec?command=ls",
            true,
            true,
            false,
        ),
        (
            "POST",
            "/api/v1/namespaces/d/pods/p/exec?command=ls",
            true,
            true,
            false,
        ),
        (
            "POST",
            "/api/v1/namespaces/d/pods/p/attach",
            true,
            true,
            false,
        ),
        (
            "GET",
            "/api/v1/namespaces/d/pods/p/portforward",
            true,
            true,
            false,
        ),
        (
            "GET",
            "/api/v1/namespaces/d/pods/p/proxy/x",
            true,
            false,
            true,
        ),
        (
            "PUT",
            "/api/v1/namespaces/d/services/s/proxy/x",
            true,
            false,
            false,
        ),
        ("GET", "/debug/pprof/profile?seconds=30", true, false, true),
        ("GET", "/api/v1/pods", false, false, true),
        ("GET", "/api/v1/namespaces/d/pods/p", false, false, true),
        (
            "PUT",
            "/api/v1/namespaces/d/pods/p/status",
            false,
            false,
            false,
        ),
        ("DELETE", "/api/v1/namespaces/d/pods", false, false, false),
        ("HEAD", "/healthz", false, false, true),
        ("POST", "/logs", false, false, false),
        // A resource named like an upgrade subresource is not one.
        ("GET", "/apis/example.com/v1/exec", false, false, true),
    ];
    for (method, target, long_running, upgrade, read) in cases {
        let got = info(method, target);
        assert_eq!(
            got.is_long_running(),
            long_running,
            "long-running {method} {target}"
        );
        assert_eq!(got.is_upgrade(), upgrade, "upgrade {method} {target}");
        assert_eq!(got.is_read(), read, "read {method} {target}");
    }
}

#[test]
fn field_selector_name_follows_the_apiserver() {
    let name = |target: &str| info("GET", target).field_selector_name().map(String::from);
    assert_eq!(
        name("/api/v1/namespaces/d/secrets?fieldSelector=metadata.name%3Dtls"),
        Some("tls".into())
    );
    assert_eq!(
        name("/api/v1/namespaces/d/secrets?watch=1&fieldSelector=metadata.name%3D%3Dtls"),
        Some("tls".into())
    );
    assert_eq!(
        name("/api/v1/secrets?fieldSelector=metadata.namespace%3Dd,metadata.name%3Dtls"),
        Some("tls".into())
    );
    // Sorted terms, first match wins, as in apimachinery's fields parser.
    assert_eq!(
        name("/api/v1/secrets?fieldSelector=metadata.name%3Db,metadata.name%3Da"),
        Some("a".into())
    );
    assert_eq!(
        name("/api/v1/secrets?fieldSelector=metadata.name!%3Dtls"),
        None
    );
    assert_eq!(
        name("/api/v1/secrets?fieldSelector=metadata.namex%3Dtls"),
        None
    );
    assert_eq!(name("/api/v1/secrets?fieldSelector=metadata.name%3D"), None);
    assert_eq!(
        name("/api/v1/secrets?fieldSelector=metadata.name%3D.."),
        None
    );
    assert_eq!(
        name("/api/v1/secrets?fieldSelector=metadata.name%3Da%25b"),
        None
    );
    assert_eq!(
        name("/api/v1/secrets?fieldSelector=metadata.name%3Da%5C,b"),
        None
    );
    assert_eq!(name("/api/v1/secrets"), None);
    // The legacy watch paths take the name from the path alone, as RequestInfoFactory
    // does: a collection watched there is authorized without a name.
    assert_eq!(
        name("/api/v1/watch/namespaces/d/secrets?fieldSelector=metadata.name%3Dtls"),
        None
    );
    let named = info(
        "GET",
        "/api/v1/watch/namespaces/d/secrets/tls?fieldSelector=metadata.name%3Dother",
    );
    assert_eq!(named.name.as_deref(), Some("tls"));
    assert_eq!(named.field_selector_name(), None);
    // Only lists and watches: a named GET has its name already.
    assert_eq!(
        name("/api/v1/namespaces/d/secrets/x?fieldSelector=metadata.name%3Dtls"),
        None
    );
}

#[test]
fn verbs_display_as_the_apiserver_spells_them() {
    let verbs = [
        (Verb::Get, "get"),
        (Verb::List, "list"),
        (Verb::Watch, "watch"),
        (Verb::Create, "create"),
        (Verb::Update, "update"),
        (Verb::Patch, "patch"),
        (Verb::Delete, "delete"),
        (Verb::DeleteCollection, "deletecollection"),
        (Verb::NonResource(Method::POST), "post"),
        (Verb::NonResource(Method::HEAD), "head"),
    ];
    for (verb, text) in verbs {
        assert_eq!(verb.to_string(), text);
    }
}

/// Random request targets made of the characters that matter (separators, dots, escapes,
/// API words) never panic, and whatever classifies keeps its path byte for byte and never
/// holds a `.`/`..`/empty segment or an encoded separator.
#[test]
fn random_targets_never_panic() {
    const PIECES: &[&str] = &[
        "/",
        "/",
        "/",
        ".",
        "..",
        "%",
        "%2",
        "%2F",
        "%2e",
        "%25",
        "%41",
        "%ff",
        "a",
        "z9",
        "-",
        "api",
        "apis",
        "v1",
        "watch",
        "proxy",
        "namespaces",
        "pods",
        "status",
        "exec",
        "log",
        "?",
        "&",
        "=",
        ";",
        "+",
        "watch=",
        "limit=",
        "timeoutSeconds=",
        "0",
        "false",
        "-1",
        "fieldSelector=metadata.name%3D",
        ",",
        "\\",
        "~",
        ":",
        "@",
    ];
    let methods = [
        Method::GET,
        Method::HEAD,
        Method::POST,
        Method::PUT,
        Method::PATCH,
        Method::DELETE,
        Method::OPTIONS,
        Method::CONNECT,
    ];
    let mut rng = StdRng::seed_from_u64(0x0062_756c_7761_726b);
    let mut classified = 0;
    for _ in 0..20_000 {
        let mut target = String::new();
        if rng.random_bool(0.9) {
            target.push('/');
        }
        for _ in 0..rng.random_range(0..14) {
            target.push_str(PIECES[rng.random_range(0..PIECES.len())]);
        }
        let method = &methods[rng.random_range(0..methods.len())];
        let Ok(uri) = target.parse::<http::Uri>() else {
            continue;
        };
        if let Ok(got) = classify(method, &uri) {
            classified += 1;
            assert_eq!(got.path, uri.path());
            let _ = (got.is_long_running(), got.is_upgrade(), got.is_read());
            let _ = got.field_selector_name();
            let _ = got.verb.to_string();
            assert!(!has_encoded_separator(&got.path), "{target}");
            let inner = got.path.trim_start_matches('/').trim_end_matches('/');
            if got.path.len() > 1 {
                assert!(
                    inner
                        .split('/')
                        .all(|s| !s.is_empty() && s != "." && s != ".."),
                    "{target} classified as {got:?}"
                );
            }
        }
        // Raw bytes too: anything, including invalid UTF-8 in escapes, must not panic.
        let raw: String = (0..rng.random_range(0..24))
            .map(|_| char::from(rng.random_range(0x20u8..0x7f)))
            .collect();
        let _ = classify_parts(method, &raw, Some(&raw));
    }
    assert!(classified > 1_000, "only {classified} targets classified");
}

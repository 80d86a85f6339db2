//! The configuration file as an operator meets it: the shipped example loads from anywhere,
//! every mistake is reported with the field it concerns, all at once.

use std::path::{Path, PathBuf};
use std::time::Duration;

use bulwark::classify::classify;
use bulwark::config::{Config, ConfigError, Problem, Quantity, ReplicaAddr};

const EXAMPLE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/bulwark.example.yaml");

/// The smallest valid configuration.
const MINIMAL: &str = "
listen:
  address: 127.0.0.1:6443
  cert: tls.crt
  key: tls.key
upstream:
  replicas: [apiserver-1.example:6443]
  ca: ca.crt
  frontProxy: {cert: fp.crt, key: fp.key}
  self: {tokenFile: token}
";

/// `MINIMAL` with one value set (the path is dotted; missing mappings are created).
fn minimal_with(path: &str, yaml: &str) -> String {
    minimal_with_all(&[(path, yaml)])
}

/// `MINIMAL` with several values set.
fn minimal_with_all(values: &[(&str, &str)]) -> String {
    bulwark_testkit::config::with_values(MINIMAL, values)
}

/// The problems of a configuration that must be invalid.
fn problems(text: &str) -> Vec<Problem> {
    match text.parse::<Config>() {
        Ok(_) => panic!("accepted:\n{text}"),
        Err(ConfigError::Invalid(problems)) => problems,
        Err(other) => panic!("expected validation problems, got: {other}\n{text}"),
    }
}

/// A scratch folder of its own for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("bulwark-config-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch folder");
    dir
}

#[test]
fn the_example_loads_and_its_defaults_are_the_real_ones() {
    let example = Config::load(Path::new(EXAMPLE)).unwrap_or_else(|e| panic!("{e}"));
    // Everything the example sets beyond the required keys is documented as the default;
    // a configuration with only the required (and non-default) keys must equal it.
    let mut minimal: Config = "
listen:
  address: 0.0.0.0:6443
  cert: ../certs/dev/bulwark.crt
  key: ../certs/dev/bulwark.key
  clientCA: ../certs/dev/client-ca.crt
upstream:
  replicas: [10.0.0.11:6443, 10.0.0.12:6443, 10.0.0.13:6443]
  ca: ../certs/dev/apiserver-ca.crt
  frontProxy:
    cert: ../certs/dev/front-proxy-client.crt
    key: ../certs/dev/front-proxy-client.key
  self:
    cert: ../certs/dev/bulwark-client.crt
    key: ../certs/dev/bulwark-client.key
rules:
  folder: ../rules/examples
audit:
  path: ../var/bulwark-audit.jsonl
"
    .parse()
    .unwrap_or_else(|e| panic!("{e}"));
    minimal.resolve_paths(Path::new(EXAMPLE).parent().expect("example folder"));
    assert_eq!(example, minimal);
}

#[test]
fn the_example_documents_every_key() {
    let text = std::fs::read_to_string(EXAMPLE).expect("example reads");
    let config = Config::load(Path::new(EXAMPLE)).unwrap_or_else(|e| panic!("{e}"));
    let tree = serde_norway::to_value(&config).expect("config serializes");
    let mut missing = Vec::new();
    let mut stack = vec![(String::new(), &tree)];
    while let Some((prefix, node)) = stack.pop() {
        let Some(map) = node.as_mapping() else {
            continue;
        };
        for (key, value) in map {
            let key = key.as_str().expect("keys are strings");
            // Set, or shown commented out (the keys without a default value).
            let documented = text.lines().any(|line| {
                let line = line.trim_start().trim_start_matches("# ");
                line.starts_with(&format!("{key}:"))
            });
            if !documented {
                missing.push(format!("{prefix}{key}"));
            }
            stack.push((format!("{prefix}{key}."), value));
        }
    }
    assert!(missing.is_empty(), "not in the example: {missing:?}");
    // Each key line is preceded by a comment saying what it does.
    let lines: Vec<&str> = text.lines().collect();
    for (i, line) in lines.iter().enumerate() {
        let trimmed = line.trim_start();
        if trimmed.starts_with('#') || trimmed.starts_with('-') || trimmed.is_empty() {
            continue;
        }
        assert!(
            i > 0 && lines[i - 1].trim_start().starts_with('#'),
            "line {} has no comment above it: {line}",
            i + 1
        );
    }
}

#[test]
fn relative_paths_resolve_against_the_files_folder_and_are_not_checked() {
    let dir = scratch("relative");
    let file = dir.join("bulwark.yaml");
    let text = minimal_with_all(&[
        ("listen.cert", "/etc/bulwark/tls.crt"),
        ("rules.folder", "rules.d"),
        ("audit.path", "audit/log.jsonl"),
        ("admin.tokenFile", "admin-token"),
    ]);
    std::fs::write(&file, text).expect("config written");
    let config = Config::load(&file).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(config.listen.cert, PathBuf::from("/etc/bulwark/tls.crt"));
    assert_eq!(config.listen.key, dir.join("tls.key"));
    assert_eq!(config.upstream.ca, dir.join("ca.crt"));
    let front_proxy = config.upstream.front_proxy.as_ref().expect("frontProxy");
    assert_eq!(front_proxy.cert, dir.join("fp.crt"));
    assert_eq!(front_proxy.key, dir.join("fp.key"));
    assert_eq!(config.upstream.own.token_file, Some(dir.join("token")));
    assert_eq!(config.rules.folder, Some(dir.join("rules.d")));
    assert_eq!(config.audit.path, Some(dir.join("audit/log.jsonl")));
    assert_eq!(config.admin.token_file, Some(dir.join("admin-token")));
    // None of those files exist; loading does not care.
    assert!(!dir.join("tls.key").exists());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_missing_file_names_the_file() {
    let missing = Path::new("/nonexistent/bulwark.yaml");
    let e = Config::load(missing).expect_err("no such file");
    assert!(matches!(e, ConfigError::Read { .. }));
    assert!(e.to_string().contains("/nonexistent/bulwark.yaml"), "{e}");
}

#[test]
fn an_unknown_field_is_named_with_its_line() {
    let text = "
listen:
  address: 127.0.0.1:6443
  cert: tls.crt
  key: tls.key
upstream:
  replicas: [a:6443]
  ca: ca.crt
  frontProxy: {cert: fp.crt, key: fp.key}
  self: {tokenFile: token}
  timeouts:
    connect: 5s
    reed: 5s
";
    match text.parse::<Config>() {
        Err(ConfigError::Parse {
            line,
            column,
            message,
        }) => {
            assert_eq!(line, Some(13), "{message}");
            assert_eq!(column, Some(5), "{message}");
            assert!(message.contains("upstream.timeouts"), "{message}");
            assert!(message.contains("unknown field `reed`"), "{message}");
            assert!(message.contains("line 13"), "{message}");
        }
        other => panic!("expected a parse error, got {other:?}"),
    }
    // A misspelled top-level key too.
    let e = format!("{MINIMAL}cahce: {{}}\n")
        .parse::<Config>()
        .expect_err("unknown top-level key");
    assert!(e.to_string().contains("unknown field `cahce`"), "{e}");
}

#[test]
fn syntax_and_type_errors_carry_line_and_column() {
    let e = "listen:\n  address: [127.0.0.1\n"
        .parse::<Config>()
        .expect_err("bad YAML");
    let ConfigError::Parse { line, column, .. } = &e else {
        panic!("expected a parse error, got {e:?}");
    };
    assert!(line.is_some() && column.is_some(), "{e}");

    let text = minimal_with("listen.limits.maxHeaderBytes", "-1");
    let e = text.parse::<Config>().expect_err("negative size");
    let message = e.to_string();
    assert!(
        message.contains("listen.limits.maxHeaderBytes"),
        "{message}"
    );
    assert!(message.contains("line"), "{message}");

    let text = minimal_with("upstream.timeouts.read", "soon");
    let message = text
        .parse::<Config>()
        .expect_err("bad duration")
        .to_string();
    assert!(message.contains("upstream.timeouts.read"), "{message}");

    let text = minimal_with("upstream.replicaHeapHeadroom", "8Gb");
    let message = text
        .parse::<Config>()
        .expect_err("bad quantity")
        .to_string();
    assert!(
        message.contains("upstream.replicaHeapHeadroom"),
        "{message}"
    );
    assert!(message.contains("unknown unit"), "{message}");

    let message = "".parse::<Config>().expect_err("empty file").to_string();
    assert!(message.contains("missing field `listen`"), "{message}");
}

/// One invalid value each: (path, value, field reported, message fragment).
#[rustfmt::skip]
const INVALID: &[(&str, &str, &str, &str)] = &[
    // (path, value, field, message fragment)
    ("upstream.replicas", "[]", "upstream.replicas", "at least one replica"),
    ("upstream.replicas", "[a:1, foo]", "upstream.replicas[1]", "\"foo\" is not host:port (the port is missing)"),
    ("upstream.replicas", "[\"a:\"]", "upstream.replicas[0]", "is not a port"),
    ("upstream.replicas", "[\"a:0\"]", "upstream.replicas[0]", "is not a port"),
    ("upstream.replicas", "[\"a:70000\"]", "upstream.replicas[0]", "is not a port"),
    ("upstream.replicas", "[\"a:+443\"]", "upstream.replicas[0]", "is not a port"),
    ("upstream.replicas", "[\"::1:6443\"]", "upstream.replicas[0]", "needs brackets"),
    ("upstream.replicas", "[\"[::g]:6443\"]", "upstream.replicas[0]", "not an IPv6 address"),
    ("upstream.replicas", "[\"10.0.0.300:6443\"]", "upstream.replicas[0]", "not a hostname or IP"),
    ("upstream.replicas", "[\"bad_host:6443\"]", "upstream.replicas[0]", "not a hostname or IP"),
    ("upstream.replicas", "[\"https://a:6443\"]", "upstream.replicas[0]", "is not host:port"),
    ("upstream.replicas", "[a:6443, b:6443, A:6443]", "upstream.replicas[2]", "repeats upstream.replicas[0]"),
    ("upstream.ca", "\"\"", "upstream.ca", "must not be empty"),
    ("upstream.serverName", "\"not a name\"", "upstream.serverName", "not a DNS name"),
    ("upstream.frontProxy.headers.user", "\"\"", "upstream.frontProxy.headers.user", "must not be empty"),
    ("upstream.frontProxy.headers.group", "\"X Remote\"", "upstream.frontProxy.headers.group", "not a valid HTTP header name"),
    ("upstream.self", "{}", "upstream.self", "set cert and key, or tokenFile"),
    ("upstream.self", "{cert: a, key: b, tokenFile: c}", "upstream.self", "not both"),
    ("upstream.self", "{cert: a}", "upstream.self.key", "required with upstream.self.cert"),
    ("upstream.self", "{key: b, tokenFile: c}", "upstream.self.cert", "required with upstream.self.key"),
    ("upstream.timeouts.connect", "0s", "upstream.timeouts.connect", "greater than 0"),
    ("upstream.timeouts.list", "0s", "upstream.timeouts.list", "greater than 0"),
    ("upstream.streamsPerConnection", "0", "upstream.streamsPerConnection", "greater than 0"),
    ("upstream.replicaHeapHeadroom", "0", "upstream.replicaHeapHeadroom", "greater than 0"),
    ("upstream.bulwarkReplicas", "0", "upstream.bulwarkReplicas", "at least 1"),
    ("upstream.ejectMax", "500ms", "upstream.ejectMax", "shorter than upstream.ejectBase"),
    ("upstream.stallTimeout", "0s", "upstream.stallTimeout", "greater than 0"),
    ("listen.goawayChance", "0.05", "listen.goawayChance", "outside 0 to 0.02"),
    ("listen.goawayChance", "-0.001", "listen.goawayChance", "outside 0 to 0.02"),
    ("listen.goawayChance", ".nan", "listen.goawayChance", "outside 0 to 0.02"),
    ("listen.cert", "\"\"", "listen.cert", "must not be empty"),
    ("listen.limits.maxHeaderBytes", "0", "listen.limits.maxHeaderBytes", "greater than 0"),
    ("listen.limits.headerReadTimeout", "0s", "listen.limits.headerReadTimeout", "greater than 0"),
    ("listen.limits.maxConcurrentStreams", "0", "listen.limits.maxConcurrentStreams", "greater than 0"),
    ("listen.limits.idleTimeout", "0s", "listen.limits.idleTimeout", "greater than 0"),
    ("listen.limits", "{bufferedBodyBytesPerFlow: 1Mi}", "listen.limits.bufferedBodyBytesPerFlow", "at least listen.limits.maxBodyBytes"),
    ("listen.limits", "{bufferedBodyBytes: 16Mi}", "listen.limits.bufferedBodyBytes", "at least listen.limits.bufferedBodyBytesPerFlow"),
    ("listen.shutdown.grace", "0s", "listen.shutdown.grace", "greater than 0"),
    ("listen.limits", "{maxConnectionsPerSource: 100, maxConnectionsPerPrefix: 50}", "listen.limits.maxConnectionsPerPrefix", "less than listen.limits.maxConnectionsPerSource"),
    ("listen.limits.firstByteTimeout", "0s", "listen.limits.firstByteTimeout", "greater than 0"),
    ("listen.limits.proxyHeaderTimeout", "0s", "listen.limits.proxyHeaderTimeout", "greater than 0"),
    ("admin.limits.maxConnections", "0", "admin.limits.maxConnections", "greater than 0"),
    ("admin.limits.maxConnections", "257", "admin.limits.maxConnections", "a quarter of listen.limits.reservedFileDescriptors"),
    ("admin.limits", "{maxConnectionsPerSource: 16, maxConnectionsPerPrefix: 8}", "admin.limits.maxConnectionsPerPrefix", "less than admin.limits.maxConnectionsPerSource"),
    ("admin.limits.headerReadTimeout", "0s", "admin.limits.headerReadTimeout", "greater than 0"),
    ("admin.limits.idleTimeout", "0s", "admin.limits.idleTimeout", "greater than 0"),
    ("identity.anonymous", "[/version, healthz]", "identity.anonymous[1]", "must start with '/'"),
    ("identity.anonymous", "[\"/version?x=1\"]", "identity.anonymous[0]", "without query"),
    ("identity.tokenReview.ttl", "0s", "identity.tokenReview.ttl", "greater than 0"),
    ("identity.tokenReview.maxEntries", "0", "identity.tokenReview.maxEntries", "greater than 0"),
    ("identity.tokenReview.maxRejectedEntries", "0", "identity.tokenReview.maxRejectedEntries", "greater than 0"),
    ("identity.tokenReview.maxTokenBytes", "0", "identity.tokenReview.maxTokenBytes", "greater than 0"),
    ("identity.tokenReview.rate", "{qps: .inf, burst: 10}", "identity.tokenReview.rate.qps", "greater than 0"),
    ("identity.tokenReview.perSource", "{qps: 5, burst: 0}", "identity.tokenReview.perSource.burst", "greater than 0"),
    ("identity.tokenReview.maxSources", "0", "identity.tokenReview.maxSources", "greater than 0"),
    ("identity.tokenReview.maxConcurrent", "0", "identity.tokenReview.maxConcurrent", "greater than 0"),
    ("identity.tokenReview.maxAge", "5s", "identity.tokenReview.maxAge", "at least ttl"),
    ("identity.tokenReview.refreshRate", "{qps: 0, burst: 10}", "identity.tokenReview.refreshRate.qps", "greater than 0"),
    ("identity.tokenReview.maxConcurrentRefreshes", "0", "identity.tokenReview.maxConcurrentRefreshes", "greater than 0"),
    ("identity.tokenReview.maxWait", "0s", "identity.tokenReview.maxWait", "greater than 0"),
    ("cache.resources", "[secrets, Secrets]", "cache.resources[1]", "not a resource name"),
    ("cache.resources", "[secrets, \"pods/status\"]", "cache.resources[1]", "not a resource name"),
    ("cache.resources", "[\"endpointslices.\"]", "cache.resources[0]", "not a resource name"),
    ("cache.resources", "[secrets, endpoints, secrets]", "cache.resources[2]", "repeats cache.resources[0]"),
    ("cache.excludeNamespaces", "[kube-system, Bad_NS]", "cache.excludeNamespaces[1]", "not a namespace name"),
    ("cache.excludeNames", "[\"ns/\"]", "cache.excludeNames[0]", "not namespace/name"),
    ("cache.ringSize", "0", "cache.ringSize", "greater than 0"),
    ("cache.listCacheBytes", "0", "cache.listCacheBytes", "greater than 0"),
    ("rules.folder", "\"\"", "rules.folder", "must not be empty"),
    ("audit.path", "\"\"", "audit.path", "must not be empty"),
    ("audit.maxSize", "4Ki", "audit.maxSize", "at least 64Ki"),
    ("audit.maxFiles", "0", "audit.maxFiles", "at least 1"),
];

#[test]
fn each_invalid_value_is_reported_on_its_field() {
    for (path, value, field, fragment) in INVALID {
        let text = minimal_with(path, value);
        let found = problems(&text);
        assert!(
            found
                .iter()
                .any(|p| p.field == *field && p.message.contains(fragment)),
            "{path} = {value}: expected {field}: …{fragment}…, got {found:?}"
        );
        assert_eq!(found.len(), 1, "{path} = {value}: {found:?}");
    }
}

#[test]
fn front_proxy_is_required_only_in_front_proxy_mode() {
    let without = MINIMAL.replace("  frontProxy: {cert: fp.crt, key: fp.key}\n", "");
    let found = problems(&without);
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0].field, "upstream.frontProxy");
    assert!(found[0].message.contains("identity.mode is front-proxy"));
    for mode in ["impersonate", "passthrough"] {
        let text = format!("{without}identity: {{mode: {mode}}}\n");
        text.parse::<Config>()
            .unwrap_or_else(|e| panic!("{mode}: {e}"));
    }
}

#[test]
fn every_problem_is_listed_at_once() {
    let text = "
listen:
  address: 127.0.0.1:6443
  cert: tls.crt
  key: tls.key
  goawayChance: 0.5
upstream:
  replicas: [a:6443, foo, a:6443]
  ca: ca.crt
  self: {cert: c.crt}
  bulwarkReplicas: 0
  replicaHeapHeadroom: 0
identity:
  anonymous: [healthz]
cache:
  ringSize: 0
  resources: [Secrets]
";
    let e = text.parse::<Config>().expect_err("invalid");
    let ConfigError::Invalid(found) = &e else {
        panic!("expected problems, got {e}");
    };
    let fields: Vec<&str> = found.iter().map(|p| p.field.as_str()).collect();
    for field in [
        "listen.goawayChance",
        "upstream.replicas[1]",
        "upstream.replicas[2]",
        "upstream.self.key",
        "upstream.bulwarkReplicas",
        "upstream.replicaHeapHeadroom",
        "upstream.frontProxy",
        "identity.anonymous[0]",
        "cache.ringSize",
        "cache.resources[0]",
    ] {
        assert!(fields.contains(&field), "{field} missing from {fields:?}");
    }
    assert_eq!(found.len(), 10, "{found:?}");
    // The error prints one problem per line.
    let printed = e.to_string();
    assert_eq!(printed.lines().count(), 10, "{printed}");
    assert!(printed.contains("upstream.replicas[1]: \"foo\" is not host:port"));
}

#[test]
fn a_non_loopback_admin_address_without_token_is_allowed_but_guards_debug() {
    let text = format!("{MINIMAL}admin: {{address: 0.0.0.0:9443}}\n");
    let config: Config = text.parse().unwrap_or_else(|e| panic!("{e}"));
    assert!(config.admin.debug_needs_token());
    assert!(config.admin.token_file.is_none());
    let local: Config = MINIMAL.parse().unwrap_or_else(|e| panic!("{e}"));
    assert!(!local.admin.debug_needs_token());
}

#[test]
fn the_fleet_is_off_by_default_and_its_section_is_checked_field_by_field() {
    let off: Config = MINIMAL.parse().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(off.fleet, None);
    let on: Config = minimal_with("fleet", "{namespace: bulwark}")
        .parse()
        .unwrap_or_else(|e| panic!("{e}"));
    let fleet = on.fleet.expect("fleet section");
    assert_eq!(fleet.lease_prefix, "bulwark-");
    assert_eq!(fleet.identity, None);
    assert_eq!(fleet.renew_interval, Duration::from_secs(2));
    assert_eq!(fleet.lease_duration, Duration::from_secs(10));
    assert_eq!(
        fleet.key_file, None,
        "unauthenticated Leases unless a key is given"
    );
    assert!(!fleet.accept_unsigned);
    let unsigned = problems(&minimal_with(
        "fleet",
        "{namespace: bulwark, acceptUnsigned: true}",
    ));
    assert_eq!(
        unsigned
            .iter()
            .map(|p| p.field.as_str())
            .collect::<Vec<_>>(),
        ["fleet.acceptUnsigned"],
        "{unsigned:?}"
    );
    let found = problems(&minimal_with(
        "fleet",
        "{namespace: Kube_System, leasePrefix: -x, identity: Node.A, keyFile: '', renewInterval: 0s, leaseDuration: 1500ms}",
    ));
    let fields: Vec<&str> = found.iter().map(|p| p.field.as_str()).collect();
    assert_eq!(
        fields,
        vec![
            "fleet.namespace",
            "fleet.leasePrefix",
            "fleet.identity",
            "fleet.keyFile",
            "fleet.renewInterval",
            "fleet.leaseDuration",
        ],
        "{found:?}"
    );
    let short = problems(&minimal_with(
        "fleet",
        "{namespace: bulwark, renewInterval: 6s, leaseDuration: 10s}",
    ));
    assert_eq!(short.len(), 1, "{short:?}");
    assert!(
        short[0].message.contains("twice fleet.renewInterval"),
        "{short:?}"
    );
    assert!(
        minimal_with("fleet", "{leasePrefix: x-}")
            .parse::<Config>()
            .is_err(),
        "namespace is required"
    );
}

#[test]
fn the_list_byte_budget_divides_headroom_by_five_and_by_replicas() {
    let text = minimal_with_all(&[
        ("upstream.replicaHeapHeadroom", "10Gi"),
        ("upstream.bulwarkReplicas", "2"),
    ]);
    let config: Config = text.parse().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(config.upstream.replica_heap_headroom, Quantity(10 << 30));
    assert_eq!(config.upstream.list_byte_budget(), (10u64 << 30) / 5 / 2);
    let default: Config = MINIMAL.parse().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(default.upstream.list_byte_budget(), (8u64 << 30) / 5);
}

#[test]
fn replica_addresses_parse_into_host_and_port() {
    let text = minimal_with(
        "upstream.replicas",
        "[\"API-1.Example:6443\", \"10.0.0.1:443\", \"[fd00::1]:6443\"]",
    );
    let config: Config = text.parse().unwrap_or_else(|e| panic!("{e}"));
    let addrs = &config.upstream.replicas;
    let shown: Vec<String> = addrs.iter().map(ToString::to_string).collect();
    assert_eq!(
        shown,
        ["api-1.example:6443", "10.0.0.1:443", "[fd00::1]:6443"]
    );
    assert_eq!(
        addrs[2],
        ReplicaAddr {
            host: "fd00::1".into(),
            port: 6443
        }
    );
}

#[test]
fn cache_resources_split_into_group_and_resource() {
    let config: Config = MINIMAL.parse().unwrap_or_else(|e| panic!("{e}"));
    let resources: Vec<(String, String)> = config
        .cache
        .resources
        .into_iter()
        .map(|gr| (gr.group, gr.resource))
        .collect();
    assert_eq!(
        resources,
        [
            ("".into(), "secrets".into()),
            ("".into(), "endpoints".into()),
            ("discovery.k8s.io".into(), "endpointslices".into()),
        ]
    );
}

#[test]
fn timeouts_follow_the_verb_class_and_long_running_requests_have_none() {
    let text = minimal_with("upstream.timeouts", "{read: 11s, list: 22s, write: 33s}");
    let config: Config = text.parse().unwrap_or_else(|e| panic!("{e}"));
    let timeouts = &config.upstream.timeouts;
    let timeout = |method: &str, target: &str| {
        let method = http::Method::from_bytes(method.as_bytes()).expect("method");
        let info = classify(&method, &target.parse().expect("uri")).expect("classifies");
        timeouts.for_request(&info)
    };
    let secs = |s| Some(Duration::from_secs(s));
    assert_eq!(timeout("GET", "/api/v1/namespaces/d/pods/p"), secs(11));
    assert_eq!(timeout("GET", "/version"), secs(11));
    assert_eq!(timeout("GET", "/api/v1/pods"), secs(22));
    assert_eq!(timeout("POST", "/api/v1/namespaces/d/pods"), secs(33));
    assert_eq!(timeout("DELETE", "/api/v1/namespaces/d/pods"), secs(33));
    assert_eq!(timeout("GET", "/api/v1/pods?watch=1"), None);
    assert_eq!(
        timeout("GET", "/api/v1/namespaces/d/pods/p/log?follow=true"),
        None
    );
    assert_eq!(timeout("POST", "/api/v1/namespaces/d/pods/p/exec"), None);
    assert_eq!(timeouts.connect, Duration::from_secs(5));
}

#[test]
fn an_attempt_limit_covers_reads_whose_head_the_apiserver_sends_at_once() {
    let default: Config = minimal_with("upstream.timeouts", "{}")
        .parse()
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        default.upstream.timeouts.attempt,
        Duration::from_secs(20),
        "the default"
    );
    let text = minimal_with("upstream.timeouts", "{attempt: 3s}");
    let config: Config = text.parse().unwrap_or_else(|e| panic!("{e}"));
    let timeouts = &config.upstream.timeouts;
    let attempt = |method: &str, target: &str| {
        let method = http::Method::from_bytes(method.as_bytes()).expect("method");
        let info = classify(&method, &target.parse().expect("uri")).expect("classifies");
        timeouts.attempt_for(&info)
    };
    let three = Some(Duration::from_secs(3));
    assert_eq!(attempt("GET", "/api/v1/namespaces/d/pods/p"), three);
    // Non-resource reads may be slow on every replica (`/openapi/v2` with many CRDs).
    assert_eq!(attempt("GET", "/version"), None);
    assert_eq!(attempt("GET", "/openapi/v2"), None);
    assert_eq!(
        attempt("GET", "/api/v1/pods?watch=1"),
        three,
        "a watch's start"
    );
    // A list's head comes only once its whole result is read.
    assert_eq!(attempt("GET", "/api/v1/pods"), None);
    // Writes are never sent twice.
    assert_eq!(attempt("POST", "/api/v1/namespaces/d/pods"), None);
    assert_eq!(attempt("DELETE", "/api/v1/namespaces/d/pods/p"), None);
    // Heads that wait on a pod or the kubelet, not the apiserver.
    assert_eq!(
        attempt("GET", "/api/v1/namespaces/d/pods/p/log?follow=true"),
        None
    );
    assert_eq!(attempt("GET", "/api/v1/namespaces/d/pods/p/proxy/x"), None);
    assert_eq!(attempt("GET", "/api/v1/namespaces/d/pods/p/exec"), None);
    let zero = minimal_with("upstream.timeouts", "{attempt: 0s}");
    let err = zero.parse::<Config>().expect_err("zero is refused");
    assert!(
        err.to_string().contains("upstream.timeouts.attempt"),
        "{err}"
    );
}

//! The watch-fed cache over real sockets, in Bulwark as production starts it: the simulated
//! fleet as the one upstream, the cache's informers with Bulwark's own certificate,
//! SubjectAccessReviews answered by the simulator's policy, and real clients (raw HTTP/2
//! and the `kube` crate) in front.

use std::collections::BTreeMap;
use std::time::Duration;

use bulwark_testkit::{Cluster, Setup};
use futures::{StreamExt, TryStreamExt};
use http_body_util::BodyExt;
use k8s_openapi::api::core::v1::Secret;
use kube::api::Api;
use kube::runtime::{WatchStreamExt, reflector, watcher};
use serde_json::{Value, json};

/// Bulwark with its cache on in front of `setup`'s fleet (two replicas unless it says
/// otherwise, bookmarks every 200 ms), ready with the cache synced. Requests take the whole
/// production path (Rescue, Classify, Identify, Admit with the cache, Forward); the default
/// rules put every authenticated client in the `exempt` level, so that admission never
/// queues or refuses them and what a test sees is the cache's doing.
async fn cached(setup: Setup) -> Cluster {
    Cluster::start(Setup {
        cache: true,
        bookmark_interval: Duration::from_millis(200),
        settings: [vec![("cache.syncCap", "30s")], setup.settings].concat(),
        ..setup
    })
    .await
    .ready()
    .await
}

/// A fleet of two with `seed`, behind Bulwark with its cache.
async fn seeded(seed: &'static str) -> Cluster {
    cached(Setup {
        replicas: 2,
        seed: vec![seed],
        ..Setup::default()
    })
    .await
}

/// `user` GETs `path` on a connection of its own: the status and the JSON body (`Null`
/// when the body is not JSON).
async fn get(cluster: &Cluster, user: &str, path: &str) -> (http::StatusCode, Value) {
    let answer = cluster.client(user, &[]).await.get(path).await;
    (
        answer.status,
        serde_json::from_slice(&answer.body).unwrap_or(Value::Null),
    )
}

/// Secret reads of `verb` the cache answered so far.
fn hits(cluster: &Cluster, verb: &str) -> u64 {
    cluster
        .bulwark
        .admin
        .metrics
        .cache_requests_total
        .with_label_values(&["secrets", verb, "hit"])
        .get()
}

/// The cache's relists of secrets so far.
fn relists(cluster: &Cluster) -> u64 {
    cluster
        .bulwark
        .admin
        .metrics
        .cache_relists_total
        .with_label_values(&["secrets"])
        .get()
}

fn names(list: &Value) -> Vec<String> {
    list["items"]
        .as_array()
        .map(|items| {
            items
                .iter()
                .map(|i| {
                    i["metadata"]["name"]
                        .as_str()
                        .unwrap_or_default()
                        .to_owned()
                })
                .collect()
        })
        .unwrap_or_default()
}

fn create(cluster: &Cluster, ns: &str, name: &str, value: &str) {
    cluster
        .fleet
        .store()
        .create(
            "secrets",
            ns,
            json!({"metadata": {"name": name, "labels": {"app": "churn"}}, "data": {"k": value}}),
        )
        .unwrap();
}

/// The simulator's secrets as name → resourceVersion.
fn truth(cluster: &Cluster) -> BTreeMap<String, String> {
    let (_, objects) = cluster.fleet.store().list("secrets", None, None).unwrap();
    objects
        .iter()
        .map(|o| (format!("{}/{}", o.namespace, o.name), o.rv.to_string()))
        .collect()
}

// Over 120 lines: one cache and every kind of reader, each answer beside who may read it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_are_answered_from_the_cache_and_authorized_per_reader() {
    let cluster = seeded("secrets=20x1KiB@team,other").await;
    cluster
        .fleet
        .store()
        .create(
            "secrets",
            "team",
            json!({"metadata": {"name": "n1-secret"}}),
        )
        .unwrap();
    // Wait until the cache has the new secret.
    let rv = cluster.fleet.store().resource_version();
    while cluster
        .cache()
        .scope_size("secrets", Some("team"))
        .map(|s| s.0)
        != Some(11)
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let (status, list) = get(
        &cluster,
        "alice",
        "/api/v1/namespaces/team/secrets?resourceVersion=0",
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(list["kind"], "SecretList");
    assert_eq!(names(&list).len(), 11);
    assert!(
        list["metadata"]["resourceVersion"]
            .as_str()
            .unwrap()
            .parse::<u64>()
            .unwrap()
            >= rv
    );
    let (status, secret) = get(
        &cluster,
        "alice",
        "/api/v1/namespaces/team/secrets/secret-0?resourceVersion=0",
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(secret["kind"], "Secret");
    // None of alice's reads reached the apiservers: the cache answered, after a review.
    assert!(
        cluster.upstream_requests_of("alice").is_empty(),
        "{:?}",
        cluster.upstream_requests_of("alice")
    );
    assert!(
        cluster
            .upstream_requests_of("bulwark")
            .iter()
            .any(|p| p.contains("subjectaccessreviews"))
    );

    // A user without access gets 403 and never the data, for every read.
    for path in [
        "/api/v1/namespaces/team/secrets/secret-0?resourceVersion=0",
        "/api/v1/namespaces/team/secrets?resourceVersion=0",
        "/api/v1/secrets?resourceVersion=0",
        "/api/v1/namespaces/team/secrets?watch=1&resourceVersion=0",
    ] {
        let (status, body) = get(&cluster, "mallory", path).await;
        assert_eq!(status, 403, "{path}");
        assert_eq!(body["reason"], "Forbidden");
        assert!(body.get("items").is_none() && body.get("data").is_none());
    }

    // A node reads its own secret by name, and no other.
    let own =
        "/api/v1/namespaces/team/secrets?resourceVersion=0&fieldSelector=metadata.name%3Dn1-secret";
    let (status, list) = get(&cluster, "system:node:n1", own).await;
    assert_eq!(status, 200);
    assert_eq!(names(&list), ["n1-secret"]);
    let (status, _) = get(
        &cluster,
        "system:node:n1",
        "/api/v1/namespaces/team/secrets/n1-secret?resourceVersion=0",
    )
    .await;
    assert_eq!(status, 200);
    for other in [
        "/api/v1/namespaces/team/secrets?resourceVersion=0&fieldSelector=metadata.name%3Dsecret-0",
        "/api/v1/namespaces/team/secrets?resourceVersion=0",
        "/api/v1/namespaces/team/secrets/secret-0?resourceVersion=0",
    ] {
        assert_eq!(
            get(&cluster, "system:node:n1", other).await.0,
            403,
            "{other}"
        );
    }

    // Every Secret read the cache answered or refused is in the audit log, with the
    // client's address.
    let events = cluster.audit_events();
    let log = format!("{events:#?}");
    let who_and_code: Vec<(&str, u64)> = events
        .iter()
        .map(|e| {
            (
                e["user"]["username"].as_str().unwrap(),
                e["responseStatus"]["code"].as_u64().unwrap(),
            )
        })
        .collect();
    let mut expected = vec![("alice", 200); 2];
    expected.extend([("mallory", 403); 4]);
    expected.extend([("system:node:n1", 200); 2]);
    expected.extend([("system:node:n1", 403); 3]);
    assert_eq!(who_and_code, expected, "{log}");
    assert!(events.iter().all(|e| e["apiVersion"] == "audit.k8s.io/v1"));
    assert!(
        events
            .iter()
            .all(|e| e["sourceIPs"] == serde_json::json!(["127.0.0.1"])),
        "{log}"
    );
}

/// logrotate moves the audit log away, then sends SIGHUP: Bulwark lets the moved file go
/// and writes the next reads to a new file at the configured path, every line whole.
#[cfg(unix)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_after_the_audit_log_is_moved_starts_a_new_file() {
    let cluster = seeded("secrets=5x256B@team").await;
    let path = cluster
        .config
        .audit
        .clone()
        .expect("the audit log is configured");
    let read = "/api/v1/namespaces/team/secrets?resourceVersion=0";
    assert_eq!(get(&cluster, "alice", read).await.0, 200);
    cluster.bulwark.flush_logs();
    let moved = path.with_extension("jsonl-rotated");
    std::fs::rename(&path, &moved).unwrap();
    // Through kill(1): the workspace forbids `unsafe`; Bulwark handles SIGHUP since start.
    let hup = std::process::Command::new("kill")
        .args(["-HUP", &std::process::id().to_string()])
        .status()
        .unwrap();
    assert!(hup.success());
    // The signal is taken on the runtime: read until a line lands in a new file.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while std::fs::metadata(&path).map_or(true, |m| m.len() == 0) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no new audit log after SIGHUP"
        );
        assert_eq!(get(&cluster, "alice", read).await.0, 200);
        cluster.bulwark.flush_logs();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let events = |file: &std::path::Path| -> Vec<Value> {
        std::fs::read_to_string(file)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("torn ({e}): {l}")))
            .collect()
    };
    let (old, new) = (events(&moved), events(&path));
    assert!(
        !old.is_empty(),
        "the moved file keeps what was written before"
    );
    assert!(!new.is_empty(), "the new file gets the reads after SIGHUP");
    for event in old.iter().chain(&new) {
        assert_eq!(event["user"]["username"], "alice");
        assert_eq!(event["verb"], "list");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pagination_works_across_pages() {
    let cluster = seeded("secrets=25x512B@team").await;
    let mut seen = Vec::new();
    let mut path = "/api/v1/namespaces/team/secrets?resourceVersion=0&limit=10".to_owned();
    loop {
        let (status, page) = get(&cluster, "alice", &path).await;
        assert_eq!(status, 200, "{page}");
        seen.extend(names(&page));
        match page["metadata"]["continue"].as_str() {
            Some(token) => {
                path = format!("/api/v1/namespaces/team/secrets?limit=10&continue={token}")
            }
            None => break,
        }
    }
    assert_eq!(seen.len(), 25);
    assert!(cluster.upstream_requests_of("alice").is_empty());
}

/// Who answers a page of a list.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Answerer {
    /// Bulwark's cache.
    Cache,
    /// The simulated apiserver, asked directly.
    Apiserver,
}

/// One page of a list (`limit=1`), from the cache or straight from a simulated apiserver:
/// its items as `namespace/name`, and its continue token's start key and
/// `remainingItemCount` (`None` on the last page), and the token itself.
async fn page(
    cluster: &Cluster,
    by: Answerer,
    base: &str,
    token: Option<&str>,
) -> (Vec<String>, Option<(String, u64, String)>) {
    let path = match (token, by) {
        (Some(token), _) => format!("{base}?limit=1&continue={token}"),
        // A first page the cache answers without a freshness proof (any version it has
        // reached; at version 0 both it and the apiserver would ignore the limit).
        (None, Answerer::Cache) => {
            format!("{base}?resourceVersion=1&resourceVersionMatch=NotOlderThan&limit=1")
        }
        (None, Answerer::Apiserver) => format!("{base}?limit=1"),
    };
    let list = match by {
        Answerer::Cache => {
            let before = hits(cluster, "list");
            let (status, list) = get(cluster, "alice", &path).await;
            assert_eq!(status, 200, "{path}: {list}");
            assert_eq!(
                hits(cluster, "list"),
                before + 1,
                "the cache did not answer {path}"
            );
            list
        }
        Answerer::Apiserver => {
            let cert = cluster.pki.client_ca.client_cert("alice", &[]);
            let tls = bulwark_testkit::tls_config(&cluster.pki, Some(&cert));
            let reply = bulwark_sim::client::get(cluster.fleet.addrs()[0], &tls, &path)
                .await
                .unwrap();
            assert_eq!(reply.status, 200, "{path}: {:?}", reply.body);
            reply.json()
        }
    };
    let items = list["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| {
            let meta = &i["metadata"];
            format!(
                "{}/{}",
                meta["namespace"].as_str().unwrap(),
                meta["name"].as_str().unwrap()
            )
        })
        .collect();
    let next = list["metadata"]["continue"].as_str().map(|token| {
        let start = apimachinery::continue_token::decode(token).unwrap().start;
        let remaining = list["metadata"]["remainingItemCount"].as_u64().unwrap();
        (start, remaining, token.to_owned())
    });
    (items, next)
}

/// Pages through `base` with `limit=1`, page `i` answered by `who(i)`: every item, and each
/// token's start key and remaining count.
async fn walk(
    cluster: &Cluster,
    base: &str,
    who: impl Fn(usize) -> Answerer,
) -> (Vec<String>, Vec<(String, u64)>) {
    let (mut items, mut tokens) = (Vec::new(), Vec::new());
    let mut token: Option<String> = None;
    for i in 0.. {
        let (page_items, next) = page(cluster, who(i), base, token.as_deref()).await;
        assert_eq!(page_items.len(), 1, "page {i} of {base}");
        items.extend(page_items);
        match next {
            Some((start, remaining, next)) => {
                tokens.push((start, remaining));
                token = Some(next);
            }
            None => break,
        }
    }
    (items, tokens)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_list_pages_on_across_the_cache_and_the_apiserver_in_either_direction() {
    // `team-a/…` keys come before `team/…` ones in etcd: a list that ordered by namespace
    // and then name would repeat or skip items when the two take turns.
    let cluster = seeded("secrets=6x256B@team,team-a").await;
    for (base, expected, first_start) in [
        (
            "/api/v1/secrets",
            vec![
                "team-a/secret-1",
                "team-a/secret-3",
                "team-a/secret-5",
                "team/secret-0",
                "team/secret-2",
                "team/secret-4",
            ],
            "team-a/secret-1\0",
        ),
        (
            "/api/v1/namespaces/team/secrets",
            vec!["team/secret-0", "team/secret-2", "team/secret-4"],
            "secret-0\0",
        ),
    ] {
        let (truth, tokens) = walk(&cluster, base, |_| Answerer::Apiserver).await;
        assert_eq!(truth, expected, "{base} from the apiserver");
        assert_eq!(tokens[0].0, first_start, "{base}");
        let remaining: Vec<u64> = tokens.iter().map(|t| t.1).collect();
        let counts: Vec<u64> = (1..expected.len() as u64).rev().collect();
        assert_eq!(remaining, counts, "{base}");
        // Each continues the other's tokens, page after page, starting either way.
        for (name, who) in [
            (
                "cache first",
                (|i| {
                    if i % 2 == 0 {
                        Answerer::Cache
                    } else {
                        Answerer::Apiserver
                    }
                }) as fn(usize) -> Answerer,
            ),
            ("apiserver first", |i| {
                if i % 2 == 0 {
                    Answerer::Apiserver
                } else {
                    Answerer::Cache
                }
            }),
            ("cache alone", |_| Answerer::Cache),
        ] {
            let (items, their_tokens) = walk(&cluster, base, who).await;
            assert_eq!(items, expected, "{base}, {name}");
            assert_eq!(their_tokens, tokens, "{base}, {name}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kube_reflector_stays_equal_to_the_store_when_the_cache_syncs_by_watch_list() {
    reflector_across_breaks_relists_and_restarts("true", "sendInitialEvents=true").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kube_reflector_stays_equal_to_the_store_when_the_cache_syncs_by_list() {
    reflector_across_breaks_relists_and_restarts("false", "limit=500").await;
}

/// A kube reflector through Bulwark against the simulator's store, under churn, across an
/// upstream watch break, a 410 relist and a replica restart; the cache's informers sync by
/// WatchList when `watch_list` is `true`, and their sync requests contain `sync_marker`.
// Over 120 lines: one reflector through breaks, relists and restarts in order, each
// asserting on the cache the last one left.
async fn reflector_across_breaks_relists_and_restarts(watch_list: &'static str, sync_marker: &str) {
    let cluster = cached(Setup {
        replicas: 2,
        event_ring: 30,
        seed: vec!["secrets=30x256B@team,other"],
        settings: vec![("cache.watchList", watch_list)],
        ..Setup::default()
    })
    .await;
    let client = cluster.kube_client("alice", &[]).await;
    let api: Api<Secret> = Api::all(client);
    let (reader, writer) = reflector::store();
    let stream = reflector(
        writer,
        watcher(api, watcher::Config::default().any_semantic()),
    )
    .default_backoff()
    .applied_objects();
    let task = tokio::spawn(async move {
        let mut stream = stream.boxed();
        // Errors (a 410, a refused request) are retried by the watcher after its backoff.
        while stream.next().await.is_some() {}
    });
    let view = || -> BTreeMap<String, String> {
        reader
            .state()
            .iter()
            .map(|s| {
                let m = &s.metadata;
                (
                    format!(
                        "{}/{}",
                        m.namespace.clone().unwrap_or_default(),
                        m.name.clone().unwrap_or_default()
                    ),
                    m.resource_version.clone().unwrap_or_default(),
                )
            })
            .collect()
    };
    let converge = |what: &'static str| {
        let view = &view;
        let cluster = &cluster;
        async move {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
            loop {
                if view() == truth(cluster) {
                    return;
                }
                if tokio::time::Instant::now() >= deadline {
                    let (v, t) = (view(), truth(cluster));
                    let missing: Vec<_> = t
                        .iter()
                        .filter(|(k, r)| v.get(*k) != Some(r))
                        .take(5)
                        .collect();
                    let extra: Vec<_> = v
                        .iter()
                        .filter(|(k, r)| t.get(*k) != Some(r))
                        .take(5)
                        .collect();
                    panic!(
                        "{what}: the reflector never caught up: {} vs {} objects; missing {missing:?}; extra {extra:?}; cache {:?}\n{}",
                        v.len(),
                        t.len(),
                        cluster.cache().scope_size("secrets", None),
                        cluster
                            .metrics()
                            .lines()
                            .filter(|l| l.contains("cache"))
                            .collect::<Vec<_>>()
                            .join("\n")
                    );
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    converge("initial sync").await;

    // Churn: creates, updates and deletes.
    for i in 0..20 {
        create(&cluster, "team", &format!("churn-{i}"), "djE=");
        cluster
            .fleet
            .store()
            .patch(
                "secrets",
                "other",
                &format!("secret-{}", (i * 2 + 1) % 30),
                &json!({"data": {"k": "djI="}}),
            )
            .unwrap();
        if i % 3 == 0 && i < 15 {
            cluster
                .fleet
                .store()
                .delete("secrets", "team", &format!("secret-{}", i * 2))
                .unwrap();
        }
    }
    converge("churn").await;

    // An upstream watch break: every replica resets its streams for a moment.
    for replica in cluster.fleet.replicas() {
        replica.set_reset_mid_body(Some(0));
    }
    create(&cluster, "team", "during-break", "djM=");
    tokio::time::sleep(Duration::from_millis(300)).await;
    for replica in cluster.fleet.replicas() {
        replica.set_reset_mid_body(None);
    }
    converge("watch break").await;

    // A 410 relist: the fleet goes away while more changes than its window happen.
    let relists_before = relists(&cluster);
    for replica in cluster.fleet.replicas() {
        replica.stop().await;
    }
    for i in 0..40 {
        create(&cluster, "other", &format!("offline-{i}"), "djQ=");
    }
    for replica in cluster.fleet.replicas() {
        replica.start().await;
    }
    converge("relist").await;
    // The reflector may have caught up through the apiserver (a watch the cache could not
    // yet answer goes upstream); the cache relists on its own schedule, within its backoff.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while relists(&cluster) == relists_before {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the cache never relisted; its requests: {:#?}",
            cluster
                .upstream_requests_of("bulwark")
                .iter()
                .filter(|p| p.contains("secrets"))
                .collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    converge("after the cache's relist").await;

    // A replica restart under churn.
    cluster.fleet.replica(0).stop().await;
    for i in 0..10 {
        create(&cluster, "team", &format!("restart-{i}"), "djU=");
    }
    cluster.fleet.replica(0).start().await;
    converge("replica restart").await;
    assert!(
        hits(&cluster, "list") + hits(&cluster, "watch") > 0,
        "the reflector was served from the cache"
    );
    let syncs = cluster
        .upstream_requests_of("bulwark")
        .into_iter()
        .filter(|p| p.starts_with("/api/v1/secrets?") && p.contains(sync_marker))
        .count();
    assert!(syncs >= 2, "the first sync and the relist: {syncs}");
    task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_list_informer_completes_its_initial_sync() {
    let cluster = seeded("secrets=15x256B@team").await;
    let client = cluster.kube_client("alice", &[]).await;
    let api: Api<Secret> = Api::namespaced(client, "team");
    let mut events = watcher(api, watcher::Config::default().streaming_lists()).boxed();
    let mut initial = 0;
    let done = tokio::time::timeout(Duration::from_secs(20), async {
        while let Some(event) = events.try_next().await.expect("watch event") {
            match event {
                watcher::Event::InitApply(_) => initial += 1,
                watcher::Event::InitDone => return true,
                _ => {}
            }
        }
        false
    })
    .await
    .expect("the initial sync ends");
    assert!(done);
    assert_eq!(initial, 15);
    assert!(
        hits(&cluster, "watch") >= 1,
        "the WatchList was served from the cache"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_watchers_share_one_upstream_watch_per_resource() {
    let cluster = seeded("secrets=5x256B@team").await;
    let mut senders = Vec::new();
    for _ in 0..4 {
        senders.push(cluster.client("alice", &[]).await.sender());
    }
    let mut bodies = Vec::new();
    for i in 0..200 {
        let mut sender = senders[i % senders.len()].clone();
        let request =
            bulwark_testkit::get("/api/v1/namespaces/team/secrets?watch=1&resourceVersion=0");
        sender.ready().await.unwrap();
        let response = sender.send_request(request).await.unwrap();
        assert_eq!(response.status(), 200);
        bodies.push(response.into_body());
    }
    create(&cluster, "team", "fan-out", "djE=");
    for body in &mut bodies {
        let mut seen = Vec::new();
        while !String::from_utf8_lossy(&seen).contains("\"name\":\"fan-out\"") {
            let frame = tokio::time::timeout(Duration::from_secs(10), body.frame())
                .await
                .expect("the event arrives")
                .expect("the stream is open")
                .unwrap();
            if let Ok(data) = frame.into_data() {
                seen.extend_from_slice(&data);
            }
        }
    }
    // The apiservers see the cache's watches (one per cached resource), not 200.
    let watches: u64 = cluster.fleet.stats().iter().map(|s| s.open_watches).sum();
    assert_eq!(watches, 3, "secrets, endpoints, endpointslices");
    assert!(cluster.upstream_requests_of("alice").is_empty());
}

/// Kubelets' watches of one Secret each (`fieldSelector=metadata.name=`), from the state
/// and from a version, read their Secret's events live from the cache (each from its
/// name's shard of the store's broadcast), as an unpinned watch reads them all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_of_one_secret_by_name_gets_its_updates_live() {
    let cluster = seeded("secrets=5x256B@team").await;
    let (status, list) = get(&cluster, "alice", "/api/v1/namespaces/team/secrets").await;
    assert_eq!(status, 200);
    let rv = list["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .to_owned();
    let mut sender = cluster.client("alice", &[]).await.sender();
    let mut watch = async |query: String| {
        let path = format!("/api/v1/namespaces/team/secrets?watch=1&{query}");
        sender.ready().await.unwrap();
        let response = sender
            .send_request(bulwark_testkit::get(&path))
            .await
            .unwrap();
        assert_eq!(response.status(), 200, "{path}");
        response.into_body()
    };
    let mut pinned = Vec::new();
    for i in 0..8 {
        let from = if i % 2 == 0 {
            "0".to_owned()
        } else {
            rv.clone()
        };
        let query = format!("fieldSelector=metadata.name%3Dmine-{i}&resourceVersion={from}");
        pinned.push((format!("mine-{i}"), watch(query).await));
    }
    let mut all = watch(format!("resourceVersion={rv}")).await;
    for i in 0..8 {
        create(&cluster, "team", &format!("mine-{i}"), "djE=");
    }
    let read_until = async |body: &mut hyper::body::Incoming, last: &str| {
        let mut seen = Vec::new();
        while !String::from_utf8_lossy(&seen).contains(&format!("\"name\":\"{last}\"")) {
            let frame = tokio::time::timeout(Duration::from_secs(10), body.frame())
                .await
                .unwrap_or_else(|_| panic!("{last}'s event arrives"))
                .expect("the stream is open")
                .unwrap();
            if let Ok(data) = frame.into_data() {
                seen.extend_from_slice(&data);
            }
        }
        events(&seen)
    };
    for (name, body) in &mut pinned {
        let got = read_until(body, name).await;
        assert_eq!(got, [("ADDED".to_owned(), name.clone())], "{name}'s watch");
    }
    let got = read_until(&mut all, "mine-7").await;
    let names: Vec<&str> = got.iter().map(|(_, n)| n.as_str()).collect();
    assert_eq!(
        names,
        (0..8).map(|i| format!("mine-{i}")).collect::<Vec<_>>(),
        "the unpinned watch gets every Secret's event"
    );
}

/// The events of a watch body that ended: `(type, name)` of each line.
fn events(body: &[u8]) -> Vec<(String, String)> {
    String::from_utf8_lossy(body)
        .lines()
        .map(|line| {
            let event: Value = serde_json::from_str(line).unwrap();
            let name = event["object"]["metadata"]["name"].as_str().unwrap_or("");
            (event["type"].as_str().unwrap().to_owned(), name.to_owned())
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_from_before_the_caches_events_is_streamed_by_the_apiserver() {
    // The cache keeps two events and the simulator many: a client resuming from a version
    // the cache no longer holds (as after a Bulwark restart) is streamed by the apiserver,
    // with its own authorization, never refused with 410 by Bulwark.
    let cluster = cached(Setup {
        replicas: 2,
        seed: vec!["secrets=3x256B@team"],
        settings: vec![("cache.ringSize", "2")],
        ..Setup::default()
    })
    .await;
    let rv_of = |object: Value| -> u64 {
        object["metadata"]["resourceVersion"]
            .as_str()
            .unwrap()
            .parse()
            .unwrap()
    };
    let mut versions = Vec::new();
    for i in 0..5 {
        let object = cluster
            .fleet
            .store()
            .create(
                "secrets",
                "team",
                json!({"metadata": {"name": format!("resumed-{i}")}}),
            )
            .unwrap();
        versions.push(rv_of(object));
    }
    let began = tokio::time::Instant::now();
    while cluster
        .cache()
        .scope_size("secrets", Some("team"))
        .map(|s| s.0)
        != Some(8)
    {
        assert!(
            began.elapsed() < Duration::from_secs(10),
            "the cache follows"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let watch = |rv: u64| {
        format!("/api/v1/namespaces/team/secrets?watch=1&resourceVersion={rv}&timeoutSeconds=1")
    };
    let served = |by: &str| {
        requests(
            &cluster,
            &["verb=\"watch\"", &format!("served_by=\"{by}\"")],
        )
    };
    let (upstream_before, cache_before) = (served("upstream"), served("cache"));

    // From the first write: the cache holds only the last two events, the apiserver all.
    let answer = cluster
        .client("alice", &[])
        .await
        .get(&watch(versions[0]))
        .await;
    assert_eq!(answer.status, 200);
    let expected: Vec<(String, String)> = (1..5)
        .map(|i| ("ADDED".to_owned(), format!("resumed-{i}")))
        .collect();
    assert_eq!(events(&answer.body), expected);
    assert!(
        cluster
            .upstream_requests_of("alice")
            .iter()
            .any(|p| p.contains(&format!("resourceVersion={}", versions[0]))),
        "{:?}",
        cluster.upstream_requests_of("alice")
    );
    assert_eq!(served("upstream") - upstream_before, 1.0);

    // The apiserver authorizes what goes to it: mallory is refused by it.
    let refused = cluster
        .client("mallory", &[])
        .await
        .get(&watch(versions[0]))
        .await;
    assert_eq!(refused.status, 403);
    assert!(
        !cluster.upstream_requests_of("mallory").is_empty(),
        "the apiserver answered mallory"
    );

    // Inside the cache's window: the cache streams, the apiserver sees nothing of alice.
    let asked = cluster.upstream_requests_of("alice").len();
    let answer = cluster
        .client("alice", &[])
        .await
        .get(&watch(versions[3]))
        .await;
    assert_eq!(answer.status, 200);
    assert_eq!(
        events(&answer.body),
        [("ADDED".to_owned(), "resumed-4".to_owned())]
    );
    assert_eq!(cluster.upstream_requests_of("alice").len(), asked);
    assert_eq!(served("cache") - cache_before, 1.0);
}

/// The sum of `bulwark_requests_total` samples with all of `labels`.
fn requests(cluster: &Cluster, labels: &[&str]) -> f64 {
    cluster
        .metrics()
        .lines()
        .filter(|l| l.starts_with("bulwark_requests_total{"))
        .filter(|l| labels.iter().all(|label| l.contains(label)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

//! Denial of service through Bulwark itself: what a hostile client can make it spend (token
//! reviews, metric series, buffered request bodies) stays bounded, and it is told so with
//! the usual `Status` answers.

use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use rand::Rng;
use rand::distr::Alphanumeric;

use bulwark_testkit::{Cluster, GOOD_TOKEN, Setup, get};

/// A random alphanumeric string of `len` characters.
fn random(len: usize) -> String {
    rand::rng()
        .sample_iter(Alphanumeric)
        .take(len)
        .map(char::from)
        .collect()
}

fn token_reviews(cluster: &Cluster) -> usize {
    cluster
        .fleet
        .seen_requests()
        .iter()
        .filter(|s| s.path.contains("/tokenreviews"))
        .count()
}

fn bearer(path: &str, token: &str) -> Request<Full<Bytes>> {
    let mut request = get(path);
    request.headers_mut().insert(
        http::header::AUTHORIZATION,
        format!("Bearer {token}").parse().unwrap(),
    );
    request
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_methods_paths_and_headers_leave_no_trace_in_the_metrics() {
    let cluster = Cluster::start(Setup {
        replicas: 1,
        ..Setup::default()
    })
    .await;
    let mut alice = cluster.client("alice", &[]).await;
    let mut sent = Vec::new();
    for _ in 0..300 {
        let method = format!("Q{}", random(200).to_uppercase());
        let request = Request::builder()
            .method(method.as_bytes())
            .uri("https://127.0.0.1/api/v1/namespaces/default/configmaps")
            .body(Full::new(Bytes::new()))
            .unwrap();
        alice.send(request).await;
        sent.push(method.to_lowercase());
    }
    for _ in 0..300 {
        let (a, b) = (random(40), random(40));
        sent.extend([a.clone(), b.clone()]);
        for path in [
            format!("/api/v1/namespaces/default/{a}"),
            format!("/apis/{a}.example.com/v1/{b}/x"),
            format!("/{a}/{b}"),
        ] {
            alice.get(&path).await;
        }
    }
    for _ in 0..300 {
        let (name, value) = (random(30).to_lowercase(), random(200));
        sent.extend([name.clone(), value.clone()]);
        let mut request = get("/api/v1/namespaces/default/configmaps");
        request.headers_mut().insert(
            http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
            value.parse().unwrap(),
        );
        alice.send(request).await;
    }
    let (_, text) = cluster.admin_get("/metrics").await;
    println!(
        "/metrics after 300 random methods, 900 random paths and 300 random headers: {} bytes",
        text.len()
    );
    for s in &sent {
        assert!(!text.contains(s.as_str()), "{s} appears in /metrics");
    }
    assert!(
        text.contains("verb=\"other\""),
        "unknown methods are counted as other"
    );
    assert!(
        text.len() < 256 * 1024,
        "/metrics grew to {} bytes",
        text.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_thousand_random_tokens_make_a_bounded_number_of_reviews() {
    // A ttl longer than the flood: the good token is not yet due for its re-review at the
    // end, so a review then would mean the flood pushed it out.
    let cluster = Cluster::start(Setup {
        replicas: 1,
        // All 3,000 on one connection, which would otherwise be closed after 16 refusals in
        // a row (`front_door.rs` tests that): here only the review bounds are under test.
        settings: vec![
            ("identity.tokenReview.ttl", "60s"),
            ("identity.tokenReview.maxAge", "120s"),
            ("listen.limits.maxUnauthenticatedRequests", "100000"),
        ],
        ..Setup::default()
    })
    .await;
    let path = "/api/v1/namespaces/default/configmaps";
    let mut client = cluster.anonymous_client().await;
    assert_eq!(client.send(bearer(path, GOOD_TOKEN)).await.status, 200);
    cluster.fleet.clear_seen();

    let started = tokio::time::Instant::now();
    let sender = client.sender();
    let mut tasks = tokio::task::JoinSet::new();
    let per_task = 3000 / 50;
    for _ in 0..50 {
        let mut sender = sender.clone();
        tasks.spawn(async move {
            let mut answers = Vec::new();
            for _ in 0..per_task {
                sender.ready().await.unwrap();
                let response = sender
                    .send_request(bearer(path, &random(40)))
                    .await
                    .unwrap();
                let retry_after = response.headers().get("retry-after").cloned();
                let reason = response.headers().get("x-bulwark-reason").cloned();
                let status = response.status();
                // Read the body: a response dropped unread is a stream reset by the client,
                // and h2 closes a connection after enough of those.
                http_body_util::BodyExt::collect(response.into_body())
                    .await
                    .unwrap();
                answers.push((status, retry_after, reason));
            }
            answers
        });
    }
    let mut answers = Vec::new();
    while let Some(done) = tasks.join_next().await {
        answers.extend(done.unwrap());
    }
    let elapsed = started.elapsed();
    let reviews = token_reviews(&cluster);
    let limited = answers.iter().filter(|(s, ..)| *s == 429).count();
    println!(
        "3000 random tokens in {elapsed:?}: {reviews} TokenReviews upstream, {limited} answered 429"
    );
    for (status, retry_after, reason) in &answers {
        match status.as_u16() {
            401 => {}
            429 => {
                assert!(retry_after.is_some(), "a 429 without Retry-After");
                assert_eq!(reason.as_ref().unwrap(), "review_limited");
            }
            other => panic!("a random token got {other}"),
        }
    }
    // One source: its bucket (burst 100, 20 per second) bounds the reviews.
    let bound = 100 + (20.0 * elapsed.as_secs_f64()).ceil() as usize + 5;
    assert!(
        reviews <= bound,
        "{reviews} reviews in {elapsed:?}, bound {bound}"
    );

    // The good token is still known: no review, still tina.
    cluster.fleet.clear_seen();
    assert_eq!(client.send(bearer(path, GOOD_TOKEN)).await.status, 200);
    assert_eq!(
        token_reviews(&cluster),
        0,
        "the good token was reviewed again"
    );
}

/// Sends random tokens from `client` until `until`; returns each answer's status and
/// `X-Bulwark-Reason`.
async fn random_tokens_until(
    client: bulwark_testkit::Client,
    path: &'static str,
    until: tokio::time::Instant,
) -> Vec<(u16, String)> {
    let mut sender = client.sender();
    let mut answers = Vec::new();
    while tokio::time::Instant::now() < until {
        if sender.ready().await.is_err() {
            break;
        }
        let Ok(response) = sender.send_request(bearer(path, &random(40))).await else {
            break;
        };
        let status = response.status().as_u16();
        let reason = response
            .headers()
            .get("x-bulwark-reason")
            .map(|v| v.to_str().unwrap().to_string())
            .unwrap_or_default();
        let _ = http_body_util::BodyExt::collect(response.into_body()).await;
        answers.push((status, reason));
    }
    answers
}

/// The TokenReviews Bulwark counted as accepted (`bulwark_authz_reviews_total`).
fn accepted_reviews(cluster: &Cluster) -> f64 {
    cluster
        .metrics()
        .lines()
        .filter(|l| {
            l.starts_with("bulwark_authz_reviews_total{")
                && l.contains("kind=\"token\"")
                && l.contains("result=\"allowed\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_random_tokens_from_200_addresses_cannot_starve_a_known_token() {
    // A small global review budget that the flood empties at once, and a ttl short enough
    // for the known token to be due for its re-review several times during the flood.
    let cluster = Cluster::start(Setup {
        replicas: 1,
        settings: vec![
            ("identity.tokenReview.ttl", "1s"),
            ("identity.tokenReview.rate", "{qps: 50, burst: 50}"),
            // Each flooder keeps its connection (it would be closed after 16 refusals in a
            // row and have to reconnect): the review budget alone is under test here.
            ("listen.limits.maxUnauthenticatedRequests", "100000"),
        ],
        ..Setup::default()
    })
    .await;
    let path = "/api/v1/namespaces/default/configmaps";
    let at = |host: u8| std::net::IpAddr::from([127, 0, 0, host]);
    let mut known =
        bulwark_testkit::Client::connect_from(cluster.bulwark.addr, at(1), &cluster.pki, None)
            .await;
    assert_eq!(known.send(bearer(path, GOOD_TOKEN)).await.status, 200);

    let flooders = futures::future::join_all((2..=201).map(|host| {
        bulwark_testkit::Client::connect_from(cluster.bulwark.addr, at(host), &cluster.pki, None)
    }))
    .await;
    let until = tokio::time::Instant::now() + Duration::from_millis(3500);
    let mut flood = tokio::task::JoinSet::new();
    for client in flooders {
        flood.spawn(random_tokens_until(client, path, until));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = accepted_reviews(&cluster);
    let mut statuses = Vec::new();
    for _ in 0..20 {
        let answer = known.send(bearer(path, GOOD_TOKEN)).await;
        statuses.push(answer.status.as_u16());
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    let re_reviews = accepted_reviews(&cluster) - before;
    let mut flooded = Vec::new();
    while let Some(done) = flood.join_next().await {
        flooded.extend(done.unwrap());
    }
    let limited = flooded.iter().filter(|(s, _)| *s == 429).count();
    let known_limited = statuses.iter().filter(|s| **s == 429).count();
    println!(
        "{} random tokens from 200 addresses: {limited} answered 429; the known token: \
         {known_limited} of 20 answered 429, {re_reviews} re-reviews",
        flooded.len()
    );
    assert!(limited > 0, "the flood was never limited");
    for (status, reason) in &flooded {
        if *status == 429 {
            assert_eq!(reason, "review_limited");
        }
    }
    assert_eq!(statuses, [200; 20], "the known token was refused");
    assert!(
        re_reviews >= 1.0,
        "the known token was not re-reviewed during the flood"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_bearer_tokens_get_401_without_a_review() {
    let cluster = Cluster::start(Setup {
        replicas: 1,
        ..Setup::default()
    })
    .await;
    let mut client = cluster.anonymous_client().await;
    let path = "/api/v1/namespaces/default/configmaps";
    let long = "a".repeat(17 * 1024);
    for value in [
        "Bearer".to_string(),
        "Bearer a b".to_string(),
        format!("Bearer  {GOOD_TOKEN}"),
        format!("Bearer {long}"),
        "Bearer tök".to_string(),
    ] {
        let mut request = get(path);
        request.headers_mut().insert(
            http::header::AUTHORIZATION,
            http::HeaderValue::from_bytes(value.as_bytes()).unwrap(),
        );
        let answer = client.send(request).await;
        let shown = &value[..value.len().min(20)];
        assert_eq!(answer.status, 401, "{shown}");
        assert_eq!(answer.json()["reason"], "Unauthorized", "{shown}");
        assert_eq!(
            answer.headers["x-bulwark-reason"], "unauthenticated",
            "{shown}"
        );
    }
    assert_eq!(token_reviews(&cluster), 0, "a malformed token was reviewed");
}

/// A Lease of about 3 MiB: one annotation of padding.
fn big_lease(name: &str) -> Bytes {
    let padding = "x".repeat(3 * 1024 * 1024 - 512);
    Bytes::from(
        serde_json::to_vec(&serde_json::json!({
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": name, "annotations": {"padding": padding}},
            "spec": {"holderIdentity": name},
        }))
        .unwrap(),
    )
}

/// Sends `count` concurrent PUTs of `body` to `path`, spread over `users`, to `addr`;
/// returns every answer's status, `X-Bulwark-Reason` and `Status` body.
async fn put_storm(
    cluster: &Cluster,
    addr: std::net::SocketAddr,
    users: &[String],
    count: usize,
    path: &str,
    body: Bytes,
) -> Vec<(u16, String, serde_json::Value)> {
    let mut tasks = tokio::task::JoinSet::new();
    for user in users {
        let cert = cluster.pki.client_ca.client_cert(user, &[]);
        let client = bulwark_testkit::Client::connect(addr, &cluster.pki, Some(&cert)).await;
        for _ in 0..count / users.len() {
            let mut sender = client.sender();
            let request = Request::put(format!("https://127.0.0.1{path}"))
                .header("content-type", "application/json")
                .body(Full::new(body.clone()))
                .unwrap();
            tasks.spawn(async move {
                sender.ready().await.unwrap();
                let response = sender.send_request(request).await.unwrap();
                let status = response.status().as_u16();
                let reason = response
                    .headers()
                    .get("x-bulwark-reason")
                    .map(|v| v.to_str().unwrap().to_string())
                    .unwrap_or_default();
                let body = http_body_util::BodyExt::collect(response.into_body())
                    .await
                    .map(|b| b.to_bytes())
                    .unwrap_or_default();
                let status_json = serde_json::from_slice(&body).unwrap_or_default();
                (status, reason, status_json)
            });
        }
    }
    let mut answers = Vec::new();
    let all = async {
        while let Some(done) = tasks.join_next().await {
            answers.push(done.unwrap());
        }
    };
    tokio::time::timeout(Duration::from_secs(90), all)
        .await
        .expect("every PUT is answered");
    answers
}

/// Rules with nothing exempt but the built-in ones.
const NO_EXTRA_EXEMPTIONS: &str = r#"
rules:
  - name: nobody
    precedence: 5000
    match:
      users: [nobody]
    level: catch-all
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_cannot_pass_big_lease_writes_as_heartbeats() {
    let cluster = Cluster::start(Setup {
        replicas: 1,
        rules: NO_EXTRA_EXEMPTIONS,
        ..Setup::default()
    })
    .await;
    let process = cluster
        .spawn_process(env!("CARGO_BIN_EXE_bulwark").as_ref())
        .await;
    cluster.fleet.replica(0).set_delay(Duration::from_secs(2));
    let answers = put_storm(
        &cluster,
        process.addr,
        &["mallory".to_string()],
        200,
        "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/node-1",
        big_lease("node-1"),
    )
    .await;
    let peak = process.peak_rss_bytes();
    let throttled = answers.iter().filter(|(s, ..)| *s == 429).count();
    println!(
        "200 concurrent 3 MiB Lease PUTs by a non-node user: bulwark peak RSS {} MiB, {throttled} answered 429",
        peak >> 20
    );
    assert!(throttled > 0, "a user's Lease writes were never throttled");
    assert!(peak < 160 << 20, "bulwark held {} MiB", peak >> 20);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buffered_request_bodies_stay_within_the_budget_even_when_exempt() {
    // Every test client is exempt: only the body budget (default 256 MiB) stands between
    // 200 slow 3 MiB PUTs and 600 MiB of buffers.
    let cluster = Cluster::start(Setup {
        replicas: 1,
        ..Setup::default()
    })
    .await;
    let process = cluster
        .spawn_process(env!("CARGO_BIN_EXE_bulwark").as_ref())
        .await;
    cluster.fleet.replica(0).set_delay(Duration::from_secs(3));
    let users: Vec<String> = (0..20).map(|i| format!("writer-{i}")).collect();
    let answers = put_storm(
        &cluster,
        process.addr,
        &users,
        200,
        "/api/v1/namespaces/default/configmaps/big",
        big_lease("big"),
    )
    .await;
    let peak = process.peak_rss_bytes();
    let refused: Vec<_> = answers.iter().filter(|(s, ..)| *s == 429).collect();
    println!(
        "200 concurrent 3 MiB exempt PUTs: bulwark peak RSS {} MiB, {} answered 429",
        peak >> 20,
        refused.len()
    );
    assert!(!refused.is_empty(), "nothing was refused");
    for (_, reason, status) in &refused {
        assert_eq!(reason, "body_budget");
        assert_eq!(status["kind"], "Status");
        assert_eq!(status["reason"], "TooManyRequests");
    }
    assert!(peak < 400 << 20, "bulwark held {} MiB", peak >> 20);
}

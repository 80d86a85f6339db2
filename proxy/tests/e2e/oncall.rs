//! What the on-call changes and reads on a running `bulwark` process: the log filter at run
//! time, and log lines with no colour codes when they go to a file or a pipe.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bulwark_testkit::{BAD_TOKEN, Cluster, Setup, admin_get};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

/// `PUT path` with `body` on the admin listener: the status and the body.
async fn admin_put(admin: std::net::SocketAddr, path: &str, body: &str) -> (u16, String) {
    let mut stream = tokio::net::TcpStream::connect(admin).await.unwrap();
    let request = format!(
        "PUT {path} HTTP/1.1\r\nHost: {admin}\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    (status, body.to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_log_filter_changes_at_run_time_and_piped_logs_have_no_colour_codes() {
    let cluster = Cluster::start(Setup {
        replicas: 1,
        ..Setup::default()
    })
    .await;
    let config = cluster.process_config();
    let path = cluster.dir().join("oncall.yaml");
    config.write(&path).unwrap();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_bulwark"))
        .args(["serve", "--config"])
        .arg(&path)
        .env_remove("RUST_LOG")
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let stderr = Arc::new(Mutex::new(String::new()));
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let sink = stderr.clone();
    tokio::spawn(async move {
        while let Ok(Some(line)) = lines.next_line().await {
            let mut all = sink.lock().unwrap();
            all.push_str(&line);
            all.push('\n');
        }
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while admin_get(config.admin, "/readyz").await.map(|(s, _)| s) != Some(200) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "bulwark never ready"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let refused = |stderr: &Arc<Mutex<String>>| {
        stderr
            .lock()
            .unwrap()
            .lines()
            .filter(|l| l.contains("DEBUG") && l.contains("refused"))
            .count()
    };
    let mut client = cluster.anonymous_client_at(config.listen).await;
    let bad = bulwark_testkit::with_token(bulwark_testkit::get("/api/v1/pods"), BAD_TOKEN);

    assert_eq!(
        admin_get(config.admin, "/debug/log-level").await,
        Some((200, "info\n".into()))
    );
    assert_eq!(client.send(bad.clone()).await.status, 401);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(refused(&stderr), 0, "debug lines at info");

    let (status, body) = admin_put(config.admin, "/debug/log-level", "debug").await;
    assert_eq!((status, body.as_str()), (200, "debug\n"));
    assert_eq!(client.send(bad.clone()).await.status, 401);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while refused(&stderr) == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no debug line after the filter changed:\n{}",
            stderr.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // A filter that does not parse is refused and the one in force stays.
    let (status, body) = admin_put(config.admin, "/debug/log-level", "bulwark=[").await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("not a log filter"), "{body}");
    assert_eq!(
        admin_get(config.admin, "/debug/log-level").await,
        Some((200, "debug\n".into()))
    );

    // A field value read as a regular expression is compiled to a DFA that grows
    // exponentially with the dots after the `a`: this one, under 100 bytes, took a minute
    // to compile in a debug build (the audit's, 4.4 s and 275 MB), with the admin listener
    // stalled meanwhile. Refused at once, saying why.
    let hostile = "info,bulwark[request{user=.*a................}]=trace";
    let started = std::time::Instant::now();
    let (status, body) = admin_put(config.admin, "/debug/log-level", hostile).await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("regular expressions"), "{body}");
    assert!(
        started.elapsed() < Duration::from_millis(500),
        "refused in {:?}",
        started.elapsed()
    );
    assert_eq!(
        admin_get(config.admin, "/debug/log-level").await,
        Some((200, "debug\n".into()))
    );

    let all = stderr.lock().unwrap().clone();
    assert!(all.contains("log filter changed"), "{all}");
    assert!(
        !all.contains('\u{1b}'),
        "colour codes in logs written to a pipe:\n{all}"
    );
}

/// Starts `cluster`'s Bulwark as its own process with its admin listener on HTTPS (the
/// serving certificate) and `/metrics` for authorized scrapers only; its admin address.
async fn with_protected_metrics(
    cluster: &Cluster,
) -> (tokio::process::Child, std::net::SocketAddr) {
    let (cert, key) = cluster.process_config().credentials.serving.clone();
    let config = cluster
        .process_config()
        .set(
            "admin.tls",
            &format!("{{cert: {}, key: {}}}", cert.display(), key.display()),
        )
        .set("admin.metricsAccess", "authorized");
    let path = cluster.dir().join("protected-metrics.yaml");
    config.write(&path).unwrap();
    let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_bulwark"))
        .args(["serve", "--config"])
        .arg(&path)
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while tokio::net::TcpStream::connect(config.admin).await.is_err() {
        assert!(tokio::time::Instant::now() < deadline, "no admin listener");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (child, config.admin)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_on_the_admin_listener_are_served_over_tls_to_authorized_scrapers_only() {
    let mut policy = bulwark_testkit::policy();
    let mut scrape = bulwark_testkit::grant(&["tina"], &[], &["get"], &[]);
    scrape.namespaces = Vec::new();
    scrape.non_resource_urls = vec!["/metrics".into()];
    policy.rules.push(scrape);
    let cluster = Cluster::start(Setup {
        replicas: 1,
        policy,
        ..Setup::default()
    })
    .await;
    let (_bulwark, admin) = with_protected_metrics(&cluster).await;

    // Plain HTTP is not spoken any more.
    assert!(
        admin_get(admin, "/metrics")
            .await
            .is_none_or(|(s, _)| s != 200),
        "plain HTTP still serves /metrics"
    );
    let mut scraper = cluster.anonymous_client_at(admin).await;
    let answer = scraper.get("/metrics").await;
    assert_eq!(answer.status, 401, "{}", answer.text());
    let answer = scraper.get_with_token("/metrics", BAD_TOKEN).await;
    assert_eq!(answer.status, 401, "{}", answer.text());
    let answer = scraper
        .get_with_token("/metrics", bulwark_testkit::GOOD_TOKEN)
        .await;
    assert_eq!(answer.status, 200, "{}", answer.text());
    assert!(
        answer.text().contains("# TYPE bulwark_"),
        "{}",
        answer.text()
    );
    // Probes stay open to the kubelet.
    assert_eq!(scraper.get("/healthz").await.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scraper_the_authorizer_does_not_allow_gets_403_for_metrics() {
    let cluster = Cluster::start(Setup {
        replicas: 1,
        ..Setup::default()
    })
    .await;
    let (_bulwark, admin) = with_protected_metrics(&cluster).await;
    let mut scraper = cluster.anonymous_client_at(admin).await;
    let answer = scraper
        .get_with_token("/metrics", bulwark_testkit::GOOD_TOKEN)
        .await;
    assert_eq!(answer.status, 403, "{}", answer.text());
    assert!(answer.text().contains("tina may not get /metrics"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_refused_scrapes_costs_one_access_review_and_is_bounded() {
    let cluster = Cluster::start(Setup {
        replicas: 1,
        ..Setup::default()
    })
    .await;
    let (_bulwark, admin) = with_protected_metrics(&cluster).await;
    let reviews = || {
        cluster
            .fleet
            .seen_requests()
            .iter()
            .filter(|s| s.path.contains("subjectaccessreviews"))
            .count()
    };
    let before = reviews();
    let mut scraper = cluster.anonymous_client_at(admin).await;
    let mut statuses = Vec::new();
    for _ in 0..60 {
        let answer = scraper
            .get_with_token("/metrics", bulwark_testkit::GOOD_TOKEN)
            .await;
        if answer.status == 429 {
            assert_eq!(answer.headers["retry-after"], "1");
        }
        statuses.push(answer.status.as_u16());
    }
    assert_eq!(
        reviews() - before,
        1,
        "one SubjectAccessReview for tina, remembered for the TTL"
    );
    assert!(statuses[..10].iter().all(|&s| s == 403), "{statuses:?}");
    assert!(
        statuses.iter().filter(|&&s| s == 429).count() >= 30,
        "past the bound the scraper is told to slow down: {statuses:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_token_reads_metrics_and_debug_pages_on_a_protected_admin_port() {
    let cluster = Cluster::start(Setup {
        replicas: 1,
        ..Setup::default()
    })
    .await;
    // As deployed: every address (so /debug/* needs the token), HTTPS, /metrics for
    // authorized callers only.
    let port = bulwark_testkit::free_port();
    let token = cluster.dir().join("admin-token");
    std::fs::write(&token, "s3cret-admin-token\n").unwrap();
    let (cert, key) = cluster.process_config().credentials.serving.clone();
    let config = cluster
        .process_config()
        .set("admin.address", &format!("0.0.0.0:{port}"))
        .set(
            "admin.tls",
            &format!("{{cert: {}, key: {}}}", cert.display(), key.display()),
        )
        .set("admin.metricsAccess", "authorized")
        .set("admin.tokenFile", &token.display().to_string());
    let path = cluster.dir().join("admin-token.yaml");
    config.write(&path).unwrap();
    let _bulwark = tokio::process::Command::new(env!("CARGO_BIN_EXE_bulwark"))
        .args(["serve", "--config"])
        .arg(&path)
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let admin = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while tokio::net::TcpStream::connect(admin).await.is_err() {
        assert!(tokio::time::Instant::now() < deadline, "no admin listener");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut oncall = cluster.anonymous_client_at(admin).await;
    let answer = oncall
        .get_with_token("/metrics", "s3cret-admin-token")
        .await;
    assert_eq!(answer.status, 200, "{}", answer.text());
    assert!(answer.text().contains("# TYPE bulwark_"));
    let answer = oncall
        .get_with_token("/debug/flows", "s3cret-admin-token")
        .await;
    assert_eq!(answer.status, 200, "{}", answer.text());
    // Any other token is still reviewed (and unknown here), and no token opens /debug/*.
    let answer = oncall
        .get_with_token("/metrics", "s3cret-admin-tokem")
        .await;
    assert_eq!(answer.status, 401, "{}", answer.text());
    assert_eq!(oncall.get("/debug/flows").await.status, 403);
}

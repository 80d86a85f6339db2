//! Admission over the real upstream pool: LIST bytes are reserved on the replica with the
//! most room, show in the pool's per-replica counters (which the replica pick weighs) and in
//! `bulwark_list_bytes_in_flight`, and a replica's budget holds.

use std::sync::Arc;
use std::time::Duration;

use bulwark::admit::{Admission, Answer};
use bulwark::classify::classify;
use bulwark::config;
use bulwark::identity::User;
use bulwark::metrics::Metrics;
use bulwark::rules::{LevelSpec, Matched, Mode, RuleHeaders};
use bulwark::upstream::{Upstream, UpstreamTls};

/// Two replicas (never connected to) with a heap headroom of 5,000 bytes: a LIST budget of
/// 1,000 bytes each.
fn upstream(dir: &std::path::Path, metrics: &Metrics) -> Upstream {
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let key = rcgen::KeyPair::generate().unwrap();
    let ca = params.self_signed(&key).unwrap();
    std::fs::write(dir.join("ca.pem"), ca.pem()).unwrap();
    let yaml = format!(
        "replicas: [\"a:1\", \"b:2\"]\nca: {}\nself: {{tokenFile: {}}}\nreplicaHeapHeadroom: 5000\n",
        dir.join("ca.pem").display(),
        dir.join("token").display()
    );
    let cfg: config::Upstream = serde_norway::from_str(&yaml).unwrap();
    let tls = UpstreamTls::from_config(&cfg).unwrap();
    Upstream::new(&cfg, tls, metrics.clone()).unwrap()
}

fn matched(level: &Arc<LevelSpec>, flow: &str) -> Matched {
    Matched {
        rule: Arc::from("operators"),
        level: level.clone(),
        flow: flow.into(),
        rate: None,
        watches: None,
        mode: Mode::Enforce,
        staleness: None,
        headers: RuleHeaders::default(),
    }
}

fn in_flight(upstream: &Upstream) -> Vec<u64> {
    upstream
        .snapshot()
        .iter()
        .map(|r| r.in_flight_bytes)
        .collect()
}

#[tokio::test(start_paused = true, flavor = "current_thread")]
async fn list_bytes_are_held_on_the_replica_with_room_and_its_budget_holds() {
    let dir = tempfile::tempdir().unwrap();
    let metrics = Metrics::new();
    let upstream = upstream(dir.path(), &metrics);
    assert_eq!(upstream.byte_budget(), 1_000);
    let level = Arc::new(LevelSpec {
        name: "lists".into(),
        exempt: false,
        seats: 10,
        queues: 8,
        hand_size: 2,
        queue_length: 10,
        max_wait: Duration::from_secs(15),
        max_seats_per_flow: 0,
    });
    let admission = Admission::new(
        std::slice::from_ref(&level),
        upstream.clone(),
        metrics.clone(),
    );
    let list = classify(
        &http::Method::GET,
        &"/api/v1/namespaces/ops/secrets".parse().unwrap(),
    )
    .unwrap();
    admission.observe_list(&list, 600, Some(6));
    let user = User::default();

    let first = admission
        .admit(
            &matched(&level, "operators/a"),
            &list,
            &user,
            Answer::Upstream,
        )
        .await
        .unwrap();
    let second = admission
        .admit(
            &matched(&level, "operators/b"),
            &list,
            &user,
            Answer::Upstream,
        )
        .await
        .unwrap();
    assert_eq!(first.expected_bytes(), 600);
    assert_ne!(
        first.replica(),
        second.replica(),
        "the second LIST goes where there is room"
    );
    assert_eq!(in_flight(&upstream), vec![600, 600]);
    let text = metrics.render();
    assert!(
        text.contains("bulwark_list_bytes_in_flight{replica=\"a:1\"} 600"),
        "{text}"
    );
    assert!(
        text.contains("bulwark_list_bytes_budget{replica=\"b:2\"} 1000"),
        "{text}"
    );

    // A third fits on neither replica: it waits, holding no bytes.
    let third_flow = matched(&level, "operators/c");
    let third = admission.admit(&third_flow, &list, &user, Answer::Upstream);
    tokio::pin!(third);
    assert!(
        tokio::time::timeout(Duration::from_secs(1), &mut third)
            .await
            .is_err()
    );
    assert_eq!(in_flight(&upstream), vec![600, 600]);
    let freed = first.replica().unwrap().to_owned();
    drop(first);
    let third = third.await.unwrap();
    assert_eq!(third.replica(), Some(freed.as_str()));
    drop((second, third));
    assert_eq!(in_flight(&upstream), vec![0, 0]);
    assert!(
        metrics
            .render()
            .contains("bulwark_list_bytes_in_flight{replica=\"b:2\"} 0")
    );
}

/// Many threads admitting, giving up half-way and finishing at random: when all is done,
/// nothing is left waiting, executing or counted against a replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_admissions_and_cancellations_leave_nothing_behind() {
    use bulwark::admit::{AdmissionConfig, LocalBudget};
    let level = Arc::new(LevelSpec {
        name: "busy".into(),
        exempt: false,
        seats: 4,
        queues: 16,
        hand_size: 3,
        queue_length: 20,
        max_wait: Duration::from_millis(50),
        max_seats_per_flow: 0,
    });
    let budget = Arc::new(LocalBudget::new(2, 10_000));
    let config = AdmissionConfig {
        seat_unit_bytes: Some(1_000),
        ..AdmissionConfig::default()
    };
    let admission = Admission::with_budget(
        std::slice::from_ref(&level),
        budget.clone(),
        config,
        Metrics::new(),
    );
    let list = classify(
        &http::Method::GET,
        &"/api/v1/namespaces/a/secrets".parse().unwrap(),
    )
    .unwrap();
    let get = classify(
        &http::Method::GET,
        &"/api/v1/namespaces/a/secrets/s".parse().unwrap(),
    )
    .unwrap();
    admission.observe_list(&list, 3_000, Some(3));
    let mut tasks = Vec::new();
    for i in 0..64u64 {
        let (admission, level, list, get) =
            (admission.clone(), level.clone(), list.clone(), get.clone());
        tasks.push(tokio::spawn(async move {
            for j in 0..50u64 {
                let m = matched(&level, &format!("operators/{}", (i * 7 + j) % 23));
                let info = if (i + j) % 3 == 0 { &list } else { &get };
                let user = User::default();
                let attempt = admission.admit(&m, info, &user, Answer::Upstream);
                if (i + j) % 5 == 0 {
                    // The client gives up before it is admitted, or just after.
                    let _ = tokio::time::timeout(Duration::from_micros(200), attempt).await;
                } else if let Ok(permit) = attempt.await {
                    tokio::task::yield_now().await;
                    drop(permit);
                }
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    let levels = admission.levels_json();
    let busy = &levels["levels"][0];
    assert_eq!(busy["waiting"], 0, "{levels}");
    assert_eq!(busy["executingSeats"], 0, "{levels}");
    assert_eq!(busy["executingRequests"], 0, "{levels}");
    assert_eq!(budget.in_flight(), vec![0, 0]);
}

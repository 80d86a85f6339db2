//! One admission decision with 10,000 active flows: the per-flow bucket, the cost
//! estimate, the fair queue and the release, measured one by one and printed as p50/p99
//! (target: p99 at most 20 µs).

use std::sync::Arc;
use std::time::{Duration, Instant};

use bulwark::admit::{Admission, AdmissionConfig, Answer, LocalBudget};
use bulwark::classify::classify;
use bulwark::identity::User;
use bulwark::metrics::Metrics;
use bulwark::rules::{LevelSpec, Matched, Mode, Rate, RuleHeaders};
use criterion::{Criterion, criterion_group, criterion_main};
use hdrhistogram::Histogram;

const FLOWS: usize = 10_000;

fn bench(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a runtime");
    let level = Arc::new(LevelSpec {
        name: "workload".into(),
        exempt: false,
        seats: 20_000,
        queues: 128,
        hand_size: 8,
        queue_length: 50,
        max_wait: Duration::from_secs(15),
        max_seats_per_flow: 0,
    });
    let budget = Arc::new(LocalBudget::new(3, 1 << 30));
    let admission = Admission::with_budget(
        std::slice::from_ref(&level),
        budget,
        AdmissionConfig::default(),
        Metrics::new(),
    );
    let flows: Vec<Matched> = (0..FLOWS)
        .map(|i| Matched {
            rule: Arc::from("agents"),
            level: level.clone(),
            flow: format!("agents/system:node:node-{i}").into(),
            rate: Some(Rate {
                qps: 1e9,
                burst: 1_000_000,
            }),
            watches: Some(10),
            mode: Mode::Enforce,
            staleness: None,
            headers: RuleHeaders::default(),
        })
        .collect();
    let get = classify(
        &http::Method::GET,
        &"/api/v1/namespaces/kube-system/configmaps/c"
            .parse()
            .expect("a URI"),
    )
    .expect("classified");
    let list = classify(
        &http::Method::GET,
        &"/api/v1/namespaces/kube-system/pods"
            .parse()
            .expect("a URI"),
    )
    .expect("classified");
    admission.observe_list(&list, 2_000_000, Some(200));
    let user = User::default();
    // Every flow active: its state is in the table, and half of them hold a seat.
    let held = runtime.block_on(async {
        let mut held = Vec::new();
        for (i, m) in flows.iter().enumerate() {
            let permit = admission
                .admit(m, &get, &user, Answer::Upstream)
                .await
                .expect("admitted");
            if i.is_multiple_of(2) {
                held.push(permit);
            }
        }
        held
    });
    assert_eq!(admission.flows(), FLOWS);

    let mut histogram = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).expect("bounds");
    let mut next = 0usize;
    c.bench_function("admission decision, 10k active flows", |b| {
        b.iter_custom(|iters| {
            runtime.block_on(async {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let m = &flows[next % FLOWS];
                    // One LIST in ten: the cost model and the byte budget too.
                    let info = if next.is_multiple_of(10) { &list } else { &get };
                    next += 1;
                    let started = Instant::now();
                    let permit = admission.admit(m, info, &user, Answer::Upstream).await;
                    drop(permit);
                    let took = started.elapsed();
                    total += took;
                    histogram.saturating_record(took.as_nanos() as u64);
                }
                total
            })
        })
    });
    drop(held);
    println!(
        "admission decision with {FLOWS} active flows: p50 {:.2} µs, p99 {:.2} µs, p99.9 {:.2} µs, max {:.2} µs over {} decisions",
        histogram.value_at_quantile(0.50) as f64 / 1000.0,
        histogram.value_at_quantile(0.99) as f64 / 1000.0,
        histogram.value_at_quantile(0.999) as f64 / 1000.0,
        histogram.max() as f64 / 1000.0,
        histogram.len(),
    );
}

criterion_group!(benches, bench);
criterion_main!(benches);

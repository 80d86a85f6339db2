//! The per-request work of each stage on the pass-through path, one by one, so that a
//! regression in any of them shows as a number (README "Benchmarks"):
//!
//! - `classify`: a GET of one object, parsed into its request info;
//! - `rule_match`: that request matched against the example rule folder;
//! - `identity_certificate`: a client certificate read into a user;
//! - `header_rewrite`: the front-proxy headers written for that user, a client's own
//!   identity headers stripped;
//! - `admission_exempt`: admission of the request under an exempt level (the pass-through
//!   benchmark's rule).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bulwark::admit::{Admission, AdmissionConfig, Answer, LocalBudget};
use bulwark::classify::classify;
use bulwark::config::IdentityMode;
use bulwark::identity::forward::Forwarding;
use bulwark::identity::{Credential, Identity, user_from_certificate};
use bulwark::metrics::Metrics;
use bulwark::rules::{LevelSpec, RuleSet};
use criterion::{Criterion, criterion_group, criterion_main};
use http::{HeaderMap, HeaderValue, Method, Uri};

const PATH: &str = "/api/v1/namespaces/ns-0/configmaps/configmap-0";

fn bench(c: &mut Criterion) {
    let uri: Uri = PATH.parse().expect("a URI");
    c.bench_function("classify", |b| {
        b.iter(|| classify(&Method::GET, std::hint::black_box(&uri)).expect("classified"))
    });

    let info = classify(&Method::GET, &uri).expect("classified");
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../rules/examples");
    let rules = RuleSet::load_dir(&examples).expect("the example rules load");
    let ca = bulwark_sim::pki::Ca::new("bench-ca");
    let cert = ca.client_cert("system:node:node-1", &["system:nodes"]);
    let der = rustls_pemfile::certs(&mut cert.cert_pem.as_bytes())
        .next()
        .expect("one certificate")
        .expect("PEM");
    c.bench_function("identity_certificate", |b| {
        b.iter(|| user_from_certificate(std::hint::black_box(&der)).expect("a user"))
    });

    let user = user_from_certificate(&der).expect("a user");
    c.bench_function("rule_match", |b| {
        b.iter(|| rules.matches(std::hint::black_box(&user), &info))
    });

    let forwarding = Forwarding::new(IdentityMode::FrontProxy, None);
    let identity = Identity::User {
        user: Arc::new(user.clone()),
        credential: Credential::Certificate,
    };
    let mut request_headers = HeaderMap::new();
    request_headers.insert("accept", HeaderValue::from_static("application/json"));
    request_headers.insert("user-agent", HeaderValue::from_static("kubelet/v1.36.5"));
    request_headers.insert("x-remote-user", HeaderValue::from_static("system:admin"));
    c.bench_function("header_rewrite", |b| {
        b.iter_batched(
            || request_headers.clone(),
            |mut headers| {
                forwarding
                    .prepare(&identity, &mut headers, false)
                    .expect("forwarded");
                headers
            },
            criterion::BatchSize::SmallInput,
        )
    });

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a runtime");
    let exempt = Arc::new(LevelSpec {
        name: "exempt".into(),
        exempt: true,
        seats: 1,
        queues: 1,
        hand_size: 1,
        queue_length: 1,
        max_wait: Duration::from_secs(1),
        max_seats_per_flow: 0,
    });
    let admission = Admission::with_budget(
        std::slice::from_ref(&exempt),
        Arc::new(LocalBudget::new(3, 1 << 30)),
        AdmissionConfig::default(),
        Metrics::new(),
    );
    let matched = bulwark::rules::Matched {
        level: exempt,
        ..rules.matches(&user, &info)
    };
    c.bench_function("admission_exempt", |b| {
        b.iter(|| {
            runtime.block_on(async {
                admission
                    .admit(&matched, &info, &user, Answer::Upstream)
                    .await
                    .expect("admitted")
            })
        })
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);

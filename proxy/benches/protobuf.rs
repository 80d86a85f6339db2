//! What a protobuf reader costs the cache (README "Benchmarks"): the cache keeps JSON, and
//! converts what a protobuf reader gets.
//!
//! - `protobuf_secret`: a 2 KiB Secret with managedFields, from its cached JSON to the
//!   enveloped protobuf object (a GET, or one item of a LIST);
//! - `protobuf_watch_event`: the same Secret as a protobuf watch frame (encoded once per
//!   event, whatever the number of watchers);
//! - `json_watch_event`: the JSON line of that event, for comparison.

use bulwark::cache::Encoding;
use bulwark::cache::protobuf::{ProtoKind, envelope};
use bulwark::fuzzing::{Kind, encode_event};
use criterion::{Criterion, criterion_group, criterion_main};

fn secret() -> Vec<u8> {
    let data = "x".repeat(1500);
    let encoded = base64::Engine::encode(&base64::engine::general_purpose::STANDARD, &data);
    format!(
        r#"{{"metadata":{{"name":"node-1-kubelet-config","namespace":"ns-0","uid":"6a3c1f2e-8a0b-4a55-9c1e-0f3e2d1c0b9a","resourceVersion":"4711","creationTimestamp":"2026-11-24T10:00:00Z","labels":{{"app":"kubelet","node":"node-1"}},"managedFields":[{{"manager":"kubectl","operation":"Apply","apiVersion":"v1","time":"2026-11-24T10:00:00Z","fieldsType":"FieldsV1","fieldsV1":{{"f:data":{{".":{{}},"f:config":{{}}}},"f:metadata":{{"f:labels":{{".":{{}},"f:app":{{}},"f:node":{{}}}}}},"f:type":{{}}}}}}]}},"data":{{"config":"{encoded}"}},"type":"Opaque"}}"#
    )
    .into_bytes()
}

fn bench(c: &mut Criterion) {
    let json = secret();
    c.bench_function("protobuf_secret", |b| {
        b.iter(|| {
            let message = ProtoKind::Secret
                .message(std::hint::black_box(&json))
                .expect("a Secret");
            envelope("v1", "Secret", message)
        })
    });
    let kind = Kind::new("", "v1", "secrets", "Secret", true);
    c.bench_function("protobuf_watch_event", |b| {
        b.iter(|| {
            encode_event(
                &kind,
                "MODIFIED",
                Encoding::Protobuf,
                std::hint::black_box(&json),
            )
        })
    });
    c.bench_function("json_watch_event", |b| {
        b.iter(|| {
            encode_event(
                &kind,
                "MODIFIED",
                Encoding::Json,
                std::hint::black_box(&json),
            )
        })
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);

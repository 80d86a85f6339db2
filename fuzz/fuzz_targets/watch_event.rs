//! The cache's object and watch-event encoding: arbitrary bytes as an object the apiserver
//! sent (a LIST item or a watch event's object), parsed into the store, written out as
//! watch event lines, and rewritten to another version as a selector watch's DELETED.
//!
//! Beyond not panicking: every line is one JSON object ending in a newline, of the event's
//! type, whose object has the kind and apiVersion of the resource and the same metadata as
//! the object parsed; the rewritten object differs from it in `metadata.resourceVersion`
//! alone. The same object as a protobuf watch frame (what protobuf readers get) is one
//! length-prefixed frame, whatever the bytes: the event, or an ERROR event when they do not
//! read as the kind.

#![no_main]

use bulwark::fuzzing::{Encoding, EventType, Kind, Obj, at_version, encode_event, event_line};
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

fuzz_target!(|data: &[u8]| {
    let Ok(obj) = Obj::parse(data) else {
        return;
    };
    // The apiserver writes valid UTF-8 and escapes only (Go's encoder replaces the rest).
    // The store skips over fields it does not read without checking them, so bytes that
    // are not such JSON only pass through as they came.
    let Ok(original) = serde_json::from_slice::<Value>(data) else {
        return;
    };
    let metadata = &original["metadata"];
    assert_eq!(metadata["name"], obj.name.as_str());
    let rv = metadata["resourceVersion"].as_str().map(str::parse::<u64>);
    assert_eq!(rv, Some(Ok(obj.rv)));

    let kind = Kind::new("", "v1", "secrets", "Secret", true);
    let item = json(&obj.body, "the item form");
    assert_eq!(
        &item["metadata"], metadata,
        "the item form changed metadata"
    );
    let full = json(&kind.full_object(&obj).concat(), "the full object");
    assert_eq!(&full["metadata"], metadata);

    for kind in [
        Kind::new("", "v1", "secrets", "Secret", true),
        Kind::new(
            "discovery.k8s.io",
            "v1",
            "endpointslices",
            "EndpointSlice",
            true,
        ),
    ] {
        let frame = encode_event(&kind, "MODIFIED", Encoding::Protobuf, &obj.body);
        let len = u32::from_be_bytes(frame[..4].try_into().expect("a length")) as usize;
        assert_eq!(len, frame.len() - 4, "one whole frame");
    }

    for as_type in [EventType::Added, EventType::Modified, EventType::Deleted] {
        let line = event_line(&kind, as_type, &obj.body);
        let event = event(&line);
        assert_eq!(event["type"], as_type.as_str());
        assert_eq!(
            &event["object"]["metadata"], metadata,
            "the event changed metadata"
        );
        assert_eq!(event["object"]["apiVersion"], "v1");
    }

    // Rewritten to another version: only metadata.resourceVersion changes.
    let other = obj.rv.wrapping_add(1);
    let rewritten = json(&at_version(&obj, other), "the rewritten object");
    let mut expected = item.clone();
    expected["metadata"]["resourceVersion"] = Value::String(other.to_string());
    assert_eq!(
        rewritten, expected,
        "at_version changed more than the version"
    );
    let line = event_line(&kind, EventType::Deleted, &at_version(&obj, other));
    let event = event(&line);
    assert_eq!(event["object"]["metadata"], expected["metadata"]);
});

fn json(bytes: &[u8], what: &str) -> Value {
    serde_json::from_slice(bytes).unwrap_or_else(|e| {
        panic!(
            "{what} is not JSON ({e}): {}",
            String::from_utf8_lossy(bytes)
        )
    })
}

/// One watch event line: a JSON object and a final newline, and no other.
fn event(line: &[u8]) -> Value {
    let Some(body) = line.strip_suffix(b"\n") else {
        panic!("no final newline: {}", String::from_utf8_lossy(line));
    };
    let value = json(body, "the event line");
    assert!(value.is_object());
    value
}

//! `Accept` headers as clients send them, negotiated into the cache's answer encoding.
//!
//! Beyond not panicking: negotiation is deterministic; protobuf is chosen only for a kind
//! the cache encodes in protobuf; a header that asks for a transformation (`;as=`) always
//! goes upstream; and JSON chosen for a kind with protobuf is JSON for one without (the
//! kind's protobuf form only matters when protobuf wins).

#![no_main]

use bulwark::fuzzing::{Encoding, negotiate};
use http::{HeaderMap, HeaderValue};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(value) = HeaderValue::from_bytes(data) else {
        return;
    };
    let mut headers = HeaderMap::new();
    headers.insert(http::header::ACCEPT, value);
    let with = negotiate(&headers, true);
    let without = negotiate(&headers, false);
    assert_eq!(with, negotiate(&headers, true), "not deterministic");
    assert_ne!(
        without,
        Ok(Encoding::Protobuf),
        "protobuf for a kind without it"
    );
    if with == Ok(Encoding::Json) {
        assert_eq!(without, Ok(Encoding::Json));
    }
    let text = String::from_utf8_lossy(data).to_ascii_lowercase();
    // Ranges without a media type are skipped, as the apiserver skips them.
    let transforms = text
        .split(',')
        .filter(|range| {
            !range
                .split(';')
                .next()
                .unwrap_or_default()
                .trim()
                .is_empty()
        })
        .flat_map(|range| range.split(';').skip(1))
        .any(|param| param.trim().starts_with("as="));
    if transforms {
        assert!(
            with.is_err(),
            "an as= transformation answered from the cache"
        );
    }
});

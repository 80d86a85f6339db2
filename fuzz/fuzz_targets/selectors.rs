//! Label and field selectors, as `labelSelector` and `fieldSelector` values arrive.
//!
//! Beyond not panicking: parsing is deterministic; a selector that parsed to nothing had
//! no term (a label selector: was blank); a field selector only matches objects with the
//! name and namespace it pins; and the name classification hands to the authorizer for a
//! `fieldSelector=metadata.name=X` list (which the cache then answers) is the only name the
//! cache's filter lets through.

#![no_main]

use apimachinery::selector::{FieldSelector, LabelSelector};
use bulwark::classify::classify;
use libfuzzer_sys::fuzz_target;
use std::collections::BTreeMap;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    labels(text);
    fields(text);
});

fn labels(text: &str) {
    let parsed = LabelSelector::parse(text);
    assert_eq!(
        parsed.as_ref().ok(),
        LabelSelector::parse(text).as_ref().ok(),
        "not deterministic"
    );
    let Ok(selector) = parsed else {
        return;
    };
    if selector.is_empty() {
        assert!(text.trim().is_empty(), "{text:?} parsed to no requirement");
    }
    // Labels made of the selector's own words, so that some requirements can match.
    let words: Vec<&str> = text
        .split(|c: char| !(c.is_ascii_alphanumeric() || "-_./".contains(c)))
        .filter(|w| !w.is_empty())
        .collect();
    let mut labels = BTreeMap::new();
    let _ = selector.matches(&labels);
    for pair in words.chunks(2) {
        labels.insert(pair[0].to_owned(), pair.get(1).unwrap_or(&"").to_string());
    }
    let _ = selector.matches(&labels);
}

fn fields(text: &str) {
    let parsed = FieldSelector::parse(text);
    assert_eq!(
        parsed.as_ref().ok(),
        FieldSelector::parse(text).as_ref().ok(),
        "not deterministic"
    );
    let Ok(selector) = parsed else {
        return;
    };
    if selector.is_empty() {
        // Empty terms are skipped, as the apiserver skips them.
        assert!(
            text.split(',').all(str::is_empty),
            "{text:?} parsed to no requirement"
        );
    }
    let pinned_name = selector.pinned_name().unwrap_or("a");
    let pinned_ns = selector.pinned_namespace().unwrap_or("ns");
    for (ns, name) in [
        (pinned_ns, pinned_name),
        (pinned_ns, pinned_name.trim()),
        (pinned_ns.trim(), pinned_name),
        ("", "a"),
    ] {
        if selector.matches(ns, name) {
            assert!(selector.pinned_name().is_none_or(|n| n == name), "{text:?}");
            assert!(
                selector.pinned_namespace().is_none_or(|n| n == ns),
                "{text:?}"
            );
        }
    }

    // The same selector on a list: the name the authorizer is asked about.
    let uri = format!(
        "/api/v1/namespaces/ns/secrets?fieldSelector={}",
        encode(text)
    );
    let uri: http::Uri = uri.parse().expect("a percent-encoded query is a valid URI");
    let info = classify(&http::Method::GET, &uri).expect("a list with a fieldSelector");
    if let Some(authorized) = info.field_selector_name() {
        for name in [
            Some(authorized.trim()),
            selector.pinned_name(),
            selector.pinned_name().map(str::trim),
        ]
        .into_iter()
        .flatten()
        {
            assert!(
                name == authorized || !selector.matches("ns", name),
                "{text:?}: authorized for {authorized:?} but the cache would return {name:?}"
            );
        }
    }
}

/// Every byte but the unreserved ones as `%XX`.
fn encode(text: &str) -> String {
    text.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

//! Request classification and query parsing: `METHOD TARGET` as a client sends it.
//!
//! Beyond not panicking: classifying is deterministic; the path and raw query are kept as
//! received (they are what gets forwarded); every name taken from the path is one decoded
//! segment, never empty, `.`, `..` or containing `/`; the verb agrees with the method and
//! with whether a name was given; and a name taken from `fieldSelector` for authorization
//! is a valid path segment name.

#![no_main]

use bulwark::classify::{RequestInfo, Verb, classify};
use http::{Method, Uri};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some(space) = data.iter().position(|b| *b == b' ') else {
        return;
    };
    let (Ok(method), Ok(uri)) = (
        Method::from_bytes(&data[..space]),
        Uri::try_from(&data[space + 1..]),
    ) else {
        return;
    };
    let result = classify(&method, &uri);
    assert_eq!(result, classify(&method, &uri), "not deterministic");
    if let Ok(info) = result {
        check(&method, &uri, &info);
    }
});

fn check(method: &Method, uri: &Uri, info: &RequestInfo) {
    assert_eq!(info.path, uri.path(), "the forwarded path changed");
    assert_eq!(
        info.query.raw,
        uri.query().unwrap_or(""),
        "the raw query changed"
    );
    assert!(info.query.limit != Some(0), "limit=0 means no limit");
    let _ = (info.is_long_running(), info.is_read(), info.is_upgrade());
    let verb = info.verb.to_string();
    assert!(!verb.is_empty() && !verb.bytes().any(|b| b.is_ascii_uppercase()));

    if !info.resource_request {
        assert_eq!(info.verb, Verb::NonResource(method.clone()));
        assert!(info.namespace.is_none() && info.name.is_none() && info.subresource.is_none());
        assert!(info.resource.is_empty() && info.api_version.is_empty());
        return;
    }
    for part in [Some(&info.api_version), Some(&info.resource)]
        .into_iter()
        .chain([&info.namespace, &info.name, &info.subresource].map(Option::as_ref))
        .flatten()
    {
        assert!(
            is_segment(part),
            "{part:?} is not one path segment: {info:?}"
        );
    }
    if !info.api_group.is_empty() {
        assert!(is_segment(&info.api_group), "group {:?}", info.api_group);
    }
    assert_eq!(info.query.watch, info.verb == Verb::Watch);
    let expected_method: &[Method] = match info.verb {
        Verb::Get | Verb::List | Verb::Watch => &[Method::GET, Method::HEAD],
        Verb::Create => &[Method::POST],
        Verb::Update => &[Method::PUT],
        Verb::Patch => &[Method::PATCH],
        Verb::Delete | Verb::DeleteCollection => &[Method::DELETE],
        Verb::NonResource(_) => panic!("a resource request with a non-resource verb: {info:?}"),
    };
    assert!(expected_method.contains(method), "{method} gave {info:?}");
    match info.verb {
        Verb::List | Verb::DeleteCollection => assert!(info.name.is_none(), "{info:?}"),
        Verb::Get | Verb::Delete => assert!(info.name.is_some(), "{info:?}"),
        _ => {}
    }
    if let Some(name) = info.field_selector_name() {
        assert!(
            is_segment(name) && !name.contains(['%', '=']),
            "fieldSelector name {name:?}"
        );
    }
}

/// What one decoded path segment can be: not empty, not `.` or `..`, no `/`.
fn is_segment(text: &str) -> bool {
    !text.is_empty() && text != "." && text != ".." && !text.contains('/')
}

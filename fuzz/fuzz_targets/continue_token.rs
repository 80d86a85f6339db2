//! Continue tokens (`apimachinery::continue_token`): `continue` values from clients, and
//! the tokens the cache writes into list pages.
//!
//! Beyond not panicking: whatever decodes has a version other than 0 and, re-encoded,
//! decodes the same; a token written after any object key, for a list of all namespaces or
//! of the object's own, is unpadded base64url (what the apiserver's decoder takes) and
//! decodes to that version and to the start the apiserver resumes at: the key, then NUL.

#![no_main]

use apimachinery::continue_token::{Resume, Scope, decode, encode, encode_after, object_key};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // As a client's `continue` value.
    if let Ok(token) = std::str::from_utf8(data)
        && let Ok(resume) = decode(token)
    {
        assert_ne!(resume.rv, 0);
        // An empty start (the token said "/") is read as the start of the list; no page
        // ends there, so none is written.
        if !resume.start.is_empty() {
            let again = encode(resume.rv, &resume.start);
            assert_eq!(decode(&again), Ok(resume), "{token:?}");
        }
    }

    // As an object's key: a version, then namespace and name split at the first NUL.
    let Some((head, rest)) = data.split_first_chunk::<8>() else {
        return;
    };
    let rv = i64::from_le_bytes(*head);
    let text = String::from_utf8_lossy(rest);
    let (namespace, name) = text.split_once('\0').unwrap_or(("", &text));
    // Keys objects can have: a namespace is a DNS label (never `.` or `..`), and neither
    // part holds a `/`. (A name's segment ends in NUL in the token, so `..` is fine there.)
    if rv == 0
        || name.is_empty()
        || matches!(namespace, "." | "..")
        || namespace.contains('/')
        || name.contains('/')
    {
        return;
    }
    let key = object_key(namespace, name);
    let scopes = [Scope::All, Scope::Namespace(namespace)];
    for scope in &scopes[..if namespace.is_empty() { 1 } else { 2 }] {
        assert!(scope.contains(&key));
        let token = encode_after(rv, &scope.relative(&key));
        assert!(
            token
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'),
            "{token:?} is not unpadded base64url"
        );
        let resume = decode(&token).unwrap_or_else(|e| panic!("{key:?} in {scope:?}: {e}"));
        assert_eq!(resume.rv, rv);
        assert_eq!(
            scope.resume_key(&resume.start),
            format!("{key}\0"),
            "{scope:?}"
        );
        let _ = Resume::at(&resume);
    }
});

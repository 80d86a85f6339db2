//! Continue tokens (`bulwark-apimachinery`'s `continue_token`, shared by Bulwark's cache and
//! the simulator): `continue` values from clients, and the tokens written into list pages.
//!
//! Beyond not panicking: whatever a token decodes to encodes to a token that decodes to the
//! same; a token written for any object key in either scope is unpadded URL-safe base64 and
//! resumes right after that key.

#![no_main]

use apimachinery::continue_token::{Scope, decode, encode, encode_after, object_key};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // As a client's `continue` value.
    if let Ok(token) = std::str::from_utf8(data)
        && let Ok(resume) = decode(token)
    {
        assert_ne!(resume.rv, 0);
        let again = encode(resume.rv, &resume.start);
        assert_eq!(decode(&again).ok(), Some(resume), "{token:?}");
    }

    // As a key: a version, then namespace and name split at the first NUL.
    let Some((head, rest)) = data.split_first_chunk::<8>() else {
        return;
    };
    let rv = i64::from_le_bytes(*head);
    let text = String::from_utf8_lossy(rest);
    let (namespace, name) = text.split_once('\0').unwrap_or(("", &text));
    // Object names are path segments: never empty, `.` or `..`, and without `/` or NUL.
    let segment = |s: &str| !s.is_empty() && s != "." && s != ".." && !s.contains(['/', '\0']);
    if rv <= 0 || !segment(name) || !(namespace.is_empty() || segment(namespace)) {
        return;
    }
    let key = object_key(namespace, name);
    let scopes = if namespace.is_empty() {
        vec![Scope::All]
    } else {
        vec![Scope::All, Scope::Namespace(namespace)]
    };
    for scope in scopes {
        let token = encode_after(rv, &scope.relative(&key));
        assert!(
            token
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_".contains(&b)),
            "{token:?} is not unpadded URL-safe base64"
        );
        let resume = decode(&token).unwrap_or_else(|e| panic!("{token:?}: {e}"));
        assert_eq!(resume.at(), Some(rv as u64));
        assert_eq!(scope.resume_key(&resume.start), format!("{key}\0"));
    }
});

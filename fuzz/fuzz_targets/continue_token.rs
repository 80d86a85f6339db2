//! The cache's continue tokens: `continue` values from clients, and the tokens the cache
//! writes into list pages.
//!
//! Beyond not panicking: a token the cache writes decodes to the version and key it was
//! made from (for every key an object can have: no `/` in the namespace or name, and a
//! version above 0), and is URL-safe base64; whatever a token decodes to encodes to a token
//! that decodes to the same.

#![no_main]

use bulwark::fuzzing::{decode_continue, encode_continue};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // As a client's `continue` value.
    if let Ok(token) = std::str::from_utf8(data)
        && let Some((rv, key)) = decode_continue(token)
    {
        assert!(rv > 0);
        let again = encode_continue(rv, &key);
        assert_eq!(decode_continue(&again), Some((rv, key)), "{token:?}");
    }

    // As a key: a version, then namespace and name split at the first NUL.
    let Some((head, rest)) = data.split_first_chunk::<8>() else {
        return;
    };
    let rv = u64::from_le_bytes(*head);
    let text = String::from_utf8_lossy(rest);
    let (namespace, name) = text.split_once('\0').unwrap_or(("", &text));
    if rv == 0 || namespace.contains('/') || name.contains('/') || name.ends_with('\0') {
        return;
    }
    let key = (namespace.to_owned(), name.to_owned());
    let token = encode_continue(rv, &key);
    assert!(
        token
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_=".contains(&b)),
        "{token:?} is not URL-safe base64"
    );
    assert_eq!(decode_continue(&token), Some((rv, key)));
});

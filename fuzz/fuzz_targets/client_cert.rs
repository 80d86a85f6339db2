//! Client certificate identity: arbitrary bytes as the DER of a verified client
//! certificate, turned into a user as the listener does after the TLS handshake.
//!
//! Beyond not panicking: a certificate either names a user or is refused; the user has a
//! non-empty name, is in `system:authenticated`, and is the same on every call.

#![no_main]

use bulwark::identity::{AUTHENTICATED, user_from_certificate};
use libfuzzer_sys::fuzz_target;
use rustls_pki_types::CertificateDer;

fuzz_target!(|data: &[u8]| {
    let der = CertificateDer::from(data);
    let result = user_from_certificate(&der);
    let again = user_from_certificate(&der);
    assert_eq!(
        result.as_ref().map_err(ToString::to_string),
        again.as_ref().map_err(ToString::to_string),
        "not deterministic"
    );
    let Ok(user) = result else {
        return;
    };
    assert!(!user.username.is_empty());
    assert!(user.groups.iter().any(|g| g == AUTHENTICATED), "{user:?}");
    assert!(user.uid.is_none() && user.extra.is_empty());
});

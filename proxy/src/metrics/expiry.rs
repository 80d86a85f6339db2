//! When the certificates Bulwark loads stop being valid, for
//! `bulwark_certificate_expiry_timestamp_seconds` and the alerts that warn before they do.

use rustls_pki_types::CertificateDer;

/// The earliest notAfter, in Unix seconds, of `certs`: a chain or a CA bundle stops working
/// whole when its first member expires. `None` when no certificate parses.
pub fn earliest_not_after(certs: &[CertificateDer<'_>]) -> Option<i64> {
    certs
        .iter()
        .filter_map(|der| x509_parser::parse_x509_certificate(der.as_ref()).ok())
        .map(|(_, cert)| cert.validity().not_after.timestamp())
        .min()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cert(year: i32) -> CertificateDer<'static> {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(vec!["ca".to_string()]).unwrap();
        params.not_after = rcgen::date_time_ymd(year, 1, 1);
        params.self_signed(&key).unwrap().der().clone()
    }

    #[test]
    fn a_bundle_expires_with_its_first_certificate() {
        // 2031-01-01 and 2030-01-01 at midnight UTC.
        let (later, sooner) = (cert(2031), cert(2030));
        assert_eq!(
            earliest_not_after(std::slice::from_ref(&later)),
            Some(1_924_992_000)
        );
        assert_eq!(earliest_not_after(&[later, sooner]), Some(1_893_456_000));
        assert_eq!(earliest_not_after(&[]), None);
        assert_eq!(
            earliest_not_after(&[CertificateDer::from(b"not DER".to_vec())]),
            None
        );
    }
}

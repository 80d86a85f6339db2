//! Client certificates as the apiserver reads them: the subject's CN is the user name and
//! each `O` attribute one group.
//!
//! rcgen keeps one value per attribute type in a distinguished name, so a certificate with
//! several groups is assembled here with yasna's DER writer (the one rcgen itself uses) and
//! signed with the CA's rcgen key: ECDSA P-256 with SHA-256, X.509 v3, `keyUsage`
//! digitalSignature, `extKeyUsage` clientAuth, and not a CA.

use rcgen::{PublicKeyData, SigningKey};
use time::OffsetDateTime;
use yasna::models::{GeneralizedTime, ObjectIdentifier, UTCTime};
use yasna::{DERWriter, Tag};

const CN: &[u64] = &[2, 5, 4, 3];
const O: &[u64] = &[2, 5, 4, 10];
const KEY_USAGE: &[u64] = &[2, 5, 29, 15];
const EXT_KEY_USAGE: &[u64] = &[2, 5, 29, 37];
const BASIC_CONSTRAINTS: &[u64] = &[2, 5, 29, 19];
const CLIENT_AUTH: &[u64] = &[1, 3, 6, 1, 5, 5, 7, 3, 2];
const ECDSA_SHA256: &[u64] = &[1, 2, 840, 10045, 4, 3, 2];

/// Why a client certificate could not be made.
#[derive(Debug, thiserror::Error)]
pub enum ClientCertError {
    /// The CA certificate does not parse.
    #[error("the CA certificate does not parse: {0}")]
    BadCa(String),
    /// A validity bound is not a representable time.
    #[error("validity bound {0} is not a representable time")]
    BadTime(i64),
    /// The CA's key could not sign.
    #[error("signing with the CA key: {0}")]
    Sign(#[from] rcgen::Error),
}

/// Who the certificate names and when it is valid.
#[derive(Debug, Clone, Copy)]
pub struct Subject<'a> {
    /// The CN: the Kubernetes user name.
    pub user: &'a str,
    /// One `O` each: the user's groups.
    pub groups: &'a [&'a str],
    /// Valid from, Unix seconds.
    pub not_before: i64,
    /// Valid until, Unix seconds.
    pub not_after: i64,
}

/// The DER certificate for `subject`'s `key`, issued by the CA whose certificate is
/// `ca_der` and whose key is `ca_key`.
pub fn issue(
    ca_der: &[u8],
    ca_key: &impl SigningKey,
    key: &impl PublicKeyData,
    subject: &Subject<'_>,
) -> Result<Vec<u8>, ClientCertError> {
    let (_, ca) = x509_parser::parse_x509_certificate(ca_der)
        .map_err(|e| ClientCertError::BadCa(e.to_string()))?;
    let issuer = ca.tbs_certificate.subject.as_raw();
    let not_before = datetime(subject.not_before)?;
    let not_after = datetime(subject.not_after)?;
    let serial: [u8; 16] = rand::random();
    let tbs = yasna::construct_der(|w| {
        w.write_sequence(|w| {
            // Version: v3.
            w.next().write_tagged(Tag::context(0), |w| w.write_u8(2));
            w.next().write_bigint_bytes(&serial, true);
            signature_algorithm(w.next());
            w.next().write_der(issuer);
            w.next().write_sequence(|w| {
                time(w.next(), not_before);
                time(w.next(), not_after);
            });
            w.next().write_sequence(|w| {
                attribute(w.next(), CN, subject.user);
                for group in subject.groups {
                    attribute(w.next(), O, group);
                }
            });
            w.next().write_der(&key.subject_public_key_info());
            w.next().write_tagged(Tag::context(3), |w| {
                w.write_sequence(|w| {
                    // digitalSignature: the first bit of a one-bit string.
                    let usage = yasna::construct_der(|w| w.write_bitvec_bytes(&[0x80], 1));
                    extension(w.next(), KEY_USAGE, true, &usage);
                    let eku = yasna::construct_der(|w| {
                        w.write_sequence(|w| w.next().write_oid(&oid(CLIENT_AUTH)))
                    });
                    extension(w.next(), EXT_KEY_USAGE, false, &eku);
                    let not_ca = yasna::construct_der(|w| w.write_sequence(|_| {}));
                    extension(w.next(), BASIC_CONSTRAINTS, true, &not_ca);
                });
            });
        })
    });
    let signature = ca_key.sign(&tbs)?;
    Ok(yasna::construct_der(|w| {
        w.write_sequence(|w| {
            w.next().write_der(&tbs);
            signature_algorithm(w.next());
            w.next().write_bitvec_bytes(&signature, signature.len() * 8);
        })
    }))
}

/// PEM armour (`-----BEGIN CERTIFICATE-----`, LF line ends) around a DER certificate.
pub fn pem(der: &[u8]) -> String {
    let config = pem::EncodeConfig::new().set_line_ending(pem::LineEnding::LF);
    pem::encode_config(&pem::Pem::new("CERTIFICATE", der), config)
}

fn oid(arcs: &[u64]) -> ObjectIdentifier {
    ObjectIdentifier::from_slice(arcs)
}

fn signature_algorithm(w: DERWriter<'_>) {
    w.write_sequence(|w| w.next().write_oid(&oid(ECDSA_SHA256)));
}

/// One relative distinguished name: SET { SEQUENCE { type, UTF8String } }.
fn attribute(w: DERWriter<'_>, ty: &[u64], value: &str) {
    w.write_set(|w| {
        w.next().write_sequence(|w| {
            w.next().write_oid(&oid(ty));
            w.next().write_utf8_string(value);
        })
    });
}

/// SEQUENCE { extnID, critical (only when true), OCTET STRING { value } }.
fn extension(w: DERWriter<'_>, id: &[u64], critical: bool, value: &[u8]) {
    w.write_sequence(|w| {
        w.next().write_oid(&oid(id));
        if critical {
            w.next().write_bool(true);
        }
        w.next().write_bytes(value);
    });
}

fn datetime(unix: i64) -> Result<OffsetDateTime, ClientCertError> {
    OffsetDateTime::from_unix_timestamp(unix).map_err(|_| ClientCertError::BadTime(unix))
}

/// UTCTime through 2049, GeneralizedTime from 2050 (RFC 5280 4.1.2.5).
fn time(w: DERWriter<'_>, at: OffsetDateTime) {
    match UTCTime::from_datetime_opt(at) {
        Some(utc) => w.write_utctime(&utc),
        None => w.write_generalized_time(&GeneralizedTime::from_datetime(at)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};

    fn ca() -> CertifiedIssuer<'static, KeyPair> {
        let mut params = CertificateParams::default();
        params
            .distinguished_name
            .push(DnType::CommonName, "test-ca");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        CertifiedIssuer::self_signed(params, key).unwrap()
    }

    #[test]
    fn the_certificate_names_the_user_and_every_group_and_verifies_against_the_ca() {
        let ca = ca();
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let der = issue(
            ca.der(),
            ca.key(),
            &key,
            &Subject {
                user: "alice",
                groups: &["devs", "system:masters"],
                not_before: 1_700_000_000,
                not_after: 2_600_000_000,
            },
        )
        .unwrap();
        let (_, cert) = x509_parser::parse_x509_certificate(&der).unwrap();
        let subject = cert.subject();
        let cn: Vec<&str> = subject
            .iter_common_name()
            .map(|a| a.as_str().unwrap())
            .collect();
        let o: Vec<&str> = subject
            .iter_organization()
            .map(|a| a.as_str().unwrap())
            .collect();
        assert_eq!(cn, ["alice"]);
        assert_eq!(o, ["devs", "system:masters"]);
        assert_eq!(
            cert.issuer(),
            x509_parser::parse_x509_certificate(ca.der())
                .unwrap()
                .1
                .subject()
        );
        assert_eq!(cert.validity().not_before.timestamp(), 1_700_000_000);
        // 2052: past UTCTime's range, written as GeneralizedTime.
        assert_eq!(cert.validity().not_after.timestamp(), 2_600_000_000);
        let (_, ca_cert) = x509_parser::parse_x509_certificate(ca.der()).unwrap();
        cert.verify_signature(Some(ca_cert.public_key()))
            .expect("signed by the CA");
        let eku = cert.extended_key_usage().unwrap().unwrap().value;
        assert!(eku.client_auth && !eku.server_auth);
        assert!(cert.key_usage().unwrap().unwrap().value.digital_signature());
        assert!(!cert.is_ca());
        assert_eq!(
            cert.public_key().raw,
            key.subject_public_key_info().as_slice()
        );
    }

    #[test]
    fn pem_is_one_certificate_block_with_lf_line_ends() {
        let pem = pem(&[0x30, 0x03, 0x02, 0x01, 0x05]);
        assert!(pem.starts_with("-----BEGIN CERTIFICATE-----\n"));
        assert!(pem.ends_with("-----END CERTIFICATE-----\n"));
        assert!(!pem.contains('\r'));
    }
}

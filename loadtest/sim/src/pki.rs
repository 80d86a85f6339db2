//! Test PKI minted with rcgen (ECDSA P-256): the apiserver's serving CA, client CA and
//! front-proxy (request-header) CA, and the certificates they issue.

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use apimachinery::client_cert;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, PKCS_ECDSA_P256_SHA256, PublicKeyData, SanType,
};
use rustls_pki_types::CertificateDer;

/// A PEM certificate and its PEM (PKCS#8) private key.
#[derive(Clone, Debug)]
pub struct CertKey {
    /// The certificate, PEM.
    pub cert_pem: String,
    /// The private key, PEM.
    pub key_pem: String,
}

impl CertKey {
    /// Writes `NAME.crt` and `NAME.key` into `dir` and returns their paths.
    pub fn write(&self, dir: &Path, name: &str) -> std::io::Result<(PathBuf, PathBuf)> {
        let crt = dir.join(format!("{name}.crt"));
        let key = dir.join(format!("{name}.key"));
        std::fs::write(&crt, &self.cert_pem)?;
        std::fs::write(&key, &self.key_pem)?;
        Ok((crt, key))
    }
}

/// A certificate authority that can issue server and client certificates.
pub struct Ca {
    issuer: Issuer<'static, KeyPair>,
    cert_der: CertificateDer<'static>,
    cert_pem: String,
    common_name: String,
}

/// Why a CA could not be loaded from PEM.
#[derive(Debug, thiserror::Error)]
pub enum LoadCaError {
    /// The certificate is not one PEM certificate.
    #[error("no PEM certificate")]
    NoCertificate,
    /// The key or the certificate does not parse, or they do not fit together.
    #[error("{0}")]
    Invalid(String),
}

impl std::fmt::Debug for Ca {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ca")
            .field("common_name", &self.common_name)
            .finish()
    }
}

/// Key generation and signing with ring on a well-formed template cannot fail; a failure
/// here is a broken build of rcgen, so test PKI creation treats it as fatal.
fn must<T>(r: Result<T, rcgen::Error>) -> T {
    match r {
        Ok(v) => v,
        Err(e) => panic!("minting test PKI failed: {e}"),
    }
}

fn new_key() -> KeyPair {
    must(KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256))
}

impl Ca {
    /// A new self-signed CA with this common name.
    pub fn new(common_name: &str) -> Ca {
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, common_name);
        params.distinguished_name = dn;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let key = new_key();
        let cert = must(params.self_signed(&key));
        let cert_der = cert.der().clone();
        let cert_pem = cert.pem();
        // An Issuer rather than a CertifiedIssuer, which cannot be made from a loaded
        // certificate: `from_pem` makes the same kind.
        let issuer = Issuer::new(params, key);
        Ca {
            issuer,
            cert_der,
            cert_pem,
            common_name: common_name.to_string(),
        }
    }

    /// A CA from its PEM certificate and PEM (PKCS#8) key, such as the development CA that
    /// `bulwark certs init` writes; it issues like a CA made by [`Ca::new`].
    pub fn from_pem(cert_pem: &str, key_pem: &str) -> Result<Ca, LoadCaError> {
        let invalid = |e: &dyn std::fmt::Display| LoadCaError::Invalid(e.to_string());
        let cert_der = rustls_pemfile::certs(&mut cert_pem.as_bytes())
            .next()
            .ok_or(LoadCaError::NoCertificate)?
            .map_err(|e| invalid(&e))?;
        let (_, parsed) =
            x509_parser::parse_x509_certificate(&cert_der).map_err(|e| invalid(&e))?;
        let common_name = parsed
            .subject()
            .iter_common_name()
            .next()
            .and_then(|cn| cn.as_str().ok())
            .unwrap_or_default()
            .to_string();
        let key = KeyPair::from_pem(key_pem).map_err(|e| invalid(&e))?;
        if parsed.public_key().raw != key.subject_public_key_info().as_slice() {
            return Err(LoadCaError::Invalid(
                "the key does not belong to the certificate".into(),
            ));
        }
        let issuer = Issuer::from_ca_cert_der(&cert_der, key).map_err(|e| invalid(&e))?;
        Ok(Ca {
            issuer,
            cert_der,
            cert_pem: cert_pem.to_string(),
            common_name,
        })
    }

    /// The CA certificate, PEM.
    pub fn cert_pem(&self) -> String {
        self.cert_pem.clone()
    }

    /// The CA certificate, DER.
    pub fn cert_der(&self) -> CertificateDer<'static> {
        self.cert_der.clone()
    }

    /// The CA's common name.
    pub fn common_name(&self) -> &str {
        &self.common_name
    }

    /// A serving certificate for these names; entries that parse as IP addresses become IP
    /// SANs, the rest DNS SANs. The first name is also the CN.
    pub fn server_cert(&self, names: &[&str]) -> CertKey {
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(
            DnType::CommonName,
            names.first().copied().unwrap_or("server"),
        );
        params.distinguished_name = dn;
        params.subject_alt_names = names
            .iter()
            .map(|n| match n.parse::<IpAddr>() {
                Ok(ip) => SanType::IpAddress(ip),
                Err(_) => SanType::DnsName(must((*n).try_into())),
            })
            .collect();
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        self.issue(params)
    }

    /// A client certificate as the apiserver reads it: CN = user, one O per group.
    pub fn client_cert(&self, user: &str, groups: &[&str]) -> CertKey {
        let now = unix_now();
        self.client_cert_valid(user, groups, now.saturating_sub(3600), now + 365 * 86_400)
    }

    /// A client certificate that expired in 2001 (otherwise like [`Ca::client_cert`]).
    pub fn expired_client_cert(&self, user: &str, groups: &[&str]) -> CertKey {
        self.client_cert_valid(user, groups, 946_684_800, 978_307_200)
    }

    /// Assembled by [`apimachinery::client_cert`]: rcgen keeps one value per attribute
    /// type, but the apiserver reads groups from repeated O attributes.
    fn client_cert_valid(
        &self,
        user: &str,
        groups: &[&str],
        not_before: u64,
        not_after: u64,
    ) -> CertKey {
        let key = new_key();
        let subject = client_cert::Subject {
            user,
            groups,
            not_before: i64::try_from(not_before).unwrap_or(i64::MAX),
            not_after: i64::try_from(not_after).unwrap_or(i64::MAX),
        };
        let der = match client_cert::issue(&self.cert_der, self.issuer.key(), &key, &subject) {
            Ok(der) => der,
            Err(e) => panic!("minting a test client certificate failed: {e}"),
        };
        CertKey {
            cert_pem: client_cert::pem(&der),
            key_pem: key.serialize_pem(),
        }
    }

    fn issue(&self, params: CertificateParams) -> CertKey {
        let key = new_key();
        let cert = must(params.signed_by(&key, &self.issuer));
        CertKey {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        }
    }
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The three CAs of a kube-apiserver: serving, client (`--client-ca-file`) and front-proxy
/// (`--requestheader-client-ca-file`).
#[derive(Debug)]
pub struct Pki {
    /// Issues the apiservers' serving certificates.
    pub server_ca: Ca,
    /// Issues user client certificates.
    pub client_ca: Ca,
    /// Issues front-proxy client certificates (X-Remote-* headers are trusted from these).
    pub front_proxy_ca: Ca,
}

impl Pki {
    /// Three fresh CAs.
    pub fn new() -> Pki {
        Pki {
            server_ca: Ca::new("bulwark-sim-server-ca"),
            client_ca: Ca::new("bulwark-sim-client-ca"),
            front_proxy_ca: Ca::new("bulwark-sim-front-proxy-ca"),
        }
    }
}

impl Default for Pki {
    fn default() -> Self {
        Pki::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_cert_carries_user_and_groups() {
        let ca = Ca::new("ca");
        let ck = ca.client_cert("alice", &["dev", "ops"]);
        let der = rustls_pemfile::certs(&mut ck.cert_pem.as_bytes())
            .next()
            .expect("one cert")
            .expect("pem");
        let (_, cert) = x509_parser::parse_x509_certificate(&der).expect("x509");
        let cn: Vec<_> = cert
            .subject()
            .iter_common_name()
            .map(|a| a.as_str().unwrap())
            .collect();
        let o: Vec<_> = cert
            .subject()
            .iter_organization()
            .map(|a| a.as_str().unwrap())
            .collect();
        assert_eq!(cn, ["alice"]);
        assert_eq!(o, ["dev", "ops"]);
    }

    #[test]
    fn a_ca_loaded_from_pem_issues_certificates_that_chain_to_it() {
        let key = new_key();
        let key_pem = key.serialize_pem();
        let mut params = CertificateParams::default();
        params.distinguished_name.push(DnType::CommonName, "loaded");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign];
        let cert = params.self_signed(&key).unwrap();
        let ca = Ca::from_pem(&cert.pem(), &key_pem).unwrap();
        assert_eq!(ca.common_name(), "loaded");
        assert_eq!(ca.cert_der(), *cert.der());
        let leaf = ca.server_cert(&["127.0.0.1"]);
        let der = rustls_pemfile::certs(&mut leaf.cert_pem.as_bytes())
            .next()
            .unwrap()
            .unwrap();
        let (_, leaf) = x509_parser::parse_x509_certificate(&der).unwrap();
        let (_, ca_cert) = x509_parser::parse_x509_certificate(cert.der()).unwrap();
        assert_eq!(leaf.issuer(), ca_cert.subject());

        let other = new_key().serialize_pem();
        assert!(Ca::from_pem(&cert.pem(), &other).is_err());
        assert!(matches!(
            Ca::from_pem("nothing", &key_pem),
            Err(LoadCaError::NoCertificate)
        ));
    }
}

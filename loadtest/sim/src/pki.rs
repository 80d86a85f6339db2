//! Test PKI minted with rcgen (ECDSA P-256): the apiserver's serving CA, client CA and
//! front-proxy (request-header) CA, and the certificates they issue.

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DistinguishedName, DnType,
    ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose, PKCS_ECDSA_P256_SHA256, SanType,
};

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
    issuer: CertifiedIssuer<'static, KeyPair>,
    common_name: String,
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
        let issuer = must(CertifiedIssuer::self_signed(params, new_key()));
        Ca {
            issuer,
            common_name: common_name.to_string(),
        }
    }

    /// The CA certificate, PEM.
    pub fn cert_pem(&self) -> String {
        self.issuer.pem()
    }

    /// The CA certificate, DER.
    pub fn cert_der(&self) -> rustls_pki_types::CertificateDer<'static> {
        self.issuer.der().clone()
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

    /// rcgen keeps one value per attribute type, but the apiserver reads groups from
    /// repeated O attributes, so client certificates are assembled here in DER and signed
    /// with the CA key.
    fn client_cert_valid(
        &self,
        user: &str,
        groups: &[&str],
        not_before: u64,
        not_after: u64,
    ) -> CertKey {
        use rcgen::{PublicKeyData, SigningKey};
        let key = new_key();
        let ca_der = self.issuer.der();
        let issuer_name = match x509_parser::parse_x509_certificate(ca_der) {
            Ok((_, c)) => c.tbs_certificate.subject.as_raw().to_vec(),
            Err(e) => panic!("own CA certificate does not parse: {e}"),
        };
        let mut subject = Vec::new();
        subject.extend(der::rdn(OID_CN, user));
        for g in groups {
            subject.extend(der::rdn(OID_O, g));
        }
        let serial: [u8; 16] = rand::random();
        let mut serial = serial.to_vec();
        serial[0] &= 0x7f;
        serial[0] |= 0x01;
        let key_usage = der::tlv(
            0x30,
            &[
                der::oid(OID_KEY_USAGE),
                der::tlv(0x01, &[0xff]),
                der::tlv(0x04, &der::tlv(0x03, &[0x07, 0x80])),
            ]
            .concat(),
        );
        let eku = der::tlv(
            0x30,
            &[
                der::oid(OID_EKU),
                der::tlv(0x04, &der::tlv(0x30, &der::oid(OID_CLIENT_AUTH))),
            ]
            .concat(),
        );
        let tbs = der::tlv(
            0x30,
            &[
                der::tlv(0xa0, &der::tlv(0x02, &[2])),
                der::tlv(0x02, &serial),
                der::tlv(0x30, &der::oid(OID_ECDSA_SHA256)),
                issuer_name,
                der::tlv(
                    0x30,
                    &[der::time(not_before), der::time(not_after)].concat(),
                ),
                der::tlv(0x30, &subject),
                key.subject_public_key_info(),
                der::tlv(0xa3, &der::tlv(0x30, &[key_usage, eku].concat())),
            ]
            .concat(),
        );
        let sig = must(self.issuer.key().sign(&tbs));
        let mut bits = vec![0u8];
        bits.extend(sig);
        let cert = der::tlv(
            0x30,
            &[
                tbs,
                der::tlv(0x30, &der::oid(OID_ECDSA_SHA256)),
                der::tlv(0x03, &bits),
            ]
            .concat(),
        );
        CertKey {
            cert_pem: pem_encode("CERTIFICATE", &cert),
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

const OID_CN: &[u64] = &[2, 5, 4, 3];
const OID_O: &[u64] = &[2, 5, 4, 10];
const OID_KEY_USAGE: &[u64] = &[2, 5, 29, 15];
const OID_EKU: &[u64] = &[2, 5, 29, 37];
const OID_CLIENT_AUTH: &[u64] = &[1, 3, 6, 1, 5, 5, 7, 3, 2];
const OID_ECDSA_SHA256: &[u64] = &[1, 2, 840, 10045, 4, 3, 2];

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn pem_encode(label: &str, der: &[u8]) -> String {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::STANDARD.encode(der);
    let mut out = format!("-----BEGIN {label}-----\n");
    for line in b64.as_bytes().chunks(64) {
        out.push_str(std::str::from_utf8(line).unwrap_or_default());
        out.push('\n');
    }
    out.push_str(&format!("-----END {label}-----\n"));
    out
}

/// The few DER encodings a client certificate needs.
mod der {
    /// Tag-length-value.
    pub fn tlv(tag: u8, content: &[u8]) -> Vec<u8> {
        let mut out = vec![tag];
        let n = content.len();
        if n < 0x80 {
            out.push(n as u8);
        } else {
            let bytes: Vec<u8> = n
                .to_be_bytes()
                .iter()
                .copied()
                .skip_while(|b| *b == 0)
                .collect();
            out.push(0x80 | bytes.len() as u8);
            out.extend(bytes);
        }
        out.extend_from_slice(content);
        out
    }

    /// An OBJECT IDENTIFIER.
    pub fn oid(arcs: &[u64]) -> Vec<u8> {
        let mut body = vec![(arcs[0] * 40 + arcs[1]) as u8];
        for &a in &arcs[2..] {
            let mut chunk = vec![(a & 0x7f) as u8];
            let mut v = a >> 7;
            while v > 0 {
                chunk.push(0x80 | (v & 0x7f) as u8);
                v >>= 7;
            }
            chunk.reverse();
            body.extend(chunk);
        }
        tlv(0x06, &body)
    }

    /// One RDN: SET { SEQUENCE { type, UTF8String } }.
    pub fn rdn(ty: &[u64], value: &str) -> Vec<u8> {
        tlv(
            0x31,
            &tlv(0x30, &[oid(ty), tlv(0x0c, value.as_bytes())].concat()),
        )
    }

    /// UTCTime (GeneralizedTime from 2050) from Unix seconds.
    pub fn time(secs: u64) -> Vec<u8> {
        let days = (secs / 86_400) as i64;
        let rem = secs % 86_400;
        let z = days + 719_468;
        let era = z.div_euclid(146_097);
        let doe = z - era * 146_097;
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let d = doy - (153 * mp + 2) / 5 + 1;
        let m = if mp < 10 { mp + 3 } else { mp - 9 };
        let y = yoe + era * 400 + i64::from(m <= 2);
        let hms = format!("{:02}{:02}{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60);
        if (1950..2050).contains(&y) {
            tlv(0x17, format!("{:02}{m:02}{d:02}{hms}", y % 100).as_bytes())
        } else {
            tlv(0x18, format!("{y:04}{m:02}{d:02}{hms}").as_bytes())
        }
    }
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
}

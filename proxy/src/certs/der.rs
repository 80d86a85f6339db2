//! The few DER encodings a client certificate with several `O` values needs.
//!
//! rcgen keeps one value per attribute type in a distinguished name, but the apiserver
//! reads a user's groups from repeated `O` attributes, so client certificates are assembled
//! here and signed with the CA's key.

/// Object identifiers used in client certificates.
pub mod oid {
    /// commonName.
    pub const CN: &[u64] = &[2, 5, 4, 3];
    /// organizationName.
    pub const O: &[u64] = &[2, 5, 4, 10];
    /// keyUsage.
    pub const KEY_USAGE: &[u64] = &[2, 5, 29, 15];
    /// extKeyUsage.
    pub const EXT_KEY_USAGE: &[u64] = &[2, 5, 29, 37];
    /// basicConstraints.
    pub const BASIC_CONSTRAINTS: &[u64] = &[2, 5, 29, 19];
    /// id-kp-clientAuth.
    pub const CLIENT_AUTH: &[u64] = &[1, 3, 6, 1, 5, 5, 7, 3, 2];
    /// ecdsa-with-SHA256.
    pub const ECDSA_SHA256: &[u64] = &[1, 2, 840, 10045, 4, 3, 2];
}

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

/// A SEQUENCE of the given encodings.
pub fn seq(parts: &[Vec<u8>]) -> Vec<u8> {
    tlv(0x30, &parts.concat())
}

/// An OBJECT IDENTIFIER (every arc after the first two in base-128).
pub fn oid(arcs: &[u64]) -> Vec<u8> {
    let mut body = vec![(arcs[0] * 40 + arcs[1]) as u8];
    for &arc in &arcs[2..] {
        let mut chunk = vec![(arc & 0x7f) as u8];
        let mut rest = arc >> 7;
        while rest > 0 {
            chunk.push(0x80 | (rest & 0x7f) as u8);
            rest >>= 7;
        }
        chunk.reverse();
        body.extend(chunk);
    }
    tlv(0x06, &body)
}

/// One relative distinguished name: SET { SEQUENCE { type, UTF8String } }.
pub fn rdn(ty: &[u64], value: &str) -> Vec<u8> {
    tlv(0x31, &seq(&[oid(ty), tlv(0x0c, value.as_bytes())]))
}

/// A positive INTEGER from big-endian bytes (a leading zero is added when the top bit is
/// set, so the value is never read as negative).
pub fn positive_integer(bytes: &[u8]) -> Vec<u8> {
    let trimmed: Vec<u8> = bytes.iter().copied().skip_while(|b| *b == 0).collect();
    let mut content = Vec::with_capacity(trimmed.len() + 1);
    if trimmed.first().is_none_or(|b| b & 0x80 != 0) {
        content.push(0);
    }
    content.extend(trimmed);
    tlv(0x02, &content)
}

/// An extension: SEQUENCE { extnID, critical, OCTET STRING { value } }.
pub fn extension(id: &[u64], critical: bool, value: Vec<u8>) -> Vec<u8> {
    let mut parts = vec![oid(id)];
    if critical {
        parts.push(tlv(0x01, &[0xff]));
    }
    parts.push(tlv(0x04, &value));
    seq(&parts)
}

/// UTCTime until 2049, GeneralizedTime from 2050 (RFC 5280 4.1.2.5), from Unix seconds.
pub fn time(unix_secs: i64) -> Vec<u8> {
    let days = unix_secs.div_euclid(86_400);
    let rem = unix_secs.rem_euclid(86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
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

/// PEM armour around DER bytes.
pub fn pem(label: &str, der: &[u8]) -> String {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::STANDARD.encode(der);
    let mut out = format!("-----BEGIN {label}-----\n");
    for line in b64.as_bytes().chunks(64) {
        // Base64 output is ASCII, so every chunk is valid UTF-8.
        out.push_str(&String::from_utf8_lossy(line));
        out.push('\n');
    }
    out.push_str(&format!("-----END {label}-----\n"));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_lengths_use_the_long_form() {
        let encoded = tlv(0x04, &[0u8; 300]);
        assert_eq!(&encoded[..4], &[0x04, 0x82, 0x01, 0x2c]);
    }

    #[test]
    fn integers_stay_positive() {
        assert_eq!(positive_integer(&[0x80, 1]), vec![0x02, 3, 0, 0x80, 1]);
        assert_eq!(positive_integer(&[0, 0, 5]), vec![0x02, 1, 5]);
    }

    #[test]
    fn times_switch_to_generalized_in_2050() {
        // 2001-01-01T00:00:00Z and 2050-01-01T00:00:00Z.
        assert_eq!(time(978_307_200), tlv(0x17, b"010101000000Z"));
        assert_eq!(time(2_524_608_000), tlv(0x18, b"20500101000000Z"));
    }
}

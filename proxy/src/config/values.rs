//! Value types and name checks shared by the sections: byte quantities, DNS labels.

use serde::{Deserialize, Serialize};

/// A byte count written as a plain number or a Kubernetes quantity (`512Mi`, `8Gi`, `2G`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct Quantity(pub u64);

impl<'de> Deserialize<'de> for Quantity {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        // A visitor rather than an untagged enum: errors raised inside it carry the field's
        // path and line.
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = Quantity;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a byte count such as 1048576 or 512Mi")
            }

            fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<Quantity, E> {
                Ok(Quantity(n))
            }

            fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<Quantity, E> {
                u64::try_from(n)
                    .map(Quantity)
                    .map_err(|_| E::custom(format!("{n} is negative; a byte count is 0 or more")))
            }

            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<Quantity, E> {
                s.parse().map_err(E::custom)
            }
        }
        d.deserialize_any(Visitor)
    }
}

impl std::str::FromStr for Quantity {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
        let (digits, suffix) = s.split_at(split);
        let n: u64 = digits
            .parse()
            .map_err(|_| format!("{s:?} is not a byte quantity such as 512Mi"))?;
        let unit: u64 = match suffix {
            "" => 1,
            "k" | "K" => 1_000,
            "M" => 1_000_000,
            "G" => 1_000_000_000,
            "T" => 1_000_000_000_000,
            "Ki" => 1 << 10,
            "Mi" => 1 << 20,
            "Gi" => 1 << 30,
            "Ti" => 1 << 40,
            _ => return Err(format!("{s:?} has an unknown unit {suffix:?}")),
        };
        n.checked_mul(unit)
            .map(Quantity)
            .ok_or_else(|| format!("{s:?} is too large"))
    }
}

/// A DNS-1123 label: 1 to 63 lowercase letters, digits or `-`, starting and ending with a
/// letter or digit (namespace names, resource names, group name labels).
pub(super) fn is_dns_label(text: &str) -> bool {
    let bytes = text.as_bytes();
    (1..=63).contains(&bytes.len())
        && bytes
            .iter()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
        && bytes[0] != b'-'
        && bytes[bytes.len() - 1] != b'-'
}

/// A hostname label: like a DNS label but in any case.
pub(super) fn is_hostname_label(text: &str) -> bool {
    is_dns_label(&text.to_ascii_lowercase())
}

/// An object name that can appear in a path: non-empty, not `.` or `..`, no `/` or `%`
/// (the apiserver's `IsValidPathSegmentName`).
pub(super) fn is_object_name(text: &str) -> bool {
    !text.is_empty() && text != "." && text != ".." && !text.contains(['/', '%'])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities_read_like_kubernetes_ones() {
        let q = |s: &str| s.parse::<Quantity>().map(|q| q.0);
        assert_eq!(q("512Mi"), Ok(512 << 20));
        assert_eq!(q("8Gi"), Ok(8 << 30));
        assert_eq!(q("2G"), Ok(2_000_000_000));
        assert_eq!(q("1000"), Ok(1000));
        assert!(q("1.5Gi").is_err());
        assert!(q("Gi").is_err());
        assert!(q("8GB").unwrap_err().contains("unknown unit"));
        assert!(q("99999999999Ti").unwrap_err().contains("too large"));
    }
}

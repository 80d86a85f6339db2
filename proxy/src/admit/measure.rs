//! What a LIST response says about the apiserver's cost, measured on the wire.
//!
//! The cost model wants the size of the JSON the apiserver built, because that is what it
//! held in memory. Only some responses show it:
//! - plain JSON (`application/json`, no `Content-Encoding`): its length;
//! - gzip'd JSON (client-go and kubectl send `Accept-Encoding: gzip`, and the apiserver
//!   compresses lists over 128 KiB): the gzip trailer's ISIZE, the uncompressed length
//!   modulo 2^32, read from the last four bytes at no cost;
//! - anything else measures something smaller than the apiserver's work (protobuf,
//!   `as=Table` or `as=PartialObjectMetadataList`, another encoding) and teaches nothing.

use http::HeaderMap;
use http::header::{CONTENT_ENCODING, CONTENT_TYPE};

/// How a response's body measures the JSON the apiserver built.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    /// Plain JSON: its length.
    Json,
    /// Gzip'd JSON: the uncompressed length in the gzip trailer.
    GzipJson,
}

impl Encoding {
    /// The measure a response with these headers allows, if any.
    pub fn of(headers: &HeaderMap) -> Option<Encoding> {
        let content_type = headers.get(CONTENT_TYPE)?.to_str().ok()?;
        let mut parts = content_type.split(';');
        let media = parts.next()?.trim();
        if !media.eq_ignore_ascii_case("application/json")
            || parts.any(|p| p.trim().to_ascii_lowercase().starts_with("as="))
        {
            return None;
        }
        let mut codings = headers.get_all(CONTENT_ENCODING).iter();
        match (codings.next().map(|v| v.to_str()), codings.next()) {
            (None, _) => Some(Encoding::Json),
            (Some(Ok(c)), None) if c.trim().eq_ignore_ascii_case("identity") => {
                Some(Encoding::Json)
            }
            (Some(Ok(c)), None) if c.trim().eq_ignore_ascii_case("gzip") => {
                Some(Encoding::GzipJson)
            }
            _ => None,
        }
    }
}

/// Measures a body as it streams by: bytes seen, the first two (the gzip magic) and the
/// last eight (the gzip trailer).
#[derive(Debug, Clone)]
pub struct Meter {
    encoding: Encoding,
    bytes: u64,
    head: [u8; 2],
    tail: [u8; 8],
}

/// The gzip member header's first two bytes.
const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

impl Meter {
    pub fn new(encoding: Encoding) -> Meter {
        Meter {
            encoding,
            bytes: 0,
            head: [0; 2],
            tail: [0; 8],
        }
    }

    /// Takes the next chunk of the body.
    pub fn feed(&mut self, chunk: &[u8]) {
        for (i, byte) in chunk.iter().take(2).enumerate() {
            let at = self.bytes as usize + i;
            if at < 2 {
                self.head[at] = *byte;
            }
        }
        self.bytes += chunk.len() as u64;
        if chunk.len() >= 8 {
            self.tail.copy_from_slice(&chunk[chunk.len() - 8..]);
        } else {
            self.tail.rotate_left(chunk.len());
            self.tail[8 - chunk.len()..].copy_from_slice(chunk);
        }
    }

    /// The JSON length the apiserver built, once the whole body was fed; `None` when the
    /// body does not show it (a gzip body without a whole member around it).
    pub fn json_bytes(&self) -> Option<u64> {
        match self.encoding {
            Encoding::Json => Some(self.bytes),
            Encoding::GzipJson => {
                // A gzip member is a 10-byte header, the deflate data and an 8-byte trailer.
                if self.bytes < 18 || self.head != GZIP_MAGIC {
                    return None;
                }
                let isize =
                    u32::from_le_bytes([self.tail[4], self.tail[5], self.tail[6], self.tail[7]]);
                // ISIZE is the length modulo 2^32; JSON compresses, so the true length is
                // the smallest such value not below the compressed length.
                let mut length = u64::from(isize);
                while length < self.bytes {
                    length += 1 << 32;
                }
                Some(length)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use flate2::Compression;
    use flate2::write::GzEncoder;
    use http::HeaderValue;

    use super::*;

    fn headers(content_type: &str, encoding: Option<&str>) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(CONTENT_TYPE, HeaderValue::from_str(content_type).unwrap());
        if let Some(e) = encoding {
            h.insert(CONTENT_ENCODING, HeaderValue::from_str(e).unwrap());
        }
        h
    }

    #[test]
    fn only_json_lists_measure_the_apiservers_work() {
        assert_eq!(
            Encoding::of(&headers("application/json", None)),
            Some(Encoding::Json)
        );
        assert_eq!(
            Encoding::of(&headers("application/json", Some("gzip"))),
            Some(Encoding::GzipJson)
        );
        for (content_type, encoding) in [
            ("application/vnd.kubernetes.protobuf", None),
            ("application/json;as=Table;v=v1;g=meta.k8s.io", None),
            (
                "application/json;as=PartialObjectMetadataList;v=v1;g=meta.k8s.io",
                Some("gzip"),
            ),
            ("application/cbor", None),
            ("application/json", Some("br")),
        ] {
            assert_eq!(
                Encoding::of(&headers(content_type, encoding)),
                None,
                "{content_type} {encoding:?}"
            );
        }
        assert_eq!(Encoding::of(&HeaderMap::new()), None);
    }

    #[test]
    fn a_gzip_body_measures_its_uncompressed_length_in_any_chunking() {
        let json = format!(
            "{{\"kind\":\"SecretList\",\"items\":[{}]}}",
            vec!["{\"data\":{\"k\":\"dmFsdWU=\"}}"; 20_000].join(",")
        );
        let mut encoder = GzEncoder::new(Vec::new(), Compression::default());
        encoder.write_all(json.as_bytes()).unwrap();
        let gz = encoder.finish().unwrap();
        assert!(gz.len() * 20 < json.len(), "the list compresses well");
        for chunk in [1, 3, 7, 8, 9, 1000, gz.len()] {
            let mut meter = Meter::new(Encoding::GzipJson);
            for piece in gz.chunks(chunk) {
                meter.feed(piece);
            }
            assert_eq!(
                meter.json_bytes(),
                Some(json.len() as u64),
                "chunks of {chunk}"
            );
        }
        let mut plain = Meter::new(Encoding::Json);
        plain.feed(json.as_bytes());
        assert_eq!(plain.json_bytes(), Some(json.len() as u64));
        // Not gzip after all: no measure rather than a wrong one.
        let mut lying = Meter::new(Encoding::GzipJson);
        lying.feed(json.as_bytes());
        assert_eq!(lying.json_bytes(), None);
    }
}

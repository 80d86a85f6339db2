//! Which encoding a cached answer takes: `Accept` negotiated the way the apiserver does,
//! so that the cache answers in the form the apiserver would have chosen, or not at all.
//!
//! The apiserver orders the client's media ranges by quality, then by specificity (a full
//! type before `application/*` before `*/*`), keeping the client's order among equals,
//! and takes the first range one of its serializers matches, trying them in its own order:
//! JSON, YAML, protobuf. So `*/*` and `application/*` get JSON, and client-go's
//! `application/vnd.kubernetes.protobuf, application/json` gets protobuf. The cache speaks
//! JSON, and protobuf for the kinds [`super::protobuf`] encodes; anything else the
//! apiserver would choose (YAML, protobuf of another kind, a `;as=` transformation, or
//! nothing acceptable, its 406) goes upstream.

use http::HeaderMap;

/// The encoding of a cached answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Encoding {
    /// `application/json` (a watch: JSON lines).
    Json,
    /// `application/vnd.kubernetes.protobuf` (a watch: length-prefixed frames).
    Protobuf,
}

/// The apiserver's serializers, in the order it tries them.
const SERIALIZERS: [(&str, Option<Encoding>); 3] = [
    ("json", Some(Encoding::Json)),
    ("yaml", None),
    ("vnd.kubernetes.protobuf", Some(Encoding::Protobuf)),
];

/// One media range of `Accept`.
#[derive(Debug)]
struct Range<'a> {
    kind: &'a str,
    subtype: &'a str,
    quality: f32,
    /// 2 for a full type, 1 for `type/*`, 0 for `*/*`.
    specificity: u8,
}

/// The encoding the apiserver would answer `headers` with, when the cache can produce it
/// (`protobuf`: whether the cache encodes this kind in protobuf); else why not.
pub fn negotiate(headers: &HeaderMap, protobuf: bool) -> Result<Encoding, &'static str> {
    let mut ranges = Vec::new();
    // An Accept with text but no range (`,`) accepts nothing: the apiserver's 406. Only
    // an absent or empty one means "anything", JSON.
    let mut said_something = false;
    for value in headers.get_all(http::header::ACCEPT) {
        let value = value.to_str().map_err(|_| "an Accept that is not text")?;
        said_something |= !value.trim().is_empty();
        for range in value.split(',') {
            let mut parts = range.split(';');
            let media = parts.next().unwrap_or_default().trim();
            if media.is_empty() {
                continue;
            }
            let (kind, subtype) = media.split_once('/').ok_or("a malformed Accept")?;
            let mut quality = 1.0;
            for param in parts {
                let (name, value) = param.split_once('=').unwrap_or((param, ""));
                match name.trim().to_ascii_lowercase().as_str() {
                    // A Table or PartialObjectMetadata is a transformation the cache does
                    // not make.
                    "as" => return Err("Accept asks for another form"),
                    "q" => quality = value.trim().parse().unwrap_or(1.0),
                    _ => {}
                }
            }
            let (kind, subtype) = (kind.trim(), subtype.trim());
            let specificity = match (kind, subtype) {
                ("*", _) => 0,
                (_, "*") => 1,
                _ => 2,
            };
            ranges.push(Range {
                kind,
                subtype,
                quality,
                specificity,
            });
        }
    }
    match (ranges.is_empty(), said_something) {
        (true, false) => return Ok(Encoding::Json),
        (true, true) => return Err("an Accept of empty ranges"),
        (false, _) => {}
    }
    // Stable: among equals, the client's order.
    ranges.sort_by(|a, b| {
        b.quality
            .total_cmp(&a.quality)
            .then(b.specificity.cmp(&a.specificity))
    });
    for range in ranges.iter().filter(|r| r.quality > 0.0) {
        let kind_matches = range.kind == "*" || range.kind.eq_ignore_ascii_case("application");
        let Some((_, chosen)) = SERIALIZERS.iter().find(|(subtype, _)| {
            kind_matches && (range.subtype == "*" || range.subtype.eq_ignore_ascii_case(subtype))
        }) else {
            continue;
        };
        return match chosen {
            Some(Encoding::Protobuf) if !protobuf => {
                Err("protobuf of a kind the cache does not encode")
            }
            Some(encoding) => Ok(*encoding),
            None => Err("Accept asks for YAML"),
        };
    }
    Err("nothing the cache can answer is acceptable")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn accept(value: &str, protobuf: bool) -> Result<Encoding, &'static str> {
        let mut headers = HeaderMap::new();
        headers.insert(http::header::ACCEPT, value.parse().unwrap());
        negotiate(&headers, protobuf)
    }

    #[test]
    fn client_go_gets_protobuf_and_wildcards_get_json() {
        use Encoding::{Json, Protobuf};
        for (value, want) in [
            // kubelet, most controllers
            (
                "application/vnd.kubernetes.protobuf,application/json",
                Protobuf,
            ),
            // kube-proxy
            ("application/vnd.kubernetes.protobuf, */*", Protobuf),
            ("application/vnd.kubernetes.protobuf", Protobuf),
            ("application/json", Json),
            (
                "application/json, application/vnd.kubernetes.protobuf",
                Json,
            ),
            ("*/*", Json),
            ("application/*", Json),
            ("*/*, application/vnd.kubernetes.protobuf", Protobuf),
            (
                "application/json;q=0.5, application/vnd.kubernetes.protobuf",
                Protobuf,
            ),
            (
                "application/vnd.kubernetes.protobuf;q=0.9, application/json",
                Json,
            ),
            ("application/vnd.kubernetes.protobuf;q=0, */*", Json),
            ("text/html, application/json", Json),
        ] {
            assert_eq!(accept(value, true), Ok(want), "{value}");
        }
        let none = HeaderMap::new();
        assert_eq!(negotiate(&none, true), Ok(Json), "no Accept is JSON");
        assert_eq!(accept("", true), Ok(Json), "an empty Accept is JSON");
        assert_eq!(accept(" ", true), Ok(Json), "a blank Accept is JSON");
        assert_eq!(accept(", application/json", true), Ok(Json));
    }

    #[test]
    fn what_the_cache_cannot_answer_goes_upstream() {
        for (value, protobuf) in [
            (
                "application/vnd.kubernetes.protobuf, application/json",
                false,
            ),
            (
                "application/json;as=Table;v=v1;g=meta.k8s.io, application/json",
                true,
            ),
            ("application/yaml, application/json", true),
            ("text/html", true),
            ("application/json;q=0", true),
            ("garbage", true),
            // Empty ranges only: the apiserver's 406, never JSON.
            (",", true),
            (", ,", true),
            (" ;q=0.5 ,", true),
        ] {
            assert!(accept(value, protobuf).is_err(), "{value}");
        }
        assert_eq!(
            accept(
                "application/json, application/vnd.kubernetes.protobuf",
                false
            ),
            Ok(Encoding::Json),
            "JSON first is served even for a kind without protobuf"
        );
    }
}

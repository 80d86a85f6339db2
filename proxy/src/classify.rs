//! Turns method, path and query into a request info like the apiserver's (DESIGN.md step 4).
//!
//! The rules follow `k8s.io/apiserver/pkg/endpoints/request.RequestInfoFactory`, so that
//! rules, admission and the cache see a request the way the apiserver's authorizer will:
//! `/api/v1/...` is the core group, `/apis/GROUP/VERSION/...` a named one,
//! `namespaces/NS/RESOURCE/NAME/SUBRESOURCE/...` the namespaced form, `namespaces/NAME` (and
//! its `status` and `finalize`) the namespace object itself, and the legacy
//! `/api/v1/watch/...` prefix makes the verb `watch`. Everything else is a non-resource
//! request whose verb is the lowercase method.
//!
//! Two things are stricter than the apiserver, because Bulwark forwards the path it
//! classified byte for byte and must never classify one thing while the apiserver (or a
//! path-cleaning hop in between) serves another: paths that could be read two ways (encoded
//! `/` or `.`, empty, `.` or `..` segments, malformed percent-encoding) and queries that Go
//! would parse differently (malformed encoding, `;`) are refused with 400.

mod query;

use std::borrow::Cow;
use std::fmt;
use std::time::Duration;

use compact_str::CompactString;
use http::Method;

pub use query::Query;

/// What a request does, in the apiserver's authorization vocabulary.
///
/// `Display` gives the apiserver's lowercase verb: `get`, `list`, ..., and for non-resource
/// requests the lowercase method (`get`, `post`, `head`, ...).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Verb {
    /// Read one object (GET or HEAD with a name); also the verb of `GET .../exec` and other
    /// connect subresources reached with GET.
    Get,
    /// Read a collection.
    List,
    /// Watch a collection or one object.
    Watch,
    /// POST; also the verb of `POST .../exec`, `.../attach`, `.../portforward`.
    Create,
    /// PUT.
    Update,
    /// PATCH.
    Patch,
    /// DELETE of one object.
    Delete,
    /// DELETE without a name.
    DeleteCollection,
    /// A request outside the resource API (`/healthz`, `/version`, discovery, ...): the
    /// method as is.
    NonResource(Method),
}

impl Verb {
    /// The apiserver's name of a resource verb (`get`, …, `deletecollection`); `None` for
    /// a non-resource request, whose method is its verb.
    pub fn resource_verb(&self) -> Option<&'static str> {
        Some(match self {
            Verb::Get => "get",
            Verb::List => "list",
            Verb::Watch => "watch",
            Verb::Create => "create",
            Verb::Update => "update",
            Verb::Patch => "patch",
            Verb::Delete => "delete",
            Verb::DeleteCollection => "deletecollection",
            Verb::NonResource(_) => return None,
        })
    }

    /// Whether this is one of the apiserver's read verbs (`get`, `list`, `watch`) or a
    /// non-resource GET or HEAD.
    fn reads(&self) -> bool {
        match self {
            Verb::Get | Verb::List | Verb::Watch => true,
            Verb::NonResource(method) => method == Method::GET || method == Method::HEAD,
            _ => false,
        }
    }
}

impl fmt::Display for Verb {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Verb::NonResource(method) => f.write_str(&method.as_str().to_lowercase()),
            resource => f.write_str(resource.resource_verb().unwrap_or_default()),
        }
    }
}

/// A classified request: what the apiserver's `RequestInfoFactory` would make of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestInfo {
    /// The apiserver's verb.
    pub verb: Verb,
    /// Whether the path is in the resource API (`/api/v1/...`, `/apis/G/V/...`).
    pub resource_request: bool,
    /// API group; `""` for the core group and for non-resource requests.
    pub api_group: CompactString,
    /// API version; `""` for non-resource requests.
    pub api_version: CompactString,
    /// Namespace of the request. As in the apiserver, a request for the namespace object
    /// `namespaces/NAME` has namespace `NAME`.
    pub namespace: Option<CompactString>,
    /// Resource, e.g. `pods`; `""` for non-resource requests.
    pub resource: CompactString,
    /// Subresource, e.g. `status`, `log`, `exec`, `proxy`.
    pub subresource: Option<CompactString>,
    /// Object name from the path. A list or watch narrowed by `fieldSelector=metadata.name=X`
    /// keeps `None` here (the name decides get vs list); see
    /// [`RequestInfo::field_selector_name`].
    pub name: Option<CompactString>,
    /// The verb came from the legacy `/watch/` path prefix. The apiserver then takes the
    /// object name from the path only, never from `fieldSelector=metadata.name=X`.
    pub watch_prefix: bool,
    /// The exact path that was classified, still percent-encoded; it is what gets forwarded.
    pub path: String,
    /// The query parameters Bulwark acts on, plus the raw query.
    pub query: Query,
}

/// Subresources that upgrade the connection (SPDY or WebSocket streams).
const UPGRADE_SUBRESOURCES: [&str; 3] = ["exec", "attach", "portforward"];

impl RequestInfo {
    /// Whether the request may run indefinitely and so holds no seat once started and has
    /// no request timeout: watches, `log?follow=true`, exec/attach/portforward and the
    /// `proxy` subresource (the apiserver's long-running check, except that a `log` without
    /// `follow` ends by itself and is treated as an ordinary read), and `/debug/pprof/`.
    pub fn is_long_running(&self) -> bool {
        if self.verb == Verb::Watch {
            return true;
        }
        if !self.resource_request {
            return self.path.starts_with("/debug/pprof/");
        }
        match self.subresource.as_deref() {
            Some("proxy") => true,
            Some("log") => self.query.follow,
            Some(sub) => UPGRADE_SUBRESOURCES.contains(&sub),
            None => false,
        }
    }

    /// Whether the request is an exec, attach or portforward, which upgrades the connection
    /// (whatever its verb: GET for WebSocket clients, POST for SPDY ones).
    pub fn is_upgrade(&self) -> bool {
        self.resource_request
            && self
                .subresource
                .as_deref()
                .is_some_and(|sub| UPGRADE_SUBRESOURCES.contains(&sub))
    }

    /// Whether the request only reads: `get`, `list`, `watch`, or a non-resource GET or
    /// HEAD. An exec, attach or portforward is never a read, even when it arrives as a GET,
    /// because it runs something in the pod.
    pub fn is_read(&self) -> bool {
        self.verb.reads() && !self.is_upgrade()
    }

    /// Whether the verb is `list`.
    pub fn is_list(&self) -> bool {
        self.verb == Verb::List
    }

    /// For a list or watch, the name X required by `fieldSelector=metadata.name=X` (or
    /// `==X`), as the apiserver uses it for authorization. `None` when there is no such
    /// term, when the value is escaped, or when it is not a valid path segment name (the
    /// apiserver then authorizes without a name too), and on the legacy `/watch/` paths,
    /// where `RequestInfoFactory` reads the name from the path alone (a collection watched
    /// there is authorized without a name, whatever its selector).
    pub fn field_selector_name(&self) -> Option<&str> {
        if !self.resource_request
            || self.watch_prefix
            || !matches!(self.verb, Verb::List | Verb::Watch)
        {
            return None;
        }
        let selector = self.query.field_selector.as_deref()?;
        query::exact_field_match(selector, "metadata.name").filter(|name| {
            // The apiserver's `IsValidPathSegmentName`, plus `=`, which its selector
            // parser refuses unescaped.
            !name.is_empty() && *name != "." && *name != ".." && !name.contains(['/', '%', '='])
        })
    }
}

/// Why a request could not be classified. Every variant is answered with 400 Bad Request
/// and its message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClassifyError {
    /// The path does not start with `/` (e.g. `*` or an authority).
    #[error("the request path {path:?} is not absolute")]
    NotAbsolute {
        /// The path as received.
        path: String,
    },
    /// `%2F` or `%2E`: a slash or dot in disguise, which another hop may decode and read as a
    /// different path than the one classified.
    #[error("the request path {path:?} contains an encoded '/' or '.'")]
    EncodedSeparator {
        /// The path as received.
        path: String,
    },
    /// `//` somewhere in the path.
    #[error("the request path {path:?} contains an empty segment")]
    EmptySegment {
        /// The path as received.
        path: String,
    },
    /// A `.` or `..` segment.
    #[error("the request path {path:?} contains a '.' or '..' segment")]
    DotSegment {
        /// The path as received.
        path: String,
    },
    /// A `%` not followed by two hex digits, or an escape that decodes to invalid UTF-8.
    #[error("the request path {path:?} is not validly percent-encoded UTF-8")]
    BadPathEncoding {
        /// The path as received.
        path: String,
    },
    /// `/api/v1/watch` with nothing after it: no resource to watch.
    #[error("unable to determine kind and namespace from the request path {path:?}")]
    MissingResource {
        /// The path as received.
        path: String,
    },
    /// The `/api/v1/proxy/...` form, removed from Kubernetes in 1.10 (the `proxy`
    /// subresource replaced it).
    #[error(
        "the request path {path:?} uses the removed /proxy/ prefix; use the proxy subresource (.../NAME/proxy/...)"
    )]
    LegacyProxy {
        /// The path as received.
        path: String,
    },
    /// A method the apiserver does not serve on this path.
    #[error("method {method} is not allowed on {path:?}")]
    MethodNotAllowed {
        /// The method.
        method: Method,
        /// The path as received.
        path: String,
    },
    /// The query string is malformed: a bad `%` escape, a `;` (which Go's parser drops, so
    /// the apiserver would read a different query), or invalid UTF-8 in a parameter Bulwark
    /// reads.
    #[error("the query string is malformed: {detail}")]
    BadQuery {
        /// What is wrong.
        detail: String,
    },
    /// A parameter Bulwark acts on has a value the apiserver would refuse.
    #[error("invalid value {value:?} for query parameter {param}: {expected}")]
    InvalidParameter {
        /// The parameter name, e.g. `limit`.
        param: &'static str,
        /// The (decoded) value.
        value: String,
        /// What was expected instead.
        expected: &'static str,
    },
}

/// Methods served anywhere; others (CONNECT, TRACE, extension methods) are refused, which
/// also keeps the `verb` metric label bounded.
const NON_RESOURCE_METHODS: [Method; 7] = [
    Method::GET,
    Method::HEAD,
    Method::POST,
    Method::PUT,
    Method::PATCH,
    Method::DELETE,
    Method::OPTIONS,
];

/// Classifies a request by method and URI, as the apiserver would.
pub fn classify(method: &Method, uri: &http::Uri) -> Result<RequestInfo, ClassifyError> {
    classify_parts(method, uri.path(), uri.query())
}

/// [`classify`] on the path and query strings.
// Over 120 lines: the path's segments, the verb and the query read in one pass in the
// apiserver's order, each step on what the one before found.
fn classify_parts(
    method: &Method,
    path: &str,
    raw_query: Option<&str>,
) -> Result<RequestInfo, ClassifyError> {
    let segments = split_path(path)?;
    let params = query::Params::parse(raw_query.unwrap_or(""))?;

    let non_resource = || -> Result<RequestInfo, ClassifyError> {
        if !NON_RESOURCE_METHODS.contains(method) {
            return Err(ClassifyError::MethodNotAllowed {
                method: method.clone(),
                path: path.to_owned(),
            });
        }
        Ok(RequestInfo {
            verb: Verb::NonResource(method.clone()),
            resource_request: false,
            api_group: CompactString::default(),
            api_version: CompactString::default(),
            namespace: None,
            resource: CompactString::default(),
            subresource: None,
            name: None,
            watch_prefix: false,
            path: path.to_owned(),
            query: params.query(false)?,
        })
    };

    // `/api/VERSION/...` or `/apis/GROUP/VERSION/...` with at least one part after the
    // version; anything shorter (discovery included) is a non-resource request.
    let mut parts: &[Cow<'_, str>] = &segments;
    let api_group = match parts.first().map(|s| s.as_ref()) {
        Some("api") if parts.len() >= 3 => {
            parts = &parts[1..];
            CompactString::default()
        }
        Some("apis") if parts.len() >= 4 => {
            let group = CompactString::new(&parts[1]);
            parts = &parts[2..];
            group
        }
        _ => return non_resource(),
    };
    let api_version = CompactString::new(&parts[0]);
    parts = &parts[1..];

    let watch_prefix = parts[0] == "watch";
    let mut verb = match parts[0].as_ref() {
        "watch" => {
            if parts.len() < 2 {
                return Err(ClassifyError::MissingResource {
                    path: path.to_owned(),
                });
            }
            // The apiserver only routes GET (and so HEAD) to watch paths; anything else
            // must not be taken for a read.
            if method != Method::GET && method != Method::HEAD {
                return Err(ClassifyError::MethodNotAllowed {
                    method: method.clone(),
                    path: path.to_owned(),
                });
            }
            parts = &parts[1..];
            Verb::Watch
        }
        "proxy" => {
            return Err(ClassifyError::LegacyProxy {
                path: path.to_owned(),
            });
        }
        _ => match *method {
            Method::GET | Method::HEAD => Verb::Get,
            Method::POST => Verb::Create,
            Method::PUT => Verb::Update,
            Method::PATCH => Verb::Patch,
            Method::DELETE => Verb::Delete,
            _ => {
                return Err(ClassifyError::MethodNotAllowed {
                    method: method.clone(),
                    path: path.to_owned(),
                });
            }
        },
    };

    let mut namespace = None;
    if parts[0] == "namespaces" && parts.len() > 1 {
        namespace = Some(CompactString::new(&parts[1]));
        // `namespaces/NS/RESOURCE/...` is a namespaced resource; `namespaces/NS`,
        // `namespaces/NS/status` and `namespaces/NS/finalize` are the namespace itself.
        if parts.len() > 2 && !matches!(parts[2].as_ref(), "status" | "finalize") {
            parts = &parts[2..];
        }
    }

    let resource = CompactString::new(&parts[0]);
    let name = parts.get(1).map(CompactString::new);
    let subresource = parts.get(2).map(CompactString::new);

    if name.is_none() {
        match verb {
            Verb::Get if params.watch() => verb = Verb::Watch,
            Verb::Get => verb = Verb::List,
            Verb::Delete => verb = Verb::DeleteCollection,
            _ => {}
        }
    }
    // Lists and watches are where the apiserver decodes ListOptions and refuses bad values.
    let strict = matches!(verb, Verb::List | Verb::Watch);
    let mut query = params.query(strict)?;
    // A `watch` parameter on a named GET is ignored by the apiserver; the legacy watch path
    // watches without one.
    query.watch = verb == Verb::Watch;

    Ok(RequestInfo {
        verb,
        resource_request: true,
        api_group,
        api_version,
        namespace,
        resource,
        subresource,
        name,
        watch_prefix,
        path: path.to_owned(),
        query,
    })
}

/// Splits an absolute path into decoded segments, refusing every shape that could be read
/// two ways. `/` gives no segments; one trailing `/` is ignored, as the apiserver does.
/// A segment without escapes is borrowed from the path, not copied.
/// A path's segments: as many as a resource path has (`/apis/G/V/namespaces/N/R/NAME/S`)
/// stay off the heap.
type Segments<'a> = smallvec::SmallVec<[Cow<'a, str>; 10]>;

fn split_path(path: &str) -> Result<Segments<'_>, ClassifyError> {
    let err = |make: fn(String) -> ClassifyError| Err(make(path.to_owned()));
    let Some(body) = path.strip_prefix('/') else {
        return err(|path| ClassifyError::NotAbsolute { path });
    };
    // Most paths have no escape at all: one look for `%` spares every segment its own.
    let escaped = path.as_bytes().contains(&b'%');
    if escaped && has_encoded_separator(path) {
        return err(|path| ClassifyError::EncodedSeparator { path });
    }
    if body.is_empty() {
        return Ok(Segments::new());
    }
    let body = body.strip_suffix('/').unwrap_or(body);
    let mut segments = Segments::new();
    // Split on `/` byte by byte: segments are a few bytes long, shorter than a searcher
    // takes to start.
    let mut start = 0;
    let ends = body
        .bytes()
        .enumerate()
        .filter_map(|(i, b)| (b == b'/').then_some(i))
        .chain([body.len()]);
    for end in ends {
        let raw = &body[start..end];
        start = end + 1;
        match raw {
            "" => return err(|path| ClassifyError::EmptySegment { path }),
            "." | ".." => return err(|path| ClassifyError::DotSegment { path }),
            _ => {}
        }
        if !escaped || !raw.contains('%') {
            segments.push(Cow::Borrowed(raw));
            continue;
        }
        let Some(bytes) = percent_decode(raw, false) else {
            return err(|path| ClassifyError::BadPathEncoding { path });
        };
        let Ok(segment) = String::from_utf8(bytes) else {
            return err(|path| ClassifyError::BadPathEncoding { path });
        };
        segments.push(Cow::Owned(segment));
    }
    Ok(segments)
}

/// Whether the text holds `%2F` or `%2E` in either case.
fn has_encoded_separator(text: &str) -> bool {
    text.as_bytes()
        .windows(3)
        .any(|w| w[0] == b'%' && w[1] == b'2' && matches!(w[2].to_ascii_lowercase(), b'f' | b'e'))
}

/// Decodes `%XX` escapes (and `+` as a space when `plus_is_space`, as in a query); `None`
/// when a `%` is not followed by two hex digits.
fn percent_decode(text: &str, plus_is_space: bool) -> Option<Vec<u8>> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hi = hex_value(*bytes.get(i + 1)?)?;
                let lo = hex_value(*bytes.get(i + 2)?)?;
                out.push(hi << 4 | lo);
                i += 3;
            }
            b'+' if plus_is_space => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    Some(out)
}

/// The value of one hex digit.
fn hex_value(digit: u8) -> Option<u8> {
    match digit {
        b'0'..=b'9' => Some(digit - b'0'),
        b'a'..=b'f' => Some(digit - b'a' + 10),
        b'A'..=b'F' => Some(digit - b'A' + 10),
        _ => None,
    }
}

/// The upstream timeouts by verb class: the configuration names the classes, this module
/// tells a request's.
impl crate::config::Timeouts {
    /// How long the upstream may take to send the response head of this request; `None`
    /// for long-running requests, which have no request timeout.
    pub fn for_request(&self, info: &RequestInfo) -> Option<Duration> {
        if info.is_long_running() {
            return None;
        }
        Some(match &info.verb {
            Verb::List => self.list,
            Verb::Get | Verb::Watch => self.read,
            Verb::NonResource(method)
                if method == http::Method::GET || method == http::Method::HEAD =>
            {
                self.read
            }
            _ => self.write,
        })
    }

    /// The limit on one try of a request until its response head ([`Timeouts::attempt`]):
    /// resource reads that are not lists, watches' starts included; `None` for lists,
    /// writes, non-resource reads (`/openapi/v2`, discovery) and the long-running requests whose head waits on something other than the apiserver
    /// (a pod's proxy, `log?follow`, a profile).
    pub fn attempt_for(&self, info: &RequestInfo) -> Option<Duration> {
        let head_from_apiserver = !info.is_long_running() || info.verb == Verb::Watch;
        // Non-resource reads (`/openapi/v2` of a cluster with many CRDs, discovery) can be
        // slow on every replica: sending them again would triple the work for a 504.
        (info.resource_request && info.is_read() && !info.is_list() && head_from_apiserver)
            .then_some(self.attempt)
    }
}

#[cfg(test)]
mod tests;

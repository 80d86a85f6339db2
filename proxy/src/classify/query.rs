//! The query parameters Bulwark acts on, decoded the way the apiserver decodes them.
//!
//! Go's `url.ParseQuery` splits on `&`, decodes `+` and `%XX`, and keeps every value of a
//! repeated key; the apiserver's parameter codec then takes the FIRST value. A boolean is
//! false only when absent, `0` or `false` (any case): an empty value (`?watch` or
//! `?watch=`) is true (apimachinery's `Convert_Slice_string_To_bool`).

use apimachinery::params::bool_param as truthy;

use super::{ClassifyError, percent_decode};

/// The query parameters that change how Bulwark treats a request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Query {
    /// The request watches: a list with a true `watch` parameter, or the legacy
    /// `/watch/` path. A `watch` parameter on a named GET is ignored, as by the apiserver.
    /// For non-resource requests, the `watch` parameter as given.
    pub watch: bool,
    /// `resourceVersion`; an empty value is the same as none.
    pub resource_version: Option<String>,
    /// `resourceVersionMatch` (`NotOlderThan`, `Exact`); empty is none.
    pub resource_version_match: Option<String>,
    /// `limit`. A value of 0 or below means "no limit" to the apiserver and is `None` here.
    pub limit: Option<u64>,
    /// `continue`; empty is none.
    pub continue_token: Option<String>,
    /// `labelSelector`; empty is none.
    pub label_selector: Option<String>,
    /// `fieldSelector`; empty is none.
    pub field_selector: Option<String>,
    /// `timeoutSeconds` as given: the apiserver takes 0 as unset and a negative value as
    /// a deadline already past (see `apimachinery::params::watch_timeout`).
    pub timeout_seconds: Option<i64>,
    /// `sendInitialEvents` (a WatchList when true); `None` when absent.
    pub send_initial_events: Option<bool>,
    /// `allowWatchBookmarks`.
    pub allow_watch_bookmarks: bool,
    /// `follow` (for `log`).
    pub follow: bool,
    /// The query exactly as received, without the `?`; it is forwarded unchanged.
    pub raw: String,
}

/// The first decoded value of each parameter Bulwark reads, before interpretation.
#[derive(Debug, Default)]
pub(super) struct Params {
    raw: String,
    watch: Option<String>,
    resource_version: Option<String>,
    resource_version_match: Option<String>,
    limit: Option<String>,
    continue_token: Option<String>,
    label_selector: Option<String>,
    field_selector: Option<String>,
    timeout_seconds: Option<String>,
    send_initial_events: Option<String>,
    allow_watch_bookmarks: Option<String>,
    follow: Option<String>,
}

impl Params {
    /// Splits and decodes a raw query. Every pair must decode, not only the ones read: Go
    /// drops a pair it cannot decode, so a malformed pair could make the apiserver read a
    /// query different from the one classified.
    pub(super) fn parse(raw: &str) -> Result<Params, ClassifyError> {
        let mut params = Params {
            raw: raw.to_owned(),
            ..Params::default()
        };
        for pair in raw.split('&') {
            if pair.is_empty() {
                continue;
            }
            if pair.contains(';') {
                return Err(ClassifyError::BadQuery {
                    detail: format!("{pair:?} contains ';' (encode it as %3B)"),
                });
            }
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            let bad_escape = || ClassifyError::BadQuery {
                detail: format!("{pair:?} has a '%' not followed by two hex digits"),
            };
            let key = percent_decode(key, true).ok_or_else(bad_escape)?;
            let value = percent_decode(value, true).ok_or_else(bad_escape)?;
            let slot = match key.as_slice() {
                b"watch" => &mut params.watch,
                b"resourceVersion" => &mut params.resource_version,
                b"resourceVersionMatch" => &mut params.resource_version_match,
                b"limit" => &mut params.limit,
                b"continue" => &mut params.continue_token,
                b"labelSelector" => &mut params.label_selector,
                b"fieldSelector" => &mut params.field_selector,
                b"timeoutSeconds" => &mut params.timeout_seconds,
                b"sendInitialEvents" => &mut params.send_initial_events,
                b"allowWatchBookmarks" => &mut params.allow_watch_bookmarks,
                b"follow" => &mut params.follow,
                _ => continue,
            };
            if slot.is_some() {
                continue;
            }
            let value = String::from_utf8(value).map_err(|_| ClassifyError::BadQuery {
                detail: format!("{pair:?} does not decode to UTF-8"),
            })?;
            *slot = Some(value);
        }
        Ok(params)
    }

    /// Whether the `watch` parameter is true: any first value but `0` or `false`, the
    /// empty one included, as the apiserver's RequestInfoFactory decides between `list`
    /// and `watch`. (Reading `?watch=` as a list would hold LIST seats and byte budget for
    /// the life of what the apiserver serves as a watch.)
    pub(super) fn watch(&self) -> bool {
        truthy(self.watch.as_deref())
    }

    /// Interprets the parameters. With `strict` (lists and watches, where the apiserver
    /// decodes them and answers 400 to bad values), an unparsable `limit` or
    /// `timeoutSeconds` is an error; otherwise it is ignored, as the apiserver ignores it.
    pub(super) fn query(&self, strict: bool) -> Result<Query, ClassifyError> {
        let limit = integer("limit", self.limit.as_deref(), strict)?;
        let timeout_seconds = integer("timeoutSeconds", self.timeout_seconds.as_deref(), strict)?;
        let non_empty = |value: &Option<String>| value.clone().filter(|v| !v.is_empty());
        Ok(Query {
            watch: self.watch(),
            resource_version: non_empty(&self.resource_version),
            resource_version_match: non_empty(&self.resource_version_match),
            limit: limit.filter(|n| *n > 0).map(i64::unsigned_abs),
            continue_token: non_empty(&self.continue_token),
            label_selector: non_empty(&self.label_selector),
            field_selector: non_empty(&self.field_selector),
            timeout_seconds,
            send_initial_events: self.send_initial_events.as_deref().map(|v| truthy(Some(v))),
            allow_watch_bookmarks: truthy(self.allow_watch_bookmarks.as_deref()),
            follow: truthy(self.follow.as_deref()),
            raw: self.raw.clone(),
        })
    }
}

/// A decimal `int64` as Go's `strconv.ParseInt(v, 10, 64)` reads it.
fn integer(
    param: &'static str,
    value: Option<&str>,
    strict: bool,
) -> Result<Option<i64>, ClassifyError> {
    let Some(value) = value else {
        return Ok(None);
    };
    // Rust accepts a leading '+' like Go does; neither accepts spaces or an empty string.
    match value.parse::<i64>() {
        Ok(n) => Ok(Some(n)),
        Err(_) if strict => Err(ClassifyError::InvalidParameter {
            param,
            value: value.to_owned(),
            expected: "a decimal integer",
        }),
        Err(_) => Ok(None),
    }
}

/// The value an apimachinery field selector requires for `field` (`field=v` or
/// `field==v`), like `fields.Selector.RequiresExactMatch`: terms are split on `,`, sorted,
/// and the first matching one wins. `None` if there is none, or if the selector uses
/// backslash escapes (no valid object name needs them).
pub(super) fn exact_field_match<'a>(selector: &'a str, field: &str) -> Option<&'a str> {
    if selector.contains('\\') {
        return None;
    }
    let mut terms: Vec<&str> = selector.split(',').filter(|t| !t.is_empty()).collect();
    terms.sort_unstable();
    terms.into_iter().find_map(|term| {
        let rest = term.strip_prefix(field)?;
        // The operator is the first of `!=`, `==`, `=` found; here it must start right after
        // the field name, or the term names a different field.
        if rest.starts_with("!=") {
            None
        } else {
            rest.strip_prefix("==").or_else(|| rest.strip_prefix('='))
        }
    })
}

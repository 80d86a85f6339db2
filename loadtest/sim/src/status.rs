//! Kubernetes `Status` error bodies, worded as the apiserver words them.

use apimachinery::continue_token;
use apimachinery::status::{Cause, Details, Status};
use serde_json::Value;

/// A `Status` failure: HTTP code plus the `Status` the apiserver would send, encoded by
/// [`apimachinery::status`] as Bulwark encodes its own.
#[derive(Clone, Debug)]
pub struct ApiError {
    /// HTTP status code.
    pub code: u16,
    /// The `Status` object (boxed: errors travel in `Result`s on every path).
    pub status: Box<Status>,
}

impl ApiError {
    /// A failure `Status` with the given fields; `details` is omitted when `None`.
    pub fn new(code: u16, reason: &str, message: String, details: Option<Details>) -> ApiError {
        ApiError {
            code,
            status: Box::new(Status::failure(code, reason, message, details)),
        }
    }

    /// The body, with its trailing newline.
    pub fn to_bytes(&self) -> Vec<u8> {
        self.status.to_body()
    }
}

/// `details` for a named object of a resource (`kind` is the resource's plural, as the
/// apiserver puts it in most errors).
pub fn details(name: &str, group: &str, kind: &str) -> Details {
    Details::of(name, group, kind)
}

/// `resource "name"` or `resource.group "name"` as errors name an object.
fn qualified(resource: &str, group: &str) -> String {
    if group.is_empty() {
        resource.to_string()
    } else {
        format!("{resource}.{group}")
    }
}

/// 401 Unauthorized.
pub fn unauthorized() -> ApiError {
    ApiError::new(401, "Unauthorized", "Unauthorized".into(), None)
}

/// 404 for an object.
pub fn not_found(resource: &str, group: &str, name: &str) -> ApiError {
    ApiError::new(
        404,
        "NotFound",
        format!("{} \"{name}\" not found", qualified(resource, group)),
        Some(details(name, group, resource)),
    )
}

/// 404 for a path the server does not serve.
pub fn path_not_found() -> ApiError {
    ApiError::new(
        404,
        "NotFound",
        "the server could not find the requested resource".into(),
        Some(Details::default()),
    )
}

/// 409 AlreadyExists.
pub fn already_exists(resource: &str, group: &str, name: &str) -> ApiError {
    ApiError::new(
        409,
        "AlreadyExists",
        format!("{} \"{name}\" already exists", qualified(resource, group)),
        Some(details(name, group, resource)),
    )
}

/// 409 Conflict on a stale resourceVersion.
pub fn conflict(resource: &str, group: &str, name: &str) -> ApiError {
    ApiError::new(
        409,
        "Conflict",
        format!(
            "Operation cannot be fulfilled on {} \"{name}\": the object has been modified; please apply your changes to the latest version and try again",
            qualified(resource, group)
        ),
        Some(details(name, group, resource)),
    )
}

/// 410 for a continue token older than the retained history, carrying the token that
/// continues from `start` at the latest version (`rv: -1`), as the apiserver's
/// `handleCompactedErrorForPaging` hands it out.
pub fn continue_expired(start: &str) -> ApiError {
    let mut error = ApiError::new(
        410,
        "Expired",
        "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter, or use the continue token in this response to retrieve the remainder of the results. Continuing with the provided token results in an inconsistent list - objects that were created, modified, or deleted between the time the first chunk was returned and now may show up in the list.".into(),
        None,
    );
    error.status.metadata.continue_token = Some(continue_token::encode(-1, start));
    error
}

/// 410 for an exact LIST at a resourceVersion older than the retained history.
pub fn list_rv_expired() -> ApiError {
    ApiError::new(
        410,
        "Expired",
        "The resourceVersion for the provided list is too old.".into(),
        None,
    )
}

/// The 410 `Status` sent in a watch `ERROR` event.
pub fn watch_expired(requested: u64, oldest: u64) -> ApiError {
    ApiError::new(
        410,
        "Expired",
        format!("too old resource version: {requested} ({oldest})"),
        None,
    )
}

/// 504 for a resourceVersion the server has not reached within its wait.
pub fn rv_too_large() -> ApiError {
    ApiError::new(
        504,
        "Timeout",
        "Too large resource version".into(),
        Some(Details {
            causes: vec![Cause {
                reason: "ResourceVersionTooLarge".into(),
                message: "Too large resource version".into(),
                field: String::new(),
            }],
            retry_after_seconds: Some(1),
            ..Details::default()
        }),
    )
}

/// 400 BadRequest.
pub fn bad_request(message: String) -> ApiError {
    ApiError::new(400, "BadRequest", message, None)
}

/// 405 MethodNotAllowed.
pub fn method_not_allowed() -> ApiError {
    ApiError::new(
        405,
        "MethodNotAllowed",
        "the server does not allow this method on the requested resource".into(),
        Some(Details::default()),
    )
}

/// 415 UnsupportedMediaType.
pub fn unsupported_media_type(ct: &str) -> ApiError {
    ApiError::new(
        415,
        "UnsupportedMediaType",
        format!(
            "the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/strategic-merge-patch+json (got {ct})"
        ),
        None,
    )
}

/// 422 Invalid with one cause.
pub fn invalid(
    kind: &str,
    group: &str,
    name: &str,
    field: &str,
    cause_reason: &str,
    detail: &str,
) -> ApiError {
    let kq = if group.is_empty() {
        kind.to_string()
    } else {
        format!("{kind}.{group}")
    };
    let mut d = details(name, group, kind);
    d.causes = vec![Cause {
        reason: cause_reason.into(),
        message: detail.into(),
        field: field.into(),
    }];
    ApiError::new(
        422,
        "Invalid",
        format!("{kq} \"{name}\" is invalid: {field}: {detail}"),
        Some(d),
    )
}

/// The 5xx (or other) failure a faulted replica answers with.
pub fn injected(code: u16) -> ApiError {
    let (reason, message) = match code {
        500 => ("InternalError", "Internal error occurred: injected fault".to_string()),
        503 => ("ServiceUnavailable", "The server is currently unable to handle the request".to_string()),
        504 => ("Timeout", "The server was unable to return a response in the time allotted, but may still be processing the request".to_string()),
        _ => ("InternalError", format!("Internal error occurred: injected fault {code}")),
    };
    ApiError::new(code, reason, message, Some(Details::default()))
}

/// Key order of the apiserver's Go structs, for objects the simulator builds itself.
const GLOBAL_ORDER: &[&str] = &[
    "type",
    "kind",
    "apiVersion",
    "metadata",
    "name",
    "singularName",
    "namespaced",
    "groupVersion",
    "version",
    "versions",
    "preferredVersion",
    "serverAddressByClientCIDRs",
    "clientCIDR",
    "serverAddress",
    "resources",
    "verbs",
    "shortNames",
    "storageVersionHash",
    "object",
    "spec",
    "status",
    "authenticated",
    "allowed",
    "denied",
    "userInfo",
    "user",
    "username",
    "uid",
    "groups",
    "extra",
    "audiences",
    "message",
    "reason",
    "details",
    "code",
    "major",
    "minor",
    "emulationMajor",
    "emulationMinor",
    "minCompatibilityMajor",
    "minCompatibilityMinor",
    "gitVersion",
    "gitCommit",
    "gitTreeState",
    "buildDate",
    "goVersion",
    "compiler",
    "platform",
];

fn order_for(parent: &str) -> &'static [&'static str] {
    match parent {
        "details" => &[
            "name",
            "group",
            "kind",
            "uid",
            "causes",
            "retryAfterSeconds",
        ],
        "causes" => &["reason", "message", "field"],
        "resources" => &[
            "name",
            "singularName",
            "namespaced",
            "group",
            "version",
            "kind",
            "verbs",
            "shortNames",
            "categories",
            "storageVersionHash",
        ],
        _ => GLOBAL_ORDER,
    }
}

fn write_ordered(out: &mut Vec<u8>, v: &Value, parent: &str) {
    match v {
        Value::Object(m) => {
            let order = order_for(parent);
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort_by_key(|k| {
                (
                    order.iter().position(|o| o == k).unwrap_or(usize::MAX),
                    k.as_str(),
                )
            });
            out.push(b'{');
            for (i, k) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                // Encoding a string into a Vec cannot fail.
                let _ = serde_json::to_writer(&mut *out, k);
                out.push(b':');
                write_ordered(out, &m[k], k);
            }
            out.push(b'}');
        }
        Value::Array(a) => {
            out.push(b'[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_ordered(out, x, parent);
            }
            out.push(b']');
        }
        other => {
            let _ = serde_json::to_writer(&mut *out, other);
        }
    }
}

/// Encodes a built object with the apiserver's field order and trailing newline.
pub fn to_ordered_bytes(v: &Value) -> Vec<u8> {
    let mut out = Vec::with_capacity(256);
    write_ordered(&mut out, v, "");
    out.push(b'\n');
    out
}

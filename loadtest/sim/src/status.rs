//! Kubernetes `Status` error bodies, worded as the apiserver words them.

use serde_json::{Value, json};

/// A `Status` failure: HTTP code plus the JSON body the apiserver would send.
#[derive(Clone, Debug)]
pub struct ApiError {
    /// HTTP status code.
    pub code: u16,
    /// The `Status` object.
    pub body: Value,
}

impl ApiError {
    /// A failure `Status` with the given fields; `details` is omitted when `None`.
    pub fn new(code: u16, reason: &str, message: String, details: Option<Value>) -> ApiError {
        let mut body = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": message,
            "reason": reason,
        });
        if let Some(d) = details {
            body["details"] = d;
        }
        body["code"] = json!(code);
        ApiError { code, body }
    }

    /// The body, encoded.
    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(&self.body).unwrap_or_default()
    }
}

/// `details` for a named object of a resource (`kind` is the resource's plural, as the
/// apiserver puts it in most errors).
pub fn details(name: &str, group: &str, kind: &str) -> Value {
    let mut d = serde_json::Map::new();
    if !name.is_empty() {
        d.insert("name".into(), json!(name));
    }
    if !group.is_empty() {
        d.insert("group".into(), json!(group));
    }
    d.insert("kind".into(), json!(kind));
    Value::Object(d)
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
        Some(json!({})),
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

/// 410 for a continue token older than the retained history.
pub fn continue_expired() -> ApiError {
    ApiError::new(
        410,
        "Expired",
        "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter, or use the continue token in this response to retrieve the remainder of the results. Continuing with the provided token results in an inconsistent list - objects that were created, modified, or deleted between the time the first chunk was returned and now may show up in the list.".into(),
        None,
    )
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
        Some(
            json!({"causes": [{"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}], "retryAfterSeconds": 1}),
        ),
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
        Some(json!({})),
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
    d["causes"] = json!([{"reason": cause_reason, "message": detail, "field": field}]);
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
        429 => ("TooManyRequests", "Too many requests, please try again later.".to_string()),
        500 => ("InternalError", "Internal error occurred: injected fault".to_string()),
        503 => ("ServiceUnavailable", "The server is currently unable to handle the request".to_string()),
        504 => ("Timeout", "The server was unable to return a response in the time allotted, but may still be processing the request".to_string()),
        _ => ("InternalError", format!("Internal error occurred: injected fault {code}")),
    };
    ApiError::new(code, reason, message, Some(json!({})))
}

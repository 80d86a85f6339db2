//! The `Status` object: the body of every error an apiserver answers, and of a watch's
//! `ERROR` event. Serialized with the fields in the order of apimachinery's Go structs
//! (`metav1.Status`, `StatusDetails`, `StatusCause`, `ListMeta`), so that a body written
//! here is byte for byte the body kube-apiserver writes for the same failure.

use serde::Serialize;

/// `Status.status` of a failure.
pub const FAILURE: &str = "Failure";
/// `Status.status` of a success (a delete that completed at once).
pub const SUCCESS: &str = "Success";

/// A `metav1.Status`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Status {
    kind: &'static str,
    #[serde(rename = "apiVersion")]
    api_version: &'static str,
    /// The list metadata: empty but for the continue token of a compacted list.
    pub metadata: ListMeta,
    /// [`FAILURE`] or [`SUCCESS`].
    pub status: &'static str,
    /// What a person reads.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub message: String,
    /// The machine-readable reason (`Forbidden`, `NotFound`, `TooManyRequests`…).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub reason: String,
    /// What the failure is about; `Some(Details::default())` writes `"details":{}` as the
    /// apiserver does for some errors.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub details: Option<Details>,
    /// The HTTP status code (absent, as in Go, when 0).
    #[serde(skip_serializing_if = "is_zero")]
    pub code: u16,
}

fn is_zero(code: &u16) -> bool {
    *code == 0
}

/// A `metav1.ListMeta` as a `Status` carries it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ListMeta {
    /// The token that continues a list whose own token was compacted away.
    #[serde(rename = "continue", skip_serializing_if = "Option::is_none")]
    pub continue_token: Option<String>,
}

/// A `metav1.StatusDetails`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Details {
    /// The object's name.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub name: String,
    /// Its API group.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub group: String,
    /// Its kind; the apiserver writes the resource (`secrets`) here in most errors.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub kind: String,
    /// Its UID (a delete's success).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub uid: String,
    /// The causes, one per invalid field.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub causes: Vec<Cause>,
    /// Seconds to wait before retrying.
    #[serde(rename = "retryAfterSeconds", skip_serializing_if = "Option::is_none")]
    pub retry_after_seconds: Option<u64>,
}

impl Details {
    /// The details of a named object of a resource.
    pub fn of(name: &str, group: &str, resource: &str) -> Details {
        Details {
            name: name.to_owned(),
            group: group.to_owned(),
            kind: resource.to_owned(),
            ..Details::default()
        }
    }
}

/// A `metav1.StatusCause`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Cause {
    /// Machine-readable reason (`FieldValueInvalid`, `ResourceVersionTooLarge`…).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub reason: String,
    /// What a person reads.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub message: String,
    /// The field it is about.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub field: String,
}

impl Status {
    /// A failure with its HTTP code, reason and message.
    pub fn failure(
        code: u16,
        reason: &str,
        message: impl Into<String>,
        details: Option<Details>,
    ) -> Status {
        Status {
            kind: "Status",
            api_version: "v1",
            metadata: ListMeta::default(),
            status: FAILURE,
            message: message.into(),
            reason: reason.to_owned(),
            details,
            code,
        }
    }

    /// The success a completed delete answers with: no message, no reason, no code.
    pub fn success(details: Details) -> Status {
        Status {
            status: SUCCESS,
            code: 0,
            ..Status::failure(0, "", "", Some(details))
        }
    }

    /// The body, without a trailing newline.
    pub fn to_bytes(&self) -> Vec<u8> {
        // Plain strings, numbers and options: serializing cannot fail.
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// The body as an apiserver sends it, ending with a newline.
    pub fn to_body(&self) -> Vec<u8> {
        let mut bytes = self.to_bytes();
        bytes.push(b'\n');
        bytes
    }

    /// The watch `ERROR` event that carries this status, as one line.
    pub fn error_event(&self) -> Vec<u8> {
        let mut line = br#"{"type":"ERROR","object":"#.to_vec();
        line.extend_from_slice(&self.to_bytes());
        line.extend_from_slice(b"}\n");
        line
    }
}

/// `secrets "x"`, or `endpointslices.discovery.k8s.io` with no name: how the apiserver
/// names the target of a request in its messages.
pub fn qualified(group: &str, resource: &str, name: &str) -> String {
    let resource = if group.is_empty() {
        resource.to_owned()
    } else {
        format!("{resource}.{group}")
    };
    if name.is_empty() {
        resource
    } else {
        format!("{resource} \"{name}\"")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_forbidden_is_byte_for_byte_the_apiservers() {
        // As kube-apiserver v1.36 writes it (fixtures/kube-apiserver-v1.36).
        let status = Status::failure(
            403,
            "Forbidden",
            r#"secrets "a" is forbidden: User "u" cannot get resource "secrets" in API group "" in the namespace "ns""#,
            Some(Details::of("a", "", "secrets")),
        );
        assert_eq!(
            String::from_utf8(status.to_body()).unwrap(),
            concat!(
                r#"{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","#,
                r#""message":"secrets \"a\" is forbidden: User \"u\" cannot get resource \"secrets\" in API group \"\" in the namespace \"ns\"","#,
                r#""reason":"Forbidden","details":{"name":"a","kind":"secrets"},"code":403}"#,
                "\n"
            )
        );
    }

    #[test]
    fn empty_details_a_continue_and_causes_keep_the_go_field_order() {
        let mut status = Status::failure(
            504,
            "Timeout",
            "Too large resource version",
            Some(Details {
                causes: vec![Cause {
                    reason: "ResourceVersionTooLarge".into(),
                    message: "Too large resource version".into(),
                    field: String::new(),
                }],
                retry_after_seconds: Some(1),
                ..Details::default()
            }),
        );
        status.metadata.continue_token = Some("abc".into());
        assert_eq!(
            String::from_utf8(status.to_bytes()).unwrap(),
            concat!(
                r#"{"kind":"Status","apiVersion":"v1","metadata":{"continue":"abc"},"status":"Failure","#,
                r#""message":"Too large resource version","reason":"Timeout","details":{"causes":"#,
                r#"[{"reason":"ResourceVersionTooLarge","message":"Too large resource version"}],"#,
                r#""retryAfterSeconds":1},"code":504}"#
            )
        );
        let not_found = Status::failure(
            404,
            "NotFound",
            "the server could not find the requested resource",
            Some(Details::default()),
        );
        assert!(
            String::from_utf8(not_found.to_bytes())
                .unwrap()
                .ends_with(r#""reason":"NotFound","details":{},"code":404}"#)
        );
    }

    #[test]
    fn a_success_has_no_message_reason_or_code() {
        let status = Status::success(Details {
            uid: "u-1".into(),
            ..Details::of("a", "", "secrets")
        });
        assert_eq!(
            String::from_utf8(status.to_bytes()).unwrap(),
            r#"{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Success","details":{"name":"a","kind":"secrets","uid":"u-1"}}"#
        );
    }

    #[test]
    fn an_error_event_wraps_the_status() {
        let status = Status::failure(410, "Expired", "too old resource version: 1 (5)", None);
        let line = String::from_utf8(status.error_event()).unwrap();
        assert!(line.starts_with(r#"{"type":"ERROR","object":{"kind":"Status""#));
        assert!(line.ends_with("\"code\":410}}\n"));
    }

    #[test]
    fn targets_are_named_as_the_apiserver_names_them() {
        assert_eq!(qualified("", "secrets", "a"), r#"secrets "a""#);
        assert_eq!(
            qualified("discovery.k8s.io", "endpointslices", ""),
            "endpointslices.discovery.k8s.io"
        );
    }
}

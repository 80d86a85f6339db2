//! The audit log of reads Bulwark answers itself: `audit.k8s.io/v1` Event JSON lines.
//!
//! The apiserver never sees a read the cache answers, so its audit log cannot hold it;
//! for Secrets that gap matters, and Bulwark writes the line the apiserver would have.

use std::io::Write;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use serde_json::json;

use crate::identity::User;

/// An append-only file of audit events, one JSON object per line. Cheap to clone.
#[derive(Clone)]
pub struct AuditLog {
    file: Arc<Mutex<std::fs::File>>,
}

/// One audited read.
#[derive(Debug, Clone)]
pub struct Record<'a> {
    /// The request's `Audit-Id`.
    pub audit_id: &'a str,
    /// Path and query as received.
    pub request_uri: &'a str,
    /// `get`, `list` or `watch`.
    pub verb: &'a str,
    /// Who read.
    pub user: &'a User,
    /// What: resource, namespace, name, group, version.
    pub resource: &'a str,
    /// Namespace, if any.
    pub namespace: Option<&'a str>,
    /// Name, if any.
    pub name: Option<&'a str>,
    /// API group.
    pub group: &'a str,
    /// API version.
    pub version: &'a str,
    /// The status answered.
    pub code: u16,
    /// `User-Agent`.
    pub user_agent: Option<&'a str>,
}

impl AuditLog {
    /// Opens (creating) the file for appending.
    pub fn open(path: &Path) -> std::io::Result<AuditLog> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        Ok(AuditLog {
            file: Arc::new(Mutex::new(file)),
        })
    }

    /// Appends one event. A failure to write is logged, not returned: the read was
    /// already authorized by the apiserver's own review.
    pub fn write(&self, record: &Record<'_>) {
        let line = event(record);
        let mut file = self.file.lock().unwrap_or_else(|p| p.into_inner());
        // One write per line, to a file opened for appending: lines never interleave.
        if let Err(e) = file.write_all(&line) {
            tracing::error!(error = %e, "writing the audit log");
        }
    }
}

/// The `audit.k8s.io/v1` Event of a record, with its newline.
fn event(r: &Record<'_>) -> Vec<u8> {
    let now = rfc3339_micros(SystemTime::now());
    let mut user = json!({"username": r.user.username, "groups": r.user.groups});
    if let Some(uid) = &r.user.uid {
        user["uid"] = json!(uid);
    }
    if !r.user.extra.is_empty() {
        user["extra"] = json!(r.user.extra);
    }
    let mut object = json!({"resource": r.resource, "apiVersion": r.version});
    if !r.group.is_empty() {
        object["apiGroup"] = json!(r.group);
    }
    if let Some(ns) = r.namespace {
        object["namespace"] = json!(ns);
    }
    if let Some(name) = r.name {
        object["name"] = json!(name);
    }
    let mut value = json!({
        "kind": "Event",
        "apiVersion": "audit.k8s.io/v1",
        "level": "Metadata",
        "auditID": r.audit_id,
        "stage": if r.verb == "watch" { "ResponseStarted" } else { "ResponseComplete" },
        "requestURI": r.request_uri,
        "verb": r.verb,
        "user": user,
        "sourceIPs": [],
        "objectRef": object,
        "responseStatus": {"metadata": {}, "code": r.code},
        "requestReceivedTimestamp": now,
        "stageTimestamp": now,
        "annotations": {"bulwark.io/served-by": "cache"},
    });
    if let Some(agent) = r.user_agent {
        value["userAgent"] = json!(agent);
    }
    let mut line = serde_json::to_vec(&value).unwrap_or_default();
    line.push(b'\n');
    line
}

/// A new `Audit-Id`: a random RFC 4122 version 4 UUID.
pub fn new_audit_id() -> String {
    uuid::Uuid::new_v4().to_string()
}

/// `2026-06-15T04:14:53.123456Z`.
fn rfc3339_micros(at: SystemTime) -> String {
    humantime::format_rfc3339_micros(at).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, UNIX_EPOCH};

    #[test]
    fn an_event_line_names_user_verb_object_and_audit_id() {
        let user = User {
            username: "alice".into(),
            groups: vec!["dev".into(), "system:authenticated".into()],
            ..User::default()
        };
        let line = event(&Record {
            audit_id: "id-1",
            request_uri: "/api/v1/namespaces/ns/secrets/a",
            verb: "get",
            user: &user,
            resource: "secrets",
            namespace: Some("ns"),
            name: Some("a"),
            group: "",
            version: "v1",
            code: 200,
            user_agent: None,
        });
        assert_eq!(line.last(), Some(&b'\n'));
        let v: serde_json::Value = serde_json::from_slice(&line).unwrap();
        assert_eq!(v["apiVersion"], "audit.k8s.io/v1");
        assert_eq!(v["kind"], "Event");
        assert_eq!(v["auditID"], "id-1");
        assert_eq!(v["user"]["username"], "alice");
        assert_eq!(v["verb"], "get");
        assert_eq!(v["objectRef"]["name"], "a");
        assert_eq!(v["responseStatus"]["code"], 200);
    }

    #[test]
    fn timestamps_and_ids_have_their_formats() {
        let at = UNIX_EPOCH + Duration::from_micros(1_781_497_693_000_123);
        assert_eq!(rfc3339_micros(at), "2026-06-15T04:28:13.000123Z");
        let id = new_audit_id();
        assert_eq!(id.len(), 36);
        assert_eq!(&id[14..15], "4");
    }
}

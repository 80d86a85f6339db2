//! The audit log of reads Bulwark answers itself: `audit.k8s.io/v1` Event JSON lines.
//!
//! The apiserver never sees a read the cache answers, so its audit log cannot hold it;
//! for Secrets that gap matters, and Bulwark writes the line the apiserver would have.

use std::net::IpAddr;
use std::path::Path;
use std::time::SystemTime;

use serde_json::json;

use crate::logs::rotate::{Limits, LineFile};
use crate::metrics::Metrics;
use crate::user::User;

/// A file of audit events, one JSON object per line, rotated by size
/// ([`crate::logs::rotate`]). Cheap to clone.
#[derive(Clone)]
pub struct AuditLog {
    file: LineFile,
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
    /// The client's addresses, as [`source_ips`] gives them.
    pub source_ips: &'a [String],
}

impl AuditLog {
    /// Opens (creating) the file for appending, rotated within `limits`; lines that cannot
    /// be written are counted as `bulwark_log_lines_dropped_total{log="audit"}`.
    pub fn open(path: &Path, limits: Limits, metrics: &Metrics) -> std::io::Result<AuditLog> {
        Ok(AuditLog {
            file: LineFile::open(path, limits, "audit", metrics)?,
        })
    }

    /// Queues one event for the log's writer thread. A line that cannot be written is
    /// counted and logged, not returned: the read was already authorized by the apiserver's
    /// own review.
    pub fn write(&self, record: &Record<'_>) {
        self.file.write_line(event(record));
    }

    /// The file the events go to, for SIGHUP's reopen and for flushing at shutdown.
    pub fn file(&self) -> &LineFile {
        &self.file
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
        // A watch that streams is audited when its response starts; a refused one is complete.
        "stage": if r.verb == "watch" && r.code < 300 { "ResponseStarted" } else { "ResponseComplete" },
        "requestURI": r.request_uri,
        "verb": r.verb,
        "user": user,
        "sourceIPs": r.source_ips,
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

/// The `sourceIPs` the apiserver would record for a request from `peer` with these
/// headers (`utilnet.SourceIPs`): every address in `X-Forwarded-For`, then `X-Real-Ip`
/// unless already there, then the peer unless it is the last one.
pub fn source_ips(headers: &http::HeaderMap, peer: Option<IpAddr>) -> Vec<String> {
    let parse = |text: &str| {
        text.trim()
            .parse::<IpAddr>()
            .ok()
            .map(|ip| ip.to_canonical())
    };
    let mut ips: Vec<IpAddr> = headers
        .get("x-forwarded-for")
        .and_then(|v| v.to_str().ok())
        .map(|list| list.split(',').filter_map(parse).collect())
        .unwrap_or_default();
    if let Some(real) = headers
        .get("x-real-ip")
        .and_then(|v| v.to_str().ok())
        .and_then(parse)
        && !ips.contains(&real)
    {
        ips.push(real);
    }
    if let Some(peer) = peer.map(|p| p.to_canonical())
        && ips.last() != Some(&peer)
    {
        ips.push(peer);
    }
    ips.iter().map(IpAddr::to_string).collect()
}

/// A new `Audit-Id`: a random RFC 4122 version 4 UUID.
pub fn new_audit_id() -> String {
    new_uuid().to_string()
}

/// A random RFC 4122 version 4 UUID from the thread's own generator (seeded from the OS,
/// reseeded as it goes), not `Uuid::new_v4`, which asks the kernel for every one: a
/// `getrandom` call per request.
pub fn new_uuid() -> uuid::Uuid {
    uuid::Builder::from_random_bytes(rand::random()).into_uuid()
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
            source_ips: &["10.0.0.7".into()],
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
        assert_eq!(v["sourceIPs"], serde_json::json!(["10.0.0.7"]));
    }

    #[test]
    fn source_ips_are_the_forwarded_chain_then_the_peer() {
        let peer = Some("::ffff:192.0.2.9".parse().unwrap());
        assert_eq!(source_ips(&http::HeaderMap::new(), peer), ["192.0.2.9"]);
        let mut headers = http::HeaderMap::new();
        headers.insert(
            "x-forwarded-for",
            "10.1.1.1, bogus, 10.2.2.2".parse().unwrap(),
        );
        headers.insert("x-real-ip", "10.1.1.1".parse().unwrap());
        assert_eq!(
            source_ips(&headers, peer),
            ["10.1.1.1", "10.2.2.2", "192.0.2.9"]
        );
        headers.insert("x-real-ip", "10.3.3.3".parse().unwrap());
        headers.insert("x-forwarded-for", "192.0.2.9".parse().unwrap());
        // The peer is left out only when it is the last address already.
        assert_eq!(
            source_ips(&headers, peer),
            ["192.0.2.9", "10.3.3.3", "192.0.2.9"]
        );
        headers.remove("x-real-ip");
        assert_eq!(source_ips(&headers, peer), ["192.0.2.9"]);
        assert!(source_ips(&http::HeaderMap::new(), None).is_empty());
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

//! Probe kubelets: nodes nobody but their probe speaks for, each renewing its own Lease and
//! reporting itself Ready as a kubelet does, through the front door as
//! `system:node:<name>`, timing every renewal at the client.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use http::Method;
use serde_json::{Value, json};

use crate::client::{ClassStats, Read, Target};
use crate::controlplane::{ControlPlane, NODE_LEASE_SECONDS, kwok_node};

/// The name of probe node `i`.
pub(super) fn probe_name(i: usize) -> String {
    format!("probe-node-{i}")
}

/// A node nobody but its probe speaks for: not KWOK's, and tainted so that no pod lands
/// on it.
pub(super) fn probe_node(name: &str) -> Value {
    let mut node = kwok_node(name);
    node["metadata"]["annotations"] = json!({"node.alpha.kubernetes.io/ttl": "0"});
    node["metadata"]["labels"]["type"] = json!("probe");
    node["spec"]["taints"] = json!([{"key": "bulwark.dev/probe", "effect": "NoSchedule"}]);
    node
}

/// One probe per probe node, as `system:node:<name>` in `system:nodes`: it renews the
/// node's Lease every quarter of its duration and reports the node Ready every minute,
/// as a kubelet does, and times each renewal at the client. A failed renewal is retried
/// after client-go's back-off. The probes run until `stop` turns true. `slowest` keeps the
/// longest renewal (µs, answered or not) since the sampler last took it.
pub(super) fn start_probes(
    cp: &ControlPlane,
    target: &Target,
    probes: usize,
    stats: &Arc<ClassStats>,
    slowest: &Arc<AtomicU64>,
    stop: tokio::sync::watch::Receiver<bool>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let renew_every = Duration::from_secs(u64::from(NODE_LEASE_SECONDS) / 4);
    (0..probes)
        .filter_map(|i| {
            let name = probe_name(i);
            let mut client = super::node_client(cp, target, &name)?;
            let stats = stats.clone();
            let slowest = slowest.clone();
            let mut stop = stop.clone();
            Some(tokio::spawn(async move {
                let mut tally = stats.tally();
                let mut reported: Option<Instant> = None;
                let lease = format!(
                    "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{name}"
                );
                let status = format!("/api/v1/nodes/{name}/status");
                while !*stop.borrow() {
                    if reported.is_none_or(|at| at.elapsed() >= Duration::from_secs(60)) {
                        let body = ready_patch(SystemTime::now());
                        let outcome = client
                            .call(
                                Method::PATCH,
                                &status,
                                Some((body, "application/strategic-merge-patch+json")),
                                Read::Count,
                                Duration::from_secs(10),
                            )
                            .await;
                        if matches!(outcome, crate::client::Outcome::Ok { .. }) {
                            reported = Some(Instant::now());
                        }
                    }
                    let body = renew_patch(&name, SystemTime::now());
                    let sent = Instant::now();
                    let outcome = client
                        .call(
                            Method::PATCH,
                            &lease,
                            Some((body, "application/merge-patch+json")),
                            Read::Count,
                            Duration::from_secs(10),
                        )
                        .await;
                    let took = u64::try_from(sent.elapsed().as_micros()).unwrap_or(u64::MAX);
                    slowest.fetch_max(took, Ordering::Relaxed);
                    let pause = match tally.record(&outcome) {
                        Duration::ZERO if matches!(outcome, crate::client::Outcome::Ok { .. }) => {
                            renew_every
                        }
                        pause => pause.max(Duration::from_millis(200)),
                    };
                    let _ = tokio::time::timeout(pause, stop.changed()).await;
                }
                stats.done(tally);
            }))
        })
        .collect()
}

/// A Lease renewal as a merge patch: `renewTime` now.
fn renew_patch(node: &str, now: SystemTime) -> Bytes {
    Bytes::from(
        json!({"spec": {
            "holderIdentity": node,
            "leaseDurationSeconds": NODE_LEASE_SECONDS,
            "renewTime": humantime::format_rfc3339_micros(now).to_string(),
        }})
        .to_string(),
    )
}

/// A node status report as a strategic merge patch: Ready, heartbeat now.
fn ready_patch(now: SystemTime) -> Bytes {
    let at = humantime::format_rfc3339_seconds(now).to_string();
    Bytes::from(
        json!({"status": {"conditions": [{
            "type": "Ready",
            "status": "True",
            "reason": "KubeletReady",
            "message": "the probe reports its node Ready",
            "lastHeartbeatTime": at,
            "lastTransitionTime": at,
        }]}})
        .to_string(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_probe_patches_are_what_a_kubelet_sends() {
        let at = SystemTime::UNIX_EPOCH + Duration::from_micros(1_800_000_000_123_456);
        let renew: Value = serde_json::from_slice(&renew_patch("probe-node-0", at)).unwrap();
        assert_eq!(renew["spec"]["renewTime"], "2027-01-15T08:00:00.123456Z");
        assert_eq!(renew["spec"]["holderIdentity"], "probe-node-0");
        let ready: Value = serde_json::from_slice(&ready_patch(at)).unwrap();
        assert_eq!(ready["status"]["conditions"][0]["type"], "Ready");
        assert_eq!(
            ready["status"]["conditions"][0]["lastHeartbeatTime"],
            "2027-01-15T08:00:00Z"
        );
        let node = probe_node("probe-node-0");
        assert!(
            node["metadata"]["annotations"]
                .get(crate::controlplane::KWOK_ANNOTATION)
                .is_none(),
            "KWOK leaves it alone"
        );
        assert_eq!(node["spec"]["taints"][0]["effect"], "NoSchedule");
    }
}

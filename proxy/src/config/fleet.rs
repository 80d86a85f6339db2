//! The `fleet` section: membership of the fleet of Bulwark replicas through Leases.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::problems::Problems;
use super::values::is_dns_label;

/// Membership of the fleet of Bulwark replicas through `coordination.k8s.io/v1` Leases:
/// each replica renews its own Lease with its recent demand, and the apiservers' LIST byte
/// budgets and the levels' seats are split among the live ones by that demand.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Fleet {
    /// Namespace of the Leases (Bulwark's own). Required.
    pub namespace: String,
    /// Every replica's Lease is named this prefix followed by its identity; the members
    /// are the unexpired Leases with the prefix.
    #[serde(default = "default_lease_prefix")]
    pub lease_prefix: String,
    /// This replica's identity in the fleet (a DNS label); default: the `POD_NAME`
    /// environment variable, else the host name.
    #[serde(default)]
    pub identity: Option<String>,
    /// How often the Lease is renewed and the others' read.
    #[serde(default = "default_renew_interval", with = "humantime_serde")]
    pub renew_interval: Duration,
    /// How long a Lease not renewed counts as a member (whole seconds, at least twice
    /// `renewInterval`): the time a stopped replica's share stays away.
    #[serde(default = "default_lease_duration", with = "humantime_serde")]
    pub lease_duration: Duration,
    /// File of the fleet's HMAC keys, one a line, each at least 32 bytes (mounted from a
    /// Secret only Bulwark's ServiceAccount may read): every Lease is signed with the
    /// first, and a Lease no key verifies does not count. Read at start and every renew
    /// period; list a new key second everywhere before moving it first. Default: none,
    /// and Leases are unauthenticated: anyone who may write Leases in the namespace can
    /// shrink the fleet's shares (deploy/README.md).
    #[serde(default)]
    pub key_file: Option<PathBuf>,
    /// With `keyFile`: sign this replica's Lease but also count Leases with no MAC (one with
    /// a wrong MAC is still rejected). Only for turning the key on: set it with `keyFile`,
    /// and once every replica runs with both, remove it; otherwise the replicas that have
    /// the key reject the Leases of those that do not yet, and take their shares. Default:
    /// false.
    #[serde(default)]
    pub accept_unsigned: bool,
    /// Publish the `kubernetes` Service's endpoints (`default/kubernetes` EndpointSlices and
    /// Endpoints), so that pods dialing the Service reach the apiservers through the live
    /// replicas, and the apiservers themselves when none is live (DESIGN.md "In-cluster
    /// clients"). Needs `keyFile` without `acceptUnsigned`: only a signed Lease may put an
    /// address behind the Service every pod dials. Default: not published.
    #[serde(default)]
    pub kubernetes_service: Option<KubernetesService>,
}

/// The `kubernetes` Service's endpoints as the fleet publishes them.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct KubernetesService {
    /// The address pods dial for this replica: its pod or host IP and the port it listens
    /// on. Absent on `bulwark guard`, which publishes the others' and serves nothing.
    #[serde(default)]
    pub endpoint: Option<SocketAddr>,
    /// The apiservers' advertised addresses (`--advertise-address:--secure-port`):
    /// published as serving-but-terminating, which kube-proxy uses only while no replica is
    /// ready, so pods reach the apiservers directly when no Bulwark is live.
    pub apiservers: Vec<SocketAddr>,
    /// The Service's ClusterIP (`KUBERNETES_SERVICE_HOST`: the first address of the
    /// apiservers' `--service-cluster-ip-range`), which `check-config` wants in the serving
    /// certificate. Default: 10.96.0.1, kubeadm's.
    #[serde(default = "default_service_ip", rename = "serviceIP")]
    pub service_ip: std::net::IpAddr,
    /// The cluster's DNS domain, for the name `kubernetes.default.svc.DOMAIN`. Default:
    /// `cluster.local`.
    #[serde(default = "default_cluster_domain")]
    pub cluster_domain: String,
}

fn default_service_ip() -> std::net::IpAddr {
    std::net::Ipv4Addr::new(10, 96, 0, 1).into()
}

fn default_cluster_domain() -> String {
    "cluster.local".into()
}

fn default_lease_prefix() -> String {
    "bulwark-".into()
}
fn default_renew_interval() -> Duration {
    Duration::from_secs(2)
}
fn default_lease_duration() -> Duration {
    Duration::from_secs(10)
}

impl Fleet {
    pub(super) fn validate(&self, p: &mut Problems) {
        let fleet = self;
        if !is_dns_label(&fleet.namespace) {
            p.add(
                "fleet.namespace",
                format!(
                    "{:?} is not a namespace name (a DNS label)",
                    fleet.namespace
                ),
            );
        }
        let prefix_ok = fleet.lease_prefix.len() < 63
            && fleet
                .lease_prefix
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
            && !fleet.lease_prefix.starts_with(['-', '.']);
        if !prefix_ok {
            p.add(
            "fleet.leasePrefix",
            format!(
                "{:?} must be lower-case letters, digits, '-' and '.', shorter than 63, not starting with '-' or '.'",
                fleet.lease_prefix
            ),
        );
        }
        if let Some(identity) = &fleet.identity
            && !is_dns_label(identity)
        {
            p.add("fleet.identity", format!("{identity:?} is not a DNS label"));
        }
        if let Some(key_file) = &fleet.key_file {
            p.path("fleet.keyFile", key_file);
        } else if fleet.accept_unsigned {
            p.add(
                "fleet.acceptUnsigned",
                "needs fleet.keyFile: without a key every Lease is unsigned",
            );
        }
        if let Some(service) = &fleet.kubernetes_service {
            if fleet.key_file.is_none() || fleet.accept_unsigned {
                p.add(
                    "fleet.kubernetesService",
                    "needs fleet.keyFile and no fleet.acceptUnsigned: an unsigned Lease could put \
                 any address behind the Service every pod dials",
                );
            }
            if service.apiservers.is_empty() {
                p.add(
                    "fleet.kubernetesService.apiservers",
                    "needs the apiservers' advertised addresses: without them no Bulwark live \
                 leaves pods no endpoint",
                );
            }
            if service.endpoint.is_some_and(|e| e.ip().is_unspecified()) {
                p.add(
                    "fleet.kubernetesService.endpoint",
                    "must be an address pods can dial, not 0.0.0.0 or ::",
                );
            }
        }
        p.positive("fleet.renewInterval", fleet.renew_interval);
        let duration = fleet.lease_duration;
        if duration.subsec_nanos() != 0 || duration.as_secs() == 0 || duration.as_secs() > 3600 {
            p.add(
                "fleet.leaseDuration",
                "must be whole seconds, from 1s to 1h (a Lease counts in seconds)",
            );
        } else if duration < fleet.renew_interval * 2 {
            p.add(
            "fleet.leaseDuration",
            format!(
                "{} is shorter than twice fleet.renewInterval ({}): one late renewal would drop the replica",
                humantime::format_duration(duration),
                humantime::format_duration(fleet.renew_interval)
            ),
        );
        }
    }
}

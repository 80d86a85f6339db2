//! The `kubernetes` Service's endpoints as the fleet publishes them
//! (`fleet.kubernetesService`, DESIGN.md "In-cluster clients").
//!
//! Pods reach the apiservers through the `default/kubernetes` Service, whose endpoints the
//! apiservers publish for themselves unless `--endpoint-reconciler-type=none`. With it, the
//! fleet publishes them instead, from the signed Leases it already keeps:
//!
//! - every live replica's address (its Lease's `endpoint`) as a **ready** endpoint, in
//!   EndpointSlices named `kubernetes-bulwark-<port>`;
//! - the apiservers' own addresses as **serving and terminating, not ready**, in the
//!   `kubernetes` EndpointSlice (and `kubernetes-apiservers-<port>` for other ports):
//!   kube-proxy sends a Service's traffic to such endpoints only while it has no ready one,
//!   so when no replica is live, pods reach the apiservers directly, with no writer needed
//!   at that moment;
//! - the `kubernetes` Endpoints (for readers that still use them) with the replicas'
//!   addresses, or the apiservers' when none is live, labelled so that no mirroring
//!   controller copies them into more slices.
//!
//! Every live replica publishes, and so does `bulwark guard` (the same loop with no Lease of
//! its own), beside the apiservers: a replica that dies leaves within its Lease's duration
//! because the others (or the guard) stop publishing it, and when the last one dies the
//! guard publishes the apiservers alone. Each writer computes the same objects from the same
//! Leases and writes only what differs, conditionally on what it read.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use k8s_openapi::api::core::v1::{EndpointAddress, EndpointPort, EndpointSubset, Endpoints};
use k8s_openapi::api::discovery::v1::{
    Endpoint, EndpointConditions, EndpointPort as SlicePort, EndpointSlice,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use tokio::time::Instant;

use super::lease::{Check, LeaseStore, Verdict};
use super::share::Member;
use crate::BoxFuture;
use crate::metrics::Metrics;
use crate::own::{self, Call, CallError};

/// The Service's namespace and name.
const NAMESPACE: &str = "default";
const SERVICE: &str = "kubernetes";
/// The Service's port name: kube-proxy matches a slice's port to the Service's by it.
const PORT_NAME: &str = "https";
/// `endpointslice.kubernetes.io/managed-by` on the slices Bulwark writes.
pub const MANAGED_BY: &str = "bulwark.io";

/// What the Service should lead to.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Published {
    /// The live replicas' addresses.
    pub bulwarks: BTreeSet<SocketAddr>,
    /// The apiservers' addresses, used only while no replica is ready.
    pub apiservers: BTreeSet<SocketAddr>,
}

/// The addresses the live members of `leases` publish, and the apiservers'. A member's
/// address that does not parse is left out (and the member still counts for shares).
pub fn published(leases: &[Member], now: SystemTime, apiservers: &[SocketAddr]) -> Published {
    Published {
        bulwarks: leases
            .iter()
            .filter(|m| m.live(now))
            .filter_map(|m| m.demand.endpoint.as_deref()?.parse().ok())
            .collect(),
        apiservers: apiservers.iter().copied().collect(),
    }
}

impl Published {
    /// The EndpointSlices, by name.
    pub fn slices(&self) -> BTreeMap<String, EndpointSlice> {
        let mut slices = BTreeMap::new();
        let ready = EndpointConditions {
            ready: Some(true),
            serving: Some(true),
            terminating: Some(false),
        };
        let fallback = EndpointConditions {
            ready: Some(false),
            serving: Some(true),
            terminating: Some(true),
        };
        for (i, ((ipv6, port), ips)) in by_family_and_port(&self.apiservers).iter().enumerate() {
            let name = if i == 0 {
                SERVICE.to_owned()
            } else {
                format!("{SERVICE}-apiservers-{port}")
            };
            slices.insert(name.clone(), slice(&name, *ipv6, *port, ips, &fallback));
        }
        for ((ipv6, port), ips) in by_family_and_port(&self.bulwarks) {
            let family = if ipv6 { "6-" } else { "" };
            let name = format!("{SERVICE}-bulwark-{family}{port}");
            slices.insert(name.clone(), slice(&name, ipv6, port, &ips, &ready));
        }
        slices
    }

    /// The Endpoints: the replicas, or the apiservers when no replica is live.
    pub fn endpoints(&self) -> Endpoints {
        let addresses = if self.bulwarks.is_empty() {
            &self.apiservers
        } else {
            &self.bulwarks
        };
        let subsets = by_family_and_port(addresses)
            .into_iter()
            .map(|((_, port), ips)| EndpointSubset {
                addresses: Some(
                    ips.iter()
                        .map(|ip| EndpointAddress {
                            ip: ip.to_string(),
                            ..EndpointAddress::default()
                        })
                        .collect(),
                ),
                ports: Some(vec![EndpointPort {
                    name: Some(PORT_NAME.into()),
                    port: i32::from(port),
                    protocol: Some("TCP".into()),
                    ..EndpointPort::default()
                }]),
                ..EndpointSubset::default()
            })
            .collect();
        Endpoints {
            metadata: ObjectMeta {
                name: Some(SERVICE.into()),
                namespace: Some(NAMESPACE.into()),
                labels: Some(
                    [(
                        "endpointslice.kubernetes.io/skip-mirror".to_owned(),
                        "true".to_owned(),
                    )]
                    .into(),
                ),
                ..ObjectMeta::default()
            },
            subsets: Some(subsets),
        }
    }
}

/// Addresses grouped as a slice holds them: one address family and one port.
fn by_family_and_port(addresses: &BTreeSet<SocketAddr>) -> BTreeMap<(bool, u16), Vec<String>> {
    let mut groups: BTreeMap<(bool, u16), Vec<String>> = BTreeMap::new();
    for addr in addresses {
        groups
            .entry((addr.is_ipv6(), addr.port()))
            .or_default()
            .push(addr.ip().to_string());
    }
    groups
}

fn slice(
    name: &str,
    ipv6: bool,
    port: u16,
    ips: &[String],
    conditions: &EndpointConditions,
) -> EndpointSlice {
    EndpointSlice {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(NAMESPACE.into()),
            labels: Some(
                [
                    ("kubernetes.io/service-name".to_owned(), SERVICE.to_owned()),
                    (
                        "endpointslice.kubernetes.io/managed-by".to_owned(),
                        MANAGED_BY.to_owned(),
                    ),
                ]
                .into(),
            ),
            ..ObjectMeta::default()
        },
        address_type: if ipv6 { "IPv6" } else { "IPv4" }.into(),
        endpoints: Some(
            ips.iter()
                .map(|ip| Endpoint {
                    addresses: vec![ip.clone()],
                    conditions: Some(conditions.clone()),
                    ..Endpoint::default()
                })
                .collect(),
        ),
        ports: Some(vec![SlicePort {
            name: Some(PORT_NAME.into()),
            port: Some(i32::from(port)),
            protocol: Some("TCP".into()),
            ..SlicePort::default()
        }]),
    }
}

/// The addresses kube-proxy sends the Service's traffic to, given its EndpointSlices: the
/// ready endpoints, or, when none is ready, the serving and terminating ones (kube-proxy's
/// `CategorizeEndpoints` for cluster traffic), on the slices' `https` port. What a pod
/// dialing the Service reaches; `bulwark` tools and tests read the Service with it.
pub fn reachable(slices: &[EndpointSlice]) -> Vec<SocketAddr> {
    let endpoints = || {
        slices.iter().flat_map(|s| {
            let port = (s.ports.iter().flatten())
                .find(|p| p.name.as_deref() == Some(PORT_NAME))
                .and_then(|p| p.port)
                .and_then(|p| u16::try_from(p).ok());
            s.endpoints
                .iter()
                .flatten()
                .filter_map(move |e| Some((e, port?)))
        })
    };
    let pick = |keep: &dyn Fn(&EndpointConditions) -> bool| -> Vec<SocketAddr> {
        endpoints()
            .filter(|(e, _)| keep(&e.conditions.clone().unwrap_or_default()))
            .flat_map(|(e, port)| {
                (e.addresses.iter())
                    .filter_map(move |a| Some(SocketAddr::new(a.parse().ok()?, port)))
            })
            .collect()
    };
    // A missing `ready` reads as ready, as kube-proxy reads it; `serving` defaults to
    // `ready`.
    let ready = pick(&|c| c.ready != Some(false));
    if !ready.is_empty() {
        return ready;
    }
    pick(&|c| c.serving.unwrap_or(c.ready != Some(false)) && c.terminating == Some(true))
}

/// Where the published objects go: the apiservers, or memory in tests.
pub trait ServiceStore: Send + Sync + 'static {
    /// Makes the Service's endpoints `published`; returns how many objects it wrote.
    fn publish(&self, published: &Published) -> BoxFuture<usize, CallError>;
}

/// The Service's objects at the apiservers, through Bulwark's own client.
pub struct UpstreamService {
    client: own::Client,
    timeout: Duration,
}

const SLICES: &str = "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices";
const ENDPOINTS: &str = "/api/v1/namespaces/default/endpoints";

impl UpstreamService {
    /// Writes through `client`, each call within `timeout`.
    pub fn new(client: own::Client, timeout: Duration) -> Self {
        Self { client, timeout }
    }

    async fn publish_once(&self, published: &Published) -> Result<usize, CallError> {
        let mut writes = 0;
        // From the apiserver's watch cache (`resourceVersion=0`): a stale read costs one
        // write refused with 409, and the next round reads again.
        let selector = "?labelSelector=kubernetes.io%2Fservice-name%3Dkubernetes&resourceVersion=0";
        let listed: k8s_openapi::List<EndpointSlice> = self
            .client
            .json(Call::get(format!("{SLICES}{selector}")).timeout(self.timeout))
            .await?;
        let mut existing: BTreeMap<String, EndpointSlice> = listed
            .items
            .into_iter()
            .filter_map(|s| Some((s.metadata.name.clone()?, s)))
            .collect();
        for (name, mut wanted) in published.slices() {
            match existing.remove(&name) {
                Some(there) if same_slice(&there, &wanted) => {}
                Some(there) => {
                    wanted.metadata.resource_version = there.metadata.resource_version;
                    let call = Call::put(format!("{SLICES}/{name}"), &wanted)?;
                    self.client.bytes(call.timeout(self.timeout)).await?;
                    writes += 1;
                }
                None => {
                    let call = Call::post(SLICES, &wanted)?;
                    self.client.bytes(call.timeout(self.timeout)).await?;
                    writes += 1;
                }
            }
        }
        // Slices of ours no longer wanted (a port no replica uses now): gone. Slices of
        // others are left alone.
        for (name, there) in existing {
            let ours = there
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get("endpointslice.kubernetes.io/managed-by"))
                .is_some_and(|m| m == MANAGED_BY);
            if ours {
                let call = Call::delete(format!("{SLICES}/{name}")).timeout(self.timeout);
                match self.client.bytes(call).await {
                    Ok(_) => writes += 1,
                    Err(e) if e.answered() == Some(http::StatusCode::NOT_FOUND) => {}
                    Err(e) => return Err(e),
                }
            }
        }
        let mut wanted = published.endpoints();
        let path = format!("{ENDPOINTS}/{SERVICE}");
        match self
            .client
            .json::<Endpoints>(Call::get(format!("{path}?resourceVersion=0")).timeout(self.timeout))
            .await
        {
            Ok(there) if same_endpoints(&there, &wanted) => {}
            Ok(there) => {
                wanted.metadata.resource_version = there.metadata.resource_version;
                let call = Call::put(path, &wanted)?;
                self.client.bytes(call.timeout(self.timeout)).await?;
                writes += 1;
            }
            Err(e) if e.answered() == Some(http::StatusCode::NOT_FOUND) => {
                let call = Call::post(ENDPOINTS, &wanted)?;
                self.client.bytes(call.timeout(self.timeout)).await?;
                writes += 1;
            }
            Err(e) => return Err(e),
        }
        Ok(writes)
    }
}

impl ServiceStore for Arc<UpstreamService> {
    fn publish(&self, published: &Published) -> BoxFuture<usize, CallError> {
        let this = self.clone();
        let published = published.clone();
        Box::pin(async move { this.publish_once(&published).await })
    }
}

fn managed_by(labels: Option<&BTreeMap<String, String>>) -> Option<&str> {
    labels?
        .get("endpointslice.kubernetes.io/managed-by")
        .map(String::as_str)
}

/// Whether a slice already says what `wanted` says (the apiserver's defaults aside).
fn same_slice(there: &EndpointSlice, wanted: &EndpointSlice) -> bool {
    let addresses = |s: &EndpointSlice| -> Vec<(Vec<String>, Option<EndpointConditions>)> {
        (s.endpoints.iter().flatten())
            .map(|e| (e.addresses.clone(), e.conditions.clone()))
            .collect()
    };
    let ports = |s: &EndpointSlice| -> Vec<(Option<String>, Option<i32>)> {
        (s.ports.iter().flatten())
            .map(|p| (p.name.clone(), p.port))
            .collect()
    };
    there.address_type == wanted.address_type
        && addresses(there) == addresses(wanted)
        && ports(there) == ports(wanted)
        && managed_by(there.metadata.labels.as_ref()) == Some(MANAGED_BY)
}

/// Whether the Endpoints already say what `wanted` says.
fn same_endpoints(there: &Endpoints, wanted: &Endpoints) -> bool {
    let shape = |e: &Endpoints| -> Vec<(Vec<String>, Vec<i32>)> {
        (e.subsets.iter().flatten())
            .map(|s| {
                (
                    (s.addresses.iter().flatten())
                        .map(|a| a.ip.clone())
                        .collect(),
                    (s.ports.iter().flatten()).map(|p| p.port).collect(),
                )
            })
            .collect()
    };
    let skip_mirror = (there.metadata.labels.as_ref())
        .and_then(|l| l.get("endpointslice.kubernetes.io/skip-mirror"))
        .is_some_and(|v| v == "true");
    skip_mirror && shape(there) == shape(wanted)
}

/// How the publisher runs.
#[derive(Clone)]
pub struct Settings {
    /// Which Leases count (the fleet's, signed).
    pub check: Arc<dyn Fn() -> Check + Send + Sync>,
    /// The apiservers' addresses.
    pub apiservers: Vec<SocketAddr>,
    /// How often the Leases are read and the objects checked.
    pub every: Duration,
    /// The wall clock the Leases' times are compared with.
    pub clock: Arc<dyn Fn() -> SystemTime + Send + Sync>,
}

/// How many reads of the Leases pass between two checks of the Service's objects when
/// nothing changed: someone else's change to them (an apiserver whose reconciler was left
/// on, a person) is undone within this many periods.
const CHECK_EVERY_READS: u32 = 15;

/// Reads the Leases every `settings.every`, and publishes when what the Service should
/// lead to changes, the moment a published member's Lease runs out, and every
/// [`CHECK_EVERY_READS`] reads; runs until aborted.
pub async fn run(
    settings: Settings,
    leases: Arc<dyn LeaseStore>,
    service: Arc<dyn ServiceStore>,
    metrics: Metrics,
) {
    let mut last: Option<Published> = None;
    let mut members: Vec<Member> = Vec::new();
    let mut next_read = Instant::now();
    let mut reads = 0u32;
    loop {
        let now = (settings.clock)();
        if Instant::now() >= next_read {
            next_read = Instant::now() + settings.every;
            match leases.list().await {
                Ok(listed) => {
                    let check = (settings.check)();
                    members = listed
                        .iter()
                        .filter_map(|l| match check.verdict(l, now) {
                            Verdict::Member(m) => Some(m),
                            _ => None,
                        })
                        .collect();
                    reads += 1;
                    if reads.is_multiple_of(CHECK_EVERY_READS) {
                        // Check the objects again: write whatever someone else changed.
                        last = None;
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %crate::report::Chain(&e), "kubernetes Service: listing the Leases");
                }
            }
        }
        let now = (settings.clock)();
        let wanted = published(&members, now, &settings.apiservers);
        if last.as_ref() != Some(&wanted) {
            match service.publish(&wanted).await {
                Ok(writes) => {
                    metrics
                        .fleet_service_endpoints
                        .set(wanted.bulwarks.len() as i64);
                    if writes > 0 {
                        tracing::info!(
                            bulwarks = ?wanted.bulwarks,
                            writes,
                            "kubernetes Service: endpoints published"
                        );
                    }
                    metrics
                        .fleet_service_writes_total
                        .with_label_values(&["success"])
                        .inc_by(writes as u64);
                    last = Some(wanted);
                }
                Err(e) => {
                    metrics
                        .fleet_service_writes_total
                        .with_label_values(&["error"])
                        .inc();
                    tracing::warn!(error = %crate::report::Chain(&e), "kubernetes Service: publishing the endpoints");
                }
            }
        }
        // Wake at the next read, or when the first published member's Lease runs out.
        let expiry = (members.iter())
            .filter(|m| m.live(now) && m.demand.endpoint.is_some())
            .filter_map(|m| m.renewed.checked_add(m.duration))
            .min()
            .map(|until| Instant::now() + until.duration_since(now).unwrap_or_default());
        let wake = expiry.map_or(next_read, |e| e.min(next_read));
        tokio::time::sleep_until(wake).await;
    }
}

#[cfg(test)]
mod tests;

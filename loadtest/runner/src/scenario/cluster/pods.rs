//! The cluster's pods that talk to the apiservers, as pods do: a bound ServiceAccount token
//! (as the kubelet projects one), the CA of `kube-root-ca.crt`, and the `kubernetes`
//! Service's ClusterIP as the name they check, connected wherever kube-proxy would send
//! them: the Service's ready endpoints (the Bulwarks, which publish them) or, in the run
//! without Bulwark, the apiservers (what their own reconciler publishes).
//!
//! Per node, a logging agent (`logging/fluent-bit`: its pods, its Secret, every
//! EndpointSlice) and a kube-proxy (`kube-system/kube-proxy`: Services and
//! EndpointSlices), each with a token bound to its node; and the storm's tenant operators.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use futures::StreamExt;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::Client;
use serde_json::{Value, json};

use super::Front;
use crate::client::{ClassStats, Identity, Target};
use crate::controlplane::{ControlPlane, KUBERNETES_SERVICE_IP};

/// The logging agent's ServiceAccount, on every node.
pub const AGENT: (&str, &str) = ("logging", "fluent-bit");
/// kube-proxy's ServiceAccount, on every node.
pub const KUBE_PROXY: (&str, &str) = ("kube-system", "kube-proxy");
/// The namespace of the agents' Secrets, one per node, named after it.
pub const AGENT_NAMESPACE: &str = "kwok-agents";

/// The run's pods, their tokens minted and the Service's endpoints found, ready to start.
pub struct Pods {
    /// Where kube-proxy sends them ([`targets`]).
    pub targets: Vec<Target>,
    /// Each node's logging agent's token, by node.
    agent_tokens: Vec<String>,
    /// Each node's kube-proxy's token, by node.
    proxy_tokens: Vec<String>,
    /// The storm's operators' tokens, bound to the first nodes.
    pub storm_tokens: Vec<String>,
}

impl Pods {
    /// ServiceAccounts, RBAC and tokens bound to their nodes: with `per_node`, a logging
    /// agent and a kube-proxy on each of `nodes`; an operator for each of `storm` (its
    /// namespace and name), the `i`-th on node `i`.
    pub async fn prepare(
        cp: &ControlPlane,
        client: &Client,
        front: Front,
        per_node: bool,
        nodes: usize,
        storm: &[(String, String)],
    ) -> anyhow::Result<Pods> {
        let node_list = self::nodes(client, nodes).await?;
        let (mut agent_tokens, mut proxy_tokens) = (Vec::new(), Vec::new());
        if per_node {
            super::grant(cp, "pods-rbac.yaml", &rbac()).await?;
            service_account(client, AGENT).await?;
            service_account(client, KUBE_PROXY).await?;
            agent_secrets(client, nodes).await?;
            agent_tokens = bound_tokens(client, AGENT, &node_list).await?;
            proxy_tokens = bound_tokens(client, KUBE_PROXY, &node_list).await?;
        }
        let mut storm_tokens = Vec::new();
        for (i, (namespace, name)) in storm.iter().enumerate() {
            let account = (namespace.as_str(), name.as_str());
            service_account(client, account).await?;
            let node = &node_list[i % node_list.len().max(1)..][..1];
            storm_tokens.extend(bound_tokens(client, account, node).await?);
        }
        Ok(Pods {
            targets: targets(cp, client, front).await?,
            agent_tokens,
            proxy_tokens,
            storm_tokens,
        })
    }

    /// Starts each node's logging agent and kube-proxy, until `until`.
    pub fn start_nodes(
        &mut self,
        agents: &Arc<ClassStats>,
        proxies: &Arc<ClassStats>,
        until: tokio::time::Instant,
    ) -> Vec<tokio::task::JoinHandle<()>> {
        if self.agent_tokens.is_empty() {
            return Vec::new();
        }
        eprintln!(
            "cluster: starting a logging agent and a kube-proxy per node, with tokens bound to \
             it, through the kubernetes Service ({:?})",
            self.targets.iter().map(|t| t.addr).collect::<Vec<_>>()
        );
        let agent_tokens = std::mem::take(&mut self.agent_tokens);
        let proxy_tokens = std::mem::take(&mut self.proxy_tokens);
        let mut tasks = start_per_node(&self.targets, agent_tokens, agent_paths, agents, until);
        tasks.extend(start_per_node(
            &self.targets,
            proxy_tokens,
            kube_proxy_paths,
            proxies,
            until,
        ));
        tasks
    }
}

/// Where node `i`'s pods connect from: an address of its own in 127.1.0.0/16 (the host
/// answers the whole of 127.0.0.0/8), so that Bulwark's per-source and per-prefix bounds
/// see one node's pods as one source and 256 nodes to a /24, as a cluster's would be,
/// rather than every pod of the cluster as this one host.
pub fn node_source(i: usize) -> IpAddr {
    let n = (i % 65_535) + 1;
    std::net::Ipv4Addr::new(127, 1, (n >> 8) as u8, (n & 0xff) as u8).into()
}

/// The `kubernetes` Service's ClusterIP: the name a pod's client checks.
pub fn service_ip() -> IpAddr {
    KUBERNETES_SERVICE_IP.parse().expect("an IP address")
}

/// Where kube-proxy sends a pod's connection to the `kubernetes` Service, and the CA the
/// pod trusts: through Bulwark, the ready endpoints the fleet publishes (waited for);
/// without, the apiservers.
pub async fn targets(
    cp: &ControlPlane,
    observer: &Client,
    front: Front,
) -> anyhow::Result<Vec<Target>> {
    let ca_pem = cp.pki().server_ca.cert_pem();
    let addrs: Vec<SocketAddr> = match front {
        Front::Direct => cp.replica_addrs(),
        Front::Bulwark => {
            let mut wanted = cp.advertised_bulwarks();
            wanted.sort();
            anyhow::ensure!(
                cp.node_ip().is_some(),
                "the host has no address but loopback: the kubernetes Service cannot lead pods \
                 to Bulwark"
            );
            let slices: kube::Api<EndpointSlice> =
                kube::Api::namespaced(observer.clone(), "default");
            let lists =
                kube::api::ListParams::default().labels("kubernetes.io/service-name=kubernetes");
            let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
            loop {
                let listed = slices.list(&lists).await?;
                let mut now = bulwark::fleet::endpoints::reachable(&listed.items);
                now.sort();
                if now == wanted {
                    break now;
                }
                anyhow::ensure!(
                    tokio::time::Instant::now() < deadline,
                    "the kubernetes Service leads to {now:?}, not the Bulwarks {wanted:?}"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    Ok(addrs
        .into_iter()
        .map(|addr| Target {
            addr,
            ca_pem: ca_pem.clone(),
        })
        .collect())
}

/// Creates `value` at `path`, or leaves what is there.
async fn ensure(client: &Client, path: &str, value: &Value) -> anyhow::Result<()> {
    let request = http::Request::post(path)
        .header("Content-Type", "application/json")
        .body(value.to_string().into_bytes())?;
    match client.request::<Value>(request).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.code == 409 => Ok(()),
        Err(e) => Err(e).with_context(|| format!("POST {path}")),
    }
}

/// The namespace and ServiceAccount `(namespace, name)`.
pub async fn service_account(
    client: &Client,
    (namespace, name): (&str, &str),
) -> anyhow::Result<()> {
    ensure(
        client,
        "/api/v1/namespaces",
        &json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}),
    )
    .await?;
    ensure(
        client,
        &format!("/api/v1/namespaces/{namespace}/serviceaccounts"),
        &json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}}),
    )
    .await
}

/// A token of `(namespace, name)` bound to each of `nodes` (their names and uids), as
/// the TokenRequest API gives a projected volume: it carries the node in its review's
/// extras. 16 requests at a time.
pub async fn bound_tokens(
    client: &Client,
    (namespace, name): (&str, &str),
    nodes: &[(String, String)],
) -> anyhow::Result<Vec<String>> {
    let path = format!("/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token");
    let tokens = futures::stream::iter(nodes)
        .map(|(node, uid)| {
            let path = path.clone();
            async move {
                let request = http::Request::post(&path)
                    .header("Content-Type", "application/json")
                    .body(
                        json!({
                            "apiVersion": "authentication.k8s.io/v1",
                            "kind": "TokenRequest",
                            "spec": {
                                "expirationSeconds": 7200,
                                "boundObjectRef": {"apiVersion": "v1", "kind": "Node", "name": node, "uid": uid},
                            },
                        })
                        .to_string()
                        .into_bytes(),
                    )?;
                let answer: Value = client
                    .request(request)
                    .await
                    .with_context(|| format!("a token of {namespace}/{name} bound to {node}"))?;
                answer["status"]["token"]
                    .as_str()
                    .map(str::to_owned)
                    .context("a TokenRequest without a token")
            }
        })
        .buffered(16)
        .collect::<Vec<_>>()
        .await;
    tokens.into_iter().collect()
}

/// Each node's name and uid, by name `kwok-node-0`, `kwok-node-1`, ...
pub async fn nodes(client: &Client, count: usize) -> anyhow::Result<Vec<(String, String)>> {
    let listed: Value = super::get(client, "/api/v1/nodes").await?;
    let uids: std::collections::BTreeMap<String, String> = (listed["items"].as_array())
        .into_iter()
        .flatten()
        .filter_map(|n| {
            Some((
                n["metadata"]["name"].as_str()?.to_owned(),
                n["metadata"]["uid"].as_str()?.to_owned(),
            ))
        })
        .collect();
    (0..count)
        .map(|i| {
            let name = format!("kwok-node-{i}");
            let uid = uids
                .get(&name)
                .cloned()
                .with_context(|| format!("no node {name}"))?;
            Ok((name, uid))
        })
        .collect()
}

/// What the logging agents and the kube-proxies may read: the agents their node's pods
/// (by field selector), every EndpointSlice and the Secrets of [`AGENT_NAMESPACE`] (each
/// watches only its own, by name); kube-proxy what `system:node-proxier` grants it, as
/// kubeadm binds it.
pub fn rbac() -> String {
    let (agent_ns, agent) = AGENT;
    let (proxy_ns, proxy) = KUBE_PROXY;
    format!(
        "apiVersion: v1
kind: Namespace
metadata:
  name: {AGENT_NAMESPACE}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: node-logging-agents
rules:
  - apiGroups: [\"\"]
    resources: [pods]
    verbs: [get, list, watch]
  - apiGroups: [discovery.k8s.io]
    resources: [endpointslices]
    verbs: [get, list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: node-logging-agents
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: node-logging-agents}}
subjects: [{{kind: ServiceAccount, namespace: {agent_ns}, name: {agent}}}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata:
  name: node-logging-agents
  namespace: {AGENT_NAMESPACE}
rules:
  - apiGroups: [\"\"]
    resources: [secrets]
    verbs: [get, list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata:
  name: node-logging-agents
  namespace: {AGENT_NAMESPACE}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: Role, name: node-logging-agents}}
subjects: [{{kind: ServiceAccount, namespace: {agent_ns}, name: {agent}}}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: kube-proxy-node-proxier
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: \"system:node-proxier\"}}
subjects: [{{kind: ServiceAccount, namespace: {proxy_ns}, name: {proxy}}}]
"
    )
}

/// Creates each node's Secret for its agent.
pub async fn agent_secrets(client: &Client, nodes: usize) -> anyhow::Result<()> {
    let created = futures::stream::iter(0..nodes)
        .map(|i| async move {
            ensure(
                client,
                &format!("/api/v1/namespaces/{AGENT_NAMESPACE}/secrets"),
                &json!({
                    "apiVersion": "v1",
                    "kind": "Secret",
                    "metadata": {"name": format!("kwok-node-{i}")},
                    "data": {"config": "c2V0dGluZ3M="},
                }),
            )
            .await
        })
        .buffer_unordered(16)
        .collect::<Vec<_>>()
        .await;
    created.into_iter().collect::<anyhow::Result<Vec<_>>>()?;
    Ok(())
}

/// One client per node with that node's token, each running `paths`' informers on one
/// connection until `until`, started 10 ms apart so that the handshakes do not all land at
/// once; the `i`-th node's client goes where kube-proxy would send it (`targets`, round
/// robin as its random pick spreads them).
fn start_per_node(
    targets: &[Target],
    tokens: Vec<String>,
    paths: impl Fn(&str) -> Vec<String>,
    stats: &Arc<ClassStats>,
    until: tokio::time::Instant,
) -> Vec<tokio::task::JoinHandle<()>> {
    tokens
        .into_iter()
        .enumerate()
        .filter_map(|(i, token)| {
            let target = &targets[i % targets.len()];
            let identity = Identity::in_cluster(token, service_ip()).from_source(node_source(i));
            let client = crate::client::Client::new(target, &identity).ok()?;
            let stats = stats.clone();
            let paths = paths(&format!("kwok-node-{i}"));
            let start = tokio::time::Instant::now() + Duration::from_millis(10 * i as u64);
            Some(tokio::spawn(async move {
                tokio::time::sleep_until(start).await;
                let received = Arc::new(super::super::informers::Received::default());
                let all = std::sync::Mutex::new(stats.tally());
                let informers = paths.into_iter().map(|path| {
                    super::super::informers::reflector(
                        client.clone(),
                        &all,
                        path,
                        until,
                        None,
                        received.clone(),
                    )
                });
                futures::future::join_all(informers).await;
                stats.done(all.into_inner().unwrap_or_else(|e| e.into_inner()));
            }))
        })
        .collect()
}

/// A logging agent's informers on node `name`: its pods, its Secret, every EndpointSlice.
fn agent_paths(name: &str) -> Vec<String> {
    vec![
        format!("/api/v1/pods?fieldSelector=spec.nodeName%3D{name}"),
        format!(
            "/api/v1/namespaces/{AGENT_NAMESPACE}/secrets?fieldSelector=metadata.name%3D{name}"
        ),
        "/apis/discovery.k8s.io/v1/endpointslices".into(),
    ]
}

/// kube-proxy's informers: Services and EndpointSlices.
fn kube_proxy_paths(_node: &str) -> Vec<String> {
    vec![
        "/api/v1/services".into(),
        "/apis/discovery.k8s.io/v1/endpointslices".into(),
    ]
}

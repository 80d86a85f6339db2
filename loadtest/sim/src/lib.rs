//! bulwark-sim: a simulated kube-apiserver fleet — N TLS replicas over one shared store,
//! authenticating and authorizing like the apiserver, with fault hooks and a memory model.
//! It is the fake upstream of every Bulwark test and the target of the load scenarios.

pub mod api;
pub mod auth;
pub mod body;
pub mod client;
pub mod discovery;
pub mod error;
pub mod exec;
pub mod faults;
pub mod heap;
pub mod l4;
pub mod metrics;
pub mod openapi;
pub mod pki;
pub mod policy;
pub mod proto;
pub mod reviews;
pub use apimachinery::selector as select;
pub mod server;
pub mod status;
pub mod store;
pub mod table;
pub mod watch;

use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub use faults::ReplicaStats;
pub use heap::HeapModel;
pub use pki::{Ca, CertKey, Pki};
pub use policy::{Policy, PolicyRule, StaticToken};
pub use server::Replica;
pub use store::{Seed, Store};

/// How a fleet is built.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Number of replicas.
    pub replicas: usize,
    /// Serving certificates come from `pki.server_ca` (for "127.0.0.1" and "localhost");
    /// client certificates are verified against `pki.client_ca` (client auth is optional).
    pub pki: Arc<Pki>,
    /// CNs allowed to send X-Remote-* (with a cert from `pki.front_proxy_ca`); empty = any.
    pub front_proxy_allowed_names: Vec<String>,
    /// Static bearer tokens.
    pub tokens: Vec<StaticToken>,
    /// Authorization policy (`system:masters` may always do everything).
    pub policy: Policy,
    /// Objects created before the fleet starts.
    pub seed: Vec<Seed>,
    /// Per-replica memory model.
    pub heap: HeapModel,
    /// Watch-cache window: events kept for watches/continue tokens before 410.
    pub event_ring: usize,
    /// Period of watch BOOKMARK events (the apiserver's is about a minute).
    pub bookmark_interval: Duration,
    /// `--anonymous-auth`.
    pub anonymous: bool,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            replicas: 1,
            pki: Arc::new(Pki::new()),
            front_proxy_allowed_names: Vec::new(),
            tokens: Vec::new(),
            policy: Policy::default(),
            seed: Vec::new(),
            heap: HeapModel::default(),
            event_ring: 10_000,
            bookmark_interval: Duration::from_secs(60),
            anonymous: true,
        }
    }
}

/// A request as one replica saw it, after authentication and impersonation.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SeenRequest {
    /// Replica index.
    pub replica: usize,
    /// HTTP method.
    pub method: String,
    /// Path and query.
    pub path: String,
    /// Effective user.
    pub user: String,
    /// Effective groups.
    pub groups: Vec<String>,
    /// Effective extra.
    pub extra: BTreeMap<String, Vec<String>>,
    /// Effective UID.
    pub uid: String,
    /// The authenticated user when the request impersonated someone.
    pub impersonated_by: Option<String>,
}

/// How many [`SeenRequest`]s a fleet keeps.
pub const SEEN_LOG: usize = 10_000;

/// A running fleet of replicas over one store.
pub struct Fleet {
    shared: Arc<server::Shared>,
    replicas: Vec<Replica>,
    l4: Mutex<Option<SocketAddr>>,
    l4_stop: tokio_util::sync::CancellationToken,
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet")
            .field("addrs", &self.addrs())
            .finish()
    }
}

impl Fleet {
    /// Seeds the store and starts every replica on its own TLS listener on 127.0.0.1:0.
    pub async fn start(cfg: SimConfig) -> crate::error::Result<Fleet> {
        let shared = Arc::new(server::Shared::new(&cfg)?);
        for s in &cfg.seed {
            shared.store.seed(s)?;
        }
        let mut replicas = Vec::with_capacity(cfg.replicas);
        for i in 0..cfg.replicas {
            replicas.push(Replica::bind(i, shared.clone()).await?);
        }
        for r in &replicas {
            r.start().await;
        }
        Ok(Fleet {
            shared,
            replicas,
            l4: Mutex::new(None),
            l4_stop: Default::default(),
        })
    }

    /// Each replica's address (stable across stop/start).
    pub fn addrs(&self) -> Vec<SocketAddr> {
        self.replicas.iter().map(Replica::addr).collect()
    }

    /// Replica `i`. Panics when out of range, like slice indexing.
    pub fn replica(&self, i: usize) -> &Replica {
        &self.replicas[i]
    }

    /// All replicas.
    pub fn replicas(&self) -> &[Replica] {
        &self.replicas
    }

    /// The fleet's PKI.
    pub fn pki(&self) -> &Pki {
        &self.shared.pki
    }

    /// The shared store ("etcd").
    pub fn store(&self) -> &Store {
        &self.shared.store
    }

    /// Creates/updates/patches/deletes applied (through the API or the store).
    pub fn applied_writes(&self) -> u64 {
        self.shared.store.applied_writes()
    }

    /// Every replica's statistics.
    pub fn stats(&self) -> Vec<ReplicaStats> {
        self.replicas.iter().map(Replica::stats).collect()
    }

    /// The last [`SEEN_LOG`] requests across the fleet, oldest first.
    pub fn seen_requests(&self) -> Vec<SeenRequest> {
        self.shared
            .seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .cloned()
            .collect()
    }

    /// Forgets the seen-request log.
    pub fn clear_seen(&self) {
        self.shared
            .seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
    }

    /// Prometheus text of the fleet's own metrics.
    pub fn metrics_text(&self) -> String {
        self.shared.metrics.render(&self.replicas)
    }

    /// A TCP balancer on 127.0.0.1: each new client connection goes to the next live
    /// replica (round robin) and stays there. Started once; later calls return its address.
    pub async fn l4_balancer(&self) -> crate::error::Result<SocketAddr> {
        if let Some(a) = *self.l4.lock().unwrap_or_else(|p| p.into_inner()) {
            return Ok(a);
        }
        let addr = l4::start(self.replicas.clone(), self.l4_stop.clone()).await?;
        *self.l4.lock().unwrap_or_else(|p| p.into_inner()) = Some(addr);
        Ok(addr)
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        self.l4_stop.cancel();
        for r in &self.replicas {
            r.shutdown_now();
        }
    }
}

pub(crate) fn push_seen(log: &Mutex<VecDeque<SeenRequest>>, s: SeenRequest) {
    let mut g = log.lock().unwrap_or_else(|p| p.into_inner());
    if g.len() >= SEEN_LOG {
        g.pop_front();
    }
    g.push_back(s);
}

//! Builds every part from the configuration, wires the request path ([`crate::stages`])
//! between the listener and the upstream pool, and starts and drains Bulwark.

mod admin;
mod cache;
mod fleet;
mod logs;
mod path;
mod rules;
mod tokens;
mod upstream;
mod workers;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::config::{self, Config};
use crate::fleet as fleet_leases;
use crate::identity::forward::Forwarding;
use crate::listen::{Connections, DrainPhase, Handoff, HandoffIo, ListenError};
use crate::logs::rotate::LineFile;
use crate::metrics::Metrics;
use crate::own;
use crate::rules::RuleProblem;
use crate::stages::forward::Forward;
use crate::upstream::UpstreamError;

/// Why Bulwark could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The client listener.
    #[error("listen: {0}")]
    Listen(#[from] ListenError),
    /// The upstream pool.
    #[error("upstream: {0}")]
    Upstream(#[from] UpstreamError),
    /// The admin listener.
    #[error("admin: {0}")]
    Admin(#[from] std::io::Error),
    /// The admin listener's certificate.
    #[error("admin.tls: {0}")]
    AdminTls(#[source] ListenError),
    /// The admin listener's socket.
    #[error("admin: {0}")]
    AdminListen(#[source] ListenError),
    /// A worker thread's runtime.
    #[error("listen.workers: cannot build a worker's runtime: {0}")]
    Workers(#[source] std::io::Error),
    /// The fleet's key file cannot be used.
    #[error("fleet.keyFile: {0}")]
    FleetKey(#[source] fleet_leases::lease::KeyError),
    /// `bulwark guard` was given a configuration without `fleet.kubernetesService`.
    #[error("bulwark guard needs fleet.kubernetesService in the configuration")]
    Guard,
    /// The rule files are invalid.
    #[error("rules: {}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n"))]
    Rules(Vec<RuleProblem>),
}

/// How long the drain waits, once the watches ended, for the listener's connections to
/// flush the ends and close before it drops whatever is left (connections handed over with
/// [`Running::serve_connection`] are not counted: they end at Close).
pub const WATCHES_END: Duration = Duration::from_secs(1);

/// A running Bulwark: its addresses and the handle that drains it.
pub struct Running {
    /// The client-facing address.
    pub addr: SocketAddr,
    /// The admin address.
    pub admin_addr: SocketAddr,
    /// Shared state of the admin endpoints.
    pub admin: Arc<crate::admin::State>,
    drain: watch::Sender<DrainPhase>,
    connections: Connections,
    handoff: Handoff,
    shutdown: config::Shutdown,
    tasks: Vec<JoinHandle<()>>,
    /// The file logs (audit), reopened on SIGHUP and flushed at the end of the drain.
    files: Vec<LineFile>,
    /// Where the prefixes trusted for token reviews are kept, written last at the drain.
    review_memory: Option<tokens::ReviewMemory>,
}

impl Running {
    /// Starts every part from a validated configuration: the upstream pool and Bulwark's
    /// own client on it, token reviews, logs, cache, rules, admission and the fleet, then
    /// the request path on the client listener and the admin listener over all of them.
    pub async fn start(config: Config) -> Result<Running, StartError> {
        let metrics = Metrics::new();
        let upstream = upstream::start(&config.upstream, &metrics)?;
        let own = own::Client::new(upstream.clone());
        let (tokens, review_memory, review_task) =
            tokens::start(&config.identity.token_review, &own, &metrics);
        let forwarding =
            Forwarding::new(config.identity.mode, config.upstream.front_proxy.as_ref());
        let forward = Forward::new(
            upstream.clone(),
            Arc::new(forwarding),
            config.upstream.timeouts.clone(),
        );
        let logs = logs::open(&config, &metrics)?;
        let cache = cache::start(&config.cache, &own, &metrics, logs.audit);
        let rules = rules::start(&config.rules, &metrics)?;
        let admitting = fleet::start(&config, &rules, &upstream, &own, &metrics)?;
        let stages = path::Stages::new(
            &config,
            path::Parts {
                tokens: tokens.clone(),
                rules: rules.clone(),
                admission: admitting.admission.clone(),
                cache: cache.clone(),
                access: logs.access,
            },
            &metrics,
        );
        let serving = workers::serve(&config.listen, &stages, forward, &metrics).await?;
        let admin = admin::serve(
            &config,
            admin::Parts {
                metrics,
                upstream,
                rules,
                admission: admitting.admission,
                cache,
                fleet: admitting.fleet,
                board: stages.board(),
                tokens,
                own,
            },
        )
        .await?;
        let reopen = logs::reopen_on_hangup(logs.files.clone());
        tracing::info!(addr = %serving.addr, admin_addr = %admin.addr, "bulwark serving");
        Ok(Running {
            addr: serving.addr,
            admin_addr: admin.addr,
            admin: admin.state,
            drain: serving.drain,
            connections: serving.connections,
            handoff: serving.handoff,
            shutdown: config.listen.shutdown.clone(),
            tasks: [serving.task, admin.task]
                .into_iter()
                .chain(admitting.tasks)
                .chain(reopen)
                .chain(review_task)
                .collect(),
            files: logs.files,
            review_memory,
        })
    }

    /// Serves a connection the caller opened (one end of an in-memory pair, for one) from
    /// `peer` on the whole request path the listener's connections take, less what comes
    /// before HTTP on a socket: no PROXY header, no TLS, no connection caps ([`Handoff`]).
    /// The future ends with the connection or at the drain's close; spawn it.
    pub fn serve_connection(
        &self,
        io: impl HandoffIo,
        peer: SocketAddr,
    ) -> impl Future<Output = ()> + Send + 'static {
        self.handoff.serve(io, peer)
    }

    /// Blocks until every line the file logs (audit) took so far is in their files, for
    /// readers that must see the last requests' lines (tests). Call where blocking is
    /// allowed; it waits on the logs' writer threads, never on the runtime.
    pub fn flush_logs(&self) {
        self.files.iter().for_each(LineFile::flush);
    }

    /// The SIGTERM sequence of DESIGN.md step 9: `/readyz` fails, a pause lets balancers
    /// notice, GOAWAY, in-flight requests get the grace period, then the watches still open
    /// end cleanly, and once their connections have closed (or [`WATCHES_END`] later)
    /// everything ends.
    pub async fn drain(self) {
        self.admin.draining.store(true, Ordering::SeqCst);
        tracing::info!(pause = ?self.shutdown.pause, "draining: readyz fails");
        tokio::time::sleep(self.shutdown.pause).await;
        let _ = self.drain.send(DrainPhase::GoAway);
        tracing::info!(grace = ?self.shutdown.grace, "draining: GOAWAY sent");
        tokio::time::sleep(self.shutdown.grace).await;
        let _ = self.drain.send(DrainPhase::EndWatches);
        let open = self.connections.open();
        tracing::info!(open, "draining: watches ended");
        let until = tokio::time::Instant::now() + WATCHES_END;
        // Told to go away with nothing left open, a connection closes itself.
        while self.connections.open() > 0 && tokio::time::Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let _ = self.drain.send(DrainPhase::Close);
        for task in self.tasks {
            task.abort();
        }
        // The lines of the last requests are still queued for the logs' writer threads.
        let files = self.files;
        let _ = tokio::task::spawn_blocking(move || files.iter().for_each(LineFile::flush)).await;
        // Up to a minute of accepted prefixes since the last write: the restart that follows
        // is when they are needed.
        if let Some(memory) = self.review_memory {
            let _ = tokio::task::spawn_blocking(move || memory.save()).await;
        }
    }
}

/// The runtime Bulwark serves on: tokio's multi-threaded one, or with
/// `TOKIO_WORKER_THREADS=1` its single-threaded one, which serves the same work on one core
/// without the work-stealing machinery (about 35k small GETs a second instead of 27k).
pub fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    runtime_beside(0)
}

/// The main runtime beside `workers` worker threads (`listen.workers`) as [`runtime`] builds
/// it, but with workers and no `TOKIO_WORKER_THREADS`, two threads: what is left to it (the
/// accept loop, probes, the admin listener, the watch cache's informers, the fleet's Leases)
/// needs no more, and a thread per core beside the workers would only sit idle.
pub fn runtime_beside(workers: usize) -> std::io::Result<tokio::runtime::Runtime> {
    let threads = std::env::var("TOKIO_WORKER_THREADS").ok();
    if threads.as_deref().is_some_and(|n| n.trim() == "1") {
        return tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build();
    }
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if threads.is_none() && workers > 0 {
        builder.worker_threads(2);
    }
    builder.enable_all().build()
}

/// Runs until SIGTERM or Ctrl-C, then drains.
pub async fn run(config: Config) -> Result<(), StartError> {
    let running = Running::start(config).await?;
    shutdown_signal().await;
    running.drain().await;
    Ok(())
}

/// `bulwark guard`: publishes the `kubernetes` Service's endpoints from the fleet's Leases
/// and serves nothing, so that when every replica is gone the Service leads to the
/// apiservers within the Lease duration (DESIGN.md "In-cluster clients"). Reads the
/// replicas' configuration: `upstream` and `fleet` (with `kubernetesService`).
pub async fn guard(config: Config) -> Result<(), StartError> {
    let Some((fleet_cfg, service)) =
        (config.fleet.as_ref()).and_then(|f| Some((f, f.kubernetes_service.as_ref()?)))
    else {
        return Err(StartError::Guard);
    };
    let metrics = Metrics::new();
    let upstream = upstream::start(&config.upstream, &metrics)?;
    let settings = fleet_leases::Settings::from_config(fleet_cfg, config.upstream.bulwark_replicas)
        .map_err(StartError::FleetKey)?;
    let task =
        fleet_leases::publish_service(&settings, service, own::Client::new(upstream), metrics);
    tracing::info!(apiservers = ?service.apiservers, "bulwark guard publishing the kubernetes Service");
    shutdown_signal().await;
    task.abort();
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("SIGTERM handler");
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

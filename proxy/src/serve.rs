//! Builds every part from the configuration, wires the request path ([`crate::stages`])
//! between the listener and the upstream pool, and starts and drains Bulwark.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::admin;
use crate::admit::{Admission, ProxyLocal};
use crate::cache::{AuditLog, Cache};
use crate::config::{self, Config};
use crate::fleet::{self, FleetShares};
use crate::identity::forward::{ForwardError, Forwarding};
use crate::identity::{TokenCache, UpstreamReviewer};
use crate::listen::{DrainPhase, Handoff, HandoffIo, ListenError, Listener, Worker};
use crate::logs::access::AccessLog;
use crate::logs::rotate::{Limits, LineFile};
use crate::metrics::{Metrics, ResourceLabels};
use crate::own;
use crate::rules::{RuleProblem, RuleSet, Rules};
use crate::stages::admit::Admit;
use crate::stages::classify::Classify;
use crate::stages::forward::Forward;
use crate::stages::identity::Identify;
use crate::stages::rescue::RescueLayer;
use crate::stages::stack;
use crate::upstream::{BodyBudget, BodyDeadlines, Upstream, UpstreamError, UpstreamTls};

/// Why Bulwark could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The client listener.
    #[error("listen: {0}")]
    Listen(#[from] ListenError),
    /// The upstream pool.
    #[error("upstream: {0}")]
    Upstream(#[from] UpstreamError),
    /// Identity forwarding.
    #[error("identity: {0}")]
    Forward(#[from] ForwardError),
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
    FleetKey(#[source] crate::fleet::lease::KeyError),
    /// `bulwark guard` was given a configuration without `fleet.kubernetesService`.
    #[error("bulwark guard needs fleet.kubernetesService in the configuration")]
    Guard,
    /// The rule files are invalid.
    #[error("rules: {}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n"))]
    Rules(Vec<RuleProblem>),
}

/// A running Bulwark: its addresses and the handle that drains it.
pub struct Running {
    /// The client-facing address.
    pub addr: SocketAddr,
    /// The admin address.
    pub admin_addr: SocketAddr,
    /// Shared state of the admin endpoints.
    pub admin: Arc<admin::State>,
    drain: watch::Sender<DrainPhase>,
    handoff: Handoff,
    shutdown: config::Shutdown,
    tasks: Vec<JoinHandle<()>>,
    /// The file logs (audit), reopened on SIGHUP and flushed at the end of the drain.
    files: Vec<LineFile>,
    /// Where the prefixes trusted for token reviews are kept, written last at the drain.
    review_memory: Option<ReviewMemory>,
}

impl Running {
    /// Starts every part from a validated configuration.
    pub async fn start(config: Config) -> Result<Running, StartError> {
        let metrics = Metrics::new();
        let tls = UpstreamTls::from_config(&config.upstream)?;
        tls.record_expiry(&metrics);
        let upstream = Upstream::new(&config.upstream, tls, metrics.clone())?;
        upstream.spawn_probes();
        let own = own::Client::new(upstream.clone());
        let reviewer = UpstreamReviewer::new(own.clone());
        let tokens = Arc::new(TokenCache::new(
            Arc::new(reviewer),
            config.identity.token_review.clone(),
            metrics.clone(),
        ));
        let review_memory = config
            .identity
            .token_review
            .memory_file
            .clone()
            .map(|path| ReviewMemory {
                limits: tokens.review_limits().clone(),
                path,
                writing: Arc::default(),
            });
        let review_memory_task = review_memory.clone().map(remember_reviews);
        let tokens_for_admin = tokens.clone();
        let forwarding =
            Forwarding::new(config.identity.mode, config.upstream.front_proxy.as_ref())?;
        let forward = Forward::new(
            upstream.clone(),
            Arc::new(forwarding),
            config.upstream.timeouts.clone(),
        );
        let audit_limits = Limits::new(config.audit.max_size.0, config.audit.max_files);
        let audit = match &config.audit.path {
            Some(path) => Some(AuditLog::open(path, audit_limits, &metrics).map_err(|e| {
                StartError::Admin(std::io::Error::new(
                    e.kind(),
                    format!("audit log {}: {e}", path.display()),
                ))
            })?),
            None => None,
        };
        let access = match &config.access_log {
            Some(access) => Some(
                AccessLog::open(
                    &access.path,
                    access.sample,
                    Limits::new(access.max_size.0, access.max_files),
                    &metrics,
                )
                .map_err(|e| {
                    StartError::Admin(std::io::Error::new(
                        e.kind(),
                        format!("access log {}: {e}", access.path.display()),
                    ))
                })?,
            ),
            None => None,
        };
        let files: Vec<LineFile> = audit
            .iter()
            .map(|a| a.file().clone())
            .chain(access.iter().map(|a| a.file().clone()))
            .collect();
        let cache = config
            .cache
            .enabled
            .then(|| Cache::start(&config.cache, own.clone(), metrics.clone(), audit));
        let rule_set = match &config.rules.folder {
            Some(folder) => RuleSet::load_dir(folder).map_err(StartError::Rules)?,
            None => RuleSet::builtin(),
        }
        .with_mode(config.rules.mode.into());
        if config.rules.mode == config::RulesMode::Shadow {
            tracing::warn!(
                "rules.mode is shadow: no rule refuses; would-be refusals are counted in \
                 bulwark_shadow_rejections_total"
            );
        }
        let rules = Rules::new(rule_set, config.rules.folder.clone(), metrics.clone());
        rules.spawn_watch();
        let fleet_shares = config.fleet.as_ref().map(|_| FleetShares::new());
        let admission = match &fleet_shares {
            Some(shares) => Admission::in_fleet(
                rules.current().levels(),
                upstream.clone(),
                shares.clone(),
                metrics.clone(),
            ),
            None => Admission::new(rules.current().levels(), upstream.clone(), metrics.clone()),
        };
        let (fleet, fleet_tasks) = match config.fleet.as_ref().zip(fleet_shares) {
            Some((cfg, shares)) => {
                let local = ProxyLocal {
                    upstream: upstream.clone(),
                    admission: admission.clone(),
                };
                let (fleet, tasks) = fleet::start(
                    cfg,
                    config.upstream.bulwark_replicas,
                    config.listen.address,
                    own.clone(),
                    Arc::new(local),
                    shares,
                    metrics.clone(),
                )
                .map_err(StartError::FleetKey)?;
                (Some(fleet), tasks)
            }
            None => (None, Vec::new()),
        };
        let mut reloaded = rules.subscribe();
        let levels_follow = {
            let admission = admission.clone();
            tokio::spawn(async move {
                while reloaded.changed().await.is_ok() {
                    let set = reloaded.borrow_and_update().clone();
                    admission.update_levels(set.levels());
                }
            })
        };
        let rescue = RescueLayer::new(metrics.clone(), config.metrics.identities, access);
        let board = rescue.board();
        let classify = Classify::new(ResourceLabels::new(
            config.cache.resources.iter().map(|gr| gr.resource.as_str()),
        ));
        let identify = Identify::new(tokens, config.identity.anonymous.clone());
        let admit = Admit::new(
            rules.clone(),
            admission.clone(),
            cache.clone(),
            BodyBudget::new(&config.listen.limits),
            BodyDeadlines {
                progress: config.listen.limits.body_progress_timeout,
                whole: config.listen.limits.body_timeout,
            },
            crate::admit::SendProgress {
                timeout: config.listen.limits.send_progress_timeout,
                cut: metrics
                    .responses_cut_total
                    .with_label_values(&["client_not_reading"]),
            },
        );
        // Every worker's request path shares every stage's state; only the connections
        // to the apiservers are each worker's own.
        let path = move |forward: Forward| {
            stack(
                rescue.clone(),
                classify.clone(),
                identify.clone(),
                admit.clone(),
                forward,
            )
        };
        let workers = (0..config.listen.workers)
            .map(|_| Worker::new(path(forward.with_own_connections())))
            .collect::<Result<Vec<_>, _>>()
            .map_err(StartError::Workers)?;
        let service = path(forward);

        let listener = Listener::bind(&config.listen, &metrics).await?;
        let addr = listener.local_addr();
        listener.spawn_reload();
        let (drain, drain_rx) = watch::channel(DrainPhase::Serving);
        let handoff = listener.handoff(service.clone(), drain_rx.clone());
        let serving = tokio::spawn(async move {
            let served = if workers.is_empty() {
                listener.serve(service, drain_rx).await
            } else {
                listener.serve_on(workers, drain_rx).await
            };
            if let Err(e) = served {
                tracing::error!(error = %e, "listener stopped");
            }
        });

        let admin = Arc::new(admin::State {
            metrics,
            upstream,
            rules,
            admission,
            cache,
            fleet,
            board,
            metrics_auth: (config.admin.metrics_access == config::MetricsAccess::Authorized).then(
                || admin::MetricsAuth {
                    tokens: tokens_for_admin,
                    own: own.clone(),
                    scrapers: admin::Scrapers::new(config.cache.access_review_ttl),
                },
            ),
            debug_token: admin::debug_token(&config.admin)?,
            draining: AtomicBool::new(false),
        });
        let admin_tls = match &config.admin.tls {
            Some(tls) => Some(
                crate::listen::ServingTls::load(&tls.cert, &tls.key, &admin.metrics)
                    .map_err(StartError::AdminTls)?,
            ),
            None => None,
        };
        let (admin_addr, admin_task) = admin::serve(
            config.admin.address,
            &config.admin.limits,
            admin.clone(),
            admin_tls,
        )
        .await
        .map_err(StartError::AdminListen)?;
        let reopen = reopen_on_hangup(files.clone());
        tracing::info!(%addr, %admin_addr, "bulwark serving");
        Ok(Running {
            addr,
            admin_addr,
            admin,
            drain,
            handoff,
            shutdown: config.listen.shutdown.clone(),
            tasks: [serving, admin_task, levels_follow]
                .into_iter()
                .chain(fleet_tasks)
                .chain(reopen)
                .chain(review_memory_task)
                .collect(),
            files,
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
    /// notice, GOAWAY, in-flight requests get the grace period, then everything ends.
    pub async fn drain(self) {
        self.admin.draining.store(true, Ordering::SeqCst);
        tracing::info!(pause = ?self.shutdown.pause, "draining: readyz fails");
        tokio::time::sleep(self.shutdown.pause).await;
        let _ = self.drain.send(DrainPhase::GoAway);
        tracing::info!(grace = ?self.shutdown.grace, "draining: GOAWAY sent");
        tokio::time::sleep(self.shutdown.grace).await;
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

/// How often the prefixes trusted for token reviews are written to their file.
const REVIEW_MEMORY_EVERY: std::time::Duration = std::time::Duration::from_secs(60);

/// The file that keeps the prefixes trusted for token reviews across restarts.
#[derive(Clone)]
struct ReviewMemory {
    limits: Arc<crate::identity::limits::ReviewLimits>,
    path: std::path::PathBuf,
    /// One write at a time: the drain's may meet the last periodic one, which an abort does
    /// not stop, and both write the same file beside `path`.
    writing: Arc<std::sync::Mutex<()>>,
}

impl ReviewMemory {
    /// Writes the trusted prefixes; a failure is a warning (the next write may succeed).
    fn save(&self) {
        let _one = self.writing.lock().unwrap_or_else(|p| p.into_inner());
        match self.limits.save(&self.path) {
            Ok(n) => {
                tracing::debug!(prefixes = n, path = %self.path.display(), "token review memory written")
            }
            Err(error) => {
                tracing::warn!(%error, path = %self.path.display(), "token review memory not written")
            }
        }
    }
}

/// Reads the prefixes trusted for token reviews from their file now (a file that does not
/// read, or is too large to be one Bulwark wrote, is a warning and ignored: nobody is
/// trusted yet), then writes them there every [`REVIEW_MEMORY_EVERY`] (and
/// [`Running::drain`] once more at the end).
fn remember_reviews(memory: ReviewMemory) -> JoinHandle<()> {
    let path = memory.path.display();
    match memory.limits.load(&memory.path) {
        Ok(loaded) => {
            tracing::info!(prefixes = loaded.taken, %path, "token review memory read");
            if loaded.skipped > 0 {
                tracing::warn!(lines = loaded.skipped, %path, "token review memory: lines that do not read were skipped");
            }
        }
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
        Err(error) => {
            tracing::warn!(%error, %path, "token review memory not read; nobody is trusted yet")
        }
    }
    tokio::spawn(async move {
        let mut every = tokio::time::interval(REVIEW_MEMORY_EVERY);
        every.tick().await;
        loop {
            every.tick().await;
            let memory = memory.clone();
            let _ = tokio::task::spawn_blocking(move || memory.save()).await;
        }
    })
}

/// Reopens the file logs on every SIGHUP (logrotate moves a file, then sends it); the rules
/// reload on the same signal. `None` without logs, or where signals cannot be had.
fn reopen_on_hangup(files: Vec<LineFile>) -> Option<JoinHandle<()>> {
    if files.is_empty() {
        return None;
    }
    #[cfg(unix)]
    {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
            Ok(mut hangup) => Some(tokio::spawn(async move {
                while hangup.recv().await.is_some() {
                    tracing::info!("SIGHUP: reopening the log files");
                    files.iter().for_each(LineFile::reopen);
                }
            })),
            Err(e) => {
                tracing::warn!("cannot listen for SIGHUP, log files are not reopened: {e}");
                None
            }
        }
    }
    #[cfg(not(unix))]
    None
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
    let tls = UpstreamTls::from_config(&config.upstream)?;
    let upstream = Upstream::new(&config.upstream, tls, metrics.clone())?;
    upstream.spawn_probes();
    let settings = fleet::Settings::from_config(fleet_cfg, config.upstream.bulwark_replicas)
        .map_err(StartError::FleetKey)?;
    let task = fleet::publish_service(&settings, service, own::Client::new(upstream), metrics);
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

//! The client listener and the worker threads that serve its connections.

use std::net::SocketAddr;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::StartError;
use super::path::Stages;
use crate::config;
use crate::listen::{Connections, DrainPhase, Handoff, Listener, Worker};
use crate::metrics::Metrics;
use crate::stages::forward::Forward;

/// The listener, serving.
pub(super) struct Serving {
    /// The address it is bound to.
    pub(super) addr: SocketAddr,
    /// Serves connections the caller opened on the same path.
    pub(super) handoff: Handoff,
    /// Moves the listener through the drain.
    pub(super) drain: watch::Sender<DrainPhase>,
    /// Its client connections, counted: the drain closes them once they are gone.
    pub(super) connections: Connections,
    /// The accept loop.
    pub(super) task: JoinHandle<()>,
}

/// Builds `listen.workers` worker threads, each with the request path over upstream
/// connections of its own (none: connections are served on this runtime), binds the
/// listener, and serves until the drain.
pub(super) async fn serve(
    listen: &config::Listen,
    stages: &Stages,
    forward: Forward,
    metrics: &Metrics,
) -> Result<Serving, StartError> {
    let workers = (0..listen.workers)
        .map(|_| Worker::new(stages.path(forward.with_own_connections())))
        .collect::<Result<Vec<_>, _>>()
        .map_err(StartError::Workers)?;
    let service = stages.path(forward);
    let listener = Listener::bind(listen, metrics).await?;
    let addr = listener.local_addr();
    let connections = listener.connections();
    listener.spawn_reload();
    let (drain, drain_rx) = watch::channel(DrainPhase::Serving);
    let handoff = listener.handoff(service.clone(), drain_rx.clone());
    let task = tokio::spawn(async move {
        let served = if workers.is_empty() {
            listener.serve(service, drain_rx).await
        } else {
            listener.serve_on(workers, drain_rx).await
        };
        if let Err(e) = served {
            tracing::error!(error = %e, "listener stopped");
        }
    });
    Ok(Serving {
        addr,
        handoff,
        drain,
        connections,
        task,
    })
}

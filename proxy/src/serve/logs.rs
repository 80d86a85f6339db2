//! The file logs (audit, access), opened at start and reopened on SIGHUP.

use tokio::task::JoinHandle;

use super::StartError;
use crate::cache::AuditLog;
use crate::config::Config;
use crate::logs::access::AccessLog;
use crate::logs::rotate::{Limits, LineFile};
use crate::metrics::Metrics;

/// The logs the configuration asks for, and their files.
pub(super) struct Logs {
    /// The audit log of reads the cache answers, for the cache.
    pub(super) audit: Option<AuditLog>,
    /// The access log, for the request path's rescue layer.
    pub(super) access: Option<AccessLog>,
    /// Every log's file, reopened on SIGHUP and flushed at the drain.
    pub(super) files: Vec<LineFile>,
}

/// Opens the audit and access logs; a file that cannot be opened stops the start, named.
pub(super) fn open(config: &Config, metrics: &Metrics) -> Result<Logs, StartError> {
    let cannot = |what: &str, path: &std::path::Path, e: std::io::Error| {
        StartError::Admin(std::io::Error::new(
            e.kind(),
            format!("{what} {}: {e}", path.display()),
        ))
    };
    let audit_limits = Limits::new(config.audit.max_size.0, config.audit.max_files);
    let audit = match &config.audit.path {
        Some(path) => Some(
            AuditLog::open(path, audit_limits, metrics)
                .map_err(|e| cannot("audit log", path, e))?,
        ),
        None => None,
    };
    let access = match &config.access_log {
        Some(access) => Some(
            AccessLog::open(
                &access.path,
                access.sample,
                Limits::new(access.max_size.0, access.max_files),
                metrics,
            )
            .map_err(|e| cannot("access log", &access.path, e))?,
        ),
        None => None,
    };
    let files = audit
        .iter()
        .map(|a| a.file().clone())
        .chain(access.iter().map(|a| a.file().clone()))
        .collect();
    Ok(Logs {
        audit,
        access,
        files,
    })
}

/// Reopens the file logs on every SIGHUP (logrotate moves a file, then sends it); the rules
/// reload on the same signal. `None` without logs, or where signals cannot be had.
pub(super) fn reopen_on_hangup(files: Vec<LineFile>) -> Option<JoinHandle<()>> {
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

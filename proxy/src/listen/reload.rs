//! Watching the certificate, key and client CA files: file-system notifications for speed,
//! a periodic re-read as the fallback for whatever notifications miss.
//!
//! Kubernetes updates a mounted Secret by writing a new timestamped folder and renaming a
//! `..data` symlink over the old one; the configured paths (`tls.crt -> ..data/tls.crt`)
//! never change themselves. So the watch is on each file's folder, any event there triggers a
//! re-read through the configured paths, and a content fingerprint decides whether anything
//! actually changed.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use notify::{EventKind, RecursiveMode, Watcher};
use tokio::sync::Notify;

use super::tls::TlsState;

/// Events come in bursts (write, chmod, rename); wait this long so one re-read sees them all.
const SETTLE: Duration = Duration::from_millis(100);

/// Runs until aborted: re-reads the files on every notification and every `interval`.
pub(super) async fn run(state: Arc<TlsState>, interval: Duration) {
    let wake = Arc::new(Notify::new());
    // Kept alive for as long as this task runs; dropping it stops the notifications.
    let _watcher = match watch(&state, wake.clone()) {
        Ok(watcher) => Some(watcher),
        Err(error) => {
            tracing::warn!(
                %error,
                every = ?interval,
                "cannot watch the certificate files; re-reading them periodically only"
            );
            None
        }
    };
    let mut tick = tokio::time::interval(interval.max(SETTLE));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The first tick is immediate, and the files were just read by `bind`.
    tick.tick().await;
    loop {
        tokio::select! {
            _ = wake.notified() => tokio::time::sleep(SETTLE).await,
            _ = tick.tick() => {}
        }
        let checked = state.clone();
        match tokio::task::spawn_blocking(move || checked.check()).await {
            Ok(Ok(true)) => tracing::info!(
                cert = %state.files.cert.display(),
                "serving certificate reloaded; new handshakes use it"
            ),
            Ok(Ok(false)) => {}
            Ok(Err(error)) => tracing::warn!(
                %error,
                "certificate reload failed; keeping the previous certificate"
            ),
            Err(error) => tracing::warn!(%error, "certificate reload task failed"),
        }
    }
}

/// Starts a notification watch on the folder of every configured file.
fn watch(state: &TlsState, wake: Arc<Notify>) -> notify::Result<notify::RecommendedWatcher> {
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        match event {
            // Our own reads show up as access events; reacting to them would loop.
            Ok(event) if matches!(event.kind, EventKind::Access(_)) => {}
            Ok(_) => wake.notify_one(),
            // An overflowed or broken watch: re-read to be safe.
            Err(_) => wake.notify_one(),
        }
    })?;
    let folders: BTreeSet<PathBuf> = state.files.paths().map(folder).collect();
    for dir in folders {
        watcher.watch(&dir, RecursiveMode::NonRecursive)?;
    }
    Ok(watcher)
}

/// The folder holding a file; `.` for a bare file name.
fn folder(path: &Path) -> PathBuf {
    match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent.to_owned(),
        _ => PathBuf::from("."),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn folder_of_a_bare_name_is_the_working_directory() {
        assert_eq!(folder(Path::new("tls.crt")), PathBuf::from("."));
        assert_eq!(
            folder(Path::new("/etc/tls/tls.crt")),
            PathBuf::from("/etc/tls")
        );
    }
}

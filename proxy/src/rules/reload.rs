//! Hot reload: the running rule set, swapped for a new one only once it validated.
//!
//! Triggers: a change in the folder (notify; the parent folder is watched too, so that a
//! folder replaced as a whole, or a ConfigMap's `..data` symlink swap, is seen), debounced
//! so that one update of many files is one reload; and SIGHUP. A failed reload keeps the
//! running set, counts `bulwark_rules_reload_total{result="error"}`, sets
//! `bulwark_rules_stale` to 1 until a reload succeeds (so the alert lasts as long as the bad
//! files do) and logs each problem with its file and line.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use arc_swap::ArcSwap;
use notify::{EventKind, RecursiveMode, Watcher};
use tokio::sync::{mpsc, watch};

use super::{Mode, RuleProblem, RuleSet};
use crate::metrics::Metrics;

/// How long the folder must be quiet before a reload: a ConfigMap update or an editor's
/// save is several events.
const DEBOUNCE: Duration = Duration::from_millis(200);

/// The running rule set and how it is replaced.
pub struct Rules {
    current: ArcSwap<RuleSet>,
    folder: Option<PathBuf>,
    /// `rules.mode`, which every reloaded set runs under as the first did.
    mode: Mode,
    metrics: Metrics,
    publish: watch::Sender<Arc<RuleSet>>,
    /// Serializes reloads, so that an older load never replaces a newer one.
    reloading: Mutex<()>,
}

impl Rules {
    /// Starts with `initial` (validated at startup) read from `folder`, which later
    /// reloads read again under `initial`'s mode ([`RuleSet::with_mode`]); without a folder
    /// only the built-in rules apply and reloads do nothing.
    pub fn new(initial: RuleSet, folder: Option<PathBuf>, metrics: Metrics) -> Arc<Rules> {
        let mode = initial.mode();
        let initial = Arc::new(initial);
        set_loaded_info(&metrics, initial.hash());
        let (publish, _) = watch::channel(initial.clone());
        Arc::new(Rules {
            current: ArcSwap::new(initial),
            folder,
            mode,
            metrics,
            publish,
            reloading: Mutex::new(()),
        })
    }

    /// The running set.
    pub fn current(&self) -> Arc<RuleSet> {
        self.current.load_full()
    }

    /// The folder the rules come from, if any.
    pub fn folder(&self) -> Option<&Path> {
        self.folder.as_deref()
    }

    /// Reads and validates the folder again; on success swaps the new set in (and tells
    /// subscribers when it differs), on failure keeps the running one. Counted either way
    /// in `bulwark_rules_reload_total{result}`; each problem is logged.
    pub fn reload(&self) -> Result<(), Vec<RuleProblem>> {
        let Some(folder) = &self.folder else {
            return Ok(());
        };
        let _serial = self
            .reloading
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        match RuleSet::load_dir(folder).map(|set| set.with_mode(self.mode)) {
            Ok(set) => {
                self.metrics
                    .rules_reload_total
                    .with_label_values(&["success"])
                    .inc();
                self.metrics.rules_stale.set(0);
                if set.hash() == self.current.load().hash() {
                    tracing::debug!(hash = set.hash(), "rules reloaded, unchanged");
                    return Ok(());
                }
                let set = Arc::new(set);
                tracing::info!(
                    folder = %folder.display(),
                    hash = set.hash(),
                    levels = set.levels().len(),
                    rules = set.rule_names().len(),
                    "rules reloaded"
                );
                set_loaded_info(&self.metrics, set.hash());
                self.current.store(set.clone());
                self.publish.send_replace(set);
                Ok(())
            }
            Err(problems) => {
                self.metrics
                    .rules_reload_total
                    .with_label_values(&["error"])
                    .inc();
                self.metrics.rules_stale.set(1);
                for problem in &problems {
                    tracing::error!(
                        file = %problem.file.display(),
                        line = problem.line,
                        column = problem.column,
                        "rules reload failed, keeping the running rules: {}",
                        problem.message
                    );
                }
                Err(problems)
            }
        }
    }

    /// A receiver that sees every new set (admission rebuilds its levels from it).
    pub fn subscribe(&self) -> watch::Receiver<Arc<RuleSet>> {
        self.publish.subscribe()
    }

    /// Reloads on folder changes and SIGHUP, for as long as `self` lives. Call within a
    /// tokio runtime. A folder that cannot be watched is logged; SIGHUP still works.
    pub fn spawn_watch(self: &Arc<Self>) {
        let Some(folder) = self.folder.clone() else {
            return;
        };
        // Capacity 1 and `try_send`: triggers while one is pending coalesce into it.
        let (trigger, mut triggered) = mpsc::channel::<()>(1);

        let on_event = {
            let trigger = trigger.clone();
            let folder = folder.clone();
            move |event: notify::Result<notify::Event>| match event {
                Ok(event) if is_change(&event, &folder) => {
                    let _ = trigger.try_send(());
                }
                Ok(_) => {}
                Err(e) => tracing::warn!("watching the rules folder: {e}"),
            }
        };
        let mut watcher = match notify::recommended_watcher(on_event) {
            Ok(watcher) => Some(watcher),
            Err(e) => {
                tracing::warn!("cannot watch the rules folder, reload with SIGHUP: {e}");
                None
            }
        };
        if let Some(watcher) = &mut watcher {
            if let Some(parent) = folder.parent().filter(|p| !p.as_os_str().is_empty())
                && let Err(e) = watcher.watch(parent, RecursiveMode::NonRecursive)
            {
                tracing::warn!(folder = %parent.display(), "cannot watch: {e}");
            }
            rewatch(watcher, &folder);
        }

        #[cfg(unix)]
        {
            let trigger = trigger.clone();
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
                Ok(mut hangup) => {
                    tokio::spawn(async move {
                        while hangup.recv().await.is_some() {
                            tracing::info!("SIGHUP: reloading the rules");
                            if trigger.send(()).await.is_err() {
                                break;
                            }
                        }
                    });
                }
                Err(e) => tracing::warn!("cannot listen for SIGHUP: {e}"),
            }
        }
        drop(trigger);

        let rules: Weak<Rules> = Arc::downgrade(self);
        tokio::spawn(async move {
            while triggered.recv().await.is_some() {
                // Wait until the folder is quiet.
                loop {
                    tokio::time::sleep(DEBOUNCE).await;
                    if triggered.try_recv().is_err() {
                        break;
                    }
                }
                // Watch again before reading: the folder may have been replaced, and a
                // change from now on must trigger another reload.
                if let Some(watcher) = &mut watcher {
                    rewatch(watcher, &folder);
                }
                let Some(rules) = rules.upgrade() else {
                    break;
                };
                // Problems are logged and counted by `reload`.
                let _ = tokio::task::spawn_blocking(move || rules.reload()).await;
            }
        });
    }
}

/// Watches `folder` afresh (after it may have been replaced).
fn rewatch(watcher: &mut notify::RecommendedWatcher, folder: &Path) {
    let _ = watcher.unwatch(folder);
    if let Err(e) = watcher.watch(folder, RecursiveMode::NonRecursive) {
        tracing::warn!(folder = %folder.display(), "cannot watch the rules folder: {e}");
    }
}

/// Whether a notify event may change the rules: a change (not a read, which our own
/// reloads cause) in the folder or to the folder itself.
fn is_change(event: &notify::Event, folder: &Path) -> bool {
    let write = match event.kind {
        EventKind::Access(notify::event::AccessKind::Close(notify::event::AccessMode::Write)) => {
            true
        }
        EventKind::Access(_) => false,
        _ => true,
    };
    write && event.paths.iter().any(|p| p.starts_with(folder))
}

fn set_loaded_info(metrics: &Metrics, hash: &str) {
    metrics.rules_loaded_info.reset();
    metrics.rules_loaded_info.with_label_values(&[hash]).set(1);
}

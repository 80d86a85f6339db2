//! The cache of token reviews, and the file that keeps the prefixes it trusts across
//! restarts.

use std::sync::Arc;

use tokio::task::JoinHandle;

use crate::config;
use crate::identity::{TokenCache, UpstreamReviewer};
use crate::metrics::Metrics;
use crate::own;

/// The token cache, reviewing upstream with Bulwark's own credential, and the memory of its
/// trusted prefixes where `identity.tokenReview.memoryFile` asks for one (read now, written
/// every minute by the task returned).
pub(super) fn start(
    settings: &config::TokenReview,
    own: &own::Client,
    metrics: &Metrics,
) -> (
    Arc<TokenCache>,
    Option<ReviewMemory>,
    Option<JoinHandle<()>>,
) {
    let reviewer = UpstreamReviewer::new(own.clone());
    let tokens = Arc::new(TokenCache::new(
        Arc::new(reviewer),
        settings.clone(),
        metrics.clone(),
    ));
    let memory = settings.memory_file.clone().map(|path| ReviewMemory {
        limits: tokens.review_limits().clone(),
        path,
        writing: Arc::default(),
    });
    let task = memory.clone().map(remember_reviews);
    (tokens, memory, task)
}

/// How often the prefixes trusted for token reviews are written to their file.
const REVIEW_MEMORY_EVERY: std::time::Duration = std::time::Duration::from_secs(60);

/// The file that keeps the prefixes trusted for token reviews across restarts.
#[derive(Clone)]
pub(super) struct ReviewMemory {
    limits: Arc<crate::identity::limits::ReviewLimits>,
    path: std::path::PathBuf,
    /// One write at a time: the drain's may meet the last periodic one, which an abort does
    /// not stop, and both write the same file beside `path`.
    writing: Arc<std::sync::Mutex<()>>,
}

impl ReviewMemory {
    /// Writes the trusted prefixes; a failure is a warning (the next write may succeed).
    pub(super) fn save(&self) {
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
/// [`super::Running::drain`] once more at the end).
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

//! The send-progress deadline of a response that holds what others wait for.
//!
//! A permit lives as long as its response body, and hyper polls a body only when the
//! client can take more: over HTTP/2 when the stream's window has room, over HTTP/1.1 when
//! the socket drains. A client that opens its window to nothing (or stops reading its
//! socket) would hold its seats and LIST bytes for as long as it keeps the connection.
//! So a response that holds them, once it has handed the connection data and is waiting for
//! the client to take it, is watched: no poll for `listen.limits.sendProgressTimeout`
//! gives the permit back at once and ends the response: an error at its next poll resets
//! the stream, and since a stream the client gives no room to is never polled again, the
//! connection is told to close (GOAWAY, then dropped a second later, counted as
//! `bulwark_connections_closed_total{reason="client_not_reading"}`), as Go's HTTP/2 server
//! closes a connection that takes no byte within its write timeout. A body waiting on the apiserver is the upstream stall timer's
//! business, not this one's. The apiserver does the same to a handler stuck writing to a
//! client that does not read, at its request timeout.
//!
//! Each such body is watched from the moment it is handed to the connection (a client
//! whose window is shut from the start never lets it be polled at all), by one small task
//! that wakes four times a deadline and ends with the body. A body that holds nothing
//! others wait for (an exempt request's, a watch once started) is not watched.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use prometheus::IntCounter;
use tokio::time::Instant;

use super::Permit;
use crate::listen::ConnAuth;

/// The largest frame a watched body hands the connection at once: one HTTP/2 DATA frame
/// of the default size. hyper polls a body again only once what it handed over has gone
/// out, so a client that reads slowly but steadily polls it at least once a chunk.
pub(super) const CHUNK: usize = 16 * 1024;

/// How a response's progress is watched: the deadline, and the counter of responses cut.
#[derive(Clone, Debug)]
pub struct SendProgress {
    /// The longest time a response may wait for its client with seats or bytes held.
    pub timeout: Duration,
    /// `bulwark_responses_cut_total{reason="client_not_reading"}`.
    pub cut: IntCounter,
}

/// What a watched body shares with its watchdog.
pub(super) struct Progress {
    /// Polls so far, shifted left by one; the low bit is set while the last poll handed the
    /// connection data, so that the next one waits for the client.
    polls: AtomicU64,
    /// The permit, given back by the watchdog when the client stalls.
    permit: Mutex<Option<Permit>>,
    /// Set when the watchdog cut the response.
    cut: AtomicBool,
}

impl Progress {
    /// Starts watching a body that holds `permit`, just handed to the connection: until it
    /// is polled it waits for the client.
    pub(super) fn watch(
        permit: Permit,
        send: &SendProgress,
        conn: Option<Arc<ConnAuth>>,
    ) -> Arc<Progress> {
        let progress = Arc::new(Progress {
            polls: AtomicU64::new(1),
            permit: Mutex::new(Some(permit)),
            cut: AtomicBool::new(false),
        });
        tokio::spawn(watchdog(
            Arc::downgrade(&progress),
            send.timeout,
            send.cut.clone(),
            conn,
        ));
        progress
    }

    /// Records a poll: `handed` when it gave the connection data.
    pub(super) fn polled(&self, handed: bool) {
        let polls = self.polls.load(Ordering::Relaxed);
        self.polls.store(
            ((polls >> 1) + 1) << 1 | u64::from(handed),
            Ordering::Relaxed,
        );
    }

    /// The permit back, unless the watchdog gave it back already; the watching ends.
    pub(super) fn into_permit(self: Arc<Self>) -> Option<Permit> {
        self.permit.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    /// Whether the watchdog cut the response.
    pub(super) fn is_cut(&self) -> bool {
        self.cut.load(Ordering::Relaxed)
    }
}

/// Gives the permit back once the body has waited for its client for `timeout`: the poll
/// count stayed the same, with data handed over, for that long (seen at a tick, so the cut
/// comes `timeout` to `timeout` and a quarter after the last poll).
async fn watchdog(
    progress: Weak<Progress>,
    timeout: Duration,
    cut: IntCounter,
    conn: Option<Arc<ConnAuth>>,
) {
    let tick = (timeout / 4).max(Duration::from_millis(1));
    let mut last = None;
    let mut since = Instant::now();
    loop {
        tokio::time::sleep(tick).await;
        let Some(progress) = progress.upgrade() else {
            return;
        };
        let seen = progress.polls.load(Ordering::Relaxed);
        let now = Instant::now();
        if last != Some(seen) || seen & 1 == 0 {
            last = Some(seen);
            since = now;
            continue;
        }
        if now.duration_since(since) >= timeout {
            progress.cut.store(true, Ordering::Relaxed);
            let permit = progress
                .permit
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take();
            drop(permit);
            cut.inc();
            if let Some(conn) = conn {
                conn.stalled();
            }
            tracing::info!(
                timeout = %humantime::format_duration(timeout),
                "a client did not read its response; its seats and LIST bytes are given back \
                 and the response is cut off"
            );
            return;
        }
    }
}

//! Bulwark's own HTTP/2 connection pool: per replica and credential a set of connections,
//! another one opened when every stream slot is taken, dead ones dropped.
//!
//! hyper-util's pooled client queues at the stream limit and never opens a second
//! connection, which is how one replica ends up with most of the load; this pool counts
//! streams itself.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::client::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use rustls_pki_types::ServerName;
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

use super::pick::Replica;
use super::tls::{Alpn, UpstreamTls};
use super::{TlsFailure, UpstreamCredential, UpstreamError};

/// The request body type on upstream connections: buffered, so that a retry can replay it.
pub(crate) type ReqBody = Full<Bytes>;

/// Receive window of one stream. With the connection window at least the sum of all stream
/// windows, a stream whose reader stalls fills only its own window and never starves the
/// other streams of the connection.
const STREAM_WINDOW: u32 = 1024 * 1024;

/// Largest window HTTP/2 allows.
const MAX_WINDOW: u64 = (1 << 31) - 1;

/// HTTP/2 keepalive pings find a dead replica behind a quiet watch.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);

/// A replica that does not answer a ping within this is treated as gone.
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);

/// Extra connections (beyond one per set) idle this long are closed, so a burst does not
/// leave connections open forever.
const IDLE_CLOSE: Duration = Duration::from_secs(90);

/// One pooled HTTP/2 connection.
pub(crate) struct Conn {
    sender: http2::SendRequest<ReqBody>,
    /// Streams currently using the connection (requests sent, responses not yet finished).
    in_use: AtomicU32,
    /// When `in_use` last dropped to zero.
    idle_since: Mutex<Instant>,
}

/// A stream slot on a pooled connection, held until the response body is done.
pub(crate) struct Lease {
    conn: Arc<Conn>,
}

impl Drop for Lease {
    fn drop(&mut self) {
        if self.conn.in_use.fetch_sub(1, Ordering::AcqRel) == 1 {
            *lock(&self.conn.idle_since) = Instant::now();
        }
    }
}

/// The connections of one (replica, credential) pair.
#[derive(Default)]
struct ConnSet {
    conns: Mutex<Vec<Arc<Conn>>>,
    /// One connection is opened at a time per set: a new connection serves a hundred
    /// waiting requests, so a burst does not open a hundred connections.
    gate: tokio::sync::Mutex<()>,
    /// The last failed connect, so that requests queued behind it fail at once instead of
    /// each waiting out its own connect timeout.
    last_failure: Mutex<Option<(Instant, UpstreamError)>>,
}

/// Per replica and credential, the pooled connections.
pub(crate) struct Pool {
    sets: Vec<[ConnSet; 3]>,
    server_names: Vec<ServerName<'static>>,
    tls: UpstreamTls,
    connect_timeout: Duration,
    streams_per_connection: u32,
    /// Where new connections are made and driven: the runtime the pool was made on, for a
    /// pool that every worker thread uses (the main one: reviews, probes, the watch cache,
    /// the fleet's Leases), so that its connections never live on one worker's runtime and
    /// die with it. `None` for a worker's own pool, whose connections live on the worker.
    home: Option<tokio::runtime::Handle>,
}

/// The first of the connections (by their streams in use) with a slot free under `limit`.
fn first_with_room(in_use: impl IntoIterator<Item = u32>, limit: u32) -> Option<usize> {
    in_use.into_iter().position(|streams| streams < limit)
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // The data under these locks stays consistent even if a holder panicked.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn credential_index(credential: UpstreamCredential) -> usize {
    match credential {
        UpstreamCredential::FrontProxy => 0,
        UpstreamCredential::Own => 1,
        UpstreamCredential::Anonymous => 2,
    }
}

impl Pool {
    /// A pool for the replicas; `server_name` overrides the name verified in every
    /// replica's certificate (default: the replica's host).
    pub(crate) fn new(
        replicas: &[Arc<Replica>],
        server_name: Option<&ServerName<'static>>,
        tls: UpstreamTls,
        connect_timeout: Duration,
        streams_per_connection: u32,
    ) -> Result<Self, UpstreamError> {
        let server_names = replicas
            .iter()
            .map(|r| match server_name {
                Some(name) => Ok(name.clone()),
                None => ServerName::try_from(r.host.clone()).map_err(|_| {
                    UpstreamError::Config(format!("{:?} is not a valid TLS server name", r.host))
                }),
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            sets: replicas.iter().map(|_| Default::default()).collect(),
            server_names,
            tls,
            connect_timeout,
            streams_per_connection: streams_per_connection.max(1),
            home: tokio::runtime::Handle::try_current().ok(),
        })
    }

    /// A pool for the same replicas with the same settings, and no connection yet.
    pub(crate) fn empty_like(&self) -> Pool {
        Pool {
            sets: self.sets.iter().map(|_| Default::default()).collect(),
            server_names: self.server_names.clone(),
            tls: self.tls.clone(),
            connect_timeout: self.connect_timeout,
            streams_per_connection: self.streams_per_connection,
            home: None,
        }
    }

    /// Connections open to a replica, all credentials together.
    pub(crate) fn connections(&self, replica: usize) -> usize {
        self.sets[replica]
            .iter()
            .map(|set| {
                let mut conns = lock(&set.conns);
                conns.retain(|c| !c.sender.is_closed());
                conns.len()
            })
            .sum()
    }

    /// A stream slot and a sender on a connection to the replica with the credential,
    /// opening a connection when every existing one is full.
    pub(crate) async fn acquire(
        self: &Arc<Self>,
        replica: &Arc<Replica>,
        index: usize,
        credential: UpstreamCredential,
    ) -> Result<(Lease, http2::SendRequest<ReqBody>), UpstreamError> {
        let set = &self.sets[index][credential_index(credential)];
        if let Some(found) = self.lease(set) {
            return Ok(found);
        }
        let waited_from = Instant::now();
        let _gate = set.gate.lock().await;
        if let Some(found) = self.lease(set) {
            return Ok(found);
        }
        if let Some((at, error)) = lock(&set.last_failure).as_ref()
            && *at >= waited_from
        {
            return Err(error.clone());
        }
        let connect = {
            let (pool, replica) = (self.clone(), replica.clone());
            async move { pool.connect_h2(&replica, index, credential).await }
        };
        let connected = match &self.home {
            Some(home) => home.spawn(connect).await.unwrap_or_else(|failed| {
                Err(UpstreamError::Connect {
                    replica: replica.name.clone(),
                    source: Arc::new(std::io::Error::other(format!(
                        "the connecting task ended: {failed}"
                    ))),
                })
            }),
            // Boxed: a connection's TLS handshake is a large future, and every request's
            // future would carry (and move) it inline although almost none connects.
            None => Box::pin(connect).await,
        };
        match connected {
            Ok(sender) => {
                let conn = Arc::new(Conn {
                    sender: sender.clone(),
                    in_use: AtomicU32::new(1),
                    idle_since: Mutex::new(Instant::now()),
                });
                lock(&set.conns).push(conn.clone());
                Ok((Lease { conn }, sender))
            }
            Err(error) => {
                *lock(&set.last_failure) = Some((Instant::now(), error.clone()));
                Err(error)
            }
        }
    }

    /// The oldest live connection with a free stream slot, if any; drops closed
    /// connections and extra idle ones on the way.
    ///
    /// Streams are packed onto the first connections rather than spread over all: the
    /// frames of many streams then leave and arrive in one write and one read, and after a
    /// burst the extra connections fall idle and close. This is how Go's HTTP/2 transport
    /// and Envoy use a pool too.
    fn lease(&self, set: &ConnSet) -> Option<(Lease, http2::SendRequest<ReqBody>)> {
        let mut conns = lock(&set.conns);
        conns.retain(|c| !c.sender.is_closed());
        if conns.len() > 1 {
            let now = Instant::now();
            let mut position = 0;
            conns.retain(|c| {
                let idle = c.in_use.load(Ordering::Acquire) == 0
                    && now.saturating_duration_since(*lock(&c.idle_since)) >= IDLE_CLOSE;
                position += 1;
                // Keep the first connection even when idle; it is the warm one.
                position == 1 || !idle
            });
        }
        let in_use = conns.iter().map(|c| c.in_use.load(Ordering::Acquire));
        let conn = conns[first_with_room(in_use, self.streams_per_connection)?].clone();
        conn.in_use.fetch_add(1, Ordering::AcqRel);
        let sender = conn.sender.clone();
        Some((Lease { conn }, sender))
    }

    /// TCP, TLS with the credential's client certificate and the given ALPN, within the
    /// connect timeout.
    async fn connect_tls(
        &self,
        replica: &Replica,
        index: usize,
        credential: UpstreamCredential,
        alpn: Alpn,
    ) -> Result<TlsStream<TcpStream>, UpstreamError> {
        let config = self.tls.client_config(credential, alpn)?;
        let name = &replica.name;
        let tcp = TcpStream::connect((replica.host.as_str(), replica.port))
            .await
            .map_err(|e| UpstreamError::Connect {
                replica: name.clone(),
                source: Arc::new(e),
            })?;
        // Requests are small and latency matters more than packet count.
        let _ = tcp.set_nodelay(true);
        let tls = TlsConnector::from(config)
            .connect(self.server_names[index].clone(), tcp)
            .await
            .map_err(|e| UpstreamError::Tls {
                replica: name.clone(),
                source: Arc::new(TlsFailure::Handshake(e)),
            })?;
        let wanted: &[u8] = match alpn {
            Alpn::H2 => b"h2",
            Alpn::Http1 => b"http/1.1",
        };
        match tls.get_ref().1.alpn_protocol() {
            Some(got) if got == wanted => Ok(tls),
            // No ALPN at all means HTTP/1.1 by convention.
            None if alpn == Alpn::Http1 => Ok(tls),
            got => Err(UpstreamError::Tls {
                replica: name.clone(),
                source: Arc::new(TlsFailure::Alpn {
                    got: got.map(|p| String::from_utf8_lossy(p).into_owned()),
                    wanted: String::from_utf8_lossy(wanted).into_owned(),
                }),
            }),
        }
    }

    async fn connect_h2(
        &self,
        replica: &Replica,
        index: usize,
        credential: UpstreamCredential,
    ) -> Result<http2::SendRequest<ReqBody>, UpstreamError> {
        let connect = async {
            let tls = self
                .connect_tls(replica, index, credential, Alpn::H2)
                .await?;
            let connection_window =
                (u64::from(STREAM_WINDOW) * u64::from(self.streams_per_connection)).min(MAX_WINDOW);
            let mut builder = http2::Builder::new(TokioExecutor::new());
            builder
                .timer(TokioTimer::new())
                .initial_stream_window_size(STREAM_WINDOW)
                .initial_connection_window_size(connection_window as u32)
                .adaptive_window(false)
                .initial_max_send_streams(self.streams_per_connection as usize)
                .keep_alive_interval(KEEPALIVE_INTERVAL)
                .keep_alive_timeout(KEEPALIVE_TIMEOUT)
                .keep_alive_while_idle(true);
            let (sender, connection) = builder
                .handshake(TokioIo::new(tls))
                .await
                .map_err(|e| UpstreamError::protocol(&replica.name, e))?;
            let name = replica.name.clone();
            tokio::spawn(async move {
                if let Err(e) = connection.await {
                    tracing::debug!(replica = %name, error = %e, "upstream connection ended");
                }
            });
            Ok(sender)
        };
        tokio::time::timeout(self.connect_timeout, connect)
            .await
            .map_err(|_| self.connect_timed_out(replica))?
    }

    /// No connection to `replica` within the connect timeout.
    fn connect_timed_out(&self, replica: &Replica) -> UpstreamError {
        UpstreamError::Connect {
            replica: replica.name.clone(),
            source: Arc::new(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no connection within {:?}", self.connect_timeout),
            )),
        }
    }

    /// A fresh HTTP/1.1 connection for one upgrade (exec, attach, port-forward); never
    /// pooled, because after the upgrade it belongs to that one stream.
    pub(crate) async fn connect_http1(
        &self,
        replica: &Replica,
        index: usize,
        credential: UpstreamCredential,
    ) -> Result<http1::SendRequest<ReqBody>, UpstreamError> {
        let connect = async {
            let tls = self
                .connect_tls(replica, index, credential, Alpn::Http1)
                .await?;
            let (sender, connection) = http1::handshake(TokioIo::new(tls))
                .await
                .map_err(|e| UpstreamError::protocol(&replica.name, e))?;
            let name = replica.name.clone();
            tokio::spawn(async move {
                if let Err(e) = connection.with_upgrades().await {
                    tracing::debug!(replica = %name, error = %e, "upgrade connection ended");
                }
            });
            Ok(sender)
        };
        tokio::time::timeout(self.connect_timeout, connect)
            .await
            .map_err(|_| self.connect_timed_out(replica))?
    }
}

#[cfg(test)]
mod tests {
    use super::first_with_room;

    #[test]
    fn streams_fill_the_oldest_connection_with_room_before_the_next() {
        // Not the least used (the third): the first with room, so streams share writes.
        assert_eq!(first_with_room([1, 1, 0], 100), Some(0));
        assert_eq!(first_with_room([100, 99, 0], 100), Some(1));
        assert_eq!(first_with_room([100, 100], 100), None);
        assert_eq!(first_with_room([], 100), None);
    }
}

//! The PROXY protocol (v1 and v2) ahead of TLS: who may send a header, reading exactly the
//! header, and a stream that gives back the bytes read past it.
//!
//! A load balancer in TCP mode hides the client's address: every connection comes from the
//! balancer. With `send-proxy-v2` (HAProxy), `proxy_protocol on` (nginx) or Envoy's
//! upstream PROXY protocol, the balancer writes the client's address before the client's
//! first byte. Only the configured balancers may do so: anyone else could claim any address
//! and dodge every per-source limit, so a header from anyone else is refused.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, BytesMut};
use ipnet::IpNet;
use ppp::{HeaderResult, PartialResult, v1, v2};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};

use crate::config;

/// The longest header taken: a v1 header is at most 107 bytes; a v2 header carries TLVs
/// (HAProxy's are a few dozen bytes), and 16 + 65,535 bytes from a peer is not worth holding.
const MAX_HEADER: usize = 4096;

/// A v2 header's fixed part: signature, version and command, family, length.
const V2_FIXED: usize = 16;

/// The longest v1 header, CR LF included.
const V1_MAX: usize = 107;

/// The v1 header's first bytes.
const V1_SIGNATURE: &[u8] = b"PROXY ";

/// Which peers may send a header, and whether they must.
#[derive(Debug, Clone)]
pub(super) struct Trust {
    sources: Vec<IpNet>,
    required: bool,
}

impl Trust {
    /// The listener's PROXY protocol settings; `None` when it is off.
    pub(super) fn from_config(cfg: Option<&config::ProxyProtocol>) -> Option<Trust> {
        cfg.map(|cfg| Trust {
            sources: cfg.trusted_sources.clone(),
            required: cfg.required,
        })
    }

    /// Whether `peer` is one of the balancers that may send a header.
    pub(super) fn trusts(&self, peer: IpAddr) -> bool {
        let peer = peer.to_canonical();
        self.sources.iter().any(|net| net.contains(&peer))
    }
}

/// Why a connection was refused before its TLS handshake.
#[derive(Debug, thiserror::Error)]
pub(super) enum Refused {
    /// A PROXY header from a peer outside the trusted sources.
    #[error("PROXY protocol header from an untrusted peer")]
    Untrusted,
    /// A trusted peer sent no header where one is required.
    #[error("no PROXY protocol header from a trusted peer")]
    Missing,
    /// The header does not parse.
    #[error("malformed PROXY protocol header: {0}")]
    Malformed(String),
    /// The header is longer than [`MAX_HEADER`].
    #[error("PROXY protocol header longer than {MAX_HEADER} bytes")]
    TooLong,
    /// The peer closed the connection before its header was complete.
    #[error("closed before the PROXY protocol header was complete")]
    Silent,
    /// The header was not complete within the PROXY header timeout.
    #[error("no complete PROXY protocol header within the timeout")]
    Timeout,
    /// Reading from the socket failed.
    #[error("reading the connection failed: {0}")]
    Io(#[from] io::Error),
}

impl Refused {
    /// The `reason` label of `bulwark_connections_refused_total`.
    pub(super) fn reason(&self) -> &'static str {
        match self {
            Refused::Untrusted => "proxy_header_untrusted",
            Refused::Missing => "proxy_header_missing",
            Refused::Malformed(_) | Refused::TooLong => "proxy_header_malformed",
            Refused::Silent | Refused::Io(_) => "proxy_header_silent",
            Refused::Timeout => "proxy_header_timeout",
        }
    }
}

/// Reads the PROXY header where `trust` expects one and returns the stream positioned at
/// the client's first byte with the client's address: the header's source where a trusted
/// peer sent one, else `peer`. With the protocol off (`trust` is `None`) nothing is read.
pub(super) async fn accept<S>(
    mut stream: S,
    peer: SocketAddr,
    trust: Option<&Trust>,
    timeout: Duration,
) -> Result<(Rewind<S>, SocketAddr), Refused>
where
    S: AsyncRead + Unpin,
{
    let Some(trust) = trust else {
        return Ok((Rewind::new(BytesMut::new(), stream), peer));
    };
    let mut buf = BytesMut::with_capacity(512);
    let read = tokio::time::timeout(timeout, async {
        loop {
            match signature(&buf) {
                Signature::Unsure => {}
                Signature::Absent => return Ok(None),
                Signature::Present => {
                    if let Some(found) = header(&buf)? {
                        return Ok(Some(found));
                    }
                }
            }
            if buf.len() >= MAX_HEADER {
                return Err(Refused::TooLong);
            }
            if stream.read_buf(&mut buf).await? == 0 {
                return Err(Refused::Silent);
            }
            // Refuse an untrusted header as soon as its signature shows, before reading it.
            if matches!(signature(&buf), Signature::Present) && !trust.trusts(peer.ip()) {
                return Err(Refused::Untrusted);
            }
        }
    });
    let found = read.await.map_err(|_| Refused::Timeout)??;
    let client = match found {
        Some((len, source)) => {
            buf.advance(len);
            source.unwrap_or(peer)
        }
        None if trust.required && trust.trusts(peer.ip()) => return Err(Refused::Missing),
        None => peer,
    };
    Ok((Rewind::new(buf, stream), client))
}

/// Whether the bytes so far begin a PROXY header.
enum Signature {
    /// Too few bytes to tell.
    Unsure,
    /// They do not (a TLS record starts with 0x16).
    Absent,
    /// They begin the v1 or v2 signature.
    Present,
}

fn signature(buf: &[u8]) -> Signature {
    let matches = |sig: &[u8]| {
        let n = buf.len().min(sig.len());
        buf[..n] == sig[..n]
    };
    let (v1, v2) = (matches(V1_SIGNATURE), matches(v2::PROTOCOL_PREFIX));
    if buf.is_empty() || (v1 && buf.len() < V1_SIGNATURE.len()) {
        Signature::Unsure
    } else if v1 || v2 {
        // A complete v1 signature, or as much of v2's as has arrived: the 12-byte v2
        // signature begins with CR LF CR LF NUL, which no TLS record or HTTP request does.
        Signature::Present
    } else {
        Signature::Absent
    }
}

/// The header's length and the client address it carries (`None` for a LOCAL command or
/// an unknown or UNIX address family: the peer itself is the client); `Ok(None)` when more
/// bytes are needed.
#[allow(clippy::type_complexity)]
fn header(buf: &[u8]) -> Result<Option<(usize, Option<SocketAddr>)>, Refused> {
    if buf.len() >= V2_FIXED && buf.starts_with(v2::PROTOCOL_PREFIX) {
        let declared = usize::from(u16::from_be_bytes([buf[14], buf[15]]));
        if V2_FIXED + declared > MAX_HEADER {
            return Err(Refused::TooLong);
        }
    }
    // ppp takes a v1 line with fields missing for one still arriving, and an UNKNOWN line
    // without its CR LF for a whole one: a v1 header is read up to its first CR, which must
    // be followed by LF (within 107 bytes), and once that is in nothing more can complete it.
    let v1_line = if buf.starts_with(V1_SIGNATURE) {
        match buf.iter().position(|&b| b == b'\r') {
            Some(cr) if cr + 2 > V1_MAX => {
                return Err(Refused::Malformed(format!(
                    "no CR LF within {V1_MAX} bytes"
                )));
            }
            Some(cr) if cr + 1 == buf.len() => return Ok(None),
            Some(cr) if buf[cr + 1] != b'\n' => {
                return Err(Refused::Malformed("a CR without its LF".into()));
            }
            Some(cr) => Some(&buf[..cr + 2]),
            None if buf.len() >= V1_MAX => {
                return Err(Refused::Malformed(format!(
                    "no CR LF within {V1_MAX} bytes"
                )));
            }
            None => return Ok(None),
        }
    } else {
        None
    };
    let parsed = HeaderResult::parse(v1_line.unwrap_or(buf));
    if parsed.is_incomplete() {
        return match v1_line {
            Some(_) => Err(Refused::Malformed("the v1 line lacks fields".into())),
            None => Ok(None),
        };
    }
    match parsed {
        HeaderResult::V1(Ok(h)) => {
            let source = match h.addresses {
                v1::Addresses::Tcp4(a) => Some(SocketAddr::from((a.source_address, a.source_port))),
                v1::Addresses::Tcp6(a) => Some(SocketAddr::from((a.source_address, a.source_port))),
                v1::Addresses::Unknown => None,
            };
            Ok(Some((h.header.len(), source)))
        }
        HeaderResult::V2(Ok(h)) => {
            let source = match (h.command, h.addresses) {
                (v2::Command::Local, _) => None,
                (v2::Command::Proxy, v2::Addresses::IPv4(a)) => {
                    Some(SocketAddr::from((a.source_address, a.source_port)))
                }
                (v2::Command::Proxy, v2::Addresses::IPv6(a)) => {
                    Some(SocketAddr::from((a.source_address, a.source_port)))
                }
                (v2::Command::Proxy, v2::Addresses::Unspecified | v2::Addresses::Unix(_)) => None,
            };
            Ok(Some((h.len(), source)))
        }
        HeaderResult::V1(Err(e)) => Err(Refused::Malformed(e.to_string())),
        HeaderResult::V2(Err(e)) => Err(Refused::Malformed(e.to_string())),
    }
}

/// For the fuzz target: what the start of a trusted balancer's connection holds. `Ok(None)`:
/// no header, or not all of it yet; `Ok(Some((len, source)))`: a header of `len` bytes;
/// `Err`: why the connection would be refused.
#[allow(clippy::type_complexity)]
pub fn at_start(buf: &[u8]) -> Result<Option<(usize, Option<SocketAddr>)>, String> {
    match signature(buf) {
        Signature::Unsure | Signature::Absent => Ok(None),
        Signature::Present => header(buf).map_err(|e| e.to_string()),
    }
}

/// A stream that first yields the bytes read past the PROXY header (the start of the TLS
/// ClientHello), then reads from the socket; writes go straight through.
#[derive(Debug)]
pub struct Rewind<S> {
    prefix: BytesMut,
    inner: S,
}

impl<S> Rewind<S> {
    fn new(prefix: BytesMut, inner: S) -> Self {
        Rewind { prefix, inner }
    }

    /// The stream underneath.
    pub(super) fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Rewind<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if !self.prefix.is_empty() {
            let n = self.prefix.len().min(buf.remaining());
            buf.put_slice(&self.prefix[..n]);
            self.prefix.advance(n);
            if self.prefix.is_empty() {
                // Nothing more to give back: free the read-ahead buffer for the connection's
                // lifetime.
                self.prefix = BytesMut::new();
            }
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Rewind<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    const TLS_START: &[u8] = &[0x16, 0x03, 0x01, 0x00, 0x05, 1, 2, 3, 4, 5];

    fn trust(required: bool) -> Trust {
        Trust {
            sources: vec!["10.0.0.0/8".parse().unwrap(), "fd00::/8".parse().unwrap()],
            required,
        }
    }

    fn balancer() -> SocketAddr {
        "10.1.2.3:40000".parse().unwrap()
    }

    fn v2_header(client: SocketAddr, server: SocketAddr) -> Vec<u8> {
        v2::Builder::with_addresses(
            v2::Version::Two | v2::Command::Proxy,
            v2::Protocol::Stream,
            (client, server),
        )
        .build()
        .unwrap()
    }

    /// Sends `bytes` in pieces of `chunk` and runs [`accept`] on the other end; returns the
    /// client address and everything read after it.
    async fn run(
        bytes: Vec<u8>,
        chunk: usize,
        peer: SocketAddr,
        trust: Option<&Trust>,
    ) -> Result<(SocketAddr, Vec<u8>), Refused> {
        let (mut tx, rx) = tokio::io::duplex(64);
        tokio::spawn(async move {
            for piece in bytes.chunks(chunk) {
                if tx.write_all(piece).await.is_err() {
                    return;
                }
                tokio::task::yield_now().await;
            }
        });
        let (mut stream, client) = accept(rx, peer, trust, Duration::from_secs(5)).await?;
        let mut rest = Vec::new();
        stream.read_to_end(&mut rest).await.unwrap();
        Ok((client, rest))
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_trusted_v2_header_gives_the_client_address_and_nothing_of_tls_is_lost() {
        let client: SocketAddr = "192.0.2.7:51234".parse().unwrap();
        let mut bytes = v2_header(client, "10.9.9.9:6443".parse().unwrap());
        bytes.extend_from_slice(TLS_START);
        for chunk in [1, 7, 1000] {
            let (got, rest) = run(bytes.clone(), chunk, balancer(), Some(&trust(true)))
                .await
                .unwrap();
            assert_eq!(got, client, "chunks of {chunk}");
            assert_eq!(rest, TLS_START, "chunks of {chunk}");
        }
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_trusted_v1_header_over_ipv6_gives_the_client_address() {
        let mut bytes = b"PROXY TCP6 2001:db8::1 fd00::2 40001 6443\r\n".to_vec();
        bytes.extend_from_slice(TLS_START);
        let peer = "[fd00::9]:1234".parse().unwrap();
        let (got, rest) = run(bytes, 3, peer, Some(&trust(true))).await.unwrap();
        assert_eq!(got, "[2001:db8::1]:40001".parse().unwrap());
        assert_eq!(rest, TLS_START);
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn local_and_unknown_headers_keep_the_peer_address() {
        let local = v2::Builder::new(
            v2::Version::Two | v2::Command::Local,
            v2::AddressFamily::Unspecified | v2::Protocol::Unspecified,
        )
        .build()
        .unwrap();
        let unknown = b"PROXY UNKNOWN\r\n".to_vec();
        for header in [local, unknown] {
            let mut bytes = header;
            bytes.extend_from_slice(TLS_START);
            let (got, rest) = run(bytes, 100, balancer(), Some(&trust(true)))
                .await
                .unwrap();
            assert_eq!(got, balancer());
            assert_eq!(rest, TLS_START);
        }
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_header_from_an_untrusted_peer_is_refused() {
        let stranger = "192.0.2.50:999".parse().unwrap();
        let spoofed = v2_header("10.0.0.1:1".parse().unwrap(), "10.0.0.2:2".parse().unwrap());
        let refused = run(spoofed, 5, stranger, Some(&trust(false))).await;
        assert!(matches!(refused, Err(Refused::Untrusted)), "{refused:?}");
        let v1 = b"PROXY TCP4 10.0.0.1 10.0.0.2 1 2\r\n".to_vec();
        let refused = run(v1, 100, stranger, Some(&trust(false))).await;
        assert!(matches!(refused, Err(Refused::Untrusted)), "{refused:?}");
        // The same peer speaking TLS straight away is served as itself.
        let (got, rest) = run(TLS_START.to_vec(), 100, stranger, Some(&trust(true)))
            .await
            .unwrap();
        assert_eq!((got, rest), (stranger, TLS_START.to_vec()));
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_trusted_peer_without_a_header_is_refused_only_when_one_is_required() {
        let refused = run(TLS_START.to_vec(), 100, balancer(), Some(&trust(true))).await;
        assert!(matches!(refused, Err(Refused::Missing)), "{refused:?}");
        let (got, rest) = run(TLS_START.to_vec(), 100, balancer(), Some(&trust(false)))
            .await
            .unwrap();
        assert_eq!((got, rest), (balancer(), TLS_START.to_vec()));
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn malformed_oversized_and_silent_headers_are_refused() {
        let garbage = b"PROXY TCP4 not-an-address\r\n".to_vec();
        let refused = run(garbage, 100, balancer(), Some(&trust(true))).await;
        assert!(matches!(refused, Err(Refused::Malformed(_))), "{refused:?}");

        let mut huge = v2::PROTOCOL_PREFIX.to_vec();
        huge.extend_from_slice(&[0x21, 0x11, 0xff, 0xff]);
        let refused = run(huge, 100, balancer(), Some(&trust(true))).await;
        assert!(matches!(refused, Err(Refused::TooLong)), "{refused:?}");

        // An UNKNOWN line without its CR LF is no header, whatever follows it.
        let mut bare = b"PROXY UNKNOWN \n".to_vec();
        bare.extend_from_slice(TLS_START);
        let refused = run(bare, 100, balancer(), Some(&trust(true))).await;
        assert!(matches!(refused, Err(Refused::Silent)), "{refused:?}");
        assert_eq!(at_start(b"PROXY UNKNOWN \n"), Ok(None));

        let endless = vec![b'P', b'R', b'O', b'X', b'Y', b' ']
            .into_iter()
            .chain(std::iter::repeat_n(b'1', 300))
            .collect();
        let refused = run(endless, 100, balancer(), Some(&trust(true))).await;
        assert!(matches!(refused, Err(Refused::Malformed(_))), "{refused:?}");

        // Half a signature, then nothing: the timeout ends it.
        let (mut tx, rx) = tokio::io::duplex(64);
        tx.write_all(b"\r\n\r\n").await.unwrap();
        let silent = accept(rx, balancer(), Some(&trust(true)), Duration::from_secs(3)).await;
        assert!(matches!(silent, Err(Refused::Timeout)));
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn with_the_protocol_off_nothing_is_read_ahead() {
        let header = v2_header(
            "192.0.2.1:1".parse().unwrap(),
            "10.0.0.2:2".parse().unwrap(),
        );
        let (got, rest) = run(header.clone(), 100, balancer(), None).await.unwrap();
        assert_eq!((got, rest), (balancer(), header));
    }
}

//! Bulwark: a TLS-terminating reverse proxy that keeps kube-apiservers alive.
//!
//! The modules follow the request path of DESIGN.md: [`listen`] → [`identity`] →
//! [`classify`] → [`rules`] → [`admit`] → cache → [`upstream`], with [`metrics`] and [`admin`]
//! beside it, [`config`] for the file that drives it all, [`status`] for what a refusal
//! tells the client and [`net`] for how client addresses are keyed. [`stages`] strings them
//! into the request path: it sits above them all, and none of them imports it.

pub mod admin;
pub mod admit;
pub mod board;
pub mod cache;
pub mod certs;
pub mod classify;
pub mod coalesce;
pub mod config;
pub mod config_files;
pub mod fleet;
#[doc(hidden)]
pub mod fuzzing;
pub mod identity;
pub mod listen;
pub mod logs;
pub mod metrics;
pub mod net;
pub mod own;
pub mod process;
pub mod report;
pub mod rules;
pub mod serve;
pub mod stages;
pub mod status;
pub mod traffic;
pub mod upstream;
pub mod user;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Full, combinators::UnsyncBoxBody};

/// The error type carried by bodies and services.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The body type of every request and response inside Bulwark: streamed, never buffered.
pub type Body = UnsyncBoxBody<Bytes, BoxError>;

/// The future of every stage of the request path.
pub type BoxFuture<T, E> =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<T, E>> + Send>>;

/// A body holding the given bytes.
pub fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// A body with nothing in it.
pub fn empty() -> Body {
    Empty::new().map_err(|never| match never {}).boxed_unsync()
}

/// Why [`read_to_limit`] gave up.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// The body is longer than the limit.
    #[error("the body is longer than {0} bytes")]
    TooLarge(usize),
    /// The body failed while being read.
    #[error("reading the body: {0}")]
    Failed(BoxError),
}

/// Reads a whole body of at most `limit` bytes. (Written out rather than with
/// `http_body_util::Limited`, whose error conversion makes futures that hold it lose `Send`.)
pub async fn read_to_limit(mut body: Body, limit: usize) -> Result<Bytes, ReadError> {
    let mut out = bytes::BytesMut::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(ReadError::Failed)?;
        if let Ok(data) = frame.into_data() {
            if out.len() + data.len() > limit {
                return Err(ReadError::TooLarge(limit));
            }
            out.extend_from_slice(&data);
        }
    }
    Ok(out.freeze())
}

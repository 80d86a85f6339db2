//! Bulwark: a TLS-terminating reverse proxy that keeps kube-apiservers alive.
//!
//! The modules follow the request path of DESIGN.md: [`listen`] → [`identity`] →
//! [`classify`] → rules → admit → cache → [`upstream`], with [`metrics`] and [`admin`]
//! beside it, [`config`] for the file that drives it all, and [`status`] as the one place
//! that turns a refusal into a response.

pub mod admin;
pub mod classify;
pub mod config;
pub mod identity;
pub mod listen;
pub mod metrics;
pub mod status;
pub mod upstream;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Full, combinators::UnsyncBoxBody};

/// The error type carried by bodies and services.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The body type of every request and response inside Bulwark: streamed, never buffered.
pub type Body = UnsyncBoxBody<Bytes, BoxError>;

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

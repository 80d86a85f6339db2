//! The request path (DESIGN.md): the stages a request passes through, outermost first, and
//! what they hand each other.
//!
//! ```text
//! listen ─▶ Rescue ─▶ Classify ─▶ Identify ─▶ Admit ─▶ Cache ─▶ Forward ─▶ upstream pool
//! ```
//! Each stage here is a thin adapter over its domain module (`classify`, `identity`,
//! `admit`, `cache`, `upstream`): it takes the [`call::Call`] with what the stages before it
//! learned and hands the next one the call with its own facts added. Every stage fails with
//! an [`error::ProxyError`], which [`rescue::Rescue`] answers, counts and logs. The domain
//! modules know nothing of this module; it sits above them all.

pub mod admit;
pub mod cache;
pub mod call;
pub mod classify;
pub mod error;
pub mod forward;
pub mod identity;
pub mod rescue;

use std::convert::Infallible;

use http::{Request, Response};
use hyper::body::Incoming;
use tower::{Layer, Service};

use self::admit::Admit;
use self::cache::Answer;
use self::call::Staged;
use self::classify::Classify;
use self::forward::Forward;
use self::identity::Identify;
use self::rescue::RescueLayer;
use crate::{Body, BoxFuture};

/// The whole request path as one service, outermost stage first. The stages after
/// `Rescue` make one future per request, boxed once.
pub fn stack(
    rescue: RescueLayer,
    classify: Classify,
    identify: Identify,
    admit: Admit,
    forward: Forward,
) -> impl Service<
    Request<Incoming>,
    Response = Response<Body>,
    Error = Infallible,
    Future = BoxFuture<Response<Body>, Infallible>,
> + Clone
+ Send
+ 'static {
    // One place that turns errors into statuses and counts every response.
    rescue.layer(
        // Malformed paths never reach identity or upstream.
        Staged::new(
            classify,
            // Certificate, token review or the anonymous allowlist; 401 otherwise.
            Staged::new(
                identify,
                // Rule match, rate limit, fair queue, seats and LIST bytes, for every
                // answer wherever it comes from; 429 otherwise.
                Staged::new(
                    admit,
                    // Reads the watch-fed cache was admitted to answer are answered here;
                    // everything else goes to a replica, as the client it acts for.
                    Staged::new(Answer, forward),
                ),
            ),
        ),
    )
}

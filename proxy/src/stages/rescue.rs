//! The outermost stage: makes the request's [`Call`], turns every [`ProxyError`] into its
//! answer through the one mapping ([`ProxyError::refusal`]), and counts every response
//! and logs every refusal, once. It also gives every request its `Audit-Id` (the client's,
//! when it sent a usable one, as the apiserver does), which the apiserver, the cache's
//! audit log, the refusal log and every answer carry, and tells the [`Board`] who asked.

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::header::USER_AGENT;
use http::{HeaderName, HeaderValue, Request, Response};
use http_body_util::BodyExt as _;
use tokio::time::Instant;
use tower::{Layer, Service};

use super::call::{Call, Next, Report};
use crate::board::{Board, IdentityRejections, Refused, Seen};
use crate::listen::{ConnInfo, Watching};
use crate::logs::access::{AccessLog, Entry as AccessEntry};
use crate::logs::{Rejection, RejectionLog, USER_AGENT_MAX};
use crate::metrics::{Metrics, ServedBy, method_label};
use crate::status::{AUDIT_ID, X_BULWARK_LEVEL, X_BULWARK_RULE};
use crate::{Body, BoxFuture};

/// The window over which `/debug/flows` counts, and over which the identities the metric
/// names are picked.
const BOARD_WINDOW: std::time::Duration = std::time::Duration::from_secs(10);
const NAMING_WINDOW: std::time::Duration = std::time::Duration::from_secs(60);

/// See [`Rescue`].
#[derive(Clone)]
pub struct RescueLayer {
    shared: Arc<Shared>,
}

/// What every request's rescue reports to.
struct Shared {
    metrics: Metrics,
    log: RejectionLog,
    board: Arc<Board>,
    identities: IdentityRejections,
    access: Option<AccessLog>,
}

impl RescueLayer {
    /// Counts in `metrics` (naming the `identities` identities refused most); logs
    /// refusals to the rejection log and every request to `access` when there is one.
    pub fn new(metrics: Metrics, identities: u32, access: Option<AccessLog>) -> RescueLayer {
        let named = metrics.identity_rejections_total.clone();
        RescueLayer {
            shared: Arc::new(Shared {
                metrics,
                log: RejectionLog::default(),
                board: Arc::new(Board::new(BOARD_WINDOW)),
                identities: IdentityRejections::new(identities, NAMING_WINDOW, named),
                access,
            }),
        }
    }

    /// The flows seen, for `/debug/flows`.
    pub fn board(&self) -> Arc<Board> {
        self.shared.board.clone()
    }
}

impl<S> Layer<S> for RescueLayer {
    type Service = Rescue<S>;
    fn layer(&self, inner: S) -> Rescue<S> {
        Rescue {
            inner: Arc::new(inner),
            shared: self.shared.clone(),
        }
    }
}

/// Answers every request: the inner stages' response, or the refusal for their error.
pub struct Rescue<S> {
    inner: Arc<S>,
    shared: Arc<Shared>,
}

impl<S> Clone for Rescue<S> {
    fn clone(&self) -> Self {
        Rescue {
            inner: self.inner.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<S, B> Service<Request<B>> for Rescue<S>
where
    S: Next<B, ()>,
    B: Send + 'static,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Response<Body>, Infallible>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    // Over 120 lines: one request's whole account (metrics, board, access log, the error's
    // status) around the inner call, which reads the clock once and needs both the request
    // and its answer in scope.
    fn call(&mut self, mut request: Request<B>) -> Self::Future {
        let method = method_label(request.method());
        let audit_id = audit_id(request.headers_mut());
        let source = request.extensions().get::<ConnInfo>().map(|c| c.peer);
        // Kept as the header (a shared reference to the received bytes); made text only
        // for a line that names it.
        let user_agent = request.headers().get(USER_AGENT).cloned();
        let call = Call::new(request);
        let report = call.report.clone();
        let started = Instant::now();
        let shared = self.shared.clone();
        let inner = self.inner.clone();
        Box::pin(async move {
            let Shared {
                metrics,
                log,
                board,
                identities,
                access,
            } = &*shared;
            let answered = inner.run(call).await;
            // The one clock read after the answer: the request's duration and the board's
            // time of it.
            let ended = Instant::now();
            let took = ended.duration_since(started);
            let (mut response, served_by, reason) = match answered {
                Ok(mut response) => {
                    if response.status().is_success()
                        && report
                            .info()
                            .is_some_and(|i| i.verb == crate::classify::Verb::Watch)
                    {
                        // Its stream ends cleanly when the drain ends the watches.
                        response.extensions_mut().insert(Watching);
                    }
                    let served_by = served_by(&response).unwrap_or(ServedBy::Upstream);
                    board.seen(
                        Seen {
                            identity: report.who(),
                            rule: named(&report, &response, X_BULWARK_RULE),
                            level: named(&report, &response, X_BULWARK_LEVEL),
                            waited: report.waited.get().copied().unwrap_or_default(),
                            refused: None,
                        },
                        ended,
                    );
                    (response, served_by, None)
                }
                Err(error) => {
                    let who = report.who();
                    let info = report.info().map(|i| &**i);
                    let refusal = error.refusal();
                    let detail = crate::report::Chain(&error);
                    let rule = refusal.rule.as_deref().unwrap_or("");
                    let level = refusal.level.as_deref().unwrap_or("");
                    let user_agent = user_agent_text(user_agent.as_ref());
                    tracing::debug!(reason = %refusal.reason, error = %detail, "refused");
                    log.rejected(Rejection {
                        identity: who,
                        rule,
                        level,
                        reason: refusal.reason,
                        detail: &detail,
                        request: info,
                        source,
                        user_agent: &user_agent,
                        audit_id: audit_id.to_str().unwrap_or(""),
                    });
                    metrics.reject(rule, level, refusal.reason);
                    identities.rejected(who, refusal.reason);
                    board.seen(
                        Seen {
                            identity: who,
                            rule,
                            level,
                            waited: report.waited.get().copied().unwrap_or_default(),
                            refused: Some(Refused {
                                reason: refusal.reason,
                                info: report.info(),
                                audit_id: audit_id.to_str().unwrap_or(""),
                            }),
                        },
                        ended,
                    );
                    let reason = refusal.reason;
                    let response = error.into_response(refusal);
                    let served_by = served_by(&response).unwrap_or(ServedBy::Bulwark);
                    (response, served_by, Some(reason))
                }
            };
            if let Some(access) = access {
                let user_agent = user_agent_text(user_agent.as_ref());
                // A refusal names its rule and level in its headers too.
                let written = access.record(&AccessEntry {
                    audit_id: audit_id.to_str().unwrap_or(""),
                    user: report.who(),
                    identity: report.user.get().and_then(Option::as_deref),
                    flow: report.flow.get().map(|f| &**f),
                    expected_bytes: report.admitted.get().map(|a| a.expected_bytes),
                    source,
                    user_agent: &user_agent,
                    method,
                    request: report.info().map(|i| &**i),
                    code: response.status().as_u16(),
                    served_by: served_by.as_str(),
                    rule: named(&report, &response, X_BULWARK_RULE),
                    level: named(&report, &response, X_BULWARK_LEVEL),
                    reason,
                    took,
                    waited: report.waited.get().copied(),
                    held: report
                        .admitted
                        .get()
                        .map(|a| ended.saturating_duration_since(a.at)),
                });
                // Marked above: an answered watch.
                let watching = response.extensions().get::<Watching>().is_some();
                if written && watching {
                    // The watch's second line is written when its body is dropped: at its
                    // end, whoever ends it.
                    let end = access.watch_end(audit_id.to_str().unwrap_or(""), report.who());
                    response = response.map(|body| {
                        body.map_frame(move |frame| {
                            let _ = &end;
                            frame
                        })
                        .boxed_unsync()
                    });
                }
            }
            answer_audit_id(response.headers_mut(), audit_id);
            let labels = match report.classified.get() {
                Some(classified) => (classified.labels.verb, &*classified.labels.resource),
                None => (method, ""),
            };
            metrics.count_request(labels, response.status(), served_by, took);
            Ok(response)
        })
    }
}

/// The longest `Audit-Id` taken from a client (a UUID is 36 bytes).
const AUDIT_ID_MAX: usize = 128;

/// The request's `Audit-Id`: the client's when it is usable, else a new UUID; either way
/// set on the request, so that the apiserver's audit log and the cache's use it too.
///
/// Marked sensitive, so that HTTP/2 sends it as a literal that is never put in the HPACK
/// table, to the apiserver and back to the client: a value used once would only push the
/// headers that do repeat (the identity headers, the rule's) out of the table.
fn audit_id(headers: &mut http::HeaderMap) -> HeaderValue {
    if let Some(given) = headers.get_mut(AUDIT_ID)
        && !given.is_empty()
        && given.len() <= AUDIT_ID_MAX
        && given.as_bytes().iter().all(|b| b.is_ascii_graphic())
    {
        given.set_sensitive(true);
        return given.clone();
    }
    let mut text = [0u8; uuid::fmt::Hyphenated::LENGTH];
    let id = crate::cache::audit::new_uuid()
        .hyphenated()
        .encode_lower(&mut text);
    let mut id = HeaderValue::from_str(id).expect("a UUID is a valid header value");
    id.set_sensitive(true);
    headers.insert(AUDIT_ID, id.clone());
    id
}

/// Puts the request's `Audit-Id` on its answer: the apiserver's and the cache's answers
/// carry it already (the apiserver's decoded from its HTTP/2 stream, so no longer marked),
/// Bulwark's own get it here. Marked sensitive either way, as on the request: a value sent
/// once would otherwise be put in the client connection's HPACK table with every answer and
/// push out the headers that repeat.
fn answer_audit_id(headers: &mut http::HeaderMap, id: HeaderValue) {
    match headers.entry(AUDIT_ID) {
        http::header::Entry::Occupied(mut given) => given.get_mut().set_sensitive(true),
        http::header::Entry::Vacant(missing) => {
            missing.insert(id);
        }
    }
}

/// The client's `User-Agent` as log lines carry it: at most [`USER_AGENT_MAX`] bytes.
fn user_agent_text(header: Option<&HeaderValue>) -> String {
    header.map_or_else(String::new, |v| {
        cut(&String::from_utf8_lossy(v.as_bytes()), USER_AGENT_MAX).to_owned()
    })
}

/// `text` cut to at most `max` bytes, at a character boundary.
fn cut(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// A response header's text, empty when absent or not text.
/// The rule (`X_BULWARK_RULE`) or level that admitted the request, as admission reported
/// it, else as the answer names it (a refusal's); "" for neither.
fn named<'a>(report: &'a Report, response: &'a Response<Body>, name: HeaderName) -> &'a str {
    let admitted = report.admitted.get().and_then(|admitted| {
        if name == X_BULWARK_RULE {
            admitted.named.rule.as_ref()
        } else {
            admitted.named.level.as_ref()
        }
    });
    admitted
        .and_then(|v| v.to_str().ok())
        .unwrap_or_else(|| header_text(response, name))
}

fn header_text(response: &Response<Body>, name: HeaderName) -> &str {
    response
        .headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
}

fn served_by(response: &Response<Body>) -> Option<ServedBy> {
    response.extensions().get::<ServedBy>().copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_request_has_an_audit_id_kept_out_of_the_hpack_table() {
        let mut headers = http::HeaderMap::new();
        let made = audit_id(&mut headers);
        assert_eq!(made.len(), 36);
        assert_eq!(headers[AUDIT_ID], made);
        assert!(made.is_sensitive() && headers[AUDIT_ID].is_sensitive());

        let mut headers = http::HeaderMap::new();
        headers.insert(AUDIT_ID, HeaderValue::from_static("client-chose-this"));
        let kept = audit_id(&mut headers);
        assert_eq!(kept, "client-chose-this");
        assert!(kept.is_sensitive() && headers[AUDIT_ID].is_sensitive());

        for unusable in ["", "has space", &"x".repeat(AUDIT_ID_MAX + 1)] {
            let mut headers = http::HeaderMap::new();
            headers.insert(AUDIT_ID, HeaderValue::from_str(unusable).unwrap());
            let id = audit_id(&mut headers);
            assert_eq!(id.len(), 36, "{unusable:?} replaced by a UUID");
            assert_eq!(headers[AUDIT_ID], id);
        }
    }

    #[test]
    fn every_answer_carries_the_audit_id_kept_out_of_the_hpack_table() {
        let mut request = http::HeaderMap::new();
        let id = audit_id(&mut request);

        // Bulwark's own answer gets the request's.
        let mut own = http::HeaderMap::new();
        answer_audit_id(&mut own, id.clone());
        assert_eq!(own[AUDIT_ID], id);
        assert!(own[AUDIT_ID].is_sensitive());

        // The apiserver's keeps its own (the same, echoed), marked again.
        let mut upstream = http::HeaderMap::new();
        upstream.insert(
            AUDIT_ID,
            HeaderValue::from_str(id.to_str().unwrap()).unwrap(),
        );
        assert!(!upstream[AUDIT_ID].is_sensitive(), "as h2 decodes it");
        answer_audit_id(&mut upstream, HeaderValue::from_static("not-this"));
        assert_eq!(upstream[AUDIT_ID], id);
        assert!(upstream[AUDIT_ID].is_sensitive());
    }
}

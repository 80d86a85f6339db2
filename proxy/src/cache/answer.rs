//! Answering a planned request ([`Cache::answer`]): a SubjectAccessReview for the reader
//! first (denied is the apiserver's 403, audited for Secrets like an answer), then GET,
//! LIST or WATCH from the cache as it is now, gzipped when asked, with its audit line.

use std::net::IpAddr;
use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Response, StatusCode};

use apimachinery::status::{Details, qualified};

use super::plan::Planned;
use super::store::{self, Store};
use super::{
    Attributes, Cache, CacheError, CachedResource, Decision, Encoding, Held, InitialState, Plan,
    Reader, Status, audit, protobuf, respond, watch,
};
use crate::Body;
use crate::classify::RequestInfo;
use crate::user::User;

impl Cache {
    /// Answers a planned request: a SubjectAccessReview for the reader first (denied is
    /// 403, audited for Secrets like an answer; no review is an error, never data), then
    /// the answer built from the cache as it is now — after any wait for admission.
    /// `initial_seats` are held while a watch sends its initial state.
    pub async fn answer(
        &self,
        plan: Plan,
        info: &RequestInfo,
        reader: Reader<'_>,
        initial_seats: Option<Held>,
    ) -> Result<Response<Body>, CacheError> {
        let audit_id = reader
            .headers
            .get("audit-id")
            .and_then(|v| v.to_str().ok())
            .filter(|v| !v.is_empty() && v.len() <= 128)
            .map_or_else(audit::new_audit_id, str::to_owned);
        let request = Request {
            resource: &self.resources[plan.resource],
            store: plan.store,
            info,
            user: reader.user,
            headers: reader.headers,
            peer: reader.peer,
            filter: plan.filter,
            audit_id,
            encoding: plan.encoding,
        };
        match plan.what {
            Planned::Get { name } => self.answer_get(request, name).await,
            Planned::List { continued } => self.answer_list(request, continued).await,
            Planned::Watch {
                from,
                watch_list,
                start,
            } => {
                self.answer_watch(request, (from, start), watch_list, initial_seats)
                    .await
            }
        }
    }

    /// [`Cache::authorize`] for a list or watch: its name is the one
    /// `fieldSelector=metadata.name=X` pins, as the apiserver has it, or none.
    pub(super) async fn authorize_collection(
        &self,
        request: &Request<'_>,
        verb: &str,
    ) -> Result<Attributes, CacheError> {
        let name = request.info.field_selector_name().unwrap_or_default();
        self.authorize(request, verb, name).await
    }

    /// Asks the apiserver, through the decision cache, whether the user may do this.
    async fn authorize(
        &self,
        request: &Request<'_>,
        verb: &str,
        name: &str,
    ) -> Result<Attributes, CacheError> {
        let kind = request.store.kind();
        let attrs = Attributes {
            verb: verb.to_owned(),
            group: kind.group.clone(),
            version: kind.version.clone(),
            resource: kind.resource.clone(),
            namespace: request
                .info
                .namespace
                .as_deref()
                .unwrap_or_default()
                .to_owned(),
            name: name.to_owned(),
        };
        match self.access.check(request.user, &attrs).await {
            Ok(Decision::Allowed) => Ok(attrs),
            Ok(Decision::Denied(reason)) => {
                // The apiserver audits the requests it refuses too.
                self.audit(request, verb, Some(name).filter(|n| !n.is_empty()), 403);
                let status = forbidden(request.user, &attrs, &reason);
                Err(CacheError::Status(
                    Box::new(status),
                    request.audit_id.clone(),
                ))
            }
            Err(e) => Err(CacheError::ReviewFailed(e)),
        }
    }

    fn audit(&self, request: &Request<'_>, verb: &str, name: Option<&str>, code: u16) {
        let (Some(log), kind) = (&self.audit, request.store.kind()) else {
            return;
        };
        if !(kind.group.is_empty() && kind.resource == "secrets") {
            return;
        }
        let uri = if request.info.query.raw.is_empty() {
            request.info.path.clone()
        } else {
            format!("{}?{}", request.info.path, request.info.query.raw)
        };
        log.write(&audit::Record {
            audit_id: &request.audit_id,
            request_uri: &uri,
            verb,
            user: request.user,
            resource: &kind.resource,
            namespace: request.info.namespace.as_deref(),
            name,
            group: &kind.group,
            version: &kind.version,
            code,
            user_agent: request
                .headers
                .get(http::header::USER_AGENT)
                .and_then(|v| v.to_str().ok()),
            source_ips: &audit::source_ips(request.headers, request.peer),
        });
    }

    async fn answer_get(
        &self,
        request: Request<'_>,
        name: String,
    ) -> Result<Response<Body>, CacheError> {
        self.authorize(&request, "get", &name).await?;
        let kind = request.store.kind();
        let namespace = request.info.namespace.as_deref().unwrap_or_default();
        let (obj, _) = request.store.get(namespace, &name);
        let Some(obj) = obj else {
            let status = Status::failure(
                404,
                "NotFound",
                format!(
                    "{} not found",
                    qualified(&kind.group, &kind.resource, &name)
                ),
                Some(Details::of(&name, &kind.group, &kind.resource)),
            );
            let response = respond::status_response(&status, &request.audit_id);
            return Ok(self.give(&request, ("get", Some(&name), 404), response));
        };
        let pieces = respond::object_answer(kind, &obj, request.encoding)
            .map_err(|e| self.unencodable(&e, &request, ("get", Some(&name))))?;
        let response = self.respond(&request, pieces).await;
        Ok(self.give(&request, ("get", Some(&name), 200), response))
    }

    /// The apiserver's 500 for a cached object that does not encode in protobuf (its JSON
    /// not reading as its kind): an error, never a silently different object, audited like
    /// any other answer (`verb`, `name`).
    pub(super) fn unencodable(
        &self,
        error: &protobuf::ProtoError,
        request: &Request<'_>,
        (verb, name): (&str, Option<&str>),
    ) -> CacheError {
        tracing::warn!(error = %crate::report::Chain(error), "a cached object does not encode in protobuf");
        self.audit(request, verb, name, 500);
        let status = Status::failure(500, "InternalError", error.to_string(), None);
        CacheError::Status(Box::new(status), request.audit_id.clone())
    }

    /// Gives an answer and writes its audit line `(verb, name, code)`.
    pub(super) fn give(
        &self,
        request: &Request<'_>,
        (verb, name, code): (&str, Option<&str>, u16),
        response: Response<Body>,
    ) -> Response<Body> {
        self.audit(request, verb, name, code);
        response
    }

    pub(super) async fn respond(
        &self,
        request: &Request<'_>,
        pieces: Arc<[Bytes]>,
    ) -> Response<Body> {
        let (pieces, gzipped) = encode(pieces, wants_gzip(request.headers)).await;
        self.send(request, pieces, gzipped)
    }

    pub(super) fn send(
        &self,
        request: &Request<'_>,
        pieces: Arc<[Bytes]>,
        gzipped: bool,
    ) -> Response<Body> {
        let mut response = respond::response(
            StatusCode::OK,
            respond::chain_body(pieces),
            &request.audit_id,
            respond::content_type(request.encoding, false),
        );
        if gzipped {
            response.headers_mut().insert(
                http::header::CONTENT_ENCODING,
                HeaderValue::from_static("gzip"),
            );
        }
        response
    }

    async fn answer_watch(
        &self,
        request: Request<'_>,
        (from, planned): (Option<u64>, Option<store::WatchStart>),
        watch_list: bool,
        initial_seats: Option<Held>,
    ) -> Result<Response<Body>, CacheError> {
        let q = &request.info.query;
        let attrs = self.authorize_collection(&request, "watch").await?;
        // A watch from a version subscribed when it was planned; one that starts with the
        // state takes the state of now, after admission.
        let start = match planned {
            Some(start) => start,
            None => request.store.watch_state(
                request.filter.namespace.as_deref(),
                request.filter.fields.pinned_name(),
                |o| request.filter.matches(o),
            ),
        };
        // As the apiserver: 0 or none is a random time in [min-request-timeout, 2x) to
        // spread re-watches, a negative value ends the watch at once.
        let timeout = apimachinery::params::watch_timeout(
            q.timeout_seconds,
            apimachinery::params::MIN_REQUEST_TIMEOUT,
        );
        let options = watch::Options {
            filter: request.filter.clone(),
            bookmarks: q
                .allow_watch_bookmarks
                .then_some(self.cfg.bookmark_interval),
            initial_events_end: watch_list,
            timeout,
            from,
            encoding: request.encoding,
        };
        let reauth = watch::Reauthorize {
            access: self.access.clone(),
            user: request.user.clone(),
            attrs,
            every: self.cfg.reauthorize_interval,
        };
        let (body, initial_bytes) = watch::body(
            request.store.clone(),
            start,
            options,
            Some(reauth),
            initial_seats,
            self.metrics.clone(),
        );
        let content_type = respond::content_type(request.encoding, true);
        let mut response = respond::response(StatusCode::OK, body, &request.audit_id, content_type);
        if initial_bytes > 0 {
            response
                .extensions_mut()
                .insert(InitialState(initial_bytes));
        }
        Ok(self.give(&request, ("watch", None, 200), response))
    }
}

/// Gzips when asked and large enough.
pub(super) async fn encode(pieces: Arc<[Bytes]>, gzip: bool) -> (Arc<[Bytes]>, bool) {
    let total: usize = pieces.iter().map(Bytes::len).sum();
    if !gzip || total < respond::GZIP_THRESHOLD {
        return (pieces, false);
    }
    match respond::gzip(pieces.clone()).await {
        Ok(zipped) => (Arc::from([zipped]), true),
        Err(e) => {
            tracing::warn!(error = %e, "gzip failed; answering uncompressed");
            (pieces, false)
        }
    }
}

/// What one answer carries through its steps.
pub(super) struct Request<'a> {
    pub(super) resource: &'a CachedResource,
    pub(super) store: Store,
    pub(super) info: &'a RequestInfo,
    pub(super) user: &'a User,
    pub(super) headers: &'a HeaderMap,
    pub(super) peer: Option<IpAddr>,
    pub(super) filter: watch::Filter,
    pub(super) audit_id: String,
    pub(super) encoding: Encoding,
}

/// The apiserver's 403 for a denied request.
fn forbidden(user: &User, attrs: &Attributes, reason: &str) -> Status {
    let scope = if attrs.namespace.is_empty() {
        "at the cluster scope".to_owned()
    } else {
        format!("in the namespace \"{}\"", attrs.namespace)
    };
    let mut message = format!(
        "{} is forbidden: User \"{}\" cannot {} resource \"{}\" in API group \"{}\" {scope}",
        qualified(&attrs.group, &attrs.resource, &attrs.name),
        user.username,
        attrs.verb,
        attrs.resource,
        attrs.group,
    );
    if !reason.is_empty() {
        message.push_str(": ");
        message.push_str(reason);
    }
    Status::failure(
        403,
        "Forbidden",
        message,
        Some(Details::of(&attrs.name, &attrs.group, &attrs.resource)),
    )
}

pub(super) fn wants_gzip(headers: &HeaderMap) -> bool {
    headers
        .get_all(http::header::ACCEPT_ENCODING)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|coding| {
            let mut parts = coding.split(';');
            let name = parts.next().unwrap_or_default().trim();
            let refused = parts.any(|p| {
                p.trim()
                    .strip_prefix("q=")
                    .and_then(|q| q.trim().parse::<f32>().ok())
                    .is_some_and(|q| q == 0.0)
            });
            name.eq_ignore_ascii_case("gzip") && !refused
        })
}

//! Request handling: request info (verb, group, resource, namespace, name) as the apiserver
//! derives it, authentication → impersonation → authorization, then discovery, reviews,
//! GET/LIST/WATCH and writes against the store, with the apiserver's response shapes.

use std::sync::Arc;
use std::time::Duration;

use apimachinery::continue_token::{self, Scope, object_key};
use apimachinery::params::bool_param as truthy;
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Response, StatusCode, header};
use http_body_util::BodyExt;
use hyper::Request;
use hyper::body::Incoming;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use crate::auth::{self, PeerCert, UserInfo};
use crate::body::SimBody;
use crate::discovery::{self, ResourceDef};
use crate::faults::Gauge;
use crate::heap::LIST_AMPLIFICATION;
use crate::policy::{Attributes, forbidden_message};
use crate::reviews;
use crate::select::{FieldSelector, LabelSelector};
use crate::server::ReplicaInner;
use crate::status::{self, ApiError};
use crate::store::{Obj, PatchKind, StoreError, WatchFrom};
use crate::table::{self, As};
use crate::watch::{self, WatchFilter, WatchOptions};
use crate::{SeenRequest, push_seen};

/// The apiserver compresses responses larger than this when the client accepts gzip.
pub const GZIP_THRESHOLD: usize = 128 * 1024;

/// How long a read waits for a resourceVersion the store has not reached.
const RV_WAIT: Duration = Duration::from_secs(3);

/// Largest request body accepted (the apiserver's limit is 3 MiB for most objects).
const MAX_BODY: usize = 3 * 1024 * 1024;

/// A plain-text response.
pub fn text(code: u16, s: &str) -> Response<SimBody> {
    let mut r = Response::new(SimBody::full(Bytes::copy_from_slice(s.as_bytes())));
    *r.status_mut() = StatusCode::from_u16(code).unwrap_or(StatusCode::OK);
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r.headers_mut().insert(
        "x-content-type-options",
        HeaderValue::from_static("nosniff"),
    );
    r
}

/// A JSON response.
pub fn json_response(code: u16, body: SimBody) -> Response<SimBody> {
    let mut r = Response::new(body);
    *r.status_mut() = StatusCode::from_u16(code).unwrap_or(StatusCode::OK);
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

pub(crate) fn value_response(code: u16, v: &Value) -> Response<SimBody> {
    json_response(code, SimBody::full(status::to_ordered_bytes(v)))
}

/// A single stored object, with the newline the apiserver's encoder ends every body with.
fn object_response(code: u16, obj: Bytes) -> Response<SimBody> {
    json_response(code, SimBody::chunks(vec![obj, Bytes::from_static(b"\n")]))
}

/// The UIDs API Priority and Fairness names in its response headers: those of the
/// `global-default` flow schema and priority level, which a simulated request falls into.
pub const APF_FLOW_SCHEMA_UID: &str = "5f8a4d0c-35b3-4b7a-9c41-2c0bd0a7a001";
/// See [`APF_FLOW_SCHEMA_UID`].
pub const APF_PRIORITY_LEVEL_UID: &str = "5f8a4d0c-35b3-4b7a-9c41-2c0bd0a7a002";

/// API Priority and Fairness rejecting a request (`tooManyRequests` in the apiserver's
/// filters): the flow schema and priority level it was classified into, `Retry-After`, and
/// Go's `http.Error` plain-text body.
pub fn apf_rejection() -> Response<SimBody> {
    let mut r = text(429, "Too many requests, please try again later.\n");
    let headers = r.headers_mut();
    headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    headers.insert(
        "x-kubernetes-pf-flowschema-uid",
        HeaderValue::from_static(APF_FLOW_SCHEMA_UID),
    );
    headers.insert(
        "x-kubernetes-pf-prioritylevel-uid",
        HeaderValue::from_static(APF_PRIORITY_LEVEL_UID),
    );
    r
}

/// A `Status` error response.
pub fn status_response(e: &ApiError) -> Response<SimBody> {
    json_response(e.code, SimBody::full(e.to_bytes()))
}

/// The request info the apiserver derives from method and path.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RequestInfo {
    /// Resource request (vs a non-resource path).
    pub resource_request: bool,
    /// Verb.
    pub verb: String,
    /// API group.
    pub group: String,
    /// API version.
    pub version: String,
    /// Resource.
    pub resource: String,
    /// Subresource.
    pub subresource: String,
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// The legacy `/watch/` path prefix was used.
    pub legacy_watch: bool,
}

/// Query parameters, decoded, in order.
pub type Query = Vec<(String, String)>;

/// Decodes a query string.
pub fn parse_query(q: Option<&str>) -> Query {
    let Some(q) = q else { return Vec::new() };
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            let dec = |s: &str| {
                percent_encoding::percent_decode_str(&s.replace('+', " "))
                    .decode_utf8_lossy()
                    .into_owned()
            };
            (dec(k), dec(v))
        })
        .collect()
}

/// The first value of a parameter.
pub fn param<'a>(q: &'a Query, name: &str) -> Option<&'a str> {
    q.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
}

/// Derives request info as the apiserver's RequestInfoFactory does.
pub fn request_info(method: &Method, path: &str, q: &Query) -> RequestInfo {
    let parts: Vec<&str> = path
        .trim_matches('/')
        .split('/')
        .filter(|s| !s.is_empty())
        .collect();
    let mut ri = RequestInfo {
        verb: method.as_str().to_lowercase(),
        ..Default::default()
    };
    let rest: &[&str] = match parts.as_slice() {
        ["api", v, rest @ ..] if !rest.is_empty() => {
            ri.version = v.to_string();
            rest
        }
        ["apis", g, v, rest @ ..] if !rest.is_empty() => {
            ri.group = g.to_string();
            ri.version = v.to_string();
            rest
        }
        _ => {
            ri.verb = match *method {
                Method::POST => "post",
                Method::PUT => "put",
                Method::PATCH => "patch",
                Method::DELETE => "delete",
                Method::HEAD => "head",
                _ => "get",
            }
            .into();
            return ri;
        }
    };
    ri.resource_request = true;
    let mut rest = rest;
    if rest.first() == Some(&"watch") {
        ri.legacy_watch = true;
        rest = &rest[1..];
    }
    if rest.first() == Some(&"namespaces") && rest.len() > 1 {
        ri.namespace = rest[1].to_string();
        if rest.len() > 2 && rest[2] != "status" && rest[2] != "finalize" {
            rest = &rest[2..];
        }
    }
    ri.resource = rest.first().unwrap_or(&"").to_string();
    ri.name = rest.get(1).unwrap_or(&"").to_string();
    ri.subresource = rest.get(2).unwrap_or(&"").to_string();
    ri.verb = match *method {
        Method::POST => "create",
        Method::GET | Method::HEAD => "get",
        Method::PUT => "update",
        Method::PATCH => "patch",
        Method::DELETE => "delete",
        _ => "",
    }
    .into();
    if ri.legacy_watch {
        ri.verb = "watch".into();
    } else if ri.verb == "get" && ri.name.is_empty() {
        ri.verb = if truthy(param(q, "watch")) {
            "watch"
        } else {
            "list"
        }
        .into();
    } else if ri.verb == "delete" && ri.name.is_empty() {
        ri.verb = "deletecollection".into();
    }
    if ri.resource == "pods" && ri.subresource == "exec" {
        // Exec is authorized as `create` whether it arrives as POST (SPDY) or GET (WebSocket).
        ri.verb = "create".into();
    }
    ri
}

fn attributes(
    u: &UserInfo,
    ri: &RequestInfo,
    path: &str,
    fields: Option<&FieldSelector>,
) -> Attributes {
    let mut name = ri.name.clone();
    // RequestInfoFactory reads the selector's name only where it turned a GET into a list
    // or watch, never on the legacy `/watch/` paths, whose name is the path's alone.
    if name.is_empty()
        && !ri.legacy_watch
        && (ri.verb == "list" || ri.verb == "watch")
        && let Some(n) = fields.and_then(FieldSelector::pinned_name)
    {
        name = n.to_string();
    }
    Attributes {
        user: u.user.clone(),
        groups: u.groups.clone(),
        verb: ri.verb.clone(),
        resource_request: ri.resource_request,
        group: ri.group.clone(),
        resource: ri.resource.clone(),
        subresource: ri.subresource.clone(),
        namespace: ri.namespace.clone(),
        name,
        path: path.to_string(),
    }
}

fn headers_list(h: &HeaderMap) -> Vec<(String, String)> {
    h.iter()
        .map(|(k, v)| {
            (
                k.as_str().to_string(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect()
}

fn store_error(def: &ResourceDef, e: StoreError) -> ApiError {
    match e {
        StoreError::NotFound { name, .. } => status::not_found(def.resource, def.group, &name),
        StoreError::AlreadyExists { name, .. } => {
            status::already_exists(def.resource, def.group, &name)
        }
        StoreError::Conflict { name, .. } => status::conflict(def.resource, def.group, &name),
        StoreError::Invalid {
            name,
            field,
            reason,
            detail,
        } => status::invalid(def.kind, def.group, &name, &field, reason, &detail),
        StoreError::Expired { .. } => status::list_rv_expired(),
        StoreError::UnknownResource(_) => status::path_not_found(),
    }
}

/// Serves one request that passed the fault hooks.
pub async fn handle(
    rep: &Arc<ReplicaInner>,
    peer: Option<&PeerCert>,
    req: Request<Incoming>,
    cancel: CancellationToken,
) -> Response<SimBody> {
    let sh = &rep.shared;
    let path = req.uri().path().to_string();
    let q = parse_query(req.uri().query());
    let method = req.method().clone();
    let ri = request_info(&method, &path, &q);
    let user = match auth::authenticate(&sh.auth, peer, req.headers()) {
        Ok(u) => u,
        Err(e) => {
            record(rep, &method, req.uri(), req.headers(), None, None);
            sh.metrics
                .observe(rep.index, &ri.verb, &ri.resource, "", e.code);
            return status_response(&e);
        }
    };
    let (user, by) = match auth::impersonate(&sh.policy, user.clone(), req.headers()) {
        Ok(x) => x,
        Err(e) => {
            record(rep, &method, req.uri(), req.headers(), Some(&user), None);
            sh.metrics
                .observe(rep.index, &ri.verb, &ri.resource, &user.user, e.code);
            return status_response(&e);
        }
    };
    record(rep, &method, req.uri(), req.headers(), Some(&user), by);
    let resp = serve(rep, &user, &ri, &path, &q, req, cancel).await;
    sh.metrics.observe(
        rep.index,
        &ri.verb,
        &ri.resource,
        &user.user,
        resp.status().as_u16(),
    );
    resp
}

fn record(
    rep: &ReplicaInner,
    method: &Method,
    uri: &http::Uri,
    h: &HeaderMap,
    u: Option<&UserInfo>,
    by: Option<String>,
) {
    let c = &rep.counters;
    let name = u.map(|u| u.user.clone());
    if let Some(n) = &name {
        *c.by_user
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(n.clone())
            .or_default() += 1;
    }
    *c.last.lock().unwrap_or_else(|p| p.into_inner()) = (name, headers_list(h));
    let u = u.cloned().unwrap_or_default();
    push_seen(
        &rep.shared.seen,
        SeenRequest {
            replica: rep.index,
            method: method.as_str().to_string(),
            path: uri
                .path_and_query()
                .map(|p| p.as_str().to_string())
                .unwrap_or_default(),
            user: u.user,
            groups: u.groups,
            extra: u.extra,
            uid: u.uid,
            impersonated_by: by,
        },
    );
}

pub(crate) async fn read_body(req: Request<Incoming>) -> Result<(HeaderMap, Bytes), ApiError> {
    let (parts, body) = req.into_parts();
    let limited = http_body_util::Limited::new(body, MAX_BODY);
    match limited.collect().await {
        Ok(b) => Ok((parts.headers, b.to_bytes())),
        Err(e) => Err(ApiError::new(
            413,
            "RequestEntityTooLarge",
            format!("request body: {e}"),
            None,
        )),
    }
}

/// Decodes a JSON or (for the few kinds kubectl sends that way) protobuf body.
pub(crate) fn parse_body(h: &HeaderMap, b: &Bytes) -> Result<Value, ApiError> {
    if content_type(h) == crate::proto::PROTOBUF {
        return crate::proto::decode(b).map_err(|e| match e {
            crate::proto::ProtoError::Unsupported(_) => {
                status::unsupported_media_type(crate::proto::PROTOBUF)
            }
            e => status::bad_request(e.to_string()),
        });
    }
    parse_json(b)
}

pub(crate) fn parse_json(b: &Bytes) -> Result<Value, ApiError> {
    serde_json::from_slice(b)
        .map_err(|e| status::bad_request(format!("the object provided is unrecognized: {e}")))
}

fn content_type(h: &HeaderMap) -> String {
    h.get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|s| {
            s.split(';')
                .next()
                .unwrap_or_default()
                .trim()
                .to_lowercase()
        })
        .unwrap_or_default()
}

// Over 120 lines: one arm per verb and subresource, as the apiserver's handler chain
// dispatches them.
async fn serve(
    rep: &Arc<ReplicaInner>,
    user: &UserInfo,
    ri: &RequestInfo,
    path: &str,
    q: &Query,
    req: Request<Incoming>,
    cancel: CancellationToken,
) -> Response<SimBody> {
    let sh = &rep.shared;
    let fields = match FieldSelector::parse(param(q, "fieldSelector").unwrap_or_default()) {
        Ok(f) => f,
        Err(e) => return status_response(&status::bad_request(e.to_string())),
    };
    let attrs = attributes(user, ri, path, Some(&fields));
    if !sh.policy.allows(&attrs) {
        let details = if ri.resource_request {
            let kind = if ri.subresource.is_empty() {
                ri.resource.clone()
            } else {
                format!("{}/{}", ri.resource, ri.subresource)
            };
            status::details(&attrs.name, &ri.group, &kind)
        } else {
            apimachinery::status::Details::default()
        };
        return status_response(&ApiError::new(
            403,
            "Forbidden",
            forbidden_message(&attrs),
            Some(details),
        ));
    }
    if !ri.resource_request {
        if crate::openapi::handles(path) && req.method() == Method::GET {
            return crate::openapi::serve(path, q, req.headers());
        }
        return non_resource(rep, path, req.method());
    }
    let Some(def) = discovery::find(&ri.group, &ri.version, &ri.resource) else {
        return status_response(&status::path_not_found());
    };
    // A namespaced resource needs a namespace except to list/watch across all of them; a
    // cluster-scoped one must have none (`/api/v1/namespaces/NAME` carries the name as its
    // namespace, as the apiserver's request info does).
    let all_namespaces =
        def.namespaced && ri.name.is_empty() && (ri.verb == "list" || ri.verb == "watch");
    let scope_ok = if def.namespaced {
        !ri.namespace.is_empty() || all_namespaces
    } else {
        ri.namespace.is_empty() || (def.resource == "namespaces" && ri.namespace == ri.name)
    };
    if !scope_ok {
        return status_response(&status::path_not_found());
    }
    // Authorization saw the request info as the apiserver derives it; storage keys
    // cluster-scoped objects without a namespace.
    let scoped;
    let ri = if def.namespaced {
        ri
    } else {
        scoped = RequestInfo {
            namespace: String::new(),
            ..ri.clone()
        };
        &scoped
    };
    match (def.resource, ri.subresource.as_str(), ri.verb.as_str()) {
        ("tokenreviews", "", "create") => {
            return reviews::review(rep, user, req, reviews::token_review).await;
        }
        ("subjectaccessreviews", "", "create") => {
            return reviews::review(rep, user, req, reviews::subject_access_review).await;
        }
        ("selfsubjectaccessreviews", "", "create") => {
            return reviews::review(rep, user, req, reviews::self_subject_access_review).await;
        }
        ("selfsubjectreviews", "", "create") => {
            return reviews::review(rep, user, req, reviews::self_subject_review).await;
        }
        ("pods", "exec", _) => return crate::exec::exec(rep, ri, req, cancel).await,
        ("pods", "log", "get") => return crate::exec::logs(rep, ri, q).await,
        (_, "", _) if def.stored() => {}
        _ => return status_response(&status::path_not_found()),
    }
    if let Some(refusal) = restful_not_acceptable(req.headers(), &ri.verb) {
        return status_response(&refusal);
    }
    let _in_flight = (ri.verb != "watch").then(|| rep.counters.enter(Gauge::InFlight));
    let repr = table::negotiate(
        req.headers()
            .get(header::ACCEPT)
            .and_then(|v| v.to_str().ok()),
    );
    let accept_gzip = req
        .headers()
        .get_all(header::ACCEPT_ENCODING)
        .iter()
        .any(|v| v.to_str().is_ok_and(|s| s.contains("gzip")));
    // Deletes read their options from the body when there is one (see `delete`).
    let options = match ri.verb.as_str() {
        "create" => "CreateOptions",
        "update" => "UpdateOptions",
        "patch" => "PatchOptions",
        _ => "",
    };
    let dry_run = match dry_run(&query_values(q, "dryRun"), options) {
        Ok(d) => d && !options.is_empty(),
        Err(e) if !options.is_empty() => return status_response(&e),
        Err(_) => false,
    };
    let r = match ri.verb.as_str() {
        "get" | "list" if repr.is_none() => Err(not_acceptable()),
        "get" => get(rep, def, ri, repr.unwrap_or(As::Plain)),
        "list" => list(rep, def, ri, q, accept_gzip, repr.unwrap_or(As::Plain)).await,
        "watch" => return watch(rep, def, ri, q, fields).await,
        "create" => create(rep, def, ri, req, dry_run).await,
        "update" => update(rep, def, ri, req, dry_run).await,
        "patch" => patch(rep, def, ri, req, dry_run).await,
        "delete" => delete(rep, def, ri, q, req).await,
        "deletecollection" => delete_collection(rep, def, ri, q, req).await,
        _ => Err(status::method_not_allowed()),
    };
    let resp = r.unwrap_or_else(|e| status_response(&e));
    match _in_flight {
        Some(g) => {
            let (parts, body) = resp.into_parts();
            Response::from_parts(parts, body.hold(g))
        }
        None => resp,
    }
}

fn non_resource(rep: &ReplicaInner, path: &str, method: &Method) -> Response<SimBody> {
    if method != Method::GET {
        return status_response(&status::method_not_allowed());
    }
    let p = path.trim_end_matches('/');
    let doc = match p {
        "/version" => Some(discovery::version()),
        "/api" => Some(discovery::api_versions(&rep.addr.to_string())),
        "/apis" => Some(discovery::api_group_list()),
        "/metrics" => return text(200, &rep.shared.metrics.render_one(rep)),
        _ => {
            let parts: Vec<&str> = p.trim_start_matches('/').split('/').collect();
            match parts.as_slice() {
                ["api", v] => discovery::resource_list("", v),
                ["apis", g] => discovery::api_group(g),
                ["apis", g, v] => discovery::resource_list(g, v),
                _ => None,
            }
        }
    };
    match doc {
        Some(d) => value_response(200, &d),
        None => status_response(&status::path_not_found()),
    }
}

fn get(
    rep: &ReplicaInner,
    def: &'static ResourceDef,
    ri: &RequestInfo,
    repr: As,
) -> Result<Response<SimBody>, ApiError> {
    let o = rep
        .shared
        .store
        .get_obj(&def.key(), &ri.namespace, &ri.name)
        .ok_or_else(|| status::not_found(def.resource, def.group, &ri.name))?;
    Ok(match repr {
        As::Plain => object_response(200, o.with_kind(def)),
        As::Table => value_response(200, &table::table(def, None, json!({}), &[&o])),
        As::Metadata => value_response(200, &table::metadata_object(&o)),
    })
}

/// The 406 the apiserver's router (go-restful) gives before any handler runs, for an
/// `Accept` with text but no media range (`,`): nothing in it matches what the route
/// produces. A collection's route also produces the watch stream types.
fn restful_not_acceptable(headers: &http::HeaderMap, verb: &str) -> Option<ApiError> {
    let accept = headers.get(header::ACCEPT)?.to_str().ok()?;
    let empty_ranges = !accept.trim().is_empty()
        && accept.split(',').all(|range| {
            range
                .split(';')
                .next()
                .unwrap_or_default()
                .trim()
                .is_empty()
        });
    if !empty_ranges {
        return None;
    }
    let mut produces =
        String::from("application/json, application/yaml, application/vnd.kubernetes.protobuf");
    if matches!(verb, "list" | "watch") {
        produces.push_str(
            ", application/json;stream=watch, application/vnd.kubernetes.protobuf;stream=watch",
        );
    }
    Some(ApiError::new(
        406,
        "NotAcceptable",
        format!("406: Not Acceptable\n\nAvailable representations: {produces}"),
        Some(apimachinery::status::Details::default()),
    ))
}

fn not_acceptable() -> ApiError {
    ApiError::new(
        406,
        "NotAcceptable",
        "only the following media types are accepted: application/json, application/yaml, application/vnd.kubernetes.protobuf".into(),
        None,
    )
}

fn parse_rv(s: &str) -> Result<u64, ApiError> {
    s.parse::<u64>().map_err(|_| {
        ApiError::new(
            400,
            "BadRequest",
            format!("invalid resource version: {s:?}"),
            None,
        )
    })
}

/// A LIST's query, read and checked in the order the apiserver checks it.
struct ListQuery<'q> {
    labels: LabelSelector,
    fields: FieldSelector,
    rv: Option<u64>,
    rv_match: Option<&'q str>,
    /// 0: no limit.
    limit: usize,
    cont: Option<&'q str>,
}

fn list_query(q: &Query) -> Result<ListQuery<'_>, ApiError> {
    let labels = LabelSelector::parse(param(q, "labelSelector").unwrap_or_default())
        .map_err(|e| status::bad_request(e.to_string()))?;
    let fields = FieldSelector::parse(param(q, "fieldSelector").unwrap_or_default())
        .map_err(|e| status::bad_request(e.to_string()))?;
    let rv_param = param(q, "resourceVersion").filter(|s| !s.is_empty());
    let rv_match = param(q, "resourceVersionMatch").filter(|s| !s.is_empty());
    let limit: usize = match param(q, "limit").filter(|s| !s.is_empty()) {
        Some(l) => l
            .parse::<i64>()
            .map_err(|_| status::bad_request(format!("invalid limit {l:?}")))?
            .max(0) as usize,
        None => 0,
    };
    let cont = param(q, "continue").filter(|s| !s.is_empty());
    if rv_match.is_some() && cont.is_some() {
        return Err(invalid_list_options(
            "resourceVersionMatch",
            "Forbidden",
            "resourceVersionMatch is forbidden when continue is provided",
        ));
    }
    if rv_match.is_some() && rv_param.is_none() {
        return Err(invalid_list_options(
            "resourceVersionMatch",
            "Forbidden",
            "resourceVersionMatch is forbidden unless resourceVersion is provided",
        ));
    }
    let rv = rv_param.map(parse_rv).transpose()?;
    if rv_match == Some("Exact") && rv == Some(0) {
        return Err(invalid_list_options(
            "resourceVersionMatch",
            "Forbidden",
            "resourceVersionMatch \"exact\" is forbidden for resourceVersion \"0\"",
        ));
    }
    if let Some(m) = rv_match
        && m != "Exact"
        && m != "NotOlderThan"
    {
        return Err(invalid_list_options(
            "resourceVersionMatch",
            "Unsupported",
            &format!("Unsupported value: \"{m}\": supported values: \"Exact\", \"NotOlderThan\""),
        ));
    }
    Ok(ListQuery {
        labels,
        fields,
        rv,
        rv_match,
        limit,
        cont,
    })
}

// Over 120 lines: a LIST's read path as the apiserver takes it (token, version, cache or
// etcd, page, encoding, the memory model), each step on the last one's result.
async fn list(
    rep: &Arc<ReplicaInner>,
    def: &'static ResourceDef,
    ri: &RequestInfo,
    q: &Query,
    gzip: bool,
    repr: As,
) -> Result<Response<SimBody>, ApiError> {
    let sh = &rep.shared;
    let ListQuery {
        labels,
        fields,
        rv,
        rv_match,
        limit,
        cont,
    } = list_query(q)?;
    let ns = (!ri.namespace.is_empty()).then_some(ri.namespace.as_str());
    let scope = Scope::of(ns);
    let key = def.key();
    // The storage layer reads the token before the version: a bad token is the first 400.
    let resume = cont
        .map(continue_token::decode)
        .transpose()
        .map_err(|e| status::bad_request(e.status_message()))?;
    if resume.is_some() && rv.is_some_and(|rv| rv != 0) {
        return Err(status::bad_request(
            "specifying resource version is not allowed when using continue".into(),
        ));
    }
    // Which read path: the watch cache (any state at least as new as rv) or etcd (consistent
    // or an exact revision, paginated).
    let (from_cache, at, start) = match (&resume, rv, rv_match) {
        // A negative version continues at the latest state.
        (Some(resume), _, _) => match resume.at() {
            Some(crv) if crv < sh.store.oldest_watchable() => {
                return Err(status::continue_expired(&resume.start));
            }
            // At version 0 the watch cache answers the rest of the list, whatever the limit.
            at => (rv == Some(0), at, Some(scope.resume_key(&resume.start))),
        },
        (None, None, _) => (false, None, None),
        (None, Some(0), _) => (true, None, None),
        (None, Some(n), Some("Exact")) => (false, Some(n), None),
        (None, Some(n), None) if limit > 0 => (false, Some(n), None),
        (None, Some(n), _) => {
            if !sh.store.wait_for(n, RV_WAIT).await {
                return Err(status::rv_too_large());
            }
            (true, None, None)
        }
    };
    if let Some(n) = at
        && n > sh.store.resource_version()
        && !sh.store.wait_for(n, RV_WAIT).await
    {
        return Err(status::rv_too_large());
    }
    let (list_rv, items) = sh.store.list(&key, ns, at).map_err(|e| match e {
        StoreError::Expired { .. } if resume.is_some() => {
            status::continue_expired(resume.as_ref().map_or("", |r| r.start.as_str()))
        }
        e => store_error(def, e),
    })?;
    let start_idx = match &start {
        Some(from) => items.partition_point(|o| object_key(&o.namespace, &o.name) < *from),
        None => 0,
    };
    let filtered = !labels.is_empty() || !fields.is_empty();
    let mut chosen: Vec<&Arc<Obj>> = Vec::new();
    let mut next_idx = items.len();
    for (i, o) in items.iter().enumerate().skip(start_idx) {
        if labels.matches(&o.labels) && fields.matches(&o.namespace, &o.name) {
            chosen.push(o);
            if !from_cache && limit > 0 && chosen.len() == limit {
                next_idx = i + 1;
                break;
            }
        }
    }
    let more = next_idx < items.len();
    let mut meta = format!("{{\"resourceVersion\":\"{list_rv}\"");
    if more && let Some(last) = chosen.last() {
        meta.push_str(&format!(
            ",\"continue\":\"{}\"",
            continue_token::encode_after(
                i64::try_from(list_rv).unwrap_or(i64::MAX),
                &scope.relative(&object_key(&last.namespace, &last.name))
            )
        ));
        if !filtered {
            meta.push_str(&format!(
                ",\"remainingItemCount\":{}",
                items.len() - next_idx
            ));
        }
    }
    meta.push('}');
    let head = format!(
        "{{\"kind\":\"{}List\",\"apiVersion\":\"{}\",\"metadata\":{meta},\"items\":[",
        def.kind,
        def.api_version()
    );
    let mut chunks = Vec::with_capacity(chosen.len() * 2 + 2);
    chunks.push(Bytes::from(head));
    let comma = Bytes::from_static(b",");
    for (i, o) in chosen.iter().enumerate() {
        if i > 0 {
            chunks.push(comma.clone());
        }
        chunks.push(o.body.clone());
    }
    chunks.push(Bytes::from_static(b"]}\n"));
    if repr != As::Plain {
        let list_meta: Value = serde_json::from_str(&meta).unwrap_or(json!({}));
        let v = match repr {
            As::Table => table::table(def, None, list_meta, &chosen),
            _ => table::metadata_list(list_meta, &chosen),
        };
        chunks = vec![Bytes::from(status::to_ordered_bytes(&v))];
    }
    let response_len: usize = chunks.iter().map(Bytes::len).sum();
    // Memory model: a LIST from etcd reads its whole scope; one from the cache copies its
    // response. Either costs 5x while it is served.
    let read = if from_cache {
        response_len as u64
    } else {
        sh.store.scope_bytes(&key, ns)
    };
    let live = sh.store.live_bytes();
    let guard = match rep.heap.charge(&sh.heap, live, read * LIST_AMPLIFICATION) {
        Ok(g) => g,
        Err(_) => {
            crate::server::oom(rep);
            return Err(ApiError::new(
                503,
                "ServiceUnavailable",
                "apiserver is restarting (out of memory)".into(),
                None,
            ));
        }
    };
    let mut resp = json_chunks(chunks, gzip)?;
    let (parts, body) = std::mem::replace(&mut resp, Response::new(SimBody::empty())).into_parts();
    Ok(Response::from_parts(parts, body.hold(guard)))
}

/// A 200 of `chunks`, gzipped when the client accepts it and the body is large enough.
fn json_chunks(chunks: Vec<Bytes>, gzip: bool) -> Result<Response<SimBody>, ApiError> {
    let response_len: usize = chunks.iter().map(Bytes::len).sum();
    Ok(if gzip && response_len > GZIP_THRESHOLD {
        let mut enc = flate2::write::GzEncoder::new(
            Vec::with_capacity(response_len / 4),
            flate2::Compression::fast(),
        );
        for c in &chunks {
            std::io::Write::write_all(&mut enc, c)
                .map_err(|e| ApiError::new(500, "InternalError", e.to_string(), None))?;
        }
        let z = enc
            .finish()
            .map_err(|e| ApiError::new(500, "InternalError", e.to_string(), None))?;
        let mut r = json_response(200, SimBody::full(z));
        r.headers_mut()
            .insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
        r
    } else {
        json_response(200, SimBody::chunks(chunks))
    })
}

/// Every value of a query parameter, in order.
fn query_values<'a>(q: &'a Query, name: &str) -> Vec<&'a str> {
    q.iter()
        .filter(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
        .collect()
}

/// Whether a write is a dry run: its `dryRun` values are all `All` (and there is one), as
/// the apiserver's validation of `options` (`CreateOptions`, …) has it; any other value is
/// that validation's 422.
fn dry_run(values: &[&str], options: &str) -> Result<bool, ApiError> {
    if values.iter().all(|v| *v == "All") {
        return Ok(!values.is_empty());
    }
    let detail = format!(
        "Unsupported value: {}: supported values: \"All\"",
        serde_json::to_string(&values).unwrap_or_default()
    );
    Err(ApiError::new(
        422,
        "Invalid",
        format!("{options}.meta.k8s.io \"\" is invalid: dryRun: {detail}"),
        Some(apimachinery::status::Details {
            causes: vec![apimachinery::status::Cause {
                reason: "FieldValueNotSupported".into(),
                message: detail,
                field: "dryRun".into(),
            }],
            ..status::details("", "meta.k8s.io", options)
        }),
    ))
}

fn invalid_list_options(field: &str, reason: &str, detail: &str) -> ApiError {
    ApiError::new(
        422,
        "Invalid",
        format!("ListOptions.meta.k8s.io \"\" is invalid: {field}: {reason}: {detail}"),
        Some(apimachinery::status::Details {
            causes: vec![apimachinery::status::Cause {
                reason: format!("FieldValue{reason}"),
                message: format!("{reason}: {detail}"),
                field: field.into(),
            }],
            ..status::details("", "meta.k8s.io", "ListOptions")
        }),
    )
}

async fn watch(
    rep: &Arc<ReplicaInner>,
    def: &'static ResourceDef,
    ri: &RequestInfo,
    q: &Query,
    fields: FieldSelector,
) -> Response<SimBody> {
    let sh = &rep.shared;
    let labels = match LabelSelector::parse(param(q, "labelSelector").unwrap_or_default()) {
        Ok(l) => l,
        Err(e) => return status_response(&status::bad_request(e.to_string())),
    };
    // A watch of one named object (the legacy `/watch/…/NAME` path), as ListResource has
    // it: the name selects, and a field selector may only repeat it.
    let fields = if ri.name.is_empty() {
        fields
    } else if fields.is_empty() {
        match FieldSelector::parse(&format!("metadata.name={}", ri.name)) {
            Ok(f) => f,
            Err(e) => return status_response(&status::bad_request(e.to_string())),
        }
    } else if fields.pinned_name() == Some(ri.name.as_str()) {
        fields
    } else {
        return status_response(&status::bad_request(
            "fieldSelector metadata.name doesn't match requested name".into(),
        ));
    };
    let rv = match param(q, "resourceVersion")
        .filter(|s| !s.is_empty())
        .map(parse_rv)
        .transpose()
    {
        Ok(rv) => rv,
        Err(e) => return status_response(&e),
    };
    let bookmarks = truthy(param(q, "allowWatchBookmarks"));
    let send_initial = param(q, "sendInitialEvents").map(|v| truthy(Some(v)));
    if send_initial.is_some() && param(q, "resourceVersionMatch") != Some("NotOlderThan") {
        return status_response(&invalid_list_options(
            "resourceVersionMatch",
            "Forbidden",
            "sendInitialEvents requires setting resourceVersionMatch to NotOlderThan",
        ));
    }
    let from = match (send_initial, rv) {
        (Some(true), _) | (None, None | Some(0)) => WatchFrom::Now,
        (Some(false), None | Some(0)) => WatchFrom::After(sh.store.resource_version()),
        (_, Some(n)) => WatchFrom::After(n),
    };
    if let Some(n) = rv
        && n > sh.store.resource_version()
        && !sh.store.wait_for(n, RV_WAIT).await
    {
        return status_response(&status::rv_too_large());
    }
    // The apiserver picks a random timeout in [min-request-timeout, 2x) for 0 or none, to
    // spread re-watches; a negative value ends the watch at once.
    let timeout_seconds = match param(q, "timeoutSeconds") {
        None => None,
        Some(t) => match t.parse::<i64>() {
            Ok(n) => Some(n),
            Err(_) => {
                return status_response(&status::bad_request(format!(
                    "strconv.ParseInt: parsing {t:?}: invalid syntax"
                )));
            }
        },
    };
    let timeout = apimachinery::params::watch_timeout(
        timeout_seconds,
        apimachinery::params::MIN_REQUEST_TIMEOUT,
    );
    let start = match sh.store.watch(&def.key(), from) {
        Ok(s) => s,
        Err(StoreError::Expired { requested, oldest }) => {
            return json_response(
                200,
                SimBody::full(watch::error_line(&status::watch_expired(requested, oldest))),
            );
        }
        Err(e) => return status_response(&store_error(def, e)),
    };
    let filter = WatchFilter {
        namespace: (!ri.namespace.is_empty()).then(|| ri.namespace.clone()),
        labels,
        fields,
    };
    let opts = WatchOptions {
        bookmarks: bookmarks.then_some(sh.bookmark_interval),
        // Without allowWatchBookmarks the apiserver sends no bookmark, that one included.
        initial_events_end: send_initial == Some(true) && bookmarks,
        timeout,
    };
    let from_rv = match from {
        WatchFrom::After(n) => Some(n),
        WatchFrom::Now => None,
    };
    let s = watch::stream(def, sh.store.clone(), start, filter, opts, from_rv);
    let guard = rep.counters.enter(Gauge::Watches);
    let mut r = json_response(200, SimBody::stream(s).hold(guard));
    r.headers_mut().insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static("no-cache, private"),
    );
    r
}

fn check_namespace(def: &ResourceDef, ri: &RequestInfo, v: &Value) -> Result<(), ApiError> {
    if !def.namespaced {
        return Ok(());
    }
    match v
        .get("metadata")
        .and_then(|m| m.get("namespace"))
        .and_then(Value::as_str)
    {
        Some(ns) if !ns.is_empty() && ns != ri.namespace => Err(status::bad_request(
            "the namespace of the provided object does not match the namespace sent on the request"
                .into(),
        )),
        _ => Ok(()),
    }
}

pub(crate) fn need_json(h: &HeaderMap) -> Result<(), ApiError> {
    let ct = content_type(h);
    if ct.is_empty() || ct == "application/json" || ct == "*/*" || ct == crate::proto::PROTOBUF {
        Ok(())
    } else {
        Err(status::unsupported_media_type(&ct))
    }
}

async fn create(
    rep: &ReplicaInner,
    def: &'static ResourceDef,
    ri: &RequestInfo,
    req: Request<Incoming>,
    dry_run: bool,
) -> Result<Response<SimBody>, ApiError> {
    if !ri.name.is_empty() {
        return Err(status::method_not_allowed());
    }
    let (h, b) = read_body(req).await?;
    need_json(&h)?;
    let v = parse_body(&h, &b)?;
    check_namespace(def, ri, &v)?;
    let o = rep
        .shared
        .store
        .create_obj(def, &ri.namespace, v, dry_run)
        .map_err(|e| store_error(def, e))?;
    Ok(object_response(201, o.with_kind(def)))
}

async fn update(
    rep: &ReplicaInner,
    def: &'static ResourceDef,
    ri: &RequestInfo,
    req: Request<Incoming>,
    dry_run: bool,
) -> Result<Response<SimBody>, ApiError> {
    let (h, b) = read_body(req).await?;
    need_json(&h)?;
    let v = parse_body(&h, &b)?;
    check_namespace(def, ri, &v)?;
    let name = v
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or_default();
    if !name.is_empty() && name != ri.name {
        return Err(status::bad_request(format!(
            "the name of the object ({name}) does not match the name on the URL ({})",
            ri.name
        )));
    }
    let o = rep
        .shared
        .store
        .update_obj(def, &ri.namespace, Some(&ri.name), v, dry_run)
        .map_err(|e| store_error(def, e))?;
    Ok(object_response(200, o.with_kind(def)))
}

async fn patch(
    rep: &ReplicaInner,
    def: &'static ResourceDef,
    ri: &RequestInfo,
    req: Request<Incoming>,
    dry_run: bool,
) -> Result<Response<SimBody>, ApiError> {
    let (h, b) = read_body(req).await?;
    let kind = match content_type(&h).as_str() {
        "application/merge-patch+json" | "application/strategic-merge-patch+json" => {
            PatchKind::Merge
        }
        "application/json-patch+json" => PatchKind::Json,
        other => return Err(status::unsupported_media_type(other)),
    };
    let p = parse_json(&b)?;
    let o = rep
        .shared
        .store
        .patch_obj(def, &ri.namespace, &ri.name, kind, &p, dry_run)
        .map_err(|e| store_error(def, e))?;
    Ok(object_response(200, o.with_kind(def)))
}

async fn delete(
    rep: &ReplicaInner,
    def: &'static ResourceDef,
    ri: &RequestInfo,
    q: &Query,
    req: Request<Incoming>,
) -> Result<Response<SimBody>, ApiError> {
    let (want, dry_run) = delete_options(q, req).await?;
    let o = rep
        .shared
        .store
        .delete_obj(def, &ri.namespace, &ri.name, want.as_deref(), dry_run)
        .map_err(|e| store_error(def, e))?;
    // The apiserver answers a delete that completes at once with a success Status; only
    // what deletes gracefully (pods) answers with the object.
    if def.resource == "pods" {
        return Ok(object_response(200, o.with_kind(def)));
    }
    let status = apimachinery::status::Status::success(apimachinery::status::Details {
        uid: o.uid.clone(),
        ..status::details(&ri.name, def.group, def.resource)
    });
    Ok(json_response(200, SimBody::full(status.to_body())))
}

/// A delete's options, as the apiserver reads them: from the body when there is one (its
/// query is then ignored, `dryRun` included), else from the query. Returns the
/// resourceVersion precondition and whether it is a dry run.
async fn delete_options(
    q: &Query,
    req: Request<Incoming>,
) -> Result<(Option<String>, bool), ApiError> {
    let (h, b) = read_body(req).await?;
    if b.is_empty() {
        return Ok((None, dry_run(&query_values(q, "dryRun"), "DeleteOptions")?));
    }
    // DeleteOptions in protobuf carry nothing the simulator acts on but preconditions and
    // dry runs, which kubectl does not send that way.
    if content_type(&h) == crate::proto::PROTOBUF {
        return Ok((None, false));
    }
    let opts = parse_json(&b)?;
    let want = opts
        .get("preconditions")
        .and_then(|p| p.get("resourceVersion"))
        .and_then(Value::as_str)
        .map(str::to_string);
    let values: Vec<&str> = opts
        .get("dryRun")
        .and_then(Value::as_array)
        .map(|a| a.iter().map(|v| v.as_str().unwrap_or_default()).collect())
        .unwrap_or_default();
    Ok((want, dry_run(&values, "DeleteOptions")?))
}

async fn delete_collection(
    rep: &ReplicaInner,
    def: &'static ResourceDef,
    ri: &RequestInfo,
    q: &Query,
    req: Request<Incoming>,
) -> Result<Response<SimBody>, ApiError> {
    let (_, dry_run) = delete_options(q, req).await?;
    let labels = LabelSelector::parse(param(q, "labelSelector").unwrap_or_default())
        .map_err(|e| status::bad_request(e.to_string()))?;
    let fields = FieldSelector::parse(param(q, "fieldSelector").unwrap_or_default())
        .map_err(|e| status::bad_request(e.to_string()))?;
    let store = &rep.shared.store;
    let ns = (!ri.namespace.is_empty()).then_some(ri.namespace.as_str());
    let (_, items) = store
        .list(&def.key(), ns, None)
        .map_err(|e| store_error(def, e))?;
    let mut deleted = Vec::new();
    for o in items
        .iter()
        .filter(|o| labels.matches(&o.labels) && fields.matches(&o.namespace, &o.name))
    {
        if let Ok(d) = store.delete_obj(def, &o.namespace, &o.name, None, dry_run) {
            deleted.push(d.body.clone());
        }
    }
    let mut chunks = vec![Bytes::from(format!(
        "{{\"kind\":\"{}List\",\"apiVersion\":\"{}\",\"metadata\":{{\"resourceVersion\":\"{}\"}},\"items\":[",
        def.kind,
        def.api_version(),
        store.resource_version()
    ))];
    for (i, b) in deleted.into_iter().enumerate() {
        if i > 0 {
            chunks.push(Bytes::from_static(b","));
        }
        chunks.push(b);
    }
    chunks.push(Bytes::from_static(b"]}\n"));
    Ok(json_response(200, SimBody::chunks(chunks)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ri(m: Method, p: &str) -> RequestInfo {
        let (path, query) = p.split_once('?').unwrap_or((p, ""));
        request_info(&m, path, &parse_query(Some(query)))
    }

    #[test]
    fn request_info_like_the_apiserver() {
        let r = ri(Method::GET, "/api/v1/namespaces/ns/secrets/x");
        assert_eq!(
            (
                r.verb.as_str(),
                r.resource.as_str(),
                r.namespace.as_str(),
                r.name.as_str()
            ),
            ("get", "secrets", "ns", "x")
        );
        let r = ri(Method::GET, "/api/v1/namespaces/ns/secrets?watch=1");
        assert_eq!(r.verb, "watch");
        let r = ri(Method::GET, "/api/v1/namespaces/ns/secrets?watch=false");
        assert_eq!(r.verb, "list");
        // An empty value is true to apimachinery's bool conversion, and the first value wins.
        for query in ["watch=", "watch", "watch=&watch=0", "watch=FALSE&watch=1"] {
            let r = ri(
                Method::GET,
                &format!("/api/v1/namespaces/ns/secrets?{query}"),
            );
            let expected = if query.contains("FALSE") {
                "list"
            } else {
                "watch"
            };
            assert_eq!(r.verb, expected, "{query}");
        }
        let r = ri(Method::GET, "/api/v1/watch/namespaces/ns/secrets");
        assert_eq!((r.verb.as_str(), r.legacy_watch), ("watch", true));
        // Authorization takes a selector's name on the `?watch=1` form only.
        let user = UserInfo::default();
        let fields = FieldSelector::parse("metadata.name=x").unwrap();
        for (path, name) in [
            ("/api/v1/namespaces/ns/secrets?watch=1", "x"),
            ("/api/v1/namespaces/ns/secrets", "x"),
            ("/api/v1/watch/namespaces/ns/secrets", ""),
            ("/api/v1/watch/namespaces/ns/secrets/y", "y"),
        ] {
            let attrs = attributes(&user, &ri(Method::GET, path), path, Some(&fields));
            assert_eq!(attrs.name, name, "{path}");
        }
        let r = ri(Method::GET, "/api/v1/namespaces/ns");
        assert_eq!(
            (r.resource.as_str(), r.name.as_str(), r.namespace.as_str()),
            ("namespaces", "ns", "ns")
        );
        let r = ri(Method::DELETE, "/apis/discovery.k8s.io/v1/endpointslices");
        assert_eq!(
            (r.verb.as_str(), r.group.as_str()),
            ("deletecollection", "discovery.k8s.io")
        );
        let r = ri(Method::GET, "/api/v1/namespaces/ns/pods/p/exec?command=sh");
        assert_eq!(
            (r.verb.as_str(), r.subresource.as_str()),
            ("create", "exec")
        );
        assert!(!ri(Method::GET, "/version").resource_request);
    }
}

//! Bulwark's Prometheus metrics: registered once, passed to every stage, never global.
//!
//! Names and labels are the contract of DESIGN.md's metrics table. Every label value comes
//! from a closed set, never from what a client sent: verbs and methods known or `other`
//! ([`verb_label`], [`method_label`]), status codes registered or `other` ([`code_label`]),
//! resources built in or configured or `other` ([`ResourceLabels`]), replicas, rules and
//! levels from config, reasons from [`Reason`].

use std::sync::Arc;

use http::{Method, StatusCode};
use prometheus::{
    Encoder, GaugeVec, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};
use rustls_pki_types::CertificateDer;

use crate::classify::{RequestInfo, Verb};
use crate::status::Reason;

mod expiry;
mod process;

pub use expiry::earliest_not_after;

/// Who produced a response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServedBy {
    /// Bulwark's cache answered.
    Cache,
    /// An apiserver replica answered.
    Upstream,
    /// Bulwark answered by itself (a rejection or an error).
    Bulwark,
}

impl ServedBy {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            ServedBy::Cache => "cache",
            ServedBy::Upstream => "upstream",
            ServedBy::Bulwark => "bulwark",
        }
    }
}

/// The `verb` label of a classified request: the apiserver's verb, or for a non-resource
/// request its method as [`method_label`] bounds it.
pub fn verb_label(verb: &Verb) -> &'static str {
    match verb {
        Verb::NonResource(method) => method_label(method),
        resource => resource.resource_verb().unwrap_or_default(),
    }
}

/// The `verb` label of a request that could not be classified: the standard methods in
/// lower case, `other` for any extension method (a client may send any token as a method).
pub fn method_label(method: &Method) -> &'static str {
    match *method {
        Method::GET => "get",
        Method::HEAD => "head",
        Method::POST => "post",
        Method::PUT => "put",
        Method::PATCH => "patch",
        Method::DELETE => "delete",
        Method::OPTIONS => "options",
        Method::CONNECT => "connect",
        Method::TRACE => "trace",
        _ => "other",
    }
}

/// The `code` label: a registered status code as its three digits, `other` for the rest
/// (an answer relayed from a pod through the `proxy` subresource may carry any of 900).
pub fn code_label(status: &StatusCode) -> &str {
    if status.canonical_reason().is_some() {
        status.as_str()
    } else {
        "other"
    }
}

/// Resources that always get their own `resource` label.
const BUILT_IN_RESOURCES: [&str; 24] = [
    "configmaps",
    "customresourcedefinitions",
    "daemonsets",
    "deployments",
    "endpoints",
    "endpointslices",
    "events",
    "ingresses",
    "jobs",
    "leases",
    "namespaces",
    "nodes",
    "persistentvolumeclaims",
    "persistentvolumes",
    "pods",
    "replicasets",
    "rolebindings",
    "roles",
    "secrets",
    "serviceaccounts",
    "services",
    "statefulsets",
    "subjectaccessreviews",
    "tokenreviews",
];

/// The closed set of `resource` label values: the built-in resources, those the cache is
/// configured for, `other` for every other resource and `""` for non-resource requests.
/// Fixed at start, so a client naming a million resources still makes one series.
#[derive(Clone, Debug)]
pub struct ResourceLabels {
    known: Arc<[Arc<str>]>,
    other: Arc<str>,
    none: Arc<str>,
}

impl ResourceLabels {
    /// The built-in resources plus `extra`, each a resource's name without its group (the
    /// label is the resource name, whatever its group).
    pub fn new<'a>(extra: impl IntoIterator<Item = &'a str>) -> Self {
        let mut known: Vec<Arc<str>> = BUILT_IN_RESOURCES.iter().map(|r| Arc::from(*r)).collect();
        for resource in extra {
            if !known.iter().any(|k| &**k == resource) {
                known.push(Arc::from(resource));
            }
        }
        Self {
            known: known.into(),
            other: Arc::from("other"),
            none: Arc::from(""),
        }
    }

    /// The label of a classified request.
    pub fn label(&self, info: &RequestInfo) -> Arc<str> {
        if !info.resource_request {
            return self.none.clone();
        }
        self.known
            .iter()
            .find(|k| ***k == *info.resource)
            .unwrap_or(&self.other)
            .clone()
    }
}

impl Default for ResourceLabels {
    fn default() -> Self {
        Self::new([])
    }
}

/// Every metric Bulwark exports, registered in one registry. Cheap to clone (one `Arc`):
/// every stage keeps a handle, and some take one per request.
#[derive(Clone)]
pub struct Metrics(Arc<MetricFamilies>);

impl std::ops::Deref for Metrics {
    type Target = MetricFamilies;

    fn deref(&self) -> &MetricFamilies {
        &self.0
    }
}

/// The metric families behind [`Metrics`].
pub struct MetricFamilies {
    registry: Registry,
    /// `bulwark_requests_total{verb, resource, code, served_by}`.
    pub requests_total: IntCounterVec,
    /// `bulwark_request_duration_seconds{verb, served_by}`.
    pub request_duration_seconds: HistogramVec,
    /// `bulwark_rejected_requests_total{rule, level, reason}`.
    pub rejected_requests_total: IntCounterVec,
    /// `bulwark_identity_rejections_total{identity, reason}`: refusals of the identities
    /// refused most (`metrics.identities` of them, the rest `other`); empty when off.
    pub identity_rejections_total: IntCounterVec,
    /// `bulwark_rule_requests_total{rule, level}`: requests each rule matched, whatever
    /// became of them — the denominator of a rule's rejection share.
    pub rule_requests_total: IntCounterVec,
    /// `bulwark_upstream_responses_total{replica, code_class}`.
    pub upstream_responses_total: IntCounterVec,
    /// `bulwark_upstream_retries_total{replica, reason}`: requests sent again to another
    /// replica after one failed them, by the replica that failed and why.
    pub upstream_retries_total: IntCounterVec,
    /// `bulwark_upstream_healthy{replica}`: 1 when the replica takes traffic.
    pub upstream_healthy: IntGaugeVec,
    /// `bulwark_upstream_in_flight{replica}`: requests waiting for their response head.
    pub upstream_in_flight: IntGaugeVec,
    /// `bulwark_upstream_watches{replica}`: open watch streams.
    pub upstream_watches: IntGaugeVec,
    /// `bulwark_authz_reviews_total{kind, result}`.
    pub authz_reviews_total: IntCounterVec,
    /// `bulwark_shadow_rejections_total{rule, level, reason}`: what shadow-mode rules would
    /// have refused.
    pub shadow_rejections_total: IntCounterVec,
    /// `bulwark_queue_wait_seconds{level}`: time from arrival to dispatch of admitted requests.
    pub queue_wait_seconds: HistogramVec,
    /// `bulwark_level_waiting_requests{level}`: requests waiting in the level's queues.
    pub level_waiting_requests: IntGaugeVec,
    /// `bulwark_level_executing_seats{level}`: seats held by executing requests.
    pub level_executing_seats: IntGaugeVec,
    /// `bulwark_level_seats_limit{level}`: seats the level may use now (shrinks with the
    /// share of healthy replicas).
    pub level_seats_limit: IntGaugeVec,
    /// `bulwark_list_bytes_in_flight{replica}`: LIST bytes admitted to the replica.
    pub list_bytes_in_flight: IntGaugeVec,
    /// `bulwark_list_bytes_budget{replica}`: the replica's in-flight LIST byte budget.
    pub list_bytes_budget: IntGaugeVec,
    /// `bulwark_rules_reload_total{result}`: rule reloads, `success` or `error`.
    pub rules_reload_total: IntCounterVec,
    /// `bulwark_rules_loaded_info{hash}`: 1 for the content hash of the loaded rules.
    pub rules_loaded_info: IntGaugeVec,
    /// `bulwark_rules_stale`: 1 while the last reload failed (the files on disk are not the
    /// rules in force), 0 once one succeeds.
    pub rules_stale: IntGauge,
    /// `bulwark_certificate_expiry_timestamp_seconds{certificate}`: the notAfter of each
    /// certificate (or the earliest of a bundle) Bulwark loaded.
    pub certificate_expiry_timestamp_seconds: IntGaugeVec,
    /// `bulwark_cache_objects{resource}`.
    pub cache_objects: IntGaugeVec,
    /// `bulwark_cache_bytes{resource}`: bytes of the cached objects' JSON.
    pub cache_bytes: IntGaugeVec,
    /// `bulwark_cache_watchers{resource}`: watches served from the cache.
    pub cache_watchers: IntGaugeVec,
    /// `bulwark_cache_lag_seconds{resource}`: 0 while the upstream watch runs, else the
    /// time since it stopped.
    pub cache_lag_seconds: GaugeVec,
    /// `bulwark_cache_relists_total{resource}`: full lists after the first.
    pub cache_relists_total: IntCounterVec,
    /// `bulwark_cache_requests_total{resource, verb, result}` (hit, miss, bypass).
    pub cache_requests_total: IntCounterVec,
    /// `bulwark_cache_slow_watchers_total{resource}`: watchers disconnected for falling
    /// behind.
    pub cache_slow_watchers_total: IntCounterVec,
    /// `bulwark_connections_open`: client connections open, handshakes included.
    pub connections_open: IntGauge,
    /// `bulwark_connections_max`: the total connection cap in force.
    pub connections_max: IntGauge,
    /// `bulwark_connections_refused_total{reason}`: client connections closed before
    /// their handshake (a cap, or the PROXY protocol).
    pub connections_refused_total: IntCounterVec,
    /// `bulwark_connections_closed_total{reason}`: client connections Bulwark closed: for
    /// not authenticating, for a timeout before their first request, or evicted.
    pub connections_closed_total: IntCounterVec,
    /// `bulwark_admin_connections_open`: admin listener connections open.
    pub admin_connections_open: IntGauge,
    /// `bulwark_admin_connections_refused_total{reason}`: admin connections reset at
    /// accept for a cap.
    pub admin_connections_refused_total: IntCounterVec,
    /// `bulwark_admin_connections_closed_total{reason}`: admin connections closed for a
    /// timeout before their first request.
    pub admin_connections_closed_total: IntCounterVec,
    /// `bulwark_fleet_members`: live members of the fleet this replica sees (0 when the
    /// fleet is off or on the static split).
    pub fleet_members: IntGauge,
    /// `bulwark_fleet_static`: 1 while this replica holds the static split because it
    /// cannot renew or read the fleet's Leases.
    pub fleet_static: IntGauge,
    /// `bulwark_flows`: flows whose state admission remembers (token bucket, backoff, open
    /// watches).
    pub flows: IntGauge,
    /// `bulwark_flows_evicted_total{reason}`: flows forgotten: `idle` (no request, watch or
    /// recent refusal for a while) or `capacity` (the table was full and a new flow took the
    /// place of the least recently seen without an open watch).
    pub flows_evicted_total: IntCounterVec,
    /// `bulwark_fleet_rate_flows`: flows whose rate this replica shares with other members
    /// (each holds part of its rule; `/debug/fleet` lists them).
    pub fleet_rate_flows: IntGauge,
    /// `bulwark_fleet_share{kind, name}`: what this replica holds of the fleet's budget:
    /// `list_bytes` per apiserver replica, `seats` per level.
    pub fleet_share: IntGaugeVec,
    /// `bulwark_fleet_renewals_total{result}`: rounds of the fleet's Lease renewal
    /// (`success` or `error`).
    pub fleet_renewals_total: IntCounterVec,
    /// `bulwark_fleet_service_endpoints`: replicas behind the `kubernetes` Service as this
    /// replica (or guard) last published it (`fleet.kubernetesService`).
    pub fleet_service_endpoints: IntGauge,
    /// `bulwark_fleet_service_writes_total{result}`: writes of the `kubernetes` Service's
    /// EndpointSlices and Endpoints (`success`), and rounds that could not publish
    /// (`error`).
    pub fleet_service_writes_total: IntCounterVec,
    /// `bulwark_fleet_leases_rejected_total{reason}`: unexpired Leases with the fleet's
    /// prefix that did not count, each time a round read one (`name`, `duration`,
    /// `future`, `signature`: [`crate::fleet::lease::Rejection`]).
    pub fleet_leases_rejected_total: IntCounterVec,
    /// `bulwark_fleet_uncounted_members`: live members beyond `bulwarkReplicas`, whose
    /// demand does not count (the newest Leases).
    pub fleet_uncounted_members: IntGauge,
    /// `bulwark_log_lines_dropped_total{log, reason}`: lines of a file log (`audit`) never
    /// written: `queue_full` (the writer fell behind) or `write_failed` (the disk refused).
    pub log_lines_dropped_total: IntCounterVec,
    /// `bulwark_responses_cut_total{reason}`: responses Bulwark ended before their end:
    /// `client_not_reading` (the client took nothing for `sendProgressTimeout` while the
    /// response held seats or LIST bytes, which went back to its level).
    pub responses_cut_total: IntCounterVec,
    /// `bulwark_access_log_suppressed_total{reason}`: access-log lines of refusals that
    /// identified no one (`unauthenticated`, `review_limited`) left out past their bound.
    pub access_log_suppressed_total: IntCounterVec,
}

impl Metrics {
    /// Creates and registers every metric in a fresh registry.
    pub fn new() -> Self {
        let registry = Registry::new();
        let counter = |name: &str, help: &str, labels: &[&str]| {
            let c = IntCounterVec::new(Opts::new(format!("bulwark_{name}"), help), labels)
                .expect("valid metric definition");
            registry
                .register(Box::new(c.clone()))
                .expect("metric registered once");
            c
        };
        let requests_total = counter(
            "requests_total",
            "Requests answered, by verb, resource, status code and who served them.",
            &["verb", "resource", "code", "served_by"],
        );
        let rejected_requests_total = counter(
            "rejected_requests_total",
            "Requests Bulwark refused, by rule, priority level and reason.",
            &["rule", "level", "reason"],
        );
        let identity_rejections_total = counter(
            "identity_rejections_total",
            "Requests Bulwark refused, by identity and reason: the metrics.identities identities refused most in the last minute are named, every other is `other` (nothing is counted when metrics.identities is 0).",
            &["identity", "reason"],
        );
        let rule_requests_total = counter(
            "rule_requests_total",
            "Requests each rule matched (answered, queued or refused), by rule and priority level.",
            &["rule", "level"],
        );
        let upstream_responses_total = counter(
            "upstream_responses_total",
            "Responses from each apiserver replica, by status class (2xx..5xx, or error).",
            &["replica", "code_class"],
        );
        let upstream_retries_total = counter(
            "upstream_retries_total",
            "Requests sent again after a replica failed them, by that replica and why: not_sent (it never reached the apiserver), reset (the exchange broke), attempt_timeout (no response head within upstream.timeouts.attempt), unresponsive (the replica was ejected for not answering its probe).",
            &["replica", "reason"],
        );
        let authz_reviews_total = counter(
            "authz_reviews_total",
            "TokenReviews and SubjectAccessReviews, by kind and result (cached and limited made no review).",
            &["kind", "result"],
        );
        let shadow_rejections_total = counter(
            "shadow_rejections_total",
            "Requests a shadow-mode rule would have refused, by rule, level and reason.",
            &["rule", "level", "reason"],
        );
        let rules_reload_total = counter(
            "rules_reload_total",
            "Reloads of the rule files, by result (success, error); a failed one keeps the running rules.",
            &["result"],
        );
        let cache_relists_total = counter(
            "cache_relists_total",
            "Full lists of a cached resource after the first (410 or a lost watch).",
            &["resource"],
        );
        let cache_requests_total = counter(
            "cache_requests_total",
            "Requests for cached resources, by result: hit (the cache answered), miss (not synced or not provably fresh), bypass (not cacheable).",
            &["resource", "verb", "result"],
        );
        let cache_slow_watchers_total = counter(
            "cache_slow_watchers_total",
            "Watchers disconnected because they fell further behind than their buffer.",
            &["resource"],
        );
        let connections_refused_total = counter(
            "connections_refused_total",
            "Client connections closed before their TLS handshake, by reason: max_connections, max_connections_per_source, max_connections_per_prefix, proxy_header_untrusted, proxy_header_missing, proxy_header_malformed, proxy_header_silent.",
            &["reason"],
        );
        let connections_closed_total = counter(
            "connections_closed_total",
            "Client connections Bulwark closed, by reason: unauthenticated_timeout (no request authenticated in time), unauthenticated_requests (too many refused credentials in a row), first_byte_timeout, proxy_header_timeout, handshake_timeout, header_read_timeout (no first request in time), evicted (the oldest unauthenticated connection, for a new one at maxConnections), client_not_reading (a response waited for its client past listen.limits.sendProgressTimeout).",
            &["reason"],
        );
        let admin_connections_refused_total = counter(
            "admin_connections_refused_total",
            "Admin listener connections reset as soon as accepted, by reason: max_connections, max_connections_per_source, max_connections_per_prefix.",
            &["reason"],
        );
        let admin_connections_closed_total = counter(
            "admin_connections_closed_total",
            "Admin listener connections Bulwark closed, by reason: first_byte_timeout, handshake_timeout, header_read_timeout, evicted (the oldest that sent no whole request, for a new one at the cap).",
            &["reason"],
        );
        let fleet_renewals_total = counter(
            "fleet_renewals_total",
            "Rounds of the fleet's Lease renewal and read, by result (success, error); an error falls back to the static split.",
            &["result"],
        );
        let fleet_service_writes_total = counter(
            "fleet_service_writes_total",
            "Writes of the kubernetes Service's EndpointSlices and Endpoints (success), and rounds that could not publish them (error), with fleet.kubernetesService.",
            &["result"],
        );
        let fleet_leases_rejected_total = counter(
            "fleet_leases_rejected_total",
            "Unexpired Leases with the fleet's prefix that did not count, each round that read one, by reason: name (not the prefix plus its holder), duration (longer than fleet.leaseDuration), future (renewed ahead of this replica's clock), signature (fleet.keyFile set and the MAC missing or wrong).",
            &["reason"],
        );
        let log_lines_dropped_total = counter(
            "log_lines_dropped_total",
            "Lines of a file log never written, by log (audit) and reason: queue_full (the writer thread fell behind), write_failed (the file could not be written).",
            &["log", "reason"],
        );
        let flows_evicted_total = counter(
            "flows_evicted_total",
            "Flows whose admission state (token bucket, backoff) was forgotten, by reason: idle (no request, open watch or recent refusal for a while), capacity (the flow table was full: a new flow took the place of the least recently seen without an open watch).",
            &["reason"],
        );
        let plain_gauge = |name: &str, help: &str| {
            let g =
                IntGauge::new(format!("bulwark_{name}"), help).expect("valid metric definition");
            registry
                .register(Box::new(g.clone()))
                .expect("metric registered once");
            g
        };
        let fleet_members = plain_gauge(
            "fleet_members",
            "Live members of the fleet of Bulwark replicas this one sees (0: fleet off or static split).",
        );
        let fleet_service_endpoints = plain_gauge(
            "fleet_service_endpoints",
            "Bulwark replicas behind the kubernetes Service as last published (0: the apiservers serve in-cluster clients directly), with fleet.kubernetesService.",
        );
        let fleet_static = plain_gauge(
            "fleet_static",
            "1 while this replica holds the static split because it cannot renew or read the fleet's Leases.",
        );
        let fleet_uncounted_members = plain_gauge(
            "fleet_uncounted_members",
            "Live fleet members beyond upstream.bulwarkReplicas (the newest Leases), whose demand does not count: a rollout, or Leases someone else wrote.",
        );
        let flows = plain_gauge(
            "flows",
            "Flows whose admission state (token bucket, backoff, open watches) is remembered.",
        );
        let fleet_rate_flows = plain_gauge(
            "fleet_rate_flows",
            "Flows whose rate this replica shares with other members of its fleet (see /debug/fleet).",
        );
        let connections_open = plain_gauge(
            "connections_open",
            "Client connections open, TLS handshakes included.",
        );
        let admin_connections_open = plain_gauge(
            "admin_connections_open",
            "Admin listener connections open, TLS handshakes included.",
        );
        let rules_stale = plain_gauge(
            "rules_stale",
            "1 while the last reload of the rule files failed (the files on disk are not the rules in force), 0 after a successful one.",
        );
        let connections_max = plain_gauge(
            "connections_max",
            "The cap on open client connections in force (listen.limits.maxConnections, lowered to the open-file limit less the reserve).",
        );
        let gauge = |name: &str, help: &str, labels: &[&str]| {
            let g = IntGaugeVec::new(Opts::new(format!("bulwark_{name}"), help), labels)
                .expect("valid metric definition");
            registry
                .register(Box::new(g.clone()))
                .expect("metric registered once");
            g
        };
        let upstream_healthy = gauge(
            "upstream_healthy",
            "1 when the apiserver replica takes traffic, 0 while it is ejected.",
            &["replica"],
        );
        let upstream_in_flight = gauge(
            "upstream_in_flight",
            "Requests sent to the replica that wait for their response head.",
            &["replica"],
        );
        let upstream_watches = gauge(
            "upstream_watches",
            "Watch streams open to the replica.",
            &["replica"],
        );
        let level_waiting_requests = gauge(
            "level_waiting_requests",
            "Requests waiting in the priority level's fair queues.",
            &["level"],
        );
        let level_executing_seats = gauge(
            "level_executing_seats",
            "Seats held by the priority level's executing requests.",
            &["level"],
        );
        let level_seats_limit = gauge(
            "level_seats_limit",
            "Seats the priority level may use now, shrunk by the share of healthy replicas.",
            &["level"],
        );
        let list_bytes_in_flight = gauge(
            "list_bytes_in_flight",
            "LIST bytes admitted to the apiserver replica and not yet answered in full.",
            &["replica"],
        );
        let fleet_share = gauge(
            "fleet_share",
            "What this replica holds of the fleet's budget: kind list_bytes per apiserver replica (bytes), kind seats per level.",
            &["kind", "name"],
        );
        let list_bytes_budget = gauge(
            "list_bytes_budget",
            "The apiserver replica's in-flight LIST byte budget.",
            &["replica"],
        );
        let rules_loaded_info = gauge(
            "rules_loaded_info",
            "1 for the content hash of the rules in force.",
            &["hash"],
        );
        let certificate_expiry_timestamp_seconds = gauge(
            "certificate_expiry_timestamp_seconds",
            "When each certificate Bulwark loaded expires (notAfter, Unix seconds; the earliest of a bundle): serving, client_ca, front_proxy, own, upstream_ca.",
            &["certificate"],
        );
        let responses_cut_total = counter(
            "responses_cut_total",
            "Responses Bulwark ended early, by reason: client_not_reading (the client took nothing for listen.limits.sendProgressTimeout while the response held seats or LIST bytes, given back at once).",
            &["reason"],
        );
        let access_log_suppressed_total = counter(
            "access_log_suppressed_total",
            "Access-log lines of refusals that identified no one left out past their bound (a line a second per client prefix, 100 in all), by reason: unauthenticated, review_limited.",
            &["reason"],
        );
        process::register(&registry);
        let queue_wait_seconds = HistogramVec::new(
            HistogramOpts::new(
                "bulwark_queue_wait_seconds",
                "Time admitted requests waited in their priority level's fair queue.",
            )
            .buckets(vec![
                0.0001, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                60.0,
            ]),
            &["level"],
        )
        .expect("valid metric definition");
        registry
            .register(Box::new(queue_wait_seconds.clone()))
            .expect("metric registered once");
        let cache_objects = gauge("cache_objects", "Objects in the cache.", &["resource"]);
        let cache_bytes = gauge(
            "cache_bytes",
            "Bytes of the cached objects' JSON.",
            &["resource"],
        );
        let cache_watchers = gauge(
            "cache_watchers",
            "Watches served from the cache.",
            &["resource"],
        );
        let cache_lag_seconds = GaugeVec::new(
            Opts::new(
                "bulwark_cache_lag_seconds",
                "0 while the cache's upstream watch runs, else the seconds since it stopped.",
            ),
            &["resource"],
        )
        .expect("valid metric definition");
        registry
            .register(Box::new(cache_lag_seconds.clone()))
            .expect("metric registered once");
        let request_duration_seconds = HistogramVec::new(
            HistogramOpts::new(
                "bulwark_request_duration_seconds",
                "Time from request head to response head, by verb and who served it.",
            )
            .buckets(vec![
                0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                60.0,
            ]),
            &["verb", "served_by"],
        )
        .expect("valid metric definition");
        registry
            .register(Box::new(request_duration_seconds.clone()))
            .expect("metric registered once");
        Self(Arc::new(MetricFamilies {
            registry,
            requests_total,
            request_duration_seconds,
            rejected_requests_total,
            identity_rejections_total,
            rule_requests_total,
            upstream_responses_total,
            upstream_retries_total,
            upstream_healthy,
            upstream_in_flight,
            upstream_watches,
            authz_reviews_total,
            shadow_rejections_total,
            queue_wait_seconds,
            level_waiting_requests,
            level_executing_seats,
            level_seats_limit,
            list_bytes_in_flight,
            list_bytes_budget,
            rules_reload_total,
            rules_loaded_info,
            rules_stale,
            certificate_expiry_timestamp_seconds,
            cache_objects,
            cache_bytes,
            cache_watchers,
            cache_lag_seconds,
            cache_relists_total,
            cache_requests_total,
            cache_slow_watchers_total,
            connections_open,
            connections_max,
            connections_refused_total,
            connections_closed_total,
            admin_connections_open,
            admin_connections_refused_total,
            admin_connections_closed_total,
            fleet_members,
            fleet_static,
            flows,
            flows_evicted_total,
            fleet_rate_flows,
            fleet_share,
            fleet_renewals_total,
            fleet_service_endpoints,
            fleet_service_writes_total,
            fleet_leases_rejected_total,
            fleet_uncounted_members,
            log_lines_dropped_total,
            responses_cut_total,
            access_log_suppressed_total,
        }))
    }

    /// Counts a request Bulwark refused.
    pub fn reject(&self, rule: &str, level: &str, reason: Reason) {
        self.rejected_requests_total
            .with_label_values(&[rule, level, reason.as_str()])
            .inc();
    }

    /// Publishes when `certificate` (`serving`, `client_ca`, ...) expires: the earliest
    /// notAfter of `certs`; nothing changes when none parses.
    pub fn set_certificate_expiry(&self, certificate: &str, certs: &[CertificateDer<'_>]) {
        if let Some(not_after) = earliest_not_after(certs) {
            self.certificate_expiry_timestamp_seconds
                .with_label_values(&[certificate])
                .set(not_after);
        }
    }

    /// The registry, for components that register metrics of their own.
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut out)
            .expect("text encoding of gathered metrics");
        String::from_utf8(out).expect("Prometheus text is UTF-8")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_values_come_from_closed_sets() {
        let odd = Method::from_bytes(b"XYZZYSOMETHINGLONG").unwrap();
        assert_eq!(method_label(&odd), "other");
        assert_eq!(method_label(&Method::PATCH), "patch");
        assert_eq!(verb_label(&Verb::NonResource(odd)), "other");
        assert_eq!(verb_label(&Verb::DeleteCollection), "deletecollection");
        assert_eq!(code_label(&StatusCode::TOO_MANY_REQUESTS), "429");
        assert_eq!(code_label(&StatusCode::from_u16(599).unwrap()), "other");

        let labels = ResourceLabels::new(["widgets", "secrets"]);
        let info =
            |path: &str| crate::classify::classify(&Method::GET, &path.parse().unwrap()).unwrap();
        assert_eq!(&*labels.label(&info("/api/v1/namespaces/a/pods")), "pods");
        assert_eq!(
            &*labels.label(&info("/apis/example.com/v1/widgets")),
            "widgets"
        );
        assert_eq!(&*labels.label(&info("/api/v1/zq8f3kd")), "other");
        assert_eq!(&*labels.label(&info("/zq8f3kd")), "");
    }
}

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
    Encoder, GaugeVec, HistogramVec, IntCounterVec, IntGauge, IntGaugeVec, Registry, TextEncoder,
};
use rustls_pki_types::CertificateDer;

use crate::classify::{RequestInfo, Verb};
use crate::status::Reason;

mod expiry;
mod families;
mod process;
mod shard;

pub use expiry::earliest_not_after;

/// Who produced a response.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
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
    /// `bulwark_requests_total{verb, resource, code, served_by}`,
    /// `bulwark_request_duration_seconds{verb, served_by}` and
    /// `bulwark_rule_requests_total{rule, level}` (requests each rule matched, whatever
    /// became of them: the denominator of a rule's rejection share), each counted by each
    /// thread into its own
    /// shard ([`Metrics::count_request`], [`Metrics::count_rule`]).
    shards: Arc<shard::Shards>,
    /// `bulwark_rejected_requests_total{rule, level, reason}`.
    pub rejected_requests_total: IntCounterVec,
    /// `bulwark_identity_rejections_total{identity, reason}`: refusals of the identities
    /// refused most (`metrics.identities` of them, the rest `other`); empty when off.
    pub identity_rejections_total: IntCounterVec,
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
    /// response held seats or LIST bytes, which went back to its level) or
    /// `upstream_unresponsive` (its replica was ejected for not answering its probe and the
    /// body then stood still for a probe interval).
    pub responses_cut_total: IntCounterVec,
    /// `bulwark_access_log_suppressed_total{reason}`: access-log lines of refusals that
    /// identified no one (`unauthenticated`, `review_limited`) left out past their bound.
    pub access_log_suppressed_total: IntCounterVec,
}

impl Metrics {
    /// Creates and registers every metric in a fresh registry.
    pub fn new() -> Self {
        use families::*;
        let registry = Registry::new();
        process::register(&registry);
        let r = Register(&registry);
        let shards = Arc::new(shard::Shards::new(
            Register::counter_apart(&REQUESTS_TOTAL),
            Register::histogram_apart(&REQUEST_DURATION_SECONDS, &REQUEST_DURATION_BUCKETS),
            Register::counter_apart(&RULE_REQUESTS_TOTAL),
        ));
        shards.register(&r);
        let families = MetricFamilies {
            shards: shards.clone(),
            rejected_requests_total: r.counter(&REJECTED_REQUESTS_TOTAL),
            identity_rejections_total: r.counter(&IDENTITY_REJECTIONS_TOTAL),
            upstream_responses_total: r.counter(&UPSTREAM_RESPONSES_TOTAL),
            upstream_retries_total: r.counter(&UPSTREAM_RETRIES_TOTAL),
            upstream_healthy: r.gauge(&UPSTREAM_HEALTHY),
            upstream_in_flight: r.gauge(&UPSTREAM_IN_FLIGHT),
            upstream_watches: r.gauge(&UPSTREAM_WATCHES),
            authz_reviews_total: r.counter(&AUTHZ_REVIEWS_TOTAL),
            shadow_rejections_total: r.counter(&SHADOW_REJECTIONS_TOTAL),
            queue_wait_seconds: r.histogram(&QUEUE_WAIT_SECONDS, &QUEUE_WAIT_BUCKETS),
            level_waiting_requests: r.gauge(&LEVEL_WAITING_REQUESTS),
            level_executing_seats: r.gauge(&LEVEL_EXECUTING_SEATS),
            level_seats_limit: r.gauge(&LEVEL_SEATS_LIMIT),
            list_bytes_in_flight: r.gauge(&LIST_BYTES_IN_FLIGHT),
            list_bytes_budget: r.gauge(&LIST_BYTES_BUDGET),
            rules_reload_total: r.counter(&RULES_RELOAD_TOTAL),
            rules_loaded_info: r.gauge(&RULES_LOADED_INFO),
            rules_stale: r.plain_gauge(&RULES_STALE),
            certificate_expiry_timestamp_seconds: r.gauge(&CERTIFICATE_EXPIRY_TIMESTAMP_SECONDS),
            cache_objects: r.gauge(&CACHE_OBJECTS),
            cache_bytes: r.gauge(&CACHE_BYTES),
            cache_watchers: r.gauge(&CACHE_WATCHERS),
            cache_lag_seconds: r.float_gauge(&CACHE_LAG_SECONDS),
            cache_relists_total: r.counter(&CACHE_RELISTS_TOTAL),
            cache_requests_total: r.counter(&CACHE_REQUESTS_TOTAL),
            cache_slow_watchers_total: r.counter(&CACHE_SLOW_WATCHERS_TOTAL),
            connections_open: r.plain_gauge(&CONNECTIONS_OPEN),
            connections_max: r.plain_gauge(&CONNECTIONS_MAX),
            connections_refused_total: r.counter(&CONNECTIONS_REFUSED_TOTAL),
            connections_closed_total: r.counter(&CONNECTIONS_CLOSED_TOTAL),
            admin_connections_open: r.plain_gauge(&ADMIN_CONNECTIONS_OPEN),
            admin_connections_refused_total: r.counter(&ADMIN_CONNECTIONS_REFUSED_TOTAL),
            admin_connections_closed_total: r.counter(&ADMIN_CONNECTIONS_CLOSED_TOTAL),
            fleet_members: r.plain_gauge(&FLEET_MEMBERS),
            fleet_static: r.plain_gauge(&FLEET_STATIC),
            flows: r.plain_gauge(&FLOWS),
            flows_evicted_total: r.counter(&FLOWS_EVICTED_TOTAL),
            fleet_rate_flows: r.plain_gauge(&FLEET_RATE_FLOWS),
            fleet_share: r.gauge(&FLEET_SHARE),
            fleet_renewals_total: r.counter(&FLEET_RENEWALS_TOTAL),
            fleet_service_endpoints: r.plain_gauge(&FLEET_SERVICE_ENDPOINTS),
            fleet_service_writes_total: r.counter(&FLEET_SERVICE_WRITES_TOTAL),
            fleet_leases_rejected_total: r.counter(&FLEET_LEASES_REJECTED_TOTAL),
            fleet_uncounted_members: r.plain_gauge(&FLEET_UNCOUNTED_MEMBERS),
            log_lines_dropped_total: r.counter(&LOG_LINES_DROPPED_TOTAL),
            responses_cut_total: r.counter(&RESPONSES_CUT_TOTAL),
            access_log_suppressed_total: r.counter(&ACCESS_LOG_SUPPRESSED_TOTAL),
            registry,
        };
        Self(Arc::new(families))
    }

    /// Counts an answered request (`bulwark_requests_total`) and how long it took
    /// (`bulwark_request_duration_seconds`), in this thread's shard.
    pub fn count_request(
        &self,
        (verb, resource): (&'static str, &str),
        status: StatusCode,
        served_by: ServedBy,
        took: std::time::Duration,
    ) {
        self.shards
            .request((verb, resource), status, served_by, took);
    }

    /// Counts a request `rule` matched at `level` (`bulwark_rule_requests_total`), in this
    /// thread's shard.
    pub fn count_rule(&self, rule: &str, level: &str) {
        self.shards.rule(rule, level);
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

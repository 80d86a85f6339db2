//! Every metric family Bulwark registers: its name, help and labels, one constant each,
//! and the registrar [`super::Metrics::new`] builds them with.

use std::sync::Arc;

use prometheus::{
    GaugeVec, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
};

use super::shard::{Flushing, Shards};

/// A metric family: `bulwark_` + `name`, its help text and its label names.
pub(super) struct Family {
    name: &'static str,
    help: &'static str,
    labels: &'static [&'static str],
}

/// Registers families in one registry; a definition that does not register is a bug.
pub(super) struct Register<'a>(pub(super) &'a Registry);

impl Register<'_> {
    fn add<M: prometheus::core::Collector + Clone + 'static>(&self, metric: M) -> M {
        self.0
            .register(Box::new(metric.clone()))
            .expect("metric registered once");
        metric
    }

    fn opts(family: &Family) -> Opts {
        Opts::new(format!("bulwark_{}", family.name), family.help)
    }

    pub(super) fn counter(&self, family: &Family) -> IntCounterVec {
        self.add(Self::counter_apart(family))
    }

    /// A counter family not yet registered: registered by [`Register::flushing`].
    pub(super) fn counter_apart(family: &Family) -> IntCounterVec {
        IntCounterVec::new(Self::opts(family), family.labels).expect("valid metric definition")
    }

    /// A histogram family not yet registered: registered by [`Register::flushing`].
    pub(super) fn histogram_apart(family: &Family, buckets: &[f64]) -> HistogramVec {
        let opts = HistogramOpts::new(format!("bulwark_{}", family.name), family.help)
            .buckets(buckets.to_vec());
        HistogramVec::new(opts, family.labels).expect("valid metric definition")
    }

    /// Registers `family` so that every scrape first adds the threads' `shards` into it.
    pub(super) fn flushing<C>(&self, family: &C, shards: &Arc<Shards>)
    where
        C: prometheus::core::Collector + Clone + 'static,
    {
        self.add(Flushing {
            inner: family.clone(),
            shards: shards.clone(),
        });
    }

    pub(super) fn gauge(&self, family: &Family) -> IntGaugeVec {
        self.add(
            IntGaugeVec::new(Self::opts(family), family.labels).expect("valid metric definition"),
        )
    }

    pub(super) fn plain_gauge(&self, family: &Family) -> IntGauge {
        self.add(IntGauge::with_opts(Self::opts(family)).expect("valid metric definition"))
    }

    pub(super) fn float_gauge(&self, family: &Family) -> GaugeVec {
        self.add(GaugeVec::new(Self::opts(family), family.labels).expect("valid metric definition"))
    }

    pub(super) fn histogram(&self, family: &Family, buckets: &[f64]) -> HistogramVec {
        self.add(Self::histogram_apart(family, buckets))
    }
}

/// Buckets of `bulwark_queue_wait_seconds`.
pub(super) const QUEUE_WAIT_BUCKETS: [f64; 15] = [
    0.0001, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// Buckets of `bulwark_request_duration_seconds`.
pub(super) const REQUEST_DURATION_BUCKETS: [f64; 15] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

pub(super) const REQUESTS_TOTAL: Family = Family {
    name: "requests_total",
    help: "Requests answered, by verb, resource, status code and who served them.",
    labels: &["verb", "resource", "code", "served_by"],
};

pub(super) const REJECTED_REQUESTS_TOTAL: Family = Family {
    name: "rejected_requests_total",
    help: "Requests Bulwark refused, by rule, priority level and reason.",
    labels: &["rule", "level", "reason"],
};

pub(super) const IDENTITY_REJECTIONS_TOTAL: Family = Family {
    name: "identity_rejections_total",
    help: "Requests Bulwark refused, by identity and reason: the metrics.identities identities refused most in the last minute are named, every other is `other` (nothing is counted when metrics.identities is 0).",
    labels: &["identity", "reason"],
};

pub(super) const RULE_REQUESTS_TOTAL: Family = Family {
    name: "rule_requests_total",
    help: "Requests each rule matched (answered, queued or refused), by rule and priority level.",
    labels: &["rule", "level"],
};

pub(super) const UPSTREAM_RESPONSES_TOTAL: Family = Family {
    name: "upstream_responses_total",
    help: "Responses from each apiserver replica, by status class (2xx..5xx, or error).",
    labels: &["replica", "code_class"],
};

pub(super) const UPSTREAM_RETRIES_TOTAL: Family = Family {
    name: "upstream_retries_total",
    help: "Requests sent again after a replica failed them, by that replica and why: not_sent (it never reached the apiserver), reset (the exchange broke), attempt_timeout (no response head within upstream.timeouts.attempt), unresponsive (the replica was ejected for not answering its probe).",
    labels: &["replica", "reason"],
};

pub(super) const AUTHZ_REVIEWS_TOTAL: Family = Family {
    name: "authz_reviews_total",
    help: "TokenReviews and SubjectAccessReviews, by kind and result (cached and limited made no review).",
    labels: &["kind", "result"],
};

pub(super) const SHADOW_REJECTIONS_TOTAL: Family = Family {
    name: "shadow_rejections_total",
    help: "Requests a shadow-mode rule would have refused, by rule, level and reason.",
    labels: &["rule", "level", "reason"],
};

pub(super) const RULES_RELOAD_TOTAL: Family = Family {
    name: "rules_reload_total",
    help: "Reloads of the rule files, by result (success, error); a failed one keeps the running rules.",
    labels: &["result"],
};

pub(super) const CACHE_RELISTS_TOTAL: Family = Family {
    name: "cache_relists_total",
    help: "Full lists of a cached resource after the first (410 or a lost watch).",
    labels: &["resource"],
};

pub(super) const CACHE_REQUESTS_TOTAL: Family = Family {
    name: "cache_requests_total",
    help: "Requests for cached resources, by result: hit (the cache answered), miss (not synced or not provably fresh), bypass (not cacheable).",
    labels: &["resource", "verb", "result"],
};

pub(super) const CACHE_SLOW_WATCHERS_TOTAL: Family = Family {
    name: "cache_slow_watchers_total",
    help: "Watchers disconnected because they fell further behind than their buffer.",
    labels: &["resource"],
};

pub(super) const CONNECTIONS_REFUSED_TOTAL: Family = Family {
    name: "connections_refused_total",
    help: "Client connections closed before their TLS handshake, by reason: max_connections, max_connections_per_source, max_connections_per_prefix, proxy_header_untrusted, proxy_header_missing, proxy_header_malformed, proxy_header_silent.",
    labels: &["reason"],
};

pub(super) const CONNECTIONS_CLOSED_TOTAL: Family = Family {
    name: "connections_closed_total",
    help: "Client connections Bulwark closed, by reason: unauthenticated_timeout (no request authenticated in time), unauthenticated_requests (too many refused credentials in a row), first_byte_timeout, proxy_header_timeout, handshake_timeout, header_read_timeout (no first request in time), evicted (the oldest unauthenticated connection, for a new one at maxConnections), client_not_reading (a response waited for its client past listen.limits.sendProgressTimeout).",
    labels: &["reason"],
};

pub(super) const ADMIN_CONNECTIONS_REFUSED_TOTAL: Family = Family {
    name: "admin_connections_refused_total",
    help: "Admin listener connections reset as soon as accepted, by reason: max_connections, max_connections_per_source, max_connections_per_prefix.",
    labels: &["reason"],
};

pub(super) const ADMIN_CONNECTIONS_CLOSED_TOTAL: Family = Family {
    name: "admin_connections_closed_total",
    help: "Admin listener connections Bulwark closed, by reason: first_byte_timeout, handshake_timeout, header_read_timeout, evicted (the oldest that sent no whole request, for a new one at the cap).",
    labels: &["reason"],
};

pub(super) const FLEET_RENEWALS_TOTAL: Family = Family {
    name: "fleet_renewals_total",
    help: "Rounds of the fleet's Lease renewal and read, by result (success, error); an error falls back to the static split.",
    labels: &["result"],
};

pub(super) const FLEET_SERVICE_WRITES_TOTAL: Family = Family {
    name: "fleet_service_writes_total",
    help: "Writes of the kubernetes Service's EndpointSlices and Endpoints (success), and rounds that could not publish them (error), with fleet.kubernetesService.",
    labels: &["result"],
};

pub(super) const FLEET_LEASES_REJECTED_TOTAL: Family = Family {
    name: "fleet_leases_rejected_total",
    help: "Unexpired Leases with the fleet's prefix that did not count, each round that read one, by reason: name (not the prefix plus its holder), duration (longer than fleet.leaseDuration), future (renewed ahead of this replica's clock), signature (fleet.keyFile set and the MAC missing or wrong).",
    labels: &["reason"],
};

pub(super) const LOG_LINES_DROPPED_TOTAL: Family = Family {
    name: "log_lines_dropped_total",
    help: "Lines of a file log never written, by log (audit) and reason: queue_full (the writer thread fell behind), write_failed (the file could not be written).",
    labels: &["log", "reason"],
};

pub(super) const FLOWS_EVICTED_TOTAL: Family = Family {
    name: "flows_evicted_total",
    help: "Flows whose admission state (token bucket, backoff) was forgotten, by reason: idle (no request, open watch or recent refusal for a while), capacity (the flow table was full: a new flow took the place of the least recently seen without an open watch).",
    labels: &["reason"],
};

pub(super) const UPSTREAM_HEALTHY: Family = Family {
    name: "upstream_healthy",
    help: "1 when the apiserver replica takes traffic, 0 while it is ejected.",
    labels: &["replica"],
};

pub(super) const UPSTREAM_IN_FLIGHT: Family = Family {
    name: "upstream_in_flight",
    help: "Requests sent to the replica that wait for their response head.",
    labels: &["replica"],
};

pub(super) const UPSTREAM_WATCHES: Family = Family {
    name: "upstream_watches",
    help: "Watch streams open to the replica.",
    labels: &["replica"],
};

pub(super) const LEVEL_WAITING_REQUESTS: Family = Family {
    name: "level_waiting_requests",
    help: "Requests waiting in the priority level's fair queues.",
    labels: &["level"],
};

pub(super) const LEVEL_EXECUTING_SEATS: Family = Family {
    name: "level_executing_seats",
    help: "Seats held by the priority level's executing requests.",
    labels: &["level"],
};

pub(super) const LEVEL_SEATS_LIMIT: Family = Family {
    name: "level_seats_limit",
    help: "Seats the priority level may use now, shrunk by the share of healthy replicas.",
    labels: &["level"],
};

pub(super) const LIST_BYTES_IN_FLIGHT: Family = Family {
    name: "list_bytes_in_flight",
    help: "LIST bytes admitted to the apiserver replica and not yet answered in full.",
    labels: &["replica"],
};

pub(super) const FLEET_SHARE: Family = Family {
    name: "fleet_share",
    help: "What this replica holds of the fleet's budget: kind list_bytes per apiserver replica (bytes), kind seats per level.",
    labels: &["kind", "name"],
};

pub(super) const LIST_BYTES_BUDGET: Family = Family {
    name: "list_bytes_budget",
    help: "The apiserver replica's in-flight LIST byte budget.",
    labels: &["replica"],
};

pub(super) const RULES_LOADED_INFO: Family = Family {
    name: "rules_loaded_info",
    help: "1 for the content hash of the rules in force.",
    labels: &["hash"],
};

pub(super) const CERTIFICATE_EXPIRY_TIMESTAMP_SECONDS: Family = Family {
    name: "certificate_expiry_timestamp_seconds",
    help: "When each certificate Bulwark loaded expires (notAfter, Unix seconds; the earliest of a bundle): serving, client_ca, front_proxy, own, upstream_ca.",
    labels: &["certificate"],
};

pub(super) const RESPONSES_CUT_TOTAL: Family = Family {
    name: "responses_cut_total",
    help: "Responses Bulwark ended early, by reason: client_not_reading (the client took nothing for listen.limits.sendProgressTimeout while the response held seats or LIST bytes, given back at once), upstream_unresponsive (its apiserver replica was ejected for not answering its probe and the body then made no progress for a probe interval: a read ends with a reset, a watch cleanly after its last whole event).",
    labels: &["reason"],
};

pub(super) const ACCESS_LOG_SUPPRESSED_TOTAL: Family = Family {
    name: "access_log_suppressed_total",
    help: "Access-log lines of refusals that identified no one left out past their bound (a line a second per client prefix, 100 in all), by reason: unauthenticated, review_limited.",
    labels: &["reason"],
};

pub(super) const CACHE_OBJECTS: Family = Family {
    name: "cache_objects",
    help: "Objects in the cache.",
    labels: &["resource"],
};

pub(super) const CACHE_BYTES: Family = Family {
    name: "cache_bytes",
    help: "Bytes of the cached objects' JSON.",
    labels: &["resource"],
};

pub(super) const CACHE_WATCHERS: Family = Family {
    name: "cache_watchers",
    help: "Watches served from the cache.",
    labels: &["resource"],
};

pub(super) const FLEET_MEMBERS: Family = Family {
    name: "fleet_members",
    help: "Live members of the fleet of Bulwark replicas this one sees (0: fleet off or static split).",
    labels: &[],
};

pub(super) const FLEET_SERVICE_ENDPOINTS: Family = Family {
    name: "fleet_service_endpoints",
    help: "Bulwark replicas behind the kubernetes Service as last published (0: the apiservers serve in-cluster clients directly), with fleet.kubernetesService.",
    labels: &[],
};

pub(super) const FLEET_STATIC: Family = Family {
    name: "fleet_static",
    help: "1 while this replica holds the static split because it cannot renew or read the fleet's Leases.",
    labels: &[],
};

pub(super) const FLEET_UNCOUNTED_MEMBERS: Family = Family {
    name: "fleet_uncounted_members",
    help: "Live fleet members beyond upstream.bulwarkReplicas (the newest Leases), whose demand does not count: a rollout, or Leases someone else wrote.",
    labels: &[],
};

pub(super) const FLOWS: Family = Family {
    name: "flows",
    help: "Flows whose admission state (token bucket, backoff, open watches) is remembered.",
    labels: &[],
};

pub(super) const FLEET_RATE_FLOWS: Family = Family {
    name: "fleet_rate_flows",
    help: "Flows whose rate this replica shares with other members of its fleet (see /debug/fleet).",
    labels: &[],
};

pub(super) const CONNECTIONS_OPEN: Family = Family {
    name: "connections_open",
    help: "Client connections open, TLS handshakes included.",
    labels: &[],
};

pub(super) const ADMIN_CONNECTIONS_OPEN: Family = Family {
    name: "admin_connections_open",
    help: "Admin listener connections open, TLS handshakes included.",
    labels: &[],
};

pub(super) const RULES_STALE: Family = Family {
    name: "rules_stale",
    help: "1 while the last reload of the rule files failed (the files on disk are not the rules in force), 0 after a successful one.",
    labels: &[],
};

pub(super) const CONNECTIONS_MAX: Family = Family {
    name: "connections_max",
    help: "The cap on open client connections in force (listen.limits.maxConnections, lowered to the open-file limit less the reserve).",
    labels: &[],
};

pub(super) const QUEUE_WAIT_SECONDS: Family = Family {
    name: "queue_wait_seconds",
    help: "Time admitted requests waited in their priority level's fair queue.",
    labels: &["level"],
};

pub(super) const CACHE_LAG_SECONDS: Family = Family {
    name: "cache_lag_seconds",
    help: "0 while the cache's upstream watch runs, else the seconds since it stopped.",
    labels: &["resource"],
};

pub(super) const REQUEST_DURATION_SECONDS: Family = Family {
    name: "request_duration_seconds",
    help: "Time from request head to response head, by verb and who served it.",
    labels: &["verb", "served_by"],
};

//! What a request costs: seats for every request, and for a LIST the bytes the apiserver
//! must hold while serving it (DESIGN.md step 6, "Cost").
//!
//! A LIST read from etcd (no resourceVersion, or an exact read with `limit`) reads its whole
//! unfiltered scope whatever its selectors, so it costs the scope's bytes; a LIST served from
//! the apiserver's watch cache (`resourceVersion=0`, or a not-older-than read) costs its
//! expected response. Both are learned from the JSON sizes of the responses Bulwark sees
//! (measured as [`super::measure`] allows): a larger response raises an estimate at once,
//! so it follows a growing collection within a request or two; a smaller one only lowers
//! it by a quarter of the difference, so that one odd observation cannot open the byte
//! budget that guards the apiserver's memory.

use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::sync::Mutex;

use lru::LruCache;

use crate::classify::RequestInfo;

/// A LIST's scope: a resource in one namespace, or across the cluster.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Scope {
    group: String,
    resource: String,
    namespace: Option<String>,
}

/// A LIST's shape within its scope: the selectors that filter its response.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Shape {
    scope: Scope,
    label_selector: Option<String>,
    field_selector: Option<String>,
}

/// What is known of one resource across its scopes.
#[derive(Debug, Default, Clone, Copy)]
struct ResourceStats {
    /// The largest namespace seen: the guess for a namespace not seen yet.
    largest_namespace: Option<u64>,
    /// The cluster-wide size, if a cluster-wide LIST was seen.
    cluster: Option<u64>,
}

struct State {
    scopes: LruCache<Scope, u64>,
    shapes: LruCache<Shape, u64>,
    resources: HashMap<(String, String), ResourceStats>,
}

/// Learned LIST sizes.
pub(crate) struct CostModel {
    state: Mutex<State>,
    /// Bytes that weigh as one seat.
    seat_unit: u64,
    /// The guess for a scope never seen.
    unknown: u64,
}

/// Whether the apiserver answers this LIST from etcd (reading the whole scope) rather than
/// from its watch cache.
fn from_etcd(info: &RequestInfo) -> bool {
    let query = &info.query;
    match query.resource_version.as_deref() {
        None | Some("") => true,
        Some("0") => false,
        // A version with `limit` (or a continue token) is an exact, paged read from etcd;
        // without, the watch cache answers once it has reached that version.
        Some(_) => query.limit.is_some() || query.continue_token.is_some(),
    }
}

fn scope(info: &RequestInfo) -> Scope {
    Scope {
        group: info.api_group.as_str().to_owned(),
        resource: info.resource.as_str().to_owned(),
        namespace: info.namespace.as_deref().map(str::to_owned),
    }
}

fn shape(info: &RequestInfo) -> Shape {
    Shape {
        scope: scope(info),
        label_selector: info.query.label_selector.clone().filter(|s| !s.is_empty()),
        field_selector: info.query.field_selector.clone().filter(|s| !s.is_empty()),
    }
}

impl CostModel {
    /// A model where `seat_unit` bytes weigh one seat, a scope never seen is guessed at
    /// `unknown` bytes, and at most `capacity` scopes and shapes are remembered.
    pub(crate) fn new(seat_unit: u64, unknown: u64, capacity: usize) -> Self {
        let capacity = NonZeroUsize::new(capacity).unwrap_or(NonZeroUsize::MIN);
        Self {
            state: Mutex::new(State {
                scopes: LruCache::new(capacity),
                shapes: LruCache::new(capacity),
                resources: HashMap::new(),
            }),
            seat_unit: seat_unit.max(1),
            unknown,
        }
    }

    /// The bytes a request makes the apiserver hold: zero for anything but a LIST.
    pub(crate) fn bytes(&self, info: &RequestInfo) -> u64 {
        if !info.resource_request || !info.is_list() {
            return 0;
        }
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let scope = scope(info);
        if !from_etcd(info) {
            let shape = shape(info);
            if let Some(&bytes) = state.shapes.get(&shape) {
                return bytes;
            }
        }
        // The watch cache's answer to an unfiltered LIST is the whole scope, and the scope
        // bounds any filtered one.
        if let Some(&bytes) = state.scopes.get(&scope) {
            return bytes;
        }
        let stats = state
            .resources
            .get(&(scope.group.clone(), scope.resource.clone()))
            .copied()
            .unwrap_or_default();
        match scope.namespace {
            Some(_) => stats
                .largest_namespace
                .unwrap_or_else(|| stats.cluster.map_or(self.unknown, |c| c.min(self.unknown))),
            None => stats.cluster.unwrap_or(self.unknown),
        }
    }

    /// The seats a request takes: 1, or for a LIST its bytes in seat units, at most
    /// `level_seats`.
    pub(crate) fn seats(&self, bytes: u64, level_seats: u32) -> u32 {
        let units = bytes.div_ceil(self.seat_unit).max(1);
        u32::try_from(units)
            .unwrap_or(u32::MAX)
            .min(level_seats.max(1))
    }

    /// Learns from a LIST response of `bytes` (with `objects` items, if known).
    pub(crate) fn observe(&self, info: &RequestInfo, bytes: u64, _objects: Option<u64>) {
        if !info.resource_request || !info.is_list() {
            return;
        }
        let query = &info.query;
        let shape = shape(info);
        let whole_scope = shape.label_selector.is_none()
            && shape.field_selector.is_none()
            && query.limit.is_none_or(|l| l == 0)
            && query.continue_token.is_none();
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let scope = shape.scope.clone();
        let known = state.scopes.get(&scope).copied();
        // An unfiltered, unpaged response is the scope; a filtered or paged one is at
        // least a part of it.
        let size = match known {
            None => bytes,
            Some(known) if whole_scope => settle(known, bytes),
            Some(known) => known.max(bytes),
        };
        if shape.label_selector.is_some() || shape.field_selector.is_some() {
            let size = match state.shapes.get(&shape) {
                Some(&known) => settle(known, bytes),
                None => bytes,
            };
            state.shapes.put(shape, size);
        }
        state.set_scope(scope, size);
    }

    /// Learns the whole size of the scope a LIST reads from a count that does not need
    /// a LIST: the watch-fed cache's bytes for that resource in that namespace (or the
    /// cluster). It follows every create and delete, not only the LISTs seen.
    pub(crate) fn observe_scope(&self, info: &RequestInfo, bytes: u64) {
        if !info.resource_request || !info.is_list() {
            return;
        }
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.set_scope(scope(info), bytes);
    }
}

/// An estimate after an observation: up at once, down by a quarter of the difference.
fn settle(known: u64, observed: u64) -> u64 {
    if observed >= known {
        observed
    } else {
        known - (known - observed) / 4
    }
}

impl State {
    fn set_scope(&mut self, scope: Scope, size: u64) {
        self.scopes.put(scope.clone(), size);
        let stats = self
            .resources
            .entry((scope.group, scope.resource))
            .or_default();
        match scope.namespace {
            Some(_) => {
                stats.largest_namespace =
                    Some(stats.largest_namespace.map_or(size, |l| l.max(size)))
            }
            None => stats.cluster = Some(size),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::classify::classify;

    fn info(uri: &str) -> RequestInfo {
        classify(&http::Method::GET, &uri.parse().unwrap()).unwrap()
    }

    #[test]
    fn gets_and_writes_cost_one_seat_and_no_bytes() {
        let model = CostModel::new(1000, 50_000, 100);
        let get = info("/api/v1/namespaces/a/secrets/s");
        assert_eq!(model.bytes(&get), 0);
        assert_eq!(model.seats(0, 10), 1);
    }

    #[test]
    fn an_etcd_list_costs_its_whole_scope_whatever_its_selector() {
        let model = CostModel::new(1000, 50_000, 100);
        model.observe(&info("/api/v1/namespaces/a/secrets"), 8_000, Some(8));
        let filtered = info("/api/v1/namespaces/a/secrets?labelSelector=app%3Dx");
        assert_eq!(model.bytes(&filtered), 8_000);
        assert_eq!(model.seats(model.bytes(&filtered), 10), 8);
        assert_eq!(
            model.seats(model.bytes(&filtered), 4),
            4,
            "capped at the level"
        );
    }

    #[test]
    fn a_small_observation_decays_an_estimate_instead_of_replacing_it() {
        let model = CostModel::new(1000, 50_000, 100);
        let all = info("/api/v1/secrets");
        model.observe(&all, 400_000_000, None);
        // A 20x smaller answer (a collection that shrank, or one this model should not
        // have been shown) lowers the estimate by a quarter of the gap, not to itself.
        model.observe(&all, 20_000_000, None);
        assert_eq!(model.bytes(&all), 305_000_000);
        // The collection really shrank: the estimate follows within a few LISTs.
        for _ in 0..15 {
            model.observe(&all, 20_000_000, None);
        }
        assert!(model.bytes(&all) < 25_000_000, "{}", model.bytes(&all));
        // It grows again: up at once.
        model.observe(&all, 400_000_000, None);
        assert_eq!(model.bytes(&all), 400_000_000);
    }

    #[test]
    fn a_cached_list_costs_its_expected_response() {
        let model = CostModel::new(1000, 50_000, 100);
        model.observe(&info("/api/v1/pods"), 900_000, None);
        let by_node = "/api/v1/pods?fieldSelector=spec.nodeName%3Dn1";
        model.observe(&info(by_node), 3_000, None);
        assert_eq!(
            model.bytes(&info(&format!("{by_node}&resourceVersion=0"))),
            3_000
        );
        // The same selector read from etcd still reads every pod.
        assert_eq!(model.bytes(&info(by_node)), 900_000);
    }

    #[test]
    fn the_caches_counts_set_a_scope_before_any_list_and_follow_its_growth() {
        let model = CostModel::new(1000, 50_000, 100);
        let all = info("/api/v1/secrets");
        model.observe_scope(&all, 2_000_000);
        assert_eq!(model.bytes(&all), 2_000_000);
        // Ten times as many Secrets a moment later: the next LIST costs the new size.
        model.observe_scope(&all, 20_000_000);
        assert_eq!(model.bytes(&all), 20_000_000);
        assert_eq!(
            model.bytes(&info("/api/v1/secrets?labelSelector=a%3Db")),
            20_000_000,
            "an etcd LIST reads the whole scope, selector or not"
        );
        let ns = info("/api/v1/namespaces/a/secrets");
        model.observe_scope(&ns, 7_000);
        assert_eq!(model.bytes(&ns), 7_000);
        // Not a LIST: nothing learned.
        model.observe_scope(&info("/api/v1/namespaces/b/secrets/x"), 1);
        assert_eq!(model.bytes(&info("/api/v1/namespaces/b/secrets")), 7_000);
    }

    #[test]
    fn an_unseen_namespace_is_guessed_from_its_largest_sibling() {
        let model = CostModel::new(1000, 50_000, 100);
        assert_eq!(model.bytes(&info("/api/v1/namespaces/x/secrets")), 50_000);
        model.observe(&info("/api/v1/namespaces/a/secrets"), 7_000, None);
        model.observe(&info("/api/v1/namespaces/b/secrets"), 2_000, None);
        assert_eq!(model.bytes(&info("/api/v1/namespaces/x/secrets")), 7_000);
    }
}

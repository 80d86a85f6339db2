//! What this replica tells the fleet ([`crate::fleet`]) and how it hears back: the demand
//! of its apiserver replicas' LIST bytes and of its admission's seats and flows, its static
//! shares, and a new dispatch whenever the fleet's split changes.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::Admission;
use crate::fleet::share::{Bytes, Demand, RateAsked};
use crate::fleet::{Local, Statics};
use crate::upstream::Upstream;

/// The fleet's [`Local`] over the real upstream pool and admission.
pub struct ProxyLocal {
    /// The apiserver replicas, for their LIST bytes in flight.
    pub upstream: Upstream,
    /// Admission, for what waits and the levels.
    pub admission: Arc<Admission>,
}

impl Local for ProxyLocal {
    fn demand(&self) -> Demand {
        let snapshot = self.upstream.snapshot();
        let waiting = self.admission.fleet_demand();
        let spread = waiting.list_bytes / (snapshot.len().max(1) as u64);
        let mut demand = Demand::default();
        for replica in snapshot {
            demand.bytes.insert(
                replica.name,
                Bytes {
                    wanted: replica.in_flight_bytes + spread,
                    in_flight: replica.in_flight_bytes,
                },
            );
        }
        demand.seats = waiting.seats;
        demand
    }

    fn statics(&self) -> Statics {
        let budget = self.upstream.byte_budget();
        Statics {
            list_bytes: self
                .upstream
                .snapshot()
                .into_iter()
                .map(|r| (r.name, budget))
                .collect(),
            seats: self.admission.configured_seats(),
            // The fleet adds its flows' rules from the rate demand.
            rates: BTreeMap::new(),
        }
    }

    fn rate_demand(&self) -> BTreeMap<String, RateAsked> {
        self.admission.rate_demand()
    }

    fn shares_changed(&self) {
        self.admission.redispatch();
    }
}

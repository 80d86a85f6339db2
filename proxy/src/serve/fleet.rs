//! Admission and, with `fleet`, the fleet of replicas that splits its budgets.

use std::sync::Arc;

use tokio::task::JoinHandle;

use super::StartError;
use crate::admit::{Admission, ProxyLocal};
use crate::config::Config;
use crate::fleet::{self, Fleet, FleetShares};
use crate::metrics::Metrics;
use crate::own;
use crate::rules::Rules;
use crate::upstream::Upstream;

/// Admission over the rules' levels, its share of the budgets set by the fleet when there
/// is one, and the tasks that keep both current.
pub(super) struct Admitting {
    pub(super) admission: Arc<Admission>,
    pub(super) fleet: Option<Arc<Fleet>>,
    /// The fleet's Lease tasks, and the one that hands reloaded levels to admission.
    pub(super) tasks: Vec<JoinHandle<()>>,
}

/// Builds admission (in the fleet where `fleet` is configured) and joins the fleet.
pub(super) fn start(
    config: &Config,
    rules: &Arc<Rules>,
    upstream: &Upstream,
    own: &own::Client,
    metrics: &Metrics,
) -> Result<Admitting, StartError> {
    let fleet_shares = config.fleet.as_ref().map(|_| FleetShares::new());
    let admission = match &fleet_shares {
        Some(shares) => Admission::in_fleet(
            rules.current().levels(),
            upstream.clone(),
            shares.clone(),
            metrics.clone(),
        ),
        None => Admission::new(rules.current().levels(), upstream.clone(), metrics.clone()),
    };
    let (fleet, mut tasks) = match config.fleet.as_ref().zip(fleet_shares) {
        Some((cfg, shares)) => {
            let local = ProxyLocal {
                upstream: upstream.clone(),
                admission: admission.clone(),
            };
            let (fleet, tasks) = fleet::start(
                cfg,
                config,
                own.clone(),
                Arc::new(local),
                shares,
                metrics.clone(),
            )
            .map_err(StartError::FleetKey)?;
            (Some(fleet), tasks)
        }
        None => (None, Vec::new()),
    };
    tasks.push(levels_follow(rules, &admission));
    Ok(Admitting {
        admission,
        fleet,
        tasks,
    })
}

/// Hands every reloaded rule set's levels to admission.
fn levels_follow(rules: &Rules, admission: &Arc<Admission>) -> JoinHandle<()> {
    let mut reloaded = rules.subscribe();
    let admission = admission.clone();
    tokio::spawn(async move {
        while reloaded.changed().await.is_ok() {
            let set = reloaded.borrow_and_update().clone();
            admission.update_levels(set.levels());
        }
    })
}

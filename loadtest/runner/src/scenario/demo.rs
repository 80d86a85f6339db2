//! `demo`: the first thing a newcomer runs. A scaled-down `list-storm` and `skew` on one
//! fleet at once: storming identities LIST large Secrets, innocent clients and heartbeats
//! carry on, long-lived clients hold their connections, and one replica restarts midway.
//! Both runs together take under two minutes.

use std::time::Duration;

use bulwark_sim::pki::Pki;

use super::list_storm::{self, Sizes};
use super::{Driven, Env, Options, Scenario, Setup, skew};

/// The scenario.
pub struct Demo;

/// Load per run unless `--duration` says otherwise.
const DEFAULT_DURATION: Duration = Duration::from_secs(40);

/// The demo's counts: a tenth of list-storm's objects, a fifth of its clients, 40 skew
/// clients, all times `--scale`.
fn sizes(opts: &Options) -> (Sizes, usize) {
    let objects = Options {
        scale: opts.scale * 0.1,
        ..opts.clone()
    };
    let clients = Options {
        scale: opts.scale * 0.2,
        ..opts.clone()
    };
    let s = Sizes {
        secrets: objects.scaled(5_000, 10),
        configmaps: objects.scaled(500, 10),
        storm: clients.scaled(50, 1),
        innocent: clients.scaled(20, 1),
        heartbeat: clients.scaled(20, 1),
    };
    (s, clients.scaled(200, 2))
}

impl Scenario for Demo {
    fn name(&self) -> &'static str {
        "demo"
    }

    fn setup(&self, opts: &Options) -> Setup {
        Setup {
            seed: sizes(opts).0.seed(),
            lists_to_oom: Some(3),
            ..Setup::default()
        }
    }

    async fn drive(&self, env: &Env, pki: &Pki, opts: &Options) -> anyhow::Result<Driven> {
        let duration = opts.duration_or(DEFAULT_DURATION);
        let (s, skew_clients) = sizes(opts);
        let mut loads = list_storm::loads(pki, &s);
        loads.push(skew::load(pki, skew_clients, s.secrets));
        let restart = tokio::spawn(skew::restart_replica(
            env.fleet.clone(),
            duration / 3,
            Duration::from_secs(2),
        ));
        let driven = env.drive_loads(loads, duration).await;
        restart.abort();
        driven
    }
}

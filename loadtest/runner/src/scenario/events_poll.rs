//! `events-poll`: a monitoring agent per node LISTs Events every few seconds, the polling
//! pattern that makes every node a LIST client of the apiserver.

use std::sync::Arc;
use std::time::Duration;

use bulwark_sim::pki::Pki;

use super::{Driven, Env, Load, Options, Persona, Req, Scenario, Setup};

/// The scenario.
pub struct EventsPoll;

/// How often each agent polls.
const POLL_EVERY: Duration = Duration::from_secs(5);

impl Scenario for EventsPoll {
    fn name(&self) -> &'static str {
        "events-poll"
    }

    fn setup(&self, opts: &Options) -> Setup {
        Setup {
            seed: vec![format!("events={}x1KiB", opts.scaled(2_000, 10))],
            lists_to_oom: Some(20),
            ..Setup::default()
        }
    }

    async fn drive(&self, env: &Env, pki: &Pki, opts: &Options) -> anyhow::Result<Driven> {
        let duration = opts.duration_or(Duration::from_secs(60));
        let agents = Load {
            class: "agents".into(),
            identities: Persona::ServiceAccountsIn {
                namespace: "monitoring",
                name_prefix: "agent",
            }
            .mint(pki, opts.scaled(2_000, 2)),
            think: POLL_EVERY,
            next: Arc::new(|_, _| Req::get("/api/v1/events".into(), Duration::from_secs(30))),
        };
        env.drive_loads(vec![agents], duration).await
    }
}

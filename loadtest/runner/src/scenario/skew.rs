//! `skew`: clients that each hold one long-lived HTTP/2 connection, with one replica
//! restarted mid-run. Through an L4 balancer the restarted replica's clients reconnect to
//! the others and stay there (the real incident); a proxy that balances per request does
//! not care.

use std::sync::Arc;
use std::time::Duration;

use bulwark_sim::Fleet;
use bulwark_sim::pki::Pki;

use super::{Driven, Env, Load, Options, Persona, Req, Scenario, Setup};

/// The scenario.
pub struct Skew;

/// The class name.
pub const CLASS: &str = "clients";

/// Seeds for the skew clients' reads.
pub fn seed(opts: &Options) -> Vec<String> {
    vec![
        format!("secrets={}x2KiB", opts.scaled(1_000, 10)),
        format!("configmaps={}x1KiB", opts.scaled(200, 10)),
    ]
}

/// `n` clients (apps: the default ServiceAccount of one namespace each), each on its own
/// connection, alternating a GET of one Secret with a LIST of
/// one namespace's ConfigMaps.
pub fn load(pki: &Pki, n: usize, secrets: usize) -> Load {
    Load {
        class: CLASS.into(),
        identities: Persona::ServiceAccounts {
            namespace_prefix: "app",
            name: "default",
        }
        .mint(pki, n),
        think: Duration::from_millis(100),
        next: Arc::new(move |i, k| {
            let pick = (i as u64 * 7919 + k * 104_729) as usize % secrets.max(1);
            let path = if k % 3 == 2 {
                format!("/api/v1/namespaces/ns-{}/configmaps", pick % 10)
            } else {
                format!("/api/v1/namespaces/ns-{}/secrets/secret-{pick}", pick % 10)
            };
            Req::get(path, Duration::from_secs(10))
        }),
    }
}

/// After `at`, stops replica 0 like a crash, and starts it again `down` later.
pub async fn restart_replica(fleet: Arc<Fleet>, at: Duration, down: Duration) {
    tokio::time::sleep(at).await;
    eprintln!("  restarting replica 0");
    fleet.replica(0).stop().await;
    tokio::time::sleep(down).await;
    fleet.replica(0).start().await;
    eprintln!("  replica 0 is back");
}

impl Scenario for Skew {
    fn name(&self) -> &'static str {
        "skew"
    }

    fn setup(&self, opts: &Options) -> Setup {
        Setup {
            seed: seed(opts),
            ..Setup::default()
        }
    }

    async fn drive(&self, env: &Env, pki: &Pki, opts: &Options) -> anyhow::Result<Driven> {
        let duration = opts.duration_or(Duration::from_secs(60));
        let clients = opts.scaled(200, 3);
        let secrets = opts.scaled(1_000, 10);
        let restart = tokio::spawn(restart_replica(
            env.fleet.clone(),
            duration / 3,
            Duration::from_secs(2),
        ));
        let driven = env
            .drive_loads(vec![load(pki, clients, secrets)], duration)
            .await;
        restart.abort();
        driven
    }
}

//! `list-storm`: many identities LIST every large Secret with no resourceVersion (each
//! such LIST costs the apiserver 5x the whole collection), while innocent clients read
//! single objects and small lists and nodes renew their Leases.

use std::sync::Arc;
use std::time::Duration;

use bulwark_sim::pki::Pki;
use bytes::Bytes;
use http::Method;

use super::{Driven, Env, Load, Options, Persona, Req, Scenario, Setup, node_name};
use crate::client::Read;

/// The scenario.
pub struct ListStorm;

/// Object and client counts at a scale.
pub struct Sizes {
    /// Secrets of 10 KiB, spread over `ns-0`…`ns-9`.
    pub secrets: usize,
    /// Small configmaps, spread the same way.
    pub configmaps: usize,
    /// Identities in class `storm`.
    pub storm: usize,
    /// Identities in class `innocent`.
    pub innocent: usize,
    /// Identities in class `heartbeat`, one node Lease each.
    pub heartbeat: usize,
}

impl Sizes {
    /// The issue's counts, scaled.
    pub fn at(opts: &Options) -> Sizes {
        Sizes {
            secrets: opts.scaled(5_000, 10),
            configmaps: opts.scaled(500, 10),
            storm: opts.scaled(50, 1),
            innocent: opts.scaled(20, 1),
            heartbeat: opts.scaled(20, 1),
        }
    }

    /// The seeds of the fleet.
    pub fn seed(&self) -> Vec<String> {
        vec![
            format!("secrets={}x10KiB", self.secrets),
            format!("configmaps={}x1KiB", self.configmaps),
            format!("leases={}x300B@kube-node-lease", self.heartbeat),
        ]
    }
}

/// Storm clients: one tenant operator per namespace, each listing every Secret of the
/// cluster (a cluster-wide informer without a resourceVersion).
pub const STORM: Persona<'static> = Persona::ServiceAccounts {
    namespace_prefix: "tenant",
    name: "secret-reader",
};
/// Innocent clients: people reading single objects and small lists.
pub const INNOCENT: Persona<'static> = Persona::Users {
    prefix: "user",
    group: "developers",
};

/// The loads of the three classes.
pub fn loads(pki: &Pki, sizes: &Sizes) -> Vec<Load> {
    let secrets = sizes.secrets;
    let storm = Load {
        class: "storm".into(),
        identities: STORM.mint(pki, sizes.storm),
        think: Duration::from_millis(10),
        next: Arc::new(|_, _| Req::get("/api/v1/secrets".into(), Duration::from_secs(60))),
    };
    let innocent = Load {
        class: "innocent".into(),
        identities: INNOCENT.mint(pki, sizes.innocent),
        think: Duration::from_millis(100),
        next: Arc::new(move |i, n| {
            let pick = (i as u64 * 7919 + n * 104_729) as usize % secrets;
            let path = if n % 2 == 0 {
                format!("/api/v1/namespaces/ns-{}/secrets/secret-{pick}", pick % 10)
            } else {
                format!("/api/v1/namespaces/ns-{}/configmaps", pick % 10)
            };
            Req::get(path, Duration::from_secs(10))
        }),
    };
    let heartbeat = Load {
        class: "heartbeat".into(),
        identities: Persona::Nodes.mint(pki, sizes.heartbeat),
        think: Duration::from_secs(1),
        next: Arc::new(|i, n| Req {
            method: Method::PATCH,
            path: format!(
                "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/lease-{i}"
            ),
            body: Some((
                Bytes::from(format!(
                    r#"{{"spec":{{"leaseDurationSeconds":40,"holderIdentity":"{}","leaseTransitions":{n}}}}}"#,
                    node_name(i)
                )),
                "application/merge-patch+json",
            )),
            read: Read::Count,
            timeout: Duration::from_secs(10),
        }),
    };
    vec![storm, innocent, heartbeat]
}

impl Scenario for ListStorm {
    fn name(&self) -> &'static str {
        "list-storm"
    }

    fn setup(&self, opts: &Options) -> Setup {
        Setup {
            seed: Sizes::at(opts).seed(),
            lists_to_oom: Some(3),
            ..Setup::default()
        }
    }

    async fn drive(&self, env: &Env, pki: &Pki, opts: &Options) -> anyhow::Result<Driven> {
        let duration = opts.duration_or(Duration::from_secs(60));
        env.drive_loads(loads(pki, &Sizes::at(opts)), duration)
            .await
    }
}

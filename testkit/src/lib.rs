//! One harness for Bulwark's tests and the sandbox: Bulwark's configuration written in one
//! place ([`config`]), a simulated apiserver fleet with a real Bulwark in front started as
//! production starts it ([`Cluster`]), certificates minted per cluster, and clients that
//! speak TLS and HTTP/2 to it ([`Client`]).
//!
//! ```no_run
//! # async fn scenario() {
//! use bulwark_testkit::{Cluster, Setup};
//! let cluster = Cluster::start(Setup::default()).await;
//! let mut alice = cluster.client("alice", &["dev"]).await;
//! let answer = alice.get("/api/v1/namespaces/team/secrets").await;
//! assert_eq!(answer.status, 200);
//! assert_eq!(answer.json()["kind"], "SecretList");
//! # }
//! ```

pub mod client;
pub mod cluster;
pub mod config;
pub mod layers;
pub mod ports;
pub mod tools;

pub use client::{Answer, Client, admin_get, get, post_json, tcp_from, tls_config, with_token};
pub use cluster::{
    ALICE_LISTS_RULES, BAD_TOKEN, BulwarkProcess, Cluster, GOOD_TOKEN, Setup, UNLIMITED_RULES,
    fleet_config, grant, kube_client, policy, start_fleet,
};
pub use config::{
    BulwarkConfig, Credentials, FRONT_PROXY_CN, Names, OWN_GROUP, OWN_USER, serving_names,
};
pub use ports::{free_addr, free_port};

/// The sum of the samples of metric `family` in a Prometheus text exposition.
pub fn metric_sum(exposition: &str, family: &str) -> f64 {
    exposition
        .lines()
        .filter(|l| {
            l.strip_prefix(family)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A file or folder of the repository, e.g. `rules/examples` or `deploy/base/bulwark.yaml`.
pub fn repo_path(path: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(path)
}

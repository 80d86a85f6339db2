//! The real control plane the load tester runs Bulwark in front of, as processes: etcd,
//! kube-apiservers in memory cgroups, kube-controller-manager, kube-scheduler and KWOK
//! built from Go modules (`build.sh` beside this crate), and Bulwark itself (the runner's
//! binary re-executed, [`proxy_process`]), with their PKI, the kubeconfigs of the
//! identities they hand out ([`identities`]) and an L4 balancer ([`balancer`]). The
//! scenarios (`bulwark-loadtest`) run on it; it knows nothing of them.

mod controlplane;

pub mod balancer;
pub mod child;
pub mod identities;
pub mod proxy_process;
pub mod sample;

pub use controlplane::*;

use std::net::SocketAddr;

use bulwark_report as report;

/// Where clients send their requests: the address and the CA of its serving certificate.
#[derive(Clone, Debug)]
pub struct Target {
    /// Address of the L4 balancer, Bulwark or another proxy.
    pub addr: SocketAddr,
    /// PEM of the CA that signed the target's serving certificate.
    pub ca_pem: String,
}

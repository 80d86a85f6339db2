//! End-to-end tests: real TLS and HTTP/2 clients → Bulwark → the simulated apiserver fleet.

mod bad_input;
mod balance;
mod cache;
mod dos;
mod fairness;
mod fleet;
mod flows;
mod front_door;
mod identity;
mod kube_client;
mod oncall;
mod operator;
mod slow_clients;
mod streaming;
mod suggest;

/// The setup the fairness and cache tests start from: Bulwark serving on the test's runtime.
fn setup() -> bulwark_testkit::Setup {
    bulwark_testkit::Setup::default()
}

mod on_workers;

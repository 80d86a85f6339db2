//! bulwark-loadtest as a library: the scenarios, the sandbox and the real control plane,
//! so that the binary and the integration tests in `tests/` share one copy.

pub mod balancer;
pub mod calibrate;
pub mod child;
pub mod client;
pub mod controlplane;
pub mod floor;
pub mod identities;
pub mod proxy_process;
pub mod reference;
pub mod report;
pub mod sample;
pub mod sandbox;
pub mod scenario;

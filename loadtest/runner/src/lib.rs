//! bulwark-loadtest as a library: the scenarios and the sandbox, on the real control plane
//! (`bulwark-controlplane`) and the one report pipeline (`bulwark-report`), so that the
//! binary and the integration tests in `tests/` share one copy. The two crates it stands on
//! are re-exported under the names the scenarios use.

pub mod calibrate;
pub mod client;
pub mod floor;
pub mod reference;
pub mod sandbox;
pub mod scenario;

pub use bulwark_controlplane as controlplane;
pub use bulwark_controlplane::{balancer, child, identities, proxy_process, sample};
pub use bulwark_report as report;

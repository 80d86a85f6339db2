//! bulwark-loadtest: scenarios, demo and sandbox.
fn main() {}

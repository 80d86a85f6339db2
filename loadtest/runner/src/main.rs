//! bulwark-loadtest: scenarios, demo and sandbox.

mod client;
mod report;

fn main() {}

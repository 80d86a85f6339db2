//! The `bulwark-sim` binary.
fn main() {}

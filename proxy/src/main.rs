//! The `bulwark` binary.
fn main() {}

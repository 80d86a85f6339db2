//! Rules: which rule, priority level and flow each request belongs to (DESIGN.md step 5).
//!
//! Only the plain data types of the interface live here for now; the rule files, matching
//! and hot reload are added beside them.

pub mod types;

pub use types::*;

//! Kubernetes API conventions that Bulwark and its simulated apiserver both speak, kept in
//! one place so that the two cannot drift apart:
//!
//! - [`selector`]: `labelSelector` and `fieldSelector`, parsed and matched as the
//!   apiserver does;
//! - [`continue_token`]: the continue tokens of paginated lists, and the storage-key order
//!   that pages walk;
//! - [`kinds`]: the built-in resources both know by name, with their kind, scope, verbs
//!   and the zero value a BOOKMARK carries;
//! - [`client_cert`]: client certificates as the apiserver reads identities from them
//!   (CN is the user, each O a group);
//! - [`params`]: query parameter values as the apiserver's parameter codec reads them;
//! - [`watch`]: the event types of a watch stream;
//! - [`status`]: the `Status` body of every error, as the apiserver encodes it.

pub mod client_cert;
pub mod continue_token;
pub mod kinds;
pub mod params;
pub mod selector;
pub mod status;
pub mod watch;

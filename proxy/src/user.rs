//! An authenticated user, as the apiserver's `user.Info`: what [`crate::identity`] makes of
//! a certificate or a TokenReview, and what rules, admission, the cache's access reviews and
//! the logs read.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The group every authenticated user belongs to.
pub const AUTHENTICATED: &str = "system:authenticated";

/// An authenticated user, as the apiserver's `user.Info`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct User {
    /// The user name (`CN` of a certificate, or from the TokenReview).
    pub username: String,
    /// The user's UID, when the authenticator gives one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
    /// Groups, always including `system:authenticated`.
    #[serde(default)]
    pub groups: Vec<String>,
    /// Extra attributes (e.g. a ServiceAccount token's pod name).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub extra: BTreeMap<String, Vec<String>>,
}

impl User {
    /// Adds `system:authenticated` when it is missing.
    pub fn with_authenticated_group(mut self) -> Self {
        if !self.groups.iter().any(|g| g == AUTHENTICATED) {
            self.groups.push(AUTHENTICATED.to_string());
        }
        self
    }
}

//! Rewrites a request's headers so the apiserver sees the client's identity and nothing a
//! client could use to pass as someone else (DESIGN.md step 3).
//!
//! Always: the configured request-header names and the default ones (`X-Remote-User`,
//! `-Group`, `-Uid`, `-Extra-*`) are stripped (a client must never set them), and so are
//! hop-by-hop headers. `Authorization` is stripped except in
//! passthrough mode. A client's own `Impersonate-*` headers travel on in front-proxy and
//! passthrough modes (the apiserver authorizes them against the real user) and are refused
//! in impersonate mode, where they would be read as Bulwark's own.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use http::HeaderMap;
use http::header::{AUTHORIZATION, CONNECTION, HeaderName, HeaderValue, UPGRADE};
use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, utf8_percent_encode};

use super::{Credential, Identity, User};
use crate::config::{self, IdentityMode};
use crate::upstream;

/// Bytes that stay as they are in an extra key; everything else is percent-encoded, as the
/// apiserver's request-header authenticator expects.
const EXTRA_KEY: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'.').remove(b'_');

/// Headers that belong to one connection and are never forwarded.
const HOP_BY_HOP: [&str; 7] = [
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
];

/// Why a request cannot be forwarded as it is.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ForwardError {
    /// In impersonate mode a client's `Impersonate-*` headers would act as Bulwark's own.
    #[error("Impersonate-* headers are not accepted by this proxy (identity mode impersonate)")]
    ClientImpersonation,
    /// The identity cannot be written into a header.
    #[error("the identity cannot be sent upstream: {0}")]
    Unrepresentable(String),
}

/// The identity-forwarding policy built from config.
pub struct Forwarding {
    /// Tells this policy's headers from another's in the memo of [`Written`].
    id: u64,
    mode: IdentityMode,
    names: Names,
    front_proxy: bool,
}

/// The request-header names, parsed once.
struct Names {
    user: HeaderName,
    uid: Option<HeaderName>,
    group: HeaderName,
    extra_prefix: String,
    /// Every name a client must not send: the configured ones and the defaults, since an
    /// apiserver whose flags differ from this config (or that reads `X-Remote-Uid` while the
    /// config sends no uid) would take a client's own as the truth.
    strip: Vec<HeaderName>,
    /// Every extra prefix a client must not send, configured and default, lowercase.
    strip_prefixes: Vec<String>,
}

impl Forwarding {
    /// Builds the policy from the header names the configuration read.
    pub fn new(mode: IdentityMode, front_proxy: Option<&config::FrontProxy>) -> Self {
        let defaults = config::HeaderNames::default();
        let names = front_proxy.map_or(&defaults, |f| &f.headers);
        let mut strip: Vec<HeaderName> = Vec::new();
        for name in [
            Some(&names.user),
            names.uid.as_ref(),
            Some(&names.group),
            Some(&defaults.user),
            defaults.uid.as_ref(),
            Some(&defaults.group),
        ]
        .into_iter()
        .flatten()
        {
            if !strip.contains(name) {
                strip.push(name.clone());
            }
        }
        let mut strip_prefixes = vec![names.extra_prefix.as_str().to_owned()];
        let default_prefix = defaults.extra_prefix.as_str().to_owned();
        if !strip_prefixes.contains(&default_prefix) {
            strip_prefixes.push(default_prefix);
        }
        static NEXT_ID: AtomicU64 = AtomicU64::new(0);
        Self {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            mode,
            names: Names {
                user: names.user.clone(),
                uid: names.uid.clone(),
                group: names.group.clone(),
                extra_prefix: names.extra_prefix.as_str().to_owned(),
                strip,
                strip_prefixes,
            },
            front_proxy: front_proxy.is_some(),
        }
    }

    /// Rewrites `headers` for `identity` and says which upstream credential carries it.
    pub fn prepare(
        &self,
        identity: &Identity,
        headers: &mut HeaderMap,
        upgrade: bool,
    ) -> Result<upstream::UpstreamCredential, ForwardError> {
        strip_hop_by_hop(headers, upgrade);
        self.strip_request_headers(headers);
        let client_impersonates = headers
            .keys()
            .any(|name| name.as_str().starts_with("impersonate-"));
        if client_impersonates && self.mode == IdentityMode::Impersonate {
            return Err(ForwardError::ClientImpersonation);
        }
        let passthrough_token = match (self.mode, identity) {
            (
                IdentityMode::Passthrough,
                Identity::User {
                    credential: Credential::Token(token),
                    ..
                },
            ) => Some(token.clone()),
            _ => None,
        };
        headers.remove(AUTHORIZATION);
        let user = match identity {
            Identity::Anonymous => return Ok(upstream::UpstreamCredential::Anonymous),
            Identity::User { user, .. } => user,
        };
        if let Some(token) = passthrough_token {
            let mut value = HeaderValue::from_str(&format!("Bearer {token}"))
                .map_err(|_| ForwardError::Unrepresentable("token".into()))?;
            value.set_sensitive(true);
            headers.insert(AUTHORIZATION, value);
            return Ok(upstream::UpstreamCredential::Anonymous);
        }
        // Certificate clients in passthrough mode have nothing to pass through: they go as
        // front-proxy when it is configured, else by impersonation.
        let front_proxy = self.mode == IdentityMode::FrontProxy
            || (self.mode == IdentityMode::Passthrough && self.front_proxy);
        if !front_proxy && client_impersonates {
            return Err(ForwardError::ClientImpersonation);
        }
        // Appended, not inserted: a client's own headers of these names were stripped
        // (front-proxy) or refused (impersonation) above.
        for (name, value) in self.identity_headers(user, front_proxy)?.iter() {
            headers.append(name.clone(), value.clone());
        }
        Ok(if front_proxy {
            upstream::UpstreamCredential::FrontProxy
        } else {
            // The pool adds Bulwark's own bearer token, when it has one, to every request
            // that travels with the own credential.
            upstream::UpstreamCredential::Own
        })
    }

    /// `user`'s identity headers, from this thread's memo when this user (this very
    /// `Arc`, which the memo holds, so that no other user can take its address) went
    /// through this policy lately: a ServiceAccount's headers (three groups, five extras)
    /// cost about 17,500 instructions a request to write (README, Benchmarks).
    fn identity_headers(
        &self,
        user: &Arc<User>,
        front_proxy: bool,
    ) -> Result<Written, ForwardError> {
        let key = (self.id, Arc::as_ptr(user) as usize);
        let recalled = WRITTEN.with_borrow_mut(|memo| memo.get(&key).map(|(_, w)| w.clone()));
        if let Some(written) = recalled {
            return Ok(written);
        }
        let mut written = Vec::new();
        if front_proxy {
            self.front_proxy_headers(user, &mut written)?;
        } else {
            impersonation_headers(user, &mut written)?;
        }
        let written: Written = written.into();
        WRITTEN.with_borrow_mut(|memo| memo.put(key, (user.clone(), written.clone())));
        Ok(written)
    }

    fn strip_request_headers(&self, headers: &mut HeaderMap) {
        let forged = |name: &HeaderName| {
            self.names.strip.contains(name)
                || (self.names.strip_prefixes.iter())
                    .any(|prefix| name.as_str().starts_with(prefix.as_str()))
        };
        // Most requests carry none: one look at the names they have, not a lookup per name.
        if !headers.keys().any(forged) {
            return;
        }
        for name in &self.names.strip {
            headers.remove(name);
        }
        let extras: Vec<HeaderName> = headers
            .keys()
            .filter(|name| {
                let name = name.as_str();
                self.names
                    .strip_prefixes
                    .iter()
                    .any(|prefix| name.starts_with(prefix.as_str()))
            })
            .cloned()
            .collect();
        for name in extras {
            headers.remove(name);
        }
    }

    fn front_proxy_headers(
        &self,
        user: &User,
        headers: &mut Vec<(HeaderName, HeaderValue)>,
    ) -> Result<(), ForwardError> {
        headers.push((self.names.user.clone(), value(&user.username)?));
        if let (Some(name), Some(uid)) = (&self.names.uid, &user.uid) {
            headers.push((name.clone(), value(uid)?));
        }
        for group in &user.groups {
            headers.push((self.names.group.clone(), value(group)?));
        }
        for (key, values) in &user.extra {
            let name = extra_header(&self.names.extra_prefix, key)?;
            for v in values {
                headers.push((name.clone(), value(v)?));
            }
        }
        Ok(())
    }
}

/// One user's identity headers as one [`Forwarding`] writes them, in order.
type Written = Arc<[(HeaderName, HeaderValue)]>;

/// How many users' headers each thread keeps (see [`Forwarding::identity_headers`]).
const WRITTEN_MEMO: usize = 1024;

/// The memo of [`Written`], by policy and user (the `Arc`'s address, held alive by the
/// entry).
type WrittenMemo = lru::LruCache<(u64, usize), (Arc<User>, Written)>;

thread_local! {
    static WRITTEN: std::cell::RefCell<WrittenMemo> = std::cell::RefCell::new(
        lru::LruCache::new(std::num::NonZeroUsize::new(WRITTEN_MEMO).expect("not zero")),
    );
}

const IMPERSONATE_USER: HeaderName = HeaderName::from_static("impersonate-user");
const IMPERSONATE_UID: HeaderName = HeaderName::from_static("impersonate-uid");
const IMPERSONATE_GROUP: HeaderName = HeaderName::from_static("impersonate-group");

fn impersonation_headers(
    user: &User,
    headers: &mut Vec<(HeaderName, HeaderValue)>,
) -> Result<(), ForwardError> {
    headers.push((IMPERSONATE_USER, value(&user.username)?));
    if let Some(uid) = &user.uid {
        headers.push((IMPERSONATE_UID, value(uid)?));
    }
    for group in &user.groups {
        headers.push((IMPERSONATE_GROUP, value(group)?));
    }
    for (key, values) in &user.extra {
        let name = extra_header("impersonate-extra-", key)?;
        for v in values {
            headers.push((name.clone(), value(v)?));
        }
    }
    Ok(())
}

fn extra_header(prefix: &str, key: &str) -> Result<HeaderName, ForwardError> {
    let encoded = utf8_percent_encode(&key.to_ascii_lowercase(), EXTRA_KEY).to_string();
    HeaderName::try_from(format!("{prefix}{encoded}"))
        .map_err(|_| ForwardError::Unrepresentable(format!("extra key {key:?}")))
}

fn value(text: &str) -> Result<HeaderValue, ForwardError> {
    HeaderValue::from_bytes(text.as_bytes())
        .map_err(|_| ForwardError::Unrepresentable(format!("{text:?} is not a header value")))
}

/// Removes the headers of this hop: those `Connection` names and the fixed list. An upgrade
/// keeps `Connection: upgrade` and `Upgrade`, which its own upstream connection needs.
fn strip_hop_by_hop(headers: &mut HeaderMap, upgrade: bool) {
    // Most requests carry none: one look at the names they have, not a lookup per name.
    let hop = |name: &HeaderName| {
        name == CONNECTION || name == UPGRADE || HOP_BY_HOP.contains(&name.as_str())
    };
    if !headers.keys().any(hop) {
        return;
    }
    let listed: Vec<String> = headers
        .get_all(CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|n| n.trim().to_ascii_lowercase())
        .filter(|n| !(upgrade && n == "upgrade"))
        .collect();
    for name in listed {
        headers.remove(name.as_str());
    }
    for name in HOP_BY_HOP {
        headers.remove(name);
    }
    if !upgrade {
        headers.remove(CONNECTION);
        headers.remove(UPGRADE);
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::Arc;

    use super::*;

    fn alice() -> Identity {
        Identity::User {
            user: Arc::new(User {
                username: "alice".into(),
                uid: Some("u-1".into()),
                groups: vec!["dev".into(), "system:authenticated".into()],
                extra: BTreeMap::from([(
                    "authentication.kubernetes.io/pod-name".into(),
                    vec!["web-0".into()],
                )]),
            }),
            credential: Credential::Token("secret-token".into()),
        }
    }

    fn spoofing_headers() -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert("x-remote-user", "system:admin".parse().unwrap());
        h.insert("x-remote-group", "system:masters".parse().unwrap());
        h.insert("x-remote-extra-scopes", "all".parse().unwrap());
        h.insert("x-remote-uid", "0".parse().unwrap());
        h.insert("authorization", "Bearer secret-token".parse().unwrap());
        h
    }

    fn forwarding(mode: IdentityMode) -> Forwarding {
        let front = config::FrontProxy {
            cert: "fp.crt".into(),
            key: "fp.key".into(),
            headers: config::HeaderNames::default(),
        };
        Forwarding::new(mode, Some(&front))
    }

    /// A user's headers are written once per policy and thread: the next request of the
    /// same user shares their bytes, another policy writes its own, and a second user
    /// between them is not answered with the first's.
    #[test]
    fn a_users_identity_headers_are_written_once_per_policy() {
        let bob = Identity::User {
            user: Arc::new(User {
                username: "bob".into(),
                groups: vec!["system:authenticated".into()],
                ..User::default()
            }),
            credential: Credential::Token("bob-token".into()),
        };
        let alice = alice();
        let front = forwarding(IdentityMode::FrontProxy);
        let impersonate = forwarding(IdentityMode::Impersonate);
        let prepare = |forwarding: &Forwarding, identity: &Identity| {
            let mut headers = HeaderMap::new();
            forwarding.prepare(identity, &mut headers, false).unwrap();
            headers
        };
        let first = prepare(&front, &alice);
        let between = prepare(&front, &bob);
        let again = prepare(&front, &alice);
        assert_eq!(between["x-remote-user"], "bob");
        assert_eq!(first, again);
        assert_eq!(
            first["x-remote-user"].as_bytes().as_ptr(),
            again["x-remote-user"].as_bytes().as_ptr(),
            "the second request shares the first's written value"
        );
        let other = prepare(&impersonate, &alice);
        assert_eq!(other["impersonate-user"], "alice");
        assert_eq!(
            other["impersonate-extra-authentication.kubernetes.io%2fpod-name"],
            "web-0"
        );
        assert!(other.get("x-remote-user").is_none());
    }

    #[test]
    fn front_proxy_replaces_spoofed_identity_headers_with_the_real_user() {
        let mut headers = spoofing_headers();
        let credential = forwarding(IdentityMode::FrontProxy)
            .prepare(&alice(), &mut headers, false)
            .unwrap();
        assert_eq!(credential, upstream::UpstreamCredential::FrontProxy);
        assert_eq!(headers["x-remote-user"], "alice");
        assert_eq!(headers["x-remote-uid"], "u-1");
        let groups: Vec<_> = headers.get_all("x-remote-group").iter().collect();
        assert_eq!(groups, ["dev", "system:authenticated"]);
        assert!(headers.get("x-remote-extra-scopes").is_none());
        assert_eq!(
            headers["x-remote-extra-authentication.kubernetes.io%2fpod-name"],
            "web-0"
        );
        assert!(headers.get("authorization").is_none());
    }

    #[test]
    fn default_identity_headers_are_stripped_whatever_names_are_configured() {
        let front = config::FrontProxy {
            cert: "fp.crt".into(),
            key: "fp.key".into(),
            headers: config::HeaderNames {
                user: HeaderName::from_static("x-proxy-user"),
                uid: None,
                group: HeaderName::from_static("x-proxy-group"),
                extra_prefix: HeaderName::from_static("x-proxy-extra-"),
            },
        };
        for mode in [
            IdentityMode::FrontProxy,
            IdentityMode::Impersonate,
            IdentityMode::Passthrough,
        ] {
            let forwarding = Forwarding::new(mode, Some(&front));
            let mut headers = spoofing_headers();
            headers.insert("x-proxy-user", "system:admin".parse().unwrap());
            headers.insert("x-proxy-group", "system:masters".parse().unwrap());
            headers.insert("x-proxy-extra-scopes", "all".parse().unwrap());
            forwarding.prepare(&alice(), &mut headers, false).unwrap();
            for name in [
                "x-remote-user",
                "x-remote-group",
                "x-remote-uid",
                "x-remote-extra-scopes",
                "x-proxy-extra-scopes",
            ] {
                assert!(headers.get(name).is_none(), "{mode:?} kept {name}");
            }
            if mode == IdentityMode::FrontProxy {
                assert_eq!(headers["x-proxy-user"], "alice");
                let groups: Vec<_> = headers.get_all("x-proxy-group").iter().collect();
                assert_eq!(groups, ["dev", "system:authenticated"]);
            } else {
                assert!(headers.get("x-proxy-user").is_none(), "{mode:?}");
                assert!(headers.get("x-proxy-group").is_none(), "{mode:?}");
            }
        }
    }

    #[test]
    fn front_proxy_passes_client_impersonation_on_for_the_apiserver_to_judge() {
        let mut headers = spoofing_headers();
        headers.insert("impersonate-user", "bob".parse().unwrap());
        forwarding(IdentityMode::FrontProxy)
            .prepare(&alice(), &mut headers, false)
            .unwrap();
        assert_eq!(headers["impersonate-user"], "bob");
        assert_eq!(headers["x-remote-user"], "alice");
    }

    #[test]
    fn impersonate_mode_refuses_client_impersonation_and_sends_its_own() {
        let mut headers = spoofing_headers();
        headers.insert("impersonate-user", "bob".parse().unwrap());
        assert!(matches!(
            forwarding(IdentityMode::Impersonate).prepare(&alice(), &mut headers, false),
            Err(ForwardError::ClientImpersonation)
        ));
        let mut headers = spoofing_headers();
        let credential = forwarding(IdentityMode::Impersonate)
            .prepare(&alice(), &mut headers, false)
            .unwrap();
        assert_eq!(credential, upstream::UpstreamCredential::Own);
        assert_eq!(headers["impersonate-user"], "alice");
        assert!(headers.get("x-remote-user").is_none());
        assert!(headers.get("authorization").is_none());
        assert_eq!(
            headers["impersonate-extra-authentication.kubernetes.io%2fpod-name"],
            "web-0"
        );
    }

    #[test]
    fn passthrough_sends_the_reviewed_token_and_nothing_else() {
        let mut headers = spoofing_headers();
        let credential = forwarding(IdentityMode::Passthrough)
            .prepare(&alice(), &mut headers, false)
            .unwrap();
        assert_eq!(credential, upstream::UpstreamCredential::Anonymous);
        assert_eq!(headers["authorization"], "Bearer secret-token");
        assert!(headers.get("x-remote-user").is_none());
        assert!(headers.get("x-remote-group").is_none());
    }

    #[test]
    fn anonymous_requests_carry_no_identity_at_all() {
        for mode in [
            IdentityMode::FrontProxy,
            IdentityMode::Impersonate,
            IdentityMode::Passthrough,
        ] {
            let mut headers = spoofing_headers();
            let credential = forwarding(mode)
                .prepare(&Identity::Anonymous, &mut headers, false)
                .unwrap();
            assert_eq!(credential, upstream::UpstreamCredential::Anonymous);
            assert!(headers.is_empty(), "{mode:?} left {headers:?}");
        }
    }

    #[test]
    fn hop_by_hop_headers_are_dropped_except_an_upgrade() {
        let mut headers = HeaderMap::new();
        headers.insert("connection", "Upgrade, x-secret".parse().unwrap());
        headers.insert("upgrade", "SPDY/3.1".parse().unwrap());
        headers.insert("x-secret", "1".parse().unwrap());
        headers.insert("te", "trailers".parse().unwrap());
        let mut upgrade = headers.clone();
        strip_hop_by_hop(&mut headers, false);
        assert!(headers.is_empty());
        strip_hop_by_hop(&mut upgrade, true);
        assert_eq!(upgrade["upgrade"], "SPDY/3.1");
        assert!(upgrade.get("x-secret").is_none());
    }
}

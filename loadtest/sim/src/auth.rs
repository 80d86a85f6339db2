//! Authentication and impersonation as the kube-apiserver does them: client certificates,
//! front-proxy request headers, static bearer tokens, anonymous, then `Impersonate-*`.

use std::collections::BTreeMap;
use std::sync::Arc;

use http::HeaderMap;
use percent_encoding::percent_decode_str;
use rustls::client::danger::HandshakeSignatureValid;
use rustls::pki_types::{CertificateDer, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{DigitallySignedStruct, DistinguishedName, RootCertStore, SignatureScheme};

use crate::policy::{Attributes, Policy, StaticToken, forbidden_message};
use crate::status::{self, ApiError};

/// The identity a request was authenticated as.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UserInfo {
    /// User name.
    pub user: String,
    /// UID ("" when none).
    pub uid: String,
    /// Groups, including `system:authenticated` or `system:unauthenticated`.
    pub groups: Vec<String>,
    /// Extra attributes (keys lower-cased).
    pub extra: BTreeMap<String, Vec<String>>,
}

/// What the TLS handshake established about the client's certificate.
#[derive(Clone, Debug, Default)]
pub struct PeerCert {
    /// Subject CN.
    pub cn: String,
    /// Subject O values.
    pub orgs: Vec<String>,
    /// The certificate verifies against the client CA (signature, validity, usage).
    pub client_ca_ok: bool,
    /// The certificate verifies against the front-proxy CA.
    pub front_proxy_ok: bool,
}

/// Client-certificate verification as the apiserver does it: the handshake accepts any
/// certificate (proof of key possession is still checked), and each authenticator verifies
/// it afterwards against its own CA, so an expired or foreign certificate gets a 401 rather
/// than a handshake failure.
#[derive(Debug)]
pub struct DeferredVerifier {
    client: Arc<dyn ClientCertVerifier>,
    front_proxy: Arc<dyn ClientCertVerifier>,
    hints: Vec<DistinguishedName>,
}

/// Building a verifier failed (a CA certificate is unusable).
#[derive(Debug, thiserror::Error)]
#[error("client CA: {0}")]
pub struct VerifierError(String);

fn verifier_for(ca: CertificateDer<'static>) -> Result<Arc<dyn ClientCertVerifier>, VerifierError> {
    let mut roots = RootCertStore::empty();
    roots.add(ca).map_err(|e| VerifierError(e.to_string()))?;
    WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots),
        Arc::new(rustls::crypto::ring::default_provider()),
    )
    .allow_unauthenticated()
    .build()
    .map_err(|e| VerifierError(e.to_string()))
}

impl DeferredVerifier {
    /// A verifier for these two CAs.
    pub fn new(
        client_ca: CertificateDer<'static>,
        front_proxy_ca: CertificateDer<'static>,
    ) -> Result<DeferredVerifier, VerifierError> {
        let client = verifier_for(client_ca)?;
        let front_proxy = verifier_for(front_proxy_ca)?;
        let mut hints = client.root_hint_subjects().to_vec();
        hints.extend(front_proxy.root_hint_subjects().iter().cloned());
        Ok(DeferredVerifier {
            client,
            front_proxy,
            hints,
        })
    }

    /// Verifies a presented chain against both CAs and reads its subject.
    pub fn inspect(&self, chain: &[CertificateDer<'static>]) -> Option<PeerCert> {
        let (end, rest) = chain.split_first()?;
        let now = UnixTime::now();
        let client_ca_ok = self.client.verify_client_cert(end, rest, now).is_ok();
        let front_proxy_ok = self.front_proxy.verify_client_cert(end, rest, now).is_ok();
        let (_, cert) = x509_parser::parse_x509_certificate(end).ok()?;
        // Go's `pkix.Name` keeps the last CN of a subject that has several.
        let cn = cert
            .subject()
            .iter_common_name()
            .filter_map(|a| a.as_str().ok())
            .last()
            .unwrap_or_default()
            .to_string();
        let orgs = cert
            .subject()
            .iter_organization()
            .filter_map(|a| a.as_str().ok().map(str::to_string))
            .collect();
        Some(PeerCert {
            cn,
            orgs,
            client_ca_ok,
            front_proxy_ok,
        })
    }
}

impl ClientCertVerifier for DeferredVerifier {
    fn offer_client_auth(&self) -> bool {
        true
    }
    fn client_auth_mandatory(&self) -> bool {
        false
    }
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &self.hints
    }
    fn verify_client_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        Ok(ClientCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.client.verify_tls12_signature(message, cert, dss)
    }
    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.client.verify_tls13_signature(message, cert, dss)
    }
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.client.supported_verify_schemes()
    }
}

/// The authenticator settings of a fleet.
#[derive(Clone, Debug)]
pub struct AuthConfig {
    /// CNs allowed to assert X-Remote-* (empty = any).
    pub front_proxy_allowed_names: Vec<String>,
    /// Static tokens.
    pub tokens: Vec<StaticToken>,
    /// `--anonymous-auth`.
    pub anonymous: bool,
}

fn header_values(h: &HeaderMap, name: &str) -> Vec<String> {
    h.get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .map(str::to_string)
        .collect()
}

fn prefixed_extra(h: &HeaderMap, prefix: &str) -> BTreeMap<String, Vec<String>> {
    let mut extra: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (name, value) in h {
        // Header names are already lower-case in the http crate.
        if let Some(key) = name.as_str().strip_prefix(prefix)
            && let Ok(v) = value.to_str()
        {
            let key = percent_decode_str(key).decode_utf8_lossy().to_lowercase();
            extra.entry(key).or_default().push(v.to_string());
        }
    }
    extra
}

fn add_authenticated(mut u: UserInfo) -> UserInfo {
    if !u.groups.iter().any(|g| g == "system:authenticated") {
        u.groups.push("system:authenticated".into());
    }
    u
}

/// Authenticates a request: front-proxy headers (only from a front-proxy certificate with an
/// allowed CN), client certificate, bearer token, then anonymous. An invalid certificate or
/// token that nothing else outweighs is a 401, even with anonymous enabled.
pub fn authenticate(
    cfg: &AuthConfig,
    peer: Option<&PeerCert>,
    h: &HeaderMap,
) -> Result<UserInfo, ApiError> {
    let mut failed = false;
    if let Some(p) = peer {
        if let Some(user) = h.get("x-remote-user").and_then(|v| v.to_str().ok())
            && !user.is_empty()
        {
            let allowed = cfg.front_proxy_allowed_names.is_empty()
                || cfg.front_proxy_allowed_names.contains(&p.cn);
            if p.front_proxy_ok && allowed {
                return Ok(add_authenticated(UserInfo {
                    user: user.to_string(),
                    uid: h
                        .get("x-remote-uid")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or_default()
                        .to_string(),
                    groups: header_values(h, "x-remote-group"),
                    extra: prefixed_extra(h, "x-remote-extra-"),
                }));
            }
            failed = !p.client_ca_ok;
        }
        if p.client_ca_ok {
            return Ok(add_authenticated(UserInfo {
                user: p.cn.clone(),
                uid: String::new(),
                groups: p.orgs.clone(),
                extra: BTreeMap::new(),
            }));
        }
        if !p.front_proxy_ok {
            failed = true;
        }
    }
    if let Some(auth) = h.get(http::header::AUTHORIZATION) {
        let tok = auth.to_str().ok().and_then(|s| {
            let (scheme, t) = s.split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then(|| t.trim())
        });
        match tok.and_then(|t| cfg.tokens.iter().find(|s| s.token == t)) {
            Some(s) => {
                return Ok(add_authenticated(UserInfo {
                    user: s.user.clone(),
                    uid: s.uid.clone(),
                    groups: s.groups.clone(),
                    extra: s.extra.clone(),
                }));
            }
            None if tok.is_some() => failed = true,
            None => {}
        }
    }
    if failed || !cfg.anonymous {
        return Err(status::unauthorized());
    }
    Ok(UserInfo {
        user: "system:anonymous".into(),
        uid: String::new(),
        groups: vec!["system:unauthenticated".into()],
        extra: BTreeMap::new(),
    })
}

/// Applies `Impersonate-*` headers: every requested attribute needs the `impersonate` verb
/// on `users`/`serviceaccounts`, `groups`, `uids` or `userextras/KEY`. Returns the effective
/// user and the impersonator's name when impersonating.
pub fn impersonate(
    policy: &Policy,
    who: UserInfo,
    h: &HeaderMap,
) -> Result<(UserInfo, Option<String>), ApiError> {
    let user = h
        .get("impersonate-user")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let groups = header_values(h, "impersonate-group");
    let uid = h
        .get("impersonate-uid")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let extra = prefixed_extra(h, "impersonate-extra-");
    if user.is_none() && groups.is_empty() && uid.is_none() && extra.is_empty() {
        return Ok((who, None));
    }
    let Some(user) = user else {
        return Err(ApiError::new(
            500,
            "InternalError",
            "Internal error occurred: requested impersonation without a user: Impersonate-User is required".into(),
            None,
        ));
    };
    let check =
        |group: &str, resource: &str, sub: &str, ns: &str, name: &str| -> Result<(), ApiError> {
            let a = Attributes {
                user: who.user.clone(),
                groups: who.groups.clone(),
                verb: "impersonate".into(),
                resource_request: true,
                group: group.into(),
                resource: resource.into(),
                subresource: sub.into(),
                namespace: ns.into(),
                name: name.into(),
                path: String::new(),
            };
            if policy.allows(&a) {
                Ok(())
            } else {
                let kind = if sub.is_empty() {
                    resource.to_string()
                } else {
                    format!("{resource}/{sub}")
                };
                Err(ApiError::new(
                    403,
                    "Forbidden",
                    forbidden_message(&a),
                    Some(status::details(name, group, &kind)),
                ))
            }
        };
    let sa = user
        .strip_prefix("system:serviceaccount:")
        .and_then(|r| r.split_once(':'));
    match sa {
        Some((ns, name)) => check("", "serviceaccounts", "", ns, name)?,
        None => check("", "users", "", "", &user)?,
    }
    for g in &groups {
        check("", "groups", "", "", g)?;
    }
    if let Some(u) = &uid {
        check("authentication.k8s.io", "uids", "", "", u)?;
    }
    for (k, vs) in &extra {
        for v in vs {
            check("authentication.k8s.io", "userextras", k, "", v)?;
        }
    }
    let mut out_groups = groups;
    if let Some((ns, _)) = sa {
        for g in [
            "system:serviceaccounts".to_string(),
            format!("system:serviceaccounts:{ns}"),
        ] {
            if !out_groups.contains(&g) {
                out_groups.push(g);
            }
        }
    }
    let out = if user == "system:anonymous" {
        if !out_groups.iter().any(|g| g == "system:unauthenticated") {
            out_groups.push("system:unauthenticated".into());
        }
        UserInfo {
            user,
            uid: uid.unwrap_or_default(),
            groups: out_groups,
            extra,
        }
    } else {
        add_authenticated(UserInfo {
            user,
            uid: uid.unwrap_or_default(),
            groups: out_groups,
            extra,
        })
    };
    Ok((out, Some(who.user)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn cfg() -> AuthConfig {
        AuthConfig {
            front_proxy_allowed_names: vec!["front-proxy".into()],
            tokens: vec![StaticToken {
                token: "t1".into(),
                user: "tok".into(),
                uid: "u1".into(),
                groups: vec!["g".into()],
                ..StaticToken::default()
            }],
            anonymous: true,
        }
    }

    fn peer(cn: &str, client: bool, fp: bool) -> PeerCert {
        PeerCert {
            cn: cn.into(),
            orgs: vec!["o".into()],
            client_ca_ok: client,
            front_proxy_ok: fp,
        }
    }

    #[test]
    fn front_proxy_headers_only_count_from_an_allowed_front_proxy() {
        let mut h = HeaderMap::new();
        h.insert("x-remote-user", HeaderValue::from_static("alice"));
        h.append("x-remote-group", HeaderValue::from_static("a"));
        h.append("x-remote-group", HeaderValue::from_static("b"));
        h.insert("x-remote-extra-scopes%2fx", HeaderValue::from_static("s"));
        let u = authenticate(&cfg(), Some(&peer("front-proxy", false, true)), &h).unwrap();
        assert_eq!(u.user, "alice");
        assert_eq!(u.groups, ["a", "b", "system:authenticated"]);
        assert_eq!(u.extra.get("scopes/x").unwrap(), &["s"]);
        let u = authenticate(&cfg(), Some(&peer("carol", true, false)), &h).unwrap();
        assert_eq!(u.user, "carol");
        let u = authenticate(&cfg(), None, &h).unwrap();
        assert_eq!(u.user, "system:anonymous");
        // A front-proxy cert with a CN not on the list is not authoritative: 401.
        assert_eq!(
            authenticate(&cfg(), Some(&peer("other", false, true)), &h)
                .unwrap_err()
                .code,
            401
        );
        // A front-proxy connection without X-Remote-User falls through to anonymous.
        let u = authenticate(
            &cfg(),
            Some(&peer("front-proxy", false, true)),
            &HeaderMap::new(),
        )
        .unwrap();
        assert_eq!(u.user, "system:anonymous");
    }

    #[test]
    fn tokens_and_bad_credentials() {
        let mut h = HeaderMap::new();
        h.insert("authorization", HeaderValue::from_static("Bearer t1"));
        let u = authenticate(&cfg(), None, &h).unwrap();
        assert_eq!((u.user.as_str(), u.uid.as_str()), ("tok", "u1"));
        h.insert("authorization", HeaderValue::from_static("Bearer nope"));
        assert_eq!(authenticate(&cfg(), None, &h).unwrap_err().code, 401);
        // An expired/foreign client cert is a 401 even with anonymous on.
        assert_eq!(
            authenticate(&cfg(), Some(&peer("x", false, false)), &HeaderMap::new())
                .unwrap_err()
                .code,
            401
        );
        let mut c = cfg();
        c.anonymous = false;
        assert_eq!(
            authenticate(&c, None, &HeaderMap::new()).unwrap_err().code,
            401
        );
    }

    #[test]
    fn impersonation_needs_the_verb_per_attribute() {
        let p = Policy::from_yaml(
            "rules:\n- users: [admin]\n  verbs: [impersonate]\n  resources: [users, groups]\n",
        )
        .unwrap();
        let admin = UserInfo {
            user: "admin".into(),
            groups: vec!["system:authenticated".into()],
            ..Default::default()
        };
        let mut h = HeaderMap::new();
        h.insert("impersonate-user", HeaderValue::from_static("bob"));
        h.append("impersonate-group", HeaderValue::from_static("dev"));
        let (u, by) = impersonate(&p, admin.clone(), &h).unwrap();
        assert_eq!(u.user, "bob");
        assert_eq!(u.groups, ["dev", "system:authenticated"]);
        assert_eq!(by.as_deref(), Some("admin"));
        h.insert("impersonate-uid", HeaderValue::from_static("1"));
        let e = impersonate(&p, admin, &h).unwrap_err();
        assert_eq!(e.code, 403);
        assert_eq!(
            e.status.message,
            "uids.authentication.k8s.io \"1\" is forbidden: User \"admin\" cannot impersonate resource \"uids\" in API group \"authentication.k8s.io\" at the cluster scope"
        );
    }
}

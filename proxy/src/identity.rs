//! Who the client is (DESIGN.md step 2) and how that identity goes upstream (step 3).
//!
//! A verified client certificate wins over a bearer token, as in the apiserver. A token is
//! resolved with a TokenReview made with Bulwark's own identity and cached by its hash; a
//! token the review rejects is never passed on, and reviews are bounded ([`limits`]). The
//! [`forward`] submodule rewrites the request headers for the configured mode.

pub mod forward;
pub mod limits;
pub mod review;

use std::collections::BTreeMap;
use std::sync::Arc;

use rustls_pki_types::CertificateDer;

pub use crate::user::{AUTHENTICATED, User};
pub use review::{TokenCache, TokenReviewer, UpstreamReviewer};

/// How the client proved who it is; decides how the request may be forwarded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Credential {
    /// A client certificate verified by the listener.
    Certificate,
    /// A bearer token, accepted by a TokenReview; kept for passthrough mode.
    Token(String),
}

/// The user name of a request on the anonymous allowlist, as the apiserver names it.
pub const ANONYMOUS: &str = "system:anonymous";

/// The identity of one request, put into its extensions by [`identify`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Identity {
    /// An authenticated user.
    User {
        /// Who (shared with the token cache and the connection: never copied per request).
        user: Arc<User>,
        /// How they proved it.
        credential: Credential,
    },
    /// No credentials, on a path of the anonymous allowlist.
    Anonymous,
}

impl Identity {
    /// The user, when there is one.
    pub fn user(&self) -> Option<&Arc<User>> {
        match self {
            Identity::User { user, .. } => Some(user),
            Identity::Anonymous => None,
        }
    }

    /// The user name for logs and metrics (`system:anonymous` for the allowlist).
    pub fn name(&self) -> &str {
        self.user()
            .map(|u| u.username.as_str())
            .unwrap_or(ANONYMOUS)
    }
}

/// Why a request has no identity.
#[derive(Debug, Clone, thiserror::Error)]
pub enum IdentityError {
    /// Neither a certificate nor a token, on a path that needs one.
    #[error("no client certificate or bearer token")]
    NoCredentials,
    /// The `Authorization` header is not a usable bearer token.
    #[error("the Authorization header is not a bearer token")]
    MalformedAuthorization,
    /// The bearer token is longer than any Bulwark reviews.
    #[error("the bearer token is longer than {0} bytes")]
    TokenTooLong(usize),
    /// A review would be needed, and a bound on reviews says not now.
    #[error("{}; retry later", .0.bound)]
    ReviewLimited(limits::Limited),
    /// The TokenReview said no.
    #[error("the token was rejected: {0}")]
    TokenRejected(String),
    /// No TokenReview could be made; the request is refused rather than passed on.
    #[error("the token could not be reviewed")]
    ReviewFailed(#[source] Arc<review::ReviewError>),
    /// The verified certificate has no usable subject (no CN, or more than one).
    #[error("the client certificate has no usable common name: {0}")]
    BadCertificate(String),
    /// The connection's credentials were refused this many times in a row and it is
    /// closing: a request that crossed its GOAWAY is refused without another review.
    #[error(
        "this connection's credentials were refused {0} times in a row and it is closing; \
         reconnect with valid credentials"
    )]
    ConnectionClosing(u32),
}

/// The user named by a verified client certificate: CN is the user, each O a group.
///
/// A subject with more than one CN is refused: Go's `pkix.Name` keeps the last one, so the
/// apiserver would take such a certificate for a user other than the first CN, and no
/// choice here could be sure to agree with every hop that reads it.
pub fn user_from_certificate(leaf: &CertificateDer<'_>) -> Result<User, IdentityError> {
    let (_, cert) = x509_parser::parse_x509_certificate(leaf.as_ref())
        .map_err(|e| IdentityError::BadCertificate(e.to_string()))?;
    let subject = cert.subject();
    let mut common_names = subject.iter_common_name();
    let first = common_names.next();
    if common_names.next().is_some() {
        return Err(IdentityError::BadCertificate("more than one CN".into()));
    }
    let username = first
        .and_then(|cn| cn.as_str().ok())
        .filter(|cn| !cn.is_empty())
        .ok_or_else(|| IdentityError::BadCertificate("no CN".into()))?
        .to_string();
    let groups = subject
        .iter_organization()
        .filter_map(|o| o.as_str().ok())
        .map(str::to_string)
        .collect();
    Ok(User {
        username,
        uid: None,
        groups,
        extra: BTreeMap::new(),
    }
    .with_authenticated_group())
}

/// The bearer token of a request, if it carries one: `Bearer`, one space, and a token of
/// visible ASCII (no spaces). Anything else is refused before a review is made: the
/// apiserver authenticates no such token either (it reads `Bearer  x` as an empty token,
/// and ServiceAccount, OIDC and bootstrap tokens are all visible ASCII).
pub fn bearer_token(headers: &http::HeaderMap) -> Result<Option<String>, IdentityError> {
    let Some(value) = headers.get(http::header::AUTHORIZATION) else {
        return Ok(None);
    };
    let value = value
        .to_str()
        .map_err(|_| IdentityError::MalformedAuthorization)?;
    let (scheme, token) = value
        .trim()
        .split_once(' ')
        .ok_or(IdentityError::MalformedAuthorization)?;
    if !scheme.eq_ignore_ascii_case("bearer")
        || token.is_empty()
        || !token.bytes().all(|b| b.is_ascii_graphic())
    {
        return Err(IdentityError::MalformedAuthorization);
    }
    Ok(Some(token.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cert_for(cn: &str, orgs: &[&str]) -> CertificateDer<'static> {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, cn);
        // rcgen keeps one value per attribute type; further O values go in under the O
        // object identifier itself, as real multi-group certificates carry them.
        for (i, o) in orgs.iter().enumerate() {
            let kind = if i == 0 {
                rcgen::DnType::OrganizationName
            } else {
                rcgen::DnType::CustomDnType(vec![2, 5, 4, 10])
            };
            params.distinguished_name.push(kind, *o);
        }
        let key = rcgen::KeyPair::generate().unwrap();
        params.self_signed(&key).unwrap().der().clone()
    }

    #[test]
    fn certificate_gives_cn_as_user_and_each_o_as_a_group_plus_authenticated() {
        let user = user_from_certificate(&cert_for("alice", &["dev", "ops"])).unwrap();
        assert_eq!(user.username, "alice");
        assert_eq!(user.groups, ["dev", "ops", AUTHENTICATED]);
    }

    #[test]
    fn certificate_without_cn_is_refused() {
        assert!(matches!(
            user_from_certificate(&cert_for("", &["dev"])),
            Err(IdentityError::BadCertificate(_))
        ));
    }

    #[test]
    fn certificate_with_more_than_one_cn_is_refused() {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "alice");
        params.distinguished_name.push(
            rcgen::DnType::CustomDnType(vec![2, 5, 4, 3]),
            "system:admin",
        );
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap().der().clone();
        let cns = x509_parser::parse_x509_certificate(cert.as_ref())
            .unwrap()
            .1
            .subject()
            .iter_common_name()
            .count();
        assert_eq!(cns, 2, "the test certificate carries both CNs");
        assert!(matches!(
            user_from_certificate(&cert),
            Err(IdentityError::BadCertificate(why)) if why == "more than one CN"
        ));
    }

    #[test]
    fn bearer_tokens_are_parsed_strictly() {
        let mut headers = http::HeaderMap::new();
        assert_eq!(bearer_token(&headers).unwrap(), None);
        headers.insert("authorization", "Bearer abc.def".parse().unwrap());
        assert_eq!(bearer_token(&headers).unwrap(), Some("abc.def".into()));
        headers.insert("authorization", "Basic dXNlcjpwdw==".parse().unwrap());
        assert!(matches!(
            bearer_token(&headers),
            Err(IdentityError::MalformedAuthorization)
        ));
        for malformed in [
            "Bearer ",
            "Bearer",
            "Bearer  abc",
            "Bearer a b",
            "Bearer a\tb",
            "Bearerabc",
        ] {
            headers.insert("authorization", malformed.parse().unwrap());
            assert!(
                matches!(
                    bearer_token(&headers),
                    Err(IdentityError::MalformedAuthorization)
                ),
                "{malformed:?}"
            );
        }
        headers.insert(
            "authorization",
            http::HeaderValue::from_bytes("Bearer t\u{f6}k".as_bytes()).unwrap(),
        );
        assert!(matches!(
            bearer_token(&headers),
            Err(IdentityError::MalformedAuthorization)
        ));
        headers.insert("authorization", "bearer a-Z_0.9~+/=".parse().unwrap());
        assert_eq!(bearer_token(&headers).unwrap(), Some("a-Z_0.9~+/=".into()));
    }
}

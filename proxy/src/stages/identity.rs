//! Identity as a stage: who the client is — its certificate first, then its bearer token
//! (by TokenReview), then the anonymous allowlist; 401 otherwise.

use std::sync::Arc;

use super::call::{Answered, Call, Classified, Identified, Next, Stage};
use crate::identity::limits::Bound;
use crate::identity::{self, Credential, Identity, IdentityError, TokenCache};
use crate::listen::ConnInfo;

/// Establishes who the client is.
#[derive(Clone)]
pub struct Identify {
    tokens: Arc<TokenCache>,
    anonymous: Arc<[String]>,
}

impl Identify {
    /// Reviews tokens through `tokens`; lets `anonymous` paths through without
    /// credentials.
    pub fn new(tokens: Arc<TokenCache>, anonymous: Vec<String>) -> Identify {
        Identify {
            tokens,
            anonymous: anonymous.into(),
        }
    }
}

impl<B: Send + 'static> Stage<B> for Identify {
    type In = Classified;
    type Out = Identified;

    async fn run<N: Next<B, Self::Out>>(&self, call: Call<B, Self::In>, next: &N) -> Answered {
        if let Some(refused) = call.conn.as_ref().and_then(|c| c.auth.given_up()) {
            // A request that crossed the GOAWAY of a connection closed for its refusals
            // (HTTP/2 lets it in until the client reads the GOAWAY) costs no review.
            return Err(IdentityError::ConnectionClosing(refused).into());
        }
        let identifying = call.conn.as_ref().and_then(|c| c.auth.identifying());
        let identity = identify(
            call.request.headers(),
            call.conn.as_ref(),
            call.request.uri().path(),
            &self.tokens,
            &self.anonymous,
        )
        .await;
        if let Some(conn) = &call.conn {
            tell_connection(conn, &identity);
        }
        drop(identifying);
        let identity = identity?;
        let _ = call.report.user.set(identity.user().cloned());
        let info = call.facts.info.clone();
        next.run(call.learn(Identified { info, identity })).await
    }
}

/// Tells the connection whether its client authenticates, so that one that never does (or
/// keeps failing) is closed. A review that could not be made (it failed, or Bulwark's own
/// reviews in flight stayed at their bound) is not the client's fault, and an anonymous
/// request on the allowlist (a balancer's `/readyz`) proves nothing either way. A review
/// refused by a bucket is not excused: the client's own prefix may be the flood that emptied
/// it, and a flooding prefix must not buy its connections more time.
fn tell_connection(conn: &ConnInfo, identity: &Result<Identity, IdentityError>) {
    match identity {
        Ok(Identity::User { .. }) => conn.auth.accepted(),
        Ok(Identity::Anonymous) => {}
        Err(IdentityError::ReviewFailed(_)) => conn.auth.excused(),
        Err(IdentityError::ReviewLimited(limited)) if limited.bound == Bound::InFlight => {
            conn.auth.excused()
        }
        Err(_) => conn.auth.refused(),
    }
}

/// Certificate, then bearer token, then the anonymous allowlist.
async fn identify(
    headers: &http::HeaderMap,
    conn: Option<&ConnInfo>,
    path: &str,
    tokens: &TokenCache,
    anonymous: &[String],
) -> Result<Identity, IdentityError> {
    if let Some((conn, leaf)) = conn.and_then(|c| {
        let leaf = c.client_chain.as_deref()?.first()?;
        Some((c, leaf))
    }) {
        // Read once per connection: every request on it presents the same certificate.
        let user = conn
            .client_user
            .get_or_init(|| {
                identity::user_from_certificate(leaf)
                    .map(Arc::new)
                    .map_err(|e| match e {
                        IdentityError::BadCertificate(why) => why,
                        other => other.to_string(),
                    })
            })
            .clone()
            .map_err(IdentityError::BadCertificate)?;
        return Ok(Identity::User {
            user,
            credential: Credential::Certificate,
        });
    }
    if let Some(token) = identity::bearer_token(headers)? {
        let user = tokens
            .authenticate_on(
                &token,
                conn.map(|c| c.peer.ip()),
                conn.map(|c| c.auth.token()),
            )
            .await?;
        return Ok(Identity::User {
            user,
            credential: Credential::Token(token),
        });
    }
    if anonymous.iter().any(|allowed| allowed == path) {
        return Ok(Identity::Anonymous);
    }
    Err(IdentityError::NoCredentials)
}

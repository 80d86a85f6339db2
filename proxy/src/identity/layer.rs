//! Identity as a stage: who the client is — its certificate first, then its bearer token
//! (by TokenReview), then the anonymous allowlist; 401 otherwise.

use std::sync::Arc;
use std::task::{Context, Poll};

use http::Response;
use tower::{Layer, Service};

use super::{Credential, Identity, IdentityError, TokenCache};
use crate::call::{Call, Classified, Identified};
use crate::listen::ConnInfo;
use crate::status::ProxyError;
use crate::{Body, BoxFuture};

/// See [`Identify`].
#[derive(Clone)]
pub struct IdentifyLayer {
    tokens: Arc<TokenCache>,
    anonymous: Arc<[String]>,
}

impl IdentifyLayer {
    /// Reviews tokens through `tokens`; lets `anonymous` paths through without
    /// credentials.
    pub fn new(tokens: Arc<TokenCache>, anonymous: Vec<String>) -> IdentifyLayer {
        IdentifyLayer {
            tokens,
            anonymous: anonymous.into(),
        }
    }
}

impl<S> Layer<S> for IdentifyLayer {
    type Service = Identify<S>;
    fn layer(&self, inner: S) -> Identify<S> {
        Identify {
            inner,
            tokens: self.tokens.clone(),
            anonymous: self.anonymous.clone(),
        }
    }
}

/// Establishes who the client is.
#[derive(Clone)]
pub struct Identify<S> {
    inner: S,
    tokens: Arc<TokenCache>,
    anonymous: Arc<[String]>,
}

impl<S, B> Service<Call<B, Classified>> for Identify<S>
where
    S: Service<Call<B, Identified>, Response = Response<Body>, Error = ProxyError>
        + Clone
        + Send
        + 'static,
    S::Future: Send,
    B: Send + 'static,
{
    type Response = Response<Body>;
    type Error = ProxyError;
    type Future = BoxFuture<Response<Body>, ProxyError>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), ProxyError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, call: Call<B, Classified>) -> Self::Future {
        let (tokens, anonymous) = (self.tokens.clone(), self.anonymous.clone());
        let mut inner = self.inner.clone();
        Box::pin(async move {
            let identity = identify(
                call.request.headers(),
                call.conn.as_ref(),
                call.request.uri().path(),
                &tokens,
                &anonymous,
            )
            .await?;
            let _ = call.report.who.set(identity.name().to_string());
            let info = call.facts.info.clone();
            inner.call(call.learn(Identified { info, identity })).await
        })
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
    if let Some(leaf) = conn
        .and_then(|c| c.client_chain.as_deref())
        .and_then(|chain| chain.first())
    {
        let user = super::user_from_certificate(leaf)?;
        return Ok(Identity::User {
            user,
            credential: Credential::Certificate,
        });
    }
    if let Some(token) = super::bearer_token(headers)? {
        let user = tokens
            .authenticate(&token, conn.map(|c| c.peer.ip()))
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

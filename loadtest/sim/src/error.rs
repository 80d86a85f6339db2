//! Why the simulator could not start, or a request of its client failed.

/// The simulator's errors, each keeping its cause.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A socket, a PEM file or another read or write.
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    /// A TLS configuration could not be built.
    #[error("TLS configuration")]
    Tls(#[from] rustls::Error),
    /// A client-certificate verifier could not be built.
    #[error("client certificate verifier")]
    Verifier(#[from] rustls::server::VerifierBuilderError),
    /// A PEM held no private key.
    #[error("no private key in the PEM")]
    NoKey,
    /// A server name is not one TLS accepts.
    #[error("server name")]
    ServerName(#[from] rustls_pki_types::InvalidDnsNameError),
    /// An HTTP exchange failed.
    #[error("HTTP: {0}")]
    Http(#[from] hyper::Error),
    /// A request could not be built.
    #[error("building a request")]
    Request(#[from] http::Error),
    /// A seed could not be stored.
    #[error("seeding")]
    Seed(#[from] crate::store::StoreError),
    /// The certificate verifiers could not be built.
    #[error("certificate verifiers")]
    Verifiers(#[from] crate::auth::VerifierError),
}

/// The simulator's results.
pub type Result<T> = std::result::Result<T, Error>;

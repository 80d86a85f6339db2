//! The control plane's certificates, from the project's development PKI
//! (`bulwark certs init`): its CA signs the apiservers' serving certificate and every client
//! certificate (so it is also their `--client-ca-file`), and its front-proxy CA is their
//! `--requestheader-client-ca-file`. Plus the service-account signing key.

use std::path::{Path, PathBuf};

use bulwark::certs::{InitOptions, init};
use bulwark_sim::pki::{Ca, Pki};
use rcgen::{KeyPair, PKCS_ECDSA_P256_SHA256};

use super::Error;

/// The CN of Bulwark's front-proxy certificate, in the apiservers'
/// `--requestheader-allowed-names`.
pub const FRONT_PROXY_NAME: &str = "bulwark-front-proxy";

/// Every file the apiservers read, and the CAs to mint client certificates with.
#[derive(Debug)]
pub struct Files {
    /// The CAs as the sandbox's code takes them: serving and client CA are both the
    /// development CA, the front-proxy CA is its own.
    pub pki: Pki,
    /// The development CA certificate (`--client-ca-file`).
    pub client_ca: PathBuf,
    /// The front-proxy CA certificate (`--requestheader-client-ca-file`).
    pub front_proxy_ca: PathBuf,
    /// The apiservers' serving certificate (127.0.0.1, localhost, and the `kubernetes`
    /// Service's names and ClusterIP).
    pub serving_cert: PathBuf,
    /// Its key.
    pub serving_key: PathBuf,
    /// The service-account token signing key (ECDSA P-256, PKCS#8).
    pub sa_key: PathBuf,
    /// Its public key, which verifies tokens.
    pub sa_pub: PathBuf,
}

/// Mints (or, for the CAs, reuses) everything in `dir`.
pub fn mint(dir: &Path) -> Result<Files, Error> {
    let mut options = InitOptions::new(dir, &["127.0.0.1", "localhost"]);
    options.front_proxy_name = FRONT_PROXY_NAME.into();
    init(&options)?;
    let load = |name: &str| -> Result<Ca, Error> {
        let read = |file: String| {
            let path = dir.join(file);
            std::fs::read_to_string(&path).map_err(|source| Error::Io { path, source })
        };
        let cert = read(format!("{name}.crt"))?;
        let key = read(format!("{name}.key"))?;
        Ca::from_pem(&cert, &key).map_err(|e| Error::Pki(format!("{name}.crt: {e}")))
    };
    let pki = Pki {
        server_ca: load("ca")?,
        client_ca: load("ca")?,
        front_proxy_ca: load("front-proxy-ca")?,
    };
    // What in-cluster clients dial too: the `kubernetes` Service's names and ClusterIP,
    // which lead to the apiservers themselves when no Bulwark is live.
    let serving = pki.server_ca.server_cert(&bulwark_testkit::serving_names());
    let serving_cert = write(dir, "apiserver.crt", &serving.cert_pem, false)?;
    let serving_key = write(dir, "apiserver.key", &serving.key_pem, true)?;
    let sa = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256)
        .map_err(|e| Error::Pki(format!("service-account key: {e}")))?;
    let sa_key = write(dir, "sa.key", &sa.serialize_pem(), true)?;
    let sa_pub = write(dir, "sa.pub", &sa.public_key_pem(), false)?;
    Ok(Files {
        client_ca: dir.join("ca.crt"),
        front_proxy_ca: dir.join("front-proxy-ca.crt"),
        pki,
        serving_cert,
        serving_key,
        sa_key,
        sa_pub,
    })
}

/// Writes a file, readable by its owner only when it is a secret (a key, a kubeconfig).
pub fn write(dir: &Path, name: &str, contents: &str, secret: bool) -> Result<PathBuf, Error> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let path = dir.join(name);
    let io = |source| Error::Io {
        path: path.clone(),
        source,
    };
    let _ = std::fs::remove_file(&path);
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(if secret { 0o600 } else { 0o644 })
        .open(&path)
        .map_err(io)?;
    file.write_all(contents.as_bytes()).map_err(io)?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mints_the_apiserver_files_from_the_development_ca() {
        let dir = tempfile::tempdir().unwrap();
        let files = mint(dir.path()).unwrap();
        for path in [
            &files.client_ca,
            &files.front_proxy_ca,
            &files.serving_cert,
            &files.serving_key,
            &files.sa_key,
            &files.sa_pub,
        ] {
            assert!(path.is_file(), "{}", path.display());
        }
        assert_eq!(
            std::fs::read_to_string(&files.client_ca).unwrap(),
            files.pki.client_ca.cert_pem()
        );
        assert_eq!(
            files.pki.front_proxy_ca.common_name(),
            "bulwark-front-proxy-ca"
        );
        let pub_pem = std::fs::read_to_string(&files.sa_pub).unwrap();
        assert!(
            pub_pem.starts_with("-----BEGIN PUBLIC KEY-----"),
            "{pub_pem}"
        );

        // A second run keeps the CAs, so certificates handed out stay valid.
        let again = mint(dir.path()).unwrap();
        assert_eq!(
            again.pki.client_ca.cert_pem(),
            files.pki.client_ca.cert_pem()
        );
    }
}

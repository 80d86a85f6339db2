//! Tests of `certs init`: what a user of the minted files observes — chains that verify,
//! identities the apiserver would read, kubeconfigs that parse, keys kept private.

use std::sync::Arc;

use rustls::client::danger::ServerCertVerifier as _;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};

use super::*;

fn cert_der(pem: &str) -> CertificateDer<'static> {
    rustls_pemfile::certs(&mut pem.as_bytes())
        .next()
        .expect("a certificate")
        .expect("valid PEM")
}

fn read(dir: &Path, name: &str) -> String {
    std::fs::read_to_string(dir.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn roots(ca_pem: &str) -> Arc<rustls::RootCertStore> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert_der(ca_pem)).expect("CA accepted as a root");
    Arc::new(roots)
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Verifies `leaf` as a client certificate issued by `ca`, as Bulwark's listener and the
/// apiserver do.
fn verify_client(ca_pem: &str, leaf_pem: &str) -> Result<(), rustls::Error> {
    let verifier =
        rustls::server::WebPkiClientVerifier::builder_with_provider(roots(ca_pem), provider())
            .build()
            .expect("verifier");
    verifier
        .verify_client_cert(&cert_der(leaf_pem), &[], UnixTime::now())
        .map(|_| ())
}

fn verify_server(ca_pem: &str, leaf_pem: &str, name: &str) -> Result<(), rustls::Error> {
    let verifier =
        rustls::client::WebPkiServerVerifier::builder_with_provider(roots(ca_pem), provider())
            .build()
            .expect("verifier");
    let name = ServerName::try_from(name.to_string()).expect("server name");
    verifier
        .verify_server_cert(&cert_der(leaf_pem), &[], &name, &[], UnixTime::now())
        .map(|_| ())
}

fn user_of(pem: &str) -> crate::identity::User {
    crate::identity::user_from_certificate(&cert_der(pem)).expect("the apiserver reads it")
}

fn options(dir: &Path) -> InitOptions {
    let mut options = InitOptions::new(dir, &["bulwark.example.com", "10.0.0.10", "::1"]);
    options.identities = vec![
        "alice:dev,ops".parse().unwrap(),
        "system:node:worker-1:system:nodes".parse().unwrap(),
        "system:serviceaccount:ops:sync".parse().unwrap(),
    ];
    options
}

#[test]
fn identities_parse_like_kubernetes_user_names() {
    let parse = |s: &str| s.parse::<IdentitySpec>().map(|i| (i.user, i.groups));
    let owned = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert_eq!(parse("alice").unwrap(), ("alice".into(), vec![]));
    assert_eq!(
        parse("alice:dev,ops").unwrap(),
        ("alice".into(), owned(&["dev", "ops"]))
    );
    assert_eq!(
        parse("system:node:n1:system:nodes").unwrap(),
        ("system:node:n1".into(), owned(&["system:nodes"]))
    );
    assert_eq!(
        parse("system:serviceaccount:ops:sync").unwrap(),
        ("system:serviceaccount:ops:sync".into(), vec![])
    );
    assert_eq!(
        parse("system:kube-scheduler").unwrap(),
        ("system:kube-scheduler".into(), vec![])
    );
    assert_eq!(
        parse("bulwark:bulwark:proxies").unwrap(),
        ("bulwark".into(), owned(&["bulwark:proxies"]))
    );
    for bad in [
        "",
        ":dev",
        "alice:",
        "alice:dev,,ops",
        "system:node",
        "system::x",
    ] {
        assert!(
            matches!(parse(bad), Err(CertsError::BadIdentity(..))),
            "{bad:?} must be refused"
        );
    }
    let spec: IdentitySpec = "system:node:n1:system:nodes,extra".parse().unwrap();
    assert_eq!(spec.to_string(), "system:node:n1:system:nodes,extra");
}

#[test]
fn init_mints_chains_that_verify() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    init(&options(d)).expect("init");

    let ca = read(d, "ca.crt");
    assert_eq!(read(d, "client-ca.crt"), ca);
    for name in ["bulwark.example.com", "10.0.0.10", "::1"] {
        verify_server(&ca, &read(d, "bulwark.crt"), name)
            .unwrap_or_else(|e| panic!("serving certificate for {name}: {e}"));
    }
    assert!(verify_server(&ca, &read(d, "bulwark.crt"), "other.example.com").is_err());

    let front_proxy_ca = read(d, "front-proxy-ca.crt");
    let front_proxy = read(d, "front-proxy-client.crt");
    verify_client(&front_proxy_ca, &front_proxy).expect("front-proxy client under its CA");
    assert!(
        verify_client(&ca, &front_proxy).is_err(),
        "the front-proxy certificate must not be a user certificate"
    );
    assert_eq!(user_of(&front_proxy).username, "front-proxy-client");

    let own = read(d, "bulwark-client.crt");
    verify_client(&ca, &own).expect("own client certificate");
    assert_eq!(user_of(&own).username, "bulwark");
    assert!(
        user_of(&own)
            .groups
            .contains(&"bulwark:proxies".to_string())
    );

    let alice = read(d, "user-alice.crt");
    verify_client(&ca, &alice).expect("alice");
    let user = user_of(&alice);
    assert_eq!(user.username, "alice");
    assert_eq!(user.groups, ["dev", "ops", "system:authenticated"]);
    let node = user_of(&read(d, "user-system-node-worker-1.crt"));
    assert_eq!(node.username, "system:node:worker-1");
    assert_eq!(node.groups, ["system:nodes", "system:authenticated"]);

    // The serving certificate is not a client certificate, and the reverse.
    assert!(verify_client(&ca, &read(d, "bulwark.crt")).is_err());
    assert!(verify_server(&ca, &alice, "alice").is_err());
}

#[test]
fn every_key_is_ecdsa_and_private() {
    let dir = tempfile::tempdir().unwrap();
    let minted = init(&options(dir.path())).expect("init");
    let keys: Vec<_> = minted
        .written
        .iter()
        .filter(|p| p.extension().is_some_and(|e| e == "key"))
        .collect();
    assert_eq!(keys.len(), 8, "{minted}");
    for key in keys {
        let pem = std::fs::read_to_string(key).unwrap();
        let pair = KeyPair::from_pem(&pem).unwrap();
        assert_eq!(
            pair.algorithm(),
            &PKCS_ECDSA_P256_SHA256,
            "{}",
            key.display()
        );
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            let mode = std::fs::metadata(key).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600, "{}", key.display());
        }
    }
    assert!(!format!("{:?}", minted).contains("PRIVATE"));
}

#[test]
fn kubeconfigs_point_at_bulwark_with_the_identity_embedded() {
    let dir = tempfile::tempdir().unwrap();
    let mut options = options(dir.path());
    options.server = Some("https://bulwark.example.com:7443".into());
    init(&options).expect("init");
    let text = read(dir.path(), "kubeconfig-system-serviceaccount-ops-sync");
    let config: serde_json::Value = serde_norway::from_str(&text).expect("YAML");
    use base64::Engine as _;
    let decode = |v: &serde_json::Value| {
        let b64 = v.as_str().expect("string");
        String::from_utf8(
            base64::engine::general_purpose::STANDARD
                .decode(b64)
                .expect("base64"),
        )
        .expect("PEM text")
    };
    let cluster = &config["clusters"][0]["cluster"];
    assert_eq!(cluster["server"], "https://bulwark.example.com:7443");
    assert_eq!(
        decode(&cluster["certificate-authority-data"]),
        read(dir.path(), "ca.crt")
    );
    let user = &config["users"][0]["user"];
    let cert = decode(&user["client-certificate-data"]);
    assert_eq!(user_of(&cert).username, "system:serviceaccount:ops:sync");
    KeyPair::from_pem(&decode(&user["client-key-data"])).expect("embedded key");
    assert_eq!(
        config["current-context"], "system:serviceaccount:ops:sync",
        "{text}"
    );
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        let path = dir.path().join("kubeconfig-system-serviceaccount-ops-sync");
        let mode = std::fs::metadata(path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
    }
}

#[test]
fn default_server_is_the_first_name() {
    assert_eq!(
        default_server("k8s.example.com"),
        "https://k8s.example.com:6443"
    );
    assert_eq!(default_server("::1"), "https://[::1]:6443");
}

#[test]
fn running_again_reuses_the_cas_and_renews_leaves() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    init(&options(d)).expect("first run");
    let ca = read(d, "ca.crt");
    let front_proxy_ca = read(d, "front-proxy-ca.crt");
    let alice = read(d, "user-alice.crt");

    let mut again = options(d);
    again.identities = vec!["bob".parse().unwrap()];
    let minted = init(&again).expect("second run");
    assert_eq!(minted.reused.len(), 2, "{minted}");
    assert_eq!(read(d, "ca.crt"), ca);
    assert_eq!(read(d, "front-proxy-ca.crt"), front_proxy_ca);
    verify_client(&ca, &read(d, "user-bob.crt")).expect("bob under the same CA");
    // Earlier identities keep working: their files are untouched and still verify.
    assert_eq!(read(d, "user-alice.crt"), alice);
    verify_client(&ca, &alice).expect("alice still valid");
}

#[test]
fn bad_input_gets_a_precise_error() {
    let dir = tempfile::tempdir().unwrap();
    let mut no_names = options(dir.path());
    no_names.server_names.clear();
    assert!(matches!(init(&no_names), Err(CertsError::NoServerName)));

    let mut bad_name = options(dir.path());
    bad_name.server_names = vec!["not a name".into()];
    assert!(matches!(init(&bad_name), Err(CertsError::BadServerName(n)) if n == "not a name"));

    let mut clash = options(dir.path());
    clash.identities = vec!["a:b".parse().unwrap(), "a".parse().unwrap()];
    assert!(matches!(
        init(&clash),
        Err(CertsError::DuplicateIdentity(..))
    ));

    let mut zero = options(dir.path());
    zero.days = 0;
    assert!(matches!(init(&zero), Err(CertsError::NoValidity)));

    // A CA key without its certificate is not silently replaced.
    let half = tempfile::tempdir().unwrap();
    std::fs::write(half.path().join("ca.key"), "x").unwrap();
    let err = init(&options(half.path())).unwrap_err();
    assert!(matches!(err, CertsError::BadCa { .. }), "{err}");

    // A CA whose key does not match its certificate is refused.
    let mixed = tempfile::tempdir().unwrap();
    init(&options(mixed.path())).unwrap();
    std::fs::copy(
        mixed.path().join("front-proxy-ca.key"),
        mixed.path().join("ca.key"),
    )
    .unwrap();
    let err = init(&options(mixed.path())).unwrap_err();
    assert!(err.to_string().contains("does not belong"), "{err}");
}

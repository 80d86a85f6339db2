//! The differential suite: the same requests sent to `bulwark-sim` and to a real
//! kube-apiserver (built from its Go module, see `loadtest/controlplane/`), normalized and
//! compared. The real one decides: every difference is either fixed in the simulator or
//! listed, with its reason, under "Differences from kube-apiserver" in
//! `loadtest/sim/README.md`. A difference that is not listed fails the test, and so does a
//! listed one that no longer differs (the list stays true).
//!
//! The table of every case is written to `target/differential.md` for the curious.

mod cases;
mod normalize;
mod suite;

use std::collections::BTreeMap;
use std::sync::Arc;

use base64::Engine;
use bulwark_loadtest::controlplane::{ControlPlane, Options};
use bulwark_sim::{Fleet, SimConfig};

use suite::Endpoint;

/// The TLS of a kubeconfig: its CA and client certificate, offering HTTP/2.
fn endpoint_from_kubeconfig(path: &std::path::Path) -> Endpoint {
    let text = std::fs::read_to_string(path).expect("kubeconfig");
    let config: serde_json::Value = serde_norway::from_str(&text).expect("kubeconfig YAML");
    let field = |pointer: &str| -> Vec<u8> {
        let b64 = config
            .pointer(pointer)
            .and_then(|v| v.as_str())
            .unwrap_or_else(|| panic!("{} has no {pointer}", path.display()));
        base64::engine::general_purpose::STANDARD
            .decode(b64)
            .expect("base64")
    };
    let server = config
        .pointer("/clusters/0/cluster/server")
        .and_then(|v| v.as_str())
        .expect("server");
    let addr = server
        .trim_start_matches("https://")
        .parse()
        .expect("server is https://IP:PORT");
    let ca = field("/clusters/0/cluster/certificate-authority-data");
    let cert = field("/users/0/user/client-certificate-data");
    let key = field("/users/0/user/client-key-data");
    let mut roots = rustls::RootCertStore::empty();
    for der in rustls_pemfile::certs(&mut &ca[..]) {
        roots.add(der.expect("CA PEM")).expect("CA");
    }
    let chain = rustls_pemfile::certs(&mut &cert[..])
        .collect::<Result<Vec<_>, _>>()
        .expect("client certificate PEM");
    let key = rustls_pemfile::private_key(&mut &key[..])
        .expect("key PEM")
        .expect("a key");
    let mut tls = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("TLS versions")
    .with_root_certificates(roots)
    .with_client_auth_cert(chain, key)
    .expect("client certificate");
    tls.alpn_protocols = vec![b"h2".to_vec()];
    Endpoint { addr, tls }
}

/// The differences the simulator's README accepts: `- \`case-id\`: why` lines under its
/// "Differences from kube-apiserver" heading.
fn intended() -> BTreeMap<String, String> {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../sim/README.md"))
        .expect("loadtest/sim/README.md");
    let section = readme
        .split("## Differences from kube-apiserver")
        .nth(1)
        .expect("the simulator's README lists its differences");
    section
        .lines()
        .take_while(|l| !l.starts_with("## "))
        .filter_map(|l| {
            let rest = l.strip_prefix("- `")?;
            let (id, why) = rest.split_once("`:")?;
            Some((id.to_owned(), why.trim().to_owned()))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_simulator_answers_as_the_real_apiserver_does() {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut options = Options::new(dir.path());
    options.replicas = 1;
    options.bulwark_exe = Some(env!("CARGO_BIN_EXE_bulwark-loadtest").into());
    let control_plane = ControlPlane::start(options)
        .await
        .expect("the real control plane starts (loadtest/controlplane/build.sh builds it)");
    let real = endpoint_from_kubeconfig(&control_plane.kubeconfig("direct-admin"));

    let fleet = Fleet::start(SimConfig::default()).await.expect("simulator");
    let admin = fleet
        .pki()
        .client_ca
        .client_cert("admin", &["system:masters"]);
    let sim = Endpoint {
        addr: fleet.addrs()[0],
        tls: bulwark_sim::client::tls_config(fleet.pki(), Some(&admin), &[b"h2"]).expect("TLS"),
    };

    let cases = cases::all();
    let outcomes = suite::run(&real, &sim, &cases).await;
    let table = suite::table(&outcomes);
    let report = concat!(env!("CARGO_MANIFEST_DIR"), "/../../target/differential.md");
    let _ = std::fs::write(report, &table);
    let details: String = outcomes
        .iter()
        .filter(|o| o.difference.is_some())
        .map(|o| {
            format!(
                "## {}\n{}\nreal: {:?}\nsim:  {:?}\n\n",
                o.id, o.request, o.real, o.sim
            )
        })
        .collect();
    let _ = std::fs::write(
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../target/differential-details.txt"
        ),
        details,
    );

    let intended = intended();
    let differing: BTreeMap<&str, &str> = outcomes
        .iter()
        .filter_map(|o| Some((o.id, o.difference.as_deref()?)))
        .collect();
    let unexplained: Vec<String> = differing
        .iter()
        .filter(|(id, _)| !intended.contains_key(**id))
        .map(|(id, d)| format!("{id}: {d}"))
        .collect();
    let stale: Vec<&String> = intended
        .keys()
        .filter(|id| !differing.contains_key(id.as_str()))
        .collect();
    println!(
        "differential: {} requests, {} differ ({} listed as intended)\n{table}",
        outcomes.len(),
        differing.len(),
        differing.len() - unexplained.len()
    );
    assert!(outcomes.len() >= 60, "the suite sends at least 60 requests");
    assert!(
        unexplained.is_empty(),
        "differences neither fixed nor listed in loadtest/sim/README.md:\n{}",
        unexplained.join("\n")
    );
    assert!(
        stale.is_empty(),
        "listed as differences but answered alike now (remove them from the README): {stale:?}"
    );
    control_plane.stop().await.expect("stop");
}

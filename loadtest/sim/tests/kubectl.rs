//! kubectl against the fleet: typed creates (protobuf bodies), server-side tables,
//! `auth can-i`/`whoami`, exec over WebSocket, namespaces, `apply` validated against the
//! served OpenAPI, `diff` and server-side dry runs. Skipped when no kubectl is on PATH.

use std::path::PathBuf;
use std::process::Stdio;

use bulwark_sim::{Fleet, SimConfig};
use tokio::io::AsyncWriteExt;
use tokio::process::Command;

fn kubectl_path() -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join("kubectl"))
            .find(|f| f.is_file())
    })
}

struct Kubectl {
    bin: PathBuf,
    kubeconfig: PathBuf,
}

impl Kubectl {
    async fn run(&self, args: &[&str], stdin: Option<&str>) -> (bool, String) {
        let mut child = Command::new(&self.bin)
            .args(args)
            .env("KUBECONFIG", &self.kubeconfig)
            .stdin(if stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        if let Some(input) = stdin {
            let mut si = child.stdin.take().unwrap();
            si.write_all(input.as_bytes()).await.unwrap();
        }
        let out =
            tokio::time::timeout(std::time::Duration::from_secs(20), child.wait_with_output())
                .await
                .unwrap()
                .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), text)
    }
}

#[tokio::test]
async fn kubectl_works_against_the_sim() {
    let Some(bin) = kubectl_path() else {
        eprintln!("kubectl not found on PATH; skipping");
        return;
    };
    let fleet = Fleet::start(SimConfig {
        seed: vec!["secrets=3x256B@a".parse().unwrap()],
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let dir = std::env::temp_dir().join(format!("bulwark-sim-kubectl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let admin = fleet
        .pki()
        .client_ca
        .client_cert("admin", &["system:masters"]);
    let kubeconfig = dir.join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        bulwark_sim::client::kubeconfig(
            fleet.pki(),
            &format!("https://{}", fleet.addrs()[0]),
            &admin,
        ),
    )
    .unwrap();
    let k = Kubectl { bin, kubeconfig };

    let (ok, out) = k.run(&["get", "secrets", "-n", "a"], None).await;
    assert!(ok, "{out}");
    assert!(
        out.contains("NAME")
            && out.contains("TYPE")
            && out.contains("secret-0")
            && out.contains("Opaque"),
        "{out}"
    );
    let (ok, out) = k
        .run(
            &[
                "create",
                "configmap",
                "cm1",
                "-n",
                "a",
                "--from-literal=k=v",
            ],
            None,
        )
        .await;
    assert!(ok, "{out}");
    assert_eq!(
        fleet.store().get("configmaps", "a", "cm1").unwrap()["data"]["k"],
        "v"
    );
    let (ok, out) = k
        .run(
            &[
                "create",
                "secret",
                "generic",
                "s1",
                "-n",
                "a",
                "--from-literal=p=q",
            ],
            None,
        )
        .await;
    assert!(ok, "{out}");
    assert_eq!(
        fleet.store().get("secrets", "a", "s1").unwrap()["type"],
        "Opaque"
    );
    let (ok, out) = k.run(&["create", "namespace", "team"], None).await;
    assert!(ok, "{out}");
    let (ok, out) = k.run(&["get", "namespace", "team"], None).await;
    assert!(ok && out.contains("Active"), "{out}");
    let (ok, out) = k
        .run(&["label", "configmap", "cm1", "-n", "a", "x=y"], None)
        .await;
    assert!(ok, "{out}");
    let (ok, out) = k
        .run(&["get", "cm", "-n", "a", "-l", "x=y", "-o", "name"], None)
        .await;
    assert!(ok && out.trim() == "configmap/cm1", "{out}");
    let (ok, out) = k.run(&["auth", "can-i", "delete", "secrets"], None).await;
    assert!(ok && out.trim() == "yes", "{out}");
    let (_, out) = k.run(&["auth", "whoami"], None).await;
    assert!(
        out.contains("admin") && out.contains("system:masters"),
        "{out}"
    );
    let pod = r#"{"apiVersion":"v1","kind":"Pod","metadata":{"name":"p","namespace":"a"},"spec":{"containers":[{"name":"c","image":"i"}]}}"#;
    let (ok, out) = k.run(&["apply", "-f", "-"], Some(pod)).await;
    assert!(ok, "{out}");
    let (ok, out) = k
        .run(
            &["exec", "-i", "-n", "a", "p", "--", "cat"],
            Some("hello exec\n"),
        )
        .await;
    assert!(ok && out.contains("hello exec"), "{out}");
    let (ok, out) = k.run(&["delete", "namespace", "team"], None).await;
    assert!(ok, "{out}");
    let (ok, out) = k
        .run(&["delete", "configmap", "cm1", "-n", "a"], None)
        .await;
    assert!(ok, "{out}");
    assert!(fleet.store().get("configmaps", "a", "cm1").is_none());
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn kubectl_diff_and_server_dry_runs_change_nothing() {
    let Some(bin) = kubectl_path() else {
        eprintln!("kubectl not found on PATH; skipping");
        return;
    };
    let fleet = Fleet::start(SimConfig::default()).await.unwrap();
    let dir = std::env::temp_dir().join(format!("bulwark-sim-kubectl-dry-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let admin = fleet
        .pki()
        .client_ca
        .client_cert("admin", &["system:masters"]);
    let kubeconfig = dir.join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        bulwark_sim::client::kubeconfig(
            fleet.pki(),
            &format!("https://{}", fleet.addrs()[0]),
            &admin,
        ),
    )
    .unwrap();
    let k = Kubectl { bin, kubeconfig };
    let manifest = |value: &str| {
        format!(
            "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: settings\n  namespace: a\ndata:\n  k: {value}\n"
        )
    };
    // Validated against the served OpenAPI (no --validate=false).
    let (ok, out) = k.run(&["apply", "-f", "-"], Some(&manifest("v1"))).await;
    assert!(ok && out.contains("configmap/settings created"), "{out}");
    let store = fleet.store();
    let stored = store.get("configmaps", "a", "settings").unwrap();
    let rv = store.resource_version();

    // diff: exit status 1 and the change shown, nothing written.
    let (ok, out) = k.run(&["diff", "-f", "-"], Some(&manifest("v2"))).await;
    assert!(
        !ok && out.contains("-  k: v1") && out.contains("+  k: v2"),
        "{out}"
    );
    let (ok, out) = k
        .run(
            &["apply", "--dry-run=server", "-f", "-"],
            Some(&manifest("v2")),
        )
        .await;
    assert!(ok && out.contains("configured (server dry run)"), "{out}");
    let (ok, out) = k
        .run(
            &["apply", "--dry-run=server", "-f", "-"],
            Some(&manifest("v2").replace("settings", "other")),
        )
        .await;
    assert!(ok && out.contains("created (server dry run)"), "{out}");
    let (ok, out) = k
        .run(
            &[
                "delete",
                "--dry-run=server",
                "configmap",
                "settings",
                "-n",
                "a",
            ],
            None,
        )
        .await;
    assert!(ok && out.contains("deleted (server dry run)"), "{out}");
    assert_eq!(store.get("configmaps", "a", "settings").unwrap(), stored);
    assert!(store.get("configmaps", "a", "other").is_none());
    assert_eq!(store.resource_version(), rv);

    // And the real apply changes what the diff showed.
    let (ok, out) = k.run(&["apply", "-f", "-"], Some(&manifest("v2"))).await;
    assert!(ok && out.contains("configured"), "{out}");
    assert_eq!(
        store.get("configmaps", "a", "settings").unwrap()["data"]["k"],
        "v2"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

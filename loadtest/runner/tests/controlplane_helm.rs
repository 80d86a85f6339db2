//! `helm install` of the chart into a real kube-apiserver, as `deploy/README.md` says to
//! (the namespace created and labelled first, the chart's own Namespace off): every object
//! is created and accepted server-side (the FlowSchema and PriorityLevelConfiguration,
//! RBAC, the DaemonSet), the admin token Secret is generated and kept by `helm upgrade`,
//! a misspelt value (`apiserver:`) is refused by the values schema before anything is
//! created, and `helm uninstall` removes what it installed. Needs the binaries
//! `loadtest/controlplane/build.sh` builds (Go 1.26), or fails: this test never skips.

use std::path::Path;
use std::process::Output;

use bulwark_loadtest::controlplane::{ControlPlane, Options};

fn repo_root() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Runs the control plane's helm against the admin kubeconfig, with its state in `home`.
async fn helm(cp: &ControlPlane, home: &Path, args: &[&str]) -> (bool, String) {
    let out: Output = tokio::process::Command::new(cp.binaries().dir().join("helm"))
        .args(args)
        .arg("--kubeconfig")
        .arg(cp.kubeconfig("direct-admin"))
        .env("HELM_CACHE_HOME", home.join("cache"))
        .env("HELM_CONFIG_HOME", home.join("config"))
        .env("HELM_DATA_HOME", home.join("data"))
        .output()
        .await
        .expect("helm runs");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

async fn kubectl(cp: &ControlPlane, args: &[&str]) -> String {
    let (ok, text) = cp
        .kubectl("direct-admin", args)
        .await
        .expect("kubectl runs");
    assert!(ok, "kubectl {args:?}: {text}");
    text
}

// Over 120 lines: helm's steps as deploy/README.md gives them (install, read back server-
// side, a misspelt value, upgrade, uninstall), each on the release the last one left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chart_installs_into_a_real_control_plane_as_the_readme_says() {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = Options::new(dir.path().join("cp"));
    opts.replicas = 1;
    opts.bulwarks = 0;
    let cp = ControlPlane::start(opts)
        .await
        .unwrap_or_else(|e| panic!("the control plane did not start: {e}"));
    let chart = repo_root().join("deploy/helm/bulwark");
    let chart = chart.to_str().unwrap();
    let home = dir.path().join("helm");

    // The harness seeds Bulwark's RBAC and APF objects as deploy/ ships them, for the
    // Bulwarks it runs: a cluster Bulwark was never installed in has none.
    for kind in [
        "clusterrole",
        "clusterrolebinding",
        "flowschema",
        "prioritylevelconfiguration",
    ] {
        kubectl(&cp, &["delete", kind, "bulwark", "--ignore-not-found"]).await;
    }
    kubectl(&cp, &["create", "namespace", "bulwark"]).await;
    kubectl(
        &cp,
        &[
            "label",
            "namespace",
            "bulwark",
            "pod-security.kubernetes.io/enforce=privileged",
            "pod-security.kubernetes.io/warn=baseline",
        ],
    )
    .await;

    // A typo is refused by the schema, and nothing is created.
    let (ok, text) = helm(
        &cp,
        &home,
        &[
            "install",
            "bulwark",
            chart,
            "--namespace",
            "bulwark",
            "--set",
            "namespace.create=false",
            "--set",
            "apiserver=10.0.0.1",
        ],
    )
    .await;
    assert!(!ok, "a misspelt value installs: {text}");
    assert!(
        text.contains("apiserver"),
        "the error names the key: {text}"
    );
    let listed = kubectl(&cp, &["get", "daemonsets", "-n", "bulwark", "-o", "name"]).await;
    assert!(listed.trim().is_empty(), "nothing was created: {listed}");

    let (ok, text) = helm(
        &cp,
        &home,
        &[
            "install",
            "bulwark",
            chart,
            "--namespace",
            "bulwark",
            "--set",
            "namespace.create=false",
            "--set",
            "admin.tokenSecret.create=true",
        ],
    )
    .await;
    assert!(ok, "helm install: {text}");
    for (kind, name, namespaced) in [
        ("daemonset", "bulwark", true),
        ("configmap", "bulwark-config", true),
        ("configmap", "bulwark-rules", true),
        ("serviceaccount", "bulwark", true),
        ("service", "bulwark-metrics", true),
        ("poddisruptionbudget", "bulwark", true),
        ("role", "bulwark-fleet", true),
        ("rolebinding", "bulwark-fleet", true),
        ("secret", "bulwark-admin-token", true),
        ("clusterrole", "bulwark", false),
        ("clusterrolebinding", "bulwark", false),
        ("flowschema", "bulwark", false),
        ("prioritylevelconfiguration", "bulwark", false),
    ] {
        let mut args = vec![
            "get",
            kind,
            name,
            "-o",
            "jsonpath={.metadata.labels.app\\.kubernetes\\.io/managed-by}",
        ];
        if namespaced {
            args.extend(["-n", "bulwark"]);
        }
        let managed = kubectl(&cp, &args).await;
        assert_eq!(managed, "Helm", "{kind}/{name} is the release's");
    }
    // The rules ConfigMap holds the shipped folder, file for file.
    let rules = kubectl(
        &cp,
        &[
            "get",
            "configmap",
            "bulwark-rules",
            "-n",
            "bulwark",
            "-o",
            "json",
        ],
    )
    .await;
    let rules: serde_json::Value = serde_json::from_str(&rules).unwrap();
    let shipped = repo_root().join("deploy/base/rules");
    for entry in std::fs::read_dir(&shipped).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap();
        assert_eq!(
            rules["data"][name].as_str(),
            Some(std::fs::read_to_string(&path).unwrap().as_str()),
            "{name}"
        );
    }

    // The generated admin token survives an upgrade.
    let token = || async {
        kubectl(
            &cp,
            &[
                "get",
                "secret",
                "bulwark-admin-token",
                "-n",
                "bulwark",
                "-o",
                "jsonpath={.data.token}",
            ],
        )
        .await
    };
    let before = token().await;
    assert!(before.len() > 20, "a token was generated: {before:?}");
    let (ok, text) = helm(
        &cp,
        &home,
        &[
            "upgrade",
            "bulwark",
            chart,
            "--namespace",
            "bulwark",
            "--reuse-values",
        ],
    )
    .await;
    assert!(ok, "helm upgrade: {text}");
    assert_eq!(token().await, before, "helm upgrade keeps the admin token");

    let (ok, text) = helm(
        &cp,
        &home,
        &["uninstall", "bulwark", "--namespace", "bulwark"],
    )
    .await;
    assert!(ok, "helm uninstall: {text}");
    let (found, text) = cp
        .kubectl("direct-admin", &["get", "flowschema", "bulwark"])
        .await
        .unwrap();
    assert!(!found && text.contains("NotFound"), "uninstalled: {text}");
    cp.stop().await.unwrap();
}

//! The operator's command line against a fleet of three real `bulwark serve` processes, as
//! deployed (admin listener on every address, HTTPS, the admin token): `bulwark flows`,
//! `levels` and `fleet` find the members through the Leases with a kubeconfig, read each
//! one's admin listener, and print what an on-call reads; a stopped member is a row saying
//! it is unreachable, and a wrong token says which credential is missing.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

use bulwark_sim::{Fleet, Pki};
use bulwark_testkit::{
    ALICE_LISTS_RULES, BulwarkConfig, Client, Credentials, Names, OWN_USER, Setup, free_addr,
    free_port, grant, policy, start_fleet,
};
use serde_json::Value;

const TOKEN: &str = "on-call-admin-token";

/// One member: its process, client address and admin port.
struct Member {
    process: tokio::process::Child,
    listen: SocketAddr,
}

/// `bulwark serve` named `identity` in a fleet of three, its admin listener on every
/// address with HTTPS and the admin token, publishing 127.0.0.1 as its pod's address.
async fn member(fleet: &Fleet, pki: &Pki, dir: &Path, identity: &str) -> Member {
    let dir = dir.join(identity);
    let credentials = Credentials::mint(&dir, pki, &pki.server_ca, Names::default())
        .expect("certificates written");
    let rules = dir.join("rules");
    std::fs::create_dir_all(&rules).expect("rules folder");
    std::fs::write(rules.join("test.yaml"), ALICE_LISTS_RULES).expect("rules written");
    let token = dir.join("admin-token");
    std::fs::write(&token, format!("{TOKEN}\n")).expect("token written");
    let (cert, key) = credentials.serving.clone();
    let mut config = BulwarkConfig::new(credentials, fleet.addrs())
        .set("upstream.bulwarkReplicas", "3")
        .set(
            "fleet",
            &format!(
                "{{namespace: bulwark, identity: {identity}, renewInterval: 200ms, leaseDuration: 30s}}"
            ),
        )
        .set(
            "admin.tls",
            &format!("{{cert: {}, key: {}}}", cert.display(), key.display()),
        )
        .set("admin.tokenFile", &token.display().to_string());
    config.cache = false;
    config.rules = Some(rules);
    config.listen = free_addr();
    config.admin = SocketAddr::from(([0, 0, 0, 0], free_port()));
    let path = dir.join("bulwark.yaml");
    config.write(&path).expect("config written");
    let process = tokio::process::Command::new(env!("CARGO_BIN_EXE_bulwark"))
        .args(["serve", "--config"])
        .arg(&path)
        .env("POD_IP", "127.0.0.1")
        .kill_on_drop(true)
        .spawn()
        .expect("bulwark starts");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while tokio::net::TcpStream::connect(config.listen).await.is_err() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{identity} never listened"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Member {
        process,
        listen: config.listen,
    }
}

/// The on-call's files: a kubeconfig for `carol` (who may list Leases) at the apiserver,
/// the admin token, a wrong token, and the CA of the admin listeners' certificates.
struct OnCall {
    kubeconfig: PathBuf,
    token: PathBuf,
    wrong_token: PathBuf,
    admin_ca: PathBuf,
}

impl OnCall {
    fn new(fleet: &Fleet, pki: &Pki, dir: &Path) -> OnCall {
        let cert = pki.client_ca.client_cert("carol", &[]);
        let server = format!("https://{}", fleet.addrs()[0]);
        let kubeconfig = dir.join("kubeconfig");
        std::fs::write(
            &kubeconfig,
            bulwark_sim::client::kubeconfig(pki, &server, &cert),
        )
        .unwrap();
        let token = dir.join("token");
        std::fs::write(&token, TOKEN).unwrap();
        let wrong_token = dir.join("wrong-token");
        std::fs::write(&wrong_token, "not-the-token").unwrap();
        let admin_ca = dir.join("admin-ca.crt");
        std::fs::write(&admin_ca, pki.server_ca.cert_pem()).unwrap();
        OnCall {
            kubeconfig,
            token,
            wrong_token,
            admin_ca,
        }
    }

    /// `bulwark ARGS` reading the fleet with the kubeconfig and the admin token.
    async fn fleet(&self, args: &[&str]) -> Output {
        let mut all: Vec<&str> = args.to_vec();
        let (kubeconfig, token, ca) = (
            self.kubeconfig.to_str().unwrap(),
            self.token.to_str().unwrap(),
            self.admin_ca.to_str().unwrap(),
        );
        all.extend([
            "--kubeconfig",
            kubeconfig,
            "--admin-token-file",
            token,
            "--admin-ca",
            ca,
        ]);
        bulwark(&all).await
    }
}

async fn bulwark(args: &[&str]) -> Output {
    tokio::process::Command::new(env!("CARGO_BIN_EXE_bulwark"))
        .args(args)
        .env_remove("KUBECONFIG")
        .env_remove("BULWARK_ADMIN_TOKEN_FILE")
        .env_remove("BULWARK_ADMIN_CA")
        .output()
        .await
        .expect("bulwark runs")
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// The cells of the table's row whose first cell is `first`.
fn row<'a>(table: &'a str, first: &str) -> Vec<&'a str> {
    table
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|cells| cells.first() == Some(&first))
        .unwrap_or_else(|| panic!("no row {first}:\n{table}"))
}

// Over 120 lines: the on-call's commands in a runbook's order against one fleet, then again
// with a member stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_on_call_reads_a_three_replica_fleet_and_sees_a_stopped_member_unreachable() {
    let mut rules = policy();
    rules.rules.push(grant(
        &[OWN_USER],
        &[],
        &["create", "update"],
        &["leases.coordination.k8s.io"],
    ));
    let (fleet, pki) = start_fleet(&Setup {
        replicas: 1,
        seed: vec!["configmaps=3x1KiB@team"],
        policy: rules,
        ..Setup::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let mut members = Vec::new();
    for identity in ["a", "b", "c"] {
        members.push(member(&fleet, &pki, dir.path(), identity).await);
    }
    let on_call = OnCall::new(&fleet, &pki, dir.path());

    // Every member renews its Lease and sees the others.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let fleet_table = loop {
        let output = on_call.fleet(&["fleet"]).await;
        let table = stdout(&output);
        let all_shared = ["a", "b", "c"].iter().all(|name| {
            table
                .lines()
                .any(|l| l.split_whitespace().collect::<Vec<_>>()[..3] == [*name, "shared", "3"])
        });
        if output.status.success() && all_shared {
            break table;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the fleet never showed three members:\n{table}{}",
            stderr(&output)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(
        fleet_table.starts_with("NAME   STANDING   MEMBERS   RENEWED"),
        "{fleet_table}"
    );

    // alice lists configmaps through member a.
    let alice = pki.client_ca.client_cert("alice", &["dev"]);
    let mut client = Client::connect(members[0].listen, &pki, Some(&alice)).await;
    for _ in 0..5 {
        let answer = client.get("/api/v1/namespaces/team/configmaps").await;
        assert_eq!(answer.status, 200, "{}", answer.text());
    }

    let flows = on_call.fleet(&["flows"]).await;
    assert!(flows.status.success(), "{}", stderr(&flows));
    let table = stdout(&flows);
    eprintln!("$ bulwark fleet\n{fleet_table}\n$ bulwark flows\n{table}");
    let header: Vec<&str> = table.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(
        header,
        [
            "REPLICA",
            "FLOW",
            "RULE",
            "LEVEL",
            "REQUESTS/S",
            "REFUSED/S",
            "WAIT"
        ]
    );
    assert_eq!(
        row(&table, "a")[1..4],
        ["alice", "alice", "lists"],
        "{table}"
    );
    assert!(
        !table
            .lines()
            .any(|l| l.starts_with("b ") && l.contains("alice")),
        "alice went through a only:\n{table}"
    );

    let json = on_call.fleet(&["flows", "-o", "json"]).await;
    assert!(json.status.success(), "{}", stderr(&json));
    let document: Value = serde_json::from_slice(&json.stdout).expect("-o json is JSON");
    let items = document["items"].as_array().expect("items");
    let replicas: Vec<&str> = items.iter().filter_map(|i| i["replica"].as_str()).collect();
    assert_eq!(replicas, ["a", "b", "c"]);
    for item in items {
        assert!(item["flows"].is_object(), "{item}");
        assert!(
            item["admin"]
                .as_str()
                .is_some_and(|a| a.starts_with("https://127.0.0.1:")),
            "{item}"
        );
    }
    let busiest = items[0]["flows"]["busiest"].as_array().unwrap();
    assert!(
        busiest
            .iter()
            .any(|f| f["identity"] == "alice" && f["rule"] == "alice"),
        "{document}"
    );

    let yaml = on_call.fleet(&["levels", "-o", "yaml"]).await;
    assert!(yaml.status.success(), "{}", stderr(&yaml));
    let document: Value = serde_norway::from_slice(&yaml.stdout).expect("-o yaml is YAML");
    let lists = document["items"][1]["levels"]["levels"]
        .as_array()
        .and_then(|l| l.iter().find(|l| l["name"] == "lists"))
        .unwrap_or_else(|| panic!("b's lists level: {document:?}"));
    assert_eq!(lists["seats"], 10);

    // One replica's admin listener with a wrong token, then with none.
    let a_admin = items[0]["admin"].as_str().unwrap().to_owned();
    let ca = on_call.admin_ca.to_str().unwrap();
    let wrong = bulwark(&[
        "flows",
        "--replica",
        &a_admin,
        "--admin-ca",
        ca,
        "--admin-token-file",
        on_call.wrong_token.to_str().unwrap(),
    ])
    .await;
    assert!(!wrong.status.success());
    assert!(
        stderr(&wrong).contains(&format!(
            "bulwark: {a_admin}: 403 Forbidden: the admin token was refused"
        )),
        "{}",
        stderr(&wrong)
    );
    let none = bulwark(&["flows", "--replica", &a_admin, "--admin-ca", ca]).await;
    assert!(
        stderr(&none).contains("/debug/* needs the admin token: pass --admin-token-file"),
        "{}",
        stderr(&none)
    );

    // c stops; its Lease still counts, and its row says it cannot be reached.
    members[2].process.kill().await.unwrap();
    let after = on_call.fleet(&["fleet"]).await;
    eprintln!("$ bulwark fleet (c killed)\n{}", stdout(&after));
    assert!(
        !after.status.success(),
        "a member could not be read: exit 1"
    );
    let table = stdout(&after);
    assert_eq!(row(&table, "a")[1], "shared", "{table}");
    let c = table.lines().find(|l| l.starts_with("c ")).unwrap();
    assert!(c.contains("unreachable: "), "{table}");
}

#[tokio::test]
async fn installed_as_kubectl_bulwark_it_is_the_kubectl_plugin() {
    let dir = tempfile::tempdir().unwrap();
    let plugin = dir.path().join("kubectl-bulwark");
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_bulwark"), &plugin).unwrap();
    let output = tokio::process::Command::new(&plugin)
        .args(["flows", "--help"])
        .output()
        .await
        .unwrap();
    assert!(output.status.success());
    let help = stdout(&output);
    assert!(help.contains("Usage: kubectl bulwark flows"), "{help}");
    let output = tokio::process::Command::new(&plugin)
        .args(["flows", "--kubeconfig", "/nonexistent/kubeconfig"])
        .output()
        .await
        .unwrap();
    assert_eq!(output.status.code(), Some(1));
    assert_eq!(
        stderr(&output),
        "bulwark: /nonexistent/kubeconfig: No such file or directory (os error 2)\n"
    );
    let output = bulwark(&[
        "levels",
        "--replica",
        "127.0.0.1:1",
        "--interval",
        "0s",
        "-w",
    ])
    .await;
    assert_eq!(output.status.code(), Some(1));
    assert_eq!(
        stderr(&output),
        "bulwark: --interval and --request-timeout must be longer than zero\n"
    );
}

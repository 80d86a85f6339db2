//! The runbooks (`docs/runbooks.md`) as the on-call runs them: every `sh` block, as written,
//! in `bash` with `curl`, `jq`, `openssl` and `kubectl`, against a Bulwark in the shape
//! `deploy/base` installs — its configuration (HTTPS admin port on every address, the admin
//! token, `/metrics` for authorized callers, the PROXY protocol required from the balancer,
//! the access log), its rules, the DaemonSet's arguments — over the simulated apiservers,
//! which also hold the Secrets, the rules' ConfigMap, the pod and the fleet's Leases that
//! `kubectl` reads. The test puts its own addresses in for the nodes, `localhost` for the
//! serving certificate's name and its admin port for 9443, and each command must exit 0
//! and show what its comment says (`shows \`TEXT\``). `kubectl logs` of Bulwark's pods is
//! the log of the process under test; blocks after `<!-- not run: REASON -->` need a real
//! cluster and are only parsed. Without `kubectl` (built by `loadtest/controlplane/build.sh`;
//! `BULWARK_CONTROLPLANE_BIN` makes it required), `jq`, `curl` or `openssl` the test reports
//! itself skipped (`bulwark_testkit::tools`; CI installs them and requires them). `BULWARK_TRACE_RUNBOOKS=1` prints every command
//! with its output.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bulwark_sim::{CertKey, Fleet, Pki, StaticToken};
use bulwark_testkit::{Client, FRONT_PROXY_CN, GOOD_TOKEN, OWN_GROUP, OWN_USER, grant};
use serde::Deserialize;
use serde_json::{Value, json};

use bulwark_testkit::repo_path as repo;

/// The admin token the Secret holds.
const ADMIN_TOKEN: &str = "runbook-admin-token-7f3a9c";
/// Bulwark's ServiceAccount token, as the kubelet mounts it.
const SERVICE_ACCOUNT_TOKEN: &str = "bulwark-service-account-token";
/// The pod the DaemonSet runs on the node.
const POD: &str = "bulwark-7xk2p";
/// The shipped rule that refuses here: cluster-wide LISTs of Secrets, 1 a second.
const REFUSING_RULE: &str = "cluster-wide-secret-lists";
/// A rule on trial beside the shipped ones, in shadow mode.
const SHADOW_RULE: &str = "trial-configmap-reads";

/// One command of a block: its text (lines joined as written) and what it must show.
#[derive(Debug, Clone)]
struct Command {
    text: String,
    shows: Option<String>,
}

/// A fenced `sh` block and the section it is in (`""` before the first alert).
#[derive(Debug)]
struct Block {
    section: String,
    commands: Vec<Command>,
    /// Why it is not run, for a block marked `<!-- not run: REASON -->`.
    not_run: Option<String>,
}

/// The `sh` blocks of a runbook file.
fn blocks(markdown: &str) -> Vec<Block> {
    let mut out = Vec::new();
    let mut section = String::new();
    let mut not_run = None;
    let mut lines = markdown.lines();
    while let Some(line) = lines.next() {
        if let Some(title) = line.strip_prefix("## ") {
            section = title.trim().to_string();
        } else if let Some(reason) = line
            .strip_prefix("<!-- not run:")
            .and_then(|r| r.strip_suffix("-->"))
        {
            not_run = Some(reason.trim().to_string());
        } else if line.trim_end() == "```sh" {
            let body: Vec<&str> = lines
                .by_ref()
                .take_while(|l| l.trim_end() != "```")
                .collect();
            out.push(Block {
                section: section.clone(),
                commands: commands(&body),
                not_run: not_run.take(),
            });
        } else if line.starts_with("```") {
            // Another language's block: skipped whole, it holds no marks.
            lines.by_ref().take_while(|l| l.trim_end() != "```").count();
            not_run = None;
        }
    }
    out
}

/// A block's lines as commands: a command goes on over indented lines, lines after one
/// ending in `\`, and the line closing a function or loop.
fn commands(lines: &[&str]) -> Vec<Command> {
    let mut out: Vec<Vec<&str>> = Vec::new();
    for line in lines.iter().filter(|l| !l.trim().is_empty()) {
        let goes_on = out.last().is_some_and(|c| {
            c.last().unwrap().ends_with('\\')
                || line.starts_with([' ', '\t'])
                || ["}", "done", "fi"].contains(&line.split_whitespace().next().unwrap_or(""))
        });
        match out.last_mut() {
            Some(command) if goes_on => command.push(line),
            _ => out.push(vec![line]),
        }
    }
    out.into_iter()
        .map(|lines| {
            let text = lines.join("\n");
            let shows = text
                .split_once("shows `")
                .and_then(|(_, rest)| rest.split_once('`'))
                .map(|(shown, _)| shown.to_string());
            Command { text, shows }
        })
        .collect()
}

/// `text` with the whole word `word` (not part of a longer name) replaced by `with`.
fn replace_word(text: &str, word: &str, with: &str) -> String {
    let is_name = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find(word) {
        let before = rest[..at].chars().next_back();
        let after = rest[at + word.len()..].chars().next();
        out.push_str(&rest[..at]);
        if before.is_some_and(is_name) || after.is_some_and(is_name) {
            out.push_str(word);
        } else {
            out.push_str(with);
        }
        rest = &rest[at + word.len()..];
    }
    out.push_str(rest);
    out
}

/// What the test puts in for the runbooks' placeholders.
struct Places {
    admin_port: u16,
    logs: PathBuf,
}

impl Places {
    /// `text` (a command, or what it shows) as it runs here, in `section`.
    fn apply(&self, text: &str, section: &str) -> String {
        let mut text = text.to_string();
        for node in ["10.0.0.11", "10.0.0.12", "10.0.0.13"] {
            text = text.replace(node, "127.0.0.1");
        }
        text = text.replace("bulwark.example.com", "localhost");
        text = text.replace("9443", &self.admin_port.to_string());
        text = text.replace(
            "/var/lib/kubelet/pods/*/volumes/kubernetes.io~empty-dir/audit",
            self.logs.to_str().unwrap(),
        );
        let rule = if section == "BulwarkShadowRejections" {
            SHADOW_RULE
        } else {
            REFUSING_RULE
        };
        text = replace_word(&text, "RULE", rule);
        text = replace_word(&text, "LEVEL", "list-heavy");
        replace_word(&text, "RESOURCE", "secrets")
    }
}

/// The folder holding `kubectl`: `BULWARK_CONTROLPLANE_BIN` (then it must be there), else
/// `target/controlplane/bin`, else `PATH`.
fn kubectl() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("BULWARK_CONTROLPLANE_BIN") {
        let kubectl = PathBuf::from(dir).join("kubectl");
        assert!(kubectl.is_file(), "{} is missing", kubectl.display());
        return Some(kubectl);
    }
    let built = repo("target/controlplane/bin/kubectl");
    if built.is_file() {
        return Some(built);
    }
    let on_path = std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join("kubectl"))
            .find(|f| f.is_file())
    });
    if on_path.is_none() {
        bulwark_testkit::tools::skip(
            "kubectl is not built (run loadtest/controlplane/build.sh, or set BULWARK_CONTROLPLANE_BIN)",
        );
    }
    on_path
}

/// A Bulwark as `deploy/base` runs it, over the simulated apiservers.
struct Deployed {
    fleet: Fleet,
    pki: Arc<Pki>,
    listen: SocketAddr,
    admin: SocketAddr,
    root: PathBuf,
    log: PathBuf,
    _bulwark: tokio::process::Child,
}

fn write(path: &Path, text: &str) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, text).unwrap();
}

/// Every string of `v` that is an absolute path of the pod's (`/etc/bulwark/…`, `/var/…`),
/// moved under `root`.
fn under_root(v: &mut Value, root: &Path) {
    match v {
        Value::String(s) if s.starts_with("/etc/bulwark/") || s.starts_with("/var/") => {
            *s = root.join(&s[1..]).display().to_string();
        }
        Value::Array(a) => a.iter_mut().for_each(|v| under_root(v, root)),
        Value::Object(o) => o.values_mut().for_each(|v| under_root(v, root)),
        _ => {}
    }
}

fn yaml_file(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap();
    Value::deserialize(serde_norway::Deserializer::from_str(&text)).unwrap()
}

/// The files the DaemonSet mounts, from the Secrets and ConfigMaps it names, under `root`;
/// the rules ConfigMap's files (the shipped rules and one on trial in shadow mode).
fn write_mounted_files(root: &Path, pki: &Pki, serving: &CertKey) -> BTreeMap<String, String> {
    let front_proxy = pki.front_proxy_ca.client_cert(FRONT_PROXY_CN, &[]);
    let files: [(&str, &str); 9] = [
        ("etc/bulwark/pki/serving/tls.crt", &serving.cert_pem),
        ("etc/bulwark/pki/serving/tls.key", &serving.key_pem),
        ("etc/bulwark/pki/front-proxy/tls.crt", &front_proxy.cert_pem),
        ("etc/bulwark/pki/front-proxy/tls.key", &front_proxy.key_pem),
        (
            "etc/bulwark/pki/client-ca/ca.crt",
            &pki.client_ca.cert_pem(),
        ),
        ("etc/bulwark/admin/token", ADMIN_TOKEN),
        (
            "var/run/secrets/kubernetes.io/serviceaccount/ca.crt",
            &pki.server_ca.cert_pem(),
        ),
        (
            "var/run/secrets/kubernetes.io/serviceaccount/token",
            SERVICE_ACCOUNT_TOKEN,
        ),
        ("var/lib/bulwark/.keep", ""),
    ];
    for (path, text) in files {
        write(&root.join(path), text);
    }
    std::fs::create_dir_all(root.join("var/log/bulwark")).unwrap();
    let mut rules = BTreeMap::new();
    for entry in std::fs::read_dir(repo("deploy/base/rules")).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        rules.insert(name, std::fs::read_to_string(&path).unwrap());
    }
    rules.insert(
        "trial.yaml".into(),
        format!(
            "rules:\n  - name: {SHADOW_RULE}\n    precedence: 50\n    mode: shadow\n    \
             match:\n      users: [dave]\n    level: workload-low\n    flow: user\n    \
             rate: {{qps: 1, burst: 1}}\n"
        ),
    );
    for (name, text) in &rules {
        write(&root.join("etc/bulwark/rules").join(name), text);
    }
    rules
}

/// What kubectl reads from the cluster: the Secrets and ConfigMap the DaemonSet names,
/// and its pod.
fn seed_what_kubectl_reads(
    store: &bulwark_sim::Store,
    pki: &Pki,
    serving: &CertKey,
    rules: &BTreeMap<String, String>,
) {
    let b64 = |s: &str| {
        use base64::Engine as _;
        base64::engine::general_purpose::STANDARD.encode(s)
    };
    for (name, data) in [
        (
            "bulwark-serving-ca",
            json!({"ca.crt": b64(&pki.server_ca.cert_pem())}),
        ),
        ("bulwark-admin-token", json!({"token": b64(ADMIN_TOKEN)})),
        (
            "bulwark-serving",
            json!({"tls.crt": b64(&serving.cert_pem), "tls.key": b64(&serving.key_pem)}),
        ),
    ] {
        store
            .create(
                "secrets",
                "bulwark",
                json!({"metadata": {"name": name}, "data": data}),
            )
            .unwrap();
    }
    store
        .create(
            "configmaps",
            "bulwark",
            json!({"metadata": {"name": "bulwark-rules"}, "data": rules}),
        )
        .unwrap();
    store
        .create(
            "pods",
            "bulwark",
            json!({
                "metadata": {"name": POD, "labels": {"app.kubernetes.io/name": "bulwark"}},
                "spec": {"nodeName": "cp-1", "hostNetwork": true,
                         "containers": [{"name": "bulwark", "image": "bulwark"}]},
                "status": {"phase": "Running", "podIP": "127.0.0.1", "hostIP": "127.0.0.1"},
            }),
        )
        .unwrap();
}

/// The `bulwark` binary as the DaemonSet's container starts it (its arguments and
/// environment), with the configuration at `config_path` and its log in `log`.
fn spawn_as_the_daemonset(config_path: &Path, log: &Path) -> tokio::process::Child {
    // The DaemonSet's container: its arguments and environment.
    let daemonset = yaml_file(&repo("deploy/base/daemonset.yaml"));
    let container = &daemonset["spec"]["template"]["spec"]["containers"][0];
    let args: Vec<String> = container["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            let a = a.as_str().unwrap();
            if a == "/etc/bulwark/config/bulwark.yaml" {
                config_path.display().to_string()
            } else {
                a.to_string()
            }
        })
        .collect();
    let rust_log = container["env"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "RUST_LOG")
        .and_then(|e| e["value"].as_str())
        .unwrap()
        .to_string();
    tokio::process::Command::new(env!("CARGO_BIN_EXE_bulwark"))
        .args(&args)
        .env("RUST_LOG", rust_log)
        .env("POD_NAME", POD)
        .env("POD_IP", "127.0.0.1")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .kill_on_drop(true)
        .spawn()
        .unwrap()
}

/// Starts the simulated apiservers with what the runbooks read from the cluster, and the
/// `bulwark` binary as the DaemonSet starts it, files where the pod has them (under
/// `root`); waits until it is ready.
async fn deploy(root: &Path) -> Deployed {
    let pki = Arc::new(Pki::new());
    let mut policy = bulwark_testkit::policy();
    policy.rules.push(grant(
        &[OWN_USER],
        &[],
        &["get", "list", "watch", "create", "update"],
        &["leases.coordination.k8s.io"],
    ));
    policy.rules.push(grant(
        &["system:serviceaccount:bulwark:bulwark"],
        &[],
        &["get", "list", "watch"],
        &["*"],
    ));
    policy
        .rules
        .push(grant(&["dave"], &[], &["get", "list"], &["configmaps"]));
    let mut config = bulwark_testkit::fleet_config(pki.clone(), 2, policy);
    config.tokens.push(StaticToken {
        token: SERVICE_ACCOUNT_TOKEN.into(),
        user: OWN_USER.into(),
        uid: "bulwark-uid".into(),
        groups: vec![OWN_GROUP.into()],
        ..StaticToken::default()
    });
    config.seed = vec!["secrets=20x1KiB@team,other".parse().unwrap()];
    let fleet = Fleet::start(config).await.expect("simulator starts");

    let serving = pki.server_ca.server_cert(&bulwark_testkit::serving_names());
    let rules = write_mounted_files(root, &pki, &serving);

    // deploy/base/bulwark.yaml with this test's addresses, enforcing (as after the first
    // days) with one rule still on trial.
    let listen = bulwark_testkit::free_addr();
    let admin_port = bulwark_testkit::free_port();
    let mut shipped = yaml_file(&repo("deploy/base/bulwark.yaml"));
    under_root(&mut shipped, root);
    let replicas: Vec<String> = fleet.addrs().iter().map(ToString::to_string).collect();
    let text = bulwark_testkit::config::with_values(
        &serde_norway::to_string(&shipped).unwrap(),
        &[
            ("listen.address", &listen.to_string()),
            ("listen.workers", "1"),
            ("listen.proxyProtocol.trustedSources", "[127.0.0.1/32]"),
            ("admin.address", &format!("0.0.0.0:{admin_port}")),
            (
                "upstream.replicas",
                &serde_json::to_string(&replicas).unwrap(),
            ),
            ("rules.mode", "enforce"),
        ],
    );
    let config_path = root.join("etc/bulwark/config/bulwark.yaml");
    write(&config_path, &text);

    seed_what_kubectl_reads(fleet.store(), &pki, &serving, &rules);

    let log = root.join("bulwark.log");
    let bulwark = spawn_as_the_daemonset(&config_path, &log);
    let deployed = Deployed {
        fleet,
        pki,
        listen,
        admin: SocketAddr::from(([127, 0, 0, 1], admin_port)),
        root: root.to_path_buf(),
        log,
        _bulwark: bulwark,
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        if tokio::net::TcpStream::connect(deployed.admin).await.is_ok() {
            let mut probe = Client::connect(deployed.admin, &deployed.pki, None).await;
            if probe.get("/readyz").await.status == 200 {
                break;
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "bulwark never became ready:\n{}",
            std::fs::read_to_string(&deployed.log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    deployed
}

/// One client asking `path` five times a second from `from`, straight to Bulwark (only the
/// balancer's address must send the PROXY header), connecting again when Bulwark closes the
/// connection (the deployment sends GOAWAY at random, `listen.goawayChance`).
async fn keep_asking(
    addr: SocketAddr,
    from: [u8; 4],
    pki: Arc<Pki>,
    cert: Option<CertKey>,
    path: &'static str,
    token: Option<&'static str>,
) {
    loop {
        let connected = match bulwark_testkit::tcp_from(from.into(), addr).await {
            Ok(tcp) => Client::over(tcp, &pki, cert.as_ref()).await.ok(),
            Err(_) => None,
        };
        if let Some(mut client) = connected {
            loop {
                let mut request = bulwark_testkit::get(path);
                if let Some(token) = token {
                    request = bulwark_testkit::with_token(request, token);
                }
                if client.try_send(request).await.is_err() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Clients as the runbooks find them: carol LISTs every namespace's Secrets five times a
/// second (the shipped rule allows one), dave reads ConfigMaps under the rule on trial,
/// tina reads with her token.
fn traffic(deployed: &Deployed) -> tokio::task::JoinSet<()> {
    let (addr, pki) = (deployed.listen, &deployed.pki);
    let mut clients = tokio::task::JoinSet::new();
    let carol = pki.client_ca.client_cert("carol", &[]);
    let dave = pki.client_ca.client_cert("dave", &[]);
    clients.spawn(keep_asking(
        addr,
        [127, 0, 0, 2],
        pki.clone(),
        Some(carol),
        "/api/v1/secrets",
        None,
    ));
    clients.spawn(keep_asking(
        addr,
        [127, 0, 0, 3],
        pki.clone(),
        Some(dave),
        "/api/v1/namespaces/team/configmaps",
        None,
    ));
    clients.spawn(keep_asking(
        addr,
        [127, 0, 0, 4],
        pki.clone(),
        None,
        "/api/v1/namespaces/team/secrets",
        Some(GOOD_TOKEN),
    ));
    clients
}

/// Runs one section's commands after the setup block, each marked in the output; the
/// failures.
async fn run_section(
    setup: &[Command],
    section: &str,
    commands: &[Command],
    places: &Places,
    env: &[(&str, String)],
    work: &Path,
) -> Vec<String> {
    let mut script = String::from("set -eo pipefail\n");
    for command in setup {
        script.push_str(&places.apply(&command.text, ""));
        script.push('\n');
    }
    for (i, command) in commands.iter().enumerate() {
        // On a line of its own, after output that may not end in one.
        script.push_str(&format!("printf '\\n@@ {i}\\n'\n"));
        script.push_str(&places.apply(&command.text, section));
        script.push('\n');
    }
    script.push_str("printf '\\n@@ end\\n'\n");
    let run = tokio::process::Command::new("bash")
        .args(["--noprofile", "--norc", "-c", &script])
        .current_dir(work)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .unwrap_or_else(|_| panic!("{section}: the commands took over 2 minutes"))
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let mut outputs: BTreeMap<usize, String> = BTreeMap::new();
    let mut current = None;
    let mut ended = false;
    for line in stdout.lines() {
        if line == "@@ end" {
            ended = true;
        } else if let Some(i) = line.strip_prefix("@@ ").and_then(|i| i.parse().ok()) {
            current = Some(i);
            outputs.insert(i, String::new());
        } else if let Some(i) = current {
            let o = outputs.get_mut(&i).unwrap();
            o.push_str(line);
            o.push('\n');
        }
    }
    let mut failures = Vec::new();
    if !ended {
        let which = match current {
            Some(i) => format!("{:?}", places.apply(&commands[i].text, section)),
            None => "the setup".to_string(),
        };
        failures.push(format!(
            "{section}: {which} failed (exit {:?}):\n{}\n--- stderr:\n{stderr}",
            out.status.code(),
            current.map(|i| outputs[&i].as_str()).unwrap_or(""),
        ));
        return failures;
    }
    for (i, command) in commands.iter().enumerate() {
        if std::env::var_os("BULWARK_TRACE_RUNBOOKS").is_some() {
            eprintln!(
                "=== {section}: {}\n{}",
                places.apply(&command.text, section),
                outputs[&i]
            );
        }
        if let Some(shows) = &command.shows {
            let shows = places.apply(shows, section);
            if !outputs[&i].contains(&shows) {
                failures.push(format!(
                    "{section}: {:?} does not show {shows:?}:\n{}",
                    places.apply(&command.text, section),
                    outputs[&i]
                ));
            }
        }
    }
    failures
}

#[test]
fn runbook_blocks_are_split_into_commands_with_what_they_show() {
    let parsed = blocks(
        "intro\n```sh\nA=1\nf() {  # f: what\n  echo x \\\n    y\n}\nf  # shows `x y`\n```\n\
         ## Alert\n<!-- not run: needs a cluster -->\n```sh\nkubectl top pods\n```\n\
         ```promql\nup\n```\n```sh\nfor n in 1 2; do\n  echo $n\ndone  # shows `2`\n```\n",
    );
    assert_eq!(parsed.len(), 3);
    let texts = |b: &Block| {
        b.commands
            .iter()
            .map(|c| c.text.clone())
            .collect::<Vec<_>>()
    };
    assert_eq!(
        texts(&parsed[0]),
        [
            "A=1",
            "f() {  # f: what\n  echo x \\\n    y\n}",
            "f  # shows `x y`"
        ]
    );
    assert_eq!(parsed[0].commands[2].shows.as_deref(), Some("x y"));
    assert_eq!(parsed[1].section, "Alert");
    assert_eq!(parsed[1].not_run.as_deref(), Some("needs a cluster"));
    assert!(parsed[2].not_run.is_none());
    assert_eq!(parsed[2].commands.len(), 1);
    assert_eq!(parsed[2].commands[0].shows.as_deref(), Some("2"));
    assert_eq!(
        replace_word("RULE \"RULE\" RULES XRULE", "RULE", "r"),
        "r \"r\" RULES XRULE"
    );
}

// Over 120 lines: every runbook's blocks run in the document's order against one deployed
// Bulwark, each failure reported with its block.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_runbook_command_works_against_bulwark_as_deployed() {
    let Some(kubectl) = kubectl() else { return };
    if bulwark_testkit::tools::find_all([
        ("jq", "apt-get install jq"),
        ("curl", "apt-get install curl"),
        ("openssl", "apt-get install openssl"),
    ])
    .is_none()
    {
        return;
    }
    let runbooks = std::fs::read_to_string(repo("docs/runbooks.md")).unwrap();
    let all = blocks(&runbooks);
    let setup = &all
        .iter()
        .find(|b| b.section.is_empty())
        .expect("the runbooks start with the setup block")
        .commands;
    assert!(
        setup.iter().any(|c| c.text.starts_with("admin()")),
        "the setup block defines admin"
    );

    // Every alert has commands that run here; those that do not say why.
    let rules = yaml_file(&repo("deploy/prometheus/bulwark.rules.yml"));
    for alert in rules["groups"][0]["rules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["alert"].as_str().unwrap())
    {
        assert!(
            all.iter()
                .any(|b| b.section == alert && b.not_run.is_none() && !b.commands.is_empty()),
            "docs/runbooks.md: {alert} has no sh block that runs"
        );
    }
    for block in all.iter().filter(|b| b.not_run.is_some()) {
        assert!(
            !block.not_run.as_deref().unwrap().is_empty(),
            "{}: a block not run says why",
            block.section
        );
    }

    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    let deployed = deploy(&root).await;
    let _clients = traffic(&deployed);

    // kubectl as the on-call has it: the simulated cluster as system:masters, and the
    // pods' logs are the process's.
    let bin = dir.path().join("bin");
    let kubeconfig = dir.path().join("kubeconfig");
    let admin = deployed
        .pki
        .client_ca
        .client_cert("oncall", &["system:masters"]);
    std::fs::write(
        &kubeconfig,
        bulwark_sim::client::kubeconfig(
            &deployed.pki,
            &format!("https://{}", deployed.fleet.addrs()[0]),
            &admin,
        ),
    )
    .unwrap();
    write(
        &bin.join("kubectl"),
        "#!/bin/sh\n\
         # kubectl for the runbooks' test: `logs` of Bulwark's pods is the log of the\n\
         # process under test; the rest goes to the simulated cluster.\n\
         for a in \"$@\"; do [ \"$a\" = logs ] && exec cat \"$BULWARK_LOG\"; done\n\
         exec \"$KUBECTL\" --kubeconfig \"$SIM_KUBECONFIG\" \"$@\"\n",
    );
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(bin.join("kubectl"), std::fs::Permissions::from_mode(0o755)).unwrap();
    let bulwark_dir = Path::new(env!("CARGO_BIN_EXE_bulwark")).parent().unwrap();
    let path = std::env::join_paths(
        [bin.clone(), bulwark_dir.to_path_buf()]
            .into_iter()
            .chain(std::env::split_paths(&std::env::var_os("PATH").unwrap())),
    )
    .unwrap();
    let env = [
        ("PATH", path.to_string_lossy().into_owned()),
        ("KUBECTL", kubectl.display().to_string()),
        ("SIM_KUBECONFIG", kubeconfig.display().to_string()),
        ("BULWARK_LOG", deployed.log.display().to_string()),
    ];
    let places = Places {
        admin_port: deployed.admin.port(),
        logs: deployed.root.join("var/log/bulwark"),
    };

    // What the runbooks look for has happened: refusals logged, counted and in the access
    // log, shadow refusals logged, a Lease written.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let log = std::fs::read_to_string(&deployed.log).unwrap_or_default();
        let access = std::fs::read_to_string(places.logs.join("access.jsonl")).unwrap_or_default();
        let leases = deployed
            .fleet
            .store()
            .list("leases.coordination.k8s.io", Some("bulwark"), None)
            .map(|(_, leases)| leases.len())
            .unwrap_or(0);
        if log.contains("request rejected")
            && log.contains("shadow mode: would have refused")
            && access.contains(r#""reason":"rate_limited""#)
            && leases > 0
        {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no refusals, shadow refusals or Lease after 20 s (Leases: {leases}):\n{log}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let mut sections: Vec<(String, Vec<Command>)> = Vec::new();
    for (i, block) in all.iter().enumerate() {
        if block.not_run.is_some() || (block.section.is_empty() && i == 0) {
            continue;
        }
        match sections.last_mut() {
            Some((section, commands)) if *section == block.section => {
                commands.extend(block.commands.iter().cloned())
            }
            _ => sections.push((block.section.clone(), block.commands.clone())),
        }
    }
    let mut failures = Vec::new();
    let mut ran = 0;
    for (section, commands) in &sections {
        ran += commands.len();
        failures.extend(run_section(setup, section, commands, &places, &env, &work).await);
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
    eprintln!("{ran} runbook commands ran in {} sections", sections.len());
}

/// Every query of the runbooks' `promql` blocks parses in Prometheus (as a recording rule
/// for `promtool check rules`), placeholders and all.
#[test]
fn every_runbook_query_parses() {
    if bulwark_testkit::tools::find("promtool", "apt-get install prometheus").is_none() {
        return;
    }
    let runbooks = std::fs::read_to_string(repo("docs/runbooks.md")).unwrap();
    let mut queries = Vec::new();
    let mut lines = runbooks.lines();
    while let Some(line) = lines.next() {
        if line.trim_end() == "```promql" {
            queries.extend(
                lines
                    .by_ref()
                    .take_while(|l| l.trim_end() != "```")
                    .map(|l| l.split_once('#').map_or(l, |(query, _)| query).trim())
                    .filter(|q| !q.is_empty())
                    .map(str::to_string),
            );
        }
    }
    assert!(queries.len() > 20, "{queries:?}");
    let mut rules = String::from("groups:\n  - name: runbooks\n    rules:\n");
    for (i, query) in queries.iter().enumerate() {
        rules.push_str(&format!(
            "      - record: runbook:query_{i}\n        expr: {}\n",
            serde_json::to_string(query).unwrap()
        ));
    }
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), rules).unwrap();
    let checked = std::process::Command::new("promtool")
        .args(["check", "rules"])
        .arg(file.path())
        .output()
        .unwrap();
    assert!(
        checked.status.success(),
        "{}{}",
        String::from_utf8_lossy(&checked.stdout),
        String::from_utf8_lossy(&checked.stderr)
    );
}

//! End-to-end smoke tests of the `bulwark-loadtest` binary: tiny scenarios against both
//! targets (the simulator's L4 balancer, and Bulwark started as its own process) must write
//! the JSON with both runs filled.

use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;

fn run_scenario(scenario: &str, extra: &[&str]) -> Value {
    run_with(scenario, &["--scale", "0.01", "--duration", "3s"], extra)
}

fn run_with(scenario: &str, sizing: &[&str], extra: &[&str]) -> Value {
    let (report, stdout) = run_table(scenario, sizing, extra);
    if extra.is_empty() {
        assert!(
            stdout.contains("direct") && stdout.contains("bulwark"),
            "the table compares both runs:\n{stdout}"
        );
    }
    report
}

/// Runs `scenario` and returns its JSON report and the table it printed.
fn run_table(scenario: &str, sizing: &[&str], extra: &[&str]) -> (Value, String) {
    let json = std::env::temp_dir().join(format!(
        "bulwark-loadtest-smoke-{scenario}-{}.json",
        std::process::id()
    ));
    let out = Command::new(env!("CARGO_BIN_EXE_bulwark-loadtest"))
        .arg(scenario)
        .args(sizing)
        .arg("--json")
        .arg(&json)
        .args(extra)
        .output()
        .expect("the binary runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{scenario} failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    let text = std::fs::read_to_string(&json).expect("the JSON report is written");
    let _ = std::fs::remove_file(&json);
    let html = json.with_extension("html");
    let page = std::fs::read_to_string(&html).expect("the HTML report is written beside it");
    let _ = std::fs::remove_file(&html);
    assert!(page.contains("<svg"), "the HTML report has charts");
    assert!(
        stdout.contains(&format!("The report, with charts: {}", html.display())),
        "the run says where its report is:\n{stdout}"
    );
    let report = serde_json::from_str(&text).expect("the report is JSON");
    (report, stdout.into_owned())
}

fn check_run(run: &Value, classes: &[&str], proxy: bool) {
    let api = &run["apiserver"];
    for key in [
        "heap_limit_bytes",
        "peak_heap_bytes",
        "ooms",
        "upstream_requests",
        "upstream_watches",
    ] {
        assert!(api[key].is_u64(), "apiserver.{key} in {run}");
    }
    let per_replica = api["replica_requests"]
        .as_array()
        .expect("replica_requests");
    assert_eq!(per_replica.len(), 3, "three replicas");
    assert_eq!(
        api["replica_peak_inflight"].as_array().map(Vec::len),
        Some(3)
    );
    assert!(
        api["upstream_requests"].as_u64().unwrap() > 0,
        "the fleet served requests"
    );
    assert_eq!(
        run.get("proxy").is_some(),
        proxy,
        "proxy figures only through a proxy"
    );
    if proxy {
        assert!(run["proxy"]["peak_rss_bytes"].as_u64().unwrap() > 1 << 20);
        assert!(run["proxy"]["cpu_seconds"].as_f64().unwrap() > 0.0);
    }
    for class in classes {
        let c = &run["classes"][class];
        assert!(c.is_object(), "class {class} in {run}");
        let ok = c["ok"].as_u64().unwrap();
        assert!(ok > 0, "class {class} got answers: {c}");
        assert_eq!(
            c["requests"].as_u64().unwrap(),
            ok + c["rejected"].as_u64().unwrap() + c["errors"].as_u64().unwrap()
        );
        for key in ["p50_ms", "p99_ms", "p999_ms", "rps"] {
            assert!(c[key].as_f64().unwrap() > 0.0, "{class}.{key}: {c}");
        }
        let per_identity: Vec<u64> = c["per_identity_ok"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect();
        assert_eq!(per_identity.iter().sum::<u64>(), ok);
    }
}

#[test]
fn list_storm_fills_both_runs() {
    let report = run_scenario("list-storm", &[]);
    assert_eq!(report["scenario"], "list-storm");
    assert_eq!(report["scale"], 0.01);
    let classes = ["storm", "innocent", "heartbeat"];
    check_run(&report["runs"]["direct"], &classes, false);
    check_run(&report["runs"]["bulwark"], &classes, true);
}

#[test]
fn informers_fill_both_runs_with_event_delivery() {
    let report = run_scenario("informers", &[]);
    for run in ["direct", "bulwark"] {
        let r = &report["runs"][run];
        check_run(r, &["nodes", "churn"], run == "bulwark");
        assert!(
            r["apiserver"]["upstream_watches"].as_u64().unwrap() > 0,
            "{run} opened watches"
        );
        assert!(
            r["event_delivery_p99_ms"].as_f64().unwrap() > 0.0,
            "{run} matched events to writes: {r}"
        );
    }
}

#[test]
fn the_oom_model_fires_in_a_direct_list_storm() {
    let report = run_with(
        "list-storm",
        &["--scale", "0.3", "--duration", "4s"],
        &["--only", "direct"],
    );
    let api = &report["runs"]["direct"]["apiserver"];
    assert!(
        api["ooms"].as_u64().unwrap() > 0,
        "replicas ran out of memory: {api}"
    );
    assert_eq!(api["peak_heap_bytes"], api["heap_limit_bytes"]);
}

#[test]
fn a_direct_skew_run_shows_the_skew_after_the_restart() {
    let report = run_with(
        "skew",
        &["--scale", "0.1", "--duration", "8s"],
        &["--only", "direct"],
    );
    let api = &report["runs"]["direct"]["apiserver"];
    let per: Vec<u64> = api["replica_requests"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    // Replica 0 restarts at 1/3 of the run; its clients move to the others and stay there.
    let others = per[1].min(per[2]);
    assert!(per[0] * 2 < others, "replica 0 served far less: {per:?}");
}

#[test]
fn sandbox_serves_kubectl_with_each_identity() {
    // The kubectl the real control plane's tests build (loadtest/controlplane/build.sh).
    let located = tokio::runtime::Runtime::new()
        .unwrap()
        .block_on(bulwark_loadtest::controlplane::Binaries::locate());
    let kubectl = match located {
        Ok(binaries) => binaries.kubectl(),
        Err(e) => panic!("kubectl for the sandbox: {e}"),
    };
    let dir = std::env::temp_dir().join(format!("bulwark-sandbox-smoke-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut child = Command::new(env!("CARGO_BIN_EXE_bulwark-loadtest"))
        .arg("sandbox")
        .arg("--dir")
        .arg(&dir)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !dir.join("ready").exists() {
        assert!(Instant::now() < deadline, "the sandbox became ready");
        assert!(
            child.try_wait().unwrap().is_none(),
            "the sandbox exited early"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let kubectl = |config: &str, args: &[&str]| {
        let out = Command::new(&kubectl)
            .arg("--kubeconfig")
            .arg(dir.join(config))
            .args(args)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr),
        )
    };
    let (ok, text) = kubectl("kubeconfig-admin", &["get", "secrets", "-A"]);
    assert!(
        ok && text.contains("secret-0") && text.contains("node-1-kubelet-config"),
        "{text}"
    );
    let (ok, text) = kubectl("kubeconfig-operator", &["get", "configmaps", "-A"]);
    assert!(ok && text.contains("configmap-0"), "{text}");
    let (ok, text) = kubectl("kubeconfig-operator", &["get", "pods", "-A"]);
    assert!(!ok && text.contains("Forbidden"), "{text}");
    let (ok, text) = kubectl(
        "kubeconfig-node-1",
        &["-n", "ns-0", "get", "secret", "node-1-kubelet-config"],
    );
    assert!(ok, "{text}");
    let (ok, text) = kubectl(
        "kubeconfig-node-1",
        &["-n", "ns-0", "get", "secret", "secret-0"],
    );
    assert!(!ok && text.contains("Forbidden"), "{text}");
    let (ok, text) = kubectl("kubeconfig-nobody", &["get", "secrets"]);
    assert!(!ok && text.contains("Forbidden"), "{text}");
    let (ok, text) = kubectl("kubeconfig-direct-admin", &["get", "secrets", "-A"]);
    assert!(ok && text.contains("secret-0"), "{text}");

    let pid = rustix::process::Pid::from_raw(child.id() as i32).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
    let status = child.wait().unwrap();
    assert!(
        status.success(),
        "the sandbox stops cleanly on SIGTERM: {status}"
    );
    assert!(
        !dir.join("ready").exists(),
        "ready is removed when it stops"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Kills the sandbox if a test fails before stopping it.
struct Running(std::process::Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn sandbox_runs_three_bulwarks_behind_a_balancer_sharing_one_budget() {
    let dir = std::env::temp_dir().join(format!(
        "bulwark-sandbox-fleet-smoke-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    let mut sandbox = Running(
        Command::new(env!("CARGO_BIN_EXE_bulwark-loadtest"))
            .arg("sandbox")
            .arg("--dir")
            .arg(&dir)
            .args(["--bulwark-replicas", "3"])
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    while !dir.join("ready").exists() {
        assert!(Instant::now() < deadline, "the sandbox became ready");
        assert!(
            sandbox.0.try_wait().unwrap().is_none(),
            "the sandbox exited early"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // Each line: a Bulwark's address and its admin address.
    let listing = std::fs::read_to_string(dir.join("bulwarks")).unwrap();
    let bulwarks: Vec<(&str, &str)> = listing
        .lines()
        .map(|l| l.split_once(' ').expect("address and admin address"))
        .collect();
    assert_eq!(bulwarks.len(), 3, "{listing}");
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        use k8s_openapi::api::core::v1::Secret;
        use kube::api::{Api, ListParams};
        use kube::config::{KubeConfigOptions, Kubeconfig};

        // One client per Bulwark: the balancer sends each new connection to the next.
        for _ in 0..bulwarks.len() {
            let kubeconfig = Kubeconfig::read_from(dir.join("kubeconfig-admin")).unwrap();
            let config =
                kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
                    .await
                    .unwrap();
            let server = config.cluster_url.to_string();
            assert!(
                bulwarks.iter().all(|(addr, _)| !server.starts_with(addr)),
                "the kubeconfig points at the balancer, not at a Bulwark: {server}"
            );
            let secrets: Api<Secret> = Api::all(kube::Client::try_from(config).unwrap());
            let list = secrets.list(&ListParams::default()).await.unwrap();
            let names: Vec<_> = list
                .iter()
                .filter_map(|s| s.metadata.name.clone())
                .collect();
            assert!(
                names.iter().any(|n| n == "secret-0")
                    && names.iter().any(|n| n == "node-1-kubelet-config"),
                "{names:?}"
            );
        }

        let all = ["bulwark-0", "bulwark-1", "bulwark-2"];
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        for (_, admin) in &bulwarks {
            let admin = admin.strip_prefix("http://").unwrap().parse().unwrap();
            loop {
                let (status, body) = bulwark_testkit::admin_get(admin, "/debug/fleet")
                    .await
                    .expect("the admin listener answers");
                assert_eq!(status, 200, "{body}");
                let debug: Value = serde_json::from_str(&body).unwrap();
                let shares = &debug["shares"];
                if shares["standing"] == "shared" && shares["members"] == serde_json::json!(all) {
                    break;
                }
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "{admin} never saw all three live: {debug}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    });

    let pid = rustix::process::Pid::from_raw(sandbox.0.id() as i32).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::INT).unwrap();
    let status = sandbox.0.wait().unwrap();
    assert!(
        status.success(),
        "the sandbox stops cleanly on SIGINT: {status}"
    );
    assert!(
        !dir.join("ready").exists(),
        "ready is removed when it stops"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Whether `program` is installed (on `PATH` or in Debian's sbin).

#[test]
fn passthrough_measures_bulwark_and_the_floor_with_h2load_without_bulwarks_limits() {
    if bulwark_testkit::tools::find_all([
        ("h2load", "apt-get install nghttp2-client"),
        (
            "nginx",
            "apt-get install nginx; it may be in an sbin folder",
        ),
    ])
    .is_none()
    {
        return;
    }
    let (report, stdout) = run_table(
        "passthrough",
        &["--duration", "3s"],
        &["--only", "direct,floor,bulwark"],
    );
    // The table ends with each target's summary against direct and the floor.
    assert!(stdout.contains("x floor"), "{stdout}");
    let classes = ["fixed_rate_2000", "fixed_rate_20000", "saturation"];
    assert!(
        report["bench"]["load_generator"]
            .as_str()
            .is_some_and(|g| g.starts_with("h2load")),
        "{report}"
    );
    for run in ["direct", "floor", "bulwark"] {
        let figures = &report["runs"][run]["classes"];
        for class in classes {
            let c = &figures[class];
            assert!(c["ok"].as_u64().unwrap() > 0, "{run} {class}: {c}");
            // h2load far above the catch-all's 20 requests/s is not refused: the scenario's
            // own rule exempts it, so the figures are the proxy's.
            assert_eq!(c["rejected"], 0, "{run} {class}: {c}");
            assert_eq!(c["errors"], 0, "{run} {class}: {c}");
        }
        // Every answer came from the upstream: Bulwark forwarded each GET (its one token
        // review and its health probes come on top).
        let answered: u64 = classes
            .iter()
            .map(|c| figures[c]["ok"].as_u64().unwrap())
            .sum();
        let upstream = report["runs"][run]["apiserver"]["upstream_requests"]
            .as_u64()
            .unwrap();
        assert!(
            upstream >= answered,
            "{run}: {upstream} upstream < {answered}"
        );
    }
    assert!(
        report["runs"]["bulwark"]["proxy"]["cpu_seconds"]
            .as_f64()
            .unwrap()
            > 0.0
    );
    // The proxies' CPU time in each phase, from /proc.
    for run in ["floor", "bulwark"] {
        for class in classes {
            let cpu = &report["runs"][run]["classes"][class]["proxy_cpu_seconds"];
            assert!(
                cpu.as_f64().is_some_and(|s| s >= 0.0),
                "{run} {class}: {cpu}"
            );
        }
    }
    assert!(
        report["runs"]["direct"]["classes"]["saturation"]
            .get("proxy_cpu_seconds")
            .is_none()
    );
}

#[test]
fn conn_flood_is_closed_for_not_authenticating_while_the_other_clients_are_served() {
    let (report, stdout) = run_table(
        "conn-flood",
        &["--connections", "200", "--sources", "4"],
        &[
            "--unauthenticated-timeout",
            "2s",
            "--hold",
            "20s",
            "--settle",
            "3s",
        ],
    );
    for row in [
        "accepted / refused / timed out / other",
        "fds idle / peak / after",
        "RSS idle / peak / after",
        "GETs during: p50 / p99 / max ms",
        "/readyz during: ok / failed",
        "new client",
    ] {
        assert!(stdout.contains(row), "the table has {row:?}:\n{stdout}");
    }
    assert_eq!(report["scenario"], "conn-flood");
    let run = &report["runs"]["bulwark"];
    assert!(run["proxy"]["peak_rss_bytes"].as_u64().unwrap() > 1 << 20);
    let f = &run["flood"];
    let n = |v: &Value| v.as_u64().unwrap_or_else(|| panic!("a count: {f}"));

    // Every flood connection was served its 401, then sent away for not authenticating
    // while the client still held it.
    assert_eq!(n(&f["accepted"]), 200, "{f}");
    assert_eq!(
        n(&f["refused"]) + n(&f["timed_out"]) + n(&f["other"]),
        0,
        "{f}"
    );
    assert_eq!(n(&f["closed_by_bulwark"]), 200, "{f}");
    assert!(
        n(&f["bulwark_closed"]["unauthenticated_timeout"]) >= 200,
        "{f}"
    );

    // Bulwark held a descriptor per flood connection, and gave them back.
    let fds = &f["fds"];
    assert!(n(&fds["peak"]) >= n(&fds["idle"]) + 150, "{fds}");
    assert!(n(&fds["after"]) <= n(&fds["idle"]) + 10, "{fds}");
    for key in ["idle", "peak", "after"] {
        assert!(n(&f["rss_bytes"][key]) > 1 << 20, "{f}");
    }

    // The authenticated client, the admin listener and a newcomer were served throughout.
    for phase in ["gets_before", "gets_during", "readyz_during"] {
        let l = &f[phase];
        assert!(n(&l["ok"]) > 0, "{phase}: {l}");
        assert_eq!(n(&l["failed"]), 0, "{phase}: {l}");
        for key in ["p50_ms", "p99_ms", "max_ms"] {
            assert!(l[key].as_f64().unwrap() > 0.0, "{phase}.{key}: {l}");
        }
    }
    assert_eq!(f["new_client"]["connected"], true, "{f}");
    let class = &run["classes"]["authenticated"];
    assert_eq!(class["errors"], 0, "{class}");
}

/// `passthrough` reads the core's speed from `__calibrate`: one number of milliseconds on
/// its own line, for work that takes a measurable time.
#[test]
fn calibrate_prints_how_long_its_work_took_in_milliseconds() {
    let out = Command::new(env!("CARGO_BIN_EXE_bulwark-loadtest"))
        .arg("__calibrate")
        .output()
        .expect("the binary runs");
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let ms: f64 = stdout
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("one number, not {stdout:?}"));
    assert!(ms > 1.0 && ms < 600_000.0, "{ms} ms");
    assert_eq!(stdout.lines().count(), 1, "{stdout:?}");
}

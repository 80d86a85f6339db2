//! Three Bulwarks in front of a real control plane keep one budget through real
//! `coordination.k8s.io/v1` Leases: each sees the others, a flow whose connections land on
//! all three gets its rule's rate and not three times it, a killed Bulwark's share goes to
//! the survivors within the Lease duration, and it rejoins when started again. Without the
//! binaries the control plane builds them (`loadtest/controlplane/build.sh`, Go 1.26) or
//! fails: this test never skips.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use bulwark_loadtest::controlplane::{ControlPlane, FLEET_NAMESPACE, Options};
use bulwark_loadtest::identities;
use bulwark_loadtest::proxy_process::admin_text;
use bulwark_testkit::metric_sum;
use kube::Client;
use kube::config::{KubeConfigOptions, Kubeconfig};
use serde_json::Value;

/// The loadtest's rule of `ops/secret-sync` (`loadtest/rules/secret-operator.yaml`, written
/// beside the shipped ones on the real control plane).
const OPERATOR: &str = "system:serviceaccount:ops:secret-sync";
const OPERATOR_QPS: f64 = 5.0;

async fn fleet_of(admin: SocketAddr) -> Value {
    let text = admin_text(admin, "/debug/fleet").await.unwrap_or_default();
    serde_json::from_str(&text).unwrap_or(Value::Null)
}

/// Waits until every Bulwark at `admins` sees exactly `members`; panics after `within`.
async fn until_members(admins: &[SocketAddr], members: &[&str], within: Duration) -> Duration {
    let started = Instant::now();
    loop {
        let mut all = true;
        for &admin in admins {
            let fleet = fleet_of(admin).await;
            let seen: Vec<&str> = fleet["shares"]["members"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .collect();
            all &= seen == members;
        }
        if all {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < within,
            "not every Bulwark saw {members:?} within {within:?}: {:?}",
            fleet_of(admins[0]).await
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A client of `user` to the Bulwark at `addr`, without retries.
async fn client(cp: &ControlPlane, addr: SocketAddr, user: &str, groups: &[&str]) -> Client {
    let cert = cp.pki().client_ca.client_cert(user, groups);
    let yaml = identities::kubeconfig(
        addr,
        cp.bulwark_ca_pem().expect("Bulwark's CA"),
        user,
        &cert.cert_pem,
        &cert.key_pem,
    );
    let kubeconfig = Kubeconfig::from_yaml(&yaml).expect("a kubeconfig");
    let mut config =
        kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
            .await
            .expect("a client config");
    // Every 429 counted, none waited out and retried.
    config.default_retry = false;
    Client::try_from(config).expect("a client")
}

/// GETs a Secret in a loop through `client` until `until`, pausing `pause` between
/// requests; counts the answers that were not 429 after `from`.
async fn hammer(client: Client, pause: Duration, from: Instant, until: Instant) -> (u64, u64) {
    let (mut passed, mut refused) = (0, 0);
    while Instant::now() < until {
        let request =
            http::Request::get("/api/v1/namespaces/default/secrets/secret-0?resourceVersion=0")
                .body(Vec::new())
                .unwrap();
        let sent = Instant::now();
        let answer = client.request_text(request).await;
        if Instant::now() >= from {
            match answer {
                Err(kube::Error::Api(status)) if status.code == 429 => refused += 1,
                Ok(_) => passed += 1,
                Err(e) => panic!("the operator's GET failed after {:?}: {e}", sent.elapsed()),
            }
        }
        tokio::time::sleep(pause).await;
    }
    (passed, refused)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_bulwarks_keep_one_budget_through_real_leases() {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = Options::new(dir.path());
    opts.bulwark_exe = Some(PathBuf::from(env!("CARGO_BIN_EXE_bulwark-loadtest")));
    opts.bulwarks = 3;
    opts.open_rbac = true;
    let mut cp = ControlPlane::start(opts)
        .await
        .expect("the control plane starts");
    let admins = cp.bulwark_admin_addrs();
    let all = ["bulwark-0", "bulwark-1", "bulwark-2"];

    // Membership: each Bulwark's Lease, renewed through its own credential, is seen by all.
    until_members(&admins, &all, Duration::from_secs(15)).await;
    let (ok, out) = cp
        .kubectl(
            "admin",
            &[
                "get",
                "leases",
                "-n",
                FLEET_NAMESPACE,
                "-o",
                "jsonpath={.items[*].spec.holderIdentity}",
            ],
        )
        .await
        .expect("kubectl runs");
    assert!(ok, "{out}");
    assert_eq!(out.split_whitespace().collect::<Vec<_>>(), all, "{out}");
    let fleet = fleet_of(admins[0]).await;
    assert_eq!(fleet["shares"]["standing"], "shared", "{fleet}");
    let lease = &fleet["leases"][0];
    assert!(
        lease["demand"].is_object(),
        "the Lease carries the demand: {fleet}"
    );

    // A flow's rate holds for the fleet: the operator's connections on all three Bulwarks,
    // most on the first, far over its rule; counted after the Bulwarks have seen the flow.
    let bulwarks = cp.bulwark_addrs();
    let groups = ["system:serviceaccounts", "system:serviceaccounts:ops"];
    let start = Instant::now();
    let (from, until) = (
        start + Duration::from_secs(8),
        start + Duration::from_secs(23),
    );
    let mut loops = Vec::new();
    for (addr, pause) in bulwarks.iter().zip([2u64, 10, 20]) {
        let c = client(&cp, *addr, OPERATOR, &groups).await;
        loops.push(tokio::spawn(hammer(
            c,
            Duration::from_millis(pause),
            from,
            until,
        )));
    }
    let (mut passed, mut refused) = (0, 0);
    for l in loops {
        let (p, r) = l.await.unwrap();
        passed += p;
        refused += r;
    }
    let rate = passed as f64 / (until - from).as_secs_f64();
    eprintln!(
        "the operator's flow over three Bulwarks: {rate:.2} per second passed, {refused} refused"
    );
    assert!(refused > 0, "the load was over the rule");
    assert!(
        (rate - OPERATOR_QPS).abs() <= OPERATOR_QPS * 0.15,
        "{rate:.2} per second passed over the fleet, rule {OPERATOR_QPS}"
    );

    // A killed Bulwark's share comes back to the survivors within the Lease duration (10 s)
    // and a renew period: they hold every apiserver's whole budget between them.
    cp.kill_bulwark(1).await.expect("bulwark-1 killed");
    let survivors = [admins[0], admins[2]];
    let took = until_members(
        &survivors,
        &["bulwark-0", "bulwark-2"],
        Duration::from_secs(14),
    )
    .await;
    let mut held = 0.0;
    for &admin in &survivors {
        let text = admin_text(admin, "/metrics").await.unwrap();
        held += metric_sum(&text, "bulwark_list_bytes_budget");
    }
    let whole = (8u64 << 30) as f64 / 5.0 * cp.replica_addrs().len() as f64;
    eprintln!("survivors took over in {took:?}, holding {held} of {whole} bytes");
    assert!(held <= whole && held >= whole - 16.0, "{held} of {whole}");

    // Started again, it rejoins.
    cp.start_bulwark(1).await.expect("bulwark-1 starts again");
    until_members(&admins, &all, Duration::from_secs(10)).await;
    cp.stop().await.expect("the control plane stops");
}

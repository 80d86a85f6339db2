//! The `kubernetes` Service's endpoints under paused time, over in-memory Leases and an
//! in-memory Service: what kube-proxy would send pods to as replicas come and go.

use std::sync::Mutex;

use k8s_openapi::api::coordination::v1::Lease;

use super::*;
use crate::fleet::lease::{Keys, LeaseError, lease_object};
use crate::fleet::share::Demand;

const LEASE: Duration = Duration::from_secs(10);
const EVERY: Duration = Duration::from_secs(2);
const BASE_SECS: u64 = 1_800_000_000;

fn addr(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

fn apiservers() -> Vec<SocketAddr> {
    vec![addr("10.0.0.1:6443"), addr("10.0.0.2:6443")]
}

fn keys() -> Keys {
    Keys::parse(b"0123456789abcdef0123456789abcdef\n").unwrap()
}

fn check(keys: Option<Keys>) -> Check {
    Check {
        namespace: "bulwark".into(),
        prefix: "bulwark-".into(),
        duration: LEASE,
        keys,
        accept_unsigned: false,
    }
}

/// A member renewed at `renewed` that publishes `endpoint`.
fn member(identity: &str, renewed: SystemTime, endpoint: Option<&str>) -> Member {
    Member {
        identity: identity.into(),
        renewed,
        duration: LEASE,
        created: None,
        demand: Demand {
            endpoint: endpoint.map(str::to_owned),
            ..Demand::default()
        },
    }
}

fn lease(m: &Member, keys: Option<&Keys>) -> Lease {
    lease_object(&format!("bulwark-{}", m.identity), "bulwark", m, None, keys)
}

#[test]
fn live_replicas_are_ready_and_the_apiservers_wait_behind_them() {
    let now = SystemTime::UNIX_EPOCH + Duration::from_secs(BASE_SECS);
    let members = [
        member("a", now, Some("10.1.0.1:8443")),
        member("b", now - Duration::from_secs(3), Some("10.1.0.2:8443")),
        member("old", now - LEASE, Some("10.1.0.3:8443")),
        member("bad", now, Some("not an address")),
        member("none", now, None),
    ];
    let both = published(&members, now, &apiservers());
    let slices = both.slices();
    assert_eq!(
        slices.keys().collect::<Vec<_>>(),
        ["kubernetes", "kubernetes-bulwark-8443"]
    );
    let all: Vec<EndpointSlice> = slices.values().cloned().collect();
    assert_eq!(
        reachable(&all),
        [addr("10.1.0.1:8443"), addr("10.1.0.2:8443")],
        "kube-proxy sends pods to the live replicas only"
    );
    let endpoints = both.endpoints();
    let subset = &endpoints.subsets.as_ref().unwrap()[0];
    let ips: Vec<&str> = (subset.addresses.iter().flatten())
        .map(|a| a.ip.as_str())
        .collect();
    assert_eq!(ips, ["10.1.0.1", "10.1.0.2"]);
    assert_eq!(subset.ports.as_ref().unwrap()[0].port, 8443);

    // No replica live: the apiservers, through the same slices, with no write needed.
    let alone = published(&members[2..], now, &apiservers());
    let slices: Vec<EndpointSlice> = alone.slices().into_values().collect();
    assert_eq!(reachable(&slices), apiservers());
    let ips: Vec<String> = (alone.endpoints().subsets.unwrap().iter())
        .flat_map(|s| s.addresses.clone().unwrap_or_default())
        .map(|a| a.ip)
        .collect();
    assert_eq!(ips, ["10.0.0.1", "10.0.0.2"]);
}

#[test]
fn replicas_on_other_ports_and_families_get_slices_of_their_own() {
    let now = SystemTime::UNIX_EPOCH + Duration::from_secs(BASE_SECS);
    let members = [
        member("a", now, Some("127.0.0.1:7001")),
        member("b", now, Some("127.0.0.1:7002")),
        member("c", now, Some("[fd00::1]:7001")),
    ];
    let apiservers = [addr("127.0.0.1:6001"), addr("127.0.0.1:6002")];
    let slices = published(&members, now, &apiservers).slices();
    assert_eq!(
        slices.keys().collect::<Vec<_>>(),
        [
            "kubernetes",
            "kubernetes-apiservers-6002",
            "kubernetes-bulwark-6-7001",
            "kubernetes-bulwark-7001",
            "kubernetes-bulwark-7002",
        ]
    );
    assert_eq!(slices["kubernetes-bulwark-6-7001"].address_type, "IPv6");
    let mut reached = reachable(&slices.into_values().collect::<Vec<_>>());
    reached.sort();
    assert_eq!(
        reached,
        [
            addr("127.0.0.1:7001"),
            addr("127.0.0.1:7002"),
            addr("[fd00::1]:7001")
        ]
    );
}

#[test]
fn kube_proxy_reads_missing_conditions_as_ready() {
    let mut slice = published(&[], SystemTime::UNIX_EPOCH, &apiservers())
        .slices()
        .remove("kubernetes")
        .unwrap();
    for e in slice.endpoints.iter_mut().flatten() {
        e.conditions = None;
    }
    assert_eq!(reachable(&[slice]), apiservers());
}

/// Leases as the apiserver keeps them.
#[derive(Default)]
struct Leases(Mutex<Vec<Lease>>);

impl Leases {
    fn put(&self, lease: &Lease) {
        let mut all = self.0.lock().unwrap();
        all.retain(|l| l.metadata.name != lease.metadata.name);
        all.push(lease.clone());
    }
}

impl LeaseStore for Arc<Leases> {
    fn write(&self, lease: &Lease) -> BoxFuture<(), LeaseError> {
        self.put(lease);
        Box::pin(async { Ok(()) })
    }

    fn list(&self) -> BoxFuture<Vec<Lease>, LeaseError> {
        let all = self.0.lock().unwrap().clone();
        Box::pin(async move { Ok(all) })
    }
}

/// What kube-proxy would reach after each publication, and when.
#[derive(Default)]
struct Service(Mutex<Vec<(Instant, Vec<SocketAddr>)>>);

impl ServiceStore for Arc<Service> {
    fn publish(&self, published: &Published) -> BoxFuture<usize, CallError> {
        let slices: Vec<EndpointSlice> = published.slices().into_values().collect();
        self.0
            .lock()
            .unwrap()
            .push((Instant::now(), reachable(&slices)));
        Box::pin(async { Ok(1) })
    }
}

impl Service {
    fn reached(&self) -> Vec<SocketAddr> {
        let all = self.0.lock().unwrap();
        all.last().map(|(_, r)| r.clone()).unwrap_or_default()
    }

    /// When the pods first reached exactly `wanted`.
    fn since(&self, wanted: &[SocketAddr]) -> Option<Instant> {
        let all = self.0.lock().unwrap();
        let last = all.iter().rposition(|(_, r)| r != wanted)?;
        all.get(last + 1).map(|(at, _)| *at)
    }
}

fn publisher(
    leases: &Arc<Leases>,
    service: &Arc<Service>,
    keys: Option<Keys>,
) -> tokio::task::JoinHandle<()> {
    let origin = Instant::now();
    let settings = Settings {
        check: Arc::new(move || check(keys.clone())),
        apiservers: apiservers(),
        every: EVERY,
        clock: Arc::new(move || {
            SystemTime::UNIX_EPOCH + Duration::from_secs(BASE_SECS) + origin.elapsed()
        }),
    };
    tokio::spawn(run(
        settings,
        Arc::new(leases.clone()),
        Arc::new(service.clone()),
        Metrics::new(),
    ))
}

fn wall(origin: Instant) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(BASE_SECS) + origin.elapsed()
}

#[tokio::test(start_paused = true)]
async fn a_dead_replica_leaves_within_its_lease_and_the_last_one_out_brings_the_apiservers_back() {
    let origin = Instant::now();
    let keys = keys();
    let leases = Arc::new(Leases::default());
    let service = Arc::new(Service::default());
    let renew = |who: &str, endpoint: &str| {
        let m = member(who, wall(origin), Some(endpoint));
        leases.put(&lease(&m, Some(&keys)));
    };
    renew("a", "10.1.0.1:8443");
    renew("b", "10.1.0.2:8443");
    let task = publisher(&leases, &service, Some(keys.clone()));
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(
        service.reached(),
        [addr("10.1.0.1:8443"), addr("10.1.0.2:8443")]
    );

    // `b` dies now, just after renewing; `a` renews every 2 s.
    let b_died = Instant::now();
    for _ in 0..10 {
        tokio::time::sleep(EVERY).await;
        renew("a", "10.1.0.1:8443");
    }
    assert_eq!(service.reached(), [addr("10.1.0.1:8443")]);
    let gone = service.since(&[addr("10.1.0.1:8443")]).unwrap() - b_died;
    assert!(gone <= LEASE, "b left {gone:?} after it died");

    // `a` dies too: the apiservers, within the Lease duration.
    let a_died = Instant::now();
    tokio::time::sleep(LEASE * 2).await;
    assert_eq!(service.reached(), apiservers());
    let back = service.since(&apiservers()).unwrap() - a_died;
    assert!(
        back <= LEASE,
        "the apiservers came back {back:?} after the last replica died"
    );

    // And a replica that starts is published at the next read.
    renew("c", "10.1.0.3:8443");
    tokio::time::sleep(EVERY + Duration::from_millis(10)).await;
    assert_eq!(service.reached(), [addr("10.1.0.3:8443")]);
    task.abort();
}

#[tokio::test(start_paused = true)]
async fn a_lease_without_the_fleets_signature_puts_no_address_behind_the_service() {
    let origin = Instant::now();
    let leases = Arc::new(Leases::default());
    let service = Arc::new(Service::default());
    let forged = Keys::parse(b"ffffffffffffffffffffffffffffffff\n").unwrap();
    let m = member("evil", wall(origin), Some("10.6.6.6:443"));
    leases.put(&lease(&m, Some(&forged)));
    let m = member("unsigned", wall(origin), Some("10.6.6.7:443"));
    leases.put(&lease(&m, None));
    let m = member("good", wall(origin), Some("10.1.0.1:8443"));
    leases.put(&lease(&m, Some(&keys())));
    let task = publisher(&leases, &service, Some(keys()));
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(service.reached(), [addr("10.1.0.1:8443")]);
    task.abort();
}

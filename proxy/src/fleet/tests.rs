//! The fleet loop under paused time, over an in-memory Lease store: membership, expiry,
//! the split by demand and the fallback to the static split.

use std::sync::atomic::{AtomicBool, Ordering};

use super::lease::LeaseError;
use super::share::Bytes;
use super::*;

/// Every replica's Lease, shared like the apiservers' store; each replica reaches it
/// through a [`Reach`] of its own.
#[derive(Default)]
struct Memory {
    leases: Mutex<BTreeMap<String, Member>>,
    writes: std::sync::atomic::AtomicU64,
    lists: std::sync::atomic::AtomicU64,
}

/// One replica's way to the store, which a test can cut.
struct Reach {
    memory: Arc<Memory>,
    down: AtomicBool,
}

impl LeaseStore for Arc<Reach> {
    fn write(&self, member: &Member) -> crate::BoxFuture<(), LeaseError> {
        let this = self.clone();
        let member = member.clone();
        Box::pin(async move {
            if this.down.load(Ordering::SeqCst) {
                return Err(LeaseError::Unreachable);
            }
            this.memory.writes.fetch_add(1, Ordering::SeqCst);
            let mut leases = this.memory.leases.lock().unwrap();
            leases.insert(member.identity.clone(), member);
            Ok(())
        })
    }

    fn list(&self) -> crate::BoxFuture<Vec<Member>, LeaseError> {
        let this = self.clone();
        Box::pin(async move {
            if this.down.load(Ordering::SeqCst) {
                return Err(LeaseError::Unreachable);
            }
            this.memory.lists.fetch_add(1, Ordering::SeqCst);
            Ok(this
                .memory
                .leases
                .lock()
                .unwrap()
                .values()
                .cloned()
                .collect())
        })
    }
}

/// A replica's demand as the test sets it; static shares of 100 bytes on `r0` and 10
/// seats in `lists`.
#[derive(Default)]
struct Wants {
    bytes: std::sync::atomic::AtomicU64,
    seats: std::sync::atomic::AtomicU64,
}

impl Local for Wants {
    fn demand(&self) -> Demand {
        let mut demand = Demand::default();
        let wanted = self.bytes.load(Ordering::SeqCst);
        demand.bytes.insert(
            "r0".into(),
            Bytes {
                wanted,
                in_flight: wanted,
            },
        );
        demand
            .seats
            .insert("lists".into(), self.seats.load(Ordering::SeqCst));
        demand
    }

    fn statics(&self) -> Statics {
        Statics {
            list_bytes: [("r0".to_string(), 100)].into(),
            seats: [("lists".to_string(), 10)].into(),
        }
    }
}

const RENEW: Duration = Duration::from_secs(2);
const LEASE: Duration = Duration::from_secs(10);

/// One replica of a fleet of three configured (`bulwarkReplicas: 3`): the whole is 300
/// bytes and 30 seats.
struct Replica {
    fleet: Arc<Fleet>,
    task: JoinHandle<()>,
    reach: Arc<Reach>,
    wants: Arc<Wants>,
    metrics: Metrics,
}

impl Replica {
    fn start(identity: &str, memory: &Arc<Memory>) -> Replica {
        // Wall time that follows tokio's paused clock.
        let base = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let start = Instant::now();
        let settings = Settings {
            identity: identity.into(),
            renew_interval: RENEW,
            lease_duration: LEASE,
            bulwark_replicas: 3,
            clock: Arc::new(move || base + start.elapsed()),
        };
        let reach = Arc::new(Reach {
            memory: memory.clone(),
            down: AtomicBool::new(false),
        });
        let wants = Arc::new(Wants::default());
        let metrics = Metrics::new();
        let (fleet, task) = Fleet::spawn(
            settings,
            Arc::new(reach.clone()),
            wants.clone(),
            FleetShares::new(),
            metrics.clone(),
        );
        Replica {
            fleet,
            task,
            reach,
            wants,
            metrics,
        }
    }

    fn bytes(&self) -> Option<u64> {
        self.fleet.shares().list_bytes("r0")
    }

    fn seats(&self) -> Option<u32> {
        self.fleet.shares().seats("lists")
    }

    fn standing(&self) -> Standing {
        self.fleet.shares().current().standing
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_replica_alone_gets_the_whole_and_members_split_by_demand_above_a_floor() {
    let memory = Arc::new(Memory::default());
    let a = Replica::start("a", &memory);
    assert_eq!(
        a.bytes(),
        None,
        "before the first renewal: the static budget"
    );
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(a.standing(), Standing::Alone);
    assert_eq!(a.bytes(), Some(300), "alone: the whole (3 × 100)");
    assert_eq!(a.seats(), Some(30));
    assert_eq!(a.metrics.fleet_members.get(), 1);

    a.wants.bytes.store(1000, Ordering::SeqCst);
    a.wants.seats.store(12, Ordering::SeqCst);
    let b = Replica::start("b", &memory);
    // B sees A at once; A sees B at its next renewal, within a renew period.
    tokio::time::sleep(RENEW + Duration::from_millis(10)).await;
    for r in [&a, &b] {
        assert_eq!(r.standing(), Standing::Shared);
        assert_eq!(
            r.fleet.shares().current().members,
            vec!["a".to_string(), "b".to_string()]
        );
        assert_eq!(r.metrics.fleet_members.get(), 2);
    }
    // A's share grows once B can have seen A's demand: a round later.
    tokio::time::sleep(RENEW).await;
    // B asks nothing: 10% of an equal share (15 bytes); A the rest.
    assert_eq!(b.bytes(), Some(15));
    assert_eq!(a.bytes(), Some(285));
    assert_eq!(b.seats(), Some(1), "at least one seat to start work with");
    assert_eq!(a.seats(), Some(29));
    assert_eq!(
        a.metrics
            .fleet_share
            .with_label_values(&["list_bytes", "r0"])
            .get(),
        285
    );
    assert_eq!(
        a.metrics.list_bytes_budget.with_label_values(&["r0"]).get(),
        285,
        "the exported budget is the share"
    );

    // B's demand grows to three times A's: the split follows within a renew period.
    b.wants.bytes.store(3000, Ordering::SeqCst);
    tokio::time::sleep(RENEW * 2).await;
    let (sa, sb) = (a.bytes().unwrap(), b.bytes().unwrap());
    assert_eq!((sa, sb), (15 + 67, 15 + 202));
    assert!(sa + sb <= 300);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn demand_rising_on_every_replica_at_once_never_shares_out_more_than_the_whole() {
    // An apiserver restart: every Bulwark's relists begin in the same renew period. Each
    // sees the others' Leases from before it, still idle; taking its split from those
    // would give each most of the budget, and the fleet several budgets at once.
    let memory = Arc::new(Memory::default());
    let replicas: Vec<_> = ["a", "b", "c"]
        .iter()
        .map(|id| Replica::start(id, &memory))
        .collect();
    tokio::time::sleep(RENEW * 2).await;
    let total = |replicas: &[Replica]| replicas.iter().map(|r| r.bytes().unwrap()).sum::<u64>();
    assert_eq!(total(&replicas), 300, "idle: equal thirds");
    for (r, wants) in replicas.iter().zip([5000u64, 3000, 1000]) {
        r.wants.bytes.store(wants, Ordering::SeqCst);
        r.wants.seats.store(wants / 100, Ordering::SeqCst);
    }
    // Every sample of every round while the demand spreads through the Leases.
    for _ in 0..40 {
        tokio::time::sleep(RENEW / 8).await;
        let bytes = total(&replicas);
        let seats: u32 = replicas.iter().map(|r| r.seats().unwrap()).sum();
        assert!(bytes <= 300, "{bytes} of 300 bytes shared out");
        assert!(seats <= 30, "{seats} of 30 seats shared out");
    }
    // Once everyone has seen everyone's demand, the split follows it.
    let shares: Vec<u64> = replicas.iter().map(|r| r.bytes().unwrap()).collect();
    assert!(shares[0] > shares[1] && shares[1] > shares[2], "{shares:?}");
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn lease_traffic_is_one_write_and_one_list_per_replica_per_renew_period() {
    let memory = Arc::new(Memory::default());
    let replicas: Vec<_> = ["a", "b", "c"]
        .iter()
        .map(|id| Replica::start(id, &memory))
        .collect();
    for r in &replicas {
        r.wants.bytes.store(5000, Ordering::SeqCst);
    }
    tokio::time::sleep(RENEW * 10 - Duration::from_millis(1)).await;
    // Rounds at 0, 2, ..., 18 s: ten each.
    assert_eq!(memory.writes.load(Ordering::SeqCst), 30);
    assert_eq!(memory.lists.load(Ordering::SeqCst), 30);
    assert_eq!(replicas[0].bytes(), Some(100), "equal demand: equal shares");
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_stopped_member_gives_its_share_back_within_the_lease_duration() {
    let memory = Arc::new(Memory::default());
    let a = Replica::start("a", &memory);
    let b = Replica::start("b", &memory);
    a.wants.bytes.store(10, Ordering::SeqCst);
    b.wants.bytes.store(10, Ordering::SeqCst);
    tokio::time::sleep(RENEW + Duration::from_millis(10)).await;
    assert_eq!(a.bytes(), Some(150));
    b.task.abort();
    // Still counted while its Lease is unexpired.
    tokio::time::sleep(LEASE - RENEW * 2).await;
    assert_eq!(a.standing(), Standing::Shared);
    // Gone within the lease duration (and one renew period for A to notice).
    tokio::time::sleep(RENEW * 2).await;
    assert_eq!(a.standing(), Standing::Alone);
    assert_eq!(a.bytes(), Some(300));
    assert_eq!(a.fleet.shares().current().members, vec!["a".to_string()]);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_replica_that_cannot_renew_falls_back_to_the_static_split_never_the_whole() {
    let memory = Arc::new(Memory::default());
    let a = Replica::start("a", &memory);
    let b = Replica::start("b", &memory);
    tokio::time::sleep(RENEW + Duration::from_millis(10)).await;
    assert_eq!(a.bytes(), Some(150));

    a.reach.down.store(true, Ordering::SeqCst);
    tokio::time::sleep(RENEW).await;
    assert_eq!(a.standing(), Standing::Static);
    assert_eq!(a.bytes(), Some(100), "the static split: 300 ÷ 3");
    assert_eq!(a.seats(), Some(10));
    assert_eq!(a.metrics.fleet_static.get(), 1);
    assert_eq!(a.metrics.fleet_members.get(), 0);
    assert!(
        a.metrics
            .fleet_renewals_total
            .with_label_values(&["error"])
            .get()
            >= 1
    );
    let debug = a.fleet.debug_json();
    assert_eq!(debug["shares"]["standing"], "static");
    assert!(
        debug["lastError"]
            .as_str()
            .is_some_and(|e| e.contains("unreachable")),
        "{debug}"
    );
    // A stays static however long it cannot reach the store; B, once A's Lease expires,
    // holds the whole.
    tokio::time::sleep(LEASE * 2).await;
    assert_eq!(a.bytes(), Some(100));
    assert_eq!(b.standing(), Standing::Alone);
    assert_eq!(b.bytes(), Some(300));

    // Reachable again: back in the fleet, and seen by B, within two renew periods.
    a.reach.down.store(false, Ordering::SeqCst);
    tokio::time::sleep(RENEW * 2 + Duration::from_millis(10)).await;
    assert_eq!(a.standing(), Standing::Shared);
    assert_eq!(a.metrics.fleet_static.get(), 0);
    assert_eq!(a.bytes().unwrap() + b.bytes().unwrap(), 300);
}

#[test]
fn an_expired_lease_is_no_member_and_a_member_absent_from_the_split_has_no_share() {
    let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_100);
    let lease = |id: &str, ago: u64| Member {
        identity: id.into(),
        renewed: now - Duration::from_secs(ago),
        duration: LEASE,
        demand: Demand::default(),
    };
    let statics = Statics {
        list_bytes: [("r0".to_string(), 100)].into(),
        seats: BTreeMap::new(),
    };
    let shares = split("a", &[lease("a", 0), lease("b", 10)], now, &statics, 3);
    assert_eq!(shares.standing, Standing::Alone);
    assert_eq!(shares.list_bytes["r0"].share, 300);
    let shares = split("a", &[lease("a", 0), lease("b", 9)], now, &statics, 3);
    assert_eq!(shares.standing, Standing::Shared);
    assert_eq!(shares.list_bytes["r0"].share, 150);
}

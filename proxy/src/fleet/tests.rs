//! The fleet loop under paused time, over an in-memory Lease store: membership, expiry,
//! the split by demand, the fallback to the static split, and Leases someone else wrote.

use std::sync::atomic::{AtomicBool, Ordering};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;

use super::lease::{LeaseError, lease_object};
use super::share::Bytes;
use super::*;
use crate::admit::flows::Flows;
use crate::rules::Rate;

/// Every Lease of the namespace, shared like the apiservers' store; each replica reaches
/// it through a [`Reach`] of its own.
#[derive(Default)]
struct Memory {
    /// By name, as the apiserver keeps them.
    leases: Mutex<BTreeMap<String, Lease>>,
    writes: std::sync::atomic::AtomicU64,
    lists: std::sync::atomic::AtomicU64,
    /// The moment every replica's wall clock counts from: they agree on the time.
    origin: std::sync::OnceLock<Instant>,
}

/// The wall clock every replica reads: it follows tokio's paused clock from the first
/// replica's start.
const BASE_SECS: u64 = 1_800_000_000;

impl Memory {
    fn now(&self) -> SystemTime {
        let start = *self.origin.get_or_init(Instant::now);
        SystemTime::UNIX_EPOCH + Duration::from_secs(BASE_SECS) + start.elapsed()
    }

    /// Creates or replaces a Lease as the apiserver does: the creation time is the
    /// server's, kept across updates, whatever the writer sent.
    fn put(&self, lease: &Lease) {
        let mut lease = lease.clone();
        let name = lease.metadata.name.clone().unwrap_or_default();
        let mut leases = self.leases.lock().unwrap();
        let created = leases
            .get(&name)
            .and_then(|old| old.metadata.creation_timestamp.clone())
            .unwrap_or_else(|| {
                let secs = self.now().duration_since(SystemTime::UNIX_EPOCH).unwrap();
                Time(Timestamp::from_second(secs.as_secs() as i64).unwrap())
            });
        lease.metadata.creation_timestamp = Some(created);
        leases.insert(name, lease);
    }
}

/// One replica's way to the store, which a test can cut.
struct Reach {
    memory: Arc<Memory>,
    down: AtomicBool,
}

impl LeaseStore for Arc<Reach> {
    fn write(&self, member: &Lease) -> crate::BoxFuture<(), LeaseError> {
        let this = self.clone();
        let member = member.clone();
        Box::pin(async move {
            if this.down.load(Ordering::SeqCst) {
                return Err(LeaseError::Unreachable);
            }
            this.memory.writes.fetch_add(1, Ordering::SeqCst);
            this.memory.put(&member);
            Ok(())
        })
    }

    fn list(&self) -> crate::BoxFuture<Vec<Lease>, LeaseError> {
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
struct Wants {
    bytes: std::sync::atomic::AtomicU64,
    /// Bytes in flight, when set apart from `bytes` (0: as many as wanted).
    in_flight: std::sync::atomic::AtomicU64,
    seats: std::sync::atomic::AtomicU64,
    /// The replica's flows (token buckets), whose demand the fleet reads.
    flows: Flows,
}

impl Default for Wants {
    fn default() -> Self {
        Self {
            bytes: Default::default(),
            in_flight: Default::default(),
            seats: Default::default(),
            flows: Flows::new(
                4,
                Duration::from_secs(300),
                crate::admit::MAX_FLOWS,
                &crate::metrics::Metrics::new(),
            ),
        }
    }
}

impl Local for Wants {
    fn demand(&self) -> Demand {
        let mut demand = Demand::default();
        let wanted = self.bytes.load(Ordering::SeqCst);
        let in_flight = match self.in_flight.load(Ordering::SeqCst) {
            0 => wanted,
            n => n,
        };
        demand
            .bytes
            .insert("r0".into(), Bytes { wanted, in_flight });
        demand
            .seats
            .insert("lists".into(), self.seats.load(Ordering::SeqCst));
        demand
    }

    fn statics(&self) -> Statics {
        Statics {
            list_bytes: [("r0".to_string(), 100)].into(),
            seats: [("lists".to_string(), 10)].into(),
            rates: BTreeMap::new(),
        }
    }

    fn rate_demand(&self) -> BTreeMap<String, share::RateAsked> {
        self.flows
            .take_rate_demand(Instant::now())
            .into_iter()
            .map(|(flow, asked, rule)| (flow, share::RateAsked { asked, rule }))
            .collect()
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

/// Replicas `a`, `b` and `c` over `memory`.
fn three(memory: &Arc<Memory>) -> Vec<Replica> {
    ["a", "b", "c"]
        .iter()
        .map(|id| Replica::start(id, memory))
        .collect()
}

/// The flow rule of the rate tests: 10 per second, a burst of 10.
const RULE: Rate = Rate {
    qps: 10.0,
    burst: 10,
};

impl Replica {
    fn start(identity: &str, memory: &Arc<Memory>) -> Replica {
        Replica::start_with(identity, memory, None)
    }

    /// A replica whose fleet signs and checks its Leases with `keys`.
    fn start_with(identity: &str, memory: &Arc<Memory>, keys: Option<Keys>) -> Replica {
        let clock = memory.clone();
        memory.now();
        let settings = Settings {
            identity: identity.into(),
            namespace: "bulwark".into(),
            prefix: "bulwark-".into(),
            keys: keys.map(|k| Arc::new(KeyFile::fixed(k))),
            accept_unsigned: false,
            renew_interval: RENEW,
            lease_duration: LEASE,
            bulwark_replicas: 3,
            clock: Arc::new(move || clock.now()),
            endpoint: None,
            admin: None,
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

    /// One request of flow `f` under `rule` at this replica: whether its bucket let it go.
    fn request(&self, rule: Rate) -> bool {
        let share = self.fleet.shares().rate_share("f");
        self.wants
            .flows
            .check_rate("f", 7, rule, share, Instant::now())
            .is_ok()
    }
}

/// Flow `f`'s requests admitted over `measure` across `replicas`, each sent requests
/// at its own steady rate (per second), after `warm` to let the fleet see the demand.
async fn admitted(
    replicas: &[Replica],
    offered: &[f64],
    rule: Rate,
    warm: Duration,
    measure: Duration,
) -> u64 {
    let tick = Duration::from_millis(5);
    let mut due: Vec<f64> = vec![0.0; replicas.len()];
    let mut ok = 0;
    let start = Instant::now();
    while start.elapsed() < warm + measure {
        let counting = start.elapsed() >= warm;
        for ((r, &rate), due) in replicas.iter().zip(offered).zip(due.iter_mut()) {
            *due += rate * tick.as_secs_f64();
            while *due >= 1.0 {
                *due -= 1.0;
                if r.request(rule) && counting {
                    ok += 1;
                }
            }
        }
        tokio::time::sleep(tick).await;
    }
    ok
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_flow_s_rate_holds_across_the_fleet_whether_its_clients_are_pinned_or_spread() {
    let memory = Arc::new(Memory::default());
    let replicas = three(&memory);
    let rule = RULE;
    let minute = Duration::from_secs(60);
    let within = |ok: u64, what: &str| {
        let rate = ok as f64 / 60.0;
        eprintln!("{what}: {rate:.2} per second");
        assert!(
            (rate - rule.qps).abs() <= rule.qps * 0.15,
            "{what}: {rate:.2} requests per second admitted over the fleet, rule {}",
            rule.qps
        );
    };
    // Three times the rule, pinned 70/20/10 over the three replicas.
    let ok = admitted(&replicas, &[21.0, 6.0, 3.0], rule, RENEW * 5, minute).await;
    within(ok, "pinned 70/20/10");
    // Spread evenly.
    let ok = admitted(&replicas, &[10.0, 10.0, 10.0], rule, RENEW * 5, minute).await;
    within(ok, "spread evenly");
    // All on one replica: it holds the whole rule once the others stop reporting the flow.
    let ok = admitted(&replicas, &[30.0, 0.0, 0.0], rule, RENEW * 5, minute).await;
    within(ok, "on one replica");
    assert_eq!(replicas[0].fleet.shares().rate_share("f"), None);
    // Just above the rule, pinned: what each replica asks for is nearly what it may use.
    let ok = admitted(&replicas, &[8.4, 2.4, 1.2], rule, RENEW * 5, minute).await;
    within(ok, "1.2 times the rule, pinned 70/20/10");
    let debug = replicas[1].fleet.debug_json();
    assert!(
        debug["shares"]["rates"]["f"]["share"].as_u64().is_some(),
        "{debug}"
    );
    assert_eq!(replicas[1].metrics.fleet_rate_flows.get(), 1);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn without_the_fleet_each_replica_gives_the_whole_rule() {
    // What the test above guards against: the same pinned load on three replicas that do
    // not share the flow's rate admits nearly twice the rule.
    let memory = Arc::new(Memory::default());
    let replicas = three(&memory);
    let rule = RULE;
    for r in &replicas {
        r.task.abort();
    }
    let ok = admitted(
        &replicas,
        &[21.0, 6.0, 3.0],
        rule,
        RENEW,
        Duration::from_secs(60),
    )
    .await;
    let rate = ok as f64 / 60.0;
    assert!(rate > 18.0, "{rate:.2}");
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

    a.wants.bytes.store(100, Ordering::SeqCst);
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
    b.wants.bytes.store(300, Ordering::SeqCst);
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
    let replicas = three(&memory);
    tokio::time::sleep(RENEW * 2).await;
    let total = |replicas: &[Replica]| replicas.iter().map(|r| r.bytes().unwrap()).sum::<u64>();
    assert_eq!(total(&replicas), 300, "idle: equal thirds");
    // Each below the whole: a demand past it counts as the whole.
    for (r, wants) in replicas.iter().zip([250u64, 150, 50]) {
        r.wants.bytes.store(wants, Ordering::SeqCst);
        r.wants.seats.store(wants / 10, Ordering::SeqCst);
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
async fn one_member_per_apiserver_may_run_a_list_bigger_than_its_share() {
    // Each member may run a LIST bigger than its share alone: three members would put three
    // such LISTs on one apiserver. In a fleet the members that ask take turns of 10 s, and
    // none starts one while another runs one.
    let memory = Arc::new(Memory::default());
    let replicas = three(&memory);
    let alone = |replicas: &[Replica]| -> Vec<bool> {
        replicas
            .iter()
            .map(|r| r.fleet.shares().may_run_alone("r0"))
            .collect()
    };
    assert_eq!(
        alone(&replicas),
        vec![true; 3],
        "before the first renewal: each its own"
    );
    // B and C ask; none runs one yet (in flight within their shares).
    for r in &replicas[1..] {
        r.wants.bytes.store(500, Ordering::SeqCst);
        r.wants.in_flight.store(1, Ordering::SeqCst);
    }
    let mut holders = Vec::new();
    for _ in 0..6 {
        tokio::time::sleep(share::ALONE_TURN / 2).await;
        let now = alone(&replicas);
        assert_eq!(
            now.iter().filter(|a| **a).count(),
            1,
            "one at a time: {now:?}"
        );
        assert!(!now[0], "A asks for nothing: {now:?}");
        holders.push(now.iter().position(|a| *a).unwrap());
    }
    holders.dedup();
    assert!(
        holders.len() >= 2,
        "the turn moves between B and C: {holders:?}"
    );
    // C runs one (more in flight than its share): nobody else may start one.
    replicas[2].wants.in_flight.store(400, Ordering::SeqCst);
    tokio::time::sleep(RENEW * 2).await;
    for _ in 0..4 {
        assert!(!alone(&replicas)[1], "B waits while C runs one");
        tokio::time::sleep(share::ALONE_TURN / 2).await;
    }
    replicas[2].reach.down.store(true, Ordering::SeqCst);
    tokio::time::sleep(RENEW).await;
    assert_eq!(replicas[2].standing(), Standing::Static);
    assert!(
        replicas[2].fleet.shares().may_run_alone("r0"),
        "on the static split, as without a fleet"
    );
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn lease_traffic_is_one_write_and_one_list_per_replica_per_renew_period() {
    let memory = Arc::new(Memory::default());
    let replicas = three(&memory);
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
async fn a_dead_member_s_share_comes_back_the_moment_its_lease_runs_out() {
    let memory = Arc::new(Memory::default());
    let a = Replica::start("a", &memory);
    tokio::time::sleep(Duration::from_secs(1)).await;
    // B renews at 1 s, 3 s, ...; A at 0 s, 2 s, ...
    let b = Replica::start("b", &memory);
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(a.bytes(), Some(150));
    // Killed at 3.5 s: its last renewal at 3 s runs out at 13 s, between A's renewals at
    // 12 s and 14 s.
    b.task.abort();
    tokio::time::sleep_until(Instant::now() + Duration::from_millis(9_490)).await;
    assert_eq!(
        a.standing(),
        Standing::Shared,
        "B's Lease still counts at 12.99 s"
    );
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(
        a.standing(),
        Standing::Alone,
        "gone at 13 s, not at A's next renewal"
    );
    assert_eq!(a.bytes(), Some(300));
    assert_eq!(a.metrics.fleet_members.get(), 1);
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
        created: None,
        demand: Demand::default(),
    };
    let statics = Statics {
        list_bytes: [("r0".to_string(), 100)].into(),
        seats: BTreeMap::new(),
        rates: BTreeMap::new(),
    };
    let shares = split("a", &[lease("a", 0), lease("b", 10)], now, &statics, 3);
    assert_eq!(shares.standing, Standing::Alone);
    assert_eq!(shares.list_bytes["r0"].share, 300);
    let shares = split("a", &[lease("a", 0), lease("b", 9)], now, &statics, 3);
    assert_eq!(shares.standing, Standing::Shared);
    assert_eq!(shares.list_bytes["r0"].share, 150);
}

/// A Lease someone other than the fleet wrote: named `name`, held by `holder`, renewed
/// `ahead` of now, counting for `duration`, asking for `demand`, signed with `keys`.
struct Forged {
    name: &'static str,
    holder: &'static str,
    ahead: Duration,
    duration: Duration,
    demand: Demand,
    keys: Option<Keys>,
}

/// Far more than any budget: what a forger asks for.
const HUGE: u64 = u64::MAX / 4;

/// A demand of [`HUGE`] bytes and seats, and of `rates`.
fn huge(rates: &[(&str, u64)]) -> Demand {
    let mut demand = Demand::default();
    demand.bytes.insert(
        "r0".into(),
        Bytes {
            wanted: HUGE,
            in_flight: 0,
        },
    );
    demand.seats.insert("lists".into(), HUGE);
    demand.rates = rates.iter().map(|(f, r)| (f.to_string(), *r)).collect();
    demand
}

impl Forged {
    /// Writes it now, as its writer would on every one of its renewals.
    fn write(&self, memory: &Memory) {
        let member = Member {
            identity: self.holder.into(),
            renewed: memory.now() + self.ahead,
            duration: self.duration,
            created: None,
            demand: self.demand.clone(),
        };
        memory.put(&lease_object(
            self.name,
            "bulwark",
            &member,
            None,
            self.keys.as_ref(),
        ));
    }

    /// Written now and again every renew period for as long as the test runs.
    fn keep_writing(self, memory: &Arc<Memory>) -> JoinHandle<()> {
        let memory = memory.clone();
        tokio::spawn(async move {
            loop {
                self.write(&memory);
                tokio::time::sleep(RENEW).await;
            }
        })
    }
}

/// What each of `replicas` holds now: its bytes and seats, and their sums as a multiple of
/// the whole (300 bytes, 30 seats). Printed for the record.
fn held(what: &str, replicas: &[Replica]) -> (Vec<u64>, Vec<u32>, f64, f64) {
    let bytes: Vec<u64> = replicas.iter().map(|r| r.bytes().unwrap()).collect();
    let seats: Vec<u32> = replicas.iter().map(|r| r.seats().unwrap()).collect();
    let bytes_sum = bytes.iter().sum::<u64>() as f64 / 300.0;
    let seats_sum = f64::from(seats.iter().sum::<u32>()) / 30.0;
    eprintln!(
        "{what}: bytes {bytes:?} (sum {bytes_sum:.2}x the whole), seats {seats:?} (sum {seats_sum:.2}x)"
    );
    (bytes, seats, bytes_sum, seats_sum)
}

/// Replicas `a`, `b` and `c`, each asking for 200 bytes and 12 seats (together twice the
/// whole), signing with `keys`, after three renew periods.
async fn busy_three(memory: &Arc<Memory>, keys: Option<Keys>) -> Vec<Replica> {
    let replicas: Vec<Replica> = ["a", "b", "c"]
        .iter()
        .map(|id| Replica::start_with(id, memory, keys.clone()))
        .collect();
    for r in &replicas {
        r.wants.bytes.store(200, Ordering::SeqCst);
        r.wants.seats.store(12, Ordering::SeqCst);
    }
    tokio::time::sleep(RENEW * 3).await;
    replicas
}

fn rejected(r: &Replica, reason: &str) -> u64 {
    r.metrics
        .fleet_leases_rejected_total
        .with_label_values(&[reason])
        .get()
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_lease_renewed_a_year_ahead_with_a_huge_demand_cuts_no_member() {
    let memory = Arc::new(Memory::default());
    let replicas = busy_three(&memory, None).await;
    let year = Duration::from_secs(365 * 24 * 3600);
    Forged {
        name: "bulwark-x",
        holder: "x",
        ahead: year,
        duration: LEASE,
        demand: huge(&[]),
        keys: None,
    }
    .write(&memory);
    tokio::time::sleep(RENEW * 3).await;
    let (bytes, seats, ..) = held("renewed a year ahead", &replicas);
    assert_eq!(
        bytes,
        vec![100; 3],
        "equal demand: equal thirds, as if unwritten"
    );
    assert_eq!(seats, vec![10; 3]);
    for r in &replicas {
        assert_eq!(r.fleet.shares().current().members, ["a", "b", "c"]);
        assert!(rejected(r, "future") >= 1);
    }
    let debug = replicas[0].fleet.debug_json();
    assert_eq!(
        debug["rejected"],
        json!([{ "name": "bulwark-x", "reason": "future" }]),
        "{debug}"
    );
    assert_eq!(debug["authenticated"], false);

    // Counting for a year from now instead: too long a duration.
    Forged {
        name: "bulwark-x",
        holder: "x",
        ahead: Duration::ZERO,
        duration: year,
        demand: huge(&[]),
        keys: None,
    }
    .write(&memory);
    tokio::time::sleep(RENEW * 2).await;
    let (bytes, seats, ..) = held("counting for a year", &replicas);
    assert_eq!((bytes, seats), (vec![100; 3], vec![10; 3]));
    assert!(rejected(&replicas[1], "duration") >= 1);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_well_formed_lease_with_a_huge_demand_takes_no_more_than_a_floor() {
    // Shaped as a member's in every way, renewed as often: without a key nothing tells it
    // from one. But a fleet of `bulwarkReplicas` members counts only the demand of the
    // oldest Leases, and no demand counts past the whole.
    let memory = Arc::new(Memory::default());
    let replicas = busy_three(&memory, None).await;
    let forger = Forged {
        name: "bulwark-x",
        holder: "x",
        ahead: Duration::ZERO,
        duration: LEASE,
        demand: huge(&[]),
        keys: None,
    }
    .keep_writing(&memory);
    tokio::time::sleep(RENEW * 3).await;
    let (bytes, seats, bytes_sum, seats_sum) = held("a fourth, well-formed Lease", &replicas);
    // Four members: a floor of 10% of a quarter (7 bytes, 1 seat) each, the rest to the
    // three whose demand counts.
    assert_eq!(bytes, vec![7 + 90; 3]);
    assert_eq!(seats, vec![1 + 8; 3]);
    assert!(bytes_sum <= 1.0 && seats_sum <= 1.0);
    for r in &replicas {
        assert_eq!(r.fleet.shares().current().uncounted, ["x"]);
        assert_eq!(r.metrics.fleet_uncounted_members.get(), 1);
    }
    forger.abort();
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_forged_rate_entry_throttles_no_flow() {
    let memory = Arc::new(Memory::default());
    let replicas = three(&memory);
    // An operator's flow `f`, 8 requests a second on A, under a rule of 10.
    let offered = [8.0, 0.0, 0.0];
    let minute = Duration::from_secs(60);
    let refused = |ok: u64| 1.0 - ok as f64 / (8.0 * 60.0);
    let ok = admitted(&replicas, &offered, RULE, RENEW * 3, minute).await;
    eprintln!("no forged Lease: {:.0}% refused", refused(ok) * 100.0);
    let forger = Forged {
        name: "bulwark-x",
        holder: "x",
        ahead: Duration::ZERO,
        duration: LEASE,
        demand: huge(&[("f", HUGE)]),
        keys: None,
    }
    .keep_writing(&memory);
    let ok = admitted(&replicas, &offered, RULE, RENEW * 3, minute).await;
    eprintln!(
        "a forged rate entry for f: {:.0}% refused, A's share of f {:?}",
        refused(ok) * 100.0,
        replicas[0].fleet.shares().rate_share("f")
    );
    assert!(refused(ok) < 0.02, "{:.1}% refused", refused(ok) * 100.0);
    assert_eq!(replicas[0].fleet.shares().rate_share("f"), None);
    forger.abort();
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_lease_naming_a_real_member_as_holder_never_shares_out_more_than_the_whole() {
    let memory = Arc::new(Memory::default());
    let replicas = busy_three(&memory, None).await;
    // Idle A, for B and C; renewed ahead of A's own renewals so that it wins.
    let forger = Forged {
        name: "bulwark-x",
        holder: "a",
        ahead: Duration::from_secs(1),
        duration: LEASE,
        demand: Demand::default(),
        keys: None,
    }
    .keep_writing(&memory);
    for _ in 0..16 {
        tokio::time::sleep(RENEW / 2).await;
        let (_, _, bytes_sum, seats_sum) = held("a Lease held by A, named otherwise", &replicas);
        assert!(bytes_sum <= 1.0, "{bytes_sum:.2}x the bytes");
        assert!(seats_sum <= 1.0, "{seats_sum:.2}x the seats");
    }
    let (bytes, seats, ..) = held("a Lease held by A, named otherwise", &replicas);
    assert_eq!((bytes, seats), (vec![100; 3], vec![10; 3]));
    assert!(rejected(&replicas[2], "name") >= 1);
    forger.abort();
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn with_a_key_only_the_fleet_s_own_leases_count() {
    let memory = Arc::new(Memory::default());
    let key = Keys::parse(b"the fleet's key: 32 bytes or more").unwrap();
    let replicas = busy_three(&memory, Some(key.clone())).await;
    let (bytes, seats, ..) = held("signed", &replicas);
    assert_eq!((bytes, seats), (vec![100; 3], vec![10; 3]));
    // Well-formed, renewed on time, and signed with another key; or overwriting A's own
    // Lease; or a fourth replica without the key.
    let other = Keys::parse(b"not the fleet's key, as long as it").unwrap();
    let forgers = [
        Forged {
            name: "bulwark-x",
            holder: "x",
            ahead: Duration::ZERO,
            duration: LEASE,
            demand: huge(&[("f", HUGE)]),
            keys: Some(other),
        },
        Forged {
            name: "bulwark-a",
            holder: "a",
            ahead: Duration::from_secs(1),
            duration: LEASE,
            demand: Demand::default(),
            keys: None,
        },
    ]
    .map(|f| f.keep_writing(&memory));
    let unkeyed = Replica::start("d", &memory);
    for _ in 0..8 {
        tokio::time::sleep(RENEW / 2).await;
        let (_, _, bytes_sum, seats_sum) = held("with unsigned Leases", &replicas);
        assert!(bytes_sum <= 1.0 && seats_sum <= 1.0);
    }
    for r in &replicas {
        let members = r.fleet.shares().current().members.clone();
        assert!(members.iter().all(|m| m != "x" && m != "d"), "{members:?}");
        assert!(rejected(r, "signature") >= 1);
        assert_eq!(r.fleet.shares().rate_share("f"), None);
    }
    // B and C: A's own Lease, overwritten, no longer counts, so they split without it
    // until A renews.
    let debug = replicas[1].fleet.debug_json();
    assert_eq!(debug["authenticated"], true);
    let names: Vec<&str> = debug["rejected"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].as_str().unwrap())
        .collect();
    assert!(
        names.contains(&"bulwark-x") && names.contains(&"bulwark-d"),
        "{debug}"
    );
    for f in forgers {
        f.abort();
    }
    unkeyed.task.abort();
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_rollout_past_bulwark_replicas_keeps_the_newest_member_on_a_floor() {
    // A fourth replica surging in a rollout: its Lease is the newest, so its demand waits
    // until an old one's Lease runs out; the shares never add up past the whole.
    let memory = Arc::new(Memory::default());
    let replicas = busy_three(&memory, None).await;
    let d = Replica::start("d", &memory);
    d.wants.bytes.store(200, Ordering::SeqCst);
    d.wants.seats.store(12, Ordering::SeqCst);
    tokio::time::sleep(RENEW * 3).await;
    assert_eq!(d.fleet.shares().current().uncounted, ["d"]);
    assert_eq!(d.bytes(), Some(7), "a floor: 10% of a quarter");
    let all: Vec<Replica> = replicas.into_iter().chain([d]).collect();
    let (_, _, bytes_sum, seats_sum) = held("a fourth replica", &all);
    assert!(bytes_sum <= 1.0 && seats_sum <= 1.0);
    // A stops: D's demand counts once A's Lease runs out.
    all[0].task.abort();
    tokio::time::sleep(LEASE + RENEW * 2).await;
    assert!(all[3].fleet.shares().current().uncounted.is_empty());
    assert_eq!(all[3].bytes(), Some(100));
    assert_eq!(all[3].metrics.fleet_uncounted_members.get(), 0);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn without_a_key_a_forged_lease_in_a_fleet_short_of_replicas_counts_as_one_member_more() {
    // What the shape checks cannot stop: two replicas of three running, and a third Lease
    // shaped as a member's. Its demand counts, but for no more than the whole: it takes
    // what a member asking for everything would, and no flow's rule more than once.
    let memory = Arc::new(Memory::default());
    let replicas: Vec<Replica> = ["a", "b"]
        .iter()
        .map(|id| Replica::start(id, &memory))
        .collect();
    for r in &replicas {
        r.wants.bytes.store(200, Ordering::SeqCst);
        r.wants.seats.store(12, Ordering::SeqCst);
    }
    let offered = [8.0, 0.0];
    let minute = Duration::from_secs(60);
    let refused = |ok: u64| 1.0 - ok as f64 / (8.0 * 60.0);
    let forger = Forged {
        name: "bulwark-x",
        holder: "x",
        ahead: Duration::ZERO,
        duration: LEASE,
        demand: huge(&[("f", HUGE)]),
        keys: None,
    }
    .keep_writing(&memory);
    let ok = admitted(&replicas, &offered, RULE, RENEW * 3, minute).await;
    let (bytes, seats, ..) = held("two of three, and a forged Lease", &replicas);
    // A floor of 10 bytes and 1 seat each; the rest by demand, the forger's at the whole
    // (300 bytes, 30 seats): 270 × 200 / 700 and 27 × 12 / 54.
    assert_eq!(bytes, vec![10 + 77; 2]);
    assert_eq!(seats, vec![1 + 6; 2]);
    let share = replicas[0].fleet.shares().rate_share("f").unwrap();
    eprintln!(
        "a forged rate entry for f, two of three: {:.0}% refused, A's share of f {share:.2}",
        refused(ok) * 100.0
    );
    // f's rule is 10 a second: the forger's report counts as 10, against A's 8.
    assert!((share - 0.45).abs() < 0.01, "{share}");
    forger.abort();
}

#[test]
fn a_key_file_that_cannot_be_used_stops_the_start_and_says_why() {
    let dir = tempfile::tempdir().unwrap();
    let config = |key_file: &Path| crate::config::Fleet {
        namespace: "bulwark".into(),
        lease_prefix: "bulwark-".into(),
        identity: Some("node-a".into()),
        renew_interval: RENEW,
        lease_duration: LEASE,
        key_file: Some(key_file.to_path_buf()),
        accept_unsigned: false,
        kubernetes_service: None,
    };
    let missing = dir.path().join("missing");
    let error = Settings::from_config(&config(&missing), 3).err().unwrap();
    assert!(
        error
            .to_string()
            .starts_with(&missing.display().to_string()),
        "{error}"
    );
    let short = dir.path().join("short");
    std::fs::write(&short, "a key too short\n").unwrap();
    let error = Settings::from_config(&config(&short), 3).err().unwrap();
    assert_eq!(error.to_string(), "key on line 1 is 15 bytes: at least 32");
    let good = dir.path().join("good");
    std::fs::write(&good, "0123456789abcdef0123456789abcdef0123\n").unwrap();
    let settings = Settings::from_config(&config(&good), 3).unwrap();
    assert!(settings.keys.is_some());
    assert_eq!(settings.lease_name(), "bulwark-node-a");
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_key_is_rotated_without_a_restart_by_listing_it_second_first() {
    let dir = tempfile::tempdir().unwrap();
    let (old, new) = ("o".repeat(40), "n".repeat(40));
    let files = [dir.path().join("a"), dir.path().join("b")];
    let write = |file: &Path, keys: &[&str]| std::fs::write(file, keys.join("\n")).unwrap();
    for file in &files {
        write(file, &[&old]);
    }
    let memory = Arc::new(Memory::default());
    let replicas: Vec<Replica> = ["a", "b"]
        .iter()
        .zip(&files)
        .map(|(id, file)| {
            let replica = Replica::start_with(id, &memory, None);
            replica.task.abort();
            let mut settings = replica.fleet.settings.clone();
            settings.keys = Some(Arc::new(KeyFile::open(file).unwrap()));
            let (fleet, task) = Fleet::spawn(
                settings,
                Arc::new(replica.reach.clone()),
                replica.wants.clone(),
                FleetShares::new(),
                replica.metrics.clone(),
            );
            Replica {
                fleet,
                task,
                ..replica
            }
        })
        .collect();
    let both_count_both = |replicas: &[Replica], when: &str| {
        for r in replicas {
            assert_eq!(
                r.fleet.shares().current().members,
                ["a", "b"],
                "{when}: {}",
                r.fleet.debug_json()
            );
            assert_eq!(rejected(r, "signature"), 0, "{when}");
        }
    };
    tokio::time::sleep(RENEW * 2).await;
    both_count_both(&replicas, "one key");
    // The new key second everywhere, then first on A only (B's copy not updated yet),
    // then first on B, then alone.
    for (file, keys) in [
        (&files[0], vec![old.as_str(), new.as_str()]),
        (&files[1], vec![old.as_str(), new.as_str()]),
        (&files[0], vec![new.as_str(), old.as_str()]),
        (&files[1], vec![new.as_str(), old.as_str()]),
        (&files[0], vec![new.as_str()]),
        (&files[1], vec![new.as_str()]),
    ] {
        write(file, &keys);
        tokio::time::sleep(RENEW * 2).await;
        both_count_both(
            &replicas,
            &format!("{} holds {}", file.display(), keys.len()),
        );
    }
    // The new key first on A while B knows only the old one: B rejects A's Lease.
    write(&files[0], &[&old]);
    tokio::time::sleep(RENEW * 2).await;
    assert!(rejected(&replicas[1], "signature") >= 1);
    assert_eq!(replicas[1].fleet.shares().current().members, ["b"]);
    // An unreadable file keeps the keys read before.
    std::fs::remove_file(&files[1]).unwrap();
    write(&files[0], &[&new]);
    tokio::time::sleep(RENEW * 2).await;
    assert_eq!(replicas[1].fleet.shares().current().members, ["a", "b"]);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn the_key_is_turned_on_replica_by_replica_without_a_share_past_the_whole() {
    // A DaemonSet rolls a new configuration one node at a time. A replica that requires
    // the key at once rejects the Leases of those not yet rolled and takes their shares; one
    // that also accepts unsigned Leases does not.
    let key = Keys::parse(b"the fleet's key: 32 bytes or more").unwrap();
    for (accept_unsigned, past_the_whole) in [(false, true), (true, false)] {
        let memory = Arc::new(Memory::default());
        let rolled = Replica::start_with("a", &memory, Some(key.clone()));
        rolled.task.abort();
        let mut settings = rolled.fleet.settings.clone();
        settings.accept_unsigned = accept_unsigned;
        let (fleet, task) = Fleet::spawn(
            settings,
            Arc::new(rolled.reach.clone()),
            rolled.wants.clone(),
            FleetShares::new(),
            rolled.metrics.clone(),
        );
        let rolled = Replica {
            fleet,
            task,
            ..rolled
        };
        let not_yet: Vec<Replica> = ["b", "c"]
            .iter()
            .map(|id| Replica::start(id, &memory))
            .collect();
        let all: Vec<Replica> = [rolled].into_iter().chain(not_yet).collect();
        for r in &all {
            r.wants.bytes.store(200, Ordering::SeqCst);
            r.wants.seats.store(12, Ordering::SeqCst);
        }
        tokio::time::sleep(RENEW * 3).await;
        let (_, _, bytes_sum, _) = held(
            &format!("one of three with the key, acceptUnsigned {accept_unsigned}"),
            &all,
        );
        assert_eq!(bytes_sum > 1.0, past_the_whole, "{bytes_sum:.2}x");
    }
}

#[test]
fn the_admin_url_a_lease_publishes_names_an_address_others_can_dial() {
    let at = |a: &str| a.parse::<std::net::SocketAddr>().unwrap();
    assert_eq!(
        admin_url(at("10.0.0.5:9443"), true, None).as_deref(),
        Some("https://10.0.0.5:9443")
    );
    assert_eq!(
        admin_url(at("0.0.0.0:9443"), true, Some("10.1.2.3".into())).as_deref(),
        Some("https://10.1.2.3:9443"),
        "every address: the pod's"
    );
    assert_eq!(
        admin_url(at("[::]:9090"), false, Some("fd00::7".into())).as_deref(),
        Some("http://[fd00::7]:9090")
    );
    assert_eq!(admin_url(at("0.0.0.0:9443"), true, None), None, "no POD_IP");
    assert_eq!(
        admin_url(at("0.0.0.0:9443"), true, Some("pod".into())),
        None
    );
    assert_eq!(
        admin_url(at("127.0.0.1:0"), false, None),
        None,
        "port picked at bind"
    );
}

#[test]
fn a_lease_s_admin_url_travels_in_its_demand_and_older_demands_still_read() {
    let demand = Demand {
        admin: Some("https://10.0.0.5:9443".into()),
        ..Demand::default()
    };
    let text = serde_json::to_string(&demand).unwrap();
    assert_eq!(text, r#"{"a":"https://10.0.0.5:9443"}"#);
    let old: Demand = serde_json::from_str(r#"{"s":{"lists":3}}"#).unwrap();
    assert_eq!(old.admin, None);
}

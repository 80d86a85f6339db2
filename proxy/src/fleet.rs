//! The fleet of Bulwark replicas in front of the same apiservers, keeping one budget.
//!
//! Each replica renews a `coordination.k8s.io/v1` Lease every renew period, carrying its
//! recent demand ([`share::Demand`]), and reads everyone's with one LIST. The live members
//! are the unexpired Leases; each apiserver replica's in-flight LIST byte budget and each
//! level's seats are split among them by demand ([`share::split`]). Admission reads the
//! result from a [`FleetShares`] snapshot, with no lock on the request path.
//!
//! The fleet's whole of a budget is the static share times `bulwarkReplicas` (heap
//! headroom ÷ 5 for an apiserver replica's bytes; the level's `seats` times
//! `bulwarkReplicas` for its seats). A replica alone gets the whole; a replica that cannot
//! renew or read the Leases takes the static share (whole ÷ `bulwarkReplicas`), never the
//! whole, since it cannot know who else is serving.
//!
//! Anyone allowed to write Leases in the namespace can write one that looks like a member's,
//! so a Lease counts only if [`lease::Check`] accepts it (named the prefix plus its holder,
//! counting no longer than `leaseDuration`, renewed no further ahead than a clock's skew
//! and, with `fleet.keyFile`, signed with the fleet's key); only the `bulwarkReplicas`
//! oldest members' demand counts; and no demand counts for more than the whole it asks of.

pub mod endpoints;
pub mod lease;
pub mod share;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use serde::Serialize;
use serde_json::json;
use tokio::task::JoinHandle;
use tokio::time::{Instant, MissedTickBehavior};

use self::lease::{Check, KeyError, Keys, LeaseStore, Rejection, Verdict};
use self::share::{Demand, Held, Member};
use crate::metrics::Metrics;
use crate::own;

/// Where this replica stands in the fleet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum Standing {
    /// The static split (whole ÷ `bulwarkReplicas`): before the first renewal, or the
    /// Leases could not be written or read.
    Static,
    /// No other live Lease: the whole.
    Alone,
    /// Split by demand with the other live members.
    Shared,
}

/// What this replica holds now, and why. Published whole after every renewal.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Shares {
    /// Where this replica stands.
    pub standing: Standing,
    /// Why, in words.
    pub reason: String,
    /// The live members' identities (this replica's among them), sorted.
    pub members: Vec<String>,
    /// The members beyond `bulwarkReplicas` (the newest Leases), whose demand does not
    /// count: each keeps a floor.
    pub uncounted: Vec<String>,
    /// Per apiserver replica (configured address): this replica's in-flight LIST bytes.
    pub list_bytes: BTreeMap<String, Held>,
    /// Per level: this replica's seats.
    pub seats: BTreeMap<String, Held>,
    /// Per flow another member also serves: this replica's share of the rule's rate, in
    /// millionths ([`share::RATE_WHOLE`]). A flow not here may use its whole rule.
    pub rates: BTreeMap<String, Held>,
    /// The apiserver replicas where this replica may run a LIST bigger than its share
    /// alone. Shared: those where it has the turn ([`share::may_run_alone`]: one member at a
    /// time, and none while another runs one), so that the fleet runs one such LIST per
    /// apiserver, not one per member. Alone or static: every one.
    pub alone: std::collections::BTreeSet<String>,
}

impl Shares {
    /// The static split of `statics`, for `reason`.
    fn static_split(statics: &Statics, replicas: u64, reason: String) -> Shares {
        let held = |&share: &u64| Held {
            share,
            whole: share.saturating_mul(replicas),
            demand: 0,
            fleet_demand: 0,
        };
        Shares {
            standing: Standing::Static,
            reason,
            members: Vec::new(),
            uncounted: Vec::new(),
            list_bytes: statics
                .list_bytes
                .iter()
                .map(|(k, v)| (k.clone(), held(v)))
                .collect(),
            seats: statics
                .seats
                .iter()
                .map(|(k, v)| (k.clone(), held(v)))
                .collect(),
            // Rates are about fairness between clients, not the apiservers' memory: a
            // replica that cannot see its fleet gives each flow its whole rule, as a
            // Bulwark alone does, rather than throttle a client pinned to it to a third.
            rates: BTreeMap::new(),
            alone: statics.list_bytes.keys().cloned().collect(),
        }
    }
}

/// The current shares, read by admission on the request path. Cheap to clone.
#[derive(Clone)]
pub struct FleetShares(Arc<ArcSwap<Shares>>);

impl FleetShares {
    /// Shares that say "static" until the fleet publishes its first.
    pub fn new() -> Self {
        Self(Arc::new(ArcSwap::from_pointee(Shares {
            standing: Standing::Static,
            reason: "no renewal yet".into(),
            members: Vec::new(),
            uncounted: Vec::new(),
            list_bytes: BTreeMap::new(),
            seats: BTreeMap::new(),
            rates: BTreeMap::new(),
            alone: Default::default(),
        })))
    }

    /// This replica's in-flight LIST bytes on the apiserver replica `replica`; `None`:
    /// the static budget.
    pub fn list_bytes(&self, replica: &str) -> Option<u64> {
        self.0.load().list_bytes.get(replica).map(|h| h.share)
    }

    /// This replica's seats in `level`; `None`: the level's configured seats.
    pub fn seats(&self, level: &str) -> Option<u32> {
        self.0
            .load()
            .seats
            .get(level)
            .map(|h| u32::try_from(h.share).unwrap_or(u32::MAX))
    }

    /// Whether this replica may run a LIST bigger than its share of `replica`'s bytes when
    /// it has nothing else in flight there: outside a shared fleet always (before the
    /// first renewal, alone, or on the static split).
    pub fn may_run_alone(&self, replica: &str) -> bool {
        let shares = self.0.load();
        shares.standing != Standing::Shared || shares.alone.contains(replica)
    }

    /// The fraction of its rule's rate `flow` may use on this replica; `None`: all of it.
    pub fn rate_share(&self, flow: &str) -> Option<f64> {
        self.0
            .load()
            .rates
            .get(flow)
            .map(|h| h.share as f64 / share::RATE_WHOLE as f64)
    }

    /// The whole snapshot.
    pub fn current(&self) -> Arc<Shares> {
        self.0.load_full()
    }

    fn publish(&self, shares: Shares) {
        self.0.store(Arc::new(shares));
    }
}

impl Default for FleetShares {
    fn default() -> Self {
        Self::new()
    }
}

/// This replica's static shares (what it takes without the fleet): per apiserver replica
/// its LIST bytes, per level its seats.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Statics {
    /// Per apiserver replica (configured address).
    pub list_bytes: BTreeMap<String, u64>,
    /// Per level (exempt levels have none).
    pub seats: BTreeMap<String, u64>,
    /// Per flow this replica reported: its rule's rate, in thousandths of a request per
    /// second (what any member's report of the flow counts for at most).
    pub rates: BTreeMap<String, u64>,
}

/// What the fleet reads of this replica.
pub trait Local: Send + Sync + 'static {
    /// Its demand now: LIST bytes and seats, sampled a few times per renewal.
    fn demand(&self) -> Demand;
    /// The rates its flows asked for since the last call, with their rules', once per
    /// renewal (see [`Demand::rates`]).
    fn rate_demand(&self) -> BTreeMap<String, share::RateAsked> {
        BTreeMap::new()
    }
    /// Its static shares now (levels come and go with rule reloads).
    fn statics(&self) -> Statics;
    /// The shares changed: waiting requests may go now.
    fn shares_changed(&self) {}
}

/// The fleet's HMAC keys (`fleet.keyFile`), read again every round so that a rotated
/// Secret is used without a restart; a file that cannot be read then keeps the keys read
/// before.
pub struct KeyFile {
    path: Option<PathBuf>,
    keys: Mutex<(Keys, Option<String>)>,
}

impl KeyFile {
    /// The keys in the file at `path`, which must be readable now.
    pub fn open(path: &Path) -> Result<KeyFile, KeyError> {
        Ok(KeyFile {
            path: Some(path.to_path_buf()),
            keys: Mutex::new((Keys::read(path)?, None)),
        })
    }

    /// `keys`, never read again (tests).
    pub fn fixed(keys: Keys) -> KeyFile {
        KeyFile {
            path: None,
            keys: Mutex::new((keys, None)),
        }
    }

    /// The keys now.
    fn current(&self) -> Keys {
        let mut held = self.keys.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(path) = &self.path {
            match Keys::read(path) {
                Ok(keys) => *held = (keys, None),
                Err(e) => {
                    let why = e.to_string();
                    // Once per new failure, not every renew period.
                    if held.1.as_deref() != Some(why.as_str()) {
                        tracing::warn!(error = %why, "fleet.keyFile: keeping the keys read before");
                        held.1 = Some(why);
                    }
                }
            }
        }
        held.0.clone()
    }
}

/// How the fleet runs.
#[derive(Clone)]
pub struct Settings {
    /// This replica's identity.
    pub identity: String,
    /// The Leases' namespace.
    pub namespace: String,
    /// Every member's Lease is named this followed by its identity.
    pub prefix: String,
    /// The fleet's keys: `None`, Leases are unauthenticated.
    pub keys: Option<Arc<KeyFile>>,
    /// With keys, Leases without a MAC count too (`fleet.acceptUnsigned`).
    pub accept_unsigned: bool,
    /// How often the Lease is renewed and the others' read.
    pub renew_interval: Duration,
    /// How long a renewal counts.
    pub lease_duration: Duration,
    /// `upstream.bulwarkReplicas`: the whole is the static share times this.
    pub bulwark_replicas: u32,
    /// The wall clock the Leases' times are compared with.
    pub clock: Arc<dyn Fn() -> SystemTime + Send + Sync>,
    /// The address this replica's Lease publishes for the `kubernetes` Service
    /// (`fleet.kubernetesService.endpoint`).
    pub endpoint: Option<std::net::SocketAddr>,
    /// The URL of this replica's admin listener its Lease publishes ([`admin_url`]).
    pub admin: Option<String>,
}

impl Settings {
    /// Settings from the configuration, on the system clock; reads `fleet.keyFile`.
    pub fn from_config(
        fleet: &crate::config::Fleet,
        bulwark_replicas: u32,
    ) -> Result<Settings, KeyError> {
        let keys = match &fleet.key_file {
            Some(path) => Some(Arc::new(KeyFile::open(path)?)),
            None => None,
        };
        Ok(Settings {
            identity: fleet.identity.clone().unwrap_or_else(default_identity),
            namespace: fleet.namespace.clone(),
            prefix: fleet.lease_prefix.clone(),
            keys,
            accept_unsigned: fleet.accept_unsigned,
            renew_interval: fleet.renew_interval,
            lease_duration: fleet.lease_duration,
            bulwark_replicas,
            clock: Arc::new(SystemTime::now),
            endpoint: (fleet.kubernetes_service.as_ref()).and_then(|k| k.endpoint),
            admin: None,
        })
    }

    /// The name of this replica's Lease.
    pub fn lease_name(&self) -> String {
        format!("{}{}", self.prefix, self.identity)
    }

    /// Which Leases count, with the keys as they are now.
    pub fn check(&self) -> lease::Check {
        lease::Check {
            namespace: self.namespace.clone(),
            prefix: self.prefix.clone(),
            duration: self.lease_duration,
            keys: self.keys.as_ref().map(|k| k.current()),
            accept_unsigned: self.accept_unsigned,
        }
    }
}

/// Starts this replica's membership from `cfg`: its Lease renewed and everyone's read
/// through Bulwark's own client, shares published into `shares`, and with
/// `kubernetesService`, the Service's endpoints. The tasks stop when aborted.
pub fn start(
    cfg: &crate::config::Fleet,
    config: &crate::config::Config,
    own: own::Client,
    local: Arc<dyn Local>,
    shares: FleetShares,
    metrics: Metrics,
) -> Result<(Arc<Fleet>, Vec<JoinHandle<()>>), KeyError> {
    let (listen, admin) = (config.listen.address, &config.admin);
    let mut settings = Settings::from_config(cfg, config.upstream.bulwark_replicas)?;
    settings.admin = admin_url(
        admin.address,
        admin.tls.is_some(),
        std::env::var("POD_IP").ok(),
    );
    if cfg.kubernetes_service.is_some() && settings.endpoint.is_none() {
        settings.endpoint = default_endpoint(listen);
        match settings.endpoint {
            Some(endpoint) => {
                tracing::info!(%endpoint, "fleet: publishing this replica behind the kubernetes Service");
            }
            None => tracing::warn!(
                "fleet.kubernetesService: no endpoint, the listen address is unspecified and \
                 POD_IP is not set; this replica is not published behind the Service"
            ),
        }
    }
    let store = Arc::new(lease::UpstreamLeases::new(
        own.clone(),
        &cfg.namespace,
        &settings.lease_name(),
        cfg.renew_interval,
    ));
    let mut tasks = Vec::new();
    if let Some(service) = &cfg.kubernetes_service {
        tasks.push(publish_service(&settings, service, own, metrics.clone()));
    }
    let (fleet, task) = Fleet::spawn(settings, Arc::new(store), local, shares, metrics);
    tasks.push(task);
    Ok((fleet, tasks))
}

/// The address pods dial for this replica when `fleet.kubernetesService.endpoint` is not
/// set: the listen address when it names one, else `POD_IP` (the downward API's
/// `status.podIP`, the node's address with `hostNetwork`) with the listen port.
fn default_endpoint(listen: std::net::SocketAddr) -> Option<std::net::SocketAddr> {
    if !listen.ip().is_unspecified() {
        return Some(listen);
    }
    let ip: std::net::IpAddr = std::env::var("POD_IP").ok()?.trim().parse().ok()?;
    Some(std::net::SocketAddr::new(ip, listen.port()))
}

/// The URL the other members and the command line reach this replica's admin listener at:
/// its address when it names one, else `pod_ip` (`POD_IP`, as for [`default_endpoint`])
/// with its port; `https` with `admin.tls`. `None` on port 0, whose port is picked at bind.
pub fn admin_url(
    address: std::net::SocketAddr,
    tls: bool,
    pod_ip: Option<String>,
) -> Option<String> {
    if address.port() == 0 {
        return None;
    }
    let ip = if address.ip().is_unspecified() {
        pod_ip?.trim().parse().ok()?
    } else {
        address.ip()
    };
    let scheme = if tls { "https" } else { "http" };
    Some(format!(
        "{scheme}://{}",
        std::net::SocketAddr::new(ip, address.port())
    ))
}

/// Publishes the `kubernetes` Service's endpoints from the fleet's Leases
/// ([`endpoints`]): in every replica with `fleet.kubernetesService`, and in `bulwark guard`.
pub fn publish_service(
    settings: &Settings,
    service: &crate::config::KubernetesService,
    own: own::Client,
    metrics: Metrics,
) -> JoinHandle<()> {
    let leases = Arc::new(lease::UpstreamLeases::new(
        own.clone(),
        &settings.namespace,
        &settings.lease_name(),
        settings.renew_interval,
    ));
    let writer = Arc::new(endpoints::UpstreamService::new(
        own,
        settings.renew_interval,
    ));
    let check_from = settings.clone();
    let publisher = endpoints::Settings {
        check: Arc::new(move || check_from.check()),
        apiservers: service.apiservers.clone(),
        every: settings.renew_interval,
        clock: settings.clock.clone(),
    };
    tokio::spawn(endpoints::run(
        publisher,
        Arc::new(leases),
        Arc::new(writer),
        metrics,
    ))
}

/// The pod's name (`POD_NAME`, from the downward API), else the host name, as a DNS label
/// (lower-cased, other characters as `-`).
pub fn default_identity() -> String {
    let raw = std::env::var("POD_NAME")
        .ok()
        .filter(|s| !s.trim().is_empty())
        .or_else(|| {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .ok()
                .filter(|s| !s.trim().is_empty())
        })
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "bulwark".into());
    let label: String = raw
        .trim()
        .to_ascii_lowercase()
        .chars()
        .map(|c| {
            if c.is_ascii_lowercase() || c.is_ascii_digit() {
                c
            } else {
                '-'
            }
        })
        .take(63)
        .collect();
    let label = label.trim_matches('-');
    if label.is_empty() {
        "bulwark".into()
    } else {
        label.to_string()
    }
}

/// What `/debug/fleet` shows beyond the shares.
#[derive(Default)]
struct Seen {
    /// Every Lease of the last list, live or not.
    leases: Vec<Member>,
    /// When the last renewal succeeded.
    renewed: Option<SystemTime>,
    /// The last failure, if the last round failed.
    error: Option<String>,
    /// The demand this replica's Lease carries since the last renewal.
    published: Option<Demand>,
    /// The demand it carried before: what the others may still be splitting with.
    before: Option<Demand>,
    /// The Leases of the last list that did not count, and why (at most
    /// [`MAX_REJECTIONS_SHOWN`]).
    rejected: Vec<(String, Rejection)>,
    /// The rules of the flows this replica last reported.
    rate_rules: BTreeMap<String, u64>,
}

/// How many rejected Leases `/debug/fleet` names; the metric counts them all.
const MAX_REJECTIONS_SHOWN: usize = 32;

/// The running fleet membership of this replica.
pub struct Fleet {
    settings: Settings,
    shares: FleetShares,
    store: Arc<dyn LeaseStore>,
    local: Arc<dyn Local>,
    metrics: Metrics,
    seen: Mutex<Seen>,
}

/// How many demand samples are taken per renew period; the Lease carries their peak.
const SAMPLES_PER_RENEWAL: u32 = 4;

impl Fleet {
    /// Starts renewing through `store` and publishing into `shares`; stops when the handle
    /// is aborted.
    pub fn spawn(
        settings: Settings,
        store: Arc<dyn LeaseStore>,
        local: Arc<dyn Local>,
        shares: FleetShares,
        metrics: Metrics,
    ) -> (Arc<Fleet>, JoinHandle<()>) {
        if settings.keys.is_none() || settings.accept_unsigned {
            tracing::warn!(
                namespace = %settings.namespace,
                "fleet: no fleet.keyFile, or fleet.acceptUnsigned, so the Leases are \
                 unauthenticated: anyone who may write Leases in the namespace can shrink \
                 this fleet's shares"
            );
        }
        for reason in Rejection::ALL {
            metrics
                .fleet_leases_rejected_total
                .with_label_values(&[reason.as_str()]);
        }
        let fleet = Arc::new(Fleet {
            settings,
            shares,
            store,
            local,
            metrics,
            seen: Mutex::new(Seen::default()),
        });
        let running = fleet.clone();
        let task = tokio::spawn(async move { running.run().await });
        (fleet, task)
    }

    /// The shares this replica holds.
    pub fn shares(&self) -> &FleetShares {
        &self.shares
    }

    async fn run(self: Arc<Self>) {
        let every =
            (self.settings.renew_interval / SAMPLES_PER_RENEWAL).max(Duration::from_millis(1));
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut peak = Demand::default();
        let mut samples = 0;
        // Set when an expiry timer found nothing to drop: wait for the tick then, rather
        // than fire again at once.
        let mut idle_expiry = false;
        loop {
            // Between renewals, the moment another member's Lease runs out: its share
            // comes back then, not at the next renewal.
            let expiry = if idle_expiry {
                None
            } else {
                self.next_expiry()
            };
            tokio::select! {
                _ = tick.tick() => idle_expiry = false,
                () = sleep_until_some(expiry) => {
                    match self.without_expired() {
                        Some(shares) => self.publish(shares),
                        None => idle_expiry = true,
                    }
                    continue;
                }
            }
            peak.peak(&self.local.demand());
            samples += 1;
            // The first round goes at once, so a replica starting alone gets the whole
            // without waiting a period.
            if samples != 1 && samples % SAMPLES_PER_RENEWAL != 1 {
                continue;
            }
            let mut demand = std::mem::take(&mut peak);
            let rates = self.local.rate_demand();
            demand.rates = rates.iter().map(|(f, r)| (f.clone(), r.asked)).collect();
            self.seen
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .rate_rules = rates.into_iter().map(|(f, r)| (f, r.rule)).collect();
            let deadline = Instant::now() + self.settings.renew_interval;
            let round = tokio::time::timeout_at(deadline, self.round(demand)).await;
            let shares = match round {
                Ok(Ok(shares)) => shares,
                Ok(Err(why)) => self.failed(why),
                Err(_) => self.failed("the renewal took longer than the renew interval".into()),
            };
            self.publish(shares);
        }
    }

    /// When the first of the other members' Leases seen in the last round runs out, while
    /// this replica shares with them.
    fn next_expiry(&self) -> Option<Instant> {
        let shares = self.shares.current();
        if shares.standing != Standing::Shared {
            return None;
        }
        let now = (self.settings.clock)();
        let seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        // Every other member the shares count, even one whose Lease ran out a moment ago
        // (its timer then fires at once).
        seen.leases
            .iter()
            .filter(|m| {
                m.identity != self.settings.identity && shares.members.contains(&m.identity)
            })
            .filter_map(|m| m.renewed.checked_add(m.duration))
            .min()
            .map(|until| Instant::now() + until.duration_since(now).unwrap_or_default())
    }

    /// The shares once the Leases that have run out since the last round are dropped,
    /// from that round's Leases; `None` when none has.
    fn without_expired(&self) -> Option<Shares> {
        let s = &self.settings;
        let now = (s.clock)();
        let seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let members = self.shares.current().members.len();
        if share::live(&seen.leases, now).len() >= members {
            return None;
        }
        let statics = Statics {
            rates: seen.rate_rules.clone(),
            ..self.local.statics()
        };
        Some(self.split_as_seen(&seen.leases, seen.before.as_ref(), now, &statics))
    }

    /// Renews this replica's Lease, reads everyone's and splits.
    async fn round(&self, mut demand: Demand) -> Result<Shares, String> {
        let s = &self.settings;
        demand.endpoint = s.endpoint.map(|e| e.to_string());
        demand.admin = s.admin.clone();
        let keys = s.keys.as_ref().map(|k| k.current());
        let mut me = Member {
            identity: s.identity.clone(),
            renewed: (s.clock)(),
            duration: s.lease_duration,
            created: None,
            demand,
        };
        let name = s.lease_name();
        let own = lease::lease_object(&name, &s.namespace, &me, None, keys.as_ref());
        if let Err(e) = self.store.write(&own).await {
            return Err(format!("renewing the Lease: {e}"));
        }
        let listed = match self.store.list().await {
            Ok(leases) => leases,
            Err(e) => return Err(format!("listing the Leases: {e}")),
        };
        self.metrics
            .fleet_renewals_total
            .with_label_values(&["success"])
            .inc();
        let now = (s.clock)();
        let check = Check {
            namespace: s.namespace.clone(),
            prefix: s.prefix.clone(),
            duration: s.lease_duration,
            keys,
            accept_unsigned: s.accept_unsigned,
        };
        let mut leases = Vec::new();
        let mut rejected = Vec::new();
        for lease in &listed {
            match check.verdict(lease, now) {
                Verdict::Ignored => {}
                Verdict::Member(m) => leases.push(m),
                Verdict::Rejected(why) => {
                    self.metrics
                        .fleet_leases_rejected_total
                        .with_label_values(&[why.as_str()])
                        .inc();
                    if rejected.len() < MAX_REJECTIONS_SHOWN {
                        let name = lease.metadata.name.clone().unwrap_or_default();
                        rejected.push((name, why));
                    }
                }
            }
        }
        // The list may not show the write yet; this replica has just renewed. Its Lease's
        // age is the one the others see.
        if let Some(listed) = leases.iter().find(|m| m.identity == me.identity) {
            me.created = listed.created;
        }
        leases.retain(|m| m.identity != me.identity);
        leases.push(me.clone());
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let statics = Statics {
            rates: seen.rate_rules.clone(),
            ..self.local.statics()
        };
        seen.before = seen.published.replace(me.demand.clone());
        let shares = self.split_as_seen(&leases, seen.before.as_ref(), now, &statics);
        seen.leases = leases;
        seen.rejected = rejected;
        seen.renewed = Some(me.renewed);
        seen.error = None;
        Ok(shares)
    }

    /// This replica's shares from `leases` (its own among them, with the demand it just
    /// published). The others split with the demand it published a round before (`before`;
    /// their list may precede its write): a share grows only once they can have seen the
    /// demand behind it. Otherwise replicas whose demand rises together would each take
    /// most of a budget from the others' old, idle Leases, and together more than the whole.
    fn split_as_seen(
        &self,
        leases: &[Member],
        before: Option<&Demand>,
        now: SystemTime,
        statics: &Statics,
    ) -> Shares {
        let s = &self.settings;
        let shares = split(&s.identity, leases, now, statics, s.bulwark_replicas);
        let mut as_seen = leases.to_vec();
        let Some(mine) = as_seen.iter_mut().find(|m| m.identity == s.identity) else {
            return shares;
        };
        match before {
            Some(before) if *before != mine.demand => {
                mine.demand = before.clone();
                at_most(
                    shares,
                    &split(&s.identity, &as_seen, now, statics, s.bulwark_replicas),
                )
            }
            _ => shares,
        }
    }

    fn failed(&self, why: String) -> Shares {
        tracing::warn!(error = %why, "fleet: falling back to the static split");
        self.metrics
            .fleet_renewals_total
            .with_label_values(&["error"])
            .inc();
        self.seen.lock().unwrap_or_else(|p| p.into_inner()).error = Some(why.clone());
        Shares::static_split(
            &self.local.statics(),
            u64::from(self.settings.bulwark_replicas.max(1)),
            format!("static split: {why}"),
        )
    }

    fn publish(&self, shares: Shares) {
        let m = &self.metrics;
        m.fleet_members.set(shares.members.len() as i64);
        m.fleet_uncounted_members.set(shares.uncounted.len() as i64);
        m.fleet_static
            .set(i64::from(shares.standing == Standing::Static));
        let old = self.shares.current();
        m.fleet_rate_flows.set(shares.rates.len() as i64);
        for (kind, old_map, new_map) in [
            ("list_bytes", &old.list_bytes, &shares.list_bytes),
            ("seats", &old.seats, &shares.seats),
        ] {
            for name in old_map.keys().filter(|k| !new_map.contains_key(*k)) {
                let _ = m.fleet_share.remove_label_values(&[kind, name]);
            }
            for (name, held) in new_map {
                m.fleet_share
                    .with_label_values(&[kind, name])
                    .set(i64::try_from(held.share).unwrap_or(i64::MAX));
            }
        }
        for (replica, held) in &shares.list_bytes {
            m.list_bytes_budget
                .with_label_values(&[replica])
                .set(i64::try_from(held.share).unwrap_or(i64::MAX));
        }
        self.shares.publish(shares);
        self.local.shares_changed();
    }

    /// `/debug/fleet`: this replica's identity and standing, every Lease it saw, and what
    /// it holds of each budget with the demand behind it.
    pub fn debug_json(&self) -> serde_json::Value {
        let shares = self.shares.current();
        let now = (self.settings.clock)();
        let seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let millis = |t: SystemTime| {
            t.duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64)
        };
        let leases: Vec<_> = seen
            .leases
            .iter()
            .map(|m| {
                json!({
                    "identity": m.identity,
                    "admin": m.demand.admin,
                    "live": m.live(now),
                    "renewedUnixMillis": millis(m.renewed),
                    "leaseDurationSeconds": m.duration.as_secs(),
                    "demand": m.demand,
                })
            })
            .collect();
        let rejected: Vec<_> = seen
            .rejected
            .iter()
            .map(|(name, why)| json!({ "name": name, "reason": why.as_str() }))
            .collect();
        json!({
            "identity": self.settings.identity,
            "renewIntervalSeconds": self.settings.renew_interval.as_secs_f64(),
            "leaseDurationSeconds": self.settings.lease_duration.as_secs(),
            "bulwarkReplicas": self.settings.bulwark_replicas,
            "lastRenewalUnixMillis": seen.renewed.map(millis),
            "lastError": seen.error,
            "authenticated": self.settings.keys.is_some() && !self.settings.accept_unsigned,
            "leases": leases,
            "rejected": rejected,
            "shares": &*shares,
        })
    }
}

/// Sleeps until `at`, or forever without one.
async fn sleep_until_some(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// `shares`, each no larger than in `other` (the same split with other demand), and
/// running a LIST alone only where both allow it.
fn at_most(mut shares: Shares, other: &Shares) -> Shares {
    shares.alone.retain(|r| other.alone.contains(r));
    for (mine, theirs) in [
        (&mut shares.list_bytes, &other.list_bytes),
        (&mut shares.seats, &other.seats),
        (&mut shares.rates, &other.rates),
    ] {
        for (name, held) in mine.iter_mut() {
            if let Some(bound) = theirs.get(name) {
                held.share = held.share.min(bound.share);
            }
        }
    }
    shares
}

/// The shares of `me` given every Lease seen (`leases`, `me`'s included) at `now`: the live
/// members split each whole, by their demand where it counts ([`share::counted`]), clamped
/// to the whole ([`share::clamped`]).
pub fn split(
    me: &str,
    leases: &[Member],
    now: SystemTime,
    statics: &Statics,
    bulwark_replicas: u32,
) -> Shares {
    let replicas = u64::from(bulwark_replicas.max(1));
    let wholes = |statics: &BTreeMap<String, u64>| -> BTreeMap<String, u64> {
        statics
            .iter()
            .map(|(k, v)| (k.clone(), v.saturating_mul(replicas)))
            .collect()
    };
    let (bytes_wholes, seats_wholes) = (wholes(&statics.list_bytes), wholes(&statics.seats));
    let live = share::live(leases, now);
    let counted = share::counted(&live, usize::try_from(replicas).unwrap_or(usize::MAX));
    let members: Vec<Member> = live
        .iter()
        .zip(&counted)
        .map(|(m, &counted)| Member {
            demand: if counted {
                share::clamped(&m.demand, &bytes_wholes, &seats_wholes)
            } else {
                Demand::default()
            },
            ..(*m).clone()
        })
        .collect();
    let uncounted: Vec<String> = live
        .iter()
        .zip(&counted)
        .filter(|(_, counted)| !**counted)
        .map(|(m, _)| m.identity.clone())
        .collect();
    let live: Vec<&Member> = members.iter().collect();
    let list_bytes = share::shares_of(me, &live, &bytes_wholes, |d, r| {
        d.bytes.get(r).map_or(0, |b| b.wanted)
    });
    let seats = share::shares_of(me, &live, &seats_wholes, |d, l| {
        d.seats.get(l).copied().unwrap_or(0)
    });
    let rates = share::rate_shares(me, &live, &statics.rates);
    let alone = statics
        .list_bytes
        .iter()
        .filter(|(r, static_share)| {
            let bytes: Vec<share::Bytes> = live
                .iter()
                .map(|m| m.demand.bytes.get(*r).copied().unwrap_or_default())
                .collect();
            let wanted: Vec<u64> = bytes.iter().map(|b| b.wanted).collect();
            let shares = share::split(static_share.saturating_mul(replicas), &wanted);
            share::may_run_alone(me, &live, &shares, &bytes, now)
        })
        .map(|(r, _)| r.clone())
        .collect();
    let members: Vec<String> = live.iter().map(|m| m.identity.clone()).collect();
    let (standing, reason) = match members.len() {
        1 => (
            Standing::Alone,
            "no other live Lease: the whole budget".to_string(),
        ),
        n if !uncounted.is_empty() => (
            Standing::Shared,
            format!(
                "{n} live members, more than bulwarkReplicas ({replicas}): split by the demand of the {replicas} oldest"
            ),
        ),
        n => (
            Standing::Shared,
            format!("{n} live members: split by demand"),
        ),
    };
    Shares {
        standing,
        reason,
        members,
        uncounted,
        list_bytes,
        seats,
        rates,
        alone,
    }
}

#[cfg(test)]
mod tests;

//! The pure part of the fleet: who is a member, and what share of each budget a member
//! holds. Every member computes the same split from the same Leases, so the shares agree
//! without any member deciding for the others.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

/// What an idle member keeps of an equal share, in percent, so that it can start work at
/// once: with three members and nothing asked of one, that one keeps 10% of a third.
pub const FLOOR_PERCENT: u64 = 10;

/// A member's recent demand, as its Lease carries it (compact JSON in an annotation).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Demand {
    /// Per apiserver replica (by its configured address): LIST bytes wanted (in flight and
    /// waiting) and in flight, the peak of the last renew period.
    #[serde(default, rename = "b", skip_serializing_if = "BTreeMap::is_empty")]
    pub bytes: BTreeMap<String, Bytes>,
    /// Per priority level: seats wanted (executing and waiting), the peak of the last
    /// renew period.
    #[serde(default, rename = "s", skip_serializing_if = "BTreeMap::is_empty")]
    pub seats: BTreeMap<String, u64>,
    /// Per flow asking for a notable part of its rule's rate: the requests it asked for
    /// over the last renew period, in thousandths of a request per second.
    #[serde(default, rename = "r", skip_serializing_if = "BTreeMap::is_empty")]
    pub rates: BTreeMap<String, u64>,
    /// The address in-cluster clients dial for this member, when the fleet publishes the
    /// `kubernetes` Service's endpoints (`fleet.kubernetesService.endpoint`). Signed with
    /// the rest of the Lease; not a demand, but what the member publishes along with it.
    #[serde(default, rename = "e", skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    /// The URL of this member's admin listener (`https://10.0.0.5:9443`), for `bulwark
    /// flows --fleet` and its siblings to read each member's `/debug/*`. Signed with the
    /// rest; members that predate it ignore it, and a Lease without it is a member whose
    /// admin listener the command line cannot find.
    #[serde(default, rename = "a", skip_serializing_if = "Option::is_none")]
    pub admin: Option<String>,
}

/// LIST bytes one member wants of one apiserver replica.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Bytes {
    /// In flight and waiting for room.
    #[serde(rename = "w")]
    pub wanted: u64,
    /// In flight.
    #[serde(rename = "f")]
    pub in_flight: u64,
}

impl Demand {
    /// Raises each figure to `other`'s where that is higher (the peak of two samples).
    pub fn peak(&mut self, other: &Demand) {
        for (replica, b) in &other.bytes {
            let mine = self.bytes.entry(replica.clone()).or_default();
            mine.wanted = mine.wanted.max(b.wanted);
            mine.in_flight = mine.in_flight.max(b.in_flight);
        }
        for (level, &seats) in &other.seats {
            let mine = self.seats.entry(level.clone()).or_default();
            *mine = (*mine).max(seats);
        }
        for (flow, &asked) in &other.rates {
            let mine = self.rates.entry(flow.clone()).or_default();
            *mine = (*mine).max(asked);
        }
    }
}

/// What one flow asked of this replica over a renew period, in thousandths of a request
/// per second.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RateAsked {
    /// The rate asked (refused requests too).
    pub asked: u64,
    /// Its rule's rate: the whole of the flow's rate across the fleet.
    pub rule: u64,
}

/// One member as its Lease shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// Its identity (`holderIdentity`).
    pub identity: String,
    /// When it last renewed (`renewTime`).
    pub renewed: SystemTime,
    /// How long the renewal counts (`leaseDurationSeconds`).
    pub duration: Duration,
    /// When its Lease was created (`creationTimestamp`: set by the apiserver, so no writer
    /// chooses it); `None` before the apiserver has shown it.
    pub created: Option<SystemTime>,
    /// What it asked for.
    pub demand: Demand,
}

impl Member {
    /// Whether the Lease is unexpired at `now`: renewed within its duration.
    pub fn live(&self, now: SystemTime) -> bool {
        self.renewed
            .checked_add(self.duration)
            .is_some_and(|until| until > now)
    }
}

/// The live members at `now`, each once (the latest renewal of an identity), by identity.
pub fn live(members: &[Member], now: SystemTime) -> Vec<&Member> {
    let mut by_identity: BTreeMap<&str, &Member> = BTreeMap::new();
    for member in members.iter().filter(|m| m.live(now)) {
        let entry = by_identity.entry(&member.identity).or_insert(member);
        if member.renewed > entry.renewed {
            *entry = member;
        }
    }
    by_identity.into_values().collect()
}

/// The most rate entries one member's demand counts with: as many as a replica reports.
pub const MAX_RATE_ENTRIES: usize = 128;

/// The largest rate a member's demand counts for one flow, in thousandths of a request per
/// second: a million requests per second, the most a rule allows.
pub const MAX_RATE_DEMAND: u64 = 1_000_000_000;

/// The members among `live` (by identity, as [`live`] gives them) whose demand counts: the
/// first `replicas` by the age of their Lease (oldest first, then by identity; a Lease not
/// yet shown with its creation time last). A fleet of `bulwarkReplicas` has no more
/// members than that but in a rollout or with a Lease someone else wrote; the others keep
/// a floor. Every member reads the same Leases, so all agree on these.
pub fn counted(live: &[&Member], replicas: usize) -> Vec<bool> {
    let mut order: Vec<usize> = (0..live.len()).collect();
    order.sort_by(|&a, &b| {
        let key = |m: &Member| (m.created.is_none(), m.created);
        key(live[a])
            .cmp(&key(live[b]))
            .then_with(|| live[a].identity.cmp(&live[b].identity))
    });
    let mut counted = vec![false; live.len()];
    for &i in order.iter().take(replicas) {
        counted[i] = true;
    }
    counted
}

/// `demand` as the split reads it: each figure at most its budget's whole (`bytes` per
/// apiserver replica, `seats` per level; budgets this replica does not know are dropped)
/// and at most [`MAX_RATE_ENTRIES`] rates (the largest), each at most [`MAX_RATE_DEMAND`].
/// No Lease can ask for more than there is, so one cannot take a share beyond what a
/// member asking for everything would.
pub fn clamped(
    demand: &Demand,
    bytes: &BTreeMap<String, u64>,
    seats: &BTreeMap<String, u64>,
) -> Demand {
    let bytes = demand
        .bytes
        .iter()
        .filter_map(|(r, b)| {
            let whole = *bytes.get(r)?;
            Some((
                r.clone(),
                Bytes {
                    wanted: b.wanted.min(whole),
                    in_flight: b.in_flight.min(whole),
                },
            ))
        })
        .collect();
    let seats = demand
        .seats
        .iter()
        .filter_map(|(l, &s)| Some((l.clone(), s.min(*seats.get(l)?))))
        .collect();
    let mut rates: Vec<(&String, u64)> = demand
        .rates
        .iter()
        .map(|(f, &r)| (f, r.min(MAX_RATE_DEMAND)))
        .collect();
    if rates.len() > MAX_RATE_ENTRIES {
        // The largest, ties by flow: the same entries on every member.
        rates.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(b.0)));
        rates.truncate(MAX_RATE_ENTRIES);
    }
    Demand {
        bytes,
        seats,
        rates: rates.into_iter().map(|(f, r)| (f.clone(), r)).collect(),
        endpoint: demand.endpoint.clone(),
        admin: demand.admin.clone(),
    }
}

/// Splits `whole` among members by their `demands`: each gets [`FLOOR_PERCENT`] of an equal
/// share (at least 1 where the whole has one for each), and the rest goes in proportion to
/// demand, or equally when nobody asks. Rounded down, so the shares never add up to more
/// than `whole`. One member gets the whole.
pub fn split(whole: u64, demands: &[u64]) -> Vec<u64> {
    let n = demands.len() as u64;
    match n {
        0 => return Vec::new(),
        1 => return vec![whole],
        _ => {}
    }
    let equal = whole / n;
    let tenth = u128::from(equal) * u128::from(FLOOR_PERCENT) / 100;
    let floor = u64::try_from(tenth).unwrap_or(equal).max(equal.min(1));
    let rest = whole - floor * n;
    let total: u128 = demands.iter().map(|&d| u128::from(d)).sum();
    demands
        .iter()
        .map(|&d| {
            if total == 0 {
                return equal;
            }
            let part = u128::from(rest) * u128::from(d) / total;
            floor + u64::try_from(part).unwrap_or(rest)
        })
        .collect()
}

/// The whole of a flow's rate in [`Held`]: shares of a rule's rate are in millionths.
pub const RATE_WHOLE: u64 = 1_000_000;

/// Each flow's share of its rule's rate for member `me` (in millionths, [`RATE_WHOLE`]),
/// for the flows another live member reports: split among the members that report it (and
/// `me`, which may not yet) by the rate each saw asked, each at most the flow's rule where
/// `me` knows it (`rules`, in thousandths of a request per second: no member can be given
/// more than the whole rate, so a report of more counts as the whole). A flow no other
/// member reports is not in the map: `me` may use all of its rule.
pub fn rate_shares(
    me: &str,
    members: &[&Member],
    rules: &BTreeMap<String, u64>,
) -> BTreeMap<String, Held> {
    let Some(mine) = members.iter().find(|m| m.identity == me) else {
        return BTreeMap::new();
    };
    let mut flows: BTreeMap<&str, Vec<u64>> = BTreeMap::new();
    let at_most = |flow: &str, asked: u64| rules.get(flow).map_or(asked, |&rule| asked.min(rule));
    for other in members.iter().filter(|m| m.identity != me) {
        for (flow, &asked) in &other.demand.rates {
            flows.entry(flow).or_default().push(at_most(flow, asked));
        }
    }
    flows
        .into_iter()
        .map(|(flow, mut demands)| {
            let asked = at_most(flow, mine.demand.rates.get(flow).copied().unwrap_or(0));
            demands.push(asked);
            let shares = split(RATE_WHOLE, &demands);
            let held = Held {
                share: shares[demands.len() - 1],
                whole: RATE_WHOLE,
                demand: asked,
                fleet_demand: demands.iter().sum(),
            };
            (flow.to_string(), held)
        })
        .collect()
}

/// How long one member at a time may run LISTs bigger than its share of an apiserver.
pub const ALONE_TURN: Duration = Duration::from_secs(10);

/// Whether `me` may run a LIST bigger than its share of one apiserver (alone there, as
/// far as it is concerned): it is this turn's member of those asking for bytes of it (in
/// identity order, [`ALONE_TURN`] each, by the wall clock the Leases share; all members
/// when none asks), and no other member has such a LIST running (more in flight than its
/// share). `members` are the live ones by identity, `shares` theirs of the apiserver's
/// bytes, `bytes` what each asked.
pub fn may_run_alone(
    me: &str,
    members: &[&Member],
    shares: &[u64],
    bytes: &[Bytes],
    now: SystemTime,
) -> bool {
    let asking: Vec<usize> = (0..members.len())
        .filter(|&i| bytes[i].wanted > 0)
        .collect();
    let turns = if asking.is_empty() {
        (0..members.len()).collect()
    } else {
        asking
    };
    let turn = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() / ALONE_TURN.as_secs());
    let Some(&holder) = turns.get((turn % turns.len().max(1) as u64) as usize) else {
        return false;
    };
    let others_running =
        (0..members.len()).any(|i| members[i].identity != me && bytes[i].in_flight > shares[i]);
    members[holder].identity == me && !others_running
}

/// What this replica holds of one budget, and how it got there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Held {
    /// This replica's share.
    pub share: u64,
    /// The fleet's whole (the static share times `bulwarkReplicas`).
    pub whole: u64,
    /// This replica's demand, as its Lease carries it.
    pub demand: u64,
    /// All live members' demand together.
    pub fleet_demand: u64,
}

/// Each budget's share for member `me` among `members` (the live ones, `me` among them).
/// `wholes` name the budgets (an apiserver replica's address or a level's name) and the
/// fleet's whole of each; `demand_of` reads a member's demand on one of them.
pub fn shares_of(
    me: &str,
    members: &[&Member],
    wholes: &BTreeMap<String, u64>,
    demand_of: impl Fn(&Demand, &str) -> u64,
) -> BTreeMap<String, Held> {
    let Some(mine) = members.iter().position(|m| m.identity == me) else {
        return BTreeMap::new();
    };
    wholes
        .iter()
        .map(|(name, &whole)| {
            let demands: Vec<u64> = members.iter().map(|m| demand_of(&m.demand, name)).collect();
            let shares = split(whole, &demands);
            let held = Held {
                share: shares[mine],
                whole,
                demand: demands[mine],
                fleet_demand: demands.iter().sum(),
            };
            (name.clone(), held)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000 + secs)
    }

    fn member(identity: &str, renewed: u64, wanted: u64) -> Member {
        let mut demand = Demand::default();
        demand.bytes.insert(
            "r0".into(),
            Bytes {
                wanted,
                in_flight: 0,
            },
        );
        demand.seats.insert("lists".into(), wanted);
        Member {
            identity: identity.into(),
            renewed: at(renewed),
            duration: Duration::from_secs(10),
            created: None,
            demand,
        }
    }

    #[test]
    fn a_member_is_live_until_its_lease_duration_after_its_renewal() {
        let m = member("a", 100, 0);
        assert!(m.live(at(100)));
        assert!(m.live(at(109)));
        assert!(!m.live(at(110)), "renewTime + duration is the end");
        assert!(!m.live(at(500)));
        let members = [member("a", 100, 0), member("b", 95, 0), member("a", 90, 0)];
        let live: Vec<_> = live(&members, at(106))
            .into_iter()
            .map(|m| (m.identity.as_str(), m.renewed))
            .collect();
        assert_eq!(
            live,
            vec![("a", at(100))],
            "b expired; a counts once, by its latest renewal"
        );
    }

    #[test]
    fn one_member_gets_the_whole() {
        assert_eq!(split(1000, &[0]), vec![1000]);
        assert_eq!(split(1000, &[5]), vec![1000]);
        assert!(split(1000, &[]).is_empty());
    }

    #[test]
    fn the_split_follows_demand_above_a_floor_and_never_adds_up_to_more_than_the_whole() {
        // Nobody asks: equal shares.
        assert_eq!(split(900, &[0, 0, 0]), vec![300, 300, 300]);
        // One asks for everything: the others keep 10% of a third.
        assert_eq!(split(900, &[500, 0, 0]), vec![840, 30, 30]);
        // Two ask, one twice as much.
        assert_eq!(split(900, &[200, 100, 0]), vec![30 + 540, 30 + 270, 30]);
        // Seats: a floor of at least one seat while there is one for each.
        assert_eq!(split(3, &[9, 0, 0]), vec![1, 1, 1]);
        assert_eq!(split(30, &[9, 0, 0]), vec![28, 1, 1]);
        assert_eq!(split(2, &[0, 0, 0]), vec![0, 0, 0]);
        // Rounding and huge figures never overshoot.
        for (whole, demands) in [
            (1000, vec![1, 1, 1]),
            (7, vec![3, 5, 11, 2]),
            (u64::MAX, vec![u64::MAX, u64::MAX, 1]),
            (1 << 40, vec![u64::MAX, 0]),
            (10, vec![1; 20]),
        ] {
            let shares = split(whole, &demands);
            let sum: u128 = shares.iter().map(|&s| u128::from(s)).sum();
            assert!(sum <= u128::from(whole), "{whole} {demands:?} → {shares:?}");
            assert!(
                sum + demands.len() as u128 >= u128::from(whole),
                "at most one unit per member lost to rounding: {whole} {demands:?} → {shares:?}"
            );
        }
    }

    #[test]
    fn every_member_computes_its_own_share_from_the_same_leases() {
        let members = [member("a", 100, 300), member("b", 101, 100)];
        let live = live(&members, at(105));
        let wholes: BTreeMap<String, u64> = [("r0".to_string(), 1000)].into();
        let bytes = |d: &Demand, r: &str| d.bytes.get(r).map_or(0, |b| b.wanted);
        let a = shares_of("a", &live, &wholes, bytes);
        let b = shares_of("b", &live, &wholes, bytes);
        assert_eq!(
            a["r0"],
            Held {
                share: 50 + 675,
                whole: 1000,
                demand: 300,
                fleet_demand: 400
            }
        );
        assert_eq!(b["r0"].share, 50 + 225);
        assert!(a["r0"].share + b["r0"].share <= 1000);
        assert!(
            shares_of("c", &live, &wholes, bytes).is_empty(),
            "not a member: no share"
        );
    }

    #[test]
    fn a_flow_s_rate_is_split_among_the_members_that_see_it() {
        let with_rates = |id: &str, rates: &[(&str, u64)]| {
            let mut m = member(id, 100, 0);
            m.demand.rates = rates.iter().map(|(f, r)| (f.to_string(), *r)).collect();
            m
        };
        let a = with_rates("a", &[("f", 7000), ("g", 500)]);
        let b = with_rates("b", &[("f", 2000)]);
        let c = with_rates("c", &[("f", 1000), ("h", 300)]);
        let members = [&a, &b, &c];
        let shares: Vec<_> = ["a", "b", "c"]
            .iter()
            .map(|me| rate_shares(me, &members, &BTreeMap::new()))
            .collect();
        // `f`: a floor of a thirtieth each, the rest 70/20/10.
        let f: Vec<u64> = shares.iter().map(|s| s["f"].share).collect();
        assert_eq!(f, vec![33_333 + 630_000, 33_333 + 180_000, 33_333 + 90_000]);
        assert!(f.iter().sum::<u64>() <= RATE_WHOLE);
        // `g` only A sees: A may use its whole rule (no entry); B and C get a floor of the
        // share of a flow A reports, ready for the requests they may get.
        assert!(!shares[0].contains_key("g"));
        assert_eq!(shares[1]["g"].share, 50_000, "a tenth of half");
        assert_eq!(shares[1]["g"].demand, 0);
        assert!(!shares[2].contains_key("h"));
        assert_eq!(shares[0]["h"].share, 50_000);
        assert_eq!(shares[0]["h"].fleet_demand, 300);
    }

    #[test]
    fn demand_travels_as_compact_json_and_peaks_keep_the_highest_sample() {
        let mut first = member("a", 0, 300).demand;
        let json = serde_json::to_string(&first).unwrap();
        assert_eq!(json, r#"{"b":{"r0":{"w":300,"f":0}},"s":{"lists":300}}"#);
        assert_eq!(serde_json::from_str::<Demand>(&json).unwrap(), first);
        assert_eq!(
            serde_json::from_str::<Demand>("{}").unwrap(),
            Demand::default()
        );
        let mut second = member("a", 0, 100).demand;
        second.bytes.get_mut("r0").unwrap().in_flight = 50;
        first.peak(&second);
        assert_eq!(
            first.bytes["r0"],
            Bytes {
                wanted: 300,
                in_flight: 50
            }
        );
        assert_eq!(first.seats["lists"], 300);
    }

    #[test]
    fn only_the_oldest_leases_demand_counts_and_none_past_the_whole() {
        let created = |id: &str, secs: Option<u64>| Member {
            created: secs.map(at),
            ..member(id, 100, 500)
        };
        // D is the oldest; C's creation not yet shown; A and B tie on age.
        let members = [
            created("a", Some(10)),
            created("b", Some(10)),
            created("c", None),
            created("d", Some(5)),
        ];
        let live = live(&members, at(105));
        assert_eq!(counted(&live, 3), vec![true, true, false, true]);
        assert_eq!(counted(&live, 2), vec![true, false, false, true]);
        assert_eq!(counted(&live, 9), vec![true; 4]);

        let mut demand = member("a", 100, u64::MAX).demand;
        demand.bytes.insert(
            "unknown".into(),
            Bytes {
                wanted: 1,
                in_flight: 1,
            },
        );
        demand.rates = (0..200u64).map(|i| (format!("f{i:03}"), i)).collect();
        demand.rates.insert("huge".into(), u64::MAX);
        let wholes: BTreeMap<String, u64> = [("r0".to_string(), 300)].into();
        let seats: BTreeMap<String, u64> = [("lists".to_string(), 30)].into();
        let c = clamped(&demand, &wholes, &seats);
        assert_eq!(
            c.bytes,
            [(
                "r0".to_string(),
                Bytes {
                    wanted: 300,
                    in_flight: 0
                }
            )]
            .into()
        );
        assert_eq!(c.seats, [("lists".to_string(), 30)].into());
        assert_eq!(c.rates.len(), MAX_RATE_ENTRIES);
        assert_eq!(c.rates["huge"], MAX_RATE_DEMAND);
        assert!(!c.rates.contains_key("f000"), "the smallest dropped");
        assert!(c.rates.contains_key("f199"));
    }

    #[test]
    fn a_flow_s_report_counts_for_no_more_than_its_rule() {
        let with_rate = |id: &str, rate: u64| {
            let mut m = member(id, 100, 0);
            m.demand.rates.insert("f".into(), rate);
            m
        };
        let (a, x) = (with_rate("a", 8_000), with_rate("x", u64::MAX / 2));
        let members = [&a, &x];
        let unbounded = rate_shares("a", &members, &BTreeMap::new());
        assert_eq!(unbounded["f"].share, 50_000, "a floor only");
        let rules: BTreeMap<String, u64> = [("f".to_string(), 10_000)].into();
        let bounded = rate_shares("a", &members, &rules);
        assert_eq!(bounded["f"].share, 50_000 + 900_000 * 8 / 18);
    }
}

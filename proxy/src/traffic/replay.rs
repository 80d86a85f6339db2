//! `bulwark rules replay`: what a rule folder would have refused of a recording.
//!
//! Each recorded request comes again at the moment it came, from the same user (groups and
//! claims), and the rule engine matches it as Bulwark would. Admission is modelled, not
//! run: every rule as if enforced (a shadow rule's would-be refusals are what it reports),
//! in the order Bulwark checks — the flow's token bucket (`rate_limited`), its open watches
//! (`watch_limit`), then its level's seats: a request takes one seat, a LIST seats by the
//! bytes admission expected of it, from its admission to its answer's head as recorded; a
//! LIST the apiservers answered also holds those bytes of the in-flight LIST budget. One
//! that cannot
//! start waits, first come first served (Bulwark's fair queues serve flows in turn: the
//! model is harsher on a flow that floods), and is refused `queue_full` when its flow's hand
//! of queues or the level's queues are full, `queue_timeout` after the level's `maxWait`. A
//! watch holds no seat and stays open for as long as it did (to the end of the recording
//! when its end was not recorded). The requests the recording refused come again too: a
//! client sends them again.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap, VecDeque};
use std::sync::Arc;

use serde::Serialize;

use super::Recording;
use crate::rules::{RuleSet, request_for};

/// The in-flight LIST budget when none is given: three apiservers at the default heap
/// headroom (8 GiB ÷ 5 each), one Bulwark.
pub const DEFAULT_LIST_BUDGET: u64 = 3 * (8 << 30) / 5;

/// The smallest seat unit admission uses (a LIST of this many bytes takes one seat).
const MIN_SEAT_UNIT: u64 = 64 * 1024;

/// Why a replayed request would have been refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Refusal {
    /// The flow's token bucket was empty.
    RateLimited,
    /// The flow held its most watches.
    WatchLimit,
    /// The flow's queues, or the level's, were full.
    QueueFull,
    /// It waited `maxWait` without seats.
    QueueTimeout,
}

impl Refusal {
    /// As a 429's `X-Bulwark-Reason` names it.
    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::RateLimited => "rate_limited",
            Refusal::WatchLimit => "watch_limit",
            Refusal::QueueFull => "queue_full",
            Refusal::QueueTimeout => "queue_timeout",
        }
    }
}

/// One rule's and identity's replay.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Row {
    /// The rule the folder matched.
    pub rule: String,
    /// The user.
    pub user: String,
    /// Requests replayed.
    pub requests: u64,
    /// Would-be refusals by reason.
    pub refused: BTreeMap<&'static str, u64>,
    /// Seconds into the recording of the first and last refusal.
    pub first: Option<f64>,
    /// See `first`.
    pub last: Option<f64>,
}

impl Row {
    /// Would-be refusals of every reason.
    pub fn total_refused(&self) -> u64 {
        self.refused.values().sum()
    }
}

/// What the folder would have done with the recording.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Replay {
    /// Per rule and user, in that order.
    pub rows: Vec<Row>,
    /// Requests replayed.
    pub requests: u64,
    /// Requests not replayed: unidentified, or not a request the rules can classify.
    pub not_replayed: u64,
    /// The recording's span in seconds.
    pub span: f64,
}

/// A request waiting for seats.
struct Waiter {
    row: usize,
    flow: Arc<str>,
    seats: u32,
    bytes: u64,
    duration: f64,
    deadline: f64,
}

/// A level's seats and queue.
struct Level {
    seats: u32,
    max_seats_per_flow: u32,
    flow_queue: usize,
    queue: usize,
    max_wait: f64,
    in_use: u32,
    by_flow: HashMap<Arc<str>, u32>,
    waiting: VecDeque<Waiter>,
}

/// A running request's end, ordered by when.
#[derive(PartialEq)]
struct End {
    at: f64,
    level: String,
    flow: Arc<str>,
    seats: u32,
    bytes: u64,
}

impl Eq for End {}
impl PartialOrd for End {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for End {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.at.total_cmp(&other.at)
    }
}

struct Model {
    levels: HashMap<String, Level>,
    ends: BinaryHeap<Reverse<End>>,
    budget: u64,
    bytes_in_flight: u64,
    rows: Vec<Row>,
}

impl Model {
    fn refuse(&mut self, row: usize, why: Refusal, at: f64) {
        let row = &mut self.rows[row];
        *row.refused.entry(why.as_str()).or_default() += 1;
        row.first.get_or_insert(at);
        row.last = Some(at);
    }

    /// Whether a request fits now.
    fn fits(&self, level: &Level, flow: &Arc<str>, seats: u32, bytes: u64) -> bool {
        let flow_seats = level.by_flow.get(flow).copied().unwrap_or(0);
        let seats_free = level.in_use + seats <= level.seats
            && (level.max_seats_per_flow == 0
                || flow_seats == 0
                || flow_seats + seats <= level.max_seats_per_flow);
        let bytes_free =
            bytes == 0 || self.bytes_in_flight == 0 || self.bytes_in_flight + bytes <= self.budget;
        seats_free && bytes_free
    }

    fn start(
        &mut self,
        name: &str,
        flow: Arc<str>,
        seats: u32,
        bytes: u64,
        at: f64,
        duration: f64,
    ) {
        let level = self.levels.get_mut(name).expect("level known");
        level.in_use += seats;
        *level.by_flow.entry(flow.clone()).or_default() += seats;
        self.bytes_in_flight += bytes;
        self.ends.push(Reverse(End {
            at: at + duration,
            level: name.to_owned(),
            flow,
            seats,
            bytes,
        }));
    }

    /// Runs the model up to `now`: ends, starts of waiters, timeouts.
    fn advance(&mut self, now: f64) {
        loop {
            let next_end = self
                .ends
                .peek()
                .map(|Reverse(e)| e.at)
                .filter(|at| *at <= now);
            let at = next_end.unwrap_or(now);
            self.time_out(at);
            let Some(at) = next_end else { break };
            let Reverse(end) = self.ends.pop().expect("peeked");
            let level = self.levels.get_mut(&end.level).expect("level known");
            level.in_use -= end.seats;
            if let Some(held) = level.by_flow.get_mut(&end.flow) {
                *held -= end.seats;
                if *held == 0 {
                    level.by_flow.remove(&end.flow);
                }
            }
            self.bytes_in_flight -= end.bytes;
            self.dispatch(at);
        }
    }

    /// Refuses the waiters whose wait ran out by `at`.
    fn time_out(&mut self, at: f64) {
        let mut timed_out = Vec::new();
        for level in self.levels.values_mut() {
            level.waiting.retain(|w| {
                let late = w.deadline <= at;
                if late {
                    timed_out.push((w.row, w.deadline));
                }
                !late
            });
        }
        for (row, deadline) in timed_out {
            self.refuse(row, Refusal::QueueTimeout, deadline);
        }
    }

    /// Starts what waits and now fits, each level's queue in order.
    fn dispatch(&mut self, at: f64) {
        let names: Vec<String> = self.levels.keys().cloned().collect();
        for name in names {
            loop {
                let level = &self.levels[&name];
                let Some(front) = level.waiting.front() else {
                    break;
                };
                if !self.fits(level, &front.flow, front.seats, front.bytes) {
                    break;
                }
                let w = self
                    .levels
                    .get_mut(&name)
                    .expect("level known")
                    .waiting
                    .pop_front()
                    .expect("front");
                self.start(&name, w.flow, w.seats, w.bytes, at, w.duration);
            }
        }
    }
}

/// Replays `recording` against `rules` with an in-flight LIST budget of `list_budget`.
// Over 120 lines: the recording's requests in time order through one model of admission
// (buckets, watches, seats, the byte budget), each step reading the state the last one
// left.
pub fn replay(recording: &Recording, rules: &RuleSet, list_budget: u64) -> Replay {
    let seat_unit = (list_budget / 100).max(MIN_SEAT_UNIT);
    let mut model = Model {
        levels: rules
            .levels()
            .iter()
            .filter(|l| !l.exempt)
            .map(|l| {
                (
                    l.name.clone(),
                    Level {
                        seats: l.seats.max(1),
                        max_seats_per_flow: l.max_seats_per_flow,
                        flow_queue: (l.hand_size * l.queue_length) as usize,
                        queue: (l.queues * l.queue_length) as usize,
                        max_wait: l.max_wait.as_secs_f64(),
                        in_use: 0,
                        by_flow: HashMap::new(),
                        waiting: VecDeque::new(),
                    },
                )
            })
            .collect(),
        ends: BinaryHeap::new(),
        budget: list_budget,
        bytes_in_flight: 0,
        rows: Vec::new(),
    };
    let mut row_of: HashMap<(Arc<str>, String), usize> = HashMap::new();
    let mut buckets: HashMap<Arc<str>, (f64, f64)> = HashMap::new();
    let mut watches: HashMap<Arc<str>, BinaryHeap<Reverse<OrdF64>>> = HashMap::new();
    let mut out = Replay {
        span: recording.span,
        ..Replay::default()
    };
    for record in &recording.records {
        let Some(info) = record
            .identified()
            .then(|| request_for(&record.verb, &record.path).ok())
            .flatten()
        else {
            out.not_replayed += 1;
            continue;
        };
        out.requests += 1;
        let now = record.at;
        model.advance(now);
        let matched = rules.matches_from(&record.user, &info, record.source);
        let row = *row_of
            .entry((matched.rule.clone(), record.user.username.clone()))
            .or_insert_with(|| {
                model.rows.push(Row {
                    rule: matched.rule.to_string(),
                    user: record.user.username.clone(),
                    ..Row::default()
                });
                model.rows.len() - 1
            });
        model.rows[row].requests += 1;
        if matched.level.exempt {
            continue;
        }
        if let Some(rate) = matched.rate {
            let (tokens, last) = buckets
                .entry(matched.flow.clone())
                .or_insert((f64::from(rate.burst), now));
            *tokens = (*tokens + (now - *last) * rate.qps).min(f64::from(rate.burst));
            *last = now;
            if *tokens < 1.0 {
                model.refuse(row, Refusal::RateLimited, now);
                continue;
            }
            *tokens -= 1.0;
        }
        if record.is_watch() {
            let open = watches.entry(matched.flow.clone()).or_default();
            while open.peek().is_some_and(|Reverse(OrdF64(end))| *end <= now) {
                open.pop();
            }
            if matched
                .watches
                .is_some_and(|limit| open.len() >= limit as usize)
            {
                model.refuse(row, Refusal::WatchLimit, now);
                continue;
            }
            let until = record.open_for.map_or(recording.span, |d| now + d);
            open.push(Reverse(OrdF64(until)));
            continue;
        }
        let level_name = matched.level.name.clone();
        let is_list = record.verb == "list";
        let expected = record.expected_bytes.unwrap_or(0);
        let seats = if is_list {
            u32::try_from(expected.div_ceil(seat_unit).max(1)).unwrap_or(u32::MAX)
        } else {
            1
        }
        .min(matched.level.seats.max(1));
        let bytes = if is_list && record.served_by == "upstream" {
            expected
        } else {
            0
        };
        // It holds its seats from admission to its head; its wait for them is the model's
        // to decide again.
        let duration = record.seat_seconds();
        let Some(level) = model.levels.get(&level_name) else {
            continue;
        };
        if level.waiting.is_empty() && model.fits(level, &matched.flow, seats, bytes) {
            model.start(
                &level_name,
                matched.flow.clone(),
                seats,
                bytes,
                now,
                duration,
            );
            continue;
        }
        let flow_waiting = level
            .waiting
            .iter()
            .filter(|w| w.flow == matched.flow)
            .count();
        if flow_waiting >= level.flow_queue || level.waiting.len() >= level.queue {
            model.refuse(row, Refusal::QueueFull, now);
            continue;
        }
        let deadline = now + level.max_wait;
        model
            .levels
            .get_mut(&level_name)
            .expect("level known")
            .waiting
            .push_back(Waiter {
                row,
                flow: matched.flow.clone(),
                seats,
                bytes,
                duration,
                deadline,
            });
    }
    model.advance(f64::INFINITY);
    let mut rows = model.rows;
    rows.sort_by(|a, b| (&a.rule, &a.user).cmp(&(&b.rule, &b.user)));
    out.rows = rows;
    out
}

/// An `f64` that orders (watch ends are never NaN).
#[derive(PartialEq)]
struct OrdF64(f64);
impl Eq for OrdF64 {}
impl PartialOrd for OrdF64 {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for OrdF64 {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}

impl Replay {
    /// The report as kubectl-style columns: per rule and user, then the totals.
    pub fn table(&self) -> String {
        let reasons = ["rate_limited", "watch_limit", "queue_full", "queue_timeout"];
        let mut rows: Vec<Vec<String>> = vec![
            ["RULE", "USER", "REQUESTS", "REFUSED"]
                .into_iter()
                .map(str::to_owned)
                .chain(reasons.iter().map(|r| r.to_uppercase()))
                .chain(["FIRST".into(), "LAST".into()])
                .collect(),
        ];
        let at = |t: Option<f64>| t.map_or("-".to_owned(), |t| format!("{t:.1}s"));
        for row in &self.rows {
            let mut cells = vec![
                row.rule.clone(),
                row.user.clone(),
                row.requests.to_string(),
                row.total_refused().to_string(),
            ];
            cells.extend(
                reasons
                    .iter()
                    .map(|r| row.refused.get(r).copied().unwrap_or(0).to_string()),
            );
            cells.push(at(row.first));
            cells.push(at(row.last));
            rows.push(cells);
        }
        let widths: Vec<usize> = (0..rows[0].len())
            .map(|i| rows.iter().map(|r| r[i].chars().count()).max().unwrap_or(0))
            .collect();
        let mut out = String::new();
        for row in &rows {
            let line: Vec<String> = row
                .iter()
                .zip(&widths)
                .map(|(c, w)| format!("{c:<w$}"))
                .collect();
            out.push_str(line.join("   ").trim_end());
            out.push('\n');
        }
        let refused: u64 = self.rows.iter().map(Row::total_refused).sum();
        out.push_str(&format!(
            "\n{} requests over {:.0} s replayed ({} not: unidentified or unclassifiable); {refused} would have been refused.\n",
            self.requests, self.span, self.not_replayed
        ));
        out
    }

    /// The would-be refusals of the rows whose user `pick` selects.
    pub fn refused_where(&self, pick: impl Fn(&Row) -> bool) -> u64 {
        self.rows
            .iter()
            .filter(|r| pick(r))
            .map(Row::total_refused)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::Source;
    use crate::traffic::tests::line;

    fn rules(yaml: &str) -> RuleSet {
        RuleSet::from_sources(&[Source {
            path: "rules.yaml".into(),
            text: yaml.into(),
        }])
        .unwrap()
    }

    const RULES: &str = "levels:\n  - {name: small, seats: 1, queues: 1, handSize: 1, queueLength: 2, maxWait: 1s}\n\
        rules:\n  - name: limited\n    precedence: 100\n    match: {users: [bob]}\n    level: small\n    rate: {qps: 1, burst: 2}\n    watches: 1\n";

    #[test]
    fn a_bucket_refuses_what_comes_faster_than_its_rate() {
        let lines: Vec<String> = (0..5)
            .map(|i| {
                line(
                    "2026-11-28T10:00:00Z",
                    "bob",
                    "get",
                    &format!("/api/v1/namespaces/a/pods/p{i}"),
                    0.0,
                )
            })
            .collect();
        let rec = Recording::parse([lines.join("\n").as_str()], &[]);
        let replay = replay(&rec, &rules(RULES), DEFAULT_LIST_BUDGET);
        assert_eq!(replay.rows.len(), 1);
        assert_eq!(replay.rows[0].requests, 5);
        assert_eq!(
            replay.rows[0].refused.get("rate_limited"),
            Some(&3),
            "{replay:?}"
        );
    }

    #[test]
    fn a_second_watch_of_a_flow_at_its_limit_is_refused_until_the_first_ends() {
        let watch = |t: &str, id: &str| {
            serde_json::json!({"time": t, "auditId": id, "user": "bob", "verb": "watch",
                "path": "/api/v1/namespaces/a/pods", "code": 200, "servedBy": "cache", "seconds": 0.0})
            .to_string()
        };
        let end =
            serde_json::json!({"time": "2026-11-28T10:00:05Z", "auditId": "w1", "user": "bob",
            "verb": "watch", "ended": true, "seconds": 5.0})
            .to_string();
        let text = [
            watch("2026-11-28T10:00:00Z", "w1"),
            watch("2026-11-28T10:00:03Z", "w2"),
            end,
            watch("2026-11-28T10:00:06Z", "w3"),
        ]
        .join("\n");
        let rec = Recording::parse([text.as_str()], &[]);
        let replay = replay(&rec, &rules(RULES), DEFAULT_LIST_BUDGET);
        assert_eq!(
            replay.rows[0].refused.get("watch_limit"),
            Some(&1),
            "{replay:?}"
        );
        assert_eq!(replay.rows[0].first, Some(3.0));
    }

    #[test]
    fn requests_wait_for_seats_and_are_refused_when_the_queue_is_full_or_the_wait_too_long() {
        let level = "levels:\n  - {name: small, seats: 1, queues: 1, handSize: 1, queueLength: 2, maxWait: 1s}\n\
            rules:\n  - name: slow\n    precedence: 100\n    match: {users: [bob]}\n    level: small\n";
        // Four at once, each 3 s long: one runs, two wait (and time out after 1 s), one
        // finds the queue full.
        let lines: Vec<String> = (0..4)
            .map(|i| {
                line(
                    "2026-11-28T10:00:03Z",
                    "bob",
                    "get",
                    &format!("/api/v1/namespaces/a/pods/p{i}"),
                    3.0,
                )
            })
            .collect();
        let rec = Recording::parse([lines.join("\n").as_str()], &[]);
        let replay = replay(&rec, &rules(level), DEFAULT_LIST_BUDGET);
        let row = &replay.rows[0];
        assert_eq!(row.refused.get("queue_full"), Some(&1), "{replay:?}");
        assert_eq!(row.refused.get("queue_timeout"), Some(&2), "{replay:?}");
        assert!(replay.table().contains("QUEUE_TIMEOUT"));
    }
}

//! `bulwark rules suggest`: a rule folder sized from what each client class was served.
//!
//! Every identified request the recording says was answered is put in one class, in the
//! order the shipped rules (`deploy/base/rules`) try them: cluster admins (exempt), the
//! kubelets (a flow per node), each control-plane user (`system:kube-*`), each
//! ServiceAccount seen on several nodes (a DaemonSet: a flow per node), kube-system's other
//! ServiceAccounts, cluster-wide Secret LISTs and WATCHes (`list-heavy`), each other
//! namespace's ServiceAccounts (a flow per pod), and people. Requests the built-in
//! heartbeat rules matched stay theirs and are left out. Refused requests (Bulwark's
//! refusals and the apiservers' 429s) are not demand to make room for: the numbers are
//! what was served, with headroom.
//!
//! Each class's rule gets, from its busiest flow, a rate whose token bucket would have
//! served every one of its flows' requests (the most in any 10 s, and the burst such a
//! bucket needs), times the headroom, and a watch limit of the most watches one flow held
//! open, times the headroom. Levels are the shipped ones, with seats raised where the
//! requests in flight at once, times the headroom, needed more. Every rule is written in
//! `mode: shadow`, and every number says where it came from.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::Path;

use super::{Record, Recording};
use crate::rules::client::{NODE_NAME_CLAIM, POD_UID_CLAIM};
use crate::rules::{RuleSet, Source, request_for};

/// The shipped levels, which the suggestion starts from.
const SHIPPED_LEVELS: &str = include_str!("../../../deploy/base/rules/levels.yaml");

/// A ServiceAccount seen on this many nodes or more is a DaemonSet's.
const DAEMONSET_NODES: usize = 3;

/// How the numbers are made.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// What the observed peaks are multiplied by (2: twice what was seen).
    pub headroom: f64,
}

impl Default for Options {
    fn default() -> Self {
        Options { headroom: 2.0 }
    }
}

/// The suggested folder: file names and their text.
#[derive(Debug, Clone)]
pub struct Suggestion {
    /// `(file name, YAML)`, levels first.
    pub files: Vec<(String, String)>,
}

impl Suggestion {
    /// The files as rule sources, for validation.
    pub fn sources(&self) -> Vec<Source> {
        self.files
            .iter()
            .map(|(name, text)| Source {
                path: name.into(),
                text: text.clone(),
            })
            .collect()
    }

    /// Writes the files into `dir` (created; files of the same names replaced).
    pub fn write(&self, dir: &Path) -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        for (name, text) in &self.files {
            std::fs::write(dir.join(name), text)?;
        }
        Ok(())
    }
}

/// A client class: what one suggested rule matches.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Class {
    /// `system:masters`: exempt, as shipped.
    Admins,
    /// Kubelets (`system:nodes`).
    Kubelets,
    /// A control-plane user, `system:kube-*` and the like.
    Component(String),
    /// A ServiceAccount seen on several nodes: `(namespace, name, nodes)`.
    DaemonSet(String, String, usize),
    /// kube-system's other ServiceAccounts.
    KubeSystem,
    /// Cluster-wide LISTs and WATCHes of Secrets by anyone not above.
    SecretLists,
    /// The other ServiceAccounts of a namespace.
    Namespace(String),
    /// Everyone else.
    People,
}

/// How a class's flows are keyed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flow {
    User,
    Node,
    Pod,
}

impl Flow {
    fn as_str(self) -> &'static str {
        match self {
            Flow::User => "user",
            Flow::Node => "node",
            Flow::Pod => "pod",
        }
    }
}

/// A class's rule before its numbers: name, file, match, level, flow.
struct Shape {
    name: String,
    matches: String,
    level: &'static str,
    flow: Flow,
    why: String,
}

/// What a class's served requests show.
#[derive(Debug, Default)]
struct Observed {
    requests: usize,
    /// Per flow: when each request came, and for a watch until when it stayed open.
    flows: BTreeMap<String, Vec<(f64, Option<f64>)>>,
    /// Who was seen, for the comment.
    users: BTreeSet<String>,
}

/// The suggestion for `recording`.
pub fn suggest(recording: &Recording, options: &Options) -> Suggestion {
    let headroom = options.headroom.max(1.0);
    let builtin: BTreeSet<String> = RuleSet::builtin()
        .rule_names()
        .into_iter()
        .filter(|n| *n != "catch-all")
        .map(str::to_owned)
        .collect();
    let daemonsets = daemonsets(recording);
    let end = recording.span;
    let mut classes: BTreeMap<Class, Observed> = BTreeMap::new();
    let mut in_flight: BTreeMap<&'static str, Vec<(f64, f64)>> = BTreeMap::new();
    let mut left_out = 0usize;
    for record in &recording.records {
        if !record.identified() || !record.served() || builtin.contains(&record.rule) {
            left_out += 1;
            continue;
        }
        let class = class_of(record, &daemonsets);
        let shape = shape(&class, recording);
        let observed = classes.entry(class).or_default();
        observed.requests += 1;
        observed.users.insert(record.user.username.clone());
        let open_until = record
            .is_watch()
            .then(|| record.open_for.map_or(end, |d| record.at + d));
        observed
            .flows
            .entry(flow_of(record, shape.flow))
            .or_default()
            .push((record.at, open_until));
        if !record.is_watch() && shape.level != "exempt" {
            in_flight.entry(shape.level).or_default().push((
                record.at + record.waited,
                record.at + record.waited + record.seat_seconds(),
            ));
        }
    }
    let (first, last) = recording.window();
    let header = format!(
        "# Suggested by `bulwark rules suggest` from {} requests between {first} and {last}\n\
         # ({} left out: refused, unidentified, or the built-in heartbeat rules'), with {headroom}x\n\
         # headroom over what was served. In shadow mode: replay it (`bulwark rules replay`),\n\
         # watch bulwark_shadow_rejections_total, then remove `mode: shadow` to enforce.\n",
        recording.records.len() - left_out,
        left_out
    );
    let mut files = vec![(
        "levels.yaml".to_owned(),
        levels(&header, &in_flight, headroom),
    )];
    let mut precedence = Precedences::default();
    for (class, observed) in &classes {
        let shape = shape(class, recording);
        let text = rule_file(&header, &shape, observed, precedence.next(class), headroom);
        files.push((format!("{}.yaml", shape.name), text));
    }
    Suggestion { files }
}

/// Precedences in the shipped order, each class its own.
#[derive(Default)]
struct Precedences {
    used: BTreeMap<u32, ()>,
}

impl Precedences {
    fn next(&mut self, class: &Class) -> u32 {
        let mut p = match class {
            Class::Admins => 1,
            Class::Kubelets => 100,
            Class::Component(_) => 110,
            Class::DaemonSet(..) => 200,
            Class::KubeSystem => 290,
            Class::SecretLists => 800,
            Class::Namespace(_) => 900,
            Class::People => 1000,
        };
        while self.used.contains_key(&p) {
            p += 1;
        }
        self.used.insert(p, ());
        p
    }
}

/// The ServiceAccounts seen on [`DAEMONSET_NODES`] nodes or more, with how many.
fn daemonsets(recording: &Recording) -> BTreeMap<String, usize> {
    let mut nodes: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for record in &recording.records {
        if let Some(node) = record.claim(NODE_NAME_CLAIM)
            && record.user.username.starts_with(SA_PREFIX)
        {
            nodes.entry(&record.user.username).or_default().insert(node);
        }
    }
    nodes
        .into_iter()
        .filter(|(_, n)| n.len() >= DAEMONSET_NODES)
        .map(|(user, n)| (user.to_owned(), n.len()))
        .collect()
}

const SA_PREFIX: &str = "system:serviceaccount:";

fn class_of(record: &Record, daemonsets: &BTreeMap<String, usize>) -> Class {
    let user = &record.user;
    let in_group = |g: &str| user.groups.iter().any(|x| x == g);
    if in_group("system:masters") {
        return Class::Admins;
    }
    if user.username.starts_with("system:node:") && in_group("system:nodes") {
        return Class::Kubelets;
    }
    if let Some(sa) = user.username.strip_prefix(SA_PREFIX) {
        let (namespace, name) = sa.split_once(':').unwrap_or((sa, ""));
        if let Some(nodes) = daemonsets.get(&user.username) {
            return Class::DaemonSet(namespace.to_owned(), name.to_owned(), *nodes);
        }
        if namespace == "kube-system" {
            return Class::KubeSystem;
        }
        if cluster_wide_secret_read(record) {
            return Class::SecretLists;
        }
        return Class::Namespace(namespace.to_owned());
    }
    if user.username.starts_with("system:") {
        return Class::Component(user.username.clone());
    }
    if cluster_wide_secret_read(record) {
        return Class::SecretLists;
    }
    Class::People
}

fn cluster_wide_secret_read(record: &Record) -> bool {
    request_for(&record.verb, &record.path).is_ok_and(|info| {
        info.resource_request
            && info.api_group.is_empty()
            && info.resource == "secrets"
            && info.namespace.is_none()
            && matches!(record.verb.as_str(), "list" | "watch")
    })
}

/// A name a rule may have: lowercase letters, digits, `-` and `.`, at most 63 characters.
fn rule_name(text: &str) -> String {
    let name: String = text
        .chars()
        .map(|c| match c.to_ascii_lowercase() {
            c @ ('a'..='z' | '0'..='9' | '-' | '.') => c,
            _ => '-',
        })
        .collect();
    let name = name.trim_matches('-');
    name.chars()
        .take(63)
        .collect::<String>()
        .trim_end_matches('-')
        .to_owned()
}

fn shape(class: &Class, recording: &Recording) -> Shape {
    let saw_pods = |prefix: &str| {
        recording
            .records
            .iter()
            .filter(|r| r.user.username.starts_with(prefix))
            .any(|r| r.claim(POD_UID_CLAIM).is_some())
    };
    match class {
        Class::Admins => Shape {
            name: "cluster-admins".into(),
            matches: "      groups: [\"system:masters\"]\n".into(),
            level: "exempt",
            flow: Flow::User,
            why: "Break-glass: system:masters is exempt, as shipped.".into(),
        },
        Class::Kubelets => Shape {
            name: "kubelets".into(),
            matches: "      groups: [\"system:nodes\"]\n".into(),
            level: "system",
            flow: Flow::Node,
            why: "The kubelets, one flow per node (their heartbeats stay the built-in rules').".into(),
        },
        Class::Component(user) => Shape {
            name: rule_name(user.trim_start_matches("system:")),
            matches: format!("      users: [{user:?}]\n"),
            level: if user == "system:kube-proxy" {
                "system"
            } else {
                "workload-high"
            },
            flow: if user == "system:kube-proxy" {
                Flow::Node
            } else {
                Flow::User
            },
            why: format!("The control plane's {user}."),
        },
        Class::DaemonSet(namespace, name, nodes) => Shape {
            name: rule_name(&format!("{namespace}-{name}")),
            matches: format!("      serviceAccounts: [{namespace}/{name}]\n"),
            level: if namespace == "kube-system" && name == "kube-proxy" {
                "system"
            } else {
                "node-agents"
            },
            flow: Flow::Node,
            why: format!(
                "{namespace}/{name} was seen on {nodes} nodes: a DaemonSet, one flow per node."
            ),
        },
        Class::KubeSystem => Shape {
            name: "kube-system-service-accounts".into(),
            matches: "      serviceAccounts: [kube-system/*]\n".into(),
            level: "workload-high",
            flow: Flow::User,
            why: "kube-system's other ServiceAccounts (the controllers').".into(),
        },
        Class::SecretLists => Shape {
            name: "cluster-wide-secret-lists".into(),
            matches: "      verbs: [list, watch]\n      resources: [{group: \"\", resource: secrets}]\n      namespaces: [\"\"]\n".into(),
            level: "list-heavy",
            flow: Flow::User,
            why: "LISTs and WATCHes of every namespace's Secrets: the reads that OOM apiservers, on list-heavy's few seats.".into(),
        },
        Class::Namespace(namespace) => {
            let pods = saw_pods(&format!("{SA_PREFIX}{namespace}:"));
            Shape {
                name: rule_name(&format!("{namespace}-service-accounts")),
                matches: format!("      serviceAccounts: [{namespace}/*]\n"),
                level: "workload-low",
                flow: if pods { Flow::Pod } else { Flow::User },
                why: format!(
                    "The ServiceAccounts of {namespace}, one flow per {}.",
                    if pods {
                        "pod"
                    } else {
                        "user (their tokens name no pod)"
                    }
                ),
            }
        }
        Class::People => Shape {
            name: "people".into(),
            matches: "      groups: [\"system:authenticated\"]\n".into(),
            level: "global-default",
            flow: Flow::User,
            why: "Everyone else: people and scripts with their own credentials.".into(),
        },
    }
}

/// The flow a record is in, keyed as Bulwark keys it (a claim, else the source address).
fn flow_of(record: &Record, flow: Flow) -> String {
    let addr = || {
        record
            .source
            .map_or("-".to_owned(), |a| format!("addr:{a}"))
    };
    match flow {
        Flow::User => record.user.username.clone(),
        Flow::Node => record
            .claim(NODE_NAME_CLAIM)
            .map(|n| format!("node:{n}"))
            .or_else(|| {
                record
                    .user
                    .username
                    .strip_prefix("system:node:")
                    .map(|n| format!("node:{n}"))
            })
            .unwrap_or_else(addr),
        Flow::Pod => record
            .claim(POD_UID_CLAIM)
            .map(|u| format!("pod:{u}"))
            .unwrap_or_else(addr),
    }
}

/// One flow's peaks.
#[derive(Debug, Default, Clone)]
struct Peak {
    flow: String,
    /// The most requests in any 10 s, per second.
    per_second_10s: f64,
    /// The most in any 1 s.
    in_one_second: u32,
    /// The most watches open at once.
    watches: u32,
}

fn peak_of(flow: &str, requests: &[(f64, Option<f64>)]) -> Peak {
    let mut times: Vec<f64> = requests.iter().map(|(t, _)| *t).collect();
    times.sort_by(f64::total_cmp);
    let most_within = |window: f64| {
        let mut most = 0;
        let mut start = 0;
        for (i, t) in times.iter().enumerate() {
            // Within a microsecond of the window is outside it: times read from text.
            while *t - times[start] >= window - 1e-6 {
                start += 1;
            }
            most = most.max(i + 1 - start);
        }
        most
    };
    let mut edges: Vec<(f64, i32)> = requests
        .iter()
        .filter_map(|(t, until)| until.map(|u| [(*t, 1), (u, -1)]))
        .flatten()
        .collect();
    // Ends before starts at one instant: a watch that replaces another is not two.
    edges.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let mut open = 0i32;
    let mut watches = 0i32;
    for (_, d) in edges {
        open += d;
        watches = watches.max(open);
    }
    Peak {
        flow: flow.to_owned(),
        per_second_10s: most_within(10.0) as f64 / 10.0,
        in_one_second: u32::try_from(most_within(1.0)).unwrap_or(u32::MAX),
        watches: u32::try_from(watches).unwrap_or(0),
    }
}

/// The burst a token bucket of `qps` needs to have served every request at `times`.
fn burst_needed(times: &[f64], qps: f64) -> u32 {
    let mut sorted = times.to_vec();
    sorted.sort_by(f64::total_cmp);
    let mut owed = 0.0f64;
    let mut most = 0.0f64;
    let mut last = None::<f64>;
    for t in sorted {
        if let Some(last) = last {
            owed = (owed - (t - last) * qps).max(0.0);
        }
        owed += 1.0;
        most = most.max(owed);
        last = Some(t);
    }
    most.ceil() as u32
}

/// Up to one decimal, never below 0.1.
fn tenths_up(x: f64) -> f64 {
    ((x * 10.0).ceil() / 10.0).max(0.1)
}

fn rule_file(
    header: &str,
    shape: &Shape,
    observed: &Observed,
    precedence: u32,
    headroom: f64,
) -> String {
    let mut out = String::from(header);
    let users: Vec<&String> = observed.users.iter().take(5).collect();
    let _ = writeln!(
        out,
        "# {} {} requests from {} flow(s) of {} user(s): {}{}.",
        shape.why,
        observed.requests,
        observed.flows.len(),
        observed.users.len(),
        users
            .iter()
            .map(|u| u.as_str())
            .collect::<Vec<_>>()
            .join(", "),
        if observed.users.len() > users.len() {
            ", ..."
        } else {
            ""
        }
    );
    let _ = write!(
        out,
        "rules:\n  - name: {}\n    precedence: {precedence}\n    match:\n{}    level: {}\n",
        shape.name, shape.matches, shape.level
    );
    let _ = writeln!(out, "    flow: {}", shape.flow.as_str());
    if shape.level != "exempt" {
        let peaks: Vec<Peak> = observed
            .flows
            .iter()
            .map(|(flow, requests)| peak_of(flow, requests))
            .collect();
        let busiest = peaks
            .iter()
            .max_by(|a, b| a.per_second_10s.total_cmp(&b.per_second_10s))
            .cloned()
            .unwrap_or_default();
        // The reads that OOM apiservers get what they were served, no more: headroom there
        // is room for the next storm.
        let headroom = if shape.level == "list-heavy" {
            1.0
        } else {
            headroom
        };
        let qps = tenths_up(busiest.per_second_10s * headroom);
        let (burst_flow, burst_seen) = observed
            .flows
            .iter()
            .map(|(flow, requests)| {
                let times: Vec<f64> = requests.iter().map(|(t, _)| *t).collect();
                (flow.as_str(), burst_needed(&times, qps))
            })
            .max_by_key(|(_, b)| *b)
            .unwrap_or(("-", 1));
        let one_second = peaks.iter().map(|p| p.in_one_second).max().unwrap_or(1);
        let burst = ((f64::from(burst_seen.max(one_second)) * headroom).ceil() as u32).max(1);
        let _ = writeln!(
            out,
            "    # The busiest flow ({}) was served {:.1} requests a second over its busiest 10 s;\n    \
             # the most any flow was served in one second was {one_second}, and at {qps}/s a bucket\n    \
             # needs a burst of {burst_seen} to have served every request of {burst_flow}. Both x{headroom}.",
            busiest.flow, busiest.per_second_10s
        );
        let _ = writeln!(out, "    rate: {{qps: {qps}, burst: {burst}}}");
        if let Some(most) = peaks
            .iter()
            .max_by_key(|p| p.watches)
            .filter(|p| p.watches > 0)
        {
            let _ = writeln!(
                out,
                "    # The most watches one flow ({}) held open at once: {}; x{headroom}.",
                most.flow, most.watches
            );
            let _ = writeln!(
                out,
                "    watches: {}",
                ((f64::from(most.watches) * headroom).ceil() as u32).max(1)
            );
        }
        let _ = writeln!(out, "    mode: shadow");
    }
    out
}

/// The shipped levels, seats raised where what was in flight at once needed more.
fn levels(
    header: &str,
    in_flight: &BTreeMap<&'static str, Vec<(f64, f64)>>,
    headroom: f64,
) -> String {
    let most: BTreeMap<&str, u32> = in_flight
        .iter()
        .map(|(level, spans)| {
            let mut edges: Vec<(f64, i32)> = spans
                .iter()
                .flat_map(|(s, e)| [(*s, 1), (*e, -1)])
                .collect();
            edges.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
            let (mut open, mut most) = (0i32, 0i32);
            for (_, d) in edges {
                open += d;
                most = most.max(open);
            }
            (*level, u32::try_from(most).unwrap_or(0))
        })
        .collect();
    let mut out = String::from(header);
    out.push_str(
        "# The shipped levels (deploy/base/rules/levels.yaml); a level's seats are raised where the\n\
         # requests in flight at once in it, times the headroom, were more.\n",
    );
    let mut level = "";
    for line in SHIPPED_LEVELS.lines() {
        if let Some(name) = line.trim_start().strip_prefix("- name: ") {
            level = name.trim();
        }
        let seats = line
            .trim_start()
            .strip_prefix("seats: ")
            .and_then(|n| n.trim().parse::<u32>().ok());
        match (seats, most.get(level)) {
            (Some(shipped), Some(seen)) => {
                let wanted = (f64::from(*seen) * headroom).ceil() as u32;
                let indent = &line[..line.len() - line.trim_start().len()];
                if wanted > shipped {
                    let _ = writeln!(
                        out,
                        "{indent}# {seen} requests were in flight at once here; x{headroom} is above the shipped {shipped}.\n{indent}seats: {wanted}"
                    );
                } else {
                    let _ = writeln!(
                        out,
                        "{indent}# At most {seen} requests were in flight at once here.\n{line}"
                    );
                }
            }
            _ => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::traffic::tests::line;

    #[test]
    fn a_bucket_of_the_suggested_rate_and_burst_serves_what_was_served() {
        let times = [0.0, 0.1, 0.2, 0.3, 5.0, 5.1, 9.9, 10.0];
        let p = peak_of("f", &times.iter().map(|t| (*t, None)).collect::<Vec<_>>());
        assert_eq!(p.in_one_second, 4);
        assert!(
            (p.per_second_10s - 0.7).abs() < 1e-9,
            "{}",
            p.per_second_10s
        );
        assert_eq!(burst_needed(&times, 0.7), 4);
        assert_eq!(burst_needed(&times, 100.0), 1);
        assert_eq!(burst_needed(&[0.0, 0.0, 0.0], 1.0), 3);
    }

    #[test]
    fn open_watches_are_counted_at_their_most() {
        let p = peak_of(
            "f",
            &[
                (0.0, Some(10.0)),
                (1.0, Some(2.0)),
                (2.0, Some(3.0)),
                (5.0, Some(6.0)),
            ],
        );
        assert_eq!(
            p.watches, 2,
            "the one ending at 2 and the one starting at 2 are not both open"
        );
    }

    #[test]
    fn the_suggestion_is_a_valid_folder_in_shadow_mode_with_a_file_per_class() {
        let mut lines = Vec::new();
        for s in 0..20 {
            let t = format!("2026-11-28T10:00:{s:02}Z");
            lines.push(line(
                &t,
                "system:kube-scheduler",
                "get",
                "/api/v1/namespaces/a/pods/p",
                0.01,
            ));
            lines.push(line(&t, "alice", "list", "/api/v1/namespaces/a/pods", 0.01));
            lines.push(line(
                &t,
                "system:serviceaccount:tenant-1:reader",
                "list",
                "/api/v1/secrets",
                0.2,
            ));
        }
        let recording = Recording::parse([lines.join("\n").as_str()], &[]);
        let suggestion = suggest(&recording, &Options::default());
        let names: Vec<&str> = suggestion.files.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "levels.yaml",
                "kube-scheduler.yaml",
                "cluster-wide-secret-lists.yaml",
                "people.yaml"
            ]
        );
        let set = RuleSet::from_sources(&suggestion.sources())
            .unwrap_or_else(|p| panic!("{p:?}\n{:#?}", suggestion.files));
        let json = set.to_json().to_string();
        assert!(json.contains("cluster-wide-secret-lists"), "{json}");
        for (name, text) in &suggestion.files[1..] {
            assert!(text.contains("mode: shadow"), "{name}: {text}");
            assert!(text.contains("# The busiest flow"), "{name}: {text}");
        }
        // One request a second for 20 s: 1/s over 10 s, 2/s with headroom.
        assert!(
            suggestion.files[1].1.contains("rate: {qps: 2, burst: 2}"),
            "{}",
            suggestion.files[1].1
        );
    }
}

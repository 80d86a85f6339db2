//! kubectl-style tables of what the replicas' admin listeners answered: upper-case
//! headers, columns aligned three spaces apart, a `REPLICA` column when several replicas
//! were read, and a row saying why for a replica that could not be.

use std::fmt;
use std::time::{Duration, SystemTime};

use serde_json::Value;

use super::{Page, Read};

/// A table ready to print.
#[derive(Debug, Default)]
pub struct Table {
    headers: Vec<&'static str>,
    rows: Vec<Row>,
}

#[derive(Debug)]
enum Row {
    /// One cell per header.
    Cells(Vec<String>),
    /// The first cell, then a message across the rest (a replica that could not be read).
    Note(String, String),
}

impl Table {
    /// Whether the table has no row.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }
}

impl fmt::Display for Table {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut widths: Vec<usize> = self.headers.iter().map(|h| h.len()).collect();
        for row in &self.rows {
            match row {
                Row::Cells(cells) => {
                    for (width, cell) in widths.iter_mut().zip(cells) {
                        *width = (*width).max(cell.chars().count());
                    }
                }
                Row::Note(first, _) => widths[0] = widths[0].max(first.chars().count()),
            }
        }
        let line = |f: &mut fmt::Formatter<'_>, cells: &[&str]| {
            let mut text = String::new();
            for (i, cell) in cells.iter().enumerate() {
                if i > 0 {
                    text.push_str("   ");
                }
                text.push_str(cell);
                let pad = widths.get(i).copied().unwrap_or(0);
                let len = cell.chars().count();
                text.extend(std::iter::repeat_n(' ', pad.saturating_sub(len)));
            }
            writeln!(f, "{}", text.trim_end())
        };
        line(f, &self.headers)?;
        for row in &self.rows {
            match row {
                Row::Cells(cells) => {
                    let cells: Vec<&str> = cells.iter().map(String::as_str).collect();
                    line(f, &cells)?;
                }
                Row::Note(first, note) => line(f, &[first, note])?,
            }
        }
        Ok(())
    }
}

/// The table of `page` from what each replica answered; `wide` adds columns. `now` ages
/// the fleet's renewals. The `REPLICA` column comes when `reads` holds several replicas;
/// otherwise a replica that could not be read is no row (its error is the caller's to say).
pub fn table(page: Page, reads: &[Read], wide: bool, now: SystemTime) -> Table {
    let several = reads.len() > 1;
    let mut headers = match page {
        Page::Flows => vec!["FLOW", "RULE", "LEVEL", "REQUESTS/S", "REFUSED/S", "WAIT"],
        Page::Levels => vec!["NAME", "SEATS", "LIMIT", "EXECUTING", "WAITING", "QUEUES"],
        Page::Upstream => vec![
            "NAME",
            "HEALTHY",
            "THROTTLED",
            "PENDING",
            "WATCHES",
            "CONNECTIONS",
        ],
        Page::Fleet => vec!["NAME", "STANDING", "MEMBERS", "RENEWED", "ERROR"],
    };
    if wide {
        headers.extend(match page {
            Page::Flows => &["LAST-REFUSAL"][..],
            Page::Levels => &["HAND", "QUEUE-LENGTH", "MAX-WAIT", "EXEMPT", "DRAINING"],
            Page::Upstream => &["LIST-BYTES"],
            Page::Fleet => &["ADMIN", "REASON"],
        });
    }
    // The fleet's table is a row per replica, named in its first column already.
    let replica_column = several && page != Page::Fleet;
    if replica_column {
        headers.insert(0, "REPLICA");
    }
    let mut rows = Vec::new();
    for read in reads {
        let answer = match &read.answer {
            Ok(answer) => answer,
            Err(why) => {
                if several || page == Page::Fleet {
                    rows.push(Row::Note(read.replica.clone(), why.clone()));
                }
                continue;
            }
        };
        let cells = match page {
            Page::Flows => flows(answer, wide),
            Page::Levels => levels(answer, wide),
            Page::Upstream => upstream(answer, wide),
            Page::Fleet => vec![fleet(
                &read.replica,
                read.admin.as_deref(),
                answer,
                wide,
                now,
            )],
        };
        for mut row in cells {
            if replica_column {
                row.insert(0, read.replica.clone());
            }
            rows.push(Row::Cells(row));
        }
    }
    Table { headers, rows }
}

fn text(value: &Value) -> String {
    match value {
        Value::String(s) if s.is_empty() => "-".into(),
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        other => other.to_string(),
    }
}

fn rate(value: &Value) -> String {
    format!("{:.1}", value.as_f64().unwrap_or(0.0))
}

fn yes(value: &Value) -> String {
    if value.as_bool().unwrap_or(false) {
        "yes"
    } else {
        "no"
    }
    .into()
}

/// A duration as kubectl ages things: `45s`, `12m`, `3h`, `2d`.
fn age(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0..120 => format!("{s}s"),
        120..7_200 => format!("{}m", s / 60),
        7_200..172_800 => format!("{}h", s / 3_600),
        _ => format!("{}d", s / 86_400),
    }
}

/// `/debug/flows`: the busiest flows, then those refused the most that are not among them.
fn flows(answer: &Value, wide: bool) -> Vec<Vec<String>> {
    let listed = |key: &str| answer[key].as_array().cloned().unwrap_or_default();
    let mut seen = std::collections::HashSet::new();
    let mut rows = Vec::new();
    for flow in listed("busiest").iter().chain(listed("mostRefused").iter()) {
        let key = (
            text(&flow["identity"]),
            text(&flow["rule"]),
            text(&flow["level"]),
        );
        if !seen.insert(key.clone()) {
            continue;
        }
        let wait = flow["meanQueueWaitMs"].as_f64().unwrap_or(0.0);
        let mut row = vec![
            key.0,
            key.1,
            key.2,
            rate(&flow["requestsPerSecond"]),
            rate(&flow["refusedPerSecond"]),
            if wait > 0.0 {
                format!("{wait:.0}ms")
            } else {
                "-".into()
            },
        ];
        if wide {
            let last = &flow["lastRefusal"];
            row.push(if last.is_null() {
                "-".into()
            } else {
                format!(
                    "{} {} {} ({} ago)",
                    text(&last["reason"]),
                    text(&last["verb"]),
                    text(&last["resource"]),
                    age(Duration::from_secs_f64(
                        last["secondsAgo"].as_f64().unwrap_or(0.0).max(0.0)
                    ))
                )
            });
        }
        rows.push(row);
    }
    rows
}

/// `/debug/levels`: a row per priority level.
fn levels(answer: &Value, wide: bool) -> Vec<Vec<String>> {
    let levels = answer["levels"].as_array().cloned().unwrap_or_default();
    levels
        .iter()
        .map(|l| {
            let mut row = vec![
                text(&l["name"]),
                text(&l["seats"]),
                text(&l["seatsLimit"]),
                text(&l["executingSeats"]),
                text(&l["waiting"]),
                format!("{}/{}", text(&l["activeQueues"]), text(&l["queues"])),
            ];
            if wide {
                row.extend([
                    text(&l["handSize"]),
                    text(&l["queueLength"]),
                    format!("{}s", l["maxWaitSeconds"].as_f64().unwrap_or(0.0)),
                    yes(&l["exempt"]),
                    yes(&l["draining"]),
                ]);
            }
            row
        })
        .collect()
}

/// `/debug/upstream`: a row per apiserver replica.
fn upstream(answer: &Value, wide: bool) -> Vec<Vec<String>> {
    let replicas = answer["replicas"].as_array().cloned().unwrap_or_default();
    replicas
        .iter()
        .map(|r| {
            let mut row = vec![
                text(&r["name"]),
                yes(&r["healthy"]),
                yes(&r["throttled"]),
                text(&r["pending"]),
                text(&r["watches"]),
                text(&r["connections"]),
            ];
            if wide {
                row.push(text(&r["inFlightBytes"]));
            }
            row
        })
        .collect()
}

/// `/debug/fleet`: the replica's standing, the members it sees, its last renewal.
fn fleet(
    replica: &str,
    admin: Option<&str>,
    answer: &Value,
    wide: bool,
    now: SystemTime,
) -> Vec<String> {
    let mut row = if answer["enabled"] == Value::Bool(false) {
        vec![
            replica.into(),
            "off".into(),
            "-".into(),
            "-".into(),
            "-".into(),
        ]
    } else {
        let shares = &answer["shares"];
        let renewed = answer["lastRenewalUnixMillis"]
            .as_u64()
            .map_or("never".into(), |ms| {
                let at = SystemTime::UNIX_EPOCH + Duration::from_millis(ms);
                format!("{} ago", age(now.duration_since(at).unwrap_or_default()))
            });
        vec![
            replica.into(),
            text(&shares["standing"]),
            shares["members"].as_array().map_or(0, Vec::len).to_string(),
            renewed,
            text(&answer["lastError"]),
        ]
    };
    if wide {
        let reason = if answer["enabled"] == Value::Bool(false) {
            &answer["reason"]
        } else {
            &answer["shares"]["reason"]
        };
        row.extend([admin.unwrap_or("-").into(), text(reason)]);
    }
    row
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn read(replica: &str, answer: Result<Value, &str>) -> Read {
        Read {
            replica: replica.into(),
            admin: Some(format!("https://{replica}:9443")),
            answer: answer.map_err(String::from),
        }
    }

    fn flows_of(identity: &str, rps: f64) -> Value {
        json!({
            "windowSeconds": 10.0, "flows": 1, "untrackedPerSecond": 0.0,
            "busiest": [{
                "identity": identity, "rule": "alice-lists", "level": "lists",
                "requestsPerSecond": rps, "refusedPerSecond": 0.0, "meanQueueWaitMs": 0.0,
                "lastRefusal": null,
            }],
            "mostRefused": [],
        })
    }

    #[test]
    fn one_replica_s_flows_are_aligned_under_upper_case_headers() {
        let table = table(
            Page::Flows,
            &[read("a", Ok(flows_of("alice", 12.345)))],
            false,
            SystemTime::UNIX_EPOCH,
        );
        assert_eq!(
            table.to_string(),
            "FLOW    RULE          LEVEL   REQUESTS/S   REFUSED/S   WAIT\n\
             alice   alice-lists   lists   12.3         0.0         -\n"
        );
    }

    #[test]
    fn several_replicas_get_a_replica_column_and_an_unreadable_one_a_row_saying_why() {
        let table = table(
            Page::Flows,
            &[
                read("bulwark-a", Ok(flows_of("alice", 2.0))),
                read("bulwark-b", Err("unreachable: connection refused")),
            ],
            false,
            SystemTime::UNIX_EPOCH,
        );
        assert_eq!(
            table.to_string(),
            "REPLICA     FLOW    RULE          LEVEL   REQUESTS/S   REFUSED/S   WAIT\n\
             bulwark-a   alice   alice-lists   lists   2.0          0.0         -\n\
             bulwark-b   unreachable: connection refused\n"
        );
    }

    #[test]
    fn a_flow_both_busy_and_refused_is_one_row_and_wide_says_its_last_refusal() {
        let flow = json!({
            "identity": "bob", "rule": "r", "level": "l", "requestsPerSecond": 5.0,
            "refusedPerSecond": 1.3, "meanQueueWaitMs": 31.6,
            "lastRefusal": {"secondsAgo": 150.0, "reason": "rate-limited", "verb": "list",
                            "resource": "pods", "auditId": "x"},
        });
        let answer = json!({"busiest": [flow.clone()], "mostRefused": [flow]});
        let table = table(
            Page::Flows,
            &[read("a", Ok(answer))],
            true,
            SystemTime::UNIX_EPOCH,
        );
        assert_eq!(
            table.to_string(),
            "FLOW   RULE   LEVEL   REQUESTS/S   REFUSED/S   WAIT   LAST-REFUSAL\n\
             bob    r      l       5.0          1.3         32ms   rate-limited list pods (2m ago)\n"
        );
    }

    #[test]
    fn the_fleet_table_ages_each_replica_s_renewal() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
        let answer = json!({
            "identity": "a", "lastRenewalUnixMillis": 997_000, "lastError": null,
            "shares": {"standing": "shared", "reason": "split by demand", "members": ["a", "b"]},
        });
        let off = json!({"enabled": false, "reason": "no fleet section"});
        let table = table(
            Page::Fleet,
            &[
                read("a", Ok(answer)),
                read("b", Ok(off)),
                read("c", Err("no answer")),
            ],
            true,
            now,
        );
        assert_eq!(
            table.to_string(),
            "NAME   STANDING   MEMBERS   RENEWED   ERROR   ADMIN            REASON\n\
             a      shared     2         3s ago    -       https://a:9443   split by demand\n\
             b      off        -         -         -       https://b:9443   no fleet section\n\
             c      no answer\n"
        );
    }

    #[test]
    fn levels_and_upstream_show_their_figures() {
        let levels = json!({"levels": [{"name": "lists", "seats": 10, "seatsLimit": 30,
            "executingSeats": 2, "waiting": 1, "activeQueues": 1, "queues": 64}]});
        assert_eq!(
            table(
                Page::Levels,
                &[read("a", Ok(levels))],
                false,
                SystemTime::UNIX_EPOCH
            )
            .to_string(),
            "NAME    SEATS   LIMIT   EXECUTING   WAITING   QUEUES\n\
             lists   10      30      2           1         1/64\n"
        );
        let upstream = json!({"replicas": [{"name": "10.0.0.11:6443", "healthy": true,
            "throttled": false, "pending": 0, "watches": 3, "connections": 1}]});
        assert_eq!(
            table(
                Page::Upstream,
                &[read("a", Ok(upstream))],
                false,
                SystemTime::UNIX_EPOCH
            )
            .to_string(),
            "NAME             HEALTHY   THROTTLED   PENDING   WATCHES   CONNECTIONS\n\
             10.0.0.11:6443   yes       no          0         3         1\n"
        );
    }

    #[test]
    fn ages_read_as_kubectl_s() {
        assert_eq!(age(Duration::from_secs(119)), "119s");
        assert_eq!(age(Duration::from_secs(600)), "10m");
        assert_eq!(age(Duration::from_secs(10_800)), "3h");
        assert_eq!(age(Duration::from_secs(259_200)), "3d");
    }
}

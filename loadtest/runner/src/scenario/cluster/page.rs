//! The `cluster` scenario's report: each chart once per front door, side by side on the
//! same axes, and the figures in a column per front door.

use super::{BulwarkGauges, ClusterReport, ClusterRun, JobFigures};
use crate::controlplane::NODE_LEASE_SECONDS;
use crate::report::Class;
use crate::report::charts::{Bars, Lines, bars, colour, latency_chart, lines};
use crate::report::html::{Chart, Item, Page, Section, Table};

/// A run's figures on one line.
pub(super) fn run_line(r: &ClusterRun) -> String {
    let ooms: u64 = r.apiservers.iter().map(|a| a.oom_kills).sum();
    let done = r.jobs.iter().filter(|j| j.done_s > 0.0).count();
    let slowest = r.jobs.iter().map(|j| j.done_s).fold(0.0, f64::max);
    let jobs = if done == r.jobs.len() {
        format!("all {} Jobs done in {slowest:.0} s", r.jobs.len())
    } else {
        format!("{done} of {} Jobs done", r.jobs.len())
    };
    let restarts: u64 = r.component_restarts.values().sum();
    let restarts = match restarts {
        0 => String::new(),
        n => format!(", {n} component restarts"),
    };
    format!(
        "{} NotReady, Lease renewal p99 {:.0} ms, {jobs}, {ooms} OOM kills{restarts}",
        r.not_ready_max, r.lease_renewals.p99_ms
    )
}

/// The one line at the top of the report.
pub fn verdict(r: &ClusterReport) -> String {
    let runs: Vec<String> = r
        .runs
        .iter()
        .map(|run| format!("{}: {}", run.front, run_line(run)))
        .collect();
    let storm = if r.storm > 0 {
        format!(
            ", a storm of {} LISTing {} MiB of Secrets",
            r.storm,
            r.storm_bytes >> 20
        )
    } else {
        String::new()
    };
    format!(
        "{} nodes, {} Jobs of {} pods{storm}. {}.",
        r.nodes + r.probes,
        r.jobs,
        r.pods_per_job,
        runs.join("; ")
    )
}

const MIB: f64 = (1 << 20) as f64;

/// The report as a self-contained HTML page: each chart once per front door, side by side
/// on the same axes.
pub fn page(r: &ClusterReport) -> anyhow::Result<Page> {
    let axes = Axes::of(r);
    let mut memory = Vec::new();
    let mut nodes = Vec::new();
    let mut calls = Vec::new();
    let mut refusals = Vec::new();
    for run in &r.runs {
        memory.push(memory_chart(run, &axes)?);
        nodes.push(nodes_chart(run, &axes)?);
        calls.push(calls_chart(run, &axes)?);
        refusals.push(refusals_chart(run, &axes)?);
    }
    let jobs = jobs_chart(r)?;
    let latency = latency_bars(r)?;
    let per_replica = replica_requests(r, axes.x_max)?;
    let mut sections = vec![
        Section {
            title: "The apiservers' memory".into(),
            items: memory,
        },
        Section {
            title: "The nodes".into(),
            items: nodes,
        },
        Section {
            title: "The burst".into(),
            items: vec![chart("Jobs: to scheduled and to done", jobs)],
        },
        Section {
            title: "What the apiservers served".into(),
            items: calls.into_iter().chain(per_replica).collect(),
        },
        Section {
            title: "Latency at the clients".into(),
            items: latency,
        },
        Section {
            title: "Who was refused".into(),
            items: refusals,
        },
    ];
    sections.push(Section {
        title: "Figures".into(),
        items: vec![Item::Table(figures(r)), Item::Table(rules(r))],
    });
    Ok(Page {
        title: format!("cluster: {} nodes, direct and through Bulwark", r.nodes + r.probes),
        verdict: verdict(r),
        notes: vec![
            format!(
                "{} kube-apiservers; {} KWOK nodes and {} probe nodes; kube-controller-manager, kube-scheduler and KWOK each as itself; per node a logging agent and a kube-proxy, and the storm's tenant operators, as pods: ServiceAccount tokens bound to their nodes, through the kubernetes Service (the Bulwarks it leads to, or the apiservers in the direct run); under {} in the Bulwark run ({} Bulwark(s)).",
                r.replicas, r.nodes, r.probes, r.rules, r.bulwarks
            ),
            "Time is seconds since the burst: the Jobs created at once, the agents and the storm started.".into(),
        ]
        .into_iter()
        .chain((!r.command.is_empty()).then(|| format!("Command: {}", r.command)))
        .collect(),
        sections,
    })
}

/// The axes every run's charts share, so that the front doors compare at a glance.
struct Axes {
    x_max: f64,
    /// The apiservers' memory limit, MiB.
    limit: Option<f64>,
    memory_max: f64,
    calls_max: f64,
    refused_max: f64,
    lease_max: f64,
}

impl Axes {
    fn of(r: &ClusterReport) -> Axes {
        let x_max = r
            .runs
            .iter()
            .filter_map(|run| run.samples.last())
            .map(|s| s.t)
            .fold(1.0, f64::max);
        let limit = r
            .runs
            .iter()
            .flat_map(|run| &run.apiservers)
            .filter_map(|a| a.limit_bytes)
            .max()
            .map(|b| b as f64 / MIB);
        let memory_max = r
            .runs
            .iter()
            .flat_map(|run| &run.samples)
            .flat_map(|s| s.memory.iter().flatten())
            .map(|b| *b as f64 / MIB)
            .fold(limit.unwrap_or(1.0), f64::max);
        let calls_max = r
            .runs
            .iter()
            .flat_map(|run| &run.samples)
            .map(|s| s.lists_per_s.max(s.watch_events_per_s).max(s.open_watches))
            .fold(1.0, f64::max);
        let refused_max = r
            .runs
            .iter()
            .flat_map(|run| &run.samples)
            .flat_map(|s| s.refused_per_s.values())
            .copied()
            .fold(1.0, f64::max);
        let lease_max = r
            .runs
            .iter()
            .flat_map(|run| &run.samples)
            .map(|s| {
                s.oldest_lease_s
                    .max(s.not_ready as f64)
                    .max(s.slowest_renewal_s)
            })
            .fold(f64::from(NODE_LEASE_SECONDS), f64::max);
        Axes {
            x_max,
            limit,
            memory_max,
            calls_max,
            refused_max,
            lease_max,
        }
    }
}

/// A run's apiserver memory, each replica a line, OOM kills marked.
fn memory_chart(run: &ClusterRun, axes: &Axes) -> anyhow::Result<Item> {
    let replicas = run.samples.first().map_or(0, |s| s.memory.len());
    let series = (0..replicas)
        .map(|i| {
            let points = run
                .samples
                .iter()
                .filter_map(|s| Some((s.t, *s.memory.get(i)?.as_ref()? as f64 / MIB)))
                .collect();
            (format!("apiserver {i}"), colour(i), points)
        })
        .collect();
    let title = format!("{}: apiserver memory (MiB), OOM kills marked", run.front);
    Ok(chart(
        &title,
        lines(&Lines {
            title: &title,
            y_desc: "MiB",
            series,
            limit: axes.limit,
            limit_label: "memory limit",
            marks: oom_marks(run, axes.limit.unwrap_or(axes.memory_max)),
            x_max: axes.x_max,
            y_max: axes.memory_max * 1.05,
        })?,
    ))
}

/// A run's oldest Lease, slowest renewal and nodes not Ready.
fn nodes_chart(run: &ClusterRun, axes: &Axes) -> anyhow::Result<Item> {
    let title = format!(
        "{}: the oldest Lease, the slowest renewal (s), nodes not Ready",
        run.front
    );
    Ok(chart(
        &title,
        lines(&Lines {
            title: &title,
            y_desc: "seconds / nodes",
            series: vec![
                (
                    "oldest Lease (s)".into(),
                    colour(0),
                    run.samples
                        .iter()
                        .map(|s| (s.t, s.oldest_lease_s))
                        .collect(),
                ),
                (
                    "slowest Lease renewal (s)".into(),
                    colour(2),
                    run.samples
                        .iter()
                        .map(|s| (s.t, s.slowest_renewal_s))
                        .collect(),
                ),
                (
                    "nodes not Ready".into(),
                    colour(1),
                    run.samples
                        .iter()
                        .map(|s| (s.t, s.not_ready as f64))
                        .collect(),
                ),
            ],
            limit: Some(f64::from(NODE_LEASE_SECONDS)),
            limit_label: "Lease duration",
            marks: Vec::new(),
            x_max: axes.x_max,
            y_max: axes.lease_max * 1.05,
        })?,
    ))
}

/// A run's LISTs and watch events a second and the watches open at the apiservers.
fn calls_chart(run: &ClusterRun, axes: &Axes) -> anyhow::Result<Item> {
    let title = format!(
        "{}: LISTs/s, watch events/s and watches open at the apiservers",
        run.front
    );
    Ok(chart(
        &title,
        lines(&Lines {
            title: &title,
            y_desc: "per second",
            series: vec![
                (
                    "LIST/s".into(),
                    colour(0),
                    run.samples.iter().map(|s| (s.t, s.lists_per_s)).collect(),
                ),
                (
                    "watch events/s".into(),
                    colour(1),
                    run.samples
                        .iter()
                        .map(|s| (s.t, s.watch_events_per_s))
                        .collect(),
                ),
                (
                    "watches open".into(),
                    colour(2),
                    run.samples.iter().map(|s| (s.t, s.open_watches)).collect(),
                ),
            ],
            limit: None,
            limit_label: "",
            marks: Vec::new(),
            x_max: axes.x_max,
            y_max: axes.calls_max * 1.05,
        })?,
    ))
}

/// A run's 429s a second by who refused whom.
fn refusals_chart(run: &ClusterRun, axes: &Axes) -> anyhow::Result<Item> {
    let keys: std::collections::BTreeSet<&String> = run
        .samples
        .iter()
        .flat_map(|s| s.refused_per_s.keys())
        .collect();
    let series = keys
        .into_iter()
        .enumerate()
        .map(|(i, key)| {
            let points = run
                .samples
                .iter()
                .map(|s| (s.t, s.refused_per_s.get(key).copied().unwrap_or(0.0)))
                .collect();
            (key.clone(), colour(i), points)
        })
        .collect();
    let title = format!("{}: 429s per second by who refused whom", run.front);
    Ok(chart(
        &title,
        lines(&Lines {
            title: &title,
            y_desc: "429/s",
            series,
            limit: None,
            limit_label: "",
            marks: Vec::new(),
            x_max: axes.x_max,
            y_max: axes.refused_max * 1.05,
        })?,
    ))
}

/// Each Job's seconds to all pods bound and to all succeeded, the front doors side by side.
fn jobs_chart(r: &ClusterReport) -> anyhow::Result<String> {
    bars(&Bars {
        title: "each Job: seconds to all pods bound, and to all succeeded (none: never)",
        y_desc: "seconds",
        categories: r
            .runs
            .first()
            .map(|run| run.jobs.iter().map(|j| j.name.clone()).collect())
            .unwrap_or_default(),
        series: r
            .runs
            .iter()
            .flat_map(|run| {
                [
                    (
                        format!("{} scheduled", run.front),
                        run.jobs.iter().map(|j| j.scheduled_s).collect(),
                    ),
                    (
                        format!("{} done", run.front),
                        run.jobs.iter().map(|j| j.done_s).collect(),
                    ),
                ]
            })
            .collect(),
        limit: None,
        log_y: false,
    })
}

/// Where a run keeps a class's figures.
type ClassOf = fn(&ClusterRun) -> Option<&Class>;

/// Latency percentiles of each client class Bulwark's run times at the client (the probes'
/// Lease renewals, the agents' lists, the storm's LISTs), the front doors side by side.
fn latency_bars(r: &ClusterReport) -> anyhow::Result<Vec<Item>> {
    let classes: [(&str, ClassOf); 4] = [
        ("Lease renewals", |run| Some(&run.lease_renewals)),
        ("node agents", |run| run.agents.as_ref()),
        ("kube-proxies", |run| run.kube_proxies.as_ref()),
        ("storm LISTs", |run| run.storm.as_ref()),
    ];
    let mut items = Vec::new();
    for (class, of) in classes {
        let runs = r
            .runs
            .iter()
            .filter_map(|run| Some((run.front.as_str(), of(run)?)));
        if let Some(chart) = latency_chart(class, runs)? {
            items.push(Item::Chart(chart));
        }
    }
    Ok(items)
}

/// Requests per second each apiserver replica served, per front door (runs recorded
/// before these were sampled have none, and draw none).
fn replica_requests(r: &ClusterReport, x_max: f64) -> anyhow::Result<Vec<Item>> {
    let y_max = r
        .runs
        .iter()
        .flat_map(|run| &run.samples)
        .flat_map(|s| s.requests_per_s.iter().copied())
        .fold(1.0, f64::max);
    let mut items = Vec::new();
    for run in &r.runs {
        let replicas = run
            .samples
            .iter()
            .map(|s| s.requests_per_s.len())
            .max()
            .unwrap_or(0);
        if replicas == 0 {
            continue;
        }
        let series = (0..replicas)
            .map(|i| {
                let points = run
                    .samples
                    .iter()
                    .map(|s| (s.t, s.requests_per_s.get(i).copied().unwrap_or(0.0)))
                    .collect();
                (format!("apiserver {i}"), colour(i), points)
            })
            .collect();
        let title = format!("{}: requests per second per apiserver replica", run.front);
        items.push(chart(
            &title,
            lines(&Lines {
                title: &title,
                y_desc: "requests/s",
                series,
                limit: None,
                limit_label: "",
                marks: Vec::new(),
                x_max,
                y_max: y_max * 1.05,
            })?,
        ));
    }
    Ok(items)
}

fn chart(title: &str, svg: String) -> Item {
    Item::Chart(Chart {
        title: title.to_owned(),
        svg,
    })
}

/// A cross at the limit where a replica was OOM-killed: the first sample that counts one
/// more kill than the one before.
fn oom_marks(run: &ClusterRun, at: f64) -> Vec<(f64, f64)> {
    run.samples
        .windows(2)
        .filter(|w| {
            w[1].oom_kills
                .iter()
                .zip(&w[0].oom_kills)
                .any(|(now, before)| now > before)
        })
        .map(|w| (w[1].t, at))
        .collect()
}

/// Figure by figure, a column per front door.
// Over 120 lines: the report's table, a row per figure in the order the page shows them.
fn figures(r: &ClusterReport) -> Table {
    let mut header = vec!["figure".to_string()];
    header.extend(r.runs.iter().map(|run| run.front.clone()));
    let row = |name: &str, cell: &dyn Fn(&ClusterRun) -> String| {
        let mut row = vec![name.to_owned()];
        row.extend(r.runs.iter().map(cell));
        row
    };
    let class = |c: &Option<Class>| {
        c.as_ref().map_or("-".into(), |c| {
            format!(
                "{}, {}, {}, {}, {:.1}",
                c.requests, c.ok, c.rejected, c.errors, c.p99_ms
            )
        })
    };
    let mut rows = vec![
        row("all nodes Ready after (s)", &|run| {
            format!("{:.1}", run.all_ready_s)
        }),
        row("most nodes NotReady at once", &|run| {
            run.not_ready_max.to_string()
        }),
        row(
            "Lease renewal at the client: p50 / p99 (ms), 429s, errors",
            &|run| {
                let c = &run.lease_renewals;
                format!(
                    "{:.1} / {:.1}, {}, {}",
                    c.p50_ms, c.p99_ms, c.rejected, c.errors
                )
            },
        ),
        row("Lease age p50 / p99 / max (s)", &|run| {
            format!(
                "{:.1} / {:.1} / {:.1}",
                run.lease_age_p50_s, run.lease_age_p99_s, run.lease_age_max_s
            )
        }),
        row("Jobs: seconds to all pods Running (-: never)", &|run| {
            job_seconds(run, |j| j.running_s)
        }),
        row("Jobs: seconds to done (-: never)", &|run| {
            job_seconds(run, |j| j.done_s)
        }),
        row("pods bound per second", &|run| {
            format!("{:.1}", run.scheduling_pods_per_s)
        }),
    ];
    for i in 0..r.replicas {
        rows.push(row(
            &format!("apiserver {i}: peak / limit (MiB), OOM kills"),
            &|run| {
                run.apiservers.get(i).map_or("-".into(), |a| {
                    format!(
                        "{} / {}, {}",
                        a.peak_bytes.map_or("-".into(), |b| (b >> 20).to_string()),
                        a.limit_bytes.map_or("-".into(), |b| (b >> 20).to_string()),
                        a.oom_kills
                    )
                })
            },
        ));
    }
    rows.push(row(
        "LISTs per second at the apiservers: mean / peak",
        &|run| {
            let n = run.samples.len().max(1) as f64;
            let mean = run.samples.iter().map(|s| s.lists_per_s).sum::<f64>() / n;
            let peak = run
                .samples
                .iter()
                .map(|s| s.lists_per_s)
                .fold(0.0, f64::max);
            format!("{mean:.1} / {peak:.1}")
        },
    ));
    rows.push(row("watch events per second: mean / peak", &|run| {
        let n = run.samples.len().max(1) as f64;
        let mean = run
            .samples
            .iter()
            .map(|s| s.watch_events_per_s)
            .sum::<f64>()
            / n;
        let peak = run
            .samples
            .iter()
            .map(|s| s.watch_events_per_s)
            .fold(0.0, f64::max);
        format!("{mean:.1} / {peak:.1}")
    }));
    rows.push(row("watches open at the apiservers: peak", &|run| {
        let peak = run
            .samples
            .iter()
            .map(|s| s.open_watches)
            .fold(0.0, f64::max);
        format!("{peak:.0}")
    }));
    rows.push(row(
        "storm LISTs: requests, ok, 429, errors, p99 (ms)",
        &|run| class(&run.storm),
    ));
    rows.push(row(
        "node agents: requests, ok, 429, errors, p99 (ms)",
        &|run| class(&run.agents),
    ));
    rows.push(row(
        "kube-proxies: requests, ok, 429, errors, p99 (ms)",
        &|run| class(&run.kube_proxies),
    ));
    rows.push(row("components started again after exiting", &|run| {
        let restarted: Vec<String> = run
            .component_restarts
            .iter()
            .filter(|(_, n)| **n > 0)
            .map(|(name, n)| format!("{name} {n}"))
            .collect();
        match restarted.is_empty() {
            true => "none".into(),
            false => restarted.join(", "),
        }
    }));
    rows.push(row("Bulwark: peak RSS (MiB), CPU (s)", &|run| {
        run.bulwark.as_ref().map_or("-".into(), |c| {
            format!("{}, {:.1}", c.peak_rss_bytes >> 20, c.cpu_seconds)
        })
    }));
    rows.push(row(
        "Bulwark at most: connections, cached watchers, watches upstream, cached MiB (objects)",
        &|run| {
            BulwarkGauges::peaks(run.samples.iter().filter_map(|s| s.bulwark.as_ref())).map_or(
                "-".into(),
                |g| {
                    format!(
                        "{:.0}, {:.0}, {:.0}, {:.1} ({:.0})",
                        g.connections,
                        g.watchers,
                        g.upstream_watches,
                        g.cached_bytes / MIB,
                        g.cached_objects
                    )
                },
            )
        },
    ));
    Table { header, rows }
}

/// Each Job's seconds to one of its moments, `-` where it never came.
fn job_seconds(run: &ClusterRun, at: fn(&JobFigures) -> f64) -> String {
    run.jobs
        .iter()
        .map(|j| match at(j) {
            0.0 => "-".to_string(),
            s => format!("{s:.0}"),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// What Bulwark matched per rule, and every refusal by who refused whom.
fn rules(r: &ClusterReport) -> Table {
    let mut rows = Vec::new();
    for run in &r.runs {
        rows.extend(
            run.rule_requests
                .iter()
                .map(|(k, v)| vec![run.front.clone(), format!("rule {k}"), format!("{v:.0}")]),
        );
        rows.extend(run.refused.iter().map(|(k, v)| {
            vec![
                run.front.clone(),
                format!("refused: {k}"),
                format!("{v:.0}"),
            ]
        }));
    }
    Table {
        header: vec!["run".into(), "requests".into(), "count".into()],
        rows,
    }
}

impl crate::report::Outcome for ClusterReport {
    fn scenario(&self) -> &str {
        &self.scenario
    }

    fn json(&self) -> serde_json::Result<String> {
        serde_json::to_string_pretty(self)
    }

    fn page(&self) -> anyhow::Result<Page> {
        page(self)
    }

    fn verdict(&self) -> String {
        verdict(self)
    }

    fn figures(&self) -> anyhow::Result<String> {
        Ok(crate::report::outcome::tables(&page(self)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scenario::cluster::Sample;

    #[test]
    fn an_oom_kill_is_marked_where_the_count_grows() {
        let sample = |t: f64, kills: Vec<u64>| Sample {
            t,
            oom_kills: kills,
            ..Sample::default()
        };
        let run = ClusterRun {
            samples: vec![
                sample(0.0, vec![0, 0]),
                sample(3.0, vec![0, 1]),
                sample(6.0, vec![0, 1]),
                sample(9.0, vec![1, 1]),
            ],
            ..ClusterRun::default()
        };
        assert_eq!(oom_marks(&run, 1200.0), vec![(3.0, 1200.0), (9.0, 1200.0)]);
    }
}

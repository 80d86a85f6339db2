//! The charts of a scenario's report, drawn with plotters' SVG backend from the figures the
//! report records: apiserver memory per replica (over time with the limit and OOM kills
//! marked where a timeline was recorded, peaks otherwise), requests per replica, latency
//! percentiles per class, and 429s by class (over time, or totals); for a bench
//! (`passthrough`), each target's saturation throughput and CPU time per request beside
//! the floor's, with the per-target summary. Every run sits beside the others on the same
//! scale, so direct and Bulwark compare at a glance.

use plotters::prelude::*;

use super::html::{Chart, Item, Page, Section, Table};
use super::{Report, Run, SATURATION, fixed_rate_class, human_bytes, thousands};

/// A chart's size in pixels.
const SIZE: (u32, u32) = (560, 340);
/// One colour per run (direct first) or per replica or class, in order.
const PALETTE: [RGBColor; 8] = [
    RGBColor(214, 39, 40),
    RGBColor(31, 119, 180),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];
/// The memory limit's line and the OOM kills' marks.
const LIMIT: RGBColor = RGBColor(0, 0, 0);
const MIB: f64 = (1u64 << 20) as f64;

/// An axis value without needless decimals.
fn tick(v: &f64) -> String {
    if v.abs() >= 10.0 || *v == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

/// The `i`th colour of the reports' palette.
pub fn colour(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

/// The report as a self-contained HTML document.
pub fn html(report: &Report) -> anyhow::Result<String> {
    Ok(super::html::render(&page(report)?))
}

/// The report's page: the verdict, the charts, and every figure as a table.
pub fn page(report: &Report) -> anyhow::Result<Page> {
    let mut notes = vec![format!(
        "Scenario {} at scale {}; runs, in the order they ran: {}.",
        report.scenario,
        report.scale,
        run_names(report).join(", ")
    )];
    if let Some(bench) = &report.bench {
        notes.push(format!("Load: {}", bench.load_generator));
        notes.push(format!("Pinning: {}", bench.pinning));
    }
    let mut sections = Vec::new();
    if let Some(summary) = super::bench_summary(report) {
        sections.push(bench(report, summary)?);
    }
    sections.extend([memory(report)?, requests(report)?]);
    sections.push(latency(report)?);
    sections.push(watch_cost(report)?);
    sections.push(rejected(report)?);
    sections.retain(|s| !s.items.is_empty());
    let mut header = vec![String::new()];
    header.extend(run_names(report));
    let rows = super::figures(report)
        .into_iter()
        .map(|(label, cells)| {
            std::iter::once(label.trim().to_string())
                .chain(cells)
                .collect()
        })
        .collect();
    sections.push(Section {
        title: "Every figure".into(),
        items: vec![Item::Table(Table { header, rows })],
    });
    Ok(Page {
        title: format!(
            "bulwark-loadtest {} (scale {})",
            report.scenario, report.scale
        ),
        verdict: verdict(report),
        notes,
        sections,
    })
}

fn run_names(report: &Report) -> Vec<String> {
    report.runs.iter().map(|(n, _)| n.clone()).collect()
}

/// OOM kills of one run: the kernel's per replica on a real control plane, the model's
/// otherwise.
fn oom_kills(run: &Run) -> u64 {
    let per_replica: u64 = run.apiserver.replica_oom_kills.iter().sum();
    per_replica.max(run.apiserver.ooms)
}

/// The highest apiserver memory of one run.
fn peak_memory(run: &Run) -> u64 {
    let replicas = run.apiserver.replica_peak_memory_bytes.iter().copied();
    replicas
        .max()
        .unwrap_or(0)
        .max(run.apiserver.peak_heap_bytes)
}

/// One line on what the run showed, from the figures every scenario records: OOM kills
/// direct against the rest, else peak memory, and 429s; for a bench, each proxy's
/// saturation throughput, CPU time per request and throughput against the floor's.
pub fn verdict(report: &Report) -> String {
    if let Some(summary) = super::bench_summary(report) {
        let parts: Vec<String> = summary
            .iter()
            .skip(1)
            .filter(|row| row[0] != "direct")
            .map(|row| format!("{} {}/s, {} µs, {} x floor", row[0], row[1], row[2], row[3]))
            .collect();
        return format!(
            "Saturation, CPU per request and throughput per core against the floor's: {}.",
            parts.join("; ")
        );
    }
    let each = |f: &dyn Fn(&Run) -> String| -> String {
        let parts: Vec<String> = report
            .runs
            .iter()
            .map(|(name, run)| format!("{name} {}", f(run)))
            .collect();
        parts.join(", ")
    };
    let kills = each(&|r| oom_kills(r).to_string());
    let direct = report.runs.iter().find(|(n, _)| n == "direct");
    let others: Vec<&Run> = report
        .runs
        .iter()
        .filter(|(n, _)| n != "direct")
        .map(|(_, r)| r)
        .collect();
    let any_kills = report.runs.iter().any(|(_, r)| oom_kills(r) > 0);
    let line = match direct {
        Some((_, d)) if oom_kills(d) > 0 && others.iter().all(|r| oom_kills(r) == 0) => {
            format!("Bulwark kept every apiserver up: OOM kills {kills}.")
        }
        _ if any_kills => format!("Apiservers were OOM-killed: OOM kills {kills}."),
        _ => {
            let limit = report
                .runs
                .iter()
                .map(|(_, r)| r.apiserver.heap_limit_bytes)
                .max()
                .unwrap_or(0);
            if report.runs.iter().all(|(_, r)| peak_memory(r) == 0) {
                return with_rejected(report, "No apiserver was OOM-killed.".into(), &each);
            }
            let of = if limit > 0 {
                format!(" of {} each", human_bytes(limit))
            } else {
                String::new()
            };
            format!(
                "No apiserver was OOM-killed; peak apiserver memory {}{of}.",
                each(&|r| human_bytes(peak_memory(r)))
            )
        }
    };
    with_rejected(report, line, &each)
}

/// A figure of every run, written `name figure, …`.
type Each<'a> = dyn Fn(&dyn Fn(&Run) -> String) -> String + 'a;

/// The verdict with each run's 429s added, where there were any.
fn with_rejected(report: &Report, mut line: String, each: &Each) -> String {
    let rejected = |r: &Run| r.classes.values().map(|c| c.rejected).sum::<u64>();
    if report.runs.iter().any(|(_, r)| rejected(r) > 0) {
        line.push_str(&format!(" 429s: {}.", each(&|r| rejected(r).to_string())));
    }
    line
}

/// A bench's summary table, each target's saturation throughput, and the proxy's CPU time
/// per request in every phase.
fn bench(report: &Report, summary: Vec<Vec<String>>) -> anyhow::Result<Section> {
    let mut rows = summary.into_iter();
    let header = rows.next().unwrap_or_default();
    let mut items = vec![Item::Table(Table {
        header,
        rows: rows.collect(),
    })];
    let series = report
        .runs
        .iter()
        .map(|(n, r)| {
            let rps = r.classes.get(SATURATION).map_or(0.0, |c| c.rps);
            (n.clone(), vec![rps / 1000.0])
        })
        .collect();
    let title = "Saturation throughput".to_string();
    let svg = bars(&Bars {
        title: &title,
        y_desc: "thousand requests/s",
        categories: vec!["saturation".into()],
        series,
        limit: None,
        log_y: false,
    })?;
    items.push(Item::Chart(Chart { title, svg }));
    let rates = report
        .bench
        .as_ref()
        .map_or(&[][..], |b| &b.fixed_rates[..]);
    let mut phases: Vec<(String, String)> = rates
        .iter()
        .map(|r| {
            (
                fixed_rate_class(*r),
                format!("{}/s", thousands(f64::from(*r))),
            )
        })
        .collect();
    phases.push((SATURATION.into(), SATURATION.into()));
    // Every run, direct's bars empty, so that each keeps its colour of the other charts.
    let series: Vec<(String, Vec<f64>)> = report
        .runs
        .iter()
        .map(|(n, r)| {
            let cpu = |phase: &str| {
                let class = r.classes.get(phase)?;
                class.cpu_us_per_request()
            };
            let v = phases.iter().map(|(p, _)| cpu(p).unwrap_or(0.0)).collect();
            (n.clone(), v)
        })
        .collect();
    if series.iter().any(|(_, v)| v.iter().any(|us| *us > 0.0)) {
        let title = "Proxy CPU time per request".to_string();
        let svg = bars(&Bars {
            title: &title,
            y_desc: "µs",
            categories: phases.into_iter().map(|(_, label)| label).collect(),
            series,
            limit: None,
            log_y: false,
        })?;
        items.push(Item::Chart(Chart { title, svg }));
    }
    Ok(Section {
        title: "Per target: throughput, CPU per request and added latency".into(),
        items,
    })
}

/// Apiserver memory: per replica over time where recorded, peaks per replica otherwise.
fn memory(report: &Report) -> anyhow::Result<Section> {
    let mut section = Section {
        title: "Apiserver memory".into(),
        items: Vec::new(),
    };
    let limit = report
        .runs
        .iter()
        .map(|(_, r)| r.apiserver.heap_limit_bytes)
        .max()
        .unwrap_or(0) as f64
        / MIB;
    let limit = (limit > 0.0).then_some(limit);
    let timed: Vec<(&String, &Run)> = report
        .runs
        .iter()
        .filter(|(_, r)| {
            r.timeline
                .as_ref()
                .is_some_and(|t| !t.replica_memory_bytes.is_empty())
        })
        .map(|(n, r)| (n, r))
        .collect();
    if !timed.is_empty() {
        let x_max = timed
            .iter()
            .filter_map(|(_, r)| r.timeline.as_ref()?.seconds.last().copied())
            .fold(1.0, f64::max);
        let y_max = timed
            .iter()
            .filter_map(|(_, r)| r.timeline.as_ref())
            .flat_map(|t| t.replica_memory_bytes.iter().flatten())
            .map(|b| *b as f64 / MIB)
            .fold(limit.unwrap_or(0.0), f64::max);
        for (name, run) in timed {
            let Some(t) = run.timeline.as_ref() else {
                continue;
            };
            let series = t
                .replica_memory_bytes
                .iter()
                .enumerate()
                .map(|(i, v)| {
                    let points = t.seconds.iter().zip(v).map(|(s, b)| (*s, *b as f64 / MIB));
                    (format!("replica {i}"), colour(i), points.collect())
                })
                .collect();
            let kills: Vec<f64> = t.oom_kills_at_s.iter().flatten().copied().collect();
            let title = format!("{name}: memory per apiserver, {} OOM kills", kills.len());
            let mark_at = limit.unwrap_or(y_max);
            let svg = lines(&Lines {
                limit_label: "memory limit",
                title: &title,
                y_desc: "MiB",
                series,
                limit,
                marks: kills.iter().map(|s| (*s, mark_at)).collect(),
                x_max,
                y_max,
            })?;
            section.items.push(Item::Chart(Chart { title, svg }));
        }
        return Ok(section);
    }
    let replicas = report
        .runs
        .iter()
        .map(|(_, r)| r.apiserver.replica_peak_memory_bytes.len())
        .max()
        .unwrap_or(0);
    let (categories, series): (Vec<String>, Vec<(String, Vec<f64>)>) = if replicas > 0 {
        let categories = (0..replicas).map(|i| format!("replica {i}")).collect();
        let series = report
            .runs
            .iter()
            .map(|(n, r)| {
                let peaks = &r.apiserver.replica_peak_memory_bytes;
                let v = (0..replicas)
                    .map(|i| peaks.get(i).copied().unwrap_or(0) as f64 / MIB)
                    .collect();
                (format!("{n} ({} OOM kills)", oom_kills(r)), v)
            })
            .collect();
        (categories, series)
    } else {
        let series = report
            .runs
            .iter()
            .map(|(n, r)| {
                let v = vec![r.apiserver.peak_heap_bytes as f64 / MIB];
                (format!("{n} ({} OOM kills)", oom_kills(r)), v)
            })
            .collect();
        (vec!["highest replica".into()], series)
    };
    if series.iter().all(|(_, v)| v.iter().all(|x| *x == 0.0)) {
        return Ok(section);
    }
    let title = "Peak apiserver memory".to_string();
    let svg = bars(&Bars {
        title: &title,
        y_desc: "MiB",
        categories,
        series,
        limit,
        log_y: false,
    })?;
    section.items.push(Item::Chart(Chart { title, svg }));
    Ok(section)
}

/// Requests each replica served, per run.
fn requests(report: &Report) -> anyhow::Result<Section> {
    let mut section = Section {
        title: "Requests per apiserver replica".into(),
        items: Vec::new(),
    };
    let replicas = report
        .runs
        .iter()
        .map(|(_, r)| r.apiserver.replica_requests.len())
        .max()
        .unwrap_or(0);
    if replicas == 0 {
        return Ok(section);
    }
    let series = report
        .runs
        .iter()
        .map(|(n, r)| {
            let v = (0..replicas)
                .map(|i| r.apiserver.replica_requests.get(i).copied().unwrap_or(0) as f64)
                .collect();
            (n.clone(), v)
        })
        .collect();
    let title = "Requests each replica served".to_string();
    let svg = bars(&Bars {
        title: &title,
        y_desc: "requests",
        categories: (0..replicas).map(|i| format!("replica {i}")).collect(),
        series,
        limit: None,
        log_y: false,
    })?;
    section.items.push(Item::Chart(Chart { title, svg }));
    Ok(section)
}

/// The classes of every run, sorted.
fn classes(report: &Report) -> Vec<String> {
    let mut classes: Vec<String> = report
        .runs
        .iter()
        .flat_map(|(_, r)| r.classes.keys().cloned())
        .collect();
    classes.sort();
    classes.dedup();
    classes
}

/// Latency percentiles of successful requests, one chart per class.
fn latency(report: &Report) -> anyhow::Result<Section> {
    let mut section = Section {
        title: "Latency of successful requests per class".into(),
        items: Vec::new(),
    };
    let none = crate::Class::default();
    for class in classes(report) {
        let runs = report
            .runs
            .iter()
            .map(|(n, r)| (n.as_str(), r.classes.get(&class).unwrap_or(&none)));
        if let Some(chart) = latency_chart(&class, runs)? {
            section.items.push(Item::Chart(chart));
        }
    }
    Ok(section)
}

/// One class's latency percentiles of successful requests (p50, p99, p99.9), a bar per
/// run in each group, on a log scale; `None` when no run has any.
pub fn latency_chart<'a>(
    class: &str,
    runs: impl IntoIterator<Item = (&'a str, &'a crate::Class)>,
) -> anyhow::Result<Option<Chart>> {
    let series: Vec<(String, Vec<f64>)> = runs
        .into_iter()
        .map(|(run, c)| (run.to_owned(), vec![c.p50_ms, c.p99_ms, c.p999_ms]))
        .collect();
    if series.iter().all(|(_, v)| v.iter().all(|x| *x <= 0.0)) {
        return Ok(None);
    }
    let title = format!("{class}: latency percentiles (ms, log scale)");
    let svg = bars(&Bars {
        title: &title,
        y_desc: "ms",
        categories: vec!["p50".into(), "p99".into(), "p99.9".into()],
        series,
        limit: None,
        log_y: true,
    })?;
    Ok(Some(Chart { title, svg }))
}

/// 429s by class: over time where a timeline was recorded, totals otherwise.
fn rejected(report: &Report) -> anyhow::Result<Section> {
    let mut section = Section {
        title: "429s by class".into(),
        items: Vec::new(),
    };
    let classes = classes(report);
    let timed: Vec<(&String, &Run)> = report
        .runs
        .iter()
        .filter(|(_, r)| r.timeline.as_ref().is_some_and(|t| !t.rejected.is_empty()))
        .map(|(n, r)| (n, r))
        .collect();
    if !timed.is_empty() && timed.len() == report.runs.len() {
        let x_max = timed
            .iter()
            .filter_map(|(_, r)| r.timeline.as_ref()?.seconds.last().copied())
            .fold(1.0, f64::max);
        let y_max = timed
            .iter()
            .filter_map(|(_, r)| r.timeline.as_ref())
            .flat_map(|t| t.rejected.values().flatten())
            .map(|n| *n as f64)
            .fold(1.0, f64::max);
        for (name, run) in timed {
            let Some(t) = run.timeline.as_ref() else {
                continue;
            };
            let series = classes
                .iter()
                .enumerate()
                .filter_map(|(i, class)| {
                    let v = t.rejected.get(class)?;
                    let points = t.seconds.iter().zip(v).map(|(s, n)| (*s, *n as f64));
                    Some((class.clone(), colour(i), points.collect()))
                })
                .collect();
            let title = format!("{name}: 429s per second by class");
            let svg = lines(&Lines {
                limit_label: "memory limit",
                title: &title,
                y_desc: "429s per tick",
                series,
                limit: None,
                marks: Vec::new(),
                x_max,
                y_max,
            })?;
            section.items.push(Item::Chart(Chart { title, svg }));
        }
        return Ok(section);
    }
    let any = report
        .runs
        .iter()
        .any(|(_, r)| r.classes.values().any(|c| c.rejected > 0));
    if classes.is_empty() || !any {
        return Ok(section);
    }
    let series = report
        .runs
        .iter()
        .map(|(n, r)| {
            let v = classes
                .iter()
                .map(|c| r.classes.get(c).map_or(0.0, |c| c.rejected as f64))
                .collect();
            (n.clone(), v)
        })
        .collect();
    let title = "429s per class, whole run".to_string();
    let svg = bars(&Bars {
        title: &title,
        y_desc: "429s",
        categories: classes,
        series,
        limit: None,
        log_y: false,
    })?;
    section.items.push(Item::Chart(Chart { title, svg }));
    Ok(section)
}

/// What the nodes' connections and watches cost the process serving them (informers): the
/// memory of one idle connection and of one watch, and how long an update took to reach
/// its watchers, each run a series.
fn watch_cost(report: &Report) -> anyhow::Result<Section> {
    let mut section = Section {
        title: "What a watcher costs".into(),
        items: Vec::new(),
    };
    let runs: Vec<(String, &super::WatchCost)> = report
        .runs
        .iter()
        .filter_map(|(n, r)| {
            Some((
                format!("{n} ({})", r.watch_cost.as_ref()?.measured),
                r.watch_cost.as_ref()?,
            ))
        })
        .collect();
    if runs.is_empty() {
        return Ok(section);
    }
    let kib = |b: Option<u64>| b.unwrap_or(0) as f64 / 1024.0;
    let title = "Memory per idle connection and per watch".to_string();
    let svg = bars(&Bars {
        title: &title,
        y_desc: "KiB",
        categories: vec!["idle connection".into(), "watch".into()],
        series: runs
            .iter()
            .map(|(n, w)| {
                (
                    n.clone(),
                    vec![kib(w.per_connection_bytes()), kib(w.per_watch_bytes())],
                )
            })
            .collect(),
        limit: None,
        log_y: false,
    })?;
    section.items.push(Item::Chart(Chart { title, svg }));
    let ms = |t: &Option<[f64; 3]>, i: usize| t.map_or(0.0, |t| t[i]);
    let title = "Update to its watchers (ms)".to_string();
    let svg = bars(&Bars {
        title: &title,
        y_desc: "ms",
        categories: [
            "Secret p50",
            "Secret p99",
            "Secret max",
            "EndpointSlice to all p50",
            "to all p99",
            "to all max",
        ]
        .map(String::from)
        .to_vec(),
        series: runs
            .iter()
            .map(|(n, w)| {
                let v = (0..3)
                    .map(|i| ms(&w.secret_delivery_ms, i))
                    .chain((0..3).map(|i| ms(&w.slice_to_all_ms, i)))
                    .collect();
                (n.clone(), v)
            })
            .collect(),
        limit: None,
        log_y: false,
    })?;
    section.items.push(Item::Chart(Chart { title, svg }));
    Ok(section)
}

/// One line of a chart: its legend, colour and points.
pub type Line = (String, RGBColor, Vec<(f64, f64)>);

/// A line chart over seconds.
pub struct Lines<'a> {
    /// The caption.
    pub title: &'a str,
    /// The y axis's unit.
    pub y_desc: &'a str,
    /// Each line: its legend, colour and points.
    pub series: Vec<Line>,
    /// A dashed horizontal line, e.g. a memory limit.
    pub limit: Option<f64>,
    /// The dashed line's legend.
    pub limit_label: &'a str,
    /// Points marked with a cross, e.g. OOM kills.
    pub marks: Vec<(f64, f64)>,
    /// The axes' ends, shared by charts set side by side.
    pub x_max: f64,
    /// See `x_max`.
    pub y_max: f64,
}

/// Draws a line chart as an SVG document.
pub fn lines(c: &Lines) -> anyhow::Result<String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE)?;
        // Headroom above the highest line for the legend.
        let y_max = (c.y_max * 1.35).max(1.0);
        let mut chart = ChartBuilder::on(&root)
            .caption(c.title, ("sans-serif", 17))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(56)
            .build_cartesian_2d(0f64..c.x_max.max(1.0), 0f64..y_max)?;
        chart
            .configure_mesh()
            .x_desc("seconds into the load")
            .y_desc(c.y_desc)
            .y_label_formatter(&tick)
            .x_label_formatter(&|v| format!("{v:.0}"))
            .light_line_style(RGBColor(238, 238, 238))
            .draw()?;
        for (name, colour, points) in &c.series {
            let colour = *colour;
            chart
                .draw_series(LineSeries::new(
                    points.iter().copied(),
                    colour.stroke_width(2),
                ))?
                .label(name.as_str())
                .legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 18, y)], colour.stroke_width(2))
                });
        }
        if let Some(limit) = c.limit {
            chart
                .draw_series(DashedLineSeries::new(
                    [(0.0, limit), (c.x_max.max(1.0), limit)],
                    8,
                    5,
                    LIMIT.stroke_width(2),
                ))?
                .label(c.limit_label)
                .legend(|(x, y)| PathElement::new([(x, y), (x + 18, y)], LIMIT.stroke_width(2)));
        }
        if !c.marks.is_empty() {
            chart
                .draw_series(
                    c.marks
                        .iter()
                        .map(|p| Cross::new(*p, 7, PALETTE[0].stroke_width(3))),
                )?
                .label("OOM kill")
                .legend(|(x, y)| Cross::new((x + 9, y), 5, PALETTE[0].stroke_width(3)));
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(RGBColor(200, 200, 200))
            .draw()?;
        root.present()?;
    }
    Ok(svg)
}

/// A bar chart: groups of bars, one bar per series in each group.
pub struct Bars<'a> {
    /// The caption.
    pub title: &'a str,
    /// The y axis's unit.
    pub y_desc: &'a str,
    /// The groups' names along the x axis.
    pub categories: Vec<String>,
    /// Each series: its legend and one value per category.
    pub series: Vec<(String, Vec<f64>)>,
    /// A dashed horizontal line, e.g. a memory limit.
    pub limit: Option<f64>,
    /// A logarithmic y axis (latencies that span orders of magnitude).
    pub log_y: bool,
}

/// Draws a grouped bar chart as an SVG document.
pub fn bars(c: &Bars) -> anyhow::Result<String> {
    let groups = c.categories.len().max(1);
    let values = c.series.iter().flat_map(|(_, v)| v.iter().copied());
    let top = values
        .clone()
        .fold(c.limit.unwrap_or(0.0), f64::max)
        .max(1.0);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE)?;
        let mut builder = ChartBuilder::on(&root);
        builder
            .caption(c.title, ("sans-serif", 17))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(56);
        // Group g is centred on x = g; the axis labels whole numbers with their group's name.
        let x = -0.5f64..groups as f64 - 0.5;
        let categories = c.categories.clone();
        let name = move |v: &f64| {
            let g = v.round();
            if (v - g).abs() > 1e-6 || g < 0.0 {
                return String::new();
            }
            categories.get(g as usize).cloned().unwrap_or_default()
        };
        let n = c.series.len().max(1) as f64;
        let width = 0.8 / n;
        let left = |g: usize, s: usize| g as f64 - 0.4 + s as f64 * width;
        if c.log_y {
            let floor = values.filter(|v| *v > 0.0).fold(top, f64::min) / 2.0;
            let mut chart = builder.build_cartesian_2d(x, (floor..top * 4.0).log_scale())?;
            chart
                .configure_mesh()
                .disable_x_mesh()
                .x_labels(groups + 1)
                .x_label_formatter(&name)
                .y_desc(c.y_desc)
                .y_label_formatter(&tick)
                .light_line_style(RGBColor(238, 238, 238))
                .draw()?;
            for (s, (label, v)) in c.series.iter().enumerate() {
                let colour = colour(s);
                chart
                    .draw_series(
                        v.iter()
                            .enumerate()
                            .filter(|(_, y)| **y > 0.0)
                            .map(|(g, y)| {
                                Rectangle::new(
                                    [(left(g, s), floor), (left(g, s) + width, *y)],
                                    colour.filled(),
                                )
                            }),
                    )?
                    .label(label.as_str())
                    .legend(move |(x, y)| {
                        Rectangle::new([(x, y - 5), (x + 12, y + 5)], colour.filled())
                    });
            }
            legend(&mut chart)?;
        } else {
            // Headroom above the highest bar for the legend.
            let mut chart = builder.build_cartesian_2d(x, 0f64..top * 1.35)?;
            chart
                .configure_mesh()
                .disable_x_mesh()
                .x_labels(groups + 1)
                .x_label_formatter(&name)
                .y_desc(c.y_desc)
                .y_label_formatter(&tick)
                .light_line_style(RGBColor(238, 238, 238))
                .draw()?;
            for (s, (label, v)) in c.series.iter().enumerate() {
                let colour = colour(s);
                chart
                    .draw_series(v.iter().enumerate().map(|(g, y)| {
                        Rectangle::new(
                            [(left(g, s), 0.0), (left(g, s) + width, *y)],
                            colour.filled(),
                        )
                    }))?
                    .label(label.as_str())
                    .legend(move |(x, y)| {
                        Rectangle::new([(x, y - 5), (x + 12, y + 5)], colour.filled())
                    });
            }
            if let Some(limit) = c.limit {
                chart
                    .draw_series(DashedLineSeries::new(
                        [(-0.5, limit), (groups as f64 - 0.5, limit)],
                        8,
                        5,
                        LIMIT.stroke_width(2),
                    ))?
                    .label("memory limit")
                    .legend(|(x, y)| {
                        PathElement::new([(x, y), (x + 18, y)], LIMIT.stroke_width(2))
                    });
            }
            legend(&mut chart)?;
        }
        root.present()?;
    }
    Ok(svg)
}

/// The legend, top right, over a translucent background.
fn legend<'a, DB, CT>(chart: &mut ChartContext<'a, DB, CT>) -> anyhow::Result<()>
where
    DB: DrawingBackend + 'a,
    DB::ErrorType: 'static,
    CT: CoordTranslate,
{
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(RGBColor(200, 200, 200))
        .draw()
        .map_err(|e| anyhow::anyhow!("drawing a legend: {e}"))
}

#[cfg(test)]
mod tests {
    use super::super::{Apiserver, Class, Timeline};
    use super::*;

    fn run(ooms: u64, rejected: u64) -> Run {
        let mut run = Run {
            apiserver: Apiserver {
                heap_limit_bytes: 600 << 20,
                peak_heap_bytes: 700 << 20,
                ooms,
                replica_requests: vec![100, 200, 300],
                ..Apiserver::default()
            },
            ..Run::default()
        };
        run.classes.insert(
            "storm".into(),
            Class {
                rejected,
                p50_ms: 2.0,
                p99_ms: 40.0,
                p999_ms: 900.0,
                ..Class::default()
            },
        );
        run.timeline = Some(Timeline {
            seconds: vec![1.0, 2.0, 3.0],
            replica_memory_bytes: vec![vec![300 << 20, 650 << 20, 280 << 20]; 3],
            oom_kills_at_s: vec![vec![2.0], vec![], vec![]],
            rejected: [("storm".to_string(), vec![0, rejected, 0])].into(),
        });
        run
    }

    #[test]
    fn the_verdict_compares_oom_kills_direct_with_bulwark() {
        let report = Report::new(
            "list-storm",
            1.0,
            vec![("direct".into(), run(4, 0)), ("bulwark".into(), run(0, 17))],
        );
        assert_eq!(
            verdict(&report),
            "Bulwark kept every apiserver up: OOM kills direct 4, bulwark 0. 429s: direct 0, bulwark 17."
        );
    }

    #[test]
    fn a_bench_page_opens_with_its_summary_throughput_and_cpu_per_request() {
        let report = super::super::tests::bench();
        let page = page(&report).unwrap();
        let first = &page.sections[0];
        let Item::Table(summary) = &first.items[0] else {
            panic!("the summary table comes first");
        };
        assert_eq!(summary.header[3], "x floor");
        assert_eq!(summary.rows.len(), report.runs.len());
        let titles: Vec<&str> = first
            .items
            .iter()
            .filter_map(|i| match i {
                Item::Chart(c) => Some(c.title.as_str()),
                Item::Table(_) => None,
            })
            .collect();
        assert_eq!(
            titles,
            ["Saturation throughput", "Proxy CPU time per request"]
        );
        assert!(
            page.verdict
                .contains("bulwark 30,000/s, 20.0 µs, 0.50 x floor")
        );
        assert!(!page.verdict.contains("direct"), "{}", page.verdict);
    }

    #[test]
    fn every_chart_is_an_svg_with_its_marks() {
        let report = Report::new(
            "list-storm",
            1.0,
            vec![("direct".into(), run(1, 0)), ("bulwark".into(), run(0, 5))],
        );
        let page = page(&report).unwrap();
        let charts: Vec<&Chart> = page
            .sections
            .iter()
            .flat_map(|s| &s.items)
            .filter_map(|i| match i {
                Item::Chart(c) => Some(c),
                Item::Table(_) => None,
            })
            .collect();
        // memory ×2 runs, requests, latency (one class), 429s ×2 runs
        assert_eq!(
            charts.len(),
            6,
            "{:?}",
            charts.iter().map(|c| &c.title).collect::<Vec<_>>()
        );
        for c in &charts {
            assert!(
                c.svg.contains("<svg") && c.svg.contains("</svg>"),
                "{}",
                c.title
            );
        }
        assert!(
            charts[0]
                .title
                .starts_with("direct: memory per apiserver, 1 OOM kills")
        );
        assert!(charts[0].svg.contains("memory limit"));
        assert!(charts[0].svg.contains("OOM kill"));
    }

    #[test]
    fn a_watch_cost_is_drawn_as_memory_per_watcher_and_delivery_per_run() {
        let cost = |measured: &str, per_watch: u64| super::super::WatchCost {
            measured: measured.into(),
            connections: 10,
            watches: 100,
            rss_before_bytes: 1 << 20,
            rss_connected_bytes: (1 << 20) + 10 * 20 * 1024,
            rss_watching_bytes: (1 << 20) + 10 * 20 * 1024 + 100 * per_watch,
            secret_delivery_ms: Some([1.0, 5.0, 9.0]),
            slice_to_all_ms: Some([2.0, 6.0, 700.0]),
            ..Default::default()
        };
        let with = |w| Run {
            watch_cost: Some(w),
            ..Run::default()
        };
        let report = Report::new(
            "informers",
            0.25,
            vec![
                ("direct".into(), with(cost("kube-apiserver", 98 << 10))),
                ("bulwark".into(), with(cost("Bulwark", 8 << 10))),
            ],
        );
        let section = watch_cost(&report).unwrap();
        let charts: Vec<&Chart> = section
            .items
            .iter()
            .filter_map(|i| match i {
                Item::Chart(c) => Some(c),
                Item::Table(_) => None,
            })
            .collect();
        assert_eq!(charts.len(), 2);
        assert!(charts[0].svg.contains("direct (kube-apiserver)"));
        assert!(charts[0].svg.contains("bulwark (Bulwark)"));
        assert!(charts[1].svg.contains("to all max"));
        // A run without the figures draws nothing.
        let bare = Report::new("list-storm", 1.0, vec![("direct".into(), run(0, 0))]);
        assert!(watch_cost(&bare).unwrap().items.is_empty());
    }
}

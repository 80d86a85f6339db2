//! The HTML report in a real browser: a recorded result and a synthetic one with a
//! timeline are drawn, opened in headless Chromium (Debian's `chromium`), and the screenshot
//! must show the charts — not a blank or one-colour page.
//!
//! Without Chromium the tests that open it report themselves skipped (`SKIPPED` in the
//! test output), or fail under `BULWARK_REQUIRE_TOOLS=1`, which CI sets.

use std::path::{Path, PathBuf};
use std::process::Command;

use bulwark_loadtest::report::{self, Apiserver, Class, Report, Run, Timeline, charts};
use bulwark_testkit::tools;

/// The browser, or `None` where it is missing (the test reported skipped).
fn chromium() -> Option<PathBuf> {
    tools::on_path("chromium-browser")
        .or_else(|| tools::find("chromium", "apt-get install chromium"))
}

/// A run whose apiservers spike into their limit and are OOM-killed (or not, through
/// Bulwark), with 429s by class over time.
fn synthetic(ooms: u64, name: &str) -> (String, Run) {
    let ticks = 30;
    let seconds: Vec<f64> = (1..=ticks).map(f64::from).collect();
    let limit = 900u64 << 20;
    let memory = |phase: u32| -> Vec<u64> {
        (0..ticks)
            .map(|t| {
                let wave = ((t + phase) % 10) as u64 * (60 << 20);
                if ooms > 0 {
                    (300 << 20) + wave
                } else {
                    (250 << 20) + wave / 3
                }
            })
            .collect()
    };
    let mut run = Run {
        apiserver: Apiserver {
            heap_limit_bytes: limit,
            peak_heap_bytes: limit,
            ooms,
            replica_requests: vec![4_000, 5_200, 4_700],
            ..Apiserver::default()
        },
        ..Run::default()
    };
    for (class, p50) in [("storm", 40.0), ("innocent", 3.0), ("heartbeat", 1.5)] {
        run.classes.insert(
            class.into(),
            Class {
                requests: 1_000,
                ok: 900,
                rejected: if ooms > 0 { 0 } else { 100 },
                p50_ms: p50,
                p99_ms: p50 * 8.0,
                p999_ms: p50 * 20.0,
                ..Class::default()
            },
        );
    }
    let kills = if ooms > 0 {
        vec![vec![9.0, 19.0], vec![29.0], vec![]]
    } else {
        vec![vec![]; 3]
    };
    let storm_429s = (0..ticks)
        .map(|t| if ooms > 0 { 0 } else { u64::from(t % 7) })
        .collect();
    run.timeline = Some(Timeline {
        seconds,
        replica_memory_bytes: vec![memory(0), memory(3), memory(6)],
        oom_kills_at_s: kills,
        rejected: [
            ("storm".to_string(), storm_429s),
            ("innocent".to_string(), vec![0; ticks as usize]),
            ("heartbeat".to_string(), vec![0; ticks as usize]),
        ]
        .into(),
    });
    (name.to_string(), run)
}

/// A recorded result from `results/`.
fn recorded(name: &str) -> Report {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("results")
        .join(name);
    let text = std::fs::read_to_string(&path).unwrap();
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Opens `html` in headless Chromium and returns the screenshot's RGBA pixels.
fn screenshot(browser: &Path, dir: &Path, html: &Path) -> Vec<[u8; 4]> {
    let png = dir.join("shot.png");
    let out = Command::new(browser)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
        ])
        .arg(format!("--screenshot={}", png.display()))
        .arg("--window-size=1200,2000")
        .arg(format!("file://{}", html.display()))
        .output()
        .expect("running chromium");
    assert!(
        out.status.success(),
        "chromium: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let decoder = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(&png).unwrap()));
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buf).unwrap();
    assert_eq!((info.width, info.height), (1200, 2000));
    let channels = info.color_type.samples();
    buf[..info.buffer_size()]
        .chunks(channels)
        .map(|p| match channels {
            4 => [p[0], p[1], p[2], p[3]],
            3 => [p[0], p[1], p[2], 255],
            _ => [p[0], p[0], p[0], 255],
        })
        .collect()
}

/// Checks the page's HTML holds its charts and the screenshot shows them.
fn check(report: &Report, charts_expected: usize) {
    check_html(
        &charts::html(report).unwrap(),
        &charts::verdict(report),
        charts_expected,
    );
}

/// [`check`] of a page already drawn, with its verdict.
fn check_html(html: &str, verdict: &str, charts_expected: usize) {
    let dir = tempfile::tempdir().unwrap();
    assert!(
        html.contains(&bulwark_loadtest::report::html::escape(verdict)),
        "the verdict is at the top"
    );
    assert_eq!(
        html.matches("<svg").count(),
        charts_expected,
        "one <svg> per chart"
    );
    for element in ["<rect", "<polyline", "<text"] {
        assert!(html.contains(element), "the charts draw {element}");
    }
    let path = dir.path().join("report.html");
    std::fs::write(&path, html).unwrap();
    let Some(browser) = chromium() else { return };
    let pixels = screenshot(&browser, dir.path(), &path);
    let white = pixels
        .iter()
        .filter(|p| p[0] > 245 && p[1] > 245 && p[2] > 245)
        .count();
    let drawn = pixels.len() - white;
    // Red and blue bars and lines: the runs' colours, not just black text.
    let coloured = pixels
        .iter()
        .filter(|p| (i16::from(p[0]) - i16::from(p[2])).abs() > 80)
        .count();
    let share = |n: usize| n as f64 / pixels.len() as f64;
    eprintln!(
        "screenshot: {:.1}% not white, {:.1}% coloured",
        100.0 * share(drawn),
        100.0 * share(coloured)
    );
    assert!(
        share(drawn) > 0.05,
        "the page is almost blank: {:.3}",
        share(drawn)
    );
    assert!(
        share(coloured) > 0.01,
        "the charts' colours are missing: {:.4}",
        share(coloured)
    );
    let first = pixels[0];
    assert!(pixels.iter().any(|p| *p != first), "one colour only");
}

#[test]
fn a_report_with_a_timeline_renders_its_charts_in_chromium() {
    let report = Report::new(
        "list-storm",
        1.0,
        vec![synthetic(3, "direct"), synthetic(0, "bulwark")],
    );
    assert!(
        charts::verdict(&report).starts_with("Bulwark kept every apiserver up: OOM kills direct 3")
    );
    // memory ×2, requests, latency ×3 classes, 429s over time ×2
    check(&report, 8);
}

#[test]
fn a_recorded_result_renders_its_charts_in_chromium() {
    let report = recorded("list-storm-controlplane-950Mi.json");
    assert_eq!(
        report.runs[0].0, "direct",
        "runs keep the order they ran in"
    );
    // peak memory, latency ×3 classes, 429 totals
    check(&report, 5);
}

#[test]
fn a_recorded_watch_cost_renders_beside_the_apiservers_in_chromium() {
    let report = recorded("informers-controlplane-1000-nodes.json");
    let html = charts::html(&report).unwrap();
    for title in [
        "Memory per idle connection and per watch",
        "Update to its watchers (ms)",
        "direct (kube-apiserver)",
        "bulwark (Bulwark)",
    ] {
        assert!(html.contains(title), "{title}");
    }
    // memory over time ×2 runs, latency ×3 classes, the watch cost ×2, 429s over time ×2
    // runs
    check_html(&html, &charts::verdict(&report), 9);
}

#[test]
fn every_recorded_result_reads_back_and_draws() {
    // Through the one pipeline every scenario's result takes: read back as the scenario
    // that wrote it, drawn, written, cut into charts.
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("results");
    let out = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "json") {
            let name = path.file_name().unwrap().to_str().unwrap();
            let outcome = bulwark_loadtest::scenario::recorded(&path).unwrap();
            assert!(!outcome.verdict().is_empty(), "{name}");
            assert!(!outcome.figures().unwrap().is_empty(), "{name}");
            let html = out.path().join(name).with_extension("html");
            report::outcome::write(outcome.as_ref(), None, &html).unwrap();
            assert!(std::fs::metadata(&html).unwrap().len() > 1000, "{name}");
            let charts = report::outcome::write_charts(outcome.as_ref(), out.path()).unwrap();
            assert!(!charts.is_empty(), "{name} draws no chart");
        }
    }
}

#[test]
fn the_recorded_cluster_run_renders_its_charts_in_chromium() {
    use bulwark_loadtest::scenario::cluster;
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("results/cluster-1000.json");
    let text = std::fs::read_to_string(&path).unwrap();
    let report: cluster::ClusterReport = serde_json::from_str(&text).unwrap();
    let bulwark = report
        .runs
        .iter()
        .find(|r| r.front == "bulwark")
        .expect("a run through Bulwark");
    assert_eq!(
        bulwark.not_ready_max, 0,
        "no node went NotReady through Bulwark"
    );
    let page = cluster::page(&report).unwrap();
    // Per front door: apiserver memory, Leases and NotReady, LISTs and watches, 429s (and
    // requests per replica where sampled); the Jobs once; latency once per client class
    // the run timed (Lease renewals always; agents, kube-proxies and the storm when run).
    let classes = 1 + [
        report.runs.iter().any(|r| r.agents.is_some()),
        report.runs.iter().any(|r| r.kube_proxies.is_some()),
        report.runs.iter().any(|r| r.storm.is_some()),
    ]
    .into_iter()
    .filter(|timed| *timed)
    .count();
    assert_eq!(classes, 4, "the recorded run times every client class");
    let per_replica = report
        .runs
        .iter()
        .filter(|r| r.samples.iter().any(|s| !s.requests_per_s.is_empty()))
        .count();
    check_html(
        &bulwark_loadtest::report::html::render(&page),
        &cluster::verdict(&report),
        1 + classes + 4 * report.runs.len() + per_replica,
    );
}

//! Each thread's own share of the counters every request writes: `bulwark_requests_total`,
//! `bulwark_request_duration_seconds` and `bulwark_rule_requests_total`.
//!
//! Counted through the shared families, every request took each family's label lock and
//! its series' reference count and wrote its atomics, cache lines that every worker thread
//! writes in turn. Here a thread counts into its own shard (prometheus's local counters and
//! histograms behind a lock no other thread takes, but a scrape), and a scrape adds every
//! shard into the shared families before it reads them ([`Flushing`]), so a scrape sees
//! every request counted before it began.

use std::cell::RefCell;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use foldhash::HashMap;
use http::StatusCode;
use prometheus::core::{Collector, Desc};
use prometheus::local::{LocalHistogram, LocalIntCounter};
use prometheus::proto::MetricFamily;
use prometheus::{HistogramVec, IntCounterVec};

use super::{ServedBy, code_label};

/// The families shards count into, and every shard made for them.
pub(super) struct Shards {
    requests: IntCounterVec,
    durations: HistogramVec,
    rules: IntCounterVec,
    all: Mutex<Vec<Arc<Mutex<Shard>>>>,
}

/// A thread's shard and the families it counts for.
type Mine = (Weak<Shards>, Arc<Mutex<Shard>>);

/// A resource's requests by verb, code and who served them.
type ByAnswer = HashMap<(&'static str, u16, ServedBy), LocalIntCounter>;

thread_local! {
    /// This thread's shard of each live `Metrics` (one, outside tests).
    static MINE: RefCell<Vec<Mine>> = const { RefCell::new(Vec::new()) };
}

/// One thread's counts since the last scrape, by label values; bounded as the families'
/// series are (closed sets of verbs, resources, codes; the rules' and levels' names).
#[derive(Default)]
struct Shard {
    /// By resource, then verb, code and who served it.
    requests: HashMap<Box<str>, ByAnswer>,
    durations: HashMap<(&'static str, ServedBy), LocalHistogram>,
    /// By rule, then level.
    rules: HashMap<Box<str>, HashMap<Box<str>, LocalIntCounter>>,
}

impl Shard {
    fn flush(&self) {
        self.requests
            .values()
            .flat_map(HashMap::values)
            .for_each(LocalIntCounter::flush);
        self.durations.values().for_each(LocalHistogram::flush);
        self.rules
            .values()
            .flat_map(HashMap::values)
            .for_each(LocalIntCounter::flush);
    }
}

impl Shards {
    pub(super) fn new(
        requests: IntCounterVec,
        durations: HistogramVec,
        rules: IntCounterVec,
    ) -> Shards {
        Shards {
            requests,
            durations,
            rules,
            all: Mutex::default(),
        }
    }

    /// Registers the families so that a scrape flushes the shards first.
    pub(super) fn register(self: &Arc<Self>, r: &super::families::Register<'_>) {
        r.flushing(&self.requests, self);
        r.flushing(&self.durations, self);
        r.flushing(&self.rules, self);
    }

    /// Adds every thread's counts into the families.
    pub(super) fn flush(&self) {
        let all = self.all.lock().unwrap_or_else(|e| e.into_inner());
        for shard in all.iter() {
            shard.lock().unwrap_or_else(|e| e.into_inner()).flush();
        }
    }

    /// Runs `f` on this thread's shard, made (and listed for scrapes) on first use.
    fn with_mine<R>(self: &Arc<Self>, f: impl FnOnce(&mut Shard, &Shards) -> R) -> R {
        let shard = MINE.with(|mine| {
            let mut mine = mine.borrow_mut();
            // By address, which no other `Shards` can take while a `Weak` to this one
            // keeps its allocation; no reference count is touched.
            if let Some((_, shard)) = mine
                .iter()
                .find(|(of, _)| std::ptr::eq(of.as_ptr(), Arc::as_ptr(self)))
            {
                return shard.clone();
            }
            // A `Metrics` dropped (in tests) leaves its shards behind: let them go.
            mine.retain(|(of, _)| of.strong_count() > 0);
            let shard = Arc::new(Mutex::new(Shard::default()));
            self.all
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(shard.clone());
            mine.push((Arc::downgrade(self), shard.clone()));
            shard
        });
        let mut shard = shard.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut shard, self)
    }

    /// One answered request: `bulwark_requests_total` and its duration.
    pub(super) fn request(
        self: &Arc<Self>,
        (verb, resource): (&'static str, &str),
        status: StatusCode,
        served_by: ServedBy,
        took: Duration,
    ) {
        self.with_mine(|shard, families| {
            let by_resource = match shard.requests.get_mut(resource) {
                Some(by) => by,
                None => shard.requests.entry(resource.into()).or_default(),
            };
            by_resource
                .entry((verb, status.as_u16(), served_by))
                .or_insert_with(|| {
                    families
                        .requests
                        .with_label_values(&[
                            verb,
                            resource,
                            code_label(&status),
                            served_by.as_str(),
                        ])
                        .local()
                })
                .inc();
            shard
                .durations
                .entry((verb, served_by))
                .or_insert_with(|| {
                    families
                        .durations
                        .with_label_values(&[verb, served_by.as_str()])
                        .local()
                })
                .observe(took.as_secs_f64());
        });
    }

    /// One request matched by `rule` at `level`: `bulwark_rule_requests_total`.
    pub(super) fn rule(self: &Arc<Self>, rule: &str, level: &str) {
        self.with_mine(|shard, families| {
            let by_rule = match shard.rules.get_mut(rule) {
                Some(by) => by,
                None => shard.rules.entry(rule.into()).or_default(),
            };
            match by_rule.get(level) {
                Some(counter) => counter.inc(),
                None => {
                    let counter = families.rules.with_label_values(&[rule, level]).local();
                    counter.inc();
                    by_rule.insert(level.into(), counter);
                }
            }
        });
    }
}

/// A family registered so that a scrape first adds every thread's shard into it.
#[derive(Clone)]
pub(super) struct Flushing<C> {
    pub(super) inner: C,
    pub(super) shards: Arc<Shards>,
}

impl<C: Collector> Collector for Flushing<C> {
    fn desc(&self) -> Vec<&Desc> {
        self.inner.desc()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        self.shards.flush();
        self.inner.collect()
    }
}

#[cfg(test)]
mod tests {
    use super::super::Metrics;
    use super::*;

    fn sample(text: &str, series: &str) -> Option<f64> {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
    }

    /// Counts from several threads, each into its own shard, all show in the next scrape,
    /// and again (not twice) in the one after.
    #[test]
    fn every_threads_counts_show_in_the_next_scrape_once() {
        let metrics = Metrics::new();
        let secrets: Arc<str> = Arc::from("secrets");
        std::thread::scope(|s| {
            for _ in 0..4 {
                let (metrics, secrets) = (&metrics, &secrets);
                s.spawn(move || {
                    for _ in 0..250 {
                        metrics.count_request(
                            ("list", secrets),
                            StatusCode::OK,
                            ServedBy::Cache,
                            Duration::from_millis(2),
                        );
                        metrics.count_rule("nodes", "workload-low");
                    }
                });
            }
        });
        metrics.count_request(
            ("get", &secrets),
            StatusCode::TOO_MANY_REQUESTS,
            ServedBy::Bulwark,
            Duration::ZERO,
        );
        for _ in 0..2 {
            let text = metrics.render();
            let requests = r#"bulwark_requests_total{code="200",resource="secrets",served_by="cache",verb="list"}"#;
            assert_eq!(sample(&text, requests), Some(1000.0), "{text}");
            let refused = r#"bulwark_requests_total{code="429",resource="secrets",served_by="bulwark",verb="get"}"#;
            assert_eq!(sample(&text, refused), Some(1.0));
            let took = r#"bulwark_request_duration_seconds_count{served_by="cache",verb="list"}"#;
            assert_eq!(sample(&text, took), Some(1000.0));
            let rule = r#"bulwark_rule_requests_total{level="workload-low",rule="nodes"}"#;
            assert_eq!(sample(&text, rule), Some(1000.0));
        }
    }

    /// A thread's shard belongs to one `Metrics`: another's counts stay out of it.
    #[test]
    fn two_metrics_on_one_thread_count_apart() {
        let (a, b) = (Metrics::new(), Metrics::new());
        a.count_rule("r", "l");
        a.count_rule("r", "l");
        b.count_rule("r", "l");
        let series = r#"bulwark_rule_requests_total{level="l",rule="r"}"#;
        assert_eq!(sample(&a.render(), series), Some(2.0));
        assert_eq!(sample(&b.render(), series), Some(1.0));
        drop(a);
        b.count_rule("r", "l");
        assert_eq!(sample(&b.render(), series), Some(2.0));
    }
}

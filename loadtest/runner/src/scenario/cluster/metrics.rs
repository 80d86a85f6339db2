//! What the apiservers and the Bulwarks count, read during a run: LISTs, watches and watch
//! events at the apiservers, and refusals by who refused whom.

use std::collections::BTreeMap;

use super::{BulwarkGauges, Sample};
use crate::controlplane::ControlPlane;
use crate::proxy_process::admin_text;

/// The samples of counter `metric` in a Prometheus text exposition, summed by the values
/// of `labels` (joined by a space; a missing label is empty).
/// The sum of every series of `metric` (labelled or not).
pub fn gauge(text: &str, metric: &str) -> f64 {
    text.lines()
        .filter_map(|line| {
            let rest = line.strip_prefix(metric)?;
            if !(rest.starts_with(' ') || rest.starts_with('{')) {
                return None;
            }
            rest.rsplit_once(' ')?.1.parse::<f64>().ok()
        })
        .sum()
}

pub fn counters(text: &str, metric: &str, labels: &[&str]) -> BTreeMap<String, f64> {
    let mut sums = BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(metric) else {
            continue;
        };
        let Some(rest) = rest.strip_prefix('{') else {
            continue;
        };
        let Some((series, value)) = rest.rsplit_once(' ') else {
            continue;
        };
        let Ok(value) = value.parse::<f64>() else {
            continue;
        };
        let key: Vec<&str> = labels
            .iter()
            .map(|label| {
                series
                    .split(&format!("{label}=\"")[..])
                    .nth(1)
                    .and_then(|v| v.split('"').next())
                    .unwrap_or("")
            })
            .collect();
        *sums.entry(key.join(" ")).or_insert(0.0) += value;
    }
    sums
}

/// Counters read again and again from several processes, turned into increases: a
/// process that restarted (its counter went down) counts from zero.
#[derive(Debug, Default)]
pub struct Rates {
    last: BTreeMap<(String, String), f64>,
    at: f64,
}

impl Rates {
    /// The increase of each of `source`'s counters since it was last read.
    pub fn step(&mut self, source: &str, now: BTreeMap<String, f64>) -> BTreeMap<String, f64> {
        now.into_iter()
            .map(|(key, value)| {
                let last = self
                    .last
                    .insert((source.to_owned(), key.clone()), value)
                    .unwrap_or(value);
                let increase = if value >= last { value - last } else { value };
                (key, increase)
            })
            .collect()
    }
}

/// Reads the apiservers' and the Bulwarks' metrics: LISTs and WATCHes per second and
/// refusals per second since the last scrape (`t` seconds since the burst).
pub(super) async fn scrape(cp: &ControlPlane, rates: &mut Rates, t: f64) -> Sample {
    let dt = (t - rates.at).max(1e-3);
    rates.at = t;
    let mut sample = Sample::default();
    let add = |map: &mut BTreeMap<String, f64>, key: String, n: f64| {
        *map.entry(key).or_insert(0.0) += n / dt;
    };
    for (i, text) in cp.replica_metrics().await.into_iter().enumerate() {
        let Some(text) = text else { continue };
        let source = format!("apiserver-{i}");
        let verbs = rates.step(
            &source,
            counters(&text, "apiserver_request_total", &["verb"]),
        );
        sample.lists_per_s += verbs.get("LIST").copied().unwrap_or(0.0) / dt;
        if sample.requests_per_s.len() <= i {
            sample.requests_per_s.resize(i + 1, 0.0);
        }
        sample.requests_per_s[i] = verbs.values().sum::<f64>() / dt;
        let events = rates.step(
            &format!("{source} events"),
            counters(&text, "apiserver_watch_events_total", &[]),
        );
        sample.watch_events_per_s += events.values().sum::<f64>() / dt;
        sample.open_watches += counters(&text, "apiserver_longrunning_requests", &["verb"])
            .get("WATCH")
            .copied()
            .unwrap_or(0.0);
        let rejected = rates.step(
            &format!("{source} APF"),
            counters(
                &text,
                "apiserver_flowcontrol_rejected_requests_total",
                &["flow_schema"],
            ),
        );
        for (schema, n) in rejected {
            add(&mut sample.refused_per_s, format!("APF {schema}"), n);
        }
    }
    for (i, addr) in cp.bulwark_admin_addrs().into_iter().enumerate() {
        let Ok(text) = admin_text(addr, "/metrics").await else {
            continue;
        };
        let held = sample.bulwark.get_or_insert_with(BulwarkGauges::default);
        held.connections += gauge(&text, "bulwark_connections_open");
        held.watchers += gauge(&text, "bulwark_cache_watchers");
        held.upstream_watches += gauge(&text, "bulwark_upstream_watches");
        held.cached_bytes += gauge(&text, "bulwark_cache_bytes");
        held.cached_objects += gauge(&text, "bulwark_cache_objects");
        held.resident_bytes += gauge(&text, "process_resident_memory_bytes");
        let rejected = rates.step(
            &format!("bulwark-{i}"),
            counters(
                &text,
                "bulwark_rejected_requests_total",
                &["rule", "reason"],
            ),
        );
        for (rule, n) in rejected {
            add(&mut sample.refused_per_s, format!("rule {rule}"), n);
        }
    }
    sample
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_sum_a_metrics_series_by_its_labels() {
        let text = "# TYPE apiserver_request_total counter\n\
apiserver_request_total{code=\"200\",resource=\"secrets\",verb=\"LIST\"} 4\n\
apiserver_request_total{code=\"429\",resource=\"pods\",verb=\"LIST\"} 1\n\
apiserver_request_total{code=\"200\",resource=\"pods\",verb=\"WATCH\"} 2\n\
apiserver_request_total_other{verb=\"LIST\"} 100\n\
bulwark_rejected_requests_total{level=\"x\",reason=\"queue_full\",rule=\"storm\"} 3\n";
        let verbs = counters(text, "apiserver_request_total", &["verb"]);
        assert_eq!(verbs.get("LIST"), Some(&5.0));
        assert_eq!(verbs.get("WATCH"), Some(&2.0));
        assert_eq!(verbs.len(), 2);
        let refused = counters(text, "bulwark_rejected_requests_total", &["rule", "reason"]);
        assert_eq!(refused.get("storm queue_full"), Some(&3.0));
    }

    #[test]
    fn rates_count_a_restarted_process_from_zero() {
        let mut rates = Rates::default();
        let at = |n: f64| BTreeMap::from([("LIST".to_string(), n)]);
        assert_eq!(
            rates.step("a", at(10.0))["LIST"],
            0.0,
            "the first read is the base"
        );
        assert_eq!(rates.step("a", at(15.0))["LIST"], 5.0);
        assert_eq!(
            rates.step("b", at(7.0))["LIST"],
            0.0,
            "each process its own"
        );
        assert_eq!(
            rates.step("a", at(3.0))["LIST"],
            3.0,
            "restarted: from zero"
        );
    }
}

//! Metrics about the Bulwark process itself: what build runs, the operating system's view of
//! its memory, CPU and files, and the memory limit of its container, so that an alert can
//! compare the two before the kernel's OOM killer does.

use std::path::{Path, PathBuf};

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{Gauge, IntGaugeVec, Opts, Registry};

/// The git revision Bulwark was built from, when the build set `BULWARK_REVISION` (no build
/// script: a build from a tarball without git must work).
const REVISION: Option<&str> = option_env!("BULWARK_REVISION");

/// A cgroup v1 limit at or above this is the kernel's "no limit" (`PAGE_COUNTER_MAX` pages).
const V1_UNLIMITED: u64 = 1 << 62;

/// Registers `bulwark_build_info`, the `process_*` metrics (Linux) and
/// `bulwark_memory_limit_bytes` in `registry`.
pub(super) fn register(registry: &Registry) {
    let build_info = IntGaugeVec::new(
        Opts::new(
            "bulwark_build_info",
            "Always 1; its labels say which build of Bulwark runs (revision empty when the build did not set BULWARK_REVISION).",
        ),
        &["version", "revision"],
    )
    .expect("valid metric definition");
    build_info
        .with_label_values(&[env!("CARGO_PKG_VERSION"), REVISION.unwrap_or("")])
        .set(1);
    registry
        .register(Box::new(build_info))
        .expect("metric registered once");
    #[cfg(target_os = "linux")]
    registry
        .register(Box::new(
            prometheus::process_collector::ProcessCollector::for_self(),
        ))
        .expect("metric registered once");
    registry
        .register(Box::new(MemoryLimit::new(PathBuf::from("/"))))
        .expect("metric registered once");
}

/// `bulwark_memory_limit_bytes`: the memory limit of the process's cgroup, read at every
/// scrape (a limit can be resized in place), and absent while there is none.
pub(super) struct MemoryLimit {
    /// The file-system root `/proc` and `/sys/fs/cgroup` are read under (a test's folder).
    root: PathBuf,
    gauge: Gauge,
}

impl MemoryLimit {
    pub(super) fn new(root: PathBuf) -> Self {
        let gauge = Gauge::new(
            "bulwark_memory_limit_bytes",
            "The memory limit of Bulwark's cgroup (v2 memory.max, v1 memory.limit_in_bytes); absent when unlimited.",
        )
        .expect("valid metric definition");
        Self { root, gauge }
    }
}

impl Collector for MemoryLimit {
    fn desc(&self) -> Vec<&Desc> {
        self.gauge.desc()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        match memory_limit(&self.root) {
            Some(bytes) => {
                self.gauge.set(bytes as f64);
                self.gauge.collect()
            }
            None => Vec::new(),
        }
    }
}

/// The memory limit of this process's cgroup under `root`, `None` when unlimited or unknown.
/// cgroup v2: the smallest `memory.max` of the process's cgroup and its ancestors (a pod's
/// limit may sit one level up). cgroup v1: the memory controller's `memory.limit_in_bytes`.
/// Inside a container the cgroup path in `/proc/self/cgroup` may not exist under the
/// container's view of `/sys/fs/cgroup`, whose root is then the container's own cgroup.
pub(super) fn memory_limit(root: &Path) -> Option<u64> {
    let cgroups = std::fs::read_to_string(root.join("proc/self/cgroup")).ok()?;
    let mount = root.join("sys/fs/cgroup");
    for line in cgroups.lines() {
        let mut fields = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) =
            (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        let relative = path.trim_start_matches('/');
        if id == "0" && controllers.is_empty() {
            // v2: the unified hierarchy.
            let own = mount.join(relative);
            let start = if own.is_dir() { own } else { mount.clone() };
            return start
                .ancestors()
                .take_while(|dir| dir.starts_with(&mount))
                .filter_map(|dir| read_limit(&dir.join("memory.max")))
                .min();
        }
        if controllers.split(',').any(|c| c == "memory") {
            let base = mount.join("memory");
            let own = base.join(relative).join("memory.limit_in_bytes");
            let file = if own.is_file() {
                own
            } else {
                base.join("memory.limit_in_bytes")
            };
            return read_limit(&file).filter(|&bytes| bytes < V1_UNLIMITED);
        }
    }
    None
}

/// A limit file's number; `max` (v2's "no limit") and unreadable files are `None`.
fn read_limit(file: &Path) -> Option<u64> {
    std::fs::read_to_string(file).ok()?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(root: &Path, path: &str, body: &str) {
        let file = root.join(path);
        std::fs::create_dir_all(file.parent().unwrap()).unwrap();
        std::fs::write(file, body).unwrap();
    }

    fn families(collector: &dyn Collector) -> Vec<(String, f64)> {
        collector
            .collect()
            .iter()
            .flat_map(|f| {
                f.get_metric()
                    .iter()
                    .map(|m| (f.name().to_string(), m.get_gauge().get_value()))
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    #[test]
    fn cgroup_v2_limit_is_the_smallest_of_the_cgroup_and_its_ancestors() {
        let root = tempfile::tempdir().unwrap();
        let root = root.path();
        write(root, "proc/self/cgroup", "0::/kubepods/pod1/ctr\n");
        write(root, "sys/fs/cgroup/kubepods/memory.max", "max\n");
        write(
            root,
            "sys/fs/cgroup/kubepods/pod1/memory.max",
            "536870912\n",
        );
        write(root, "sys/fs/cgroup/kubepods/pod1/ctr/memory.max", "max\n");
        assert_eq!(memory_limit(root), Some(512 << 20));
        let collector = MemoryLimit::new(root.to_owned());
        assert_eq!(
            families(&collector),
            vec![("bulwark_memory_limit_bytes".to_string(), 536870912.0)]
        );

        // Resized in place: the next scrape says so. Unlimited: the metric is absent.
        write(
            root,
            "sys/fs/cgroup/kubepods/pod1/memory.max",
            "1073741824\n",
        );
        assert_eq!(families(&collector)[0].1, 1073741824.0);
        write(root, "sys/fs/cgroup/kubepods/pod1/memory.max", "max\n");
        assert_eq!(memory_limit(root), None);
        assert!(families(&collector).is_empty());
    }

    #[test]
    fn cgroup_v2_inside_a_container_reads_the_mount_root() {
        let root = tempfile::tempdir().unwrap();
        let root = root.path();
        // The host's path, which the container's cgroup namespace does not show.
        write(root, "proc/self/cgroup", "0::/kubepods/pod1/ctr\n");
        write(root, "sys/fs/cgroup/memory.max", "268435456\n");
        assert_eq!(memory_limit(root), Some(256 << 20));
    }

    #[test]
    fn cgroup_v1_limit_and_its_unlimited_value() {
        let root = tempfile::tempdir().unwrap();
        let root = root.path();
        write(
            root,
            "proc/self/cgroup",
            "12:cpu,cpuacct:/kubepods/pod1/ctr\n4:memory:/kubepods/pod1/ctr\n",
        );
        write(
            root,
            "sys/fs/cgroup/memory/kubepods/pod1/ctr/memory.limit_in_bytes",
            "104857600\n",
        );
        assert_eq!(memory_limit(root), Some(100 << 20));
        write(
            root,
            "sys/fs/cgroup/memory/kubepods/pod1/ctr/memory.limit_in_bytes",
            "9223372036854771712\n",
        );
        assert_eq!(memory_limit(root), None);
    }

    #[test]
    fn no_cgroup_file_means_no_limit() {
        let root = tempfile::tempdir().unwrap();
        assert_eq!(memory_limit(root.path()), None);
    }

    #[test]
    fn build_info_and_process_metrics_are_registered() {
        let registry = Registry::new();
        register(&registry);
        let names: Vec<String> = registry
            .gather()
            .iter()
            .map(|f| f.name().to_string())
            .collect();
        assert!(
            names.contains(&"bulwark_build_info".to_string()),
            "{names:?}"
        );
        #[cfg(target_os = "linux")]
        for name in [
            "process_resident_memory_bytes",
            "process_cpu_seconds_total",
            "process_open_fds",
            "process_max_fds",
            "process_start_time_seconds",
        ] {
            assert!(names.contains(&name.to_string()), "{name} in {names:?}");
        }
        let info = registry
            .gather()
            .into_iter()
            .find(|f| f.name() == "bulwark_build_info")
            .unwrap();
        let metric = &info.get_metric()[0];
        assert_eq!(metric.get_gauge().get_value(), 1.0);
        let version = metric
            .get_label()
            .iter()
            .find(|l| l.name() == "version")
            .unwrap();
        assert_eq!(version.value(), env!("CARGO_PKG_VERSION"));
    }
}

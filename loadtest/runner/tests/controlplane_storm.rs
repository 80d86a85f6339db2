//! `list-storm --controlplane` at a small size on the real control plane (etcd and a
//! kube-apiserver in a memory cgroup), direct and through Bulwark: each run records each
//! replica's memory over time from its cgroup, as the report charts it, not only its peak.
//! Without the binaries the control plane builds them (`loadtest/controlplane/build.sh`,
//! Go 1.26) or fails: this test never skips.

use std::path::PathBuf;
use std::time::Duration;

use bulwark_loadtest::scenario::Options;
use bulwark_loadtest::scenario::on_controlplane::{ControlPlaneOptions, list_storm};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_list_storm_on_the_real_control_plane_records_memory_over_time_per_replica() {
    let opts = Options {
        duration: Some(Duration::from_secs(4)),
        scale: 0.01,
        only: None,
        protobuf: false,
        secrets_per_node: 2,
        kube_proxy_apart: false,
        join_window: None,
        slice_churn: 20,
        endpointslices: None,
    };
    let cp = ControlPlaneOptions {
        replicas: 1,
        memory_limit: 900 << 20,
        bulwark_exe: Some(PathBuf::from(env!("CARGO_BIN_EXE_bulwark-loadtest"))),
    };
    let report = list_storm(&opts, &cp).await.unwrap();
    let names: Vec<&str> = report.runs.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["direct", "bulwark"]);
    for (name, run) in &report.runs {
        let timeline = run.timeline.as_ref().expect("a timeline");
        assert!(timeline.seconds.len() >= 3, "{name}: {timeline:?}");
        assert_eq!(timeline.replica_memory_bytes.len(), 1, "{name}");
        let memory = &timeline.replica_memory_bytes[0];
        assert_eq!(memory.len(), timeline.seconds.len(), "{name}");
        // A kube-apiserver holds well over 50 MiB at every tick, and never more than its
        // cgroup's limit.
        assert!(
            memory.iter().all(|b| *b > 50 << 20 && *b <= 900 << 20),
            "{name}: {memory:?}"
        );
        assert!(
            timeline.rejected.contains_key("storm"),
            "{name}: {timeline:?}"
        );
    }
    let page = bulwark_loadtest::report::charts::page(&report).unwrap();
    let html = bulwark_loadtest::report::html::render(&page);
    assert!(html.contains("<svg"), "the report draws its charts");
}

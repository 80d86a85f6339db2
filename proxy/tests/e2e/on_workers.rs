//! The fairness and cache tests again, unchanged, with Bulwark's client connections served
//! by two worker threads (`listen.workers: 2`): flows, queues, seats, byte budgets and the
//! cache are shared between the workers' request paths, and must hold as they do when one
//! runtime serves every connection.

// The same files as the crate's `cache` and `fairness`, on purpose: each test runs twice.
#[allow(clippy::duplicate_mod)]
#[path = "cache.rs"]
mod cache;
#[allow(clippy::duplicate_mod)]
#[path = "fairness.rs"]
mod fairness;

fn setup() -> bulwark_testkit::Setup {
    bulwark_testkit::Setup {
        workers: 2,
        ..bulwark_testkit::Setup::default()
    }
}

/// Each worker opens its own connection to a replica, on its own thread, and
/// `/debug/upstream` counts them all: two clients on two workers make two connections where
/// one runtime makes one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_worker_has_its_own_upstream_connections_and_the_snapshot_counts_them_all() {
    use bulwark_testkit::{Cluster, Setup};

    let connections = |cluster: &Cluster| -> usize {
        let views = cluster.bulwark.admin.upstream.snapshot();
        views.iter().map(|replica| replica.connections).sum()
    };
    let mut opened = Vec::new();
    for workers in [0, 2] {
        let cluster = Cluster::start(Setup {
            replicas: 1,
            workers,
            ..Setup::default()
        })
        .await
        .ready()
        .await;
        // The first probe's own connection, made on the main runtime, is not the clients'.
        tokio::time::timeout(std::time::Duration::from_secs(10), async {
            while connections(&cluster) == 0 {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
        })
        .await
        .expect("the replica is probed");
        let before = connections(&cluster);
        let mut clients = Vec::new();
        for _ in 0..2 {
            let mut client = cluster.client("alice", &[]).await;
            let answer = client.get("/api/v1/namespaces/default/configmaps").await;
            assert_eq!(answer.status, 200, "{}", answer.text());
            clients.push(client);
        }
        opened.push(connections(&cluster) - before);
    }
    assert_eq!(
        opened,
        [1, 2],
        "new connections to the replica for two clients: on one runtime, on two workers"
    );
}

/// A start that fails after the workers' runtimes are made (here: the address is taken)
/// is the error it is, as without workers, not a panic of a runtime dropped in a task.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_that_fails_after_the_workers_are_made_says_why() {
    use bulwark::serve::{Running, StartError};
    use bulwark_testkit::{Cluster, Setup};

    let cluster = Cluster::start(Setup {
        replicas: 1,
        ..Setup::default()
    })
    .await;
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("a port");
    let address = taken.local_addr().expect("its address").to_string();
    let config = cluster
        .config
        .clone()
        .set("listen.workers", "2")
        .set("listen.address", &address);
    let failed = Running::start(config.config()).await.err();
    assert!(
        matches!(failed, Some(StartError::Listen(_))),
        "{:?}",
        failed.map(|e| e.to_string())
    );
}

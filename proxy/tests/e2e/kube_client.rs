//! The `kube` crate, a real client library, through Bulwark.

use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, ListParams, PostParams};
use kube::runtime::watcher;

use bulwark_testkit::{Cluster, Setup};

fn secret(name: &str) -> Secret {
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": name, "labels": {"app": "e2e"}},
        "stringData": {"k": "v"},
    }))
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kube_client_lists_paginates_creates_and_watches_through_bulwark() {
    let cluster = Cluster::start(Setup {
        seed: vec!["secrets=25x1KiB@team"],
        ..Setup::default()
    })
    .await;
    let client = cluster.kube_client("alice", &[]).await;
    let secrets: Api<Secret> = Api::namespaced(client, "team");

    let mut names = Vec::new();
    let mut params = ListParams::default().limit(10);
    loop {
        let page = secrets.list(&params).await.expect("list page");
        names.extend(page.items.iter().filter_map(|s| s.metadata.name.clone()));
        match page.metadata.continue_ {
            Some(token) if !token.is_empty() => params = params.continue_token(&token),
            _ => break,
        }
    }
    assert_eq!(names.len(), 25, "{names:?}");

    let mut events = watcher(
        secrets.clone(),
        watcher::Config::default().labels("app=e2e"),
    )
    .boxed();
    // The first event is the (empty) initial list being done.
    let created = secrets
        .create(&PostParams::default(), &secret("made-through-bulwark"))
        .await
        .expect("create");
    assert_eq!(
        created.metadata.name.as_deref(),
        Some("made-through-bulwark")
    );
    let seen = tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(event) = events.try_next().await.expect("watch event") {
            if let watcher::Event::Apply(s) | watcher::Event::InitApply(s) = event
                && s.metadata.name.as_deref() == Some("made-through-bulwark")
            {
                return true;
            }
        }
        false
    })
    .await
    .expect("the created secret shows up in the watch");
    assert!(seen);
    assert_eq!(cluster.fleet.applied_writes(), 1);
}

//! The fleet as the `kube` crate sees it: paginated LIST, watches with bookmarks, WatchList
//! (streaming lists), 410 handling and a reflector that tracks the store under churn.

use std::time::Duration;

use bulwark_sim::{Fleet, SimConfig};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::api::{Api, ListParams, PostParams, WatchEvent, WatchParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::{WatchStreamExt, reflector, watcher};
use kube::{Client, Config};
use serde_json::json;

async fn client(fleet: &Fleet) -> Client {
    let admin = fleet
        .pki()
        .client_ca
        .client_cert("admin", &["system:masters"]);
    let kc = bulwark_sim::client::kubeconfig(
        fleet.pki(),
        &format!("https://{}", fleet.addrs()[0]),
        &admin,
    );
    let cfg = Config::from_custom_kubeconfig(
        Kubeconfig::from_yaml(&kc).unwrap(),
        &KubeConfigOptions::default(),
    )
    .await
    .unwrap();
    Client::try_from(cfg).unwrap()
}

async fn fleet(seed: &str, ring: usize) -> Fleet {
    Fleet::start(SimConfig {
        seed: vec![seed.parse().unwrap()],
        event_ring: ring,
        bookmark_interval: Duration::from_millis(200),
        ..SimConfig::default()
    })
    .await
    .unwrap()
}

#[tokio::test]
async fn paginated_list_returns_every_object_once() {
    let fleet = fleet("secrets=53x512B", 1000).await;
    let api: Api<Secret> = Api::all(client(&fleet).await);
    let mut names = Vec::new();
    let mut lp = ListParams::default().limit(10);
    let mut pages = 0;
    let page = api.list(&lp).await.unwrap();
    let first_rv = page.metadata.resource_version.clone();
    assert_eq!(page.metadata.remaining_item_count, Some(43));
    let mut page = page;
    loop {
        pages += 1;
        names.extend(page.items.iter().map(|s| s.metadata.name.clone().unwrap()));
        assert_eq!(
            page.metadata.resource_version, first_rv,
            "every page is the same snapshot"
        );
        match page.metadata.continue_.clone() {
            Some(c) if !c.is_empty() => {
                lp = lp.continue_token(&c);
                // Writes between pages do not show up in the snapshot.
                if pages == 1 {
                    fleet
                        .store()
                        .create("secrets", "ns-0", json!({"metadata": {"name": "zz-late"}}))
                        .unwrap();
                }
                page = api.list(&lp).await.unwrap();
            }
            _ => break,
        }
    }
    assert_eq!(pages, 6);
    let mut sorted = names.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(sorted.len(), 53);
    assert!(!names.contains(&"zz-late".to_string()));
}

#[tokio::test]
async fn an_expired_continue_token_is_410() {
    let fleet = fleet("secrets=20x256B", 5).await;
    let api: Api<Secret> = Api::all(client(&fleet).await);
    let page = api.list(&ListParams::default().limit(5)).await.unwrap();
    let token = page.metadata.continue_.unwrap();
    for i in 0..10 {
        fleet
            .store()
            .create(
                "configmaps",
                "ns-0",
                json!({"metadata": {"name": format!("c{i}")}}),
            )
            .unwrap();
    }
    let err = api
        .list(&ListParams::default().limit(5).continue_token(&token))
        .await
        .unwrap_err();
    match err {
        kube::Error::Api(s) => {
            assert_eq!((s.code, s.reason.as_str()), (410, "Expired"));
        }
        e => panic!("{e}"),
    }
}

#[tokio::test]
async fn a_watch_from_a_too_old_version_gets_a_410_error_event() {
    let fleet = fleet("secrets=5x256B", 3).await;
    let api: Api<Secret> = Api::namespaced(client(&fleet).await, "ns-0");
    for i in 0..10 {
        fleet
            .store()
            .create(
                "secrets",
                "ns-0",
                json!({"metadata": {"name": format!("n{i}")}}),
            )
            .unwrap();
    }
    let mut s = api
        .watch(&WatchParams::default(), "2")
        .await
        .unwrap()
        .boxed();
    match s.try_next().await.unwrap() {
        Some(WatchEvent::Error(e)) => assert_eq!((e.code, e.reason.as_str()), (410, "Expired")),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn watches_get_bookmarks_and_events_in_order() {
    let fleet = fleet("secrets=5x256B", 1000).await;
    let api: Api<Secret> = Api::namespaced(client(&fleet).await, "ns-0");
    let rv = fleet.store().resource_version().to_string();
    let mut s = api
        .watch(&WatchParams::default().timeout(10), &rv)
        .await
        .unwrap()
        .boxed();
    fleet
        .store()
        .create("secrets", "ns-0", json!({"metadata": {"name": "new"}}))
        .unwrap();
    fleet
        .store()
        .create(
            "secrets",
            "ns-1",
            json!({"metadata": {"name": "elsewhere"}}),
        )
        .unwrap();
    fleet.store().delete("secrets", "ns-0", "new").unwrap();
    let mut seen = Vec::new();
    let mut bookmark = None;
    while bookmark.is_none() {
        match tokio::time::timeout(Duration::from_secs(5), s.try_next())
            .await
            .unwrap()
            .unwrap()
        {
            Some(WatchEvent::Added(o)) => seen.push(format!("ADDED {}", o.metadata.name.unwrap())),
            Some(WatchEvent::Deleted(o)) => {
                seen.push(format!("DELETED {}", o.metadata.name.unwrap()))
            }
            Some(WatchEvent::Bookmark(b)) => bookmark = Some(b.metadata.resource_version),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(seen, ["ADDED new", "DELETED new"]);
    assert_eq!(
        bookmark.unwrap(),
        fleet.store().resource_version().to_string()
    );
}

#[tokio::test]
async fn streaming_lists_end_the_initial_state() {
    let fleet = fleet("configmaps=30x256B", 1000).await;
    let api: Api<ConfigMap> = Api::all(client(&fleet).await);
    let mut s = watcher(api, watcher::Config::default().streaming_lists()).boxed();
    let mut init = 0;
    loop {
        match tokio::time::timeout(Duration::from_secs(5), s.try_next())
            .await
            .unwrap()
            .unwrap()
        {
            Some(watcher::Event::Init) => {}
            Some(watcher::Event::InitApply(_)) => init += 1,
            Some(watcher::Event::InitDone) => break,
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(init, 30);
    let seen = fleet.seen_requests();
    let q = &seen.last().unwrap().path;
    assert!(q.contains("sendInitialEvents=true"), "{q}");
}

#[tokio::test]
async fn a_reflector_converges_to_the_store_under_churn() {
    let fleet = fleet("configmaps=40x256B", 50).await;
    let api: Api<ConfigMap> = Api::all(client(&fleet).await);
    let (reader, writer) = reflector::store();
    let rf = reflector(
        writer,
        watcher(api.clone(), watcher::Config::default().page_size(7)),
    )
    .default_backoff()
    .applied_objects()
    .for_each(|_| async {});
    let task = tokio::spawn(rf);
    reader.wait_until_ready().await.unwrap();
    let st = fleet.store();
    for i in 0..200 {
        let ns = format!("ns-{}", i % 10);
        match i % 4 {
            0 => {
                st.create("configmaps", &ns, json!({"metadata": {"name": format!("churn-{i}")}, "data": {"i": i.to_string()}})).unwrap();
            }
            1 => {
                st.patch(
                    "configmaps",
                    &ns,
                    &format!("configmap-{}", i % 40 / 10 * 10 + i % 10),
                    &json!({"data": {"i": i.to_string()}}),
                )
                .ok();
            }
            2 => {
                st.delete("configmaps", &ns, &format!("churn-{}", i - 2))
                    .ok();
            }
            _ => {
                let ns_api: Api<ConfigMap> = Api::namespaced(api.clone().into_client(), &ns);
                let cm = serde_json::from_value(json!({"metadata": {"name": format!("api-{i}")}}))
                    .unwrap();
                ns_api.create(&PostParams::default(), &cm).await.unwrap();
            }
        }
    }
    let want = || {
        let (_, items) = st.list("configmaps", None, None).unwrap();
        let mut v: Vec<(String, String, String)> = items
            .iter()
            .map(|o| (o.namespace.clone(), o.name.clone(), o.rv.to_string()))
            .collect();
        v.sort();
        v
    };
    let have = || {
        let mut v: Vec<(String, String, String)> = reader
            .state()
            .iter()
            .map(|c| {
                (
                    c.metadata.namespace.clone().unwrap(),
                    c.metadata.name.clone().unwrap(),
                    c.metadata.resource_version.clone().unwrap(),
                )
            })
            .collect();
        v.sort();
        v
    };
    let mut ok = false;
    for _ in 0..200 {
        if have() == want() {
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(
        ok,
        "reflector differs: {} vs {}",
        have().len(),
        want().len()
    );
    task.abort();
}

#[tokio::test]
async fn kube_discovery_finds_the_served_resources() {
    let fleet = fleet("secrets=1x256B", 100).await;
    let d = kube::discovery::Discovery::new(client(&fleet).await)
        .run()
        .await
        .unwrap();
    let mut found = Vec::new();
    for g in d.groups() {
        for (ar, caps) in g.recommended_resources() {
            found.push(format!("{}/{} {:?}", ar.group, ar.plural, caps.scope));
        }
    }
    for want in [
        "/secrets Namespaced",
        "/namespaces Cluster",
        "discovery.k8s.io/endpointslices Namespaced",
        "coordination.k8s.io/leases Namespaced",
    ] {
        assert!(found.iter().any(|f| f == want), "{want} not in {found:?}");
    }
}

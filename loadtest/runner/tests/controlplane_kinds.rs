//! The table of resources that Bulwark and the simulator share
//! (`apimachinery::kinds::RESOURCES`), held against a real kube-apiserver, asked directly:
//! each entry's kind, scope, singular name, short names and verbs as the apiserver's
//! discovery lists them, and, for each resource that can be watched, the object of the
//! BOOKMARK that ends a WatchList's initial events, byte for byte (its zero value, which
//! Bulwark's cache and the simulator write from the table). Without the binaries the
//! control plane builds them (`loadtest/controlplane/build.sh`, Go 1.26) or fails: this
//! test never skips.

use std::collections::BTreeMap;

use apimachinery::kinds::{RESOURCES, Resource};
use bulwark_loadtest::controlplane::{ControlPlane, Options};
use futures::{AsyncBufReadExt, StreamExt};
use kube::Client;
use serde_json::Value;
use serde_json::value::RawValue;

fn get(path: &str) -> http::Request<Vec<u8>> {
    http::Request::get(path).body(Vec::new()).unwrap()
}

/// `/api/v1` or `/apis/GROUP/VERSION`.
fn group_version_path(r: &Resource) -> String {
    if r.group.is_empty() {
        format!("/api/{}", r.version)
    } else {
        format!("/apis/{}/{}", r.group, r.version)
    }
}

/// A JSON array of strings as a sorted list (a missing one is empty).
fn strings(value: &Value) -> Vec<String> {
    let mut all: Vec<String> = value
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v.as_str().map(str::to_owned))
        .collect();
    all.sort();
    all
}

fn sorted(names: &[&str]) -> Vec<String> {
    let mut all: Vec<String> = names.iter().map(|s| (*s).to_owned()).collect();
    all.sort();
    all
}

/// The object of the BOOKMARK that ends a WatchList of `r`'s collection, as sent.
async fn initial_events_end(client: &Client, r: &Resource) -> String {
    let path = format!(
        "{}/{}?watch=1&sendInitialEvents=true&resourceVersionMatch=NotOlderThan&allowWatchBookmarks=true&timeoutSeconds=30",
        group_version_path(r),
        r.resource
    );
    let mut lines = client.request_stream(get(&path)).await.unwrap().lines();
    while let Some(line) = lines.next().await {
        let line = line.unwrap();
        #[derive(serde::Deserialize)]
        struct Event<'a> {
            #[serde(rename = "type")]
            kind: &'a str,
            #[serde(borrow)]
            object: &'a RawValue,
        }
        let event: Event<'_> = serde_json::from_str(&line).unwrap();
        if event.kind == "BOOKMARK" {
            return event.object.get().to_owned();
        }
    }
    panic!("{path}: the stream ended before its BOOKMARK");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shared_table_of_resources_is_what_the_real_apiserver_serves() {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = Options::new(dir.path());
    opts.replicas = 1;
    opts.bulwarks = 0;
    let cp = ControlPlane::start(opts)
        .await
        .unwrap_or_else(|e| panic!("the control plane did not start: {e}"));
    let client = cp.client("direct-admin").await.unwrap();

    let mut documents: BTreeMap<String, Value> = BTreeMap::new();
    let mut wrong = Vec::new();
    for r in RESOURCES {
        let path = group_version_path(r);
        if !documents.contains_key(&path) {
            let text = client.request_text(get(&path)).await.unwrap();
            documents.insert(path.clone(), serde_json::from_str(&text).unwrap());
        }
        let served = documents[&path]["resources"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|s| s["name"] == r.resource);
        let Some(served) = served else {
            wrong.push(format!("{path} does not list {}", r.resource));
            continue;
        };
        let table = (
            r.kind,
            r.namespaced,
            r.singular,
            sorted(r.short_names),
            sorted(r.verbs),
        );
        let real = (
            served["kind"].as_str().unwrap_or_default(),
            served["namespaced"].as_bool().unwrap_or_default(),
            served["singularName"].as_str().unwrap_or_default(),
            strings(&served["shortNames"]),
            strings(&served["verbs"]),
        );
        if table != real {
            wrong.push(format!(
                "{path} {}: the table has {table:?}, the apiserver {real:?}",
                r.resource
            ));
        }
        if r.verbs.contains(&"watch") {
            let object = initial_events_end(&client, r).await;
            let rv = serde_json::from_str::<Value>(&object).unwrap()["metadata"]["resourceVersion"]
                .as_str()
                .unwrap()
                .to_owned();
            let expected = format!(
                "{{\"kind\":\"{}\",\"apiVersion\":\"{}\",\"metadata\":{{\"resourceVersion\":\"{rv}\",\"annotations\":{{\"k8s.io/initial-events-end\":\"true\"}}}}{}}}",
                r.kind,
                r.api_version(),
                r.zero_fields
            );
            if object != expected {
                wrong.push(format!(
                    "{} bookmark: the table makes\n  {expected}\nthe apiserver sends\n  {object}",
                    r.resource
                ));
            }
        }
    }
    cp.stop().await.unwrap();
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

//! The simulator's answers held against real kube-apiserver v1.36 responses
//! (`fixtures/kube-apiserver-v1.36/`): same kinds, fields, field order and framing.

use std::fmt;

use bulwark_sim::client::{self, Reply};
use bulwark_sim::{Fleet, SimConfig};
use serde::de::{Deserialize, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::{Value, json};

const FIXTURES: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../fixtures/kube-apiserver-v1.36/"
);

#[derive(serde::Deserialize)]
struct Exchange {
    request_url: String,
    request_method: String,
    response_status_code: u16,
    response_body: String,
}

fn fixture(name: &str) -> Vec<Exchange> {
    let s = std::fs::read_to_string(format!("{FIXTURES}{name}")).unwrap();
    serde_json::from_str(&s).unwrap()
}

/// The keys of a JSON document in wire order, recursively (arrays keep their first element's).
#[derive(Debug, PartialEq, Clone)]
enum Keys {
    Obj(Vec<(String, Keys)>),
    Arr(Option<Box<Keys>>),
    Leaf,
}

impl Keys {
    fn of(s: &str) -> Keys {
        serde_json::from_str(s).unwrap()
    }
    fn names(&self) -> Vec<&str> {
        match self {
            Keys::Obj(v) => v.iter().map(|(k, _)| k.as_str()).collect(),
            _ => vec![],
        }
    }
    fn get(&self, k: &str) -> &Keys {
        match self {
            Keys::Obj(v) => {
                &v.iter()
                    .find(|(n, _)| n == k)
                    .unwrap_or_else(|| panic!("no {k}"))
                    .1
            }
            _ => panic!("not an object"),
        }
    }
    fn first(&self) -> &Keys {
        match self {
            Keys::Arr(Some(b)) => b,
            _ => panic!("not a non-empty array"),
        }
    }
}

impl<'de> Deserialize<'de> for Keys {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Keys, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Keys;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("json")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Keys, A::Error> {
                let mut v = Vec::new();
                while let Some(k) = m.next_key::<String>()? {
                    v.push((k, m.next_value::<Keys>()?));
                }
                Ok(Keys::Obj(v))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut s: A) -> Result<Keys, A::Error> {
                let first = s.next_element::<Keys>()?;
                while s.next_element::<IgnoredAny>()?.is_some() {}
                Ok(Keys::Arr(first.map(Box::new)))
            }
            fn visit_bool<E>(self, _: bool) -> Result<Keys, E> {
                Ok(Keys::Leaf)
            }
            fn visit_i64<E>(self, _: i64) -> Result<Keys, E> {
                Ok(Keys::Leaf)
            }
            fn visit_u64<E>(self, _: u64) -> Result<Keys, E> {
                Ok(Keys::Leaf)
            }
            fn visit_f64<E>(self, _: f64) -> Result<Keys, E> {
                Ok(Keys::Leaf)
            }
            fn visit_str<E>(self, _: &str) -> Result<Keys, E> {
                Ok(Keys::Leaf)
            }
            fn visit_unit<E>(self) -> Result<Keys, E> {
                Ok(Keys::Leaf)
            }
        }
        d.deserialize_any(V)
    }
}

/// The fixture's kube-system pods, loaded into a fresh fleet.
async fn fleet_with_fixture_pods() -> (Fleet, Vec<Value>) {
    let fleet = Fleet::start(SimConfig::default()).await.unwrap();
    let list: Value = serde_json::from_str(&fixture("pod-list.json")[0].response_body).unwrap();
    let items = list["items"].as_array().unwrap().clone();
    for p in &items {
        fleet
            .store()
            .create("pods", "kube-system", p.clone())
            .unwrap();
    }
    (fleet, items)
}

async fn get(fleet: &Fleet, path: &str) -> Reply {
    let admin = fleet
        .pki()
        .client_ca
        .client_cert("admin", &["system:masters"]);
    let tls = client::tls_config(fleet.pki(), Some(&admin), &[b"h2"]).unwrap();
    client::get(fleet.addrs()[0], &tls, path).await.unwrap()
}

/// Server-assigned fields differ by nature; everything else must be what was stored.
fn scrub(mut v: Value) -> Value {
    for k in ["uid", "resourceVersion", "creationTimestamp"] {
        v["metadata"][k] = json!("X");
    }
    v
}

fn body_str(r: &Reply) -> &str {
    std::str::from_utf8(&r.body).unwrap()
}

#[tokio::test]
async fn list_has_the_fixtures_shape_and_items_without_kind() {
    let (fleet, want_items) = fleet_with_fixture_pods().await;
    let r = get(&fleet, "/api/v1/namespaces/kube-system/pods").await;
    assert_eq!(r.status, 200);
    assert_eq!(r.headers["content-type"], "application/json");
    let real = &fixture("pod-list.json")[0].response_body;
    let ours = body_str(&r);
    assert!(ours.ends_with("]}\n") && real.ends_with("]}\n"));
    let (rk, ok) = (Keys::of(real), Keys::of(ours));
    assert_eq!(ok.names(), rk.names());
    assert_eq!(ok.get("metadata").names(), rk.get("metadata").names());
    let (ri, oi) = (rk.get("items").first(), ok.get("items").first());
    assert_eq!(
        oi.names(),
        ri.names(),
        "list items carry no kind/apiVersion"
    );
    assert_eq!(oi.get("metadata").names(), ri.get("metadata").names());
    let v: Value = serde_json::from_str(ours).unwrap();
    assert_eq!(v["kind"], "PodList");
    let got: Vec<Value> = v["items"]
        .as_array()
        .unwrap()
        .iter()
        .cloned()
        .map(scrub)
        .collect();
    let mut want: Vec<Value> = want_items.into_iter().map(scrub).collect();
    want.sort_by_key(|p| p["metadata"]["name"].as_str().unwrap().to_string());
    assert_eq!(got, want);
}

#[tokio::test]
async fn watch_events_have_the_fixtures_framing() {
    let (fleet, items) = fleet_with_fixture_pods().await;
    let r = get(
        &fleet,
        "/api/v1/namespaces/kube-system/pods?&watch=true&timeoutSeconds=1",
    )
    .await;
    let real = &fixture("watch_event-watch_pods.json")[0];
    assert_eq!(
        real.request_url,
        "/api/v1/namespaces/kube-system/pods?&watch=true"
    );
    let ours = body_str(&r);
    assert!(ours.ends_with('\n') && real.response_body.ends_with('\n'));
    let real_lines: Vec<&str> = real.response_body.lines().collect();
    let our_lines: Vec<&str> = ours.lines().collect();
    // The recording watched a moment with fewer pods than the LIST fixture holds.
    assert_eq!(our_lines.len(), items.len());
    let name = |l: &str| {
        serde_json::from_str::<Value>(l).unwrap()["object"]["metadata"]["name"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let mut compared = 0;
    for l in &our_lines {
        let k = Keys::of(l);
        assert_eq!(k.names(), ["type", "object"]);
        let v: Value = serde_json::from_str(l).unwrap();
        assert_eq!(
            (v["type"].as_str(), v["object"]["kind"].as_str()),
            (Some("ADDED"), Some("Pod"))
        );
        if let Some(rl) = real_lines.iter().find(|r| name(r) == name(l)) {
            let rk = Keys::of(rl);
            assert_eq!(
                k.get("object").names(),
                rk.get("object").names(),
                "watch objects carry kind/apiVersion"
            );
            assert_eq!(
                k.get("object").get("metadata").names(),
                rk.get("object").get("metadata").names()
            );
            compared += 1;
        }
    }
    assert!(compared >= 3, "{compared}");
}

#[tokio::test]
async fn watch_list_ends_its_initial_state_with_the_fixtures_bookmark() {
    let (fleet, items) = fleet_with_fixture_pods().await;
    let real = &fixture("watch_event-watch_pods_without_initial_events.json")[0];
    let r = get(&fleet, &format!("{}&timeoutSeconds=1", real.request_url)).await;
    let ours = body_str(&r);
    let our_lines: Vec<&str> = ours.lines().collect();
    let real_lines: Vec<&str> = real.response_body.lines().collect();
    assert_eq!(our_lines.len(), items.len() + 1);
    assert_eq!(real_lines.len(), our_lines.len());
    let rv = fleet.store().resource_version();
    let real_bookmark = real_lines
        .last()
        .unwrap()
        .replace("\"550\"", &format!("\"{rv}\""));
    assert_eq!(
        *our_lines.last().unwrap(),
        real_bookmark,
        "byte-identical bookmark"
    );
    assert!(our_lines[..items.len()].iter().all(|l| {
        l.starts_with("{\"type\":\"ADDED\",\"object\":{\"kind\":\"Pod\",\"apiVersion\":\"v1\",")
    }));
}

#[tokio::test]
async fn discovery_has_the_fixtures_shape() {
    let fleet = Fleet::start(SimConfig::default()).await.unwrap();
    let r = get(&fleet, "/apis").await;
    let real = &fixture("api_versions-list.json")[0].response_body;
    let (rk, ok) = (Keys::of(real), Keys::of(body_str(&r)));
    assert_eq!(ok.names(), rk.names());
    assert_eq!(
        ok.get("groups").first().names(),
        rk.get("groups").first().names()
    );
    assert_eq!(
        ok.get("groups").first().get("versions").first().names(),
        rk.get("groups").first().get("versions").first().names()
    );
    assert!(body_str(&r).ends_with('\n'));
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    let real_v: Value = serde_json::from_str(real).unwrap();
    for g in [
        "discovery.k8s.io",
        "coordination.k8s.io",
        "authentication.k8s.io",
        "authorization.k8s.io",
    ] {
        let ours = v["groups"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["name"] == g)
            .unwrap();
        let theirs = real_v["groups"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["name"] == g)
            .unwrap();
        assert_eq!(ours, theirs, "{g}");
    }
    let rl: Value = serde_json::from_slice(&get(&fleet, "/api/v1").await.body).unwrap();
    assert_eq!(rl["kind"], "APIResourceList");
    let secrets = rl["resources"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == "secrets")
        .unwrap();
    assert_eq!(
        secrets["verbs"],
        json!([
            "create",
            "delete",
            "deletecollection",
            "get",
            "list",
            "patch",
            "update",
            "watch"
        ])
    );
    assert_eq!(secrets["namespaced"], true);
    let nf = get(&fleet, "/apis/nope.example.com/v1").await;
    assert_eq!(
        (nf.status, nf.json()["reason"].clone()),
        (404, json!("NotFound"))
    );
}

#[tokio::test]
async fn status_errors_have_the_fixtures_shape() {
    let fleet = Fleet::start(SimConfig::default()).await.unwrap();
    let admin = fleet
        .pki()
        .client_ca
        .client_cert("admin", &["system:masters"]);
    let tls = client::tls_config(fleet.pki(), Some(&admin), &[b"h2"]).unwrap();
    let post = |body: Value| {
        http::Request::post("https://localhost/api/v1/namespaces/default/secrets")
            .header("content-type", "application/json")
            .body(bytes::Bytes::from(body.to_string()))
            .unwrap()
    };
    let real = fixture("custom_resource_definition-test.json")
        .into_iter()
        .find(|e| e.response_status_code == 422)
        .unwrap();
    assert_eq!(real.request_method, "POST");
    let r = client::request(
        fleet.addrs()[0],
        &tls,
        post(json!({"metadata": {"name": "Bad_Name"}})),
    )
    .await
    .unwrap();
    assert_eq!(r.status, 422);
    let (rk, ok) = (Keys::of(&real.response_body), Keys::of(body_str(&r)));
    assert_eq!(ok.names(), rk.names());
    // The fixture's resource has a group; a core resource's details omit the empty group.
    let real_details: Vec<&str> = rk
        .get("details")
        .names()
        .into_iter()
        .filter(|k| *k != "group")
        .collect();
    assert_eq!(ok.get("details").names(), real_details);
    assert_eq!(
        ok.get("details").get("causes").first().names(),
        rk.get("details").get("causes").first().names()
    );
    assert!(body_str(&r).ends_with("}\n"));

    // Create answers 201 with the object in the fixture's field order.
    let r = client::request(
        fleet.addrs()[0],
        &tls,
        post(json!({"metadata": {"name": "s"}, "type": "Opaque"})),
    )
    .await
    .unwrap();
    assert_eq!(r.status, 201);
    let real_create = &fixture("job-create.json")[0];
    assert_eq!(real_create.response_status_code, 201);
    let rk = Keys::of(&real_create.response_body);
    let ok = Keys::of(body_str(&r));
    assert_eq!(ok.names()[..3], rk.names()[..3]);
    assert_eq!(
        ok.get("metadata").names(),
        [
            "name",
            "namespace",
            "uid",
            "resourceVersion",
            "creationTimestamp"
        ]
    );
    assert!(body_str(&r).ends_with("}\n"));

    let again = client::request(
        fleet.addrs()[0],
        &tls,
        post(json!({"metadata": {"name": "s"}})),
    )
    .await
    .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&again.body),
        "{\"kind\":\"Status\",\"apiVersion\":\"v1\",\"metadata\":{},\"status\":\"Failure\",\"message\":\"secrets \\\"s\\\" already exists\",\"reason\":\"AlreadyExists\",\"details\":{\"name\":\"s\",\"kind\":\"secrets\"},\"code\":409}\n"
    );
    let nf = get(&fleet, "/api/v1/namespaces/default/secrets/nope").await;
    assert_eq!(
        body_str(&nf),
        "{\"kind\":\"Status\",\"apiVersion\":\"v1\",\"metadata\":{},\"status\":\"Failure\",\"message\":\"secrets \\\"nope\\\" not found\",\"reason\":\"NotFound\",\"details\":{\"name\":\"nope\",\"kind\":\"secrets\"},\"code\":404}\n"
    );
}

#[tokio::test]
async fn tables_and_metadata_lists_are_served_for_kubectl_and_metadata_informers() {
    let fleet = Fleet::start(SimConfig {
        seed: vec!["secrets=3x256B@a".parse().unwrap()],
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let admin = fleet
        .pki()
        .client_ca
        .client_cert("admin", &["system:masters"]);
    let tls = client::tls_config(fleet.pki(), Some(&admin), &[b"h2"]).unwrap();
    let get_accept = |accept: &'static str| {
        let tls = tls.clone();
        let addr = fleet.addrs()[0];
        async move {
            let req = http::Request::get("https://localhost/api/v1/namespaces/a/secrets")
                .header("accept", accept)
                .body(bytes::Bytes::new())
                .unwrap();
            client::request(addr, &tls, req).await.unwrap().json()
        }
    };
    let t = get_accept("application/json;as=Table;v=v1;g=meta.k8s.io,application/json").await;
    assert_eq!(t["kind"], "Table");
    let cols: Vec<&str> = t["columnDefinitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(cols, ["Name", "Type", "Data", "Age"]);
    assert_eq!(t["rows"][0]["cells"][0], "secret-0");
    assert_eq!(t["rows"][0]["object"]["kind"], "PartialObjectMetadata");
    let m = get_accept("application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1").await;
    assert_eq!(m["kind"], "PartialObjectMetadataList");
    assert_eq!(m["items"].as_array().unwrap().len(), 3);
    assert!(m["items"][0].get("data").is_none());
    let n = get_accept("application/vnd.kubernetes.protobuf").await;
    assert_eq!(n["code"], 406);
}

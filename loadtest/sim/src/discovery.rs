//! The resources the simulator serves, and the discovery documents (`/api`, `/apis`,
//! APIResourceLists, `/version`) that kubectl and kube-rs read before anything else.

use serde_json::{Value, json};

pub use apimachinery::kinds::{RESOURCES, Resource as ResourceDef};

/// The resource with this group and plural name.
pub fn find(group: &str, version: &str, resource: &str) -> Option<&'static ResourceDef> {
    RESOURCES
        .iter()
        .find(|r| r.group == group && r.version == version && r.resource == resource)
}

/// The resource for a store key (`secrets`, `leases.coordination.k8s.io`).
pub fn by_key(key: &str) -> Option<&'static ResourceDef> {
    let (resource, group) = key.split_once('.').unwrap_or((key, ""));
    RESOURCES
        .iter()
        .find(|r| r.group == group && r.resource == resource)
}

fn groups() -> Vec<&'static str> {
    let mut gs: Vec<&str> = Vec::new();
    for r in RESOURCES {
        if !r.group.is_empty() && !gs.contains(&r.group) {
            gs.push(r.group);
        }
    }
    gs
}

/// `/version`.
pub fn version() -> Value {
    json!({
        "major": "1",
        "minor": "36",
        "emulationMajor": "1",
        "emulationMinor": "36",
        "minCompatibilityMajor": "1",
        "minCompatibilityMinor": "35",
        "gitVersion": "v1.36.0",
        "gitCommit": "0000000000000000000000000000000000000000",
        "gitTreeState": "clean",
        "buildDate": "2026-06-01T00:00:00Z",
        "goVersion": "go1.26.0",
        "compiler": "gc",
        "platform": "linux/amd64"
    })
}

/// `/api`.
pub fn api_versions(server_addr: &str) -> Value {
    json!({
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": server_addr}]
    })
}

/// `/apis`.
pub fn api_group_list() -> Value {
    let groups: Vec<Value> = groups()
        .into_iter()
        .map(|g| {
            let gv = json!({"groupVersion": format!("{g}/v1"), "version": "v1"});
            json!({"name": g, "versions": [gv.clone()], "preferredVersion": gv})
        })
        .collect();
    json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})
}

/// `/apis/GROUP`.
pub fn api_group(group: &str) -> Option<Value> {
    if !groups().contains(&group) {
        return None;
    }
    let gv = json!({"groupVersion": format!("{group}/v1"), "version": "v1"});
    Some(json!({
        "kind": "APIGroup", "apiVersion": "v1", "name": group,
        "versions": [gv.clone()], "preferredVersion": gv
    }))
}

/// The APIResourceList of one group-version.
pub fn resource_list(group: &str, version: &str) -> Option<Value> {
    let defs: Vec<&ResourceDef> = RESOURCES
        .iter()
        .filter(|r| r.group == group && r.version == version)
        .collect();
    if defs.is_empty() {
        return None;
    }
    let gv = defs[0].api_version();
    let mut resources = Vec::new();
    for r in defs {
        let mut e = json!({
            "name": r.resource, "singularName": r.singular, "namespaced": r.namespaced,
            "kind": r.kind, "verbs": r.verbs,
        });
        if !r.short_names.is_empty() {
            e["shortNames"] = json!(r.short_names);
        }
        if r.stored() {
            e["storageVersionHash"] = json!(format!("sim{}", r.kind));
        }
        resources.push(e);
        if r.resource == "pods" {
            resources.push(json!({"name": "pods/exec", "singularName": "", "namespaced": true, "kind": "PodExecOptions", "verbs": ["create", "get"]}));
            resources.push(json!({"name": "pods/log", "singularName": "", "namespaced": true, "kind": "Pod", "verbs": ["get"]}));
        }
    }
    Some(
        json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": resources}),
    )
}

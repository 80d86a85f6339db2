//! What the control plane holds before Bulwark starts: RBAC for the sandbox's identities
//! (the same grants as the simulator's sandbox policy, now enforced by the real RBAC
//! authorizer), Bulwark's own ClusterRole exactly as `deploy/base/rbac.yaml` ships it, and
//! namespaces, Secrets, ConfigMaps and EndpointSlices to read.

use std::fmt::Debug;
use std::time::Duration;

use base64::Engine as _;
use k8s_openapi::api::authorization::v1::SubjectAccessReview;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Secret};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use kube::api::{Api, PostParams};
use kube::{Client, Resource};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use super::Error;
use crate::identities::{NODE, NODE_NAMESPACE, NODE_SECRETS, OPERATORS};

/// Bulwark's own identity upstream (its `upstream.self` client certificate's CN).
pub const BULWARK_USER: &str = "bulwark";
/// Its group.
pub const BULWARK_GROUP: &str = "bulwark:proxies";

/// The namespaces seeded besides `default`.
pub const NAMESPACES: [&str; 2] = ["ns-0", "ns-1"];
/// Secrets per namespace (`secret-0`, ...), besides the node's two.
pub const SECRETS_PER_NAMESPACE: usize = 10;
const CONFIGMAPS_PER_NAMESPACE: usize = 5;
const ENDPOINTSLICES_PER_NAMESPACE: usize = 4;
/// Bytes of data in each seeded Secret.
const SECRET_BYTES: usize = 2048;

/// Bulwark's ClusterRole as shipped.
const DEPLOY_RBAC: &str = include_str!("../../../../deploy/base/rbac.yaml");

/// Bulwark's own priority level and FlowSchema in the apiservers' APF, as shipped.
const DEPLOY_FLOWCONTROL: &str = include_str!("../../../../deploy/base/flowcontrol.yaml");

/// What publishing the `kubernetes` Service needs, as shipped.
const SERVICE_RBAC: &str =
    include_str!("../../../../deploy/components/kubernetes-service/rbac.yaml");

/// Creates everything with `admin` (a `system:masters` client straight to a replica);
/// objects that already exist are left as they are.
pub async fn seed(admin: &Client) -> Result<(), Error> {
    let namespaces = std::iter::once("default").chain(NAMESPACES);
    for ns in NAMESPACES {
        create(
            &Api::<Namespace>::all(admin.clone()),
            json!({"metadata": {"name": ns}}),
        )
        .await?;
    }
    rbac(admin).await?;
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    for ns in namespaces {
        let secrets = Api::<Secret>::namespaced(admin.clone(), ns);
        for i in 0..SECRETS_PER_NAMESPACE {
            let value: String = format!("{ns}/secret-{i} ")
                .chars()
                .cycle()
                .take(SECRET_BYTES)
                .collect();
            create(
                &secrets,
                json!({
                    "metadata": {"name": format!("secret-{i}"), "labels": {"app": format!("app-{}", i % 3)}},
                    "type": "Opaque",
                    "data": {"value": b64(&value)},
                }),
            )
            .await?;
        }
        let configmaps = Api::<ConfigMap>::namespaced(admin.clone(), ns);
        for i in 0..CONFIGMAPS_PER_NAMESPACE {
            create(
                &configmaps,
                json!({
                    "metadata": {"name": format!("configmap-{i}")},
                    "data": {"setting": format!("value {i} of {ns}")},
                }),
            )
            .await?;
        }
        let slices = Api::<EndpointSlice>::namespaced(admin.clone(), ns);
        for i in 0..ENDPOINTSLICES_PER_NAMESPACE {
            // FQDN endpoints: the objects are read, never dialled, and an IPv4 slice may not
            // hold loopback addresses.
            create(
                &slices,
                json!({
                    "metadata": {
                        "name": format!("endpointslice-{i}"),
                        "labels": {"kubernetes.io/service-name": format!("service-{i}")},
                    },
                    "addressType": "FQDN",
                    "endpoints": (0..3).map(|e| json!({
                        "addresses": [format!("backend-{e}.service-{i}.{ns}.example")],
                        "conditions": {"ready": true},
                    })).collect::<Vec<_>>(),
                    "ports": [{"name": "https", "port": 8443, "protocol": "TCP"}],
                }),
            )
            .await?;
        }
    }
    let node_secrets = Api::<Secret>::namespaced(admin.clone(), NODE_NAMESPACE);
    for name in NODE_SECRETS {
        create(
            &node_secrets,
            json!({
                "metadata": {"name": name},
                "type": "Opaque",
                "data": {"token": b64(&format!("{name} value"))},
            }),
        )
        .await?;
    }
    Ok(())
}

/// The grants: operators read secrets and configmaps everywhere; the node gets, lists and
/// watches its two secrets by name; Bulwark gets the shipped ClusterRole; `nobody` gets
/// nothing beyond what every authenticated user has (discovery).
async fn rbac(admin: &Client) -> Result<(), Error> {
    let cluster_roles = Api::<ClusterRole>::all(admin.clone());
    let cluster_bindings = Api::<ClusterRoleBinding>::all(admin.clone());
    create(
        &cluster_roles,
        json!({
            "metadata": {"name": "sandbox:operator"},
            "rules": [{
                "apiGroups": [""],
                "resources": ["secrets", "configmaps"],
                "verbs": ["get", "list", "watch"],
            }],
        }),
    )
    .await?;
    create(
        &cluster_bindings,
        json!({
            "metadata": {"name": "sandbox:operator"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "sandbox:operator"},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": OPERATORS}],
        }),
    )
    .await?;
    create(
        &Api::<Role>::namespaced(admin.clone(), NODE_NAMESPACE),
        json!({
            "metadata": {"name": format!("{NODE}-secrets")},
            "rules": [{
                "apiGroups": [""],
                "resources": ["secrets"],
                "resourceNames": NODE_SECRETS,
                "verbs": ["get", "list", "watch"],
            }],
        }),
    )
    .await?;
    create(
        &Api::<RoleBinding>::namespaced(admin.clone(), NODE_NAMESPACE),
        json!({
            "metadata": {"name": format!("{NODE}-secrets")},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": format!("{NODE}-secrets")},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": format!("system:node:{NODE}")}],
        }),
    )
    .await?;
    let bulwark_role = shipped_cluster_role()?;
    let role_name = bulwark_role["metadata"]["name"].clone();
    create(&cluster_roles, bulwark_role).await?;
    create(
        &cluster_bindings,
        json!({
            "metadata": {"name": role_name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role_name},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": BULWARK_USER}],
        }),
    )
    .await
}

/// The ClusterRole of `deploy/base/rbac.yaml`.
fn shipped_cluster_role() -> Result<Value, Error> {
    shipped("ClusterRole")
}

/// The first object of `kind` in `deploy/base/rbac.yaml`.
fn shipped(kind: &str) -> Result<Value, Error> {
    shipped_in(DEPLOY_RBAC, "deploy/base/rbac.yaml", kind)
}

/// The first object of `kind` in `text`, the shipped file `file`.
fn shipped_in(text: &str, file: &str, kind: &str) -> Result<Value, Error> {
    use serde::Deserialize as _;
    for doc in serde_norway::Deserializer::from_str(text) {
        let value = Value::deserialize(doc).map_err(|e| Error::Seed(format!("{file}: {e}")))?;
        if value["kind"] == kind {
            return Ok(value);
        }
    }
    Err(Error::Seed(format!("{file} has no {kind}")))
}

/// What a fleet of Bulwarks needs: namespace `bulwark`, and there the shipped Role on
/// Leases, and in `default` the shipped Role on the `kubernetes` Service's endpoints, bound
/// to Bulwark's own user.
pub async fn fleet_rbac(admin: &Client) -> Result<(), Error> {
    let namespace = super::FLEET_NAMESPACE;
    create(
        &Api::<Namespace>::all(admin.clone()),
        json!({"metadata": {"name": namespace}}),
    )
    .await?;
    bind_role(admin, namespace, shipped("Role")?).await?;
    let file = "deploy/components/kubernetes-service/rbac.yaml";
    bind_role(admin, "default", shipped_in(SERVICE_RBAC, file, "Role")?).await
}

/// Bulwark's own traffic in the apiservers' APF as `deploy/base/flowcontrol.yaml` ships it
/// (its reviews, informers and Leases on a priority level of their own, so that what it
/// holds back cannot starve them), matching Bulwark's own user here where the shipped
/// schema names its ServiceAccount.
pub async fn flowcontrol(admin: &Client) -> Result<(), Error> {
    use k8s_openapi::api::flowcontrol::v1::{FlowSchema, PriorityLevelConfiguration};
    let file = "deploy/base/flowcontrol.yaml";
    let level = shipped_in(DEPLOY_FLOWCONTROL, file, "PriorityLevelConfiguration")?;
    create(
        &Api::<PriorityLevelConfiguration>::all(admin.clone()),
        level,
    )
    .await?;
    let mut schema = shipped_in(DEPLOY_FLOWCONTROL, file, "FlowSchema")?;
    schema["spec"]["rules"][0]["subjects"] =
        json!([{"kind": "User", "user": {"name": BULWARK_USER}}]);
    create(&Api::<FlowSchema>::all(admin.clone()), schema).await
}

/// Creates `role` in `namespace` and binds it to Bulwark's own user (the shipped bindings
/// name its ServiceAccount).
async fn bind_role(admin: &Client, namespace: &str, role: Value) -> Result<(), Error> {
    let name = role["metadata"]["name"].clone();
    create(&Api::<Role>::namespaced(admin.clone(), namespace), role).await?;
    create(
        &Api::<RoleBinding>::namespaced(admin.clone(), namespace),
        json!({
            "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": BULWARK_USER}],
        }),
    )
    .await
}

/// Waits until `admin`'s replica authorizes Bulwark to list Secrets: each apiserver's RBAC
/// authorizer reads bindings from its own informer, so a binding written through one
/// replica reaches the others a moment later.
pub async fn wait_for_rbac(admin: &Client, timeout: Duration) -> Result<(), Error> {
    let reviews = Api::<SubjectAccessReview>::all(admin.clone());
    let review: SubjectAccessReview = serde_json::from_value(json!({
        "spec": {
            "user": BULWARK_USER,
            "groups": [BULWARK_GROUP],
            "resourceAttributes": {"verb": "list", "resource": "secrets"},
        },
    }))
    .map_err(|e| Error::Seed(e.to_string()))?;
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let answer = reviews
            .create(&PostParams::default(), &review)
            .await
            .map_err(|e| Error::Kube {
                what: "a SubjectAccessReview".into(),
                source: e,
            })?;
        if answer.status.is_some_and(|s| s.allowed) {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            return Err(Error::Seed(format!(
                "a replica still denies {BULWARK_USER} listing secrets {timeout:?} after the \
                 binding was written"
            )));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Creates one object from its JSON; a 409 (it exists already) is fine.
async fn create<K>(api: &Api<K>, value: Value) -> Result<(), Error>
where
    K: Resource + Clone + DeserializeOwned + Serialize + Debug,
    K::DynamicType: Default,
{
    let what = format!(
        "{} {}",
        K::kind(&K::DynamicType::default()),
        value["metadata"]["name"].as_str().unwrap_or("?")
    );
    let object: K =
        serde_json::from_value(value).map_err(|e| Error::Seed(format!("{what}: {e}")))?;
    match api.create(&PostParams::default(), &object).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.code == 409 => Ok(()),
        Err(source) => Err(Error::Kube {
            what: format!("creating {what}"),
            source,
        }),
    }
}

/// Creates the objects of simulator-style seeds (`secrets=1500x100KiB`), the same objects
/// the simulated fleet would hold, with a few requests in flight at once; their namespaces
/// are created first. Objects that already exist are left as they are.
pub async fn bulk(admin: &Client, seeds: &[bulwark_sim::Seed]) -> Result<(), Error> {
    use futures::StreamExt as _;
    for seed in seeds {
        let def = bulwark_sim::discovery::by_key(&seed.resource)
            .ok_or_else(|| Error::Seed(format!("{}: no such resource", seed.resource)))?;
        if def.namespaced {
            for ns in &seed.namespaces {
                post(
                    admin,
                    "/api/v1/namespaces".into(),
                    json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}),
                )
                .await?;
            }
        }
        let api_version = if def.group.is_empty() {
            def.version.to_string()
        } else {
            format!("{}/{}", def.group, def.version)
        };
        let prefix = if def.group.is_empty() {
            "/api/v1".to_string()
        } else {
            format!("/apis/{}/{}", def.group, def.version)
        };
        let results: Vec<Result<(), Error>> = futures::stream::iter(0..seed.count)
            .map(|i| {
                let (api_version, prefix) = (&api_version, &prefix);
                async move {
                    let (ns, _, mut object) = seed
                        .object(i)
                        .map_err(|e| Error::Seed(format!("{}: {e}", seed.resource)))?;
                    object["apiVersion"] = json!(api_version);
                    object["kind"] = json!(def.kind);
                    if let Some(meta) = object["metadata"].as_object_mut() {
                        meta.remove("uid");
                        meta.remove("creationTimestamp");
                    }
                    let path = if ns.is_empty() {
                        format!("{prefix}/{}", def.resource)
                    } else {
                        format!("{prefix}/namespaces/{ns}/{}", def.resource)
                    };
                    post(admin, path, object).await
                }
            })
            .buffer_unordered(SEED_CONCURRENCY)
            .collect()
            .await;
        results.into_iter().collect::<Result<(), Error>>()?;
    }
    Ok(())
}

/// Creates held in flight at once while seeding in bulk.
const SEED_CONCURRENCY: usize = 16;

/// POSTs `object` to `path`; an object that exists already is fine.
async fn post(admin: &Client, path: String, object: Value) -> Result<(), Error> {
    let request = http::Request::post(&path)
        .header("Content-Type", "application/json")
        .body(object.to_string().into_bytes())
        .map_err(|e| Error::Seed(format!("{path}: {e}")))?;
    match admin.request_text(request).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.code == 409 => Ok(()),
        Err(source) => Err(Error::Kube {
            what: format!("POST {path}"),
            source,
        }),
    }
}

/// Lets every authenticated user do everything (`cluster-admin`), as the scenarios'
/// simulated fleet does: the scenarios measure load, not authorization.
pub async fn open_rbac(admin: &Client) -> Result<(), Error> {
    post(
        admin,
        "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings".into(),
        json!({
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "loadtest:everyone"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": "system:authenticated"}],
        }),
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bulwark_gets_the_shipped_cluster_role() {
        let role: ClusterRole = serde_json::from_value(shipped_cluster_role().unwrap()).unwrap();
        let rules = role.rules.unwrap();
        let grants = |resource: &str, verb: &str| {
            rules.iter().any(|r| {
                r.resources.iter().flatten().any(|x| x == resource)
                    && r.verbs.iter().any(|v| v == verb)
            })
        };
        assert!(grants("tokenreviews", "create"));
        assert!(grants("subjectaccessreviews", "create"));
        for resource in ["secrets", "endpoints", "endpointslices"] {
            assert!(
                grants(resource, "list") && grants(resource, "watch"),
                "{resource}"
            );
        }
        assert!(!grants("secrets", "create"));
    }
}

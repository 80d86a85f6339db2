//! The Helm chart (`deploy/helm/bulwark`) against the kustomize base (`deploy/base`): with
//! default values `helm template` renders the same objects, field for field, as `kubectl
//! kustomize`, and the values a platform team sets reach the objects and make a
//! configuration Bulwark accepts. Both tools are the ones `loadtest/controlplane/build.sh`
//! builds; without them (and without `BULWARK_CONTROLPLANE_BIN`, which CI sets) the tests
//! report themselves skipped.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use bulwark::config::{Config, RulesMode};
use serde::Deserialize;
use serde_json::Value;

use bulwark_testkit::repo_path as repo;

/// Labels Helm adds that the base has no counterpart for.
const HELM_ONLY_LABELS: [&str; 3] = [
    "app.kubernetes.io/managed-by",
    "app.kubernetes.io/instance",
    "helm.sh/chart",
];

/// The folder holding `helm` and `kubectl`: `BULWARK_CONTROLPLANE_BIN` (then they must be
/// there), else `target/controlplane/bin` when build.sh has filled it.
fn tools() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("BULWARK_CONTROLPLANE_BIN") {
        let dir = PathBuf::from(dir);
        for tool in ["helm", "kubectl"] {
            assert!(
                dir.join(tool).is_file(),
                "{tool} is missing from BULWARK_CONTROLPLANE_BIN={} (loadtest/controlplane/build.sh builds it)",
                dir.display()
            );
        }
        return Some(dir);
    }
    let dir = repo("target/controlplane/bin");
    if ["helm", "kubectl"].iter().all(|t| dir.join(t).is_file()) {
        return Some(dir);
    }
    bulwark_testkit::tools::skip(
        "helm or kubectl is not built (run loadtest/controlplane/build.sh, or set BULWARK_CONTROLPLANE_BIN)",
    );
    None
}

fn run(program: PathBuf, args: &[&str], stdin: &str) -> String {
    use std::io::Write as _;
    let mut child = Command::new(&program)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{}: {e}", program.display()));
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{} {}: {}",
        program.display(),
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("UTF-8 output")
}

/// Every YAML document of a rendering, as JSON values.
fn docs(text: &str) -> Vec<Value> {
    serde_norway::Deserializer::from_str(text)
        .map(|doc| Value::deserialize(doc).expect("rendered YAML parses"))
        .filter(|v| !v.is_null())
        .collect()
}

/// `helm template` of the chart as release "bulwark" in namespace "bulwark", with `values`
/// (YAML) over the defaults.
fn helm_template(dir: &std::path::Path, values: &str) -> Vec<Value> {
    let chart = repo("deploy/helm/bulwark");
    let all = [
        "template",
        "bulwark",
        chart.to_str().unwrap(),
        "--namespace",
        "bulwark",
        "--values",
        "-",
    ];
    docs(&run(dir.join("helm"), &all, values))
}

/// `kubectl kustomize` of `deploy/base`.
fn kustomize(dir: &std::path::Path) -> Vec<Value> {
    kustomize_at(dir, "deploy/base")
}

/// `kubectl kustomize` of a kustomization in the repository.
fn kustomize_at(dir: &std::path::Path, at: &str) -> Vec<Value> {
    let base = repo(at);
    docs(&run(
        dir.join("kubectl"),
        &["kustomize", base.to_str().unwrap()],
        "",
    ))
}

fn find<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

/// Replaces every string equal to `from` in `v` with `to`.
fn rename(v: &mut Value, from: &str, to: &str) {
    match v {
        Value::String(s) if s == from => *s = to.to_string(),
        Value::Array(a) => a.iter_mut().for_each(|v| rename(v, from, to)),
        Value::Object(o) => o.values_mut().for_each(|v| rename(v, from, to)),
        _ => {}
    }
}

/// The first place where `a` and `b` differ, as a path, with both values.
fn difference(path: &str, a: &Value, b: &Value) -> Option<String> {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let keys: std::collections::BTreeSet<_> = x.keys().chain(y.keys()).collect();
            keys.into_iter().find_map(|k| {
                difference(
                    &format!("{path}.{k}"),
                    x.get(k).unwrap_or(&Value::Null),
                    y.get(k).unwrap_or(&Value::Null),
                )
            })
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => x
            .iter()
            .zip(y)
            .enumerate()
            .find_map(|(i, (a, b))| difference(&format!("{path}[{i}]"), a, b)),
        _ if a == b => None,
        _ => Some(format!("{path}: kustomize {a}, helm {b}")),
    }
}

/// Kinds without a namespace. Kustomize's `namespace:` sets one on those it does not know
/// (FlowSchema, PriorityLevelConfiguration); the apiserver drops it.
const CLUSTER_SCOPED: [&str; 4] = [
    "ClusterRole",
    "ClusterRoleBinding",
    "FlowSchema",
    "PriorityLevelConfiguration",
];

/// The base's objects by (kind, name), with the configuration ConfigMap's hash suffix taken
/// off (Helm rolls the pods through a checksum annotation instead), no namespace on
/// cluster-scoped objects, and bulwark.yaml parsed (the files differ in comments and key
/// order, not in content).
fn normalized_base(objects: Vec<Value>) -> BTreeMap<(String, String), Value> {
    let hashed = objects
        .iter()
        .filter(|o| o["kind"] == "ConfigMap")
        .filter_map(|o| o["metadata"]["name"].as_str())
        .find(|n| n.starts_with("bulwark-config-"))
        .expect("the base's bulwark-config ConfigMap has a hash suffix")
        .to_string();
    objects
        .into_iter()
        .map(|mut o| {
            rename(&mut o, &hashed, "bulwark-config");
            if CLUSTER_SCOPED.iter().any(|k| o["kind"] == *k) {
                o["metadata"].as_object_mut().unwrap().remove("namespace");
            }
            parse_config(&mut o);
            key(o)
        })
        .collect()
}

/// Helm's objects by (kind, name), without the labels and the annotation that only Helm sets.
fn normalized_chart(objects: Vec<Value>) -> BTreeMap<(String, String), Value> {
    objects
        .into_iter()
        .map(|mut o| {
            if let Some(labels) = o
                .pointer_mut("/metadata/labels")
                .and_then(Value::as_object_mut)
            {
                HELM_ONLY_LABELS.iter().for_each(|l| {
                    labels.remove(*l);
                });
            }
            if let Some(annotations) = o
                .pointer_mut("/spec/template/metadata/annotations")
                .and_then(Value::as_object_mut)
            {
                assert!(
                    annotations.remove("checksum/config").is_some(),
                    "the pod template carries the configuration's checksum"
                );
            }
            parse_config(&mut o);
            key(o)
        })
        .collect()
}

fn parse_config(o: &mut Value) {
    if let Some(text) = o["data"]["bulwark.yaml"].as_str() {
        let parsed: Value = serde_norway::from_str(text).expect("bulwark.yaml parses");
        o["data"]["bulwark.yaml"] = parsed;
    }
}

fn key(o: Value) -> ((String, String), Value) {
    let kind = o["kind"].as_str().expect("kind").to_string();
    let name = o["metadata"]["name"].as_str().expect("name").to_string();
    ((kind, name), o)
}

/// The configuration text the chart renders.
fn rendered_config(objects: &[Value]) -> String {
    find(objects, "ConfigMap", "bulwark-config")["data"]["bulwark.yaml"]
        .as_str()
        .expect("bulwark.yaml")
        .to_string()
}

#[test]
fn default_values_render_what_the_kustomize_base_does() {
    let Some(dir) = tools() else { return };
    let rendered = helm_template(&dir, "");
    let config: Config = rendered_config(&rendered).parse().unwrap();
    assert_eq!(
        config.rules.mode,
        RulesMode::Shadow,
        "a default install observes first"
    );
    let base = normalized_base(kustomize(&dir));
    let chart = normalized_chart(rendered);
    assert_eq!(
        base.keys().collect::<Vec<_>>(),
        chart.keys().collect::<Vec<_>>(),
        "the same kinds and names"
    );
    for (k, b) in &base {
        if let Some(d) = difference(&format!("{} {}", k.0, k.1), b, &chart[k]) {
            panic!("the chart differs from deploy/base at {d}");
        }
    }
}

#[test]
fn values_reach_the_objects_and_make_a_configuration_bulwark_accepts() {
    let Some(dir) = tools() else { return };
    let objects = helm_template(
        &dir,
        r#"
image: {repository: registry.example/bulwark, tag: "1.2.3"}
apiservers: [192.0.2.1:6443, "cp-2.example:6443"]
listen: {port: 8443}
admin: {address: 127.0.0.1, port: 9444, tokenSecret: {name: my-admin-token}}
certificates:
  servingSecret: my-serving
  frontProxySecret: my-front-proxy
  clientCASecret: my-client-ca
rules:
  mode: enforce
  files:
    only.yaml: |
      levels:
        - name: tiny
          seats: 1
          queues: 1
          handSize: 1
          queueLength: 1
          maxWait: 1s
resources: {requests: {cpu: 100m, memory: 64Mi}, limits: {memory: 128Mi}}
namespace: {create: false}
config:
  listen: {proxyProtocol: null}
"#,
    );

    assert!(
        !objects.iter().any(|o| o["kind"] == "Namespace"),
        "namespace.create=false renders no Namespace"
    );
    let config: Config = rendered_config(&objects)
        .parse()
        .unwrap_or_else(|e| panic!("the rendered bulwark.yaml is not a valid configuration: {e}"));
    let replicas: Vec<String> = config
        .upstream
        .replicas
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(replicas, ["192.0.2.1:6443", "cp-2.example:6443"]);
    assert_eq!(config.listen.address.to_string(), "0.0.0.0:8443");
    assert_eq!(config.admin.address.to_string(), "127.0.0.1:9444");
    assert!(
        config.listen.proxy_protocol.is_none(),
        "a null value removes a block"
    );
    assert_eq!(config.rules.mode, RulesMode::Enforce);

    let ds = find(&objects, "DaemonSet", "bulwark");
    let pod = &ds["spec"]["template"]["spec"];
    let container = &pod["containers"][0];
    assert_eq!(container["image"], "registry.example/bulwark:1.2.3");
    assert_eq!(container["resources"]["limits"]["memory"], "128Mi");
    let ports: BTreeMap<&str, (&Value, &Value)> = container["ports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["name"].as_str().unwrap(),
                (&p["containerPort"], &p["hostPort"]),
            )
        })
        .collect();
    assert_eq!(ports["https"], (&Value::from(8443), &Value::from(8443)));
    assert_eq!(ports["admin"], (&Value::from(9444), &Value::from(9444)));
    let service = find(&objects, "Service", "bulwark-metrics");
    assert_eq!(service["spec"]["ports"][0]["port"], 9444);
    let secrets: Vec<&str> = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v["secret"]["secretName"].as_str())
        .collect();
    assert_eq!(
        secrets,
        [
            "my-serving",
            "my-front-proxy",
            "my-client-ca",
            "my-admin-token"
        ]
    );
    let rules = &find(&objects, "ConfigMap", "bulwark-rules")["data"];
    assert_eq!(
        rules.as_object().unwrap().keys().collect::<Vec<_>>(),
        ["only.yaml"],
        "rule files replace the chart's"
    );

    // A changed configuration changes the pod template, so the DaemonSet rolls.
    let default = helm_template(&dir, "");
    let checksum = |objs: &[Value]| {
        find(objs, "DaemonSet", "bulwark")["spec"]["template"]["metadata"]
            ["annotations"]["checksum/config"]
            .clone()
    };
    assert_ne!(checksum(&objects), checksum(&default));
}

/// The chart's values that render what `deploy/overlays/node-pki` does.
const KEY_FROM_NODE: &str = "certificates: {frontProxyFromNode: {enabled: true, group: 997}}";

#[test]
fn the_node_pki_overlay_renders_what_the_chart_does_with_the_key_from_the_node() {
    let Some(dir) = tools() else { return };
    // A strategic-merge patch puts the volumes it adds first; the order means nothing.
    let by_name = |mut objects: BTreeMap<(String, String), Value>| {
        let pod = objects
            .get_mut(&("DaemonSet".into(), "bulwark".into()))
            .unwrap()
            .pointer_mut("/spec/template/spec")
            .unwrap();
        for list in ["/volumes", "/containers/0/volumeMounts"] {
            let list = pod.pointer_mut(list).unwrap().as_array_mut().unwrap();
            list.sort_by_key(|v| v["name"].as_str().unwrap().to_owned());
        }
        objects
    };
    let overlay = by_name(normalized_base(kustomize_at(
        &dir,
        "deploy/overlays/node-pki",
    )));
    let chart = by_name(normalized_chart(helm_template(&dir, KEY_FROM_NODE)));
    assert_eq!(
        overlay.keys().collect::<Vec<_>>(),
        chart.keys().collect::<Vec<_>>()
    );
    for (k, o) in &overlay {
        if let Some(d) = difference(&format!("{} {}", k.0, k.1), o, &chart[k]) {
            panic!("the chart differs from deploy/overlays/node-pki at {d}");
        }
    }
}

#[test]
fn the_front_proxy_key_can_come_from_the_node_and_never_be_in_the_api() {
    let Some(dir) = tools() else { return };
    let objects = helm_template(&dir, KEY_FROM_NODE);
    let config: Config = rendered_config(&objects)
        .parse()
        .unwrap_or_else(|e| panic!("the rendered bulwark.yaml is not a valid configuration: {e}"));
    let front_proxy = config.upstream.front_proxy.expect("front-proxy mode");
    let pod = &find(&objects, "DaemonSet", "bulwark")["spec"]["template"]["spec"];
    let volumes = pod["volumes"].as_array().unwrap();
    let secrets: Vec<&str> = volumes
        .iter()
        .filter_map(|v| v["secret"]["secretName"].as_str())
        .collect();
    assert_eq!(
        secrets,
        [
            "bulwark-serving",
            "bulwark-client-ca",
            "bulwark-admin-token"
        ]
    );
    // Each file Bulwark reads is the node's own, alone, where the configuration names it.
    let mounts = pod["containers"][0]["volumeMounts"].as_array().unwrap();
    for (file, node) in [
        (
            &front_proxy.cert,
            "/etc/kubernetes/pki/front-proxy-client.crt",
        ),
        (
            &front_proxy.key,
            "/etc/kubernetes/pki/front-proxy-client.key",
        ),
    ] {
        let mount = mounts
            .iter()
            .find(|m| m["mountPath"] == file.to_str().unwrap())
            .unwrap_or_else(|| panic!("{} is not mounted", file.display()));
        assert_eq!(mount["readOnly"], true);
        let volume = volumes.iter().find(|v| v["name"] == mount["name"]).unwrap();
        assert_eq!(volume["hostPath"]["path"], node);
        assert_eq!(volume["hostPath"]["type"], "File");
    }
    assert_eq!(
        pod["securityContext"]["supplementalGroups"],
        serde_json::json!([997]),
        "the pod joins the group that may read the key"
    );

    // Without the group the key's 0600 keeps Bulwark out: the chart says so instead.
    let refused = Command::new(dir.join("helm"))
        .args(["template", "bulwark"])
        .arg(repo("deploy/helm/bulwark"))
        .args(["--set", "certificates.frontProxyFromNode.enabled=true"])
        .output()
        .unwrap();
    assert!(!refused.status.success());
    let why = String::from_utf8_lossy(&refused.stderr);
    assert!(why.contains("frontProxyFromNode.group"), "{why}");
}

/// The chart's values that lead pods through Bulwark, as `deploy/overlays/in-cluster` does.
const IN_CLUSTER: &str =
    "kubernetesService: {apiservers: [\"10.0.0.11:6443\", \"10.0.0.12:6443\"]}";

#[test]
fn the_in_cluster_overlay_renders_what_the_chart_does_with_kubernetes_service() {
    let Some(dir) = tools() else { return };
    // A strategic-merge patch puts what it adds first; the order means nothing.
    let sorted = |mut objects: BTreeMap<(String, String), Value>| {
        let pod = objects
            .get_mut(&("DaemonSet".into(), "bulwark".into()))
            .unwrap()
            .pointer_mut("/spec/template/spec")
            .unwrap();
        pod["containers"]
            .as_array_mut()
            .unwrap()
            .sort_by_key(|c| c["name"].as_str().unwrap().to_owned());
        let mut lists = vec!["/volumes".to_owned()];
        for i in 0..pod["containers"].as_array().unwrap().len() {
            lists.push(format!("/containers/{i}/volumeMounts"));
        }
        for list in lists {
            let list = pod.pointer_mut(&list).unwrap().as_array_mut().unwrap();
            list.sort_by_key(|v| v["name"].as_str().unwrap().to_owned());
        }
        objects
    };
    let overlay = sorted(normalized_base(kustomize_at(
        &dir,
        "deploy/overlays/in-cluster",
    )));
    let chart = sorted(normalized_chart(helm_template(&dir, IN_CLUSTER)));
    assert_eq!(
        overlay.keys().collect::<Vec<_>>(),
        chart.keys().collect::<Vec<_>>()
    );
    // The configuration is the user's to extend in the overlay (deploy/README.md); the chart
    // writes it from the values. Everything else is the same.
    for (k, o) in overlay.iter().filter(|(k, _)| k.0 != "ConfigMap") {
        if let Some(d) = difference(&format!("{} {}", k.0, k.1), o, &chart[k]) {
            panic!("the chart differs from deploy/overlays/in-cluster at {d}");
        }
    }
    for kind in ["Role", "RoleBinding"] {
        let object = &chart[&(kind.into(), "bulwark-kubernetes-service".into())];
        assert_eq!(object["metadata"]["namespace"], "default");
    }
    let pod = &chart[&("DaemonSet".into(), "bulwark".into())]["spec"]["template"]["spec"];
    let guard = pod["containers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "guard")
        .expect("a guard beside Bulwark");
    assert_eq!(guard["args"][0], "guard");

    // The chart's configuration publishes the Service, signed, and Bulwark accepts it.
    let objects = helm_template(&dir, IN_CLUSTER);
    let config: Config = rendered_config(&objects)
        .parse()
        .unwrap_or_else(|e| panic!("the rendered bulwark.yaml is not a valid configuration: {e}"));
    let fleet = config.fleet.expect("a fleet");
    assert_eq!(
        fleet.key_file.as_deref(),
        Some(std::path::Path::new("/etc/bulwark/fleet/key"))
    );
    let service = fleet.kubernetes_service.expect("the Service published");
    assert_eq!(service.apiservers.len(), 2);
    // Without the values, none of it.
    let plain = normalized_chart(helm_template(&dir, ""));
    assert!(!plain.contains_key(&("Role".into(), "bulwark-kubernetes-service".into())));
}

#[test]
fn the_admin_token_is_mounted_where_bulwark_reads_it_and_the_chart_can_make_it() {
    let Some(dir) = tools() else { return };
    let objects = helm_template(&dir, "");
    assert!(
        !objects.iter().any(|o| o["kind"] == "Secret"),
        "by default the Secret is made by hand, as for the base"
    );
    let config: Config = rendered_config(&objects).parse().unwrap();
    let token_file = config.admin.token_file.expect("admin.tokenFile");
    let pod = &find(&objects, "DaemonSet", "bulwark")["spec"]["template"]["spec"];
    let mount = pod["containers"][0]["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["mountPath"] == token_file.parent().unwrap().to_str().unwrap())
        .expect("the token's folder is mounted");
    let volume = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mount["name"])
        .unwrap();
    assert_eq!(volume["secret"]["secretName"], "bulwark-admin-token");
    assert_eq!(token_file.file_name().unwrap(), "token");
    assert!(config.access_log.is_some() && config.metrics.identities > 0);

    let objects = helm_template(
        &dir,
        "admin: {tokenSecret: {create: true}}\nconfig: {accessLog: null}",
    );
    let secret = find(&objects, "Secret", "bulwark-admin-token");
    use base64::Engine as _;
    let token = base64::engine::general_purpose::STANDARD
        .decode(secret["data"]["token"].as_str().unwrap())
        .unwrap();
    assert_eq!(token.len(), 48);
    assert!(token.iter().all(u8::is_ascii_alphanumeric));
    let config: Config = rendered_config(&objects).parse().unwrap();
    assert!(config.access_log.is_none(), "accessLog: null turns it off");
}

/// `helm` with `args` and `values` (YAML) on stdin: whether it succeeded, and what it said.
fn helm_says(dir: &std::path::Path, args: &[&str], values: &str) -> (bool, String) {
    use std::io::Write as _;
    let mut child = Command::new(dir.join("helm"))
        .args(args)
        .arg(repo("deploy/helm/bulwark"))
        .args(["--values", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(values.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), said)
}

#[test]
fn a_misspelt_key_or_a_value_of_the_wrong_type_fails_lint_and_template() {
    let Some(dir) = tools() else { return };
    let template = ["template", "bulwark", "--namespace", "bulwark"];
    let lint = ["lint", "--strict"];
    for args in [&template[..], &lint[..]] {
        let (ok, said) = helm_says(&dir, args, "apiservers: [10.0.0.21:6443]\n");
        assert!(ok, "helm {args:?} refuses good values: {said}");
    }
    for (values, named) in [
        // `apiserver:` would leave the replicas at the chart's examples, silently.
        ("apiserver: [10.0.0.21:6443]\n", "apiserver"),
        ("admin: {tokenSecret: {creat: true}}\n", "creat"),
        ("resources: {request: {memory: 1Gi}}\n", "request"),
        ("listen: {port: \"7443/tcp\"}\n", "/listen/port"),
        ("rules: {mode: enfroce}\n", "/rules/mode"),
        (
            "serviceMonitor: {enabled: \"yes\"}\n",
            "/serviceMonitor/enabled",
        ),
        ("auditVolumeSizeLimit: 1 GB\n", "/auditVolumeSizeLimit"),
    ] {
        for args in [&template[..], &lint[..]] {
            let (ok, said) = helm_says(&dir, args, values);
            assert!(!ok, "helm {args:?} accepted {values:?}");
            assert!(said.contains(named), "helm {args:?} on {values:?}: {said}");
        }
    }
    // Bulwark's own configuration is Bulwark's to validate: any key passes the chart.
    let (ok, said) = helm_says(&dir, &template, "config: {cache: {resources: [secrets]}}\n");
    assert!(ok, "{said}");
}

#[test]
fn the_monitoring_objects_render_what_deploy_prometheus_and_grafana_do() {
    let Some(dir) = tools() else { return };
    let plain = helm_template(&dir, "");
    for kind in ["ServiceMonitor", "PrometheusRule"] {
        assert!(
            !plain.iter().any(|o| o["kind"] == kind),
            "{kind} by default"
        );
    }
    let objects = helm_template(
        &dir,
        "serviceMonitor: {enabled: true}\nprometheusRule: {enabled: true}\ndashboard: {enabled: true}\n",
    );
    let prometheus = kustomize_at(&dir, "deploy/prometheus");
    let grafana = kustomize_at(&dir, "deploy/grafana");
    for kind in ["ServiceMonitor", "PrometheusRule"] {
        let shipped = find(&prometheus, kind, "bulwark");
        let chart = find(&objects, kind, "bulwark");
        assert_eq!(chart["apiVersion"], shipped["apiVersion"], "{kind}");
        assert_eq!(chart["metadata"]["namespace"], "bulwark");
        if let Some(d) = difference(kind, &shipped["spec"], &chart["spec"]) {
            panic!("the chart's {kind} differs from deploy/prometheus at {d}");
        }
        for (label, value) in shipped["metadata"]["labels"].as_object().unwrap() {
            assert_eq!(&chart["metadata"]["labels"][label], value, "{kind} {label}");
        }
    }
    // The ServiceMonitor selects the chart's metrics Service and its port.
    let monitor = find(&objects, "ServiceMonitor", "bulwark");
    let service = find(&objects, "Service", "bulwark-metrics");
    for (label, value) in monitor["spec"]["selector"]["matchLabels"]
        .as_object()
        .unwrap()
    {
        assert_eq!(&service["metadata"]["labels"][label], value);
    }
    assert_eq!(
        monitor["spec"]["endpoints"][0]["port"],
        service["spec"]["ports"][0]["name"]
    );
    // The alerts are the rules file's, and promtool takes them as a rules file.
    let rules: Value = serde_norway::from_str(
        &std::fs::read_to_string(repo("deploy/prometheus/bulwark.rules.yml")).unwrap(),
    )
    .unwrap();
    let groups = &find(&objects, "PrometheusRule", "bulwark")["spec"]["groups"];
    assert_eq!(groups, &rules["groups"]);
    if let Ok(out) = Command::new("promtool").arg("--version").output()
        && out.status.success()
    {
        let file = tempfile::NamedTempFile::new().unwrap();
        let text = serde_norway::to_string(&serde_json::json!({ "groups": groups })).unwrap();
        std::fs::write(file.path(), text).unwrap();
        let checked = Command::new("promtool")
            .args(["check", "rules"])
            .arg(file.path())
            .output()
            .unwrap();
        assert!(
            checked.status.success(),
            "{}",
            String::from_utf8_lossy(&checked.stdout)
        );
    }
    // The dashboard is deploy/grafana's, labelled for Grafana's sidecar.
    let shipped = find(&grafana, "ConfigMap", "bulwark-dashboard");
    let chart = find(&objects, "ConfigMap", "bulwark-dashboard");
    assert_eq!(chart["metadata"]["labels"]["grafana_dashboard"], "1");
    let json = |o: &Value| -> Value {
        serde_json::from_str(o["data"]["bulwark.json"].as_str().unwrap()).unwrap()
    };
    assert_eq!(json(chart), json(shipped));
}

#[test]
fn extra_volumes_and_mounts_are_added_to_the_chart_s_own() {
    let Some(dir) = tools() else { return };
    let objects = helm_template(
        &dir,
        r#"
extraVolumes:
  - name: state-on-node
    hostPath: {path: /var/lib/bulwark-state, type: DirectoryOrCreate}
extraVolumeMounts:
  - name: state-on-node
    mountPath: /var/lib/bulwark-node
"#,
    );
    let pod = &find(&objects, "DaemonSet", "bulwark")["spec"]["template"]["spec"];
    let default = helm_template(&dir, "");
    let plain = &find(&default, "DaemonSet", "bulwark")["spec"]["template"]["spec"];
    for (list, name) in [
        ("/volumes", "state-on-node"),
        ("/containers/0/volumeMounts", "state-on-node"),
    ] {
        let with = pod.pointer(list).unwrap().as_array().unwrap();
        let without = plain.pointer(list).unwrap().as_array().unwrap();
        assert_eq!(with.len(), without.len() + 1, "{list}");
        assert_eq!(
            &with[..without.len()],
            &without[..],
            "{list}: the chart's own first"
        );
        assert_eq!(with.last().unwrap()["name"], name, "{list}");
    }
    assert_eq!(
        pod["volumes"].as_array().unwrap().last().unwrap()["hostPath"]["path"],
        "/var/lib/bulwark-state"
    );
}

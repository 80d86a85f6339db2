//! Checks of what `deploy/` and `certs` ship, against a running Bulwark: the manifests'
//! cross-references (ports, names, mounted paths, probe paths), the alerts and the dashboard
//! against the metrics Bulwark exports (a live `/metrics` plus DESIGN.md's contract),
//! `promtool check metrics` on a live scrape, certificates from `certs init` used by real
//! clients, and logs that never hold a token, a key or Secret data.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::OnceLock;
use std::time::Duration;

use bulwark::config::{Config, Quantity};
use serde::Deserialize;
use serde_json::Value;
use tokio::io::AsyncReadExt;

use bulwark_testkit::repo_path as repo;
use bulwark_testkit::{
    BAD_TOKEN, Client, Cluster, GOOD_TOKEN, Setup, admin_get, get, post_json, with_token,
};

// ---------------------------------------------------------------------------------------
// Files

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every YAML document of a file, as JSON values.
fn yaml_docs(path: &Path) -> Vec<Value> {
    let text = read(path);
    serde_norway::Deserializer::from_str(&text)
        .map(|doc| Value::deserialize(doc).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
        .filter(|v| !v.is_null())
        .collect()
}

fn yaml(path: &Path) -> Value {
    let mut docs = yaml_docs(path);
    assert_eq!(docs.len(), 1, "{}: one document expected", path.display());
    docs.remove(0)
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|s| s.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// A kustomization and every object it includes, with its generators, recursively.
#[derive(Default)]
struct Kustomized {
    objects: Vec<Value>,
    /// Generated ConfigMaps and Secrets: (kind, name) → data keys.
    generated: BTreeMap<(String, String), BTreeSet<String>>,
    namespaces: BTreeSet<String>,
}

fn kustomize(dir: &Path, out: &mut Kustomized) {
    let file = dir.join("kustomization.yaml");
    let k = yaml(&file);
    if let Some(ns) = k["namespace"].as_str() {
        out.namespaces.insert(ns.to_string());
    }
    for resource in strings(&k["resources"]) {
        let path = dir.join(&resource);
        assert!(
            path.exists(),
            "{}: resource {resource} does not exist",
            file.display()
        );
        if path.is_dir() {
            kustomize(&path, out);
        } else {
            out.objects.extend(yaml_docs(&path));
        }
    }
    for (field, kind) in [
        ("configMapGenerator", "ConfigMap"),
        ("secretGenerator", "Secret"),
    ] {
        for generator in k[field].as_array().into_iter().flatten() {
            let name = generator["name"].as_str().expect("generator name");
            let mut keys = BTreeSet::new();
            for entry in strings(&generator["files"]) {
                let (key, source) = match entry.split_once('=') {
                    Some((key, source)) => (key.to_string(), source.to_string()),
                    None => (
                        Path::new(&entry)
                            .file_name()
                            .unwrap()
                            .to_string_lossy()
                            .into_owned(),
                        entry.clone(),
                    ),
                };
                // Secret sources are generated (`certs init`) and git-ignored; the rest ship.
                if kind == "ConfigMap" {
                    assert!(
                        dir.join(&source).is_file(),
                        "{}: {source} does not exist",
                        file.display()
                    );
                }
                keys.insert(key);
            }
            out.generated
                .insert((kind.to_string(), name.to_string()), keys);
        }
    }
}

fn object<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

fn only<'a>(objects: &'a [Value], kind: &str) -> &'a Value {
    let found: Vec<_> = objects.iter().filter(|o| o["kind"] == kind).collect();
    assert_eq!(found.len(), 1, "one {kind} expected");
    found[0]
}

fn port_of(address: &SocketAddr) -> u64 {
    u64::from(address.port())
}

fn deploy_config() -> Config {
    read(&repo("deploy/base/bulwark.yaml"))
        .parse()
        .unwrap_or_else(|e| panic!("deploy/base/bulwark.yaml is not a valid configuration: {e}"))
}

/// `policy/`'s ValidatingAdmissionPolicy guards the Leases the base's fleet writes: its
/// namespace, its prefix, and the ServiceAccount its DaemonSet runs as.
#[test]
fn the_fleet_lease_policy_admits_only_the_base_s_bulwark() {
    let mut policy = Kustomized::default();
    kustomize(&repo("deploy/policy"), &mut policy);
    let mut base = Kustomized::default();
    kustomize(&repo("deploy/base"), &mut base);
    let fleet = deploy_config().fleet.expect("the base runs a fleet");
    let namespace = base
        .namespaces
        .first()
        .expect("the base's namespace")
        .clone();
    let sa = only(&base.objects, "DaemonSet")["spec"]["template"]["spec"]["serviceAccountName"]
        .as_str()
        .expect("the DaemonSet names its ServiceAccount")
        .to_string();
    assert_eq!(
        fleet.namespace, namespace,
        "the fleet's Leases are in Bulwark's namespace"
    );

    let vap = object(
        &policy.objects,
        "ValidatingAdmissionPolicy",
        "bulwark-fleet-leases",
    );
    let spec = &vap["spec"];
    assert_eq!(spec["failurePolicy"], "Fail");
    assert_eq!(
        spec["matchConstraints"]["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"],
        fleet.namespace.as_str()
    );
    let rules = &spec["matchConstraints"]["resourceRules"][0];
    assert_eq!(
        rules["apiGroups"],
        serde_json::json!(["coordination.k8s.io"])
    );
    assert_eq!(rules["resources"], serde_json::json!(["leases"]));
    assert_eq!(
        rules["operations"],
        serde_json::json!(["CREATE", "UPDATE", "DELETE"])
    );
    let condition = spec["matchConditions"][0]["expression"].as_str().unwrap();
    assert!(
        condition.contains(&format!("startsWith(\"{}\")", fleet.lease_prefix)),
        "{condition}"
    );
    let allowed = spec["validations"][0]["expression"].as_str().unwrap();
    assert!(
        allowed.contains(&format!(
            "request.userInfo.username == \"system:serviceaccount:{namespace}:{sa}\""
        )),
        "{allowed}"
    );
    let binding = object(
        &policy.objects,
        "ValidatingAdmissionPolicyBinding",
        "bulwark-fleet-leases",
    );
    assert_eq!(binding["spec"]["policyName"], "bulwark-fleet-leases");
    assert_eq!(
        binding["spec"]["validationActions"],
        serde_json::json!(["Deny"])
    );
}

/// The Dockerfile against the DaemonSet and the configuration: no Docker engine runs in CI,
/// so what can be checked without building is checked here.
#[test]
fn the_dockerfile_builds_a_non_root_image_the_daemonset_can_run() {
    let dockerfile = read(&repo("deploy/Dockerfile"));
    let lines: Vec<&str> = dockerfile
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    let stages: Vec<usize> = (0..lines.len())
        .filter(|&i| lines[i].starts_with("FROM "))
        .collect();
    assert!(stages.len() >= 2, "multi-stage: build, then run");
    let last = &lines[*stages.last().unwrap()..];
    let instruction = |name: &str| -> Vec<&str> {
        last.iter()
            .filter_map(|l| l.strip_prefix(name).map(str::trim))
            .collect()
    };
    assert!(
        lines[stages[0]..stages[1]]
            .iter()
            .any(|l| l.contains("cargo build --release --locked -p bulwark")),
        "the build stage builds the locked release binary"
    );
    assert!(
        !last.iter().any(|l| l.contains("cargo")),
        "the run stage carries no toolchain"
    );
    // What it is and what is inside: the OCI labels and the SBOM.
    for label in ["version", "revision", "source", "licenses"] {
        assert!(
            last.iter()
                .any(|l| l.contains(&format!("org.opencontainers.image.{label}="))),
            "the image is labelled with its {label}"
        );
    }
    assert!(
        last.iter()
            .any(|l| l.starts_with("COPY --from=build /out/sbom.cdx.json ")),
        "the image carries its SBOM"
    );

    // Non-root, and the same user the DaemonSet runs as.
    let user = instruction("USER ");
    let uid = user
        .last()
        .expect("the image sets USER")
        .split(':')
        .next()
        .unwrap();
    assert_ne!(uid, "0");
    assert_ne!(uid, "root");
    let mut all = Kustomized::default();
    kustomize(&repo("deploy/overlays/dev"), &mut all);
    let ds = object(&all.objects, "DaemonSet", "bulwark");
    let pod = &ds["spec"]["template"]["spec"];
    assert_eq!(pod["securityContext"]["runAsUser"].to_string(), uid);
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);

    // The entrypoint is the binary the build stage copied in, and the default command
    // is the DaemonSet's: serve the mounted configuration.
    let entrypoint: Vec<String> =
        serde_json::from_str(instruction("ENTRYPOINT ").last().expect("ENTRYPOINT")).unwrap();
    assert!(
        last.iter()
            .any(|l| l.starts_with("COPY --from=") && l.ends_with(&format!(" {}", entrypoint[0]))),
        "{} is copied from the build stage",
        entrypoint[0]
    );
    let cmd: Vec<String> = serde_json::from_str(instruction("CMD ").last().expect("CMD")).unwrap();
    let container = &pod["containers"][0];
    let args: Vec<String> = strings(&container["args"]);
    assert_eq!(
        &cmd[..args.len()],
        &args[..],
        "CMD and the DaemonSet's args agree"
    );

    // The ports it documents are the configuration's.
    let config = deploy_config();
    let exposed: BTreeSet<u64> = instruction("EXPOSE ")
        .iter()
        .flat_map(|l| l.split_whitespace())
        .map(|p| p.parse().unwrap())
        .collect();
    assert_eq!(
        exposed,
        BTreeSet::from([
            port_of(&config.listen.address),
            port_of(&config.admin.address)
        ])
    );

    // The build context never carries build output or generated keys.
    let ignore = read(&repo(".dockerignore"));
    for needed in ["target/", ".git/", "**/*.key", "**/kubeconfig-*"] {
        assert!(
            ignore.lines().any(|l| l.trim() == needed),
            ".dockerignore lacks {needed}"
        );
    }
}

/// The rule files of a folder (`*.yaml`, `*.yml`), by name, with their bytes.
fn rule_files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml" || e == "yml"))
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(&p).unwrap())
        })
        .collect()
}

/// One rule set ships, from one folder: the base's `bulwark-rules` ConfigMap is made of
/// every file of `deploy/base/rules` and of nothing else, and the chart's `rules/` (Helm reads
/// only files under the chart) holds the same files, byte for byte.
#[test]
fn the_base_and_the_chart_ship_exactly_the_rules_folder() {
    let shipped = rule_files(&repo("deploy/base/rules"));
    assert!(shipped.len() > 1, "{:?}", shipped.keys());

    let kustomization = yaml(&repo("deploy/base/kustomization.yaml"));
    let generator = kustomization["configMapGenerator"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["name"] == "bulwark-rules")
        .expect("the bulwark-rules ConfigMap generator");
    let listed: BTreeSet<String> = strings(&generator["files"]).into_iter().collect();
    let folder: BTreeSet<String> = shipped.keys().map(|n| format!("rules/{n}")).collect();
    assert_eq!(
        listed, folder,
        "deploy/base/kustomization.yaml's bulwark-rules lists every file of deploy/base/rules"
    );

    let chart = rule_files(&repo("deploy/helm/bulwark/rules"));
    assert_eq!(
        chart.keys().collect::<Vec<_>>(),
        shipped.keys().collect::<Vec<_>>(),
        "the chart's rules/ has the files of deploy/base/rules (copy them: \
         cp deploy/base/rules/*.yaml deploy/helm/bulwark/rules/)"
    );
    for (name, bytes) in &shipped {
        assert!(
            chart[name] == *bytes,
            "deploy/helm/bulwark/rules/{name} differs from deploy/base/rules/{name}"
        );
    }
}

/// The chart ships the alerts and the dashboard of `deploy/` as copies under its own folder
/// (Helm reads only files under the chart): the same files, byte for byte.
#[test]
fn the_chart_ships_the_alerts_and_the_dashboard_of_deploy() {
    for (shipped, copy) in [
        (
            "deploy/prometheus/bulwark.rules.yml",
            "deploy/helm/bulwark/prometheus/bulwark.rules.yml",
        ),
        (
            "deploy/grafana/bulwark.json",
            "deploy/helm/bulwark/grafana/bulwark.json",
        ),
    ] {
        assert!(
            read(&repo(shipped)) == read(&repo(copy)),
            "{copy} differs from {shipped} (copy it: cp {shipped} {copy})"
        );
    }
}

/// Does the label selector `selector` (matchLabels or a plain map) select `labels`?
fn selects(selector: &Value, labels: &Value) -> bool {
    let wanted = selector
        .get("matchLabels")
        .unwrap_or(selector)
        .as_object()
        .expect("a selector map");
    !wanted.is_empty() && wanted.iter().all(|(k, v)| labels[k] == *v)
}

// ---------------------------------------------------------------------------------------
// Manifests

#[test]
fn manifests_agree_with_each_other_and_with_the_configuration() {
    let mut all = Kustomized::default();
    kustomize(&repo("deploy/overlays/dev"), &mut all);
    let config = deploy_config();
    let daemonset = object(&all.objects, "DaemonSet", "bulwark");
    let pod = &daemonset["spec"]["template"]["spec"];
    let container = &pod["containers"][0];
    let d = Deployed {
        all: &all,
        objects: &all.objects,
        config: &config,
        daemonset,
        pod,
        pod_labels: &daemonset["spec"]["template"]["metadata"]["labels"],
        container,
        mounts: &Mounts::new(pod, container, &all),
    };
    the_pod_runs_beside_each_apiserver(&d);
    every_file_is_where_a_volume_puts_it(&d);
    the_service_account_s_rights_and_flow_schema(&d);
    monitoring_selects_the_pods(&d);
}

/// The dev overlay's objects, kustomized, and the parts of them the checks read.
struct Deployed<'a> {
    all: &'a Kustomized,
    objects: &'a [Value],
    config: &'a Config,
    daemonset: &'a Value,
    pod: &'a Value,
    pod_labels: &'a Value,
    container: &'a Value,
    mounts: &'a Mounts<'a>,
}

/// One namespace, the pod beside each apiserver (host network, no cluster DNS), its drain, ports, resources, security and probes.
fn the_pod_runs_beside_each_apiserver(d: &Deployed<'_>) {
    let Deployed {
        objects,
        config,
        pod,
        pod_labels,
        container,
        ..
    } = *d;
    assert_eq!(d.all.namespaces, BTreeSet::from(["bulwark".to_string()]));
    let namespace = object(objects, "Namespace", "bulwark");
    assert_eq!(
        namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"], "privileged",
        "host networking needs the privileged Pod Security level"
    );
    for o in objects {
        if let Some(ns) = o["metadata"]["namespace"].as_str() {
            assert_eq!(ns, "bulwark", "{} {}", o["kind"], o["metadata"]["name"]);
        }
    }

    // Topology: beside each apiserver, independent of kube-proxy and cluster DNS.
    assert!(selects(&d.daemonset["spec"]["selector"], pod_labels));
    assert_eq!(pod["hostNetwork"], true);
    assert_eq!(pod["dnsPolicy"], "Default", "never cluster DNS");
    assert!(
        pod["nodeSelector"]
            .as_object()
            .unwrap()
            .contains_key("node-role.kubernetes.io/control-plane")
    );
    assert!(
        pod["tolerations"]
            .as_array()
            .unwrap()
            .iter()
            .any(|t| t["key"] == "node-role.kubernetes.io/control-plane")
    );
    let anti =
        &pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0];
    assert_eq!(anti["topologyKey"], "kubernetes.io/hostname");
    assert!(selects(&anti["labelSelector"], pod_labels));

    // Graceful termination outlasts the drain.
    let drain =
        config.listen.shutdown.pause + config.listen.shutdown.grace + bulwark::serve::WATCHES_END;
    let grace = pod["terminationGracePeriodSeconds"].as_u64().unwrap();
    assert!(
        Duration::from_secs(grace) > drain,
        "terminationGracePeriodSeconds {grace} must exceed pause + grace + the watches' end {drain:?}"
    );

    // Ports: the container declares the configured listen and admin ports.
    let ports: BTreeMap<String, &Value> = container["ports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p["name"].as_str().unwrap().to_string(), p))
        .collect();
    assert_eq!(
        ports["https"]["containerPort"],
        port_of(&config.listen.address)
    );
    assert_eq!(
        ports["admin"]["containerPort"],
        port_of(&config.admin.address)
    );
    for port in ports.values() {
        assert_eq!(
            port["hostPort"], port["containerPort"],
            "host networking: hostPort = containerPort"
        );
    }
    assert!(
        !config.admin.address.ip().is_loopback(),
        "the kubelet probes and Prometheus scrape the node address"
    );
    assert!(container["resources"]["requests"]["cpu"].is_string());
    assert!(container["resources"]["requests"]["memory"].is_string());
    let security = &container["securityContext"];
    assert_eq!(security["allowPrivilegeEscalation"], false);
    assert_eq!(security["readOnlyRootFilesystem"], true);
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);

    // Probes on the admin port, on paths the admin listener serves (checked live in
    // `probe_paths_answer_on_the_admin_listener`).
    for probe in ["startupProbe", "livenessProbe", "readinessProbe"] {
        let get = &container[probe]["httpGet"];
        assert_eq!(get["port"], "admin", "{probe}");
        assert!(
            PROBE_PATHS.contains(&get["path"].as_str().unwrap()),
            "{probe}"
        );
    }
    assert_eq!(container["readinessProbe"]["httpGet"]["path"], "/readyz");
}

/// The configuration and every file it names are where a volume puts them; the logs and the review memory fit their volumes.
fn every_file_is_where_a_volume_puts_it(d: &Deployed<'_>) {
    let Deployed {
        config,
        container,
        mounts,
        ..
    } = *d;
    // The config file the container is started with is the one the ConfigMap mounts.
    let args = strings(&container["args"]);
    let config_path = args
        .iter()
        .position(|a| a == "--config")
        .map(|i| PathBuf::from(&args[i + 1]))
        .expect("--config argument");
    mounts.assert_file(&config_path);
    assert_eq!(config_path.file_name().unwrap(), "bulwark.yaml");

    // Every file of the configuration is where a volume puts it.
    mounts.assert_file(&config.listen.cert);
    mounts.assert_file(&config.listen.key);
    mounts.assert_file(config.listen.client_ca.as_ref().unwrap());
    mounts.assert_file(&config.upstream.ca);
    let front_proxy = config.upstream.front_proxy.as_ref().unwrap();
    mounts.assert_file(&front_proxy.cert);
    mounts.assert_file(&front_proxy.key);
    mounts.assert_file(config.upstream.own.token_file.as_ref().unwrap());
    // The on-call's token for /debug/* (on every address, the admin port needs one) comes
    // from a Secret something makes: the dev overlay generates it.
    mounts.assert_file(
        config
            .admin
            .token_file
            .as_ref()
            .expect("admin.tokenFile: /debug/* answers nobody without it"),
    );
    let rules = config.rules.folder.as_ref().unwrap();
    let rules_volume = mounts
        .volume_at(rules)
        .expect("the rules folder is mounted");
    assert_eq!(
        rules_volume["configMap"]["name"], "bulwark-rules",
        "the rules folder is the rules ConfigMap"
    );
    let audit_dir = config.audit.path.as_ref().unwrap().parent().unwrap();
    let audit_volume = mounts
        .volume_at(audit_dir)
        .expect("the audit log is mounted");
    assert!(
        audit_volume.get("emptyDir").is_some() || audit_volume.get("hostPath").is_some(),
        "the audit log needs a writable volume"
    );
    // The access log, sampled, beside it on the same volume.
    let access = config
        .access_log
        .as_ref()
        .expect("the deployment writes an access log");
    assert!(
        access.sample > 0.0 && access.sample < 1.0,
        "a sampled access log"
    );
    assert_eq!(
        mounts.volume_at(access.path.parent().unwrap()),
        Some(audit_volume),
        "the access log goes to the logs volume"
    );
    assert!(
        config.metrics.identities > 0,
        "the metrics name who is refused"
    );
    // The kubelet evicts the pod whose emptyDir passes its sizeLimit: the rotated logs in
    // it must fit at their largest, with a quarter to spare.
    if let Some(limit) = audit_volume["emptyDir"].get("sizeLimit") {
        let limit: Quantity = serde_json::from_value(limit.clone()).expect("a quantity");
        let logs = config.audit.max_disk_bytes() + access.max_disk_bytes();
        assert!(
            limit.0 >= logs + logs / 4,
            "the logs volume's sizeLimit ({} bytes) does not hold maxSize x (maxFiles + 1) \
             of the audit log and the access log = {logs} bytes with 25% to spare",
            limit.0
        );
    }

    // The prefixes trusted for token reviews outlive a restart only on a writable volume
    // apart from the read-only root, one the kubelet does not evict the pod over: the file
    // takes at most 64 bytes a remembered prefix, twice while it is rewritten.
    let review = &config.identity.token_review;
    let memory = review
        .memory_file
        .as_ref()
        .expect("the base keeps the prefixes trusted for token reviews");
    let state = mounts
        .volume_at(memory.parent().unwrap())
        .expect("the review memory's folder is mounted");
    assert!(
        state.get("emptyDir").is_some() || state.get("hostPath").is_some(),
        "the review memory needs a writable volume"
    );
    if let Some(limit) = state["emptyDir"].get("sizeLimit") {
        let limit: Quantity = serde_json::from_value(limit.clone()).expect("a quantity");
        let most = 2 * 64 * review.max_sources as u64;
        assert!(
            limit.0 >= most,
            "the state volume's sizeLimit ({} bytes) does not hold 2 x 64 x \
             identity.tokenReview.maxSources = {most} bytes",
            limit.0
        );
    }
}

/// The ServiceAccount's RBAC (reviews, the cache's reads, the fleet's Leases) and its FlowSchema.
fn the_service_account_s_rights_and_flow_schema(d: &Deployed<'_>) {
    let Deployed {
        objects,
        config,
        pod,
        ..
    } = *d;
    // The ServiceAccount, its RBAC and its FlowSchema.
    let sa_name = pod["serviceAccountName"].as_str().unwrap();
    let sa = object(objects, "ServiceAccount", sa_name);
    assert_ne!(sa["automountServiceAccountToken"], false);
    let binding = only(objects, "ClusterRoleBinding");
    assert_eq!(binding["subjects"][0]["kind"], "ServiceAccount");
    assert_eq!(binding["subjects"][0]["name"], sa_name);
    assert_eq!(binding["subjects"][0]["namespace"], "bulwark");
    let role = object(
        objects,
        "ClusterRole",
        binding["roleRef"]["name"].as_str().unwrap(),
    );
    let grants = |group: &str, resource: &str, verb: &str| {
        role["rules"].as_array().unwrap().iter().any(|r| {
            strings(&r["apiGroups"]).iter().any(|g| g == group)
                && strings(&r["resources"]).iter().any(|x| x == resource)
                && strings(&r["verbs"]).iter().any(|v| v == verb)
        })
    };
    assert!(grants("authentication.k8s.io", "tokenreviews", "create"));
    assert!(grants(
        "authorization.k8s.io",
        "subjectaccessreviews",
        "create"
    ));
    for cached in &config.cache.resources {
        for verb in ["list", "watch"] {
            assert!(
                grants(&cached.group, &cached.resource, verb),
                "RBAC: {verb} {cached} for the cache"
            );
        }
    }
    // The fleet's Leases: exactly get, list, watch, create and update, in its namespace,
    // through a Role bound to the same ServiceAccount.
    let fleet = config
        .fleet
        .as_ref()
        .expect("the deployment runs as a fleet");
    let lease_binding = objects
        .iter()
        .find(|o| {
            o["kind"] == "RoleBinding"
                && o["metadata"]["namespace"] == fleet.namespace.as_str()
                && o["subjects"][0]["name"] == sa_name
        })
        .expect("a RoleBinding for the fleet's Leases");
    assert_eq!(lease_binding["roleRef"]["kind"], "Role");
    let lease_role = object(
        objects,
        "Role",
        lease_binding["roleRef"]["name"].as_str().unwrap(),
    );
    assert_eq!(
        lease_role["metadata"]["namespace"],
        fleet.namespace.as_str()
    );
    let lease_rules = lease_role["rules"].as_array().unwrap();
    assert_eq!(lease_rules.len(), 1, "{lease_rules:?}");
    assert_eq!(
        strings(&lease_rules[0]["apiGroups"]),
        ["coordination.k8s.io"]
    );
    assert_eq!(strings(&lease_rules[0]["resources"]), ["leases"]);
    assert_eq!(
        strings(&lease_rules[0]["verbs"]),
        ["get", "list", "watch", "create", "update"]
    );
    let schema = only(objects, "FlowSchema");
    let covers_leases = schema["spec"]["rules"][0]["resourceRules"]
        .as_array()
        .unwrap()
        .iter()
        .any(|r| {
            strings(&r["apiGroups"]) == ["coordination.k8s.io"]
                && strings(&r["resources"]) == ["leases"]
                && strings(&r["namespaces"]).contains(&fleet.namespace)
                && ["get", "list", "create", "update"]
                    .iter()
                    .all(|v| strings(&r["verbs"]).iter().any(|x| x == v))
        });
    assert!(covers_leases, "the FlowSchema covers the fleet's Leases");
    let level = schema["spec"]["priorityLevelConfiguration"]["name"]
        .as_str()
        .unwrap();
    object(objects, "PriorityLevelConfiguration", level);
    let subject = &schema["spec"]["rules"][0]["subjects"][0];
    assert_eq!(subject["serviceAccount"]["name"], sa_name);
    assert_eq!(subject["serviceAccount"]["namespace"], "bulwark");
}

/// The disruption budget, the metrics Service and the ServiceMonitor select the pods; the PrometheusRule and the dashboard are the repository's.
fn monitoring_selects_the_pods(d: &Deployed<'_>) {
    let Deployed {
        objects,
        config,
        pod_labels,
        all,
        ..
    } = *d;
    // Disruption budget, metrics Service and ServiceMonitor select the pods.
    let pdb = only(objects, "PodDisruptionBudget");
    assert!(selects(&pdb["spec"]["selector"], pod_labels));
    let service = object(objects, "Service", "bulwark-metrics");
    assert!(selects(&service["spec"]["selector"], pod_labels));
    let service_port = &service["spec"]["ports"][0];
    assert_eq!(service_port["targetPort"], "admin");
    assert_eq!(
        service_port["port"],
        port_of(&config.admin.address),
        "Service port"
    );
    let monitor = only(objects, "ServiceMonitor");
    assert!(selects(
        &monitor["spec"]["selector"],
        &service["metadata"]["labels"]
    ));
    assert_eq!(
        monitor["spec"]["endpoints"][0]["port"],
        service_port["name"]
    );
    assert_eq!(monitor["spec"]["endpoints"][0]["path"], "/metrics");

    // The PrometheusRule carries exactly the rules file's groups.
    let rule = only(objects, "PrometheusRule");
    let file = yaml(&repo("deploy/prometheus/bulwark.rules.yml"));
    assert_eq!(
        rule["spec"]["groups"], file["groups"],
        "prometheusrule.yaml and bulwark.rules.yml differ"
    );
    assert!(
        all.generated
            .contains_key(&("ConfigMap".to_string(), "bulwark-dashboard".to_string())),
        "the dashboard ConfigMap"
    );
}

/// The paths the admin listener answers for probes.
const PROBE_PATHS: [&str; 3] = ["/healthz", "/livez", "/readyz"];

/// The container's volume mounts and what each volume holds.
struct Mounts<'a> {
    mounts: Vec<(PathBuf, &'a Value)>,
    generated: &'a BTreeMap<(String, String), BTreeSet<String>>,
    service_account: bool,
}

impl<'a> Mounts<'a> {
    fn new(pod: &'a Value, container: &'a Value, all: &'a Kustomized) -> Mounts<'a> {
        let volumes: BTreeMap<&str, &Value> = pod["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| (v["name"].as_str().unwrap(), v))
            .collect();
        let mounts = container["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| {
                let name = m["name"].as_str().unwrap();
                let volume = volumes
                    .get(name)
                    .unwrap_or_else(|| panic!("volumeMount {name} has no volume"));
                assert!(m.get("subPath").is_none(), "{name}: subPath stops updates");
                (PathBuf::from(m["mountPath"].as_str().unwrap()), *volume)
            })
            .collect();
        Mounts {
            mounts,
            generated: &all.generated,
            service_account: pod["automountServiceAccountToken"] != false,
        }
    }

    fn volume_at(&self, dir: &Path) -> Option<&'a Value> {
        self.mounts
            .iter()
            .find(|(at, _)| at == dir)
            .map(|(_, volume)| *volume)
    }

    /// The file is in a mounted ConfigMap or Secret that has that key, or in the
    /// ServiceAccount mount.
    fn assert_file(&self, path: &Path) {
        let dir = path.parent().unwrap();
        let key = path.file_name().unwrap().to_string_lossy().into_owned();
        if dir == Path::new("/var/run/secrets/kubernetes.io/serviceaccount") {
            assert!(
                self.service_account,
                "{}: the ServiceAccount token is not mounted",
                path.display()
            );
            assert!(["token", "ca.crt", "namespace"].contains(&key.as_str()));
            return;
        }
        let volume = self.volume_at(dir).unwrap_or_else(|| {
            panic!(
                "{}: no volume is mounted at {}",
                path.display(),
                dir.display()
            )
        });
        let (kind, name) = if let Some(name) = volume["configMap"]["name"].as_str() {
            ("ConfigMap", name)
        } else if let Some(name) = volume["secret"]["secretName"].as_str() {
            ("Secret", name)
        } else {
            panic!(
                "{}: volume {} holds no files",
                path.display(),
                volume["name"]
            );
        };
        let keys = self
            .generated
            .get(&(kind.to_string(), name.to_string()))
            .unwrap_or_else(|| panic!("{}: {kind} {name} is never made", path.display()));
        assert!(
            keys.contains(&key),
            "{}: {kind} {name} has no key {key} (it has {keys:?})",
            path.display()
        );
    }
}

// ---------------------------------------------------------------------------------------
// Metrics: the contract, a live scrape, the alerts and the dashboard

/// DESIGN.md's metrics table: `bulwark_NAME` → its labels.
fn contract() -> BTreeMap<String, BTreeSet<String>> {
    let design = read(&repo("docs/DESIGN.md"));
    let section = design
        .split("**Metrics**")
        .nth(1)
        .expect("DESIGN.md has a Metrics contract");
    let mut out = BTreeMap::new();
    for line in section.lines().skip_while(|l| !l.starts_with('|')) {
        if !line.starts_with('|') {
            break;
        }
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        let (names, labels) = (cells[1], cells[2]);
        if !names.starts_with('`') {
            continue;
        }
        // Label values in parentheses are documentation, not label names.
        let mut plain = String::new();
        let mut depth = 0;
        for c in labels.chars() {
            match c {
                '(' => depth += 1,
                ')' => depth -= 1,
                _ if depth == 0 => plain.push(c),
                _ => {}
            }
        }
        let labels: BTreeSet<String> = plain
            .split(',')
            .map(|l| l.trim().to_string())
            .filter(|l| !l.is_empty())
            .collect();
        for name in names.split('`').skip(1).step_by(2) {
            let name = name.split_whitespace().next().unwrap();
            out.insert(format!("bulwark_{name}"), labels.clone());
        }
    }
    assert!(out.len() >= 20, "the contract table was not found: {out:?}");
    out
}

/// Metric families in a Prometheus text exposition.
fn families(exposition: &str) -> BTreeSet<String> {
    exposition
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect()
}

/// A Bulwark in front of the simulator, after some traffic of each kind: served, refused,
/// token-authenticated. Its live `/metrics` text.
async fn live_scrape(cluster: &Cluster) -> String {
    let mut alice = cluster.client("alice", &[]).await;
    assert_eq!(
        alice.get("/api/v1/namespaces/default/secrets").await.status,
        200
    );
    assert_eq!(alice.get("/api/v1/pods").await.status, 403);
    let mut anonymous = cluster.anonymous_client().await;
    assert_eq!(anonymous.get("/api/v1/pods").await.status, 401);
    assert_eq!(
        anonymous
            .get_with_token("/api/v1/namespaces", GOOD_TOKEN)
            .await
            .status,
        200
    );
    let (status, body) = cluster.admin_get("/metrics").await;
    assert_eq!(status, 200);
    body
}

/// Metric names and the label names an expression uses, with the labels of `by`, `on`,
/// `ignoring` and `without` clauses.
struct Expression {
    metrics: Vec<String>,
    selector_labels: Vec<(String, String)>,
    grouping_labels: Vec<String>,
}

fn parse_expression(expr: &str) -> Expression {
    let bytes = expr.as_bytes();
    let is_ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    let mut out = Expression {
        metrics: Vec::new(),
        selector_labels: Vec::new(),
        grouping_labels: Vec::new(),
    };
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'"' {
            // Skip string literals: label values are not names.
            i += 1;
            while i < bytes.len() && bytes[i] != b'"' {
                i += if bytes[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
            continue;
        }
        if !is_ident(bytes[i]) || (i > 0 && is_ident(bytes[i - 1])) {
            i += 1;
            continue;
        }
        let start = i;
        while i < bytes.len() && is_ident(bytes[i]) {
            i += 1;
        }
        let word = &expr[start..i];
        let rest = expr[i..].trim_start();
        if word.starts_with("bulwark_") {
            out.metrics.push(word.to_string());
            if let Some(body) = rest.strip_prefix('{') {
                let end = body.find('}').expect("closed selector");
                for matcher in split_outside_quotes(&body[..end]) {
                    let name: String = matcher
                        .trim()
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                        .collect();
                    if !name.is_empty() {
                        out.selector_labels.push((word.to_string(), name));
                    }
                }
            }
        } else if ["by", "on", "ignoring", "without"].contains(&word) && rest.starts_with('(') {
            let end = rest.find(')').expect("closed grouping");
            out.grouping_labels.extend(
                rest[1..end]
                    .split(',')
                    .map(|l| l.trim().to_string())
                    .filter(|l| !l.is_empty()),
            );
        }
    }
    out
}

fn split_outside_quotes(s: &str) -> Vec<String> {
    let mut parts = vec![String::new()];
    let mut quoted = false;
    for c in s.chars() {
        match c {
            '"' => {
                quoted = !quoted;
                parts.last_mut().unwrap().push(c);
            }
            ',' if !quoted => parts.push(String::new()),
            _ => parts.last_mut().unwrap().push(c),
        }
    }
    parts
}

/// The family a series name belongs to (histogram series end in _bucket, _sum, _count).
fn family_of<'a>(name: &'a str, known: &BTreeMap<String, BTreeSet<String>>) -> &'a str {
    if known.contains_key(name) {
        return name;
    }
    for suffix in ["_bucket", "_sum", "_count"] {
        if let Some(base) = name.strip_suffix(suffix)
            && known.contains_key(base)
        {
            return base;
        }
    }
    name
}

/// Metrics that expressions may use beside Bulwark's: the apiservers' (`apiserver_*`, and
/// `process_*` under their job), the process metrics Bulwark exports without its prefix, and
/// Prometheus's own `up` of a scrape target.
const FOREIGN_METRICS: [&str; 3] = ["apiserver_", "process_", "up{"];

/// Every metric of the expression is exported (live or by contract) and every label it
/// names belongs to one of its metrics (or is a target label Prometheus adds).
fn check_expression(
    what: &str,
    expr: &str,
    exported: &BTreeMap<String, BTreeSet<String>>,
) -> Vec<String> {
    const TARGET_LABELS: [&str; 2] = ["job", "instance"];
    let parsed = parse_expression(expr);
    let mut problems = Vec::new();
    if parsed.metrics.is_empty() {
        // The apiservers' own metrics (the dashboard's apiserver row) and the scrape's `up`
        // are not Bulwark's to check; the live Prometheus check parses them.
        if !FOREIGN_METRICS.iter().any(|prefix| expr.contains(prefix)) {
            problems.push(format!("{what}: no Bulwark metric in {expr:?}"));
        }
        return problems;
    }
    let mut labels: BTreeSet<String> = TARGET_LABELS.iter().map(|s| s.to_string()).collect();
    for metric in &parsed.metrics {
        let family = family_of(metric, exported);
        match exported.get(family) {
            Some(l) => labels.extend(l.iter().cloned()),
            None => problems.push(format!("{what}: {metric} is not a metric Bulwark exports")),
        }
        if metric.ends_with("_bucket") {
            labels.insert("le".into());
        }
    }
    for (metric, label) in &parsed.selector_labels {
        let family = family_of(metric, exported);
        let own = exported.get(family).cloned().unwrap_or_default();
        let bucket_bound = label == "le" && metric.ends_with("_bucket");
        if !own.contains(label) && !TARGET_LABELS.contains(&label.as_str()) && !bucket_bound {
            problems.push(format!("{what}: {metric} has no label {label}"));
        }
    }
    for label in &parsed.grouping_labels {
        if !labels.contains(label) {
            problems.push(format!(
                "{what}: no metric of the expression has label {label}"
            ));
        }
    }
    problems
}

/// Every alert expression of the rules file.
fn alert_expressions() -> Vec<(String, String)> {
    let file = yaml(&repo("deploy/prometheus/bulwark.rules.yml"));
    file["groups"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_array().unwrap().iter())
        .map(|r| {
            (
                r["alert"].as_str().unwrap().to_string(),
                r["expr"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

fn dashboard() -> Value {
    serde_json::from_str(&read(&repo("deploy/grafana/bulwark.json"))).expect("dashboard JSON")
}

/// Every (panel title, expression) of the dashboard, rows included.
fn dashboard_expressions(dashboard: &Value) -> Vec<(String, String)> {
    fn walk(panels: &Value, out: &mut Vec<(String, String)>) {
        for panel in panels.as_array().into_iter().flatten() {
            for target in panel["targets"].as_array().into_iter().flatten() {
                out.push((
                    panel["title"].as_str().unwrap_or("?").to_string(),
                    target["expr"].as_str().unwrap_or_default().to_string(),
                ));
            }
            walk(&panel["panels"], out);
        }
    }
    let mut out = Vec::new();
    walk(&dashboard["panels"], &mut out);
    for annotation in dashboard["annotations"]["list"]
        .as_array()
        .into_iter()
        .flatten()
    {
        if let Some(expr) = annotation["expr"].as_str() {
            out.push((
                format!("annotation {}", annotation["name"].as_str().unwrap_or("?")),
                expr.to_string(),
            ));
        }
    }
    out
}

/// An expression as Grafana runs it: its variables replaced by what they stand for (all
/// values of each).
fn substitute_variables(expr: &str) -> String {
    expr.replace("$__rate_interval", "5m")
        .replace("$job", ".*")
        .replace("$instance", ".*")
        .replace("$rule", ".*")
        .replace("$level", ".*")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_and_alerts_use_only_metrics_bulwark_exports() {
    let cluster = Cluster::start(Setup::default()).await;
    let scrape = live_scrape(&cluster).await;
    let live = families(&scrape);
    let mut contract = contract();
    // Beyond the contract: the per-rule request counter, the denominator of the
    // rejection-share alert.
    contract.insert(
        "bulwark_rule_requests_total".into(),
        ["rule", "level"].map(String::from).into(),
    );
    // What Bulwark exports: the live scrape, plus contract metrics that only appear once
    // their stage has something to count. Live metrics must be in the contract too, so a
    // renamed metric in the code fails here before it breaks a dashboard.
    for name in &live {
        if name.starts_with("bulwark_") {
            assert!(
                contract.contains_key(name),
                "{name} is exported but not in DESIGN.md's contract"
            );
        }
    }
    for name in [
        "bulwark_requests_total",
        "bulwark_request_duration_seconds",
        "bulwark_rejected_requests_total",
        "bulwark_upstream_responses_total",
        "bulwark_upstream_healthy",
    ] {
        assert!(live.contains(name), "{name} missing from a live scrape");
    }
    let exported = contract;

    let dashboard = dashboard();
    let expressions = dashboard_expressions(&dashboard);
    assert!(expressions.len() >= 10, "{expressions:?}");
    let mut problems = Vec::new();
    for (title, expr) in &expressions {
        problems.extend(check_expression(
            &format!("panel {title:?}"),
            expr,
            &exported,
        ));
    }
    for (alert, expr) in alert_expressions() {
        problems.extend(check_expression(
            &format!("alert {alert}"),
            &expr,
            &exported,
        ));
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));

    // What the issue asks the dashboard to show.
    let all: String = expressions
        .iter()
        .map(|(_, e)| e.as_str())
        .collect::<Vec<_>>()
        .join("\n");
    for needle in [
        "by (served_by) (rate(bulwark_requests_total",
        "by (rule, reason) (rate(bulwark_rejected_requests_total",
        "code_class=\"5xx\"",
        "bulwark_queue_wait_seconds_bucket",
        "bulwark_level_executing_seats",
        "result=\"hit\"",
        "bulwark_cache_lag_seconds",
        "by (replica) (rate(bulwark_upstream_responses_total",
        // Who is throttled and why; reloads on the time axis.
        "by (identity, reason) (rate(bulwark_identity_rejections_total",
        "rule=~\"$rule\", level=~\"$level\"",
        "increase(bulwark_rules_reload_total",
        // Is an apiserver about to fall over, beside Bulwark's view of each replica.
        "apiserver_flowcontrol_current_inqueue_requests",
        "apiserver_flowcontrol_rejected_requests_total",
        "process_resident_memory_bytes{job=\"apiserver\"}",
        "apiserver_current_inflight_requests",
        "by (replica) (bulwark_upstream_in_flight",
    ] {
        assert!(all.contains(needle), "the dashboard lacks {needle}");
    }
    let variables: Vec<&str> = dashboard["templating"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v["name"].as_str())
        .collect();
    for name in ["rule", "level"] {
        assert!(
            variables.contains(&name),
            "no {name} variable: {variables:?}"
        );
    }
}

#[test]
fn the_dashboard_datasource_is_a_variable() {
    let dashboard = dashboard();
    let variables = dashboard["templating"]["list"].as_array().unwrap();
    let datasource = variables
        .iter()
        .find(|v| v["type"] == "datasource")
        .expect("a datasource variable");
    assert_eq!(datasource["query"], "prometheus");
    let reference = format!("${{{}}}", datasource["name"].as_str().unwrap());
    fn walk(panels: &Value, reference: &str) {
        for panel in panels.as_array().into_iter().flatten() {
            if panel["type"] != "row" {
                assert_eq!(panel["datasource"]["uid"], reference, "{}", panel["title"]);
                for target in panel["targets"].as_array().unwrap() {
                    assert_eq!(target["datasource"]["uid"], reference, "{}", panel["title"]);
                }
            }
            walk(&panel["panels"], reference);
        }
    }
    walk(&dashboard["panels"], &reference);
}

#[test]
fn expression_checks_catch_unknown_metrics_and_labels() {
    let contract = contract();
    assert!(
        check_expression(
            "ok",
            "sum by (rule) (rate(bulwark_rejected_requests_total{reason=\"a,b\"}[5m]))",
            &contract
        )
        .is_empty()
    );
    let problems = check_expression(
        "bad",
        "sum by (rul) (rate(bulwark_rejected_request_total{reasn=\"x\"}[5m])) + bulwark_queue_wait_seconds_bucket{le=\"1\"}",
        &contract,
    );
    assert_eq!(problems.len(), 3, "{problems:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_paths_answer_on_the_admin_listener() {
    let cluster = Cluster::start(Setup::default()).await;
    let ds = yaml_docs(&repo("deploy/base/daemonset.yaml"));
    let container = &ds[0]["spec"]["template"]["spec"]["containers"][0];
    // The upstream probes make the replicas healthy shortly after start.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    for probe in ["startupProbe", "livenessProbe", "readinessProbe"] {
        let path = container[probe]["httpGet"]["path"].as_str().unwrap();
        loop {
            let (status, body) = cluster.admin_get(path).await;
            if status == 200 {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{probe} {path}: {status} {body}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

// ---------------------------------------------------------------------------------------
// promtool

/// promtool, or `None` (with a note) when it is not installed and not required.
fn promtool() -> Option<PathBuf> {
    bulwark_testkit::tools::find("promtool", "apt-get install prometheus")
}

fn run_promtool(promtool: &Path, args: &[&str], stdin: &str) -> (bool, String) {
    use std::io::Write as _;
    let mut child = std::process::Command::new(promtool)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool runs");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn promtool_check_metrics_passes_on_a_live_scrape() {
    let Some(promtool) = promtool() else { return };
    let cluster = Cluster::start(Setup::default()).await;
    let scrape = live_scrape(&cluster).await;
    let (ok, output) = run_promtool(&promtool, &["check", "metrics"], &scrape);
    assert!(
        ok,
        "promtool check metrics:\n{output}\n--- scrape:\n{scrape}"
    );
    // And promtool is not a rubber stamp: a counter without _total is refused.
    let bad = "# HELP bulwark_things Things.\n# TYPE bulwark_things counter\nbulwark_things 1\n";
    assert!(!run_promtool(&promtool, &["check", "metrics"], bad).0);
}

#[test]
fn promtool_accepts_every_dashboard_expression() {
    let Some(promtool) = promtool() else { return };
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, (_, expr)) in dashboard_expressions(&dashboard()).iter().enumerate() {
        // Grafana's variables, as Grafana substitutes them.
        let expr = substitute_variables(expr);
        rules.push_str(&format!(
            "      - record: dashboard:panel_{i}\n        expr: {}\n",
            serde_json::to_string(&expr).unwrap()
        ));
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("dashboard.rules.yml");
    std::fs::write(&path, rules).unwrap();
    let (ok, output) = run_promtool(&promtool, &["check", "rules", path.to_str().unwrap()], "");
    assert!(ok, "{output}");
}

/// Each alert links to its own section of docs/runbooks.md, which says why its severity is
/// what it is, and the promtool tests show it both firing and staying quiet.
#[test]
fn every_alert_has_a_runbook_a_deliberate_severity_and_tests_both_ways() {
    let runbooks = read(&repo("docs/runbooks.md"));
    let sections: BTreeMap<&str, &str> = runbooks
        .split("\n## ")
        .skip(1)
        .map(|section| section.split_once('\n').unwrap_or((section, "")))
        .collect();
    let file = yaml(&repo("deploy/prometheus/bulwark.rules.yml"));
    let tests = yaml(&repo("deploy/prometheus/bulwark.rules.test.yml"));
    let cases: Vec<&Value> = tests["tests"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|t| t["alert_rule_test"].as_array().unwrap().iter())
        .collect();
    let mut names = BTreeSet::new();
    for rule in file["groups"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_array().unwrap().iter())
    {
        let alert = rule["alert"].as_str().unwrap();
        names.insert(alert);
        let url = rule["annotations"]["runbook_url"].as_str().unwrap_or("");
        assert!(
            url.ends_with(&format!("/docs/runbooks.md#{}", alert.to_lowercase())),
            "{alert}: runbook_url {url:?}"
        );
        let section = sections
            .get(alert)
            .unwrap_or_else(|| panic!("docs/runbooks.md has no section ## {alert}"));
        let severity = rule["labels"]["severity"].as_str().unwrap();
        assert!(
            ["critical", "warning", "info"].contains(&severity),
            "{alert}: severity {severity}"
        );
        assert!(
            section.contains(&format!("**Severity: {severity}.**")),
            "{alert}: its runbook does not say why it is {severity}"
        );
        for part in ["**Means.**", "**Fix.**"] {
            assert!(section.contains(part), "{alert}: runbook lacks {part}");
        }
        let of_alert = || cases.iter().filter(|c| c["alertname"] == alert);
        assert!(
            of_alert().any(|c| c["exp_alerts"].as_array().is_some_and(|a| !a.is_empty())),
            "{alert}: no promtool test shows it firing"
        );
        assert!(
            of_alert().any(|c| c["exp_alerts"].as_array().is_none_or(|a| a.is_empty())),
            "{alert}: no promtool test shows it quiet"
        );
    }
    for section in sections.keys() {
        assert!(names.contains(section), "runbook for no alert: {section}");
    }
    // What the on-call needs alerts for, beyond rejections and the upstreams.
    for alert in [
        "BulwarkDown",
        "BulwarkAbsent",
        "BulwarkCertificateExpiringSoon",
        "BulwarkCertificateExpiryImminent",
        "BulwarkErrorsHigh",
        "BulwarkSelfProtectionRefusals",
        "BulwarkListBudgetSaturated",
        "BulwarkMemoryNearLimit",
    ] {
        assert!(names.contains(alert), "no alert {alert}");
    }
}

/// GET `path` from a plain-HTTP server at `base` (`http://host:port`): status and body.
fn http_get(base: &str, path: &str) -> (u16, String) {
    use std::io::{Read as _, Write as _};
    let address = base.trim_start_matches("http://").trim_end_matches('/');
    let mut stream = std::net::TcpStream::connect(address).expect("connect to Prometheus");
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    write!(
        stream,
        "GET {path} HTTP/1.0\r\nHost: {address}\r\nAccept: application/json\r\n\r\n"
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, body.to_string())
}

/// Every panel's and annotation's query, and every alert's expression, runs on a live
/// Prometheus that scrapes a live Bulwark (fire-test.sh sets BULWARK_PROMETHEUS_URL): an
/// empty result is fine, an error (a parse error, a bad regex, many-to-many matching) is
/// not.
#[test]
fn dashboard_and_alert_queries_run_on_a_live_prometheus() {
    use std::io::Write as _;
    let Ok(base) = std::env::var("BULWARK_PROMETHEUS_URL") else {
        // Only deploy/prometheus/fire-test.sh, which starts that Prometheus, runs it for real.
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED dashboard_and_alert_queries_run_on_a_live_prometheus: BULWARK_PROMETHEUS_URL is not set (deploy/prometheus/fire-test.sh sets it)"
        );
        return;
    };
    let mut queries: Vec<(String, String)> = dashboard_expressions(&dashboard())
        .into_iter()
        .map(|(title, expr)| (format!("panel {title:?}"), substitute_variables(&expr)))
        .collect();
    queries.extend(
        alert_expressions()
            .into_iter()
            .map(|(alert, expr)| (format!("alert {alert}"), expr)),
    );
    let mut problems = Vec::new();
    let mut with_data = 0;
    for (what, expr) in &queries {
        let path = format!(
            "/api/v1/query?query={}",
            percent_encoding::utf8_percent_encode(expr, percent_encoding::NON_ALPHANUMERIC)
        );
        let (status, body) = http_get(&base, &path);
        let answer: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
        if status != 200 || answer["status"] != "success" {
            problems.push(format!("{what}: {status} {body}\n  query: {expr}"));
        } else if answer["data"]["result"]
            .as_array()
            .is_some_and(|r| !r.is_empty())
        {
            with_data += 1;
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    eprintln!(
        "{} queries ran on {base}, {with_data} with data",
        queries.len()
    );
    // Prometheus does refuse a broken query: the check is not a rubber stamp.
    let (status, _) = http_get(&base, "/api/v1/query?query=sum%20by%20(");
    assert_eq!(status, 400);
}

// ---------------------------------------------------------------------------------------
// Certificates from `certs init`, used by real clients

static CERTS_DIR: OnceLock<PathBuf> = OnceLock::new();

/// Serves clients with the serving certificate and client CA that `certs init` minted.
fn use_minted_certificates(config: &mut Config) {
    let dir = CERTS_DIR.get().expect("certs minted before start");
    config.listen.cert = dir.join("bulwark.crt");
    config.listen.key = dir.join("bulwark.key");
    config.listen.client_ca = Some(dir.join("client-ca.crt"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn minted_kubeconfigs_work_through_bulwark() {
    use k8s_openapi::api::core::v1::Secret;
    use kube::api::{Api, ListParams};
    use kube::config::{KubeConfigOptions, Kubeconfig};

    let dir = tempfile::tempdir().unwrap();
    let mut options = bulwark::certs::InitOptions::new(dir.path(), &["127.0.0.1", "localhost"]);
    bulwark::certs::init(&options).expect("certs init");
    CERTS_DIR.set(dir.path().to_path_buf()).unwrap();
    let cluster = Cluster::start(Setup {
        seed: vec!["secrets=3x1KiB@team"],
        tweak: use_minted_certificates,
        ..Setup::default()
    })
    .await;

    // Now that Bulwark's port is known: kubeconfigs pointing at it (the CAs are reused).
    options.server = Some(format!("https://{}", cluster.bulwark.addr));
    options.identities = vec![
        "alice:dev".parse().unwrap(),
        "mallory:system:masters".parse().unwrap(),
    ];
    bulwark::certs::init(&options).expect("certs init again");
    let client = |user: &str| {
        let path = dir.path().join(format!("kubeconfig-{user}"));
        async move {
            let kubeconfig = Kubeconfig::read_from(&path).expect("kubeconfig parses");
            let config =
                kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
                    .await
                    .expect("kube config");
            kube::Client::try_from(config).expect("kube client")
        }
    };
    let secrets: Api<Secret> = Api::namespaced(client("alice").await, "team");
    let listed = secrets
        .list(&ListParams::default())
        .await
        .expect("alice lists secrets");
    assert_eq!(listed.items.len(), 3);

    // Whoever holds the CA Bulwark trusts for clients can mint any identity, and Bulwark
    // forwards it with its front-proxy certificate: a certificate claiming system:masters
    // gets the apiserver's full power. This is why listen.clientCA must be the cluster's
    // own client CA (or one the apiserver already trusts) — then no new power is minted
    // (certs/README.md).
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client("mallory").await);
    nodes
        .list(&ListParams::default())
        .await
        .expect("a system:masters certificate from the trusted CA is all-powerful");
}

// ---------------------------------------------------------------------------------------
// Logs

/// Secret data written and read through Bulwark, in plain text.
const SECRET_VALUE: &str = "correct-horse-battery-staple-4711";

// Over 120 lines: one Bulwark taken through every request that could leak, then every log
// it wrote searched for each secret.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_and_audit_log_hold_no_token_key_or_secret_data() {
    use base64::Engine as _;
    let cluster = Cluster::start(Setup::default()).await;
    // Bulwark as deployed, in a process of its own: the built-in rules and the cache on.
    let mut process = cluster.process_config();
    process.rules = None;
    process.cache = true;
    process.shutdown = (Duration::ZERO, Duration::from_secs(1));
    let config = cluster.dir().join("logs.yaml");
    process.write(&config).unwrap();
    let pki = &cluster.pki;
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_bulwark"))
        .args(["--log-format", "json", "serve", "--config"])
        .arg(&config)
        // Everything logged, at every level, by Bulwark and the libraries it uses.
        .env("RUST_LOG", "trace")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("bulwark starts");
    let mut stderr = child.stderr.take().unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let logs = tokio::spawn(async move {
        let mut out = Vec::new();
        let _ = stderr.read_to_end(&mut out).await;
        let _ = stdout.read_to_end(&mut out).await;
        out
    });
    let addr = process.listen;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while admin_get(process.admin, "/readyz").await.map(|r| r.0) != Some(200) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "bulwark never ready"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Secret data goes in and out through Bulwark; tokens good and bad; refusals.
    let secret_b64 = base64::engine::general_purpose::STANDARD.encode(SECRET_VALUE);
    let alice_cert = pki.client_ca.client_cert("alice", &[]);
    let mut alice = Client::connect(addr, pki, Some(&alice_cert)).await;
    let body = serde_json::json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "db-password", "namespace": "default"},
        "data": {"password": secret_b64},
    });
    let create = post_json("/api/v1/namespaces/default/secrets", &body);
    assert_eq!(alice.send(create).await.status, 201);
    let got = alice
        .get("/api/v1/namespaces/default/secrets/db-password")
        .await;
    assert_eq!(got.status, 200);
    assert!(String::from_utf8_lossy(&got.body).contains(&secret_b64));
    let listed = alice.get("/api/v1/namespaces/default/secrets").await;
    assert!(String::from_utf8_lossy(&listed.body).contains(&secret_b64));
    // The same Secret answered by Bulwark's cache (which writes the audit log) once its
    // informer has seen the create.
    let cached = "/api/v1/namespaces/default/secrets/db-password?resourceVersion=0";
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let got = alice.get(cached).await;
        if got.status == 200 {
            assert!(String::from_utf8_lossy(&got.body).contains(&secret_b64));
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the cache never had the Secret: {}",
            got.status
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut anonymous = Client::connect(addr, pki, None).await;
    for (token, path, expected) in [
        (GOOD_TOKEN, "/api/v1/namespaces/default/secrets", 200),
        (GOOD_TOKEN, "/api/v1/secrets?resourceVersion=0", 200),
        (BAD_TOKEN, "/api/v1/namespaces/default/secrets", 401),
    ] {
        let answer = anonymous.send(with_token(get(path), token)).await;
        assert_eq!(answer.status, expected, "{token} {path}");
        if expected == 200 {
            assert!(String::from_utf8_lossy(&answer.body).contains(&secret_b64));
        }
    }
    assert_eq!(anonymous.get("/api/v1/secrets").await.status, 401);
    let bad_path = alice.get("/api/v1/namespaces/default/secrets/%2E%2E").await;
    assert_eq!(bad_path.status, 400);

    drop(alice);
    drop(anonymous);
    child.start_kill().unwrap();
    let _ = child.wait().await;
    let logs = String::from_utf8(logs.await.unwrap()).expect("UTF-8 logs");
    let audit = std::fs::read_to_string(process.audit.as_ref().unwrap()).unwrap_or_default();

    // Structured: every line is a JSON object; refusals are logged with their reason.
    let lines: Vec<Value> = logs
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    assert!(lines.len() > 5, "{logs}");
    assert!(
        lines
            .iter()
            .any(|l| l["fields"]["reason"] == "unauthenticated"),
        "no refusal logged with its reason:\n{logs}"
    );

    // The cached reads are in the audit log, by user, with what was read and no data.
    let events: Vec<Value> = audit
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let audited = |user: &str, verb: &str| {
        events.iter().any(|e| {
            e["user"]["username"] == user
                && e["verb"] == verb
                && e["objectRef"]["resource"] == "secrets"
        })
    };
    assert!(
        audited("alice", "get"),
        "alice's cached get is not audited:\n{audit}"
    );
    assert!(
        audited("tina", "list"),
        "tina's cached list is not audited:\n{audit}"
    );

    // Never a token, a key or Secret data.
    let key_material = |pem: &str| -> Vec<String> {
        pem.lines()
            .filter(|l| !l.starts_with("-----"))
            .map(|l| l.chars().take(40).collect())
            .collect()
    };
    let mut forbidden: Vec<(String, String)> = vec![
        ("the good token".into(), GOOD_TOKEN.into()),
        ("the bad token".into(), BAD_TOKEN.into()),
        ("a PEM key".into(), "PRIVATE KEY".into()),
        ("the Secret's value".into(), SECRET_VALUE.into()),
        ("the Secret's value, base64".into(), secret_b64.clone()),
    ];
    let keys = &process.credentials;
    let read = |path: &std::path::Path| std::fs::read_to_string(path).unwrap();
    for (what, pem) in [
        ("the serving key", read(&keys.serving.1)),
        ("the front-proxy key", read(&keys.front_proxy.1)),
        ("Bulwark's own key", read(&keys.own.1)),
        ("alice's key", alice_cert.key_pem.clone()),
    ] {
        for line in key_material(&pem) {
            forbidden.push((what.to_string(), line));
        }
    }
    for (name, text) in [("log", &logs), ("audit log", &audit)] {
        for (what, needle) in &forbidden {
            assert!(
                !text.contains(needle.as_str()),
                "the {name} contains {what}"
            );
        }
    }
}

#[test]
fn the_fleet_s_namespace_with_the_front_proxy_key_is_never_cached() {
    // The front-proxy key can assert any user: its Secret lives in the fleet's namespace,
    // and a cache holding that namespace would keep a copy and answer it to whoever may
    // read Secrets there.
    let config = deploy_config();
    let fleet = config.fleet.as_ref().expect("the base runs a fleet");
    assert!(
        config.cache.exclude_namespaces.contains(&fleet.namespace),
        "deploy/base caches {}: {:?}",
        fleet.namespace,
        config.cache.exclude_namespaces
    );
    let daemonset = read(&repo("deploy/base/daemonset.yaml"));
    assert!(daemonset.contains("secretName: bulwark-front-proxy"));
    let namespace = yaml(&repo("deploy/base/namespace.yaml"));
    assert_eq!(namespace["metadata"]["name"], fleet.namespace.as_str());
}

// ---------------------------------------------------------------------------------------
// The load balancer: deploy/README.md's haproxy lines, run

/// haproxy, or `None` where it is not on PATH (the test reported skipped).
fn haproxy() -> Option<PathBuf> {
    bulwark_testkit::tools::find("haproxy", "apt-get install haproxy")
}

/// The haproxy configuration deploy/README.md gives, exactly: the code block after "In
/// haproxy".
fn readme_haproxy_lines() -> String {
    let readme = read(&repo("deploy/README.md"));
    let after = readme
        .split_once("In haproxy")
        .expect("deploy/README.md shows haproxy's configuration")
        .1;
    let block = after
        .split_once("```\n")
        .expect("a code block")
        .1
        .split_once("```")
        .expect("the block ends")
        .0;
    block
        .lines()
        .map(|l| l.trim_start().to_string() + "\n")
        .collect()
}

/// `text` with `from` replaced by `to`, which must be there.
fn substituted(text: &str, from: &str, to: &str) -> String {
    assert!(text.contains(from), "no {from:?} in:\n{text}");
    text.replace(from, to)
}

/// Each server of haproxy's stats (`show stat` on its socket) as backend/server → column →
/// value.
async fn haproxy_servers(socket: &Path) -> BTreeMap<String, BTreeMap<String, String>> {
    use tokio::io::AsyncWriteExt as _;
    let Ok(mut stream) = tokio::net::UnixStream::connect(socket).await else {
        return BTreeMap::new();
    };
    stream.write_all(b"show stat\n").await.unwrap();
    let mut csv = String::new();
    stream.read_to_string(&mut csv).await.unwrap();
    let mut lines = csv.lines();
    let header: Vec<&str> = lines
        .next()
        .unwrap_or_default()
        .trim_start_matches("# ")
        .split(',')
        .collect();
    lines
        .filter(|line| !line.trim().is_empty())
        .map(|line| {
            header
                .iter()
                .zip(line.split(','))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<BTreeMap<_, _>>()
        })
        .filter(|row| !["FRONTEND", "BACKEND"].contains(&row["svname"].as_str()))
        .map(|row| (format!("{}/{}", row["pxname"], row["svname"]), row))
        .collect()
}

/// The README's haproxy lines, run against a Bulwark in the deployed shape (HTTPS admin
/// port, the PROXY protocol required from the balancer): every server's health check
/// passes and a client reaches Bulwark through the frontend. The same lines with a
/// plain-HTTP check, as the README had them, fail theirs.
// Over 120 lines: the README's haproxy lines run as written, every server seen UP, then the
// old plain-HTTP check seen DOWN against the same Bulwark.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_s_haproxy_lines_health_check_bulwark_s_https_admin_port() {
    let Some(haproxy) = haproxy() else { return };
    let cluster = Cluster::start(Setup {
        replicas: 1,
        settings: vec![(
            "listen.proxyProtocol",
            "{trustedSources: [127.0.0.1/32], required: true}",
        )],
        tweak: |config| {
            config.admin.tls = Some(bulwark::config::AdminTls {
                cert: config.listen.cert.clone(),
                key: config.listen.key.clone(),
            });
        },
        ..Setup::default()
    })
    .await
    .ready()
    .await;
    let dir = cluster.dir();
    let ca = dir.join("serving-ca.crt");
    std::fs::write(&ca, cluster.pki.server_ca.cert_pem()).unwrap();
    let front = bulwark_testkit::free_addr();
    let bulwark = cluster.bulwark.addr.to_string();
    let admin_port = cluster.bulwark.admin_addr.port().to_string();

    // The README's lines with this test's addresses, names and files.
    let mut lines = readme_haproxy_lines();
    lines = substituted(&lines, "bind :443", &format!("bind {front}"));
    for node in ["10.0.0.11:7443", "10.0.0.12:7443", "10.0.0.13:7443"] {
        lines = substituted(&lines, node, &bulwark);
    }
    lines = substituted(&lines, "port 9443", &format!("port {admin_port}"));
    lines = substituted(
        &lines,
        "/etc/haproxy/bulwark-serving-ca.crt",
        ca.to_str().unwrap(),
    );
    // The serving certificate's name here.
    lines = substituted(&lines, "bulwark.example.com", "localhost");
    // The same backend checked in plain HTTP, as the README had it.
    let plain = lines
        .split_once("\nbackend bulwark\n")
        .expect("the backend")
        .1
        .lines()
        .map(|l| {
            if l.starts_with("default-server") {
                format!("default-server check port {admin_port}\n")
            } else {
                format!("{l}\n")
            }
        })
        .collect::<String>();
    let socket = dir.join("haproxy.sock");
    let config = format!(
        "global\n  stats socket {} mode 600 level admin\n\
         defaults\n  timeout connect 2s\n  timeout client 30s\n  timeout server 30s\n\
         {lines}backend plain-http\n{plain}",
        socket.display()
    );
    let path = dir.join("haproxy.cfg");
    std::fs::write(&path, &config).unwrap();
    let checked = std::process::Command::new(&haproxy)
        .arg("-c")
        .arg("-f")
        .arg(&path)
        .output()
        .unwrap();
    assert!(
        checked.status.success(),
        "haproxy -c refuses the README's lines:\n{}{}\n{config}",
        String::from_utf8_lossy(&checked.stdout),
        String::from_utf8_lossy(&checked.stderr)
    );
    let _haproxy = tokio::process::Command::new(&haproxy)
        .arg("-db")
        .arg("-f")
        .arg(&path)
        .kill_on_drop(true)
        .spawn()
        .unwrap();

    // Every server's first check has a result (haproxy starts them UP and checks every 2 s).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let servers = loop {
        let servers = haproxy_servers(&socket).await;
        let checked = |row: &BTreeMap<String, String>| {
            !row["check_status"].is_empty() && !row["check_status"].starts_with("INI")
        };
        if servers.len() == 6 && servers.values().all(checked) {
            break servers;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "haproxy's checks never ran: {servers:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    for server in ["cp1", "cp2", "cp3"] {
        let row = &servers[&format!("bulwark/{server}")];
        assert_eq!(
            (row["status"].as_str(), row["check_status"].as_str()),
            ("UP", "L7OK"),
            "{server}: {row:?}"
        );
        let row = &servers[&format!("plain-http/{server}")];
        assert_ne!(
            row["check_status"], "L7OK",
            "a plain-HTTP check of the HTTPS admin port passed: {row:?}"
        );
    }

    // A client through the frontend reaches Bulwark, which takes haproxy's PROXY header.
    let tcp = bulwark_testkit::tcp_from([127, 0, 0, 2].into(), front)
        .await
        .unwrap();
    let cert = cluster.pki.client_ca.client_cert("carol", &[]);
    let mut client = Client::over(tcp, &cluster.pki, Some(&cert))
        .await
        .expect("TLS through haproxy");
    let answer = client.get("/api/v1/namespaces/default/configmaps").await;
    assert_eq!(answer.status, 200, "{}", answer.text());
}

// ---------------------------------------------------------------------------------------
// deploy/README.md's alert table

/// The alert table lists exactly the alerts of the rules file, each with its severity, and
/// names unit tests that exist and show it firing (or, marked "quiet:", staying quiet).
#[test]
fn the_readme_s_alert_table_lists_every_alert_with_its_severity_and_tests() {
    let readme = read(&repo("deploy/README.md"));
    let table = readme
        .split_once("| alert | fires when | severity |")
        .expect("deploy/README.md has the alert table")
        .1;
    let rows: Vec<Vec<String>> = table
        .lines()
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .map(|l| {
            l.trim_matches('|')
                .split(" | ")
                .map(|c| c.trim().to_string())
                .collect()
        })
        .collect();
    let file = yaml(&repo("deploy/prometheus/bulwark.rules.yml"));
    let severities: BTreeMap<String, String> = file["groups"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_array().unwrap().iter())
        .filter_map(|r| {
            Some((
                r["alert"].as_str()?.to_string(),
                r["labels"]["severity"].as_str()?.to_string(),
            ))
        })
        .collect();
    let tests = yaml(&repo("deploy/prometheus/bulwark.rules.test.yml"));
    let groups: BTreeMap<&str, &Value> = tests["tests"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| (t["name"].as_str().unwrap(), t))
        .collect();

    let listed: Vec<String> = rows
        .iter()
        .map(|r| r[0].trim_matches('`').to_string())
        .collect();
    assert_eq!(
        listed.iter().cloned().collect::<BTreeSet<_>>(),
        severities.keys().cloned().collect::<BTreeSet<_>>(),
        "deploy/README.md's alert table and bulwark.rules.yml list different alerts"
    );
    assert_eq!(listed.len(), severities.len(), "an alert listed twice");
    for row in &rows {
        let alert = row[0].trim_matches('`');
        assert_eq!(row.len(), 4, "{alert}: {row:?}");
        assert_eq!(row[2], severities[alert], "{alert}: the table's severity");
        for named in row[3].split("; ") {
            let (quiet, name) = match named.strip_prefix("quiet: ") {
                Some(name) => (true, name),
                None => (false, named),
            };
            let name = name.trim_matches('"');
            let group = groups
                .get(name)
                .unwrap_or_else(|| panic!("{alert}: no unit test {name:?}"));
            let shown = group["alert_rule_test"]
                .as_array()
                .unwrap()
                .iter()
                .any(|c| {
                    c["alertname"] == alert
                        && c["exp_alerts"].as_array().is_some_and(|a| a.is_empty()) == quiet
                });
            assert!(
                shown,
                "{alert}: unit test {name:?} does not show it {}",
                if quiet { "quiet" } else { "firing" }
            );
        }
    }
}

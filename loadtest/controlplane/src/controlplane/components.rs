//! The rest of a cluster beside the apiservers: kube-controller-manager, kube-scheduler and
//! KWOK's controller (which speaks for simulated nodes and their pods), each a real process
//! built from its Go module, each talking through Bulwark with its own identity, as they
//! would through a cluster's front door.
//!
//! KWOK manages the nodes annotated [`KWOK_ANNOTATION`]: it renews their Leases in
//! `kube-node-lease`, keeps their status Ready and runs their pods through their life (a
//! Job's pods run, then succeed). One client speaks for every node, so its identity has rules
//! of its own (`loadtest/rules/kwok.yaml`) where a real cluster's kubelets have the node rules.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use serde_json::{Value, json};
use tokio::process::Child;

use super::{ControlPlane, Error, log_tail, spawn, terminate};
use crate::identities::kubeconfig;

/// The user KWOK's controller is (a client certificate with this CN and no group).
pub const KWOK_USER: &str = "kwok-controller";
/// The annotation of the nodes KWOK manages.
pub const KWOK_ANNOTATION: &str = "kwok.x-k8s.io/node";
/// How long a node's Lease lasts; KWOK renews it about every quarter of this.
pub const NODE_LEASE_SECONDS: u32 = 40;

/// What KWOK may do: its nodes, their Leases and status, their pods and events. Bound to
/// [`KWOK_USER`].
const KWOK_RBAC: &str = r#"apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: kwok-controller
rules:
  - apiGroups: [""]
    resources: [nodes, pods]
    verbs: [get, list, watch, create, update, patch, delete]
  - apiGroups: [""]
    resources: [nodes/status, pods/status]
    verbs: [update, patch]
  - apiGroups: [coordination.k8s.io]
    resources: [leases]
    verbs: [get, list, watch, create, update, patch]
  - apiGroups: ["", events.k8s.io]
    resources: [events]
    verbs: [create, patch, update]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: kwok-controller
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: ClusterRole
  name: kwok-controller
subjects:
  - apiGroup: rbac.authorization.k8s.io
    kind: User
    name: kwok-controller
---
# The apiservers' own fairness gives kubelets' heartbeats the node-high level (APF's
# system-node-high FlowSchema matches group system:nodes); KWOK's heartbeats are every
# node's, so they get the same, or a busy apiserver queues them behind everyone's LISTs.
apiVersion: flowcontrol.apiserver.k8s.io/v1
kind: FlowSchema
metadata:
  name: kwok-node-heartbeats
spec:
  matchingPrecedence: 450
  priorityLevelConfiguration:
    name: node-high
  distinguisherMethod:
    type: ByUser
  rules:
    - subjects:
        - kind: User
          user:
            name: kwok-controller
      resourceRules:
        - verbs: ["*"]
          apiGroups: [coordination.k8s.io]
          resources: [leases]
          namespaces: [kube-node-lease]
        - verbs: ["*"]
          apiGroups: [""]
          resources: [nodes, nodes/status]
          clusterScope: true
"#;

/// KWOK's stages, as it releases them (`loadtest/controlplane/kwok/stages.yaml`).
const KWOK_STAGES: &str = include_str!("../../../controlplane/kwok/stages.yaml");

/// KWOK's configuration: the annotated nodes only, their Leases renewed 16 at a time, and
/// its released stages to move nodes and pods along.
fn kwok_config() -> String {
    format!(
        "{KWOK_STAGES}---
apiVersion: config.kwok.x-k8s.io/v1alpha1
kind: KwokConfiguration
options:
  manageNodesWithAnnotationSelector: {KWOK_ANNOTATION}=fake
  nodeLeaseDurationSeconds: {NODE_LEASE_SECONDS}
  nodeLeaseParallelism: 16
  nodePlayStageParallelism: 16
  podPlayStageParallelism: 16
  podsOnNodeSyncParallelism: 16
  cidr: 10.0.0.1/16
  nodeIP: 10.0.0.1
"
    )
}

/// A node KWOK manages, with room for 110 pods.
pub fn kwok_node(name: &str) -> Value {
    let capacity = json!({"cpu": "32", "memory": "256Gi", "pods": "110"});
    json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {KWOK_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
            },
        },
        "spec": {},
        "status": {"capacity": capacity, "allocatable": capacity},
    })
}

/// kube-controller-manager, kube-scheduler and KWOK, running; [`Components::stop`] them.
pub struct Components {
    running: Vec<Component>,
}

struct Component {
    name: &'static str,
    program: PathBuf,
    args: Vec<OsString>,
    child: Child,
    log: PathBuf,
    restarts: u64,
}

impl ControlPlane {
    /// Starts kube-controller-manager, kube-scheduler and KWOK through the front door
    /// (Bulwark, or without it the balancer in front of the kube-apiservers), each with a
    /// client certificate of its own identity,
    /// after granting KWOK its RBAC. Their logs are `DIR/<name>.log`.
    pub async fn start_components(&self) -> Result<Components, Error> {
        let binaries = self.binaries().components()?;
        let rbac = self.dir().join("kwok-rbac.yaml");
        std::fs::write(&rbac, KWOK_RBAC).map_err(|source| Error::Io {
            path: rbac.clone(),
            source,
        })?;
        let rbac_arg = rbac.display().to_string();
        let (applied, said) = self
            .kubectl("admin", &["apply", "-f", &rbac_arg])
            .await
            .map_err(|source| Error::Io {
                path: rbac.clone(),
                source,
            })?;
        if !applied {
            return Err(Error::Setup(format!("granting KWOK its RBAC: {said}")));
        }
        let config = self.dir().join("kwok.yaml");
        std::fs::write(&config, kwok_config()).map_err(|source| Error::Io {
            path: config.clone(),
            source,
        })?;
        let mut running = Vec::new();
        let front = self.front_door();
        let specs: [(&'static str, PathBuf, &str, Vec<OsString>); 3] = [
            (
                "kube-controller-manager",
                binaries.kube_controller_manager,
                "system:kube-controller-manager",
                vec![
                    // No serving port: nothing here scrapes it, and it would need its own
                    // delegated authentication.
                    "--secure-port=0".into(),
                    "--leader-elect=true".into(),
                    // One ServiceAccount per controller, as clusters run it: each asks the
                    // TokenRequest API for its token and reaches the apiserver, through
                    // Bulwark, as `system:serviceaccount:kube-system:<controller>` (Bulwark
                    // reviews those tokens like any other).
                    "--use-service-account-credentials=true".into(),
                    "--controllers=*".into(),
                    "--concurrent-job-syncs=10".into(),
                    "--kube-api-qps=200".into(),
                    "--kube-api-burst=400".into(),
                ],
            ),
            (
                "kube-scheduler",
                binaries.kube_scheduler,
                "system:kube-scheduler",
                vec![
                    "--secure-port=0".into(),
                    "--leader-elect=true".into(),
                    "--kube-api-qps=200".into(),
                    "--kube-api-burst=400".into(),
                ],
            ),
            (
                "kwok",
                binaries.kwok,
                KWOK_USER,
                vec![flag("--config", &config)],
            ),
        ];
        for (name, program, user, mut args) in specs {
            let kubeconfig_path = self.dir().join(format!("kubeconfig-{name}"));
            let cert = self.pki().client_ca.client_cert(user, &[]);
            let text = kubeconfig(
                front.addr,
                &front.ca_pem,
                user,
                &cert.cert_pem,
                &cert.key_pem,
            );
            std::fs::write(&kubeconfig_path, text).map_err(|source| Error::Io {
                path: kubeconfig_path.clone(),
                source,
            })?;
            args.push(flag("--kubeconfig", &kubeconfig_path));
            let log = self.dir().join(format!("{name}.log"));
            let _ = std::fs::remove_file(&log);
            let child = spawn(name, &program, &args, &log, None)?;
            running.push(Component {
                name,
                program,
                args,
                child,
                log,
                restarts: 0,
            });
        }
        Ok(Components { running })
    }
}

fn flag(name: &str, path: &Path) -> OsString {
    let mut f = OsString::from(name);
    f.push("=");
    f.push(path);
    f
}

impl Components {
    /// The first component that exited, with its status and the end of its log.
    pub fn exited(&mut self) -> Option<String> {
        self.running.iter_mut().find_map(|c| {
            let status = c.child.try_wait().ok().flatten()?;
            Some(format!(
                "{} exited ({status}); the end of {}:\n{}",
                c.name,
                c.log.display(),
                log_tail(&c.log)
            ))
        })
    }

    /// Starts again every component that exited, as a kubelet restarts a static pod (a
    /// controller manager that loses its leader Lease exits by design); returns what
    /// exited, with the end of its log. Its log goes on in the same file.
    pub fn restart_exited(&mut self) -> Vec<String> {
        let mut restarted = Vec::new();
        for c in &mut self.running {
            let Ok(Some(status)) = c.child.try_wait() else {
                continue;
            };
            restarted.push(format!(
                "{} exited ({status}); the end of {}:\n{}",
                c.name,
                c.log.display(),
                log_tail(&c.log)
            ));
            match spawn(c.name, &c.program, &c.args, &c.log, None) {
                Ok(child) => {
                    c.child = child;
                    c.restarts += 1;
                }
                Err(e) => restarted.push(format!("{} could not start again: {e}", c.name)),
            }
        }
        restarted
    }

    /// How many times each component was started again, by name.
    pub fn restarts(&self) -> Vec<(&'static str, u64)> {
        self.running.iter().map(|c| (c.name, c.restarts)).collect()
    }

    /// The log of `name` (`kube-controller-manager`, `kube-scheduler`, `kwok`).
    pub fn log(&self, name: &str) -> Option<&Path> {
        self.running
            .iter()
            .find(|c| c.name == name)
            .map(|c| c.log.as_path())
    }

    /// SIGTERM to each, SIGKILL to what is left after the grace period.
    pub async fn stop(mut self) {
        for component in &mut self.running {
            terminate(&mut component.child).await;
        }
    }
}

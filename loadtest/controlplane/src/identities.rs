//! The identities the sandbox and the real control plane hand out: the node and the
//! Secrets it may read, the operators' group, and kubeconfigs that embed each identity's
//! client certificate and the CA of the server it points at.

use std::net::SocketAddr;

use base64::Engine as _;
use bulwark_sim::pki::Ca;

/// The node whose kubeconfig the sandbox writes.
pub const NODE: &str = "node-1";
/// The Secrets the node may read.
pub const NODE_SECRETS: [&str; 2] = ["node-1-kubelet-config", "node-1-registry-pull"];
/// Their namespace.
pub const NODE_NAMESPACE: &str = "ns-0";
/// The operator's group, which reads secrets and configmaps everywhere.
pub const OPERATORS: &str = "sandbox:operators";

/// A kubeconfig with everything embedded: the server's CA, the client certificate and key.
pub fn kubeconfig(
    server: SocketAddr,
    ca_pem: &str,
    user: &str,
    cert_pem: &str,
    key_pem: &str,
) -> String {
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s.as_bytes());
    format!(
        "apiVersion: v1
kind: Config
clusters:
- name: sandbox
  cluster:
    server: https://{server}
    certificate-authority-data: {ca}
users:
- name: {user}
  user:
    client-certificate-data: {cert}
    client-key-data: {key}
contexts:
- name: {user}
  context:
    cluster: sandbox
    user: {user}
current-context: {user}
",
        ca = b64(ca_pem),
        cert = b64(cert_pem),
        key = b64(key_pem),
    )
}

/// Where the kubeconfigs point, and the CA each server's certificate comes from.
pub struct Servers<'a> {
    /// Bulwark.
    pub bulwark: SocketAddr,
    /// The CA of Bulwark's serving certificate, PEM.
    pub bulwark_ca: &'a str,
    /// The apiserver replica that `kubeconfig-direct-admin` goes straight to.
    pub replica: SocketAddr,
    /// The CA of the replicas' serving certificate, PEM.
    pub replica_ca: &'a str,
}

/// The sandbox's kubeconfigs as (file name, contents), with fresh client certificates from
/// `client_ca`: admin, operator, node-1 and nobody through Bulwark, and direct-admin
/// straight to a replica.
pub fn kubeconfigs(servers: &Servers<'_>, client_ca: &Ca) -> Vec<(&'static str, String)> {
    let node = format!("system:node:{NODE}");
    let via_bulwark = (servers.bulwark, servers.bulwark_ca);
    let direct = (servers.replica, servers.replica_ca);
    let masters: &[&str] = &["system:masters"];
    [
        ("kubeconfig-admin", via_bulwark, "admin", masters),
        ("kubeconfig-operator", via_bulwark, "operator", &[OPERATORS]),
        ("kubeconfig-node-1", via_bulwark, &node, &["system:nodes"]),
        ("kubeconfig-nobody", via_bulwark, "nobody", &[]),
        ("kubeconfig-direct-admin", direct, "admin", masters),
    ]
    .into_iter()
    .map(|(file, (server, ca_pem), user, groups)| {
        let ck = client_ca.client_cert(user, groups);
        (
            file,
            kubeconfig(server, ca_pem, user, &ck.cert_pem, &ck.key_pem),
        )
    })
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kubeconfig_embeds_pem_data() {
        let text = kubeconfig(
            "127.0.0.1:6443".parse().unwrap(),
            "CA",
            "alice",
            "CERT",
            "KEY",
        );
        let v: serde_norway::Value = serde_norway::from_str(&text).unwrap();
        let cluster = &v["clusters"][0]["cluster"];
        assert_eq!(cluster["server"].as_str(), Some("https://127.0.0.1:6443"));
        assert_eq!(cluster["certificate-authority-data"].as_str(), Some("Q0E="));
        let user = &v["users"][0]["user"];
        assert_eq!(user["client-certificate-data"].as_str(), Some("Q0VSVA=="));
        assert_eq!(user["client-key-data"].as_str(), Some("S0VZ"));
        assert_eq!(v["current-context"].as_str(), Some("alice"));
    }
}

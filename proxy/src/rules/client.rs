//! Who the client of a request is, for rules whose flows are per client (`flow: node`,
//! `flow: pod`): the node or pod its credential names, else the address it connects from.
//!
//! A claim is taken only when it is one value of the shape Kubernetes gives it (a node name
//! is a DNS subdomain, a pod UID a UUID); anything else keys the client by its address, so
//! that no credential can name its way into another client's flow. Each kind of client is
//! written with its own prefix (`node:`, `pod:`, `addr:`): a node named like an address and
//! that address are two flows.

use std::fmt;
use std::net::IpAddr;

use super::matcher::is_dns_subdomain;
use super::types::FlowBy;
use crate::identity::User;

/// The extra of a bound ServiceAccount token that names the node its pod runs on.
pub const NODE_NAME_CLAIM: &str = "authentication.kubernetes.io/node-name";
/// The extra of a bound ServiceAccount token that names its pod's UID.
pub const POD_UID_CLAIM: &str = "authentication.kubernetes.io/pod-uid";

/// The claim of a bound ServiceAccount token that names its pod (logged, never keyed by:
/// a pod's name is reused by its successor).
pub const POD_NAME_CLAIM: &str = "authentication.kubernetes.io/pod-name";

/// The user name prefix and the group of a kubelet, as the Node authorizer reads them.
const NODE_USER_PREFIX: &str = "system:node:";
const NODES_GROUP: &str = "system:nodes";

/// The longest node name: a DNS subdomain.
const MAX_NODE_NAME: usize = 253;
/// A UUID's length in its text form (`8-4-4-4-12` hex digits).
const UUID_LEN: usize = 36;

/// A client as a flow key names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Client<'a> {
    /// A node, by name (a DNS subdomain).
    Node(&'a str),
    /// A pod, by UID.
    Pod(&'a str),
    /// The source address of the connection (an IPv6 one by its /64); `None` when the
    /// request came on no connection (`explain` without `--source`, tests).
    Addr(Option<IpAddr>),
}

/// The claims that name a client: the ones [`Claim::Node`] and [`Claim::Pod`] read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// `authentication.kubernetes.io/node-name`.
    Node,
    /// `authentication.kubernetes.io/pod-uid`.
    Pod,
}

impl Claim {
    fn short(self) -> &'static str {
        match self {
            Claim::Node => "node-name",
            Claim::Pod => "pod-uid",
        }
    }
}

/// Why a client is keyed by its source address rather than the node or pod it names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fallback {
    /// The credential carries no such claim (a client certificate carries none).
    Missing(Claim),
    /// The claim has this many values, not one.
    Several(Claim, usize),
    /// The claim is empty.
    Empty(Claim),
    /// The claim is this many bytes, longer than any of its kind.
    TooLong(Claim, usize),
    /// The claim is not a DNS subdomain (node name) or a UUID (pod UID).
    Malformed(Claim),
    /// A kubelet whose user name names no valid node.
    NodeUser,
}

impl fmt::Display for Fallback {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Fallback::Missing(claim) => write!(f, "no {} claim", claim.short()),
            Fallback::Several(claim, n) => write!(f, "{n} {} claims, not one", claim.short()),
            Fallback::Empty(claim) => write!(f, "an empty {} claim", claim.short()),
            Fallback::TooLong(claim, len) => write!(
                f,
                "a {} claim of {len} bytes, longer than any {}",
                claim.short(),
                match claim {
                    Claim::Node => "node name (253)",
                    Claim::Pod => "UUID (36)",
                }
            ),
            Fallback::Malformed(Claim::Node) => {
                write!(f, "a node-name claim that is not a DNS subdomain")
            }
            Fallback::Malformed(Claim::Pod) => write!(f, "a pod-uid claim that is not a UUID"),
            Fallback::NodeUser => write!(f, "a node user whose name is not a DNS subdomain"),
        }
    }
}

/// The client of a request for a rule keyed by `flow` (`Node` or `Pod`), and why it is
/// its address when it is. `source` is the connection's client address (the PROXY
/// header's, from a trusted balancer).
pub(crate) fn client_of(
    flow: FlowBy,
    user: &User,
    source: Option<IpAddr>,
) -> (Client<'_>, Option<Fallback>) {
    let named = match flow {
        FlowBy::Pod => claim(user, Claim::Pod).map(Client::Pod),
        _ => node_of(user).map(Client::Node),
    };
    match named {
        Ok(client) => (client, None),
        Err(why) => (Client::Addr(source.map(crate::net::source_of)), Some(why)),
    }
}

/// The node of a kubelet (`system:node:<name>` in `system:nodes`), else the node its
/// token's claim names.
fn node_of(user: &User) -> Result<&str, Fallback> {
    if let Some(name) = user.username.strip_prefix(NODE_USER_PREFIX)
        && user.groups.iter().any(|g| g == NODES_GROUP)
    {
        return if is_dns_subdomain(name) {
            Ok(name)
        } else {
            Err(Fallback::NodeUser)
        };
    }
    claim(user, Claim::Node)
}

/// The one value of `kind`'s claim, if it has the shape of one.
fn claim(user: &User, kind: Claim) -> Result<&str, Fallback> {
    let key = match kind {
        Claim::Node => NODE_NAME_CLAIM,
        Claim::Pod => POD_UID_CLAIM,
    };
    let value = match user.extra.get(key).map(Vec::as_slice) {
        None | Some([]) => return Err(Fallback::Missing(kind)),
        Some([value]) => value.as_str(),
        Some(values) => return Err(Fallback::Several(kind, values.len())),
    };
    let most = match kind {
        Claim::Node => MAX_NODE_NAME,
        Claim::Pod => UUID_LEN,
    };
    if value.is_empty() {
        Err(Fallback::Empty(kind))
    } else if value.len() > most {
        Err(Fallback::TooLong(kind, value.len()))
    } else if match kind {
        Claim::Node => is_dns_subdomain(value),
        Claim::Pod => is_uuid(value),
    } {
        Ok(value)
    } else {
        Err(Fallback::Malformed(kind))
    }
}

/// Whether `s` is a UUID as Kubernetes writes one: 8-4-4-4-12 hex digits.
fn is_uuid(s: &str) -> bool {
    s.len() == UUID_LEN
        && s.bytes().enumerate().all(|(i, b)| match i {
            8 | 13 | 18 | 23 => b == b'-',
            _ => b.is_ascii_hexdigit(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "0f3c5e2a-7b1d-4c9e-8a6f-2d4b6c8e0a1f";

    fn sa(extra: &[(&str, &[&str])]) -> User {
        User {
            username: "system:serviceaccount:kube-system:kube-proxy".into(),
            groups: vec!["system:serviceaccounts".into()],
            extra: extra
                .iter()
                .map(|(k, v)| (k.to_string(), v.iter().map(|s| s.to_string()).collect()))
                .collect(),
            ..User::default()
        }
    }

    #[test]
    fn a_token_s_node_and_pod_claims_name_its_client() {
        let user = sa(&[(NODE_NAME_CLAIM, &["n-1.zone-a"]), (POD_UID_CLAIM, &[UID])]);
        let source = Some("10.0.0.9".parse().unwrap());
        assert_eq!(
            client_of(FlowBy::Node, &user, source),
            (Client::Node("n-1.zone-a"), None)
        );
        assert_eq!(
            client_of(FlowBy::Pod, &user, source),
            (Client::Pod(UID), None)
        );
    }

    #[test]
    fn a_kubelet_is_its_node_and_a_user_named_like_one_is_not() {
        let kubelet = User {
            username: "system:node:n-7".into(),
            groups: vec!["system:nodes".into()],
            ..User::default()
        };
        assert_eq!(
            client_of(FlowBy::Node, &kubelet, None),
            (Client::Node("n-7"), None)
        );
        // Without the group the Node authorizer would not take it for a kubelet either.
        let pretender = User {
            username: "system:node:n-7".into(),
            ..User::default()
        };
        assert_eq!(
            client_of(FlowBy::Node, &pretender, None),
            (Client::Addr(None), Some(Fallback::Missing(Claim::Node)))
        );
        let odd = User {
            username: "system:node:N_7".into(),
            groups: vec!["system:nodes".into()],
            ..User::default()
        };
        assert_eq!(
            client_of(FlowBy::Node, &odd, None).1,
            Some(Fallback::NodeUser)
        );
        // A kubelet has no pod.
        assert_eq!(
            client_of(FlowBy::Pod, &kubelet, None).1,
            Some(Fallback::Missing(Claim::Pod))
        );
    }

    #[test]
    fn a_claim_that_is_not_one_value_of_its_shape_keys_by_address() {
        let source: IpAddr = "10.0.0.9".parse().unwrap();
        let long = "a".repeat(254);
        let long_uid = format!("{UID}0");
        let cases: Vec<(FlowBy, User, Fallback)> = vec![
            (FlowBy::Node, sa(&[]), Fallback::Missing(Claim::Node)),
            (
                FlowBy::Node,
                sa(&[(NODE_NAME_CLAIM, &[])]),
                Fallback::Missing(Claim::Node),
            ),
            (
                FlowBy::Node,
                sa(&[(NODE_NAME_CLAIM, &["n1", "n2"])]),
                Fallback::Several(Claim::Node, 2),
            ),
            (
                FlowBy::Node,
                sa(&[(NODE_NAME_CLAIM, &[""])]),
                Fallback::Empty(Claim::Node),
            ),
            (
                FlowBy::Node,
                sa(&[(NODE_NAME_CLAIM, &[&long])]),
                Fallback::TooLong(Claim::Node, 254),
            ),
            (
                FlowBy::Node,
                sa(&[(NODE_NAME_CLAIM, &["n1/addr:10.0.0.1"])]),
                Fallback::Malformed(Claim::Node),
            ),
            (
                FlowBy::Node,
                sa(&[(NODE_NAME_CLAIM, &["Node-1"])]),
                Fallback::Malformed(Claim::Node),
            ),
            (FlowBy::Pod, sa(&[]), Fallback::Missing(Claim::Pod)),
            (
                FlowBy::Pod,
                sa(&[(POD_UID_CLAIM, &[UID, UID])]),
                Fallback::Several(Claim::Pod, 2),
            ),
            (
                FlowBy::Pod,
                sa(&[(POD_UID_CLAIM, &[&long_uid])]),
                Fallback::TooLong(Claim::Pod, 37),
            ),
            (
                FlowBy::Pod,
                sa(&[(POD_UID_CLAIM, &["web-1"])]),
                Fallback::Malformed(Claim::Pod),
            ),
            (
                FlowBy::Pod,
                sa(&[(POD_UID_CLAIM, &["0f3c5e2a-7b1d-4c9e-8a6f+2d4b6c8e0a1f"])]),
                Fallback::Malformed(Claim::Pod),
            ),
        ];
        for (flow, user, why) in cases {
            assert_eq!(
                client_of(flow, &user, Some(source)),
                (Client::Addr(Some(source)), Some(why.clone())),
                "{why}"
            );
        }
    }

    #[test]
    fn an_ipv6_source_is_keyed_by_its_64() {
        let user = sa(&[]);
        let (client, _) = client_of(FlowBy::Node, &user, Some("fd00::1:2:3:4".parse().unwrap()));
        assert_eq!(client, Client::Addr(Some("fd00::".parse().unwrap())));
    }

    #[test]
    fn fallbacks_say_why() {
        assert_eq!(
            Fallback::Missing(Claim::Node).to_string(),
            "no node-name claim"
        );
        assert_eq!(
            Fallback::Several(Claim::Pod, 3).to_string(),
            "3 pod-uid claims, not one"
        );
        assert_eq!(
            Fallback::TooLong(Claim::Node, 300).to_string(),
            "a node-name claim of 300 bytes, longer than any node name (253)"
        );
    }
}

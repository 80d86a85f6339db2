//! The cache's answers in Kubernetes' protobuf encoding, for the clients that prefer it:
//! client-go programs (kubelets, kube-proxy, most controllers) ask for
//! `application/vnd.kubernetes.protobuf` first.
//!
//! The cache keeps each object's JSON, as its informers read it; a protobuf answer is
//! converted from it: the JSON read into k8s-openapi's type, moved field by field into
//! k8s-pb's (prost's) type, and encoded. Both sides are spelled out in full (no `..` in a
//! pattern, no `..Default::default()` in a literal), so that a field either crate gains
//! fails the build here instead of being dropped. `managedFields[].fieldsV1` travels as the
//! JSON text the apiserver wrote, which is what its protobuf carries too.
//!
//! The wire forms are the apiserver's:
//! - an object or a list: `k8s\0`, then `runtime.Unknown{typeMeta, raw}` with the message
//!   in `raw`;
//! - a watch stream (`;stream=watch`): per event a 4-byte big-endian length, then
//!   `metav1.WatchEvent{type, object: RawExtension{raw: the object as above}}`.

use k8s_openapi::api::core::v1 as core;
use k8s_openapi::api::discovery::v1 as discovery;
use k8s_openapi::apimachinery::pkg::apis::meta::v1 as meta;
use k8s_pb::api::core::v1 as pb_core;
use k8s_pb::api::discovery::v1 as pb_discovery;
use k8s_pb::apimachinery::pkg::apis::meta::v1 as pb_meta;
use k8s_pb::apimachinery::pkg::runtime as pb_runtime;
use prost::Message;
use prost::encoding::{WireType, encode_key, encode_varint};
use serde::Deserialize;
use serde_json::value::RawValue;

/// The protobuf media type.
pub const MEDIA_TYPE: &str = "application/vnd.kubernetes.protobuf";
/// The media type of a protobuf watch stream.
pub const WATCH_MEDIA_TYPE: &str = "application/vnd.kubernetes.protobuf;stream=watch";
/// What every protobuf object and list starts with.
const MAGIC: &[u8; 4] = b"k8s\0";

/// A cached object that does not convert.
#[derive(Debug, thiserror::Error)]
#[error("a cached {kind} does not read as one: {source}")]
pub struct ProtoError {
    kind: &'static str,
    #[source]
    source: serde_json::Error,
}

/// The kinds the cache answers in protobuf; others go upstream when a client asks for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProtoKind {
    /// `v1` Secret.
    Secret,
    /// `v1` Endpoints.
    Endpoints,
    /// `discovery.k8s.io/v1` EndpointSlice.
    EndpointSlice,
    /// `v1` ConfigMap.
    ConfigMap,
}

impl ProtoKind {
    /// The protobuf form of a group's kind, if the cache has one.
    pub fn of(group: &str, version: &str, kind: &str) -> Option<ProtoKind> {
        match (group, version, kind) {
            ("", "v1", "Secret") => Some(ProtoKind::Secret),
            ("", "v1", "Endpoints") => Some(ProtoKind::Endpoints),
            ("", "v1", "ConfigMap") => Some(ProtoKind::ConfigMap),
            ("discovery.k8s.io", "v1", "EndpointSlice") => Some(ProtoKind::EndpointSlice),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            ProtoKind::Secret => "Secret",
            ProtoKind::Endpoints => "Endpoints",
            ProtoKind::EndpointSlice => "EndpointSlice",
            ProtoKind::ConfigMap => "ConfigMap",
        }
    }

    /// The object's message (without the envelope) from its JSON.
    pub fn message(self, json: &[u8]) -> Result<Vec<u8>, ProtoError> {
        let fail = |source| ProtoError {
            kind: self.name(),
            source,
        };
        let fields = fields_v1(json).map_err(fail)?;
        Ok(match self {
            ProtoKind::Secret => {
                let object: core::Secret = serde_json::from_slice(json).map_err(fail)?;
                secret(object, fields).encode_to_vec()
            }
            ProtoKind::Endpoints => {
                let object: core::Endpoints = serde_json::from_slice(json).map_err(fail)?;
                endpoints(object, fields).encode_to_vec()
            }
            ProtoKind::EndpointSlice => {
                let object: discovery::EndpointSlice =
                    serde_json::from_slice(json).map_err(fail)?;
                endpoint_slice(object, fields).encode_to_vec()
            }
            ProtoKind::ConfigMap => {
                let object: core::ConfigMap = serde_json::from_slice(json).map_err(fail)?;
                config_map(object, fields).encode_to_vec()
            }
        })
    }
}

/// `k8s\0` + `runtime.Unknown`: an object or a list as the apiserver sends it.
pub fn envelope(api_version: &str, kind: &str, raw: Vec<u8>) -> Vec<u8> {
    let unknown = pb_runtime::Unknown {
        type_meta: Some(pb_runtime::TypeMeta {
            api_version: Some(api_version.to_owned()),
            kind: Some(kind.to_owned()),
        }),
        raw: Some(raw),
        content_encoding: Some(String::new()),
        content_type: Some(String::new()),
    };
    let mut out = Vec::with_capacity(MAGIC.len() + unknown.encoded_len());
    out.extend_from_slice(MAGIC);
    unknown.encode_raw(&mut out);
    out
}

/// A list's message: its metadata (field 1) and its items' messages (field 2), each
/// written once, whatever their type.
pub fn list_message<'a>(
    metadata: &ListMeta<'_>,
    items: impl IntoIterator<Item = &'a [u8]>,
) -> Vec<u8> {
    let mut out = Vec::new();
    let meta = pb_meta::ListMeta {
        self_link: None,
        resource_version: Some(metadata.resource_version.to_owned()),
        r#continue: metadata.next.map(str::to_owned),
        remaining_item_count: metadata.remaining_item_count,
    };
    prost::encoding::message::encode(1, &meta, &mut out);
    for item in items {
        encode_key(2, WireType::LengthDelimited, &mut out);
        encode_varint(item.len() as u64, &mut out);
        out.extend_from_slice(item);
    }
    out
}

/// A list's `metadata`.
#[derive(Debug, Clone, Copy)]
pub struct ListMeta<'a> {
    /// The version the list is a snapshot of.
    pub resource_version: &'a str,
    /// The continue token of a page that has more after it.
    pub next: Option<&'a str>,
    /// How many items follow the page, when known.
    pub remaining_item_count: Option<i64>,
}

/// One frame of a protobuf watch stream: `event_type` and the enveloped `object`.
pub fn watch_frame(event_type: &str, object: Vec<u8>) -> Vec<u8> {
    let event = pb_meta::WatchEvent {
        r#type: Some(event_type.to_owned()),
        object: Some(pb_runtime::RawExtension { raw: Some(object) }),
    };
    let len = event.encoded_len();
    let mut out = Vec::with_capacity(4 + len);
    out.extend_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_be_bytes());
    event.encode_raw(&mut out);
    out
}

/// A `metav1.Status` (its JSON) as an enveloped protobuf object.
pub fn status(json: &[u8]) -> Result<Vec<u8>, ProtoError> {
    let fail = |source| ProtoError {
        kind: "Status",
        source,
    };
    let meta::Status {
        code,
        details,
        message,
        metadata,
        reason,
        status,
    } = serde_json::from_slice(json).map_err(fail)?;
    let message = pb_meta::Status {
        metadata: Some(list_meta(metadata)),
        status,
        message,
        reason,
        details: details.map(|d| {
            let meta::StatusDetails {
                causes,
                group,
                kind,
                name,
                retry_after_seconds,
                uid,
            } = d;
            pb_meta::StatusDetails {
                name,
                group,
                kind,
                uid,
                causes: causes
                    .unwrap_or_default()
                    .into_iter()
                    .map(|c| {
                        let meta::StatusCause {
                            field,
                            message,
                            reason,
                        } = c;
                        pb_meta::StatusCause {
                            reason,
                            message,
                            field,
                        }
                    })
                    .collect(),
                retry_after_seconds,
            }
        }),
        code,
    };
    Ok(envelope("v1", "Status", message.encode_to_vec()))
}

/// Each `managedFields[].fieldsV1` as the JSON text the apiserver wrote, in order.
fn fields_v1(json: &[u8]) -> Result<Vec<Option<Vec<u8>>>, serde_json::Error> {
    #[derive(Deserialize)]
    struct Object<'a> {
        #[serde(borrow, default)]
        metadata: Option<Metadata<'a>>,
    }
    #[derive(Deserialize)]
    struct Metadata<'a> {
        #[serde(borrow, default, rename = "managedFields")]
        managed_fields: Option<Vec<Entry<'a>>>,
    }
    #[derive(Deserialize)]
    struct Entry<'a> {
        #[serde(borrow, default, rename = "fieldsV1")]
        fields_v1: Option<&'a RawValue>,
    }
    let object: Object<'_> = serde_json::from_slice(json)?;
    Ok(object
        .metadata
        .and_then(|m| m.managed_fields)
        .unwrap_or_default()
        .into_iter()
        .map(|e| e.fields_v1.map(|raw| raw.get().as_bytes().to_vec()))
        .collect())
}

fn time(t: meta::Time) -> pb_meta::Time {
    pb_meta::Time {
        seconds: Some(t.0.as_second()),
        nanos: Some(t.0.subsec_nanosecond()),
    }
}

fn list_meta(m: meta::ListMeta) -> pb_meta::ListMeta {
    let meta::ListMeta {
        continue_,
        remaining_item_count,
        resource_version,
        self_link,
        // v1.36's sharded lists; k8s-pb's protobuf has no field for it yet, and a Status
        // (the only ListMeta converted here) never carries one.
        shard_info: _,
    } = m;
    pb_meta::ListMeta {
        self_link,
        resource_version,
        r#continue: continue_,
        remaining_item_count,
    }
}

fn object_meta(m: meta::ObjectMeta, fields: Vec<Option<Vec<u8>>>) -> pb_meta::ObjectMeta {
    let meta::ObjectMeta {
        annotations,
        creation_timestamp,
        deletion_grace_period_seconds,
        deletion_timestamp,
        finalizers,
        generate_name,
        generation,
        labels,
        managed_fields,
        name,
        namespace,
        owner_references,
        resource_version,
        self_link,
        uid,
    } = m;
    let mut fields = fields.into_iter();
    pb_meta::ObjectMeta {
        name,
        generate_name,
        namespace,
        self_link,
        uid,
        resource_version,
        generation,
        creation_timestamp: creation_timestamp.map(time),
        deletion_timestamp: deletion_timestamp.map(time),
        deletion_grace_period_seconds,
        labels: labels.unwrap_or_default(),
        annotations: annotations.unwrap_or_default(),
        owner_references: owner_references
            .unwrap_or_default()
            .into_iter()
            .map(owner_reference)
            .collect(),
        finalizers: finalizers.unwrap_or_default(),
        managed_fields: managed_fields
            .unwrap_or_default()
            .into_iter()
            .map(|e| managed_fields_entry(e, fields.next().flatten()))
            .collect(),
    }
}

fn owner_reference(r: meta::OwnerReference) -> pb_meta::OwnerReference {
    let meta::OwnerReference {
        api_version,
        block_owner_deletion,
        controller,
        kind,
        name,
        uid,
    } = r;
    pb_meta::OwnerReference {
        api_version: Some(api_version),
        kind: Some(kind),
        name: Some(name),
        uid: Some(uid),
        controller,
        block_owner_deletion,
    }
}

/// An entry, with its `fieldsV1` as the text it had in the JSON (`raw`).
fn managed_fields_entry(
    e: meta::ManagedFieldsEntry,
    raw: Option<Vec<u8>>,
) -> pb_meta::ManagedFieldsEntry {
    let meta::ManagedFieldsEntry {
        api_version,
        fields_type,
        fields_v1,
        manager,
        operation,
        subresource,
        time: at,
    } = e;
    let fields_v1 = fields_v1.map(|value| pb_meta::FieldsV1 {
        raw: Some(raw.unwrap_or_else(|| value.0.to_string().into_bytes())),
    });
    pb_meta::ManagedFieldsEntry {
        manager,
        operation,
        api_version,
        time: at.map(time),
        fields_type,
        fields_v1,
        subresource,
    }
}

fn object_reference(r: core::ObjectReference) -> pb_core::ObjectReference {
    let core::ObjectReference {
        api_version,
        field_path,
        kind,
        name,
        namespace,
        resource_version,
        uid,
    } = r;
    pb_core::ObjectReference {
        kind,
        namespace,
        name,
        uid,
        api_version,
        resource_version,
        field_path,
    }
}

fn secret(s: core::Secret, fields: Vec<Option<Vec<u8>>>) -> pb_core::Secret {
    let core::Secret {
        data,
        immutable,
        metadata,
        string_data,
        type_,
    } = s;
    pb_core::Secret {
        metadata: Some(object_meta(metadata, fields)),
        immutable,
        data: data
            .unwrap_or_default()
            .into_iter()
            .map(|(k, v)| (k, v.0))
            .collect(),
        string_data: string_data.unwrap_or_default(),
        r#type: type_,
    }
}

fn config_map(c: core::ConfigMap, fields: Vec<Option<Vec<u8>>>) -> pb_core::ConfigMap {
    let core::ConfigMap {
        binary_data,
        data,
        immutable,
        metadata,
    } = c;
    pb_core::ConfigMap {
        metadata: Some(object_meta(metadata, fields)),
        immutable,
        data: data.unwrap_or_default(),
        binary_data: binary_data
            .unwrap_or_default()
            .into_iter()
            .map(|(k, v)| (k, v.0))
            .collect(),
    }
}

fn endpoints(e: core::Endpoints, fields: Vec<Option<Vec<u8>>>) -> pb_core::Endpoints {
    let core::Endpoints { metadata, subsets } = e;
    let address = |a: core::EndpointAddress| {
        let core::EndpointAddress {
            hostname,
            ip,
            node_name,
            target_ref,
        } = a;
        pb_core::EndpointAddress {
            ip: Some(ip),
            hostname,
            node_name,
            target_ref: target_ref.map(object_reference),
        }
    };
    pb_core::Endpoints {
        metadata: Some(object_meta(metadata, fields)),
        subsets: subsets
            .unwrap_or_default()
            .into_iter()
            .map(|s| {
                let core::EndpointSubset {
                    addresses,
                    not_ready_addresses,
                    ports,
                } = s;
                pb_core::EndpointSubset {
                    addresses: addresses
                        .unwrap_or_default()
                        .into_iter()
                        .map(address)
                        .collect(),
                    not_ready_addresses: not_ready_addresses
                        .unwrap_or_default()
                        .into_iter()
                        .map(address)
                        .collect(),
                    ports: ports
                        .unwrap_or_default()
                        .into_iter()
                        .map(|p| {
                            let core::EndpointPort {
                                app_protocol,
                                name,
                                port,
                                protocol,
                            } = p;
                            pb_core::EndpointPort {
                                name,
                                port: Some(port),
                                protocol,
                                app_protocol,
                            }
                        })
                        .collect(),
                }
            })
            .collect(),
    }
}

fn endpoint_slice(
    s: discovery::EndpointSlice,
    fields: Vec<Option<Vec<u8>>>,
) -> pb_discovery::EndpointSlice {
    let discovery::EndpointSlice {
        address_type,
        endpoints,
        metadata,
        ports,
    } = s;
    pb_discovery::EndpointSlice {
        metadata: Some(object_meta(metadata, fields)),
        address_type: Some(address_type),
        endpoints: endpoints
            .unwrap_or_default()
            .into_iter()
            .map(endpoint)
            .collect(),
        ports: ports
            .unwrap_or_default()
            .into_iter()
            .map(|p| {
                let discovery::EndpointPort {
                    app_protocol,
                    name,
                    port,
                    protocol,
                } = p;
                pb_discovery::EndpointPort {
                    name,
                    protocol,
                    port,
                    app_protocol,
                }
            })
            .collect(),
    }
}

fn endpoint(e: discovery::Endpoint) -> pb_discovery::Endpoint {
    let discovery::Endpoint {
        addresses,
        conditions,
        deprecated_topology,
        hints,
        hostname,
        node_name,
        target_ref,
        zone,
    } = e;
    pb_discovery::Endpoint {
        addresses,
        conditions: conditions.map(|c| {
            let discovery::EndpointConditions {
                ready,
                serving,
                terminating,
            } = c;
            pb_discovery::EndpointConditions {
                ready,
                serving,
                terminating,
            }
        }),
        hostname,
        target_ref: target_ref.map(object_reference),
        deprecated_topology: deprecated_topology.unwrap_or_default(),
        node_name,
        zone,
        hints: hints.map(|h| {
            let discovery::EndpointHints {
                for_nodes,
                for_zones,
            } = h;
            pb_discovery::EndpointHints {
                for_zones: for_zones
                    .unwrap_or_default()
                    .into_iter()
                    .map(|z| pb_discovery::ForZone { name: Some(z.name) })
                    .collect(),
                for_nodes: for_nodes
                    .unwrap_or_default()
                    .into_iter()
                    .map(|n| pb_discovery::ForNode { name: Some(n.name) })
                    .collect(),
            }
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A Secret as the apiserver writes it, with every part that needs care: binary data,
    /// labels, an owner, and managedFields whose fieldsV1 keys are not in sorted order.
    const SECRET: &str = r#"{"metadata":{"name":"s","namespace":"ns","uid":"u-1","resourceVersion":"42","creationTimestamp":"2026-11-24T10:00:00Z","labels":{"b":"2","a":"1"},"ownerReferences":[{"apiVersion":"v1","kind":"ConfigMap","name":"o","uid":"u-0","controller":true}],"managedFields":[{"manager":"kubectl","operation":"Apply","apiVersion":"v1","time":"2026-11-24T10:00:01Z","fieldsType":"FieldsV1","fieldsV1":{"f:type":{},"f:data":{".":{},"f:k":{}}}}]},"data":{"k":"AAEC/w=="},"type":"Opaque"}"#;

    fn unwrap_envelope(bytes: &[u8]) -> pb_runtime::Unknown {
        assert_eq!(&bytes[..4], MAGIC, "starts with k8s\\0");
        pb_runtime::Unknown::decode(&bytes[4..]).unwrap()
    }

    #[test]
    fn a_secret_decodes_to_the_same_object() {
        let raw = ProtoKind::Secret.message(SECRET.as_bytes()).unwrap();
        let bytes = envelope("v1", "Secret", raw);
        let unknown = unwrap_envelope(&bytes);
        let type_meta = unknown.type_meta.unwrap();
        assert_eq!(type_meta.api_version.as_deref(), Some("v1"));
        assert_eq!(type_meta.kind.as_deref(), Some("Secret"));
        let secret = pb_core::Secret::decode(unknown.raw.unwrap().as_slice()).unwrap();
        assert_eq!(
            secret.data["k"],
            vec![0, 1, 2, 255],
            "base64 decoded to bytes"
        );
        assert_eq!(secret.r#type.as_deref(), Some("Opaque"));
        let meta = secret.metadata.unwrap();
        assert_eq!(meta.name.as_deref(), Some("s"));
        assert_eq!(meta.resource_version.as_deref(), Some("42"));
        assert_eq!(meta.labels.len(), 2);
        let created = meta.creation_timestamp.unwrap();
        assert_eq!(created.seconds, Some(1_795_514_400));
        assert_eq!(meta.owner_references[0].controller, Some(true));
        let entry = &meta.managed_fields[0];
        assert_eq!(entry.manager.as_deref(), Some("kubectl"));
        assert_eq!(entry.time.unwrap().seconds, Some(1_795_514_401));
        assert_eq!(
            entry.fields_v1.as_ref().unwrap().raw.as_deref(),
            Some(br#"{"f:type":{},"f:data":{".":{},"f:k":{}}}"#.as_slice()),
            "fieldsV1 is the apiserver's text, its key order kept"
        );
    }

    #[test]
    fn an_endpoint_slice_keeps_its_endpoints_ports_and_hints() {
        let json = r#"{"metadata":{"name":"e","namespace":"ns","resourceVersion":"7"},"addressType":"IPv4","endpoints":[{"addresses":["10.0.0.1"],"conditions":{"ready":true,"serving":true,"terminating":false},"nodeName":"n1","zone":"z","hints":{"forZones":[{"name":"z"}],"forNodes":[{"name":"n1"}]},"targetRef":{"kind":"Pod","name":"p","namespace":"ns"}}],"ports":[{"name":"http","port":8080,"protocol":"TCP"}]}"#;
        let raw = ProtoKind::EndpointSlice.message(json.as_bytes()).unwrap();
        let slice = pb_discovery::EndpointSlice::decode(raw.as_slice()).unwrap();
        assert_eq!(slice.address_type.as_deref(), Some("IPv4"));
        let endpoint = &slice.endpoints[0];
        assert_eq!(endpoint.addresses, ["10.0.0.1"]);
        assert_eq!(endpoint.conditions.unwrap().terminating, Some(false));
        assert_eq!(endpoint.node_name.as_deref(), Some("n1"));
        let hints = endpoint.hints.as_ref().unwrap();
        assert_eq!(hints.for_nodes[0].name.as_deref(), Some("n1"));
        assert_eq!(
            endpoint.target_ref.as_ref().unwrap().kind.as_deref(),
            Some("Pod")
        );
        assert_eq!(slice.ports[0].port, Some(8080));
    }

    #[test]
    fn endpoints_keep_ready_and_not_ready_addresses() {
        let json = r#"{"metadata":{"name":"svc"},"subsets":[{"addresses":[{"ip":"10.0.0.1","nodeName":"n1"}],"notReadyAddresses":[{"ip":"10.0.0.2"}],"ports":[{"port":443,"protocol":"TCP","name":"https"}]}]}"#;
        let raw = ProtoKind::Endpoints.message(json.as_bytes()).unwrap();
        let endpoints = pb_core::Endpoints::decode(raw.as_slice()).unwrap();
        let subset = &endpoints.subsets[0];
        assert_eq!(subset.addresses[0].ip.as_deref(), Some("10.0.0.1"));
        assert_eq!(
            subset.not_ready_addresses[0].ip.as_deref(),
            Some("10.0.0.2")
        );
        assert_eq!(subset.ports[0].port, Some(443));
    }

    #[test]
    fn a_list_carries_its_metadata_and_each_item_once() {
        let a = ProtoKind::Secret.message(SECRET.as_bytes()).unwrap();
        let b = ProtoKind::Secret
            .message(br#"{"metadata":{"name":"t","namespace":"ns"}}"#)
            .unwrap();
        let meta = ListMeta {
            resource_version: "42",
            next: Some("token"),
            remaining_item_count: Some(3),
        };
        let bytes = envelope(
            "v1",
            "SecretList",
            list_message(&meta, [a.as_slice(), b.as_slice()]),
        );
        let unknown = unwrap_envelope(&bytes);
        assert_eq!(
            unknown.type_meta.unwrap().kind.as_deref(),
            Some("SecretList")
        );
        let list = pb_core::SecretList::decode(unknown.raw.unwrap().as_slice()).unwrap();
        let meta = list.metadata.unwrap();
        assert_eq!(meta.resource_version.as_deref(), Some("42"));
        assert_eq!(meta.r#continue.as_deref(), Some("token"));
        assert_eq!(meta.remaining_item_count, Some(3));
        let names: Vec<_> = list
            .items
            .iter()
            .map(|s| s.metadata.as_ref().unwrap().name.clone().unwrap())
            .collect();
        assert_eq!(names, ["s", "t"]);
    }

    #[test]
    fn a_watch_frame_is_length_prefixed_and_wraps_the_enveloped_object() {
        let object = envelope(
            "v1",
            "Secret",
            ProtoKind::Secret.message(SECRET.as_bytes()).unwrap(),
        );
        let frame = watch_frame("MODIFIED", object.clone());
        let len = u32::from_be_bytes(frame[..4].try_into().unwrap()) as usize;
        assert_eq!(len, frame.len() - 4);
        let event = pb_meta::WatchEvent::decode(&frame[4..]).unwrap();
        assert_eq!(event.r#type.as_deref(), Some("MODIFIED"));
        assert_eq!(event.object.unwrap().raw.unwrap(), object);
    }

    #[test]
    fn a_status_converts_with_its_details() {
        let json = br#"{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"too old resource version: 1 (5)","reason":"Expired","details":{"name":"x","retryAfterSeconds":2},"code":410}"#;
        let bytes = status(json).unwrap();
        let unknown = unwrap_envelope(&bytes);
        let status = pb_meta::Status::decode(unknown.raw.unwrap().as_slice()).unwrap();
        assert_eq!(status.code, Some(410));
        assert_eq!(status.reason.as_deref(), Some("Expired"));
        assert_eq!(status.details.unwrap().retry_after_seconds, Some(2));
    }

    #[test]
    fn json_that_is_not_the_kind_is_an_error_not_a_panic() {
        let err = ProtoKind::Secret
            .message(br#"{"data":{"k":"not base64!"}}"#)
            .unwrap_err();
        assert!(err.to_string().contains("Secret"), "{err}");
        assert!(ProtoKind::EndpointSlice.message(b"[]").is_err());
    }
}

//! The built-in resources that Bulwark and its simulated apiserver both know by name, as
//! kube-apiserver v1.36 serves them: one table, so that the simulator serves what Bulwark's
//! cache expects of the real thing. Bulwark's cache discovers a resource's kind and scope
//! from the apiserver itself; from here it takes what discovery does not say (the zero
//! value a BOOKMARK carries). `loadtest/runner/tests/controlplane_kinds.rs` holds the table
//! against a real apiserver.

/// One resource as the apiserver serves it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Resource {
    /// API group ("" for core).
    pub group: &'static str,
    /// API version.
    pub version: &'static str,
    /// Plural resource name.
    pub resource: &'static str,
    /// Singular name.
    pub singular: &'static str,
    /// Kind.
    pub kind: &'static str,
    /// Whether objects live in namespaces.
    pub namespaced: bool,
    /// kubectl short names.
    pub short_names: &'static [&'static str],
    /// Verbs advertised in discovery.
    pub verbs: &'static [&'static str],
    /// The fields the apiserver's encoder writes for the zero value of the kind, after
    /// `metadata`: what the object of a BOOKMARK carries after its `resourceVersion`.
    pub zero_fields: &'static str,
}

/// The verbs of a resource with objects.
const RW: &[&str] = &[
    "create",
    "delete",
    "deletecollection",
    "get",
    "list",
    "patch",
    "update",
    "watch",
];
/// Namespaces: no `deletecollection`.
const RW_BUT_DELETECOLLECTION: &[&str] = &[
    "create", "delete", "get", "list", "patch", "update", "watch",
];
/// The verb of a review endpoint.
const CREATE: &[&str] = &["create"];

/// Every resource Bulwark or its simulated apiserver knows by name: those with objects,
/// then the review endpoints.
pub const RESOURCES: &[Resource] = &[
    Resource {
        group: "",
        version: "v1",
        resource: "namespaces",
        singular: "namespace",
        kind: "Namespace",
        namespaced: false,
        short_names: &["ns"],
        verbs: RW_BUT_DELETECOLLECTION,
        zero_fields: ",\"spec\":{},\"status\":{}",
    },
    Resource {
        group: "",
        version: "v1",
        resource: "nodes",
        singular: "node",
        kind: "Node",
        namespaced: false,
        short_names: &["no"],
        verbs: RW,
        zero_fields: ",\"spec\":{},\"status\":{\"daemonEndpoints\":{\"kubeletEndpoint\":{\"Port\":0}},\"nodeInfo\":{\"machineID\":\"\",\"systemUUID\":\"\",\"bootID\":\"\",\"kernelVersion\":\"\",\"osImage\":\"\",\"containerRuntimeVersion\":\"\",\"kubeletVersion\":\"\",\"kubeProxyVersion\":\"\",\"operatingSystem\":\"\",\"architecture\":\"\"}}",
    },
    Resource {
        group: "",
        version: "v1",
        resource: "secrets",
        singular: "secret",
        kind: "Secret",
        namespaced: true,
        short_names: &[],
        verbs: RW,
        zero_fields: "",
    },
    Resource {
        group: "",
        version: "v1",
        resource: "configmaps",
        singular: "configmap",
        kind: "ConfigMap",
        namespaced: true,
        short_names: &["cm"],
        verbs: RW,
        zero_fields: "",
    },
    Resource {
        group: "",
        version: "v1",
        resource: "endpoints",
        singular: "endpoints",
        kind: "Endpoints",
        namespaced: true,
        short_names: &["ep"],
        verbs: RW,
        zero_fields: "",
    },
    Resource {
        group: "",
        version: "v1",
        resource: "pods",
        singular: "pod",
        kind: "Pod",
        namespaced: true,
        short_names: &["po"],
        verbs: RW,
        zero_fields: ",\"spec\":{\"containers\":null},\"status\":{}",
    },
    Resource {
        group: "",
        version: "v1",
        resource: "services",
        singular: "service",
        kind: "Service",
        namespaced: true,
        short_names: &["svc"],
        verbs: RW,
        zero_fields: ",\"spec\":{},\"status\":{\"loadBalancer\":{}}",
    },
    Resource {
        group: "",
        version: "v1",
        resource: "events",
        singular: "event",
        kind: "Event",
        namespaced: true,
        short_names: &["ev"],
        verbs: RW,
        zero_fields: ",\"involvedObject\":{},\"source\":{},\"firstTimestamp\":null,\"lastTimestamp\":null,\"eventTime\":null,\"reportingComponent\":\"\",\"reportingInstance\":\"\"",
    },
    Resource {
        group: "discovery.k8s.io",
        version: "v1",
        resource: "endpointslices",
        singular: "endpointslice",
        kind: "EndpointSlice",
        namespaced: true,
        short_names: &[],
        verbs: RW,
        zero_fields: ",\"addressType\":\"\",\"endpoints\":null,\"ports\":null",
    },
    Resource {
        group: "coordination.k8s.io",
        version: "v1",
        resource: "leases",
        singular: "lease",
        kind: "Lease",
        namespaced: true,
        short_names: &[],
        verbs: RW,
        zero_fields: ",\"spec\":{}",
    },
    Resource {
        group: "authentication.k8s.io",
        version: "v1",
        resource: "tokenreviews",
        singular: "tokenreview",
        kind: "TokenReview",
        namespaced: false,
        short_names: &[],
        verbs: CREATE,
        zero_fields: "",
    },
    Resource {
        group: "authentication.k8s.io",
        version: "v1",
        resource: "selfsubjectreviews",
        singular: "selfsubjectreview",
        kind: "SelfSubjectReview",
        namespaced: false,
        short_names: &[],
        verbs: CREATE,
        zero_fields: "",
    },
    Resource {
        group: "authorization.k8s.io",
        version: "v1",
        resource: "subjectaccessreviews",
        singular: "subjectaccessreview",
        kind: "SubjectAccessReview",
        namespaced: false,
        short_names: &[],
        verbs: CREATE,
        zero_fields: "",
    },
    Resource {
        group: "authorization.k8s.io",
        version: "v1",
        resource: "selfsubjectaccessreviews",
        singular: "selfsubjectaccessreview",
        kind: "SelfSubjectAccessReview",
        namespaced: false,
        short_names: &[],
        verbs: CREATE,
        zero_fields: "",
    },
];

impl Resource {
    /// `v1` or `group/v1`.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.to_string()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    /// The store key: `secrets` or `endpointslices.discovery.k8s.io`.
    pub fn key(&self) -> String {
        if self.group.is_empty() {
            self.resource.to_string()
        } else {
            format!("{}.{}", self.resource, self.group)
        }
    }

    /// Whether the resource has objects (it is not a review endpoint, which only creates).
    pub fn stored(&self) -> bool {
        self.verbs.len() > 1
    }
}

/// The resource of this group and kind.
pub fn by_kind(group: &str, kind: &str) -> Option<&'static Resource> {
    RESOURCES
        .iter()
        .find(|r| r.group == group && r.kind == kind)
}

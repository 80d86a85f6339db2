//! What a real apiserver serves, for `rules check`'s warnings on API groups and resources
//! that no request can carry: the groups from the recorded discovery in `fixtures/` (a
//! kube-apiserver v1.36's `/apis`), the resources of each from k8s-openapi's v1.36 types.

use std::collections::BTreeSet;
use std::sync::LazyLock;

use k8s_openapi::Resource;

/// The recorded `/apis` exchange of a kube-apiserver v1.36 (fixtures/README.md).
const RECORDED_APIS: &str =
    include_str!("../../../fixtures/kube-apiserver-v1.36/api_versions-list.json");

/// `(group, resource)` of every built-in type with a collection, core group `""`.
macro_rules! resources {
    ($($ty:path,)*) => {
        &[$((<$ty as Resource>::GROUP, <$ty as Resource>::URL_PATH_SEGMENT),)*]
    };
}

static BUILTIN_RESOURCES: &[(&str, &str)] = resources!(
    k8s_openapi::api::admissionregistration::v1::MutatingAdmissionPolicy,
    k8s_openapi::api::admissionregistration::v1::MutatingAdmissionPolicyBinding,
    k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration,
    k8s_openapi::api::admissionregistration::v1::ValidatingAdmissionPolicy,
    k8s_openapi::api::admissionregistration::v1::ValidatingAdmissionPolicyBinding,
    k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration,
    k8s_openapi::api::admissionregistration::v1alpha1::MutatingAdmissionPolicy,
    k8s_openapi::api::admissionregistration::v1alpha1::MutatingAdmissionPolicyBinding,
    k8s_openapi::api::admissionregistration::v1beta1::MutatingAdmissionPolicy,
    k8s_openapi::api::admissionregistration::v1beta1::MutatingAdmissionPolicyBinding,
    k8s_openapi::api::apiserverinternal::v1alpha1::StorageVersion,
    k8s_openapi::api::apps::v1::ControllerRevision,
    k8s_openapi::api::apps::v1::DaemonSet,
    k8s_openapi::api::apps::v1::Deployment,
    k8s_openapi::api::apps::v1::ReplicaSet,
    k8s_openapi::api::apps::v1::StatefulSet,
    k8s_openapi::api::authentication::v1::SelfSubjectReview,
    k8s_openapi::api::authentication::v1::TokenReview,
    k8s_openapi::api::authorization::v1::LocalSubjectAccessReview,
    k8s_openapi::api::authorization::v1::SelfSubjectAccessReview,
    k8s_openapi::api::authorization::v1::SelfSubjectRulesReview,
    k8s_openapi::api::authorization::v1::SubjectAccessReview,
    k8s_openapi::api::autoscaling::v1::HorizontalPodAutoscaler,
    k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler,
    k8s_openapi::api::batch::v1::CronJob,
    k8s_openapi::api::batch::v1::Job,
    k8s_openapi::api::certificates::v1::CertificateSigningRequest,
    k8s_openapi::api::certificates::v1alpha1::ClusterTrustBundle,
    k8s_openapi::api::certificates::v1beta1::ClusterTrustBundle,
    k8s_openapi::api::certificates::v1beta1::PodCertificateRequest,
    k8s_openapi::api::coordination::v1::Lease,
    k8s_openapi::api::coordination::v1alpha2::LeaseCandidate,
    k8s_openapi::api::coordination::v1beta1::LeaseCandidate,
    k8s_openapi::api::core::v1::Binding,
    k8s_openapi::api::core::v1::ComponentStatus,
    k8s_openapi::api::core::v1::ConfigMap,
    k8s_openapi::api::core::v1::Endpoints,
    k8s_openapi::api::core::v1::Event,
    k8s_openapi::api::core::v1::LimitRange,
    k8s_openapi::api::core::v1::Namespace,
    k8s_openapi::api::core::v1::Node,
    k8s_openapi::api::core::v1::PersistentVolume,
    k8s_openapi::api::core::v1::PersistentVolumeClaim,
    k8s_openapi::api::core::v1::Pod,
    k8s_openapi::api::core::v1::PodTemplate,
    k8s_openapi::api::core::v1::ReplicationController,
    k8s_openapi::api::core::v1::ResourceQuota,
    k8s_openapi::api::core::v1::Secret,
    k8s_openapi::api::core::v1::Service,
    k8s_openapi::api::core::v1::ServiceAccount,
    k8s_openapi::api::discovery::v1::EndpointSlice,
    k8s_openapi::api::events::v1::Event,
    k8s_openapi::api::flowcontrol::v1::FlowSchema,
    k8s_openapi::api::flowcontrol::v1::PriorityLevelConfiguration,
    k8s_openapi::api::networking::v1::IPAddress,
    k8s_openapi::api::networking::v1::Ingress,
    k8s_openapi::api::networking::v1::IngressClass,
    k8s_openapi::api::networking::v1::NetworkPolicy,
    k8s_openapi::api::networking::v1::ServiceCIDR,
    k8s_openapi::api::networking::v1beta1::IPAddress,
    k8s_openapi::api::networking::v1beta1::ServiceCIDR,
    k8s_openapi::api::node::v1::RuntimeClass,
    k8s_openapi::api::policy::v1::PodDisruptionBudget,
    k8s_openapi::api::rbac::v1::ClusterRole,
    k8s_openapi::api::rbac::v1::ClusterRoleBinding,
    k8s_openapi::api::rbac::v1::Role,
    k8s_openapi::api::rbac::v1::RoleBinding,
    k8s_openapi::api::resource::v1::DeviceClass,
    k8s_openapi::api::resource::v1::ResourceClaim,
    k8s_openapi::api::resource::v1::ResourceClaimTemplate,
    k8s_openapi::api::resource::v1::ResourceSlice,
    k8s_openapi::api::resource::v1alpha3::DeviceTaintRule,
    k8s_openapi::api::resource::v1alpha3::ResourcePoolStatusRequest,
    k8s_openapi::api::resource::v1beta1::DeviceClass,
    k8s_openapi::api::resource::v1beta1::ResourceClaim,
    k8s_openapi::api::resource::v1beta1::ResourceClaimTemplate,
    k8s_openapi::api::resource::v1beta1::ResourceSlice,
    k8s_openapi::api::resource::v1beta2::DeviceClass,
    k8s_openapi::api::resource::v1beta2::DeviceTaintRule,
    k8s_openapi::api::resource::v1beta2::ResourceClaim,
    k8s_openapi::api::resource::v1beta2::ResourceClaimTemplate,
    k8s_openapi::api::resource::v1beta2::ResourceSlice,
    k8s_openapi::api::scheduling::v1::PriorityClass,
    k8s_openapi::api::scheduling::v1alpha2::PodGroup,
    k8s_openapi::api::scheduling::v1alpha2::Workload,
    k8s_openapi::api::storage::v1::CSIDriver,
    k8s_openapi::api::storage::v1::CSINode,
    k8s_openapi::api::storage::v1::CSIStorageCapacity,
    k8s_openapi::api::storage::v1::StorageClass,
    k8s_openapi::api::storage::v1::VolumeAttachment,
    k8s_openapi::api::storage::v1::VolumeAttributesClass,
    k8s_openapi::api::storage::v1beta1::VolumeAttributesClass,
    k8s_openapi::api::storagemigration::v1beta1::StorageVersionMigration,
    k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
    k8s_openapi::apimachinery::pkg::apis::meta::v1::Status,
    k8s_openapi::kube_aggregator::pkg::apis::apiregistration::v1::APIService,
);

/// The API groups the recorded apiserver serves, the core group `""` included.
pub(crate) fn groups() -> &'static BTreeSet<String> {
    static GROUPS: LazyLock<BTreeSet<String>> = LazyLock::new(|| {
        let mut groups = recorded_groups(RECORDED_APIS);
        groups.insert(String::new());
        groups
    });
    &GROUPS
}

/// The group names in a recorded discovery exchange (an `APIGroupList` answer).
fn recorded_groups(recording: &str) -> BTreeSet<String> {
    let exchanges: Vec<serde_json::Value> = serde_json::from_str(recording).unwrap_or_default();
    exchanges
        .iter()
        .filter_map(|exchange| exchange["response_body"].as_str())
        .filter_map(|body| serde_json::from_str::<serde_json::Value>(body).ok())
        .filter(|body| body["kind"] == "APIGroupList")
        .flat_map(|body| {
            body["groups"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|g| g["name"].as_str().map(str::to_owned))
                .collect::<Vec<_>>()
        })
        .collect()
}

/// The resources of a served group (empty for a group the apiserver does not serve).
pub(crate) fn resources(group: &str) -> Vec<&'static str> {
    let mut names: Vec<&'static str> = BUILTIN_RESOURCES
        .iter()
        .filter(|(g, _)| *g == group)
        .map(|(_, r)| *r)
        .collect();
    names.sort_unstable();
    names.dedup();
    names
}

/// The closest of `candidates` to `word` by edit distance, when close enough to be a
/// likely misspelling (at most a third of the word's length, and at least 1).
pub(crate) fn closest<'a>(
    word: &str,
    candidates: impl IntoIterator<Item = &'a str>,
) -> Option<&'a str> {
    let limit = (word.chars().count() / 3).max(1);
    candidates
        .into_iter()
        .map(|c| (strsim::damerau_levenshtein(word, c), c))
        .filter(|(d, _)| *d <= limit)
        .min_by_key(|(d, c)| (*d, *c))
        .map(|(_, c)| c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_recorded_groups_are_read_with_the_core_group() {
        let groups = groups();
        for group in [
            "",
            "apps",
            "batch",
            "coordination.k8s.io",
            "discovery.k8s.io",
        ] {
            assert!(groups.contains(group), "{group:?} in {groups:?}");
        }
        assert!(!groups.contains("core"));
    }

    #[test]
    fn resources_are_plural_and_by_group() {
        assert!(resources("").contains(&"pods"));
        assert!(resources("").contains(&"secrets"));
        assert!(!resources("").contains(&"deployments"));
        assert!(resources("apps").contains(&"deployments"));
        assert!(resources("coordination.k8s.io").contains(&"leases"));
        assert!(resources("example.com").is_empty());
    }

    #[test]
    fn closest_finds_misspellings_only() {
        let levels = ["list-heavy", "catch-all", "exempt"];
        assert_eq!(closest("list-hevy", levels), Some("list-heavy"));
        assert_eq!(closest("exmept", levels), Some("exempt"));
        assert_eq!(closest("workloads", levels), None);
    }
}

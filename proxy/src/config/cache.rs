//! The `cache` section: the watch-fed cache and what it keeps.

use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::Quantity;
use super::problems::{Problems, defer};
use super::values::{is_dns_label, is_object_name};

/// The watch-fed cache (DESIGN.md step 7).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct Cache {
    /// Whether the cache runs at all.
    pub enabled: bool,
    /// Resources kept, as `resource` for the core group or `resource.group`.
    #[serde(deserialize_with = "resources")]
    pub resources: Vec<GroupResource>,
    /// Namespaces never served from the cache.
    pub exclude_namespaces: Vec<String>,
    /// Objects never served from the cache, as `namespace/name` (or `name` for
    /// cluster-scoped objects); a list or watch that could include one goes upstream.
    #[serde(deserialize_with = "exclude_names")]
    pub exclude_names: Vec<ExcludedName>,
    /// Events kept per resource for watches that resume.
    pub ring_size: usize,
    /// How long `/readyz` waits for the caches' first full lists before it reports ready
    /// anyway (cacheable requests go upstream until a cache is synced).
    #[serde(with = "humantime_serde")]
    pub sync_cap: Duration,
    /// The largest bounded staleness a rule may grant (a rule's `staleness` above it is
    /// capped to it).
    #[serde(with = "humantime_serde")]
    pub max_staleness: Duration,
    /// Bytes of encoded LIST responses kept for reuse (an LRU), as a number or a quantity.
    pub list_cache_bytes: Quantity,
    /// Events buffered per watcher; a watcher that falls this far behind is disconnected.
    pub watcher_buffer: usize,
    /// How often open watches served from the cache are authorized again (with jitter).
    #[serde(with = "humantime_serde")]
    pub reauthorize_interval: Duration,
    /// How long a SubjectAccessReview answer for a cache read is reused.
    #[serde(with = "humantime_serde")]
    pub access_review_ttl: Duration,
    /// How often a watch served from the cache that allows bookmarks gets one (the
    /// apiserver sends about one a minute).
    #[serde(with = "humantime_serde")]
    pub bookmark_interval: Duration,
    /// Whether the informers start (and relist) with a WatchList (`sendInitialEvents`),
    /// which spares the apiserver a LIST; an upstream that refuses it gets a paginated
    /// LIST instead.
    pub watch_list: bool,
}

impl Default for Cache {
    fn default() -> Self {
        Self {
            enabled: true,
            resources: vec![
                GroupResource::core("secrets"),
                GroupResource::core("endpoints"),
                GroupResource {
                    group: "discovery.k8s.io".into(),
                    resource: "endpointslices".into(),
                },
            ],
            exclude_namespaces: Vec::new(),
            exclude_names: Vec::new(),
            ring_size: 10_000,
            sync_cap: Duration::from_secs(60),
            max_staleness: Duration::from_secs(10),
            list_cache_bytes: Quantity(256 * 1024 * 1024),
            watcher_buffer: 1_000,
            reauthorize_interval: Duration::from_secs(300),
            access_review_ttl: Duration::from_secs(10),
            bookmark_interval: Duration::from_secs(60),
            watch_list: true,
        }
    }
}

impl Cache {
    pub(super) fn validate(&self, p: &mut Problems) {
        let cache = self;
        p.parsed("cache.resources");
        for (i, namespace) in cache.exclude_namespaces.iter().enumerate() {
            if !is_dns_label(namespace) {
                p.add(
                    format!("cache.excludeNamespaces[{i}]"),
                    format!("{namespace:?} is not a namespace name"),
                );
            }
        }
        p.parsed("cache.excludeNames");
        p.nonzero("cache.ringSize", cache.ring_size as u64);
        p.positive("cache.syncCap", cache.sync_cap);
        p.nonzero("cache.listCacheBytes", cache.list_cache_bytes.0);
        p.nonzero("cache.watcherBuffer", cache.watcher_buffer as u64);
        p.positive("cache.reauthorizeInterval", cache.reauthorize_interval);
        p.positive("cache.accessReviewTtl", cache.access_review_ttl);
        p.positive("cache.bookmarkInterval", cache.bookmark_interval);
    }
}

/// A resource of an API group, e.g. `endpointslices` of `discovery.k8s.io`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct GroupResource {
    /// The API group; `""` for the core group.
    pub group: String,
    /// The resource (plural, lowercase).
    pub resource: String,
}

impl GroupResource {
    /// A resource of the core group.
    pub fn core(resource: &str) -> GroupResource {
        GroupResource {
            group: String::new(),
            resource: resource.to_owned(),
        }
    }

    /// Parses `resource` (core group) or `resource.group`.
    pub fn parse(text: &str) -> Option<GroupResource> {
        let (resource, group, group_ok) = match text.split_once('.') {
            Some((resource, group)) => (resource, group, group.split('.').all(is_dns_label)),
            None => (text, "", true),
        };
        (is_dns_label(resource) && group_ok && group.len() <= 253).then(|| GroupResource {
            group: group.to_owned(),
            resource: resource.to_owned(),
        })
    }
}

impl Serialize for GroupResource {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// Reads `cache.resources`: each a [`GroupResource`], none twice; a problem is set aside
/// for validation and the entry left out.
fn resources<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<GroupResource>, D::Error> {
    let texts = Vec::<String>::deserialize(d)?;
    let mut kept: Vec<GroupResource> = Vec::new();
    for (i, text) in texts.iter().enumerate() {
        let field = format!("cache.resources[{i}]");
        if let Some(gr) = GroupResource::parse(text) {
            if let Some(first) = texts[..i].iter().position(|r| r == text) {
                defer(field, format!("{text:?} repeats cache.resources[{first}]"))?;
            } else {
                kept.push(gr);
            }
        } else {
            defer(
                field,
                format!(
                    "{text:?} is not a resource name such as \"secrets\" or \"endpointslices.discovery.k8s.io\""
                ),
            )?;
        }
    }
    Ok(kept)
}

/// An object never served from the cache: `namespace/name`, or `name`, which matches
/// that name in every namespace and cluster-scoped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExcludedName {
    /// The namespace; `None` for any.
    pub namespace: Option<String>,
    /// The object's name.
    pub name: String,
}

impl std::str::FromStr for ExcludedName {
    type Err = String;

    fn from_str(entry: &str) -> Result<Self, Self::Err> {
        let (namespace, name) = match entry.split_once('/') {
            Some((namespace, name)) if is_dns_label(namespace) => (Some(namespace), name),
            Some(_) => return Err(format!("{entry:?} is not namespace/name or name")),
            None => (None, entry),
        };
        if !is_object_name(name) {
            return Err(format!("{entry:?} is not namespace/name or name"));
        }
        Ok(ExcludedName {
            namespace: namespace.map(str::to_owned),
            name: name.to_owned(),
        })
    }
}

impl std::fmt::Display for ExcludedName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.namespace {
            Some(namespace) => write!(f, "{namespace}/{}", self.name),
            None => f.write_str(&self.name),
        }
    }
}

impl Serialize for ExcludedName {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// Reads `cache.excludeNames`, each an [`ExcludedName`]; a problem is set aside for
/// validation and the entry left out.
fn exclude_names<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<ExcludedName>, D::Error> {
    let mut kept = Vec::new();
    for (i, entry) in Vec::<String>::deserialize(d)?.iter().enumerate() {
        match entry.parse() {
            Ok(name) => kept.push(name),
            Err(why) => defer(format!("cache.excludeNames[{i}]"), why)?,
        }
    }
    Ok(kept)
}

impl std::fmt::Display for GroupResource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.group.is_empty() {
            f.write_str(&self.resource)
        } else {
            write!(f, "{}.{}", self.resource, self.group)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_resources_are_a_label_and_an_optional_subdomain() {
        let gr = |s: &str| GroupResource::parse(s).map(|g| (g.group, g.resource));
        assert_eq!(gr("secrets"), Some(("".into(), "secrets".into())));
        assert_eq!(
            gr("leases.coordination.k8s.io"),
            Some(("coordination.k8s.io".into(), "leases".into()))
        );
        for bad in [
            "",
            "Secrets",
            "secrets.",
            ".secrets",
            "pods/status",
            "a..b",
            "-x",
        ] {
            assert_eq!(gr(bad), None, "{bad:?} accepted");
        }
    }
}

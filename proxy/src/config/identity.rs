//! The `identity` section: how clients are identified and how that identity goes upstream.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::problems::Problems;

/// How clients are identified and how the identity goes upstream.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct Identity {
    /// `front-proxy` (default), `impersonate` or `passthrough`.
    pub mode: IdentityMode,
    /// Paths forwarded without credentials on their own upstream connection.
    pub anonymous: Vec<String>,
    /// The TokenReview cache.
    pub token_review: TokenReview,
}

impl Default for Identity {
    fn default() -> Self {
        Self {
            mode: IdentityMode::FrontProxy,
            anonymous: [
                "/version",
                "/healthz",
                "/livez",
                "/readyz",
                "/.well-known/openid-configuration",
                "/openid/v1/jwks",
                "/api/v1/namespaces/kube-public/configmaps/cluster-info",
            ]
            .into_iter()
            .map(String::from)
            .collect(),
            token_review: TokenReview::default(),
        }
    }
}

/// How a client's identity is forwarded upstream (DESIGN.md step 3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum IdentityMode {
    /// Front-proxy certificate plus `X-Remote-*` headers; needs no impersonation rights.
    FrontProxy,
    /// Bulwark's own identity plus `Impersonate-*` headers.
    Impersonate,
    /// The client's bearer token is sent unchanged.
    Passthrough,
}

/// The cache of TokenReview results, and the bounds on the reviews it makes.
///
/// A token in neither cache costs one upstream TokenReview before any rule applies, so
/// reviews are bounded on their own: per source prefix, overall (shared fairly between
/// prefixes), and in flight. An accepted token is re-reviewed in the background before its
/// `ttl` ends, with a budget of its own that unknown tokens cannot spend.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct TokenReview {
    /// How long an accepted token is trusted (capped by the token's own expiry). The
    /// apiserver's own cache of token checks keeps a result 10 s, so a revoked token stops
    /// working about as soon as it would without Bulwark.
    #[serde(with = "humantime_serde")]
    pub ttl: Duration,
    /// How long before `ttl` ends a request with the token starts its re-review in the
    /// background, so that a token in use never waits for one (at most half the `ttl`).
    #[serde(with = "humantime_serde")]
    pub refresh_ahead: Duration,
    /// The longest an accepted token is served since the review that last accepted it,
    /// while its re-reviews fail or cannot be made (never past the token's own expiry).
    /// A re-review that rejects the token ends it at once.
    #[serde(with = "humantime_serde")]
    pub max_age: Duration,
    /// How long a rejected token is remembered (a review that failed is not).
    #[serde(with = "humantime_serde")]
    pub failure_ttl: Duration,
    /// Most accepted tokens remembered.
    pub max_entries: usize,
    /// Most rejected tokens remembered, in a cache of their own so that a flood of bad
    /// tokens cannot push good ones out.
    pub max_rejected_entries: usize,
    /// Longest bearer token reviewed; a longer one gets 401 without a review.
    pub max_token_bytes: usize,
    /// Reviews of unknown tokens Bulwark makes for all clients together. Once the bucket
    /// is below half full, each client prefix gets a fair share of it: the rate divided
    /// among the prefixes active in the last second, and one more.
    pub rate: ReviewRate,
    /// Reviews of unknown tokens Bulwark makes for one client address (IPv6 by its /64).
    pub per_source: ReviewRate,
    /// Client addresses (and prefixes, for the fair share) whose review rate is remembered;
    /// the least recently seen beyond this start again with a full bucket.
    pub max_sources: usize,
    /// Re-reviews of accepted tokens, apart from `rate` and `perSource` so that unknown
    /// tokens cannot spend them.
    pub refresh_rate: ReviewRate,
    /// Reviews of unknown tokens in flight at once. 128: when Bulwark starts (or pods
    /// are first led through it), every pod's token is new, and at 32 in flight the
    /// `cluster` scenario's 2,000 pods on 1,000 nodes got thousands of 429s in the first
    /// seconds while the apiservers answered each review in tens of milliseconds.
    pub max_concurrent: usize,
    /// Re-reviews of accepted tokens in flight at once, apart from `maxConcurrent`.
    pub max_concurrent_refreshes: usize,
    /// How long a request waits for a review to start while `maxConcurrent` are in flight
    /// before it gets 429 (and a re-review waits while `maxConcurrentRefreshes` are).
    #[serde(with = "humantime_serde")]
    pub max_wait: Duration,
    /// A file where the client prefixes that had tokens accepted in the last day are kept
    /// (written every minute and at the drain, read at start), so that after a restart,
    /// when every token is new, they still get the larger share of reviews a flood of
    /// unknown prefixes cannot take. A file that does not read at start (too large to be
    /// one Bulwark wrote, not text) is a warning and ignored. `None`: remembered in memory
    /// only.
    pub memory_file: Option<PathBuf>,
}

impl Default for TokenReview {
    fn default() -> Self {
        Self {
            ttl: Duration::from_secs(10),
            refresh_ahead: Duration::from_secs(3),
            max_age: Duration::from_secs(60),
            failure_ttl: Duration::from_secs(10),
            max_entries: 10_000,
            max_rejected_entries: 1_000,
            max_token_bytes: 16 * 1024,
            rate: ReviewRate {
                qps: 500.0,
                burst: 1_000,
            },
            per_source: ReviewRate {
                qps: 20.0,
                burst: 100,
            },
            max_sources: 10_000,
            refresh_rate: ReviewRate {
                qps: 500.0,
                burst: 1_000,
            },
            max_concurrent: 128,
            max_concurrent_refreshes: 8,
            max_wait: Duration::from_secs(1),
            memory_file: None,
        }
    }
}

/// A token bucket of TokenReviews.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ReviewRate {
    /// Reviews per second, sustained.
    pub qps: f64,
    /// Reviews allowed at once on a full bucket.
    pub burst: u32,
}

impl Identity {
    /// `front_proxy` says whether `upstream.frontProxy` is set.
    pub(super) fn validate(&self, front_proxy: bool, p: &mut Problems) {
        let id = self;
        if id.mode == IdentityMode::FrontProxy && !front_proxy {
            p.add(
                "upstream.frontProxy",
                "required when identity.mode is front-proxy (the default)",
            );
        }
        for (i, path) in id.anonymous.iter().enumerate() {
            let field = format!("identity.anonymous[{i}]");
            if !path.starts_with('/') {
                p.add(field, format!("{path:?} must start with '/'"));
            } else if path.contains(['?', '#']) {
                p.add(
                    field,
                    format!("{path:?} must be a path without query or fragment"),
                );
            }
        }
        let tr = &id.token_review;
        p.positive("identity.tokenReview.ttl", tr.ttl);
        if tr.max_age < tr.ttl {
            p.add("identity.tokenReview.maxAge", "must be at least ttl");
        }
        p.positive("identity.tokenReview.failureTtl", tr.failure_ttl);
        p.nonzero("identity.tokenReview.maxEntries", tr.max_entries as u64);
        p.nonzero(
            "identity.tokenReview.maxRejectedEntries",
            tr.max_rejected_entries as u64,
        );
        p.nonzero(
            "identity.tokenReview.maxTokenBytes",
            tr.max_token_bytes as u64,
        );
        for (field, rate) in [
            ("identity.tokenReview.rate", tr.rate),
            ("identity.tokenReview.perSource", tr.per_source),
            ("identity.tokenReview.refreshRate", tr.refresh_rate),
        ] {
            if !(rate.qps.is_finite() && rate.qps > 0.0) {
                p.add(format!("{field}.qps"), "must be greater than 0");
            }
            p.nonzero(&format!("{field}.burst"), u64::from(rate.burst));
        }
        p.nonzero("identity.tokenReview.maxSources", tr.max_sources as u64);
        p.nonzero(
            "identity.tokenReview.maxConcurrent",
            tr.max_concurrent as u64,
        );
        p.nonzero(
            "identity.tokenReview.maxConcurrentRefreshes",
            tr.max_concurrent_refreshes as u64,
        );
        p.positive("identity.tokenReview.maxWait", tr.max_wait);
    }
}

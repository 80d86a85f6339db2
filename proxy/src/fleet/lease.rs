//! The fleet's Leases at the apiservers: this replica's own, written with Bulwark's own
//! credential (as token reviews and the cache's informers are), and everyone's, read by one
//! LIST of the namespace per renew period; and which of them the fleet believes
//! ([`Check`]): any identity that may write Leases in the namespace can write one, so a
//! Lease counts only when it is shaped as Bulwark writes its own and, with a key, signed.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use base64::Engine as _;

use http::StatusCode;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;

use serde::Serialize;

use super::share::{Demand, Member};
use crate::BoxFuture;
use crate::own::{self, Call, CallError};

/// The annotation a member's [`Demand`] travels in.
pub const DEMAND_ANNOTATION: &str = "bulwark.io/demand";

/// The annotation carrying the Lease's HMAC-SHA256 ([`Keys`]), in base64.
pub const MAC_ANNOTATION: &str = "bulwark.io/mac";

/// How far ahead of this replica's clock another member's renewal may be: the clocks of
/// nodes kept by NTP agree far closer. A Lease renewed further ahead would count for as long
/// as its writer likes (the audit's year), so it is rejected.
pub const MAX_CLOCK_AHEAD: Duration = Duration::from_secs(5);

/// The shortest key: as long as the HMAC-SHA256 output, the strength it can have.
pub const MIN_KEY_BYTES: usize = 32;

/// The largest Lease list read: a namespace of a few Leases is a few KiB.
const MAX_LIST_BYTES: usize = 4 << 20;

/// Why a Lease could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    /// The call failed: no apiserver answered, one refused, or the answer is no Lease.
    #[error(transparent)]
    Call(#[from] CallError),
    /// The store is unreachable (tests' in-memory stores).
    #[error("lease store unreachable")]
    Unreachable,
}

/// Where the fleet's Leases live: the apiservers, or memory in tests.
pub trait LeaseStore: Send + Sync + 'static {
    /// Creates or renews this replica's Lease (built by [`lease_object`]).
    fn write(&self, lease: &Lease) -> BoxFuture<(), LeaseError>;
    /// Every Lease of the namespace, as the apiserver has them; [`Check`] picks the fleet's.
    fn list(&self) -> BoxFuture<Vec<Lease>, LeaseError>;
}

/// The fleet's HMAC keys, from a file of one or more keys, one a line (each at least
/// [`MIN_KEY_BYTES`] bytes, taken as written). The first signs this replica's Lease; any
/// verifies the others', so a new key can be added everywhere before it signs.
#[derive(Clone)]
pub struct Keys(Vec<ring::hmac::Key>);

impl std::fmt::Debug for Keys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Keys({} keys)", self.0.len())
    }
}

/// Why a key file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// It cannot be read.
    #[error("{path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        source: std::io::Error,
    },
    /// It holds no key.
    #[error("no key (one or more keys, one a line)")]
    Empty,
    /// A key is too short to be a secret.
    #[error("key on line {line} is {len} bytes: at least {MIN_KEY_BYTES}")]
    Short {
        /// Its line, from 1.
        line: usize,
        /// Its length.
        len: usize,
    },
}

impl Keys {
    /// The keys in `text`: each non-blank line, trimmed.
    pub fn parse(text: &[u8]) -> Result<Keys, KeyError> {
        let mut keys = Vec::new();
        for (i, line) in text.split(|&b| b == b'\n').enumerate() {
            let key = line.trim_ascii();
            if key.is_empty() {
                continue;
            }
            if key.len() < MIN_KEY_BYTES {
                return Err(KeyError::Short {
                    line: i + 1,
                    len: key.len(),
                });
            }
            keys.push(ring::hmac::Key::new(ring::hmac::HMAC_SHA256, key));
        }
        if keys.is_empty() {
            return Err(KeyError::Empty);
        }
        Ok(Keys(keys))
    }

    /// The keys in the file at `path`.
    pub fn read(path: &Path) -> Result<Keys, KeyError> {
        let text = std::fs::read(path).map_err(|source| KeyError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Keys::parse(&text)
    }

    fn sign(&self, message: &[u8]) -> String {
        base64::engine::general_purpose::STANDARD.encode(ring::hmac::sign(&self.0[0], message))
    }

    fn verify(&self, message: &[u8], mac: &str) -> bool {
        let Ok(mac) = base64::engine::general_purpose::STANDARD.decode(mac) else {
            return false;
        };
        // `ring` compares in constant time.
        self.0
            .iter()
            .any(|key| ring::hmac::verify(key, message, &mac).is_ok())
    }
}

/// What a Lease's MAC covers: everything the fleet reads of it, and where it lives, so
/// that a signed Lease cannot be moved to another name or namespace, or changed.
fn signed_text(
    namespace: &str,
    name: &str,
    holder: &str,
    renew_micros: i64,
    duration_secs: i32,
    demand: &str,
) -> Vec<u8> {
    format!(
        "bulwark.io/fleet-lease/v1\n{namespace}\n{name}\n{holder}\n{renew_micros}\n{duration_secs}\n{demand}"
    )
    .into_bytes()
}

/// The Lease object for `member`, named `name` in `namespace`, signed with the first of
/// `keys` when there are keys.
pub fn lease_object(
    name: &str,
    namespace: &str,
    member: &Member,
    resource_version: Option<String>,
    keys: Option<&Keys>,
) -> Lease {
    let demand = serde_json::to_string(&member.demand).unwrap_or_else(|_| "{}".into());
    let micros = member
        .renewed
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX));
    let renewed = Timestamp::from_microsecond(micros).unwrap_or(Timestamp::UNIX_EPOCH);
    let duration = i32::try_from(member.duration.as_secs()).unwrap_or(i32::MAX);
    let mut annotations: std::collections::BTreeMap<String, String> = Default::default();
    if let Some(keys) = keys {
        let text = signed_text(
            namespace,
            name,
            &member.identity,
            renewed.as_microsecond(),
            duration,
            &demand,
        );
        annotations.insert(MAC_ANNOTATION.to_string(), keys.sign(&text));
    }
    annotations.insert(DEMAND_ANNOTATION.to_string(), demand);
    Lease {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            namespace: Some(namespace.to_string()),
            resource_version,
            annotations: Some(annotations),
            labels: Some(
                [(
                    "app.kubernetes.io/managed-by".to_string(),
                    "bulwark".to_string(),
                )]
                .into(),
            ),
            ..ObjectMeta::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(member.identity.clone()),
            lease_duration_seconds: Some(duration),
            renew_time: Some(MicroTime(renewed)),
            ..LeaseSpec::default()
        }),
    }
}

/// Why a Lease of the fleet's (named with its prefix, unexpired) does not count.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum Rejection {
    /// Its name is not the prefix followed by its holder: Bulwark never writes one, and
    /// counting it would let a writer speak for a real member.
    Name,
    /// It counts for longer than `fleet.leaseDuration`.
    Duration,
    /// Renewed more than [`MAX_CLOCK_AHEAD`] ahead of this replica's clock.
    Future,
    /// A key is configured and its MAC is missing or wrong.
    Signature,
}

impl Rejection {
    /// The `reason` label of `bulwark_fleet_leases_rejected_total`.
    pub fn as_str(self) -> &'static str {
        match self {
            Rejection::Name => "name",
            Rejection::Duration => "duration",
            Rejection::Future => "future",
            Rejection::Signature => "signature",
        }
    }

    /// Every reason, for the metric's series.
    pub const ALL: [Rejection; 4] = [
        Rejection::Name,
        Rejection::Duration,
        Rejection::Future,
        Rejection::Signature,
    ];
}

/// What one Lease of the namespace is to the fleet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Not the fleet's (another prefix), not held, or expired by its own account: it can
    /// change no split, so it is neither counted nor rejected.
    Ignored,
    /// The fleet's, and it does not count.
    Rejected(Rejection),
    /// A member.
    Member(Member),
}

/// Which Leases of the namespace are members: the fleet's shape and, with keys, its MAC.
#[derive(Clone, Debug)]
pub struct Check {
    /// The namespace (the MAC covers it).
    pub namespace: String,
    /// `fleet.leasePrefix`.
    pub prefix: String,
    /// `fleet.leaseDuration`: the longest a Lease may count.
    pub duration: Duration,
    /// The fleet's keys; without them Leases are unauthenticated.
    pub keys: Option<Keys>,
    /// With keys: a Lease without a MAC counts too (`fleet.acceptUnsigned`, while the key
    /// is being turned on); one with a wrong MAC never does.
    pub accept_unsigned: bool,
}

impl Check {
    /// What `lease` is at `now`. A demand that does not parse counts as none: the member
    /// still holds a floor.
    pub fn verdict(&self, lease: &Lease, now: SystemTime) -> Verdict {
        let Some(name) = lease.metadata.name.as_deref() else {
            return Verdict::Ignored;
        };
        let Some(suffix) = name.strip_prefix(self.prefix.as_str()) else {
            return Verdict::Ignored;
        };
        let Some(spec) = lease.spec.as_ref() else {
            return Verdict::Ignored;
        };
        let (Some(identity), Some(renew), Some(seconds)) = (
            spec.holder_identity.as_deref(),
            spec.renew_time.as_ref(),
            spec.lease_duration_seconds,
        ) else {
            return Verdict::Ignored;
        };
        let Ok(micros) = u64::try_from(renew.0.as_microsecond()) else {
            return Verdict::Ignored;
        };
        let Ok(secs) = u64::try_from(seconds) else {
            return Verdict::Ignored;
        };
        let renewed = SystemTime::UNIX_EPOCH + Duration::from_micros(micros);
        let duration = Duration::from_secs(secs);
        let expired = renewed
            .checked_add(duration)
            .is_none_or(|until| until <= now);
        if expired {
            return Verdict::Ignored;
        }
        if suffix != identity {
            return Verdict::Rejected(Rejection::Name);
        }
        // Shorter is allowed: such a Lease only counts for less (a fleet whose configured
        // duration is being lowered keeps its members through the rollout).
        if duration.is_zero() || duration > self.duration {
            return Verdict::Rejected(Rejection::Duration);
        }
        if now
            .checked_add(MAX_CLOCK_AHEAD)
            .is_some_and(|latest| renewed > latest)
        {
            return Verdict::Rejected(Rejection::Future);
        }
        let annotations = lease.metadata.annotations.as_ref();
        let demand_text = annotations.and_then(|a| a.get(DEMAND_ANNOTATION));
        if let Some(keys) = &self.keys {
            let text = signed_text(
                &self.namespace,
                name,
                identity,
                renew.0.as_microsecond(),
                seconds,
                demand_text.map_or("", String::as_str),
            );
            let good = match annotations.and_then(|a| a.get(MAC_ANNOTATION)) {
                Some(mac) => keys.verify(&text, mac),
                None => self.accept_unsigned,
            };
            if !good {
                return Verdict::Rejected(Rejection::Signature);
            }
        }
        let demand = demand_text
            .and_then(|json| serde_json::from_str::<Demand>(json).ok())
            .unwrap_or_default();
        let created = lease.metadata.creation_timestamp.as_ref().map(|t| {
            let secs = u64::try_from(t.0.as_second()).unwrap_or(0);
            SystemTime::UNIX_EPOCH + Duration::from_secs(secs)
        });
        Verdict::Member(Member {
            identity: identity.to_string(),
            renewed,
            duration,
            created,
            demand,
        })
    }
}

/// The Leases at the apiservers, through Bulwark's own client.
pub struct UpstreamLeases {
    client: own::Client,
    namespace: String,
    name: String,
    timeout: Duration,
    /// The resourceVersion of this replica's Lease as last written: the next renewal is
    /// conditional on it, so a Lease someone else changed is read again, not overwritten
    /// blindly.
    resource_version: Mutex<Option<String>>,
}

impl UpstreamLeases {
    /// The Leases in `namespace`; this replica's is `name`. Each call gives up after
    /// `timeout`.
    pub fn new(client: own::Client, namespace: &str, name: &str, timeout: Duration) -> Self {
        Self {
            client,
            namespace: namespace.to_string(),
            name: name.to_string(),
            timeout,
            resource_version: Mutex::new(None),
        }
    }

    fn collection(&self) -> String {
        format!(
            "/apis/coordination.k8s.io/v1/namespaces/{}/leases",
            self.namespace
        )
    }

    fn own_path(&self) -> String {
        format!("{}/{}", self.collection(), self.name)
    }

    fn known(&self) -> Option<String> {
        self.resource_version
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn remember(&self, resource_version: Option<String>) {
        *self
            .resource_version
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = resource_version;
    }

    /// Creates this replica's Lease, or replaces it conditionally on `known`.
    async fn put_or_create(&self, member: &Lease, known: Option<String>) -> Result<(), LeaseError> {
        let mut lease = member.clone();
        lease.metadata.resource_version = known;
        let call = match lease.metadata.resource_version {
            Some(_) => Call::put(self.own_path(), &lease)?,
            None => Call::post(self.collection(), &lease)?,
        };
        let written: Lease = self
            .client
            .json(call.timeout(self.timeout).max_bytes(MAX_LIST_BYTES))
            .await?;
        self.remember(written.metadata.resource_version);
        Ok(())
    }

    async fn write_once(&self, member: &Lease) -> Result<(), LeaseError> {
        match self.put_or_create(member, self.known()).await {
            Err(LeaseError::Call(e))
                if matches!(
                    e.answered(),
                    Some(StatusCode::CONFLICT | StatusCode::NOT_FOUND)
                ) =>
            {
                // Created before (a restart), changed by someone else, or deleted: read
                // what is there (or learn it is gone) and write once more.
                let call = Call::get(self.own_path())
                    .timeout(self.timeout)
                    .max_bytes(MAX_LIST_BYTES);
                match self.client.json::<Lease>(call).await {
                    Ok(there) => self.remember(there.metadata.resource_version),
                    Err(e) if e.answered() == Some(StatusCode::NOT_FOUND) => self.remember(None),
                    Err(e) => return Err(e.into()),
                }
                self.put_or_create(member, self.known()).await
            }
            result => result,
        }
    }

    async fn list_once(&self) -> Result<Vec<Lease>, LeaseError> {
        let call = Call::get(self.collection())
            .timeout(self.timeout)
            .max_bytes(MAX_LIST_BYTES);
        let list: k8s_openapi::List<Lease> = self.client.json(call).await?;
        Ok(list.items)
    }
}

impl LeaseStore for Arc<UpstreamLeases> {
    fn write(&self, member: &Lease) -> BoxFuture<(), LeaseError> {
        let this = self.clone();
        let member = member.clone();
        Box::pin(async move { this.write_once(&member).await })
    }

    fn list(&self) -> BoxFuture<Vec<Lease>, LeaseError> {
        let this = self.clone();
        Box::pin(async move { this.list_once().await })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::share::Bytes;

    const KEY: &[u8] = b"0123456789abcdef0123456789abcdef";

    fn check(keys: Option<Keys>) -> Check {
        Check {
            namespace: "bulwark".into(),
            prefix: "bulwark-".into(),
            duration: Duration::from_secs(10),
            keys,
            accept_unsigned: false,
        }
    }

    fn member(identity: &str, renewed: SystemTime) -> Member {
        let mut demand = Demand::default();
        demand.bytes.insert(
            "10.0.0.11:6443".into(),
            Bytes {
                wanted: 5,
                in_flight: 3,
            },
        );
        Member {
            identity: identity.into(),
            renewed,
            duration: Duration::from_secs(10),
            created: None,
            demand,
        }
    }

    /// `lease` as the apiserver hands it back: through JSON.
    fn round_trip(lease: &Lease) -> Lease {
        serde_json::from_value(serde_json::to_value(lease).unwrap()).unwrap()
    }

    #[test]
    fn a_member_goes_into_a_lease_and_comes_back_out() {
        let renewed = SystemTime::UNIX_EPOCH + Duration::from_micros(1_700_000_000_123_456);
        let now = renewed + Duration::from_secs(1);
        let member = member("node-a", renewed);
        let lease = lease_object("bulwark-node-a", "bulwark", &member, Some("7".into()), None);
        let json = serde_json::to_value(&lease).unwrap();
        assert_eq!(json["spec"]["renewTime"], "2023-11-14T22:13:20.123456Z");
        assert_eq!(json["spec"]["leaseDurationSeconds"], 10);
        assert_eq!(json["metadata"]["resourceVersion"], "7");
        let back: Lease = serde_json::from_value(json).unwrap();
        let check = check(None);
        assert_eq!(check.verdict(&back, now), Verdict::Member(member.clone()));
        let other = Check {
            prefix: "other-".into(),
            ..check.clone()
        };
        assert_eq!(
            other.verdict(&back, now),
            Verdict::Ignored,
            "not the fleet's"
        );
        assert_eq!(
            check.verdict(&back, renewed + Duration::from_secs(10)),
            Verdict::Ignored,
            "expired: counts for nothing, rejected for nothing"
        );
        let mut garbled = back.clone();
        garbled
            .metadata
            .annotations
            .as_mut()
            .unwrap()
            .insert(DEMAND_ANNOTATION.into(), "{not json".into());
        assert_eq!(
            check.verdict(&garbled, now),
            Verdict::Member(Member {
                demand: Demand::default(),
                ..member
            }),
            "a demand that does not parse counts as none"
        );
        let mut unheld = back;
        unheld.spec.as_mut().unwrap().holder_identity = None;
        assert_eq!(check.verdict(&unheld, now), Verdict::Ignored);
    }

    #[test]
    fn a_lease_not_shaped_as_bulwark_writes_its_own_is_rejected() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let check = check(None);
        let verdict = |name: &str, m: &Member| {
            check.verdict(
                &round_trip(&lease_object(name, "bulwark", m, None, None)),
                now,
            )
        };
        let real = member("node-a", now);
        assert!(matches!(
            verdict("bulwark-node-a", &real),
            Verdict::Member(_)
        ));
        assert_eq!(
            verdict("bulwark-forged", &real),
            Verdict::Rejected(Rejection::Name),
            "a real member named as the holder of another Lease"
        );
        let year = Duration::from_secs(365 * 24 * 3600);
        let ahead = member("node-a", now + year);
        assert_eq!(
            verdict("bulwark-node-a", &ahead),
            Verdict::Rejected(Rejection::Future)
        );
        let just_ahead = member("node-a", now + MAX_CLOCK_AHEAD);
        assert!(
            matches!(verdict("bulwark-node-a", &just_ahead), Verdict::Member(_)),
            "clocks a little apart"
        );
        let long = Member {
            duration: year,
            ..member("node-a", now)
        };
        assert_eq!(
            verdict("bulwark-node-a", &long),
            Verdict::Rejected(Rejection::Duration)
        );
        let short = Member {
            duration: Duration::from_secs(5),
            ..member("node-a", now)
        };
        assert!(
            matches!(verdict("bulwark-node-a", &short), Verdict::Member(_)),
            "a shorter duration only counts for less"
        );
    }

    #[test]
    fn with_a_key_only_a_lease_signed_with_it_counts() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let keys = Keys::parse(KEY).unwrap();
        let check = check(Some(keys.clone()));
        let real = member("node-a", now);
        let signed = round_trip(&lease_object(
            "bulwark-node-a",
            "bulwark",
            &real,
            None,
            Some(&keys),
        ));
        assert_eq!(check.verdict(&signed, now), Verdict::Member(real.clone()));
        let unsigned = round_trip(&lease_object(
            "bulwark-node-a",
            "bulwark",
            &real,
            None,
            None,
        ));
        assert_eq!(
            check.verdict(&unsigned, now),
            Verdict::Rejected(Rejection::Signature)
        );
        let other_key = Keys::parse(&[b'x'; 32]).unwrap();
        let forged = lease_object("bulwark-node-a", "bulwark", &real, None, Some(&other_key));
        assert_eq!(
            check.verdict(&forged, now),
            Verdict::Rejected(Rejection::Signature)
        );
        // Any field the fleet reads, changed after signing.
        let mut more = signed.clone();
        more.metadata.annotations.as_mut().unwrap().insert(
            DEMAND_ANNOTATION.into(),
            r#"{"s":{"lists":1000000}}"#.into(),
        );
        assert_eq!(
            check.verdict(&more, now),
            Verdict::Rejected(Rejection::Signature)
        );
        let elsewhere = check.clone();
        let moved = Check {
            namespace: "other".into(),
            ..elsewhere
        };
        assert_eq!(
            moved.verdict(&signed, now),
            Verdict::Rejected(Rejection::Signature),
            "the namespace is signed"
        );
        // Rotation: a file with the new key first and the old second verifies both.
        let rotated = Keys::parse(&[&[b'n'; 40][..], b"\n", KEY, b"\n"].concat()).unwrap();
        let rotating = Check {
            keys: Some(rotated.clone()),
            ..check.clone()
        };
        assert_eq!(
            rotating.verdict(&signed, now),
            Verdict::Member(real.clone())
        );
        let new = round_trip(&lease_object(
            "bulwark-node-a",
            "bulwark",
            &real,
            None,
            Some(&rotated),
        ));
        assert_eq!(rotating.verdict(&new, now), Verdict::Member(real.clone()));
        assert_eq!(
            check.verdict(&new, now),
            Verdict::Rejected(Rejection::Signature),
            "signed with the new key"
        );
        // While the key is turned on: unsigned Leases count, wrongly signed ones do not.
        let turning_on = Check {
            accept_unsigned: true,
            ..check
        };
        assert_eq!(turning_on.verdict(&unsigned, now), Verdict::Member(real));
        assert_eq!(
            turning_on.verdict(&forged, now),
            Verdict::Rejected(Rejection::Signature)
        );
    }

    #[test]
    fn a_key_file_needs_keys_long_enough_to_be_secrets() {
        assert!(matches!(Keys::parse(b"\n \n"), Err(KeyError::Empty)));
        let short = Keys::parse(&[KEY, b"\nshort\n"].concat()).unwrap_err();
        assert_eq!(
            short.to_string(),
            "key on line 2 is 5 bytes: at least 32",
            "{short:?}"
        );
        assert!(Keys::read(Path::new("/nonexistent/fleet-key")).is_err());
    }
}

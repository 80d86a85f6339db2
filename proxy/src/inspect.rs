//! `bulwark flows | levels | fleet | upstream`: an operator's view of the admin listeners
//! of one replica (`--replica`) or of every member the fleet's Leases name (`--fleet`, the
//! default), read with the kubeconfig's credentials (the Leases) and the admin token
//! (`/debug/*`), as kubectl-style tables, JSON or YAML, once or every `--interval`
//! (`--watch`). Also `kubectl bulwark ...` when the binary is installed as `kubectl-bulwark`.
//!
//! The fleet's members are found as the replicas find each other: the unexpired Leases named
//! the prefix and their holder. Each member's Lease publishes its admin listener's URL
//! (`fleet::admin_url`); a member whose Lease does not (an older Bulwark, or an admin
//! listener on every address without `POD_IP`) is a row saying so.

mod fetch;
mod kubeconfig;
mod table;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, SystemTime};

use bulwark::fleet::lease::{Check, Verdict};
use http::StatusCode;
use k8s_openapi::api::coordination::v1::Lease;
use serde_json::{Value, json};

use fetch::{Dial, FetchError};
use kubeconfig::Apiserver;

/// The token file's environment variable, the default of `--admin-token-file`.
pub const TOKEN_FILE_ENV: &str = "BULWARK_ADMIN_TOKEN_FILE";

/// Which admin page a command reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Page {
    /// `/debug/flows`.
    Flows,
    /// `/debug/levels`.
    Levels,
    /// `/debug/fleet`.
    Fleet,
    /// `/debug/upstream`.
    Upstream,
}

impl Page {
    fn name(self) -> &'static str {
        match self {
            Page::Flows => "flows",
            Page::Levels => "levels",
            Page::Fleet => "fleet",
            Page::Upstream => "upstream",
        }
    }

    fn path(self) -> String {
        format!("/debug/{}", self.name())
    }
}

/// How the answer is printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    /// The table with more columns.
    Wide,
    /// `{"items": [...]}`, one item per replica with its page as it answered.
    Json,
    /// The same as YAML.
    Yaml,
}

/// What the command was asked.
pub struct Options {
    /// The page.
    pub page: Page,
    /// Admin listeners to read; empty: the fleet's members.
    pub replicas: Vec<String>,
    /// The output format; `None`: the table.
    pub output: Option<Output>,
    /// Print again every `interval` until Ctrl-C.
    pub watch: bool,
    /// Between two prints with `watch`.
    pub interval: Duration,
    /// The file of the admin token.
    pub admin_token_file: Option<PathBuf>,
    /// The CA of the admin listeners' certificates.
    pub admin_ca: Option<PathBuf>,
    /// The name the admin listeners' certificates must carry (default: each one's host).
    pub admin_server_name: Option<String>,
    /// `--kubeconfig`.
    pub kubeconfig: Option<PathBuf>,
    /// `--context`.
    pub context: Option<String>,
    /// The Leases' namespace (`fleet.namespace`).
    pub namespace: String,
    /// `fleet.leasePrefix`.
    pub lease_prefix: String,
    /// The longest one request may take.
    pub request_timeout: Duration,
}

/// What one replica answered, or why it did not.
#[derive(Debug, Clone)]
pub struct Read {
    /// Its name: its fleet identity, or the address given.
    pub replica: String,
    /// Its admin listener's URL, when known.
    pub admin: Option<String>,
    /// The page, or why there is none.
    pub answer: Result<Value, String>,
}

/// Why the command cannot run at all (a replica that cannot be read is a row, not this).
#[derive(Debug, thiserror::Error)]
pub enum InspectError {
    /// The kubeconfig gives no way to the apiserver.
    #[error(transparent)]
    Kubeconfig(#[from] kubeconfig::KubeconfigError),
    /// A file given on the command line cannot be used.
    #[error("{flag} {}: {why}", path.display())]
    File {
        /// The flag.
        flag: &'static str,
        /// The file.
        path: PathBuf,
        /// Why.
        why: String,
    },
    /// The fleet's Leases could not be listed.
    #[error("listing the fleet's Leases in namespace {namespace} at {server}: {why}")]
    Leases {
        /// The namespace.
        namespace: String,
        /// The apiserver.
        server: String,
        /// Why.
        why: String,
    },
    /// A bad value on the command line.
    #[error("{0}")]
    Usage(String),
}

/// Runs the command: prints, and exits 1 when a replica could not be read or nothing could.
pub fn run(options: Options) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("bulwark: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run_async(options)) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("bulwark: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Every replica read, once or until Ctrl-C: whether the last round read them all.
async fn run_async(options: Options) -> Result<bool, InspectError> {
    if !is_dns_label(&options.namespace) {
        return Err(InspectError::Usage(format!(
            "--namespace {:?} is not a namespace name",
            options.namespace
        )));
    }
    if options.interval.is_zero() || options.request_timeout.is_zero() {
        return Err(InspectError::Usage(
            "--interval and --request-timeout must be longer than zero".into(),
        ));
    }
    let apiserver = if options.replicas.is_empty() {
        let files = kubeconfig::files(
            options.kubeconfig.as_deref(),
            std::env::var("KUBECONFIG").ok().as_deref(),
            std::env::var_os("HOME").as_deref().map(Path::new),
        )?;
        let mut apiserver = kubeconfig::load(&files, options.context.as_deref())?;
        apiserver.dial.timeout = options.request_timeout;
        Some(apiserver)
    } else {
        None
    };
    let admin = admin_dial(&options, apiserver.as_ref())?;
    let every = options.watch.then_some(options.interval);
    rounds(every, tokio::signal::ctrl_c(), || async {
        let reads = read_all(&options, apiserver.as_ref(), &admin).await?;
        Ok(print(&options, &reads))
    })
    .await
}

/// `round` once, or with `every` again each period until `stop`: the last round's answer.
/// An error (the Leases could not be listed) ends it.
async fn rounds<F, R, S>(
    every: Option<Duration>,
    stop: S,
    mut round: F,
) -> Result<bool, InspectError>
where
    F: FnMut() -> R,
    R: std::future::Future<Output = Result<bool, InspectError>>,
    S: std::future::Future,
{
    tokio::pin!(stop);
    loop {
        let all = round().await?;
        let Some(every) = every else {
            return Ok(all);
        };
        tokio::select! {
            _ = tokio::time::sleep(every) => println!(),
            _ = &mut stop => return Ok(all),
        }
    }
}

/// How the admin listeners are dialled: the token, and TLS against `--admin-ca` (else the
/// kubeconfig's cluster CA, which signs the serving certificates in most clusters).
fn admin_dial(options: &Options, apiserver: Option<&Apiserver>) -> Result<Dial, InspectError> {
    let bearer = match &options.admin_token_file {
        Some(path) => {
            let file = |why: String| InspectError::File {
                flag: "--admin-token-file",
                path: path.clone(),
                why,
            };
            let token = std::fs::read_to_string(path).map_err(|e| file(e.to_string()))?;
            let token = token.trim();
            if token.is_empty() {
                return Err(file("holds no token".into()));
            }
            Some(token.to_owned())
        }
        None => None,
    };
    let tls = match (&options.admin_ca, apiserver) {
        (Some(path), _) => {
            let file = |why: String| InspectError::File {
                flag: "--admin-ca",
                path: path.clone(),
                why,
            };
            let pem = std::fs::read(path).map_err(|e| file(e.to_string()))?;
            Some(fetch::client_config(&pem, None).map_err(file)?)
        }
        (None, Some(apiserver)) => fetch::client_config(&apiserver.ca, None).ok(),
        (None, None) => None,
    };
    Ok(Dial {
        tls,
        server_name: options.admin_server_name.clone(),
        bearer,
        timeout: options.request_timeout,
    })
}

/// Every replica's page, in the order of their names.
async fn read_all(
    options: &Options,
    apiserver: Option<&Apiserver>,
    admin: &Dial,
) -> Result<Vec<Read>, InspectError> {
    let targets: Vec<(String, Result<String, String>)> = match apiserver {
        None => options
            .replicas
            .iter()
            .map(|r| (r.clone(), Ok(admin_base(r))))
            .collect(),
        Some(apiserver) => members(options, apiserver).await?,
    };
    let reads = targets.into_iter().map(|(replica, base)| async move {
        let (admin_url, answer) = match base {
            Ok(base) => {
                let answer = read_page(&base, options.page, admin).await;
                (Some(base), answer)
            }
            Err(why) => (None, Err(why)),
        };
        Read {
            replica,
            admin: admin_url,
            answer,
        }
    });
    Ok(futures::future::join_all(reads).await)
}

/// `https://` before an address given without a scheme.
fn admin_base(replica: &str) -> String {
    if replica.contains("://") {
        replica.to_owned()
    } else {
        format!("https://{replica}")
    }
}

/// The fleet's live members by identity, each with its admin URL or why there is none.
async fn members(
    options: &Options,
    apiserver: &Apiserver,
) -> Result<Vec<(String, Result<String, String>)>, InspectError> {
    let path = format!(
        "/apis/coordination.k8s.io/v1/namespaces/{}/leases",
        options.namespace
    );
    let failed = |why: String| InspectError::Leases {
        namespace: options.namespace.clone(),
        server: apiserver.server.clone(),
        why,
    };
    let (status, body) = fetch::get(&apiserver.server, &path, &apiserver.dial)
        .await
        .map_err(|e| failed(e.to_string()))?;
    if !status.is_success() {
        return Err(failed(refused_by_apiserver(status, &body, &apiserver.user)));
    }
    let list: k8s_openapi::List<Lease> =
        serde_json::from_slice(&body).map_err(|e| failed(format!("not a LeaseList: {e}")))?;
    Ok(members_of(
        &list.items,
        &options.namespace,
        &options.lease_prefix,
        SystemTime::now(),
    ))
}

/// The members among `leases` at `now`, as the replicas count them (a key the command line
/// does not hold aside), sorted by identity.
fn members_of(
    leases: &[Lease],
    namespace: &str,
    prefix: &str,
    now: SystemTime,
) -> Vec<(String, Result<String, String>)> {
    let check = Check {
        namespace: namespace.to_owned(),
        prefix: prefix.to_owned(),
        duration: Duration::MAX,
        keys: None,
        accept_unsigned: true,
    };
    let mut members: Vec<_> = leases
        .iter()
        .filter_map(|lease| match check.verdict(lease, now) {
            Verdict::Member(member) => Some((
                member.identity,
                member.demand.admin.ok_or_else(|| {
                    "its Lease names no admin listener (a Bulwark before this one, or \
                     admin.address on every address without POD_IP)"
                        .to_owned()
                }),
            )),
            Verdict::Ignored | Verdict::Rejected(_) => None,
        })
        .collect();
    members.sort();
    members
}

/// The apiserver's refusal of the Lease list, naming the credential.
fn refused_by_apiserver(status: StatusCode, body: &[u8], user: &str) -> String {
    let message = serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|s| s["message"].as_str().map(str::to_owned))
        .unwrap_or_else(|| String::from_utf8_lossy(body).trim().to_owned());
    match status {
        StatusCode::UNAUTHORIZED => format!(
            "{status}: the apiserver did not accept the credential of the kubeconfig's user {user:?}"
        ),
        StatusCode::FORBIDDEN => {
            format!("{status}: the kubeconfig's user {user:?} may not list Leases there: {message}")
        }
        _ => format!("{status}: {message}"),
    }
}

/// One replica's page, or why it could not be read, in the words its row shows.
async fn read_page(base: &str, page: Page, dial: &Dial) -> Result<Value, String> {
    let mut dial = dial.clone();
    // The token goes only where TLS has verified the listener: a URL from a Lease anyone
    // could write must not collect it in the clear (a loopback listener needs none).
    let withheld = base.starts_with("http://") && dial.bearer.take().is_some();
    let (status, body) = fetch::get(base, &page.path(), &dial)
        .await
        .map_err(|e| match e {
            FetchError::Tls(_) => format!(
                "{e} (is --admin-ca the CA of its admin.tls certificate, and does the \
                 certificate name the host dialled, or --admin-server-name?)"
            ),
            e => e.to_string(),
        })?;
    match status {
        StatusCode::OK => {
            serde_json::from_slice(&body).map_err(|e| format!("{} is not JSON: {e}", page.path()))
        }
        StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN if withheld => Err(format!(
            "{status}: /debug/* needs the admin token, which is sent over HTTPS only \
             (admin.tls)"
        )),
        StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN if dial.bearer.is_some() => Err(format!(
            "{status}: the admin token was refused: --admin-token-file (or {TOKEN_FILE_ENV}) \
             must hold the replica's admin.tokenFile"
        )),
        StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => Err(format!(
            "{status}: /debug/* needs the admin token: pass --admin-token-file (or set \
             {TOKEN_FILE_ENV})"
        )),
        _ => Err(format!(
            "{status}: {}",
            String::from_utf8_lossy(&body).trim()
        )),
    }
}

fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// Prints one round; whether every replica was read.
fn print(options: &Options, reads: &[Read]) -> bool {
    let all = reads.iter().all(|r| r.answer.is_ok());
    match options.output {
        Some(Output::Json) => println!(
            "{}",
            serde_json::to_string_pretty(&document(options.page, reads)).unwrap_or_default()
        ),
        Some(Output::Yaml) => {
            if options.watch {
                println!("---");
            }
            print!(
                "{}",
                serde_norway::to_string(&document(options.page, reads)).unwrap_or_default()
            );
        }
        None | Some(Output::Wide) => {
            let wide = options.output == Some(Output::Wide);
            let table = table::table(options.page, reads, wide, SystemTime::now());
            if reads.len() <= 1 && options.page != Page::Fleet {
                for read in reads {
                    if let Err(why) = &read.answer {
                        eprintln!("bulwark: {}: {why}", read.replica);
                    }
                }
            }
            if reads.is_empty() {
                eprintln!(
                    "No members: no live Lease named {}* in namespace {}.",
                    options.lease_prefix, options.namespace
                );
            } else if table.is_empty() && all {
                eprintln!("No {} to show.", options.page.name());
            } else if !table.is_empty() {
                print!("{table}");
            }
        }
    }
    all
}

/// The `-o json|yaml` document: an item per replica with its page as it answered, or the
/// error that stood in for it.
fn document(page: Page, reads: &[Read]) -> Value {
    let items: Vec<Value> = reads
        .iter()
        .map(|r| {
            let mut item = json!({ "replica": r.replica, "admin": r.admin });
            match &r.answer {
                Ok(answer) => item[page.name()] = answer.clone(),
                Err(why) => item["error"] = why.clone().into(),
            }
            item
        })
        .collect();
    json!({ "items": items })
}

#[cfg(test)]
mod tests {
    use bulwark::fleet::lease::lease_object;
    use bulwark::fleet::share::{Demand, Member};

    use super::*;

    fn lease(identity: &str, admin: Option<&str>, renewed: SystemTime) -> Lease {
        let member = Member {
            identity: identity.into(),
            renewed,
            duration: Duration::from_secs(15),
            created: None,
            demand: Demand {
                admin: admin.map(String::from),
                ..Demand::default()
            },
        };
        lease_object(
            &format!("bulwark-{identity}"),
            "bulwark",
            &member,
            None,
            None,
        )
    }

    #[test]
    fn the_members_are_the_live_leases_of_the_prefix_with_their_admin_urls() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let mut other = lease("x", Some("https://10.0.0.9:9443"), now);
        other.metadata.name = Some("controller-x".into());
        let leases = [
            lease("b", None, now),
            lease("a", Some("https://10.0.0.5:9443"), now),
            lease(
                "gone",
                Some("https://10.0.0.6:9443"),
                now - Duration::from_secs(60),
            ),
            other,
        ];
        let members = members_of(&leases, "bulwark", "bulwark-", now);
        let names: Vec<&str> = members.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["a", "b"]);
        assert_eq!(members[0].1, Ok("https://10.0.0.5:9443".into()));
        assert!(
            members[1]
                .1
                .as_ref()
                .unwrap_err()
                .contains("names no admin listener")
        );
    }

    #[test]
    fn json_has_an_item_per_replica_with_its_page_or_its_error() {
        let reads = [
            Read {
                replica: "a".into(),
                admin: Some("https://a:9443".into()),
                answer: Ok(json!({"busiest": []})),
            },
            Read {
                replica: "b".into(),
                admin: None,
                answer: Err("unreachable".into()),
            },
        ];
        assert_eq!(
            document(Page::Flows, &reads),
            json!({"items": [
                {"replica": "a", "admin": "https://a:9443", "flows": {"busiest": []}},
                {"replica": "b", "admin": null, "error": "unreachable"},
            ]})
        );
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn watch_prints_each_period_until_stopped() {
        let start = tokio::time::Instant::now();
        let mut at = Vec::new();
        let stop = tokio::time::sleep(Duration::from_millis(4_500));
        let all = rounds(Some(Duration::from_secs(2)), stop, || {
            at.push(start.elapsed().as_secs());
            async { Ok(true) }
        })
        .await;
        assert!(all.unwrap());
        assert_eq!(at, [0, 2, 4]);
        let mut once = 0;
        let _ = rounds(None, std::future::pending::<()>(), || {
            once += 1;
            async { Ok(false) }
        })
        .await;
        assert_eq!(once, 1, "without --watch");
    }

    #[test]
    fn addresses_without_a_scheme_are_https_and_namespaces_are_names() {
        assert_eq!(admin_base("10.0.0.5:9443"), "https://10.0.0.5:9443");
        assert_eq!(admin_base("http://127.0.0.1:9090"), "http://127.0.0.1:9090");
        assert!(is_dns_label("bulwark"));
        assert!(!is_dns_label("bulwark/../x"));
    }

    #[tokio::test]
    async fn the_admin_token_never_crosses_plain_http() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = tokio::spawn(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut request = vec![0; 4096];
            let n = socket.read(&mut request).await.unwrap();
            socket
                .write_all(b"HTTP/1.1 403 Forbidden\r\ncontent-length: 0\r\n\r\n")
                .await
                .unwrap();
            String::from_utf8_lossy(&request[..n]).to_lowercase()
        });
        let dial = Dial {
            bearer: Some("s3cret".into()),
            timeout: Duration::from_secs(5),
            ..Dial::default()
        };
        let why = read_page(&format!("http://{addr}"), Page::Flows, &dial)
            .await
            .unwrap_err();
        assert_eq!(
            why,
            "403 Forbidden: /debug/* needs the admin token, which is sent over HTTPS only (admin.tls)"
        );
        let request = seen.await.unwrap();
        assert!(request.starts_with("get /debug/flows "), "{request}");
        assert!(!request.contains("s3cret"), "{request}");
    }
}

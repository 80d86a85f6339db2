//! The `bulwark` command line: its arguments, and how each failure becomes an exit code.
//! Only the binary uses it; the library knows nothing of clap or exit codes.

use std::path::PathBuf;

use bulwark::certs::{IdentitySpec, InitOptions};
use clap::{Parser, Subcommand, ValueEnum};

use crate::inspect::{Options, Output, Page};

/// A TLS-terminating reverse proxy that keeps kube-apiservers alive.
#[derive(Parser)]
#[command(name = "bulwark", version, about)]
pub struct Cli {
    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text, global = true)]
    pub log_format: LogFormat,
    #[command(subcommand)]
    pub command: Command,
}

/// The command line, read as `kubectl bulwark` when the binary runs under the name kubectl
/// gives plugins (`kubectl-bulwark`, on `PATH`): kubectl runs it with the words after
/// `bulwark`, so only the name in help and errors changes.
pub fn parse() -> Cli {
    use clap::{CommandFactory, FromArgMatches};
    let mut command = Cli::command();
    if std::env::args_os()
        .next()
        .is_some_and(|argv0| is_plugin(&argv0))
    {
        command = command.bin_name(PLUGIN_NAME).name(PLUGIN_NAME);
    }
    let matches = command.get_matches();
    Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
}

/// How kubectl users call it.
const PLUGIN_NAME: &str = "kubectl bulwark";

/// Whether the program's name (`argv[0]`) is kubectl's plugin name for Bulwark.
fn is_plugin(argv0: &std::ffi::OsStr) -> bool {
    std::path::Path::new(argv0)
        .file_name()
        .is_some_and(|name| name == "kubectl-bulwark")
}

/// How log lines are written.
#[derive(Clone, Copy, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// What to do.
#[derive(Subcommand)]
pub enum Command {
    /// Serve clients in front of the configured apiserver replicas.
    Serve {
        /// The configuration file (see proxy/bulwark.example.yaml).
        #[arg(long)]
        config: PathBuf,
    },
    /// Publish the `kubernetes` Service's endpoints from the fleet's Leases and serve
    /// nothing: run one beside each apiserver, so that pods reach the apiservers again
    /// within the Lease duration when no replica is live. Reads the replicas'
    /// configuration (`upstream`, `fleet.kubernetesService`).
    Guard {
        /// The configuration file.
        #[arg(long)]
        config: PathBuf,
    },
    /// Check a configuration file and every file it names (certificates, keys, CAs, token
    /// files, the rules folder); print every problem and exit 2 when there is any.
    CheckConfig {
        /// The configuration file.
        config: PathBuf,
    },
    /// Mint certificates and kubeconfigs.
    Certs {
        #[command(subcommand)]
        command: CertsCommand,
    },
    /// Check or explain a folder of rule files.
    Rules {
        #[command(subcommand)]
        command: RulesCommand,
    },
    /// The flows each replica sees: who asks how much, under which rule and level, how
    /// much is refused (`/debug/flows`).
    Flows(InspectArgs),
    /// Each priority level's seats, queues and waiting requests (`/debug/levels`).
    Levels(InspectArgs),
    /// Each replica's standing in the fleet: its share, the members it sees, its last
    /// renewal (`/debug/fleet`).
    Fleet(InspectArgs),
    /// Each apiserver replica as each Bulwark replica sees it: healthy, throttled,
    /// pending, watches (`/debug/upstream`).
    Upstream(InspectArgs),
}

/// The arguments of `bulwark flows | levels | fleet | upstream`: which replicas, how to
/// reach them, how to print.
#[derive(clap::Args)]
pub struct InspectArgs {
    /// A replica's admin listener, as `HOST:PORT` (https) or a URL (repeatable). Default:
    /// every member the fleet's Leases name.
    #[arg(long = "replica", value_name = "ADDR")]
    pub replicas: Vec<String>,
    /// Every member the fleet's Leases name, found with the kubeconfig (the default).
    #[arg(long, conflicts_with = "replicas")]
    pub fleet: bool,
    /// Output format: wide (more columns), json or yaml. Default: a table.
    #[arg(short = 'o', long = "output", value_enum)]
    pub output: Option<Output>,
    /// Print again every `--interval` until Ctrl-C.
    #[arg(short = 'w', long)]
    pub watch: bool,
    /// Between two prints with `--watch`.
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    pub interval: std::time::Duration,
    /// File of the admin token (`admin.tokenFile`), sent to `/debug/*` as a bearer token.
    #[arg(long, env = crate::inspect::TOKEN_FILE_ENV)]
    pub admin_token_file: Option<PathBuf>,
    /// CA of the admin listeners' certificates (`admin.tls`). Default: the kubeconfig's
    /// cluster CA.
    #[arg(long, env = "BULWARK_ADMIN_CA")]
    pub admin_ca: Option<PathBuf>,
    /// Name the admin listeners' certificates must carry. Default: the host dialled.
    #[arg(long)]
    pub admin_server_name: Option<String>,
    /// The kubeconfig. Default: `KUBECONFIG`'s files, else `~/.kube/config`.
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    /// The kubeconfig context. Default: its current context.
    #[arg(long)]
    pub context: Option<String>,
    /// Namespace of the fleet's Leases (`fleet.namespace`).
    #[arg(short = 'n', long, default_value = "bulwark")]
    pub namespace: String,
    /// Prefix of the fleet's Lease names (`fleet.leasePrefix`).
    #[arg(long, default_value = "bulwark-")]
    pub lease_prefix: String,
    /// The longest one request may take.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    pub request_timeout: std::time::Duration,
}

impl InspectArgs {
    /// The options of the command reading `page`.
    pub fn options(self, page: Page) -> Options {
        Options {
            page,
            replicas: self.replicas,
            output: self.output,
            watch: self.watch,
            interval: self.interval,
            admin_token_file: self.admin_token_file,
            admin_ca: self.admin_ca,
            admin_server_name: self.admin_server_name,
            kubeconfig: self.kubeconfig,
            context: self.context,
            namespace: self.namespace,
            lease_prefix: self.lease_prefix,
            request_timeout: self.request_timeout,
        }
    }
}

/// `bulwark rules ...` subcommands.
#[derive(Subcommand)]
pub enum RulesCommand {
    /// Print every problem of every file as `file:line:column: message` and exit 1 when
    /// there is any; print warnings (`file:line:column: warning: message`) on rules that
    /// load but cannot do what they say, and exit 0 unless `--strict`.
    Check {
        /// The folder of rule files.
        dir: PathBuf,
        /// Bulwark's configuration, for its `cache.maxStaleness` (default: the built-in cap).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Exit 1 on warnings too.
        #[arg(long)]
        strict: bool,
    },
    /// Print the rule a request matches, its level and flow, and why each rule of lower
    /// precedence did not match.
    Explain {
        /// The folder of rule files.
        dir: PathBuf,
        /// Bulwark's configuration, for its `rules.mode` (default: enforce, each rule's own
        /// mode).
        #[arg(long)]
        config: Option<PathBuf>,
        /// The user name.
        #[arg(long)]
        user: String,
        /// A group of the user (repeatable); `system:authenticated` is added.
        #[arg(long = "group")]
        groups: Vec<String>,
        /// An extra of the user's credential as `KEY=VALUE` (repeatable; a key given twice
        /// has two values), e.g. `authentication.kubernetes.io/node-name=node-1`.
        #[arg(long = "extra", value_parser = parse_extra)]
        extras: Vec<(String, String)>,
        /// The client's address, which keys `flow: node` and `flow: pod` flows whose client
        /// names no node or pod.
        #[arg(long)]
        source: Option<std::net::IpAddr>,
        /// The apiserver verb (get, list, watch, create, ...).
        verb: String,
        /// The request path, e.g. /api/v1/namespaces/default/secrets.
        path: String,
    },
    /// Write a rule folder sized from recorded traffic: one file per client class, levels,
    /// rates and watch limits from what each class was served, times the headroom, every
    /// rule in shadow mode and every number explained in a comment.
    Suggest {
        /// An access-log file (repeatable); its rotated files (`FILE.1`, `FILE.2`, ...) are
        /// read too.
        #[arg(long = "access-log", required = true)]
        access_logs: Vec<PathBuf>,
        /// The folder to write the rules into (created).
        #[arg(long)]
        out: PathBuf,
        /// What the observed peaks are multiplied by.
        #[arg(long, default_value_t = 2.0)]
        headroom: f64,
    },
    /// Replay recorded traffic against a rule folder: what its rates, watch limits, seats
    /// and LIST byte budget would have refused, per rule and user, and when.
    Replay {
        /// An access-log file (repeatable); its rotated files are read too.
        #[arg(long = "access-log", required = true)]
        access_logs: Vec<PathBuf>,
        /// The folder of rule files.
        #[arg(long)]
        rules: PathBuf,
        /// The in-flight LIST byte budget (bytes): the apiservers' heap headroom ÷ 5, over
        /// all replicas (default: three at the default 8 GiB).
        #[arg(long, default_value_t = bulwark::traffic::replay::DEFAULT_LIST_BUDGET)]
        list_budget: u64,
        /// `table` or `json`.
        #[arg(short = 'o', long, default_value = "table", value_parser = ["table", "json"])]
        output: String,
    },
}

/// `KEY=VALUE` of `--extra`.
fn parse_extra(arg: &str) -> Result<(String, String), String> {
    match arg.split_once('=') {
        Some((key, value)) if !key.is_empty() => Ok((key.to_owned(), value.to_owned())),
        _ => Err(format!("expected KEY=VALUE, got {arg:?}")),
    }
}

/// `bulwark certs ...` subcommands.
#[derive(Subcommand)]
pub enum CertsCommand {
    /// Mint a development PKI and a kubeconfig per identity.
    Init(InitArgs),
}

/// The arguments of `bulwark certs init`.
#[derive(clap::Args)]
pub struct InitArgs {
    /// Folder for the certificates, keys and kubeconfigs (created when missing).
    #[arg(long)]
    dir: PathBuf,
    /// A name clients use to reach Bulwark: a DNS name or an IP address (repeatable; the
    /// first is the serving certificate's CN and the kubeconfigs' host).
    #[arg(long = "server-name", required = true)]
    server_names: Vec<String>,
    /// A user to mint a client certificate and kubeconfig for, as `USER[:GROUP,GROUP]`
    /// (repeatable). `system:serviceaccount:NS:NAME` and `system:node:NAME` users are read
    /// whole; the groups start after the next `:`.
    #[arg(long = "identity")]
    identities: Vec<IdentitySpec>,
    /// The server URL written into the kubeconfigs. Default: `https://FIRST-NAME:6443`.
    #[arg(long)]
    server: Option<String>,
    /// CN of the front-proxy client certificate (must be in the apiserver's
    /// `--requestheader-allowed-names`).
    #[arg(long, default_value = "front-proxy-client")]
    front_proxy_name: String,
    /// Bulwark's own identity, as `USER[:GROUP,GROUP]`.
    #[arg(long = "self", default_value = "bulwark:bulwark:proxies")]
    self_identity: IdentitySpec,
    /// Validity of the leaf certificates in days (CAs get ten times as long).
    #[arg(long, default_value_t = 365)]
    days: u32,
    /// Also name what pods dial in the serving certificate, for Bulwark behind the
    /// `kubernetes` Service: its ClusterIP SERVICE_IP and `kubernetes`,
    /// `kubernetes.default`, `kubernetes.default.svc`, `kubernetes.default.svc.DOMAIN`. Put
    /// the cluster CA (the one `kube-root-ca.crt` carries: kubeadm's `ca.crt` and
    /// `ca.key`) in `--dir` first, and the certificate comes from it.
    #[arg(long = "in-cluster", value_name = "SERVICE_IP")]
    in_cluster: Option<std::net::IpAddr>,
    /// The cluster's DNS domain, with `--in-cluster`.
    #[arg(long, default_value = "cluster.local")]
    cluster_domain: String,
}

impl From<InitArgs> for InitOptions {
    fn from(args: InitArgs) -> Self {
        let mut server_names = args.server_names;
        if let Some(ip) = args.in_cluster {
            for name in bulwark::certs::in_cluster_names(&ip.to_string(), &args.cluster_domain) {
                if !server_names.contains(&name) {
                    server_names.push(name);
                }
            }
        }
        InitOptions {
            dir: args.dir,
            server_names,
            identities: args.identities,
            server: args.server,
            front_proxy_name: args.front_proxy_name,
            self_identity: args.self_identity,
            days: args.days,
        }
    }
}

//! The `bulwark` binary: `bulwark serve --config FILE`.

use std::path::PathBuf;
use std::process::ExitCode;

use bulwark::config::{Config, ConfigError};
use bulwark::serve::StartError;
use clap::{Parser, Subcommand, ValueEnum};

/// A TLS-terminating reverse proxy that keeps kube-apiservers alive.
#[derive(Parser)]
#[command(name = "bulwark", version, about)]
struct Cli {
    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text, global = true)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Serve clients in front of the configured apiserver replicas.
    Serve {
        /// The configuration file (see proxy/bulwark.example.yaml).
        #[arg(long)]
        config: PathBuf,
    },
    /// Check a configuration file and print every problem.
    CheckConfig {
        /// The configuration file.
        config: PathBuf,
    },
    /// Mint certificates and kubeconfigs.
    Certs {
        #[command(subcommand)]
        command: bulwark::certs::CertsCommand,
    },
    /// Check or explain a folder of rule files.
    Rules {
        #[command(subcommand)]
        command: RulesCommand,
    },
}

#[derive(Subcommand)]
enum RulesCommand {
    /// Exit 0 when the folder is valid; else print every problem as `file:line:column:
    /// message` and exit 1.
    Check {
        /// The folder of rule files.
        dir: PathBuf,
    },
    /// Print the rule a request matches, its level and flow, and why each rule of lower
    /// precedence did not match.
    Explain {
        /// The folder of rule files.
        dir: PathBuf,
        /// The user name.
        #[arg(long)]
        user: String,
        /// A group of the user (repeatable); `system:authenticated` is added.
        #[arg(long = "group")]
        groups: Vec<String>,
        /// The apiserver verb (get, list, watch, create, ...).
        verb: String,
        /// The request path, e.g. /api/v1/namespaces/default/secrets.
        path: String,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.log_format);
    match cli.command {
        Command::Serve { config } => {
            // Keys and Secrets live in this process's memory: never write them to a core file.
            if let Err(e) = bulwark::certs::disable_core_dumps() {
                eprintln!("bulwark: cannot disable core dumps: {e}");
            }
            let Some(config) = load(&config) else {
                return ExitCode::from(2);
            };
            let runtime = match tokio::runtime::Runtime::new() {
                Ok(runtime) => runtime,
                Err(e) => {
                    eprintln!("bulwark: cannot start the runtime: {e}");
                    return ExitCode::FAILURE;
                }
            };
            match runtime.block_on(bulwark::serve::run(config)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(StartError::Rules(problems)) => {
                    for problem in problems {
                        eprintln!("{problem}");
                    }
                    ExitCode::from(2)
                }
                Err(e) => {
                    eprintln!("bulwark: {e}");
                    ExitCode::from(2)
                }
            }
        }
        Command::CheckConfig { config } => match load(&config) {
            Some(_) => ExitCode::SUCCESS,
            None => ExitCode::from(2),
        },
        Command::Certs { command } => match bulwark::certs::run(&command) {
            Ok(minted) => {
                print!("{minted}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("bulwark: {e}");
                ExitCode::FAILURE
            }
        },
        Command::Rules {
            command: RulesCommand::Check { dir },
        } => {
            let (code, report) = bulwark::rules::check(&dir);
            if code == 0 {
                print!("{report}");
            } else {
                eprint!("{report}");
            }
            ExitCode::from(code)
        }
        Command::Rules {
            command:
                RulesCommand::Explain {
                    dir,
                    user,
                    groups,
                    verb,
                    path,
                },
        } => match bulwark::rules::explain_cli(&dir, &user, &groups, &verb, &path) {
            Ok(text) => {
                print!("{text}");
                ExitCode::SUCCESS
            }
            Err(why) => {
                eprintln!("bulwark: {why}");
                ExitCode::from(1)
            }
        },
    }
}

/// Loads the configuration, printing one line per problem when it is invalid.
fn load(path: &std::path::Path) -> Option<Config> {
    match Config::load(path) {
        Ok(config) => Some(config),
        Err(ConfigError::Invalid(problems)) => {
            for problem in problems {
                eprintln!("{}: {problem}", path.display());
            }
            None
        }
        Err(e) => {
            eprintln!("bulwark: {e}");
            None
        }
    }
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

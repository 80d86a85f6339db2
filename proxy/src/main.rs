//! The `bulwark` binary: `bulwark serve --config FILE`.

use std::path::PathBuf;
use std::process::ExitCode;

use bulwark::config::{Config, ConfigError};
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
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.log_format);
    match cli.command {
        Command::Serve { config } => {
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

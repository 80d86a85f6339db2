//! The `bulwark` binary: `bulwark serve --config FILE`.

mod cli;
mod inspect;

use std::process::ExitCode;

use bulwark::config::{Config, ConfigError};
use bulwark::report::Chain;
use bulwark::serve::StartError;
use cli::{CertsCommand, Command, LogFormat, RulesCommand};

/// mimalloc rather than glibc's malloc: a proxy allocates and frees small buffers for every
/// request, and glibc's arenas spent about 15% of a saturated core on it (`_int_malloc`,
/// `_int_free`, `malloc_consolidate`, `unlink_chunk` in the pass-through profile). Version 2
/// (the workspace's `v2` feature): version 3 kept what thousands of closed connections had
/// held resident in idle worker threads' heaps (after a 3,000-connection flood had closed,
/// 178 MiB resident against 40 MiB idle; version 2: 42 MiB; `loadtest/runner/results/`).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

// Over 120 lines: one arm per subcommand, each handing off to its module.
fn main() -> ExitCode {
    let cli = cli::parse();
    init_logging(cli.log_format);
    match cli.command {
        Command::Serve { config } => {
            // Keys and Secrets live in this process's memory: never write them to a core file.
            if let Err(e) = bulwark::process::make_undumpable() {
                eprintln!("bulwark: cannot disable core dumps: {e}");
            }
            let Some(config) = load(&config) else {
                return ExitCode::from(2);
            };
            // Client connections are capped below this limit (with a reserve kept back), so
            // take all the descriptors the system allows, as Go programs do.
            let descriptors = bulwark::listen::raise_open_file_limit();
            tracing::info!(descriptors, "open-file limit");
            let runtime = match bulwark::serve::runtime_beside(config.listen.workers) {
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
                    eprintln!("bulwark: {}", Chain(&e));
                    ExitCode::from(2)
                }
            }
        }
        Command::Guard { config } => {
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
            match runtime.block_on(bulwark::serve::guard(config)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("bulwark: {}", Chain(&e));
                    ExitCode::from(2)
                }
            }
        }
        Command::CheckConfig { config } => check_config(&config),
        Command::Flows(args) => inspect::run(args.options(inspect::Page::Flows)),
        Command::Levels(args) => inspect::run(args.options(inspect::Page::Levels)),
        Command::Fleet(args) => inspect::run(args.options(inspect::Page::Fleet)),
        Command::Upstream(args) => inspect::run(args.options(inspect::Page::Upstream)),
        Command::Certs {
            command: CertsCommand::Init(args),
        } => match bulwark::certs::init(&args.into()) {
            Ok(minted) => {
                print!("{minted}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("bulwark: {}", Chain(&e));
                ExitCode::FAILURE
            }
        },
        Command::Rules {
            command:
                RulesCommand::Check {
                    dir,
                    config,
                    strict,
                },
        } => {
            let max_staleness = match &config {
                None => bulwark::config::Cache::default().max_staleness,
                Some(path) => match load(path) {
                    Some(config) => config.cache.max_staleness,
                    None => return ExitCode::from(2),
                },
            };
            let checked = bulwark::rules::check(&dir, max_staleness);
            for problem in &checked.errors {
                eprintln!("{problem}");
            }
            for warning in &checked.warnings {
                eprintln!("{}", warning.warning_line());
            }
            if let Some(summary) = &checked.summary {
                print!("{summary}");
            }
            if !checked.errors.is_empty() || (strict && !checked.warnings.is_empty()) {
                ExitCode::from(1)
            } else {
                ExitCode::SUCCESS
            }
        }
        Command::Rules {
            command:
                RulesCommand::Explain {
                    dir,
                    config,
                    user,
                    groups,
                    extras,
                    source,
                    verb,
                    path,
                },
        } => {
            let mode = match &config {
                None => bulwark::config::RulesMode::default(),
                Some(path) => match load(path) {
                    Some(config) => config.rules.mode,
                    None => return ExitCode::from(2),
                },
            };
            let mut user = bulwark::rules::cli_user(&user, &groups);
            for (key, value) in extras {
                user.extra.entry(key).or_default().push(value);
            }
            explain(&dir, mode.into(), &user, source, &verb, &path)
        }
        Command::Rules {
            command:
                RulesCommand::Suggest {
                    access_logs,
                    out,
                    headroom,
                },
        } => suggest(&access_logs, &out, headroom),
        Command::Rules {
            command:
                RulesCommand::Replay {
                    access_logs,
                    rules,
                    list_budget,
                    output,
                },
        } => replay(&access_logs, &rules, list_budget, &output),
    }
}

/// The recording of the access-log files named, their rotated files included.
fn recording(files: &[std::path::PathBuf]) -> Option<bulwark::traffic::Recording> {
    let files: Vec<_> = files
        .iter()
        .flat_map(|f| bulwark::traffic::rotated(f))
        .collect();
    match bulwark::traffic::Recording::read(&files) {
        Ok(recording) => Some(recording),
        Err(e) => {
            eprintln!("bulwark: {e}");
            None
        }
    }
}

/// `bulwark rules suggest`.
fn suggest(files: &[std::path::PathBuf], out: &std::path::Path, headroom: f64) -> ExitCode {
    let Some(recording) = recording(files) else {
        return ExitCode::from(2);
    };
    let options = bulwark::traffic::suggest::Options { headroom };
    let suggestion = bulwark::traffic::suggest::suggest(&recording, &options);
    if let Err(problems) = bulwark::rules::RuleSet::from_sources(&suggestion.sources()) {
        // A suggestion that does not load is Bulwark's bug, not the recording's.
        for problem in problems {
            eprintln!("{problem}");
        }
        return ExitCode::from(1);
    }
    if let Err(e) = suggestion.write(out) {
        eprintln!("bulwark: writing {}: {e}", out.display());
        return ExitCode::from(2);
    }
    println!(
        "{} requests ({} lines skipped) -> {} files in {}:",
        recording.records.len(),
        recording.skipped,
        suggestion.files.len(),
        out.display()
    );
    for (name, _) in &suggestion.files {
        println!("  {name}");
    }
    ExitCode::SUCCESS
}

/// `bulwark rules replay`.
fn replay(
    files: &[std::path::PathBuf],
    dir: &std::path::Path,
    list_budget: u64,
    output: &str,
) -> ExitCode {
    let rules = match bulwark::rules::RuleSet::load_dir(dir) {
        Ok(rules) => rules,
        Err(problems) => {
            for problem in problems {
                eprintln!("{problem}");
            }
            return ExitCode::from(1);
        }
    };
    let Some(recording) = recording(files) else {
        return ExitCode::from(2);
    };
    let replay = bulwark::traffic::replay::replay(&recording, &rules, list_budget);
    if output == "json" {
        match serde_json::to_string_pretty(&replay) {
            Ok(json) => println!("{json}"),
            Err(e) => {
                eprintln!("bulwark: {e}");
                return ExitCode::FAILURE;
            }
        }
    } else {
        print!("{}", replay.table());
    }
    ExitCode::SUCCESS
}

/// `bulwark rules explain`: the text, or the reason there is none (exit 1).
fn explain(
    dir: &std::path::Path,
    mode: bulwark::rules::Mode,
    user: &bulwark::identity::User,
    source: Option<std::net::IpAddr>,
    verb: &str,
    path: &str,
) -> ExitCode {
    match bulwark::rules::explain_dir(dir, mode, user, source, verb, path) {
        Ok(text) => {
            print!("{text}");
            ExitCode::SUCCESS
        }
        Err(why) => {
            eprintln!("bulwark: {}", Chain(&why));
            ExitCode::from(1)
        }
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
            eprintln!("{}", parse_error_line(path, &e));
            None
        }
    }
}

/// `bulwark check-config FILE`: the schema, then every file the configuration names; one
/// line per problem, with its file and line, and exit 2 when there is any.
fn check_config(path: &std::path::Path) -> ExitCode {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) => {
            eprintln!("bulwark: cannot read {}: {e}", path.display());
            return ExitCode::from(2);
        }
    };
    let mut config = match text.parse::<Config>() {
        Ok(config) => config,
        Err(ConfigError::Invalid(problems)) => {
            for problem in problems {
                let line = bulwark::config_files::field_line(&text, &problem.field);
                eprintln!("{}:{line}: {problem}", path.display());
            }
            return ExitCode::from(2);
        }
        Err(e) => {
            eprintln!("{}", parse_error_line(path, &e));
            return ExitCode::from(2);
        }
    };
    if let Some(base) = path.parent() {
        config.resolve_paths(base);
    }
    let problems = bulwark::config_files::check(&config, path, &text);
    for problem in &problems {
        eprintln!("{problem}");
    }
    if problems.is_empty() {
        println!(
            "{}: valid, and every file it names is usable",
            path.display()
        );
        ExitCode::SUCCESS
    } else {
        ExitCode::from(2)
    }
}

/// A configuration parse error as `file:line:column: message`, naming the file.
fn parse_error_line(path: &std::path::Path, e: &ConfigError) -> String {
    match e {
        ConfigError::Parse {
            line: Some(line),
            column: Some(column),
            message,
        } => {
            let suffix = format!(" at line {line} column {column}");
            let message = message.replacen(&suffix, "", 1);
            format!("{}:{line}:{column}: {message}", path.display())
        }
        ConfigError::Parse { message, .. } => format!("{}: {message}", path.display()),
        other => format!("bulwark: {}", Chain(other)),
    }
}

fn init_logging(format: LogFormat) {
    use std::io::IsTerminal;
    use tracing_subscriber::prelude::*;
    let directives = std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into());
    let filter = bulwark::logs::parse_filter(&directives).unwrap_or_else(|e| {
        eprintln!("bulwark: RUST_LOG: {e}; logging at info");
        tracing_subscriber::EnvFilter::new("info")
    });
    let (filter, handle) = tracing_subscriber::reload::Layer::new(filter);
    // Colour codes only for a person at a terminal, never into a file or a log collector.
    let ansi = std::io::stderr().is_terminal();
    let lines = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(ansi);
    let registry = tracing_subscriber::registry().with(filter);
    match format {
        LogFormat::Text => registry.with(lines).init(),
        LogFormat::Json => registry.with(lines.json()).init(),
    }
    bulwark::logs::install_level_control(
        directives,
        Box::new(move |directives: &str| {
            let filter = bulwark::logs::parse_filter(directives)?;
            handle
                .reload(filter)
                .map_err(|e| format!("the log filter could not be changed: {e}"))
        }),
    );
}

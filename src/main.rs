//! The `sluice` binary: parses the command line, sets up logging and calls into the library
//! (`server::run` for `serve`, the config loader for `check`). Kept thin so everything the
//! service does is reachable from tests through the library; the one thing that lives here
//! instead is `sluice bench` (`bench.rs`), a load generator and no part of the service.
#![forbid(unsafe_code)]

mod bench;

use clap::{Args, FromArgMatches};
use sluice::config::load_path;
use sluice::settings::{CheckArgs, Cli, Command, LogArgs, LogFormat, Parsed, ServeArgs};
use std::process::ExitCode;

/// mimalloc instead of glibc malloc: allocation was ~15% of the server's CPU under load (perf),
/// and the README's side-by-side runs show the difference per decision.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let bench_command = bench::BenchArgs::augment_args(clap::Command::new("bench"));
    let (command, log) = match Cli::parse_args_with([bench_command]) {
        Parsed::Cli(cli) => cli.into_command(),
        Parsed::Extra { matches, log, .. } => {
            // `bench` is the only extra subcommand.
            let args = bench::BenchArgs::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
            init_logging(&log);
            // The load generator wants Tokio's work-stealing pool for its many clients.
            return block_on(tokio::runtime::Builder::new_multi_thread(), run_bench(args));
        }
    };
    init_logging(&log);
    match command {
        Command::Check(args) => check(&args),
        Command::Admin(args) => {
            block_on(tokio::runtime::Builder::new_current_thread(), admin(args))
        }
        Command::Replay(args) => {
            block_on(tokio::runtime::Builder::new_current_thread(), replay(args))
        }
        // `serve` starts on a single-threaded runtime that is also its first gRPC serving
        // thread; the server adds the others, one runtime each (`server/workers.rs` says why).
        Command::Serve(args) => {
            block_on(tokio::runtime::Builder::new_current_thread(), serve(args))
        }
    }
}

fn block_on(
    mut builder: tokio::runtime::Builder,
    main: impl std::future::Future<Output = ExitCode>,
) -> ExitCode {
    match builder.enable_all().build() {
        Ok(runtime) => runtime.block_on(main),
        Err(e) => {
            eprintln!("cannot start the Tokio runtime: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Logs go to stderr; `RUST_LOG`, when set, refines `LOG_LEVEL` per module. The admin audit
/// lines are written whatever either says (see `admin::audit`).
fn init_logging(log: &LogArgs) {
    let level = tracing::level_filters::LevelFilter::from_level(log.log_level.as_tracing());
    let rust_log = std::env::var("RUST_LOG").ok();
    let filter = sluice::telemetry::log_filter::log_filter(level, rust_log.as_deref());
    let filter = sluice::admin::audit::always_on(filter);
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colour codes only for a person at a terminal, never in collected container logs.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    match log.log_format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}

async fn serve(args: ServeArgs) -> ExitCode {
    // Handlers first: a SIGTERM while the config loads must drain (here: exit 0), not kill.
    let shutdown = sluice::server::shutdown_signal();
    tracing::debug!(settings = ?args, "starting");
    let config = match sluice::app::server_config(&args) {
        Ok(c) => c,
        Err(e) => {
            tracing::error!("{e}");
            return ExitCode::FAILURE;
        }
    };
    match sluice::server::run(config, shutdown).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e}");
            ExitCode::FAILURE
        }
    }
}

/// `sluice bench`: the summary on stdout (JSON with `--json`), progress on stderr.
async fn run_bench(args: bench::BenchArgs) -> ExitCode {
    let json = args.json;
    match bench::run(args).await {
        Ok(summary) => {
            if json {
                match serde_json::to_string(&summary) {
                    Ok(s) => println!("{s}"),
                    Err(e) => {
                        eprintln!("{e}");
                        return ExitCode::FAILURE;
                    }
                }
            } else {
                print!("{}", bench::render(&summary));
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("sluice bench: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `sluice admin ...`: the answer on stdout as JSON, an error on stderr and exit 1.
async fn admin(args: sluice::admin::client::AdminArgs) -> ExitCode {
    match args.run().await {
        Ok(json) => {
            println!("{json}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("sluice admin: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `sluice replay`: the report on stdout, or the error on stderr and exit 1.
async fn replay(args: sluice::settings::ReplayArgs) -> ExitCode {
    match sluice::replay::cli::run(&args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sluice replay: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `sluice check PATH`: every error on its own line (`file:line: path: message`) on stdout and
/// exit 1, or a short summary and exit 0.
fn check(args: &CheckArgs) -> ExitCode {
    let opts = args.load.options();
    match load_path(&args.path, &opts) {
        Ok(rules) => {
            let warnings = rules.counting_warnings(args.load.counting);
            for warning in warnings.iter().chain(&rules.layout_warnings()) {
                eprintln!("warning: {warning}");
            }
            let counts = rules.rule_counts();
            let total: usize = counts.iter().map(|(_, n)| n).sum();
            println!(
                "{}: OK, {} domain(s), {} rate limit(s)",
                args.path.display(),
                counts.len(),
                total
            );
            for (domain, n) in counts {
                println!("  {domain}: {n}");
            }
            ExitCode::SUCCESS
        }
        Err(errors) => {
            for e in &errors.0 {
                println!("{e}");
            }
            eprintln!("{}: {} error(s)", args.path.display(), errors.0.len());
            ExitCode::FAILURE
        }
    }
}

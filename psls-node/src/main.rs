//! `psls-node --config FILE --node NAME`: runs one node daemon in the foreground.

use clap::Parser;
use std::path::PathBuf;

#[derive(Parser)]
#[command(name = "psls-node", about = "PSLS node daemon", version)]
struct Args {
    /// Cluster configuration (TOML).
    #[arg(long)]
    config: PathBuf,
    /// Name of this node in the configuration.
    #[arg(long)]
    node: String,
    /// Async worker threads (default: one per core). Daemons sharing a machine should share
    /// its cores out (`psls cluster up` does).
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=1024))]
    workers: Option<u16>,
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    // Logs: `PSLS_LOG` filters them (tracing's EnvFilter syntax, default `info,quinn=warn`),
    // `PSLS_LOG_FORMAT` says `text` (the default) or `json` (one object per line).
    let filter = match std::env::var("PSLS_LOG") {
        Err(_) => tracing_subscriber::EnvFilter::new("info,quinn=warn"),
        Ok(f) => match tracing_subscriber::EnvFilter::try_new(&f) {
            Ok(filter) => filter,
            Err(e) => {
                eprintln!("psls-node: PSLS_LOG={f:?} is not a log filter (e.g. info, or debug,quinn=warn): {e}");
                return std::process::ExitCode::from(2);
            }
        },
    };
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match std::env::var("PSLS_LOG_FORMAT").as_deref() {
        Ok("json") => logs.json().init(),
        Err(_) | Ok("text") => logs
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init(),
        Ok(other) => {
            eprintln!("psls-node: PSLS_LOG_FORMAT={other:?}: use text or json");
            return std::process::ExitCode::from(2);
        }
    }
    let mut b = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = args.workers {
        b.worker_threads(n as usize);
    }
    let rt = match b.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("psls-node: cannot start runtime: {e}");
            return std::process::ExitCode::from(1);
        }
    };
    match rt.block_on(psls_node::daemon::run(&args.config, &args.node)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            eprintln!("psls-node: error: {e:#}");
            std::process::ExitCode::from(2)
        }
    }
}

//! `bench` (`make bench`): the lock bench against rslock, the HTTP path against `wrk`, and
//! memory, in one run; prints JSON lines and writes the README's performance section.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use loadtest::bench::{self, Options, Results};

/// Every performance figure in one run, written into the README.
#[derive(Debug, Parser)]
#[command(
    name = "bench",
    version,
    about = "Runs every benchmark (the lock bench against rslock, the sale path through nginx, memory) and writes the README section"
)]
struct Args {
    /// Client processes of the lock bench, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "4,16,64")]
    clients: Vec<usize>,
    /// Seconds per lock-bench run.
    #[arg(long, default_value_t = 10)]
    lock_seconds: u64,
    /// Seconds per HTTP measurement.
    #[arg(long, default_value_t = 10)]
    http_seconds: u64,
    /// Connections for the HTTP measurements.
    #[arg(long, default_value_t = 64)]
    connections: usize,
    /// The README to write the section into (none: print it).
    #[arg(long)]
    readme: Option<PathBuf>,
    /// Where the chart goes, relative to the README.
    #[arg(long, default_value = "docs/bench-lock.svg")]
    svg: String,
    /// Skip the HTTP half (no nginx, no wrk).
    #[arg(long, conflicts_with = "http_only")]
    locks_only: bool,
    /// Skip the lock bench: the sale path and memory only, one JSON line (a README section
    /// needs both halves).
    #[arg(long, conflicts_with = "readme")]
    http_only: bool,
}

#[tokio::main]
async fn main() -> ExitCode {
    match run(Args::parse()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> anyhow::Result<()> {
    let options = Options {
        clients: args.clients,
        lock_duration: Duration::from_secs(args.lock_seconds),
        http_duration: Duration::from_secs(args.http_seconds),
        connections: args.connections,
    };
    let dir = std::env::current_exe()?
        .parent()
        .map(PathBuf::from)
        .unwrap_or_default();
    let machine = bench::machine().await;
    eprintln!("bench: {machine}");
    let http = async || -> anyhow::Result<_> {
        let figures = bench::http(&dir.join("inventory"), &options).await?;
        println!("{}", serde_json::to_string(&figures)?);
        Ok(figures)
    };
    if args.http_only {
        // Its JSON line is the whole result: a README section's lock half would be empty.
        http().await?;
        return Ok(());
    }
    let (locks, serial) = bench::locks(&dir.join("lock-bench"), &options, |r| {
        if let Ok(line) = serde_json::to_string(r) {
            println!("{line}");
        }
    })
    .await?;
    let http = if args.locks_only {
        None
    } else {
        Some(http().await?)
    };
    let results = Results {
        machine,
        locks,
        serial,
        http,
    };
    let section = bench::markdown(&results, &args.svg);
    match args.readme {
        Some(readme) => {
            let svg_path = readme
                .parent()
                .map(|p| p.join(&args.svg))
                .unwrap_or_else(|| PathBuf::from(&args.svg));
            if let Some(parent) = svg_path.parent() {
                std::fs::create_dir_all(parent)?;
            }
            std::fs::write(&svg_path, bench::svg(&results.locks))?;
            let text = std::fs::read_to_string(&readme).unwrap_or_default();
            std::fs::write(&readme, bench::splice_readme(&text, &section))?;
            eprintln!(
                "bench: wrote {} and {}",
                readme.display(),
                svg_path.display()
            );
        }
        None => println!("{section}"),
    }
    Ok(())
}

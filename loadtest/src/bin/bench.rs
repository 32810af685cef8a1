//! `bench` (`make bench`): the lock bench against rslock, the HTTP path against `wrk`, and
//! memory, in one run; prints JSON lines and writes the README's performance section.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use clap::builder::RangedU64ValueParser;
use loadtest::bench::{self, Options, Results};

/// The longest `--lock-seconds` and `--http-seconds`: a day, as the other tools' durations.
const MAX_SECONDS: u64 = 86_400;

/// The fewest `--connections`: `wrk` runs two threads (`-t 2`) and refuses fewer
/// connections than threads.
const MIN_CONNECTIONS: u64 = 2;

/// Every performance figure in one run, written into the README.
#[derive(Debug, Parser)]
#[command(
    name = "bench",
    version,
    about = "Runs every benchmark (the lock bench against rslock, the sale path through nginx, memory) and writes the README section"
)]
struct Args {
    /// Client processes of the lock bench (1..=1024 each, as `lock-bench --clients`),
    /// comma-separated.
    // Range-checked by clap, so that 0 is a usage error (exit 2) naming the range, as in
    // lock-bench, not a bench started with no client.
    #[arg(long, value_delimiter = ',', default_value = "4,16,64",
          value_parser = RangedU64ValueParser::<usize>::new().range(1..=1024))]
    clients: Vec<usize>,
    /// Seconds per lock-bench run (1..=86400, at most a day).
    #[arg(long, default_value_t = 10,
          value_parser = clap::value_parser!(u64).range(1..=MAX_SECONDS))]
    lock_seconds: u64,
    /// Seconds per HTTP measurement (1..=86400, at most a day).
    #[arg(long, default_value_t = 10,
          value_parser = clap::value_parser!(u64).range(1..=MAX_SECONDS))]
    http_seconds: u64,
    /// Connections for the HTTP measurements (2..=4096: `wrk` runs two threads and needs a
    /// connection per thread; beyond 4096 nginx times the instances out).
    #[arg(long, default_value_t = 64,
          value_parser = RangedU64ValueParser::<usize>::new()
              .range(MIN_CONNECTIONS..=loadtest::tool::MAX_CONCURRENCY))]
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

#[cfg(test)]
mod tests {
    use super::*;

    /// `bench` with a zero (or out-of-range) count or duration is a usage error of clap's
    /// (exit status 2) naming the flag and its range, before anything starts: `--clients 0`,
    /// `--lock-seconds 0` and `--connections 0` were accepted and began a bench.
    #[test]
    fn numeric_options_out_of_range_are_usage_errors_naming_the_range() {
        for (flag, bad, range) in [
            ("--clients", "0", "1..=1024"),
            ("--clients", "4,0", "1..=1024"),
            ("--clients", "1025", "1..=1024"),
            ("--lock-seconds", "0", "1..=86400"),
            ("--lock-seconds", "86401", "1..=86400"),
            ("--http-seconds", "0", "1..=86400"),
            ("--http-seconds", "86401", "1..=86400"),
            ("--connections", "0", "2..=4096"),
            ("--connections", "1", "2..=4096"),
            ("--connections", "4097", "2..=4096"),
        ] {
            let refusal = Args::try_parse_from(["bench".into(), format!("{flag}={bad}")])
                .expect_err(&format!("{flag} {bad}"));
            assert_eq!(refusal.exit_code(), 2, "{flag} {bad}: {refusal}");
            let said = refusal.to_string();
            assert!(
                said.contains(flag) && said.contains(&format!("is not in {range}")),
                "{flag} {bad}: {said}"
            );
        }
    }

    #[test]
    fn numeric_options_at_the_ends_of_their_ranges_are_taken() {
        let args = Args::try_parse_from([
            "bench",
            "--clients",
            "1,1024",
            "--lock-seconds",
            "1",
            "--http-seconds",
            "86400",
            "--connections",
            "2",
        ])
        .unwrap();
        assert_eq!(args.clients, [1, 1024]);
        assert_eq!((args.lock_seconds, args.http_seconds), (1, 86_400));
        assert_eq!(args.connections, 2);
        let defaults = Args::try_parse_from(["bench"]).unwrap();
        assert_eq!(defaults.clients, [4, 16, 64]);
        assert_eq!((defaults.lock_seconds, defaults.http_seconds), (10, 10));
        assert_eq!(defaults.connections, 64);
        let most = Args::try_parse_from(["bench", "--connections", "4096"]).unwrap();
        assert_eq!(most.connections, 4096);
    }
}

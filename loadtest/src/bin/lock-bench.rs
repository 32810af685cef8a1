//! `lock-bench`: C client processes contend for one lock; one JSON line per run, rslock
//! measured in the same invocation as the reference. See `loadtest::lockbench`.

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use loadtest::lockbench::{self, Contender, Load};
use testkit::RedisProcess;

/// Lock bench: acquire -> GET -> SET -> release, C processes, one lock.
#[derive(Debug, Parser)]
#[command(
    name = "lock-bench",
    version,
    about = "C client processes on one lock, each strategy's waits against rslock: one JSON line per run"
)]
struct Args {
    #[command(subcommand)]
    child: Option<Child>,
    /// What to measure: `rslock`, or `<strategy>/<wait>` (`fenced/notify`), optionally with
    /// the longest tenure in milliseconds (`fenced/notify:0`: none, the plain hand-off),
    /// comma-separated.
    // Parsed by clap, so that a wrong one is a usage error (exit 2) as in the other tools,
    // not the exit 1 of a bench that failed.
    #[arg(
        long,
        value_delimiter = ',',
        value_parser = contender,
        default_value = "rslock,lua-release/notify,fenced/notify,lua-release/notify:0,fenced/notify:0,lua-release/pubsub,fenced/pubsub,lua-release/spin,fenced/spin"
    )]
    contenders: Vec<Contender>,
    /// Numbers of client processes (1..=1024), comma-separated.
    // Each client is a process with its own runtime and Redis connections: past a thousand
    // the machine measures its scheduler, and Redis nears its default 10000 clients.
    #[arg(long, value_delimiter = ',', default_value = "16,64",
          value_parser = clap::value_parser!(u64).range(1..=1024))]
    clients: Vec<u64>,
    /// Seconds each run lasts (above 0, at most a day).
    #[arg(long, value_name = "SECONDS", default_value = "10",
          value_parser = loadtest::tool::seconds_above_zero)]
    duration: Duration,
    /// Seconds one acquire may wait before it counts as a timeout (above 0, at most a day).
    #[arg(long, value_name = "SECONDS", default_value = "10",
          value_parser = loadtest::tool::seconds_above_zero)]
    wait_budget: Duration,
    /// Exit 1 unless every run lost no update and had no timeout (for tests).
    #[arg(long)]
    check: bool,
    /// Worker threads of each client process's Tokio runtime (rslock's included); unset,
    /// what `make up` gives an instance: half the cores, at least one.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=64))]
    client_threads: Option<u16>,
}

#[derive(Debug, Subcommand)]
enum Child {
    /// One client process (spawned by the bench itself).
    #[command(hide = true)]
    Child {
        /// The bench's pid: the client dies with it.
        #[arg(long)]
        parent: u32,
        #[arg(long)]
        redis: String,
        #[arg(long)]
        contender: String,
        #[arg(long)]
        id: usize,
        #[arg(long)]
        duration_ms: u64,
        #[arg(long)]
        wait_budget_ms: u64,
        #[arg(long)]
        ttl_ms: u64,
        #[arg(long, default_value_t = 1)]
        threads: usize,
    },
}

/// A `--contenders` entry, as clap's `value_parser`: the refusal names what is valid.
fn contender(text: &str) -> Result<Contender, String> {
    Contender::parse(text).map_err(|e| format!("{e:#}"))
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Some(Child::Child { parent, .. }) = &args.child
        && let Err(e) = lockbench::die_with_parent(*parent)
    {
        eprintln!("lock-bench child: {e:#}");
        return ExitCode::FAILURE;
    }
    let runtime = match &args.child {
        // Each client is one small service instance, with the worker threads it is given
        // (its loop runs in a task on them, as a sale does in an instance).
        Some(Child::Child { threads, .. }) => tokio::runtime::Builder::new_multi_thread()
            .worker_threads((*threads).max(1))
            .enable_all()
            .build(),
        None => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(4)
            .enable_all()
            .build(),
    };
    let result = runtime
        .map_err(anyhow::Error::from)
        .and_then(|rt| rt.block_on(run(args)));
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("lock-bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> anyhow::Result<bool> {
    if let Some(Child::Child {
        redis,
        contender,
        id,
        duration_ms,
        wait_budget_ms,
        ttl_ms,
        ..
    }) = args.child
    {
        let load = Load {
            duration: Duration::from_millis(duration_ms),
            wait_budget: Duration::from_millis(wait_budget_ms),
            ttl: Duration::from_millis(ttl_ms),
            client_threads: 1,
        };
        lockbench::client(&redis, Contender::parse(&contender)?, id, load).await?;
        return Ok(true);
    }
    let contenders = args.contenders;
    let load = Load {
        duration: args.duration,
        wait_budget: args.wait_budget,
        client_threads: args
            .client_threads
            .map_or_else(lockbench::default_client_threads, usize::from),
        ..Load::default()
    };
    let exe = std::env::current_exe()?;
    let redis = RedisProcess::start(&[]).await?;
    let mut clean = true;
    // Every contender at one C before the next C, so that each comparison is made minutes
    // apart at most on a machine whose load changes.
    for clients in args.clients.iter().map(|&c| c as usize) {
        for &contender in &contenders {
            eprintln!("lock-bench: {} with {clients} clients", contender.label());
            let report = lockbench::run(&redis, &exe, contender, clients, load).await?;
            clean &= report.lost_updates == 0 && report.timeouts == 0 && report.errors == 0;
            println!("{}", serde_json::to_string(&report)?);
        }
    }
    Ok(clean || !args.check)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_counts_outside_one_to_1024_are_refused_naming_the_range() {
        for bad in ["0", "16,0", "1025", "-1", "many"] {
            let refusal = Args::try_parse_from(["lock-bench".into(), format!("--clients={bad}")])
                .expect_err(bad)
                .to_string();
            assert!(refusal.contains("--clients"), "{refusal}");
            if bad.parse::<i64>().is_ok_and(|n| n >= 0) || bad.contains(',') {
                assert!(refusal.contains("1..=1024"), "{refusal}");
            }
        }
        let args = Args::try_parse_from(["lock-bench", "--clients", "1,1024"]).unwrap();
        assert_eq!(args.clients, [1, 1024]);
    }

    /// Wrong values are usage errors of clap's (exit status 2, like the other tools'), with
    /// the flag and what is valid named, before Redis starts: they used to be refused by
    /// `run`, with the exit status 1 of a failed bench.
    #[test]
    fn wrong_values_are_usage_errors_naming_what_is_valid() {
        let day = "valid: a number of seconds above 0, at most 86400 (a day)";
        for (flag, bad, valid) in [
            ("--duration", "-1", day),
            ("--duration", "1e300", day),
            ("--duration", "0", day),
            ("--wait-budget", "nan", day),
            ("--wait-budget", "inf", day),
            (
                "--contenders",
                "rslock,bogus",
                "expected rslock or <strategy>/<wait>, <wait> one of notify, pubsub, spin",
            ),
            (
                "--contenders",
                "fenced/bogus",
                "valid: notify, pubsub, spin",
            ),
            ("--contenders", "fenced/notify:5000", "0 to 1000"),
        ] {
            let refusal = Args::try_parse_from(["lock-bench".into(), format!("{flag}={bad}")])
                .expect_err(bad);
            assert_eq!(refusal.exit_code(), 2, "{flag} {bad}");
            let said = refusal.to_string();
            assert!(said.contains(flag) && said.contains(valid), "{said}");
        }
        let args =
            Args::try_parse_from(["lock-bench", "--contenders", "rslock,fenced/notify:0"]).unwrap();
        assert_eq!(
            args.contenders
                .iter()
                .map(|c| c.label())
                .collect::<Vec<_>>(),
            ["rslock", "fenced/notify:0"]
        );
        assert_eq!(args.duration, Duration::from_secs(10));
    }
}

//! `loadtest`: resets the stock, fires the sales, reads the audit, for each strategy; prints
//! a comparison and exits 2 when a strategy that should be safe oversold, else 3 when a
//! strategy's run was INCONCLUSIVE (nothing sold while requests failed or were refused, or
//! requests refused as wrong): a run that proved nothing must not pass a script's check.
//! A usage error exits 64 before anything is sent.

use std::io::IsTerminal;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::error::ErrorKind;
use clap::parser::ValueSource;
use clap::{CommandFactory, FromArgMatches, Parser};
use indicatif::{ProgressBar, ProgressStyle};
use inventory::lock::Strategy;
use loadtest::tool::Strategies;
use loadtest::{LoadTest, Plan, StrategyReport, Verdict, html, table};

// The generator's own allocations (a request and its answer per sale) should cost it less
// than the server it measures.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The service's `MAX_WORK_MS` unless configured (`inventory --max-work-ms`'s default).
const SERVICE_MAX_WORK_MS: u64 = 2_000;

/// Load test of the inventory service, strategy by strategy.
#[derive(Debug, Parser)]
#[command(name = "loadtest", version, about)]
struct Args {
    /// Base URL of nginx (or of one instance).
    #[arg(long, env = "LOADTEST_TARGET", default_value = "http://127.0.0.1:8080")]
    target: String,
    /// `all`, or a comma-separated list of strategy names or aliases, in any case; a strategy
    /// named twice runs once.
    #[arg(long, default_value = "all", value_parser = loadtest::tool::strategies)]
    strategy: Strategies,
    /// Stock to start each strategy with [default: 100, or 1000000000 with --duration].
    #[arg(long, value_parser = clap::value_parser!(i64).range(0..=1_000_000_000))]
    stock: Option<i64>,
    /// Throughput mode: sell for this many seconds per strategy instead of `--requests`
    /// times, from a stock that never runs out, so that every request is a sale.
    #[arg(long, value_name = "SECONDS", value_parser = loadtest::tool::seconds_above_zero)]
    duration: Option<Duration>,
    /// Measure `GET /health` instead of sales (for --duration seconds, default 10): the
    /// generator's own ceiling, to compare with `wrk` on the same target.
    #[arg(long)]
    health: bool,
    /// Sales to attempt per strategy (1..=100000000).
    #[arg(long, default_value_t = 1000,
          value_parser = clap::value_parser!(u64).range(1..=100_000_000))]
    requests: u64,
    /// Spread the sales over this many items (1..=10000), ids `item-0001`, `item-0002`, ...
    /// (four digits, five for 10000 items), each reset to --stock with
    /// `PUT /inventory/{item}` before every strategy and judged by its own audit. Every round
    /// of N requests visits each item once, in a random order. 1: the default item, on the
    /// paths without an id.
    #[arg(long, value_name = "N", default_value_t = 1,
          value_parser = clap::value_parser!(u64).range(1..=loadtest::MAX_ITEMS as u64))]
    items: u64,
    /// Requests in flight at once, each on a connection of its own. The native stack's
    /// instances take 1024 connections each (`MAX_CONNECTIONS`): far beyond twice that, nginx
    /// waits for connections to them, times out and marks them down.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=loadtest::tool::MAX_CONCURRENCY))]
    concurrency: u64,
    /// Business time inside the lock, per sale (0..=60000 ms). The service refuses more than
    /// its MAX_WORK_MS (2000 unless configured) with 400 bad_request: such a run sells
    /// nothing and is INCONCLUSIVE.
    // Up to the service's hard ceiling, not its default: an instance may be configured to
    // allow more, and loadtest cannot ask which.
    #[arg(long, default_value_t = 0,
          value_parser = clap::value_parser!(u64).range(0..=inventory::sale::MAX_WORK_MS))]
    work_ms: u64,
    /// Print one JSON object per strategy instead of the table.
    #[arg(long)]
    json: bool,
    /// Write an HTML report with charts to this file once every strategy has run (its
    /// directory is created if missing). Checked before anything is sent: a file that
    /// cannot be written is refused with exit status 1. A run that fails writes no page,
    /// and leaves an existing one as it was.
    #[arg(long, value_name = "FILE.html")]
    report: Option<std::path::PathBuf>,
    /// Kill the master that Sentinel names this many seconds into the run (one strategy
    /// only: the old master stays down). The table's `200 lost` column then counts sales
    /// answered 200 that the new master has no record of.
    #[arg(long, value_name = "SECONDS", requires = "sentinel",
          value_parser = loadtest::tool::seconds_from_zero)]
    failover_after: Option<Duration>,
    /// A sentinel (`host:port`) to ask for the master, for --failover-after.
    #[arg(long, value_name = "HOST:PORT")]
    sentinel: Option<String>,
    /// The master's name at the sentinels.
    #[arg(long, env = "REDIS_MASTER_NAME", default_value = "inventory")]
    master_name: String,
    /// Bearer token for the stock reset, when the service has one.
    #[arg(long, env = "ADMIN_TOKEN", hide_env_values = true)]
    admin_token: Option<String>,
}

/// What `--health` takes besides itself: it measures `GET /health` only.
const HEALTH_TAKES: [&str; 4] = ["target", "duration", "concurrency", "json"];

/// The options given on the command line that `--health` has no use for, as `--name`s; none
/// without `--health`. Environment variables (`ADMIN_TOKEN`, `REDIS_MASTER_NAME`) are not
/// counted: they are set for the sales runs of the same shell, not for this one.
fn health_conflicts(matches: &clap::ArgMatches) -> Vec<String> {
    if !matches.get_flag("health") {
        return Vec::new();
    }
    Args::command()
        .get_arguments()
        .filter(|arg| !HEALTH_TAKES.contains(&arg.get_id().as_str()) && arg.get_id() != "health")
        .filter(|arg| matches.value_source(arg.get_id().as_str()) == Some(ValueSource::CommandLine))
        .map(|arg| format!("--{}", arg.get_long().unwrap_or(arg.get_id().as_str())))
        .collect()
}

/// The exit status of a usage error (sysexits' `EX_USAGE`): 2 says that a strategy oversold,
/// and a script that checks for it must not read a misspelt option as an oversell.
const USAGE: i32 = 64;

/// Prints clap's message and exits: `--help` and `--version` as clap does (0), every other
/// error with [`USAGE`].
fn usage(error: clap::Error) -> ! {
    if !error.use_stderr() {
        error.exit();
    }
    let _ = error.print();
    std::process::exit(USAGE)
}

/// The arguments, or clap's own message and exit status [`USAGE`] before anything is sent:
/// for a wrong value, and for options that the run would otherwise ignore without a word (a
/// `--report` never written).
fn parse_args() -> Args {
    let matches = Args::command()
        .try_get_matches()
        .unwrap_or_else(|e| usage(e));
    if let Some(refusal) = refusal(&matches) {
        usage(Args::command().error(ErrorKind::ArgumentConflict, refusal));
    }
    Args::from_arg_matches(&matches).unwrap_or_else(|e| usage(e))
}

/// Why no run takes these options together, if none does. As for `--health`, variables from
/// the environment (`REDIS_MASTER_NAME`) do not count: they serve other runs of the shell.
fn refusal(matches: &clap::ArgMatches) -> Option<String> {
    let conflicts = health_conflicts(matches);
    if !conflicts.is_empty() {
        return Some(health_refusal(&conflicts));
    }
    // Checked here rather than by a value parser, whose error would quote the URL and any
    // password in it.
    if let Some(url) = matches.get_one::<String>("target")
        && let Err(e) = loadtest::conn::Target::parse(url.trim_end_matches('/'))
    {
        return Some(format!("--target: {e}"));
    }
    let given = |id: &str| matches.value_source(id) == Some(ValueSource::CommandLine);
    if given("duration") && given("requests") {
        return Some(
            "--duration sells for that long and cannot be combined with --requests; give one of them"
                .into(),
        );
    }
    if !given("failover_after") {
        // Which master to kill, and where to ask for it: nothing else reads them.
        let idle = [("sentinel", "--sentinel"), ("master_name", "--master-name")];
        return idle.iter().find(|(id, _)| given(id)).map(|(_, flag)| {
            format!("{flag} serves --failover-after only; without --failover-after, leave it out")
        });
    }
    if let (Some(after), Some(duration)) = (
        matches.get_one::<Duration>("failover_after"),
        matches.get_one::<Duration>("duration"),
    ) && after >= duration
    {
        return Some(format!(
            "--failover-after {} s is not within --duration {} s: the master would be killed \
             after the sales; give a time below --duration",
            after.as_secs_f64(),
            duration.as_secs_f64()
        ));
    }
    let strategies = matches.get_one::<Strategies>("strategy")?;
    (strategies.list.len() != 1).then(|| {
        let names: Vec<&str> = strategies.list.iter().map(|s| s.name()).collect();
        format!(
            "--failover-after kills a master: give it one --strategy (the old master stays down); \
             --strategy names {}: {}",
            names.len(),
            names.join(", ")
        )
    })
}

fn health_refusal(conflicts: &[String]) -> String {
    let takes: Vec<String> = HEALTH_TAKES.iter().map(|t| format!("--{t}")).collect();
    format!(
        "--health measures GET /health only and cannot be combined with {}; with --health, give only {}",
        conflicts.join(", "),
        takes.join(", ")
    )
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = parse_args();
    match run(args).await {
        Ok(reports) if reports.iter().any(StrategyReport::is_unexpected_oversell) => {
            ExitCode::from(2)
        }
        Ok(reports) if reports.iter().any(|r| r.verdict == Verdict::Inconclusive) => {
            ExitCode::from(loadtest::tool::INCONCLUSIVE)
        }
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("loadtest: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> anyhow::Result<Vec<StrategyReport>> {
    for note in &args.strategy.notes {
        eprintln!("loadtest: {note}");
    }
    if let Some(path) = &args.report {
        loadtest::tool::ready_report(path)?;
    }
    let (duration, failover_after) = (args.duration, args.failover_after);
    let default_stock = if duration.is_some() {
        1_000_000_000
    } else {
        100
    };
    let plan = Plan {
        target: args.target,
        strategies: args.strategy.list,
        stock: args.stock.unwrap_or(default_stock),
        requests: usize::try_from(args.requests)?,
        concurrency: args.concurrency as usize,
        work_ms: args.work_ms,
        admin_token: args.admin_token.filter(|t| !t.is_empty()),
    };
    if plan.work_ms > SERVICE_MAX_WORK_MS && !args.health {
        // Said before the run, not only in its verdict: a long run of refusals is minutes lost.
        eprintln!(
            "loadtest: --work-ms {} is above the service's default MAX_WORK_MS ({SERVICE_MAX_WORK_MS}); \
             unless the instances allow more, every sale is refused with 400 bad_request",
            plan.work_ms
        );
    }
    let mut load = LoadTest::new(plan.clone())?.with_items(args.items as usize)?;
    if args.health {
        let report = load
            .health(duration.unwrap_or(std::time::Duration::from_secs(10)))
            .await?;
        if args.json {
            println!("{}", serde_json::to_string(&report)?);
        } else {
            println!(
                "GET /health: {} requests/s ({} requests, {} errors, {} connections, {} s)",
                report.requests_per_s,
                report.requests,
                report.errors,
                report.concurrency,
                report.duration_s
            );
        }
        return Ok(Vec::new());
    }
    if let Some(duration) = duration {
        load = load.with_duration(duration);
    }
    // One strategy, as parse_args made sure.
    if let (Some(after), Some(sentinel)) = (failover_after, args.sentinel) {
        let failover = loadtest::failover::Failover {
            after,
            sentinel,
            master_name: args.master_name,
        };
        failover.master().await?;
        load = load.with_failover(failover);
    }
    let interactive = !args.json && std::io::stderr().is_terminal();
    let mut reports = Vec::new();
    for &strategy in &plan.strategies {
        let bar = (interactive && duration.is_none())
            .then(|| progress_bar(strategy, plan.requests as u64));
        let tick = bar
            .clone()
            .map(|b| Arc::new(move || b.inc(1)) as loadtest::Progress);
        let report = load.run_strategy(strategy, tick).await?;
        if let Some(bar) = bar {
            bar.finish_and_clear();
        }
        if args.json {
            println!("{}", serde_json::to_string(&report)?);
        } else if !interactive {
            eprintln!(
                "{}: {} sold, {}",
                report.strategy,
                report.sold,
                report.verdict_text()
            );
        }
        reports.push(report);
    }
    if !args.json {
        println!("{}", table::render(&reports));
    }
    if let Some(path) = &args.report {
        loadtest::tool::write_report(
            path,
            html::render(&plan, &reports, duration.map(|d| d.as_secs_f64())),
        )?;
        if !args.json {
            println!("\nHTML report: {}", path.display());
        }
    }
    Ok(reports)
}

fn progress_bar(strategy: Strategy, total: u64) -> ProgressBar {
    let bar = ProgressBar::new(total);
    if let Ok(style) = ProgressStyle::with_template("{prefix:>12} [{bar:40}] {pos}/{len} {per_sec}")
    {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_prefix(strategy.name());
    bar
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn items_outside_one_to_ten_thousand_are_refused_naming_the_range() {
        for bad in ["0", "10001", "-3", "many"] {
            let refusal = Args::try_parse_from(["loadtest".into(), format!("--items={bad}")])
                .expect_err(bad)
                .to_string();
            assert!(refusal.contains("--items"), "{refusal}");
            if bad.parse::<u64>().is_ok() {
                assert!(refusal.contains("1..=10000"), "{refusal}");
            }
        }
        let args = Args::try_parse_from(["loadtest", "--items", "10000"]).unwrap();
        assert_eq!(args.items, 10_000);
        assert_eq!(Args::try_parse_from(["loadtest"]).unwrap().items, 1);
    }

    fn conflicts(args: &[&str]) -> Vec<String> {
        let matches = Args::command()
            .try_get_matches_from(std::iter::once("loadtest").chain(args.iter().copied()))
            .unwrap();
        health_conflicts(&matches)
    }

    #[test]
    fn health_refuses_the_options_it_would_ignore_and_takes_its_own() {
        assert_eq!(
            conflicts(&[
                "--health",
                "--report",
                "r.html",
                "--requests",
                "5",
                "--items=3"
            ]),
            ["--requests", "--items", "--report"]
        );
        for ignored in [
            &["--stock", "5"][..],
            &["--work-ms", "5"],
            &["--strategy", "fenced"],
            &["--admin-token", "t"],
            &["--master-name", "m"],
            &["--sentinel", "h:1", "--failover-after", "1"],
        ] {
            let mut args = vec!["--health"];
            args.extend(ignored);
            assert!(!conflicts(&args).is_empty(), "{args:?} was taken");
        }
        let own = [
            "--health",
            "--target",
            "http://127.0.0.1:1",
            "--duration",
            "1",
            "--concurrency",
            "2",
            "--json",
        ];
        assert!(conflicts(&own).is_empty());
        assert!(conflicts(&["--report", "r.html", "--items", "3"]).is_empty());
        let refusal = health_refusal(&["--report".into()]);
        assert!(refusal.contains("combined with --report;"), "{refusal}");
        assert!(
            refusal.ends_with("give only --target, --duration, --concurrency, --json"),
            "{refusal}"
        );
    }

    #[test]
    fn the_work_limit_warned_about_is_the_services_default() {
        use clap::CommandFactory;
        let service = inventory::config::Config::command();
        let default = service
            .get_arguments()
            .find(|a| a.get_id() == "max_work_ms")
            .and_then(|a| a.get_default_values().first().cloned());
        assert_eq!(
            default.and_then(|d| d.to_str()?.parse::<u64>().ok()),
            Some(SERVICE_MAX_WORK_MS)
        );
        let help = Args::command().render_long_help().to_string();
        assert!(
            help.contains("MAX_WORK_MS (2000 unless configured)"),
            "{help}"
        );
        assert!(Args::try_parse_from(["loadtest", "--work-ms", "60001"]).is_err());
    }
}

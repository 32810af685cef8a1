//! `make failover-table`: the load test through nginx on the `sentinel` topology (a master,
//! two replicas, three sentinels, two instances), with the master killed part-way, for each
//! strategy and `REPLICA_ACKS` setting; each row on a topology of its own. Prints how many
//! sales were answered 200 and then lost with the old master.

use std::process::ExitCode;
use std::time::Duration;

use clap::error::ErrorKind;
use clap::{CommandFactory, Parser};
use loadtest::failover::{Failover, REPLICAS, SentinelTopology};
use loadtest::{LoadTest, Plan, Verdict, table};

#[derive(Debug, Parser)]
#[command(
    name = "failover-table",
    version,
    about = "Kills the Sentinel master under load, per strategy and REPLICA_ACKS, and counts the sales answered 200 and lost",
    after_help = loadtest::tool::TABLE_EXIT_STATUS
)]
struct Args {
    /// `all`, or strategy names or aliases (comma-separated, in any case); a strategy named
    /// twice runs once.
    #[arg(long, default_value = "fenced,lua-release,atomic", value_parser = loadtest::tool::strategies)]
    strategy: loadtest::tool::Strategies,
    /// `REPLICA_ACKS` values (comma-separated), each 0 to 2 (the topology has two replicas).
    /// A value named again runs again, after the others: `0,1,0,1` alternates the settings.
    #[arg(long, default_value = "0,1", value_delimiter = ',',
          value_parser = clap::value_parser!(u32).range(0..=REPLICAS as i64))]
    acks: Vec<u32>,
    /// Seconds of selling per row (above 0, at most a day). "sales/s overall" is `-` for a
    /// row that lasted less than 1 s.
    #[arg(long, value_name = "SECONDS", default_value = "8",
          value_parser = loadtest::tool::seconds_above_zero)]
    duration: Duration,
    /// Seconds into each row at which the master is killed (from 0, less than --duration).
    /// "sales/s before the kill" needs a kill at least 1 s in; it is `-` before that, too
    /// few milliseconds of sales to be a rate.
    #[arg(long, value_name = "SECONDS", default_value = "2",
          value_parser = loadtest::tool::seconds_from_zero)]
    failover_after: Duration,
    /// Requests in flight at once, each on a connection of its own (1..=4096).
    #[arg(long, default_value_t = 32,
          value_parser = clap::value_parser!(u64).range(1..=loadtest::tool::MAX_CONCURRENCY))]
    concurrency: u64,
    #[command(flatten)]
    inventory: loadtest::tool::InventoryBin,
}

#[tokio::main]
async fn main() -> ExitCode {
    loadtest::tool::exit_after_rows("failover-table", run(parse_args()).await)
}

/// The arguments, or clap's error and exit status 2, before anything starts: for a wrong
/// value, and for a kill that would come after the selling ends.
fn parse_args() -> Args {
    let args = Args::parse();
    if args.failover_after >= args.duration {
        let message = format!(
            "--failover-after ({} s) must fall within --duration ({} s); valid: from 0 to less than --duration",
            args.failover_after.as_secs_f64(),
            args.duration.as_secs_f64()
        );
        Args::command()
            .error(ErrorKind::ArgumentConflict, message)
            .exit();
    }
    args
}

/// The verdict of every row printed.
async fn run(args: Args) -> anyhow::Result<Vec<Verdict>> {
    for note in &args.strategy.notes {
        eprintln!("failover-table: {note}");
    }
    let bin = args.inventory.resolve()?;
    for line in table::FAILOVER_HEADER {
        println!("{line}");
    }
    let mut verdicts = Vec::new();
    for &strategy in &args.strategy.list {
        for &acks in &args.acks {
            let topology =
                SentinelTopology::start(&bin, &[("REPLICA_ACKS", acks.to_string())]).await?;
            let plan = Plan::endless(topology.nginx.url(), strategy, args.concurrency as usize);
            let load = LoadTest::new(plan)?
                .with_duration(args.duration)
                .with_failover(Failover {
                    after: args.failover_after,
                    sentinel: topology.sentinel(),
                    master_name: loadtest::failover::MASTER_NAME.into(),
                });
            let r = load.run_strategy(strategy, None).await?;
            println!("{}", table::failover_row(acks, &r));
            verdicts.push(r.verdict);
        }
    }
    Ok(verdicts)
}

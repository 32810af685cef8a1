//! `make failover-table`: the load test through nginx on the `sentinel` topology (a master,
//! two replicas, three sentinels, two instances), with the master killed part-way, for each
//! strategy and `REPLICA_ACKS` setting; each row on a topology of its own. Prints how many
//! sales were answered 200 and then lost with the old master.

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use loadtest::failover::{Failover, SentinelTopology};
use loadtest::{LoadTest, Plan, table};

#[derive(Debug, Parser)]
#[command(
    name = "failover-table",
    version,
    about = "Kills the Sentinel master under load, per strategy and REPLICA_ACKS, and counts the sales answered 200 and lost"
)]
struct Args {
    /// `all`, or strategy names or aliases (comma-separated, in any case); a strategy named
    /// twice runs once.
    #[arg(long, default_value = "fenced,lua-release,atomic", value_parser = loadtest::tool::strategies)]
    strategy: loadtest::tool::Strategies,
    /// `REPLICA_ACKS` values (comma-separated).
    #[arg(long, default_value = "0,1", value_delimiter = ',')]
    acks: Vec<u32>,
    /// Seconds of selling per row.
    #[arg(long, default_value_t = 8.0)]
    duration: f64,
    /// Seconds into each row at which the master is killed.
    #[arg(long, default_value_t = 2.0)]
    failover_after: f64,
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    #[command(flatten)]
    inventory: loadtest::tool::InventoryBin,
}

#[tokio::main]
async fn main() -> ExitCode {
    loadtest::tool::exit("failover-table", run(Args::parse()).await)
}

async fn run(args: Args) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.duration > args.failover_after && args.failover_after >= 0.0,
        "--failover-after must fall within --duration"
    );
    for note in &args.strategy.notes {
        eprintln!("failover-table: {note}");
    }
    let bin = args.inventory.resolve()?;
    for line in table::FAILOVER_HEADER {
        println!("{line}");
    }
    for &strategy in &args.strategy.list {
        for &acks in &args.acks {
            let topology =
                SentinelTopology::start(&bin, &[("REPLICA_ACKS", acks.to_string())]).await?;
            let plan = Plan::endless(topology.nginx.url(), strategy, args.concurrency);
            let load = LoadTest::new(plan)?
                .with_duration(Duration::from_secs_f64(args.duration))
                .with_failover(Failover {
                    after: Duration::from_secs_f64(args.failover_after),
                    sentinel: topology.sentinel(),
                    master_name: loadtest::failover::MASTER_NAME.into(),
                });
            let r = load.run_strategy(strategy, None).await?;
            println!("{}", table::failover_row(acks, &r));
        }
    }
    Ok(())
}

//! `make cluster-table`: the load test through nginx on one Redis and on a Redis Cluster of
//! three masters and three replicas (two instances each), for `atomic` and `fenced` over 1
//! and 64 items. Prints sales/s, p99, and each master's share of the commands the run sent
//! (`INFO commandstats`, so commands run inside scripts count too): one item's keys share
//! a hash slot, so one item keeps one master busy, and many items spread over all three.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use loadtest::lockbench::parse_commandstats;
use loadtest::{LoadTest, Plan, Verdict, table};

#[derive(Debug, Parser)]
#[command(
    name = "cluster-table",
    version,
    about = "Sales/s, p99 and each master's share of commands, on one Redis against a 3-master Redis Cluster",
    after_help = loadtest::tool::TABLE_EXIT_STATUS
)]
struct Args {
    /// `all`, or strategy names or aliases (comma-separated, in any case); a strategy named
    /// twice runs once.
    #[arg(long, default_value = "atomic,fenced", value_parser = loadtest::tool::strategies)]
    strategy: loadtest::tool::Strategies,
    /// Item counts (comma-separated), each 1..=10000.
    #[arg(long, default_value = "1,64", value_delimiter = ',',
          value_parser = clap::value_parser!(u64).range(1..=loadtest::MAX_ITEMS as u64))]
    items: Vec<u64>,
    /// Seconds of selling per row (above 0, at most a day).
    #[arg(long, value_name = "SECONDS", default_value = "5",
          value_parser = loadtest::tool::seconds_above_zero)]
    duration: Duration,
    /// Requests in flight at once, each on a connection of its own (1..=4096).
    #[arg(long, default_value_t = 64,
          value_parser = clap::value_parser!(u64).range(1..=loadtest::tool::MAX_CONCURRENCY))]
    concurrency: u64,
    #[command(flatten)]
    inventory: loadtest::tool::InventoryBin,
}

#[tokio::main]
async fn main() -> ExitCode {
    loadtest::tool::exit_after_rows("cluster-table", run(Args::parse()).await)
}

/// Two instances behind nginx on whatever Redis `redis` names, and the masters to count on.
struct Stack {
    nginx: testkit::NginxProcess,
    _apps: Vec<testkit::InventoryProcess>,
    masters: Vec<u16>,
}

impl Stack {
    async fn start(
        bin: &std::path::Path,
        redis: (&str, &str),
        masters: Vec<u16>,
    ) -> anyhow::Result<Self> {
        let mut apps = Vec::new();
        for name in ["app1", "app2"] {
            let mut vars = testkit::default_env("redis://127.0.0.1:1", name);
            vars.remove("REDIS_URL");
            vars.remove("LOCK_NODES");
            vars.insert(redis.0.into(), redis.1.into());
            vars.insert("LOG_FORMAT".into(), "text".into());
            vars.insert("RUST_LOG".into(), "warn".into());
            apps.push(testkit::InventoryProcess::start(bin, name, &vars, None).await?);
        }
        let nginx = testkit::NginxProcess::start([apps[0].port, apps[1].port]).await?;
        Ok(Self {
            nginx,
            _apps: apps,
            masters,
        })
    }
}

/// The verdict of every row printed.
async fn run(args: Args) -> anyhow::Result<Vec<Verdict>> {
    for note in &args.strategy.notes {
        eprintln!("cluster-table: {note}");
    }
    let bin = args.inventory.resolve()?;
    for line in table::CLUSTER_HEADER {
        println!("{line}");
    }

    let single = testkit::RedisProcess::start(&[]).await?;
    let stack = Stack::start(&bin, ("REDIS_URL", &single.url()), vec![single.port]).await?;
    let mut verdicts = rows(&args, "one node", &stack).await?;
    drop(stack);
    drop(single);

    let cluster = testkit::RedisCluster::start().await;
    let masters = cluster.masters().await.iter().map(|m| m.port).collect();
    let seeds = cluster.seed_urls().join(",");
    let stack = Stack::start(&bin, ("REDIS_CLUSTER", &seeds), masters).await?;
    verdicts.extend(rows(&args, "cluster, 3 masters", &stack).await?);
    Ok(verdicts)
}

async fn rows(args: &Args, redis: &str, stack: &Stack) -> anyhow::Result<Vec<Verdict>> {
    let mut verdicts = Vec::new();
    for &strategy in &args.strategy.list {
        for &items in &args.items {
            let plan = Plan::endless(stack.nginx.url(), strategy, args.concurrency as usize);
            let load = LoadTest::new(plan)?
                .with_items(items as usize)?
                .with_duration(args.duration);
            let before = commands(&stack.masters).await?;
            let r = load.run_strategy(strategy, None).await?;
            let after = commands(&stack.masters).await?;
            let sent: Vec<u64> = after
                .iter()
                .zip(&before)
                .map(|(a, b)| a.saturating_sub(*b))
                .collect();
            println!("{}", table::cluster_row(redis, &sent, &r));
            verdicts.push(r.verdict);
        }
    }
    Ok(verdicts)
}

/// Commands each master has run since it started (`INFO commandstats`, but not `INFO`).
async fn commands(masters: &[u16]) -> anyhow::Result<Vec<u64>> {
    let mut counts = Vec::new();
    for port in masters {
        let mut c = redis::Client::open(format!("redis://127.0.0.1:{port}"))?
            .get_multiplexed_async_connection()
            .await
            .with_context(|| format!("cannot reach the master on port {port}"))?;
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query_async(&mut c)
            .await?;
        counts.push(parse_commandstats(&info).values().sum());
    }
    Ok(counts)
}

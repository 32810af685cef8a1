//! `make failover-table`: the load test through nginx on the `sentinel` topology (a master,
//! two replicas, three sentinels, two instances), with the master killed part-way, for each
//! strategy and `REPLICA_ACKS` setting; each row on a topology of its own. Prints how many
//! sales were answered 200 and then lost with the old master.

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use inventory::lock::Strategy;
use loadtest::failover::{Failover, SentinelTopology};
use loadtest::{LoadTest, Plan};

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
    println!(
        "| strategy | REPLICA_ACKS | sold (200) | 200 lost | sales resumed after | errors | sales/s before the kill | sales/s overall | verdict |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
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
            println!("{}", line(strategy, acks, &r));
        }
    }
    Ok(())
}

/// One row of the table. An INCONCLUSIVE verdict carries its reason: the row is all a
/// reader of the table gets, and the reason is what to fix before running it again.
fn line(strategy: Strategy, acks: u32, r: &loadtest::StrategyReport) -> String {
    format!(
        "| {strategy} | {acks} | {} | {} | {} | {} | {} | {:.0} | {} |",
        r.sold,
        r.lost_200,
        r.resumed_after_s
            .map_or("never".into(), |s| format!("{s:.2} s")),
        errors(r),
        r.sales_per_s_before_failover
            .map_or("-".into(), |s| format!("{s:.0}")),
        r.sales_per_s,
        loadtest::table::markdown_verdict(r)
    )
}

/// The error count with its kinds, most frequent first: what a failover costs differs by
/// kind (a fast 503 `redis_unavailable` against a refused `not_replicated`).
fn errors(r: &loadtest::StrategyReport) -> String {
    if r.errors == 0 {
        return "0".into();
    }
    let mut kinds: Vec<_> = r.error_kinds.iter().collect();
    kinds.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
    // Escaped: a kind is the server's error code, and a `|` in it would end the cell.
    let kinds: Vec<String> = kinds
        .iter()
        .map(|(k, n)| format!("{} {n}", k.replace('|', "\\|")))
        .collect();
    format!("{} ({})", r.errors, kinds.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A report of `fenced` that sold nothing, every request failing with `kind`.
    fn failed(kind: &str) -> loadtest::StrategyReport {
        serde_json::from_value(serde_json::json!({
            "strategy": "fenced", "stock": 1_000_000_000, "requests": 4, "sold": 0,
            "sold_out": 0, "refused": 0, "errors": 4, "error_kinds": {kind: 4},
            "oversold": 0, "lost_updates": 0, "duplicates": 0, "remaining": 1_000_000_000,
            "audit_sales": 0, "instances": {}, "duration_s": 1.0, "throughput_rps": 4.0,
            "sales_per_s": 0.0, "latency_ms": {"p50": 1.0, "p90": 1.0, "p99": 1.0, "max": 1.0},
            "agrees": true, "verdict": "INCONCLUSIVE"
        }))
        .expect("a report")
    }

    #[test]
    fn a_strategy_named_twice_is_one_strategy_and_a_wrong_one_a_usage_error() {
        let args = Args::try_parse_from(["failover-table", "--strategy", "fenced,FENCED"]).unwrap();
        assert_eq!(args.strategy.list, [fenced()]);
        assert_eq!(args.strategy.notes.len(), 1, "{:?}", args.strategy.notes);
        let refusal =
            Args::try_parse_from(["failover-table", "--strategy", "fenced,v9"]).unwrap_err();
        assert_eq!(refusal.exit_code(), 2);
        assert!(
            refusal
                .to_string()
                .contains("unknown strategy \"v9\"; valid: "),
            "{refusal}"
        );
    }

    fn fenced() -> Strategy {
        "fenced".parse().unwrap()
    }

    #[test]
    fn an_inconclusive_row_says_why() {
        let fenced: Strategy = "fenced".parse().unwrap();
        let row = line(fenced, 1, &failed("not_replicated"));
        assert!(
            row.ends_with("| INCONCLUSIVE: nothing sold; 4 requests failed (not_replicated: 4) |"),
            "{row}"
        );
        let row = line(fenced, 1, &failed("a|b"));
        let cells = row.replace("\\|", "").matches('|').count();
        assert_eq!(cells, 10, "a | in a kind ends no cell: {row}");
        let mut safe = failed("x");
        safe.verdict = loadtest::Verdict::Safe;
        assert!(line(fenced, 0, &safe).ends_with("| SAFE |"));
    }
}

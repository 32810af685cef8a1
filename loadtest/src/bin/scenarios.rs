//! `scenarios`: makes each version's flaw happen on demand, against its own `redis-server`
//! and two `inventory` processes, and shows the next version surviving the same fault.

use std::process::ExitCode;

use clap::Parser;
use inventory::lock::Strategy;
use loadtest::scenarios::{self, Fault, Row, Run, Side};

/// Fault scenarios: one fault each, a timeline of what every instance did, and a verdict.
#[derive(Debug, Parser)]
#[command(
    name = "scenarios",
    version,
    about = "Makes each strategy's flaw happen on demand (a paused holder, a killed master, ...) and says whether it did"
)]
struct Args {
    /// Scenarios to run (comma-separated), or `all`.
    #[arg(long, default_value = "all", value_delimiter = ',', value_parser = scenario_arg)]
    scenario: Vec<Option<Fault>>,
    /// Run only this strategy's row of each scenario (default: both rows).
    #[arg(long)]
    strategy: Option<String>,
    /// Print one JSON object per run instead of timelines and a table.
    #[arg(long)]
    json: bool,
    /// Tries per run when the fault did not take place (the timing missed).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=10))]
    attempts: u32,
    /// The `inventory` binary to start (default: the one next to this executable).
    #[arg(long, env = "INVENTORY_BIN")]
    inventory_bin: Option<std::path::PathBuf>,
    /// Also write one HTML page with a picture of each run (inline SVG, nothing fetched).
    #[arg(long, value_name = "FILE.html")]
    report: Option<std::path::PathBuf>,
    /// List the scenarios and exit.
    #[arg(long)]
    list: bool,
}

#[tokio::main]
async fn main() -> ExitCode {
    match run(Args::parse()).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("scenarios: {e:#}");
            ExitCode::from(2)
        }
    }
}

/// `all` (every scenario, `None`) or one fault by name; a wrong name lists the valid ones.
fn scenario_arg(name: &str) -> Result<Option<Fault>, String> {
    match name.trim() {
        "all" => Ok(None),
        name => name.parse().map(Some).map_err(|e| format!("{e}, or all")),
    }
}

async fn run(args: Args) -> anyhow::Result<bool> {
    if args.list {
        for fault in Fault::ALL {
            let s = fault.scenario();
            let [flawed, survivor] = [Side::Flawed, Side::Survivor].map(|side| Row { fault, side });
            println!(
                "{:<22} {} (flaw: {}, survives: {})",
                fault,
                s.description,
                flawed.label(),
                survivor.label()
            );
        }
        return Ok(true);
    }
    let bin = match args.inventory_bin {
        Some(path) => path,
        None => testkit::inventory_binary()?,
    };
    // `all` anywhere in the list means every scenario.
    let wanted: Option<Vec<Fault>> = args.scenario.iter().copied().collect();
    let only: Option<Strategy> = args
        .strategy
        .as_deref()
        .map(str::parse)
        .transpose()
        .map_err(anyhow::Error::msg)?;
    let rows: Vec<_> = scenarios::rows()
        .into_iter()
        .filter(|row| wanted.as_ref().is_none_or(|w| w.contains(&row.fault)))
        .filter(|row| only.is_none_or(|o| o == row.strategy()))
        .collect();
    anyhow::ensure!(!rows.is_empty(), "no scenario matches");

    let mut runs = Vec::new();
    for row in rows {
        if !args.json {
            println!(
                "== {} / {}: {}",
                row.fault,
                row.label(),
                row.fault.scenario().description
            );
        }
        let run = scenarios::run_bounded(row, &bin, args.attempts).await?;
        if args.json {
            println!("{}", serde_json::to_string(&run)?);
        } else {
            print!("{}", run.timeline);
            println!(
                "   verdict: expected {}, observed {} -> {}\n",
                run.expected,
                run.observed,
                if run.ok { "ok" } else { "NOT OK" }
            );
        }
        runs.push(run);
    }
    if !args.json {
        print_table(&runs);
    }
    if let Some(path) = &args.report {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(path, loadtest::picture::page(&runs))
            .map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))?;
        if !args.json {
            println!("pictures: {}", path.display());
        }
    }
    Ok(runs.iter().all(|r| r.ok))
}

fn print_table(runs: &[Run]) {
    println!(
        "{:<22}  {:<20}  {:<8}  {:<8}  ok",
        "scenario", "strategy", "expected", "observed"
    );
    println!("{:-<22}  {:-<20}  {:-<8}  {:-<8}  --", "", "", "", "");
    for r in runs {
        println!(
            "{:<22}  {:<20}  {:<8}  {:<8}  {}",
            r.scenario,
            r.label(),
            r.expected.to_string(),
            r.observed.to_string(),
            if r.ok { "ok" } else { "NOT OK" }
        );
    }
    let ok = runs.iter().filter(|r| r.ok).count();
    println!("\n{ok} of {} runs ok", runs.len());
}

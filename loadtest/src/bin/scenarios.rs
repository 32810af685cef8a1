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
    /// Scenarios to run (comma-separated, in any case), or `all`.
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
    #[command(flatten)]
    inventory: loadtest::tool::InventoryBin,
    /// Also write one HTML page with a picture of each run (inline SVG, nothing fetched),
    /// once every run is done; its directory is created if missing. Checked before anything
    /// starts: a file that cannot be written is refused with exit status 2. Runs that fail
    /// write no page, and leave an existing one as it was.
    #[arg(long, value_name = "FILE.html")]
    report: Option<std::path::PathBuf>,
    /// List the scenarios and exit.
    // Refused with the options of a run, which it would otherwise ignore: `--list --json`
    // printed text, and `--list --report` wrote no page.
    #[arg(long, conflicts_with_all = ["scenario", "strategy", "json", "attempts", "report"])]
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

/// `all` (every scenario, `None`) or one fault by name, in any case; a wrong name lists the
/// valid ones.
fn scenario_arg(name: &str) -> Result<Option<Fault>, String> {
    if name.trim().eq_ignore_ascii_case("all") {
        return Ok(None);
    }
    name.parse().map(Some).map_err(|e| format!("{e}, or all"))
}

/// The rows of the `wanted` scenarios (every one for `None`) that run `only` (both rows for
/// `None`). A scenario named without a row for `only` is refused rather than skipped, with
/// the strategies it has rows for: the user asked for a run that does not exist.
fn select(wanted: Option<&[Fault]>, only: Option<Strategy>) -> Result<Vec<Row>, String> {
    let rows: Vec<Row> = scenarios::rows()
        .into_iter()
        .filter(|row| wanted.is_none_or(|w| w.contains(&row.fault)))
        .collect();
    let Some(only) = only else {
        return Ok(rows);
    };
    let has_row = |fault: Fault| {
        rows.iter()
            .any(|r| r.fault == fault && r.strategy() == only)
    };
    let missing: Vec<String> = wanted
        .unwrap_or_default()
        .iter()
        .filter(|&&fault| !has_row(fault))
        .map(|&fault| {
            format!(
                "scenario {fault} has no row for {only}; valid --strategy for it: {}",
                strategies(rows.iter().filter(|r| r.fault == fault))
            )
        })
        .collect();
    if !missing.is_empty() {
        let mut missing = missing;
        missing.dedup();
        return Err(missing.join("; "));
    }
    let chosen: Vec<Row> = rows
        .iter()
        .copied()
        .filter(|row| row.strategy() == only)
        .collect();
    if chosen.is_empty() {
        return Err(format!(
            "no scenario has a row for {only}; valid --strategy: {}",
            strategies(rows.iter())
        ));
    }
    Ok(chosen)
}

/// The strategies of `rows`, each once, in the rows' order.
fn strategies<'a>(rows: impl Iterator<Item = &'a Row>) -> String {
    let mut names: Vec<&str> = Vec::new();
    for row in rows {
        let name = row.strategy().name();
        if !names.contains(&name) {
            names.push(name);
        }
    }
    names.join(", ")
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
    if let Some(path) = &args.report {
        loadtest::tool::ready_report(path)?;
    }
    // `all` anywhere in the list means every scenario.
    let wanted: Option<Vec<Fault>> = args.scenario.iter().copied().collect();
    let only: Option<Strategy> = args
        .strategy
        .as_deref()
        .map(str::parse)
        .transpose()
        .map_err(anyhow::Error::msg)?;
    // Before the binary is looked for: a wrong row is the answer, whatever is installed.
    let rows = select(wanted.as_deref(), only).map_err(anyhow::Error::msg)?;
    let bin = args.inventory.resolve()?;

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
            if let Some(note) = &run.audit_note {
                println!("   {note}\n");
            }
        }
        runs.push(run);
    }
    if !args.json {
        print_table(&runs);
    }
    if let Some(path) = &args.report {
        loadtest::tool::write_report(path, loadtest::picture::page(&runs))?;
        if !args.json {
            println!("pictures: {}", path.display());
        }
    }
    Ok(runs.iter().all(|r| r.ok))
}

fn print_table(runs: &[Run]) {
    print!("{}", table(runs));
    let ok = runs.iter().filter(|r| r.ok).count();
    println!("\n{ok} of {} runs ok", runs.len());
}

/// The summary table, its strategy column as wide as its widest label
/// (`fenced REPLICA_ACKS=0` is 21). A safe row with an unclean audit says so.
fn table(runs: &[Run]) -> String {
    use std::fmt::Write;
    let w = runs
        .iter()
        .map(|r| r.label().len())
        .max()
        .unwrap_or(0)
        .max(8);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<22}  {:<w$}  {:<8}  {:<8}  ok",
        "scenario", "strategy", "expected", "observed"
    );
    let _ = writeln!(out, "{:-<22}  {:-<w$}  {:-<8}  {:-<8}  --", "", "", "", "");
    for r in runs {
        let audit = if r.audit_note.is_some() {
            "  (audit NOT clean)"
        } else {
            ""
        };
        let _ = writeln!(
            out,
            "{:<22}  {:<w$}  {:<8}  {:<8}  {}{audit}",
            r.scenario,
            r.label(),
            r.expected.to_string(),
            r.observed.to_string(),
            if r.ok { "ok" } else { "NOT OK" }
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strategy(name: &str) -> Option<Strategy> {
        Some(name.parse().expect("a strategy"))
    }

    #[test]
    fn a_row_that_does_not_exist_is_refused_naming_the_scenarios_strategies() {
        let pause: Fault = "process-pause".parse().unwrap();
        let e = select(Some(&[pause]), strategy("atomic")).unwrap_err();
        assert_eq!(
            e,
            "scenario process-pause has no row for atomic; valid --strategy for it: watchdog, fenced"
        );
        // Named with one that has the row, the one without is still refused, not skipped.
        let two: Fault = "two-instances".parse().unwrap();
        let e = select(Some(&[two, pause]), strategy("local")).unwrap_err();
        assert!(
            e.starts_with("scenario process-pause has no row for local;"),
            "{e}"
        );
        assert!(!e.contains("two-instances"), "{e}");
        let rows = select(Some(&[pause]), strategy("v8")).unwrap();
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].strategy().name(), "watchdog");
        assert_eq!(select(Some(&[pause]), None).unwrap().len(), 2);
        // Both failover rows are fenced, told apart by REPLICA_ACKS: the strategy once.
        let failover: Fault = "failover".parse().unwrap();
        let e = select(Some(&[failover]), strategy("atomic")).unwrap_err();
        assert!(e.ends_with("valid --strategy for it: fenced"), "{e}");
        assert_eq!(
            select(Some(&[failover]), strategy("fenced")).unwrap().len(),
            2
        );
    }

    #[test]
    fn every_scenario_runs_the_rows_of_the_strategy() {
        let fenced = select(None, strategy("fenced")).unwrap();
        assert!(fenced.len() > 1, "{fenced:?}");
        assert!(fenced.iter().all(|r| r.strategy().name() == "fenced"));
        assert_eq!(select(None, None).unwrap().len(), scenarios::rows().len());
        // Every strategy has a row today; one added without any would be refused by name.
        for s in Strategy::ALL {
            assert!(!select(None, Some(s)).unwrap().is_empty(), "{s}");
        }
    }

    /// "fenced REPLICA_ACKS=0" is 21 characters: in a 20-wide column it shifted its row.
    #[test]
    fn the_summary_table_lines_up_with_its_widest_label() {
        let run = |setting: &str| Run {
            scenario: "failover",
            strategy: "fenced",
            setting: Some(setting.to_owned()),
            expected: scenarios::Observed::Safe,
            observed: scenarios::Observed::Safe,
            ok: true,
            details: serde_json::Value::Null,
            audit_note: None,
            timeline: String::new(),
            entries: Vec::new(),
        };
        let table = table(&[run("REPLICA_ACKS=0"), run("REPLICA_ACKS=10")]);
        let columns: Vec<usize> = table
            .lines()
            .filter(|l| !l.starts_with('-'))
            .map(|l| l.find("expected").or_else(|| l.find("safe")).unwrap())
            .collect();
        assert!(columns.windows(2).all(|w| w[0] == w[1]), "{table}");
    }

    #[test]
    fn scenario_names_and_all_are_read_in_any_case() {
        let args = Args::try_parse_from(["scenarios", "--scenario", "Process-Pause,FAILOVER"]);
        let pause: Fault = "process-pause".parse().unwrap();
        let failover: Fault = "failover".parse().unwrap();
        assert_eq!(args.unwrap().scenario, [Some(pause), Some(failover)]);
        let args = Args::try_parse_from(["scenarios", "--scenario", "ALL"]);
        assert_eq!(args.unwrap().scenario, [None]);
    }

    #[test]
    fn an_unknown_scenario_is_refused_naming_the_valid_ones() {
        let e = Args::try_parse_from(["scenarios", "--scenario", "process-paus"])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("unknown scenario \"process-paus\"; valid: "),
            "{e}"
        );
        for fault in Fault::ALL {
            assert!(e.contains(fault.name()), "{e}");
        }
        assert!(e.contains("or all"), "{e}");
    }
}

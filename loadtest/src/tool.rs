//! What the crate's tools share: the `--inventory-bin` of the tools that start their own
//! processes (`failover-table`, `cluster-table`, `scenarios`), the one reader of a
//! `--strategy` list (`loadtest` and the two tables), the one parser of flags given in
//! seconds (every tool's, as clap's `value_parser`), the `--report` check, and the exit
//! statuses of the tables.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use inventory::lock::Strategy;

/// `--inventory-bin`: which `inventory` the tool starts.
#[derive(Debug, Clone, clap::Args)]
pub struct InventoryBin {
    /// The `inventory` binary (default: the one next to this executable).
    #[arg(long = "inventory-bin", env = "INVENTORY_BIN")]
    path: Option<PathBuf>,
}

impl InventoryBin {
    /// The binary, refused unless it is a file: checked before a tool starts anything, or
    /// it would start Redis and sentinels (and print a table's header) for an instance it
    /// cannot run.
    pub fn resolve(&self) -> anyhow::Result<PathBuf> {
        let path = match &self.path {
            Some(path) => path.clone(),
            None => testkit::inventory_binary()?,
        };
        anyhow::ensure!(
            path.is_file(),
            "no inventory binary at {} (from --inventory-bin or INVENTORY_BIN)",
            path.display()
        );
        // Absolute: the instances start in directories of their own, where a path relative
        // to the caller's named nothing ("cannot run target/release/inventory").
        Ok(std::path::absolute(&path)?)
    }
}

/// What a `--strategy` list names: `all`, or strategy names and aliases, comma-separated,
/// in any case.
#[derive(Debug, Clone, PartialEq)]
pub struct Strategies {
    /// Each strategy once, in the order first named.
    pub list: Vec<Strategy>,
    /// A line for stderr for each strategy named more than once.
    pub notes: Vec<String>,
}

/// Reads a `--strategy` list, as clap's `value_parser`. Aliases name their strategy (`v8` is
/// `watchdog`) and names are read in any case, so `v8,watchdog` or `fenced,Fenced` would
/// otherwise run the same lock twice and print two rows of it; each such strategy runs
/// once, and a note says so rather than leaving the user to count rows.
pub fn strategies(list: &str) -> Result<Strategies, String> {
    let mut named: Vec<(Strategy, Vec<&str>)> = Vec::new();
    for name in list.split(',') {
        let found = if name.trim().eq_ignore_ascii_case("all") {
            Strategy::ALL.to_vec()
        } else {
            vec![name.parse()?]
        };
        for strategy in found {
            match named.iter_mut().find(|(s, _)| *s == strategy) {
                Some((_, spellings)) => spellings.push(name.trim()),
                None => named.push((strategy, vec![name.trim()])),
            }
        }
    }
    let notes = named
        .iter()
        .filter(|(_, spellings)| spellings.len() > 1)
        .map(|(strategy, spellings)| {
            format!(
                "--strategy names {strategy} {} times ({}); it runs once",
                spellings.len(),
                spellings.join(", ")
            )
        })
        .collect();
    Ok(Strategies {
        list: named.into_iter().map(|(s, _)| s).collect(),
        notes,
    })
}

/// Makes ready for a `--report` page before the run, so that a path that cannot be written
/// fails at once, named, rather than after minutes of load (the page was then lost): its
/// directory is created if missing, a directory is refused as the file, and the file is
/// opened for writing, as the page will be.
///
/// Nothing is left of the check: a file that did not exist is removed again, and one that
/// did is neither truncated nor changed. A run that fails after it leaves no empty page, and
/// the last run's page stays until a run that completes replaces it.
pub fn ready_report(path: &Path) -> anyhow::Result<()> {
    if path.is_dir() {
        anyhow::bail!("--report {}: is a directory; give a file", path.display());
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| {
            anyhow::anyhow!(
                "--report {}: creating {}: {e}",
                path.display(),
                dir.display()
            )
        })?;
    }
    // Whether there is anything at the path, a dangling link included: only a file this
    // check created is removed (removing a link would not remove what it names).
    let existed = std::fs::symlink_metadata(path).is_ok();
    std::fs::OpenOptions::new()
        .write(true)
        .create(!existed)
        .open(path)
        .map_err(|e| anyhow::anyhow!("--report {}: cannot be written: {e}", path.display()))?;
    if !existed {
        std::fs::remove_file(path).map_err(|e| {
            anyhow::anyhow!(
                "--report {}: removing the file made to check it: {e}",
                path.display()
            )
        })?;
    }
    Ok(())
}

/// Writes a `--report` page, naming the file when it cannot.
pub fn write_report(path: &Path, page: String) -> anyhow::Result<()> {
    std::fs::write(path, page)
        .map_err(|e| anyhow::anyhow!("--report {}: writing it: {e}", path.display()))
}

/// The exit status of a run with an INCONCLUSIVE verdict: `loadtest`'s, and the tables'.
pub const INCONCLUSIVE: u8 = 3;

/// The exit statuses of the table tools, for their `--help`.
pub const TABLE_EXIT_STATUS: &str = "Exit status: 0 when every row measured something; 3 \
when a row is INCONCLUSIVE (the row says why, e.g. no request was sent; every row is printed \
all the same), as loadtest's; 2 for a wrong option or value; 1 when a run fails.";

/// A table tool's exit status from the verdicts of the rows it printed: [`INCONCLUSIVE`]
/// when any is, as `loadtest` does, since a table with a row that measured nothing must not
/// pass a script's check; else as [`exit`].
pub fn exit_after_rows(tool: &str, result: anyhow::Result<Vec<crate::Verdict>>) -> ExitCode {
    match result {
        Ok(verdicts) => {
            let inconclusive = verdicts
                .iter()
                .filter(|v| **v == crate::Verdict::Inconclusive)
                .count();
            if inconclusive == 0 {
                return ExitCode::SUCCESS;
            }
            eprintln!(
                "{tool}: {inconclusive} of {} rows INCONCLUSIVE; exit status {INCONCLUSIVE}",
                verdicts.len()
            );
            ExitCode::from(INCONCLUSIVE)
        }
        Err(e) => exit(tool, Err(e)),
    }
}

/// A tool's exit status, its error (with causes) on stderr under its name.
pub fn exit(tool: &str, result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{tool}: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// The longest flag given in seconds (`--duration`, `--failover-after`, `--wait-budget`): a
/// day. Beyond it a run is a mistake, and far beyond it the seconds no longer fit a
/// `Duration` or a deadline.
pub const MAX_SECONDS: f64 = 86_400.0;

/// A flag in seconds above 0, up to a day, as clap's `value_parser`: a wrong value is then a
/// usage error (exit status 2) named by clap with its flag, before the tool does anything.
pub fn seconds_above_zero(text: &str) -> Result<Duration, String> {
    parse_seconds(text, false)
}

/// A flag in seconds from 0, up to a day, as clap's `value_parser`.
pub fn seconds_from_zero(text: &str) -> Result<Duration, String> {
    parse_seconds(text, true)
}

fn parse_seconds(text: &str, zero_ok: bool) -> Result<Duration, String> {
    match text.trim().parse::<f64>() {
        Ok(value) => in_range(value, zero_ok),
        Err(_) => Err(format!("not a number; {}", valid_seconds(zero_ok))),
    }
}

/// NaN fails both comparisons, so it is refused too: `Duration::from_secs_f64` panics on it.
fn in_range(value: f64, zero_ok: bool) -> Result<Duration, String> {
    let low_ok = if zero_ok { value >= 0.0 } else { value > 0.0 };
    if low_ok && value <= MAX_SECONDS {
        return Ok(Duration::from_secs_f64(value));
    }
    Err(valid_seconds(zero_ok))
}

fn valid_seconds(zero_ok: bool) -> String {
    let low = if zero_ok { "from 0" } else { "above 0" };
    format!("valid: a number of seconds {low}, at most {MAX_SECONDS} (a day)")
}

/// The most requests in flight a tool opens at once (`--concurrency`), each on a
/// connection of its own: beyond it, nginx waits for connections to the instances, times
/// out and marks them down, and the run measures that.
pub const MAX_CONCURRENCY: u64 = 4096;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_strategy_named_twice_runs_once_whatever_its_spelling_and_says_so() {
        let watchdog: Strategy = "watchdog".parse().unwrap();
        let fenced: Strategy = "fenced".parse().unwrap();
        let named = strategies("v8,fenced, WATCHDOG ,Fenced,v8").unwrap();
        assert_eq!(named.list, [watchdog, fenced]);
        assert_eq!(
            named.notes,
            [
                "--strategy names watchdog 3 times (v8, WATCHDOG, v8); it runs once",
                "--strategy names fenced 2 times (fenced, Fenced); it runs once",
            ]
        );
        let named = strategies("fenced,ALL").unwrap();
        assert_eq!(named.list.len(), Strategy::ALL.len());
        assert_eq!(named.list[0], fenced, "the order first named");
        assert_eq!(named.notes.len(), 1, "{:?}", named.notes);
        let named = strategies("v1,v8").unwrap();
        assert_eq!(named.list.len(), 2);
        assert!(named.notes.is_empty(), "{:?}", named.notes);
        let refusal = strategies("v8,v9").unwrap_err();
        assert!(
            refusal.starts_with("unknown strategy \"v9\"; valid: none, local,"),
            "{refusal}"
        );
    }

    /// A path of this test's own under the temporary directory, gone at first.
    fn scratch(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("ready-report-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(name);
        let _ = std::fs::remove_file(&path);
        path
    }

    /// A file the user may not write (sysfs takes no new file, root's included) is refused
    /// by the check, before a run: it used to pass, and the page was lost after the run.
    #[test]
    fn a_report_that_cannot_be_written_is_refused_by_the_check() {
        let refusal = ready_report(Path::new("/sys/kernel/x.html"))
            .unwrap_err()
            .to_string();
        assert!(
            refusal.starts_with("--report /sys/kernel/x.html: cannot be written: "),
            "{refusal}"
        );
        assert!(!Path::new("/sys/kernel/x.html").exists());
    }

    #[test]
    fn the_check_leaves_no_file_behind_and_an_existing_page_as_it_was() {
        let new = scratch("new.html");
        ready_report(&new).unwrap();
        assert!(!new.exists(), "an empty page was left behind");
        let old = scratch("old.html");
        std::fs::write(&old, "the last run's page").unwrap();
        ready_report(&old).unwrap();
        assert_eq!(
            std::fs::read_to_string(&old).unwrap(),
            "the last run's page"
        );
        let nested = scratch("a").join("b").join("page.html");
        ready_report(&nested).unwrap();
        assert!(nested.parent().unwrap().is_dir() && !nested.exists());
        std::fs::remove_dir_all(scratch("a").parent().unwrap()).unwrap();
    }

    #[test]
    fn seconds_as_clap_reads_them_are_refused_as_the_numbers_are() {
        assert_eq!(seconds_above_zero(" 1.5"), Ok(Duration::from_millis(1500)));
        assert_eq!(seconds_from_zero("0"), Ok(Duration::ZERO));
        for bad in ["0", "-1", "inf", "NaN", "1e30", "86400.5"] {
            let refusal = seconds_above_zero(bad).expect_err(bad);
            assert_eq!(
                refusal,
                "valid: a number of seconds above 0, at most 86400 (a day)"
            );
        }
        assert_eq!(
            seconds_from_zero("soon").unwrap_err(),
            "not a number; valid: a number of seconds from 0, at most 86400 (a day)"
        );
    }

    #[test]
    fn seconds_beyond_a_day_or_not_numbers_are_refused_naming_the_range() {
        for bad in [
            0.0,
            -1.0,
            f64::NAN,
            f64::INFINITY,
            86_400.5,
            1e19,
            1e30,
            1e300,
        ] {
            let refusal = in_range(bad, false).expect_err("taken");
            assert!(refusal.contains("above 0, at most 86400"), "{refusal}");
        }
        assert!(in_range(0.0, true).is_ok());
        assert!(in_range(-0.5, true).is_err());
        assert_eq!(
            in_range(86_400.0, false).ok(),
            Some(Duration::from_secs(86_400))
        );
    }
}

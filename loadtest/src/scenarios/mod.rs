//! Fault scenarios: each provokes one fault against its own `redis-server` and two
//! `inventory` processes, records what happened, and judges it from the evidence (statuses,
//! the audit, the keys in Redis), never from the strategy's name. Each scenario is run for
//! the strategy that shows the flaw and for the one that survives it.
//!
//! One file per fault, named after it, holds its description, its two strategies, any
//! setting it needs, and how it is provoked and judged; [`Fault`] lists them, and a match on
//! it (never on a name) picks the file. What they share is in `env.rs` (the processes and
//! the requests) and, for `slow-holder` and `release-race`, `handover.rs`.
//!
//! A module of `loadtest` rather than a crate of its own: the scenarios are read through
//! this crate's timeline, run by its `scenarios` binary, and start their processes with
//! `testkit` like the rest of it; a crate of their own would still depend on this one (or
//! take the timeline with it) and only add a build unit, with no new boundary to keep.

use std::collections::BTreeMap;
use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

use anyhow::Context;
use inventory::lock::Strategy;
use serde::Serialize;
use serde_json::{Value, json};
use tokio::time::Instant;

use env::{Env, Nodes};

mod contention;
mod crash_holder;
mod env;
mod failover;
mod failover_wrong_replica;
mod handover;
mod long_work;
mod mixed_writers;
mod node_loss;
mod node_restart;
mod partition;
mod process_pause;
mod redlock_pause;
mod reentry;
mod release_race;
mod slow_holder;
mod two_instances;

/// One fault, provoked on demand; each has a file of its own, named after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fault {
    TwoInstances,
    CrashHolder,
    SlowHolder,
    ReleaseRace,
    Reentry,
    LongWork,
    ProcessPause,
    MixedWriters,
    NodeLoss,
    Partition,
    RedlockPause,
    NodeRestart,
    Contention,
    Failover,
    FailoverWrongReplica,
}

impl Fault {
    /// Every fault, in the order of the story (each row's flawed strategy is the survivor
    /// of the row before, until `mixed-writers`).
    pub const ALL: [Fault; 15] = [
        Fault::TwoInstances,
        Fault::CrashHolder,
        Fault::SlowHolder,
        Fault::ReleaseRace,
        Fault::Reentry,
        Fault::LongWork,
        Fault::ProcessPause,
        Fault::MixedWriters,
        Fault::NodeLoss,
        Fault::Partition,
        Fault::RedlockPause,
        Fault::NodeRestart,
        Fault::Contention,
        Fault::Failover,
        Fault::FailoverWrongReplica,
    ];

    /// Its name on the command line, in `--json` and in the test names.
    pub const fn name(self) -> &'static str {
        match self {
            Fault::TwoInstances => "two-instances",
            Fault::CrashHolder => "crash-holder",
            Fault::SlowHolder => "slow-holder",
            Fault::ReleaseRace => "release-race",
            Fault::Reentry => "reentry",
            Fault::LongWork => "long-work",
            Fault::ProcessPause => "process-pause",
            Fault::MixedWriters => "mixed-writers",
            Fault::NodeLoss => "node-loss",
            Fault::Partition => "partition",
            Fault::RedlockPause => "redlock-pause",
            Fault::NodeRestart => "node-restart",
            Fault::Contention => "contention",
            Fault::Failover => "failover",
            Fault::FailoverWrongReplica => "failover-wrong-replica",
        }
    }

    /// What it does, and the strategy expected to fall to it and the one to survive it.
    pub const fn scenario(self) -> Scenario {
        match self {
            Fault::TwoInstances => two_instances::SCENARIO,
            Fault::CrashHolder => crash_holder::SCENARIO,
            Fault::SlowHolder => slow_holder::SCENARIO,
            Fault::ReleaseRace => release_race::SCENARIO,
            Fault::Reentry => reentry::SCENARIO,
            Fault::LongWork => long_work::SCENARIO,
            Fault::ProcessPause => process_pause::SCENARIO,
            Fault::MixedWriters => mixed_writers::SCENARIO,
            Fault::Contention => contention::SCENARIO,
            Fault::NodeLoss => node_loss::SCENARIO,
            Fault::Partition => partition::SCENARIO,
            Fault::RedlockPause => redlock_pause::SCENARIO,
            Fault::NodeRestart => node_restart::SCENARIO,
            Fault::Failover => failover::SCENARIO,
            Fault::FailoverWrongReplica => failover_wrong_replica::SCENARIO,
        }
    }

    /// Where the stock's Redis and the lock nodes run for `strategy`'s row.
    fn nodes(self, strategy: Strategy) -> Nodes {
        match self {
            Fault::NodeLoss => node_loss::nodes(strategy),
            Fault::Partition => partition::nodes(strategy),
            Fault::NodeRestart => Nodes::ThirdInNamespace,
            _ => Nodes::Shared,
        }
    }

    /// Replicas of the stock's Redis, watched by three sentinels that the instances ask for
    /// the master (`REDIS_SENTINELS`); none by default.
    fn replicas(self) -> usize {
        match self {
            Fault::Failover => 1,
            Fault::FailoverWrongReplica => 2,
            _ => 0,
        }
    }

    /// Arguments for the stock's `redis-server` beyond the common ones.
    fn redis_extra(self) -> &'static [&'static str] {
        match self {
            // The stock must survive its node's crash for "sales resume when it returns".
            Fault::NodeLoss => &["--appendonly", "yes", "--appendfsync", "always"],
            // A replica that (re)syncs after the failover is served at once, not after the
            // 5 s that a diskless sync waits by default for more replicas to join.
            Fault::Failover | Fault::FailoverWrongReplica => &["--repl-diskless-sync-delay", "0"],
            _ => &[],
        }
    }

    /// The settings it needs beyond the common ones, for instance `app`.
    fn configure(self, app: &str, env: &mut BTreeMap<String, String>) {
        match self {
            Fault::ReleaseRace => release_race::configure(app, env),
            Fault::Reentry => reentry::configure(app, env),
            Fault::NodeLoss => node_loss::configure(env),
            Fault::Failover | Fault::FailoverWrongReplica => failover::configure(env),
            Fault::TwoInstances
            | Fault::CrashHolder
            | Fault::SlowHolder
            | Fault::LongWork
            | Fault::ProcessPause
            | Fault::MixedWriters
            | Fault::Partition
            | Fault::RedlockPause
            | Fault::NodeRestart
            | Fault::Contention => {}
        }
    }

    /// Provokes it on `env` with `strategy`, and judges what happened.
    async fn provoke(self, env: &mut Env, strategy: Strategy) -> anyhow::Result<(Observed, Value)> {
        match self {
            Fault::TwoInstances => two_instances::run(env, strategy).await,
            Fault::CrashHolder => crash_holder::run(env, strategy).await,
            Fault::SlowHolder => slow_holder::run(env, strategy).await,
            Fault::ReleaseRace => release_race::run(env, strategy).await,
            Fault::Reentry => reentry::run(env, strategy).await,
            Fault::LongWork => long_work::run(env, strategy).await,
            Fault::ProcessPause => process_pause::run(env, strategy).await,
            Fault::MixedWriters => mixed_writers::run(env, strategy).await,
            Fault::NodeLoss => node_loss::run(env, strategy).await,
            Fault::Partition => partition::run(env, strategy).await,
            Fault::RedlockPause => redlock_pause::run(env, strategy).await,
            Fault::NodeRestart => node_restart::run(env, strategy).await,
            Fault::Contention => contention::run(env, strategy).await,
            Fault::Failover => failover::run(env, strategy).await,
            Fault::FailoverWrongReplica => failover_wrong_replica::run(env, strategy).await,
        }
    }
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // `pad`, so that `{:<14}` lines a table up as it does for a `&str`.
        f.pad(self.name())
    }
}

impl FromStr for Fault {
    type Err = String;

    /// In any case and with spaces around it, as a strategy's name is read: the two are
    /// named side by side (`--scenario Process-Pause --strategy Fenced`).
    fn from_str(name: &str) -> Result<Self, Self::Err> {
        let name = name.trim();
        Self::ALL
            .into_iter()
            .find(|f| f.name().eq_ignore_ascii_case(name))
            .ok_or_else(|| {
                let valid: Vec<_> = Self::ALL.iter().map(|f| f.name()).collect();
                format!("unknown scenario {name:?}; valid: {}", valid.join(", "))
            })
    }
}

/// A fault's row pair: what it does, the strategy that falls to it, the one that survives.
#[derive(Debug, Clone, Copy)]
pub struct Scenario {
    pub description: &'static str,
    /// The strategy expected to show the flaw.
    pub flawed: Strategy,
    /// The next strategy, expected to survive it.
    pub survivor: Strategy,
    /// A setting the two rows differ in, when the survivor is the same strategy configured
    /// otherwise (`REPLICA_ACKS=0` against `1`).
    pub setting: Option<Setting>,
}

/// An environment variable of the instances, and its value in each row.
#[derive(Debug, Clone, Copy)]
pub struct Setting {
    pub var: &'static str,
    pub flawed: &'static str,
    pub survivor: &'static str,
}

/// Which of a scenario's two rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Side {
    Flawed,
    Survivor,
}

/// One row: a fault, and the side of it that runs (its strategy and setting).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Row {
    pub fault: Fault,
    pub side: Side,
}

impl Row {
    pub fn strategy(self) -> Strategy {
        let s = self.fault.scenario();
        match self.side {
            Side::Flawed => s.flawed,
            Side::Survivor => s.survivor,
        }
    }

    /// The row's own value of its scenario's setting, as `(variable, value)`.
    pub fn setting(self) -> Option<(&'static str, &'static str)> {
        let setting = self.fault.scenario().setting?;
        Some(match self.side {
            Side::Flawed => (setting.var, setting.flawed),
            Side::Survivor => (setting.var, setting.survivor),
        })
    }

    pub fn expected(self) -> Observed {
        match self.side {
            Side::Flawed => Observed::Flaw,
            Side::Survivor => Observed::Safe,
        }
    }

    /// The strategy, and the setting when the row has one: `fenced REPLICA_ACKS=1`.
    pub fn label(self) -> String {
        match self.setting() {
            Some((var, value)) => format!("{} {var}={value}", self.strategy()),
            None => self.strategy().to_string(),
        }
    }

    /// The row of `fault` whose [`label`](Self::label) is `label`.
    pub fn find(fault: Fault, label: &str) -> Option<Row> {
        [Side::Flawed, Side::Survivor]
            .into_iter()
            .map(|side| Row { fault, side })
            .find(|row| row.label() == label)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Observed {
    Flaw,
    Safe,
    /// The fault did not take place (the timing missed): neither verdict.
    Missed,
}

impl std::fmt::Display for Observed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Observed::Flaw => "flaw",
            Observed::Safe => "safe",
            Observed::Missed => "missed",
        })
    }
}

/// One run: `--json` prints exactly this (without the timeline), one per line.
#[derive(Debug, Clone, Serialize)]
pub struct Run {
    pub scenario: &'static str,
    pub strategy: &'static str,
    /// The row's setting (`REPLICA_ACKS=1`), when its scenario has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub setting: Option<String>,
    pub expected: Observed,
    pub observed: Observed,
    pub ok: bool,
    pub details: Value,
    /// What the audit found when it is not clean and the verdict is `safe`: the verdict
    /// judges the row's fault only, and "safe" must not be read as "nothing sold twice".
    #[serde(skip_serializing_if = "Option::is_none")]
    pub audit_note: Option<String>,
    #[serde(skip)]
    pub timeline: String,
    /// The entries the timeline was rendered from, for the picture (`crate::picture`).
    #[serde(skip)]
    pub entries: Vec<crate::timeline::Entry>,
}

impl Run {
    /// The strategy, and the setting when the row has one.
    pub fn label(&self) -> String {
        match &self.setting {
            Some(setting) => format!("{} {setting}", self.strategy),
            None => self.strategy.to_owned(),
        }
    }
}

/// Runs one row. A run whose fault did not take place is tried again, up to `attempts`
/// times; the attempts are reported in the details.
pub async fn run(row: Row, bin: &Path, attempts: u32) -> anyhow::Result<Run> {
    let (fault, strategy, expected) = (row.fault, row.strategy(), row.expected());
    let mut attempt = 0;
    loop {
        attempt += 1;
        let mut env = Env::start(bin, row).await?;
        let (observed, mut details) = fault.provoke(&mut env, strategy).await?;
        if observed == Observed::Missed && attempt < attempts {
            continue;
        }
        details["attempts"] = json!(attempt);
        return Ok(Run {
            scenario: fault.name(),
            strategy: strategy.name(),
            setting: row.setting().map(|(var, value)| format!("{var}={value}")),
            expected,
            observed,
            ok: observed == expected,
            audit_note: (observed == Observed::Safe)
                .then(|| audit_note(&details))
                .flatten(),
            details,
            timeline: env.timeline.render(),
            entries: env.timeline.entries(),
        });
    }
}

/// The audit's findings in words when it is not clean (`details.audit`), else `None`.
pub fn audit_note(details: &Value) -> Option<String> {
    let audit = details.get("audit")?;
    if audit.get("clean")?.as_bool()? {
        return None;
    }
    let n = |name: &str| audit.get(name).and_then(Value::as_i64).unwrap_or(0);
    let twice: i64 = audit
        .get("duplicates")
        .and_then(Value::as_array)
        .map(|d| {
            d.iter()
                .filter_map(|d| d.get("times")?.as_i64())
                .map(|t| t - 1)
                .sum()
        })
        .unwrap_or(0);
    let mut found = Vec::new();
    if n("lost_updates") != 0 {
        found.push(format!("{} lost update(s)", n("lost_updates")));
    }
    if twice > 0 {
        found.push(format!("{twice} stock value(s) sold twice"));
    }
    if n("oversold") > 0 {
        found.push(format!("{} oversold", n("oversold")));
    }
    if found.is_empty() {
        found.push("not clean".to_owned());
    }
    Some(format!(
        "the audit is NOT clean ({}): the verdict judges this row's fault only, not \
         whether anything was sold twice",
        found.join(", ")
    ))
}

/// Every row: each scenario for its flawed strategy, then for its survivor.
pub fn rows() -> Vec<Row> {
    Fault::ALL
        .into_iter()
        .flat_map(|fault| [Side::Flawed, Side::Survivor].map(|side| Row { fault, side }))
        .collect()
}

/// How long a run may take at most, for callers that want a bound.
pub const RUN_BOUND: Duration = Duration::from_secs(60);

pub async fn run_bounded(row: Row, bin: &Path, attempts: u32) -> anyhow::Result<Run> {
    let started = Instant::now();
    tokio::time::timeout(RUN_BOUND, run(row, bin, attempts))
        .await
        .with_context(|| {
            format!(
                "{} / {} took longer than {:?}",
                row.fault,
                row.label(),
                started.elapsed()
            )
        })?
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// slow-holder / owner-check said "observed safe" beside an audit that found a value
    /// sold twice; the text must say what the audit found.
    #[test]
    fn an_unclean_audit_is_said_beside_a_safe_verdict() {
        let details = json!({"audit": {"clean": false, "lost_updates": 1, "oversold": 0,
            "duplicates": [{"remaining": 3, "times": 2}]}});
        let note = audit_note(&details).unwrap();
        assert!(note.contains("NOT clean"), "{note}");
        assert!(note.contains("1 lost update(s)"), "{note}");
        assert!(note.contains("1 stock value(s) sold twice"), "{note}");
        assert_eq!(audit_note(&json!({"audit": {"clean": true}})), None);
        assert_eq!(audit_note(&json!({})), None);
    }

    #[test]
    fn every_fault_is_found_by_its_name_and_a_wrong_name_lists_the_valid_ones() {
        for fault in Fault::ALL {
            assert_eq!(fault.name().parse::<Fault>(), Ok(fault));
        }
        // In any case, as strategy names are: `--scenario Process-Pause --strategy Fenced`.
        assert_eq!("Process-PAUSE".parse::<Fault>(), Ok(Fault::ProcessPause));
        assert_eq!(" failover ".parse::<Fault>(), Ok(Fault::Failover));
        let error = "release_race".parse::<Fault>().unwrap_err();
        assert!(
            error.contains("valid: two-instances, crash-holder"),
            "{error}"
        );
    }

    #[test]
    fn each_row_pair_differs_in_its_strategy_or_its_setting_and_is_found_by_its_label() {
        for fault in Fault::ALL {
            let s = fault.scenario();
            let setting_differs = s.setting.is_some_and(|s| s.flawed != s.survivor);
            assert!(s.flawed != s.survivor || setting_differs, "{fault}");
        }
        let rows = rows();
        assert_eq!(rows.len(), 2 * Fault::ALL.len());
        for row in rows {
            assert_eq!(Row::find(row.fault, &row.label()), Some(row));
        }
    }
}

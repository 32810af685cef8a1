//! `contention`: many buyers, long work, little stock. `optimistic` takes no lock: every
//! buyer reads and works at once, one `EXEC` wins, and every other one is refused (nil) and
//! starts over, its work thrown away. It still sells exactly the stock: its flaw is cost,
//! not safety (a sale that breaks the books fails the run instead of counting as the flaw).
//! `fenced` makes the buyers wait for the lock instead: one attempt, one piece of work, per
//! sale. The evidence is each instance's `/metrics`: retries, refused `EXEC`s and the work
//! thrown away, against the sales made.

use std::collections::BTreeMap;

use inventory::lock::Strategy;
use inventory::strategy::RedisLock;
use serde_json::{Value, json};

use super::env::{Env, audit_json, query};
use super::{Observed, Scenario};

pub(super) const SCENARIO: Scenario = Scenario {
    description: "32 buyers with 50 ms of work each on a stock of 10: optimistic retries, fenced waits",
    flawed: Strategy::Optimistic,
    survivor: Strategy::Redis(RedisLock::Fenced),
    setting: None,
};

const STOCK: i64 = 10;
const BUYERS: usize = 32;
const WORK_MS: u64 = 50;

pub(super) async fn run(env: &Env, strategy: Strategy) -> anyhow::Result<(Observed, Value)> {
    env.reset(STOCK).await?;
    let before = cost(env, strategy).await?;
    let sales = (0..BUYERS).map(|i| env.sale(i % 2, query(strategy, WORK_MS)));
    let replies = futures_util::future::join_all(sales).await;
    let after = cost(env, strategy).await?;
    let audit = env.audit().await?;
    let mut outcomes = BTreeMap::<String, u64>::new();
    for r in &replies {
        *outcomes.entry(r.code().to_owned()).or_default() += 1;
    }
    let sold = replies.iter().filter(|r| r.status == 200).count() as i64;
    // Safety is not what this row is about: broken books fail the run outright.
    anyhow::ensure!(
        audit.clean && sold == STOCK - audit.remaining,
        "{strategy} broke the books under contention: {outcomes:?}, {}",
        audit_json(&audit)
    );
    let retries = after.retries - before.retries;
    let conflicts = after.conflicts - before.conflicts;
    let wasted_ms = ((after.wasted_s - before.wasted_s) * 1000.0).round() as u64;
    let per_sale = if sold > 0 {
        retries as f64 / sold as f64
    } else {
        0.0
    };
    let observed = if sold == 0 {
        Observed::Missed
    } else if retries == 0 && conflicts == 0 {
        Observed::Safe
    } else if per_sale >= 1.0 && wasted_ms > 0 {
        // At least one thrown-away attempt, with its work, for every sale made.
        Observed::Flaw
    } else {
        Observed::Missed
    };
    env.timeline.note(
        "runner",
        format!(
            "{strategy}: {sold} sold, {retries} retries ({per_sale:.1} per sale), {conflicts} refused EXECs, {wasted_ms} ms of work thrown away"
        ),
    );
    Ok((
        observed,
        json!({"outcomes": outcomes, "sold": sold, "retries": retries,
               "retries_per_sale": (per_sale * 10.0).round() / 10.0,
               "refused_exec": conflicts, "wasted_work_ms": wasted_ms,
               "audit": audit_json(&audit)}),
    ))
}

#[derive(Default)]
struct Cost {
    retries: u64,
    conflicts: u64,
    wasted_s: f64,
}

/// The strategy's retry counters, summed over both instances.
async fn cost(env: &Env, strategy: Strategy) -> anyhow::Result<Cost> {
    let http = reqwest::Client::new();
    let mut cost = Cost::default();
    for app in &env.apps {
        let text = http.get(app.url("/metrics")).send().await?.text().await?;
        let series = |name: &str| -> f64 {
            let prefix = format!("{name}{{strategy=\"{strategy}\"}} ");
            text.lines()
                .find_map(|l| l.strip_prefix(&prefix))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0.0)
        };
        cost.retries += series("inventory_sale_retries_total") as u64;
        cost.conflicts += series("inventory_optimistic_conflicts_total") as u64;
        cost.wasted_s += series("inventory_wasted_work_seconds_total");
    }
    Ok(cost)
}

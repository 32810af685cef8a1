//! `two-instances`: `local` (v1-v2) against `setnx` (v3). Each instance's mutex keeps its
//! own sales in line, but nothing stops both from reading the same stock at once.

use std::collections::BTreeMap;

use inventory::events::Event;
use inventory::lock::{RedisLock, Strategy};
use serde_json::{Value, json};

use super::env::{Env, audit_json, query};
use super::{Observed, Scenario};

pub(super) const SCENARIO: Scenario = Scenario {
    description: "concurrent sales on both instances",
    flawed: Strategy::Local,
    survivor: Strategy::Redis(RedisLock::Setnx),
    setting: None,
};

/// Local mutexes are per process: two instances sell the same stock at once.
pub(super) async fn run(env: &Env, strategy: Strategy) -> anyhow::Result<(Observed, Value)> {
    env.reset(5).await?;
    let sales = (0..20).map(|i| env.sale(i % 2, query(strategy, 50)));
    let replies = futures_util::future::join_all(sales).await;
    let audit = env.audit().await?;
    let mut sold_by = BTreeMap::<String, u64>::new();
    for r in replies.iter().filter(|r| r.status == 200) {
        *sold_by
            .entry(r.body["instance"].as_str().unwrap_or("?").to_owned())
            .or_default() += 1;
    }
    // The fault is both instances selling from the same stock: each must have read it.
    let reads = |app: &str| env.timeline.count(|e| e.is(app, Event::StockRead));
    let observed = if reads("app1") == 0 || reads("app2") == 0 {
        Observed::Missed
    } else if !audit.clean {
        Observed::Flaw
    } else if audit.sales == 5 && audit.remaining == 0 {
        Observed::Safe
    } else {
        Observed::Missed
    };
    Ok((
        observed,
        json!({"sold_by": sold_by, "audit": audit_json(&audit)}),
    ))
}

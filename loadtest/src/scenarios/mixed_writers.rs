//! `mixed-writers`: a lock protects only the writers that take it. The row's strategy is the
//! second writer, selling beside `fenced` buyers on the same item: `none` ignores the lock and
//! overwrites; `atomic` takes no lock either, but announces its writes, so a locked sale that
//! read before one is refused instead of overwriting it.

use std::collections::BTreeMap;

use inventory::lock::{RedisLock, Strategy};
use serde_json::{Value, json};

use super::env::{Env, audit_json, query};
use super::{Observed, Scenario};

pub(super) const SCENARIO: Scenario = Scenario {
    description: "half the buyers use fenced, the other half a writer that takes no lock",
    flawed: Strategy::None,
    survivor: Strategy::Atomic,
    setting: None,
};

/// `fenced` buyers on app1 and `strategy` buyers on app2, on one item, at once.
pub(super) async fn run(env: &Env, strategy: Strategy) -> anyhow::Result<(Observed, Value)> {
    // More stock than either kind of buyer asks for, so that a fast one cannot sell it all
    // before the other starts.
    const STOCK: i64 = 30;
    env.reset(STOCK).await?;
    let fenced = Strategy::Redis(RedisLock::Fenced);
    let sales = (0..40).map(|i| {
        let (app, strategy) = if i % 2 == 0 {
            (0, fenced)
        } else {
            (1, strategy)
        };
        env.sale(app, query(strategy, 20))
    });
    let replies = futures_util::future::join_all(sales).await;
    let audit = env.audit().await?;
    let mut outcomes = BTreeMap::<String, u64>::new();
    for (i, r) in replies.iter().enumerate() {
        let who = if i % 2 == 0 {
            "fenced"
        } else {
            strategy.name()
        };
        *outcomes.entry(format!("{who}: {}", r.code())).or_default() += 1;
    }
    let sold_200 = replies.iter().filter(|r| r.status == 200).count() as i64;
    // The two kinds of writer met when both sold, or when a fenced sale was refused
    // because the other wrote during it.
    let met = outcomes.contains_key("fenced: stock_changed")
        || ["fenced: sold", &format!("{}: sold", strategy.name())]
            .iter()
            .all(|k| outcomes.contains_key(*k));
    let observed = if !audit.clean || sold_200 != STOCK - audit.remaining {
        Observed::Flaw
    } else if met {
        Observed::Safe
    } else {
        Observed::Missed
    };
    Ok((
        observed,
        json!({"outcomes": outcomes, "answered_200": sold_200, "audit": audit_json(&audit)}),
    ))
}

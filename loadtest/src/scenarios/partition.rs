//! `partition`: `fenced` (its lock on the stock's one Redis) against `redlock` (three lock
//! nodes). One node is cut off from `app1` only, by taking down `app1`'s link into the
//! network namespace the node runs in; `app2` still reaches it.

use futures_util::future::join_all;
use inventory::events::Event;
use inventory::lock::{RedisLock, Strategy};
use serde_json::{Value, json};

use super::env::{Env, Nodes, audit_json, overlapping_holders, query};
use super::{Observed, Scenario};

pub(super) const SCENARIO: Scenario = Scenario {
    description: "cut one Redis node off from app1 only (network namespace, link down) while both instances sell",
    flawed: Strategy::Redis(RedisLock::Fenced),
    survivor: Strategy::Redis(RedisLock::Redlock),
    setting: None,
};

/// `fenced`'s one node is the stock's Redis; `redlock`'s third lock node is the one cut off.
pub(super) fn nodes(strategy: Strategy) -> Nodes {
    if strategy.info().quorum {
        Nodes::ThirdInNamespace
    } else {
        Nodes::StockInNamespace
    }
}

const SALES: usize = 12;

pub(super) async fn run(env: &mut Env, strategy: Strategy) -> anyhow::Result<(Observed, Value)> {
    env.reset(20).await?;
    env.cut_app1()?;
    let env = &*env;
    let replies = join_all((0..SALES).map(|i| env.sale(i % 2, query(strategy, 10)))).await;
    let (app1, app2): (Vec<_>, Vec<_>) = replies.iter().enumerate().partition(|(i, _)| i % 2 == 0);
    let sold =
        |side: &[(usize, &super::env::Reply)]| side.iter().filter(|(_, r)| r.status == 200).count();
    let failed = |side: &[(usize, &super::env::Reply)]| {
        side.iter()
            .filter(|(_, r)| r.status == 0 || r.status >= 500)
            .count()
    };
    let (app1_sold, app2_sold) = (sold(&app1), sold(&app2));
    let app1_failed = failed(&app1);
    let overlaps = overlapping_holders(&env.timeline);
    // The quorum counts app1 made without the node it cannot reach: its vote failed, or
    // was still out when the other two settled the attempt.
    let votes_without_node = env.timeline.count(|e| {
        e.is("app1", Event::LockQuorum)
            && e.fields
                .get("votes")
                .and_then(Value::as_str)
                .is_some_and(|v| v.ends_with("failed") || v.ends_with("late"))
    });
    let audit = env.audit().await?;
    let observed = if !audit.clean || !overlaps.is_empty() {
        Observed::Flaw
    } else if app1_sold == 0 && app1_failed > 0 && app2_sold > 0 {
        // The instance cut off from the lock's only node cannot sell at all.
        Observed::Flaw
    } else if app1_sold > 0
        && app2_sold > 0
        && app1_failed == 0
        && (votes_without_node > 0 || !strategy.info().quorum)
    {
        Observed::Safe
    } else {
        Observed::Missed
    };
    let details = json!({
        "app1_sold": app1_sold, "app1_failed": app1_failed, "app2_sold": app2_sold,
        "app1_quorums_without_the_cut_node": votes_without_node,
        "holders_at_once": overlaps,
        "audit": audit_json(&audit),
    });
    Ok((observed, details))
}

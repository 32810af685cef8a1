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
    // was still out when the other two settled the attempt. The cut must be real: app1
    // votes on three nodes, and the third never answered it (a "late" vote alone is no
    // sign: a healthy node is late whenever the other two settle first). A `LOCK_NODES`
    // without that node, or a route around the cut, made this row "safe" untested.
    let app1_votes: Vec<Vec<String>> = env
        .timeline
        .entries()
        .iter()
        .filter(|e| e.is("app1", Event::LockQuorum))
        .filter_map(|e| {
            e.fields
                .get("votes")
                .and_then(Value::as_str)
                .map(str::to_owned)
        })
        .map(|v| {
            v.trim_matches(|c| c == '[' || c == ']')
                .split_whitespace()
                .map(str::to_owned)
                .collect()
        })
        .collect();
    let cut_never_answered = !app1_votes.is_empty()
        && app1_votes
            .iter()
            .all(|votes| votes.len() == 3 && matches!(votes[2].as_str(), "failed" | "late"));
    let votes_without_node = if cut_never_answered {
        app1_votes.len()
    } else {
        0
    };
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

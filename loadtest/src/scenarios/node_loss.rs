//! `node-loss`: `fenced` (its lock on the stock's one Redis) against `redlock` (three lock
//! nodes of their own). One node that holds the lock is killed mid-load, and comes back.

use std::time::Duration;

use futures_util::future::join_all;
use inventory::events::Event;
use inventory::lock::{RedisLock, Strategy};
use serde_json::{Value, json};

use super::env::{Env, Nodes, audit_json, query};
use super::{Observed, Scenario};

pub(super) const SCENARIO: Scenario = Scenario {
    description: "kill -9 a Redis node that holds the lock mid-load, then start it again",
    flawed: Strategy::Redis(RedisLock::Fenced),
    survivor: Strategy::Redis(RedisLock::Redlock),
    setting: None,
};

/// `fenced` has one node, the stock's (kept in an append-only file, so that it returns with
/// the stock); `redlock` has three of its own, and loses the second.
pub(super) fn nodes(strategy: Strategy) -> Nodes {
    if strategy.info().quorum {
        Nodes::Separate
    } else {
        Nodes::Shared
    }
}

/// A longer lease than the other scenarios' 500 ms: each node's share of it (a twentieth,
/// 25 ms at 500 ms) is what a healthy node has to answer in, and on a loaded machine 25 ms
/// is missed now and then. A healthy node counted as failed next to the dead one leaves too
/// few answers, and `redlock` fails fast with 503 `redis_unavailable`: the dead node's
/// fault would be blamed for the machine's load.
pub(super) fn configure(env: &mut std::collections::BTreeMap<String, String>) {
    env.insert("LOCK_TTL_MS".into(), "2000".into());
}

const STOCK: i64 = 30;
const SALES: usize = 24;
const WORK_MS: u64 = 20;

pub(super) async fn run(env: &mut Env, strategy: Strategy) -> anyhow::Result<(Observed, Value)> {
    env.reset(STOCK).await?;
    let quorum = !env.nodes.is_empty();
    let victim = if quorum {
        "lock node 2 of 3"
    } else {
        "the stock's Redis (fenced's only node)"
    };
    let pid = match env.nodes.get_mut(1) {
        Some(node) => node.get_mut().pid(),
        None => env.redis.pid(),
    };
    // The victim must hold the lock when it dies: a node no instance votes on (a
    // `LOCK_NODES` without it) took nothing down with it, and the row said "safe".
    let victim_conn = match env.nodes.get_mut(1) {
        Some(node) => node.get_mut().connection().await,
        None => env.redis.connection().await,
    }
    .ok();
    let held_when_killed = std::sync::atomic::AtomicBool::new(false);
    let (first, killed_at) = {
        let env = &*env;
        let kill = async {
            env.wait_event("app1", Event::SaleWritten).await?;
            if let Some(mut conn) = victim_conn.clone() {
                let deadline = tokio::time::Instant::now() + Duration::from_millis(500);
                while tokio::time::Instant::now() < deadline {
                    let held: bool = redis::AsyncCommands::exists(&mut conn, &env.keys.lock)
                        .await
                        .unwrap_or(false);
                    if held {
                        held_when_killed.store(true, std::sync::atomic::Ordering::Relaxed);
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            }
            nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid? as i32),
                nix::sys::signal::Signal::SIGKILL,
            )
            .ok()?;
            env.timeline.note("runner", format!("kill -9 {victim}"));
            Some(env.since_start())
        };
        tokio::join!(wave(env, strategy), kill)
    };
    let Some(killed_at) = killed_at else {
        return Ok((
            Observed::Missed,
            json!({"why": "could not kill the node mid-load"}),
        ));
    };
    // Down for a moment longer than every sale of the first wave, then back.
    tokio::time::sleep(Duration::from_millis(300)).await;
    match env.nodes.get_mut(1) {
        Some(node) => node.get_mut().restart().await?,
        None => env.redis.restart().await?,
    }
    let env = &*env;
    env.timeline.note("runner", format!("{victim} is back"));
    let second = wave(env, strategy).await;

    let after_kill: Vec<_> = first.iter().filter(|r| r.at > killed_at).collect();
    // What a node's loss causes: Redis unreachable, or an outcome lost with it. A wait that
    // ran out (`lock_timeout`) is the lock's polling under contention, not the node: it is
    // reported in the outcomes, not counted.
    let failed = |r: &super::env::Reply| {
        r.status == 0 || matches!(r.code(), "redis_unavailable" | "outcome_unknown")
    };
    let failed_while_down = after_kill.iter().filter(|r| failed(r)).count();
    let sold_while_down = after_kill.iter().filter(|r| r.status == 200).count();
    let sold_after_return = second.iter().filter(|r| r.status == 200).count();
    let failed_after_return = second.iter().filter(|r| failed(r)).count();
    let audit = env.audit().await?;
    let sold: usize = first
        .iter()
        .chain(&second)
        .filter(|r| r.status == 200)
        .count();
    let held_when_killed = held_when_killed.load(std::sync::atomic::Ordering::Relaxed);
    let observed = if after_kill.is_empty() || !held_when_killed {
        // Every sale was over before the node died, or it held no lock: nothing was put to
        // the test.
        Observed::Missed
    } else if !audit.clean || (failed_while_down > 0 && sold_after_return > 0) {
        // Oversold, or (the flaw this row is about) sales failed while the node was down
        // and sold again once it was back.
        Observed::Flaw
    } else if failed_while_down == 0 && sold_while_down > 0 && failed_after_return == 0 {
        Observed::Safe
    } else {
        Observed::Missed
    };
    let mut outcomes = std::collections::BTreeMap::<String, usize>::new();
    for r in &after_kill {
        *outcomes.entry(r.code().to_owned()).or_default() += 1;
    }
    let details = json!({
        "killed": victim, "killed_at_ms": killed_at.as_millis() as u64,
        "it_held_the_lock_when_killed": held_when_killed,
        "outcomes_after_the_kill": outcomes,
        "failed_while_down": failed_while_down, "sold_while_down": sold_while_down,
        "sold_after_return": sold_after_return, "sold": sold,
        "audit": audit_json(&audit),
    });
    Ok((observed, details))
}

async fn wave(env: &Env, strategy: Strategy) -> Vec<super::env::Reply> {
    join_all((0..SALES).map(|i| env.sale(i % 2, query(strategy, WORK_MS)))).await
}

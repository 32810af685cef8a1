//! `reentry`: `lua-release` (v6) against `reentrant` (v7). The sale takes its own lock again.

use std::collections::BTreeMap;

use inventory::events::Event;
use inventory::lock::{RedisLock, Strategy};
use serde_json::{Value, json};

use super::env::Env;
use super::{Observed, Scenario};

pub(super) const SCENARIO: Scenario = Scenario {
    description: "the sale acquires the same lock again, nested",
    flawed: Strategy::Redis(RedisLock::LuaRelease),
    survivor: Strategy::Redis(RedisLock::Reentrant),
    setting: None,
};

/// The nested acquire must wait out its budget, not the outer lease.
pub(super) fn configure(_app: &str, env: &mut BTreeMap<String, String>) {
    env.insert("LOCK_WAIT_MS".into(), "1000".into());
    env.insert("LOCK_TTL_MS".into(), "10000".into());
}

/// The sale takes its own lock again.
pub(super) async fn run(env: &Env, strategy: Strategy) -> anyhow::Result<(Observed, Value)> {
    env.reset(5).await?;
    let reply = env
        .sale(0, format!("strategy={strategy}&reenter=true"))
        .await;
    let nested_attempted = env.timeline.count(|e| e.is("app1", Event::LockAcquired)) >= 1;
    // Sold, but only once the nested acquire had waited its own lock out (a lease shorter
    // than the wait): that is the flaw, a sale made late under a lock that expired while
    // its sale held it. A re-entered lock waits for nothing.
    let waited = reply.body["waited_ms"].as_u64().unwrap_or(0);
    let observed = match (reply.status, reply.code()) {
        (200, _) if waited >= 100 => Observed::Flaw,
        (200, _) => Observed::Safe,
        (503, "lock_timeout") if nested_attempted => Observed::Flaw,
        _ => Observed::Missed,
    };
    Ok((
        observed,
        json!({"sale": reply.summary(), "body": reply.body}),
    ))
}

//! `crash-holder`: `setnx` (v3) against `setnx-ttl` (v4). The holder is killed with the lock.

use inventory::events::Event;
use inventory::lock::{RedisLock, Strategy};
use serde_json::{Value, json};

use super::env::{Env, query};
use super::{Observed, Scenario};

pub(super) const SCENARIO: Scenario = Scenario {
    description: "kill -9 the instance holding the lock mid-sale",
    flawed: Strategy::Redis(RedisLock::Setnx),
    survivor: Strategy::Redis(RedisLock::SetnxTtl),
    setting: None,
};

/// The holder dies with the lock: does anyone ever sell again?
pub(super) async fn run(env: &Env, strategy: Strategy) -> anyhow::Result<(Observed, Value)> {
    env.reset(5).await?;
    let holder = env.sale(0, query(strategy, 10_000));
    let crash = async {
        env.wait_event("app1", Event::StockRead).await?;
        env.apps[0].signal("KILL").await.ok()?;
        env.timeline
            .note("runner", "kill -9 app1 (it holds the lock)");
        Some(())
    };
    let (_, crashed) = tokio::join!(holder, crash);
    if crashed.is_none() {
        return Ok((Observed::Missed, json!({"why": "app1 never held the lock"})));
    }
    let pttl_after_crash = env.lock_pttl().await?;
    let next = env.sale(1, query(strategy, 0)).await;
    let holder_after = env.lock_holder().await?;
    let observed = match (next.status, next.code()) {
        (200, _) => Observed::Safe,
        (503, "lock_timeout")
            if holder_after
                .as_deref()
                .is_some_and(|h| h.starts_with("app1:")) =>
        {
            Observed::Flaw
        }
        _ => Observed::Missed,
    };
    let details = json!({
        "lock_pttl_after_crash_ms": pttl_after_crash,
        "next_sale_on_app2": next.summary(),
        "dead_holder_still_owns_the_lock": holder_after.is_some_and(|h| h.starts_with("app1:")),
    });
    Ok((observed, details))
}

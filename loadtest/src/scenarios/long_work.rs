//! `long-work`: `reentrant` (v7) against `watchdog` (v8). Work longer than the lease.

use inventory::events::Event;
use inventory::lock::{RedisLock, Strategy};
use serde_json::{Value, json};

use super::env::{Env, TTL_MS, audit_json, query};
use super::{Observed, Scenario};

pub(super) const SCENARIO: Scenario = Scenario {
    description: "work three times the TTL while the other instance sells",
    flawed: Strategy::Redis(RedisLock::Reentrant),
    survivor: Strategy::Redis(RedisLock::Watchdog),
    setting: None,
};

/// Work three leases long on app1 while app2 sells.
pub(super) async fn run(env: &Env, strategy: Strategy) -> anyhow::Result<(Observed, Value)> {
    env.reset(5).await?;
    let a = env.sale(0, query(strategy, 3 * TTL_MS));
    let b = async {
        env.wait_event("app1", Event::StockRead).await?;
        env.timeline
            .note("runner", "app2 starts a sale while app1 works");
        Some(env.sale(1, query(strategy, 0)).await)
    };
    let (a, b) = tokio::join!(a, b);
    let Some(b) = b else {
        return Ok((Observed::Missed, json!({"why": "app1 never held the lock"})));
    };
    let audit = env.audit().await?;
    let renewals = env.timeline.count(|e| e.is("app1", Event::LockRenewed));
    // The fault is a lease that runs out under the work: a renewing lock had to renew, and
    // another one let app2 sell while app1 still worked. Neither: the lease outlasted the
    // work (a longer lease than the scenario's), and nothing was put to the test.
    let lease_ran_out = if strategy.info().renews {
        renewals > 0
    } else {
        b.at < a.at
    };
    let observed = if a.status != 200 || b.status != 200 {
        Observed::Missed
    } else if !audit.clean {
        Observed::Flaw
    } else if !lease_ran_out {
        Observed::Missed
    } else {
        Observed::Safe
    };
    let details = json!({
        "a": a.summary(), "b": b.summary(), "b_sold_before_a": b.at < a.at,
        "renewals_by_app1": renewals, "audit": audit_json(&audit),
    });
    Ok((observed, details))
}

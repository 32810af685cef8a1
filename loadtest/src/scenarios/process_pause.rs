//! `process-pause`: `watchdog` (v8) against `fenced`. A frozen process cannot renew.

use std::time::Duration;

use inventory::events::Event;
use inventory::lock::{RedisLock, Strategy};
use serde_json::{Value, json};

use super::env::{Env, audit_json, query};
use super::{Observed, Scenario};

pub(super) const SCENARIO: Scenario = Scenario {
    description: "SIGSTOP the holder after it read the stock, longer than the TTL, while the other instance sells",
    flawed: Strategy::Redis(RedisLock::Watchdog),
    survivor: Strategy::Redis(RedisLock::Fenced),
    setting: None,
};

/// Freeze the holder between its read and its write, long enough for its lease to expire and
/// for the other instance to sell; then let it go on.
pub(super) async fn run(env: &Env, strategy: Strategy) -> anyhow::Result<(Observed, Value)> {
    const WORK_MS: u64 = 600;
    env.reset(5).await?;
    let a = env.sale(0, query(strategy, WORK_MS));
    let fault = async {
        let read = env.wait_event("app1", Event::StockRead).await?;
        env.apps[0].signal("STOP").await.ok()?;
        env.timeline.note(
            "runner",
            "SIGSTOP app1 (it read the stock and holds the lock)",
        );
        let b = env.sale(1, query(strategy, 0)).await;
        // Resume only once app1's work is over, so that it wakes straight into its write,
        // as a process back from a long GC pause does.
        let work_over = Duration::from_millis(read.at_ms + WORK_MS + 100);
        tokio::time::sleep(work_over.saturating_sub(env.since_start())).await;
        env.apps[0].signal("CONT").await.ok()?;
        env.timeline.note("runner", "SIGCONT app1");
        Some(b)
    };
    let (a, b) = tokio::join!(a, fault);
    let Some(b) = b else {
        return Ok((
            Observed::Missed,
            json!({"why": "could not pause app1 while it held the lock"}),
        ));
    };
    let audit = env.audit().await?;
    let observed = if b.status != 200 {
        // The other instance never sold during the pause: the lock did not change hands.
        Observed::Missed
    } else if a.code() == "lock_lost" {
        // Woken with both its work and its renewal overdue, the holder's renewal ran first
        // and it noticed before writing: the write this scenario is about never happened.
        Observed::Missed
    } else if a.status == 200 && !audit.clean {
        Observed::Flaw
    } else if a.status == 409 && audit.clean {
        Observed::Safe
    } else {
        Observed::Missed
    };
    let details = json!({
        "paused_holder": a.summary(), "other_instance": b.summary(),
        "stale_write_refused": a.code() == "stale_fence" || a.code() == "lock_lost",
        "audit": audit_json(&audit),
    });
    Ok((observed, details))
}

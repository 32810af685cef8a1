//! `node-restart`: `redlock` against `redlock-fenced`. A node that granted the lock restarts
//! empty at once (no persistence): a second owner reaches a majority while the first still
//! holds it. Kleppmann's example, on three nodes: app1 is cut off from node 3 (a partition
//! through a network namespace) so it holds nodes 1 and 2 only; node 1 restarts empty; app2
//! then gets nodes 1 and 3.

use std::time::Duration;

use inventory::events::Event;
use inventory::lock::{RedisLock, Strategy};
use serde_json::{Value, json};

use super::env::{Env, audit_json, overlapping_holders, query};
use super::{Observed, Scenario};

pub(super) const SCENARIO: Scenario = Scenario {
    description: "restart empty a lock node that granted the holder's lock, so that a second owner reaches a majority",
    flawed: Strategy::Redis(RedisLock::Redlock),
    survivor: Strategy::Redis(RedisLock::RedlockFenced),
    setting: None,
};

/// Shorter than the lease (500 ms), so that the first holder is still within its validity
/// when it writes, and long enough for the restart and the second sale to fit in it.
const WORK_MS: u64 = 350;

pub(super) async fn run(env: &mut Env, strategy: Strategy) -> anyhow::Result<(Observed, Value)> {
    env.reset(5).await?;
    env.cut_app1()?;
    let env = &*env;
    let a = env.sale(0, query(strategy, WORK_MS));
    let fault = async {
        env.wait_event("app1", Event::LockAcquired).await?;
        let mut node = env.nodes[0].lock().await;
        node.restart().await.ok()?;
        drop(node);
        env.timeline.note(
            "runner",
            "lock node 1 restarted EMPTY (it had granted app1's lock)",
        );
        let b = env.sale(1, query(strategy, 0)).await;
        Some(b)
    };
    let (a, b) = tokio::join!(a, fault);
    let Some(b) = b else {
        return Ok((Observed::Missed, json!({"why": "app1 never held the lock"})));
    };
    // Let app1's writes and releases reach the timeline.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let overlaps = overlapping_holders(&env.timeline);
    let audit = env.audit().await?;
    let observed = if overlaps.is_empty() || b.status != 200 {
        // The second sale never got the lock while the first held it.
        Observed::Missed
    } else if !audit.clean {
        Observed::Flaw
    } else if a.status == 409 {
        // Two holders, but the store refused the first one's late write.
        Observed::Safe
    } else {
        Observed::Missed
    };
    let details = json!({
        "first_holder": a.summary(), "second_holder": b.summary(),
        "holders_at_once": overlaps,
        "audit": audit_json(&audit),
    });
    Ok((observed, details))
}

//! What `slow-holder` and `release-race` share: the lock changes hands while its first holder
//! still believes it holds it, and the question is what that holder's release does next.

use inventory::events::Event;
use inventory::lock::Strategy;
use serde_json::{Value, json};

use super::Observed;
use super::env::{Env, audit_json, query};
use crate::timeline::sale_tag;

/// Sale A's lock changes hands while A still believes it holds it (by expiry for
/// `slow-holder`, in the release window for `release-race`); B takes it, C waits behind B.
/// The flaw: A's release deletes B's lock and C enters while B still works.
///
/// A works `a_work` ms, B `b_work` ms: B less than a lease, so that B's lock can only end by
/// B's release or by A's mistake. A releases `a_releases_after` ms after its read: the fault
/// is a lease that ends before then.
pub(super) async fn third_sale_enters(
    env: &Env,
    strategy: Strategy,
    a_work: u64,
    a_releases_after: u64,
    b_work: u64,
) -> anyhow::Result<(Observed, Value)> {
    env.reset(5).await?;
    let a = env.sale(0, query(strategy, a_work));
    // What is left of A's lease once it has read: the fault needs it to end before A's
    // release (a lease longer than the scenario's never does).
    let a_lease_left = std::sync::Mutex::new(None::<i64>);
    let rest = async {
        env.wait_event("app1", Event::StockRead).await?;
        let left = env.lock_pttl().await.ok().filter(|ms| *ms >= 0);
        if let Ok(mut slot) = a_lease_left.lock() {
            *slot = left;
        }
        let b = env.sale(1, query(strategy, b_work));
        let c_and_evidence = async {
            let b_read = env.wait_event("app2", Event::StockRead).await?;
            let b_owner = env.lock_holder().await.ok().flatten();
            env.timeline
                .note("runner", "B holds the lock; C (app2) starts waiting for it");
            let c = env.sale(1, query(strategy, 0)).await;
            Some((b_owner, c, sale_tag(&b_read), b_read.at_ms))
        };
        let (b, c) = tokio::join!(b, c_and_evidence);
        Some((b, c?))
    };
    // The lock holder the moment A's reply arrives: B's, unless A's release deleted it.
    let a_then_lock = async {
        let a = a.await;
        let holder = env.lock_holder().await.ok().flatten();
        (a, holder)
    };
    let ((a, holder_after_a), rest) = tokio::join!(a_then_lock, rest);
    let Some((b, (b_owner, c, b_tag, b_read_at_ms))) = rest else {
        return Ok((
            Observed::Missed,
            json!({"why": "B never took the lock", "a": a.summary()}),
        ));
    };
    let audit = env.audit().await?;
    let a_lease_left = a_lease_left.lock().ok().and_then(|l| *l);
    let lease_runs_out = a_lease_left.is_none_or(|ms| (ms as u64) < a_releases_after);
    let b_owner = b_owner.filter(|o| o.starts_with("app2:"));
    // Only an A that finished after B had the lock can have deleted it: an A that released
    // first (its lease never ran out) left nothing of B's to delete, however late B's own
    // acquire came on a loaded machine.
    let a_ended_after_b_held = a.at.as_millis() as u64 > b_read_at_ms;
    let b_lock_deleted = b_owner.is_some() && a_ended_after_b_held && holder_after_a != b_owner;
    // From the instance's own events, not from the order the replies arrive in: a waiter
    // woken at once by B's release can answer before B's own reply gets out.
    let entries = env.timeline.entries();
    let b_done = entries.iter().find(|e| {
        e.who == "app2"
            && matches!(e.event(), Some(Event::SaleWritten | Event::SaleRefused))
            && sale_tag(e) == b_tag
    });
    let c_read = entries
        .iter()
        .find(|e| e.is("app2", Event::StockRead) && sale_tag(e) != b_tag);
    let c_entered_during_b = match (c_read, b_done) {
        (Some(c_read), Some(b_done)) => c_read.at_ms < b_done.at_ms,
        _ => c.status == 200 && c.at < b.at,
    };
    let observed = match b_owner {
        None => Observed::Missed,
        Some(_) if b_lock_deleted || c_entered_during_b => Observed::Flaw,
        // A's lease outlasted its hold (a lease longer than the scenario's), or B took the
        // lock only once A had finished: nothing was put to the test.
        Some(_) if !lease_runs_out || !a_ended_after_b_held => Observed::Missed,
        Some(_) => Observed::Safe,
    };
    let details = json!({
        "a": a.summary(), "b": b.summary(), "c": c.summary(),
        "a_lease_left_at_its_read_ms": a_lease_left,
        "b_took_the_lock_while_a_worked": a_ended_after_b_held,
        "a_release_deleted_b_lock": b_lock_deleted,
        "c_entered_while_b_worked": c_entered_during_b,
        "audit": audit_json(&audit),
    });
    Ok((observed, details))
}

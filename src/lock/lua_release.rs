//! `lua-release` (tutorial v6): `SET NX PX ttl`; release compares and deletes in one Lua script.
//! Fixes: `owner-check`'s race: nothing can run between the owner check and the delete.
//! Still wrong: not reentrant: a sale that takes the lock again (a nested call) waits on
//! itself until its wait budget runs out.

use redis::RedisResult;

use super::{Attempt, LockCx, Released, StrategyInfo};
use crate::store::scripts;

pub(super) const INFO: StrategyInfo = StrategyInfo {
    name: "lua-release",
    aliases: &["v6"],
    seed: "v6",
    protocol: "SET NX PX ttl; compare-and-delete in one Lua script",
    fixes: "the release can no longer delete a lock that changed hands",
    flaw: "not reentrant: a nested acquire by the same sale waits on itself",
    reentrant: false,
    renews: false,
    fenced: false,
    distributed: true,
};

pub(super) async fn try_acquire(cx: &LockCx, owner: &str) -> RedisResult<Attempt> {
    super::set_nx(cx, owner, Some(cx.ttl)).await
}

pub(super) async fn release(cx: &LockCx, owner: &str) -> RedisResult<Released> {
    let keys = &cx.store.keys;
    let (queue, entries) = super::handoff::queue_keys(keys);
    let (queue, entries) = (&queue, &entries);
    // Hands the lock to the next queued waiter, if any (`super::handoff`).
    let deleted: i64 = cx
        .store
        .call(|mut c| async move {
            scripts::UNLOCK_OWNED
                .key(&keys.lock)
                .key(&keys.signal)
                .key(queue)
                .key(entries)
                .key(&keys.fence)
                .arg(owner)
                .arg(&keys.released)
                .invoke_async(&mut c)
                .await
        })
        .await?;
    Ok(if deleted == 1 {
        Released::Freed
    } else {
        Released::NotHeld
    })
}

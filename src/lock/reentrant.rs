//! `reentrant` (tutorial v7): a hash `owner -> hold count`, taken and left by Lua scripts.
//! Fixes: `lua-release` waiting on itself: the same sale may enter again, and only its last
//! exit deletes the lock.
//! Still wrong: nobody renews the lease: work longer than the TTL loses the lock, another
//! sale enters, and both write.

use std::time::Duration;

use redis::RedisResult;

use super::{Attempt, LockCx, Released, StrategyInfo};
use crate::store::scripts;

pub(super) const INFO: StrategyInfo = StrategyInfo {
    name: "reentrant",
    aliases: &["v7"],
    seed: "v7",
    protocol: "hash owner -> count; HINCRBY lock/unlock in Lua",
    fixes: "a nested acquire by the same sale succeeds instead of waiting on itself",
    flaw: "no renewal: work longer than the TTL loses the lock",
    reentrant: true,
    renews: false,
    fenced: false,
    distributed: true,
};

pub(super) async fn try_acquire(cx: &LockCx, owner: &str) -> RedisResult<Attempt> {
    let key = &cx.store.keys.lock;
    let reply = cx
        .store
        .call(|mut c| async move {
            scripts::LOCK_REENTRANT
                .key(key)
                .arg(owner)
                .arg(millis(cx.ttl))
                .invoke_async(&mut c)
                .await
        })
        .await?;
    Ok(Attempt::from_script(reply, false))
}

pub(super) async fn release(cx: &LockCx, owner: &str) -> RedisResult<Released> {
    let keys = &cx.store.keys;
    let (queue, entries) = super::handoff::queue_keys(keys);
    let (queue, entries) = (&queue, &entries);
    // The last level hands the lock to the next queued waiter, if any (`super::handoff`).
    let left: i64 = cx
        .store
        .call(|mut c| async move {
            scripts::UNLOCK_REENTRANT
                .key(&keys.lock)
                .key(&keys.signal)
                .key(queue)
                .key(entries)
                .key(&keys.fence)
                .arg(owner)
                .arg(millis(cx.ttl))
                .arg(&keys.released)
                .invoke_async(&mut c)
                .await
        })
        .await?;
    Ok(match left {
        1 => Released::Freed,
        0 => Released::StillHeld,
        _ => Released::NotHeld,
    })
}

pub(super) fn millis(d: Duration) -> u64 {
    d.as_millis() as u64
}

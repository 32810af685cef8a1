//! `watchdog` (tutorial v8): the reentrant lock, plus a renewal every TTL/3 while it is held.
//! Fixes: `reentrant` losing the lock to long work: the lease is extended as long as the
//! holder is alive, and a renewal that finds the lock gone stops the sale before it writes.
//! Still wrong: a paused process (GC, `SIGSTOP`) cannot renew: the lock expires under it,
//! and when it wakes it writes before it has noticed.

use redis::RedisResult;

use super::{Attempt, LockCx, Released, StrategyInfo};
use crate::store::scripts;

pub(super) const INFO: StrategyInfo = StrategyInfo {
    name: "watchdog",
    aliases: &["v8"],
    seed: "v8",
    protocol: "reentrant hash lock + owner-checked renewal every ttl/3",
    fixes: "work longer than the TTL keeps the lock; a lost lock is reported before the write",
    flaw: "a paused process (GC, SIGSTOP) cannot renew: the lock expires under it",
    reentrant: true,
    renews: true,
    fenced: false,
    distributed: true,
};

pub(super) async fn try_acquire(cx: &LockCx, owner: &str) -> RedisResult<Attempt> {
    super::reentrant::try_acquire(cx, owner).await
}

pub(super) async fn release(cx: &LockCx, owner: &str) -> RedisResult<Released> {
    super::reentrant::release(cx, owner).await
}

/// Extends the lease if `owner` still holds the lock; `false` when it is gone.
pub(super) async fn renew(cx: &LockCx, owner: &str) -> RedisResult<bool> {
    let key = &cx.store.keys.lock;
    let renewed: i64 = cx
        .store
        .call(|mut c| async move {
            scripts::RENEW
                .key(key)
                .arg(owner)
                .arg(super::reentrant::millis(cx.ttl))
                .invoke_async(&mut c)
                .await
        })
        .await?;
    Ok(renewed == 1)
}

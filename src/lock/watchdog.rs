//! `watchdog` (tutorial v8): the reentrant lock, plus a renewal every TTL/3 while it is held.
//! Fixes: `reentrant` losing the lock to long work: the lease is extended as long as the
//! holder is alive, and a renewal that finds the lock gone stops the sale before it writes.
//! Still wrong: a paused process (GC, `SIGSTOP`) cannot renew: the lock expires under it,
//! and when it wakes it writes before it has noticed.

use redis::RedisResult;

use super::reentrant::Reentrant;
use super::{Attempt, LockCx, RedisLockOps, Released};
use crate::store::scripts;

pub(super) struct Watchdog;

impl RedisLockOps for Watchdog {
    const HANDOFF: Option<&'static str> = Some("hash");

    async fn try_acquire(cx: &LockCx, owner: &str) -> RedisResult<Attempt> {
        Reentrant::try_acquire(cx, owner).await
    }

    async fn release(cx: &LockCx, owner: &str) -> RedisResult<Released> {
        Reentrant::release(cx, owner).await
    }

    /// Extends the lease if `owner` still holds the lock; `false` when it is gone.
    async fn renew(cx: &LockCx, owner: &str) -> RedisResult<bool> {
        let renew = &scripts::renew(&cx.store.keys.lock, owner, super::reentrant::millis(cx.ttl));
        let renewed: i64 = cx
            .store
            .call(|mut c| async move { renew.invoke_async(&mut c).await })
            .await?;
        Ok(renewed == 1)
    }
}

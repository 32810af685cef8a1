//! `fenced`: the watchdog lock, plus a fencing token drawn atomically with each acquisition;
//! the stock read registers the token and the stock write refuses one older than the newest
//! the store has seen.
//! Fixes: `watchdog`'s paused holder: when it wakes, its write carries an old token and is
//! refused (409 `stale_fence`) instead of applied. When the lock it lost went to a sale of a
//! strategy without tokens (`watchdog` beside it on the same item), no newer token exists;
//! that sale's write moved the count of writes under this kind of lock, which the fenced
//! write also checks (409 `lock_lost`).
//! Still wrong: only writes that check the token are protected, and the lock depends on one
//! Redis node (a failover can lose it: see `redlock`).

use std::sync::atomic::Ordering;

use redis::RedisResult;

use super::reentrant::Reentrant;
use super::watchdog::Watchdog;
use super::{Attempt, LockCx, RedisLockOps, Released};
use crate::store::scripts;

pub(super) struct Fenced;

impl RedisLockOps for Fenced {
    const HANDOFF: Option<&'static str> = Some("fenced");

    async fn try_acquire(cx: &LockCx, owner: &str) -> RedisResult<Attempt> {
        let keys = &cx.store.keys;
        let newest = cx.newest_fence.load(Ordering::Acquire);
        let lock = &scripts::lock_fenced(keys, owner, super::reentrant::millis(cx.ttl), newest);
        let reply = cx
            .store
            .call(|mut c| async move { lock.invoke_async(&mut c).await })
            .await?;
        let attempt = Attempt::from_script(reply, true);
        if let Attempt::Acquired {
            fence: Some(token), ..
        } = attempt
        {
            cx.newest_fence.fetch_max(token, Ordering::AcqRel);
        }
        Ok(attempt)
    }

    async fn release(cx: &LockCx, owner: &str) -> RedisResult<Released> {
        Reentrant::release(cx, owner).await
    }

    async fn renew(cx: &LockCx, owner: &str) -> RedisResult<bool> {
        Watchdog::renew(cx, owner).await
    }
}

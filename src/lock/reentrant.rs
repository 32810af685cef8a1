//! `reentrant` (tutorial v7): a hash `owner -> hold count`, taken and left by Lua scripts.
//! Fixes: `lua-release` waiting on itself: the same sale may enter again, and only its last
//! exit deletes the lock.
//! Still wrong: nobody renews the lease: work longer than the TTL loses the lock, another
//! sale enters, and both write.

use std::time::Duration;

use redis::RedisResult;

use super::{Attempt, LockCx, RedisLockOps, Released};
use crate::store::scripts;

pub(super) struct Reentrant;

impl RedisLockOps for Reentrant {
    const HANDOFF: Option<&'static str> = Some("hash");

    async fn try_acquire(cx: &LockCx, owner: &str) -> RedisResult<Attempt> {
        let lock = &scripts::lock_reentrant(&cx.store.keys.lock, owner, millis(cx.ttl));
        let reply = cx
            .store
            .call(|mut c| async move { lock.invoke_async(&mut c).await })
            .await?;
        Ok(Attempt::from_script(reply, false))
    }

    async fn release(cx: &LockCx, owner: &str) -> RedisResult<Released> {
        let unlock =
            &scripts::unlock_reentrant(&cx.store.keys, owner, millis(cx.ttl), cx.tenure_mean());
        let left: i64 = cx
            .store
            .call(|mut c| async move { unlock.invoke_async(&mut c).await })
            .await?;
        Ok(match left {
            1 => Released::Freed,
            0 => Released::StillHeld,
            _ => Released::NotHeld,
        })
    }
}

pub(super) fn millis(d: Duration) -> u64 {
    d.as_millis() as u64
}

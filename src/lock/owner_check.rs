//! `owner-check` (tutorial v5): `SET NX PX ttl`; release reads the key and deletes it only if
//! it still holds this sale's owner id.
//! Fixes: `setnx-ttl` deleting a lock that another sale took after the TTL ran out.
//! Still wrong: `GET` and `DEL` are two commands; the lock can expire and change hands between
//! them, and the `DEL` then removes the new holder's lock.

use redis::{AsyncCommands, RedisResult};

use super::{Attempt, LockCx, RedisLockOps, Released};

pub(super) struct OwnerCheck;

impl RedisLockOps for OwnerCheck {
    async fn try_acquire(cx: &LockCx, owner: &str) -> RedisResult<Attempt> {
        super::set_nx(&cx.store, owner, Some(cx.ttl)).await
    }

    async fn release(cx: &LockCx, owner: &str) -> RedisResult<Released> {
        let key = &cx.store.keys.lock;
        let holder: Option<String> =
            match cx.store.call(|mut c| async move { c.get(key).await }).await {
                // A hash lock: another strategy's holder took the key after this lease ran out.
                Err(e) if e.code() == Some("WRONGTYPE") => return Ok(Released::NotHeld),
                holder => holder?,
            };
        if holder.as_deref() != Some(owner) {
            return Ok(Released::NotHeld);
        }
        // The window this version is known for; fault scenarios widen it to make the race certain.
        if !cx.release_gap.is_zero() {
            tokio::time::sleep(cx.release_gap).await;
        }
        super::delete_and_announce(cx, owner).await
    }
}

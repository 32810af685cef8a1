//! `setnx` (tutorial v3): `SET lock owner NX` with no lease, `DEL` to release.
//! Fixes: `local`'s oversell behind nginx: the lock lives in Redis, shared by every instance.
//! Still wrong: nothing ever expires the key, so a holder that dies mid-sale leaves the item
//! locked forever and every later sale times out. The only way out is a reset, which gives
//! the lock a lease longer than any live sale (wait budget, work and Redis timeouts) rather
//! than deleting it: a dead holder's lock frees itself when that runs out, and a live holder
//! keeps its lock for the rest of its sale (deleting it, or a lease of `LOCK_TTL_MS` that the
//! sale's work outlasted, let a second sale in beside the first, and the two sold one unit
//! twice). A holder frozen longer than that lease loses it all the same, as under
//! `setnx-ttl`, and its `DEL` then deletes the next holder's lock: a lease cannot tell a dead
//! holder from a frozen one.

use redis::RedisResult;

use super::{Attempt, LockCx, RedisLockOps, Released};

pub(super) struct Setnx;

impl RedisLockOps for Setnx {
    async fn try_acquire(cx: &LockCx, owner: &str) -> RedisResult<Attempt> {
        super::set_nx(&cx.store, owner, None).await
    }

    async fn release(cx: &LockCx, owner: &str) -> RedisResult<Released> {
        super::delete_and_announce(cx, owner).await
    }
}

//! `setnx` (tutorial v3): `SET lock owner NX` with no lease, `DEL` to release.
//! Fixes: `local`'s oversell behind nginx: the lock lives in Redis, shared by every instance.
//! Still wrong: nothing ever expires the key, so a holder that dies mid-sale leaves the item
//! locked forever and every later sale times out. The only way out, a reset, deletes a live
//! holder's lock too; that holder's sale is refused (`stock_changed`), but its `DEL` checks no
//! owner and deletes the next holder's lock, so two sales then run at once and one unit is
//! sold twice (`owner-check` is the version that looks before it deletes).

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

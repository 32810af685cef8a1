//! `lua-release` (tutorial v6): `SET NX PX ttl`; release compares and deletes in one Lua script.
//! Fixes: `owner-check`'s race: nothing can run between the owner check and the delete.
//! Still wrong: not reentrant: a sale that takes the lock again (a nested call) waits on
//! itself until its wait budget runs out.

use redis::RedisResult;

use super::{Attempt, LockCx, RedisLockOps, Released};
use crate::store::scripts;

pub(super) struct LuaRelease;

impl RedisLockOps for LuaRelease {
    const HANDOFF: Option<&'static str> = Some("string");

    async fn try_acquire(cx: &LockCx, owner: &str) -> RedisResult<Attempt> {
        super::set_nx(&cx.store, owner, Some(cx.ttl)).await
    }

    async fn release(cx: &LockCx, owner: &str) -> RedisResult<Released> {
        // Fault scenarios only: the release arrives as late as `owner-check`'s delete does
        // after its check, so that the lock may change hands before it (`release-race`);
        // this version's one step then finds another owner and deletes nothing.
        if !cx.release_gap.is_zero() {
            tokio::time::sleep(cx.release_gap).await;
        }
        let keys = &cx.store.keys;
        let unlock = &scripts::unlock_owned(&keys.lock, keys, owner, cx.tenure_mean());
        let deleted: i64 = cx
            .store
            .call(|mut c| async move { unlock.invoke_async(&mut c).await })
            .await?;
        Ok(Released::by_deleted(deleted))
    }
}

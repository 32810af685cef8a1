//! `setnx` (tutorial v3): `SET lock owner NX` with no lease, `DEL` to release.
//! Fixes: `local`'s oversell behind nginx: the lock lives in Redis, shared by every instance.
//! Still wrong: nothing ever expires the key, so a holder that dies mid-sale leaves the item
//! locked forever and every later sale times out.

use redis::RedisResult;

use super::{Attempt, LockCx, Released, StrategyInfo};

pub(super) const INFO: StrategyInfo = StrategyInfo {
    name: "setnx",
    aliases: &["v3"],
    seed: "v3",
    protocol: "SET NX (no TTL), wait, DEL",
    fixes: "oversell across instances: one lock in Redis for all of them",
    flaw: "a holder that crashes leaves the lock forever: every later sale times out",
    reentrant: false,
    renews: false,
    fenced: false,
    distributed: true,
};

pub(super) async fn try_acquire(cx: &LockCx, owner: &str) -> RedisResult<Attempt> {
    super::set_nx(cx, owner, None).await
}

pub(super) async fn release(cx: &LockCx, owner: &str) -> RedisResult<Released> {
    super::delete_and_announce(cx, owner).await
}

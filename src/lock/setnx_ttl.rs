//! `setnx-ttl` (tutorial v4): `SET lock owner NX PX ttl`, `DEL` to release.
//! Fixes: `setnx`'s eternal lock: the key of a crashed holder expires after the TTL.
//! Still wrong: a sale that works longer than the TTL finds the lock expired and taken by
//! another sale, and its `DEL` then deletes that other sale's lock, letting a third one in.

use redis::RedisResult;

use super::{Attempt, LockCx, RedisLockOps, Released};

pub(super) struct SetnxTtl;

impl RedisLockOps for SetnxTtl {
    async fn try_acquire(cx: &LockCx, owner: &str) -> RedisResult<Attempt> {
        super::set_nx(&cx.store, owner, Some(cx.ttl)).await
    }

    async fn release(cx: &LockCx, owner: &str) -> RedisResult<Released> {
        super::delete_and_announce(cx, owner).await
    }
}

//! `setnx-ttl` (tutorial v4): `SET lock owner NX PX ttl`, `DEL` to release.
//! Fixes: `setnx`'s eternal lock: the key of a crashed holder expires after the TTL.
//! Still wrong: a sale that works longer than the TTL finds the lock expired and taken by
//! another sale, and its `DEL` then deletes that other sale's lock, letting a third one in.

use redis::RedisResult;

use super::{Attempt, LockCx, Released, StrategyInfo};

pub(super) const INFO: StrategyInfo = StrategyInfo {
    name: "setnx-ttl",
    aliases: &["v4"],
    seed: "v4",
    protocol: "SET NX PX ttl, wait, DEL",
    fixes: "a crashed holder's lock expires after the TTL",
    flaw: "work longer than the TTL: the late holder DELs someone else's lock",
    reentrant: false,
    renews: false,
    fenced: false,
    distributed: true,
};

pub(super) async fn try_acquire(cx: &LockCx, owner: &str) -> RedisResult<Attempt> {
    super::set_nx(cx, owner, Some(cx.ttl)).await
}

pub(super) async fn release(cx: &LockCx, owner: &str) -> RedisResult<Released> {
    super::delete_and_announce(cx, owner).await
}

//! `atomic`: no lock; one Lua script decrements the stock if any is left and records the sale.
//! Fixes: everything the locks are for, for this particular job: a counter needs no mutual
//! exclusion when the check and the decrement run as one step inside Redis.
//! Still wrong: nothing for a counter; it cannot guard work that happens outside Redis, which
//! is what the locks are for. It is the throughput reference.

use redis::RedisResult;

use super::StrategyInfo;
use crate::store::{Entry, Recorded, Store};

pub(super) const INFO: StrategyInfo = StrategyInfo {
    name: "atomic",
    aliases: &[],
    seed: "beyond",
    protocol: "no lock: one Lua script decrements if positive and records the sale",
    fixes: "the whole check-and-decrement runs as one step in Redis: one round trip",
    flaw: "none for a counter; cannot guard work done outside Redis",
    reentrant: true,
    renews: false,
    fenced: false,
    distributed: true,
};

/// The whole sale in one round trip.
pub async fn sell(store: &Store, entry: &Entry<'_>) -> RedisResult<Recorded> {
    store.atomic_sale(entry).await
}

//! `atomic`: no lock; one Lua script decrements the stock if any is left and records the sale.
//! Fixes: everything the locks are for, for this particular job: a counter needs no mutual
//! exclusion when the check and the decrement run as one step inside Redis.
//! Still wrong: nothing for a counter; it cannot guard work that happens outside Redis, which
//! is what the locks are for. It is the throughput reference.

use redis::RedisResult;

use crate::store::{Entry, Recorded, Store};

/// The whole sale in one round trip, shared with the item's other atomic sales that reach
/// the instance at the same time (one script call sells them all, `store/batch.rs`).
pub async fn sell(store: &Store, entry: &Entry<'_>) -> RedisResult<Recorded> {
    store.atomic_sale(entry).await
}

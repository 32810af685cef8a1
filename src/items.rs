//! Many items: the lock machinery of each item an instance sells, the default item's for
//! good, every other's built on its first sale and dropped once it has been idle.
//!
//! Why per item, and why dropped: one item's keys must share a hash slot (its scripts touch
//! them together, and Redis Cluster refuses a script across slots), so its release signals
//! live in its own slot too: its own signal list, inboxes and channel. One `BLPOP` over
//! every item's signal list would cross slots, so each item with waiters needs its own
//! listener, exactly what a [`Locks`] is (a task, plus a blocked connection or a
//! subscription once someone waited). Items also must not exclude each other, so each has
//! its own process-local mutex. Kept forever, that would be one task and one connection per
//! item ever sold; so an item's `Locks` lives while a sale holds it and for `ITEM_IDLE_MS`
//! after its last one, then goes, and the resources follow the items being sold now. The
//! default item's `Locks` is built at start, never dropped, and reached without the map,
//! so its sales cost exactly what they cost before there were many items.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use redis::RedisResult;
use tokio::time::Instant;

use crate::lock::Locks;
use crate::metrics::Metrics;
use crate::store::Store;

/// One item's lock machinery, and whether its stock was seen.
pub struct Item {
    pub locks: Locks,
    /// Set once a sale saw the stock key, cleared when one finds it gone: until then each
    /// sale looks before it locks, so that selling an item nobody stocked writes nothing
    /// (no lock key, no fencing counter, no idempotency key).
    stocked: AtomicBool,
}

impl Item {
    fn new(locks: Locks) -> Self {
        Self {
            locks,
            stocked: AtomicBool::new(false),
        }
    }

    pub fn id(&self) -> &str {
        self.locks.store().item()
    }

    pub fn store(&self) -> &Store {
        self.locks.store()
    }

    /// Whether a sale must look for the stock key before it locks.
    pub fn needs_stock_check(&self) -> bool {
        !self.stocked.load(Ordering::Relaxed)
    }

    pub fn set_stocked(&self, stocked: bool) {
        self.stocked.store(stocked, Ordering::Relaxed);
    }
}

/// Every item's lock machinery in this instance. Clones share it.
#[derive(Clone)]
pub struct Items {
    default: Arc<Item>,
    others: Arc<Mutex<HashMap<String, Tracked>>>,
}

struct Tracked {
    item: Arc<Item>,
    last_used: Instant,
}

impl Items {
    /// `default` is the default item's (`ITEM_ID`); every other item's is built from it.
    /// Starts the sweeper; must be called inside a Tokio runtime.
    pub fn new(default: Locks, idle: Duration) -> Self {
        let others = Arc::default();
        let metrics = default.store().metrics_handle();
        tokio::spawn(sweep(Arc::downgrade(&others), idle, metrics));
        Self {
            default: Arc::new(Item::new(default)),
            others,
        }
    }

    pub fn default_item(&self) -> &Arc<Item> {
        &self.default
    }

    pub fn default_id(&self) -> &str {
        self.default.id()
    }

    /// The lease every lock is taken with, the same for every item.
    pub fn lease(&self) -> std::time::Duration {
        self.default.locks.lease()
    }

    /// The item's machinery, built now if it has none. `id` must be a valid item id
    /// ([`crate::names::parse_item_id`]). Hold the `Arc` for the whole sale: an item is
    /// dropped only when nothing holds it.
    pub fn get(&self, id: &str) -> Arc<Item> {
        if id == self.default_id() {
            return self.default.clone();
        }
        // A std mutex: no await happens while it is held.
        let mut others = self.others.lock().unwrap_or_else(|p| p.into_inner());
        let built = others.len();
        let tracked = others.entry(id.to_owned()).or_insert_with(|| Tracked {
            item: Arc::new(Item::new(self.default.locks.for_item(id))),
            last_used: Instant::now(),
        });
        tracked.last_used = Instant::now();
        let item = tracked.item.clone();
        if others.len() != built {
            self.default.store().metrics().items_live(others.len());
        }
        item
    }

    /// Gives back the locks this instance still keeps parked between its own sales (a
    /// tenure, `LOCK_TENURE_MS`), so that an instance stopping does not leave the others
    /// waiting for a lease to run out.
    pub async fn close(&self) {
        let others: Vec<Arc<Item>> = {
            let others = self.others.lock().unwrap_or_else(|p| p.into_inner());
            others.values().map(|t| t.item.clone()).collect()
        };
        for item in std::iter::once(&self.default).chain(&others) {
            item.locks.close().await;
        }
    }

    /// A store for the item, for reads and resets, which need no lock machinery.
    pub fn store(&self, id: &str) -> Store {
        if id == self.default_id() {
            return self.default.store().clone();
        }
        self.default.store().for_item(id)
    }

    /// The item's machinery if the item has stock, without building anything for an item
    /// that has none: ids nobody stocked cost one `EXISTS` each, and no memory.
    pub async fn stocked(&self, id: &str) -> RedisResult<Option<Arc<Item>>> {
        let known = if id == self.default_id() {
            Some(self.default.clone())
        } else {
            self.others
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(id)
                .map(|t| t.item.clone())
        };
        if let Some(item) = known
            && !item.needs_stock_check()
        {
            return Ok(Some(item));
        }
        if !self.store(id).is_stocked().await? {
            return Ok(None);
        }
        let item = self.get(id);
        item.set_stocked(true);
        Ok(Some(item))
    }

    /// After a reset: the item has stock now.
    pub fn restocked(&self, id: &str) {
        if id == self.default_id() {
            self.default.set_stocked(true);
        } else if let Some(tracked) = self
            .others
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
        {
            tracked.item.set_stocked(true);
        }
    }

    /// How many items other than the default one have their machinery built now.
    pub fn live(&self) -> usize {
        self.others.lock().map_or(0, |o| o.len())
    }
}

/// Drops, every half `idle`, the machinery of each item that no sale holds, that nobody
/// waits for, and that was last used more than `idle` ago. Stops with its `Items`.
async fn sweep(
    others: Weak<Mutex<HashMap<String, Tracked>>>,
    idle: Duration,
    metrics: Arc<Metrics>,
) {
    let every = (idle / 2).max(Duration::from_millis(5));
    loop {
        tokio::time::sleep(every).await;
        let Some(others) = others.upgrade() else {
            return;
        };
        let now = Instant::now();
        let mut dropped = Vec::new();
        if let Ok(mut map) = others.lock() {
            let stale: Vec<String> = map
                .iter()
                .filter(|(_, t)| {
                    Arc::strong_count(&t.item) == 1
                        && now.saturating_duration_since(t.last_used) >= idle
                        && t.item.locks.is_idle()
                })
                .map(|(id, _)| id.clone())
                .collect();
            dropped.extend(stale.iter().filter_map(|id| map.remove(id)));
            metrics.items_live(map.len());
        }
        if !dropped.is_empty() {
            tracing::debug!(
                items = dropped.len(),
                "dropped the lock machinery of idle items"
            );
        }
        // Dropped here, outside the map's mutex: each stops its listeners.
        drop(dropped);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lock::wait::WaitMode;

    /// Nothing here talks to Redis: a store connects on its first call.
    fn items(idle: Duration) -> Items {
        let metrics = Arc::new(Metrics::default());
        let store = Store::new(
            "redis://127.0.0.1:1",
            "001",
            Duration::from_secs(1),
            metrics,
        )
        .expect("a valid URL");
        let locks = Locks::new(
            store,
            Duration::from_secs(5),
            WaitMode::Pubsub,
            Duration::ZERO,
        );
        Items::new(locks, idle)
    }

    #[tokio::test]
    async fn an_item_held_by_a_sale_stays_and_an_idle_one_goes() {
        let items = items(Duration::from_millis(100));
        let held = items.get("held");
        drop(items.get("idle"));
        assert_eq!(items.live(), 2);
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(items.live(), 1, "the idle item went, the held one stayed");
        assert!(Arc::ptr_eq(&held, &items.get("held")), "the same machinery");
        drop(held);
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(items.live(), 0);
    }

    #[tokio::test]
    async fn the_default_item_is_never_in_the_map_and_never_dropped() {
        let items = items(Duration::from_millis(10));
        let default = items.get("001");
        assert!(Arc::ptr_eq(&default, items.default_item()));
        assert_eq!(items.live(), 0);
        drop(default);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(items.get("001").id(), "001");
        assert_eq!(items.store("sku-1").keys.stock, "inventory:{sku-1}:stock");
    }
}

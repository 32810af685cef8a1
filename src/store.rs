//! Everything the service keeps in Redis: key names, the Lua scripts, and the calls that read
//! and write the stock and its ledger. Lock calls live with their strategies in `lock/`.

use std::future::Future;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use redis::aio::ConnectionManager;
use redis::{AsyncCommands, Client, RedisError, RedisResult, Script};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::metrics::Metrics;

/// One `Script` per file in `lua/`: hashed once, then run by `EVALSHA` (loaded on first
/// `NOSCRIPT`, so a restarted Redis heals itself).
pub mod scripts {
    use super::*;

    macro_rules! script {
        ($name:ident, $file:literal) => {
            pub static $name: LazyLock<Script> =
                LazyLock::new(|| Script::new(include_str!(concat!("../lua/", $file))));
        };
    }

    script!(LOCK_REENTRANT, "lock_reentrant.lua");
    script!(LOCK_FENCED, "lock_fenced.lua");
    script!(UNLOCK_REENTRANT, "unlock_reentrant.lua");
    script!(UNLOCK_OWNED, "unlock_owned.lua");
    script!(RENEW, "renew.lua");
    script!(READ_FENCED, "read_fenced.lua");
    script!(RECORD_SALE, "record_sale.lua");
    script!(ATOMIC_SALE, "atomic_sale.lua");
    script!(RESET, "reset.lua");
    script!(IDEMPOTENCY_SETTLE, "idempotency_settle.lua");
}

/// The keys of one item. They share the hash tag `{item}`, so every script touches a single
/// slot and runs unchanged on Redis Cluster.
#[derive(Debug, Clone)]
pub struct Keys {
    pub stock: String,
    pub initial: String,
    pub ledger: String,
    pub sold_at: String,
    pub fence: String,
    pub fence_seen: String,
    pub lock: String,
    /// Pub/sub channel on which every release is announced.
    pub released: String,
    idempotency_prefix: String,
}

impl Keys {
    pub fn new(item: &str) -> Self {
        let key = |suffix: &str| format!("inventory:{{{item}}}:{suffix}");
        Self {
            stock: key("stock"),
            initial: key("initial"),
            ledger: key("ledger"),
            sold_at: key("sold_at"),
            fence: key("fence"),
            fence_seen: key("fence:seen"),
            lock: key("lock"),
            released: key("lock:released"),
            idempotency_prefix: key("idem:"),
        }
    }

    /// Where the outcome of a sale sent with `Idempotency-Key: <key>` is kept.
    pub fn idempotency(&self, key: &str) -> String {
        format!("{}{key}", self.idempotency_prefix)
    }
}

/// A handle to Redis for one item: one multiplexed connection shared by every request (no
/// pool checkout, no health-check PING on the hot path), every call bounded in time.
#[derive(Clone)]
pub struct Store {
    conn: ConnectionManager,
    client: Client,
    item: String,
    pub keys: Keys,
    timeout: Duration,
    metrics: Arc<Metrics>,
}

/// What `GET /inventory` reports.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[schema(example = json!({"item": "001", "stock": 76, "initial": 100, "sales": 24}))]
pub struct Inventory {
    pub item: String,
    /// Stock left now.
    pub stock: i64,
    /// Stock set by the last reset.
    pub initial: i64,
    /// Sales recorded in the ledger since the last reset.
    pub sales: i64,
}

/// What `GET /inventory/audit` reports: whether the ledger and the stock agree.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[schema(example = json!({"item": "001", "initial": 100, "remaining": 0, "sales": 102,
    "oversold": 2, "lost_updates": 2, "duplicates": [{"remaining": 76, "times": 2}], "clean": false}))]
pub struct Audit {
    pub item: String,
    pub initial: i64,
    pub remaining: i64,
    /// Sales recorded in the ledger.
    pub sales: i64,
    /// Items sold that never existed: max(0, sales - initial).
    pub oversold: i64,
    /// Sales whose decrement was overwritten: sales - (initial - remaining).
    pub lost_updates: i64,
    /// Remaining-stock values left by more than one sale (the tutorial's "76 sold twice").
    pub duplicates: Vec<Duplicate>,
    /// True when no sale was lost, duplicated or oversold.
    pub clean: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Duplicate {
    pub remaining: i64,
    pub times: i64,
}

/// Who made a sale, for its ledger entry, and the idempotency claim it holds, if any.
#[derive(Debug, Clone, Copy)]
pub struct Entry<'a> {
    pub order_id: &'a str,
    pub instance: &'a str,
    pub strategy: &'a str,
    pub claim: Option<&'a Claim>,
}

impl Entry<'_> {
    /// Scripts declare every key they may touch; without a claim this one is never touched.
    fn claim_key(&self, keys: &Keys) -> String {
        self.claim
            .map_or_else(|| keys.idempotency(""), |c| c.key.clone())
    }

    fn claim_marker(&self) -> &str {
        self.claim.map_or("", |c| c.marker.as_str())
    }

    fn claim_keep_ms(&self) -> u64 {
        self.claim.map_or(0, |c| c.keep.as_millis() as u64)
    }
}

/// A sale's hold on an idempotency key: the key holds `marker` while the sale runs, and
/// the sale's outcome for `keep` afterwards.
#[derive(Debug, Clone)]
pub struct Claim {
    pub key: String,
    pub marker: String,
    pub keep: Duration,
}

/// What a sale's write did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recorded {
    /// Written and recorded: the stock left.
    Written(i64),
    /// Nothing left to sell (the atomic sale checks this itself).
    SoldOut,
    /// Refused: the store has seen a newer fencing token.
    StaleFence { newest: u64 },
    /// Refused: the idempotency claim expired or another attempt holds the key.
    ClaimLost,
}

/// The answer of a script that checks a fencing token: `{1, value}` or `{0, newest token}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fenced<T> {
    Accepted(T),
    Stale { newest: u64 },
}

impl Store {
    /// Does not touch the network: the service starts with Redis down and connects when it can.
    pub fn new(
        redis_url: &str,
        item: &str,
        timeout: Duration,
        metrics: Arc<Metrics>,
    ) -> RedisResult<Self> {
        let client = Client::open(redis_url)?;
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout))
            .set_number_of_retries(1)
            .set_min_delay(Duration::from_millis(50))
            .set_max_delay(Duration::from_millis(500));
        let conn = ConnectionManager::new_lazy_with_config(client.clone(), config)?;
        Ok(Self {
            conn,
            client,
            item: item.to_owned(),
            keys: Keys::new(item),
            timeout,
            metrics,
        })
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    pub fn client(&self) -> &Client {
        &self.client
    }

    pub fn item(&self) -> &str {
        &self.item
    }

    /// Runs one Redis exchange under the configured bound, so a hung or unreachable server
    /// costs a request at most `timeout`, never a hang.
    pub async fn call<T, F, Fut>(&self, f: F) -> RedisResult<T>
    where
        F: FnOnce(ConnectionManager) -> Fut,
        Fut: Future<Output = RedisResult<T>>,
    {
        let result = match tokio::time::timeout(self.timeout, f(self.conn.clone())).await {
            Ok(result) => result,
            Err(_) => Err(RedisError::from(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "redis did not answer in time",
            ))),
        };
        if result.is_err() {
            self.metrics.redis_error();
        }
        result
    }

    pub async fn ping(&self) -> RedisResult<()> {
        self.call(|mut c| async move { redis::cmd("PING").query_async::<String>(&mut c).await })
            .await
            .map(drop)
    }

    pub async fn read_stock(&self) -> RedisResult<Option<i64>> {
        let key = self.keys.stock.clone();
        self.call(|mut c| async move { c.get(key).await }).await
    }

    /// Reads the stock for the holder of `fence`, registering the token with the store.
    pub async fn read_stock_fenced(&self, fence: u64) -> RedisResult<Fenced<Option<i64>>> {
        let k = &self.keys;
        let (ok, value): (i64, i64) = self
            .call(|mut c| async move {
                scripts::READ_FENCED
                    .key(&k.stock)
                    .key(&k.fence_seen)
                    .arg(fence)
                    .invoke_async(&mut c)
                    .await
            })
            .await?;
        Ok(match ok {
            1 => Fenced::Accepted((value >= 0).then_some(value)),
            _ => Fenced::Stale {
                newest: value.max(0) as u64,
            },
        })
    }

    /// Writes the stock a sale computed and appends the sale to the ledger, atomically.
    pub async fn record_sale(
        &self,
        new_stock: i64,
        entry: &Entry<'_>,
        fence: Option<u64>,
    ) -> RedisResult<Recorded> {
        let k = &self.keys;
        let fence = fence.map(|f| f.to_string()).unwrap_or_default();
        let (ok, value): (i64, i64) = self
            .call(|mut c| async move {
                scripts::RECORD_SALE
                    .key(&k.stock)
                    .key(&k.ledger)
                    .key(&k.sold_at)
                    .key(&k.fence_seen)
                    .key(entry.claim_key(k))
                    .arg(new_stock)
                    .arg(entry.order_id)
                    .arg(entry.instance)
                    .arg(entry.strategy)
                    .arg(fence)
                    .arg(entry.claim_marker())
                    .arg(entry.claim_keep_ms())
                    .invoke_async(&mut c)
                    .await
            })
            .await?;
        Ok(match ok {
            1 => Recorded::Written(value),
            2 => Recorded::ClaimLost,
            _ => Recorded::StaleFence {
                newest: value.max(0) as u64,
            },
        })
    }

    /// The lock-free sale: one script, one round trip.
    pub async fn atomic_sale(&self, entry: &Entry<'_>) -> RedisResult<Recorded> {
        let k = &self.keys;
        let remaining: i64 = self
            .call(|mut c| async move {
                scripts::ATOMIC_SALE
                    .key(&k.stock)
                    .key(&k.ledger)
                    .key(&k.sold_at)
                    .key(entry.claim_key(k))
                    .arg(entry.order_id)
                    .arg(entry.instance)
                    .arg(entry.strategy)
                    .arg(entry.claim_marker())
                    .arg(entry.claim_keep_ms())
                    .invoke_async(&mut c)
                    .await
            })
            .await?;
        Ok(match remaining {
            -1 => Recorded::SoldOut,
            -2 => Recorded::ClaimLost,
            remaining => Recorded::Written(remaining),
        })
    }

    /// Claims an idempotency key for a sale with one `SET NX GET`: `None` when claimed,
    /// otherwise what the key already holds.
    pub async fn claim(&self, claim: &Claim, pending_for: Duration) -> RedisResult<Option<String>> {
        self.call(|mut c| async move {
            redis::cmd("SET")
                .arg(&claim.key)
                .arg(&claim.marker)
                .arg("NX")
                .arg("GET")
                .arg("PX")
                .arg(pending_for.as_millis().max(1) as u64)
                .query_async(&mut c)
                .await
        })
        .await
    }

    /// Ends a claim that did not sell: keeps `outcome` for replays, or frees the key.
    pub async fn settle(&self, claim: &Claim, outcome: Option<&str>) -> RedisResult<bool> {
        let settled: i64 = self
            .call(|mut c| async move {
                scripts::IDEMPOTENCY_SETTLE
                    .key(&claim.key)
                    .arg(&claim.marker)
                    .arg(outcome.unwrap_or_default())
                    .arg(claim.keep.as_millis() as u64)
                    .invoke_async(&mut c)
                    .await
            })
            .await?;
        Ok(settled == 1)
    }

    pub async fn reset(&self, stock: i64) -> RedisResult<()> {
        let k = &self.keys;
        self.call(|mut c| async move {
            scripts::RESET
                .key(&k.stock)
                .key(&k.initial)
                .key(&k.ledger)
                .key(&k.sold_at)
                .key(&k.fence)
                .key(&k.fence_seen)
                .key(&k.lock)
                .arg(stock)
                .arg(&k.released)
                .invoke_async::<i64>(&mut c)
                .await
        })
        .await
        .map(drop)
    }

    pub async fn inventory(&self) -> RedisResult<Inventory> {
        let k = &self.keys;
        let (stock, initial, sales): (Option<i64>, Option<i64>, i64) = self
            .call(|mut c| async move {
                redis::pipe()
                    .get(&k.stock)
                    .get(&k.initial)
                    .llen(&k.ledger)
                    .query_async(&mut c)
                    .await
            })
            .await?;
        Ok(Inventory {
            item: self.item().to_owned(),
            stock: stock.unwrap_or(0),
            initial: initial.unwrap_or(0),
            sales,
        })
    }

    pub async fn audit(&self) -> RedisResult<Audit> {
        let k = &self.keys;
        type Reply = (Option<i64>, Option<i64>, i64, Vec<(i64, i64)>);
        let (stock, initial, sales, sold_at): Reply = self
            .call(|mut c| async move {
                redis::pipe()
                    .get(&k.stock)
                    .get(&k.initial)
                    .llen(&k.ledger)
                    .hgetall(&k.sold_at)
                    .query_async(&mut c)
                    .await
            })
            .await?;
        Ok(Audit::compute(
            self.item(),
            initial.unwrap_or(0),
            stock.unwrap_or(0),
            sales,
            sold_at,
        ))
    }

    /// The raw ledger entries, oldest first (for tests and scenarios).
    pub async fn ledger(&self) -> RedisResult<Vec<String>> {
        let key = self.keys.ledger.clone();
        self.call(|mut c| async move { c.lrange(key, 0, -1).await })
            .await
    }
}

impl Audit {
    pub fn compute(
        item: &str,
        initial: i64,
        remaining: i64,
        sales: i64,
        sold_at: Vec<(i64, i64)>,
    ) -> Self {
        let mut duplicates: Vec<Duplicate> = sold_at
            .into_iter()
            .filter(|&(_, times)| times > 1)
            .map(|(remaining, times)| Duplicate { remaining, times })
            .collect();
        duplicates.sort_by_key(|d| std::cmp::Reverse(d.remaining));
        let oversold = (sales - initial).max(0);
        let lost_updates = sales - (initial - remaining);
        let clean = oversold == 0 && lost_updates == 0 && duplicates.is_empty();
        Self {
            item: item.to_owned(),
            initial,
            remaining,
            sales,
            oversold,
            lost_updates,
            duplicates,
            clean,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_of_an_item_shares_one_hash_tag() {
        let k = Keys::new("001");
        for key in [
            &k.stock,
            &k.initial,
            &k.ledger,
            &k.sold_at,
            &k.fence,
            &k.fence_seen,
            &k.lock,
        ] {
            assert!(key.starts_with("inventory:{001}:"), "{key}");
        }
    }

    #[test]
    fn audit_of_a_correct_run_is_clean() {
        let audit = Audit::compute("001", 5, 0, 5, vec![(4, 1), (3, 1), (2, 1), (1, 1), (0, 1)]);
        assert!(audit.clean);
        assert_eq!((audit.oversold, audit.lost_updates), (0, 0));
    }

    #[test]
    fn audit_counts_what_two_instances_selling_the_same_item_leave_behind() {
        // Stock 2, four sales, two of them overwritten: 1 left twice, then 0 left twice.
        let audit = Audit::compute("001", 2, 0, 4, vec![(1, 2), (0, 2)]);
        assert_eq!(audit.oversold, 2);
        assert_eq!(audit.lost_updates, 2);
        assert_eq!(audit.duplicates.len(), 2);
        assert_eq!(audit.duplicates[0].remaining, 1);
        assert!(!audit.clean);
    }
}

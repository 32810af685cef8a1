//! One sale, the same for every strategy: take the lock, (re-enter it), read the stock, do
//! the business work, write stock - 1 with its ledger entry, release. Only `atomic` skips
//! the lock and does the whole sale in one script.

use std::sync::Arc;
use std::time::Duration;

use redis::RedisError;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;
use utoipa::ToSchema;

use crate::lock::{Guard, LockError, Locks, Strategy, atomic_sell};
use crate::store::{Fenced, Store};

/// Longest simulated business time a sale may ask for.
pub const MAX_WORK_MS: u64 = 60_000;

#[derive(Debug, Clone, Copy)]
pub struct SaleRequest {
    pub strategy: Strategy,
    /// Time spent between reading the stock and writing it, with the lock held.
    pub work: Duration,
    /// Take the same lock a second time, nested, before writing.
    pub reenter: bool,
}

/// A successful sale.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[schema(example = json!({"sold": true, "remaining": 76, "instance": "app1:7777",
    "strategy": "fenced", "order_id": "5f0c3c1e-8a51-4a43-9f7e-1b0f3b3c2a10", "fence": 25,
    "waited_ms": 3}))]
pub struct Sold {
    /// Always true: a refused sale answers with an error instead.
    pub sold: bool,
    /// Stock left after this sale.
    pub remaining: i64,
    /// The instance that made the sale.
    pub instance: String,
    pub strategy: String,
    /// Id of the ledger entry of this sale.
    pub order_id: String,
    /// Fencing token of the lock that guarded the sale (`fenced` only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fence: Option<u64>,
    /// Time spent waiting for the lock, in milliseconds.
    pub waited_ms: u64,
}

/// Why no sale was made. Nothing was written in any of these cases.
#[derive(Debug)]
pub enum SaleError {
    SoldOut,
    /// The lock stayed held for the whole wait budget.
    LockTimeout {
        waited: Duration,
    },
    /// The watchdog found the lock gone before the sale wrote.
    LockLost,
    /// The store has seen a newer fencing token than this sale's.
    StaleFence {
        token: u64,
        newest: u64,
    },
    Redis(RedisError),
}

impl SaleError {
    /// The error code the HTTP API reports for it.
    pub fn code(&self) -> &'static str {
        match self {
            SaleError::SoldOut => "sold_out",
            SaleError::LockTimeout { .. } => "lock_timeout",
            SaleError::LockLost => "lock_lost",
            SaleError::StaleFence { .. } => "stale_fence",
            SaleError::Redis(_) => "redis_unavailable",
        }
    }
}

impl From<RedisError> for SaleError {
    fn from(e: RedisError) -> Self {
        SaleError::Redis(e)
    }
}

impl From<LockError> for SaleError {
    fn from(e: LockError) -> Self {
        match e {
            LockError::Timeout { waited } => SaleError::LockTimeout { waited },
            LockError::Redis(e) => SaleError::Redis(e),
        }
    }
}

/// Everything a sale needs; cheap to share between requests.
pub struct Seller {
    pub instance: String,
    pub store: Store,
    pub locks: Locks,
    pub wait_budget: Duration,
}

impl Seller {
    pub async fn sell(&self, request: SaleRequest) -> Result<Sold, SaleError> {
        let order_id = uuid::Uuid::new_v4().to_string();
        let outcome = match request.strategy {
            Strategy::Atomic => self.sell_atomic(request, order_id.clone()).await,
            _ => self.sell_locked(request, order_id.clone()).await,
        };
        if let Err(e) = &outcome {
            tracing::info!(%order_id, reason = e.code(), "sale refused");
        }
        outcome
    }

    async fn sell_atomic(&self, request: SaleRequest, order_id: String) -> Result<Sold, SaleError> {
        tokio::time::sleep(request.work).await;
        match atomic_sell(&self.store, &order_id, &self.instance).await? {
            Some(remaining) => {
                Ok(self.sold(request.strategy, remaining, order_id, None, Duration::ZERO))
            }
            None => Err(SaleError::SoldOut),
        }
    }

    async fn sell_locked(&self, request: SaleRequest, order_id: String) -> Result<Sold, SaleError> {
        // Per request, never per thread: tokio moves a sale between threads at every await.
        let owner: Arc<str> = format!("{}:{order_id}", self.instance).into();
        let deadline = Instant::now() + self.wait_budget;
        let guard = self
            .locks
            .acquire(request.strategy, &owner, deadline, false)
            .await?;
        let outcome = if request.reenter {
            self.reenter(&guard, &owner, deadline, request, order_id)
                .await
        } else {
            self.read_work_write(&guard, request, order_id).await
        };
        self.release(guard).await;
        outcome
    }

    /// The nested acquisition that non-reentrant locks cannot survive.
    async fn reenter(
        &self,
        outer: &Guard,
        owner: &Arc<str>,
        deadline: Instant,
        request: SaleRequest,
        order_id: String,
    ) -> Result<Sold, SaleError> {
        let inner = self
            .locks
            .acquire(request.strategy, owner, deadline, true)
            .await?;
        let outcome = self.read_work_write(outer, request, order_id).await;
        self.release(inner).await;
        outcome
    }

    async fn read_work_write(
        &self,
        guard: &Guard,
        request: SaleRequest,
        order_id: String,
    ) -> Result<Sold, SaleError> {
        let fence = guard.fence();
        let stock = match fence {
            Some(token) => match self.store.read_stock_fenced(token).await? {
                Fenced::Accepted(stock) => stock,
                Fenced::Stale { newest } => return Err(SaleError::StaleFence { token, newest }),
            },
            None => self.store.read_stock().await?,
        }
        .unwrap_or(0);
        tracing::info!(%order_id, stock, fence, "stock read");
        if stock <= 0 {
            return Err(SaleError::SoldOut);
        }
        tokio::time::sleep(request.work).await;
        if guard.is_lost() {
            return Err(SaleError::LockLost);
        }
        let strategy = request.strategy;
        let written = self
            .store
            .record_sale(stock - 1, &order_id, &self.instance, strategy.name(), fence)
            .await?;
        match written {
            Fenced::Accepted(remaining) => {
                tracing::info!(%order_id, remaining, fence, "sale written");
                Ok(self.sold(strategy, remaining, order_id, fence, guard.waited()))
            }
            // Only a write that carries a token can be refused.
            Fenced::Stale { newest } => Err(SaleError::StaleFence {
                token: fence.unwrap_or(0),
                newest,
            }),
        }
    }

    /// A failed release is logged, not returned: the sale's outcome is already decided and
    /// the lease (where there is one) frees the lock.
    async fn release(&self, guard: Guard) {
        if let Err(e) = self.locks.release(guard).await {
            tracing::warn!(error = %e, "lock release failed; the lock is freed when its lease ends");
        }
    }

    fn sold(
        &self,
        strategy: Strategy,
        remaining: i64,
        order_id: String,
        fence: Option<u64>,
        waited: Duration,
    ) -> Sold {
        Sold {
            sold: true,
            remaining,
            instance: self.instance.clone(),
            strategy: strategy.name().to_owned(),
            order_id,
            fence,
            waited_ms: waited.as_millis() as u64,
        }
    }
}

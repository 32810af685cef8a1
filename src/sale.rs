//! One sale, the same for every strategy: take the lock, (re-enter it), read the stock, do
//! the business work, write stock - 1 with its ledger entry, release. Only `atomic` skips
//! the lock and does the whole sale in one script.

use std::sync::Arc;
use std::time::Duration;

use redis::RedisError;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;
use utoipa::ToSchema;

use crate::idempotency;
use crate::idempotency::{Claim, Next, Prior, SoldEntry};
use crate::items::{Item, Items};
use crate::lock::{Guard, LockError, atomic_sell, optimistic};
use crate::metrics::Outcome;
use crate::store::{Entry, LockKind, Recorded, StockRead, Store};
use crate::strategy::{RedisLock, Strategy};

/// The hard ceiling of simulated business time; the configured one (`MAX_WORK_MS`) is
/// usually far lower.
pub const MAX_WORK_MS: u64 = 60_000;

#[derive(Debug, Clone, Copy)]
pub struct SaleRequest {
    pub strategy: Strategy,
    /// Time spent between reading the stock and writing it, with the lock held.
    pub work: Duration,
    /// Take the same lock a second time, nested, before writing.
    pub reenter: bool,
}

pub use crate::hangup::{Hangup, HangupGuard};

/// A successful sale.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
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
    /// Fencing token of the lock that guarded the sale (`fenced` and `redlock-fenced` only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fence: Option<u64>,
    /// Time spent waiting for the lock, in milliseconds.
    pub waited_ms: u64,
}

impl From<SoldEntry> for Sold {
    /// A replayed sale: what its ledger entry says (it waited for no lock this time).
    fn from(e: SoldEntry) -> Self {
        Sold {
            sold: true,
            remaining: e.remaining,
            instance: e.instance,
            strategy: e.strategy,
            order_id: e.order_id,
            fence: e.fence,
            waited_ms: 0,
        }
    }
}

/// Why no sale was made. Nothing was written in any of these cases, except possibly under
/// `OutcomeUnknown`, and on the master only under `NotReplicated { written: true }`.
#[derive(Debug)]
pub enum SaleError {
    /// `replayed`: the `sold_out` of an earlier attempt with the same `Idempotency-Key`,
    /// which a restock since may have made untrue.
    SoldOut { replayed: bool },
    /// The lock stayed held for the whole wait budget.
    LockTimeout { waited: Duration },
    /// The watchdog found the lock gone before the sale wrote.
    LockLost,
    /// The store has seen a newer fencing token than this sale's.
    StaleFence { token: u64, newest: u64 },
    /// Another attempt with the same `Idempotency-Key` is running.
    InProgress,
    /// This attempt's claim on its `Idempotency-Key` was gone when it wrote (it ran out while
    /// the instance was paused, or Redis was away, longer than its lease), and the key holds
    /// nothing since: it sold nothing, and a retry with the key may sell. Said as
    /// `in_progress`, whose advice (retry with the same key) holds, in words that are true.
    ClaimLost,
    /// A writer that takes no lock (an `atomic` sale or a reset) changed the stock between
    /// this sale's read and its write.
    StockChanged,
    /// The item has no stock key: never stocked, or Redis lost its data.
    UnknownItem,
    /// Every optimistic attempt within the wait budget found the stock changed under it.
    TooMuchContention { attempts: u32, waited: Duration },
    /// Redis failed before the write was sent: certainly nothing sold.
    Redis(RedisError),
    /// The write was sent and its answer never came: it may have landed.
    OutcomeUnknown(RedisError),
    /// Fewer replicas than `REPLICA_ACKS` acknowledged the lock (`written: false`: it was
    /// released, nothing sold) or the sale's write (`written: true`: it is on the master,
    /// and a failover may or may not lose it).
    NotReplicated {
        acked: i64,
        wanted: u32,
        written: bool,
    },
    /// The client went away before the sale wrote: nothing was written, and nobody hears
    /// this answer (it is logged and counted).
    ClientGone,
}

impl SaleError {
    /// The error code the HTTP API reports for it.
    pub fn code(&self) -> &'static str {
        self.outcome().label()
    }

    pub fn outcome(&self) -> Outcome {
        match self {
            SaleError::SoldOut { .. } => Outcome::SoldOut,
            SaleError::LockTimeout { .. } => Outcome::LockTimeout,
            SaleError::LockLost => Outcome::LockLost,
            SaleError::StaleFence { .. } => Outcome::StaleFence,
            SaleError::InProgress | SaleError::ClaimLost => Outcome::InProgress,
            SaleError::StockChanged => Outcome::StockChanged,
            SaleError::UnknownItem => Outcome::UnknownItem,
            SaleError::TooMuchContention { .. } => Outcome::TooMuchContention,
            SaleError::Redis(e) if crate::store::is_auth_error(e) => Outcome::RedisAuth,
            SaleError::Redis(e) if crate::store::is_pool_exhausted(e) => Outcome::PoolExhausted,
            SaleError::Redis(_) => Outcome::RedisUnavailable,
            SaleError::OutcomeUnknown(_) => Outcome::OutcomeUnknown,
            SaleError::NotReplicated { .. } => Outcome::NotReplicated,
            SaleError::ClientGone => Outcome::ClientGone,
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
            LockError::NotReplicated { acked, wanted } => SaleError::NotReplicated {
                acked,
                wanted,
                written: false,
            },
        }
    }
}

/// A sale's answer: made now, or the replay of an earlier attempt with the same key.
#[derive(Debug)]
pub struct Completed {
    pub sold: Sold,
    pub replayed: bool,
}

/// Everything a sale needs; cheap to share between requests.
pub struct Seller {
    pub instance: String,
    /// Every item's lock machinery (and through it, its store).
    pub items: Items,
    pub wait_budget: Duration,
    /// How long the outcome of a sale with an `Idempotency-Key` stays replayable.
    pub idempotency_keep: Duration,
}

/// One attempt at a sale: what was asked, under which order id, holding which claim.
struct SaleAttempt {
    request: SaleRequest,
    order_id: String,
    claim: Option<Claim>,
    hangup: Hangup,
}

impl SaleAttempt {
    fn entry<'a>(&'a self, instance: &'a str) -> Entry<'a> {
        Entry {
            order_id: &self.order_id,
            instance,
            strategy: self.request.strategy.name(),
            claim: self.claim.as_ref(),
        }
    }
}

impl Seller {
    /// The default item's store: the server every item lives on, and the metrics.
    pub fn store(&self) -> &Store {
        self.items.default_item().store()
    }

    /// The independent lock nodes of quorum strategies (empty without `LOCK_NODES`).
    pub fn nodes(&self) -> &[Store] {
        self.items.default_item().locks.nodes()
    }

    /// Every command a sale of `strategy` on the default item may send to the stock's Redis
    /// ([`crate::lock::acl`]).
    pub fn acl_needs(&self, strategy: Strategy) -> Vec<crate::lock::acl::Need> {
        self.items.default_item().locks.acl_needs(strategy)
    }

    /// How long a quorum sale waits for one lock node ([`crate::lock::Locks::node_bound`]).
    pub fn node_bound(&self) -> std::time::Duration {
        self.items.default_item().locks.node_bound()
    }

    /// Sells one of item `id` (a valid id): [`Seller::sell`] on its machinery, built only if
    /// the item has stock.
    pub async fn sell_item(
        &self,
        id: &str,
        request: SaleRequest,
        idempotency_key: Option<&idempotency::Key>,
        hangup: Hangup,
    ) -> Result<Completed, SaleError> {
        let outcome = match self.items.stocked(id).await {
            Ok(Some(item)) => {
                self.sell_uncounted(&item, request, idempotency_key, hangup)
                    .await
            }
            Ok(None) => Err(SaleError::UnknownItem),
            Err(e) => Err(e.into()),
        };
        self.count(request.strategy, &outcome);
        outcome
    }

    /// Sells one item. With an idempotency key, a repeated request replays the first
    /// outcome instead of selling again.
    pub async fn sell(
        &self,
        item: &Item,
        request: SaleRequest,
        idempotency_key: Option<&idempotency::Key>,
        hangup: Hangup,
    ) -> Result<Completed, SaleError> {
        let outcome = self
            .sell_uncounted(item, request, idempotency_key, hangup)
            .await;
        self.count(request.strategy, &outcome);
        outcome
    }

    /// Counts every answer of the sale endpoint in one place, the early ones too (Redis
    /// failing the stock check or the idempotency claim). A replayed answer, a sale or a
    /// `sold_out`, is counted apart: counted again, the sales would no longer match the
    /// ledger.
    fn count(&self, strategy: Strategy, outcome: &Result<Completed, SaleError>) {
        let metrics = self.store().metrics();
        match outcome {
            // Under the strategy that sold, as its body says (a retry may name another).
            Ok(Completed {
                replayed: true,
                sold,
            }) => metrics.replay(sold.strategy.parse().unwrap_or(strategy), true),
            Err(SaleError::SoldOut { replayed: true }) => metrics.replay(strategy, false),
            Ok(_) => metrics.sale(strategy, Outcome::Sold),
            Err(e) => metrics.sale(strategy, e.outcome()),
        }
    }

    async fn sell_uncounted(
        &self,
        item: &Item,
        request: SaleRequest,
        idempotency_key: Option<&idempotency::Key>,
        hangup: Hangup,
    ) -> Result<Completed, SaleError> {
        if item.needs_stock_check() {
            // Before anything is written for the sale: an item nobody stocked gets no lock
            // key, no fencing counter and no idempotency key.
            if !item.store().is_stocked().await? {
                return Err(SaleError::UnknownItem);
            }
            item.set_stocked(true);
        }
        let order_id = uuid::Uuid::new_v4().to_string();
        let claim = match idempotency_key {
            None => None,
            Some(key) => match self.claim(item, key, &order_id).await? {
                Next::Proceed(claim) => Some(claim),
                Next::Replay(prior) => return replay(prior),
            },
        };
        let keeper = claim
            .as_ref()
            .map(|claim| keep_claimed(item.store(), claim));
        let attempt = SaleAttempt {
            request,
            order_id,
            claim,
            hangup,
        };
        // The locked and optimistic sales are boxed: their state machines (the waits, the
        // watchdog, the retries) are kilobytes, and an unboxed arm would make every sale's
        // future, the `atomic` one's too, as large as the largest; axum moves the handler's
        // future into a box of its own on every request.
        let outcome = match request.strategy {
            Strategy::Atomic => self.sell_atomic(item, &attempt).await,
            Strategy::Optimistic => Box::pin(self.sell_optimistic(item, &attempt)).await,
            _ => Box::pin(self.sell_locked(item, &attempt)).await,
        };
        // The attempt is over: what its claim becomes is the settle's, or the write's.
        drop(keeper);
        let outcome = match (&attempt.claim, outcome) {
            // Its claim ran out under it: what the key holds now is the truth for its client
            // (a retry's sale, replayed), not "still in progress" (from outside: a frozen
            // attempt that woke answered that while a retry had sold, or nothing held the key).
            (Some(claim), Err(SaleError::ClaimLost)) => {
                match item.store().claim_holds(&claim.key).await {
                    Ok(Some(prior)) => {
                        return replay(idempotency::parse(&prior));
                    }
                    Ok(None) => Err(SaleError::ClaimLost),
                    Err(_) => Err(SaleError::InProgress),
                }
            }
            (_, outcome) => outcome,
        };
        if let (Some(claim), Err(e)) = (&attempt.claim, &outcome) {
            self.settle(item.store(), claim, e).await;
        }
        if let Err(SaleError::UnknownItem) = &outcome {
            // Redis lost the item's data: the next sale looks again before it writes.
            item.set_stocked(false);
        }
        if let Err(e) = &outcome {
            tracing::info!(event = crate::events::Event::SaleRefused.name(), order_id = %attempt.order_id, reason = e.code(), "sale refused");
        }
        outcome.map(|sold| Completed {
            sold,
            replayed: false,
        })
    }

    /// Claims the key for this attempt, or returns what an earlier attempt left there.
    async fn claim(
        &self,
        item: &Item,
        key: &idempotency::Key,
        order_id: &str,
    ) -> Result<Next, SaleError> {
        let store = item.store();
        let redis_key = store.keys.idempotency(key.as_str());
        let claim = Claim::new(redis_key, order_id, self.idempotency_keep);
        match store.claim(claim.clone()).await {
            Ok(next) => Ok(next),
            Err(e) => {
                // The claim may sit queued in a Redis that stopped answering, and would then
                // answer every retry "in progress" until it expires. Nothing was sold under
                // it, so it is freed as soon as Redis answers again.
                settle_when_redis_answers(store, &claim, None);
                Err(e.into())
            }
        }
    }

    /// Keeps a final `sold_out` for replays; frees the key after a failure that sold nothing
    /// for certain, so a retry sells; leaves it pending when the write may have landed (it
    /// then replaces the claim with the sale itself).
    async fn settle(&self, store: &Store, claim: &Claim, error: &SaleError) {
        let keep = match error {
            SaleError::SoldOut { .. } => Some(idempotency::SOLD_OUT),
            SaleError::LockTimeout { .. }
            | SaleError::LockLost
            | SaleError::StaleFence { .. }
            | SaleError::StockChanged
            | SaleError::TooMuchContention { .. }
            | SaleError::UnknownItem
            | SaleError::NotReplicated { written: false, .. }
            | SaleError::ClientGone
            | SaleError::Redis(_) => None,
            // The sale script stored its outcome under the key with the write: a retry
            // replays it if the write survives, and sells afresh if a failover lost both.
            SaleError::NotReplicated { written: true, .. } => return,
            SaleError::InProgress | SaleError::ClaimLost => return,
            SaleError::OutcomeUnknown(_) => return settle_when_redis_answers(store, claim, None),
        };
        // Redis did not answer the call that failed: a settle now would wait out the timeout
        // too, and the answer came after two (found from outside, 4 of 4 with Redis frozen).
        // Settled as soon as Redis answers instead, at once if it does already.
        if let SaleError::Redis(e) = error
            && !matches!(
                e.kind(),
                redis::ErrorKind::Server(_) | redis::ErrorKind::Extension
            )
        {
            return settle_when_redis_answers(store, claim, keep);
        }
        if let Err(e) = store.settle(claim, keep).await {
            // Redis went away during the sale (the reason it failed, often): the answer
            // said "retry", and a retry must not hear "in progress" until the claim expires.
            tracing::warn!(error = %e, "could not settle an idempotency key; trying again until Redis answers");
            settle_when_redis_answers(store, claim, keep);
        }
    }

    async fn sell_atomic(&self, item: &Item, attempt: &SaleAttempt) -> Result<Sold, SaleError> {
        work(Instant::now(), attempt.request.work).await;
        if attempt.hangup.is_gone() {
            return Err(SaleError::ClientGone);
        }
        let recorded = atomic_sell(item.store(), &attempt.entry(&self.instance))
            .await
            .map_err(after_write)?;
        self.recorded(item, attempt, recorded, None, Duration::ZERO)
    }

    async fn sell_optimistic(&self, item: &Item, attempt: &SaleAttempt) -> Result<Sold, SaleError> {
        let deadline = Instant::now() + self.wait_budget;
        let entry = attempt.entry(&self.instance);
        match optimistic::sell(
            item.store(),
            &entry,
            attempt.request.work,
            deadline,
            &attempt.hangup,
        )
        .await
        {
            Ok((recorded, _attempts)) => {
                self.recorded(item, attempt, recorded, None, Duration::ZERO)
            }
            Err(optimistic::Failure::Contention { attempts, waited }) => {
                Err(SaleError::TooMuchContention { attempts, waited })
            }
            Err(optimistic::Failure::Redis(e)) => Err(SaleError::Redis(e)),
            Err(optimistic::Failure::Unknown(e)) => Err(SaleError::OutcomeUnknown(e)),
            Err(optimistic::Failure::ClientGone) => Err(SaleError::ClientGone),
        }
    }

    async fn sell_locked(&self, item: &Item, attempt: &SaleAttempt) -> Result<Sold, SaleError> {
        // Per request, never per thread: tokio moves a sale between threads at every await.
        let owner: Arc<str> = format!("{}:{}", self.instance, attempt.order_id).into();
        let deadline = Instant::now() + self.wait_budget;
        let strategy = attempt.request.strategy;
        let locks = &item.locks;
        let outages = item.store().outages();
        let mut guard = locks.acquire(strategy, &owner, deadline, false).await?;
        if attempt.hangup.is_gone() {
            // Its client left while it waited: nothing read, nothing written.
            self.release(item, guard).await;
            return Err(SaleError::ClientGone);
        }
        if item.store().outages() != outages {
            // Redis stopped answering while this sale waited (the sale ahead of it timed
            // out): it would only wait out the same timeout in its turn. Nothing written.
            self.release(item, guard).await;
            return Err(SaleError::Redis(crate::store::unanswered_while_waiting()));
        }
        let outcome = if attempt.request.reenter {
            // The nested acquisition that non-reentrant locks cannot survive.
            match locks.reenter(&guard, deadline).await {
                Ok(inner) => {
                    guard.add_nested_wait(&inner);
                    let outcome = self.read_work_write(item, &mut guard, attempt).await;
                    self.release(item, inner).await;
                    outcome
                }
                Err(e) => Err(e.into()),
            }
        } else {
            self.read_work_write(item, &mut guard, attempt).await
        };
        let info = strategy.info();
        // A release that may reach a lock's server before this sale's write reaches the
        // stock's: a quorum lock's nodes are other servers, and calls that take connections
        // of their own are not kept in order.
        let may_overtake = info.quorum || !item.store().calls_in_order();
        let leased_without_token = matches!(strategy, Strategy::Redis(lock)
            if lock != RedisLock::Setnx && !info.fenced);
        if matches!(outcome, Err(SaleError::OutcomeUnknown(_)))
            && leased_without_token
            && may_overtake
        {
            // Its write may still land: the lease, not a release, frees the lock. (Fenced
            // locks release: the token refuses a late write. `setnx` has no lease.)
            locks.abandon(guard);
        } else if item.store().outages() != outages {
            // Redis left a call of this sale unanswered: its release would most likely wait
            // out one more timeout before the sale could answer.
            locks.release_detached(guard);
        } else {
            self.release(item, guard).await;
        }
        outcome
    }

    async fn read_work_write(
        &self,
        item: &Item,
        guard: &mut Guard,
        attempt: &SaleAttempt,
    ) -> Result<Sold, SaleError> {
        let store = item.store();
        let order_id = &attempt.order_id;
        let fence = guard.fence();
        let kind = if attempt.request.strategy.info().quorum {
            LockKind::Quorum
        } else {
            LockKind::SingleNode
        };
        // Within a tenure the sale before this one may have read for it, behind its write.
        let prefetched = guard.take_prefetched();
        let read = match prefetched {
            Some(read) => read,
            None => store.read_for_sale(kind, fence).await?,
        };
        let (stock, seen) = match read {
            StockRead::Current { stock, seen } => (stock, seen),
            StockRead::Stale { newest } => {
                return Err(SaleError::StaleFence {
                    token: fence.unwrap_or(0),
                    newest,
                });
            }
            StockRead::Overtaken => return Err(SaleError::StockChanged),
        };
        // The work starts at the read, before anyone hears of it: a process frozen right after
        // this event wakes with its work over, as a process back from a long pause does.
        let read_at = Instant::now();
        tracing::debug!(event = crate::events::Event::StockRead.name(), %order_id, stock, fence, prefetched = prefetched.is_some(), "stock read");
        let stock = stock.ok_or(SaleError::UnknownItem)?;
        if stock <= 0 {
            return Err(SaleError::SoldOut { replayed: false });
        }
        work(read_at, attempt.request.work).await;
        if !guard.lease_confirmed().await || guard.is_lost() {
            // The extension of a handed-over lease met an exhausted pool or a timeout: that
            // is what the client should hear (503, retry), not that another took its lock.
            return Err(guard
                .lease_failure()
                .map_or(SaleError::LockLost, SaleError::Redis));
        }
        if attempt.hangup.is_gone() {
            return Err(SaleError::ClientGone);
        }
        let entry = attempt.entry(&self.instance);
        let recorded = match item.locks.next_read(guard) {
            // A sale of this instance waits for the tenure: its read rides behind this write.
            Some(next_fence) => {
                let (recorded, next) = store
                    .record_sale_then_read(stock - 1, &entry, fence, seen, next_fence)
                    .await
                    .map_err(after_write)?;
                if let Some(read) = next {
                    item.locks.keep_next_read(guard, next_fence, read);
                }
                recorded
            }
            None => store
                .record_sale(stock - 1, &entry, fence, seen)
                .await
                .map_err(after_write)?,
        };
        self.recorded(item, attempt, recorded, fence, guard.waited())
    }

    fn recorded(
        &self,
        item: &Item,
        attempt: &SaleAttempt,
        recorded: Recorded,
        fence: Option<u64>,
        waited: Duration,
    ) -> Result<Sold, SaleError> {
        match recorded {
            Recorded::Written(remaining) => {
                tracing::info!(event = crate::events::Event::SaleWritten.name(), order_id = %attempt.order_id, remaining, fence, "sale written");
                Ok(Sold {
                    sold: true,
                    remaining,
                    instance: self.instance.clone(),
                    strategy: attempt.request.strategy.name().to_owned(),
                    order_id: attempt.order_id.clone(),
                    fence,
                    waited_ms: waited.as_millis() as u64,
                })
            }
            Recorded::SoldOut => Err(SaleError::SoldOut { replayed: false }),
            Recorded::StaleFence { newest } => Err(SaleError::StaleFence {
                token: fence.unwrap_or(0),
                newest,
            }),
            Recorded::ClaimLost => Err(SaleError::ClaimLost),
            Recorded::StockChanged => Err(SaleError::StockChanged),
            Recorded::Overtaken => Err(SaleError::LockLost),
            Recorded::Unstocked => Err(SaleError::UnknownItem),
            Recorded::NotReplicated { remaining, acked } => {
                tracing::warn!(event = crate::events::Event::SaleWritten.name(), order_id = %attempt.order_id, remaining, fence, acked, "sale written, but not acknowledged by enough replicas");
                Err(SaleError::NotReplicated {
                    acked,
                    wanted: item.store().replication().acks,
                    written: true,
                })
            }
        }
    }

    /// A failed release is logged, not returned: the sale's outcome is already decided and
    /// the lease (where there is one) frees the lock.
    async fn release(&self, item: &Item, guard: Guard) {
        let leaseless = guard.strategy() == Strategy::Redis(RedisLock::Setnx);
        if let Err(e) = item.locks.release(guard).await {
            if leaseless {
                // The tutorial's first lock has no lease: nothing frees it but a reset.
                tracing::error!(error = %e, "lock release failed; a setnx lock has no lease and stays until a reset (PUT /inventory) frees it");
            } else {
                tracing::warn!(error = %e, "lock release failed; the lock is freed when its lease ends");
            }
        }
    }
}

/// Settles `claim` (frees it, or keeps `keep`) in a task of its own, as soon as Redis answers
/// again, until the claim would have run out anyway: after a claim, a failed sale or a write
/// whose answer never came, while Redis is away. Safe whenever it lands: the settle changes the
/// key only while it holds this claim; the write checks the claim before it writes, so once the
/// claim is freed a late write is refused; and a write that landed first has replaced the
/// claim with its sale, which the settle leaves alone. Either way the key soon tells a retry
/// the truth, instead of "in progress" until the claim expires.
///
/// A settle that finds the key without this claim looks again, once a second, until the
/// claim would have run out: the claim may still land. A call whose answer never came can be
/// sent later by the cluster client (queued behind a slot refresh, then to the promoted
/// replica), and its claim then sat on the new master for the rest of its time, answering
/// retries "in progress" after a 503 that said nothing was sold (from outside).
fn settle_when_redis_answers(store: &Store, claim: &Claim, keep: Option<&'static str>) {
    let (store, claim) = (store.clone(), claim.clone());
    tokio::spawn(async move {
        while Instant::now() < claim.pending_until() {
            let wait = match store.settle(&claim, keep).await {
                Ok(true) => return,
                Ok(false) => Duration::from_secs(1),
                Err(_) => Duration::from_millis(100),
            };
            tokio::time::sleep(wait).await;
        }
    });
}

/// Extends `claim` every third of its lease while its attempt runs, so that only an attempt
/// that stopped (its instance killed or frozen, its request's future dropped) lets it run
/// out. Ends when the key no longer holds the claim, and when the returned guard is dropped.
/// A failed extension is tried again at the next tick: if none lands within the lease, the
/// claim runs out under a live attempt, whose write then finds it gone and sells nothing.
fn keep_claimed(store: &Store, claim: &Claim) -> AbortOnDrop {
    let (store, claim) = (store.clone(), claim.clone());
    AbortOnDrop(tokio::spawn(async move {
        let tick = idempotency::CLAIM_LEASE / 3;
        loop {
            tokio::time::sleep(tick).await;
            if let Ok(false) = store.extend_claim(&claim).await {
                return;
            }
        }
    }))
}

/// A task that stops when its handle is dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// What an earlier attempt with the same key left: its sale, replayed, or its refusal.
fn replay(prior: Prior) -> Result<Completed, SaleError> {
    match prior {
        Prior::Sold(entry) => Ok(Completed {
            sold: entry.into(),
            replayed: true,
        }),
        Prior::SoldOut => Err(SaleError::SoldOut { replayed: true }),
        Prior::InProgress => Err(SaleError::InProgress),
    }
}

/// The business step. A zero-length sleep still waits for the next timer tick (about a
/// millisecond, with the lock held), so no work means no sleep at all.
async fn work(from: Instant, duration: Duration) {
    if !duration.is_zero() {
        tokio::time::sleep_until(from + duration).await;
    }
}

/// A failed write call: "nothing sold" only where that is certain: the connection was
/// refused, or Redis answered with an error (the scripts check everything before their
/// first write). A timeout or a connection dropped mid-call may hide a write that landed,
/// or one still queued in a frozen Redis.
fn after_write(e: RedisError) -> SaleError {
    let answered = matches!(
        e.kind(),
        redis::ErrorKind::Server(_) | redis::ErrorKind::Extension
    );
    // A call that never got a pooled connection sent nothing.
    if answered || e.is_connection_refusal() || crate::store::is_pool_exhausted(&e) {
        SaleError::Redis(e)
    } else {
        SaleError::OutcomeUnknown(e)
    }
}

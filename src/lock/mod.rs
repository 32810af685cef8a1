//! The locks, one file per strategy in the tutorial's order, each opening with what it is,
//! what it fixes and what it still gets wrong.
//!
//! Every Redis strategy implements the same verbs ([`RedisLockOps`]): `try_acquire` (one
//! attempt, never waits), `release`, and `renew` for those that renew. [`Locks`] adds what
//! they share: waiting for a held lock ([`wait`]), passing it between the instance's own
//! sales for a bounded tenure ([`cohort`]), renewing a lease ([`renewal`]) and the
//! per-process mutex of `local`. The catalogue (names, flaws, properties) is data in
//! [`crate::strategy`]; [`on_lock!`] maps each `RedisLock` variant to the type that
//! implements it, so a new strategy is a file here, a variant and a row there, and one arm
//! of that macro. Locks spanning several Redis nodes find them in [`LockCx::nodes`].

pub mod acl;
mod atomic;
mod cohort;
mod fenced;
mod handoff;
mod local;
mod lua_release;
mod none;
pub mod optimistic;
mod owner_check;
pub mod redlock;
mod reentrant;
pub mod renewal;
mod setnx;
mod setnx_ttl;
pub mod wait;
mod watchdog;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use redis::{RedisError, RedisResult};
use tokio::sync::{Mutex, OwnedMutexGuard};
use tokio::time::Instant;

use crate::store::{StockRead, Store, scripts};
pub use crate::strategy::{RedisLock, Strategy};
use cohort::{Cohort, Joined, Passed, Tenure};
use renewal::Renewal;
use wait::{Acquired, WaitMode, Waiter};

pub use atomic::sell as atomic_sell;

/// The pause before a quorum attempt again after a majority of the lock nodes left one
/// unanswered: the attempt itself already waited for them.
const UNANSWERED_RETRY: Duration = Duration::from_millis(10);

/// A lock that nothing renews is passed within a tenure as it is while more than this part
/// of its lease is left (1 / 100: 99%, the share of a lease the quorum lock sets aside for
/// clock drift); with less, its lease is made whole first ([`Locks::take_passed`]). Tenures
/// of the default 5 ms never come near it.
const FRESH_LEASE: u32 = 100;

/// Why a lock could not be had.
#[derive(Debug)]
pub enum LockError {
    /// The lock stayed held for the whole wait budget.
    Timeout {
        waited: Duration,
    },
    Redis(RedisError),
    /// Acquired, but fewer replicas than `REPLICA_ACKS` acknowledged it in time; released.
    NotReplicated {
        acked: i64,
        wanted: u32,
    },
}

impl From<RedisError> for LockError {
    fn from(e: RedisError) -> Self {
        LockError::Redis(e)
    }
}

/// The outcome of one attempt at a Redis lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attempt {
    /// Taken (or re-entered), with the fencing token drawn for it, if the strategy has one,
    /// and, from the queue of the hand-off (`notify`), how many still wait behind it.
    Acquired {
        fence: Option<u64>,
        behind: Option<u64>,
        /// The last of the tokens drawn with `fence`, when a block was (see [`Grant`]).
        fence_to: Option<u64>,
    },
    /// Held by someone else; `retry_in` is its remaining lease, `None` when it has none.
    Busy { retry_in: Option<Duration> },
}

impl Attempt {
    /// Reads the `PTTL` of a lock that could not be taken: -2 means it vanished meanwhile.
    fn busy(pttl: i64) -> Self {
        let retry_in = match pttl {
            -1 => None,
            ms => Some(Duration::from_millis(ms.max(0) as u64)),
        };
        Attempt::Busy { retry_in }
    }

    /// Reads the `{1, token[, behind[, last]]}` / `{0, pttl}` reply of the lock scripts.
    fn from_script(reply: Vec<i64>, fenced: bool) -> Self {
        let value = reply.get(1).copied().unwrap_or(-2);
        if reply.first() == Some(&1) {
            Attempt::Acquired {
                fence: fenced.then_some(value.max(0) as u64),
                behind: reply.get(2).map(|&b| b.max(0) as u64),
                fence_to: reply.get(3).filter(|_| fenced).map(|&t| t.max(0) as u64),
            }
        } else {
            Attempt::busy(value)
        }
    }
}

/// What an acquisition got: its fencing token, if the strategy draws one, and how many
/// waiters were still queued behind it, when the hand-off queue says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    pub fence: Option<u64>,
    pub behind: Option<u64>,
    /// The last of a block of tokens drawn with `fence` in the same step, for the sales the
    /// lock passes to within its tenure: their first pass then needs no round trip to draw.
    pub fence_to: Option<u64>,
    /// Handed over by a release, with its short lease ([`handoff::HANDED_LEASE`]), and heard
    /// of from the inbox: the lease is still to be extended.
    pub handed: bool,
    /// When the call that wrote this lease was sent (for a lock handed over, a moment
    /// before its release wrote it): the lease surely runs from then, whenever Redis ran it.
    pub leased_from: Instant,
    /// The critical sections per tenure the release that handed the lock over passed on,
    /// in 256ths.
    pub tenure_mean: Option<u32>,
    /// How long the next in line had waited when the release handed the lock over.
    pub next_waited: Option<Duration>,
}

impl Grant {
    /// Until when the lease this grant gave surely lasts, before any renewal: from its
    /// sending, the lease the grant was written with, less the clocks' drift.
    fn good_until(&self, ttl: Duration) -> Instant {
        let lease = if self.handed {
            ttl.min(handoff::HANDED_LEASE)
        } else {
            ttl
        };
        self.leased_from + lease.saturating_sub(redlock::drift(ttl))
    }

    /// The lease before any renewal: until when it surely lasts, and when the call that set
    /// it was sent, from which the first renewal is due. A lock handed over gets the whole
    /// lease from its extension, sent now, and the renewal counts from that.
    fn lease(&self, ttl: Duration) -> (Instant, Instant) {
        let set_at = if self.handed {
            Instant::now()
        } else {
            self.leased_from
        };
        (self.good_until(ttl), set_at)
    }

    /// The tokens drawn with this grant beyond its own, `next..=last`, if any.
    fn spare_fences(&self) -> Option<(u64, u64)> {
        let (fence, last) = (self.fence?, self.fence_to?);
        (last > fence).then_some((fence + 1, last))
    }
}

/// What a release found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Released {
    /// The lock key is gone (for the naive strategies: *a* lock key, maybe someone else's).
    Freed,
    /// An outer level of a reentrant hold remains.
    StillHeld,
    /// The lock was no longer this owner's: it had expired, or been taken over.
    NotHeld,
}

/// The verbs of a lock kept in Redis, implemented by one unit type per strategy file.
///
/// Each call is one attempt on the Redis side; waiting, renewal scheduling, undoing an
/// acquire that Redis did not answer, and metrics are [`Locks`]' business, not the
/// strategy's.
pub(crate) trait RedisLockOps {
    /// One attempt: acquired (with a fencing token if the strategy draws one), or busy with
    /// the holder's remaining lease.
    async fn try_acquire(cx: &LockCx, owner: &str) -> RedisResult<Attempt>;

    /// Gives the lock up. Whether it checks the owner is the strategy's flaw or fix, and its
    /// table row says which (`release_checks_owner`).
    async fn release(cx: &LockCx, owner: &str) -> RedisResult<Released>;

    /// Extends the lease if `owner` still holds the lock; `Ok(false)` when it is gone. Only
    /// asked of strategies whose row says `renews`.
    async fn renew(cx: &LockCx, owner: &str) -> RedisResult<bool> {
        let _ = (cx, owner);
        Ok(false)
    }

    /// Whether a release wakes the waiters of the stock's Redis ([`wait`]). A lock that
    /// lives elsewhere (on other nodes) says no, and its waiters poll instead.
    const WAKES_WAITERS: bool = true;

    /// How a release may hand this lock straight to the next queued waiter
    /// (`LOCK_WAIT=notify`, [`handoff`]): the shape the release writes for it (`string`,
    /// `hash`, or `fenced`, which also draws the waiter's token); `None` for a lock whose
    /// release deletes blindly or in two steps, which has nothing to hand over with.
    const HANDOFF: Option<&'static str> = None;
}

/// Runs `$body` with `$L` bound to the type that implements `$lock`: the one place that
/// maps a [`RedisLock`] variant to its file.
macro_rules! on_lock {
    ($lock:expr, $L:ident => $body:expr) => {
        match $lock {
            RedisLock::Setnx => {
                type $L = setnx::Setnx;
                $body
            }
            RedisLock::SetnxTtl => {
                type $L = setnx_ttl::SetnxTtl;
                $body
            }
            RedisLock::OwnerCheck => {
                type $L = owner_check::OwnerCheck;
                $body
            }
            RedisLock::LuaRelease => {
                type $L = lua_release::LuaRelease;
                $body
            }
            RedisLock::Reentrant => {
                type $L = reentrant::Reentrant;
                $body
            }
            RedisLock::Watchdog => {
                type $L = watchdog::Watchdog;
                $body
            }
            RedisLock::Fenced => {
                type $L = fenced::Fenced;
                $body
            }
            RedisLock::Redlock => {
                type $L = redlock::Redlock;
                $body
            }
            RedisLock::RedlockFenced => {
                type $L = redlock::RedlockFenced;
                $body
            }
        }
    };
}

async fn try_acquire(cx: &LockCx, lock: RedisLock, owner: &str) -> RedisResult<Attempt> {
    on_lock!(lock, L => L::try_acquire(cx, owner).await)
}

async fn release_redis(cx: &LockCx, lock: RedisLock, owner: &str) -> RedisResult<Released> {
    on_lock!(lock, L => L::release(cx, owner).await)
}

async fn renew(cx: &LockCx, lock: RedisLock, owner: &str) -> RedisResult<bool> {
    on_lock!(lock, L => L::renew(cx, owner).await)
}

fn wakes_waiters(lock: RedisLock) -> bool {
    on_lock!(lock, L => L::WAKES_WAITERS)
}

fn handoff_shape(lock: RedisLock) -> Option<&'static str> {
    on_lock!(lock, L => L::HANDOFF)
}

impl Released {
    /// Reads the count of a `DEL` (or of a script that deletes the lock key): one key gone.
    fn by_deleted(deleted: i64) -> Self {
        if deleted == 1 {
            Released::Freed
        } else {
            Released::NotHeld
        }
    }
}

/// What every strategy file needs: where the lock lives and how long its lease is.
#[derive(Clone)]
pub struct LockCx {
    /// The Redis that keeps the stock; every single-node lock lives there too, next to it.
    pub store: Store,
    /// Independent Redis nodes for a lock that a majority of them must grant (`LOCK_NODES`);
    /// empty when none are configured. Each has the item's key names and its own connection.
    pub nodes: Arc<[Store]>,
    pub ttl: Duration,
    /// Widens the race window of `owner-check` on demand (fault scenarios only).
    pub release_gap: Duration,
    /// The newest fencing token this instance has drawn: if Redis loses its data (and its
    /// counter), the counter restarts above it instead of handing out old tokens again.
    pub newest_fence: Arc<std::sync::atomic::AtomicU64>,
    /// How many sales have given up because a majority of the lock nodes left their
    /// attempts unanswered, or too few of them were up: a quorum sale that waited in line
    /// since before it moved answers 503 too, instead of starting a streak of its own (8
    /// sales in line: 1 to 10 s apart unanswered, up to 7 s refused).
    pub quorum_outages: Arc<std::sync::atomic::AtomicU64>,
    /// Fencing tokens a queued attempt draws when it is granted the lock (`notify`): one,
    /// or with tenures a block, the rest for the sales the tenure passes the lock to.
    pub fence_block: u64,
    /// The mean critical sections per tenure, in 256ths, as this instance last set them for this
    /// item (0: none yet): every release passes the number on with the lock
    /// ([`cohort::next_mean`]).
    pub tenure_mean: Arc<std::sync::atomic::AtomicU32>,
}

impl LockCx {
    /// The mean critical sections per tenure a release passes on with the lock.
    pub fn tenure_mean(&self) -> u32 {
        self.tenure_mean.load(Ordering::Relaxed)
    }

    /// A copy whose stock store waits for `REPLICA_ACKS` replicas after every call, with
    /// the count they acknowledged; `None` when `REPLICA_ACKS` is 0.
    pub fn acked(&self) -> Option<(LockCx, Arc<crate::store::Acks>)> {
        let (store, acks) = self.store.acked()?;
        let mut cx = self.clone();
        cx.store = store;
        Some((cx, acks))
    }
}

/// A held lock. Release it with [`Locks::release`]; a guard that is dropped instead stops its
/// renewal, so a forgotten release expires with the lease rather than living forever
/// (except under `setnx`, whose key has no lease: that is its flaw).
pub struct Guard {
    strategy: Strategy,
    owner: Arc<str>,
    fence: Option<u64>,
    waited: Duration,
    hold: Hold,
    /// Taken again by its holder (`reenter`): its release counts a reentrant lock down.
    nested: bool,
    /// The stock read that the sale before this one in the tenure sent behind its write,
    /// for this sale (see [`Locks::next_read`]).
    prefetched: Option<StockRead>,
    /// For a lock handed over and held outside a tenure: the extension of its short lease.
    handed: Option<Arc<handoff::HandedLease>>,
}

enum Hold {
    Nothing,
    /// Held until the guard is released (or dropped).
    Local(OwnedMutexGuard<()>),
    Redis(RedisLock, Option<Renewal>),
    /// Held as part of this instance's tenure ([`cohort`]): its release may pass it on here.
    Cohort(Tenure),
}

impl Guard {
    /// The strategy the lock was taken under.
    pub fn strategy(&self) -> Strategy {
        self.strategy
    }

    pub fn fence(&self) -> Option<u64> {
        self.fence
    }

    pub fn waited(&self) -> Duration {
        self.waited
    }

    /// Counts the wait of the nested acquisition `inner` in this sale's own.
    pub fn add_nested_wait(&mut self, inner: &Guard) {
        self.waited += inner.waited;
    }

    /// True once the renewal found the lock gone, or the short lease of a lock handed over
    /// could not be extended. Strategies without renewal know nothing else.
    pub fn is_lost(&self) -> bool {
        let renewal = match &self.hold {
            Hold::Redis(_, renewal) => renewal.as_ref(),
            Hold::Cohort(tenure) => tenure.renewal.as_ref(),
            Hold::Nothing | Hold::Local(_) => None,
        };
        renewal.is_some_and(Renewal::is_lost) || self.handed().is_some_and(|h| h.is_lost())
    }

    fn handed(&self) -> Option<&handoff::HandedLease> {
        match &self.hold {
            Hold::Cohort(tenure) => tenure.handed.as_deref(),
            _ => self.handed.as_deref(),
        }
    }

    /// False when the lock was handed over with a short lease that could not be extended:
    /// the sale must not write. Waits for the extension's answer, which has usually come
    /// by the time a sale has read.
    pub async fn lease_confirmed(&self) -> bool {
        match self.handed() {
            Some(handed) => handed.confirmed().await,
            None => true,
        }
    }

    /// Why a handed-over lease could not be confirmed, when Redis gave no answer (an
    /// exhausted pool, a timeout) rather than a no: nothing was sold, and the sale says why.
    pub fn lease_failure(&self) -> Option<redis::RedisError> {
        self.handed().and_then(|handed| handed.failure())
    }

    /// The stock read a sale before this one in the tenure sent behind its own write, for
    /// this sale (see [`Locks::next_read`]): its read is done.
    pub fn take_prefetched(&mut self) -> Option<StockRead> {
        self.prefetched.take()
    }

    /// The owner id the lock is written under in Redis: the sale's own, or, for a lock
    /// passed within a tenure, the one of the sale that took it from Redis.
    pub fn redis_owner(&self) -> &Arc<str> {
        match &self.hold {
            Hold::Cohort(tenure) => &tenure.owner,
            _ => &self.owner,
        }
    }
}

/// The lock machinery of one item in one instance: its store, its lock nodes, its
/// process-local mutex and what listens for its releases.
pub struct Locks {
    cx: LockCx,
    mode: WaitMode,
    local: Arc<Mutex<()>>,
    waiter: Waiter,
    /// For locks whose releases wake nobody here: retries bounded by the holder's lease.
    poller: Waiter,
    /// The lock as passed between this instance's sales ([`cohort`]).
    cohort: Arc<Cohort>,
    /// How long a tenure lasts; zero turns passing off.
    tenure: Duration,
}

impl Locks {
    /// Starts listening for releases; must be called inside a Tokio runtime.
    pub fn new(store: Store, ttl: Duration, mode: WaitMode, release_gap: Duration) -> Self {
        let cx = LockCx {
            store,
            nodes: Arc::new([]),
            ttl,
            release_gap,
            newest_fence: Arc::default(),
            tenure_mean: Arc::default(),
            quorum_outages: Arc::default(),
            fence_block: 1,
        };
        Self::listening(cx, mode)
    }

    fn listening(cx: LockCx, mode: WaitMode) -> Self {
        let waiter = Waiter::listen(&cx.store, mode);
        let poller = Waiter::listen(&cx.store, WaitMode::Spin);
        Self {
            mode,
            local: Arc::default(),
            waiter,
            poller,
            cohort: Arc::new(Cohort::passing_on(cx.tenure_mean.clone())),
            cx,
            tenure: Duration::ZERO,
        }
        .with_tenure(cohort::QUANTUM)
    }

    /// Sets how long a lock taken from Redis passes between this instance's sales before it
    /// goes back ([`cohort`]); zero turns passing off. Kept under a quarter of the lease.
    pub fn with_tenure(mut self, tenure: Duration) -> Self {
        self.tenure = tenure.min(self.cx.ttl / 4);
        self.cx.fence_block = if self.tenure.is_zero() {
            1
        } else {
            cohort::TOKEN_BLOCK
        };
        self
    }

    /// The same machinery for another item: the same servers and connections, the item's
    /// own keys, mutex and listeners; must be called inside a Tokio runtime.
    ///
    /// The newest fencing token is shared with this `Locks`: it is a floor that a counter
    /// lost with Redis's data restarts above, and one floor for every item keeps each
    /// item's tokens increasing (they may jump) while forgetting nothing when an idle
    /// item's machinery is dropped.
    pub fn for_item(&self, item: &str) -> Self {
        let cx = LockCx {
            store: self.cx.store.for_item(item),
            nodes: self.cx.nodes.iter().map(|n| n.for_item(item)).collect(),
            ttl: self.cx.ttl,
            release_gap: self.cx.release_gap,
            newest_fence: self.cx.newest_fence.clone(),
            quorum_outages: self.cx.quorum_outages.clone(),
            fence_block: self.cx.fence_block,
            tenure_mean: Arc::default(),
        };
        Self::listening(cx, self.mode).with_tenure(self.tenure)
    }

    /// Every command a sale of `strategy` may send to the stock's Redis, with its key
    /// ([`acl`]), as this instance reaches Redis.
    pub fn acl_needs(&self, strategy: Strategy) -> Vec<acl::Need> {
        let keys = &self.cx.store.keys;
        let inbox = match self.waiter.inbox() {
            Some(inbox) => inbox.to_string(),
            None => keys.inbox("acl-check"),
        };
        let reach = acl::Reach {
            wait: self.mode,
            pooled: self.cx.store.uses_pool(),
            acks: self.cx.store.replication().acks > 0,
        };
        acl::needs(strategy, keys, &inbox, reach)
    }

    /// The store of this item.
    pub fn store(&self) -> &Store {
        &self.cx.store
    }

    /// The lease every lock is taken with (`LOCK_TTL_MS`).
    pub fn lease(&self) -> Duration {
        self.cx.ttl
    }

    /// No sale waits for this item's lock here, and no hand-off is owed: dropping it now
    /// strands nobody.
    pub fn is_idle(&self) -> bool {
        self.waiter.is_idle() && self.poller.is_idle() && self.cohort.is_idle()
    }

    /// Adds the independent nodes a quorum lock is taken on.
    pub fn with_nodes(mut self, nodes: Vec<Store>) -> Self {
        self.cx
            .store
            .metrics()
            .register_nodes(nodes.iter().map(Store::address).collect());
        self.cx.nodes = nodes.into();
        self
    }

    pub fn nodes(&self) -> &[Store] {
        &self.cx.nodes
    }

    /// How long a quorum sale waits for one lock node's answer before it counts that node's
    /// vote as lost (a share of the lease).
    pub fn node_bound(&self) -> Duration {
        redlock::node_timeout(self.cx.ttl)
    }

    /// Acquire attempts this instance has sent to Redis so far (every strategy together).
    pub fn attempts(&self) -> u64 {
        self.waiter.attempts() + self.poller.attempts()
    }

    /// Takes the lock for `owner`, waiting until `deadline` at most. A `nested` acquire is
    /// the same sale entering again: it starts no second renewal.
    pub async fn acquire(
        &self,
        strategy: Strategy,
        owner: &Arc<str>,
        deadline: Instant,
        nested: bool,
    ) -> Result<Guard, LockError> {
        let started = Instant::now();
        let mut handed = None;
        let (fence, mut hold) = match strategy {
            Strategy::None | Strategy::Atomic | Strategy::Optimistic => (None, Hold::Nothing),
            Strategy::Local => {
                let guard =
                    local::acquire(&self.local, deadline)
                        .await
                        .ok_or(LockError::Timeout {
                            waited: started.elapsed(),
                        })?;
                (None, Hold::Local(guard))
            }
            Strategy::Redis(lock) if !nested && self.passes(lock) => {
                self.acquire_in_tenure(lock, owner, deadline).await?
            }
            Strategy::Redis(lock) => {
                let never = std::future::pending::<std::convert::Infallible>();
                let grant = match self
                    .acquire_redis(lock, owner, deadline, nested, never)
                    .await?
                {
                    Acquired::Granted(grant) => grant,
                    Acquired::Passed(never) => match never {},
                };
                let renewal = (lock.info().renews && !nested).then(|| {
                    let (good_until, set_at) = grant.lease(self.cx.ttl);
                    Renewal::start(self.cx.clone(), lock, owner.clone(), good_until, set_at)
                });
                handed = self.handed_lease(lock, owner, &grant, renewal.as_ref());
                (grant.fence, Hold::Redis(lock, renewal))
            }
        };
        // A read sent for this sale is this sale's alone: never left in the tenure for the
        // next one, and only under the token it was sent with.
        let prefetched = match &mut hold {
            Hold::Cohort(tenure) => tenure.prefetched.take(),
            _ => None,
        }
        .filter(|p| p.fence == fence)
        .map(|p| p.read);
        let waited = started.elapsed();
        // The nested acquisition's too: under a lock that is not reentrant it waits for the
        // lease its own sale holds, which neither the answer nor /metrics showed.
        self.cx.store.metrics().lock_wait(strategy, waited);
        tracing::debug!(event = crate::events::Event::LockAcquired.name(), %strategy, %owner, fence, nested, waited_ms = waited.as_millis() as u64, "lock acquired");
        Ok(Guard {
            strategy,
            owner: owner.clone(),
            fence,
            waited,
            hold,
            nested,
            prefetched,
            handed,
        })
    }

    /// The extension of a lock's short lease, when a release handed it over.
    fn handed_lease(
        &self,
        lock: RedisLock,
        owner: &Arc<str>,
        grant: &Grant,
        renewal: Option<&Renewal>,
    ) -> Option<Arc<handoff::HandedLease>> {
        let lease = renewal.map(|r| r.lease().clone());
        grant
            .handed
            .then(|| handoff::HandedLease::start(&self.cx, lock, owner, lease))
            .flatten()
    }

    /// Whether a lock of `lock` is passed between this instance's sales ([`cohort`]): the
    /// hand-off strategies in `notify` mode, when acquires need no replica acknowledgement
    /// (a pass would skip the `WAIT` that an acquire makes).
    fn passes(&self, lock: RedisLock) -> bool {
        !self.tenure.is_zero()
            && self.mode == WaitMode::Notify
            && handoff_shape(lock).is_some()
            && self.cx.store.replication().acks == 0
    }

    /// One acquisition in Redis: attempts, waiting between them, until it is had, the
    /// deadline passes or Redis fails, or `passed` gives something first (see
    /// [`Waiter::until_acquired`]).
    async fn acquire_redis<P: std::future::Future>(
        &self,
        lock: RedisLock,
        owner: &Arc<str>,
        deadline: Instant,
        nested: bool,
        passed: P,
    ) -> Result<Acquired<P::Output>, LockError> {
        let waiter = if wakes_waiters(lock) {
            &self.waiter
        } else {
            &self.poller
        };
        let hands_off = handoff_shape(lock).is_some();
        // With REPLICA_ACKS, every call of an attempt waits for the replicas on its
        // own connection; the count is read once the lock is had.
        let acked = self.cx.acked();
        // Between attempts, a waiter that sees the stock's Redis leave a call unanswered
        // stops, with nothing sent: the holder it waits for is stuck on the same Redis, and
        // each waiter in turn would hold the lock for its own timeout (`redlock-fenced`
        // draws its token there with the quorum held: 1, 2, 3... s in line).
        let outages = self.cx.store.outages();
        let (failures, started) = (self.cx.store.failures(), Instant::now());
        // Since when every attempt of this sale went unanswered by a majority of the lock
        // nodes (quorum strategies): past the stock Redis's own timeout, a 503 as for a
        // stock Redis that stopped answering, instead of a wait for the whole budget that
        // would end in "the lock stayed held" when nobody held it.
        let unanswered_since = &std::sync::Mutex::new(None::<Instant>);
        let quorum_outages = self.cx.quorum_outages.load(Ordering::Acquire);
        let attempt = waiter.until_acquired(
            owner,
            deadline,
            nested,
            hands_off,
            |queued| {
                let cx = match &acked {
                    Some((cx, acks)) => {
                        acks.reset();
                        cx
                    }
                    None => &self.cx,
                };
                let outage = self.cx.store.outages() != outages;
                let failing = self.cx.store.failures() != failures
                    && started.elapsed() >= self.cx.store.timeout();
                let quorum_outage = lock.info().quorum
                    && self.cx.quorum_outages.load(Ordering::Acquire) != quorum_outages;
                async move {
                    if outage {
                        return Err(crate::store::unanswered_while_waiting());
                    }
                    if quorum_outage {
                        return Err(redlock::quorum_failed_while_waiting());
                    }
                    if failing {
                        return Err(crate::store::failed_while_waiting());
                    }
                    let tried = Instant::now();
                    let attempt = match queued {
                        Some(queued) => handoff::try_acquire(cx, lock, owner, queued).await,
                        None => try_acquire(cx, lock, owner).await,
                    };
                    let Ok(mut since) = unanswered_since.lock() else {
                        return attempt;
                    };
                    match attempt {
                        Err(e) if redlock::is_majority_unanswered(&e) => {
                            let since = *since.get_or_insert(tried);
                            if since.elapsed() >= self.cx.store.timeout() {
                                self.cx.quorum_outages.fetch_add(1, Ordering::AcqRel);
                                Err(e)
                            } else {
                                Ok(Attempt::Busy {
                                    retry_in: Some(UNANSWERED_RETRY),
                                })
                            }
                        }
                        // Too few nodes up: nobody can win, and the sales in line behind this
                        // one answer now instead of each finding it out in turn.
                        Err(e) if redlock::is_quorum_lost(&e) => {
                            *since = None;
                            self.cx.quorum_outages.fetch_add(1, Ordering::AcqRel);
                            Err(e)
                        }
                        attempt => {
                            *since = None;
                            attempt
                        }
                    }
                }
            },
            passed,
        );
        let grant = match attempt.await {
            Ok(Acquired::Passed(passed)) => return Ok(Acquired::Passed(passed)),
            Ok(Acquired::Granted(grant)) => {
                // Tokens drawn by the release that handed the lock over.
                if let Some(token) = grant.fence_to.or(grant.fence) {
                    self.cx.newest_fence.fetch_max(token, Ordering::AcqRel);
                }
                grant
            }
            Err(LockError::Redis(e)) => {
                if !nested {
                    self.undo_unanswered_acquire(lock, owner);
                }
                return Err(LockError::Redis(e));
            }
            Err(e) => return Err(e),
        };
        if let Some((_, acks)) = &acked {
            self.check_replicated(lock, owner, acks).await?;
        }
        Ok(Acquired::Granted(grant))
    }

    /// Takes the lock from a sale of this instance if one holds it within its tenure (or
    /// just parked it), else from Redis, beginning a tenure ([`cohort`]); while queued in
    /// Redis, a lock passed by a sale of this instance is taken too.
    async fn acquire_in_tenure(
        &self,
        lock: RedisLock,
        owner: &Arc<str>,
        deadline: Instant,
    ) -> Result<(Option<u64>, Hold), LockError> {
        let started = Instant::now();
        let outages = self.cx.store.outages();
        let failures = self.cx.store.failures();
        let quorum_outages = self.cx.quorum_outages.load(Ordering::Acquire);
        loop {
            // Every wait here ends within a few tens of milliseconds to join again: a sale
            // that sees Redis left a call unanswered meanwhile (the sale standing in the
            // Redis queue for this instance, or the holder, timed out) answers now, instead
            // of each sale in line standing in the queue in turn for its own timeout.
            if self.cx.store.outages() != outages {
                return Err(LockError::Redis(crate::store::unanswered_while_waiting()));
            }
            // Redis refusing: the sale in the Redis queue for this instance fails fast, and
            // the next in line takes its place, and fails in its turn; a sale that has
            // waited its own timeout meanwhile answers now.
            if self.cx.store.failures() != failures && started.elapsed() >= self.cx.store.timeout()
            {
                return Err(LockError::Redis(crate::store::failed_while_waiting()));
            }
            // A quorum sale in the Redis queue for this instance gave up, a majority of the
            // lock nodes unanswering or down: the sales in line behind it answer now.
            if lock.info().quorum
                && self.cx.quorum_outages.load(Ordering::Acquire) != quorum_outages
            {
                return Err(LockError::Redis(redlock::quorum_failed_while_waiting()));
            }
            // Ok: a tenure passed here; Err: the sale stands in the Redis queue for this
            // instance, and asks Redis.
            let joined = match self.cohort.join(lock, started) {
                Joined::Taken(tenure) => Ok(tenure),
                Joined::Wait { mut passed, until } | Joined::Behind { mut passed, until } => {
                    let waited = tokio::time::timeout_at(until.min(deadline), passed.passed());
                    // One passed just as the wait ended is taken all the same.
                    match waited.await.ok().flatten().or_else(|| passed.close()) {
                        Some(tenure) => Ok(tenure),
                        None if Instant::now() >= deadline => {
                            return Err(LockError::Timeout {
                                waited: started.elapsed(),
                            });
                        }
                        // The tenure ended, or the wait did: join again, behind this
                        // instance's sale in the Redis queue if one stands there, or first.
                        None => continue,
                    }
                }
                Joined::Redis(standing) => Err(standing),
            };
            let mut passing = match joined {
                Ok(tenure) => match self.take_passed(tenure).await {
                    Some(taken) => return Ok(taken),
                    None => continue,
                },
                Err(standing) => standing,
            };
            if Instant::now() >= deadline {
                return Err(LockError::Timeout {
                    waited: started.elapsed(),
                });
            }
            let since = Instant::now();
            let local = async {
                match passing.passed().await {
                    Some(tenure) => tenure,
                    None => std::future::pending().await,
                }
            };
            let acquired = self
                .acquire_redis(lock, owner, deadline, false, local)
                .await;
            let late = passing.close();
            let grant = match acquired {
                Ok(Acquired::Granted(grant)) => grant,
                Ok(Acquired::Passed(tenure)) => {
                    self.leave_redis_queue(lock, owner);
                    match self.take_passed(tenure).await {
                        Some(taken) => return Ok(taken),
                        None => continue,
                    }
                }
                Err(e) => {
                    if let Some(tenure) = late {
                        self.hand_back(tenure);
                    }
                    self.cohort.left_redis_queue(lock);
                    return Err(e);
                }
            };
            // Redis granted it while a tenure here was passed to this sale: that tenure's
            // lock must have been lost (one lock, one holder); it goes on or is released.
            if let Some(tenure) = late {
                self.hand_back(tenure);
            }
            let renewal = lock.info().renews.then(|| {
                let (good_until, set_at) = grant.lease(self.cx.ttl);
                Renewal::start(self.cx.clone(), lock, owner.clone(), good_until, set_at)
            });
            let handed = self.handed_lease(lock, owner, &grant, renewal.as_ref());
            let acquired = Instant::now();
            let waited = (grant.handed && grant.behind.is_some()).then(|| acquired - since);
            let (quantum, cap) = self.cohort.allot(
                self.tenure,
                grant.behind,
                waited,
                grant.tenure_mean,
                grant.next_waited,
            );
            self.cohort.began(lock, acquired, quantum);
            let tenure = Tenure {
                lock,
                owner: owner.clone(),
                since,
                acquired,
                quantum,
                lease: self.cx.ttl,
                renewal,
                tokens: grant.spare_fences(),
                prefetched: None,
                handed,
                passes: 1,
                cap: cap.and_then(std::num::NonZeroU16::new),
            };
            return Ok((grant.fence, Hold::Cohort(tenure)));
        }
    }

    /// A sale queued in Redis that took a passed lock leaves the queue, so that the release
    /// ending the tenure does not hand the lock to it. Not waited for: until it lands, a
    /// hand-off that reaches the sale is released at once, as for any waiter that is gone.
    fn leave_redis_queue(&self, lock: RedisLock, owner: &Arc<str>) {
        let (Some(inbox), Some(shape)) = (self.waiter.inbox(), handoff_shape(lock)) else {
            return;
        };
        let (store, owner) = (self.cx.store.clone(), owner.clone());
        tokio::spawn(async move {
            let forget =
                &scripts::lock_queued(&store.keys, &inbox, &owner, shape, 0, 0, "forget", 0, 1);
            let left: RedisResult<Vec<i64>> = store
                .call(|mut c| async move { forget.invoke_async(&mut c).await })
                .await;
            if let Err(e) = left {
                tracing::debug!(%owner, error = %e, "leaving the lock queue failed; the entry expires");
            }
        });
    }

    /// A tenure nobody will use where it is: to the next sale waiting here, parked, or
    /// released in Redis, without waiting for any of it.
    fn hand_back(&self, tenure: Tenure) {
        match self.cohort.pass(tenure) {
            Passed::ToWaiter => {}
            Passed::Parked(park) => release_when_unused(self.cohort.clone(), self.cx.clone(), park),
            Passed::Over(tenure) => {
                let cx = self.cx.clone();
                tokio::spawn(async move { end_tenure(&cx, tenure).await.ok() });
            }
        }
    }

    /// A sale takes a tenure passed to it. A fenced one needs a token of its own: the next
    /// one drawn ahead, or a new block, drawn only if the tenure's owner still holds the lock
    /// in Redis. `None` when the lock turned out lost, or the draw failed: the tenure is
    /// over and the sale asks Redis.
    async fn take_passed(&self, mut tenure: Tenure) -> Option<(Option<u64>, Hold)> {
        tenure.passes = tenure.passes.saturating_add(1);
        if !tenure.lock.info().renews && tenure.since.elapsed() > tenure.lease / FRESH_LEASE {
            // A lock that nothing renews (lua-release, reentrant) is safe for work shorter than
            // its lease, and a sale that took it from Redis gets the whole lease. One passed
            // to it got what the sales before it had left (with a quarter-lease tenure, work
            // of 0.75-1 lease lost the lock, and a sale of another instance wrote beside it):
            // the lease is made whole again first, unless it has nearly all of it still.
            let sent = Instant::now();
            let ttl_ms = reentrant::millis(self.cx.ttl);
            let extend = if handoff_shape(tenure.lock) == Some("string") {
                scripts::extend_owned(&self.cx.store.keys.lock, &tenure.owner, ttl_ms)
            } else {
                scripts::renew(&self.cx.store.keys.lock, &tenure.owner, ttl_ms)
            };
            let extend = &extend;
            let extended: RedisResult<i64> = self
                .cx
                .store
                .call(|mut c| async move { extend.invoke_async(&mut c).await })
                .await;
            if !matches!(extended, Ok(1)) {
                self.cohort.abandoned();
                end_tenure(&self.cx, tenure).await.ok();
                return None;
            }
            tenure.since = sent;
        }
        if handoff_shape(tenure.lock) != Some("fenced") {
            return Some((None, Hold::Cohort(tenure)));
        }
        if let Some(token) = tenure.take_token() {
            return Some((Some(token), Hold::Cohort(tenure)));
        }
        let newest = self.cx.newest_fence.load(Ordering::Acquire);
        let draw = &scripts::draw_fences(
            &self.cx.store.keys,
            &tenure.owner,
            newest,
            cohort::TOKEN_BLOCK,
        );
        let drawn: RedisResult<u64> = self
            .cx
            .store
            .call(|mut c| async move { draw.invoke_async(&mut c).await })
            .await;
        match drawn {
            Ok(last) if last > 0 => {
                self.cx.newest_fence.fetch_max(last, Ordering::AcqRel);
                let first = last + 1 - cohort::TOKEN_BLOCK;
                tenure.tokens = Some((first, last));
                let token = tenure.take_token();
                Some((token, Hold::Cohort(tenure)))
            }
            drawn => {
                if let Err(e) = &drawn {
                    tracing::debug!(error = %e, "drawing fencing tokens for a passed lock failed");
                }
                self.cohort.abandoned();
                end_tenure(&self.cx, tenure).await.ok();
                None
            }
        }
    }

    /// Whether the holder of `guard` should send the read of the next sale of its tenure
    /// behind its write ([`crate::store::Store::record_sale_then_read`]), and with which
    /// fencing token: when the tenure will pass to a sale waiting here, and, for a fenced
    /// lock, that sale's token is drawn already. `None`: the next holder reads for itself.
    pub fn next_read(&self, guard: &Guard) -> Option<Option<u64>> {
        let Hold::Cohort(tenure) = &guard.hold else {
            return None;
        };
        if !tenure.can_pass() || !self.cohort.has_waiter(tenure.lock) {
            return None;
        }
        if handoff_shape(tenure.lock) == Some("fenced") {
            return tenure.next_token().map(Some);
        }
        Some(None)
    }

    /// Keeps the read sent for the next sale of `guard`'s tenure, under `fence` (from
    /// [`Locks::next_read`]); the sale that gets the tenure next uses it if its token is that.
    pub fn keep_next_read(&self, guard: &mut Guard, fence: Option<u64>, read: StockRead) {
        if let Hold::Cohort(tenure) = &mut guard.hold {
            tenure.prefetched = Some(cohort::Prefetched { fence, read });
        }
    }

    /// Releases in Redis a lock parked for this instance's next sale, at once: for a process
    /// about to exit, which would otherwise leave it to its lease.
    pub async fn close(&self) {
        if let Some(tenure) = self.cohort.take_parked() {
            end_tenure(&self.cx, tenure).await.ok();
        }
    }

    /// Takes the lock `outer` holds again, nested, as the same owner in Redis; a quorum lock
    /// under an owner id of its own. A quorum attempt that loses gives back, by owner id,
    /// whatever the nodes whose vote came late may have granted it; a nested attempt loses to
    /// its own outer hold, and under the same id those give-backs deleted that hold, node by
    /// node, while its sale ran: other buyers took the lock within half a second (found
    /// from outside). The quorum lock is not reentrant either way: the nested attempt still
    /// waits for the hold of its own sale.
    pub async fn reenter(&self, outer: &Guard, deadline: Instant) -> Result<Guard, LockError> {
        let owner = if outer.strategy.info().quorum {
            Arc::from(format!("{}/nested", outer.redis_owner()))
        } else {
            outer.redis_owner().clone()
        };
        self.acquire(outer.strategy, &owner, deadline, true).await
    }

    /// Releases without waiting for Redis: for a sale that Redis has just left a call
    /// unanswered, which would otherwise wait out one more timeout in its release before it
    /// answers (a frozen Redis cost such a sale twice the timeout). The release still goes
    /// out, and an owner-checked one is sent again until Redis answers; a tenure goes on to
    /// a sale waiting here or ends as any other.
    pub fn release_detached(&self, guard: Guard) {
        let Guard {
            strategy,
            owner,
            hold,
            nested,
            ..
        } = guard;
        match hold {
            Hold::Nothing | Hold::Local(_) => {}
            Hold::Cohort(tenure) => self.hand_back(tenure),
            Hold::Redis(lock, renewal) => {
                drop(renewal);
                let cx = self.cx.clone();
                let retry = !nested && strategy.info().release_checks_owner;
                tokio::spawn(async move {
                    if release_redis(&cx, lock, &owner).await.is_err() && retry {
                        retry_release(cx, lock, owner.to_string(), Duration::from_millis(50));
                    }
                });
            }
        }
    }

    /// Lets the lock go without releasing it: its renewal stops and its lease frees it. For a
    /// sale whose write was sent and never confirmed, under a lock without a fencing token,
    /// when its release could reach Redis before that write: the write may still land (held
    /// in a socket, or on the way to a server that froze), and a release now lets the next
    /// holder read and write before it does, with nothing to refuse the late one. From outside, `redlock` (whose release goes to other servers
    /// than the write) sold 2 to 30 units twice after cuts of 0.2-2.5 s between the instances
    /// and the stock's Redis: a write landed 1.7 s into its lease, after the next holder's.
    /// Left to its lease, the lock outlasts a write that lands within it; one that lands
    /// later still can, which is these strategies' flaw (a holder paused past its lease).
    pub fn abandon(&self, guard: Guard) {
        let Guard {
            strategy,
            owner,
            hold,
            ..
        } = guard;
        match hold {
            Hold::Nothing | Hold::Local(_) => {}
            Hold::Redis(_, renewal) => drop(renewal),
            Hold::Cohort(tenure) => {
                // Not passed on within the instance either: the sales waiting here go to
                // Redis, and wait there for the lease.
                drop(tenure);
                self.cohort.abandoned();
            }
        }
        tracing::warn!(%strategy, %owner, "the sale's write went unconfirmed: its lock is left to its lease, not released, so that a write still on its way cannot land beside the next holder's");
    }

    /// Releases the lock. Consuming the guard makes a second release impossible; the scripts
    /// that check the owner make a late one harmless.
    pub async fn release(&self, guard: Guard) -> RedisResult<Released> {
        let Guard {
            strategy,
            owner,
            hold,
            nested,
            ..
        } = guard;
        let released = match hold {
            Hold::Nothing => Released::Freed,
            Hold::Local(mutex_guard) => {
                drop(mutex_guard);
                Released::Freed
            }
            Hold::Cohort(tenure) => match self.cohort.pass(tenure) {
                Passed::ToWaiter => Released::Freed,
                Passed::Parked(park) => {
                    release_when_unused(self.cohort.clone(), self.cx.clone(), park);
                    Released::Freed
                }
                Passed::Over(tenure) => end_tenure(&self.cx, tenure).await?,
            },
            Hold::Redis(lock, renewal) => {
                // Stop renewing first: a renewal racing the release is harmless (it only
                // extends a lease this owner still holds), but there is no point to it.
                drop(renewal);
                match release_redis(&self.cx, lock, &owner).await {
                    Ok(released) => released,
                    Err(e) => {
                        if !nested {
                            self.release_later(strategy, lock, owner);
                        }
                        return Err(e);
                    }
                }
            }
        };
        tracing::debug!(event = crate::events::Event::LockReleased.name(), %strategy, %owner, ?released, "lock released");
        Ok(released)
    }

    /// A release that failed (the master died, say) is tried again in the background until
    /// the lease would have ended anyway. Without it, a lock that reached a replica before
    /// its master died would stay on the promoted replica, with its owner gone, for the
    /// whole lease, and every sale would wait for it. Only an outermost owner-checked
    /// release is retried, as running it twice is harmless: a blind `DEL` could free the
    /// next holder's lock, and a nested reentrant release that landed once would count the
    /// outer hold down too.
    fn release_later(&self, strategy: Strategy, lock: RedisLock, owner: Arc<str>) {
        if !strategy.info().release_checks_owner {
            return;
        }
        retry_release(
            self.cx.clone(),
            lock,
            owner.to_string(),
            Duration::from_millis(50),
        );
    }

    /// An acquire that too few replicas acknowledged could be lost with the master, and a
    /// promoted replica would then grant the same lock to a second owner: it is given back
    /// at once (a failed release leaves it to its lease).
    async fn check_replicated(
        &self,
        lock: RedisLock,
        owner: &str,
        acks: &crate::store::Acks,
    ) -> Result<(), LockError> {
        let wanted = self.cx.store.replication().acks;
        // No command at all (nothing written by this attempt) has nothing to wait for.
        let Some(acked) = acks.get() else {
            return Ok(());
        };
        if acked >= i64::from(wanted) {
            return Ok(());
        }
        tracing::warn!(%owner, acked, wanted, "lock acquired but not acknowledged by enough replicas; releasing it");
        if let Err(e) = release_redis(&self.cx, lock, owner).await {
            tracing::debug!(%owner, error = %e, "releasing an unreplicated lock failed; the lease ends it");
        }
        Err(LockError::NotReplicated { acked, wanted })
    }

    /// An acquire that Redis did not answer in time may still run once Redis wakes up, and
    /// would then hold the lock for a sale that gave up. A release sent right behind it, on
    /// the same connection, runs after it and undoes it. The naive strategies' own releases
    /// delete blindly (a stray one could delete someone else's lock), so their acquires are
    /// undone with `lua-release`'s compare-and-delete of the same string key, which can only
    /// remove this very owner's lock.
    fn undo_unanswered_acquire(&self, lock: RedisLock, owner: &str) {
        let undo = if lock.info().release_checks_owner {
            lock
        } else {
            RedisLock::LuaRelease
        };
        retry_release(self.cx.clone(), undo, owner.to_owned(), Duration::ZERO);
    }
}

/// Releases the tenure parked as `park` in Redis unless a sale took it meanwhile. Runs
/// after the releasing task's next await: a sale that task starts at once takes the parked
/// lock first.
fn release_when_unused(cohort: Arc<Cohort>, cx: LockCx, park: u64) {
    tokio::spawn(async move {
        tokio::task::yield_now().await;
        if let Some(tenure) = cohort.unpark(park) {
            let owner = tenure.owner.clone();
            let released = end_tenure(&cx, tenure).await;
            tracing::debug!(%owner, ?released, "lock released after its tenure, nobody here wanting it");
        }
    });
}

/// Gives a tenure's lock back to Redis, whose release hands it to the next waiter in line;
/// when it fails, retried as [`Locks::release_later`] does.
async fn end_tenure(cx: &LockCx, tenure: Tenure) -> RedisResult<Released> {
    let Tenure {
        lock,
        owner,
        renewal,
        ..
    } = tenure;
    // Stop renewing first: no point extending a lease about to be given up.
    drop(renewal);
    let released = release_redis(cx, lock, &owner).await;
    if released.is_err() {
        retry_release(
            cx.clone(),
            lock,
            owner.to_string(),
            Duration::from_millis(50),
        );
    }
    released
}

/// Releases `owner`'s lock in the background, after `first` and then with a growing
/// backoff, until it succeeds or the lease would have ended anyway.
fn retry_release(cx: LockCx, lock: RedisLock, owner: String, first: Duration) {
    tokio::spawn(async move {
        let until = tokio::time::Instant::now() + cx.ttl;
        let mut backoff = first;
        while tokio::time::Instant::now() + backoff < until {
            tokio::time::sleep(backoff).await;
            match release_redis(&cx, lock, &owner).await {
                Ok(released) => {
                    tracing::info!(%owner, ?released, "lock released in the background");
                    return;
                }
                Err(e) => {
                    tracing::debug!(%owner, error = %e, "background release failed; trying again")
                }
            }
            backoff = (backoff * 2).clamp(Duration::from_millis(50), Duration::from_secs(1));
        }
    });
}

/// Deletes a plain lock key and announces it, in one round trip: the release of the naive
/// strategies, which never look at whose lock they delete.
async fn delete_and_announce(cx: &LockCx, owner: &str) -> RedisResult<Released> {
    let keys = &cx.store.keys;
    let (deleted, _): (i64, i64) = cx
        .store
        .call(|mut c| async move {
            redis::pipe()
                .del(&keys.lock)
                .cmd(keys.publish())
                .arg(&keys.released)
                .arg(owner)
                .del(&keys.signal)
                .ignore()
                .rpush(&keys.signal, owner)
                .ignore()
                .query_async(&mut c)
                .await
        })
        .await?;
    Ok(Released::by_deleted(deleted))
}

/// `SET lock owner NX [PX ttl]` and, in the same round trip, the lock's `PTTL`, so a failed
/// attempt knows how long the holder may keep it.
async fn set_nx(store: &Store, owner: &str, ttl: Option<Duration>) -> RedisResult<Attempt> {
    let key = &store.keys.lock;
    let (set, pttl): (Option<String>, i64) = store
        .call(|mut c| async move {
            let mut set = redis::cmd("SET");
            set.arg(key).arg(owner).arg("NX");
            if let Some(ttl) = ttl {
                set.arg("PX").arg(ttl.as_millis() as u64);
            }
            redis::pipe()
                .add_command(set)
                .pttl(key)
                .query_async(&mut c)
                .await
        })
        .await?;
    Ok(match set {
        Some(_) => Attempt::Acquired {
            fence: None,
            behind: None,
            fence_to: None,
        },
        None => Attempt::busy(pttl),
    })
}

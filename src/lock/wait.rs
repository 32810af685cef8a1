//! Waiting for a lock someone else holds: one mechanism for every Redis strategy.
//!
//! `LOCK_WAIT=notify` (the default) wakes *one* waiter across all instances per release,
//! as python-redis-lock does: a release pushes a signal onto a Redis list (at most one
//! signal lies there), and each instance that has waiters keeps one connection blocked in
//! `BLPOP` on it. Redis hands a pushed element to exactly one blocked client, the one that
//! has waited longest, so instances take turns; inside an instance the signal goes to the
//! waiter at the front of a FIFO queue. A release is never missed although a waiter
//! registers after its failed attempt: a signal pushed meanwhile stays in the list until
//! someone pops it. A signal nobody here wants any more (the waiter gave up) is pushed
//! back for the next instance, and one handed to a waiter that is cancelled before using
//! it is passed on.
//!
//! Fairness needs one more rule: while the lock is contended, an arriving sale does not
//! try first. It would only race the waiter that the last release just woke (and, being
//! already running, usually win), so it queues at once; the first attempt after a wake-up
//! then succeeds, which keeps attempts near one per critical section. "Contended" is what
//! the last acquisition of this instance saw (a busy lock, or a wake-up by a signal), and
//! the queued arrival waits at most four times the recent acquisition time (scheduling
//! hiccups on a busy machine stretch single waits well past the average) before trying
//! anyway, so the end of contention costs one short wait, not a stall.
//!
//! Every wait is bounded by the holder's remaining lease (a key may simply expire, and an
//! expiry signals nobody) and by the sale's deadline. A signal can still be lost with its
//! popper (an instance killed between `BLPOP` and its attempt): an instance whose
//! `BLPOP` finds no signal for [`STALL`] wakes its front waiter to look for itself, and a
//! (re)connection wakes every local waiter, since a restarted Redis forgot the list.
//!
//! For the strategies whose release checks its owner (`lua-release`, `reentrant`,
//! `watchdog`, `fenced`), notify mode goes one step further: a busy attempt queues the
//! waiter in Redis in the same script, and the release hands the lock straight to the first
//! live waiter and pushes to its instance's inbox list ([`super::handoff`]), so the woken
//! waiter already holds the lock. Its entry stays valid for [`ENTRY_LEASE`] and is
//! refreshed every [`REFRESH`] (which also finds a lock freed without a hand-off); a
//! waiter that gives up leaves the queue in the same script as its last attempt (and takes
//! a lock handed to it meanwhile); a cancelled one is marked, and a hand-off that reaches it
//! is released by the popper at once. The signal list stays for the other strategies.
//!
//! Above this, in notify mode, a lock taken from Redis passes between the instance's own
//! sales for a bounded tenure before it goes back to the queue ([`super::cohort`]); a
//! hand-off waiter takes such a passed lock too, between its attempts (`passed`).
//!
//! `LOCK_WAIT=pubsub` keeps the previous mechanism for comparison: every release is
//! published to every instance, which wakes one local waiter each, so a release costs one
//! attempt per instance. `LOCK_WAIT=spin` is the tutorial's fixed 20 ms retry.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use futures_util::StreamExt;
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, Client, RedisResult};
use tokio::sync::{Notify, oneshot};
use tokio::time::{Instant, sleep, sleep_until, timeout};

use super::handoff::{self, Handed, Phase, Queued};
use super::{Attempt, Grant, LockError};
use crate::store::{Keys, Store};

/// How a sale waits for a lock held by someone else.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum WaitMode {
    /// Sleep until a release's signal wakes this waiter (one waiter per release across all
    /// instances, in turn) or the holder's lease runs out.
    Notify,
    /// The previous wake-up, for comparison: every release is published to every instance,
    /// and each wakes one of its waiters.
    Pubsub,
    /// Retry every 20 ms, as the tutorial does (for comparison).
    Spin,
}

/// The tutorial's retry interval.
const SPIN_INTERVAL: Duration = Duration::from_millis(20);

/// How long an instance with waiters blocks on the signal list before it suspects a lost
/// signal and lets its front waiter look for itself.
const STALL: Duration = Duration::from_millis(250);

/// How long a hand-off waiter's entry in the Redis queue stays valid without a refresh: a
/// release skips an entry past it, so a waiter that died holds up nobody for longer.
const ENTRY_LEASE: Duration = Duration::from_secs(1);

/// How often a hand-off waiter refreshes its entry (and looks at the lock itself: a lock
/// freed without a hand-off, by a lease running out or by a naive strategy's release, is
/// found within this).
const REFRESH: Duration = Duration::from_millis(250);

/// How long a listening connection (the signal popper's, a release subscription) outlives
/// the last wait that needed it: contention that pauses for a moment keeps it, an item
/// nobody waits for any more gives it back to Redis.
const LINGER: Duration = Duration::from_secs(1);

/// Bounds of how long a queued arrival waits for a signal before it tries anyway.
const MIN_YIELD: Duration = Duration::from_millis(2);
const MAX_YIELD: Duration = STALL;

pub struct Waiter {
    mode: WaitMode,
    /// Acquire attempts sent to Redis, successful or not: what a herd costs, and what the
    /// lock bench reports per critical section.
    attempts: AtomicU64,
    backend: Backend,
}

enum Backend {
    Spin,
    PubSub {
        releases: Arc<Notify>,
        /// The waits that need the subscription: it is made only while there are some.
        listeners: Arc<Listeners>,
        /// Dropped with the `Waiter`, it ends the subscription.
        _stop: oneshot::Sender<()>,
    },
    Queue(Arc<Queue>),
}

impl Waiter {
    /// Spawns what `mode` listens with; it stops once the returned `Waiter` is gone.
    ///
    /// Its connections are made from the store's client of the moment, so that after a
    /// Sentinel failover they reconnect to the new master, not the old one.
    pub fn listen(store: &Store, mode: WaitMode) -> Self {
        let keys = &store.keys;
        let backend = match mode {
            WaitMode::Spin => Backend::Spin,
            WaitMode::Pubsub => {
                let releases = Arc::new(Notify::new());
                let listeners = Arc::new(Listeners::default());
                let (stop, stopped) = oneshot::channel::<()>();
                let subscription = subscribe_while_waited(
                    store.clone(),
                    keys.released.clone(),
                    Arc::downgrade(&releases),
                    listeners.clone(),
                );
                // The subscription ends with its `Waiter`, not at the next message: an
                // item nobody sells any more publishes none, and would keep its
                // subscription (a connection) forever.
                tokio::spawn(async move {
                    tokio::select! {
                        () = subscription => {}
                        _ = stopped => {}
                    }
                });
                Backend::PubSub {
                    releases,
                    listeners,
                    _stop: stop,
                }
            }
            WaitMode::Notify => {
                let queue = Arc::new(Queue {
                    inbox: handoff::inbox_key(keys).into(),
                    ..Queue::default()
                });
                tokio::spawn(pop_signals(store.clone(), keys.clone(), queue.clone()));
                Backend::Queue(queue)
            }
        };
        Self {
            mode,
            attempts: AtomicU64::new(0),
            backend,
        }
    }

    /// This instance's inbox, where the releases hand it locks (`notify` only).
    pub fn inbox(&self) -> Option<Arc<str>> {
        match &self.backend {
            Backend::Queue(queue) => Some(queue.inbox.clone()),
            Backend::Spin | Backend::PubSub { .. } => None,
        }
    }

    pub fn attempts(&self) -> u64 {
        self.attempts.load(Ordering::Relaxed)
    }

    /// Nothing waits here and nothing is owed to Redis: no waiter, no signal to give back,
    /// no hand-off expected or to release. Dropping an idle `Waiter` loses nothing.
    pub fn is_idle(&self) -> bool {
        match &self.backend {
            Backend::Spin | Backend::PubSub { .. } => true,
            Backend::Queue(queue) => {
                !queue.has_waiters()
                    && queue.give_back.load(Ordering::Relaxed) == 0
                    && !queue.has_handoffs()
            }
        }
    }

    /// Repeats `attempt` until it acquires, the deadline passes, or Redis fails. Returns the
    /// fencing token of the acquisition, if any; or what `passed` gave, when it completed
    /// first: a hand-off waiter listens to it between its attempts (never during one, so an
    /// attempt that took the lock is never dropped), the other waits ignore it. A `nested` acquire (the holder entering
    /// again) tries at once: queueing behind the sales that wait for its own lock would only
    /// make it hold the lock longer. With `hands_off` (a strategy whose release can hand the
    /// lock over) and `LOCK_WAIT=notify`, `attempt` gets a [`Queued`]: the waiter queues in
    /// Redis and is handed the lock by the release ([`handoff`]); otherwise it gets `None`.
    pub async fn until_acquired<F, Fut, P>(
        &self,
        owner: &Arc<str>,
        deadline: Instant,
        nested: bool,
        hands_off: bool,
        mut attempt: F,
        passed: P,
    ) -> Result<Acquired<P::Output>, LockError>
    where
        F: FnMut(Option<Queued>) -> Fut,
        Fut: Future<Output = RedisResult<Attempt>>,
        P: Future,
    {
        match &self.backend {
            Backend::Queue(queue) if hands_off => {
                self.handed_over(queue, owner, deadline, attempt, passed)
                    .await
            }
            Backend::Queue(queue) => self
                .queued(queue, deadline, nested, || attempt(None))
                .await
                .map(Acquired::Granted),
            Backend::Spin | Backend::PubSub { .. } => self
                .retried(deadline, || attempt(None))
                .await
                .map(Acquired::Granted),
        }
    }

    /// The hand-off wait: attempt and queue in one step, then wait for the release to hand
    /// the lock over (it arrives owned), refreshing the entry every [`REFRESH`] and looking
    /// again when the holder's lease ends. At the deadline the waiter leaves the queue in the
    /// same step as a last attempt, so a hand-off that raced its departure is taken, never
    /// stranded.
    async fn handed_over<F, Fut, P>(
        &self,
        queue: &Queue,
        owner: &Arc<str>,
        deadline: Instant,
        mut attempt: F,
        passed: P,
    ) -> Result<Acquired<P::Output>, LockError>
    where
        F: FnMut(Option<Queued>) -> Fut,
        Fut: Future<Output = RedisResult<Attempt>>,
        P: Future,
    {
        tokio::pin!(passed);
        let started = Instant::now();
        // Registered before the first attempt: a hand-off may arrive before its reply.
        let mut registration = queue.expect_handoff(owner.clone());
        let mut phase = Phase::Try;
        loop {
            let now = Instant::now();
            if now >= deadline {
                phase = Phase::Leave;
            }
            let entry = ENTRY_LEASE.min(deadline.saturating_duration_since(now));
            let queued = Queued {
                phase,
                inbox: queue.inbox.clone(),
                entry_ms: (entry.as_millis() as u64).max(1),
            };
            self.attempts.fetch_add(1, Ordering::Relaxed);
            // A Redis error drops the registration as cancelled: a hand-off that still
            // arrives for it is released at once.
            let sent = Instant::now();
            let retry_in = match attempt(Some(queued)).await? {
                Attempt::Acquired {
                    fence,
                    behind,
                    fence_to,
                } => {
                    registration.finish();
                    return Ok(Acquired::Granted(Grant {
                        fence,
                        behind,
                        fence_to,
                        handed: false,
                        leased_from: sent,
                        tenure_mean: None,
                        next_waited: None,
                    }));
                }
                Attempt::Busy { retry_in } => retry_in,
            };
            if phase == Phase::Leave {
                registration.finish();
                return Err(LockError::Timeout {
                    waited: started.elapsed(),
                });
            }
            registration.queued();
            let now = Instant::now();
            let lease_end = retry_in.map_or(deadline, |r| now + r).min(deadline);
            let handed = tokio::select! {
                message = registration.wait_until(lease_end.min(now + REFRESH)) => message,
                // Dropping the registration unfinished marks this waiter as gone: a hand-off
                // that still reaches it in Redis is released at once.
                value = &mut passed => return Ok(Acquired::Passed(value)),
            };
            if let Some(message) = handed {
                let handed = Handed::parse(&message);
                return Ok(Acquired::Granted(Grant {
                    fence: handed.as_ref().and_then(Handed::fence),
                    behind: handed.as_ref().map(|h| h.behind),
                    fence_to: handed.as_ref().and_then(Handed::fence_to),
                    handed: true,
                    // The release wrote it for the entry this wait's first attempt made.
                    leased_from: started,
                    tenure_mean: handed.as_ref().and_then(|h| h.tenure_mean),
                    next_waited: handed.as_ref().and_then(|h| h.next_waited),
                }));
            }
            phase = Phase::Wait;
        }
    }

    async fn queued<F, Fut>(
        &self,
        queue: &Queue,
        deadline: Instant,
        nested: bool,
        mut attempt: F,
    ) -> Result<Grant, LockError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = RedisResult<Attempt>>,
    {
        let started = Instant::now();
        let mut signalled = false;
        let mut saw_busy = false;
        let mut queued_before = false;
        if !nested && queue.contended.load(Ordering::Relaxed) {
            let bound = (started + queue.yield_bound()).min(deadline);
            signalled = queue.register(false).wait_until(bound).await;
            queued_before = true;
        }
        loop {
            let lease_end = match self.attempt(&mut attempt, started, deadline).await? {
                Tried::Acquired(fence) => {
                    queue.learn(saw_busy || signalled, started.elapsed());
                    return Ok(fence);
                }
                Tried::Busy { lease_end } => lease_end,
            };
            saw_busy = true;
            // A sale that has waited already goes back to the front, ahead of newcomers.
            signalled = queue.register(queued_before).wait_until(lease_end).await;
            queued_before = true;
        }
    }

    /// One counted attempt: acquired, or busy until the holder's lease ends (or the
    /// deadline, whichever is first); busy at the deadline is a timeout.
    async fn attempt<F, Fut>(
        &self,
        attempt: &mut F,
        started: Instant,
        deadline: Instant,
    ) -> Result<Tried, LockError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = RedisResult<Attempt>>,
    {
        self.attempts.fetch_add(1, Ordering::Relaxed);
        let sent = Instant::now();
        let retry_in = match attempt().await? {
            Attempt::Acquired {
                fence,
                behind,
                fence_to,
            } => {
                return Ok(Tried::Acquired(Grant {
                    fence,
                    behind,
                    fence_to,
                    handed: false,
                    leased_from: sent,
                    tenure_mean: None,
                    next_waited: None,
                }));
            }
            Attempt::Busy { retry_in } => retry_in,
        };
        let now = Instant::now();
        if now >= deadline {
            return Err(LockError::Timeout {
                waited: now - started,
            });
        }
        let lease_end = retry_in.map_or(deadline, |r| (now + r).min(deadline));
        Ok(Tried::Busy { lease_end })
    }

    /// The pub/sub and spin waits: try, then sleep until a release is heard (or 20 ms pass).
    async fn retried<F, Fut>(&self, deadline: Instant, mut attempt: F) -> Result<Grant, LockError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = RedisResult<Attempt>>,
    {
        let started = Instant::now();
        // Held from the first busy attempt on: the subscription is made while some sale
        // waits (and says so when it is, waking the waits to look again).
        let mut listening = None;
        loop {
            let released = match &self.backend {
                Backend::PubSub { releases, .. } => Some(releases.notified()),
                _ => None,
            };
            tokio::pin!(released);
            if let Some(released) = released.as_mut().as_pin_mut() {
                // Registered before the attempt, so a release published in between counts.
                released.enable();
            }
            let lease_end = match self.attempt(&mut attempt, started, deadline).await? {
                Tried::Acquired(fence) => return Ok(fence),
                Tried::Busy { lease_end } => lease_end,
            };
            if let Backend::PubSub { listeners, .. } = &self.backend {
                listening.get_or_insert_with(|| listeners.enter());
            }
            let now = Instant::now();
            match released.as_pin_mut() {
                Some(released) if self.mode == WaitMode::Pubsub => {
                    tokio::select! {
                        () = released => {}
                        () = sleep_until(lease_end) => {}
                    }
                }
                _ => sleep_until(lease_end.min(now + SPIN_INTERVAL)).await,
            }
        }
    }
}

/// How a wait ended: the lock granted in Redis, or what the caller's other source gave.
pub enum Acquired<T> {
    Granted(Grant),
    Passed(T),
}

/// What one attempt found.
enum Tried {
    Acquired(Grant),
    Busy { lease_end: Instant },
}

impl Drop for Waiter {
    fn drop(&mut self) {
        if let Backend::Queue(queue) = &self.backend {
            queue.closed.store(true, Ordering::Relaxed);
            queue.wanted.notify_one();
        }
    }
}

/// This instance's waiters in arrival order, and what it learnt about contention.
#[derive(Default)]
struct Queue {
    /// A std mutex: no await happens while it is held.
    waiters: Mutex<VecDeque<oneshot::Sender<()>>>,
    /// Wakes the signal popper: a waiter arrived, or a signal must go back to Redis.
    wanted: Notify,
    /// Signals popped here that no local waiter took.
    give_back: AtomicU64,
    contended: AtomicBool,
    /// A moving average of acquisition times, in microseconds.
    typical_wait_us: AtomicU64,
    closed: AtomicBool,
    /// This instance's inbox: the list the releases push hand-offs onto.
    inbox: Arc<str>,
    /// Hand-off waiters by owner.
    handoffs: Mutex<HashMap<Arc<str>, Slot>>,
    /// Hand-off messages for waiters that are gone: their locks are released at once.
    orphans: Mutex<Vec<String>>,
}

/// A hand-off waiter, as the signal popper sees it.
enum Slot {
    /// Its first attempt is under way: if it queues, it says so ([`Handoff::queued`]), and
    /// only then does the popper listen for it (most acquisitions never wait, and listening
    /// takes a connection).
    Trying(oneshot::Sender<String>),
    Waiting(oneshot::Sender<String>),
    /// Its sale was cancelled while queued; its entry in Redis lives on until it expires,
    /// and a hand-off that still arrives for it is released.
    Cancelled(Instant),
}

impl Queue {
    fn register(self: &Queue, front: bool) -> Registration<'_> {
        let (tx, rx) = oneshot::channel();
        if let Ok(mut waiters) = self.waiters.lock() {
            if front {
                waiters.push_front(tx);
            } else {
                waiters.push_back(tx);
            }
        }
        self.wanted.notify_one();
        Registration {
            queue: self,
            rx: Some(rx),
        }
    }

    fn expect_handoff(&self, owner: Arc<str>) -> Handoff<'_> {
        let (tx, rx) = oneshot::channel();
        if let Ok(mut handoffs) = self.handoffs.lock() {
            handoffs.insert(owner.clone(), Slot::Trying(tx));
        }
        // The popper is woken only once the waiter has queued (most acquisitions never
        // wait): a hand-off that arrives before that lies in the inbox until it listens.
        Handoff {
            queue: self,
            owner,
            rx: Some(rx),
            done: false,
        }
    }

    /// Whether the inbox must be listened to: a waiter expects a hand-off, a cancelled one
    /// may still get one, or a lock handed to a gone waiter awaits its release.
    fn has_handoffs(&self) -> bool {
        let pending = self.orphans.lock().map(|o| !o.is_empty()).unwrap_or(false);
        let now = Instant::now();
        let expecting = self
            .handoffs
            .lock()
            .map(|mut h| {
                h.retain(|_, slot| match slot {
                    Slot::Trying(_) | Slot::Waiting(_) => true,
                    // Its entry expired in Redis: no release hands it anything any more.
                    Slot::Cancelled(at) => now < *at + ENTRY_LEASE + Duration::from_secs(1),
                });
                h.values().any(|slot| !matches!(slot, Slot::Trying(_)))
            })
            .unwrap_or(false);
        pending || expecting
    }

    /// Gives a hand-off to its waiter; returns the message when the waiter is gone and the
    /// lock must be released. A message for an owner not expected here is stale (the waiter
    /// took the lock with its own attempt) and is dropped.
    fn deliver(&self, message: String) -> Option<String> {
        let owner = Handed::parse(&message)?.owner;
        let slot = self.handoffs.lock().ok()?.remove(owner)?;
        match slot {
            Slot::Trying(tx) | Slot::Waiting(tx) => tx.send(message).err(),
            Slot::Cancelled(_) => Some(message),
        }
    }

    fn has_waiters(&self) -> bool {
        self.waiters
            .lock()
            .map(|mut w| {
                w.retain(|tx| !tx.is_closed());
                !w.is_empty()
            })
            .unwrap_or(false)
    }

    /// Hands a signal to the first waiter still waiting; false when there is none.
    fn hand_out(&self) -> bool {
        let Ok(mut waiters) = self.waiters.lock() else {
            return false;
        };
        while let Some(tx) = waiters.pop_front() {
            if tx.send(()).is_ok() {
                return true;
            }
        }
        false
    }

    /// A signal nobody here can use goes back to Redis, for the next instance.
    fn pass_on(&self) {
        if !self.hand_out() {
            self.give_back.fetch_add(1, Ordering::Relaxed);
            self.wanted.notify_one();
        }
    }

    fn wake_all(&self) {
        while self.hand_out() {}
    }

    fn learn(&self, contended: bool, waited: Duration) {
        self.contended.store(contended, Ordering::Relaxed);
        let sample = waited.as_micros().min(u128::from(u32::MAX)) as u64;
        let old = self.typical_wait_us.load(Ordering::Relaxed);
        let new = if old == 0 {
            sample
        } else {
            (old * 7 + sample) / 8
        };
        self.typical_wait_us.store(new, Ordering::Relaxed);
    }

    fn yield_bound(&self) -> Duration {
        let typical = Duration::from_micros(self.typical_wait_us.load(Ordering::Relaxed));
        (typical * 4).clamp(MIN_YIELD, MAX_YIELD)
    }
}

/// One wait in the queue. Dropped with a signal it did not use (its sale was cancelled
/// between the wake-up and the attempt), it passes the signal on.
struct Registration<'a> {
    queue: &'a Queue,
    rx: Option<oneshot::Receiver<()>>,
}

impl Registration<'_> {
    /// True when woken by a signal; false when `until` came first (or the popper stopped).
    async fn wait_until(mut self, until: Instant) -> bool {
        let Some(rx) = self.rx.as_mut() else {
            return false;
        };
        let woken = tokio::select! {
            r = rx => r.is_ok(),
            () = sleep_until(until) => false,
        };
        if woken {
            // Consumed: the attempt that follows is its use.
            self.rx = None;
        }
        woken
    }
}

/// One hand-off waiter. Dropped without [`Handoff::finish`] (its sale was cancelled, or
/// Redis failed), it is marked cancelled, and a hand-off it received or still receives is
/// released by the signal popper.
struct Handoff<'a> {
    queue: &'a Queue,
    owner: Arc<str>,
    rx: Option<oneshot::Receiver<String>>,
    done: bool,
}

impl Handoff<'_> {
    /// The hand-off message, when the lock was handed over before `until`.
    async fn wait_until(&mut self, until: Instant) -> Option<String> {
        let Some(rx) = self.rx.as_mut() else {
            sleep_until(until).await;
            return None;
        };
        tokio::select! {
            r = rx => match r {
                Ok(message) => {
                    self.done = true;
                    Some(message)
                }
                // The popper stopped: the refreshes still find the lock.
                Err(_) => {
                    self.rx = None;
                    None
                }
            },
            () = sleep_until(until) => None,
        }
    }

    /// Its attempt queued it in Redis: from now on the popper listens for its hand-off.
    fn queued(&self) {
        if let Ok(mut handoffs) = self.queue.handoffs.lock() {
            let slot = match handoffs.remove(&self.owner) {
                Some(Slot::Trying(tx)) => Some(Slot::Waiting(tx)),
                other => other,
            };
            if let Some(slot) = slot {
                handoffs.insert(self.owner.clone(), slot);
            }
        }
        self.queue.wanted.notify_one();
    }

    /// The wait ended by an attempt (acquired, or left the queue): a message that arrived
    /// meanwhile is the same hand-off, already taken by that attempt.
    fn finish(&mut self) {
        self.done = true;
        if let Ok(mut handoffs) = self.queue.handoffs.lock() {
            handoffs.remove(&self.owner);
        }
    }
}

impl Drop for Handoff<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        if let Ok(mut handoffs) = self.queue.handoffs.lock() {
            handoffs.insert(self.owner.clone(), Slot::Cancelled(Instant::now()));
        }
        if let Some(mut rx) = self.rx.take() {
            rx.close();
            if let Ok(message) = rx.try_recv()
                && let Ok(mut orphans) = self.queue.orphans.lock()
            {
                orphans.push(message);
            }
        }
        self.queue.wanted.notify_one();
    }
}

impl Drop for Registration<'_> {
    fn drop(&mut self) {
        if let Some(mut rx) = self.rx.take() {
            rx.close();
            if rx.try_recv().is_ok() {
                self.queue.pass_on();
            }
        }
    }
}

/// Keeps one connection blocked on the signal list while this instance has waiters, and
/// hands each popped signal to the front waiter.
async fn pop_signals(store: Store, keys: Keys, queue: Arc<Queue>) {
    let mut backoff = Duration::from_millis(50);
    let mut conn: Option<MultiplexedConnection> = None;
    let mut moves = store.master_moves();
    while !queue.closed.load(Ordering::Relaxed) {
        // Idle until someone waits: an instance without waiters must not take signals. Its
        // connection is closed once nobody has waited for [`LINGER`]: one connection per item
        // ever waited for, kept until the item's machinery was dropped, let one client
        // selling 10,000 items in a few seconds take every connection Redis allows (found
        // from outside). Now an item holds one only while its sales wait.
        loop {
            let wanted = queue.wanted.notified();
            tokio::pin!(wanted);
            wanted.as_mut().enable();
            if queue.closed.load(Ordering::Relaxed) {
                return;
            }
            if queue.has_waiters()
                || queue.give_back.load(Ordering::Relaxed) > 0
                || queue.has_handoffs()
            {
                break;
            }
            if conn.is_some() {
                tokio::select! {
                    () = wanted => {}
                    () = sleep(LINGER) => conn = None,
                }
            } else {
                wanted.await;
            }
        }
        if conn.is_none() {
            // Seen before the client is taken: a move after it reconnects once more.
            moves.borrow_and_update();
        }
        let connected = match conn.as_mut() {
            Some(connected) => connected,
            None => match blocking_connection(&store).await {
                Ok(fresh) => {
                    // Signals pushed while nobody here listened may be gone with a
                    // restarted Redis: every local waiter looks for itself once.
                    queue.wake_all();
                    conn.insert(fresh)
                }
                Err(e) => {
                    tracing::debug!(error = %e, "cannot connect for lock signals yet");
                    queue.wake_all();
                    sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                    continue;
                }
            },
        };
        let served = Instant::now();
        if let Err(e) = serve(connected, &keys, &queue, &mut moves).await {
            tracing::warn!(error = %e, "lock signal connection lost; reconnecting");
            // On a cluster a `MOVED` here means the item's slot has another master now: the
            // next connection goes to the one the cluster names. An `ASK` (the slot half
            // migrated) lasts until the move is finished: the waiters fall back on their
            // own bounds meanwhile, and the popper does not spin on it.
            store.after_error(&e);
            conn = None;
            if served.elapsed() > Duration::from_secs(1) {
                backoff = Duration::from_millis(50);
            }
            queue.wake_all();
            sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(1));
        }
    }
}

async fn serve(
    conn: &mut MultiplexedConnection,
    keys: &Keys,
    queue: &Queue,
    moves: &mut tokio::sync::watch::Receiver<u64>,
) -> RedisResult<()> {
    let key = keys.signal.as_str();
    loop {
        if queue.closed.load(Ordering::Relaxed) {
            return Ok(());
        }
        let back = queue.give_back.swap(0, Ordering::Relaxed);
        if back > 0 {
            // At the head, where it was: the next blocked instance gets it at once.
            redis::cmd("LPUSH")
                .arg(key)
                .arg("passed-on")
                .query_async::<()>(conn)
                .await?;
        }
        let orphans = queue
            .orphans
            .lock()
            .map(|mut o| std::mem::take(&mut *o))
            .unwrap_or_default();
        for message in orphans {
            if let Some(handed) = Handed::parse(&message) {
                tracing::debug!(
                    owner = handed.owner,
                    "releasing a lock handed to a waiter that gave up"
                );
                handoff::release_orphan(conn, keys, &handed).await?;
            }
        }
        let signals = queue.has_waiters();
        if !signals && !queue.has_handoffs() {
            return Ok(());
        }
        // The inbox first: a hand-off is a lock already taken for a waiter here.
        let mut blpop = redis::cmd("BLPOP");
        blpop.arg(&*queue.inbox);
        if signals {
            blpop.arg(key);
        }
        blpop.arg(STALL.as_secs_f64());
        let popped = tokio::select! {
            popped = timeout(
                STALL + Duration::from_secs(2),
                blpop.query_async::<Option<(String, String)>>(conn),
            ) => popped.map_err(|_| {
                redis::RedisError::from(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "BLPOP outlived its own timeout",
                ))
            })??,
            () = master_moved(moves) => return Err(redis::RedisError::from(std::io::Error::other(
                "Sentinel named a new master: the releases happen there now",
            ))),
        };
        match popped {
            Some((list, message)) if *list == *queue.inbox => {
                if let Some(orphan) = queue.deliver(message)
                    && let Ok(mut orphans) = queue.orphans.lock()
                {
                    orphans.push(orphan);
                }
            }
            Some(_) => queue.pass_on(),
            // No release for a while: a signal may have died with its popper.
            None => {
                queue.hand_out();
            }
        }
    }
}

/// Once the store follows Sentinel to another master; never for a fixed server or a cluster
/// (where the old master of a slot answers `MOVED`).
async fn master_moved(moves: &mut tokio::sync::watch::Receiver<u64>) {
    if moves.changed().await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// Its own connection: a blocked `BLPOP` holds up every command queued behind it. On a
/// cluster, to the master of the item's slot, asked of the cluster at each (re)connection.
async fn blocking_connection(store: &Store) -> RedisResult<MultiplexedConnection> {
    let client = timeout(Duration::from_secs(2), store.client())
        .await
        .map_err(|_| {
            redis::RedisError::from(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "no master for the item's slot in time",
            ))
        })??;
    let config = AsyncConnectionConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(2)))
        .set_response_timeout(None);
    client
        .get_multiplexed_async_connection_with_config(&config)
        .await
}

/// The waits of one item that need its release subscription (`LOCK_WAIT=pubsub`).
#[derive(Default)]
struct Listeners {
    waiting: std::sync::atomic::AtomicUsize,
    wanted: Notify,
}

/// One wait that needs the subscription, until it is dropped.
struct Listening(Arc<Listeners>);

impl Listeners {
    fn enter(self: &Arc<Self>) -> Listening {
        self.waiting.fetch_add(1, Ordering::AcqRel);
        self.wanted.notify_one();
        Listening(self.clone())
    }

    fn waited(&self) -> bool {
        self.waiting.load(Ordering::Acquire) > 0
    }

    async fn until_waited(&self) {
        loop {
            let wanted = self.wanted.notified();
            tokio::pin!(wanted);
            wanted.as_mut().enable();
            if self.waited() {
                return;
            }
            wanted.await;
        }
    }

    /// Once nobody has waited at one look, [`LINGER`] after the previous.
    async fn until_unwaited(&self) {
        let mut look = tokio::time::interval(LINGER);
        look.tick().await;
        loop {
            look.tick().await;
            if !self.waited() {
                return;
            }
        }
    }
}

impl Drop for Listening {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The release subscription, made only while a sale of the item waits and dropped (its
/// connection closed) once none has for [`LINGER`]: one per item ever sold, kept until the
/// item's machinery was dropped, let one client selling 10,000 items take every connection
/// Redis allows (found from outside). A subscription made late misses nothing: it wakes
/// every wait once it is made.
async fn subscribe_while_waited(
    store: Store,
    channel: String,
    releases: Weak<Notify>,
    listeners: Arc<Listeners>,
) {
    loop {
        listeners.until_waited().await;
        tokio::select! {
            () = subscribe(store.clone(), channel.clone(), releases.clone()) => return,
            () = listeners.until_unwaited() => {}
        }
    }
}

/// Keeps one subscription alive for as long as anyone listens (`LOCK_WAIT=pubsub`).
async fn subscribe(store: Store, channel: String, releases: Weak<Notify>) {
    if store.is_cluster() {
        return subscribe_sharded(store, channel, releases).await;
    }
    let mut backoff = Duration::from_millis(50);
    let mut moves = store.master_moves();
    while releases.strong_count() > 0 {
        moves.borrow_and_update();
        let client = match store.client().await {
            Ok(client) => client,
            Err(e) => {
                tracing::debug!(error = %e, "no server for lock releases yet");
                sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
                continue;
            }
        };
        match tokio::time::timeout(Duration::from_secs(2), connect(&client, &channel)).await {
            Ok(Ok(pubsub)) => {
                backoff = Duration::from_millis(50);
                tracing::debug!(%channel, "listening for lock releases");
                let mut messages = pubsub.into_on_message();
                // Releases published while unsubscribed were missed: everyone retries.
                let mut wake: fn(&Notify) = Notify::notify_waiters;
                loop {
                    let Some(notify) = releases.upgrade() else {
                        return;
                    };
                    wake(&notify);
                    drop(notify);
                    let heard = tokio::select! {
                        message = messages.next() => message.is_some(),
                        () = master_moved(&mut moves) => {
                            tracing::info!(%channel, "Sentinel named a new master: subscribing there");
                            break;
                        }
                    };
                    if !heard {
                        tracing::warn!(%channel, "release subscription lost; waiters fall back to lease bounds");
                        break;
                    }
                    wake = Notify::notify_one;
                }
            }
            Ok(Err(e)) => tracing::debug!(error = %e, "cannot subscribe to lock releases yet"),
            Err(_) => tracing::debug!("subscribing to lock releases timed out"),
        }
        sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(1));
    }
}

/// How often a sharded subscription is sent again: `SSUBSCRIBE` is idempotent, and sent
/// through the cluster connection it reaches the slot's master of the moment, so a
/// subscription the crate did not move after a failover or a slot migration is restored
/// within this (meanwhile waiters fall back to their lease bounds).
const RESUBSCRIBE: Duration = Duration::from_secs(1);

/// The cluster's `LOCK_WAIT=pubsub`: sharded pub/sub (`SSUBSCRIBE`), so that a release
/// (`SPUBLISH` in the release script) reaches only the shard that owns the item's slot,
/// not every node of the cluster.
async fn subscribe_sharded(store: Store, channel: String, releases: Weak<Notify>) {
    let (tx, mut pushed) = tokio::sync::mpsc::unbounded_channel();
    let mut conn = match store.cluster_subscriber(tx) {
        Some(Ok(conn)) => conn,
        Some(Err(e)) => {
            tracing::warn!(error = %e, "cannot subscribe to lock releases; waiters fall back to lease bounds");
            return;
        }
        None => return,
    };
    let mut subscribed = false;
    let mut resubscribe = tokio::time::interval(RESUBSCRIBE);
    resubscribe.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = resubscribe.tick() => {
                let sent = tokio::time::timeout(
                    Duration::from_secs(2),
                    conn.ssubscribe(&channel),
                ).await;
                match sent {
                    Ok(Ok(())) => {
                        if !subscribed {
                            tracing::debug!(%channel, "listening for lock releases (sharded)");
                            // Releases published while unsubscribed were missed.
                            if let Some(notify) = releases.upgrade() {
                                notify.notify_waiters();
                            }
                        }
                        subscribed = true;
                    }
                    Ok(Err(e)) => {
                        subscribed = false;
                        tracing::debug!(error = %e, "cannot subscribe to lock releases yet");
                    }
                    Err(_) => {
                        subscribed = false;
                        tracing::debug!("subscribing to lock releases timed out");
                    }
                }
            }
            push = pushed.recv() => {
                let Some(push) = push else { return };
                let Some(notify) = releases.upgrade() else { return };
                match push.kind {
                    redis::PushKind::SMessage | redis::PushKind::Message => notify.notify_one(),
                    // The node gave the slot up (a migration) or the crate subscribed again
                    // elsewhere: anything published in between was missed.
                    redis::PushKind::SUnsubscribe | redis::PushKind::SSubscribe => {
                        notify.notify_waiters();
                    }
                    _ => {}
                }
            }
        }
        if releases.strong_count() == 0 {
            return;
        }
    }
}

async fn connect(client: &Client, channel: &str) -> RedisResult<redis::aio::PubSub> {
    let mut pubsub = client.get_async_pubsub().await?;
    pubsub.subscribe(channel).await?;
    Ok(pubsub)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_signal_goes_to_the_longest_waiter_and_a_rewaiter_keeps_its_place() {
        let queue = Queue::default();
        let first = queue.register(false);
        let second = queue.register(false);
        assert!(queue.hand_out());
        let far = Instant::now() + Duration::from_secs(3600);
        assert!(first.wait_until(far).await);
        let again = queue.register(true);
        assert!(queue.hand_out());
        assert!(again.wait_until(far).await);
        assert!(queue.hand_out());
        assert!(second.wait_until(far).await);
        assert!(!queue.hand_out());
    }

    #[tokio::test]
    async fn a_signal_left_by_a_cancelled_waiter_is_passed_on_or_given_back() {
        let queue = Queue::default();
        let cancelled = queue.register(false);
        let next = queue.register(false);
        assert!(queue.hand_out());
        drop(cancelled);
        let far = Instant::now() + Duration::from_secs(3600);
        assert!(
            next.wait_until(far).await,
            "the signal went on to the next waiter"
        );
        let last = queue.register(false);
        assert!(queue.hand_out());
        drop(last);
        assert_eq!(queue.give_back.load(Ordering::Relaxed), 1, "back to Redis");
    }

    #[test]
    fn waiters_that_gave_up_do_not_count() {
        let queue = Queue::default();
        let gone = queue.register(false);
        assert!(queue.has_waiters());
        drop(gone);
        assert!(!queue.has_waiters());
    }

    #[test]
    fn a_queued_arrival_waits_about_four_times_the_recent_acquisition_time() {
        let queue = Queue::default();
        assert_eq!(queue.yield_bound(), MIN_YIELD);
        queue.learn(true, Duration::from_millis(10));
        assert_eq!(queue.yield_bound(), Duration::from_millis(40));
        queue.learn(true, Duration::from_secs(60));
        assert_eq!(queue.yield_bound(), MAX_YIELD);
    }
}

//! Lock cohorting (`LOCK_WAIT=notify`, the strategies whose release hands the lock over:
//! `lua-release`, `reentrant`, `watchdog`, `fenced`): a lock this instance took from Redis
//! passes from one of its sales to the next without a round trip, for a short tenure, and
//! only then goes back to Redis, where the release hands it to the next instance in line.
//!
//! Why: a fair lock that changes process at every critical section pays, per critical
//! section, the release, the wake-up of another process and its acquire. Within a tenure a
//! critical section costs only its own reads and writes. Fairness moves from one critical
//! section to one tenure: instances still take turns in the Redis queue's arrival order,
//! each for at most [`QUANTUM`] (plus the critical section running when it ends), so a waiter
//! behind N instances waits about N tenures, and a tenure ends early rather than keep the
//! next in line waiting past [`LONGEST_WAIT`]. While other instances wait, a tenure also
//! begins at most a fifth more critical sections than tenures get through on average, a
//! mean the release passes on to the next holder with the lock ([`next_mean`]), so that
//! instances share the lock by critical sections as well as by time.
//!
//! What stays true:
//! - The Redis lock never changes while it is passed: it stays written under the owner id of
//!   the sale that took it, with that sale's lease and renewal, and a tenure ends (a real
//!   release) as soon as its quantum is used, its renewal found the lock lost, or nobody here
//!   wants it.
//! - A lease is never stretched: a sale gets a passed lock only within the quantum of its
//!   acquisition, and while at least half the lease is left however long that acquisition
//!   waited in the queue (the lease began somewhere in that wait). A lock that nothing renews
//!   (lua-release, reentrant), whose sales count on a whole lease for their work, is made
//!   whole again (an owner-checked extension) before it is passed with less than 99% of its
//!   lease left (`Locks::take_passed`).
//! - Every sale gets its own fencing token: a tenure draws a block of tokens in one round
//!   trip at its first pass and gives them out in order; the next holder's token is drawn
//!   above the block. Tokens may jump by what a tenure left unused.
//! - A sale that arrives while a sale here holds the lock waits here, not in Redis, and only
//!   for the rest of the tenure: when the tenure ends it goes to Redis and queues behind
//!   the other instances.
//! - One sale per instance stands in the Redis queue for a strategy's lock: a sale arriving
//!   while one of its instance's sales is queued there waits here behind it, and takes the
//!   lock that sale's tenure passes on. Redis then sees an instance, not each of its sales:
//!   no enqueue and no leave per sale. A waiter behind a sale that left the queue without
//!   the lock (its deadline, its request gone) goes to Redis itself, at once when that sale
//!   gave up and within [`BEHIND_RECHECK`] when it was cancelled.
//! - A holder that will pass the tenure to a waiting sale sends that sale's stock read
//!   behind its own write, in one pipeline ([`Prefetched`]): Redis runs the read after the
//!   write with the lock held throughout, so nothing the read could miss happens between.
//!   The read belongs to the next holder under its token only; a tenure parked or ended
//!   drops it, and the write's checks (fence, resets, other writers) are those of any sale.
//!
//! What it costs: a sale arriving at another instance waits for a whole tenure, not one
//! critical section; and a lock nobody here wants is kept one scheduler turn before its
//! release (the turn in which the releasing task's own next sale, if any, takes it).

use std::collections::VecDeque;
use std::num::NonZeroU16;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::Instant;

use super::RedisLock;
use super::renewal::Renewal;
use crate::store::StockRead;

/// The longest tenure (`LOCK_TENURE_MS`'s default, 5), counted from the acquisition in Redis:
/// short against any lease, long against one critical section (a few round trips on a
/// local network).
pub(super) const QUANTUM: Duration = Duration::from_millis(5);

/// What the tenures of every instance in line add up to at least: a tenure that begins with
/// N other instances waiting lasts the round divided by N + 1 (within [`MIN_QUANTUM`] and
/// the longest tenure), so the last of them waits about a round plus N hand-offs, however
/// many there are. Instances, not sales: an instance's own waiters are served within its
/// tenure. 45 ms leaves half of a 100 ms wait for the hand-offs and for a holder the
/// scheduler paused. Never shortened below this when turns come late: at 64 instances on a
/// loaded machine the hand-offs, not the tenures, make the round long (without tenures at
/// all its p99 was 84 ms), and tenures shortened whenever a turn came late (down to a
/// quarter of a millisecond) bought hardly a shorter wait but more hand-offs, which loaded
/// the machine further: half the throughput, below rslock's, for the same longest acquire.
const ROUND: Duration = Duration::from_millis(45);

/// The wait in the Redis queue the round grows towards while turns come sooner: the round
/// lengthens while the waits measured stay under this, and shrinks back (never below
/// [`ROUND`]) as soon as one goes over. Why grow at all: each hand-off costs far more than a
/// critical section on a machine whose idle cores sleep (waking a process on another core
/// took 70 µs per round trip here, against 10 on the core Redis runs on, and a new holder
/// runs on the other core for its first few), so every millisecond the round can spare
/// without a wait going long is worth more tenure, not more hand-offs. Measured at 64
/// instances: the fixed 45 ms round waited 60-65 ms (p99) with hand-offs costing a third of
/// the time; a 60 ms one sold 44% more with its longest acquire near 100 ms.
const TARGET_WAIT: Duration = Duration::from_millis(80);

/// A tenure shorter than this would end before its second critical section.
const MIN_QUANTUM: Duration = Duration::from_micros(500);

/// The longest a tenure keeps the next in line waiting, counted from that one's arrival in
/// the Redis queue: a tenure that begins when the next one has waited nearly this long is cut
/// short, to its first critical section if need be ([`within_next_wait`]).
///
/// Why, beside the round: the round is sized from waits measured a round late, by each
/// instance for itself, so when hand-offs slow down all at once (a machine whose other
/// tenants wake up) every tenure of that round is still long, and the waits of its end ran
/// 20-30 ms past the target (up to 122 ms at 64 instances, with a p99 of 88). The release
/// reads how long the next one has waited in the same step that hands the lock over
/// (`hand_off.lua`), so each tenure sees the lateness of the turn it delays. Above
/// [`TARGET_WAIT`], so that it cuts only the turns the round let run long, and never the
/// tenures the round has sized.
const LONGEST_WAIT: Duration = Duration::from_millis(90);

/// What the next in line waits besides this tenure: its release, and its own wake-up.
const HAND_OFF_ALLOWANCE: Duration = Duration::from_millis(2);

/// A tenure's `quantum` when the next in line has waited `next_waited` already: no longer
/// than leaves that wait within [`LONGEST_WAIT`] (zero: the first critical section only).
pub(super) fn within_next_wait(quantum: Duration, next_waited: Option<Duration>) -> Duration {
    match next_waited {
        Some(waited) => {
            quantum.min(LONGEST_WAIT.saturating_sub(waited.saturating_add(HAND_OFF_ALLOWANCE)))
        }
        None => quantum,
    }
}

/// How long a tenure lasts that began with `behind` other instances waiting (unknown: as
/// if none), for a round of `round`.
pub(super) fn quantum(round: Duration, longest: Duration, behind: Option<u64>) -> Duration {
    let share = u32::try_from(behind.unwrap_or(0).saturating_add(1)).unwrap_or(u32::MAX);
    (round / share).max(MIN_QUANTUM).min(longest)
}

/// The round after a tenure began whose sale waited `waited` in the Redis queue behind
/// others: cut in proportion at once when the wait went over [`TARGET_WAIT`] (a wait is
/// the sum of the tenures before it, so this brings the next round back under), grown by
/// an eighth of the room left when it came sooner (a step of the kind that converges
/// without overshoot: every instance grows at once, and the waits grow N times as fast).
pub(super) fn next_round(round: Duration, waited: Duration) -> Duration {
    let next = if waited > TARGET_WAIT {
        round.mul_f64(TARGET_WAIT.as_secs_f64() / waited.as_secs_f64())
    } else {
        round + (TARGET_WAIT - waited) / 8
    };
    next.clamp(ROUND, TARGET_WAIT)
}

/// How many critical sections a tenure may begin while other instances wait, in percent
/// of the mean that tenures get through in their quanta ([`next_mean`]).
///
/// Why a number as well as a time: what a tenure gets through in its quantum varies several
/// times over (a holder on the core Redis runs on does a round trip in a seventh of the time
/// of one on the other core, and which core a woken process gets is the kernel's): at 64
/// instances a tenure began 15 critical sections on average with a spread of 9, so over a
/// run one instance sold 0.65-0.7 of what another did. Capping the lucky tenures takes the
/// top off that spread while the quantum still bounds the others; the cap costs what those
/// tenures would have sold beyond it, in critical sections that are the cheapest there are.
/// In alternating 5 s runs at 64 instances the instance served least had 0.81-0.84 of the
/// critical sections of the one served most at 120%, 0.68-0.75 at 150%, and 0.70-0.74
/// uncapped (8 s runs), throughput within the noise between runs.
const CAP_PERCENT: u64 = 120;

/// The mean number of critical sections tenures get through (in 256ths), after a tenure
/// that began with the mean `mean` (none: the first here) got through `passes`, `capped`
/// when its cap ([`CAP_PERCENT`]) ended it: it counts one more, so the mean follows what
/// the quantum would allow. A running mean over about sixteen tenures.
///
/// Why it travels with the lock, from holder to holder in the hand-off: an instance that
/// kept a number of its own from its own tenures drifted away from the others (a smaller
/// number meant more of its critical sections were the slow first ones, so a smaller number
/// still), and over a run one instance sold half of what another did. One number passed on
/// cannot drift apart.
pub(super) fn next_mean(mean: Option<u32>, passes: u32, capped: bool) -> u32 {
    let got = u64::from(passes.saturating_add(u32::from(capped))) * 256;
    let next = match mean {
        Some(mean) => {
            let mean = u64::from(mean);
            (mean * 15 + got) / 16
        }
        None => got,
    };
    u32::try_from(next.max(2 * 256)).unwrap_or(u32::MAX)
}

/// How long past the quantum a sale waits here for the holder's critical section to end.
/// A holder that is slower than that (long work, or a guard dropped without a release)
/// will release in Redis anyway: the waiter queues there instead of waiting for nothing.
const WAIT_SLACK: Duration = Duration::from_millis(10);

/// How often a sale waiting behind its instance's sale in the Redis queue looks whether that
/// sale still stands there: only a cancelled one leaves without saying so.
const BEHIND_RECHECK: Duration = Duration::from_millis(50);

/// Fencing tokens drawn at once for the passes of one tenure.
pub(super) const TOKEN_BLOCK: u64 = 16;

/// The Redis lock as this instance holds it across the sales it passes through.
pub(super) struct Tenure {
    pub lock: RedisLock,
    /// The owner id the lock is written under in Redis: the sale that took it.
    pub owner: Arc<str>,
    /// When the acquire that began the tenure was sent: the lease began after it.
    pub since: Instant,
    /// When that acquire returned: the quantum counts from here, as a wait in the Redis
    /// queue is no tenure.
    pub acquired: Instant,
    pub quantum: Duration,
    /// The lease the lock was taken with (renewals aside).
    pub lease: Duration,
    pub renewal: Option<Renewal>,
    /// Fencing tokens drawn ahead and not given out yet, `next..=last`.
    pub tokens: Option<(u64, u64)>,
    /// The next holder's read, sent behind the last holder's write.
    pub prefetched: Option<Prefetched>,
    /// The extension of the short lease of a lock a release handed over; every sale of the
    /// tenure writes only once it said yes.
    pub handed: Option<Arc<super::handoff::HandedLease>>,
    /// Critical sections begun in this tenure, the first included (saturating: a tenure is
    /// a few milliseconds).
    pub passes: u16,
    /// How many it may begin while other instances wait ([`CAP_PERCENT`]); none: as many as
    /// its quantum holds.
    pub cap: Option<NonZeroU16>,
}

/// A stock read done for the next sale of a tenure, by the sale before it: sent on the same
/// connection right behind that sale's write, so Redis ran it after the write, with the lock
/// held throughout. Good only for the sale passed the tenure next, under that token.
pub(crate) struct Prefetched {
    pub fence: Option<u64>,
    pub read: StockRead,
}

impl Tenure {
    /// Within its number of critical sections and its quantum, with at least half the lease
    /// left however long the acquire waited, and not found lost by a renewal.
    pub fn can_pass(&self) -> bool {
        self.cap.is_none_or(|cap| self.passes < cap.get())
            && self.acquired.elapsed() < self.quantum
            && self.since.elapsed() < self.lease / 2
            && !self.renewal.as_ref().is_some_and(Renewal::is_lost)
            && !self.handed.as_ref().is_some_and(|h| h.is_lost())
    }

    /// The token the next pass gives out, if one is drawn ahead.
    pub fn next_token(&self) -> Option<u64> {
        self.tokens.map(|(next, _)| next)
    }

    /// The next token drawn ahead, if any is left.
    pub fn take_token(&mut self) -> Option<u64> {
        let (next, last) = self.tokens?;
        self.tokens = (next < last).then_some((next + 1, last));
        Some(next)
    }
}

/// What a sale that wants the lock finds here.
pub(super) enum Joined {
    /// A tenure parked by the sale before: it is this sale's now.
    Taken(Tenure),
    /// A sale here holds it within its quantum: wait for it to be passed, until `until` at
    /// most (a closed channel means the tenure ended: go to Redis).
    Wait { passed: Passing, until: Instant },
    /// A sale here stands in the Redis queue for it: wait for the tenure it will pass on,
    /// until `until` at most, then join again (a closed channel: join again at once).
    Behind { passed: Passing, until: Instant },
    /// Not held here, or its quantum is used: ask Redis. The sale stands in the Redis queue
    /// for this instance from here on (registered in the same step as the look, so that two
    /// sales arriving together do not both go), and takes a tenure passed meanwhile.
    Redis(Passing),
}

/// What a releasing sale did with its tenure.
pub(super) enum Passed {
    /// Given to a sale waiting here.
    ToWaiter,
    /// Nobody waits: kept for a scheduler turn, in case this instance's next sale comes at
    /// once; [`Cohort::unpark`] with this number ends it otherwise.
    Parked(u64),
    /// The tenure is over: release it in Redis.
    Over(Tenure),
}

/// Where a waiting sale receives a passed tenure. A tenure must never be dropped with it (its
/// Redis lock would then stay held, by nobody, for its lease): [`Passing::close`] takes back
/// one that arrived too late for its sale, to be passed on or released.
pub(super) struct Passing(Option<oneshot::Receiver<Tenure>>);

impl Passing {
    /// The tenure, once passed; pending forever if the cohort will never pass one (its
    /// tenure ended, for a sale waiting here: the caller's bound then ends the wait).
    pub async fn passed(&mut self) -> Option<Tenure> {
        let rx = self.0.as_mut()?;
        match rx.await {
            Ok(tenure) => {
                self.0 = None;
                Some(tenure)
            }
            Err(_) => {
                self.0 = None;
                None
            }
        }
    }

    /// Stops receiving; a tenure that was passed meanwhile is returned.
    pub fn close(&mut self) -> Option<Tenure> {
        let mut rx = self.0.take()?;
        rx.close();
        rx.try_recv().ok()
    }
}

impl Drop for Passing {
    fn drop(&mut self) {
        if let Some(tenure) = self.close() {
            // Only reachable when a caller dropped a `Passing` without closing it, which
            // the lock code never does; the renewal stops, and the lease frees the lock.
            tracing::warn!(owner = %tenure.owner, "a passed lock was dropped unreleased; its lease will free it");
        }
    }
}

#[derive(Default)]
pub(super) struct Cohort {
    state: Mutex<State>,
    /// The mean critical sections per tenure, in 256ths (0: none yet), shared with the releases that
    /// pass the number on with the lock.
    mean: Arc<AtomicU32>,
}

#[derive(Default)]
struct State {
    /// A sale here holds the lock, or it is parked for the next one.
    held: bool,
    /// Which strategy's lock the tenure is: a sale of another strategy on the same item
    /// never takes it (its lock has another shape, and maybe no fencing token).
    lock: Option<RedisLock>,
    /// When the tenure being held began, to tell arrivals whether waiting here pays.
    since: Option<Instant>,
    quantum: Duration,
    /// What the tenures in line add up to ([`next_round`]); zero until a wait is measured,
    /// read as [`ROUND`].
    round: Duration,
    parked: Option<(Tenure, u64)>,
    parks: u64,
    /// Sales that arrived during the tenure, or behind a sale in the Redis queue, and wait
    /// here, by strategy, in the order they arrived (a sale that joins again keeps its place).
    waiters: VecDeque<(RedisLock, Instant, oneshot::Sender<Tenure>)>,
    /// Sales of this instance queued in Redis, by strategy, that take a passed lock too
    /// (they have waited longer than `waiters`, so they come first). They stay through
    /// the end of a tenure: they are in the Redis queue already.
    queued: VecDeque<(RedisLock, oneshot::Sender<Tenure>)>,
}

impl State {
    /// Registers a sale waiting here for a tenure of `lock`.
    fn wait(&mut self, lock: RedisLock, arrived: Instant) -> Passing {
        let (tx, rx) = oneshot::channel();
        self.waiters.retain(|(_, _, w)| !w.is_closed());
        let at = self
            .waiters
            .iter()
            .position(|(_, t, _)| *t > arrived)
            .unwrap_or(self.waiters.len());
        self.waiters.insert(at, (lock, arrived, tx));
        Passing(Some(rx))
    }

    /// A sale of `lock`'s strategy queued in Redis takes a lock passed here too (it then
    /// leaves the Redis queue as a cancelled waiter does).
    fn stand(&mut self, lock: RedisLock) -> Passing {
        let (tx, rx) = oneshot::channel();
        self.queued.retain(|(_, w)| !w.is_closed());
        self.queued.push_back((lock, tx));
        Passing(Some(rx))
    }

    /// Whether a live sale of this instance stands in the Redis queue for `lock`.
    fn standing(&mut self, lock: RedisLock) -> bool {
        self.queued.retain(|(_, w)| !w.is_closed());
        self.queued.iter().any(|(l, _)| *l == lock)
    }

    /// The sale of `lock` that has waited here longest joins again (its channel closes):
    /// with nobody of this instance in the Redis queue, it goes there, and the others keep
    /// their places behind it.
    fn wake_first(&mut self, lock: RedisLock) {
        self.waiters.retain(|(_, _, w)| !w.is_closed());
        if let Some(i) = self.waiters.iter().position(|(l, _, _)| *l == lock) {
            self.waiters.remove(i);
        }
    }

    /// Ends the tenure here: the sale that has waited longest for it goes to Redis (its
    /// channel closes) and stands in the queue there for the others, which keep their places.
    fn end(&mut self) {
        self.held = false;
        self.since = None;
        if let Some(lock) = self.lock.take() {
            self.wake_first(lock);
        }
    }
}

impl Cohort {
    /// A cohort whose number of critical sections per tenure is `passes`, which the
    /// instance's releases pass on.
    pub fn passing_on(mean: Arc<AtomicU32>) -> Self {
        Self {
            state: Mutex::default(),
            mean,
        }
    }

    /// A sale of `lock`'s strategy wants the lock.
    pub fn join(&self, lock: RedisLock, arrived: Instant) -> Joined {
        let Ok(mut state) = self.state.lock() else {
            return Joined::Redis(Passing(None));
        };
        if state.lock == Some(lock) {
            if let Some((tenure, park)) = state.parked.take() {
                if tenure.can_pass() {
                    return Joined::Taken(tenure);
                }
                state.parked = Some((tenure, park));
            } else if let Some(since) = state.since
                && state.held
                && since.elapsed() < state.quantum
            {
                let passed = state.wait(lock, arrived);
                return Joined::Wait {
                    passed,
                    until: since + state.quantum + WAIT_SLACK,
                };
            }
        }
        let standing = state.standing(lock);
        // Older sales of this instance wait for this lock with nobody standing in the Redis
        // queue for them (one was just told to go): the oldest goes, this one waits its turn
        // behind them rather than overtaking them in Redis.
        let older = |s: &State| {
            s.waiters
                .iter()
                .any(|(l, t, w)| *l == lock && *t < arrived && !w.is_closed())
        };
        if standing || older(&state) {
            if !standing {
                state.wake_first(lock);
            }
            let passed = state.wait(lock, arrived);
            return Joined::Behind {
                passed,
                until: Instant::now() + BEHIND_RECHECK,
            };
        }
        Joined::Redis(state.stand(lock))
    }

    /// A sale of this instance left the Redis queue for `lock` without the lock (it gave up,
    /// or Redis failed): if none stands there any more, the sales waiting behind it go to
    /// Redis themselves now (their channels close), unless a tenure here will serve them.
    pub fn left_redis_queue(&self, lock: RedisLock) {
        if let Ok(mut state) = self.state.lock() {
            let standing = state.standing(lock);
            let serving = state.held && state.lock == Some(lock);
            if !(standing || serving) {
                state.wake_first(lock);
            }
        }
    }

    /// How long the tenure of a sale that took the lock in Redis lasts, with `behind` other
    /// instances waiting, and how many critical sections it begins at most. `waited` is its
    /// wait in the Redis queue when a release handed the lock over, which moves the round,
    /// `passed_on` the mean that release passed on ([`next_mean`]), and `next_waited` how
    /// long the next in line had waited then ([`within_next_wait`]).
    pub fn allot(
        &self,
        longest: Duration,
        behind: Option<u64>,
        waited: Option<Duration>,
        passed_on: Option<u32>,
        next_waited: Option<Duration>,
    ) -> (Duration, Option<u16>) {
        let round = match self.state.lock() {
            Ok(mut state) => {
                let round = state.round.max(ROUND);
                if let Some(waited) = waited {
                    state.round = next_round(round, waited);
                }
                round
            }
            Err(_) => ROUND,
        };
        let sized = quantum(round, longest, behind);
        let quantum = within_next_wait(sized, next_waited);
        // A tenure cut short for a late turn says nothing of what tenures get through: no
        // cap, which also keeps it out of the mean (its quantum bounds it anyway).
        if behind.unwrap_or(0) == 0 || quantum < sized {
            return (quantum, None);
        }
        // The mean passed on is this instance's from now on, and the one its releases pass on.
        if let Some(mean) = passed_on.filter(|m| *m > 0) {
            self.mean.store(mean, Ordering::Relaxed);
        }
        let mean = self.mean.load(Ordering::Relaxed);
        let cap = (mean > 0).then(|| (u64::from(mean) * CAP_PERCENT / (256 * 100)).max(2));
        let cap = cap.map(|cap| u16::try_from(cap).unwrap_or(u16::MAX));
        (quantum, cap)
    }

    /// A sale took `lock` in Redis: sales of its strategy arriving here from now on wait for
    /// it here.
    pub fn began(&self, lock: RedisLock, since: Instant, quantum: Duration) {
        if let Ok(mut state) = self.state.lock() {
            state.held = true;
            state.lock = Some(lock);
            state.since = Some(since);
            state.quantum = quantum;
        }
    }

    /// Passes the tenure to the first sale still waiting here, or parks it when nobody
    /// waits, or gives it back when its quantum is used.
    pub fn pass(&self, mut tenure: Tenure) -> Passed {
        let Ok(mut state) = self.state.lock() else {
            return Passed::Over(tenure);
        };
        if !tenure.can_pass() {
            let capped = tenure.cap.is_some_and(|cap| tenure.passes >= cap.get());
            // The mean this tenure began with: the one passed on to it, or the instance's own.
            let mean = Some(self.mean.load(Ordering::Relaxed)).filter(|m| *m > 0);
            // Only tenures that others waited for count (those with a cap), and the first
            // one: a tenure alone holds as many as its longest quantum allows, which says
            // nothing about a round.
            let timed = tenure.acquired.elapsed() >= tenure.quantum;
            if capped || (timed && (tenure.cap.is_some() || mean.is_none())) {
                self.mean.store(
                    next_mean(mean, tenure.passes.into(), capped),
                    Ordering::Relaxed,
                );
            }
            state.end();
            return Passed::Over(tenure);
        }
        // The longest waiting first: those queued in Redis, then those that came during the
        // tenure. A send fails when the sale gave up (its deadline, or its request went
        // away, or Redis gave it the lock): the next one gets it.
        while let Some(i) = state.queued.iter().position(|(l, _)| *l == tenure.lock) {
            let Some((_, waiter)) = state.queued.remove(i) else {
                break;
            };
            match waiter.send(tenure) {
                Ok(()) => return Passed::ToWaiter,
                Err(back) => tenure = back,
            }
        }
        while let Some(i) = state.waiters.iter().position(|(l, _, _)| *l == tenure.lock) {
            let Some((_, _, waiter)) = state.waiters.remove(i) else {
                break;
            };
            match waiter.send(tenure) {
                Ok(()) => return Passed::ToWaiter,
                Err(back) => tenure = back,
            }
        }
        // Whoever takes a parked tenure reads for itself.
        tenure.prefetched = None;
        state.parks += 1;
        let park = state.parks;
        state.parked = Some((tenure, park));
        Passed::Parked(park)
    }

    /// The tenure parked as `park`, if nobody took it: its release is due.
    pub fn unpark(&self, park: u64) -> Option<Tenure> {
        let mut state = self.state.lock().ok()?;
        match state.parked.take() {
            Some((tenure, p)) if p == park => {
                state.end();
                Some(tenure)
            }
            other => {
                state.parked = other;
                None
            }
        }
    }

    /// Whether a sale of `lock` waits here for a tenure (or stands in the Redis queue for it).
    pub fn has_waiter(&self, lock: RedisLock) -> bool {
        self.state.lock().is_ok_and(|mut s| {
            s.standing(lock)
                || s.waiters
                    .iter()
                    .any(|(l, _, w)| *l == lock && !w.is_closed())
        })
    }

    /// The parked tenure, whoever parked it: its release is due now (the instance stops).
    pub fn take_parked(&self) -> Option<Tenure> {
        let mut state = self.state.lock().ok()?;
        let (tenure, _) = state.parked.take()?;
        state.end();
        Some(tenure)
    }

    /// A sale that held the tenure lost it without passing it (its Redis calls failed, or
    /// its guard was dropped): the sales waiting here go to Redis.
    pub fn abandoned(&self) {
        if let Ok(mut state) = self.state.lock() {
            state.parked = None;
            state.end();
        }
    }

    /// Nothing parked, nobody waiting, and no tenure within its quantum. A tenure past it
    /// (its holder runs long, or dropped its guard) is released in Redis by its holder, or by
    /// its lease: nothing here is owed to anyone.
    pub fn is_idle(&self) -> bool {
        self.state
            .lock()
            .map(|mut s| {
                s.waiters.retain(|(_, _, w)| !w.is_closed());
                s.queued.retain(|(_, w)| !w.is_closed());
                let current = s.held && s.since.is_some_and(|t| t.elapsed() < s.quantum);
                !current && s.parked.is_none() && s.waiters.is_empty() && s.queued.is_empty()
            })
            .unwrap_or(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tenure(since: Instant) -> Tenure {
        Tenure {
            lock: RedisLock::LuaRelease,
            owner: "a".into(),
            since,
            acquired: since,
            quantum: Duration::from_secs(60),
            lease: Duration::from_secs(600),
            renewal: None,
            tokens: None,
            prefetched: None,
            handed: None,
            passes: 1,
            cap: None,
        }
    }

    /// A sale that goes to Redis: it stands in the queue there for its instance.
    fn stand(cohort: &Cohort, lock: RedisLock) -> Passing {
        let Joined::Redis(standing) = cohort.join(lock, Instant::now()) else {
            panic!("nobody holds it or stands for it here: to Redis");
        };
        standing
    }

    #[test]
    fn of_sales_arriving_together_one_goes_to_redis_and_the_others_wait_behind_it() {
        let cohort = Cohort::default();
        let lua = RedisLock::LuaRelease;
        let first = stand(&cohort, lua);
        for _ in 0..3 {
            assert!(
                matches!(cohort.join(lua, Instant::now()), Joined::Behind { .. }),
                "the first stands in the Redis queue from the moment it was told to go"
            );
        }
        drop(first);
        let _next = stand(&cohort, lua);
    }

    #[tokio::test]
    async fn a_tenure_goes_to_waiters_in_order_then_parks_then_is_released() {
        let cohort = Cohort::default();
        let lua = RedisLock::LuaRelease;
        assert!(matches!(cohort.join(lua, Instant::now()), Joined::Redis(_)));
        cohort.began(lua, Instant::now(), Duration::from_secs(60));
        assert!(
            matches!(
                cohort.join(RedisLock::Fenced, Instant::now()),
                Joined::Redis(_)
            ),
            "another strategy's lock is never passed"
        );
        let (
            Joined::Wait { passed: first, .. },
            Joined::Wait {
                passed: mut second, ..
            },
        ) = (
            cohort.join(lua, Instant::now()),
            cohort.join(lua, Instant::now()),
        )
        else {
            panic!("arrivals during a tenure wait here");
        };
        drop(first);
        assert!(matches!(
            cohort.pass(tenure(Instant::now())),
            Passed::ToWaiter
        ));
        let passed = second
            .passed()
            .await
            .expect("the second, since the first gave up");
        let Passed::Parked(park) = cohort.pass(passed) else {
            panic!("nobody waits: parked");
        };
        assert!(!cohort.is_idle());
        assert!(matches!(
            cohort.join(RedisLock::Watchdog, Instant::now()),
            Joined::Redis(_)
        ));
        let Joined::Taken(taken) = cohort.join(lua, Instant::now()) else {
            panic!("a parked tenure is taken by the next arrival");
        };
        assert!(cohort.unpark(park).is_none(), "taken, so not released");
        let Passed::Parked(park) = cohort.pass(taken) else {
            panic!("parked again");
        };
        assert!(cohort.unpark(park).is_some());
        assert!(cohort.is_idle());
        assert!(matches!(cohort.join(lua, Instant::now()), Joined::Redis(_)));
    }

    #[tokio::test]
    async fn a_used_quantum_ends_the_tenure_and_sends_waiters_to_redis() {
        let cohort = Cohort::default();
        cohort.began(
            RedisLock::LuaRelease,
            Instant::now(),
            Duration::from_secs(60),
        );
        let Joined::Wait {
            passed: mut waiting,
            ..
        } = cohort.join(RedisLock::LuaRelease, Instant::now())
        else {
            panic!("waits here");
        };
        let mut old = tenure(Instant::now() - Duration::from_secs(61));
        old.quantum = Duration::from_secs(60);
        assert!(matches!(cohort.pass(old), Passed::Over(_)));
        assert!(waiting.passed().await.is_none(), "told to go to Redis");
        assert!(cohort.is_idle());
    }

    #[tokio::test]
    async fn sales_wait_here_behind_their_instances_sale_in_the_redis_queue_for_its_strategy_only()
    {
        let cohort = Cohort::default();
        let (lua, fenced) = (RedisLock::LuaRelease, RedisLock::Fenced);
        let mut standing = stand(&cohort, lua);
        let Joined::Behind {
            passed: mut behind, ..
        } = cohort.join(lua, Instant::now())
        else {
            panic!("one sale of an instance stands in the Redis queue, the next waits here");
        };
        assert!(
            matches!(cohort.join(fenced, Instant::now()), Joined::Redis(_)),
            "behind a sale of the same strategy only"
        );
        // The standing sale is handed the lock by Redis: its tenure serves the one behind.
        cohort.began(lua, Instant::now(), Duration::from_secs(60));
        assert!(standing.close().is_none());
        cohort.left_redis_queue(lua);
        assert!(matches!(
            cohort.pass(tenure(Instant::now())),
            Passed::ToWaiter
        ));
        assert!(behind.passed().await.is_some());

        // A standing sale that gives up sends the ones behind it to Redis at once.
        let cohort = Cohort::default();
        let mut standing = stand(&cohort, lua);
        let Joined::Behind {
            passed: mut behind, ..
        } = cohort.join(lua, Instant::now())
        else {
            panic!("waits behind");
        };
        let _other = stand(&cohort, fenced);
        assert!(standing.close().is_none());
        cohort.left_redis_queue(lua);
        assert!(behind.passed().await.is_none(), "told to join again");
        assert!(
            matches!(cohort.join(lua, Instant::now()), Joined::Redis(_)),
            "and now first"
        );

        // A fenced tenure never goes to a sale waiting behind a `lua-release` sale.
        let cohort = Cohort::default();
        let _standing = stand(&cohort, lua);
        let Joined::Behind {
            passed: mut behind, ..
        } = cohort.join(lua, Instant::now())
        else {
            panic!("waits behind");
        };
        cohort.began(fenced, Instant::now(), Duration::from_secs(60));
        let mut other = tenure(Instant::now());
        other.lock = fenced;
        assert!(matches!(cohort.pass(other), Passed::Parked(_)));
        assert!(behind.close().is_none());
    }

    #[test]
    fn a_tenure_passes_only_within_its_quantum_and_half_its_lease() {
        let now = Instant::now();
        assert!(tenure(now).can_pass());
        let mut waited_long = tenure(now - Duration::from_secs(301));
        waited_long.acquired = now;
        assert!(!waited_long.can_pass(), "less than half the lease left");
        let mut used = tenure(now);
        used.quantum = Duration::ZERO;
        assert!(!used.can_pass(), "its quantum is used");
    }

    #[test]
    fn tenures_shrink_with_the_queue_behind_them_within_their_bounds() {
        let longest = Duration::from_millis(5);
        for round in [ROUND, TARGET_WAIT] {
            assert_eq!(quantum(round, longest, None), longest);
            assert_eq!(quantum(round, longest, Some(0)), longest);
            assert_eq!(quantum(round, longest, Some(15)), round / 16);
            assert_eq!(quantum(round, longest, Some(63)), round / 64);
            assert!(
                round / 64 > MIN_QUANTUM,
                "64 instances still get a tenure of their own"
            );
            assert_eq!(quantum(round, longest, Some(10_000)), MIN_QUANTUM);
            assert_eq!(quantum(round, Duration::ZERO, Some(3)), Duration::ZERO);
            for behind in [0, 1, 7, 99, u64::MAX] {
                let q = quantum(round, longest, Some(behind));
                assert!(
                    q <= longest && q >= MIN_QUANTUM.min(longest),
                    "{behind}: {q:?}"
                );
            }
        }
    }

    /// Instances that all move their round by the waits they measure, each wait being the
    /// others' tenures plus a hand-off each: whatever the hand-offs cost, the waits settle
    /// at the target or below it and never stay above it, and the round stays within its
    /// bounds, the floor when the hand-offs alone take the whole target.
    #[test]
    fn the_round_grows_while_waits_come_early_and_settles_with_the_waits_at_the_target() {
        for instances in [2u32, 16, 64, 256] {
            for hand_off_us in [0u64, 50, 300, 1000, 5000] {
                let hand_off = Duration::from_micros(hand_off_us);
                let longest = Duration::from_millis(5);
                let mut round = ROUND;
                let mut waits = Vec::new();
                for _ in 0..200 {
                    let behind = u64::from(instances - 1);
                    let tenure = quantum(round, longest, Some(behind));
                    let waited = (tenure + hand_off) * (instances - 1);
                    waits.push(waited);
                    let next = next_round(round, waited);
                    assert!(
                        (ROUND..=TARGET_WAIT).contains(&next),
                        "{instances}/{hand_off_us}: {next:?}"
                    );
                    round = next;
                }
                let settled = waits[150..].iter().max().copied().unwrap_or_default();
                let floor = (quantum(ROUND, longest, Some(u64::from(instances - 1))) + hand_off)
                    * (instances - 1);
                assert!(
                    settled <= TARGET_WAIT.max(floor) + TARGET_WAIT / 50,
                    "{instances}/{hand_off_us}: waits settle over the target: {settled:?}"
                );
                if floor < TARGET_WAIT && round / instances < longest {
                    assert!(
                        settled >= TARGET_WAIT - TARGET_WAIT / 10,
                        "{instances}/{hand_off_us}: the round stopped short: {settled:?}"
                    );
                }
            }
        }
        // One long wait cuts the round at once, in proportion.
        assert_eq!(
            next_round(TARGET_WAIT, TARGET_WAIT * 2),
            ROUND.max(TARGET_WAIT / 2)
        );
        assert_eq!(next_round(ROUND, Duration::from_secs(10)), ROUND);
    }

    #[test]
    fn a_capped_tenure_stops_passing_at_its_number_of_critical_sections() {
        let mut t = tenure(Instant::now());
        t.cap = NonZeroU16::new(3);
        assert!(t.can_pass());
        t.passes = 3;
        assert!(!t.can_pass(), "three begun of three");
        t.cap = None;
        assert!(t.can_pass(), "uncapped: its quantum alone");
    }

    /// The mean passed from holder to holder follows what the tenures got through; a tenure
    /// its cap ended counts one more, so a mean too low for the quantum climbs back.
    #[test]
    fn the_mean_passed_on_follows_the_tenures_and_climbs_when_they_are_capped() {
        assert_eq!(next_mean(None, 12, false), 12 * 256);
        assert_eq!(next_mean(None, 0, false), 2 * 256, "at least two");
        let mut mean = None;
        for _ in 0..200 {
            mean = Some(next_mean(mean, 20, false));
        }
        let settled = mean.unwrap_or_default();
        assert!((19 * 256..=20 * 256).contains(&settled), "{settled}");
        // Tenures that could have done 30 but were capped at a mean of 4 climb.
        let mut mean = 4 * 256;
        for _ in 0..400 {
            let cap = u32::try_from(u64::from(mean) * CAP_PERCENT / (256 * 100)).unwrap_or(2);
            let done = cap.min(30);
            mean = next_mean(Some(mean), done, done == cap);
        }
        assert!(mean >= 19 * 256, "{mean}");
    }

    #[test]
    fn a_tenure_is_capped_only_with_others_waiting_and_a_mean_known() {
        let passes = Arc::new(AtomicU32::new(0));
        let cohort = Cohort::passing_on(passes.clone());
        let longest = Duration::from_millis(5);
        let waited = Some(Duration::from_millis(10));
        let (_, cap) = cohort.allot(longest, Some(3), waited, None, None);
        assert_eq!(cap, None, "no mean yet");
        let (_, cap) = cohort.allot(longest, Some(3), waited, Some(10 * 256), None);
        assert_eq!(cap, Some(12), "120% of the mean passed on");
        assert_eq!(
            passes.load(Ordering::Relaxed),
            10 * 256,
            "and passed on in turn"
        );
        let (_, cap) = cohort.allot(longest, Some(0), waited, Some(20 * 256), None);
        assert_eq!(cap, None, "nobody else waits");
        passes.store(5 * 256, Ordering::Relaxed);
        let (_, cap) = cohort.allot(longest, Some(3), waited, None, None);
        assert_eq!(cap, Some(6), "its own when none is passed on");
    }

    /// A turn that comes late is caught at the tenure that would delay it further: that
    /// tenure ends early enough for the next in line to wait no longer than the bound, at its
    /// first critical section if the bound is near, and stays out of the mean.
    #[test]
    fn a_tenure_ends_early_when_the_next_in_line_has_waited_long() {
        let q = Duration::from_millis(5);
        assert_eq!(within_next_wait(q, None), q);
        assert_eq!(within_next_wait(q, Some(Duration::from_millis(20))), q);
        assert_eq!(
            within_next_wait(
                q,
                Some(LONGEST_WAIT - HAND_OFF_ALLOWANCE - Duration::from_millis(3))
            ),
            Duration::from_millis(3)
        );
        assert_eq!(within_next_wait(q, Some(LONGEST_WAIT)), Duration::ZERO);
        assert_eq!(within_next_wait(q, Some(Duration::MAX)), Duration::ZERO);

        let cohort = Cohort::passing_on(Arc::new(AtomicU32::new(10 * 256)));
        let longest = Duration::from_millis(5);
        let (sized, cap) =
            cohort.allot(longest, Some(3), None, None, Some(Duration::from_millis(9)));
        assert!(sized > Duration::ZERO);
        assert_eq!(cap, Some(12), "an early turn changes nothing");
        let (cut, cap) = cohort.allot(longest, Some(3), None, None, Some(LONGEST_WAIT));
        assert_eq!(
            (cut, cap),
            (Duration::ZERO, None),
            "a late one: its first section alone"
        );
        let mut t = tenure(Instant::now());
        t.quantum = cut;
        t.passes = 1;
        assert!(!t.can_pass());
        assert!(matches!(cohort.pass(t), Passed::Over(_)));
        assert_eq!(
            cohort.mean.load(Ordering::Relaxed),
            10 * 256,
            "the mean unmoved"
        );
    }

    /// A tenure moves the mean it passes on only when others waited for it (it had a cap),
    /// or when there is no mean yet: one alone fills its longest quantum, which says nothing
    /// of a round.
    #[test]
    fn only_tenures_others_waited_for_move_the_mean_passed_on() {
        let passes = Arc::new(AtomicU32::new(10 * 256));
        let cohort = Cohort::passing_on(passes.clone());
        let ended = |passes: u16, cap: Option<u16>| {
            let mut t = tenure(Instant::now());
            t.quantum = Duration::ZERO;
            t.passes = passes;
            t.cap = cap.and_then(NonZeroU16::new);
            t
        };
        assert!(matches!(cohort.pass(ended(300, None)), Passed::Over(_)));
        assert_eq!(passes.load(Ordering::Relaxed), 10 * 256, "alone: unchanged");
        assert!(matches!(cohort.pass(ended(12, Some(12))), Passed::Over(_)));
        assert_eq!(
            passes.load(Ordering::Relaxed),
            (10 * 256 * 15 + 13 * 256) / 16,
            "capped: counts one more"
        );
        passes.store(0, Ordering::Relaxed);
        assert!(matches!(cohort.pass(ended(7, None)), Passed::Over(_)));
        assert_eq!(passes.load(Ordering::Relaxed), 7 * 256, "the first mean");
    }

    #[test]
    fn tokens_drawn_ahead_come_out_once_each_in_order() {
        let mut t = tenure(Instant::now());
        t.tokens = Some((5, 7));
        let drawn: Vec<_> = std::iter::from_fn(|| t.take_token()).collect();
        assert_eq!(drawn, [5, 6, 7]);
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        fn millis(max: u64) -> impl Strategy<Value = Duration> {
            (0..=max).prop_map(Duration::from_millis)
        }

        /// What one tenure's acquisition saw: instances behind, its own wait, the mean and the
        /// next one's wait the release passed on.
        fn turn()
        -> impl Strategy<Value = (Option<u64>, Option<Duration>, Option<u32>, Option<Duration>)>
        {
            (
                proptest::option::of(0..200u64),
                proptest::option::of(millis(1_000)),
                proptest::option::of(0..100_000u32),
                proptest::option::of(millis(1_000)),
            )
        }

        proptest! {
            /// Over any run of turns: a tenure never outlasts the longest one configured,
            /// never keeps the next in line past the longest wait unless it is cut to its
            /// first critical section, never gets a cap when nobody waits or when it was cut,
            /// and the round stays within its bounds.
            #[test]
            fn a_tenure_stays_within_every_bound_over_any_run_of_turns(
                longest in (1..=1_000u64).prop_map(Duration::from_millis),
                turns in proptest::collection::vec(turn(), 1..60),
            ) {
                let cohort = Cohort::passing_on(Arc::new(AtomicU32::new(0)));
                for (behind, waited, passed_on, next_waited) in turns {
                    let (quantum, cap) = cohort.allot(longest, behind, waited, passed_on, next_waited);
                    prop_assert!(quantum <= longest);
                    let share = u32::try_from(behind.unwrap_or(0) + 1).unwrap_or(u32::MAX);
                    prop_assert!(quantum <= (TARGET_WAIT / share).max(MIN_QUANTUM));
                    if let Some(w) = next_waited {
                        prop_assert!(
                            quantum.is_zero() || w + quantum + HAND_OFF_ALLOWANCE <= LONGEST_WAIT,
                            "the next one waited {w:?}, and the tenure is {quantum:?}"
                        );
                    }
                    let cut = next_waited.is_some_and(|w| w + HAND_OFF_ALLOWANCE + MIN_QUANTUM.min(longest) > LONGEST_WAIT);
                    if behind.unwrap_or(0) == 0 || cut {
                        prop_assert_eq!(cap, None);
                    }
                    if let Some(cap) = cap {
                        prop_assert!(cap >= 2, "a cap lets a tenure pass the lock at least once");
                    }
                    let round = cohort.state.lock().map(|s| s.round).unwrap_or_default();
                    prop_assert!((ROUND..=TARGET_WAIT).contains(&round) || round.is_zero());
                }
            }

            /// A later turn never makes the next round longer.
            #[test]
            fn the_round_never_grows_for_a_later_turn(
                round in millis(200),
                earlier in millis(1_000),
                later in millis(1_000),
            ) {
                let (earlier, later) = (earlier.min(later), earlier.max(later));
                let (a, b) = (next_round(round, earlier), next_round(round, later));
                prop_assert!(a >= b, "{earlier:?} -> {a:?}, {later:?} -> {b:?}");
                prop_assert!((ROUND..=TARGET_WAIT).contains(&a));
            }

            /// The mean passed on lies between the last mean and what the tenure got, and
            /// never below two critical sections.
            #[test]
            fn the_mean_passed_on_moves_towards_what_the_tenure_got(
                mean in proptest::option::of(any::<u32>()),
                passes in any::<u32>(),
                capped in any::<bool>(),
            ) {
                let next = u64::from(next_mean(mean, passes, capped));
                let got = u64::from(passes.saturating_add(u32::from(capped))) * 256;
                let (lo, hi) = match mean {
                    Some(m) => (got.min(u64::from(m)), got.max(u64::from(m))),
                    None => (got, got),
                };
                prop_assert!(next >= 512);
                prop_assert!(next >= lo.max(512).min(u64::from(u32::MAX)));
                prop_assert!(next <= hi.max(512).min(u64::from(u32::MAX)));
            }

            /// Tokens drawn ahead come out once each, in order: a fencing token never goes
            /// backwards within a tenure.
            #[test]
            fn tokens_drawn_ahead_never_go_backwards(first in any::<u64>(), more in 0..64u64) {
                let last = first.saturating_add(more);
                let mut t = tenure(Instant::now());
                t.tokens = Some((first, last));
                let drawn: Vec<_> = std::iter::from_fn(|| t.take_token()).take(100).collect();
                prop_assert_eq!(drawn.len() as u64, last - first + 1);
                prop_assert!(drawn.windows(2).all(|w| w[1] == w[0] + 1));
                prop_assert_eq!(drawn.first().copied(), Some(first));
                prop_assert_eq!(drawn.last().copied(), Some(last));
            }
        }
    }
}

//! The watchdog: renews a held lock every third of its lease until released or lost.
//!
//! The hold is lost once a renewal finds the lock gone, and, once a renewal sent within the lease
//! has not been confirmed, when its lease runs out: the lease surely lasts from the *sending* of
//! the last call that set it (the acquisition, a renewal, the extension of a lock handed over),
//! plus the lease, less the clock drift. The sale checks that at its write. Before, time counted
//! only once a renewal had failed, so a holder whose renewal was still waiting for its answer when
//! the lease ended (`REDIS_TIMEOUT_MS` longer than two thirds of the lease) wrote after another
//! owner had taken the lock. A renewal that fails is tried again soon, within what is left of the
//! lease, rather than a third of a lease later: a pause of Redis shorter than the lease costs
//! nothing. The next renewal is due a third of a lease after the *sending* of the call that last
//! set the lease, not after its answer: Redis may have run a renewal long before its answer came
//! back, and a tick counted from a late answer fell after the lease's end, with nothing counting
//! time in between. An answer later than the next renewal's due time leaves time counting, and
//! the next renewal goes at once. Dropping the [`Renewal`] stops the task, so a sale that ends
//! without releasing cannot keep its lock alive forever.
//!
//! What time does not catch: a holder whose whole process was paused sent no renewal and saw
//! nothing fail, so it wakes believing its lease good (the watchdog's flaw, which the pause
//! scenarios show), and a pause between the check and the write defeats any check. That is
//! what fencing tokens are for.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::{Instant, sleep_until};

use super::{LockCx, RedisLock};

/// What the holder knows for sure of its lease: until when it lasts at least.
pub struct Lease {
    base: Instant,
    /// Nanoseconds after `base` (negative: before) until which the lease surely lasts.
    good_until: AtomicI64,
    /// Nanoseconds after `base` when the last call that set the lease was sent: the next
    /// renewal is due a third of a lease after it.
    set_at: AtomicI64,
    /// The lease every successful call gives, from its sending time: the lock's TTL less the
    /// drift of the clocks.
    length: Duration,
    /// A renewal was sent and has not succeeded yet: the lease may end at `good_until`.
    unconfirmed: AtomicBool,
    lost: AtomicBool,
}

impl Lease {
    /// `good_until`: the end of the lease the acquisition surely gave; `set_at`: when the
    /// call that set it was sent.
    fn new(ttl: Duration, good_until: Instant, set_at: Instant) -> Self {
        let base = Instant::now();
        Self {
            base,
            good_until: AtomicI64::new(offset(base, good_until)),
            set_at: AtomicI64::new(offset(base, set_at)),
            length: ttl.saturating_sub(super::redlock::drift(ttl)),
            unconfirmed: AtomicBool::new(false),
            lost: AtomicBool::new(false),
        }
    }

    /// A call sent at `sent` set the lease afresh (a renewal, the extension of a lock
    /// handed over).
    pub(super) fn extended(&self, sent: Instant) {
        let until = offset(self.base, sent + self.length);
        self.good_until.fetch_max(until, Ordering::AcqRel);
        self.set_at
            .fetch_max(offset(self.base, sent), Ordering::AcqRel);
    }

    /// When the next renewal is due: `interval` after the sending of the last call that set
    /// the lease, not after its answer, which may have come late.
    fn renewal_due(&self, interval: Duration) -> Instant {
        let set_at = self.set_at.load(Ordering::Acquire);
        let magnitude = Duration::from_nanos(set_at.unsigned_abs());
        let set_at = if set_at < 0 {
            self.base.checked_sub(magnitude).unwrap_or(self.base)
        } else {
            self.base + magnitude
        };
        set_at + interval
    }

    /// How long the lease surely lasts from now.
    fn left(&self) -> Duration {
        let until = self.good_until.load(Ordering::Acquire);
        let now = offset(self.base, Instant::now());
        Duration::from_nanos(u64::try_from(until.saturating_sub(now)).unwrap_or(0))
    }

    fn lose(&self) {
        self.lost.store(true, Ordering::Release);
    }

    /// Not final by time alone: a later success proves the lock was held throughout (an
    /// owner-checked renewal finds an expired lock gone).
    pub fn is_lost(&self) -> bool {
        self.lost.load(Ordering::Acquire)
            || (self.unconfirmed.load(Ordering::Acquire) && self.left().is_zero())
    }
}

fn offset(base: Instant, at: Instant) -> i64 {
    let nanos = |d: Duration| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX);
    match at.checked_duration_since(base) {
        Some(after) => nanos(after),
        None => -nanos(base.duration_since(at)),
    }
}

pub struct Renewal {
    lease: Arc<Lease>,
    _stop: oneshot::Sender<()>,
}

impl Renewal {
    /// `good_until`: the end of the lease the acquisition surely gave (see
    /// [`super::Grant::good_until`]); `set_at`: when the call that set it was sent (for a lock
    /// handed over, now: its extension is about to be).
    pub fn start(
        cx: LockCx,
        lock: RedisLock,
        owner: Arc<str>,
        good_until: Instant,
        set_at: Instant,
    ) -> Self {
        let lease = Arc::new(Lease::new(cx.ttl, good_until, set_at));
        let (stop_tx, stop) = oneshot::channel();
        tokio::spawn(renew_until_stopped(cx, lock, owner, lease.clone(), stop));
        Self {
            lease,
            _stop: stop_tx,
        }
    }

    pub fn is_lost(&self) -> bool {
        self.lease.is_lost()
    }

    /// For the extension of a lock handed over, which sets the same lease.
    pub(super) fn lease(&self) -> &Arc<Lease> {
        &self.lease
    }
}

async fn renew_until_stopped(
    cx: LockCx,
    lock: RedisLock,
    owner: Arc<str>,
    lease: Arc<Lease>,
    mut stop: oneshot::Receiver<()>,
) {
    let interval = cx.ttl / 3;
    // After a failure: soon, so that Redis back within the lease finds a renewal in time.
    let retry = interval / 4;
    let mut failed = false;
    let lost = |reason: &str, error: Option<String>| {
        cx.store.metrics().lock_lost();
        tracing::warn!(event = crate::events::Event::LockLost.name(), %owner, reason, error, "lock lost");
        lease.lose();
    };
    loop {
        let due = if failed {
            Instant::now() + retry.min(lease.left())
        } else {
            lease.renewal_due(interval)
        };
        tokio::select! {
            // Fires on release and on drop alike.
            _ = &mut stop => return,
            () = sleep_until(due) => {}
        }
        // Set afresh meanwhile (the extension of a lock handed over): not due yet.
        if !failed && lease.renewal_due(interval) > Instant::now() {
            continue;
        }
        if lease.is_lost() || (failed && lease.left().is_zero()) {
            return lost("could not renew within its lease", None);
        }
        // Time counts for a renewal sent within the lease. One sent after it, by a process
        // that was paused past its lease, is left to its answer: that holder's write is the
        // watchdog's flaw, which fencing refuses, and counting it would make the pause
        // scenarios a race between this task and the sale's check.
        if !lease.left().is_zero() {
            lease.unconfirmed.store(true, Ordering::Release);
        }
        let acked = cx.acked();
        let renewing = acked.as_ref().map_or(&cx, |(cx, _)| cx);
        let sent = Instant::now();
        let renewed = super::renew(renewing, lock, &owner).await;
        let wanted = i64::from(cx.store.replication().acks);
        let unreplicated = acked
            .as_ref()
            .and_then(|(_, acks)| acks.get())
            .filter(|&acked| acked < wanted);
        match renewed {
            // A renewal the replicas did not get would not survive a failover: the new
            // master would let the lease run out early and grant the lock again.
            Ok(true) if unreplicated.is_some() => {
                cx.store.metrics().lock_lost();
                tracing::warn!(event = crate::events::Event::LockLost.name(), %owner, acked = unreplicated, wanted, reason = "renewal not acknowledged by enough replicas", "lock lost");
                lease.lose();
                return;
            }
            Ok(true) => {
                failed = false;
                lease.extended(sent);
                // An answer later than the next renewal's due time leaves time counting: the
                // next goes at once, and the lease this one gave may end before its answer.
                if Instant::now() < lease.renewal_due(interval) {
                    lease.unconfirmed.store(false, Ordering::Release);
                }
                cx.store.metrics().renewal();
                tracing::debug!(event = crate::events::Event::LockRenewed.name(), %owner, "lock renewed");
            }
            Ok(false) => return lost("renewal found it gone or taken", None),
            Err(e) => {
                failed = true;
                if lease.left().is_zero() {
                    return lost("could not renew within its lease", Some(e.to_string()));
                }
                tracing::warn!(%owner, error = %e, "renewal failed; retrying");
            }
        }
    }
}

//! The watchdog: renews a held lock every third of its lease until released or lost.
//!
//! A renewal that finds the lock gone marks the hold as lost; so does a Redis that stays
//! unreachable for a whole lease, since the key has surely expired by then. The sale checks
//! the mark before it writes. Dropping the [`Renewal`] stops the task, so a sale that ends
//! without releasing cannot keep its lock alive forever.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::oneshot;
use tokio::time::{Instant, sleep};

use super::{LockCx, RedisLock};

pub struct Renewal {
    lost: Arc<AtomicBool>,
    _stop: oneshot::Sender<()>,
}

impl Renewal {
    pub fn start(cx: LockCx, lock: RedisLock, owner: Arc<str>) -> Self {
        let lost = Arc::new(AtomicBool::new(false));
        let (stop_tx, stop) = oneshot::channel();
        tokio::spawn(renew_until_stopped(cx, lock, owner, lost.clone(), stop));
        Self {
            lost,
            _stop: stop_tx,
        }
    }

    pub fn is_lost(&self) -> bool {
        self.lost.load(Ordering::Acquire)
    }
}

async fn renew_until_stopped(
    cx: LockCx,
    lock: RedisLock,
    owner: Arc<str>,
    lost: Arc<AtomicBool>,
    mut stop: oneshot::Receiver<()>,
) {
    let interval = cx.ttl / 3;
    let mut last_renewed = Instant::now();
    loop {
        tokio::select! {
            // Fires on release and on drop alike.
            _ = &mut stop => return,
            () = sleep(interval) => {}
        }
        let acked = cx.acked();
        let renewing = acked.as_ref().map_or(&cx, |(cx, _)| cx);
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
                lost.store(true, Ordering::Release);
                return;
            }
            Ok(true) => {
                last_renewed = Instant::now();
                cx.store.metrics().renewal();
                tracing::debug!(event = crate::events::Event::LockRenewed.name(), %owner, "lock renewed");
            }
            Ok(false) => {
                cx.store.metrics().lock_lost();
                tracing::warn!(event = crate::events::Event::LockLost.name(), %owner, reason = "renewal found it gone or taken", "lock lost");
                lost.store(true, Ordering::Release);
                return;
            }
            Err(e) if last_renewed.elapsed() >= cx.ttl => {
                cx.store.metrics().lock_lost();
                tracing::warn!(event = crate::events::Event::LockLost.name(), %owner, error = %e, reason = "could not renew within its lease", "lock lost");
                lost.store(true, Ordering::Release);
                return;
            }
            Err(e) => tracing::warn!(%owner, error = %e, "renewal failed; retrying"),
        }
    }
}

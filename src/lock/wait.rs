//! Waiting for a lock someone else holds: one mechanism for every Redis strategy.
//!
//! Each instance keeps one subscription to the item's release channel. A release wakes *one*
//! waiter of the instance (as Redisson's semaphore does): one lock can go to one sale, so
//! waking all of them would only send a herd of doomed attempts to Redis. A waiter
//! registers *before* each attempt, so a release published between a failed attempt and
//! the wait still wakes it; a waiter that gives up passes its wake-up on (tokio's `Notify`
//! forwards it). Each wait is bounded by the holder's remaining lease (the key may simply
//! expire, and nobody publishes an expiry) and by the sale's deadline; a (re)subscription
//! wakes everyone, since releases may have been missed meanwhile. `LOCK_WAIT=spin`
//! replaces all of this with the tutorial's fixed 20 ms sleep, for comparison.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use futures_util::StreamExt;
use redis::{Client, RedisResult};
use tokio::sync::Notify;
use tokio::time::{Instant, sleep, sleep_until};

use super::{Attempt, LockError};
use crate::config::WaitMode;

/// The tutorial's retry interval.
const SPIN_INTERVAL: Duration = Duration::from_millis(20);

pub struct Waiter {
    releases: Arc<Notify>,
    mode: WaitMode,
    /// Acquire attempts sent to Redis, successful or not: what a herd costs, and what the
    /// lock bench reports per critical section.
    attempts: AtomicU64,
}

impl Waiter {
    /// Spawns the subscriber; it stops once the returned `Waiter` is gone.
    pub fn listen(client: Client, channel: String, mode: WaitMode) -> Self {
        let releases = Arc::new(Notify::new());
        tokio::spawn(subscribe(client, channel, Arc::downgrade(&releases)));
        Self {
            releases,
            mode,
            attempts: AtomicU64::new(0),
        }
    }

    pub fn attempts(&self) -> u64 {
        self.attempts.load(Ordering::Relaxed)
    }

    /// Repeats `attempt` until it acquires, the deadline passes, or Redis fails. Returns the
    /// fencing token of the acquisition, if any.
    pub async fn until_acquired<F, Fut>(
        &self,
        deadline: Instant,
        mut attempt: F,
    ) -> Result<Option<u64>, LockError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = RedisResult<Attempt>>,
    {
        let started = Instant::now();
        loop {
            let released = self.releases.notified();
            tokio::pin!(released);
            released.as_mut().enable();
            self.attempts.fetch_add(1, Ordering::Relaxed);
            let retry_in = match attempt().await? {
                Attempt::Acquired { fence } => return Ok(fence),
                Attempt::Busy { retry_in } => retry_in,
            };
            let now = Instant::now();
            if now >= deadline {
                return Err(LockError::Timeout {
                    waited: now - started,
                });
            }
            let lease_end = retry_in.map_or(deadline, |r| (now + r).min(deadline));
            match self.mode {
                WaitMode::Spin => sleep_until(lease_end.min(now + SPIN_INTERVAL)).await,
                WaitMode::Notify => {
                    tokio::select! {
                        () = released => {}
                        () = sleep_until(lease_end) => {}
                    }
                }
            }
        }
    }
}

/// Keeps one subscription alive for as long as anyone listens.
async fn subscribe(client: Client, channel: String, releases: Weak<Notify>) {
    let mut backoff = Duration::from_millis(50);
    while releases.strong_count() > 0 {
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
                    if messages.next().await.is_none() {
                        break;
                    }
                    wake = Notify::notify_one;
                }
                tracing::warn!(%channel, "release subscription lost; waiters fall back to lease bounds");
            }
            Ok(Err(e)) => tracing::debug!(error = %e, "cannot subscribe to lock releases yet"),
            Err(_) => tracing::debug!("subscribing to lock releases timed out"),
        }
        sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(1));
    }
}

async fn connect(client: &Client, channel: &str) -> RedisResult<redis::aio::PubSub> {
    let mut pubsub = client.get_async_pubsub().await?;
    pubsub.subscribe(channel).await?;
    Ok(pubsub)
}

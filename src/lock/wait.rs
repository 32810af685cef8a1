//! Waiting for a lock someone else holds: one mechanism for every Redis strategy.
//!
//! Each instance keeps one subscription to the item's release channel and turns every
//! message into a tick of a `watch` counter. A waiter marks the counter *before* each
//! attempt, so a release published between a failed attempt and the wait still wakes it.
//! Each wait is bounded by the holder's remaining lease (the key may simply expire, and
//! nobody publishes an expiry) and by the sale's deadline. `LOCK_WAIT=spin` replaces all of
//! this with the tutorial's fixed 20 ms sleep, for comparison.

use std::future::Future;
use std::time::Duration;

use futures_util::StreamExt;
use redis::{Client, RedisResult};
use tokio::sync::watch;
use tokio::time::{Instant, sleep, sleep_until};

use super::{Attempt, LockError};
use crate::config::WaitMode;

/// The tutorial's retry interval.
const SPIN_INTERVAL: Duration = Duration::from_millis(20);

pub struct Waiter {
    releases: watch::Receiver<u64>,
    mode: WaitMode,
}

impl Waiter {
    /// Spawns the subscriber; it lives as long as the returned `Waiter`.
    pub fn listen(client: Client, channel: String, mode: WaitMode) -> Self {
        let (tx, releases) = watch::channel(0);
        tokio::spawn(subscribe(client, channel, tx));
        Self { releases, mode }
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
            let mut releases = self.releases.clone();
            releases.mark_unchanged();
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
                        changed = releases.changed() => {
                            // The subscriber is gone only at shutdown; fall back to the lease.
                            if changed.is_err() {
                                sleep_until(lease_end).await;
                            }
                        }
                        () = sleep_until(lease_end) => {}
                    }
                }
            }
        }
    }
}

/// Keeps one subscription alive for as long as anyone listens. Every (re)subscription also
/// ticks the counter: releases published while it was down were missed, so waiters retry.
async fn subscribe(client: Client, channel: String, tx: watch::Sender<u64>) {
    let mut backoff = Duration::from_millis(50);
    while !tx.is_closed() {
        match tokio::time::timeout(Duration::from_secs(2), connect(&client, &channel)).await {
            Ok(Ok(pubsub)) => {
                backoff = Duration::from_millis(50);
                tracing::debug!(%channel, "listening for lock releases");
                tx.send_modify(|n| *n += 1);
                let mut messages = pubsub.into_on_message();
                loop {
                    tokio::select! {
                        message = messages.next() => match message {
                            Some(_) => tx.send_modify(|n| *n += 1),
                            None => break,
                        },
                        () = tx.closed() => return,
                    }
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

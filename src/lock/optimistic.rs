//! `optimistic`: no lock. On a connection of its own (from the pool: `WATCH` belongs to a
//! connection, so it cannot run on the shared multiplexed one), `WATCH` the stock and the
//! counters every other writer bumps, `GET` the stock, do the work, then `MULTI` / the sale
//! script / `EXEC`. If anything watched changed since the `WATCH`, Redis refuses the whole
//! transaction (`EXEC` answers nil) and the sale reads and works again, after a jittered
//! backoff, within `LOCK_WAIT_MS`; past it, 503 `too_much_contention`.
//!
//! Watched: the stock (every sale and reset writes it), the lock-free write count (atomic
//! sales, resets, other optimistic sales), both lock kinds' write counts (locked sales) and
//! the sale's idempotency claim. The `EXEC` body is `sell.lua` in its `optimistic` mode, so
//! the books are kept in one place; it bumps the lock-free count, so a locked sale that read
//! before it is refused (`stock_changed`) instead of overwriting it.
//!
//! Fixes: there is no lock to lose, expire, or wait for, and no stale write can land: Redis
//! itself refuses an `EXEC` whose read went stale.
//! Still wrong: cost, not safety. Under contention most attempts are thrown away, with the
//! work they did, and a sale may give up; each sale in flight holds a pooled connection.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use redis::{RedisError, RedisResult};
use tokio::time::Instant;

use crate::events::Event;
use crate::store::{Entry, Recorded, Store};
use crate::strategy::Strategy;

/// Why an optimistic sale made no sale.
#[derive(Debug)]
pub enum Failure {
    /// Every attempt within the budget found something watched changed under it.
    Contention { attempts: u32, waited: Duration },
    /// Failed before any `EXEC` was sent: nothing sold, for certain.
    Redis(RedisError),
    /// An `EXEC` was sent and its answer never came: it may have sold.
    Unknown(RedisError),
    /// The client went away before an `EXEC` was sent: nothing sold.
    ClientGone,
}

/// What one attempt came to.
enum Attempt {
    Done(Recorded),
    /// `EXEC` answered nil: a watched key changed after the `WATCH`.
    Conflict,
    /// Redis had lost the sale script (a restart): loaded again, try again at once.
    ScriptLoaded,
}

/// Sells with `WATCH` / `MULTI` / `EXEC`, retrying refused transactions until `deadline`.
/// Returns what the write did and how many attempts it took.
pub async fn sell(
    store: &Store,
    entry: &Entry<'_>,
    work: Duration,
    deadline: Instant,
    hangup: &crate::hangup::Hangup,
) -> Result<(Recorded, u32), Failure> {
    let strategy = Strategy::Optimistic;
    let started = Instant::now();
    let mut attempts = 0u32;
    let mut conflicts = 0u32;
    loop {
        attempts += 1;
        if attempts > 1 {
            store.metrics().retry(strategy);
        }
        match attempt(store, entry, work, hangup).await? {
            Attempt::Done(recorded) => return Ok((recorded, attempts)),
            Attempt::ScriptLoaded if Instant::now() < deadline => {}
            Attempt::ScriptLoaded => {
                return Err(Failure::Contention {
                    attempts,
                    waited: started.elapsed(),
                });
            }
            Attempt::Conflict => {
                conflicts += 1;
                store.metrics().conflict(strategy, work);
                tracing::info!(event = Event::TransactionConflict.name(), order_id = %entry.order_id, attempt = attempts, "EXEC refused: a watched key changed; the work is thrown away");
                let pause = backoff(conflicts);
                if Instant::now() + pause >= deadline {
                    return Err(Failure::Contention {
                        attempts,
                        waited: started.elapsed(),
                    });
                }
                tokio::time::sleep(pause).await;
            }
        }
    }
}

/// Full jitter over an exponential window (1 ms, 2 ms, ... up to 64 ms): contenders that
/// collided spread out instead of colliding again in step.
fn backoff(conflicts: u32) -> Duration {
    let window_us = 1_000u64 << conflicts.min(6);
    let random = uuid::Uuid::new_v4().as_u128() as u64;
    Duration::from_micros(random % window_us + 1)
}

/// Whether Redis is known to hold the sale script. Inside `MULTI`, `EVALSHA` cannot load it
/// on `NOSCRIPT` as a plain call does, and a `NOSCRIPT` at `EXEC` would waste the attempt's
/// work: the script is loaded before the first `WATCH`, and again after Redis lost it.
static SCRIPT_LOADED: AtomicBool = AtomicBool::new(false);

async fn attempt(
    store: &Store,
    entry: &Entry<'_>,
    work: Duration,
    hangup: &crate::hangup::Hangup,
) -> Result<Attempt, Failure> {
    // The checkout, the script's load and the WATCH with its read share one timeout: the
    // checkout pings a pooled connection (or opens one), and a frozen Redis leaves that
    // unanswered as it would the WATCH, so bounding each apart cost two timeouts or three.
    let read_by = Instant::now() + store.timeout();
    let mut conn = match tokio::time::timeout_at(read_by, store.pooled()).await {
        // The checkout counted its own errors.
        Ok(conn) => conn.map_err(Failure::Redis)?,
        Err(_) => {
            let e = unanswered();
            store.metrics().redis_error();
            return Err(Failure::Redis(e));
        }
    };
    let sell_probe = store.optimistic_sell(entry, 0);
    if !SCRIPT_LOADED.load(Ordering::Relaxed) {
        match bounded_until(store, read_by, sell_probe.load_async(&mut *conn)).await {
            Ok(_) => SCRIPT_LOADED.store(true, Ordering::Relaxed),
            Err(e) => {
                discard(conn);
                return Err(Failure::Redis(e));
            }
        }
    }
    let keys = &store.keys;
    let watched: [&str; 4] = [
        &keys.stock,
        &keys.lockfree_writes,
        &keys.single_node_writes,
        &keys.quorum_writes,
    ];
    // Not the idempotency claim: the EXEC body checks that the claim is still this sale's
    // (`sell.lua`), and the attempt itself extends the claim's lease while it runs, which a
    // WATCH counts as a change: every keyed attempt longer than one extension (1.7 s) was
    // refused by its own keeper, and answered `too_much_contention` with nobody else selling.
    // One round trip: WATCH, then the read it guards.
    let mut read = redis::pipe();
    read.cmd("WATCH").arg(&watched).ignore().get(&keys.stock);
    let stock = match bounded_until(
        store,
        read_by,
        read.query_async::<(Option<i64>,)>(&mut *conn),
    )
    .await
    {
        Ok((stock,)) => stock,
        Err(e) => {
            // Its WATCH may be active, or its reply still on the way: never pooled again.
            discard(conn);
            return Err(Failure::Redis(e));
        }
    };
    tracing::debug!(event = Event::StockRead.name(), order_id = %entry.order_id, stock, "stock read");
    let new_stock = match stock {
        None => {
            return Ok(Attempt::Done(
                unwatch(store, conn, Recorded::Unstocked).await,
            ));
        }
        Some(stock) if stock <= 0 => {
            return Ok(Attempt::Done(unwatch(store, conn, Recorded::SoldOut).await));
        }
        Some(stock) => stock - 1,
    };
    if !work.is_zero() {
        tokio::time::sleep(work).await;
    }
    if hangup.is_gone() {
        end_watch(store, conn).await;
        return Err(Failure::ClientGone);
    }
    // The connection holding the WATCH may have died during the work (Redis killed, or
    // restarted): an EXEC sent on it then fails as one lost after it was sent does, and the
    // sale answered 504 "may have sold" for a transaction that could not have run (found
    // from outside, 4 of 4). One PING first, small next to the work, tells them apart: if it
    // fails, no EXEC was sent, and nothing sold.
    if !work.is_zero()
        && let Err(e) = bounded(store, redis::cmd("PING").query_async::<()>(&mut *conn)).await
    {
        discard(conn);
        return Err(Failure::Redis(e));
    }
    let sell = store.optimistic_sell(entry, new_stock);
    let mut exec = redis::pipe();
    exec.atomic().invoke_script(&sell);
    // EXEC ends the WATCH whatever it answers.
    match bounded(store, exec.query_async::<Option<((i64, i64),)>>(&mut *conn)).await {
        Ok(None) => Ok(Attempt::Conflict),
        Ok(Some(((code, value),))) => {
            let recorded = Recorded::from_reply(code, value);
            match recorded {
                Recorded::Written(remaining) => acknowledged(store, conn, remaining).await,
                recorded => Ok(Attempt::Done(recorded)),
            }
        }
        Err(e) if is_noscript(&e) => {
            SCRIPT_LOADED.store(false, Ordering::Relaxed);
            Ok(Attempt::ScriptLoaded)
        }
        // Redis answered, and refused the transaction or the script before its first write
        // (a refusal such as NOREPLICAS comes back as the EXEC's error for its one command,
        // whose kind the client does not know; it answered 504 for a sale that certainly
        // did not land).
        Err(e)
            if matches!(e.kind(), redis::ErrorKind::Server(_))
                || crate::store::write_refusal(&e).is_some()
                || crate::store::is_auth_error(&e) =>
        {
            Err(Failure::Redis(e))
        }
        Err(e) => {
            discard(conn);
            Err(Failure::Unknown(e))
        }
    }
}

/// With `REPLICA_ACKS`, the written sale is acknowledged by that many replicas before it
/// answers 200, as every other strategy's: `WAIT` right behind the `EXEC`, on its
/// connection, whose last write the `EXEC` is. Without it, a failover lost sales answered
/// 200 that the other strategies answered `not_replicated`.
async fn acknowledged(
    store: &Store,
    mut conn: deadpool_redis::Connection,
    remaining: i64,
) -> Result<Attempt, Failure> {
    let replication = store.replication();
    if replication.acks == 0 {
        return Ok(Attempt::Done(Recorded::Written(remaining)));
    }
    let mut wait = redis::cmd("WAIT");
    wait.arg(replication.acks)
        .arg(replication.timeout.as_millis().max(1) as u64);
    let until = Instant::now() + store.timeout() + replication.timeout;
    match bounded_until(store, until, wait.query_async::<i64>(&mut *conn)).await {
        Ok(acked) if acked >= i64::from(replication.acks) => {
            Ok(Attempt::Done(Recorded::Written(remaining)))
        }
        Ok(acked) => Ok(Attempt::Done(Recorded::NotReplicated { remaining, acked })),
        // Written on the master, and nothing known of the replicas; its reply may still
        // be on the way, so the connection is not pooled again.
        Err(_) => {
            discard(conn);
            Ok(Attempt::Done(Recorded::NotReplicated {
                remaining,
                acked: 0,
            }))
        }
    }
}

/// Ends the WATCH of an attempt that will not write; a connection that cannot say so is
/// closed rather than pooled with its WATCH.
async fn unwatch(store: &Store, conn: deadpool_redis::Connection, outcome: Recorded) -> Recorded {
    end_watch(store, conn).await;
    outcome
}

/// Gives the connection back to the pool without its WATCH (or closes it, when Redis does
/// not answer the `UNWATCH`).
async fn end_watch(store: &Store, mut conn: deadpool_redis::Connection) {
    let unwatch = redis::cmd("UNWATCH");
    if bounded(store, unwatch.query_async::<()>(&mut *conn))
        .await
        .is_err()
    {
        discard(conn);
    }
}

/// Takes the connection out of the pool for good and closes it: Redis forgets its WATCH
/// and any MULTI with it.
fn discard(conn: deadpool_redis::Connection) {
    drop(deadpool_redis::Connection::take(conn));
}

fn is_noscript(e: &RedisError) -> bool {
    e.code() == Some("NOSCRIPT") || e.to_string().contains("NOSCRIPT")
}

/// One exchange on the pooled connection, under `REDIS_TIMEOUT_MS`.
async fn bounded<T>(
    store: &Store,
    exchange: impl std::future::Future<Output = RedisResult<T>>,
) -> RedisResult<T> {
    bounded_until(store, Instant::now() + store.timeout(), exchange).await
}

async fn bounded_until<T>(
    store: &Store,
    until: Instant,
    exchange: impl std::future::Future<Output = RedisResult<T>>,
) -> RedisResult<T> {
    let result = match tokio::time::timeout_at(until, exchange).await {
        Ok(result) => result,
        Err(_) => Err(unanswered()),
    };
    let result = result.map_err(slot_moving);
    if let Err(e) = &result {
        store.metrics().redis_error();
        // On a cluster, a MOVED or ASK here means the item's slot is served elsewhere now.
        store.after_error(e);
    }
    result
}

fn unanswered() -> RedisError {
    RedisError::from(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        "redis did not answer in time",
    ))
}

/// On a cluster, an `EXEC` whose queued command met the item's slot in migration (`ASK`,
/// `TRYAGAIN`) or moved (`MOVED`) is discarded whole: nothing was written, and the sale can
/// be tried again once the move is over. Said as `TRYAGAIN` (a 503), not as the aborted
/// transaction it arrives as (a 500 for a command Redis refused as wrong).
fn slot_moving(e: RedisError) -> RedisError {
    let redirected = [
        "TryAgain",
        "Ask",
        "Moved",
        "ClusterDown",
        "TRYAGAIN",
        "ASK ",
        "MOVED",
    ];
    if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::ExecAbort)
        && redirected.iter().any(|r| e.to_string().contains(r))
    {
        return RedisError::from((
            redis::ErrorKind::Server(redis::ServerErrorKind::TryAgain),
            "transaction discarded: the item's slot is moving",
            e.to_string(),
        ));
    }
    e
}

//! Direct hand-off (`LOCK_WAIT=notify`): a release hands the lock to the first live queued
//! waiter. A waiter that died or gave up must never stall the queue, and a handed-over lock
//! has exactly one owner.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use inventory::config::WaitMode;
use inventory::lock::{LockError, Locks, RedisLock, Strategy};
use inventory::metrics::Metrics;
use inventory::store::{Keys, Store, scripts};
use redis::AsyncCommands;
use redis::aio::MultiplexedConnection;
use tokio::time::Instant;

use testkit::fixture::RedisServer;

const TTL_MS: u64 = 30_000;

/// One attempt of `owner` at the string lock: `phase` as in lock_queued.lua.
async fn attempt(
    c: &mut MultiplexedConnection,
    k: &Keys,
    owner: &str,
    inbox: &str,
    phase: &str,
    entry_ms: u64,
) -> (i64, i64) {
    scripts::lock_queued(k, inbox, owner, "string", TTL_MS, 0, phase, entry_ms)
        .invoke_async(c)
        .await
        .unwrap()
}

async fn release(c: &mut MultiplexedConnection, k: &Keys, owner: &str) -> i64 {
    scripts::unlock_owned(&k.lock, k, owner)
        .invoke_async(c)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_waiter_that_dies_while_queued_does_not_stall_the_next_one() {
    let redis = RedisServer::start().await;
    let mut c = redis.conn().await;
    let k = Keys::new("001");
    assert_eq!(attempt(&mut c, &k, "a", "inbox:a", "try", 1000).await.0, 1);
    // b queues first, with an entry valid for 50 ms, and is never heard of again.
    assert_eq!(attempt(&mut c, &k, "b", "inbox:b", "try", 50).await.0, 0);
    assert_eq!(attempt(&mut c, &k, "c", "inbox:c", "try", 5000).await.0, 0);
    tokio::time::sleep(Duration::from_millis(120)).await;

    assert_eq!(release(&mut c, &k, "a").await, 1);
    let holder: Option<String> = c.get(&k.lock).await.unwrap();
    assert_eq!(holder.as_deref(), Some("c"), "the dead waiter was skipped");
    assert!(c.pttl::<_, i64>(&k.lock).await.unwrap() > 0, "with a lease");
    let to_c: Vec<String> = c.lrange("inbox:c", 0, -1).await.unwrap();
    assert_eq!(to_c, ["0|string|c"]);
    let to_b: i64 = c.llen("inbox:b").await.unwrap();
    assert_eq!(to_b, 0);

    // c's own attempt (a refresh racing the message) finds it holds the lock, and takes
    // the message back so that nobody acts on it twice.
    assert_eq!(
        attempt(&mut c, &k, "c", "inbox:c", "wait", 5000).await,
        (1, 0)
    );
    assert_eq!(c.llen::<_, i64>("inbox:c").await.unwrap(), 0);
    // Nobody left in the queue: the next release deletes and signals.
    assert_eq!(release(&mut c, &k, "c").await, 1);
    assert!(!c.exists::<_, bool>(&k.lock).await.unwrap());
    assert_eq!(c.llen::<_, i64>(&k.signal).await.unwrap(), 1);
}

#[tokio::test]
async fn a_waiter_leaving_the_queue_takes_a_lock_handed_to_it_meanwhile_or_leaves_cleanly() {
    let redis = RedisServer::start().await;
    let mut c = redis.conn().await;
    let k = Keys::new("001");
    attempt(&mut c, &k, "a", "inbox:a", "try", 1000).await;
    attempt(&mut c, &k, "b", "inbox:b", "try", 1000).await;
    attempt(&mut c, &k, "c", "inbox:c", "try", 1000).await;
    // c gives up while a still holds: it leaves the queue and is never handed anything.
    assert_eq!(
        attempt(&mut c, &k, "c", "inbox:c", "leave", 1000).await.0,
        0
    );
    release(&mut c, &k, "a").await;
    // b gives up just after the hand-off: its last attempt takes the lock.
    assert_eq!(
        attempt(&mut c, &k, "b", "inbox:b", "leave", 1000).await,
        (1, 0)
    );
    release(&mut c, &k, "b").await;
    assert!(
        !c.exists::<_, bool>(&k.lock).await.unwrap(),
        "c was not queued"
    );
    // A nested acquire of the non-reentrant lock still waits on itself, queue or not.
    attempt(&mut c, &k, "d", "inbox:d", "try", 1000).await;
    assert_eq!(attempt(&mut c, &k, "d", "inbox:d", "try", 1000).await.0, 0);
    assert_eq!(attempt(&mut c, &k, "d", "inbox:d", "wait", 1000).await.0, 0);
    assert_eq!(
        attempt(&mut c, &k, "d", "inbox:d", "leave", 1000).await.0,
        0
    );
}

fn locks(redis: &RedisServer) -> (Store, Locks) {
    let store = Store::new(
        &redis.url(),
        "001",
        Duration::from_secs(2),
        Arc::new(Metrics::default()),
    )
    .unwrap();
    let locks = Locks::new(
        store.clone(),
        Duration::from_millis(TTL_MS),
        WaitMode::Notify,
        Duration::ZERO,
    );
    (store, locks)
}

#[tokio::test]
async fn a_handed_off_lock_is_owned_by_exactly_one_and_fence_tokens_only_grow() {
    let redis = RedisServer::start().await;
    let mut c = redis.conn().await;
    for lock in [RedisLock::LuaRelease, RedisLock::Fenced] {
        let inside = Arc::new(AtomicBool::new(false));
        let newest = Arc::new(AtomicU64::new(0));
        let sections = Arc::new(AtomicU64::new(0));
        let mut tasks = Vec::new();
        for instance in 0..4 {
            let (store, locks) = locks(&redis);
            let locks = Arc::new(locks);
            for worker in 0..3 {
                let (locks, store) = (locks.clone(), store.clone());
                let (inside, newest, sections) = (inside.clone(), newest.clone(), sections.clone());
                tasks.push(tokio::spawn(async move {
                    let end = Instant::now() + Duration::from_millis(1500);
                    let mut n = 0;
                    while Instant::now() < end {
                        n += 1;
                        let owner: Arc<str> = format!("i{instance}:w{worker}:{n}").into();
                        let deadline = Instant::now() + Duration::from_secs(5);
                        let guard = locks
                            .acquire(Strategy::Redis(lock), &owner, deadline, false)
                            .await
                            .unwrap();
                        assert!(!inside.swap(true, Ordering::SeqCst), "two owners at once");
                        let key = &store.keys.lock;
                        let mut c = store
                            .client()
                            .await
                            .unwrap()
                            .get_multiplexed_async_connection()
                            .await
                            .unwrap();
                        let owns = if lock == RedisLock::LuaRelease {
                            c.get::<_, Option<String>>(key).await.unwrap().as_deref()
                                == Some(&*owner)
                        } else {
                            let fields: Vec<String> = c.hkeys(key).await.unwrap();
                            fields == [owner.to_string()]
                        };
                        assert!(owns, "the lock key names its one owner");
                        if let Some(token) = guard.fence() {
                            assert!(newest.swap(token, Ordering::SeqCst) < token, "tokens grow");
                        }
                        sections.fetch_add(1, Ordering::Relaxed);
                        inside.store(false, Ordering::SeqCst);
                        locks.release(guard).await.unwrap();
                    }
                }));
            }
        }
        for task in tasks {
            task.await.unwrap();
        }
        assert!(
            sections.load(Ordering::Relaxed) > 12,
            "{lock:?}: every worker got in"
        );
        assert!(!c.exists::<_, bool>(&Keys::new("001").lock).await.unwrap());
    }
}

#[tokio::test]
async fn a_lock_handed_to_a_cancelled_waiter_passes_on_at_once() {
    let redis = RedisServer::start().await;
    let (_s1, holder) = locks(&redis);
    let (_s2, quitter) = locks(&redis);
    let (_s3, patient) = locks(&redis);
    let strategy = Strategy::Redis(RedisLock::Fenced);
    let far = || Instant::now() + Duration::from_secs(10);
    let a: Arc<str> = "a".into();
    let held = holder.acquire(strategy, &a, far(), false).await.unwrap();

    // b queues, then its sale is cancelled (the future dropped) while its entry is valid.
    let b: Arc<str> = "b".into();
    let cancelled = tokio::time::timeout(
        Duration::from_millis(100),
        quitter.acquire(strategy, &b, far(), false),
    )
    .await;
    assert!(cancelled.is_err(), "b was still waiting");
    let c: Arc<str> = "c".into();
    let waiting = tokio::spawn(async move {
        let started = Instant::now();
        let guard = patient.acquire(strategy, &c, far(), false).await;
        (guard.map(|g| g.fence()), started)
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let released_at = Instant::now();
    holder.release(held).await.unwrap();
    let (fence, _) = waiting.await.unwrap();
    let fence = match fence {
        Ok(fence) => fence,
        Err(LockError::Timeout { .. }) => panic!("c timed out"),
        Err(e) => panic!("{e:?}"),
    };
    // Far less than the 30 s lease b's hand-off would otherwise hold the lock for.
    assert!(
        released_at.elapsed() < Duration::from_secs(2),
        "{:?}",
        released_at.elapsed()
    );
    // b's hand-off drew token 2 and was released; c drew 3.
    assert_eq!(fence, Some(3));
}

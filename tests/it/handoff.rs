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

use crate::harness::scripts_run;

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
    let reply: Vec<i64> =
        scripts::lock_queued(k, inbox, owner, "string", TTL_MS, 0, phase, entry_ms, 1)
            .invoke_async(c)
            .await
            .unwrap();
    (reply[0], reply[1])
}

async fn release(c: &mut MultiplexedConnection, k: &Keys, owner: &str) -> i64 {
    scripts::unlock_owned(&k.lock, k, owner, 0)
        .invoke_async(c)
        .await
        .unwrap()
}

/// The number of critical sections per tenure that a release passes on reaches the next
/// holder with the lock, whichever release script hands it over, and reads back.
#[tokio::test]
async fn a_release_passes_its_number_of_critical_sections_on_with_the_lock() {
    let redis = RedisServer::start().await;
    let mut c = redis.conn().await;
    let k = Keys::new("001");
    assert_eq!(attempt(&mut c, &k, "a", "inbox:a", "try", 1000).await.0, 1);
    assert_eq!(attempt(&mut c, &k, "b", "inbox:b", "try", 5000).await.0, 0);
    let released: i64 = scripts::unlock_owned(&k.lock, &k, "a", 7 * 256 + 128)
        .invoke_async(&mut c)
        .await
        .unwrap();
    assert_eq!(released, 1);
    let to_b: Vec<String> = c.lrange("inbox:b", 0, -1).await.unwrap();
    assert_eq!(to_b, ["0|0|0|1920|0|string|b"]);

    // A hash lock's release script passes it on the same way.
    let k = Keys::new("002");
    let queued = |owner: &'static str, inbox: &'static str| {
        scripts::lock_queued(&k, inbox, owner, "hash", TTL_MS, 0, "try", 5000, 1)
    };
    let first: Vec<i64> = queued("a", "inbox:c").invoke_async(&mut c).await.unwrap();
    assert_eq!(first[0], 1);
    let second: Vec<i64> = queued("d", "inbox:d").invoke_async(&mut c).await.unwrap();
    assert_eq!(second[0], 0);
    let released: i64 = scripts::unlock_reentrant(&k, "a", TTL_MS, 300)
        .invoke_async(&mut c)
        .await
        .unwrap();
    assert_eq!(released, 1);
    let to_d: Vec<String> = c.lrange("inbox:d", 0, -1).await.unwrap();
    assert_eq!(to_d, ["0|0|0|300|0|hash|d"]);
}

/// The wait of the next in line, in milliseconds, as a hand-off message tells it.
fn next_waited(message: &str) -> u64 {
    let numbers: Vec<&str> = message.split('|').take(5).collect();
    numbers[4]
        .parse()
        .unwrap_or_else(|_| panic!("five numbers first: {message}"))
}

/// A hand-off tells the new holder how long the next instance in line has waited (its tenure
/// ends early when that wait nears its bound): measured from that waiter's arrival in the
/// queue, by Redis's clock, at the hand-off; 0 when nobody is next, when the next entry is
/// past its deadline, or when it is the new holder's own instance's.
#[tokio::test]
async fn a_hand_off_says_how_long_the_next_in_line_has_waited() {
    let redis = RedisServer::start().await;
    let mut c = redis.conn().await;
    let k = Keys::new("001");
    assert_eq!(attempt(&mut c, &k, "a", "inbox:a", "try", 1000).await.0, 1);
    assert_eq!(attempt(&mut c, &k, "b", "inbox:x", "try", 5000).await.0, 0);
    let queued = Instant::now();
    assert_eq!(attempt(&mut c, &k, "c", "inbox:y", "try", 5000).await.0, 0);
    tokio::time::sleep(Duration::from_millis(60)).await;
    assert_eq!(release(&mut c, &k, "a").await, 1);
    let bound = queued.elapsed().as_millis() as u64;
    let to_x: Vec<String> = c.lrange("inbox:x", 0, -1).await.unwrap();
    let waited = next_waited(&to_x[0]);
    assert!(
        (60..=bound).contains(&waited),
        "c waited {waited} ms (at least 60, at most {bound}): {to_x:?}"
    );
    attempt(&mut c, &k, "b", "inbox:x", "wait", 5000).await;
    assert_eq!(release(&mut c, &k, "b").await, 1);
    let to_y: Vec<String> = c.lrange("inbox:y", 0, -1).await.unwrap();
    assert_eq!(next_waited(&to_y[0]), 0, "nobody after c: {to_y:?}");
    attempt(&mut c, &k, "c", "inbox:y", "wait", 5000).await;

    // The next entry is past its deadline: its wait means nothing, the next release skips it.
    assert_eq!(attempt(&mut c, &k, "d", "inbox:z", "try", 5000).await.0, 0);
    assert_eq!(attempt(&mut c, &k, "e", "inbox:w", "try", 30).await.0, 0);
    tokio::time::sleep(Duration::from_millis(80)).await;
    assert_eq!(release(&mut c, &k, "c").await, 1);
    let to_z: Vec<String> = c.lrange("inbox:z", 0, -1).await.unwrap();
    assert_eq!(next_waited(&to_z[0]), 0, "e's entry ran out: {to_z:?}");
    attempt(&mut c, &k, "d", "inbox:z", "wait", 5000).await;

    // The next entry is the new holder's own instance's: served within its tenure.
    assert_eq!(attempt(&mut c, &k, "f", "inbox:v", "try", 5000).await.0, 0);
    assert_eq!(attempt(&mut c, &k, "g", "inbox:v", "try", 5000).await.0, 0);
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(release(&mut c, &k, "d").await, 1);
    let to_v: Vec<String> = c.lrange("inbox:v", 0, -1).await.unwrap();
    assert_eq!(next_waited(&to_v[0]), 0, "g is v's own: {to_v:?}");
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
    assert_eq!(
        to_c,
        ["0|0|0|0|0|string|c"],
        "nobody behind c, token 0 (unfenced), c"
    );
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

/// The hand-off says how many other instances still have waiters queued (the new holder's
/// tenure is shared with them, its own instance's waiters are served within it), and the
/// holder's own attempt still takes that message back. A waiter that leaves, or forgets
/// its place because its own instance passed it the lock, is no longer counted.
#[tokio::test]
async fn a_hand_off_counts_the_other_instances_waiting_and_is_taken_back_whatever_the_count() {
    let redis = RedisServer::start().await;
    let mut c = redis.conn().await;
    let k = Keys::new("001");
    assert_eq!(attempt(&mut c, &k, "a", "inbox:a", "try", 1000).await.0, 1);
    // Instance x queues b; instance y queues c and d; instance z queues e, then forgets it.
    for (waiter, inbox) in [("b", "x"), ("c", "y"), ("d", "y"), ("e", "z")] {
        let inbox = format!("inbox:{inbox}");
        assert_eq!(attempt(&mut c, &k, waiter, &inbox, "try", 5000).await.0, 0);
    }
    assert_eq!(
        attempt(&mut c, &k, "e", "inbox:z", "forget", 5000).await,
        (0, 0)
    );
    assert_eq!(release(&mut c, &k, "a").await, 1);
    let to_x: Vec<String> = c.lrange("inbox:x", 0, -1).await.unwrap();
    let [to_x] = to_x.as_slice() else {
        panic!("one message: {to_x:?}")
    };
    assert!(
        to_x.starts_with("1|0|0|0|") && to_x.ends_with("|string|b"),
        "only y waits besides x: {to_x}"
    );
    assert_eq!(
        attempt(&mut c, &k, "b", "inbox:x", "wait", 5000).await,
        (1, 0)
    );
    assert_eq!(c.llen::<_, i64>("inbox:x").await.unwrap(), 0);
    assert_eq!(release(&mut c, &k, "b").await, 1);
    let to_y: Vec<String> = c.lrange("inbox:y", 0, -1).await.unwrap();
    assert_eq!(
        to_y,
        ["0|0|0|0|0|string|c"],
        "d is y's own: nobody else waits"
    );
    assert_eq!(
        attempt(&mut c, &k, "d", "inbox:y", "leave", 5000).await.0,
        0
    );
    let counts: std::collections::HashMap<String, i64> = c.hgetall(&k.queue_inboxes).await.unwrap();
    assert!(counts.is_empty(), "{counts:?}");
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

/// Four instances of three sales each, on one lock: whatever path the lock takes (handed
/// over by a release, passed between one instance's sales within a tenure, or taken free),
/// one owner at a time, the Redis key naming that owner, and fencing tokens that strictly
/// grow from one critical section to the next. With tenures, an instance's sales take the
/// lock from each other without asking Redis: fewer attempts than critical sections.
#[tokio::test]
async fn a_handed_off_lock_is_owned_by_exactly_one_and_fence_tokens_only_grow() {
    let redis = RedisServer::start().await;
    let mut c = redis.conn().await;
    let default_tenure = None;
    let no_tenure = Some(Duration::ZERO);
    for (lock, tenure) in [
        (RedisLock::LuaRelease, default_tenure),
        (RedisLock::Fenced, default_tenure),
        (RedisLock::Fenced, no_tenure),
    ] {
        let inside = Arc::new(AtomicBool::new(false));
        let newest = Arc::new(AtomicU64::new(0));
        let sections = Arc::new(AtomicU64::new(0));
        let mut tasks = Vec::new();
        let mut all_locks = Vec::new();
        for instance in 0..4 {
            let (store, locks) = locks(&redis);
            let locks = Arc::new(match tenure {
                Some(t) => locks.with_tenure(t),
                None => locks,
            });
            all_locks.push(locks.clone());
            for worker in 0..3 {
                let (locks, store) = (locks.clone(), store.clone());
                let (inside, newest, sections) = (inside.clone(), newest.clone(), sections.clone());
                tasks.push(tokio::spawn(async move {
                    let end = Instant::now() + Duration::from_millis(1500);
                    let mut n = 0;
                    let mut c = store
                        .client()
                        .await
                        .unwrap()
                        .get_multiplexed_async_connection()
                        .await
                        .unwrap();
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
                        let held_as = guard.redis_owner().to_string();
                        let owns = if lock == RedisLock::LuaRelease {
                            c.get::<_, Option<String>>(key).await.unwrap() == Some(held_as)
                        } else {
                            let fields: Vec<String> = c.hkeys(key).await.unwrap();
                            fields == [held_as]
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
        let sections = sections.load(Ordering::Relaxed);
        assert!(sections > 12, "{lock:?}: every worker got in");
        let attempts: u64 = all_locks.iter().map(|l| l.attempts()).sum();
        if tenure == no_tenure {
            assert!(
                attempts >= sections,
                "{attempts} attempts, {sections} sections"
            );
        } else {
            assert!(
                attempts < sections,
                "{lock:?}: {attempts} attempts for {sections} sections: no lock was passed"
            );
        }
        // A lock parked for a sale that never came goes back by itself.
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!c.exists::<_, bool>(&Keys::new("001").lock).await.unwrap());
    }
}

/// Every pair of the strategies whose lock is handed over and passed within tenures, selling
/// the same item from two instances at once: still one owner at a time, and a sale of a
/// fenced strategy always holds a token of its own, never a lock passed from a sale of the
/// other strategy (whose lock has another shape, and maybe no token).
#[tokio::test]
async fn every_pair_of_handed_over_strategies_excludes_each_other_and_fenced_sales_keep_tokens() {
    let redis = RedisServer::start().await;
    let kinds = [
        RedisLock::LuaRelease,
        RedisLock::Reentrant,
        RedisLock::Watchdog,
        RedisLock::Fenced,
    ];
    let instances: Vec<Arc<Locks>> = (0..2).map(|_| Arc::new(locks(&redis).1)).collect();
    for (i, &first) in kinds.iter().enumerate() {
        for &second in &kinds[i + 1..] {
            let inside = Arc::new(AtomicBool::new(false));
            let tokens = Arc::new(std::sync::Mutex::new(Vec::new()));
            let mut tasks = Vec::new();
            for (n, lock) in [first, second, first, second].into_iter().enumerate() {
                for (i, locks) in instances.iter().enumerate() {
                    let (locks, inside, tokens) = (locks.clone(), inside.clone(), tokens.clone());
                    tasks.push(tokio::spawn(async move {
                        let end = Instant::now() + Duration::from_millis(400);
                        let mut k = 0;
                        while Instant::now() < end {
                            k += 1;
                            // Unique per sale, as an instance's owner ids are.
                            let owner: Arc<str> = format!("i{i}:{lock:?}:{n}:{k}").into();
                            let deadline = Instant::now() + Duration::from_secs(5);
                            let guard = locks
                                .acquire(Strategy::Redis(lock), &owner, deadline, false)
                                .await
                                .unwrap();
                            assert!(
                                !inside.swap(true, Ordering::SeqCst),
                                "{first:?} + {second:?}: two owners at once"
                            );
                            let fenced = lock == RedisLock::Fenced;
                            assert_eq!(guard.fence().is_some(), fenced, "{lock:?}");
                            if let Some(token) = guard.fence() {
                                tokens.lock().unwrap().push(token);
                            }
                            tokio::task::yield_now().await;
                            inside.store(false, Ordering::SeqCst);
                            locks.release(guard).await.unwrap();
                        }
                    }));
                }
            }
            for task in tasks {
                task.await.unwrap();
            }
            let tokens = tokens.lock().unwrap();
            assert!(
                tokens.windows(2).all(|w| w[0] < w[1]),
                "{first:?} + {second:?}: {tokens:?}"
            );
        }
    }
}

/// A sale that releases while another instance waits, with nobody of its own to pass the
/// lock to: the lock goes to the waiter then, not at the end of the lease (30 s), which is
/// what a lock parked for a next sale that never comes would cost.
#[tokio::test]
async fn a_lock_nobody_here_wants_goes_to_the_next_instance_at_once() {
    let redis = RedisServer::start().await;
    let (_s1, here) = locks(&redis);
    let (_s2, there) = locks(&redis);
    let here = here.with_tenure(Duration::from_millis(1000));
    let strategy = Strategy::Redis(RedisLock::Fenced);
    let a: Arc<str> = "a".into();
    let held = here
        .acquire(strategy, &a, Instant::now() + Duration::from_secs(5), false)
        .await
        .unwrap();
    let first = held.fence().unwrap_or(0);
    let waiting = tokio::spawn(async move {
        let b: Arc<str> = "b".into();
        let deadline = Instant::now() + Duration::from_secs(10);
        let guard = there.acquire(strategy, &b, deadline, false).await?;
        let fence = guard.fence();
        there.release(guard).await?;
        Ok::<_, LockError>(fence)
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    here.release(held).await.unwrap();
    let handed = tokio::time::timeout(Duration::from_secs(2), waiting)
        .await
        .expect("handed over within 2 s of the release")
        .unwrap()
        .unwrap();
    // a's grant drew its tenure's block of 16: the hand-off's is above all of it (further
    // up when Redis's clock has passed the counter: every draw lifts it to the clock).
    assert!(
        handed >= Some(first + 16),
        "{handed:?} within a's block from {first}"
    );
}

/// A sale that waits behind a sale of its own instance waits here only for the rest of the
/// tenure; a holder that keeps the lock longer sends it to Redis, and its deadline still
/// holds: a timeout, not a hang, and the lock is had again once the holder lets go.
#[tokio::test]
async fn a_sale_behind_a_long_holder_of_its_own_instance_times_out_at_its_deadline() {
    let redis = RedisServer::start().await;
    let (_s, locks) = locks(&redis);
    let strategy = Strategy::Redis(RedisLock::LuaRelease);
    let a: Arc<str> = "a".into();
    let held = locks
        .acquire(strategy, &a, Instant::now() + Duration::from_secs(5), false)
        .await
        .unwrap();
    let b: Arc<str> = "b".into();
    let started = Instant::now();
    let refused = locks
        .acquire(strategy, &b, started + Duration::from_millis(300), false)
        .await;
    assert!(
        matches!(refused, Err(LockError::Timeout { .. })),
        "{:?}",
        refused.map(|g| g.fence())
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    locks.release(held).await.unwrap();
    let c: Arc<str> = "c".into();
    let again = locks
        .acquire(strategy, &c, Instant::now() + Duration::from_secs(2), false)
        .await
        .unwrap();
    locks.release(again).await.unwrap();
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
    let first = held.fence().unwrap_or(0);

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
    // Each grant draws its tenure's block of 16 tokens: a drew the first 16, b's hand-off
    // the next 16 and was released; c's starts at least 32 above a's (more when Redis's
    // clock has passed the counter: every draw lifts it to the clock).
    assert!(
        fence >= Some(first + 32),
        "{fence:?}: within the blocks from {first}"
    );
}

/// An instance stopping right after a sale, before its scheduler ever runs the task that would
/// give back the lock parked for a next sale: closing its locks gives it back, so the other
/// instances do not wait out a 30 s lease. Two runtimes, so that the one that sold can end
/// with that task never run, as a process's does when `main` returns.
#[test]
fn a_closed_instance_gives_back_its_parked_lock_even_when_its_runtime_ends_at_once() {
    let runtime = || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    };
    let outside = runtime();
    let redis = outside.block_on(RedisServer::start());
    let lock_key = Keys::new("001").lock;
    for close in [false, true] {
        let selling = runtime();
        selling.block_on(async {
            let (_s, locks) = locks(&redis);
            let locks = locks.with_tenure(Duration::from_millis(1000));
            let owner: Arc<str> = format!("sale-{close}").into();
            let deadline = Instant::now() + Duration::from_secs(5);
            let strategy = Strategy::Redis(RedisLock::Fenced);
            let guard = locks
                .acquire(strategy, &owner, deadline, false)
                .await
                .unwrap();
            locks.release(guard).await.unwrap();
            if close {
                locks.close().await;
            }
        });
        drop(selling);
        let left = outside.block_on(async {
            let client = redis::Client::open(redis.url()).unwrap();
            let mut c = client.get_multiplexed_async_connection().await.unwrap();
            let left: bool = c.exists(&lock_key).await.unwrap();
            let _: () = c.del(&lock_key).await.unwrap();
            left
        });
        // Without the close, the lock outlives the process: the reason the server closes.
        assert_eq!(left, !close, "close={close}");
    }
}

/// Eight sales of one instance wanting a lock that another instance holds: one of them stands
/// in the Redis queue, the others wait behind it here; when the lock comes, all eight have it
/// in turn, one owner at a time, with a handful of attempts in Redis rather than one (and a
/// leave) per sale.
#[tokio::test(flavor = "multi_thread")]
async fn an_instances_sales_stand_once_in_the_redis_queue_and_all_get_the_lock() {
    let redis = RedisServer::start().await;
    let (_s1, holder) = locks(&redis);
    let (store, queued) = locks(&redis);
    // A tenure long enough for all eight, however slow the machine.
    let queued = Arc::new(queued.with_tenure(Duration::from_millis(1000)));
    let strategy = Strategy::Redis(RedisLock::Fenced);
    let a: Arc<str> = "holder".into();
    let far = || Instant::now() + Duration::from_secs(10);
    let held = holder.acquire(strategy, &a, far(), false).await.unwrap();
    let inside = Arc::new(AtomicBool::new(false));
    let sales: Vec<_> = (0..8)
        .map(|n| {
            let (queued, inside) = (queued.clone(), inside.clone());
            tokio::spawn(async move {
                let owner: Arc<str> = format!("sale{n}").into();
                let guard = queued.acquire(strategy, &owner, far(), false).await?;
                assert!(!inside.swap(true, Ordering::SeqCst), "two holders at once");
                tokio::time::sleep(Duration::from_millis(2)).await;
                inside.store(false, Ordering::SeqCst);
                let fence = guard.fence();
                queued.release(guard).await?;
                Ok::<_, LockError>(fence)
            })
        })
        .collect();
    let mut c = redis::Client::open(redis.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    // However slow the machine: the first to stand there, then time for any other to join.
    let started = Instant::now();
    while c.zcard::<_, u64>(&store.keys.queue).await.unwrap() == 0 {
        assert!(started.elapsed() < Duration::from_secs(5), "nobody queued");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let standing: u64 = c.zcard(&store.keys.queue).await.unwrap();
    assert_eq!(standing, 1, "one sale of the instance in the Redis queue");
    let attempts_before = queued.attempts();
    holder.release(held).await.unwrap();
    let mut fences = Vec::new();
    for sale in sales {
        let fence = tokio::time::timeout(Duration::from_secs(5), sale)
            .await
            .expect("every sale gets the lock")
            .unwrap()
            .unwrap();
        fences.push(fence.expect("a fenced sale has a token"));
    }
    fences.sort_unstable();
    fences.dedup();
    assert_eq!(fences.len(), 8, "a token of its own each: {fences:?}");
    assert!(
        queued.attempts() - attempts_before <= 3,
        "{} attempts after the release",
        queued.attempts() - attempts_before
    );
}

/// Six sales of one instance arrive one after another while another instance holds the lock
/// for a while: one stands in the Redis queue, the others wait behind it and look again
/// every so often. They must get the lock in the order they arrived, however often they
/// looked: a sale that joins again keeps its place (it used to go to the back, so a busy
/// instance could pass one sale over until its deadline).
#[tokio::test(flavor = "multi_thread")]
async fn an_instances_sales_get_the_lock_in_the_order_they_arrived() {
    let redis = RedisServer::start().await;
    let (_s1, other) = locks(&redis);
    let (_s2, here) = locks(&redis);
    let here = Arc::new(here.with_tenure(Duration::from_millis(1000)));
    let strategy = Strategy::Redis(RedisLock::Fenced);
    let far = || Instant::now() + Duration::from_secs(10);
    let a: Arc<str> = "other".into();
    let held = other.acquire(strategy, &a, far(), false).await.unwrap();
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut sales = Vec::new();
    for n in 0..6 {
        let (here, order) = (here.clone(), order.clone());
        sales.push(tokio::spawn(async move {
            let owner: Arc<str> = format!("sale{n}").into();
            let guard = here.acquire(strategy, &owner, far(), false).await?;
            order.lock().unwrap().push(n);
            tokio::time::sleep(Duration::from_millis(5)).await;
            here.release(guard).await?;
            Ok::<_, LockError>(())
        }));
        // Apart enough to arrive in order, close enough that all wait through rechecks.
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    // Several rechecks (every 50 ms) happen while the other instance holds on.
    tokio::time::sleep(Duration::from_millis(200)).await;
    other.release(held).await.unwrap();
    for sale in sales {
        tokio::time::timeout(Duration::from_secs(5), sale)
            .await
            .expect("every sale gets the lock")
            .unwrap()
            .unwrap();
    }
    assert_eq!(*order.lock().unwrap(), vec![0, 1, 2, 3, 4, 5]);
}

/// Twelve sales of one instance in a loop, each holding the lock 20-60 ms, longer than a
/// tenure: each must wait about one round of the others, never much more. A sale that has
/// waited here must not be overtaken in Redis by one that just arrived (the releasing sale's
/// own next one, say), or it can be passed over until its deadline.
#[tokio::test(flavor = "multi_thread")]
async fn sales_of_one_instance_holding_past_their_tenure_take_turns() {
    let redis = RedisServer::start().await;
    let (_s, here) = locks(&redis);
    let here = Arc::new(here);
    let strategy = Strategy::Redis(RedisLock::Fenced);
    let waits = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for n in 0..12u64 {
        let (here, waits) = (here.clone(), waits.clone());
        tasks.push(tokio::spawn(async move {
            let end = Instant::now() + Duration::from_secs(3);
            let mut k = 0u64;
            while Instant::now() < end {
                k += 1;
                let owner: Arc<str> = format!("s{n}-{k}").into();
                let asked = Instant::now();
                let deadline = asked + Duration::from_secs(10);
                let guard = here.acquire(strategy, &owner, deadline, false).await?;
                waits.lock().unwrap().push(asked.elapsed());
                let work = 20 + (n * 37 + k * 53) % 41;
                tokio::time::sleep(Duration::from_millis(work)).await;
                here.release(guard).await?;
            }
            Ok::<_, LockError>(())
        }));
    }
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    let longest = waits.lock().unwrap().iter().copied().max().unwrap();
    // A round of the other eleven is at most 11 x 60 ms; twice that leaves room for a slow
    // machine, and a sale passed over waits seconds.
    assert!(
        longest < Duration::from_millis(1500),
        "a sale waited {longest:?}"
    );
}

/// `a` takes the lock as "a:1", `b` queues for it in Redis as "b:1", and `a` lets go: the
/// guard `b` was handed, and the token `a` held.
async fn hand_over(
    c: &mut MultiplexedConnection,
    keys: &Keys,
    strategy: Strategy,
    a: &Locks,
    b: Arc<Locks>,
) -> (inventory::lock::Guard, Option<u64>) {
    let deadline = || Instant::now() + Duration::from_secs(5);
    let held = a
        .acquire(strategy, &"a:1".into(), deadline(), false)
        .await
        .unwrap();
    let first = held.fence();
    let waiter =
        tokio::spawn(async move { b.acquire(strategy, &"b:1".into(), deadline(), false).await });
    // b stands in the Redis queue before a lets go.
    let queued = Instant::now();
    while c.zcard::<_, u64>(&keys.queue).await.unwrap() == 0 {
        assert!(queued.elapsed() < Duration::from_secs(5), "b never queued");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    a.release(held).await.unwrap();
    (waiter.await.unwrap().unwrap(), first)
}

/// A fenced lock handed over from the Redis queue comes with the tokens of its tenure, drawn
/// in the same step as the hand-off: the sale the tenure passes the lock to next gets the
/// following token without a round trip of its own, and the holder after the tenure draws
/// above the whole block. Without tenures a grant draws exactly one token.
#[tokio::test]
async fn a_fenced_lock_handed_over_brings_the_tokens_of_its_tenure() {
    let redis = RedisServer::start().await;
    let mut c = redis.conn().await;
    let fenced = Strategy::Redis(RedisLock::Fenced);
    let keys = Keys::new("001");
    for tenure in [None, Some(Duration::ZERO)] {
        let (_, a) = locks(&redis);
        let (_, b) = locks(&redis);
        let (a, b) = match tenure {
            Some(t) => (a.with_tenure(t), b.with_tenure(t)),
            None => (a, b),
        };
        let b = Arc::new(b);
        let deadline = || Instant::now() + Duration::from_secs(5);
        let (handed, first) = hand_over(&mut c, &keys, fenced, &a, b.clone()).await;
        let first = first.unwrap();
        let token = handed.fence().unwrap();
        assert!(token > first, "{tenure:?}: {token} after {first}");
        let counter: u64 = c.get(&keys.fence).await.unwrap();
        let block = if tenure.is_some() { 1 } else { 16 };
        assert_eq!(
            counter,
            token + block - 1,
            "{tenure:?}: the hand-off drew {block} token(s)"
        );
        // The extension of the hand-off's short lease is the one script of its own.
        assert!(handed.lease_confirmed().await);
        let before = scripts_run(&mut c).await;
        b.release(handed).await.unwrap();
        let next = b
            .acquire(fenced, &"b:2".into(), deadline(), false)
            .await
            .unwrap();
        // A release with nobody waiting parks the lock for one scheduler turn; on a loaded
        // machine that turn can end before the next acquire, which then goes to Redis and
        // draws above the whole block. Either way the token goes up; a pass must also take
        // the block's next one and run no script.
        let passed = tenure.is_none() && scripts_run(&mut c).await == before;
        if passed {
            assert_eq!(next.fence(), Some(token + 1), "the block's next token");
        } else {
            assert!(next.fence() > Some(counter), "{:?}", next.fence());
        }
        b.release(next).await.unwrap();
        // The next holder from Redis draws above everything drawn so far.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let drawn: u64 = c.get(&keys.fence).await.unwrap();
        let after = a
            .acquire(fenced, &"a:2".into(), deadline(), false)
            .await
            .unwrap();
        assert!(after.fence() > Some(drawn.max(token + block - 1)));
        a.release(after).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A release hands the lock over with a short lease (1 s here against a 30 s lease): a
/// waiter that died after its last refresh, while its entry was still valid, holds the item
/// up for that second, not a whole lease. A live waiter's own next attempt finds it holds
/// the lock and extends the lease to its own in the same step.
#[tokio::test]
async fn a_lock_handed_over_has_a_short_lease_until_its_waiter_takes_it() {
    let redis = RedisServer::start().await;
    let mut c = redis.conn().await;
    let k = Keys::new("001");
    assert_eq!(attempt(&mut c, &k, "a", "inbox:a", "try", 5000).await.0, 1);
    // b queues with an entry valid for 5 s and never refreshes it: as if its instance died.
    assert_eq!(attempt(&mut c, &k, "b", "inbox:b", "try", 5000).await.0, 0);
    assert_eq!(release(&mut c, &k, "a").await, 1);
    let holder: Option<String> = c.get(&k.lock).await.unwrap();
    assert_eq!(holder.as_deref(), Some("b"), "handed to b");
    let pttl: i64 = c.pttl(&k.lock).await.unwrap();
    assert!(
        (1..=1000).contains(&pttl),
        "a handed lock's lease is at most 1 s, not the 30 s lease: {pttl}"
    );
    // Nobody extends it: it is free again within that second.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert!(!c.exists::<_, bool>(&k.lock).await.unwrap());

    // A live waiter taking its hand-off extends it to its own lease.
    assert_eq!(attempt(&mut c, &k, "c", "inbox:c", "try", 5000).await.0, 1);
    assert_eq!(attempt(&mut c, &k, "d", "inbox:d", "try", 5000).await.0, 0);
    assert_eq!(release(&mut c, &k, "c").await, 1);
    assert!(c.pttl::<_, i64>(&k.lock).await.unwrap() <= 1000);
    assert_eq!(
        attempt(&mut c, &k, "d", "inbox:d", "wait", 5000).await,
        (1, 0)
    );
    let pttl: i64 = c.pttl(&k.lock).await.unwrap();
    assert!(pttl > 20_000, "extended to the lease: {pttl}");
}

/// The instance that hears of a hand-off from its inbox extends the short lease at once,
/// and a sale learns that before it writes: held, here. Every shape of lock handed over.
#[tokio::test]
async fn a_waiter_woken_by_a_hand_off_extends_its_short_lease() {
    let redis = RedisServer::start().await;
    let mut c = redis.conn().await;
    let keys = Keys::new("001");
    for lock in [
        RedisLock::LuaRelease,
        RedisLock::Reentrant,
        RedisLock::Fenced,
    ] {
        let strategy = Strategy::Redis(lock);
        let (_, a) = locks(&redis);
        let (_, b) = locks(&redis);
        let b = Arc::new(b);
        let (handed, _) = hand_over(&mut c, &keys, strategy, &a, b.clone()).await;
        assert!(handed.lease_confirmed().await, "{lock:?}: extended");
        assert!(!handed.is_lost(), "{lock:?}");
        let pttl: i64 = c.pttl(&keys.lock).await.unwrap();
        assert!(
            pttl > 20_000,
            "{lock:?}: the lease is the holder's own: {pttl}"
        );
        b.release(handed).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A lock that nothing renews (`lua-release`, `reentrant`) is safe for work shorter than its
/// lease, however it was had: one passed within a tenure gets a whole lease again, as one
/// taken from Redis does. X (40 ms of work) takes the lock at instance A, Y (280 ms, under
/// the 300 ms lease) is passed it at A within the tenure, and Z at B waits in Redis: Y's work
/// outlived what X had left of the lease, Z took the lock and both sold the same unit
/// (19-20 of 20 rounds, found from outside).
#[tokio::test(flavor = "multi_thread")]
async fn a_lock_passed_within_a_tenure_has_a_whole_lease_for_strategies_that_do_not_renew() {
    let cluster = testkit::fixture::Cluster::start(2, |b| {
        b.env("LOCK_TTL_MS", 300).env("LOCK_TENURE_MS", 1000)
    })
    .await;
    let (a, b) = (&cluster.instances[0], &cluster.instances[1]);
    for strategy in ["reentrant", "lua-release"] {
        a.reset(100).await;
        let mut answers = Vec::new();
        for _ in 0..5 {
            let first = format!("strategy={strategy}&work_ms=40");
            let x = a.sale(&first);
            let y = async {
                tokio::time::sleep(Duration::from_millis(5)).await;
                a.sale(&format!("strategy={strategy}&work_ms=280")).await
            };
            let z = async {
                tokio::time::sleep(Duration::from_millis(15)).await;
                b.sale(&format!("strategy={strategy}")).await
            };
            let (x, y, z) = tokio::join!(x, y, z);
            answers.extend([x.status, y.status, z.status]);
        }
        let audit = a.audit().await;
        let sold = answers.iter().filter(|s| **s == 200).count();
        assert_eq!(audit["clean"], true, "{strategy}: {audit}");
        assert_eq!(
            (audit["sales"].as_u64(), audit["remaining"].as_u64()),
            (Some(sold as u64), Some(100 - sold as u64)),
            "{strategy}: {answers:?} {audit}"
        );
    }
}

//! Behaviour under failure: Redis stopping and freezing, an instance dying with its lock,
//! retried sales, shutdown, metrics, request ids and secrets. Every wait is for a condition,
//! bounded by a deadline.

use std::future::Future;
use std::time::{Duration, Instant};

use inventory::events::Event;
use inventory::store::Keys;
use redis::AsyncCommands;
use testkit::fixture::{Cluster, Instance, InstanceBuilder, LockNodes, RedisServer, Reply};

/// Polls `check` until it is true or `within` passes; the time it took, if it became true.
async fn within<F, Fut>(within: Duration, mut check: F) -> Option<Duration>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let started = Instant::now();
    while started.elapsed() < within {
        if check().await {
            return Some(started.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    None
}

const REDIS_TIMEOUT_MS: u64 = 400;

/// An instance on `redis` under [`REDIS_TIMEOUT_MS`], whose quorum strategies lock on three
/// nodes of their own: they stay up whatever happens to `redis`.
async fn instance_with_lock_nodes(redis: &RedisServer) -> (LockNodes, Instance) {
    let nodes = LockNodes::start(3).await;
    let app = InstanceBuilder::new(redis, "app1")
        .env("REDIS_TIMEOUT_MS", REDIS_TIMEOUT_MS)
        .lock_nodes(&nodes)
        .start()
        .await;
    (nodes, app)
}

/// A Redis that keeps its data across a restart, and one instance on it whose calls time out
/// after [`REDIS_TIMEOUT_MS`]: the setting of every test that stops and restarts Redis.
async fn durable_redis_and_instance() -> (RedisServer, Instance) {
    let redis = RedisServer::start_durable().await;
    let app = InstanceBuilder::new(&redis, "app1")
        .env("REDIS_TIMEOUT_MS", REDIS_TIMEOUT_MS)
        .start()
        .await;
    (redis, app)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_redis_outage_gets_fast_503s_and_sales_resume_within_two_seconds_of_its_return() {
    let (mut redis, app) = durable_redis_and_instance().await;
    app.reset(10).await;
    assert_eq!(app.sale("").await.status, 200);

    // Refused connections: Redis is gone.
    redis.stop().await;
    for strategy in ["fenced", "atomic", "setnx", "local"] {
        let sale = app.sale(&format!("strategy={strategy}")).await;
        assert_eq!(
            (sale.status, sale.error_code()),
            (503, "redis_unavailable"),
            "{strategy}: {sale:?}"
        );
        assert!(
            sale.elapsed < Duration::from_millis(REDIS_TIMEOUT_MS + 600),
            "{strategy}: {sale:?}"
        );
    }
    let ready = app.get("/ready").await;
    assert_eq!(
        (ready.status, ready.error_code()),
        (503, "redis_unavailable")
    );
    assert_eq!(app.get("/health").await.status, 200, "alive without Redis");

    redis.restart().await;
    let recovered = within(Duration::from_secs(2), || async {
        app.sale("").await.status == 200
    })
    .await;
    assert!(
        recovered.is_some(),
        "no sale within 2 s of Redis's return\n{}",
        app.log()
    );
    assert_eq!(app.get("/ready").await.status, 200);

    let audit = app.audit().await;
    assert_eq!(
        audit["lost_updates"], 0,
        "every recorded sale decremented, once: {audit}"
    );
    assert_eq!(audit["oversold"], 0, "{audit}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_frozen_redis_costs_a_sale_the_timeout_and_leaves_no_lock_behind() {
    let redis = RedisServer::start().await;
    let app = InstanceBuilder::new(&redis, "app1")
        .env("REDIS_TIMEOUT_MS", REDIS_TIMEOUT_MS)
        .start()
        .await;
    app.reset(10).await;

    // Hung connections: Redis accepts but does not answer.
    redis.signal("STOP").await;
    let sale = app.sale("strategy=fenced").await;
    redis.signal("CONT").await;
    assert_eq!(
        (sale.status, sale.error_code()),
        (503, "redis_unavailable"),
        "{sale:?}"
    );
    assert!(
        sale.elapsed < Duration::from_millis(REDIS_TIMEOUT_MS + 600),
        "{sale:?}"
    );

    // The acquire queued in the frozen server ran when it woke; the release sent behind it
    // undid it, so the next sale does not wait out a 30 s lease.
    let next = app.sale("strategy=fenced").await;
    assert_eq!(next.status, 200, "{next:?}");
    assert!(next.elapsed < Duration::from_secs(2), "{next:?}");
    let audit = app.audit().await;
    assert_eq!(audit["lost_updates"], 0, "{audit}");
}

/// Every strategy, one sale at a time against a frozen Redis, each after a sale that left
/// its connections warm (a pooled one included, whose checkout pings it first): each
/// answers within about one timeout. `optimistic` answered after two (the checkout's ping
/// waited out one, then its WATCH another).
#[tokio::test(flavor = "multi_thread")]
async fn a_frozen_redis_costs_a_sale_of_any_strategy_about_one_timeout() {
    let redis = RedisServer::start().await;
    let (_nodes, app) = instance_with_lock_nodes(&redis).await;
    for strategy in inventory::strategy::Strategy::ALL {
        let query = format!("strategy={}", strategy.name());
        app.reset(10).await;
        let warm = app.sale(&query).await;
        assert_eq!(warm.status, 200, "{query}: {warm:?}");
        redis.signal("STOP").await;
        let sale = app.sale(&query).await;
        redis.signal("CONT").await;
        assert!(
            matches!(sale.status, 503 | 504),
            "{query}: answered {} with Redis frozen: {sale:?}",
            sale.status
        );
        assert!(
            sale.elapsed < Duration::from_millis(REDIS_TIMEOUT_MS + 400),
            "{query}: {:?} with a {REDIS_TIMEOUT_MS} ms timeout: {sale:?}",
            sale.elapsed
        );
        let next = within(Duration::from_secs(3), || async {
            app.sale(&query).await.status == 200
        })
        .await;
        assert!(next.is_some(), "{query}: no sale after the thaw");
    }
}

/// Redis refusing writes (out of memory under `noeviction`; too few replicas for
/// `min-replicas-to-write`): every strategy
/// answers 503 `redis_unavailable` saying why, sells nothing and keeps no idempotency key,
/// and sells again, the same key too, once Redis takes writes. They answered 500.
#[tokio::test(flavor = "multi_thread")]
async fn redis_refusing_writes_gets_every_strategy_a_503_that_sold_nothing() {
    let redis = RedisServer::start().await;
    let (_nodes, app) = instance_with_lock_nodes(&redis).await;
    let mut conn = redis.conn().await;
    let refusals: [(&str, &[&str], &[&str]); 2] = [
        (
            "OOM",
            &["maxmemory-policy", "noeviction", "maxmemory", "1"],
            &["maxmemory", "0"],
        ),
        (
            "NOREPLICAS",
            &["min-replicas-to-write", "1"],
            &["min-replicas-to-write", "0"],
        ),
    ];
    for (name, refuse, accept) in refusals {
        for strategy in inventory::strategy::Strategy::ALL {
            if !strategy.info().distributed {
                continue;
            }
            let query = format!("strategy={}", strategy.name());
            app.reset(10).await;
            let sold = app.sale(&query).await;
            assert_eq!(sold.status, 200, "{query}: {sold:?}");
            let mut set = redis::cmd("CONFIG");
            set.arg("SET").arg(refuse);
            let () = set.query_async(&mut conn).await.expect("refuse writes");
            let key = format!("{name}-{}", strategy.name());
            let refused = app.sale_with_key(&query, &key).await;
            // Without a key the lock's own write is the first refused: in a pipeline
            // (`SET NX` with `PTTL`), whose error named no code, it answered 500.
            let unkeyed = app.sale(&query).await;
            let mut set = redis::cmd("CONFIG");
            set.arg("SET").arg(accept);
            let () = set.query_async(&mut conn).await.expect("take writes");
            assert_eq!(
                (refused.status, refused.error_code()),
                (503, "redis_unavailable"),
                "{name} {query}: {refused:?}\n{}",
                app.log()
            );
            assert!(
                refused.body["message"]
                    .as_str()
                    .is_some_and(|m| m.contains(name) || m.contains("memory")),
                "{name} {query}: the message says why: {refused:?}"
            );
            assert_eq!(
                (unkeyed.status, unkeyed.error_code()),
                (503, "redis_unavailable"),
                "{name} {query}, no key: {unkeyed:?}\n{}",
                app.log()
            );
            let retried = app.sale_with_key(&query, &key).await;
            assert_eq!(retried.status, 200, "{name} {query}: {retried:?}");
            let audit = app.audit().await;
            assert_eq!(audit["sales"], 2, "{name} {query}: {audit}");
            assert_eq!(audit["clean"], true, "{name} {query}: {audit}");
        }
    }
}

/// Sales in line for the lock while Redis is frozen: each answers about the timeout, not
/// one timeout per sale ahead of it. Before, every sale in line got the lock in turn and
/// waited out its own call (12 sales: up to 12 timeouts), and a sale at the end of the line
/// could still sell after the freeze, long after the first 503 said Redis was down.
#[tokio::test(flavor = "multi_thread")]
async fn a_frozen_redis_costs_every_sale_in_line_about_the_timeout_not_one_timeout_each() {
    const IN_LINE: usize = 12;
    let redis = RedisServer::start().await;
    // Only the stock's Redis freezes, where `redlock-fenced` draws its token with the
    // quorum held.
    let (_nodes, app) = instance_with_lock_nodes(&redis).await;
    for strategy in [
        "fenced",
        "lua-release",
        "watchdog",
        "setnx-ttl",
        "redlock",
        "redlock-fenced",
    ] {
        app.reset(100).await;
        redis.signal("STOP").await;
        let query = format!("strategy={strategy}");
        let sales = (0..IN_LINE).map(|_| app.sale(&query));
        let sales = futures_util::future::join_all(sales).await;
        redis.signal("CONT").await;
        // The holder's own call may be answered only just past the timeout, then a sale
        // standing in the Redis queue for its next attempt, then a look every 50 ms.
        let bound = Duration::from_millis(3 * REDIS_TIMEOUT_MS + 600);
        for sale in &sales {
            assert!(
                matches!(sale.status, 503 | 504),
                "{strategy}: a sale answered {} with Redis frozen: {sale:?}",
                sale.status
            );
            assert!(
                sale.elapsed < bound,
                "{strategy}: a sale in line took {:?}, beyond {bound:?}: {:?}",
                sale.elapsed,
                sales.iter().map(|s| s.elapsed).collect::<Vec<_>>()
            );
        }
        // Nothing those sales left behind stops the next one, and none of them sold.
        let next = app.sale(&query).await;
        assert_eq!(next.status, 200, "{strategy}: {next:?}");
        let audit = app.audit().await;
        assert_eq!(audit["sales"], 1, "{strategy}: {audit}");
        assert_eq!(audit["clean"], true, "{strategy}: {audit}");
    }
}

/// Sales in line for the lock while Redis is stopped (connections refused, not left
/// unanswered): each answers 503 within about the timeout, however many stand in line.
/// Before, the sale standing in the Redis queue for its instance failed fast, the next took
/// its place and failed in its turn, and so on: 24 sales answered one after the other,
/// about 0.15 s apart. Contended first, so that the sales wait in line in the instance.
#[tokio::test(flavor = "multi_thread")]
async fn a_stopped_redis_answers_every_sale_in_line_within_about_the_timeout() {
    const IN_LINE: usize = 24;
    let (mut redis, app) = durable_redis_and_instance().await;
    for strategy in [
        "fenced",
        "lua-release",
        "watchdog",
        "reentrant",
        "setnx-ttl",
    ] {
        app.reset(1000).await;
        let query = format!("strategy={strategy}");
        let warm = futures_util::future::join_all((0..16).map(|_| app.sale(&query))).await;
        assert!(warm.iter().all(|r| r.status == 200), "{strategy}: {warm:?}");
        redis.stop().await;
        let sales = futures_util::future::join_all((0..IN_LINE).map(|_| app.sale(&query))).await;
        let bound = Duration::from_millis(2 * REDIS_TIMEOUT_MS + 500);
        let took: Vec<Duration> = sales.iter().map(|s| s.elapsed).collect();
        for sale in &sales {
            assert_eq!(
                (sale.status, sale.error_code()),
                (503, "redis_unavailable"),
                "{strategy}: {sale:?}"
            );
            assert!(
                sale.elapsed < bound,
                "{strategy}: a sale in line took {:?}, beyond {bound:?}: {took:?}",
                sale.elapsed
            );
        }
        redis.restart().await;
        // Back by itself, and nothing the refused sales left behind holds the lock.
        let back = Instant::now();
        loop {
            let next = app.sale(&query).await;
            if next.status == 200 {
                break;
            }
            assert!(
                back.elapsed() < Duration::from_secs(5),
                "{strategy}: no sale after Redis came back: {next:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let audit = app.audit().await;
        assert_eq!(audit["sales"], 17, "{strategy}: {audit}");
        assert_eq!(audit["clean"], true, "{strategy}: {audit}");
    }
}

/// Redis freezing during a locked sale's work: its write goes unanswered (504, it may have
/// sold), and the sale answers after that one timeout, not after a second one spent on its
/// release, which goes out without being waited for. Once Redis thaws, the lock is free
/// again at once (the release lands), not after its lease.
#[tokio::test(flavor = "multi_thread")]
async fn a_sale_whose_write_redis_left_unanswered_answers_without_waiting_out_its_release() {
    const TIMEOUT_MS: u64 = 800;
    let redis = RedisServer::start().await;
    let app = InstanceBuilder::new(&redis, "app1")
        .env("REDIS_TIMEOUT_MS", TIMEOUT_MS)
        .env("LOCK_TTL_MS", 30_000)
        .start()
        .await;
    for strategy in [
        "lua-release",
        "reentrant",
        "watchdog",
        "fenced",
        "setnx-ttl",
    ] {
        app.reset(10).await;
        let query = format!("strategy={strategy}&work_ms=300");
        let (sale, _) = tokio::join!(app.sale(&query), async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            redis.signal("STOP").await;
        });
        redis.signal("CONT").await;
        assert!(matches!(sale.status, 503 | 504), "{strategy}: {sale:?}");
        let bound = Duration::from_millis(300 + TIMEOUT_MS + 500);
        assert!(
            sale.elapsed < bound,
            "{strategy}: answered after {:?}, beyond {bound:?}",
            sale.elapsed
        );
        // The release lands once Redis answers: the next sale does not wait out a lease.
        let next = app.sale(&format!("strategy={strategy}")).await;
        assert_eq!(next.status, 200, "{strategy}: {next:?}");
        assert!(
            next.elapsed < Duration::from_secs(3),
            "{strategy}: {next:?}"
        );
        let audit = app.audit().await;
        assert_eq!(audit["clean"], true, "{strategy}: {audit}");
    }
}

/// An instance killed while one of its sales stands in the Redis queue, holding nothing:
/// the next release hands the lock to that dead waiter (its entry was refreshed within the
/// last second), with a short lease that nobody extends, so the sales behind it wait about
/// a second more, not a whole lease (8 s here; 9.3 s for the sale behind before).
#[tokio::test(flavor = "multi_thread")]
async fn a_waiter_killed_while_queued_holds_the_lock_up_about_a_second_not_a_lease() {
    const TTL_MS: u64 = 8_000;
    let cluster = Cluster::start(2, |b| b.env("LOCK_TTL_MS", TTL_MS)).await;
    let (app1, app2) = (&cluster.instances[0], &cluster.instances[1]);
    app1.reset(100).await;
    let started = Instant::now();
    let (holder, behind) = tokio::join!(app1.sale("strategy=fenced&work_ms=1500"), async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        // Sent by hand: it dies with its instance.
        let url = app2.url("/inventory/sale?strategy=fenced");
        let doomed = tokio::spawn(async move { reqwest::Client::new().post(url).send().await });
        tokio::time::sleep(Duration::from_millis(100)).await;
        let (behind, _) = tokio::join!(app1.sale("strategy=fenced"), async {
            tokio::time::sleep(Duration::from_millis(900)).await;
            app2.signal("KILL").await;
        });
        assert!(
            doomed.await.unwrap().is_err(),
            "the queued sale died with app2"
        );
        behind
    });
    assert_eq!(holder.status, 200, "{holder:?}");
    assert_eq!(behind.status, 200, "{behind:?}");
    // The holder's 1.5 s, the dead waiter's short lease (1 s), and a look after the queue
    // stalled (250 ms), with room for a slow machine; far below the 8 s lease.
    let bound = Duration::from_millis(4_000);
    let at = started.elapsed();
    assert!(
        at < bound,
        "the sale behind the dead waiter answered after {at:?}"
    );
    let audit = app1.audit().await;
    assert_eq!(audit["sales"], 2, "{audit}");
    assert_eq!(audit["clean"], true, "{audit}");
}

/// The other side of the short lease of a hand-off: a waiter whose instance was paused past
/// it (SIGSTOP) while the lock moved on never writes beside the next holder. Its instance
/// wakes while app1's next sale holds the lock: the extension of the hand-off finds the lock
/// someone else's and the sale is refused (nothing written), or its own next attempt finds
/// it held and waits its turn. `lua-release`, which has no fencing token to catch a write
/// under a lost lock: an overlap would sell one stock value twice.
#[tokio::test(flavor = "multi_thread")]
async fn a_waiter_paused_past_its_hand_offs_short_lease_never_writes_beside_the_next_holder() {
    let cluster = Cluster::start(2, |b| b.env("LOCK_TTL_MS", 8_000)).await;
    let (app1, app2) = (&cluster.instances[0], &cluster.instances[1]);
    app1.reset(100).await;
    let (holder, (paused, behind)) =
        tokio::join!(app1.sale("strategy=lua-release&work_ms=1000"), async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            tokio::join!(app2.sale("strategy=lua-release"), async {
                // app2's sale stands in the Redis queue; its instance stops before the
                // holder lets go, and wakes after the handed lease ran out, while app1's
                // next sale holds the lock.
                tokio::time::sleep(Duration::from_millis(200)).await;
                app2.signal("STOP").await;
                tokio::time::sleep(Duration::from_millis(900)).await;
                let (behind, _) =
                    tokio::join!(app1.sale("strategy=lua-release&work_ms=1500"), async {
                        tokio::time::sleep(Duration::from_millis(1400)).await;
                        app2.signal("CONT").await;
                    });
                behind
            })
        });
    assert_eq!(holder.status, 200, "{holder:?}");
    assert_eq!(behind.status, 200, "{behind:?}");
    assert!(
        [200, 409].contains(&paused.status),
        "the paused waiter: {paused:?}"
    );
    let sold = [&holder, &paused, &behind]
        .iter()
        .filter(|r| r.status == 200)
        .count();
    let audit = app1.audit().await;
    assert_eq!(audit["sales"], sold, "{audit}");
    assert_eq!(audit["clean"], true, "two holders at once: {audit}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_lock_held_by_a_killed_instance_expires_within_its_ttl() {
    const TTL_MS: u64 = 1_000;
    let cluster = Cluster::start(2, |b| b.env("LOCK_TTL_MS", TTL_MS)).await;
    let (holder, survivor) = (&cluster.instances[0], &cluster.instances[1]);
    holder.reset(5).await;
    let keys = Keys::new("001");
    let mut c = cluster.redis.conn().await;

    // Sent by hand: this request dies with the instance, and that is the point.
    let url = holder.url("/inventory/sale?strategy=watchdog&work_ms=30000");
    let long_sale = tokio::spawn(async move { reqwest::Client::new().post(url).send().await });
    let killed_at = {
        let held = cluster
            .redis
            .wait_for_key(&keys.lock, true, Duration::from_secs(5))
            .await;
        assert!(held.is_some(), "the watchdog sale never took the lock");
        holder.signal("KILL").await;
        Instant::now()
    };
    assert!(
        long_sale.await.unwrap().is_err(),
        "the sale died with its instance"
    );
    let pttl: i64 = c.pttl(&keys.lock).await.unwrap();
    assert!(
        pttl <= TTL_MS as i64,
        "the dead holder's lease is at most one TTL: {pttl}"
    );
    let gone = cluster
        .redis
        .wait_for_key(&keys.lock, false, Duration::from_millis(TTL_MS + 500))
        .await;
    assert!(
        gone.is_some(),
        "the lock outlived its TTL: the watchdog did not die with its process"
    );
    assert!(killed_at.elapsed() < Duration::from_millis(TTL_MS + 600));
    let sale = survivor.sale("strategy=watchdog").await;
    assert_eq!(sale.status, 200, "{sale:?}");
    assert_eq!(survivor.audit().await["clean"], true);
}

fn order_id(reply: &Reply) -> String {
    reply.body["order_id"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_retried_sale_with_an_idempotency_key_replays_the_first_on_either_instance() {
    let cluster = Cluster::start(2, |b| b).await;
    let (app1, app2) = (&cluster.instances[0], &cluster.instances[1]);
    app1.reset(5).await;

    let first = app1.sale_with_key("strategy=fenced", "order-42").await;
    assert_eq!(first.status, 200);
    assert!(first.headers.get("idempotent-replayed").is_none());
    for app in [app1, app2, app1] {
        let retry = app.sale_with_key("strategy=fenced", "order-42").await;
        assert_eq!(retry.status, 200, "{retry:?}");
        assert_eq!(order_id(&retry), order_id(&first), "same order id");
        assert_eq!(retry.body["remaining"], first.body["remaining"]);
        assert_eq!(
            retry
                .headers
                .get("idempotent-replayed")
                .map(|v| v.as_bytes()),
            Some(&b"true"[..])
        );
    }
    // The same key under another strategy is still the same sale.
    assert_eq!(
        order_id(&app2.sale_with_key("strategy=atomic", "order-42").await),
        order_id(&first)
    );
    let audit = app1.audit().await;
    assert_eq!(
        (audit["sales"].as_i64(), audit["remaining"].as_i64()),
        (Some(1), Some(4)),
        "{audit}"
    );

    let other = app2.sale_with_key("strategy=atomic", "order-43").await;
    assert_eq!(other.status, 200);
    assert_ne!(
        order_id(&other),
        order_id(&first),
        "a new key is a new sale"
    );

    let bad = app1.sale_with_key("", "no spaces allowed").await;
    assert_eq!((bad.status, bad.error_code()), (400, "bad_request"));
    assert!(
        bad.body["message"]
            .as_str()
            .unwrap()
            .contains("Idempotency-Key")
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_retry_while_the_first_attempt_is_in_flight_never_sells_twice() {
    let cluster = Cluster::start(2, |b| b).await;
    let (app1, app2) = (&cluster.instances[0], &cluster.instances[1]);
    app1.reset(5).await;
    let keys = Keys::new("001");
    let mut c = cluster.redis.conn().await;

    let first = app1.sale_with_key("strategy=fenced&work_ms=600", "slow-1");
    let retries = async {
        let claimed = cluster
            .redis
            .wait_for_key(&keys.idempotency("slow-1"), true, Duration::from_secs(5))
            .await;
        assert!(claimed.is_some());
        let (a, b) = tokio::join!(
            app2.sale_with_key("strategy=fenced", "slow-1"),
            app1.sale_with_key("strategy=atomic", "slow-1")
        );
        vec![a, b]
    };
    let (first, retries) = tokio::join!(first, retries);
    assert_eq!(first.status, 200);
    for retry in &retries {
        assert_eq!(
            (retry.status, retry.error_code()),
            (409, "in_progress"),
            "{retry:?}"
        );
    }
    let after = app2.sale_with_key("strategy=fenced", "slow-1").await;
    assert_eq!(order_id(&after), order_id(&first));
    let audit = app1.audit().await;
    assert_eq!(audit["sales"], 1, "{audit}");
    let kept: String = c.get(keys.idempotency("slow-1")).await.unwrap();
    assert!(kept.starts_with("sold:"), "{kept}");
}

/// Sends a keyed sale to `app` in a task of its own (its answer may never come: the test
/// kills or freezes `app`), and returns once the sale's claim is in Redis.
async fn keyed_sale_claimed(
    redis: &RedisServer,
    app: &Instance,
    query: &str,
    key: &str,
) -> tokio::task::JoinHandle<reqwest::Result<reqwest::Response>> {
    let original = tokio::spawn(
        testkit::fixture::client()
            .post(app.url(&format!("/inventory/sale?{query}")))
            .header("idempotency-key", key)
            .send(),
    );
    let claimed = redis
        .wait_for_key(
            &Keys::new("001").idempotency(key),
            true,
            Duration::from_secs(5),
        )
        .await;
    assert!(claimed.is_some(), "{key}: never claimed");
    original
}

/// An instance killed or frozen in the middle of a keyed sale stops extending its claim, so
/// a retry elsewhere hears `in_progress` for at most the claim's lease (5 s) and a lock's
/// lease, then sells (it heard `in_progress` for about 41 s: the wait budget, the work and
/// a 30 s margin). A frozen instance that wakes after the retry sold writes nothing, lock or
/// no lock (`atomic`: only the claim's check stands between it and a second unit): the
/// stock, the sales count and the ledger say one sale per key.
#[tokio::test(flavor = "multi_thread")]
async fn a_retry_sells_once_the_instance_holding_its_key_died_or_froze() {
    let redis = RedisServer::start().await;
    // The default lease (the harness gives 30 s): the dead holder's lock runs out in time.
    let start = |name: &'static str| {
        InstanceBuilder::new(&redis, name)
            .env("LOCK_TTL_MS", 5000)
            .start()
    };
    let (dying, freezing, retrying) = tokio::join!(start("app1"), start("app2"), start("app3"));
    retrying.reset(10).await;
    let keys = Keys::new("001");
    // (instance, strategy, key, how it stops)
    let cases = [
        (&dying, "fenced", "held-by-the-dead", "KILL"),
        (&freezing, "atomic", "held-by-the-frozen", "STOP"),
    ];
    for (app, strategy, key, signal) in cases {
        let query = format!("strategy={strategy}&work_ms=3000");
        let original = keyed_sale_claimed(&redis, app, &query, key).await;
        app.signal(signal).await;
        let stopped = Instant::now();
        let retry = loop {
            let retry = retrying.sale_with_key(&query, key).await;
            if retry.error_code() != "in_progress" || stopped.elapsed() > Duration::from_secs(30) {
                break retry;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        assert_eq!(retry.status, 200, "{key} after SIG{signal}: {retry:?}");
        // The claim's lease, then (for the lock held by the dead) the lock's, and the work.
        assert!(
            stopped.elapsed() < Duration::from_secs(15),
            "{key}: the retry sold {:?} after SIG{signal}",
            stopped.elapsed()
        );
        if signal == "STOP" {
            // It wakes, writes nothing, and tells its client what the key holds: the retry's
            // sale (it said "still in progress").
            app.signal("CONT").await;
            let original = original.await.unwrap().unwrap();
            let replayed = original.headers().get("idempotent-replayed").cloned();
            let body: serde_json::Value = original.json().await.unwrap();
            assert_eq!(
                replayed.as_ref().map(|v| v.as_bytes()),
                Some(&b"true"[..]),
                "{body}"
            );
            assert_eq!(body["order_id"], retry.body["order_id"], "{body}");
        } else {
            original.abort();
        }
    }
    // Frozen past the claim's lease with nobody retrying: it wakes to a key that holds
    // nothing, sells nothing, and says so.
    let key = "held-by-the-frozen-alone";
    let original = keyed_sale_claimed(&redis, &freezing, "strategy=atomic&work_ms=1000", key).await;
    freezing.signal("STOP").await;
    let gone = redis
        .wait_for_key(&keys.idempotency(key), false, Duration::from_secs(10))
        .await;
    freezing.signal("CONT").await;
    assert!(gone.is_some(), "the frozen attempt's claim never ran out");
    let original = original.await.unwrap().unwrap();
    assert_eq!(original.status().as_u16(), 409);
    let body: serde_json::Value = original.json().await.unwrap();
    assert!(
        body["message"]
            .as_str()
            .is_some_and(|m| m.contains("sold nothing")),
        "{body}"
    );
    let audit = retrying.audit().await;
    assert_eq!(audit["sales"], 2, "{audit}");
    assert_eq!(retrying.get("/inventory").await.body["stock"], 8);
    let mut c = redis.conn().await;
    for key in ["held-by-the-dead", "held-by-the-frozen"] {
        let kept: String = c.get(keys.idempotency(key)).await.unwrap();
        assert!(kept.contains("app3"), "{key}: {kept}");
    }
}

/// A live attempt keeps its claim however long it works: one that outlasts the claim's
/// lease (5 s) still sells, and a retry meanwhile hears `in_progress`, not a second sale.
#[tokio::test(flavor = "multi_thread")]
async fn a_keyed_sale_that_outlasts_its_claims_lease_keeps_the_key_and_sells_once() {
    let redis = RedisServer::start().await;
    let app = InstanceBuilder::new(&redis, "app1")
        .env("MAX_WORK_MS", 8000)
        .start()
        .await;
    app.reset(5).await;
    // `optimistic` watched the claim's key, so the claim's own extensions refused its EXEC.
    for strategy in ["watchdog", "atomic", "optimistic"] {
        let key = format!("long-{strategy}");
        let query = format!("strategy={strategy}&work_ms=7000");
        let (first, retry) = tokio::join!(app.sale_with_key(&query, &key), async {
            tokio::time::sleep(Duration::from_millis(6000)).await;
            app.sale_with_key(&query, &key).await
        });
        assert_eq!(first.status, 200, "{strategy}: {first:?}");
        assert_eq!(
            (retry.status, retry.error_code()),
            (409, "in_progress"),
            "{strategy}: {retry:?}"
        );
    }
    assert_eq!(app.audit().await["sales"], 3);
}

/// A sale that failed because Redis went away mid-sale answers "nothing sold, retry" (or
/// "outcome unknown, retry with the key"): once Redis is back, the retry with its
/// Idempotency-Key must sell (or replay what landed), not hear "in progress" until the claim
/// runs out (about 40 s; the settle that frees the key had failed on the same dead Redis and
/// was never tried again). Every way of selling: locked, lock-free, optimistic.
#[tokio::test(flavor = "multi_thread")]
async fn a_key_whose_sale_failed_with_redis_gone_sells_on_retry_once_redis_is_back() {
    let (mut redis, app) = durable_redis_and_instance().await;
    app.reset(100).await;
    // The naive locks stay out: their blind release is not sent late (it could delete the
    // next holder's lock), so their lock stays until its lease and the retry waits for that.
    for strategy in ["fenced", "lua-release", "watchdog", "atomic", "optimistic"] {
        let key = format!("gone-mid-sale-{strategy}");
        let sales_before = app.audit().await["sales"].as_i64().unwrap();
        let slow = format!("strategy={strategy}&work_ms=1000");
        let (first, ()) = tokio::join!(app.sale_with_key(&slow, &key), async {
            tokio::time::sleep(Duration::from_millis(300)).await;
            redis.stop().await;
        });
        assert!(
            [503, 504].contains(&first.status),
            "{strategy}: Redis was killed before the write: {first:?}"
        );
        redis.restart().await;
        let back = Instant::now();
        let retry = loop {
            let retry = app
                .sale_with_key(&format!("strategy={strategy}"), &key)
                .await;
            if retry.status == 200 || back.elapsed() > Duration::from_secs(5) {
                break retry;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert_eq!(
            retry.status,
            200,
            "{strategy}: the retry with its key, {:?} after Redis came back, after {first:?}: {retry:?}\n{}",
            back.elapsed(),
            app.log()
        );
        let audit = app.audit().await;
        assert_eq!(
            audit["sales"].as_i64().unwrap() - sales_before,
            1,
            "{strategy}: one sale for the key: {audit}"
        );
        assert_eq!(audit["clean"], true, "{strategy}: {audit}");
    }
}

/// A sale whose client hung up before the sale wrote sells nothing: the sale runs in a task
/// of its own (so that nothing is abandoned half-way), and it used to sell to nobody, for as
/// long as it could wait for the lock: clients that left in a queue kept buying stock after
/// them, each with a 504 in hand that invites buying again. Every way of selling, locked or
/// not: clients that give up while they wait for the lock, or during the work before the
/// write, buy nothing; the one that waits is sold to.
#[tokio::test(flavor = "multi_thread")]
async fn a_sale_whose_client_hung_up_before_it_wrote_sells_nothing() {
    let redis = RedisServer::start().await;
    let app = InstanceBuilder::new(&redis, "app1").start().await;
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(250))
        .build()
        .unwrap();
    for strategy in [
        "fenced",
        "lua-release",
        "watchdog",
        "reentrant",
        "owner-check",
        "setnx-ttl",
        "setnx",
        "optimistic",
        "atomic",
    ] {
        app.reset(100).await;
        let holder = format!("strategy={strategy}&work_ms=800");
        let (held, ()) = tokio::join!(app.sale(&holder), async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let url = app.url(&format!("/inventory/sale?strategy={strategy}&work_ms=600"));
            let quitters = (0..6).map(|_| impatient.post(&url).send());
            for gave_up in futures_util::future::join_all(quitters).await {
                assert!(
                    gave_up.as_ref().is_err_and(reqwest::Error::is_timeout),
                    "{strategy}: {gave_up:?}"
                );
            }
        });
        assert_eq!(held.status, 200, "{strategy}: {held:?}");
        // Long enough for two quitters to have had the lock and their work, and sold, as
        // they did before.
        tokio::time::sleep(Duration::from_millis(2 * 600 + 500)).await;
        let audit = app.audit().await;
        assert_eq!(
            (audit["sales"].as_i64(), audit["clean"].as_bool()),
            (Some(1), Some(true)),
            "{strategy}: only the client that waited bought: {audit}\n{}",
            app.log()
        );
        assert!(
            app.log().contains("client_gone"),
            "{strategy}: the refusals are logged"
        );
    }
}

/// The same, whatever else the client sent before it left. hyper sees a connection end only
/// while nothing of the client's is left unread: a client that pipelined a second sale, or
/// sent a stray `\r\n` after its request, and then closed, was never seen to leave; its first
/// sale and then its second sold, to nobody. Each way of leaving, for a locked, an optimistic
/// and a worked atomic sale; and a client that pipelines and stays is sold to, every request.
#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_left_with_bytes_unread_is_sold_nothing() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let redis = RedisServer::start().await;
    let app = InstanceBuilder::new(&redis, "app1").start().await;
    let address = crate::harness::host_port(&app);
    let request = |strategy: &str| {
        format!(
            "POST /inventory/sale?strategy={strategy}&work_ms=300 HTTP/1.1\r\nHost: x\r\n\
             Content-Length: 0\r\n\r\n"
        )
    };
    for strategy in ["fenced", "lua-release", "optimistic", "atomic"] {
        let leavings: [(&str, String, bool); 4] = [
            ("a pipelined second sale", request(strategy), false),
            ("a stray CRLF", "\r\n".to_owned(), false),
            ("one stray byte", "G".to_owned(), false),
            (
                "a pipelined sale, then a half-close",
                request(strategy),
                true,
            ),
        ];
        for (what, trailing, half_close) in leavings {
            app.reset(100).await;
            let mut client = tokio::net::TcpStream::connect(&address).await.unwrap();
            client
                .write_all(format!("{}{trailing}", request(strategy)).as_bytes())
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_millis(50)).await;
            if half_close {
                client.shutdown().await.unwrap();
            } else {
                drop(client);
            }
            // Both sales' work and writes, had they gone on, with room to spare.
            tokio::time::sleep(Duration::from_millis(2 * 300 + 400)).await;
            let audit = app.audit().await;
            assert_eq!(
                (audit["sales"].as_i64(), audit["clean"].as_bool()),
                (Some(0), Some(true)),
                "{strategy}, {what}: a client that left bought nothing: {audit}\n{}",
                app.log()
            );
        }
        // A client that pipelines and stays hears every answer, and each is a sale.
        app.reset(100).await;
        let mut client = tokio::net::TcpStream::connect(&address).await.unwrap();
        let pair = format!("{}{}", request(strategy), request(strategy));
        client.write_all(pair.as_bytes()).await.unwrap();
        let mut heard = Vec::new();
        let mut buffer = [0u8; 4096];
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while String::from_utf8_lossy(&heard)
            .matches("HTTP/1.1 200")
            .count()
            < 2
        {
            let read = tokio::time::timeout_at(deadline, client.read(&mut buffer))
                .await
                .expect("both answers within 10 s")
                .unwrap();
            assert!(
                read > 0,
                "{strategy}: closed early: {}",
                String::from_utf8_lossy(&heard)
            );
            heard.extend_from_slice(&buffer[..read]);
        }
        let audit = app.audit().await;
        assert_eq!(audit["sales"].as_i64(), Some(2), "{strategy}: {audit}");
    }
    assert!(app.log().contains("client_gone"), "the refusals are logged");
}

/// A client that left before its request was even read (the instance paused, or behind)
/// buys nothing either, however it left, on every path: the `atomic` sale without a key or
/// work runs in the request's own task, which was never told (it sold to 10 of 10 departed
/// clients from outside), and the others in a task of their own.
#[tokio::test(flavor = "multi_thread")]
async fn clients_that_left_before_a_paused_instance_read_their_requests_buy_nothing() {
    use tokio::io::AsyncWriteExt;
    let redis = RedisServer::start().await;
    let app = InstanceBuilder::new(&redis, "app1").start().await;
    let address = crate::harness::host_port(&app);
    for strategy in ["atomic", "fenced", "optimistic"] {
        let request = format!(
            "POST /inventory/sale?strategy={strategy} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"
        );
        for how in ["close", "pipelined, then close", "half-close"] {
            app.reset(100).await;
            app.signal("STOP").await;
            for _ in 0..5 {
                let mut client = tokio::net::TcpStream::connect(&address).await.unwrap();
                let sent = match how {
                    "pipelined, then close" => format!("{request}{request}"),
                    _ => request.clone(),
                };
                client.write_all(sent.as_bytes()).await.unwrap();
                if how == "half-close" {
                    client.shutdown().await.unwrap();
                    // Kept open on this side: only the client's sending side is shut.
                    tokio::spawn(async move {
                        tokio::time::sleep(Duration::from_secs(2)).await;
                        drop(client);
                    });
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            app.signal("CONT").await;
            tokio::time::sleep(Duration::from_millis(500)).await;
            let audit = app.audit().await;
            assert_eq!(
                (audit["sales"].as_i64(), audit["clean"].as_bool()),
                (Some(0), Some(true)),
                "{strategy}, {how}: {audit}\n{}",
                app.log()
            );
        }
    }
}

/// `/ready` reads `INFO` for the role and the eviction policy; a user that may run every
/// command a sale needs but `INFO` is still ready (the stock's Redis answered 503
/// `redis_auth_failed` while every sale sold, and such a lock node was listed "not ok"), and
/// the start says what cannot be checked.
#[tokio::test(flavor = "multi_thread")]
async fn a_redis_user_without_info_is_ready_and_sells() {
    let redis = RedisServer::start().await;
    let nodes = LockNodes::start(3).await;
    let no_info = [
        "ACL", "SETUSER", "no-info", "on", ">pw", "~*", "&*", "+@all", "-info",
    ];
    let mut urls = Vec::new();
    for server in std::iter::once(&redis).chain(&nodes.nodes) {
        let mut acl = redis::cmd(no_info[0]);
        acl.arg(&no_info[1..]);
        let () = acl.query_async(&mut server.conn().await).await.unwrap();
        urls.push(format!("redis://no-info:pw@127.0.0.1:{}", server.port()));
    }
    let app = InstanceBuilder::new(&redis, "app1")
        .env("REDIS_URL", &urls[0])
        .env("LOCK_NODES", urls[1..].join(","))
        .start()
        .await;
    let ready = app.get("/ready").await;
    assert_eq!(ready.status, 200, "{ready:?}");
    assert_eq!(
        crate::harness::node_states(&ready.body),
        [true, true, true],
        "{ready:?}"
    );
    app.reset(5).await;
    for strategy in ["fenced", "redlock-fenced"] {
        let sale = app.sale(&format!("strategy={strategy}")).await;
        assert_eq!(sale.status, 200, "{strategy}: {sale:?}");
    }
    assert!(app.log().contains("may not run INFO"), "{}", app.log());
}

/// Redis does not undo a script's writes when a later command of it fails, and an ACL user
/// may lack any command. From outside: a user without `XADD` had every sale answer 500 after
/// taking its unit, and one `Idempotency-Key` sold on each retry. For a user lacking each
/// command a sale or a reset writes with, and every way of selling: an answer is a sale
/// (200) or a 503 that sold nothing, never a 500; the stock, the sales count and the ledger
/// account for exactly the 200s; and a key refused there sells once on an instance allowed.
#[tokio::test(flavor = "multi_thread")]
async fn a_redis_user_without_a_command_sells_nothing_half_way() {
    let redis = RedisServer::start().await;
    let app = InstanceBuilder::new(&redis, "app1").start().await;
    let mut admin = redis.conn().await;
    let strategies = [
        "atomic",
        "fenced",
        "lua-release",
        "watchdog",
        "reentrant",
        "optimistic",
        "setnx-ttl",
    ];
    let keys = Keys::new("001");
    for lacking in [
        "XADD", "SETBIT", "INCR", "INCRBY", "DECRBY", "SET", "TIME", "GET",
    ] {
        let user = format!("no-{}", lacking.to_lowercase());
        let _: () = redis::cmd("ACL")
            .arg("SETUSER")
            .arg(&user)
            .arg("on")
            .arg(">pw")
            .arg("~*")
            .arg("&*")
            .arg("+@all")
            .arg(format!("-{}", lacking.to_lowercase()))
            .query_async(&mut admin)
            .await
            .unwrap();
        // Without GET a lock script stops half-way too, leaving its lock for its lease:
        // that sale waits it out (lock_timeout, nothing sold).
        let limited = InstanceBuilder::new(&redis, "limited")
            .env("LOCK_WAIT_MS", 1000)
            .env(
                "REDIS_URL",
                format!("redis://{user}:pw@127.0.0.1:{}", redis.port()),
            )
            .start()
            .await;
        let reset = limited.put_inventory(r#"{"stock": 50}"#, None).await;
        assert!(
            reset.status == 200 || reset.status == 503,
            "without {lacking}: a reset {reset:?}"
        );
        app.reset(50).await;
        let mut sold = 0;
        for strategy in strategies {
            let key = format!("{lacking}-{strategy}");
            let sale = limited
                .sale_with_key(&format!("strategy={strategy}"), &key)
                .await;
            match sale.status {
                200 => sold += 1,
                503 => {
                    let retry = app
                        .sale_with_key(&format!("strategy={strategy}"), &key)
                        .await;
                    // A user that cannot even read the claim back cannot free it either:
                    // the key waits out its claim, in progress.
                    if (retry.status, retry.error_code()) != (409, "in_progress") {
                        assert_eq!(
                            retry.status, 200,
                            "without {lacking}, {strategy}: {retry:?}"
                        );
                        assert!(retry.headers.get("idempotent-replayed").is_none());
                        sold += 1;
                    }
                }
                _ => panic!("without {lacking}, {strategy}: {sale:?}\n{}", limited.log()),
            }
            let stock: i64 = admin.get(&keys.stock).await.unwrap();
            let sales: Option<i64> = admin.get(&keys.sales).await.unwrap();
            let sales = sales.unwrap_or(0);
            let ledger: i64 = redis::cmd("XLEN")
                .arg(&keys.ledger)
                .query_async(&mut admin)
                .await
                .unwrap();
            assert_eq!(
                (stock, sales, ledger),
                (50 - sold, sold, sold),
                "without {lacking}, after {strategy}: every unit gone is one 200\n{}",
                limited.log()
            );
        }
        let audit = app.audit().await;
        assert_eq!(audit["clean"], true, "without {lacking}: {audit}");
    }
}

/// A Redis that may evict keys under memory pressure breaks every lock: from outside, with
/// `volatile-lru` one memory spike evicted a held `lua-release` lock and a second sale sold
/// the same unit, and with `volatile-ttl` beside a cache the load test said OVERSOLD; evicted
/// idempotency records sold their keys again. `/ready` says so (503 `redis_may_evict`,
/// naming the policy) for every policy that can evict under a memory limit, and is ready
/// again once the policy is `noeviction` or there is no limit.
#[tokio::test(flavor = "multi_thread")]
async fn ready_says_when_redis_may_evict_keys() {
    /// Sets `maxmemory` and the policy on `server`, and returns `/ready`'s answer on `app`.
    async fn ready_under(
        app: &Instance,
        server: &RedisServer,
        maxmemory: &str,
        policy: &str,
    ) -> Reply {
        let () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("maxmemory")
            .arg(maxmemory)
            .arg("maxmemory-policy")
            .arg(policy)
            .query_async(&mut server.conn().await)
            .await
            .unwrap();
        app.get("/ready").await
    }
    /// A 503 `redis_may_evict` whose message holds every one of `words`.
    fn says_may_evict(ready: &Reply, words: &[&str]) -> bool {
        (ready.status, ready.error_code()) == (503, "redis_may_evict")
            && ready.body["message"]
                .as_str()
                .is_some_and(|m| words.iter().all(|w| m.contains(w)))
    }
    let redis = RedisServer::start().await;
    let app = InstanceBuilder::new(&redis, "app1").start().await;
    assert_eq!(app.get("/ready").await.status, 200);
    for policy in [
        "volatile-lru",
        "allkeys-lru",
        "volatile-ttl",
        "allkeys-random",
        "volatile-lfu",
    ] {
        let ready = ready_under(&app, &redis, "1gb", policy).await;
        assert!(
            says_may_evict(&ready, &[policy, "noeviction"]),
            "{policy}: {ready:?}"
        );
        let ready = ready_under(&app, &redis, "0", policy).await;
        assert_eq!(ready.status, 200, "{policy} without a limit: {ready:?}");
    }
    let ready = ready_under(&app, &redis, "1gb", "noeviction").await;
    assert_eq!(ready.status, 200, "noeviction with a limit: {ready:?}");

    // The quorum lock's nodes hold its votes: one that may evict is said too.
    let nodes = LockNodes::start(3).await;
    let quorum = InstanceBuilder::new(&redis, "app2")
        .lock_nodes(&nodes)
        .start()
        .await;
    assert_eq!(quorum.get("/ready").await.status, 200);
    let ready = ready_under(&quorum, &nodes.nodes[1], "1gb", "allkeys-lru").await;
    let port = nodes.nodes[1].port().to_string();
    assert!(says_may_evict(&ready, &["lock node", &port]), "{ready:?}");
}

/// A Redis that answers PING can still refuse every write: `min-replicas-to-write` with too
/// few replicas (`NOREPLICAS`), `maxmemory` reached under `noeviction` (`OOM`). `/ready`
/// said ready while every sale answered 503. The property: `/ready` is 503 exactly while a
/// sale is refused, it names the refusal, the refused sales sell nothing, and both come
/// back by themselves once Redis takes writes again.
#[tokio::test(flavor = "multi_thread")]
async fn ready_is_not_ready_exactly_while_redis_refuses_writes() {
    async fn config(server: &RedisServer, name: &str, value: &str) {
        let () = redis::cmd("CONFIG")
            .arg("SET")
            .arg(name)
            .arg(value)
            .query_async(&mut server.conn().await)
            .await
            .unwrap();
    }
    let redis = RedisServer::start().await;
    let app = InstanceBuilder::new(&redis, "app1").start().await;
    app.reset(10).await;
    let mut sold = 0;
    // (setting, refusing value, value that takes writes again, what the refusal is called)
    let refusals = [
        ("min-replicas-to-write", "1", "0", "NOREPLICAS"),
        ("maxmemory", "1", "0", "out of memory"),
    ];
    for (setting, refusing, taking, named) in refusals {
        assert_eq!(app.get("/ready").await.status, 200, "before {setting}");
        config(&redis, setting, refusing).await;
        let ready = app.get("/ready").await;
        assert_eq!(
            (ready.status, ready.error_code()),
            (503, "redis_unavailable"),
            "{setting} {refusing}: {ready:?}"
        );
        assert!(
            ready.body["message"]
                .as_str()
                .is_some_and(|m| m.contains(named)),
            "{setting} {refusing}: {ready:?}"
        );
        for strategy in ["atomic", "fenced", "lua-release", "optimistic"] {
            let sale = app.sale(&format!("strategy={strategy}")).await;
            assert_eq!(sale.status, 503, "{setting}, {strategy}: {sale:?}");
        }
        config(&redis, setting, taking).await;
        let ready = app.get("/ready").await;
        assert_eq!(ready.status, 200, "{setting} {taking}: {ready:?}");
        for strategy in ["atomic", "fenced"] {
            let sale = app.sale(&format!("strategy={strategy}")).await;
            assert_eq!(sale.status, 200, "{setting} {taking}, {strategy}: {sale:?}");
            sold += 1;
        }
    }
    // Only the sales answered 200 took a unit.
    let stock = app.get("/inventory").await;
    assert_eq!(stock.body["stock"], 10 - sold, "{stock:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn idempotency_keys_expire_after_their_ttl_and_sold_out_is_replayed() {
    let cluster = Cluster::start(1, |b| b.env("IDEMPOTENCY_TTL_S", 1)).await;
    let app = &cluster.instances[0];
    app.reset(1).await;
    let first = app.sale_with_key("strategy=atomic", "k-1").await;
    assert_eq!(first.status, 200);
    // A retry may name another strategy: the replay is the atomic sale's, counted as such.
    let replay = app.sale_with_key("strategy=none", "k-1").await;
    assert_eq!(replay.headers["idempotent-replayed"], "true");
    assert_eq!(replay.body["strategy"], "atomic");
    let out = app.sale_with_key("strategy=atomic", "k-2").await;
    assert_eq!((out.status, out.error_code()), (409, "sold_out"));
    assert!(out.headers.get("idempotent-replayed").is_none());
    app.reset(1).await;
    let replayed = app.sale_with_key("strategy=atomic", "k-2").await;
    assert_eq!(
        (replayed.status, replayed.error_code()),
        (409, "sold_out"),
        "kept outcome"
    );
    // Said as a replay: the item is in stock again, and only a new key buys it.
    assert_eq!(replayed.headers["idempotent-replayed"], "true");
    let message = replayed.body["message"].as_str().unwrap_or_default();
    assert!(message.contains("replayed"), "{message}");
    // Each sale and each refusal counted once, as the ledger has them; the replays apart.
    let metrics = app.get("/metrics").await;
    let metrics = metrics.body.as_str().unwrap_or_default();
    for (line, n) in [
        (
            "inventory_sales_total{strategy=\"atomic\",outcome=\"sold\"}",
            1,
        ),
        (
            "inventory_sales_total{strategy=\"atomic\",outcome=\"sold_out\"}",
            1,
        ),
        (
            "inventory_sales_replayed_total{strategy=\"atomic\",outcome=\"sold\"}",
            1,
        ),
        (
            "inventory_sales_replayed_total{strategy=\"atomic\",outcome=\"sold_out\"}",
            1,
        ),
        (
            "inventory_sales_replayed_total{strategy=\"none\",outcome=\"sold\"}",
            0,
        ),
    ] {
        assert!(
            metrics.contains(&format!("{line} {n}\n")),
            "{line} {n}:\n{metrics}"
        );
    }

    let expired = within(Duration::from_secs(3), || async {
        app.sale_with_key("strategy=atomic", "k-1").await.status == 200
            && app.audit().await["sales"] == 1
    })
    .await;
    assert!(expired.is_some(), "after its TTL the key sells again");
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_lets_the_sale_in_flight_finish_release_its_lock_and_exit_zero() {
    let cluster = Cluster::start(1, |b| b).await;
    let mut app = cluster.instances.into_iter().next().unwrap();
    app.reset(5).await;
    let keys = Keys::new("001");
    let mut c = cluster.redis.conn().await;

    let sale = app.sale("strategy=fenced&work_ms=800");
    let term = async {
        let held = cluster
            .redis
            .wait_for_key(&keys.lock, true, Duration::from_secs(5))
            .await;
        assert!(held.is_some());
        app.signal("TERM").await;
        Instant::now()
    };
    let (sale, termed_at) = tokio::join!(sale, term);
    assert_eq!(sale.status, 200, "the sale in flight finished: {sale:?}");
    let status = app.wait_exit(Duration::from_secs(5)).await;
    assert!(
        status.is_some_and(|s| s.success()),
        "exit status {status:?}"
    );
    assert!(termed_at.elapsed() < Duration::from_secs(3));
    let lock_left: bool = c.exists(&keys.lock).await.unwrap();
    assert!(!lock_left, "the lock was released before exit");
    assert!(
        tokio::net::TcpStream::connect(("127.0.0.1", app.port))
            .await
            .is_err(),
        "nothing listens any more"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn shutdown_does_not_wait_for_a_sale_longer_than_the_grace_period() {
    let cluster = Cluster::start(1, |b| b.env("SHUTDOWN_GRACE_MS", 300)).await;
    let mut app = cluster.instances.into_iter().next().unwrap();
    app.reset(5).await;
    let url = app.url("/inventory/sale?strategy=atomic&work_ms=30000");
    let stuck = tokio::spawn(async move { reqwest::Client::new().post(url).send().await });
    let started = within(Duration::from_secs(5), || async {
        app.get("/metrics").await.body.as_str().is_some()
    })
    .await;
    assert!(started.is_some());
    tokio::time::sleep(Duration::from_millis(100)).await;
    let before = Instant::now();
    app.signal("TERM").await;
    let status = app.wait_exit(Duration::from_secs(5)).await;
    assert!(status.is_some_and(|s| s.success()), "{status:?}");
    assert!(
        before.elapsed() < Duration::from_secs(2),
        "exited after {:?}",
        before.elapsed()
    );
    assert!(
        stuck.await.unwrap().is_err(),
        "the abandoned request got no answer"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn metrics_count_sales_waits_renewals_and_redis_errors() {
    let mut redis = RedisServer::start_durable().await;
    let app = InstanceBuilder::new(&redis, "app1")
        .env("LOCK_TTL_MS", 300)
        .env("REDIS_TIMEOUT_MS", REDIS_TIMEOUT_MS)
        .start()
        .await;
    app.reset(2).await;
    assert_eq!(app.sale("strategy=watchdog&work_ms=500").await.status, 200);
    assert_eq!(app.sale("strategy=atomic").await.status, 200);
    assert_eq!(app.sale("strategy=atomic").await.status, 409);
    redis.stop().await;
    // The first call after the connection broke cannot tell whether its write went out.
    let down = app.sale("strategy=atomic").await;
    assert!(matches!(down.status, 503 | 504), "{down:?}");
    // Answers that come before the sale proper: Redis fails the idempotency claim, or the
    // look at whether an item was ever stocked. Each is counted, as every answer is.
    let http = reqwest::Client::new();
    let keyed = app
        .send(
            http.post(app.url("/inventory/sale?strategy=fenced"))
                .header("idempotency-key", "counted-while-down"),
        )
        .await;
    assert_eq!(keyed.status, 503, "{keyed:?}");
    let fresh = app
        .send(http.post(app.url("/inventory/never-stocked/sale?strategy=setnx")))
        .await;
    assert_eq!(fresh.status, 503, "{fresh:?}");
    redis.restart().await;

    let metrics = app.get("/metrics").await;
    assert_eq!(metrics.status, 200);
    assert!(
        metrics.headers["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/plain; version=0.0.4")
    );
    let text = metrics.body.as_str().unwrap();
    let value = |series: &str| -> f64 {
        text.lines()
            .find_map(|l| {
                l.strip_prefix(series)
                    .and_then(|rest| rest.trim().parse().ok())
            })
            .unwrap_or_else(|| panic!("{series} missing from\n{text}"))
    };
    assert_eq!(
        value(r#"inventory_sales_total{strategy="watchdog",outcome="sold"}"#),
        1.0
    );
    assert_eq!(
        value(r#"inventory_sales_total{strategy="atomic",outcome="sold"}"#),
        1.0
    );
    assert_eq!(
        value(r#"inventory_sales_total{strategy="atomic",outcome="sold_out"}"#),
        1.0
    );
    let outcome = if down.status == 503 {
        "redis_unavailable"
    } else {
        "outcome_unknown"
    };
    assert_eq!(
        value(&format!(
            r#"inventory_sales_total{{strategy="atomic",outcome="{outcome}"}}"#
        )),
        1.0
    );
    assert_eq!(
        value(r#"inventory_lock_wait_seconds_count{strategy="watchdog"}"#),
        1.0
    );
    assert!(
        value("inventory_lock_renewals_total") >= 2.0,
        "500 ms of work on a 300 ms lease"
    );
    assert!(value("inventory_redis_errors_total") >= 1.0);
    assert_eq!(value("inventory_locks_lost_total"), 0.0);
    // Every answer of the sale endpoint is counted once, whatever its outcome.
    let counted: f64 = text
        .lines()
        .filter(|l| l.starts_with("inventory_sales_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(counted, 6.0, "{text}");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_request_id_from_nginx_is_echoed_and_logged() {
    let cluster = Cluster::start(1, |b| b).await;
    let app = &cluster.instances[0];
    app.reset(3).await;
    let http = reqwest::Client::new();
    let reply = app
        .send(
            http.post(app.url("/inventory/sale"))
                .header("x-request-id", "req-7f3a9c"),
        )
        .await;
    assert_eq!(reply.headers["x-request-id"], "req-7f3a9c");
    let logged = within(Duration::from_secs(2), || async {
        app.log()
            .lines()
            .any(|l| l.contains(Event::StockRead.name()) && l.contains("req-7f3a9c"))
    })
    .await;
    assert!(
        logged.is_some(),
        "the sale's log lines carry the request id:\n{}",
        app.log()
    );
    let generated = app.get("/health").await;
    assert!(
        !generated.headers["x-request-id"].is_empty(),
        "one is made when none is sent"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_redis_password_never_reaches_logs_errors_or_help() {
    const PASSWORD: &str = "pw-Zk39fQ";
    let redis = testkit::fixture::RedisServer::start_with(&["--requirepass", PASSWORD]).await;
    let url = format!("redis://:{PASSWORD}@127.0.0.1:{}", redis.port());
    let wrong = format!("redis://:not-{PASSWORD}@127.0.0.1:{}", redis.port());

    let good = InstanceBuilder::new(&redis, "good")
        .env("REDIS_URL", &url)
        .start()
        .await;
    good.reset(3).await;
    assert_eq!(good.sale("").await.status, 200, "authenticated");

    let bad = InstanceBuilder::new(&redis, "bad")
        .env("REDIS_URL", &wrong)
        .start()
        .await;
    let sale = bad.sale("").await;
    assert_eq!((sale.status, sale.error_code()), (503, "redis_auth_failed"));
    assert!(!sale.body.to_string().contains(PASSWORD));
    let ready = bad.get("/ready").await;
    assert_eq!(
        (ready.status, ready.error_code()),
        (503, "redis_auth_failed")
    );
    assert!(
        bad.log().contains("redis refused the credentials"),
        "start-up says what is wrong: {}",
        bad.log()
    );
    assert!(!bad.log().contains(PASSWORD), "{}", bad.log());
    assert!(!good.log().contains(PASSWORD));

    let help = std::process::Command::new(env!("CARGO_BIN_EXE_inventory"))
        .arg("--help")
        .env("REDIS_URL", &url)
        .env("ADMIN_TOKEN", "admin-Q81x")
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(
        !help.contains(PASSWORD) && !help.contains("admin-Q81x"),
        "{help}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn oversized_bodies_are_refused() {
    let cluster = Cluster::start(1, |b| b).await;
    let app = &cluster.instances[0];
    let body = format!(r#"{{"stock": 5, "padding": "{}"}}"#, "x".repeat(64 * 1024));
    let reply = app.put_inventory(&body, None).await;
    assert_eq!(reply.status, 413, "{reply:?}");

    // Declared or sent chunked (no Content-Length), on every sale route and method: 413,
    // and nothing sold. Chunked, the sale sold.
    app.reset(10).await;
    for path in ["/inventory/sale", "/inventory/001/sale"] {
        for method in ["POST", "GET"] {
            for chunked in [false, true] {
                let status = send_raw_body(app, method, path, 20 * 1024, chunked).await;
                assert_eq!(status, 413, "{method} {path} chunked={chunked}");
            }
        }
    }
    assert_eq!(app.audit().await["sales"], 0, "an oversized body sold");
    assert_eq!(app.sale("strategy=atomic").await.status, 200);
}

/// Sends `method path?strategy=atomic` with a body of `size` bytes, declared or chunked, by
/// hand (no client sends a body chunked unasked); the status it got.
async fn send_raw_body(
    app: &Instance,
    method: &str,
    path: &str,
    size: usize,
    chunked: bool,
) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = app
        .url("")
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_owned();
    let mut stream = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let mut request = format!("{method} {path}?strategy=atomic HTTP/1.1\r\nHost: {addr}\r\n");
    let payload = "x".repeat(size);
    if chunked {
        request.push_str("Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n");
        for chunk in payload.as_bytes().chunks(4096) {
            request.push_str(&format!(
                "{:x}\r\n{}\r\n",
                chunk.len(),
                String::from_utf8_lossy(chunk)
            ));
        }
        request.push_str("0\r\n\r\n");
    } else {
        request.push_str(&format!(
            "Content-Length: {size}\r\nConnection: close\r\n\r\n{payload}"
        ));
    }
    // The instance may answer and close before reading everything: a failed write is fine.
    let _ = stream.write_all(request.as_bytes()).await;
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer).await;
    let answer = String::from_utf8_lossy(&answer);
    answer
        .split_whitespace()
        .nth(1)
        .and_then(|status| status.parse().ok())
        .unwrap_or_else(|| panic!("no HTTP answer: {answer:?}"))
}

/// Redis restarted while an instance sat idle: the instance's shared connection is dead, and
/// it learns so only by writing into it. The first request after the return must not pay
/// for that with a 503: a command written into a closed connection reached no Redis, so it
/// is sent again on the new one. Each kind of first request: locked sales, an atomic one,
/// a restock, a read.
#[tokio::test(flavor = "multi_thread")]
async fn the_first_request_after_redis_restarted_behind_an_idle_instance_succeeds() {
    let (mut redis, app) = durable_redis_and_instance().await;
    app.reset(100).await;
    assert_eq!(app.sale("strategy=fenced").await.status, 200);
    let firsts = [
        "strategy=fenced",
        "strategy=lua-release",
        "strategy=atomic",
        "strategy=setnx-ttl",
        "restock",
        "audit",
    ];
    // Back at once, or after a second away (the instance's reconnection is then refused,
    // and it used to hand that refusal to its next request).
    for (first, away) in firsts.into_iter().zip([0, 1000].into_iter().cycle()) {
        redis.stop().await;
        tokio::time::sleep(Duration::from_millis(away)).await;
        redis.restart().await;
        // Idle long enough for the old connection's end to have arrived.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let reply = match first {
            "restock" => app.put_inventory(r#"{"stock": 100}"#, None).await,
            "audit" => app.get("/inventory/audit").await,
            sale => app.sale(sale).await,
        };
        assert_eq!(
            reply.status,
            200,
            "{first} after {away} ms away: {reply:?}\n{}",
            app.log()
        );
    }
}

/// One response on a kept-alive connection: its status, once its headers and its body (by
/// Content-Length) are in, or 0 if the connection ended or nothing complete came `within`.
async fn response_on(stream: &mut tokio::net::TcpStream, within: Duration) -> u16 {
    use tokio::io::AsyncReadExt;
    let mut buf = Vec::new();
    let read = async {
        let mut chunk = [0u8; 4096];
        loop {
            let text = String::from_utf8_lossy(&buf).into_owned();
            if let Some((head, body)) = text.split_once("\r\n\r\n") {
                let length = head
                    .lines()
                    .find_map(|l| {
                        let (name, value) = l.split_once(':')?;
                        name.eq_ignore_ascii_case("content-length")
                            .then(|| value.trim().parse::<usize>().ok())?
                    })
                    .unwrap_or(0);
                if body.len() >= length {
                    return head.split_whitespace().nth(1).and_then(|s| s.parse().ok());
                }
            }
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return None,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
    };
    tokio::time::timeout(within, read)
        .await
        .ok()
        .flatten()
        .unwrap_or(0)
}

/// A request sent to an instance while it is stopped (`SIGSTOP`, a debugger, a frozen VM)
/// for longer than its header deadline is served when it resumes, as one sent during a
/// shorter stop is: the deadline passed while the process could not read, not while the
/// client kept it waiting (the runtime resumes with its `epoll_wait` interrupted and fired
/// the deadline before it saw the request, and the connection was reset: a 502 from nginx
/// for a sale never read). A connection that sent nothing is still closed after the stop.
#[tokio::test(flavor = "multi_thread")]
async fn a_request_sent_during_a_stop_longer_than_the_header_deadline_is_served_on_resume() {
    use tokio::io::AsyncWriteExt;
    let cluster = Cluster::start(1, |b| b.env("HEADER_TIMEOUT_MS", 500)).await;
    let app = &cluster.instances[0];
    app.reset(5).await;
    let request =
        b"POST /inventory/sale?strategy=atomic HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n";
    let connect = || tokio::net::TcpStream::connect(("127.0.0.1", app.port));
    let (mut busy, mut idle) = (connect().await.unwrap(), connect().await.unwrap());
    for stream in [&mut busy, &mut idle] {
        stream.write_all(request).await.unwrap();
        assert_eq!(response_on(stream, Duration::from_secs(3)).await, 200);
    }
    for round in 0..2 {
        app.signal("STOP").await;
        busy.write_all(request).await.unwrap();
        tokio::time::sleep(Duration::from_millis(1_300)).await;
        app.signal("CONT").await;
        assert_eq!(
            response_on(&mut busy, Duration::from_secs(3)).await,
            200,
            "round {round}: the sale sent during a 1.3 s stop (header deadline 0.5 s)"
        );
    }
    assert_eq!(
        response_on(&mut idle, Duration::from_secs(3)).await,
        0,
        "the connection that sent nothing is closed"
    );
    assert_eq!(app.audit().await["sales"], 4);
}

/// Under `REDIS_CONNECTION=pool` the pool recycles each idle connection with a `PING`
/// bounded by the timeout, one after another: with Redis frozen, one sale tried every idle
/// connection in turn and answered after 17 and 27 timeouts (found from outside). A checkout
/// is bounded as a whole: the 503 comes within a few timeouts, however many idle connections.
#[tokio::test(flavor = "multi_thread")]
async fn a_frozen_redis_costs_a_pooled_sale_a_few_timeouts_however_large_the_pool() {
    let redis = RedisServer::start().await;
    let app = InstanceBuilder::new(&redis, "app1")
        .env("REDIS_CONNECTION", "pool")
        .env("REDIS_TIMEOUT_MS", 250)
        .start()
        .await;
    app.reset(1000).await;
    // `optimistic` sales of different items at once each hold a pooled connection through
    // their work, and leave that many idle connections behind.
    let client = testkit::fixture::client();
    for i in 0..24 {
        let put = client
            .put(app.url(&format!("/inventory/p{i}")))
            .json(&serde_json::json!({"stock": 5}));
        assert_eq!(app.send(put).await.status, 200);
    }
    let sales = (0..24).map(|i| {
        let url = app.url(&format!(
            "/inventory/p{i}/sale?strategy=optimistic&work_ms=150"
        ));
        app.send(client.post(url))
    });
    for sale in futures_util::future::join_all(sales).await {
        assert_eq!(sale.status, 200, "{sale:?}");
    }
    let metrics = app.get("/metrics").await;
    let open: f64 = metrics
        .body
        .as_str()
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("inventory_redis_pool_open "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0);
    assert!(open >= 12.0, "idle pooled connections: {open}");
    redis.signal("STOP").await;
    let sale = app.sale("strategy=atomic").await;
    redis.signal("CONT").await;
    // 504 when a connection was taken and the script sent, 503 when none answered.
    assert!(matches!(sale.status, 503 | 504), "{sale:?}");
    assert!(
        sale.elapsed < Duration::from_millis(1500),
        "{} idle connections: {:?}",
        open,
        sale.elapsed
    );
}

/// A keyed retry that cannot read its key's record (Redis frozen) sold nothing itself, but
/// an earlier request with the key may have: from outside, it heard "nothing was sold" for a
/// key whose unit had sold. It says to retry with the key; an unkeyed sale still says
/// nothing was sold.
#[tokio::test(flavor = "multi_thread")]
async fn a_keyed_retry_that_cannot_read_its_key_never_says_nothing_was_sold() {
    let redis = RedisServer::start().await;
    let app = InstanceBuilder::new(&redis, "app1")
        .env("REDIS_TIMEOUT_MS", 300)
        .start()
        .await;
    app.reset(10).await;
    for strategy in ["fenced", "atomic"] {
        let key = format!("frozen-{strategy}");
        let query = format!("strategy={strategy}");
        let first = app.sale_with_key(&query, &key).await;
        assert_eq!(first.status, 200, "{first:?}");
        redis.signal("STOP").await;
        let retry = app.sale_with_key(&query, &key).await;
        let unkeyed = app.sale(&query).await;
        redis.signal("CONT").await;
        let message = retry.body["message"].as_str().unwrap_or_default();
        assert_eq!(retry.status, 503, "{retry:?}");
        assert!(
            !message.contains("nothing was sold") && message.contains("same key"),
            "{strategy}: {message}"
        );
        let unkeyed_message = unkeyed.body["message"].as_str().unwrap_or_default();
        assert!(
            unkeyed.status != 503 || unkeyed_message.contains("nothing was sold"),
            "{unkeyed:?}"
        );
        // And the key's outcome, once Redis answers: the first sale, replayed.
        let mut replayed = app.sale_with_key(&query, &key).await;
        for _ in 0..20 {
            if replayed.status == 200 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            replayed = app.sale_with_key(&query, &key).await;
        }
        assert_eq!(replayed.status, 200, "{replayed:?}");
        assert_eq!(replayed.body["order_id"], first.body["order_id"]);
        assert_eq!(replayed.headers["idempotent-replayed"], "true");
    }
}

/// A keyed sale that failed on an unanswered call frees its key once Redis answers, without
/// waiting out a second timeout for that first: with Redis frozen, keyed sales answered
/// after two timeouts, unkeyed ones after one (found from outside, 4 of 4).
#[tokio::test(flavor = "multi_thread")]
async fn a_keyed_sale_failing_on_a_frozen_redis_costs_one_timeout_not_two() {
    let cluster = Cluster::start(2, |b| b.env("REDIS_TIMEOUT_MS", 1000)).await;
    let (app1, app2) = (&cluster.instances[0], &cluster.instances[1]);
    app1.reset(10).await;
    let holder = app1.sale("strategy=fenced&work_ms=2000");
    let keyed = async {
        tokio::time::sleep(Duration::from_millis(150)).await;
        app2.sale_with_key("strategy=fenced", "frozen-wait").await
    };
    let freeze = async {
        tokio::time::sleep(Duration::from_millis(400)).await;
        cluster.redis.signal("STOP").await;
        tokio::time::sleep(Duration::from_millis(3500)).await;
        cluster.redis.signal("CONT").await;
    };
    let (_, keyed, ()) = tokio::join!(holder, keyed, freeze);
    assert_eq!(
        (keyed.status, keyed.error_code()),
        (503, "redis_unavailable"),
        "{keyed:?}"
    );
    // Sent 150 ms in, frozen at 400: its answer came within a timeout (and a refresh of
    // its place in the queue) of the freeze.
    let answered = Duration::from_millis(150) + keyed.elapsed;
    let after_freeze = answered.saturating_sub(Duration::from_millis(400));
    assert!(
        after_freeze < Duration::from_millis(1600),
        "answered {after_freeze:?} after the freeze (the timeout is 1 s)"
    );
    // The key was freed once Redis answered: a retry sells, as a new sale.
    let mut retry = app2.sale_with_key("strategy=fenced", "frozen-wait").await;
    for _ in 0..30 {
        if retry.status == 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        retry = app2.sale_with_key("strategy=fenced", "frozen-wait").await;
    }
    assert_eq!(retry.status, 200, "{retry:?}");
    assert!(
        retry.headers.get("idempotent-replayed").is_none(),
        "{retry:?}"
    );
}

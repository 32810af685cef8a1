//! Properties that must hold whatever buyers and admins do at the same time: any mix of
//! strategies, a reset in the middle of a sale, a `HEAD`, a frozen Redis after the write was
//! sent, an item that was never stocked, slow and idle clients.

use std::time::Duration;

use crate::harness::until_stock_read;
use inventory::lock::Strategy;
use inventory::store::{Keys, Store};
use redis::AsyncCommands;
use serde_json::Value;
use testkit::fixture::{
    Cluster, Instance, InstanceBuilder, LockNodes, RedisServer, Reply, Stack, ledger,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The strategies that take a lock in Redis, or need none: the ones the load test calls SAFE.
fn safe_strategies() -> Vec<Strategy> {
    Strategy::ALL
        .into_iter()
        .filter(|s| s.info().distributed)
        .collect()
}

/// The safe strategies that hold a lock across the read and the write (not `atomic`, which
/// reads nothing, nor `optimistic`, whose refused transaction reads again and sells).
fn locked_strategies() -> Vec<Strategy> {
    safe_strategies()
        .into_iter()
        .filter(|s| matches!(s, Strategy::Redis(_)))
        .collect()
}

/// The books balance: every 200 is one item gone from the stock, and nothing else is; every
/// other answer is one of the `refusals` (nothing sold).
fn assert_books_balance(replies: &[Reply], audit: &Value, what: &str, refusals: &[&str]) {
    let sold = replies.iter().filter(|r| r.status == 200).count() as i64;
    assert_eq!(audit["clean"], true, "{what}: {audit}");
    assert_eq!(audit["sales"].as_i64(), Some(sold), "{what}: {audit}");
    let (initial, remaining) = (audit["initial"].as_i64(), audit["remaining"].as_i64());
    assert_eq!(
        initial.zip(remaining).map(|(i, r)| i - r),
        Some(sold),
        "{what}: {audit}"
    );
    for r in replies.iter().filter(|r| r.status != 200) {
        assert!(
            refusals.contains(&r.error_code()),
            "{what}: {} {}",
            r.status,
            r.body
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn every_pair_of_safe_strategies_mixed_on_one_item_never_oversells_or_loses_a_sale() {
    let cluster = Cluster::start(2, |b| b).await;
    let strategies = safe_strategies();
    for (i, a) in strategies.iter().enumerate() {
        for b in &strategies[i + 1..] {
            cluster.instances[0].reset(12).await;
            // Both kinds of buyer on both instances, all at once.
            let sales = (0..24).map(|n| {
                let strategy = if n % 2 == 0 { a } else { b };
                let app = &cluster.instances[(n / 2) % 2];
                let query = format!("strategy={strategy}&work_ms=5");
                async move { app.sale(&query).await }
            });
            let replies = futures_util::future::join_all(sales).await;
            let audit = cluster.instances[1].audit().await;
            // A single-node lock and a quorum lock never wait for each other, so their
            // sales may overlap; the store refuses the one that read first (409
            // stock_changed). No lock is ever lost here (5 ms of work, 5 s leases): a
            // stale_fence would be a lie, though the two kinds draw tokens from one counter.
            let refusals = &["sold_out", "stock_changed"];
            assert_books_balance(&replies, &audit, &format!("{a} + {b}"), refusals);
        }
    }
}

/// Sales of one instance passed the lock within a tenure: each one's read goes out behind
/// the previous sale's write, on the same connection, and must still see that write. For
/// every strategy with tenures: every sale sells, each a remaining value of its own, the
/// books balance, and (fenced) the later token sold the lower value: a token never goes
/// backwards against the stock. Some reads must have been sent that way, or this tests
/// nothing.
#[tokio::test(flavor = "multi_thread")]
async fn sales_passed_within_a_tenure_read_behind_the_previous_write_and_see_it() {
    let cluster = Cluster::start(1, |b| b.env("LOCK_TENURE_MS", 1000)).await;
    let app = &cluster.instances[0];
    for strategy in ["fenced", "lua-release", "reentrant", "watchdog"] {
        app.reset(100).await;
        let sales = (0..16).map(|n| {
            // Half of them re-enter the lock they hold (a second, nested acquire).
            let query = format!("strategy={strategy}&work_ms=2&reenter={}", n % 2 == 0);
            async move { app.sale(&query).await }
        });
        let replies = futures_util::future::join_all(sales).await;
        let reenter_refused = |r: &Reply| strategy == "lua-release" && r.status != 200;
        let sold: Vec<&Reply> = replies.iter().filter(|r| r.status == 200).collect();
        for r in replies.iter().filter(|r| r.status != 200) {
            assert!(reenter_refused(r), "{strategy}: {} {}", r.status, r.body);
        }
        let mut remaining: Vec<i64> = sold
            .iter()
            .map(|r| r.body["remaining"].as_i64().unwrap())
            .collect();
        remaining.sort_unstable();
        let expected: Vec<i64> = (100 - sold.len() as i64..100).collect();
        assert_eq!(
            remaining, expected,
            "{strategy}: each sale saw the one before"
        );
        if strategy == "fenced" {
            let mut by_token: Vec<(u64, i64)> = sold
                .iter()
                .map(|r| {
                    (
                        r.body["fence"].as_u64().unwrap(),
                        r.body["remaining"].as_i64().unwrap(),
                    )
                })
                .collect();
            by_token.sort_unstable();
            assert!(
                by_token
                    .windows(2)
                    .all(|w| w[0].0 < w[1].0 && w[0].1 > w[1].1),
                "{by_token:?}"
            );
        }
        assert_books_balance(
            &replies,
            &app.audit().await,
            strategy,
            &["lock_not_reentrant", "lock_timeout"],
        );
    }
    let prefetched = app.log().matches("\"prefetched\":true").count();
    assert!(prefetched > 0, "no read was sent behind a write");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_reset_in_the_middle_of_a_sale_refuses_that_sale_for_every_lock_strategy() {
    let cluster = Cluster::start(1, |b| b).await;
    let app = &cluster.instances[0];
    for strategy in locked_strategies() {
        app.reset(100).await;
        let reads = app.log().matches("stock read").count();
        let query = format!("strategy={strategy}&work_ms=400");
        let sale = app.sale(&query);
        // The reset lands after the sale read the stock and before it writes.
        let reset = async {
            until_stock_read(app, reads).await;
            app.reset(10).await;
        };
        let (sale, ()) = tokio::join!(sale, reset);
        assert_eq!(
            (sale.status, sale.error_code()),
            (409, "stock_changed"),
            "{strategy}: {}",
            sale.body
        );
        let audit = app.audit().await;
        assert_eq!(
            (audit["remaining"].as_i64(), audit["sales"].as_i64()),
            (Some(10), Some(0)),
            "{strategy}: the sale from before the reset landed after it: {audit}"
        );
    }
}

/// A single-node lock and a quorum lock do not exclude each other. A `fenced` sale overtaken
/// by a `redlock-fenced` sale between its read and its write is refused as `stock_changed`
/// (a writer that does not take its lock wrote since its read), not `stale_fence`: its own
/// lock was never lost, though the other sale's token is newer (both draw from one counter).
#[tokio::test(flavor = "multi_thread")]
async fn a_fenced_sale_overtaken_by_a_quorum_sale_is_stock_changed_not_a_lost_lock() {
    let cluster = Cluster::start(2, |b| b).await;
    let (a, b) = (&cluster.instances[0], &cluster.instances[1]);
    for (slow, fast) in [("fenced", "redlock-fenced"), ("redlock-fenced", "fenced")] {
        a.reset(10).await;
        let reads = a.log().matches("stock read").count();
        let slow_query = format!("strategy={slow}&work_ms=400");
        let slow_sale = a.sale(&slow_query);
        let overtaking = async {
            until_stock_read(a, reads).await;
            b.sale(&format!("strategy={fast}")).await
        };
        let (slow_sale, fast_sale) = tokio::join!(slow_sale, overtaking);
        assert_eq!(fast_sale.status, 200, "{fast}: {}", fast_sale.body);
        assert_eq!(
            (slow_sale.status, slow_sale.error_code()),
            (409, "stock_changed"),
            "{slow}: {}",
            slow_sale.body
        );
        let audit = a.audit().await;
        assert_eq!(
            (audit["sales"].as_i64(), audit["remaining"].as_i64()),
            (Some(1), Some(9)),
            "{audit}"
        );

        // The other sale only reads (drawing a newer token) before this one writes: this
        // one's lock is still its own, so it sells; the other is then overtaken.
        a.reset(10).await;
        let reads = a.log().matches("stock read").count();
        let first_query = format!("strategy={slow}&work_ms=300");
        let first = a.sale(&first_query);
        let second = async {
            until_stock_read(a, reads).await;
            b.sale(&format!("strategy={fast}&work_ms=800")).await
        };
        let (first, second) = tokio::join!(first, second);
        assert_eq!(
            first.status, 200,
            "{slow} after {fast} read: {}",
            first.body
        );
        assert_eq!(
            (second.status, second.error_code()),
            (409, "stock_changed"),
            "{fast}: {}",
            second.body
        );
    }
}

/// A fenced holder paused past its lease, whose lock a holder of the same kind of lock
/// without a token then took and wrote under: the paused one's late write is refused, for
/// every such pair (`fenced` beside each single-node lock without a token, `redlock-fenced`
/// beside `redlock`). The taker draws no token, so the token alone cannot tell the paused
/// holder that it lost its lock; its write sold the same stock value a second time.
#[tokio::test(flavor = "multi_thread")]
async fn a_paused_fenced_holder_is_refused_whichever_lock_of_its_kind_took_over() {
    let redis = RedisServer::start().await;
    let nodes = LockNodes::start(3).await;
    let start = |name: &'static str| {
        InstanceBuilder::new(&redis, name)
            .env("LOCK_TTL_MS", 600)
            .lock_nodes(&nodes)
            .start()
    };
    let paused = start("app1").await;
    let taker = start("app2").await;
    let locked = locked_strategies();
    let fenced = locked.iter().filter(|s| s.info().fenced);
    let mut pairs = 0;
    for fenced in fenced {
        let same_kind_unfenced = locked
            .iter()
            .filter(|s| !s.info().fenced && s.info().quorum == fenced.info().quorum);
        for other in same_kind_unfenced {
            pairs += 1;
            paused.reset(10).await;
            let reads = paused.log().matches("stock read").count();
            let late_query = format!("strategy={fenced}&work_ms=300");
            let late = paused.sale(&late_query);
            let take_over = async {
                until_stock_read(&paused, reads).await;
                paused.signal("SIGSTOP").await;
                // The paused holder renews nothing: its lease runs out while this waits.
                let taken = taker.sale(&format!("strategy={other}")).await;
                paused.signal("SIGCONT").await;
                taken
            };
            let (late, taken) = tokio::join!(late, take_over);
            assert_eq!(taken.status, 200, "{other}: {}", taken.body);
            assert_eq!(
                (late.status, late.error_code()),
                (409, "lock_lost"),
                "{fenced} paused, {other} took over: {}",
                late.body
            );
            let audit = paused.audit().await;
            assert_eq!(audit["clean"], true, "{fenced} + {other}: {audit}");
            assert_eq!(
                (audit["sales"].as_i64(), audit["remaining"].as_i64()),
                (Some(1), Some(9)),
                "{fenced} + {other}: {audit}"
            );
        }
    }
    assert_eq!(
        pairs, 7,
        "every lock without a token beside the fenced one of its kind"
    );
}

/// `fenced` and `redlock-fenced` sales mixed on one item, on two instances: the two kinds of
/// lock do not exclude each other, and both draw their tokens from one counter. In the order
/// the ledger recorded the sales, the tokens only go up: a sale whose token is older than
/// one the other kind already registered is refused at its read (409 `stock_changed`)
/// instead of writing after it. The books balance as before.
#[tokio::test(flavor = "multi_thread")]
async fn the_ledgers_fencing_tokens_only_go_up_with_both_kinds_of_fenced_lock_mixed() {
    let redis = RedisServer::start().await;
    let nodes = LockNodes::start(3).await;
    let start = |name: &'static str| {
        InstanceBuilder::new(&redis, name)
            .lock_nodes(&nodes)
            .start()
    };
    let apps = [start("app1").await, start("app2").await];
    apps[0].reset(10_000).await;
    let mut replies = Vec::new();
    for round in 0..12 {
        let sales = (0..32).map(|n| {
            let strategy = if (n + round) % 2 == 0 {
                "fenced"
            } else {
                "redlock-fenced"
            };
            let app = &apps[(n / 2) % 2];
            let query = format!("strategy={strategy}&work_ms={}", n % 3);
            async move { app.sale(&query).await }
        });
        replies.extend(futures_util::future::join_all(sales).await);
    }
    let audit = apps[1].audit().await;
    assert_books_balance(
        &replies,
        &audit,
        "fenced + redlock-fenced",
        &["stock_changed"],
    );
    let mut c = redis.conn().await;
    let tokens: Vec<(u64, String)> = ledger(&mut c, &Keys::new("001").ledger)
        .await
        .iter()
        .map(|sale| {
            let strategy = sale["strategy"].as_str().unwrap_or_default().to_owned();
            (sale["fence"].as_u64().unwrap_or(0), strategy)
        })
        .collect();
    assert!(
        tokens.len() > 100,
        "too few sales to show anything: {}",
        tokens.len()
    );
    let backwards: Vec<_> = tokens.windows(2).filter(|w| w[1].0 <= w[0].0).collect();
    assert!(
        backwards.is_empty(),
        "{} steps back, first: {:?}",
        backwards.len(),
        backwards.first()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn fencing_tokens_never_go_backwards_and_no_sale_crosses_a_reset_under_load() {
    let cluster = Cluster::start(2, |b| b).await;
    cluster.instances[0].reset(1_000).await;
    let buyers = (0..16).map(|n| {
        let app = &cluster.instances[n % 2];
        async move {
            let mut tokens = Vec::new();
            for _ in 0..25 {
                let reply = app.sale("strategy=fenced&work_ms=2").await;
                if let Some(token) = reply.body["fence"].as_u64() {
                    tokens.push(token);
                }
            }
            tokens
        }
    });
    let resets = async {
        for stock in [500, 300, 200] {
            tokio::time::sleep(Duration::from_millis(150)).await;
            cluster.instances[1].reset(stock).await;
        }
    };
    let (tokens, ()) = tokio::join!(futures_util::future::join_all(buyers), resets);
    let audit = cluster.instances[0].audit().await;
    assert_eq!(audit["clean"], true, "a sale crossed a reset: {audit}");

    for (buyer, tokens) in tokens.iter().enumerate() {
        assert!(
            tokens.windows(2).all(|w| w[0] < w[1]),
            "buyer {buyer} saw its tokens go backwards: {tokens:?}"
        );
    }
    let mut all: Vec<u64> = tokens.into_iter().flatten().collect();
    let count = all.len();
    all.sort_unstable();
    all.dedup();
    assert_eq!(all.len(), count, "a fencing token was handed out twice");
}

#[tokio::test(flavor = "multi_thread")]
async fn string_and_hash_locks_of_different_strategies_wait_for_each_other() {
    let cluster = Cluster::start(2, |b| b).await;
    let lock = Keys::new("001").lock;
    for (first, second) in [("lua-release", "fenced"), ("fenced", "owner-check")] {
        cluster.instances[0].reset(10).await;
        let query = format!("strategy={first}&work_ms=300");
        let holder = cluster.instances[0].sale(&query);
        let waiter = async {
            cluster
                .redis
                .wait_for_key(&lock, true, Duration::from_secs(5))
                .await
                .expect("the first sale never took the lock");
            cluster.instances[1]
                .sale(&format!("strategy={second}"))
                .await
        };
        let (holder, waiter) = tokio::join!(holder, waiter);
        assert_eq!(holder.status, 200, "{first}: {}", holder.body);
        assert_eq!(
            waiter.status, 200,
            "{second} waiting on {first}: {}",
            waiter.body
        );
        assert!(
            waiter.body["waited_ms"].as_u64() > Some(0),
            "{second} did not wait for {first}: {}",
            waiter.body
        );
        assert_eq!(cluster.instances[0].audit().await["clean"], true);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn head_never_sells_on_any_route_directly_or_through_nginx() {
    let stack = Stack::start(|b| b).await;
    let app = &stack.cluster.instances[0];
    app.reset(5).await;
    let before = stack.cluster.redis.snapshot().await;
    let document = app.get("/api-docs/openapi.json").await.body;
    let paths: Vec<String> = document["paths"]
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .collect();
    assert!(paths.contains(&"/inventory/sale".to_owned()), "{paths:?}");
    let http = reqwest::Client::new();
    for path in &paths {
        for strategy in ["fenced", "atomic", "none"] {
            for base in [app.url(""), stack.nginx.url()] {
                let url = format!("{base}{path}?strategy={strategy}");
                let response = http.head(&url).send().await.unwrap();
                if path == "/inventory/sale" {
                    assert_eq!(response.status().as_u16(), 405, "HEAD {url}");
                    assert_eq!(response.headers()["allow"], "GET, POST", "HEAD {url}");
                }
            }
        }
    }
    let after = stack.cluster.redis.snapshot().await;
    assert_eq!(before, after, "a HEAD changed what Redis holds");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_write_sent_to_a_frozen_redis_is_outcome_unknown_and_its_key_learns_the_outcome() {
    let redis = RedisServer::start().await;
    let app = InstanceBuilder::new(&redis, "app1")
        .env("REDIS_TIMEOUT_MS", 300)
        .start()
        .await;
    for (strategy, key) in [
        ("atomic", "frozen-1"),
        ("lua-release", "frozen-2"),
        ("optimistic", "frozen-3"),
    ] {
        app.reset(5).await;
        let query = format!("strategy={strategy}&work_ms=400");
        let sale = app.sale_with_key(&query, key);
        let reads = app.log().matches("stock read").count();
        let freeze = async {
            // Freeze once the claim is taken (and a locked sale has read the stock): the
            // next call is the write, sent into the frozen server.
            let claim = Keys::new("001").idempotency(key);
            redis
                .wait_for_key(&claim, true, Duration::from_secs(5))
                .await
                .expect("the sale never claimed its key");
            if strategy != "atomic" {
                until_stock_read(&app, reads).await;
            }
            redis.signal("STOP").await;
        };
        let (sale, ()) = tokio::join!(sale, freeze);
        redis.signal("CONT").await;
        let message = sale.body["message"].as_str().unwrap_or_default();
        if strategy == "optimistic" {
            // It checks its connection after the work, before sending EXEC: that check went
            // unanswered, and no EXEC was sent. This request sold nothing; its key says so
            // once Redis answers.
            assert_eq!(
                (sale.status, sale.error_code()),
                (503, "redis_unavailable"),
                "{strategy}: {}",
                sale.body
            );
            assert!(message.contains("same key"), "{message}");
        } else {
            assert_eq!(
                (sale.status, sale.error_code()),
                (504, "outcome_unknown"),
                "{strategy}: {}",
                sale.body
            );
            assert!(!message.contains("nothing"), "{message}");
        }
        // The write was queued in the frozen Redis and runs when it wakes; until it has,
        // the key says "in progress", never "nothing sold".
        let retry_query = format!("strategy={strategy}");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        let retry = loop {
            let retry = app.sale_with_key(&retry_query, key).await;
            if retry.error_code() != "in_progress" || tokio::time::Instant::now() > deadline {
                break retry;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        // Either the queued write landed (the retry replays it) or it never did (the key
        // was freed, and the retry sells): one item sold for the key, never two.
        assert_eq!(retry.status, 200, "{strategy}: {}", retry.body);
        let audit = app.audit().await;
        assert_eq!(
            (audit["sales"].as_i64(), audit["remaining"].as_i64()),
            (Some(1), Some(4)),
            "{strategy}: {audit}"
        );
        let again = app.sale_with_key(&retry_query, key).await;
        assert_eq!(again.headers["idempotent-replayed"], "true");
        assert_eq!(again.body["order_id"], retry.body["order_id"]);
    }
}

async fn assert_not_stocked(app: &Instance) {
    for strategy in Strategy::ALL {
        let sale = app.sale(&format!("strategy={strategy}")).await;
        assert_eq!(
            (sale.status, sale.error_code()),
            (404, "unknown_item"),
            "{strategy}: {}",
            sale.body
        );
    }
    for path in ["/inventory", "/inventory/audit"] {
        let reply = app.get(path).await;
        assert_eq!((reply.status, reply.error_code()), (404, "unknown_item"));
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_item_without_stock_answers_unknown_item_and_no_write_creates_one() {
    let mut redis = RedisServer::start().await;
    let app = InstanceBuilder::new(&redis, "app1").start().await;
    assert_not_stocked(&app).await;
    let mut c = redis.conn().await;
    let exists: bool = c.exists(Keys::new("001").stock).await.unwrap();
    assert!(!exists);

    // Redis restarted without its data: the stock is gone, not zero.
    app.reset(5).await;
    redis.stop().await;
    redis.restart().await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while app.get("/ready").await.status != 200 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_not_stocked(&app).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_ledger_is_capped_and_the_audit_still_counts_every_sale() {
    let cluster = Cluster::start(1, |b| b.env("LEDGER_MAX", 5)).await;
    let app = &cluster.instances[0];
    app.reset(400).await;
    for strategy in ["atomic", "fenced"] {
        for _ in 0..150 {
            assert_eq!(app.sale(&format!("strategy={strategy}")).await.status, 200);
        }
    }
    let audit = app.audit().await;
    assert_eq!(
        (audit["sales"].as_i64(), audit["clean"].as_bool()),
        (Some(300), Some(true))
    );
    let mut c = cluster.redis.conn().await;
    let kept: i64 = redis::cmd("XLEN")
        .arg(Keys::new("001").ledger)
        .query_async(&mut c)
        .await
        .unwrap();
    // Trimmed by whole nodes of the stream (at most 100 entries each, Redis's default).
    assert!((5..=5 + 100).contains(&kept), "{kept} entries kept");
    let newest = Store::new(
        &cluster.redis.url(),
        "001",
        Duration::from_secs(2),
        Default::default(),
    )
    .unwrap()
    .with_ledger_cap(5)
    .ledger()
    .await
    .unwrap();
    let remaining: Vec<i64> = newest
        .iter()
        .map(|e| {
            serde_json::from_str::<serde_json::Value>(e).unwrap()["remaining"]
                .as_i64()
                .unwrap()
        })
        .collect();
    assert_eq!(
        remaining,
        [104, 103, 102, 101, 100],
        "the newest five, oldest first"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn work_beyond_the_configured_ceiling_is_refused_and_the_document_says_so() {
    let cluster = Cluster::start(1, |b| b.env("MAX_WORK_MS", 100)).await;
    let app = &cluster.instances[0];
    app.reset(5).await;
    let refused = app.sale("work_ms=101").await;
    assert_eq!(refused.status, 400);
    assert!(
        refused.body["message"].as_str().unwrap().contains("100"),
        "{}",
        refused.body
    );
    assert_eq!(app.sale("work_ms=100").await.status, 200);
    let document = app.get("/api-docs/openapi.json").await.body;
    let parameters = document["paths"]["/inventory/sale"]["post"]["parameters"]
        .as_array()
        .unwrap();
    let work = parameters.iter().find(|p| p["name"] == "work_ms").unwrap();
    assert_eq!(work["schema"]["maximum"], 100);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_wrong_method_gets_a_json_405() {
    let cluster = Cluster::start(1, |b| b).await;
    let app = &cluster.instances[0];
    let http = reqwest::Client::new();
    for (method, path) in [
        (reqwest::Method::DELETE, "/inventory"),
        (reqwest::Method::PATCH, "/inventory/sale"),
        (reqwest::Method::POST, "/health"),
    ] {
        let reply = app.send(http.request(method.clone(), app.url(path))).await;
        assert_eq!(
            (reply.status, reply.error_code()),
            (405, "method_not_allowed"),
            "{method} {path}"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_instance_drops_clients_that_never_finish_their_headers_or_sit_idle() {
    let cluster = Cluster::start(1, |b| {
        b.env("HEADER_TIMEOUT_MS", 1_000).env("MAX_CONNECTIONS", 2)
    })
    .await;
    let app = &cluster.instances[0];
    let addr = format!("127.0.0.1:{}", app.port);

    // Half a request, then nothing: dropped.
    let mut slow = TcpStream::connect(&addr).await.unwrap();
    slow.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    let mut idle = TcpStream::connect(&addr).await.unwrap();
    // Both connections are taken: a third client waits in the backlog.
    let waiting = reqwest::Client::new()
        .get(app.url("/health"))
        .timeout(Duration::from_millis(150))
        .send()
        .await;
    assert!(waiting.is_err(), "served past MAX_CONNECTIONS: {waiting:?}");

    for (what, stream) in [("slow", &mut slow), ("idle", &mut idle)] {
        let mut buf = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut buf)).await;
        assert!(read.is_ok(), "the {what} client was never dropped");
    }
    // Their slots are free again.
    assert_eq!(app.get("/health").await.status, 200);
}

/// Connections past `MAX_CONNECTIONS` wait in the listening socket's backlog, which holds as
/// many again (at least 1024): with the standard library's 128, 1500 connections through
/// nginx overflowed it, nginx's connects timed out and it marked both instances down. Here
/// 600 clients connect to an instance that serves 4 at a time: every connection completes,
/// and each is served in turn.
#[tokio::test(flavor = "multi_thread")]
async fn connections_past_max_connections_wait_in_a_backlog_that_holds_them() {
    let cluster = Cluster::start(1, |b| b.env("MAX_CONNECTIONS", 4)).await;
    let app = &cluster.instances[0];
    let addr = format!("127.0.0.1:{}", app.port);
    let connects = (0..600).map(|_| {
        let addr = addr.clone();
        async move {
            tokio::time::timeout(Duration::from_secs(3), TcpStream::connect(addr))
                .await
                .map_err(|_| "connect timed out".to_owned())
                .and_then(|c| c.map_err(|e| e.to_string()))
        }
    });
    let streams = futures_util::future::join_all(connects).await;
    let failed = streams.iter().filter(|s| s.is_err()).count();
    assert_eq!(
        failed, 0,
        "connections left out of the backlog: {failed} of 600"
    );
    // Each is served once the ones before it close.
    let served =
        futures_util::future::join_all(streams.into_iter().flatten().map(|mut s| async move {
            s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                .await
                .ok()?;
            let mut answer = Vec::new();
            tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut answer))
                .await
                .ok()?
                .ok()?;
            answer.starts_with(b"HTTP/1.1 200").then_some(())
        }))
        .await;
    assert_eq!(served.iter().flatten().count(), 600);
}

/// A fencing token never goes backwards, across instances, even after Redis lost its data
/// (here `FLUSHALL`, then a restock): for each fenced strategy, one instance draws one token
/// and another many; after the loss, the first token either of them draws is above every
/// token drawn before it by anyone. An instance remembers only its own newest token, which
/// was all that lifted a lost counter before: the one that had drawn few went back.
#[tokio::test(flavor = "multi_thread")]
async fn fencing_tokens_never_go_backwards_across_instances_even_after_redis_lost_its_data() {
    let redis = RedisServer::start().await;
    let nodes = LockNodes::start(3).await;
    let start = |name: &'static str| {
        InstanceBuilder::new(&redis, name)
            .lock_nodes(&nodes)
            .start()
    };
    let few = start("app1").await;
    let many = start("app2").await;
    let mut c = redis.conn().await;
    let token = |reply: &Reply| {
        assert_eq!(reply.status, 200, "{}", reply.body);
        reply.body["fence"].as_u64().unwrap_or(0)
    };
    for strategy in ["fenced", "redlock-fenced"] {
        few.reset(1000).await;
        let query = format!("strategy={strategy}");
        let mut newest = token(&few.sale(&query).await);
        for _ in 0..3 {
            let burst = futures_util::future::join_all((0..16).map(|_| many.sale(&query))).await;
            newest = burst.iter().map(token).fold(newest, u64::max);
        }
        let _: () = redis::cmd("FLUSHALL").query_async(&mut c).await.unwrap();
        few.reset(1000).await;
        for app in [&few, &many, &few] {
            let after = token(&app.sale(&query).await);
            assert!(
                after > newest,
                "{strategy}: token {after} drawn by {} after the loss, {newest} before it",
                app.name
            );
            newest = after;
        }
        // Not lost but rolled back: Redis restarted from an append-only file whose last
        // second was not on disk, or from a backup, or a lagging replica was promoted. The
        // counter is there, only older: `few` drew nothing since, so its own newest token
        // lifts nothing, and its next token must still be above `many`'s.
        let keys = Keys::new("001");
        let rolled = [&keys.fence, &keys.fence_seen, &keys.quorum_fence_seen];
        let mut before: Vec<Option<String>> = Vec::new();
        for key in rolled {
            before.push(c.get(key).await.unwrap());
        }
        let burst = futures_util::future::join_all((0..16).map(|_| many.sale(&query))).await;
        newest = burst.iter().map(token).fold(newest, u64::max);
        for (key, value) in rolled.into_iter().zip(before) {
            let _: () = match value {
                Some(value) => c.set(key, value).await.unwrap(),
                None => c.del(key).await.unwrap(),
            };
        }
        let after = token(&few.sale(&query).await);
        assert!(
            after > newest,
            "{strategy}: token {after} drawn after a rollback of the counter, {newest} before it"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn no_write_from_before_a_loss_of_redis_data_lands_after_the_restock() {
    let cluster = Cluster::start(1, |b| b).await;
    let app = &cluster.instances[0];
    let mut c = cluster.redis.conn().await;
    app.reset(100).await;

    let reads = app.log().matches("stock read").count();
    let sale = app.sale("strategy=lua-release&work_ms=400");
    let lose_everything = async {
        until_stock_read(app, reads).await;
        let _: () = redis::cmd("FLUSHALL").query_async(&mut c).await.unwrap();
        app.reset(10).await;
    };
    let (sale, ()) = tokio::join!(sale, lose_everything);
    assert_eq!(
        (sale.status, sale.error_code()),
        (409, "stock_changed"),
        "{}",
        sale.body
    );
    assert_eq!(app.audit().await["remaining"], 10);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_audit_of_the_largest_stock_costs_bytes_not_megabytes() {
    let cluster = Cluster::start(1, |b| b).await;
    let app = &cluster.instances[0];
    app.reset(1_000_000_000).await;
    for strategy in ["atomic", "fenced"] {
        assert_eq!(app.sale(&format!("strategy={strategy}")).await.status, 200);
    }
    let mut c = cluster.redis.conn().await;
    let bytes: i64 = redis::cmd("MEMORY")
        .arg("USAGE")
        .arg(Keys::new("001").sold)
        .query_async(&mut c)
        .await
        .unwrap();
    assert!(bytes < 1_024, "two sales cost the audit {bytes} bytes");
    assert_eq!(app.audit().await["clean"], true);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_claim_or_an_acquire_queued_in_a_frozen_redis_does_not_outlive_it() {
    let redis = RedisServer::start().await;
    let app = InstanceBuilder::new(&redis, "app1")
        .env("REDIS_TIMEOUT_MS", 300)
        .start()
        .await;
    app.reset(10).await;
    for strategy in ["setnx", "owner-check", "fenced"] {
        let key = format!("frozen-claim-{strategy}");
        let query = format!("strategy={strategy}");
        redis.signal("STOP").await;
        let sale = app.sale_with_key(&query, &key).await;
        redis.signal("CONT").await;
        assert_eq!(sale.status, 503, "{strategy}: {}", sale.body);
        // The queued claim is freed and no lock is left behind: a retry soon sells.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
        let retry = loop {
            let retry = app.sale_with_key(&query, &key).await;
            if retry.status == 200 || tokio::time::Instant::now() > deadline {
                break retry;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert_eq!(retry.status, 200, "{strategy}: {}", retry.body);
    }
    // The naive strategies' acquires sent into the frozen Redis were undone too.
    redis.signal("STOP").await;
    let sale = app.sale("strategy=setnx").await;
    redis.signal("CONT").await;
    assert_eq!(sale.status, 503);
    let gone = redis
        .wait_for_key(&Keys::new("001").lock, false, Duration::from_secs(3))
        .await;
    assert!(
        gone.is_some(),
        "setnx's unanswered acquire left a lock forever"
    );
    assert_eq!(app.audit().await["clean"], true);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_instance_drops_a_client_that_stops_sending_its_body() {
    let cluster = Cluster::start(1, |b| b.env("HEADER_TIMEOUT_MS", 500)).await;
    let app = &cluster.instances[0];
    let mut stalled = TcpStream::connect(format!("127.0.0.1:{}", app.port))
        .await
        .unwrap();
    stalled
        .write_all(
            b"PUT /inventory HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
              Content-Length: 100\r\n\r\n{\"stock\":",
        )
        .await
        .unwrap();
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), stalled.read_to_end(&mut answer)).await;
    assert!(read.is_ok(), "a stalled body held the connection");
    let answer = String::from_utf8_lossy(&answer);
    // Slow, not wrong: a 408 in the JSON error shape.
    assert!(
        answer.starts_with("HTTP/1.1 408") && answer.contains("\"request_timeout\""),
        "{answer}"
    );
}

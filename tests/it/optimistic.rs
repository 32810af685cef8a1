//! `optimistic`: WATCH / MULTI / EXEC on pooled connections. It never oversells, a refused
//! EXEC is retried and sells, the pool's limits answer fast, and a connection left in an
//! unknown state mid-transaction is never handed to the next sale.

use std::time::{Duration, Instant};

use crate::harness::until_stock_read;
use inventory::lock::Strategy;
use inventory::store::Keys;
use loadtest::{LoadTest, Plan, Verdict};
use redis::AsyncCommands;
use testkit::fixture::{Instance, InstanceBuilder, RedisServer, Stack};

/// The value of one series of `/metrics`, 0 when absent.
async fn metric(app: &Instance, series: &str) -> f64 {
    let reply = app.get("/metrics").await;
    let text = reply.body.as_str().unwrap_or_default();
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{series} ")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread")]
async fn optimistic_never_oversells_under_a_64_way_storm_through_nginx() {
    let stack = Stack::start(|b| b).await;
    let strategy = Strategy::Optimistic;
    let plan = Plan {
        target: stack.nginx.url(),
        strategies: vec![strategy],
        stock: 50,
        requests: 400,
        concurrency: 64,
        work_ms: 1,
        admin_token: None,
    };
    let report = LoadTest::new(plan)
        .unwrap()
        .run_strategy(strategy, None)
        .await
        .unwrap();
    assert_eq!(report.verdict, Verdict::Safe, "{report:#?}");
    assert_eq!(
        (report.oversold, report.lost_updates, report.duplicates),
        (0, 0, 0),
        "{report:#?}"
    );
    assert_eq!((report.sold, report.remaining), (50, 0), "{report:#?}");
    assert!(report.agrees, "{report:#?}");
    let audit = stack.get("/inventory/audit").await.body;
    assert_eq!(audit["clean"], true, "{audit}");
    assert_eq!(audit["sales"].as_u64(), Some(50), "{audit}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_nil_exec_is_retried_and_the_retry_sells() {
    let redis = RedisServer::start().await;
    let app = InstanceBuilder::new(&redis, "app1").start().await;
    app.reset(100).await;
    let reads = app.log().matches("stock read").count();
    let sale = app.sale("strategy=optimistic&work_ms=400");
    // Another writer changes the stock while the sale works on what it read (100).
    let write = async {
        until_stock_read(&app, reads).await;
        let mut c = redis.conn().await;
        let () = c.set(Keys::new("001").stock, 50).await.unwrap();
    };
    let (sale, ()) = tokio::join!(sale, write);
    assert_eq!(sale.status, 200, "{}", sale.body);
    // Not 99: the first EXEC was refused, and the retry read 50.
    assert_eq!(sale.body["remaining"], 49, "{}", sale.body);
    assert!(app.log().contains("transaction conflict"), "{}", app.log());
    let conflicts = "inventory_optimistic_conflicts_total{strategy=\"optimistic\"}";
    let retries = "inventory_sale_retries_total{strategy=\"optimistic\"}";
    let wasted = "inventory_wasted_work_seconds_total{strategy=\"optimistic\"}";
    assert_eq!(metric(&app, conflicts).await, 1.0, "{}", app.log());
    assert_eq!(metric(&app, retries).await, 1.0);
    assert!(metric(&app, wasted).await >= 0.4);
    let mut c = redis.conn().await;
    let stock: i64 = c.get(Keys::new("001").stock).await.unwrap();
    assert_eq!(stock, 49);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_exhausted_pool_answers_503_fast() {
    let redis = RedisServer::start().await;
    let app = InstanceBuilder::new(&redis, "app1")
        .env("REDIS_POOL_SIZE", 1)
        .env("REDIS_POOL_WAIT_MS", 50)
        .start()
        .await;
    app.reset(10).await;
    let reads = app.log().matches("stock read").count();
    // The one connection is held by a sale that works for a second.
    let holder = app.sale("strategy=optimistic&work_ms=1000");
    let refused = async {
        until_stock_read(&app, reads).await;
        let started = Instant::now();
        let reply = app.sale("strategy=optimistic").await;
        (reply, started.elapsed())
    };
    let (holder, (refused, took)) = tokio::join!(holder, refused);
    assert_eq!(
        (refused.status, refused.error_code()),
        (503, "pool_exhausted"),
        "{}",
        refused.body
    );
    assert!(took < Duration::from_millis(500), "took {took:?}");
    assert_eq!(holder.status, 200, "{}", holder.body);
    assert_eq!(
        metric(&app, "inventory_redis_pool_exhausted_total").await,
        1.0
    );
    assert_eq!(metric(&app, "inventory_redis_pool_size").await, 1.0);
    let audit = app.audit().await;
    assert_eq!(
        (audit["sales"].as_i64(), audit["remaining"].as_i64()),
        (Some(1), Some(9)),
        "{audit}"
    );
}

/// The ids of the clients connected to `redis` whose last command was `cmd`.
async fn clients_last_running(redis: &RedisServer, cmd: &str) -> Vec<String> {
    let mut c = redis.conn().await;
    let list: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query_async(&mut c)
        .await
        .unwrap();
    list.lines()
        .filter(|l| l.split(' ').any(|f| f == format!("cmd={cmd}")))
        .filter_map(|l| l.split(' ').find_map(|f| f.strip_prefix("id=")))
        .map(str::to_owned)
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_connection_that_timed_out_mid_transaction_is_not_handed_to_the_next_sale() {
    let redis = RedisServer::start().await;
    let app = InstanceBuilder::new(&redis, "app1")
        .env("REDIS_POOL_SIZE", 1)
        .env("REDIS_TIMEOUT_MS", 300)
        .start()
        .await;
    app.reset(10).await;
    // The pool's one connection, known by its last command.
    assert_eq!(app.sale("strategy=optimistic").await.status, 200);
    let pooled = clients_last_running(&redis, "exec").await;
    assert_eq!(pooled.len(), 1, "{pooled:?}");

    // Redis freezes while the sale works, with its WATCH active: the check of its connection
    // before the EXEC goes unanswered (503: no EXEC sent), or, frozen later, the EXEC (504).
    let reads = app.log().matches("stock read").count();
    let sale = app.sale("strategy=optimistic&work_ms=200");
    let freeze = async {
        until_stock_read(&app, reads).await;
        redis.signal("STOP").await;
    };
    let (sale, ()) = tokio::join!(sale, freeze);
    redis.signal("CONT").await;
    assert!(
        matches!(
            (sale.status, sale.error_code()),
            (503, "redis_unavailable") | (504, "outcome_unknown")
        ),
        "{}",
        sale.body
    );

    // That connection was closed, not pooled again: Redis forgets it.
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let mut c = redis.conn().await;
        let list: String = redis::cmd("CLIENT")
            .arg("LIST")
            .query_async(&mut c)
            .await
            .unwrap();
        let ids: Vec<&str> = list
            .lines()
            .filter_map(|l| l.split(' ').find_map(|f| f.strip_prefix("id=")))
            .collect();
        if !ids.contains(&pooled[0].as_str()) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the timed-out connection is still open: {list}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A write between two sales would trip a WATCH left behind; the next sale, on a fresh
    // connection, sells at its first attempt.
    let mut c = redis.conn().await;
    let () = c.incr(Keys::new("001").lockfree_writes, 1).await.unwrap();
    let next = app.sale("strategy=optimistic").await;
    assert_eq!(next.status, 200, "{}", next.body);
    let conflicts = "inventory_optimistic_conflicts_total{strategy=\"optimistic\"}";
    assert_eq!(metric(&app, conflicts).await, 0.0);
    let audit = app.audit().await;
    assert_eq!(audit["clean"], true, "{audit}");
}

/// Redis killed during an `optimistic` sale's work, and back before it ends: the connection
/// holding the WATCH is gone, so the transaction cannot run. The sale answered 504 "may have
/// sold" (found from outside, 4 of 4); it now finds the connection dead before sending, and
/// answers 503 with nothing sold, which the books confirm.
#[tokio::test(flavor = "multi_thread")]
async fn redis_lost_during_the_work_is_a_sale_that_certainly_sold_nothing() {
    let mut redis = RedisServer::start_durable().await;
    let app = InstanceBuilder::new(&redis, "app1").start().await;
    app.reset(10).await;
    let sale = app.sale("strategy=optimistic&work_ms=800");
    let crash = async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        redis.stop().await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        redis.restart().await;
    };
    let (sale, ()) = tokio::join!(sale, crash);
    assert_eq!(
        (sale.status, sale.error_code()),
        (503, "redis_unavailable"),
        "{sale:?}"
    );
    let audit = app.audit().await;
    assert_eq!(
        (audit["sales"].as_i64(), audit["remaining"].as_i64()),
        (Some(0), Some(10)),
        "{audit}"
    );
    // And Redis back, the next sale sells.
    assert_eq!(app.sale("strategy=optimistic").await.status, 200);
}

//! Each strategy against its fault: two instances selling at once, a nested acquire, work
//! longer than the lease. The races are forced with `work_ms` and short leases.

use std::time::Duration;

use inventory::store::Keys;
use serde_json::Value;
use testkit::fixture::{Cluster, Reply, ledger};

use crate::harness::scripts_run;

const STOCK: i64 = 5;
const REQUESTS: usize = 24;
/// Long enough that every sale on one instance overlaps one on the other.
const WORK_MS: u64 = 40;

fn count(replies: &[Reply], status: u16, code: Option<&str>) -> usize {
    replies
        .iter()
        .filter(|r| r.status == status && code.is_none_or(|c| r.error_code() == c))
        .count()
}

/// Two instances, `REQUESTS` concurrent sales split between them; returns the audit.
async fn sell_on_two_instances(strategy: &str) -> (Value, Vec<Reply>) {
    let cluster = Cluster::start(2, |b| b).await;
    cluster.instances[0].reset(STOCK).await;
    let replies = cluster
        .concurrent_sales(REQUESTS, &format!("strategy={strategy}&work_ms={WORK_MS}"))
        .await;
    let audit = cluster.instances[1].audit().await;
    (audit, replies)
}

async fn assert_oversells(strategy: &str) {
    let (audit, replies) = sell_on_two_instances(strategy).await;
    let sold = count(&replies, 200, None);
    assert!(
        audit["oversold"].as_i64().unwrap() > 0,
        "{strategy} did not oversell: {audit}"
    );
    assert!(
        !audit["duplicates"].as_array().unwrap().is_empty(),
        "{audit}"
    );
    assert_eq!(
        audit["sales"].as_i64().unwrap(),
        sold as i64,
        "ledger vs 200s: {audit}"
    );
    assert_eq!(
        sold + count(&replies, 409, Some("sold_out")),
        REQUESTS,
        "{replies:?}"
    );
}

async fn assert_sells_exactly_the_stock(strategy: &str) {
    let (audit, replies) = sell_on_two_instances(strategy).await;
    assert_eq!(
        count(&replies, 200, None),
        STOCK as usize,
        "{strategy}: {replies:?}"
    );
    assert_eq!(
        count(&replies, 409, Some("sold_out")),
        REQUESTS - STOCK as usize,
        "{replies:?}"
    );
    assert_eq!(audit["remaining"], 0, "{audit}");
    assert_eq!(audit["sales"], STOCK, "{audit}");
    assert_eq!(audit["clean"], true, "{strategy}: {audit}");
    let instances: std::collections::BTreeSet<_> =
        replies.iter().filter_map(|r| r.instance.clone()).collect();
    assert_eq!(instances.len(), 2, "both instances answered");
}

#[tokio::test(flavor = "multi_thread")]
async fn none_oversells_across_two_instances() {
    assert_oversells("none").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn local_oversells_across_two_instances() {
    assert_oversells("local").await;
}

macro_rules! sells_exactly_the_stock {
    ($($test:ident => $strategy:literal),* $(,)?) => {$(
        #[tokio::test(flavor = "multi_thread")]
        async fn $test() {
            assert_sells_exactly_the_stock($strategy).await;
        }
    )*};
}

sells_exactly_the_stock! {
    setnx_sells_exactly_the_stock_across_two_instances => "setnx",
    setnx_ttl_sells_exactly_the_stock_across_two_instances => "setnx-ttl",
    owner_check_sells_exactly_the_stock_across_two_instances => "owner-check",
    lua_release_sells_exactly_the_stock_across_two_instances => "lua-release",
    reentrant_sells_exactly_the_stock_across_two_instances => "reentrant",
    watchdog_sells_exactly_the_stock_across_two_instances => "watchdog",
    fenced_sells_exactly_the_stock_across_two_instances => "fenced",
    atomic_sells_exactly_the_stock_across_two_instances => "atomic",
}

/// `atomic` sales that reach an instance together are sold by one script call (a batch),
/// and each still sells its own unit: its own remaining value, its own ledger entry, and a
/// refusal for those the stock no longer covers.
#[tokio::test(flavor = "multi_thread")]
async fn atomic_sales_arriving_together_share_one_script_call_and_each_sells_its_own_unit() {
    const BUYERS: usize = 20;
    // app1 runs on one worker thread, the scheduler under which sales are batched.
    let cluster = Cluster::start(1, |b| b).await;
    let app = &cluster.instances[0];
    app.reset(12).await;
    // One sale first: the script is loaded, and the item is known to be stocked.
    assert_eq!(app.sale("strategy=atomic").await.status, 200);
    let mut redis = cluster.redis.conn().await;
    let before = scripts_run(&mut redis).await;
    // Frozen, the instance leaves every connection and request to the kernel; thawed, it
    // reads them all in one turn of its scheduler.
    app.signal("STOP").await;
    let sales = futures_util::future::join_all((0..BUYERS).map(|_| app.sale("strategy=atomic")));
    let thaw = async {
        tokio::time::sleep(Duration::from_millis(500)).await;
        app.signal("CONT").await;
    };
    let (replies, ()) = tokio::join!(sales, thaw);
    let calls = scripts_run(&mut redis).await - before;

    let mut remaining: Vec<i64> = replies
        .iter()
        .filter(|r| r.status == 200)
        .map(|r| r.body["remaining"].as_i64().unwrap())
        .collect();
    remaining.sort_unstable();
    assert_eq!(remaining, (0..11).collect::<Vec<_>>(), "{replies:?}");
    assert_eq!(
        count(&replies, 409, Some("sold_out")),
        BUYERS - 11,
        "{replies:?}"
    );
    assert!(
        calls <= 2,
        "{BUYERS} sales that came together took {calls} script calls"
    );
    let audit = app.audit().await;
    assert_eq!(
        (audit["sales"].as_i64(), audit["remaining"].as_i64()),
        (Some(12), Some(0)),
        "{audit}"
    );
    assert_eq!(audit["clean"], true, "{audit}");
    let entries = ledger(&mut redis, &Keys::new("001").ledger).await;
    let sold: std::collections::BTreeSet<&str> = replies
        .iter()
        .filter(|r| r.status == 200)
        .map(|r| r.body["order_id"].as_str().unwrap())
        .collect();
    let written: std::collections::BTreeSet<&str> = entries
        .iter()
        .map(|e| e["order_id"].as_str().unwrap())
        .collect();
    assert!(
        sold.is_subset(&written),
        "every sale answered 200 has its ledger entry"
    );
    assert_eq!(written.len(), 12, "one entry per sale: {entries:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn spin_waiting_sells_exactly_the_stock_too() {
    let cluster = Cluster::start(2, |b| b.env("LOCK_WAIT", "spin")).await;
    cluster.instances[0].reset(STOCK).await;
    let replies = cluster
        .concurrent_sales(12, "strategy=lua-release&work_ms=20")
        .await;
    assert_eq!(count(&replies, 200, None), STOCK as usize);
    assert_eq!(cluster.instances[0].audit().await["clean"], true);
}

/// The previous wake-up (every release published to every instance) stays for comparison.
#[tokio::test(flavor = "multi_thread")]
async fn pubsub_waiting_sells_exactly_the_stock_too() {
    let cluster = Cluster::start(2, |b| b.env("LOCK_WAIT", "pubsub")).await;
    cluster.instances[0].reset(STOCK).await;
    let replies = cluster
        .concurrent_sales(12, "strategy=fenced&work_ms=20")
        .await;
    assert_eq!(count(&replies, 200, None), STOCK as usize);
    assert_eq!(cluster.instances[0].audit().await["clean"], true);
}

#[tokio::test(flavor = "multi_thread")]
async fn local_on_a_single_instance_never_oversells() {
    let cluster = Cluster::start(1, |b| b).await;
    cluster.instances[0].reset(STOCK).await;
    let replies = cluster
        .concurrent_sales(REQUESTS, "strategy=local&work_ms=20")
        .await;
    assert_eq!(count(&replies, 200, None), STOCK as usize);
    let audit = cluster.instances[0].audit().await;
    assert_eq!(audit["clean"], true, "{audit}");
    assert_eq!(audit["remaining"], 0);
}

const WAIT_BUDGET_MS: u64 = 400;

/// Walks the strategy table: a nested acquire succeeds exactly where the table says the
/// strategy is reentrant, and otherwise times out within the budget and frees the lock.
#[tokio::test(flavor = "multi_thread")]
async fn a_nested_acquire_succeeds_only_on_reentrant_strategies() {
    let cluster = Cluster::start(1, |b| b.env("LOCK_WAIT_MS", WAIT_BUDGET_MS)).await;
    let app = &cluster.instances[0];
    app.reset(100).await;
    let table = app.get("/strategies").await.body;
    let strategies = table["strategies"].as_array().unwrap();
    assert_eq!(strategies.len(), inventory::strategy::Strategy::ALL.len());
    for info in strategies {
        let name = info["name"].as_str().unwrap();
        let nested = app.sale(&format!("strategy={name}&reenter=true")).await;
        if info["reentrant"] == true {
            assert_eq!(nested.status, 200, "{name}: {nested:?}");
        } else {
            assert_eq!(
                (nested.status, nested.error_code()),
                (503, "lock_timeout"),
                "{name}: {nested:?}"
            );
            assert!(
                nested.elapsed >= Duration::from_millis(WAIT_BUDGET_MS)
                    && nested.elapsed < Duration::from_millis(WAIT_BUDGET_MS + 1_500),
                "{name} waited {:?} on a {WAIT_BUDGET_MS} ms budget",
                nested.elapsed
            );
        }
        // Whatever the nested acquire did, the outer lock was released.
        let next = app.sale(&format!("strategy={name}")).await;
        assert_eq!(next.status, 200, "{name} left its lock behind: {next:?}");
        assert!(
            next.elapsed < Duration::from_millis(WAIT_BUDGET_MS),
            "{name}: {next:?}"
        );
    }
    let reentrant: Vec<_> = strategies
        .iter()
        .filter(|i| i["reentrant"] == true)
        .filter_map(|i| i["name"].as_str())
        .collect();
    for name in ["reentrant", "watchdog", "fenced"] {
        assert!(reentrant.contains(&name), "{name} must be reentrant");
    }
    assert!(!reentrant.contains(&"lua-release"));
    assert_eq!(app.audit().await["clean"], true);
}

/// A nested acquire under a lock that is not reentrant, with a budget longer than the
/// lease: it waits for its own sale's lease to end, then sells, late. That wait is in the
/// answer's `waited_ms` and in the lock-wait histogram; both said 0 (a sale 5 s late
/// answered `"waited_ms": 0`).
#[tokio::test(flavor = "multi_thread")]
async fn a_nested_acquire_that_outwaits_its_own_lease_says_how_long_it_waited() {
    const TTL_MS: u64 = 300;
    let cluster = Cluster::start(1, |b| {
        b.env("LOCK_TTL_MS", TTL_MS).env("LOCK_WAIT_MS", 3000)
    })
    .await;
    let app = &cluster.instances[0];
    app.reset(10).await;
    for name in ["lua-release", "setnx-ttl", "owner-check"] {
        let nested = app.sale(&format!("strategy={name}&reenter=true")).await;
        assert_eq!(nested.status, 200, "{name}: {nested:?}");
        let waited = nested.body["waited_ms"].as_u64().unwrap_or(0);
        assert!(
            waited >= TTL_MS * 3 / 4 && Duration::from_millis(waited) <= nested.elapsed,
            "{name}: waited_ms {waited} for a sale answered after {:?}",
            nested.elapsed
        );
        let metrics = app.get("/metrics").await;
        let text = metrics.body.as_str().unwrap_or_default();
        let series = format!("inventory_lock_wait_seconds_sum{{strategy=\"{name}\"}} ");
        let sum: f64 = text
            .lines()
            .find_map(|l| l.strip_prefix(series.as_str()))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0);
        assert!(
            sum * 1000.0 >= (TTL_MS * 3 / 4) as f64,
            "{name}: {series}{sum}"
        );
    }
}

const SHORT_TTL_MS: u64 = 300;
const LONG_WORK_MS: u64 = 3 * SHORT_TTL_MS;

/// A sale on app1 works three leases long; a second sale on app2 starts while it holds the
/// lock. Returns the audit and both replies.
async fn work_longer_than_the_lease(strategy: &str) -> (Value, Reply, Reply) {
    let cluster = Cluster::start(2, |b| b.env("LOCK_TTL_MS", SHORT_TTL_MS)).await;
    let (slow_app, fast_app) = (&cluster.instances[0], &cluster.instances[1]);
    slow_app.reset(2).await;
    let slow_query = format!("strategy={strategy}&work_ms={LONG_WORK_MS}");
    let slow = slow_app.sale(&slow_query);
    let fast = async {
        tokio::time::sleep(Duration::from_millis(SHORT_TTL_MS / 3)).await;
        fast_app.sale(&format!("strategy={strategy}")).await
    };
    let (slow, fast) = tokio::join!(slow, fast);
    (slow_app.audit().await, slow, fast)
}

#[tokio::test(flavor = "multi_thread")]
async fn reentrant_loses_its_lock_to_work_longer_than_the_ttl() {
    let (audit, slow, fast) = work_longer_than_the_lease("reentrant").await;
    assert_eq!((slow.status, fast.status), (200, 200));
    assert!(
        fast.elapsed < Duration::from_millis(LONG_WORK_MS - SHORT_TTL_MS / 3),
        "the second sale got in before the first finished: {fast:?}"
    );
    assert!(audit["lost_updates"].as_i64().unwrap() > 0, "{audit}");
    assert_eq!(audit["clean"], false, "{audit}");
}

#[tokio::test(flavor = "multi_thread")]
async fn watchdog_keeps_its_lock_through_work_longer_than_the_ttl() {
    let (audit, slow, fast) = work_longer_than_the_lease("watchdog").await;
    assert_eq!((slow.status, fast.status), (200, 200), "{slow:?} {fast:?}");
    assert_eq!(audit["remaining"], 0, "{audit}");
    assert_eq!(audit["clean"], true, "{audit}");
    assert!(
        fast.elapsed >= Duration::from_millis(LONG_WORK_MS - SHORT_TTL_MS),
        "{fast:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn fenced_keeps_its_lock_through_work_longer_than_the_ttl() {
    let (audit, slow, fast) = work_longer_than_the_lease("fenced").await;
    assert_eq!((slow.status, fast.status), (200, 200), "{slow:?} {fast:?}");
    assert_eq!(audit["clean"], true, "{audit}");
    assert!(
        fast.body["fence"].as_u64() > slow.body["fence"].as_u64(),
        "{slow:?} {fast:?}"
    );
}

/// `LOCK_WAIT_MS=0`: no waiting, but a free lock is still taken. From outside, every sale of
/// a strategy that passes its lock within a tenure (the default, `fenced`, among them)
/// answered 503 `lock_timeout` on an idle instance, "the lock stayed held for 0 ms". For
/// every lock strategy, in every wait mode: sales one after another all sell; one arriving
/// while another holds the lock answers `lock_timeout` at once and sells nothing.
#[tokio::test(flavor = "multi_thread")]
async fn with_no_wait_budget_a_free_lock_is_taken_and_a_held_one_refused_at_once() {
    let strategies = [
        "setnx-ttl",
        "owner-check",
        "lua-release",
        "reentrant",
        "watchdog",
        "fenced",
        "redlock",
        "redlock-fenced",
    ];
    for wait in ["notify", "pubsub", "spin"] {
        let cluster = Cluster::start(1, |b| b.env("LOCK_WAIT_MS", 0).env("LOCK_WAIT", wait)).await;
        let app = &cluster.instances[0];
        app.reset(100).await;
        for strategy in strategies {
            for _ in 0..3 {
                let sale = app.sale(&format!("strategy={strategy}")).await;
                assert_eq!(sale.status, 200, "{wait}, {strategy}, lock free: {sale:?}");
            }
            let query = format!("strategy={strategy}&work_ms=400");
            let (holder, refused) = tokio::join!(app.sale(&query), async {
                tokio::time::sleep(Duration::from_millis(150)).await;
                app.sale(&format!("strategy={strategy}")).await
            });
            assert_eq!(holder.status, 200, "{wait}, {strategy}: {holder:?}");
            assert_eq!(
                (refused.status, refused.error_code()),
                (503, "lock_timeout"),
                "{wait}, {strategy}, lock held: {refused:?}"
            );
            assert!(refused.elapsed < Duration::from_millis(200), "{refused:?}");
        }
        let audit = app.audit().await;
        assert_eq!(audit["sales"], 4 * strategies.len(), "{wait}: {audit}");
        assert_eq!(audit["clean"], true, "{wait}: {audit}");
    }
}

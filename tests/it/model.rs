//! Generated runs of the whole service, checked against what Redis holds.
//!
//! Each case is a few rounds of requests sent at once to two instances: sales of every safe
//! strategy on two items, with and without an `Idempotency-Key` (a small pool, so keys
//! repeat across strategies, instances and rounds), with work inside the lock; at most one
//! reset per item per round, landing among those sales; and requests that must not sell
//! (`HEAD` and `OPTIONS` of a sale route, `GET` of the stock). After each round the stock is
//! read from Redis directly, not through the service, and the round must account for it:
//!
//! - every 200 with a new order id sold one unit, and nothing else sold: the stock after is
//!   the stock before (or the reset's) less those sales;
//! - their remaining values are exactly the units between, each once: no unit sold twice,
//!   none lost, whether a sale landed before the reset or after it;
//! - a key that was answered with a sale answers that sale ever after (or "in progress"
//!   while one runs), never a second one;
//! - fencing tokens never go backwards: within a round a later unit has a higher token, and
//!   every token of a round is above every token of the rounds before;
//! - every other answer is a refusal that sells nothing (`sold_out`, `stock_changed`,
//!   `in_progress`, `too_much_contention`, and `lock_lost` when a reset took the item's lock
//!   mid-sale), never a 5xx on a healthy Redis.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use inventory::store::Keys;
use inventory::store::hash_slot;
use inventory::strategy::Strategy as SaleStrategy;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use testkit::RedisCluster;
use testkit::fixture::{Cluster, Instance, InstanceBuilder, LockNodes, Reply};

/// The default item (paths without an id) and one more.
const DEFAULT_ITEM: &str = "001";

/// Where the runs go: the instances, the two items' ids, and a connection that reads the
/// stock from Redis itself (one server's, or the cluster's).
struct World<'a, C> {
    apps: &'a [Instance],
    items: [String; 2],
    redis: C,
}
const REFUSALS: [&str; 4] = [
    "sold_out",
    "stock_changed",
    "in_progress",
    "too_much_contention",
];

fn safe_strategies() -> Vec<SaleStrategy> {
    SaleStrategy::ALL
        .into_iter()
        .filter(|s| s.info().distributed)
        .collect()
}

#[derive(Debug, Clone)]
enum Op {
    Sale {
        app: usize,
        strategy: usize,
        item: usize,
        work_ms: u64,
        key: Option<u8>,
    },
    Reset {
        app: usize,
        item: usize,
        stock: i64,
    },
    /// A request that must not sell: 0 `HEAD` sale, 1 `OPTIONS` sale, 2 `GET` stock.
    Look {
        app: usize,
        item: usize,
        kind: u8,
    },
}

fn op(strategies: usize) -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..2usize, 0..strategies, 0..2usize, prop_oneof![Just(0u64), 1..25u64], proptest::option::of(0..4u8))
            .prop_map(|(app, strategy, item, work_ms, key)| Op::Sale { app, strategy, item, work_ms, key }),
        1 => (0..2usize, 0..2usize, 0..7i64).prop_map(|(app, item, stock)| Op::Reset { app, item, stock }),
        1 => (0..2usize, 0..2usize, 0..3u8).prop_map(|(app, item, kind)| Op::Look { app, item, kind }),
    ]
}

/// Rounds of requests sent at once; a second reset of an item in a round is dropped, so
/// that each round has at most one point at which the stock was set.
fn rounds(strategies: usize) -> impl Strategy<Value = Vec<Vec<Op>>> {
    proptest::collection::vec(proptest::collection::vec(op(strategies), 1..10), 1..5).prop_map(
        |rounds| {
            rounds
                .into_iter()
                .map(|round| {
                    let mut reset = [false; 2];
                    round
                        .into_iter()
                        .filter(|op| match op {
                            Op::Reset { item, .. } => !std::mem::replace(&mut reset[*item], true),
                            _ => true,
                        })
                        .collect()
                })
                .collect()
        },
    )
}

/// What the checks remember across rounds and cases.
#[derive(Default)]
struct Books {
    /// Every order id answered so far.
    orders: HashSet<String>,
    /// The order id each key (per item) was answered with.
    keyed: HashMap<(usize, String), String>,
    /// The highest fencing token seen per item.
    newest_fence: [u64; 2],
}

impl<C: redis::aio::ConnectionLike + Send> World<'_, C> {
    async fn stock(&mut self, item: usize) -> i64 {
        redis::cmd("GET")
            .arg(Keys::new(&self.items[item]).stock)
            .query_async::<Option<i64>>(&mut self.redis)
            .await
            .unwrap()
            .expect("every item is stocked before the cases")
    }

    /// The item's path with `suffix` (`/sale`, `/audit`, or none): the default item's is
    /// the one without an id.
    fn path(&self, item: usize, suffix: &str) -> String {
        match self.items[item].as_str() {
            DEFAULT_ITEM => format!("/inventory{suffix}"),
            id => format!("/inventory/{id}{suffix}"),
        }
    }

    async fn reset_at(&self, app: usize, item: usize, stock: i64) {
        let app = &self.apps[app];
        let reply = app
            .send(
                reqwest::Client::new()
                    .put(app.url(&self.path(item, "")))
                    .header("content-type", "application/json")
                    .body(format!(r#"{{"stock": {stock}}}"#)),
            )
            .await;
        assert_eq!(reply.status, 200, "reset: {reply:?}");
    }
}

/// Sends one op; a sale's reply comes back with its item and key.
async fn send<C: redis::aio::ConnectionLike + Send>(
    world: &World<'_, C>,
    case: u64,
    op: &Op,
    strategies: &[SaleStrategy],
) -> Option<(usize, Option<String>, Reply)> {
    let http = reqwest::Client::new();
    match *op {
        Op::Sale {
            app,
            strategy,
            item,
            work_ms,
            key,
        } => {
            let app = &world.apps[app];
            let url = app.url(&format!(
                "{}?strategy={}&work_ms={work_ms}",
                world.path(item, "/sale"),
                strategies[strategy]
            ));
            let key = key.map(|k| format!("case{case}-k{k}"));
            let mut request = http.post(url);
            if let Some(key) = &key {
                request = request.header("idempotency-key", key);
            }
            Some((item, key, app.send(request).await))
        }
        Op::Reset { app, item, stock } => {
            world.reset_at(app, item, stock).await;
            None
        }
        Op::Look { app, item, kind } => {
            let app = &world.apps[app];
            let sale = app.url(&world.path(item, "/sale"));
            let reply = match kind {
                0 => app.send(http.head(sale)).await,
                1 => app.send(http.request(reqwest::Method::OPTIONS, sale)).await,
                _ => app.get(&world.path(item, "")).await,
            };
            assert!(reply.status < 500, "{op:?}: {reply:?}");
            None
        }
    }
}

async fn run_case<C: redis::aio::ConnectionLike + Send>(
    world: &mut World<'_, C>,
    books: &Mutex<Books>,
    case: u64,
    rounds: &[Vec<Op>],
    strategies: &[SaleStrategy],
) -> Result<(), TestCaseError> {
    // Every case from a clean slate: the audit speaks of the sales since the last reset, and
    // a shrunk case must not be blamed for the case that failed before it.
    for item in 0..2 {
        world.reset_at(0, item, 4).await;
    }
    for round in rounds {
        let before = [world.stock(0).await, world.stock(1).await];
        let replies = {
            let world = &*world;
            futures_util::future::join_all(round.iter().map(|op| send(world, case, op, strategies)))
                .await
        };
        let after = [world.stock(0).await, world.stock(1).await];
        let mut books = books.lock().unwrap();
        let round_fences_floor = books.newest_fence;
        // Per item: the remaining values of the new sales, and (fenced) their tokens.
        let mut sold: [Vec<i64>; 2] = Default::default();
        let mut fenced: [Vec<(i64, u64)>; 2] = Default::default();
        for (item, key, reply) in replies.into_iter().flatten() {
            if reply.status != 200 {
                // A reset takes the item's lock away from a sale holding it, which then
                // finds it gone before its write (and writes nothing).
                let reset_here = round
                    .iter()
                    .any(|op| matches!(op, Op::Reset { item: i, .. } if *i == item));
                let code = reply.error_code();
                prop_assert!(
                    REFUSALS.contains(&code) || (reset_here && code == "lock_lost"),
                    "a refusal that is not one, for item {} (reset in the round: {}): {} {}",
                    world.items[item],
                    reset_here,
                    reply.status,
                    reply.body
                );
                continue;
            }
            let order = reply.body["order_id"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            prop_assert!(!order.is_empty(), "{}", reply.body);
            if let Some(key) = key {
                let first = books
                    .keyed
                    .entry((item, key.clone()))
                    .or_insert(order.clone());
                prop_assert_eq!(&*first, &order, "key {} answered two sales", key);
            }
            if !books.orders.insert(order) {
                continue; // a replay of a sale counted before
            }
            let remaining = reply.body["remaining"].as_i64().unwrap();
            sold[item].push(remaining);
            if let Some(fence) = reply.body["fence"].as_u64() {
                fenced[item].push((remaining, fence));
            }
        }
        for item in 0..2 {
            let reset = round.iter().find_map(|op| match op {
                Op::Reset { item: i, stock, .. } if *i == item => Some(*stock),
                _ => None,
            });
            let mut units = sold[item].clone();
            units.sort_unstable();
            // The units each new sale took: below the stock before, and (after a reset)
            // below the reset's stock, down to the stock after.
            let after_reset = match reset {
                Some(r) => r - after[item],
                None => 0,
            };
            let before_reset = i64::try_from(units.len()).unwrap() - after_reset;
            prop_assert!(
                (0..=i64::try_from(units.len()).unwrap()).contains(&after_reset)
                    && before_reset >= 0,
                "item {}: stock {} -> {} (reset {:?}) with sales {:?}",
                world.items[item],
                before[item],
                after[item],
                reset,
                units
            );
            let mut expected: Vec<i64> = (before[item] - before_reset..before[item]).collect();
            match reset {
                Some(r) => expected.extend(after[item]..r),
                None => prop_assert_eq!(
                    after[item],
                    before[item] - before_reset,
                    "item {}: a sale landed that no 200 told of, or a 200 sold nothing",
                    world.items[item]
                ),
            }
            expected.sort_unstable();
            prop_assert_eq!(
                &units,
                &expected,
                "item {}: stock {} -> {} (reset {:?}); round {:?}",
                world.items[item],
                before[item],
                after[item],
                reset,
                round
            );
            // Tokens: above every earlier round's, and (between resets, where a lower unit
            // was sold later) rising as the units fall.
            let mut by_unit = fenced[item].clone();
            by_unit.sort_unstable_by(|a, b| b.cmp(a));
            for &(unit, fence) in &by_unit {
                prop_assert!(
                    fence > round_fences_floor[item],
                    "item {}: token {} sold unit {} after token {} of an earlier round",
                    world.items[item],
                    fence,
                    unit,
                    round_fences_floor[item]
                );
            }
            if reset.is_none() {
                prop_assert!(
                    by_unit.windows(2).all(|w| w[0].1 < w[1].1),
                    "item {}: a later unit under an older token: {:?}",
                    world.items[item],
                    by_unit
                );
            }
            if let Some(newest) = by_unit.iter().map(|f| f.1).max() {
                books.newest_fence[item] = books.newest_fence[item].max(newest);
            }
        }
    }
    for instance in world.apps {
        for item in 0..2 {
            let audit = instance.get(&world.path(item, "/audit")).await;
            prop_assert_eq!(
                &audit.body["clean"],
                true,
                "{}: {}",
                world.items[item],
                audit.body
            );
        }
    }
    Ok(())
}

/// Runs `cases` generated cases against `world`; what it sold, and the first failure with
/// both instances' logs.
fn run_model<C: redis::aio::ConnectionLike + Send>(
    runtime: &tokio::runtime::Runtime,
    world: &mut World<'_, C>,
    cases: u32,
) {
    let strategies = safe_strategies();
    let books = Mutex::new(Books::default());
    let ran = AtomicU64::new(0);
    let mut runner = TestRunner::new(Config {
        cases,
        max_shrink_iters: 64,
        failure_persistence: None,
        ..Config::default()
    });
    let world = Mutex::new(world);
    let outcome = runner.run(&rounds(strategies.len()), |rounds| {
        let case = ran.fetch_add(1, Ordering::Relaxed);
        let mut world = world.lock().unwrap();
        runtime.block_on(run_case(&mut world, &books, case, &rounds, &strategies))
    });
    let world = world.into_inner().unwrap();
    let ran = ran.load(Ordering::Relaxed);
    let sales: BTreeMap<usize, usize> = books
        .lock()
        .map(|b| BTreeMap::from([(0, b.orders.len()), (1, b.keyed.len())]))
        .unwrap_or_default();
    if let Err(e) = outcome {
        panic!(
            "{e}\nafter {ran} cases; logs:\n{}\n{}",
            world.apps[0].log(),
            world.apps[1].log()
        );
    }
    // The cases did sell, and keys did repeat: otherwise this checked nothing.
    assert!(
        sales[&0] > 0 && sales[&1] > 0,
        "sales and keys seen: {sales:?}"
    );
}

/// Generated rounds of sales of every safe strategy, resets and requests that must not sell,
/// on two instances and two items of one Redis: the stock read from Redis accounts for
/// every round.
#[test]
fn generated_rounds_of_safe_sales_resets_and_retries_account_for_every_unit() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    // Long leases: no lock expires under 25 ms of work, so every refusal here is one that
    // a healthy Redis makes, and the books must balance exactly.
    let cluster = runtime.block_on(Cluster::start(2, |b| b.env("LOCK_TTL_MS", 5000)));
    let redis = runtime.block_on(cluster.redis.conn());
    let mut world = World {
        apps: &cluster.instances,
        items: [DEFAULT_ITEM.to_owned(), "m2".to_owned()],
        redis,
    };
    run_model(&runtime, &mut world, 40);
}

/// The same on a Redis Cluster of three masters, with the two items on two of them.
#[test]
fn generated_rounds_on_a_redis_cluster_account_for_every_unit_on_each_master() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let (redis_cluster, nodes) =
        runtime.block_on(async { (RedisCluster::start().await, LockNodes::start(3).await) });
    let apps: Vec<Instance> = runtime.block_on(async {
        let mut apps = Vec::new();
        for name in ["app1", "app2"] {
            apps.push(
                InstanceBuilder::on_cluster(&redis_cluster, &nodes, name)
                    .env("LOCK_TTL_MS", 5000)
                    .start()
                    .await,
            );
        }
        apps
    });
    let masters = runtime.block_on(redis_cluster.masters());
    let on_master = |i: usize| -> String {
        std::iter::once(DEFAULT_ITEM.to_owned())
            .chain((0..10_000).map(|n| format!("m{n}")))
            .find(|id| masters[i].serves(hash_slot(&format!("{{{id}}}"))))
            .expect("an id on every master")
    };
    let items = [on_master(0), on_master(1)];
    let redis = runtime.block_on(redis_cluster.client());
    let mut world = World {
        apps: &apps,
        items,
        redis,
    };
    run_model(&runtime, &mut world, 16);
}

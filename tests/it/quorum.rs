//! The quorum lock on separate `redis-server` nodes: it works while a majority answers,
//! says which node is missing, fails fast when a majority is gone, and refuses to run
//! without nodes.

use std::time::Duration;

use clap::Parser;
use inventory::config::Config;
use serde_json::Value;
use testkit::fixture::{Instance, InstanceBuilder, RedisServer};

use crate::harness::node_states;

const QUORUM_STRATEGIES: [&str; 2] = ["redlock", "redlock-fenced"];

/// The `LOCK_NODES` setting naming `nodes`.
pub(crate) fn lock_nodes(nodes: &[RedisServer]) -> String {
    let list: Vec<String> = nodes.iter().map(RedisServer::url).collect();
    list.join(",")
}

/// Three lock nodes, each its own process, and one instance using them.
pub(crate) async fn with_three_nodes(
    configure: impl Fn(InstanceBuilder) -> InstanceBuilder,
) -> (RedisServer, Vec<RedisServer>, Instance) {
    let redis = RedisServer::start().await;
    let mut nodes = Vec::new();
    for _ in 0..3 {
        nodes.push(RedisServer::start().await);
    }
    let app = configure(
        InstanceBuilder::new(&redis, "app1")
            .env("LOCK_NODES", lock_nodes(&nodes))
            .env("REDIS_TIMEOUT_MS", 300),
    )
    .start()
    .await;
    (redis, nodes, app)
}

/// A quorum sale no acquirer could win: 503 `redis_unavailable` within `bound`, not after
/// the 10 s wait budget, and saying that the lock nodes are the cause (the stock's Redis
/// answers) and that nothing was sold.
async fn refused_soon(app: &Instance, strategy: &str, bound: Duration) {
    let sale = app.sale(&format!("strategy={strategy}")).await;
    assert_eq!(
        (sale.status, sale.error_code()),
        (503, "redis_unavailable"),
        "{strategy}: {sale:?}"
    );
    assert!(sale.elapsed < bound, "{strategy}: {sale:?}");
    let message = sale.body["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("lock nodes") && message.contains("nothing was sold"),
        "{strategy}: {message}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_quorum_lock_sells_with_one_node_of_three_down_and_fails_fast_without_a_majority() {
    let (_redis, mut nodes, app) = with_three_nodes(|b| b).await;
    app.reset(100).await;
    let ready = app.get("/ready").await;
    assert_eq!(
        (ready.status, node_states(&ready.body)),
        (200, vec![true; 3])
    );
    for strategy in QUORUM_STRATEGIES {
        assert_eq!(app.sale(&format!("strategy={strategy}")).await.status, 200);
    }

    nodes[1].stop().await;
    for strategy in QUORUM_STRATEGIES {
        for _ in 0..5 {
            let sale = app.sale(&format!("strategy={strategy}")).await;
            assert_eq!(sale.status, 200, "{strategy} with one node down: {sale:?}");
        }
    }
    let ready = app.get("/ready").await;
    assert_eq!(
        (ready.status, node_states(&ready.body)),
        (200, vec![true, false, true]),
        "{:?}",
        ready.body
    );
    let metrics = app.get("/metrics").await;
    let text = metrics.body.as_str().unwrap();
    let failed_on_node_2 = format!(
        "inventory_lock_node_votes_total{{node=\"127.0.0.1:{}\",vote=\"failed\"}}",
        nodes[1].port()
    );
    let failed: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix(&failed_on_node_2))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {failed_on_node_2} in\n{text}"));
    assert!(failed >= 10.0, "{failed_on_node_2} = {failed}");

    // Without a majority no acquirer can win: a fast 503, not a wait for the budget.
    nodes[2].stop().await;
    for strategy in QUORUM_STRATEGIES {
        refused_soon(&app, strategy, Duration::from_secs(2)).await;
    }
    // Sales in line behind one another answer together once the first found too few nodes
    // up, not each in turn (8 in line took 2-7 s before).
    for strategy in QUORUM_STRATEGIES {
        let query = format!("strategy={strategy}");
        let sales = futures_util::future::join_all((0..8).map(|_| app.sale(&query))).await;
        let slowest = sales.iter().map(|s| s.elapsed).max().unwrap_or_default();
        for sale in &sales {
            assert_eq!(
                (sale.status, sale.error_code()),
                (503, "redis_unavailable"),
                "{strategy}: {sale:?}"
            );
        }
        assert!(
            slowest < Duration::from_secs(1),
            "{strategy}: 8 sales in line took {slowest:?} to be refused"
        );
    }
    let ready = app.get("/ready").await;
    assert_eq!(ready.status, 503, "{ready:?}");
    let message = ready.body["message"].as_str().unwrap_or_default();
    assert!(
        message.starts_with("2 of the 3 lock nodes") && message.contains("needs 2"),
        "/ready names the lock nodes, not the stock's Redis: {message}"
    );
    // Each node that did not answer, by address (with why: refused, or no answer within its
    // bound while the connection is retried).
    for i in [1, 2] {
        let node = format!("127.0.0.1:{}: ", nodes[i].port());
        assert!(message.contains(&node), "names {node}: {message}");
    }
    assert!(
        !message.contains(&format!("127.0.0.1:{}: ", nodes[0].port())),
        "{message}"
    );
    // The other strategies do not depend on the lock nodes.
    assert_eq!(app.sale("strategy=fenced").await.status, 200);

    // Back to a majority: the quorum lock sells again by itself.
    nodes[2].restart().await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        if app.sale("strategy=redlock").await.status == 200 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "never recovered");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let audit = app.audit().await;
    assert_eq!(audit["clean"], true, "{audit}");
}

/// Frozen nodes (`SIGSTOP`) accept connections and answer nothing, unlike stopped ones: a
/// majority frozen is still a fast 503 that sold nothing, not a wait for the whole budget
/// ending in "the lock stayed held" when nobody held it. A frozen minority costs votes only,
/// and no time: a sale settles once the others have answered. And when the nodes wake, what
/// they were sent runs in the order it was sent: no node is left holding the lock for a
/// sale that gave up or had finished.
#[tokio::test(flavor = "multi_thread")]
async fn the_quorum_lock_answers_503_soon_with_a_majority_of_nodes_frozen_and_sells_again_after() {
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;

    // A lease far longer than the waits below, so that a grant left on a node would show;
    // each node call is then bounded by 250 ms.
    let (_redis, nodes, app) = with_three_nodes(|b| b.env("LOCK_TTL_MS", 30_000)).await;
    app.reset(100).await;
    let pid = |i: usize| Pid::from_raw(nodes[i].pid().expect("a running node") as i32);
    // Frozen before any sale, so it has cached no script either (as after a restart).
    kill(pid(0), Signal::SIGSTOP).unwrap();
    // Readiness waits for a frozen node no longer than a sale does (its share of the lease,
    // 250 ms here), once: not for the Redis timeout twice over, nor for a second round of
    // checks bounded again (503 ms, from outside).
    let ready = app.get("/ready").await;
    assert_eq!(
        (ready.status, node_states(&ready.body)),
        (200, vec![false, true, true]),
        "{ready:?}"
    );
    assert!(ready.elapsed < Duration::from_millis(450), "{ready:?}");
    for strategy in QUORUM_STRATEGIES {
        for _ in 0..3 {
            let sale = app.sale(&format!("strategy={strategy}")).await;
            assert_eq!(
                sale.status, 200,
                "{strategy} with one node frozen: {sale:?}"
            );
            // Waiting for the frozen node costs its bound for the grant and again for the
            // release: 500 ms a sale.
            assert!(
                sale.elapsed < Duration::from_millis(250),
                "{strategy} waited for the frozen node: {sale:?}"
            );
        }
    }
    kill(pid(1), Signal::SIGSTOP).unwrap();
    let ready = app.get("/ready").await;
    let message = ready.body["message"].as_str().unwrap_or_default();
    assert_eq!(ready.status, 503, "{ready:?}");
    assert!(
        message.contains(&format!(
            "127.0.0.1:{}: no answer within 250 ms",
            nodes[1].port()
        )),
        "a frozen node is said not to answer, not to refuse: {message}"
    );
    for strategy in QUORUM_STRATEGIES {
        for _ in 0..2 {
            // The store's timeout is 300 ms, and one attempt waits up to twice the nodes'
            // bound (the votes, then the give-back).
            refused_soon(&app, strategy, Duration::from_secs(3)).await;
        }
    }
    // Sales in line behind one another (one at a time stands in the Redis queue for the
    // instance) answer together once the first has given up, not one streak apart each.
    for strategy in QUORUM_STRATEGIES {
        let query = format!("strategy={strategy}");
        let sales = futures_util::future::join_all((0..8).map(|_| app.sale(&query))).await;
        for sale in &sales {
            assert_eq!(
                (sale.status, sale.error_code()),
                (503, "redis_unavailable"),
                "{strategy}: {sale:?}"
            );
        }
        let slowest = sales.iter().map(|s| s.elapsed).max().unwrap_or_default();
        assert!(
            slowest < Duration::from_secs(3),
            "{strategy}: 8 sales in line took {slowest:?} to be refused"
        );
    }
    assert_eq!(app.audit().await["sales"], 6, "the 503s sold nothing");
    for i in [0, 1] {
        kill(pid(i), Signal::SIGCONT).unwrap();
    }
    // Each grant a node ran on waking has its give-back right behind it, on the same
    // connection: a node left holding the lock would keep it for the 30 s lease.
    let lock = inventory::store::Keys::new("001").lock;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
    for node in &nodes {
        let mut c = node.conn().await;
        loop {
            let holder: Option<String> = redis::cmd("GET")
                .arg(&lock)
                .query_async(&mut c)
                .await
                .unwrap();
            let Some(holder) = holder else { break };
            assert!(
                tokio::time::Instant::now() < deadline,
                "node {} still holds the lock for {holder}, who gave it up",
                node.port()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    for strategy in QUORUM_STRATEGIES {
        let sale = app.sale(&format!("strategy={strategy}")).await;
        assert_eq!(
            sale.status, 200,
            "{strategy} after the nodes woke: {sale:?}"
        );
    }
    let audit = app.audit().await;
    assert_eq!(
        (audit["sales"].as_i64(), audit["clean"].as_bool()),
        (Some(8), Some(true)),
        "{audit}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_quorum_sale_without_lock_nodes_is_a_400_naming_the_setting() {
    let redis = RedisServer::start().await;
    let app = InstanceBuilder::new(&redis, "app1")
        .unset("LOCK_NODES")
        .start()
        .await;
    app.reset(5).await;
    for strategy in QUORUM_STRATEGIES {
        let sale = app.sale(&format!("strategy={strategy}")).await;
        assert_eq!((sale.status, sale.error_code()), (400, "bad_request"));
        assert!(
            sale.body["message"]
                .as_str()
                .unwrap()
                .contains("LOCK_NODES"),
            "{:?}",
            sale.body
        );
    }
    let ready = app.get("/ready").await;
    assert_eq!(ready.status, 200);
    assert!(ready.body.get("lock_nodes").is_none(), "{:?}", ready.body);
    assert_eq!(app.audit().await["sales"], 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_lock_node_settings_are_refused_at_start_up_by_name_and_without_the_password() {
    let parse = |args: &[&str]| {
        Config::try_parse_from(std::iter::once("inventory").chain(args.iter().copied()))
    };
    // Checked after parsing: a parser's own error would quote the value, password included.
    let config = parse(&[
        "--lock-nodes",
        "redis://:s3cret@127.0.0.1:1,tcp://:s3cret@h:2",
    ])
    .unwrap();
    let err = inventory::server::build(&config)
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains("node 2") && !err.contains("s3cret"), "{err}");

    let config = parse(&["--lock-strategy", "redlock"]).unwrap();
    let err = inventory::server::build(&config)
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains("LOCK_NODES"), "{err}");

    // An unreachable node is named in the log (never with its password), and the instance
    // still starts: nodes may come up after it.
    let redis = RedisServer::start().await;
    let dead = format!(
        "redis://:s3cret@127.0.0.1:{}",
        testkit::free_port().unwrap()
    );
    let alive: Vec<RedisServer> = vec![RedisServer::start().await, RedisServer::start().await];
    let app = InstanceBuilder::new(&redis, "app1")
        .env(
            "LOCK_NODES",
            format!("{},{dead},{}", alive[0].url(), alive[1].url()),
        )
        .start()
        .await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while !app.log().contains("lock node 127.0.0.1") {
        assert!(tokio::time::Instant::now() < deadline, "{}", app.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(app.log().contains("is not reachable"), "{}", app.log());
    assert!(!app.log().contains("s3cret"), "{}", app.log());
    app.reset(3).await;
    assert_eq!(app.sale("strategy=redlock").await.status, 200);
}

/// A sale's nested attempt at the quorum lock (which is not reentrant) waits on its own
/// outer hold and never frees it: buyers at the other instance, which give up after 200 ms,
/// get nothing while it waits. Its failed attempts' give-backs, sent under the sale's own
/// owner id to the nodes whose vote came late, used to delete the outer hold node by node,
/// and the other buyers sold within half a second.
#[tokio::test(flavor = "multi_thread")]
async fn a_nested_quorum_attempt_never_frees_the_hold_of_its_own_sale() {
    let redis = RedisServer::start().await;
    let nested_at = InstanceBuilder::new(&redis, "app1")
        .env("LOCK_WAIT_MS", 1500)
        .start()
        .await;
    let others_at = InstanceBuilder::new(&redis, "app2")
        .env("LOCK_WAIT_MS", 200)
        .start()
        .await;
    for strategy in ["redlock", "redlock-fenced"] {
        nested_at.reset(100).await;
        let query = format!("strategy={strategy}&reenter=true");
        let nested = nested_at.sale(&query);
        let others = async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let started = tokio::time::Instant::now();
            let mut replies = Vec::new();
            while started.elapsed() < Duration::from_millis(1100) {
                replies.push(others_at.sale(&format!("strategy={strategy}")).await);
            }
            replies
        };
        let (nested, others) = tokio::join!(nested, others);
        assert_eq!(
            (nested.status, nested.error_code()),
            (503, "lock_timeout"),
            "{strategy}: {}",
            nested.body
        );
        let sold: Vec<&Value> = others
            .iter()
            .filter(|r| r.status == 200)
            .map(|r| &r.body)
            .collect();
        assert!(
            sold.is_empty(),
            "{strategy}: buyers took the lock while its holder's sale ran: {sold:?}"
        );
    }
}

/// Lock nodes that are read-only replicas answer `PING` and refuse every vote (`READONLY`):
/// `/ready` said ready, listing them `ok`, while every quorum sale answered "refused or
/// dropped the connection" (from outside). `/ready` now names them as replicas, and a sale's
/// 503 carries what a node answered.
#[tokio::test(flavor = "multi_thread")]
async fn lock_nodes_that_are_replicas_are_not_ready_and_the_refusal_says_readonly() {
    let (_redis, nodes, app) = with_three_nodes(|b| b).await;
    app.reset(5).await;
    for replica in &nodes[1..] {
        let () = redis::cmd("REPLICAOF")
            .arg("127.0.0.1")
            .arg(nodes[0].port())
            .query_async(&mut replica.conn().await)
            .await
            .unwrap();
    }
    let ready = app.get("/ready").await;
    assert_eq!(ready.status, 503, "{ready:?}");
    let message = ready.body["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("is a replica")
            && message.contains("READONLY")
            && message.contains(&nodes[1].port().to_string()),
        "{message}"
    );
    for strategy in QUORUM_STRATEGIES {
        refused_soon(&app, strategy, Duration::from_secs(3)).await;
        let sale = app.sale(&format!("strategy={strategy}")).await;
        let message = sale.body["message"].as_str().unwrap_or_default();
        assert!(
            message.contains("read only replica"),
            "{strategy}: {message}"
        );
    }
}

/// Lock nodes that answer `PING` but refuse writes (`min-replicas-to-write` unmet, full memory
/// under `noeviction`) refuse every vote: `/ready` listed them `ok` and answered 200 while
/// every quorum sale answered 503 "refused or dropped the connection" (from outside). Now
/// `/ready` names them and why, the sale's 503 quotes a node's refusal, and both are back
/// once the nodes take writes.
#[tokio::test(flavor = "multi_thread")]
async fn lock_nodes_that_refuse_writes_are_not_ready_and_the_refusal_says_why() {
    let (_redis, nodes, app) = with_three_nodes(|b| b).await;
    app.reset(5).await;
    let set = |node: &RedisServer, name: &'static str, value: &'static str| {
        let node = node.url();
        async move {
            let client = redis::Client::open(node).unwrap();
            let mut c = client.get_multiplexed_async_connection().await.unwrap();
            let () = redis::cmd("CONFIG")
                .arg("SET")
                .arg(name)
                .arg(value)
                .query_async(&mut c)
                .await
                .unwrap();
        }
    };
    for (setting, refusing, taking, named) in [
        ("min-replicas-to-write", "1", "0", "too few replicas"),
        ("maxmemory", "1", "0", "out of memory"),
    ] {
        for node in &nodes[1..] {
            set(node, setting, refusing).await;
        }
        let ready = app.get("/ready").await;
        assert_eq!(ready.status, 503, "{setting}: {ready:?}");
        let message = ready.body["message"].as_str().unwrap_or_default();
        assert!(
            message.contains("refuses writes")
                && message.contains(named)
                && message.contains(&nodes[1].port().to_string()),
            "{setting}: {message}"
        );
        for strategy in QUORUM_STRATEGIES {
            let sale = app.sale(&format!("strategy={strategy}")).await;
            assert_eq!(sale.status, 503, "{setting}, {strategy}: {sale:?}");
            let message = sale.body["message"].as_str().unwrap_or_default();
            assert!(
                message.contains("NOREPLICAS") || message.contains("OOM"),
                "{setting}, {strategy}: {message}"
            );
        }
        for node in &nodes[1..] {
            set(node, setting, taking).await;
        }
        assert_eq!(app.get("/ready").await.status, 200, "{setting} lifted");
        for strategy in QUORUM_STRATEGIES {
            let sale = app.sale(&format!("strategy={strategy}")).await;
            assert_eq!(sale.status, 200, "{setting} lifted, {strategy}: {sale:?}");
        }
    }
    assert_eq!(app.audit().await["sales"], 4);
}

/// A quorum sale whose write to the stock's Redis was sent and never confirmed (504) leaves
/// the quorum lock to its lease instead of releasing it: the lock nodes are other servers,
/// and a release there let the next holder read and write before the held write landed
/// (from outside: 2 to 30 units sold twice after short cuts between an instance and the
/// stock's Redis). Here the first holder's connection to the stock's Redis holds what it
/// sends for 1.5 s, past its 300 ms timeout and well within its 4 s lease; the next sale, at
/// the other instance, starts at once. Every unit sold is sold once, and the stock agrees
/// with the ledger. `redlock-fenced` may release: the token refuses the late write.
#[tokio::test(flavor = "multi_thread")]
async fn a_quorum_sale_whose_write_went_unconfirmed_leaves_its_lock_to_its_lease() {
    let redis = RedisServer::start().await;
    let mut nodes = Vec::new();
    for _ in 0..3 {
        nodes.push(RedisServer::start().await);
    }
    let proxy = testkit::DelayProxy::transparent(format!("127.0.0.1:{}", redis.port()))
        .await
        .unwrap();
    let start = |name: &'static str, url: String| {
        InstanceBuilder::new(&redis, name)
            .env("REDIS_URL", url)
            .env("LOCK_NODES", lock_nodes(&nodes))
            .env("LOCK_TTL_MS", 4000)
            .env("REDIS_TIMEOUT_MS", 300)
            .start()
    };
    let (held, other) = tokio::join!(start("app1", proxy.redis_url()), start("app2", redis.url()));
    for strategy in QUORUM_STRATEGIES {
        other.reset(10).await;
        proxy.delay_requests(Duration::ZERO);
        let query = format!("strategy={strategy}&work_ms=600");
        let (first, second) = tokio::join!(held.sale(&query), async {
            // The read is done by now; the write, at 600 ms, is held.
            tokio::time::sleep(Duration::from_millis(300)).await;
            proxy.delay_requests(Duration::from_millis(1500));
            tokio::time::sleep(Duration::from_millis(700)).await;
            other.sale(&format!("strategy={strategy}")).await
        });
        assert_eq!(
            (first.status, first.error_code()),
            (504, "outcome_unknown"),
            "{strategy}: {first:?}"
        );
        assert_eq!(second.status, 200, "{strategy}: {second:?}");
        // The held write has landed by now.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let audit = other.audit().await;
        assert_eq!(
            audit["clean"], true,
            "{strategy}: a unit sold twice: {audit}"
        );
        let stock = other.get("/inventory").await;
        assert_eq!(
            stock.body["stock"].as_i64().unwrap() + audit["sales"].as_i64().unwrap(),
            10,
            "{strategy}: {stock:?} {audit}"
        );
    }
}

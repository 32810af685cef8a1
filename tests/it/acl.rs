//! `/ready` and the Redis user's ACL: ready means the sales of the default strategy may run
//! every command they send. From outside, users without `XADD`, `SETBIT` or `TIME`, or with
//! the item's keys read-only, were ready while every sale answered 503 `redis_auth_failed`.
//!
//! Each strategy's user is granted exactly what `/ready` checks for it, a command and its key
//! at a time (ACL selectors): it must then be ready and sell, under contention across two
//! instances, with an `Idempotency-Key` and with renewals. And each command, and each key,
//! taken away in turn makes it not ready, with a message that names what is missing.

use std::collections::BTreeSet;

use inventory::lock::acl::{self, Need, Reach};
use inventory::lock::wait::WaitMode;
use inventory::store::Keys;
use inventory::strategy::Strategy;
use redis::aio::MultiplexedConnection;
use testkit::fixture::{Instance, InstanceBuilder, LockNodes, RedisServer};

const USER: &str = "seller";

/// What the tests grant besides the sales' commands: the instance's start and `/ready`
/// itself (`PING`, `INFO`, which may be refused, and the probe script, which declares no
/// key), and the client library's connection setup.
const ROOT: [&str; 5] = ["+ping", "+info", "+client", "+hello", "+evalsha"];

/// The commands whose arguments hold no key.
const KEYLESS: [&str; 6] = ["TIME", "MULTI", "EXEC", "UNWATCH", "PING", "WAIT"];

/// The ACL rules granting `needs` and nothing more: keyless commands at the root, and each
/// command with its keys (or channel) in a selector of its own.
fn rules(needs: &[Need]) -> Vec<String> {
    let mut rules: Vec<String> = ["reset", "on", ">pw"].map(str::to_owned).to_vec();
    rules.extend(ROOT.map(str::to_owned));
    for need in needs {
        let command = need.command.to_lowercase();
        let keys: Vec<&String> = match need.command {
            c if KEYLESS.contains(&c) => {
                rules.push(format!("+{command}"));
                continue;
            }
            "SCRIPT" => {
                rules.push(format!("+script|{}", need.args[0].to_lowercase()));
                continue;
            }
            "SUBSCRIBE" | "PUBLISH" | "SPUBLISH" => {
                rules.push(format!("(+{command} &{})", need.args[0]));
                continue;
            }
            "EVALSHA" | "EVAL" => need.args[2..].iter().collect(),
            "WATCH" => need.args.iter().collect(),
            "BLPOP" => need.args[..need.args.len() - 1].iter().collect(),
            _ => vec![&need.args[0]],
        };
        let patterns: Vec<String> = keys.iter().map(|k| format!("~{k}")).collect();
        rules.push(format!("(+{command} {})", patterns.join(" ")));
    }
    rules
}

/// What Redis refused the user, from `ACL LOG`: command or key, and the command's context.
async fn refusals(admin: &mut MultiplexedConnection) -> Vec<String> {
    let log: Vec<std::collections::HashMap<String, redis::Value>> = redis::cmd("ACL")
        .arg("LOG")
        .query_async(admin)
        .await
        .unwrap_or_default();
    let text = |v: Option<&redis::Value>| match v {
        Some(redis::Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
        Some(other) => format!("{other:?}"),
        None => String::new(),
    };
    log.iter()
        .map(|e| {
            format!(
                "{} {} ({})",
                text(e.get("reason")),
                text(e.get("object")),
                text(e.get("context"))
            )
        })
        .collect()
}

async fn set_user(admin: &mut MultiplexedConnection, rules: &[String]) {
    let () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg(USER)
        .arg(rules)
        .query_async(admin)
        .await
        .unwrap_or_else(|e| panic!("ACL SETUSER {rules:?}: {e}"));
}

/// What `/ready` checks for `strategy`, with the instance's inbox and the sale's
/// idempotency key as patterns (each instance has an inbox of its own).
fn needs_of(strategy: Strategy, wait: WaitMode) -> Vec<Need> {
    let keys = Keys::new("001");
    let inbox = keys.inbox("*");
    let reach = Reach {
        wait,
        pooled: false,
        acks: false,
    };
    let claim = keys.idempotency("acl-check");
    acl::needs(strategy, &keys, &inbox, reach)
        .into_iter()
        .map(|mut need| {
            for arg in &mut need.args {
                if *arg == claim {
                    *arg = keys.idempotency("*");
                }
            }
            need
        })
        .collect()
}

async fn limited(redis: &RedisServer, name: &str, strategy: &str, wait: &str) -> Instance {
    InstanceBuilder::new(redis, name)
        .env(
            "REDIS_URL",
            format!("redis://{USER}:pw@127.0.0.1:{}", redis.port()),
        )
        .env("LOCK_STRATEGY", strategy)
        .env("LOCK_WAIT", wait)
        .env("LOCK_TTL_MS", 600)
        .start()
        .await
}

/// For `strategy` waiting in `wait` mode: granted exactly its needs, two instances are
/// ready and sell; without any one command, or any one key, they are not ready.
async fn exactly_what_ready_checks(strategy: &str, wait: WaitMode) {
    let parsed: Strategy = strategy.parse().expect("a strategy");
    let wait_name = format!("{wait:?}").to_lowercase();
    let redis = RedisServer::start().await;
    let mut admin = redis.conn().await;
    let needs = needs_of(parsed, wait);
    set_user(&mut admin, &rules(&needs)).await;
    let app1 = limited(&redis, "app1", strategy, &wait_name).await;
    let app2 = limited(&redis, "app2", strategy, &wait_name).await;
    let owner = InstanceBuilder::new(&redis, "owner").start().await;
    owner.reset(100).await;
    for app in [&app1, &app2] {
        let ready = app.get("/ready").await;
        assert_eq!(
            ready.status,
            200,
            "{strategy}/{wait_name}: {ready:?}\n{}",
            app.log()
        );
    }
    // Contended across the instances (the queue, the hand-off, the signal), with work past
    // a third of the lease (renewals) and with a key (the claim and its outcome).
    let sales = (0..6).map(|i| {
        let app = if i % 2 == 0 { &app1 } else { &app2 };
        async move {
            let query = format!("strategy={strategy}&work_ms=250");
            if i < 2 {
                app.sale_with_key(&query, &format!("acl-{i}")).await
            } else {
                app.sale(&query).await
            }
        }
    });
    for sale in futures_util::future::join_all(sales).await {
        assert_eq!(
            sale.status,
            200,
            "{strategy}/{wait_name}, granted what /ready checks: {sale:?}\nrefused: {:?}",
            refusals(&mut admin).await
        );
    }
    if parsed.info().distributed {
        let audit = owner.audit().await;
        assert_eq!(audit["clean"], true, "{strategy}/{wait_name}: {audit}");
    }

    // Each command taken away: not ready, and the message names it.
    let commands: BTreeSet<&str> = needs.iter().map(|n| n.command).collect();
    for command in commands {
        let without: Vec<Need> = needs
            .iter()
            .filter(|n| n.command != command)
            .cloned()
            .collect();
        set_user(&mut admin, &rules(&without)).await;
        let ready = app1.get("/ready").await;
        assert_eq!(
            (ready.status, ready.error_code()),
            (503, "redis_auth_failed"),
            "{strategy}/{wait_name} without {command}: {ready:?}"
        );
        let message = ready.body["message"].as_str().unwrap_or_default();
        assert!(
            message.contains(&format!("may not run {command}")),
            "{strategy}/{wait_name} without {command}: {message}"
        );
    }
    // Each key taken away (every command on it): not ready, naming a command on it.
    let keys: BTreeSet<&String> = needs
        .iter()
        .flat_map(|n| n.args.iter())
        .filter(|a| a.starts_with("inventory:"))
        // The bare prefix an unkeyed sale declares is inside the `idem:*` pattern here.
        .filter(|a| **a != Keys::new("001").idempotency(""))
        .collect();
    for key in keys {
        let without: Vec<Need> = needs
            .iter()
            .filter(|n| !n.args.contains(key))
            .cloned()
            .collect();
        set_user(&mut admin, &rules(&without)).await;
        let ready = app1.get("/ready").await;
        let message = ready.body["message"].as_str().unwrap_or_default();
        // The inbox and the idempotency key are patterns here, and real keys in Redis.
        assert!(
            ready.status == 503 && message.contains(key.trim_end_matches('*')),
            "{strategy}/{wait_name} without the key {key}: {ready:?}"
        );
    }
    set_user(&mut admin, &rules(&needs)).await;
    assert_eq!(app1.get("/ready").await.status, 200, "ready again");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_user_granted_what_ready_checks_sells_with_the_handed_off_locks() {
    for strategy in ["fenced", "lua-release", "reentrant", "watchdog"] {
        exactly_what_ready_checks(strategy, WaitMode::Notify).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_user_granted_what_ready_checks_sells_with_the_naive_locks() {
    for strategy in ["setnx", "setnx-ttl", "owner-check"] {
        exactly_what_ready_checks(strategy, WaitMode::Notify).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_user_granted_what_ready_checks_sells_without_a_redis_lock() {
    for strategy in ["none", "local", "atomic", "optimistic"] {
        exactly_what_ready_checks(strategy, WaitMode::Notify).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_user_granted_what_ready_checks_sells_in_the_other_wait_modes() {
    for wait in [WaitMode::Pubsub, WaitMode::Spin] {
        for strategy in ["fenced", "setnx-ttl"] {
            exactly_what_ready_checks(strategy, wait).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_user_granted_what_ready_checks_sells_with_the_quorum_locks() {
    for strategy in ["redlock", "redlock-fenced"] {
        exactly_what_ready_checks(strategy, WaitMode::Notify).await;
    }
}

/// A lock node whose user may not run a command of the vote refuses every vote: it is listed
/// not ok, with the command, and without a majority of nodes `/ready` is not ready.
#[tokio::test(flavor = "multi_thread")]
async fn a_lock_node_whose_user_may_not_vote_is_not_ok_and_says_why() {
    let redis = RedisServer::start().await;
    let nodes = LockNodes::start(3).await;
    let mut urls = Vec::new();
    let mut admins = Vec::new();
    for node in &nodes.nodes {
        let mut admin = node.conn().await;
        let rules = ["on", ">pw", "~*", "&*", "+@all", "-pexpire"].map(str::to_owned);
        set_user(&mut admin, &rules).await;
        admins.push(admin);
        urls.push(format!("redis://{USER}:pw@127.0.0.1:{}", node.port()));
    }
    let app = InstanceBuilder::new(&redis, "app1")
        .env("LOCK_NODES", urls.join(","))
        .start()
        .await;
    let ready = app.get("/ready").await;
    let message = ready.body["message"].as_str().unwrap_or_default();
    assert_eq!(ready.status, 503, "{ready:?}");
    assert_eq!(
        message.matches("may not run PEXPIRE").count(),
        3,
        "each node says why: {message}"
    );
    for admin in &mut admins[..2] {
        set_user(admin, &["+pexpire".to_owned()]).await;
    }
    let ready = app.get("/ready").await;
    assert_eq!(ready.status, 200, "{ready:?}");
    assert_eq!(
        crate::harness::node_states(&ready.body),
        [true, true, false],
        "{ready:?}"
    );
    app.reset(5).await;
    let sale = app.sale("strategy=redlock-fenced").await;
    assert_eq!(sale.status, 200, "two votes of three: {sale:?}");
}

/// The start says what the user may not run, before any sale or `/ready` finds it.
#[tokio::test(flavor = "multi_thread")]
async fn the_start_names_a_command_the_user_may_not_run() {
    let redis = RedisServer::start().await;
    let mut admin = redis.conn().await;
    let rules = ["on", ">pw", "~*", "&*", "+@all", "-setbit"].map(str::to_owned);
    set_user(&mut admin, &rules).await;
    let app = limited(&redis, "app1", "atomic", "notify").await;
    let named = "may not run SETBIT inventory:{001}:sold, which sales of atomic";
    for _ in 0..50 {
        if app.log().contains(named) {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    panic!("{}", app.log());
}

/// Lock nodes whose users are granted exactly what `/ready` checks of a node: ready, and
/// quorum sales sell under contention with renewals. From outside, nodes without `PTTL` (the
/// vote's) or `EVAL` (the release's) were listed ok while every quorum sale failed. Each
/// command taken away from every node: not ready, naming it.
#[tokio::test(flavor = "multi_thread")]
async fn lock_nodes_granted_what_ready_checks_vote_and_lacking_any_of_it_are_named() {
    let redis = RedisServer::start().await;
    let nodes = LockNodes::start(3).await;
    let needs = acl::node_needs(&Keys::new("001"));
    let mut admins = Vec::new();
    let mut urls = Vec::new();
    for node in &nodes.nodes {
        let mut admin = node.conn().await;
        set_user(&mut admin, &rules(&needs)).await;
        admins.push(admin);
        urls.push(format!("redis://{USER}:pw@127.0.0.1:{}", node.port()));
    }
    let app = |name: &str| {
        InstanceBuilder::new(&redis, name)
            .env("LOCK_NODES", urls.join(","))
            .env("LOCK_STRATEGY", "redlock-fenced")
            .env("LOCK_TTL_MS", 600)
            .start()
    };
    let (app1, app2) = (app("app1").await, app("app2").await);
    app1.reset(20).await;
    let ready = app1.get("/ready").await;
    assert_eq!(ready.status, 200, "{ready:?}");
    let sales = (0..6).map(|i| {
        let app = if i % 2 == 0 { &app1 } else { &app2 };
        app.sale("strategy=redlock-fenced&work_ms=250")
    });
    for sale in futures_util::future::join_all(sales).await {
        assert_eq!(sale.status, 200, "{sale:?}");
    }
    assert_eq!(app1.audit().await["clean"], true);
    let commands: BTreeSet<&str> = needs.iter().map(|n| n.command).collect();
    for command in commands {
        let without: Vec<Need> = needs
            .iter()
            .filter(|n| n.command != command)
            .cloned()
            .collect();
        for admin in &mut admins {
            set_user(admin, &rules(&without)).await;
        }
        let ready = app1.get("/ready").await;
        let message = ready.body["message"].as_str().unwrap_or_default();
        let named = if matches!(command, "EVALSHA" | "SCRIPT") {
            format!("may not run {command}")
        } else {
            format!("may not run {command} ")
        };
        assert!(
            ready.status == 503 && message.matches(&named).count() == 3,
            "without {command}: {ready:?}"
        );
    }
}

/// A user that may not run `PING` (which sales never send) is ready and sells; one that may
/// not run `EVALSHA` (which every sale sends) is not, and the refusal says so.
#[tokio::test(flavor = "multi_thread")]
async fn ping_refused_is_no_reason_to_be_unready_and_evalsha_refused_is_named() {
    let redis = RedisServer::start().await;
    let mut admin = redis.conn().await;
    let rules = |lacking: &str| ["on", ">pw", "~*", "&*", "+@all", lacking].map(str::to_owned);
    set_user(&mut admin, &rules("-ping")).await;
    let app = limited(&redis, "app1", "fenced", "notify").await;
    let owner = InstanceBuilder::new(&redis, "owner").start().await;
    owner.reset(5).await;
    let ready = app.get("/ready").await;
    assert_eq!(ready.status, 200, "{ready:?}");
    assert_eq!(app.sale("").await.status, 200);
    assert!(
        !app.log().contains("refused the credentials"),
        "{}",
        app.log()
    );
    set_user(&mut admin, &rules("-evalsha")).await;
    let ready = app.get("/ready").await;
    let message = ready.body["message"].as_str().unwrap_or_default();
    assert_eq!(
        (ready.status, ready.error_code()),
        (503, "redis_auth_failed"),
        "{ready:?}"
    );
    assert!(
        message.contains("may not run EVALSHA or SCRIPT LOAD"),
        "{message}"
    );
}

//! Many items: `/inventory/{item}/...` against real `redis-server` and instances. Items are
//! sold independently (neither oversold, neither waiting for the other), an item is only
//! what a reset made it (an unknown or malformed id writes nothing), the default item has
//! two names, and the lock machinery of an item nobody sells any more goes away.

use std::time::Duration;

use inventory::lock::Strategy;
use serde_json::Value;
use testkit::fixture::{Cluster, Instance, InstanceBuilder, RedisServer, Reply};

/// The strategies that take a lock in Redis, or need none: the ones the load test calls SAFE.
fn safe_strategies() -> Vec<Strategy> {
    Strategy::ALL
        .into_iter()
        .filter(|s| s.info().distributed)
        .collect()
}

/// The strategies whose sales wait for each other (in Redis, or in one process for `local`).
fn locking_strategies() -> Vec<Strategy> {
    Strategy::ALL
        .into_iter()
        .filter(|s| matches!(s, Strategy::Redis(_) | Strategy::Local))
        .collect()
}

async fn request(app: &Instance, method: &str, path: &str) -> Reply {
    let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
    app.send(reqwest::Client::new().request(method, app.url(path)))
        .await
}

/// `PUT /inventory/{item}` with `{"stock": stock}` and an optional bearer token.
async fn put_item(app: &Instance, item: &str, stock: i64, token: Option<&str>) -> Reply {
    let mut put = reqwest::Client::new()
        .put(app.url(&format!("/inventory/{item}")))
        .header("content-type", "application/json")
        .body(format!(r#"{{"stock": {stock}}}"#));
    if let Some(token) = token {
        put = put.bearer_auth(token);
    }
    app.send(put).await
}

async fn stock_item(app: &Instance, item: &str, stock: i64) {
    let reply = put_item(app, item, stock, None).await;
    assert_eq!(reply.status, 200, "stocking {item}: {reply:?}");
    assert_eq!(reply.body["item"], item);
    assert_eq!(reply.body["stock"], stock);
}

async fn sell(app: &Instance, item: &str, query: &str) -> Reply {
    request(app, "POST", &format!("/inventory/{item}/sale?{query}")).await
}

async fn keyed_sale(app: &Instance, item: &str, key: &str) -> Reply {
    let url = app.url(&format!("/inventory/{item}/sale?strategy=fenced"));
    app.send(
        reqwest::Client::new()
            .post(url)
            .header("idempotency-key", key),
    )
    .await
}

async fn item_audit(app: &Instance, item: &str) -> Value {
    let reply = request(app, "GET", &format!("/inventory/{item}/audit")).await;
    assert_eq!(reply.status, 200, "audit of {item}: {reply:?}");
    reply.body
}

/// Every key in every database of `redis` (the lock nodes of the tests are databases 1-3).
async fn keyspace(redis: &RedisServer) -> String {
    let mut c = redis.conn().await;
    let info: String = redis::cmd("INFO")
        .arg("keyspace")
        .query_async(&mut c)
        .await
        .unwrap();
    info.lines()
        .filter(|l| l.starts_with("db"))
        .collect::<Vec<_>>()
        .join(", ")
}

#[tokio::test(flavor = "multi_thread")]
async fn every_safe_strategy_sells_two_items_through_two_instances_exactly_their_stock() {
    let cluster = Cluster::start(2, |b| b).await;
    let (a, b) = (&cluster.instances[0], &cluster.instances[1]);
    a.reset(7).await;
    for strategy in safe_strategies() {
        let items = [format!("{strategy}-x"), format!("{strategy}-y")];
        for (n, item) in items.iter().enumerate() {
            stock_item(a, item, 5 + n as i64).await;
        }
        // Both items on both instances, all at once, each asked for more than it has.
        let sales = (0..32).map(|n| {
            let (app, item) = ([a, b][n % 2], &items[(n / 2) % 2]);
            let query = format!("strategy={strategy}&work_ms=5");
            async move { (item.clone(), sell(app, item, &query).await) }
        });
        let replies = futures_util::future::join_all(sales).await;
        for (n, item) in items.iter().enumerate() {
            let stock = 5 + n as i64;
            let mine: Vec<&Reply> = replies
                .iter()
                .filter(|(i, _)| i == item)
                .map(|(_, r)| r)
                .collect();
            let sold = mine.iter().filter(|r| r.status == 200).count() as i64;
            let audit = item_audit(b, item).await;
            assert_eq!(audit["clean"], true, "{strategy} {item}: {audit}");
            assert_eq!(sold, stock, "{strategy} {item}: sold all, no more: {audit}");
            assert_eq!(audit["sales"].as_i64(), Some(stock), "{strategy} {item}");
            assert_eq!(audit["remaining"].as_i64(), Some(0), "{strategy} {item}");
            let mut remaining: Vec<i64> = mine
                .iter()
                .filter(|r| r.status == 200)
                .map(|r| r.body["remaining"].as_i64().unwrap())
                .collect();
            remaining.sort_unstable();
            assert_eq!(
                remaining,
                (0..stock).collect::<Vec<_>>(),
                "{strategy} {item}: each remaining value once"
            );
            for refused in mine.iter().filter(|r| r.status != 200) {
                assert_eq!(
                    (refused.status, refused.error_code()),
                    (409, "sold_out"),
                    "{strategy} {item}: {}",
                    refused.body
                );
            }
        }
    }
    let default = a.audit().await;
    assert_eq!(
        (default["sales"].as_i64(), default["remaining"].as_i64()),
        (Some(0), Some(7)),
        "the default item is another item: {default}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_sale_holding_one_items_lock_never_delays_another_items_sale_but_does_delay_its_own() {
    let cluster = Cluster::start(2, |b| b).await;
    let (a, b) = (&cluster.instances[0], &cluster.instances[1]);
    let runs = locking_strategies().into_iter().map(|strategy| async move {
        let (held, other) = (format!("held-{strategy}"), format!("free-{strategy}"));
        stock_item(a, &held, 10).await;
        stock_item(a, &other, 10).await;
        let holder = async { sell(a, &held, &format!("strategy={strategy}&work_ms=3000")).await };
        let others = async {
            // Well inside the holder's 3 s of work.
            tokio::time::sleep(Duration::from_millis(500)).await;
            // `local` excludes only inside one instance: its contender asks the same one.
            let same_item_app = if strategy == Strategy::Local { a } else { b };
            let query = format!("strategy={strategy}");
            tokio::join!(sell(a, &other, &query), sell(same_item_app, &held, &query))
        };
        let (holder, (other_sale, same_item_sale)) = tokio::join!(holder, others);
        for reply in [&holder, &other_sale, &same_item_sale] {
            assert_eq!(reply.status, 200, "{strategy}: {}", reply.body);
        }
        // The other item's sale was made while the first lock was held, without waiting.
        assert!(
            other_sale.body["waited_ms"].as_u64().unwrap() < 1_500,
            "{strategy}: another item waited for this one's lock: {}",
            other_sale.body
        );
        assert!(
            other_sale.elapsed < holder.elapsed,
            "{strategy}: the other item's sale ended after the holder's"
        );
        // The same item's sale waited for the holder: its lock is the item's.
        assert!(
            same_item_sale.body["waited_ms"].as_u64().unwrap() >= 1_500,
            "{strategy}: a second sale of the held item did not wait: {}",
            same_item_sale.body
        );
    });
    futures_util::future::join_all(runs).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_default_item_paths_and_the_item_path_of_item_id_are_one_item() {
    let cluster = Cluster::start(1, |b| b.env("ITEM_ID", "sku-1")).await;
    let app = &cluster.instances[0];
    stock_item(app, "sku-1", 6).await;
    let plain = request(app, "GET", "/inventory").await;
    assert_eq!(plain.status, 200, "{plain:?}");
    assert_eq!(plain.body["item"], "sku-1");
    assert_eq!(plain.body["stock"], 6);

    // Sales through either name count in both, and take the same lock: a `local` sale through
    // one name waits for one holding the mutex through the other.
    let (through_default, through_item) =
        tokio::join!(app.sale("strategy=local&work_ms=2000"), async {
            tokio::time::sleep(Duration::from_millis(400)).await;
            sell(app, "sku-1", "strategy=local").await
        });
    assert_eq!(through_default.status, 200, "{through_default:?}");
    assert_eq!(through_item.status, 200, "{through_item:?}");
    assert!(
        through_item.body["waited_ms"].as_u64().unwrap() >= 1_000,
        "one mutex for both names: {}",
        through_item.body
    );
    let fenced = sell(app, "sku-1", "strategy=fenced").await;
    assert_eq!(fenced.body["remaining"], 3, "{fenced:?}");
    let by_item = request(app, "GET", "/inventory/sku-1").await.body;
    let by_default = request(app, "GET", "/inventory").await.body;
    assert_eq!(by_item, by_default);
    assert_eq!(by_item["sales"], 3);
    assert_eq!(app.audit().await, item_audit(app, "sku-1").await);
    let mut c = cluster.redis.conn().await;
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*")
        .query_async(&mut c)
        .await
        .unwrap();
    assert!(
        keys.iter().all(|k| k.starts_with("inventory:{sku-1}:")),
        "{keys:?}"
    );
    // `PUT /inventory` resets the same item.
    app.reset(2).await;
    let after = request(app, "GET", "/inventory/sku-1").await.body;
    assert_eq!(
        (after["stock"].as_i64(), after["sales"].as_i64()),
        (Some(2), Some(0))
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn an_unknown_item_answers_404_for_every_method_and_writes_nothing() {
    let redis = RedisServer::start().await;
    let app = InstanceBuilder::new(&redis, "app1").start().await;
    for strategy in Strategy::ALL {
        for method in ["POST", "GET"] {
            let path = format!("/inventory/nobody-stocked-me/sale?strategy={strategy}");
            let plain = request(&app, method, &path).await;
            let keyed = app
                .send(
                    reqwest::Client::new()
                        .request(
                            reqwest::Method::from_bytes(method.as_bytes()).unwrap(),
                            app.url(&path),
                        )
                        .header("idempotency-key", format!("k-{strategy}-{method}")),
                )
                .await;
            for reply in [plain, keyed] {
                assert_eq!(
                    (reply.status, reply.error_code()),
                    (404, "unknown_item"),
                    "{method} {strategy}: {}",
                    reply.body
                );
                let message = reply.body["message"].as_str().unwrap();
                assert!(message.contains("nobody-stocked-me"), "{message}");
            }
        }
    }
    for path in [
        "/inventory/nobody-stocked-me",
        "/inventory/nobody-stocked-me/audit",
    ] {
        let reply = request(&app, "GET", path).await;
        assert_eq!(
            (reply.status, reply.error_code()),
            (404, "unknown_item"),
            "{path}"
        );
    }
    let head = request(&app, "HEAD", "/inventory/nobody-stocked-me/sale").await;
    assert_eq!(head.status, 405, "HEAD never sells, stocked or not");
    assert_eq!(keyspace(&redis).await, "", "no key in any database");
}

#[tokio::test(flavor = "multi_thread")]
async fn malformed_item_ids_answer_400_naming_the_format_and_write_nothing() {
    let cluster = Cluster::start(1, |b| b).await;
    let app = &cluster.instances[0];
    let too_long = "x".repeat(33);
    // As sent in the path (percent-encoded where a URL needs it).
    let ids = [
        "%7Bx%7D",
        "a%7Bb",
        "b%7D",
        "a:b",
        "a%3Ab",
        "",
        too_long.as_str(),
        "%C3%A9t%C3%A9",
        "%E2%9C%93",
        "a%20b",
        "a.b",
        "a%00b",
        "sale",
        "audit",
    ];
    for id in ids {
        let mut requests = vec![
            ("POST", format!("/inventory/{id}/sale")),
            ("GET", format!("/inventory/{id}/sale")),
            ("GET", format!("/inventory/{id}/audit")),
        ];
        // `/inventory/sale` and `/inventory/audit` are the default item's routes, which is
        // why those two ids are refused everywhere.
        if id != "sale" && id != "audit" {
            requests.push(("GET", format!("/inventory/{id}")));
            requests.push(("PUT", format!("/inventory/{id}")));
        }
        for (method, path) in requests {
            let mut builder = reqwest::Client::new().request(
                reqwest::Method::from_bytes(method.as_bytes()).unwrap(),
                app.url(&path),
            );
            if method == "PUT" {
                builder = builder
                    .header("content-type", "application/json")
                    .body(r#"{"stock": 5}"#);
            }
            let reply = app.send(builder).await;
            assert_eq!(
                (reply.status, reply.error_code()),
                (400, "bad_request"),
                "{method} {path}: {}",
                reply.body
            );
            let message = reply.body["message"].as_str().unwrap();
            assert!(
                message.contains(inventory::names::ITEM_ID_PATTERN),
                "{method} {path}: the refusal names the format: {message}"
            );
        }
    }
    assert_eq!(
        keyspace(&cluster.redis).await,
        "",
        "nothing written anywhere"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn putting_an_item_needs_the_admin_token_exactly_as_putting_the_default_one() {
    let cluster = Cluster::start(1, |b| b.env("ADMIN_TOKEN", "s3cret")).await;
    let app = &cluster.instances[0];
    for token in [None, Some("wrong"), Some("s3cre"), Some("s3cret2")] {
        let refused = put_item(app, "sku-9", 5, token).await;
        assert_eq!(
            (refused.status, refused.error_code()),
            (401, "unauthorized"),
            "{token:?}"
        );
        let plain = app.put_inventory(r#"{"stock": 5}"#, token).await;
        assert_eq!(
            plain.status, refused.status,
            "{token:?}: same rule as PUT /inventory"
        );
    }
    assert_eq!(
        keyspace(&cluster.redis).await,
        "",
        "a refused PUT writes nothing"
    );
    let unknown = request(app, "GET", "/inventory/sku-9").await;
    assert_eq!(unknown.status, 404);
    let created = put_item(app, "sku-9", 5, Some("s3cret")).await;
    assert_eq!(created.status, 200, "{created:?}");
    assert_eq!(
        request(app, "GET", "/inventory/sku-9").await.body["stock"],
        5
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn head_on_an_item_sale_never_sells_and_every_sale_parameter_works_on_item_paths() {
    let cluster = Cluster::start(2, |b| b).await;
    let (a, b) = (&cluster.instances[0], &cluster.instances[1]);
    stock_item(a, "sku-2", 5).await;
    stock_item(a, "sku-3", 5).await;
    for strategy in Strategy::ALL {
        let head = request(
            a,
            "HEAD",
            &format!("/inventory/sku-2/sale?strategy={strategy}"),
        )
        .await;
        assert_eq!(head.status, 405, "{strategy}");
        assert_eq!(head.headers["allow"], "GET, POST", "{strategy}");
    }
    for (method, path) in [
        ("PUT", "/inventory/sku-2/sale"),
        ("DELETE", "/inventory/sku-2/sale"),
    ] {
        let reply = request(a, method, path).await;
        assert_eq!(
            (reply.status, reply.error_code()),
            (405, "method_not_allowed"),
            "{method}"
        );
        assert_eq!(reply.headers["allow"], "GET, POST", "{method}");
    }
    assert_eq!(
        item_audit(a, "sku-2").await["sales"],
        0,
        "HEAD sold nothing"
    );

    // Query validation, as on /inventory/sale.
    for (query, names) in [
        ("strategy=v9", "fenced"),
        ("work_ms=999999999", "work_ms"),
        ("reenter=maybe", "reenter"),
    ] {
        let reply = sell(a, "sku-2", query).await;
        assert_eq!(
            (reply.status, reply.error_code()),
            (400, "bad_request"),
            "{query}"
        );
        assert!(
            reply.body["message"].as_str().unwrap().contains(names),
            "{query}: {}",
            reply.body
        );
    }
    let bad_key = a
        .send(
            reqwest::Client::new()
                .post(a.url("/inventory/sku-2/sale"))
                .header("idempotency-key", "not a key"),
        )
        .await;
    assert_eq!(bad_key.status, 400, "{bad_key:?}");

    // GET sells as POST does, aliases and reentry included.
    let by_get = request(a, "GET", "/inventory/sku-2/sale?strategy=v7&reenter=true").await;
    assert_eq!(by_get.status, 200, "{by_get:?}");
    assert_eq!(by_get.body["strategy"], "reentrant");
    assert_eq!(by_get.body["remaining"], 4);

    // Idempotency-Key: a retry on either instance replays; the same key names another sale
    // on another item.
    let first = keyed_sale(a, "sku-2", "order-77").await;
    let retry = keyed_sale(b, "sku-2", "order-77").await;
    let other_item = keyed_sale(b, "sku-3", "order-77").await;
    assert_eq!(first.status, 200, "{first:?}");
    assert_eq!(retry.body["order_id"], first.body["order_id"]);
    assert_eq!(retry.headers["idempotent-replayed"], "true");
    assert_eq!(other_item.status, 200, "{other_item:?}");
    assert_ne!(other_item.body["order_id"], first.body["order_id"]);
    assert!(other_item.headers.get("idempotent-replayed").is_none());
    assert_eq!(item_audit(a, "sku-2").await["sales"], 2);
    assert_eq!(item_audit(a, "sku-3").await["sales"], 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_lock_machinery_of_items_nobody_sells_any_more_is_dropped() {
    let redis = RedisServer::start().await;
    // Pub/sub waiting subscribes while an item's sales wait: each such item is a subscribed
    // channel and a connection Redis can count, for a moment; its machinery lives longer.
    let app = InstanceBuilder::new(&redis, "app1")
        .env("LOCK_WAIT", "pubsub")
        .env("ITEM_IDLE_MS", "3000")
        .start()
        .await;
    app.reset(5).await;
    let mut c = redis.conn().await;
    let clients = |info: String| -> i64 {
        info.lines()
            .find_map(|l| l.strip_prefix("connected_clients:"))
            .and_then(|n| n.trim().parse().ok())
            .unwrap()
    };
    assert_eq!(app.sale("strategy=fenced").await.status, 200);
    let before: String = redis::cmd("INFO")
        .arg("clients")
        .query_async(&mut c)
        .await
        .unwrap();
    let before = clients(before);

    let items: Vec<String> = (0..24).map(|n| format!("burst-{n}")).collect();
    for item in &items {
        stock_item(&app, item, 2).await;
    }
    // Two sales at once per item: one waits, and its item subscribes for the wait.
    let sales = items
        .iter()
        .flat_map(|item| [item, item])
        .map(|item| sell(&app, item, "strategy=fenced&work_ms=200"));
    for reply in futures_util::future::join_all(sales).await {
        assert_eq!(reply.status, 200, "{reply:?}");
    }
    let channels = |c: &mut redis::aio::MultiplexedConnection| {
        let mut c = c.clone();
        async move {
            let channels: Vec<String> = redis::cmd("PUBSUB")
                .arg("CHANNELS")
                .query_async(&mut c)
                .await
                .unwrap();
            channels
        }
    };
    let live = channels(&mut c).await;
    assert!(
        live.iter().any(|ch| ch.contains("{burst-")),
        "the items sold just now listen for their releases: {live:?}"
    );

    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let live = channels(&mut c).await;
        let gauge = app.get("/metrics").await.body;
        let gauge = gauge
            .as_str()
            .unwrap_or_default()
            .lines()
            .find(|l| l.starts_with("inventory_items_live "))
            .map(str::to_owned);
        let now: String = redis::cmd("INFO")
            .arg("clients")
            .query_async(&mut c)
            .await
            .unwrap();
        let now = clients(now);
        if !live.iter().any(|ch| ch.contains("{burst-"))
            && gauge.as_deref() == Some("inventory_items_live 0")
            && now <= before
        {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "idle items still hold resources: channels {live:?}, {gauge:?}, {now} clients (was {before})"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // And an item sold again later simply gets them back.
    stock_item(&app, "burst-0", 1).await;
    assert_eq!(sell(&app, "burst-0", "strategy=fenced").await.status, 200);
    assert_eq!(
        app.sale("strategy=fenced").await.status,
        200,
        "the default item never left"
    );
}

/// Redis's connections now: `connected_clients`, less the one asking.
async fn redis_clients(redis: &RedisServer) -> i64 {
    let info: String = redis::cmd("INFO")
        .arg("clients")
        .query_async(&mut redis.conn().await)
        .await
        .unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("connected_clients:"))
        .and_then(|n| n.trim().parse::<i64>().ok())
        .unwrap_or(0)
        - 1
}

/// An item's waiters listen on a connection of their own (`notify`'s blocking pop, `pubsub`'s
/// subscription). Kept from an item's first sale until its machinery was dropped, one client
/// selling 10,000 items in a few seconds took every connection Redis allows, and every other
/// client was refused (found from outside). Sales that never wait take none, however many
/// items; contended items take one each while they wait, and give it back soon after.
#[tokio::test(flavor = "multi_thread")]
async fn only_items_whose_sales_wait_hold_a_listening_connection_and_not_for_long() {
    for wait in ["notify", "pubsub"] {
        let redis = RedisServer::start().await;
        let app = InstanceBuilder::new(&redis, "app1")
            .env("LOCK_WAIT", wait)
            .start()
            .await;
        app.reset(10).await;
        assert_eq!(app.sale("").await.status, 200);
        let before = redis_clients(&redis).await;
        let client = testkit::fixture::client();
        let items: Vec<String> = (0..150).map(|i| format!("many{i}")).collect();
        for item in &items {
            let put = client
                .put(app.url(&format!("/inventory/{item}")))
                .json(&serde_json::json!({"stock": 10}));
            assert_eq!(app.send(put).await.status, 200);
        }
        // One sale at a time per item, 16 items at once: nobody waits.
        for chunk in items.chunks(16) {
            let sales = chunk
                .iter()
                .map(|item| app.send(client.post(app.url(&format!("/inventory/{item}/sale")))));
            for sale in futures_util::future::join_all(sales).await {
                assert_eq!(sale.status, 200, "{wait}: {sale:?}");
            }
        }
        let uncontended = redis_clients(&redis).await;
        assert!(
            uncontended <= before + 2,
            "{wait}: {before} connections before, {uncontended} after 150 items sold"
        );
        // Four sales at once on each of 10 items: they wait, and listen.
        let sales = items[..10].iter().flat_map(|item| {
            let url = app.url(&format!("/inventory/{item}/sale?work_ms=100"));
            (0..4).map(move |_| url.clone())
        });
        let sales = sales.map(|url| app.send(client.post(url)));
        for sale in futures_util::future::join_all(sales).await {
            assert_eq!(sale.status, 200, "{wait}: {sale:?}");
        }
        let mut after = i64::MAX;
        for _ in 0..40 {
            after = redis_clients(&redis).await;
            if after <= before + 2 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(
            after <= before + 2,
            "{wait}: {before} connections before, {after} 4 s after the contention ended"
        );
        let audit = app.audit().await;
        assert_eq!(audit["clean"], true, "{audit}");
    }
}

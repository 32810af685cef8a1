//! The HTTP contract: statuses, error bodies, headers, validation, the OpenAPI document.

use std::time::Duration;

use serde_json::Value;
use testkit::fixture::{Cluster, InstanceBuilder, RedisServer};

#[tokio::test(flavor = "multi_thread")]
async fn a_sale_reports_what_it_sold_and_who_sold_it() {
    let cluster = Cluster::start(1, |b| b).await;
    let app = &cluster.instances[0];
    app.reset(3).await;

    let sold = app.sale("").await;
    assert_eq!(sold.status, 200, "{sold:?}");
    assert_eq!(sold.instance.as_deref(), Some("app1"));
    assert_eq!(sold.body["sold"], true);
    assert_eq!(sold.body["remaining"], 2);
    assert_eq!(sold.body["instance"], "app1");
    assert_eq!(sold.body["strategy"], "fenced", "the configured default");
    assert!(sold.body["fence"].as_u64().is_some(), "{sold:?}");
    assert!(!sold.body["order_id"].as_str().unwrap().is_empty());

    let by_get = app.get("/inventory/sale?strategy=v6").await;
    assert_eq!(by_get.status, 200, "GET works as in the tutorial");
    assert_eq!(by_get.body["strategy"], "lua-release", "v6 is an alias");
    assert!(
        by_get.body.get("fence").is_none(),
        "no fence without fencing"
    );

    let inventory = app.get("/inventory").await.body;
    assert_eq!(
        (inventory["stock"].as_i64(), inventory["sales"].as_i64()),
        (Some(1), Some(2))
    );

    let ledger = inventory::store::Keys::new("001").ledger;
    let mut c = cluster.redis.conn().await;
    let first = &testkit::fixture::ledger(&mut c, &ledger).await[0];
    assert_eq!(first["order_id"], sold.body["order_id"]);
    assert_eq!(first["instance"], "app1");
    assert_eq!(first["remaining"], 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn nothing_left_answers_409_sold_out() {
    let cluster = Cluster::start(1, |b| b).await;
    let app = &cluster.instances[0];
    app.reset(0).await;
    for strategy in ["none", "local", "setnx", "fenced", "atomic"] {
        let reply = app.sale(&format!("strategy={strategy}")).await;
        assert_eq!(
            (reply.status, reply.error_code()),
            (409, "sold_out"),
            "{strategy}"
        );
        assert!(
            reply.body["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty())
        );
    }
    assert_eq!(app.audit().await["sales"], 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_input_gets_400_naming_the_valid_values_and_changes_nothing() {
    let cluster = Cluster::start(1, |b| b).await;
    let app = &cluster.instances[0];
    app.reset(10).await;
    let before = cluster.redis.snapshot().await;

    let unknown = app.sale("strategy=v9").await;
    assert_eq!((unknown.status, unknown.error_code()), (400, "bad_request"));
    let message = unknown.body["message"].as_str().unwrap();
    for name in [
        "none",
        "local",
        "setnx",
        "setnx-ttl",
        "owner-check",
        "lua-release",
        "reentrant",
        "watchdog",
        "fenced",
        "atomic",
        "v1",
        "v8",
    ] {
        assert!(message.contains(name), "{name} missing from {message}");
    }

    for query in [
        "work_ms=60001",
        "work_ms=-1",
        "work_ms=abc",
        "reenter=maybe",
    ] {
        let reply = app.sale(query).await;
        assert_eq!(
            (reply.status, reply.error_code()),
            (400, "bad_request"),
            "{query}: {reply:?}"
        );
    }
    // A parameter the sale does not take is refused, not ignored: misspelled, it would
    // otherwise run the sale with the defaults. So is a strategy with spaces around it
    // (`+` is a space in a query).
    for query in [
        "Strategy=none",
        "work-ms=500",
        "workms=5",
        "strategy=fenced&reenter=true&item=002",
        "strategy=fenced&strategy=atomic",
        "strategy=+atomic",
        "strategy=atomic+",
        "strategy=%20fenced",
    ] {
        let reply = app.sale(query).await;
        assert_eq!(
            (reply.status, reply.error_code()),
            (400, "bad_request"),
            "{query}: {reply:?}"
        );
        let message = reply.body["message"].as_str().unwrap_or_default();
        for named in ["strategy", "fenced", "atomic"] {
            assert!(
                message.contains(named),
                "{query}: {named} not named: {message}"
            );
        }
    }
    let misspelled = app.sale("Strategy=none").await;
    let message = misspelled.body["message"].as_str().unwrap_or_default();
    for named in ["work_ms", "reenter", "Strategy"] {
        assert!(message.contains(named), "{named} not named: {message}");
    }
    let range = app.sale("work_ms=60001").await;
    assert!(
        range.body["message"].as_str().unwrap().contains("60000"),
        "{range:?}"
    );
    // One that is no whole number names this instance's bound too (it named the default).
    for query in [
        "work_ms=-1",
        "work_ms=abc",
        "work_ms=1e2",
        "work_ms=99999999999999999999",
    ] {
        let reply = app.sale(query).await;
        let message = reply.body["message"].as_str().unwrap_or_default();
        assert!(
            message.contains("60000") && message.contains("MAX_WORK_MS"),
            "{query}: {message}"
        );
    }

    // Every body that is not an object with a whole stock in range is refused, and the
    // message says what would do, whatever shape the mistake takes.
    for body in [
        r#"{"stock": -1}"#,
        r#"{"stock": "abc"}"#,
        r#"{"stock": "5"}"#,
        r#"{"stock": 1.5}"#,
        r#"{"stock": 1e300}"#,
        r#"{"stock": 1e-400}"#,
        r#"{"stock": 5.0000000000000001}"#,
        r#"{"stock": 1000000000.0000001}"#,
        r#"{"stock": 9223372036854775808}"#,
        r#"{"stock": -9223372036854775809}"#,
        r#"{"stock": null}"#,
        r#"{"stock": [5]}"#,
        r#"{"stock": 5, "stock": 6}"#,
        r#"{"stok": 5}"#,
        r#"{"stock": 5, "stok": 7}"#,
        r#"{"stok": 7, "stock": 5}"#,
        r#"{"stock": 5, "note": "restock"}"#,
        "{}",
        "[5]",
        "[]",
        "5",
        "null",
        r#""stock""#,
        "not json",
        "",
        r#"{"stock": 5"#,
        r#"{"stock": 1000000001}"#,
    ] {
        let reply = app.put_inventory(body, None).await;
        assert_eq!(
            (reply.status, reply.error_code()),
            (400, "bad_request"),
            "{body}: {reply:?}"
        );
        let message = reply.body["message"].as_str().unwrap_or_default();
        assert!(
            message.contains("0..=1000000000"),
            "{body}: the message does not name the valid stock: {message}"
        );
        // Nothing after the range that could be read as part of it (serde's " at line 1
        // column 14" was).
        assert!(
            message.ends_with("0..=1000000000"),
            "{body}: the message ends with the valid range: {message}"
        );
    }
    // Raw bytes that are not UTF-8, in a field nothing reads: not JSON, so not a reset.
    let http = reqwest::Client::new();
    let not_utf8 = app
        .send(
            http.put(app.url("/inventory"))
                .header("content-type", "application/json")
                .body(b"{\"x\": \"\xff\xfe\", \"stock\": 3}".to_vec()),
        )
        .await;
    assert_eq!(
        (not_utf8.status, not_utf8.error_code()),
        (400, "bad_request"),
        "{not_utf8:?}"
    );
    // A declared body over 16 KiB is refused on every route, the sale's too, which reads no
    // body: straight to an instance as through nginx.
    for (method, path) in [
        (reqwest::Method::POST, "/inventory/sale"),
        (reqwest::Method::PUT, "/inventory"),
    ] {
        let big = app
            .send(
                http.request(method.clone(), app.url(path))
                    .header("content-type", "application/json")
                    .body(vec![b' '; 20_000]),
            )
            .await;
        assert_eq!(
            (big.status, big.error_code()),
            (413, "payload_too_large"),
            "{method} {path}: {big:?}"
        );
        let message = big.body["message"].as_str().unwrap_or_default();
        assert!(message.contains("16384"), "{message}");
    }
    assert_eq!(
        cluster.redis.snapshot().await,
        before,
        "a rejected request changed Redis"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn reset_needs_the_admin_token_when_one_is_set() {
    let cluster = Cluster::start(1, |b| b.env("ADMIN_TOKEN", "s3cret")).await;
    let app = &cluster.instances[0];
    assert_eq!(
        app.put_inventory(r#"{"stock": 5}"#, Some("s3cret"))
            .await
            .status,
        200
    );
    let before = cluster.redis.snapshot().await;

    for token in [None, Some("wrong"), Some("s3cre"), Some("s3cret2")] {
        let reply = app.put_inventory(r#"{"stock": 7}"#, token).await;
        assert_eq!(
            (reply.status, reply.error_code()),
            (401, "unauthorized"),
            "{token:?}"
        );
        // Every 401 says which scheme it wants (RFC 9110).
        let challenge = reply.headers.get("www-authenticate");
        assert!(
            challenge.is_some_and(|c| c.as_bytes().starts_with(b"Bearer ")),
            "{token:?}: {challenge:?}"
        );
    }
    // Two `Authorization` headers are refused, even when one of them is right.
    let http = reqwest::Client::new();
    for pair in [
        ["Bearer s3cret", "Bearer wrong"],
        ["Bearer wrong", "Bearer s3cret"],
    ] {
        let reply = app
            .send(
                http.put(app.url("/inventory"))
                    .header("content-type", "application/json")
                    .header("authorization", pair[0])
                    .header("authorization", pair[1])
                    .body(r#"{"stock": 7}"#),
            )
            .await;
        assert_eq!(
            (reply.status, reply.error_code()),
            (401, "unauthorized"),
            "{pair:?}"
        );
    }
    assert_eq!(
        cluster.redis.snapshot().await,
        before,
        "a refused reset changed Redis"
    );
    // The scheme's name is case-insensitive (RFC 9110): `bearer` is `Bearer`.
    for scheme in ["bearer", "BEARER"] {
        let reply = app
            .send(
                http.put(app.url("/inventory"))
                    .header("content-type", "application/json")
                    .header("authorization", format!("{scheme} s3cret"))
                    .body(r#"{"stock": 6}"#),
            )
            .await;
        assert_eq!(
            (reply.status, &reply.body["stock"]),
            (200, &6.into()),
            "{scheme}: {reply:?}"
        );
    }
    // Sales need no token.
    assert_eq!(app.sale("").await.status, 200);
}

#[tokio::test(flavor = "multi_thread")]
async fn reset_restores_stock_and_clears_ledger_fencing_and_lock() {
    // A short sale budget (wait, work, Redis timeout): the lease a reset gives the stuck lock
    // outlasts any live sale, 1 + 0 + 4 x 0.1 + 1 = 2.4 s here.
    let cluster = Cluster::start(1, |b| {
        b.env("LOCK_TTL_MS", 1000)
            .env("LOCK_WAIT_MS", 1000)
            .env("MAX_WORK_MS", 0)
            .env("REDIS_TIMEOUT_MS", 100)
    })
    .await;
    let app = &cluster.instances[0];
    app.reset(3).await;
    app.sale("").await;
    let keys = inventory::store::Keys::new("001");
    let mut c = cluster.redis.conn().await;
    let _: () = redis::cmd("SET")
        .arg(&keys.lock)
        .arg("stuck")
        .query_async(&mut c)
        .await
        .unwrap();

    let reply = app.put_inventory(r#"{"stock": 8}"#, None).await;
    assert_eq!(reply.body["stock"], 8);
    assert_eq!(reply.body["initial"], 8);
    assert_eq!(reply.body["sales"], 0);
    let audit = app.audit().await;
    assert_eq!(audit["clean"], true, "{audit}");
    // The lease-less lock (a crashed `setnx` holder's, or a live one's) got a lease longer
    // than any live sale: it frees itself then, and a live holder keeps it until then.
    let pttl: i64 = redis::cmd("PTTL")
        .arg(&keys.lock)
        .query_async(&mut c)
        .await
        .unwrap();
    assert!(
        (2000..=2400).contains(&pttl),
        "the stuck lock's lease: {pttl}"
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let sold = loop {
        let sale = app.sale("strategy=setnx").await;
        if sale.status != 503 || std::time::Instant::now() > deadline {
            break sale;
        }
    };
    assert_eq!(sold.status, 200, "the stuck lock freed itself: {sold:?}");
    assert_eq!(sold.body["remaining"], 7);
}

#[tokio::test(flavor = "multi_thread")]
async fn every_response_names_the_instance_and_errors_are_json() {
    let cluster = Cluster::start(1, |b| b).await;
    let app = &cluster.instances[0];
    for path in [
        "/health",
        "/ready",
        "/strategies",
        "/inventory",
        "/inventory/audit",
        "/nowhere",
        "/swagger-ui/",
        "/api-docs/openapi.json",
    ] {
        let reply = app.get(path).await;
        assert_eq!(reply.instance.as_deref(), Some("app1"), "{path}");
    }
    // Every path nothing answers is the contract's 404, under the UI's own prefix too (its
    // file server's own 404 was empty), while the UI's files are still served.
    for path in [
        "/nowhere",
        "/swagger-ui/nope",
        "/swagger-ui/nope/deeper.js",
        "/api-docs/nope.json",
    ] {
        let missing = app.get(path).await;
        assert_eq!(
            (missing.status, missing.error_code()),
            (404, "not_found"),
            "{path}: {missing:?}"
        );
    }
    let script = app.get("/swagger-ui/swagger-ui-bundle.js").await;
    assert_eq!(script.status, 200, "{:?}", script.headers);

    // A client's X-Request-Id is sent back when it is one short visible token; anything else
    // (8 KB of it, spaces, two of them) is replaced by one of the instance's own.
    let http = reqwest::Client::new();
    let request_id = |reply: &reqwest::Response| {
        reply
            .headers()
            .get("x-request-id")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let kept = http
        .get(app.url("/health"))
        .header("x-request-id", "abc-123")
        .send()
        .await
        .unwrap();
    assert_eq!(request_id(&kept).as_deref(), Some("abc-123"));
    let long = "x".repeat(8192);
    for ids in [vec![long.as_str()], vec!["two words"], vec!["a", "b"]] {
        let mut request = http.get(app.url("/health"));
        for id in &ids {
            request = request.header("x-request-id", *id);
        }
        let reply = request.send().await.unwrap();
        let echoed = request_id(&reply).unwrap_or_default();
        assert!(
            !echoed.is_empty() && echoed.len() <= 128 && !ids.contains(&echoed.as_str()),
            "{:?} came back as {echoed:?}",
            ids.iter()
                .map(|id| &id[..id.len().min(16)])
                .collect::<Vec<_>>()
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn health_stays_200_and_ready_turns_503_fast_while_redis_is_down() {
    let redis = RedisServer::start().await;
    let app = InstanceBuilder::new(&redis, "app1")
        .env("REDIS_TIMEOUT_MS", 300)
        .start()
        .await;
    assert_eq!(app.get("/ready").await.status, 200);
    drop(redis);

    assert_eq!(app.get("/health").await.status, 200);
    let ready = app.get("/ready").await;
    assert_eq!(
        (ready.status, ready.error_code()),
        (503, "redis_unavailable"),
        "{ready:?}"
    );
    // Only a sale says it sold nothing; a reset whose connection was refused says it was not
    // applied (nothing was sent).
    let message = ready.body["message"].as_str().unwrap_or_default();
    assert!(!message.contains("sold"), "/ready: {message}");
    let reset = app.put_inventory(r#"{"stock": 5}"#, None).await;
    assert_eq!(
        (reset.status, reset.error_code()),
        (503, "redis_unavailable"),
        "{reset:?}"
    );
    let message = reset.body["message"].as_str().unwrap_or_default();
    assert!(
        !message.contains("sold") && message.contains("the stock was not reset"),
        "PUT /inventory: {message}"
    );
    let sale = app.sale("").await;
    assert_eq!(
        (sale.status, sale.error_code()),
        (503, "redis_unavailable"),
        "{sale:?}"
    );
    assert!(sale.elapsed < Duration::from_millis(1_500), "{sale:?}");
    let message = sale.body["message"].as_str().unwrap_or_default();
    assert!(message.contains("nothing was sold"), "{message}");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_openapi_document_lists_every_route_and_describes_every_response() {
    let cluster = Cluster::start(1, |b| b).await;
    let app = &cluster.instances[0];
    let doc = app.get("/api-docs/openapi.json").await.body;
    assert!(
        doc["openapi"].as_str().unwrap().starts_with("3.1"),
        "{}",
        doc["openapi"]
    );

    let expected = [
        ("/inventory/sale", vec!["get", "post"]),
        ("/inventory", vec!["get", "put"]),
        ("/inventory/audit", vec!["get"]),
        ("/inventory/{item}/sale", vec!["get", "post"]),
        ("/inventory/{item}", vec!["get", "put"]),
        ("/inventory/{item}/audit", vec!["get"]),
        ("/strategies", vec!["get"]),
        ("/health", vec!["get"]),
        ("/ready", vec!["get"]),
        ("/metrics", vec!["get"]),
    ];
    let paths = doc["paths"].as_object().unwrap();
    assert_eq!(
        paths.len(),
        expected.len(),
        "{:?}",
        paths.keys().collect::<Vec<_>>()
    );
    for (path, methods) in expected {
        for method in methods {
            let op = &paths[path][method];
            let responses = op["responses"]
                .as_object()
                .unwrap_or_else(|| panic!("{method} {path}"));
            for (status, response) in responses {
                let description = response["description"].as_str().unwrap_or_default();
                assert!(
                    !description.is_empty(),
                    "{method} {path} {status} has no description"
                );
            }
            assert!(
                op["summary"].as_str().is_some(),
                "{method} {path} has no summary"
            );
        }
    }
    let sale = &paths["/inventory/sale"]["post"];
    for status in ["200", "400", "409", "503"] {
        assert!(
            sale["responses"][status].is_object(),
            "sale documents {status}"
        );
    }
    // The header a replayed outcome carries is in the document where it is sent.
    for (path, method) in [
        ("/inventory/sale", "post"),
        ("/inventory/sale", "get"),
        ("/inventory/{item}/sale", "post"),
    ] {
        for status in ["200", "409"] {
            let headers = &paths[path][method]["responses"][status]["headers"];
            assert!(
                headers["Idempotent-Replayed"].is_object(),
                "{method} {path} {status} does not document Idempotent-Replayed"
            );
        }
    }
    // The item paths document the item's format as the service checks it, and the sale of
    // an item answers what the default item's sale answers.
    for (path, method) in [
        ("/inventory/{item}/sale", "post"),
        ("/inventory/{item}/sale", "get"),
        ("/inventory/{item}", "get"),
        ("/inventory/{item}", "put"),
        ("/inventory/{item}/audit", "get"),
    ] {
        let op = &paths[path][method];
        let item = op["parameters"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == "item")
            .unwrap_or_else(|| panic!("{method} {path} has no item parameter"));
        assert_eq!(item["in"], "path");
        assert_eq!(
            item["schema"]["pattern"],
            inventory::names::ITEM_ID_SCHEMA_PATTERN,
            "{method} {path}"
        );
        assert!(op["responses"]["400"].is_object(), "{method} {path}: 400");
    }
    let item_sale = &paths["/inventory/{item}/sale"]["post"];
    let statuses = |op: &Value| {
        op["responses"]
            .as_object()
            .unwrap()
            .keys()
            .cloned()
            .collect::<Vec<_>>()
    };
    assert_eq!(statuses(item_sale), statuses(sale));
    let strategy = sale["parameters"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "strategy")
        .unwrap();
    let allowed = strategy["schema"]["enum"].as_array().unwrap();
    assert!(allowed.contains(&Value::from("fenced")) && allowed.contains(&Value::from("v8")));

    let page = app.get("/swagger-ui/").await;
    assert_eq!(page.status, 200);
    assert!(
        page.body.as_str().unwrap().contains("swagger-ui"),
        "{page:?}"
    );
}

/// Redis URLs the client library would take but the service cannot use are refused at
/// start, by the setting's name and the reason, with the password hidden: TLS (the first
/// connection used to panic in the TLS library, and every request after it got no answer or
/// a 500) and port 0, in `REDIS_URL` and in `LOCK_NODES` alike.
#[tokio::test(flavor = "multi_thread")]
async fn redis_urls_the_service_cannot_use_are_refused_at_start_naming_why() {
    for (variable, url, why) in [
        ("REDIS_URL", "rediss://:pw-secret@127.0.0.1:6390", "TLS"),
        ("REDIS_URL", "redis://:pw-secret@127.0.0.1:0", "port 0"),
        (
            "LOCK_NODES",
            "redis://127.0.0.1:6391,rediss://:pw-secret@127.0.0.1:6392,redis://127.0.0.1:6393",
            "TLS",
        ),
    ] {
        let (started, text) = crate::harness::start_with_only(&[(variable, url)]).await;
        assert!(!started, "{variable}={url}: it started\n{text}");
        for expected in [variable, why, "valid: redis://"] {
            assert!(text.contains(expected), "{variable}={url}: {text}");
        }
        assert!(!text.contains("pw-secret"), "the password shown: {text}");
        assert!(!text.contains("panicked"), "{text}");
    }
}

/// One Redis server under two names in `LOCK_NODES`. The same database under two spellings
/// (a host name and an address) never works, since a sale's grant there makes its second vote
/// busy (every quorum sale waited its budget out, from outside): refused at start, naming
/// both nodes. Two databases of one server vote twice, and one crash of it takes both: said
/// at start, not refused (databases of one server are how the tests try the quorum's logic).
/// Three servers, one of them down, say nothing of it.
#[tokio::test(flavor = "multi_thread")]
async fn lock_nodes_naming_one_server_twice_are_refused_or_said_at_start() {
    let (a, b) = (RedisServer::start().await, RedisServer::start().await);
    let (pa, pb) = (a.port(), b.port());
    let (started, text) = crate::harness::start_with_only(&[
        ("REDIS_URL", &format!("redis://127.0.0.1:{pa}")),
        (
            "LOCK_NODES",
            &format!("redis://127.0.0.1:{pa},redis://localhost:{pa},redis://127.0.0.1:{pb}"),
        ),
    ])
    .await;
    assert!(!started, "one database under two names: it started\n{text}");
    assert!(
        text.contains("node 1 (") && text.contains("node 2 (") && text.contains("same database"),
        "{text}"
    );
    let down = crate::harness::free_port();
    for (nodes, twice) in [
        (
            format!("redis://127.0.0.1:{pb},redis://127.0.0.1:{pa}/1,redis://127.0.0.1:{pa}/2"),
            true,
        ),
        (
            format!("redis://127.0.0.1:{pa},redis://127.0.0.1:{pb},redis://127.0.0.1:{down}"),
            false,
        ),
    ] {
        let app = InstanceBuilder::new(&a, "app1")
            .env("LOCK_NODES", &nodes)
            .start()
            .await;
        app.reset(5).await;
        let sale = app.sale("strategy=redlock").await;
        assert_eq!(sale.status, 200, "{nodes}: {sale:?}");
        let log = app.log();
        if twice {
            assert!(
                log.contains("node 2 (")
                    && log.contains("node 3 (")
                    && log.contains("same Redis server"),
                "{nodes}: {log}"
            );
        } else {
            assert!(!log.contains("same Redis server"), "{nodes}: {log}");
        }
    }
}

/// Every route refuses a body over 16 KiB with 413, before it does anything, and the OpenAPI
/// document lists that answer for every operation (only those that take a body listed it).
#[tokio::test(flavor = "multi_thread")]
async fn every_documented_operation_answers_and_documents_413_and_its_headers() {
    let redis = RedisServer::start().await;
    let app = InstanceBuilder::new(&redis, "app1").start().await;
    app.reset(5).await;
    let document = app.get("/api-docs/openapi.json").await.body;
    let paths = document["paths"].as_object().expect("paths");
    let http = reqwest::Client::new();
    let mut checked = 0;
    for (path, item) in paths {
        for (method, operation) in item.as_object().expect("operations") {
            let url = app.url(&path.replace("{item}", "001"));
            let sent = http
                .request(method.to_uppercase().parse().unwrap(), url)
                .header("content-type", "application/json")
                .body(vec![b' '; 20_000])
                .send()
                .await
                .unwrap();
            assert_eq!(sent.status(), 413, "{method} {path}");
            assert!(
                operation["responses"].get("413").is_some(),
                "{method} {path} does not document its 413"
            );
            // Every answer carries these two headers, and every documented answer says so.
            for header in ["x-instance", "x-request-id"] {
                assert!(
                    sent.headers().contains_key(header),
                    "{method} {path}: {header}"
                );
            }
            for (status, response) in operation["responses"].as_object().expect("responses") {
                let headers = &response["headers"];
                assert!(
                    headers.get("X-Instance").is_some() && headers.get("X-Request-Id").is_some(),
                    "{method} {path} {status}: {headers}"
                );
            }
            checked += 1;
        }
    }
    assert!(checked >= 12, "{checked} operations");
    assert_eq!(app.audit().await["sales"], 0, "nothing sold");
    assert_eq!(
        app.get("/inventory").await.body["stock"],
        5,
        "nothing reset"
    );
}

/// A database the Redis server does not have (`REDIS_URL=.../5000` against the default 16):
/// every route that needs Redis answers 503 naming the database setting, never 500, and
/// every one of those answers is in the OpenAPI document.
#[tokio::test(flavor = "multi_thread")]
async fn a_database_redis_does_not_have_answers_503_naming_it_on_every_route() {
    let redis = RedisServer::start().await;
    let app = InstanceBuilder::new(&redis, "app1")
        .env(
            "REDIS_URL",
            format!("redis://127.0.0.1:{}/5000", redis.port()),
        )
        .start()
        .await;
    let document = app.get("/api-docs/openapi.json").await.body;
    let http = reqwest::Client::new();
    for (method, path, documented_at) in [
        ("GET", "/ready", "/ready"),
        ("GET", "/inventory", "/inventory"),
        ("GET", "/inventory/audit", "/inventory/audit"),
        ("PUT", "/inventory", "/inventory"),
        ("POST", "/inventory/sale", "/inventory/sale"),
        ("GET", "/inventory/other/sale", "/inventory/{item}/sale"),
    ] {
        let mut request = http.request(method.parse().unwrap(), app.url(path));
        if method == "PUT" {
            request = request
                .header("content-type", "application/json")
                .body(r#"{"stock": 5}"#);
        }
        let reply = app.send(request).await;
        assert_eq!(
            (reply.status, reply.error_code()),
            (503, "redis_unavailable"),
            "{method} {path}: {}",
            reply.body
        );
        let message = reply.body["message"].as_str().unwrap_or_default();
        assert!(message.contains("database REDIS_URL names"), "{message}");
        let operation = &document["paths"][documented_at][method.to_lowercase()];
        assert!(
            operation["responses"]["503"].is_object(),
            "{method} {documented_at} does not document its 503"
        );
    }
}

/// The stock, reset and audit routes take no query parameters: `?item=qq` used to answer
/// with the default item's stock (or reset it), and `?dry_run=true` reset all the same.
#[tokio::test(flavor = "multi_thread")]
async fn a_query_parameter_on_the_stock_reset_or_audit_routes_is_refused_and_changes_nothing() {
    let cluster = Cluster::start(1, |b| b).await;
    let app = &cluster.instances[0];
    app.reset(7).await;
    let http = reqwest::Client::new();
    for (method, path) in [
        ("GET", "/inventory?item=qq"),
        ("GET", "/inventory/audit?item=qq"),
        ("PUT", "/inventory?dry_run=true"),
        ("PUT", "/inventory?item=qq"),
        ("GET", "/inventory/001?x=1"),
        ("GET", "/inventory/001/audit?item=001"),
        ("PUT", "/inventory/001?stock=1"),
    ] {
        let reply = app
            .send(
                http.request(method.parse().unwrap(), app.url(path))
                    .header("content-type", "application/json")
                    .body(r#"{"stock": 3}"#),
            )
            .await;
        assert_eq!(
            (reply.status, reply.error_code()),
            (400, "bad_request"),
            "{method} {path}: {}",
            reply.body
        );
        let message = reply.body["message"].as_str().unwrap_or_default();
        assert!(message.contains("takes no query parameters"), "{message}");
    }
    assert_eq!(
        app.get("/inventory").await.body["stock"],
        7,
        "a refused reset reset"
    );
    // A bare `?` is no parameter.
    assert_eq!(app.get("/inventory?").await.status, 200);
}

/// The sale takes no body: one with its parameters in it (`{"strategy": "none"}`) sold under
/// the default strategy, unread. Refused now, nothing sold; an empty body is no body.
#[tokio::test(flavor = "multi_thread")]
async fn a_sale_with_a_body_is_refused_and_sells_nothing() {
    let cluster = Cluster::start(1, |b| b).await;
    let app = &cluster.instances[0];
    app.reset(5).await;
    let http = reqwest::Client::new();
    for (method, path) in [("POST", "/inventory/sale"), ("GET", "/inventory/001/sale")] {
        let reply = app
            .send(
                http.request(method.parse().unwrap(), app.url(path))
                    .header("content-type", "application/json")
                    .body(r#"{"strategy": "none", "work_ms": 99999}"#),
            )
            .await;
        assert_eq!(
            (reply.status, reply.error_code()),
            (400, "bad_request"),
            "{method} {path}: {}",
            reply.body
        );
        let message = reply.body["message"].as_str().unwrap_or_default();
        assert!(message.contains("the sale takes no body"), "{message}");
    }
    assert_eq!(app.audit().await["sales"], 0, "a refused sale sold");
    let empty = app
        .send(http.post(app.url("/inventory/sale")).body(" \r\n"))
        .await;
    assert_eq!(empty.status, 200, "{}", empty.body);
}

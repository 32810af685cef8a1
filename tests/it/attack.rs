//! Hostile outside testing of the fixes for issue 8: properties the team's own tests
//! (`safety.rs`) do not try. Every race is forced (work_ms, SIGSTOP, resets at a known
//! moment), never hoped for. Some of these tests FAIL on purpose: each failure is a finding,
//! and its message says which property broke and what was seen.
//!
//! Properties attacked:
//! - no oversell / lost update for any mix of safe (`distributed`) strategies, resets included;
//! - a reset mid-sale never lets an old write land; fencing tokens never go backwards;
//! - a frozen or restarted Redis costs a fast 503 and sales recover without a restart;
//! - nothing is sold twice for one Idempotency-Key; "nothing sold" means a retry may sell;
//! - HEAD never sells; every error is JSON `{error, message}`; no 500 from any input;
//! - slow clients cannot take an instance down.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use inventory::lock::Strategy;
use inventory::store::Keys;
use redis::AsyncCommands;
use serde_json::Value;
use testkit::fixture::{Cluster, Instance, InstanceBuilder, RedisServer, Reply, Stack};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn lock_key() -> String {
    Keys::new("001").lock
}

fn safe_strategies() -> Vec<Strategy> {
    Strategy::ALL
        .into_iter()
        .filter(|s| s.info().distributed)
        .collect()
}

/// Resets through `app`, retrying while Redis is coming back (503), for at most `within`.
async fn reset_eventually(app: &Instance, stock: i64, within: Duration) {
    let started = Instant::now();
    loop {
        let reply = app
            .put_inventory(&format!(r#"{{"stock": {stock}}}"#), None)
            .await;
        if reply.status == 200 {
            return;
        }
        assert!(
            started.elapsed() < within,
            "reset never succeeded: {reply:?}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

async fn used_memory(redis: &RedisServer) -> i64 {
    let mut c = redis.conn().await;
    let info: String = redis::cmd("INFO")
        .arg("memory")
        .query_async(&mut c)
        .await
        .unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap()
}

/// A raw HTTP exchange: the status, the header block and the body (read until the server
/// closes, or `within`).
async fn raw(port: u16, request: &[u8], within: Duration) -> (u16, String, String) {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    stream.write_all(request).await.unwrap();
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(within, stream.read_to_end(&mut buf)).await;
    let text = String::from_utf8_lossy(&buf).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, head.to_owned(), body.to_owned())
}

fn is_json_error(body: &str) -> bool {
    // A chunked body would have its chunk sizes around it; the error bodies here are small
    // and sent with a Content-Length, so a plain parse is enough.
    serde_json::from_str::<Value>(body.trim())
        .map(|v| v["error"].is_string() && v["message"].is_string())
        .unwrap_or(false)
}

// ------------------------------------------------------------------------------------------
// Finding: a reset lets a naive release (setnx, setnx-ttl) delete the NEXT holder's lock.
// ------------------------------------------------------------------------------------------

/// A naive holder (`first`) is in the middle of its sale when the admin resets the stock: the
/// reset deletes its lock, and a new buyer (`then`) takes the lock afresh. The naive sale is
/// refused (`stock_changed`, as the fix intends), but its release is an unconditional `DEL`:
/// it deletes the new holder's lock. A third buyer then walks straight in, and two sales
/// write the same stock value. No work is longer than the lease: this is not setnx-ttl's
/// documented flaw, it is the reset's.
#[tokio::test(flavor = "multi_thread")]
async fn attack_a_reset_lets_a_naive_release_delete_the_next_holders_lock() {
    let cluster = Cluster::start(2, |b| b).await;
    let (app1, app2) = (&cluster.instances[0], &cluster.instances[1]);
    let lock = lock_key();
    let mut broken = Vec::new();
    for (first, then) in [
        // `setnx`'s lock has no lease: a reset gives it one instead of deleting it, so its
        // live holder keeps it too.
        ("setnx", "setnx"),
        ("setnx", "lua-release"),
        ("setnx-ttl", "setnx-ttl"),
        ("setnx-ttl", "lua-release"),
        ("setnx-ttl", "reentrant"),
        ("setnx-ttl", "watchdog"),
        ("setnx-ttl", "owner-check"),
        // The control: fencing refuses the late writer.
        ("setnx-ttl", "fenced"),
    ] {
        app1.reset(10).await;
        let qa = format!("strategy={first}&work_ms=600");
        let qb = format!("strategy={then}&work_ms=900");
        let a = app1.sale(&qa);
        let rest = async {
            cluster
                .redis
                .wait_for_key(&lock, true, Duration::from_secs(5))
                .await
                .expect("the first sale never took the lock");
            app2.reset(10).await;
            let b = app2.sale(&qb);
            let c = async {
                cluster
                    .redis
                    .wait_for_key(&lock, true, Duration::from_secs(5))
                    .await
                    .expect("the second sale never took the lock");
                // By now `a` has finished (its work ends 600 ms after it started) and
                // released; give it the time, then buy while `b` is still working.
                tokio::time::sleep(Duration::from_millis(650)).await;
                app1.sale(&format!("strategy={then}")).await
            };
            tokio::join!(b, c)
        };
        let (a, (b, c)) = tokio::join!(a, rest);
        let audit = app1.audit().await;
        // `a` may read after the reset on a loaded machine, and then sells rightly.
        let sold = [&a, &b, &c].iter().filter(|r| r.status == 200).count() as i64;
        let ok = audit["clean"] == true && audit["sales"].as_i64() == Some(sold);
        if !ok {
            broken.push(format!(
                "{first} then {then}: a={} {} | b={} {} | c={} {} (c waited {} ms) | audit {audit}",
                a.status,
                a.error_code(),
                b.status,
                b.body,
                c.status,
                c.body,
                c.body["waited_ms"]
            ));
        }
    }
    assert!(
        broken.is_empty(),
        "a reset mid-sale let a naive release delete the next holder's lock; two sales \
         wrote the same stock:\n{}",
        broken.join("\n")
    );
}

// ------------------------------------------------------------------------------------------
// Finding: a frozen Redis during a naive acquire leaves a lock that nobody holds.
// ------------------------------------------------------------------------------------------

/// Redis freezes while a `setnx` sale sends its `SET NX`; the sale answers 503
/// `redis_unavailable` ("nothing sold; retry shortly"). When Redis wakes, the queued
/// `SET NX` runs: a lock owned by a sale that already gave up. `undo_unanswered_acquire`
/// only undoes owner-checking strategies, so this lock is never released: every later sale
/// of every lock strategy (`fenced` included) times out, forever for `setnx` (no lease), for
/// a whole lease for the others. README: "the lock is not left to a sale that gave up".
#[tokio::test(flavor = "multi_thread")]
async fn attack_a_frozen_redis_during_a_naive_acquire_leaves_a_lock_nobody_holds() {
    let redis = RedisServer::start().await;
    let app = InstanceBuilder::new(&redis, "app1")
        .env("REDIS_TIMEOUT_MS", 300)
        .env("LOCK_WAIT_MS", 1500)
        .env("LOCK_TTL_MS", 6000)
        .start()
        .await;
    let lock = lock_key();
    let mut broken = Vec::new();
    for strategy in ["setnx", "setnx-ttl", "owner-check", "lua-release", "fenced"] {
        app.reset(10).await;
        // A warm connection, so the acquire is written into the frozen server's socket.
        assert_eq!(app.sale("strategy=atomic").await.status, 200);
        redis.signal("STOP").await;
        let frozen = app.sale(&format!("strategy={strategy}")).await;
        redis.signal("CONT").await;
        assert_eq!(frozen.status, 503, "{strategy}: {}", frozen.body);
        tokio::time::sleep(Duration::from_millis(300)).await;
        let next = app.sale("strategy=fenced").await;
        if next.status != 200 {
            let mut c = redis.conn().await;
            let holder: Option<String> = c.get(&lock).await.unwrap_or(None);
            let pttl: i64 = c.pttl(&lock).await.unwrap_or(-3);
            broken.push(format!(
                "after a frozen {strategy} acquire ({} {}): the next fenced sale got {} {}; \
                 the lock is held by {holder:?}, pttl {pttl} ms",
                frozen.status,
                frozen.error_code(),
                next.status,
                next.body
            ));
        }
    }
    assert!(
        broken.is_empty(),
        "a sale that gave up (503) left its lock behind:\n{}",
        broken.join("\n")
    );
}

// ------------------------------------------------------------------------------------------
// Finding: an Idempotency-Key claim sent to a frozen Redis blocks every retry for ~40 s.
// ------------------------------------------------------------------------------------------

/// The claim (`SET NX GET PX`) is queued in a frozen Redis; the sale answers 503
/// `redis_unavailable`: "nothing sold; retry shortly". When Redis wakes, the claim lands and
/// nobody ever settles it, so the retry with the same key (what the README tells clients to
/// do) gets 409 `in_progress` for LOCK_WAIT_MS + work + 30 s, although nothing was sold.
#[tokio::test(flavor = "multi_thread")]
async fn attack_a_claim_queued_in_a_frozen_redis_blocks_the_retry_that_nothing_sold_invites() {
    let redis = RedisServer::start().await;
    let app = InstanceBuilder::new(&redis, "app1")
        .env("REDIS_TIMEOUT_MS", 300)
        .env("LOCK_WAIT_MS", 1000)
        .start()
        .await;
    app.reset(10).await;
    assert_eq!(app.sale("strategy=atomic").await.status, 200);
    redis.signal("STOP").await;
    let first = app.sale_with_key("strategy=fenced", "frozen-claim-1").await;
    redis.signal("CONT").await;
    assert_eq!(
        (first.status, first.error_code()),
        (503, "redis_unavailable"),
        "{}",
        first.body
    );
    // "retry shortly": give it the whole wait budget and more.
    let deadline = Instant::now() + Duration::from_secs(3);
    let retry = loop {
        let retry = app.sale_with_key("strategy=fenced", "frozen-claim-1").await;
        if retry.status == 200 || Instant::now() > deadline {
            break retry;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let mut c = redis.conn().await;
    let key = Keys::new("001").idempotency("frozen-claim-1");
    let held: Option<String> = c.get(&key).await.unwrap();
    let pttl: i64 = c.pttl(&key).await.unwrap();
    assert_eq!(
        retry.status, 200,
        "the first attempt said 'nothing sold; retry shortly', but 3 s later the retry with \
         the same key still gets {} {}; the key holds {held:?} for another {pttl} ms",
        retry.status, retry.body
    );
    let audit = app.audit().await;
    assert_eq!(audit["sales"], 2, "{audit}");
}

// ------------------------------------------------------------------------------------------
// Finding: Redis losing its data lets a sale from before it land after the next reset, and
// fencing tokens start again from 1.
// ------------------------------------------------------------------------------------------

/// A `fenced` sale reads the stock, then Redis restarts without its data (the harness's and
/// the README quick start's `--save ""`; or a host crash within appendfsync everysec). The
/// admin restocks. The reset bumps the lock-free write count from 0 to 1, which is exactly
/// what the old sale read before the restart, and the newest token seen is gone: the old
/// sale's write passes both guards and lands on the new stock. And the next fenced sale is
/// given token 1 again: tokens went backwards.
#[tokio::test(flavor = "multi_thread")]
async fn attack_a_write_from_before_a_redis_data_loss_lands_after_the_restock() {
    let mut redis = RedisServer::start().await;
    let app = InstanceBuilder::new(&redis, "app1")
        .env("REDIS_TIMEOUT_MS", 300)
        .start()
        .await;
    app.reset(10).await;
    // Tokens before the loss.
    let mut before = Vec::new();
    for _ in 0..3 {
        let r = app.sale("strategy=fenced").await;
        before.push(r.body["fence"].as_u64().unwrap());
    }
    app.reset(10).await; // lock-free writes: 2 resets so far
    let old = app.sale("strategy=fenced&work_ms=2500");
    let crash = async {
        redis
            .wait_for_key(&lock_key(), true, Duration::from_secs(5))
            .await
            .expect("the sale never took the lock");
        tokio::time::sleep(Duration::from_millis(100)).await; // it has read by now
        redis.stop().await;
        redis.restart().await;
        // The operator restocks twice (the count the old sale read was 2).
        reset_eventually(&app, 10, Duration::from_secs(5)).await;
        reset_eventually(&app, 10, Duration::from_secs(5)).await;
    };
    let (old, ()) = tokio::join!(old, crash);
    let audit = app.audit().await;
    let next = app.sale("strategy=fenced").await;
    let token = next.body["fence"].as_u64().unwrap_or(0);
    let next_shown = format!("{} {}", next.status, next.body);
    let mut broken = Vec::new();
    if old.status == 200 || audit["remaining"] != 10 {
        broken.push(format!(
            "the sale from before the restock landed after it: {} {} ; audit {audit}",
            old.status, old.body
        ));
    }
    if token <= *before.last().unwrap() {
        broken.push(format!(
            "fencing tokens went backwards: {before:?} before; the next fenced sale after the \
             restock: {next_shown}"
        ));
    }
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

// ------------------------------------------------------------------------------------------
// Finding: one sale at a large (allowed) stock allocates a 125 MB bitmap in Redis.
// ------------------------------------------------------------------------------------------

/// The audit's "values sold twice" bitmap is indexed by the remaining stock: with the
/// largest stock a reset accepts (1e9), the first sale `SETBIT`s offset ~1e9, which makes
/// Redis allocate ~125 MB and blocks it for the allocation, inside the sale's script.
#[tokio::test(flavor = "multi_thread")]
async fn attack_one_sale_at_the_largest_allowed_stock_costs_redis_a_125_mb_bitmap() {
    let cluster = Cluster::start(1, |b| b).await;
    let app = &cluster.instances[0];
    app.reset(1_000_000_000).await;
    let before = used_memory(&cluster.redis).await;
    let sale = app.sale("strategy=atomic").await;
    assert_eq!(sale.status, 200, "{}", sale.body);
    let after = used_memory(&cluster.redis).await;
    let grown = after - before;
    assert!(
        grown < 16 << 20,
        "one sale grew Redis by {} MiB (the sale took {:?})",
        grown >> 20,
        sale.elapsed
    );
}

// ------------------------------------------------------------------------------------------
// Finding: slow clients directly against an instance: a stalled body holds a slot forever.
// ------------------------------------------------------------------------------------------

/// The header deadline stops at the end of the headers; nothing bounds the body. Two
/// clients that send a `PUT /inventory` header announcing a body, and then nothing, hold both
/// connection slots (MAX_CONNECTIONS=2) long after the header timeout: the instance serves
/// nobody else.
#[tokio::test(flavor = "multi_thread")]
async fn attack_a_stalled_request_body_holds_an_instance_connection_forever() {
    let cluster = Cluster::start(1, |b| {
        b.env("HEADER_TIMEOUT_MS", 300).env("MAX_CONNECTIONS", 2)
    })
    .await;
    let app = &cluster.instances[0];
    let mut stalled = Vec::new();
    for _ in 0..2 {
        let mut s = TcpStream::connect(("127.0.0.1", app.port)).await.unwrap();
        s.write_all(
            b"PUT /inventory HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
              Content-Length: 100\r\n\r\n{\"stock\"",
        )
        .await
        .unwrap();
        stalled.push(s);
    }
    // Ten header timeouts later.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let started = Instant::now();
    let health = reqwest::Client::new()
        .get(app.url("/health"))
        .timeout(Duration::from_secs(3))
        .send()
        .await;
    assert!(
        health.as_ref().map(|r| r.status().as_u16()).ok() == Some(200),
        "two clients with a stalled body keep the instance from answering anyone, 3 s after \
         a 300 ms header timeout: {:?} after {:?}",
        health.map(|r| r.status()),
        started.elapsed()
    );
    drop(stalled);
}

/// A client that pipelines requests for a large response and never reads: hyper blocks on
/// the write with no deadline, and the slot stays taken.
#[tokio::test(flavor = "multi_thread")]
async fn attack_a_client_that_never_reads_its_responses_cannot_hold_an_instance() {
    let cluster = Cluster::start(1, |b| {
        b.env("HEADER_TIMEOUT_MS", 300).env("MAX_CONNECTIONS", 1)
    })
    .await;
    let app = &cluster.instances[0];
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut reader = socket
        .connect(format!("127.0.0.1:{}", app.port).parse().unwrap())
        .await
        .unwrap();
    let request = b"GET /api-docs/openapi.json HTTP/1.1\r\nHost: x\r\n\r\n";
    let pipelined: Vec<u8> = request
        .iter()
        .copied()
        .cycle()
        .take(request.len() * 400)
        .collect();
    let _ = tokio::time::timeout(Duration::from_secs(2), reader.write_all(&pipelined)).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let health = reqwest::Client::new()
        .get(app.url("/health"))
        .timeout(Duration::from_secs(3))
        .send()
        .await;
    assert!(
        health.as_ref().map(|r| r.status().as_u16()).ok() == Some(200),
        "a client that never reads keeps the instance from answering anyone: {:?}",
        health.map(|r| r.status())
    );
    drop(reader);
}

// ------------------------------------------------------------------------------------------
// Finding: errors that are not the JSON shape, directly and through nginx.
// ------------------------------------------------------------------------------------------

/// Malformed requests sent straight to an instance are answered by hyper before the
/// application sees them: a 4xx and a closed connection, never a 5xx or a hang. (Their body
/// is empty; through nginx, which refuses them first, they are JSON: see the next test.)
#[tokio::test(flavor = "multi_thread")]
async fn attack_malformed_requests_to_an_instance_get_a_4xx_and_never_a_hang() {
    let cluster = Cluster::start(1, |b| b).await;
    let app = &cluster.instances[0];
    let mut broken = Vec::new();
    for (what, request) in [
        ("garbage request line", &b"GARBAGE\r\n\r\n"[..]),
        ("HTTP/9.9", b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n"),
        (
            "Transfer-Encoding: gzip",
            b"POST /inventory/sale HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n",
        ),
        (
            "two Content-Lengths",
            b"PUT /inventory HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n{}",
        ),
        (
            "a header without a colon",
            b"GET /health HTTP/1.1\r\nHost: x\r\nno-colon-here\r\n\r\n",
        ),
    ] {
        let (status, _, body) = raw(app.port, request, Duration::from_secs(2)).await;
        if !(400..500).contains(&status) {
            broken.push(format!("{what}: {status} body {body:?}"));
        }
    }
    assert!(broken.is_empty(), "{}", broken.join("\n"));
    assert_eq!(app.get("/health").await.status, 200);
}

/// Errors nginx answers itself, beyond the ones its `error_page` lists (501, 505, 411...).
#[tokio::test(flavor = "multi_thread")]
async fn attack_every_error_through_nginx_is_json() {
    let stack = Stack::start(|b| b).await;
    stack.cluster.instances[0].reset(5).await;
    let before = stack.cluster.redis.snapshot().await;
    let mut broken = Vec::new();
    let mut seen = Vec::new();
    for (what, request) in [
        (
            "Transfer-Encoding: gzip",
            &b"POST /inventory/sale HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\nConnection: close\r\n\r\n"[..],
        ),
        ("HTTP/2.0 request line", b"GET /health HTTP/2.0\r\nHost: x\r\n\r\n"),
        ("HTTP/3.1 request line", b"GET /health HTTP/3.1\r\nHost: x\r\n\r\n"),
        ("TRACE", b"TRACE /inventory/sale HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"),
        ("lowercase method", b"get /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"),
        (
            "two Hosts",
            b"GET /health HTTP/1.1\r\nHost: x\r\nHost: y\r\nConnection: close\r\n\r\n",
        ),
        (
            "bad Content-Length",
            b"PUT /inventory HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\nConnection: close\r\n\r\n",
        ),
        (
            "HTTP/1.0 chunked",
            b"POST /inventory/sale HTTP/1.0\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        ),
        ("no Host", b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n"),
        (
            "Expect: 100-continue over the body limit",
            b"PUT /inventory HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 999999999\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n",
        ),
    ] {
        let (status, head, body) = raw(stack.nginx.port, request, Duration::from_secs(3)).await;
        seen.push(format!("{what}: {status}"));
        if status >= 400 && !is_json_error(&body) {
            let server = head
                .lines()
                .find(|l| l.to_ascii_lowercase().starts_with("content-type"))
                .unwrap_or("");
            broken.push(format!(
                "{what}: {status} ({server}) body {:?}",
                body.chars().take(120).collect::<String>()
            ));
        }
    }
    let after = stack.cluster.redis.snapshot().await;
    assert_eq!(before, after, "a malformed request changed Redis: {seen:?}");
    assert!(
        broken.is_empty(),
        "errors through nginx that are not JSON:\n{}\n(all: {seen:?})",
        broken.join("\n")
    );
}

/// The 405 of the sale route says `Allow: POST,GET,HEAD`, but HEAD on it is refused with 405.
#[tokio::test(flavor = "multi_thread")]
async fn attack_the_sale_routes_allow_header_does_not_offer_head() {
    let cluster = Cluster::start(1, |b| b).await;
    let app = &cluster.instances[0];
    let http = reqwest::Client::new();
    let reply = app
        .send(http.request(reqwest::Method::PATCH, app.url("/inventory/sale")))
        .await;
    assert_eq!(reply.status, 405);
    let head = app
        .send(http.request(reqwest::Method::HEAD, app.url("/inventory/sale")))
        .await;
    assert_eq!(head.status, 405);
    let allow = reply
        .headers
        .get("allow")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    assert!(
        !allow.split(',').any(|m| m.trim() == "HEAD"),
        "Allow advertises HEAD ({allow}) on a route that answers HEAD with 405"
    );
}

// ------------------------------------------------------------------------------------------
// Load: resets in a tight loop while 64 buyers mix safe strategies.
// ------------------------------------------------------------------------------------------

/// 64 buyers mixing `strategies` on two instances while the admin resets the stock again and
/// again. The audit only speaks of the sales since the last reset, so the run is cut into
/// epochs: a reset lands in the middle of the buying (crossing every sale in flight), the
/// buying goes on, then the buyers pause, the sales in flight drain, and the epoch's audit
/// must be clean. Returns the audits that were not, and the answers that were not expected.
async fn resets_in_a_loop_under_mixed_load(strategies: &[&str]) -> (Vec<Value>, Vec<String>) {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let cluster = Cluster::start(2, |b| b.env("LOCK_WAIT_MS", 3000)).await;
    cluster.instances[0].reset(1_000).await;
    let paused = AtomicBool::new(false);
    let in_flight = AtomicUsize::new(0);
    let done = AtomicBool::new(false);
    let buyers = (0..64).map(|n| {
        let app = &cluster.instances[n % 2];
        let strategies = strategies.to_vec();
        let (paused, in_flight, done) = (&paused, &in_flight, &done);
        async move {
            let mut odd = Vec::new();
            let mut i = n;
            while !done.load(Ordering::SeqCst) {
                if paused.load(Ordering::SeqCst) {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    continue;
                }
                in_flight.fetch_add(1, Ordering::SeqCst);
                let strategy = strategies[i % strategies.len()];
                let reenter = i % 3 == 0
                    && !["setnx", "setnx-ttl", "owner-check", "lua-release"].contains(&strategy);
                let work = 5 + (i * 7) % 30;
                let reply = app
                    .sale(&format!(
                        "strategy={strategy}&work_ms={work}&reenter={reenter}"
                    ))
                    .await;
                in_flight.fetch_sub(1, Ordering::SeqCst);
                if !matches!(
                    (reply.status, reply.error_code()),
                    (200, _)
                        | (
                            409,
                            "sold_out" | "stock_changed" | "stale_fence" | "lock_lost"
                        )
                        | (503, "lock_timeout" | "too_much_contention")
                ) {
                    odd.push(format!("{strategy}: {} {}", reply.status, reply.body));
                }
                i += 1;
            }
            odd
        }
    });
    let epochs = async {
        let mut unclean = Vec::new();
        for epoch in 0..8 {
            tokio::time::sleep(Duration::from_millis(150)).await;
            // Mid-buying: crosses every sale in flight.
            cluster.instances[epoch % 2].reset(1_000).await;
            tokio::time::sleep(Duration::from_millis(250)).await;
            paused.store(true, Ordering::SeqCst);
            while in_flight.load(Ordering::SeqCst) > 0 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let audit = cluster.instances[0].audit().await;
            if audit["clean"] != true {
                unclean.push(audit);
            }
            paused.store(false, Ordering::SeqCst);
        }
        done.store(true, Ordering::SeqCst);
        unclean
    };
    let (odd, unclean) = tokio::join!(futures_util::future::join_all(buyers), epochs);
    (unclean, odd.into_iter().flatten().collect())
}

/// Every owner-checking lock strategy, reentrant nesting and `atomic`, under resets. FLAKY
/// FAIL (about one run in two here): a reset that lands between a sale's acquire and its read
/// takes the lock from it silently; the deterministic form is
/// `attack_a_reset_between_a_sales_acquire_and_its_read_takes_its_lock_silently`.
#[tokio::test(flavor = "multi_thread")]
async fn attack_resets_in_a_tight_loop_under_64_buyers_of_owner_checking_strategies() {
    let (unclean, odd) = resets_in_a_loop_under_mixed_load(&[
        "fenced",
        "atomic",
        "lua-release",
        "reentrant",
        "watchdog",
        "owner-check",
    ])
    .await;
    assert!(
        odd.is_empty(),
        "unexpected answers: {:?}",
        &odd[..odd.len().min(10)]
    );
    assert!(
        unclean.is_empty(),
        "epochs whose audit is not clean: {unclean:?}"
    );
}

/// The same with every safe strategy, the naive ones included, but `setnx`: a reset frees
/// its lease-less lock (the only way out of its crash flaw), a live holder's included.
#[tokio::test(flavor = "multi_thread")]
async fn attack_resets_in_a_tight_loop_under_64_buyers_of_every_safe_strategy() {
    let names: Vec<&str> = safe_strategies()
        .iter()
        .map(|s| s.name())
        .filter(|name| *name != "setnx")
        .collect();
    let (unclean, odd) = resets_in_a_loop_under_mixed_load(&names).await;
    assert!(
        odd.is_empty(),
        "unexpected answers: {:?}",
        &odd[..odd.len().min(10)]
    );
    assert!(
        unclean.is_empty(),
        "{} of 8 epochs (a reset crossing the sales in flight) ended with lost updates: \
         {unclean:?}",
        unclean.len()
    );
}

// ------------------------------------------------------------------------------------------
// Idempotency under attack.
// ------------------------------------------------------------------------------------------

/// One key, 32 concurrent attempts over both instances and every safe strategy: one sale.
#[tokio::test(flavor = "multi_thread")]
async fn attack_one_key_reused_across_strategies_and_instances_at_once_sells_once() {
    let cluster = Cluster::start(2, |b| b).await;
    cluster.instances[0].reset(50).await;
    let strategies = safe_strategies();
    let attempts = (0..32).map(|n| {
        let app = &cluster.instances[n % 2];
        let query = format!(
            "strategy={}&work_ms=80&reenter={}",
            strategies[n % strategies.len()],
            n % 4 == 0 && strategies[n % strategies.len()].info().reentrant
        );
        async move { app.sale_with_key(&query, "one-key-for-all").await }
    });
    let replies = futures_util::future::join_all(attempts).await;
    let sold: Vec<&Reply> = replies.iter().filter(|r| r.status == 200).collect();
    for r in &replies {
        assert!(
            r.status == 200 || (r.status, r.error_code()) == (409, "in_progress"),
            "{} {}",
            r.status,
            r.body
        );
    }
    let orders: HashSet<&str> = sold
        .iter()
        .filter_map(|r| r.body["order_id"].as_str())
        .collect();
    assert!(orders.len() <= 1, "two order ids for one key: {orders:?}");
    let audit = cluster.instances[1].audit().await;
    assert!(audit["sales"].as_i64() <= Some(1), "{audit}");
    assert_eq!(audit["clean"], true, "{audit}");
    // And afterwards, from any strategy, the key replays that sale.
    let again = cluster.instances[1]
        .sale_with_key("strategy=atomic", "one-key-for-all")
        .await;
    if let Some(order) = orders.iter().next() {
        assert_eq!(again.body["order_id"], *order, "{}", again.body);
    }
}

/// A key whose sale was refused because a reset crossed it can be retried and sells once;
/// a key that sold before a reset never sells again after it.
#[tokio::test(flavor = "multi_thread")]
async fn attack_an_idempotency_key_across_a_reset_never_sells_twice() {
    let cluster = Cluster::start(1, |b| b).await;
    let app = &cluster.instances[0];
    app.reset(10).await;
    let sold = app.sale_with_key("strategy=fenced", "across-reset-1").await;
    assert_eq!(sold.status, 200);
    // A tenure may keep the first sale's lock parked for a moment after its answer: the
    // lock key seen below must be the next sale's.
    cluster
        .redis
        .wait_for_key(&lock_key(), false, Duration::from_secs(5))
        .await
        .unwrap();
    // Crossed by a reset: refused, key freed. The reset lands once the sale has read (the
    // lock alone is not enough: a reset before the read is one the sale reads after).
    let reads = app.log().matches("stock read").count();
    let crossed = app.sale_with_key("strategy=lua-release&work_ms=500", "across-reset-2");
    let reset = async {
        crate::harness::until_stock_read(app, reads).await;
        app.reset(10).await;
    };
    let (crossed, ()) = tokio::join!(crossed, reset);
    assert_eq!(crossed.error_code(), "stock_changed", "{}", crossed.body);
    for strategy in ["atomic", "fenced", "setnx-ttl"] {
        let replay = app
            .sale_with_key(&format!("strategy={strategy}"), "across-reset-1")
            .await;
        assert_eq!(replay.body["order_id"], sold.body["order_id"]);
    }
    let retry = app.sale_with_key("strategy=atomic", "across-reset-2").await;
    assert_eq!(retry.status, 200, "{}", retry.body);
    let audit = app.audit().await;
    assert_eq!(
        (audit["sales"].as_i64(), audit["clean"].as_bool()),
        (Some(1), Some(true)),
        "{audit}"
    );
}

/// Two `Idempotency-Key` headers on one sale, directly and through nginx: whichever were used,
/// a retry with the other would sell again, so the sale is refused (400, naming the rule) and
/// nothing is sold; the same request with one of them sells once, and its retry replays.
#[tokio::test(flavor = "multi_thread")]
async fn attack_two_idempotency_keys_on_one_sale_are_refused_and_sell_nothing() {
    let stack = Stack::start(|b| b).await;
    let app = &stack.cluster.instances[0];
    app.reset(5).await;
    for url in [
        app.url("/inventory/sale"),
        format!("{}/inventory/sale", stack.nginx.url()),
    ] {
        let twice = reqwest::Client::new()
            .post(&url)
            .header("Idempotency-Key", "first")
            .header("Idempotency-Key", "second");
        let r = app.send(twice).await;
        assert_eq!(
            (r.status, r.error_code()),
            (400, "bad_request"),
            "{url}: {}",
            r.body
        );
        assert!(
            r.body["message"]
                .as_str()
                .unwrap()
                .contains("one Idempotency-Key"),
            "{}",
            r.body
        );
    }
    assert_eq!(app.audit().await["sales"], 0);
    let once = || {
        reqwest::Client::new()
            .post(format!("{}/inventory/sale", stack.nginx.url()))
            .header("Idempotency-Key", "second")
    };
    let (first, retry) = (app.send(once()).await, app.send(once()).await);
    assert_eq!((first.status, retry.status), (200, 200));
    assert_eq!(first.body["order_id"], retry.body["order_id"]);
    assert_eq!(app.audit().await["sales"], 1);
}

/// Redis frozen at moments spread over a run, while 24 buyers each retry their own key until
/// a final answer: no key sells twice, every 200 is in the audit, no 500.
#[tokio::test(flavor = "multi_thread")]
async fn attack_redis_frozen_repeatedly_under_load_with_keys_sells_each_key_once() {
    let cluster = Cluster::start(2, |b| {
        b.env("REDIS_TIMEOUT_MS", 250).env("LOCK_WAIT_MS", 1500)
    })
    .await;
    cluster.instances[0].reset(1_000).await;
    let strategies = ["fenced", "atomic", "lua-release", "watchdog", "owner-check"];
    // Generous: 77 locked sales of 30 ms queue on one lock, and a loaded CI machine
    // stretches that; what the test holds to is that every key ends, and sells once.
    let global = Instant::now() + Duration::from_secs(20);
    let buyers = (0..24).map(|n| {
        let cluster = &cluster;
        async move {
            let mut outcomes: Vec<(String, String, u16, String)> = Vec::new();
            for k in 0..4 {
                let key = format!("buyer{n}-sale{k}");
                let strategy = strategies[(n + k) % strategies.len()];
                let deadline = (Instant::now() + Duration::from_secs(10)).min(global);
                loop {
                    let app = &cluster.instances[(n + k) % 2];
                    let r = app
                        .sale_with_key(&format!("strategy={strategy}&work_ms=30"), &key)
                        .await;
                    let code = r.error_code().to_owned();
                    outcomes.push((
                        key.clone(),
                        r.body["order_id"].as_str().unwrap_or("").to_owned(),
                        r.status,
                        code.clone(),
                    ));
                    if r.status == 200 || code == "sold_out" || Instant::now() > deadline {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
            outcomes
        }
    });
    let freezes = async {
        for pause in [120u64, 400, 60, 700, 250] {
            tokio::time::sleep(Duration::from_millis(300)).await;
            cluster.redis.signal("STOP").await;
            tokio::time::sleep(Duration::from_millis(pause)).await;
            cluster.redis.signal("CONT").await;
        }
    };
    let (outcomes, ()) = tokio::join!(futures_util::future::join_all(buyers), freezes);
    let outcomes: Vec<_> = outcomes.into_iter().flatten().collect();
    let mut orders: BTreeMap<&str, HashSet<&str>> = BTreeMap::new();
    let mut unfinished = Vec::new();
    for (key, order, status, code) in &outcomes {
        assert!(
            *status != 500 && (*status == 200 || !code.is_empty()),
            "{key}: {status} {code}"
        );
        if *status == 200 {
            orders.entry(key).or_default().insert(order);
        }
    }
    let finals: HashMap<&str, (u16, &str)> = outcomes
        .iter()
        .map(|(k, _, s, c)| (k.as_str(), (*s, c.as_str())))
        .collect();
    for (key, (status, code)) in &finals {
        if *status != 200 && *code != "sold_out" {
            unfinished.push(format!("{key}: {status} {code}"));
        }
    }
    for (key, set) in &orders {
        assert_eq!(set.len(), 1, "{key} sold as {set:?}");
    }
    let audit = cluster.instances[0].audit().await;
    assert_eq!(audit["clean"], true, "{audit}");
    assert_eq!(
        audit["sales"].as_i64(),
        Some(orders.len() as i64),
        "the audit's sales differ from the keys answered 200: {audit}"
    );
    assert!(
        unfinished.is_empty(),
        "keys without a final answer after retrying (503 lock_timeout: a ghost lock left by an \
         acquire queued in the frozen Redis, see attack_a_frozen_redis_during_a_naive_acquire...; \
         409 in_progress: a claim that landed after its 503, see \
         attack_a_claim_queued_in_a_frozen_redis...): {unfinished:?}"
    );
}

// ------------------------------------------------------------------------------------------
// Input at the boundaries.
// ------------------------------------------------------------------------------------------

/// `work_ms`, `strategy` and `reenter` at and past their edges: 200 or a JSON 400, never a
/// 500, and the stock moves exactly once per 200.
#[tokio::test(flavor = "multi_thread")]
async fn attack_query_parameters_at_their_edges_are_200_or_json_400() {
    let cluster = Cluster::start(1, |b| b.env("MAX_WORK_MS", 50)).await;
    let app = &cluster.instances[0];
    app.reset(1_000).await;
    let queries = [
        "work_ms=0",
        "work_ms=50",
        "work_ms=51",
        "work_ms=60000",
        "work_ms=60001",
        "work_ms=18446744073709551615",
        "work_ms=18446744073709551616",
        "work_ms=-1",
        "work_ms=-0",
        "work_ms=%2B5",
        "work_ms=1e3",
        "work_ms=abc",
        "work_ms=",
        "work_ms=5&work_ms=6",
        "work_ms=0x10",
        "work_ms=%00",
        "strategy=",
        "strategy=%20fenced%20",
        "strategy=FENCED",
        "strategy=V8",
        "strategy=fenced%00",
        "strategy=v9",
        "strategy=atomic&strategy=none",
        "reenter=TRUE",
        "reenter=1",
        "reenter=",
        "reenter=true&strategy=atomic",
        "reenter=true&strategy=none",
        "unknown=1",
        "%ff=%fe",
        "strategy=%ff",
    ];
    let mut sold = 0;
    let mut broken = Vec::new();
    for q in queries {
        for method in [reqwest::Method::POST, reqwest::Method::GET] {
            let r = app
                .send(
                    reqwest::Client::new()
                        .request(method.clone(), app.url(&format!("/inventory/sale?{q}"))),
                )
                .await;
            let message = r.body["message"].as_str().unwrap_or("");
            // A refusal says what the parameter takes, not only what was wrong.
            let names_the_valid_values = message.contains("fenced")
                || message.contains("true or false")
                || (message.contains("work_ms") && message.contains("0 "));
            match r.status {
                200 => sold += 1,
                400 if r.error_code() == "bad_request" && names_the_valid_values => {}
                _ => broken.push(format!("{method} ?{q}: {} {}", r.status, r.body)),
            }
        }
    }
    let audit = app.audit().await;
    assert!(broken.is_empty(), "{}", broken.join("\n"));
    assert_eq!(audit["sales"].as_i64(), Some(sold), "{audit}");
    assert_eq!(audit["clean"], true, "{audit}");
}

/// Odd `PUT /inventory` bodies: 200 or a JSON 400/413, and a refused one changes nothing.
#[tokio::test(flavor = "multi_thread")]
async fn attack_weird_reset_bodies_are_200_or_json_4xx_and_refused_ones_change_nothing() {
    let cluster = Cluster::start(1, |b| b).await;
    let app = &cluster.instances[0];
    app.reset(7).await;
    let big = format!(r#"{{"stock": 5, "pad": "{}"}}"#, "x".repeat(20_000));
    let deep = format!("{}5{}", "[".repeat(10_000), "]".repeat(10_000));
    let bodies: Vec<String> = [
        r#"{"stock": 1e9}"#,
        r#"{"stock": 1000000001}"#,
        r#"{"stock": -1}"#,
        r#"{"stock": -0.0}"#,
        r#"{"stock": 1e300}"#,
        r#"{"stock": NaN}"#,
        r#"{"stock": "5"}"#,
        r#"{"stock": null}"#,
        r#"{"stock": true}"#,
        r#"{"stock": 5, "stock": 6}"#,
        r#"{"Stock": 5}"#,
        r#"{}"#,
        "null",
        "[]",
        "[5]",
        "5",
        r#""stock""#,
        r#"{"stock": 18446744073709551616}"#,
        r#"{"stock": 5}garbage"#,
        "\u{feff}{\"stock\": 5}",
        "",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([big, deep])
    .collect();
    let mut broken = Vec::new();
    for body in &bodies {
        let before = cluster.redis.snapshot().await;
        let r = app.put_inventory(body, None).await;
        let shown: String = body.chars().take(40).collect();
        match r.status {
            200 => {}
            400 | 413 if r.body["error"].is_string() && r.body["message"].is_string() => {
                if cluster.redis.snapshot().await != before {
                    broken.push(format!(
                        "{shown:?}: refused ({}) but Redis changed",
                        r.status
                    ));
                }
            }
            _ => broken.push(format!("{shown:?}: {} {}", r.status, r.body)),
        }
    }
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

// ------------------------------------------------------------------------------------------
// HEAD, OPTIONS, TRACE and odd spellings of the sale path, directly and through nginx.
// ------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn attack_no_method_or_path_spelling_but_get_and_post_on_the_sale_sells() {
    let stack = Stack::start(|b| b).await;
    let app = &stack.cluster.instances[0];
    app.reset(5).await;
    let before = stack.cluster.redis.snapshot().await;
    let paths = [
        "/inventory/sale",
        "/inventory/sale/",
        "//inventory/sale",
        "/inventory//sale",
        "/inventory/./sale",
        "/inventory/x/../sale",
        "/inventory/%73ale",
        "/Inventory/Sale",
        "/inventory/sale;x",
        "/inventory/sale%3Fstrategy=atomic",
        "/inventory/001/sale",
        "/inventory",
        "/inventory/audit",
    ];
    let mut broken = Vec::new();
    for base_port in [app.port, stack.nginx.port] {
        for path in paths {
            for method in ["HEAD", "OPTIONS", "TRACE", "PROPFIND", "PATCH", "DELETE"] {
                let request = format!(
                    "{method} {path}?strategy=atomic HTTP/1.1\r\nHost: x\r\n\
                     X-HTTP-Method-Override: POST\r\nConnection: close\r\n\r\n"
                );
                let (status, _, body) =
                    raw(base_port, request.as_bytes(), Duration::from_secs(3)).await;
                // A HEAD of a read may answer 200; nothing that names the sale may.
                let sale_path = path.contains("sale");
                if (status == 200 && sale_path) || status >= 500 || status == 0 {
                    broken.push(format!(
                        "{method} {path} on :{base_port}: {status} {body:?}"
                    ));
                }
            }
        }
    }
    let after = stack.cluster.redis.snapshot().await;
    assert_eq!(before, after, "a non-selling method sold: {broken:?}");
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

/// nginx picks its location by the path it has decoded and cleaned up (`%2F` made a slash,
/// `..` resolved, `//` merged), so odd spellings of a path land in the sale's location; what
/// it sends on must still be the path the client wrote, for a GET as for a POST, or a URL
/// naming one item (or none) would buy the default one. Every spelling below is answered
/// through nginx exactly as the instance answers it directly, and none sells.
#[tokio::test(flavor = "multi_thread")]
async fn attack_odd_spellings_of_a_sale_path_are_answered_through_nginx_as_by_the_instance() {
    let stack = Stack::start(|b| b).await;
    let app = &stack.cluster.instances[0];
    app.reset(5).await;
    let stocked = app
        .send(
            reqwest::Client::new()
                .put(app.url("/inventory/sku2"))
                .header("content-type", "application/json")
                .body(r#"{"stock": 5}"#),
        )
        .await;
    assert_eq!(stocked.status, 200, "{stocked:?}");
    let before = stack.cluster.redis.snapshot().await;
    let paths = [
        "/inventory/sku2%2F..%2F001/sale",
        "/inventory/sku2%2f..%2fsale",
        "/inventory/001%2Fsale",
        "/inventory/sku2/%2E%2E/001/sale",
        "/inventory/sku2/../001/sale",
        "/inventory/sku2/../sale",
        "/inventory/x/../sale",
        "/inventory//sale",
        "//inventory/sale",
        "/inventory/./sale",
        "/inventory/%73ale",
        "/inventory/sku2/%73ale",
    ];
    let mut differ = Vec::new();
    for path in paths {
        for method in ["GET", "POST"] {
            let request = format!(
                "{method} {path}?strategy=atomic HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\
                 Connection: close\r\n\r\n"
            );
            let (direct, _, _) = raw(app.port, request.as_bytes(), Duration::from_secs(3)).await;
            let (proxied, _, body) =
                raw(stack.nginx.port, request.as_bytes(), Duration::from_secs(3)).await;
            if direct != proxied || direct == 200 {
                differ.push(format!(
                    "{method} {path}: {direct} directly, {proxied} through nginx ({body:?})"
                ));
            }
        }
    }
    let after = stack.cluster.redis.snapshot().await;
    assert_eq!(before, after, "an odd spelling sold: {differ:?}");
    assert!(differ.is_empty(), "{}", differ.join("\n"));
    // The path itself still sells through nginx, by either method, and so does an item
    // spelled with percent-escapes of its own characters (the same URL, RFC 3986): the
    // instance decodes it, and nginx leaves that to the instance.
    for path in ["/inventory/sku2/sale", "/inventory/%73ku2/sale"] {
        for method in ["GET", "POST"] {
            let request = format!(
                "{method} {path}?strategy=atomic HTTP/1.1\r\nHost: x\r\n\
                 Content-Length: 0\r\nConnection: close\r\n\r\n"
            );
            let (status, _, body) =
                raw(stack.nginx.port, request.as_bytes(), Duration::from_secs(3)).await;
            assert_eq!(status, 200, "{method} {path}: {body}");
        }
    }
    let sku2 = stack.get("/inventory/sku2/audit").await;
    assert_eq!(sku2.body["sales"], 4, "{sku2:?}");
    assert_eq!(
        app.audit().await["sales"],
        0,
        "the default item sold nothing"
    );
}

// ------------------------------------------------------------------------------------------
// Fencing under nesting, mixed strategies and resets.
// ------------------------------------------------------------------------------------------

/// Fenced buyers that nest (reenter=true) and ones that do not, beside watchdog and atomic
/// buyers, under resets: each buyer's tokens strictly increase and none is handed out twice.
#[tokio::test(flavor = "multi_thread")]
async fn attack_fencing_tokens_stay_unique_and_increasing_with_nesting_and_mixed_writers() {
    let cluster = Cluster::start(2, |b| b).await;
    cluster.instances[0].reset(2_000).await;
    let buyers = (0..16).map(|n| {
        let app = &cluster.instances[n % 2];
        async move {
            let mut tokens = Vec::new();
            for i in 0..20 {
                let query = match (n + i) % 4 {
                    0 => "strategy=fenced&reenter=true&work_ms=3",
                    1 => "strategy=fenced&work_ms=1",
                    2 => "strategy=watchdog&reenter=true&work_ms=2",
                    _ => "strategy=atomic",
                };
                let reply = app.sale(query).await;
                assert_ne!(reply.status, 500, "{query}: {}", reply.body);
                if let Some(token) = reply.body["fence"].as_u64() {
                    tokens.push(token);
                }
            }
            tokens
        }
    });
    let resets = async {
        for _ in 0..5 {
            tokio::time::sleep(Duration::from_millis(120)).await;
            cluster.instances[1].reset(2_000).await;
        }
    };
    let (tokens, ()) = tokio::join!(futures_util::future::join_all(buyers), resets);
    for (buyer, t) in tokens.iter().enumerate() {
        assert!(t.windows(2).all(|w| w[0] < w[1]), "buyer {buyer}: {t:?}");
    }
    let mut all: Vec<u64> = tokens.into_iter().flatten().collect();
    let n = all.len();
    all.sort_unstable();
    all.dedup();
    assert_eq!(all.len(), n, "a token was handed out twice");
    assert_eq!(cluster.instances[0].audit().await["clean"], true);
}

/// A Redis restart (durable, as the stack runs it) in the middle of fenced, reentrant and
/// atomic load: fast 503s, recovery without restarting the instances, a clean audit, and
/// tokens that keep counting up.
#[tokio::test(flavor = "multi_thread")]
async fn attack_a_durable_redis_restart_mid_load_recovers_and_keeps_the_books() {
    let mut redis = RedisServer::start_durable().await;
    let apps = [
        InstanceBuilder::new(&redis, "app1")
            .env("REDIS_TIMEOUT_MS", 300)
            .env("LOCK_WAIT_MS", 2000)
            .start()
            .await,
        InstanceBuilder::new(&redis, "app2")
            .env("REDIS_TIMEOUT_MS", 300)
            .env("LOCK_WAIT_MS", 2000)
            .start()
            .await,
    ];
    apps[0].reset(5_000).await;
    let stop = Instant::now() + Duration::from_secs(5);
    let buyers = (0..16).map(|n| {
        let app = &apps[n % 2];
        async move {
            let mut seen = Vec::new();
            let mut i = n;
            while Instant::now() < stop {
                let q = [
                    "strategy=fenced&work_ms=5",
                    "strategy=atomic",
                    "strategy=reentrant&reenter=true&work_ms=3",
                ][i % 3];
                let r = app.sale(q).await;
                seen.push((
                    r.status,
                    r.error_code().to_owned(),
                    r.elapsed,
                    r.body["fence"].as_u64(),
                ));
                i += 1;
            }
            seen
        }
    });
    let restart = async {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        redis.stop().await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        redis.restart().await;
    };
    let (seen, ()) = tokio::join!(futures_util::future::join_all(buyers), restart);
    let all: Vec<_> = seen.iter().flatten().collect();
    for (status, code, elapsed, _) in &all {
        assert!(*status != 500, "500 {code}");
        if *status == 503 && code == "redis_unavailable" {
            assert!(
                *elapsed < Duration::from_millis(1500),
                "slow 503: {elapsed:?}"
            );
        }
    }
    let sold_late = seen
        .iter()
        .flatten()
        .rev()
        .take(16)
        .filter(|(s, ..)| *s == 200)
        .count();
    assert!(sold_late > 0, "no sale after Redis came back");
    let sold = all.iter().filter(|(s, ..)| *s == 200).count() as i64;
    let unknown = all
        .iter()
        .filter(|(_, c, ..)| c == "outcome_unknown")
        .count() as i64;
    let audit = apps[0].audit().await;
    assert_eq!(audit["clean"], true, "{audit}");
    let sales = audit["sales"].as_i64().unwrap();
    assert!(
        sales >= sold && sales <= sold + unknown,
        "200s {sold}, outcome_unknown {unknown}, audit {audit}"
    );
    for buyer in &seen {
        let t: Vec<u64> = buyer.iter().filter_map(|(.., f)| *f).collect();
        assert!(t.windows(2).all(|w| w[0] < w[1]), "{t:?}");
    }
}

// ------------------------------------------------------------------------------------------
// Finding: a reset takes the lock from a sale that has not read yet, and nobody tells it.
// ------------------------------------------------------------------------------------------

/// A TCP proxy between one instance and Redis that holds back, once when armed, the first
/// client chunk that runs a given script (and what follows it on that connection): a network
/// hiccup (or a GC pause) at one step of a sale, such as between its acquire and its read.
struct DelayingProxy {
    port: u16,
    armed: std::sync::Arc<std::sync::atomic::AtomicBool>,
    delaying: std::sync::Arc<tokio::sync::Notify>,
}

impl DelayingProxy {
    /// Holds back the chunk that runs `script` (a file of `lua/`, by its source).
    async fn start(redis_port: u16, delay: Duration, script: &str) -> Self {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicBool, Ordering};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let armed = Arc::new(AtomicBool::new(false));
        let delaying = Arc::new(tokio::sync::Notify::new());
        let sha = redis::Script::new(script).get_hash().to_owned();
        let (armed2, delaying2) = (armed.clone(), delaying.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(("127.0.0.1", redis_port)).await else {
                    continue;
                };
                let (mut cr, mut cw) = client.into_split();
                let (mut sr, mut sw) = server.into_split();
                let (armed, delaying, sha) = (armed2.clone(), delaying2.clone(), sha.clone());
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 64 * 1024];
                    loop {
                        let n = match cr.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        let chunk = &buf[..n];
                        let hit = chunk.windows(sha.len()).any(|w| w == sha.as_bytes());
                        if hit && armed.swap(false, Ordering::SeqCst) {
                            delaying.notify_one();
                            tokio::time::sleep(delay).await;
                        }
                        if sw.write_all(chunk).await.is_err() {
                            return;
                        }
                    }
                });
                tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut sr, &mut cw).await;
                });
            }
        });
        Self {
            port,
            armed,
            delaying,
        }
    }

    /// Arms the delay; the future is ready once a call of the script is being held back.
    async fn hold_next_call(&self) -> impl std::future::Future<Output = ()> + '_ {
        self.armed.store(true, std::sync::atomic::Ordering::SeqCst);
        self.delaying.notified()
    }
}

/// app1's sale takes the lock; its stock read is delayed 600 ms on the wire. Meanwhile the
/// admin resets the stock through app2: the reset deleted the lock (now it leaves a leased
/// lock alone and gives `setnx`'s lease-less one a lease) and bumps the lock-free
/// write count, but app1's sale has not read yet, so the count it will read is the new one.
/// A second buyer (app2, same strategy) takes the free lock and reads 10; app1's read
/// arrives and also reads 10; both write 9. The fix for issue 8 (the lock-free count
/// checked by the write) protects only the sales that read before the reset; every unfenced
/// lock strategy loses an update here, `fenced` refuses the late reader (the control).
#[tokio::test(flavor = "multi_thread")]
async fn attack_a_reset_between_a_sales_acquire_and_its_read_takes_its_lock_silently() {
    let redis = RedisServer::start().await;
    let proxy = DelayingProxy::start(
        redis.port(),
        Duration::from_millis(600),
        include_str!("../../lua/read_stock.lua"),
    )
    .await;
    let app1 = InstanceBuilder::new(&redis, "app1")
        .env("REDIS_URL", format!("redis://127.0.0.1:{}", proxy.port))
        .start()
        .await;
    let app2 = InstanceBuilder::new(&redis, "app2").start().await;
    let lock = lock_key();
    let mut broken = Vec::new();
    for strategy in [
        // `setnx` too: a reset used to delete its lease-less lock, a live holder's included.
        "setnx",
        "lua-release",
        "owner-check",
        "setnx-ttl",
        "reentrant",
        "watchdog",
        "fenced",
    ] {
        app2.reset(10).await;
        // Warm: app1's connections are up and its scripts loaded.
        assert_eq!(app1.sale("strategy=atomic").await.status, 200);
        app2.reset(10).await;
        let held = proxy.hold_next_call().await;
        let query_a = format!("strategy={strategy}");
        let a = app1.sale(&query_a);
        let rest = async {
            held.await;
            app2.reset(10).await;
            let query_c = format!("strategy={strategy}&work_ms=1200");
            let c = app2.sale(&query_c);
            let watch = async {
                cluster_wait(&redis, &lock).await;
            };
            let (c, ()) = tokio::join!(c, watch);
            c
        };
        let (a, c) = tokio::join!(a, rest);
        let audit = app2.audit().await;
        let sold = [&a, &c].iter().filter(|r| r.status == 200).count() as i64;
        if audit["clean"] != true || audit["sales"].as_i64() != Some(sold) {
            broken.push(format!(
                "{strategy}: a={} {} | c={} {} | audit {audit}",
                a.status, a.body, c.status, c.body
            ));
        }
    }
    assert!(
        broken.is_empty(),
        "a reset between a sale's acquire and its read took its lock without telling it; \
         two sales wrote the same stock:\n{}",
        broken.join("\n")
    );
}

async fn cluster_wait(redis: &RedisServer, lock: &str) {
    redis
        .wait_for_key(lock, true, Duration::from_secs(5))
        .await
        .expect("the second buyer never took the lock");
}

/// A fenced holder's write leaves inside its lease and is held on the wire for 700 ms; its
/// lease runs out meanwhile, and a sale of the same kind of lock without a token takes the
/// lock and reads. The late write lands between that read and that sale's own write: the
/// token is still the newest (the taker drew none) and nothing was written since the fenced
/// read, so before the taker's read was counted the late write landed, the taker wrote the
/// same stock over it, and one unit was sold twice with two 200s. Found from outside, 20 of
/// 20 runs; `fenced` beside `fenced` (the control) was always refused.
#[tokio::test(flavor = "multi_thread")]
async fn attack_a_fenced_write_held_on_the_wire_never_lands_under_a_tokenless_taker_of_its_kind() {
    let redis = RedisServer::start().await;
    let proxy = DelayingProxy::start(
        redis.port(),
        Duration::from_millis(700),
        include_str!("../../lua/sell.lua"),
    )
    .await;
    let lease = |b: InstanceBuilder| b.env("LOCK_TTL_MS", 600).env("REDIS_TIMEOUT_MS", 1500);
    let app1 = lease(InstanceBuilder::new(&redis, "app1"))
        .env("REDIS_URL", format!("redis://127.0.0.1:{}", proxy.port))
        .start()
        .await;
    let app2 = lease(InstanceBuilder::new(&redis, "app2")).start().await;
    let mut broken = Vec::new();
    // The quorum kind's pair (`redlock-fenced`, `redlock`) is the same check in `sell.lua`;
    // `tests/it/lua.rs` covers it, since its lock lives on nodes this proxy does not hold.
    for (fenced, taker) in [("fenced", "watchdog"), ("fenced", "lua-release")] {
        app2.reset(10).await;
        // Warm: app1's connections are up and its scripts loaded.
        assert_eq!(app1.sale("strategy=atomic").await.status, 200);
        app2.reset(10).await;
        let held = proxy.hold_next_call().await;
        let (query_a, query_b) = (
            format!("strategy={fenced}&work_ms=300"),
            format!("strategy={taker}&work_ms=600"),
        );
        let a = app1.sale(&query_a);
        let b = async {
            held.await;
            app2.sale(&query_b).await
        };
        let (a, b) = tokio::join!(a, b);
        let audit = app2.audit().await;
        let sold = [&a, &b].iter().filter(|r| r.status == 200).count() as i64;
        if audit["clean"] != true || audit["sales"].as_i64() != Some(sold) || a.status == 200 {
            broken.push(format!(
                "{fenced} then {taker}: a={} {} | b={} {} | audit {audit}",
                a.status, a.body, b.status, b.body
            ));
        }
        assert_eq!(b.status, 200, "{taker}: {}", b.body);
    }
    assert!(
        broken.is_empty(),
        "a late fenced write landed after its lock was taken:\n{}",
        broken.join("\n")
    );
}

/// A `setnx` holder whose sale outlasts `LOCK_TTL_MS` (work past it, as a short lease and the
/// default `MAX_WORK_MS` allow), with a reset between its acquire and its read: the lease the
/// reset gives its lock outlasts the sale, so the next buyer waits for its release. With a
/// lease of `LOCK_TTL_MS` the next buyer took the lock mid-sale, and both sold one unit (4 of
/// 4, from outside).
#[tokio::test(flavor = "multi_thread")]
async fn attack_a_setnx_holder_working_past_the_ttl_keeps_its_lock_across_a_reset() {
    let redis = RedisServer::start().await;
    let proxy = DelayingProxy::start(
        redis.port(),
        Duration::from_millis(300),
        include_str!("../../lua/read_stock.lua"),
    )
    .await;
    let short = |b: InstanceBuilder| b.env("LOCK_TTL_MS", 1000).env("MAX_WORK_MS", 2000);
    let app1 = short(
        InstanceBuilder::new(&redis, "app1")
            .env("REDIS_URL", format!("redis://127.0.0.1:{}", proxy.port)),
    )
    .start()
    .await;
    let app2 = short(InstanceBuilder::new(&redis, "app2")).start().await;
    app2.reset(10).await;
    assert_eq!(app1.sale("strategy=atomic").await.status, 200, "warm");
    app2.reset(10).await;
    let held = proxy.hold_next_call().await;
    let a = app1.sale("strategy=setnx&work_ms=1500");
    let rest = async {
        held.await;
        // Between a's acquire and its read: the reset it will read after.
        app2.reset(10).await;
        app2.sale("strategy=setnx&work_ms=300").await
    };
    let (a, b) = tokio::join!(a, rest);
    let audit = app2.audit().await;
    let sold = [&a, &b].iter().filter(|r| r.status == 200).count() as i64;
    assert_eq!(
        (audit["clean"].as_bool(), audit["sales"].as_i64()),
        (Some(true), Some(sold)),
        "a={} {} | b={} {} | audit {audit}",
        a.status,
        a.body,
        b.status,
        b.body
    );
    assert_eq!(
        (a.status, b.status),
        (200, 200),
        "both sell, one after the other"
    );
}

/// A client that sends `Expect: 100-continue` with a length over the limit waits for the
/// go-ahead before it sends: it gets its 413 at once, not `100 Continue` (an invitation to
/// send what will be refused) and then the 413 at the header timeout, 10 s later.
#[tokio::test(flavor = "multi_thread")]
async fn attack_an_oversized_body_behind_expect_100_continue_is_refused_at_once() {
    let cluster = Cluster::start(1, |b| b).await;
    let app = &cluster.instances[0];
    app.reset(5).await;
    for path in ["/inventory/sale?strategy=fenced", "/inventory"] {
        let method = if path == "/inventory" { "PUT" } else { "POST" };
        let request = format!(
            "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
             Content-Length: 20000\r\nExpect: 100-continue\r\n\r\n"
        );
        let started = std::time::Instant::now();
        let (status, head, body) = raw(app.port, request.as_bytes(), Duration::from_secs(3)).await;
        assert_eq!(status, 413, "{method} {path}: {head}\n{body}");
        assert!(!head.contains("100 Continue"), "{method} {path}: {head}");
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{method} {path}: {:?}",
            started.elapsed()
        );
    }
    assert_eq!(app.audit().await["sales"], 0);
}

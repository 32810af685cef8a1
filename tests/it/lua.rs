//! Each script of `lua/` against a real Redis: what it does for its owner, and that it does
//! nothing for anyone else.

use inventory::store::{Keys, scripts};
use redis::AsyncCommands;
use redis::aio::MultiplexedConnection;

use crate::harness::RedisServer;

const TTL_MS: u64 = 5_000;

async fn setup() -> (RedisServer, MultiplexedConnection, Keys) {
    let redis = RedisServer::start().await;
    let conn = redis.conn().await;
    (redis, conn, Keys::new("001"))
}

async fn lock_reentrant(c: &mut MultiplexedConnection, k: &Keys, owner: &str) -> (i64, i64) {
    scripts::LOCK_REENTRANT
        .key(&k.lock)
        .arg(owner)
        .arg(TTL_MS)
        .invoke_async(c)
        .await
        .unwrap()
}

async fn unlock_reentrant(c: &mut MultiplexedConnection, k: &Keys, owner: &str) -> i64 {
    scripts::UNLOCK_REENTRANT
        .key(&k.lock)
        .arg(owner)
        .arg(TTL_MS)
        .arg(&k.released)
        .invoke_async(c)
        .await
        .unwrap()
}

async fn renew(c: &mut MultiplexedConnection, k: &Keys, owner: &str) -> i64 {
    scripts::RENEW
        .key(&k.lock)
        .arg(owner)
        .arg(TTL_MS)
        .invoke_async(c)
        .await
        .unwrap()
}

async fn pttl(c: &mut MultiplexedConnection, key: &str) -> i64 {
    c.pttl(key).await.unwrap()
}

#[tokio::test]
async fn reentrant_lock_counts_up_and_down_and_only_the_last_exit_deletes_it() {
    let (_redis, mut c, k) = setup().await;

    assert_eq!(lock_reentrant(&mut c, &k, "a").await, (1, 0));
    assert_eq!(lock_reentrant(&mut c, &k, "a").await, (1, 0));
    let count: i64 = c.hget(&k.lock, "a").await.unwrap();
    assert_eq!(count, 2);
    let ttl = pttl(&mut c, &k.lock).await;
    assert!(ttl > 0 && ttl <= TTL_MS as i64, "lease not set: {ttl}");

    assert_eq!(
        unlock_reentrant(&mut c, &k, "a").await,
        0,
        "one level remains"
    );
    let count: i64 = c.hget(&k.lock, "a").await.unwrap();
    assert_eq!(count, 1);
    assert!(
        pttl(&mut c, &k.lock).await > 0,
        "the remaining level keeps its lease"
    );

    assert_eq!(
        unlock_reentrant(&mut c, &k, "a").await,
        1,
        "last level deletes"
    );
    let exists: bool = c.exists(&k.lock).await.unwrap();
    assert!(!exists);
}

#[tokio::test]
async fn a_held_reentrant_lock_refuses_others_and_reports_its_lease() {
    let (_redis, mut c, k) = setup().await;
    lock_reentrant(&mut c, &k, "a").await;

    let (acquired, ttl) = lock_reentrant(&mut c, &k, "b").await;
    assert_eq!(acquired, 0);
    assert!(
        ttl > 0 && ttl <= TTL_MS as i64,
        "busy reply carries the lease: {ttl}"
    );
}

#[tokio::test]
async fn a_non_owner_can_neither_release_nor_renew() {
    let (_redis, mut c, k) = setup().await;
    lock_reentrant(&mut c, &k, "a").await;
    let _: () = c.pexpire(&k.lock, 1_000).await.unwrap();

    assert_eq!(unlock_reentrant(&mut c, &k, "b").await, -1);
    assert_eq!(renew(&mut c, &k, "b").await, 0);
    let count: i64 = c.hget(&k.lock, "a").await.unwrap();
    assert_eq!(count, 1, "the owner's hold is untouched");
    assert!(
        pttl(&mut c, &k.lock).await <= 1_000,
        "a non-owner's renewal must not extend it"
    );

    // The string lock of lua-release: compare-and-delete refuses a stranger too.
    let _: () = redis::cmd("SET")
        .arg("plain")
        .arg("a")
        .query_async(&mut c)
        .await
        .unwrap();
    let deleted: i64 = scripts::UNLOCK_OWNED
        .key("plain")
        .arg("b")
        .arg(&k.released)
        .invoke_async(&mut c)
        .await
        .unwrap();
    assert_eq!(deleted, 0);
    let holder: String = c.get("plain").await.unwrap();
    assert_eq!(holder, "a");
    let deleted: i64 = scripts::UNLOCK_OWNED
        .key("plain")
        .arg("a")
        .arg(&k.released)
        .invoke_async(&mut c)
        .await
        .unwrap();
    assert_eq!(deleted, 1);
}

#[tokio::test]
async fn renewal_extends_the_owners_lease_but_never_resurrects_a_lost_lock() {
    let (_redis, mut c, k) = setup().await;
    lock_reentrant(&mut c, &k, "a").await;
    let _: () = c.pexpire(&k.lock, 200).await.unwrap();

    assert_eq!(renew(&mut c, &k, "a").await, 1);
    assert!(
        pttl(&mut c, &k.lock).await > 1_000,
        "renewal restores the full lease"
    );

    let _: () = c.del(&k.lock).await.unwrap();
    assert_eq!(renew(&mut c, &k, "a").await, 0);
    let exists: bool = c.exists(&k.lock).await.unwrap();
    assert!(!exists, "renewing a lost lock must not create it again");
}

#[tokio::test]
async fn releasing_the_last_level_announces_it_on_the_release_channel() {
    let (redis, mut c, k) = setup().await;
    let mut pubsub = redis::Client::open(redis.url())
        .unwrap()
        .get_async_pubsub()
        .await
        .unwrap();
    pubsub.subscribe(&k.released).await.unwrap();
    lock_reentrant(&mut c, &k, "a").await;
    unlock_reentrant(&mut c, &k, "a").await;

    use futures_util::StreamExt;
    let message = tokio::time::timeout(
        std::time::Duration::from_secs(2),
        pubsub.on_message().next(),
    )
    .await
    .expect("no release announced")
    .unwrap();
    assert_eq!(message.get_payload::<String>().unwrap(), "a");
}

#[tokio::test]
async fn each_fenced_acquisition_draws_a_larger_token_and_reentry_keeps_it() {
    let (_redis, mut c, k) = setup().await;
    let conn = c.clone();
    let lock = |owner: &'static str| {
        let k = k.clone();
        let mut c = conn.clone();
        async move {
            scripts::LOCK_FENCED
                .key(&k.lock)
                .key(&k.fence)
                .arg(owner)
                .arg(TTL_MS)
                .invoke_async::<(i64, i64)>(&mut c)
                .await
                .unwrap()
        }
    };
    let (ok, first) = lock("a").await;
    assert_eq!(ok, 1);
    assert_eq!(
        lock("a").await,
        (1, first),
        "re-entry keeps the holding's token"
    );
    assert_eq!(lock("b").await.0, 0, "held by a");

    unlock_reentrant(&mut c, &k, "a").await;
    unlock_reentrant(&mut c, &k, "a").await;
    let (ok, second) = lock("b").await;
    assert_eq!(ok, 1);
    assert!(second > first, "{second} after {first}");
    assert!(pttl(&mut c, &k.lock).await > 0, "lease set");
}

async fn record_sale(
    c: &mut MultiplexedConnection,
    k: &Keys,
    stock: i64,
    fence: &str,
) -> (i64, i64) {
    scripts::RECORD_SALE
        .key(&k.stock)
        .key(&k.ledger)
        .key(&k.sold_at)
        .key(&k.fence_seen)
        .key(k.idempotency("unused"))
        .arg(stock)
        .arg("order")
        .arg("app1")
        .arg("fenced")
        .arg(fence)
        .arg("")
        .arg(0)
        .invoke_async(c)
        .await
        .unwrap()
}

#[tokio::test]
async fn the_fenced_write_refuses_a_token_older_than_the_newest_seen() {
    let (_redis, mut c, k) = setup().await;
    let _: () = c.set(&k.stock, 10).await.unwrap();

    assert_eq!(record_sale(&mut c, &k, 9, "7").await, (1, 9));
    assert_eq!(
        record_sale(&mut c, &k, 8, "6").await,
        (0, 7),
        "token 6 after 7 is stale"
    );
    let stock: i64 = c.get(&k.stock).await.unwrap();
    assert_eq!(stock, 9, "the refused write changed nothing");
    let sales: i64 = c.llen(&k.ledger).await.unwrap();
    assert_eq!(sales, 1, "the refused write recorded nothing");

    // A newer holder's read registers its token, so the older holder's later write fails
    // even though no newer write has happened yet.
    let read: (i64, i64) = scripts::READ_FENCED
        .key(&k.stock)
        .key(&k.fence_seen)
        .arg(8)
        .invoke_async(&mut c)
        .await
        .unwrap();
    assert_eq!(read, (1, 9));
    assert_eq!(record_sale(&mut c, &k, 8, "7").await, (0, 8));
    let stale_read: (i64, i64) = scripts::READ_FENCED
        .key(&k.stock)
        .key(&k.fence_seen)
        .arg(7)
        .invoke_async(&mut c)
        .await
        .unwrap();
    assert_eq!(stale_read, (0, 8));
}

#[tokio::test]
async fn an_unfenced_write_records_the_sale_with_the_stock_it_left() {
    let (_redis, mut c, k) = setup().await;
    assert_eq!(record_sale(&mut c, &k, 4, "").await, (1, 4));
    assert_eq!(record_sale(&mut c, &k, 4, "").await, (1, 4));
    let twice: i64 = c.hget(&k.sold_at, 4).await.unwrap();
    assert_eq!(twice, 2, "the same remaining value sold twice is counted");
    let entry: String = c.lindex(&k.ledger, 0).await.unwrap();
    let entry: serde_json::Value = serde_json::from_str(&entry).unwrap();
    assert_eq!(entry["remaining"], 4);
    assert_eq!(entry["instance"], "app1");
}

#[tokio::test]
async fn the_atomic_sale_stops_at_zero() {
    let (_redis, mut c, k) = setup().await;
    let _: () = c.set(&k.stock, 2).await.unwrap();
    let mut left = Vec::new();
    for _ in 0..4 {
        let remaining: i64 = scripts::ATOMIC_SALE
            .key(&k.stock)
            .key(&k.ledger)
            .key(&k.sold_at)
            .key(k.idempotency("unused"))
            .arg("order")
            .arg("app1")
            .arg("atomic")
            .arg("")
            .arg(0)
            .invoke_async(&mut c)
            .await
            .unwrap();
        left.push(remaining);
    }
    assert_eq!(left, [1, 0, -1, -1]);
    let sales: i64 = c.llen(&k.ledger).await.unwrap();
    assert_eq!(sales, 2);
}

#[tokio::test]
async fn reset_clears_ledger_fencing_and_lock() {
    let (_redis, mut c, k) = setup().await;
    lock_reentrant(&mut c, &k, "a").await;
    record_sale(&mut c, &k, 3, "5").await;
    let _: () = c.set(&k.fence, 5).await.unwrap();

    let stock: i64 = scripts::RESET
        .key(&k.stock)
        .key(&k.initial)
        .key(&k.ledger)
        .key(&k.sold_at)
        .key(&k.fence)
        .key(&k.fence_seen)
        .key(&k.lock)
        .arg(100)
        .arg(&k.released)
        .invoke_async(&mut c)
        .await
        .unwrap();
    assert_eq!(stock, 100);
    let initial: i64 = c.get(&k.initial).await.unwrap();
    assert_eq!(initial, 100);
    for key in [&k.ledger, &k.sold_at, &k.fence, &k.fence_seen, &k.lock] {
        let exists: bool = c.exists(key).await.unwrap();
        assert!(!exists, "{key} survived the reset");
    }
}

#[tokio::test]
async fn a_write_under_an_idempotency_claim_lands_once_and_replaces_the_claim_with_the_sale() {
    let (_redis, mut c, k) = setup().await;
    let _: () = c.set(&k.stock, 5).await.unwrap();
    let key = k.idempotency("retry-1");
    let conn = c.clone();
    let sell = |marker: &'static str| {
        let (k, key, mut c) = (k.clone(), key.clone(), conn.clone());
        async move {
            scripts::ATOMIC_SALE
                .key(&k.stock)
                .key(&k.ledger)
                .key(&k.sold_at)
                .key(&key)
                .arg("o-1")
                .arg("app1")
                .arg("atomic")
                .arg(marker)
                .arg(60_000)
                .invoke_async::<i64>(&mut c)
                .await
                .unwrap()
        }
    };

    assert_eq!(sell("pending:o-1").await, -2, "no claim, no sale");
    let _: () = c.set(&key, "pending:o-1").await.unwrap();
    assert_eq!(
        sell("pending:o-2").await,
        -2,
        "someone else's claim, no sale"
    );
    assert_eq!(sell("pending:o-1").await, 4);
    let kept: String = c.get(&key).await.unwrap();
    assert!(
        kept.starts_with("sold:") && kept.contains("\"order_id\":\"o-1\""),
        "{kept}"
    );
    assert!(
        pttl(&mut c, &key).await > 50_000,
        "kept for the configured time"
    );
    assert_eq!(
        sell("pending:o-1").await,
        -2,
        "the claim is spent: a replay cannot sell again"
    );
    let sales: i64 = c.llen(&k.ledger).await.unwrap();
    assert_eq!(sales, 1);
}

#[tokio::test]
async fn settling_a_claim_needs_the_claim() {
    let (_redis, mut c, k) = setup().await;
    let key = k.idempotency("retry-2");
    let _: () = c.set(&key, "pending:o-1").await.unwrap();
    let conn = c.clone();
    let settle = |marker: &'static str, outcome: &'static str| {
        let (key, mut c) = (key.clone(), conn.clone());
        async move {
            scripts::IDEMPOTENCY_SETTLE
                .key(&key)
                .arg(marker)
                .arg(outcome)
                .arg(60_000)
                .invoke_async::<i64>(&mut c)
                .await
                .unwrap()
        }
    };
    assert_eq!(settle("pending:o-2", "").await, 0);
    assert_eq!(settle("pending:o-1", "sold_out").await, 1);
    let kept: String = c.get(&key).await.unwrap();
    assert_eq!(kept, "sold_out");
    assert_eq!(settle("pending:o-1", "").await, 0, "settled once");
}

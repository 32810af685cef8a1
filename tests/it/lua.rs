//! Each script of `lua/` against a real Redis: what it does for its owner, and that it does
//! nothing for anyone else.

use std::sync::Arc;
use std::time::Duration;

use inventory::idempotency::{Claim, Next, Prior};
use inventory::metrics::Metrics;
use inventory::store::{Entry, Keys, LockKind, Recorded, StockRead, Store, WritesSeen, scripts};
use redis::AsyncCommands;
use redis::aio::MultiplexedConnection;
use testkit::fixture::RedisServer;

const TTL_MS: u64 = 5_000;
/// The lease a reset gives a lock that has none (an instance passes its `LOCK_TTL_MS`).
const LEASE: Duration = Duration::from_millis(TTL_MS);

async fn setup() -> (RedisServer, MultiplexedConnection, Keys) {
    let redis = RedisServer::start().await;
    let conn = redis.conn().await;
    (redis, conn, Keys::new("001"))
}

async fn lock_reentrant(c: &mut MultiplexedConnection, k: &Keys, owner: &str) -> (i64, i64) {
    scripts::lock_reentrant(&k.lock, owner, TTL_MS)
        .invoke_async(c)
        .await
        .unwrap()
}

async fn unlock_reentrant(c: &mut MultiplexedConnection, k: &Keys, owner: &str) -> i64 {
    scripts::unlock_reentrant(k, owner, TTL_MS, 0)
        .invoke_async(c)
        .await
        .unwrap()
}

async fn renew(c: &mut MultiplexedConnection, k: &Keys, owner: &str) -> i64 {
    scripts::renew(&k.lock, owner, TTL_MS)
        .invoke_async(c)
        .await
        .unwrap()
}

async fn lock_fenced(c: &mut MultiplexedConnection, k: &Keys, owner: &str) -> (i64, i64) {
    scripts::lock_fenced(k, owner, TTL_MS, 0)
        .invoke_async(c)
        .await
        .unwrap()
}

async fn unlock_owned(c: &mut MultiplexedConnection, k: &Keys, owner: &str) -> i64 {
    scripts::unlock_owned(&k.lock, k, owner, 0)
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
    let deleted: i64 = scripts::unlock_owned("plain", &k, "b", 0)
        .invoke_async(&mut c)
        .await
        .unwrap();
    assert_eq!(deleted, 0);
    let holder: String = c.get("plain").await.unwrap();
    assert_eq!(holder, "a");
    let deleted: i64 = scripts::unlock_owned("plain", &k, "a", 0)
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
        let (k, mut c) = (k.clone(), conn.clone());
        async move { lock_fenced(&mut c, &k, owner).await }
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

fn store(redis: &RedisServer) -> Store {
    Store::new(
        &redis.url(),
        "001",
        Duration::from_secs(2),
        Arc::new(Metrics::default()),
    )
    .unwrap()
}

fn entry<'a>(claim: Option<&'a Claim>) -> Entry<'a> {
    Entry {
        order_id: "o-1",
        instance: "app1",
        strategy: "fenced",
        claim,
    }
}

#[tokio::test]
async fn the_fenced_write_refuses_a_token_older_than_the_newest_seen() {
    let (redis, mut c, k) = setup().await;
    let store = store(&redis);
    store.reset(10, LEASE).await.unwrap();
    let lockfree = read(&store, Some(7)).await.1;

    let write = |stock, fence| {
        let store = store.clone();
        async move {
            store
                .record_sale(stock, &entry(None), Some(fence), lockfree)
                .await
                .unwrap()
        }
    };
    assert_eq!(write(9, 7).await, Recorded::Written(9));
    assert_eq!(
        write(8, 6).await,
        Recorded::StaleFence { newest: 7 },
        "token 6 after 7 is stale"
    );
    let stock: i64 = c.get(&k.stock).await.unwrap();
    assert_eq!(stock, 9, "the refused write changed nothing");
    assert_eq!(
        store.ledger().await.unwrap().len(),
        1,
        "and recorded nothing"
    );

    // A newer holder's read registers its token, so the older holder's later write fails
    // even though no newer write has happened yet.
    assert_eq!(read(&store, Some(8)).await.0, Some(9));
    assert_eq!(write(8, 7).await, Recorded::StaleFence { newest: 8 });
    assert_eq!(
        store
            .read_for_sale(LockKind::SingleNode, Some(7))
            .await
            .unwrap(),
        StockRead::Stale { newest: 8 }
    );

    // A reader of the other kind of lock whose token is older than one a quorum reader
    // registered would write after it, and the ledger's tokens would go backwards: refused,
    // and nothing is registered for it. A newer one of its kind reads as before.
    assert!(matches!(
        store
            .read_for_sale(LockKind::Quorum, Some(20))
            .await
            .unwrap(),
        StockRead::Current { .. }
    ));
    assert_eq!(
        store
            .read_for_sale(LockKind::SingleNode, Some(15))
            .await
            .unwrap(),
        StockRead::Overtaken
    );
    assert_eq!(read(&store, Some(21)).await.0, Some(9));
}

/// What a locked sale under a single-node lock reads: the stock, and what its write hands
/// back (the writes its lock does not exclude).
async fn read(store: &Store, fence: Option<u64>) -> (Option<i64>, WritesSeen) {
    read_as(store, LockKind::SingleNode, fence).await
}

async fn read_as(store: &Store, kind: LockKind, fence: Option<u64>) -> (Option<i64>, WritesSeen) {
    match store.read_for_sale(kind, fence).await.unwrap() {
        StockRead::Current { stock, seen } => (stock, seen),
        StockRead::Stale { newest } => panic!("stale: {newest}"),
        StockRead::Overtaken => panic!("overtaken by the other kind of lock"),
    }
}

#[tokio::test]
async fn an_unfenced_write_records_the_sale_and_counts_a_value_sold_twice() {
    let (redis, _c, _k) = setup().await;
    let store = store(&redis);
    store.reset(5, LEASE).await.unwrap();
    let (_, lockfree) = read(&store, None).await;
    for _ in 0..3 {
        let written = store.record_sale(4, &entry(None), None, lockfree).await;
        assert_eq!(written.unwrap(), Recorded::Written(4));
    }
    let audit = store.audit().await.unwrap().unwrap();
    assert_eq!((audit.sales, audit.remaining), (3, 4));
    assert_eq!(audit.duplicates.len(), 1);
    assert_eq!(
        (audit.duplicates[0].remaining, audit.duplicates[0].times),
        (4, 3)
    );
    assert_eq!((audit.oversold, audit.lost_updates), (0, 2));
    let ledger = store.ledger().await.unwrap();
    let first: serde_json::Value = serde_json::from_str(&ledger[0]).unwrap();
    assert_eq!(
        (first["remaining"].as_i64(), first["instance"].as_str()),
        (Some(4), Some("app1"))
    );
}

#[tokio::test]
async fn every_ledger_entry_is_json_whatever_the_instance_is_called() {
    let (redis, _c, _k) = setup().await;
    let store = store(&redis);
    store.reset(1_000_000, LEASE).await.unwrap();
    let awkward = "app \"1\" \\ é\u{7}";
    let entry = Entry {
        order_id: "o-\"2",
        instance: awkward,
        strategy: "fenced",
        claim: None,
    };
    assert_eq!(
        store.atomic_sale(&entry).await.unwrap(),
        Recorded::Written(999_999)
    );
    let seen = read(&store, Some(123_456_789_012)).await.1;
    assert_eq!(
        store
            .record_sale(999_998, &entry, Some(123_456_789_012), seen)
            .await
            .unwrap(),
        Recorded::Written(999_998)
    );
    let ledger: Vec<serde_json::Value> = store
        .ledger()
        .await
        .unwrap()
        .iter()
        .map(|e| serde_json::from_str(e).unwrap_or_else(|err| panic!("{e}: {err}")))
        .collect();
    assert_eq!(
        ledger,
        [
            serde_json::json!({"order_id": "o-\"2", "instance": awkward, "strategy": "fenced",
                "remaining": 999_999}),
            serde_json::json!({"order_id": "o-\"2", "instance": awkward, "strategy": "fenced",
                "remaining": 999_998, "fence": 123_456_789_012_u64}),
        ],
        "strings kept as sent, numbers as numbers, no fence where there is none"
    );
}

#[tokio::test]
async fn the_atomic_sale_stops_at_zero() {
    let (redis, _c, _k) = setup().await;
    let store = store(&redis);
    store.reset(2, LEASE).await.unwrap();
    let mut left = Vec::new();
    for _ in 0..4 {
        left.push(store.atomic_sale(&entry(None)).await.unwrap());
    }
    use Recorded::*;
    assert_eq!(left, [Written(1), Written(0), SoldOut, SoldOut]);
    assert_eq!(store.audit().await.unwrap().unwrap().sales, 2);
}

/// Several atomic sales in one call (`store/batch.rs`): sold in order while stock lasts,
/// each with its own ledger entry and audit bit, so a value a stale locked writer had
/// already sold is still counted twice.
#[tokio::test]
async fn one_atomic_call_sells_its_sales_in_order_while_stock_lasts_and_audits_each() {
    use Recorded::*;
    let (redis, mut c, k) = setup().await;
    let store = store(&redis);
    store.reset(5, LEASE).await.unwrap();
    // Two holders of an unsafe lock read 5; one writes 4, a third sale 3, and the stale
    // one writes 4 again: the stock is back up to 4, and 4 was sold twice.
    let (_, stale) = read(&store, None).await;
    let (_, seen) = read(&store, None).await;
    assert_eq!(
        store
            .record_sale(4, &entry(None), None, seen)
            .await
            .unwrap(),
        Written(4)
    );
    let (_, seen) = read(&store, None).await;
    assert_eq!(
        store
            .record_sale(3, &entry(None), None, seen)
            .await
            .unwrap(),
        Written(3)
    );
    assert_eq!(
        store
            .record_sale(4, &entry(None), None, stale)
            .await
            .unwrap(),
        Written(4)
    );

    let heads: Vec<String> = (1..=6)
        .map(|i| format!(r#"{{"order_id":"b-{i}","instance":"app1","strategy":"atomic""#))
        .collect();
    let reply: (i64, i64) = scripts::sell_atomic(&k, heads.join("\n"), 100)
        .invoke_async(&mut c)
        .await
        .unwrap();
    let first = Recorded::from_reply(reply.0, reply.1);
    let each: Vec<Recorded> = (0..6).map(|i| first.nth(i)).collect();
    assert_eq!(
        each,
        [
            Written(3),
            Written(2),
            Written(1),
            Written(0),
            SoldOut,
            SoldOut
        ]
    );

    let ledger: Vec<serde_json::Value> = store
        .ledger()
        .await
        .unwrap()
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let batch: Vec<(&str, i64)> = ledger[3..]
        .iter()
        .map(|e| {
            (
                e["order_id"].as_str().unwrap(),
                e["remaining"].as_i64().unwrap(),
            )
        })
        .collect();
    assert_eq!(batch, [("b-1", 3), ("b-2", 2), ("b-3", 1), ("b-4", 0)]);
    let audit = store.audit().await.unwrap().unwrap();
    assert_eq!((audit.sales, audit.remaining, audit.oversold), (7, 0, 2));
    let mut twice: Vec<(i64, i64)> = audit
        .duplicates
        .iter()
        .map(|d| (d.remaining, d.times))
        .collect();
    twice.sort_unstable();
    assert_eq!(twice, [(3, 2), (4, 2)]);
    // Nothing left: the next call sells none of its sales.
    let again: (i64, i64) = scripts::sell_atomic(&k, heads[..2].join("\n"), 100)
        .invoke_async(&mut c)
        .await
        .unwrap();
    assert_eq!(Recorded::from_reply(again.0, again.1), SoldOut);
}

/// A fenced write refuses to land once a holder of its kind of lock without a token has
/// read since the fenced read: that holder took the lock after the fenced one's lease ran
/// out (it moves no token) and will write what it read over the late write. A token-less
/// read from before the fenced read changes nothing. Both kinds of lock.
#[tokio::test]
async fn a_fenced_write_is_refused_once_a_tokenless_holder_of_its_kind_has_read_since() {
    use Recorded::*;
    let (redis, _c, _k) = setup().await;
    let store = store(&redis);
    for (kind, token) in [(LockKind::SingleNode, 100), (LockKind::Quorum, 200)] {
        store.reset(10, LEASE).await.unwrap();
        read_as(&store, kind, None).await;
        let (_, fenced) = read_as(&store, kind, Some(token)).await;
        assert_eq!(
            store
                .record_sale(9, &entry(None), Some(token), fenced)
                .await
                .unwrap(),
            Written(9),
            "{kind:?}: a token-less read before the fenced one is no taker"
        );
        let (_, fenced) = read_as(&store, kind, Some(token + 1)).await;
        let (_, taker) = read_as(&store, kind, None).await;
        assert_eq!(
            store
                .record_sale(8, &entry(None), Some(token + 1), fenced)
                .await
                .unwrap(),
            Overtaken,
            "{kind:?}: the late fenced write landed under the taker"
        );
        assert_eq!(
            store
                .record_sale(8, &entry(None), None, taker)
                .await
                .unwrap(),
            Written(8)
        );
        let audit = store.audit().await.unwrap().unwrap();
        assert!(audit.clean, "{kind:?}: {audit:?}");
    }
}

#[tokio::test]
async fn no_write_creates_a_stock_that_is_not_there() {
    let (redis, mut c, k) = setup().await;
    let store = store(&redis);
    let (stock, seen) = read(&store, None).await;
    assert_eq!(stock, None);
    assert_eq!(
        store.atomic_sale(&entry(None)).await.unwrap(),
        Recorded::Unstocked
    );
    assert_eq!(
        store
            .record_sale(41, &entry(None), None, seen)
            .await
            .unwrap(),
        Recorded::Unstocked
    );
    let exists: bool = c.exists(&k.stock).await.unwrap();
    assert!(!exists, "a write conjured a stock");
    assert!(store.audit().await.unwrap().is_none());
    assert!(store.inventory().await.unwrap().is_none());
}

#[tokio::test]
async fn a_locked_write_never_lands_after_a_lock_free_write_it_did_not_see() {
    let (redis, mut c, k) = setup().await;
    let store = store(&redis);
    store.reset(10, LEASE).await.unwrap();
    let (stock, lockfree) = read(&store, Some(1)).await;
    assert_eq!(stock, Some(10));

    // An atomic sale lands between the locked sale's read and its write.
    assert_eq!(
        store.atomic_sale(&entry(None)).await.unwrap(),
        Recorded::Written(9)
    );
    for fence in [Some(1), None] {
        assert_eq!(
            store
                .record_sale(9, &entry(None), fence, lockfree)
                .await
                .unwrap(),
            Recorded::StockChanged
        );
    }
    // So does a reset.
    let (_, lockfree) = read(&store, None).await;
    store.reset(100, LEASE).await.unwrap();
    assert_eq!(
        store
            .record_sale(8, &entry(None), None, lockfree)
            .await
            .unwrap(),
        Recorded::StockChanged
    );
    let stock: i64 = c.get(&k.stock).await.unwrap();
    assert_eq!(stock, 100);
}

#[tokio::test]
async fn a_reset_clears_the_ledger_but_leaves_a_leased_lock_and_fencing_tokens_count_up() {
    let (redis, mut c, k) = setup().await;
    let store = store(&redis);
    store.reset(10, LEASE).await.unwrap();
    let (_, before) = lock_fenced(&mut c, &k, "a").await;
    let (_, lockfree) = read(&store, Some(before as u64)).await;
    store
        .record_sale(9, &entry(None), Some(before as u64), lockfree)
        .await
        .unwrap();

    store.reset(100, LEASE).await.unwrap();
    let initial: i64 = c.get(&k.initial).await.unwrap();
    assert_eq!(initial, 100);
    for key in [&k.ledger, &k.sales, &k.sold, &k.duplicates] {
        let exists: bool = c.exists(key).await.unwrap();
        assert!(!exists, "{key} survived the reset");
    }
    assert_eq!(
        lock_fenced(&mut c, &k, "b").await.0,
        0,
        "the reset took a leased lock from its holder"
    );
    assert_eq!(unlock_reentrant(&mut c, &k, "a").await, 1);
    let (taken, after) = lock_fenced(&mut c, &k, "b").await;
    assert_eq!(taken, 1);
    assert!(
        after > before,
        "token {after} after the reset, {before} before"
    );

    // A lock without a lease (setnx's, whose holder may be dead or may be mid-sale) gets the
    // lease the others are taken with: a live holder keeps it, a dead one's frees itself.
    let _: () = c.del(&k.lock).await.unwrap();
    let _: () = c.set(&k.lock, "crashed").await.unwrap();
    store.reset(5, LEASE).await.unwrap();
    let holder: Option<String> = c.get(&k.lock).await.unwrap();
    assert_eq!(
        holder.as_deref(),
        Some("crashed"),
        "the reset took a lease-less lock"
    );
    let pttl: i64 = c.pttl(&k.lock).await.unwrap();
    assert!(
        (1..=TTL_MS as i64).contains(&pttl),
        "a lease-less lock got no lease from the reset: {pttl}"
    );
    // A second reset leaves the lease it gave alone (it does not restart it).
    let _: () = c.pexpire(&k.lock, 50).await.unwrap();
    store.reset(5, LEASE).await.unwrap();
    let pttl: i64 = c.pttl(&k.lock).await.unwrap();
    assert!((1..=50).contains(&pttl), "{pttl}");
}

#[tokio::test]
async fn a_write_under_an_idempotency_claim_lands_once_and_replaces_the_claim_with_the_sale() {
    let (redis, mut c, k) = setup().await;
    let store = store(&redis);
    store.reset(5, LEASE).await.unwrap();
    let claim = |order: &str| Claim::new(k.idempotency("retry-1"), order, Duration::from_secs(60));
    let (mine, theirs) = (claim("o-1"), claim("o-2"));
    let sell = |claim: &Claim| {
        let (store, claim) = (store.clone(), claim.clone());
        async move { store.atomic_sale(&entry(Some(&claim))).await.unwrap() }
    };

    assert_eq!(sell(&mine).await, Recorded::ClaimLost, "no claim, no sale");
    let next = store.claim(mine.clone()).await;
    assert!(matches!(next, Ok(Next::Proceed(_))), "claimed: {next:?}");
    // The same claim sent again (a cluster call re-sent after its first send had run) finds
    // its own marker: it is this attempt's, not one "in progress" elsewhere.
    let again = store.claim(mine.clone()).await;
    assert!(
        matches!(again, Ok(Next::Proceed(_))),
        "its own claim: {again:?}"
    );
    // Another attempt's claim on the same key is one in progress.
    let other = store.claim(theirs.clone()).await;
    assert!(
        matches!(other, Ok(Next::Replay(Prior::InProgress))),
        "{other:?}"
    );
    assert_eq!(
        sell(&theirs).await,
        Recorded::ClaimLost,
        "someone else's claim, no sale"
    );
    // The marker's lease is short, and its holder extends it: only the holder's.
    let lease = pttl(&mut c, &mine.key).await;
    assert!((1..=5000).contains(&lease), "{lease}");
    let _: () = c.pexpire(&mine.key, 100).await.unwrap();
    assert_eq!(store.extend_claim(&theirs).await.ok(), Some(false));
    assert_eq!(store.extend_claim(&mine).await.ok(), Some(true));
    let lease = pttl(&mut c, &mine.key).await;
    assert!((4000..=5000).contains(&lease), "extended: {lease}");
    assert_eq!(sell(&mine).await, Recorded::Written(4));
    // The sale replaced the marker: nothing left to extend (the kept sale keeps its time).
    assert_eq!(store.extend_claim(&mine).await.ok(), Some(false));
    let kept: String = c.get(&mine.key).await.unwrap();
    assert!(
        kept.starts_with("sold:") && kept.contains("\"order_id\":\"o-1\""),
        "{kept}"
    );
    assert!(
        pttl(&mut c, &mine.key).await > 50_000,
        "kept for the configured time"
    );
    assert_eq!(
        sell(&mine).await,
        Recorded::ClaimLost,
        "the claim is spent: a replay cannot sell again"
    );
    assert_eq!(store.audit().await.unwrap().unwrap().sales, 1);
}

/// Every pair of lock shapes on the same key: a string lock (`SET NX`, the naive strategies
/// and `lua-release`) and a hash lock (`reentrant`, `watchdog`, `fenced`). A lock held in
/// the other shape is a held lock: never an error, never taken, never released or renewed
/// by the other side.
#[tokio::test]
async fn a_lock_held_in_the_other_shape_is_held_and_never_an_error() {
    let (_redis, mut c, k) = setup().await;
    // A string lock held: the hash scripts see a holder.
    let _: () = redis::cmd("SET")
        .arg(&k.lock)
        .arg("s")
        .arg("PX")
        .arg(TTL_MS)
        .query_async(&mut c)
        .await
        .unwrap();
    let (taken, lease) = lock_reentrant(&mut c, &k, "h").await;
    assert_eq!(taken, 0);
    assert!(lease > 0, "the busy reply carries the string lock's lease");
    assert_eq!(lock_fenced(&mut c, &k, "h").await.0, 0);
    assert_eq!(unlock_reentrant(&mut c, &k, "s").await, -1);
    assert_eq!(renew(&mut c, &k, "s").await, 0);
    let holder: String = c.get(&k.lock).await.unwrap();
    assert_eq!(holder, "s", "untouched");
    assert_eq!(unlock_owned(&mut c, &k, "s").await, 1);

    // A hash lock held: the string scripts see a holder.
    assert_eq!(lock_fenced(&mut c, &k, "h").await.0, 1);
    assert_eq!(unlock_owned(&mut c, &k, "h").await, 0);
    let set: Option<String> = redis::cmd("SET")
        .arg(&k.lock)
        .arg("s")
        .arg("NX")
        .query_async(&mut c)
        .await
        .unwrap();
    assert_eq!(set, None, "SET NX does not take a hash lock");
    assert_eq!(unlock_reentrant(&mut c, &k, "h").await, 1);
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
            scripts::idempotency_settle(&key, marker, outcome, 60_000)
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

#[tokio::test]
async fn the_optimistic_write_lands_only_in_an_exec_whose_watch_held_and_refuses_a_locked_write() {
    let (redis, mut c, k) = setup().await;
    let store = store(&redis);
    store.reset(10, LEASE).await.unwrap();
    // A locked sale reads first: the optimistic write must refuse its later write.
    let (_, locked_seen) = read(&store, None).await;
    let sell = store.optimistic_sell(&entry(None), 9);
    sell.load_async(&mut c).await.unwrap();

    // Its own connection: WATCH, a write by someone else, then the transaction.
    let mut own = redis.conn().await;
    let exec = |own: &mut MultiplexedConnection| {
        let mut pipe = redis::pipe();
        pipe.atomic().invoke_script(&sell);
        let own = own.clone();
        async move {
            let mut own = own;
            pipe.query_async::<Option<((i64, i64),)>>(&mut own)
                .await
                .unwrap()
        }
    };
    let () = redis::cmd("WATCH")
        .arg(&k.stock)
        .query_async(&mut own)
        .await
        .unwrap();
    let () = c.set(&k.stock, 10).await.unwrap();
    assert_eq!(exec(&mut own).await, None, "the watched stock was written");
    let ledger = store.ledger().await.unwrap();
    assert!(
        ledger.is_empty(),
        "the refused transaction recorded nothing"
    );

    let () = redis::cmd("WATCH")
        .arg(&k.stock)
        .query_async(&mut own)
        .await
        .unwrap();
    assert_eq!(exec(&mut own).await, Some(((1, 9),)));
    let stock: i64 = c.get(&k.stock).await.unwrap();
    assert_eq!(stock, 9);
    assert_eq!(store.audit().await.unwrap().unwrap().sales, 1);
    assert_eq!(
        store
            .record_sale(8, &entry(None), None, locked_seen)
            .await
            .unwrap(),
        Recorded::StockChanged,
        "a locked sale that read before the optimistic write must not overwrite it"
    );
}

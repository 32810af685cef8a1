//! `REPLICA_ACKS`: a master with one replica, real processes. The replica is frozen with
//! `SIGSTOP` so that `WAIT` runs out of time on purpose: the lock it could not replicate is
//! given back and nothing is sold; a write it could not replicate is reported as such, and a
//! retry with the same `Idempotency-Key` tells whether it survived.

use std::time::{Duration, Instant};

use inventory::store::Keys;
use redis::AsyncCommands;
use testkit::fixture::{InstanceBuilder, RedisServer};
use testkit::{SentinelProcess, SentinelTiming};

// Long enough that a live replica on a loaded test machine always acknowledges in time
// (200 ms was seen to miss); a frozen one costs each refused sale this much.
const ACK_TIMEOUT_MS: u64 = 1_000;

/// A master and a replica of it that has finished its first sync.
async fn master_and_replica() -> (RedisServer, RedisServer) {
    let master = RedisServer::start().await;
    let port = master.port().to_string();
    let replica = RedisServer::start_with(&["--replicaof", "127.0.0.1", &port]).await;
    let mut conn = master.conn().await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let info: String = redis::cmd("INFO")
            .arg("replication")
            .query_async(&mut conn)
            .await
            .unwrap();
        if info.contains("state=online") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the replica never synced:\n{info}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (master, replica)
}

async fn stock_on(redis: &RedisServer) -> Option<i64> {
    redis
        .conn()
        .await
        .get(Keys::new("001").stock)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_frozen_replica_refuses_the_acquire_with_nothing_sold_and_sales_resume_when_it_wakes() {
    let (master, replica) = master_and_replica().await;
    let acked = InstanceBuilder::new(&master, "app1")
        .env("REPLICA_ACKS", 1)
        .env("REPLICA_ACK_TIMEOUT_MS", ACK_TIMEOUT_MS)
        .start()
        .await;
    let unacked = InstanceBuilder::new(&master, "app2")
        .env("REPLICA_ACKS", 0)
        .start()
        .await;
    acked.reset(10).await;

    let sale = acked.sale("strategy=fenced").await;
    assert_eq!(
        (sale.status, sale.body["remaining"].as_i64()),
        (200, Some(9)),
        "{sale:?}"
    );
    // Sold means the replica has it too.
    assert_eq!(stock_on(&replica).await, Some(9));

    replica.signal("STOP").await;
    for strategy in ["fenced", "lua-release", "setnx-ttl"] {
        let sale = acked.sale(&format!("strategy={strategy}")).await;
        assert_eq!(
            (sale.status, sale.error_code()),
            (503, "not_replicated"),
            "{strategy}: {sale:?}"
        );
        let message = sale.body["message"].as_str().unwrap();
        assert!(message.contains("nothing was sold"), "{message}");
        assert!(
            sale.elapsed >= Duration::from_millis(ACK_TIMEOUT_MS),
            "WAIT waited for the replica: {sale:?}"
        );
    }
    assert_eq!(stock_on(&master).await, Some(9), "nothing sold");
    let lock: bool = master
        .conn()
        .await
        .exists(Keys::new("001").lock)
        .await
        .unwrap();
    assert!(!lock, "the unreplicated lock was released");
    let audit = acked.audit().await;
    assert_eq!(
        (audit["sales"].as_i64(), audit["clean"].as_bool()),
        (Some(1), Some(true))
    );

    // Without REPLICA_ACKS nothing changes: the master alone answers.
    let sale = unacked.sale("strategy=fenced").await;
    assert_eq!(
        (sale.status, sale.body["remaining"].as_i64()),
        (200, Some(8)),
        "{sale:?}"
    );

    replica.signal("CONT").await;
    let sale = acked.sale("strategy=fenced").await;
    assert_eq!(
        (sale.status, sale.body["remaining"].as_i64()),
        (200, Some(7)),
        "{sale:?}"
    );
    assert_eq!(stock_on(&replica).await, Some(7));
    assert_eq!(acked.audit().await["clean"].as_bool(), Some(true));
}

#[tokio::test(flavor = "multi_thread")]
async fn an_unreplicated_write_says_it_may_survive_and_a_retry_with_its_key_tells_which() {
    let (master, replica) = master_and_replica().await;
    let app = InstanceBuilder::new(&master, "app1")
        .env("REPLICA_ACKS", 1)
        .env("REPLICA_ACK_TIMEOUT_MS", ACK_TIMEOUT_MS)
        .start()
        .await;
    app.reset(10).await;

    // `atomic` takes no lock: its only write is the sale, so the frozen replica fails that.
    replica.signal("STOP").await;
    let sale = app.sale_with_key("strategy=atomic", "order-1").await;
    assert_eq!(
        (sale.status, sale.error_code()),
        (503, "not_replicated"),
        "{sale:?}"
    );
    let message = sale.body["message"].as_str().unwrap();
    assert!(message.contains("may or may not survive"), "{message}");
    assert!(message.contains("Idempotency-Key"), "{message}");
    assert_eq!(stock_on(&master).await, Some(9), "written on the master");

    replica.signal("CONT").await;
    // The master survived (no failover): the retry replays the sale instead of selling again.
    let retry = app.sale_with_key("strategy=atomic", "order-1").await;
    assert_eq!(
        (retry.status, retry.body["remaining"].as_i64()),
        (200, Some(9)),
        "{retry:?}"
    );
    assert_eq!(
        retry
            .headers
            .get("idempotent-replayed")
            .map(|v| v.to_str().unwrap()),
        Some("true")
    );
    assert_eq!(stock_on(&master).await, Some(9), "sold once");
    let deadline = Instant::now() + Duration::from_secs(5);
    while stock_on(&replica).await != Some(9) {
        assert!(Instant::now() < deadline, "the replica never caught up");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

const MASTER_NAME: &str = "inventory";

async fn sentinels_for(master: &RedisServer, timing: SentinelTiming) -> Vec<SentinelProcess> {
    testkit::start_sentinels(MASTER_NAME, master.port(), 1, timing)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn sales_follow_a_sentinel_failover_by_themselves_within_down_after_plus_failover_plus_2_s() {
    let (mut master, replica) = master_and_replica().await;
    let timing = SentinelTiming::default();
    let sentinels = sentinels_for(&master, timing).await;
    let list = sentinels
        .iter()
        .map(SentinelProcess::addr)
        .collect::<Vec<_>>()
        .join(",");
    // REDIS_URL still names the master: the sentinels take precedence over it.
    let app = InstanceBuilder::new(&master, "app1")
        .env("REDIS_SENTINELS", &list)
        .env("REDIS_MASTER_NAME", MASTER_NAME)
        .env("REDIS_TIMEOUT_MS", 500)
        .start()
        .await;
    app.reset(100).await;
    let sale = app.sale("strategy=fenced").await;
    assert_eq!(
        (sale.status, sale.body["remaining"].as_i64()),
        (200, Some(99)),
        "{sale:?}"
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    while stock_on(&replica).await != Some(99) {
        assert!(Instant::now() < deadline, "the replica never got the sale");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    master.stop().await;
    let killed = Instant::now();
    let bound = timing.down_after + timing.failover_timeout + Duration::from_secs(2);
    let mut refused = Vec::new();
    let sale = loop {
        let sale = app.sale("strategy=fenced").await;
        if sale.status == 200 {
            break sale;
        }
        refused.push((sale.status, sale.error_code().to_owned()));
        assert!(
            killed.elapsed() < bound,
            "no sale within {bound:?} of the master's death; answers: {refused:?}\n\
             sentinel log:\n{}\ninstance log:\n{}",
            sentinels[0].log(),
            app.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let recovered = killed.elapsed();
    // The promoted replica had the first sale: the next one sells the next item.
    assert_eq!(sale.body["remaining"].as_i64(), Some(98), "{sale:?}");
    assert!(
        refused
            .iter()
            .all(|(status, code)| *status == 503 && code == "redis_unavailable"),
        "only bounded 503s meanwhile: {refused:?}"
    );
    let role: Vec<redis::Value> = redis::cmd("ROLE")
        .query_async(&mut replica.conn().await)
        .await
        .unwrap();
    assert_eq!(
        role.first(),
        Some(&redis::Value::BulkString(b"master".to_vec()))
    );
    eprintln!(
        "sales resumed {recovered:?} after the master was killed ({} refused)",
        refused.len()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn wait_vouches_for_what_a_command_read_not_only_for_what_it_wrote() {
    use inventory::store::{Replication, Store};
    let (master, replica) = master_and_replica().await;
    let replication = Replication {
        acks: 1,
        timeout: Duration::from_millis(ACK_TIMEOUT_MS),
    };
    // A store of its own for each read: its pooled connection is fresh and has written
    // nothing, as a pool's new connection has under load.
    let read = || async {
        let store = Store::new(
            &master.url(),
            "001",
            Duration::from_secs(1),
            std::sync::Arc::default(),
        )
        .unwrap()
        .with_replication(replication)
        .unwrap();
        let (acked, acks) = store.acked().unwrap();
        let key = Keys::new("001").stock;
        let _: Option<i64> = acked
            .call(|mut c| async move { c.get(&key).await })
            .await
            .unwrap();
        acks.get()
    };
    assert_eq!(read().await, Some(1), "a live replica acknowledges");

    replica.signal("STOP").await;
    // Someone else's write, which the replica never gets; then a command that only reads it.
    let _: () = master
        .conn()
        .await
        .set(Keys::new("001").stock, 7)
        .await
        .unwrap();
    assert_eq!(
        read().await,
        Some(0),
        "the read saw a write no replica has: WAIT must not vouch for it"
    );
    replica.signal("CONT").await;
}

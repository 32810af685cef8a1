//! `REPLICA_ACKS`: a master with one replica, real processes. The replica is frozen with
//! `SIGSTOP` so that `WAIT` runs out of time on purpose: the lock it could not replicate is
//! given back and nothing is sold; a write it could not replicate is reported as such, and a
//! retry with the same `Idempotency-Key` tells whether it survived.

use std::time::{Duration, Instant};

use inventory::store::Keys;
use redis::AsyncCommands;
use testkit::fixture::{InstanceBuilder, RedisServer};

const ACK_TIMEOUT_MS: u64 = 200;

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

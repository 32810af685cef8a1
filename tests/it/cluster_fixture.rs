//! `testkit::RedisCluster`, the Redis Cluster fixture the cluster topology's tests will run
//! on: real `redis-server` nodes, reached through the `redis` crate's cluster client. It
//! serves reads and writes on every master, survives a master killed (its replica takes
//! over), and redirects with `ASK` during a slot's migration and `MOVED` after it.

use std::time::{Duration, Instant};

use redis::AsyncCommands;
use testkit::{Migration, RedisCluster};

/// Generous against a node timeout of 1 s: failure detection, then the replica's election
/// (a random delay of up to 500 ms plus its rank), on a shared 2-core machine.
const FAILOVER_WITHIN: Duration = Duration::from_secs(15);

/// Keys spread over every master's slots.
fn keys(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("item:{i}")).collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_cluster_fixture_has_three_masters_each_followed_by_a_replica_and_serves_reads_and_writes()
 {
    let cluster = RedisCluster::start().await;

    let masters = cluster.masters().await;
    assert_eq!(masters.len(), 3, "{masters:#?}");
    let served: usize = masters
        .iter()
        .flat_map(|m| &m.slots)
        .map(|r| usize::from(r.end() - r.start()) + 1)
        .sum();
    assert_eq!(served, 16384, "every slot has a master: {masters:#?}");
    let replicas = cluster.replicas().await;
    assert_eq!(replicas.len(), 3, "{replicas:#?}");
    for master in &masters {
        assert_eq!(
            replicas
                .iter()
                .filter(|r| r.master_id.as_ref() == Some(&master.id))
                .count(),
            1,
            "one replica follows {}: {replicas:#?}",
            master.addr()
        );
    }
    assert_eq!(cluster.seed_urls().len(), 6);

    let mut c = cluster.client().await;
    for key in keys(60) {
        let _: () = c.set(&key, format!("value of {key}")).await.unwrap();
    }
    for key in keys(60) {
        let value: String = c.get(&key).await.unwrap();
        assert_eq!(value, format!("value of {key}"));
    }
    // The keys really are spread: every master holds some of them.
    for master in &masters {
        let mut node = cluster.node_connection(master.port).await;
        let size: u64 = redis::cmd("DBSIZE").query_async(&mut node).await.unwrap();
        assert!(size > 0, "{} holds none of the keys", master.addr());
    }
    let slot = cluster.slot_of("item:0").await;
    let owner = cluster.master_for_slot(slot).await;
    let mut node = cluster.node_connection(owner.port).await;
    let direct: String = node.get("item:0").await.unwrap();
    assert_eq!(direct, "value of item:0");
}

#[tokio::test(flavor = "multi_thread")]
async fn killing_a_master_promotes_its_replica_and_the_keys_of_its_slots_are_served_again() {
    let mut cluster = RedisCluster::start().await;
    let mut c = cluster.client().await;
    for key in keys(60) {
        let _: () = c.set(&key, format!("value of {key}")).await.unwrap();
    }
    cluster.wait_for_replication().await;

    let victim_slot = cluster.slot_of("item:7").await;
    let masters = cluster.masters().await;
    let victim_index = masters.iter().position(|m| m.serves(victim_slot)).unwrap();
    let replica_before = cluster
        .replicas()
        .await
        .into_iter()
        .find(|r| r.master_id.as_ref() == Some(&masters[victim_index].id))
        .unwrap();

    let killed_at = Instant::now();
    let killed = cluster.kill_master(victim_index).await;
    let promoted = cluster.wait_for_failover(&killed, FAILOVER_WITHIN).await;
    let failover = killed_at.elapsed();
    eprintln!("cluster failover took {failover:?} (node timeout 1 s)");

    assert_eq!(
        promoted.port, replica_before.port,
        "its own replica took over"
    );
    assert_eq!(
        cluster.master_for_slot(victim_slot).await.port,
        promoted.port
    );
    assert_eq!(cluster.masters().await.len(), 3);

    // Every key is there, those of the killed master's slots included, through a client
    // that knew the old master and through a new one.
    let mut fresh = cluster.client().await;
    for key in keys(60) {
        let expected = format!("value of {key}");
        let value = read_within(&mut c, &key, Duration::from_secs(5)).await;
        assert_eq!(value.as_deref(), Some(expected.as_str()), "{key}");
        let value: Option<String> = fresh.get(&key).await.unwrap();
        assert_eq!(value.as_deref(), Some(expected.as_str()), "{key}");
    }
    let _: () = fresh.set("item:7", "written after").await.unwrap();
    let mut node = cluster.node_connection(promoted.port).await;
    let direct: String = node.get("item:7").await.unwrap();
    assert_eq!(direct, "written after");
}

/// A client whose connections went to the killed master may fail a few calls while it
/// learns the new slot map; it must get there within `limit`.
async fn read_within(
    c: &mut redis::cluster_async::ClusterConnection,
    key: &str,
    limit: Duration,
) -> Option<String> {
    let deadline = Instant::now() + limit;
    loop {
        match c.get::<_, Option<String>>(key).await {
            Ok(value) => return value,
            Err(e) if Instant::now() < deadline => {
                eprintln!("{key}: {e}, retrying");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("{key}: still failing after {limit:?}: {e}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_slot_half_way_through_migration_answers_ask_and_a_migrated_one_moved() {
    let cluster = RedisCluster::start().await;
    let mut c = cluster.client().await;
    // Two keys of one slot (one hash tag).
    let (first, second) = ("{sku}:1", "{sku}:2");
    let _: () = c.set(first, "one").await.unwrap();
    let _: () = c.set(second, "two").await.unwrap();
    let slot = cluster.slot_of(first).await;
    let from = cluster.master_for_slot(slot).await;
    let to = cluster
        .masters()
        .await
        .into_iter()
        .find(|m| m.id != from.id)
        .unwrap();
    let mut source = cluster.node_connection(from.port).await;

    // Half-way: one key moved, the slot still the source's.
    let moved = cluster
        .migrate_slot(slot, &from, &to, Migration::StopAfterKeys(1))
        .await;
    assert_eq!(moved, 1);
    let (gone, kept) = {
        let exists: bool = source.exists(first).await.unwrap();
        if exists {
            (second, first)
        } else {
            (first, second)
        }
    };
    let error = source.get::<_, String>(gone).await.unwrap_err();
    assert_eq!(error.code(), Some("ASK"), "{error}");
    assert_eq!(
        error.redirect_node(),
        Some((to.addr().as_str(), slot)),
        "{error}"
    );
    let here: String = source.get(kept).await.unwrap();
    assert!(here == "one" || here == "two");
    assert_eq!(cluster.master_for_slot(slot).await.id, from.id);
    // The cluster client follows the ASK.
    let values: (String, String) = (c.get(first).await.unwrap(), c.get(second).await.unwrap());
    assert_eq!(values, ("one".to_owned(), "two".to_owned()));

    // Finished: every key moved, the slot handed over.
    let moved = cluster
        .migrate_slot(slot, &from, &to, Migration::Finish)
        .await;
    assert_eq!(moved, 1, "the key left behind");
    for key in [first, second] {
        let error = source.get::<_, String>(key).await.unwrap_err();
        assert_eq!(error.code(), Some("MOVED"), "{error}");
        assert_eq!(
            error.redirect_node(),
            Some((to.addr().as_str(), slot)),
            "{error}"
        );
    }
    assert_eq!(cluster.master_for_slot(slot).await.id, to.id);
    let values: (String, String) = (c.get(first).await.unwrap(), c.get(second).await.unwrap());
    assert_eq!(values, ("one".to_owned(), "two".to_owned()));
}

/// Dropping the fixture, also while a test panics, leaves no node running.
#[tokio::test(flavor = "multi_thread")]
async fn a_cluster_dropped_by_a_panicking_test_leaves_no_node_behind() {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let test = tokio::spawn(async move {
        let cluster = RedisCluster::start().await;
        tx.send(cluster.pids()).unwrap();
        panic!("a failing test");
    });
    assert!(test.await.is_err_and(|e| e.is_panic()));
    let pids = rx.await.unwrap();
    assert_eq!(pids.len(), 6);
    let deadline = Instant::now() + Duration::from_secs(3);
    let alive = || {
        pids.iter()
            .filter(|pid| testkit::ProcStat::read(**pid).is_some_and(|p| !p.is_zombie()))
            .count()
    };
    while alive() > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(alive(), 0, "nodes left running: {pids:?}");
}

//! `failover`: `fenced` with `REPLICA_ACKS=0` against `REPLICA_ACKS=1`, on a master with one
//! replica behind three sentinels. The replica lags (frozen with `SIGSTOP`, its link
//! dropped), a sale on app1 takes the lock and sells on the master, the master is killed, the
//! replica resumes and is promoted, the old master comes back as its replica, and app2 sells
//! again. Without acknowledgements the first sale was answered 200
//! and then lost with the old master: the new master never heard of the lock it granted nor
//! of the sale, and sells the same remaining-stock value again. With `REPLICA_ACKS=1` the
//! acquire that no replica acknowledged is given back and refused with 503
//! `not_replicated`: nothing is sold that a failover can lose.
//!
//! What it does not show: `WAIT` is not a consensus. A failover that promotes a replica
//! other than the one that acknowledged still loses the write (`failover-wrong-replica`).

use std::collections::BTreeMap;
use std::time::Duration;

use inventory::lock::{RedisLock, Strategy};
use redis::AsyncCommands;
use serde_json::{Value, json};
use testkit::{SentinelTiming, master_port};

use super::env::{Env, MASTER_NAME, Reply, audit_json, query};
use super::{Observed, Scenario, Setting};

pub(super) const SCENARIO: Scenario = Scenario {
    description: "freeze the replica, sell on the master, kill it: the replica is promoted without the sale",
    flawed: Strategy::Redis(RedisLock::Fenced),
    survivor: Strategy::Redis(RedisLock::Fenced),
    setting: Some(Setting {
        var: "REPLICA_ACKS",
        flawed: "0",
        survivor: "1",
    }),
};

/// Short enough that a replica frozen for a refused acquire stays well inside the
/// sentinels' `down-after` (it must still be eligible for promotion afterwards).
const ACK_TIMEOUT_MS: u64 = 300;

pub(super) fn configure(env: &mut BTreeMap<String, String>) {
    env.insert("REPLICA_ACK_TIMEOUT_MS".into(), ACK_TIMEOUT_MS.to_string());
    // A dead master is noticed (and Sentinel asked again) within this.
    env.insert("REDIS_TIMEOUT_MS".into(), "300".into());
}

pub(super) async fn run(env: &mut Env, strategy: Strategy) -> anyhow::Result<(Observed, Value)> {
    run_with(env, strategy, Promoted::TheLaggingReplica).await
}

/// Which replica the failover may promote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Promoted {
    /// The only replica, the one that lagged.
    TheLaggingReplica,
    /// Replica 0, which lagged, while replica 1, which acknowledged, is kept out of the
    /// election (`replica-priority 0`).
    NotTheOneThatAcknowledged,
}

pub(super) async fn run_with(
    env: &mut Env,
    strategy: Strategy,
    promoted: Promoted,
) -> anyhow::Result<(Observed, Value)> {
    const STOCK: i64 = 5;
    env.reset(STOCK).await?;
    for i in 0..env.replicas.len() {
        wait_for_stock(env, i, STOCK).await?;
    }
    if promoted == Promoted::NotTheOneThatAcknowledged {
        // Sentinel promotes the replica with the most data; in life the up-to-date one is
        // left out when the sentinels cannot reach it, or by its priority, as here.
        let mut c = env.replicas[1].connection().await?;
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("replica-priority")
            .arg(0)
            .query_async(&mut c)
            .await?;
        env.timeline.note(
            "runner",
            "replica 2 (up to date) may never be promoted (priority 0)",
        );
    }
    lag(env).await?;
    let a = env.sale(0, query(strategy, 0)).await;
    env.timeline.note(
        "runner",
        format!("app1's sale answered {} ({})", a.status, a.code()),
    );
    let old_master = env.redis.port;
    env.redis.stop().await;
    env.timeline.note("runner", "master KILLED (SIGKILL)");
    env.replicas[0].signal("CONT").await?;
    env.timeline
        .note("runner", "replica 1 resumed, without what it missed");
    let Some(new_master) = promotion(env, old_master).await else {
        return Ok((
            Observed::Missed,
            json!({"why": "Sentinel promoted no replica", "first_sale": a.summary()}),
        ));
    };
    // Named as the picture names its lane (`replica 1`), so that the leases after it are
    // drawn on the node that is the master now.
    let which = env
        .replicas
        .iter()
        .position(|r| r.port == new_master)
        .map_or_else(|| "a replica".to_owned(), |i| format!("replica {}", i + 1));
    env.timeline.note(
        "runner",
        format!("Sentinel promoted {which} (port {new_master}): the master now"),
    );
    // The old master comes back as a replica of the new one, so that REPLICA_ACKS can be
    // met again. Sentinel would make it one by itself, but only some seconds after it saw it
    // back (it waits for the master's role to settle).
    env.redis.restart().await?;
    let mut c = env.redis.connection().await?;
    let _: () = redis::cmd("REPLICAOF")
        .arg("127.0.0.1")
        .arg(new_master)
        .query_async(&mut c)
        .await?;
    env.timeline
        .note("runner", "old master restarted as a replica of the new one");
    let Some(c) = sell_after_failover(env, strategy).await else {
        return Ok((
            Observed::Missed,
            json!({"why": "no sale went through after the failover", "first_sale": a.summary()}),
        ));
    };
    let ledger = ledger_on(new_master).await?;
    let audit = env.audit().await?;
    let answered_but_lost: Vec<&Reply> = [&a, &c]
        .into_iter()
        .filter(|r| r.status == 200 && !ledger.contains(&order_id(r)))
        .collect();
    let sold_twice = a.status == 200 && a.body["remaining"] == c.body["remaining"];
    let observed = if !answered_but_lost.is_empty() || sold_twice || !audit.clean {
        Observed::Flaw
    } else if a.status == 503 && a.code() == "not_replicated" || a.status == 200 {
        // Refused before anything was sold, or sold and kept by the new master.
        Observed::Safe
    } else {
        Observed::Missed
    };
    let details = json!({
        "first_sale": a.summary(),
        "first_remaining": a.body["remaining"],
        "after_failover": c.summary(),
        "after_failover_remaining": c.body["remaining"],
        "answered_200_but_lost": answered_but_lost.iter().map(|r| order_id(r)).collect::<Vec<_>>(),
        "same_remaining_sold_twice": sold_twice,
        "new_master_ledger": ledger.len(),
        "audit": audit_json(&audit),
    });
    Ok((observed, details))
}

/// Makes replica 0 lag: frozen, and its link dropped by the master. Freezing alone is not
/// enough: what the master already sent waits in the frozen replica's socket, and it would
/// read it on waking, before it noticed the master had died. The other replicas reconnect
/// at once.
async fn lag(env: &Env) -> anyhow::Result<()> {
    env.replicas[0].signal("STOP").await?;
    let mut c = env.redis.connection().await?;
    let _: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("replica")
        .query_async(&mut c)
        .await?;
    env.timeline.note(
        "runner",
        "replica 1 frozen (SIGSTOP) and its link dropped: from now on it gets nothing",
    );
    Ok(())
}

/// The port of the new master, once every sentinel names it. The old master is restarted
/// only then: a sentinel that has not heard of the promotion yet would name the old address,
/// where an empty master would be accepting writes.
async fn promotion(env: &Env, old: u16) -> Option<u16> {
    let timing = SentinelTiming::default();
    let deadline = tokio::time::Instant::now()
        + timing.down_after
        + 2 * timing.failover_timeout
        + Duration::from_secs(4);
    while tokio::time::Instant::now() < deadline {
        let mut named = Vec::new();
        for sentinel in &env.sentinels {
            named.push(master_port(std::slice::from_ref(sentinel), MASTER_NAME).await);
        }
        if let [Some(port), ..] = named[..]
            && port != old
            && named.iter().all(|n| *n == Some(port))
        {
            return Some(port);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

fn order_id(reply: &Reply) -> String {
    reply.body["order_id"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

async fn wait_for_stock(env: &Env, replica: usize, stock: i64) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    let mut c = env.replicas[replica].connection().await?;
    let key = inventory::store::Keys::new("001").stock;
    loop {
        let now: Option<i64> = c.get(&key).await?;
        if now == Some(stock) {
            return Ok(());
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "replica {replica} never got the reset"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Sales on app2 until one is sold, within the sentinels' failover time and some margin;
/// the refusals meanwhile (503s while there is no master) go on the timeline.
async fn sell_after_failover(env: &Env, strategy: Strategy) -> Option<Reply> {
    let timing = SentinelTiming::default();
    let deadline = tokio::time::Instant::now()
        + timing.down_after
        + timing.failover_timeout
        + Duration::from_secs(6);
    let mut refused = 0;
    while tokio::time::Instant::now() < deadline {
        let reply = env.sale(1, query(strategy, 0)).await;
        if reply.status == 200 {
            env.timeline.note(
                "runner",
                format!("app2 sold after the failover ({refused} refusals before)"),
            );
            return Some(reply);
        }
        refused += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    None
}

/// The order ids in the ledger of the server on `port`.
async fn ledger_on(port: u16) -> anyhow::Result<Vec<String>> {
    let mut c = redis::Client::open(format!("redis://127.0.0.1:{port}"))?
        .get_multiplexed_async_connection()
        .await?;
    let key = inventory::store::Keys::new("001").ledger;
    let entries: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
        .arg(&key)
        .arg("-")
        .arg("+")
        .query_async(&mut c)
        .await?;
    Ok(entries
        .into_iter()
        .flat_map(|(_, fields)| fields)
        .filter_map(|(_, entry)| serde_json::from_str::<Value>(&entry).ok())
        .filter_map(|entry| entry["order_id"].as_str().map(str::to_owned))
        .collect())
}

//! `--failover-after`: kills the master that Sentinel names, once, part-way through a run,
//! so that the table shows what a failover does to sales already answered 200.
//!
//! The master is killed with `SIGKILL` when it runs on this machine (its `process_id` is a
//! `redis-server` here), as a crash would: nothing is flushed to the replicas. Elsewhere (a
//! container) it gets `SHUTDOWN NOSAVE NOW FORCE`, which stops it without waiting for
//! lagging replicas but does flush what it already queued for them, so it loses less.

use std::time::Duration;

use anyhow::Context;
use serde::{Deserialize, Serialize};

/// Where to find the master, and when to kill it.
#[derive(Debug, Clone)]
pub struct Failover {
    pub after: Duration,
    /// One sentinel, `host:port`.
    pub sentinel: String,
    pub master_name: String,
}

/// What was killed, and how.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Killed {
    /// `host:port` of the master at the time.
    pub master: String,
    /// `SIGKILL` or `SHUTDOWN NOW`.
    pub how: String,
    /// Seconds into the run.
    pub at_s: f64,
}

impl Failover {
    /// The master the sentinel names now, `host:port`: asked before a run too, so that a
    /// wrong `--sentinel` or `--master-name` fails before the load rather than into it.
    pub async fn master(&self) -> anyhow::Result<String> {
        let sentinel = &self.sentinel;
        let client = redis::Client::open(format!("redis://{sentinel}")).map_err(|e| {
            anyhow::anyhow!("--sentinel {sentinel}: not host:port ({:?})", e.kind())
        })?;
        let mut c = tokio::time::timeout(
            Duration::from_secs(2),
            client.get_multiplexed_async_connection(),
        )
        .await
        .map_err(|_| anyhow::anyhow!("--sentinel {sentinel}: no answer within 2 s"))?
        // The error's text repeats its own detail; its kind and detail say it once.
        .map_err(|e| {
            anyhow::anyhow!(
                "--sentinel {sentinel}: cannot connect ({})",
                e.detail().unwrap_or(&format!("{:?}", e.kind()))
            )
        })?;
        let (host, port): (String, u16) = redis::cmd("SENTINEL")
            .arg("get-master-addr-by-name")
            .arg(&self.master_name)
            .query_async(&mut c)
            .await
            .with_context(|| {
                format!(
                    "--sentinel {sentinel} knows no master named {:?} (--master-name)",
                    self.master_name
                )
            })?;
        Ok(format!("{host}:{port}"))
    }

    /// Kills the master the sentinel names now.
    pub async fn kill_master(&self) -> anyhow::Result<(String, String)> {
        let master = self.master().await?;
        let mut m = redis::Client::open(format!("redis://{master}"))?
            .get_multiplexed_async_connection()
            .await
            .with_context(|| format!("cannot reach the master {master}"))?;
        let info: String = redis::cmd("INFO").arg("server").query_async(&mut m).await?;
        if let Some(pid) = local_redis_pid(&info) {
            nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            )?;
            return Ok((master, "SIGKILL".into()));
        }
        // The connection drops as the server stops: no reply is the expected outcome.
        let _: redis::RedisResult<()> = redis::cmd("SHUTDOWN")
            .arg("NOSAVE")
            .arg("NOW")
            .arg("FORCE")
            .query_async(&mut m)
            .await;
        Ok((master, "SHUTDOWN NOW".into()))
    }
}

/// The server's pid, when a process of that pid on this machine is a `redis-server`.
fn local_redis_pid(info: &str) -> Option<i32> {
    let pid: i32 = info
        .lines()
        .find_map(|l| l.strip_prefix("process_id:"))?
        .trim()
        .parse()
        .ok()?;
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
    comm.trim().starts_with("redis-server").then_some(pid)
}

/// A master with two replicas, three sentinels, two instances that find the master through
/// them, and nginx in front: the `sentinel` topology on free ports, for one failover run.
pub struct SentinelTopology {
    pub nginx: testkit::NginxProcess,
    pub apps: Vec<testkit::InventoryProcess>,
    pub sentinels: Vec<testkit::SentinelProcess>,
    pub replicas: Vec<testkit::RedisProcess>,
    pub master: testkit::RedisProcess,
}

/// The topology's replicas: `REPLICA_ACKS` above this refuses every sale.
pub const REPLICAS: usize = 2;

/// The name the topology's sentinels know the master by.
pub const MASTER_NAME: &str = "inventory";

impl SentinelTopology {
    /// Every instance gets `env` on top of the defaults (say `REPLICA_ACKS`).
    pub async fn start(bin: &std::path::Path, env: &[(&str, String)]) -> anyhow::Result<Self> {
        // A replica that (re)syncs is served at once, not after diskless sync's 5 s wait.
        const NO_DELAY: [&str; 2] = ["--repl-diskless-sync-delay", "0"];
        let master = testkit::RedisProcess::start(&NO_DELAY).await?;
        let port = master.port.to_string();
        let mut replicas = Vec::new();
        for _ in 0..REPLICAS {
            let mut args = vec!["--replicaof", "127.0.0.1", &port];
            args.extend(NO_DELAY);
            replicas.push(testkit::RedisProcess::start(&args).await?);
        }
        let sentinels = testkit::start_sentinels(
            MASTER_NAME,
            master.port,
            replicas.len(),
            testkit::SentinelTiming::default(),
        )
        .await?;
        let list: Vec<String> = sentinels
            .iter()
            .map(testkit::SentinelProcess::addr)
            .collect();
        let mut apps = Vec::new();
        for name in ["app1", "app2"] {
            let mut vars = testkit::default_env(&master.url(), name);
            vars.remove("REDIS_URL");
            vars.remove("LOCK_NODES");
            vars.insert("REDIS_SENTINELS".into(), list.join(","));
            vars.insert("REDIS_MASTER_NAME".into(), MASTER_NAME.into());
            // A dead master is noticed within this, and Sentinel asked again.
            vars.insert("REDIS_TIMEOUT_MS".into(), "300".into());
            vars.insert("LOCK_TTL_MS".into(), "5000".into());
            vars.insert("LOG_FORMAT".into(), "text".into());
            vars.insert("RUST_LOG".into(), "warn".into());
            for (key, value) in env {
                vars.insert((*key).into(), value.clone());
            }
            apps.push(testkit::InventoryProcess::start(bin, name, &vars, None).await?);
        }
        let nginx = testkit::NginxProcess::start([apps[0].port, apps[1].port]).await?;
        Ok(Self {
            nginx,
            apps,
            sentinels,
            replicas,
            master,
        })
    }

    /// One sentinel's `host:port`, for [`Failover::sentinel`].
    pub fn sentinel(&self) -> String {
        self.sentinels[0].addr()
    }
}

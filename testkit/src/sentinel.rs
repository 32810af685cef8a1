//! `redis-server --sentinel` on a free port, in a temporary directory of its own (a sentinel
//! rewrites its configuration file, so each needs one it may write).

use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, bail};
use nix::sys::signal::Signal;
use tempfile::TempDir;
use tokio::process::Command;
use tokio::time::Instant;

use crate::group::{DEFAULT_GRACE, ProcessGroup};
use crate::{START_ATTEMPTS, free_port, read_log};

/// How fast the sentinels act: a master silent for `down_after` is down, and a failover
/// that has not completed within `failover_timeout` is given up (and retried after twice
/// that).
#[derive(Debug, Clone, Copy)]
pub struct SentinelTiming {
    pub down_after: Duration,
    pub failover_timeout: Duration,
}

impl Default for SentinelTiming {
    /// Fast enough for a test or a demo.
    fn default() -> Self {
        Self {
            down_after: Duration::from_millis(1000),
            failover_timeout: Duration::from_millis(2000),
        }
    }
}

pub struct SentinelProcess {
    process: ProcessGroup,
    pub port: u16,
    dir: TempDir,
    /// Its own `requirepass`, which is also the servers' (`sentinel auth-pass`).
    password: Option<String>,
}

impl SentinelProcess {
    /// A sentinel monitoring `master_name` at `127.0.0.1:master_port`, with `quorum`
    /// sentinels needed to agree that it is down.
    pub async fn start(
        master_name: &str,
        master_port: u16,
        quorum: u32,
        timing: SentinelTiming,
    ) -> anyhow::Result<Self> {
        Self::start_with_password(master_name, master_port, quorum, timing, None).await
    }

    /// As [`start`](Self::start), with `password` required of its clients (`requirepass`)
    /// and given to the servers it watches (`sentinel auth-pass`), which require it too.
    pub async fn start_with_password(
        master_name: &str,
        master_port: u16,
        quorum: u32,
        timing: SentinelTiming,
        password: Option<&str>,
    ) -> anyhow::Result<Self> {
        let auth = password.map_or(String::new(), |p| {
            format!("requirepass {p}\nsentinel auth-pass {master_name} {p}\n")
        });
        let mut last_log = String::new();
        for _ in 0..START_ATTEMPTS {
            let dir = tempfile::tempdir()?;
            let port = free_port()?;
            let conf = dir.path().join("sentinel.conf");
            std::fs::write(
                &conf,
                format!(
                    "port {port}\nbind 127.0.0.1\ndir {dir}\nlogfile {dir}/sentinel.log\n\
                     sentinel monitor {master_name} 127.0.0.1 {master_port} {quorum}\n\
                     sentinel down-after-milliseconds {master_name} {down}\n\
                     sentinel failover-timeout {master_name} {failover}\n\
                     sentinel parallel-syncs {master_name} 1\n{auth}",
                    dir = dir.path().display(),
                    down = timing.down_after.as_millis(),
                    failover = timing.failover_timeout.as_millis(),
                ),
            )?;
            let mut command = Command::new("redis-server");
            command
                .arg(&conf)
                .arg("--sentinel")
                .current_dir(dir.path())
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            let process = ProcessGroup::spawn(&mut command, Signal::SIGTERM, DEFAULT_GRACE)
                .context("cannot run redis-server --sentinel: install redis-server")?;
            let sentinel = SentinelProcess {
                process,
                port,
                dir,
                password: password.map(str::to_owned),
            };
            if sentinel.wait_ready(Duration::from_secs(5)).await {
                return Ok(sentinel);
            }
            last_log = sentinel.log();
        }
        bail!("redis-server --sentinel did not start; its last log:\n{last_log}")
    }

    async fn wait_ready(&self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Ok(mut c) = self.connection().await
                && redis::cmd("PING")
                    .query_async::<String>(&mut c)
                    .await
                    .is_ok()
            {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        false
    }

    /// `host:port`, as `REDIS_SENTINELS` lists it.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub async fn connection(&self) -> redis::RedisResult<redis::aio::MultiplexedConnection> {
        // Set as a field, not in a URL: the password may hold `@`, `/` or `#`.
        let mut settings = redis::RedisConnectionInfo::default();
        if let Some(p) = &self.password {
            settings = settings.set_password(p);
        }
        let info = redis::IntoConnectionInfo::into_connection_info(("127.0.0.1", self.port))?
            .set_redis_settings(settings);
        redis::Client::open(info)?
            .get_multiplexed_async_connection()
            .await
    }

    /// `SENTINEL MASTER <name>` as field -> value.
    pub async fn master_info(
        &self,
        master_name: &str,
    ) -> anyhow::Result<std::collections::HashMap<String, String>> {
        let mut c = self.connection().await?;
        Ok(redis::cmd("SENTINEL")
            .arg("MASTER")
            .arg(master_name)
            .query_async(&mut c)
            .await?)
    }

    /// Whether it is in TILT (`INFO sentinel`): after its own loop stalled for over 2 s it
    /// tells every other sentinel the master is up, for 30 s.
    pub async fn in_tilt(&self) -> anyhow::Result<bool> {
        let mut c = self.connection().await?;
        let info: String = redis::cmd("INFO")
            .arg("sentinel")
            .query_async(&mut c)
            .await?;
        let tilt = info
            .lines()
            .find_map(|l| l.trim().strip_prefix("sentinel_tilt:"))
            .context("INFO sentinel has no sentinel_tilt")?;
        Ok(tilt != "0")
    }

    pub fn pid(&self) -> Option<u32> {
        self.process.id()
    }

    pub fn log(&self) -> String {
        read_log(&self.dir.path().join("sentinel.log"))
    }
}

/// Three sentinels watching `master_name` at `127.0.0.1:master_port` (quorum 2), returned
/// once each knows the other two and `replicas` replicas (a failover before that could pick
/// no replica at all) and none is in TILT.
pub async fn start_sentinels(
    master_name: &str,
    master_port: u16,
    replicas: usize,
    timing: SentinelTiming,
) -> anyhow::Result<Vec<SentinelProcess>> {
    start_sentinels_with_password(master_name, master_port, replicas, timing, None).await
}

/// As [`start_sentinels`], each sentinel requiring `password` and giving it to the servers.
pub async fn start_sentinels_with_password(
    master_name: &str,
    master_port: u16,
    replicas: usize,
    timing: SentinelTiming,
    password: Option<&str>,
) -> anyhow::Result<Vec<SentinelProcess>> {
    let mut sentinels = Vec::new();
    for _ in 0..3 {
        sentinels.push(
            SentinelProcess::start_with_password(master_name, master_port, 2, timing, password)
                .await?,
        );
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    let (others, replicas) = ("2".to_owned(), replicas.to_string());
    'wait: loop {
        if Instant::now() >= deadline {
            bail!("the sentinels never found each other and the {replicas} replicas");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        for sentinel in &sentinels {
            let Ok(info) = sentinel.master_info(master_name).await else {
                continue 'wait;
            };
            if info.get("num-other-sentinels") != Some(&others)
                || info.get("num-slaves") != Some(&replicas)
            {
                continue 'wait;
            }
        }
        break;
    }
    wait_out_tilt(&sentinels).await?;
    Ok(sentinels)
}

/// Until none of `sentinels` is in TILT: with two of the three so, no failover happens at
/// all. A stall shows only on the next tick of a sentinel's loop, after it answered the
/// queries that were waiting, hence the pause first.
async fn wait_out_tilt(sentinels: &[SentinelProcess]) -> anyhow::Result<()> {
    tokio::time::sleep(Duration::from_millis(300)).await;
    let deadline = Instant::now() + Duration::from_secs(45);
    for sentinel in sentinels {
        while sentinel.in_tilt().await? {
            if Instant::now() >= deadline {
                bail!("a sentinel stayed in TILT; its log:\n{}", sentinel.log());
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    Ok(())
}

/// The port of the master that the first answering sentinel names now.
pub async fn master_port(sentinels: &[SentinelProcess], master_name: &str) -> Option<u16> {
    for sentinel in sentinels {
        let Ok(mut c) = sentinel.connection().await else {
            continue;
        };
        let addr: redis::RedisResult<(String, u16)> = redis::cmd("SENTINEL")
            .arg("get-master-addr-by-name")
            .arg(master_name)
            .query_async(&mut c)
            .await;
        if let Ok((_, port)) = addr {
            return Some(port);
        }
    }
    None
}

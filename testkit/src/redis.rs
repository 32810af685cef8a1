//! `redis-server` on a free port, in a temporary directory of its own.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, bail};
use nix::sys::signal::Signal;
use redis::aio::MultiplexedConnection;
use tempfile::TempDir;
use tokio::process::Command;
use tokio::time::Instant;

use crate::group::{DEFAULT_GRACE, ProcessGroup, signal_named};
use crate::{START_ATTEMPTS, free_port, read_log};

pub struct RedisProcess {
    process: ProcessGroup,
    pub port: u16,
    dir: TempDir,
    extra: Vec<String>,
    /// Where it listens: `127.0.0.1`, or the addresses inside a network namespace.
    binds: Vec<String>,
    /// The namespace it runs in (`ip netns exec`), if any.
    netns: Option<String>,
}

impl RedisProcess {
    /// `extra` is passed on to `redis-server` (`--notify-keyspace-events Ex`, say).
    pub async fn start(extra: &[&str]) -> anyhow::Result<Self> {
        Self::start_on(None, vec!["127.0.0.1".to_owned()], extra, free_port).await
    }

    /// [`start`](Self::start) on a port that `pick` chooses (a cluster node needs its port
    /// + 10000 free as well).
    pub async fn start_picking(
        pick: fn() -> anyhow::Result<u16>,
        extra: &[&str],
    ) -> anyhow::Result<Self> {
        Self::start_on(None, vec!["127.0.0.1".to_owned()], extra, pick).await
    }

    /// A server inside network namespace `ns`, listening on `binds` (the namespace's ends of
    /// its links); its [`url`](Self::url) is on the first of them, [`url_at`](Self::url_at)
    /// names another. Protected mode is off, as it refuses every address but loopback: only
    /// the namespace's own links reach these addresses.
    pub async fn start_in(
        ns: &crate::netns::Namespace,
        binds: &[std::net::Ipv4Addr],
        extra: &[&str],
    ) -> anyhow::Result<Self> {
        let binds = binds.iter().map(|a| a.to_string()).collect();
        let mut extra = extra.to_vec();
        extra.extend(["--protected-mode", "no"]);
        Self::start_on(Some(ns.name.clone()), binds, &extra, free_port).await
    }

    async fn start_on(
        netns: Option<String>,
        binds: Vec<String>,
        extra: &[&str],
        pick: fn() -> anyhow::Result<u16>,
    ) -> anyhow::Result<Self> {
        let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        let mut last_log = String::new();
        for _ in 0..START_ATTEMPTS {
            let dir = tempfile::tempdir()?;
            let port = pick()?;
            let process = spawn_redis(port, dir.path(), &extra, &binds, netns.as_deref())?;
            let server = RedisProcess {
                process,
                port,
                dir,
                extra: extra.clone(),
                binds: binds.clone(),
                netns: netns.clone(),
            };
            if server.wait_ready(Duration::from_secs(5)).await {
                return Ok(server);
            }
            last_log = server.log();
        }
        bail!("redis-server did not start; its last log:\n{last_log}")
    }

    /// Starts the server again on the same port and directory (with `--appendonly yes` in
    /// `extra`, it comes back with its data), after a [`stop`](Self::stop).
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        self.stop().await;
        for _ in 0..START_ATTEMPTS {
            self.process = spawn_redis(
                self.port,
                self.dir.path(),
                &self.extra,
                &self.binds,
                self.netns.as_deref(),
            )?;
            if self.wait_ready(Duration::from_secs(5)).await {
                return Ok(());
            }
        }
        bail!("redis-server did not restart; its log:\n{}", self.log())
    }

    /// Sends a signal by name (`STOP` freezes it: connections hang instead of failing).
    pub async fn signal(&self, name: &str) -> anyhow::Result<()> {
        self.process.signal(signal_named(name)?)
    }

    async fn wait_ready(&self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Ok(mut c) = self.connection().await {
                match redis::cmd("PING").query_async::<String>(&mut c).await {
                    // PONG, not any answer: with nothing listening on a port of the
                    // ephemeral range, the kernel can connect a client to itself, which then
                    // reads its own PING back.
                    Ok(pong) if pong == "PONG" => return true,
                    Ok(_) => {}
                    // A server with `--requirepass` is up when it asks for the password.
                    Err(e) if e.code() == Some("NOAUTH") => return true,
                    Err(_) => {}
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        false
    }

    pub fn url(&self) -> String {
        format!("redis://{}:{}", self.binds[0], self.port)
    }

    /// Its URL on `addr`, one of the addresses it binds.
    pub fn url_at(&self, addr: std::net::Ipv4Addr) -> String {
        format!("redis://{addr}:{}", self.port)
    }

    pub async fn connection(&self) -> redis::RedisResult<MultiplexedConnection> {
        redis::Client::open(self.url())?
            .get_multiplexed_async_connection()
            .await
    }

    pub fn log(&self) -> String {
        read_log(&self.dir.path().join("redis.log"))
    }

    /// Kills the server (SIGKILL, a crash as far as its data is concerned) and waits for it
    /// to be gone.
    pub async fn stop(&mut self) {
        self.process.kill();
    }

    /// Stops the server the way an operator would (SIGTERM: it finishes what it is writing),
    /// then makes sure nothing of it is left.
    pub async fn shutdown(&mut self) {
        self.process.stop().await;
    }

    pub fn pid(&self) -> Option<u32> {
        self.process.id()
    }

    /// Its data directory, which is also its working directory.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

fn spawn_redis(
    port: u16,
    dir: &Path,
    extra: &[String],
    binds: &[String],
    netns: Option<&str>,
) -> anyhow::Result<ProcessGroup> {
    // `ip netns exec` execs the server: the pid, and the group, are still the server's.
    let mut command = match netns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns, "redis-server"]);
            c
        }
        None => Command::new("redis-server"),
    };
    command
        .args(["--port", &port.to_string(), "--bind"])
        .args(binds)
        .args(["--save", ""])
        .args(["--appendonly", "no", "--dir"])
        .arg(dir)
        .arg("--logfile")
        .arg(dir.join("redis.log"))
        .args(extra)
        .current_dir(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    ProcessGroup::spawn(&mut command, Signal::SIGTERM, DEFAULT_GRACE)
        .context("cannot run redis-server: install it (apt-get install redis-server)")
}

//! Real processes on free loopback ports: a `redis-server` and `inventory` instances, for the
//! fault scenarios and the integration tests alike. Each is killed when its handle drops;
//! a failure to start comes with the process's own log.

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, bail};
use redis::aio::MultiplexedConnection;
use tempfile::TempDir;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::time::Instant;

use crate::timeline::Timeline;

/// A port the OS had free a moment ago; servers that then fail to bind it are retried.
pub fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

const START_ATTEMPTS: usize = 5;

pub struct RedisProcess {
    child: Child,
    pub port: u16,
    dir: TempDir,
    extra: Vec<String>,
}

impl RedisProcess {
    /// `extra` is passed on to `redis-server` (`--notify-keyspace-events Ex`, say).
    pub async fn start(extra: &[&str]) -> anyhow::Result<Self> {
        let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        let mut last_log = String::new();
        for _ in 0..START_ATTEMPTS {
            let dir = tempfile::tempdir()?;
            let port = free_port()?;
            let child = spawn_redis(port, dir.path(), &extra)?;
            let server = RedisProcess {
                child,
                port,
                dir,
                extra: extra.clone(),
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
            self.child = spawn_redis(self.port, self.dir.path(), &self.extra)?;
            if self.wait_ready(Duration::from_secs(5)).await {
                return Ok(());
            }
        }
        bail!("redis-server did not restart; its log:\n{}", self.log())
    }

    /// Sends a signal by name (`STOP` freezes it: connections hang instead of failing).
    pub async fn signal(&self, name: &str) -> anyhow::Result<()> {
        send_signal(self.child.id(), name).await
    }

    async fn wait_ready(&self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Ok(mut c) = self.connection().await {
                match redis::cmd("PING").query_async::<String>(&mut c).await {
                    // A server with `--requirepass` is up when it asks for the password.
                    Ok(_) => return true,
                    Err(e) if e.code() == Some("NOAUTH") => return true,
                    Err(_) => {}
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        false
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub async fn connection(&self) -> redis::RedisResult<MultiplexedConnection> {
        redis::Client::open(self.url())?
            .get_multiplexed_async_connection()
            .await
    }

    pub fn log(&self) -> String {
        read_log(&self.dir.path().join("redis.log"))
    }

    /// Kills the server and waits for it to be gone.
    pub async fn stop(&mut self) {
        let _ = self.child.kill().await;
    }
}

fn spawn_redis(port: u16, dir: &Path, extra: &[String]) -> anyhow::Result<Child> {
    Command::new("redis-server")
        .args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
        ])
        .args(["--appendonly", "no", "--dir"])
        .arg(dir)
        .arg("--logfile")
        .arg(dir.join("redis.log"))
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .context("cannot run redis-server: install it (apt-get install redis-server)")
}

/// Sends a signal by name with the `kill` command (no unsafe code for `kill(2)`).
async fn send_signal(pid: Option<u32>, name: &str) -> anyhow::Result<()> {
    let pid = pid.context("the process has already been collected")?;
    let status = Command::new("kill")
        .arg(format!("-{name}"))
        .arg(pid.to_string())
        .status()
        .await?;
    if !status.success() {
        bail!("kill -{name} {pid} failed");
    }
    Ok(())
}

fn read_log(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| format!("(no log at {}: {e})", path.display()))
}

/// The `inventory` binary next to the running executable (both live in `target/<profile>/`),
/// unless `INVENTORY_BIN` says otherwise.
pub fn sibling_inventory_binary() -> anyhow::Result<PathBuf> {
    if let Some(path) = std::env::var_os("INVENTORY_BIN") {
        return Ok(path.into());
    }
    let exe = std::env::current_exe()?;
    let dir = exe.parent().context("executable has no directory")?;
    let path = dir.join("inventory");
    if path.exists() {
        Ok(path)
    } else {
        bail!(
            "no inventory binary at {} (build the workspace, or set INVENTORY_BIN)",
            path.display()
        )
    }
}

/// Every setting of an instance, passed explicitly so the environment of whoever runs the
/// scenarios or tests cannot change what they do.
pub fn default_env(redis_url: &str, name: &str) -> BTreeMap<String, String> {
    [
        ("REDIS_URL", redis_url),
        ("INSTANCE_NAME", name),
        ("BIND_ADDR", "127.0.0.1"),
        ("LOCK_STRATEGY", "fenced"),
        ("LOCK_TTL_MS", "30000"),
        ("LOCK_WAIT_MS", "10000"),
        ("LOCK_WAIT", "notify"),
        ("ITEM_ID", "001"),
        ("REDIS_TIMEOUT_MS", "1000"),
        ("RELEASE_GAP_MS", "0"),
        ("ADMIN_TOKEN", ""),
        ("LOG_FORMAT", "json"),
        ("RUST_LOG", "info,inventory=debug"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect()
}

pub struct InventoryProcess {
    child: Child,
    pub port: u16,
    pub name: String,
    log: Arc<Mutex<Vec<String>>>,
}

impl InventoryProcess {
    /// Starts `bin` with `env` on a free port and waits for `/health`. Every log line is
    /// kept, and also put on `timeline` when one is given.
    pub async fn start(
        bin: &Path,
        name: &str,
        env: &BTreeMap<String, String>,
        timeline: Option<Timeline>,
    ) -> anyhow::Result<Self> {
        let mut last_log = String::new();
        for _ in 0..START_ATTEMPTS {
            let port = free_port()?;
            let mut child = Command::new(bin)
                .env("PORT", port.to_string())
                .envs(env)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .kill_on_drop(true)
                .spawn()
                .with_context(|| format!("cannot run {}", bin.display()))?;
            let log = Arc::new(Mutex::new(Vec::new()));
            for stream in [
                child
                    .stdout
                    .take()
                    .map(|s| Box::new(s) as Box<dyn tokio::io::AsyncRead + Unpin + Send>),
                child
                    .stderr
                    .take()
                    .map(|s| Box::new(s) as Box<dyn tokio::io::AsyncRead + Unpin + Send>),
            ]
            .into_iter()
            .flatten()
            {
                tokio::spawn(collect(
                    stream,
                    name.to_owned(),
                    log.clone(),
                    timeline.clone(),
                ));
            }
            let mut instance = InventoryProcess {
                child,
                port,
                name: name.to_owned(),
                log,
            };
            if instance.wait_healthy(Duration::from_secs(10)).await {
                return Ok(instance);
            }
            last_log = instance.log();
        }
        bail!("instance {name} did not start; its log:\n{last_log}")
    }

    async fn wait_healthy(&mut self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        let http = reqwest::Client::new();
        while Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return false;
            }
            if let Ok(r) = http.get(self.url("/health")).send().await
                && r.status().is_success()
            {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        false
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    pub fn log(&self) -> String {
        self.log.lock().map(|l| l.join("\n")).unwrap_or_default()
    }

    /// Sends a signal by name (`KILL`, `STOP`, `CONT`, `TERM`) with the `kill` command.
    pub async fn signal(&self, name: &str) -> anyhow::Result<()> {
        send_signal(self.pid(), name).await
    }

    /// Waits for the process to exit, for at most `within`; its exit status, if it did.
    pub async fn wait_exit(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        tokio::time::timeout(within, self.child.wait())
            .await
            .ok()
            .and_then(Result::ok)
    }
}

async fn collect(
    stream: Box<dyn tokio::io::AsyncRead + Unpin + Send>,
    name: String,
    log: Arc<Mutex<Vec<String>>>,
    timeline: Option<Timeline>,
) {
    let mut lines = BufReader::new(stream).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        if let Some(timeline) = &timeline {
            timeline.record_log(&name, &line);
        }
        if let Ok(mut log) = log.lock() {
            log.push(line);
        }
    }
}

//! `inventory` instances on free ports, each in an empty temporary directory of its own,
//! with every log line kept.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, bail};
use nix::sys::signal::Signal;
use tempfile::TempDir;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;
use tokio::time::Instant;

use crate::group::{DEFAULT_GRACE, ProcessGroup, signal_named};
use crate::{START_ATTEMPTS, free_port};

/// The `inventory` binary to start: `INVENTORY_BIN` when set; else the one nextest names
/// (`NEXTEST_BIN_EXE_inventory`, set for this package's integration tests); else the one next
/// to the running executable (both live in `target/<profile>/`), or one directory up when
/// the executable is a test binary in `target/<profile>/deps/` (cargo builds a package's
/// binaries before its integration tests).
pub fn inventory_binary() -> anyhow::Result<PathBuf> {
    for var in ["INVENTORY_BIN", "NEXTEST_BIN_EXE_inventory"] {
        if let Some(path) = std::env::var_os(var) {
            return Ok(path.into());
        }
    }
    let exe = std::env::current_exe()?;
    let dir = exe.parent().context("executable has no directory")?;
    let mut candidates = vec![dir.join("inventory")];
    if dir.file_name().is_some_and(|name| name == "deps")
        && let Some(profile) = dir.parent()
    {
        candidates.push(profile.join("inventory"));
    }
    match candidates.iter().find(|path| path.exists()) {
        Some(path) => Ok(path.clone()),
        None => bail!(
            "no inventory binary at {} (build the workspace, or set INVENTORY_BIN)",
            candidates[0].display()
        ),
    }
}

/// Where an instance's log lines go as they come, besides its own log: each line with the
/// instance's name (the fault scenarios put them on their timeline).
pub type LogSink = Arc<dyn Fn(&str, &str) + Send + Sync>;

/// Every setting of an instance, passed explicitly so the environment of whoever runs the
/// scenarios or tests cannot change what they do.
///
/// The quorum lock's three nodes default to three databases of the same server: every
/// strategy then works everywhere a test runs them all, and the quorum's logic (votes,
/// give-back, owner-checked release on each node) runs for real. What only separate
/// processes can show (a node down, slow or cut off) is tested with nodes of its own.
pub fn default_env(redis_url: &str, name: &str) -> BTreeMap<String, String> {
    let lock_nodes = (1..=3)
        .map(|db| format!("{redis_url}/{db}"))
        .collect::<Vec<_>>()
        .join(",");
    [
        ("REDIS_URL", redis_url),
        ("LOCK_NODES", &lock_nodes),
        ("INSTANCE_NAME", name),
        ("BIND_ADDR", "127.0.0.1"),
        ("LOCK_STRATEGY", "fenced"),
        ("LOCK_TTL_MS", "30000"),
        ("LOCK_WAIT_MS", "10000"),
        ("LOCK_WAIT", "notify"),
        ("ITEM_ID", "001"),
        ("REDIS_TIMEOUT_MS", "1000"),
        ("RELEASE_GAP_MS", "0"),
        // The fault scenarios and tests ask for long work on purpose.
        ("MAX_WORK_MS", "60000"),
        ("LOG_FORMAT", "json"),
        ("RUST_LOG", "info,inventory=debug"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .chain(
        // The first instance runs on one worker thread, as `make up` runs each on two
        // cores; the others on one per core: every two-instance test covers both.
        name.ends_with('1')
            .then(|| ("WORKER_THREADS".to_owned(), "1".to_owned())),
    )
    .collect()
}

pub struct InventoryProcess {
    process: ProcessGroup,
    pub port: u16,
    pub name: String,
    log: Arc<Mutex<Vec<String>>>,
    /// Its working directory, empty: every process of a run can be found by where it runs.
    dir: TempDir,
}

impl InventoryProcess {
    /// Starts `bin` with `env` on a free port and waits for `/health`. Every log line is
    /// kept, and also given to `sink` when there is one.
    pub async fn start(
        bin: &Path,
        name: &str,
        env: &BTreeMap<String, String>,
        sink: Option<LogSink>,
    ) -> anyhow::Result<Self> {
        let mut last_log = String::new();
        for _ in 0..START_ATTEMPTS {
            let port = free_port()?;
            let dir = tempfile::tempdir()?;
            let mut command = Command::new(bin);
            command
                // An inherited token would lock the tests out of resets; an empty one is
                // refused at start-up, so none at all unless `env` names one.
                .env_remove("ADMIN_TOKEN")
                .env("PORT", port.to_string())
                .envs(env)
                .current_dir(dir.path())
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            let mut process = ProcessGroup::spawn(&mut command, Signal::SIGTERM, DEFAULT_GRACE)
                .with_context(|| format!("cannot run {}", bin.display()))?;
            let log = Arc::new(Mutex::new(Vec::new()));
            for stream in [
                process
                    .take_stdout()
                    .map(|s| Box::new(s) as Box<dyn tokio::io::AsyncRead + Unpin + Send>),
                process
                    .take_stderr()
                    .map(|s| Box::new(s) as Box<dyn tokio::io::AsyncRead + Unpin + Send>),
            ]
            .into_iter()
            .flatten()
            {
                tokio::spawn(collect(stream, name.to_owned(), log.clone(), sink.clone()));
            }
            let mut instance = InventoryProcess {
                process,
                port,
                name: name.to_owned(),
                log,
                dir,
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
            if self.process.has_exited() {
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
        self.process.id()
    }

    /// Its working directory.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn log(&self) -> String {
        self.log.lock().map(|l| l.join("\n")).unwrap_or_default()
    }

    /// Sends a signal by name (`KILL`, `STOP`, `CONT`, `TERM`) to the instance.
    pub async fn signal(&self, name: &str) -> anyhow::Result<()> {
        self.process.signal(signal_named(name)?)
    }

    /// Waits for the process to exit, for at most `within`; its exit status, if it did.
    pub async fn wait_exit(&mut self, within: Duration) -> Option<ExitStatus> {
        self.process.wait_exit(within).await
    }

    /// SIGTERM (the instance drains and exits), bounded, then nothing of it is left.
    pub async fn stop(&mut self) -> Option<ExitStatus> {
        self.process.stop().await
    }
}

async fn collect(
    stream: Box<dyn tokio::io::AsyncRead + Unpin + Send>,
    name: String,
    log: Arc<Mutex<Vec<String>>>,
    sink: Option<LogSink>,
) {
    let mut lines = BufReader::new(stream).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        if let Some(sink) = &sink {
            sink(&name, &line);
        }
        if let Ok(mut log) = log.lock() {
            log.push(line);
        }
    }
}

//! Real processes on free loopback ports: a `redis-server` and `inventory` instances, for the
//! fault scenarios and the integration tests alike. Each is killed when its handle drops;
//! a failure to start comes with the process's own log.
//!
//! Every child leads a process group of its own ([`ProcessGroup`]), and is stopped by
//! signalling that group: whatever it forked (nginx's workers, Redis's rewrite child) goes
//! with it, even once the leader is gone and they have been adopted by init.

use std::collections::{BTreeMap, BTreeSet};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::str::FromStr;
use std::sync::{Arc, Mutex, Once};
use std::time::Duration;

use anyhow::{Context, bail};
use nix::sys::signal::{Signal, kill, killpg};
use nix::sys::wait::{Id, WaitPidFlag, WaitStatus, waitid};
use nix::unistd::Pid;
use redis::aio::MultiplexedConnection;
use tempfile::TempDir;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, ChildStderr, ChildStdout, Command};
use tokio::time::Instant;

use crate::timeline::Timeline;

/// A port the OS had free a moment ago; servers that then fail to bind it are retried.
pub fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

const START_ATTEMPTS: usize = 5;

/// A child started as the leader of a new process group, stopped with its whole group: the
/// graceful signal, a bounded wait for the leader, then SIGKILL to every member left, then
/// the leader reaped. Killing only the leader is what left nginx's workers running, adopted
/// by init and still listening.
///
/// The group is signalled only while its leader is unreaped: a zombie still holds its pid,
/// so the group's id cannot have been handed to another process (with a `pid_max` of 32768
/// that happens within minutes on a busy machine). Nothing here reaps the leader except
/// [`kill`](Self::kill), which sweeps the group first.
///
/// Dropping it stops it the same way, synchronously (a `Drop` cannot await): a test that
/// panics still takes its processes with it.
pub struct ProcessGroup {
    child: Child,
    /// The leader's pid, which is also the group's id; `None` once the leader is reaped.
    pid: Option<Pid>,
    status: Option<ExitStatus>,
    graceful: Signal,
    grace: Duration,
}

/// How long a stop waits for the leader after the graceful signal before killing the group.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(5);

/// Bounds the wait for a leader that has been sent SIGKILL; only a process stuck in the
/// kernel could take longer.
const REAP_WITHIN: Duration = Duration::from_secs(5);

impl ProcessGroup {
    /// Spawns `command` in a new process group; `graceful` is what [`stop`](Self::stop)
    /// sends first (nginx's graceful stop is `SIGQUIT`, most others' `SIGTERM`).
    pub fn spawn(
        command: &mut Command,
        graceful: Signal,
        grace: Duration,
    ) -> std::io::Result<Self> {
        let child = command.process_group(0).kill_on_drop(false).spawn()?;
        let pid = child.id().map(|id| Pid::from_raw(id as i32));
        if let Some(pid) = pid {
            live_groups(|groups| groups.insert(pid.as_raw()));
        }
        Ok(Self {
            child,
            pid,
            status: None,
            graceful,
            grace,
        })
    }

    pub fn id(&self) -> Option<u32> {
        self.pid.map(|pid| pid.as_raw() as u32)
    }

    pub fn take_stdout(&mut self) -> Option<ChildStdout> {
        self.child.stdout.take()
    }

    pub fn take_stderr(&mut self) -> Option<ChildStderr> {
        self.child.stderr.take()
    }

    /// Sends `signal` to the leader alone, as `kill PID` would.
    pub fn signal(&self, signal: Signal) -> anyhow::Result<()> {
        let pid = self.pid.context("the process has already been collected")?;
        kill(pid, signal).with_context(|| format!("kill -{signal} {pid}"))
    }

    fn signal_group(&self, signal: Signal) {
        if let Some(pid) = self.pid {
            // ESRCH only means that nothing is left in the group.
            let _ = killpg(pid, signal);
        }
    }

    /// Whether the leader has exited, without reaping it (so the group id stays ours).
    pub fn has_exited(&self) -> bool {
        let Some(pid) = self.pid else { return true };
        let flags = WaitPidFlag::WEXITED | WaitPidFlag::WNOHANG | WaitPidFlag::WNOWAIT;
        !matches!(waitid(Id::Pid(pid), flags), Ok(WaitStatus::StillAlive))
    }

    /// The graceful signal to the group (and `SIGCONT`, so a stopped process can act on
    /// it), up to the grace period for the leader to exit, then [`kill`](Self::kill).
    pub async fn stop(&mut self) -> Option<ExitStatus> {
        self.ask_to_exit();
        let deadline = Instant::now() + self.grace;
        while !self.has_exited() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        self.kill()
    }

    fn ask_to_exit(&self) {
        self.signal_group(self.graceful);
        self.signal_group(Signal::SIGCONT);
    }

    /// SIGKILL to everything left in the group, then reaps the leader; its exit status
    /// (the one it had already exited with, if it had).
    pub fn kill(&mut self) -> Option<ExitStatus> {
        if self.pid.is_none() {
            return self.status;
        }
        self.signal_group(Signal::SIGKILL);
        let deadline = std::time::Instant::now() + REAP_WITHIN;
        while std::time::Instant::now() < deadline {
            match self.child.try_wait() {
                Ok(Some(status)) => {
                    if let Some(pid) = self.pid.take() {
                        live_groups(|groups| groups.remove(&pid.as_raw()));
                    }
                    self.status = Some(status);
                    break;
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(5)),
                Err(_) => break,
            }
        }
        self.status
    }

    /// Waits at most `within` for the leader to exit by itself (a crash, a signal the
    /// caller sent), then sweeps its group and reaps it; its exit status, if it did exit.
    pub async fn wait_exit(&mut self, within: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + within;
        while !self.has_exited() {
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        self.kill()
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        if self.pid.is_none() {
            return;
        }
        self.ask_to_exit();
        let deadline = std::time::Instant::now() + self.grace;
        while !self.has_exited() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        self.kill();
    }
}

/// Process groups started and not yet reaped, killed if this process is interrupted or
/// terminated: a group of its own no longer receives the terminal's Ctrl-C nor a test
/// runner's signal to the test's group, and a process killed by a signal runs no `Drop`.
static LIVE_GROUPS: Mutex<BTreeSet<i32>> = Mutex::new(BTreeSet::new());

fn live_groups<T>(f: impl FnOnce(&mut BTreeSet<i32>) -> T) -> T {
    let mut groups = LIVE_GROUPS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let out = f(&mut groups);
    drop(groups);
    sweep_groups_on_fatal_signals();
    out
}

/// Once per process: on SIGINT, SIGTERM or SIGHUP, kill every live group and exit as the
/// signal would have (128 + its number). Its own runtime on its own thread, because the
/// caller's may be a test's, gone when that test ends.
fn sweep_groups_on_fatal_signals() {
    static INSTALLED: Once = Once::new();
    INSTALLED.call_once(|| {
        use tokio::signal::unix::{SignalKind, signal};
        let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        else {
            return;
        };
        let kinds = [
            (SignalKind::interrupt(), Signal::SIGINT),
            (SignalKind::terminate(), Signal::SIGTERM),
            (SignalKind::hangup(), Signal::SIGHUP),
        ];
        // Registered before returning, so no group can outlive a signal sent from now on.
        let streams: Vec<_> = {
            let _entered = runtime.enter();
            kinds
                .into_iter()
                .filter_map(|(kind, number)| signal(kind).ok().map(|s| (s, number)))
                .collect()
        };
        std::thread::spawn(move || {
            runtime.block_on(async move {
                let waits = streams.into_iter().map(|(mut stream, number)| {
                    Box::pin(async move {
                        stream.recv().await;
                        number
                    })
                });
                let (number, _, _) = futures_util::future::select_all(waits).await;
                let groups = LIVE_GROUPS
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                for &pgid in groups.iter() {
                    let _ = killpg(Pid::from_raw(pgid), Signal::SIGKILL);
                }
                std::process::exit(128 + number as i32);
            })
        });
    });
}

/// One line of `/proc/PID/stat`, reduced to what tells where a process belongs.
#[derive(Debug, Clone)]
pub struct ProcStat {
    pub pid: u32,
    pub ppid: u32,
    pub pgrp: u32,
    /// `R`, `S`, `D`, `T`, `Z` (exited, waiting to be reaped), ...
    pub state: char,
    pub comm: String,
}

impl ProcStat {
    pub fn read(pid: u32) -> Option<Self> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
        let (head, rest) = stat.rsplit_once(") ")?;
        let comm = head.split_once(" (")?.1.to_owned();
        let mut fields = rest.split_whitespace();
        let state = fields.next()?.chars().next()?;
        let ppid = fields.next()?.parse().ok()?;
        let pgrp = fields.next()?.parse().ok()?;
        Some(Self {
            pid,
            ppid,
            pgrp,
            state,
            comm,
        })
    }

    /// Every process on the machine (those that vanish while being read are skipped).
    pub fn all() -> Vec<Self> {
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return Vec::new();
        };
        entries
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
            .filter_map(Self::read)
            .collect()
    }

    /// Exited but not reaped: a zombie holds no memory, no port and runs nothing.
    pub fn is_zombie(&self) -> bool {
        self.state == 'Z'
    }
}

/// The live members of process group `pgid`.
pub fn group_members(pgid: u32) -> Vec<ProcStat> {
    ProcStat::all()
        .into_iter()
        .filter(|p| p.pgrp == pgid && !p.is_zombie())
        .collect()
}

/// A signal by its name without the `SIG` prefix, as `kill -NAME` takes it.
pub fn signal_named(name: &str) -> anyhow::Result<Signal> {
    Signal::from_str(&format!("SIG{}", name.trim_start_matches("SIG")))
        .with_context(|| format!("no signal called {name}"))
}

pub struct RedisProcess {
    process: ProcessGroup,
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
            let process = spawn_redis(port, dir.path(), &extra)?;
            let server = RedisProcess {
                process,
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
            self.process = spawn_redis(self.port, self.dir.path(), &self.extra)?;
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

fn spawn_redis(port: u16, dir: &Path, extra: &[String]) -> anyhow::Result<ProcessGroup> {
    let mut command = Command::new("redis-server");
    command
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
        .current_dir(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    ProcessGroup::spawn(&mut command, Signal::SIGTERM, DEFAULT_GRACE)
        .context("cannot run redis-server: install it (apt-get install redis-server)")
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
        // The fault scenarios and tests ask for long work on purpose.
        ("MAX_WORK_MS", "60000"),
        ("LOG_FORMAT", "json"),
        ("RUST_LOG", "info,inventory=debug"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
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
                tokio::spawn(collect(
                    stream,
                    name.to_owned(),
                    log.clone(),
                    timeline.clone(),
                ));
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

/// nginx in front of two instances, from the native stack's template, on a free port, for
/// the benchmarks and the integration tests. The master leads the group its workers
/// inherit; it is stopped with SIGQUIT (finish the requests in flight), then SIGKILL to the
/// group: a master killed alone leaves its workers running, adopted by init, still
/// listening.
pub struct NginxProcess {
    process: ProcessGroup,
    pub port: u16,
    /// Configuration, logs and working directory; removed after the process is gone (fields
    /// drop in order).
    dir: TempDir,
}

impl NginxProcess {
    pub async fn start(upstreams: [u16; 2]) -> anyhow::Result<Self> {
        let nginx = ["/usr/sbin/nginx", "/usr/bin/nginx"]
            .into_iter()
            .find(|p| Path::new(p).exists())
            .context("nginx is not installed (apt-get install nginx)")?;
        let conf_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../nginx");
        let template = std::fs::read_to_string(conf_dir.join("nginx.native.conf.template"))
            .context("nginx template")?;
        let mut last_log = String::new();
        for _ in 0..START_ATTEMPTS {
            let dir = tempfile::tempdir()?;
            std::fs::create_dir_all(dir.path().join("nginx-tmp"))?;
            let port = free_port()?;
            let conf = template
                .replace("@RUN_DIR@", &dir.path().display().to_string())
                .replace("@CONF_DIR@", &conf_dir.display().to_string())
                .replace("@NGINX_PORT@", &port.to_string())
                .replace("@APP1_PORT@", &upstreams[0].to_string())
                .replace("@APP2_PORT@", &upstreams[1].to_string());
            let conf_path = dir.path().join("nginx.conf");
            std::fs::write(&conf_path, conf)?;
            let error_log = dir.path().join("nginx-error.log");
            let mut command = Command::new(nginx);
            command
                .arg("-e")
                .arg(&error_log)
                .arg("-p")
                .arg(dir.path())
                .arg("-c")
                .arg(&conf_path)
                // In the foreground, so it stays our child and keeps the group we give it.
                .args(["-g", "daemon off;"])
                .current_dir(dir.path())
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            // Its own group, stopped with nginx's graceful SIGQUIT: the workers go too.
            let process = ProcessGroup::spawn(&mut command, Signal::SIGQUIT, DEFAULT_GRACE)
                .context("cannot run nginx")?;
            let mut server = NginxProcess { process, port, dir };
            if server.wait_listening(Duration::from_secs(5)).await {
                return Ok(server);
            }
            last_log = read_log(&error_log);
        }
        bail!("nginx did not start; its error log:\n{last_log}")
    }

    async fn wait_listening(&mut self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if self.process.has_exited() {
                return false;
            }
            if tokio::net::TcpStream::connect(("127.0.0.1", self.port))
                .await
                .is_ok()
            {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        false
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn error_log(&self) -> String {
        read_log(&self.dir.path().join("nginx-error.log"))
    }

    pub fn access_log(&self) -> String {
        read_log(&self.dir.path().join("nginx-access.log"))
    }

    /// Graceful stop (SIGQUIT), bounded, then SIGKILL to whatever is left of the group.
    pub async fn stop(&mut self) {
        self.process.stop().await;
    }

    /// The master's pid, which is also its group's id.
    pub fn pid(&self) -> Option<u32> {
        self.process.id()
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

/// Resident memory of a process, from `/proc/<pid>/status`, in KiB.
pub fn rss_kib(pid: u32) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// A shell that forks two children, like a master and its workers; all three ignore the
    /// graceful signals, like a server stuck in a request.
    fn stubborn_tree(grace: Duration) -> ProcessGroup {
        let mut command = Command::new("sh");
        command
            .args(["-c", "trap '' TERM QUIT; sleep 600 & sleep 600 & wait"])
            .stdin(Stdio::null());
        ProcessGroup::spawn(&mut command, Signal::SIGTERM, grace).unwrap()
    }

    async fn wait_for_members(pgid: u32, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while group_members(pgid).len() < n {
            assert!(Instant::now() < deadline, "the tree never grew to {n}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    async fn assert_empty_soon(pgid: u32) {
        // SIGKILL is delivered asynchronously; a process adopted by init may still be on its
        // way out for a moment.
        let deadline = Instant::now() + Duration::from_secs(2);
        while !group_members(pgid).is_empty() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(group_members(pgid).is_empty(), "{:?}", group_members(pgid));
    }

    #[tokio::test]
    async fn a_stop_empties_the_group_even_when_it_ignores_the_graceful_signal() {
        let mut tree = stubborn_tree(Duration::from_millis(200));
        let pgid = tree.id().unwrap();
        wait_for_members(pgid, 3).await;
        let started = Instant::now();
        assert!(tree.stop().await.is_some(), "the leader is reaped");
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "the wait is bounded"
        );
        assert_eq!(tree.id(), None);
        assert_empty_soon(pgid).await;
    }

    #[tokio::test]
    async fn dropping_a_group_takes_what_its_leader_forked() {
        let tree = stubborn_tree(Duration::from_millis(100));
        let pgid = tree.id().unwrap();
        wait_for_members(pgid, 3).await;
        drop(tree);
        assert_empty_soon(pgid).await;
    }

    /// The way the harness used to stop nginx: the leader killed alone leaves its children
    /// running. Waiting for the leader's exit sweeps them.
    #[tokio::test]
    async fn children_outlive_a_leader_killed_alone_until_the_group_is_swept() {
        let mut tree = stubborn_tree(Duration::from_millis(100));
        let pgid = tree.id().unwrap();
        wait_for_members(pgid, 3).await;
        tree.signal(Signal::SIGKILL).unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(
            group_members(pgid).len(),
            2,
            "the children survive their leader"
        );
        let status = tree.wait_exit(Duration::from_secs(2)).await.unwrap();
        assert!(!status.success());
        assert_empty_soon(pgid).await;
    }

    #[test]
    fn signals_are_named_as_the_kill_command_names_them() {
        assert_eq!(signal_named("KILL").unwrap(), Signal::SIGKILL);
        assert_eq!(signal_named("SIGSTOP").unwrap(), Signal::SIGSTOP);
        assert!(signal_named("NOPE").is_err());
    }
}

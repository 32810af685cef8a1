//! The lock bench behind `lock-bench`: C client processes, each one `Locks` with its own
//! connections (as C service instances would be), loop acquire -> `GET counter` ->
//! `SET counter+1` -> release on one lock for a fixed time. rslock runs the same loop in the
//! same invocation as the reference.
//!
//! Processes, not tasks: a herd or a hand-off between instances costs a wake-up of another
//! process (and its scheduling on a busy machine), which tasks of one runtime would hide.
//! The parent starts its own `redis-server`, spawns its own executable as the clients, lets
//! them connect, starts them together, and then reads what only Redis knows: the final
//! counter (lost updates) and `INFO commandstats` (what a critical section costs).

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use inventory::config::WaitMode;
use inventory::lock::{LockError, Locks, RedisLock, Strategy};
use inventory::metrics::Metrics;
use inventory::store::Store;
use redis::AsyncCommands;
use serde::{Deserialize, Serialize};
use testkit::RedisProcess;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::Command;
use tokio::time::Instant;

/// The item whose lock the clients share; the counter lives in the same hash slot.
const ITEM: &str = "bench";
const COUNTER: &str = "inventory:{bench}:counter";
const RSLOCK_RESOURCE: &str = "inventory:{bench}:rslock";

/// Who is measured: one of the project's Redis locks with a way of waiting, or rslock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Contender {
    /// `tenure_ms`: how long a lock passes between one client's critical sections before it
    /// goes back to Redis (`LOCK_TENURE_MS`); `None` is the instance's default.
    Project {
        lock: RedisLock,
        wait: WaitMode,
        tenure_ms: Option<u64>,
    },
    Rslock,
}

impl Contender {
    /// `rslock`, or `<strategy>/<wait>` (`lua-release/notify`), optionally with a tenure in
    /// milliseconds (`fenced/notify:0`, the plain hand-off). Every refusal names what is
    /// valid: the bench is run by hand, from a list typed on the command line.
    pub fn parse(text: &str) -> anyhow::Result<Self> {
        if text == "rslock" {
            return Ok(Contender::Rslock);
        }
        let (text, tenure_ms) = match text.split_once(':') {
            Some((text, ms)) => (text, Some(tenure(ms)?)),
            None => (text, None),
        };
        let (strategy, wait) = text.split_once('/').with_context(|| {
            format!(
                "{text:?}: expected rslock or <strategy>/<wait>, <wait> one of {}",
                wait_modes()
            )
        })?;
        let Strategy::Redis(lock) = strategy.parse::<Strategy>().map_err(anyhow::Error::msg)?
        else {
            bail!("{strategy}: only the strategies whose lock lives in Redis can be benched");
        };
        let wait = <WaitMode as clap::ValueEnum>::from_str(wait, true).map_err(|_| {
            anyhow::anyhow!(
                "{text}: unknown wait mode {wait:?}; valid: {}",
                wait_modes()
            )
        })?;
        // Only the notify waiter keeps a lock between an instance's own sales
        // (`LOCK_TENURE_MS`); a tenure given to another would be ignored, and the run
        // labelled with a setting it never had.
        if let Some(ms) = tenure_ms.filter(|_| wait != WaitMode::Notify) {
            bail!(
                "{text}:{ms}: a tenure applies only to notify ({strategy}/notify:{ms}); \
                 drop it from the other wait modes"
            );
        }
        Ok(Contender::Project {
            lock,
            wait,
            tenure_ms,
        })
    }

    pub fn strategy(self) -> &'static str {
        match self {
            Contender::Project { lock, .. } => lock.info().name,
            Contender::Rslock => "rslock",
        }
    }

    /// The way of waiting, with the tenure when one is set (`notify:0`).
    pub fn wait(self) -> String {
        match self {
            Contender::Project {
                wait, tenure_ms, ..
            } => {
                let name = clap::ValueEnum::to_possible_value(&wait)
                    .map(|v| v.get_name().to_owned())
                    .unwrap_or_default();
                match tenure_ms {
                    Some(ms) => format!("{name}:{ms}"),
                    None => name,
                }
            }
            // rslock retries after a random 0-200 ms sleep, three times per `lock()` call.
            Contender::Rslock => "random-retry".to_owned(),
        }
    }

    pub fn label(self) -> String {
        match self {
            Contender::Project { .. } => format!("{}/{}", self.strategy(), self.wait()),
            Contender::Rslock => "rslock".to_owned(),
        }
    }
}

/// The longest tenure: the service's own bound on `LOCK_TENURE_MS`.
const MAX_TENURE_MS: u64 = 1_000;

/// A tenure in whole milliseconds, 0 ..= [`MAX_TENURE_MS`].
fn tenure(ms: &str) -> anyhow::Result<u64> {
    match ms.parse::<u64>() {
        Ok(ms) if ms <= MAX_TENURE_MS => Ok(ms),
        _ => bail!(
            "{ms:?}: the tenure is whole milliseconds, 0 to {MAX_TENURE_MS} (as LOCK_TENURE_MS)"
        ),
    }
}

/// The wait modes by the names `LOCK_WAIT` takes, for the messages that refuse one.
fn wait_modes() -> String {
    <WaitMode as clap::ValueEnum>::value_variants()
        .iter()
        .filter_map(clap::ValueEnum::to_possible_value)
        .map(|v| v.get_name().to_owned())
        .collect::<Vec<_>>()
        .join(", ")
}

/// How every client of a run behaves.
#[derive(Debug, Clone, Copy)]
pub struct Load {
    pub duration: Duration,
    /// How long one acquire may wait before it counts as a timeout.
    pub wait_budget: Duration,
    pub ttl: Duration,
    /// Worker threads of each client's Tokio runtime.
    pub client_threads: usize,
}

/// Worker threads of a client process unless told otherwise: what `make up` gives a
/// service instance, half the cores (at least one), since the clients, like instances,
/// share the machine's cores with each other and with Redis.
pub fn default_client_threads() -> usize {
    let cores = std::thread::available_parallelism().map_or(2, usize::from);
    (cores / 2).max(1)
}

impl Default for Load {
    fn default() -> Self {
        Self {
            duration: Duration::from_secs(10),
            wait_budget: Duration::from_secs(10),
            ttl: Duration::from_secs(30),
            client_threads: default_client_threads(),
        }
    }
}

/// What one client process reports to the parent (one JSON line on its stdout).
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct ClientReport {
    pub ops: u64,
    pub timeouts: u64,
    pub errors: u64,
    /// Acquire attempts sent to Redis (the project's locks only; rslock's are counted by
    /// the parent from `INFO commandstats`).
    pub attempts: u64,
    /// Time each successful acquire took, in microseconds.
    pub acquire_us: Vec<u32>,
    /// CPU time the process (all its threads) spent during the loop, in microseconds.
    #[serde(default)]
    pub cpu_us: u64,
}

/// How many of the busiest commands a report lists.
const BUSIEST: usize = 8;

/// One line of the bench's output.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RunReport {
    pub strategy: String,
    pub wait: String,
    pub clients: usize,
    pub duration_s: f64,
    pub ops: u64,
    pub ops_per_s: f64,
    pub acquire_ms: Percentiles,
    pub timeouts: u64,
    pub errors: u64,
    /// Critical sections completed minus the increments the counter kept.
    pub lost_updates: i64,
    pub fewest_ops: u64,
    pub most_ops: u64,
    /// fewest / most: 1 is perfectly fair, 0 means a client was starved.
    pub fairness: f64,
    pub attempts_per_cs: f64,
    /// Every command Redis ran during the run, per critical section.
    pub commands_per_cs: f64,
    /// The busiest commands, per critical section.
    pub commands: BTreeMap<String, f64>,
    /// CPU time per critical section, in microseconds: the client processes together, and
    /// redis-server (`INFO cpu`). On a machine with few cores the bench is CPU-bound, so
    /// this, more than round trips, is what ops/s follows.
    #[serde(default)]
    pub client_cpu_us_per_cs: f64,
    #[serde(default)]
    pub redis_cpu_us_per_cs: f64,
}

#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq)]
pub struct Percentiles {
    pub p50: f64,
    pub p99: f64,
    pub max: f64,
}

impl RunReport {
    /// One report for rounds of the same contender at the same C: the operations over the
    /// time of all of them, the worst round's acquire times and fairness, and the costs per
    /// critical section weighted by each round's critical sections. `None` for no rounds.
    pub fn merge(rounds: &[RunReport]) -> Option<RunReport> {
        let first = rounds.first()?;
        let ops: u64 = rounds.iter().map(|r| r.ops).sum();
        let duration_s: f64 = rounds.iter().map(|r| r.duration_s).sum();
        let weighted = |f: &dyn Fn(&RunReport) -> f64| {
            let total: f64 = rounds.iter().map(|r| f(r) * r.ops as f64).sum();
            round(total / (ops.max(1) as f64), 2)
        };
        let worst = |f: &dyn Fn(&RunReport) -> f64| rounds.iter().map(f).fold(0.0, f64::max);
        let least_fair = rounds
            .iter()
            .min_by(|a, b| a.fairness.total_cmp(&b.fairness))
            .unwrap_or(first);
        let mut commands: BTreeMap<String, f64> = BTreeMap::new();
        for r in rounds.iter() {
            for (name, per_cs) in &r.commands {
                *commands.entry(name.clone()).or_default() += per_cs * r.ops as f64;
            }
        }
        // Each round lists its busiest few; so does the merge.
        let mut busiest: Vec<(String, f64)> = commands
            .into_iter()
            .map(|(name, total)| (name, round(total / (ops.max(1) as f64), 2)))
            .collect();
        busiest.sort_by(|a, b| b.1.total_cmp(&a.1));
        let commands: BTreeMap<String, f64> = busiest.into_iter().take(BUSIEST).collect();
        Some(RunReport {
            strategy: first.strategy.clone(),
            wait: first.wait.clone(),
            clients: first.clients,
            duration_s: round(duration_s, 2),
            ops,
            ops_per_s: round(ops as f64 / duration_s.max(1e-9), 1),
            acquire_ms: Percentiles {
                p50: worst(&|r| r.acquire_ms.p50),
                p99: worst(&|r| r.acquire_ms.p99),
                max: worst(&|r| r.acquire_ms.max),
            },
            timeouts: rounds.iter().map(|r| r.timeouts).sum(),
            errors: rounds.iter().map(|r| r.errors).sum(),
            lost_updates: rounds.iter().map(|r| r.lost_updates).sum(),
            fewest_ops: least_fair.fewest_ops,
            most_ops: least_fair.most_ops,
            fairness: least_fair.fairness,
            attempts_per_cs: weighted(&|r| r.attempts_per_cs),
            commands_per_cs: weighted(&|r| r.commands_per_cs),
            commands,
            client_cpu_us_per_cs: weighted(&|r| r.client_cpu_us_per_cs),
            redis_cpu_us_per_cs: weighted(&|r| r.redis_cpu_us_per_cs),
        })
    }

    pub fn label(&self) -> String {
        if self.strategy == "rslock" {
            self.strategy.clone()
        } else {
            format!("{}/{}", self.strategy, self.wait)
        }
    }
}

/// Runs `clients` copies of `exe` (which must answer `child` like `lock-bench` does) against
/// `redis`, and measures them.
pub async fn run(
    redis: &RedisProcess,
    exe: &Path,
    contender: Contender,
    clients: usize,
    load: Load,
) -> anyhow::Result<RunReport> {
    let mut admin = redis.connection().await?;
    redis::cmd("FLUSHALL").query_async::<()>(&mut admin).await?;

    let mut children = Vec::with_capacity(clients);
    let parent = std::process::id().to_string();
    for id in 0..clients {
        // `kill_on_drop` covers an error return only: a bench killed by a signal runs no
        // `Drop`, and its clients used to run out their `--duration` adopted by init. Each
        // client therefore asks the kernel to kill it when its parent dies
        // ([`die_with_parent`]), and is told which pid that parent is.
        let mut child = Command::new(exe)
            .arg("child")
            .args(["--parent", &parent])
            .args(["--redis", &redis.url()])
            .args(["--contender", &contender.label()])
            .args(["--id", &id.to_string()])
            .args(["--duration-ms", &load.duration.as_millis().to_string()])
            .args([
                "--wait-budget-ms",
                &load.wait_budget.as_millis().to_string(),
            ])
            .args(["--ttl-ms", &load.ttl.as_millis().to_string()])
            .args(["--threads", &load.client_threads.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("cannot run {}", exe.display()))?;
        let stdin = child.stdin.take().context("child stdin")?;
        let stdout = BufReader::new(child.stdout.take().context("child stdout")?).lines();
        children.push((child, stdin, stdout));
    }
    // Everyone connected before anyone starts, so the first seconds are not a race of
    // process start-ups.
    for (_, _, stdout) in &mut children {
        let line = tokio::time::timeout(Duration::from_secs(30), stdout.next_line())
            .await
            .context("a client did not get ready within 30 s")??;
        if line.as_deref() != Some("ready") {
            bail!("a client said {line:?} instead of ready");
        }
    }
    redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async::<()>(&mut admin)
        .await?;
    let redis_cpu_before = redis_cpu_us(&mut admin).await?;
    let started = Instant::now();
    for (_, stdin, _) in &mut children {
        stdin.write_all(b"go\n").await?;
        stdin.flush().await?;
    }
    let mut reports = Vec::with_capacity(clients);
    for (mut child, _stdin, mut stdout) in children {
        let line = tokio::time::timeout(load.duration * 3 + load.wait_budget, stdout.next_line())
            .await
            .context("a client did not report in time")??
            .context("a client exited without a report")?;
        reports.push(serde_json::from_str::<ClientReport>(&line).context("client report")?);
        let _ = child.wait().await;
    }
    let elapsed = started.elapsed().min(load.duration).as_secs_f64().max(1e-9);
    let redis_cpu = redis_cpu_us(&mut admin)
        .await?
        .saturating_sub(redis_cpu_before);
    let counter: Option<i64> = admin.get(COUNTER).await?;
    let stats: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut admin)
        .await?;
    Ok(summarize(
        contender,
        clients,
        elapsed,
        &reports,
        counter.unwrap_or(0),
        &parse_commandstats(&stats),
        redis_cpu,
    ))
}

/// redis-server's CPU time so far (user + system), in microseconds.
async fn redis_cpu_us(admin: &mut redis::aio::MultiplexedConnection) -> anyhow::Result<u64> {
    let info: String = redis::cmd("INFO").arg("cpu").query_async(admin).await?;
    Ok(parse_redis_cpu_us(&info))
}

fn parse_redis_cpu_us(info: &str) -> u64 {
    let seconds: f64 = info
        .lines()
        .filter_map(|line| line.trim().split_once(':'))
        .filter(|(name, _)| *name == "used_cpu_user" || *name == "used_cpu_sys")
        .filter_map(|(_, value)| value.parse::<f64>().ok())
        .sum();
    (seconds * 1e6) as u64
}

/// CPU time of every thread of this process so far, in microseconds, from
/// `/proc/self/task/*/schedstat` (nanoseconds on a CPU, unlike `/proc/self/stat`'s 10 ms
/// ticks); 0 where there is no such file.
fn own_cpu_us() -> u64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    let ns: u64 = tasks
        .filter_map(Result::ok)
        .filter_map(|task| std::fs::read_to_string(task.path().join("schedstat")).ok())
        .filter_map(|line| line.split_whitespace().next()?.parse::<u64>().ok())
        .sum();
    ns / 1000
}

fn summarize(
    contender: Contender,
    clients: usize,
    elapsed: f64,
    reports: &[ClientReport],
    counter: i64,
    calls: &BTreeMap<String, u64>,
    redis_cpu_us: u64,
) -> RunReport {
    let ops: u64 = reports.iter().map(|r| r.ops).sum();
    let per_cs = |n: u64| if ops == 0 { 0.0 } else { n as f64 / ops as f64 };
    let fewest = reports.iter().map(|r| r.ops).min().unwrap_or(0);
    let most = reports.iter().map(|r| r.ops).max().unwrap_or(0);
    let mut acquire: Vec<u32> = reports.iter().flat_map(|r| r.acquire_us.clone()).collect();
    acquire.sort_unstable();
    let attempts = match contender {
        Contender::Project { .. } => reports.iter().map(|r| r.attempts).sum(),
        // Each rslock attempt is one `SET NX PX`; the clients' own writes are the other SETs.
        Contender::Rslock => calls.get("set").copied().unwrap_or(0).saturating_sub(ops),
    };
    let total: u64 = calls.values().sum();
    let mut commands: Vec<(&String, &u64)> = calls.iter().collect();
    commands.sort_by(|a, b| b.1.cmp(a.1));
    RunReport {
        strategy: contender.strategy().to_owned(),
        wait: contender.wait(),
        clients,
        duration_s: round(elapsed, 2),
        ops,
        ops_per_s: round(ops as f64 / elapsed, 1),
        acquire_ms: Percentiles {
            p50: percentile_ms(&acquire, 0.50),
            p99: percentile_ms(&acquire, 0.99),
            max: percentile_ms(&acquire, 1.0),
        },
        timeouts: reports.iter().map(|r| r.timeouts).sum(),
        errors: reports.iter().map(|r| r.errors).sum(),
        lost_updates: ops as i64 - counter,
        fewest_ops: fewest,
        most_ops: most,
        fairness: if most == 0 {
            0.0
        } else {
            round(fewest as f64 / most as f64, 3)
        },
        attempts_per_cs: round(per_cs(attempts), 2),
        commands_per_cs: round(per_cs(total), 2),
        commands: commands
            .into_iter()
            .take(BUSIEST)
            .map(|(name, &n)| (name.clone(), round(per_cs(n), 2)))
            .collect(),
        client_cpu_us_per_cs: round(per_cs(reports.iter().map(|r| r.cpu_us).sum()), 1),
        redis_cpu_us_per_cs: round(per_cs(redis_cpu_us), 1),
    }
}

fn round(x: f64, digits: i32) -> f64 {
    let scale = 10f64.powi(digits);
    (x * scale).round() / scale
}

fn percentile_ms(sorted_us: &[u32], p: f64) -> f64 {
    if sorted_us.is_empty() {
        return 0.0;
    }
    let index = ((sorted_us.len() - 1) as f64 * p).round() as usize;
    round(f64::from(sorted_us[index]) / 1000.0, 2)
}

/// `cmdstat_get:calls=3,usec=...` lines, by command, without the bench's own bookkeeping.
pub fn parse_commandstats(info: &str) -> BTreeMap<String, u64> {
    info.lines()
        .filter_map(|line| {
            let (name, fields) = line.trim().strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = fields
                .split(',')
                .find_map(|f| f.strip_prefix("calls="))?
                .parse()
                .ok()?;
            Some((name.to_owned(), calls))
        })
        .filter(|(name, _)| !(name == "info" || name == "flushall" || name.starts_with("config")))
        .collect()
}

/// Makes this client process die (SIGKILL) when the bench that spawned it, pid `parent`,
/// dies, however it dies: SIGTERM, Ctrl-C sent to its pid alone, or SIGKILL, none of which
/// runs the bench's `Drop`s. To call first thing in the client, before its runtime starts.
///
/// The kernel sends the signal when the *thread* that forked the client exits: the bench
/// spawns its clients from the thread that `block_on` runs on, the main thread, which lives
/// as long as the bench does.
pub fn die_with_parent(parent: u32) -> anyhow::Result<()> {
    // Set here rather than in a `pre_exec` hook of the bench's: the workspace forbids
    // `unsafe`, and the check below closes the same window that the hook would.
    #[cfg(target_os = "linux")]
    nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)
        .context("prctl(PR_SET_PDEATHSIG)")?;
    // The bench may have died between the fork and the line above, when there was nothing
    // yet to send the signal: this process has then been adopted by another.
    let now = nix::unistd::getppid().as_raw();
    if u32::try_from(now).ok() != Some(parent) {
        bail!("the bench (pid {parent}) is gone; this client's parent is now pid {now}");
    }
    Ok(())
}

/// One client process: connect, say `ready`, wait for `go`, loop for `load.duration`, and
/// print a [`ClientReport`].
pub async fn client(
    redis_url: &str,
    contender: Contender,
    id: usize,
    load: Load,
) -> anyhow::Result<()> {
    let mut stdout = tokio::io::stdout();
    let mut stdin = BufReader::new(tokio::io::stdin()).lines();
    let report = match contender {
        Contender::Project {
            lock,
            wait,
            tenure_ms,
        } => {
            let store = Store::new(
                redis_url,
                ITEM,
                Duration::from_secs(5),
                Arc::new(Metrics::default()),
            )?;
            let mut locks = Locks::new(store.clone(), load.ttl, wait, Duration::ZERO);
            if let Some(ms) = tenure_ms {
                locks = locks.with_tenure(Duration::from_millis(ms));
            }
            store.ping().await?;
            // Lets the release listener connect before the clock starts.
            tokio::time::sleep(Duration::from_millis(200)).await;
            stdout.write_all(b"ready\n").await?;
            stdout.flush().await?;
            wait_for_go(&mut stdin).await?;
            let cpu = own_cpu_us();
            // The loop runs in a task, as a sale does in an instance: on `block_on`'s own
            // thread every Redis reply (delivered by the connection's task on a worker)
            // would wake another thread, which costs rslock's cheap critical sections
            // twice what they cost themselves. rslock's loop runs the same way.
            let mut report = tokio::spawn(async move {
                let mut report =
                    project_loop(&store, &locks, Strategy::Redis(lock), id, load).await;
                // The others may still be running: a lock parked for this loop's next
                // critical section goes back now, not with its lease after the exit.
                locks.close().await;
                report.attempts = locks.attempts();
                report
            })
            .await?;
            report.cpu_us = own_cpu_us().saturating_sub(cpu);
            report
        }
        Contender::Rslock => {
            let manager = rslock::LockManager::new(vec![redis_url.to_owned()]);
            let mut conn = redis::Client::open(redis_url)?
                .get_multiplexed_async_connection()
                .await?;
            redis::cmd("PING").query_async::<()>(&mut conn).await?;
            stdout.write_all(b"ready\n").await?;
            stdout.flush().await?;
            wait_for_go(&mut stdin).await?;
            let cpu = own_cpu_us();
            let mut report =
                tokio::spawn(async move { rslock_loop(&manager, &mut conn, load).await }).await?;
            report.cpu_us = own_cpu_us().saturating_sub(cpu);
            report
        }
    };
    let mut line = serde_json::to_vec(&report)?;
    line.push(b'\n');
    stdout.write_all(&line).await?;
    stdout.flush().await?;
    Ok(())
}

/// The bench's `go`. Its stdin closed instead means the bench is gone: the loop is not
/// run, as nobody would read its report.
async fn wait_for_go(
    stdin: &mut tokio::io::Lines<BufReader<tokio::io::Stdin>>,
) -> anyhow::Result<()> {
    match stdin.next_line().await? {
        Some(_) => Ok(()),
        None => bail!("the bench closed this client's stdin before the start"),
    }
}

async fn project_loop(
    store: &Store,
    locks: &Locks,
    strategy: Strategy,
    id: usize,
    load: Load,
) -> ClientReport {
    let mut report = ClientReport::default();
    let end = Instant::now() + load.duration;
    let mut n = 0u64;
    while Instant::now() < end {
        n += 1;
        let owner: Arc<str> = format!("bench{id}:{n}").into();
        let started = Instant::now();
        let guard = match locks
            .acquire(strategy, &owner, started + load.wait_budget, false)
            .await
        {
            Ok(guard) => guard,
            Err(LockError::Timeout { .. }) => {
                report.timeouts += 1;
                continue;
            }
            // The bench sets no REPLICA_ACKS: an unreplicated acquire counts as an error.
            Err(LockError::Redis(_) | LockError::NotReplicated { .. }) => {
                report.errors += 1;
                continue;
            }
        };
        report.acquire_us.push(micros(started.elapsed()));
        let counted = store
            .call(|mut c| async move { increment(&mut c).await })
            .await;
        if locks.release(guard).await.is_err() || counted.is_err() {
            report.errors += 1;
        } else {
            report.ops += 1;
        }
    }
    report
}

async fn rslock_loop(
    manager: &rslock::LockManager,
    conn: &mut redis::aio::MultiplexedConnection,
    load: Load,
) -> ClientReport {
    let mut report = ClientReport::default();
    let end = Instant::now() + load.duration;
    while Instant::now() < end {
        let started = Instant::now();
        let guard = match tokio::time::timeout(
            load.wait_budget,
            manager.acquire(RSLOCK_RESOURCE, load.ttl),
        )
        .await
        {
            Ok(Ok(guard)) => guard,
            Ok(Err(_)) => {
                report.errors += 1;
                continue;
            }
            Err(_) => {
                report.timeouts += 1;
                continue;
            }
        };
        report.acquire_us.push(micros(started.elapsed()));
        let counted = increment(conn).await;
        guard.release().await;
        if counted.is_err() {
            report.errors += 1;
        } else {
            report.ops += 1;
        }
    }
    report
}

/// The critical section: a read-modify-write that loses updates unless the lock holds.
async fn increment<C: redis::aio::ConnectionLike + Send>(c: &mut C) -> redis::RedisResult<()> {
    let value: Option<i64> = redis::cmd("GET").arg(COUNTER).query_async(c).await?;
    redis::cmd("SET")
        .arg(COUNTER)
        .arg(value.unwrap_or(0) + 1)
        .query_async::<()>(c)
        .await
}

fn micros(d: Duration) -> u32 {
    u32::try_from(d.as_micros()).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commandstats_lines_are_read_by_command_without_the_bench_bookkeeping() {
        let info = "# Commandstats\r\ncmdstat_get:calls=10,usec=5,usec_per_call=0.5\r\n\
                    cmdstat_evalsha:calls=4,usec=9\r\ncmdstat_config:calls=1,usec=1\r\n";
        let calls = parse_commandstats(info);
        assert_eq!(calls.get("get"), Some(&10));
        assert_eq!(calls.get("evalsha"), Some(&4));
        assert_eq!(calls.get("config"), None);
    }

    #[test]
    fn redis_cpu_is_user_plus_system_in_microseconds() {
        let info = "# CPU\r\nused_cpu_sys:1.500000\r\nused_cpu_user:0.250000\r\n\
                    used_cpu_sys_children:9.000000\r\n";
        assert_eq!(parse_redis_cpu_us(info), 1_750_000);
    }

    #[test]
    fn contenders_parse_from_their_labels() {
        for label in [
            "rslock",
            "lua-release/notify",
            "fenced/spin",
            "fenced/notify:0",
        ] {
            assert_eq!(Contender::parse(label).unwrap().label(), label);
        }
        assert!(Contender::parse("atomic/notify").is_err());
        assert!(Contender::parse("fenced").is_err());
    }

    #[test]
    fn a_wrong_wait_mode_or_tenure_is_refused_naming_what_is_valid() {
        let refusal = |label: &str| {
            Contender::parse(label)
                .map(Contender::label)
                .expect_err(label)
                .to_string()
        };
        for label in ["fenced/bogus", "fenced", "fenced/"] {
            let why = refusal(label);
            assert!(why.contains("notify, pubsub, spin"), "{label}: {why}");
        }
        for label in ["fenced/spin:5", "lua-release/pubsub:0"] {
            let why = refusal(label);
            assert!(why.contains("only to notify"), "{label}: {why}");
        }
        for label in ["fenced/notify:-1", "fenced/notify:x", "fenced/notify:1001"] {
            let why = refusal(label);
            assert!(why.contains("0 to 1000"), "{label}: {why}");
        }
        assert!(Contender::parse("fenced/notify:1000").is_ok());
        assert!(
            Contender::parse("fenced/NOTIFY").is_ok(),
            "as LOCK_WAIT takes it"
        );
    }

    #[test]
    fn a_run_reports_lost_updates_fairness_and_costs_per_critical_section() {
        let clients = [
            ClientReport {
                ops: 10,
                attempts: 12,
                acquire_us: vec![1000, 3000],
                ..ClientReport::default()
            },
            ClientReport {
                ops: 5,
                attempts: 8,
                acquire_us: vec![2000],
                ..ClientReport::default()
            },
        ];
        let calls = BTreeMap::from([("get".to_owned(), 15), ("set".to_owned(), 30)]);
        let contender = Contender::parse("fenced/notify").unwrap();
        let report = summarize(contender, 2, 1.0, &clients, 14, &calls, 45);
        assert_eq!(report.lost_updates, 1);
        assert_eq!(report.fairness, 0.5);
        assert_eq!(report.attempts_per_cs, round(20.0 / 15.0, 2));
        assert_eq!(report.commands_per_cs, 3.0);
        assert_eq!(report.acquire_ms.max, 3.0);
        assert_eq!(report.acquire_ms.p50, 2.0);
        assert_eq!(report.redis_cpu_us_per_cs, 3.0);
        let rslock = summarize(Contender::Rslock, 2, 1.0, &clients, 15, &calls, 0);
        assert_eq!(rslock.attempts_per_cs, 1.0, "SETs minus the counter writes");
    }

    #[test]
    fn rounds_merge_into_their_total_rate_the_worst_waits_and_weighted_costs() {
        let contender = Contender::parse("fenced/notify").unwrap();
        let client = |ops, acquire_us| ClientReport {
            ops,
            attempts: ops,
            acquire_us,
            ..ClientReport::default()
        };
        // One round: its length, its two clients (ops, one acquire each), the counter it
        // left and the GETs Redis counted.
        let one_round = |seconds, clients: [(u64, u32); 2], counter, gets| {
            let clients = clients.map(|(ops, acquire_us)| client(ops, vec![acquire_us]));
            let calls = BTreeMap::from([("get".to_owned(), gets)]);
            summarize(contender, 2, seconds, &clients, counter, &calls, 0)
        };
        let fast = one_round(1.0, [(30, 1000), (30, 5000)], 59, 60);
        let slow = one_round(3.0, [(10, 2000), (20, 2000)], 30, 90);
        let merged = RunReport::merge(&[fast.clone(), slow]).unwrap();
        assert_eq!(merged.ops, 90);
        assert_eq!(merged.duration_s, 4.0);
        assert_eq!(merged.ops_per_s, 22.5, "all operations over all the time");
        assert_eq!(
            merged.acquire_ms.max, 5.0,
            "the worst round's longest acquire"
        );
        assert_eq!(merged.fairness, 0.5, "the least fair round");
        assert_eq!((merged.fewest_ops, merged.most_ops), (10, 20));
        assert_eq!(merged.lost_updates, 1);
        // 60 GETs for 60 critical sections and 90 for 30: 150 for 90.
        assert_eq!(merged.commands_per_cs, round(150.0 / 90.0, 2));
        assert_eq!(merged.commands["get"], round(150.0 / 90.0, 2));
        assert_eq!(RunReport::merge(std::slice::from_ref(&fast)), Some(fast));
        assert_eq!(RunReport::merge(&[]), None);
    }
}

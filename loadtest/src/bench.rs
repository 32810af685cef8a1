//! `make bench`: every performance figure of the project in one run, on one machine, so that
//! the ratios compare numbers taken minutes apart under the same load: the lock bench
//! against rslock, sales through nginx against the serial lock-cycle limit and against
//! `GET /health`, the load generator against `wrk`, and memory after 256 connections. It
//! writes a README section (a table and an SVG chart) between two markers.

use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use inventory::lock::Strategy;
use serde::Serialize;
use testkit::{InventoryProcess, NginxProcess, RedisProcess};

use crate::lockbench::{self, Contender, Load, RunReport};
use crate::{LoadTest, Plan};

pub const README_START: &str = "<!-- bench:start (written by `make bench`) -->";
pub const README_END: &str = "<!-- bench:end -->";

/// What one `make bench` asks for.
#[derive(Debug, Clone)]
pub struct Options {
    pub clients: Vec<usize>,
    pub lock_duration: Duration,
    pub http_duration: Duration,
    pub connections: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct HttpFigures {
    pub connections: usize,
    pub wrk_health_rps: f64,
    /// Worker threads of each instance.
    pub worker_threads: usize,
    pub loadtest_health_rps: f64,
    /// Rounds of (`wrk` GET /health req/s, `loadtest --health` req/s), one right after the
    /// other: a single pair measured the neighbours as much as the generator (0.74-0.85x
    /// in runs where the same binaries measured 0.83-0.99x minutes apart).
    pub health_rounds: Vec<(f64, f64)>,
    /// Sales/s through nginx, stock that never runs out, by strategy.
    pub sales_per_s: Vec<(String, f64)>,
    /// Sales that did not end in a 200, by strategy.
    pub sale_errors: Vec<(String, u64)>,
    /// `atomic` sales/s with `wrk` sending the POSTs (the load generator's own cost taken
    /// out of the comparison with `GET /health`), counted by the server's audit: rounds
    /// of (`wrk` GET /health req/s, `wrk` atomic sales/s), one right after the other, so
    /// that each ratio is taken under the same load from the machine's other tenants.
    pub wrk_atomic_rounds: Vec<(f64, f64)>,
    /// Answers other than 2xx that `wrk` saw in those runs.
    pub wrk_atomic_non_2xx: u64,
    pub rss_idle_mib: Vec<f64>,
    pub rss_after_256_mib: Vec<f64>,
}

pub struct Results {
    pub machine: String,
    pub locks: Vec<RunReport>,
    /// One client, a lock cycle with nobody to wait for: `fenced/notify` (its tenures pass
    /// the lock to the client's next cycle), then `fenced/notify:0` (every cycle in Redis).
    /// The sale path is measured against both: the second is the issue's serial lock cycle
    /// (acquire, read, write, release, each in Redis); the first is two round trips, and with
    /// one-thread clients it runs about three times as fast as the second.
    pub serial: Vec<RunReport>,
    pub http: Option<HttpFigures>,
}

/// Rounds the lock bench splits each contender's time into, at each C.
const LOCK_ROUNDS: u32 = 2;

/// The lock bench: rslock and the project's waits at each C, interleaved.
pub async fn locks(
    lock_bench: &Path,
    options: &Options,
    mut progress: impl FnMut(&RunReport),
) -> anyhow::Result<(Vec<RunReport>, Vec<RunReport>)> {
    let contenders = [
        "rslock",
        "lua-release/notify",
        "fenced/notify",
        "lua-release/notify:0",
        "fenced/notify:0",
        "lua-release/pubsub",
        "fenced/pubsub",
        "lua-release/spin",
        "fenced/spin",
    ]
    .map(Contender::parse)
    .into_iter()
    .collect::<anyhow::Result<Vec<_>>>()?;
    let load = Load {
        duration: options.lock_duration,
        ..Load::default()
    };
    let redis = RedisProcess::start(&[]).await?;
    let mut serial = Vec::new();
    for contender in ["fenced/notify", "fenced/notify:0"] {
        let report =
            lockbench::run(&redis, lock_bench, Contender::parse(contender)?, 1, load).await?;
        progress(&report);
        serial.push(report);
    }
    // In rounds, each contender once per round: the machine's slow spells (other guests'
    // steal time moves results by 2x here) then fall on every contender rather than on
    // whichever ran during them. Ratios to rslock are what the table is for.
    let round_load = Load {
        duration: load.duration / LOCK_ROUNDS,
        ..load
    };
    let mut reports = Vec::new();
    for &clients in &options.clients {
        let mut rounds: Vec<Vec<RunReport>> = vec![Vec::new(); contenders.len()];
        for _ in 0..LOCK_ROUNDS {
            for (&contender, done) in contenders.iter().zip(&mut rounds) {
                let report =
                    lockbench::run(&redis, lock_bench, contender, clients, round_load).await?;
                progress(&report);
                done.push(report);
            }
        }
        reports.extend(rounds.iter().filter_map(|done| RunReport::merge(done)));
    }
    Ok((reports, serial))
}

/// Redis, two instances and nginx on free ports; then `wrk` and the load generator on
/// `GET /health`, sales at `connections`, and memory after a run at 256.
pub async fn http(inventory: &Path, options: &Options) -> anyhow::Result<HttpFigures> {
    let redis = RedisProcess::start(&[]).await?;
    let mut instances = Vec::new();
    let cores = std::thread::available_parallelism().map_or(2, usize::from);
    let worker_threads = (cores / 2).max(1);
    for name in ["app1", "app2"] {
        let mut env = testkit::default_env(&redis.url(), name);
        // Logs at debug cost more than a sale; a production instance logs warnings.
        env.insert("RUST_LOG".into(), "warn".into());
        // As `make up` runs them: the two instances share the cores with nginx, Redis and
        // the load generator, and each gets half of them.
        env.insert("WORKER_THREADS".into(), worker_threads.to_string());
        instances.push(InventoryProcess::start(inventory, name, &env, None).await?);
    }
    let nginx = NginxProcess::start([instances[0].port, instances[1].port]).await?;
    let rss = |instances: &[InventoryProcess]| {
        instances
            .iter()
            .map(|i| {
                let kib = i.pid().and_then(testkit::rss_kib).unwrap_or(0);
                (kib as f64 / 1024.0 * 10.0).round() / 10.0
            })
            .collect::<Vec<_>>()
    };
    let rss_idle_mib = rss(&instances);
    let plan = |strategies: Vec<Strategy>, connections: usize| Plan {
        target: nginx.url(),
        strategies,
        stock: 1_000_000_000,
        requests: 1,
        concurrency: connections,
        work_ms: 0,
        admin_token: None,
    };
    let d = options.http_duration;
    let health = LoadTest::new(plan(Vec::new(), options.connections))?;
    // Rounds of two seconds: each opens its connections again, which a shorter round
    // would weigh too much.
    let mut health_rounds = Vec::new();
    for _ in 0..(d.as_secs() / 2).max(ATOMIC_ROUNDS) {
        let by_wrk = wrk(&nginx.url(), options.connections, 2 * ROUND).await?;
        let by_loadtest = health.health(2 * ROUND).await?.requests_per_s;
        health_rounds.push((by_wrk, by_loadtest));
    }
    let wrk_health_rps = mean(health_rounds.iter().map(|r| r.0));
    let loadtest_health_rps = mean(health_rounds.iter().map(|r| r.1));

    let mut sales_per_s = Vec::new();
    let mut sale_errors = Vec::new();
    let strategies: Vec<Strategy> = ["fenced", "lua-release", "atomic"]
        .iter()
        .map(|s| s.parse().map_err(anyhow::Error::msg))
        .collect::<anyhow::Result<_>>()?;
    let sales = LoadTest::new(plan(strategies.clone(), options.connections))?.with_duration(d);
    for &strategy in &strategies {
        let report = sales.run_strategy(strategy, None).await?;
        sales_per_s.push((report.strategy.clone(), report.sales_per_s));
        sale_errors.push((report.strategy.clone(), report.errors));
    }
    let mut wrk_atomic_rounds = Vec::new();
    let mut wrk_atomic_non_2xx = 0;
    for _ in 0..d.as_secs().max(ATOMIC_ROUNDS) {
        let health = wrk(&nginx.url(), options.connections, ROUND).await?;
        let (sales, non_2xx) = wrk_atomic(&nginx.url(), options.connections, ROUND).await?;
        wrk_atomic_rounds.push((health, sales));
        wrk_atomic_non_2xx += non_2xx;
    }
    let wide = LoadTest::new(plan(strategies.clone(), 256))?.with_duration(d);
    wide.run_strategy(strategies[0], None).await?;
    let rss_after_256_mib = rss(&instances);
    drop(nginx);
    Ok(HttpFigures {
        connections: options.connections,
        worker_threads,
        wrk_health_rps,
        loadtest_health_rps,
        health_rounds,
        sales_per_s,
        sale_errors,
        wrk_atomic_rounds,
        wrk_atomic_non_2xx,
        rss_idle_mib,
        rss_after_256_mib,
    })
}

/// Fewest rounds of `wrk` on `GET /health` then on `atomic` sales (one per second of the
/// HTTP duration otherwise), and of `wrk` then `loadtest` on `GET /health`; the median
/// ratio is reported.
const ATOMIC_ROUNDS: u64 = 3;

/// The machine's other tenants come and go within seconds, and a short round gives both
/// halves of a ratio the same neighbours.
const ROUND: Duration = Duration::from_secs(1);

/// The median of the rounds' sales over `GET /health` ratios.
pub fn median_ratio(rounds: &[(f64, f64)]) -> f64 {
    let mut ratios: Vec<f64> = rounds
        .iter()
        .map(|(health, sales)| sales / health.max(1.0))
        .collect();
    ratios.sort_by(f64::total_cmp);
    match ratios.len() {
        0 => 0.0,
        n if n % 2 == 1 => ratios[n / 2],
        n => (ratios[n / 2 - 1] + ratios[n / 2]) / 2.0,
    }
}

/// The mean of `values`, 0 for none.
fn mean(values: impl Iterator<Item = f64>) -> f64 {
    let (sum, n) = values.fold((0.0, 0usize), |(sum, n), v| (sum + v, n + 1));
    sum / n.max(1) as f64
}

/// Each round's ratio, second over first, as the table lists them.
fn rounds_of(rounds: &[(f64, f64)]) -> String {
    rounds
        .iter()
        .map(|(first, second)| format!("{:.2}", second / first.max(1.0)))
        .collect::<Vec<_>>()
        .join(", ")
}

/// `wrk` on `GET /health`, two threads (the machine's cores), its Requests/sec.
async fn wrk(target: &str, connections: usize, duration: Duration) -> anyhow::Result<f64> {
    let text = run_wrk(&format!("{target}/health"), connections, duration, None).await?;
    text.lines()
        .find_map(|l| l.strip_prefix("Requests/sec:"))
        .and_then(|v| v.trim().parse().ok())
        .with_context(|| format!("no Requests/sec in wrk's output:\n{text}"))
}

/// `wrk`'s output for `url`, with a Lua `script` when given.
async fn run_wrk(
    url: &str,
    connections: usize,
    duration: Duration,
    script: Option<&Path>,
) -> anyhow::Result<String> {
    let mut command = tokio::process::Command::new("wrk");
    command
        .args(["-t", "2", "-c", &connections.to_string()])
        .args(["-d", &format!("{}s", duration.as_secs().max(1))]);
    if let Some(script) = script {
        command.arg("-s").arg(script);
    }
    let out = command
        .arg(url)
        .output()
        .await
        .context("cannot run wrk (apt-get install wrk)")?;
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `atomic` sales sent by `wrk` (a POST script): `wrk` reads no body, so the sales are
/// counted by the server's audit, before and after, and its non-2xx count is kept.
async fn wrk_atomic(
    target: &str,
    connections: usize,
    duration: Duration,
) -> anyhow::Result<(f64, u64)> {
    let http = reqwest::Client::new();
    let reset = http
        .put(format!("{target}/inventory"))
        .json(&serde_json::json!({ "stock": crate::Plan::ENDLESS_STOCK }))
        .send()
        .await?;
    anyhow::ensure!(reset.status().is_success(), "reset: {}", reset.status());
    let sales = || async {
        let audit: serde_json::Value = http
            .get(format!("{target}/inventory/audit"))
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?;
        audit["sales"]
            .as_i64()
            .with_context(|| format!("no sales in the audit: {audit}"))
    };
    let script = std::env::temp_dir().join(format!("bench-post-{}.lua", std::process::id()));
    std::fs::write(&script, "wrk.method = \"POST\"\n")?;
    let before = sales().await?;
    let started = std::time::Instant::now();
    let text = run_wrk(
        &format!("{target}/inventory/sale?strategy=atomic"),
        connections,
        duration,
        Some(&script),
    )
    .await;
    let _ = std::fs::remove_file(&script);
    let text = text?;
    let secs = started.elapsed().as_secs_f64().max(1e-9);
    let sold = sales().await? - before;
    let non_2xx = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("Non-2xx or 3xx responses:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    Ok(((sold as f64 / secs).round(), non_2xx))
}

/// CPU model, cores, kernel, and the Redis version, for the README.
pub async fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|m| m.trim_start_matches([' ', '\t', ':']).to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, usize::from);
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|k| k.trim().to_owned())
        .unwrap_or_default();
    let redis = tokio::process::Command::new("redis-server")
        .arg("--version")
        .output()
        .await
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .split_whitespace()
                .find_map(|w| w.strip_prefix("v="))
                .unwrap_or("?")
                .to_owned()
        })
        .unwrap_or_else(|_| "?".into());
    format!("{cores} cores ({cpu}), Linux {kernel}, redis-server {redis}")
}

fn find<'a>(locks: &'a [RunReport], label: &str, clients: usize) -> Option<&'a RunReport> {
    locks
        .iter()
        .find(|r| r.label() == label && r.clients == clients)
}

/// The README section: machine, lock table with ratios to rslock, HTTP figures.
pub fn markdown(results: &Results, svg_path: &str) -> String {
    let mut md = String::new();
    let _ = writeln!(md, "{README_START}");
    let _ = writeln!(
        md,
        "Measured by `make bench` on {}; other work shared the machine, so compare \
         within the table, not with other runs.\n",
        results.machine
    );
    let _ = writeln!(
        md,
        "**Lock bench** (`make bench-lock`): C client processes, each its own `Locks`, loop \
         acquire -> `GET` -> `SET +1` -> release on one lock; rslock 0.10 runs the same loop. \
         Fairness is the fewest critical sections of a client over the most. Each contender \
         runs in {LOCK_ROUNDS} rounds, interleaved with the others at the same C; ops/s is over \
         all of them, acquire times and fairness are the worst round's.\n"
    );
    let _ = writeln!(
        md,
        "| C | contender | ops/s | x rslock | acquire p50 / p99 / max ms | fairness | \
         attempts/cs | Redis cmds/cs | timeouts | lost |"
    );
    let _ = writeln!(md, "|---:|---|---:|---:|---|---:|---:|---:|---:|---:|");
    for r in &results.locks {
        let base = find(&results.locks, "rslock", r.clients).map_or(0.0, |b| b.ops_per_s);
        let ratio = if base > 0.0 { r.ops_per_s / base } else { 0.0 };
        let _ = writeln!(
            md,
            "| {} | {} | {:.0} | {:.2} | {} / {} / {} | {:.2} | {:.2} | {:.1} | {} | {} |",
            r.clients,
            r.label(),
            r.ops_per_s,
            ratio,
            r.acquire_ms.p50,
            r.acquire_ms.p99,
            r.acquire_ms.max,
            r.fairness,
            r.attempts_per_cs,
            r.commands_per_cs,
            r.timeouts,
            r.lost_updates
        );
    }
    let serial = |i: usize| results.serial.get(i).map_or(0.0, |r| r.ops_per_s);
    let _ = writeln!(
        md,
        "\n`:0` is `LOCK_TENURE_MS=0`: every release goes to the Redis queue (the plain \
         hand-off).\n\nSerial lock cycle (one client, nobody to wait for): {:.0} cycles/s \
         with `fenced/notify` (its tenures pass the lock to the client's next cycle), {:.0} \
         with `fenced/notify:0`.\n",
        serial(0),
        serial(1)
    );
    let _ = writeln!(md, "![ops/s and max acquire against C]({svg_path})\n");
    if let Some(h) = &results.http {
        let _ = writeln!(
            md,
            "**Through nginx** (two instances of {} worker thread(s) each, {} connections, a stock that never runs out):\n",
            h.worker_threads, h.connections
        );
        let _ = writeln!(md, "| measure | value | ratio |");
        let _ = writeln!(md, "|---|---:|---|");
        let _ = writeln!(
            md,
            "| `wrk` GET /health | {:.0} req/s | |",
            h.wrk_health_rps
        );
        let _ = writeln!(
            md,
            "| `loadtest --health`, each round right after `wrk` GET /health | {:.0} req/s | {:.2}x wrk (median of the rounds {}) |",
            h.loadtest_health_rps,
            median_ratio(&h.health_rounds),
            rounds_of(&h.health_rounds)
        );
        for (strategy, sales) in &h.sales_per_s {
            let ratio = if strategy == "atomic" {
                format!("{:.2}x wrk GET /health", sales / h.wrk_health_rps.max(1.0))
            } else {
                format!(
                    "{:.2}x the serial lock cycle in Redis, {:.2}x the cycle passed within a tenure",
                    sales / serial(1).max(1.0),
                    sales / serial(0).max(1.0)
                )
            };
            let _ = writeln!(md, "| `{strategy}` sales | {sales:.0} sales/s | {ratio} |");
        }
        let rounds = rounds_of(&h.wrk_atomic_rounds);
        let mean_sales = mean(h.wrk_atomic_rounds.iter().map(|r| r.1));
        let _ = writeln!(
            md,
            "| `atomic` sales sent by `wrk`, each round right after `wrk` GET /health (counted by the audit; {} non-2xx) | {:.0} sales/s | {:.2}x wrk GET /health (median of the rounds {rounds}) |",
            h.wrk_atomic_non_2xx,
            mean_sales,
            median_ratio(&h.wrk_atomic_rounds)
        );
        let _ = writeln!(
            md,
            "| RSS per instance, idle | {:?} MiB | |",
            h.rss_idle_mib
        );
        let _ = writeln!(
            md,
            "| RSS per instance after 256 connections | {:?} MiB | |",
            h.rss_after_256_mib
        );
    }
    targets_table(&mut md, results);
    let _ = write!(md, "{README_END}");
    md
}

/// One of the performance goals the bench reports on, as measured in this run.
#[derive(Debug, Clone, PartialEq)]
pub struct Target {
    pub what: String,
    pub measured: f64,
    pub bound: f64,
    /// Whether the bound is a floor (`>=`) or a ceiling (`<=`).
    pub at_least: bool,
}

impl Target {
    fn new(what: impl Into<String>, measured: f64, bound: f64, at_least: bool) -> Self {
        Target {
            what: what.into(),
            measured,
            bound,
            at_least,
        }
    }

    pub fn met(&self) -> bool {
        if self.at_least {
            self.measured >= self.bound
        } else {
            self.measured <= self.bound
        }
    }

    /// How far from the bound a target that is not met stands, in words.
    fn verdict(&self) -> String {
        if self.met() {
            return "met".to_owned();
        }
        let by = (self.measured - self.bound).abs();
        let missed = if self.at_least { "short by" } else { "over by" };
        match self.bound {
            b if b > 0.0 => format!("{missed} {} ({:.0}%)", figure(by), 100.0 * by / b),
            _ => format!("{missed} {}", figure(by)),
        }
    }
}

fn figure(x: f64) -> String {
    if x.fract() == 0.0 {
        format!("{x:.0}")
    } else {
        format!("{x:.2}")
    }
}

/// The goals of the performance work, each against what this run measured: the lock bench's
/// at C=16 and C=64 for `lua-release` and `fenced` (ops/s against rslock's, fairness, longest
/// acquire, timeouts, lost updates, attempts per critical section), the sale path's, memory
/// and the load generator's. A goal whose figures this run did not measure is left out.
pub fn targets(results: &Results) -> Vec<Target> {
    let mut out = Vec::new();
    for clients in [16, 64] {
        let Some(base) = find(&results.locks, "rslock", clients) else {
            continue;
        };
        for label in ["lua-release/notify", "fenced/notify"] {
            let Some(r) = find(&results.locks, label, clients) else {
                continue;
            };
            let at = |what: &str| format!("`{label}` at C={clients}: {what}");
            let ratio = if base.ops_per_s > 0.0 {
                r.ops_per_s / base.ops_per_s
            } else {
                0.0
            };
            out.push(Target::new(at("x rslock ops/s"), round2(ratio), 1.3, true));
            out.push(Target::new(at("fairness"), r.fairness, 0.7, true));
            out.push(Target::new(
                at("max acquire ms"),
                r.acquire_ms.max,
                100.0,
                false,
            ));
            out.push(Target::new(at("timeouts"), r.timeouts as f64, 0.0, false));
            out.push(Target::new(
                at("lost updates"),
                r.lost_updates as f64,
                0.0,
                false,
            ));
            out.push(Target::new(
                at("attempts/cs"),
                r.attempts_per_cs,
                1.5,
                false,
            ));
        }
    }
    let Some(h) = &results.http else {
        return out;
    };
    let serial = results.serial.get(1).map_or(0.0, |r| r.ops_per_s);
    let sold = |name: &str| h.sales_per_s.iter().find(|(s, _)| s == name).map(|s| s.1);
    if let Some(fenced) = sold("fenced").filter(|_| serial > 0.0) {
        out.push(Target::new(
            "`fenced` sales through nginx, x the serial lock cycle in Redis",
            round2(fenced / serial),
            0.5,
            true,
        ));
    }
    if let Some(atomic) = sold("atomic").filter(|_| h.wrk_health_rps > 0.0) {
        // Both ways of sending the sales must reach it: the load generator's and `wrk`'s.
        let ratio = (atomic / h.wrk_health_rps).min(median_ratio(&h.wrk_atomic_rounds));
        out.push(Target::new(
            "`atomic` sales through nginx, x `GET /health` (the lower of the two ways sent)",
            round2(ratio),
            0.7,
            true,
        ));
    }
    if let Some(rss) = h.rss_after_256_mib.iter().copied().reduce(f64::max) {
        out.push(Target::new(
            "RSS of the larger instance after 256 connections, MiB",
            rss,
            30.0,
            false,
        ));
    }
    if !h.health_rounds.is_empty() {
        out.push(Target::new(
            "`loadtest --health`, x `wrk` (median of the rounds)",
            round2(median_ratio(&h.health_rounds)),
            0.8,
            true,
        ));
    }
    out
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

fn targets_table(md: &mut String, results: &Results) {
    let targets = targets(results);
    if targets.is_empty() {
        return;
    }
    let met = targets.iter().filter(|t| t.met()).count();
    let _ = writeln!(
        md,
        "\n**Targets** ({met} of {} met in this run):\n",
        targets.len()
    );
    let _ = writeln!(md, "| target | measured | bound | verdict |");
    let _ = writeln!(md, "|---|---:|---|---|");
    for t in &targets {
        let bound = if t.at_least { ">=" } else { "<=" };
        let _ = writeln!(
            md,
            "| {} | {} | {bound} {} | {} |",
            t.what,
            figure(t.measured),
            figure(t.bound),
            t.verdict()
        );
    }
}

/// Replaces the section between the markers, or appends it under a heading.
pub fn splice_readme(readme: &str, section: &str) -> String {
    match (readme.find(README_START), readme.find(README_END)) {
        (Some(start), Some(end)) if end > start => format!(
            "{}{section}{}",
            &readme[..start],
            &readme[end + README_END.len()..]
        ),
        _ => format!("{}\n\n## Performance\n\n{section}\n", readme.trim_end()),
    }
}

/// Two panels against C: ops/s and max acquire (log scale), one line per contender.
pub fn svg(locks: &[RunReport]) -> String {
    let mut clients: Vec<usize> = locks.iter().map(|r| r.clients).collect();
    clients.sort_unstable();
    clients.dedup();
    let mut labels: Vec<String> = Vec::new();
    for r in locks {
        if !labels.contains(&r.label()) {
            labels.push(r.label());
        }
    }
    let colors = [
        "#444444", "#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02",
    ];
    let (w, h, pad) = (360.0, 240.0, 50.0);
    let max_ops = locks.iter().map(|r| r.ops_per_s).fold(1.0, f64::max) * 1.1;
    let max_ms = locks.iter().map(|r| r.acquire_ms.max).fold(1.0, f64::max);
    let log_top = max_ms.max(10.0).log10().ceil();
    let x = |c: usize| {
        let i = clients.iter().position(|&k| k == c).unwrap_or(0) as f64;
        let n = (clients.len().max(2) - 1) as f64;
        pad + i * (w - 2.0 * pad) / n
    };
    let y_ops = |v: f64| h - pad + (v / max_ops) * (2.0 * pad - h);
    let y_ms = |v: f64| {
        let l = v.max(0.1).log10().max(-1.0);
        h - pad + ((l + 1.0) / (log_top + 1.0)) * (2.0 * pad - h)
    };
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{}" font-family="sans-serif" font-size="11">"#,
        2.0 * w + 170.0,
        h + 10.0
    );
    for (panel, title) in [(0.0, "ops/s"), (w, "max acquire, ms (log)")] {
        let _ = write!(
            s,
            r#"<g transform="translate({panel},0)"><text x="{}" y="18" text-anchor="middle" font-weight="bold">{title} vs clients</text><line x1="{pad}" y1="{}" x2="{}" y2="{}" stroke="black"/><line x1="{pad}" y1="{pad}" x2="{pad}" y2="{}" stroke="black"/>"#,
            w / 2.0,
            h - pad,
            w - pad,
            h - pad,
            h - pad
        );
        for &c in &clients {
            let _ = write!(
                s,
                r#"<text x="{}" y="{}" text-anchor="middle">{c}</text>"#,
                x(c),
                h - pad + 15.0
            );
        }
        if panel == 0.0 {
            for k in 0..=4 {
                let v = max_ops * f64::from(k) / 4.0;
                let _ = write!(
                    s,
                    r#"<text x="{}" y="{}" text-anchor="end">{v:.0}</text>"#,
                    pad - 4.0,
                    y_ops(v) + 4.0
                );
            }
        } else {
            for e in -1..=(log_top as i32) {
                let v = 10f64.powi(e);
                let _ = write!(
                    s,
                    r#"<text x="{}" y="{}" text-anchor="end">{v}</text>"#,
                    pad - 4.0,
                    y_ms(v) + 4.0
                );
            }
        }
        for (i, label) in labels.iter().enumerate() {
            let color = colors[i % colors.len()];
            let points: Vec<String> = clients
                .iter()
                .filter_map(|&c| find(locks, label, c))
                .map(|r| {
                    let y = if panel == 0.0 {
                        y_ops(r.ops_per_s)
                    } else {
                        y_ms(r.acquire_ms.max)
                    };
                    format!("{:.1},{:.1}", x(r.clients), y)
                })
                .collect();
            // The reference dashed, so it stands out from the project's lines.
            let dash = if label == "rslock" {
                r#" stroke-dasharray="6 3""#
            } else {
                ""
            };
            let _ = write!(
                s,
                r#"<polyline fill="none" stroke="{color}" stroke-width="2"{dash} points="{}"/>"#,
                points.join(" ")
            );
        }
        let _ = write!(s, "</g>");
    }
    for (i, label) in labels.iter().enumerate() {
        let color = colors[i % colors.len()];
        let y = 40.0 + 16.0 * i as f64;
        let _ = write!(
            s,
            r#"<rect x="{}" y="{}" width="12" height="4" fill="{color}"/><text x="{}" y="{}">{label}</text>"#,
            2.0 * w + 5.0,
            y - 4.0,
            2.0 * w + 22.0,
            y
        );
    }
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_readme_section_is_replaced_between_its_markers_or_appended_once() {
        let first = splice_readme("# Title\n", &format!("{README_START}\nA\n{README_END}"));
        assert!(first.contains("## Performance"));
        let second = splice_readme(&first, &format!("{README_START}\nB\n{README_END}"));
        assert!(
            second.contains("\nB\n") && !second.contains("\nA\n"),
            "{second}"
        );
        assert_eq!(second.matches("## Performance").count(), 1);
    }

    fn run(label: &str, clients: usize, ops_per_s: f64, max_ms: f64, lost: i64) -> RunReport {
        let (strategy, wait) = label.split_once('/').unwrap_or((label, "random-retry"));
        serde_json::from_value(serde_json::json!({
            "strategy": strategy, "wait": wait, "clients": clients, "duration_s": 5.0,
            "ops": 1000, "ops_per_s": ops_per_s,
            "acquire_ms": {"p50": 0.0, "p99": max_ms / 2.0, "max": max_ms},
            "timeouts": 0, "errors": 0, "lost_updates": lost, "fewest_ops": 80,
            "most_ops": 100, "fairness": 0.8, "attempts_per_cs": 0.1, "commands_per_cs": 4.0,
            "commands": {}
        }))
        .expect("a run report")
    }

    #[test]
    fn every_target_is_reported_with_how_far_a_missed_one_falls_short() {
        let locks = vec![
            run("rslock", 64, 10_000.0, 2000.0, 0),
            run("lua-release/notify", 64, 15_000.0, 90.0, 0),
            run("fenced/notify", 64, 12_800.0, 101.5, 2),
            run("fenced/notify:0", 64, 99_000.0, 1.0, 0),
        ];
        let results = Results {
            machine: "test".into(),
            locks,
            serial: vec![],
            http: None,
        };
        let targets = targets(&results);
        assert_eq!(
            targets.len(),
            12,
            "six for each of the two contenders: {targets:?}"
        );
        let missed: Vec<_> = targets.iter().filter(|t| !t.met()).collect();
        let names: Vec<&str> = missed.iter().map(|t| t.what.as_str()).collect();
        assert_eq!(
            names,
            [
                "`fenced/notify` at C=64: x rslock ops/s",
                "`fenced/notify` at C=64: max acquire ms",
                "`fenced/notify` at C=64: lost updates",
            ],
            "the plain hand-off is not what the targets are about"
        );
        assert_eq!(missed[0].verdict(), "short by 0.02 (2%)");
        assert_eq!(missed[1].verdict(), "over by 1.50 (2%)");
        assert_eq!(missed[2].verdict(), "over by 2");
        let md = markdown(&results, "x.svg");
        assert!(md.contains("**Targets** (9 of 12 met in this run)"), "{md}");
        assert!(
            md.contains(
                "| `fenced/notify` at C=64: x rslock ops/s | 1.28 | >= 1.30 | short by 0.02 (2%) |"
            ),
            "{md}"
        );
        assert!(md.trim_end().ends_with(README_END));
    }

    #[test]
    fn the_http_targets_take_the_worse_of_the_two_ways_of_sending_and_the_larger_instance() {
        let h = HttpFigures {
            connections: 64,
            wrk_health_rps: 40_000.0,
            worker_threads: 1,
            loadtest_health_rps: 36_000.0,
            health_rounds: vec![
                (40_000.0, 30_000.0),
                (40_000.0, 36_000.0),
                (40_000.0, 34_000.0),
            ],
            sales_per_s: vec![("fenced".into(), 1_000.0), ("atomic".into(), 32_000.0)],
            sale_errors: vec![],
            wrk_atomic_rounds: vec![(40_000.0, 26_000.0)],
            wrk_atomic_non_2xx: 0,
            rss_idle_mib: vec![12.0, 12.0],
            rss_after_256_mib: vec![16.0, 31.5],
        };
        let results = Results {
            machine: "test".into(),
            locks: vec![],
            serial: vec![
                run("fenced/notify", 1, 6000.0, 1.0, 0),
                run("fenced/notify:0", 1, 3000.0, 1.0, 0),
            ],
            http: Some(h),
        };
        let verdicts: Vec<(String, bool)> = targets(&results)
            .into_iter()
            .map(|t| (format!("{} {}", t.what, t.measured), t.met()))
            .collect();
        assert_eq!(
            verdicts,
            [
                ("`fenced` sales through nginx, x the serial lock cycle in Redis 0.33".into(), false),
                ("`atomic` sales through nginx, x `GET /health` (the lower of the two ways sent) 0.65".into(), false),
                ("RSS of the larger instance after 256 connections, MiB 31.5".into(), false),
                ("`loadtest --health`, x `wrk` (median of the rounds) 0.85".into(), true),
            ]
        );
    }

    #[test]
    fn the_atomic_ratio_is_the_median_of_the_rounds_each_against_its_own_health_run() {
        // A round whose /health run caught a busy neighbour neither flatters nor sinks it.
        let rounds = [
            (20_000.0, 16_000.0),
            (30_000.0, 18_000.0),
            (10_000.0, 9_000.0),
        ];
        assert!((median_ratio(&rounds) - 0.8).abs() < 1e-9);
        assert!((median_ratio(&rounds[..2]) - 0.7).abs() < 1e-9);
        assert_eq!(median_ratio(&[]), 0.0);
        assert_eq!(median_ratio(&[(0.0, 5.0)]), 5.0, "no division by zero");
    }
}

//! The load generator behind the `loadtest` binary: for each strategy, reset the stock, fire
//! the sales over keep-alive connections, then read the server's audit and hold the client's
//! counts against it.
//!
//! It speaks the service's own types (`Sold`, `Audit`, `ErrorBody`), so a change to the
//! contract breaks this crate's build rather than its numbers.

pub mod bench;
pub mod conn;
pub mod failover;
pub mod html;
pub mod items;
pub mod lockbench;
pub mod picture;
pub mod scenarios;
pub mod table;
pub mod timeline;
pub mod tool;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use futures_util::{StreamExt, TryStreamExt};
use inventory::http::ErrorBody;
use inventory::lock::Strategy;
use inventory::sale::Sold;
use inventory::store::Audit;
use serde::{Deserialize, Serialize};

pub use items::{ItemReport, MAX_ITEMS};

/// What one run asks for.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Base URL of nginx or of one instance.
    pub target: String,
    pub strategies: Vec<Strategy>,
    pub stock: i64,
    pub requests: usize,
    pub concurrency: usize,
    pub work_ms: u64,
    pub admin_token: Option<String>,
}

impl Plan {
    /// The largest stock the service takes: one that a timed run never sells out.
    pub const ENDLESS_STOCK: i64 = 1_000_000_000;

    /// A throughput run's plan (with [`LoadTest::with_duration`]): `strategy` alone, no
    /// work, a stock that never runs out, no admin token.
    pub fn endless(target: String, strategy: Strategy, concurrency: usize) -> Self {
        Self {
            target,
            strategies: vec![strategy],
            stock: Self::ENDLESS_STOCK,
            requests: 1,
            concurrency,
            work_ms: 0,
            admin_token: None,
        }
    }
}

/// The result for one strategy; `--json` prints exactly this, one object per line.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct StrategyReport {
    pub strategy: String,
    pub stock: i64,
    pub requests: u64,
    /// 200: a sale.
    pub sold: u64,
    /// 409 `sold_out`.
    pub sold_out: u64,
    /// 409 `lock_lost`, `stale_fence` or `stock_changed`: refused on purpose, nothing sold,
    /// because the lock was lost or the stock changed under the sale.
    pub refused: u64,
    /// `refused`, by kind.
    #[serde(default)]
    pub refused_kinds: BTreeMap<String, u64>,
    /// Anything else: 503s, 5xx from nginx, failed connections.
    pub errors: u64,
    /// `errors`, by kind (`lock_timeout`, `redis_unavailable`, `http_502`, `connect`, ...).
    pub error_kinds: BTreeMap<String, u64>,
    /// From the server's audit: max(0, sales - initial).
    pub oversold: i64,
    /// From the server's audit: sales - (initial - remaining).
    pub lost_updates: i64,
    /// From the server's audit: how many remaining-stock values were sold more than once.
    pub duplicates: u64,
    /// Stock left, from the server's audit.
    pub remaining: i64,
    /// Sales the server recorded in its ledger.
    pub audit_sales: i64,
    /// Sales answered 200 that the server has no record of: `sold - audit_sales` when
    /// positive. A failover to a replica that never got them loses them, and the stock they
    /// took is sold again.
    #[serde(default)]
    pub lost_200: i64,
    /// The master killed by `--failover-after`.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub failover: Option<failover::Killed>,
    /// Seconds from the kill to the answer of the first sale sent after the outage began (the
    /// first request after the kill that failed); 0 when no request failed.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub resumed_after_s: Option<f64>,
    /// Sales per second until the kill: the steady rate, which the outage does not dilute.
    /// `None` for a kill less than [`MIN_RATE_WINDOW`] into the run: too short to be a rate.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub sales_per_s_before_failover: Option<f64>,
    /// 200s per instance (from `X-Instance`), every instance that answered listed: 0 for one
    /// that answered without selling.
    pub instances: BTreeMap<String, u64>,
    pub duration_s: f64,
    pub throughput_rps: f64,
    pub sales_per_s: f64,
    pub latency_ms: Latency,
    /// Whether the client's 200s and the server's ledger agree.
    pub agrees: bool,
    /// Why they do not, when they do not.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub disagreement: Option<String>,
    /// `OVERSOLD` when any item is; else `INCONCLUSIVE` when the run could not have shown
    /// an oversell (see [`StrategyReport::inconclusive`]); else `SAFE`.
    pub verdict: Verdict,
    /// How many items the sales were spread over (`--items`); 1 is the default item. The
    /// figures above are the items' totals.
    #[serde(default = "one")]
    pub items: usize,
    /// Each item's figures against its own audit, in id order.
    #[serde(default)]
    pub per_item: Vec<ItemReport>,
}

/// How long sales stopped after a kill at `at`, from `(sent, answered, sold, failed)` per
/// request. Requests sent just after the kill can still be answered by the dying master, so
/// the outage starts at the first failure sent after the kill, and ends when a sale sent
/// after that failure is answered: by its answer, not its sending, or a sale that waited out
/// the failover would look as if sales had come back the moment it was sent. `None` when
/// sales never came back.
fn resumed_after(
    requests: impl Iterator<Item = (Duration, Duration, bool, bool)> + Clone,
    at: Duration,
) -> Option<Duration> {
    let outage = requests
        .clone()
        .filter(|&(sent, _, _, failed)| failed && sent >= at)
        .map(|(sent, _, _, _)| sent)
        .min();
    let after = outage.unwrap_or(at);
    let first_sale = requests
        .filter(|&(sent, _, sold, _)| sold && sent > after)
        .map(|(_, answered, _, _)| answered)
        .min();
    match (outage, first_sale) {
        (None, Some(_)) => Some(Duration::ZERO),
        (Some(_), Some(sale)) => Some(sale.saturating_sub(at)),
        (_, None) => None,
    }
}

/// The shortest window over which `failover-table` gives a rate of sales: the time before
/// the kill, and the row's whole run.
pub const MIN_RATE_WINDOW: Duration = Duration::from_secs(1);

/// Sales per second over the `window` from the start to the kill, `None` when the window is
/// shorter than [`MIN_RATE_WINDOW`]. Over the milliseconds of a kill at 0 s, the few sales
/// sent before it (answered later, some by the new master) made "740 sales/s" of a run that
/// sold 6; a window of a few request times is no rate, however it is divided.
fn rate_before_kill(sales: usize, window: Duration) -> Option<f64> {
    (window >= MIN_RATE_WINDOW).then(|| (sales as f64 / window.as_secs_f64()).round())
}

fn one() -> usize {
    1
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "UPPERCASE")]
pub enum Verdict {
    Safe,
    Oversold,
    /// Neither: the sales that would show an oversell did not happen (nothing sold while
    /// requests failed or were refused) or were not the sales asked for (the service refused requests as
    /// wrong). A strategy's report only; an item's verdict stays `SAFE` or `OVERSOLD`.
    Inconclusive,
}

impl std::fmt::Display for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Verdict::Safe => "SAFE",
            Verdict::Oversold => "OVERSOLD",
            Verdict::Inconclusive => "INCONCLUSIVE",
        })
    }
}

/// Error kinds that say the request itself was wrong, not the lock or the network: the
/// 4xx answers other than the sale's own 409s (a `work_ms` above the service's
/// `MAX_WORK_MS` is a `bad_request`), and a 4xx without the service's body (`http_4..`).
/// The service refused such a sale before it tried the lock.
const REQUEST_FAULTS: [&str; 6] = [
    "bad_request",
    "payload_too_large",
    "unauthorized",
    "not_found",
    "method_not_allowed",
    "unknown_item",
];

fn is_request_fault(kind: &str) -> bool {
    REQUEST_FAULTS.contains(&kind) || kind.starts_with("http_4")
}

/// Why a run that oversold nothing still proves nothing, from its totals; `None` when its
/// `SAFE` means something. Stock left unsold because every request failed is no evidence
/// that the lock holds, and a run whose requests the service refused as wrong measured
/// something other than the plan (typically a `--work-ms` above `MAX_WORK_MS`).
///
/// Refusals count with the failures when nothing sold: a refusal is the service protecting
/// the stock, but a run made of nothing else never let a sale race another, so it shows
/// nothing about the lock either.
fn inconclusive(
    requests: u64,
    sold: u64,
    (errors, error_kinds): (u64, &BTreeMap<String, u64>),
    (refused, refused_kinds): (u64, &BTreeMap<String, u64>),
) -> Option<String> {
    if requests == 0 {
        // A run shorter than one request (`--duration 0.000001`) tried nothing.
        return Some("no request was sent".into());
    }
    let list = |of: &BTreeMap<String, u64>, keep: fn(&str) -> bool| {
        of.iter()
            .filter(|(kind, _)| keep(kind))
            .map(|(kind, n)| format!("{kind}: {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let kinds = |keep: fn(&str) -> bool| list(error_kinds, keep);
    if sold == 0 && errors + refused > 0 {
        let mut why = vec![];
        if errors > 0 {
            why.push(format!("{errors} requests failed ({})", kinds(|_| true)));
        }
        if refused > 0 {
            why.push(format!(
                "{refused} refused ({})",
                list(refused_kinds, |_| true)
            ));
        }
        return Some(format!("nothing sold; {}", why.join(", ")));
    }
    let faults: u64 = error_kinds
        .iter()
        .filter(|(kind, _)| is_request_fault(kind))
        .map(|(_, n)| n)
        .sum();
    (faults > 0).then(|| {
        format!(
            "{faults} requests refused as wrong by the service ({})",
            kinds(is_request_fault)
        )
    })
}

#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq)]
pub struct Latency {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

impl StrategyReport {
    /// Why the verdict is `INCONCLUSIVE` (`nothing sold; 2 requests failed (bad_request:
    /// 2)`), from the report's own figures: a line read back from `--json` says it too.
    pub fn inconclusive(&self) -> Option<String> {
        if self.verdict != Verdict::Inconclusive {
            return None;
        }
        inconclusive(
            self.requests,
            self.sold,
            (self.errors, &self.error_kinds),
            (self.refused, &self.refused_kinds),
        )
    }

    /// The verdict with its reason when it has one, for the lines people read.
    pub fn verdict_text(&self) -> String {
        match self.inconclusive() {
            Some(why) => format!("{}: {why}", self.verdict),
            None => self.verdict.to_string(),
        }
    }

    /// An oversell that the strategy exists to prevent (the exit status 2 of the binary).
    pub fn is_unexpected_oversell(&self) -> bool {
        // The table says which strategies are meant to hold across instances.
        let meant_to_hold = self
            .strategy
            .parse::<inventory::lock::Strategy>()
            .is_ok_and(|s| s.info().distributed);
        self.verdict == Verdict::Oversold && meant_to_hold
    }
}

/// One request: which item it asked for (an index into the run's items), how it ended, how
/// long it took, and when it was sent (since the start).
struct Sale {
    item: usize,
    outcome: Outcome,
    /// The instance that answered (`X-Instance`) when it did not sell; a sale's is in its
    /// outcome.
    answered_by: Option<String>,
    latency: Duration,
    sent: Duration,
}

/// How one request ended.
#[derive(Clone)]
enum Outcome {
    Sold {
        instance: Option<String>,
    },
    SoldOut,
    /// Refused on purpose by the service, nothing sold, by its error code.
    Refused(String),
    Error(String),
}

/// Called after each request, for a progress bar.
pub type Progress = Arc<dyn Fn() + Send + Sync>;

pub struct LoadTest {
    plan: Plan,
    /// Resets and audits.
    http: reqwest::Client,
    /// The sales and `--health`: a connection of its own per worker (see [`conn`]).
    target: Arc<conn::Target>,
    /// How long one sale may take before it counts as a `timeout`.
    request_timeout: Duration,
    /// Throughput mode: sell for this long instead of `plan.requests` times.
    duration: Option<Duration>,
    failover: Option<failover::Failover>,
    /// Where each item lives: `/inventory` for the default item alone, else
    /// `/inventory/{item}` per item.
    item_paths: Vec<String>,
}

/// What `--health` measures: the HTTP path alone, to hold against `wrk`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct HealthReport {
    pub endpoint: String,
    pub concurrency: usize,
    pub duration_s: f64,
    pub requests: u64,
    pub errors: u64,
    pub requests_per_s: f64,
}

impl LoadTest {
    pub fn new(plan: Plan) -> anyhow::Result<Self> {
        if plan.requests == 0 || plan.concurrency == 0 {
            bail!("--requests and --concurrency must be at least 1");
        }
        let request_timeout = Duration::from_millis(plan.work_ms) + Duration::from_secs(60);
        let http = reqwest::Client::builder()
            .pool_max_idle_per_host(plan.concurrency)
            .timeout(request_timeout)
            .build()?;
        let plan = Plan {
            target: plan.target.trim_end_matches('/').to_owned(),
            ..plan
        };
        Ok(Self {
            target: Arc::new(conn::Target::parse(&plan.target)?),
            request_timeout,
            plan,
            http,
            duration: None,
            failover: None,
            item_paths: vec!["/inventory".to_owned()],
        })
    }

    /// Spreads each run's sales over `items` items of their own (`item-0001`, ...), each reset
    /// to the plan's stock before the run; 1 keeps the default item on the paths without an
    /// id. At most [`MAX_ITEMS`].
    pub fn with_items(mut self, items: usize) -> anyhow::Result<Self> {
        items::check_count(items)?;
        self.item_paths = if items == 1 {
            vec!["/inventory".to_owned()]
        } else {
            (1..=items)
                .map(|n| format!("/inventory/{}", items::item_id(n, items)))
                .collect()
        };
        Ok(self)
    }

    /// How many items each run sells.
    pub fn items(&self) -> usize {
        self.item_paths.len()
    }

    /// Kills the master that Sentinel names `failover.after` into each run.
    pub fn with_failover(mut self, failover: failover::Failover) -> Self {
        self.failover = Some(failover);
        self
    }

    /// Throughput mode: each run sells for `duration` (with `plan.concurrency` in flight)
    /// instead of stopping after `plan.requests`; give it a stock that never runs out.
    pub fn with_duration(mut self, duration: Duration) -> Self {
        self.duration = Some(duration);
        self
    }

    /// `GET /health` as fast as `plan.concurrency` keep-alive connections allow, for
    /// `duration`: the generator's own ceiling, to compare with `wrk` on the same target.
    pub async fn health(&self, duration: Duration) -> anyhow::Result<HealthReport> {
        let started = Instant::now();
        let end = started + duration;
        // A request still out when the run ends has a second to answer.
        let deadline = tokio::time::Instant::from_std(end) + Duration::from_secs(1);
        let workers = (0..self.plan.concurrency).map(|_| {
            let mut conn =
                conn::Conn::new(self.target.clone(), self.request_timeout).until(deadline);
            async move {
                let (mut ok, mut failed) = (0u64, 0u64);
                while Instant::now() < end {
                    match conn.send(hyper::Method::GET, "/health").await {
                        Ok(answer) if answer.status == 200 => ok += 1,
                        _ => failed += 1,
                    }
                }
                (ok, failed)
            }
        });
        let counts = spawn_all(workers).await?;
        let secs = started.elapsed().as_secs_f64().max(1e-9);
        let requests: u64 = counts.iter().map(|c| c.0).sum();
        Ok(HealthReport {
            endpoint: "/health".into(),
            concurrency: self.plan.concurrency,
            duration_s: (secs * 1e3).round() / 1e3,
            requests,
            errors: counts.iter().map(|c| c.1).sum(),
            requests_per_s: (requests as f64 / secs).round(),
        })
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    pub async fn run_strategy(
        &self,
        strategy: Strategy,
        progress: Option<Progress>,
    ) -> anyhow::Result<StrategyReport> {
        self.reset().await?;
        let started = Instant::now();
        let end = self.duration.map(|d| started + d);
        let next = Arc::new(AtomicUsize::new(0));
        let deck = Arc::new(items::Deck::new(self.items()));
        let sale_paths: Arc<Vec<String>> = Arc::new(
            self.item_paths
                .iter()
                .map(|path| {
                    format!(
                        "{path}/sale?strategy={strategy}&work_ms={}",
                        self.plan.work_ms
                    )
                })
                .collect(),
        );
        let workers = match end {
            Some(_) => self.plan.concurrency,
            None => self.plan.concurrency.min(self.plan.requests),
        };
        let requests = self.plan.requests;
        // A timed run waits for the sales still out at its end as long as a sale may take
        // (its work and the service's default wait for the lock), not the full timeout
        // meant for a server that is merely slow.
        let deadline = end.map(|end| {
            tokio::time::Instant::from_std(end)
                + Duration::from_millis(self.plan.work_ms)
                + SALE_GRACE
        });
        let workers = (0..workers).map(|_| {
            let next = next.clone();
            let progress = progress.clone();
            let deck = deck.clone();
            let sale_paths = sale_paths.clone();
            let mut conn = conn::Conn::new(self.target.clone(), self.request_timeout);
            if let Some(deadline) = deadline {
                conn = conn.until(deadline);
            }
            async move {
                let mut done = Vec::new();
                let more = || match end {
                    Some(end) => Instant::now() < end,
                    None => next.fetch_add(1, Ordering::Relaxed) < requests,
                };
                while more() {
                    let item = deck.draw();
                    let sent = started.elapsed();
                    let (outcome, answered_by, latency) =
                        sell_once(&mut conn, &sale_paths[item]).await;
                    done.push(Sale {
                        item,
                        outcome,
                        answered_by,
                        latency,
                        sent,
                    });
                    if let Some(tick) = &progress {
                        tick();
                    }
                }
                done
            }
        });
        let kill = async {
            let failover = self.failover.as_ref()?;
            tokio::time::sleep(failover.after).await;
            // Taken once the signal is sent: finding the master first takes round trips,
            // during which it still sells.
            let killed = failover.kill_master().await;
            let at = started.elapsed();
            Some(killed.map(|(master, how)| {
                (
                    failover::Killed {
                        master,
                        how,
                        at_s: (at.as_secs_f64() * 1e3).round() / 1e3,
                    },
                    at,
                )
            }))
        };
        let (results, killed) = tokio::join!(spawn_all(workers), kill);
        let results: Vec<Sale> = results?.into_iter().flatten().collect();
        let killed = killed.transpose()?;
        let duration = started.elapsed();
        let audits = self.audits().await?;
        let mut report = summarize(
            strategy,
            self.plan.stock,
            results
                .iter()
                .map(|s| (s.item, s.outcome.clone(), s.latency))
                .collect(),
            duration,
            &audits,
        );
        count_idle_instances(
            &mut report.instances,
            results.iter().filter_map(|s| s.answered_by.as_deref()),
        );
        if let Some((killed, at)) = killed {
            report.resumed_after_s = resumed_after(
                results.iter().map(|s| {
                    let sold = matches!(s.outcome, Outcome::Sold { .. });
                    let failed = matches!(s.outcome, Outcome::Error(_));
                    (s.sent, s.sent + s.latency, sold, failed)
                }),
                at,
            )
            .map(|d| (d.as_secs_f64() * 1e3).round() / 1e3);
            let before = results
                .iter()
                .filter(|s| matches!(s.outcome, Outcome::Sold { .. }) && s.sent < at)
                .count();
            report.sales_per_s_before_failover = rate_before_kill(before, at);
            report.failover = Some(killed);
        }
        Ok(report)
    }

    /// Resets every item, as many at once as the plan's concurrency.
    async fn reset(&self) -> anyhow::Result<()> {
        futures_util::stream::iter(&self.item_paths)
            .map(|path| self.reset_one(path))
            .buffer_unordered(self.plan.concurrency)
            .try_collect::<Vec<()>>()
            .await?;
        Ok(())
    }

    /// Every message names the URL requested, the target's prefix included: the path alone
    /// (`/inventory`) was not what a target with a prefix had been sent.
    async fn reset_one(&self, path: &str) -> anyhow::Result<()> {
        let url = self.target.url(path);
        let send = || {
            let request = self
                .http
                .put(&url)
                .json(&serde_json::json!({ "stock": self.plan.stock }));
            match &self.plan.admin_token {
                Some(token) => request.bearer_auth(token),
                None => request,
            }
        };
        let response = until_not_passing(send)
            .await
            // Named once, by the context.
            .map_err(reqwest::Error::without_url)
            .with_context(|| format!("resetting the stock: cannot reach {url}"))?;
        let status = response.status();
        if !status.is_success() {
            let body = response.text().await.unwrap_or_default();
            bail!("resetting the stock (PUT {url}) failed with {status}: {body}");
        }
        Ok(())
    }

    /// Every item's audit, in the items' order.
    async fn audits(&self) -> anyhow::Result<Vec<Audit>> {
        futures_util::stream::iter(&self.item_paths)
            .map(|path| self.audit(path))
            .buffered(self.plan.concurrency)
            .try_collect()
            .await
    }

    /// An answer that is [`passing`] is asked again for up to [`AUDIT_PATIENCE`]: a run that
    /// ends during a failover, with Redis restarting or with nginx holding the instances
    /// down still gets its books once the service is back.
    async fn audit(&self, path: &str) -> anyhow::Result<Audit> {
        let url = self.target.url(&format!("{path}/audit"));
        let response = until_not_passing(|| self.http.get(&url))
            .await
            .map_err(reqwest::Error::without_url)
            .with_context(|| format!("cannot read the audit (GET {url})"))?;
        let status = response.status();
        if !status.is_success() {
            bail!("the audit (GET {url}) failed with {status}");
        }
        response
            .json()
            .await
            .with_context(|| format!("the audit (GET {url}) is not an audit"))
    }
}

/// Sends the request `build` makes, again every 200 ms while the answer is [`passing`], for
/// up to [`AUDIT_PATIENCE`]; returns the last answer. Only for requests that are safe to send
/// again: reads, and resets (which set the stock rather than take from it).
async fn until_not_passing(
    build: impl Fn() -> reqwest::RequestBuilder,
) -> reqwest::Result<reqwest::Response> {
    let give_up = Instant::now() + AUDIT_PATIENCE;
    loop {
        let response = build().send().await?;
        if !passing(response.status()) || Instant::now() >= give_up {
            return Ok(response);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// How long an audit or a reset answered [`passing`] is asked again: longer than a Sentinel
/// failover (`down-after` plus the failover itself), a cluster's replica promotion, or the
/// seconds nginx keeps overloaded instances marked down.
const AUDIT_PATIENCE: Duration = Duration::from_secs(15);

/// How long past the end of a timed run a sale still out may take to answer.
const SALE_GRACE: Duration = Duration::from_secs(15);

/// An answer that says "not now" rather than "no": Redis away (503), or nginx with no
/// instance to pass the request to (502, 504). Reads and resets are safe to send again: a
/// reset sets the stock, it does not take from it.
fn passing(status: reqwest::StatusCode) -> bool {
    matches!(status.as_u16(), 502..=504)
}

/// One sale on the worker's own connection: how it ended, the instance that answered when
/// it did not sell, and how long it took.
async fn sell_once(conn: &mut conn::Conn, path: &str) -> (Outcome, Option<String>, Duration) {
    let started = Instant::now();
    // The name moves into a sale's outcome rather than being copied: this is the hot loop.
    let (outcome, answered_by) = match conn.send(hyper::Method::POST, path).await {
        Ok(answer) if answer.status == 200 => (classify(200, &answer.body, answer.instance), None),
        Ok(answer) => (classify(answer.status, &answer.body, None), answer.instance),
        Err(failure) => (Outcome::Error(failure.kind().into()), None),
    };
    (outcome, answered_by, started.elapsed())
}

/// Lists with 0 sales every instance that answered without selling, beside those that sold
/// (`instances`, 200s per instance). The `split` column had one number per instance that
/// sold: `50` read as one instance, when a second had answered every other request with
/// `sold_out`; it is `50/0`.
fn count_idle_instances<'a>(
    instances: &mut BTreeMap<String, u64>,
    answered_by: impl Iterator<Item = &'a str>,
) {
    for name in answered_by {
        if !instances.contains_key(name) {
            instances.insert(name.to_owned(), 0);
        }
    }
}

/// Runs each worker as a task of its own, so that the runtime's threads share them (one
/// future polling them all would keep the generator on one core), and collects their
/// results in order.
async fn spawn_all<T: Send + 'static>(
    workers: impl Iterator<Item = impl std::future::Future<Output = T> + Send + 'static>,
) -> anyhow::Result<Vec<T>> {
    let handles: Vec<_> = workers.map(tokio::spawn).collect();
    let mut results = Vec::with_capacity(handles.len());
    for handle in handles {
        results.push(handle.await.context("a load worker panicked")?);
    }
    Ok(results)
}

fn classify(status: u16, body: &[u8], instance: Option<String>) -> Outcome {
    if status == 200 {
        // The body is checked, not just the status: a 200 that is not a sale is an error.
        return match serde_json::from_slice::<Sold>(body) {
            Ok(sold) if sold.sold => Outcome::Sold {
                instance: instance.or(Some(sold.instance)),
            },
            _ => Outcome::Error("bad_200_body".into()),
        };
    }
    let code = serde_json::from_slice::<ErrorBody>(body)
        .map(|e| e.error)
        .ok();
    match (status, code.as_deref()) {
        (409, Some("sold_out")) => Outcome::SoldOut,
        // `stock_changed` is the store refusing a write whose read went stale, as
        // `stale_fence` is: the service doing its job, not failing at it.
        (409, Some(code @ ("lock_lost" | "stale_fence" | "stock_changed"))) => {
            Outcome::Refused(code.to_owned())
        }
        (_, Some(code)) => Outcome::Error(code.to_owned()),
        (status, None) => Outcome::Error(format!("http_{status}")),
    }
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    ms(sorted[rank.clamp(1, sorted.len()) - 1])
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

/// Totals over every item, each item judged against its own audit. `results` name their
/// item by its index into `audits`.
fn summarize(
    strategy: Strategy,
    stock: i64,
    results: Vec<(usize, Outcome, Duration)>,
    duration: Duration,
    audits: &[Audit],
) -> StrategyReport {
    let (mut sold, mut sold_out, mut refused, mut errors) = (0, 0, 0, 0);
    let mut error_kinds = BTreeMap::new();
    let mut refused_kinds = BTreeMap::new();
    let mut instances = BTreeMap::new();
    let mut latencies = Vec::with_capacity(results.len());
    let mut tallies = vec![items::Tally::default(); audits.len()];
    for (item, outcome, latency) in results {
        latencies.push(latency);
        let tally = &mut tallies[item];
        tally.requests += 1;
        match outcome {
            Outcome::Sold { instance } => {
                sold += 1;
                tally.sold += 1;
                *instances
                    .entry(instance.unwrap_or_else(|| "?".into()))
                    .or_insert(0) += 1;
            }
            Outcome::SoldOut => sold_out += 1,
            Outcome::Refused(kind) => {
                refused += 1;
                *refused_kinds.entry(kind).or_insert(0) += 1;
            }
            Outcome::Error(kind) => {
                errors += 1;
                tally.errors += 1;
                *error_kinds.entry(kind).or_insert(0) += 1;
            }
        }
    }
    latencies.sort_unstable();
    let per_item: Vec<ItemReport> = tallies
        .into_iter()
        .zip(audits)
        .map(|(tally, audit)| ItemReport::judge(tally, audit))
        .collect();
    let requests = latencies.len() as u64;
    let secs = duration.as_secs_f64().max(1e-9);
    let audit_sales = per_item.iter().map(|i| i.audit_sales).sum();
    let disagreement = total_disagreement(&per_item, sold, errors, audit_sales);
    // An oversell is evidence however the other requests ended; the absence of one is
    // evidence only when sales were made as asked.
    let verdict = if per_item.iter().any(|i| i.verdict == Verdict::Oversold) {
        Verdict::Oversold
    } else if inconclusive(
        requests,
        sold,
        (errors, &error_kinds),
        (refused, &refused_kinds),
    )
    .is_some()
    {
        Verdict::Inconclusive
    } else {
        Verdict::Safe
    };
    StrategyReport {
        strategy: strategy.name().to_owned(),
        stock,
        requests,
        sold,
        sold_out,
        refused,
        refused_kinds,
        errors,
        error_kinds,
        oversold: per_item.iter().map(|i| i.oversold).sum(),
        lost_updates: per_item.iter().map(|i| i.lost_updates).sum(),
        duplicates: per_item.iter().map(|i| i.duplicates).sum(),
        remaining: per_item.iter().map(|i| i.remaining).sum(),
        audit_sales,
        // Per item, then summed: one item's lost 200 is not cancelled by another item's
        // sale that the clients never saw.
        lost_200: per_item.iter().map(|i| i.lost_200).sum(),
        failover: None,
        resumed_after_s: None,
        sales_per_s_before_failover: None,
        instances,
        duration_s: (secs * 1e3).round() / 1e3,
        throughput_rps: (requests as f64 / secs).round(),
        sales_per_s: (sold as f64 / secs).round(),
        latency_ms: Latency {
            p50: percentile(&latencies, 50.0),
            p90: percentile(&latencies, 90.0),
            p99: percentile(&latencies, 99.0),
            max: latencies.last().copied().map(ms).unwrap_or(0.0),
        },
        agrees: disagreement.is_none(),
        disagreement,
        verdict,
        items: per_item.len(),
        per_item,
    }
}

/// The clients and the ledgers agree when they agree on every item. One item says what it
/// always said; several add which items disagree, since totals can match while items do not.
fn total_disagreement(
    per_item: &[ItemReport],
    sold: u64,
    errors: u64,
    recorded: i64,
) -> Option<String> {
    if let [only] = per_item {
        return only.disagreement.clone();
    }
    let ids: Vec<String> = per_item
        .iter()
        .filter(|i| !i.agrees)
        .map(|i| i.id.clone())
        .collect();
    if ids.is_empty() {
        return None;
    }
    let total = disagreement(sold, errors, recorded).unwrap_or_else(|| {
        format!("the server recorded {recorded} sales in all, as many as the clients received")
    });
    Some(format!(
        "{total}; {} of {} items disagree: {}",
        ids.len(),
        per_item.len(),
        items::name_some(&ids, 10)
    ))
}

/// The client saw `sold` sales; the server recorded `recorded`. Requests that ended in an
/// error (a dropped connection, a 502) may or may not have sold, and are said to be so.
pub(crate) fn disagreement(sold: u64, errors: u64, recorded: i64) -> Option<String> {
    let sold = sold as i64;
    if recorded == sold {
        return None;
    }
    let unknown = if recorded > sold && recorded - sold <= errors as i64 {
        format!("; {errors} requests ended in errors, so up to {errors} sales may have gone unseen")
    } else {
        String::new()
    };
    Some(format!(
        "the server recorded {recorded} sales, the clients received {sold}{unknown}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_instance_that_answered_without_selling_is_listed_with_0_sales() {
        let mut instances = BTreeMap::from([("app1".to_owned(), 50)]);
        count_idle_instances(&mut instances, ["app2", "app1", "app2"].into_iter());
        assert_eq!(
            instances,
            BTreeMap::from([("app1".to_owned(), 50), ("app2".to_owned(), 0)])
        );
    }

    #[test]
    fn percentiles_use_the_nearest_rank() {
        let sorted: Vec<_> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(percentile(&sorted, 50.0), 50.0);
        assert_eq!(percentile(&sorted, 99.0), 99.0);
        assert_eq!(percentile(&[Duration::from_millis(7)], 90.0), 7.0);
        assert_eq!(percentile(&[], 90.0), 0.0);
    }

    #[test]
    fn responses_are_classified_by_their_error_code() {
        let body = |code: &str| format!(r#"{{"error":"{code}","message":"m"}}"#).into_bytes();
        assert!(matches!(
            classify(409, &body("sold_out"), None),
            Outcome::SoldOut
        ));
        for code in ["stale_fence", "lock_lost", "stock_changed"] {
            assert!(
                matches!(classify(409, &body(code), None), Outcome::Refused(k) if k == code),
                "{code}"
            );
        }
        assert!(
            matches!(classify(503, &body("lock_timeout"), None), Outcome::Error(k) if k == "lock_timeout")
        );
        assert!(matches!(classify(502, b"<html>", None), Outcome::Error(k) if k == "http_502"));
        assert!(matches!(classify(200, b"{}", None), Outcome::Error(_)));
    }

    use crate::items::tests::audit;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn an_outage_runs_from_the_first_failure_after_the_kill_to_the_next_sale() {
        // A sale sent just after the kill was still answered by the dying master: the outage
        // is not over then, it has not begun.
        let requests = [
            (ms(90), ms(95), true, false),
            (ms(101), ms(104), true, false),
            (ms(105), ms(106), false, true),
            (ms(900), ms(901), false, true),
            (ms(1500), ms(1510), true, false),
            (ms(1600), ms(1605), true, false),
        ];
        assert_eq!(resumed_after(requests.into_iter(), ms(100)), Some(ms(1410)));
    }

    #[test]
    fn a_sale_that_waited_out_the_failover_ends_the_outage_when_it_is_answered() {
        // Sent right after the first failure, it hung through the failover and sold on the
        // new master 2.3 s later: sales were back then, not when it was sent.
        let requests = [
            (ms(105), ms(106), false, true),
            (ms(110), ms(2400), true, false),
            (ms(2390), ms(2395), true, false),
        ];
        assert_eq!(resumed_after(requests.into_iter(), ms(100)), Some(ms(2295)));
    }

    #[test]
    fn a_rate_before_the_kill_needs_a_second_of_sales() {
        assert_eq!(rate_before_kill(6, ms(8)), None, "a kill at 0 s");
        assert_eq!(rate_before_kill(900, ms(999)), None);
        assert_eq!(rate_before_kill(1000, ms(1000)), Some(1000.0));
        assert_eq!(rate_before_kill(3000, ms(2000)), Some(1500.0));
        assert_eq!(
            rate_before_kill(0, ms(2000)),
            Some(0.0),
            "no sale is a rate of 0"
        );
    }

    #[test]
    fn no_failure_after_the_kill_is_no_outage_and_no_sale_after_it_is_never() {
        let clean = [
            (ms(50), ms(51), true, false),
            (ms(150), ms(151), true, false),
        ];
        assert_eq!(resumed_after(clean.into_iter(), ms(100)), Some(ms(0)));
        let dead = [
            (ms(50), ms(51), true, false),
            (ms(150), ms(151), false, true),
        ];
        assert_eq!(resumed_after(dead.into_iter(), ms(100)), None);
        // Sold out is an answer, not a failure.
        let sold_out = [
            (ms(150), ms(151), false, false),
            (ms(200), ms(201), true, false),
        ];
        assert_eq!(resumed_after(sold_out.into_iter(), ms(100)), Some(ms(0)));
    }

    /// `n` requests for `item`, each ending in `outcome`, 1 ms each.
    fn sales(item: usize, n: usize, outcome: Outcome) -> Vec<(usize, Outcome, Duration)> {
        vec![(item, outcome, Duration::from_millis(1)); n]
    }

    fn sold(instance: &str) -> Outcome {
        Outcome::Sold {
            instance: Some(instance.into()),
        }
    }

    fn fenced() -> Strategy {
        "fenced".parse().unwrap()
    }

    #[test]
    fn the_totals_are_the_sums_of_the_items_and_one_oversold_item_makes_the_strategy_oversold() {
        let mut results = sales(0, 5, sold("app1"));
        results.extend(sales(0, 3, Outcome::SoldOut));
        results.extend(sales(1, 7, sold("app2")));
        results.extend(sales(2, 4, sold("app1")));
        results.extend(sales(2, 1, Outcome::Error("http_502".into())));
        let audits = [
            audit("item-0001", 5, 5, 0),
            audit("item-0002", 5, 7, 0),
            audit("item-0003", 5, 5, 0),
        ];
        let report = summarize(fenced(), 5, results, Duration::from_secs(1), &audits);
        assert_eq!(report.items, 3);
        let ids: Vec<&str> = report.per_item.iter().map(|i| i.id.as_str()).collect();
        assert_eq!(ids, ["item-0001", "item-0002", "item-0003"]);
        let per = |f: fn(&ItemReport) -> i64| report.per_item.iter().map(f).sum::<i64>();
        assert_eq!(report.sold as i64, per(|i| i.sold as i64));
        assert_eq!(report.audit_sales, per(|i| i.audit_sales));
        assert_eq!(report.oversold, per(|i| i.oversold));
        assert_eq!(report.lost_updates, per(|i| i.lost_updates));
        assert_eq!(report.remaining, per(|i| i.remaining));
        assert_eq!(report.requests as i64, per(|i| i.requests as i64));
        assert_eq!((report.sold, report.oversold, report.errors), (16, 2, 1));
        let verdicts: Vec<Verdict> = report.per_item.iter().map(|i| i.verdict).collect();
        assert_eq!(
            verdicts,
            [Verdict::Safe, Verdict::Oversold, Verdict::Safe],
            "{report:#?}"
        );
        assert_eq!(report.verdict, Verdict::Oversold);
        assert!(
            report.is_unexpected_oversell(),
            "fenced should not oversell"
        );
        // The third item's ledger has a sale its clients lost with a 502: said, and named.
        assert!(!report.per_item[2].agrees && report.per_item[1].agrees);
        let why = report.disagreement.clone().unwrap();
        assert!(why.contains("1 of 3 items disagree: item-0003"), "{why}");
        assert_eq!(
            report.instances,
            [("app1".into(), 9), ("app2".into(), 7)].into()
        );
    }

    #[test]
    fn a_lost_200_of_one_item_is_not_cancelled_by_another_items_unseen_sale() {
        let mut results = sales(0, 3, sold("app1"));
        results.extend(sales(1, 1, sold("app1")));
        results.extend(sales(1, 1, Outcome::Error("connect".into())));
        // Item 1 lost a 200 (2 answered, 1 recorded... as 3 vs 2), item 2 sold one unseen.
        let audits = [audit("item-0001", 5, 2, 3), audit("item-0002", 5, 2, 3)];
        let report = summarize(fenced(), 5, results, Duration::from_secs(1), &audits);
        assert_eq!(report.sold as i64, report.audit_sales, "the totals match");
        assert_eq!(report.lost_200, 1, "{report:#?}");
        assert_eq!(report.verdict, Verdict::Oversold);
        assert!(!report.agrees, "the items do not: {report:#?}");
    }

    #[test]
    fn one_item_reports_what_the_single_item_report_always_did_plus_items_and_per_item() {
        let mut results = sales(0, 5, sold("app1"));
        results.extend(sales(0, 2, Outcome::Error("http_502".into())));
        let report = summarize(
            fenced(),
            10,
            results,
            Duration::from_secs(1),
            &[audit("001", 10, 6, 4)],
        );
        assert_eq!((report.items, report.per_item.len()), (1, 1));
        assert_eq!(report.per_item[0].id, "001");
        assert_eq!(report.disagreement, disagreement(5, 2, 6));
        assert_eq!(
            (report.sold, report.audit_sales, report.remaining),
            (5, 6, 4)
        );
        assert_eq!(report.verdict, Verdict::Safe);
        // The new fields come last, so a line without them is the line of old.
        let line = serde_json::to_string(&report).unwrap();
        let (old, new) = line.split_at(line.find(r#","items":1,"per_item":["#).unwrap());
        assert!(old.ends_with(r#""verdict":"SAFE""#), "{line}");
        assert!(new.ends_with("]}"), "{line}");
        let read: StrategyReport = serde_json::from_str(&format!("{old}}}")).unwrap();
        assert_eq!(
            (read.items, read.per_item.len()),
            (1, 0),
            "old lines still read"
        );
    }

    #[test]
    fn a_run_where_every_request_was_refused_is_inconclusive_not_safe() {
        // What a --work-ms above MAX_WORK_MS gives: every sale a 400, the stock untouched.
        let results = sales(0, 2, Outcome::Error("bad_request".into()));
        let report = summarize(
            fenced(),
            100,
            results,
            Duration::from_secs(1),
            &[audit("001", 100, 0, 100)],
        );
        assert_eq!((report.sold, report.errors), (0, 2));
        assert_eq!(report.verdict, Verdict::Inconclusive, "{report:#?}");
        assert_eq!(
            report.verdict_text(),
            "INCONCLUSIVE: nothing sold; 2 requests failed (bad_request: 2)"
        );
        assert!(!report.is_unexpected_oversell());
        let line = serde_json::to_string(&report).unwrap();
        assert!(line.contains(r#""verdict":"INCONCLUSIVE""#), "{line}");
        let read: StrategyReport = serde_json::from_str(&line).unwrap();
        assert_eq!(
            read.inconclusive(),
            report.inconclusive(),
            "said by the line"
        );

        // Nothing sold because Redis was down is no more a proof of safety.
        let down = sales(0, 3, Outcome::Error("redis_unavailable".into()));
        let report = summarize(fenced(), 5, down, ms(1), &[audit("001", 5, 0, 5)]);
        assert_eq!(report.verdict, Verdict::Inconclusive, "{report:#?}");
    }

    #[test]
    fn a_run_that_sent_nothing_is_inconclusive_not_safe() {
        let report = summarize(fenced(), 5, Vec::new(), ms(0), &[audit("001", 5, 0, 5)]);
        assert_eq!(report.requests, 0);
        assert_eq!(report.verdict, Verdict::Inconclusive, "{report:#?}");
        assert_eq!(report.verdict_text(), "INCONCLUSIVE: no request was sent");
    }

    #[test]
    fn a_run_with_requests_refused_as_wrong_is_inconclusive_even_with_sales() {
        let mut results = sales(0, 3, sold("app1"));
        results.extend(sales(0, 1, Outcome::Error("bad_request".into())));
        results.extend(sales(0, 1, Outcome::Error("http_404".into())));
        results.extend(sales(0, 2, Outcome::Error("lock_timeout".into())));
        let report = summarize(fenced(), 5, results, ms(1), &[audit("001", 5, 3, 2)]);
        assert_eq!(report.verdict, Verdict::Inconclusive, "{report:#?}");
        let why = report.inconclusive().unwrap();
        assert_eq!(
            why,
            "2 requests refused as wrong by the service (bad_request: 1, http_404: 1)"
        );
    }

    #[test]
    fn a_sold_out_run_or_one_with_some_timeouts_stays_safe_and_an_oversell_stays_oversold() {
        // Stock 0: nothing sold, nothing failed; every answer was a real sold_out.
        let report = summarize(
            fenced(),
            0,
            sales(0, 4, Outcome::SoldOut),
            ms(1),
            &[audit("001", 0, 0, 0)],
        );
        assert_eq!(report.verdict, Verdict::Safe, "{report:#?}");
        assert_eq!(report.verdict_text(), "SAFE");
        let mut results = sales(0, 5, sold("app1"));
        results.extend(sales(0, 2, Outcome::Error("lock_timeout".into())));
        let report = summarize(fenced(), 5, results, ms(1), &[audit("001", 5, 5, 0)]);
        assert_eq!(report.verdict, Verdict::Safe, "{report:#?}");
        // An oversell is evidence whatever else failed.
        let mut results = sales(0, 6, sold("app1"));
        results.extend(sales(0, 2, Outcome::Error("bad_request".into())));
        let report = summarize(fenced(), 5, results, ms(1), &[audit("001", 5, 6, 0)]);
        assert_eq!(report.verdict, Verdict::Oversold, "{report:#?}");
        assert_eq!(report.inconclusive(), None);
    }

    #[test]
    fn stock_changed_is_a_refusal_not_an_error_and_refusals_alone_prove_nothing() {
        let body = br#"{"error":"stock_changed","message":"m"}"#;
        let changed = || classify(409, body, None);
        let mut results = sales(0, 4, sold("app1"));
        results.extend(sales(0, 2, changed()));
        results.extend(sales(0, 1, Outcome::Refused("stale_fence".into())));
        let report = summarize(fenced(), 5, results, ms(1), &[audit("001", 5, 4, 1)]);
        assert_eq!((report.refused, report.errors), (3, 0), "{report:#?}");
        assert_eq!(
            report.refused_kinds,
            [("stale_fence".into(), 1), ("stock_changed".into(), 2)].into()
        );
        assert!(report.error_kinds.is_empty(), "{report:#?}");
        assert_eq!(report.verdict, Verdict::Safe, "{report:#?}");
        assert!(report.agrees, "a refusal sold nothing unseen: {report:#?}");

        // Nothing sold and every answer a refusal: no two sales ever raced, so SAFE would
        // claim what the run never tested.
        let report = summarize(
            fenced(),
            5,
            sales(0, 3, changed()),
            ms(1),
            &[audit("001", 5, 0, 5)],
        );
        assert_eq!(report.verdict, Verdict::Inconclusive, "{report:#?}");
        assert_eq!(
            report.verdict_text(),
            "INCONCLUSIVE: nothing sold; 3 refused (stock_changed: 3)"
        );
        let read: StrategyReport =
            serde_json::from_str(&serde_json::to_string(&report).unwrap()).unwrap();
        assert_eq!(
            read.inconclusive(),
            report.inconclusive(),
            "said by the line"
        );

        let mut results = sales(0, 1, changed());
        results.extend(sales(0, 2, Outcome::Error("lock_timeout".into())));
        let report = summarize(fenced(), 5, results, ms(1), &[audit("001", 5, 0, 5)]);
        assert_eq!(
            report.inconclusive().as_deref(),
            Some("nothing sold; 2 requests failed (lock_timeout: 2), 1 refused (stock_changed: 1)")
        );
    }

    #[test]
    fn a_mismatch_between_client_and_server_is_reported() {
        assert_eq!(disagreement(5, 0, 5), None);
        assert!(disagreement(5, 0, 6).is_some());
        assert!(
            disagreement(5, 2, 6)
                .unwrap()
                .contains("may have gone unseen")
        );
    }
}

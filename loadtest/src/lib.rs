//! The load generator behind the `loadtest` binary: for each strategy, reset the stock, fire
//! the sales over keep-alive connections, then read the server's audit and hold the client's
//! counts against it.
//!
//! It speaks the service's own types (`Sold`, `Audit`, `ErrorBody`), so a change to the
//! contract breaks this crate's build rather than its numbers.

pub mod bench;
pub mod failover;
pub mod html;
pub mod lockbench;
pub mod picture;
pub mod scenarios;
pub mod table;
pub mod timeline;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use inventory::http::ErrorBody;
use inventory::lock::Strategy;
use inventory::sale::Sold;
use inventory::store::Audit;
use serde::{Deserialize, Serialize};

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
    /// 409 `lock_lost` or `stale_fence`: refused because the lock was lost.
    pub refused: u64,
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
    /// Seconds from the kill to the first request sent after it that sold.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub resumed_after_s: Option<f64>,
    /// 200s per instance (from `X-Instance`).
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
    /// `SAFE` or `OVERSOLD`.
    pub verdict: Verdict,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "UPPERCASE")]
pub enum Verdict {
    Safe,
    Oversold,
}

impl std::fmt::Display for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Verdict::Safe => "SAFE",
            Verdict::Oversold => "OVERSOLD",
        })
    }
}

#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq)]
pub struct Latency {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

impl StrategyReport {
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

/// One request: how it ended, how long it took, and when it was sent (since the start).
struct Sale {
    outcome: Outcome,
    latency: Duration,
    sent: Duration,
}

/// How one request ended.
#[derive(Clone)]
enum Outcome {
    Sold { instance: Option<String> },
    SoldOut,
    Refused,
    Error(String),
}

/// Called after each request, for a progress bar.
pub type Progress = Arc<dyn Fn() + Send + Sync>;

pub struct LoadTest {
    plan: Plan,
    http: reqwest::Client,
    /// Throughput mode: sell for this long instead of `plan.requests` times.
    duration: Option<Duration>,
    failover: Option<failover::Failover>,
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
        let http = reqwest::Client::builder()
            .pool_max_idle_per_host(plan.concurrency)
            .timeout(Duration::from_millis(plan.work_ms) + Duration::from_secs(60))
            .build()?;
        let plan = Plan {
            target: plan.target.trim_end_matches('/').to_owned(),
            ..plan
        };
        Ok(Self {
            plan,
            http,
            duration: None,
            failover: None,
        })
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
    pub async fn health(&self, duration: Duration) -> HealthReport {
        let url = format!("{}/health", self.plan.target);
        let started = Instant::now();
        let end = started + duration;
        let workers = (0..self.plan.concurrency).map(|_| {
            let url = url.as_str();
            async move {
                let (mut ok, mut failed) = (0u64, 0u64);
                while Instant::now() < end {
                    let fine = match self.http.get(url).send().await {
                        Ok(r) => r.status().is_success() && r.bytes().await.is_ok(),
                        Err(_) => false,
                    };
                    if fine {
                        ok += 1;
                    } else {
                        failed += 1;
                    }
                }
                (ok, failed)
            }
        });
        let counts = futures_util::future::join_all(workers).await;
        let secs = started.elapsed().as_secs_f64().max(1e-9);
        let requests: u64 = counts.iter().map(|c| c.0).sum();
        HealthReport {
            endpoint: "/health".into(),
            concurrency: self.plan.concurrency,
            duration_s: (secs * 1e3).round() / 1e3,
            requests,
            errors: counts.iter().map(|c| c.1).sum(),
            requests_per_s: (requests as f64 / secs).round(),
        }
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
        let workers = match end {
            Some(_) => self.plan.concurrency,
            None => self.plan.concurrency.min(self.plan.requests),
        };
        let workers = (0..workers).map(|_| {
            let next = next.clone();
            let progress = progress.clone();
            async move {
                let mut done = Vec::new();
                let more = || match end {
                    Some(end) => Instant::now() < end,
                    None => next.fetch_add(1, Ordering::Relaxed) < self.plan.requests,
                };
                while more() {
                    let sent = started.elapsed();
                    let (outcome, latency) = self.sell_once(strategy).await;
                    done.push(Sale {
                        outcome,
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
            let at = started.elapsed();
            Some(failover.kill_master().await.map(|(master, how)| {
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
        let (results, killed) = tokio::join!(futures_util::future::join_all(workers), kill);
        let results: Vec<Sale> = results.into_iter().flatten().collect();
        let killed = killed.transpose()?;
        let duration = started.elapsed();
        let audit = self.audit().await?;
        let mut report = summarize(
            strategy,
            self.plan.stock,
            results
                .iter()
                .map(|s| (s.outcome.clone(), s.latency))
                .collect(),
            duration,
            &audit,
        );
        if let Some((killed, at)) = killed {
            report.resumed_after_s = results
                .iter()
                .filter(|s| matches!(s.outcome, Outcome::Sold { .. }) && s.sent > at)
                .map(|s| s.sent - at)
                .min()
                .map(|d| (d.as_secs_f64() * 1e3).round() / 1e3);
            report.failover = Some(killed);
        }
        Ok(report)
    }

    async fn sell_once(&self, strategy: Strategy) -> (Outcome, Duration) {
        let url = format!(
            "{}/inventory/sale?strategy={strategy}&work_ms={}",
            self.plan.target, self.plan.work_ms
        );
        let started = Instant::now();
        let outcome = match self.http.post(url).send().await {
            Err(e) if e.is_connect() => Outcome::Error("connect".into()),
            Err(e) if e.is_timeout() => Outcome::Error("timeout".into()),
            Err(_) => Outcome::Error("transport".into()),
            Ok(response) => {
                let status = response.status().as_u16();
                let instance = response
                    .headers()
                    .get("x-instance")
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned);
                let body = response.bytes().await.unwrap_or_default();
                classify(status, &body, instance)
            }
        };
        (outcome, started.elapsed())
    }

    async fn reset(&self) -> anyhow::Result<()> {
        let mut request = self
            .http
            .put(format!("{}/inventory", self.plan.target))
            .json(&serde_json::json!({ "stock": self.plan.stock }));
        if let Some(token) = &self.plan.admin_token {
            request = request.bearer_auth(token);
        }
        let response = request
            .send()
            .await
            .with_context(|| format!("cannot reach {}", self.plan.target))?;
        let status = response.status();
        if !status.is_success() {
            let body = response.text().await.unwrap_or_default();
            bail!("resetting the stock failed with {status}: {body}");
        }
        Ok(())
    }

    async fn audit(&self) -> anyhow::Result<Audit> {
        let response = self
            .http
            .get(format!("{}/inventory/audit", self.plan.target))
            .send()
            .await
            .context("cannot read the audit")?;
        let status = response.status();
        if !status.is_success() {
            bail!("the audit failed with {status}");
        }
        Ok(response.json().await?)
    }
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
        (409, Some("lock_lost" | "stale_fence")) => Outcome::Refused,
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

fn summarize(
    strategy: Strategy,
    stock: i64,
    results: Vec<(Outcome, Duration)>,
    duration: Duration,
    audit: &Audit,
) -> StrategyReport {
    let (mut sold, mut sold_out, mut refused, mut errors) = (0, 0, 0, 0);
    let mut error_kinds = BTreeMap::new();
    let mut instances = BTreeMap::new();
    let mut latencies = Vec::with_capacity(results.len());
    for (outcome, latency) in results {
        latencies.push(latency);
        match outcome {
            Outcome::Sold { instance } => {
                sold += 1;
                *instances
                    .entry(instance.unwrap_or_else(|| "?".into()))
                    .or_insert(0) += 1;
            }
            Outcome::SoldOut => sold_out += 1,
            Outcome::Refused => refused += 1,
            Outcome::Error(kind) => {
                errors += 1;
                *error_kinds.entry(kind).or_insert(0) += 1;
            }
        }
    }
    latencies.sort_unstable();
    let requests = latencies.len() as u64;
    let secs = duration.as_secs_f64().max(1e-9);
    let disagreement = disagreement(sold, errors, audit.sales);
    let lost_200 = (sold as i64 - audit.sales).max(0);
    // A sale answered 200 and lost sells its item again: an oversell the audit cannot see.
    let verdict = if audit.oversold > 0
        || audit.lost_updates != 0
        || !audit.duplicates.is_empty()
        || lost_200 > 0
    {
        Verdict::Oversold
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
        errors,
        error_kinds,
        oversold: audit.oversold,
        lost_updates: audit.lost_updates,
        duplicates: audit.duplicates.len() as u64,
        remaining: audit.remaining,
        audit_sales: audit.sales,
        lost_200,
        failover: None,
        resumed_after_s: None,
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
    }
}

/// The client saw `sold` sales; the server recorded `recorded`. Requests that ended in an
/// error (a dropped connection, a 502) may or may not have sold, and are said to be so.
fn disagreement(sold: u64, errors: u64, recorded: i64) -> Option<String> {
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
        assert!(matches!(
            classify(409, &body("stale_fence"), None),
            Outcome::Refused
        ));
        assert!(matches!(
            classify(409, &body("lock_lost"), None),
            Outcome::Refused
        ));
        assert!(
            matches!(classify(503, &body("lock_timeout"), None), Outcome::Error(k) if k == "lock_timeout")
        );
        assert!(matches!(classify(502, b"<html>", None), Outcome::Error(k) if k == "http_502"));
        assert!(matches!(classify(200, b"{}", None), Outcome::Error(_)));
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

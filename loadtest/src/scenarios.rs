//! Fault scenarios: each provokes one fault against its own `redis-server` and two
//! `inventory` processes, records what happened, and judges it from the evidence (statuses,
//! the audit, the keys in Redis), never from the strategy's name. Each scenario is run for
//! the strategy that shows the flaw and for the one that survives it.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use futures_util::StreamExt;
use inventory::events::Event;
use inventory::lock::{RedisLock, Strategy};
use inventory::store::{Audit, Keys};
use redis::AsyncCommands;
use serde::Serialize;
use serde_json::{Value, json};
use testkit::{InventoryProcess, LogSink, RedisProcess, default_env};
use tokio::time::Instant;

use crate::timeline::{Entry, Timeline, sale_tag};

/// Short leases make expiry happen in a fraction of a second.
const TTL_MS: u64 = 500;
/// Long enough for any wait a scenario provokes to end in a lock, short enough to keep a
/// stuck lock from stalling the run.
const WAIT_MS: u64 = 3_000;
/// The pause `release-race` puts between `owner-check`'s GET and its DEL.
const RELEASE_GAP_MS: u64 = 400;
/// How long the runner waits for an event it caused.
const EVENT_WITHIN: Duration = Duration::from_secs(5);

#[derive(Debug, Clone, Copy, Serialize)]
pub struct Scenario {
    pub name: &'static str,
    pub fault: &'static str,
    /// The strategy expected to show the flaw.
    pub flawed: Strategy,
    /// The next strategy, expected to survive it.
    pub survivor: Strategy,
}

pub const SCENARIOS: [Scenario; 8] = [
    Scenario {
        name: "two-instances",
        fault: "concurrent sales on both instances",
        flawed: Strategy::Local,
        survivor: Strategy::Redis(RedisLock::Setnx),
    },
    Scenario {
        name: "crash-holder",
        fault: "kill -9 the instance holding the lock mid-sale",
        flawed: Strategy::Redis(RedisLock::Setnx),
        survivor: Strategy::Redis(RedisLock::SetnxTtl),
    },
    Scenario {
        name: "slow-holder",
        fault: "work longer than the TTL; another sale takes the expired lock; the first then releases",
        flawed: Strategy::Redis(RedisLock::SetnxTtl),
        survivor: Strategy::Redis(RedisLock::OwnerCheck),
    },
    Scenario {
        name: "release-race",
        fault: "the lock changes hands between the owner check and the delete",
        flawed: Strategy::Redis(RedisLock::OwnerCheck),
        survivor: Strategy::Redis(RedisLock::LuaRelease),
    },
    Scenario {
        name: "reentry",
        fault: "the sale acquires the same lock again, nested",
        flawed: Strategy::Redis(RedisLock::LuaRelease),
        survivor: Strategy::Redis(RedisLock::Reentrant),
    },
    Scenario {
        name: "long-work",
        fault: "work three times the TTL while the other instance sells",
        flawed: Strategy::Redis(RedisLock::Reentrant),
        survivor: Strategy::Redis(RedisLock::Watchdog),
    },
    Scenario {
        name: "process-pause",
        fault: "SIGSTOP the holder after it read the stock, longer than the TTL, while the other instance sells",
        flawed: Strategy::Redis(RedisLock::Watchdog),
        survivor: Strategy::Redis(RedisLock::Fenced),
    },
    // A lock protects only the writers that take it. The row's strategy is the second
    // writer, selling beside `fenced` buyers on the same item: `none` ignores the lock and
    // overwrites; `atomic` takes no lock either, but announces its writes, so a locked sale
    // that read before one is refused instead of overwriting it.
    Scenario {
        name: "mixed-writers",
        fault: "half the buyers use fenced, the other half a writer that takes no lock",
        flawed: Strategy::None,
        survivor: Strategy::Atomic,
    },
];

pub fn find(name: &str) -> Option<Scenario> {
    SCENARIOS.into_iter().find(|s| s.name == name)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Observed {
    Flaw,
    Safe,
    /// The fault did not take place (the timing missed): neither verdict.
    Missed,
}

impl std::fmt::Display for Observed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Observed::Flaw => "flaw",
            Observed::Safe => "safe",
            Observed::Missed => "missed",
        })
    }
}

/// One run: `--json` prints exactly this (without the timeline), one per line.
#[derive(Debug, Clone, Serialize)]
pub struct Run {
    pub scenario: &'static str,
    pub strategy: &'static str,
    pub expected: Observed,
    pub observed: Observed,
    pub ok: bool,
    pub details: Value,
    #[serde(skip)]
    pub timeline: String,
}

/// Runs `scenario` for `strategy`. A run whose fault did not take place is tried again, up
/// to `attempts` times; the attempts are reported in the details.
pub async fn run(
    scenario: Scenario,
    strategy: Strategy,
    bin: &Path,
    attempts: u32,
) -> anyhow::Result<Run> {
    let expected = if strategy == scenario.flawed {
        Observed::Flaw
    } else {
        Observed::Safe
    };
    let mut attempt = 0;
    loop {
        attempt += 1;
        let env = Env::start(bin, scenario).await?;
        let (observed, mut details) = match scenario.name {
            "two-instances" => two_instances(&env, strategy).await?,
            "crash-holder" => crash_holder(&env, strategy).await?,
            "slow-holder" | "release-race" => third_sale_enters(&env, scenario, strategy).await?,
            "reentry" => reentry(&env, strategy).await?,
            "long-work" => long_work(&env, strategy).await?,
            "process-pause" => process_pause(&env, strategy).await?,
            "mixed-writers" => mixed_writers(&env, strategy).await?,
            other => anyhow::bail!("unknown scenario {other}"),
        };
        if observed == Observed::Missed && attempt < attempts {
            continue;
        }
        details["attempts"] = json!(attempt);
        return Ok(Run {
            scenario: scenario.name,
            strategy: strategy.name(),
            expected,
            observed,
            ok: observed == expected,
            details,
            timeline: env.timeline.render(),
        });
    }
}

/// A fresh Redis and two instances, with the scenario's settings.
struct Env {
    redis: RedisProcess,
    apps: Vec<InventoryProcess>,
    timeline: Timeline,
    http: reqwest::Client,
    keys: Keys,
}

#[derive(Debug)]
struct Reply {
    status: u16,
    body: Value,
    /// When the reply arrived, since the scenario began.
    at: Duration,
}

impl Reply {
    fn code(&self) -> &str {
        if self.status == 200 {
            "sold"
        } else {
            self.body["error"].as_str().unwrap_or("?")
        }
    }

    fn summary(&self) -> Value {
        json!({"status": self.status, "outcome": self.code(), "at_ms": self.at.as_millis() as u64})
    }
}

impl Env {
    async fn start(bin: &Path, scenario: Scenario) -> anyhow::Result<Self> {
        let redis = RedisProcess::start(&["--notify-keyspace-events", "Ex"]).await?;
        let timeline = Timeline::new();
        let mut apps = Vec::new();
        for name in ["app1", "app2"] {
            let mut env: BTreeMap<String, String> = default_env(&redis.url(), name);
            env.insert("LOCK_TTL_MS".into(), TTL_MS.to_string());
            env.insert("LOCK_WAIT_MS".into(), WAIT_MS.to_string());
            if scenario.name == "release-race" && name == "app1" {
                // Only app1's first sale releases in this scenario: widen its window.
                env.insert("RELEASE_GAP_MS".into(), RELEASE_GAP_MS.to_string());
            }
            if scenario.name == "reentry" {
                // The nested acquire must wait out its budget, not the outer lease.
                env.insert("LOCK_WAIT_MS".into(), "1000".into());
                env.insert("LOCK_TTL_MS".into(), "10000".into());
            }
            let sink: LogSink = {
                let timeline = timeline.clone();
                Arc::new(move |who: &str, line: &str| timeline.record_log(who, line))
            };
            apps.push(InventoryProcess::start(bin, name, &env, Some(sink)).await?);
        }
        let env = Self {
            redis,
            apps,
            timeline,
            http: reqwest::Client::new(),
            keys: Keys::new("001"),
        };
        env.watch_expiries().await?;
        Ok(env)
    }

    /// Puts Redis's own word for a lease running out on the timeline.
    async fn watch_expiries(&self) -> anyhow::Result<()> {
        let mut pubsub = redis::Client::open(self.redis.url())?
            .get_async_pubsub()
            .await?;
        pubsub.subscribe("__keyevent@0__:expired").await?;
        let (timeline, lock) = (self.timeline.clone(), self.keys.lock.clone());
        tokio::spawn(async move {
            let mut messages = pubsub.into_on_message();
            while let Some(message) = messages.next().await {
                if message.get_payload::<String>().is_ok_and(|key| key == lock) {
                    timeline.note("redis", "the lock key EXPIRED");
                }
            }
        });
        Ok(())
    }

    async fn reset(&self, stock: i64) -> anyhow::Result<()> {
        let response = self
            .http
            .put(self.apps[0].url("/inventory"))
            .json(&json!({ "stock": stock }))
            .send()
            .await?;
        anyhow::ensure!(
            response.status().is_success(),
            "reset failed: {}",
            response.status()
        );
        self.timeline
            .note("runner", format!("stock reset to {stock}"));
        Ok(())
    }

    /// One sale on `app` (0 or 1); a transport failure (the instance died) is status 0.
    async fn sale(&self, app: usize, query: String) -> Reply {
        let url = self.apps[app].url(&format!("/inventory/sale?{query}"));
        let body = match self.http.post(url).send().await {
            Ok(response) => {
                let status = response.status().as_u16();
                (
                    status,
                    response.json::<Value>().await.unwrap_or(Value::Null),
                )
            }
            Err(e) => (0, json!({"error": "transport", "message": e.to_string()})),
        };
        Reply {
            status: body.0,
            body: body.1,
            at: self.since_start(),
        }
    }

    fn since_start(&self) -> Duration {
        self.timeline.elapsed()
    }

    async fn audit(&self) -> anyhow::Result<Audit> {
        let response = self
            .http
            .get(self.apps[1].url("/inventory/audit"))
            .send()
            .await?;
        response.json().await.context("reading the audit")
    }

    async fn lock_holder(&self) -> anyhow::Result<Option<String>> {
        let mut c = self.redis.connection().await?;
        Ok(c.get(&self.keys.lock).await?)
    }

    async fn lock_pttl(&self) -> anyhow::Result<i64> {
        let mut c = self.redis.connection().await?;
        Ok(c.pttl(&self.keys.lock).await?)
    }

    async fn wait_event(&self, who: &str, event: Event) -> Option<Entry> {
        self.timeline
            .wait_for(EVENT_WITHIN, |e| e.is(who, event))
            .await
    }
}

fn query(strategy: Strategy, work_ms: u64) -> String {
    format!("strategy={strategy}&work_ms={work_ms}")
}

fn audit_json(audit: &Audit) -> Value {
    serde_json::to_value(audit).unwrap_or(Value::Null)
}

/// Local mutexes are per process: two instances sell the same stock at once.
async fn two_instances(env: &Env, strategy: Strategy) -> anyhow::Result<(Observed, Value)> {
    env.reset(5).await?;
    let sales = (0..20).map(|i| env.sale(i % 2, query(strategy, 50)));
    let replies = futures_util::future::join_all(sales).await;
    let audit = env.audit().await?;
    let mut sold_by = BTreeMap::<String, u64>::new();
    for r in replies.iter().filter(|r| r.status == 200) {
        *sold_by
            .entry(r.body["instance"].as_str().unwrap_or("?").to_owned())
            .or_default() += 1;
    }
    // The fault is both instances selling from the same stock: each must have read it.
    let reads = |app: &str| env.timeline.count(|e| e.is(app, Event::StockRead));
    let observed = if reads("app1") == 0 || reads("app2") == 0 {
        Observed::Missed
    } else if !audit.clean {
        Observed::Flaw
    } else if audit.sales == 5 && audit.remaining == 0 {
        Observed::Safe
    } else {
        Observed::Missed
    };
    Ok((
        observed,
        json!({"sold_by": sold_by, "audit": audit_json(&audit)}),
    ))
}

/// `fenced` buyers on app1 and `strategy` buyers on app2, on one item, at once.
async fn mixed_writers(env: &Env, strategy: Strategy) -> anyhow::Result<(Observed, Value)> {
    // More stock than either kind of buyer asks for, so that a fast one cannot sell it all
    // before the other starts.
    const STOCK: i64 = 30;
    env.reset(STOCK).await?;
    let fenced = Strategy::Redis(RedisLock::Fenced);
    let sales = (0..40).map(|i| {
        let (app, strategy) = if i % 2 == 0 {
            (0, fenced)
        } else {
            (1, strategy)
        };
        env.sale(app, query(strategy, 20))
    });
    let replies = futures_util::future::join_all(sales).await;
    let audit = env.audit().await?;
    let mut outcomes = BTreeMap::<String, u64>::new();
    for (i, r) in replies.iter().enumerate() {
        let who = if i % 2 == 0 {
            "fenced"
        } else {
            strategy.name()
        };
        *outcomes.entry(format!("{who}: {}", r.code())).or_default() += 1;
    }
    let sold_200 = replies.iter().filter(|r| r.status == 200).count() as i64;
    // The two kinds of writer met when both sold, or when a fenced sale was refused
    // because the other wrote during it.
    let met = outcomes.contains_key("fenced: stock_changed")
        || ["fenced: sold", &format!("{}: sold", strategy.name())]
            .iter()
            .all(|k| outcomes.contains_key(*k));
    let observed = if !audit.clean || sold_200 != STOCK - audit.remaining {
        Observed::Flaw
    } else if met {
        Observed::Safe
    } else {
        Observed::Missed
    };
    Ok((
        observed,
        json!({"outcomes": outcomes, "answered_200": sold_200, "audit": audit_json(&audit)}),
    ))
}

/// The holder dies with the lock: does anyone ever sell again?
async fn crash_holder(env: &Env, strategy: Strategy) -> anyhow::Result<(Observed, Value)> {
    env.reset(5).await?;
    let holder = env.sale(0, query(strategy, 10_000));
    let crash = async {
        env.wait_event("app1", Event::StockRead).await?;
        env.apps[0].signal("KILL").await.ok()?;
        env.timeline
            .note("runner", "kill -9 app1 (it holds the lock)");
        Some(())
    };
    let (_, crashed) = tokio::join!(holder, crash);
    if crashed.is_none() {
        return Ok((Observed::Missed, json!({"why": "app1 never held the lock"})));
    }
    let pttl_after_crash = env.lock_pttl().await?;
    let next = env.sale(1, query(strategy, 0)).await;
    let holder_after = env.lock_holder().await?;
    let observed = match (next.status, next.code()) {
        (200, _) => Observed::Safe,
        (503, "lock_timeout")
            if holder_after
                .as_deref()
                .is_some_and(|h| h.starts_with("app1:")) =>
        {
            Observed::Flaw
        }
        _ => Observed::Missed,
    };
    let details = json!({
        "lock_pttl_after_crash_ms": pttl_after_crash,
        "next_sale_on_app2": next.summary(),
        "dead_holder_still_owns_the_lock": holder_after.is_some_and(|h| h.starts_with("app1:")),
    });
    Ok((observed, details))
}

/// Sale A's lock changes hands while A still believes it holds it (by expiry for
/// `slow-holder`, in the release window for `release-race`); B takes it, C waits behind B.
/// The flaw: A's release deletes B's lock and C enters while B still works.
async fn third_sale_enters(
    env: &Env,
    scenario: Scenario,
    strategy: Strategy,
) -> anyhow::Result<(Observed, Value)> {
    env.reset(5).await?;
    // B works less than a lease, so that B's lock can only end by B's release or by A's
    // mistake. `slow-holder`: A's lease ends at 500 ms, B holds from there to ~900 ms, A
    // releases at 700 ms. `release-race`: A checks at 300 ms, the lease ends at 500 ms, B
    // takes it, A deletes at 300 + RELEASE_GAP_MS = 700 ms.
    let (a_work, b_work) = if scenario.name == "slow-holder" {
        (700, 400)
    } else {
        (300, 400)
    };
    let a = env.sale(0, query(strategy, a_work));
    let rest = async {
        env.wait_event("app1", Event::StockRead).await?;
        let b = env.sale(1, query(strategy, b_work));
        let c_and_evidence = async {
            let b_read = env.wait_event("app2", Event::StockRead).await?;
            let b_owner = env.lock_holder().await.ok().flatten();
            env.timeline
                .note("runner", "B holds the lock; C (app2) starts waiting for it");
            let c = env.sale(1, query(strategy, 0)).await;
            Some((b_owner, c, sale_tag(&b_read), b_read.at_ms))
        };
        let (b, c) = tokio::join!(b, c_and_evidence);
        Some((b, c?))
    };
    // The lock holder the moment A's reply arrives: B's, unless A's release deleted it.
    let a_then_lock = async {
        let a = a.await;
        let holder = env.lock_holder().await.ok().flatten();
        (a, holder)
    };
    let ((a, holder_after_a), rest) = tokio::join!(a_then_lock, rest);
    let Some((b, (b_owner, c, b_tag, b_read_at_ms))) = rest else {
        return Ok((
            Observed::Missed,
            json!({"why": "B never took the lock", "a": a.summary()}),
        ));
    };
    let audit = env.audit().await?;
    let b_owner = b_owner.filter(|o| o.starts_with("app2:"));
    // Only an A that finished after B had the lock can have deleted it: an A that released
    // first (its lease never ran out) left nothing of B's to delete, however late B's own
    // acquire came on a loaded machine.
    let a_ended_after_b_held = a.at.as_millis() as u64 > b_read_at_ms;
    let b_lock_deleted = b_owner.is_some() && a_ended_after_b_held && holder_after_a != b_owner;
    // From the instance's own events, not from the order the replies arrive in: a waiter
    // woken at once by B's release can answer before B's own reply gets out.
    let entries = env.timeline.entries();
    let b_done = entries.iter().find(|e| {
        e.who == "app2"
            && matches!(e.event(), Some(Event::SaleWritten | Event::SaleRefused))
            && sale_tag(e) == b_tag
    });
    let c_read = entries
        .iter()
        .find(|e| e.is("app2", Event::StockRead) && sale_tag(e) != b_tag);
    let c_entered_during_b = match (c_read, b_done) {
        (Some(c_read), Some(b_done)) => c_read.at_ms < b_done.at_ms,
        _ => c.status == 200 && c.at < b.at,
    };
    let observed = match b_owner {
        None => Observed::Missed,
        Some(_) if b_lock_deleted || c_entered_during_b => Observed::Flaw,
        Some(_) => Observed::Safe,
    };
    let details = json!({
        "a": a.summary(), "b": b.summary(), "c": c.summary(),
        "a_release_deleted_b_lock": b_lock_deleted,
        "c_entered_while_b_worked": c_entered_during_b,
        "audit": audit_json(&audit),
    });
    Ok((observed, details))
}

/// The sale takes its own lock again.
async fn reentry(env: &Env, strategy: Strategy) -> anyhow::Result<(Observed, Value)> {
    env.reset(5).await?;
    let reply = env
        .sale(0, format!("strategy={strategy}&reenter=true"))
        .await;
    let nested_attempted = env.timeline.count(|e| e.is("app1", Event::LockAcquired)) >= 1;
    let observed = match (reply.status, reply.code()) {
        (200, _) => Observed::Safe,
        (503, "lock_timeout") if nested_attempted => Observed::Flaw,
        _ => Observed::Missed,
    };
    Ok((
        observed,
        json!({"sale": reply.summary(), "body": reply.body}),
    ))
}

/// Work three leases long on app1 while app2 sells.
async fn long_work(env: &Env, strategy: Strategy) -> anyhow::Result<(Observed, Value)> {
    env.reset(5).await?;
    let a = env.sale(0, query(strategy, 3 * TTL_MS));
    let b = async {
        env.wait_event("app1", Event::StockRead).await?;
        env.timeline
            .note("runner", "app2 starts a sale while app1 works");
        Some(env.sale(1, query(strategy, 0)).await)
    };
    let (a, b) = tokio::join!(a, b);
    let Some(b) = b else {
        return Ok((Observed::Missed, json!({"why": "app1 never held the lock"})));
    };
    let audit = env.audit().await?;
    let renewals = env.timeline.count(|e| e.is("app1", Event::LockRenewed));
    let observed = if a.status != 200 || b.status != 200 {
        Observed::Missed
    } else if !audit.clean {
        Observed::Flaw
    } else {
        Observed::Safe
    };
    let details = json!({
        "a": a.summary(), "b": b.summary(), "b_sold_before_a": b.at < a.at,
        "renewals_by_app1": renewals, "audit": audit_json(&audit),
    });
    Ok((observed, details))
}

/// Freeze the holder between its read and its write, long enough for its lease to expire and
/// for the other instance to sell; then let it go on.
async fn process_pause(env: &Env, strategy: Strategy) -> anyhow::Result<(Observed, Value)> {
    const WORK_MS: u64 = 600;
    env.reset(5).await?;
    let a = env.sale(0, query(strategy, WORK_MS));
    let fault = async {
        let read = env.wait_event("app1", Event::StockRead).await?;
        env.apps[0].signal("STOP").await.ok()?;
        env.timeline.note(
            "runner",
            "SIGSTOP app1 (it read the stock and holds the lock)",
        );
        let b = env.sale(1, query(strategy, 0)).await;
        // Resume only once app1's work is over, so that it wakes straight into its write,
        // as a process back from a long GC pause does.
        let work_over = Duration::from_millis(read.at_ms + WORK_MS + 100);
        tokio::time::sleep(work_over.saturating_sub(env.since_start())).await;
        env.apps[0].signal("CONT").await.ok()?;
        env.timeline.note("runner", "SIGCONT app1");
        Some(b)
    };
    let (a, b) = tokio::join!(a, fault);
    let Some(b) = b else {
        return Ok((
            Observed::Missed,
            json!({"why": "could not pause app1 while it held the lock"}),
        ));
    };
    let audit = env.audit().await?;
    let observed = if b.status != 200 {
        // The other instance never sold during the pause: the lock did not change hands.
        Observed::Missed
    } else if a.code() == "lock_lost" {
        // Woken with both its work and its renewal overdue, the holder's renewal ran first
        // and it noticed before writing: the write this scenario is about never happened.
        Observed::Missed
    } else if a.status == 200 && !audit.clean {
        Observed::Flaw
    } else if a.status == 409 && audit.clean {
        Observed::Safe
    } else {
        Observed::Missed
    };
    let details = json!({
        "paused_holder": a.summary(), "other_instance": b.summary(),
        "stale_write_refused": a.code() == "stale_fence" || a.code() == "lock_lost",
        "audit": audit_json(&audit),
    });
    Ok((observed, details))
}

/// Every row: each scenario for its flawed strategy, then for its survivor.
pub fn rows() -> Vec<(Scenario, Strategy)> {
    SCENARIOS
        .iter()
        .flat_map(|s| [(*s, s.flawed), (*s, s.survivor)])
        .collect()
}

/// How long a run may take at most, for callers that want a bound.
pub const RUN_BOUND: Duration = Duration::from_secs(60);

pub async fn run_bounded(
    scenario: Scenario,
    strategy: Strategy,
    bin: &Path,
    attempts: u32,
) -> anyhow::Result<Run> {
    let started = Instant::now();
    tokio::time::timeout(RUN_BOUND, run(scenario, strategy, bin, attempts))
        .await
        .with_context(|| {
            format!(
                "{} / {} took longer than {:?}",
                scenario.name,
                strategy,
                started.elapsed()
            )
        })?
}

//! What every scenario runs against: a fresh `redis-server` and two instances (`app1`,
//! `app2`) with short leases, their events on one timeline, and the few requests a scenario
//! makes.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use futures_util::StreamExt;
use inventory::events::Event;
use inventory::lock::Strategy;
use inventory::store::{Audit, Keys};
use redis::AsyncCommands;
use serde_json::{Value, json};
use testkit::{
    InventoryProcess, LogSink, Namespace, RedisProcess, SentinelProcess, SentinelTiming,
    default_env,
};

use super::Row;
use crate::timeline::{Entry, Timeline};

/// Short leases make expiry happen in a fraction of a second.
pub(super) const TTL_MS: u64 = 500;
/// Long enough for any wait a scenario provokes to end in a lock, short enough to keep a
/// stuck lock from stalling the run.
const WAIT_MS: u64 = 3_000;
/// How long the runner waits for an event it caused.
const EVENT_WITHIN: Duration = Duration::from_secs(5);

/// Where the lock nodes (`LOCK_NODES`) and the stock's Redis live in a scenario.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Nodes {
    /// Three databases of the stock's Redis (the default of every instance).
    Shared,
    /// Three `redis-server` processes of their own on loopback.
    Separate,
    /// Like `Separate`, but the third node runs in a network namespace reached by one link
    /// per instance, so that it can be cut off from `app1` alone (link 0).
    ThirdInNamespace,
    /// The stock's Redis (and the lock nodes, its databases) in a namespace reached by one
    /// link per instance: its one node can be cut off from `app1` alone (link 0).
    StockInNamespace,
}

/// A fresh Redis and two instances, with the scenario's settings.
pub(super) struct Env {
    /// Declared first: dropped before the namespace they may run in.
    pub(super) redis: RedisProcess,
    /// Replicas of `redis`, and the sentinels that watch them all, when the scenario has
    /// them; the instances then find the master through the sentinels.
    pub(super) replicas: Vec<RedisProcess>,
    pub(super) sentinels: Vec<SentinelProcess>,
    /// The separate lock nodes, when the scenario has them.
    pub(super) nodes: Vec<tokio::sync::Mutex<RedisProcess>>,
    pub(super) apps: Vec<InventoryProcess>,
    pub(super) timeline: Timeline,
    http: reqwest::Client,
    pub(super) keys: Keys,
    /// The namespace of `Nodes::ThirdInNamespace` / `StockInNamespace`; dropped last, which
    /// removes it with its links.
    pub(super) ns: Option<Namespace>,
}

#[derive(Debug)]
pub(super) struct Reply {
    pub(super) status: u16,
    pub(super) body: Value,
    /// When the reply arrived, since the scenario began.
    pub(super) at: Duration,
}

impl Reply {
    pub(super) fn code(&self) -> &str {
        if self.status == 200 {
            "sold"
        } else {
            self.body["error"].as_str().unwrap_or("?")
        }
    }

    pub(super) fn summary(&self) -> Value {
        json!({"status": self.status, "outcome": self.code(), "at_ms": self.at.as_millis() as u64})
    }
}

impl Env {
    pub(super) async fn start(bin: &Path, row: Row) -> anyhow::Result<Self> {
        let (fault, strategy) = (row.fault, row.strategy());
        let placement = fault.nodes(strategy);
        let mut extra = vec!["--notify-keyspace-events", "Ex"];
        extra.extend(fault.redis_extra());
        let mut ns = match placement {
            Nodes::ThirdInNamespace | Nodes::StockInNamespace => {
                let mut ns = Namespace::create()?;
                ns.add_link()?;
                ns.add_link()?;
                Some(ns)
            }
            Nodes::Shared | Nodes::Separate => None,
        };
        let in_ns = |ns: &Option<Namespace>| {
            ns.as_ref()
                .map(|ns| (ns.link(0).ns_addr, ns.link(1).ns_addr))
        };
        let redis = match (placement, in_ns(&ns)) {
            (Nodes::StockInNamespace, Some((a, b))) => {
                RedisProcess::start_in(ns.as_ref().context("namespace")?, &[a, b], &extra).await?
            }
            _ => RedisProcess::start(&extra).await?,
        };
        let mut nodes = Vec::new();
        if matches!(placement, Nodes::Separate | Nodes::ThirdInNamespace) {
            nodes.push(RedisProcess::start(&[]).await?);
            nodes.push(RedisProcess::start(&[]).await?);
            nodes.push(match in_ns(&ns) {
                Some((a, b)) if placement == Nodes::ThirdInNamespace => {
                    RedisProcess::start_in(ns.as_mut().context("namespace")?, &[a, b], &[]).await?
                }
                _ => RedisProcess::start(&[]).await?,
            });
        }
        let (replicas, sentinels) = replicated(&redis, fault.replicas(), &extra).await?;
        let timeline = Timeline::new();
        let mut apps = Vec::new();
        for (i, name) in ["app1", "app2"].into_iter().enumerate() {
            // Each instance reaches a node in the namespace through a link of its own.
            let link = in_ns(&ns).map(|(a, b)| if i == 0 { a } else { b });
            let stock_url = match (placement, link) {
                (Nodes::StockInNamespace, Some(addr)) => redis.url_at(addr),
                _ => redis.url(),
            };
            let mut env: BTreeMap<String, String> = default_env(&stock_url, name);
            if !nodes.is_empty() {
                let urls: Vec<String> = nodes
                    .iter()
                    .enumerate()
                    .map(|(n, node)| match link {
                        Some(addr) if n == 2 => node.url_at(addr),
                        _ => node.url(),
                    })
                    .collect();
                env.insert("LOCK_NODES".into(), urls.join(","));
            }
            env.insert("LOCK_TTL_MS".into(), TTL_MS.to_string());
            env.insert("LOCK_WAIT_MS".into(), WAIT_MS.to_string());
            if !sentinels.is_empty() {
                env.remove("REDIS_URL");
                env.remove("LOCK_NODES");
                let addrs: Vec<String> = sentinels.iter().map(SentinelProcess::addr).collect();
                env.insert("REDIS_SENTINELS".into(), addrs.join(","));
                env.insert("REDIS_MASTER_NAME".into(), MASTER_NAME.into());
            }
            fault.configure(name, &mut env);
            if let Some((var, value)) = row.setting() {
                env.insert(var.into(), value.into());
            }
            let sink: LogSink = {
                let timeline = timeline.clone();
                Arc::new(move |who: &str, line: &str| timeline.record_log(who, line))
            };
            apps.push(InventoryProcess::start(bin, name, &env, Some(sink)).await?);
        }
        let env = Self {
            redis,
            replicas,
            sentinels,
            nodes: nodes.into_iter().map(tokio::sync::Mutex::new).collect(),
            apps,
            timeline,
            http: reqwest::Client::new(),
            keys: Keys::new("001"),
            ns: ns.take(),
        };
        env.watch_expiries().await?;
        Ok(env)
    }

    /// Cuts the namespace's link 0 (`app1`'s): from now on `app1` cannot reach what runs in
    /// the namespace, while `app2` still can.
    pub(super) fn cut_app1(&self) -> anyhow::Result<()> {
        let ns = self.ns.as_ref().context("this scenario has no namespace")?;
        ns.link(0).cut()?;
        self.timeline.note(
            "runner",
            format!(
                "partition: link {} ({}) down, app1 cut off from the namespace",
                ns.link(0).host_if,
                ns.link(0).ns_addr
            ),
        );
        Ok(())
    }

    /// Puts Redis's own word for a lease running out on the timeline.
    async fn watch_expiries(&self) -> anyhow::Result<()> {
        let mut pubsub = redis::Client::open(self.runner_url())?
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

    /// The stock's Redis as the runner reaches it: through `app2`'s link when it runs in a
    /// namespace (`app1`'s may be cut).
    fn runner_url(&self) -> String {
        match &self.ns {
            Some(ns) if self.nodes.is_empty() => self.redis.url_at(ns.link(1).ns_addr),
            _ => self.redis.url(),
        }
    }

    pub(super) async fn reset(&self, stock: i64) -> anyhow::Result<()> {
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
    pub(super) async fn sale(&self, app: usize, query: String) -> Reply {
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

    pub(super) fn since_start(&self) -> Duration {
        self.timeline.elapsed()
    }

    pub(super) async fn audit(&self) -> anyhow::Result<Audit> {
        let response = self
            .http
            .get(self.apps[1].url("/inventory/audit"))
            .send()
            .await?;
        response.json().await.context("reading the audit")
    }

    pub(super) async fn lock_holder(&self) -> anyhow::Result<Option<String>> {
        let mut c = self.redis.connection().await?;
        Ok(c.get(&self.keys.lock).await?)
    }

    pub(super) async fn lock_pttl(&self) -> anyhow::Result<i64> {
        let mut c = self.redis.connection().await?;
        Ok(c.pttl(&self.keys.lock).await?)
    }

    pub(super) async fn wait_event(&self, who: &str, event: Event) -> Option<Entry> {
        self.timeline
            .wait_for(EVENT_WITHIN, |e| e.is(who, event))
            .await
    }
}

/// The name the sentinels know the stock's master by.
pub(super) const MASTER_NAME: &str = "inventory";

/// `count` replicas of `master`, synced, and three sentinels that know them all; nothing
/// when `count` is 0.
async fn replicated(
    master: &RedisProcess,
    count: usize,
    extra: &[&str],
) -> anyhow::Result<(Vec<RedisProcess>, Vec<SentinelProcess>)> {
    if count == 0 {
        return Ok((Vec::new(), Vec::new()));
    }
    let port = master.port.to_string();
    let mut replicas = Vec::new();
    for _ in 0..count {
        let mut args = vec!["--replicaof", "127.0.0.1", &port];
        args.extend(extra);
        replicas.push(RedisProcess::start(&args).await?);
    }
    let mut c = master.connection().await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let info: String = redis::cmd("INFO")
            .arg("replication")
            .query_async(&mut c)
            .await?;
        if info.matches("state=online").count() == count {
            break;
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the replicas never synced:\n{info}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let sentinels =
        testkit::start_sentinels(MASTER_NAME, master.port, count, SentinelTiming::default())
            .await?;
    Ok((replicas, sentinels))
}

pub(super) fn query(strategy: Strategy, work_ms: u64) -> String {
    format!("strategy={strategy}&work_ms={work_ms}")
}

pub(super) fn audit_json(audit: &Audit) -> Value {
    serde_json::to_value(audit).unwrap_or(Value::Null)
}

/// Pairs of sales that held the lock at the same time, by their timeline entries, as
/// `"app1 [tag] / app2 [tag]"`. A sale holds from its `lock acquired` to the first of its
/// write, its refusal or its release (a sale that logged none holds to the end): the release
/// of a quorum lock is logged only once every node answered or timed out, well after the
/// nodes that count have freed it, so it alone would see a hand-over as an overlap.
pub(super) fn overlapping_holders(timeline: &Timeline) -> Vec<String> {
    use crate::timeline::sale_tag;
    let entries = timeline.entries();
    let ends = [Event::SaleWritten, Event::SaleRefused, Event::LockReleased];
    let mut spans: Vec<(u64, u64, String)> = Vec::new();
    for e in entries
        .iter()
        .filter(|e| e.event() == Some(Event::LockAcquired))
    {
        let tag = sale_tag(e);
        let end = entries
            .iter()
            .filter(|r| r.event().is_some_and(|ev| ends.contains(&ev)))
            .find(|r| r.who == e.who && sale_tag(r) == tag && r.at_ms >= e.at_ms)
            .map_or(u64::MAX, |r| r.at_ms);
        spans.push((e.at_ms, end, format!("{} {}", e.who, tag.trim())));
    }
    let mut overlaps = Vec::new();
    for (i, a) in spans.iter().enumerate() {
        for b in &spans[i + 1..] {
            // Strictly inside: an end and the next acquire logged in the same millisecond
            // are a hand-over, not two holders.
            if a.0 < b.1 && b.0 < a.1 && a.2 != b.2 {
                overlaps.push(format!("{} / {}", a.2, b.2));
            }
        }
    }
    overlaps
}

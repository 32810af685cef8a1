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
use testkit::{InventoryProcess, LogSink, RedisProcess, default_env};

use super::Fault;
use crate::timeline::{Entry, Timeline};

/// Short leases make expiry happen in a fraction of a second.
pub(super) const TTL_MS: u64 = 500;
/// Long enough for any wait a scenario provokes to end in a lock, short enough to keep a
/// stuck lock from stalling the run.
const WAIT_MS: u64 = 3_000;
/// How long the runner waits for an event it caused.
const EVENT_WITHIN: Duration = Duration::from_secs(5);

/// A fresh Redis and two instances, with the scenario's settings.
pub(super) struct Env {
    redis: RedisProcess,
    pub(super) apps: Vec<InventoryProcess>,
    pub(super) timeline: Timeline,
    http: reqwest::Client,
    keys: Keys,
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
    pub(super) async fn start(bin: &Path, fault: Fault) -> anyhow::Result<Self> {
        let redis = RedisProcess::start(&["--notify-keyspace-events", "Ex"]).await?;
        let timeline = Timeline::new();
        let mut apps = Vec::new();
        for name in ["app1", "app2"] {
            let mut env: BTreeMap<String, String> = default_env(&redis.url(), name);
            env.insert("LOCK_TTL_MS".into(), TTL_MS.to_string());
            env.insert("LOCK_WAIT_MS".into(), WAIT_MS.to_string());
            fault.configure(name, &mut env);
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

pub(super) fn query(strategy: Strategy, work_ms: u64) -> String {
    format!("strategy={strategy}&work_ms={work_ms}")
}

pub(super) fn audit_json(audit: &Audit) -> Value {
    serde_json::to_value(audit).unwrap_or(Value::Null)
}

//! What happened, in order: the instances' own log events (read from their JSON logs as they
//! come) and the runner's notes, each stamped with the time since the scenario began.
//!
//! An instance's line is an event when its `event` field names one of
//! [`inventory::events::Event`], the same type the service's log sites write it with.

use std::fmt::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use inventory::events::{self, Event};
use serde_json::{Map, Value};
use tokio::sync::Notify;
use tokio::time::Instant;

#[derive(Debug, Clone)]
pub struct Entry {
    pub at_ms: u64,
    /// `app1`, `app2`, `redis` or `runner`.
    pub who: String,
    pub what: What,
    /// The rest of the event's log line (`owner`, `fence`, `stock`, ...); empty for a note.
    pub fields: Map<String, Value>,
}

/// What an entry says happened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum What {
    /// An instance's own event, from its log.
    Event(Event),
    /// The runner's (or Redis's) word, for people.
    Note(String),
}

#[derive(Clone)]
pub struct Timeline(Arc<Inner>);

struct Inner {
    start: Instant,
    entries: Mutex<Vec<Entry>>,
    changed: Notify,
}

impl Default for Timeline {
    fn default() -> Self {
        Self::new()
    }
}

impl Timeline {
    pub fn new() -> Self {
        Self(Arc::new(Inner {
            start: Instant::now(),
            entries: Mutex::default(),
            changed: Notify::new(),
        }))
    }

    /// Time since the timeline began.
    pub fn elapsed(&self) -> Duration {
        self.0.start.elapsed()
    }

    pub fn note(&self, who: &str, what: impl Into<String>) {
        self.push(who, What::Note(what.into()), Map::new());
    }

    fn push(&self, who: &str, what: What, fields: Map<String, Value>) {
        let at_ms = self.0.start.elapsed().as_millis() as u64;
        if let Ok(mut entries) = self.0.entries.lock() {
            // Redis reports an expiry when it finds the key expired, often on the very `SET NX`
            // that takes it next, and the acquire's log line may reach us first: within one
            // millisecond, the expiry goes before the acquire it allowed.
            let expiry = matches!(&what, What::Note(n) if n.contains("EXPIRED"));
            let at = if expiry {
                let same_ms = entries
                    .iter()
                    .rev()
                    .take_while(|e| e.at_ms == at_ms)
                    .count();
                let from = entries.len() - same_ms;
                entries[from..]
                    .iter()
                    .position(|e| {
                        e.event() == Some(Event::LockAcquired) && e.text("nested") != "true"
                    })
                    .map_or(entries.len(), |i| from + i)
            } else {
                entries.len()
            };
            entries.insert(
                at,
                Entry {
                    at_ms,
                    who: who.to_owned(),
                    what,
                    fields,
                },
            );
        }
        self.0.changed.notify_waiters();
    }

    /// Takes one line of an instance's JSON log; keeps it if it names an [`Event`].
    pub fn record_log(&self, instance: &str, line: &str) {
        let Ok(Value::Object(mut fields)) = serde_json::from_str::<Value>(line) else {
            return;
        };
        let Some(Value::String(name)) = fields.remove(events::FIELD) else {
            return;
        };
        if let Some(event) = Event::from_name(&name) {
            for noise in ["message", "timestamp", "level"] {
                fields.remove(noise);
            }
            self.push(instance, What::Event(event), fields);
        }
    }

    pub fn entries(&self) -> Vec<Entry> {
        self.0.entries.lock().map(|e| e.clone()).unwrap_or_default()
    }

    /// Waits until an entry matching `found` exists (returning it), or `within` passes.
    pub async fn wait_for(
        &self,
        within: Duration,
        found: impl Fn(&Entry) -> bool,
    ) -> Option<Entry> {
        let deadline = Instant::now() + within;
        loop {
            let changed = self.0.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if let Some(entry) = self.entries().into_iter().find(|e| found(e)) {
                return Some(entry);
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return None;
            }
        }
    }

    pub fn count(&self, found: impl Fn(&Entry) -> bool) -> usize {
        self.entries().iter().filter(|e| found(e)).count()
    }

    /// One line per entry, for people.
    pub fn render(&self) -> String {
        let mut out = String::new();
        for e in self.entries() {
            let _ = writeln!(
                out,
                "  {:>6.3}s  {:<6}  {}",
                e.at_ms as f64 / 1000.0,
                e.who,
                describe(&e)
            );
        }
        out
    }
}

impl Entry {
    /// Whether `who` logged `event`.
    pub fn is(&self, who: &str, event: Event) -> bool {
        self.who == who && self.event() == Some(event)
    }

    pub fn event(&self) -> Option<Event> {
        match self.what {
            What::Event(event) => Some(event),
            What::Note(_) => None,
        }
    }

    fn field(&self, name: &str) -> Option<&Value> {
        self.fields.get(name).filter(|v| !v.is_null())
    }

    fn text(&self, name: &str) -> String {
        match self.field(name) {
            Some(Value::String(s)) => s.clone(),
            Some(v) => v.to_string(),
            None => String::new(),
        }
    }
}

/// A sale is known by the first 8 characters of its id, in owner ids and order ids alike.
pub fn sale_tag(e: &Entry) -> String {
    let id = e.text("owner");
    let id = if id.is_empty() {
        e.text("order_id")
    } else {
        id
    };
    let id = id.rsplit(':').next().unwrap_or_default();
    if id.is_empty() {
        String::new()
    } else {
        format!("[{}] ", &id[..id.len().min(8)])
    }
}

fn describe(e: &Entry) -> String {
    let tag = sale_tag(e);
    let fence = e
        .field("fence")
        .map(|f| format!(" (fence {f})"))
        .unwrap_or_default();
    let event = match &e.what {
        What::Event(event) => *event,
        What::Note(note) => return note.clone(),
    };
    match event {
        Event::LockAcquired if e.text("nested") == "true" => format!("{tag}re-entered the lock"),
        Event::LockAcquired => format!(
            "{tag}acquired the lock{fence}, after waiting {} ms",
            e.text("waited_ms")
        ),
        Event::LockReleased => match e.text("released").as_str() {
            "Freed" => format!("{tag}released the lock"),
            "StillHeld" => format!("{tag}left one level of the lock"),
            // Only a release that checks the owner can find the lock another's; a plain
            // `DEL` that deleted nothing found it gone.
            "NotHeld"
                if matches!(
                    e.text("strategy").parse::<inventory::strategy::Strategy>(),
                    Ok(inventory::strategy::Strategy::Redis(
                        inventory::strategy::RedisLock::Setnx
                            | inventory::strategy::RedisLock::SetnxTtl
                    ))
                ) =>
            {
                format!("{tag}released: the lock was already gone, nothing deleted")
            }
            "NotHeld" => format!("{tag}released: the lock was no longer its own, nothing deleted"),
            other => format!("{tag}released ({other})"),
        },
        Event::LockRenewed => format!("{tag}renewed the lock"),
        Event::LockLost => format!("{tag}LOST the lock: {}", e.text("reason")),
        Event::StockRead => format!("{tag}read stock {}{fence}", e.text("stock")),
        Event::SaleWritten => format!("{tag}wrote stock {}{fence}", e.text("remaining")),
        Event::SaleRefused => format!("{tag}sale refused: {}", e.text("reason")),
        Event::TransactionConflict => format!(
            "{tag}EXEC refused (attempt {}): its work is thrown away",
            e.text("attempt")
        ),
        Event::LockQuorum => format!(
            "{tag}quorum {}/{}: [{}] -> {}",
            e.text("granted"),
            e.text("nodes"),
            e.text("votes"),
            if e.text("held") == "true" {
                "held"
            } else {
                "not held, given back"
            }
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Heard in one millisecond, an expiry and the acquire it allowed were printed acquire
    /// first ("acquired the lock" before "the lock key EXPIRED"), the order of no cause.
    #[test]
    fn an_expiry_goes_before_the_acquire_it_allowed_within_one_millisecond() {
        let timeline = Timeline::new();
        let line = format!(
            r#"{{"{}":"{}","strategy":"setnx-ttl","owner":"a:b:12345678","nested":false,"waited_ms":3}}"#,
            events::FIELD,
            Event::LockAcquired.name()
        );
        timeline.record_log("app2", &line);
        timeline.note("redis", "the lock key EXPIRED");
        let entries = timeline.entries();
        if entries[0].at_ms != entries[1].at_ms {
            // The clock moved between the two: there is no millisecond to order within.
            return;
        }
        let rendered = timeline.render();
        let expired = rendered.find("EXPIRED").unwrap_or(usize::MAX);
        let acquired = rendered.find("acquired the lock").unwrap_or(0);
        assert!(expired < acquired, "{rendered}");
    }

    /// Only a release that checks its owner can find the lock another's: `setnx-ttl`'s plain
    /// `DEL` that deleted nothing found it gone, and its timeline said "no longer its own",
    /// the words of the owner check it does not have.
    #[test]
    fn a_release_that_deleted_nothing_is_told_by_whether_it_checks_the_owner() {
        let said = |strategy: &str| {
            let timeline = Timeline::new();
            let line = format!(
                r#"{{"{}":"{}","strategy":"{strategy}","owner":"a:b:12345678","released":"NotHeld"}}"#,
                events::FIELD,
                Event::LockReleased.name()
            );
            timeline.record_log("app1", &line);
            timeline.render()
        };
        assert!(
            said("setnx-ttl").contains("already gone"),
            "{}",
            said("setnx-ttl")
        );
        assert!(
            said("owner-check").contains("no longer its own"),
            "{}",
            said("owner-check")
        );
        assert!(said("fenced").contains("no longer its own"));
    }
}

#![allow(clippy::unwrap_used)]

use serde_json::{Map, json};

use super::*;
use crate::timeline::What;
use inventory::events::Event;

fn event(at_ms: u64, who: &str, event: Event, fields: serde_json::Value) -> Entry {
    let fields: Map<String, Value> = fields.as_object().cloned().unwrap_or_default();
    Entry {
        at_ms,
        who: who.into(),
        what: What::Event(event),
        fields,
    }
}

fn note(at_ms: u64, who: &str, text: &str) -> Entry {
    Entry {
        at_ms,
        who: who.into(),
        what: What::Note(text.into()),
        fields: Map::new(),
    }
}

/// process-pause as a timeline: A (app1) paused after its read, its lease expires, B
/// (app2) sells; A then writes (`refused` None) or is refused.
pub(crate) fn pause(strategy: &str, refused: Option<&str>) -> Vec<Entry> {
    let a = "app1:aaaaaaaa-1";
    let b = "app2:bbbbbbbb-2";
    let mut e = vec![
        note(10, "runner", "stock reset to 5"),
        event(
            20,
            "app1",
            Event::LockAcquired,
            json!({"owner": a, "strategy": strategy, "fence": 1, "nested": false, "waited_ms": 0}),
        ),
        event(
            22,
            "app1",
            Event::StockRead,
            json!({"order_id": "aaaaaaaa-1", "stock": 5, "fence": 1}),
        ),
        note(
            25,
            "runner",
            "SIGSTOP app1 (it read the stock and holds the lock)",
        ),
        note(520, "redis", "the lock key EXPIRED"),
        event(
            521,
            "app2",
            Event::LockAcquired,
            json!({"owner": b, "strategy": strategy, "fence": 2, "nested": false, "waited_ms": 490}),
        ),
        event(
            522,
            "app2",
            Event::StockRead,
            json!({"order_id": "bbbbbbbb-2", "stock": 5, "fence": 2}),
        ),
        event(
            524,
            "app2",
            Event::SaleWritten,
            json!({"order_id": "bbbbbbbb-2", "remaining": 4, "fence": 2}),
        ),
        event(
            525,
            "app2",
            Event::LockReleased,
            json!({"owner": b, "strategy": strategy, "released": "Freed"}),
        ),
        note(720, "runner", "SIGCONT app1"),
    ];
    match refused {
        None => e.push(event(
            722,
            "app1",
            Event::SaleWritten,
            json!({"order_id": "aaaaaaaa-1", "remaining": 4, "fence": 1}),
        )),
        Some(reason) => e.push(event(
            722,
            "app1",
            Event::SaleRefused,
            json!({"order_id": "aaaaaaaa-1", "reason": reason}),
        )),
    }
    e.push(event(
        723,
        "app1",
        Event::LockReleased,
        json!({"owner": a, "strategy": strategy, "released": "NotHeld"}),
    ));
    e
}

#[test]
fn a_stale_write_after_a_pause_is_red_where_both_held_and_a_refused_one_is_not() {
    let flaw = Model::from_entries(&pause("watchdog", None));
    assert_eq!(flaw.conflicts.len(), 1, "{:?}", flaw.conflicts);
    let c = &flaw.conflicts[0];
    assert_eq!(
        (
            flaw.sales[c.first].letter.as_str(),
            flaw.sales[c.stale].letter.as_str()
        ),
        ("B", "A")
    );
    assert_eq!(c.both.map(|b| (b.from, b.to)), Some((521, 525)));
    assert!(flaw.has_harm());
    let svg = draw(&pause("watchdog", None), "t").svg;
    assert!(
        svg.contains(RED) && svg.contains("mark write stale"),
        "{svg}"
    );
    assert!(svg.contains("frozen"), "the pause is drawn");

    let safe = Model::from_entries(&pause("fenced", Some("stale_fence")));
    assert!(!safe.has_harm(), "{:?}", safe.findings());
    assert_eq!(safe.overlaps.len(), 1, "two holders at once, kept harmless");
    let svg = draw(&pause("fenced", Some("stale_fence")), "t").svg;
    assert!(!svg.contains(RED), "{svg}");
    assert!(svg.contains("mark refused"), "{svg}");
}

#[test]
fn lanes_come_from_the_entries_so_more_nodes_get_lanes_of_their_own() {
    let owner = "app3:cccccccc-3";
    let entries = vec![
        event(
            5,
            "app3",
            Event::LockAcquired,
            json!({"owner": owner, "strategy": "redlock", "nested": false}),
        ),
        note(10, "runner", "SIGSTOP redis2"),
        note(50, "redis3", "the lock key EXPIRED"),
        note(90, "runner", "SIGCONT redis2"),
        note(95, "runner", "something nobody planned for"),
    ];
    let m = Model::from_entries(&entries);
    let names: Vec<&str> = m.lanes.iter().map(|l| l.name.as_str()).collect();
    assert_eq!(names, ["app3", "redis2", "redis3"]);
    assert_eq!(m.states.len(), 1, "redis2 is paused");
    let svg = draw(&entries, "t").svg;
    assert!(svg.contains(r#"data-lane="redis3""#));
    assert!(
        svg.contains("runner notes"),
        "the unknown note is on the strip"
    );
}

#[test]
fn a_dead_holders_lock_that_blocks_a_buyer_is_red_and_one_that_expires_is_not() {
    let a = "app1:aaaaaaaa-1";
    let mut entries = vec![
        event(
            20,
            "app1",
            Event::LockAcquired,
            json!({"owner": a, "strategy": "setnx", "nested": false}),
        ),
        event(
            22,
            "app1",
            Event::StockRead,
            json!({"order_id": "aaaaaaaa-1", "stock": 5}),
        ),
        note(30, "runner", "kill -9 app1 (it holds the lock)"),
    ];
    let mut expired = entries.clone();
    entries.push(event(
        3040,
        "app2",
        Event::SaleRefused,
        json!({"order_id": "bbbbbbbb-2", "reason": "lock_timeout"}),
    ));
    let m = Model::from_entries(&entries);
    assert_eq!(m.blocked.len(), 1, "{:?}", m.findings());
    assert!(draw(&entries, "t").svg.contains(RED));

    expired.push(note(520, "redis", "the lock key EXPIRED"));
    expired.push(event(
        521,
        "app2",
        Event::LockAcquired,
        json!({"owner": "app2:bbbbbbbb-2", "strategy": "setnx-ttl", "nested": false}),
    ));
    assert!(!Model::from_entries(&expired).has_harm());
}

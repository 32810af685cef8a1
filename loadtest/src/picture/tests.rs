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

fn acquire(at: u64, who: &str, id: &str, strategy: &str) -> Entry {
    event(
        at,
        who,
        Event::LockAcquired,
        json!({"owner": format!("{who}:{id}"), "strategy": strategy, "nested": false, "waited_ms": 0}),
    )
}

fn read(at: u64, who: &str, id: &str, stock: u64) -> Entry {
    event(
        at,
        who,
        Event::StockRead,
        json!({"order_id": id, "stock": stock}),
    )
}

fn write(at: u64, who: &str, id: &str, remaining: u64) -> Entry {
    event(
        at,
        who,
        Event::SaleWritten,
        json!({"order_id": id, "remaining": remaining}),
    )
}

fn release(at: u64, who: &str, id: &str, strategy: &str) -> Entry {
    event(
        at,
        who,
        Event::LockReleased,
        json!({"owner": format!("{who}:{id}"), "strategy": strategy, "released": "Freed"}),
    )
}

fn refuse(at: u64, who: &str, id: &str, reason: &str) -> Entry {
    event(
        at,
        who,
        Event::SaleRefused,
        json!({"order_id": id, "reason": reason}),
    )
}

/// A lock handed on within one millisecond: each release is heard strictly before the next
/// acquire. Rounded to whole milliseconds the holds touched, and the picture said "both
/// believed they held the lock" for every hand-over.
#[test]
fn a_release_heard_before_the_next_acquire_is_never_two_holders_in_one_millisecond() {
    let mut entries = vec![note(0, "runner", "stock reset to 9")];
    let mut stock = 9;
    for (i, who) in ["app1", "app2", "app1", "app2"].into_iter().enumerate() {
        let id = format!("{i}aaaaaaa-{i}");
        entries.push(acquire(315, who, &id, "setnx"));
        entries.push(read(315, who, &id, stock));
        entries.push(write(315, who, &id, stock - 1));
        entries.push(release(315, who, &id, "setnx"));
        stock -= 1;
    }
    let m = Model::from_entries(&entries);
    assert!(m.overlaps.is_empty(), "{:?}", m.findings());
    assert!(m.findings().is_empty(), "{:?}", m.findings());
    assert!(!draw(&entries, "t").svg.contains("band overlap"));
}

/// A sale that found the stock sold out wrote nothing: no fence kept a write of its out.
#[test]
fn a_sold_out_answer_is_not_a_write_kept_out() {
    let entries = vec![
        acquire(100, "app1", "aaaaaaaa-1", "fenced"),
        read(101, "app1", "aaaaaaaa-1", 1),
        note(199, "redis", "the lock key EXPIRED"),
        acquire(200, "app2", "bbbbbbbb-2", "fenced"),
        read(201, "app2", "bbbbbbbb-2", 0),
        refuse(202, "app2", "bbbbbbbb-2", "sold_out"),
        release(203, "app2", "bbbbbbbb-2", "fenced"),
        event(
            300,
            "app1",
            Event::LockLost,
            json!({"owner": "app1:aaaaaaaa-1", "reason": "expired"}),
        ),
    ];
    let findings = Model::from_entries(&entries).findings();
    assert_eq!(findings.len(), 1, "{findings:?}");
    assert!(!findings[0].2.contains("sold_out"), "{findings:?}");
    assert!(findings[0].2.contains("sale A noticed"), "{findings:?}");
}

/// node-loss / fenced: the stock's Redis killed after A wrote and before its release, which
/// then logs nothing. A was drawn holding to the end of the run (its lease through Redis's
/// death), "both holding" with every later sale.
#[test]
fn a_holder_whose_release_died_with_redis_believes_to_its_answer_and_the_kill_is_drawn() {
    let mut entries = vec![
        note(0, "runner", "stock reset to 50"),
        acquire(50, "app1", "aaaaaaaa-1", "fenced"),
        read(51, "app1", "aaaaaaaa-1", 50),
        write(53, "app1", "aaaaaaaa-1", 49),
        note(
            60,
            "runner",
            "kill -9 the stock's Redis (fenced's only node)",
        ),
        refuse(100, "app2", "bbbbbbbb-2", "redis_unavailable"),
        note(
            400,
            "runner",
            "the stock's Redis (fenced's only node) is back",
        ),
    ];
    let mut stock = 49;
    for i in 0..6 {
        let id = format!("c{i}cccccc-{i}");
        let who = if i % 2 == 0 { "app1" } else { "app2" };
        let at = 500 + 300 * i;
        entries.push(acquire(at, who, &id, "fenced"));
        entries.push(read(at + 1, who, &id, stock));
        entries.push(write(at + 2, who, &id, stock - 1));
        entries.push(release(at + 3, who, &id, "fenced"));
        stock -= 1;
    }
    let m = Model::from_entries(&entries);
    let a = &m.sales[0];
    assert_eq!(
        a.hold(m.t1).map(|h| (h.from, h.to, h.open)),
        Some((50, 53, false))
    );
    assert!(m.overlaps.is_empty(), "{:?}", m.findings());
    let redis = m.lane("redis").unwrap();
    let lease = m.leases.iter().find(|l| l.sale == 0).unwrap();
    assert_eq!(
        (lease.lane, lease.to, lease.end),
        (redis, 60, LeaseEnd::NodeGone)
    );
    assert_eq!(m.states.len(), 1, "{:?}", m.states);
    assert_eq!((m.states[0].1.from, m.states[0].1.to), (60, 400));
    let svg = draw(&entries, "t").svg;
    assert!(svg.contains(r#"class="dead" data-lane="redis""#), "{svg}");
    assert!(
        svg.contains("B&#39;s lock refused: redis_unavailable")
            || svg.contains("B's lock refused: redis_unavailable"),
        "{svg}"
    );
}

/// failover: A's sale landed on the master and was answered; the master died, and the
/// promoted replica never had it; B read there two seconds later and sold the same item.
/// Nothing raced: the picture drew "B works on a stale read" from A's write, and said B's
/// write "overwrote" A's sale.
#[test]
fn a_sale_lost_with_the_master_is_drawn_lost_not_overwritten_and_the_failover_is_drawn() {
    let entries = vec![
        note(0, "runner", "stock reset to 5"),
        note(
            10,
            "runner",
            "replica 1 frozen (SIGSTOP) and its link dropped: from now on it gets nothing",
        ),
        acquire(50, "app1", "aaaaaaaa-1", "fenced"),
        read(51, "app1", "aaaaaaaa-1", 5),
        write(53, "app1", "aaaaaaaa-1", 4),
        release(54, "app1", "aaaaaaaa-1", "fenced"),
        note(60, "runner", "app1's sale answered 200 (ok)"),
        note(70, "runner", "master KILLED (SIGKILL)"),
        note(75, "runner", "replica 1 resumed, without what it missed"),
        note(
            1500,
            "runner",
            "Sentinel promoted replica 1 (port 7001): the master now",
        ),
        note(
            1600,
            "runner",
            "old master restarted as a replica of the new one",
        ),
        acquire(2349, "app2", "bbbbbbbb-2", "fenced"),
        read(2350, "app2", "bbbbbbbb-2", 5),
        write(2351, "app2", "bbbbbbbb-2", 4),
        release(2352, "app2", "bbbbbbbb-2", "fenced"),
    ];
    let m = Model::from_entries(&entries);
    assert_eq!(m.conflicts.len(), 1);
    let findings = m.findings();
    assert!(
        findings[0].2.contains("lost, not overwritten"),
        "{findings:?}"
    );
    assert!(!findings[0].2.contains("is stale"), "{findings:?}");
    let svg = draw(&entries, "t").svg;
    assert!(!svg.contains("stale-read"), "{svg}");
    assert!(svg.contains("lost-write"), "{svg}");
    assert!(
        svg.contains(r#"class="dead" data-lane="redis""#),
        "the kill: {svg}"
    );
    assert!(
        svg.contains(r#"class="paused" data-lane="replica1""#),
        "the freeze: {svg}"
    );
    assert!(
        svg.contains("redis restarted"),
        "the old master's return: {svg}"
    );
    let on: Vec<&str> = m
        .leases
        .iter()
        .map(|l| m.lanes[l.lane].name.as_str())
        .collect();
    assert_eq!(
        on,
        ["redis", "replica1"],
        "B's lease is on the promoted replica"
    );
}

/// A stale write that overwrote two sales sold two items twice (the audit's lost_updates 2),
/// not "one item".
#[test]
fn a_stale_write_over_two_sales_counts_two_items_sold_twice() {
    let entries = vec![
        note(0, "runner", "stock reset to 5"),
        acquire(10, "app1", "aaaaaaaa-1", "setnx-ttl"),
        read(11, "app1", "aaaaaaaa-1", 5),
        note(510, "redis", "the lock key EXPIRED"),
        acquire(511, "app2", "bbbbbbbb-2", "setnx-ttl"),
        read(512, "app2", "bbbbbbbb-2", 5),
        write(513, "app2", "bbbbbbbb-2", 4),
        release(514, "app2", "bbbbbbbb-2", "setnx-ttl"),
        acquire(520, "app2", "cccccccc-3", "setnx-ttl"),
        read(521, "app2", "cccccccc-3", 4),
        write(522, "app2", "cccccccc-3", 3),
        release(523, "app2", "cccccccc-3", "setnx-ttl"),
        write(700, "app1", "aaaaaaaa-1", 4),
    ];
    let m = Model::from_entries(&entries);
    assert_eq!(m.conflicts.len(), 1);
    let findings = m.findings();
    let text = &findings.iter().find(|f| f.0).unwrap().2;
    assert!(text.contains("2 items sold twice"), "{text}");
    assert!(text.contains("sale B's sale and sale C's sale"), "{text}");
}

/// The redlock rows' nodes each get a lane, from the quorum's votes, and the node faults the
/// runner notes ("kill -9 lock node 2 of 3", "lock node 1 restarted EMPTY") are drawn there;
/// contention's refused EXECs are drawn and counted.
#[test]
fn lock_nodes_get_lanes_and_their_faults_and_refused_execs_are_drawn() {
    let entries = vec![
        event(
            10,
            "app1",
            Event::LockQuorum,
            json!({"owner": "app1:aaaaaaaa-1", "votes": "granted failed granted", "granted": 2, "nodes": 3, "held": true}),
        ),
        acquire(11, "app1", "aaaaaaaa-1", "redlock"),
        note(20, "runner", "kill -9 lock node 2 of 3"),
        note(
            30,
            "runner",
            "lock node 1 restarted EMPTY (it had granted app1's lock)",
        ),
        release(40, "app1", "aaaaaaaa-1", "redlock"),
        event(
            50,
            "app2",
            Event::TransactionConflict,
            json!({"order_id": "bbbbbbbb-2", "attempt": 1}),
        ),
        event(
            55,
            "app2",
            Event::TransactionConflict,
            json!({"order_id": "bbbbbbbb-2", "attempt": 2}),
        ),
    ];
    let m = Model::from_entries(&entries);
    let names: Vec<&str> = m.lanes.iter().map(|l| l.name.as_str()).collect();
    assert_eq!(names, ["app1", "app2", "node1", "node2", "node3"]);
    let on: Vec<&str> = m
        .leases
        .iter()
        .map(|l| m.lanes[l.lane].name.as_str())
        .collect();
    assert_eq!(on, ["node1", "node3"], "where the votes granted it");
    assert_eq!(m.leases[0].end, LeaseEnd::NodeGone, "node1 restarted empty");
    let svg = draw(&entries, "t").svg;
    assert!(svg.contains(r#"class="dead" data-lane="node2""#), "{svg}");
    assert!(svg.contains("node1 restarted EMPTY"), "{svg}");
    assert_eq!(svg.matches("mark thrown-away").count(), 2, "{svg}");
    assert!(svg.contains("2 EXECs refused"), "{svg}");
}

/// Six refusals at once on one lane: three labels found room, the rest were lost. Each is
/// said for what was refused (an acquire, not a write), and all are counted.
#[test]
fn every_refusal_is_counted_and_said_for_what_was_refused() {
    let mut entries = vec![acquire(0, "app1", "aaaaaaaa-0", "fenced")];
    for i in 1..=6 {
        entries.push(refuse(
            100,
            "app2",
            &format!("b{i}bbbbbb-{i}"),
            "not_replicated",
        ));
    }
    entries.push(release(200, "app1", "aaaaaaaa-0", "fenced"));
    let svg = draw(&entries, "t").svg;
    assert!(svg.contains("6 refused"), "{svg}");
    assert!(
        !svg.contains("write refused"),
        "no write was refused: {svg}"
    );
    assert!(svg.contains("lock refused: not_replicated"), "{svg}");
    assert_eq!(svg.matches(r#"class="refusal""#).count(), 6, "{svg}");
}

/// Runner notes a moment apart were drawn on top of each other (x=121.0 and 122.8).
#[test]
fn runner_note_circles_never_overlap() {
    let entries = vec![
        note(0, "runner", "first thing"),
        note(1, "runner", "second thing"),
        note(2, "runner", "third thing"),
        note(5000, "runner", "later thing"),
    ];
    let svg = draw(&entries, "t").svg;
    let xs: Vec<f64> = svg
        .split(r#"<g class="note"><circle cx=""#)
        .skip(1)
        .map(|s| s[..s.find('"').unwrap()].parse().unwrap())
        .collect();
    assert_eq!(xs.len(), 4);
    for pair in xs.windows(2) {
        assert!(pair[1] - pair[0] >= 16.0, "{xs:?}");
    }
}

/// contention / fenced: app1's acquire heard a millisecond before app2's release, both in
/// the same millisecond as their ends: the order two processes' logs arrive in, not two
/// holders (both sales found the stock sold out, nothing was kept out).
#[test]
fn a_hand_over_heard_out_of_order_within_a_millisecond_is_not_two_holders() {
    let entries = vec![
        acquire(610, "app2", "rrrrrrrr-1", "fenced"),
        read(611, "app2", "rrrrrrrr-1", 0),
        acquire(612, "app1", "ssssssss-2", "fenced"),
        release(613, "app2", "rrrrrrrr-1", "fenced"),
        refuse(613, "app2", "rrrrrrrr-1", "sold_out"),
        read(613, "app1", "ssssssss-2", 0),
        release(613, "app1", "ssssssss-2", "fenced"),
        refuse(613, "app1", "ssssssss-2", "sold_out"),
    ];
    let m = Model::from_entries(&entries);
    assert!(m.overlaps.is_empty(), "{:?}", m.findings());
}

/// node-loss / fenced: the holder's release and the next acquire, both before the kill,
/// heard after it. The release freed its own lock, not the next holder's.
#[test]
fn a_release_heard_after_its_node_died_deletes_no_other_sales_lock() {
    let entries = vec![
        acquire(68, "app1", "aaaaaaaa-1", "fenced"),
        read(81, "app1", "aaaaaaaa-1", 30),
        write(104, "app1", "aaaaaaaa-1", 29),
        note(
            108,
            "runner",
            "kill -9 the stock's Redis (fenced's only node)",
        ),
        acquire(111, "app1", "bbbbbbbb-2", "fenced"),
        release(111, "app1", "aaaaaaaa-1", "fenced"),
        refuse(111, "app1", "bbbbbbbb-2", "redis_unavailable"),
    ];
    let m = Model::from_entries(&entries);
    assert!(m.foreign_deletes.is_empty(), "{:?}", m.findings());
    assert!(!m.has_harm(), "{:?}", m.findings());
}

/// two-instances / setnx: app2's acquire heard before app1's whole hold of the next
/// millisecond. Nothing ended app2's lease before app1 took the key, so app2 had released
/// it first: one key has one owner.
#[test]
fn a_hold_heard_inside_another_whose_lease_nothing_ended_is_not_two_holders() {
    let entries = vec![
        acquire(357, "app2", "pppppppp-1", "setnx"),
        acquire(357, "app1", "qqqqqqqq-2", "setnx"),
        read(357, "app1", "qqqqqqqq-2", 0),
        release(357, "app1", "qqqqqqqq-2", "setnx"),
        refuse(357, "app1", "qqqqqqqq-2", "sold_out"),
        read(358, "app2", "pppppppp-1", 0),
        release(359, "app2", "pppppppp-1", "setnx"),
        refuse(359, "app2", "pppppppp-1", "sold_out"),
    ];
    let m = Model::from_entries(&entries);
    assert!(m.overlaps.is_empty(), "{:?}", m.findings());
}

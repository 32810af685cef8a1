//! What a scenario's timeline says happened, as intervals and instants on lanes: who believed
//! it held the lock, whose lease Redis had, and where the two disagreed harmfully.
//!
//! Everything here is read from the entries the text timeline prints, never from the
//! scenario or the strategy's name: a new scenario row gets its picture from its events.
//! Lanes are whatever the entries name (an instance logging events, a Redis node noting an
//! expiry, a lane a runner note names by itself, such as `app1` or `redis2`).

use std::collections::BTreeMap;

use inventory::events::Event;
use inventory::lock::Strategy;
use serde_json::Value;

use crate::timeline::{Entry, What};

/// How far apart the runner may hear two things that happened in one order in Redis: log
/// lines of two processes, and Redis's expiry notification, travel separately.
const HEARD_APART_MS: u64 = 50;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LaneKind {
    Instance,
    Redis,
}

#[derive(Debug, Clone)]
pub struct Lane {
    pub name: String,
    pub kind: LaneKind,
}

/// What a runner's (or Redis's) note does to the lanes it names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Pause,
    Resume,
    Kill,
    Restart,
    Expire,
    /// A replica made the master: the stock's node from then on.
    Promote,
    /// Any other note: a numbered mark on the runner's strip (and on the lanes it names).
    Other,
}

impl Action {
    /// Read from the note's own words; unknown words are `Other`, never an error.
    fn of(text: &str) -> Self {
        let t = text.to_lowercase();
        let said = |w: &str| {
            t.split(|c: char| !c.is_ascii_alphanumeric())
                .any(|x| x == w)
        };
        if said("promoted") && !said("never") && !said("not") {
            Action::Promote
        } else if t.contains("sigstop")
            || t.starts_with("pause")
            || said("freeze")
            || said("frozen")
        {
            Action::Pause
        } else if t.contains("sigcont") || said("resume") || said("resumed") || said("unfreeze") {
            Action::Resume
        } else if t.contains("kill") {
            Action::Kill
        } else if t.contains("restart") || t.ends_with(" is back") {
            Action::Restart
        } else if t.contains("expired") {
            Action::Expire
        } else {
            Action::Other
        }
    }
}

#[derive(Debug, Clone)]
pub struct Note {
    pub at: u64,
    pub who: String,
    pub text: String,
    pub action: Action,
    /// The lanes it acts on.
    pub lanes: Vec<usize>,
    /// Its number on the runner's strip, for `Other` notes.
    pub number: Option<usize>,
}

/// One sale, known by its id, with what its instance logged about it.
#[derive(Debug, Clone, Default)]
pub struct Sale {
    pub id: String,
    /// `A`, `B`, ... in the order the sales first appear: the README's "sale A".
    pub letter: String,
    pub lane: usize,
    pub strategy: Option<Strategy>,
    pub fence: Option<String>,
    pub acquired: Option<u64>,
    /// How long it waited for the lock before `acquired` (its own word, `waited_ms`).
    pub waited: u64,
    /// The outer release: when, and what it found (`Freed`, `NotHeld`).
    pub released: Option<(u64, String)>,
    pub lost: Option<(u64, String)>,
    /// When its instance was killed while the sale was under way.
    pub killed: Option<u64>,
    pub read: Option<(u64, String)>,
    pub written: Option<(u64, String)>,
    pub refused: Option<(u64, String)>,
    pub renewals: Vec<u64>,
    /// Nested acquires (`true`) and releases of one level (`false`).
    pub nested: Vec<(u64, bool)>,
    /// Refused `EXEC`s: work done and thrown away.
    pub thrown_away: Vec<u64>,
    /// The nodes its last quorum granted the lock on (by node, `true` = granted).
    pub granted: Vec<bool>,
    pub order: Order,
}

/// Where a sale's events stand in the timeline's order. The timeline counts whole
/// milliseconds, and a lock is often handed on within one: a release heard before the next
/// acquire came first, whatever their milliseconds say.
#[derive(Debug, Clone, Copy, Default)]
pub struct Order {
    pub acquired: Option<usize>,
    pub released: Option<usize>,
    pub lost: Option<usize>,
    pub killed: Option<usize>,
    pub read: Option<usize>,
    pub written: Option<usize>,
    pub refused: Option<usize>,
}

impl Sale {
    /// Whether its strategy holds something while the sale works (`none` and `atomic` hold
    /// nothing).
    pub fn locks(&self) -> bool {
        !matches!(
            self.strategy,
            None | Some(Strategy::None | Strategy::Atomic)
        )
    }

    /// When the sale believed it held the lock: from its acquire to its release, to the
    /// moment it learnt it was lost, or to its death; `open` when none of these came.
    pub fn hold(&self, end: u64) -> Option<Span> {
        let from = self.acquired.filter(|_| self.locks())?;
        let to = self.hold_end().map(|(at, _)| at);
        // At least a millisecond: a hold acquired and released within one is still a hold.
        Some(Span {
            from,
            to: to.unwrap_or(end).max(from + 1),
            open: to.is_none(),
        })
    }

    /// What ended its belief, with its place in the timeline: the first of its release, its
    /// learning the lock lost and its death; when none came, its answer (its write or its
    /// refusal). A sale that answered its buyer works under the lock no more: a release that
    /// failed (its Redis dead) logs nothing, and must not stretch the hold to the end.
    pub fn hold_end(&self) -> Option<(u64, usize)> {
        let o = &self.order;
        let ends = [
            self.released.as_ref().map(|r| r.0).zip(o.released),
            self.lost.as_ref().map(|l| l.0).zip(o.lost),
            self.killed.zip(o.killed),
        ];
        ends.into_iter().flatten().min().or_else(|| self.answer())
    }

    /// Its write or its refusal, with its place in the timeline.
    fn answer(&self) -> Option<(u64, usize)> {
        let o = &self.order;
        [
            self.written.as_ref().map(|w| w.0).zip(o.written),
            self.refused.as_ref().map(|r| r.0).zip(o.refused),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Where the stretch its write depends on ([`span`](Self::span)) begins and ends in the
    /// timeline's order.
    fn span_order(&self) -> Option<(usize, Option<usize>)> {
        if self.acquired.is_some() && self.locks() {
            return Some((self.order.acquired?, self.hold_end().map(|e| e.1)));
        }
        Some((self.order.read?, self.answer().map(|a| a.1)))
    }

    /// The stretch the sale's write depends on: its hold, or for a sale without a lock,
    /// from its read to its write.
    pub fn span(&self, end: u64) -> Option<Span> {
        self.hold(end).or_else(|| {
            let (read, _) = self.read.as_ref()?;
            let to = self
                .written
                .as_ref()
                .or(self.refused.as_ref())
                .map(|w| w.0)?;
            Some(Span {
                from: *read,
                to: to.max(*read + 1),
                open: false,
            })
        })
    }

    /// `A` in the text of a finding.
    pub fn name(&self) -> String {
        format!("sale {}", self.letter)
    }
}

/// Whether one of the two stretches ended, in the timeline's order, before the other began:
/// then they never overlapped, even where rounding to milliseconds makes them touch.
fn apart(a: &Sale, b: &Sale) -> bool {
    let (Some((a_from, a_to)), Some((b_from, b_to))) = (a.span_order(), b.span_order()) else {
        return false;
    };
    a_to.is_some_and(|t| t < b_from) || b_to.is_some_and(|t| t < a_from)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    pub from: u64,
    pub to: u64,
    /// Still going when the timeline ended.
    pub open: bool,
}

impl Span {
    pub fn overlap(self, other: Span) -> Option<Span> {
        let from = self.from.max(other.from);
        let to = self.to.min(other.to);
        (to > from).then_some(Span {
            from,
            to,
            open: false,
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseEnd {
    Expired,
    /// Deleted by a release; by its own holder or, the flaw, by another sale.
    Deleted {
        by: usize,
    },
    /// Its node was killed or restarted.
    NodeGone,
    /// Another acquire took the key (it was gone without the timeline saying so).
    Replaced,
    /// Still there when the timeline ended.
    Open,
}

/// A lease as Redis had it: the lock key, owned by one sale, on one Redis lane.
#[derive(Debug, Clone)]
pub struct Lease {
    pub lane: usize,
    pub sale: usize,
    pub from: u64,
    pub to: u64,
    pub end: LeaseEnd,
}

/// Two sales that both wrote over the same stock: the later write is stale.
#[derive(Debug, Clone)]
pub struct Conflict {
    /// The sale whose write was overwritten (it wrote first).
    pub first: usize,
    /// The stale write's sale.
    pub stale: usize,
    /// The stock value both wrote.
    pub remaining: String,
    /// When both held (or were between read and write) at once, if they did.
    pub both: Option<Span>,
    /// The first write landed before the stale sale even read: the Redis it read from had
    /// lost that write (a failover to a replica without it), nothing raced.
    pub lost: bool,
    /// The sales whose writes landed between the stale sale's read and its write.
    pub overwritten: Vec<usize>,
    /// The sales the stale write undid: the stock it read less the stock it overwrote,
    /// the audit's lost updates for this write.
    pub items: i64,
}

/// A sale that gave up waiting for a lock nobody would release.
#[derive(Debug, Clone)]
pub struct Blocked {
    pub sale: usize,
    pub at: u64,
    /// The sale whose lock it waited on: itself, or one whose instance was killed.
    pub behind: usize,
    /// The stretch drawn red: from the moment nobody could release it to the refusal.
    pub span: Span,
}

#[derive(Debug, Clone, Default)]
pub struct Model {
    pub t0: u64,
    pub t1: u64,
    pub lanes: Vec<Lane>,
    pub sales: Vec<Sale>,
    pub leases: Vec<Lease>,
    pub notes: Vec<Note>,
    /// Lane states from the notes: (lane, span, paused = true / dead = false).
    pub states: Vec<(usize, Span, bool)>,
    pub conflicts: Vec<Conflict>,
    /// Two sales believing they held the lock at once without both writes landing.
    pub overlaps: Vec<(usize, usize, Span)>,
    /// A release that deleted another sale's lease: (lease, deleting sale).
    pub foreign_deletes: Vec<usize>,
    pub blocked: Vec<Blocked>,
    /// The lane promoted to master, once one is: single-node locks live there from then on.
    pub master: Option<usize>,
    /// Every landed write: (place in the timeline, sale, stock resets before it).
    pub writes: Vec<(usize, usize, usize)>,
}

fn text(e: &Entry, name: &str) -> Option<String> {
    match e.fields.get(name) {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(v) => Some(v.to_string()),
    }
}

/// A sale's id: the order id, alone or after the instance in an owner.
fn sale_id(e: &Entry) -> Option<String> {
    let id = text(e, "owner").or_else(|| text(e, "order_id"))?;
    Some(id.rsplit(':').next().unwrap_or_default().to_owned())
}

fn letter(n: usize) -> String {
    let mut n = n;
    let mut s = String::new();
    loop {
        s.insert(0, (b'A' + (n % 26) as u8) as char);
        if n < 26 {
            return s;
        }
        n = n / 26 - 1;
    }
}

/// The words of a note that may name lanes, as lane names: `node 2` and `replica 1` are
/// `node2` and `replica1`, and the stock's Redis (`Redis`, `the master`) is `redis`.
fn lane_words(text: &str) -> Vec<String> {
    let words: Vec<String> = text
        .split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(str::to_owned)
        .collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < words.len() {
        let word = words[i].to_lowercase();
        let numbered = words
            .get(i + 1)
            .filter(|n| n.bytes().all(|b| b.is_ascii_digit()));
        match (word.as_str(), numbered) {
            ("node" | "replica", Some(n)) => {
                out.push(format!("{word}{n}"));
                i += 1;
            }
            ("redis" | "master", _) => out.push("redis".to_owned()),
            _ => out.push(words[i].clone()),
        }
        i += 1;
    }
    out
}

/// `app1`, `redis`, `redis2`, `node3`: a word that names a lane (a number, or `redis` alone,
/// so that "the node" or "an instance" in a note's prose names none).
fn lane_kind(word: &str) -> Option<LaneKind> {
    let stem = word.trim_end_matches(|c: char| c.is_ascii_digit());
    if stem.len() == word.len() && word != "redis" {
        return None;
    }
    match stem {
        "redis" | "node" | "replica" => Some(LaneKind::Redis),
        "app" | "instance" => Some(LaneKind::Instance),
        _ => None,
    }
}

impl Model {
    pub fn from_entries(entries: &[Entry]) -> Self {
        let mut m = Model {
            t0: entries.first().map(|e| e.at_ms).unwrap_or(0),
            t1: entries.last().map(|e| e.at_ms).unwrap_or(0),
            ..Model::default()
        };
        m.find_lanes(entries);
        let mut by_id: BTreeMap<String, usize> = BTreeMap::new();
        // The stock resets seen so far: a value written twice counts only within one.
        let mut epoch = 0;
        let mut writes: BTreeMap<(usize, String), Vec<usize>> = BTreeMap::new();
        for (seq, e) in entries.iter().enumerate() {
            match &e.what {
                What::Note(text) => {
                    if text.starts_with("stock reset") {
                        epoch += 1;
                    }
                    m.note(e, text, seq);
                }
                What::Event(event) => {
                    let Some(id) = sale_id(e) else { continue };
                    let lane = m.lane(&e.who).unwrap_or(0);
                    let n = *by_id.entry(id.clone()).or_insert_with(|| {
                        m.sales.push(Sale {
                            letter: letter(m.sales.len()),
                            id,
                            lane,
                            ..Sale::default()
                        });
                        m.sales.len() - 1
                    });
                    m.event(n, *event, e, seq);
                    if *event == Event::SaleWritten
                        && let Some((_, remaining)) = &m.sales[n].written
                    {
                        m.writes.push((seq, n, epoch));
                        writes
                            .entry((epoch, remaining.clone()))
                            .or_default()
                            .push(n);
                    }
                }
            }
        }
        m.close_leases();
        m.find_conflicts(writes);
        m.find_overlaps();
        m.find_blocked();
        m
    }

    pub fn lane(&self, name: &str) -> Option<usize> {
        self.lanes.iter().position(|l| l.name == name)
    }

    fn add_lane(&mut self, name: &str, kind: LaneKind) {
        if self.lane(name).is_none() {
            self.lanes.push(Lane {
                name: name.to_owned(),
                kind,
            });
        }
    }

    /// Instances first (in name order), then the Redis nodes.
    fn find_lanes(&mut self, entries: &[Entry]) {
        for e in entries {
            match &e.what {
                What::Event(event) => {
                    self.add_lane(&e.who, LaneKind::Instance);
                    // A quorum lock's votes name its nodes, in order: a lane for each.
                    if *event == Event::LockQuorum
                        && let Some(n) = text(e, "nodes").and_then(|n| n.parse::<usize>().ok())
                    {
                        for node in 1..=n.min(16) {
                            self.add_lane(&format!("node{node}"), LaneKind::Redis);
                        }
                    }
                }
                What::Note(text) => {
                    if e.who != "runner"
                        && let Some(kind) = lane_kind(&e.who)
                    {
                        self.add_lane(&e.who, kind);
                    }
                    for word in lane_words(text) {
                        if let Some(kind) = lane_kind(&word) {
                            self.add_lane(&word, kind);
                        }
                    }
                }
            }
        }
        // A lock in Redis needs a Redis lane even when nothing else named one: a single-node
        // lock lives on the stock's node (`redis`, as the expiry notes call it); a quorum lock
        // on the nodes the notes name, or on that one.
        let locks = entries.iter().filter_map(|e| match e.what {
            What::Event(Event::LockAcquired) => text(e, "strategy")?.parse::<Strategy>().ok(),
            _ => None,
        });
        let (mut single, mut quorum) = (false, false);
        for lock in locks {
            if let Strategy::Redis(lock) = lock {
                if lock.info().quorum {
                    quorum = true;
                } else {
                    single = true;
                }
            }
        }
        if single || (quorum && !self.lanes.iter().any(|l| l.kind == LaneKind::Redis)) {
            self.add_lane("redis", LaneKind::Redis);
        }
        self.lanes.sort_by(|a, b| {
            (a.kind == LaneKind::Redis, &a.name).cmp(&(b.kind == LaneKind::Redis, &b.name))
        });
    }

    /// The Redis lanes a lock of `strategy` lives on: every node for a quorum lock when
    /// there are several, else the stock's node (`redis`, or the only one).
    fn lease_lanes(&self, strategy: Strategy) -> Vec<usize> {
        let redis: Vec<usize> = (0..self.lanes.len())
            .filter(|&i| self.lanes[i].kind == LaneKind::Redis)
            .collect();
        if strategy.info().quorum {
            let nodes: Vec<usize> = redis
                .iter()
                .copied()
                .filter(|&i| self.lanes[i].name != "redis")
                .collect();
            if !nodes.is_empty() {
                return nodes;
            }
        }
        self.master
            .or_else(|| self.lane("redis"))
            .or_else(|| redis.first().copied())
            .into_iter()
            .collect()
    }

    fn open_lease(&mut self, lane: usize) -> Option<&mut Lease> {
        self.leases
            .iter_mut()
            .rev()
            .find(|l| l.lane == lane && l.end == LeaseEnd::Open)
    }

    fn end_lease(&mut self, lane: usize, at: u64, end: LeaseEnd) -> Option<usize> {
        let lease = self.open_lease(lane)?;
        lease.to = at;
        lease.end = end;
        let sale = lease.sale;
        self.leases
            .iter()
            .rposition(|l| l.lane == lane && l.sale == sale)
    }

    /// Redis reports an expiry when it finds the key expired, often on the very `SET NX`
    /// that takes it next, and the runner hears the two in either order: an expiry just
    /// after an acquire that replaced a lease ends the replaced lease, not the new one.
    fn expire(&mut self, lane: usize, at: u64) {
        let open = self
            .leases
            .iter()
            .rposition(|l| l.lane == lane && l.end == LeaseEnd::Open);
        if let Some(open) = open {
            let from = self.leases[open].from;
            let replaced = self.leases[..open]
                .iter()
                .rposition(|l| l.lane == lane && l.end == LeaseEnd::Replaced && l.to == from);
            if let Some(replaced) = replaced.filter(|_| at <= from + HEARD_APART_MS) {
                self.leases[replaced].end = LeaseEnd::Expired;
                return;
            }
        }
        self.end_lease(lane, at, LeaseEnd::Expired);
    }

    fn note(&mut self, e: &Entry, text: &str, seq: usize) {
        let action = Action::of(text);
        let mut lanes: Vec<usize> = Vec::new();
        if let Some(own) = self.lane(&e.who) {
            lanes.push(own);
        }
        for word in lane_words(text) {
            if let Some(i) = self.lane(&word)
                && !lanes.contains(&i)
            {
                lanes.push(i);
            }
        }
        // An expiry the stock's node reports, in words that name no lane.
        if action == Action::Expire && lanes.is_empty() {
            lanes.extend(self.lane("redis"));
        }
        let at = e.at_ms;
        // A fault befalls the note's subject, the first lane it names: "lock node 1
        // restarted EMPTY (it had granted app1's lock)" restarts node1, not app1.
        let subject = if action == Action::Other {
            &[][..]
        } else {
            &lanes[..lanes.len().min(1)]
        };
        for &lane in subject {
            match action {
                Action::Pause => self.states.push((
                    lane,
                    Span {
                        from: at,
                        to: at,
                        open: true,
                    },
                    true,
                )),
                Action::Resume | Action::Restart => {
                    for (l, span, _) in &mut self.states {
                        if *l == lane && span.open {
                            span.to = at;
                            span.open = false;
                        }
                    }
                    if action == Action::Restart && self.lanes[lane].kind == LaneKind::Redis {
                        self.end_lease(lane, at, LeaseEnd::NodeGone);
                    }
                }
                Action::Kill => {
                    self.states.push((
                        lane,
                        Span {
                            from: at,
                            to: at,
                            open: true,
                        },
                        false,
                    ));
                    for sale in &mut self.sales {
                        let done = sale.released.is_some()
                            || sale.written.is_some()
                            || sale.refused.is_some();
                        if sale.lane == lane && !done && sale.killed.is_none() {
                            sale.killed = Some(at);
                            sale.order.killed = Some(seq);
                        }
                    }
                    if self.lanes[lane].kind == LaneKind::Redis {
                        self.end_lease(lane, at, LeaseEnd::NodeGone);
                    }
                }
                Action::Expire => {
                    if self.lanes[lane].kind == LaneKind::Redis {
                        self.expire(lane, at);
                    }
                }
                Action::Promote => {
                    if self.lanes[lane].kind == LaneKind::Redis {
                        self.master = Some(lane);
                    }
                }
                Action::Other => {}
            }
        }
        // A reset is the scenario's set-up, not part of its story.
        let number = (action == Action::Other && !text.starts_with("stock reset"))
            .then(|| self.notes.iter().filter(|n| n.number.is_some()).count() + 1);
        self.notes.push(Note {
            at,
            who: e.who.clone(),
            text: text.to_owned(),
            action,
            lanes,
            number,
        });
    }

    fn event(&mut self, n: usize, event: Event, e: &Entry, seq: usize) {
        let at = e.at_ms;
        let sale = &mut self.sales[n];
        match event {
            Event::LockAcquired if text(e, "nested").as_deref() == Some("true") => {
                sale.nested.push((at, true));
            }
            Event::LockAcquired => {
                let strategy = text(e, "strategy").and_then(|s| s.parse::<Strategy>().ok());
                sale.strategy = strategy;
                sale.acquired = Some(at);
                sale.order.acquired = Some(seq);
                sale.waited = text(e, "waited_ms")
                    .and_then(|w| w.parse().ok())
                    .unwrap_or(0);
                sale.fence = text(e, "fence");
                if let Some(s @ Strategy::Redis(_)) = strategy {
                    let granted = sale.granted.clone();
                    let lanes = self.lease_lanes(s);
                    // Its quorum's votes say which nodes granted it, node by node.
                    let lanes: Vec<usize> = if granted.len() == lanes.len() {
                        lanes
                            .into_iter()
                            .zip(granted)
                            .filter_map(|(lane, yes)| yes.then_some(lane))
                            .collect()
                    } else {
                        lanes
                    };
                    for lane in lanes {
                        self.end_lease(lane, at, LeaseEnd::Replaced);
                        self.leases.push(Lease {
                            lane,
                            sale: n,
                            from: at,
                            to: at,
                            end: LeaseEnd::Open,
                        });
                    }
                }
            }
            Event::LockReleased => {
                let released = text(e, "released").unwrap_or_default();
                if released == "StillHeld" {
                    sale.nested.push((at, false));
                    return;
                }
                sale.released = Some((at, released.clone()));
                sale.order.released = Some(seq);
                if released == "Freed"
                    && let Some(s @ Strategy::Redis(_)) = sale.strategy
                {
                    for lane in self.lease_lanes(s) {
                        // A quorum lock's release asks every node, but deletes only where
                        // its votes had placed it.
                        if s.info().quorum
                            && !self.leases.iter().any(|l| l.lane == lane && l.sale == n)
                        {
                            continue;
                        }
                        // Its lease died with its node, yet Redis freed it: the release came
                        // before the kill and was heard after it, with any acquire since.
                        let own = self
                            .leases
                            .iter()
                            .rposition(|l| l.lane == lane && l.sale == n);
                        if own.is_some_and(|i| self.leases[i].end == LeaseEnd::NodeGone) {
                            continue;
                        }
                        // Its lease was replaced by an acquire heard before this release:
                        // the release came first (every expiry is noted), and freed its own.
                        if let Some(own) =
                            self.leases.iter_mut().rev().find(|l| {
                                l.lane == lane && l.sale == n && l.end == LeaseEnd::Replaced
                            })
                        {
                            own.end = LeaseEnd::Deleted { by: n };
                            continue;
                        }
                        if let Some(lease) = self.end_lease(lane, at, LeaseEnd::Deleted { by: n })
                            && self.leases[lease].sale != n
                        {
                            self.foreign_deletes.push(lease);
                        }
                    }
                }
            }
            Event::LockRenewed => sale.renewals.push(at),
            Event::LockLost => {
                if sale.lost.is_none() {
                    sale.lost = Some((at, text(e, "reason").unwrap_or_default()));
                    sale.order.lost = Some(seq);
                }
            }
            Event::StockRead => {
                sale.read = Some((at, text(e, "stock").unwrap_or_default()));
                sale.order.read = Some(seq);
                if sale.fence.is_none() {
                    sale.fence = text(e, "fence");
                }
            }
            Event::SaleWritten => {
                sale.written = Some((at, text(e, "remaining").unwrap_or_default()));
                sale.order.written = Some(seq);
            }
            // The leases the votes grant are drawn from the acquire that follows.
            Event::LockQuorum => {
                sale.granted = text(e, "votes")
                    .unwrap_or_default()
                    .split_whitespace()
                    .map(|v| v == "granted")
                    .collect();
            }
            Event::TransactionConflict => sale.thrown_away.push(at),
            Event::SaleRefused => {
                sale.refused = Some((at, text(e, "reason").unwrap_or_default()));
                sale.order.refused = Some(seq);
            }
        }
        self.t1 = self.t1.max(at);
    }

    fn close_leases(&mut self) {
        let end = self.t1;
        for lease in &mut self.leases {
            if lease.end == LeaseEnd::Open {
                lease.to = end;
            }
        }
        for (_, span, _) in &mut self.states {
            if span.open {
                span.to = end;
            }
        }
    }

    /// Two landed writes of the same remaining stock (within one reset): both sales sold
    /// the same item, and the later write overwrote the earlier one's sale.
    fn find_conflicts(&mut self, writes: BTreeMap<(usize, String), Vec<usize>>) {
        for ((epoch, remaining), sales) in writes {
            for pair in sales.windows(2) {
                let (first, stale) = (pair[0], pair[1]);
                let (f, s) = (&self.sales[first], &self.sales[stale]);
                let both = match (f.span(self.t1), s.span(self.t1)) {
                    (Some(a), Some(b)) if !apart(f, s) => a.overlap(b),
                    _ => None,
                };
                let first_written = f.order.written;
                let (read, written) = (s.order.read, s.order.written);
                let lost = matches!((first_written, read), (Some(w), Some(r)) if w < r);
                // The writes that landed while the stale sale worked on what it had read.
                let overwritten: Vec<usize> = match (read, written) {
                    (Some(r), Some(w)) if !lost => self
                        .writes
                        .iter()
                        .filter(|&&(at, n, e)| e == epoch && n != stale && r < at && at < w)
                        .map(|&(_, n, _)| n)
                        .collect(),
                    _ => vec![first],
                };
                // Several writes may have left the same value (two sales that read alike):
                // what was undone is what the stock fell by since the stale sale read it.
                let number = |v: Option<&String>| v.and_then(|v| v.parse::<i64>().ok());
                let read_stock = number(s.read.as_ref().map(|r| &r.1));
                let overwrote = written.and_then(|w| {
                    let &(_, n, _) = self
                        .writes
                        .iter()
                        .rfind(|&&(at, _, e)| e == epoch && at < w)?;
                    number(self.sales[n].written.as_ref().map(|w| &w.1))
                });
                let items = match (lost, read_stock, overwrote) {
                    (false, Some(read), Some(was)) if read > was => read - was,
                    _ => 1,
                };
                self.conflicts.push(Conflict {
                    first,
                    stale,
                    remaining: remaining.clone(),
                    both,
                    lost,
                    overwritten,
                    items,
                });
            }
        }
    }

    /// Holds of two sales at once that no conflict explains: both believed they held the
    /// lock, and something (a fence, a lost-lock check) kept the second write out.
    fn find_overlaps(&mut self) {
        let holds: Vec<(usize, Span)> = (0..self.sales.len())
            .filter_map(|i| Some((i, self.sales[i].hold(self.t1)?)))
            .collect();
        for (i, &(a, ha)) in holds.iter().enumerate() {
            for &(b, hb) in &holds[i + 1..] {
                let conflicted = self
                    .conflicts
                    .iter()
                    .any(|c| (c.first, c.stale) == (a, b) || (c.first, c.stale) == (b, a));
                // A release heard before the next acquire came first, even in one millisecond.
                if conflicted || apart(&self.sales[a], &self.sales[b]) {
                    continue;
                }
                // One ending as the next begins, by a few ms, is the order the runner heard
                // two processes' logs in (a release is logged after the key is gone).
                let (first, second) = if ha.from <= hb.from {
                    (ha, hb)
                } else {
                    (hb, ha)
                };
                // Ends in one millisecond are still a hand-over heard out of order.
                let handover =
                    |both: Span| both.to - both.from < HEARD_APART_MS && first.to <= second.to;
                // One Redis key has one owner: a lease that nothing ended (no expiry, no
                // delete, no node lost) until the other's acquire took it was released before
                // that acquire, whatever order two processes' log lines arrived in.
                let taken_over = |both: Span| {
                    both.to - both.from < HEARD_APART_MS
                        && (self.took_over(a, b) || self.took_over(b, a))
                };
                if let Some(both) = ha.overlap(hb)
                    && !handover(both)
                    && !taken_over(both)
                {
                    self.overlaps.push((a, b, both));
                }
            }
        }
    }

    /// Whether `to`'s acquire took a single-node lock whose lease `from` still had as far as
    /// the timeline says (nothing but that acquire, or its own late-heard release, ended it).
    fn took_over(&self, from: usize, to: usize) -> bool {
        let single = |n: usize| matches!(self.sales[n].strategy, Some(s @ Strategy::Redis(_)) if !s.info().quorum);
        single(from)
            && single(to)
            && self.leases.iter().any(|l| {
                // `Deleted` by itself: its release, heard after the acquire, freed it.
                l.sale == from
                    && (l.end == LeaseEnd::Replaced || l.end == LeaseEnd::Deleted { by: from })
                    && self
                        .leases
                        .iter()
                        .any(|m| m.sale == to && m.lane == l.lane && m.from == l.to)
            })
    }

    /// A sale that gave up waiting (`lock_timeout`) on a lease nobody could release: its
    /// own (a nested acquire waiting on itself), or one whose instance was killed.
    fn find_blocked(&mut self) {
        for (n, sale) in self.sales.iter().enumerate() {
            let Some((at, reason)) = &sale.refused else {
                continue;
            };
            if reason != "lock_timeout" {
                continue;
            }
            if let Some(hold) = sale.hold(self.t1)
                && sale.nested.is_empty()
            {
                // It held the lock and timed out: the only acquire it can have waited on
                // inside its own hold is a nested one, on itself.
                self.blocked.push(Blocked {
                    sale: n,
                    at: *at,
                    behind: n,
                    span: hold,
                });
                continue;
            }
            let behind = self.leases.iter().find(|l| {
                l.from <= *at
                    && l.to >= *at
                    && l.sale != n
                    && self.sales[l.sale].killed.is_some_and(|k| k <= *at)
            });
            if let Some(lease) = behind {
                let from = self.sales[lease.sale].killed.unwrap_or(lease.from);
                self.blocked.push(Blocked {
                    sale: n,
                    at: *at,
                    behind: lease.sale,
                    span: Span {
                        from,
                        to: *at,
                        open: false,
                    },
                });
            }
        }
    }

    /// The part of a sale's hold after Redis stopped having its lease (it expired, or another
    /// sale deleted it): the sale believes it holds a lock that is gone.
    pub fn believed_without_lease(&self, n: usize) -> Option<Span> {
        let hold = self.sales[n].hold(self.t1)?;
        let leases: Vec<&Lease> = self.leases.iter().filter(|l| l.sale == n).collect();
        if leases
            .iter()
            .any(|l| matches!(l.end, LeaseEnd::Open) || l.end == LeaseEnd::Deleted { by: n })
        {
            return None;
        }
        let gone = leases.iter().map(|l| l.to).max()?;
        (hold.to > gone + HEARD_APART_MS / 10).then_some(Span {
            from: gone.max(hold.from),
            to: hold.to,
            open: hold.open,
        })
    }

    /// Whether anything in the picture is drawn red.
    pub fn has_harm(&self) -> bool {
        !self.conflicts.is_empty() || !self.foreign_deletes.is_empty() || !self.blocked.is_empty()
    }

    /// The red findings and the amber ones, in words, in time order.
    pub fn findings(&self) -> Vec<(bool, u64, String)> {
        let s = |n: usize| &self.sales[n];
        let lane = |n: usize| &self.lanes[self.sales[n].lane].name;
        let mut out = Vec::new();
        for c in &self.conflicts {
            let (first, stale) = (s(c.first), s(c.stale));
            let at = stale.written.as_ref().map(|w| w.0).unwrap_or(0);
            let both = c
                .both
                .map(|b| {
                    format!(
                        " Both held it (or worked without a lock) at once from {} to {}.",
                        secs(b.from),
                        secs(b.to)
                    )
                })
                .unwrap_or_default();
            let text = if c.lost {
                let read = stale.read.as_ref().map(|r| r.0).unwrap_or(at);
                let written = first.written.as_ref().map(|w| w.0).unwrap_or(0);
                format!(
                    "{} ({}) and {} ({}) both wrote stock {}: {}'s write at {} had landed, yet \
                     {} read at {} from a Redis that no longer had it: {}'s sale was lost, not \
                     overwritten, and its item was sold again (one item sold twice).",
                    first.name(),
                    lane(c.first),
                    stale.name(),
                    lane(c.stale),
                    c.remaining,
                    first.name(),
                    secs(written),
                    stale.name(),
                    secs(read),
                    first.name(),
                )
            } else {
                // Named when each overwritten write was one undone sale; else counted.
                let names: Vec<String> = if c.overwritten.len() as i64 == c.items {
                    c.overwritten.iter().map(|&n| s(n).name()).collect()
                } else {
                    Vec::new()
                };
                let items = match c.items {
                    1 => "one item sold twice".to_owned(),
                    n => format!("{n} items sold twice"),
                };
                let undone = match (names.is_empty(), c.items) {
                    (false, _) => and_list(&names),
                    (true, 1) => "an earlier sale".to_owned(),
                    (true, n) => format!("{n} earlier sales"),
                };
                format!(
                    "{} ({}) and {} ({}) both wrote stock {}: {}'s write at {} is stale and \
                     overwrote {undone} ({items}).{both}",
                    first.name(),
                    lane(c.first),
                    stale.name(),
                    lane(c.stale),
                    c.remaining,
                    stale.name(),
                    secs(at),
                )
            };
            out.push((true, at, text));
        }
        for &l in &self.foreign_deletes {
            let lease = &self.leases[l];
            if let LeaseEnd::Deleted { by } = lease.end {
                out.push((
                    true,
                    lease.to,
                    format!(
                        "{}'s release at {} deleted {}'s lock on {}.",
                        s(by).name(),
                        secs(lease.to),
                        s(lease.sale).name(),
                        self.lanes[lease.lane].name
                    ),
                ));
            }
        }
        for b in &self.blocked {
            let text = if b.behind == b.sale {
                format!(
                    "{} waited on its own lock and gave up at {} (lock_timeout).",
                    s(b.sale).name(),
                    secs(b.at)
                )
            } else {
                format!(
                    "{} gave up at {} (lock_timeout) behind {}'s lock, whose instance {} was \
                     killed at {}.",
                    s(b.sale).name(),
                    secs(b.at),
                    s(b.behind).name(),
                    lane(b.behind),
                    secs(b.span.from)
                )
            };
            out.push((true, b.at, text));
        }
        for &(a, b, both) in &self.overlaps {
            let kept_out = [a, b]
                .iter()
                .filter_map(|&n| {
                    // Only a write refused for holding no lock any more was kept out: a
                    // sale that found the stock sold out wrote nothing to keep out.
                    s(n).refused
                        .as_ref()
                        .filter(|(_, r)| s(n).read.is_some() && r != "sold_out")
                        .map(|(_, r)| format!("{}'s write was refused ({r})", s(n).name()))
                        .or_else(|| {
                            s(n).lost
                                .as_ref()
                                .map(|_| format!("{} noticed it had lost the lock", s(n).name()))
                        })
                })
                .collect::<Vec<_>>();
            let why = if kept_out.is_empty() {
                String::new()
            } else {
                format!(", but {}", kept_out.join(" and "))
            };
            out.push((
                false,
                both.from,
                format!(
                    "{} and {} both believed they held the lock from {} to {}{why}.",
                    s(a).name(),
                    s(b).name(),
                    secs(both.from),
                    secs(both.to)
                ),
            ));
        }
        out.sort_by_key(|f| f.1);
        out
    }
}

/// `sale A`, `sale A's and sale B's`: the sales whose sales were overwritten.
fn and_list(names: &[String]) -> String {
    let owned: Vec<String> = names.iter().map(|n| format!("{n}'s sale")).collect();
    match owned.as_slice() {
        [] => "an earlier sale".to_owned(),
        [one] => one.clone(),
        [rest @ .., last] => format!("{} and {last}", rest.join(", ")),
    }
}

pub fn secs(ms: u64) -> String {
    format!("{:.3} s", ms as f64 / 1000.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn letters_go_on_after_z() {
        assert_eq!(letter(0), "A");
        assert_eq!(letter(25), "Z");
        assert_eq!(letter(26), "AA");
        assert_eq!(letter(27), "AB");
    }

    #[test]
    fn notes_are_read_for_what_they_do() {
        assert_eq!(Action::of("SIGSTOP app1 (it read)"), Action::Pause);
        assert_eq!(Action::of("SIGCONT app1"), Action::Resume);
        assert_eq!(Action::of("kill -9 app1 (it holds the lock)"), Action::Kill);
        assert_eq!(Action::of("the lock key EXPIRED"), Action::Expire);
        assert_eq!(Action::of("restart redis2"), Action::Restart);
        assert_eq!(
            Action::of("Sentinel promoted replica 1 (port 7001): the master now"),
            Action::Promote
        );
        assert_eq!(
            Action::of("replica 2 (up to date) may never be promoted (priority 0)"),
            Action::Other
        );
        assert_eq!(
            Action::of("replica 1 resumed, without what it missed"),
            Action::Resume
        );
        assert_eq!(Action::of("the stock's Redis is back"), Action::Restart);
        assert_eq!(
            lane_words("kill -9 lock node 2 of 3"),
            ["kill", "9", "lock", "node2", "of", "3"]
        );
        assert_eq!(lane_words("master KILLED"), ["redis", "KILLED"]);
        assert_eq!(
            Action::of("app2 starts a sale while app1 works"),
            Action::Other
        );
        assert_eq!(lane_kind("redis3"), Some(LaneKind::Redis));
        assert_eq!(lane_kind("app2"), Some(LaneKind::Instance));
        assert_eq!(lane_kind("application"), None);
        assert_eq!(lane_kind("node"), None);
        assert_eq!(lane_kind("redis"), Some(LaneKind::Redis));
    }
}

//! Each scenario run drawn as a picture: one self-contained HTML page (inline SVG, no
//! script, nothing fetched) with a lane per instance and per Redis node on a shared time
//! axis, built from the same timeline entries the text timeline prints.
//!
//! On an instance's lane, a bar for each sale while it *believes* it holds the lock; on a
//! Redis lane, a bar for each lease while *Redis* has it. Where the two stories part, the
//! picture says so: two sales that sold the same item (the later write stale), a release
//! that deleted another sale's lock, a buyer that gave up behind a lock nobody could
//! release are red; two holders at once whose second write was kept out are amber.
//!
//! Nothing here knows a scenario or a strategy by name ([`model`] reads the events), so a
//! new scenario row, with more instances or more Redis nodes, gets its picture as it is.

pub mod model;

use std::fmt::Write;

use serde_json::Value;

use crate::html::escape;
use crate::scenarios::{Fault, Observed, Run};
use crate::timeline::Entry;
use model::{LaneKind, LeaseEnd, Model, Span, secs};

/// Harm: a stale write, a deleted lock, a buyer blocked for good. Nothing else is this color.
pub const RED: &str = "#c53030";
/// Two holders at once, kept harmless.
const AMBER: &str = "#d69e2e";
const INK: &str = "#1a202c";
const MUTED: &str = "#4a5568";
const LANE_COLORS: [&str; 6] = [
    "#2b6cb0", "#6b46c1", "#2c7a7b", "#975a16", "#b83280", "#2f855a",
];

const WIDTH: f64 = 960.0;
const LEFT: f64 = 120.0;
const RIGHT: f64 = 24.0;
const STRIP: f64 = 26.0;
const INSTANCE_H: f64 = 78.0;
const REDIS_H: f64 = 60.0;
const AXIS_H: f64 = 30.0;
/// Approximate width of a character of the 11 px labels.
const CHAR_W: f64 = 6.1;

/// One run's picture, with what it found in words.
pub struct Picture {
    pub svg: String,
    /// (harmful, at_ms, text), in time order.
    pub findings: Vec<(bool, u64, String)>,
    pub notes: Vec<(usize, u64, String)>,
    pub sales: Vec<(String, String, String)>,
}

/// Draws one run's entries; `id` makes the SVG's own ids unique within a page.
pub fn draw(entries: &[Entry], id: &str) -> Picture {
    let m = Model::from_entries(entries);
    let mut d = Drawing::new(&m, id);
    d.draw();
    Picture {
        svg: d.finish(),
        findings: m.findings(),
        notes: m
            .notes
            .iter()
            .filter_map(|n| Some((n.number?, n.at, format!("{}: {}", n.who, n.text))))
            .collect(),
        sales: m
            .sales
            .iter()
            .map(|s| {
                (
                    s.letter.clone(),
                    m.lanes[s.lane].name.clone(),
                    s.id.chars().take(8).collect(),
                )
            })
            .collect(),
    }
}

struct Drawing<'a> {
    m: &'a Model,
    id: String,
    out: String,
    scale: f64,
    /// Each lane's top, and the strip's height above them.
    tops: Vec<f64>,
    strip: f64,
    height: f64,
    /// Label rows per lane.
    rows: Vec<Vec<LabelRow>>,
    /// Labels waiting for a place: the important ones are placed first.
    labels: Vec<Label>,
}

/// A row of labels: its baseline, and the x ranges its labels already take.
type LabelRow = (f64, Vec<(f64, f64)>);

struct Label {
    lane: usize,
    x: f64,
    text: String,
    color: &'static str,
    bold: bool,
}

impl Label {
    /// Bold (what went wrong, what the runner did) first, then the sales' own steps in ink,
    /// then the rest; a label that finds no room is left out (its mark keeps a tooltip).
    fn rank(&self) -> u8 {
        match (self.bold, self.color) {
            (true, _) => 0,
            (false, INK) => 1,
            _ => 2,
        }
    }
}

impl<'a> Drawing<'a> {
    fn new(m: &'a Model, id: &str) -> Self {
        let span = (m.t1.saturating_sub(m.t0)).max(100) as f64;
        let t0 = m.t0;
        let strip = if m.notes.iter().any(|n| n.number.is_some()) {
            STRIP
        } else {
            6.0
        };
        let mut tops = Vec::new();
        let mut rows = Vec::new();
        let mut y = strip;
        for lane in &m.lanes {
            tops.push(y);
            let (h, label_rows): (f64, Vec<f64>) = match lane.kind {
                LaneKind::Instance => (INSTANCE_H, vec![y + 27.0, y + 14.0, y + 68.0]),
                LaneKind::Redis => (REDIS_H, vec![y + 15.0, y + 53.0]),
            };
            rows.push(label_rows.into_iter().map(|r| (r, Vec::new())).collect());
            y += h;
        }
        let plot = WIDTH - LEFT - RIGHT;
        let _ = t0;
        Self {
            m,
            id: id.to_owned(),
            out: String::new(),
            scale: plot / (span * 1.03),
            tops,
            strip,
            height: y + AXIS_H,
            rows,
            labels: Vec::new(),
        }
    }

    fn x(&self, at: u64) -> f64 {
        LEFT + at.saturating_sub(self.m.t0) as f64 * self.scale
    }

    fn lane_color(&self, lane: usize) -> &'static str {
        let instances = self.m.lanes[..lane]
            .iter()
            .filter(|l| l.kind == LaneKind::Instance)
            .count();
        LANE_COLORS[instances % LANE_COLORS.len()]
    }

    fn sale_color(&self, sale: usize) -> &'static str {
        self.lane_color(self.m.sales[sale].lane)
    }

    /// The bar of a lane: (top, height).
    fn bar(&self, lane: usize) -> (f64, f64) {
        let top = self.tops[lane];
        match self.m.lanes[lane].kind {
            LaneKind::Instance => (top + 34.0, 20.0),
            LaneKind::Redis => (top + 22.0, 18.0),
        }
    }

    fn label(&mut self, lane: usize, x: f64, text: &str, color: &'static str, bold: bool) {
        self.labels.push(Label {
            lane,
            x,
            text: text.to_owned(),
            color,
            bold,
        });
    }

    fn place_labels(&mut self) {
        let mut labels = std::mem::take(&mut self.labels);
        labels.sort_by_key(Label::rank);
        for l in labels {
            self.place(l.lane, l.x, &l.text, l.color, l.bold);
        }
    }

    /// Puts a label centred on `x` in the first free row of `lane`; none when all are taken.
    fn place(&mut self, lane: usize, x: f64, text: &str, color: &str, bold: bool) {
        let w = text.chars().count() as f64 * CHAR_W;
        let from = (x - w / 2.0).clamp(LEFT, WIDTH - RIGHT - w);
        let to = from + w;
        let Some(row) = self.rows[lane]
            .iter_mut()
            .find(|(_, taken)| taken.iter().all(|&(a, b)| to + 4.0 < a || from > b + 4.0))
        else {
            return;
        };
        row.1.push((from, to));
        let y = row.0;
        let weight = if bold { " font-weight=\"700\"" } else { "" };
        let _ = writeln!(
            self.out,
            r#"<text x="{:.1}" y="{y:.1}" fill="{color}"{weight}>{}</text>"#,
            from,
            escape(text)
        );
    }

    fn draw(&mut self) {
        let id = self.id.clone();
        let _ = writeln!(
            self.out,
            r##"<defs><pattern id="{id}-gone" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(-45)"><rect width="6" height="6" fill="white" fill-opacity="0.6"/><line x1="0" y1="0" x2="0" y2="6" stroke="#a0aec0" stroke-width="2"/></pattern><pattern id="{id}-amber" width="5" height="5" patternUnits="userSpaceOnUse" patternTransform="rotate(45)"><line x1="0" y1="0" x2="0" y2="5" stroke="{AMBER}" stroke-width="3"/></pattern></defs>"##
        );
        self.lanes();
        self.axis();
        self.states();
        self.bands();
        self.leases();
        self.holds();
        self.marks();
        self.faults();
        self.lane_counts();
        self.strip();
        self.place_labels();
    }

    fn lanes(&mut self) {
        for (i, lane) in self.m.lanes.iter().enumerate() {
            let top = self.tops[i];
            let h = match lane.kind {
                LaneKind::Instance => INSTANCE_H,
                LaneKind::Redis => REDIS_H,
            };
            let fill = match lane.kind {
                LaneKind::Instance => "#f7fafc",
                LaneKind::Redis => "#fffaf0",
            };
            let color = match lane.kind {
                LaneKind::Instance => self.lane_color(i),
                LaneKind::Redis => "#9c4221",
            };
            let (sub, what) = match lane.kind {
                LaneKind::Instance => ("holds, as it believes", "instance"),
                LaneKind::Redis => ("lease, as Redis has it", "redis"),
            };
            let _ = writeln!(
                self.out,
                r##"<g class="lane" data-lane="{name}" data-kind="{what}"><rect x="0" y="{top:.1}" width="{WIDTH}" height="{h:.1}" fill="{fill}" stroke="#e2e8f0"/><text x="8" y="{ty:.1}" fill="{color}" font-weight="700" font-size="13">{name}</text><text x="8" y="{sy:.1}" fill="{MUTED}" font-size="10">{sub}</text></g>"##,
                name = escape(&lane.name),
                ty = top + h / 2.0,
                sy = top + h / 2.0 + 13.0,
            );
        }
    }

    fn axis(&mut self) {
        let span = self.m.t1.saturating_sub(self.m.t0).max(100);
        let step = [10, 20, 50, 100, 200, 250, 500, 1000, 2000, 5000, 10_000]
            .into_iter()
            .find(|s| span / s <= 12)
            .unwrap_or(20_000);
        let bottom = self.height - AXIS_H;
        let first = self.m.t0.div_ceil(step) * step;
        let _ = writeln!(
            self.out,
            r#"<line x1="{LEFT}" y1="{bottom:.1}" x2="{:.1}" y2="{bottom:.1}" stroke="{MUTED}"/>"#,
            WIDTH - RIGHT
        );
        let mut t = first;
        while t <= self.m.t0 + span * 103 / 100 {
            let x = self.x(t);
            let _ = writeln!(
                self.out,
                r##"<line x1="{x:.1}" y1="{:.1}" x2="{x:.1}" y2="{:.1}" stroke="#e2e8f0" stroke-dasharray="2 3"/><text x="{x:.1}" y="{:.1}" fill="{MUTED}" text-anchor="middle" font-size="11">{:.2} s</text>"##,
                self.strip,
                bottom + 4.0,
                bottom + 17.0,
                t as f64 / 1000.0
            );
            t += step;
        }
        let _ = writeln!(
            self.out,
            r#"<text x="8" y="{:.1}" fill="{MUTED}" font-size="10">time since start</text>"#,
            bottom + 17.0
        );
    }

    /// Paused (SIGSTOP .. SIGCONT) and dead (after kill) stretches of a lane.
    fn states(&mut self) {
        for &(lane, span, paused) in &self.m.states {
            let top = self.tops[lane] + 1.0;
            let h = match self.m.lanes[lane].kind {
                LaneKind::Instance => INSTANCE_H,
                LaneKind::Redis => REDIS_H,
            } - 2.0;
            let (x1, x2) = (
                self.x(span.from),
                self.x(span.to).max(self.x(span.from) + 2.0),
            );
            let lane_name = &self.m.lanes[lane].name;
            let (fill, label, class) = if paused {
                ("#cbd5e0", format!("{lane_name} frozen (SIGSTOP)"), "paused")
            } else {
                ("#718096", format!("{lane_name} killed (kill -9)"), "dead")
            };
            let _ = writeln!(
                self.out,
                r#"<rect class="{class}" data-lane="{}" data-from="{}" data-to="{}" x="{x1:.1}" y="{top:.1}" width="{:.1}" height="{h:.1}" fill="{fill}" fill-opacity="0.45"/>"#,
                escape(lane_name),
                span.from,
                span.to,
                x2 - x1,
            );
            let _ = writeln!(
                self.out,
                r#"<line x1="{x1:.1}" y1="{top:.1}" x2="{x1:.1}" y2="{:.1}" stroke="{INK}" stroke-width="2"/>"#,
                top + h
            );
            let text = if paused && !span.open {
                format!("{lane_name} frozen: SIGSTOP .. SIGCONT")
            } else {
                label
            };
            self.label(lane, (x1 + x2) / 2.0, &text, INK, true);
        }
    }

    fn lane_span_y(&self, lanes: &[usize]) -> (f64, f64) {
        let top = lanes
            .iter()
            .map(|&l| self.bar(l).0)
            .fold(f64::MAX, f64::min);
        let bottom = lanes
            .iter()
            .map(|&l| {
                let (t, h) = self.bar(l);
                t + h
            })
            .fold(0.0, f64::max);
        (top - 4.0, bottom + 4.0)
    }

    /// The red band where two sales that both sold the same item held at once, and the
    /// amber band where two held at once but the second write was kept out.
    fn bands(&mut self) {
        let m = self.m;
        for c in &m.conflicts {
            let Some(both) = c.both else { continue };
            let lanes = [m.sales[c.first].lane, m.sales[c.stale].lane];
            let (y1, y2) = self.lane_span_y(&lanes);
            let (x1, x2) = (self.x(both.from), self.x(both.to));
            let _ = writeln!(
                self.out,
                r#"<rect class="band conflict" data-sales="{} {}" data-from="{}" data-to="{}" x="{x1:.1}" y="{y1:.1}" width="{:.1}" height="{:.1}" fill="{RED}" fill-opacity="0.16" stroke="{RED}" stroke-dasharray="4 2"/>"#,
                m.sales[c.first].letter,
                m.sales[c.stale].letter,
                both.from,
                both.to,
                (x2 - x1).max(2.0),
                y2 - y1
            );
        }
        for &(a, b, both) in &m.overlaps {
            let lanes = [m.sales[a].lane, m.sales[b].lane];
            let (y1, y2) = self.lane_span_y(&lanes);
            let (x1, x2) = (self.x(both.from), self.x(both.to));
            let _ = writeln!(
                self.out,
                r#"<rect class="band overlap" data-sales="{} {}" data-from="{}" data-to="{}" x="{x1:.1}" y="{y1:.1}" width="{:.1}" height="{:.1}" fill="{AMBER}" fill-opacity="0.14" stroke="{AMBER}" stroke-dasharray="4 2"/>"#,
                m.sales[a].letter,
                m.sales[b].letter,
                both.from,
                both.to,
                (x2 - x1).max(2.0),
                y2 - y1
            );
        }
    }

    fn leases(&mut self) {
        let m = self.m;
        for (i, lease) in m.leases.iter().enumerate() {
            let (top, h) = self.bar(lease.lane);
            let (x1, x2) = (self.x(lease.from), self.x(lease.to));
            let color = self.sale_color(lease.sale);
            let sale = &m.sales[lease.sale];
            let end = match lease.end {
                LeaseEnd::Expired => "expired".to_owned(),
                LeaseEnd::Deleted { by } if by == lease.sale => "released".to_owned(),
                LeaseEnd::Deleted { by } => format!("deleted by {}", m.sales[by].letter),
                LeaseEnd::NodeGone => "node gone".to_owned(),
                LeaseEnd::Replaced => "replaced".to_owned(),
                LeaseEnd::Open => "still held".to_owned(),
            };
            let _ = writeln!(
                self.out,
                r#"<rect class="lease" data-sale="{letter}" data-lane="{lane}" data-from="{from}" data-to="{to}" x="{x1:.1}" y="{top:.1}" width="{w:.1}" height="{h:.1}" fill="{color}" fill-opacity="0.35" stroke="{color}"><title>{letter}'s lease on {lane}: {} to {}, {end}</title></rect>"#,
                secs(lease.from),
                secs(lease.to),
                letter = sale.letter,
                lane = escape(&m.lanes[lease.lane].name),
                from = lease.from,
                to = lease.to,
                w = (x2 - x1).max(3.0),
            );
            if x2 - x1 > 14.0 {
                let _ = writeln!(
                    self.out,
                    r#"<text x="{:.1}" y="{:.1}" fill="{INK}" font-weight="700">{}</text>"#,
                    x1 + 4.0,
                    top + h / 2.0 + 4.0,
                    sale.letter
                );
            }
            let foreign = m.foreign_deletes.contains(&i);
            match lease.end {
                LeaseEnd::Open => {
                    // An arrow off the end: Redis still has it.
                    let _ = writeln!(
                        self.out,
                        r#"<path d="M{:.1},{:.1} l8,{:.1} l-8,{:.1} z" fill="{color}"/>"#,
                        x2,
                        top,
                        h / 2.0,
                        h / 2.0
                    );
                    self.label(
                        lease.lane,
                        x2 - 30.0,
                        &format!("{}'s lock {end}", sale.letter),
                        INK,
                        false,
                    );
                }
                _ if foreign => {
                    self.cross(x2, top + h / 2.0, 6.0, RED, "deleted");
                    self.label(lease.lane, x2, &end, RED, true);
                }
                LeaseEnd::Expired => {
                    self.end_tick(x2, top, h, INK);
                    self.label(lease.lane, x2, "expired", INK, true);
                }
                _ => {
                    self.end_tick(x2, top, h, color);
                    self.label(lease.lane, x2, &end, MUTED, false);
                }
            }
        }
        // A buyer blocked behind a lease nobody could release: the lease is red from the
        // moment nobody could.
        for b in &m.blocked {
            if b.behind == b.sale {
                continue;
            }
            for lease in m.leases.iter().filter(|l| l.sale == b.behind) {
                let Some(span) = b.span.overlap(Span {
                    from: lease.from,
                    to: lease.to.max(b.at),
                    open: false,
                }) else {
                    continue;
                };
                let (top, h) = self.bar(lease.lane);
                let _ = writeln!(
                    self.out,
                    r#"<rect class="blocked" data-sale="{}" x="{:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="{RED}" fill-opacity="0.55"/>"#,
                    m.sales[b.behind].letter,
                    self.x(span.from),
                    top + h / 3.0,
                    self.x(span.to) - self.x(span.from),
                    h / 3.0
                );
                let text = format!(
                    "a dead holder's lock, {} waits in vain",
                    m.sales[b.sale].letter
                );
                let mid = (self.x(span.from) + self.x(span.to)) / 2.0;
                self.label(lease.lane, mid, &text, RED, true);
            }
        }
    }

    fn holds(&mut self) {
        let m = self.m;
        for (n, sale) in m.sales.iter().enumerate() {
            let (top, h) = self.bar(sale.lane);
            let color = self.sale_color(n);
            if let Some(hold) = sale.hold(m.t1) {
                let (x1, x2) = (self.x(hold.from), self.x(hold.to));
                let _ = writeln!(
                    self.out,
                    r#"<rect class="hold" data-sale="{letter}" data-lane="{lane}" data-from="{}" data-to="{}" x="{x1:.1}" y="{top:.1}" width="{:.1}" height="{h:.1}" fill="{color}" fill-opacity="0.3" stroke="{color}"><title>sale {letter} [{id}] believes it holds the lock: {} to {}</title></rect>"#,
                    hold.from,
                    hold.to,
                    (x2 - x1).max(3.0),
                    secs(hold.from),
                    secs(hold.to),
                    letter = sale.letter,
                    lane = escape(&m.lanes[sale.lane].name),
                    id = sale.id.chars().take(8).collect::<String>(),
                );
                if x2 - x1 > 12.0 {
                    let _ = writeln!(
                        self.out,
                        r#"<text x="{:.1}" y="{:.1}" fill="{INK}" font-weight="700">{}</text>"#,
                        x1 + 4.0,
                        top + h / 2.0 + 4.0,
                        sale.letter
                    );
                }
            } else if let Some(span) = sale.span(m.t1) {
                // No lock at all: the stretch from read to write, dashed.
                let (x1, x2) = (self.x(span.from), self.x(span.to));
                let _ = writeln!(
                    self.out,
                    r#"<rect class="unlocked" data-sale="{}" x="{x1:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="none" stroke="{color}" stroke-dasharray="3 2"><title>sale {} works without a lock</title></rect>"#,
                    sale.letter,
                    top + 3.0,
                    (x2 - x1).max(1.5),
                    h - 6.0,
                    sale.letter
                );
            }
            // Believing it holds a lock Redis no longer has: hatched grey over its bar.
            if let Some(gone) = m.believed_without_lease(n) {
                let (x1, x2) = (self.x(gone.from), self.x(gone.to));
                let _ = writeln!(
                    self.out,
                    r##"<rect class="no-lease" data-sale="{}" data-from="{}" data-to="{}" x="{x1:.1}" y="{top:.1}" width="{:.1}" height="{h:.1}" fill="url(#{}-gone)" stroke="{MUTED}" stroke-dasharray="3 2"><title>sale {} still believes it holds the lock, but its lease is gone</title></rect>"##,
                    sale.letter,
                    gone.from,
                    gone.to,
                    (x2 - x1).max(1.5),
                    self.id,
                    sale.letter
                );
                let text = format!("{}'s lease is gone, it still believes", sale.letter);
                self.label(sale.lane, (x1 + x2) / 2.0, &text, MUTED, false);
            }
            // From its read to its write it works on the stock it read: a darker core.
            if let (Some((read, _)), Some(done)) = (
                &sale.read,
                sale.written.as_ref().or(sale.refused.as_ref()).map(|w| w.0),
            ) {
                let (x1, x2) = (self.x(*read), self.x(done));
                let _ = writeln!(
                    self.out,
                    r#"<rect class="working" x="{x1:.1}" y="{:.1}" width="{:.1}" height="6" fill="{color}" fill-opacity="0.75"/>"#,
                    top + h - 6.0,
                    (x2 - x1).max(1.0)
                );
            }
        }
        // Over both holders' bars, where both sold the same item while holding: red.
        for c in &m.conflicts {
            let Some(both) = c.both else { continue };
            for n in [c.first, c.stale] {
                let (top, h) = self.bar(m.sales[n].lane);
                let (x1, x2) = (self.x(both.from), self.x(both.to));
                let _ = writeln!(
                    self.out,
                    r#"<rect class="both conflict" data-sale="{}" data-from="{}" data-to="{}" x="{x1:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="{RED}" fill-opacity="0.6" stroke="{RED}" stroke-width="2"/>"#,
                    m.sales[n].letter,
                    both.from,
                    both.to,
                    top,
                    (x2 - x1).max(2.0),
                    h
                );
            }
        }
        // The stale sale worked on a stock that another sale had already changed: red on its
        // bar from that other write to its own.
        for c in m.conflicts.iter().filter(|c| !c.lost) {
            let (Some((written, _)), Some((to, _))) =
                (&m.sales[c.first].written, &m.sales[c.stale].written)
            else {
                continue;
            };
            // It worked on a stale read from the moment the stock changed under it, which is
            // never before it read.
            let read = m.sales[c.stale].read.as_ref().map_or(0, |r| r.0);
            let from = &(*written).max(read);
            let (top, h) = self.bar(m.sales[c.stale].lane);
            let (x1, x2) = (self.x(*from), self.x(*to));
            let _ = writeln!(
                self.out,
                r#"<rect class="stale-read conflict" data-sale="{}" data-from="{from}" data-to="{to}" x="{x1:.1}" y="{:.1}" width="{:.1}" height="8" fill="{RED}"><title>sale {} works on a stock that sale {} already changed</title></rect>"#,
                m.sales[c.stale].letter,
                top + h - 8.0,
                (x2 - x1).max(2.0),
                m.sales[c.stale].letter,
                m.sales[c.first].letter,
            );
            if x2 - x1 > 60.0 {
                let text = format!("{} works on a stale read", m.sales[c.stale].letter);
                self.label(m.sales[c.stale].lane, (x1 + x2) / 2.0, &text, RED, false);
            }
        }
        for &(a, b, both) in &m.overlaps {
            for n in [a, b] {
                let (top, h) = self.bar(m.sales[n].lane);
                let (x1, x2) = (self.x(both.from), self.x(both.to));
                let _ = writeln!(
                    self.out,
                    r#"<rect class="both overlap" data-sale="{}" data-from="{}" data-to="{}" x="{x1:.1}" y="{top:.1}" width="{:.1}" height="{h:.1}" fill="url(#{}-amber)" stroke="{AMBER}" stroke-width="2"/>"#,
                    m.sales[n].letter,
                    both.from,
                    both.to,
                    (x2 - x1).max(2.0),
                    self.id
                );
            }
        }
        for b in &m.blocked {
            if b.behind != b.sale {
                continue;
            }
            let (top, h) = self.bar(m.sales[b.sale].lane);
            let (x1, x2) = (self.x(b.span.from), self.x(b.span.to));
            let _ = writeln!(
                self.out,
                r#"<rect class="blocked" data-sale="{}" x="{x1:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="{RED}" fill-opacity="0.55"/>"#,
                m.sales[b.sale].letter,
                top + h / 3.0,
                (x2 - x1).max(2.0),
                h / 3.0
            );
        }
    }

    fn marks(&mut self) {
        let m = self.m;
        let stale: Vec<usize> = m
            .conflicts
            .iter()
            .filter(|c| !c.lost)
            .map(|c| c.stale)
            .collect();
        // A landed write the Redis read next no longer had, and the sale that sold its item
        // again: (lost write's sale, reseller).
        let lost: Vec<(usize, usize)> = m
            .conflicts
            .iter()
            .filter(|c| c.lost)
            .map(|c| (c.first, c.stale))
            .collect();
        for (n, sale) in m.sales.iter().enumerate() {
            let lane = sale.lane;
            let (top, h) = self.bar(lane);
            let mid = top + h / 2.0;
            let color = self.sale_color(n);
            if let Some(at) = sale.acquired.filter(|_| sale.locks()) {
                let x = self.x(at);
                if sale.waited >= 20 {
                    let from = self.x(at.saturating_sub(sale.waited));
                    let _ = writeln!(
                        self.out,
                        r#"<line class="wait" data-sale="{}" x1="{from:.1}" y1="{mid:.1}" x2="{x:.1}" y2="{mid:.1}" stroke="{color}" stroke-width="2" stroke-dasharray="1 4"><title>sale {} waits {} ms for the lock</title></line>"#,
                        sale.letter, sale.letter, sale.waited
                    );
                    let text = format!("{} waits", sale.letter);
                    self.label(lane, (from + x) / 2.0, &text, MUTED, false);
                }
                let _ = writeln!(
                    self.out,
                    r#"<path class="mark acquire" data-sale="{}" d="M{x:.1},{:.1} l7,5 l-7,5 z" fill="{INK}"/>"#,
                    sale.letter,
                    mid - 5.0
                );
                let text = match &sale.fence {
                    Some(f) => format!("{} acquires, fence {f}", sale.letter),
                    None => format!("{} acquires", sale.letter),
                };
                self.label(lane, x, &text, INK, false);
            }
            for &(at, acquire) in &sale.nested {
                let x = self.x(at);
                let _ = writeln!(
                    self.out,
                    r#"<path class="mark nested" d="M{x:.1},{:.1} l5,4 l-5,4 z" fill="{MUTED}"/>"#,
                    top + 2.0
                );
                let text = if acquire {
                    "nested acquire"
                } else {
                    "nested release"
                };
                self.label(lane, x, text, MUTED, false);
            }
            if let Some((at, stock)) = &sale.read {
                let x = self.x(*at);
                let _ = writeln!(
                    self.out,
                    r#"<circle class="mark read" data-sale="{}" data-stock="{stock}" cx="{x:.1}" cy="{mid:.1}" r="5" fill="white" stroke="{INK}" stroke-width="2"><title>sale {} read stock {stock} at {}</title></circle>"#,
                    sale.letter,
                    sale.letter,
                    secs(*at)
                );
                self.label(
                    lane,
                    x,
                    &format!("{} reads {stock}", sale.letter),
                    INK,
                    false,
                );
            }
            for &at in &sale.renewals {
                let x = self.x(at);
                let _ = writeln!(
                    self.out,
                    r##"<path class="mark renew" d="M{x:.1},{:.1} l-4,-6 h8 z" fill="#2f855a"><title>renewed at {}</title></path>"##,
                    top - 1.0,
                    secs(at)
                );
                self.label(lane, x, "renew", "#2f855a", false);
            }
            if let Some((at, reason)) = &sale.lost {
                let x = self.x(*at);
                self.cross(x, mid, 5.0, "#c05621", "lost");
                let _ = reason;
                self.label(
                    lane,
                    x,
                    &format!("{} learns it lost the lock", sale.letter),
                    "#c05621",
                    false,
                );
            }
            if let Some((at, remaining)) = &sale.written {
                let x = self.x(*at);
                let is_stale = stale.contains(&n);
                let resold = lost.iter().find(|l| l.1 == n).map(|l| l.0);
                let was_lost = lost.iter().any(|l| l.0 == n);
                let (fill, class, text) = if let Some(first) = resold {
                    (
                        RED,
                        "mark write resold",
                        format!(
                            "{} writes {remaining}: sells {}'s item again",
                            sale.letter, m.sales[first].letter
                        ),
                    )
                } else if was_lost {
                    (
                        RED,
                        "mark write lost-write conflict",
                        format!("{} writes {remaining}: answered, then LOST", sale.letter),
                    )
                } else if is_stale {
                    (
                        RED,
                        "mark write stale",
                        format!("{} writes {remaining}: STALE", sale.letter),
                    )
                } else {
                    (
                        INK,
                        "mark write",
                        format!("{} writes {remaining}", sale.letter),
                    )
                };
                let _ = writeln!(
                    self.out,
                    r#"<rect class="{class}" data-sale="{}" data-stock="{remaining}" x="{:.1}" y="{:.1}" width="10" height="10" fill="{fill}" stroke="white"><title>sale {} wrote stock {remaining} at {}</title></rect>"#,
                    sale.letter,
                    x - 5.0,
                    mid - 5.0,
                    sale.letter,
                    secs(*at)
                );
                self.label(lane, x, &text, fill, fill == RED);
            }
            if let Some((at, reason)) = &sale.refused {
                let x = self.x(*at);
                let blocked = m.blocked.iter().any(|b| b.sale == n);
                let color = if blocked { RED } else { "#744210" };
                self.cross(x, mid, 5.0, color, "mark refused");
                let text = if blocked {
                    format!("{} gives up: {reason}", sale.letter)
                } else {
                    refusal(sale, reason)
                };
                let _ = writeln!(
                    self.out,
                    r#"<rect class="refusal" data-sale="{}" x="{:.1}" y="{:.1}" width="12" height="12" fill="none"><title>{} at {}</title></rect>"#,
                    sale.letter,
                    x - 6.0,
                    mid - 6.0,
                    escape(&text),
                    secs(*at)
                );
                // Sold out is the stock's answer, not a fault: its label yields to those.
                let bold = blocked || reason != "sold_out";
                self.label(lane, x, &text, color, bold);
            }
            if let Some((at, released)) = &sale.released
                && sale.locks()
            {
                let x = self.x(*at);
                self.end_tick(x, top, h, color);
                let text = match released.as_str() {
                    "NotHeld" => format!("{} releases: not its own any more", sale.letter),
                    _ => format!("{} releases", sale.letter),
                };
                self.label(lane, x, &text, MUTED, false);
            }
            // Every refused EXEC threw work away: a tick each, counted on the lane.
            for &at in &sale.thrown_away {
                let x = self.x(at);
                let _ = writeln!(
                    self.out,
                    r##"<line class="mark thrown-away" data-sale="{}" x1="{x:.1}" y1="{:.1}" x2="{x:.1}" y2="{:.1}" stroke="#c05621" stroke-width="1.5"><title>sale {} EXEC refused at {}: its work thrown away</title></line>"##,
                    sale.letter,
                    top - 4.0,
                    top + 4.0,
                    sale.letter,
                    secs(at)
                );
            }
        }
    }

    /// What each lane's sales had refused, and the EXECs thrown away, counted under its
    /// name: labels that find no room are dropped, a count never is.
    fn lane_counts(&mut self) {
        let m = self.m;
        for (lane, l) in m.lanes.iter().enumerate() {
            let sales = || m.sales.iter().filter(move |s| s.lane == lane);
            let refused = sales().filter(|s| s.refused.is_some()).count();
            let thrown: usize = sales().map(|s| s.thrown_away.len()).sum();
            let mut lines = Vec::new();
            if refused > 0 {
                lines.push(format!("{refused} refused"));
            }
            if thrown > 0 {
                lines.push(format!("{thrown} EXECs refused"));
            }
            let h = match l.kind {
                LaneKind::Instance => INSTANCE_H,
                LaneKind::Redis => REDIS_H,
            };
            for (i, line) in lines.iter().enumerate() {
                let _ = writeln!(
                    self.out,
                    r##"<text class="count" data-lane="{}" x="8" y="{:.1}" fill="#744210" font-size="10">{line}</text>"##,
                    escape(&l.name),
                    self.tops[lane] + h / 2.0 + 25.0 + 11.0 * i as f64,
                );
            }
        }
    }

    /// A fault's mark on its lane where nothing else draws it: a restart (the kill, the
    /// pause and the expiry are drawn as states and lease ends).
    fn faults(&mut self) {
        let m = self.m;
        for note in &m.notes {
            if note.action != model::Action::Restart {
                continue;
            }
            let Some(&lane) = note.lanes.first() else {
                continue;
            };
            let top = self.tops[lane];
            let h = match m.lanes[lane].kind {
                LaneKind::Instance => INSTANCE_H,
                LaneKind::Redis => REDIS_H,
            };
            let x = self.x(note.at);
            let _ = writeln!(
                self.out,
                r##"<line class="fault restart" data-lane="{}" data-at="{}" x1="{x:.1}" y1="{:.1}" x2="{x:.1}" y2="{:.1}" stroke="{INK}" stroke-width="2" stroke-dasharray="4 2"><title>{}</title></line>"##,
                escape(&m.lanes[lane].name),
                note.at,
                top + 1.0,
                top + h - 1.0,
                escape(&note.text)
            );
            let empty = if note.text.to_lowercase().contains("empty") {
                " EMPTY"
            } else {
                ""
            };
            let text = format!("{} restarted{empty}", m.lanes[lane].name);
            self.label(lane, x, &text, INK, true);
        }
    }

    /// The runner's other notes: numbered dots on a strip above the lanes, listed below.
    fn strip(&mut self) {
        if self.strip < STRIP {
            return;
        }
        let _ = writeln!(
            self.out,
            r#"<text x="8" y="17" fill="{MUTED}" font-size="10">runner notes</text>"#
        );
        // Circles of notes close in time are set side by side, never on each other.
        let mut last = f64::MIN;
        for note in &self.m.notes {
            let Some(number) = note.number else { continue };
            let x = self.x(note.at).max(last + 17.0);
            last = x;
            let _ = writeln!(
                self.out,
                r##"<g class="note"><circle cx="{x:.1}" cy="13" r="8" fill="#edf2f7" stroke="{MUTED}"/><text x="{x:.1}" y="17" text-anchor="middle" fill="{INK}" font-size="10">{number}</text><title>{}</title></g>"##,
                escape(&note.text)
            );
        }
    }

    fn cross(&mut self, x: f64, y: f64, r: f64, color: &str, class: &str) {
        let _ = writeln!(
            self.out,
            r#"<path class="{class}" d="M{:.1},{:.1} l{d:.1},{d:.1} m0,-{d:.1} l-{d:.1},{d:.1}" stroke="{color}" stroke-width="3"/>"#,
            x - r,
            y - r,
            d = 2.0 * r
        );
    }

    fn end_tick(&mut self, x: f64, top: f64, h: f64, color: &str) {
        let _ = writeln!(
            self.out,
            r#"<line x1="{x:.1}" y1="{:.1}" x2="{x:.1}" y2="{:.1}" stroke="{color}" stroke-width="3"/>"#,
            top - 3.0,
            top + h + 3.0
        );
    }

    fn finish(self) -> String {
        format!(
            r#"<svg class="picture" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {h:.0}" width="{WIDTH}" height="{h:.0}" font-family="system-ui, sans-serif" font-size="11" role="img">
{}</svg>"#,
            self.out,
            h = self.height
        )
    }
}

/// The whole page: a summary table, a legend, and each run's picture with its verdict, the
/// evidence and the text timeline.
pub fn page(runs: &[Run]) -> String {
    let mut page = String::new();
    let _ = write!(
        page,
        r#"<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>inventory: every flaw on demand</title>
<style>
body {{ font: 15px/1.45 system-ui, sans-serif; margin: 1.5rem auto; max-width: 1000px; color: {INK}; padding: 0 1rem; }}
h1 {{ font-size: 1.5rem; margin-bottom: .2rem; }} .sub {{ color: {MUTED}; margin-top: 0; }}
h2 {{ font-size: 1.15rem; margin: 2.4rem 0 .2rem; }} h2 .what {{ font-weight: 400; color: {MUTED}; }}
table {{ border-collapse: collapse; font-variant-numeric: tabular-nums; }}
th, td {{ padding: .2rem .6rem; border-bottom: 1px solid #e2e8f0; text-align: left; }}
.flaw {{ color: {RED}; font-weight: 600; }} .safe {{ color: #2f855a; font-weight: 600; }} .missed {{ color: #975a16; font-weight: 600; }}
.verdict {{ font-size: 1.05rem; margin: .3rem 0; }}
ul.findings {{ margin: .2rem 0; padding-left: 1.2rem; }} ul.findings li.harm {{ color: {RED}; }} ul.findings li.kept {{ color: #744210; }}
.legend svg {{ vertical-align: middle; }} .legend span {{ margin-right: 1.1rem; white-space: nowrap; }}
pre {{ background: #f7fafc; padding: .6rem; overflow-x: auto; font-size: 12.5px; }}
.key {{ color: {MUTED}; font-size: 13px; margin: .2rem 0; }}
figure {{ margin: .4rem 0; }}
</style></head><body>
<h1>Every flaw on demand</h1>
<p class="sub">Each fault against the version that falls to it and the version that survives it.
Each picture is drawn from the same events as the text timeline under it.</p>
"#
    );
    page.push_str(&legend());
    if runs.len() > 1 {
        page.push_str(&summary(runs));
    }
    for (i, r) in runs.iter().enumerate() {
        page.push_str(&section(i, r));
    }
    page.push_str("</body></html>\n");
    page
}

/// The table of every run, each linking to its picture.
fn summary(runs: &[Run]) -> String {
    let mut page = String::new();
    page.push_str("<table><tr><th>scenario</th><th>strategy</th><th>expected</th><th>observed</th><th></th></tr>\n");
    for (i, r) in runs.iter().enumerate() {
        let _ = writeln!(
            page,
            r##"<tr><td><a href="#row-{i}">{}</a></td><td>{}</td><td>{}</td><td class="{o}">{o}</td><td>{}</td></tr>"##,
            r.scenario,
            escape(&r.label()),
            r.expected,
            if r.ok { "ok" } else { "NOT OK" },
            o = r.observed,
        );
    }
    page.push_str("</table>\n");
    page
}

fn section(i: usize, r: &Run) -> String {
    let description = r
        .scenario
        .parse::<Fault>()
        .map(|f| f.scenario().description)
        .unwrap_or_default();
    let picture = draw(&r.entries, &format!("row{i}"));
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<section class="row" id="row-{i}" data-scenario="{sc}" data-strategy="{st}" data-observed="{o}">
<h2>{sc} / {st}: <span class="what">{}</span></h2>
<p class="verdict">expected <b>{}</b>, observed <span class="{o}">{o}</span>: {}</p>
<figure>{}</figure>
"#,
        escape(description),
        r.expected,
        if r.ok { "ok" } else { "NOT OK" },
        picture.svg,
        sc = r.scenario,
        st = escape(&r.label()),
        o = r.observed,
    );
    if let Some(note) = &r.audit_note {
        let _ = writeln!(s, r#"<p class="key">{}</p>"#, escape(note));
    } else if r.observed == Observed::Safe && picture.findings.iter().any(|f| f.0) {
        s.push_str(
            "<p class=\"key\">The verdict judges this row's fault only: the red below is \
             harm of another kind that this version still allows (a later row provokes it).</p>\n",
        );
    }
    if !picture.findings.is_empty() {
        s.push_str("<ul class=\"findings\">\n");
        for (harm, _, text) in &picture.findings {
            let _ = writeln!(
                s,
                r#"<li class="{}">{}</li>"#,
                if *harm { "harm" } else { "kept" },
                escape(text)
            );
        }
        s.push_str("</ul>\n");
    }
    if !picture.sales.is_empty() && picture.sales.len() <= 12 {
        let key: Vec<String> = picture
            .sales
            .iter()
            .map(|(letter, lane, id)| format!("{letter} = [{id}] on {lane}"))
            .collect();
        let _ = writeln!(
            s,
            r#"<p class="key">Sales: {}</p>"#,
            escape(&key.join(", "))
        );
    }
    if !picture.notes.is_empty() {
        let key: Vec<String> = picture
            .notes
            .iter()
            .map(|(n, at, text)| format!("({n}) {} {text}", secs(*at)))
            .collect();
        let _ = writeln!(
            s,
            r#"<p class="key">Runner notes: {}</p>"#,
            escape(&key.join("; "))
        );
    }
    let _ = write!(
        s,
        "<details><summary>evidence: the scenario's details</summary><pre>{}</pre></details>\n\
         <details><summary>the text timeline</summary><pre>{}</pre></details>\n</section>\n",
        escape(&pretty(&r.details)),
        escape(&r.timeline)
    );
    s
}

/// A refusal in words, for what was refused: the acquire (nothing read yet), the write, or
/// the sale for want of stock.
fn refusal(sale: &model::Sale, reason: &str) -> String {
    if reason == "sold_out" {
        format!("{}: sold out", sale.letter)
    } else if sale.read.is_some() {
        format!("{}'s write refused: {reason}", sale.letter)
    } else if sale.acquired.is_some() {
        format!("{} refused before it read: {reason}", sale.letter)
    } else {
        format!("{}'s lock refused: {reason}", sale.letter)
    }
}

fn pretty(v: &Value) -> String {
    serde_json::to_string_pretty(v).unwrap_or_default()
}

fn swatch(inner: &str) -> String {
    format!(r#"<svg width="34" height="16" viewBox="0 0 34 16">{inner}</svg>"#)
}

fn legend() -> String {
    let c = LANE_COLORS[0];
    let items = [
        (
            swatch(&format!(
                r#"<rect x="1" y="3" width="32" height="10" fill="{c}" fill-opacity="0.3" stroke="{c}"/>"#
            )),
            "a sale believes it holds the lock (instance lane)",
        ),
        (
            swatch(&format!(
                r#"<rect x="1" y="3" width="32" height="10" fill="{c}" fill-opacity="0.35" stroke="{c}"/><line x1="33" y1="1" x2="33" y2="15" stroke="{INK}" stroke-width="3"/>"#
            )),
            "its lease as Redis has it (Redis lane), to expiry or release",
        ),
        (
            swatch(&format!(
                r#"<rect x="1" y="9" width="32" height="6" fill="{c}" fill-opacity="0.75"/>"#
            )),
            "from its read to its write (red: the stock changed meanwhile)",
        ),
        (
            swatch(&format!(
                r#"<path d="M4,3 l7,5 l-7,5 z" fill="{INK}"/><circle cx="22" cy="8" r="5" fill="white" stroke="{INK}" stroke-width="2"/>"#
            )),
            "acquire, read (the stock read)",
        ),
        (
            swatch(&format!(
                r#"<rect x="3" y="3" width="10" height="10" fill="{INK}"/><rect x="20" y="3" width="10" height="10" fill="{RED}"/>"#
            )),
            "write (the stock written); red: stale, lost after it landed, or selling a lost sale's item again",
        ),
        (
            swatch(&format!(
                r##"<line x1="6" y1="2" x2="6" y2="14" stroke="#c05621" stroke-width="1.5"/><line x1="24" y1="1" x2="24" y2="15" stroke="{INK}" stroke-width="2" stroke-dasharray="4 2"/>"##
            )),
            "EXEC refused (work thrown away), a node restarted",
        ),
        (
            swatch(
                r##"<path d="M4,3 l10,10 m0,-10 l-10,10" stroke="#744210" stroke-width="3"/><path d="M22,11 l-4,-6 h8 z" fill="#2f855a"/>"##,
            ),
            "refused, renew",
        ),
        (
            swatch(&format!(
                r#"<rect x="1" y="2" width="32" height="12" fill="{RED}" fill-opacity="0.6" stroke="{RED}" stroke-width="2"/>"#
            )),
            "two holders at once, both writes landed",
        ),
        (
            swatch(&format!(
                r#"<rect x="1" y="2" width="32" height="12" fill="none" stroke="{AMBER}" stroke-width="2"/><path d="M1,14 l12,-12 M11,14 l12,-12 M21,14 l12,-12" stroke="{AMBER}" stroke-width="3"/>"#
            )),
            "two holders at once, the late write kept out",
        ),
        (
            swatch(&format!(
                r##"<rect x="1" y="3" width="32" height="10" fill="white" stroke="{MUTED}" stroke-dasharray="3 2"/><path d="M5,13 l8,-10 M13,13 l8,-10 M21,13 l8,-10" stroke="#a0aec0" stroke-width="2"/>"##
            )),
            "it still believes, but its lease is gone",
        ),
        (
            swatch(&format!(
                r#"<line x1="1" y1="8" x2="33" y2="8" stroke="{c}" stroke-width="2" stroke-dasharray="1 4"/>"#
            )),
            "waits for the lock",
        ),
        (
            swatch(
                r##"<rect x="1" y="1" width="15" height="14" fill="#cbd5e0"/><rect x="18" y="1" width="15" height="14" fill="#718096" fill-opacity="0.7"/>"##,
            ),
            "frozen (SIGSTOP), killed",
        ),
    ];
    let mut s = String::from("<p class=\"legend\">");
    for (svg, text) in items {
        let _ = write!(s, "<span>{svg} {text}</span> ");
    }
    s.push_str("</p>\n");
    s
}

#[cfg(test)]
mod tests;

//! The scenarios' pictures (`scenarios --report`): drawn from real runs, red exactly where
//! the run went wrong, and every row's picture there when a browser opens the page.

use std::collections::BTreeMap;
use std::path::Path;

use loadtest::picture::{self, RED};
use loadtest::scenarios::{self, Fault, Observed, Row, Run};

async fn run(fault: &str, label: &str) -> Run {
    let fault: Fault = fault.parse().unwrap();
    let row = Row::find(fault, label).unwrap();
    let bin = Path::new(env!("CARGO_BIN_EXE_inventory"));
    scenarios::run_bounded(row, bin, 3).await.unwrap()
}

/// The attributes of every `<tag ...>` element of `svg` with `class` among its classes.
fn elements(svg: &str, tag: &str, class: &str) -> Vec<BTreeMap<String, String>> {
    let open = format!("<{tag} ");
    svg.split(&open)
        .skip(1)
        .filter_map(|rest| {
            let attrs = &rest[..rest.find('>')?];
            let mut map = BTreeMap::new();
            for pair in attrs.split("\" ") {
                if let Some((k, v)) = pair.split_once("=\"") {
                    map.insert(
                        k.trim().to_owned(),
                        v.trim_end_matches(['"', '/']).to_owned(),
                    );
                }
            }
            map.get("class")
                .is_some_and(|c| c.split(' ').any(|c| c == class))
                .then_some(map)
        })
        .collect()
}

fn ms(e: &BTreeMap<String, String>, name: &str) -> u64 {
    e[name].parse().unwrap()
}

/// Each row's section of the page, by `scenario/strategy`, with its SVG.
fn sections(page: &str) -> BTreeMap<String, String> {
    page.split("<section ")
        .skip(1)
        .map(|s| {
            let attr = |name: &str| {
                let from = s.find(&format!("{name}=\"")).unwrap() + name.len() + 2;
                s[from..from + s[from..].find('"').unwrap()].to_owned()
            };
            let svg_from = s.find("<svg class=\"picture\"").unwrap();
            let svg = &s[svg_from..svg_from + s[svg_from..].find("</svg>").unwrap()];
            (
                format!("{}/{}", attr("data-scenario"), attr("data-strategy")),
                svg.to_owned(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_paused_holders_stale_write_is_red_where_both_held_and_the_fenced_row_has_no_red() {
    let flaw = run("process-pause", "watchdog").await;
    let safe = run("process-pause", "fenced").await;
    assert_eq!(
        (flaw.observed, safe.observed),
        (Observed::Flaw, Observed::Safe),
        "timelines:\n{}\n{}",
        flaw.timeline,
        safe.timeline
    );
    let page = picture::page(&[flaw.clone(), safe]);
    let rows = sections(&page);
    let svg = &rows["process-pause/watchdog"];

    // Two sales' "holds the lock" bars, on two instances, that overlap in time.
    let holds = elements(svg, "rect", "hold");
    let (a, b) = holds
        .iter()
        .flat_map(|a| holds.iter().map(move |b| (a, b)))
        .find(|(a, b)| {
            a["data-lane"] != b["data-lane"]
                && ms(a, "data-from") < ms(b, "data-to")
                && ms(b, "data-from") < ms(a, "data-to")
        })
        .unwrap_or_else(|| panic!("no two overlapping holds in\n{svg}\n{}", flaw.timeline));
    // Each is marked red over the overlap.
    let both = elements(svg, "rect", "both");
    for hold in [a, b] {
        let marked = both
            .iter()
            .find(|m| m["data-sale"] == hold["data-sale"])
            .unwrap_or_else(|| {
                panic!(
                    "sale {}'s bar is not marked where both held",
                    hold["data-sale"]
                )
            });
        assert!(marked["class"].contains("conflict"), "{marked:?}");
        assert_eq!(marked["fill"], RED);
        let (from, to) = (ms(marked, "data-from"), ms(marked, "data-to"));
        assert!(
            from >= ms(a, "data-from").max(ms(b, "data-from"))
                && to <= ms(a, "data-to").min(ms(b, "data-to")),
            "the red stretch {from}..{to} is where both held: {a:?} {b:?}"
        );
    }
    // And the stale write is red.
    let stale = elements(svg, "rect", "stale");
    assert_eq!(stale.len(), 1, "one stale write: {svg}");
    assert_eq!(stale[0]["fill"], RED);

    let safe_svg = &rows["process-pause/fenced"];
    assert!(
        !safe_svg.contains(RED),
        "the fenced row has no red:\n{safe_svg}"
    );
    assert!(
        !elements(safe_svg, "rect", "hold").is_empty(),
        "the fenced row is drawn too"
    );
}

/// Rows whose text timeline hands the lock on strictly in order were drawn with "two
/// holders at once" wherever a hand-over fell within one millisecond; the faults themselves
/// (a Redis killed, a master killed, a replica frozen) were drawn nowhere, and a sale lost
/// with the master was drawn as a stale read that started before its read.
#[tokio::test(flavor = "multi_thread")]
async fn pictures_show_the_fault_and_no_two_holders_the_timeline_does_not_have() {
    let setnx = run("two-instances", "setnx").await;
    let node_loss = run("node-loss", "fenced").await;
    let failover = run("failover", "fenced REPLICA_ACKS=0").await;
    let page = picture::page(&[setnx.clone(), node_loss.clone(), failover.clone()]);
    let rows = sections(&page);

    let svg = &rows["two-instances/setnx"];
    assert!(
        elements(svg, "rect", "overlap").is_empty(),
        "no two holders at once:\n{svg}\n{}",
        setnx.timeline
    );

    let svg = &rows["node-loss/fenced"];
    let dead = elements(svg, "rect", "dead");
    assert!(
        dead.iter().any(|d| d["data-lane"] == "redis"),
        "the kill of the stock's Redis is drawn:\n{svg}\n{}",
        node_loss.timeline
    );
    assert!(
        elements(svg, "rect", "overlap").is_empty(),
        "nobody's belief outlives its answer:\n{svg}\n{}",
        node_loss.timeline
    );

    let svg = &rows["failover/fenced REPLICA_ACKS=0"];
    assert!(
        elements(svg, "rect", "stale-read").is_empty(),
        "{svg}\n{}",
        failover.timeline
    );
    assert!(
        !elements(svg, "rect", "lost-write").is_empty(),
        "{svg}\n{}",
        failover.timeline
    );
    assert!(
        elements(svg, "rect", "dead")
            .iter()
            .any(|d| d["data-lane"] == "redis"),
        "the master's death is drawn:\n{svg}"
    );
    assert!(
        elements(svg, "rect", "paused")
            .iter()
            .any(|d| d["data-lane"] == "replica1"),
        "the frozen replica is drawn:\n{svg}"
    );
}

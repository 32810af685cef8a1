//! The comparison table printed at the end of a run.

use crate::StrategyReport;
use crate::items::{Spread, name_some};

// Sales/s and requests/s apart: with a small stock most requests are quick refusals
// (sold out), and their rate says nothing about how fast the lock sells.
// "200 lost": sales answered 200 that the server no longer has (a failover lost them).
const HEADERS: [&str; 15] = [
    "strategy", "sold", "sold out", "refused", "errors", "oversold", "lost", "dup", "200 lost",
    "split", "sales/s", "req/s", "p50 ms", "p99 ms", "verdict",
];

/// The verdict with its reason, as a cell of a Markdown table (the failover and cluster
/// tables): a `|` in it, which an error kind from the server could carry, would end the cell.
pub fn markdown_verdict(r: &StrategyReport) -> String {
    r.verdict_text().replace('|', "\\|")
}

pub fn render(reports: &[StrategyReport]) -> String {
    let rows: Vec<[String; 15]> = reports.iter().map(row).collect();
    let mut widths = HEADERS.map(str::len);
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: &[String]| {
        let padded: Vec<String> = cells
            .iter()
            .zip(widths)
            .enumerate()
            .map(|(i, (c, w))| {
                if i == 0 || i == 9 {
                    format!("{c:<w$}")
                } else {
                    format!("{c:>w$}")
                }
            })
            .collect();
        padded.join("  ").trim_end().to_owned()
    };
    let mut out = vec![
        line(&HEADERS.map(String::from)),
        line(&widths.map(|w| "-".repeat(w))),
    ];
    out.extend(rows.iter().map(|r| line(r)));
    for report in reports {
        if report.items > 1 {
            out.push(items_line(report));
        }
        if let (Some(killed), resumed) = (&report.failover, report.resumed_after_s) {
            let resumed = resumed.map_or("no sale after it".into(), |s| {
                format!("sales resumed {s} s later")
            });
            out.push(format!(
                "failover: {}: master {} killed ({}) at {} s; {resumed}",
                report.strategy, killed.master, killed.how, killed.at_s
            ));
        }
        if let Some(why) = &report.disagreement {
            out.push(format!("note: {}: {why}", report.strategy));
        }
        // The column has room for the word only; the reason is what to fix before a rerun.
        if let Some(why) = report.inconclusive() {
            out.push(format!("inconclusive: {}: {why}", report.strategy));
        }
    }
    out.join("\n")
}

/// One line per strategy however many items: the spread of sales per item, and the
/// oversold items by name (the first ten).
fn items_line(r: &StrategyReport) -> String {
    let spread = Spread::of(&r.per_item);
    let oversold = if spread.oversold.is_empty() {
        "none oversold".to_owned()
    } else {
        format!(
            "oversold: {} of {}: {}",
            spread.oversold.len(),
            spread.items,
            name_some(&spread.oversold, 10)
        )
    };
    format!(
        "items: {}: {} items of stock {} each, sold per item min {} / max {}; {oversold}",
        r.strategy, r.items, r.stock, spread.min_sold, spread.max_sold
    )
}

fn row(r: &StrategyReport) -> [String; 15] {
    let split = r
        .instances
        .values()
        .map(u64::to_string)
        .collect::<Vec<_>>()
        .join("/");
    [
        r.strategy.clone(),
        r.sold.to_string(),
        r.sold_out.to_string(),
        r.refused.to_string(),
        r.errors.to_string(),
        r.oversold.to_string(),
        r.lost_updates.to_string(),
        r.duplicates.to_string(),
        r.lost_200.to_string(),
        if split.is_empty() { "-".into() } else { split },
        format!("{:.0}", r.sales_per_s),
        format!("{:.0}", r.throughput_rps),
        format!("{:.1}", r.latency_ms.p50),
        format!("{:.1}", r.latency_ms.p99),
        r.verdict.to_string(),
    ]
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::render;
    use crate::{Outcome, summarize};
    use inventory::store::Audit;

    fn audit(item: &str, sales: i64) -> Audit {
        let remaining = (5 - sales).max(0);
        Audit {
            item: item.into(),
            initial: 5,
            remaining,
            sales,
            oversold: (sales - 5).max(0),
            lost_updates: sales - (5 - remaining),
            duplicates: Vec::new(),
            clean: sales <= 5,
        }
    }

    fn report(sold: &[i64]) -> crate::StrategyReport {
        let results = sold
            .iter()
            .enumerate()
            .flat_map(|(item, &n)| {
                let outcome = Outcome::Sold {
                    instance: Some("app1".into()),
                };
                vec![(item, outcome, Duration::from_millis(1)); n as usize]
            })
            .collect();
        let audits: Vec<Audit> = sold
            .iter()
            .enumerate()
            .map(|(n, &s)| audit(&crate::items::item_id(n + 1, sold.len()), s))
            .collect();
        summarize(
            "local".parse().unwrap(),
            5,
            results,
            Duration::from_secs(1),
            &audits,
        )
    }

    #[test]
    fn an_inconclusive_run_says_why_under_the_table() {
        let results = vec![(0, Outcome::Error("bad_request".into()), Duration::ZERO); 2];
        let mut untouched = audit("001", 0);
        untouched.remaining = 5;
        let report = summarize(
            "fenced".parse().unwrap(),
            5,
            results,
            Duration::from_secs(1),
            &[untouched],
        );
        let table = render(&[report]);
        let lines: Vec<&str> = table.lines().collect();
        assert!(lines[2].ends_with("INCONCLUSIVE"), "{table}");
        assert_eq!(
            lines[3],
            "inconclusive: fenced: nothing sold; 2 requests failed (bad_request: 2)"
        );
    }

    #[test]
    fn one_item_prints_the_table_of_old_and_no_items_line() {
        let table = render(&[report(&[5])]);
        assert_eq!(table.lines().count(), 3, "{table}");
        assert!(!table.contains("items:"), "{table}");
    }

    #[test]
    fn many_items_print_one_line_with_the_spread_and_the_oversold_items_by_name() {
        let table = render(&[report(&[5, 7, 4, 6])]);
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 4, "totals, not a row per item: {table}");
        assert!(
            lines[2].starts_with("local") && lines[2].contains("22"),
            "{table}"
        );
        assert_eq!(
            lines[3],
            "items: local: 4 items of stock 5 each, sold per item min 4 / max 7; \
             oversold: 2 of 4: item-0002, item-0004"
        );
        let clean = render(&[report(&[5, 5, 3])]);
        assert!(clean.ends_with("min 3 / max 5; none oversold"), "{clean}");
    }
}

//! The tables the tools print: `loadtest`'s comparison at the end of a run, and the Markdown
//! tables of `failover-table` and `cluster-table`, each with its header beside its rows so
//! that the two cannot drift apart.

use crate::items::{Spread, name_some};
use crate::{MIN_RATE_WINDOW, StrategyReport};

// Sales/s and requests/s apart: with a small stock most requests are quick refusals
// (sold out), and their rate says nothing about how fast the lock sells.
// "200 lost": sales answered 200 that the server no longer has (a failover lost them).
const HEADERS: [&str; 15] = [
    "strategy", "sold", "sold out", "refused", "errors", "oversold", "lost", "dup", "200 lost",
    "split", "sales/s", "req/s", "p50 ms", "p99 ms", "verdict",
];

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

/// The verdict with its reason: a row is all a reader of these tables gets, and the reason
/// an INCONCLUSIVE run gives is what to fix before running again.
fn markdown_verdict(r: &StrategyReport) -> String {
    cell(&r.verdict_text())
}

/// `text` as a Markdown cell: a `|` in it, which an error kind from the server (in an error
/// count or a verdict's reason) could carry, would end the cell.
fn cell(text: &str) -> String {
    text.replace('|', "\\|")
}

/// `failover-table`'s header: its two lines.
pub const FAILOVER_HEADER: [&str; 2] = [
    "| strategy | REPLICA_ACKS | sold (200) | 200 lost | sales resumed after | errors | sales/s before the kill | sales/s overall | verdict |",
    "|---|---|---|---|---|---|---|---|---|",
];

/// One row of `failover-table`: a run with `REPLICA_ACKS` at `acks` and its master killed.
/// A rate is `-` over less than [`MIN_RATE_WINDOW`]: the kill's own (`None` in the report)
/// and, for a run that short, the overall one.
pub fn failover_row(acks: u32, r: &StrategyReport) -> String {
    let overall = if r.duration_s >= MIN_RATE_WINDOW.as_secs_f64() {
        format!("{:.0}", r.sales_per_s)
    } else {
        "-".into()
    };
    format!(
        "| {} | {acks} | {} | {} | {} | {} | {} | {overall} | {} |",
        r.strategy,
        r.sold,
        r.lost_200,
        r.resumed_after_s
            .map_or("never".into(), |s| format!("{s:.2} s")),
        errors(r),
        r.sales_per_s_before_failover
            .map_or("-".into(), |s| format!("{s:.0}")),
        markdown_verdict(r)
    )
}

/// The error count with its kinds, most frequent first: what a failover costs differs by
/// kind (a fast 503 `redis_unavailable` against a refused `not_replicated`).
fn errors(r: &StrategyReport) -> String {
    if r.errors == 0 {
        return "0".into();
    }
    let mut kinds: Vec<_> = r.error_kinds.iter().collect();
    kinds.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
    let kinds: Vec<String> = kinds
        .iter()
        .map(|(k, n)| format!("{} {n}", cell(k)))
        .collect();
    format!("{} ({})", r.errors, kinds.join(", "))
}

/// `cluster-table`'s header: its two lines.
pub const CLUSTER_HEADER: [&str; 2] = [
    "| Redis | strategy | items | sales/s | p99 ms | each master's share of commands | verdict |",
    "|---|---|---:|---:|---:|---|---|",
];

/// One row of `cluster-table`: a run on `redis`, whose masters ran `sent` commands each
/// during it.
pub fn cluster_row(redis: &str, sent: &[u64], r: &StrategyReport) -> String {
    let total = sent.iter().sum::<u64>().max(1);
    let shares: Vec<String> = sent
        .iter()
        .map(|n| format!("{:.0}%", 100.0 * *n as f64 / total as f64))
        .collect();
    format!(
        "| {redis} | {} | {} | {:.0} | {:.1} | {} | {} |",
        r.strategy,
        r.items,
        r.sales_per_s,
        r.latency_ms.p99,
        shares.join(" / "),
        markdown_verdict(r)
    )
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
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

    /// A run of `fenced` that sold nothing, its `n` requests all failing with `kind`.
    fn failed(kind: &str, n: usize) -> StrategyReport {
        let results = vec![(0, Outcome::Error(kind.into()), Duration::ZERO); n];
        let mut untouched = audit("001", 0);
        untouched.remaining = 5;
        summarize(
            "fenced".parse().unwrap(),
            5,
            results,
            Duration::from_secs(1),
            &[untouched],
        )
    }

    #[test]
    fn an_inconclusive_run_says_why_under_the_table() {
        let table = render(&[failed("bad_request", 2)]);
        let lines: Vec<&str> = table.lines().collect();
        assert!(lines[2].ends_with("INCONCLUSIVE"), "{table}");
        assert_eq!(
            lines[3],
            "inconclusive: fenced: nothing sold; 2 requests failed (bad_request: 2)"
        );
    }

    /// The cells of a Markdown row, an escaped `|` kept inside its cell.
    fn cells(row: &str) -> usize {
        row.replace("\\|", "").matches('|').count() - 1
    }

    #[test]
    fn an_inconclusive_failover_row_says_why_and_a_bar_in_an_error_kind_ends_no_cell() {
        let row = failover_row(1, &failed("not_replicated", 4));
        assert!(
            row.starts_with("| fenced | 1 | 0 | 0 | never | 4 (not_replicated 4) |"),
            "{row}"
        );
        assert!(
            row.ends_with("| INCONCLUSIVE: nothing sold; 4 requests failed (not_replicated: 4) |"),
            "{row}"
        );
        let header = FAILOVER_HEADER.map(cells);
        assert_eq!(header, [9, 9]);
        assert_eq!(cells(&row), 9, "{row}");
        let row = failover_row(1, &failed("a|b", 4));
        assert_eq!(cells(&row), 9, "{row}");
        let mut safe = failed("x", 4);
        safe.verdict = crate::Verdict::Safe;
        assert!(failover_row(0, &safe).ends_with("| SAFE |"));
    }

    #[test]
    fn a_failover_row_gives_no_rate_over_less_than_a_second() {
        let mut short = report(&[5]);
        short.sales_per_s_before_failover = None;
        short.duration_s = 0.6;
        assert!(
            failover_row(0, &short).ends_with("| - | - | SAFE |"),
            "{}",
            failover_row(0, &short)
        );
        short.sales_per_s_before_failover = Some(990.0);
        short.duration_s = 8.0;
        short.sales_per_s = 700.0;
        assert!(
            failover_row(0, &short).ends_with("| 990 | 700 | SAFE |"),
            "{}",
            failover_row(0, &short)
        );
    }

    #[test]
    fn a_cluster_row_gives_each_masters_share_and_an_inconclusive_one_says_why() {
        let row = cluster_row(
            "cluster, 3 masters",
            &[300, 0, 0],
            &failed("redis_unavailable", 4),
        );
        assert!(
            row.starts_with("| cluster, 3 masters | fenced | 1 | 0 |"),
            "{row}"
        );
        assert!(
            row.ends_with(
                "| 100% / 0% / 0% | INCONCLUSIVE: nothing sold; 4 requests failed (redis_unavailable: 4) |"
            ),
            "{row}"
        );
        assert_eq!(CLUSTER_HEADER.map(cells), [7, 7]);
        assert_eq!(cells(&row), 7, "{row}");
        let row = cluster_row("one node", &[0], &failed("a|b", 4));
        assert!(row.contains("| 0% |"), "no command, no share: {row}");
        assert_eq!(cells(&row), 7, "{row}");
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

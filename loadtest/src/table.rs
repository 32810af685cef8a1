//! The comparison table printed at the end of a run.

use crate::StrategyReport;

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
    }
    out.join("\n")
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

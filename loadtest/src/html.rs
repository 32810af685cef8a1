//! A self-contained HTML report: inline SVG charts, no scripts, nothing fetched, so it opens
//! the same on a machine without a network.

use std::fmt::Write;

use crate::{Plan, StrategyReport, Verdict};

const SAFE: &str = "#2f855a";
const BAD: &str = "#c53030";
const STOCK: &str = "#a0aec0";
/// Neither safe nor oversold: the run proved nothing.
const UNSURE: &str = "#b7791f";

/// The page for `reports`; `timed_s` is a timed run's length (`--duration`), whose requests
/// are as many as the time allowed, not `plan.requests`.
pub fn render(plan: &Plan, reports: &[StrategyReport], timed_s: Option<f64>) -> String {
    let items = reports.iter().map(|r| r.items).max().unwrap_or(1);
    let mut page = String::new();
    let _ = write!(
        page,
        r#"<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>inventory load test</title>
<style>
body {{ font: 15px/1.45 system-ui, sans-serif; margin: 2rem auto; max-width: 980px; color: #1a202c; padding: 0 1rem; }}
h1 {{ font-size: 1.5rem; margin-bottom: .2rem; }} .sub {{ color: #4a5568; margin-top: 0; }}
h2 {{ font-size: 1.1rem; margin-top: 2.2rem; }}
table {{ border-collapse: collapse; width: 100%; font-variant-numeric: tabular-nums; font-size: 13px; }}
th, td {{ padding: .3rem .35rem; border-bottom: 1px solid #e2e8f0; text-align: right; }}
th:first-child, td:first-child {{ text-align: left; }}
.SAFE {{ color: {SAFE}; font-weight: 600; }} .OVERSOLD {{ color: {BAD}; font-weight: 600; }} .INCONCLUSIVE {{ color: {UNSURE}; font-weight: 600; }}
svg text {{ font: 12px system-ui, sans-serif; fill: #2d3748; }}
.legend span {{ display: inline-block; width: .8rem; height: .8rem; margin: 0 .3rem 0 1rem; vertical-align: -1px; }}
</style></head><body>
<h1>inventory load test</h1>
<p class="sub">{what}, {concurrency} at a time,
{work} ms of work inside the lock, through <code>{target}</code>.</p>
"#,
        what = what_was_done(plan, reports, items, timed_s),
        concurrency = plan.concurrency,
        work = plan.work_ms,
        target = escape(&plan.target),
    );

    if timed_s.is_some() {
        // A timed run's stock never runs out: drawn against it, every strategy's sales are a
        // sliver and its lost updates invisible. Drawn against one another instead.
        let _ = write!(
            page,
            r#"<h2>Sales, and the sales lost by overwriting</h2>
<p class="legend"><span style="background:{SAFE}"></span>sold, safe<span style="background:{BAD}"></span>sold, oversold; lost updates</p>
"#
        );
        let max = reports
            .iter()
            .map(|r| r.sold.max(r.lost_updates.max(0) as u64))
            .max()
            .unwrap_or(1)
            .max(1);
        page.push_str(&bars(reports, max as f64, |r| {
            vec![
                (
                    r.sold as f64,
                    verdict_color(r).to_owned(),
                    format!("{} sold", r.sold),
                ),
                (
                    r.lost_updates.max(0) as f64,
                    BAD.to_owned(),
                    format!("{} lost updates", r.lost_updates),
                ),
            ]
        }));
    } else {
        let _ = write!(
            page,
            r#"<h2>Items sold against the stock</h2>
<p class="legend"><span style="background:{STOCK}"></span>stock<span style="background:{SAFE}"></span>sold, safe<span style="background:{BAD}"></span>sold, oversold</p>
"#
        );
        // With many items the stock to hold the sales against is every item's together.
        let total_stock = |r: &StrategyReport| r.stock.max(0) as u64 * r.items.max(1) as u64;
        let max_sold = reports
            .iter()
            .map(|r| r.sold.max(total_stock(r)))
            .max()
            .unwrap_or(1);
        page.push_str(&bars(reports, max_sold as f64, |r| {
            vec![
                (
                    total_stock(r) as f64,
                    STOCK.to_owned(),
                    match r.items {
                        0 | 1 => format!("stock {}", r.stock),
                        n => format!("stock {} ({n} x {})", total_stock(r), r.stock),
                    },
                ),
                (
                    r.sold as f64,
                    verdict_color(r).to_owned(),
                    format!("{} sold", r.sold),
                ),
            ]
        }));
    }

    if items > 1 {
        let _ = write!(
            page,
            r#"<h2>Sales per item</h2>
<p class="legend"><span style="background:{SAFE}"></span>sold, safe<span style="background:{BAD}"></span>sold, oversold<span style="background:{STOCK}"></span>stock</p>
"#
        );
        for r in reports.iter().filter(|r| r.items > 1) {
            page.push_str(&item_bars(r));
        }
    }

    // Requests per second say nothing about how fast a lock sells: a refusal is a request
    // too, and a fast one. Sales per second beside them.
    page.push_str(
        r##"<h2>Throughput (per second)</h2>
<p class="legend"><span style="background:#3182ce"></span>requests<span style="background:#2c7a7b"></span>sales (200s)</p>
"##,
    );
    let max_rps = reports
        .iter()
        .map(|r| r.throughput_rps.max(r.sales_per_s))
        .fold(1.0, f64::max);
    page.push_str(&bars(reports, max_rps, |r| {
        vec![
            (
                r.throughput_rps,
                "#3182ce".to_owned(),
                format!("{:.0} req/s", r.throughput_rps),
            ),
            (
                r.sales_per_s,
                "#2c7a7b".to_owned(),
                format!("{:.0} sales/s", r.sales_per_s),
            ),
        ]
    }));

    page.push_str(
        r##"<h2>Latency (ms)</h2>
<p class="legend"><span style="background:#90cdf4"></span>p50<span style="background:#3182ce"></span>p99<span style="background:#1a365d"></span>max</p>
"##,
    );
    let max_latency = reports.iter().map(|r| r.latency_ms.max).fold(1.0, f64::max);
    page.push_str(&bars(reports, max_latency, |r| {
        vec![
            (
                r.latency_ms.p50,
                "#90cdf4".to_owned(),
                format!("p50 {:.1}", r.latency_ms.p50),
            ),
            (
                r.latency_ms.p99,
                "#3182ce".to_owned(),
                format!("p99 {:.1}", r.latency_ms.p99),
            ),
            (
                r.latency_ms.max,
                "#1a365d".to_owned(),
                format!("max {:.1}", r.latency_ms.max),
            ),
        ]
    }));

    page.push_str(
        "<h2>Numbers</h2>\n<table><tr><th>strategy</th><th>verdict</th><th>requests</th><th>sold</th>\
         <th>sold out</th><th>refused</th><th>errors</th><th>oversold</th><th>lost updates</th>\
         <th>duplicates</th><th>split</th><th>req/s</th><th>sales/s</th><th>p50</th><th>p90</th>\
         <th>p99</th></tr>\n",
    );
    for r in reports {
        let split = r
            .instances
            .iter()
            .map(|(name, n)| format!("{}: {n}", escape(name)))
            .collect::<Vec<_>>()
            .join(", ");
        let verdict = r.verdict;
        // The verdict next to the name: the last of many columns is the first cut off.
        let _ = writeln!(
            page,
            "<tr><td>{}</td><td class=\"{verdict}\">{verdict}</td><td>{}</td><td>{}</td><td>{}</td>\
             <td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{split}</td><td>{:.0}</td>\
             <td>{:.0}</td><td>{:.1}</td><td>{:.1}</td><td>{:.1}</td></tr>",
            escape(&r.strategy),
            r.requests,
            r.sold,
            r.sold_out,
            r.refused,
            r.errors,
            r.oversold,
            r.lost_updates,
            r.duplicates,
            r.throughput_rps,
            r.sales_per_s,
            r.latency_ms.p50,
            r.latency_ms.p90,
            r.latency_ms.p99,
        );
    }
    page.push_str("</table>\n");
    for r in reports {
        if let Some(why) = r.inconclusive() {
            let _ = writeln!(
                page,
                "<p><b>{}</b>: <span class=\"INCONCLUSIVE\">INCONCLUSIVE</span>: {}</p>",
                escape(&r.strategy),
                escape(&why)
            );
        }
    }
    for r in reports.iter().filter(|r| r.disagreement.is_some()) {
        let _ = writeln!(
            page,
            "<p><b>{}</b>: {}</p>",
            escape(&r.strategy),
            escape(r.disagreement.as_deref().unwrap_or_default())
        );
    }
    page.push_str("</body></html>\n");
    page
}

/// The header's account of the run: the requests each strategy made (a timed run's are as
/// many as its time allowed), against which stock.
fn what_was_done(
    plan: &Plan,
    reports: &[StrategyReport],
    items: usize,
    timed_s: Option<f64>,
) -> String {
    let each = match items {
        1 => String::new(),
        n => format!(" on each of {n} items"),
    };
    match timed_s {
        Some(s) => {
            let made: Vec<String> = reports
                .iter()
                .map(|r| format!("{} by {}", r.requests, escape(&r.strategy)))
                .collect();
            format!(
                "Sales requested for {s} s per strategy ({} requests made) against a stock of \
                 {}{each} that a timed run never sells out",
                made.join(", "),
                plan.stock
            )
        }
        None => format!(
            "{} sales requested per strategy against a stock of {}{each}",
            plan.requests, plan.stock
        ),
    }
}

fn verdict_color(r: &StrategyReport) -> &'static str {
    match r.verdict {
        Verdict::Safe => SAFE,
        Verdict::Oversold => BAD,
        Verdict::Inconclusive => UNSURE,
    }
}

/// One strategy's items as vertical bars of their 200s, oversold items red, under a line at
/// the stock. Ten thousand items still fit: a bar is then a fraction of a pixel wide.
fn item_bars(r: &StrategyReport) -> String {
    const WIDTH: f64 = 940.0;
    const HEIGHT: f64 = 120.0;
    const TOP: f64 = 18.0;
    let oversold = r
        .per_item
        .iter()
        .filter(|i| i.verdict == Verdict::Oversold)
        .count();
    let max = r
        .per_item
        .iter()
        .map(|i| i.sold)
        .max()
        .unwrap_or(0)
        .max(r.stock.max(0) as u64)
        .max(1) as f64;
    let slot = WIDTH / r.per_item.len().max(1) as f64;
    let gap = if slot > 4.0 { 1.0 } else { 0.0 };
    let total = HEIGHT + TOP;
    let mut svg = format!(
        r#"<svg width="{WIDTH}" height="{total}" viewBox="0 0 {WIDTH} {total}" style="max-width:100%;height:auto" role="img"><text x="0" y="12">{} - {} items, {oversold} oversold</text>"#,
        escape(&r.strategy),
        r.per_item.len(),
    );
    for (n, item) in r.per_item.iter().enumerate() {
        let h = (item.sold as f64 / max * HEIGHT).max(if item.sold > 0 { 1.0 } else { 0.0 });
        let color = if item.verdict == Verdict::Oversold {
            BAD
        } else {
            SAFE
        };
        let _ = write!(
            svg,
            r#"<rect x="{:.2}" y="{:.1}" width="{:.2}" height="{h:.1}" fill="{color}"><title>{}: {} sold, {} in its ledger, stock {}{}</title></rect>"#,
            n as f64 * slot,
            TOP + HEIGHT - h,
            (slot - gap).max(0.1),
            escape(&item.id),
            item.sold,
            item.audit_sales,
            r.stock,
            if item.verdict == Verdict::Oversold {
                ", OVERSOLD"
            } else {
                ""
            },
        );
    }
    let stock_y = TOP + HEIGHT - r.stock.max(0) as f64 / max * HEIGHT;
    let _ = write!(
        svg,
        r#"<line x1="0" x2="{WIDTH}" y1="{stock_y:.1}" y2="{stock_y:.1}" stroke="{STOCK}" stroke-dasharray="4 3"><title>stock {}</title></line>"#,
        r.stock
    );
    svg.push_str("</svg>\n");
    svg
}

/// Horizontal bars, one group per strategy, one bar per series.
fn bars(
    reports: &[StrategyReport],
    max: f64,
    series: impl Fn(&StrategyReport) -> Vec<(f64, String, String)>,
) -> String {
    const LABEL: f64 = 110.0;
    const WIDTH: f64 = 940.0;
    const BAR: f64 = 14.0;
    let usable = WIDTH - LABEL - 120.0;
    let groups: Vec<_> = reports.iter().map(|r| (r, series(r))).collect();
    let height: f64 = groups
        .iter()
        .map(|(_, s)| s.len() as f64 * (BAR + 2.0) + 10.0)
        .sum();
    let mut svg = format!(
        r#"<svg width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" style="max-width:100%;height:auto" role="img">"#
    );
    let mut y = 0.0;
    for (report, bars) in groups {
        let group_height = bars.len() as f64 * (BAR + 2.0);
        let _ = write!(
            svg,
            r#"<text x="0" y="{:.1}">{}</text>"#,
            y + group_height / 2.0 + 4.0,
            escape(&report.strategy)
        );
        for (value, color, label) in bars {
            let w = if max > 0.0 {
                (value / max * usable).max(1.0)
            } else {
                1.0
            };
            let _ = write!(
                svg,
                r#"<rect x="{LABEL}" y="{y:.1}" width="{w:.1}" height="{BAR}" fill="{color}"><title>{label}</title></rect><text x="{:.1}" y="{:.1}">{}</text>"#,
                LABEL + w + 6.0,
                y + BAR - 3.0,
                escape(&label)
            );
            y += BAR + 2.0;
        }
        y += 10.0;
    }
    svg.push_str("</svg>\n");
    svg
}

pub(crate) fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Latency, StrategyReport};

    fn report(strategy: &str, sold: u64, verdict: Verdict) -> StrategyReport {
        StrategyReport {
            strategy: strategy.into(),
            stock: 10,
            requests: 20,
            sold,
            sold_out: 20 - sold,
            refused: 0,
            refused_kinds: Default::default(),
            errors: 0,
            error_kinds: Default::default(),
            oversold: sold.saturating_sub(10) as i64,
            lost_updates: 0,
            duplicates: 0,
            remaining: 0,
            audit_sales: sold as i64,
            lost_200: 0,
            failover: None,
            resumed_after_s: None,
            sales_per_s_before_failover: None,
            instances: [("app1".to_owned(), sold)].into(),
            duration_s: 1.0,
            throughput_rps: 20.0,
            sales_per_s: sold as f64,
            latency_ms: Latency {
                p50: 1.0,
                p90: 2.0,
                p99: 3.0,
                max: 4.0,
            },
            agrees: true,
            disagreement: None,
            verdict,
            items: 1,
            per_item: Vec::new(),
        }
    }

    #[test]
    fn the_report_draws_every_strategy_and_marks_the_oversold_red() {
        let plan = Plan {
            target: "http://127.0.0.1:8080/<x>".into(),
            strategies: vec![],
            stock: 10,
            requests: 20,
            concurrency: 4,
            work_ms: 0,
            admin_token: None,
        };
        let page = render(
            &plan,
            &[
                report("local", 14, Verdict::Oversold),
                report("fenced", 10, Verdict::Safe),
            ],
            None,
        );
        assert!(page.starts_with("<!doctype html>") && page.ends_with("</html>\n"));
        assert_eq!(
            page.matches("<svg").count(),
            3,
            "sold, throughput and latency charts"
        );
        assert!(page.contains(&format!("fill=\"{BAD}\"><title>14 sold")));
        assert!(page.contains(&format!("fill=\"{SAFE}\"><title>10 sold")));
        assert!(
            page.contains("&lt;x&gt;") && !page.contains("<x>"),
            "the target is escaped"
        );
        assert!(!page.contains("<script"), "no script, nothing fetched");
        assert!(
            !page.contains("Sales per item"),
            "one item: no chart per item"
        );
    }

    /// `--duration 4`: the header said "1000 sales requested per strategy" for runs of
    /// 2239 and 1105 requests, the sales were drawn against a stock of 10^9 (local's lost
    /// updates invisible), and only requests per second were shown.
    #[test]
    fn a_timed_run_says_what_it_did_and_shows_sales_per_second_and_lost_updates() {
        let plan = Plan {
            target: "http://127.0.0.1:8080".into(),
            strategies: vec![],
            stock: Plan::ENDLESS_STOCK,
            requests: 1000,
            concurrency: 32,
            work_ms: 2,
            admin_token: None,
        };
        let mut local = report("local", 20, Verdict::Oversold);
        (local.requests, local.sold) = (2239, 2200);
        (local.lost_updates, local.sales_per_s) = (1118, 550.0);
        let mut fenced = report("fenced", 20, Verdict::Safe);
        (fenced.requests, fenced.sold, fenced.sales_per_s) = (1105, 1100, 275.0);
        let page = render(&plan, &[local, fenced], Some(4.0));
        assert!(!page.contains("1000 sales requested"), "{page}");
        assert!(page.contains("2239 by local, 1105 by fenced"), "{page}");
        assert!(page.contains("for 4 s per strategy"), "{page}");
        assert!(page.contains(&format!("fill=\"{BAD}\"><title>1118 lost updates")));
        assert!(!page.contains("<title>stock 1000000000"), "{page}");
        assert!(page.contains("<title>550 sales/s"), "{page}");
        assert!(page.contains("<th>sales/s</th>"));
        assert!(
            page.contains(r#"<td>local</td><td class="OVERSOLD">OVERSOLD</td>"#),
            "the verdict beside the name: {page}"
        );
    }

    #[test]
    fn an_inconclusive_run_is_neither_green_nor_red_and_says_why() {
        let mut refused = report("fenced", 0, Verdict::Inconclusive);
        (refused.sold_out, refused.errors) = (0, 20);
        refused.error_kinds = [("bad_request".to_owned(), 20)].into();
        let plan = Plan {
            target: "http://127.0.0.1:8080".into(),
            strategies: vec![],
            stock: 10,
            requests: 20,
            concurrency: 4,
            work_ms: 5000,
            admin_token: None,
        };
        let page = render(&plan, &[refused], None);
        assert!(
            page.contains(&format!("fill=\"{UNSURE}\"><title>0 sold")),
            "{page}"
        );
        assert!(page.contains(r#"<td class="INCONCLUSIVE">INCONCLUSIVE</td>"#));
        assert!(
            page.contains("nothing sold; 20 requests failed (bad_request: 20)"),
            "{page}"
        );
    }

    #[test]
    fn many_items_get_a_chart_of_sales_per_item_with_the_oversold_items_red() {
        let item = |id: &str, sold: u64, verdict: Verdict| crate::ItemReport {
            id: id.into(),
            requests: 20,
            sold,
            errors: 0,
            audit_sales: sold as i64,
            remaining: 0,
            oversold: sold.saturating_sub(10) as i64,
            lost_updates: 0,
            duplicates: 0,
            lost_200: 0,
            agrees: true,
            disagreement: None,
            verdict,
        };
        let mut local = report("local", 20, Verdict::Oversold);
        local.items = 2;
        local.per_item = vec![
            item("item-0001", 6, Verdict::Safe),
            item("item-0002", 14, Verdict::Oversold),
        ];
        let mut fenced = report("fenced", 20, Verdict::Safe);
        fenced.items = 2;
        fenced.per_item = vec![
            item("item-0001", 10, Verdict::Safe),
            item("item-0002", 10, Verdict::Safe),
        ];
        let plan = Plan {
            target: "http://127.0.0.1:8080".into(),
            strategies: vec![],
            stock: 10,
            requests: 40,
            concurrency: 4,
            work_ms: 0,
            admin_token: None,
        };
        let page = render(&plan, &[local, fenced], None);
        assert!(page.contains("Sales per item"), "{page}");
        assert!(page.contains("a stock of 10 on each of 2 items"));
        assert_eq!(
            page.matches("<svg").count(),
            5,
            "3 charts + one per strategy"
        );
        assert!(page.contains(&format!(
            "fill=\"{BAD}\"><title>item-0002: 14 sold, 14 in its ledger, stock 10, OVERSOLD"
        )));
        assert_eq!(
            page.matches(&format!("fill=\"{SAFE}\"><title>item-"))
                .count(),
            3,
            "every other item green"
        );
        assert!(page.contains("local - 2 items, 1 oversold"));
        assert!(
            page.contains("<title>stock 20 (2 x 10)</title>"),
            "the items' stock in all"
        );
        assert!(page.contains("fenced - 2 items, 0 oversold"));
    }
}

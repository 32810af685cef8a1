//! `loadtest --items N` through real nginx and two real instances: each item judged by its
//! own audit, the totals the items' sums, and one item the report it always was.

use inventory::lock::Strategy;
use loadtest::{LoadTest, Plan, StrategyReport, Verdict, table};
use testkit::fixture::Stack;

fn plan(stack: &Stack, stock: i64, requests: usize, concurrency: usize, work_ms: u64) -> Plan {
    Plan {
        target: stack.nginx.url(),
        strategies: Vec::new(),
        stock,
        requests,
        concurrency,
        work_ms,
        admin_token: None,
    }
}

async fn run(load: &LoadTest, name: &str) -> StrategyReport {
    let strategy: Strategy = name.parse().unwrap();
    load.run_strategy(strategy, None).await.unwrap()
}

/// The server's own audit of `item`.
async fn audit(stack: &Stack, item: &str) -> serde_json::Value {
    let reply = stack.get(&format!("/inventory/{item}/audit")).await;
    assert_eq!(reply.status, 200, "audit of {item}: {reply:?}");
    reply.body
}

fn ids(n: usize) -> Vec<String> {
    (1..=n).map(|i| format!("item-{i:04}")).collect()
}

/// Every total is the sum of the items' figures.
fn assert_totals_are_the_items_sums(report: &StrategyReport) {
    let sum = |f: fn(&loadtest::ItemReport) -> i64| report.per_item.iter().map(f).sum::<i64>();
    assert_eq!(report.sold as i64, sum(|i| i.sold as i64), "{report:#?}");
    assert_eq!(report.requests as i64, sum(|i| i.requests as i64));
    assert_eq!(report.errors as i64, sum(|i| i.errors as i64));
    assert_eq!(report.audit_sales, sum(|i| i.audit_sales));
    assert_eq!(report.remaining, sum(|i| i.remaining));
    assert_eq!(report.oversold, sum(|i| i.oversold));
    assert_eq!(report.lost_updates, sum(|i| i.lost_updates));
    assert_eq!(report.duplicates as i64, sum(|i| i.duplicates as i64));
    assert_eq!(report.lost_200, sum(|i| i.lost_200));
}

#[tokio::test(flavor = "multi_thread")]
async fn over_eight_items_fenced_and_atomic_sell_every_item_exactly_its_stock_through_nginx() {
    let stack = Stack::start(|b| b).await;
    let load = LoadTest::new(plan(&stack, 5, 8 * 15, 16, 1))
        .unwrap()
        .with_items(8)
        .unwrap();
    for name in ["fenced", "atomic"] {
        let report = run(&load, name).await;
        assert_eq!(report.verdict, Verdict::Safe, "{name}: {report:#?}");
        assert_eq!(report.items, 8);
        let seen: Vec<&str> = report.per_item.iter().map(|i| i.id.as_str()).collect();
        assert_eq!(seen, ids(8), "{name}");
        assert_eq!(
            (
                report.sold,
                report.sold_out,
                report.errors,
                report.remaining
            ),
            (40, 80, 0, 0),
            "{name}: {report:#?}"
        );
        assert_totals_are_the_items_sums(&report);
        assert!(report.agrees, "{name}: {report:#?}");
        for item in &report.per_item {
            assert_eq!(
                (item.requests, item.sold, item.audit_sales, item.remaining),
                (15, 5, 5, 0),
                "{name}: each item gets its share and sells exactly its stock: {item:#?}"
            );
            assert_eq!(item.verdict, Verdict::Safe, "{name}: {item:#?}");
            assert!(item.agrees, "{name}: {item:#?}");
            let server = audit(&stack, &item.id).await;
            assert_eq!(server["clean"], true, "{name} {}: {server}", item.id);
            assert_eq!(server["sales"].as_u64(), Some(item.sold), "{server}");
        }
        // What `--json` prints names every item, and reads back the same.
        let line = serde_json::to_string(&report).unwrap();
        let json: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(json["items"], 8);
        let listed: Vec<&str> = json["per_item"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i["id"].as_str().unwrap())
            .collect();
        assert_eq!(listed, ids(8));
        assert_eq!(
            serde_json::from_str::<StrategyReport>(&line).unwrap(),
            report
        );
        assert!(
            table::render(std::slice::from_ref(&report))
                .contains("8 items of stock 5 each, sold per item min 5 / max 5; none oversold"),
            "{name}"
        );
    }
    // The default item was never even stocked: the items are items of their own.
    let default = stack.get("/inventory/audit").await;
    assert_eq!(
        (default.status, default.error_code()),
        (404, "unknown_item"),
        "{default:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn over_eight_items_local_oversells_some_item_and_the_strategy_is_oversold() {
    let stack = Stack::start(|b| b).await;
    // 10 ms inside each instance's own mutex, four sales in flight per item on average: two
    // instances sell the same item at once.
    let load = LoadTest::new(plan(&stack, 5, 8 * 20, 32, 10))
        .unwrap()
        .with_items(8)
        .unwrap();
    let report = run(&load, "local").await;
    assert_eq!(report.verdict, Verdict::Oversold, "{report:#?}");
    assert!(
        !report.is_unexpected_oversell(),
        "local is meant to oversell"
    );
    assert_eq!(
        report.instances.len(),
        2,
        "both instances sold: {report:#?}"
    );
    assert_totals_are_the_items_sums(&report);
    let oversold: Vec<&loadtest::ItemReport> = report
        .per_item
        .iter()
        .filter(|i| i.verdict == Verdict::Oversold)
        .collect();
    assert!(!oversold.is_empty(), "{report:#?}");
    for item in &report.per_item {
        let server = audit(&stack, &item.id).await;
        assert_eq!(server["sales"].as_i64(), Some(item.audit_sales), "{server}");
        assert_eq!(server["oversold"].as_i64(), Some(item.oversold), "{server}");
        assert_eq!(server["clean"] == false, item.verdict == Verdict::Oversold);
    }
    let table = table::render(std::slice::from_ref(&report));
    let line = table
        .lines()
        .find(|l| l.starts_with("items: local"))
        .unwrap();
    assert!(
        line.contains(&format!("oversold: {} of 8", oversold.len())),
        "{table}"
    );
    for item in oversold.iter().take(10) {
        assert!(line.contains(&item.id), "{table}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn one_item_sells_the_default_item_with_the_figures_and_fields_of_before() {
    let stack = Stack::start(|b| b).await;
    let without = LoadTest::new(plan(&stack, 10, 30, 8, 1)).unwrap();
    let with_one = LoadTest::new(plan(&stack, 10, 30, 8, 1))
        .unwrap()
        .with_items(1)
        .unwrap();
    for load in [&without, &with_one] {
        let report = run(load, "fenced").await;
        assert_eq!(report.verdict, Verdict::Safe, "{report:#?}");
        assert_eq!(
            (
                report.sold,
                report.sold_out,
                report.remaining,
                report.audit_sales
            ),
            (10, 20, 0, 10),
            "{report:#?}"
        );
        // The default item, on the paths without an id.
        let default = stack.get("/inventory/audit").await.body;
        assert_eq!(default["sales"], 10, "{default}");
        let never = stack.get("/inventory/item-0001/audit").await;
        assert_eq!(never.status, 404, "no item of its own: {never:?}");
        assert_eq!(report.items, 1);
        let [item] = report.per_item.as_slice() else {
            panic!("{report:#?}")
        };
        assert_eq!(item.id, default["item"].as_str().unwrap());
        assert_eq!(
            (item.sold, item.audit_sales, item.remaining, item.verdict),
            (
                report.sold,
                report.audit_sales,
                report.remaining,
                report.verdict
            )
        );
        // Every field of before, in the order of before, then the two new ones.
        let line = serde_json::to_string(&report).unwrap();
        let json: serde_json::Map<String, serde_json::Value> = serde_json::from_str(&line).unwrap();
        let mut fields: Vec<&str> = json.keys().map(String::as_str).collect();
        fields.sort_unstable();
        let mut before = vec![
            "strategy",
            "stock",
            "requests",
            "sold",
            "sold_out",
            "refused",
            // Added with stock_changed counted as a refusal: which refusals, by kind.
            "refused_kinds",
            "errors",
            "error_kinds",
            "oversold",
            "lost_updates",
            "duplicates",
            "remaining",
            "audit_sales",
            "lost_200",
            "instances",
            "duration_s",
            "throughput_rps",
            "sales_per_s",
            "latency_ms",
            "agrees",
            "verdict",
            "items",
            "per_item",
        ];
        before.sort_unstable();
        assert_eq!(fields, before, "{line}");
        assert!(
            line.contains(r#""verdict":"SAFE","items":1,"per_item":[{"#),
            "{line}"
        );
        let table = table::render(std::slice::from_ref(&report));
        assert_eq!(table.lines().count(), 3, "the table of before: {table}");
    }
}

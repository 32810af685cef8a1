//! Pages in a real browser: Debian's Chromium, headless, driven through chromedriver. Swagger
//! UI's "Try it out" and "Execute" on the sale put the sale in Redis; the scenarios' page shows
//! a picture for every row.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use fantoccini::{ClientBuilder, Locator};
use nix::sys::signal::Signal;
use serde_json::json;
use testkit::fixture::Cluster;
use testkit::{DEFAULT_GRACE, ProcessGroup};
use tokio::process::Command;

use crate::harness::free_port;

/// chromedriver and the Chromium it starts, in one process group: a test that panics with a
/// session open still leaves no browser behind.
struct ChromeDriver {
    _process: ProcessGroup,
    port: u16,
}

impl ChromeDriver {
    async fn start() -> Self {
        let driver = ["/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver"]
            .into_iter()
            .find(|p| std::path::Path::new(p).exists())
            .expect("chromedriver is not installed (`make test` installs chromium-driver)");
        let port = free_port();
        let mut command = Command::new(driver);
        command
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let process = ProcessGroup::spawn(&mut command, Signal::SIGTERM, DEFAULT_GRACE)
            .expect("run chromedriver");
        let status = format!("http://127.0.0.1:{port}/status");
        for _ in 0..200 {
            if reqwest::get(&status)
                .await
                .is_ok_and(|r| r.status().is_success())
            {
                return Self {
                    _process: process,
                    port,
                };
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("chromedriver did not start on port {port}");
    }
}

/// Headless Chromium through `driver`, with its profile in `profile`.
async fn headless(driver: &ChromeDriver, profile: &Path) -> fantoccini::Client {
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".into(),
        json!({
            "binary": "/usr/bin/chromium",
            "args": [
                "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-quic", "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--window-size=1280,2000",
                format!("--user-data-dir={}", profile.display()),
            ]
        }),
    );
    let connector = hyper_util::client::legacy::connect::HttpConnector::new();
    ClientBuilder::new(connector)
        .capabilities(caps)
        .connect(&format!("http://127.0.0.1:{}", driver.port))
        .await
        .expect("start headless chromium")
}

#[tokio::test(flavor = "multi_thread")]
async fn swagger_ui_try_it_out_sells_an_item() {
    let cluster = Cluster::start(1, |b| b).await;
    let app = &cluster.instances[0];
    app.reset(3).await;
    let driver = ChromeDriver::start().await;
    let profile = tempfile::tempdir().unwrap();
    let browser = headless(&driver, profile.path()).await;

    let outcome = async {
        browser.goto(&app.url("/swagger-ui/")).await?;
        let operation = browser
            .wait()
            .at_most(Duration::from_secs(20))
            .for_element(Locator::Css("#operations-sale-sale"))
            .await?;
        let summary = operation.find(Locator::Css(".opblock-summary")).await?;
        assert!(
            summary.text().await?.contains("/inventory/sale"),
            "the sale operation is listed"
        );
        summary.click().await?;
        browser
            .wait()
            .for_element(Locator::Css("#operations-sale-sale .try-out__btn"))
            .await?
            .click()
            .await?;
        browser
            .wait()
            .for_element(Locator::Css("#operations-sale-sale .execute"))
            .await?
            .click()
            .await?;
        let status = browser
            .wait()
            .at_most(Duration::from_secs(20))
            .for_element(Locator::Css(
                "#operations-sale-sale .live-responses-table tr.response .response-col_status",
            ))
            .await?
            .text()
            .await?;
        Ok::<_, fantoccini::error::CmdError>(status)
    }
    .await;
    let _ = browser.close().await;
    let status = outcome.expect("drive Swagger UI");
    assert_eq!(status.trim(), "200", "Swagger UI shows the sale's status");

    let audit = app.audit().await;
    assert_eq!(
        (audit["sales"].as_i64(), audit["remaining"].as_i64()),
        (Some(1), Some(2)),
        "{audit}"
    );
}

/// The item paths in Swagger UI: "Try it out" on `POST /inventory/{item}/sale`, with the item
/// typed into its field, sells that item and leaves the default item alone.
#[tokio::test(flavor = "multi_thread")]
async fn swagger_ui_try_it_out_sells_the_item_typed_into_the_path() {
    let cluster = Cluster::start(1, |b| b).await;
    let app = &cluster.instances[0];
    app.reset(3).await;
    let stocked = app
        .send(
            reqwest::Client::new()
                .put(app.url("/inventory/sku-7"))
                .header("content-type", "application/json")
                .body(r#"{"stock": 5}"#),
        )
        .await;
    assert_eq!(stocked.status, 200, "{stocked:?}");
    let driver = ChromeDriver::start().await;
    let profile = tempfile::tempdir().unwrap();
    let browser = headless(&driver, profile.path()).await;

    let op = "#operations-sale-item_sale";
    let outcome = async {
        browser.goto(&app.url("/swagger-ui/")).await?;
        let operation = browser
            .wait()
            .at_most(Duration::from_secs(20))
            .for_element(Locator::Css(op))
            .await?;
        let summary = operation.find(Locator::Css(".opblock-summary")).await?;
        assert!(
            summary.text().await?.contains("/inventory/{item}/sale"),
            "the item sale is listed"
        );
        summary.click().await?;
        browser
            .wait()
            .for_element(Locator::Css(&format!("{op} .try-out__btn")))
            .await?
            .click()
            .await?;
        let field = browser
            .wait()
            .for_element(Locator::Css(&format!(
                "{op} tr[data-param-name=\"item\"] input"
            )))
            .await?;
        field.clear().await?;
        field.send_keys("sku-7").await?;
        browser
            .wait()
            .for_element(Locator::Css(&format!("{op} .execute")))
            .await?
            .click()
            .await?;
        let status = browser
            .wait()
            .at_most(Duration::from_secs(20))
            .for_element(Locator::Css(&format!(
                "{op} .live-responses-table tr.response .response-col_status"
            )))
            .await?
            .text()
            .await?;
        Ok::<_, fantoccini::error::CmdError>(status)
    }
    .await;
    let _ = browser.close().await;
    let status = outcome.expect("drive Swagger UI");
    assert_eq!(
        status.trim(),
        "200",
        "Swagger UI shows the item sale's status"
    );

    let item = app.get("/inventory/sku-7/audit").await.body;
    assert_eq!(
        (item["sales"].as_i64(), item["remaining"].as_i64()),
        (Some(1), Some(4)),
        "{item}"
    );
    let default = app.audit().await;
    assert_eq!(default["sales"].as_i64(), Some(0), "{default}");
}

/// Every scenario row, run for real, rendered by `scenarios --report`'s page and opened from
/// disk (nothing fetched): each row is there with its picture, lanes and bars drawn.
#[tokio::test(flavor = "multi_thread")]
async fn the_scenarios_page_shows_every_rows_picture_in_chromium() {
    let bin = Path::new(env!("CARGO_BIN_EXE_inventory"));
    let mut runs = Vec::new();
    for row in loadtest::scenarios::rows() {
        runs.push(loadtest::scenarios::run_bounded(row, bin, 3).await.unwrap());
    }
    let dir = tempfile::tempdir().unwrap();
    let page = dir.path().join("scenarios.html");
    std::fs::write(&page, loadtest::picture::page(&runs)).unwrap();

    let driver = ChromeDriver::start().await;
    let profile = tempfile::tempdir().unwrap();
    let browser = headless(&driver, profile.path()).await;
    let outcome = async {
        browser.goto(&format!("file://{}", page.display())).await?;
        let mut seen = Vec::new();
        for section in browser.find_all(Locator::Css("section.row")).await? {
            let row = format!(
                "{}/{}",
                section.attr("data-scenario").await?.unwrap_or_default(),
                section.attr("data-strategy").await?.unwrap_or_default()
            );
            let picture = section.find(Locator::Css("svg.picture")).await?;
            let (_, _, width, height) = picture.rectangle().await?;
            let lanes = picture.find_all(Locator::Css("g.lane")).await?.len();
            let bars = picture
                .find_all(Locator::Css(
                    "rect.hold, rect.lease, rect.unlocked, rect.mark",
                ))
                .await?
                .len();
            seen.push((row, width, height, lanes, bars));
        }
        Ok::<_, fantoccini::error::CmdError>(seen)
    }
    .await;
    let _ = browser.close().await;
    let seen = outcome.expect("open the scenarios' page");
    let expected: Vec<String> = runs
        .iter()
        .map(|r| format!("{}/{}", r.scenario, r.label()))
        .collect();
    let rows: Vec<String> = seen.iter().map(|s| s.0.clone()).collect();
    assert_eq!(rows, expected, "one section per row, in order");
    for (row, width, height, lanes, bars) in &seen {
        assert!(
            *width > 500.0 && *height > 100.0,
            "{row}: picture drawn {width}x{height}"
        );
        assert!(*lanes >= 2, "{row}: {lanes} lanes");
        assert!(*bars >= 1, "{row}: nothing drawn on the lanes");
    }
}

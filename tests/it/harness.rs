//! What only the integration tests need beside [`testkit`]: a port that panics when there is
//! none, and paths into the repository. The processes themselves (`redis-server`,
//! `inventory`, nginx, each in a process group of its own and stopped with it, also when a
//! test panics) come from `testkit::fixture`, the same crate the fault scenarios, the load
//! test and the benchmarks start theirs with; `tests/it/leaks.rs` looks for anything left.

use std::path::{Path, PathBuf};

use redis::aio::MultiplexedConnection;

pub fn free_port() -> u16 {
    testkit::free_port().expect("no free port on 127.0.0.1")
}

pub fn repo_path(relative: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(relative)
}

/// Scripts Redis has run so far (`EVALSHA` calls, from `INFO commandstats`).
pub async fn scripts_run(c: &mut MultiplexedConnection) -> u64 {
    let stats: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(c)
        .await
        .unwrap();
    stats
        .lines()
        .find_map(|line| line.strip_prefix("cmdstat_evalsha:calls="))
        .and_then(|rest| rest.split(',').next())
        .and_then(|calls| calls.parse().ok())
        .unwrap_or(0)
}

/// Waits until `app` logs one more `stock read` than `before`: the sale has read the stock.
pub async fn until_stock_read(app: &testkit::fixture::Instance, before: usize) {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
    while app.log().matches("stock read").count() <= before {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the sale never read the stock"
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}

/// Starts `inventory` with nothing but `env` (and a free port on loopback), as a setting it
/// must refuse would: whether it exited successfully, and all it printed; within 20 s, or
/// the start-up hung.
pub async fn start_with_only(env: &[(&str, &str)]) -> (bool, String) {
    let out = tokio::time::timeout(
        std::time::Duration::from_secs(20),
        tokio::process::Command::new(env!("CARGO_BIN_EXE_inventory"))
            .env_clear()
            .env("PORT", free_port().to_string())
            .env("BIND_ADDR", "127.0.0.1")
            .envs(env.iter().copied())
            // One that starts after all (the setting was not refused) must not outlive the
            // test: without this it ran on, orphaned, after the timeout below.
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("a refused setting stops the start-up, it does not hang")
    .expect("inventory runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// `host:port` of an instance, for a raw TCP client that writes its own requests.
pub fn host_port(app: &testkit::fixture::Instance) -> String {
    app.url("")
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_owned()
}

/// Whether each lock node `/ready` lists is ok, in order.
pub fn node_states(ready: &serde_json::Value) -> Vec<bool> {
    ready["lock_nodes"]
        .as_array()
        .map(|nodes| nodes.iter().map(|n| n["ok"] == true).collect())
        .unwrap_or_default()
}

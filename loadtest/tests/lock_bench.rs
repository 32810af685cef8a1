//! The lock bench's correctness half, as a test: a short run of real client processes
//! against a real `redis-server` loses no update and times out nowhere. Speed is the
//! bench's business (`make bench-lock`), never asserted here.

use std::process::Command;

/// `lock-bench --check` with `args`: one JSON object per run, once it exited successfully.
fn lock_bench(args: &[&str]) -> Vec<serde_json::Value> {
    let output = Command::new(env!("CARGO_BIN_EXE_lock-bench"))
        .arg("--check")
        .args(args)
        .output()
        .expect("lock-bench runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    stdout
        .lines()
        .map(|line| serde_json::from_str(line).expect("one JSON object per line"))
        .collect()
}

#[test]
fn a_short_bench_loses_no_update_and_never_times_out() {
    let runs = lock_bench(&[
        "--clients",
        "4",
        "--duration",
        "2",
        "--wait-budget",
        "10",
        "--contenders",
        "rslock,lua-release/notify,fenced/notify,reentrant/notify,lua-release/spin",
    ]);
    assert_eq!(runs.len(), 5, "{runs:?}");
    for run in &runs {
        assert_eq!(run["lost_updates"], 0, "{run}");
        assert_eq!(run["timeouts"], 0, "{run}");
        assert!(run["ops"].as_u64().unwrap_or(0) > 0, "{run}");
    }
}

/// Clients with two worker threads (one, the default, on this machine's two cores) run the
/// same loop, and every line says what a critical section cost in CPU, on the clients'
/// side and on Redis's.
#[test]
fn two_thread_clients_run_the_same_loop_and_the_cpu_per_critical_section_is_reported() {
    let runs = lock_bench(&[
        "--clients",
        "2",
        "--duration",
        "1",
        "--client-threads",
        "2",
        "--contenders",
        "rslock,lua-release/notify",
    ]);
    assert_eq!(runs.len(), 2, "{runs:?}");
    for run in &runs {
        assert_eq!(run["lost_updates"], 0, "{run}");
        assert!(
            run["client_cpu_us_per_cs"].as_f64().unwrap_or(0.0) > 0.0,
            "{run}"
        );
        assert!(
            run["redis_cpu_us_per_cs"].as_f64().unwrap_or(0.0) > 0.0,
            "{run}"
        );
    }
}

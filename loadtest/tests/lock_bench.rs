//! The lock bench as a user runs it: a short run of real client processes against a real
//! `redis-server` loses no update and times out nowhere (speed is the bench's business,
//! `make bench-lock`, never asserted here), wrong values are usage errors, and the clients
//! die with the bench.

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

/// Wrong values are usage errors (exit status 2, as in the other tools), naming what is
/// valid, before Redis or a client starts: they exited 1, as a failed bench does.
#[test]
fn wrong_values_exit_2_naming_the_valid_ones() {
    for (args, valid) in [
        (
            &["--contenders", "bogus"][..],
            "expected rslock or <strategy>/<wait>, <wait> one of notify, pubsub, spin",
        ),
        (
            &["--duration", "0"],
            "valid: a number of seconds above 0, at most 86400 (a day)",
        ),
        (
            &["--wait-budget", "nan"],
            "valid: a number of seconds above 0, at most 86400 (a day)",
        ),
    ] {
        let output = Command::new(env!("CARGO_BIN_EXE_lock-bench"))
            .args(args)
            .output()
            .expect("lock-bench runs");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(
            stderr.contains(args[0]) && stderr.contains(valid),
            "{args:?}: {stderr}"
        );
        assert!(output.stdout.is_empty(), "{args:?}: a run was begun");
    }
}

/// A client process of one bench: its pid, and its command line to tell it from a process
/// that took the pid over once it is gone.
struct Client {
    pid: u32,
    cmdline: Vec<u8>,
}

impl Client {
    fn cmdline(pid: u32) -> Option<Vec<u8>> {
        std::fs::read(format!("/proc/{pid}/cmdline")).ok()
    }

    /// Still running: neither gone nor a zombie, and still the same program.
    fn alive(&self) -> bool {
        testkit::ProcStat::read(self.pid).is_some_and(|p| !p.is_zombie())
            && Self::cmdline(self.pid).as_ref() == Some(&self.cmdline)
    }
}

/// What a failed test would leave running for its `--duration`: killed by pid, the clients
/// it found only.
struct Clients(Vec<Client>);

impl Drop for Clients {
    fn drop(&mut self) {
        for client in self.0.iter().filter(|c| c.alive()) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(client.pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}

/// The `lock-bench child` processes whose parent is `parent`.
fn clients_of(parent: u32) -> Vec<Client> {
    testkit::ProcStat::all()
        .into_iter()
        .filter(|p| p.ppid == parent && !p.is_zombie())
        .filter_map(|p| {
            let cmdline = Client::cmdline(p.pid)?;
            let child = cmdline.split(|&b| b == 0).nth(1) == Some(b"child");
            child.then_some(Client {
                pid: p.pid,
                cmdline,
            })
        })
        .collect()
}

/// The clients die with the bench however it dies: a signal to the bench's pid alone (no
/// terminal's group-wide Ctrl-C), caught or not, runs none of its `Drop`s. They used to run
/// out their `--duration`, adopted by init.
#[test]
fn the_clients_die_with_the_bench_however_it_dies() {
    use nix::sys::signal::Signal;
    use std::time::{Duration, Instant};
    for signal in [Signal::SIGTERM, Signal::SIGINT, Signal::SIGKILL] {
        let mut bench = Command::new(env!("CARGO_BIN_EXE_lock-bench"))
            .args(["--contenders", "fenced/notify", "--clients", "3"])
            .args(["--duration", "300", "--client-threads", "1"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("lock-bench runs");
        let pid = bench.id();
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut clients = Clients(clients_of(pid));
        while clients.0.len() < 3 {
            assert!(
                Instant::now() < deadline,
                "{signal}: the bench never started its 3 clients"
            );
            std::thread::sleep(Duration::from_millis(50));
            clients = Clients(clients_of(pid));
        }
        // Into the run: a client still connecting fails by itself once Redis is swept
        // with the bench, while one in its loop went on without Redis.
        std::thread::sleep(Duration::from_secs(2));
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), signal)
            .expect("the bench is signalled");
        bench.wait().expect("the bench is reaped");
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let left: Vec<u32> = clients
                .0
                .iter()
                .filter(|c| c.alive())
                .map(|c| c.pid)
                .collect();
            if left.is_empty() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{signal}: clients {left:?} outlived the bench"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

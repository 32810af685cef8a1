//! The command-line tools as a user runs them: real `loadtest`, `scenarios`, `failover-table`
//! and `cluster-table` processes against a real `redis-server`, `inventory` instance and nginx,
//! with their exit statuses and what they print.

// A panic is how a test reports a failure.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

use nix::sys::signal::Signal;
use serde_json::Value;
use testkit::fixture::{Instance, InstanceBuilder, RedisServer};
use tokio::process::Command;

async fn run(bin: &str, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(bin);
    command.args(args);
    // The tests' own environment must not choose a target or a token for them.
    for var in ["LOADTEST_TARGET", "ADMIN_TOKEN", "REDIS_MASTER_NAME"] {
        command.env_remove(var);
    }
    command.envs(env.iter().copied());
    tokio::time::timeout(Duration::from_secs(120), command.output())
        .await
        .expect("the tool ends within two minutes")
        .expect("the tool runs")
}

/// loadtest's exit status for a usage error (sysexits' `EX_USAGE`): 2 means an oversell.
const USAGE: i32 = 64;

async fn loadtest(args: &[&str]) -> Output {
    run(env!("CARGO_BIN_EXE_loadtest"), args, &[]).await
}

fn text(output: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

fn json_lines(stdout: &str) -> Vec<Value> {
    stdout
        .lines()
        .map(|line| serde_json::from_str(line).expect("one JSON object per line"))
        .collect()
}

async fn instance() -> (RedisServer, Instance) {
    let redis = RedisServer::start().await;
    let app = InstanceBuilder::new(&redis, "app1").start().await;
    (redis, app)
}

fn target(app: &Instance) -> String {
    format!("http://127.0.0.1:{}", app.port)
}

#[tokio::test]
async fn health_refuses_options_it_would_ignore_before_sending_anything() {
    // Whatever connects here was sent something; the refusal must come first.
    let witness = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    witness.set_nonblocking(true).unwrap();
    let to = format!("http://127.0.0.1:{}", witness.local_addr().unwrap().port());
    let report = std::env::temp_dir().join(format!("health-{}.html", std::process::id()));
    let output = loadtest(&[
        "--health",
        "--target",
        &to,
        "--duration",
        "0.2",
        "--report",
        report.to_str().unwrap(),
        "--requests",
        "5",
        "--items",
        "3",
        "--stock",
        "4",
        "--work-ms",
        "1",
    ])
    .await;
    let (stdout, stderr) = text(&output);
    assert_eq!(output.status.code(), Some(USAGE), "{stdout}\n{stderr}");
    assert!(
        stderr.contains(
            "--health measures GET /health only and cannot be combined with \
             --stock, --requests, --items, --work-ms, --report; \
             with --health, give only --target, --duration, --concurrency, --json"
        ),
        "{stderr}"
    );
    assert!(
        matches!(witness.accept(), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "a request was sent"
    );
    assert!(!report.exists(), "a report was written");
}

#[tokio::test]
async fn health_runs_with_its_own_options_and_a_token_from_the_environment() {
    let (_redis, app) = instance().await;
    let to = target(&app);
    let args = [
        "--health",
        "--target",
        &to,
        "--duration",
        "0.3",
        "--concurrency",
        "2",
        "--json",
    ];
    // The environment serves the sales runs of the same shell: not a conflict.
    let output = run(
        env!("CARGO_BIN_EXE_loadtest"),
        &args,
        &[("ADMIN_TOKEN", "secret"), ("REDIS_MASTER_NAME", "m")],
    )
    .await;
    let (stdout, stderr) = text(&output);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    let lines = json_lines(&stdout);
    assert_eq!(lines.len(), 1, "{stdout}");
    // `requests` counts the 200s only. Errors are not asserted: a request still out when
    // the 0.3 s end, on a loaded machine, may miss its one second of grace.
    assert!(lines[0]["requests"].as_u64().unwrap() > 0, "{stdout}");
}

#[tokio::test]
async fn a_strategy_named_twice_by_its_alias_runs_once_and_says_so() {
    let (_redis, app) = instance().await;
    let to = target(&app);
    let output = loadtest(&[
        "--target",
        &to,
        "--strategy",
        "v8,watchdog,V8",
        "--stock",
        "3",
        "--requests",
        "6",
        "--concurrency",
        "2",
        "--json",
    ])
    .await;
    let (stdout, stderr) = text(&output);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    let lines = json_lines(&stdout);
    let ran: Vec<&str> = lines
        .iter()
        .map(|l| l["strategy"].as_str().unwrap())
        .collect();
    assert_eq!(ran, ["watchdog"], "{stdout}");
    assert_eq!(
        (lines[0]["sold"].as_u64(), lines[0]["requests"].as_u64()),
        (Some(3), Some(6))
    );
    assert!(
        stderr.contains("--strategy names watchdog 3 times (v8, watchdog, V8); it runs once"),
        "{stderr}"
    );

    // A run shorter than one request tried nothing: not SAFE, and not a success.
    let output = loadtest(&[
        "--target",
        &to,
        "--strategy",
        "fenced",
        "--duration",
        "0.000001",
        "--json",
    ])
    .await;
    let (stdout, stderr) = text(&output);
    assert_eq!(output.status.code(), Some(3), "{stdout}\n{stderr}");
    let line = &json_lines(&stdout)[0];
    assert_eq!(
        (line["requests"].as_u64(), line["verdict"].as_str()),
        (Some(0), Some("INCONCLUSIVE")),
        "{stdout}"
    );
}

/// nginx serving the instance at `/shop/` only, logging every request line it gets.
struct PrefixProxy {
    _nginx: testkit::ProcessGroup,
    port: u16,
    dir: PathBuf,
}

impl PrefixProxy {
    async fn start(upstream: u16) -> Self {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("prefix-nginx-{}-{upstream}", std::process::id()));
        std::fs::create_dir_all(dir.join("tmp")).unwrap();
        let port = testkit::free_port().unwrap();
        let d = dir.display();
        let conf = format!(
            "worker_processes 1;\n\
             pid {d}/nginx.pid;\n\
             events {{ worker_connections 256; }}\n\
             http {{\n\
               log_format line '$request';\n\
               access_log {d}/access.log line;\n\
               client_body_temp_path {d}/tmp/body; proxy_temp_path {d}/tmp/proxy;\n\
               fastcgi_temp_path {d}/tmp/fcgi; uwsgi_temp_path {d}/tmp/uwsgi;\n\
               scgi_temp_path {d}/tmp/scgi;\n\
               server {{\n\
                 listen 127.0.0.1:{port};\n\
                 location /shop/ {{\n\
                   proxy_pass http://127.0.0.1:{upstream}/;\n\
                   proxy_http_version 1.1;\n\
                   proxy_set_header Connection \"\";\n\
                 }}\n\
                 location / {{ return 404; }}\n\
               }}\n\
             }}\n"
        );
        std::fs::write(dir.join("nginx.conf"), conf).unwrap();
        let mut command = Command::new("/usr/sbin/nginx");
        command
            .arg("-e")
            .arg(dir.join("error.log"))
            .arg("-p")
            .arg(&dir)
            .arg("-c")
            .arg(dir.join("nginx.conf"))
            // In the foreground, so that it stays in the group that is stopped on drop.
            .args(["-g", "daemon off;"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        let nginx =
            testkit::ProcessGroup::spawn(&mut command, Signal::SIGQUIT, testkit::DEFAULT_GRACE)
                .unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_err()
        {
            assert!(
                tokio::time::Instant::now() < deadline,
                "nginx did not start: {}",
                std::fs::read_to_string(dir.join("error.log")).unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Self {
            _nginx: nginx,
            port,
            dir,
        }
    }

    /// The request lines so far (`POST /shop/inventory/sale?... HTTP/1.1`).
    fn requests(&self) -> Vec<String> {
        std::fs::read_to_string(self.dir.join("access.log"))
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }
}

impl Drop for PrefixProxy {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[tokio::test]
async fn a_target_with_a_prefix_sends_every_request_under_it_and_an_unclear_path_is_refused() {
    let (_redis, app) = instance().await;
    let proxy = PrefixProxy::start(app.port).await;
    let to = format!("http://127.0.0.1:{}/shop/", proxy.port);
    let output = loadtest(&[
        "--target",
        &to,
        "--strategy",
        "atomic",
        "--items",
        "2",
        "--stock",
        "2",
        "--requests",
        "8",
        "--concurrency",
        "2",
        "--json",
    ])
    .await;
    let (stdout, stderr) = text(&output);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    let line = &json_lines(&stdout)[0];
    assert_eq!(
        (line["sold"].as_u64(), line["sold_out"].as_u64()),
        (Some(4), Some(4)),
        "{line}"
    );
    assert_eq!(line["verdict"], "SAFE", "{line}");
    let health = loadtest(&["--health", "--target", &to, "--duration", "0.2", "--json"]).await;
    let (stdout, stderr) = text(&health);
    assert!(health.status.success(), "{stdout}\n{stderr}");
    // 200s only: /health reached under the prefix.
    assert!(
        json_lines(&stdout)[0]["requests"].as_u64().unwrap() > 0,
        "{stdout}"
    );

    let seen = proxy.requests();
    for (what, start) in [
        ("resets", "PUT /shop/inventory/item-"),
        ("sales", "POST /shop/inventory/item-"),
        ("audits", "GET /shop/inventory/item-"),
        ("health", "GET /shop/health "),
    ] {
        assert!(
            seen.iter().any(|l| l.starts_with(start)),
            "no {what}: {seen:#?}"
        );
    }
    let outside: Vec<&String> = seen
        .iter()
        .filter(|l| !l.split(' ').nth(1).is_some_and(|p| p.starts_with("/shop/")))
        .collect();
    assert!(outside.is_empty(), "sent outside the prefix: {outside:#?}");

    // A fragment would reach hyper's sales and reqwest's resets as different paths.
    let before = proxy.requests().len();
    for unclear in ["/shop#top", "/a/../shop"] {
        let to = format!("http://127.0.0.1:{}{unclear}", proxy.port);
        let output = loadtest(&["--target", &to, "--requests", "2", "--strategy", "atomic"]).await;
        let (stdout, stderr) = text(&output);
        // A usage error, as a wrong value of any other option is.
        assert_eq!(output.status.code(), Some(USAGE), "{stdout}\n{stderr}");
        assert!(!stderr.contains(&to), "the target is not quoted: {stderr}");
        assert!(
            stderr.contains("valid: http://host:port, or http://host:port/prefix"),
            "{unclear}: {stderr}"
        );
    }
    assert_eq!(
        proxy.requests().len(),
        before,
        "an unclear target was sent to"
    );
}

async fn scenarios(args: &[&str]) -> Output {
    // A binary that does not exist: the refusal must come before anything is started.
    let nothing = "/nonexistent/inventory";
    run(
        env!("CARGO_BIN_EXE_scenarios"),
        args,
        &[("INVENTORY_BIN", nothing)],
    )
    .await
}

#[tokio::test]
async fn scenarios_refuse_a_row_that_does_not_exist_naming_the_scenarios_strategies() {
    let output = scenarios(&["--scenario", "process-pause", "--strategy", "atomic"]).await;
    let (stdout, stderr) = text(&output);
    assert_eq!(output.status.code(), Some(2), "{stdout}\n{stderr}");
    assert!(
        stderr.contains(
            "scenario process-pause has no row for atomic; valid --strategy for it: watchdog, fenced"
        ),
        "{stderr}"
    );

    // Scenario names are read in any case, as strategy names are.
    let output = scenarios(&["--scenario", "Process-Pause", "--strategy", "ATOMIC"]).await;
    let (stdout, stderr) = text(&output);
    assert_eq!(output.status.code(), Some(2), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("scenario process-pause has no row for atomic;"),
        "{stderr}"
    );

    let output = scenarios(&["--scenario", "process-paws"]).await;
    let (stdout, stderr) = text(&output);
    assert_eq!(output.status.code(), Some(2), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("unknown scenario \"process-paws\"; valid: two-instances,"),
        "{stderr}"
    );
    assert!(
        stderr.contains("process-pause") && stderr.contains("or all"),
        "{stderr}"
    );
}

/// `failover-table` or `cluster-table` with an `inventory` that does not exist: whatever
/// they are to refuse, they refuse before starting Redis for a binary they cannot run.
async fn table(bin: &str, args: &[&str]) -> Output {
    let mut args = args.to_vec();
    args.extend(["--inventory-bin", "/nonexistent/inventory"]);
    run(bin, &args, &[]).await
}

#[tokio::test]
async fn the_tools_refuse_a_missing_inventory_binary_before_printing_or_starting_anything() {
    // The scenarios' own error status is 2, the tables' 1.
    for (bin, status) in [
        (env!("CARGO_BIN_EXE_failover-table"), 1),
        (env!("CARGO_BIN_EXE_cluster-table"), 1),
        (env!("CARGO_BIN_EXE_scenarios"), 2),
    ] {
        let started = std::time::Instant::now();
        let output = table(bin, &[]).await;
        let (stdout, stderr) = text(&output);
        assert_eq!(
            output.status.code(),
            Some(status),
            "{bin}: {stdout}\n{stderr}"
        );
        assert!(
            stderr.contains("no inventory binary at /nonexistent/inventory"),
            "{bin}: {stderr}"
        );
        assert_eq!(stdout, "", "{bin}: a table or a run was begun");
        // Redis, sentinels or a cluster take seconds to start; a refusal takes none.
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{bin}: {:?}",
            started.elapsed()
        );
    }
}

#[tokio::test]
async fn the_table_tools_run_a_strategy_named_twice_once_and_say_so() {
    for bin in [
        env!("CARGO_BIN_EXE_failover-table"),
        env!("CARGO_BIN_EXE_cluster-table"),
    ] {
        let output = table(bin, &["--strategy", "fenced,v6,FENCED,lua-release"]).await;
        let (stdout, stderr) = text(&output);
        // Said before the binary is looked for, so the missing one ends the run here.
        assert_eq!(output.status.code(), Some(1), "{bin}: {stdout}\n{stderr}");
        for note in [
            "--strategy names fenced 2 times (fenced, FENCED); it runs once",
            "--strategy names lua-release 2 times (v6, lua-release); it runs once",
        ] {
            assert!(stderr.contains(note), "{bin}: {stderr}");
        }
        let output = table(bin, &["--strategy", "fenced,v9"]).await;
        let (stdout, stderr) = text(&output);
        assert_eq!(output.status.code(), Some(2), "{bin}: {stdout}\n{stderr}");
        assert!(
            stderr.contains("unknown strategy \"v9\"; valid: none, local,"),
            "{bin}: {stderr}"
        );
    }
}

#[tokio::test]
async fn the_table_tools_refuse_values_they_cannot_run_naming_the_valid_ones_before_anything() {
    let failover = env!("CARGO_BIN_EXE_failover-table");
    let cluster = env!("CARGO_BIN_EXE_cluster-table");
    let day = "valid: a number of seconds above 0, at most 86400 (a day)";
    for (bin, args, said) in [
        // Each of these ran into Duration::from_secs_f64's panic, once the topology was up.
        (failover, &["--duration", "inf"][..], day),
        (failover, &["--duration", "1e30"], day),
        (cluster, &["--duration=-1"], day),
        (cluster, &["--duration", "NaN"], day),
        // A row of nothing but the connection's start.
        (cluster, &["--duration", "0"], day),
        (
            failover,
            &["--failover-after", "1e30"],
            "valid: a number of seconds from 0, at most 86400 (a day)",
        ),
        (
            failover,
            &["--failover-after", "9"],
            "--failover-after (9 s) must fall within --duration (8 s)",
        ),
        // The topology has two replicas: more acknowledgements refuse every sale.
        (failover, &["--acks", "0,3"], "3 is not in 0..=2"),
        (failover, &["--concurrency", "0"], "0 is not in 1..=4096"),
        (cluster, &["--concurrency", "0"], "0 is not in 1..=4096"),
        (cluster, &["--items", "1,0"], "0 is not in 1..=10000"),
        (cluster, &["--items", "10001"], "10001 is not in 1..=10000"),
    ] {
        let output = table(bin, args).await;
        let (stdout, stderr) = text(&output);
        assert_eq!(
            output.status.code(),
            Some(2),
            "{bin} {args:?}: {stdout}\n{stderr}"
        );
        assert!(stderr.contains(said), "{bin} {args:?}: {stderr}");
        assert_eq!(stdout, "", "{bin} {args:?}");
    }
}

#[tokio::test]
async fn loadtest_refuses_wrong_values_and_options_no_run_uses_before_sending_anything() {
    // Whatever connects here was sent something; every refusal must come first.
    let witness = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    witness.set_nonblocking(true).unwrap();
    let to = format!("http://127.0.0.1:{}", witness.local_addr().unwrap().port());
    let day = "valid: a number of seconds above 0, at most 86400 (a day)";
    let sentinel = ["--sentinel", "127.0.0.1:1"];
    for (args, said) in [
        // Each of these was the run failing (exit 1) rather than a usage error.
        (
            &["--strategy", "fenced,v9"][..],
            "unknown strategy \"v9\"; valid: none, local,",
        ),
        (&["--duration", "0"], day),
        (&["--duration", "inf"], day),
        (
            &[
                &sentinel[..],
                &["--failover-after=-1", "--strategy", "fenced"],
            ]
            .concat(),
            "valid: a number of seconds from 0, at most 86400 (a day)",
        ),
        (
            &[
                &sentinel[..],
                &["--failover-after", "1", "--strategy", "fenced,atomic"],
            ]
            .concat(),
            "--failover-after kills a master: give it one --strategy (the old master stays down); \
             --strategy names 2: fenced, atomic",
        ),
        // Killed after the sales: the run then stretched to it and reported half the rate.
        (
            &[
                &sentinel[..],
                &[
                    "--failover-after",
                    "4",
                    "--duration",
                    "2",
                    "--strategy",
                    "fenced",
                ],
            ]
            .concat(),
            "--failover-after 4 s is not within --duration 2 s",
        ),
        // And these were taken, and ignored without a word.
        (
            &["--duration", "1", "--requests", "50"],
            "--duration sells for that long and cannot be combined with --requests",
        ),
        (
            &sentinel[..],
            "--sentinel serves --failover-after only; without --failover-after, leave it out",
        ),
        (
            &["--master-name", "m"],
            "--master-name serves --failover-after only; without --failover-after, leave it out",
        ),
    ] {
        let mut args = args.to_vec();
        args.extend(["--target", &to]);
        let output = loadtest(&args).await;
        let (stdout, stderr) = text(&output);
        assert_eq!(
            output.status.code(),
            Some(USAGE),
            "{args:?}: {stdout}\n{stderr}"
        );
        assert!(stderr.contains(said), "{args:?}: {stderr}");
    }
    // What a run cannot do is found before the load, named, not after it: a report that is
    // a directory, a sentinel that does not answer.
    let dir = std::env::temp_dir();
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let nobody = format!("127.0.0.1:{}", closed.local_addr().unwrap().port());
    drop(closed);
    for (args, said) in [
        (
            vec!["--report", dir.to_str().unwrap()],
            format!("--report {}: is a directory", dir.display()),
        ),
        (
            vec![
                "--sentinel",
                &nobody,
                "--failover-after",
                "1",
                "--strategy",
                "fenced",
            ],
            format!("--sentinel {nobody}: cannot connect"),
        ),
    ] {
        let mut args = args.clone();
        args.extend(["--target", &to]);
        let output = loadtest(&args).await;
        let (stdout, stderr) = text(&output);
        assert_eq!(
            output.status.code(),
            Some(1),
            "{args:?}: {stdout}\n{stderr}"
        );
        assert!(stderr.contains(&said), "{args:?}: {stderr}");
        assert!(
            !stderr.contains("refused (os error 111): Connection"),
            "said twice: {stderr}"
        );
    }
    let with_password = to.replace("http://", "http://user:hunter2@");
    let output = loadtest(&["--target", &with_password]).await;
    let (stdout, stderr) = text(&output);
    assert_eq!(output.status.code(), Some(USAGE), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("--target: credentials in the target URL are not supported"),
        "{stderr}"
    );
    assert!(
        !stderr.contains("hunter2"),
        "the password was printed: {stderr}"
    );
    assert!(
        matches!(witness.accept(), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "a request was sent"
    );
}

#[tokio::test]
async fn scenarios_list_refuses_the_options_it_would_ignore() {
    let output = scenarios(&["--list"]).await;
    let (stdout, stderr) = text(&output);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    assert_eq!(
        stdout.lines().count(),
        15,
        "one line per scenario: {stdout}"
    );
    // Each was taken and ignored: the list came out as text, and no page was written.
    for other in [
        &["--json"][..],
        &["--report", "/tmp/never.html"],
        &["--scenario", "failover"],
        &["--strategy", "fenced"],
        &["--attempts", "2"],
    ] {
        let mut args = vec!["--list"];
        args.extend(other);
        let output = scenarios(&args).await;
        let (stdout, stderr) = text(&output);
        assert_eq!(
            output.status.code(),
            Some(2),
            "{args:?}: {stdout}\n{stderr}"
        );
        assert!(
            stderr.contains("the argument '--list' cannot be used with"),
            "{args:?}: {stderr}"
        );
        assert!(stderr.contains(other[0]), "{args:?}: {stderr}");
        assert_eq!(stdout, "", "{args:?}");
    }
}

/// A count of sales or connections out of range is a usage error like any other wrong value:
/// exit 64, naming the valid values, before anything is sent.
#[tokio::test]
async fn counts_out_of_range_are_usage_errors_naming_the_valid_values() {
    let witness = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    witness.set_nonblocking(true).unwrap();
    let to = format!("http://127.0.0.1:{}", witness.local_addr().unwrap().port());
    for (option, value, valid) in [
        ("--requests", "0", "1..=100000000"),
        ("--requests", "-3", ""),
        ("--requests", "many", ""),
        ("--concurrency", "0", "1..=4096"),
    ] {
        let output = loadtest(&["--target", &to, &format!("{option}={value}")]).await;
        let (stdout, stderr) = text(&output);
        assert_eq!(
            output.status.code(),
            Some(USAGE),
            "{option} {value}: {stdout}\n{stderr}"
        );
        assert!(
            stderr.contains(option) && stderr.contains(valid),
            "{option} {value}: {stderr}"
        );
    }
    assert!(
        matches!(witness.accept(), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "a request was sent"
    );
}

/// The network namespaces and host-side interfaces of process `pid` that still exist: its
/// namespaces are `tk-<pid>-<n>`, their host-side interfaces `tk<pid, 5 hex>...h`.
fn netns_of(pid: u32) -> Vec<String> {
    let (ns, ifs) = (format!("tk-{pid}-"), format!("tk{:05x}", pid & 0xf_ffff));
    testkit::netns::leftovers()
        .into_iter()
        .filter(|n| n.starts_with(&ns) || n.starts_with(&ifs))
        .collect()
}

/// `scenarios` stopped by Ctrl-C (or SIGTERM) while a scenario's network namespace is up
/// removes it, with its veth pairs, before it exits: a signal runs no `Drop`, and they used
/// to stay until the next run (one veth for over a minute more).
#[tokio::test]
async fn scenarios_stopped_by_a_signal_leave_no_namespace_or_veth() {
    use testkit::netns;
    assert!(
        netns::supported(),
        "network namespaces need root and iproute2 (CI runs as root)"
    );
    let bin = testkit::inventory_binary().unwrap();
    for signal in [Signal::SIGINT, Signal::SIGTERM] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_scenarios"))
            .args(["--scenario", "partition"])
            .env("INVENTORY_BIN", &bin)
            .stdout(std::process::Stdio::null())
            // Read after the exit: what it said, if it stopped for another reason.
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut stderr = child.stderr.take().unwrap();
        let said = tokio::spawn(async move {
            let mut text = String::new();
            let _ = tokio::io::AsyncReadExt::read_to_string(&mut stderr, &mut text).await;
            text
        });
        let pid = child.id().unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while netns_of(pid).len() < 2 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the partition scenario never set up its namespace and links"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), signal).unwrap();
        let status = tokio::time::timeout(Duration::from_secs(20), child.wait())
            .await
            .expect("it exits on the signal")
            .unwrap();
        let said = said.await.unwrap_or_default();
        assert_eq!(
            status.code(),
            Some(128 + signal as i32),
            "{signal}; it said:\n{said}"
        );
        let left = netns_of(pid);
        assert!(left.is_empty(), "{signal}: left behind: {left:?}");
    }
}

/// `scenarios` killed outright (SIGKILL: no handler, no `Drop`) takes what it started with
/// it: every process group (Redis, sentinels, instances) and the partition's namespace and
/// links are removed by the harness's keeper within seconds. They used to run for good.
#[tokio::test]
async fn scenarios_killed_outright_leave_no_process_namespace_or_veth() {
    use testkit::{ProcStat, group_members};
    let bin = testkit::inventory_binary().unwrap();
    for scenario in ["failover", "partition"] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_scenarios"))
            .args(["--scenario", scenario])
            .env("INVENTORY_BIN", &bin)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let pid = child.id().unwrap();
        // The groups it leads: its children's, the keeper (a `sh`) aside.
        let groups = || -> Vec<u32> {
            let mut groups: Vec<u32> = ProcStat::all()
                .into_iter()
                .filter(|p| p.ppid == pid && p.comm != "sh" && !p.is_zombie())
                .map(|p| p.pgrp)
                .collect();
            groups.sort_unstable();
            groups.dedup();
            groups
        };
        // Three groups at least: Redis and both instances, or the lock nodes.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        let mut started = groups();
        while started.len() < 3 || (scenario == "partition" && netns_of(pid).is_empty()) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{scenario}: never started its processes: {started:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
            started = groups();
        }
        // A group is listed with the keeper right after its spawn returns: one killed in
        // that instant escapes it (a race this test would otherwise hit, polling as it does).
        tokio::time::sleep(Duration::from_millis(300)).await;
        started = groups();
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), Signal::SIGKILL).unwrap();
        child.wait().await.unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let alive: Vec<ProcStat> = started.iter().flat_map(|&g| group_members(g)).collect();
            let left = netns_of(pid);
            if alive.is_empty() && left.is_empty() {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{scenario}: left running {alive:?}, left behind {left:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// A row is called safe only when its fault took place: with a lease far longer than the
/// scenarios' (an `inventory` that sets `LOCK_TTL_MS=60000` itself), no lease runs out
/// under the work, and the rows that need one to say "safe" say "missed" instead. They
/// said "safe, ok" although nothing had been put to the test.
#[tokio::test]
async fn a_row_whose_lease_never_ran_out_is_missed_not_safe() {
    let wrapper = inventory_wrapped("long-lease", "LOCK_TTL_MS=60000");
    let output = run(
        env!("CARGO_BIN_EXE_scenarios"),
        &[
            "--scenario",
            "long-work,slow-holder,release-race",
            "--attempts",
            "1",
            "--json",
        ],
        &[("INVENTORY_BIN", wrapper.to_str().unwrap())],
    )
    .await;
    let (stdout, stderr) = text(&output);
    let rows = json_lines(&stdout);
    assert_eq!(rows.len(), 6, "{stdout}\n{stderr}");
    for row in &rows {
        assert_eq!(row["observed"], "missed", "{row}");
        assert_eq!(row["ok"], false, "{row}");
    }
}

/// An `inventory` that runs `setup` (shell) first, as a wrapper under
/// `$TMPDIR/<name>-<pid>/inventory`: how a row is run with its fault taken away.
fn inventory_wrapped(name: &str, setup: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let dir = std::env::temp_dir().join(format!("{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let wrapper = dir.join("inventory");
    let real = testkit::inventory_binary().unwrap();
    std::fs::write(
        &wrapper,
        format!("#!/bin/bash\n{setup}\nexec {} \"$@\"\n", real.display()),
    )
    .unwrap();
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();
    wrapper
}

/// Rows whose fault never reached the lock say "missed", not "safe": `node-loss` killing a
/// lock node no instance votes on, `partition` cutting app1 off from a node it does not use.
/// And a nested `lua-release` acquire that waited its own lock out and then sold (a lease
/// shorter than the wait) is the flaw, not "safe".
#[tokio::test]
async fn rows_whose_fault_missed_the_lock_are_missed_and_a_late_nested_sale_is_the_flaw() {
    for (scenario, strategy, setup, expected) in [
        (
            "node-loss",
            "redlock",
            r#"IFS=, read -ra N <<< "$LOCK_NODES"; [ ${#N[@]} -eq 3 ] && export LOCK_NODES="${N[0]},${N[2]}""#,
            "missed",
        ),
        (
            "partition",
            "redlock",
            r#"IFS=, read -ra N <<< "$LOCK_NODES"; K=(); for n in "${N[@]}"; do case $n in *10.200.*) ;; *) K+=("$n");; esac; done; export LOCK_NODES=$(IFS=,; echo "${K[*]}")"#,
            "missed",
        ),
        (
            "reentry",
            "lua-release",
            "export LOCK_TTL_MS=500 LOCK_WAIT_MS=3000",
            "flaw",
        ),
    ] {
        let wrapper = inventory_wrapped(&format!("fault-{scenario}"), setup);
        let output = run(
            env!("CARGO_BIN_EXE_scenarios"),
            &[
                "--scenario",
                scenario,
                "--strategy",
                strategy,
                "--attempts",
                "1",
                "--json",
            ],
            &[("INVENTORY_BIN", wrapper.to_str().unwrap())],
        )
        .await;
        let (stdout, stderr) = text(&output);
        let rows = json_lines(&stdout);
        assert_eq!(rows.len(), 1, "{scenario}: {stdout}\n{stderr}");
        assert_eq!(rows[0]["observed"], expected, "{scenario}: {}", rows[0]);
    }
}

/// `--inventory-bin` relative to where the tool is run from: the instances start in
/// directories of their own, and a relative path used to name nothing there.
#[tokio::test]
async fn a_relative_inventory_bin_is_found_from_where_the_tool_runs() {
    let bin = testkit::inventory_binary().unwrap();
    let dir = bin.parent().unwrap().to_owned();
    let output = Command::new(env!("CARGO_BIN_EXE_scenarios"))
        .args([
            "--scenario",
            "two-instances",
            "--strategy",
            "setnx",
            "--json",
        ])
        .args(["--inventory-bin", "./inventory"])
        .current_dir(&dir)
        .output()
        .await
        .unwrap();
    let (stdout, stderr) = text(&output);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    assert_eq!(json_lines(&stdout)[0]["observed"], "safe", "{stdout}");
}

/// A report file that cannot be written (sysfs takes no new file, root's included) is
/// refused before the run, named, with each tool's error status: it was found only once the
/// run was over, and its page lost. A run that fails writes no page, not even an empty one.
#[tokio::test]
async fn a_report_that_cannot_be_written_is_refused_before_the_run() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let nobody = format!("http://127.0.0.1:{}", closed.local_addr().unwrap().port());
    drop(closed);
    let unwritable = "/sys/kernel/x.html";
    let said = format!("--report {unwritable}: cannot be written: ");
    let output = loadtest(&["--target", &nobody, "--report", unwritable]).await;
    let (stdout, stderr) = text(&output);
    assert_eq!(output.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(stderr.contains(&said), "{stderr}");
    assert!(
        !stderr.contains("cannot reach"),
        "the run was begun: {stderr}"
    );

    // Before the inventory binary is looked for, as a wrong row is.
    let output = scenarios(&["--scenario", "two-instances", "--report", unwritable]).await;
    let (stdout, stderr) = text(&output);
    assert_eq!(output.status.code(), Some(2), "{stdout}\n{stderr}");
    assert!(stderr.contains(&said), "{stderr}");
    assert_eq!(stdout, "");

    let page = std::env::temp_dir().join(format!("unreached-{}.html", std::process::id()));
    let output = loadtest(&["--target", &nobody, "--report", page.to_str().unwrap()]).await;
    let (stdout, stderr) = text(&output);
    assert_eq!(output.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(!page.exists(), "a failed run left {}", page.display());

    let help = loadtest(&["--help"]).await;
    assert!(
        text(&help)
            .0
            .contains("a file that cannot be written is refused with exit status 1"),
        "{}",
        text(&help).0
    );
}

/// Every error of a target with a prefix names the URL requested, prefix included: a 404
/// under `/nope` was reported as "resetting the stock (/inventory)".
#[tokio::test]
async fn an_error_names_the_url_requested_under_the_targets_prefix() {
    let (_redis, app) = instance().await;
    let proxy = PrefixProxy::start(app.port).await;
    let to = format!("http://127.0.0.1:{}/nope", proxy.port);
    let output = loadtest(&["--target", &to, "--requests", "2", "--strategy", "atomic"]).await;
    let (stdout, stderr) = text(&output);
    assert_eq!(output.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(
        stderr.contains(&format!(
            "resetting the stock (PUT {to}/inventory) failed with 404 Not Found"
        )),
        "{stderr}"
    );
    assert!(
        proxy
            .requests()
            .iter()
            .any(|l| l.starts_with("PUT /nope/inventory ")),
        "{:?}",
        proxy.requests()
    );
}

/// Behind nginx, two instances and a stock of 1: one of them sells it, the other answers
/// `sold_out`. The split lists both, `1/0` or `0/1`: it said `1`, as if one instance had
/// answered.
#[tokio::test]
async fn the_split_lists_an_instance_that_answered_without_selling() {
    let redis = RedisServer::start().await;
    let app1 = InstanceBuilder::new(&redis, "app1").start().await;
    let app2 = InstanceBuilder::new(&redis, "app2").start().await;
    let nginx = testkit::NginxProcess::start([app1.port, app2.port])
        .await
        .unwrap();
    let to = nginx.url();
    let args = [
        "--target",
        &to,
        "--strategy",
        "atomic",
        "--stock",
        "1",
        "--requests",
        "6",
        "--concurrency",
        "1",
    ];
    let output = loadtest(&[&args[..], &["--json"]].concat()).await;
    let (stdout, stderr) = text(&output);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    let line = &json_lines(&stdout)[0];
    let mut sales: Vec<u64> = line["instances"]
        .as_object()
        .unwrap()
        .values()
        .map(|n| n.as_u64().unwrap())
        .collect();
    sales.sort_unstable();
    assert_eq!(sales, [0, 1], "{line}");

    let output = loadtest(&args).await;
    let (stdout, stderr) = text(&output);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    let row = stdout
        .lines()
        .find(|l| l.starts_with("atomic"))
        .unwrap_or_default();
    assert!(
        row.split_whitespace().any(|c| c == "1/0" || c == "0/1"),
        "{stdout}"
    );
}

/// A row that sent no request (a duration shorter than one) is INCONCLUSIVE, and the table
/// tools exit 3 for it, as loadtest does: they exited 0, and a script took the table for a
/// measurement. Their help says so.
#[tokio::test]
async fn the_tables_exit_3_when_a_row_is_inconclusive() {
    let bin = testkit::inventory_binary().unwrap();
    let cluster = env!("CARGO_BIN_EXE_cluster-table");
    let output = run(
        cluster,
        &["--duration", "1e-9", "--strategy", "atomic", "--items", "1"],
        &[("INVENTORY_BIN", bin.to_str().unwrap())],
    )
    .await;
    let (stdout, stderr) = text(&output);
    assert_eq!(output.status.code(), Some(3), "{stdout}\n{stderr}");
    assert_eq!(
        stdout.matches("INCONCLUSIVE: no request was sent").count(),
        2,
        "{stdout}"
    );
    assert!(
        stderr.contains("cluster-table: 2 of 2 rows INCONCLUSIVE; exit status 3"),
        "{stderr}"
    );
    for bin in [cluster, env!("CARGO_BIN_EXE_failover-table")] {
        let (help, _) = text(&run(bin, &["--help"], &[]).await);
        assert!(
            help.contains(
                "Exit status: 0 when every row measured something; 3 when a row is INCONCLUSIVE"
            ),
            "{bin}: {help}"
        );
    }
}

/// A kill at 0 s leaves a few milliseconds of sales before it: no rate, `-`. It reported
/// "sales/s before the kill 740" for a row that sold 6. (The overall rate of a row shorter
/// than a second is `-` too, but how long the row lasts depends on how long its last sales
/// take to end: the table's unit tests hold that.)
#[tokio::test]
async fn a_failover_row_gives_no_rate_over_a_window_too_short_for_one() {
    let bin = testkit::inventory_binary().unwrap();
    let output = run(
        env!("CARGO_BIN_EXE_failover-table"),
        &[
            "--failover-after",
            "0",
            "--duration",
            "0.5",
            "--strategy",
            "atomic",
            "--acks",
            "0",
        ],
        &[("INVENTORY_BIN", bin.to_str().unwrap())],
    )
    .await;
    let (stdout, stderr) = text(&output);
    let row = stdout
        .lines()
        .find(|l| l.starts_with("| atomic | 0 |"))
        .unwrap_or_else(|| panic!("no row: {stdout}\n{stderr}"));
    let cells: Vec<&str> = row.split(" | ").collect();
    // strategy, acks, sold, lost, resumed, errors, before the kill, overall, verdict.
    assert_eq!(cells[6], "-", "{row}");
}

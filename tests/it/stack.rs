//! The whole stack: real nginx in front of two real instances, the load test through it,
//! an instance killed under load, the native stack's scripts and the compose file.

use std::collections::BTreeSet;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use inventory::lock::Strategy;
use loadtest::{LoadTest, Plan, StrategyReport, Verdict};
use testkit::fixture::{Cluster, LockNodes, Stack};
use testkit::native;

use crate::harness::repo_path;

fn plan(stack: &Stack, strategy: Strategy, stock: i64, requests: usize, work_ms: u64) -> Plan {
    Plan {
        target: stack.nginx.url(),
        strategies: vec![strategy],
        stock,
        requests,
        concurrency: 16,
        work_ms,
        admin_token: None,
    }
}

async fn load(
    stack: &Stack,
    name: &str,
    stock: i64,
    requests: usize,
    work_ms: u64,
) -> StrategyReport {
    let strategy: Strategy = name.parse().unwrap();
    let load = LoadTest::new(plan(stack, strategy, stock, requests, work_ms)).unwrap();
    load.run_strategy(strategy, None).await.unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn responses_through_nginx_alternate_between_the_two_instances() {
    let stack = Stack::start(|b| b).await;
    let mut seen = Vec::new();
    for _ in 0..6 {
        let reply = stack.get("/health").await;
        assert_eq!(reply.status, 200);
        seen.push(reply.instance.unwrap());
    }
    for pair in seen.windows(2) {
        assert_ne!(pair[0], pair[1], "round robin should alternate: {seen:?}");
    }
    assert_eq!(seen.iter().collect::<BTreeSet<_>>().len(), 2, "{seen:?}");
    let log = stack.nginx.access_log();
    assert!(
        log.contains("upstream=127.0.0.1:") && log.contains("upstream_time="),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn through_nginx_local_oversells_and_the_report_agrees_with_the_audit() {
    let stack = Stack::start(|b| b).await;
    let report = load(&stack, "local", 20, 120, 5).await;
    assert_eq!(report.verdict, Verdict::Oversold, "{report:#?}");
    assert!(report.oversold > 0, "{report:#?}");
    assert!(
        !report.is_unexpected_oversell(),
        "local is expected to oversell"
    );
    assert_eq!(
        report.instances.len(),
        2,
        "both instances sold: {report:#?}"
    );
    assert_agrees_with_the_audit(&stack, &report).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn through_nginx_fenced_and_atomic_sell_exactly_the_stock() {
    let stack = Stack::start(|b| b).await;
    for name in ["fenced", "atomic"] {
        let report = load(&stack, name, 30, 120, 1).await;
        assert_eq!(report.verdict, Verdict::Safe, "{report:#?}");
        assert_eq!(
            (report.sold, report.sold_out, report.errors),
            (30, 90, 0),
            "{report:#?}"
        );
        assert_eq!(
            (report.oversold, report.lost_updates, report.duplicates),
            (0, 0, 0)
        );
        assert_eq!(report.remaining, 0);
        assert_agrees_with_the_audit(&stack, &report).await;
        // What `--json` prints is this struct, and it reads back the same.
        let line = serde_json::to_string(&report).unwrap();
        assert_eq!(
            serde_json::from_str::<StrategyReport>(&line).unwrap(),
            report
        );
    }
}

async fn assert_agrees_with_the_audit(stack: &Stack, report: &StrategyReport) {
    let audit = stack.get("/inventory/audit").await.body;
    assert!(report.agrees, "{report:#?}");
    assert_eq!(
        audit["sales"].as_u64(),
        Some(report.sold),
        "{audit} vs {report:#?}"
    );
    assert_eq!(audit["oversold"].as_i64(), Some(report.oversold));
    assert_eq!(audit["lost_updates"].as_i64(), Some(report.lost_updates));
    assert_eq!(audit["remaining"].as_i64(), Some(report.remaining));
    assert_eq!(
        audit["duplicates"].as_array().map(Vec::len),
        Some(report.duplicates as usize)
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn killing_an_instance_under_load_loses_no_sale_and_sells_none_twice() {
    // A short lease, so a lock held by the killed instance frees itself quickly.
    let stack = Stack::start(|b| b.env("LOCK_TTL_MS", 1_000)).await;
    let victim = stack.cluster.instances[1].name.clone();
    let victim_pid = stack.cluster.instances[1].pid();
    let strategy = Strategy::Redis(inventory::lock::RedisLock::Fenced);
    let load = LoadTest::new(plan(&stack, strategy, 150, 400, 2)).unwrap();

    // Kill the instance once a quarter of the requests are done: by count, not by clock.
    let done = Arc::new(AtomicUsize::new(0));
    let tick = {
        let done = done.clone();
        Arc::new(move || {
            if done.fetch_add(1, Ordering::SeqCst) + 1 == 100 {
                let _ = Command::new("kill")
                    .args(["-KILL", &victim_pid.to_string()])
                    .status();
            }
        })
    };
    let report = load.run_strategy(strategy, Some(tick)).await.unwrap();

    let audit = stack.get("/inventory/audit").await.body;
    assert_eq!(audit["oversold"], 0, "{audit}");
    assert_eq!(audit["lost_updates"], 0, "{audit}");
    assert_eq!(
        audit["duplicates"].as_array().map(Vec::len),
        Some(0),
        "{audit}"
    );
    assert_eq!(
        audit["remaining"], 0,
        "the surviving instance sold the rest: {audit}"
    );
    let recorded = audit["sales"].as_u64().unwrap();
    assert!(
        report.sold <= recorded && recorded <= report.sold + report.errors,
        "every sale the clients saw is recorded once, and only requests that died with the \
         instance may have sold unseen: {report:#?}"
    );
    assert!(
        report.errors <= 16,
        "only requests in flight at the kill may fail: {report:#?}"
    );
    let survivor = &stack.cluster.instances[0].name;
    assert!(
        report.instances.get(survivor).copied().unwrap_or(0)
            > report.instances.get(&victim).copied().unwrap_or(0),
        "{report:#?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn with_one_of_three_lock_nodes_down_redlock_sells_the_whole_stock_through_nginx() {
    let mut nodes = LockNodes::start(3).await;
    let stack = Stack::start(|b| b.lock_nodes(&nodes)).await;
    nodes.kill(1).await;
    let ready = stack.get("/ready").await;
    assert_eq!(ready.status, 200, "a majority answers: {ready:?}");
    let report = load(&stack, "redlock", 60, 200, 1).await;
    assert_eq!(
        report.error_kinds.get("redis_unavailable"),
        None,
        "{report:#?}"
    );
    // The whole stock, and nothing but waits that ran out: a dead node costs every acquire
    // its per-node timeout, and 16 buyers polling for one lock are not served in order.
    assert_eq!(report.sold, 60, "{report:#?}");
    assert!(
        report.error_kinds.keys().all(|k| k == "lock_timeout"),
        "{report:#?}"
    );
    assert_eq!(report.verdict, Verdict::Safe, "{report:#?}");
    assert_agrees_with_the_audit(&stack, &report).await;
    let audit = stack.get("/inventory/audit").await.body;
    assert_eq!(audit["clean"], true, "{audit}");
    assert_eq!(audit["remaining"], 0, "{audit}");
    // The dead node was asked and counted as failed: the quorum really ran without it.
    let metrics = stack.get("/metrics").await.body;
    let metrics = metrics.as_str().unwrap_or_default();
    assert!(
        metrics
            .lines()
            .filter(|l| l.starts_with("inventory_lock_node_votes_total")
                && l.contains("vote=\"failed\""))
            .any(|l| l.rsplit(' ').next().and_then(|n| n.parse::<f64>().ok()) > Some(0.0)),
        "{metrics}"
    );
}

fn stack_script(
    run_dir: &std::path::Path,
    ports: native::Ports,
    verb: &str,
) -> std::process::Output {
    native::stack_script(
        &repo_path("scripts/stack.sh"),
        run_dir,
        &ports,
        env!("CARGO_BIN_EXE_inventory").as_ref(),
        verb,
    )
}

/// `down` succeeds, and no port of the stack is taken after it.
fn down_frees_every_port(run_dir: &std::path::Path, ports: native::Ports) {
    let down = stack_script(run_dir, ports, "down");
    assert!(down.status.success(), "{}", text(&down));
    for port in ports {
        assert!(!listening(port), "port {port} still taken after `down`");
    }
}

/// What a run of the script printed, stdout then stderr.
fn text(o: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn listening(port: u16) -> bool {
    std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
}

/// Running, as opposed to gone or a zombie waiting for its adopter to reap it.
fn alive(pid: &str) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rsplit_once(") ")
            .is_some_and(|(_, rest)| !rest.starts_with('Z'))
    })
}

#[tokio::test(flavor = "multi_thread")]
async fn the_native_stack_starts_twice_harmlessly_and_stops_without_leftovers() {
    let run_dir = tempfile::tempdir().unwrap();
    let ports = native::free_ports();
    let script = repo_path("scripts/stack.sh");
    let _down = native::DownOnDrop {
        script: &script,
        run_dir: run_dir.path(),
        inventory: env!("CARGO_BIN_EXE_inventory").as_ref(),
    };

    let first = stack_script(run_dir.path(), ports, "up");
    assert!(first.status.success(), "{}", text(&first));
    let pids: Vec<String> = native::pid_files(run_dir.path())
        .iter()
        .map(|file| std::fs::read_to_string(file).unwrap())
        .map(|p| p.trim().to_owned())
        .collect();
    assert!(pids.iter().all(|p| alive(p)), "{pids:?}");
    let through_nginx = reqwest::get(format!(
        "http://127.0.0.1:{}/ready",
        native::nginx_port(&ports)
    ))
    .await
    .unwrap();
    assert_eq!(through_nginx.status(), 200);

    let second = stack_script(run_dir.path(), ports, "up");
    assert!(second.status.success(), "{}", text(&second));
    assert_eq!(
        text(&second).matches("already running").count(),
        native::SERVICES.len(),
        "{}",
        text(&second)
    );

    let down = stack_script(run_dir.path(), ports, "down");
    assert!(down.status.success(), "{}", text(&down));
    for pid in &pids {
        assert!(!alive(pid), "pid {pid} survived `down`");
    }
    for port in ports {
        assert!(!listening(port), "port {port} still taken after `down`");
    }
}

/// The pids whose parent is `parent`.
fn children(parent: &str) -> Vec<String> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|pid| pid.bytes().all(|b| b.is_ascii_digit()))
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
                stat.rsplit_once(") ")
                    .and_then(|(_, rest)| rest.split(' ').nth(1).map(|p| p == parent))
                    .unwrap_or(false)
            })
        })
        .collect()
}

/// Every service's leader killed at once (a `kill -9` of the whole stack, an OOM kill):
/// `up` must bring back a stack that answers, and leave nothing of the old one running.
/// nginx's workers outlive their master and keep its port, so a new master could not bind.
#[tokio::test(flavor = "multi_thread")]
async fn the_native_stack_comes_back_with_up_after_every_leader_was_killed() {
    let run_dir = tempfile::tempdir().unwrap();
    let ports = native::free_ports();
    let script = repo_path("scripts/stack.sh");
    let _down = native::DownOnDrop {
        script: &script,
        run_dir: run_dir.path(),
        inventory: env!("CARGO_BIN_EXE_inventory").as_ref(),
    };
    let first = stack_script(run_dir.path(), ports, "up");
    assert!(first.status.success(), "{}", text(&first));
    let leaders: Vec<String> = native::pid_files(run_dir.path())
        .iter()
        .map(|file| std::fs::read_to_string(file).unwrap().trim().to_owned())
        .collect();
    let nginx_master = leaders.last().unwrap().clone();
    let workers = children(&nginx_master);
    assert!(!workers.is_empty(), "nginx {nginx_master} has no workers");
    for pid in &leaders {
        let pid = nix::unistd::Pid::from_raw(pid.parse().unwrap());
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL).unwrap();
    }
    for _ in 0..100 {
        if leaders.iter().all(|p| !alive(p)) {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(leaders.iter().all(|p| !alive(p)), "{leaders:?}");
    assert!(
        workers.iter().any(|w| alive(w)) && listening(native::nginx_port(&ports)),
        "the case under test: nginx's workers {workers:?} outlive their master and keep the port"
    );

    let again = stack_script(run_dir.path(), ports, "up");
    assert!(again.status.success(), "{}", text(&again));
    for w in &workers {
        assert!(
            !alive(w),
            "the old nginx worker {w} still runs:\n{}",
            text(&again)
        );
    }
    let now: Vec<String> = native::pid_files(run_dir.path())
        .iter()
        .map(|file| std::fs::read_to_string(file).unwrap().trim().to_owned())
        .collect();
    assert!(
        now.iter().all(|p| alive(p) && !leaders.contains(p)),
        "{now:?} after {leaders:?}"
    );
    let ready = reqwest::get(format!(
        "http://127.0.0.1:{}/ready",
        native::nginx_port(&ports)
    ))
    .await
    .unwrap();
    assert_eq!(ready.status(), 200);
    down_frees_every_port(run_dir.path(), ports);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_native_stack_refuses_to_start_on_a_taken_port() {
    let run_dir = tempfile::tempdir().unwrap();
    let squatter = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = squatter.local_addr().unwrap().port();
    let mut ports = native::free_ports();
    let last = ports.len() - 1;
    ports[last] = taken;

    let script = repo_path("scripts/stack.sh");
    let _down = native::DownOnDrop {
        script: &script,
        run_dir: run_dir.path(),
        inventory: env!("CARGO_BIN_EXE_inventory").as_ref(),
    };
    let up = stack_script(run_dir.path(), ports, "up");
    let stderr = String::from_utf8_lossy(&up.stderr);
    assert!(!up.status.success());
    assert!(
        stderr.contains(&format!("port {taken}")) && stderr.contains("taken"),
        "{stderr}"
    );
    for port in &ports[..last] {
        assert!(
            !listening(*port),
            "nothing was started before the check failed"
        );
    }
}

/// The second of two services on one port would fail to bind, and its start check (a PING
/// of the port) would be answered by the first: `up` must refuse before starting either.
#[tokio::test(flavor = "multi_thread")]
async fn the_native_stack_refuses_to_start_with_one_port_given_to_two_services() {
    let run_dir = tempfile::tempdir().unwrap();
    let mut ports = native::free_ports();
    let (redis, lock1) = (0, 1);
    assert_eq!(
        (native::SERVICES[redis], native::SERVICES[lock1]),
        ("redis", "lock1")
    );
    ports[lock1] = ports[redis];

    let script = repo_path("scripts/stack.sh");
    let _down = native::DownOnDrop {
        script: &script,
        run_dir: run_dir.path(),
        inventory: env!("CARGO_BIN_EXE_inventory").as_ref(),
    };
    let up = stack_script(run_dir.path(), ports, "up");
    let stdout = String::from_utf8_lossy(&up.stdout);
    let stderr = String::from_utf8_lossy(&up.stderr);
    assert!(!up.status.success(), "{stdout}{stderr}");
    assert!(
        stderr.contains("REDIS_PORT and LOCK1_PORT")
            && stderr.contains(&format!("port {}", ports[redis])),
        "{stderr}"
    );
    assert!(!stdout.contains("started"), "{stdout}");
    for port in ports {
        assert!(
            !listening(port),
            "port {port}: nothing was started before the check failed"
        );
    }
    for file in native::pid_files(run_dir.path()) {
        assert!(!file.exists(), "{} was written", file.display());
    }
}

/// Sends one long sale through nginx, kills the instance that holds its lock, and returns
/// what the client got and how many sales the surviving instance's audit shows.
async fn a_sale_whose_instance_dies(method: reqwest::Method) -> (u16, serde_json::Value) {
    let stack = Stack::start(|b| b).await;
    a_sale_whose_instance_dies_behind(&stack.cluster, &stack.nginx.url(), method).await
}

/// [`a_sale_whose_instance_dies`], through any nginx in front of `cluster`'s two instances.
pub(crate) async fn a_sale_whose_instance_dies_behind(
    cluster: &Cluster,
    nginx_url: &str,
    method: reqwest::Method,
) -> (u16, serde_json::Value) {
    cluster.instances[0].reset(5).await;
    let lock = inventory::store::Keys::new("001").lock;
    let mut c = cluster.redis.conn().await;

    let url = format!("{nginx_url}/inventory/sale?strategy=fenced&work_ms=3000");
    let request = reqwest::Client::new().request(method, url).send();
    let kill_the_holder = async {
        let holder = loop {
            let owners: Vec<String> = redis::AsyncCommands::hkeys(&mut c, &lock).await.unwrap();
            if let Some(owner) = owners.first() {
                break owner.split(':').next().unwrap().to_owned();
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        };
        let victim = cluster.instances.iter().find(|i| i.name == holder).unwrap();
        Command::new("kill")
            .args(["-KILL", &victim.pid().to_string()])
            .status()
            .unwrap();
        holder
    };
    let (response, holder) = tokio::join!(request, kill_the_holder);
    let survivor = cluster.instances.iter().find(|i| i.name != holder).unwrap();
    (response.unwrap().status().as_u16(), survivor.audit().await)
}

/// A sale that reached an instance which then died must not be resent to the other one:
/// that would sell although the client is told it failed, or sell twice on a retry.
#[tokio::test(flavor = "multi_thread")]
async fn nginx_never_resends_a_post_sale_whose_instance_died_mid_request() {
    let (status, audit) = a_sale_whose_instance_dies(reqwest::Method::POST).await;
    assert_eq!(status, 502);
    assert_eq!(
        audit["sales"], 0,
        "the sale was resent to the other instance: {audit}"
    );
}

/// nginx thinks GET is idempotent and would resend it; the tutorial's GET sale is not.
#[tokio::test(flavor = "multi_thread")]
async fn nginx_never_resends_a_get_sale_whose_instance_died_mid_request() {
    let (status, audit) = a_sale_whose_instance_dies(reqwest::Method::GET).await;
    assert_eq!(status, 502);
    assert_eq!(
        audit["sales"], 0,
        "the sale was resent to the other instance: {audit}"
    );
}

/// nginx waits for an instance as long as a sale's budget may take, and not much longer: a
/// frozen instance still accepts connections, so the read timeout is how long each request
/// sent to it hangs before nginx answers 504 and marks it down. `make up` computes it from
/// the LOCK_WAIT_MS, MAX_WORK_MS and REDIS_TIMEOUT_MS the instances get (the first two,
/// four of the third and 4 s); the compose file, which cannot, states the figure for the
/// defaults.
#[tokio::test(flavor = "multi_thread")]
async fn nginx_waits_for_an_instance_as_long_as_its_sale_budget_and_no_longer() {
    let run_dir = tempfile::tempdir().unwrap();
    let script = repo_path("scripts/stack.sh");
    let inventory: &std::path::Path = env!("CARGO_BIN_EXE_inventory").as_ref();
    let _down = native::DownOnDrop {
        script: &script,
        run_dir: run_dir.path(),
        inventory,
    };
    let ports = native::TopologyPorts::free(native::Topology::Single);
    let env = [
        ("LOCK_WAIT_MS", "30000"),
        ("MAX_WORK_MS", "1500"),
        ("REDIS_TIMEOUT_MS", "3000"),
    ];
    let up = native::stack_script_in(&script, run_dir.path(), &ports, inventory, "up", &env);
    assert!(up.status.success(), "{}", text(&up));
    let conf = std::fs::read_to_string(run_dir.path().join("nginx.conf")).unwrap();
    // 30 + 1.5 + 4 x 3 + 4 s.
    assert!(conf.contains("proxy_read_timeout 48s;"), "{conf}");
    let down = native::stack_script_in(&script, run_dir.path(), &ports, inventory, "down", &[]);
    assert!(down.status.success(), "{}", text(&down));

    let compose = std::fs::read_to_string(repo_path("nginx/nginx.conf")).unwrap();
    assert_eq!(
        compose.matches("proxy_read_timeout 20s;").count(),
        1,
        "10 s of LOCK_WAIT_MS, 2 s of MAX_WORK_MS, 4 x 1 s of REDIS_TIMEOUT_MS and 4 s"
    );
    let shared = std::fs::read_to_string(repo_path("nginx/locations.conf")).unwrap();
    assert!(
        !shared
            .lines()
            .any(|l| l.trim_start().starts_with("proxy_read_timeout")),
        "set once, by the including file"
    );
}

/// A native stack started by a test goes down once the test's process is gone, even killed
/// by a signal that runs no `Drop`: interrupting the suite left whole stacks running for
/// good (their daemons lead sessions of their own). The watchdog every test stack gets,
/// here watching a stand-in process killed with SIGKILL.
#[tokio::test(flavor = "multi_thread")]
async fn a_native_stack_goes_down_when_the_process_that_started_it_is_killed() {
    let run_dir = tempfile::tempdir().unwrap();
    let ports = native::free_ports();
    let script = repo_path("scripts/stack.sh");
    let inventory: &std::path::Path = env!("CARGO_BIN_EXE_inventory").as_ref();
    let _down = native::DownOnDrop {
        script: &script,
        run_dir: run_dir.path(),
        inventory,
    };
    let up = stack_script(run_dir.path(), ports, "up");
    assert!(up.status.success(), "{}", text(&up));
    let pids: Vec<String> = native::pid_files(run_dir.path())
        .iter()
        .map(|file| std::fs::read_to_string(file).unwrap().trim().to_owned())
        .collect();
    let mut stand_in = std::process::Command::new("sleep")
        .arg("600")
        .spawn()
        .unwrap();
    native::down_when_gone(stand_in.id(), &script, run_dir.path(), inventory);
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert!(
        pids.iter().all(|p| alive(p)),
        "nothing stopped while it lives"
    );
    stand_in.kill().unwrap();
    stand_in.wait().unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while pids.iter().any(|p| alive(p)) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "still running 15 s after: {:?}",
            pids.iter().filter(|p| alive(p)).collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for port in ports {
        assert!(!listening(port), "port {port} still taken");
    }
}

fn topology_ports(ports: native::Ports) -> native::TopologyPorts {
    native::TopologyPorts {
        topology: native::Topology::Single,
        ports: native::SERVICES.iter().copied().zip(ports).collect(),
    }
}

/// What `up` used to find out half-way, with Redis and the lock nodes already started (and
/// left running), or with a raw bash error: a setting that is no number, a port that is
/// none, a binary that is not there. Refused first, by name, with nothing started.
#[tokio::test(flavor = "multi_thread")]
async fn the_native_stack_refuses_bad_settings_before_starting_anything() {
    let run_dir = tempfile::tempdir().unwrap();
    let ports = native::free_ports();
    let script = repo_path("scripts/stack.sh");
    let inventory: &std::path::Path = env!("CARGO_BIN_EXE_inventory").as_ref();
    let _down = native::DownOnDrop {
        script: &script,
        run_dir: run_dir.path(),
        inventory,
    };
    /// The settings given, the binary, what `up` must say.
    type Case<'a> = (&'a [(&'a str, &'a str)], &'a std::path::Path, &'a str);
    let dollar = run_dir.path().join("p$q").display().to_string();
    let cases: [Case; 5] = [
        (
            &[("RUN_DIR", &dollar)],
            inventory,
            "holds a double quote, a $ or a line break",
        ),
        (
            &[("LOCK_WAIT_MS", "5s")],
            inventory,
            "LOCK_WAIT_MS is '5s'; valid: a whole number",
        ),
        (
            &[("READY_TIMEOUT_S", "-1")],
            inventory,
            "READY_TIMEOUT_S is '-1'",
        ),
        (
            &[("APP2_PORT", "0")],
            inventory,
            "APP2_PORT is '0'; valid: a port number in 1..=65535",
        ),
        (
            &[],
            "/nonexistent/inventory".as_ref(),
            "no binary at /nonexistent/inventory",
        ),
    ];
    for (env, binary, said) in cases {
        let up = native::stack_script_in(
            &script,
            run_dir.path(),
            &topology_ports(ports),
            binary,
            "up",
            env,
        );
        let out = text(&up);
        assert!(!up.status.success(), "{env:?}: {out}");
        assert!(out.contains(said), "{env:?}: {out}");
        assert!(!out.contains("started"), "{env:?}: {out}");
        for port in ports {
            assert!(
                !listening(port),
                "{env:?}: port {port} taken: something started"
            );
        }
    }
}

/// A run directory whose path holds spaces and the characters sed and nginx treat apart
/// (`&`, `|`): the stack starts, sells through nginx and stops. nginx refused its
/// configuration half-way through `up` ("invalid number of arguments in pid").
#[tokio::test(flavor = "multi_thread")]
async fn the_native_stack_runs_in_a_run_dir_with_spaces_and_sed_characters() {
    let parent = tempfile::tempdir().unwrap();
    let run_dir = parent.path().join("my stack & co | run");
    let ports = native::free_ports();
    let script = repo_path("scripts/stack.sh");
    let _down = native::DownOnDrop {
        script: &script,
        run_dir: &run_dir,
        inventory: env!("CARGO_BIN_EXE_inventory").as_ref(),
    };
    let up = stack_script(&run_dir, ports, "up");
    assert!(up.status.success(), "{}", text(&up));
    let http = reqwest::Client::new();
    let nginx = native::nginx_port(&ports);
    let reset = http
        .put(format!("http://127.0.0.1:{nginx}/inventory"))
        .header("content-type", "application/json")
        .body(r#"{"stock": 2}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(reset.status(), 200);
    let sale = http
        .post(format!(
            "http://127.0.0.1:{nginx}/inventory/sale?strategy=fenced"
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(sale.status(), 200);
    down_frees_every_port(&run_dir, ports);
}

/// An instance that refuses its settings exits at once: `up` says so from its log within
/// moments, instead of waiting out READY_TIMEOUT_S and then printing every log.
#[tokio::test(flavor = "multi_thread")]
async fn an_instance_that_exits_at_start_is_named_at_once_with_its_reason() {
    let run_dir = tempfile::tempdir().unwrap();
    let ports = native::free_ports();
    let script = repo_path("scripts/stack.sh");
    let inventory: &std::path::Path = env!("CARGO_BIN_EXE_inventory").as_ref();
    let _down = native::DownOnDrop {
        script: &script,
        run_dir: run_dir.path(),
        inventory,
    };
    let started = std::time::Instant::now();
    let up = native::stack_script_in(
        &script,
        run_dir.path(),
        &topology_ports(ports),
        inventory,
        "up",
        &[("LOCK_STRATEGY", "bogus"), ("READY_TIMEOUT_S", "60")],
    );
    let out = text(&up);
    assert!(!up.status.success(), "{out}");
    assert!(out.contains("app1 exited at start"), "{out}");
    assert!(out.contains("unknown strategy \"bogus\""), "{out}");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(30),
        "it waited {:?}: {out}",
        started.elapsed()
    );
}

/// Two `up` at once on one run directory start one stack: the second waits for the first,
/// then finds every service running. Each used to start what it saw stopped; the pid file
/// could name the copy that lost the port, and `down` then left the running one behind.
#[tokio::test(flavor = "multi_thread")]
async fn two_ups_at_once_start_one_stack_that_down_stops_whole() {
    let run_dir = tempfile::tempdir().unwrap();
    let ports = native::free_ports();
    let script = repo_path("scripts/stack.sh");
    let _down = native::DownOnDrop {
        script: &script,
        run_dir: run_dir.path(),
        inventory: env!("CARGO_BIN_EXE_inventory").as_ref(),
    };
    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(|| stack_script(run_dir.path(), ports, "up"));
        let b = s.spawn(|| stack_script(run_dir.path(), ports, "up"));
        (a.join().unwrap(), b.join().unwrap())
    });
    assert!(a.status.success(), "{}", text(&a));
    assert!(b.status.success(), "{}", text(&b));
    let pids: Vec<String> = native::pid_files(run_dir.path())
        .iter()
        .map(|f| std::fs::read_to_string(f).unwrap().trim().to_owned())
        .collect();
    for pid in &pids {
        assert!(alive(pid), "a pid file names {pid}, which is not running");
    }
    down_frees_every_port(run_dir.path(), ports);
}

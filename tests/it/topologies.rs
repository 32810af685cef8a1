//! The native stack's other topologies (`make up TOPOLOGY=sentinel`, `make up CLUSTER=1`),
//! run by `scripts/stack.sh` on free ports in a run directory of their own: the sentinel
//! stack sells through nginx again by itself after its master is killed, `status` tells who
//! is master of what, and `down` leaves no process and no listening port behind.

use std::path::Path;
use std::process::Output;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use testkit::native::{self, Topology, TopologyPorts};

use crate::harness::repo_path;
use crate::leaks::Footprint;

/// The sentinels' timing the test gives the stack (its defaults too).
const DOWN_AFTER_MS: u64 = 1_000;
const FAILOVER_TIMEOUT_MS: u64 = 3_000;

/// A topology's stack on free ports in a temporary run directory, with the debug binary;
/// `down` once more when dropped, so a failed assertion leaves nothing running.
struct TopologyStack {
    run_dir: tempfile::TempDir,
    ports: TopologyPorts,
}

impl TopologyStack {
    fn new(topology: Topology) -> Self {
        Self {
            run_dir: tempfile::tempdir().unwrap(),
            ports: TopologyPorts::free(topology),
        }
    }

    fn run(&self, verb: &str) -> (Output, String) {
        let output = native::stack_script_in(
            &repo_path("scripts/stack.sh"),
            self.run_dir.path(),
            &self.ports,
            env!("CARGO_BIN_EXE_inventory").as_ref(),
            verb,
            &[
                ("DOWN_AFTER_MS", &DOWN_AFTER_MS.to_string()),
                ("FAILOVER_TIMEOUT_MS", &FAILOVER_TIMEOUT_MS.to_string()),
            ],
        );
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        (output, text)
    }

    /// `stack.sh <verb>`, which must succeed; what it printed.
    fn script(&self, verb: &str) -> String {
        let (output, text) = self.run(verb);
        assert!(output.status.success(), "stack.sh {verb}: {text}");
        text
    }

    fn pid(&self, service: &str) -> Option<u32> {
        let file = self.run_dir.path().join(format!("{service}.pid"));
        Some(std::fs::read_to_string(file).ok()?.trim().parse().unwrap())
    }

    /// Every process it started (by pid file), every port it may listen on, its directory.
    fn footprint(&self) -> Footprint {
        Footprint {
            dirs: vec![self.run_dir.path().to_owned()],
            leaders: self
                .ports
                .topology
                .services()
                .iter()
                .filter_map(|s| self.pid(s))
                .collect(),
            ports: self.ports.all(),
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.ports.port("nginx"))
    }

    /// `up` of a sentinel stack, which must name `master` (a service) as the master; what
    /// `up` and then `status` printed.
    fn up_with_master(&self, master: &str) -> (String, String) {
        let up = self.script("up");
        assert!(up.contains("stack ready (sentinel)"), "{up}");
        let status = self.script("status");
        assert!(
            status.contains(&format!(
                "master now (says sentinel1): 127.0.0.1:{}",
                self.ports.port(master)
            )),
            "{up}\n{status}"
        );
        (up, status)
    }

    /// The default item's audit, through nginx.
    async fn audit(&self, http: &reqwest::Client) -> serde_json::Value {
        http.get(self.url("/inventory/audit"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.run_dir.path().join(format!("{name}.log"))).unwrap_or_default()
    }
}

impl Drop for TopologyStack {
    fn drop(&mut self) {
        let _ = self.run("down");
    }
}

fn alive(pid: u32) -> bool {
    testkit::ProcStat::read(pid).is_some_and(|p| !p.is_zombie())
}

async fn redis_field(port: u16, section: &str, field: &str) -> Option<String> {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}")).ok()?;
    let mut c = client.get_multiplexed_async_connection().await.ok()?;
    let info: String = redis::cmd("INFO")
        .arg(section)
        .query_async(&mut c)
        .await
        .ok()?;
    info.lines()
        .find_map(|l| l.trim().strip_prefix(&format!("{field}:")))
        .map(str::to_owned)
}

/// Until both replicas have applied all the master wrote (the stock included), so that the
/// failover below tests availability, not what asynchronous replication may lose.
async fn wait_for_replicas(stack: &TopologyStack) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let master = stack.ports.port("redis");
    loop {
        let written = redis_field(master, "replication", "master_repl_offset").await;
        let mut caught_up = written.is_some();
        for replica in ["replica1", "replica2"] {
            let applied = redis_field(
                stack.ports.port(replica),
                "replication",
                "slave_repl_offset",
            )
            .await;
            let behind = match (&written, applied) {
                (Some(w), Some(a)) => a.parse::<u64>().unwrap() < w.parse::<u64>().unwrap(),
                _ => true,
            };
            caught_up &= !behind;
        }
        if caught_up {
            return;
        }
        assert!(Instant::now() < deadline, "the replicas never caught up");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_sentinel_stack_sells_through_nginx_again_within_down_after_plus_failover_timeout_plus_2_s_of_its_master_killed()
 {
    let stack = TopologyStack::new(Topology::Sentinel);
    let up = stack.script("up");
    assert!(up.contains("stack ready (sentinel)"), "{up}");
    let footprint = stack.footprint();
    assert_eq!(
        footprint.leaders.len(),
        Topology::Sentinel.services().len(),
        "{up}"
    );
    let master_port = stack.ports.port("redis");
    let status = stack.script("status");
    assert!(status.contains("topology: sentinel"), "{status}");
    assert!(
        status.contains(&format!(
            "master now (says sentinel1): 127.0.0.1:{master_port}"
        )),
        "{status}"
    );
    for replica in ["replica1", "replica2"] {
        assert!(
            status.contains(&format!(
                "{replica} 127.0.0.1:{}: replica of 127.0.0.1:{master_port}, link up, offset ",
                stack.ports.port(replica)
            )),
            "{status}"
        );
    }

    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    let reset = http
        .put(stack.url("/inventory"))
        .header("content-type", "application/json")
        .body(r#"{"stock": 50}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(reset.status(), 200);
    let sale = http
        .post(stack.url("/inventory/sale?strategy=fenced"))
        .send()
        .await
        .unwrap();
    assert_eq!(sale.status(), 200);
    wait_for_replicas(&stack).await;
    let instances = [stack.pid("app1").unwrap(), stack.pid("app2").unwrap()];

    let master = stack.pid("redis").unwrap();
    let killed_at = Instant::now();
    kill(Pid::from_raw(master as i32), Signal::SIGKILL).unwrap();
    let limit = Duration::from_millis(DOWN_AFTER_MS + FAILOVER_TIMEOUT_MS + 2_000);
    let mut failures = Vec::new();
    // Every sale made after the kill: the first at once, so it meets the dead master.
    let resumed = loop {
        match http
            .post(stack.url("/inventory/sale?strategy=fenced"))
            .send()
            .await
        {
            Ok(reply) if reply.status() == 200 => break killed_at.elapsed(),
            Ok(reply) => failures.push(reply.status().as_u16().to_string()),
            Err(e) => failures.push(e.to_string()),
        }
        assert!(
            killed_at.elapsed() < limit,
            "no sale within {limit:?} of the master's kill; answers: {failures:?}\n\
             status:\n{}\n{}",
            stack.run("status").1,
            [
                "sentinel1",
                "sentinel2",
                "sentinel3",
                "replica1",
                "replica2",
                "app1"
            ]
            .map(|s| format!("{s}:\n{}", stack.log(s)))
            .join("\n")
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    eprintln!(
        "sales resumed {resumed:?} after the master was killed ({} refused meanwhile)",
        failures.len()
    );
    // Both instances sell again, and neither was restarted.
    for _ in 0..4 {
        let sale = http
            .post(stack.url("/inventory/sale?strategy=fenced"))
            .send()
            .await
            .unwrap();
        assert_eq!(sale.status(), 200);
    }
    assert!(instances.iter().all(|pid| alive(*pid)));
    assert_eq!(
        [stack.pid("app1").unwrap(), stack.pid("app2").unwrap()],
        instances
    );

    // `status` names a replica as the master now.
    let status = stack.script("status");
    let promoted = ["replica1", "replica2"]
        .iter()
        .find(|r| {
            status.contains(&format!(
                "master now (says sentinel1): 127.0.0.1:{}",
                stack.ports.port(r)
            ))
        })
        .unwrap_or_else(|| panic!("no replica named master: {status}"));
    assert!(
        status.contains(&format!(
            "{promoted} 127.0.0.1:{}: master",
            stack.ports.port(promoted)
        )),
        "{status}"
    );
    assert!(status.contains("redis: stopped"), "{status}");
    let audit = async || {
        let audit = stack.audit(&http).await;
        (audit["remaining"].clone(), audit["sales"].clone())
    };
    let before = audit().await;

    let down = stack.script("down");
    for service in Topology::Sentinel.services() {
        assert!(down.contains(&format!("{service} stopped")), "{down}");
    }
    footprint.assert_gone().await;
    assert!(
        !stack.run_dir.path().join("sentinel1.conf").exists(),
        "down forgets what the sentinels learnt"
    );

    // `up` again starts from the master at the time of `down`, the promoted replica, whose
    // data is the newest: the old master on REDIS_PORT rejoins as its replica, instead of
    // being master again with the stock of before the failover (the sales answered 200
    // since then were for sale again).
    let (_, status) = stack.up_with_master(promoted);
    assert_eq!(audit().await, before, "{status}");
    let footprint = stack.footprint();
    stack.script("down");
    footprint.assert_gone().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_cluster_stack_shows_each_masters_slots_and_replica_then_stops_without_leftovers() {
    let stack = TopologyStack::new(Topology::Cluster);
    let up = stack.script("up");
    assert!(up.contains("cluster created"), "{up}");
    let knows_cluster = std::process::Command::new(env!("CARGO_BIN_EXE_inventory"))
        .arg("--help")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains("REDIS_CLUSTER"))
        .unwrap();
    if !knows_cluster {
        assert!(
            up.contains("not started on the cluster yet"),
            "says why no instance runs: {up}"
        );
        assert_eq!(stack.pid("app1"), None, "{up}");
        assert_eq!(stack.pid("nginx"), None, "{up}");
    } else {
        // The instances run on the cluster (REDIS_CLUSTER) behind nginx, and sell.
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(5))
            .build()
            .unwrap();
        let reset = http
            .put(stack.url("/inventory"))
            .header("content-type", "application/json")
            .body(r#"{"stock": 5}"#)
            .send()
            .await
            .unwrap();
        assert_eq!(reset.status(), 200, "{}", stack.log("app1"));
        for strategy in ["fenced", "atomic", "optimistic", "redlock"] {
            let sale = http
                .post(stack.url(&format!("/inventory/sale?strategy={strategy}")))
                .send()
                .await
                .unwrap();
            assert_eq!(sale.status(), 200, "{strategy}: {}", stack.log("app1"));
        }
    }
    let footprint = stack.footprint();
    assert!(footprint.leaders.len() >= 6, "{footprint:?}");
    assert!(!footprint.processes().is_empty());

    let status = stack.script("status");
    assert!(status.contains("topology: cluster"), "{status}");
    assert!(status.contains("cluster_state: ok"), "{status}");
    let masters: Vec<&str> = status
        .lines()
        .filter(|l| l.starts_with("master "))
        .collect();
    let replicas: Vec<&str> = status
        .lines()
        .filter(|l| l.starts_with("replica "))
        .collect();
    assert_eq!((masters.len(), replicas.len()), (3, 3), "{status}");
    let mut slots: Vec<&str> = masters
        .iter()
        .map(|l| {
            l.split(" slots ")
                .nth(1)
                .unwrap()
                .split(' ')
                .next()
                .unwrap()
        })
        .collect();
    slots.sort();
    assert_eq!(slots, ["0-5460", "10923-16383", "5461-10922"], "{status}");
    for replica in &replicas {
        let followed = replica.split(" follows ").nth(1).unwrap();
        let followed = followed.split(' ').next().unwrap();
        assert!(
            masters
                .iter()
                .any(|m| m.split(' ').nth(2) == Some(followed)),
            "{replica} follows no master: {status}"
        );
    }

    // `up` again: nothing restarted, the cluster not created twice.
    let again = stack.script("up");
    assert!(!again.contains("cluster created"), "{again}");
    // Six nodes, and with the instances three lock nodes, two instances and nginx.
    let services = if knows_cluster { 12 } else { 6 };
    assert_eq!(
        again.matches("already running").count(),
        services,
        "{again}"
    );

    stack.script("down");
    footprint.assert_gone().await;
    assert!(!Path::new(&stack.run_dir.path().join("node1/nodes.conf")).exists());
}

/// A stack of one topology must be stopped before another starts in its run directory.
#[tokio::test(flavor = "multi_thread")]
async fn a_running_stack_refuses_another_topology_until_it_is_down() {
    let stack = TopologyStack::new(Topology::Cluster);
    stack.script("up");
    let sentinel = TopologyStack {
        run_dir: tempfile::tempdir().unwrap(),
        ports: TopologyPorts::free(Topology::Sentinel),
    };
    // Same run directory, other topology.
    let output = native::stack_script_in(
        &repo_path("scripts/stack.sh"),
        stack.run_dir.path(),
        &sentinel.ports,
        env!("CARGO_BIN_EXE_inventory").as_ref(),
        "up",
        &[],
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(
        stderr.contains("runs as topology cluster") && stderr.contains("down first"),
        "{stderr}"
    );
    assert_eq!(
        std::fs::read_to_string(stack.run_dir.path().join("topology"))
            .unwrap()
            .trim(),
        "cluster"
    );
    let footprint = stack.footprint();
    stack.script("down");
    footprint.assert_gone().await;
}

/// `make up` keeps the single topology; `TOPOLOGY=...` and `CLUSTER=1` reach `stack.sh`.
#[test]
fn make_up_passes_the_topology_and_reads_cluster_1_as_the_cluster_topology() {
    let dry_run = |args: &[&str]| {
        let output = std::process::Command::new("make")
            .args(["-n", "up"])
            .args(args)
            .current_dir(repo_path(""))
            .env_remove("TOPOLOGY")
            .env_remove("CLUSTER")
            .output()
            .expect("make");
        assert!(output.status.success());
        let text = String::from_utf8_lossy(&output.stdout).into_owned();
        text.lines()
            .find(|l| l.contains("scripts/stack.sh up"))
            .unwrap_or_else(|| panic!("no stack.sh up in: {text}"))
            .to_owned()
    };
    assert!(dry_run(&[]).contains("TOPOLOGY=single "));
    assert!(dry_run(&["TOPOLOGY=sentinel"]).contains("TOPOLOGY=sentinel "));
    assert!(dry_run(&["TOPOLOGY=cluster"]).contains("TOPOLOGY=cluster "));
    assert!(dry_run(&["CLUSTER=1"]).contains("TOPOLOGY=cluster "));
}

/// `up` repairs a cluster stack whose master was killed, and the master's items survive:
/// restarted before its replica took over, the node is still master of its slots, and it
/// came back empty (nothing on disk) and its replica copied it, so every item of the shard
/// answered 404 `unknown_item`. It now reloads its append-only file.
#[tokio::test(flavor = "multi_thread")]
async fn a_cluster_master_killed_and_restarted_by_up_at_once_keeps_its_items() {
    let stack = TopologyStack::new(Topology::Cluster);
    stack.script("up");
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    // Items whose slots node1, a master of the fresh cluster (slots 0-5460), serves.
    let mut node1 = redis::Client::open(format!("redis://127.0.0.1:{}", stack.ports.port("node1")))
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let mut items = Vec::new();
    for n in 0.. {
        let item = format!("k{n}");
        let slot: u16 = redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(format!("inventory:{{{item}}}:stock"))
            .query_async(&mut node1)
            .await
            .unwrap();
        if slot <= 5460 {
            items.push(item);
        }
        if items.len() == 4 {
            break;
        }
    }
    for item in &items {
        let stocked = http
            .put(stack.url(&format!("/inventory/{item}")))
            .header("content-type", "application/json")
            .body(r#"{"stock": 7}"#)
            .send()
            .await
            .unwrap();
        assert_eq!(stocked.status(), 200, "{item}: {}", stack.log("app1"));
    }
    // Past the append-only file's fsync (every second), then killed, and `up` at once,
    // well within the 1 s cluster-node-timeout.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let pid = stack.pid("node1").unwrap();
    kill(Pid::from_raw(pid as i32), Signal::SIGKILL).unwrap();
    stack.script("up");
    for item in &items {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let read = http
                .get(stack.url(&format!("/inventory/{item}")))
                .send()
                .await
                .unwrap();
            let status = read.status().as_u16();
            let body: serde_json::Value = read.json().await.unwrap_or_default();
            if status == 200 {
                assert_eq!(body["stock"], 7, "{item}: {body}");
                break;
            }
            assert!(
                status == 503 && Instant::now() < deadline,
                "{item}: {status} {body}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    stack.script("down");
}

/// `up` repairs a sentinel stack whose sentinels and master were all killed after a
/// failover (one sentinel was down during it): it starts the master the sentinels last
/// named (from their own files, the one with the highest configuration epoch) first,
/// with its data, and the others as its replicas, instead of the server on REDIS_PORT, an
/// old master, as a replica of its own replicas (a replication loop: "stack ready" and then
/// 503s until the sentinels sorted it out).
#[tokio::test(flavor = "multi_thread")]
async fn up_repairs_a_sentinel_stack_whose_sentinels_and_master_were_killed_after_a_failover() {
    let stack = TopologyStack::new(Topology::Sentinel);
    stack.script("up");
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    let sell = async || {
        http.post(stack.url("/inventory/sale?strategy=fenced"))
            .send()
            .await
            .map(|r| r.status().as_u16())
            .unwrap_or(0)
    };
    let reset = http
        .put(stack.url("/inventory"))
        .header("content-type", "application/json")
        .body(r#"{"stock": 20}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(reset.status(), 200);
    for _ in 0..3 {
        assert_eq!(sell().await, 200);
    }
    // sentinel1 is down during the failover: its file still names the old master, at the
    // epoch before (the first file was taken as it came, and the old master came back
    // as master, its replicas copying its old data: 50 sales lost, found from outside).
    let pid = stack.pid("sentinel1").unwrap();
    kill(Pid::from_raw(pid as i32), Signal::SIGKILL).unwrap();
    let sentinel = format!("redis://127.0.0.1:{}", stack.ports.port("sentinel2"));
    let mut sentinel = redis::Client::open(sentinel)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let master = async |c: &mut redis::aio::MultiplexedConnection| -> u16 {
        let addr: Vec<String> = redis::cmd("SENTINEL")
            .arg("GET-MASTER-ADDR-BY-NAME")
            .arg("inventory")
            .query_async(c)
            .await
            .unwrap();
        addr[1].parse().unwrap()
    };
    let _: () = redis::cmd("SENTINEL")
        .arg("FAILOVER")
        .arg("inventory")
        .query_async(&mut sentinel)
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    let promoted = loop {
        let now = master(&mut sentinel).await;
        if now != stack.ports.port("redis") {
            break now;
        }
        assert!(Instant::now() < deadline, "no failover");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let promoted = ["replica1", "replica2"]
        .into_iter()
        .find(|r| stack.ports.port(r) == promoted)
        .unwrap();
    // Sales on the new master, then every sentinel and that master killed.
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut sold = 3;
    while sold < 6 {
        if sell().await == 200 {
            sold += 1;
        }
        assert!(Instant::now() < deadline, "no sales after the failover");
    }
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    for service in ["sentinel2", "sentinel3", promoted] {
        let pid = stack.pid(service).unwrap();
        kill(Pid::from_raw(pid as i32), Signal::SIGKILL).unwrap();
    }
    let (up, status) = stack.up_with_master(promoted);
    // One master among the servers: the old one, if the sentinels had not yet made it a
    // replica when they were killed, was made one by `up`.
    assert_eq!(status.matches(": master, ").count(), 1, "{up}\n{status}");
    let started = Instant::now();
    while sell().await != 200 {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "no sale within 5 s of up: {}",
            stack.run("status").1
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let audit = stack.audit(&http).await;
    assert_eq!(
        (&audit["sales"], &audit["remaining"]),
        (&7.into(), &13.into()),
        "{audit}"
    );
    let footprint = stack.footprint();
    stack.script("down");
    footprint.assert_gone().await;
}

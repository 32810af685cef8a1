//! A Redis Cluster of real `redis-server` processes on free loopback ports: three masters
//! and a replica of each, set up for fast failover (`cluster-node-timeout` 1 s), with the
//! faults a cluster client must survive: a master killed ([`RedisCluster::kill_master`],
//! then [`RedisCluster::wait_for_failover`]) and a slot moved to another master, finished
//! (`MOVED`) or stopped half-way (`ASK`, [`RedisCluster::migrate_slot`]).
//!
//! A test fixture: it panics on failure, with the cluster's view and the nodes' logs in the
//! message. Each node is a [`RedisProcess`] (a process group of its own, in a temporary
//! directory); dropping the cluster stops them all, also when a test panics.

// A panic is how a test fixture reports a failure.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::ops::RangeInclusive;
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use tokio::time::Instant;

use crate::RedisProcess;

/// A node unreachable for this long is failed by the others, and its replica promoted.
pub const NODE_TIMEOUT: Duration = Duration::from_millis(1000);

/// Masters, and replicas per master.
const MASTERS: usize = 3;
const NODES: usize = MASTERS * 2;

/// How long the cluster may take to form, and a migration's slot to settle everywhere.
const SETTLE_WITHIN: Duration = Duration::from_secs(20);

/// A port free for a cluster node: its own and its bus port (port + 10000) were both free a
/// moment ago. A node that then fails to bind either is started again on another pick.
pub fn free_cluster_port() -> anyhow::Result<u16> {
    for _ in 0..100 {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let port = listener.local_addr()?.port();
        let Some(bus) = port.checked_add(10_000) else {
            continue;
        };
        if TcpListener::bind(("127.0.0.1", bus)).is_ok() {
            return Ok(port);
        }
    }
    anyhow::bail!("no port with a free bus port (port + 10000) on 127.0.0.1")
}

/// One node as the cluster sees it (a line of `CLUSTER NODES`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterNodeInfo {
    pub id: String,
    pub port: u16,
    /// Slot ranges it serves (a master); empty for a replica.
    pub slots: Vec<RangeInclusive<u16>>,
    /// The master it replicates (a replica).
    pub master_id: Option<String>,
    /// Failed (`fail`) or suspected (`fail?`) by the node asked.
    pub failing: bool,
}

impl ClusterNodeInfo {
    pub fn is_master(&self) -> bool {
        self.master_id.is_none()
    }

    pub fn serves(&self, slot: u16) -> bool {
        self.slots.iter().any(|r| r.contains(&slot))
    }

    /// `127.0.0.1:port`, as redirections name it.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub fn url(&self) -> String {
        format!("redis://{}", self.addr())
    }
}

/// How far [`RedisCluster::migrate_slot`] goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Migration {
    /// Every key moved and the slot handed over: the old owner answers `MOVED`.
    Finish,
    /// Importing and migrating states set and at most this many keys moved, then stop:
    /// the old owner answers `ASK` for a key it no longer has.
    StopAfterKeys(usize),
}

pub struct RedisCluster {
    /// Every node it started, killed ones included (a killed node's process is reaped; its
    /// directory and log stay until the cluster drops).
    nodes: Vec<RedisProcess>,
    killed: Vec<u16>,
    /// Nodes taken out of the cluster ([`RedisCluster::remove_node`]), still running: no
    /// longer among the live ones the cluster's checks and seeds use.
    removed: Vec<u16>,
}

impl RedisCluster {
    /// Six nodes joined by `redis-cli --cluster create --cluster-replicas 1`; returns once
    /// every node says `cluster_state:ok`, knows all six, and every replica's link to its
    /// master is up.
    pub async fn start() -> Self {
        let mut nodes = Vec::with_capacity(NODES);
        for _ in 0..NODES {
            nodes.push(Self::start_node().await);
        }
        let cluster = Self {
            nodes,
            killed: Vec::new(),
            removed: Vec::new(),
        };
        let addrs: Vec<String> = cluster
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let output = tokio::process::Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()
            .await
            .expect("run redis-cli (apt-get install redis-tools)");
        assert!(
            output.status.success(),
            "redis-cli --cluster create failed:\n{}{}\n{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr),
            cluster.logs()
        );
        cluster
            .wait_until("the cluster to form", SETTLE_WITHIN, |c| c.formed())
            .await;
        cluster
    }

    /// One cluster-enabled `redis-server`, in no cluster yet.
    async fn start_node() -> RedisProcess {
        let timeout = NODE_TIMEOUT.as_millis().to_string();
        let extra = [
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            &timeout,
            // A replica takes over however long it was cut off: with one replica per master
            // there is nobody better, and a test that kills a master wants the failover.
            "--cluster-replica-validity-factor",
            "0",
            // The other masters keep serving their slots while one shard has no master
            // (the default stops the whole cluster until every slot is served again).
            "--cluster-require-full-coverage",
            "no",
        ];
        RedisProcess::start_picking(free_cluster_port, &extra)
            .await
            .unwrap_or_else(|e| panic!("a cluster node did not start: {e:#}"))
    }

    /// A new master with no slots, joined as `redis-cli --cluster add-node` joins one;
    /// returns once every live node knows it.
    pub async fn add_master(&mut self) -> ClusterNodeInfo {
        let node = Self::start_node().await;
        let port = node.port;
        self.nodes.push(node);
        let first = self.live_ports().next().expect("a live node");
        let () = redis::cmd("CLUSTER")
            .arg("MEET")
            .arg("127.0.0.1")
            .arg(port)
            .query_async(&mut self.node_connection(first).await)
            .await
            .expect("CLUSTER MEET");
        let known = self.live_ports().count();
        self.wait_until(
            "every node to know the new master",
            SETTLE_WITHIN,
            |c| async move {
                for p in c.live_ports() {
                    match c.nodes_seen_by(p).await {
                        Ok(nodes) if nodes.len() == known => {}
                        _ => return false,
                    }
                }
                // It takes part (imports, answers) only once it has learnt every slot's owner.
                c.cluster_info(port)
                    .await
                    .get("cluster_state")
                    .map(String::as_str)
                    == Some("ok")
            },
        )
        .await;
        self.nodes_seen_by(port)
            .await
            .expect("CLUSTER NODES")
            .into_iter()
            .find(|n| n.port == port)
            .expect("the new node knows itself")
    }

    /// Takes `node` (a master without slots) out of the cluster as `redis-cli --cluster
    /// del-node` does: every other node forgets it, and it is reset (`CLUSTER RESET SOFT`)
    /// and left running, a node of no cluster that answers every key with `CLUSTERDOWN`.
    pub async fn remove_node(&mut self, node: &ClusterNodeInfo) {
        let others: Vec<u16> = self.live_ports().filter(|&p| p != node.port).collect();
        for port in &others {
            let () = redis::cmd("CLUSTER")
                .arg("FORGET")
                .arg(&node.id)
                .query_async(&mut self.node_connection(*port).await)
                .await
                .expect("CLUSTER FORGET");
        }
        let () = redis::cmd("CLUSTER")
            .arg("RESET")
            .arg("SOFT")
            .query_async(&mut self.node_connection(node.port).await)
            .await
            .expect("CLUSTER RESET SOFT");
        self.removed.push(node.port);
    }

    async fn formed(&self) -> bool {
        for port in self.live_ports() {
            if self
                .cluster_info(port)
                .await
                .get("cluster_state")
                .map(String::as_str)
                != Some("ok")
            {
                return false;
            }
            let Ok(nodes) = self.nodes_seen_by(port).await else {
                return false;
            };
            if nodes.len() != NODES {
                return false;
            }
        }
        let replicas = self.replicas().await;
        if replicas.len() != MASTERS {
            return false;
        }
        for replica in replicas {
            if self
                .replication(replica.port)
                .await
                .get("master_link_status")
                .map(String::as_str)
                != Some("up")
            {
                return false;
            }
        }
        true
    }

    /// `redis://127.0.0.1:port` of every live node: seeds for a cluster client.
    pub fn seed_urls(&self) -> Vec<String> {
        self.live_ports()
            .map(|p| format!("redis://127.0.0.1:{p}"))
            .collect()
    }

    fn live_ports(&self) -> impl Iterator<Item = u16> + '_ {
        self.nodes
            .iter()
            .map(|n| n.port)
            .filter(|p| !self.killed.contains(p) && !self.removed.contains(p))
    }

    /// A connection to one node (no redirections followed: what a node answers itself).
    pub async fn node_connection(&self, port: u16) -> MultiplexedConnection {
        redis::Client::open(format!("redis://127.0.0.1:{port}"))
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap_or_else(|e| panic!("cannot connect to cluster node {port}: {e}"))
    }

    /// A cluster client's connection, seeded with every live node.
    pub async fn client(&self) -> redis::cluster_async::ClusterConnection {
        redis::cluster::ClusterClient::new(self.seed_urls())
            .unwrap()
            .get_async_connection()
            .await
            .unwrap_or_else(|e| panic!("cluster client: {e}\n{}", self.logs()))
    }

    /// The nodes as the first live node sees them, masters first, each group by port.
    pub async fn nodes(&self) -> Vec<ClusterNodeInfo> {
        for port in self.live_ports() {
            if let Ok(nodes) = self.nodes_seen_by(port).await {
                return nodes;
            }
        }
        panic!(
            "no live cluster node answers CLUSTER NODES\n{}",
            self.logs()
        )
    }

    /// The masters that serve slots and are not failing, in slot order: index `i` of
    /// [`kill_master`](Self::kill_master) is an index into this list.
    pub async fn masters(&self) -> Vec<ClusterNodeInfo> {
        let mut masters: Vec<_> = self
            .nodes()
            .await
            .into_iter()
            .filter(|n| n.is_master() && !n.slots.is_empty() && !n.failing)
            .collect();
        masters.sort_by_key(|m| m.slots.first().map(|r| *r.start()));
        masters
    }

    /// The replicas that are not failing, with the master each follows in `master_id`.
    pub async fn replicas(&self) -> Vec<ClusterNodeInfo> {
        self.nodes()
            .await
            .into_iter()
            .filter(|n| !n.is_master() && !n.failing)
            .collect()
    }

    /// The master that serves `slot` now.
    pub async fn master_for_slot(&self, slot: u16) -> ClusterNodeInfo {
        self.masters()
            .await
            .into_iter()
            .find(|m| m.serves(slot))
            .unwrap_or_else(|| panic!("no master serves slot {slot}\n{}", self.logs()))
    }

    /// The slot of `key` (`CLUSTER KEYSLOT`, asked of a node).
    pub async fn slot_of(&self, key: &str) -> u16 {
        let port = self.live_ports().next().expect("a live node");
        let mut c = self.node_connection(port).await;
        redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(key)
            .query_async(&mut c)
            .await
            .unwrap()
    }

    /// Waits until every replica has acknowledged everything its master has written, so
    /// that a master killed next loses nothing.
    pub async fn wait_for_replication(&self) {
        self.wait_until("the replicas to catch up", SETTLE_WITHIN, |c| async move {
            for replica in c.replicas().await {
                let Some(master) = c
                    .nodes()
                    .await
                    .into_iter()
                    .find(|n| Some(&n.id) == replica.master_id.as_ref())
                else {
                    return false;
                };
                let written = c.replication(master.port).await;
                let applied = c.replication(replica.port).await;
                let offset = |m: &BTreeMap<String, String>, k: &str| {
                    m.get(k).and_then(|v| v.parse::<u64>().ok())
                };
                match (
                    offset(&written, "master_repl_offset"),
                    offset(&applied, "slave_repl_offset"),
                ) {
                    (Some(w), Some(a)) if a >= w => {}
                    _ => return false,
                }
            }
            true
        })
        .await
    }

    /// Kills master `i` of [`masters`](Self::masters) with SIGKILL (a crash) and returns it
    /// as it was.
    pub async fn kill_master(&mut self, i: usize) -> ClusterNodeInfo {
        let masters = self.masters().await;
        let master = masters
            .get(i)
            .unwrap_or_else(|| panic!("no master {i}: {masters:#?}"))
            .clone();
        let node = self
            .nodes
            .iter_mut()
            .find(|n| n.port == master.port)
            .expect("the master is one of ours");
        node.stop().await;
        self.killed.push(master.port);
        master
    }

    /// Waits until a replica of `killed` is a master serving its slots and every live node
    /// says `cluster_state:ok` again; returns the promoted node. Panics after `within` with
    /// the cluster's view and the logs.
    pub async fn wait_for_failover(
        &self,
        killed: &ClusterNodeInfo,
        within: Duration,
    ) -> ClusterNodeInfo {
        let started = Instant::now();
        let promoted = |nodes: Vec<ClusterNodeInfo>| {
            nodes.into_iter().find(|n| {
                n.id != killed.id
                    && n.is_master()
                    && !n.failing
                    && killed.slots.iter().all(|r| n.slots.contains(r))
            })
        };
        let promoted = &promoted;
        let done = self
            .poll(within, move || async move {
                for port in self.live_ports() {
                    let state = self.cluster_info(port).await;
                    if state.get("cluster_state").map(String::as_str) != Some("ok") {
                        return None;
                    }
                    promoted(self.nodes_seen_by(port).await.ok()?)?;
                }
                promoted(self.nodes().await)
            })
            .await;
        if let Some(node) = done {
            return node;
        }
        panic!(
            "no replica of the killed master {} took over its slots {:?} with \
             cluster_state:ok everywhere within {within:?} (waited {:?}); the cluster \
             now:\n{:#?}\n{}",
            killed.addr(),
            killed.slots,
            started.elapsed(),
            self.nodes_everywhere().await,
            self.logs()
        )
    }

    /// Moves `slot` from master `from` to master `to` the way `redis-cli --cluster
    /// reshard` does: `to` IMPORTING, `from` MIGRATING, `MIGRATE` of its keys in batches,
    /// then `SETSLOT ... NODE` on both and on every other master, waiting until every live
    /// node agrees. [`Migration::StopAfterKeys`] stops before the hand-over; calling again
    /// with [`Migration::Finish`] completes it. Returns how many keys were moved.
    pub async fn migrate_slot(
        &self,
        slot: u16,
        from: &ClusterNodeInfo,
        to: &ClusterNodeInfo,
        how: Migration,
    ) -> usize {
        let mut source = self.node_connection(from.port).await;
        let mut target = self.node_connection(to.port).await;
        let setslot = |state: &str, node: &str| {
            let mut cmd = redis::cmd("CLUSTER");
            cmd.arg("SETSLOT").arg(slot).arg(state).arg(node);
            cmd
        };
        let ok = |what: &str, r: redis::RedisResult<()>| {
            r.unwrap_or_else(|e| panic!("{what} of slot {slot}: {e}"))
        };
        ok(
            "SETSLOT IMPORTING",
            setslot("IMPORTING", &from.id)
                .query_async(&mut target)
                .await,
        );
        ok(
            "SETSLOT MIGRATING",
            setslot("MIGRATING", &to.id).query_async(&mut source).await,
        );
        let limit = match how {
            Migration::Finish => usize::MAX,
            Migration::StopAfterKeys(n) => n,
        };
        let mut moved = 0;
        while moved < limit {
            let batch = (limit - moved).min(100);
            let keys: Vec<String> = redis::cmd("CLUSTER")
                .arg("GETKEYSINSLOT")
                .arg(slot)
                .arg(batch)
                .query_async(&mut source)
                .await
                .unwrap();
            if keys.is_empty() {
                break;
            }
            ok(
                "MIGRATE",
                redis::cmd("MIGRATE")
                    .arg("127.0.0.1")
                    .arg(to.port)
                    .arg("")
                    .arg(0)
                    .arg(5000)
                    .arg("KEYS")
                    .arg(&keys)
                    .query_async(&mut source)
                    .await,
            );
            moved += keys.len();
        }
        if how != Migration::Finish {
            return moved;
        }
        // The new owner first, then the old one (which stops redirecting with ASK and starts
        // with MOVED), then the other masters, so no node goes back to the old owner.
        ok(
            "SETSLOT NODE",
            setslot("NODE", &to.id).query_async(&mut target).await,
        );
        // A master that gave its last slot away turns into a replica of the node that took
        // it (Redis 7, `cluster-allow-replica-migration`), and refuses SETSLOT from then on:
        // it has learnt the new owner already.
        match setslot("NODE", &to.id).query_async::<()>(&mut source).await {
            Err(e) if e.to_string().contains("only with masters") => {}
            r => ok("SETSLOT NODE", r),
        }
        for master in self.masters().await {
            if master.id != from.id && master.id != to.id {
                let mut c = self.node_connection(master.port).await;
                ok(
                    "SETSLOT NODE",
                    setslot("NODE", &to.id).query_async(&mut c).await,
                );
            }
        }
        let description = format!("every node to see slot {slot} on {}", to.addr());
        self.wait_until(&description, SETTLE_WITHIN, |c| async move {
            for port in c.live_ports() {
                let Ok(nodes) = c.nodes_seen_by(port).await else {
                    return false;
                };
                if !nodes.iter().any(|n| n.id == to.id && n.serves(slot)) {
                    return false;
                }
            }
            true
        })
        .await;
        moved
    }

    /// Every live node's own log, one after the other.
    pub fn logs(&self) -> String {
        self.nodes
            .iter()
            .map(|n| format!("--- node 127.0.0.1:{} ---\n{}", n.port, tail(&n.log(), 30)))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// The pid of each node still running, for leak checks.
    pub fn pids(&self) -> Vec<u32> {
        self.nodes.iter().filter_map(RedisProcess::pid).collect()
    }

    /// Each node's data directory (its working directory), for leak checks.
    pub fn dirs(&self) -> Vec<std::path::PathBuf> {
        self.nodes.iter().map(|n| n.dir().to_owned()).collect()
    }

    async fn nodes_seen_by(&self, port: u16) -> redis::RedisResult<Vec<ClusterNodeInfo>> {
        let mut c = redis::Client::open(format!("redis://127.0.0.1:{port}"))?
            .get_multiplexed_async_connection()
            .await?;
        let text: String = redis::cmd("CLUSTER")
            .arg("NODES")
            .query_async(&mut c)
            .await?;
        Ok(parse_cluster_nodes(&text))
    }

    async fn nodes_everywhere(&self) -> BTreeMap<u16, Vec<ClusterNodeInfo>> {
        let mut out = BTreeMap::new();
        for port in self.live_ports() {
            out.insert(port, self.nodes_seen_by(port).await.unwrap_or_default());
        }
        out
    }

    async fn info_section(&self, port: u16, cmd: redis::Cmd) -> BTreeMap<String, String> {
        let text: Option<String> = async {
            let mut c = redis::Client::open(format!("redis://127.0.0.1:{port}"))
                .ok()?
                .get_multiplexed_async_connection()
                .await
                .ok()?;
            cmd.query_async(&mut c).await.ok()
        }
        .await;
        text.unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().split_once(':'))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect()
    }

    async fn cluster_info(&self, port: u16) -> BTreeMap<String, String> {
        let mut cmd = redis::cmd("CLUSTER");
        cmd.arg("INFO");
        self.info_section(port, cmd).await
    }

    async fn replication(&self, port: u16) -> BTreeMap<String, String> {
        let mut cmd = redis::cmd("INFO");
        cmd.arg("replication");
        self.info_section(port, cmd).await
    }

    async fn poll<T, F, Fut>(&self, within: Duration, mut f: F) -> Option<T>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Option<T>>,
    {
        let deadline = Instant::now() + within;
        loop {
            if let Some(value) = f().await {
                return Some(value);
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn wait_until<'a, F, Fut>(&'a self, what: &str, within: Duration, f: F)
    where
        F: Fn(&'a Self) -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let done = self
            .poll(within, || {
                let check = f(self);
                async move { check.await.then_some(()) }
            })
            .await;
        if done.is_none() {
            panic!(
                "waited {within:?} for {what}; the cluster now:\n{:#?}\n{}",
                self.nodes_everywhere().await,
                self.logs()
            );
        }
    }
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// `CLUSTER NODES`: `<id> <ip:port@cport[,hostname]> <flags> <master> <ping-sent>
/// <pong-recv> <config-epoch> <link-state> <slot> <slot> ...`; a slot is `n`, `a-b`, or
/// `[n->-id]` / `[n-<-id]` while it migrates (skipped: its owner still lists it). Masters
/// first, each group by port.
pub fn parse_cluster_nodes(text: &str) -> Vec<ClusterNodeInfo> {
    let mut nodes: Vec<ClusterNodeInfo> = text
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let [id, addr, flags, master, _, _, _, _, slots @ ..] = fields.as_slice() else {
                return None;
            };
            let port = addr.split('@').next()?.rsplit_once(':')?.1.parse().ok()?;
            let flags: Vec<&str> = flags.split(',').collect();
            let slots = slots
                .iter()
                .filter(|s| !s.starts_with('['))
                .filter_map(|s| match s.split_once('-') {
                    Some((a, b)) => Some(a.parse().ok()?..=b.parse().ok()?),
                    None => {
                        let n = s.parse().ok()?;
                        Some(n..=n)
                    }
                })
                .collect();
            Some(ClusterNodeInfo {
                id: (*id).to_owned(),
                port,
                slots,
                master_id: flags
                    .contains(&"slave")
                    .then(|| (*master).to_owned())
                    .filter(|m| m != "-"),
                failing: flags.iter().any(|f| f.starts_with("fail")),
            })
        })
        .collect();
    nodes.sort_by_key(|n| (!n.is_master(), n.port));
    nodes
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn cluster_nodes_lines_are_read_with_slot_ranges_masters_and_failures() {
        let text = "\
a1 127.0.0.1:7001@17001 myself,master - 0 0 1 connected 0-5460 [5461->-b2]
b2 127.0.0.1:7002@17002,host master - 0 0 2 connected 5461-10922 16000
c3 127.0.0.1:7003@17003 master,fail - 0 0 3 disconnected
d4 127.0.0.1:7004@17004 slave a1 0 0 1 connected
e5 127.0.0.1:7005@17005 slave,fail? b2 0 0 2 connected
";
        let nodes = parse_cluster_nodes(text);
        assert_eq!(nodes.len(), 5);
        assert_eq!(nodes[0].port, 7001);
        assert_eq!(nodes[0].slots, vec![0..=5460]);
        assert!(nodes[0].is_master() && !nodes[0].failing);
        assert_eq!(nodes[1].slots, vec![5461..=10922, 16000..=16000]);
        assert!(nodes[1].serves(16000) && !nodes[1].serves(0));
        assert!(nodes[2].failing && nodes[2].slots.is_empty());
        assert_eq!(nodes[3].master_id.as_deref(), Some("a1"));
        assert!(nodes[4].failing && !nodes[4].is_master());
    }

    #[test]
    fn a_cluster_port_leaves_room_for_its_bus_port() {
        let port = free_cluster_port().unwrap();
        assert!(port <= u16::MAX - 10_000);
    }
}

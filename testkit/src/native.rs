//! `scripts/stack.sh`, the native stack of `make up`, run on free ports in a directory of
//! its own, so that tests can start, restart and stop it without touching a running demo.
//! [`SERVICES`] and [`stack_script`] are the default topology; [`Topology`],
//! [`TopologyPorts`] and [`stack_script_in`] any of them (`TOPOLOGY=sentinel`, `cluster`).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The stack's services, in the order `stack.sh` starts them; each listens on the port of
/// the variable `<SERVICE>_PORT`.
pub const SERVICES: [&str; 7] = ["redis", "lock1", "lock2", "lock3", "app1", "app2", "nginx"];

/// One port per service of [`SERVICES`], in that order.
pub type Ports = [u16; SERVICES.len()];

/// Free ports for every service, no two the same.
pub fn free_ports() -> Ports {
    let mut taken = Vec::new();
    SERVICES.map(|_| distinct_port(&mut taken, false))
}

/// A port the OS had free, that is none of `taken` (nor, for a cluster node, is its bus
/// port, port + 10000), added to `taken` with its bus port. A port is free only until
/// something binds it, and the OS hands a just-released one out again: asked for several
/// in a row, it once gave a cluster node and an instance the same port.
fn distinct_port(taken: &mut Vec<u16>, cluster_node: bool) -> u16 {
    for _ in 0..100 {
        let port = if cluster_node {
            crate::free_cluster_port()
        } else {
            crate::free_port()
        }
        .expect("a free port");
        let bus = port.checked_add(10_000);
        let clash =
            taken.contains(&port) || (cluster_node && bus.is_some_and(|bus| taken.contains(&bus)));
        if !clash {
            taken.push(port);
            if let (true, Some(bus)) = (cluster_node, bus) {
                taken.push(bus);
            }
            return port;
        }
    }
    panic!("no free port distinct from {taken:?}")
}

/// nginx's port: the stack's front door.
pub fn nginx_port(ports: &Ports) -> u16 {
    ports[SERVICES.len() - 1]
}

/// Runs `stack.sh <verb>` for the stack kept in `run_dir`, with `inventory` as its binary.
pub fn stack_script(
    script: &Path,
    run_dir: &Path,
    ports: &Ports,
    inventory: &Path,
    verb: &str,
) -> Output {
    let ports = TopologyPorts {
        topology: Topology::Single,
        ports: SERVICES
            .iter()
            .copied()
            .zip(ports.iter().copied())
            .collect(),
    };
    stack_script_in(script, run_dir, &ports, inventory, verb, &[])
}

/// The shapes `stack.sh up` starts (its `TOPOLOGY`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Topology {
    /// One redis-server, three lock nodes, two instances, nginx ([`SERVICES`]).
    Single,
    /// A master (`redis`), two replicas and three sentinels instead of the one server.
    Sentinel,
    /// Six Redis Cluster nodes (instances and nginx only once the binary reads
    /// `REDIS_CLUSTER`).
    Cluster,
}

impl Topology {
    /// Its name in `TOPOLOGY=` and in what `stack.sh status` prints.
    pub fn name(self) -> &'static str {
        match self {
            Topology::Single => "single",
            Topology::Sentinel => "sentinel",
            Topology::Cluster => "cluster",
        }
    }

    /// Every service whose `<SERVICE>_PORT` the topology may use, in start order.
    pub fn services(self) -> &'static [&'static str] {
        match self {
            Topology::Single => &SERVICES,
            Topology::Sentinel => &[
                "redis",
                "replica1",
                "replica2",
                "sentinel1",
                "sentinel2",
                "sentinel3",
                "lock1",
                "lock2",
                "lock3",
                "app1",
                "app2",
                "nginx",
            ],
            Topology::Cluster => &[
                "node1", "node2", "node3", "node4", "node5", "node6", "lock1", "lock2", "lock3",
                "app1", "app2", "nginx",
            ],
        }
    }
}

/// A port for every service of a topology.
#[derive(Debug, Clone)]
pub struct TopologyPorts {
    pub topology: Topology,
    pub ports: Vec<(&'static str, u16)>,
}

impl TopologyPorts {
    /// Free ports for every service; a cluster node's bus port (+ 10000) is free as well.
    pub fn free(topology: Topology) -> Self {
        let mut taken = Vec::new();
        let ports = topology
            .services()
            .iter()
            .map(|&service| {
                (
                    service,
                    distinct_port(&mut taken, service.starts_with("node")),
                )
            })
            .collect();
        Self { topology, ports }
    }

    pub fn port(&self, service: &str) -> u16 {
        self.ports
            .iter()
            .find(|(s, _)| *s == service)
            .unwrap_or_else(|| panic!("{service} is no service of {:?}", self.topology))
            .1
    }

    /// Every port the stack may listen on, cluster bus ports included.
    pub fn all(&self) -> Vec<u16> {
        let mut all: Vec<u16> = self.ports.iter().map(|(_, p)| *p).collect();
        for (service, port) in &self.ports {
            if service.starts_with("node") {
                all.push(port + 10_000);
            }
        }
        all
    }
}

/// Runs `TOPOLOGY=<topology> stack.sh <verb>` for the stack kept in `run_dir`, with
/// `inventory` as its binary and `env` on top (`DOWN_AFTER_MS`, say). `TOPOLOGY` and
/// `CLUSTER` of the caller's environment never leak in.
pub fn stack_script_in(
    script: &Path,
    run_dir: &Path,
    ports: &TopologyPorts,
    inventory: &Path,
    verb: &str,
    env: &[(&str, &str)],
) -> Output {
    let mut command = Command::new(script);
    command
        .arg(verb)
        .env("RUN_DIR", run_dir)
        .env("INVENTORY_BIN", inventory)
        .env("TOPOLOGY", ports.topology.name())
        .env_remove("CLUSTER");
    for (service, port) in &ports.ports {
        command.env(format!("{}_PORT", service.to_uppercase()), port.to_string());
    }
    command.envs(env.iter().copied());
    if verb == "up" {
        down_when_gone(std::process::id(), script, run_dir, inventory);
    }
    command.output().expect("run scripts/stack.sh")
}

/// Runs `stack.sh down` on `run_dir` once process `pid` (the test's own, when a test starts
/// a stack) is gone, however it ends. A failed assertion's `Drop` does it already
/// ([`DownOnDrop`]), but a test interrupted by a signal (Ctrl-C, the runner's SIGINT,
/// SIGKILL) runs no `Drop`, and the stack's daemons lead sessions of their own: whole stacks
/// stayed up, for good. A watchdog in a process group of its own, started once per run
/// directory and process; once the stack's own `Drop` has removed the directory, it has
/// nothing to do.
pub fn down_when_gone(pid: u32, script: &Path, run_dir: &Path, inventory: &Path) {
    use std::os::unix::process::CommandExt;
    static WATCHED: std::sync::Mutex<std::collections::BTreeSet<(u32, PathBuf)>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    let first = WATCHED
        .lock()
        .map(|mut watched| watched.insert((pid, run_dir.to_owned())))
        .unwrap_or(false);
    if !first {
        return;
    }
    // The run directory goes by the environment, not the command line: the leak checks
    // look for processes whose command line or working directory names it.
    let _ = std::process::Command::new("sh")
        .arg("-c")
        .arg(
            r#"while kill -0 "$WATCHED_PID" 2>/dev/null; do sleep 0.5; done
               [ -d "$RUN_DIR" ] && exec "$STACK_SCRIPT" down >/dev/null 2>&1"#,
        )
        .env("WATCHED_PID", pid.to_string())
        .env("RUN_DIR", run_dir)
        .env("STACK_SCRIPT", script)
        .env("INVENTORY_BIN", inventory)
        .current_dir("/")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .process_group(0)
        .spawn();
}

/// The pid files of a stack's services, in [`SERVICES`] order.
pub fn pid_files(run_dir: &Path) -> Vec<PathBuf> {
    SERVICES
        .iter()
        .map(|s| run_dir.join(format!("{s}.pid")))
        .collect()
}

/// Runs `stack.sh down` when dropped: a test that fails half-way (a panic) must not leave
/// its stack running. Harmless when the stack is already down.
pub struct DownOnDrop<'a> {
    pub script: &'a Path,
    pub run_dir: &'a Path,
    pub inventory: &'a Path,
}

impl Drop for DownOnDrop<'_> {
    fn drop(&mut self) {
        let _ = Command::new(self.script)
            .arg("down")
            .env("RUN_DIR", self.run_dir)
            .env("INVENTORY_BIN", self.inventory)
            .output();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_two_services_and_no_bus_port_share_a_port() {
        for topology in [Topology::Single, Topology::Sentinel, Topology::Cluster] {
            let ports = TopologyPorts::free(topology).all();
            let mut unique = ports.clone();
            unique.sort_unstable();
            unique.dedup();
            assert_eq!(unique.len(), ports.len(), "{topology:?}: {ports:?}");
        }
        let single = free_ports();
        let mut unique = single.to_vec();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), single.len(), "{single:?}");
    }
}

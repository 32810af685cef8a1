//! Real processes on free loopback ports: `redis-server`, `inventory` instances and nginx,
//! for the integration tests (`tests/it`), the fault scenarios, the load test and the
//! benchmarks alike. Each is stopped when its handle drops; a failure to start comes with
//! the process's own log.
//!
//! Every child leads a process group of its own ([`ProcessGroup`]) and is stopped by
//! signalling that group: whatever it forked goes with it.
//!
//! Two layers:
//!
//! - [`RedisProcess`], [`InventoryProcess`], [`NginxProcess`]: fallible (`anyhow::Result`),
//!   for the tools (scenarios, load test, benchmarks).
//! - [`fixture`]: the same processes as test fixtures that panic on failure (with the
//!   process's log), an HTTP client that reads `X-Instance`, and a cluster or a whole stack
//!   in one call.
//!
//! [`RedisCluster`]: three masters and three replicas of a Redis Cluster, with the faults a
//! cluster has (a master killed, a slot half-way through a migration).
//!
//! Beside them, lock nodes of their own ([`fixture::LockNodes`]: N `redis-server` processes
//! for `LOCK_NODES`) and real network faults ([`netns`]: a namespace with veth links that
//! can be cut, slowed or made lossy, removed on drop), with [`DelayProxy`] for a delay where
//! the kernel has no `tc netem`.
//!
//! This crate depends on nothing of the workspace: the service is run as a binary.

use std::net::TcpListener;
use std::path::Path;

pub mod fixture;
pub mod group;
pub mod inventory;
mod lifeline;
pub mod native;
pub mod netns;
pub mod nginx;
pub mod proxy;
pub mod redis;
pub mod redis_cluster;
pub mod sentinel;

pub use group::{DEFAULT_GRACE, ProcStat, ProcessGroup, group_members, signal_named};
pub use inventory::{InventoryProcess, LogSink, default_env, inventory_binary};
pub use netns::{Link, Namespace};
pub use nginx::NginxProcess;
pub use proxy::DelayProxy;
pub use redis::RedisProcess;
pub use redis_cluster::{ClusterNodeInfo, Migration, RedisCluster, free_cluster_port};
pub use sentinel::{
    SentinelProcess, SentinelTiming, master_port, start_sentinels, start_sentinels_with_password,
};

/// A port the OS had free a moment ago; servers that then fail to bind it are retried.
pub fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// How many times a server is started on a fresh free port before giving up.
const START_ATTEMPTS: usize = 5;

fn read_log(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| format!("(no log at {}: {e})", path.display()))
}

/// Resident memory of a process, from `/proc/<pid>/status`, in KiB.
pub fn rss_kib(pid: u32) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}

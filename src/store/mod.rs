//! Everything the service keeps in Redis: key names, the Lua scripts, and the calls that read
//! and write the stock and its ledger. Lock calls live with their strategies in `lock/`.

use std::future::Future;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager};
use redis::{AsyncCommands, Client, RedisError, RedisResult, Script, ScriptInvocation};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::idempotency::{self, Claim, Next};
use crate::metrics::Metrics;

mod batch;
mod cluster;
pub mod scripts;
mod sentinel;

pub use cluster::{ClusterSeeds, hash_slot};
pub use sentinel::Sentinels;
use sentinel::{Backend, Server};

/// Whether Redis refused our credentials: a wrong or missing password in `REDIS_URL`, or an
/// ACL user without the rights. Not worth retrying until someone fixes the configuration.
/// Redis refused to switch to `REDIS_URL`'s database (`/db` at or past the server's
/// `databases`): a setting that every new connection meets again until one of the two
/// changes. The client says so in its own words only, so they are what is matched.
pub fn is_database_refused(e: &RedisError) -> bool {
    e.to_string().contains("refused to switch database")
}

/// Also a command the user may not run: `NOPERM` on its own, and in a script Redis's own
/// words under `ERR`, which is how it reports a `redis.call` the user's ACL refuses.
pub fn is_auth_error(e: &RedisError) -> bool {
    e.kind() == redis::ErrorKind::AuthenticationFailed
        || server_codes(e)
            .iter()
            .any(|code| matches!(code.as_str(), "NOAUTH" | "WRONGPASS" | "NOPERM"))
        || e.to_string().contains("can't run this command")
}

/// A command the user's ACL refuses (`NOPERM`): Redis answered, and the credentials were
/// taken; only that command may not run.
pub fn is_command_refused(e: &RedisError) -> bool {
    e.code() == Some("NOPERM")
}

/// The codes of every error Redis answered in `e`: one for a command, one per refused
/// command of a pipeline, whose error `code()` does not tell (it names only a kind the
/// client knows, and `OOM`, `NOREPLICAS` or `BUSY` are none, so a refused pipeline answered
/// 500 where the same refusal of a script answered 503).
fn server_codes(e: &RedisError) -> Vec<String> {
    match e.clone().into_server_errors() {
        Some(errors) => errors
            .iter()
            .map(|(_, error)| error.code().to_owned())
            .collect(),
        None => e.code().map(str::to_owned).into_iter().collect(),
    }
}

/// Why Redis refused a command it will take again later, if that is what `e` is: out of
/// memory (`OOM`, with `maxmemory` and `noeviction`), a failing save (`MISCONF`), too few
/// replicas for `min-replicas-to-write` (`NOREPLICAS`), a script running too long (`BUSY`).
/// Redis refuses these before the command (a script: before its first write) does anything,
/// and a transaction whose queued command was refused is discarded whole, so nothing was
/// written.
pub fn write_refusal(e: &RedisError) -> Option<&'static str> {
    const REFUSALS: [(&str, &str); 5] = [
        ("OOM", "Redis is out of memory (maxmemory)"),
        (
            "READONLY",
            "Redis is a read-only replica (READONLY: REDIS_URL names a replica, or a failover \
             has just made it one)",
        ),
        ("MISCONF", "Redis cannot save its data (MISCONF)"),
        (
            "NOREPLICAS",
            "Redis has too few replicas to write (NOREPLICAS)",
        ),
        ("BUSY", "Redis is busy running a script (BUSY)"),
    ];
    let codes = server_codes(e);
    let text = e.to_string();
    REFUSALS.iter().find_map(|(refusal, why)| {
        let discarded = codes.iter().any(|c| c == "EXECABORT") && text.contains(refusal);
        (codes.iter().any(|c| c == refusal) || discarded).then_some(*why)
    })
}

/// The policy `INFO memory` names, when Redis may evict keys under it.
fn evicting_policy(info: &str) -> Option<String> {
    let field = |name: &str| {
        info.lines()
            .find_map(|l| l.trim().strip_prefix(name)?.strip_prefix(':'))
    };
    let limited = field("maxmemory").and_then(|m| m.parse::<u64>().ok()) > Some(0);
    let policy = field("maxmemory_policy")?;
    (limited && policy != "noeviction").then(|| policy.to_owned())
}

/// A Redis URL fit for a log line or an error: any password replaced by `***`. Whatever
/// stands before the last `@` is taken for credentials, URL or not: a value that failed
/// to parse as a URL (`:pw@host`, `redis:/:pw@host`) is exactly the one quoted in an error.
pub fn redact(url: &str) -> String {
    let Some((userinfo, host)) = url.rsplit_once('@') else {
        return url.to_owned();
    };
    match userinfo.split_once("://") {
        Some((scheme, info)) if !scheme.is_empty() && !scheme.contains([':', '/', '@']) => {
            // A user without a password is masked too: it may be the password, misplaced.
            let user = info.split_once(':').map_or("", |(user, _)| user);
            format!("{scheme}://{user}:***@{host}")
        }
        _ => format!("***@{host}"),
    }
}

const NOT_A_CLUSTER: &str = "REDIS_CLUSTER names a server that is not a cluster node";

/// Whether `REDIS_CLUSTER` named a server without cluster support: a configuration error,
/// not an outage.
pub fn is_not_a_cluster(e: &RedisError) -> bool {
    e.to_string().contains(NOT_A_CLUSTER)
}

const POOL_EXHAUSTED: &str = "every pooled Redis connection stayed in use for REDIS_POOL_WAIT_MS";

/// Whether a call gave up waiting for a free pooled connection: nothing was sent.
/// Whether a call's bound passed with no answer: Redis is there but hangs (frozen, or
/// swamped). Not a broken or refused connection: a sale in line then fails fast on its own
/// call, and counting those made every waiting sale of a Sentinel failover answer 503
/// (`make failover-table`: 870 errors where 30 were, and sales back 0.9 s later).
pub fn unanswered(e: &RedisError) -> bool {
    e.is_timeout()
}

/// Redis was not there for the call: unanswered, refused, or the connection dropped; not a
/// reply Redis gave (a script's error, say).
fn unreachable(e: &RedisError) -> bool {
    e.is_timeout() || e.is_io_error() || e.is_connection_refusal() || e.is_connection_dropped()
}

/// The error of a sale that did not go on because Redis kept failing while it waited.
pub fn failed_while_waiting() -> RedisError {
    RedisError::from(std::io::Error::new(
        std::io::ErrorKind::ConnectionRefused,
        "redis kept failing while this sale waited for the lock",
    ))
}

/// The error of a sale that did not go on because Redis stopped answering while it waited.
pub fn unanswered_while_waiting() -> RedisError {
    RedisError::from(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        "redis stopped answering while this sale waited for the lock",
    ))
}

pub fn is_pool_exhausted(e: &RedisError) -> bool {
    e.kind() == redis::ErrorKind::Client && e.to_string().contains(POOL_EXHAUSTED)
}

/// How the pool is sized and used (`REDIS_POOL_SIZE`, `REDIS_POOL_WAIT_MS`,
/// `REDIS_CONNECTION`).
#[derive(Debug, Clone, Copy)]
pub struct PoolSettings {
    pub size: usize,
    /// The longest wait for a free connection before `pool_exhausted`.
    pub wait: Duration,
    pub mode: ConnectionMode,
    /// Added to `REDIS_TIMEOUT_MS` for a pooled connection's replies: a `WAIT` behind a
    /// command (`REPLICA_ACKS`) may hold its reply up for the whole ack timeout, and the
    /// connection must not give up on it first. Set from the store's replication.
    pub reply_slack: Duration,
}

impl Default for PoolSettings {
    fn default() -> Self {
        Self {
            size: 64,
            wait: Duration::from_millis(200),
            mode: ConnectionMode::Multiplexed,
            reply_slack: Duration::ZERO,
        }
    }
}

/// How many replicas must acknowledge a write before it counts (`REPLICA_ACKS`), and how
/// long `WAIT` may wait for them (`REPLICA_ACK_TIMEOUT_MS`). `acks == 0` sends no `WAIT`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Replication {
    pub acks: u32,
    pub timeout: Duration,
}

impl Default for Replication {
    fn default() -> Self {
        Self {
            acks: 0,
            timeout: Duration::from_millis(200),
        }
    }
}

/// The fewest replicas that acknowledged any command of one operation run on an
/// [`Store::acked`] store; `i64::MAX` until a command has been sent.
#[derive(Debug)]
pub struct Acks(AtomicI64);

impl Acks {
    fn new() -> Self {
        Self(AtomicI64::new(i64::MAX))
    }

    /// Forgets what an earlier attempt saw.
    pub fn reset(&self) {
        self.0.store(i64::MAX, Ordering::Release);
    }

    fn record(&self, reply: Option<&redis::Value>) {
        // A WAIT that Redis refused (sent to a replica, say) acknowledged nothing.
        let acked = match reply {
            Some(redis::Value::Int(n)) => *n,
            _ => 0,
        };
        self.0.fetch_min(acked, Ordering::AcqRel);
    }

    /// Replicas that acknowledged every write of the operation; `None` if it sent nothing.
    pub fn get(&self) -> Option<i64> {
        match self.0.load(Ordering::Acquire) {
            i64::MAX => None,
            n => Some(n),
        }
    }
}

/// What every command of an acked call is followed by: a barrier write, then `WAIT acks
/// timeout`.
///
/// `WAIT` is documented to wait for the replication offset of its connection's *last
/// write*. A command that only observed someone else's write (an acquire that finds the
/// lock already handed over by another instance's release writes nothing) would leave that
/// offset behind, and `WAIT` could then report replicas that never got the state the sale
/// relies on. (Redis 7.0.15 was seen to wait for other connections' recent writes as well;
/// the barrier does not depend on that.) The barrier, a `PUBLISH` to a channel nobody reads (Redis propagates
/// it to replicas), runs after the command on the same single-threaded master, so its offset
/// covers every write the command saw or made.
#[derive(Clone)]
pub struct AckWait {
    replication: Replication,
    acks: Arc<Acks>,
    /// Where the barrier is published: [`WAIT_BARRIER`] with `PUBLISH` on a single server;
    /// on a cluster, a channel of the item's slot with `SPUBLISH` (a plain `PUBLISH` would
    /// be broadcast to every node over the cluster bus).
    barrier: (&'static str, String),
}

/// Exchanges one acked call may make; see [`Store::call`].
const ACKED_EXCHANGES_PER_CALL: u32 = 3;

/// The channel of the barrier write.
const WAIT_BARRIER: &str = "inventory:wait-barrier";

impl AckWait {
    /// Replies added behind the command's own: the barrier's, then `WAIT`'s.
    const REPLIES: usize = 2;

    fn append(&self, pipe: &mut redis::Pipeline) {
        pipe.cmd(self.barrier.0).arg(&self.barrier.1).arg("");
        pipe.cmd("WAIT")
            .arg(self.replication.acks)
            .arg(self.replication.timeout.as_millis().max(1) as u64);
    }
}

/// The connection one call runs on: the shared multiplexed one, or a pooled one of its own
/// (back to the pool when dropped); or one of those with a `WAIT` behind every command.
pub enum Conn {
    Shared(ConnectionManager),
    /// The cluster connection: routed by key, redirections followed.
    Cluster(redis::cluster_async::ClusterConnection),
    Pooled(deadpool_redis::Connection),
    /// `WAIT` counts the replicas that have the writes *of the connection it is sent on*,
    /// so it must go on the very connection of the write, right behind it: each command is
    /// sent as a pipeline `[command, barrier write, WAIT]` (see [`AckWait`]), which one
    /// connection carries in one piece (a reconnection in between would otherwise send
    /// WAIT on a fresh connection with no writes, and it would report every replica as up
    /// to date).
    Acked(Box<Conn>, AckWait),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a redis::Cmd,
    ) -> redis::RedisFuture<'a, redis::Value> {
        match self {
            Conn::Shared(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
            Conn::Pooled(c) => c.req_packed_command(cmd),
            Conn::Acked(c, wait) => Box::pin(async move {
                let mut pipe = redis::pipe();
                pipe.add_command(cmd.clone());
                wait.append(&mut pipe);
                let mut replies = c
                    .req_packed_commands(&pipe, 0, 1 + AckWait::REPLIES)
                    .await?;
                wait.acks.record(replies.get(AckWait::REPLIES));
                replies.truncate(1);
                replies.pop().ok_or_else(|| {
                    RedisError::from((redis::ErrorKind::Client, "no reply to the command"))
                })
            }),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        match self {
            Conn::Shared(c) => c.req_packed_commands(cmd, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(cmd, offset, count),
            Conn::Pooled(c) => c.req_packed_commands(cmd, offset, count),
            Conn::Acked(c, wait) => Box::pin(async move {
                if offset != 0 {
                    // A transaction's replies are picked from behind its EXEC: no WAIT can
                    // be appended, so it counts as acknowledged by nobody.
                    wait.acks.record(None);
                    return c.req_packed_commands(cmd, offset, count).await;
                }
                let mut pipe = cmd.clone();
                wait.append(&mut pipe);
                let mut replies = c
                    .req_packed_commands(&pipe, 0, count + AckWait::REPLIES)
                    .await?;
                wait.acks.record(replies.get(count + AckWait::REPLIES - 1));
                replies.truncate(count);
                Ok(replies)
            }),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Shared(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
            Conn::Pooled(c) => c.get_db(),
            Conn::Acked(c, _) => c.get_db(),
        }
    }
}

/// The keys of one item. They share the hash tag `{item}`, so every script touches a single
/// slot and runs unchanged on Redis Cluster.
#[derive(Debug, Clone)]
pub struct Keys {
    pub stock: String,
    pub initial: String,
    /// A stream of sale entries, capped: the audit never reads it.
    pub ledger: String,
    /// Sales since the last reset.
    pub sales: String,
    /// One bit per remaining-stock value already sold.
    pub sold: String,
    /// Remaining-stock value -> times sold, only for values sold more than once.
    pub duplicates: String,
    /// Writes that take no lock (atomic sales, resets); a locked write refuses to land
    /// after one it did not see. Never reset.
    pub lockfree_writes: String,
    /// Writes made under single-node locks, and under quorum locks: the two kinds never
    /// wait for each other's lock, so each kind's write refuses to land after one of the
    /// other kind that it did not see. Never reset.
    pub single_node_writes: String,
    pub quorum_writes: String,
    /// Reads made under single-node locks, and under quorum locks, by sales that have no
    /// fencing token. Such a reader moves no token when it takes the lock from a fenced
    /// holder whose lease ran out, so this count is how that holder's late write learns
    /// that somebody read after it (and will write what it read). Never reset.
    pub single_node_unfenced_reads: String,
    pub quorum_unfenced_reads: String,
    pub fence: String,
    /// The newest fencing token the store has seen from a sale under a single-node lock,
    /// and under a quorum lock. Apart, because the two kinds do not exclude each other: a
    /// quorum sale's newer token says nothing about whether a single-node sale's lock was
    /// lost (its writes are caught by the write counters instead).
    pub fence_seen: String,
    pub quorum_fence_seen: String,
    pub lock: String,
    /// Pub/sub channel on which every release is announced.
    pub released: String,
    /// A list holding at most one release signal; waiting instances block on it, so each
    /// release wakes one of them.
    pub signal: String,
    /// The waiters queued for a hand-off (`LOCK_WAIT=notify`): a sorted set by arrival,
    /// and a hash of their entries.
    pub queue: String,
    pub queue_entries: String,
    /// How many of the queued waiters each instance has (inbox -> count): how many
    /// instances wait, which is how a tenure is shared ([`crate::lock`]'s cohort).
    pub queue_inboxes: String,
    /// The channel of the `REPLICA_ACKS` barrier on a cluster (see [`AckWait`]).
    pub wait_barrier: String,
    idempotency_prefix: String,
    /// On a cluster, releases are announced with `SPUBLISH` (sharded pub/sub: only the
    /// shard of the item's slot hears them); on a single server with `PUBLISH`.
    pub sharded: bool,
}

impl Keys {
    pub fn new(item: &str) -> Self {
        let key = |suffix: &str| format!("inventory:{{{item}}}:{suffix}");
        Self {
            stock: key("stock"),
            initial: key("initial"),
            ledger: key("ledger"),
            sales: key("sales"),
            sold: key("sold"),
            duplicates: key("duplicates"),
            lockfree_writes: key("lockfree_writes"),
            single_node_writes: key("writes:single-node"),
            quorum_writes: key("writes:quorum"),
            single_node_unfenced_reads: key("unfenced-reads:single-node"),
            quorum_unfenced_reads: key("unfenced-reads:quorum"),
            fence: key("fence"),
            fence_seen: key("fence:seen"),
            quorum_fence_seen: key("fence:seen:quorum"),
            lock: key("lock"),
            released: key("lock:released"),
            signal: key("lock:signal"),
            queue: key("lock:queue"),
            queue_entries: key("lock:entries"),
            queue_inboxes: key("lock:inboxes"),
            wait_barrier: key("wait-barrier"),
            idempotency_prefix: key("idem:"),
            sharded: false,
        }
    }

    /// The same keys, announced on sharded pub/sub (a cluster) or not.
    pub fn sharded(mut self, sharded: bool) -> Self {
        self.sharded = sharded;
        self
    }

    /// The command that announces a release on [`Keys::released`].
    pub fn publish(&self) -> &'static str {
        if self.sharded { "SPUBLISH" } else { "PUBLISH" }
    }

    /// The slot of every key of the item.
    pub fn slot(&self) -> u16 {
        hash_slot(&self.stock)
    }

    pub fn fence_seen_by(&self, kind: LockKind) -> &str {
        match kind {
            LockKind::SingleNode => &self.fence_seen,
            LockKind::Quorum => &self.quorum_fence_seen,
        }
    }

    pub fn locked_writes(&self, kind: LockKind) -> &str {
        match kind {
            LockKind::SingleNode => &self.single_node_writes,
            LockKind::Quorum => &self.quorum_writes,
        }
    }

    pub fn unfenced_reads(&self, kind: LockKind) -> &str {
        match kind {
            LockKind::SingleNode => &self.single_node_unfenced_reads,
            LockKind::Quorum => &self.quorum_unfenced_reads,
        }
    }

    /// Where the hand-offs to one listening `Locks` arrive (`listener` is unique to it).
    pub fn inbox(&self, listener: &str) -> String {
        format!("{}:inbox:{listener}", self.lock)
    }

    /// Where the outcome of a sale sent with `Idempotency-Key: <key>` is kept.
    pub fn idempotency(&self, key: &str) -> String {
        format!("{}{key}", self.idempotency_prefix)
    }
}

/// How the strategies that need no connection of their own reach Redis.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ConnectionMode {
    Multiplexed,
    Pool,
}

/// Where a locked sale's lock lives: next to the stock, or on a majority of `LOCK_NODES`.
/// Locks of different kinds do not exclude each other, so the store tells their writes
/// apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockKind {
    SingleNode,
    Quorum,
}

impl LockKind {
    fn other(self) -> Self {
        match self {
            LockKind::SingleNode => LockKind::Quorum,
            LockKind::Quorum => LockKind::SingleNode,
        }
    }
}

/// What a locked sale's read saw of the writers its lock does not exclude; its write
/// refuses to land if any of them wrote since.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WritesSeen {
    kind: LockKind,
    lockfree: i64,
    other_locks: i64,
    /// Writes under this kind of lock: checked by a fenced write only (see `sell.lua`).
    own_locks: i64,
    /// Reads without a fencing token under this kind of lock: checked by a fenced write
    /// only (see `read_stock.lua`).
    unfenced_reads: i64,
}

impl WritesSeen {
    /// What the next sale of a tenure would have read right after this sale's write landed:
    /// the write counted itself under its kind of lock.
    fn after_own_write(self) -> Self {
        WritesSeen {
            own_locks: self.own_locks + 1,
            ..self
        }
    }
}

/// A handle to Redis for one item: one multiplexed connection shared by every request (no
/// pool checkout, no health-check PING on the hot path), every call bounded in time; and a
/// pool of connections of their own, for `WATCH` (which belongs to a connection) and for
/// every call under `REDIS_CONNECTION=pool`.
#[derive(Clone)]
pub struct Store {
    /// The server's connections: fixed for `REDIS_URL`, replaced after a failover when
    /// Sentinel names the master.
    server: Arc<Server>,
    /// Set for `REDIS_CLUSTER`: then every call goes to the cluster, and `server` is unused.
    cluster: Option<Arc<cluster::Cluster>>,
    pool_settings: PoolSettings,
    item: String,
    pub keys: Keys,
    timeout: Duration,
    metrics: Arc<Metrics>,
    ledger_cap: u64,
    replication: Replication,
    /// Set on a store returned by [`Store::acked`]: every call waits for the replicas.
    acked: Option<Arc<Acks>>,
    /// Calls that Redis left unanswered within their bound ([`unanswered`]), shared
    /// by every item on the server: a sale that waited for a lock while one happened does not
    /// go on to wait out the same timeout itself (see [`Store::outages`]).
    outages: Arc<AtomicU64>,
    /// Calls that failed for want of Redis in any way (unanswered, refused, dropped), shared
    /// like `outages` (see [`Store::failures`]).
    failures: Arc<AtomicU64>,
    /// The item's atomic sales waiting to be sent together (`store/batch.rs`); each item has
    /// its own, since a call sells one item.
    batch: Arc<batch::Batch>,
    /// Whether atomic sales are sent in batches: only under the single-threaded scheduler
    /// (`store/batch.rs` says why).
    batches: bool,
}

/// How often a cluster call that certainly did not run is sent again, and the wait before
/// the first time (10 ms longer each time after): the crate's slot map is refreshed by then.
const CLUSTER_RESENDS: u32 = 4;
const CLUSTER_RESEND_WAIT: Duration = Duration::from_millis(10);

/// Ledger entries kept unless configured otherwise: enough to read the story of a load
/// test, about 2 MB; the audit's figures are counters and do not need the entries.
pub const DEFAULT_LEDGER_CAP: u64 = 10_000;

/// What `GET /inventory` reports.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[schema(example = json!({"item": "001", "stock": 76, "initial": 100, "sales": 24}))]
pub struct Inventory {
    pub item: String,
    /// Stock left now.
    pub stock: i64,
    /// Stock set by the last reset.
    pub initial: i64,
    /// Sales recorded in the ledger since the last reset.
    pub sales: i64,
}

/// What `GET /inventory/audit` reports: whether the ledger and the stock agree.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[schema(example = json!({"item": "001", "initial": 100, "remaining": 0, "sales": 102,
    "oversold": 2, "lost_updates": 2, "duplicates": [{"remaining": 76, "times": 2}], "clean": false}))]
pub struct Audit {
    pub item: String,
    pub initial: i64,
    pub remaining: i64,
    /// Sales recorded in the ledger.
    pub sales: i64,
    /// Items sold that never existed: max(0, sales - initial).
    pub oversold: i64,
    /// Sales whose decrement was overwritten: sales - (initial - remaining).
    pub lost_updates: i64,
    /// Remaining-stock values left by more than one sale (the tutorial's "76 sold twice").
    pub duplicates: Vec<Duplicate>,
    /// True when no sale was lost, duplicated or oversold.
    pub clean: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Duplicate {
    pub remaining: i64,
    pub times: i64,
}

/// Who made a sale, for its ledger entry, and the idempotency claim it holds, if any.
#[derive(Debug, Clone, Copy)]
pub struct Entry<'a> {
    pub order_id: &'a str,
    pub instance: &'a str,
    pub strategy: &'a str,
    pub claim: Option<&'a Claim>,
}

impl Entry<'_> {
    /// Scripts declare every key they may touch; without a claim this one is never touched.
    fn claim_key(&self, keys: &Keys) -> String {
        self.claim
            .map_or_else(|| keys.idempotency(""), |c| c.key.clone())
    }

    fn claim_marker(&self) -> &str {
        self.claim.map_or("", |c| c.marker.as_str())
    }

    fn claim_keep_ms(&self) -> u64 {
        self.claim.map_or(0, |c| c.keep.as_millis() as u64)
    }

    /// The ledger entry's JSON up to the figures only the write knows (the stock left, the
    /// token), which `sell.lua` appends with the closing brace: the strings are escaped
    /// here, once, and the script only concatenates numbers.
    fn head(&self) -> String {
        #[derive(serde::Serialize)]
        struct Head<'a> {
            order_id: &'a str,
            instance: &'a str,
            strategy: &'a str,
        }
        let mut head = serde_json::to_string(&Head {
            order_id: self.order_id,
            instance: self.instance,
            strategy: self.strategy,
        })
        .expect("a struct of strings always serializes");
        head.pop();
        head
    }
}

/// What a sale's write did. Nothing was written in any case but `Written`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recorded {
    /// Written and recorded: the stock left.
    Written(i64),
    /// Nothing left to sell (the atomic sale checks this itself).
    SoldOut,
    /// Refused: the store has seen a newer fencing token.
    StaleFence { newest: u64 },
    /// Refused: the idempotency claim expired or another attempt holds the key.
    ClaimLost,
    /// Refused: a writer that takes no lock (an atomic sale, a reset) wrote after the read.
    StockChanged,
    /// Refused: the stock key is missing (never stocked, or Redis lost its data).
    Unstocked,
    /// Refused: a fenced sale's lock ran out and a holder of the same kind of lock without
    /// a fencing token (which moves no token) took it and wrote after this sale's read.
    Overtaken,
    /// Written and recorded on the master, but fewer replicas than `REPLICA_ACKS`
    /// acknowledged it in time: a failover may or may not lose it.
    NotReplicated { remaining: i64, acked: i64 },
}

impl Recorded {
    /// What the `i`-th (from 0) of several atomic sales sent in one call got, from the call's
    /// answer: the first was sold with `stock` left, the next with one less, as long as that
    /// is not negative.
    pub fn nth(self, i: usize) -> Self {
        match self {
            Recorded::Written(first) => match first.checked_sub(i as i64) {
                Some(remaining) if remaining >= 0 => Recorded::Written(remaining),
                _ => Recorded::SoldOut,
            },
            other => other,
        }
    }

    /// Reads the `{code, value}` reply of `sell.lua`.
    pub fn from_reply(code: i64, value: i64) -> Self {
        match code {
            1 => Recorded::Written(value),
            0 => Recorded::StaleFence {
                newest: value.max(0) as u64,
            },
            2 => Recorded::ClaimLost,
            3 => Recorded::StockChanged,
            4 => Recorded::Unstocked,
            6 => Recorded::Overtaken,
            _ => Recorded::SoldOut,
        }
    }
}

/// What a locked sale read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StockRead {
    /// The stock (`None` when the key is missing) and the lock-free write count to hand back
    /// to [`Store::record_sale`].
    Current {
        stock: Option<i64>,
        seen: WritesSeen,
    },
    /// The store has seen a newer fencing token than the reader's.
    Stale { newest: u64 },
    /// A sale under the other kind of lock (single-node against quorum: they do not exclude
    /// each other) registered a newer token: this one would write after it, and the tokens
    /// in the ledger would go backwards.
    Overtaken,
}

impl Store {
    /// Does not touch the network: the service starts with Redis down and connects when it can.
    pub fn new(
        redis_url: &str,
        item: &str,
        timeout: Duration,
        metrics: Arc<Metrics>,
    ) -> RedisResult<Self> {
        let client = Client::open(redis_url)?;
        let pool_settings = PoolSettings::default();
        let backend = Backend::build(client, timeout, pool_settings)?;
        Ok(Self::with_server(
            Server::fixed(backend),
            pool_settings,
            item,
            timeout,
            metrics,
        ))
    }

    /// The master that `sentinels` name, looked up now (a failed lookup is an error: the
    /// service cannot know where to connect) and again after every connection error, so
    /// that the store follows a failover without a restart.
    pub fn with_sentinels(
        sentinels: Sentinels,
        item: &str,
        timeout: Duration,
        metrics: Arc<Metrics>,
    ) -> RedisResult<Self> {
        let pool_settings = PoolSettings::default();
        let server = Server::sentinel(sentinels, timeout, pool_settings)?;
        Ok(Self::with_server(
            server,
            pool_settings,
            item,
            timeout,
            metrics,
        ))
    }

    /// The cluster that `seeds` lead to; nothing is contacted before the first call.
    pub fn with_cluster(
        seeds: ClusterSeeds,
        item: &str,
        timeout: Duration,
        metrics: Arc<Metrics>,
    ) -> RedisResult<Self> {
        let pool_settings = PoolSettings::default();
        let first = seeds.0.first().cloned().unwrap_or_default();
        // Never contacted: every call of a cluster store goes to the cluster.
        let unused = Backend::build(Client::open(first)?, timeout, pool_settings)?;
        let cluster = cluster::Cluster::new(seeds, timeout, pool_settings)?;
        let mut store =
            Self::with_server(Server::fixed(unused), pool_settings, item, timeout, metrics);
        store.cluster = Some(Arc::new(cluster));
        store.keys = Keys::new(item).sharded(true);
        Ok(store)
    }

    /// Whether the store is a Redis Cluster (`REDIS_CLUSTER`).
    pub fn is_cluster(&self) -> bool {
        self.cluster.is_some()
    }

    fn with_server(
        server: Server,
        pool_settings: PoolSettings,
        item: &str,
        timeout: Duration,
        metrics: Arc<Metrics>,
    ) -> Self {
        let server = Arc::new(server);
        server.watch();
        Self {
            server,
            cluster: None,
            pool_settings,
            item: item.to_owned(),
            keys: Keys::new(item),
            timeout,
            metrics,
            ledger_cap: DEFAULT_LEDGER_CAP,
            replication: Replication::default(),
            acked: None,
            outages: Arc::default(),
            failures: Arc::default(),
            batch: Arc::default(),
            batches: tokio::runtime::Handle::try_current().is_ok_and(|runtime| {
                runtime.runtime_flavor() == tokio::runtime::RuntimeFlavor::CurrentThread
            }),
        }
    }

    /// Sizes the pool, and chooses which connection every other call takes.
    pub fn with_pool(mut self, mut settings: PoolSettings) -> RedisResult<Self> {
        settings.reply_slack = self.reply_slack();
        self.server.resize_pool(self.timeout, settings)?;
        self.pool_settings = settings;
        let gauges = |pools: Vec<deadpool_redis::Pool>| {
            let mut gauges = crate::metrics::PoolGauges::default();
            for pool in pools {
                let status = pool.status();
                gauges.max_size += status.max_size as u64;
                gauges.open += status.size as u64;
                gauges.in_use += (status.size - status.available.min(status.size)) as u64;
                gauges.waiting += status.waiting as u64;
            }
            gauges
        };
        if let Some(cluster) = &self.cluster {
            // One pool per master, summed.
            cluster.resize_pool(settings);
            let watched = cluster.clone();
            self.metrics
                .register_pool(Box::new(move || gauges(watched.pools())));
            return Ok(self);
        }
        // Only the pool sized by the configuration is reported (lock nodes keep theirs idle).
        let watched = self.server.clone();
        self.metrics.register_pool(Box::new(move || {
            gauges(vec![watched.backend().pool.clone()])
        }));
        Ok(self)
    }

    /// A connection of its own, waiting at most `REDIS_POOL_WAIT_MS` for a free one.
    /// Connecting, and the checkout's `UNWATCH` + `PING`, are bounded by `REDIS_TIMEOUT_MS`.
    /// [`Store::pooled`] in a box of its own: its future (a cluster lookup, the pool's
    /// checkout) is about 7 KB, and every call's future, on every connection mode, would
    /// otherwise be that large, to be moved and zeroed on each request.
    fn pooled_boxed(
        &self,
    ) -> std::pin::Pin<Box<impl Future<Output = RedisResult<deadpool_redis::Connection>> + '_>>
    {
        Box::pin(self.checkout())
    }

    /// A pooled connection of its own, for a transaction: not while a failover a sentinel
    /// announced is under way (see [`Store::call`]).
    pub async fn pooled(&self) -> RedisResult<deadpool_redis::Connection> {
        self.failover_clear().await?;
        self.checkout().await
    }

    /// Under Sentinel, waits (at most the timeout) while a sentinel says it is failing the
    /// master over: the old master may still take writes that the promoted replica will
    /// never have. Then a 503 that sent nothing, so sold nothing.
    async fn failover_clear(&self) -> RedisResult<()> {
        // Every call passes here: without sentinels, no boxed future, no lock.
        if !self.server.follows_sentinels()
            || Box::pin(self.server.failover_clear(self.timeout)).await
        {
            return Ok(());
        }
        Err(RedisError::from((
            redis::ErrorKind::Server(redis::ServerErrorKind::TryAgain),
            "a Sentinel failover is under way",
            "nothing was sent to the master it is replacing".to_owned(),
        )))
    }

    async fn checkout(&self) -> RedisResult<deadpool_redis::Connection> {
        use deadpool_redis::{PoolError, TimeoutType};
        let pool = match &self.cluster {
            // The master of the item's slot: a transaction, a WAIT or a pooled call must stay
            // on one node's connection.
            Some(cluster) => match cluster.owner(self.keys.slot()).await {
                Ok(owner) => owner.pool.clone(),
                Err(e) => {
                    self.metrics.redis_error();
                    cluster.after_error(&e);
                    return Err(e);
                }
            },
            None => self.server.backend().pool.clone(),
        };
        let status = pool.status();
        if status.available == 0 && status.size >= status.max_size {
            self.metrics.pool_wait();
        }
        // deadpool recycles the idle connections one after another, each bounded by the
        // timeout: with Redis frozen, a checkout tried every idle connection in turn, and one
        // sale answered after 17 and 27 timeouts (found from outside). One bound for the
        // whole checkout: the wait for a free connection, and one timeout.
        let bound = self.timeout + self.pool_settings.wait;
        let Ok(got) = tokio::time::timeout(bound, pool.get()).await else {
            self.metrics.redis_error();
            return Err(RedisError::from(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "no pooled Redis connection answered within REDIS_TIMEOUT_MS",
            )));
        };
        match got {
            Ok(conn) => Ok(conn),
            Err(PoolError::Timeout(TimeoutType::Wait)) => {
                self.metrics.pool_exhausted();
                Err(RedisError::from((
                    redis::ErrorKind::Client,
                    "pool exhausted",
                    POOL_EXHAUSTED.to_owned(),
                )))
            }
            Err(PoolError::Backend(e)) => {
                self.metrics.redis_error();
                self.after_error(&e);
                Err(e)
            }
            Err(e) => {
                self.metrics.redis_error();
                Err(RedisError::from(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("no pooled Redis connection: {e}"),
                )))
            }
        }
    }

    /// Asks `replication.acks` replicas to acknowledge acquires, renewals and sale writes.
    /// The pool is rebuilt with room for `WAIT` replies.
    pub fn with_replication(mut self, replication: Replication) -> RedisResult<Self> {
        self.replication = replication;
        let settings = self.pool_settings;
        self.with_pool(settings)
    }

    fn reply_slack(&self) -> Duration {
        if self.replication.acks == 0 {
            Duration::ZERO
        } else {
            self.replication.timeout
        }
    }

    pub fn replication(&self) -> Replication {
        self.replication
    }

    /// A section of the server's `INFO`; `None` on a cluster, where each item has a master
    /// of its own.
    async fn info(&self, section: &str) -> RedisResult<Option<String>> {
        if self.cluster.is_some() {
            return Ok(None);
        }
        self.call(|mut c| async move {
            redis::cmd("INFO")
                .arg(section)
                .query_async::<String>(&mut c)
                .await
        })
        .await
        .map(Some)
    }

    /// The server's `run_id` (`INFO server`), which tells one server reached under two
    /// names apart from two servers; `None` on a cluster.
    pub async fn run_id(&self) -> RedisResult<Option<String>> {
        Ok(self.info("server").await?.and_then(|info| {
            info.lines()
                .find_map(|l| l.trim().strip_prefix("run_id:"))
                .map(str::to_owned)
        }))
    }

    /// How many replicas the master reports online (`INFO replication`); `None` on a
    /// cluster.
    pub async fn replicas_online(&self) -> RedisResult<Option<u32>> {
        let Some(info) = self.info("replication").await? else {
            return Ok(None);
        };
        // A replica acknowledges every second; one whose last came longer ago than this is
        // frozen or cut off, however long the master keeps it `online` (`repl-timeout`, 60 s),
        // and acknowledges nothing a sale waits for.
        const ACK_LAG_S: u64 = 2;
        let online = info
            .lines()
            .filter(|l| l.starts_with("slave") && l.contains("state=online"))
            .filter(|l| {
                l.split(',')
                    .find_map(|f| f.strip_prefix("lag="))
                    .and_then(|lag| lag.trim().parse::<u64>().ok())
                    .is_none_or(|lag| lag <= ACK_LAG_S)
            })
            .count();
        Ok(Some(u32::try_from(online).unwrap_or(u32::MAX)))
    }

    /// Whether the server is a replica (`INFO replication`), which refuses every write;
    /// `false` on a cluster, where the store asks each item's master.
    pub async fn is_replica(&self) -> RedisResult<bool> {
        let info = self.info("replication").await?.unwrap_or_default();
        Ok(info.lines().any(|l| l.trim() == "role:slave"))
    }

    /// Whether Redis takes writes now, asked without writing: a script Redis must treat as
    /// one that may write (`lua/writable.lua`) is refused up front where a sale's write would
    /// be refused part way (`READONLY`, `NOREPLICAS`, `MISCONF`, `OOM`), and that refusal is
    /// the error. `Ok` on a cluster, where each item has a master of its own.
    ///
    /// Each of `checks` (a command and its arguments, key first) is checked against the user's
    /// ACL in the same step, without running it: `Some(i)` when the user may not run
    /// `checks[i]` (the first such).
    pub async fn writable(&self, checks: &[(&str, &[String])]) -> RedisResult<Option<usize>> {
        if self.cluster.is_some() {
            return Ok(None);
        }
        let probe = &scripts::writable(checks.iter().copied());
        let refused: usize = self
            .call(|mut c| async move { probe.invoke_async(&mut c).await })
            .await?;
        Ok(refused.checked_sub(1))
    }

    /// The eviction policy of a Redis that may evict keys (`maxmemory` set, and a
    /// `maxmemory-policy` other than `noeviction`), from `INFO memory`, which managed Redis
    /// services answer where they refuse `CONFIG`; `None` when it never evicts, and on a
    /// cluster (each item has a master of its own). Evicted, a lock lets a second holder in
    /// (the `volatile-*` policies pick keys with a lease first, the locks' among them), an
    /// idempotency record lets its key sell again, and the stock vanishes.
    pub async fn eviction_policy(&self) -> RedisResult<Option<String>> {
        Ok(self
            .info("memory")
            .await?
            .as_deref()
            .and_then(evicting_policy))
    }

    /// A copy of this store whose every call is followed by `WAIT` on its own connection,
    /// and the count of replicas that acknowledged them; `None` when `REPLICA_ACKS` is 0.
    ///
    /// The call takes a pooled connection: `WAIT` blocks the connection it is sent on until
    /// the replicas answer or the timeout passes, and on the shared multiplexed connection
    /// it would hold up every other sale's commands behind it (for the whole timeout when
    /// a replica is down).
    pub fn acked(&self) -> Option<(Store, Arc<Acks>)> {
        if self.replication.acks == 0 {
            return None;
        }
        let acks = Arc::new(Acks::new());
        let mut store = self.clone();
        store.acked = Some(acks.clone());
        Some((store, acks))
    }

    /// The bound on one Redis exchange (`REDIS_TIMEOUT_MS`).
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Keeps about `cap` ledger entries (the stream is trimmed as it grows).
    pub fn with_ledger_cap(mut self, cap: u64) -> Self {
        self.ledger_cap = cap;
        self
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// The metrics this store records into, for another store that should count with it.
    pub fn metrics_handle(&self) -> Arc<Metrics> {
        self.metrics.clone()
    }

    /// After a failed call: under Sentinel or on a cluster, looks the master up again if
    /// the error says it may have moved.
    pub fn after_error(&self, e: &RedisError) {
        match &self.cluster {
            Some(cluster) => cluster.after_error(e),
            None => self.server.after_error(e),
        }
    }

    /// The database number the store's connections select (`/db` of the URL); 0 on a
    /// cluster.
    pub fn database(&self) -> i64 {
        if self.cluster.is_some() {
            return 0;
        }
        self.server
            .backend()
            .client
            .get_connection_info()
            .redis_settings()
            .db()
    }

    /// `host:port` of the server (never the password), for logs and metrics labels; on a
    /// cluster, of its first seed.
    pub fn address(&self) -> String {
        if let Some(cluster) = &self.cluster {
            return cluster.address();
        }
        self.server
            .backend()
            .client
            .get_connection_info()
            .addr()
            .to_string()
    }

    /// A client for the server as it is now (under Sentinel, the master of the moment; on a
    /// cluster, the master of the item's slot, asked of the cluster now), for connections of
    /// their own that last (a blocked `BLPOP`, a subscription).
    pub async fn client(&self) -> RedisResult<Client> {
        match &self.cluster {
            Some(cluster) => {
                let found = cluster.fresh_owner_client(self.keys.slot()).await;
                if let Err(e) = &found {
                    cluster.after_error(e);
                }
                found
            }
            None => Ok(self.server.backend().client.clone()),
        }
    }

    /// Changes each time the store follows Sentinel to another master: a connection made
    /// from [`Store::client`] before that goes to the old one, which may still be up and
    /// taking commands (a planned failover) while the releases happen on the new one.
    pub fn master_moves(&self) -> tokio::sync::watch::Receiver<u64> {
        self.server.moves()
    }

    /// On a cluster, a cluster connection of its own that pushes what it receives (sharded
    /// pub/sub messages) to `sender`; `None` for a single server.
    pub fn cluster_subscriber(
        &self,
        sender: tokio::sync::mpsc::UnboundedSender<redis::PushInfo>,
    ) -> Option<RedisResult<redis::cluster_async::ClusterConnection>> {
        self.cluster.as_ref().map(|c| c.subscriber(sender))
    }

    pub fn item(&self) -> &str {
        &self.item
    }

    /// The same server, connections, pool and settings, for another item's keys: items
    /// share everything but their key names, so another item costs no connection.
    pub fn for_item(&self, item: &str) -> Store {
        let mut store = self.clone();
        store.item = item.to_owned();
        store.keys = Keys::new(item).sharded(self.cluster.is_some());
        store.batch = Arc::default();
        store
    }

    /// Runs one Redis exchange under the configured bound, so a hung or unreachable server
    /// costs a request at most `timeout`, never a hang.
    pub async fn call<T, F, Fut>(&self, f: F) -> RedisResult<T>
    where
        F: Fn(Conn) -> Fut,
        Fut: Future<Output = RedisResult<T>>,
    {
        let started = tokio::time::Instant::now();
        let mut result = self.call_once(&f).await;
        // On a cluster: sent again, within the call's bound, only when it certainly did not
        // run (a redirection while a slot moves or after a failover, no connection yet).
        let mut sent = 1;
        while self.cluster.is_some()
            && result.as_ref().is_err_and(cluster::not_run)
            && sent <= CLUSTER_RESENDS
            && started.elapsed() < self.timeout
        {
            tokio::time::sleep(CLUSTER_RESEND_WAIT * sent).await;
            result = self.call_once(&f).await;
            sent += 1;
        }
        // After Redis was gone a while, the shared connection's last reconnection may have
        // been refused; the manager hands that refusal to the next call and only then
        // reconnects, however long Redis has been back. A refused call reached no Redis:
        // sent again once, on the connection the manager is opening now; under Sentinel,
        // to the master the sentinels name now (a failover moved it away from the refusal).
        if let Err(e) = &result
            && e.is_connection_refusal()
            && self.uses_shared_connection()
        {
            self.after_error(e);
            // Within the call's own bound: a sentinel that is slow to answer must not turn
            // a fast 503 into a wait of seconds (the lookup goes on in the background).
            let _ = Box::pin(tokio::time::timeout(
                self.timeout,
                self.server.look_up_now(),
            ))
            .await;
            result = self.call_once(&f).await;
        }
        if let Err(e) = &result {
            self.metrics.redis_error();
            self.after_error(e);
            if unanswered(e) {
                self.outages.fetch_add(1, Ordering::Relaxed);
            }
            if unreachable(e) {
                self.failures.fetch_add(1, Ordering::Relaxed);
            }
        }
        result
    }

    /// How many calls have failed so far for want of Redis, refused or dropped connections
    /// included. Unlike [`Store::outages`], a refusal costs its call little, so a sale in
    /// line does not stop at the first one; it stops once it has waited its own timeout with
    /// this count moved: with Redis stopped, the sales queued in an instance otherwise went
    /// to Redis one after the other, each failing in turn (32 sales: the last answered after
    /// 4.7 s). On a cluster it never moves, as `outages`; nor under Sentinel, where a refusal
    /// is most often a failover under way, after which the sale in line sells: waiting there
    /// is what keeps a failover to about one refusal per buyer (stopping at the timeout gave
    /// 106 errors at 16 connections where waiting gives about 30).
    pub fn failures(&self) -> u64 {
        if self.cluster.is_some() || self.server.follows_sentinels() {
            return 0;
        }
        self.failures.load(Ordering::Relaxed)
    }

    /// How many calls Redis has left unanswered so far: a sale reads it before it waits for
    /// a lock, and if it moved meanwhile, answers 503 instead of taking its turn. A frozen
    /// Redis otherwise held every waiting sale for one timeout after another, as each got
    /// the lock in turn and waited out its own read (8 sales in line: 1 to 8 s). On a
    /// cluster it never moves: one node's outage says nothing of the others.
    pub fn outages(&self) -> u64 {
        if self.cluster.is_some() {
            return 0;
        }
        self.outages.load(Ordering::Relaxed)
    }

    /// Whether this store's calls reach Redis in the order they were sent: all on the shared
    /// multiplexed connection (a cluster node's, on a cluster), and none taking a pooled
    /// connection of its own (`REDIS_CONNECTION=pool`, or `REPLICA_ACKS`, whose calls each
    /// take one). A release sent after a write that went unanswered then reaches Redis
    /// behind that write, wherever the write is held.
    /// Whether every call takes a pooled connection of its own (`REDIS_CONNECTION=pool`).
    pub fn uses_pool(&self) -> bool {
        self.pool_settings.mode == ConnectionMode::Pool
    }

    pub fn calls_in_order(&self) -> bool {
        self.replication.acks == 0 && self.pool_settings.mode == ConnectionMode::Multiplexed
    }

    fn uses_shared_connection(&self) -> bool {
        self.acked.is_none()
            && self.cluster.is_none()
            && self.pool_settings.mode == ConnectionMode::Multiplexed
    }

    async fn call_once<T, F, Fut>(&self, f: &F) -> RedisResult<T>
    where
        F: Fn(Conn) -> Fut,
        Fut: Future<Output = RedisResult<T>>,
    {
        self.failover_clear().await?;
        let (conn, bound) = match (&self.acked, self.pool_settings.mode) {
            (Some(acks), _) => {
                let barrier = if self.cluster.is_some() {
                    ("SPUBLISH", self.keys.wait_barrier.clone())
                } else {
                    ("PUBLISH", WAIT_BARRIER.to_owned())
                };
                let wait = AckWait {
                    replication: self.replication,
                    acks: acks.clone(),
                    barrier,
                };
                let conn = Conn::Acked(Box::new(Conn::Pooled(self.pooled_boxed().await?)), wait);
                // Each exchange is bounded by the pooled connection's own reply timeout
                // (store timeout + ack timeout); a call has at most a script's first run
                // in it (EVALSHA, SCRIPT LOAD, EVALSHA), each with its WAIT behind it.
                (
                    conn,
                    ACKED_EXCHANGES_PER_CALL * (self.timeout + self.replication.timeout),
                )
            }
            (None, ConnectionMode::Multiplexed) => match &self.cluster {
                // The crate's retries and redirections stay inside the call's bound.
                Some(cluster) => (Conn::Cluster(cluster.conn()), self.timeout),
                None => (
                    Conn::Shared(self.server.backend().conn.clone()),
                    self.timeout,
                ),
            },
            // A pooled call that times out drops its connection back into the pool with
            // its reply outstanding; the checkout's PING (itself bounded) weeds out one
            // that is still stuck. Calls never leave a WATCH or a MULTI open.
            (None, ConnectionMode::Pool) => {
                (Conn::Pooled(self.pooled_boxed().await?), self.timeout)
            }
        };
        let shared_cluster = matches!(conn, Conn::Cluster(_));
        let result = match tokio::time::timeout(bound, f(conn)).await {
            Ok(result) => result,
            Err(_) => Err(RedisError::from(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "redis did not answer in time",
            ))),
        };
        if let (true, Some(cluster)) = (shared_cluster, &self.cluster) {
            match &result {
                Err(e) if e.is_timeout() => cluster.unanswered(),
                Err(e) if e.code() == Some("CLUSTERDOWN") => {
                    cluster.answered();
                    cluster.refused();
                }
                _ => cluster.answered(),
            }
        }
        result
    }

    /// Whether Redis answers; on a cluster, whether a node says `cluster_state:ok`.
    pub async fn ping(&self) -> RedisResult<()> {
        if let Some(cluster) = &self.cluster {
            let slot = self.keys.slot();
            let ok = self
                .call(|_| async move { cluster.state_ok(slot).await })
                .await?;
            return if ok {
                Ok(())
            } else {
                Err(RedisError::from((
                    redis::ErrorKind::Server(redis::ServerErrorKind::ClusterDown),
                    "the cluster is down",
                    "cluster_state is not ok".to_owned(),
                )))
            };
        }
        match self
            .call(|mut c| async move { redis::cmd("PING").query_async::<String>(&mut c).await })
            .await
        {
            // Refused by the user's ACL: Redis answered, and took the credentials. The sales
            // send no PING; whether they may run what they send is `writable`'s to say.
            Err(e) if is_command_refused(&e) => Ok(()),
            answered => answered.map(drop),
        }
    }

    /// Reads the stock for a locked sale, with what its write must check; a fenced reader's
    /// token is registered with the store in the same step.
    pub async fn read_for_sale(
        &self,
        kind: LockKind,
        fence: Option<u64>,
    ) -> RedisResult<StockRead> {
        let read = &scripts::read_stock(&self.keys, kind, fence);
        let reply = self
            .call(|mut c| async move { read.invoke_async(&mut c).await })
            .await?;
        Ok(Self::stock_read(kind, reply))
    }

    /// The read of [`Store::read_for_sale`] from its reply.
    fn stock_read(kind: LockKind, reply: (i64, i64, i64, i64, i64, i64)) -> StockRead {
        let (ok, value, lockfree, other_locks, own_locks, unfenced_reads) = reply;
        match ok {
            1 => StockRead::Current {
                stock: (value >= 0).then_some(value),
                seen: WritesSeen {
                    kind,
                    lockfree,
                    other_locks,
                    own_locks,
                    unfenced_reads,
                },
            },
            2 => StockRead::Overtaken,
            _ => StockRead::Stale {
                newest: value.max(0) as u64,
            },
        }
    }

    /// [`Store::record_sale`], and the read of the next sale of the same lock tenure done by
    /// the same script once the write lands: that sale's stock is this write's, its counts
    /// are the ones the write checked, and its fencing token (`next_fence`) is registered as
    /// read then, as its own read would. The next sale starts its critical section with its
    /// read done: one round trip a sale instead of two, within a tenure. The read is `None`
    /// when the write did not land, and when the store cannot do the two in one step (a
    /// cluster, or `REPLICA_ACKS`, whose `WAIT` must follow the write alone): the next sale
    /// then reads for itself.
    ///
    /// One script, not the write and a read pipelined: a write whose script Redis had lost
    /// ran nothing, while a read behind it that ran registered the next token, and the write
    /// sent again was then refused as stale (every first sale after Redis started).
    pub async fn record_sale_then_read(
        &self,
        new_stock: i64,
        entry: &Entry<'_>,
        fence: Option<u64>,
        seen: WritesSeen,
        next_fence: Option<u64>,
    ) -> RedisResult<(Recorded, Option<StockRead>)> {
        if self.cluster.is_some() || self.replication.acks > 0 {
            let recorded = self.record_sale(new_stock, entry, fence, seen).await?;
            return Ok((recorded, None));
        }
        let mode = scripts::SellMode::Locked {
            new_stock,
            fence,
            seen,
            next_fence,
        };
        let recorded = self.sell(entry, mode).await?;
        let read = match recorded {
            Recorded::Written(remaining) => Some(StockRead::Current {
                stock: Some(remaining),
                seen: seen.after_own_write(),
            }),
            _ => None,
        };
        Ok((recorded, read))
    }

    /// Writes the stock a locked sale computed and records the sale, atomically; refused
    /// when a newer token, a lock-free write or a write under the other kind of lock came
    /// after the read.
    pub async fn record_sale(
        &self,
        new_stock: i64,
        entry: &Entry<'_>,
        fence: Option<u64>,
        seen: WritesSeen,
    ) -> RedisResult<Recorded> {
        let mode = scripts::SellMode::Locked {
            new_stock,
            fence,
            seen,
            next_fence: None,
        };
        self.sell(entry, mode).await
    }

    /// The sale script in its `optimistic` mode, for the `EXEC` of a watched transaction.
    pub fn optimistic_sell(&self, entry: &Entry<'_>, new_stock: i64) -> ScriptInvocation<'static> {
        scripts::sell(
            &self.keys,
            entry,
            self.ledger_cap,
            scripts::SellMode::Optimistic { new_stock },
        )
    }

    /// The lock-free sale: one script, one round trip, shared with the item's other atomic
    /// sales that came at the same time (`store/batch.rs`). A sale with an idempotency claim,
    /// or one that waits for replicas, has a call of its own: its claim and its replicas'
    /// answer are its alone.
    pub async fn atomic_sale(&self, entry: &Entry<'_>) -> RedisResult<Recorded> {
        if !self.batches || entry.claim.is_some() || self.replication.acks > 0 {
            return self.sell(entry, scripts::SellMode::Atomic).await;
        }
        let (send, answered) = self.batch.join(entry.head());
        if send {
            tokio::spawn(self.clone().send_batch());
        }
        answered.await.unwrap_or_else(|_| Err(batch::unanswered()))
    }

    /// Sends the atomic sales that joined the batch since it was started, and answers each.
    async fn send_batch(self) {
        let calls = self.batch.take().into_iter().map(|call| async {
            let invocation = scripts::sell_atomic(&self.keys, batch::heads(&call), self.ledger_cap);
            let outcome = self.sell_with(&invocation).await;
            batch::answer(call, outcome);
        });
        futures_util::future::join_all(calls).await;
    }

    async fn sell(&self, entry: &Entry<'_>, mode: scripts::SellMode) -> RedisResult<Recorded> {
        self.sell_with(&scripts::sell(&self.keys, entry, self.ledger_cap, mode))
            .await
    }

    /// Runs `sell.lua` as `invocation` says, and reads its answer.
    async fn sell_with(&self, invocation: &ScriptInvocation<'static>) -> RedisResult<Recorded> {
        let acked = self.acked();
        let store = acked.as_ref().map_or(self, |(store, _)| store);
        let (code, value): (i64, i64) = store
            .call(|mut c| async move { invocation.invoke_async(&mut c).await })
            .await?;
        let recorded = Recorded::from_reply(code, value);
        if let (Recorded::Written(remaining), Some((_, acks))) = (recorded, &acked) {
            let acked = acks.get().unwrap_or(0);
            if acked < i64::from(self.replication.acks) {
                return Ok(Recorded::NotReplicated { remaining, acked });
            }
        }
        Ok(recorded)
    }

    /// Claims an idempotency key for a sale with one `SET NX GET`: the claim when it is
    /// this attempt's, otherwise what an earlier attempt left.
    pub async fn claim(&self, claim: Claim) -> RedisResult<Next> {
        let claim_ref = &claim;
        let prior: Option<String> = self
            .call(|mut c| async move {
                redis::cmd("SET")
                    .arg(&claim_ref.key)
                    .arg(&claim_ref.marker)
                    .arg("NX")
                    .arg("GET")
                    .arg("PX")
                    .arg(idempotency::CLAIM_LEASE.as_millis() as u64)
                    .query_async(&mut c)
                    .await
            })
            .await?;
        claim.leased(tokio::time::Instant::now());
        Ok(match prior {
            None => Next::Proceed(claim),
            // This claim's own marker: an earlier send of this same call landed (a cluster
            // call sent again after a redirection whose first send had run). It is ours: a
            // retry's claim would carry its own order id. Answered "in progress", it was the
            // first and only request of its key (24 of them in a failover, from outside).
            Some(prior) if prior == claim.marker => Next::Proceed(claim),
            Some(prior) => Next::Replay(idempotency::parse(&prior)),
        })
    }

    /// What an idempotency key holds now (a marker, a sale, `sold_out`), if anything.
    pub async fn claim_holds(&self, key: &str) -> RedisResult<Option<String>> {
        self.call(|mut c| async move { redis::cmd("GET").arg(key).query_async(&mut c).await })
            .await
    }

    /// Extends the lease of `claim`'s marker while the key still holds it: `false` once it
    /// does not (the sale replaced it, a settle freed it, or it ran out and a retry took it).
    pub async fn extend_claim(&self, claim: &Claim) -> RedisResult<bool> {
        let extend = &scripts::extend_owned(
            &claim.key,
            &claim.marker,
            idempotency::CLAIM_LEASE.as_millis() as u64,
        );
        let extended: i64 = self
            .call(|mut c| async move { extend.invoke_async(&mut c).await })
            .await?;
        if extended == 1 {
            claim.leased(tokio::time::Instant::now());
        }
        Ok(extended == 1)
    }

    /// Ends a claim that did not sell: keeps `outcome` for replays, or frees the key.
    pub async fn settle(&self, claim: &Claim, outcome: Option<&str>) -> RedisResult<bool> {
        let settle = &scripts::idempotency_settle(
            &claim.key,
            &claim.marker,
            outcome.unwrap_or_default(),
            claim.keep.as_millis() as u64,
        );
        let settled: i64 = self
            .call(|mut c| async move { settle.invoke_async(&mut c).await })
            .await?;
        Ok(settled == 1)
    }

    /// New stock, an empty ledger and audit; a lock without a lease (`setnx`'s) gets
    /// `orphan_lease` (longer than any live sale), so that a dead holder's frees itself and a
    /// live one's stays its own.
    pub async fn reset(&self, stock: i64, orphan_lease: Duration) -> RedisResult<()> {
        let reset = &scripts::reset(&self.keys, stock, orphan_lease);
        self.call(|mut c| async move { reset.invoke_async::<i64>(&mut c).await })
            .await
            .map(drop)
    }

    /// The stock, the initial stock and the sales count: `None` when the item was never
    /// stocked (or Redis lost its data), rather than a stock of 0 that looks real.
    async fn counters(&self) -> RedisResult<Option<(i64, i64, i64)>> {
        let k = &self.keys;
        let (stock, initial, sales): (Option<i64>, Option<i64>, Option<i64>) = self
            .call(|mut c| async move {
                redis::pipe()
                    .get(&k.stock)
                    .get(&k.initial)
                    .get(&k.sales)
                    .query_async(&mut c)
                    .await
            })
            .await?;
        Ok(match (stock, initial) {
            (None, None) => None,
            (stock, initial) => {
                Some((stock.unwrap_or(0), initial.unwrap_or(0), sales.unwrap_or(0)))
            }
        })
    }

    /// Whether the item has a stock key (one `EXISTS`).
    pub async fn is_stocked(&self) -> RedisResult<bool> {
        let key = &self.keys.stock;
        self.call(|mut c| async move { c.exists(key).await }).await
    }

    pub async fn inventory(&self) -> RedisResult<Option<Inventory>> {
        Ok(self
            .counters()
            .await?
            .map(|(stock, initial, sales)| Inventory {
                item: self.item().to_owned(),
                stock,
                initial,
                sales,
            }))
    }

    /// O(1) in the number of sales: counters kept by the write, plus the values sold twice.
    pub async fn audit(&self) -> RedisResult<Option<Audit>> {
        let Some((stock, initial, sales)) = self.counters().await? else {
            return Ok(None);
        };
        let key = &self.keys.duplicates;
        let duplicates: Vec<(i64, i64)> = self
            .call(|mut c| async move { c.hgetall(key).await })
            .await?;
        Ok(Some(Audit::compute(
            self.item(),
            initial,
            stock,
            sales,
            duplicates,
        )))
    }

    /// The newest `LEDGER_MAX` ledger entries, oldest first (the stream may keep a few
    /// more: the write trims whole nodes of it).
    pub async fn ledger(&self) -> RedisResult<Vec<String>> {
        let key = &self.keys.ledger;
        let cap = self.ledger_cap;
        let entries: Vec<(String, Vec<(String, String)>)> = self
            .call(|mut c| async move {
                redis::cmd("XREVRANGE")
                    .arg(key)
                    .arg("+")
                    .arg("-")
                    .arg("COUNT")
                    .arg(cap)
                    .query_async(&mut c)
                    .await
            })
            .await?;
        Ok(entries
            .into_iter()
            .rev()
            .flat_map(|(_, fields)| fields.into_iter().map(|(_, entry)| entry))
            .collect())
    }
}

/// The pool, connecting lazily; its size and usage are reported by `/metrics`.
fn build_pool(
    info: redis::ConnectionInfo,
    timeout: Duration,
    settings: PoolSettings,
) -> RedisResult<deadpool_redis::Pool> {
    use deadpool_redis::{Manager, Pool, Runtime};
    let config = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(timeout))
        .set_response_timeout(Some(timeout + settings.reply_slack));
    let manager = Manager::new_with_config(info, config)?;
    let pool = Pool::builder(manager)
        .max_size(settings.size)
        .runtime(Runtime::Tokio1)
        .wait_timeout(Some(settings.wait))
        .create_timeout(Some(timeout))
        .recycle_timeout(Some(timeout))
        .build()
        .map_err(|e| {
            RedisError::from((redis::ErrorKind::InvalidClientConfig, "pool", e.to_string()))
        })?;
    Ok(pool)
}

impl Audit {
    /// `duplicates`: each remaining-stock value sold more than once, with how many times.
    pub fn compute(
        item: &str,
        initial: i64,
        remaining: i64,
        sales: i64,
        duplicates: Vec<(i64, i64)>,
    ) -> Self {
        let mut duplicates: Vec<Duplicate> = duplicates
            .into_iter()
            .filter(|&(_, times)| times > 1)
            .map(|(remaining, times)| Duplicate { remaining, times })
            .collect();
        duplicates.sort_by_key(|d| std::cmp::Reverse(d.remaining));
        let oversold = (sales - initial).max(0);
        let lost_updates = sales - (initial - remaining);
        let clean = oversold == 0 && lost_updates == 0 && duplicates.is_empty();
        Self {
            item: item.to_owned(),
            initial,
            remaining,
            sales,
            oversold,
            lost_updates,
            duplicates,
            clean,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_policy_that_can_evict_under_a_memory_limit_counts() {
        let info = |max: &str, policy: &str| {
            format!(
                "# Memory\r\nused_memory:1\r\nmaxmemory:{max}\r\nmaxmemory_human:x\r\nmaxmemory_policy:{policy}\r\n"
            )
        };
        assert_eq!(evicting_policy(&info("0", "allkeys-lru")), None);
        assert_eq!(evicting_policy(&info("1048576", "noeviction")), None);
        for policy in [
            "volatile-lru",
            "allkeys-lru",
            "volatile-ttl",
            "allkeys-random",
        ] {
            assert_eq!(
                evicting_policy(&info("1048576", policy)).as_deref(),
                Some(policy)
            );
        }
        assert_eq!(evicting_policy("garbage"), None);
    }

    /// Every key name of one item, the idempotency keys and the hand-off inboxes included.
    fn every_key(k: &Keys) -> Vec<String> {
        let Keys {
            stock,
            initial,
            ledger,
            sales,
            sold,
            duplicates,
            lockfree_writes,
            single_node_writes,
            quorum_writes,
            single_node_unfenced_reads,
            quorum_unfenced_reads,
            fence,
            fence_seen,
            quorum_fence_seen,
            lock,
            released,
            signal,
            queue,
            queue_entries,
            queue_inboxes,
            wait_barrier,
            idempotency_prefix: _,
            sharded: _,
        } = k;
        let mut keys: Vec<String> = [
            stock,
            initial,
            ledger,
            sales,
            sold,
            duplicates,
            lockfree_writes,
            single_node_writes,
            quorum_writes,
            single_node_unfenced_reads,
            quorum_unfenced_reads,
            fence,
            fence_seen,
            quorum_fence_seen,
            lock,
            released,
            signal,
            queue,
            queue_entries,
            queue_inboxes,
            wait_barrier,
        ]
        .into_iter()
        .cloned()
        .collect();
        keys.push(k.idempotency("5f0c3c1e-8a51"));
        keys.push(k.idempotency(""));
        keys.push(k.inbox("9b2f6c0e"));
        keys
    }

    use cluster::crc16;

    #[test]
    fn every_key_of_an_item_is_in_the_slot_of_its_hash_tag() {
        for item in ["001", "sku_9-b", "A", "z-long_item-id-with-32-chars-xx"] {
            let keys = Keys::new(item);
            let slot = crc16(item.as_bytes()) % 16384;
            for key in every_key(&keys) {
                assert!(key.starts_with(&format!("inventory:{{{item}}}:")), "{key}");
                assert_eq!(hash_slot(&key), slot, "{key} left the slot of {item}");
            }
        }
    }

    #[test]
    fn two_items_share_no_key() {
        let (a, b) = (every_key(&Keys::new("a")), every_key(&Keys::new("b")));
        assert!(a.iter().all(|k| !b.contains(k)));
    }

    #[test]
    fn audit_of_a_correct_run_is_clean() {
        let audit = Audit::compute("001", 5, 0, 5, vec![]);
        assert!(audit.clean);
        assert_eq!((audit.oversold, audit.lost_updates), (0, 0));
    }

    #[test]
    fn audit_counts_what_two_instances_selling_the_same_item_leave_behind() {
        // Stock 2, four sales, two of them overwritten: 1 left twice, then 0 left twice.
        let audit = Audit::compute("001", 2, 0, 4, vec![(1, 2), (0, 2)]);
        assert_eq!(audit.oversold, 2);
        assert_eq!(audit.lost_updates, 2);
        assert_eq!(audit.duplicates.len(), 2);
        assert_eq!(audit.duplicates[0].remaining, 1);
        assert!(!audit.clean);
    }
}

//! The stock on a Redis Cluster (`REDIS_CLUSTER`).
//!
//! Commands go through the `redis` crate's cluster connection, which refreshes its slot
//! map after a `MOVED` or a failover; its own retries are off, and the store sends again
//! only a call that certainly did not run ([`not_run`]). It connects lazily, so an instance
//! starts while the cluster is down. Every key of one item shares the hash tag `{item}`, so
//! each command and script touches one slot.
//!
//! What must stay on one connection to one node cannot go through it: `WATCH` / `MULTI` /
//! `EXEC` (`optimistic`), a command with its `WAIT` (`REPLICA_ACKS`), a blocking `BLPOP`
//! (`LOCK_WAIT=notify`), and every call under `REDIS_CONNECTION=pool`. Those take a plain
//! connection (a pool per node) to the master that owns the item's slot, found with
//! `CLUSTER SLOTS` and looked up again after an error that says the slot may have moved
//! (`MOVED`, `ASK`, `TRYAGAIN`, `CLUSTERDOWN`, a dead connection): a call on a stale owner
//! fails (503) rather than landing on the wrong node, and the next one goes to the new
//! owner.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use redis::cluster::{ClusterClientBuilder, ClusterConfig};
use redis::cluster_async::ClusterConnection;
use redis::{Client, RedisError, RedisResult};

use super::PoolSettings;
use super::sentinel::Backend;

/// The shortest time between two slot lookups started by errors.
const LOOKUP_INTERVAL: Duration = Duration::from_millis(100);

/// How long the shared cluster connection may leave every call unanswered before it is
/// replaced by a new one (at least; twice the call timeout when that is longer).
///
/// Why: the crate's connection can wedge. After a master was killed under load, a slot
/// refresh that never completed held every call of every item on every master until its
/// timeout, for as long as the instance ran (found from outside: 5 of 5 runs with keyed
/// sales; 60 s and more, the cluster healthy again meanwhile, only a restart helped). A
/// connection that answers nothing for this long is replaced, as a restart would; one that
/// answers anything (an error included) is left alone.
const REBUILD_AFTER: Duration = Duration::from_secs(2);

/// The shortest time between two replacements of the shared connection after `CLUSTERDOWN`
/// refusals ([`Cluster::refused`]): a cluster that is down refuses every call, and a new
/// connection a second is enough to find the slots once it is up again.
const REBUILD_REFUSED: Duration = Duration::from_secs(1);

/// When the shared connection last answered, and when it was last replaced, in
/// milliseconds since `since`: atomics, as every call notes its answer.
struct Watch {
    since: Instant,
    answered: AtomicU64,
    rebuilt: AtomicU64,
}

impl Watch {
    fn now(&self) -> u64 {
        u64::try_from(self.since.elapsed().as_millis()).unwrap_or(u64::MAX)
    }
}

/// `REDIS_CLUSTER`, checked: the seed nodes, in the order given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterSeeds(pub Vec<String>);

impl ClusterSeeds {
    /// `list`: comma-separated `redis://host:port` URLs (a password, if any, in each).
    /// Errors name the variable and the node, never its password.
    pub fn parse(list: &str) -> Result<Self, String> {
        let mut urls: Vec<String> = Vec::new();
        for (i, url) in list.split(',').map(str::trim).enumerate() {
            let node = i + 1;
            let shown = super::redact(url);
            if url.is_empty() {
                return Err(format!(
                    "REDIS_CLUSTER: node {node} is empty; give comma-separated seed URLs such \
                     as redis://127.0.0.1:7000,redis://127.0.0.1:7001"
                ));
            }
            let info = match redis::IntoConnectionInfo::into_connection_info(url) {
                Ok(info) => info,
                Err(e) => {
                    return Err(format!(
                        "REDIS_CLUSTER: node {node} ({shown}) is not a Redis URL \
                         (redis://host:port): {:?}",
                        e.kind()
                    ));
                }
            };
            if !matches!(info.addr(), redis::ConnectionAddr::Tcp(_, _)) {
                return Err(format!(
                    "REDIS_CLUSTER: node {node} ({shown}) is not a TCP address (redis://host:port)"
                ));
            }
            if info.redis_settings().db() != 0 {
                return Err(format!(
                    "REDIS_CLUSTER: node {node} ({shown}) names a database; a cluster has only \
                     database 0"
                ));
            }
            if !urls.iter().any(|u| u == url) {
                urls.push(url.to_owned());
            }
        }
        Ok(Self(urls))
    }
}

/// One slot range and the address (`host:port`) of its master.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Range {
    start: u16,
    end: u16,
    master: String,
}

pub(super) struct Cluster {
    /// Shared by every call, like the multiplexed connection of a single server; replaced
    /// when it stops answering ([`REBUILD_AFTER`]).
    conn: RwLock<ClusterConnection>,
    watch: Watch,
    seeds: ClusterSeeds,
    timeout: Duration,
    pool: Mutex<PoolSettings>,
    slots: RwLock<Vec<Range>>,
    /// Per master address: a pool and a client, built when first needed.
    nodes: Mutex<HashMap<String, Arc<Backend>>>,
    looking_up: AtomicBool,
}

impl Cluster {
    /// Does not touch the network.
    pub fn new(seeds: ClusterSeeds, timeout: Duration, pool: PoolSettings) -> RedisResult<Self> {
        let client = builder(&seeds).build()?;
        let conn = client.get_pending_async_connection_with_config(config(timeout));
        Ok(Self {
            conn: RwLock::new(conn),
            watch: Watch {
                since: Instant::now(),
                answered: AtomicU64::new(0),
                rebuilt: AtomicU64::new(0),
            },
            seeds,
            timeout,
            pool: Mutex::new(pool),
            slots: RwLock::new(Vec::new()),
            nodes: Mutex::new(HashMap::new()),
            looking_up: AtomicBool::new(false),
        })
    }

    pub fn conn(&self) -> ClusterConnection {
        self.conn.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// A call on the shared connection got an answer (a reply or an error, in time).
    pub fn answered(&self) {
        let now = self.watch.now();
        self.watch.answered.store(now, Ordering::Relaxed);
    }

    /// A call on the shared connection got no answer in time: once nothing has answered
    /// for [`REBUILD_AFTER`] (and it was not replaced within that), the connection is
    /// replaced by a new one, which connects on its first call.
    pub fn unanswered(&self) {
        let bound =
            u64::try_from(REBUILD_AFTER.max(2 * self.timeout).as_millis()).unwrap_or(u64::MAX);
        let now = self.watch.now();
        let answered = self.watch.answered.load(Ordering::Relaxed);
        if now.saturating_sub(answered) < bound || !self.claim_rebuild(now, bound) {
            return;
        }
        let silent = Duration::from_millis(now.saturating_sub(answered));
        self.rebuild(&format!(
            "the cluster connection answered nothing for {silent:?}"
        ));
    }

    /// A call on the shared connection was refused with `CLUSTERDOWN`: the crate sent it to
    /// the node its slot map names, which may be a node no longer in the cluster (removed
    /// with `--cluster del-node`, which resets it and leaves it running: it answers "Hash
    /// slot not served" to every key, never `MOVED`, so the crate's map is never corrected).
    /// From outside, a sixth of 120 items answered 503 on a healthy cluster for minutes,
    /// until that node was killed. The connection is replaced (at most once per
    /// [`REBUILD_REFUSED`]), and the new one reads the slot map afresh from the seeds.
    pub fn refused(&self) {
        let bound = u64::try_from(REBUILD_REFUSED.as_millis()).unwrap_or(u64::MAX);
        if self.claim_rebuild(self.watch.now(), bound) {
            self.rebuild("a call was refused with CLUSTERDOWN");
        }
    }

    /// Whether this caller may replace the connection at `now`: none was replaced within
    /// `bound`, and no other caller claimed it first (they see `rebuilt` moved and return).
    fn claim_rebuild(&self, now: u64, bound: u64) -> bool {
        let rebuilt = self.watch.rebuilt.load(Ordering::Relaxed);
        now.saturating_sub(rebuilt) >= bound
            && self
                .watch
                .rebuilt
                .compare_exchange(rebuilt, now, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
    }

    fn rebuild(&self, why: &str) {
        match builder(&self.seeds).build() {
            Ok(client) => {
                let fresh = client.get_pending_async_connection_with_config(config(self.timeout));
                *self.conn.write().unwrap_or_else(|p| p.into_inner()) = fresh;
                tracing::warn!("{why}: the cluster connection is replaced by a new one");
            }
            Err(e) => tracing::warn!(error = %e, "cannot build a new cluster connection"),
        }
    }

    /// `host:port` of the first seed, for logs.
    pub fn address(&self) -> String {
        self.seeds
            .0
            .first()
            .and_then(|url| redis::IntoConnectionInfo::into_connection_info(url.as_str()).ok())
            .map(|info| info.addr().to_string())
            .unwrap_or_default()
    }

    /// A cluster connection of its own, speaking RESP3 and pushing what it receives (sharded
    /// pub/sub messages) to `sender`; the crate subscribes it again after a reconnection or
    /// a change of the slot map.
    pub fn subscriber(
        &self,
        sender: tokio::sync::mpsc::UnboundedSender<redis::PushInfo>,
    ) -> RedisResult<ClusterConnection> {
        let client = builder(&self.seeds)
            .use_protocol(redis::ProtocolVersion::RESP3)
            .push_sender(sender)
            .build()?;
        Ok(client.get_pending_async_connection_with_config(config(self.timeout)))
    }

    /// Rebuilds the node pools with `settings` (they are built again when next needed).
    pub fn resize_pool(&self, settings: PoolSettings) {
        *self.pool.lock().unwrap_or_else(|p| p.into_inner()) = settings;
        self.nodes.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }

    /// Every node pool built so far, for the pool gauges.
    pub fn pools(&self) -> Vec<deadpool_redis::Pool> {
        self.nodes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .map(|b| b.pool.clone())
            .collect()
    }

    /// The connections to the master of `slot` as the cluster names it now (asking it when
    /// nothing is known yet).
    pub async fn owner(&self, slot: u16) -> RedisResult<Arc<Backend>> {
        let known = self.master_of(slot);
        let master = match known {
            Some(master) => master,
            None => {
                self.look_up().await?;
                self.master_of(slot).ok_or_else(|| {
                    RedisError::from((
                        redis::ErrorKind::Server(redis::ServerErrorKind::ClusterDown),
                        "no master serves the item's slot",
                        format!("slot {slot}"),
                    ))
                })?
            }
        };
        self.backend(&master)
    }

    /// A client for the master of `slot`, asked of the cluster now: for connections that
    /// last (a blocked `BLPOP`), made after an error that may mean the slot moved.
    pub async fn fresh_owner_client(&self, slot: u16) -> RedisResult<Client> {
        self.look_up().await?;
        Ok(self.owner(slot).await?.client.clone())
    }

    fn master_of(&self, slot: u16) -> Option<String> {
        self.slots
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .find(|r| r.start <= slot && slot <= r.end)
            .map(|r| r.master.clone())
    }

    fn backend(&self, master: &str) -> RedisResult<Arc<Backend>> {
        let mut nodes = self.nodes.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(backend) = nodes.get(master) {
            return Ok(backend.clone());
        }
        let client = Client::open(node_url(&self.seeds, master))?;
        let settings = *self.pool.lock().unwrap_or_else(|p| p.into_inner());
        let backend = Arc::new(Backend::build(client, self.timeout, settings)?);
        nodes.insert(master.to_owned(), backend.clone());
        Ok(backend)
    }

    /// Asks the cluster (a node the crate picks) which master serves which slots.
    async fn look_up(&self) -> RedisResult<()> {
        let mut conn = self.conn();
        let reply = tokio::time::timeout(
            self.timeout,
            redis::cmd("CLUSTER")
                .arg("SLOTS")
                .query_async::<redis::Value>(&mut conn),
        )
        .await
        .map_err(|_| {
            RedisError::from(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "CLUSTER SLOTS did not answer in time",
            ))
        })??;
        self.adopt_slots(&reply);
        Ok(())
    }

    /// Takes the slot map a node answered `CLUSTER SLOTS` with, unless it had none (a node
    /// outside the cluster, or one that does not know the masters' addresses yet); whether
    /// it was taken.
    fn adopt_slots(&self, reply: &redis::Value) -> bool {
        let ranges = parse_slots(reply);
        if ranges.is_empty() {
            return false;
        }
        *self.slots.write().unwrap_or_else(|p| p.into_inner()) = ranges;
        true
    }

    /// After a failed call on a node connection: looks the slots up again (in the
    /// background, at most one lookup per [`LOOKUP_INTERVAL`]) if the error says the slot
    /// may have another master now.
    pub fn after_error(self: &Arc<Self>, e: &RedisError) {
        if !slot_may_have_moved(e) || self.looking_up.swap(true, Ordering::AcqRel) {
            return;
        }
        let cluster = self.clone();
        tokio::spawn(async move {
            if let Err(e) = cluster.look_up().await {
                tracing::debug!(error = %e, "cannot look the cluster's slots up yet");
            }
            tokio::time::sleep(LOOKUP_INTERVAL).await;
            cluster.looking_up.store(false, Ordering::Release);
        });
    }

    /// `CLUSTER INFO` of the master serving `slot` (the default item's): ready means
    /// `cluster_state:ok`. Asked of a node the crate picked, it could be a node no longer in
    /// the cluster (removed with `--cluster del-node`, or reset, and left running), which says
    /// `cluster_state:fail`: from outside, `/ready` answered 503 to a fifth of the probes of a
    /// healthy cluster. A server without cluster support, named by mistake, answers
    /// single-node commands all the same (the crate sends them on): this is where it shows,
    /// and says so.
    pub async fn state_ok(&self, slot: u16) -> RedisResult<bool> {
        match self.owner_state(slot).await {
            Ok(true) => return Ok(true),
            Err(e) if super::is_not_a_cluster(&e) => return Err(e),
            _ => {}
        }
        // The map may name a master that has left the cluster since (its slots moved away,
        // then removed and reset; from outside, an idle instance answered 503 for minutes
        // while every sale of the item sold): read the map afresh from a node that has one,
        // and ask the master it names. The crate's map is likely as old: renewed too.
        if self.look_up_from_nodes().await.is_ok() {
            match self.owner_state(slot).await {
                Ok(true) => {
                    self.refused();
                    return Ok(true);
                }
                Ok(false) => return Ok(false),
                Err(_) => {}
            }
        }
        self.state_ok_anywhere().await
    }

    /// `CLUSTER INFO` of the master the map names for `slot`.
    async fn owner_state(&self, slot: u16) -> RedisResult<bool> {
        let mut conn = self.owner(slot).await?.conn.clone();
        Self::cluster_state(&mut conn).await
    }

    /// The slot map from the first node that has one: each known master, then each seed. A
    /// node outside the cluster (reset) answers with no slots, and is passed over; the
    /// crate's connection would ask a node of its own choosing, that one perhaps.
    async fn look_up_from_nodes(&self) -> RedisResult<()> {
        let mut clients: Vec<Client> = self
            .nodes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .map(|backend| backend.client.clone())
            .collect();
        clients.extend(
            self.seeds
                .0
                .iter()
                .filter_map(|url| Client::open(url.as_str()).ok()),
        );
        let mut last = None;
        for client in clients {
            let asked = tokio::time::timeout(self.timeout, async {
                let mut conn = client.get_multiplexed_async_connection().await?;
                redis::cmd("CLUSTER")
                    .arg("SLOTS")
                    .query_async::<redis::Value>(&mut conn)
                    .await
            })
            .await;
            match asked {
                Ok(Ok(reply)) if self.adopt_slots(&reply) => return Ok(()),
                Ok(Ok(_)) => {}
                Ok(Err(e)) => last = Some(e),
                Err(_) => {}
            }
        }
        Err(last.unwrap_or_else(|| {
            RedisError::from((
                redis::ErrorKind::Server(redis::ServerErrorKind::ClusterDown),
                "no cluster node answered with a slot map",
            ))
        }))
    }

    /// `CLUSTER INFO` of a node the crate picks, when no master is known for the slot.
    async fn state_ok_anywhere(&self) -> RedisResult<bool> {
        Self::cluster_state(&mut self.conn()).await
    }

    /// `CLUSTER INFO` on `conn`: whether it says `cluster_state:ok`.
    async fn cluster_state<C: redis::aio::ConnectionLike>(conn: &mut C) -> RedisResult<bool> {
        let info: RedisResult<String> = redis::cmd("CLUSTER").arg("INFO").query_async(conn).await;
        match info {
            Ok(info) => Ok(info.lines().any(|l| l.trim() == "cluster_state:ok")),
            Err(e) if e.to_string().contains("cluster support disabled") => {
                Err(RedisError::from((
                    redis::ErrorKind::Server(redis::ServerErrorKind::ClusterDown),
                    super::NOT_A_CLUSTER,
                    "it answers CLUSTER INFO with `cluster support disabled`; give \
                     REDIS_CLUSTER the URLs of cluster nodes, or use REDIS_URL"
                        .to_owned(),
                )))
            }
            Err(e) => Err(e),
        }
    }
}

fn builder(seeds: &ClusterSeeds) -> ClusterClientBuilder {
    // No retries by the crate: it sends a call again after a dropped connection or a reply
    // timeout just as after a redirection, and a script that had run ran twice (found from
    // outside: a batch of atomic sales cut off before its reply ran again, 16 units sold
    // twice with one 200 each; a fenced write run again was refused, a 409 for a sale
    // that landed). The store sends again only what certainly did not run ([`not_run`]).
    ClusterClientBuilder::new(seeds.0.clone()).retries(0)
}

/// Whether a cluster call failed before it could run anywhere, so that sending it again
/// cannot run it twice: a redirection or a refusal by the node (`MOVED`, `ASK`, `TRYAGAIN`,
/// `CLUSTERDOWN`, `MASTERDOWN`, `LOADING`, `READONLY`: none runs the command), no connection
/// to the slot's node, or a connection refused. The crate refreshes its slot map after
/// the redirections, so the call sent again goes to the new owner.
pub(super) fn not_run(e: &RedisError) -> bool {
    use redis::{ErrorKind, ServerErrorKind};
    matches!(
        e.kind(),
        ErrorKind::Server(
            ServerErrorKind::Moved
                | ServerErrorKind::Ask
                | ServerErrorKind::TryAgain
                | ServerErrorKind::ClusterDown
                | ServerErrorKind::MasterDown
                | ServerErrorKind::BusyLoading
                | ServerErrorKind::ReadOnly
        ) | ErrorKind::ClusterConnectionNotFound
    ) || e.is_connection_refusal()
}

fn config(timeout: Duration) -> ClusterConfig {
    ClusterConfig::new()
        .set_connection_timeout(timeout)
        .set_response_timeout(timeout)
}

/// The URL of a master the cluster named, with the seeds' credentials (the crate uses the
/// first seed's for every node too).
fn node_url(seeds: &ClusterSeeds, master: &str) -> String {
    let userinfo = seeds
        .0
        .first()
        .and_then(|url| url.split_once("://"))
        .and_then(|(_, rest)| rest.rsplit_once('@'))
        .map(|(userinfo, _)| format!("{userinfo}@"))
        .unwrap_or_default();
    format!("redis://{userinfo}{master}")
}

/// `CLUSTER SLOTS`: `[[start, end, [host, port, id, ...], replicas...], ...]`.
fn parse_slots(reply: &redis::Value) -> Vec<Range> {
    use redis::Value;
    let int = |v: &Value| match v {
        Value::Int(n) => u16::try_from(*n).ok(),
        _ => None,
    };
    let text = |v: &Value| match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    };
    let Value::Array(ranges) = reply else {
        return Vec::new();
    };
    ranges
        .iter()
        .filter_map(|range| {
            let Value::Array(fields) = range else {
                return None;
            };
            let start = int(fields.first()?)?;
            let end = int(fields.get(1)?)?;
            let Value::Array(master) = fields.get(2)? else {
                return None;
            };
            // A node that does not know a master's address yet names it `?` or nothing
            // (just after the cluster formed): a range it cannot place is left unknown,
            // and the call that needed it fails as not run and is sent again.
            let host = text(master.first()?).filter(|h| !h.is_empty() && h != "?")?;
            let port = match master.get(1)? {
                Value::Int(p) => u16::try_from(*p).ok()?,
                _ => return None,
            };
            Some(Range {
                start,
                end,
                master: format!("{host}:{port}"),
            })
        })
        .collect()
}

/// Errors after which the item's slot may be served by another master: redirections, a
/// cluster that is down or reconfiguring, a connection that failed.
fn slot_may_have_moved(e: &RedisError) -> bool {
    if super::is_pool_exhausted(e) {
        return false;
    }
    match e.code() {
        Some("MOVED" | "ASK" | "TRYAGAIN" | "CLUSTERDOWN" | "READONLY" | "MASTERDOWN") => true,
        Some(_) => false,
        None => !matches!(e.kind(), redis::ErrorKind::Server(_)),
    }
}

/// The slot Redis Cluster puts `key` in: the CRC16 of the first `{...}` with something
/// inside, or of the whole key.
pub fn hash_slot(key: &str) -> u16 {
    let hashed = key
        .find('{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            rest.find('}')
                .filter(|&close| close > 0)
                .map(|close| &rest[..close])
        })
        .unwrap_or(key);
    crc16(hashed.as_bytes()) % 16384
}

/// CRC16-XMODEM (polynomial 0x1021, initial 0), the checksum Redis Cluster slots by.
pub fn crc16(bytes: &[u8]) -> u16 {
    bytes.iter().fold(0u16, |crc, &b| {
        (0..8).fold(crc ^ (u16::from(b) << 8), |crc, _| {
            if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            }
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeds_are_redis_urls_and_errors_name_the_variable_without_the_password() {
        let seeds = ClusterSeeds::parse("redis://127.0.0.1:7000, redis://127.0.0.1:7001").unwrap();
        assert_eq!(seeds.0.len(), 2);
        for (bad, says) in [
            ("redis://a:1,,redis://b:2", "node 2"),
            ("redis://:s3cret@a:1,http://:s3cret@b:2", "node 2"),
            ("redis://:s3cret@a:1/3", "database"),
            ("127.0.0.1:7000", "node 1"),
        ] {
            let err = ClusterSeeds::parse(bad).unwrap_err();
            assert!(err.starts_with("REDIS_CLUSTER"), "{err}");
            assert!(err.contains(says), "{err}");
            assert!(!err.contains("s3cret"), "{err}");
        }
    }

    #[test]
    fn a_master_whose_address_is_not_known_yet_is_left_out_of_the_slot_map() {
        use redis::Value;
        let range = |start: i64, host: &str| {
            Value::Array(vec![
                Value::Int(start),
                Value::Int(start + 99),
                Value::Array(vec![
                    Value::BulkString(host.as_bytes().to_vec()),
                    Value::Int(7001),
                ]),
            ])
        };
        let reply = Value::Array(vec![range(0, "127.0.0.1"), range(100, "?"), range(200, "")]);
        let ranges = parse_slots(&reply);
        assert_eq!(ranges.len(), 1, "{ranges:?}");
        assert_eq!(ranges[0].master, "127.0.0.1:7001");
    }

    #[test]
    fn a_node_url_keeps_the_seeds_credentials() {
        let seeds = ClusterSeeds(vec!["redis://u:pw@127.0.0.1:7000".into()]);
        assert_eq!(
            node_url(&seeds, "10.0.0.2:7003"),
            "redis://u:pw@10.0.0.2:7003"
        );
        let open = ClusterSeeds(vec!["redis://127.0.0.1:7000".into()]);
        assert_eq!(node_url(&open, "10.0.0.2:7003"), "redis://10.0.0.2:7003");
    }

    #[test]
    fn cluster_slots_are_read_as_ranges_with_their_master() {
        use redis::Value;
        let bulk = |s: &str| Value::BulkString(s.as_bytes().to_vec());
        let reply = Value::Array(vec![Value::Array(vec![
            Value::Int(0),
            Value::Int(5460),
            Value::Array(vec![bulk("127.0.0.1"), Value::Int(7000), bulk("id")]),
            Value::Array(vec![bulk("127.0.0.1"), Value::Int(7003), bulk("id2")]),
        ])]);
        assert_eq!(
            parse_slots(&reply),
            [Range {
                start: 0,
                end: 5460,
                master: "127.0.0.1:7000".into()
            }]
        );
    }

    #[test]
    fn crc16_matches_the_redis_cluster_specification() {
        // The check value the specification gives, and slots `CLUSTER KEYSLOT` answers.
        assert_eq!(crc16(b"123456789"), 0x31C3);
        assert_eq!(hash_slot("foo"), 12182);
        assert_eq!(hash_slot("{user1000}.following"), hash_slot("user1000"));
        assert_eq!(hash_slot("foo{}{bar}"), crc16(b"foo{}{bar}") % 16384);
    }
}

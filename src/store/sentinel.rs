//! Where a store's connections go: a fixed server (`REDIS_URL`), or the master that Redis
//! Sentinel names (`REDIS_SENTINELS`, `REDIS_MASTER_NAME`).
//!
//! Under Sentinel the master can change without the service being told: after a failover
//! the old master is dead (connections refused or timing out) or, once back, a replica
//! (writes answer `READONLY`). Any such error makes the store ask the sentinels again
//! (the `redis` crate's `SentinelClient`, which also checks the `ROLE` of the server it
//! names) and, if they name another server, replace its connections, so that sales resume
//! by themselves: 503s until Sentinel has promoted a replica, then the new master. At most
//! one lookup runs at a time, and at most one starts per [`LOOKUP_INTERVAL`].
//!
//! A failover whose old master is still up (`SENTINEL FAILOVER`, or sentinels cut off from
//! a master the instances still reach) is the costly one: the old master takes writes until
//! Sentinel turns it into a replica of the promoted one, which then wipes them, sales
//! answered 200 included (2384 of 4121 in 1.7 s, in an outside run of a planned failover).
//! No error says so, and a lookup meanwhile names the old master. So every instance listens
//! to every sentinel: from the moment one says it tries a failover of our master
//! (`+try-failover`, sent before it even picks the replica to promote), calls are held
//! (each for at most the store's timeout, then a 503 with nothing sent) until a sentinel
//! names the new master (`+switch-master`, followed at once) or gives the failover up, and
//! for at most [`HOLD_MAX`]. Sentinels announce late and out of order; [`news`] says which
//! announcement is news and which is the story of an earlier change.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::Duration;

use futures_util::StreamExt;
use tokio::time::Instant;

use redis::aio::ConnectionManager;
use redis::sentinel::{SentinelClient, SentinelServerType};
use redis::{Client, RedisError, RedisResult};

use super::PoolSettings;

/// The shortest time between two lookups: a dead master fails every call, and each would
/// otherwise ask the sentinels again.
const LOOKUP_INTERVAL: Duration = Duration::from_millis(100);
/// How often the master is looked up without an error to prompt it.
const WATCH_INTERVAL: Duration = Duration::from_millis(500);
mod news;

use news::{Act, HOLD_MAX, Heard, News};

/// `REDIS_SENTINELS` and `REDIS_MASTER_NAME`, checked, with the passwords of
/// `REDIS_SENTINEL_PASSWORD` and `REDIS_MASTER_PASSWORD`.
#[derive(Clone, PartialEq, Eq)]
pub struct Sentinels {
    /// `(host, port)` of each sentinel, in the order given.
    pub addrs: Vec<(String, u16)>,
    pub master_name: String,
    /// The sentinels' own `requirepass`.
    pub sentinel_password: Option<String>,
    /// The `requirepass` of the master and replicas they name.
    pub master_password: Option<String>,
}

/// The passwords stay out of logs and errors.
impl std::fmt::Debug for Sentinels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hidden = |p: &Option<String>| p.as_ref().map(|_| "***");
        f.debug_struct("Sentinels")
            .field("addrs", &self.addrs)
            .field("master_name", &self.master_name)
            .field("sentinel_password", &hidden(&self.sentinel_password))
            .field("master_password", &hidden(&self.master_password))
            .finish()
    }
}

impl Sentinels {
    /// `list`: comma-separated `host:port`; every entry must be one.
    pub fn parse(list: &str, master_name: &str) -> Result<Self, String> {
        let mut addrs = Vec::new();
        for (i, addr) in list.split(',').map(str::trim).enumerate() {
            let parsed = addr
                .rsplit_once(':')
                .and_then(|(host, port)| Some((host, port.parse::<u16>().ok()?)))
                .filter(|(host, _)| !host.is_empty());
            let Some((host, port)) = parsed else {
                return Err(format!(
                    "REDIS_SENTINELS: sentinel {} ({:?}) is not host:port; give \
                     comma-separated host:port such as 127.0.0.1:26379,127.0.0.1:26380 \
                     (a password goes in REDIS_SENTINEL_PASSWORD)",
                    i + 1,
                    super::redact(addr)
                ));
            };
            addrs.push((host.to_owned(), port));
        }
        if master_name.trim().is_empty() {
            return Err("REDIS_MASTER_NAME is empty: name the master the sentinels monitor".into());
        }
        Ok(Self {
            addrs,
            master_name: master_name.to_owned(),
            sentinel_password: None,
            master_password: None,
        })
    }

    /// Empty passwords count as none: an unset variable in a compose file expands to "".
    pub fn with_passwords(mut self, sentinel: Option<&str>, master: Option<&str>) -> Self {
        let given = |p: Option<&str>| p.filter(|p| !p.is_empty()).map(str::to_owned);
        self.sentinel_password = given(sentinel);
        self.master_password = given(master);
        self
    }

    fn auth(password: &Option<String>) -> redis::RedisConnectionInfo {
        let settings = redis::RedisConnectionInfo::default();
        match password {
            Some(p) => settings.set_password(p),
            None => settings,
        }
    }

    /// A sentinel's own connection, for listening to its announcements.
    fn sentinel_info(&self, host: &str, port: u16) -> RedisResult<redis::ConnectionInfo> {
        redis::IntoConnectionInfo::into_connection_info((host, port))
            .map(|info| info.set_redis_settings(Self::auth(&self.sentinel_password)))
    }

    /// Whether the sentinel at `host:port` knows the master's name, whatever state it holds
    /// the master in (`SENTINEL GET-MASTER-ADDR-BY-NAME` names a master that is down, where
    /// the crate's lookup skips it); `None` when it does not answer within `timeout`.
    fn knows_name(&self, host: &str, port: u16, timeout: Duration) -> Option<bool> {
        let asked = || -> RedisResult<Option<(String, u16)>> {
            let client = Client::open(self.sentinel_info(host, port)?)?;
            let mut c = client.get_connection_with_timeout(timeout)?;
            c.set_read_timeout(Some(timeout))?;
            redis::cmd("SENTINEL")
                .arg("GET-MASTER-ADDR-BY-NAME")
                .arg(&self.master_name)
                .query(&mut c)
        };
        asked().ok().map(|address| address.is_some())
    }

    /// A client of the server a sentinel named master.
    fn master_client(&self, host: &str, port: u16) -> RedisResult<Client> {
        let info = redis::IntoConnectionInfo::into_connection_info((host, port))?
            .set_redis_settings(Self::auth(&self.master_password));
        Client::open(info)
    }

    /// The `SentinelClient` these settings describe: the sentinels' addresses (with their
    /// password, set as a field, so that no character of it needs escaping in a URL), and
    /// the master's password for the connections to the servers they name.
    fn client(&self) -> RedisResult<SentinelClient> {
        let nodes = self
            .addrs
            .iter()
            .map(|(host, port)| self.sentinel_info(host, *port))
            .collect::<RedisResult<Vec<_>>>()?;
        let servers = redis::sentinel::SentinelNodeConnectionInfo::default()
            .set_redis_connection_info(Self::auth(&self.master_password));
        SentinelClient::build(
            nodes,
            self.master_name.clone(),
            Some(servers),
            SentinelServerType::Master,
        )
    }
}

/// The connections to one server.
pub(super) struct Backend {
    pub conn: ConnectionManager,
    pub pool: deadpool_redis::Pool,
    pub client: Client,
}

impl Backend {
    /// Connects lazily: nothing is sent before the first call.
    pub fn build(client: Client, timeout: Duration, pool: PoolSettings) -> RedisResult<Self> {
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout))
            .set_number_of_retries(1)
            .set_min_delay(Duration::from_millis(50))
            .set_max_delay(Duration::from_millis(500));
        // RESP3 for the shared connection: the manager then hears of the connection's end
        // (Redis restarted, a failover) when it happens and reconnects at once, rather than
        // when the next request writes into the dead connection and fails with it.
        let info = client.get_connection_info().clone();
        let resp3 = info
            .redis_settings()
            .clone()
            .set_protocol(redis::ProtocolVersion::RESP3);
        let managed = Client::open(info.set_redis_settings(resp3))?;
        let conn = ConnectionManager::new_lazy_with_config(managed, config)?;
        let pool = super::build_pool(client.get_connection_info().clone(), timeout, pool)?;
        Ok(Self { conn, pool, client })
    }

    fn address(&self) -> String {
        self.client.get_connection_info().addr().to_string()
    }
}

/// The server of a store, as it is now.
pub(super) struct Server {
    current: RwLock<Arc<Backend>>,
    lookup: Option<Lookup>,
    timeout: Duration,
    pool: Mutex<PoolSettings>,
    /// Counts the masters followed: connections of their own (a blocked `BLPOP`, a
    /// subscription) move when it changes. An old master still up after a planned failover
    /// breaks none of them until Sentinel reconfigures it (at its next `INFO`, up to 10 s
    /// later), and meanwhile they heard nothing of the releases on the new one.
    moved: tokio::sync::watch::Sender<u64>,
}

impl Server {
    /// Whether the master is found through sentinels, and so may move.
    pub(super) fn follows_sentinels(&self) -> bool {
        self.lookup.is_some()
    }
}

struct Lookup {
    sentinels: Sentinels,
    /// The failovers under way (calls wait for them) and the last switch followed.
    heard: Mutex<Heard>,
    held: tokio::sync::Notify,
    client: tokio::sync::Mutex<SentinelClient>,
    running: AtomicBool,
    /// Lookups finished so far: a caller that waited for the client while another lookup
    /// ran takes that one's answer instead of asking again.
    finished: AtomicU64,
}

impl Server {
    pub fn fixed(backend: Backend) -> Self {
        Self {
            current: RwLock::new(Arc::new(backend)),
            lookup: None,
            timeout: Duration::ZERO,
            pool: Mutex::new(PoolSettings::default()),
            moved: tokio::sync::watch::Sender::new(0),
        }
    }

    /// Asks the sentinels for the master once, now (blocking, at start-up). What the
    /// sentinels answer with is final (a refused password, an unknown master name: the
    /// configuration is wrong); that none of them, or not the master, could be reached is
    /// not: the instance starts as it does with Redis down, on a placeholder that refuses
    /// every connection (503s, not ready), and the lookups after each error and every
    /// [`WATCH_INTERVAL`] find the master when there is one.
    pub fn sentinel(
        sentinels: Sentinels,
        timeout: Duration,
        pool: PoolSettings,
    ) -> RedisResult<Self> {
        let client = sentinels.client()?;
        // The crate's blocking lookup has no timeout of its own, and asks the sentinels one
        // after another: a sentinel that accepts connections and never answers (frozen)
        // would hold the start-up forever. It runs on a thread of its own, waited for
        // within the lookup bound; one that overruns is left to finish or hang alone.
        let mut first = sentinels.client()?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(first.get_client());
        });
        // Beside the lookup, each sentinel is asked whether it knows the name at all. The
        // crate's error does not tell: it says "not found" also for a name whose master the
        // sentinels hold down (a failover yet to come), and reports the last sentinel it
        // asked, so one down at the end of the list hid the others' "no such master" and an
        // instance with a wrong name ran unready for good.
        let (known_tx, known_rx) = std::sync::mpsc::channel();
        for (host, port) in sentinels.addrs.clone() {
            let (asked, known_tx) = (sentinels.clone(), known_tx.clone());
            std::thread::spawn(move || {
                let _ = known_tx.send(asked.knows_name(&host, port, timeout));
            });
        }
        drop(known_tx);
        let started = std::time::Instant::now();
        let bound = timeout * 4;
        let start_without_one = || Backend::build(Client::open(UNREACHABLE)?, timeout, pool);
        // The lookup's error, or `None` when it did not end in time.
        let failed = match rx.recv_timeout(bound) {
            Ok(Ok(master)) => {
                let backend = Backend::build(master, timeout, pool)?;
                tracing::info!(master = %backend.address(), "Sentinel names the master");
                return Ok(Self::following(backend, sentinels, client, timeout, pool));
            }
            // A refused password and the like: the configuration is wrong.
            Ok(Err(e))
                if !unreachable(&e)
                    && e.kind() != redis::ErrorKind::MasterNameNotFoundBySentinel =>
            {
                return Err(e);
            }
            Ok(Err(e)) => Some(e),
            Err(_) => None,
        };
        // Some(true): a sentinel knows the name; Some(false): every sentinel that answered
        // does not; None: none answered.
        let mut known = None;
        while let Some(left) = bound.checked_sub(started.elapsed()) {
            match known_rx.recv_timeout(left) {
                Ok(Some(true)) => {
                    known = Some(true);
                    break;
                }
                Ok(Some(false)) => known = Some(false),
                Ok(None) => {}
                Err(_) => break,
            }
        }
        if known == Some(false) {
            return Err(RedisError::from((
                redis::ErrorKind::MasterNameNotFoundBySentinel,
                "no sentinel that answered knows the master name",
                sentinels.master_name.clone(),
            )));
        }
        match failed {
            Some(e) if unreachable(&e) => {
                tracing::warn!(error = %e, "no sentinel or no master reachable yet; starting without one and asking again")
            }
            Some(_) if known == Some(true) => tracing::warn!(
                master_name = %sentinels.master_name,
                "the sentinels know the master but hold it down; starting without one and asking again"
            ),
            Some(e) => {
                tracing::warn!(error = %e, "no sentinel said whether it knows the master; starting without one and asking again")
            }
            None => tracing::warn!(
                within_ms = bound.as_millis() as u64,
                "no sentinel named the master in time; starting without one and asking again"
            ),
        }
        let backend = start_without_one()?;
        Ok(Self::following(backend, sentinels, client, timeout, pool))
    }

    fn following(
        backend: Backend,
        sentinels: Sentinels,
        client: SentinelClient,
        timeout: Duration,
        pool: PoolSettings,
    ) -> Self {
        Self {
            current: RwLock::new(Arc::new(backend)),
            lookup: Some(Lookup {
                sentinels,
                heard: Mutex::new(Heard::default()),
                held: tokio::sync::Notify::new(),
                client: tokio::sync::Mutex::new(client),
                running: AtomicBool::new(false),
                finished: AtomicU64::new(0),
            }),
            timeout,
            pool: Mutex::new(pool),
            moved: tokio::sync::watch::Sender::new(0),
        }
    }

    /// Changes each time another master is followed (never for a fixed server).
    pub fn moves(&self) -> tokio::sync::watch::Receiver<u64> {
        self.moved.subscribe()
    }

    pub fn backend(&self) -> Arc<Backend> {
        self.current
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }

    fn replace(&self, backend: Backend) {
        *self
            .current
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = Arc::new(backend);
    }

    /// Rebuilds the pool of the current server with `settings`, and of every later one.
    pub fn resize_pool(&self, timeout: Duration, settings: PoolSettings) -> RedisResult<()> {
        *self.pool.lock().unwrap_or_else(|p| p.into_inner()) = settings;
        let current = self.backend();
        let pool = super::build_pool(
            current.client.get_connection_info().clone(),
            timeout,
            settings,
        )?;
        self.replace(Backend {
            conn: current.conn.clone(),
            pool,
            client: current.client.clone(),
        });
        Ok(())
    }

    /// After a failed call: under Sentinel, looks the master up again if the error says it
    /// may have moved.
    pub fn after_error(self: &Arc<Self>, e: &RedisError) {
        let Some(lookup) = &self.lookup else {
            return;
        };
        if master_may_have_moved(e) {
            self.look_up(lookup);
        }
    }

    /// Under Sentinel, asks the sentinels every [`WATCH_INTERVAL`] as well: a master that
    /// restarted empty at the old address (before Sentinel makes it a replica) accepts every
    /// command, so no error would ever say that the master moved.
    pub fn watch(self: &Arc<Self>) {
        if self.lookup.is_none() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if let Some(lookup) = &self.lookup {
            for (host, port) in &lookup.sentinels.addrs {
                match lookup.sentinels.sentinel_info(host, *port) {
                    Ok(info) => {
                        runtime.spawn(listen(Arc::downgrade(self), info, self.timeout));
                    }
                    Err(e) => tracing::warn!(error = %e, "cannot listen to a sentinel"),
                }
            }
        }
        let server = Arc::downgrade(self);
        runtime.spawn(async move {
            loop {
                tokio::time::sleep(WATCH_INTERVAL).await;
                let Some(server) = server.upgrade() else {
                    return;
                };
                if let Some(lookup) = &server.lookup {
                    server.look_up(lookup);
                }
            }
        });
    }

    /// Starts one lookup unless one is running (or ran within [`LOOKUP_INTERVAL`]).
    fn look_up(self: &Arc<Self>, lookup: &Lookup) {
        if lookup.running.swap(true, Ordering::AcqRel) {
            return;
        }
        let server = self.clone();
        let seen = lookup.finished.load(Ordering::Acquire);
        tokio::spawn(async move {
            server.follow_master_unless_answered(seen).await;
            tokio::time::sleep(LOOKUP_INTERVAL).await;
            if let Some(lookup) = &server.lookup {
                lookup.running.store(false, Ordering::Release);
            }
        });
    }

    /// Under Sentinel, looks the master up now and returns once the store follows the
    /// answer, unless a lookup that ended meanwhile already gave one: for a call refused by
    /// a master that is gone, which is sent again to the master the sentinels name, not to
    /// the same dead address (the first sale of each instance after a failover would
    /// otherwise fail, until the next lookup).
    pub async fn look_up_now(&self) {
        if let Some(lookup) = &self.lookup {
            let seen = lookup.finished.load(Ordering::Acquire);
            self.follow_master_unless_answered(seen).await;
        }
    }

    /// Asks the sentinels unless a lookup ended since the caller saw `seen` lookups end: a
    /// refused call starts a lookup in the background and awaits one of its own, and
    /// whichever takes the client first answers both.
    async fn follow_master_unless_answered(&self, seen: u64) {
        let Some(lookup) = &self.lookup else {
            return;
        };
        let mut client = lookup.client.lock().await;
        if lookup.finished.load(Ordering::Acquire) != seen {
            return;
        }
        self.follow_master_with(&mut client).await;
        lookup.finished.fetch_add(1, Ordering::AcqRel);
    }

    async fn follow_master_with(&self, client: &mut SentinelClient) {
        // Each sentinel, and the server it names, is asked within the call bound.
        let found = tokio::time::timeout(self.timeout * 4, client.async_get_client()).await;
        let master = match found {
            Ok(Ok(master)) => master,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "no master from Sentinel yet; asking again at the next error");
                return;
            }
            Err(_) => {
                tracing::warn!(
                    "Sentinel did not name a master in time; asking again at the next error"
                );
                return;
            }
        };
        let address = master.get_connection_info().addr().to_string();
        if let Some(lookup) = &self.lookup
            && let Some(pinned) = lock(&lookup.heard)
                .pinned_at(Instant::now())
                .map(ToString::to_string)
            && pinned != address
        {
            tracing::debug!(master = %address, %pinned, "a sentinel still names the old master: not followed");
            return;
        }
        self.follow(master, address);
    }

    fn follow(&self, master: Client, address: String) {
        let previous = self.backend().address();
        if address == previous {
            return;
        }
        let pool = *self.pool.lock().unwrap_or_else(|p| p.into_inner());
        match Backend::build(master, self.timeout, pool) {
            Ok(backend) => {
                self.replace(backend);
                self.moved.send_modify(|moves| *moves += 1);
                if previous == UNREACHABLE_ADDR {
                    tracing::info!(master = %address, "Sentinel names the master");
                } else {
                    tracing::warn!(master = %address, %previous, "Sentinel names a new master: following it");
                }
            }
            Err(e) => {
                tracing::warn!(master = %address, error = %e, "cannot connect to the new master")
            }
        }
    }
}

impl Server {
    /// Waits, at most `within`, while a failover a sentinel announced is under way: false
    /// if it still is, and the call should not be sent to a master that may be losing its
    /// writes.
    pub(super) async fn failover_clear(&self, within: Duration) -> bool {
        let Some(lookup) = &self.lookup else {
            return true;
        };
        let give_up = Instant::now() + within;
        loop {
            // Registered before the state is read, so a release in between is not missed.
            let released = lookup.held.notified();
            let Some(until) = lock(&lookup.heard).held_until(Instant::now()) else {
                return true;
            };
            if Instant::now() >= give_up {
                return false;
            }
            let _ = tokio::time::timeout_at(until.min(give_up), released).await;
        }
    }

    /// What the sentinel at `sentinel` said on one of the channels [`listen`] follows.
    fn on_announcement(&self, sentinel: &str, channel: &str, payload: &str) {
        let Some(lookup) = &self.lookup else {
            return;
        };
        let Some(news) = News::parse(channel, payload, &lookup.sentinels.master_name) else {
            return;
        };
        let act = lock(&lookup.heard).hear(sentinel, news.clone(), Instant::now());
        match act {
            Act::Hold => tracing::warn!(
                %sentinel,
                hold_max_ms = HOLD_MAX.as_millis() as u64,
                "a sentinel tries a failover: calls wait until it names the new master"
            ),
            Act::Follow(master) => {
                match lookup.sentinels.master_client(&master.host, master.port) {
                    Ok(client) => self.follow(client, master.to_string()),
                    Err(e) => {
                        tracing::warn!(%master, error = %e, "a sentinel named a master that cannot be reached")
                    }
                }
                lookup.held.notify_waiters();
            }
            Act::Release => {
                tracing::warn!(%channel, "the failover was given up: calls go on to the master");
                lookup.held.notify_waiters();
            }
            Act::Ignore => {
                tracing::info!(%sentinel, ?news, "a sentinel's news of an earlier change: not followed")
            }
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Listens to one sentinel's announcements of failovers for as long as the server lives,
/// connecting again after an error (a sentinel restarted, or not up yet).
async fn listen(server: Weak<Server>, sentinel: redis::ConnectionInfo, timeout: Duration) {
    let mut channels = vec![news::TRY_FAILOVER, news::SWITCH_MASTER];
    channels.extend(news::ABORTS);
    let name = sentinel.addr().to_string();
    loop {
        if server.strong_count() == 0 {
            return;
        }
        let subscribed = async {
            let mut pubsub = Client::open(sentinel.clone())?.get_async_pubsub().await?;
            pubsub.subscribe(&channels).await?;
            RedisResult::Ok(pubsub)
        };
        if let Ok(Ok(pubsub)) = tokio::time::timeout(timeout * 4, subscribed).await {
            let mut messages = pubsub.into_on_message();
            while let Some(message) = messages.next().await {
                let Some(server) = server.upgrade() else {
                    return;
                };
                let payload: String = message.get_payload().unwrap_or_default();
                server.on_announcement(&name, message.get_channel_name(), &payload);
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Where an instance that found no master at start-up sends its calls meanwhile: port 0
/// refuses every connection at once, so each call fails fast with a connection error.
const UNREACHABLE: &str = "redis://127.0.0.1:0";
const UNREACHABLE_ADDR: &str = "127.0.0.1:0";

/// A lookup that failed for want of a connection (to a sentinel or to the server one
/// named), not because of what was answered.
fn unreachable(e: &RedisError) -> bool {
    e.is_io_error() || e.is_timeout() || e.is_connection_refusal() || e.is_connection_dropped()
}

/// Refused, dropped or timed-out connections, and writes refused by a replica: the master
/// may be elsewhere now. An error Redis answered otherwise (a script's, say), or an
/// exhausted pool, says nothing about where the master is.
fn master_may_have_moved(e: &RedisError) -> bool {
    match e.kind() {
        redis::ErrorKind::Server(_) => matches!(e.code(), Some("READONLY" | "MASTERDOWN")),
        _ => !super::is_pool_exhausted(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sentinels_are_host_port_pairs_and_the_master_has_a_name() {
        let s = Sentinels::parse("127.0.0.1:26379, localhost:26380", "inventory").unwrap();
        assert_eq!(
            s.addrs,
            [
                ("127.0.0.1".to_owned(), 26379),
                ("localhost".to_owned(), 26380)
            ]
        );
        let s = s.with_passwords(Some("s3cret"), Some(""));
        assert_eq!(s.sentinel_password.as_deref(), Some("s3cret"));
        assert_eq!(s.master_password, None, "an empty password is none");
        assert!(!format!("{s:?}").contains("s3cret"), "{s:?}");
        for (list, name, says) in [
            ("127.0.0.1", "m", "sentinel 1"),
            ("a:1,,b:2", "m", "sentinel 2"),
            ("a:1,b:x", "m", "sentinel 2"),
            ("a:1", " ", "REDIS_MASTER_NAME"),
        ] {
            let err = Sentinels::parse(list, name).unwrap_err();
            assert!(err.contains(says), "{err}");
        }
        let err = Sentinels::parse("redis://:s3cret@127.0.0.1", "m").unwrap_err();
        assert!(
            !err.contains("s3cret") && err.contains("REDIS_SENTINEL_PASSWORD"),
            "{err}"
        );
    }
}

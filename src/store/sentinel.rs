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

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use redis::aio::ConnectionManager;
use redis::sentinel::{SentinelClient, SentinelServerType};
use redis::{Client, RedisError, RedisResult};

use super::PoolSettings;

/// The shortest time between two lookups: a dead master fails every call, and each would
/// otherwise ask the sentinels again.
const LOOKUP_INTERVAL: Duration = Duration::from_millis(100);
/// How often the master is looked up without an error to prompt it.
const WATCH_INTERVAL: Duration = Duration::from_millis(500);

/// `REDIS_SENTINELS` and `REDIS_MASTER_NAME`, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sentinels {
    /// `redis://host:port` of each sentinel, in the order given.
    pub urls: Vec<String>,
    pub master_name: String,
}

impl Sentinels {
    /// `list`: comma-separated `host:port`; every entry must be one.
    pub fn parse(list: &str, master_name: &str) -> Result<Self, String> {
        let mut urls = Vec::new();
        for (i, addr) in list.split(',').map(str::trim).enumerate() {
            let valid = addr
                .rsplit_once(':')
                .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
            if !valid {
                return Err(format!(
                    "REDIS_SENTINELS: sentinel {} ({addr:?}) is not host:port; give \
                     comma-separated host:port such as 127.0.0.1:26379,127.0.0.1:26380",
                    i + 1
                ));
            }
            urls.push(format!("redis://{addr}"));
        }
        if master_name.trim().is_empty() {
            return Err("REDIS_MASTER_NAME is empty: name the master the sentinels monitor".into());
        }
        Ok(Self {
            urls,
            master_name: master_name.to_owned(),
        })
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
        let conn = ConnectionManager::new_lazy_with_config(client.clone(), config)?;
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
}

struct Lookup {
    client: tokio::sync::Mutex<SentinelClient>,
    running: AtomicBool,
}

impl Server {
    pub fn fixed(backend: Backend) -> Self {
        Self {
            current: RwLock::new(Arc::new(backend)),
            lookup: None,
            timeout: Duration::ZERO,
            pool: Mutex::new(PoolSettings::default()),
        }
    }

    /// Asks the sentinels for the master once, now (blocking, at start-up).
    pub fn sentinel(
        sentinels: Sentinels,
        timeout: Duration,
        pool: PoolSettings,
    ) -> RedisResult<Self> {
        let mut client = SentinelClient::build(
            sentinels.urls,
            sentinels.master_name,
            None,
            SentinelServerType::Master,
        )?;
        let master = client.get_client()?;
        let backend = Backend::build(master, timeout, pool)?;
        tracing::info!(master = %backend.address(), "Sentinel names the master");
        Ok(Self {
            current: RwLock::new(Arc::new(backend)),
            lookup: Some(Lookup {
                client: tokio::sync::Mutex::new(client),
                running: AtomicBool::new(false),
            }),
            timeout,
            pool: Mutex::new(pool),
        })
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
        tokio::spawn(async move {
            server.follow_master().await;
            tokio::time::sleep(LOOKUP_INTERVAL).await;
            if let Some(lookup) = &server.lookup {
                lookup.running.store(false, Ordering::Release);
            }
        });
    }

    async fn follow_master(&self) {
        let Some(lookup) = &self.lookup else {
            return;
        };
        // Each sentinel, and the server it names, is asked within the call bound.
        let found = {
            let mut client = lookup.client.lock().await;
            tokio::time::timeout(self.timeout * 4, client.async_get_client()).await
        };
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
        let previous = self.backend().address();
        if address == previous {
            return;
        }
        let pool = *self.pool.lock().unwrap_or_else(|p| p.into_inner());
        match Backend::build(master, self.timeout, pool) {
            Ok(backend) => {
                self.replace(backend);
                tracing::warn!(master = %address, %previous, "Sentinel names a new master: following it");
            }
            Err(e) => {
                tracing::warn!(master = %address, error = %e, "cannot connect to the new master")
            }
        }
    }
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
            s.urls,
            ["redis://127.0.0.1:26379", "redis://localhost:26380"]
        );
        for (list, name, says) in [
            ("127.0.0.1", "m", "sentinel 1"),
            ("a:1,,b:2", "m", "sentinel 2"),
            ("a:1,b:x", "m", "sentinel 2"),
            ("a:1", " ", "REDIS_MASTER_NAME"),
        ] {
            let err = Sentinels::parse(list, name).unwrap_err();
            assert!(err.contains(says), "{err}");
        }
    }
}

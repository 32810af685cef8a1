//! Configuration: flags with environment fallbacks, every one with a default that works for
//! a local run against `redis-server` on its default port.

use std::net::IpAddr;
use std::time::Duration;

use clap::{Parser, ValueEnum};

pub use crate::lock::wait::WaitMode;
pub use crate::store::{ConnectionMode, redact};

use crate::strategy::Strategy;

/// `REDIS_URL` when none is given.
pub const DEFAULT_REDIS_URL: &str = "redis://127.0.0.1:6379";

/// The form a Redis URL takes, for the messages that refuse one.
pub const REDIS_URL_FORM: &str = "redis://[[user]:password@]host:port[/db], port 1..=65535";

/// What `RUST_LOG` may hold, in the words of its refusal.
const LOG_FILTER_FORM: &str = "valid: a level (error, warn, info, debug, trace, off), or comma-separated \
     directives such as info,inventory=debug";

const LOG_LEVELS: [&str; 6] = ["error", "warn", "info", "debug", "trace", "off"];

/// `RUST_LOG` checked: the filter, and a warning for each directive that is a bare word but
/// no level (it names a target and shows only that target's logs: `debugg` showed nothing
/// at all), or an error for one that does not parse (it used to fall back to `info` without
/// a word). Unset or empty: `info`.
pub fn log_filter(value: Option<&str>) -> Result<(String, Vec<String>), String> {
    let Some(value) = value.map(str::trim).filter(|v| !v.is_empty()) else {
        return Ok(("info".to_owned(), Vec::new()));
    };
    if let Err(e) = tracing_subscriber::EnvFilter::builder().parse(value) {
        let shown: String = format!("{value:?}").chars().take(80).collect();
        return Err(format!("RUST_LOG is {shown} ({e}); {LOG_FILTER_FORM}"));
    }
    let warnings = value
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty() && !d.contains(['=', '[']))
        .filter(|d| {
            !LOG_LEVELS.contains(&d.to_ascii_lowercase().as_str()) && d.parse::<u8>().is_err()
        })
        .map(|d| {
            format!(
                "RUST_LOG directive {d:?} is no level: it shows every log of the target {d:?} \
                 and nothing else; for a level, write one of {}",
                LOG_LEVELS.join(", ")
            )
        })
        .collect();
    Ok((value.to_owned(), warnings))
}

/// What the Redis client would accept in a URL but this service cannot use, named for the
/// refusal at start: TLS (`rediss://`; no TLS provider is set up, and the first connection
/// panicked inside the TLS library), and port 0.
pub fn unsupported_redis_url(url: &str) -> Option<&'static str> {
    let info = redis::IntoConnectionInfo::into_connection_info(url).ok()?;
    match info.addr() {
        redis::ConnectionAddr::TcpTls { .. } => Some("TLS (rediss://) is not supported"),
        redis::ConnectionAddr::Tcp(_, 0) => Some("port 0 is no port"),
        _ => None,
    }
}

/// An inventory-sale service whose sale is guarded by a switchable distributed lock.
#[derive(Debug, Clone, Parser)]
#[command(name = "inventory", version, about, long_about = None)]
pub struct Config {
    /// TCP port to listen on.
    #[arg(long, env = "PORT", default_value_t = 7777, value_parser = whole_u16::<1, 65_535>)]
    pub port: u16,

    /// Address to listen on (0.0.0.0 inside a container).
    #[arg(long, env = "BIND_ADDR", default_value = "127.0.0.1", value_parser = parse_bind_addr)]
    pub bind_addr: IpAddr,

    /// Redis connection URL (redis://[:password@]host:port[/db]).
    #[arg(
        long,
        env = "REDIS_URL",
        default_value = DEFAULT_REDIS_URL,
        hide_env_values = true
    )]
    pub redis_url: String,

    /// Redis Sentinel nodes (comma-separated `host:port`) that name the master of
    /// `REDIS_MASTER_NAME`; used instead of `REDIS_URL`, and asked again after a connection
    /// error, so that a failover is followed without a restart.
    #[arg(long, env = "REDIS_SENTINELS", requires = "redis_master_name")]
    pub redis_sentinels: Option<String>,

    /// Redis Cluster seed nodes, as comma-separated URLs (`redis://host:port,...`); used
    /// instead of `REDIS_URL` (and never with `REDIS_SENTINELS`). Commands follow the
    /// cluster's redirections and failovers; every key of an item lives in its slot.
    /// Checked by [`Config::cluster`], not by the parser: a parser's error would quote the
    /// whole value, passwords included.
    #[arg(long, env = "REDIS_CLUSTER", hide_env_values = true)]
    pub redis_cluster: Option<String>,

    /// The master's name in the sentinels' configuration (`sentinel monitor NAME ...`).
    #[arg(long, env = "REDIS_MASTER_NAME", requires = "redis_sentinels")]
    pub redis_master_name: Option<String>,

    /// The password the sentinels of `REDIS_SENTINELS` require (their `requirepass`).
    #[arg(
        long,
        env = "REDIS_SENTINEL_PASSWORD",
        hide_env_values = true,
        requires = "redis_sentinels"
    )]
    pub redis_sentinel_password: Option<String>,

    /// The password the master and replicas that the sentinels name require (their
    /// `requirepass`; the sentinels know it as `sentinel auth-pass`).
    #[arg(
        long,
        env = "REDIS_MASTER_PASSWORD",
        hide_env_values = true,
        requires = "redis_sentinels"
    )]
    pub redis_master_password: Option<String>,

    /// Independent Redis nodes for a lock that a majority of them must grant, as
    /// comma-separated URLs (`redis://host:port,...`); the stock stays on `REDIS_URL`.
    /// Checked by [`Config::lock_nodes`], not by the parser: a parser's error would quote
    /// the whole value, passwords included.
    #[arg(long, env = "LOCK_NODES", hide_env_values = true)]
    pub lock_nodes: Option<String>,

    /// Name reported in `X-Instance` and in every sale; defaults to `<host>:<port>`.
    #[arg(long, env = "INSTANCE_NAME", value_parser = parse_instance_name)]
    pub instance_name: Option<String>,

    /// Lock strategy used when a sale does not name one (see `GET /strategies`).
    #[arg(long, env = "LOCK_STRATEGY", default_value = "fenced", value_parser = parse_strategy)]
    pub lock_strategy: Strategy,

    /// Lease of a Redis lock in milliseconds (the watchdog renews every third of it). A
    /// holder that crashes stops every sale of the item for up to this long; strategies that
    /// do not renew lose the lock to work longer than this. The default is 2.5 times the
    /// longest work allowed (`MAX_WORK_MS`) and half the wait budget, so a waiting sale
    /// outlives a crashed holder.
    #[arg(long, env = "LOCK_TTL_MS", default_value_t = 5_000,
          value_parser = whole::<30, 3_600_000>)]
    pub lock_ttl_ms: u64,

    /// How long a sale may wait for a held lock, in milliseconds, before answering 503.
    #[arg(long, env = "LOCK_WAIT_MS", default_value_t = 10_000,
          value_parser = whole::<0, 600_000>)]
    pub lock_wait_ms: u64,

    /// How a waiting sale learns that the lock is free.
    #[arg(long, env = "LOCK_WAIT", value_enum, default_value_t = WaitMode::Notify)]
    pub lock_wait: WaitMode,

    /// With `LOCK_WAIT=notify`, how long at most a lock taken from Redis passes between this
    /// instance's own sales before it goes back to the queue, in milliseconds (shorter when
    /// others wait; at most a quarter of `LOCK_TTL_MS`); 0 hands every release to the queue.
    #[arg(long, env = "LOCK_TENURE_MS", default_value_t = 5,
          value_parser = whole::<0, 1_000>)]
    pub lock_tenure_ms: u64,

    /// Bearer token required by `PUT /inventory`; unset leaves admin endpoints open. An
    /// empty token is refused: it would look set while protecting nothing.
    #[arg(long, env = "ADMIN_TOKEN", hide_env_values = true, value_parser = AdminTokenParser)]
    pub admin_token: Option<String>,

    /// Longest simulated business time (`work_ms`) a sale may ask for, in milliseconds.
    /// Small on purpose: the lock is held that long, so a few buyers asking for long work
    /// (renewed by the watchdog) would lock every other buyer out.
    #[arg(long, env = "MAX_WORK_MS", default_value_t = 2_000,
          value_parser = whole::<0, 60_000>)]
    pub max_work_ms: u64,

    /// Ledger entries kept per item (older ones are trimmed); the audit's figures are
    /// counters and do not depend on it.
    #[arg(long, env = "LEDGER_MAX", default_value_t = crate::store::DEFAULT_LEDGER_CAP,
          value_parser = whole::<1, 10_000_000>)]
    pub ledger_max: u64,

    /// Threads that run the instance's requests; unset, one per core. Instances that share
    /// a machine's cores with each other (and with nginx and Redis, as `make up` runs them)
    /// do better with their share: a thread more than the cores it gets is woken across
    /// cores for every Redis reply, and preempted.
    #[arg(long, env = "WORKER_THREADS", value_parser = whole_u16::<1, 1_024>)]
    pub worker_threads: Option<u16>,

    /// Most client connections one instance keeps open at once; more wait in the listen
    /// backlog. Bounds what slow or idle clients can hold.
    #[arg(long, env = "MAX_CONNECTIONS", default_value_t = 1_024,
          value_parser = whole::<1, 100_000>)]
    pub max_connections: u64,

    /// How long a client may take to send a request's headers, then its body, or to take
    /// a response off the wire, and how long an idle keep-alive connection stays open, in
    /// milliseconds.
    #[arg(long, env = "HEADER_TIMEOUT_MS", default_value_t = 10_000,
          value_parser = whole::<100, 600_000>)]
    pub header_timeout_ms: u64,

    /// The default item: the one the paths without `{item}` sell (`/inventory/sale`); the
    /// same rule as `/inventory/{item}` (1 to 32 letters, digits, `-` or `_`, not `sale`
    /// or `audit`).
    #[arg(long, env = "ITEM_ID", default_value = "001", value_parser = parse_item_id)]
    pub item_id: String,

    /// How long the lock machinery of an item other than `ITEM_ID` (its waiters'
    /// connection or subscription, its local mutex) is kept after its last sale, in
    /// milliseconds; the next sale of the item builds it again.
    #[arg(long, env = "ITEM_IDLE_MS", default_value_t = 30_000,
          value_parser = whole::<10, 86_400_000>)]
    pub item_idle_ms: u64,

    /// Bound on every Redis call in milliseconds; past it a sale answers 503.
    #[arg(long, env = "REDIS_TIMEOUT_MS", default_value_t = 1_000,
          value_parser = whole::<10, 60_000>)]
    pub redis_timeout_ms: u64,

    /// How every strategy but `optimistic` talks to Redis: `multiplexed` (one shared
    /// connection, commands pipelined on it) or `pool` (a pooled connection per call).
    /// `optimistic` always takes a pooled connection: `WATCH` belongs to a connection.
    #[arg(long, env = "REDIS_CONNECTION", value_enum, default_value_t = ConnectionMode::Multiplexed)]
    pub redis_connection: ConnectionMode,

    /// Connections in the pool (one per `optimistic` sale in flight, and per call under
    /// `REDIS_CONNECTION=pool`). The load test runs 64 buyers at once.
    #[arg(long, env = "REDIS_POOL_SIZE", default_value_t = 64,
          value_parser = whole::<1, 10_000>)]
    pub redis_pool_size: u64,

    /// How long a call waits for a free pooled connection, in milliseconds, before answering
    /// 503 `pool_exhausted` (nothing sold).
    #[arg(long, env = "REDIS_POOL_WAIT_MS", default_value_t = 200,
          value_parser = whole::<1, 60_000>)]
    pub redis_pool_wait_ms: u64,

    /// Replicas that must acknowledge (Redis `WAIT`) every lock acquire, renewal and sale
    /// write on the stock's Redis. 0 sends no `WAIT`. An acquire acknowledged by fewer is
    /// released and the sale answers 503 `not_replicated` (nothing sold); a write
    /// acknowledged by fewer answers 503 `not_replicated` too, but it is on the master and
    /// may or may not survive a failover; a renewal acknowledged by fewer loses the lock.
    #[arg(long, env = "REPLICA_ACKS", default_value_t = 0,
          value_parser = whole_u32::<0, 64>)]
    pub replica_acks: u32,

    /// How long each `WAIT` waits for the replicas of `REPLICA_ACKS`, in milliseconds.
    #[arg(long, env = "REPLICA_ACK_TIMEOUT_MS", default_value_t = 200,
          value_parser = whole::<1, 60_000>)]
    pub replica_ack_timeout_ms: u64,

    /// How long the outcome of a sale sent with an `Idempotency-Key` is kept, in seconds.
    #[arg(long, env = "IDEMPOTENCY_TTL_S", default_value_t = 86_400,
          value_parser = whole::<1, 2_592_000>)]
    pub idempotency_ttl_s: u64,

    /// On SIGTERM or Ctrl-C, how long sales in flight may take to finish before the
    /// process exits anyway, in milliseconds.
    #[arg(long, env = "SHUTDOWN_GRACE_MS", default_value_t = 10_000,
          value_parser = whole::<0, 600_000>)]
    pub shutdown_grace_ms: u64,

    /// Log format: `text` for people, `json` (one object per line) for tools.
    #[arg(long, env = "LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,

    /// Pause before the delete of a release: between the owner check and the delete of
    /// `owner-check`, and before the one-step release of `lua-release`, to make the race of
    /// the first (and its absence in the second) happen on demand in fault scenarios. Keep
    /// 0 in normal use.
    #[arg(long, env = "RELEASE_GAP_MS", default_value_t = 0, hide = true,
          value_parser = whole::<0, 60_000>)]
    pub release_gap_ms: u64,

    /// Print the OpenAPI document as JSON and exit.
    #[arg(long)]
    pub openapi: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

impl Config {
    pub fn instance_name(&self) -> String {
        self.instance_name
            .clone()
            .unwrap_or_else(|| format!("{}:{}", hostname(), self.port))
    }

    /// The seeds of `REDIS_CLUSTER`, checked one by one; errors hide passwords. Refused
    /// together with `REDIS_SENTINELS` or an explicit `REDIS_URL`: which server holds the
    /// stock must not depend on which variable wins.
    pub fn cluster(&self) -> Result<Option<crate::store::ClusterSeeds>, String> {
        let Some(list) = self.redis_cluster.as_deref() else {
            return Ok(None);
        };
        if self.redis_sentinels.is_some() {
            return Err(
                "REDIS_CLUSTER and REDIS_SENTINELS are both set: give one of them (a cluster \
                 fails over by itself, without sentinels)"
                    .into(),
            );
        }
        if self.redis_url != DEFAULT_REDIS_URL {
            return Err(
                "REDIS_CLUSTER and REDIS_URL are both set: give one of them (REDIS_CLUSTER \
                 holds every node the service needs)"
                    .into(),
            );
        }
        crate::store::ClusterSeeds::parse(list).map(Some)
    }

    /// The nodes of `LOCK_NODES`, checked one by one; errors hide passwords.
    pub fn lock_nodes(&self) -> Result<Option<LockNodes>, String> {
        self.lock_nodes.as_deref().map(LockNodes::parse).transpose()
    }

    /// `REDIS_SENTINELS` and `REDIS_MASTER_NAME`, checked; `None` when unset. Refused with
    /// an explicit `REDIS_URL` (one other than its default, as [`Config::cluster`] tells):
    /// the sentinels name the master, and a `REDIS_URL` beside them was ignored without a
    /// word.
    pub fn sentinels(&self) -> Result<Option<crate::store::Sentinels>, String> {
        if self.redis_sentinels.is_some() && self.redis_url != DEFAULT_REDIS_URL {
            return Err(
                "REDIS_SENTINELS and REDIS_URL are both set: give one of them (REDIS_SENTINELS \
                 with REDIS_MASTER_NAME finds the master by itself; REDIS_URL is for one \
                 server without sentinels)"
                    .into(),
            );
        }
        match (&self.redis_sentinels, &self.redis_master_name) {
            (Some(list), Some(name)) => crate::store::Sentinels::parse(list, name).map(|s| {
                Some(s.with_passwords(
                    self.redis_sentinel_password.as_deref(),
                    self.redis_master_password.as_deref(),
                ))
            }),
            _ => Ok(None),
        }
    }

    pub fn lock_ttl(&self) -> Duration {
        Duration::from_millis(self.lock_ttl_ms)
    }

    pub fn item_idle(&self) -> Duration {
        Duration::from_millis(self.item_idle_ms)
    }

    pub fn lock_wait(&self) -> Duration {
        Duration::from_millis(self.lock_wait_ms)
    }

    pub fn max_work(&self) -> Duration {
        Duration::from_millis(self.max_work_ms)
    }

    pub fn header_timeout(&self) -> Duration {
        Duration::from_millis(self.header_timeout_ms)
    }

    pub fn redis_timeout(&self) -> Duration {
        Duration::from_millis(self.redis_timeout_ms)
    }

    pub fn replication(&self) -> crate::store::Replication {
        crate::store::Replication {
            acks: self.replica_acks,
            timeout: Duration::from_millis(self.replica_ack_timeout_ms),
        }
    }

    pub fn pool(&self) -> crate::store::PoolSettings {
        crate::store::PoolSettings {
            size: self.redis_pool_size as usize,
            wait: Duration::from_millis(self.redis_pool_wait_ms),
            mode: self.redis_connection,
            ..Default::default()
        }
    }
}

/// The nodes of `LOCK_NODES`, in the order given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockNodes(pub Vec<String>);

impl LockNodes {
    /// Every node must be a Redis URL the client accepts, and none may appear twice (a
    /// node counted twice would vote twice). Errors name the node with its password hidden.
    pub fn parse(list: &str) -> Result<Self, String> {
        let mut nodes: Vec<String> = Vec::new();
        for (i, url) in list.split(',').map(str::trim).enumerate() {
            let node = i + 1;
            if url.is_empty() {
                return Err(format!(
                    "LOCK_NODES: node {node} is empty; give comma-separated URLs such as \
                     redis://127.0.0.1:7001,redis://127.0.0.1:7002,redis://127.0.0.1:7003"
                ));
            }
            if let Err(e) = redis::Client::open(url) {
                return Err(format!(
                    "LOCK_NODES: node {node} ({}) is not a Redis URL ({:?}); valid: {REDIS_URL_FORM}",
                    redact(url),
                    e.kind()
                ));
            }
            if let Some(why) = unsupported_redis_url(url) {
                return Err(format!(
                    "LOCK_NODES: node {node} ({}): {why}; valid: {REDIS_URL_FORM}",
                    redact(url)
                ));
            }
            if nodes.iter().any(|n| n == url) {
                return Err(format!(
                    "LOCK_NODES: node {node} ({}) is listed twice",
                    redact(url)
                ));
            }
            nodes.push(url.to_owned());
        }
        Ok(Self(nodes))
    }
}

/// What an `ADMIN_TOKEN` may hold, in the words of its refusal.
const ADMIN_TOKEN_FORM: &str = "valid: visible ASCII characters (! to ~) and spaces, no space at \
     either end (nothing else reaches the service in an Authorization header), or unset to \
     leave admin endpoints open";

/// [`parse_admin_token`] as clap's parser, with a refusal of its own: clap's would begin
/// "invalid value '<the token>'", and the token is a secret.
#[derive(Clone)]
struct AdminTokenParser;

impl clap::builder::TypedValueParser for AdminTokenParser {
    type Value = String;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        _: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<String, clap::Error> {
        value
            .to_str()
            .ok_or_else(|| {
                format!("ADMIN_TOKEN is not UTF-8, which no Authorization header can carry; {ADMIN_TOKEN_FORM}")
            })
            .and_then(parse_admin_token)
            .map_err(|refusal| {
                clap::Error::raw(clap::error::ErrorKind::ValueValidation, format!("{refusal}\n"))
                    .with_cmd(cmd)
            })
    }
}

/// A token that a client can present: the service compares it with the token of the one
/// `Authorization: Bearer <token>` header, read as text (`HeaderValue::to_str`, which fails
/// for any byte outside visible ASCII, space and tab, so a non-ASCII token never matches),
/// with the spaces after `Bearer` dropped (so never one at the token's start), and HTTP
/// drops white space at either end of a header value (so never one at its end). Control
/// characters are refused, the tab too: a newline cannot be sent at all, and a tab, which
/// `to_str` would let through, is white space that clients, shells and proxies fold or
/// trim. The refusal says where, never what: the token is a secret.
fn parse_admin_token(token: &str) -> Result<String, String> {
    if token.trim().is_empty() {
        return Err(
            "ADMIN_TOKEN is empty; valid: any token with a character other than white space, or unset to leave admin endpoints open"
                .into(),
        );
    }
    let bad = token.chars().enumerate().find_map(|(i, c)| {
        if !c.is_ascii() {
            Some(format!("a non-ASCII character (character {})", i + 1))
        } else if c.is_ascii_control() {
            Some(format!("a control character (character {})", i + 1))
        } else {
            None
        }
    });
    let bad = bad.or_else(|| {
        if token.starts_with(' ') {
            Some("a space at its start".to_owned())
        } else if token.ends_with(' ') {
            Some("a space at its end".to_owned())
        } else {
            None
        }
    });
    match bad {
        Some(what) => Err(format!(
            "ADMIN_TOKEN has {what}, which no Authorization header can carry; {ADMIN_TOKEN_FORM}"
        )),
        None => Ok(token.to_owned()),
    }
}

/// Longest instance name: it goes out in every answer's `X-Instance` header, and nginx
/// answers 502 for a response whose headers overflow its 4 KiB buffer (after the sale).
const MAX_INSTANCE_NAME: usize = 256;

fn parse_instance_name(name: &str) -> Result<String, String> {
    // An empty name would answer `X-Instance:` with nothing; HTTP drops white space at
    // either end of a header, so the header and the body's `instance` would differ. A
    // control character cannot go out in a header at all (the tab could, but it is white
    // space that proxies fold): the instance failed at start-up, or, a tab, started.
    if name.trim().is_empty() || name.trim() != name {
        Err(format!(
            "INSTANCE_NAME is {name:?}; valid: 1 to {MAX_INSTANCE_NAME} bytes, no control characters, no white space at either end, or unset for <host>:<port>"
        ))
    } else if name.len() > MAX_INSTANCE_NAME {
        Err(format!(
            "INSTANCE_NAME is {} bytes; at most {MAX_INSTANCE_NAME} (it is sent in every answer's X-Instance header)",
            name.len()
        ))
    } else if name.chars().any(char::is_control) {
        // Debug formatting escapes control characters: the refusal never echoes them raw.
        Err(format!(
            "INSTANCE_NAME is {name:?}, with a control character; valid: 1 to {MAX_INSTANCE_NAME} bytes, no control characters, no white space at either end, or unset for <host>:<port>"
        ))
    } else {
        Ok(name.to_owned())
    }
}

/// A whole number in `LO..=HI`. The message names the range for every bad value (`abc`, an
/// empty value, `1.5`, `-1`, one too large for the type), not only for a number outside it:
/// clap's own parser answers "invalid digit found in string" for those.
fn whole<const LO: u64, const HI: u64>(value: &str) -> Result<u64, String> {
    // Digits only: `u64`'s parser also takes a leading `+`.
    Some(value)
        .filter(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|n| (LO..=HI).contains(n))
        .ok_or_else(|| format!("valid: a whole number in {LO}..={HI}"))
}

fn whole_u32<const LO: u64, const HI: u64>(value: &str) -> Result<u32, String> {
    whole_as::<u32, LO, HI>(value)
}

fn whole_u16<const LO: u64, const HI: u64>(value: &str) -> Result<u16, String> {
    whole_as::<u16, LO, HI>(value)
}

/// [`whole`] for a narrower type; `HI` fits it in every use.
fn whole_as<T: TryFrom<u64>, const LO: u64, const HI: u64>(value: &str) -> Result<T, String> {
    whole::<LO, HI>(value)
        .and_then(|n| T::try_from(n).map_err(|_| format!("valid: a whole number in {LO}..={HI}")))
}

fn parse_bind_addr(value: &str) -> Result<IpAddr, String> {
    value.parse().map_err(|_| {
        "valid: an IP address, like 127.0.0.1, 0.0.0.0 (every interface) or ::1".into()
    })
}

fn parse_strategy(name: &str) -> Result<Strategy, String> {
    name.parse()
}

/// The one rule for item ids, shared with the API's `/inventory/{item}`.
pub fn parse_item_id(id: &str) -> Result<String, String> {
    crate::names::parse_item_id(id)
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_setting_that_refuses_a_value_names_the_valid_ones() {
        // A property over the whole command line, so that a setting added later is held to
        // it too: whatever a setting refuses, its message says what it takes.
        use clap::CommandFactory;
        let bad = [
            "+5",
            "abc",
            "",
            "1.5",
            "-1",
            " 5",
            "99999999999999999999999",
            "18446744073709551616",
            "0",
        ];
        let command = Config::command();
        let mut refused = 0;
        for arg in command.get_arguments() {
            let Some(long) = arg.get_long() else { continue };
            if !arg.get_action().takes_values() || long == "help" {
                continue;
            }
            for value in bad {
                let args = ["inventory".to_owned(), format!("--{long}={value}")];
                let Err(e) = Config::try_parse_from(&args) else {
                    continue;
                };
                if e.kind() != clap::error::ErrorKind::ValueValidation
                    && e.kind() != clap::error::ErrorKind::InvalidValue
                {
                    continue;
                }
                refused += 1;
                let text = e.to_string();
                // The item id's message is the API's own, which names the rule its way.
                assert!(
                    ["valid:", "possible values", "use 1 to 32"]
                        .iter()
                        .any(|names| text.contains(names)),
                    "--{long}={value:?} is refused without naming the valid values: {text}"
                );
            }
        }
        // The numeric settings alone refuse most of these: a check that refuses nothing
        // checks nothing.
        assert!(refused > 100, "only {refused} refusals");
    }

    #[test]
    fn ranges_are_inclusive_and_the_bounds_pass() {
        assert_eq!(whole::<1, 10>("1"), Ok(1));
        assert_eq!(whole::<1, 10>("10"), Ok(10));
        for bad in ["0", "11", "abc", "", "1.0", "+"] {
            assert_eq!(
                whole::<1, 10>(bad),
                Err("valid: a whole number in 1..=10".to_owned())
            );
        }
        assert_eq!(whole_u32::<0, 64>("64"), Ok(64));
        assert_eq!(whole_u16::<1, 65_535>("65535"), Ok(65_535));
        assert!(whole_u16::<1, 65_535>("65536").is_err());
        assert!(whole_u16::<1, 65_535>("0").is_err());
        assert!(whole::<1, 10>("+5").is_err());
    }

    #[test]
    fn lock_nodes_are_checked_one_by_one_and_never_print_a_password() {
        let nodes = LockNodes::parse("redis://127.0.0.1:7001, redis://127.0.0.1:7002").unwrap();
        assert_eq!(nodes.0.len(), 2);
        for (bad, names) in [
            ("redis://a:1,,redis://b:2", "node 2"),
            ("redis://:s3cret@a:1,http://:s3cret@b:2", "node 2"),
            ("redis://:s3cret@a:1,redis://:s3cret@a:1", "listed twice"),
        ] {
            let err = LockNodes::parse(bad).unwrap_err();
            assert!(err.contains(names), "{err}");
            assert!(!err.contains("s3cret"), "{err}");
        }
    }

    #[test]
    fn redis_cluster_is_refused_beside_another_server_and_never_prints_a_password() {
        let parse = |args: &[&str]| Config::try_parse_from(args).unwrap().cluster();
        let seeds = parse(&["inventory", "--redis-cluster", "redis://127.0.0.1:7000"]).unwrap();
        assert_eq!(seeds.unwrap().0, ["redis://127.0.0.1:7000"]);
        let both = parse(&[
            "inventory",
            "--redis-cluster",
            "redis://127.0.0.1:7000",
            "--redis-url",
            "redis://:s3cret@127.0.0.1:6380",
        ])
        .unwrap_err();
        assert!(both.contains("REDIS_CLUSTER and REDIS_URL"), "{both}");
        assert!(!both.contains("s3cret"), "{both}");
        let bad = parse(&["inventory", "--redis-cluster", "redis://:s3cret@h:1,,"]).unwrap_err();
        assert!(bad.starts_with("REDIS_CLUSTER"), "{bad}");
        assert!(!bad.contains("s3cret"), "{bad}");
    }

    #[test]
    fn redacting_keeps_the_user_and_the_host() {
        assert_eq!(redact("redis://u:p@h:1/0"), "redis://u:***@h:1/0");
        assert_eq!(redact("redis://:p@h:1"), "redis://:***@h:1");
        assert_eq!(redact("redis://h:1"), "redis://h:1");
        assert_eq!(redact("rediss://u:p@ss@h:1"), "rediss://u:***@h:1");
    }

    #[test]
    fn nothing_before_the_last_at_survives_redaction_url_or_not() {
        for (value, secret) in [
            (":s3cret@127.0.0.1:1", "s3cret"),
            ("u:s3cret@127.0.0.1:1", "s3cret"),
            ("s3cret@127.0.0.1:1", "s3cret"),
            ("redis:/:s3cret@127.0.0.1:1", "s3cret"),
            ("redis://s3cret@127.0.0.1:1", "s3cret"),
            ("://:s3cret@h", "s3cret"),
            ("redis://:a@s3cret@h", "s3cret"),
        ] {
            let shown = redact(value);
            assert!(!shown.contains(secret), "{value} -> {shown}");
            assert!(
                shown.ends_with("127.0.0.1:1") || shown.ends_with("@h"),
                "{shown}"
            );
        }
    }

    #[test]
    fn item_ids_that_could_escape_their_key_are_refused() {
        assert!(parse_item_id("001").is_ok());
        assert!(parse_item_id("sku_9-b").is_ok());
        for bad in ["", "a}b", "a:b", "a b", "x{1}", &"9".repeat(33)] {
            assert!(parse_item_id(bad).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn defaults_match_the_documented_ones() {
        // Read from the argument definitions, not from a parse, so that variables set in
        // the environment running the tests cannot change the answer.
        use clap::CommandFactory;
        let command = Config::command();
        let default = |id: &str| {
            let arg = command.get_arguments().find(|a| a.get_id() == id).unwrap();
            arg.get_default_values()
                .iter()
                .map(|v| v.to_string_lossy().into_owned())
                .collect::<String>()
        };
        assert_eq!(default("port"), "7777");
        assert_eq!(default("redis_url"), "redis://127.0.0.1:6379");
        assert_eq!(default("lock_strategy"), "fenced");
        assert_eq!(default("lock_ttl_ms"), "5000");
        assert_eq!(default("max_work_ms"), "2000");
        assert_eq!(default("lock_wait_ms"), "10000");
        assert_eq!(default("lock_wait"), "notify");
        assert_eq!(default("lock_tenure_ms"), "5");
        assert_eq!(default("item_id"), "001");
        assert_eq!(default("item_idle_ms"), "30000");
        assert_eq!(default("redis_connection"), "multiplexed");
        assert_eq!(default("redis_pool_size"), "64");
        assert_eq!(default("redis_pool_wait_ms"), "200");
        assert_eq!(
            default("replica_acks"),
            "0",
            "no WAIT: the behaviour before it"
        );
        assert_eq!(default("replica_ack_timeout_ms"), "200");
        assert_eq!(default("instance_name"), "", "derived from host and port");
        assert_eq!(
            default("admin_token"),
            "",
            "unset leaves admin endpoints open"
        );
    }

    #[test]
    fn an_instance_name_too_long_for_a_header_buffer_is_refused_at_start_up() {
        let long = "a".repeat(MAX_INSTANCE_NAME + 1);
        let err = Config::try_parse_from(["inventory", "--instance-name", &long])
            .unwrap_err()
            .to_string();
        assert!(err.contains("at most 256"), "{err}");
        for bad in ["", " ", "\t", " app1", "app1 "] {
            let err = Config::try_parse_from(["inventory", "--instance-name", bad])
                .unwrap_err()
                .to_string();
            assert!(err.contains("valid: 1 to 256 bytes"), "{bad:?}: {err}");
        }
        let fits = "a".repeat(MAX_INSTANCE_NAME);
        let config = Config::try_parse_from(["inventory", "--instance-name", &fits]).unwrap();
        assert_eq!(config.instance_name.as_deref(), Some(fits.as_str()));
    }

    #[test]
    fn a_bad_worker_thread_count_is_refused_naming_the_range() {
        for bad in [
            "0",
            "-1",
            "1025",
            "abc",
            "",
            " 2",
            "1.5",
            "99999999999999999999",
        ] {
            let err = Config::try_parse_from(["inventory", &format!("--worker-threads={bad}")])
                .unwrap_err()
                .to_string();
            assert!(err.contains("1..=1024"), "{bad:?}: {err}");
        }
        let config = Config::try_parse_from(["inventory", "--worker-threads", "1"]).unwrap();
        assert_eq!(config.worker_threads, Some(1));
    }

    #[test]
    fn an_empty_admin_token_is_refused_at_start_up() {
        for args in [
            &["inventory", "--admin-token", ""][..],
            &["inventory", "--admin-token", "  "][..],
        ] {
            let err = Config::try_parse_from(args).unwrap_err().to_string();
            assert!(err.contains("ADMIN_TOKEN is empty"), "{err}");
        }
        let config = Config::try_parse_from(["inventory", "--admin-token", "t0k"]).unwrap();
        assert_eq!(config.admin_token.as_deref(), Some("t0k"));
    }

    #[test]
    fn an_admin_token_no_authorization_header_can_carry_is_refused_at_start_up() {
        // Each would start, and then every `PUT /inventory` answered 401 for good.
        for bad in [
            "tök",
            "s3cr\net",
            "s3cret\n",
            "s3cr\tet",
            "\ts3cret",
            "s3cr\u{7f}et",
            "s3cr\u{0}et",
            "s3cr\u{85}et",
            " s3cret",
            "s3cret ",
        ] {
            let err = Config::try_parse_from(["inventory", "--admin-token", bad])
                .unwrap_err()
                .to_string();
            assert!(err.contains("ADMIN_TOKEN has "), "{bad:?}: {err}");
            assert!(
                err.contains("valid: visible ASCII characters (! to ~) and spaces"),
                "{bad:?}: {err}"
            );
            assert!(!err.contains("s3cr") && !err.contains("tök"), "{err}");
        }
        use std::os::unix::ffi::OsStringExt;
        let not_utf8 = std::ffi::OsString::from_vec(b"s3cr\xffet".to_vec());
        let err = Config::try_parse_from(["inventory".into(), "--admin-token".into(), not_utf8])
            .unwrap_err()
            .to_string();
        assert!(err.contains("ADMIN_TOKEN is not UTF-8"), "{err}");
        for fine in ["t0k", "a b", "!~\"'<>{}", "Zm9v+/=", "x"] {
            let config = Config::try_parse_from(["inventory", "--admin-token", fine]).unwrap();
            assert_eq!(config.admin_token.as_deref(), Some(fine));
        }
    }

    #[test]
    fn an_instance_name_with_a_control_character_the_tab_too_is_refused_at_start_up() {
        for bad in [
            "app\t1",
            "app\u{1}1",
            "app\n1",
            "app\r1",
            "app\u{7f}",
            "app\u{85}1",
        ] {
            let err = Config::try_parse_from(["inventory", "--instance-name", bad])
                .unwrap_err()
                .to_string();
            assert!(err.contains("no control characters"), "{bad:?}: {err}");
            assert!(err.contains("valid: 1 to 256 bytes"), "{bad:?}: {err}");
        }
        for fine in ["app 1", "app1", "höst:7777"] {
            let config = Config::try_parse_from(["inventory", "--instance-name", fine]).unwrap();
            assert_eq!(config.instance_name.as_deref(), Some(fine));
        }
    }

    #[test]
    fn redis_sentinels_are_refused_beside_a_redis_url_of_its_own_and_never_print_a_password() {
        let sentinels = |extra: &[&str]| {
            let mut args = vec![
                "inventory",
                "--redis-sentinels",
                "127.0.0.1:26379",
                "--redis-master-name",
                "inventory",
            ];
            args.extend_from_slice(extra);
            Config::try_parse_from(args).unwrap().sentinels()
        };
        let found = sentinels(&[]).unwrap().unwrap();
        assert_eq!(found.addrs, [("127.0.0.1".to_owned(), 26379)]);
        let both = sentinels(&["--redis-url", "redis://:s3cret@127.0.0.1:6380"]).unwrap_err();
        assert!(
            both.contains("REDIS_SENTINELS and REDIS_URL are both set: give one of them"),
            "{both}"
        );
        assert!(!both.contains("s3cret"), "{both}");
        // Without sentinels, a REDIS_URL is simply the server.
        let alone = Config::try_parse_from(["inventory", "--redis-url", "redis://h:1"]).unwrap();
        assert_eq!(alone.sentinels(), Ok(None));
    }

    #[test]
    fn rust_log_that_does_not_parse_is_refused_and_a_bare_word_that_is_no_level_warned_of() {
        assert_eq!(log_filter(None), Ok(("info".to_owned(), vec![])));
        assert_eq!(log_filter(Some("  ")), Ok(("info".to_owned(), vec![])));
        for fine in [
            "debug",
            "WARN",
            "info,inventory=debug",
            "3",
            "off",
            "inventory[request]=trace",
        ] {
            let (filter, warnings) = log_filter(Some(fine)).expect(fine);
            assert_eq!((filter.as_str(), warnings.len()), (fine, 0), "{fine}");
        }
        let refusal = log_filter(Some("garbage=[[")).unwrap_err();
        assert!(
            refusal.contains("valid: a level (error, warn, info, debug, trace, off)"),
            "{refusal}"
        );
        let (_, warnings) = log_filter(Some("info,debugg")).unwrap();
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(
            warnings[0].contains("\"debugg\" is no level"),
            "{warnings:?}"
        );
    }

    mod properties {
        use super::*;
        use proptest::prelude::{any, prop_assert, prop_assert_eq, prop_oneof, proptest};
        use proptest::strategy::Strategy as _;

        proptest! {
            /// A whole-number setting takes exactly the digits of a number in its range, and
            /// names the range for anything else.
            #[test]
            fn a_whole_number_setting_takes_its_range_and_names_it_otherwise(
                value in prop_oneof![any::<String>(), "[-+ 0-9.e]{0,22}", (0..=20_000u64).prop_map(|n| n.to_string())],
            ) {
                match whole::<1, 10_000>(&value) {
                    Ok(n) => {
                        prop_assert!((1..=10_000).contains(&n));
                        let written = n.to_string();
                        prop_assert_eq!(written.trim_start_matches('0'), value.trim_start_matches('0'));
                    }
                    Err(refusal) => {
                        prop_assert!(refusal.contains("1..=10000"), "{}", refusal);
                        let in_range = value.parse::<u64>().is_ok_and(|n| (1..=10_000).contains(&n));
                        prop_assert!(!in_range || !value.bytes().all(|b| b.is_ascii_digit()), "{:?}", value);
                    }
                }
            }
        }
    }
}

//! Wiring: from a [`Config`] to a running server.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};
use std::time::Duration;

use anyhow::Context;
use axum::extract::Request;
use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_io_timeout::TimeoutStream;
use tower::ServiceExt;

use crate::config::{Config, REDIS_URL_FORM};
use crate::hangup::Peer;
use crate::http::{self, AppState};
use crate::items::Items;
use crate::lock::acl::Need;
use crate::lock::{Locks, Strategy};
use crate::metrics::Metrics;
use crate::sale::Seller;
use crate::store::Store;

/// Builds the application; must be called inside a Tokio runtime. Redis is not waited for:
/// an instance starts while Redis is down, reports not-ready, and connects as soon as it
/// can; a task only says at start-up what is wrong with it, if anything.
pub fn build(config: &Config) -> anyhow::Result<(axum::Router, Items)> {
    let instance = config.instance_name();
    // The URL may hold a password: it stays out of the error.
    let metrics = Arc::new(Metrics::default());
    let cluster = config.cluster().map_err(|e| anyhow::anyhow!(e))?;
    let sentinels = config.sentinels().map_err(|e| anyhow::anyhow!(e))?;
    let store = match (cluster, sentinels) {
        (Some(seeds), _) => {
            Store::with_cluster(seeds, &config.item_id, config.redis_timeout(), metrics)
                .map_err(|e| anyhow::anyhow!("REDIS_CLUSTER cannot be used ({:?})", e.kind()))?
        }
        (None, Some(sentinels)) => {
            Store::with_sentinels(sentinels, &config.item_id, config.redis_timeout(), metrics)
                .map_err(|e| anyhow::anyhow!("no master from REDIS_SENTINELS: {e}"))?
        }
        (None, None) if let Some(why) = crate::config::unsupported_redis_url(&config.redis_url) => {
            anyhow::bail!(
                "REDIS_URL ({}): {why}; valid: {REDIS_URL_FORM}",
                crate::config::redact(&config.redis_url)
            )
        }
        (None, None) => Store::new(
            &config.redis_url,
            &config.item_id,
            config.redis_timeout(),
            metrics,
        )
        .map_err(|e| {
            anyhow::anyhow!(
                "REDIS_URL is not a valid Redis URL ({:?}); valid: {REDIS_URL_FORM}",
                e.kind()
            )
        })?,
    }
    .with_ledger_cap(config.ledger_max)
    .with_pool(config.pool())
    .and_then(|store| store.with_replication(config.replication()))
    .map_err(|e| anyhow::anyhow!("cannot build the Redis pool ({:?})", e.kind()))?;
    let metrics = store.metrics_handle();
    let locks = Locks::new(
        store,
        config.lock_ttl(),
        config.lock_wait,
        Duration::from_millis(config.release_gap_ms),
    )
    // With no wait budget a sale never waits for a tenure to pass the lock to it: one that
    // arrived while a sibling ended its tenure (its release in flight) was refused on an
    // otherwise idle instance. Passing needs waiting; without it every release goes to Redis.
    .with_tenure(match config.lock_wait_ms {
        0 => Duration::ZERO,
        _ => Duration::from_millis(config.lock_tenure_ms),
    })
    .with_nodes(lock_nodes(config, metrics)?);
    check_quorum_setup(config, locks.nodes())?;
    let needs = locks.acl_needs(config.lock_strategy);
    tokio::spawn(report_redis_at_start(
        locks.store().clone(),
        needs,
        config.lock_strategy,
    ));
    let items = Items::new(locks, config.item_idle());
    let state = AppState {
        seller: Seller {
            instance: instance.clone(),
            items: items.clone(),
            wait_budget: config.lock_wait(),
            idempotency_keep: Duration::from_secs(config.idempotency_ttl_s),
        },
        default_strategy: config.lock_strategy,
        admin_token: config.admin_token.clone(),
        max_work: config.max_work(),
        body_timeout: config.header_timeout(),
    };
    Ok((http::app(state, &instance)?, items))
}

/// One store per `LOCK_NODES` node, each with the item's key names and its own connection;
/// like the stock's, none is contacted before it is needed.
fn lock_nodes(config: &Config, metrics: Arc<Metrics>) -> anyhow::Result<Vec<Store>> {
    let Some(nodes) = config.lock_nodes().map_err(|e| anyhow::anyhow!(e))? else {
        return Ok(Vec::new());
    };
    nodes
        .0
        .iter()
        .map(|url| {
            Store::new(
                url,
                &config.item_id,
                config.redis_timeout(),
                metrics.clone(),
            )
            .map_err(|e| {
                anyhow::anyhow!(
                    "LOCK_NODES: {} is not a valid Redis URL ({:?}); valid: {REDIS_URL_FORM}",
                    crate::config::redact(url),
                    e.kind()
                )
            })
        })
        .collect()
}

/// Serves until Ctrl-C or SIGTERM; then stops accepting, lets the sales in flight finish
/// (and so release their locks) for up to `SHUTDOWN_GRACE_MS`, and returns.
///
/// hyper is driven directly rather than through `axum::serve`, for the two bounds a service
/// facing slow or idle clients needs and `axum::serve` does not set: a deadline for each
/// request's headers (which also closes idle keep-alive connections), and a cap on open
/// connections (past it, new ones wait in the kernel's backlog instead of costing memory).
/// The listening socket, with a backlog for the connections past `MAX_CONNECTIONS`, which
/// wait there: the standard library's 128 overflowed at 1500 connections through nginx (from
/// outside: nginx's connects timed out, it marked both instances down, and 37,000 requests
/// answered "no live upstreams"). The kernel caps it at `net.core.somaxconn`.
fn listen(ip: std::net::IpAddr, port: u16, max_connections: u64) -> std::io::Result<TcpListener> {
    let addr = std::net::SocketAddr::new(ip, port);
    let socket = match addr {
        std::net::SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
        std::net::SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
    };
    // As `TcpListener::bind` does: a restart finds the port free while old connections
    // linger in TIME_WAIT.
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(backlog(max_connections))
}

/// Room for as many connections again as `MAX_CONNECTIONS` lets in, at least 1024.
fn backlog(max_connections: u64) -> u32 {
    u32::try_from(max_connections).unwrap_or(u32::MAX).max(1024)
}

pub async fn run(config: Config) -> anyhow::Result<()> {
    let (app, items) = build(&config)?;
    check_one_server_named_twice(items.default_item().locks.nodes()).await?;
    let listener = listen(config.bind_addr, config.port, config.max_connections)
        .with_context(|| format!("cannot listen on {}:{}", config.bind_addr, config.port))?;
    tracing::info!(
        instance = %config.instance_name(),
        addr = %listener.local_addr()?,
        strategy = %config.lock_strategy,
        ttl_ms = config.lock_ttl_ms,
        wait_ms = config.lock_wait_ms,
        "listening"
    );
    // HTTP/1.1 only (nginx and every client here speak it): the auto-detecting builder
    // reads a first byte before any timer runs, so a client that connects and sends
    // nothing would be kept forever.
    let mut http = http1::Builder::new();
    http.timer(SettledTimer)
        .header_read_timeout(config.header_timeout());
    raise_open_files(config.max_connections);
    let connections = Arc::new(Semaphore::new(config.max_connections as usize));
    let graceful = GracefulShutdown::new();
    let signalled = shutdown_signal();
    tokio::pin!(signalled);
    loop {
        let permit = tokio::select! {
            () = &mut signalled => break,
            permit = connections.clone().acquire_owned() => permit?,
        };
        let (stream, _) = tokio::select! {
            () = &mut signalled => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of file descriptors and the like: pause rather than spin.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        // Each request carries its connection, which a sale asks whether its client left.
        let peer = Peer::of(&stream);
        // hyper has no write deadline: a client that never reads its responses would hold
        // the connection (and one of MAX_CONNECTIONS) forever once the socket buffer fills.
        let mut stream = TimeoutStream::new(stream);
        stream.set_write_timeout(Some(config.header_timeout()));
        let service = {
            let peer = peer.clone();
            TowerToHyperService::new(app.clone().map_request(move |mut request: Request<_>| {
                if let Some(peer) = &peer {
                    request.extensions_mut().insert(peer.clone());
                }
                request
            }))
        };
        let io = TokioIo::new(Box::pin(stream));
        let connection = graceful.watch(http.serve_connection(io, service));
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "connection ended with an error");
            }
            if let Some(peer) = peer {
                peer.ended();
            }
            drop(permit);
        });
    }
    drop(listener);
    let grace = Duration::from_millis(config.shutdown_grace_ms);
    if tokio::time::timeout(grace, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(
            grace_ms = config.shutdown_grace_ms,
            "requests still in flight after the grace period; exiting (their locks expire with their leases)"
        );
    }
    items.close().await;
    tracing::info!("stopped");
    Ok(())
}

/// Each client connection takes two descriptors (its socket and the copy a sale asks whether
/// the client left, see [`Peer`]), besides Redis's connections and the log: with the soft
/// limit many systems start a process with (1024), `MAX_CONNECTIONS` (1024 by default) could
/// never be reached, and accepts would fail past about half of it. The soft limit is raised
/// to the hard one, as a server may; a hard limit too low is said once, at start.
fn raise_open_files(max_connections: u64) {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    if limit.current.is_some() && limit.current != limit.maximum {
        let raised = Rlimit {
            current: limit.maximum,
            maximum: limit.maximum,
        };
        if let Err(e) = setrlimit(Resource::Nofile, raised) {
            tracing::debug!(error = %e, "could not raise the limit of open files");
        }
    }
    let needed = max_connections.saturating_mul(2).saturating_add(64);
    if let Some(open_files) = getrlimit(Resource::Nofile).current
        && open_files < needed
    {
        tracing::warn!(
            open_files,
            max_connections,
            "the limit of open files ({open_files}) is below what MAX_CONNECTIONS needs \
             ({needed}: two per connection and some to spare): connections past it fail \
             to be accepted; raise `ulimit -n` or lower MAX_CONNECTIONS"
        );
    }
}

/// hyper's timer (its only one here is the request-header deadline, which also ends idle
/// keep-alive connections), with deadlines that fire only once the runtime has looked for
/// I/O after they passed.
///
/// Why: a process stopped past a deadline (`SIGSTOP`, a debugger, a frozen VM) resumes with
/// its `epoll_wait` interrupted, reporting nothing (Linux never restarts it after a stop,
/// see signal(7)), and the runtime then fires every timer due before it has seen the
/// requests that arrived during the stop. hyper found its header deadline passed and the
/// request not read, and closed connections that held a whole request: after a pause of
/// more than HEADER_TIMEOUT_MS, the sales nginx had sent to the paused instance came back as
/// 502, never read, while a shorter pause served them all. Waiting [`SETTLE`] more once the
/// deadline has passed makes the runtime wait in `epoll_wait` again first, which reports what
/// arrived; a client that really sent nothing is closed that much later.
#[derive(Clone, Copy, Debug)]
struct SettledTimer;

/// How long a passed deadline waits for the runtime to look for I/O once more.
const SETTLE: Duration = Duration::from_millis(5);

struct SettledSleep {
    deadline: Pin<Box<tokio::time::Sleep>>,
    settling: bool,
}

impl Future for SettledSleep {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<()> {
        let this = self.get_mut();
        loop {
            if this.deadline.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            if this.settling {
                return Poll::Ready(());
            }
            this.settling = true;
            let settled = tokio::time::Instant::now() + SETTLE;
            this.deadline.as_mut().reset(settled);
        }
    }
}

impl hyper::rt::Sleep for SettledSleep {}

impl hyper::rt::Timer for SettledTimer {
    fn sleep(&self, duration: Duration) -> Pin<Box<dyn hyper::rt::Sleep>> {
        self.sleep_until(std::time::Instant::now() + duration)
    }

    fn sleep_until(&self, deadline: std::time::Instant) -> Pin<Box<dyn hyper::rt::Sleep>> {
        Box::pin(SettledSleep {
            deadline: Box::pin(tokio::time::sleep_until(deadline.into())),
            settling: false,
        })
    }

    fn reset(&self, sleep: &mut Pin<Box<dyn hyper::rt::Sleep>>, deadline: std::time::Instant) {
        // hyper resets its deadline at every request: reuse the timer entry.
        match sleep.as_mut().downcast_mut_pin::<SettledSleep>() {
            Some(settled) => {
                let settled = settled.get_mut();
                settled.settling = false;
                settled.deadline.as_mut().reset(deadline.into());
            }
            None => *sleep = self.sleep_until(deadline),
        }
    }
}

/// Says at start-up what is wrong with Redis, when something is: a wrong password fails
/// every sale, and should not first be discovered by a buyer.
/// A quorum strategy as the default needs nodes; an even number of nodes, or fewer than
/// three, works but tolerates no more failures than one node fewer (or none at all).
fn check_quorum_setup(config: &Config, nodes: &[Store]) -> anyhow::Result<()> {
    if config.lock_strategy.info().quorum && nodes.is_empty() {
        anyhow::bail!(
            "LOCK_STRATEGY={} needs LOCK_NODES (independent Redis nodes, comma-separated URLs)",
            config.lock_strategy
        );
    }
    let n = nodes.len();
    if n > 0 && (n < 3 || n.is_multiple_of(2)) {
        let tolerates = n - crate::lock::redlock::quorum(n);
        tracing::warn!(
            nodes = n,
            tolerates,
            "LOCK_NODES has {n} node(s): a majority is {} of them, so the lock survives {tolerates} \
             node(s) down; use an odd number, at least 3",
            crate::lock::redlock::quorum(n)
        );
    }
    for node in nodes {
        tokio::spawn(report_node_at_start(node.clone()));
    }

    Ok(())
}

/// Two `LOCK_NODES` that are one Redis server under two names give that server two votes.
/// The list refuses a URL given twice by its text; this asks each node that answers within
/// `REDIS_TIMEOUT_MS` for its `run_id`, at start. The same database under two spellings
/// (`localhost` and `127.0.0.1`) cannot work at all: a sale's grant there makes its second
/// vote busy, and every quorum sale waited its whole budget out; refused. Two databases of
/// one server work, but one crash of it takes both votes (from outside: a server restarted
/// empty under a holder, and a second sale won the majority beside it); said loudly, not
/// refused, as for an even number of nodes, since databases of one server are how the
/// quorum's logic is tried on one machine (the tests do). A node down at start cannot be
/// told apart, and is not.
async fn check_one_server_named_twice(nodes: &[Store]) -> anyhow::Result<()> {
    let ids = futures_util::future::join_all(nodes.iter().map(Store::run_id)).await;
    let mut seen: Vec<(usize, String)> = Vec::new();
    for (i, id) in ids.into_iter().enumerate() {
        let Ok(Some(id)) = id else { continue };
        if let Some((first, _)) = seen.iter().find(|(_, seen)| *seen == id) {
            let (one, other) = (&nodes[*first], &nodes[i]);
            let named = format!(
                "LOCK_NODES: node {} ({}/{}) and node {} ({}/{}) are the same Redis server (one \
                 run_id)",
                first + 1,
                one.address(),
                one.database(),
                i + 1,
                other.address(),
                other.database()
            );
            if one.database() == other.database() {
                anyhow::bail!(
                    "{named} and the same database: the node would vote twice on one key, and \
                     every quorum sale would find its own grant busy; give each node a server \
                     of its own"
                );
            }
            tracing::error!(
                "{named}: it casts two votes, and one crash of it takes both; a quorum lock \
                 needs independent servers"
            );
        }
        seen.push((i, id));
    }
    Ok(())
}

async fn report_node_at_start(node: Store) {
    let name = node.address();
    match node.ping().await {
        Ok(()) => {
            tracing::info!(node = %name, "lock node reachable");
            if let Err(e) = node.is_replica().await
                && crate::store::is_auth_error(&e)
            {
                tracing::warn!(node = %name, "lock node {name}: the user may not run INFO, so whether it is a replica or may evict keys cannot be checked");
            }
            if let Ok(true) = node.is_replica().await {
                tracing::error!(node = %name, "lock node {name} is a read-only replica: it refuses every vote (READONLY)");
            }
            if let Ok(Some(policy)) = node.eviction_policy().await {
                tracing::error!(node = %name, policy, "lock node {name} may evict keys (maxmemory-policy {policy}): an evicted vote lets a second holder win; /ready answers 503 redis_may_evict");
            }
        }
        Err(e) if crate::store::is_auth_error(&e) => tracing::error!(
            node = %name,
            "lock node {name} refused the credentials in LOCK_NODES: it will never vote"
        ),
        Err(e) => tracing::error!(
            node = %name, error = %e,
            "lock node {name} is not reachable: quorum locks count it as a failed vote until it answers"
        ),
    }
}

async fn report_redis_at_start(store: Store, needs: Vec<Need>, strategy: Strategy) {
    match store.ping().await {
        Ok(()) => {
            tracing::info!("redis reachable");
            match store.is_replica().await {
                Ok(true) => tracing::error!(
                    "REDIS_URL names a replica: its writes are refused (READONLY), or, on a \
                     writable replica, lost at its next sync; /ready answers 503 until it is the \
                     master"
                ),
                Err(e) if crate::store::is_auth_error(&e) => tracing::warn!(
                    "the Redis user may not run INFO: whether Redis is a replica, or may evict \
                     keys, cannot be checked"
                ),
                _ => {}
            }
            // A command the sales need, refused to the user: said now, not at the first sale.
            if let Ok(Some(what)) = crate::lock::acl::refused(&store, &needs).await {
                tracing::error!(
                    "the Redis user may not run {what}, which sales of {strategy} \
                     (LOCK_STRATEGY) send: /ready answers 503 redis_auth_failed, and those \
                     sales fail or wait longer, until Redis's ACL grants it"
                );
            }
            if let Ok(Some(policy)) = store.eviction_policy().await {
                tracing::error!(
                    policy,
                    "redis may evict keys (maxmemory is set, maxmemory-policy {policy}): an \
                     evicted lock lets a second sale in beside its holder; /ready answers 503 \
                     redis_may_evict until maxmemory-policy is noeviction"
                );
            }
        }
        Err(e) if crate::store::is_auth_error(&e) => tracing::error!(
            "redis refused the credentials in REDIS_URL (wrong or missing password, or user \
             without rights): every sale will fail with 503 redis_auth_failed until it is fixed"
        ),
        Err(e) if crate::store::is_not_a_cluster(&e) => tracing::error!(
            error = %e,
            "REDIS_CLUSTER names a server that is not a cluster node: /ready answers 503 \
             until it is fixed"
        ),
        Err(e) => tracing::warn!(error = %e, "redis not reachable yet; retrying on each request"),
    }
}

async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::warn!(error = %e, "cannot listen for Ctrl-C");
            std::future::pending::<()>().await;
        }
    };
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut sigterm) => {
                sigterm.recv().await;
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        () = ctrl_c => {}
        () = terminate => {}
    }
    tracing::info!("shutting down: no new connections; finishing the requests in flight");
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[tokio::test]
    async fn a_redis_url_that_is_not_one_is_refused_naming_the_form_and_no_password() {
        for (flag, url) in [
            ("--redis-url", "abc"),
            ("--redis-url", ""),
            ("--redis-url", "http://:s3cret@127.0.0.1:6379"),
            (
                "--lock-nodes",
                "abc,redis://127.0.0.1:1,redis://127.0.0.1:2",
            ),
        ] {
            let config = Config::try_parse_from(["inventory", flag, url]).expect("parsed");
            let Err(e) = build(&config) else {
                panic!("{flag} {url:?} was taken");
            };
            let message = format!("{e:#}");
            assert!(message.contains("valid: redis://"), "{url:?}: {message}");
            assert!(!message.contains("s3cret"), "{url:?}: {message}");
        }
    }
}

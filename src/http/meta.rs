//! The service itself: its strategies, liveness and readiness.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::{ApiError, AppState, ErrorBody, TAG_SERVICE};
use crate::strategy::{Strategy, StrategyInfo};

pub fn router() -> OpenApiRouter<Arc<AppState>> {
    OpenApiRouter::new()
        .routes(routes!(strategies))
        .routes(routes!(health))
        .routes(routes!(ready))
        .routes(routes!(metrics))
}

/// Prometheus metrics
///
/// Sales by strategy and outcome, lock wait time, renewals, locks lost, fence refusals and
/// Redis errors, in the Prometheus text format.
#[utoipa::path(
    get,
    path = "/metrics",
    tag = TAG_SERVICE,
    responses((status = 200, description = "Prometheus text exposition format, version 0.0.4",
        content_type = "text/plain", body = String,
        example = "inventory_sales_total{strategy=\"fenced\",outcome=\"sold\"} 100"))
)]
async fn metrics(State(app): State<Arc<AppState>>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        app.seller.store().metrics().render(),
    )
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Strategies {
    /// The strategy a sale uses when it names none.
    #[schema(example = "fenced")]
    pub default: String,
    /// Every strategy, in the order of the story.
    pub strategies: Vec<StrategyInfo>,
}

/// List the lock strategies
///
/// Each strategy with the tutorial version it reproduces, what it fixes, and the flaw it
/// still has.
#[utoipa::path(
    get,
    path = "/strategies",
    tag = TAG_SERVICE,
    responses((status = 200, description = "The strategy table", body = Strategies))
)]
async fn strategies(State(app): State<Arc<AppState>>) -> Json<Strategies> {
    Json(Strategies {
        default: app.default_strategy.name().to_owned(),
        strategies: Strategy::ALL.iter().map(|s| *s.info()).collect(),
    })
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[schema(example = json!({"status": "ok", "instance": "app1:7777"}))]
pub struct Status {
    pub status: String,
    pub instance: String,
    /// The lock nodes of `LOCK_NODES` and whether each answered (readiness only; absent
    /// when none are configured).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub lock_nodes: Vec<NodeStatus>,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[schema(example = json!({"node": "127.0.0.1:7001", "ok": true}))]
pub struct NodeStatus {
    /// `host:port` (never a password).
    pub node: String,
    pub ok: bool,
}

/// Liveness
///
/// 200 while the process serves HTTP, whatever the state of Redis.
#[utoipa::path(
    get,
    path = "/health",
    tag = TAG_SERVICE,
    responses((status = 200, description = "The process is alive", body = Status))
)]
async fn health(State(app): State<Arc<AppState>>) -> Json<Status> {
    Json(Status {
        status: "ok".into(),
        instance: app.seller.instance.clone(),
        lock_nodes: Vec::new(),
    })
}

/// Readiness
///
/// 200 when Redis answers a PING within the Redis timeout and takes writes, with `REPLICA_ACKS` the master
/// has that many replicas online, and with `LOCK_NODES` a majority of the lock nodes answer
/// too (each is listed with its answer); 503 otherwise.
#[utoipa::path(
    get,
    path = "/ready",
    tag = TAG_SERVICE,
    responses(
        (status = 200, description = "Redis is reachable (and a majority of the lock nodes, if any)", body = Status,
            example = json!({"status": "ready", "instance": "app1:7777", "lock_nodes": [
                {"node": "127.0.0.1:7001", "ok": true}, {"node": "127.0.0.1:7002", "ok": false},
                {"node": "127.0.0.1:7003", "ok": true}]})),
        (status = 503, description = "Redis did not answer, or fewer than a majority of the lock nodes did (the message names each that did not, and why), or (`not_replicated`) the master has fewer replicas online than `REPLICA_ACKS`, or Redis answers as a read-only replica or refuses writes (`NOREPLICAS` under `min-replicas-to-write`, `MISCONF`, `OOM`), or (`redis_auth_failed`) the Redis user may not run a command that sales of the default strategy send (the message names it and its key; a lock node's, in its entry), or (`redis_may_evict`) Redis may evict keys (`maxmemory` with a `maxmemory-policy` other than `noeviction`)", body = ErrorBody,
            example = json!({"error": "redis_unavailable", "message": "Redis did not answer; retry shortly"})),
    )
)]
async fn ready(State(app): State<Arc<AppState>>) -> Result<Json<Status>, ApiError> {
    let nodes = app.seller.nodes();
    // Each node within the share of the lease a quorum sale gives it: a frozen node costs
    // a sale nothing once the others have voted, and costs readiness no more than that.
    let bound = app.seller.node_bound();
    let (stock, answers) = tokio::join!(
        app.seller.store().ping(),
        futures_util::future::join_all(
            nodes
                .iter()
                .map(|node| tokio::time::timeout(bound, check_node(node)))
        )
    );
    stock?;
    // A replica answers PING, and refuses every write.
    if unless_refused(app.seller.store().is_replica().await)? {
        return Err(ApiError::Replica);
    }
    // A Redis that may evict keys breaks every lock's promise as soon as memory runs short.
    if let Some(policy) = unless_refused(app.seller.store().eviction_policy().await)? {
        return Err(ApiError::MayEvict(policy));
    }
    // A master that answers PING may still refuse every write (`min-replicas-to-write`
    // unmet, a save failing, memory full), or refuse its user a command the sales need:
    // asked without writing or running any of them.
    let needs = app.seller.acl_needs(app.default_strategy);
    if let Some(what) = crate::lock::acl::refused(app.seller.store(), &needs).await? {
        return Err(ApiError::MayNotRun {
            what,
            strategy: app.default_strategy,
        });
    }
    // With REPLICA_ACKS, a master without enough replicas refuses every locked sale: not
    // ready, whatever PING says.
    let wanted = app.seller.store().replication().acks;
    if wanted > 0
        && let Some(online) = app.seller.store().replicas_online().await?
        && online < wanted
    {
        return Err(ApiError::TooFewReplicas { online, wanted });
    }
    let failures: Vec<Option<String>> = answers
        .iter()
        .map(|answer| match answer {
            Ok(Ok(_)) => None,
            Ok(Err(e)) if e.is_connection_refusal() => Some("refused the connection".to_owned()),
            Ok(Err(e)) if e.code() == Some("READONLY") => Some(
                "is a replica, whose votes are refused (READONLY) or, if it is writable, lost \
                 at its next sync with its master"
                    .to_owned(),
            ),
            Ok(Err(e)) if let Some(why) = crate::store::write_refusal(e) => {
                Some(format!("refuses writes, and so every vote: {why}"))
            }
            Ok(Err(e)) if e.to_string().contains(VOTE_REFUSED) => Some(format!(
                "its user may not run {}, which quorum sales send it (the node's ACL)",
                e.detail().unwrap_or("a command")
            )),
            Ok(Err(e)) if crate::store::is_command_refused(e) => {
                Some(format!("its user's ACL refuses a command: {e}"))
            }
            Ok(Err(e)) => Some(format!("failed: {}", e.category())),
            Err(_) => Some(format!("no answer within {} ms", bound.as_millis())),
        })
        .collect();
    let lock_nodes: Vec<NodeStatus> = nodes
        .iter()
        .zip(&failures)
        .map(|(node, failure)| NodeStatus {
            node: node.address(),
            ok: failure.is_none(),
        })
        .collect();
    let answered = lock_nodes.iter().filter(|n| n.ok).count();
    if !nodes.is_empty() && answered < crate::lock::redlock::quorum(nodes.len()) {
        let failed: Vec<String> = lock_nodes
            .iter()
            .zip(&failures)
            .filter_map(|(node, failure)| Some(format!("{}: {}", node.node, failure.as_ref()?)))
            .collect();
        return Err(crate::lock::redlock::quorum_unreached(&failed, nodes.len()).into());
    }
    // A lock node that may evict loses its vote's key as the stock's Redis would its lock.
    for (node, answer) in nodes.iter().zip(&answers) {
        if let Ok(Ok(Some(policy))) = answer {
            let on = format!("{policy} on lock node {}", node.address());
            return Err(ApiError::MayEvict(on));
        }
    }
    Ok(Json(Status {
        status: "ready".into(),
        instance: app.seller.instance.clone(),
        lock_nodes,
    }))
}

/// How a lock node's probe says that its user may not run a command of the votes.
const VOTE_REFUSED: &str = "the node's user may not run a command of the votes";

/// The checks that read `INFO` (role, eviction policy) say nothing when the user may not run
/// it: an ACL that allows every command a sale needs but `INFO` made an otherwise healthy
/// node "not ok", and the stock's Redis not ready, though every sale sold.
fn unless_refused<T: Default>(checked: redis::RedisResult<T>) -> redis::RedisResult<T> {
    match checked {
        Err(e) if crate::store::is_auth_error(&e) => Ok(T::default()),
        checked => checked,
    }
}

/// A node's first command after it restarted fails and makes its connection reconnect: one
/// more try tells a node that is back from one that is down.
///
/// Every check of a node in one future, which `/ready` bounds once: the eviction policy was
/// read in a second round with a bound of its own, and a frozen node cost `/ready` twice its
/// share (503 ms for 250, from outside). Returns the policy of a node that may evict.
async fn check_node(node: &crate::store::Store) -> redis::RedisResult<Option<String>> {
    match node.ping().await {
        Err(_) => node.ping().await,
        ok => ok,
    }?;
    // A replica answers PING, and its votes are refused (READONLY) or lost at its next sync.
    if unless_refused(node.is_replica().await)? {
        return Err(redis::RedisError::from((
            redis::ErrorKind::Server(redis::ServerErrorKind::ReadOnly),
            "a replica",
        )));
    }
    // So does a node that refuses writes (NOREPLICAS, OOM, MISCONF): it refuses every vote
    // too, and `/ready` listed it `ok` while every quorum sale answered 503. And one whose
    // user may not run a command of the vote.
    let needs = crate::lock::acl::node_needs(&node.keys);
    if let Some(what) = crate::lock::acl::refused(node, &needs).await? {
        return Err(redis::RedisError::from((
            redis::ErrorKind::Server(redis::ServerErrorKind::NoPerm),
            VOTE_REFUSED,
            what,
        )));
    }
    unless_refused(node.eviction_policy().await)
}

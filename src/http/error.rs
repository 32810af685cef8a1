//! The one place where outcomes become HTTP statuses.

use axum::Json;
use axum::extract::rejection::{BytesRejection, JsonRejection, QueryRejection};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use redis::{ErrorKind, RedisError, ServerErrorKind};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::sale::SaleError;
use crate::strategy::Strategy;

/// Every error body: a stable machine code and a sentence for people.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[schema(example = json!({"error": "sold_out", "message": "item 001 is sold out"}))]
pub struct ErrorBody {
    /// One of: bad_request, payload_too_large, request_timeout, unauthorized, not_found,
    /// method_not_allowed, unknown_item, sold_out, lock_lost, stale_fence, stock_changed,
    /// in_progress, lock_timeout, too_much_contention, pool_exhausted, redis_unavailable,
    /// redis_auth_failed, not_replicated, redis_may_evict (`/ready` only), outcome_unknown,
    /// internal (and client_gone, in the logs and metrics only: the client of that sale had
    /// left).
    pub error: String,
    pub message: String,
}

#[derive(Debug)]
pub enum ApiError {
    /// 400: the message names what is valid.
    BadRequest(String),
    /// 413: the body is larger than the service accepts.
    PayloadTooLarge(String),
    /// 408: the body did not arrive in time (`HEADER_TIMEOUT_MS`).
    RequestTimeout,
    /// 401: the admin token is missing or wrong.
    Unauthorized,
    /// 404: no such route.
    NotFound,
    /// 404: the item (its id) has no stock (never stocked, or Redis lost its data).
    UnknownItem(String),
    /// 405: the route exists, the method does not (`HEAD` on the sale among them).
    MethodNotAllowed,
    /// 409 or 503, depending on why the sale was refused.
    Sale(SaleError),
    /// 503 when Redis is unreachable, 500 when it answered something unexpected.
    Redis(RedisError),
    /// A reset's Redis call failed: as `Redis`, but its message says whether the reset may
    /// have landed.
    Reset(RedisError),
    /// A sale with an `Idempotency-Key` failed before its write: this request sold nothing,
    /// but its key's record may not have been read, and an earlier request with the key may
    /// have sold (from outside: a retry heard "nothing was sold" while Redis was frozen,
    /// for a key whose unit had sold).
    KeyedSale(RedisError),
    /// 500: details go to the log, never to the client.
    Internal(String),
    /// 503 `not_replicated` from `/ready`: the master has fewer replicas online than
    /// `REPLICA_ACKS` wants, so every locked sale would be refused.
    TooFewReplicas { online: u32, wanted: u32 },
    /// Redis may evict keys (its `maxmemory-policy`, with `maxmemory` set): not ready.
    MayEvict(String),
    /// The server is a replica: every write would be refused.
    Replica,
    /// 503 `redis_auth_failed` from `/ready`: the Redis user may not run a command (named,
    /// with its key) that sales of the default strategy send.
    MayNotRun { what: String, strategy: Strategy },
}

impl ApiError {
    /// A refused sale of `item`.
    pub fn sale(e: SaleError, item: &str) -> Self {
        match e {
            SaleError::UnknownItem => ApiError::UnknownItem(item.to_owned()),
            e => ApiError::Sale(e),
        }
    }
}

impl From<RedisError> for ApiError {
    fn from(e: RedisError) -> Self {
        ApiError::Redis(e)
    }
}

impl From<QueryRejection> for ApiError {
    fn from(rejection: QueryRejection) -> Self {
        let text = rejection.body_text();
        ApiError::BadRequest(match query_hint(&text) {
            Some(hint) => format!("{text}; {hint}"),
            None => text,
        })
    }
}

/// What the query parameter that serde complains about takes: its complaint names the
/// parameter and the fault, not the values that would do.
fn query_hint(text: &str) -> Option<String> {
    if text.contains("unknown field") {
        // serde names the known ones, but in its own words; these are the values too.
        Some(format!(
            "a sale takes only strategy (one of: {}), work_ms (0 up to MAX_WORK_MS) and \
             reenter (true or false), each at most once",
            crate::strategy::Strategy::accepted_names().join(", ")
        ))
    } else if text.contains("work_ms") {
        // Its value is parsed by the sale, which names the configured ceiling; serde
        // complains here only of a work_ms given twice.
        Some("give work_ms once, a whole number of milliseconds from 0 up to MAX_WORK_MS".into())
    } else if text.contains("reenter") {
        Some("reenter is true or false".into())
    } else if text.contains("strategy") {
        Some(format!(
            "give strategy once, one of: {}",
            crate::strategy::Strategy::accepted_names().join(", ")
        ))
    } else {
        None
    }
}

impl From<JsonRejection> for ApiError {
    fn from(rejection: JsonRejection) -> Self {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::PayloadTooLarge(too_large_message())
        } else if body_timed_out(&rejection) {
            ApiError::RequestTimeout
        } else {
            ApiError::BadRequest(rejection.body_text())
        }
    }
}

/// What a 413 says, from an instance as from nginx.
pub(crate) fn too_large_message() -> String {
    format!(
        "request body over 16 KiB; valid: at most {} bytes",
        super::BODY_LIMIT
    )
}

impl From<BytesRejection> for ApiError {
    fn from(rejection: BytesRejection) -> Self {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::PayloadTooLarge(too_large_message())
        } else if body_timed_out(&rejection) {
            ApiError::RequestTimeout
        } else {
            ApiError::BadRequest(rejection.body_text())
        }
    }
}

/// Whether the body stopped arriving: the client was slow, not wrong.
fn body_timed_out(rejection: &dyn std::error::Error) -> bool {
    let mut source = rejection.source();
    while let Some(e) = source {
        if e.is::<tower_http::timeout::TimeoutError>() {
            return true;
        }
        source = e.source();
    }
    false
}

/// Whether Redis failed to answer (worth a retry later) rather than answered wrongly.
fn unavailable(e: &RedisError) -> bool {
    match e.kind() {
        ErrorKind::Server(kind) => matches!(
            kind,
            ServerErrorKind::BusyLoading
                | ServerErrorKind::TryAgain
                | ServerErrorKind::ClusterDown
                | ServerErrorKind::MasterDown
                // A redirection on a node connection, or a write to a master that became a
                // replica: the slot or the master moved, and the next call finds it.
                | ServerErrorKind::Moved
                | ServerErrorKind::Ask
                | ServerErrorKind::ReadOnly
        ),
        // Our own scripts' replies not matching what the code expects: a bug, a 500. A reply
        // that does not parse as Redis's protocol at all (`Parse`) is the server, not us: a
        // proxy failing, or something else listening on Redis's port.
        ErrorKind::UnexpectedReturnType | ErrorKind::Extension => false,
        _ => true,
    }
}

impl ApiError {
    fn parts(&self) -> (StatusCode, &'static str, String) {
        match self {
            ApiError::BadRequest(m) => (StatusCode::BAD_REQUEST, "bad_request", m.clone()),
            ApiError::PayloadTooLarge(m) => (
                StatusCode::PAYLOAD_TOO_LARGE,
                "payload_too_large",
                m.clone(),
            ),
            ApiError::RequestTimeout => (
                StatusCode::REQUEST_TIMEOUT,
                "request_timeout",
                "the request body did not arrive in time (HEADER_TIMEOUT_MS); nothing was changed"
                    .into(),
            ),
            ApiError::Unauthorized => (
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "this endpoint needs the header `Authorization: Bearer <ADMIN_TOKEN>`".into(),
            ),
            ApiError::NotFound => (StatusCode::NOT_FOUND, "not_found", "no such route".into()),
            ApiError::UnknownItem(item) => (
                StatusCode::NOT_FOUND,
                "unknown_item",
                format!(
                    "item {item} has no stock in Redis (never stocked, or Redis lost its \
                     data); stock it with PUT /inventory/{item}"
                ),
            ),
            ApiError::MethodNotAllowed => (
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                "this route does not take that method; see /swagger-ui/ for the ones it takes"
                    .into(),
            ),
            ApiError::Sale(e) => {
                let (status, message) = match e {
                    // nginx's own code for a request whose client closed the connection
                    // first: nobody reads this answer, but the log and the metrics do.
                    SaleError::ClientGone => (
                        StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
                        "the client closed its connection before the sale wrote; nothing was sold"
                            .into(),
                    ),
                    SaleError::SoldOut { replayed: false } => {
                        (StatusCode::CONFLICT, "the item is sold out".into())
                    }
                    SaleError::SoldOut { replayed: true } => (
                        StatusCode::CONFLICT,
                        "the item was sold out when this Idempotency-Key was first used; this \
                         is that answer, replayed (a restock since does not change it: send a \
                         new key to buy)"
                            .into(),
                    ),
                    SaleError::LockLost => (
                        StatusCode::CONFLICT,
                        "the lock expired before the sale could write; nothing was sold".into(),
                    ),
                    SaleError::StaleFence { token, newest } => (
                        StatusCode::CONFLICT,
                        format!(
                            "fencing token {token} is older than {newest}, already seen by the store; nothing was sold"
                        ),
                    ),
                    SaleError::LockTimeout { waited } => (
                        StatusCode::SERVICE_UNAVAILABLE,
                        format!(
                            "the lock stayed held for {} ms, the whole wait budget",
                            waited.as_millis()
                        ),
                    ),
                    SaleError::TooMuchContention { attempts, waited } => (
                        StatusCode::SERVICE_UNAVAILABLE,
                        format!(
                            "{attempts} optimistic attempts in {} ms each found the stock \
                             changed before their EXEC; nothing was sold",
                            waited.as_millis()
                        ),
                    ),
                    SaleError::InProgress => (
                        StatusCode::CONFLICT,
                        "a sale with this Idempotency-Key is still in progress (or its outcome \
                         is not known yet); retry later with the same key"
                            .into(),
                    ),
                    SaleError::ClaimLost => (
                        StatusCode::CONFLICT,
                        "this sale's hold on its Idempotency-Key ran out before it wrote (its \
                         instance was paused, or Redis away, longer than the hold's lease): it \
                         sold nothing, and nothing holds the key now; retry with the same key"
                            .into(),
                    ),
                    SaleError::StockChanged => (
                        StatusCode::CONFLICT,
                        "a writer that does not take this lock (an atomic or optimistic sale, a \
                         reset, or a sale under the other kind of lock, single-node against \
                         quorum) changed the stock or drew a newer fencing token while this sale \
                         held the lock; nothing was sold"
                            .into(),
                    ),
                    SaleError::OutcomeUnknown(_) => (
                        StatusCode::GATEWAY_TIMEOUT,
                        "the sale's write was sent to Redis but never confirmed: it may have \
                         sold. A sale sent with an Idempotency-Key learns the outcome by a \
                         retry with the same key; without one, a retry may buy a second unit \
                         (GET /inventory/audit counts the sales)"
                            .into(),
                    ),
                    SaleError::NotReplicated {
                        acked,
                        wanted,
                        written: false,
                    } => (
                        StatusCode::SERVICE_UNAVAILABLE,
                        format!(
                            "{acked} of the {wanted} replicas REPLICA_ACKS asks for acknowledged \
                             the lock within REPLICA_ACK_TIMEOUT_MS, so a failover could hand it \
                             to a second owner: the lock was released and nothing was sold"
                        ),
                    ),
                    SaleError::NotReplicated {
                        acked,
                        wanted,
                        written: true,
                    } => (
                        StatusCode::SERVICE_UNAVAILABLE,
                        format!(
                            "the sale was written on the Redis master, but {acked} of the \
                             {wanted} replicas REPLICA_ACKS asks for acknowledged it within \
                             REPLICA_ACK_TIMEOUT_MS: it may or may not survive a failover. \
                             A sale sent with an Idempotency-Key learns which by a retry with \
                             the same key"
                        ),
                    ),
                    SaleError::UnknownItem => (
                        StatusCode::NOT_FOUND,
                        "the item has no stock in Redis (never stocked, or Redis lost its data)"
                            .into(),
                    ),
                    SaleError::Redis(e) => return redis_parts(e, Effect::Sale),
                };
                (status, e.code(), message)
            }
            ApiError::Redis(e) => redis_parts(e, Effect::Read),
            ApiError::Reset(e) => redis_parts(e, Effect::Reset),
            ApiError::KeyedSale(e) => redis_parts(e, Effect::KeyedSale),
            ApiError::Internal(_) => internal(),
            ApiError::Replica => (
                StatusCode::SERVICE_UNAVAILABLE,
                "redis_unavailable",
                "Redis answers as a replica: its writes are refused (READONLY), or, on a \
                 writable replica, lost at its next sync with the master; REDIS_URL must name \
                 the master (or use REDIS_SENTINELS)"
                    .to_owned(),
            ),
            ApiError::MayNotRun { what, strategy } => (
                StatusCode::SERVICE_UNAVAILABLE,
                "redis_auth_failed",
                format!(
                    "the Redis user (REDIS_URL) may not run {what}, which sales of `{strategy}` \
                     (LOCK_STRATEGY) send: without it they fail (503 redis_auth_failed) or wait \
                     longer for the lock; grant it in Redis's ACL (`ACL SETUSER`)"
                ),
            ),
            ApiError::MayEvict(policy) => (
                StatusCode::SERVICE_UNAVAILABLE,
                "redis_may_evict",
                format!(
                    "Redis may evict keys (maxmemory is set, and maxmemory-policy is \
                     {policy}): an evicted lock lets a second sale in beside its holder, and an \
                     evicted idempotency record sells its key again; set maxmemory-policy \
                     noeviction (full memory then refuses writes, 503, and loses nothing)"
                ),
            ),
            ApiError::TooFewReplicas { online, wanted } => (
                StatusCode::SERVICE_UNAVAILABLE,
                "not_replicated",
                format!(
                    "REPLICA_ACKS is {wanted}, but the master has {online} replica(s) online: \
                     every locked sale would answer 503 not_replicated; start replicas, or \
                     lower REPLICA_ACKS"
                ),
            ),
        }
    }
}

fn internal() -> (StatusCode, &'static str, String) {
    (
        StatusCode::INTERNAL_SERVER_ERROR,
        "internal",
        "internal error; see the service log".into(),
    )
}

/// What a request whose Redis call failed may have done, for its message to say.
#[derive(Clone, Copy)]
enum Effect {
    /// A sale: every sale error that may have written is `OutcomeUnknown`, so the ones here
    /// failed before their write and sold nothing.
    Sale,
    /// A read (stock, audit, readiness): it changes nothing either way.
    Read,
    /// A reset, whose script may have run before its reply was lost.
    Reset,
    /// A sale with an `Idempotency-Key`: this request sold nothing, an earlier one with the
    /// key may have.
    KeyedSale,
}

impl Effect {
    fn unanswered(self) -> &'static str {
        match self {
            Effect::Sale => "; nothing was sold",
            Effect::KeyedSale => KEYED_SALE_FAILED,
            Effect::Read => "",
            Effect::Reset => "; the reset may or may not have been applied (GET /inventory tells)",
        }
    }

    fn refused(self) -> &'static str {
        match self {
            Effect::Sale => "; nothing was sold",
            Effect::KeyedSale => KEYED_SALE_FAILED,
            Effect::Read => "",
            Effect::Reset => "; the stock was not reset",
        }
    }
}

const KEYED_SALE_FAILED: &str = "; this request sold nothing, but whether an earlier request \
    with this Idempotency-Key did was not learnt: retry with the same key to learn its outcome";

/// A Redis failure, of a sale before anything was written or of any other request.
fn redis_parts(e: &RedisError, effect: Effect) -> (StatusCode, &'static str, String) {
    if crate::store::is_pool_exhausted(e) {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "pool_exhausted",
            format!(
                "every pooled Redis connection stayed in use for REDIS_POOL_WAIT_MS{}; retry \
                 shortly",
                effect.refused()
            ),
        )
    } else if crate::store::is_auth_error(e) {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "redis_auth_failed",
            format!(
                "Redis refused this service's credentials, or a command to its user (the \
                 password or user in REDIS_URL, and its ACL){}",
                effect.refused()
            ),
        )
    } else if crate::store::is_database_refused(e) {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "redis_unavailable",
            format!(
                "Redis refused the database REDIS_URL names (its /db must be below the \
                 server's `databases`, 16 unless configured otherwise){}",
                effect.refused()
            ),
        )
    } else if let Some(why) = crate::lock::redlock::lock_nodes_failure(e) {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "redis_unavailable",
            format!(
                "{why}{}; retry once enough of them answer again",
                effect.refused()
            ),
        )
    } else if let Some(why) = crate::store::write_refusal(e) {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "redis_unavailable",
            format!(
                "{why}: it refused the write{}; retry once it takes writes",
                effect.refused()
            ),
        )
    } else if e.is_connection_refusal() {
        // No connection, so nothing was sent: certain, for a reset as for a sale.
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "redis_unavailable",
            format!(
                "Redis refused the connection{}; retry shortly",
                effect.refused()
            ),
        )
    } else if e.code() == Some("CLUSTERDOWN") {
        // An answer, and a refusal: nothing ran (see `cluster::not_run`). It used to say
        // "Redis did not answer".
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "redis_unavailable",
            format!(
                "the Redis Cluster is down or does not serve the slot now (CLUSTERDOWN: {}; a \
                 failover or a change of the cluster may be under way){}; retry shortly",
                e.detail().unwrap_or("refused"),
                effect.refused()
            ),
        )
    } else if unavailable(e) {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "redis_unavailable",
            format!("Redis did not answer{}; retry shortly", effect.unanswered()),
        )
    } else {
        internal()
    }
}

/// What went wrong behind an error response, for the log only: the client gets the generic
/// body. Carried in the response's extensions to [`log_failures`].
#[derive(Debug, Clone)]
pub struct Failure(pub String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, code, message) = self.parts();
        let failure = match &self {
            ApiError::Redis(e)
            | ApiError::Reset(e)
            | ApiError::KeyedSale(e)
            | ApiError::Sale(SaleError::Redis(e))
            | ApiError::Sale(SaleError::OutcomeUnknown(e)) => Some(format!("redis: {e}")),
            ApiError::Internal(detail) => Some(detail.clone()),
            _ => None,
        };
        let body = ErrorBody {
            error: code.to_owned(),
            message,
        };
        let mut response = (status, Json(body)).into_response();
        match &self {
            ApiError::Sale(SaleError::SoldOut { replayed: true }) => {
                response.headers_mut().insert(
                    super::inventory::REPLAYED,
                    axum::http::HeaderValue::from_static("true"),
                );
            }
            // A 401 names the scheme it wants (RFC 9110, 11.6.1), so that a client can tell
            // "send a bearer token" from "you may not".
            ApiError::Unauthorized => {
                response.headers_mut().insert(
                    axum::http::header::WWW_AUTHENTICATE,
                    axum::http::HeaderValue::from_static(r#"Bearer realm="inventory admin""#),
                );
            }
            _ => {}
        }
        if let Some(failure) = failure {
            response.extensions_mut().insert(Failure(failure));
        }
        response
    }
}

/// Logs the failures behind error responses, once, inside the request's span: a 5xx is an
/// error, anything else a warning.
pub async fn log_failures(response: Response) -> Response {
    if let Some(Failure(detail)) = response.extensions().get::<Failure>() {
        let status = response.status().as_u16();
        if response.status().is_server_error() && status != 503 && status != 504 {
            tracing::error!(%detail, status, "request failed");
        } else {
            tracing::warn!(%detail, status, "request failed");
        }
    }
    response
}

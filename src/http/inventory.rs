//! `/inventory`: the sale, the stock, its reset and its audit.

use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::extract::FromRequestParts;
use axum::extract::State;
use axum::http::request::Parts;
use axum::http::{HeaderValue, Method};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use tracing::Instrument;
use utoipa::openapi::schema::{ObjectBuilder, Type};
use utoipa::{IntoParams, IntoResponses, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::extract::{Admin, ApiJson, ApiQuery, ItemPath, NoQuery};
use super::{ApiError, AppState, ErrorBody, TAG_INVENTORY, TAG_SALE};
use crate::hangup::Peer;
use crate::idempotency;
use crate::sale::{Completed, Hangup, MAX_WORK_MS, SaleRequest, Sold};
use crate::store::{Audit, Inventory};
use crate::strategy::Strategy;

/// Largest stock a reset accepts.
pub const MAX_STOCK: i64 = 1_000_000_000;

pub fn router() -> OpenApiRouter<Arc<AppState>> {
    OpenApiRouter::new()
        .routes(routes!(sale, sale_get))
        .routes(routes!(get_inventory, reset_inventory))
        .routes(routes!(audit))
        .routes(routes!(item_sale, item_sale_get))
        .routes(routes!(get_item, reset_item))
        .routes(routes!(item_audit))
}

/// The query of a sale. A parameter it does not know is refused, not ignored: a misspelled
/// one (`Strategy=none`, `work-ms=500`) would otherwise run the sale with the defaults, and
/// the answer would not say so.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct SaleQuery {
    /// Lock strategy, by name or tutorial alias (`v1`..`v8`); defaults to `LOCK_STRATEGY`.
    #[param(schema_with = strategy_schema, example = "fenced")]
    pub strategy: Option<String>,
    /// Simulated business time, in ms, spent holding the lock between reading the stock and
    /// writing it (0 up to `MAX_WORK_MS`, 2000 unless configured).
    // Text, parsed in `into_request`: a value that is not a whole number is then refused
    // naming this instance's `MAX_WORK_MS`, not the default one.
    #[param(value_type = Option<u64>, minimum = 0, maximum = 60000, example = 0)]
    pub work_ms: Option<String>,
    /// Acquire the same lock a second time, nested, before writing.
    #[param(example = false)]
    pub reenter: Option<bool>,
}

/// The headers a sale reads.
#[derive(Debug, IntoParams)]
#[into_params(parameter_in = Header)]
pub struct SaleHeaders {
    /// Makes retries safe: a repeated request with the same key (on either instance) replays
    /// the first outcome, with the same `order_id` and the header `Idempotent-Replayed: true`,
    /// and never sells twice. 1 to 128 letters, digits, `-`, `_`, `.` or `:`. Kept for
    /// `IDEMPOTENCY_TTL_S` (default 24 h).
    #[param(
        rename = "Idempotency-Key",
        value_type = Option<String>,
        pattern = "^[A-Za-z0-9._:-]{1,128}$",
        example = "5f0c3c1e-8a51-4a43-9f7e-1b0f3b3c2a10"
    )]
    pub idempotency_key: Option<idempotency::Key>,
    /// The client's connection, which the server puts in each request: the sale asks it
    /// whether its client is still there. Not a header; read from the same parts.
    #[param(ignore)]
    pub peer: Option<Peer>,
}

fn strategy_schema() -> ObjectBuilder {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .enum_values(Some(Strategy::accepted_names()))
}

impl SaleQuery {
    fn into_request(self, app: &AppState) -> Result<SaleRequest, ApiError> {
        let strategy: Strategy = match self.strategy.as_deref() {
            None => app.default_strategy,
            // The parser trims, for a list in a flag or a variable; a query value with spaces
            // (`strategy=+atomic`) is a typo to point out, not a name.
            Some(name) if name.trim() != name => {
                return Err(ApiError::BadRequest(format!(
                    "unknown strategy {name:?} (spaces around it); valid: {}",
                    Strategy::accepted_names().join(", ")
                )));
            }
            Some(name) => name.parse().map_err(ApiError::BadRequest)?,
        };
        if strategy.info().quorum && app.seller.nodes().is_empty() {
            return Err(ApiError::BadRequest(format!(
                "strategy {strategy} needs independent lock nodes, and this instance has none: \
                 start it with LOCK_NODES=redis://host:port,redis://host:port,redis://host:port"
            )));
        }
        let max = (app.max_work.as_millis() as u64).min(MAX_WORK_MS);
        let work_ms = match self.work_ms.as_deref() {
            None => 0,
            Some(text) => match text.parse::<u64>() {
                Ok(ms) if ms <= max => ms,
                Ok(ms) => {
                    return Err(ApiError::BadRequest(format!(
                        "work_ms must be between 0 and {max} (MAX_WORK_MS), got {ms}"
                    )));
                }
                Err(_) => {
                    return Err(ApiError::BadRequest(format!(
                        "work_ms is a whole number of milliseconds, from 0 up to {max} \
                         (MAX_WORK_MS), got {text:?}"
                    )));
                }
            },
        };
        Ok(SaleRequest {
            strategy,
            work: Duration::from_millis(work_ms),
            reenter: self.reenter.unwrap_or(false),
        })
    }
}

/// Sell one item
///
/// Takes the lock of the chosen strategy, reads the stock, works for `work_ms`, writes
/// stock - 1 and records the sale in the ledger. Sells the default item (`ITEM_ID`); see
/// `/inventory/{item}/sale` for the others.
#[utoipa::path(
    post,
    path = "/inventory/sale",
    tag = TAG_SALE,
    params(SaleQuery, SaleHeaders),
    responses(SaleResponses)
)]
async fn sale(
    State(app): State<Arc<AppState>>,
    headers: SaleHeaders,
    ApiQuery(query): ApiQuery<SaleQuery>,
    _: BodyWithinLimit,
) -> Result<Response, ApiError> {
    sell(app, None, headers, query).await
}

/// Sell one of an item
///
/// The sale of `POST /inventory/sale`, of the item `{item}`: the same query, headers and
/// answers. Items never exclude each other's sales; `/inventory/{ITEM_ID}/sale` is the
/// default item's sale.
#[utoipa::path(
    post,
    path = "/inventory/{item}/sale",
    tag = TAG_SALE,
    params(ItemPath, SaleQuery, SaleHeaders),
    responses(SaleResponses)
)]
async fn item_sale(
    State(app): State<Arc<AppState>>,
    ItemPath { item }: ItemPath,
    headers: SaleHeaders,
    ApiQuery(query): ApiQuery<SaleQuery>,
    _: BodyWithinLimit,
) -> Result<Response, ApiError> {
    sell(app, Some(item), headers, query).await
}

/// The sale takes no body, but reads whatever comes, to the body limit: a body sent chunked
/// has no `Content-Length` for the middleware to refuse, and over 16 KiB it sold where the
/// same body declared got 413. One with anything in it is refused: `{"strategy": "none"}`
/// sold under the default strategy, the body unread, as if the client had been heard.
struct BodyWithinLimit;

impl<S: Send + Sync> axum::extract::FromRequest<S> for BodyWithinLimit {
    type Rejection = ApiError;

    async fn from_request(request: axum::extract::Request, state: &S) -> Result<Self, ApiError> {
        let body = axum::body::Bytes::from_request(request, state).await?;
        if body.iter().all(u8::is_ascii_whitespace) {
            Ok(BodyWithinLimit)
        } else {
            Err(ApiError::BadRequest(format!(
                "the sale takes no body (this one had {} bytes); give strategy, work_ms and \
                 reenter in the query string, as /inventory/sale?strategy=fenced&work_ms=0",
                body.len()
            )))
        }
    }
}

/// The one sale handler: `item` is `None` for the default item's paths.
async fn sell(
    app: Arc<AppState>,
    item: Option<String>,
    headers: SaleHeaders,
    query: SaleQuery,
) -> Result<Response, ApiError> {
    let request = query.into_request(&app)?;
    let key = headers.idempotency_key;
    let inline = request.strategy == Strategy::Atomic && key.is_none() && request.work.is_zero();
    let completed = if inline {
        // One script, no work before it and nothing to undo: its command is queued on the
        // Redis connection in the first poll and lands even if the client hangs up after
        // that; a hang-up before it (or while the connection is being re-established)
        // sells nothing, one of the two outcomes nginx's 504 announces. So it runs in the
        // request's own task: a task of its own costs a spawn and, often, a wake-up of the
        // other worker thread, about a third of the instance's CPU per atomic sale. Its
        // client may have left before the request was read (the instance fell behind, or
        // was paused): the socket is asked once, before the script (one `poll`, about 1 us).
        let hangup = Hangup::of_connection(headers.peer);
        sell_in_place(&app, item.as_deref(), request, None, hangup).await?
    } else {
        // The sale runs in its own task: it is never abandoned half-way, between taking
        // the lock and releasing it or between claiming an idempotency key and settling it,
        // if its client hangs up (nginx then answers 504: it may have sold). It stops
        // cleanly instead, before its write, or goes through if the write was sent. The task
        // keeps the request's span, and so its request id.
        // Spawned in a block: a moved-from future still takes room in the handler's own
        // future while its binding is in scope across an await.
        // The guard lives in this future: a client gone drops it, and the sale, which
        // outlives it, stops where stopping is clean (see `Hangup`).
        let (hangup, _client_waits) = Hangup::watch(headers.peer);
        let task = {
            let sale = async move {
                sell_in_place(&app, item.as_deref(), request, key.as_ref(), hangup).await
            };
            tokio::spawn(sale.instrument(tracing::Span::current()))
        };
        task.await
            .map_err(|e| ApiError::Internal(format!("sale task failed: {e}")))??
    };
    let mut response = Json(completed.sold).into_response();
    if completed.replayed {
        response
            .headers_mut()
            .insert(REPLAYED, HeaderValue::from_static("true"));
    }
    Ok(response)
}

async fn sell_in_place(
    app: &AppState,
    item: Option<&str>,
    request: SaleRequest,
    key: Option<&idempotency::Key>,
    hangup: Hangup,
) -> Result<Completed, ApiError> {
    let seller = &app.seller;
    let (sold, id) = match item {
        None => {
            let default = seller.items.default_item();
            (
                seller.sell(default, request, key, hangup).await,
                default.id(),
            )
        }
        Some(id) => (seller.sell_item(id, request, key, hangup).await, id),
    };
    sold.map_err(|e| match (e, key) {
        // The key's record may not have been read: an earlier request with it may have sold.
        (crate::sale::SaleError::Redis(e), Some(_)) => ApiError::KeyedSale(e),
        (e, _) => ApiError::sale(e, id),
    })
}

pub(super) const REPLAYED: &str = "idempotent-replayed";

/// What a sale can answer, documented once for `POST` and `GET`. Never built: the handlers
/// answer through `Sold` and `ApiError`, whose statuses `http::error` decides.
#[derive(IntoResponses)]
#[allow(dead_code)]
enum SaleResponses {
    /// One item sold (or, with an `Idempotency-Key` seen before, the first sale replayed)
    #[response(status = 200, headers(
        ("Idempotent-Replayed" = String, description = "`true` when this is the first sale of the `Idempotency-Key`, replayed (nothing sold now); absent otherwise")
    ))]
    Sold(#[to_schema] Sold),
    /// Unknown strategy, `work_ms` out of range, a malformed `Idempotency-Key`, a body (the
    /// sale takes none: its parameters go in the query) or (in `/inventory/{item}/sale`) a
    /// malformed item id; the message names the valid values
    #[response(status = 400, example = json!({"error": "bad_request",
        "message": "unknown strategy \"v9\"; valid: none, local, setnx, ..."}))]
    BadRequest(ErrorBody),
    /// Nothing sold: the item has no stock in Redis (`unknown_item`: never stocked, or Redis
    /// lost its data); nothing was written for it
    #[response(status = 404, example = json!({"error": "unknown_item",
        "message": "item 002 has no stock in Redis (never stocked, or Redis lost its data); stock it with PUT /inventory/002"}))]
    UnknownItem(ErrorBody),
    /// Nothing sold: the sale takes no body, and one that did not arrive within
    /// `HEADER_TIMEOUT_MS` is refused (`request_timeout`)
    #[response(status = 408, example = json!({"error": "request_timeout",
        "message": "the request body did not arrive in time (HEADER_TIMEOUT_MS); nothing was changed"}))]
    RequestTimeout(ErrorBody),
    /// Nothing sold: the sale takes no body, and one larger than 16 KiB is refused
    /// (`payload_too_large`)
    #[response(status = 413, example = json!({"error": "payload_too_large",
        "message": "request body over 16 KiB; valid: at most 16384 bytes"}))]
    PayloadTooLarge(ErrorBody),
    /// Nothing sold: `sold_out`; the lock was lost before the write (`lock_lost`,
    /// `stale_fence`); a writer that takes no lock (an `atomic` or `optimistic` sale, a
    /// reset), or a sale under the other kind of lock (single-node against quorum), changed
    /// the stock during the sale (`stock_changed`); or an attempt with the same
    /// `Idempotency-Key` is still running or its outcome is not known yet (`in_progress`)
    #[response(status = 409, headers(
        ("Idempotent-Replayed" = String, description = "`true` on a `sold_out` that an earlier attempt with the same `Idempotency-Key` answered, replayed; absent otherwise")
    ), example = json!({"error": "stale_fence",
        "message": "fencing token 7 is older than 8, already seen by the store; nothing was sold"}))]
    Conflict(ErrorBody),
    /// Nothing sold, for certain: the lock stayed held for the whole wait budget
    /// (`lock_timeout`), every `optimistic` attempt within that budget found the stock
    /// changed before its `EXEC` (`too_much_contention`), every pooled Redis connection
    /// stayed in use for `REDIS_POOL_WAIT_MS` (`pool_exhausted`), Redis did not answer before
    /// the write was sent (`redis_unavailable`), Redis refused the service's credentials
    /// (`redis_auth_failed`), or fewer replicas than `REPLICA_ACKS` acknowledged the lock
    /// within `REPLICA_ACK_TIMEOUT_MS` (`not_replicated`; the lock was released). The one
    /// exception, also `not_replicated`: the sale's write is on the Redis master but fewer
    /// replicas than `REPLICA_ACKS` acknowledged it in time, so it may or may not survive a
    /// failover (the message says so); a retry with the same `Idempotency-Key` tells which
    #[response(status = 503, example = json!({"error": "lock_timeout",
        "message": "the lock stayed held for 10000 ms, the whole wait budget"}))]
    Unavailable(ErrorBody),
    /// Outcome unknown (`outcome_unknown`): the write was sent to Redis and never confirmed,
    /// so the item may have been sold. Retry with the same `Idempotency-Key` to learn the
    /// outcome; without one, a retry may buy a second item
    #[response(status = 504, example = json!({"error": "outcome_unknown",
        "message": "the sale's write was sent to Redis but never confirmed: it may have sold"}))]
    OutcomeUnknown(ErrorBody),
    /// Unexpected failure; details are in the service log
    #[response(status = 500)]
    Internal(ErrorBody),
}

impl<S: Send + Sync> FromRequestParts<S> for SaleHeaders {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        let peer = parts.extensions.get::<Peer>().cloned();
        let mut values = parts.headers.get_all("idempotency-key").iter();
        let Some(value) = values.next() else {
            return Ok(Self {
                idempotency_key: None,
                peer,
            });
        };
        // Whichever one were used, a retry sending the other would sell again.
        if values.next().is_some() {
            return Err(ApiError::BadRequest(
                "send one Idempotency-Key header, not several: a retry must repeat the one key \
                 of its first attempt"
                    .to_owned(),
            ));
        }
        let invalid = || ApiError::BadRequest(idempotency::INVALID_KEY.to_owned());
        let key = value.to_str().map_err(|_| invalid())?;
        let key = idempotency::Key::try_from(key).map_err(|_| invalid())?;
        Ok(Self {
            idempotency_key: Some(key),
            peer,
        })
    }
}

/// Sell one item (GET, as in the tutorial)
///
/// The same sale as `POST /inventory/sale`, for a browser's address bar and the tutorial's
/// `curl`. Not idempotent, despite the method. `HEAD` (which a `GET` route would otherwise
/// answer by running the handler) never sells: it answers 405.
#[utoipa::path(
    get,
    path = "/inventory/sale",
    tag = TAG_SALE,
    params(SaleQuery, SaleHeaders),
    responses(
        SaleResponses,
        (status = 405, description = "`HEAD` never sells: nothing sold", body = ErrorBody),
    )
)]
async fn sale_get(
    method: Method,
    State(app): State<Arc<AppState>>,
    headers: SaleHeaders,
    ApiQuery(query): ApiQuery<SaleQuery>,
    _: BodyWithinLimit,
) -> Result<Response, ApiError> {
    if method == Method::HEAD {
        return Ok(head_never_sells());
    }
    sell(app, None, headers, query).await
}

/// Sell one of an item (GET, as in the tutorial)
///
/// The same sale as `POST /inventory/{item}/sale`. `HEAD` never sells: it answers 405.
#[utoipa::path(
    get,
    path = "/inventory/{item}/sale",
    tag = TAG_SALE,
    params(ItemPath, SaleQuery, SaleHeaders),
    responses(
        SaleResponses,
        (status = 405, description = "`HEAD` never sells: nothing sold", body = ErrorBody),
    )
)]
async fn item_sale_get(
    method: Method,
    State(app): State<Arc<AppState>>,
    ItemPath { item }: ItemPath,
    headers: SaleHeaders,
    ApiQuery(query): ApiQuery<SaleQuery>,
    _: BodyWithinLimit,
) -> Result<Response, ApiError> {
    if method == Method::HEAD {
        return Ok(head_never_sells());
    }
    sell(app, Some(item), headers, query).await
}

fn head_never_sells() -> Response {
    let mut refused = ApiError::MethodNotAllowed.into_response();
    refused.headers_mut().insert(
        axum::http::header::ALLOW,
        HeaderValue::from_static("GET, POST"),
    );
    refused
}

/// Show the stock
///
/// Of the default item (`ITEM_ID`); `/inventory/{item}` shows any item's.
#[utoipa::path(
    get,
    path = "/inventory",
    tag = TAG_INVENTORY,
    responses(
        (status = 200, description = "Stock now, stock at the last reset, sales recorded", body = Inventory),
        (status = 400, description = "A query parameter: this route takes none (an item is named in the path, `/inventory/{item}`)", body = ErrorBody),
        (status = 404, description = "The item was never stocked, or Redis lost its data (`unknown_item`)", body = ErrorBody,
            example = json!({"error": "unknown_item", "message": "item 002 has no stock in Redis (never stocked, or Redis lost its data); stock it with PUT /inventory/002"})),
        (status = 503, description = "Redis did not answer, or refused the service's credentials", body = ErrorBody),
    )
)]
async fn get_inventory(
    _: NoQuery,
    State(app): State<Arc<AppState>>,
) -> Result<Json<Inventory>, ApiError> {
    show(&app, app.seller.items.default_id()).await
}

/// Show an item's stock
#[utoipa::path(
    get,
    path = "/inventory/{item}",
    tag = TAG_INVENTORY,
    params(ItemPath),
    responses(
        (status = 200, description = "Stock now, stock at the last reset, sales recorded", body = Inventory),
        (status = 404, description = "The item was never stocked, or Redis lost its data (`unknown_item`)", body = ErrorBody,
            example = json!({"error": "unknown_item", "message": "item 002 has no stock in Redis (never stocked, or Redis lost its data); stock it with PUT /inventory/002"})),
        (status = 503, description = "Redis did not answer, or refused the service's credentials", body = ErrorBody),
        (status = 400, description = "Malformed item id, or a query parameter (this route takes none); the message names the valid format", body = ErrorBody,
            example = json!({"error": "bad_request", "message": "invalid item id \"a:b\": use 1 to 32 ASCII letters, digits, '-' or '_' (pattern ^[A-Za-z0-9_-]{1,32}$), not \"sale\" or \"audit\""})),
    )
)]
async fn get_item(
    _: NoQuery,
    State(app): State<Arc<AppState>>,
    ItemPath { item }: ItemPath,
) -> Result<Json<Inventory>, ApiError> {
    show(&app, &item).await
}

async fn show(app: &AppState, item: &str) -> Result<Json<Inventory>, ApiError> {
    let inventory = app.seller.items.store(item).inventory().await?;
    Ok(Json(
        inventory.ok_or_else(|| ApiError::UnknownItem(item.to_owned()))?,
    ))
}

/// A reset of the item.
#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({"stock": 100}))]
#[serde(deny_unknown_fields)]
pub struct ResetRequest {
    /// New stock, 0..=1000000000.
    #[schema(minimum = 0, maximum = 1_000_000_000)]
    pub stock: i64,
}

/// What every refused reset body is told it should have been.
const RESET_SHAPE: &str = "valid: a JSON object {\"stock\": N}, N a whole number in 0..=1000000000";

/// By hand, so that every refusal names the valid shape: derived, serde takes `[5]` for
/// `{"stock": 5}` (a struct may come as a sequence) and answers a string, a `null` or a
/// number too large for an `i64` in its own words.
impl<'de> Deserialize<'de> for ResetRequest {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_map(ResetVisitor)
    }
}

struct ResetVisitor;

impl<'de> serde::de::Visitor<'de> for ResetVisitor {
    type Value = ResetRequest;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str(RESET_SHAPE)
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<ResetRequest, A::Error> {
        use serde::de::Error;
        let mut stock = None;
        while let Some(key) = map.next_key::<String>()? {
            if key != "stock" {
                // Refused, as the sale's unknown parameters are: `{"stock": 5, "stok": 7}`
                // is a typo whose author meant one of the two numbers.
                return Err(A::Error::custom(format!(
                    "unknown field {}; {RESET_SHAPE}",
                    shown(&format!("{key:?}"))
                )));
            }
            if stock.is_some() {
                return Err(A::Error::custom(format!(
                    "stock is given twice; {RESET_SHAPE}"
                )));
            }
            let raw = map.next_value::<Box<serde_json::value::RawValue>>()?;
            stock = Some(exact_whole(raw.get()).ok_or_else(|| {
                A::Error::custom(format!("stock is {}; {RESET_SHAPE}", shown(raw.get())))
            })?);
        }
        let stock =
            stock.ok_or_else(|| A::Error::custom(format!("stock is missing; {RESET_SHAPE}")))?;
        Ok(ResetRequest { stock })
    }
}

/// The reset's body. Every refusal names the valid shape, those that serde never sees too
/// (a body that is not JSON, a wrong content type).
struct ResetBody(ResetRequest);

impl<S: Send + Sync> axum::extract::FromRequest<S> for ResetBody {
    type Rejection = ApiError;

    async fn from_request(req: axum::extract::Request, state: &S) -> Result<Self, ApiError> {
        // JSON is UTF-8, but serde skips the strings it ignores without checking them: a
        // body with raw bytes in a field nobody reads would otherwise reset the stock.
        let headers = req.headers().clone();
        let bytes = axum::body::Bytes::from_request(req, state).await?;
        if std::str::from_utf8(&bytes).is_err() {
            return Err(ApiError::BadRequest(format!(
                "the body is not UTF-8, so not JSON; {RESET_SHAPE}"
            )));
        }
        let mut req = axum::extract::Request::new(axum::body::Body::from(bytes));
        *req.headers_mut() = headers;
        match ApiJson::<ResetRequest>::from_request(req, state).await {
            Ok(ApiJson(reset)) => Ok(ResetBody(reset)),
            Err(ApiError::BadRequest(m)) if !m.contains(RESET_SHAPE) => {
                Err(ApiError::BadRequest(format!("{m}; {RESET_SHAPE}")))
            }
            // serde_json appends where it stopped (" at line 1 column 14") to the visitor's
            // own words, which then read as part of the valid range: the message ends with
            // the shape, as every other refusal of the reset does.
            Err(ApiError::BadRequest(m)) => {
                let end = m
                    .find(RESET_SHAPE)
                    .map_or(m.len(), |at| at + RESET_SHAPE.len());
                Err(ApiError::BadRequest(m[..end].to_owned()))
            }
            Err(e) => Err(e),
        }
    }
}

/// The whole number a JSON number's text stands for, read exactly: JSON Schema counts `5.0`
/// and `1e2` as integers, so the API does too, but `5.5` is refused, and so are `1e-400` and
/// `5.0000000000000001`, which a float reads as 0 and 5. `None` for anything else: not a
/// number, not whole, or beyond an `i64` (the range check that follows names the range).
fn exact_whole(text: &str) -> Option<i64> {
    let (negative, rest) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text),
    };
    let (mantissa, exponent) = match rest.split_once(['e', 'E']) {
        Some((mantissa, exponent)) => (mantissa, exponent.parse::<i64>().ok()?),
        None => (rest, 0),
    };
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let all_digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    if int.is_empty() || !all_digits(int) || !all_digits(frac) {
        return None;
    }
    let written = format!("{int}{frac}");
    let digits = written.trim_start_matches('0');
    if digits.is_empty() {
        return Some(0);
    }
    // How many of `digits` stand before the decimal point (negative: zeros come first).
    let zeros_dropped = (written.len() - digits.len()) as i64;
    let point = (int.len() as i64 - zeros_dropped).checked_add(exponent)?;
    // A nonzero first digit at or past the 20th place is beyond any i64.
    if point > 19 {
        return None;
    }
    let whole_digits = usize::try_from(point).ok().filter(|&p| p > 0)?;
    let (before, after) = digits.split_at(whole_digits.min(digits.len()));
    if after.bytes().any(|b| b != b'0') {
        return None;
    }
    let padding = u32::try_from(whole_digits.saturating_sub(digits.len())).ok()?;
    let magnitude = before.parse::<i128>().ok()? * 10i128.pow(padding);
    i64::try_from(if negative { -magnitude } else { magnitude }).ok()
}

/// A refused value as the message shows it: at most 40 characters of what was sent.
fn shown(text: &str) -> String {
    match text.char_indices().nth(40) {
        Some((cut, _)) => format!("{}...", &text[..cut]),
        None => text.to_owned(),
    }
}

/// Reset the stock
///
/// Sets the stock and the initial stock of the default item (`ITEM_ID`), empties its sales
/// ledger and the audit's counters. A leased lock stays with its holder; a lock without a
/// lease (`setnx`'s) gets one longer than any live sale (`LOCK_WAIT_MS` + `MAX_WORK_MS` +
/// four `REDIS_TIMEOUT_MS` + 1 s), so that a crashed holder's frees itself. A
/// sale that read before the reset is refused (`stock_changed`), and fencing tokens keep
/// counting up. A field other than `stock` is refused. Needs
/// `Authorization: Bearer <ADMIN_TOKEN>` when the service has one.
#[utoipa::path(
    put,
    path = "/inventory",
    tag = TAG_INVENTORY,
    request_body = ResetRequest,
    security((), ("admin_token" = [])),
    responses(
        (status = 200, description = "The item after the reset", body = Inventory),
        (status = 400, description = "Stock missing, not a number, or out of range, or a field other than `stock`, or a query parameter (none is taken); or (`/inventory/{item}`) a malformed item id; the message names the valid values", body = ErrorBody,
            example = json!({"error": "bad_request", "message": "stock is -1; valid: a whole number in 0..=1000000000"})),
        (status = 413, description = "Body larger than 16 KiB", body = ErrorBody),
        (status = 408, description = "The body did not arrive within `HEADER_TIMEOUT_MS`: nothing changed", body = ErrorBody),
        (status = 401, description = "Wrong or missing admin token", body = ErrorBody,
            headers(("WWW-Authenticate" = String, description = "`Bearer realm=\"inventory admin\"`: the scheme to send")),
            example = json!({"error": "unauthorized", "message": "this endpoint needs the header `Authorization: Bearer <ADMIN_TOKEN>`"})),
        (status = 503, description = "Redis did not answer", body = ErrorBody),
    )
)]
async fn reset_inventory(
    _: NoQuery,
    admin: Admin,
    State(app): State<Arc<AppState>>,
    ResetBody(reset): ResetBody,
) -> Result<Json<Inventory>, ApiError> {
    let item = app.seller.items.default_id().to_owned();
    restock(admin, &app, &item, reset).await
}

/// Create or reset an item
///
/// `PUT /inventory` for the item `{item}`: stocks an item never seen before, or resets one
/// exactly as `PUT /inventory` resets the default item. Needs `Authorization: Bearer
/// <ADMIN_TOKEN>` when the service has one.
#[utoipa::path(
    put,
    path = "/inventory/{item}",
    tag = TAG_INVENTORY,
    params(ItemPath),
    request_body = ResetRequest,
    security((), ("admin_token" = [])),
    responses(
        (status = 200, description = "The item after the reset", body = Inventory),
        (status = 400, description = "Stock missing, not a number, or out of range, or a field other than `stock`, or a query parameter (none is taken); or (`/inventory/{item}`) a malformed item id; the message names the valid values", body = ErrorBody,
            example = json!({"error": "bad_request", "message": "stock is -1; valid: a whole number in 0..=1000000000"})),
        (status = 413, description = "Body larger than 16 KiB", body = ErrorBody),
        (status = 408, description = "The body did not arrive within `HEADER_TIMEOUT_MS`: nothing changed", body = ErrorBody),
        (status = 401, description = "Wrong or missing admin token", body = ErrorBody,
            headers(("WWW-Authenticate" = String, description = "`Bearer realm=\"inventory admin\"`: the scheme to send")),
            example = json!({"error": "unauthorized", "message": "this endpoint needs the header `Authorization: Bearer <ADMIN_TOKEN>`"})),
        (status = 503, description = "Redis did not answer", body = ErrorBody),
    )
)]
async fn reset_item(
    _: NoQuery,
    admin: Admin,
    State(app): State<Arc<AppState>>,
    ItemPath { item }: ItemPath,
    ResetBody(reset): ResetBody,
) -> Result<Json<Inventory>, ApiError> {
    restock(admin, &app, &item, reset).await
}

/// `_admin` is the proof that the token was checked.
async fn restock(
    _admin: Admin,
    app: &AppState,
    item: &str,
    reset: ResetRequest,
) -> Result<Json<Inventory>, ApiError> {
    if !(0..=MAX_STOCK).contains(&reset.stock) {
        return Err(ApiError::BadRequest(format!(
            "stock is {}; valid: a whole number in 0..={MAX_STOCK}",
            reset.stock
        )));
    }
    let store = app.seller.items.store(item);
    // A lock without a lease (`setnx`'s) gets one that outlasts any live sale: its wait for
    // a nested acquire (the wait budget), its work, its Redis calls (read, write, release,
    // each bounded by the timeout), a second to spare; never less than the lease the other
    // locks are taken with. `LOCK_TTL_MS` alone let a live holder lose it mid-sale (work
    // past it, or a nested acquire waiting on itself) and two sales sold one unit.
    let orphan_lease =
        (app.seller.wait_budget + app.max_work + 4 * store.timeout() + Duration::from_secs(1))
            .max(app.seller.items.lease());
    store
        .reset(reset.stock, orphan_lease)
        .await
        .map_err(ApiError::Reset)?;
    app.seller.items.restocked(item);
    tracing::info!(item, stock = reset.stock, "inventory reset");
    let inventory = store.inventory().await?;
    Ok(Json(inventory.ok_or(ApiError::Internal(
        "the stock vanished right after its reset".into(),
    ))?))
}

/// Audit the sales
///
/// Compares the sales recorded with the stock of the default item (`ITEM_ID`): items
/// oversold, decrements lost, and the remaining-stock values that more than one sale left
/// behind. Reads counters that every write keeps, so it costs the same after a million
/// sales as after one.
#[utoipa::path(
    get,
    path = "/inventory/audit",
    tag = TAG_INVENTORY,
    responses(
        (status = 200, description = "The ledger against the stock", body = Audit),
        (status = 400, description = "A query parameter: this route takes none (an item is named in the path, `/inventory/{item}/audit`)", body = ErrorBody),
        (status = 404, description = "The item was never stocked, or Redis lost its data (`unknown_item`)", body = ErrorBody),
        (status = 503, description = "Redis did not answer, or refused the service's credentials", body = ErrorBody),
    )
)]
async fn audit(_: NoQuery, State(app): State<Arc<AppState>>) -> Result<Json<Audit>, ApiError> {
    audit_of(&app, app.seller.items.default_id()).await
}

/// Audit an item's sales
///
/// `GET /inventory/audit` for the item `{item}`.
#[utoipa::path(
    get,
    path = "/inventory/{item}/audit",
    tag = TAG_INVENTORY,
    params(ItemPath),
    responses(
        (status = 200, description = "The ledger against the stock", body = Audit),
        (status = 404, description = "The item was never stocked, or Redis lost its data (`unknown_item`)", body = ErrorBody),
        (status = 503, description = "Redis did not answer, or refused the service's credentials", body = ErrorBody),
        (status = 400, description = "Malformed item id, or a query parameter (this route takes none); the message names the valid format", body = ErrorBody),
    )
)]
async fn item_audit(
    _: NoQuery,
    State(app): State<Arc<AppState>>,
    ItemPath { item }: ItemPath,
) -> Result<Json<Audit>, ApiError> {
    audit_of(&app, &item).await
}

async fn audit_of(app: &AppState, item: &str) -> Result<Json<Audit>, ApiError> {
    let audit = app.seller.items.store(item).audit().await?;
    Ok(Json(
        audit.ok_or_else(|| ApiError::UnknownItem(item.to_owned()))?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stock_is_read_from_the_number_as_written_never_rounded() {
        for (text, value) in [
            ("0", 0),
            ("-0", 0),
            ("0.0", 0),
            ("0e999999", 0),
            ("5", 5),
            ("5.0", 5),
            ("5.000", 5),
            ("1e2", 100),
            ("1E+2", 100),
            ("100e-2", 1),
            ("1000000000", 1_000_000_000),
            ("10.5e1", 105),
            ("-1", -1),
            ("9223372036854775807", i64::MAX),
            ("-9223372036854775808", i64::MIN),
            ("0.001e3", 1),
        ] {
            assert_eq!(exact_whole(text), Some(value), "{text}");
        }
        for text in [
            "5.5",
            "1e-400",
            "5.0000000000000001",
            "1000000000.0000001",
            "999999999.99999999",
            "9223372036854775808",
            "-9223372036854775809",
            "1e19",
            "1e99999999999999999999",
            "99999999999999999999999",
            "0.1",
            "\"5\"",
            "null",
            "[5]",
            "true",
            "{}",
        ] {
            assert_eq!(exact_whole(text), None, "{text}");
        }
    }

    #[test]
    fn every_whole_number_in_range_reads_back_as_itself_in_each_form() {
        // A property over written forms: plain, with a zero fraction, and scaled by an
        // exponent, every value reads back exactly, and a half never passes.
        for n in (0..=1_000_000_000i64)
            .step_by(7_654_321)
            .chain([1, 10, 999_999_999])
        {
            assert_eq!(exact_whole(&n.to_string()), Some(n));
            assert_eq!(exact_whole(&format!("{n}.000")), Some(n));
            assert_eq!(exact_whole(&format!("{n}000e-3")), Some(n));
            assert_eq!(exact_whole(&format!("-{n}")), Some(-n));
            if n % 10 == 0 && n > 0 {
                assert_eq!(exact_whole(&format!("{}e1", n / 10)), Some(n));
            }
            assert_eq!(exact_whole(&format!("{n}.5")), None);
        }
    }
}

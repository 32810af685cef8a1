//! The HTTP surface: one module per resource, routes and OpenAPI collected together by
//! `utoipa-axum`, so the document cannot forget a route.

pub mod error;
mod extract;
mod inventory;
mod meta;

use std::sync::Arc;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::http::Request;
use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use tower::ServiceBuilder;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::set_header::SetResponseHeaderLayer;
use tower_http::timeout::RequestBodyTimeoutLayer;
use tower_http::trace::TraceLayer;
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;
use utoipa_swagger_ui::SwaggerUi;

use crate::sale::Seller;
use crate::strategy::Strategy;
pub use error::{ApiError, ErrorBody};

pub const TAG_SALE: &str = "sale";
pub const TAG_INVENTORY: &str = "inventory";
pub const TAG_SERVICE: &str = "service";

static REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// Request bodies are a few bytes of JSON; anything large is a mistake or an attack.
pub(crate) const BODY_LIMIT: usize = 16 * 1024;

/// What every handler shares.
pub struct AppState {
    pub seller: Seller,
    pub default_strategy: Strategy,
    pub admin_token: Option<String>,
    /// Longest `work_ms` a sale may ask for.
    pub max_work: std::time::Duration,
    /// How long a client may take to send a request's body once its headers are in (the
    /// server bounds the headers themselves).
    pub body_timeout: std::time::Duration,
}

#[derive(OpenApi)]
#[openapi(
    info(
        title = "inventory",
        description = "Sells one item at a time from a stock kept in Redis, guarded by a \
            switchable distributed lock: from a process-local mutex that oversells behind \
            nginx, through each Redis fix, to fencing tokens and a lock-free atomic sale. \
            Every response carries `X-Instance`, the instance that answered."
    ),
    tags(
        (name = TAG_SALE, description = "Selling, under the lock strategy of your choice"),
        (name = TAG_INVENTORY, description = "Stock, reset and audit"),
        (name = TAG_SERVICE, description = "Strategies, health and readiness"),
    ),
    modifiers(&AdminToken)
)]
struct ApiDoc;

/// Declares the bearer token that `PUT /inventory` asks for when `ADMIN_TOKEN` is set.
struct AdminToken;

impl utoipa::Modify for AdminToken {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "admin_token",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

fn api_router() -> OpenApiRouter<Arc<AppState>> {
    OpenApiRouter::with_openapi(ApiDoc::openapi())
        .merge(inventory::router())
        .merge(meta::router())
}

/// A body over the limit is refused on every route, before any handler runs: the limit
/// itself only binds the handlers that read a body, and a sale reads none, so straight to
/// an instance a 20 KB sale sold, where nginx refuses it. A body without a length is bound
/// by the limit where it is read.
async fn refuse_declared_oversize(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let declared = request
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    match declared {
        Some(length) if length > BODY_LIMIT as u64 => {
            // Read and dropped first, up to a bound: answered at once, the connection was
            // closed with the body still arriving, the kernel reset it, and the client lost
            // the 413 to "connection reset" (1 run in 20 of a 64 KiB body, from a test).
            // Larger bodies are not worth reading; their clients may see the reset.
            // Not when the client waits for `100 Continue` before it sends: reading would
            // send it that invitation, and then the 413 a timeout later.
            let waits = request
                .headers()
                .get(axum::http::header::EXPECT)
                .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
            if length <= DRAIN_LIMIT as u64 && !waits {
                let _ = axum::body::to_bytes(request.into_body(), DRAIN_LIMIT).await;
            }
            axum::response::IntoResponse::into_response(ApiError::PayloadTooLarge(
                error::too_large_message(),
            ))
        }
        _ => next.run(request).await,
    }
}

/// The largest declared body that is read (and dropped) before its 413 is sent.
const DRAIN_LIMIT: usize = 1024 * 1024;

/// axum offers `HEAD` wherever `GET` is routed; the sale refuses it (it would sell), so its
/// 405s must not offer it either.
async fn sale_allows_no_head(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let sale = request.uri().path().ends_with("/sale");
    let mut response = next.run(request).await;
    if sale && response.status() == axum::http::StatusCode::METHOD_NOT_ALLOWED {
        response.headers_mut().insert(
            axum::http::header::ALLOW,
            HeaderValue::from_static("GET, POST"),
        );
    }
    response
}

/// The OpenAPI document, without building the application, for an instance that allows
/// `work_ms` up to `max_work_ms`.
pub fn openapi(max_work_ms: u64) -> utoipa::openapi::OpenApi {
    let mut api = api_router().into_openapi();
    complete_document(&mut api, max_work_ms);
    api
}

/// What the routes' own annotations cannot say: the configured `work_ms` ceiling, the 413
/// every route answers, and the headers every answer carries.
fn complete_document(api: &mut utoipa::openapi::OpenApi, max_work_ms: u64) {
    set_max_work(api, max_work_ms);
    document_body_limit(api);
    document_common_headers(api);
}

/// Every operation of the document.
fn operations(
    api: &mut utoipa::openapi::OpenApi,
) -> impl Iterator<Item = &mut utoipa::openapi::path::Operation> {
    api.paths
        .paths
        .values_mut()
        .flat_map(|item| {
            [
                item.get.as_mut(),
                item.put.as_mut(),
                item.post.as_mut(),
                item.delete.as_mut(),
                item.patch.as_mut(),
            ]
        })
        .flatten()
}

/// Every answer carries `X-Instance` and `X-Request-Id` (set by the outermost layers): the
/// document listed neither, and a client generated from it could not read them.
fn document_common_headers(api: &mut utoipa::openapi::OpenApi) {
    use utoipa::openapi::header::HeaderBuilder;
    use utoipa::openapi::{ObjectBuilder, RefOr, Type};
    let header = |description: &str| {
        HeaderBuilder::new()
            .schema(Some(ObjectBuilder::new().schema_type(Type::String)))
            .description(Some(description))
            .build()
    };
    let instance = header("The instance that answered (`INSTANCE_NAME`), on every answer");
    let request_id = header(
        "The request's id: the client's or nginx's `X-Request-Id` if it sent a usable one, \
         else a new one; in every log line of the request",
    );
    for operation in operations(api) {
        for response in operation.responses.responses.values_mut() {
            if let RefOr::T(response) = response {
                response
                    .headers
                    .entry("X-Instance".to_owned())
                    .or_insert_with(|| RefOr::T(instance.clone()));
                response
                    .headers
                    .entry("X-Request-Id".to_owned())
                    .or_insert_with(|| RefOr::T(request_id.clone()));
            }
        }
    }
}

/// Every route answers 413 to a body over the limit (the limit is the whole router's): the
/// document says so for each, where only those that take a body said it (a GET sent with a
/// body got an answer the document did not list).
fn document_body_limit(api: &mut utoipa::openapi::OpenApi) {
    use utoipa::openapi::{ContentBuilder, Ref, RefOr, ResponseBuilder};
    let too_large = ResponseBuilder::new()
        .description("Body larger than 16 KiB: nothing done")
        .content(
            "application/json",
            ContentBuilder::new()
                .schema(Some(Ref::from_schema_name("ErrorBody")))
                .build(),
        )
        .build();
    for operation in operations(api) {
        operation
            .responses
            .responses
            .entry("413".to_owned())
            .or_insert_with(|| RefOr::T(too_large.clone()));
    }
}

/// The document states the configured ceiling of `work_ms`, not the hard one, so that a
/// client generated from it never sends what the instance refuses.
fn set_max_work(api: &mut utoipa::openapi::OpenApi, max_work_ms: u64) {
    use utoipa::openapi::{RefOr, Schema};
    let operations = api
        .paths
        .paths
        .values_mut()
        .flat_map(|item| [item.get.as_mut(), item.post.as_mut()])
        .flatten();
    for operation in operations {
        let parameters = operation.parameters.iter_mut().flatten();
        let inline = parameters.filter_map(|p| match p {
            RefOr::T(p) => Some(p),
            RefOr::Ref(_) => None,
        });
        for parameter in inline.filter(|p| p.name == "work_ms") {
            if let Some(RefOr::T(Schema::Object(schema))) = parameter.schema.as_mut() {
                schema.maximum = Some(utoipa::Number::UInt(max_work_ms as usize));
            }
        }
    }
}

/// The whole application, ready for `axum::serve` or for `oneshot` in tests.
pub fn app(state: AppState, instance: &str) -> anyhow::Result<Router> {
    let instance = HeaderValue::from_str(instance)
        .map_err(|_| anyhow::anyhow!("instance name {instance:?} cannot be sent in a header"))?;
    let (router, mut api) = api_router().split_for_parts();
    complete_document(&mut api, state.max_work.as_millis() as u64);
    let body_timeout = RequestBodyTimeoutLayer::new(state.body_timeout);
    Ok(router
        // The item path with an empty id, which no `{item}` route matches: a malformed
        // id, not a missing route.
        .route(
            "/inventory/",
            axum::routing::any(|| async {
                ApiError::BadRequest(
                    crate::names::parse_item_id("").err().unwrap_or_default(),
                )
            }),
        )
        .merge(
            Router::from(SwaggerUi::new("/swagger-ui").url("/api-docs/openapi.json", api))
                // The UI's file server answers a name it has no file for with a bare 404,
                // neither JSON nor the contract's shape.
                .layer(axum::middleware::map_response(|response: Response| async move {
                    if response.status() == StatusCode::NOT_FOUND {
                        ApiError::NotFound.into_response()
                    } else {
                        response
                    }
                })),
        )
        .fallback(|| async { ApiError::NotFound })
        .method_not_allowed_fallback(|| async { ApiError::MethodNotAllowed })
        .with_state(Arc::new(state))
        .layer(axum::middleware::from_fn(refuse_declared_oversize))
        .layer(axum::middleware::map_response(error::log_failures))
        .layer(axum::middleware::from_fn(sale_allows_no_head))
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .layer(body_timeout)
        .layer(
            // Outermost first: take nginx's X-Request-Id (or make one), open a span that
            // carries it into every log line of the request, and send it back.
            ServiceBuilder::new()
                .layer(axum::middleware::map_request(drop_unusable_request_id))
                .layer(SetRequestIdLayer::new(REQUEST_ID.clone(), MakeRequestUuid))
                .layer(TraceLayer::new_for_http().make_span_with(|request: &Request<_>| {
                    let id = request
                        .headers()
                        .get(&REQUEST_ID)
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or_default();
                    tracing::info_span!("request", request_id = %id, method = %request.method(), path = %request.uri().path())
                }))
                .layer(PropagateRequestIdLayer::new(REQUEST_ID.clone()))
                .layer(SetResponseHeaderLayer::overriding(
                    HeaderName::from_static("x-instance"),
                    instance,
                )),
        ))
}

/// The longest `X-Request-Id` taken from a client; nginx's own are 32 characters.
const REQUEST_ID_MAX: usize = 128;

/// Drops an `X-Request-Id` the service would not want in its logs or its answers (longer than
/// 128 bytes, spaces or control characters, or given twice), so that one is made instead: it is
/// echoed back and written into every log line of the request, and an 8 KB one was.
async fn drop_unusable_request_id(mut request: axum::extract::Request) -> axum::extract::Request {
    let headers = request.headers();
    let mut ids = headers.get_all(&REQUEST_ID).iter();
    let usable = match (ids.next(), ids.next()) {
        (Some(id), None) => usable_request_id(id.as_bytes()),
        (None, _) => true,
        _ => false,
    };
    if !usable {
        request.headers_mut().remove(&REQUEST_ID);
    }
    request
}

fn usable_request_id(id: &[u8]) -> bool {
    (1..=REQUEST_ID_MAX).contains(&id.len()) && id.iter().all(|b| b.is_ascii_graphic())
}

#[cfg(test)]
mod request_id_tests {
    use super::usable_request_id;

    #[test]
    fn only_short_visible_request_ids_are_kept() {
        assert!(usable_request_id(b"0f1e2d3c4b5a69788796a5b4c3d2e1f0"));
        assert!(usable_request_id(&[b'a'; 128]));
        assert!(!usable_request_id(&[b'a'; 129]));
        assert!(!usable_request_id(b""));
        assert!(!usable_request_id(b"two words"));
        assert!(!usable_request_id(b"tab\there"));
        assert!(!usable_request_id("caf\u{e9}".as_bytes()));
    }
}

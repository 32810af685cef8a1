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
        app.seller.store.metrics().render(),
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
    })
}

/// Readiness
///
/// 200 when Redis answers a PING within the Redis timeout, 503 otherwise.
#[utoipa::path(
    get,
    path = "/ready",
    tag = TAG_SERVICE,
    responses(
        (status = 200, description = "Redis is reachable", body = Status),
        (status = 503, description = "Redis did not answer", body = ErrorBody,
            example = json!({"error": "redis_unavailable", "message": "Redis did not answer; retry shortly"})),
    )
)]
async fn ready(State(app): State<Arc<AppState>>) -> Result<Json<Status>, ApiError> {
    app.seller.store.ping().await?;
    Ok(Json(Status {
        status: "ready".into(),
        instance: app.seller.instance.clone(),
    }))
}

//! Wiring: from a [`Config`] to a running server.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::net::TcpListener;
use tokio::sync::Notify;

use crate::config::Config;
use crate::http::{self, AppState};
use crate::lock::Locks;
use crate::metrics::Metrics;
use crate::sale::Seller;
use crate::store::Store;

/// Builds the application. Redis is not contacted here: an instance starts while Redis is
/// down, reports not-ready, and connects as soon as it can.
pub fn build(config: &Config) -> anyhow::Result<axum::Router> {
    let instance = config.instance_name();
    // The URL may hold a password: it stays out of the error.
    let store = Store::new(
        &config.redis_url,
        &config.item_id,
        config.redis_timeout(),
        Arc::new(Metrics::default()),
    )
    .map_err(|e| anyhow::anyhow!("REDIS_URL is not a valid Redis URL ({:?})", e.kind()))?;
    let locks = Locks::new(
        store.clone(),
        config.lock_ttl(),
        config.lock_wait,
        Duration::from_millis(config.release_gap_ms),
    );
    let state = AppState {
        seller: Seller {
            instance: instance.clone(),
            store,
            locks,
            wait_budget: config.lock_wait(),
            idempotency_keep: Duration::from_secs(config.idempotency_ttl_s),
        },
        default_strategy: config.lock_strategy,
        admin_token: config.admin_token.clone().filter(|t| !t.is_empty()),
    };
    http::app(state, &instance)
}

/// Serves until Ctrl-C or SIGTERM; then stops accepting, lets the sales in flight finish
/// (and so release their locks) for up to `SHUTDOWN_GRACE_MS`, and returns.
pub async fn run(config: Config) -> anyhow::Result<()> {
    let app = build(&config)?;
    let addr = (config.bind_addr, config.port);
    let listener = TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {}:{}", config.bind_addr, config.port))?;
    tracing::info!(
        instance = %config.instance_name(),
        addr = %listener.local_addr()?,
        strategy = %config.lock_strategy,
        ttl_ms = config.lock_ttl_ms,
        wait_ms = config.lock_wait_ms,
        "listening"
    );
    let stopping = Arc::new(Notify::new());
    let signalled = {
        let stopping = stopping.clone();
        async move {
            shutdown_signal().await;
            stopping.notify_one();
        }
    };
    let serve = axum::serve(listener, app).with_graceful_shutdown(signalled);
    let grace = Duration::from_millis(config.shutdown_grace_ms);
    tokio::select! {
        served = serve => served?,
        () = async { stopping.notified().await; tokio::time::sleep(grace).await } => {
            tracing::warn!(grace_ms = config.shutdown_grace_ms,
                "requests still in flight after the grace period; exiting (their locks expire with their leases)");
        }
    }
    tracing::info!("stopped");
    Ok(())
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

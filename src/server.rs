//! Wiring: from a [`Config`] to a running server.

use anyhow::Context;
use tokio::net::TcpListener;

use crate::config::Config;
use crate::http::{self, AppState};
use crate::lock::Locks;
use crate::sale::Seller;
use crate::store::Store;

/// Builds the application. Redis is not contacted here: an instance starts while Redis is
/// down, reports not-ready, and connects as soon as it can.
pub fn build(config: &Config) -> anyhow::Result<axum::Router> {
    let instance = config.instance_name();
    let store = Store::new(&config.redis_url, &config.item_id, config.redis_timeout())
        .context("invalid REDIS_URL")?;
    let locks = Locks::new(
        store.clone(),
        config.lock_ttl(),
        config.lock_wait,
        std::time::Duration::from_millis(config.release_gap_ms),
    );
    let state = AppState {
        seller: Seller {
            instance: instance.clone(),
            store,
            locks,
            wait_budget: config.lock_wait(),
        },
        default_strategy: config.lock_strategy,
        admin_token: config.admin_token.clone().filter(|t| !t.is_empty()),
    };
    http::app(state, &instance)
}

/// Serves until Ctrl-C or SIGTERM, then stops accepting and lets requests in flight finish.
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
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown_signal())
        .await?;
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
    tracing::info!("shutting down: finishing requests in flight");
}

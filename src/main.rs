use std::io::IsTerminal;

use clap::Parser;
use tracing_subscriber::EnvFilter;

use inventory::config::{Config, LogFormat};

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> anyhow::Result<()> {
    let config = Config::parse();
    if config.openapi {
        println!(
            "{}",
            inventory::http::openapi(config.max_work_ms).to_pretty_json()?
        );
        return Ok(());
    }
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .with_ansi(std::io::stdout().is_terminal());
    match config.log_format {
        LogFormat::Text => logs.init(),
        LogFormat::Json => logs.json().flatten_event(true).with_span_list(false).init(),
    }
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    if let Some(threads) = config.worker_threads {
        runtime.worker_threads(usize::from(threads));
    }
    runtime
        .enable_all()
        .build()?
        .block_on(inventory::server::run(config))
}

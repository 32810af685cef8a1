use std::io::{IsTerminal, Write};

use clap::Parser;
use tracing_subscriber::EnvFilter;

use inventory::config::{Config, LogFormat};

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> anyhow::Result<()> {
    let config = Config::parse();
    if config.openapi {
        let document = inventory::http::openapi(config.max_work_ms).to_pretty_json()?;
        print_document(&document);
        return Ok(());
    }
    let rust_log = std::env::var("RUST_LOG").ok();
    let (filter, warnings) = match inventory::config::log_filter(rust_log.as_deref()) {
        Ok(checked) => checked,
        Err(refusal) => {
            // As clap refuses a setting: the message and status 2, before anything starts.
            eprintln!("error: {refusal}");
            std::process::exit(2);
        }
    };
    for warning in &warnings {
        eprintln!("warning: {warning}");
    }
    let filter = EnvFilter::new(filter);
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .with_ansi(std::io::stdout().is_terminal());
    match config.log_format {
        LogFormat::Text => logs.init(),
        LogFormat::Json => logs.json().flatten_event(true).with_span_list(false).init(),
    }
    // One thread: the single-threaded scheduler. The multi-threaded one, even with one
    // worker, runs a task woken by the running task next (its LIFO slot), so the shared
    // Redis connection's writer ran after every sale's send and wrote each command in a
    // `writev` of its own; here it runs after the sales already woken, and writes them
    // together (about 15 per `writev` at 64 connections), which Redis then reads together.
    let mut runtime = match config.worker_threads {
        Some(1) => tokio::runtime::Builder::new_current_thread(),
        threads => {
            let mut runtime = tokio::runtime::Builder::new_multi_thread();
            if let Some(threads) = threads {
                runtime.worker_threads(usize::from(threads));
            }
            runtime
        }
    };
    runtime
        .enable_all()
        .build()?
        .block_on(inventory::server::run(config))
}

/// Writes `document` to stdout, and exits when it cannot (`println!` panicked, status 101).
/// A reader that left (`inventory --openapi | head -c 10`: a broken pipe) is no error: it
/// exits 0 without a word, as ripgrep does, since the pipeline's status is the reader's to
/// report (a writer killed by SIGPIPE would say 141, but Rust ignores the signal, and only
/// an `unsafe` call could restore it). Any other failure (`> /dev/full`) is one line on
/// stderr and status 1. The flush is explicit: at exit, Rust drops a failed flush silently.
fn print_document(document: &str) {
    let mut out = std::io::stdout().lock();
    let written = writeln!(out, "{document}").and_then(|()| out.flush());
    match written {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => std::process::exit(0),
        Err(e) => {
            eprintln!("error: cannot write the OpenAPI document to stdout: {e}");
            std::process::exit(1);
        }
    }
}

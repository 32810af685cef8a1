//! An inventory-sale service that teaches distributed locking with Redis.
//!
//! Each sale reads a stock kept in Redis, works for a while, and writes stock - 1. Two or
//! more instances run behind nginx, so the read-modify-write must be guarded; the guard is
//! a lock strategy chosen per request, from the tutorial's process-local mutex (which
//! oversells as soon as there are two instances) through each Redis fix to fencing tokens,
//! and a lock-free atomic sale as the reference. Every strategy shows its known flaw on
//! demand, and the next one survives it.
//!
//! # Layout
//!
//! - [`config`]: flags with environment fallbacks.
//! - [`store`]: key names, the Lua scripts of `lua/`, stock, ledger and audit.
//! - [`lock`]: one file per strategy, in history order, and what they share: waiting
//!   for a held lock ([`lock::wait`]) and renewing a lease ([`lock::renewal`]).
//! - [`items`]: many items: each item's lock machinery, the default item's for good and
//!   every other's while it is being sold.
//! - [`sale`]: the one sale flow: lock, read, work, write, release.
//! - [`idempotency`]: `Idempotency-Key` (its key type, its claim, what a retry finds), so
//!   that a retried sale never sells twice.
//! - [`names`]: what a client may put into a Redis key name.
//! - [`hangup`]: whether a sale's client still waits for its answer.
//! - [`metrics`]: Prometheus counters and histograms.
//! - [`http`]: routes, OpenAPI and Swagger UI, and the mapping of outcomes to statuses.
//! - [`server`]: wiring and graceful shutdown, for `main` and for tests.

pub mod config;
pub mod events;
pub mod hangup;
pub mod http;
pub mod idempotency;
pub mod items;
pub mod lock;
pub mod metrics;
pub mod names;
pub mod sale;
pub mod server;
pub mod store;
pub mod strategy;

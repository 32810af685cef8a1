//! `slow-holder`: `setnx-ttl` (v4) against `owner-check` (v5). The holder works past its lease;
//! another sale takes the expired lock; the first then releases.

use inventory::lock::{RedisLock, Strategy};
use serde_json::Value;

use super::env::Env;
use super::{Observed, Scenario, handover};

pub(super) const SCENARIO: Scenario = Scenario {
    description: "work longer than the TTL; another sale takes the expired lock; the first then releases",
    flawed: Strategy::Redis(RedisLock::SetnxTtl),
    survivor: Strategy::Redis(RedisLock::OwnerCheck),
    setting: None,
};

/// A's lease ends at 500 ms, B holds from there to ~900 ms, A releases at 700 ms.
pub(super) async fn run(env: &Env, strategy: Strategy) -> anyhow::Result<(Observed, Value)> {
    handover::third_sale_enters(env, strategy, 700, 700, 400).await
}

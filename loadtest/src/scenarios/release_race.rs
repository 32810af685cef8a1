//! `release-race`: `owner-check` (v5) against `lua-release` (v6). The lock changes hands
//! between the owner check and the delete.

use std::collections::BTreeMap;

use inventory::lock::{RedisLock, Strategy};
use serde_json::Value;

use super::env::Env;
use super::{Observed, Scenario, handover};

/// The pause `release-race` puts between `owner-check`'s GET and its DEL.
const RELEASE_GAP_MS: u64 = 400;

pub(super) const SCENARIO: Scenario = Scenario {
    description: "the lock changes hands between the owner check and the delete",
    flawed: Strategy::Redis(RedisLock::OwnerCheck),
    survivor: Strategy::Redis(RedisLock::LuaRelease),
    setting: None,
};

/// Only app1's first sale releases in this scenario: widen its window.
pub(super) fn configure(app: &str, env: &mut BTreeMap<String, String>) {
    if app == "app1" {
        env.insert("RELEASE_GAP_MS".into(), RELEASE_GAP_MS.to_string());
    }
}

/// A checks at 300 ms (`lua-release`: sends its one-step release at 700 ms), the lease ends
/// at 500 ms, B takes it, A deletes at 300 + RELEASE_GAP_MS = 700 ms.
pub(super) async fn run(env: &Env, strategy: Strategy) -> anyhow::Result<(Observed, Value)> {
    handover::third_sale_enters(env, strategy, 300, 300 + RELEASE_GAP_MS, 400).await
}

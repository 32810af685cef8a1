//! `redlock-pause`: `redlock` against `redlock-fenced`. A quorum of nodes cannot make a
//! frozen holder notice that its validity ran out: only a fence at the store can.

use inventory::lock::{RedisLock, Strategy};
use serde_json::Value;

use super::env::Env;
use super::{Observed, Scenario};

pub(super) const SCENARIO: Scenario = Scenario {
    description: "SIGSTOP the redlock holder after it read the stock, past its validity, while the other instance sells",
    flawed: Strategy::Redis(RedisLock::Redlock),
    survivor: Strategy::Redis(RedisLock::RedlockFenced),
    setting: None,
};

/// The same fault as `process-pause`, provoked and judged the same way: the pause does not
/// care how many nodes granted the lock.
pub(super) async fn run(env: &Env, strategy: Strategy) -> anyhow::Result<(Observed, Value)> {
    super::process_pause::run(env, strategy).await
}

//! `failover-wrong-replica`: `fenced` with `REPLICA_ACKS=1` against `REPLICA_ACKS=2`, on a
//! master with two replicas. One replica lags (frozen), the other acknowledges every write
//! of a sale on app1; the up-to-date replica is kept out of the election (`replica-priority
//! 0`, as a replica the sentinels cannot reach would be), the master is killed and the
//! lagging one is promoted; the up-to-date one then resyncs from it and drops the sale. One acknowledgement
//! did not make the lock or the sale survive (as in redisson issue 5256): app2 sells the
//! same remaining-stock value again. Asking every replica (`REPLICA_ACKS=2`) refuses the
//! first sale instead, at the price of availability: one replica down stops every sale.

use inventory::lock::{RedisLock, Strategy};
use serde_json::Value;

use super::env::Env;
use super::failover::{Promoted, run_with};
use super::{Observed, Scenario, Setting};

pub(super) const SCENARIO: Scenario = Scenario {
    description: "one replica acknowledges the sale, the other (lagging) one is promoted",
    flawed: Strategy::Redis(RedisLock::Fenced),
    survivor: Strategy::Redis(RedisLock::Fenced),
    setting: Some(Setting {
        var: "REPLICA_ACKS",
        flawed: "1",
        survivor: "2",
    }),
};

pub(super) async fn run(env: &mut Env, strategy: Strategy) -> anyhow::Result<(Observed, Value)> {
    run_with(env, strategy, Promoted::NotTheOneThatAcknowledged).await
}

//! Every fault scenario row, as a test: the flawed strategy shows its flaw, the next one
//! survives the same fault. The verdicts come from what happened, not from names.

use std::path::Path;

use loadtest::scenarios::{self, Fault, Observed, Row};

async fn assert_row(scenario: &str, label: &str, expected: Observed) {
    let fault: Fault = scenario.parse().unwrap();
    let row = Row::find(fault, label).unwrap_or_else(|| panic!("no row {scenario} / {label}"));
    let bin = Path::new(env!("CARGO_BIN_EXE_inventory"));
    let run = scenarios::run_bounded(row, bin, 3).await.unwrap();
    assert_eq!(run.expected, expected, "the row's expectation");
    assert!(
        run.ok,
        "{} / {}: expected {}, observed {}\ndetails: {:#}\ntimeline:\n{}",
        run.scenario,
        run.label(),
        run.expected,
        run.observed,
        run.details,
        run.timeline
    );
}

macro_rules! rows {
    ($($test:ident => ($scenario:literal, $strategy:literal, $expected:ident)),* $(,)?) => {$(
        #[tokio::test(flavor = "multi_thread")]
        async fn $test() {
            assert_row($scenario, $strategy, Observed::$expected).await;
        }
    )*};
}

rows! {
    local_oversells_when_two_instances_sell_at_once => ("two-instances", "local", Flaw),
    setnx_holds_when_two_instances_sell_at_once => ("two-instances", "setnx", Safe),
    setnx_lock_is_never_freed_when_its_holder_dies => ("crash-holder", "setnx", Flaw),
    setnx_ttl_lock_expires_after_its_holder_dies => ("crash-holder", "setnx-ttl", Safe),
    setnx_ttl_late_holder_deletes_the_next_holders_lock => ("slow-holder", "setnx-ttl", Flaw),
    owner_check_late_holder_leaves_the_next_holders_lock_alone => ("slow-holder", "owner-check", Safe),
    owner_check_deletes_a_lock_that_changed_hands_after_the_check => ("release-race", "owner-check", Flaw),
    lua_release_cannot_delete_a_lock_that_changed_hands => ("release-race", "lua-release", Safe),
    lua_release_waits_on_itself_when_reentered => ("reentry", "lua-release", Flaw),
    reentrant_lock_can_be_reentered => ("reentry", "reentrant", Safe),
    reentrant_lock_expires_under_long_work => ("long-work", "reentrant", Flaw),
    watchdog_renews_the_lock_through_long_work => ("long-work", "watchdog", Safe),
    watchdog_lets_a_paused_holder_write_after_its_lock_expired => ("process-pause", "watchdog", Flaw),
    fenced_refuses_the_paused_holders_stale_write => ("process-pause", "fenced", Safe),
    a_lock_does_not_protect_against_a_writer_that_ignores_it => ("mixed-writers", "none", Flaw),
    atomic_sales_beside_fenced_ones_never_overwrite_or_get_overwritten => ("mixed-writers", "atomic", Safe),
    fenced_sales_fail_while_its_one_redis_node_is_down => ("node-loss", "fenced", Flaw),
    redlock_sells_on_with_one_of_three_nodes_killed => ("node-loss", "redlock", Safe),
    fenced_on_one_node_cannot_sell_from_the_instance_cut_off_from_it => ("partition", "fenced", Flaw),
    redlock_keeps_one_holder_at_a_time_with_a_node_cut_off_from_one_instance => ("partition", "redlock", Safe),
    redlock_lets_a_paused_holder_write_after_its_validity_ran_out => ("redlock-pause", "redlock", Flaw),
    redlock_fenced_refuses_the_paused_holders_stale_write => ("redlock-pause", "redlock-fenced", Safe),
    redlock_grants_the_lock_twice_when_a_node_restarts_empty => ("node-restart", "redlock", Flaw),
    redlock_fenced_keeps_the_stock_right_when_a_node_restarts_empty => ("node-restart", "redlock-fenced", Safe),
    optimistic_sells_right_under_contention_but_throws_work_away => ("contention", "optimistic", Flaw),
    fenced_waits_under_contention_and_never_retries => ("contention", "fenced", Safe),
    without_replica_acks_a_failover_loses_a_sale_answered_200_and_sells_its_stock_again => ("failover", "fenced REPLICA_ACKS=0", Flaw),
    with_one_replica_ack_an_unreplicated_acquire_is_refused_and_nothing_is_sold_twice => ("failover", "fenced REPLICA_ACKS=1", Safe),
    one_replica_ack_loses_the_sale_when_the_other_lagging_replica_is_promoted => ("failover-wrong-replica", "fenced REPLICA_ACKS=1", Flaw),
    acks_from_every_replica_refuse_the_sale_that_a_lagging_replica_would_lose => ("failover-wrong-replica", "fenced REPLICA_ACKS=2", Safe),
}

#[test]
fn every_scenario_has_a_test_for_both_of_its_rows() {
    let source = include_str!("scenarios.rs");
    for row in scenarios::rows() {
        let row = format!("(\"{}\", \"{}\",", row.fault, row.label());
        assert!(source.contains(&row), "no test for {row}");
    }
}

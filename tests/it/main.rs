//! Integration tests: real `redis-server`, real `inventory` processes.

// A panic is how a test reports a failure.
#![allow(clippy::unwrap_used)]

mod acl;
mod api;
mod attack;
mod browser;
mod cli;
mod cluster;
mod cluster_fixture;
mod compose;
mod handoff;
mod harness;
mod items;
mod leaks;
mod lease;
mod loadtest_items;
mod lua;
mod model;
mod optimistic;
mod pictures;
mod quorum;
mod replication;
mod resilience;
mod safety;
mod scenarios;
mod stack;
mod strategies;
mod topologies;

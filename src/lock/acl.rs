//! What a strategy's sales ask of the Redis user: every command they may send, with the key
//! it goes to, so that `/ready` can ask Redis, without running any of them, whether the
//! user's ACL allows each (`redis.acl_check_cmd`, in `lua/writable.lua`).
//!
//! Redis checks a command's rights only when it runs: a user without `XADD`, `SETBIT`,
//! `TIME` or write access to the item's keys answered `PING` and every `INFO`, `/ready` said
//! ready, and every sale answered 503 `redis_auth_failed` (found from outside, 4 of 4). The
//! lists cover the paths a sale may take, not only the quiet one: a lock found busy (the
//! queue, the hand-off, the signal), a renewal, an `Idempotency-Key` and its claim, the
//! script cache emptied by a restart (`SCRIPT LOAD`). They are the default strategy's: a user
//! may be granted exactly what that strategy needs (the tests grant each strategy its list,
//! command by command and key by key, and sell with it), and an instance is not declared
//! unready for a strategy nobody asks it for.

use super::wait::WaitMode;
use redis::RedisResult;

use crate::store::{Keys, Store};
use crate::strategy::{RedisLock, Strategy};

/// What a refusal of the readiness probe's own script means: the probe is a script, so its
/// `EVALSHA` (or the `SCRIPT LOAD` behind it) was refused before any check ran.
const SCRIPTS_REFUSED: &str = "EVALSHA or SCRIPT LOAD (every sale runs scripts)";

/// A script's hash in a check: the ACL reads only its keys.
const SHA: &str = "0000000000000000000000000000000000000000";

/// One command a sale may send, with the arguments an ACL check reads: its key (or
/// subcommand) first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Need {
    pub command: &'static str,
    pub args: Vec<String>,
}

impl Need {
    fn new(command: &'static str, args: &[&str]) -> Self {
        Need {
            command,
            args: args.iter().map(|a| (*a).to_owned()).collect(),
        }
    }

    /// How a refusal names it: `XADD inventory:{001}:ledger`; a script call with the keys it
    /// declares.
    pub fn describe(&self) -> String {
        match (self.command, self.args.first()) {
            ("EVALSHA" | "EVAL", _) => match self.args.get(2..).unwrap_or_default() {
                [key] => format!("{} with the key {key}", self.command),
                keys => format!(
                    "{} with the {} keys of the item together",
                    self.command,
                    keys.len()
                ),
            },
            (command, Some(first)) => format!("{command} {first}"),
            (command, None) => command.to_owned(),
        }
    }
}

/// Whether `store` takes writes now, and which of `needs` its user may not run, asked
/// without running any of them ([`Store::writable`]): the first one refused, described; a
/// refusal of the probe's own script is one of `EVALSHA` or `SCRIPT LOAD`. Redis's refusal
/// of writes (`READONLY`, `NOREPLICAS`...) and a Redis that does not answer are the error.
pub async fn refused(store: &Store, needs: &[Need]) -> RedisResult<Option<String>> {
    let checks: Vec<(&str, &[String])> = needs
        .iter()
        .map(|n| (n.command, n.args.as_slice()))
        .collect();
    match store.writable(&checks).await {
        Ok(refused) => Ok(refused.map(|i| needs[i].describe())),
        Err(e) if crate::store::is_command_refused(&e) => Ok(Some(SCRIPTS_REFUSED.to_owned())),
        Err(e) => Err(e),
    }
}

/// How the instance reaches Redis, as far as the commands sent depend on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reach {
    pub wait: WaitMode,
    /// `REDIS_CONNECTION=pool`: deadpool-redis checks a connection out with `PING`, and
    /// an `optimistic` sale's connection goes back after `UNWATCH`.
    pub pooled: bool,
    /// `REPLICA_ACKS` above 0: every write is followed by `WAIT`.
    pub acks: bool,
}

/// Every command a sale of `strategy` may send to the stock's Redis (the server of `keys`),
/// with its key. `inbox` is this instance's hand-off inbox. A quorum lock's own commands go
/// to the lock nodes: [`node_needs`].
pub fn needs(strategy: Strategy, keys: &Keys, inbox: &str, reach: Reach) -> Vec<Need> {
    let mut out = Vec::new();
    let mut add = |command: &'static str, args: &[&str]| out.push(Need::new(command, args));
    let claim = keys.idempotency("acl-check");
    let mut item_keys = script_keys(keys);
    // A sale without a key declares the key prefix alone to its write script.
    item_keys.extend([claim.clone(), keys.idempotency(""), inbox.to_owned()]);
    let declared: Vec<&str> = item_keys.iter().map(String::as_str).collect();
    let count = declared.len().to_string();
    // Every sale runs scripts, and loads them again after Redis lost its script cache. Each
    // key a script declares alone first, so that a refusal names it; then together, as a
    // script declares them (a user whose rights are split among selectors may have each
    // and not all at once).
    for key in &declared {
        add("EVALSHA", &[SHA, "1", key]);
    }
    let mut evalsha = vec![SHA, count.as_str()];
    evalsha.extend(&declared);
    add("EVALSHA", &evalsha);
    add("SCRIPT", &["LOAD", "return 1"]);
    if reach.pooled {
        add("PING", &[]);
    }
    if reach.acks {
        add("WAIT", &["1", "0"]);
    }
    // An Idempotency-Key: the claim, its extension, its outcome (any sale may carry one).
    add("SET", &[&claim, "x"]);
    add("GET", &[&claim]);
    add("PEXPIRE", &[&claim, "1"]);
    add("DEL", &[&claim]);
    // Whether the item is stocked, at its first sale.
    add("EXISTS", &[&keys.stock]);
    // The write (`lua/sell.lua`), which checks these itself before writing anything.
    add("GET", &[&keys.stock]);
    add("GET", &[&keys.initial]);
    add("XADD", &[&keys.ledger, "MAXLEN", "~", "1", "*", "sale", ""]);
    add("SETBIT", &[&keys.sold, "0", "1"]);
    add("HINCRBY", &[&keys.duplicates, "0", "1"]);
    add("HSET", &[&keys.duplicates, "0", "2"]);
    add("HEXISTS", &[&keys.duplicates, "0"]);
    match strategy {
        Strategy::Atomic => {
            add("DECRBY", &[&keys.stock, "1"]);
            add("INCRBY", &[&keys.lockfree_writes, "1"]);
            add("INCRBY", &[&keys.sales, "1"]);
            return out;
        }
        Strategy::Optimistic => {
            add(
                "WATCH",
                &[
                    &keys.stock,
                    &keys.lockfree_writes,
                    &keys.single_node_writes,
                    &keys.quorum_writes,
                ],
            );
            for command in ["MULTI", "EXEC", "UNWATCH"] {
                add(command, &[]);
            }
            add("GET", &[&keys.lockfree_writes]);
            add("GET", &[&keys.single_node_writes]);
            add("GET", &[&keys.quorum_writes]);
            add("SET", &[&keys.stock, "0"]);
            add("INCR", &[&keys.lockfree_writes]);
            add("INCR", &[&keys.sales]);
            return out;
        }
        _ => {}
    }
    // A sale under a lock (or none): the read (`lua/read_stock.lua`), then the write.
    let lock = match strategy {
        Strategy::Redis(lock) => Some(lock),
        _ => None,
    };
    let quorum = lock.is_some_and(|l| l.info().quorum);
    let fenced = lock.is_some_and(|l| l.info().fenced);
    let (this_writes, other_writes, unfenced_reads, seen, other_seen) = if quorum {
        (
            &keys.quorum_writes,
            &keys.single_node_writes,
            &keys.quorum_unfenced_reads,
            &keys.quorum_fence_seen,
            &keys.fence_seen,
        )
    } else {
        (
            &keys.single_node_writes,
            &keys.quorum_writes,
            &keys.single_node_unfenced_reads,
            &keys.fence_seen,
            &keys.quorum_fence_seen,
        )
    };
    add("GET", &[&keys.lockfree_writes]);
    add("GET", &[this_writes]);
    add("GET", &[other_writes]);
    add("SET", &[&keys.stock, "0"]);
    add("INCR", &[&keys.sales]);
    add("INCR", &[this_writes]);
    if fenced {
        add("GET", &[seen]);
        add("SET", &[seen, "0"]);
        add("GET", &[other_seen]);
        add("GET", &[unfenced_reads]);
        // Tokens are drawn on the stock's Redis, lifted to its clock (`lua/fence_floor.lua`).
        add("INCR", &[&keys.fence]);
        add("INCRBY", &[&keys.fence, "1"]);
        add("GET", &[&keys.fence]);
        add("SET", &[&keys.fence, "0"]);
        add("TIME", &[]);
    } else {
        add("INCR", &[unfenced_reads]);
    }
    if let Some(lock) = lock.filter(|l| !l.info().quorum) {
        single_node_lock(&mut add, lock, keys, inbox, reach.wait);
    }
    out
}

/// The commands of a single-node lock held on the stock's Redis: taking it, renewing it,
/// releasing it and announcing the release, and waiting for it in `wait` mode.
fn single_node_lock(
    add: &mut impl FnMut(&'static str, &[&str]),
    lock: RedisLock,
    keys: &Keys,
    inbox: &str,
    wait: WaitMode,
) {
    let key = keys.lock.as_str();
    add("PTTL", &[key]);
    add("DEL", &[key]);
    let hash = super::handoff_shape(lock).is_some_and(|shape| shape != "string");
    match lock {
        RedisLock::Setnx | RedisLock::SetnxTtl | RedisLock::OwnerCheck | RedisLock::LuaRelease => {
            add("SET", &[key, "x"]);
        }
        _ => {}
    }
    if matches!(lock, RedisLock::OwnerCheck | RedisLock::LuaRelease) || hash {
        add("GET", &[key]);
    }
    if lock == RedisLock::LuaRelease || hash {
        add("PEXPIRE", &[key, "1"]);
    }
    if hash {
        add("TYPE", &[key]);
        add("HEXISTS", &[key, "x"]);
        add("HINCRBY", &[key, "x", "1"]);
    }
    // Every release announces itself: the signal list, and the channel.
    add("DEL", &[&keys.signal]);
    add("RPUSH", &[&keys.signal, "x"]);
    add(keys.publish(), &[&keys.released, "x"]);
    match wait {
        WaitMode::Spin => {}
        WaitMode::Pubsub => add("SUBSCRIBE", &[&keys.released]),
        WaitMode::Notify => {
            add("BLPOP", &[inbox, &keys.signal, "0"]);
            add("LPUSH", &[&keys.signal, "x"]);
        }
    }
    // The release of a lock that can be handed over looks for a waiter queued by any
    // instance, whatever this one's wait mode.
    if super::handoff_shape(lock).is_some() {
        hand_off_queue(add, lock, keys, inbox);
    }
}

/// The queue of a lock handed over by its release (`lua/lock_queued.lua`,
/// `lua/hand_off.lua`).
fn hand_off_queue(
    add: &mut impl FnMut(&'static str, &[&str]),
    lock: RedisLock,
    keys: &Keys,
    inbox: &str,
) {
    let key = keys.lock.as_str();
    add("TIME", &[]);
    add("GET", &[key]);
    add("SET", &[key, "x"]);
    add("PEXPIRE", &[key, "1"]);
    if super::handoff_shape(lock) != Some("string") {
        add("HSET", &[key, "x", "1"]);
    }
    let (queue, entries, inboxes) = (&keys.queue, &keys.queue_entries, &keys.queue_inboxes);
    add("ZADD", &[queue, "1", "x"]);
    add("ZREM", &[queue, "x"]);
    add("ZRANGE", &[queue, "0", "0"]);
    add("ZPOPMIN", &[queue, "1"]);
    add("PEXPIRE", &[queue, "1"]);
    for command in ["HSET", "HGET", "HDEL", "HEXISTS"] {
        add(command, &[entries, "x", "1"]);
    }
    add("PEXPIRE", &[entries, "1"]);
    for command in ["HINCRBY", "HDEL", "HEXISTS"] {
        add(command, &[inboxes, "x", "1"]);
    }
    add("HLEN", &[inboxes]);
    add("PEXPIRE", &[inboxes, "1"]);
    add("RPUSH", &[inbox, "x"]);
    add("LRANGE", &[inbox, "0", "-1"]);
    add("LREM", &[inbox, "1", "x"]);
    add("PEXPIRE", &[inbox, "1"]);
}

/// Every command a quorum sale sends to one lock node (`keys` are the node's): the vote
/// (`SET NX PX` with the key's `PTTL`), its extension and its release (an `EVAL` of its
/// own, which needs no script loaded on a node that restarted).
pub fn node_needs(keys: &Keys) -> Vec<Need> {
    let key = keys.lock.as_str();
    vec![
        Need::new("EVALSHA", &[SHA, "1", key]),
        Need::new("EVAL", &["return 1", "1", key]),
        Need::new("SCRIPT", &["LOAD", "return 1"]),
        Need::new("SET", &[key, "x"]),
        Need::new("PTTL", &[key]),
        Need::new("GET", &[key]),
        Need::new("PEXPIRE", &[key, "1"]),
        Need::new("DEL", &[key]),
    ]
}

/// The keys the item's scripts declare (an `EVALSHA` is checked against each).
fn script_keys(keys: &Keys) -> Vec<String> {
    [
        &keys.stock,
        &keys.initial,
        &keys.ledger,
        &keys.sales,
        &keys.sold,
        &keys.duplicates,
        &keys.lockfree_writes,
        &keys.single_node_writes,
        &keys.quorum_writes,
        &keys.single_node_unfenced_reads,
        &keys.quorum_unfenced_reads,
        &keys.fence,
        &keys.fence_seen,
        &keys.quorum_fence_seen,
        &keys.lock,
        &keys.signal,
        &keys.queue,
        &keys.queue_entries,
        &keys.queue_inboxes,
    ]
    .into_iter()
    .cloned()
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reach() -> Reach {
        Reach {
            wait: WaitMode::Notify,
            pooled: false,
            acks: false,
        }
    }

    #[test]
    fn every_strategy_needs_the_write_and_the_ones_with_a_redis_lock_need_it_too() {
        let keys = Keys::new("001");
        for strategy in Strategy::ALL {
            let needs = needs(strategy, &keys, "inbox", reach());
            let has = |d: &str| needs.iter().any(|n| n.describe() == d);
            assert!(has("XADD inventory:{001}:ledger"), "{strategy}");
            assert!(has("SETBIT inventory:{001}:sold"), "{strategy}");
            let single_node_lock = matches!(strategy, Strategy::Redis(l) if !l.info().quorum);
            assert_eq!(
                has("PTTL inventory:{001}:lock"),
                single_node_lock,
                "{strategy}"
            );
            assert_eq!(
                has("TIME"),
                strategy.info().fenced
                    || matches!(strategy,
                Strategy::Redis(l) if super::super::handoff_shape(l).is_some()),
                "{strategy}"
            );
        }
    }

    #[test]
    fn the_wait_mode_decides_how_a_busy_lock_is_waited_for() {
        let keys = Keys::new("001");
        let fenced = Strategy::Redis(RedisLock::Fenced);
        let with = |wait| {
            needs(fenced, &keys, "inbox", Reach { wait, ..reach() })
                .iter()
                .map(Need::describe)
                .collect::<Vec<_>>()
        };
        let waits = |wait, how: &str| with(wait).iter().any(|d| d.starts_with(how));
        assert!(waits(WaitMode::Notify, "BLPOP") && !waits(WaitMode::Notify, "SUBSCRIBE"));
        assert!(waits(WaitMode::Pubsub, "SUBSCRIBE") && !waits(WaitMode::Pubsub, "BLPOP"));
        assert!(!waits(WaitMode::Spin, "SUBSCRIBE") && !waits(WaitMode::Spin, "BLPOP"));
        // Its release hands the lock to a waiter any instance queued, whatever the mode.
        for wait in [WaitMode::Notify, WaitMode::Pubsub, WaitMode::Spin] {
            assert!(
                waits(wait, "ZPOPMIN inventory:{001}:lock:queue"),
                "{wait:?}"
            );
        }
    }
}

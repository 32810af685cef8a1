//! The catalogue of strategies: their stable names, the tutorial versions they reproduce,
//! and the table `GET /strategies` serves (what each fixes, what it still gets wrong, and the
//! properties the rest of the service reads: whether it renews, fences, checks the owner on
//! release, and is safe across instances).
//!
//! It is data only, so everything else (the locks, the sale, the metrics, the HTTP layer,
//! the load test) may depend on it without depending on each other. The locks themselves are
//! in `lock/`, one file per strategy.

use std::fmt;
use std::str::FromStr;

use serde::Serialize;
use utoipa::ToSchema;

/// A way of guarding the sale, by its stable name (`GET /strategies` lists them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Strategy {
    None,
    Local,
    Redis(RedisLock),
    Optimistic,
    Atomic,
}

/// The strategies whose lock lives in Redis, and so is shared by every instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RedisLock {
    Setnx,
    SetnxTtl,
    OwnerCheck,
    LuaRelease,
    Reentrant,
    Watchdog,
    Fenced,
    Redlock,
    RedlockFenced,
}

/// One row of the strategy table: what the strategy is, and what it still gets wrong.
#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
#[schema(example = json!({"name": "setnx-ttl", "aliases": ["v4"], "seed": "v4",
    "protocol": "SET NX PX ttl, DEL to release",
    "fixes": "a crashed holder no longer blocks every later sale: the key expires",
    "flaw": "work longer than the TTL: the late holder DELs someone else's lock",
    "reentrant": false, "renews": false, "fenced": false, "release_checks_owner": false, "quorum": false,
    "distributed": true}))]
pub struct StrategyInfo {
    pub name: &'static str,
    /// Other names accepted for it (the tutorial's version numbers).
    pub aliases: &'static [&'static str],
    /// The tutorial version it reproduces, or `beyond`.
    pub seed: &'static str,
    pub protocol: &'static str,
    pub fixes: &'static str,
    /// The flaw it exists to show.
    pub flaw: &'static str,
    /// A nested acquire by the same sale succeeds.
    pub reentrant: bool,
    /// The lease is renewed while the lock is held.
    pub renews: bool,
    /// The stock write checks a fencing token.
    pub fenced: bool,
    /// The release deletes the lock only for its owner, in one atomic step.
    pub release_checks_owner: bool,
    /// The lock is held by a majority of the independent nodes of `LOCK_NODES`.
    pub quorum: bool,
    /// Safe across instances (the lock, or the sale itself, lives in Redis).
    pub distributed: bool,
}

impl Strategy {
    /// Every strategy, in the order of the story.
    pub const ALL: [Strategy; 13] = [
        Strategy::None,
        Strategy::Local,
        Strategy::Redis(RedisLock::Setnx),
        Strategy::Redis(RedisLock::SetnxTtl),
        Strategy::Redis(RedisLock::OwnerCheck),
        Strategy::Redis(RedisLock::LuaRelease),
        Strategy::Redis(RedisLock::Reentrant),
        Strategy::Redis(RedisLock::Watchdog),
        Strategy::Redis(RedisLock::Fenced),
        Strategy::Redis(RedisLock::Redlock),
        Strategy::Redis(RedisLock::RedlockFenced),
        Strategy::Optimistic,
        Strategy::Atomic,
    ];

    pub fn info(self) -> &'static StrategyInfo {
        match self {
            Strategy::None => &NONE,
            Strategy::Local => &LOCAL,
            Strategy::Redis(lock) => lock.info(),
            Strategy::Optimistic => &OPTIMISTIC,
            Strategy::Atomic => &ATOMIC,
        }
    }

    pub fn name(self) -> &'static str {
        self.info().name
    }

    /// Every accepted spelling: the names, then the aliases.
    pub fn accepted_names() -> Vec<&'static str> {
        let names = Self::ALL.iter().map(|s| s.name());
        let aliases = Self::ALL
            .iter()
            .flat_map(|s| s.info().aliases.iter().copied());
        let mut all: Vec<_> = names.collect();
        let mut aliases: Vec<_> = aliases.collect();
        aliases.sort_unstable();
        all.extend(aliases);
        all
    }
}

impl RedisLock {
    pub fn info(self) -> &'static StrategyInfo {
        match self {
            RedisLock::Setnx => &SETNX,
            RedisLock::SetnxTtl => &SETNX_TTL,
            RedisLock::OwnerCheck => &OWNER_CHECK,
            RedisLock::LuaRelease => &LUA_RELEASE,
            RedisLock::Reentrant => &REENTRANT,
            RedisLock::Watchdog => &WATCHDOG,
            RedisLock::Fenced => &FENCED,
            RedisLock::Redlock => &REDLOCK,
            RedisLock::RedlockFenced => &REDLOCK_FENCED,
        }
    }
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Strategy {
    type Err = String;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        let name = name.trim();
        Self::ALL
            .into_iter()
            .find(|s| {
                let info = s.info();
                info.name.eq_ignore_ascii_case(name)
                    || info.aliases.iter().any(|a| a.eq_ignore_ascii_case(name))
            })
            .ok_or_else(|| {
                format!(
                    "unknown strategy {name:?}; valid: {}",
                    Self::accepted_names().join(", ")
                )
            })
    }
}

impl Serialize for Strategy {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

// The table, in the order of the story.

const NONE: StrategyInfo = StrategyInfo {
    name: "none",
    aliases: &[],
    seed: "-",
    protocol: "no lock: GET, work, SET",
    fixes: "nothing (the baseline)",
    flaw: "lost updates even on one instance: overlapping sales read the same stock",
    reentrant: true,
    renews: false,
    fenced: false,
    release_checks_owner: false,
    quorum: false,
    distributed: false,
};

const LOCAL: StrategyInfo = StrategyInfo {
    name: "local",
    aliases: &["v1", "v2"],
    seed: "v1/v2",
    protocol: "process-local mutex",
    fixes: "lost updates between sales of one instance",
    flaw: "correct on one instance, oversells behind nginx with two",
    reentrant: false,
    renews: false,
    fenced: false,
    release_checks_owner: false,
    quorum: false,
    distributed: false,
};

const SETNX: StrategyInfo = StrategyInfo {
    name: "setnx",
    aliases: &["v3"],
    seed: "v3",
    protocol: "SET NX (no TTL), wait, DEL",
    fixes: "oversell across instances: one lock in Redis for all of them",
    flaw: "a holder that crashes leaves the lock forever: every later sale times out",
    reentrant: false,
    renews: false,
    fenced: false,
    release_checks_owner: false,
    quorum: false,
    distributed: true,
};

const SETNX_TTL: StrategyInfo = StrategyInfo {
    name: "setnx-ttl",
    aliases: &["v4"],
    seed: "v4",
    protocol: "SET NX PX ttl, wait, DEL",
    fixes: "a crashed holder's lock expires after the TTL",
    flaw: "work longer than the TTL: the late holder DELs someone else's lock",
    reentrant: false,
    renews: false,
    fenced: false,
    release_checks_owner: false,
    quorum: false,
    distributed: true,
};

const OWNER_CHECK: StrategyInfo = StrategyInfo {
    name: "owner-check",
    aliases: &["v5"],
    seed: "v5",
    protocol: "SET NX PX ttl; GET == owner, then DEL",
    fixes: "the late holder no longer deletes a lock that is visibly someone else's",
    flaw: "check and delete are two commands: the lock can change hands between them",
    reentrant: false,
    renews: false,
    fenced: false,
    release_checks_owner: false,
    quorum: false,
    distributed: true,
};

const LUA_RELEASE: StrategyInfo = StrategyInfo {
    name: "lua-release",
    aliases: &["v6"],
    seed: "v6",
    protocol: "SET NX PX ttl; compare-and-delete in one Lua script",
    fixes: "the release can no longer delete a lock that changed hands",
    flaw: "not reentrant: a nested acquire by the same sale waits on itself",
    reentrant: false,
    renews: false,
    fenced: false,
    release_checks_owner: true,
    quorum: false,
    distributed: true,
};

const REENTRANT: StrategyInfo = StrategyInfo {
    name: "reentrant",
    aliases: &["v7"],
    seed: "v7",
    protocol: "hash owner -> count; HINCRBY lock/unlock in Lua",
    fixes: "a nested acquire by the same sale succeeds instead of waiting on itself",
    flaw: "no renewal: work longer than the TTL loses the lock",
    reentrant: true,
    renews: false,
    fenced: false,
    release_checks_owner: true,
    quorum: false,
    distributed: true,
};

const WATCHDOG: StrategyInfo = StrategyInfo {
    name: "watchdog",
    aliases: &["v8"],
    seed: "v8",
    protocol: "reentrant hash lock + owner-checked renewal every ttl/3",
    fixes: "work longer than the TTL keeps the lock; a lost lock is reported before the write",
    flaw: "a paused process (GC, SIGSTOP) cannot renew: the lock expires under it",
    reentrant: true,
    renews: true,
    fenced: false,
    release_checks_owner: true,
    quorum: false,
    distributed: true,
};

const FENCED: StrategyInfo = StrategyInfo {
    name: "fenced",
    aliases: &[],
    seed: "beyond",
    protocol: "watchdog + fencing token (INCR with the acquire), checked by the stock read and write",
    fixes: "a paused holder's late write is refused instead of applied",
    flaw: "protects only the writes that check the token; one Redis node is a single point of failure",
    reentrant: true,
    renews: true,
    fenced: true,
    release_checks_owner: true,
    quorum: false,
    distributed: true,
};

const REDLOCK: StrategyInfo = StrategyInfo {
    name: "redlock",
    aliases: &[],
    seed: "beyond",
    protocol: "SET NX PX on N independent nodes at once; held by a majority within the validity",
    fixes: "one Redis node is no longer a single point of failure: a minority may be down",
    flaw: "no fencing token: a holder paused past its validity writes late; a node restarted empty can grant the lock twice",
    reentrant: false,
    renews: true,
    fenced: false,
    release_checks_owner: true,
    quorum: true,
    distributed: true,
};

const REDLOCK_FENCED: StrategyInfo = StrategyInfo {
    name: "redlock-fenced",
    aliases: &[],
    seed: "beyond",
    protocol: "redlock + a fencing token from the stock's Redis, checked by the stock read and write",
    fixes: "the paused holder's late write, and a double grant after a node restart, are refused at the stock",
    flaw: "the token lives on the stock's single Redis: the sale is as available as that node",
    reentrant: false,
    renews: true,
    fenced: true,
    release_checks_owner: true,
    quorum: true,
    distributed: true,
};

const OPTIMISTIC: StrategyInfo = StrategyInfo {
    name: "optimistic",
    aliases: &[],
    seed: "beyond",
    protocol: "no lock: WATCH stock and write counters, GET, work, MULTI / sell script / EXEC on a pooled connection; a nil EXEC retries with jittered backoff",
    fixes: "no lock to lose, expire or wait for: a write whose read went stale is refused by Redis (nil EXEC), and the retry reads again",
    flaw: "cost, not safety: under contention most attempts are thrown away with their work, and a sale may give up (503 too_much_contention); one connection per sale in flight",
    reentrant: true,
    renews: false,
    fenced: false,
    release_checks_owner: false,
    quorum: false,
    distributed: true,
};

const ATOMIC: StrategyInfo = StrategyInfo {
    name: "atomic",
    aliases: &[],
    seed: "beyond",
    protocol: "no lock: one Lua script decrements if positive and records the sale",
    fixes: "the whole check-and-decrement runs as one step in Redis: one round trip",
    flaw: "none for a counter; cannot guard work done outside Redis",
    reentrant: true,
    renews: false,
    fenced: false,
    release_checks_owner: false,
    quorum: false,
    distributed: true,
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_and_alias_parses_back_to_its_strategy() {
        for strategy in Strategy::ALL {
            assert_eq!(strategy.name().parse::<Strategy>(), Ok(strategy));
            for alias in strategy.info().aliases {
                assert_eq!(alias.parse::<Strategy>(), Ok(strategy));
            }
        }
    }

    #[test]
    fn the_tutorial_versions_map_to_their_strategies() {
        let expect = [
            ("v1", "local"),
            ("v2", "local"),
            ("v3", "setnx"),
            ("v4", "setnx-ttl"),
            ("v5", "owner-check"),
            ("v6", "lua-release"),
            ("v7", "reentrant"),
            ("v8", "watchdog"),
        ];
        for (alias, name) in expect {
            assert_eq!(alias.parse::<Strategy>().map(Strategy::name), Ok(name));
        }
    }

    #[test]
    fn an_unknown_name_is_refused_with_every_valid_one() {
        let err = "redlokc".parse::<Strategy>().unwrap_err();
        for strategy in Strategy::ALL {
            assert!(err.contains(strategy.name()), "{err}");
        }
        assert!(err.contains("v8"), "{err}");
    }

    #[test]
    fn names_are_unique() {
        let mut names = Strategy::accepted_names();
        let count = names.len();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), count);
    }

    mod properties {
        use crate::strategy::Strategy;
        use proptest::prelude::{any, prop, prop_assert, prop_assert_eq, prop_oneof, proptest};

        proptest! {
            /// A name is accepted only when it is a strategy's name or alias (in any case,
            /// white space around it aside), and every refusal lists every accepted name.
            #[test]
            fn a_name_is_a_strategy_or_its_refusal_lists_them_all(
                name in prop_oneof![any::<String>(), "[ a-zA-Z-]{0,16}"],
            ) {
                match name.parse::<Strategy>() {
                    Ok(strategy) => {
                        let info = strategy.info();
                        let given = name.trim();
                        prop_assert!(
                            info.name.eq_ignore_ascii_case(given)
                                || info.aliases.iter().any(|a| a.eq_ignore_ascii_case(given)),
                            "{:?} read as {}", name, info.name
                        );
                    }
                    Err(refusal) => {
                        for accepted in Strategy::accepted_names() {
                            prop_assert!(refusal.contains(accepted), "{} lacks {}", refusal, accepted);
                        }
                    }
                }
            }

            /// Every accepted spelling, in any case and padded, reads as one strategy, and that
            /// strategy's own name reads back to it.
            #[test]
            fn every_accepted_spelling_reads_back(
                index in any::<prop::sample::Index>(),
                upper in any::<Vec<bool>>(),
                pad in "[ \t]{0,2}",
            ) {
                let names = Strategy::accepted_names();
                let name = index.get(&names);
                let cased: String = name
                    .chars()
                    .zip(upper.iter().copied().chain(std::iter::repeat(false)))
                    .map(|(c, up)| if up { c.to_ascii_uppercase() } else { c })
                    .collect();
                let strategy = format!("{pad}{cased}{pad}").parse::<Strategy>();
                prop_assert!(strategy.is_ok(), "{:?}", strategy);
                if let Ok(strategy) = strategy {
                    prop_assert_eq!(strategy.name().parse::<Strategy>(), Ok(strategy));
                }
            }
        }
    }
}

//! The locks, one file per strategy in the tutorial's order, each opening with what it is,
//! what it fixes and what it still gets wrong.
//!
//! Every Redis strategy has the same two verbs, `try_acquire` (one attempt, never waits) and
//! `release`; [`Locks`] adds what they share: waiting for a held lock ([`wait`]), renewing a
//! lease ([`renewal`]) and the per-process mutex of `local`. Dispatch is an exhaustive
//! `match`: a new strategy is a file, a variant and an arm.

mod atomic;
mod fenced;
mod handoff;
mod local;
mod lua_release;
mod none;
mod owner_check;
mod reentrant;
pub mod renewal;
mod setnx;
mod setnx_ttl;
pub mod wait;
mod watchdog;

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use redis::{RedisError, RedisResult};
use serde::Serialize;
use tokio::sync::{Mutex, OwnedMutexGuard};
use tokio::time::Instant;
use utoipa::ToSchema;

use crate::store::Store;
use renewal::Renewal;
use wait::WaitMode;
use wait::Waiter;

pub use atomic::sell as atomic_sell;

/// A way of guarding the sale, by its stable name (`GET /strategies` lists them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Strategy {
    None,
    Local,
    Redis(RedisLock),
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
}

/// One row of the strategy table: what the strategy is, and what it still gets wrong.
#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
#[schema(example = json!({"name": "setnx-ttl", "aliases": ["v4"], "seed": "v4",
    "protocol": "SET NX PX ttl, DEL to release",
    "fixes": "a crashed holder no longer blocks every later sale: the key expires",
    "flaw": "work longer than the TTL: the late holder DELs someone else's lock",
    "reentrant": false, "renews": false, "fenced": false, "distributed": true}))]
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
    /// Safe across instances (the lock, or the sale itself, lives in Redis).
    pub distributed: bool,
}

impl Strategy {
    /// Every strategy, in the order of the story.
    pub const ALL: [Strategy; 10] = [
        Strategy::None,
        Strategy::Local,
        Strategy::Redis(RedisLock::Setnx),
        Strategy::Redis(RedisLock::SetnxTtl),
        Strategy::Redis(RedisLock::OwnerCheck),
        Strategy::Redis(RedisLock::LuaRelease),
        Strategy::Redis(RedisLock::Reentrant),
        Strategy::Redis(RedisLock::Watchdog),
        Strategy::Redis(RedisLock::Fenced),
        Strategy::Atomic,
    ];

    pub fn info(self) -> &'static StrategyInfo {
        match self {
            Strategy::None => &none::INFO,
            Strategy::Local => &local::INFO,
            Strategy::Redis(lock) => lock.info(),
            Strategy::Atomic => &atomic::INFO,
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
    /// Whether its release deletes the lock only for its owner, in one atomic step.
    pub fn release_checks_owner(self) -> bool {
        match self {
            RedisLock::Setnx | RedisLock::SetnxTtl | RedisLock::OwnerCheck => false,
            RedisLock::LuaRelease
            | RedisLock::Reentrant
            | RedisLock::Watchdog
            | RedisLock::Fenced => true,
        }
    }

    pub fn info(self) -> &'static StrategyInfo {
        match self {
            RedisLock::Setnx => &setnx::INFO,
            RedisLock::SetnxTtl => &setnx_ttl::INFO,
            RedisLock::OwnerCheck => &owner_check::INFO,
            RedisLock::LuaRelease => &lua_release::INFO,
            RedisLock::Reentrant => &reentrant::INFO,
            RedisLock::Watchdog => &watchdog::INFO,
            RedisLock::Fenced => &fenced::INFO,
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

/// Why a lock could not be had.
#[derive(Debug)]
pub enum LockError {
    /// The lock stayed held for the whole wait budget.
    Timeout {
        waited: Duration,
    },
    Redis(RedisError),
}

impl From<RedisError> for LockError {
    fn from(e: RedisError) -> Self {
        LockError::Redis(e)
    }
}

/// The outcome of one attempt at a Redis lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attempt {
    /// Taken (or re-entered), with the fencing token drawn for it, if the strategy has one.
    Acquired { fence: Option<u64> },
    /// Held by someone else; `retry_in` is its remaining lease, `None` when it has none.
    Busy { retry_in: Option<Duration> },
}

impl Attempt {
    /// Reads the `PTTL` of a lock that could not be taken: -2 means it vanished meanwhile.
    fn busy(pttl: i64) -> Self {
        let retry_in = match pttl {
            -1 => None,
            ms => Some(Duration::from_millis(ms.max(0) as u64)),
        };
        Attempt::Busy { retry_in }
    }

    /// Reads the `{1, token}` / `{0, pttl}` reply of the lock scripts.
    fn from_script((acquired, value): (i64, i64), fenced: bool) -> Self {
        if acquired == 1 {
            Attempt::Acquired {
                fence: fenced.then_some(value.max(0) as u64),
            }
        } else {
            Attempt::busy(value)
        }
    }
}

/// What a release found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Released {
    /// The lock key is gone (for the naive strategies: *a* lock key, maybe someone else's).
    Freed,
    /// An outer level of a reentrant hold remains.
    StillHeld,
    /// The lock was no longer this owner's: it had expired, or been taken over.
    NotHeld,
}

/// What every strategy file needs: where the lock lives and how long its lease is.
#[derive(Clone)]
pub struct LockCx {
    pub store: Store,
    pub ttl: Duration,
    /// Widens the race window of `owner-check` on demand (fault scenarios only).
    pub release_gap: Duration,
    /// The newest fencing token this instance has drawn: if Redis loses its data (and its
    /// counter), the counter restarts above it instead of handing out old tokens again.
    pub newest_fence: Arc<std::sync::atomic::AtomicU64>,
}

/// A held lock. Release it with [`Locks::release`]; a guard that is dropped instead stops its
/// renewal, so a forgotten release expires with the lease rather than living forever
/// (except under `setnx`, whose key has no lease: that is its flaw).
pub struct Guard {
    strategy: Strategy,
    owner: Arc<str>,
    fence: Option<u64>,
    waited: Duration,
    hold: Hold,
}

enum Hold {
    Nothing,
    /// Held until the guard is released (or dropped).
    Local(OwnedMutexGuard<()>),
    Redis(RedisLock, Option<Renewal>),
}

impl Guard {
    pub fn fence(&self) -> Option<u64> {
        self.fence
    }

    pub fn waited(&self) -> Duration {
        self.waited
    }

    /// True once the renewal found the lock gone. Strategies without renewal never know.
    pub fn is_lost(&self) -> bool {
        matches!(&self.hold, Hold::Redis(_, Some(renewal)) if renewal.is_lost())
    }
}

/// The lock machinery of one instance.
pub struct Locks {
    cx: LockCx,
    local: Arc<Mutex<()>>,
    waiter: Waiter,
}

impl Locks {
    /// Starts listening for releases; must be called inside a Tokio runtime.
    pub fn new(store: Store, ttl: Duration, mode: WaitMode, release_gap: Duration) -> Self {
        let waiter = Waiter::listen(store.client().clone(), &store.keys, mode);
        Self {
            cx: LockCx {
                store,
                ttl,
                release_gap,
                newest_fence: Arc::default(),
            },
            local: Arc::default(),
            waiter,
        }
    }

    /// Acquire attempts this instance has sent to Redis so far (every strategy together).
    pub fn attempts(&self) -> u64 {
        self.waiter.attempts()
    }

    /// Takes the lock for `owner`, waiting until `deadline` at most. A `nested` acquire is
    /// the same sale entering again: it starts no second renewal.
    pub async fn acquire(
        &self,
        strategy: Strategy,
        owner: &Arc<str>,
        deadline: Instant,
        nested: bool,
    ) -> Result<Guard, LockError> {
        let started = Instant::now();
        let (fence, hold) = match strategy {
            Strategy::None | Strategy::Atomic => (None, Hold::Nothing),
            Strategy::Local => {
                let guard =
                    local::acquire(&self.local, deadline)
                        .await
                        .ok_or(LockError::Timeout {
                            waited: started.elapsed(),
                        })?;
                (None, Hold::Local(guard))
            }
            Strategy::Redis(lock) => {
                let hands_off = handoff::shape(lock).is_some();
                let attempt =
                    self.waiter
                        .until_acquired(owner, deadline, nested, hands_off, |queued| {
                            self.try_acquire(lock, owner, queued)
                        });
                let fence = match attempt.await {
                    Ok(fence) => {
                        // A token drawn by the release that handed the lock over.
                        if let Some(token) = fence {
                            self.cx.newest_fence.fetch_max(token, Ordering::AcqRel);
                        }
                        fence
                    }
                    Err(LockError::Redis(e)) => {
                        if !nested {
                            self.undo_unanswered_acquire(lock, owner);
                        }
                        return Err(LockError::Redis(e));
                    }
                    Err(e) => return Err(e),
                };
                let renewal = (lock.info().renews && !nested)
                    .then(|| Renewal::start(self.cx.clone(), owner.clone()));
                (fence, Hold::Redis(lock, renewal))
            }
        };
        let waited = started.elapsed();
        if !nested {
            self.cx.store.metrics().lock_wait(strategy, waited);
        }
        tracing::debug!(%strategy, %owner, fence, nested, waited_ms = waited.as_millis() as u64, "lock acquired");
        Ok(Guard {
            strategy,
            owner: owner.clone(),
            fence,
            waited,
            hold,
        })
    }

    async fn try_acquire(
        &self,
        lock: RedisLock,
        owner: &str,
        queued: Option<handoff::Queued>,
    ) -> RedisResult<Attempt> {
        let cx = &self.cx;
        if let Some(queued) = queued {
            return handoff::try_acquire(cx, lock, owner, queued).await;
        }
        match lock {
            RedisLock::Setnx => setnx::try_acquire(cx, owner).await,
            RedisLock::SetnxTtl => setnx_ttl::try_acquire(cx, owner).await,
            RedisLock::OwnerCheck => owner_check::try_acquire(cx, owner).await,
            RedisLock::LuaRelease => lua_release::try_acquire(cx, owner).await,
            RedisLock::Reentrant => reentrant::try_acquire(cx, owner).await,
            RedisLock::Watchdog => watchdog::try_acquire(cx, owner).await,
            RedisLock::Fenced => fenced::try_acquire(cx, owner).await,
        }
    }

    /// Releases the lock. Consuming the guard makes a second release impossible; the scripts
    /// that check the owner make a late one harmless.
    pub async fn release(&self, guard: Guard) -> RedisResult<Released> {
        let Guard {
            strategy,
            owner,
            hold,
            ..
        } = guard;
        let released = match hold {
            Hold::Nothing => Released::Freed,
            Hold::Local(mutex_guard) => {
                drop(mutex_guard);
                Released::Freed
            }
            Hold::Redis(lock, renewal) => {
                // Stop renewing first: a renewal racing the release is harmless (it only
                // extends a lease this owner still holds), but there is no point to it.
                drop(renewal);
                release_redis(&self.cx, lock, &owner).await?
            }
        };
        tracing::debug!(%strategy, %owner, ?released, "lock released");
        Ok(released)
    }

    /// An acquire that Redis did not answer in time may still run once Redis wakes up, and
    /// would then hold the lock for a sale that gave up. A release sent right behind it, on
    /// the same connection, runs after it and undoes it. The naive strategies' own releases
    /// delete blindly (a stray one could delete someone else's lock), so their acquires are
    /// undone with `lua-release`'s compare-and-delete of the same string key, which can only
    /// remove this very owner's lock.
    fn undo_unanswered_acquire(&self, lock: RedisLock, owner: &str) {
        let undo = if lock.release_checks_owner() {
            lock
        } else {
            RedisLock::LuaRelease
        };
        let (cx, owner) = (self.cx.clone(), owner.to_owned());
        tokio::spawn(async move {
            if let Err(e) = release_redis(&cx, undo, &owner).await {
                tracing::debug!(%owner, error = %e, "undoing an unanswered acquire failed; the lease ends it");
            }
        });
    }
}

async fn release_redis(cx: &LockCx, lock: RedisLock, owner: &str) -> RedisResult<Released> {
    match lock {
        RedisLock::Setnx => setnx::release(cx, owner).await,
        RedisLock::SetnxTtl => setnx_ttl::release(cx, owner).await,
        RedisLock::OwnerCheck => owner_check::release(cx, owner).await,
        RedisLock::LuaRelease => lua_release::release(cx, owner).await,
        RedisLock::Reentrant => reentrant::release(cx, owner).await,
        RedisLock::Watchdog => watchdog::release(cx, owner).await,
        RedisLock::Fenced => fenced::release(cx, owner).await,
    }
}

/// Deletes a plain lock key and announces it, in one round trip: the release of the naive
/// strategies, which never look at whose lock they delete.
async fn delete_and_announce(cx: &LockCx, owner: &str) -> RedisResult<Released> {
    let keys = &cx.store.keys;
    let (deleted, _): (i64, i64) = cx
        .store
        .call(|mut c| async move {
            redis::pipe()
                .del(&keys.lock)
                .publish(&keys.released, owner)
                .del(&keys.signal)
                .ignore()
                .rpush(&keys.signal, owner)
                .ignore()
                .query_async(&mut c)
                .await
        })
        .await?;
    Ok(if deleted == 1 {
        Released::Freed
    } else {
        Released::NotHeld
    })
}

/// `SET lock owner NX [PX ttl]` and, in the same round trip, the lock's `PTTL`, so a failed
/// attempt knows how long the holder may keep it.
async fn set_nx(cx: &LockCx, owner: &str, ttl: Option<Duration>) -> RedisResult<Attempt> {
    let key = &cx.store.keys.lock;
    let (set, pttl): (Option<String>, i64) = cx
        .store
        .call(|mut c| async move {
            let mut set = redis::cmd("SET");
            set.arg(key).arg(owner).arg("NX");
            if let Some(ttl) = ttl {
                set.arg("PX").arg(ttl.as_millis() as u64);
            }
            redis::pipe()
                .add_command(set)
                .pttl(key)
                .query_async(&mut c)
                .await
        })
        .await?;
    Ok(match set {
        Some(_) => Attempt::Acquired { fence: None },
        None => Attempt::busy(pttl),
    })
}

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
}

//! `redlock` and `redlock-fenced`: the `lua-release` lock taken on N independent Redis
//! nodes (`LOCK_NODES`) at once, held when a majority granted it within its validity.
//!
//! Fixes: every other lock here lives on one Redis, so losing that node stops every sale
//! (or, with replication, a failover can hand the lock out twice). With N nodes, any
//! minority may be down, slow or cut off and the lock still works.
//!
//! How: the same owner value goes to every node at once (`SET NX PX`), each call bounded by
//! a per-node timeout far below the lease, so one slow node cannot eat the validity. The
//! lock is held when N/2+1 nodes granted it and `lease - time spent - drift` is still
//! positive; otherwise it is given back on *every* node (a grant whose answer was lost may
//! still have landed) and the sale retries after a random pause, so that competing
//! acquirers do not keep splitting the votes. Releases and renewals are owner-checked on
//! every node; a renewal counts only when a majority extended.
//!
//! Still wrong (`redlock`): it issues no fencing token. A holder paused past its validity
//! (GC, `SIGSTOP`) wakes up believing it holds the lock and writes over the next holder's
//! sale. A node that granted the lock and restarts empty at once lets a second owner reach
//! a majority while the first still holds it: two holders. The Redlock page prescribes
//! restarting a node only after a lease has passed (or `appendfsync always`). A node frozen
//! with grants sent to it runs them when it wakes, after their sale gave up and gave them
//! back elsewhere: the lock is then held, by nobody, for a lease from that moment.
//!
//! `redlock-fenced` keeps the quorum lock and adds `fenced`'s token, drawn from the Redis
//! that keeps the stock (the lock nodes know nothing of tokens) and checked by the stock's
//! read and write. The paused holder's late write is then refused, and a double grant by a
//! restarted node cannot cost a sale either. What it still gets wrong: the token lives on
//! the stock's single Redis, so the stock is as available as that node.

use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures_util::future::join_all;
use redis::{ErrorKind, RedisError, RedisResult};
use tokio::time::{Instant, timeout};

use super::{Attempt, LockCx, RedisLockOps, Released};
use crate::metrics::Vote;
use crate::store::{Store, scripts};

pub(super) struct Redlock;
pub(super) struct RedlockFenced;

impl RedisLockOps for Redlock {
    async fn try_acquire(cx: &LockCx, owner: &str) -> RedisResult<Attempt> {
        quorum_acquire(cx, owner).await
    }

    async fn release(cx: &LockCx, owner: &str) -> RedisResult<Released> {
        release_everywhere(cx, owner).await
    }

    async fn renew(cx: &LockCx, owner: &str) -> RedisResult<bool> {
        extend_on_majority(cx, owner).await
    }

    /// Releases happen on other nodes than the stock's: waiters poll, with jitter.
    const WAKES_WAITERS: bool = false;
}

impl RedisLockOps for RedlockFenced {
    async fn try_acquire(cx: &LockCx, owner: &str) -> RedisResult<Attempt> {
        match quorum_acquire(cx, owner).await? {
            Attempt::Acquired { .. } => {}
            busy => return Ok(busy),
        }
        let newest = cx.newest_fence.load(Ordering::Acquire);
        let draw = &scripts::next_fence(&cx.store.keys, newest);
        let token: RedisResult<u64> = cx
            .store
            .call(|mut c| async move { draw.invoke_async(&mut c).await })
            .await;
        match token {
            Ok(token) => {
                cx.newest_fence.fetch_max(token, Ordering::AcqRel);
                Ok(Attempt::Acquired {
                    fence: Some(token),
                    behind: None,
                    fence_to: None,
                })
            }
            Err(e) => {
                // Held without a token is not held: give it back rather than sell unfenced.
                let _ = release_everywhere(cx, owner).await;
                Err(e)
            }
        }
    }

    async fn release(cx: &LockCx, owner: &str) -> RedisResult<Released> {
        release_everywhere(cx, owner).await
    }

    async fn renew(cx: &LockCx, owner: &str) -> RedisResult<bool> {
        extend_on_majority(cx, owner).await
    }

    const WAKES_WAITERS: bool = false;
}

/// The majority of `n` nodes.
pub fn quorum(n: usize) -> usize {
    n / 2 + 1
}

/// How long one node may take to answer one call: a twentieth of the lease, so that even a
/// few slow nodes leave most of the validity, but never below what a loaded machine needs
/// for one round trip.
fn node_timeout(ttl: Duration) -> Duration {
    (ttl / 20).clamp(Duration::from_millis(10), Duration::from_millis(250))
}

/// Clocks of different machines run at slightly different rates: the validity is shortened
/// by 1% of the lease plus 2 ms, as the Redlock algorithm prescribes.
fn drift(ttl: Duration) -> Duration {
    ttl / 100 + Duration::from_millis(2)
}

/// Runs `call` on every node at once, each bounded by the per-node timeout.
async fn on_every_node<'a, T, F, Fut>(cx: &'a LockCx, call: F) -> Vec<RedisResult<T>>
where
    F: Fn(&'a Store) -> Fut,
    Fut: Future<Output = RedisResult<T>>,
{
    let bound = node_timeout(cx.ttl);
    join_all(cx.nodes.iter().map(|node| {
        let call = call(node);
        async move {
            timeout(bound, call)
                .await
                .unwrap_or_else(|_| Err(node_timed_out()))
        }
    }))
    .await
}

/// A node slower than its share of the lease: busy, maybe, rather than down.
fn node_timed_out() -> RedisError {
    RedisError::from(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        "lock node did not answer within its share of the lease",
    ))
}

/// An attempt that fewer than a majority of the lock nodes answered within their bound,
/// without any of them refusing the connection ([`is_majority_unanswered`]).
fn majority_unanswered() -> RedisError {
    RedisError::from(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        MAJORITY_UNANSWERED,
    ))
}

const MAJORITY_UNANSWERED: &str =
    "a majority of the lock nodes did not answer within their share of the lease";

/// Whether `e` says an attempt went unanswered by a majority of the lock nodes: nobody can
/// win while that lasts, but a node that was only slow may answer the next attempt.
pub(super) fn is_majority_unanswered(e: &RedisError) -> bool {
    e.is_timeout() && e.to_string().contains(MAJORITY_UNANSWERED)
}

fn not_configured() -> RedisError {
    RedisError::from((
        ErrorKind::Client,
        "no lock nodes: set LOCK_NODES to use a quorum lock",
    ))
}

async fn quorum_acquire(cx: &LockCx, owner: &str) -> RedisResult<Attempt> {
    let n = cx.nodes.len();
    if n == 0 {
        return Err(not_configured());
    }
    let started = Instant::now();
    let votes = on_every_node(cx, |node| super::set_nx(node, owner, Some(cx.ttl))).await;
    let validity = cx.ttl.checked_sub(started.elapsed() + drift(cx.ttl));
    let metrics = cx.store.metrics();
    let (mut granted, mut busy, mut down, mut shortest_busy) = (0, 0, 0, None::<Duration>);
    let mut first_error = None;
    let mut maybe_ours = Vec::with_capacity(n);
    let mut labels = Vec::with_capacity(n);
    for (i, vote) in votes.into_iter().enumerate() {
        let vote = match vote {
            Ok(Attempt::Acquired { .. }) => {
                maybe_ours.push(i);
                granted += 1;
                Vote::Granted
            }
            Ok(Attempt::Busy { retry_in }) => {
                busy += 1;
                if let Some(left) = retry_in {
                    shortest_busy = Some(shortest_busy.map_or(left, |s| s.min(left)));
                }
                Vote::Busy
            }
            Err(e) => {
                maybe_ours.push(i);
                // A refused connection is a node down; a slow answer only a lost vote.
                if !e.is_timeout() {
                    down += 1;
                    first_error.get_or_insert(e);
                }
                Vote::Failed
            }
        };
        labels.push(match vote {
            Vote::Granted => "granted",
            Vote::Busy => "busy",
            Vote::Failed => "failed",
        });
        metrics.node_vote(i, vote);
    }
    let held = matches!(validity, Some(left) if granted >= quorum(n) && !left.is_zero());
    let votes = labels.join(" ");
    tracing::debug!(event = crate::events::Event::LockQuorum.name(), %owner, %votes, granted, nodes = n, held, validity_ms = validity.map(|v| v.as_millis() as u64), "lock quorum");
    match validity {
        Some(left) if held => {
            metrics.quorum(Some(left));
            return Ok(Attempt::Acquired {
                fence: None,
                behind: None,
                fence_to: None,
            });
        }
        _ => metrics.quorum(None),
    }
    // A minority, or a majority that came too late: give back every grant, including those
    // whose answer was lost, before anyone counts on them. Not on the nodes that said busy:
    // nothing of this attempt is there, and the holder may be this very sale entering again
    // (its outer hold must survive its nested attempt).
    let give_back = maybe_ours.into_iter().map(|i| &cx.nodes[i]);
    join_all(give_back.map(|node| unlock_on(node, owner, node_timeout(cx.ttl)))).await;
    if n - down < quorum(n) {
        // Too few nodes are up for any acquirer to win: fail fast (503), don't wait.
        return Err(first_error.unwrap_or_else(not_configured));
    }
    if granted + busy < quorum(n) {
        // Up, but too few answered in time for anyone to win this round: slow nodes, or
        // frozen ones. The caller tries again, and answers 503 once it has lasted.
        return Err(majority_unanswered());
    }
    // Busy: retry after a random pause (up to a twentieth of the lease, at most 20 ms), so
    // acquirers that split the votes do not split them again; never past the shortest
    // lease a busy node reported, when that is sooner.
    let jitter = Duration::from_millis(1 + RandomState::new().hash_one(started) % 20);
    let pause = jitter.min(cx.ttl / 20).max(Duration::from_millis(1));
    Ok(Attempt::Busy {
        retry_in: Some(shortest_busy.map_or(pause, |s| s.max(Duration::from_millis(1)).min(pause))),
    })
}

async fn unlock_on(node: &Store, owner: &str, bound: Duration) -> RedisResult<i64> {
    let unlock = &scripts::unlock_owned(&node.keys.lock, &node.keys, owner);
    let call = node.call(|mut c| async move { unlock.invoke_async::<i64>(&mut c).await });
    timeout(bound, call)
        .await
        .unwrap_or_else(|_| Err(node_timed_out()))
}

async fn release_everywhere(cx: &LockCx, owner: &str) -> RedisResult<Released> {
    if cx.nodes.is_empty() {
        return Err(not_configured());
    }
    let bound = node_timeout(cx.ttl);
    let results = join_all(cx.nodes.iter().map(|node| unlock_on(node, owner, bound))).await;
    let answered = results.iter().filter(|r| r.is_ok()).count();
    let deleted: i64 = results.iter().flatten().sum();
    if answered == 0
        && let Some(Err(e)) = results.into_iter().find(Result::is_err)
    {
        return Err(e);
    }
    // Freed when a majority gave it back; the nodes that did not answer let it expire.
    Ok(if deleted as usize >= quorum(cx.nodes.len()) {
        Released::Freed
    } else {
        Released::NotHeld
    })
}

/// `Ok(true)` when a majority extended the lease; `Ok(false)` when a majority says it is no
/// longer this owner's (lost for sure); an error while it is unknown, so the renewal retries.
async fn extend_on_majority(cx: &LockCx, owner: &str) -> RedisResult<bool> {
    let n = cx.nodes.len();
    if n == 0 {
        return Err(not_configured());
    }
    let ttl_ms = cx.ttl.as_millis() as u64;
    let results = on_every_node(cx, |node| async move {
        let extend = &scripts::extend_owned(&node.keys.lock, owner, ttl_ms);
        node.call(|mut c| async move { extend.invoke_async::<i64>(&mut c).await })
            .await
    })
    .await;
    let extended = results.iter().filter(|r| matches!(r, Ok(1))).count();
    let refused = results.iter().filter(|r| matches!(r, Ok(0))).count();
    if extended >= quorum(n) {
        Ok(true)
    } else if refused > n - quorum(n) {
        Ok(false)
    } else {
        Err(results
            .into_iter()
            .find_map(Result::err)
            .unwrap_or_else(not_configured))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_majority_is_more_than_half() {
        assert_eq!(
            [1, 2, 3, 4, 5, 6, 7].map(quorum),
            [1, 2, 2, 3, 3, 4, 4],
            "an even N needs as many as N+1 would: it adds a node without adding tolerance"
        );
    }

    #[test]
    fn each_node_gets_a_small_share_of_the_lease() {
        assert_eq!(
            node_timeout(Duration::from_secs(5)),
            Duration::from_millis(250)
        );
        assert_eq!(
            node_timeout(Duration::from_millis(500)),
            Duration::from_millis(25)
        );
        assert_eq!(
            node_timeout(Duration::from_millis(30)),
            Duration::from_millis(10)
        );
        assert!(drift(Duration::from_secs(5)) < Duration::from_millis(60));
    }
}

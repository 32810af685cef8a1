//! `redlock` and `redlock-fenced`: the `lua-release` lock taken on N independent Redis
//! nodes (`LOCK_NODES`) at once, held when a majority granted it within its validity.
//!
//! Fixes: every other lock here lives on one Redis, so losing that node stops every sale
//! (or, with replication, a failover can hand the lock out twice). With N nodes, any
//! minority may be down, slow or cut off and the lock still works.
//!
//! How: the same owner value goes to every node at once (`SET NX PX`), each call bounded by
//! a per-node timeout far below the lease, so one slow node cannot eat the validity, and
//! settled as soon as the answers decide it: a slow or frozen minority costs no time. The
//! lock is held when N/2+1 nodes granted it and `lease - time spent - drift` is still
//! positive; otherwise it is given back on *every* node but those that said busy (a grant
//! whose answer was lost or is late may still land) and the sale retries after a random
//! pause, so that competing acquirers do not keep splitting the votes. Give-backs and
//! releases are one owner-checked `EVAL` each (`lua/give_back.lua`), which needs no script
//! cached on the node and so runs right behind the grant it follows on that connection,
//! even on a node that was frozen with both queued. Renewals count only when a majority
//! extended.
//!
//! Still wrong (`redlock`): it issues no fencing token. A holder paused past its validity
//! (GC, `SIGSTOP`) wakes up believing it holds the lock and writes over the next holder's
//! sale. A node that granted the lock and restarts empty at once lets a second owner reach
//! a majority while the first still holds it: two holders. The Redlock page prescribes
//! restarting a node only after a lease has passed (or `appendfsync always`). A node frozen
//! so long that its connection's buffers fill (tens of thousands of calls queued) leaves
//! the calls past that point unsent: a grant sent before its give-back could not go out
//! would hold that node for a lease from the moment it wakes (one vote, not the lock,
//! unless a majority froze that long). The check before the write can only narrow the
//! window: a holder whose renewals go unanswered (a majority frozen) knows its lease lasts
//! from the sending of the last renewal that worked, and stops writing once that ran out
//! ([`super::renewal`]; it used to wait for the renewal's next tick, a third of a lease
//! later, and wrote over the next owner's sale in between), but a pause between the check
//! and the write still gives two writers.
//!
//! `redlock-fenced` keeps the quorum lock and adds `fenced`'s token, drawn from the Redis
//! that keeps the stock (the lock nodes know nothing of tokens) and checked by the stock's
//! read and write. The paused holder's late write is then refused, and a double grant by a
//! restarted node cannot cost a sale either. What it still gets wrong: the token lives on
//! the stock's single Redis, so the stock is as available as that node.

use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::Poll;
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::future::join_all;
use futures_util::stream::FuturesUnordered;
use redis::{ErrorKind, RedisError, RedisResult};
use tokio::sync::oneshot;
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
pub(crate) fn node_timeout(ttl: Duration) -> Duration {
    (ttl / 20).clamp(Duration::from_millis(10), Duration::from_millis(250))
}

/// Clocks of different machines run at slightly different rates: the validity is shortened
/// by 1% of the lease plus 2 ms, as the Redlock algorithm prescribes.
pub(super) fn drift(ttl: Duration) -> Duration {
    ttl / 100 + Duration::from_millis(2)
}

/// Runs `call` on every node at once, each bounded by the per-node timeout, and returns as
/// soon as `settled` says the answers so far decide the question (a majority granted, or
/// can no longer): a node that is slow or frozen then costs a sale nothing once the others
/// have answered, where waiting for every node cost it the node's whole bound, twice per
/// sale (the votes, then the release: 0.5 s a sale with the default lease and one node
/// frozen). A call still out then goes on by itself within its bound, as it must: what it
/// sent may still land, and whatever follows on that node goes out on the same connection,
/// behind it. Its slot is `None`.
async fn until_settled<T, F, Fut, A>(
    cx: &LockCx,
    call: F,
    answered: A,
    settled: impl Fn(&[Option<RedisResult<T>>]) -> bool,
) -> Vec<Option<RedisResult<T>>>
where
    T: Send + 'static,
    F: Fn(Arc<[Store]>, usize) -> Fut,
    Fut: Future<Output = RedisResult<T>> + Send + 'static,
    A: Fn(usize, &RedisResult<T>) + Clone + Send + 'static,
{
    let bound = node_timeout(cx.ttl);
    let mut sent = Vec::with_capacity(cx.nodes.len());
    let mut out: FuturesUnordered<_> = (0..cx.nodes.len())
        .map(|i| {
            let (call, answered) = (call(cx.nodes.clone(), i), answered.clone());
            let (polled, first_poll) = oneshot::channel::<()>();
            sent.push(first_poll);
            let task = tokio::spawn(async move {
                let mut call = std::pin::pin!(bounded(bound, call));
                let answer = match futures_util::poll!(call.as_mut()) {
                    Poll::Ready(answer) => answer,
                    Poll::Pending => {
                        drop(polled);
                        call.await
                    }
                };
                answered(i, &answer);
                answer
            });
            async move { (i, task.await) }
        })
        .collect();
    let mut answers: Vec<Option<RedisResult<T>>> = (0..cx.nodes.len()).map(|_| None).collect();
    while let Some((i, joined)) = out.next().await {
        answers[i] = Some(joined.unwrap_or_else(|e| {
            Err(RedisError::from((
                ErrorKind::Client,
                "a lock node call failed",
                e.to_string(),
            )))
        }));
        if settled(&answers) {
            break;
        }
    }
    // Not before every call still out has been polled once, and so handed to its node's
    // connection: a give-back sent next must go out behind the grant it undoes, not race a
    // task that has not started yet.
    for (answer, first_poll) in answers.iter().zip(sent) {
        if answer.is_none() {
            let _ = first_poll.await;
        }
    }
    answers
}

async fn bounded<T>(bound: Duration, call: impl Future<Output = RedisResult<T>>) -> RedisResult<T> {
    timeout(bound, call)
        .await
        .unwrap_or_else(|_| Err(node_timed_out()))
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
pub(super) fn majority_unanswered() -> RedisError {
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

/// Fewer lock nodes up than a quorum needs (`down` of `n` refused or dropped the
/// connection): nobody can win until enough are back. Still a refusal to the code that
/// handles it (nothing was sent to a node that is down), but worded so that the answer names
/// the lock nodes, not the stock's Redis, which may be fine.
pub(super) fn quorum_lost(down: usize, n: usize, first: Option<&RedisError>) -> RedisError {
    // A node that answered with a refusal (a replica's READONLY, a wrong password) is down
    // for the lock too, and its own words say why better than "refused the connection".
    let said = first
        .filter(|e| {
            e.code().is_some()
                || crate::store::is_auth_error(e)
                || crate::store::write_refusal(e).is_some()
        })
        .map(|e| format!(" (one answered: {e})"))
        .unwrap_or_default();
    RedisError::from(std::io::Error::new(
        std::io::ErrorKind::ConnectionRefused,
        format!(
            "{down} of the {n} {QUORUM_LOST}{said}, and a quorum lock needs {} of them",
            quorum(n)
        ),
    ))
}

const QUORUM_LOST: &str = "lock nodes (LOCK_NODES) refused or dropped the connection";

/// Fewer lock nodes than a quorum answered a check (`/ready`): `failed` names each node
/// that did not, with why.
pub(crate) fn quorum_unreached(failed: &[String], n: usize) -> RedisError {
    RedisError::from(std::io::Error::new(
        std::io::ErrorKind::ConnectionRefused,
        format!(
            "{} of the {n} {QUORUM_UNREACHED} ({}), and a quorum lock needs {} of them",
            failed.len(),
            failed.join(", "),
            quorum(n)
        ),
    ))
}

const QUORUM_UNREACHED: &str = "lock nodes (LOCK_NODES) did not answer";

/// Whether `e` says too few lock nodes are up for a quorum ([`quorum_lost`]).
pub(super) fn is_quorum_lost(e: &RedisError) -> bool {
    e.is_connection_refusal() && e.to_string().contains(QUORUM_LOST)
}

/// The error of a quorum sale that did not try: the sale standing in the line for the lock
/// nodes ahead of it found too few of them up, or a majority unanswering, while it waited.
pub(super) fn quorum_failed_while_waiting() -> RedisError {
    RedisError::from(std::io::Error::new(
        std::io::ErrorKind::ConnectionRefused,
        QUORUM_FAILED_WHILE_WAITING,
    ))
}

const QUORUM_FAILED_WHILE_WAITING: &str =
    "too few lock nodes (LOCK_NODES) answered for a quorum while this sale waited for the lock";

/// What a client is told when `e` is about the lock nodes rather than the stock's Redis:
/// too few of them up, or too few answering in time.
pub(crate) fn lock_nodes_failure(e: &RedisError) -> Option<String> {
    let text = e.to_string();
    [
        QUORUM_LOST,
        QUORUM_UNREACHED,
        MAJORITY_UNANSWERED,
        QUORUM_FAILED_WHILE_WAITING,
    ]
    .iter()
    .any(|marker| text.contains(marker))
    .then_some(text)
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
    let (ttl, metrics, shared): (_, _, Arc<str>) =
        (cx.ttl, cx.store.metrics_handle(), owner.into());
    let votes = until_settled(
        cx,
        |nodes, i| {
            let owner = shared.clone();
            async move { super::set_nx(&nodes[i], &owner, Some(ttl)).await }
        },
        move |i, vote| {
            metrics.node_vote(
                i,
                match vote {
                    Ok(Attempt::Acquired { .. }) => Vote::Granted,
                    Ok(Attempt::Busy { .. }) => Vote::Busy,
                    Err(_) => Vote::Failed,
                },
            )
        },
        |votes| {
            let granted = votes
                .iter()
                .filter(|v| matches!(v, Some(Ok(Attempt::Acquired { .. }))))
                .count();
            let against = votes.iter().flatten().count() - granted;
            granted >= quorum(n) || against > n - quorum(n)
        },
    )
    .await;
    let validity = cx.ttl.checked_sub(started.elapsed() + drift(cx.ttl));
    let metrics = cx.store.metrics();
    let (mut granted, mut busy, mut down, mut late) = (0, 0, 0, 0);
    let (mut shortest_busy, mut first_error) = (None::<Duration>, None);
    let mut maybe_ours = Vec::with_capacity(n);
    let mut labels = Vec::with_capacity(n);
    for (i, vote) in votes.into_iter().enumerate() {
        labels.push(match vote {
            Some(Ok(Attempt::Acquired { .. })) => {
                maybe_ours.push(i);
                granted += 1;
                "granted"
            }
            Some(Ok(Attempt::Busy { retry_in })) => {
                busy += 1;
                if let Some(left) = retry_in {
                    shortest_busy = Some(shortest_busy.map_or(left, |s| s.min(left)));
                }
                "busy"
            }
            Some(Err(e)) => {
                maybe_ours.push(i);
                // A refused connection is a node down; a slow answer only a lost vote.
                if !e.is_timeout() {
                    down += 1;
                    first_error.get_or_insert(e);
                }
                "failed"
            }
            // Still out when the others settled it: its grant may yet land.
            None => {
                maybe_ours.push(i);
                late += 1;
                "late"
            }
        });
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
        if let Some(e) = &first_error {
            tracing::debug!(error = %e, down, nodes = n, "lock nodes down");
        }
        return Err(quorum_lost(down, n, first_error.as_ref()));
    }
    if granted + busy + late < quorum(n) {
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
    bounded(bound, unlock(node, owner)).await
}

async fn unlock(node: &Store, owner: &str) -> RedisResult<i64> {
    let give_back = &scripts::give_back(&node.keys.lock, owner);
    node.call(|mut c| async move { give_back.query_async::<i64>(&mut c).await })
        .await
}

/// The answers that count towards `want` (`Ok(1)`: deleted, extended) and those that do not.
fn tally(answers: &[Option<RedisResult<i64>>]) -> (usize, usize) {
    let given = answers.iter().filter(|a| matches!(a, Some(Ok(1)))).count();
    (given, answers.iter().flatten().count() - given)
}

async fn release_everywhere(cx: &LockCx, owner: &str) -> RedisResult<Released> {
    let n = cx.nodes.len();
    if n == 0 {
        return Err(not_configured());
    }
    let shared: Arc<str> = owner.into();
    let results = until_settled(
        cx,
        |nodes, i| {
            let owner = shared.clone();
            async move { unlock(&nodes[i], &owner).await }
        },
        |_, _| {},
        |answers| {
            let (freed, not) = tally(answers);
            freed >= quorum(n) || not > n - quorum(n)
        },
    )
    .await;
    let (freed, _) = tally(&results);
    let answered: Vec<_> = results.into_iter().flatten().collect();
    if !answered.iter().any(Result::is_ok)
        && let Some(Err(e)) = answered.into_iter().next()
    {
        return Err(e);
    }
    // Freed when a majority gave it back; the nodes that did not answer let it expire.
    Ok(if freed >= quorum(n) {
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
    let shared: Arc<str> = owner.into();
    let results = until_settled(
        cx,
        |nodes, i| {
            let owner = shared.clone();
            async move {
                let node = &nodes[i];
                let extend = &scripts::extend_owned(&node.keys.lock, &owner, ttl_ms);
                node.call(|mut c| async move { extend.invoke_async::<i64>(&mut c).await })
                    .await
            }
        },
        |_, _| {},
        |answers| {
            let (extended, not) = tally(answers);
            extended >= quorum(n) || not > n - quorum(n)
        },
    )
    .await;
    let (extended, _) = tally(&results);
    let refused = results.iter().filter(|r| matches!(r, Some(Ok(0)))).count();
    if extended >= quorum(n) {
        Ok(true)
    } else if refused > n - quorum(n) {
        Ok(false)
    } else {
        Err(results
            .into_iter()
            .flatten()
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

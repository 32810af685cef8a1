//! Direct hand-off (`LOCK_WAIT=notify`, for the strategies whose release checks its owner:
//! `lua-release`, `reentrant`, `watchdog`, `fenced`). A sale that finds the lock held joins
//! a FIFO queue in Redis in the same script as its attempt (`lua/lock_queued.lua`); the
//! release script, instead of deleting the lock and signalling, writes the lock for the
//! first waiter whose entry is still valid (drawing its fencing token, for `fenced`) and
//! pushes a message onto that waiter's instance's inbox list, so the woken waiter already
//! owns the lock and skips the acquire round trip. How the waiting itself works (entry
//! refreshes, the inbox, a waiter that gives up) is in [`super::wait`].

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use redis::RedisResult;
use tokio::sync::watch;
use tokio::time::Instant;

use super::renewal::Lease;
use super::{Attempt, LockCx, RedisLock};
use crate::store::{Keys, scripts};

/// The longest lease a release writes when it hands the lock to a waiter
/// (`HANDED_LEASE_MS` in `lua/hand_off.lua`). A waiter whose entry was still valid may have
/// died since its last refresh (its instance killed): it then holds the item up this long,
/// not a whole lease (5 s by default), since nobody will release or extend what was handed
/// to it. The live waiter's instance extends the lease as soon as the hand-off reaches it.
pub(crate) const HANDED_LEASE: Duration = Duration::from_millis(1000);

/// The extension of a lock handed over with [`HANDED_LEASE`], started as soon as the hand-off
/// is heard of, beside the sale's first steps; the sale writes only once it said yes
/// ([`HandedLease::confirmed`]), so that a waiter that heard of its hand-off too late (its
/// process paused past the short lease, while someone else took the lock) never writes.
pub(crate) struct HandedLease {
    answer: watch::Receiver<Option<bool>>,
    /// Why the extension got no answer, when Redis did not give one (a pool exhausted, a
    /// timeout): the sale then says that, not that its lock was lost.
    failed: Arc<std::sync::OnceLock<redis::RedisError>>,
}

impl HandedLease {
    /// Extends `owner`'s handed lock to the full lease, in a task of its own. A yes extends
    /// `lease` too, the renewal's, if the strategy renews. Nothing to do when the lease is no
    /// longer than the handed one and nothing renews it; a renewing holder needs the call
    /// all the same: its lease counts from the call that set it, and when the release wrote
    /// the handed lock is known here only as "after this wait began", which may be a lease
    /// ago (every handed sale of a wait longer than the lease would be refused).
    pub(crate) fn start(
        cx: &LockCx,
        lock: RedisLock,
        owner: &Arc<str>,
        lease: Option<Arc<Lease>>,
    ) -> Option<Arc<Self>> {
        let shape = shape(lock)?;
        if cx.ttl <= HANDED_LEASE && lease.is_none() {
            return None;
        }
        let (tx, rx) = watch::channel(None);
        let failed = Arc::new(std::sync::OnceLock::new());
        let why = failed.clone();
        let (store, owner) = (cx.store.clone(), owner.clone());
        let ttl_ms = super::reentrant::millis(cx.ttl);
        tokio::spawn(async move {
            let extend = if shape == "string" {
                scripts::extend_owned(&store.keys.lock, &owner, ttl_ms)
            } else {
                scripts::renew(&store.keys.lock, &owner, ttl_ms)
            };
            let extend = &extend;
            let sent = Instant::now();
            let extended: RedisResult<i64> = store
                .call(|mut c| async move { extend.invoke_async(&mut c).await })
                .await;
            let held = matches!(extended, Ok(1));
            if let (true, Some(lease)) = (held, &lease) {
                lease.extended(sent);
            }
            if !held {
                store.metrics().lock_lost();
                tracing::warn!(event = crate::events::Event::LockLost.name(), %owner, reason = "a handed-over lock could not be extended", error = extended.as_ref().err().map(|e| e.to_string()), "lock lost");
                if let Err(e) = extended {
                    let _ = why.set(e);
                }
            }
            let _ = tx.send(Some(held));
        });
        Some(Arc::new(Self { answer: rx, failed }))
    }

    /// True once the extension failed: the short lease may have run out.
    pub(crate) fn is_lost(&self) -> bool {
        *self.answer.borrow() == Some(false)
    }

    /// The error the extension met, when it failed without Redis saying no.
    pub(crate) fn failure(&self) -> Option<redis::RedisError> {
        self.failed.get().cloned()
    }

    /// Whether the lease was extended; waits for the answer (one bounded call).
    pub(crate) async fn confirmed(&self) -> bool {
        let mut answer = self.answer.clone();
        matches!(
            answer.wait_for(Option::is_some).await.as_deref(),
            Ok(Some(true))
        )
    }
}

/// Where one instance's hand-offs arrive; unique per `Locks`.
pub(crate) fn inbox_key(keys: &Keys) -> String {
    keys.inbox(&uuid::Uuid::new_v4().simple().to_string())
}

/// How the lock is written for an owner of this strategy: the shape of the lock key, and
/// whether a token is drawn with it.
pub(crate) fn shape(lock: RedisLock) -> Option<&'static str> {
    super::handoff_shape(lock)
}

/// Where a waiter stands in the queue when it attempts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Not queued yet: take the lock, or join the queue.
    Try,
    /// Queued: take the lock if it was handed over or is free, else refresh the entry.
    Wait,
    /// Giving up: take the lock if it was handed over or is free, else leave the queue.
    Leave,
}

impl Phase {
    fn as_str(self) -> &'static str {
        match self {
            Phase::Try => "try",
            Phase::Wait => "wait",
            Phase::Leave => "leave",
        }
    }
}

/// What a queued attempt needs besides the lock and the owner.
#[derive(Debug, Clone)]
pub struct Queued {
    pub phase: Phase,
    pub inbox: std::sync::Arc<str>,
    /// How long the entry stays valid without a refresh.
    pub entry_ms: u64,
}

/// One attempt that joins (or stays in, or leaves) the queue when the lock is held.
pub(super) async fn try_acquire(
    cx: &LockCx,
    lock: RedisLock,
    owner: &str,
    q: Queued,
) -> RedisResult<Attempt> {
    let Some(shape) = shape(lock) else {
        unreachable!("only strategies with a shape wait in the queue")
    };
    let newest = cx.newest_fence.load(Ordering::Acquire);
    let attempt = &scripts::lock_queued(
        &cx.store.keys,
        &q.inbox,
        owner,
        shape,
        super::reentrant::millis(cx.ttl),
        newest,
        q.phase.as_str(),
        q.entry_ms,
        cx.fence_block,
    );
    let reply = cx
        .store
        .call(|mut c| async move { attempt.invoke_async(&mut c).await })
        .await?;
    let attempt = Attempt::from_script(reply, shape == "fenced");
    if let Attempt::Acquired {
        fence: Some(token),
        fence_to,
        ..
    } = attempt
    {
        cx.newest_fence
            .fetch_max(fence_to.unwrap_or(token).max(token), Ordering::AcqRel);
    }
    Ok(attempt)
}

/// A hand-off message: `<behind>|<token>|<last>|<passes>|<next_waited>|<shape>|<owner>`,
/// `behind` being how many waiters were still queued after this one, `token..=last` the
/// fencing tokens drawn for the new holder (its own, then those of the sales its tenure
/// passes the lock to), `passes` the releasing instance's number of critical sections per
/// tenure, in 256ths (0: none), and `next_waited` how long the next in line had waited, in
/// milliseconds (0: nobody). The two last numbers are absent in the messages of older
/// releases. The owner comes last: it is the only part that may itself hold a `|`.
pub(crate) struct Handed<'a> {
    pub behind: u64,
    pub token: u64,
    pub last: u64,
    pub tenure_mean: Option<u32>,
    pub next_waited: Option<Duration>,
    pub shape: &'a str,
    pub owner: &'a str,
}

impl<'a> Handed<'a> {
    pub(crate) fn parse(message: &'a str) -> Option<Self> {
        let mut rest = message;
        let mut field = || {
            let (head, tail) = rest.split_once('|')?;
            rest = tail;
            Some(head)
        };
        // Numbers up to the shape, which is a word: three, four or five of them.
        let mut numbers = [0u64; 5];
        let mut count = 0;
        let shape = loop {
            let f = field()?;
            if f.is_empty() || !f.bytes().all(|b| b.is_ascii_digit()) {
                break f;
            }
            *numbers.get_mut(count)? = f.parse().ok()?;
            count += 1;
        };
        if count < 3 || shape.is_empty() || rest.is_empty() {
            return None;
        }
        let [behind, token, last, passes, next_waited] = numbers;
        Some(Self {
            behind,
            token,
            last,
            tenure_mean: u32::try_from(passes).ok().filter(|p| *p > 0),
            next_waited: (next_waited > 0).then(|| Duration::from_millis(next_waited)),
            shape,
            owner: rest,
        })
    }

    pub(crate) fn fence(&self) -> Option<u64> {
        (self.shape == "fenced").then_some(self.token)
    }

    pub(crate) fn fence_to(&self) -> Option<u64> {
        (self.shape == "fenced").then_some(self.last.max(self.token))
    }
}

/// Releases a lock that was handed to a waiter who is gone (its sale was cancelled), so
/// that it passes on to the next waiter at once instead of at the end of its lease.
pub(crate) async fn release_orphan<C: redis::aio::ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    handed: &Handed<'_>,
) -> RedisResult<()> {
    // A handed-over lock has no outer levels, so no lease to restore for them.
    let passes = handed.tenure_mean.unwrap_or(0);
    let invocation = if handed.shape == "string" {
        scripts::unlock_owned(&keys.lock, keys, handed.owner, passes)
    } else {
        scripts::unlock_reentrant(keys, handed.owner, 1000, passes)
    };
    invocation.invoke_async::<i64>(conn).await.map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hand_off_message_reads_back() {
        let handed = Handed::parse("3|7|22|3840|61|fenced|host:1:order|x").expect("parses");
        assert_eq!(handed.behind, 3);
        assert_eq!(handed.token, 7);
        assert_eq!(handed.tenure_mean, Some(3840));
        assert_eq!(handed.next_waited, Some(Duration::from_millis(61)));
        assert_eq!(handed.shape, "fenced");
        assert_eq!(handed.owner, "host:1:order|x");
        assert_eq!(handed.fence(), Some(7));
        assert_eq!(handed.fence_to(), Some(22));
        let unfenced = Handed::parse("0|0|0|0|0|string|a").expect("parses");
        assert_eq!((unfenced.fence(), unfenced.fence_to()), (None, None));
        assert_eq!(
            (unfenced.tenure_mean, unfenced.next_waited),
            (None, None),
            "0 passes on nothing"
        );
        // From older releases: without the next one's wait, and without the mean either.
        let old = Handed::parse("3|7|22|3840|fenced|9|x").expect("parses");
        assert_eq!(
            (old.tenure_mean, old.next_waited, old.shape, old.owner),
            (Some(3840), None, "fenced", "9|x")
        );
        let older = Handed::parse("3|7|22|fenced|9|x").expect("parses");
        assert_eq!(
            (
                older.tenure_mean,
                older.next_waited,
                older.shape,
                older.owner
            ),
            (None, None, "fenced", "9|x")
        );
        assert!(
            Handed::parse("1|2|3|4|5|6|fenced|a").is_none(),
            "at most five numbers"
        );
        assert!(Handed::parse("1|2|3|4|fenced|").is_none(), "an owner");
        assert!(Handed::parse("1|2|3|4||a").is_none(), "a shape");
        assert!(Handed::parse("garbage").is_none());
        assert!(Handed::parse("7|fenced|a").is_none(), "a count first");
        assert!(
            Handed::parse("3|7|fenced|a").is_none(),
            "both ends of the block"
        );
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        /// A shape as a release script writes it: a word, never all digits, never a `|`.
        fn shape() -> impl Strategy<Value = String> {
            "[a-z][a-z0-9_-]{0,15}"
        }

        proptest! {
            /// The message comes from Redis: whatever it holds, reading it never panics, and
            /// what it reads always has a shape and an owner.
            #[test]
            fn any_message_reads_without_panicking(
                message in prop_oneof![any::<String>(), "[0-9|a-z]{0,24}", "([0-9]{0,21}[|]){0,7}[a-z|]{0,3}"],
            ) {
                if let Some(handed) = Handed::parse(&message) {
                    prop_assert!(!handed.shape.is_empty());
                    prop_assert!(!handed.owner.is_empty());
                    prop_assert!(!handed.shape.bytes().all(|b| b.is_ascii_digit()));
                }
            }

            /// Every message of the current form reads back field by field, whatever the
            /// owner holds (`|` included), and the fencing range never runs backwards.
            #[test]
            fn a_message_of_the_current_form_reads_back(
                behind in any::<u64>(),
                token in any::<u64>(),
                last in any::<u64>(),
                passes in any::<u32>(),
                next_waited in any::<u64>(),
                shape in shape(),
                owner in ".+",
            ) {
                let message = format!("{behind}|{token}|{last}|{passes}|{next_waited}|{shape}|{owner}");
                let handed = Handed::parse(&message).expect("a message of the current form");
                prop_assert_eq!(
                    (handed.behind, handed.token, handed.last, handed.shape, handed.owner),
                    (behind, token, last, shape.as_str(), owner.as_str())
                );
                prop_assert_eq!(handed.tenure_mean, (passes > 0).then_some(passes));
                prop_assert_eq!(
                    handed.next_waited,
                    (next_waited > 0).then(|| Duration::from_millis(next_waited))
                );
                match (handed.fence(), handed.fence_to()) {
                    (Some(from), Some(to)) => {
                        prop_assert_eq!(shape.as_str(), "fenced");
                        prop_assert!(to >= from, "the block runs forwards");
                    }
                    (None, None) => prop_assert_ne!(shape.as_str(), "fenced"),
                    other => prop_assert!(false, "a fence without its block: {other:?}"),
                }
            }

            /// Older releases' messages (without the next one's wait, or without the mean as
            /// well) read with those fields absent, never shifted into the others.
            #[test]
            fn an_older_message_reads_with_the_missing_fields_absent(
                behind in any::<u64>(),
                token in any::<u64>(),
                last in any::<u64>(),
                passes in 1..=u32::MAX,
                shape in shape(),
                owner in ".+",
                with_mean in any::<bool>(),
            ) {
                let message = if with_mean {
                    format!("{behind}|{token}|{last}|{passes}|{shape}|{owner}")
                } else {
                    format!("{behind}|{token}|{last}|{shape}|{owner}")
                };
                let handed = Handed::parse(&message).expect("an older form");
                prop_assert_eq!((handed.behind, handed.token, handed.last), (behind, token, last));
                prop_assert_eq!(handed.tenure_mean, with_mean.then_some(passes));
                prop_assert_eq!(handed.next_waited, None);
                prop_assert_eq!((handed.shape, handed.owner), (shape.as_str(), owner.as_str()));
            }
        }
    }
}

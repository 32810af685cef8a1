//! One `Script` per file in `lua/`: hashed once, then run by `EVALSHA` (loaded on first
//! `NOSCRIPT`, so a restarted Redis heals itself).

use super::*;

macro_rules! script {
    ($name:ident, $file:literal) => {
        static $name: LazyLock<Script> =
            LazyLock::new(|| Script::new(include_str!(concat!("../../lua/", $file))));
    };
}

/// A script that draws fencing tokens, with the floor it draws above in front
/// (`lua/fence_floor.lua`).
macro_rules! fencing_script {
    ($name:ident, $file:literal) => {
        static $name: LazyLock<Script> = LazyLock::new(|| {
            Script::new(concat!(
                include_str!("../../lua/fence_floor.lua"),
                include_str!(concat!("../../lua/", $file))
            ))
        });
    };
}

/// A release script with the hand-off function in front (`lua/hand_off.lua`), and the
/// fencing floor the hand-off draws above.
macro_rules! release_script {
    ($name:ident, $file:literal) => {
        static $name: LazyLock<Script> = LazyLock::new(|| {
            Script::new(concat!(
                include_str!("../../lua/fence_floor.lua"),
                include_str!("../../lua/hand_off.lua"),
                include_str!(concat!("../../lua/", $file))
            ))
        });
    };
}

script!(LOCK_REENTRANT, "lock_reentrant.lua");
fencing_script!(LOCK_FENCED, "lock_fenced.lua");

release_script!(UNLOCK_REENTRANT, "unlock_reentrant.lua");
release_script!(UNLOCK_OWNED, "unlock_owned.lua");
script!(RENEW, "renew.lua");
script!(READ_STOCK, "read_stock.lua");
script!(SELL, "sell.lua");
script!(RESET, "reset.lua");
script!(IDEMPOTENCY_SETTLE, "idempotency_settle.lua");
script!(EXTEND_OWNED, "extend_owned.lua");
script!(WRITABLE, "writable.lua");
fencing_script!(LOCK_QUEUED, "lock_queued.lua");
fencing_script!(NEXT_FENCE, "next_fence.lua");
fencing_script!(DRAW_FENCES, "draw_fences.lua");

// One builder per script: the only place that knows its KEYS and ARGV layout, used by
// the store, the locks and the Lua tests alike.

/// 0 when Redis takes writes now and the user may run each of `checks` (a command and its
/// arguments, key first), else the number (from 1) of the first one refused; Redis's refusal
/// of a write (`READONLY`, `NOREPLICAS`, `MISCONF`, `OOM`) as an error. Runs none of them.
pub fn writable<'a>(
    checks: impl IntoIterator<Item = (&'a str, &'a [String])>,
) -> ScriptInvocation<'static> {
    let mut i = WRITABLE.prepare_invoke();
    for (command, args) in checks {
        i.arg(args.len() + 1).arg(command).arg(args);
    }
    i
}

/// `{1, 0}` when taken or re-entered, `{0, pttl}` when another owner holds it.
pub fn lock_reentrant(lock: &str, owner: &str, ttl_ms: u64) -> ScriptInvocation<'static> {
    let mut i = LOCK_REENTRANT.key(lock);
    i.arg(owner).arg(ttl_ms);
    i
}

/// `{1, token}` when taken or re-entered (a fresh token, above `newest` if the counter
/// was lost), `{0, pttl}` when another owner holds it.
pub fn lock_fenced(
    keys: &Keys,
    owner: &str,
    ttl_ms: u64,
    newest: u64,
) -> ScriptInvocation<'static> {
    let mut i = LOCK_FENCED.key(&keys.lock);
    i.key(&keys.fence).arg(owner).arg(ttl_ms).arg(newest);
    i
}

/// 1 when the last hold was left (the lock is gone, or handed to the next queued
/// waiter), 0 when an outer hold remains, -1 when `owner` did not hold it.
pub fn unlock_reentrant(
    keys: &Keys,
    owner: &str,
    ttl_ms: u64,
    passes: u32,
) -> ScriptInvocation<'static> {
    let mut i = UNLOCK_REENTRANT.key(&keys.lock);
    i.key(&keys.signal)
        .key(&keys.queue)
        .key(&keys.queue_entries)
        .key(&keys.fence)
        .key(&keys.queue_inboxes)
        .arg(owner)
        .arg(ttl_ms)
        .arg(&keys.released)
        .arg(keys.publish())
        .arg(passes);
    i
}

/// Compare-and-delete of a string lock at `lock` (normally `keys.lock`), handing it to
/// the next queued waiter if there is one: 1 when released.
pub fn unlock_owned(
    lock: &str,
    keys: &Keys,
    owner: &str,
    passes: u32,
) -> ScriptInvocation<'static> {
    let mut i = UNLOCK_OWNED.key(lock);
    i.key(&keys.signal)
        .key(&keys.queue)
        .key(&keys.queue_entries)
        .key(&keys.fence)
        .key(&keys.queue_inboxes)
        .arg(owner)
        .arg(&keys.released)
        .arg(keys.publish())
        .arg(passes);
    i
}

/// Takes the lock, or joins (stays in, leaves, forgets) its queue of waiters: `{1, token,
/// instances behind}` when held, `{0, pttl}` when another owner holds it. See
/// `lua/lock_queued.lua`.
#[allow(clippy::too_many_arguments)]
pub fn lock_queued(
    keys: &Keys,
    inbox: &str,
    owner: &str,
    shape: &str,
    ttl_ms: u64,
    newest: u64,
    phase: &str,
    entry_ms: u64,
    fence_block: u64,
) -> ScriptInvocation<'static> {
    let mut i = LOCK_QUEUED.key(&keys.lock);
    i.key(&keys.fence)
        .key(&keys.queue)
        .key(&keys.queue_entries)
        .key(inbox)
        .key(&keys.queue_inboxes)
        .arg(owner)
        .arg(shape)
        .arg(ttl_ms)
        .arg(newest)
        .arg(phase)
        .arg(entry_ms)
        .arg(fence_block);
    i
}

/// 1 when `owner` still held the hash lock and its lease was extended.
pub fn renew(lock: &str, owner: &str, ttl_ms: u64) -> ScriptInvocation<'static> {
    let mut i = RENEW.key(lock);
    i.arg(owner).arg(ttl_ms);
    i
}

/// Compare-and-delete of a quorum lock's string key on one lock node, as one `EVAL` that
/// needs nothing cached there (`lua/give_back.lua` says why): 1 when deleted.
pub fn give_back(lock: &str, owner: &str) -> redis::Cmd {
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(include_str!("../../lua/give_back.lua"))
        .arg(1)
        .arg(lock)
        .arg(owner);
    cmd
}

/// 1 when `owner` still held the string lock at `lock` and its lease was extended.
pub fn extend_owned(lock: &str, owner: &str, ttl_ms: u64) -> ScriptInvocation<'static> {
    let mut i = EXTEND_OWNED.key(lock);
    i.arg(owner).arg(ttl_ms);
    i
}

/// The next fencing token, above `newest` even if the counter was lost.
pub fn next_fence(keys: &Keys, newest: u64) -> ScriptInvocation<'static> {
    let mut i = NEXT_FENCE.key(&keys.fence);
    i.arg(newest);
    i
}

/// The last of `count` fencing tokens drawn for `owner`'s held fenced lock (the block ends
/// there), or 0 when `owner` no longer holds it.
pub fn draw_fences(keys: &Keys, owner: &str, newest: u64, count: u64) -> ScriptInvocation<'static> {
    let mut i = DRAW_FENCES.key(&keys.lock);
    i.key(&keys.fence).arg(owner).arg(newest).arg(count);
    i
}

/// `{1, stock or -1, lock-free writes, other-lock writes, this-lock writes, token-less
/// reads}` (a reader without `fence` counts itself among the last), or `{0, newest token,
/// 0, 0, 0, 0}` for a stale `fence`, `{2, 0, 0, 0, 0, 0}` for one older than the other kind
/// of lock has seen.
pub fn read_stock(keys: &Keys, kind: LockKind, fence: Option<u64>) -> ScriptInvocation<'static> {
    let mut i = READ_STOCK.key(&keys.stock);
    i.key(keys.fence_seen_by(kind))
        .key(&keys.lockfree_writes)
        .key(keys.locked_writes(kind.other()))
        .key(keys.locked_writes(kind))
        .key(keys.fence_seen_by(kind.other()))
        .key(keys.unfenced_reads(kind))
        .arg(fence.map(|f| f.to_string()).unwrap_or_default());
    i
}

/// How a sale's write is checked: `Locked` carries what its read saw.
#[derive(Debug, Clone, Copy)]
pub enum SellMode {
    Atomic,
    /// Only inside a `MULTI` whose `WATCH` covers the stock and the write counters: the
    /// script writes the value the caller computed and checks nothing, the `WATCH` did.
    Optimistic {
        new_stock: i64,
    },
    Locked {
        new_stock: i64,
        fence: Option<u64>,
        seen: WritesSeen,
        /// The token of the sale the write's lock tenure passes to next, registered as read
        /// with the write ([`super::Store::record_sale_then_read`]).
        next_fence: Option<u64>,
    },
}

/// `{code, value}`; see [`super::Recorded`] for the codes. Sends only the keys and arguments
/// the mode reads: an `atomic` sale without a claim is 7 keys and 3 arguments, not 16.
pub fn sell(
    keys: &Keys,
    entry: &Entry<'_>,
    ledger_cap: u64,
    mode: SellMode,
) -> ScriptInvocation<'static> {
    let mode_name = match mode {
        SellMode::Atomic => "atomic",
        SellMode::Optimistic { .. } => "optimistic",
        SellMode::Locked { .. } => "locked",
    };
    let mut i = sell_keys(keys, mode_name, entry.head(), ledger_cap);
    // KEYS[8] and ARGV[4..=5] are the claim's; a mode that reads keys or arguments after
    // them (the locked mode's keys, the locked and optimistic modes' arguments) sends them
    // empty when there is no claim.
    let claimed = entry.claim.is_some();
    if claimed || matches!(mode, SellMode::Locked { .. }) {
        i.key(entry.claim_key(keys));
    }
    if claimed || !matches!(mode, SellMode::Atomic) {
        i.arg(entry.claim_marker()).arg(entry.claim_keep_ms());
    }
    match mode {
        SellMode::Atomic => {}
        SellMode::Optimistic { new_stock } => {
            i.arg(new_stock);
        }
        SellMode::Locked {
            new_stock,
            fence,
            seen,
            next_fence,
        } => {
            i.key(keys.fence_seen_by(seen.kind))
                .key(keys.locked_writes(seen.kind.other()))
                .key(keys.locked_writes(seen.kind))
                .arg(new_stock)
                .arg(fence.map(|f| f.to_string()).unwrap_or_default())
                .arg(seen.lockfree)
                .arg(seen.other_locks)
                .arg(next_fence.map(|f| f.to_string()).unwrap_or_default())
                .arg(
                    fence
                        .map(|_| seen.own_locks.to_string())
                        .unwrap_or_default(),
                );
            if fence.is_some() {
                i.key(keys.unfenced_reads(seen.kind))
                    .arg(seen.unfenced_reads);
            }
        }
    }
    i
}

/// Several `atomic` sales without a claim in one call: `heads` holds each sale's ledger
/// head ([`Entry::head`]), a line each, in the order they are to be sold. `{1, stock left
/// after the first}` or `{5, 0}`, `{4, 0}` for all of them (see [`super::Recorded::nth`]).
pub fn sell_atomic(keys: &Keys, heads: String, ledger_cap: u64) -> ScriptInvocation<'static> {
    sell_keys(keys, "atomic", heads, ledger_cap)
}

/// The keys and first arguments every mode of `sell.lua` reads.
fn sell_keys(keys: &Keys, mode: &str, head: String, ledger_cap: u64) -> ScriptInvocation<'static> {
    let mut i = SELL.key(&keys.stock);
    i.key(&keys.ledger)
        .key(&keys.sales)
        .key(&keys.sold)
        .key(&keys.duplicates)
        .key(&keys.lockfree_writes)
        .key(&keys.initial)
        .arg(mode)
        .arg(head)
        .arg(ledger_cap);
    i
}

/// 1 when the claim was still `marker`'s and was settled (kept with `outcome`, or freed
/// when `outcome` is empty).
pub fn idempotency_settle(
    key: &str,
    marker: &str,
    outcome: &str,
    keep_ms: u64,
) -> ScriptInvocation<'static> {
    let mut i = IDEMPOTENCY_SETTLE.key(key);
    i.arg(marker).arg(outcome).arg(keep_ms);
    i
}

/// Restocks; a lock without a lease gets `orphan_lease` (`lua/reset.lua`).
pub fn reset(keys: &Keys, stock: i64, orphan_lease: Duration) -> ScriptInvocation<'static> {
    let mut i = RESET.key(&keys.stock);
    i.key(&keys.initial)
        .key(&keys.ledger)
        .key(&keys.sales)
        .key(&keys.sold)
        .key(&keys.duplicates)
        .key(&keys.lock)
        .key(&keys.lockfree_writes)
        .arg(stock)
        .arg(orphan_lease.as_millis().max(1).to_string());
    i
}

//! `Idempotency-Key`: a retried sale returns the first result and never sells twice,
//! whichever instance the retry reaches.
//!
//! The first attempt claims the key in Redis with a pending marker (`SET NX GET`, one round
//! trip). Its write checks that the marker is still its own and replaces it with the sale
//! in the same script, so there is no moment at which the item is sold but the key does not
//! say so. A retry finds the sale (replayed, same order id), the marker (409 `in_progress`),
//! or a kept `sold_out`. An attempt that sold nothing for a passing reason (`lock_timeout`,
//! `lock_lost`, `stale_fence`) frees the key so that a retry tries again; one that cannot
//! know whether it sold (Redis stopped answering) leaves the marker to expire.

use std::time::Duration;

use serde::Deserialize;

use crate::sale::Sold;

/// How long the outcome of a sale stays replayable, unless configured otherwise.
pub const DEFAULT_KEEP: Duration = Duration::from_secs(24 * 60 * 60);
/// The pending marker outlives the attempt's own bounds (its wait budget and work) by this
/// much, so that it cannot expire under an attempt that is still running.
pub const PENDING_MARGIN: Duration = Duration::from_secs(30);
pub const MAX_KEY_LEN: usize = 128;

pub const INVALID_KEY: &str =
    "Idempotency-Key must be 1 to 128 letters, digits, '-', '_', '.' or ':'";

/// Keys become part of a Redis key name: a strict alphabet keeps them harmless.
pub fn validate(key: &str) -> Result<(), &'static str> {
    let valid = !key.is_empty()
        && key.len() <= MAX_KEY_LEN
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b));
    if valid { Ok(()) } else { Err(INVALID_KEY) }
}

pub fn pending_marker(order_id: &str) -> String {
    format!("pending:{order_id}")
}

/// What the kept value for `sold_out` is.
pub const SOLD_OUT: &str = "sold_out";

/// What an earlier attempt with the same key left.
#[derive(Debug, Clone, PartialEq)]
pub enum Prior {
    Sold(Sold),
    SoldOut,
    InProgress,
}

#[derive(Deserialize)]
struct LedgerEntry {
    order_id: String,
    instance: String,
    strategy: String,
    remaining: i64,
    fence: Option<u64>,
}

/// Reads what the key holds: `pending:<order id>`, `sold:<ledger entry>` or `sold_out`.
pub fn parse(value: &str) -> Prior {
    if value == SOLD_OUT {
        return Prior::SoldOut;
    }
    let entry = value
        .strip_prefix("sold:")
        .and_then(|json| serde_json::from_str::<LedgerEntry>(json).ok());
    match entry {
        Some(e) => Prior::Sold(Sold {
            sold: true,
            remaining: e.remaining,
            instance: e.instance,
            strategy: e.strategy,
            order_id: e.order_id,
            fence: e.fence,
            waited_ms: 0,
        }),
        // A pending marker, or a value this version does not know: never sell again on it.
        None => Prior::InProgress,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_outside_the_alphabet_are_refused() {
        assert!(validate("0f8c2a9e-3b1d-4a52-9c7e-2d1f0b6a8e41").is_ok());
        assert!(validate("order:42.retry_1").is_ok());
        for bad in ["", "a b", "a{b}", "a\nb", "ключ", &"k".repeat(129)] {
            assert!(validate(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_kept_sale_is_replayed_with_its_order_id() {
        let kept = r#"sold:{"order_id":"o-1","instance":"app2","strategy":"fenced","remaining":4,"fence":7}"#;
        let Prior::Sold(sold) = parse(kept) else {
            panic!("not a sale")
        };
        assert_eq!(
            (sold.order_id.as_str(), sold.remaining, sold.fence),
            ("o-1", 4, Some(7))
        );
        assert_eq!(parse("sold_out"), Prior::SoldOut);
        assert_eq!(parse("pending:o-2"), Prior::InProgress);
    }
}

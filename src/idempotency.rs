//! `Idempotency-Key`: a retried sale returns the first result and never sells twice,
//! whichever instance the retry reaches.
//!
//! The first attempt claims the key in Redis with a pending marker (`SET NX GET`, one round
//! trip). Its write checks that the marker is still its own and replaces it with the sale
//! in the same script, so there is no moment at which the item is sold but the key does not
//! say so. A retry finds the sale (replayed, same order id), the marker (409 `in_progress`),
//! or a kept `sold_out`. An attempt that sold nothing for a passing reason (`lock_timeout`,
//! `lock_lost`, `stale_fence`) frees the key so that a retry tries again; one that cannot
//! know whether it sold (Redis stopped answering) leaves the marker to run out.
//!
//! The marker has a short lease ([`CLAIM_LEASE`]) that its attempt extends while it runs,
//! as a lock's watchdog does: an instance killed or frozen mid-sale stops extending, and a
//! retry elsewhere sells once the lease has run out (it used to hear `in_progress` for the
//! wait budget, the work and 30 s more: about 41 s by default). The write's check of its
//! own marker is what keeps that safe: a frozen attempt that wakes after a retry took the
//! key finds the marker gone and writes nothing.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use serde::Deserialize;

/// How long the outcome of a sale stays replayable, unless configured otherwise.
pub const DEFAULT_KEEP: Duration = Duration::from_secs(24 * 60 * 60);
/// How long a pending marker lasts unless its attempt extends it (every third of this, while
/// it runs): how long a retry hears `in_progress` after the instance holding the key died.
/// As long as a lock's default lease: an instance frozen this long loses its locks too.
pub const CLAIM_LEASE: Duration = Duration::from_secs(5);
pub const MAX_KEY_LEN: usize = 128;

pub const INVALID_KEY: &str =
    "Idempotency-Key must be 1 to 128 letters, digits, '-', '_', '.' or ':'";

/// An `Idempotency-Key` as a client sent it, checked: it becomes part of a Redis key name,
/// and a strict alphabet keeps it harmless there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Key(String);

impl TryFrom<&str> for Key {
    type Error = &'static str;

    fn try_from(key: &str) -> Result<Self, Self::Error> {
        if crate::names::is_token(key, MAX_KEY_LEN, b"-_.:") {
            Ok(Self(key.to_owned()))
        } else {
            Err(INVALID_KEY)
        }
    }
}

impl Key {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A sale's hold on an idempotency key: the key holds `marker` while the sale runs, and
/// the sale's outcome for `keep` afterwards.
#[derive(Debug, Clone)]
pub struct Claim {
    /// The Redis key.
    pub key: String,
    pub marker: String,
    pub keep: Duration,
    /// When the marker runs out in Redis at the latest: settling it after that changes
    /// nothing. Moved on by each extension that Redis confirmed.
    pending_until: Arc<Mutex<Instant>>,
}

impl Claim {
    pub fn new(redis_key: String, order_id: &str, keep: Duration) -> Self {
        Self {
            key: redis_key,
            marker: format!("pending:{order_id}"),
            keep,
            pending_until: Arc::new(Mutex::new(Instant::now() + CLAIM_LEASE)),
        }
    }

    pub fn pending_until(&self) -> Instant {
        *self
            .pending_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Redis confirmed, no earlier than `answered`, a write or extension of the marker that
    /// gave it a whole [`CLAIM_LEASE`].
    pub fn leased(&self, answered: Instant) {
        let mut until = self
            .pending_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        *until = (*until).max(answered + CLAIM_LEASE);
    }
}

/// What to do after trying to claim a key.
#[derive(Debug)]
pub enum Next {
    /// The key is this attempt's: sell.
    Proceed(Claim),
    /// An earlier attempt left this: answer with it, sell nothing.
    Replay(Prior),
}

/// What the kept value for `sold_out` is.
pub const SOLD_OUT: &str = "sold_out";

/// What an earlier attempt with the same key left.
#[derive(Debug, Clone, PartialEq)]
pub enum Prior {
    Sold(SoldEntry),
    SoldOut,
    InProgress,
}

/// The ledger entry of the sale an earlier attempt made.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct SoldEntry {
    pub order_id: String,
    pub instance: String,
    pub strategy: String,
    pub remaining: i64,
    pub fence: Option<u64>,
}

/// Reads what the key holds: `pending:<order id>`, `sold:<ledger entry>` or `sold_out`.
pub fn parse(value: &str) -> Prior {
    if value == SOLD_OUT {
        return Prior::SoldOut;
    }
    let entry = value
        .strip_prefix("sold:")
        .and_then(|json| serde_json::from_str::<SoldEntry>(json).ok());
    match entry {
        Some(entry) => Prior::Sold(entry),
        // A pending marker, or a value this version does not know: never sell again on it.
        None => Prior::InProgress,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_outside_the_alphabet_are_refused() {
        assert!(Key::try_from("0f8c2a9e-3b1d-4a52-9c7e-2d1f0b6a8e41").is_ok());
        assert!(Key::try_from("order:42.retry_1").is_ok());
        for bad in ["", "a b", "a{b}", "a\nb", "ключ", &"k".repeat(129)] {
            assert!(Key::try_from(bad).is_err(), "{bad:?}");
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

    mod properties {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            /// An accepted key cannot leave its Redis key name; every key of the alphabet is
            /// accepted.
            #[test]
            fn an_accepted_key_stays_inside_its_redis_key(
                key in prop_oneof![any::<String>(), "[A-Za-z0-9_.:{} -]{0,140}"],
            ) {
                if let Ok(accepted) = Key::try_from(key.as_str()) {
                    prop_assert_eq!(accepted.as_str(), key.as_str());
                    prop_assert!((1..=MAX_KEY_LEN).contains(&key.len()));
                    prop_assert!(!key.contains(['{', '}', ' ']), "{:?}", key);
                    prop_assert!(key.is_ascii() && !key.chars().any(char::is_control));
                }
            }

            #[test]
            fn every_key_of_the_alphabet_is_accepted(key in "[A-Za-z0-9_.:-]{1,128}") {
                prop_assert!(Key::try_from(key.as_str()).is_ok());
            }

            /// Whatever a key holds (another version's value, a damaged one), a retry never
            /// reads it as "sold out" unless it says exactly that, and never as a sale unless
            /// it holds one: anything else reads as in progress, which never sells again.
            #[test]
            fn an_unknown_value_never_reads_as_sold_out_or_as_a_sale(
                value in prop_oneof![any::<String>(), "(sold:|pending:|sold_out)[ -~]{0,40}"],
            ) {
                match parse(&value) {
                    Prior::SoldOut => prop_assert_eq!(value.as_str(), SOLD_OUT),
                    Prior::Sold(entry) => {
                        let json = value.strip_prefix("sold:").expect("a sale's prefix");
                        prop_assert_eq!(serde_json::from_str::<SoldEntry>(json).ok(), Some(entry));
                    }
                    Prior::InProgress => {}
                }
            }
        }
    }
}

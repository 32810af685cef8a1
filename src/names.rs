//! What a client may put into a Redis key name: item ids and idempotency keys. A leaf module,
//! so that configuration and idempotency share the rule without importing each other.

/// 1 to `max_len` ASCII letters, digits or `punctuation`: nothing that could escape a key's
/// hash tag (`{`, `}`) or its prefix.
pub fn is_token(s: &str, max_len: usize, punctuation: &[u8]) -> bool {
    !s.is_empty()
        && s.len() <= max_len
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || punctuation.contains(&b))
}

/// Longest item id: short enough to keep every key name of the item small.
pub const ITEM_ID_MAX: usize = 32;

/// Path segments next to `/inventory/{item}` that would make an item of that name
/// unreachable at `/inventory/{item}` (`GET /inventory/sale` is a sale).
const RESERVED_ITEM_IDS: [&str; 2] = ["sale", "audit"];

/// What an item id may be, in the words of every refusal; the API's path parameter and
/// `ITEM_ID` share it.
pub const ITEM_ID_RULE: &str = "1 to 32 ASCII letters, digits, '-' or '_' (pattern ^[A-Za-z0-9_-]{1,32}$), not \"sale\" or \"audit\"";

/// The pattern of an item id, the reserved names aside (as refusals quote it).
pub const ITEM_ID_PATTERN: &str = "^[A-Za-z0-9_-]{1,32}$";

/// The same rule as one ECMA-262 regular expression, for the OpenAPI document, where
/// clients and fuzzers read it: a lookahead refuses the reserved names.
pub const ITEM_ID_SCHEMA_PATTERN: &str = "^(?!(?:sale|audit)$)[A-Za-z0-9_-]{1,32}$";

/// Checks an item id, for `ITEM_ID` and for `/inventory/{item}` alike. Ids go into a hash
/// tag (`inventory:{item}:stock`), so `{`, `}` and `:` must never get in: one of them could
/// move an item's keys to different slots or make two items share keys.
pub fn parse_item_id(id: &str) -> Result<String, String> {
    if is_token(id, ITEM_ID_MAX, b"-_") && !RESERVED_ITEM_IDS.contains(&id) {
        Ok(id.to_owned())
    } else {
        // Debug formatting escapes control characters: the refusal never echoes them raw.
        let shown: String = format!("{id:?}").chars().take(80).collect();
        Err(format!("invalid item id {shown}: use {ITEM_ID_RULE}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn item_ids_that_could_escape_their_key_or_shadow_a_route_are_refused() {
        for good in ["001", "sku_9-b", "A", &"z".repeat(ITEM_ID_MAX)] {
            assert_eq!(parse_item_id(good).as_deref(), Ok(good));
        }
        let too_long = "9".repeat(ITEM_ID_MAX + 1);
        for bad in [
            "", "a}b", "{x}", "a:b", "a b", "x{1}", "é", "a/b", "a.b", "sale", "audit", &too_long,
        ] {
            let refusal = parse_item_id(bad).expect_err(bad);
            assert!(refusal.contains("^[A-Za-z0-9_-]{1,32}$"), "{refusal}");
        }
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            /// Whatever a client sends, an id that is accepted cannot leave its hash tag or
            /// its prefix, and a refusal quotes the rule without echoing a control character.
            #[test]
            fn an_accepted_id_stays_inside_its_key_and_a_refusal_names_the_rule(
                id in prop_oneof![any::<String>(), "[A-Za-z0-9_{}:/ .-]{0,40}"],
            ) {
                match parse_item_id(&id) {
                    Ok(accepted) => {
                        prop_assert_eq!(&accepted, &id);
                        prop_assert!((1..=ITEM_ID_MAX).contains(&id.len()));
                        prop_assert!(!id.contains(['{', '}', ':', '/', ' ']), "{:?}", id);
                        prop_assert!(id.is_ascii() && !id.chars().any(char::is_control));
                        prop_assert!(!RESERVED_ITEM_IDS.contains(&id.as_str()));
                    }
                    Err(refusal) => {
                        prop_assert!(refusal.contains(ITEM_ID_PATTERN), "{}", refusal);
                        prop_assert!(!refusal.chars().any(char::is_control), "{:?}", refusal);
                    }
                }
            }

            /// Every id of the documented pattern is accepted, the two reserved names aside.
            #[test]
            fn every_id_of_the_pattern_is_accepted(id in "[A-Za-z0-9_-]{1,32}") {
                let reserved = RESERVED_ITEM_IDS.contains(&id.as_str());
                prop_assert_eq!(parse_item_id(&id).is_ok(), !reserved);
            }
        }
    }
}

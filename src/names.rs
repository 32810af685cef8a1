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

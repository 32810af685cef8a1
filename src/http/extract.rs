//! Extractors whose rejections speak the service's error shape instead of axum's plain text.

use axum::extract::{FromRequest, FromRequestParts};
use axum::http::request::Parts;
use std::sync::Arc;

use super::AppState;
use super::error::ApiError;

#[derive(FromRequestParts)]
#[from_request(via(axum::extract::Query), rejection(ApiError))]
pub struct ApiQuery<T>(pub T);

#[derive(FromRequest)]
#[from_request(via(axum::Json), rejection(ApiError))]
pub struct ApiJson<T>(pub T);

/// The item of an `/inventory/{item}/...` path, checked by the rule `ITEM_ID` follows; a
/// malformed one is refused with 400 naming that rule, before anything touches Redis.
#[derive(Debug, utoipa::IntoParams)]
#[into_params(parameter_in = Path)]
pub struct ItemPath {
    /// Item id: 1 to 32 ASCII letters, digits, `-` or `_`, not `sale` or `audit`. The
    /// instance's `ITEM_ID` (default `001`) is the item of the paths without `{item}`.
    #[param(
        pattern = "^(?!(?:sale|audit)$)[A-Za-z0-9_-]{1,32}$",
        min_length = 1,
        max_length = 32,
        example = "001"
    )]
    pub item: String,
}

impl<S: Send + Sync> FromRequestParts<S> for ItemPath {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let axum::extract::Path(raw) =
            axum::extract::Path::<String>::from_request_parts(parts, state)
                .await
                .map_err(|_| {
                    ApiError::BadRequest(format!(
                        "invalid item id: use {}",
                        crate::names::ITEM_ID_RULE
                    ))
                })?;
        let item = crate::names::parse_item_id(&raw).map_err(ApiError::BadRequest)?;
        Ok(ItemPath { item })
    }
}

/// Present in a handler's arguments, it refuses a query string: on the stock, reset and audit
/// routes a parameter (`?item=qq`, `?dry_run=true`) used to be ignored, and the answer was
/// the default item's, or the reset was made, without a word.
pub struct NoQuery;

impl<S: Send + Sync> FromRequestParts<S> for NoQuery {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        let Some(query) = parts.uri.query().filter(|q| !q.is_empty()) else {
            return Ok(NoQuery);
        };
        // Debug formatting escapes control characters; a few names, each cut short.
        let names: Vec<String> = query
            .split('&')
            .filter_map(|pair| pair.split('=').next())
            .filter(|name| !name.is_empty())
            .take(4)
            .map(|name| format!("{:?}", name.chars().take(40).collect::<String>()))
            .collect();
        Err(ApiError::BadRequest(format!(
            "this route takes no query parameters (given: {}); name an item in the path \
             (/inventory/{{item}}, /inventory/{{item}}/audit) and a stock in the body",
            names.join(", ")
        )))
    }
}

/// Present in a handler's arguments, it lets the request through only with the admin token
/// (or when none is configured).
pub struct Admin;

impl FromRequestParts<Arc<AppState>> for Admin {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &Arc<AppState>,
    ) -> Result<Self, Self::Rejection> {
        let Some(expected) = &state.admin_token else {
            return Ok(Admin);
        };
        // Two `Authorization` headers are refused whatever they say: a proxy and a client
        // that disagree on which one counts must not be able to pass with either.
        let mut headers = parts
            .headers
            .get_all(axum::http::header::AUTHORIZATION)
            .iter();
        let presented = match (headers.next(), headers.next()) {
            (Some(value), None) => value.to_str().ok().and_then(bearer_token),
            _ => None,
        }
        .unwrap_or_default();
        if constant_time_eq(presented.as_bytes(), expected.as_bytes()) {
            Ok(Admin)
        } else {
            Err(ApiError::Unauthorized)
        }
    }
}

/// The token of `Bearer <token>`. The scheme's name is case-insensitive (RFC 9110, 11.1), so
/// `bearer` and `BEARER` are the same scheme; one or more spaces may follow it.
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim_start_matches(' '))
}

/// Compares without an early exit, so the time taken does not reveal how much of the token
/// was right (only whether its length was).
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::{bearer_token, constant_time_eq};

    #[test]
    fn the_bearer_scheme_is_case_insensitive_and_nothing_else_passes() {
        assert_eq!(bearer_token("Bearer s3cret"), Some("s3cret"));
        assert_eq!(bearer_token("bearer s3cret"), Some("s3cret"));
        assert_eq!(bearer_token("BEARER  s3cret"), Some("s3cret"));
        assert_eq!(bearer_token("Basic s3cret"), None);
        assert_eq!(bearer_token("Bearers3cret"), None);
        assert_eq!(bearer_token("s3cret"), None);
    }

    #[test]
    fn only_the_exact_token_matches() {
        assert!(constant_time_eq(b"s3cret", b"s3cret"));
        assert!(!constant_time_eq(b"s3cres", b"s3cret"));
        assert!(!constant_time_eq(b"s3cre", b"s3cret"));
        assert!(!constant_time_eq(b"", b"s3cret"));
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #[test]
            fn tokens_match_exactly_when_they_are_equal(a in any::<Vec<u8>>(), b in any::<Vec<u8>>()) {
                prop_assert_eq!(constant_time_eq(&a, &b), a == b);
                prop_assert!(constant_time_eq(&a, &a));
            }

            /// The bearer scheme in any case, with any run of spaces, gives back the token;
            /// no other scheme gives anything.
            #[test]
            fn the_token_after_the_bearer_scheme_and_only_it_comes_back(
                scheme in "[bB][eE][aA][rR][eE][rR]",
                spaces in " {1,4}",
                token in "[!-~]{1,40}",
                other in "[A-Za-z]{1,10}",
            ) {
                let header = format!("{scheme}{spaces}{token}");
                prop_assert_eq!(bearer_token(&header), Some(token.as_str()));
                let header = format!("{other} {token}");
                if !other.eq_ignore_ascii_case("bearer") {
                    prop_assert_eq!(bearer_token(&header), None);
                }
            }
        }
    }
}

//! Extractors whose rejections speak problem+json: the authenticated tenant (which also takes
//! a token from its rate limit, so every tenant route is limited and nothing else is) or admin,
//! the `Idempotency-Key` header, and a JSON body that is size-limited, strictly typed (unknown
//! fields refused, the failing field named) and canonically hashed for idempotency.

use std::sync::{Arc, OnceLock};

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::response::Response;
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::error::{ApiError, RATELIMIT, RATELIMIT_POLICY};
use super::SharedState;
use crate::auth::{AuthFailure, TenantAuth};
use crate::engine::IdempotencyKey;
use crate::ratelimit::{remaining_field, Decision};
use crate::storage::IdempotencyRequest;

fn bearer(parts: &Parts) -> Option<&str> {
    let value = parts.headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then_some(token.trim()).filter(|t| !t.is_empty())
}

/// The tenant a request's API key belongs to, admitted by its rate limit. A request past the
/// limit is refused here, before any handler runs, so a `429` is never an idempotent outcome.
pub struct Tenant(pub TenantAuth);

impl FromRequestParts<SharedState> for Tenant {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &SharedState) -> Result<Self, Self::Rejection> {
        let token = bearer(parts).ok_or_else(ApiError::unauthorized)?;
        let auth = match state.auth.tenant(&state.storage, token).await {
            Ok(auth) => auth,
            Err(AuthFailure::Invalid) => return Err(ApiError::unauthorized()),
            Err(AuthFailure::Storage(err)) => return Err(err.into()),
        };
        match state.limits.check(&auth.tenant, auth.rate_limit) {
            Decision::Unlimited => {}
            Decision::Allowed { limit, remaining, reset_s } => {
                if let Some(note) = parts.extensions.get::<RateLimitNote>() {
                    note.set(limit.policy_field(), remaining_field(remaining, reset_s));
                }
            }
            Decision::Limited { limit, retry_after_s } => {
                metrics::counter!("stockd_rate_limited_total").increment(1);
                return Err(ApiError::rate_limited(&limit, retry_after_s));
            }
        }
        Ok(Tenant(auth))
    }
}

/// Where the [`Tenant`] extractor leaves a served request's `RateLimit-Policy` and `RateLimit`
/// values, for the request middleware to put on the response (an extractor cannot reach it).
#[derive(Debug, Clone, Default)]
pub struct RateLimitNote(Arc<OnceLock<[HeaderValue; 2]>>);

impl RateLimitNote {
    fn set(&self, policy: String, remaining: String) {
        if let (Ok(policy), Ok(remaining)) = (HeaderValue::try_from(policy), HeaderValue::try_from(remaining)) {
            let _ = self.0.set([policy, remaining]);
        }
    }

    /// Adds the noted headers, unless the response already has its own (a 429).
    pub fn apply(&self, response: &mut Response) {
        if let Some([policy, remaining]) = self.0.get() {
            let headers = response.headers_mut();
            if !headers.contains_key(RATELIMIT) {
                headers.insert(RATELIMIT_POLICY, policy.clone());
                headers.insert(RATELIMIT, remaining.clone());
            }
        }
    }
}

/// Proof that a request carries the admin token.
pub struct Admin;

impl FromRequestParts<SharedState> for Admin {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &SharedState) -> Result<Self, Self::Rejection> {
        let token = bearer(parts).ok_or_else(ApiError::unauthorized)?;
        if state.auth.is_admin(token) {
            return Ok(Admin);
        }
        // A valid tenant key is authenticated but not allowed here.
        match state.auth.tenant(&state.storage, token).await {
            Ok(_) => Err(ApiError::forbidden()),
            Err(AuthFailure::Invalid) => Err(ApiError::unauthorized()),
            Err(AuthFailure::Storage(err)) => Err(err.into()),
        }
    }
}

/// The required `Idempotency-Key` header.
pub struct IdemKey(pub IdempotencyKey);

impl<S: Send + Sync> FromRequestParts<S> for IdemKey {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        let value = parts.headers.get("idempotency-key").ok_or_else(|| {
            ApiError::new(
                400,
                "idempotency_key_missing",
                "Idempotency-Key missing",
                "this call requires an Idempotency-Key header",
            )
        })?;
        let text = value.to_str().map_err(|_| ApiError::validation("Idempotency-Key", "must be visible ASCII"))?;
        IdempotencyKey::parse(text).map(IdemKey).map_err(|e| ApiError::validation("Idempotency-Key", e))
    }
}

/// Path parameters. axum's own rejection (a segment that is not UTF-8 once percent-decoded) is
/// plain text; this one is `400 validation_failed`, like every other malformed input.
pub struct Path<T>(pub T);

impl<T: DeserializeOwned + Send, S: Send + Sync> FromRequestParts<S> for Path<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        match axum::extract::Path::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Path(value)) => Ok(Path(value)),
            Err(rejection) => Err(ApiError::validation("path", rejection.body_text())),
        }
    }
}

/// A strictly parsed JSON body, plus the hash that identifies the request for idempotency.
pub struct ValidJson<T> {
    pub value: T,
    /// SHA-256 over method, path and the canonical (key-sorted, whitespace-free) body.
    pub request_hash: String,
}

impl<T> ValidJson<T> {
    pub fn idempotency(&self, key: IdempotencyKey) -> IdempotencyRequest {
        IdempotencyRequest { key, request_hash: self.request_hash.clone() }
    }
}

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for ValidJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let is_json = req
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(';').next())
            .is_some_and(|mime| mime.trim().eq_ignore_ascii_case("application/json"));
        if !is_json {
            return Err(ApiError::new(
                415,
                "unsupported_media_type",
                "Unsupported media type",
                "the body must be application/json",
            ));
        }
        let method = req.method().clone();
        let path = req.uri().path().to_string();
        let bytes = Bytes::from_request(req, state).await.map_err(|rejection| {
            if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::new(413, "payload_too_large", "Payload too large", "the body exceeds the configured limit")
            } else {
                ApiError::validation("body", "could not be read")
            }
        })?;
        let json: Value = serde_json::from_slice(&bytes)
            .map_err(|e| ApiError::validation("body", format!("malformed JSON ({e})")))?;
        // Typed from the bytes, not from `json`: a `Value` silently keeps the last of duplicate
        // fields, while the typed parse refuses them, so no two readers can see different bodies.
        let mut de = serde_json::Deserializer::from_slice(&bytes);
        let value = serde_path_to_error::deserialize(&mut de).map_err(|e| {
            let path = e.path().to_string();
            ApiError::validation(&path, e.into_inner())
        })?;
        Ok(Self { value, request_hash: request_hash(&method, &path, &json) })
    }
}

/// Identity of a request for idempotency: the same method, path and JSON value (whatever its
/// key order or whitespace) hash the same.
pub fn request_hash(method: &Method, path: &str, body: &Value) -> String {
    let mut canonical = Vec::with_capacity(256);
    canonical.extend_from_slice(method.as_str().as_bytes());
    canonical.push(b'\n');
    canonical.extend_from_slice(path.as_bytes());
    canonical.push(b'\n');
    write_canonical(body, &mut canonical);
    crate::auth::digest_hex(&canonical)
}

/// The body with every object's keys sorted, written compactly: strings, numbers and literals
/// by serde_json's own compact writer, so the bytes (and every hash stored before) stay what
/// `Value`'s `to_string` gave for them, without a string allocated for each.
fn write_canonical(value: &Value, out: &mut Vec<u8>) {
    match value {
        Value::Object(map) => {
            let mut entries: Vec<_> = map.iter().collect();
            entries.sort_by(|a, b| a.0.cmp(b.0));
            out.push(b'{');
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_scalar(k, out);
                out.push(b':');
                write_canonical(v, out);
            }
            out.push(b'}');
        }
        Value::Array(items) => {
            out.push(b'[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_canonical(v, out);
            }
            out.push(b']');
        }
        scalar => write_scalar(scalar, out),
    }
}

/// Writing a string or a scalar into memory cannot fail.
fn write_scalar<T: serde::Serialize + ?Sized>(value: &T, out: &mut Vec<u8>) {
    let _ = serde_json::to_writer(out, value);
}

/// Items per page unless `limit` says otherwise, and the most it may say (every paged list).
pub const DEFAULT_PAGE: u32 = 100;
pub const MAX_PAGE: u32 = 1000;

/// A page's `limit`: [`DEFAULT_PAGE`] when absent, else 1..=[`MAX_PAGE`] or `400`.
pub fn page_limit(limit: Option<u32>) -> Result<u32, ApiError> {
    match limit.unwrap_or(DEFAULT_PAGE) {
        n @ 1..=MAX_PAGE => Ok(n),
        _ => Err(ApiError::validation("limit", format!("must be between 1 and {MAX_PAGE}"))),
    }
}

/// The query parameters, or `400 validation_failed` naming what is wrong with them.
pub fn query<T>(q: Result<axum::extract::Query<T>, axum::extract::rejection::QueryRejection>) -> Result<T, ApiError> {
    q.map(|axum::extract::Query(v)| v).map_err(|e| ApiError::validation("query", e.body_text()))
}

#[cfg(test)]
mod tests {
    use sha2::{Digest, Sha256};

    use super::*;

    #[test]
    fn key_order_and_whitespace_do_not_change_the_request_hash() {
        let a: Value = serde_json::from_str(r#"{"b": 1, "a": {"y": [1, 2], "x": "s"}}"#).unwrap_or_default();
        let b: Value = serde_json::from_str(r#"{"a":{"x":"s","y":[1,2]},"b":1}"#).unwrap_or_default();
        let c: Value = serde_json::from_str(r#"{"a":{"x":"s","y":[2,1]},"b":1}"#).unwrap_or_default();
        let h = |v: &Value| request_hash(&Method::POST, "/v1/orders", v);
        assert_eq!(h(&a), h(&b));
        assert_ne!(h(&a), h(&c));
        assert_ne!(h(&a), request_hash(&Method::POST, "/v1/other", &a));
    }

    /// The canonical form as it was first written (a string allocated for every key and
    /// scalar): the hashes stored by earlier versions were made from exactly these bytes.
    fn reference_hash(method: &Method, path: &str, body: &Value) -> String {
        fn canonical(value: &Value, out: &mut String) {
            match value {
                Value::Object(map) => {
                    let mut entries: Vec<_> = map.iter().collect();
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                    out.push('{');
                    for (i, (k, v)) in entries.into_iter().enumerate() {
                        if i > 0 {
                            out.push(',');
                        }
                        out.push_str(&Value::String(k.clone()).to_string());
                        out.push(':');
                        canonical(v, out);
                    }
                    out.push('}');
                }
                Value::Array(items) => {
                    out.push('[');
                    for (i, v) in items.iter().enumerate() {
                        if i > 0 {
                            out.push(',');
                        }
                        canonical(v, out);
                    }
                    out.push(']');
                }
                scalar => out.push_str(&scalar.to_string()),
            }
        }
        let mut out = format!("{method}\n{path}\n");
        canonical(body, &mut out);
        hex::encode(Sha256::digest(out.as_bytes()))
    }

    fn json_value() -> impl proptest::strategy::Strategy<Value = Value> {
        use proptest::prelude::*;
        let text = prop_oneof![any::<String>(), "[a-z\\\\\"\\u{0}-\\u{1f}\\u{7f}-\\u{a0}\\u{2028}\\u{1F600}]{0,12}"];
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            any::<f64>().prop_map(Value::from),
            text.clone().prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 48, 6, move |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                proptest::collection::vec((text.clone(), inner), 0..6)
                    .prop_map(|entries| Value::Object(entries.into_iter().collect())),
            ]
        })
    }

    proptest::proptest! {
        /// Every stored request hash stays valid across the rewrite: same bytes, same hash, for
        /// any JSON (escapes, control characters, astral code points, floats, large integers).
        #[test]
        fn the_request_hash_is_the_one_earlier_versions_stored(body in json_value()) {
            let path = "/v1/orders";
            proptest::prop_assert_eq!(request_hash(&Method::POST, path, &body), reference_hash(&Method::POST, path, &body));
        }
    }
}

//! Secrets: API keys and the admin token. Keys are 256 random bits, shown once, stored only as a
//! SHA-256 (a fast hash is right for high-entropy keys: there is nothing to brute-force), and
//! compared in constant time. Verified keys are cached briefly so the hot path does not ask
//! storage on every request; revocation through this process evicts at once.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use base64::Engine as _;
use rand::RngCore;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::engine::TenantId;
use crate::ratelimit::RateLimit;
use crate::storage::{NewApiKey, Storage, StorageError};

/// Most cached keys; beyond it the cache is cleared (a bound, not an eviction policy worth more).
const MAX_CACHED_KEYS: usize = 100_000;

/// SHA-256 of a secret, hex-encoded.
pub fn sha256_hex(secret: &str) -> String {
    digest_hex(secret.as_bytes())
}

/// SHA-256 of `bytes` as 64 lowercase hex digits, written through a table (`hex::encode`
/// collects a `char` at a time: ~2,200 instructions a digest, 1 % of an order).
pub fn digest_hex(bytes: &[u8]) -> String {
    let mut out = [0u8; 64];
    // A 32-byte digest always fills the 64 digits exactly, and hex digits are ASCII.
    let written = hex::encode_to_slice(Sha256::digest(bytes), &mut out);
    debug_assert!(written.is_ok());
    String::from_utf8_lossy(&out).into_owned()
}

fn random_token(prefix: &str) -> String {
    let mut bytes = [0u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    format!("{prefix}{}", base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes))
}

/// A new API key: the secret for the client (shown once) and the half storage keeps.
pub fn mint_api_key() -> (String, NewApiKey) {
    let secret = random_token("sk_");
    let stored = NewApiKey { id: format!("key_{}", ulid::Ulid::new()), hash: sha256_hex(&secret) };
    (secret, stored)
}

/// A random admin token, for dev mode when none is configured.
pub fn mint_admin_token() -> String {
    random_token("adm_")
}

fn equal(a: &str, b: &str) -> bool {
    a.as_bytes().ct_eq(b.as_bytes()).into()
}

/// Who a request authenticated as.
#[derive(Debug, Clone)]
pub struct TenantAuth {
    pub tenant: TenantId,
    pub key_id: String,
    /// The tenant's own request rate as of when the key was verified (cached with it).
    pub rate_limit: Option<RateLimit>,
}

struct Cached {
    auth: TenantAuth,
    hash: String,
    at: Instant,
}

/// Verifies bearer tokens.
pub struct Authenticator {
    admin_hash: String,
    cache_ttl: Duration,
    cache: RwLock<HashMap<String, Cached>>,
}

/// A token that is not a valid tenant key.
pub enum AuthFailure {
    Invalid,
    Storage(StorageError),
}

impl Authenticator {
    pub fn new(admin_hash: String, cache_ttl: Duration) -> Self {
        Self { admin_hash, cache_ttl, cache: RwLock::new(HashMap::new()) }
    }

    pub fn is_admin(&self, token: &str) -> bool {
        equal(&sha256_hex(token), &self.admin_hash)
    }

    /// Resolves a tenant API key.
    pub async fn tenant(&self, storage: &Arc<dyn Storage>, token: &str) -> Result<TenantAuth, AuthFailure> {
        let hash = sha256_hex(token);
        if let Ok(cache) = self.cache.read() {
            if let Some(hit) = cache.get(&hash) {
                if hit.at.elapsed() < self.cache_ttl && equal(&hit.hash, &hash) {
                    return Ok(hit.auth.clone());
                }
            }
        }
        let record = storage.find_api_key(&hash).await.map_err(AuthFailure::Storage)?;
        let record = record.filter(|r| equal(&r.hash, &hash)).ok_or(AuthFailure::Invalid)?;
        let auth = TenantAuth { tenant: record.tenant_id, key_id: record.id, rate_limit: record.rate_limit };
        if let Ok(mut cache) = self.cache.write() {
            if cache.len() >= MAX_CACHED_KEYS {
                cache.clear();
            }
            cache.insert(hash.clone(), Cached { auth: auth.clone(), hash, at: Instant::now() });
        }
        Ok(auth)
    }

    /// Forgets a revoked key so it fails at once.
    pub fn evict(&self, key_id: &str) {
        if let Ok(mut cache) = self.cache.write() {
            cache.retain(|_, c| c.auth.key_id != key_id);
        }
    }

    /// Forgets every key of a tenant, so a change to it (its rate) applies here at once.
    pub fn evict_tenant(&self, tenant: &TenantId) {
        if let Ok(mut cache) = self.cache.write() {
            cache.retain(|_, c| &c.auth.tenant != tenant);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minted_keys_are_long_random_and_stored_only_as_hashes() {
        let (a, stored_a) = mint_api_key();
        let (b, _) = mint_api_key();
        assert_ne!(a, b);
        assert!(a.len() >= 40, "a 256-bit key encodes to at least 43 characters");
        assert_eq!(stored_a.hash, sha256_hex(&a));
        assert!(!stored_a.hash.contains(&a));
    }

    #[test]
    fn admin_token_is_checked_against_its_hash() {
        let auth = Authenticator::new(sha256_hex("secret"), Duration::from_secs(1));
        assert!(auth.is_admin("secret"));
        assert!(!auth.is_admin("secret "));
    }
}

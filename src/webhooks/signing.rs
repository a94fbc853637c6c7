//! Standard Webhooks signatures (spec/standard-webhooks.md of the standard-webhooks repository):
//! the secret is `whsec_` + base64 of the key bytes; the signed content is
//! `{webhook-id}.{webhook-timestamp}.{body}`; a signature is `v1,` + base64(HMAC-SHA256). During
//! a rotation's grace period the header carries both signatures, space separated, as the spec
//! allows, so receivers verify with the published libraries unchanged.

use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Key bytes of a secret we issue: 256 bits (the spec asks for 24 to 64 bytes).
const KEY_BYTES: usize = 32;
/// The prefix of a symmetric secret.
pub const SECRET_PREFIX: &str = "whsec_";

/// A signing secret, `whsec_<base64>`. Its `Debug` never shows it, so it cannot reach a log by
/// accident.
#[derive(Clone, PartialEq, Eq)]
pub struct SigningSecret(String);

impl std::fmt::Debug for SigningSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SigningSecret(whsec_***)")
    }
}

impl SigningSecret {
    /// A fresh random secret.
    pub fn generate() -> Self {
        let key: [u8; KEY_BYTES] = rand::random();
        Self(format!("{SECRET_PREFIX}{}", STANDARD.encode(key)))
    }

    /// A stored (or, in tests, published) secret; `None` if it is not `whsec_<base64>`.
    pub fn parse(text: &str) -> Option<Self> {
        let key = STANDARD.decode(text.strip_prefix(SECRET_PREFIX)?).ok()?;
        (!key.is_empty()).then(|| Self(text.to_string()))
    }

    /// The secret as issued, for the one answer that shows it and for storage.
    pub fn expose(&self) -> &str {
        &self.0
    }

    fn key(&self) -> Vec<u8> {
        // Checked by `parse`/`generate`; a bad stored value signs with no key rather than panic.
        self.0.strip_prefix(SECRET_PREFIX).and_then(|k| STANDARD.decode(k).ok()).unwrap_or_default()
    }

    /// `v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}">`.
    pub fn sign(&self, id: &str, timestamp: i64, body: &[u8]) -> String {
        // HMAC takes a key of any length, so `new_from_slice` cannot fail.
        let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(&self.key()) else { return String::from("v1,") };
        mac.update(id.as_bytes());
        mac.update(b".");
        mac.update(timestamp.to_string().as_bytes());
        mac.update(b".");
        mac.update(body);
        format!("v1,{}", STANDARD.encode(mac.finalize().into_bytes()))
    }
}

/// The `webhook-signature` header: the current secret's signature, then the previous secret's
/// while it is still within its grace period (`now_ms` before its end).
pub fn signature_header(
    secret: &SigningSecret,
    previous: Option<&(SigningSecret, i64)>,
    now_ms: i64,
    id: &str,
    timestamp: i64,
    body: &[u8],
) -> String {
    let mut header = secret.sign(id, timestamp, body);
    if let Some((old, until)) = previous {
        if now_ms < *until {
            header.push(' ');
            header.push_str(&old.sign(id, timestamp, body));
        }
    }
    header
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The published vectors: the Go and Python libraries' `TestWebhookSign` /
    /// `test_sign_function` and the Rust library's `test_sign` (standard-webhooks repository,
    /// libraries/{go,python,rust}).
    #[test]
    fn signs_the_published_example_vectors() {
        let secret = SigningSecret::parse("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        assert_eq!(
            secret.sign("msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, br#"{"test": 2432232314}"#),
            "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
        );
        let secret = SigningSecret::parse("whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD").unwrap();
        assert_eq!(
            secret.sign(
                "msg_27UH4WbU6Z5A5EzD8u03UvzRbpk",
                1649367553,
                br#"{"email":"test@example.com","username":"test_user"}"#
            ),
            "v1,tZ1I4/hDygAJgO5TYxiSd6Sd0kDW6hPenDe+bTa3Kkw="
        );
    }

    #[test]
    fn generated_secrets_parse_and_never_print() {
        let secret = SigningSecret::generate();
        assert!(secret.expose().starts_with("whsec_"));
        assert_eq!(SigningSecret::parse(secret.expose()), Some(secret.clone()));
        assert!(!format!("{secret:?}").contains(&secret.expose()[6..]));
        assert_eq!(SigningSecret::parse("whsec_"), None);
        assert_eq!(SigningSecret::parse("nope"), None);
    }

    #[test]
    fn the_previous_secret_signs_only_within_its_grace() {
        let (new, old) = (SigningSecret::generate(), SigningSecret::generate());
        let previous = (old.clone(), 1_000);
        let both = signature_header(&new, Some(&previous), 999, "evt_1", 5, b"{}");
        assert_eq!(both, format!("{} {}", new.sign("evt_1", 5, b"{}"), old.sign("evt_1", 5, b"{}")));
        let one = signature_header(&new, Some(&previous), 1_000, "evt_1", 5, b"{}");
        assert_eq!(one, new.sign("evt_1", 5, b"{}"));
    }
}

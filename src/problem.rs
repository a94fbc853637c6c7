//! The problem document (RFC 9457, `application/problem+json`) every error uses. It lives at the
//! crate root because storage also renders problems: an idempotent request's first outcome,
//! errors included, is stored in the same transaction as its effects and replayed verbatim.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// An error response body. `code` is stable and machine-readable; `detail` is for humans and
/// never carries SQL, stack traces or another tenant's data.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Problem {
    #[serde(rename = "type")]
    pub type_url: String,
    pub title: String,
    pub status: u16,
    pub code: String,
    pub detail: String,
}

impl Problem {
    pub fn new(status: u16, code: &str, title: &str, detail: impl Into<String>) -> Self {
        Self {
            type_url: format!("https://stockd.dev/errors/{code}"),
            title: title.to_string(),
            status,
            code: code.to_string(),
            detail: detail.into(),
        }
    }
}

//! A reversal of an order sold in redis mode.

use super::{RedisMode, RedisModeError};
use crate::apply::reversals::ReversalJob;
use crate::engine::reversal::LineReversal;
use crate::storage::Idempotent;

impl RedisMode {
    /// Gives back one line of an order Redis sold.
    pub async fn reverse(
        &self,
        _job: &ReversalJob,
        _lines: &[LineReversal],
        _settled_reversed: &[i64],
        _now_ms: i64,
    ) -> Result<Idempotent, RedisModeError> {
        Err(RedisModeError::OrderUnsupported)
    }
}

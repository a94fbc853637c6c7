//! The plain Rust side of the plugin contract: what the core passes in ([`PlanInput`]), the
//! validated plan it gets back ([`PluginPlan`]), and the two ways a plugin can fail
//! ([`PluginInvalid`] at upload, [`PluginFailed`] per call). These mirror
//! `wit/stockd-plugin.wit`; nothing from wasmtime appears here.

use serde::Serialize;
use utoipa::ToSchema;

use crate::engine::{Kind, OrderRequest, Quantity, ResourceKey, TenantId};

/// Everything a plugin sees for one order. The plugin has no clock and no randomness of its
/// own: the core passes `now_ms` and `seed`, so a plan is a pure function of this input.
#[derive(Debug, Clone, Copy)]
pub struct PlanInput<'a> {
    pub tenant: &'a TenantId,
    /// The validated order (1..=100 lines, each key once).
    pub order: &'a OrderRequest,
    /// The core's clock, milliseconds since the Unix epoch (UTC).
    pub now_ms: i64,
    /// A random number the core chose for this request (for random bucket orders).
    pub seed: u64,
    /// The tenant's plugin configuration text; may be empty.
    pub config: &'a str,
}

/// How an order ends when some of its lines cannot apply.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum PluginPolicy {
    /// Every line applies, or none does.
    AllOrNothing,
    /// Lines that can apply do; the order is `partial` when some could not.
    AllowPartial,
    /// Like `AllowPartial`, but the order is rejected unless every `mandatory` line applied.
    MandatoryLines,
}

/// A plan the host has validated: every index, key and number is within the contract.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct PluginPlan {
    pub policy: PluginPolicy,
    /// At least one line; each order line appears at most once.
    pub lines: Vec<PluginLine>,
}

/// The plan for one order line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct PluginLine {
    /// Index into the order's lines (in range, unique within the plan).
    pub line: usize,
    /// What to deduct or reserve, 1..=10^12.
    pub qty: Quantity,
    /// For [`PluginPolicy::MandatoryLines`]: the order fails unless this line applies.
    pub mandatory: bool,
    /// 1..=8 targets: the primary resource first, then fallbacks to try in order.
    pub targets: Vec<PluginTarget>,
    /// The per-user limit this line counts against, enforced atomically with the deduction.
    pub limit: Option<UserLimit>,
}

/// One resource a planned line may take from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct PluginTarget {
    pub resource: ResourceKey,
    /// The kind the resource must be, when the plugin cares.
    pub kind: Option<Kind>,
    /// Create the resource with this allowance (0..=10^15) when it does not exist.
    pub create_if_missing: Option<i64>,
    /// Order in which the resource's buckets are tried (each < 1024, at most 1024); empty
    /// means the core's default order.
    pub buckets: Vec<u16>,
}

/// A per-user limit: the line applies only if `used(key) + qty <= max`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct UserLimit {
    /// The counter's key (same rules as a resource key).
    pub key: ResourceKey,
    /// At least 0.
    pub max: i64,
}

/// Why an uploaded component was refused (`422 plugin_invalid`). The reason is short and
/// meant for the plugin's author.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason}")]
pub struct PluginInvalid {
    reason: String,
}

impl PluginInvalid {
    pub(crate) fn new(reason: impl Into<String>) -> Self {
        Self { reason: reason.into() }
    }

    /// The human-readable reason.
    pub fn reason(&self) -> &str {
        &self.reason
    }
}

/// Why a component could not be loaded (compiled and checked).
#[derive(Debug, Clone, thiserror::Error)]
pub enum LoadError {
    /// The component is invalid or exceeds a limit: `422 plugin_invalid`.
    #[error(transparent)]
    Invalid(#[from] PluginInvalid),
    /// This tenant already has a compile in progress: `429`, retry when it is done.
    #[error("{0}")]
    Busy(String),
    /// The server cannot compile right now (busy, shutting down, no child could be started):
    /// `503`, retry later.
    #[error("{0}")]
    Unavailable(String),
}

/// Why one plan call failed (`422 plugin_failed`). Only that request fails; nothing of the
/// plugin's state survives it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PluginFailed {
    /// The plugin ran longer than its fuel allows (an endless or very long loop).
    #[error("plugin ran out of fuel after {fuel} units: it takes too long")]
    OutOfFuel { fuel: u64 },
    /// The plugin ran past its wall-clock deadline (work that fuel does not count, such as
    /// bulk memory operations, or a machine too busy to give it the time).
    #[error("plugin exceeded its time limit of {limit_ms} ms")]
    TimedOut { limit_ms: u64 },
    /// The plugin tried to grow its memory beyond the cap.
    #[error("plugin exceeded its memory limit of {limit_bytes} bytes")]
    OutOfMemory { limit_bytes: usize },
    /// The plugin trapped: a panic, `unreachable`, a bad memory access, stack overflow, ...
    #[error("plugin trapped: {0}")]
    Trap(String),
    /// The plugin refused the order with a reason of its own (at most 500 characters).
    #[error("plugin refused the order: {0}")]
    Refused(String),
    /// The plugin returned a plan that breaks the contract.
    #[error("plugin returned an invalid plan: {0}")]
    InvalidPlan(String),
    /// The host could not run the plugin right now (too many calls in flight).
    #[error("plugin could not run: {0}")]
    Unavailable(String),
}

impl PluginFailed {
    /// A stable, low-cardinality name for metrics and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            PluginFailed::OutOfFuel { .. } => "out_of_fuel",
            PluginFailed::TimedOut { .. } => "timed_out",
            PluginFailed::OutOfMemory { .. } => "out_of_memory",
            PluginFailed::Trap(_) => "trap",
            PluginFailed::Refused(_) => "refused",
            PluginFailed::InvalidPlan(_) => "invalid_plan",
            PluginFailed::Unavailable(_) => "unavailable",
        }
    }
}

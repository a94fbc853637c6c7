//! Planning: turning a validated order into the list of resource changes to attempt. The engine
//! asks a [`Planner`]; the built-in [`DefaultPlanner`] maps each line key to the resource of the
//! same key, all-or-nothing. Tenant plugins implement the same trait.

use serde::Serialize;
use utoipa::ToSchema;

use super::order::OrderRequest;
use super::types::{Kind, ResourceKey, TenantId};

/// Which planner produced a plan; recorded in every order document and ledger row.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize, ToSchema)]
pub struct PlannerRef {
    pub name: String,
    pub version: i64,
}

impl PlannerRef {
    pub fn builtin() -> Self {
        Self { name: "default".into(), version: 0 }
    }
}

/// How an order with some failing lines ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum PartialPolicy {
    /// Every line applies, or none does.
    AllOrNothing,
    /// Lines that can apply do; the order is `partial` when some could not.
    AllowPartial,
    /// Like `AllowPartial`, but the order is rejected unless every mandatory line applied.
    MandatoryLines,
}

/// One resource a planned line may take from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct Target {
    /// The canonical resource.
    pub resource: ResourceKey,
    /// The kind the resource must be, when the plan cares.
    pub kind: Option<Kind>,
    /// Create the resource with this allowance when it does not exist (e.g. a new quota period).
    pub create_if_missing: Option<i64>,
    /// The order in which a bucketed resource's buckets are tried; empty: the core's default.
    pub buckets: Vec<u16>,
}

impl Target {
    /// A plain target: this resource, any kind, no creation, default bucket order.
    pub fn plain(resource: ResourceKey) -> Self {
        Self { resource, kind: None, create_if_missing: None, buckets: Vec::new() }
    }
}

/// A per-user limit: the line applies only if `used(key) + qty <= max`, atomically with it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct LimitSpec {
    pub key: ResourceKey,
    pub max: i64,
}

/// The resource change the plan asks for one order line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct PlannedLine {
    /// Index of the order line this change serves.
    pub line: usize,
    pub qty: i64,
    /// With [`PartialPolicy::MandatoryLines`]: the order fails unless this line applies.
    pub mandatory: bool,
    /// At least one: the primary resource, then fallbacks tried in order.
    pub targets: Vec<Target>,
    pub limit: Option<LimitSpec>,
}

impl PlannedLine {
    /// The primary target (plans always have at least one).
    pub fn primary(&self) -> Option<&Target> {
        self.targets.first()
    }

    /// The smallest resource key this line may touch: lines are applied in this order so
    /// concurrent multi-line orders never wait on each other in a cycle.
    pub fn lock_key(&self) -> Option<&ResourceKey> {
        self.targets.iter().map(|t| &t.resource).min()
    }
}

/// The complete decision for one order, before anything is applied.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct Plan {
    pub planner: PlannerRef,
    pub policy: PartialPolicy,
    /// One entry per order line, in line order.
    pub lines: Vec<PlannedLine>,
}

impl Plan {
    /// The order in which lines are applied: by their smallest resource key, one global order,
    /// so concurrent multi-line orders never wait on each other's row locks in a cycle.
    pub fn lock_sequence(&self) -> Vec<usize> {
        let mut sequence: Vec<usize> = (0..self.lines.len()).collect();
        sequence.sort_by(|a, b| self.lines[*a].lock_key().cmp(&self.lines[*b].lock_key()));
        sequence
    }

    /// Every resource the plan may touch, for backends that lock rows up front.
    pub fn resources(&self) -> impl Iterator<Item = &ResourceKey> {
        self.lines.iter().flat_map(|l| l.targets.iter().map(|t| &t.resource))
    }
}

/// A planner that could not produce a usable plan; fails only its own request.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct PlanError(pub String);

/// Produces plans. Pure: no I/O, the caller passes `now`.
pub trait Planner: Send + Sync {
    fn plan(&self, tenant: &TenantId, order: &OrderRequest, now_ms: i64) -> Result<Plan, PlanError>;
}

/// The native plan used when a tenant has no plugin: line key = resource key, all-or-nothing.
pub struct DefaultPlanner;

impl Planner for DefaultPlanner {
    fn plan(&self, _tenant: &TenantId, order: &OrderRequest, _now_ms: i64) -> Result<Plan, PlanError> {
        let lines = order
            .lines
            .iter()
            .enumerate()
            .map(|(line, l)| PlannedLine {
                line,
                qty: l.qty.get(),
                mandatory: false,
                targets: vec![Target::plain(l.key.clone())],
                limit: None,
            })
            .collect();
        Ok(Plan { planner: PlannerRef::builtin(), policy: PartialPolicy::AllOrNothing, lines })
    }
}

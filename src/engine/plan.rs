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
}

/// One resource change the plan asks for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct PlannedLine {
    /// Index of the order line this change serves.
    pub line: usize,
    /// The canonical resource the line deducts from.
    pub resource: ResourceKey,
    /// The kind the plan expects the resource to be, when it cares.
    pub kind: Option<Kind>,
    pub qty: i64,
}

/// The complete decision for one order, before anything is applied.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct Plan {
    pub planner: PlannerRef,
    pub policy: PartialPolicy,
    /// One entry per order line, in line order.
    pub lines: Vec<PlannedLine>,
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
            .map(|(line, l)| PlannedLine { line, resource: l.key.clone(), kind: None, qty: l.qty.get() })
            .collect();
        Ok(Plan { planner: PlannerRef::builtin(), policy: PartialPolicy::AllOrNothing, lines })
    }
}

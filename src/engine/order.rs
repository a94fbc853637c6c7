//! Orders: the validated request, the per-line results storage reports, the pure decision that
//! turns those results into an order status, and the order document clients receive (and that
//! the idempotency record stores verbatim).

use std::collections::{BTreeMap, HashSet};

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::plan::{PartialPolicy, Plan, PlannerRef};
#[cfg(test)]
use super::plan::{PlannedLine, Target};
use super::types::{Action, InvalidValue, OrderId, Quantity, ResourceKey, UserId};
use crate::time::Timestamp;

/// Longest reservation a client may ask for: one week.
pub const MAX_TTL_SECONDS: i64 = 604_800;
const MAX_ATTRIBUTES: usize = 16;
const MAX_ATTRIBUTE_KEY_LEN: usize = 64;
const MAX_ATTRIBUTE_VALUE_LEN: usize = 256;

/// The body of `POST /v1/orders` as sent. Unknown fields are refused.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct OrderBody {
    pub order_id: OrderId,
    #[serde(default)]
    pub user_id: Option<UserId>,
    pub action: Action,
    /// Reserve only: seconds until an unconfirmed reservation is released (1..=604800).
    #[serde(default)]
    #[schema(minimum = 1, maximum = 604800)]
    pub ttl_seconds: Option<i64>,
    /// 1..=`[orders] max_lines` (100 by default, at most 1000).
    #[schema(min_items = 1, max_items = 1000)]
    pub lines: Vec<OrderLineBody>,
}

/// One line of an order as sent.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct OrderLineBody {
    pub key: ResourceKey,
    pub qty: Quantity,
    /// Free-form attributes the tenant's plan may use (warehouse, campaign, ...).
    #[serde(default)]
    pub attributes: Option<BTreeMap<String, String>>,
}

/// A fully validated order.
#[derive(Debug, Clone)]
pub struct OrderRequest {
    pub order_id: OrderId,
    pub user_id: Option<UserId>,
    pub action: Action,
    /// Reserve only; `None` means "the configured default".
    pub ttl_seconds: Option<i64>,
    pub lines: Vec<OrderLineBody>,
}

impl OrderBody {
    /// Applies the rules serde cannot express; the error names the offending field.
    pub fn validate(self, max_lines: usize) -> Result<OrderRequest, (String, InvalidValue)> {
        let invalid = |field: &str, msg: String| Err((field.to_string(), InvalidValue(msg)));
        if self.lines.is_empty() || self.lines.len() > max_lines {
            return invalid("lines", format!("must hold 1 to {max_lines} lines"));
        }
        match (self.action, self.ttl_seconds) {
            (Action::Deduct, Some(_)) => {
                return invalid("ttl_seconds", "is only allowed with action \"reserve\"".into())
            }
            (Action::Reserve, Some(ttl)) if !(1..=MAX_TTL_SECONDS).contains(&ttl) => {
                return invalid("ttl_seconds", format!("must be between 1 and {MAX_TTL_SECONDS}"))
            }
            _ => {}
        }
        let mut seen = HashSet::with_capacity(self.lines.len());
        for (i, line) in self.lines.iter().enumerate() {
            if !seen.insert(line.key.as_str()) {
                return invalid(&format!("lines[{i}].key"), format!("{} appears more than once", line.key));
            }
            if let Some(attrs) = &line.attributes {
                let too_long = attrs
                    .iter()
                    .any(|(k, v)| k.is_empty() || k.len() > MAX_ATTRIBUTE_KEY_LEN || v.len() > MAX_ATTRIBUTE_VALUE_LEN);
                if attrs.len() > MAX_ATTRIBUTES || too_long {
                    return invalid(
                        &format!("lines[{i}].attributes"),
                        format!(
                            "at most {MAX_ATTRIBUTES} entries, names 1-{MAX_ATTRIBUTE_KEY_LEN} bytes, values up to {MAX_ATTRIBUTE_VALUE_LEN} bytes"
                        ),
                    );
                }
            }
        }
        Ok(OrderRequest {
            order_id: self.order_id,
            user_id: self.user_id,
            action: self.action,
            ttl_seconds: self.ttl_seconds,
            lines: self.lines,
        })
    }
}

/// Why a line was not applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    Insufficient,
    LimitExceeded,
    ResourceNotFound,
    ResourceInactive,
    SoldOut,
    Skipped,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Insufficient => "insufficient",
            Reason::LimitExceeded => "limit_exceeded",
            Reason::ResourceNotFound => "resource_not_found",
            Reason::ResourceInactive => "resource_inactive",
            Reason::SoldOut => "sold_out",
            Reason::Skipped => "skipped",
        }
    }
}

/// What storage reports for one planned line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LineResult {
    /// Applied to the line's target of this index (0: the primary).
    Applied(usize),
    Rejected(Reason),
}

impl LineResult {
    pub fn applied(self) -> bool {
        matches!(self, LineResult::Applied(_))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum OrderStatus {
    Succeeded,
    Partial,
    Rejected,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum LineStatus {
    Applied,
    Rejected,
    Skipped,
}

/// The order's fate given each planned line's result (in plan order). Pure, so every backend
/// decides identically.
pub fn decide(plan: &Plan, results: &[LineResult]) -> OrderStatus {
    let applied = results.iter().filter(|r| r.applied()).count();
    let mandatory_missed = plan.lines.iter().zip(results).any(|(line, r)| line.mandatory && !r.applied());
    if applied == results.len() {
        OrderStatus::Succeeded
    } else if applied == 0 {
        OrderStatus::Rejected
    } else {
        match plan.policy {
            PartialPolicy::AllOrNothing => OrderStatus::Rejected,
            PartialPolicy::MandatoryLines if mandatory_missed => OrderStatus::Rejected,
            PartialPolicy::AllowPartial | PartialPolicy::MandatoryLines => OrderStatus::Partial,
        }
    }
}

/// One line of the order document.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct LineDocument {
    pub key: String,
    pub resource: String,
    pub qty: i64,
    pub applied: i64,
    pub status: LineStatus,
    pub reason: Option<Reason>,
}

/// The response to an order; stored verbatim as the idempotency record's body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct OrderDocument {
    pub order_id: String,
    pub status: OrderStatus,
    pub action: Action,
    pub reservation_id: Option<String>,
    #[schema(value_type = Option<String>, format = DateTime)]
    pub expires_at: Option<Timestamp>,
    pub lines: Vec<LineDocument>,
    pub plugin: PlannerRef,
}

impl OrderDocument {
    /// Builds the document from the plan and each line's result (in plan line order).
    /// A rejected all-or-nothing order reports lines that would have applied as `skipped`.
    pub fn build(
        order: &OrderRequest,
        plan: &Plan,
        results: &[LineResult],
        reservation: Option<(String, Timestamp)>,
    ) -> Self {
        let status = decide(plan, results);
        let lines = plan
            .lines
            .iter()
            .zip(results)
            .map(|(planned, result)| {
                let key = order.lines.get(planned.line).map(|l| l.key.to_string()).unwrap_or_default();
                let (line_status, applied, reason) = match (result, status) {
                    (LineResult::Applied(_), OrderStatus::Rejected) => (LineStatus::Skipped, 0, Some(Reason::Skipped)),
                    (LineResult::Applied(_), _) => (LineStatus::Applied, planned.qty, None),
                    (LineResult::Rejected(reason), _) => (LineStatus::Rejected, 0, Some(*reason)),
                };
                // The resource the line applied to (a fallback, perhaps), else its primary.
                let target = match (result, status) {
                    (LineResult::Applied(i), s) if s != OrderStatus::Rejected => planned.targets.get(*i),
                    _ => planned.primary(),
                };
                LineDocument {
                    key,
                    resource: target.map(|t| t.resource.to_string()).unwrap_or_default(),
                    qty: planned.qty,
                    applied,
                    status: line_status,
                    reason,
                }
            })
            .collect();
        let (reservation_id, expires_at) = match (status, reservation) {
            (OrderStatus::Rejected, _) | (_, None) => (None, None),
            (_, Some((id, at))) => (Some(id), Some(at)),
        };
        Self {
            order_id: order.order_id.to_string(),
            status,
            action: order.action,
            reservation_id,
            expires_at,
            lines,
            plugin: plan.planner.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(policy: PartialPolicy, mandatory: &[bool]) -> Plan {
        let lines = mandatory
            .iter()
            .enumerate()
            .map(|(line, &mandatory)| PlannedLine {
                line,
                qty: 1,
                mandatory,
                targets: vec![Target::plain(ResourceKey::parse(format!("k{line}")).unwrap_or_else(|e| panic!("{e}")))],
                limit: None,
            })
            .collect();
        Plan { planner: PlannerRef::builtin(), policy, lines }
    }

    #[test]
    fn all_or_nothing_rejects_on_any_failed_line() {
        let r = [LineResult::Applied(0), LineResult::Rejected(Reason::Insufficient)];
        assert_eq!(decide(&plan(PartialPolicy::AllOrNothing, &[false, false]), &r), OrderStatus::Rejected);
        assert_eq!(decide(&plan(PartialPolicy::AllowPartial, &[false, false]), &r), OrderStatus::Partial);
        assert_eq!(decide(&plan(PartialPolicy::AllowPartial, &[false]), &r[1..]), OrderStatus::Rejected);
        assert_eq!(decide(&plan(PartialPolicy::AllOrNothing, &[false]), &r[..1]), OrderStatus::Succeeded);
    }

    #[test]
    fn mandatory_lines_must_all_apply() {
        let r = [LineResult::Applied(1), LineResult::Rejected(Reason::Insufficient)];
        assert_eq!(decide(&plan(PartialPolicy::MandatoryLines, &[true, false]), &r), OrderStatus::Partial);
        assert_eq!(decide(&plan(PartialPolicy::MandatoryLines, &[true, true]), &r), OrderStatus::Rejected);
    }
}

//! Rules every backend applies the same way, as pure functions and shared constants: why a
//! line is refused, what a dry run predicts, how business actions are named.

use ulid::Ulid;

use crate::engine::{LineResult, PlannedLine, Reason, ResourceStatus, Target};

/// The resource columns every backend selects, in the order their row mappers expect.
pub const RESOURCE_COLUMNS: &str =
    "key, kind, status, available, reserved, consumed, total, buckets, mode, version, updated_at";

/// A new identity for one business action; the ledger's unique key includes it.
pub fn new_request_id() -> String {
    format!("req_{}", Ulid::new())
}

/// Why a line cannot apply to a target, judged from the resource's current row (`None`: it can).
pub fn line_refusal(row: Option<(String, String, i64)>, target: &Target, qty: i64) -> Option<Reason> {
    let Some((status, kind, available)) = row else { return Some(Reason::ResourceNotFound) };
    if target.kind.is_some_and(|k| k.as_str() != kind) {
        Some(Reason::ResourceNotFound)
    } else if status != ResourceStatus::Active.as_str() {
        Some(Reason::ResourceInactive)
    } else if available < qty {
        Some(Reason::Insufficient)
    } else {
        None
    }
}

/// What a line would do now, for the dry run: `used` is its limit key's count so far, `views`
/// the current rows of its targets (in order). Ignores interactions between lines of one order.
pub fn preview_line(line: &PlannedLine, used: i64, views: Vec<Option<(String, String, i64)>>) -> LineResult {
    if line.limit.as_ref().is_some_and(|l| used.saturating_add(line.qty) > l.max) {
        return LineResult::Rejected(Reason::LimitExceeded);
    }
    let mut first_refusal = None;
    for (i, (target, view)) in line.targets.iter().zip(views).enumerate() {
        let refusal = match (&view, target.create_if_missing) {
            (None, Some(allowance)) if allowance >= line.qty => None,
            (None, Some(_)) => Some(Reason::Insufficient),
            _ => line_refusal(view, target, line.qty),
        };
        match refusal {
            None => return LineResult::Applied(i),
            Some(reason) => {
                first_refusal.get_or_insert(reason);
            }
        }
    }
    LineResult::Rejected(first_refusal.unwrap_or(Reason::ResourceNotFound))
}

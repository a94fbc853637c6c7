//! Rules every backend applies the same way, as pure functions and shared constants: why a
//! line is refused, what a dry run predicts, how business actions are named.

use ulid::Ulid;

use crate::engine::{
    reconcile, LedgerOp, LedgerSum, LineResult, NewestEntry, PlannedLine, Reason, Reconciliation, ReservationLine,
    ResourceState, ResourceStatus, Target,
};
use crate::storage::{OrderJob, StorageError};

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

/// The lines a reservation holds, as stored (JSON): each applied line with the resource it took
/// from and the per-user limit it counted against, so release and expiry can give both back.
pub fn reservation_lines_json(job: &OrderJob, results: &[LineResult]) -> Result<String, StorageError> {
    let lines: Vec<ReservationLine> = job
        .plan
        .lines
        .iter()
        .zip(results)
        .filter_map(|(p, r)| match r {
            LineResult::Applied(target) => Some(ReservationLine {
                key: job.order.lines.get(p.line).map(|l| l.key.to_string()).unwrap_or_default(),
                resource: p.targets.get(*target).map(|t| t.resource.to_string()).unwrap_or_default(),
                qty: p.qty,
                limit_key: p.limit.as_ref().map(|l| l.key.to_string()),
            }),
            LineResult::Rejected(_) => None,
        })
        .collect();
    serde_json::to_string(&lines).map_err(|e| StorageError::Internal(e.to_string()))
}

/// Judges reconciliation from the rows both backends read in one snapshot: resources (with their
/// tenant, mapped by the backend), per-op ledger sums (`tenant_id, resource_key, op, qty, n`) and
/// each resource's newest entry (`tenant_id, resource_key, available_after, reserved_after,
/// consumed_after`).
pub fn reconcile_rows<R>(
    resources: Vec<(String, ResourceState)>,
    sums: &[R],
    latest: &[R],
) -> Result<Reconciliation, StorageError>
where
    R: sqlx::Row,
    for<'a> &'a str: sqlx::ColumnIndex<R>,
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    let sums = sums
        .iter()
        .map(|row| {
            let op: String = row.try_get("op")?;
            Ok(LedgerSum {
                tenant: row.try_get("tenant_id")?,
                key: row.try_get("resource_key")?,
                op: LedgerOp::from_db(&op).ok_or_else(|| StorageError::Internal("unexpected ledger op".into()))?,
                qty: row.try_get("qty")?,
                count: row.try_get("n")?,
            })
        })
        .collect::<Result<Vec<_>, StorageError>>()?;
    let newest = latest
        .iter()
        .map(|row| {
            Ok(NewestEntry {
                tenant: row.try_get("tenant_id")?,
                key: row.try_get("resource_key")?,
                after: [
                    row.try_get("available_after")?,
                    row.try_get("reserved_after")?,
                    row.try_get("consumed_after")?,
                ],
            })
        })
        .collect::<Result<Vec<_>, StorageError>>()?;
    Ok(reconcile(&resources, &sums, &newest))
}

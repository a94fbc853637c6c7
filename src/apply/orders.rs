//! An order on the database path, decided on its own: its key claimed, then each line in the
//! global lock order (its per-user limit, then its targets in order, creating a missing one when
//! the plan says so, falling back across buckets), the plan's policy, its reservation, and the
//! response stored under its key, all in the caller's transaction.

use ulid::Ulid;

use super::buckets;
use super::events;
use super::port::{Change, Entry, Gate, Move, NewReservation, Port, Row, Savepoint, View};
use super::resources::create;
use crate::engine::order::decide;
use crate::engine::ReservationLine;
use crate::engine::{
    Action, BucketTake, Kind, LedgerOp, LineResult, Mode, OrderDocument, OrderStatus, PlannedLine, Reason,
    ResourceStatus, Target, TenantId,
};
use crate::events::NewEvent;
use crate::storage::rules::{bucket_seed, new_request_id, reservation_lines};
use crate::storage::{Idempotent, NewResource, OrderExecution, OrderJob, StorageError, StoredResponse};
use crate::time::Timestamp;

/// Identity shared by every ledger row of one order (and, set per line, of one line).
#[derive(Clone, Copy)]
pub(super) struct OrderFacts<'a> {
    pub tenant: &'a TenantId,
    /// Picks the first bucket tried when the plan names none.
    pub seed: u64,
    pub action: Action,
    pub request_id: &'a str,
    pub order_id: &'a str,
    pub reservation_id: Option<&'a str>,
    pub plugin_version: Option<i64>,
    pub now_ms: i64,
    /// The line being applied: its key as sent, and its per-user limit.
    pub line_key: Option<&'a str>,
    pub limit_key: Option<&'a str>,
}

impl OrderFacts<'_> {
    fn entry<'e>(&'e self, resource: &'e str, qty: i64) -> Entry<'e> {
        Entry {
            tenant: self.tenant.as_str(),
            resource,
            bucket: 0,
            op: match self.action {
                Action::Deduct => LedgerOp::Deduct,
                Action::Reserve => LedgerOp::Reserve,
            },
            qty,
            request_id: self.request_id,
            order_id: Some(self.order_id),
            reservation_id: self.reservation_id,
            plugin_version: self.plugin_version,
            at: self.now_ms,
            line_key: self.line_key,
            limit_key: self.limit_key,
            reverses: None,
        }
    }

    fn how(&self) -> Move {
        match self.action {
            Action::Deduct => Move::Deduct,
            Action::Reserve => Move::Reserve,
        }
    }
}

/// A new reservation's id and deadline, for an order that reserves.
pub(super) fn new_reservation(job: &OrderJob, now_ms: i64) -> Option<(String, Timestamp)> {
    (job.order.action == Action::Reserve)
        .then(|| (format!("rsv_{}", Ulid::new()), Timestamp(now_ms.saturating_add(job.ttl_ms))))
}

/// Why a line cannot apply to a target, judged from its resource (`None`: it can).
pub fn refusal(view: Option<&View>, target: &Target, qty: i64) -> Option<Reason> {
    let Some(view) = view else { return Some(Reason::ResourceNotFound) };
    if target.kind.is_some_and(|k| k != view.kind) {
        Some(Reason::ResourceNotFound)
    } else if view.status != ResourceStatus::Active {
        Some(Reason::ResourceInactive)
    } else if view.available < qty {
        Some(Reason::Insufficient)
    } else {
        None
    }
}

/// Applies an order (or answers its key's first outcome).
pub async fn execute<P: Port>(port: &mut P, job: &OrderJob, now_ms: i64) -> Result<OrderExecution, StorageError> {
    if let Some(previous) = port.claim_key(&job.tenant, &job.idempotency, now_ms).await? {
        return Ok(OrderExecution { response: previous, outcome: None });
    }
    let request_id = new_request_id();
    let reservation = new_reservation(job, now_ms);
    let facts = OrderFacts {
        tenant: &job.tenant,
        seed: bucket_seed(job.tenant.as_str(), job.idempotency.key.as_str()),
        action: job.order.action,
        request_id: &request_id,
        order_id: job.order.order_id.as_str(),
        reservation_id: reservation.as_ref().map(|(id, _)| id.as_str()),
        plugin_version: Some(job.plan.planner.version),
        now_ms,
        line_key: None,
        limit_key: None,
    };
    // A single line that fails changed nothing, so only multi-line orders need a savepoint.
    let nested = job.plan.lines.len() > 1;
    if nested {
        port.savepoint(Savepoint::Lines).await?;
    }
    let mut results = vec![LineResult::Rejected(Reason::Skipped); job.plan.lines.len()];
    let mut takes = vec![Vec::new(); job.plan.lines.len()];
    for i in job.plan.lock_sequence() {
        let planned = &job.plan.lines[i];
        let facts = OrderFacts {
            line_key: job.order.lines.get(planned.line).map(|l| l.key.as_str()),
            limit_key: planned.limit.as_ref().map(|l| l.key.as_str()),
            ..facts
        };
        (results[i], takes[i]) = line(port, &facts, planned).await?;
    }
    let status = decide(&job.plan, &results);
    if nested {
        if status == OrderStatus::Rejected {
            port.rollback_to(Savepoint::Lines).await?;
        }
        port.release(Savepoint::Lines).await?;
    }
    let mut held = None;
    if status != OrderStatus::Rejected {
        if let Some((id, expires_at)) = &reservation {
            let (row, event) =
                held_reservation(job, id, *expires_at, reservation_lines(job, &results, &takes), now_ms)?;
            port.insert_reservation(&row).await?;
            held = Some(event);
        }
    }
    let response = order_response(job, &results, reservation)?;
    // An applied order's answer is its event's payload: the record keeps the event's id.
    let applied = (status != OrderStatus::Rejected)
        .then(|| events::order_applied_event(job.tenant.as_str(), job.order.order_id.as_str(), &response.body, now_ms));
    let event = applied.as_ref().map(|e| e.id.as_str());
    port.store_outcome(&job.tenant, &job.idempotency, &response, event, Some(&request_id), now_ms).await?;
    if let Some(applied) = applied {
        let tenant = job.tenant.as_str();
        port.emit(&applied).await?;
        if let Some(held) = held {
            port.emit(&held).await?;
        }
        let touched = job.plan.lines.iter().zip(&results).filter_map(|(line, result)| match result {
            LineResult::Applied(i) => line.targets.get(*i).map(|t| t.resource.as_str()),
            LineResult::Rejected(_) => None,
        });
        events::observe_all(port, tenant, touched, now_ms).await?;
    }
    Ok(OrderExecution { response: Idempotent::Fresh(response), outcome: Some((status, results)) })
}

/// A reserving order's reservation row, held, and its `reservation.held` event.
pub(super) fn held_reservation(
    job: &OrderJob,
    id: &str,
    expires_at: Timestamp,
    lines: Vec<ReservationLine>,
    now_ms: i64,
) -> Result<(NewReservation, NewEvent), StorageError> {
    let row = NewReservation {
        tenant: job.tenant.as_str().to_owned(),
        id: id.to_string(),
        order_id: job.order.order_id.as_str().to_owned(),
        lines: serde_json::to_string(&lines).map_err(|e| StorageError::Internal(e.to_string()))?,
        expires_at: expires_at.0,
        created_at: now_ms,
    };
    let event = events::held_event(&row, lines, now_ms);
    Ok((row, event))
}

/// The response to a decided order: 201 with its document, or 409 when it was rejected.
pub(super) fn order_response(
    job: &OrderJob,
    results: &[LineResult],
    reservation: Option<(String, Timestamp)>,
) -> Result<StoredResponse, StorageError> {
    let document = OrderDocument::build(&job.order, &job.plan, results, reservation);
    let code = if document.status == OrderStatus::Rejected { 409 } else { 201 };
    StoredResponse::json(code, &document)
}

/// Applies one planned line: its limit (if any), then the first target that can take it. A
/// line that fails leaves nothing behind.
async fn line<P: Port>(
    port: &mut P,
    facts: &OrderFacts<'_>,
    line: &PlannedLine,
) -> Result<(LineResult, Vec<BucketTake>), StorageError> {
    // Only a line with a limit, or one that may create a resource, can change something and
    // still fail; only those need a savepoint of their own.
    let nested = line.limit.is_some() || line.targets.iter().any(|t| t.create_if_missing.is_some());
    if nested {
        port.savepoint(Savepoint::Line).await?;
    }
    let result = line_inner(port, facts, line).await?;
    if nested {
        if !result.0.applied() {
            port.rollback_to(Savepoint::Line).await?;
        }
        port.release(Savepoint::Line).await?;
    }
    Ok(result)
}

async fn line_inner<P: Port>(
    port: &mut P,
    facts: &OrderFacts<'_>,
    line: &PlannedLine,
) -> Result<(LineResult, Vec<BucketTake>), StorageError> {
    if let Some(limit) = &line.limit {
        if line.qty > limit.max || !port.take_limit(facts.tenant.as_str(), limit, line.qty).await? {
            return Ok((LineResult::Rejected(Reason::LimitExceeded), Vec::new()));
        }
    }
    let mut first_refusal = None;
    for (i, target) in line.targets.iter().enumerate() {
        match apply_target(port, facts, line.qty, target).await? {
            Ok(takes) => return Ok((LineResult::Applied(i), takes)),
            Err(reason) => {
                first_refusal.get_or_insert(reason);
            }
        }
    }
    Ok((LineResult::Rejected(first_refusal.unwrap_or(Reason::ResourceNotFound)), Vec::new()))
}

/// One target: its guarded change first (one statement when it applies, the common case); on a
/// refusal, the resource is read to say why, created when it is missing and the plan allows, or
/// taken from bucket by bucket. `Ok`: applied, with what each bucket gave (empty for a
/// single-bucket resource); `Err(reason)`: refused, and nothing changed.
async fn apply_target<P: Port>(
    port: &mut P,
    facts: &OrderFacts<'_>,
    qty: i64,
    target: &Target,
) -> Result<Result<Vec<BucketTake>, Reason>, StorageError> {
    let tenant = facts.tenant.as_str();
    let resource = target.resource.as_str();
    let change = Change {
        row: Row::Resource,
        how: facts.how(),
        gate: Gate::Order { kind: target.kind },
        entry: facts.entry(resource, qty),
    };
    if port.change(&change).await?.is_some() {
        return Ok(Ok(Vec::new()));
    }
    let mut view = port.view(tenant, resource).await?;
    if let (None, Some(allowance)) = (&view, target.create_if_missing) {
        // Creates nothing when another process created it meanwhile; the change is judged again.
        let kind = target.kind.unwrap_or(Kind::Quota);
        let new = NewResource { key: target.resource.clone(), kind, total: allowance, buckets: 1, low_stock: None };
        create(port, facts.tenant, &new, facts.plugin_version, facts.now_ms).await?;
        if port.change(&change).await?.is_some() {
            return Ok(Ok(Vec::new()));
        }
        view = port.view(tenant, resource).await?;
    }
    match &view {
        // Sold by Redis alone: an order planned before this process learnt of the switch must not
        // take from the database copy. The client retries with the same key and reaches Redis.
        Some(v) if v.mode == Mode::Redis => Err(StorageError::RetryLater(format!("{resource} is sold in redis mode"))),
        Some(v) if v.buckets > 1 => match refusal(view.as_ref(), target, qty) {
            Some(reason) => Ok(Err(reason)),
            None => buckets::take(port, facts, target, v.buckets, qty).await,
        },
        // The guard refused, so some reason applied then; if the row changed since (another
        // process restocked it), the refusal was for want of stock.
        _ => Ok(Err(refusal(view.as_ref(), target, qty).unwrap_or(Reason::Insufficient))),
    }
}

/// The change a line makes to one bucket (for [`buckets::take`]).
pub(super) fn bucket_change<'e>(facts: &'e OrderFacts<'_>, resource: &'e str, bucket: i64, qty: i64) -> Change<'e> {
    Change {
        row: Row::Bucket(bucket),
        how: facts.how(),
        gate: Gate::Order { kind: None },
        entry: Entry { bucket, ..facts.entry(resource, qty) },
    }
}

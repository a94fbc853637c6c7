//! An order as its ledger tells it, and its reversals on the database path: the key claimed,
//! the order read from its ledger entries, what to give back decided
//! ([`crate::engine::reversal`]), then, line by line in resource and bucket order, the guarded
//! count of what the order line has had reversed (`reversed + qty <= taken`: the row that
//! serialises concurrent reversals of one order across processes) and the guarded
//! `consumed → available` change with its `reverse` ledger entry; the per-user limit given back;
//! the response stored under the key, and `order.reversed` emitted, all in the caller's
//! transaction. All or nothing: a line refused half-way rolls every line back.

use serde_json::json;
use ulid::Ulid;

use super::events;
use super::port::{Change, Entry, Gate, Move, Port, Row, Savepoint};
use crate::engine::reversal::{LineReversal, OrderLedger, ReversalDocument, ReversalLineBody, ReversalRefusal};
use crate::engine::{LedgerOp, Mode, OrderId, TenantId};
use crate::events::{order_key, EventType, NewEvent};
use crate::storage::{IdempotencyRequest, Idempotent, StorageError, StoredResponse};

/// Most `(resource, bucket, op)` groups of one order's ledger read: far beyond any order
/// (`[orders] max_lines` lines, each on one resource), so only a corrupt ledger reaches it.
pub const MAX_ORDER_GROUPS: u32 = 100_000;

/// A reversal to apply.
#[derive(Debug, Clone)]
pub struct ReversalJob {
    pub tenant: TenantId,
    pub idempotency: IdempotencyRequest,
    pub order_id: OrderId,
    /// What to give back; `None`: everything still reversible.
    pub lines: Option<Vec<ReversalLineBody>>,
    pub reason: Option<String>,
}

/// How a reversal ended on the database path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reversed {
    /// A fresh outcome (stored with its effects), or the key's first outcome.
    Answered(Idempotent),
    /// The tenant never applied this order: nothing stored, the key stays free.
    NotFound,
    /// The order has a line on a resource sold in redis mode: nothing written, the key stays
    /// free; redis mode decides and gives it back ([`crate::redis_mode`]). The order as its
    /// ledger tells it, and that resource.
    InRedis { order: OrderLedger, resource: String },
}

/// A new reversal's id: also the request id of its ledger entries.
pub fn new_reversal_id() -> String {
    format!("rev_{}", Ulid::new())
}

/// The order as its ledger entries tell it; `None` when the tenant never applied it.
pub async fn order<P: Port>(port: &mut P, tenant: &str, order_id: &str) -> Result<Option<OrderLedger>, StorageError> {
    let entries = port.order_entries(tenant, order_id, MAX_ORDER_GROUPS).await?;
    let mut bucketed = std::collections::HashSet::new();
    let mut seen = std::collections::HashSet::new();
    for e in &entries {
        if seen.insert(e.resource.as_str()) && port.view(tenant, &e.resource).await?.is_some_and(|v| v.buckets > 1) {
            bucketed.insert(e.resource.clone());
        }
    }
    Ok(OrderLedger::fold(order_id, &entries, |r| bucketed.contains(r)))
}

/// Stores a refusal as the key's outcome.
async fn refuse<P: Port>(
    port: &mut P,
    job: &ReversalJob,
    refusal: &ReversalRefusal,
    now_ms: i64,
) -> Result<Reversed, StorageError> {
    let response = StoredResponse::problem(&refusal.problem())?;
    port.store_outcome(&job.tenant, &job.idempotency, &response, None, None, now_ms).await?;
    Ok(Reversed::Answered(Idempotent::Fresh(response)))
}

/// Applies a reversal (or answers its key's first outcome). See the module docs.
pub async fn reverse<P: Port>(port: &mut P, job: &ReversalJob, now_ms: i64) -> Result<Reversed, StorageError> {
    if let Some(previous) = port.claim_key(&job.tenant, &job.idempotency, now_ms).await? {
        return Ok(Reversed::Answered(previous));
    }
    let (tenant, order_id) = (job.tenant.as_str(), job.order_id.as_str());
    let Some(order) = order(port, tenant, order_id).await? else {
        port.forget_key(&job.tenant, &job.idempotency).await?;
        return Ok(Reversed::NotFound);
    };
    // Decided by Redis, whose record of the key a refusal here must not hide.
    for line in &order.lines {
        if port.view(tenant, &line.resource).await?.is_some_and(|v| v.mode == Mode::Redis) {
            port.forget_key(&job.tenant, &job.idempotency).await?;
            let resource = line.resource.clone();
            return Ok(Reversed::InRedis { order, resource });
        }
    }
    let mut lines = match order.plan(job.lines.as_deref()) {
        Ok(lines) => lines,
        Err(refusal) => return refuse(port, job, &refusal, now_ms).await,
    };
    // One global order (resource, then bucket), so concurrent reversals never wait in a cycle.
    lines.sort_by(|a, b| a.resource.cmp(&b.resource));
    let reversal_id = new_reversal_id();
    port.savepoint(Savepoint::Lines).await?;
    for line in &lines {
        let Err(shortfall) = give_back(port, tenant, order_id, &reversal_id, line, false, now_ms).await? else {
            continue;
        };
        port.rollback_to(Savepoint::Lines).await?;
        port.release(Savepoint::Lines).await?;
        if shortfall == Shortfall::Consumed {
            return Err(match port.view(tenant, &line.resource).await? {
                // It entered redis mode after the read: decided again, through Redis.
                Some(v) if v.mode == Mode::Redis => {
                    StorageError::RetryLater(format!("{} is sold in redis mode", line.resource))
                }
                _ => StorageError::Internal(format!("{} has consumed less than order {order_id} took", line.resource)),
            });
        }
        let detail = format!("{}: another reversal of the order came first; read the order again", line.key);
        return refuse(port, job, &ReversalRefusal::Exceeds(detail), now_ms).await;
    }
    port.release(Savepoint::Lines).await?;
    let document = ReversalDocument::build(order_id, &reversal_id, job.reason.as_deref(), &lines);
    let response = StoredResponse::json(201, &document)?;
    port.store_outcome(&job.tenant, &job.idempotency, &response, None, None, now_ms).await?;
    emit_reversed(port, tenant, &document, now_ms).await?;
    events::observe_all(port, tenant, lines.iter().map(|l| l.resource.as_str()), now_ms).await?;
    Ok(Reversed::Answered(Idempotent::Fresh(response)))
}

/// Why [`give_back`] refused a line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shortfall {
    /// Other reversals of the order came first: this one no longer fits what it took.
    Reversed,
    /// The row refused the change: it consumed less than the order took (or, on the database
    /// path, it left db mode).
    Consumed,
}

/// `order.reversed`, with the reversal's document as its data.
pub async fn emit_reversed<P: Port>(
    port: &mut P,
    tenant: &str,
    document: &ReversalDocument,
    now_ms: i64,
) -> Result<(), StorageError> {
    let data = json!(document);
    port.emit(&NewEvent::new(tenant, EventType::OrderReversed, order_key(&document.order_id), now_ms, &data)).await
}

/// Gives one line back, bucket by bucket: the guarded count first (the row every reversal of
/// this order line updates), then the guarded change with its ledger entry, then the per-user
/// limit. `Err(shortfall)`: refused, the caller rolls the reversal back.
/// `settling`: a reversal Redis made (its resource is in redis mode, and only the counters may
/// refuse it).
pub async fn give_back<P: Port>(
    port: &mut P,
    tenant: &str,
    order_id: &str,
    reversal_id: &str,
    line: &LineReversal,
    settling: bool,
    now_ms: i64,
) -> Result<Result<(), Shortfall>, StorageError> {
    for take in &line.takes {
        if !port.take_reversal(tenant, order_id, &line.resource, take.bucket, take.taken, take.qty, now_ms).await? {
            return Ok(Err(Shortfall::Reversed));
        }
        let entry = Entry {
            tenant,
            resource: &line.resource,
            bucket: take.bucket,
            op: LedgerOp::Reverse,
            qty: take.qty,
            request_id: reversal_id,
            order_id: Some(order_id),
            reservation_id: None,
            plugin_version: None,
            at: now_ms,
            line_key: Some(&line.key),
            limit_key: line.limit_key.as_deref(),
            reverses: Some(&line.reverses),
        };
        let (row, gate) = if line.bucketed {
            (Row::Bucket(take.bucket), Gate::Counters)
        } else if settling {
            (Row::Resource, Gate::Counters)
        } else {
            // In db mode only: a resource sold in Redis is given back through Redis.
            (Row::Resource, Gate::Order { kind: None })
        };
        if port.change(&Change { row, how: Move::Reverse, gate, entry }).await?.is_none() {
            return Ok(Err(Shortfall::Consumed));
        }
    }
    if let Some(limit) = &line.limit_key {
        port.give_back_limit(tenant, limit, line.qty).await?;
    }
    Ok(Ok(()))
}

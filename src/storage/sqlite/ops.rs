//! The SQLite write operations, each run by the writer inside its own savepoint. Every deduction
//! is a guarded UPDATE judged by the row it returns; every state change writes its ledger row
//! in the same transaction; every idempotent request stores its response there too.

use sqlx::sqlite::SqliteRow;
use sqlx::{Executor, Row, SqliteConnection};
use ulid::Ulid;

use crate::engine::order::decide;
use crate::engine::{
    Action, Kind, LedgerOp, LineResult, Mode, OrderDocument, OrderStatus, PlannedLine, Reason, Reservation,
    ReservationLine, ReservationState, ResourceKey, ResourceState, ResourceStatus, TenantId, MAX_TOTAL,
};
use crate::problem::Problem;
use crate::storage::{
    AdjustRefusal, ContentType, IdempotencyRequest, Idempotent, NewResource, OrderExecution, OrderJob, StorageError,
    StoredResponse, Transition,
};
use crate::time::Timestamp;

pub const RESOURCE_COLUMNS: &str =
    "key, kind, status, available, reserved, consumed, total, buckets, mode, version, updated_at";

fn corrupt(what: &str) -> StorageError {
    StorageError::Internal(format!("unexpected stored value in {what}"))
}

pub fn resource_from_row(row: &SqliteRow) -> Result<ResourceState, StorageError> {
    Ok(ResourceState {
        key: row.try_get("key")?,
        kind: Kind::from_db(row.try_get("kind")?).ok_or_else(|| corrupt("resources.kind"))?,
        status: ResourceStatus::from_db(row.try_get("status")?).ok_or_else(|| corrupt("resources.status"))?,
        available: row.try_get("available")?,
        reserved: row.try_get("reserved")?,
        consumed: row.try_get("consumed")?,
        total: row.try_get("total")?,
        buckets: row.try_get("buckets")?,
        mode: Mode::from_db(row.try_get("mode")?).ok_or_else(|| corrupt("resources.mode"))?,
        version: row.try_get("version")?,
        updated_at: Timestamp(row.try_get("updated_at")?),
    })
}

pub fn reservation_from_row(row: &SqliteRow) -> Result<Reservation, StorageError> {
    let lines: String = row.try_get("lines")?;
    Ok(Reservation {
        id: row.try_get("id")?,
        order_id: row.try_get("order_id")?,
        state: ReservationState::from_db(row.try_get("state")?).ok_or_else(|| corrupt("reservations.state"))?,
        lines: serde_json::from_str(&lines).map_err(|_| corrupt("reservations.lines"))?,
        expires_at: Timestamp(row.try_get("expires_at")?),
    })
}

/// A new identity for one business action; the ledger's unique key includes it.
pub fn new_request_id() -> String {
    format!("req_{}", Ulid::new())
}

/// What the ledger row of one change records besides the counters.
struct LedgerFacts<'a> {
    tenant: &'a str,
    resource: &'a str,
    op: LedgerOp,
    qty: i64,
    request_id: &'a str,
    order_id: Option<&'a str>,
    reservation_id: Option<&'a str>,
    plugin_version: Option<i64>,
    now_ms: i64,
}

/// Appends a ledger row carrying the counters the guarded UPDATE returned.
async fn append_ledger(
    conn: &mut SqliteConnection,
    facts: LedgerFacts<'_>,
    after: &SqliteRow,
) -> Result<(), StorageError> {
    let available: i64 = after.try_get("available")?;
    let reserved: i64 = after.try_get("reserved")?;
    let consumed: i64 = after.try_get("consumed")?;
    let version: i64 = after.try_get("version")?;
    sqlx::query(
        "INSERT INTO ledger (tenant_id, resource_key, bucket, op, qty, request_id, order_id, reservation_id,
                             available_after, reserved_after, consumed_after, version_after, plugin_version, at)
         VALUES ($1, $2, 0, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)",
    )
    .bind(facts.tenant)
    .bind(facts.resource)
    .bind(facts.op.as_str())
    .bind(facts.qty)
    .bind(facts.request_id)
    .bind(facts.order_id)
    .bind(facts.reservation_id)
    .bind(available)
    .bind(reserved)
    .bind(consumed)
    .bind(version)
    .bind(facts.plugin_version)
    .bind(facts.now_ms)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// The first outcome of an idempotency key, if it was used before.
async fn idempotency_lookup(
    conn: &mut SqliteConnection,
    tenant: &TenantId,
    idem: &IdempotencyRequest,
) -> Result<Option<Idempotent>, StorageError> {
    let row = sqlx::query(
        "SELECT request_hash, response_code, response_type, response_body FROM idempotency
         WHERE tenant_id = $1 AND key = $2",
    )
    .bind(tenant.as_str())
    .bind(idem.key.as_str())
    .fetch_optional(&mut *conn)
    .await?;
    let Some(row) = row else { return Ok(None) };
    let hash: String = row.try_get("request_hash")?;
    if hash != idem.request_hash {
        return Ok(Some(Idempotent::Mismatch));
    }
    let status: i64 = row.try_get("response_code")?;
    let kind: String = row.try_get("response_type")?;
    Ok(Some(Idempotent::Replayed(StoredResponse {
        status: u16::try_from(status).map_err(|_| corrupt("idempotency.response_code"))?,
        content_type: ContentType::from_db(&kind),
        body: row.try_get("response_body")?,
    })))
}

async fn idempotency_store(
    conn: &mut SqliteConnection,
    tenant: &TenantId,
    idem: &IdempotencyRequest,
    response: &StoredResponse,
    now_ms: i64,
) -> Result<(), StorageError> {
    sqlx::query(
        "INSERT INTO idempotency (tenant_id, key, request_hash, response_code, response_type, response_body, created_at)
         VALUES ($1, $2, $3, $4, $5, $6, $7)",
    )
    .bind(tenant.as_str())
    .bind(idem.key.as_str())
    .bind(&idem.request_hash)
    .bind(i64::from(response.status))
    .bind(response.content_type.as_str())
    .bind(&response.body)
    .bind(now_ms)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

pub async fn create_resource(
    conn: &mut SqliteConnection,
    tenant: TenantId,
    res: NewResource,
    now_ms: i64,
) -> Result<Option<ResourceState>, StorageError> {
    let row = sqlx::query(&format!(
        "INSERT INTO resources (tenant_id, key, kind, status, mode, buckets, total, available, reserved, consumed,
                                version, created_at, updated_at)
         VALUES ($1, $2, $3, 'active', 'db', 1, $4, $4, 0, 0, 1, $5, $5)
         ON CONFLICT (tenant_id, key) DO NOTHING
         RETURNING {RESOURCE_COLUMNS}"
    ))
    .bind(tenant.as_str())
    .bind(res.key.as_str())
    .bind(res.kind.as_str())
    .bind(res.total)
    .bind(now_ms)
    .fetch_optional(&mut *conn)
    .await?;
    let Some(row) = row else { return Ok(None) };
    let facts = LedgerFacts {
        tenant: tenant.as_str(),
        resource: res.key.as_str(),
        op: LedgerOp::Create,
        qty: res.total,
        request_id: "create",
        order_id: None,
        reservation_id: None,
        plugin_version: None,
        now_ms,
    };
    append_ledger(conn, facts, &row).await?;
    resource_from_row(&row).map(Some)
}

pub async fn set_resource_status(
    conn: &mut SqliteConnection,
    tenant: TenantId,
    key: ResourceKey,
    status: ResourceStatus,
    now_ms: i64,
) -> Result<Option<ResourceState>, StorageError> {
    let row = sqlx::query(&format!(
        "UPDATE resources SET status = $1, updated_at = $2 WHERE tenant_id = $3 AND key = $4 RETURNING {RESOURCE_COLUMNS}"
    ))
    .bind(status.as_str())
    .bind(now_ms)
    .bind(tenant.as_str())
    .bind(key.as_str())
    .fetch_optional(&mut *conn)
    .await?;
    row.as_ref().map(resource_from_row).transpose()
}

pub async fn adjust(
    conn: &mut SqliteConnection,
    tenant: TenantId,
    idem: IdempotencyRequest,
    key: ResourceKey,
    delta: i64,
    now_ms: i64,
) -> Result<Result<Idempotent, AdjustRefusal>, StorageError> {
    if let Some(previous) = idempotency_lookup(conn, &tenant, &idem).await? {
        return Ok(Ok(previous));
    }
    let row = sqlx::query(&format!(
        "UPDATE resources SET available = available + $1, total = total + $1, version = version + 1, updated_at = $2
         WHERE tenant_id = $3 AND key = $4 AND available + $1 >= 0 AND total + $1 <= $5
         RETURNING {RESOURCE_COLUMNS}"
    ))
    .bind(delta)
    .bind(now_ms)
    .bind(tenant.as_str())
    .bind(key.as_str())
    .bind(MAX_TOTAL)
    .fetch_optional(&mut *conn)
    .await?;
    let response = match row {
        Some(row) => {
            let request_id = new_request_id();
            let facts = LedgerFacts {
                tenant: tenant.as_str(),
                resource: key.as_str(),
                op: LedgerOp::Adjust,
                qty: delta,
                request_id: &request_id,
                order_id: None,
                reservation_id: None,
                plugin_version: None,
                now_ms,
            };
            append_ledger(conn, facts, &row).await?;
            StoredResponse::json(200, &resource_from_row(&row)?)?
        }
        None => {
            let current = sqlx::query("SELECT available, total FROM resources WHERE tenant_id = $1 AND key = $2")
                .bind(tenant.as_str())
                .bind(key.as_str())
                .fetch_optional(&mut *conn)
                .await?;
            let Some(current) = current else { return Ok(Err(AdjustRefusal::ResourceNotFound)) };
            let available: i64 = current.try_get("available")?;
            let problem = if delta < 0 {
                Problem::new(
                    409,
                    "insufficient",
                    "Insufficient stock",
                    format!("{key} has {available} available, write-off of {} requested", -delta),
                )
            } else {
                Problem::new(
                    422,
                    "total_out_of_range",
                    "Total out of range",
                    format!("{key} would exceed the largest total, {MAX_TOTAL}"),
                )
            };
            StoredResponse::problem(&problem)?
        }
    };
    idempotency_store(conn, &tenant, &idem, &response, now_ms).await?;
    Ok(Ok(Idempotent::Fresh(response)))
}

const DEDUCT_SQL: &str = "UPDATE resources SET available = available - $1, consumed = consumed + $1,
        version = version + 1, updated_at = $2
    WHERE tenant_id = $3 AND key = $4 AND status = 'active' AND available >= $1 AND ($5 IS NULL OR kind = $5)
    RETURNING available, reserved, consumed, version";
const RESERVE_SQL: &str = "UPDATE resources SET available = available - $1, reserved = reserved + $1,
        version = version + 1, updated_at = $2
    WHERE tenant_id = $3 AND key = $4 AND status = 'active' AND available >= $1 AND ($5 IS NULL OR kind = $5)
    RETURNING available, reserved, consumed, version";

/// Why a guarded UPDATE matched no row: the line's reason.
async fn refusal_reason(
    conn: &mut SqliteConnection,
    tenant: &TenantId,
    line: &PlannedLine,
) -> Result<Reason, StorageError> {
    let row = sqlx::query("SELECT status, kind FROM resources WHERE tenant_id = $1 AND key = $2")
        .bind(tenant.as_str())
        .bind(line.resource.as_str())
        .fetch_optional(&mut *conn)
        .await?;
    let Some(row) = row else { return Ok(Reason::ResourceNotFound) };
    let status: String = row.try_get("status")?;
    let kind: String = row.try_get("kind")?;
    Ok(match line.kind {
        Some(expected) if expected.as_str() != kind => Reason::ResourceNotFound,
        _ if status != ResourceStatus::Active.as_str() => Reason::ResourceInactive,
        _ => Reason::Insufficient,
    })
}

/// Identity shared by every ledger row of one order.
struct OrderFacts<'a> {
    tenant: &'a TenantId,
    action: Action,
    request_id: &'a str,
    order_id: &'a str,
    reservation_id: Option<&'a str>,
    plugin_version: Option<i64>,
    now_ms: i64,
}

async fn apply_line(
    conn: &mut SqliteConnection,
    facts: &OrderFacts<'_>,
    line: &PlannedLine,
) -> Result<LineResult, StorageError> {
    let (sql, op) = match facts.action {
        Action::Deduct => (DEDUCT_SQL, LedgerOp::Deduct),
        Action::Reserve => (RESERVE_SQL, LedgerOp::Reserve),
    };
    let row = sqlx::query(sql)
        .bind(line.qty)
        .bind(facts.now_ms)
        .bind(facts.tenant.as_str())
        .bind(line.resource.as_str())
        .bind(line.kind.map(Kind::as_str))
        .fetch_optional(&mut *conn)
        .await?;
    let Some(row) = row else {
        return Ok(LineResult::Rejected(refusal_reason(conn, facts.tenant, line).await?));
    };
    let ledger = LedgerFacts {
        tenant: facts.tenant.as_str(),
        resource: line.resource.as_str(),
        op,
        qty: line.qty,
        request_id: facts.request_id,
        order_id: Some(facts.order_id),
        reservation_id: facts.reservation_id,
        plugin_version: facts.plugin_version,
        now_ms: facts.now_ms,
    };
    append_ledger(conn, ledger, &row).await?;
    Ok(LineResult::Applied)
}

pub async fn execute_order(
    conn: &mut SqliteConnection,
    job: OrderJob,
    now_ms: i64,
) -> Result<OrderExecution, StorageError> {
    if let Some(previous) = idempotency_lookup(conn, &job.tenant, &job.idempotency).await? {
        return Ok(OrderExecution { response: previous, outcome: None });
    }
    let request_id = new_request_id();
    let reservation = (job.order.action == Action::Reserve)
        .then(|| (format!("rsv_{}", Ulid::new()), Timestamp(now_ms.saturating_add(job.ttl_ms))));
    let facts = OrderFacts {
        tenant: &job.tenant,
        action: job.order.action,
        request_id: &request_id,
        order_id: job.order.order_id.as_str(),
        reservation_id: reservation.as_ref().map(|(id, _)| id.as_str()),
        plugin_version: Some(job.plan.planner.version),
        now_ms,
    };
    // Lines are applied in one global order (by resource key) so that concurrent multi-line
    // orders on a shared database can never wait on each other in a cycle.
    let mut sequence: Vec<usize> = (0..job.plan.lines.len()).collect();
    sequence.sort_by(|a, b| job.plan.lines[*a].resource.cmp(&job.plan.lines[*b].resource));
    // A single line that fails changed nothing, so only multi-line orders need a savepoint.
    let nested = job.plan.lines.len() > 1;
    if nested {
        conn.execute("SAVEPOINT lines").await?;
    }
    let mut results = vec![LineResult::Applied; job.plan.lines.len()];
    for i in sequence {
        results[i] = apply_line(conn, &facts, &job.plan.lines[i]).await?;
    }
    let status = decide(job.plan.policy, &results);
    if nested {
        let end = if status == OrderStatus::Rejected { "ROLLBACK TO lines; RELEASE lines" } else { "RELEASE lines" };
        conn.execute(end).await?;
    }
    if status != OrderStatus::Rejected {
        if let Some((id, expires_at)) = &reservation {
            insert_reservation(conn, &job, &results, id, *expires_at, now_ms).await?;
        }
    }
    let document = OrderDocument::build(&job.order, &job.plan, &results, reservation);
    let code = if status == OrderStatus::Rejected { 409 } else { 201 };
    let response = StoredResponse::json(code, &document)?;
    idempotency_store(conn, &job.tenant, &job.idempotency, &response, now_ms).await?;
    Ok(OrderExecution { response: Idempotent::Fresh(response), outcome: Some((status, results)) })
}

async fn insert_reservation(
    conn: &mut SqliteConnection,
    job: &OrderJob,
    results: &[LineResult],
    id: &str,
    expires_at: Timestamp,
    now_ms: i64,
) -> Result<(), StorageError> {
    let lines: Vec<ReservationLine> = job
        .plan
        .lines
        .iter()
        .zip(results)
        .filter(|(_, r)| **r == LineResult::Applied)
        .map(|(p, _)| ReservationLine {
            key: job.order.lines.get(p.line).map(|l| l.key.to_string()).unwrap_or_default(),
            resource: p.resource.to_string(),
            qty: p.qty,
        })
        .collect();
    let lines = serde_json::to_string(&lines).map_err(|e| StorageError::Internal(e.to_string()))?;
    sqlx::query(
        "INSERT INTO reservations (tenant_id, id, order_id, state, lines, expires_at, created_at, updated_at)
         VALUES ($1, $2, $3, 'held', $4, $5, $6, $6)",
    )
    .bind(job.tenant.as_str())
    .bind(id)
    .bind(job.order.order_id.as_str())
    .bind(lines)
    .bind(expires_at.0)
    .bind(now_ms)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

async fn load_reservation(
    conn: &mut SqliteConnection,
    tenant: &str,
    id: &str,
) -> Result<Option<Reservation>, StorageError> {
    let row =
        sqlx::query("SELECT id, order_id, state, lines, expires_at FROM reservations WHERE tenant_id = $1 AND id = $2")
            .bind(tenant)
            .bind(id)
            .fetch_optional(&mut *conn)
            .await?;
    row.as_ref().map(reservation_from_row).transpose()
}

/// Moves a held reservation to `to` (confirmed, released or expired): its lines leave
/// `reserved`, each with a ledger row, and the state changes only if it is still `held`.
async fn finish_reservation(
    conn: &mut SqliteConnection,
    tenant: &str,
    mut reservation: Reservation,
    to: ReservationState,
    now_ms: i64,
) -> Result<Reservation, StorageError> {
    let (op, sql) = match to {
        ReservationState::Confirmed => (
            LedgerOp::Confirm,
            "UPDATE resources SET reserved = reserved - $1, consumed = consumed + $1, version = version + 1, updated_at = $2
             WHERE tenant_id = $3 AND key = $4 AND reserved >= $1 RETURNING available, reserved, consumed, version",
        ),
        ReservationState::Released | ReservationState::Expired => (
            if to == ReservationState::Released { LedgerOp::Release } else { LedgerOp::Expire },
            "UPDATE resources SET reserved = reserved - $1, available = available + $1, version = version + 1, updated_at = $2
             WHERE tenant_id = $3 AND key = $4 AND reserved >= $1 RETURNING available, reserved, consumed, version",
        ),
        ReservationState::Held => return Err(StorageError::Internal("a reservation cannot move back to held".into())),
    };
    let moved = sqlx::query(
        "UPDATE reservations SET state = $1, updated_at = $2 WHERE tenant_id = $3 AND id = $4 AND state = 'held'",
    )
    .bind(to.as_str())
    .bind(now_ms)
    .bind(tenant)
    .bind(&reservation.id)
    .execute(&mut *conn)
    .await?;
    if moved.rows_affected() != 1 {
        return Err(StorageError::Internal(format!("reservation {} was not held", reservation.id)));
    }
    let mut lines = reservation.lines.clone();
    lines.sort_by(|a, b| a.resource.cmp(&b.resource));
    for line in &lines {
        let row = sqlx::query(sql)
            .bind(line.qty)
            .bind(now_ms)
            .bind(tenant)
            .bind(&line.resource)
            .fetch_optional(&mut *conn)
            .await?;
        let Some(row) = row else {
            return Err(StorageError::Internal(format!(
                "resource of reservation {} holds less than reserved",
                reservation.id
            )));
        };
        let facts = LedgerFacts {
            tenant,
            resource: &line.resource,
            op,
            qty: line.qty,
            request_id: &reservation.id,
            order_id: Some(&reservation.order_id),
            reservation_id: Some(&reservation.id),
            plugin_version: None,
            now_ms,
        };
        append_ledger(conn, facts, &row).await?;
    }
    reservation.state = to;
    Ok(reservation)
}

pub async fn confirm_reservation(
    conn: &mut SqliteConnection,
    tenant: TenantId,
    id: String,
    now_ms: i64,
) -> Result<Transition, StorageError> {
    let Some(reservation) = load_reservation(conn, tenant.as_str(), &id).await? else {
        return Ok(Transition::NotFound);
    };
    Ok(match reservation.state {
        ReservationState::Confirmed => Transition::Done(reservation),
        ReservationState::Released | ReservationState::Expired => Transition::Refused(reservation.state, reservation),
        // Past its deadline but not yet swept: it is expired, and expiring it now keeps the
        // sweeper from racing a late confirm.
        ReservationState::Held if reservation.expires_at.0 <= now_ms => {
            let expired =
                finish_reservation(conn, tenant.as_str(), reservation, ReservationState::Expired, now_ms).await?;
            metrics::counter!("stockd_reservations_expired_total").increment(1);
            Transition::Refused(ReservationState::Expired, expired)
        }
        ReservationState::Held => Transition::Done(
            finish_reservation(conn, tenant.as_str(), reservation, ReservationState::Confirmed, now_ms).await?,
        ),
    })
}

pub async fn release_reservation(
    conn: &mut SqliteConnection,
    tenant: TenantId,
    id: String,
    now_ms: i64,
) -> Result<Transition, StorageError> {
    let Some(reservation) = load_reservation(conn, tenant.as_str(), &id).await? else {
        return Ok(Transition::NotFound);
    };
    Ok(match reservation.state {
        ReservationState::Released | ReservationState::Expired => Transition::Done(reservation),
        ReservationState::Confirmed => Transition::Refused(ReservationState::Confirmed, reservation),
        ReservationState::Held => Transition::Done(
            finish_reservation(conn, tenant.as_str(), reservation, ReservationState::Released, now_ms).await?,
        ),
    })
}

pub async fn expire_due(conn: &mut SqliteConnection, now_ms: i64, limit: u32) -> Result<u64, StorageError> {
    let rows = sqlx::query(
        "SELECT tenant_id, id, order_id, state, lines, expires_at FROM reservations
         WHERE state = 'held' AND expires_at <= $1 ORDER BY expires_at LIMIT $2",
    )
    .bind(now_ms)
    .bind(i64::from(limit))
    .fetch_all(&mut *conn)
    .await?;
    let mut expired = 0;
    for row in rows {
        let tenant: String = row.try_get("tenant_id")?;
        let reservation = reservation_from_row(&row)?;
        finish_reservation(conn, &tenant, reservation, ReservationState::Expired, now_ms).await?;
        expired += 1;
    }
    Ok(expired)
}

pub async fn purge_idempotency(conn: &mut SqliteConnection, before_ms: i64, limit: u32) -> Result<u64, StorageError> {
    let done = sqlx::query(
        "DELETE FROM idempotency WHERE (tenant_id, key) IN
           (SELECT tenant_id, key FROM idempotency WHERE created_at < $1 LIMIT $2)",
    )
    .bind(before_ms)
    .bind(i64::from(limit))
    .execute(&mut *conn)
    .await?;
    Ok(done.rows_affected())
}

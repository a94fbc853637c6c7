//! The SQLite write operations, each run by the writer thread inside its own savepoint. Every
//! deduction is a guarded UPDATE judged by the row it returns; every state change writes its
//! ledger row in the same transaction; every idempotent request stores its response there too.
//! Statements are prepared once per connection (`prepare_cached`) and run in-process on the
//! writer thread, so an order costs a few microseconds of SQLite work and no thread hops.

use std::collections::{HashMap, HashSet};

use rusqlite::{params, Connection, OptionalExtension, Row};
use ulid::Ulid;

use super::buckets;
use crate::engine::admission;
use crate::engine::order::decide;
use crate::engine::{
    Action, BucketTake, Kind, LedgerOp, LimitSpec, LineResult, Mode, OrderDocument, OrderStatus, PlannedLine, Reason,
    Reservation, ReservationState, ResourceKey, ResourceState, ResourceStatus, Target, TenantId, MAX_TOTAL,
};
use crate::ratelimit::RateLimit;
use crate::storage::rules::{
    self, adjust_refusal, bucket_seed, line_refusal, new_request_id, reservation_lines_json, LineView, RESOURCE_COLUMNS,
};
use crate::storage::{
    AdjustRefusal, ContentType, IdempotencyRequest, Idempotent, Insert, NewApiKey, NewResource, OrderExecution,
    OrderJob, PluginUpload, PluginVersion, StorageError, StoredResponse, Transition,
};
use crate::time::Timestamp;

impl From<rusqlite::Error> for StorageError {
    fn from(err: rusqlite::Error) -> Self {
        use rusqlite::ErrorCode as C;
        match err.sqlite_error_code() {
            Some(
                C::DatabaseBusy
                | C::DatabaseLocked
                | C::SystemIoFailure
                | C::DiskFull
                | C::CannotOpen
                | C::FileLockingProtocolFailed
                | C::OutOfMemory,
            ) => StorageError::Unavailable(err.to_string()),
            _ => StorageError::Internal(err.to_string()),
        }
    }
}

pub(super) fn corrupt(what: &str) -> StorageError {
    StorageError::Internal(format!("unexpected stored value in {what}"))
}

fn resource_from_row(row: &Row<'_>) -> rusqlite::Result<Result<ResourceState, StorageError>> {
    let kind: String = row.get("kind")?;
    let status: String = row.get("status")?;
    let mode: String = row.get("mode")?;
    let (Some(kind), Some(status), Some(mode)) =
        (Kind::from_db(&kind), ResourceStatus::from_db(&status), Mode::from_db(&mode))
    else {
        return Ok(Err(corrupt("resources")));
    };
    Ok(Ok(ResourceState {
        key: row.get("key")?,
        kind,
        status,
        available: row.get("available")?,
        reserved: row.get("reserved")?,
        consumed: row.get("consumed")?,
        total: row.get("total")?,
        buckets: row.get("buckets")?,
        mode,
        version: row.get("version")?,
        updated_at: Timestamp(row.get("updated_at")?),
        bucket_counts: None,
    }))
}

fn reservation_from_row(row: &Row<'_>) -> rusqlite::Result<Result<Reservation, StorageError>> {
    let state: String = row.get("state")?;
    let lines: String = row.get("lines")?;
    let (Some(state), Ok(lines)) = (ReservationState::from_db(&state), serde_json::from_str(&lines)) else {
        return Ok(Err(corrupt("reservations")));
    };
    Ok(Ok(Reservation {
        id: row.get("id")?,
        order_id: row.get("order_id")?,
        state,
        lines,
        expires_at: Timestamp(row.get("expires_at")?),
    }))
}

/// Counters a guarded UPDATE returned, for the ledger row.
#[derive(Debug, Clone, Copy)]
pub(super) struct After {
    available: i64,
    reserved: i64,
    consumed: i64,
    version: i64,
}

impl After {
    pub(super) fn from_row(row: &Row<'_>) -> rusqlite::Result<Self> {
        Ok(Self {
            available: row.get("available")?,
            reserved: row.get("reserved")?,
            consumed: row.get("consumed")?,
            version: row.get("version")?,
        })
    }
}

/// What the ledger row of one change records besides the counters.
pub(super) struct LedgerFacts<'a> {
    pub tenant: &'a str,
    pub resource: &'a str,
    pub bucket: i64,
    pub op: LedgerOp,
    pub qty: i64,
    pub request_id: &'a str,
    pub order_id: Option<&'a str>,
    pub reservation_id: Option<&'a str>,
    pub plugin_version: Option<i64>,
    pub now_ms: i64,
}

pub(super) fn append_ledger(conn: &Connection, f: LedgerFacts<'_>, after: After) -> Result<(), StorageError> {
    conn.prepare_cached(
        "INSERT INTO ledger (tenant_id, resource_key, bucket, op, qty, request_id, order_id, reservation_id,
                             available_after, reserved_after, consumed_after, version_after, plugin_version, at)
         VALUES (?1, ?2, ?14, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13)",
    )?
    .execute(params![
        f.tenant,
        f.resource,
        f.op.as_str(),
        f.qty,
        f.request_id,
        f.order_id,
        f.reservation_id,
        after.available,
        after.reserved,
        after.consumed,
        after.version,
        f.plugin_version,
        f.now_ms,
        f.bucket
    ])?;
    Ok(())
}

/// The first outcome of an idempotency key, if it was used before.
fn idempotency_lookup(
    conn: &Connection,
    tenant: &TenantId,
    idem: &IdempotencyRequest,
) -> Result<Option<Idempotent>, StorageError> {
    let row = conn
        .prepare_cached(
            "SELECT request_hash, response_code, response_type, response_body FROM idempotency
             WHERE tenant_id = ?1 AND key = ?2",
        )?
        .query_row(params![tenant.as_str(), idem.key.as_str()], |row| {
            Ok((row.get::<_, String>(0)?, row.get::<_, i64>(1)?, row.get::<_, String>(2)?, row.get::<_, String>(3)?))
        })
        .optional()?;
    let Some((hash, status, kind, body)) = row else { return Ok(None) };
    if hash != idem.request_hash {
        return Ok(Some(Idempotent::Mismatch));
    }
    Ok(Some(Idempotent::Replayed(StoredResponse {
        status: u16::try_from(status).map_err(|_| corrupt("idempotency.response_code"))?,
        content_type: ContentType::from_db(&kind),
        body,
    })))
}

fn idempotency_store(
    conn: &Connection,
    tenant: &TenantId,
    idem: &IdempotencyRequest,
    response: &StoredResponse,
    now_ms: i64,
) -> Result<(), StorageError> {
    conn.prepare_cached(
        "INSERT INTO idempotency (tenant_id, key, request_hash, response_code, response_type, response_body, created_at)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
    )?
    .execute(params![
        tenant.as_str(),
        idem.key.as_str(),
        idem.request_hash,
        i64::from(response.status),
        response.content_type.as_str(),
        response.body,
        now_ms
    ])?;
    Ok(())
}

pub fn create_tenant(
    conn: &Connection,
    id: &TenantId,
    name: &str,
    rate_limit: Option<RateLimit>,
    key: &NewApiKey,
    now_ms: i64,
) -> Result<Insert, StorageError> {
    let (rps, burst) = rules::rate_limit_columns(rate_limit);
    let created = conn
        .prepare_cached(
            "INSERT INTO tenants (id, name, created_at, rate_limit_rps, rate_limit_burst) VALUES (?1, ?2, ?3, ?4, ?5)
             ON CONFLICT (id) DO NOTHING",
        )?
        .execute(params![id.as_str(), name, now_ms, rps, burst])?;
    if created == 0 {
        return Ok(Insert::AlreadyExists);
    }
    conn.prepare_cached("INSERT INTO api_keys (id, tenant_id, hash, created_at) VALUES (?1, ?2, ?3, ?4)")?
        .execute(params![key.id, id.as_str(), key.hash, now_ms])?;
    Ok(Insert::Created)
}

pub fn add_api_key(
    conn: &Connection,
    tenant: &TenantId,
    key: &NewApiKey,
    now_ms: i64,
) -> Result<Option<()>, StorageError> {
    let added = conn
        .prepare_cached(
            "INSERT INTO api_keys (id, tenant_id, hash, created_at) SELECT ?1, id, ?2, ?3 FROM tenants WHERE id = ?4",
        )?
        .execute(params![key.id, key.hash, now_ms, tenant.as_str()])?;
    Ok((added == 1).then_some(()))
}

pub fn revoke_api_key(
    conn: &Connection,
    tenant: &TenantId,
    key_id: &str,
    now_ms: i64,
) -> Result<Option<()>, StorageError> {
    let revoked = conn
        .prepare_cached("UPDATE api_keys SET revoked_at = ?1 WHERE id = ?2 AND tenant_id = ?3 AND revoked_at IS NULL")?
        .execute(params![now_ms, key_id, tenant.as_str()])?;
    Ok((revoked == 1).then_some(()))
}

pub fn set_rate_limit(
    conn: &Connection,
    tenant: &TenantId,
    rate_limit: Option<RateLimit>,
) -> Result<Option<()>, StorageError> {
    let (rps, burst) = rules::rate_limit_columns(rate_limit);
    let updated = conn
        .prepare_cached("UPDATE tenants SET rate_limit_rps = ?1, rate_limit_burst = ?2 WHERE id = ?3")?
        .execute(params![rps, burst, tenant.as_str()])?;
    Ok((updated == 1).then_some(()))
}

pub fn ensure_config_tenant(
    conn: &Connection,
    id: &TenantId,
    name: &str,
    rate_limit: Option<RateLimit>,
    key_hash: &str,
    now_ms: i64,
) -> Result<(), StorageError> {
    let (rps, burst) = rules::rate_limit_columns(rate_limit);
    conn.prepare_cached(
        "INSERT INTO tenants (id, name, created_at, rate_limit_rps, rate_limit_burst) VALUES (?1, ?2, ?3, ?4, ?5)
         ON CONFLICT (id) DO UPDATE SET name = excluded.name, rate_limit_rps = excluded.rate_limit_rps,
             rate_limit_burst = excluded.rate_limit_burst",
    )?
    .execute(params![id.as_str(), name, now_ms, rps, burst])?;
    conn.prepare_cached(
        "INSERT INTO api_keys (id, tenant_id, hash, created_at) VALUES (?1, ?2, ?3, ?4)
         ON CONFLICT (id) DO UPDATE SET hash = excluded.hash, revoked_at = NULL",
    )?
    .execute(params![format!("cfg-{id}"), id.as_str(), key_hash, now_ms])?;
    Ok(())
}

pub fn create_resource(
    conn: &Connection,
    tenant: &TenantId,
    res: &NewResource,
    now_ms: i64,
) -> Result<Option<ResourceState>, StorageError> {
    create_resource_as(conn, tenant, res, None, now_ms)
}

/// Creates a resource with its `create` ledger row; `plugin_version` when a plan created it.
fn create_resource_as(
    conn: &Connection,
    tenant: &TenantId,
    res: &NewResource,
    plugin_version: Option<i64>,
    now_ms: i64,
) -> Result<Option<ResourceState>, StorageError> {
    // A bucketed resource's row holds no counters: its buckets do.
    let row_total = if res.buckets > 1 { 0 } else { res.total };
    let row = conn
        .prepare_cached(&format!(
            "INSERT INTO resources (tenant_id, key, kind, status, mode, buckets, total, available, reserved, consumed,
                                    version, created_at, updated_at)
             VALUES (?1, ?2, ?3, 'active', 'db', ?6, ?4, ?4, 0, 0, 1, ?5, ?5)
             ON CONFLICT (tenant_id, key) DO NOTHING
             RETURNING {RESOURCE_COLUMNS}"
        ))?
        .query_row(
            params![tenant.as_str(), res.key.as_str(), res.kind.as_str(), row_total, now_ms, res.buckets.max(1)],
            |row| Ok((resource_from_row(row)?, After::from_row(row)?)),
        )
        .optional()?;
    let Some((state, after)) = row else { return Ok(None) };
    if res.buckets > 1 {
        buckets::create_buckets(conn, tenant, res, plugin_version, now_ms)?;
        return buckets::complete(conn, tenant.as_str(), state?).map(Some);
    }
    let facts = LedgerFacts {
        tenant: tenant.as_str(),
        resource: res.key.as_str(),
        bucket: 0,
        op: LedgerOp::Create,
        qty: res.total,
        request_id: "create",
        order_id: None,
        reservation_id: None,
        plugin_version,
        now_ms,
    };
    append_ledger(conn, facts, after)?;
    state.map(Some)
}

pub fn set_resource_status(
    conn: &Connection,
    tenant: &TenantId,
    key: &ResourceKey,
    status: ResourceStatus,
    now_ms: i64,
) -> Result<Option<ResourceState>, StorageError> {
    let state = conn
        .prepare_cached(&format!(
            "UPDATE resources SET status = ?1, updated_at = ?2 WHERE tenant_id = ?3 AND key = ?4 RETURNING {RESOURCE_COLUMNS}"
        ))?
        .query_row(params![status.as_str(), now_ms, tenant.as_str(), key.as_str()], resource_from_row)
        .optional()?
        .transpose()?;
    state.map(|state| buckets::complete(conn, tenant.as_str(), state)).transpose()
}

pub fn adjust(
    conn: &Connection,
    tenant: &TenantId,
    idem: &IdempotencyRequest,
    key: &ResourceKey,
    delta: i64,
    now_ms: i64,
) -> Result<Result<Idempotent, AdjustRefusal>, StorageError> {
    if let Some(previous) = idempotency_lookup(conn, tenant, idem)? {
        return Ok(Ok(previous));
    }
    let bucketed = conn
        .prepare_cached(&format!(
            "SELECT {RESOURCE_COLUMNS} FROM resources WHERE tenant_id = ?1 AND key = ?2 AND buckets > 1"
        ))?
        .query_row(params![tenant.as_str(), key.as_str()], resource_from_row)
        .optional()?
        .transpose()?;
    if let Some(state) = bucketed {
        let response = match buckets::adjust(conn, tenant, state, delta, now_ms)? {
            Ok(state) => StoredResponse::json(200, &state)?,
            Err(available) => StoredResponse::problem(&adjust_refusal(key, available, delta))?,
        };
        idempotency_store(conn, tenant, idem, &response, now_ms)?;
        return Ok(Ok(Idempotent::Fresh(response)));
    }
    let row = conn
        .prepare_cached(&format!(
            "UPDATE resources SET available = available + ?1, total = total + ?1, version = version + 1, updated_at = ?2
             WHERE tenant_id = ?3 AND key = ?4 AND available + ?1 >= 0 AND total + ?1 <= ?5
             RETURNING {RESOURCE_COLUMNS}"
        ))?
        .query_row(params![delta, now_ms, tenant.as_str(), key.as_str(), MAX_TOTAL], |row| {
            Ok((resource_from_row(row)?, After::from_row(row)?))
        })
        .optional()?;
    let response = match row {
        Some((state, after)) => {
            let request_id = new_request_id();
            let facts = LedgerFacts {
                tenant: tenant.as_str(),
                resource: key.as_str(),
                bucket: 0,
                op: LedgerOp::Adjust,
                qty: delta,
                request_id: &request_id,
                order_id: None,
                reservation_id: None,
                plugin_version: None,
                now_ms,
            };
            append_ledger(conn, facts, after)?;
            StoredResponse::json(200, &state?)?
        }
        None => {
            let available = conn
                .prepare_cached("SELECT available FROM resources WHERE tenant_id = ?1 AND key = ?2")?
                .query_row(params![tenant.as_str(), key.as_str()], |row| row.get::<_, i64>(0))
                .optional()?;
            let Some(available) = available else { return Ok(Err(AdjustRefusal::ResourceNotFound)) };
            StoredResponse::problem(&adjust_refusal(key, available, delta))?
        }
    };
    idempotency_store(conn, tenant, idem, &response, now_ms)?;
    Ok(Ok(Idempotent::Fresh(response)))
}

const DEDUCT_SQL: &str = "UPDATE resources SET available = available - ?1, consumed = consumed + ?1,
        version = version + 1, updated_at = ?2
    WHERE tenant_id = ?3 AND key = ?4 AND status = 'active' AND mode = 'db' AND available >= ?1
      AND (?5 IS NULL OR kind = ?5)
    RETURNING available, reserved, consumed, version";
const RESERVE_SQL: &str = "UPDATE resources SET available = available - ?1, reserved = reserved + ?1,
        version = version + 1, updated_at = ?2
    WHERE tenant_id = ?3 AND key = ?4 AND status = 'active' AND mode = 'db' AND available >= ?1
      AND (?5 IS NULL OR kind = ?5)
    RETURNING available, reserved, consumed, version";

/// The `(status, kind, available, buckets)` of a resource, for judging lines; a bucketed
/// resource's available is its buckets' sum.
pub fn line_view(conn: &Connection, tenant: &str, resource: &str) -> Result<Option<LineView>, StorageError> {
    Ok(conn
        .prepare_cached(
            "SELECT status, kind,
                    CASE WHEN buckets = 1 THEN available ELSE
                      (SELECT COALESCE(SUM(b.available), 0) FROM resource_buckets b
                       WHERE b.tenant_id = r.tenant_id AND b.resource_key = r.key) END,
                    buckets
             FROM resources r WHERE tenant_id = ?1 AND key = ?2",
        )?
        .query_row(params![tenant, resource], |row| Ok((row.get(0)?, row.get(1)?, row.get(2)?, row.get(3)?)))
        .optional()?)
}

/// A resource that switched to redis mode is sold by Redis alone; an order planned before this
/// process learnt of the switch must not take from the database copy. `Unavailable`: the
/// client retries with the same key and reaches the Redis path.
fn redis_mode_guard(conn: &Connection, tenant: &str, resource: &str) -> Result<(), StorageError> {
    let mode: Option<String> = conn
        .prepare_cached("SELECT mode FROM resources WHERE tenant_id = ?1 AND key = ?2")?
        .query_row(params![tenant, resource], |row| row.get(0))
        .optional()?;
    match mode.as_deref() {
        Some("redis") => Err(StorageError::Unavailable(format!("{resource} switched to redis mode"))),
        _ => Ok(()),
    }
}

/// Identity shared by every ledger row of one order.
struct OrderFacts<'a> {
    tenant: &'a TenantId,
    /// Picks the first bucket tried when the plan names none.
    seed: u64,
    action: Action,
    request_id: &'a str,
    order_id: &'a str,
    reservation_id: Option<&'a str>,
    plugin_version: Option<i64>,
    now_ms: i64,
}

/// One guarded UPDATE of one target, creating the resource first when it is missing and the
/// plan says so. `Ok`: applied, with what each bucket gave (empty for a single-bucket
/// resource); `Err(reason)`: refused, and nothing changed.
fn apply_target(
    conn: &Connection,
    facts: &OrderFacts<'_>,
    qty: i64,
    target: &Target,
) -> Result<Result<Vec<BucketTake>, Reason>, StorageError> {
    let (sql, op) = match facts.action {
        Action::Deduct => (DEDUCT_SQL, LedgerOp::Deduct),
        Action::Reserve => (RESERVE_SQL, LedgerOp::Reserve),
    };
    let tenant = facts.tenant.as_str();
    let update = |conn: &Connection| -> Result<Option<After>, StorageError> {
        Ok(conn
            .prepare_cached(sql)?
            .query_row(
                params![qty, facts.now_ms, tenant, target.resource.as_str(), target.kind.map(Kind::as_str)],
                After::from_row,
            )
            .optional()?)
    };
    let mut after = update(conn)?;
    if after.is_none() {
        let view = line_view(conn, tenant, target.resource.as_str())?;
        match (&view, target.create_if_missing) {
            (None, Some(allowance)) => {
                let kind = target.kind.unwrap_or(Kind::Quota);
                let new = NewResource { key: target.resource.clone(), kind, total: allowance, buckets: 1 };
                create_resource_as(conn, facts.tenant, &new, facts.plugin_version, facts.now_ms)?;
                after = update(conn)?;
            }
            (Some((.., n)), _) if *n > 1 => {
                // A bucketed resource's row holds no counters; its buckets take the line.
                if let Some(reason) = line_refusal(view.as_ref(), target, qty) {
                    return Ok(Err(reason));
                }
                let how = match facts.action {
                    Action::Deduct => buckets::Move::Deduct,
                    Action::Reserve => buckets::Move::Reserve,
                };
                let bucket_facts = buckets::BucketFacts {
                    tenant,
                    resource: target.resource.as_str(),
                    op,
                    request_id: facts.request_id,
                    order_id: Some(facts.order_id),
                    reservation_id: facts.reservation_id,
                    plugin_version: facts.plugin_version,
                    now_ms: facts.now_ms,
                };
                return buckets::take(conn, &bucket_facts, how, target, *n, facts.seed, qty);
            }
            _ => {}
        }
    }
    let Some(after) = after else {
        // The guarded UPDATE refused, so some reason applies; `insufficient` if the row changed
        // shape in between (it cannot: this connection is the only writer).
        redis_mode_guard(conn, tenant, target.resource.as_str())?;
        let view = line_view(conn, tenant, target.resource.as_str())?;
        return Ok(Err(line_refusal(view.as_ref(), target, qty).unwrap_or(Reason::Insufficient)));
    };
    let ledger = LedgerFacts {
        tenant,
        resource: target.resource.as_str(),
        bucket: 0,
        op,
        qty,
        request_id: facts.request_id,
        order_id: Some(facts.order_id),
        reservation_id: facts.reservation_id,
        plugin_version: facts.plugin_version,
        now_ms: facts.now_ms,
    };
    append_ledger(conn, ledger, after)?;
    Ok(Ok(Vec::new()))
}

/// Counts `qty` against a per-user limit if it stays within `max`; `false`: it would not.
fn take_limit(conn: &Connection, tenant: &TenantId, limit: &LimitSpec, qty: i64) -> Result<bool, StorageError> {
    if qty > limit.max {
        return Ok(false);
    }
    let changed = conn
        .prepare_cached(
            "INSERT INTO user_limits (tenant_id, key, used) VALUES (?1, ?2, ?3)
             ON CONFLICT (tenant_id, key) DO UPDATE SET used = used + excluded.used
             WHERE used + excluded.used <= ?4",
        )?
        .execute(params![tenant.as_str(), limit.key.as_str(), qty, limit.max])?;
    Ok(changed == 1)
}

/// Gives back what a released or expired reservation line took from its limit.
fn give_back_limit(conn: &Connection, tenant: &str, key: &str, qty: i64) -> Result<(), StorageError> {
    conn.prepare_cached("UPDATE user_limits SET used = used - ?1 WHERE tenant_id = ?2 AND key = ?3 AND used >= ?1")?
        .execute(params![qty, tenant, key])?;
    Ok(())
}

/// Applies one planned line: its limit (if any), then the first target that can take it. A
/// line that fails leaves nothing behind.
fn apply_line(
    conn: &Connection,
    facts: &OrderFacts<'_>,
    line: &PlannedLine,
) -> Result<(LineResult, Vec<BucketTake>), StorageError> {
    // Only a line with a limit, or one that may create a resource, can change something and
    // still fail; only those need a savepoint of their own.
    let nested = line.limit.is_some() || line.targets.iter().any(|t| t.create_if_missing.is_some());
    if nested {
        conn.prepare_cached("SAVEPOINT line")?.execute([])?;
    }
    let result = apply_line_inner(conn, facts, line)?;
    if nested {
        if !result.0.applied() {
            conn.prepare_cached("ROLLBACK TO line")?.execute([])?;
        }
        conn.prepare_cached("RELEASE line")?.execute([])?;
    }
    Ok(result)
}

fn apply_line_inner(
    conn: &Connection,
    facts: &OrderFacts<'_>,
    line: &PlannedLine,
) -> Result<(LineResult, Vec<BucketTake>), StorageError> {
    if let Some(limit) = &line.limit {
        if !take_limit(conn, facts.tenant, limit, line.qty)? {
            return Ok((LineResult::Rejected(Reason::LimitExceeded), Vec::new()));
        }
    }
    let mut first_refusal = None;
    for (i, target) in line.targets.iter().enumerate() {
        match apply_target(conn, facts, line.qty, target)? {
            Ok(takes) => return Ok((LineResult::Applied(i), takes)),
            Err(reason) => {
                first_refusal.get_or_insert(reason);
            }
        }
    }
    Ok((LineResult::Rejected(first_refusal.unwrap_or(Reason::ResourceNotFound)), Vec::new()))
}

pub fn execute_order(conn: &Connection, job: &OrderJob, now_ms: i64) -> Result<OrderExecution, StorageError> {
    if let Some(previous) = idempotency_lookup(conn, &job.tenant, &job.idempotency)? {
        return Ok(OrderExecution { response: previous, outcome: None });
    }
    let request_id = new_request_id();
    let reservation = (job.order.action == Action::Reserve)
        .then(|| (format!("rsv_{}", Ulid::new()), Timestamp(now_ms.saturating_add(job.ttl_ms))));
    let facts = OrderFacts {
        tenant: &job.tenant,
        seed: bucket_seed(job.tenant.as_str(), job.idempotency.key.as_str()),
        action: job.order.action,
        request_id: &request_id,
        order_id: job.order.order_id.as_str(),
        reservation_id: reservation.as_ref().map(|(id, _)| id.as_str()),
        plugin_version: Some(job.plan.planner.version),
        now_ms,
    };
    let sequence = job.plan.lock_sequence();
    // A single line that fails changed nothing, so only multi-line orders need a savepoint.
    let nested = job.plan.lines.len() > 1;
    if nested {
        conn.prepare_cached("SAVEPOINT lines")?.execute([])?;
    }
    let mut results = vec![LineResult::Rejected(Reason::Skipped); job.plan.lines.len()];
    let mut takes = vec![Vec::new(); job.plan.lines.len()];
    for i in sequence {
        (results[i], takes[i]) = apply_line(conn, &facts, &job.plan.lines[i])?;
    }
    let status = decide(&job.plan, &results);
    if nested {
        if status == OrderStatus::Rejected {
            conn.prepare_cached("ROLLBACK TO lines")?.execute([])?;
        }
        conn.prepare_cached("RELEASE lines")?.execute([])?;
    }
    finish_order(conn, job, results, &takes, status, reservation, now_ms)
}

/// The end of an order decided either way: its reservation (if it holds anything), its
/// document, and the idempotency record that replays it.
fn finish_order(
    conn: &Connection,
    job: &OrderJob,
    results: Vec<LineResult>,
    takes: &[Vec<BucketTake>],
    status: OrderStatus,
    reservation: Option<(String, Timestamp)>,
    now_ms: i64,
) -> Result<OrderExecution, StorageError> {
    if status != OrderStatus::Rejected {
        if let Some((id, expires_at)) = &reservation {
            insert_reservation(conn, job, &results, takes, id, *expires_at, now_ms)?;
        }
    }
    let document = OrderDocument::build(&job.order, &job.plan, &results, reservation);
    let code = if status == OrderStatus::Rejected { 409 } else { 201 };
    let response = StoredResponse::json(code, &document)?;
    idempotency_store(conn, &job.tenant, &job.idempotency, &response, now_ms)?;
    Ok(OrderExecution { response: Idempotent::Fresh(response), outcome: Some((status, results)) })
}

/// Decides many orders at once by in-memory admission (see [`crate::engine::admission`]):
/// each resource row is read once, the orders are judged in sequence against it, each order
/// still gets its own ledger rows, reservation and idempotency record, and each changed row is
/// written once, guarded by the version it was read at. `None` for an order this path leaves
/// to [`execute_order`] (limits, creation, buckets, or a second use of one key in the batch).
/// Runs inside the caller's savepoint: on any error nothing of it stands.
pub fn execute_orders_fast(
    conn: &Connection,
    orders: &[(&OrderJob, i64)],
) -> Result<Vec<Option<OrderExecution>>, StorageError> {
    let mut out = Vec::with_capacity(orders.len());
    // Per tenant: the rows as admission left them, and the version each was read at.
    let mut rows: HashMap<String, HashMap<String, admission::Row>> = HashMap::new();
    let mut read_at: HashMap<(String, String), i64> = HashMap::new();
    let mut keys_seen = HashSet::new();
    let mut last_ms = 0;
    for &(job, now_ms) in orders {
        let tenant = job.tenant.as_str();
        if !admission::admissible(&job.plan) || !keys_seen.insert((tenant, job.idempotency.key.as_str())) {
            out.push(None);
            continue;
        }
        if let Some(previous) = idempotency_lookup(conn, &job.tenant, &job.idempotency)? {
            out.push(Some(OrderExecution { response: previous, outcome: None }));
            continue;
        }
        let tenant_rows = rows.entry(tenant.to_string()).or_default();
        for key in job.plan.resources() {
            if tenant_rows.contains_key(key.as_str()) {
                continue;
            }
            if let Some(row) = admission_row(conn, tenant, key.as_str())? {
                read_at.insert((tenant.to_string(), key.to_string()), row.version);
                tenant_rows.insert(key.to_string(), row);
            }
        }
        let Some(admitted) = admission::admit(tenant_rows, &job.plan, job.order.action) else {
            out.push(None);
            continue;
        };
        last_ms = last_ms.max(now_ms);
        let request_id = new_request_id();
        let reservation = (job.order.action == Action::Reserve)
            .then(|| (format!("rsv_{}", Ulid::new()), Timestamp(now_ms.saturating_add(job.ttl_ms))));
        for change in &admitted.changes {
            let facts = LedgerFacts {
                tenant,
                resource: &change.resource,
                bucket: 0,
                op: change.op,
                qty: change.qty,
                request_id: &request_id,
                order_id: Some(job.order.order_id.as_str()),
                reservation_id: reservation.as_ref().map(|(id, _)| id.as_str()),
                plugin_version: Some(job.plan.planner.version),
                now_ms,
            };
            let [available, reserved, consumed] = change.after;
            append_ledger(conn, facts, After { available, reserved, consumed, version: change.version_after })?;
        }
        out.push(Some(finish_order(conn, job, admitted.results, &[], admitted.status, reservation, now_ms)?));
    }
    for (tenant, tenant_rows) in &rows {
        for (key, row) in tenant_rows {
            let Some(&version) = read_at.get(&(tenant.clone(), key.clone())) else { continue };
            if row.version == version {
                continue;
            }
            let written = conn
                .prepare_cached(
                    "UPDATE resources SET available = ?1, reserved = ?2, consumed = ?3, version = ?4, updated_at = ?5
                     WHERE tenant_id = ?6 AND key = ?7 AND version = ?8",
                )?
                .execute(params![
                    row.available,
                    row.reserved,
                    row.consumed,
                    row.version,
                    last_ms,
                    tenant,
                    key,
                    version
                ])?;
            if written != 1 {
                return Err(StorageError::Internal(format!("resource {key} changed under the writer")));
            }
        }
    }
    Ok(out)
}

/// A resource row as admission judges it; `None` when there is no such resource.
fn admission_row(conn: &Connection, tenant: &str, key: &str) -> Result<Option<admission::Row>, StorageError> {
    let row = conn
        .prepare_cached(
            "SELECT kind, CASE WHEN mode = 'db' THEN status ELSE 'redis' END, buckets, available, reserved,
                    consumed, version
             FROM resources WHERE tenant_id = ?1 AND key = ?2",
        )?
        .query_row(params![tenant, key], |row| {
            Ok((
                row.get::<_, String>(0)?,
                row.get::<_, String>(1)?,
                row.get(2)?,
                row.get(3)?,
                row.get(4)?,
                row.get(5)?,
                row.get(6)?,
            ))
        })
        .optional()?;
    let Some((kind, status, buckets, available, reserved, consumed, version)) = row else { return Ok(None) };
    Ok(Some(admission::Row {
        kind: Kind::from_db(&kind).ok_or_else(|| corrupt("resources.kind"))?,
        active: status == ResourceStatus::Active.as_str(),
        redis: status == "redis",
        buckets,
        available,
        reserved,
        consumed,
        version,
    }))
}

fn insert_reservation(
    conn: &Connection,
    job: &OrderJob,
    results: &[LineResult],
    takes: &[Vec<BucketTake>],
    id: &str,
    expires_at: Timestamp,
    now_ms: i64,
) -> Result<(), StorageError> {
    let lines = reservation_lines_json(job, results, takes)?;
    conn.prepare_cached(
        "INSERT INTO reservations (tenant_id, id, order_id, state, lines, expires_at, created_at, updated_at)
         VALUES (?1, ?2, ?3, 'held', ?4, ?5, ?6, ?6)",
    )?
    .execute(params![job.tenant.as_str(), id, job.order.order_id.as_str(), lines, expires_at.0, now_ms])?;
    Ok(())
}

fn load_reservation(conn: &Connection, tenant: &str, id: &str) -> Result<Option<Reservation>, StorageError> {
    conn.prepare_cached(
        "SELECT id, order_id, state, lines, expires_at FROM reservations WHERE tenant_id = ?1 AND id = ?2",
    )?
    .query_row(params![tenant, id], reservation_from_row)
    .optional()?
    .transpose()
}

const CONFIRM_SQL: &str =
    "UPDATE resources SET reserved = reserved - ?1, consumed = consumed + ?1, version = version + 1,
        updated_at = ?2
    WHERE tenant_id = ?3 AND key = ?4 AND reserved >= ?1 RETURNING available, reserved, consumed, version";
const UNRESERVE_SQL: &str =
    "UPDATE resources SET reserved = reserved - ?1, available = available + ?1, version = version + 1,
        updated_at = ?2
    WHERE tenant_id = ?3 AND key = ?4 AND reserved >= ?1 RETURNING available, reserved, consumed, version";

/// Moves a held reservation to `to` (confirmed, released or expired): the state changes only
/// if it is still `held`, and its lines leave `reserved`, each with a ledger row.
fn finish_reservation(
    conn: &Connection,
    tenant: &str,
    mut reservation: Reservation,
    to: ReservationState,
    now_ms: i64,
) -> Result<Reservation, StorageError> {
    let (op, sql) = match to {
        ReservationState::Confirmed => (LedgerOp::Confirm, CONFIRM_SQL),
        ReservationState::Released => (LedgerOp::Release, UNRESERVE_SQL),
        ReservationState::Expired => (LedgerOp::Expire, UNRESERVE_SQL),
        ReservationState::Held => return Err(StorageError::Internal("a reservation cannot move back to held".into())),
    };
    let moved = conn
        .prepare_cached(
            "UPDATE reservations SET state = ?1, updated_at = ?2 WHERE tenant_id = ?3 AND id = ?4 AND state = 'held'",
        )?
        .execute(params![to.as_str(), now_ms, tenant, reservation.id])?;
    if moved != 1 {
        return Err(StorageError::Internal(format!("reservation {} was not held", reservation.id)));
    }
    let mut lines = reservation.lines.clone();
    lines.sort_by(|a, b| a.resource.cmp(&b.resource));
    for line in &lines {
        if !line.buckets.is_empty() {
            let how = if to == ReservationState::Confirmed { buckets::Move::Confirm } else { buckets::Move::Unreserve };
            let facts = buckets::BucketFacts {
                tenant,
                resource: &line.resource,
                op,
                request_id: &reservation.id,
                order_id: Some(&reservation.order_id),
                reservation_id: Some(&reservation.id),
                plugin_version: None,
                now_ms,
            };
            for take in &line.buckets {
                if !buckets::move_bucket(conn, &facts, how, take.bucket, take.qty)? {
                    return Err(StorageError::Internal(format!(
                        "bucket of reservation {} holds less than reserved",
                        reservation.id
                    )));
                }
            }
            if let (Some(key), true) = (&line.limit_key, to != ReservationState::Confirmed) {
                give_back_limit(conn, tenant, key, line.qty)?;
            }
            continue;
        }
        let after = conn
            .prepare_cached(sql)?
            .query_row(params![line.qty, now_ms, tenant, line.resource], After::from_row)
            .optional()?
            .ok_or_else(|| {
                StorageError::Internal(format!("resource of reservation {} holds less than reserved", reservation.id))
            })?;
        let facts = LedgerFacts {
            tenant,
            resource: &line.resource,
            bucket: 0,
            op,
            qty: line.qty,
            request_id: &reservation.id,
            order_id: Some(&reservation.order_id),
            reservation_id: Some(&reservation.id),
            plugin_version: None,
            now_ms,
        };
        append_ledger(conn, facts, after)?;
        if let (Some(key), true) = (&line.limit_key, to != ReservationState::Confirmed) {
            give_back_limit(conn, tenant, key, line.qty)?;
        }
    }
    reservation.state = to;
    Ok(reservation)
}

pub fn confirm_reservation(
    conn: &Connection,
    tenant: &TenantId,
    id: &str,
    now_ms: i64,
) -> Result<Transition, StorageError> {
    let Some(reservation) = load_reservation(conn, tenant.as_str(), id)? else { return Ok(Transition::NotFound) };
    Ok(match reservation.state {
        ReservationState::Confirmed => Transition::Done(reservation),
        ReservationState::Released | ReservationState::Expired => Transition::Refused(reservation.state, reservation),
        // Past its deadline but not yet swept: it is expired. Expiring it here keeps a late
        // confirm from winning a race with the sweeper.
        ReservationState::Held if reservation.expires_at.0 <= now_ms => {
            let expired = finish_reservation(conn, tenant.as_str(), reservation, ReservationState::Expired, now_ms)?;
            metrics::counter!("stockd_reservations_expired_total").increment(1);
            Transition::Refused(ReservationState::Expired, expired)
        }
        ReservationState::Held => Transition::Done(finish_reservation(
            conn,
            tenant.as_str(),
            reservation,
            ReservationState::Confirmed,
            now_ms,
        )?),
    })
}

pub fn release_reservation(
    conn: &Connection,
    tenant: &TenantId,
    id: &str,
    now_ms: i64,
) -> Result<Transition, StorageError> {
    let Some(reservation) = load_reservation(conn, tenant.as_str(), id)? else { return Ok(Transition::NotFound) };
    Ok(match reservation.state {
        ReservationState::Released | ReservationState::Expired => Transition::Done(reservation),
        ReservationState::Confirmed => Transition::Refused(ReservationState::Confirmed, reservation),
        ReservationState::Held => Transition::Done(finish_reservation(
            conn,
            tenant.as_str(),
            reservation,
            ReservationState::Released,
            now_ms,
        )?),
    })
}

pub fn expire_due(conn: &Connection, now_ms: i64, limit: u32) -> Result<u64, StorageError> {
    let due: Vec<(String, Result<Reservation, StorageError>)> = conn
        .prepare_cached(
            "SELECT tenant_id, id, order_id, state, lines, expires_at FROM reservations
             WHERE state = 'held' AND expires_at <= ?1 ORDER BY expires_at LIMIT ?2",
        )?
        .query_map(params![now_ms, i64::from(limit)], |row| Ok((row.get(0)?, reservation_from_row(row)?)))?
        .collect::<rusqlite::Result<_>>()?;
    let mut expired = 0;
    for (tenant, reservation) in due {
        finish_reservation(conn, &tenant, reservation?, ReservationState::Expired, now_ms)?;
        expired += 1;
    }
    Ok(expired)
}

pub fn purge_idempotency(conn: &Connection, before_ms: i64, limit: u32) -> Result<u64, StorageError> {
    let deleted = conn
        .prepare_cached(
            "DELETE FROM idempotency WHERE (tenant_id, key) IN
               (SELECT tenant_id, key FROM idempotency WHERE created_at < ?1 LIMIT ?2)",
        )?
        .execute(params![before_ms, i64::from(limit)])?;
    Ok(deleted as u64)
}

/// Stores the next plugin version of a tenant and activates it.
/// Deletes a tenant's (?1) versions beyond the newest ?3, ranking first the new version (?2)
/// and the active one, so neither is ever deleted while the cap is at least 2.
const PRUNE_PLUGINS: &str = "DELETE FROM plugins WHERE tenant_id = ?1 AND version IN (
    SELECT version FROM (
        SELECT p.version, ROW_NUMBER() OVER (ORDER BY
            p.version = ?2 DESC,
            p.version = COALESCE((SELECT a.version FROM plugin_active a WHERE a.tenant_id = ?1), 0) DESC,
            p.version DESC) AS keep_rank
        FROM plugins p WHERE p.tenant_id = ?1)
    WHERE keep_rank > ?3)";

pub fn save_plugin(
    conn: &Connection,
    tenant: &TenantId,
    upload: &PluginUpload,
    now_ms: i64,
) -> Result<PluginVersion, StorageError> {
    let version: i64 = conn
        .prepare_cached("SELECT COALESCE(MAX(version), 0) + 1 FROM plugins WHERE tenant_id = ?1")?
        .query_row(params![tenant.as_str()], |row| row.get(0))?;
    conn.prepare_cached(
        "INSERT INTO plugins (tenant_id, version, sha256, wasm, config, uploaded_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
    )?
    .execute(params![tenant.as_str(), version, upload.sha256, upload.wasm, upload.config, now_ms])?;
    // Before the switch, so the version active until now is still the one the rule keeps.
    let max_versions = i64::try_from(upload.max_versions).unwrap_or(i64::MAX);
    conn.prepare_cached(PRUNE_PLUGINS)?.execute(params![tenant.as_str(), version, max_versions])?;
    set_active_plugin(conn, tenant, version)?;
    Ok(PluginVersion {
        version,
        sha256: upload.sha256.clone(),
        config: upload.config.clone(),
        uploaded_at_ms: now_ms,
        active: true,
    })
}

fn set_active_plugin(conn: &Connection, tenant: &TenantId, version: i64) -> Result<(), StorageError> {
    conn.prepare_cached(
        "INSERT INTO plugin_active (tenant_id, version) VALUES (?1, ?2)
         ON CONFLICT (tenant_id) DO UPDATE SET version = excluded.version",
    )?
    .execute(params![tenant.as_str(), version])?;
    Ok(())
}

/// Activates a stored version (or 0, the built-in default); `None` if there is no such version.
pub fn activate_plugin(
    conn: &Connection,
    tenant: &TenantId,
    version: i64,
) -> Result<Option<PluginVersion>, StorageError> {
    if version == 0 {
        set_active_plugin(conn, tenant, 0)?;
        return Ok(Some(PluginVersion {
            version: 0,
            sha256: String::new(),
            config: String::new(),
            uploaded_at_ms: 0,
            active: true,
        }));
    }
    let found = conn
        .prepare_cached("SELECT sha256, config, uploaded_at FROM plugins WHERE tenant_id = ?1 AND version = ?2")?
        .query_row(params![tenant.as_str(), version], |row| Ok((row.get(0)?, row.get(1)?, row.get(2)?)))
        .optional()?;
    let Some((sha256, config, uploaded_at_ms)) = found else { return Ok(None) };
    set_active_plugin(conn, tenant, version)?;
    Ok(Some(PluginVersion { version, sha256, config, uploaded_at_ms, active: true }))
}

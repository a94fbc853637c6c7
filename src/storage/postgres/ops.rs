//! The PostgreSQL write operations, one per write of the [`Storage`](crate::storage::Storage)
//! trait, mirroring [`crate::storage::sqlite::ops`] function by function so both backends give
//! the same responses, ledger rows and reasons. Each runs on the batcher's connection inside its
//! own savepoint of a group-commit transaction (see [`super`]), and may be run again from the
//! start if that batch is retried, so none keeps anything between runs.
//!
//! Unlike SQLite, several `stockd` processes may write the same database at once, and nothing
//! here relies on being the only writer: every deduction is a guarded UPDATE judged by the row it
//! returns; an idempotency key is claimed by inserting its row first (a concurrent duplicate in
//! another process waits on that row, then replays); a reservation moves only by a guarded UPDATE
//! from `held`; the expiry sweep locks its rows with `SKIP LOCKED`.

use sqlx::postgres::PgRow;
use sqlx::{PgConnection, Row};
use ulid::Ulid;

use super::buckets;
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

fn corrupt(what: &str) -> StorageError {
    StorageError::Internal(format!("unexpected stored value in {what}"))
}

/// A resource row selected or returned with [`RESOURCE_COLUMNS`].
pub(super) fn resource_from_row(row: &PgRow) -> Result<ResourceState, StorageError> {
    let kind: &str = row.try_get("kind")?;
    let status: &str = row.try_get("status")?;
    let mode: &str = row.try_get("mode")?;
    let (Some(kind), Some(status), Some(mode)) =
        (Kind::from_db(kind), ResourceStatus::from_db(status), Mode::from_db(mode))
    else {
        return Err(corrupt("resources"));
    };
    Ok(ResourceState {
        key: row.try_get("key")?,
        kind,
        status,
        available: row.try_get("available")?,
        reserved: row.try_get("reserved")?,
        consumed: row.try_get("consumed")?,
        total: row.try_get("total")?,
        buckets: row.try_get("buckets")?,
        mode,
        version: row.try_get("version")?,
        updated_at: Timestamp(row.try_get("updated_at")?),
        bucket_counts: None,
    })
}

/// A reservation row with `id, order_id, state, lines, expires_at`.
pub(super) fn reservation_from_row(row: &PgRow) -> Result<Reservation, StorageError> {
    let state: &str = row.try_get("state")?;
    let lines: &str = row.try_get("lines")?;
    let (Some(state), Ok(lines)) = (ReservationState::from_db(state), serde_json::from_str(lines)) else {
        return Err(corrupt("reservations"));
    };
    Ok(Reservation {
        id: row.try_get("id")?,
        order_id: row.try_get("order_id")?,
        state,
        lines,
        expires_at: Timestamp(row.try_get("expires_at")?),
    })
}

/// Counters a guarded UPDATE returned, for the ledger row.
#[derive(Debug, Clone, Copy)]
struct After {
    available: i64,
    reserved: i64,
    consumed: i64,
    version: i64,
}

impl After {
    fn from_row(row: &PgRow) -> Result<Self, StorageError> {
        Ok(Self {
            available: row.try_get("available")?,
            reserved: row.try_get("reserved")?,
            consumed: row.try_get("consumed")?,
            version: row.try_get("version")?,
        })
    }
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

async fn append_ledger(conn: &mut PgConnection, f: LedgerFacts<'_>, after: After) -> Result<(), StorageError> {
    sqlx::query(
        "INSERT INTO ledger (tenant_id, resource_key, bucket, op, qty, request_id, order_id, reservation_id,
                             available_after, reserved_after, consumed_after, version_after, plugin_version, at)
         VALUES ($1, $2, 0, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)",
    )
    .bind(f.tenant)
    .bind(f.resource)
    .bind(f.op.as_str())
    .bind(f.qty)
    .bind(f.request_id)
    .bind(f.order_id)
    .bind(f.reservation_id)
    .bind(after.available)
    .bind(after.reserved)
    .bind(after.consumed)
    .bind(after.version)
    .bind(f.plugin_version)
    .bind(f.now_ms)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Claims an idempotency key for this request before any business write. `None`: the key is
/// ours, proceed (and [`idempotency_finish`] it). `Some`: the key was used before; its outcome.
///
/// The INSERT comes first because it is what serialises duplicates across processes: if another
/// transaction holds an uncommitted row for the key, `ON CONFLICT` waits for it to end, then
/// either inserts (it rolled back) or does nothing (it committed, response and all).
async fn idempotency_claim(
    conn: &mut PgConnection,
    tenant: &TenantId,
    idem: &IdempotencyRequest,
    now_ms: i64,
) -> Result<Option<Idempotent>, StorageError> {
    let inserted = sqlx::query(
        "INSERT INTO idempotency (tenant_id, key, request_hash, created_at) VALUES ($1, $2, $3, $4)
         ON CONFLICT (tenant_id, key) DO NOTHING",
    )
    .bind(tenant.as_str())
    .bind(idem.key.as_str())
    .bind(&idem.request_hash)
    .bind(now_ms)
    .execute(&mut *conn)
    .await?
    .rows_affected();
    if inserted == 1 {
        return Ok(None);
    }
    let row = sqlx::query(
        "SELECT request_hash, response_code, response_type, response_body FROM idempotency
         WHERE tenant_id = $1 AND key = $2",
    )
    .bind(tenant.as_str())
    .bind(idem.key.as_str())
    .fetch_optional(&mut *conn)
    .await?;
    // The row conflicted a moment ago and is gone now: the purge job removed an expired key in
    // between. Transient: the retried batch finds the key free.
    let Some(row) = row else { return Err(StorageError::Unavailable("idempotency key vanished".into())) };
    let hash: &str = row.try_get("request_hash")?;
    if hash != idem.request_hash {
        return Ok(Some(Idempotent::Mismatch));
    }
    // Committed rows always carry their response (it is written in the transaction that inserted
    // them), so a missing one means this transaction claimed the key and did not finish it.
    let Some(response) = stored_response(&row)? else {
        return Err(StorageError::Internal(format!("idempotency key {} has no stored response", idem.key.as_str())));
    };
    Ok(Some(Idempotent::Replayed(response)))
}

/// The response stored in an idempotency row (`response_code, response_type, response_body`);
/// `None` while its key is claimed but not yet answered.
pub(super) fn stored_response(row: &PgRow) -> Result<Option<StoredResponse>, StorageError> {
    let code: Option<i32> = row.try_get("response_code")?;
    let kind: Option<&str> = row.try_get("response_type")?;
    let body: Option<String> = row.try_get("response_body")?;
    let (Some(code), Some(kind), Some(body)) = (code, kind, body) else { return Ok(None) };
    Ok(Some(StoredResponse {
        status: u16::try_from(code).map_err(|_| corrupt("idempotency.response_code"))?,
        content_type: ContentType::from_db(kind),
        body,
    }))
}

/// Stores the response of a key claimed by [`idempotency_claim`], in the same transaction as
/// the effects it describes.
async fn idempotency_finish(
    conn: &mut PgConnection,
    tenant: &TenantId,
    idem: &IdempotencyRequest,
    response: &StoredResponse,
) -> Result<(), StorageError> {
    let updated = sqlx::query(
        "UPDATE idempotency SET response_code = $1, response_type = $2, response_body = $3
         WHERE tenant_id = $4 AND key = $5",
    )
    .bind(i32::from(response.status))
    .bind(response.content_type.as_str())
    .bind(&response.body)
    .bind(tenant.as_str())
    .bind(idem.key.as_str())
    .execute(&mut *conn)
    .await?
    .rows_affected();
    if updated != 1 {
        return Err(StorageError::Internal(format!("idempotency key {} was not claimed", idem.key.as_str())));
    }
    Ok(())
}

/// Gives back a claimed key whose request ends without a stored outcome, so it stays free.
async fn idempotency_release(
    conn: &mut PgConnection,
    tenant: &TenantId,
    idem: &IdempotencyRequest,
) -> Result<(), StorageError> {
    sqlx::query("DELETE FROM idempotency WHERE tenant_id = $1 AND key = $2 AND response_code IS NULL")
        .bind(tenant.as_str())
        .bind(idem.key.as_str())
        .execute(&mut *conn)
        .await?;
    Ok(())
}

pub async fn create_tenant(
    conn: &mut PgConnection,
    id: &TenantId,
    name: &str,
    rate_limit: Option<RateLimit>,
    key: &NewApiKey,
    now_ms: i64,
) -> Result<Insert, StorageError> {
    let (rps, burst) = rules::rate_limit_columns(rate_limit);
    let created = sqlx::query(
        "INSERT INTO tenants (id, name, created_at, rate_limit_rps, rate_limit_burst) VALUES ($1, $2, $3, $4, $5)
         ON CONFLICT (id) DO NOTHING RETURNING id",
    )
    .bind(id.as_str())
    .bind(name)
    .bind(now_ms)
    .bind(rps)
    .bind(burst)
    .fetch_optional(&mut *conn)
    .await?;
    if created.is_none() {
        return Ok(Insert::AlreadyExists);
    }
    sqlx::query("INSERT INTO api_keys (id, tenant_id, hash, created_at) VALUES ($1, $2, $3, $4)")
        .bind(&key.id)
        .bind(id.as_str())
        .bind(&key.hash)
        .bind(now_ms)
        .execute(&mut *conn)
        .await?;
    Ok(Insert::Created)
}

pub async fn add_api_key(
    conn: &mut PgConnection,
    tenant: &TenantId,
    key: &NewApiKey,
    now_ms: i64,
) -> Result<Option<()>, StorageError> {
    let added = sqlx::query(
        "INSERT INTO api_keys (id, tenant_id, hash, created_at) SELECT $1, id, $2, $3 FROM tenants WHERE id = $4",
    )
    .bind(&key.id)
    .bind(&key.hash)
    .bind(now_ms)
    .bind(tenant.as_str())
    .execute(&mut *conn)
    .await?
    .rows_affected();
    Ok((added == 1).then_some(()))
}

pub async fn revoke_api_key(
    conn: &mut PgConnection,
    tenant: &TenantId,
    key_id: &str,
    now_ms: i64,
) -> Result<Option<()>, StorageError> {
    let revoked =
        sqlx::query("UPDATE api_keys SET revoked_at = $1 WHERE id = $2 AND tenant_id = $3 AND revoked_at IS NULL")
            .bind(now_ms)
            .bind(key_id)
            .bind(tenant.as_str())
            .execute(&mut *conn)
            .await?
            .rows_affected();
    Ok((revoked == 1).then_some(()))
}

pub async fn ensure_config_tenant(
    conn: &mut PgConnection,
    id: &TenantId,
    name: &str,
    rate_limit: Option<RateLimit>,
    key_hash: &str,
    now_ms: i64,
) -> Result<(), StorageError> {
    let (rps, burst) = rules::rate_limit_columns(rate_limit);
    // Upserts, so several processes starting on one database at once all succeed.
    sqlx::query(
        "INSERT INTO tenants (id, name, created_at, rate_limit_rps, rate_limit_burst) VALUES ($1, $2, $3, $4, $5)
         ON CONFLICT (id) DO UPDATE SET name = excluded.name, rate_limit_rps = excluded.rate_limit_rps,
             rate_limit_burst = excluded.rate_limit_burst",
    )
    .bind(id.as_str())
    .bind(name)
    .bind(now_ms)
    .bind(rps)
    .bind(burst)
    .execute(&mut *conn)
    .await?;
    sqlx::query(
        "INSERT INTO api_keys (id, tenant_id, hash, created_at) VALUES ($1, $2, $3, $4)
         ON CONFLICT (id) DO UPDATE SET hash = excluded.hash, revoked_at = NULL",
    )
    .bind(format!("cfg-{id}"))
    .bind(id.as_str())
    .bind(key_hash)
    .bind(now_ms)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

pub async fn create_resource(
    conn: &mut PgConnection,
    tenant: &TenantId,
    res: &NewResource,
    now_ms: i64,
) -> Result<Option<ResourceState>, StorageError> {
    create_resource_as(conn, tenant, res, None, now_ms).await
}

/// Creates a resource with its `create` ledger row; `plugin_version` when a plan created it.
async fn create_resource_as(
    conn: &mut PgConnection,
    tenant: &TenantId,
    res: &NewResource,
    plugin_version: Option<i64>,
    now_ms: i64,
) -> Result<Option<ResourceState>, StorageError> {
    let sql = format!(
        "INSERT INTO resources (tenant_id, key, kind, status, mode, buckets, total, available, reserved, consumed,
                                version, created_at, updated_at)
         VALUES ($1, $2, $3, 'active', 'db', $6, $4, $4, 0, 0, 1, $5, $5)
         ON CONFLICT (tenant_id, key) DO NOTHING
         RETURNING {RESOURCE_COLUMNS}"
    );
    // A bucketed resource's row holds no counters: its buckets do.
    let row_total = if res.buckets > 1 { 0 } else { res.total };
    let row = sqlx::query(&sql)
        .bind(tenant.as_str())
        .bind(res.key.as_str())
        .bind(res.kind.as_str())
        .bind(row_total)
        .bind(now_ms)
        .bind(res.buckets.max(1))
        .fetch_optional(&mut *conn)
        .await?;
    let Some(row) = row else { return Ok(None) };
    let (state, after) = (resource_from_row(&row)?, After::from_row(&row)?);
    if res.buckets > 1 {
        buckets::create_buckets(conn, tenant, res, plugin_version, now_ms).await?;
        return buckets::complete(conn, tenant.as_str(), state).await.map(Some);
    }
    let facts = LedgerFacts {
        tenant: tenant.as_str(),
        resource: res.key.as_str(),
        op: LedgerOp::Create,
        qty: res.total,
        request_id: "create",
        order_id: None,
        reservation_id: None,
        plugin_version,
        now_ms,
    };
    append_ledger(conn, facts, after).await?;
    Ok(Some(state))
}

pub async fn set_resource_status(
    conn: &mut PgConnection,
    tenant: &TenantId,
    key: &ResourceKey,
    status: ResourceStatus,
    now_ms: i64,
) -> Result<Option<ResourceState>, StorageError> {
    let sql = format!(
        "UPDATE resources SET status = $1, updated_at = $2 WHERE tenant_id = $3 AND key = $4 RETURNING {RESOURCE_COLUMNS}"
    );
    let row = sqlx::query(&sql)
        .bind(status.as_str())
        .bind(now_ms)
        .bind(tenant.as_str())
        .bind(key.as_str())
        .fetch_optional(&mut *conn)
        .await?;
    let Some(state) = row.as_ref().map(resource_from_row).transpose()? else { return Ok(None) };
    buckets::complete(conn, tenant.as_str(), state).await.map(Some)
}

pub async fn adjust(
    conn: &mut PgConnection,
    tenant: &TenantId,
    idem: &IdempotencyRequest,
    key: &ResourceKey,
    delta: i64,
    now_ms: i64,
) -> Result<Result<Idempotent, AdjustRefusal>, StorageError> {
    if let Some(previous) = idempotency_claim(conn, tenant, idem, now_ms).await? {
        return Ok(Ok(previous));
    }
    let bucketed = sqlx::query(&format!(
        "SELECT {RESOURCE_COLUMNS} FROM resources WHERE tenant_id = $1 AND key = $2 AND buckets > 1"
    ))
    .bind(tenant.as_str())
    .bind(key.as_str())
    .fetch_optional(&mut *conn)
    .await?;
    if let Some(row) = bucketed {
        let state = resource_from_row(&row)?;
        let response = match buckets::adjust(conn, tenant, state, delta, now_ms).await? {
            Ok(state) => StoredResponse::json(200, &state)?,
            Err(available) => StoredResponse::problem(&adjust_refusal(key, available, delta))?,
        };
        idempotency_finish(conn, tenant, idem, &response).await?;
        return Ok(Ok(Idempotent::Fresh(response)));
    }
    let sql = format!(
        "UPDATE resources SET available = available + $1, total = total + $1, version = version + 1, updated_at = $2
         WHERE tenant_id = $3 AND key = $4 AND available + $1 >= 0 AND total + $1 <= $5
         RETURNING {RESOURCE_COLUMNS}"
    );
    let row = sqlx::query(&sql)
        .bind(delta)
        .bind(now_ms)
        .bind(tenant.as_str())
        .bind(key.as_str())
        .bind(MAX_TOTAL)
        .fetch_optional(&mut *conn)
        .await?;
    let response = match row {
        Some(row) => {
            let (state, after) = (resource_from_row(&row)?, After::from_row(&row)?);
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
            append_ledger(conn, facts, after).await?;
            StoredResponse::json(200, &state)?
        }
        None => {
            let available: Option<i64> =
                sqlx::query_scalar("SELECT available FROM resources WHERE tenant_id = $1 AND key = $2")
                    .bind(tenant.as_str())
                    .bind(key.as_str())
                    .fetch_optional(&mut *conn)
                    .await?;
            let Some(available) = available else {
                // An unknown resource leaves no stored outcome (as on SQLite): the key stays
                // free for a retry once the resource exists.
                idempotency_release(conn, tenant, idem).await?;
                return Ok(Err(AdjustRefusal::ResourceNotFound));
            };
            StoredResponse::problem(&adjust_refusal(key, available, delta))?
        }
    };
    idempotency_finish(conn, tenant, idem, &response).await?;
    Ok(Ok(Idempotent::Fresh(response)))
}

/// The guarded UPDATE and its ledger row in one statement (one round trip): the INSERT reads
/// the UPDATE's RETURNING, so it writes a row exactly when the guard let the change through.
const fn apply_sql(reserve: bool) -> &'static str {
    if reserve {
        "WITH changed AS (
            UPDATE resources SET available = available - $1, reserved = reserved + $1,
                version = version + 1, updated_at = $2
            WHERE tenant_id = $3 AND key = $4 AND status = 'active' AND mode = 'db' AND available >= $1
              AND ($5::text IS NULL OR kind = $5::text)
            RETURNING available, reserved, consumed, version)
         INSERT INTO ledger (tenant_id, resource_key, bucket, op, qty, request_id, order_id, reservation_id,
                             available_after, reserved_after, consumed_after, version_after, plugin_version, at)
         SELECT $3, $4, 0, 'reserve', $1, $6, $7, $8, available, reserved, consumed, version, $9, $2 FROM changed
         RETURNING seq"
    } else {
        "WITH changed AS (
            UPDATE resources SET available = available - $1, consumed = consumed + $1,
                version = version + 1, updated_at = $2
            WHERE tenant_id = $3 AND key = $4 AND status = 'active' AND mode = 'db' AND available >= $1
              AND ($5::text IS NULL OR kind = $5::text)
            RETURNING available, reserved, consumed, version)
         INSERT INTO ledger (tenant_id, resource_key, bucket, op, qty, request_id, order_id, reservation_id,
                             available_after, reserved_after, consumed_after, version_after, plugin_version, at)
         SELECT $3, $4, 0, 'deduct', $1, $6, $7, $8, available, reserved, consumed, version, $9, $2 FROM changed
         RETURNING seq"
    }
}

/// What a per-user limit key has used so far (0 if never).
pub(super) async fn limit_used(conn: &mut PgConnection, tenant: &str, key: &str) -> Result<i64, StorageError> {
    let used: Option<i64> = sqlx::query_scalar("SELECT used FROM user_limits WHERE tenant_id = $1 AND key = $2")
        .bind(tenant)
        .bind(key)
        .fetch_optional(&mut *conn)
        .await?;
    Ok(used.unwrap_or(0))
}

/// The `(status, kind, available, buckets)` of a resource, for judging lines with
/// [`line_refusal`]; a bucketed resource's available is its buckets' sum.
pub(super) async fn line_view(
    conn: &mut PgConnection,
    tenant: &str,
    resource: &str,
) -> Result<Option<LineView>, StorageError> {
    Ok(sqlx::query_as(LINE_VIEW_SQL).bind(tenant).bind(resource).fetch_optional(&mut *conn).await?)
}

/// See [`line_view`].
pub(super) const LINE_VIEW_SQL: &str = "SELECT status, kind,
        CASE WHEN buckets = 1 THEN available ELSE
          (SELECT COALESCE(SUM(b.available), 0)::BIGINT FROM resource_buckets b
           WHERE b.tenant_id = r.tenant_id AND b.resource_key = r.key) END AS available,
        buckets
    FROM resources r WHERE tenant_id = $1 AND key = $2";

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
/// resource); `Err(reason)`: refused.
async fn apply_target(
    conn: &mut PgConnection,
    facts: &OrderFacts<'_>,
    qty: i64,
    target: &Target,
) -> Result<Result<Vec<BucketTake>, Reason>, StorageError> {
    let sql = apply_sql(facts.action == Action::Reserve);
    let tenant = facts.tenant.as_str();
    let update = || {
        sqlx::query(sql)
            .bind(qty)
            .bind(facts.now_ms)
            .bind(tenant)
            .bind(target.resource.as_str())
            .bind(target.kind.map(Kind::as_str))
            .bind(facts.request_id)
            .bind(facts.order_id)
            .bind(facts.reservation_id)
            .bind(facts.plugin_version)
    };
    let mut applied = update().fetch_optional(&mut *conn).await?.is_some();
    if !applied {
        if let Some(allowance) = target.create_if_missing {
            // ON CONFLICT DO NOTHING: when another process created the same period meanwhile
            // (or it existed and was short), this creates nothing and the update is judged again.
            let kind = target.kind.unwrap_or(Kind::Quota);
            let new = NewResource { key: target.resource.clone(), kind, total: allowance, buckets: 1 };
            create_resource_as(conn, facts.tenant, &new, facts.plugin_version, facts.now_ms).await?;
            applied = update().fetch_optional(&mut *conn).await?.is_some();
        }
    }
    if applied {
        return Ok(Ok(Vec::new()));
    }
    let view = line_view(conn, tenant, target.resource.as_str()).await?;
    if let Some((.., n)) = view {
        if n > 1 {
            // A bucketed resource's row holds no counters; its buckets take the line.
            if let Some(reason) = line_refusal(view.as_ref(), target, qty) {
                return Ok(Err(reason));
            }
            let (how, op) = match facts.action {
                Action::Deduct => (buckets::Move::Deduct, LedgerOp::Deduct),
                Action::Reserve => (buckets::Move::Reserve, LedgerOp::Reserve),
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
            return buckets::take(conn, &bucket_facts, how, target, n, facts.seed, qty).await;
        }
    }
    // A resource that switched to redis mode is sold by Redis alone; an order planned before
    // this process learnt of the switch retries (same key) and reaches the Redis path.
    let mode: Option<String> = sqlx::query_scalar("SELECT mode FROM resources WHERE tenant_id = $1 AND key = $2")
        .bind(tenant)
        .bind(target.resource.as_str())
        .fetch_optional(&mut *conn)
        .await?;
    if mode.as_deref() == Some("redis") {
        return Err(StorageError::Unavailable(format!("{} switched to redis mode", target.resource)));
    }
    // The guarded UPDATE refused, so some reason applied at that moment. Another process may
    // have changed the row since (a restock, say); then the refusal was for want of stock.
    Ok(Err(line_refusal(view.as_ref(), target, qty).unwrap_or(Reason::Insufficient)))
}

/// Counts `qty` against a per-user limit if it stays within `max`; `false`: it would not.
async fn take_limit(
    conn: &mut PgConnection,
    tenant: &TenantId,
    limit: &LimitSpec,
    qty: i64,
) -> Result<bool, StorageError> {
    if qty > limit.max {
        return Ok(false);
    }
    let changed = sqlx::query(
        "INSERT INTO user_limits (tenant_id, key, used) VALUES ($1, $2, $3)
         ON CONFLICT (tenant_id, key) DO UPDATE SET used = user_limits.used + EXCLUDED.used
         WHERE user_limits.used + EXCLUDED.used <= $4",
    )
    .bind(tenant.as_str())
    .bind(limit.key.as_str())
    .bind(qty)
    .bind(limit.max)
    .execute(&mut *conn)
    .await?;
    Ok(changed.rows_affected() == 1)
}

/// Gives back what a released or expired reservation line took from its limit.
async fn give_back_limit(conn: &mut PgConnection, tenant: &str, key: &str, qty: i64) -> Result<(), StorageError> {
    sqlx::query("UPDATE user_limits SET used = used - $1 WHERE tenant_id = $2 AND key = $3 AND used >= $1")
        .bind(qty)
        .bind(tenant)
        .bind(key)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// Applies one planned line: its limit (if any), then the first target that can take it. A
/// line that fails leaves nothing behind.
async fn apply_line(
    conn: &mut PgConnection,
    facts: &OrderFacts<'_>,
    line: &PlannedLine,
) -> Result<(LineResult, Vec<BucketTake>), StorageError> {
    // Only a line with a limit, or one that may create a resource, can change something and
    // still fail; only those need a savepoint of their own.
    let nested = line.limit.is_some() || line.targets.iter().any(|t| t.create_if_missing.is_some());
    if nested {
        sqlx::query("SAVEPOINT line").execute(&mut *conn).await?;
    }
    let result = apply_line_inner(conn, facts, line).await?;
    if nested {
        if !result.0.applied() {
            sqlx::query("ROLLBACK TO SAVEPOINT line").execute(&mut *conn).await?;
        }
        sqlx::query("RELEASE SAVEPOINT line").execute(&mut *conn).await?;
    }
    Ok(result)
}

async fn apply_line_inner(
    conn: &mut PgConnection,
    facts: &OrderFacts<'_>,
    line: &PlannedLine,
) -> Result<(LineResult, Vec<BucketTake>), StorageError> {
    if let Some(limit) = &line.limit {
        if !take_limit(conn, facts.tenant, limit, line.qty).await? {
            return Ok((LineResult::Rejected(Reason::LimitExceeded), Vec::new()));
        }
    }
    let mut first_refusal = None;
    for (i, target) in line.targets.iter().enumerate() {
        match apply_target(conn, facts, line.qty, target).await? {
            Ok(takes) => return Ok((LineResult::Applied(i), takes)),
            Err(reason) => {
                first_refusal.get_or_insert(reason);
            }
        }
    }
    Ok((LineResult::Rejected(first_refusal.unwrap_or(Reason::ResourceNotFound)), Vec::new()))
}

pub async fn execute_order(
    conn: &mut PgConnection,
    job: &OrderJob,
    now_ms: i64,
) -> Result<OrderExecution, StorageError> {
    if let Some(previous) = idempotency_claim(conn, &job.tenant, &job.idempotency, now_ms).await? {
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
        sqlx::query("SAVEPOINT lines").execute(&mut *conn).await?;
    }
    let mut results = vec![LineResult::Rejected(Reason::Skipped); job.plan.lines.len()];
    let mut takes = vec![Vec::new(); job.plan.lines.len()];
    for i in sequence {
        (results[i], takes[i]) = apply_line(conn, &facts, &job.plan.lines[i]).await?;
    }
    let status = decide(&job.plan, &results);
    if nested {
        if status == OrderStatus::Rejected {
            sqlx::query("ROLLBACK TO SAVEPOINT lines").execute(&mut *conn).await?;
        }
        sqlx::query("RELEASE SAVEPOINT lines").execute(&mut *conn).await?;
    }
    if status != OrderStatus::Rejected {
        if let Some((id, expires_at)) = &reservation {
            insert_reservation(conn, job, &results, &takes, id, *expires_at, now_ms).await?;
        }
    }
    let document = OrderDocument::build(&job.order, &job.plan, &results, reservation);
    let code = if status == OrderStatus::Rejected { 409 } else { 201 };
    let response = StoredResponse::json(code, &document)?;
    idempotency_finish(conn, &job.tenant, &job.idempotency, &response).await?;
    Ok(OrderExecution { response: Idempotent::Fresh(response), outcome: Some((status, results)) })
}

async fn insert_reservation(
    conn: &mut PgConnection,
    job: &OrderJob,
    results: &[LineResult],
    takes: &[Vec<BucketTake>],
    id: &str,
    expires_at: Timestamp,
    now_ms: i64,
) -> Result<(), StorageError> {
    let lines = reservation_lines_json(job, results, takes)?;
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
    conn: &mut PgConnection,
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

const CONFIRM_SQL: &str =
    "UPDATE resources SET reserved = reserved - $1, consumed = consumed + $1, version = version + 1,
        updated_at = $2
    WHERE tenant_id = $3 AND key = $4 AND reserved >= $1 RETURNING available, reserved, consumed, version";
const UNRESERVE_SQL: &str =
    "UPDATE resources SET reserved = reserved - $1, available = available + $1, version = version + 1,
        updated_at = $2
    WHERE tenant_id = $3 AND key = $4 AND reserved >= $1 RETURNING available, reserved, consumed, version";

/// Moves a held reservation to `to` (confirmed, released or expired): the state changes only
/// if it is still `held`, and its lines leave `reserved`, each with a ledger row. `None` when it
/// was no longer held: another process moved it after our read, and its move stands.
async fn finish_reservation(
    conn: &mut PgConnection,
    tenant: &str,
    mut reservation: Reservation,
    to: ReservationState,
    now_ms: i64,
) -> Result<Option<Reservation>, StorageError> {
    let (op, sql) = match to {
        ReservationState::Confirmed => (LedgerOp::Confirm, CONFIRM_SQL),
        ReservationState::Released => (LedgerOp::Release, UNRESERVE_SQL),
        ReservationState::Expired => (LedgerOp::Expire, UNRESERVE_SQL),
        ReservationState::Held => return Err(StorageError::Internal("a reservation cannot move back to held".into())),
    };
    // Under READ COMMITTED this waits for a concurrent mover's commit and then re-checks
    // `state = 'held'` against the committed row, so exactly one move wins.
    let moved = sqlx::query(
        "UPDATE reservations SET state = $1, updated_at = $2 WHERE tenant_id = $3 AND id = $4 AND state = 'held'",
    )
    .bind(to.as_str())
    .bind(now_ms)
    .bind(tenant)
    .bind(&reservation.id)
    .execute(&mut *conn)
    .await?
    .rows_affected();
    if moved != 1 {
        return Ok(None);
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
                if !buckets::move_bucket(conn, &facts, how, take.bucket, take.qty).await? {
                    return Err(StorageError::Internal(format!(
                        "bucket of reservation {} holds less than reserved",
                        reservation.id
                    )));
                }
            }
            if let (Some(key), true) = (&line.limit_key, to != ReservationState::Confirmed) {
                give_back_limit(conn, tenant, key, line.qty).await?;
            }
            continue;
        }
        let row = sqlx::query(sql)
            .bind(line.qty)
            .bind(now_ms)
            .bind(tenant)
            .bind(&line.resource)
            .fetch_optional(&mut *conn)
            .await?
            .ok_or_else(|| {
                StorageError::Internal(format!("resource of reservation {} holds less than reserved", reservation.id))
            })?;
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
        append_ledger(conn, facts, After::from_row(&row)?).await?;
        if let (Some(key), true) = (&line.limit_key, to != ReservationState::Confirmed) {
            give_back_limit(conn, tenant, key, line.qty).await?;
        }
    }
    reservation.state = to;
    Ok(Some(reservation))
}

/// How many times a transition reads the reservation: a second read follows only a lost race,
/// and then sees a final state, which needs no move.
const TRANSITION_READS: usize = 2;

pub async fn confirm_reservation(
    conn: &mut PgConnection,
    tenant: &TenantId,
    id: &str,
    now_ms: i64,
) -> Result<Transition, StorageError> {
    for _ in 0..TRANSITION_READS {
        let Some(reservation) = load_reservation(conn, tenant.as_str(), id).await? else {
            return Ok(Transition::NotFound);
        };
        let transition = match reservation.state {
            ReservationState::Confirmed => Transition::Done(reservation),
            ReservationState::Released | ReservationState::Expired => {
                Transition::Refused(reservation.state, reservation)
            }
            // Past its deadline but not yet swept: it is expired. Expiring it here keeps a late
            // confirm from winning a race with the sweeper.
            ReservationState::Held if reservation.expires_at.0 <= now_ms => {
                match finish_reservation(conn, tenant.as_str(), reservation, ReservationState::Expired, now_ms).await? {
                    Some(expired) => {
                        metrics::counter!("stockd_reservations_expired_total").increment(1);
                        Transition::Refused(ReservationState::Expired, expired)
                    }
                    None => continue,
                }
            }
            ReservationState::Held => {
                match finish_reservation(conn, tenant.as_str(), reservation, ReservationState::Confirmed, now_ms)
                    .await?
                {
                    Some(confirmed) => Transition::Done(confirmed),
                    None => continue,
                }
            }
        };
        return Ok(transition);
    }
    Err(StorageError::Internal(format!("reservation {id} left held twice")))
}

pub async fn release_reservation(
    conn: &mut PgConnection,
    tenant: &TenantId,
    id: &str,
    now_ms: i64,
) -> Result<Transition, StorageError> {
    for _ in 0..TRANSITION_READS {
        let Some(reservation) = load_reservation(conn, tenant.as_str(), id).await? else {
            return Ok(Transition::NotFound);
        };
        let transition = match reservation.state {
            ReservationState::Released | ReservationState::Expired => Transition::Done(reservation),
            ReservationState::Confirmed => Transition::Refused(ReservationState::Confirmed, reservation),
            ReservationState::Held => {
                match finish_reservation(conn, tenant.as_str(), reservation, ReservationState::Released, now_ms).await?
                {
                    Some(released) => Transition::Done(released),
                    None => continue,
                }
            }
        };
        return Ok(transition);
    }
    Err(StorageError::Internal(format!("reservation {id} left held twice")))
}

pub async fn expire_due(conn: &mut PgConnection, now_ms: i64, limit: u32) -> Result<u64, StorageError> {
    // SKIP LOCKED: the sweepers of several processes each take different due rows, and a row a
    // confirm or release is moving right now is left to it.
    let rows = sqlx::query(
        "SELECT tenant_id, id, order_id, state, lines, expires_at FROM reservations
         WHERE state = 'held' AND expires_at <= $1 ORDER BY expires_at LIMIT $2
         FOR UPDATE SKIP LOCKED",
    )
    .bind(now_ms)
    .bind(i64::from(limit))
    .fetch_all(&mut *conn)
    .await?;
    let mut expired = 0;
    for row in &rows {
        let tenant: &str = row.try_get("tenant_id")?;
        let reservation = reservation_from_row(row)?;
        let id = reservation.id.clone();
        // The row is locked by this transaction, so it is still held.
        if finish_reservation(conn, tenant, reservation, ReservationState::Expired, now_ms).await?.is_none() {
            return Err(StorageError::Internal(format!("locked reservation {id} was not held")));
        }
        expired += 1;
    }
    Ok(expired)
}

pub async fn purge_idempotency(conn: &mut PgConnection, before_ms: i64, limit: u32) -> Result<u64, StorageError> {
    let deleted = sqlx::query(
        "DELETE FROM idempotency WHERE (tenant_id, key) IN
           (SELECT tenant_id, key FROM idempotency WHERE created_at < $1 LIMIT $2 FOR UPDATE SKIP LOCKED)",
    )
    .bind(before_ms)
    .bind(i64::from(limit))
    .execute(&mut *conn)
    .await?
    .rows_affected();
    Ok(deleted)
}

/// Deletes a tenant's ($1) versions beyond the newest $3, ranking first the new version ($2)
/// and the active one, so neither is ever deleted while the cap is at least 2.
const PRUNE_PLUGINS: &str = "DELETE FROM plugins WHERE tenant_id = $1 AND version IN (
    SELECT version FROM (
        SELECT p.version, ROW_NUMBER() OVER (ORDER BY
            p.version = $2 DESC,
            p.version = COALESCE((SELECT a.version FROM plugin_active a WHERE a.tenant_id = $1), 0) DESC,
            p.version DESC) AS keep_rank
        FROM plugins p WHERE p.tenant_id = $1) ranked
    WHERE keep_rank > $3)";

/// Stores the next plugin version of a tenant, prunes beyond the cap, and activates it. The
/// tenant row is locked first, so two processes uploading at once number their versions one
/// after the other, and an activation (which share-locks the row) never picks a version the
/// prune is deleting.
pub async fn save_plugin(
    conn: &mut PgConnection,
    tenant: &TenantId,
    upload: &PluginUpload,
    now_ms: i64,
) -> Result<PluginVersion, StorageError> {
    sqlx::query("SELECT 1 FROM tenants WHERE id = $1 FOR UPDATE").bind(tenant.as_str()).execute(&mut *conn).await?;
    let version: i64 = sqlx::query_scalar("SELECT COALESCE(MAX(version), 0) + 1 FROM plugins WHERE tenant_id = $1")
        .bind(tenant.as_str())
        .fetch_one(&mut *conn)
        .await?;
    sqlx::query(
        "INSERT INTO plugins (tenant_id, version, sha256, wasm, config, uploaded_at) VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(tenant.as_str())
    .bind(version)
    .bind(&upload.sha256)
    .bind(&upload.wasm)
    .bind(&upload.config)
    .bind(now_ms)
    .execute(&mut *conn)
    .await?;
    // Before the switch, so the version active until now is still the one the rule keeps.
    let max_versions = i64::try_from(upload.max_versions).unwrap_or(i64::MAX);
    sqlx::query(PRUNE_PLUGINS).bind(tenant.as_str()).bind(version).bind(max_versions).execute(&mut *conn).await?;
    set_active_plugin(conn, tenant, version).await?;
    Ok(PluginVersion {
        version,
        sha256: upload.sha256.clone(),
        config: upload.config.clone(),
        uploaded_at_ms: now_ms,
        active: true,
    })
}

async fn set_active_plugin(conn: &mut PgConnection, tenant: &TenantId, version: i64) -> Result<(), StorageError> {
    sqlx::query(
        "INSERT INTO plugin_active (tenant_id, version) VALUES ($1, $2)
         ON CONFLICT (tenant_id) DO UPDATE SET version = EXCLUDED.version",
    )
    .bind(tenant.as_str())
    .bind(version)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Activates a stored version (or 0, the built-in default); `None` if there is no such version.
pub async fn activate_plugin(
    conn: &mut PgConnection,
    tenant: &TenantId,
    version: i64,
) -> Result<Option<PluginVersion>, StorageError> {
    if version == 0 {
        set_active_plugin(conn, tenant, 0).await?;
        return Ok(Some(PluginVersion {
            version: 0,
            sha256: String::new(),
            config: String::new(),
            uploaded_at_ms: 0,
            active: true,
        }));
    }
    // Waits for an upload of this tenant in flight, so the version is not one it is pruning.
    sqlx::query("SELECT 1 FROM tenants WHERE id = $1 FOR SHARE").bind(tenant.as_str()).execute(&mut *conn).await?;
    let found: Option<(String, String, i64)> =
        sqlx::query_as("SELECT sha256, config, uploaded_at FROM plugins WHERE tenant_id = $1 AND version = $2")
            .bind(tenant.as_str())
            .bind(version)
            .fetch_optional(&mut *conn)
            .await?;
    let Some((sha256, config, uploaded_at_ms)) = found else { return Ok(None) };
    set_active_plugin(conn, tenant, version).await?;
    Ok(Some(PluginVersion { version, sha256, config, uploaded_at_ms, active: true }))
}

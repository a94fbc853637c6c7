//! [`Port`] on PostgreSQL: the statements of [`crate::apply`] for the batcher's connection,
//! inside the savepoint of one job of a group commit.
//!
//! Several processes may write at once, and nothing here relies on being the only writer: a
//! guarded change is one statement with its ledger row (the INSERT reads the UPDATE's RETURNING,
//! so a row is written exactly when the guard let the change through); an idempotency key is
//! claimed by inserting its row first (a concurrent duplicate in another process waits on that
//! row, then replays); a reservation leaves `held` only by a guarded UPDATE; sweeps lock their
//! rows with `SKIP LOCKED`.

use sqlx::postgres::{PgArguments, PgRow};
use std::collections::{HashMap, HashSet};

use sqlx::{PgConnection, Row as SqlRow};

use crate::apply::port::{
    BatchWrites, Change, Claim, Counts, Entry, Gate, Move, NewReservation, Outcome, Port, Row, Savepoint, View,
};
use crate::apply::reads::{LedgerRows, Reads};
use crate::engine::reversal::OrderEntries;
use crate::engine::{
    BucketCounts, Checkpoint, Kind, LedgerEntry, LimitSpec, Mode, Pass, Reservation, ReservationState, ResourceState,
    ResourceStatus, TenantId, MAX_TOTAL,
};
use crate::events::{NewEvent, Stock, StockBand};
use crate::storage::redis_store::{SettleRecord, REFUSED_RESERVATION_SQL};
use crate::storage::rows::{self, Columns, BUCKET_COLUMNS, CHECKPOINT_COLUMNS, LEDGER_COLUMNS, RESOURCE_COLUMNS};
use crate::storage::{
    body_columns, stored_hash, IdempotencyRequest, Idempotent, NewResource, PageFrom, StorageError, StoredResponse,
};

/// An order's entries on PostgreSQL, through `ledger_by_order`, which is keyed by a hash of the
/// tenant and the order id (migrations/postgres/0022): the condition names the index's expression,
/// then the two values themselves, so two pairs whose hashes collide cost a row read, not a wrong
/// answer.
pub(super) const ORDER_ENTRIES: &str = rows::order_entries_sql!(
    "ledger WHERE hashtextextended(tenant_id || ' ' || order_id, 0) = hashtextextended($1::text || ' ' || $2::text, 0)
       AND tenant_id = $1 AND order_id = $2",
    "$3"
);

fn corrupt(what: &str) -> StorageError {
    StorageError::Internal(format!("unexpected stored value in {what}"))
}

/// The response stored in an idempotency row (`response_code, response_type, response_body`);
/// `None` while its key is claimed but not yet answered.
pub(super) fn stored_response(row: &PgRow) -> Result<Option<StoredResponse>, StorageError> {
    let code: Option<i32> = row.try_get("response_code")?;
    let kind: Option<&str> = row.try_get("response_type")?;
    StoredResponse::from_columns(
        code.map(i64::from),
        kind,
        row.try_get("response_body")?,
        row.try_get("response_event")?,
    )
}

/// A guarded UPDATE and its ledger row in one statement. `$1` quantity, `$2` time, `$3` tenant,
/// `$4` resource, `$5` bucket, `$6` op, `$7` request, `$8` order, `$9` reservation, `$10` plugin
/// version, `$11` line key, `$12` limit key, `$13` the request a reversal gives back, and `$14`
/// the kind (an order's deduction or reservation) or the largest total (an adjustment of a
/// resource row).
macro_rules! with_ledger {
    ($update:expr) => {
        concat!(
            "WITH changed AS (",
            $update,
            " RETURNING available, reserved, consumed, version)
             INSERT INTO ledger (tenant_id, resource_key, bucket, op, qty, request_id, order_id, reservation_id,
                                 available_after, reserved_after, consumed_after, version_after, plugin_version, at,
                                 line_key, limit_key, reverses)
             SELECT $3, $4, $5, $6, $1, $7, $8, $9, available, reserved, consumed, version, $10, $2, $11, $12, $13
             FROM changed
             RETURNING available_after AS available, reserved_after AS reserved, consumed_after AS consumed,
                       version_after AS version"
        )
    };
}
macro_rules! resource_move {
    ($set:literal, $guard:literal) => {
        with_ledger!(concat!(
            "UPDATE resources SET ",
            $set,
            ", version = version + 1, updated_at = $2 WHERE tenant_id = $3 AND key = $4 AND ",
            $guard
        ))
    };
}
macro_rules! bucket_move {
    ($set:literal, $guard:literal) => {
        with_ledger!(concat!(
            "UPDATE resource_buckets SET ",
            $set,
            ", version = version + 1, updated_at = $2
             WHERE tenant_id = $3 AND resource_key = $4 AND bucket = $5 AND ",
            $guard
        ))
    };
}

fn change_sql(row: Row, how: Move, gate: Gate) -> &'static str {
    match (row, how, gate) {
        (Row::Resource, Move::Deduct, Gate::Order { .. }) => resource_move!(
            "available = available - $1, consumed = consumed + $1",
            "status = 'active' AND mode = 'db' AND available >= $1 AND ($14::text IS NULL OR kind = $14::text)"
        ),
        (Row::Resource, Move::Reserve, Gate::Order { .. }) => resource_move!(
            "available = available - $1, reserved = reserved + $1",
            "status = 'active' AND mode = 'db' AND available >= $1 AND ($14::text IS NULL OR kind = $14::text)"
        ),
        (Row::Resource, Move::Deduct, _) => {
            resource_move!("available = available - $1, consumed = consumed + $1", "available >= $1")
        }
        (Row::Resource, Move::Reserve, _) => {
            resource_move!("available = available - $1, reserved = reserved + $1", "available >= $1")
        }
        (Row::Resource, Move::Confirm, _) => {
            resource_move!("reserved = reserved - $1, consumed = consumed + $1", "reserved >= $1")
        }
        (Row::Resource, Move::Unreserve, _) => {
            resource_move!("reserved = reserved - $1, available = available + $1", "reserved >= $1")
        }
        (Row::Resource, Move::Adjust, _) => resource_move!(
            "available = available + $1, total = total + $1",
            "available + $1 >= 0 AND total + $1 <= $14::bigint"
        ),
        (Row::Bucket(_), Move::Deduct, _) => {
            bucket_move!("available = available - $1, consumed = consumed + $1", "available >= $1")
        }
        (Row::Bucket(_), Move::Reserve, _) => {
            bucket_move!("available = available - $1, reserved = reserved + $1", "available >= $1")
        }
        (Row::Bucket(_), Move::Confirm, _) => {
            bucket_move!("reserved = reserved - $1, consumed = consumed + $1", "reserved >= $1")
        }
        (Row::Bucket(_), Move::Unreserve, _) => {
            bucket_move!("reserved = reserved - $1, available = available + $1", "reserved >= $1")
        }
        (Row::Bucket(_), Move::Adjust, _) => {
            bucket_move!("available = available + $1, total = total + $1", "available + $1 >= 0")
        }
        (Row::Resource, Move::Reverse, Gate::Order { .. }) => {
            resource_move!("consumed = consumed - $1, available = available + $1", "mode = 'db' AND consumed >= $1")
        }
        (Row::Resource, Move::Reverse, _) => {
            resource_move!("consumed = consumed - $1, available = available + $1", "consumed >= $1")
        }
        (Row::Bucket(_), Move::Reverse, _) => {
            bucket_move!("consumed = consumed - $1, available = available + $1", "consumed >= $1")
        }
    }
}

/// A connection of the batcher (or of a sweep) as a [`Port`].
pub struct PgPort<'c> {
    conn: &'c mut PgConnection,
}

impl<'c> PgPort<'c> {
    pub fn new(conn: &'c mut PgConnection) -> Self {
        Self { conn }
    }

    async fn exec(&mut self, sql: &'static str) -> Result<(), StorageError> {
        sqlx::query(sql).execute(&mut *self.conn).await?;
        Ok(())
    }

    /// The stored outcomes of these keys that have one, by `(tenant, key)`, with their hashes.
    async fn stored_outcomes(
        &mut self,
        tenants: &[String],
        keys: &[String],
    ) -> Result<std::collections::HashMap<(String, String), (String, StoredResponse)>, StorageError> {
        let rows = sqlx::query(concat!(
            "SELECT i.tenant_id, i.key, ",
            crate::outcome_columns!(),
            " JOIN UNNEST($1::text[], $2::text[]) AS u (tenant_id, key) ON i.tenant_id = u.tenant_id AND i.key = u.key"
        ))
        .bind(tenants)
        .bind(keys)
        .fetch_all(&mut *self.conn)
        .await?;
        let mut found = std::collections::HashMap::with_capacity(rows.len());
        for row in rows {
            if let Some(response) = stored_response(&row)? {
                found
                    .insert((row.try_get("tenant_id")?, row.try_get("key")?), (row.try_get("request_hash")?, response));
            }
        }
        Ok(found)
    }
}

impl Port for PgPort<'_> {
    /// The INSERT comes first because it is what serialises duplicates across processes: if
    /// another transaction holds an uncommitted row for the key, `ON CONFLICT` waits for it to
    /// end, then either inserts (it rolled back) or does nothing (it committed, response and all).
    async fn claim_key(
        &mut self,
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
        .bind(stored_hash(&idem.request_hash))
        .bind(now_ms)
        .execute(&mut *self.conn)
        .await?
        .rows_affected();
        if inserted == 1 {
            return Ok(None);
        }
        let row = sqlx::query(concat!("SELECT ", crate::outcome_columns!(), " WHERE i.tenant_id = $1 AND i.key = $2"))
            .bind(tenant.as_str())
            .bind(idem.key.as_str())
            .fetch_optional(&mut *self.conn)
            .await?;
        // The row conflicted a moment ago and is gone now: the purge job removed an expired key in
        // between. Transient: the retried batch finds the key free.
        let Some(row) = row else { return Err(StorageError::Unavailable("idempotency key vanished".into())) };
        let hash: &str = row.try_get("request_hash")?;
        // Committed rows always carry their response (it is written in the transaction that
        // inserted them), so a missing one means this transaction claimed it and did not finish.
        let Some(response) = stored_response(&row)? else {
            return Err(StorageError::Internal(format!(
                "idempotency key {} has no stored response",
                idem.key.as_str()
            )));
        };
        Ok(Some(idem.judge(hash, response)))
    }

    async fn store_outcome(
        &mut self,
        tenant: &TenantId,
        idem: &IdempotencyRequest,
        response: &StoredResponse,
        event: Option<&str>,
        // Found through `ledger_by_order` like any other order's entries.
        _request_id: Option<&str>,
        _now_ms: i64,
    ) -> Result<(), StorageError> {
        let (body, event) = body_columns(response, event);
        let updated = sqlx::query(
            "UPDATE idempotency SET response_code = $1, response_type = $2, response_body = $3, response_event = $6
             WHERE tenant_id = $4 AND key = $5",
        )
        .bind(i32::from(response.status))
        .bind(response.content_type.as_str())
        .bind(body)
        .bind(tenant.as_str())
        .bind(idem.key.as_str())
        .bind(event)
        .execute(&mut *self.conn)
        .await?
        .rows_affected();
        if updated != 1 {
            return Err(StorageError::Internal(format!("idempotency key {} was not claimed", idem.key.as_str())));
        }
        Ok(())
    }

    async fn forget_key(&mut self, tenant: &TenantId, idem: &IdempotencyRequest) -> Result<(), StorageError> {
        sqlx::query("DELETE FROM idempotency WHERE tenant_id = $1 AND key = $2 AND response_code IS NULL")
            .bind(tenant.as_str())
            .bind(idem.key.as_str())
            .execute(&mut *self.conn)
            .await?;
        Ok(())
    }

    async fn savepoint(&mut self, at: Savepoint) -> Result<(), StorageError> {
        self.exec(match at {
            Savepoint::Lines => "SAVEPOINT lines",
            Savepoint::Line => "SAVEPOINT line",
        })
        .await
    }

    async fn rollback_to(&mut self, at: Savepoint) -> Result<(), StorageError> {
        self.exec(match at {
            Savepoint::Lines => "ROLLBACK TO SAVEPOINT lines",
            Savepoint::Line => "ROLLBACK TO SAVEPOINT line",
        })
        .await
    }

    async fn release(&mut self, at: Savepoint) -> Result<(), StorageError> {
        self.exec(match at {
            Savepoint::Lines => "RELEASE SAVEPOINT lines",
            Savepoint::Line => "RELEASE SAVEPOINT line",
        })
        .await
    }

    async fn change(&mut self, change: &Change<'_>) -> Result<Option<Counts>, StorageError> {
        let e = &change.entry;
        let bucket = match change.row {
            Row::Resource => 0,
            Row::Bucket(b) => b,
        };
        let query = sqlx::query(change_sql(change.row, change.how, change.gate))
            .bind(e.qty)
            .bind(e.at)
            .bind(e.tenant)
            .bind(e.resource)
            .bind(bucket)
            .bind(e.op.as_str())
            .bind(e.request_id)
            .bind(e.order_id)
            .bind(e.reservation_id)
            .bind(e.plugin_version)
            .bind(e.line_key)
            .bind(e.limit_key)
            .bind(e.reverses);
        let query = match (change.row, change.how, change.gate) {
            (Row::Resource, Move::Deduct | Move::Reserve, Gate::Order { kind }) => query.bind(kind.map(Kind::as_str)),
            (Row::Resource, Move::Adjust, _) => query.bind(MAX_TOTAL),
            _ => query,
        };
        query.fetch_optional(&mut *self.conn).await?.as_ref().map(|row| rows::counts(row)).transpose()
    }

    async fn append_ledger(&mut self, e: &Entry<'_>, after: Counts) -> Result<(), StorageError> {
        sqlx::query(
            "INSERT INTO ledger (tenant_id, resource_key, bucket, op, qty, request_id, order_id, reservation_id,
                                 available_after, reserved_after, consumed_after, version_after, plugin_version, at,
                                 line_key, limit_key, reverses)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17)",
        )
        .bind(e.tenant)
        .bind(e.resource)
        .bind(e.bucket)
        .bind(e.op.as_str())
        .bind(e.qty)
        .bind(e.request_id)
        .bind(e.order_id)
        .bind(e.reservation_id)
        .bind(after.available)
        .bind(after.reserved)
        .bind(after.consumed)
        .bind(after.version)
        .bind(e.plugin_version)
        .bind(e.at)
        .bind(e.line_key)
        .bind(e.limit_key)
        .bind(e.reverses)
        .execute(&mut *self.conn)
        .await?;
        Ok(())
    }

    async fn view(&mut self, tenant: &str, key: &str) -> Result<Option<View>, StorageError> {
        let row: Option<(String, String, String, i64, i64)> = sqlx::query_as(
            "SELECT status, kind, mode,
                    CASE WHEN buckets = 1 THEN available ELSE
                      (SELECT COALESCE(SUM(b.available), 0)::BIGINT FROM resource_buckets b
                       WHERE b.tenant_id = r.tenant_id AND b.resource_key = r.key) END AS available,
                    buckets
             FROM resources r WHERE tenant_id = $1 AND key = $2",
        )
        .bind(tenant)
        .bind(key)
        .fetch_optional(&mut *self.conn)
        .await?;
        let Some((status, kind, mode, available, buckets)) = row else { return Ok(None) };
        let (Some(status), Some(kind), Some(mode)) =
            (ResourceStatus::from_db(&status), Kind::from_db(&kind), Mode::from_db(&mode))
        else {
            return Err(corrupt("resources"));
        };
        Ok(Some(View { status, kind, mode, available, buckets }))
    }

    async fn resource(&mut self, tenant: &str, key: &str) -> Result<Option<ResourceState>, StorageError> {
        let row = sqlx::query(&format!("SELECT {RESOURCE_COLUMNS} FROM resources WHERE tenant_id = $1 AND key = $2"))
            .bind(tenant)
            .bind(key)
            .fetch_optional(&mut *self.conn)
            .await?;
        row.as_ref().map(|row| rows::resource(row)).transpose()
    }

    async fn set_status(
        &mut self,
        tenant: &str,
        key: &str,
        status: ResourceStatus,
        now_ms: i64,
    ) -> Result<Option<ResourceState>, StorageError> {
        let row = sqlx::query(&format!(
            "UPDATE resources SET status = $1, updated_at = $2 WHERE tenant_id = $3 AND key = $4
             RETURNING {RESOURCE_COLUMNS}"
        ))
        .bind(status.as_str())
        .bind(now_ms)
        .bind(tenant)
        .bind(key)
        .fetch_optional(&mut *self.conn)
        .await?;
        row.as_ref().map(|row| rows::resource(row)).transpose()
    }

    async fn insert_resource(
        &mut self,
        tenant: &str,
        res: &NewResource,
        now_ms: i64,
    ) -> Result<Option<(ResourceState, Counts)>, StorageError> {
        // A bucketed resource's row holds no counters: its buckets do.
        let row_total = if res.buckets > 1 { 0 } else { res.total };
        let row = sqlx::query(&format!(
            "INSERT INTO resources (tenant_id, key, kind, status, mode, buckets, total, available, reserved, consumed,
                                    version, created_at, updated_at, low_stock, stock)
             VALUES ($1, $2, $3, 'active', 'db', $6, $4, $4, 0, 0, 1, $5, $5, $7, $8)
             ON CONFLICT (tenant_id, key) DO NOTHING
             RETURNING {RESOURCE_COLUMNS}"
        ))
        .bind(tenant)
        .bind(res.key.as_str())
        .bind(res.kind.as_str())
        .bind(row_total)
        .bind(now_ms)
        .bind(res.buckets.max(1))
        .bind(res.low_stock)
        .bind(StockBand::of(res.total, res.low_stock).as_str())
        .fetch_optional(&mut *self.conn)
        .await?;
        let Some(row) = row else { return Ok(None) };
        Ok(Some((rows::resource(&row)?, rows::counts(&row)?)))
    }

    async fn insert_buckets(&mut self, shares: &[i64], e: &Entry<'_>) -> Result<(), StorageError> {
        let buckets: Vec<i64> = (0..shares.len() as i64).collect();
        sqlx::query(
            "WITH created AS (
                INSERT INTO resource_buckets (tenant_id, resource_key, bucket, total, available, reserved, consumed,
                                              version, updated_at)
                SELECT $1, $2, b, s, s, 0, 0, 1, $5 FROM UNNEST($3::bigint[], $4::bigint[]) AS t (b, s)
                RETURNING bucket, total)
             INSERT INTO ledger (tenant_id, resource_key, bucket, op, qty, request_id, order_id, reservation_id,
                                 available_after, reserved_after, consumed_after, version_after, plugin_version, at)
             SELECT $1, $2, bucket, $7, total, $8, NULL, NULL, total, 0, 0, 1, $6, $5 FROM created
             ORDER BY bucket",
        )
        .bind(e.tenant)
        .bind(e.resource)
        .bind(&buckets)
        .bind(shares)
        .bind(e.at)
        .bind(e.plugin_version)
        .bind(e.op.as_str())
        .bind(e.request_id)
        .execute(&mut *self.conn)
        .await?;
        Ok(())
    }

    async fn buckets(&mut self, tenant: &str, key: &str) -> Result<Vec<BucketCounts>, StorageError> {
        let rows = sqlx::query(&format!(
            "SELECT {BUCKET_COLUMNS} FROM resource_buckets WHERE tenant_id = $1 AND resource_key = $2 ORDER BY bucket"
        ))
        .bind(tenant)
        .bind(key)
        .fetch_all(&mut *self.conn)
        .await?;
        rows.iter().map(|row| Ok(rows::bucket(row)?.1)).collect()
    }

    /// Each resource row is locked, in the batches' global order, so no batch deducts from its
    /// buckets meanwhile.
    async fn uneven_resources(&mut self, limit: u32) -> Result<Vec<(String, String)>, StorageError> {
        // From the buckets' rows to each resource's, looked up by key in the candidates' order:
        // a filter on `resources.buckets` would read every resource, bucketed or not, each run.
        let rows = sqlx::query(
            "SELECT r.tenant_id, r.key
             FROM (SELECT b.tenant_id, b.resource_key FROM resource_buckets b
                   GROUP BY b.tenant_id, b.resource_key HAVING MAX(b.available) - MIN(b.available) > 1
                   ORDER BY b.tenant_id COLLATE \"C\", b.resource_key COLLATE \"C\"
                   LIMIT $1) u
             CROSS JOIN LATERAL (
                 SELECT r.tenant_id, r.key FROM resources r
                 WHERE r.tenant_id = u.tenant_id AND r.key = u.resource_key AND r.buckets > 1
                 FOR UPDATE SKIP LOCKED) r",
        )
        .bind(i64::from(limit))
        .fetch_all(&mut *self.conn)
        .await?;
        rows.iter().map(|row| Ok((row.try_get("tenant_id")?, row.try_get("key")?))).collect()
    }

    async fn take_limit(&mut self, tenant: &str, limit: &LimitSpec, qty: i64) -> Result<bool, StorageError> {
        let changed = sqlx::query(
            "INSERT INTO user_limits (tenant_id, key, used) VALUES ($1, $2, $3)
             ON CONFLICT (tenant_id, key) DO UPDATE SET used = user_limits.used + EXCLUDED.used
             WHERE user_limits.used + EXCLUDED.used <= $4",
        )
        .bind(tenant)
        .bind(limit.key.as_str())
        .bind(qty)
        .bind(limit.max)
        .execute(&mut *self.conn)
        .await?;
        Ok(changed.rows_affected() == 1)
    }

    async fn give_back_limit(&mut self, tenant: &str, key: &str, qty: i64) -> Result<(), StorageError> {
        sqlx::query("UPDATE user_limits SET used = used - $1 WHERE tenant_id = $2 AND key = $3 AND used >= $1")
            .bind(qty)
            .bind(tenant)
            .bind(key)
            .execute(&mut *self.conn)
            .await?;
        Ok(())
    }

    async fn insert_reservation(&mut self, r: &NewReservation) -> Result<(), StorageError> {
        sqlx::query(
            "INSERT INTO reservations (tenant_id, id, order_id, state, lines, expires_at, created_at, updated_at)
             VALUES ($1, $2, $3, 'held', $4, $5, $6, $6)",
        )
        .bind(&r.tenant)
        .bind(&r.id)
        .bind(&r.order_id)
        .bind(&r.lines)
        .bind(r.expires_at)
        .bind(r.created_at)
        .execute(&mut *self.conn)
        .await?;
        Ok(())
    }

    async fn reservation(&mut self, tenant: &str, id: &str) -> Result<Option<Reservation>, StorageError> {
        let row = sqlx::query(
            "SELECT id, order_id, state, lines, expires_at FROM reservations WHERE tenant_id = $1 AND id = $2",
        )
        .bind(tenant)
        .bind(id)
        .fetch_optional(&mut *self.conn)
        .await?;
        row.as_ref().map(|row| rows::reservation(row)).transpose()
    }

    async fn held_reservations(&mut self, tenant: &str, limit: u32) -> Result<Vec<Reservation>, StorageError> {
        let rows = sqlx::query(rows::HELD_RESERVATIONS_SQL)
            .bind(tenant)
            .bind(i64::from(limit))
            .fetch_all(&mut *self.conn)
            .await?;
        rows.iter().map(|row| rows::reservation(row)).collect()
    }

    /// Under READ COMMITTED this waits for a concurrent mover's commit and then re-checks
    /// `state = 'held'` against the committed row, so exactly one move wins. The state is a
    /// parameter, not a constant, so that a plan kept across executions never reads the
    /// partial index of held reservations (`reservations_due`) instead of the primary key.
    async fn leave_held(
        &mut self,
        tenant: &str,
        id: &str,
        to: ReservationState,
        now_ms: i64,
    ) -> Result<bool, StorageError> {
        let moved = sqlx::query(
            "UPDATE reservations SET state = $1, updated_at = $2 WHERE tenant_id = $3 AND id = $4 AND state = $5",
        )
        .bind(to.as_str())
        .bind(now_ms)
        .bind(tenant)
        .bind(id)
        .bind(ReservationState::Held.as_str())
        .execute(&mut *self.conn)
        .await?
        .rows_affected();
        Ok(moved == 1)
    }

    /// Locked in one global order, before the batch locks any resource row (see the batcher).
    async fn lock_reservations(&mut self, wanted: &[(&str, &str)]) -> Result<Vec<Option<Reservation>>, StorageError> {
        let (tenants, ids): (Vec<&str>, Vec<&str>) = wanted.iter().copied().unzip();
        let found = sqlx::query(
            "SELECT r.tenant_id, r.id, r.order_id, r.state, r.lines, r.expires_at
             FROM reservations r
             JOIN UNNEST($1::text[], $2::text[]) AS w (tenant_id, id) ON r.tenant_id = w.tenant_id AND r.id = w.id
             ORDER BY r.tenant_id COLLATE \"C\", r.id COLLATE \"C\"
             FOR UPDATE OF r",
        )
        .bind(&tenants)
        .bind(&ids)
        .fetch_all(&mut *self.conn)
        .await?;
        let mut by_id = std::collections::HashMap::with_capacity(found.len());
        for row in &found {
            by_id.insert((row.text("tenant_id")?, row.text("id")?), rows::reservation(row)?);
        }
        Ok(wanted.iter().map(|(t, id)| by_id.get(&(t.to_string(), id.to_string())).cloned()).collect())
    }

    /// SKIP LOCKED: the sweepers of several processes each take different due rows, and a row a
    /// confirm or release is moving right now is left to it.
    async fn due_reservations(&mut self, now_ms: i64, limit: u32) -> Result<Vec<(String, Reservation)>, StorageError> {
        let rows = sqlx::query(
            "SELECT tenant_id, id, order_id, state, lines, expires_at FROM reservations
             WHERE state = 'held' AND expires_at <= $1 ORDER BY expires_at LIMIT $2
             FOR UPDATE SKIP LOCKED",
        )
        .bind(now_ms)
        .bind(i64::from(limit))
        .fetch_all(&mut *self.conn)
        .await?;
        rows.iter().map(|row| Ok((row.text("tenant_id")?, rows::reservation(row)?))).collect()
    }

    /// Claimed first: a second consumer settling the same entry waits here for the first one's
    /// transaction, then finds the row and does nothing.
    async fn claim_settlement(
        &mut self,
        tenant: &str,
        key: &str,
        request_id: &str,
        now_ms: i64,
    ) -> Result<bool, StorageError> {
        let claimed = sqlx::query(
            "INSERT INTO redis_settled (tenant_id, resource_key, request_id, at) VALUES ($1, $2, $3, $4)
             ON CONFLICT DO NOTHING",
        )
        .bind(tenant)
        .bind(key)
        .bind(request_id)
        .bind(now_ms)
        .execute(&mut *self.conn)
        .await?
        .rows_affected();
        Ok(claimed == 1)
    }

    /// One statement for the run; the ids it did not insert were claimed before (or by a
    /// transaction it waited for).
    async fn claim_settlements(
        &mut self,
        tenant: &str,
        key: &str,
        request_ids: &[&str],
        now_ms: i64,
    ) -> Result<Vec<bool>, StorageError> {
        if request_ids.is_empty() {
            return Ok(Vec::new());
        }
        let inserted: Vec<String> = sqlx::query_scalar(
            "INSERT INTO redis_settled (tenant_id, resource_key, request_id, at)
             SELECT $1, $2, id, $4 FROM UNNEST($3::text[]) WITH ORDINALITY AS u (id, n) ORDER BY n
             ON CONFLICT DO NOTHING RETURNING request_id",
        )
        .bind(tenant)
        .bind(key)
        .bind(request_ids)
        .bind(now_ms)
        .fetch_all(&mut *self.conn)
        .await?;
        let inserted: HashSet<String> = inserted.into_iter().collect();
        Ok(request_ids.iter().map(|id| inserted.contains(*id)).collect())
    }

    async fn record_settlement_failure(
        &mut self,
        r: &SettleRecord,
        qty: i64,
        reason: &str,
        available: i64,
        now_ms: i64,
    ) -> Result<(), StorageError> {
        sqlx::query(
            "INSERT INTO settlement_failures (tenant_id, resource_key, request_id, order_id, idempotency_key,
                                              qty, reason, available, at, reservation_id)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10) ON CONFLICT DO NOTHING",
        )
        .bind(&r.t)
        .bind(&r.k)
        .bind(&r.rid)
        .bind(&r.oid)
        .bind(&r.idem)
        .bind(qty)
        .bind(reason)
        .bind(available)
        .bind(now_ms)
        .bind(&r.rsv)
        .execute(&mut *self.conn)
        .await?;
        Ok(())
    }

    async fn refused_reservation(&mut self, tenant: &str, id: &str) -> Result<Option<i64>, StorageError> {
        Ok(sqlx::query_scalar::<_, i64>(REFUSED_RESERVATION_SQL)
            .bind(tenant)
            .bind(id)
            .fetch_optional(&mut *self.conn)
            .await?)
    }

    async fn count_limit(&mut self, tenant: &str, key: &str, qty: i64) -> Result<(), StorageError> {
        sqlx::query(
            "INSERT INTO user_limits (tenant_id, key, used) VALUES ($1, $2, $3)
             ON CONFLICT (tenant_id, key) DO UPDATE SET used = user_limits.used + EXCLUDED.used",
        )
        .bind(tenant)
        .bind(key)
        .bind(qty)
        .execute(&mut *self.conn)
        .await?;
        Ok(())
    }

    async fn store_outcome_if_absent(
        &mut self,
        tenant: &str,
        key: &str,
        request_hash: &str,
        response: &StoredResponse,
        event: Option<&str>,
        at: i64,
    ) -> Result<bool, StorageError> {
        let (body, event) = body_columns(response, event);
        let stored = sqlx::query(
            "INSERT INTO idempotency (tenant_id, key, request_hash, response_code, response_type, response_body,
                                      response_event, created_at)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT DO NOTHING",
        )
        .bind(tenant)
        .bind(key)
        .bind(stored_hash(request_hash))
        .bind(i32::from(response.status))
        .bind(response.content_type.as_str())
        .bind(body)
        .bind(event)
        .bind(at)
        .execute(&mut *self.conn)
        .await?;
        Ok(stored.rows_affected() == 1)
    }

    /// One statement; the keys it did not insert had an outcome (or got one from a transaction
    /// it waited for).
    async fn store_outcomes_if_absent(&mut self, outcomes: &[Outcome]) -> Result<Vec<bool>, StorageError> {
        fn col<U>(items: &[Outcome], f: impl Fn(&Outcome) -> U) -> Vec<U> {
            items.iter().map(f).collect()
        }
        if outcomes.is_empty() {
            return Ok(Vec::new());
        }
        let o = outcomes;
        let rows = sqlx::query(
            "INSERT INTO idempotency (tenant_id, key, request_hash, response_code, response_type, response_body,
                                      response_event, created_at)
             SELECT t, k, h, c, ty, b, e, at
             FROM UNNEST($1::text[], $2::text[], $3::text[], $4::int[], $5::text[], $6::text[], $7::text[],
                         $8::bigint[]) WITH ORDINALITY AS u (t, k, h, c, ty, b, e, at, n)
             ORDER BY n
             ON CONFLICT (tenant_id, key) DO NOTHING RETURNING tenant_id, key",
        )
        .bind(col(o, |x| x.tenant.clone()))
        .bind(col(o, |x| x.key.clone()))
        .bind(col(o, |x| stored_hash(&x.request_hash).to_owned()))
        .bind(col(o, |x| i32::from(x.response.status)))
        .bind(col(o, |x| x.response.content_type.as_str()))
        .bind(col(o, |x| body_columns(&x.response, x.event.as_deref()).0.map(std::borrow::Cow::into_owned)))
        .bind(col(o, |x| x.event.clone()))
        .bind(col(o, |x| x.at))
        .fetch_all(&mut *self.conn)
        .await?;
        let inserted: HashSet<(String, String)> = rows
            .iter()
            .map(|row| Ok((row.text("tenant_id")?, row.text("key")?)))
            .collect::<Result<_, StorageError>>()?;
        Ok(o.iter().map(|x| inserted.contains(&(x.tenant.clone(), x.key.clone()))).collect())
    }

    /// Reads the stored outcomes of the batch's keys in one statement: a key found was used
    /// before; any other is taken as ours, and its record is inserted with the batch's writes
    /// ([`Port::write_batch`]), in the same statement as everything it decided. A key another
    /// transaction uses first meanwhile makes that insert wait for it and then find the key
    /// taken: the batch is then run again, and finds the key answered.
    ///
    /// Why not claim with an empty row first, as [`Port::claim_key`] does: the row's response
    /// is then written by an UPDATE, which stores every record twice (the old version waits for
    /// vacuum) with a second entry in each index.
    async fn claim_keys(
        &mut self,
        keys: &[(&TenantId, &IdempotencyRequest)],
        _now_ms: i64,
    ) -> Result<Vec<Claim>, StorageError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let tenants: Vec<String> = keys.iter().map(|(t, _)| t.as_str().to_owned()).collect();
        let names: Vec<String> = keys.iter().map(|(_, i)| i.key.as_str().to_owned()).collect();
        let mut stored = self.stored_outcomes(&tenants, &names).await?;
        Ok(keys
            .iter()
            .zip(tenants.into_iter().zip(names))
            .map(|((_, idem), id)| match stored.remove(&id) {
                Some((hash, response)) => Claim::Answered(idem.judge(&hash, response)),
                None => Claim::Ours,
            })
            .collect())
    }

    async fn write_batch(&mut self, w: &BatchWrites) -> Result<(), StorageError> {
        fn col<T, U>(items: &[T], f: impl Fn(&T) -> U) -> Vec<U> {
            items.iter().map(f).collect()
        }
        type Statement<'q> = sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>;
        /// Four arrays: each item's counters after, `available, reserved, consumed, version`.
        fn after<'q, T>(query: Statement<'q>, items: &[T], f: impl Fn(&T) -> Counts) -> Statement<'q> {
            query
                .bind(col(items, |x| f(x).available))
                .bind(col(items, |x| f(x).reserved))
                .bind(col(items, |x| f(x).consumed))
                .bind(col(items, |x| f(x).version))
        }
        let (c, l, r, o, ev, m) = (&w.rows, &w.ledger, &w.reservations, &w.outcomes, &w.events, &w.moves);
        let b = &w.buckets;
        let statement = sqlx::query(
            "WITH written AS (
                UPDATE resources r SET available = u.available, reserved = u.reserved, consumed = u.consumed,
                       version = u.version, updated_at = COALESCE(u.at, r.updated_at), stock = COALESCE(u.stock, r.stock)
                FROM UNNEST($1::text[], $2::text[], $3::bigint[], $4::bigint[], $5::bigint[], $6::bigint[], $7::bigint[],
                            $8::bigint[], $34::text[])
                     AS u (tenant_id, key, available, reserved, consumed, version, was, at, stock)
                WHERE r.tenant_id = u.tenant_id AND r.key = u.key AND r.version = u.was
                RETURNING 1),
             bucketed AS (
                UPDATE resource_buckets b SET available = u.available, reserved = u.reserved, consumed = u.consumed,
                       version = u.version, updated_at = u.at
                FROM UNNEST($43::text[], $44::text[], $45::bigint[], $46::bigint[], $47::bigint[], $48::bigint[],
                            $49::bigint[], $50::bigint[], $51::bigint[])
                     AS u (tenant_id, key, bucket, available, reserved, consumed, version, was, at)
                WHERE b.tenant_id = u.tenant_id AND b.resource_key = u.key AND b.bucket = u.bucket AND b.version = u.was
                RETURNING 1),
             ledgered AS (
                INSERT INTO ledger (tenant_id, resource_key, bucket, op, qty, request_id, order_id, reservation_id,
                                    available_after, reserved_after, consumed_after, version_after, plugin_version, at,
                                    line_key, limit_key)
                SELECT t, k, b, o, q, rq, oi, ri, a, rs, cs, v, pv, at, lk, lm
                FROM UNNEST($9::text[], $10::text[], $11::text[], $12::bigint[], $13::text[], $14::text[], $15::text[],
                            $16::bigint[], $17::bigint[], $18::bigint[], $19::bigint[], $20::bigint[], $21::bigint[],
                            $33::text[], $35::text[], $52::bigint[])
                     WITH ORDINALITY AS u (t, k, o, q, rq, oi, ri, a, rs, cs, v, pv, at, lk, lm, b, n)
                ORDER BY n
                RETURNING 1),
             held AS (
                INSERT INTO reservations (tenant_id, id, order_id, state, lines, expires_at, created_at, updated_at)
                SELECT t, id, o, 'held', ls, e, cr, cr
                FROM UNNEST($22::text[], $23::text[], $24::text[], $25::text[], $26::bigint[], $27::bigint[])
                     AS u (t, id, o, ls, e, cr)
                RETURNING 1),
             moved AS (
                UPDATE reservations r SET state = u.state, updated_at = u.at
                FROM UNNEST($36::text[], $37::text[], $38::text[], $39::bigint[]) AS u (tenant_id, id, state, at)
                -- The state is a parameter ('held'), not a constant: the batch's plan is kept
                -- (see the batcher's BEGIN), and a constant would let it read every held
                -- reservation through their partial index instead of each by its key.
                WHERE r.tenant_id = u.tenant_id AND r.id = u.id AND r.state = $53
                RETURNING 1),
             answered AS (
                INSERT INTO idempotency (tenant_id, key, request_hash, response_code, response_type, response_body,
                                         response_event, created_at)
                SELECT * FROM UNNEST($28::text[], $29::text[], $40::text[], $30::int[], $31::text[], $32::text[],
                                     $42::text[], $41::bigint[])
                ON CONFLICT (tenant_id, key) DO NOTHING
                RETURNING 1)
             SELECT (SELECT COUNT(*) FROM written) AS written, (SELECT COUNT(*) FROM bucketed) AS bucketed,
                    (SELECT COUNT(*) FROM ledgered) AS ledgered,
                    (SELECT COUNT(*) FROM held) AS held, (SELECT COUNT(*) FROM moved) AS moved,
                    (SELECT COUNT(*) FROM answered) AS answered",
        )
        .bind(col(c, |x| x.tenant.clone()))
        .bind(col(c, |x| x.key.clone()));
        let statement = after(statement, c, |x| x.after)
            .bind(col(c, |x| x.read_version))
            .bind(col(c, |x| x.at))
            .bind(col(l, |x| x.tenant.clone()))
            .bind(col(l, |x| x.resource.clone()))
            .bind(col(l, |x| x.op.as_str()))
            .bind(col(l, |x| x.qty))
            .bind(col(l, |x| x.request_id.clone()))
            .bind(col(l, |x| x.order_id.clone()))
            .bind(col(l, |x| x.reservation_id.clone()));
        let statement = after(statement, l, |x| x.after)
            .bind(col(l, |x| x.plugin_version))
            .bind(col(l, |x| x.at))
            .bind(col(r, |x| x.tenant.clone()))
            .bind(col(r, |x| x.id.clone()))
            .bind(col(r, |x| x.order_id.clone()))
            .bind(col(r, |x| x.lines.clone()))
            .bind(col(r, |x| x.expires_at))
            .bind(col(r, |x| x.created_at))
            .bind(col(o, |x| x.tenant.clone()))
            .bind(col(o, |x| x.key.clone()))
            .bind(col(o, |x| i32::from(x.response.status)))
            .bind(col(o, |x| x.response.content_type.as_str()))
            .bind(col(o, |x| body_columns(&x.response, x.event.as_deref()).0.map(std::borrow::Cow::into_owned)))
            .bind(col(l, |x| x.line_key.clone()))
            .bind(col(c, |x| x.stock.map(|s| s.as_str())))
            .bind(col(l, |x| x.limit_key.clone()))
            .bind(col(m, |x| x.tenant.clone()))
            .bind(col(m, |x| x.id.clone()))
            .bind(col(m, |x| x.to.as_str()))
            .bind(col(m, |x| x.at))
            .bind(col(o, |x| stored_hash(&x.request_hash).to_owned()))
            .bind(col(o, |x| x.at))
            .bind(col(o, |x| x.event.clone()))
            .bind(col(b, |x| x.tenant.clone()))
            .bind(col(b, |x| x.key.clone()))
            .bind(col(b, |x| x.bucket));
        let counts = after(statement, b, |x| x.after)
            .bind(col(b, |x| x.read_version))
            .bind(col(b, |x| x.at))
            .bind(col(l, |x| x.bucket))
            .bind(ReservationState::Held.as_str())
            .fetch_one(&mut *self.conn)
            .await?;
        let count = |name: &str| -> Result<u64, StorageError> { Ok(counts.try_get::<i64, _>(name)?.max(0) as u64) };
        if count("answered")? != o.len() as u64 {
            // Another transaction used one of the keys first, after `claim_keys` read them: its
            // commit made our insert skip the key. Nothing of this batch may stand; run again,
            // it finds the key answered.
            return Err(StorageError::Unavailable(
                "an idempotency key of the batch was used by another transaction meanwhile".into(),
            ));
        }
        if count("bucketed")? != b.len() as u64 {
            return Err(crate::apply::port::bucket_moved());
        }
        for (name, want) in [("written", c.len()), ("ledgered", l.len()), ("held", r.len()), ("moved", m.len())] {
            if count(name)? != want as u64 {
                // The rows are locked and the keys claimed by this transaction: nothing else can
                // have moved them. A mismatch is a bug; the batch is decided again order by order.
                return Err(StorageError::Internal(format!(
                    "batch admission wrote {name} {} times, not {want}",
                    count(name)?
                )));
            }
        }
        crate::storage::held_events::hold(ev)
    }

    /// Held by the batch attempt until just before its COMMIT, when the batcher inserts them
    /// numbered ([`super::events::seal`]), so a tenant's events commit in sequence order.
    async fn emit(&mut self, e: &NewEvent) -> Result<(), StorageError> {
        crate::storage::held_events::hold(std::slice::from_ref(e))
    }

    async fn stock(&mut self, tenant: &str, key: &str) -> Result<Option<Stock>, StorageError> {
        let row = sqlx::query(
            "SELECT CASE WHEN buckets = 1 THEN available ELSE
                      (SELECT COALESCE(SUM(b.available), 0)::bigint FROM resource_buckets b
                       WHERE b.tenant_id = r.tenant_id AND b.resource_key = r.key) END AS available,
                    low_stock, stock
             FROM resources r WHERE tenant_id = $1 AND key = $2",
        )
        .bind(tenant)
        .bind(key)
        .fetch_optional(&mut *self.conn)
        .await?;
        let Some(row) = row else { return Ok(None) };
        let band: &str = row.try_get("stock")?;
        let band = StockBand::from_db(band).ok_or_else(|| corrupt("resources.stock"))?;
        Ok(Some(Stock { available: row.try_get("available")?, low_stock: row.try_get("low_stock")?, band }))
    }

    async fn set_low_stock(
        &mut self,
        tenant: &str,
        key: &str,
        low_stock: Option<i64>,
        now_ms: i64,
    ) -> Result<bool, StorageError> {
        let done =
            sqlx::query("UPDATE resources SET low_stock = $1, updated_at = $2 WHERE tenant_id = $3 AND key = $4")
                .bind(low_stock)
                .bind(now_ms)
                .bind(tenant)
                .bind(key)
                .execute(&mut *self.conn)
                .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn set_stock(&mut self, tenant: &str, key: &str, band: StockBand) -> Result<(), StorageError> {
        sqlx::query("UPDATE resources SET stock = $1 WHERE tenant_id = $2 AND key = $3")
            .bind(band.as_str())
            .bind(tenant)
            .bind(key)
            .execute(&mut *self.conn)
            .await?;
        Ok(())
    }

    async fn order_entries(
        &mut self,
        tenant: &str,
        order_id: &str,
        limit: u32,
    ) -> Result<Vec<OrderEntries>, StorageError> {
        let rows = sqlx::query(ORDER_ENTRIES)
            .bind(tenant)
            .bind(order_id)
            .bind(i64::from(limit))
            .fetch_all(&mut *self.conn)
            .await?;
        rows.iter().map(|row| rows::order_entries(row)).collect()
    }

    async fn take_reversal(
        &mut self,
        tenant: &str,
        order_id: &str,
        resource: &str,
        bucket: i64,
        taken: i64,
        qty: i64,
        now_ms: i64,
    ) -> Result<bool, StorageError> {
        let counted = sqlx::query(rows::TAKE_REVERSAL_SQL)
            .bind(tenant)
            .bind(order_id)
            .bind(resource)
            .bind(bucket)
            .bind(taken)
            .bind(qty)
            .bind(now_ms)
            .execute(&mut *self.conn)
            .await?
            .rows_affected();
        Ok(counted == 1)
    }

    /// One statement for all of them, in key order, so two processes' passes take the
    /// checkpoint rows' locks in the same order.
    async fn advance_checkpoints(&mut self, checkpoints: &[Checkpoint]) -> Result<(), StorageError> {
        if checkpoints.is_empty() {
            return Ok(());
        }
        let mut sorted: Vec<&Checkpoint> = checkpoints.iter().collect();
        sorted.sort_by(|a, b| (&a.tenant, &a.key, a.bucket).cmp(&(&b.tenant, &b.key, b.bucket)));
        let col = |f: fn(&Checkpoint) -> i64| sorted.iter().map(|c| f(c)).collect::<Vec<i64>>();
        sqlx::query(
            "INSERT INTO ledger_checkpoints AS c
                 (tenant_id, resource_key, bucket, version, available, reserved, consumed, total, seq)
             SELECT * FROM UNNEST($1::text[], $2::text[], $3::bigint[], $4::bigint[], $5::bigint[], $6::bigint[],
                                  $7::bigint[], $8::bigint[], $9::bigint[])
             ON CONFLICT (tenant_id, resource_key, bucket) DO UPDATE SET version = excluded.version,
                 available = excluded.available, reserved = excluded.reserved, consumed = excluded.consumed,
                 total = excluded.total, seq = excluded.seq
             WHERE excluded.version >= c.version",
        )
        .bind(sorted.iter().map(|c| c.tenant.clone()).collect::<Vec<_>>())
        .bind(sorted.iter().map(|c| c.key.clone()).collect::<Vec<_>>())
        .bind(col(|c| c.bucket))
        .bind(col(|c| c.counters.version))
        .bind(col(|c| c.counters.available))
        .bind(col(|c| c.counters.reserved))
        .bind(col(|c| c.counters.consumed))
        .bind(col(|c| c.counters.total))
        .bind(col(|c| c.seq))
        .execute(&mut *self.conn)
        .await?;
        Ok(())
    }

    async fn forget_checkpoints(&mut self, which: &[(String, String, i64)]) -> Result<(), StorageError> {
        if which.is_empty() {
            return Ok(());
        }
        sqlx::query(
            "DELETE FROM ledger_checkpoints c USING UNNEST($1::text[], $2::text[], $3::bigint[]) AS f (t, k, b)
             WHERE c.tenant_id = f.t AND c.resource_key = f.k AND c.bucket = f.b",
        )
        .bind(which.iter().map(|w| w.0.clone()).collect::<Vec<_>>())
        .bind(which.iter().map(|w| w.1.clone()).collect::<Vec<_>>())
        .bind(which.iter().map(|w| w.2).collect::<Vec<_>>())
        .execute(&mut *self.conn)
        .await?;
        Ok(())
    }
}

impl Reads for PgPort<'_> {
    async fn resources_page(
        &mut self,
        tenant: &str,
        prefix: &str,
        after: &str,
        limit: u32,
    ) -> Result<Vec<ResourceState>, StorageError> {
        // Keys are [A-Za-z0-9._:@-], so a prefix range needs no LIKE escaping: every key with
        // the prefix sorts in [prefix, prefix || chr(0x7f)) in byte order. COLLATE "C" makes the
        // comparisons and the page order bytewise whatever the database's default collation
        // (a linguistic one may ignore punctuation, and pages would skip or repeat keys).
        let rows = sqlx::query(&format!(
            "SELECT {RESOURCE_COLUMNS} FROM resources
             WHERE tenant_id = $1 AND key COLLATE \"C\" >= $2 AND key COLLATE \"C\" < $3 AND key COLLATE \"C\" > $4
             ORDER BY key COLLATE \"C\" LIMIT $5"
        ))
        .bind(tenant)
        .bind(prefix)
        .bind(format!("{prefix}\u{7f}"))
        .bind(after)
        .bind(i64::from(limit))
        .fetch_all(&mut *self.conn)
        .await?;
        rows.iter().map(|row| rows::resource(row)).collect()
    }

    async fn buckets_of(
        &mut self,
        tenant: &str,
        keys: &[String],
    ) -> Result<HashMap<(String, String), Vec<BucketCounts>>, StorageError> {
        let rows = sqlx::query(&format!(
            "SELECT {BUCKET_COLUMNS} FROM resource_buckets WHERE tenant_id = $1 AND resource_key = ANY($2)
             ORDER BY resource_key, bucket"
        ))
        .bind(tenant)
        .bind(keys)
        .fetch_all(&mut *self.conn)
        .await?;
        Ok(rows::group_buckets(rows.iter().map(|row| rows::bucket(row)).collect::<Result<Vec<_>, _>>()?))
    }

    /// Paging by `seq` is gap-free per resource: its ledger rows are written while the resource
    /// row is locked, so they commit in `seq` order.
    async fn ledger_entries(
        &mut self,
        tenant: &str,
        key: &str,
        from: PageFrom,
        limit: u32,
    ) -> Result<Vec<LedgerEntry>, StorageError> {
        let (after, order) = from.bounds();
        let rows = sqlx::query(&format!(
            "SELECT {LEDGER_COLUMNS} FROM ledger WHERE tenant_id = $1 AND resource_key = $2 AND seq > $3
             ORDER BY seq {order} LIMIT $4"
        ))
        .bind(tenant)
        .bind(key)
        .bind(after)
        .bind(i64::from(limit))
        .fetch_all(&mut *self.conn)
        .await?;
        rows.iter().map(|row| rows::ledger_entry(row)).collect()
    }

    async fn limit_used(&mut self, tenant: &str, key: &str) -> Result<i64, StorageError> {
        let used: Option<i64> = sqlx::query_scalar("SELECT used FROM user_limits WHERE tenant_id = $1 AND key = $2")
            .bind(tenant)
            .bind(key)
            .fetch_optional(&mut *self.conn)
            .await?;
        Ok(used.unwrap_or(0))
    }

    async fn held_among(&mut self, tenant: &str, ids: &[String]) -> Result<HashSet<String>, StorageError> {
        let held: Vec<String> = sqlx::query_scalar(
            "SELECT id FROM reservations WHERE tenant_id = $1 AND id = ANY($2::text[]) AND state = 'held'",
        )
        .bind(tenant)
        .bind(ids)
        .fetch_all(&mut *self.conn)
        .await?;
        Ok(held.into_iter().collect())
    }

    async fn ledger_rows(&mut self, tenant: Option<&str>, pass: Pass) -> Result<LedgerRows, StorageError> {
        // One tenant's reconciliation reads its own rows only (through the tenant-first keys);
        // `$1 IS NULL OR tenant_id = $1` would scan every tenant's ledger under a generic plan.
        let [resources, checkpoints, sums, newest, buckets] = ledger_rows_sql(tenant.is_some(), pass);
        fn bind<'q>(sql: &'q str, tenant: Option<&'q str>) -> sqlx::query::Query<'q, sqlx::Postgres, PgArguments> {
            match tenant {
                Some(t) => sqlx::query(sql).bind(t),
                None => sqlx::query(sql),
            }
        }
        let found = bind(&resources, tenant).fetch_all(&mut *self.conn).await?;
        let resources = found
            .iter()
            .map(|row| Ok((row.text("tenant_id")?, rows::resource(row)?)))
            .collect::<Result<_, StorageError>>()?;
        let found = bind(&checkpoints, tenant).fetch_all(&mut *self.conn).await?;
        let checkpoints = found.iter().map(|row| rows::checkpoint(row)).collect::<Result<_, _>>()?;
        let found = bind(&sums, tenant).fetch_all(&mut *self.conn).await?;
        let sums = found.iter().map(|row| rows::ledger_sum(row)).collect::<Result<_, _>>()?;
        let found = bind(&newest, tenant).fetch_all(&mut *self.conn).await?;
        let newest = found.iter().map(|row| rows::newest_entry(row)).collect::<Result<_, _>>()?;
        let found = bind(&buckets, tenant).fetch_all(&mut *self.conn).await?;
        let buckets = rows::group_buckets(found.iter().map(|row| rows::bucket(row)).collect::<Result<Vec<_>, _>>()?);
        Ok(LedgerRows { resources, checkpoints, sums, newest, buckets })
    }
}

/// The five queries of reconciliation: resources, checkpoints, per-op ledger sums, newest
/// entries, buckets; for one tenant (`$1`) or for all. The ledger is read per resource (bucket)
/// as one range of `ledger_by_resource` (a LATERAL subquery, so the planner cannot turn it into a
/// scan of the whole ledger): after its checkpoint's `seq` in an incremental pass, from the
/// start in a full one.
fn ledger_rows_sql(one_tenant: bool, pass: Pass) -> [String; 5] {
    let only = if one_tenant { "WHERE tenant_id = $1" } else { "" };
    let targets = rows::reconciliation_targets(one_tenant.then_some("$1"), pass);
    let range = "l.tenant_id = w.tenant_id AND l.resource_key = w.resource_key AND l.seq > w.since
                 AND l.bucket = w.bucket";
    [
        format!(
            "SELECT tenant_id, {RESOURCE_COLUMNS} FROM resources {only}
             ORDER BY tenant_id COLLATE \"C\", key COLLATE \"C\""
        ),
        format!("SELECT {CHECKPOINT_COLUMNS} FROM ledger_checkpoints {only}"),
        // SUM over BIGINT is NUMERIC in PostgreSQL; the cast fails (rather than wraps) on overflow.
        format!(
            "{targets}
             SELECT w.tenant_id, w.resource_key, w.bucket, s.op, s.qty, s.n FROM w CROSS JOIN LATERAL (
                 SELECT l.op, SUM(l.qty)::BIGINT AS qty, COUNT(*) AS n FROM ledger l WHERE {range} GROUP BY l.op
             ) s"
        ),
        format!(
            "{targets}
             SELECT w.tenant_id, w.resource_key, w.bucket, n.seq, n.available_after, n.reserved_after,
                    n.consumed_after
             FROM w CROSS JOIN LATERAL (
                 SELECT l.seq, l.available_after, l.reserved_after, l.consumed_after FROM ledger l WHERE {range}
                 ORDER BY l.seq DESC LIMIT 1
             ) n"
        ),
        format!("SELECT {BUCKET_COLUMNS} FROM resource_buckets {only} ORDER BY tenant_id, resource_key, bucket"),
    ]
}

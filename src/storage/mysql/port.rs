//! [`Port`] on MySQL / MariaDB: the statements of [`crate::apply`] for the batcher's connection,
//! inside the savepoint of one job of a group commit.
//!
//! Several processes may write at once, and nothing here relies on being the only writer: a
//! guarded change is an UPDATE whose WHERE holds the guard, followed (only when it matched) by
//! its ledger row, under the row lock the UPDATE took; an idempotency key is claimed by inserting
//! its row first (a concurrent duplicate in another process waits on that row, then replays); a
//! reservation leaves `held` only by a guarded UPDATE; sweeps lock their rows with `SKIP LOCKED`.
//!
//! MySQL has no `RETURNING` on UPDATE and no arrays: a change reads its row back after the
//! UPDATE (the same transaction, READ COMMITTED, so it sees its own write), and a batch's rows
//! are written with multi-row statements built for its size. Sessions run with the client flag
//! `FOUND_ROWS` (sqlx sets it): an UPDATE counts the rows its WHERE matched.

use std::collections::{HashMap, HashSet};

use sqlx::mysql::{MySqlArguments, MySqlRow};
use sqlx::{MySql, MySqlConnection, Row as SqlRow};

use super::sql::{bind_all, translate, Arg};
use crate::apply::port::{
    BatchWrites, Change, Claim, Counts, Entry, Gate, Move, NewReservation, Port, Row, Savepoint, View,
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

fn corrupt(what: &str) -> StorageError {
    StorageError::Internal(format!("unexpected stored value in {what}"))
}

/// `n` groups of `group` placeholders: `(?, ?), (?, ?)`.
/// Most ids one `held_among` statement names.
const HELD_AMONG_CHUNK: usize = 1_000;

pub(super) fn tuples(n: usize, group: usize) -> String {
    let one = format!("({})", vec!["?"; group].join(", "));
    vec![one; n].join(", ")
}

/// The response stored in an idempotency row (`response_code, response_type, response_body`);
/// `None` while its key is claimed but not yet answered.
pub(super) fn stored_response(row: &MySqlRow) -> Result<Option<StoredResponse>, StorageError> {
    let code: Option<i32> = row.try_get("response_code")?;
    let kind = row.opt_text("response_type")?;
    let event = row.opt_text("response_event")?;
    StoredResponse::from_columns(code.map(i64::from), kind.as_deref(), row.opt_text("response_body")?, event.as_deref())
}

/// The guarded UPDATE of a change, in the shared `$n` form: `$1` quantity, `$2` time, `$3`
/// tenant, `$4` resource, `$5` bucket, `$6` the kind an order line asks for (NULL: any) or the
/// largest total (an adjustment of a resource row).
fn change_sql(row: Row, how: Move, gate: Gate) -> String {
    let (set, guard) = match how {
        Move::Deduct => ("available = available - $1, consumed = consumed + $1", "available >= $1"),
        Move::Reserve => ("available = available - $1, reserved = reserved + $1", "available >= $1"),
        Move::Confirm => ("reserved = reserved - $1, consumed = consumed + $1", "reserved >= $1"),
        Move::Unreserve => ("reserved = reserved - $1, available = available + $1", "reserved >= $1"),
        Move::Adjust => ("available = available + $1, total = total + $1", "available + $1 >= 0"),
        Move::Reverse => ("consumed = consumed - $1, available = available + $1", "consumed >= $1"),
    };
    let extra = match (row, how, gate) {
        (Row::Resource, Move::Deduct | Move::Reserve, Gate::Order { .. }) => {
            " AND status = 'active' AND mode = 'db' AND ($6 IS NULL OR kind = $6)"
        }
        (Row::Resource, Move::Adjust, _) => " AND total + $1 <= $6",
        (Row::Resource, Move::Reverse, Gate::Order { .. }) => " AND mode = 'db'",
        _ => "",
    };
    match row {
        Row::Resource => format!(
            "UPDATE resources SET {set}, version = version + 1, updated_at = $2
             WHERE tenant_id = $3 AND key = $4 AND {guard}{extra}"
        ),
        Row::Bucket(_) => format!(
            "UPDATE resource_buckets SET {set}, version = version + 1, updated_at = $2
             WHERE tenant_id = $3 AND resource_key = $4 AND bucket = $5 AND {guard}{extra}"
        ),
    }
}

/// Locks resource rows `(tenant, key)` in the batches' global order (tenant, then key, bytewise)
/// and returns them as they are now. InnoDB locks rows as its range scan of the primary key
/// meets them, in key order; under READ COMMITTED a key with no row locks nothing.
pub(super) async fn lock_resources(
    conn: &mut MySqlConnection,
    rows: &[(String, String)],
    skip_locked: bool,
) -> Result<Vec<MySqlRow>, sqlx::Error> {
    if rows.is_empty() {
        return Ok(Vec::new());
    }
    // The batcher reads these columns by position (`rows::locked_rows`).
    let sql = format!(
        "SELECT tenant_id, `key`, kind, status, mode, buckets, available, reserved, consumed, version, low_stock, stock
         FROM resources WHERE (tenant_id, `key`) IN ({}) ORDER BY tenant_id, `key` FOR UPDATE{}",
        tuples(rows.len(), 2),
        if skip_locked { " SKIP LOCKED" } else { "" }
    );
    let mut query = sqlx::query(&sql);
    for (tenant, key) in rows {
        query = query.bind(tenant).bind(key);
    }
    query.fetch_all(conn).await
}

/// A connection of the batcher (or of a sweep) as a [`Port`].
pub struct MyPort<'c> {
    conn: &'c mut MySqlConnection,
}

impl<'c> MyPort<'c> {
    pub fn new(conn: &'c mut MySqlConnection) -> Self {
        Self { conn }
    }

    async fn exec(&mut self, sql: &'static str) -> Result<(), StorageError> {
        sqlx::query(sql).execute(&mut *self.conn).await?;
        Ok(())
    }

    /// Runs a shared `$n` statement; returns the rows it matched or changed.
    async fn run(&mut self, sql: &str, args: &[Arg<'_>]) -> Result<u64, StorageError> {
        let translated = translate(sql);
        Ok(bind_all(&translated, args).execute(&mut *self.conn).await?.rows_affected())
    }

    /// Fetches the rows of a shared `$n` statement.
    async fn rows(&mut self, sql: &str, args: &[Arg<'_>]) -> Result<Vec<MySqlRow>, StorageError> {
        let translated = translate(sql);
        Ok(bind_all(&translated, args).fetch_all(&mut *self.conn).await?)
    }

    /// Like [`Self::rows`], on a statement prepared for this one execution. MariaDB 10.11 answers
    /// the reconciliation queries (a CTE whose correlated subquery reads the checkpoints) wrongly
    /// when it executes a cached prepared statement again: it kept the first execution's
    /// checkpoint versions, and a clean ledger was reported as drift. Prepared afresh, they are right.
    async fn rows_once(&mut self, sql: &str, args: &[Arg<'_>]) -> Result<Vec<MySqlRow>, StorageError> {
        let translated = translate(sql);
        Ok(bind_all(&translated, args).persistent(false).fetch_all(&mut *self.conn).await?)
    }

    async fn row(&mut self, sql: &str, args: &[Arg<'_>]) -> Result<Option<MySqlRow>, StorageError> {
        let translated = translate(sql);
        Ok(bind_all(&translated, args).fetch_optional(&mut *self.conn).await?)
    }

    /// The counters of a resource row or bucket, as this transaction sees them.
    async fn counts_of(&mut self, tenant: &str, resource: &str, row: Row) -> Result<Option<Counts>, StorageError> {
        let found = match row {
            Row::Resource => {
                self.row(
                    "SELECT available, reserved, consumed, version FROM resources WHERE tenant_id = $1 AND key = $2",
                    &[Arg::Text(tenant), Arg::Text(resource)],
                )
                .await?
            }
            Row::Bucket(b) => {
                self.row(
                    "SELECT available, reserved, consumed, version FROM resource_buckets
                     WHERE tenant_id = $1 AND resource_key = $2 AND bucket = $3",
                    &[Arg::Text(tenant), Arg::Text(resource), Arg::Int(b)],
                )
                .await?
            }
        };
        found.as_ref().map(|row| rows::counts(row)).transpose()
    }

    /// The stored outcomes of these keys that have one, by `(tenant, key)`, with their hashes.
    async fn stored_outcomes(
        &mut self,
        keys: &[(String, String)],
    ) -> Result<HashMap<(String, String), (String, StoredResponse)>, StorageError> {
        let sql = format!(
            "SELECT i.tenant_id, i.`key`, {} WHERE (i.tenant_id, i.`key`) IN ({})",
            crate::outcome_columns!(),
            tuples(keys.len(), 2)
        );
        let mut query = sqlx::query(&sql);
        for (tenant, key) in keys {
            query = query.bind(tenant).bind(key);
        }
        let rows = query.fetch_all(&mut *self.conn).await?;
        let mut found = HashMap::with_capacity(rows.len());
        for row in rows {
            if let Some(response) = stored_response(&row)? {
                found.insert((row.text("tenant_id")?, row.text("key")?), (row.text("request_hash")?, response));
            }
        }
        Ok(found)
    }

    /// Runs `sql` (from [`many`]) with each item's values bound by `bind`; returns the rows it
    /// inserted.
    async fn insert_many<'a, T>(
        &mut self,
        sql: &'a str,
        items: &'a [T],
        bind: impl Fn(sqlx::query::Query<'a, MySql, MySqlArguments>, &'a T) -> sqlx::query::Query<'a, MySql, MySqlArguments>,
    ) -> Result<u64, StorageError> {
        if items.is_empty() {
            return Ok(0);
        }
        let mut query = sqlx::query(sql);
        for item in items {
            query = bind(query, item);
        }
        Ok(query.execute(&mut *self.conn).await?.rows_affected())
    }
}

/// A multi-row INSERT: `head` with `n` rows of `width` values.
fn many(head: &str, width: usize, n: usize) -> String {
    format!("{head} VALUES {}", tuples(n, width))
}

const LEDGER_INSERT: &str = "INSERT INTO ledger (tenant_id, resource_key, bucket, op, qty, request_id, order_id,
    reservation_id, available_after, reserved_after, consumed_after, version_after, plugin_version, at, line_key,
    limit_key, reverses)";

impl Port for MyPort<'_> {
    /// The INSERT comes first because it is what serialises duplicates across processes: if
    /// another transaction holds an uncommitted row for the key, the insert waits for it to end,
    /// then either inserts (it rolled back) or skips (it committed, response and all).
    async fn claim_key(
        &mut self,
        tenant: &TenantId,
        idem: &IdempotencyRequest,
        now_ms: i64,
    ) -> Result<Option<Idempotent>, StorageError> {
        // IGNORE skips only the duplicate key: the values are bounded and checked before here.
        let inserted = sqlx::query(
            "INSERT IGNORE INTO idempotency (tenant_id, `key`, request_hash, created_at) VALUES (?, ?, ?, ?)",
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
        let row = sqlx::query(concat!("SELECT ", crate::outcome_columns!(), " WHERE i.tenant_id = ? AND i.`key` = ?"))
            .bind(tenant.as_str())
            .bind(idem.key.as_str())
            .fetch_optional(&mut *self.conn)
            .await?;
        // The row conflicted a moment ago and is gone now: the purge job removed an expired key in
        // between. Transient: the retried batch finds the key free.
        let Some(row) = row else { return Err(StorageError::Unavailable("idempotency key vanished".into())) };
        let hash = row.text("request_hash")?;
        // Committed rows always carry their response (it is written in the transaction that
        // inserted them), so a missing one means this transaction claimed it and did not finish.
        let Some(response) = stored_response(&row)? else {
            return Err(StorageError::Internal(format!(
                "idempotency key {} has no stored response",
                idem.key.as_str()
            )));
        };
        Ok(Some(idem.judge(&hash, response)))
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
            "UPDATE idempotency SET response_code = ?, response_type = ?, response_body = ?, response_event = ?
             WHERE tenant_id = ? AND `key` = ?",
        )
        .bind(i32::from(response.status))
        .bind(response.content_type.as_str())
        .bind(body)
        .bind(event)
        .bind(tenant.as_str())
        .bind(idem.key.as_str())
        .execute(&mut *self.conn)
        .await?
        .rows_affected();
        if updated != 1 {
            return Err(StorageError::Internal(format!("idempotency key {} was not claimed", idem.key.as_str())));
        }
        Ok(())
    }

    async fn forget_key(&mut self, tenant: &TenantId, idem: &IdempotencyRequest) -> Result<(), StorageError> {
        sqlx::query("DELETE FROM idempotency WHERE tenant_id = ? AND `key` = ? AND response_code IS NULL")
            .bind(tenant.as_str())
            .bind(idem.key.as_str())
            .execute(&mut *self.conn)
            .await?;
        Ok(())
    }

    async fn savepoint(&mut self, at: Savepoint) -> Result<(), StorageError> {
        self.exec(match at {
            Savepoint::Lines => "SAVEPOINT lines_sp",
            Savepoint::Line => "SAVEPOINT line_sp",
        })
        .await
    }

    async fn rollback_to(&mut self, at: Savepoint) -> Result<(), StorageError> {
        self.exec(match at {
            Savepoint::Lines => "ROLLBACK TO SAVEPOINT lines_sp",
            Savepoint::Line => "ROLLBACK TO SAVEPOINT line_sp",
        })
        .await
    }

    async fn release(&mut self, at: Savepoint) -> Result<(), StorageError> {
        self.exec(match at {
            Savepoint::Lines => "RELEASE SAVEPOINT lines_sp",
            Savepoint::Line => "RELEASE SAVEPOINT line_sp",
        })
        .await
    }

    /// The guarded UPDATE, then (only if it matched) the row read back under the lock it took and
    /// the ledger row with those counters.
    async fn change(&mut self, change: &Change<'_>) -> Result<Option<Counts>, StorageError> {
        let e = &change.entry;
        let bucket = match change.row {
            Row::Resource => 0,
            Row::Bucket(b) => b,
        };
        let sixth = match (change.row, change.how, change.gate) {
            (Row::Resource, Move::Deduct | Move::Reserve, Gate::Order { kind }) => Arg::OptText(kind.map(Kind::as_str)),
            (Row::Resource, Move::Adjust, _) => Arg::Int(MAX_TOTAL),
            _ => Arg::OptText(None),
        };
        let args =
            [Arg::Int(e.qty), Arg::Int(e.at), Arg::Text(e.tenant), Arg::Text(e.resource), Arg::Int(bucket), sixth];
        if self.run(&change_sql(change.row, change.how, change.gate), &args).await? != 1 {
            return Ok(None);
        }
        let Some(after) = self.counts_of(e.tenant, e.resource, change.row).await? else {
            return Err(StorageError::Internal("a changed row vanished".into()));
        };
        self.append_ledger(&Entry { bucket, ..*e }, after).await?;
        Ok(Some(after))
    }

    async fn append_ledger(&mut self, e: &Entry<'_>, after: Counts) -> Result<(), StorageError> {
        sqlx::query(&format!("{LEDGER_INSERT} VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"))
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
        let row = sqlx::query(
            "SELECT status, kind, mode,
                    CASE WHEN buckets = 1 THEN available ELSE
                      (SELECT CAST(COALESCE(SUM(b.available), 0) AS SIGNED) FROM resource_buckets b
                       WHERE b.tenant_id = r.tenant_id AND b.resource_key = r.`key`) END AS available,
                    buckets
             FROM resources r WHERE tenant_id = ? AND `key` = ?",
        )
        .bind(tenant)
        .bind(key)
        .fetch_optional(&mut *self.conn)
        .await?;
        let Some(row) = row else { return Ok(None) };
        let (status, kind, mode) = (row.text("status")?, row.text("kind")?, row.text("mode")?);
        let (available, buckets) = (row.int("available")?, row.int("buckets")?);
        let (Some(status), Some(kind), Some(mode)) =
            (ResourceStatus::from_db(&status), Kind::from_db(&kind), Mode::from_db(&mode))
        else {
            return Err(corrupt("resources"));
        };
        Ok(Some(View { status, kind, mode, available, buckets }))
    }

    async fn resource(&mut self, tenant: &str, key: &str) -> Result<Option<ResourceState>, StorageError> {
        let sql = format!("SELECT {RESOURCE_COLUMNS} FROM resources WHERE tenant_id = $1 AND key = $2");
        let row = self.row(&sql, &[Arg::Text(tenant), Arg::Text(key)]).await?;
        row.as_ref().map(|row| rows::resource(row)).transpose()
    }

    async fn set_status(
        &mut self,
        tenant: &str,
        key: &str,
        status: ResourceStatus,
        now_ms: i64,
    ) -> Result<Option<ResourceState>, StorageError> {
        let matched = self
            .run(
                "UPDATE resources SET status = $1, updated_at = $2 WHERE tenant_id = $3 AND key = $4",
                &[Arg::Text(status.as_str()), Arg::Int(now_ms), Arg::Text(tenant), Arg::Text(key)],
            )
            .await?;
        if matched == 0 {
            return Ok(None);
        }
        self.resource(tenant, key).await
    }

    async fn insert_resource(
        &mut self,
        tenant: &str,
        res: &NewResource,
        now_ms: i64,
    ) -> Result<Option<(ResourceState, Counts)>, StorageError> {
        // A bucketed resource's row holds no counters: its buckets do.
        let row_total = if res.buckets > 1 { 0 } else { res.total };
        let inserted = sqlx::query(
            "INSERT IGNORE INTO resources (tenant_id, `key`, kind, status, mode, buckets, total, available, reserved,
                                           consumed, version, created_at, updated_at, low_stock, stock)
             VALUES (?, ?, ?, 'active', 'db', ?, ?, ?, 0, 0, 1, ?, ?, ?, ?)",
        )
        .bind(tenant)
        .bind(res.key.as_str())
        .bind(res.kind.as_str())
        .bind(res.buckets.max(1))
        .bind(row_total)
        .bind(row_total)
        .bind(now_ms)
        .bind(now_ms)
        .bind(res.low_stock)
        .bind(StockBand::of(res.total, res.low_stock).as_str())
        .execute(&mut *self.conn)
        .await?
        .rows_affected();
        if inserted != 1 {
            return Ok(None);
        }
        let sql = format!("SELECT {RESOURCE_COLUMNS} FROM resources WHERE tenant_id = $1 AND key = $2");
        let Some(row) = self.row(&sql, &[Arg::Text(tenant), Arg::Text(res.key.as_str())]).await? else {
            return Err(StorageError::Internal("an inserted resource vanished".into()));
        };
        Ok(Some((rows::resource(&row)?, rows::counts(&row)?)))
    }

    async fn insert_buckets(&mut self, shares: &[i64], e: &Entry<'_>) -> Result<(), StorageError> {
        let numbered: Vec<(i64, i64)> = shares.iter().enumerate().map(|(b, s)| (b as i64, *s)).collect();
        let sql = many(
            "INSERT INTO resource_buckets (tenant_id, resource_key, bucket, total, available, reserved, consumed,
                                           version, updated_at)",
            9,
            numbered.len(),
        );
        self.insert_many(&sql, &numbered, |q, (b, s)| {
            q.bind(e.tenant).bind(e.resource).bind(*b).bind(*s).bind(*s).bind(0i64).bind(0i64).bind(1i64).bind(e.at)
        })
        .await?;
        let sql = many(LEDGER_INSERT, 17, numbered.len());
        self.insert_many(&sql, &numbered, |q, (b, s)| {
            q.bind(e.tenant)
                .bind(e.resource)
                .bind(*b)
                .bind(e.op.as_str())
                .bind(*s)
                .bind(e.request_id)
                .bind(None::<&str>)
                .bind(None::<&str>)
                .bind(*s)
                .bind(0i64)
                .bind(0i64)
                .bind(1i64)
                .bind(e.plugin_version)
                .bind(e.at)
                .bind(None::<&str>)
                .bind(None::<&str>)
                .bind(None::<&str>)
        })
        .await?;
        Ok(())
    }

    async fn buckets(&mut self, tenant: &str, key: &str) -> Result<Vec<BucketCounts>, StorageError> {
        let rows = sqlx::query(&format!(
            "SELECT {BUCKET_COLUMNS} FROM resource_buckets WHERE tenant_id = ? AND resource_key = ? ORDER BY bucket"
        ))
        .bind(tenant)
        .bind(key)
        .fetch_all(&mut *self.conn)
        .await?;
        rows.iter().map(|row| Ok(rows::bucket(row)?.1)).collect()
    }

    /// Candidates found first without locks; then their resource rows are locked, in the batches'
    /// global order, skipping any a batch holds, so no batch deducts from their buckets meanwhile.
    async fn uneven_resources(&mut self, limit: u32) -> Result<Vec<(String, String)>, StorageError> {
        let candidates = sqlx::query(
            "SELECT b.tenant_id, b.resource_key FROM resource_buckets b
             GROUP BY b.tenant_id, b.resource_key HAVING MAX(b.available) - MIN(b.available) > 1
             ORDER BY b.tenant_id, b.resource_key LIMIT ?",
        )
        .bind(i64::from(limit))
        .fetch_all(&mut *self.conn)
        .await?
        .iter()
        .map(|row| Ok((row.text("tenant_id")?, row.text("resource_key")?)))
        .collect::<Result<Vec<_>, StorageError>>()?;
        let locked = lock_resources(self.conn, &candidates, true).await?;
        locked
            .iter()
            .filter(|row| row.int("buckets").unwrap_or(1) > 1)
            .map(|row| Ok((row.text("tenant_id")?, row.text("key")?)))
            .collect()
    }

    /// The limit's row moves only while `used + qty <= max`; a key seen for the first time is
    /// inserted (the caller checked `qty <= max`). A first use racing another process's waits on
    /// its insert, then finds the row and tries the guarded move once more.
    async fn take_limit(&mut self, tenant: &str, limit: &LimitSpec, qty: i64) -> Result<bool, StorageError> {
        let key = limit.key.as_str();
        let guarded = "UPDATE user_limits SET used = used + $1 WHERE tenant_id = $2 AND key = $3 AND used + $1 <= $4";
        let args = [Arg::Int(qty), Arg::Text(tenant), Arg::Text(key), Arg::Int(limit.max)];
        if self.run(guarded, &args).await? == 1 {
            return Ok(true);
        }
        let inserted = sqlx::query("INSERT IGNORE INTO user_limits (tenant_id, `key`, used) VALUES (?, ?, ?)")
            .bind(tenant)
            .bind(key)
            .bind(qty)
            .execute(&mut *self.conn)
            .await?
            .rows_affected();
        if inserted == 1 {
            return Ok(true);
        }
        Ok(self.run(guarded, &args).await? == 1)
    }

    async fn give_back_limit(&mut self, tenant: &str, key: &str, qty: i64) -> Result<(), StorageError> {
        self.run(
            "UPDATE user_limits SET used = used - $1 WHERE tenant_id = $2 AND key = $3 AND used >= $1",
            &[Arg::Int(qty), Arg::Text(tenant), Arg::Text(key)],
        )
        .await?;
        Ok(())
    }

    async fn insert_reservation(&mut self, r: &NewReservation) -> Result<(), StorageError> {
        sqlx::query(
            "INSERT INTO reservations (tenant_id, id, order_id, state, `lines`, expires_at, created_at, updated_at)
             VALUES (?, ?, ?, 'held', ?, ?, ?, ?)",
        )
        .bind(&r.tenant)
        .bind(&r.id)
        .bind(&r.order_id)
        .bind(&r.lines)
        .bind(r.expires_at)
        .bind(r.created_at)
        .bind(r.created_at)
        .execute(&mut *self.conn)
        .await?;
        Ok(())
    }

    async fn reservation(&mut self, tenant: &str, id: &str) -> Result<Option<Reservation>, StorageError> {
        let row = sqlx::query(
            "SELECT id, order_id, state, `lines`, expires_at FROM reservations WHERE tenant_id = ? AND id = ?",
        )
        .bind(tenant)
        .bind(id)
        .fetch_optional(&mut *self.conn)
        .await?;
        row.as_ref().map(|row| rows::reservation(row)).transpose()
    }

    async fn held_reservations(&mut self, tenant: &str, limit: u32) -> Result<Vec<Reservation>, StorageError> {
        let rows = self.rows(rows::HELD_RESERVATIONS_SQL, &[Arg::Text(tenant), Arg::Int(i64::from(limit))]).await?;
        rows.iter().map(|row| rows::reservation(row)).collect()
    }

    /// Under READ COMMITTED this waits for a concurrent mover's commit and then re-checks
    /// `state = 'held'` against the committed row, so exactly one move wins.
    async fn leave_held(
        &mut self,
        tenant: &str,
        id: &str,
        to: ReservationState,
        now_ms: i64,
    ) -> Result<bool, StorageError> {
        let moved = sqlx::query(
            "UPDATE reservations SET state = ?, updated_at = ? WHERE tenant_id = ? AND id = ? AND state = 'held'",
        )
        .bind(to.as_str())
        .bind(now_ms)
        .bind(tenant)
        .bind(id)
        .execute(&mut *self.conn)
        .await?
        .rows_affected();
        Ok(moved == 1)
    }

    /// Locked in one global order, before the batch locks any resource row (see the batcher).
    async fn lock_reservations(&mut self, wanted: &[(&str, &str)]) -> Result<Vec<Option<Reservation>>, StorageError> {
        if wanted.is_empty() {
            return Ok(Vec::new());
        }
        let sql = format!(
            "SELECT tenant_id, id, order_id, state, `lines`, expires_at FROM reservations
             WHERE (tenant_id, id) IN ({}) ORDER BY tenant_id, id FOR UPDATE",
            tuples(wanted.len(), 2)
        );
        let mut query = sqlx::query(&sql);
        for (tenant, id) in wanted {
            query = query.bind(*tenant).bind(*id);
        }
        let found = query.fetch_all(&mut *self.conn).await?;
        let mut by_id = HashMap::with_capacity(found.len());
        for row in &found {
            by_id.insert((row.text("tenant_id")?, row.text("id")?), rows::reservation(row)?);
        }
        Ok(wanted.iter().map(|(t, id)| by_id.get(&(t.to_string(), id.to_string())).cloned()).collect())
    }

    /// SKIP LOCKED: the sweepers of several processes each take different due rows, and a row a
    /// confirm or release is moving right now is left to it.
    async fn due_reservations(&mut self, now_ms: i64, limit: u32) -> Result<Vec<(String, Reservation)>, StorageError> {
        let rows = sqlx::query(
            "SELECT tenant_id, id, order_id, state, `lines`, expires_at FROM reservations
             WHERE state = 'held' AND expires_at <= ? ORDER BY expires_at LIMIT ?
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
            "INSERT IGNORE INTO redis_settled (tenant_id, resource_key, request_id, at) VALUES (?, ?, ?, ?)",
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

    async fn record_settlement_failure(
        &mut self,
        r: &SettleRecord,
        qty: i64,
        reason: &str,
        available: i64,
        now_ms: i64,
    ) -> Result<(), StorageError> {
        sqlx::query(
            "INSERT IGNORE INTO settlement_failures (tenant_id, resource_key, request_id, order_id, idempotency_key,
                                                     qty, reason, available, at, reservation_id)
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
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
        let row = self.row(REFUSED_RESERVATION_SQL, &[Arg::Text(tenant), Arg::Text(id)]).await?;
        row.map(|row| row.int("qty")).transpose()
    }

    async fn count_limit(&mut self, tenant: &str, key: &str, qty: i64) -> Result<(), StorageError> {
        sqlx::query(
            "INSERT INTO user_limits (tenant_id, `key`, used) VALUES (?, ?, ?)
             ON DUPLICATE KEY UPDATE used = used + VALUES(used)",
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
            "INSERT IGNORE INTO idempotency (tenant_id, `key`, request_hash, response_code, response_type,
                                             response_body, response_event, created_at)
             VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
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

    /// Reads the stored outcomes of the batch's keys in one statement: a key found was used
    /// before; any other is taken as ours, and its record is inserted with the batch's writes
    /// ([`Port::write_batch`]). A key another transaction uses first meanwhile makes that insert
    /// wait for it and then skip the key: the batch is then run again, and finds it answered.
    async fn claim_keys(
        &mut self,
        keys: &[(&TenantId, &IdempotencyRequest)],
        _now_ms: i64,
    ) -> Result<Vec<Claim>, StorageError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let ids: Vec<(String, String)> = keys.iter().map(|(t, i)| (t.to_string(), i.key.to_string())).collect();
        let mut stored = self.stored_outcomes(&ids).await?;
        Ok(keys
            .iter()
            .zip(ids)
            .map(|((_, idem), id)| match stored.remove(&id) {
                Some((hash, response)) => Claim::Answered(idem.judge(&hash, response)),
                None => Claim::Ours,
            })
            .collect())
    }

    /// Every write the batch's admission decided, a few multi-row statements: the rows (each
    /// guarded by the version admission read under its lock), the ledger, new reservations,
    /// reservation moves and the idempotency records.
    async fn write_batch(&mut self, w: &BatchWrites) -> Result<(), StorageError> {
        let mut written = 0;
        for r in &w.rows {
            written += sqlx::query(
                "UPDATE resources SET available = ?, reserved = ?, consumed = ?, version = ?,
                        updated_at = COALESCE(?, updated_at), stock = COALESCE(?, stock)
                 WHERE tenant_id = ? AND `key` = ? AND version = ?",
            )
            .bind(r.after.available)
            .bind(r.after.reserved)
            .bind(r.after.consumed)
            .bind(r.after.version)
            .bind(r.at)
            .bind(r.stock.map(|s| s.as_str()))
            .bind(&r.tenant)
            .bind(&r.key)
            .bind(r.read_version)
            .execute(&mut *self.conn)
            .await?
            .rows_affected();
        }
        let mut bucketed = 0;
        for b in &w.buckets {
            bucketed += sqlx::query(
                "UPDATE resource_buckets SET available = ?, reserved = ?, consumed = ?, version = ?, updated_at = ?
                 WHERE tenant_id = ? AND resource_key = ? AND bucket = ? AND version = ?",
            )
            .bind(b.after.available)
            .bind(b.after.reserved)
            .bind(b.after.consumed)
            .bind(b.after.version)
            .bind(b.at)
            .bind(&b.tenant)
            .bind(&b.key)
            .bind(b.bucket)
            .bind(b.read_version)
            .execute(&mut *self.conn)
            .await?
            .rows_affected();
        }
        if bucketed != w.buckets.len() as u64 {
            return Err(crate::apply::port::bucket_moved());
        }
        let sql = many(LEDGER_INSERT, 17, w.ledger.len());
        let ledgered = self
            .insert_many(&sql, &w.ledger, |q, x| {
                q.bind(&x.tenant)
                    .bind(&x.resource)
                    .bind(x.bucket)
                    .bind(x.op.as_str())
                    .bind(x.qty)
                    .bind(&x.request_id)
                    .bind(&x.order_id)
                    .bind(&x.reservation_id)
                    .bind(x.after.available)
                    .bind(x.after.reserved)
                    .bind(x.after.consumed)
                    .bind(x.after.version)
                    .bind(x.plugin_version)
                    .bind(x.at)
                    .bind(&x.line_key)
                    .bind(&x.limit_key)
                    .bind(None::<&str>)
            })
            .await?;
        let sql = many(
            "INSERT INTO reservations (tenant_id, id, order_id, state, `lines`, expires_at, created_at, updated_at)",
            8,
            w.reservations.len(),
        );
        let held = self
            .insert_many(&sql, &w.reservations, |q, x| {
                q.bind(&x.tenant)
                    .bind(&x.id)
                    .bind(&x.order_id)
                    .bind("held")
                    .bind(&x.lines)
                    .bind(x.expires_at)
                    .bind(x.created_at)
                    .bind(x.created_at)
            })
            .await?;
        let mut moved = 0;
        for m in &w.moves {
            moved += sqlx::query(
                "UPDATE reservations SET state = ?, updated_at = ? WHERE tenant_id = ? AND id = ? AND state = 'held'",
            )
            .bind(m.to.as_str())
            .bind(m.at)
            .bind(&m.tenant)
            .bind(&m.id)
            .execute(&mut *self.conn)
            .await?
            .rows_affected();
        }
        // IGNORE skips only a key another transaction took first: counted below.
        let sql = many(
            "INSERT IGNORE INTO idempotency (tenant_id, `key`, request_hash, response_code, response_type,
                                             response_body, response_event, created_at)",
            8,
            w.outcomes.len(),
        );
        let answered = self
            .insert_many(&sql, &w.outcomes, |q, x| {
                let (body, event) = body_columns(&x.response, x.event.as_deref());
                q.bind(&x.tenant)
                    .bind(&x.key)
                    .bind(stored_hash(&x.request_hash))
                    .bind(i32::from(x.response.status))
                    .bind(x.response.content_type.as_str())
                    .bind(body)
                    .bind(event)
                    .bind(x.at)
            })
            .await?;
        if answered != w.outcomes.len() as u64 {
            // Another transaction used one of the keys first, after `claim_keys` read them: its
            // commit made our insert skip the key. Nothing of this batch may stand; run again,
            // it finds the key answered.
            return Err(StorageError::Unavailable(
                "an idempotency key of the batch was used by another transaction meanwhile".into(),
            ));
        }
        for (name, got, want) in [
            ("written", written, w.rows.len()),
            ("ledgered", ledgered, w.ledger.len()),
            ("held", held, w.reservations.len()),
            ("moved", moved, w.moves.len()),
        ] {
            if got != want as u64 {
                // The rows are locked and the keys claimed by this transaction: nothing else can
                // have moved them. A mismatch is a bug; the batch is decided again order by order.
                return Err(StorageError::Internal(format!("batch admission wrote {name} {got} times, not {want}")));
            }
        }
        crate::storage::held_events::hold(&w.events)
    }

    /// Held by the batch attempt until just before its COMMIT, when the batcher inserts them
    /// numbered ([`super::events::seal`]), so a tenant's events commit in sequence order.
    async fn emit(&mut self, e: &NewEvent) -> Result<(), StorageError> {
        crate::storage::held_events::hold(std::slice::from_ref(e))
    }

    async fn stock(&mut self, tenant: &str, key: &str) -> Result<Option<Stock>, StorageError> {
        let row = sqlx::query(
            "SELECT CASE WHEN buckets = 1 THEN available ELSE
                      (SELECT CAST(COALESCE(SUM(b.available), 0) AS SIGNED) FROM resource_buckets b
                       WHERE b.tenant_id = r.tenant_id AND b.resource_key = r.`key`) END AS available,
                    low_stock, stock
             FROM resources r WHERE tenant_id = ? AND `key` = ?",
        )
        .bind(tenant)
        .bind(key)
        .fetch_optional(&mut *self.conn)
        .await?;
        let Some(row) = row else { return Ok(None) };
        let band = row.text("stock")?;
        let band = StockBand::from_db(&band).ok_or_else(|| corrupt("resources.stock"))?;
        Ok(Some(Stock { available: row.try_get("available")?, low_stock: row.try_get("low_stock")?, band }))
    }

    async fn set_low_stock(
        &mut self,
        tenant: &str,
        key: &str,
        low_stock: Option<i64>,
        now_ms: i64,
    ) -> Result<bool, StorageError> {
        let done = self
            .run(
                "UPDATE resources SET low_stock = $1, updated_at = $2 WHERE tenant_id = $3 AND key = $4",
                &[Arg::OptInt(low_stock), Arg::Int(now_ms), Arg::Text(tenant), Arg::Text(key)],
            )
            .await?;
        Ok(done == 1)
    }

    async fn set_stock(&mut self, tenant: &str, key: &str, band: StockBand) -> Result<(), StorageError> {
        self.run(
            "UPDATE resources SET stock = $1 WHERE tenant_id = $2 AND key = $3",
            &[Arg::Text(band.as_str()), Arg::Text(tenant), Arg::Text(key)],
        )
        .await?;
        Ok(())
    }

    async fn order_entries(
        &mut self,
        tenant: &str,
        order_id: &str,
        limit: u32,
    ) -> Result<Vec<OrderEntries>, StorageError> {
        let rows = self
            .rows(rows::ORDER_ENTRIES_SQL, &[Arg::Text(tenant), Arg::Text(order_id), Arg::Int(i64::from(limit))])
            .await?;
        rows.iter().map(|row| rows::order_entries(row)).collect()
    }

    /// The guarded move of an existing row first; a first reversal of the line inserts it (the
    /// caller checked `qty <= taken`), and one racing another process's first waits on its
    /// insert, then tries the guarded move once more.
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
        // MySQL assigns left to right: `taken` is raised first; the WHERE is judged before either.
        let guarded =
            "UPDATE order_reversals SET taken = GREATEST(taken, $5), reversed = reversed + $6, updated_at = $7
             WHERE tenant_id = $1 AND order_id = $2 AND resource_key = $3 AND bucket = $4
               AND reversed + $6 <= GREATEST(taken, $5)";
        let args = [
            Arg::Text(tenant),
            Arg::Text(order_id),
            Arg::Text(resource),
            Arg::Int(bucket),
            Arg::Int(taken),
            Arg::Int(qty),
            Arg::Int(now_ms),
        ];
        if self.run(guarded, &args).await? == 1 {
            return Ok(true);
        }
        let inserted = self
            .run(
                "INSERT IGNORE INTO order_reversals (tenant_id, order_id, resource_key, bucket, taken, reversed, updated_at)
                 VALUES ($1, $2, $3, $4, $5, $6, $7)",
                &args,
            )
            .await?;
        if inserted == 1 {
            return Ok(true);
        }
        Ok(self.run(guarded, &args).await? == 1)
    }

    /// One statement for all of them, in key order, so two processes' passes take the
    /// checkpoint rows' locks in the same order. A checkpoint only moves forward.
    async fn advance_checkpoints(&mut self, checkpoints: &[Checkpoint]) -> Result<(), StorageError> {
        if checkpoints.is_empty() {
            return Ok(());
        }
        let mut sorted: Vec<&Checkpoint> = checkpoints.iter().collect();
        sorted.sort_by(|a, b| (&a.tenant, &a.key, a.bucket).cmp(&(&b.tenant, &b.key, b.bucket)));
        // Assignments run left to right and see the values already assigned: `version` last,
        // so every other column compares against the version the row had.
        let keep = |col: &str| format!("{col} = IF(VALUES(version) >= version, VALUES({col}), {col})");
        let head = format!(
            "INSERT INTO ledger_checkpoints (tenant_id, resource_key, bucket, version, available, reserved, consumed,
                                             total, seq) VALUES {} ON DUPLICATE KEY UPDATE {}, {}, {}, {}, {}, {}",
            tuples(sorted.len(), 9),
            keep("available"),
            keep("reserved"),
            keep("consumed"),
            keep("total"),
            keep("seq"),
            "version = GREATEST(version, VALUES(version))"
        );
        let mut query = sqlx::query(&head);
        for c in sorted {
            query = query
                .bind(&c.tenant)
                .bind(&c.key)
                .bind(c.bucket)
                .bind(c.counters.version)
                .bind(c.counters.available)
                .bind(c.counters.reserved)
                .bind(c.counters.consumed)
                .bind(c.counters.total)
                .bind(c.seq);
        }
        query.execute(&mut *self.conn).await?;
        Ok(())
    }

    async fn forget_checkpoints(&mut self, which: &[(String, String, i64)]) -> Result<(), StorageError> {
        if which.is_empty() {
            return Ok(());
        }
        let sql = format!(
            "DELETE FROM ledger_checkpoints WHERE (tenant_id, resource_key, bucket) IN ({})",
            tuples(which.len(), 3)
        );
        let mut query = sqlx::query(&sql);
        for (t, k, b) in which {
            query = query.bind(t).bind(k).bind(*b);
        }
        query.execute(&mut *self.conn).await?;
        Ok(())
    }
}

impl Reads for MyPort<'_> {
    async fn resources_page(
        &mut self,
        tenant: &str,
        prefix: &str,
        after: &str,
        limit: u32,
    ) -> Result<Vec<ResourceState>, StorageError> {
        // Keys are [A-Za-z0-9._:@-], so a prefix range needs no LIKE escaping: every key with
        // the prefix sorts in [prefix, prefix || 0x7f) in byte order, which ascii_bin compares in.
        let upper = format!("{prefix}\u{7f}");
        let sql = format!(
            "SELECT {RESOURCE_COLUMNS} FROM resources
             WHERE tenant_id = $1 AND key >= $2 AND key < $3 AND key > $4 ORDER BY key LIMIT $5"
        );
        let args =
            [Arg::Text(tenant), Arg::Text(prefix), Arg::Text(&upper), Arg::Text(after), Arg::Int(i64::from(limit))];
        let rows = self.rows(&sql, &args).await?;
        rows.iter().map(|row| rows::resource(row)).collect()
    }

    async fn buckets_of(
        &mut self,
        tenant: &str,
        keys: &[String],
    ) -> Result<HashMap<(String, String), Vec<BucketCounts>>, StorageError> {
        if keys.is_empty() {
            return Ok(HashMap::new());
        }
        let sql = format!(
            "SELECT {BUCKET_COLUMNS} FROM resource_buckets WHERE tenant_id = ? AND resource_key IN ({})
             ORDER BY resource_key, bucket",
            vec!["?"; keys.len()].join(", ")
        );
        let mut query = sqlx::query(&sql).bind(tenant);
        for key in keys {
            query = query.bind(key);
        }
        let rows = query.fetch_all(&mut *self.conn).await?;
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
            "SELECT {LEDGER_COLUMNS} FROM ledger WHERE tenant_id = ? AND resource_key = ? AND seq > ?
             ORDER BY seq {order} LIMIT ?"
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
        let used: Option<i64> = sqlx::query_scalar("SELECT used FROM user_limits WHERE tenant_id = ? AND `key` = ?")
            .bind(tenant)
            .bind(key)
            .fetch_optional(&mut *self.conn)
            .await?;
        Ok(used.unwrap_or(0))
    }

    async fn held_among(&mut self, tenant: &str, ids: &[String]) -> Result<HashSet<String>, StorageError> {
        let mut held = HashSet::with_capacity(ids.len());
        for chunk in ids.chunks(HELD_AMONG_CHUNK) {
            let sql = format!(
                "SELECT id FROM reservations WHERE tenant_id = ? AND id IN ({}) AND state = 'held'",
                vec!["?"; chunk.len()].join(", ")
            );
            let mut query = sqlx::query_scalar::<_, String>(&sql).bind(tenant);
            for id in chunk {
                query = query.bind(id);
            }
            held.extend(query.fetch_all(&mut *self.conn).await?);
        }
        Ok(held)
    }

    async fn ledger_rows(&mut self, tenant: Option<&str>, pass: Pass) -> Result<LedgerRows, StorageError> {
        let [resources, checkpoints, sums, newest, buckets] = ledger_rows_sql(tenant.is_some(), pass);
        let args: Vec<Arg<'_>> = tenant.map(Arg::Text).into_iter().collect();
        let found = self.rows(&resources, &args).await?;
        let resources = found
            .iter()
            .map(|row| Ok((row.text("tenant_id")?, rows::resource(row)?)))
            .collect::<Result<_, StorageError>>()?;
        let found = self.rows(&checkpoints, &args).await?;
        let checkpoints = found.iter().map(|row| rows::checkpoint(row)).collect::<Result<_, _>>()?;
        let found = self.rows_once(&sums, &args).await?;
        let sums = found.iter().map(|row| rows::ledger_sum(row)).collect::<Result<_, _>>()?;
        let found = self.rows_once(&newest, &args).await?;
        let newest = found.iter().map(|row| rows::newest_entry(row)).collect::<Result<_, _>>()?;
        let found = self.rows(&buckets, &args).await?;
        let buckets = rows::group_buckets(found.iter().map(|row| rows::bucket(row)).collect::<Result<Vec<_>, _>>()?);
        Ok(LedgerRows { resources, checkpoints, sums, newest, buckets })
    }
}

/// The five queries of reconciliation (in the shared `$n` form): resources, checkpoints, per-op
/// ledger sums, newest entries, buckets; for one tenant (`$1`) or for all. MariaDB has no
/// LATERAL: the sums join each target's range of `ledger_by_resource` (after its checkpoint's
/// `seq`), and the newest entry of a target is the one at the largest `seq` in its range.
fn ledger_rows_sql(one_tenant: bool, pass: Pass) -> [String; 5] {
    let only = if one_tenant { "WHERE tenant_id = $1" } else { "" };
    let targets = rows::reconciliation_targets(one_tenant.then_some("$1"), pass);
    let range = "l.tenant_id = w.tenant_id AND l.resource_key = w.resource_key AND l.seq > w.since
                 AND l.bucket = w.bucket";
    [
        format!("SELECT tenant_id, {RESOURCE_COLUMNS} FROM resources {only} ORDER BY tenant_id, key"),
        format!("SELECT {CHECKPOINT_COLUMNS} FROM ledger_checkpoints {only}"),
        format!(
            "{targets}
             SELECT w.tenant_id, w.resource_key, w.bucket, l.op, CAST(SUM(l.qty) AS SIGNED) AS qty, COUNT(*) AS n
             FROM w JOIN ledger l ON {range}
             GROUP BY w.tenant_id, w.resource_key, w.bucket, l.op"
        ),
        format!(
            "{targets}, m AS (
                 SELECT w.tenant_id, w.resource_key, w.bucket, MAX(l.seq) AS seq
                 FROM w JOIN ledger l ON {range} GROUP BY w.tenant_id, w.resource_key, w.bucket)
             SELECT m.tenant_id, m.resource_key, m.bucket, l.seq, l.available_after, l.reserved_after,
                    l.consumed_after
             FROM m JOIN ledger l ON l.seq = m.seq"
        ),
        format!("SELECT {BUCKET_COLUMNS} FROM resource_buckets {only} ORDER BY tenant_id, resource_key, bucket"),
    ]
}

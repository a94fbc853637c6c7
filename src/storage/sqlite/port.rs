//! [`Port`] on SQLite: the statements of [`crate::apply`] for the writer thread's connection.
//! Every method completes at once (the writer drives the orchestration with
//! [`crate::apply::port::run_now`]); statements are prepared once per connection.
//!
//! There is one writer, so nothing is locked and nothing can change between a read and the
//! write that follows it; a key is "claimed" by finding no record for it.

use std::collections::{HashMap, HashSet};

use rusqlite::{params, Connection, OptionalExtension, Row as SqlRow};

use crate::apply::port::{
    BatchWrites, Change, Claim, Counts, Entry, Gate, LockedRows, Move, NewReservation, Port, Row, Savepoint, View,
};
use crate::apply::reads::{LedgerRows, Reads};
use crate::engine::admission::Row as AdmissionRow;
use crate::engine::reversal::OrderEntries;
use crate::engine::{
    BucketCounts, Checkpoint, Kind, LedgerEntry, LimitSpec, Mode, Pass, Reservation, ReservationState, ResourceState,
    ResourceStatus, TenantId, MAX_TOTAL,
};
use crate::events::{NewEvent, Stock, StockBand};
use crate::storage::redis_store::{SettleRecord, REFUSED_RESERVATION_SQL, STORED_OUTCOME_SQL};
use crate::storage::rows::{self, Columns, BUCKET_COLUMNS, CHECKPOINT_COLUMNS, LEDGER_COLUMNS, RESOURCE_COLUMNS};
use crate::storage::{
    body_columns, payload, stored_hash, IdempotencyRequest, Idempotent, NewResource, PageFrom, StorageError,
    StoredResponse,
};

pub(super) fn corrupt(what: &str) -> StorageError {
    StorageError::Internal(format!("unexpected stored value in {what}"))
}

/// Maps one rusqlite row with a shared mapper of [`rows`].
pub(super) fn mapped<T>(
    map: impl Fn(&dyn Columns) -> Result<T, StorageError>,
) -> impl Fn(&SqlRow<'_>) -> rusqlite::Result<Result<T, StorageError>> {
    move |row: &SqlRow<'_>| Ok(map(row))
}

/// Every row of a query, mapped.
pub(super) fn all<T>(
    statement: &mut rusqlite::CachedStatement<'_>,
    params: impl rusqlite::Params,
    map: impl Fn(&dyn Columns) -> Result<T, StorageError>,
) -> Result<Vec<T>, StorageError> {
    statement.query_map(params, mapped(map))?.map(|row| row?).collect()
}

/// The guarded UPDATEs: `?1` quantity, `?2` time, `?3` tenant, `?4` resource, and `?5` the kind
/// (an order's deduction or reservation), the largest total (an adjustment) or the bucket.
macro_rules! resource_move {
    ($set:literal, $guard:literal) => {
        concat!(
            "UPDATE resources SET ",
            $set,
            ", version = version + 1, updated_at = ?2 WHERE tenant_id = ?3 AND key = ?4 AND ",
            $guard,
            " RETURNING available, reserved, consumed, version"
        )
    };
}
macro_rules! bucket_move {
    ($set:literal, $guard:literal) => {
        concat!(
            "UPDATE resource_buckets SET ",
            $set,
            ", version = version + 1, updated_at = ?2
             WHERE tenant_id = ?3 AND resource_key = ?4 AND bucket = ?5 AND ",
            $guard,
            " RETURNING available, reserved, consumed, version"
        )
    };
}
fn change_sql(row: Row, how: Move, gate: Gate) -> &'static str {
    match (row, how, gate) {
        (Row::Resource, Move::Deduct, Gate::Order { .. }) => resource_move!(
            "available = available - ?1, consumed = consumed + ?1",
            "status = 'active' AND mode = 'db' AND available >= ?1 AND (?5 IS NULL OR kind = ?5)"
        ),
        (Row::Resource, Move::Reserve, Gate::Order { .. }) => resource_move!(
            "available = available - ?1, reserved = reserved + ?1",
            "status = 'active' AND mode = 'db' AND available >= ?1 AND (?5 IS NULL OR kind = ?5)"
        ),
        (Row::Resource, Move::Deduct, _) => {
            resource_move!("available = available - ?1, consumed = consumed + ?1", "available >= ?1")
        }
        (Row::Resource, Move::Reserve, _) => {
            resource_move!("available = available - ?1, reserved = reserved + ?1", "available >= ?1")
        }
        (Row::Resource, Move::Confirm, _) => {
            resource_move!("reserved = reserved - ?1, consumed = consumed + ?1", "reserved >= ?1")
        }
        (Row::Resource, Move::Unreserve, _) => {
            resource_move!("reserved = reserved - ?1, available = available + ?1", "reserved >= ?1")
        }
        (Row::Resource, Move::Adjust, _) => {
            resource_move!("available = available + ?1, total = total + ?1", "available + ?1 >= 0 AND total + ?1 <= ?5")
        }
        (Row::Bucket(_), Move::Deduct, _) => {
            bucket_move!("available = available - ?1, consumed = consumed + ?1", "available >= ?1")
        }
        (Row::Bucket(_), Move::Reserve, _) => {
            bucket_move!("available = available - ?1, reserved = reserved + ?1", "available >= ?1")
        }
        (Row::Bucket(_), Move::Confirm, _) => {
            bucket_move!("reserved = reserved - ?1, consumed = consumed + ?1", "reserved >= ?1")
        }
        (Row::Bucket(_), Move::Unreserve, _) => {
            bucket_move!("reserved = reserved - ?1, available = available + ?1", "reserved >= ?1")
        }
        (Row::Bucket(_), Move::Adjust, _) => {
            bucket_move!("available = available + ?1, total = total + ?1", "available + ?1 >= 0")
        }
        (Row::Resource, Move::Reverse, Gate::Order { .. }) => {
            resource_move!("consumed = consumed - ?1, available = available + ?1", "mode = 'db' AND consumed >= ?1")
        }
        (Row::Resource, Move::Reverse, _) => {
            resource_move!("consumed = consumed - ?1, available = available + ?1", "consumed >= ?1")
        }
        (Row::Bucket(_), Move::Reverse, _) => {
            bucket_move!("consumed = consumed - ?1, available = available + ?1", "consumed >= ?1")
        }
    }
}

// The statements every order writes with (besides the guarded UPDATEs), named so that a test can
// check what SQLite compiles them to (`migrate::tests`).
pub(super) const INSERT_LEDGER: &str =
    "INSERT INTO ledger (tenant_id, resource_key, bucket, op, qty, request_id, order_id, reservation_id,
                         available_after, reserved_after, consumed_after, version_after, plugin_version, at,
                         line_key, limit_key, reverses, by_key)
     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18)";

/// Stores a record unless its key has one (`ON CONFLICT DO NOTHING`): a change count of 0 is a
/// stub to evict ([`evict_stub`]) or a record that answers.
pub(super) const INSERT_OUTCOME: &str =
    "INSERT INTO idempotency (tenant_id, key, request_hash, response_code, response_type,
                                                      response_body, response_event, created_at, ledger_seq)
     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9) ON CONFLICT DO NOTHING";

pub(super) const INSERT_RESERVATION: &str =
    "INSERT INTO reservations (tenant_id, id, order_id, state, lines, expires_at, created_at, updated_at)
     VALUES (?1, ?2, ?3, 'held', ?4, ?5, ?6, ?6)";

pub(super) const MOVE_RESERVATION: &str = "UPDATE reservations SET state = ?1, updated_at = ?2
     WHERE tenant_id = ?3 AND id = ?4 AND state = 'held'";

pub(super) const INSERT_EVENT: &str =
    "INSERT INTO events (id, tenant_id, seq, type, ordering_key, at, data) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)";

/// [`rows::ORDER_ENTRIES_SQL`] on SQLite: an order's entries are those `ledger_by_order` holds
/// and those found through the record stored under the order id (`by_key`, through the entry its
/// `ledger_seq` names and `ledger_identity`; migrations/sqlite/0022). Both indexes are named:
/// without statistics SQLite may read the tenant's whole ledger through an index whose order
/// suits the GROUP BY (`ledger_by_resource`) instead of the order's few rows.
pub(super) const ORDER_ENTRIES: &str = rows::order_entries_sql!(
    "(SELECT resource_key, bucket, op, qty, line_key, limit_key, request_id
      FROM ledger INDEXED BY ledger_by_order WHERE tenant_id = ?1 AND order_id = ?2 AND by_key IS NULL
      UNION ALL
      SELECT l.resource_key, l.bucket, l.op, l.qty, l.line_key, l.limit_key, l.request_id
      FROM idempotency i JOIN ledger f ON f.seq = i.ledger_seq AND f.tenant_id = ?1
           JOIN ledger l INDEXED BY ledger_identity ON l.tenant_id = ?1 AND l.request_id = f.request_id
      WHERE i.tenant_id = ?1 AND i.key = ?2 AND l.order_id = ?2 AND l.by_key = 1)",
    "?3"
);

/// Writes one ledger entry with `statement`, [`INSERT_LEDGER`] prepared; `by_key`: found by its
/// order id through the record of that key (migrations/sqlite/0022), not `ledger_by_order`.
fn insert_ledger(
    statement: &mut rusqlite::CachedStatement<'_>,
    e: &Entry<'_>,
    after: Counts,
    by_key: bool,
) -> Result<(), StorageError> {
    statement.execute(params![
        e.tenant,
        e.resource,
        e.bucket,
        e.op.as_str(),
        e.qty,
        e.request_id,
        e.order_id,
        e.reservation_id,
        after.available,
        after.reserved,
        after.consumed,
        after.version,
        e.plugin_version,
        e.at,
        e.line_key,
        e.limit_key,
        e.reverses,
        by_key.then_some(1)
    ])?;
    Ok(())
}

/// Stores an idempotency record with [`INSERT_OUTCOME`] prepared as `insert`, its key's stub
/// evicted first if it has one. `Ok(false)`: the key has a record that answers.
fn insert_outcome(
    conn: &Connection,
    insert: &mut rusqlite::CachedStatement<'_>,
    values: &[&dyn rusqlite::ToSql],
    tenant: &str,
    key: &str,
) -> Result<bool, StorageError> {
    if insert.execute(values)? == 1 {
        return Ok(true);
    }
    if !evict_stub(conn, tenant, key)? {
        return Ok(false);
    }
    Ok(insert.execute(values)? == 1)
}

/// Gives a stub's key back (migrations/sqlite/0022): the stub goes, and the entries its order
/// was found by go back into `ledger_by_order`. `false`: the key has no stub.
fn evict_stub(conn: &Connection, tenant: &str, key: &str) -> Result<bool, StorageError> {
    let stub: Option<i64> = conn
        .prepare_cached(
            "DELETE FROM idempotency WHERE tenant_id = ?1 AND key = ?2 AND response_code IS NULL RETURNING ledger_seq",
        )?
        .query_row(params![tenant, key], |row| row.get(0))
        .optional()?;
    let Some(seq) = stub else { return Ok(false) };
    conn.prepare_cached(
        "UPDATE ledger SET by_key = NULL
         WHERE tenant_id = ?1 AND request_id = (SELECT request_id FROM ledger WHERE seq = ?3)
           AND order_id = ?2 AND by_key = 1",
    )?
    .execute(params![tenant, key, seq])?;
    Ok(true)
}

/// Why a record could not be stored: its key answers already. The writer looked the key up in
/// the same transaction and found nothing, so this is a fault, not a request's answer.
fn key_taken(key: &str) -> StorageError {
    StorageError::Internal(format!("idempotency key {key} has a record already"))
}

/// The writer's connection as a [`Port`].
pub struct SqlitePort<'c> {
    conn: &'c Connection,
}

impl<'c> SqlitePort<'c> {
    pub fn new(conn: &'c Connection) -> Self {
        Self { conn }
    }

    fn exec(&self, sql: &str) -> Result<(), StorageError> {
        self.conn.prepare_cached(sql)?.execute([])?;
        Ok(())
    }

    /// The finished outcome stored under the key, judged against this request.
    pub(super) fn lookup(
        &self,
        tenant: &TenantId,
        idem: &IdempotencyRequest,
    ) -> Result<Option<Idempotent>, StorageError> {
        let row = self
            .conn
            .prepare_cached(STORED_OUTCOME_SQL)?
            .query_row(params![tenant.as_str(), idem.key.as_str()], |row| {
                Ok((
                    row.get::<_, String>(0)?,
                    row.get::<_, i64>(1)?,
                    row.get::<_, String>(2)?,
                    row.get::<_, Option<String>>(3)?,
                    row.get::<_, Option<String>>(4)?,
                ))
            })
            .optional()?;
        let Some((hash, code, kind, body, event)) = row else { return Ok(None) };
        let Some(response) = StoredResponse::from_columns(Some(code), Some(&kind), body, event.as_deref())? else {
            return Ok(None);
        };
        Ok(Some(idem.judge(&hash, response)))
    }

    /// Marks the entries `request` wrote for the order whose id is `key` as found through its
    /// record (`by_key`), and returns the `seq` of the first, which the record keeps; `None`:
    /// there are none.
    fn found_by_key(&self, tenant: &str, key: &str, request: &str) -> Result<Option<i64>, StorageError> {
        let mut marked = self.conn.prepare_cached(
            "UPDATE ledger SET by_key = 1 WHERE tenant_id = ?1 AND request_id = ?2 AND order_id = ?3 RETURNING seq",
        )?;
        let seqs = marked.query_map(params![tenant, request, key], |row| row.get::<_, i64>(0))?;
        Ok(seqs.collect::<rusqlite::Result<Vec<i64>>>()?.into_iter().min())
    }

    fn ledger(&self, e: &Entry<'_>, after: Counts) -> Result<(), StorageError> {
        insert_ledger(&mut self.conn.prepare_cached(INSERT_LEDGER)?, e, after, false)
    }

    /// Writes events of one tenant, numbered next in its sequence. The only writer: numbering as
    /// it writes is numbering in commit order, and a rolled-back savepoint takes its numbers back
    /// with its events.
    fn write_events(&self, events: &[NewEvent]) -> Result<(), StorageError> {
        let Some(first) = events.first() else { return Ok(()) };
        let n = events.len() as i64;
        let last: i64 = self
            .conn
            .prepare_cached(
                "INSERT INTO event_seqs (tenant_id, last) VALUES (?1, ?2)
                 ON CONFLICT (tenant_id) DO UPDATE SET last = last + excluded.last RETURNING last",
            )?
            .query_row(params![first.tenant, n], |row| row.get(0))?;
        let mut insert = self.conn.prepare_cached(INSERT_EVENT)?;
        for (e, seq) in events.iter().zip(last - n + 1..) {
            insert.execute(params![
                e.id,
                e.tenant,
                seq,
                e.kind.as_str(),
                e.ordering_key,
                e.at,
                payload::pack(&e.data)
            ])?;
            crate::events::written_now(e.kind);
        }
        Ok(())
    }

    /// The resource rows of these `(tenant, key)` pairs that exist, as batch admission judges them.
    pub fn admission_rows<'k>(
        &self,
        wanted: impl IntoIterator<Item = (&'k str, &'k str)>,
    ) -> Result<LockedRows, StorageError> {
        let mut rows = LockedRows::new();
        let mut statement = self.conn.prepare_cached(
            "SELECT kind, status, mode, buckets, available, reserved, consumed, version, low_stock, stock
             FROM resources WHERE tenant_id = ?1 AND key = ?2",
        )?;
        for (tenant, key) in wanted {
            if rows.get(tenant).is_some_and(|r: &HashMap<String, AdmissionRow>| r.contains_key(key)) {
                continue;
            }
            let row = statement
                .query_row(params![tenant, key], |row| {
                    Ok((
                        row.get::<_, String>(0)?,
                        row.get::<_, String>(1)?,
                        row.get::<_, String>(2)?,
                        row.get(3)?,
                        row.get(4)?,
                        row.get(5)?,
                        row.get(6)?,
                        row.get(7)?,
                        row.get::<_, Option<i64>>(8)?,
                        row.get::<_, String>(9)?,
                    ))
                })
                .optional()?;
            let Some((kind, status, mode, buckets, available, reserved, consumed, version, low_stock, stock)) = row
            else {
                continue;
            };
            let parsed = AdmissionRow {
                kind: Kind::from_db(&kind).ok_or_else(|| corrupt("resources.kind"))?,
                active: status == ResourceStatus::Active.as_str(),
                redis: mode == Mode::Redis.as_str(),
                buckets,
                available,
                reserved,
                consumed,
                version,
                low_stock,
                stock: StockBand::from_db(&stock).ok_or_else(|| corrupt("resources.stock"))?,
                bucket_rows: Vec::new(),
            };
            rows.entry(tenant.to_string()).or_default().insert(key.to_string(), parsed);
        }
        Ok(rows)
    }
}

impl Port for SqlitePort<'_> {
    async fn claim_key(
        &mut self,
        tenant: &TenantId,
        idem: &IdempotencyRequest,
        _now_ms: i64,
    ) -> Result<Option<Idempotent>, StorageError> {
        self.lookup(tenant, idem)
    }

    async fn store_outcome(
        &mut self,
        tenant: &TenantId,
        idem: &IdempotencyRequest,
        response: &StoredResponse,
        event: Option<&str>,
        request_id: Option<&str>,
        now_ms: i64,
    ) -> Result<(), StorageError> {
        let (body, event) = body_columns(response, event);
        let (tenant, key) = (tenant.as_str(), idem.key.as_str());
        // An order decided on its own wrote its entries into `ledger_by_order`; where its id is
        // this key they leave it (the pages are this transaction's already) and are found
        // through the record, as a batch's are (migrations/sqlite/0022).
        let ledger_seq = match request_id {
            Some(request) => self.found_by_key(tenant, key, request)?,
            None => None,
        };
        let stored = insert_outcome(
            self.conn,
            &mut self.conn.prepare_cached(INSERT_OUTCOME)?,
            params![
                tenant,
                key,
                stored_hash(&idem.request_hash),
                i64::from(response.status),
                response.content_type.as_str(),
                body,
                event,
                now_ms,
                ledger_seq
            ],
            tenant,
            key,
        )?;
        if !stored {
            return Err(key_taken(key));
        }
        Ok(())
    }

    async fn forget_key(&mut self, _tenant: &TenantId, _idem: &IdempotencyRequest) -> Result<(), StorageError> {
        // Nothing was written for the key.
        Ok(())
    }

    async fn savepoint(&mut self, at: Savepoint) -> Result<(), StorageError> {
        self.exec(match at {
            Savepoint::Lines => "SAVEPOINT lines",
            Savepoint::Line => "SAVEPOINT line",
        })
    }

    async fn rollback_to(&mut self, at: Savepoint) -> Result<(), StorageError> {
        self.exec(match at {
            Savepoint::Lines => "ROLLBACK TO lines",
            Savepoint::Line => "ROLLBACK TO line",
        })
    }

    async fn release(&mut self, at: Savepoint) -> Result<(), StorageError> {
        self.exec(match at {
            Savepoint::Lines => "RELEASE lines",
            Savepoint::Line => "RELEASE line",
        })
    }

    async fn change(&mut self, change: &Change<'_>) -> Result<Option<Counts>, StorageError> {
        let e = &change.entry;
        let mut statement = self.conn.prepare_cached(change_sql(change.row, change.how, change.gate))?;
        let counts = mapped(rows::counts);
        let after = match (change.row, change.how, change.gate) {
            (Row::Bucket(bucket), ..) => {
                statement.query_row(params![e.qty, e.at, e.tenant, e.resource, bucket], counts).optional()?
            }
            (Row::Resource, Move::Deduct | Move::Reserve, Gate::Order { kind }) => statement
                .query_row(params![e.qty, e.at, e.tenant, e.resource, kind.map(Kind::as_str)], counts)
                .optional()?,
            (Row::Resource, Move::Adjust, _) => {
                statement.query_row(params![e.qty, e.at, e.tenant, e.resource, MAX_TOTAL], counts).optional()?
            }
            (Row::Resource, ..) => {
                statement.query_row(params![e.qty, e.at, e.tenant, e.resource], counts).optional()?
            }
        }
        .transpose()?;
        if let Some(after) = after {
            self.ledger(e, after)?;
        }
        Ok(after)
    }

    async fn append_ledger(&mut self, entry: &Entry<'_>, after: Counts) -> Result<(), StorageError> {
        self.ledger(entry, after)
    }

    async fn view(&mut self, tenant: &str, key: &str) -> Result<Option<View>, StorageError> {
        let row = self
            .conn
            .prepare_cached(
                "SELECT status, kind, mode,
                        CASE WHEN buckets = 1 THEN available ELSE
                          (SELECT COALESCE(SUM(b.available), 0) FROM resource_buckets b
                           WHERE b.tenant_id = r.tenant_id AND b.resource_key = r.key) END,
                        buckets
                 FROM resources r WHERE tenant_id = ?1 AND key = ?2",
            )?
            .query_row(params![tenant, key], |row| {
                Ok((
                    row.get::<_, String>(0)?,
                    row.get::<_, String>(1)?,
                    row.get::<_, String>(2)?,
                    row.get::<_, i64>(3)?,
                    row.get::<_, i64>(4)?,
                ))
            })
            .optional()?;
        let Some((status, kind, mode, available, buckets)) = row else { return Ok(None) };
        let (Some(status), Some(kind), Some(mode)) =
            (ResourceStatus::from_db(&status), Kind::from_db(&kind), Mode::from_db(&mode))
        else {
            return Err(corrupt("resources"));
        };
        Ok(Some(View { status, kind, mode, available, buckets }))
    }

    async fn resource(&mut self, tenant: &str, key: &str) -> Result<Option<ResourceState>, StorageError> {
        self.conn
            .prepare_cached(&format!("SELECT {RESOURCE_COLUMNS} FROM resources WHERE tenant_id = ?1 AND key = ?2"))?
            .query_row(params![tenant, key], mapped(rows::resource))
            .optional()?
            .transpose()
    }

    async fn set_status(
        &mut self,
        tenant: &str,
        key: &str,
        status: ResourceStatus,
        now_ms: i64,
    ) -> Result<Option<ResourceState>, StorageError> {
        self.conn
            .prepare_cached(&format!(
                "UPDATE resources SET status = ?1, updated_at = ?2 WHERE tenant_id = ?3 AND key = ?4
                 RETURNING {RESOURCE_COLUMNS}"
            ))?
            .query_row(params![status.as_str(), now_ms, tenant, key], mapped(rows::resource))
            .optional()?
            .transpose()
    }

    async fn insert_resource(
        &mut self,
        tenant: &str,
        res: &NewResource,
        now_ms: i64,
    ) -> Result<Option<(ResourceState, Counts)>, StorageError> {
        // A bucketed resource's row holds no counters: its buckets do.
        let row_total = if res.buckets > 1 { 0 } else { res.total };
        let row = self
            .conn
            .prepare_cached(&format!(
                "INSERT INTO resources (tenant_id, key, kind, status, mode, buckets, total, available, reserved,
                                        consumed, version, created_at, updated_at, low_stock, stock)
                 VALUES (?1, ?2, ?3, 'active', 'db', ?6, ?4, ?4, 0, 0, 1, ?5, ?5, ?7, ?8)
                 ON CONFLICT (tenant_id, key) DO NOTHING
                 RETURNING {RESOURCE_COLUMNS}"
            ))?
            .query_row(
                params![
                    tenant,
                    res.key.as_str(),
                    res.kind.as_str(),
                    row_total,
                    now_ms,
                    res.buckets.max(1),
                    res.low_stock,
                    StockBand::of(res.total, res.low_stock).as_str()
                ],
                mapped(|row| Ok((rows::resource(row)?, rows::counts(row)?))),
            )
            .optional()?;
        row.transpose()
    }

    async fn insert_buckets(&mut self, shares: &[i64], entry: &Entry<'_>) -> Result<(), StorageError> {
        for (bucket, &share) in shares.iter().enumerate() {
            let bucket = bucket as i64;
            let after = self
                .conn
                .prepare_cached(
                    "INSERT INTO resource_buckets (tenant_id, resource_key, bucket, total, available, reserved,
                                                   consumed, version, updated_at)
                     VALUES (?1, ?2, ?3, ?4, ?4, 0, 0, 1, ?5)
                     RETURNING available, reserved, consumed, version",
                )?
                .query_row(params![entry.tenant, entry.resource, bucket, share, entry.at], mapped(rows::counts))??;
            self.ledger(&Entry { bucket, qty: share, ..*entry }, after)?;
        }
        Ok(())
    }

    async fn buckets(&mut self, tenant: &str, key: &str) -> Result<Vec<BucketCounts>, StorageError> {
        let mut statement = self.conn.prepare_cached(&format!(
            "SELECT {BUCKET_COLUMNS} FROM resource_buckets WHERE tenant_id = ?1 AND resource_key = ?2 ORDER BY bucket"
        ))?;
        Ok(all(&mut statement, params![tenant, key], rows::bucket)?.into_iter().map(|(_, b)| b).collect())
    }

    async fn uneven_resources(&mut self, limit: u32) -> Result<Vec<(String, String)>, StorageError> {
        Ok(self
            .conn
            .prepare_cached(
                "SELECT b.tenant_id, b.resource_key FROM resource_buckets b
                 JOIN resources r ON r.tenant_id = b.tenant_id AND r.key = b.resource_key
                 WHERE r.buckets > 1
                 GROUP BY b.tenant_id, b.resource_key HAVING MAX(b.available) - MIN(b.available) > 1
                 LIMIT ?1",
            )?
            .query_map(params![i64::from(limit)], |row| Ok((row.get(0)?, row.get(1)?)))?
            .collect::<rusqlite::Result<_>>()?)
    }

    async fn take_limit(&mut self, tenant: &str, limit: &LimitSpec, qty: i64) -> Result<bool, StorageError> {
        let changed = self
            .conn
            .prepare_cached(
                "INSERT INTO user_limits (tenant_id, key, used) VALUES (?1, ?2, ?3)
                 ON CONFLICT (tenant_id, key) DO UPDATE SET used = used + excluded.used
                 WHERE used + excluded.used <= ?4",
            )?
            .execute(params![tenant, limit.key.as_str(), qty, limit.max])?;
        Ok(changed == 1)
    }

    async fn give_back_limit(&mut self, tenant: &str, key: &str, qty: i64) -> Result<(), StorageError> {
        self.conn
            .prepare_cached("UPDATE user_limits SET used = used - ?1 WHERE tenant_id = ?2 AND key = ?3 AND used >= ?1")?
            .execute(params![qty, tenant, key])?;
        Ok(())
    }

    async fn insert_reservation(&mut self, r: &NewReservation) -> Result<(), StorageError> {
        self.conn.prepare_cached(INSERT_RESERVATION)?.execute(params![
            r.tenant,
            r.id,
            r.order_id,
            r.lines,
            r.expires_at,
            r.created_at
        ])?;
        Ok(())
    }

    async fn reservation(&mut self, tenant: &str, id: &str) -> Result<Option<Reservation>, StorageError> {
        self.conn
            .prepare_cached(
                "SELECT id, order_id, state, lines, expires_at FROM reservations WHERE tenant_id = ?1 AND id = ?2",
            )?
            .query_row(params![tenant, id], mapped(rows::reservation))
            .optional()?
            .transpose()
    }

    async fn held_reservations(&mut self, tenant: &str, limit: u32) -> Result<Vec<Reservation>, StorageError> {
        let mut statement = self.conn.prepare_cached(rows::HELD_RESERVATIONS_SQL)?;
        all(&mut statement, params![tenant, i64::from(limit)], rows::reservation)
    }

    async fn leave_held(
        &mut self,
        tenant: &str,
        id: &str,
        to: ReservationState,
        now_ms: i64,
    ) -> Result<bool, StorageError> {
        let moved = self.conn.prepare_cached(MOVE_RESERVATION)?.execute(params![to.as_str(), now_ms, tenant, id])?;
        Ok(moved == 1)
    }

    /// The only writer holds every row already.
    async fn lock_reservations(&mut self, wanted: &[(&str, &str)]) -> Result<Vec<Option<Reservation>>, StorageError> {
        let mut found = Vec::with_capacity(wanted.len());
        for (tenant, id) in wanted {
            found.push(self.reservation(tenant, id).await?);
        }
        Ok(found)
    }

    async fn due_reservations(&mut self, now_ms: i64, limit: u32) -> Result<Vec<(String, Reservation)>, StorageError> {
        let due: Vec<(String, Result<Reservation, StorageError>)> = self
            .conn
            .prepare_cached(
                "SELECT tenant_id, id, order_id, state, lines, expires_at FROM reservations
                 WHERE state = 'held' AND expires_at <= ?1 ORDER BY expires_at LIMIT ?2",
            )?
            .query_map(params![now_ms, i64::from(limit)], |row| Ok((row.get(0)?, rows::reservation(row))))?
            .collect::<rusqlite::Result<_>>()?;
        due.into_iter().map(|(tenant, r)| Ok((tenant, r?))).collect()
    }

    async fn claim_settlement(
        &mut self,
        tenant: &str,
        key: &str,
        request_id: &str,
        now_ms: i64,
    ) -> Result<bool, StorageError> {
        let claimed = self
            .conn
            .prepare_cached(
                "INSERT INTO redis_settled (tenant_id, resource_key, request_id, at) VALUES (?1, ?2, ?3, ?4)
                 ON CONFLICT DO NOTHING",
            )?
            .execute(params![tenant, key, request_id, now_ms])?;
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
        self.conn
            .prepare_cached(
                "INSERT INTO settlement_failures (tenant_id, resource_key, request_id, order_id, idempotency_key,
                                                  qty, reason, available, at, reservation_id)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10) ON CONFLICT DO NOTHING",
            )?
            .execute(params![r.t, r.k, r.rid, r.oid, r.idem, qty, reason, available, now_ms, r.rsv])?;
        Ok(())
    }

    async fn refused_reservation(&mut self, tenant: &str, id: &str) -> Result<Option<i64>, StorageError> {
        Ok(self
            .conn
            .prepare_cached(&REFUSED_RESERVATION_SQL.replace('$', "?"))?
            .query_row(params![tenant, id], |row| row.get::<_, i64>(0))
            .optional()?)
    }

    async fn count_limit(&mut self, tenant: &str, key: &str, qty: i64) -> Result<(), StorageError> {
        self.conn
            .prepare_cached(
                "INSERT INTO user_limits (tenant_id, key, used) VALUES (?1, ?2, ?3)
                 ON CONFLICT (tenant_id, key) DO UPDATE SET used = used + excluded.used",
            )?
            .execute(params![tenant, key, qty])?;
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
        insert_outcome(
            self.conn,
            &mut self.conn.prepare_cached(INSERT_OUTCOME)?,
            params![
                tenant,
                key,
                stored_hash(request_hash),
                i64::from(response.status),
                response.content_type.as_str(),
                body,
                event,
                at,
                None::<i64>
            ],
            tenant,
            key,
        )
    }

    async fn claim_keys(
        &mut self,
        keys: &[(&TenantId, &IdempotencyRequest)],
        _now_ms: i64,
    ) -> Result<Vec<Claim>, StorageError> {
        keys.iter().map(|(tenant, idem)| Ok(self.lookup(tenant, idem)?.map_or(Claim::Ours, Claim::Answered))).collect()
    }

    async fn write_batch(&mut self, w: &BatchWrites) -> Result<(), StorageError> {
        for row in &w.rows {
            // `stock` is set only when the band moved: an UPDATE that sets it costs SQLite ~8 %
            // more instructions per order under `uniform` (callgrind), even to the same value.
            let band = row.stock.map(|b| b.as_str());
            let mut values: Vec<&dyn rusqlite::ToSql> = vec![
                &row.after.available,
                &row.after.reserved,
                &row.after.consumed,
                &row.after.version,
                &row.at,
                &row.tenant,
                &row.key,
                &row.read_version,
            ];
            let sql = match &band {
                None => {
                    "UPDATE resources SET available = ?1, reserved = ?2, consumed = ?3, version = ?4,
                                          updated_at = COALESCE(?5, updated_at)
                     WHERE tenant_id = ?6 AND key = ?7 AND version = ?8"
                }
                Some(band) => {
                    values.push(band);
                    "UPDATE resources SET available = ?1, reserved = ?2, consumed = ?3, version = ?4,
                                          updated_at = COALESCE(?5, updated_at), stock = ?9
                     WHERE tenant_id = ?6 AND key = ?7 AND version = ?8"
                }
            };
            let written = self.conn.prepare_cached(sql)?.execute(values.as_slice())?;
            if written != 1 {
                return Err(StorageError::Internal(format!("resource {} changed under the writer", row.key)));
            }
        }
        if !w.buckets.is_empty() {
            let mut buckets = self.conn.prepare_cached(
                "UPDATE resource_buckets SET available = ?1, reserved = ?2, consumed = ?3, version = ?4, updated_at = ?5
                 WHERE tenant_id = ?6 AND resource_key = ?7 AND bucket = ?8 AND version = ?9",
            )?;
            for b in &w.buckets {
                let (after, key) = (&b.after, &b.key);
                let written = buckets.execute(params![
                    after.available,
                    after.reserved,
                    after.consumed,
                    after.version,
                    b.at,
                    b.tenant,
                    key,
                    b.bucket,
                    b.read_version
                ])?;
                if written != 1 {
                    return Err(StorageError::Internal(format!(
                        "bucket {} of {key} changed under the writer",
                        b.bucket
                    )));
                }
            }
        }
        // An order whose id is the key its own request's record is stored under is found through
        // that record (migrations/sqlite/0022): its entries skip `ledger_by_order`, and the record
        // keeps the `seq` of the first.
        let keyed: HashMap<(&str, &str), &str> = w
            .outcomes
            .iter()
            .filter_map(|o| Some(((o.tenant.as_str(), o.key.as_str()), o.request_id.as_deref()?)))
            .collect();
        let mut first_by_key: HashMap<(&str, &str), i64> = HashMap::new();
        // Each statement looked up once for the batch: `prepare_cached` hashes its SQL text at
        // every call and again when the statement goes back to the cache.
        let mut ledger = self.conn.prepare_cached(INSERT_LEDGER)?;
        for l in &w.ledger {
            let entry = Entry {
                tenant: &l.tenant,
                resource: &l.resource,
                bucket: l.bucket,
                op: l.op,
                qty: l.qty,
                request_id: &l.request_id,
                order_id: Some(&l.order_id),
                reservation_id: l.reservation_id.as_deref(),
                plugin_version: l.plugin_version,
                at: l.at,
                line_key: Some(&l.line_key),
                limit_key: l.limit_key.as_deref(),
                reverses: None,
            };
            let order = (l.tenant.as_str(), l.order_id.as_str());
            let by_key = keyed.get(&order) == Some(&l.request_id.as_str());
            insert_ledger(&mut ledger, &entry, l.after, by_key)?;
            if by_key {
                first_by_key.entry(order).or_insert_with(|| self.conn.last_insert_rowid());
            }
        }
        drop(ledger);
        for r in &w.reservations {
            self.insert_reservation(r).await?;
        }
        for m in &w.moves {
            if !self.leave_held(&m.tenant, &m.id, m.to, m.at).await? {
                return Err(StorageError::Internal(format!("reservation {} left held under the writer", m.id)));
            }
        }
        let mut answers = self.conn.prepare_cached(INSERT_OUTCOME)?;
        for o in &w.outcomes {
            let (body, event) = body_columns(&o.response, o.event.as_deref());
            let ledger_seq = first_by_key.get(&(o.tenant.as_str(), o.key.as_str())).copied();
            let values = params![
                o.tenant,
                o.key,
                stored_hash(&o.request_hash),
                i64::from(o.response.status),
                o.response.content_type.as_str(),
                body,
                event,
                o.at,
                ledger_seq
            ];
            if !insert_outcome(self.conn, &mut answers, values, &o.tenant, &o.key)? {
                return Err(key_taken(&o.key));
            }
        }
        // A run of one tenant's events takes its numbers with one bump of its sequence.
        let mut rest = w.events.as_slice();
        while let Some(first) = rest.first() {
            let run = rest.iter().take_while(|e| e.tenant == first.tenant).count();
            self.write_events(&rest[..run])?;
            rest = &rest[run..];
        }
        Ok(())
    }

    async fn emit(&mut self, e: &NewEvent) -> Result<(), StorageError> {
        self.write_events(std::slice::from_ref(e))
    }

    async fn stock(&mut self, tenant: &str, key: &str) -> Result<Option<Stock>, StorageError> {
        let row = self
            .conn
            .prepare_cached(
                "SELECT CASE WHEN buckets = 1 THEN available ELSE
                          (SELECT COALESCE(SUM(b.available), 0) FROM resource_buckets b
                           WHERE b.tenant_id = r.tenant_id AND b.resource_key = r.key) END,
                        low_stock, stock
                 FROM resources r WHERE tenant_id = ?1 AND key = ?2",
            )?
            .query_row(params![tenant, key], |row| {
                Ok((row.get::<_, i64>(0)?, row.get::<_, Option<i64>>(1)?, row.get::<_, String>(2)?))
            })
            .optional()?;
        let Some((available, low_stock, band)) = row else { return Ok(None) };
        let band = StockBand::from_db(&band).ok_or_else(|| corrupt("resources.stock"))?;
        Ok(Some(Stock { available, low_stock, band }))
    }

    async fn set_low_stock(
        &mut self,
        tenant: &str,
        key: &str,
        low_stock: Option<i64>,
        now_ms: i64,
    ) -> Result<bool, StorageError> {
        let n = self
            .conn
            .prepare_cached("UPDATE resources SET low_stock = ?1, updated_at = ?2 WHERE tenant_id = ?3 AND key = ?4")?
            .execute(params![low_stock, now_ms, tenant, key])?;
        Ok(n == 1)
    }

    async fn set_stock(&mut self, tenant: &str, key: &str, band: StockBand) -> Result<(), StorageError> {
        self.conn
            .prepare_cached("UPDATE resources SET stock = ?1 WHERE tenant_id = ?2 AND key = ?3")?
            .execute(params![band.as_str(), tenant, key])?;
        Ok(())
    }

    async fn order_entries(
        &mut self,
        tenant: &str,
        order_id: &str,
        limit: u32,
    ) -> Result<Vec<OrderEntries>, StorageError> {
        let mut statement = self.conn.prepare_cached(ORDER_ENTRIES)?;
        all(&mut statement, params![tenant, order_id, i64::from(limit)], rows::order_entries)
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
        let counted = self
            .conn
            .prepare_cached(&rows::TAKE_REVERSAL_SQL.replace('$', "?"))?
            .execute(params![tenant, order_id, resource, bucket, taken, qty, now_ms])?;
        Ok(counted == 1)
    }

    async fn advance_checkpoints(&mut self, checkpoints: &[Checkpoint]) -> Result<(), StorageError> {
        let mut statement = self.conn.prepare_cached(ADVANCE_CHECKPOINT)?;
        for c in checkpoints {
            let n = &c.counters;
            statement.execute(params![
                c.tenant,
                c.key,
                c.bucket,
                n.version,
                n.available,
                n.reserved,
                n.consumed,
                n.total,
                c.seq
            ])?;
        }
        Ok(())
    }

    async fn forget_checkpoints(&mut self, which: &[(String, String, i64)]) -> Result<(), StorageError> {
        let mut statement = self.conn.prepare_cached(
            "DELETE FROM ledger_checkpoints WHERE tenant_id = ?1 AND resource_key = ?2 AND bucket = ?3",
        )?;
        for (tenant, key, bucket) in which {
            statement.execute(params![tenant, key, bucket])?;
        }
        Ok(())
    }
}

/// A checkpoint replaces the stored one unless that one is newer (a slower pass of another
/// process, or of this one, must not move it back).
const ADVANCE_CHECKPOINT: &str =
    "INSERT INTO ledger_checkpoints (tenant_id, resource_key, bucket, version, available, reserved, consumed, total,
                                     seq)
     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)
     ON CONFLICT (tenant_id, resource_key, bucket) DO UPDATE SET version = excluded.version,
         available = excluded.available, reserved = excluded.reserved, consumed = excluded.consumed,
         total = excluded.total, seq = excluded.seq
     WHERE excluded.version >= ledger_checkpoints.version";

impl Reads for SqlitePort<'_> {
    async fn resources_page(
        &mut self,
        tenant: &str,
        prefix: &str,
        after: &str,
        limit: u32,
    ) -> Result<Vec<ResourceState>, StorageError> {
        // Keys are [A-Za-z0-9._:@-], so a prefix range needs no LIKE escaping: every key with
        // the prefix sorts in [prefix, prefix || char(0x7f)); SQLite compares bytewise.
        let mut statement = self.conn.prepare_cached(&format!(
            "SELECT {RESOURCE_COLUMNS} FROM resources
             WHERE tenant_id = ?1 AND key >= ?2 AND key < ?3 AND key > ?4 ORDER BY key LIMIT ?5"
        ))?;
        let end = format!("{prefix}\u{7f}");
        all(&mut statement, params![tenant, prefix, end, after, i64::from(limit)], rows::resource)
    }

    async fn buckets_of(
        &mut self,
        tenant: &str,
        keys: &[String],
    ) -> Result<HashMap<(String, String), Vec<BucketCounts>>, StorageError> {
        let mut statement = self.conn.prepare_cached(&format!(
            "SELECT {BUCKET_COLUMNS} FROM resource_buckets WHERE tenant_id = ?1 AND resource_key = ?2 ORDER BY bucket"
        ))?;
        let mut found = Vec::new();
        for key in keys {
            found.extend(all(&mut statement, params![tenant, key], rows::bucket)?);
        }
        Ok(rows::group_buckets(found))
    }

    async fn ledger_entries(
        &mut self,
        tenant: &str,
        key: &str,
        from: PageFrom,
        limit: u32,
    ) -> Result<Vec<LedgerEntry>, StorageError> {
        let (after, order) = from.bounds();
        let mut statement = self.conn.prepare_cached(&format!(
            "SELECT {LEDGER_COLUMNS} FROM ledger WHERE tenant_id = ?1 AND resource_key = ?2 AND seq > ?3
             ORDER BY seq {order} LIMIT ?4"
        ))?;
        all(&mut statement, params![tenant, key, after, i64::from(limit)], rows::ledger_entry)
    }

    async fn limit_used(&mut self, tenant: &str, key: &str) -> Result<i64, StorageError> {
        let used: Option<i64> = self
            .conn
            .prepare_cached("SELECT used FROM user_limits WHERE tenant_id = ?1 AND key = ?2")?
            .query_row(params![tenant, key], |row| row.get(0))
            .optional()?;
        Ok(used.unwrap_or(0))
    }

    async fn held_among(&mut self, tenant: &str, ids: &[String]) -> Result<HashSet<String>, StorageError> {
        let mut statement = self
            .conn
            .prepare_cached("SELECT 1 FROM reservations WHERE tenant_id = ?1 AND id = ?2 AND state = 'held'")?;
        let mut held = HashSet::new();
        for id in ids {
            if statement.exists(params![tenant, id])? {
                held.insert(id.clone());
            }
        }
        Ok(held)
    }

    async fn ledger_rows(&mut self, tenant: Option<&str>, pass: Pass) -> Result<LedgerRows, StorageError> {
        let [resources, checkpoints, sums, newest, buckets] = ledger_rows_sql(tenant.is_some(), pass);
        // One tenant's reconciliation reads its own rows only (through the tenant-first keys);
        // `?1 IS NULL OR tenant_id = ?1` would scan every tenant's ledger.
        let bind: Vec<&str> = tenant.into_iter().collect();
        let params = rusqlite::params_from_iter(bind.iter());
        let mut statement = self.conn.prepare_cached(&resources)?;
        let resources = all(&mut statement, params.clone(), |row| Ok((row.text("tenant_id")?, rows::resource(row)?)))?;
        let checkpoints = all(&mut self.conn.prepare_cached(&checkpoints)?, params.clone(), rows::checkpoint)?;
        let sums = all(&mut self.conn.prepare_cached(&sums)?, params.clone(), rows::ledger_sum)?;
        let newest = all(&mut self.conn.prepare_cached(&newest)?, params.clone(), rows::newest_entry)?;
        let buckets = rows::group_buckets(all(&mut self.conn.prepare_cached(&buckets)?, params, rows::bucket)?);
        Ok(LedgerRows { resources, checkpoints, sums, newest, buckets })
    }
}

/// The five queries of reconciliation: resources, checkpoints, per-op ledger sums, newest
/// entries, buckets; for one tenant (`?1`) or for all. The ledger is read per resource (bucket)
/// as one range of `ledger_by_resource`: after its checkpoint's `seq` in an incremental pass,
/// from the start in a full one.
fn ledger_rows_sql(one_tenant: bool, pass: Pass) -> [String; 5] {
    let only = if one_tenant { "WHERE tenant_id = ?1" } else { "" };
    let targets = rows::reconciliation_targets(one_tenant.then_some("?1"), pass);
    [
        format!("SELECT tenant_id, {RESOURCE_COLUMNS} FROM resources {only} ORDER BY tenant_id, key"),
        format!("SELECT {CHECKPOINT_COLUMNS} FROM ledger_checkpoints {only}"),
        format!(
            "{targets}
             SELECT w.tenant_id, w.resource_key, w.bucket, l.op, SUM(l.qty) AS qty, COUNT(*) AS n
             FROM w JOIN ledger l
               ON l.tenant_id = w.tenant_id AND l.resource_key = w.resource_key AND l.seq > w.since
              AND l.bucket = w.bucket
             GROUP BY w.tenant_id, w.resource_key, w.bucket, l.op"
        ),
        format!(
            "{targets}
             SELECT w.tenant_id, w.resource_key, w.bucket, l.seq, l.available_after, l.reserved_after,
                    l.consumed_after
             FROM w JOIN ledger l ON l.seq = (
                 SELECT x.seq FROM ledger x
                 WHERE x.tenant_id = w.tenant_id AND x.resource_key = w.resource_key AND x.seq > w.since
                   AND x.bucket = w.bucket
                 ORDER BY x.seq DESC LIMIT 1)"
        ),
        format!("SELECT {BUCKET_COLUMNS} FROM resource_buckets {only} ORDER BY tenant_id, resource_key, bucket"),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Proves one tenant's reconciliation reads only that tenant's rows: SQLite's plan for each
    /// of its queries searches by the tenant-first keys and scans no table whole.
    #[test]
    fn one_tenants_reconciliation_reads_through_the_tenant_keys() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let mut conn = Connection::open(dir.path().join("plan.db")).expect("a database");
        super::super::migrate::run(&mut conn).expect("migrations");
        for sql in ledger_rows_sql(true, Pass::Incremental).into_iter().chain(ledger_rows_sql(true, Pass::Full)) {
            let mut explain = conn.prepare(&format!("EXPLAIN QUERY PLAN {sql}")).expect("explain");
            let plan: Vec<String> = explain
                .query_map(params!["shop"], |row| row.get::<_, String>(3))
                .expect("plan rows")
                .collect::<rusqlite::Result<_>>()
                .expect("plan");
            // `SCAN <table>` reads a whole table; `SCAN m` reads the subquery's own result.
            let tables = ["resources", "ledger", "l", "resource_buckets"];
            let whole = plan.iter().find(|step| {
                step.strip_prefix("SCAN ").is_some_and(|t| tables.contains(&t.split(' ').next().unwrap_or("")))
            });
            assert!(whole.is_none(), "{sql}\nscans a whole table: {plan:?}");
        }
    }

    mod by_key {
        use super::*;
        use crate::apply::port::{run_now, LedgerRow, Outcome};
        use crate::engine::{IdempotencyKey, LedgerOp};
        use crate::storage::{ContentType, StoredResponse};

        fn migrated() -> (tempfile::TempDir, Connection) {
            let dir = tempfile::tempdir().expect("a temporary directory");
            let mut conn = Connection::open(dir.path().join("by-key.db")).expect("a database");
            super::super::super::migrate::run(&mut conn).expect("migrations");
            (dir, conn)
        }

        /// An order of a test batch: key, order id, request id, lines as (resource, qty).
        type TestOrder<'a> = (&'a str, &'a str, &'a str, &'a [(&'a str, i64)]);

        /// A batch of orders, written at `at`.
        fn batch(orders: &[TestOrder<'_>], at: i64) -> BatchWrites {
            let mut w = BatchWrites::default();
            for (key, order, request, lines) in orders {
                for (resource, qty) in lines.iter() {
                    w.ledger.push(LedgerRow {
                        tenant: "shop".into(),
                        resource: (*resource).into(),
                        bucket: 0,
                        line_key: (*resource).into(),
                        limit_key: None,
                        op: LedgerOp::Deduct,
                        qty: *qty,
                        request_id: (*request).into(),
                        order_id: (*order).into(),
                        reservation_id: None,
                        after: Counts { available: 0, reserved: 0, consumed: *qty, version: 1 },
                        plugin_version: Some(1),
                        at,
                    });
                }
                w.outcomes.push(Outcome {
                    tenant: "shop".into(),
                    key: (*key).into(),
                    request_hash: "ab".repeat(16),
                    response: StoredResponse {
                        status: 201,
                        content_type: ContentType::Json,
                        body: format!("{{\"order_id\":\"{order}\"}}"),
                    },
                    event: None,
                    request_id: Some((*request).into()),
                    at,
                });
            }
            w
        }

        /// An order's entries as reversals and `GET /v1/orders/{id}` read them: (resource, qty).
        fn entries(conn: &Connection, order: &str) -> Vec<(String, i64)> {
            let found = run_now(SqlitePort::new(conn).order_entries("shop", order, 100)).expect("entries");
            found.into_iter().map(|e| (e.resource, e.qty)).collect()
        }

        fn answers(conn: &Connection, key: &str) -> bool {
            let idem =
                IdempotencyRequest { key: IdempotencyKey::parse(key).expect("a key"), request_hash: "ab".repeat(32) };
            SqlitePort::new(conn).lookup(&TenantId::parse("shop").expect("a tenant"), &idem).expect("lookup").is_some()
        }

        fn count(conn: &Connection, sql: &str) -> i64 {
            conn.query_row(sql, [], |r| r.get(0)).expect("count")
        }

        /// An order whose id is its key writes no `ledger_by_order` entry and is found through
        /// its record; past the record's retention through its stub, which answers nothing; and
        /// once a new request takes the key, through `ledger_by_order` again, beside the new
        /// order's entries.
        #[test]
        fn an_order_whose_id_is_its_key_is_found_through_its_record_its_stub_and_after_the_key_moves_on() {
            let (_dir, conn) = migrated();
            let w = batch(
                &[("ord-a", "ord-a", "req_a", &[("r1", 2), ("r2", 3)]), ("k-b", "ord-b", "req_b", &[("r1", 1)])],
                100,
            );
            run_now(SqlitePort::new(&conn).write_batch(&w)).expect("the batch");
            assert_eq!(count(&conn, "SELECT COUNT(*) FROM ledger WHERE by_key = 1 AND order_id = 'ord-a'"), 2);
            assert_eq!(
                count(&conn, "SELECT COUNT(*) FROM ledger INDEXED BY ledger_by_order WHERE tenant_id = 'shop' AND order_id IS NOT NULL AND by_key IS NULL"),
                1,
                "only the order whose id is not its key is in ledger_by_order"
            );
            assert_eq!(entries(&conn, "ord-a"), vec![("r1".into(), 2), ("r2".into(), 3)]);
            assert_eq!(entries(&conn, "ord-b"), vec![("r1".into(), 1)]);
            assert!(entries(&conn, "k-b").is_empty(), "a key that is not its order's id finds nothing");

            // Past their retention: the record that finds ord-a becomes a stub, k-b's goes.
            assert_eq!(super::super::super::ops::purge_idempotency(&conn, 1_000, 100).expect("purge"), 2);
            assert_eq!(count(&conn, "SELECT COUNT(*) FROM idempotency"), 1);
            assert_eq!(
                count(&conn, "SELECT COUNT(*) FROM idempotency WHERE key = 'ord-a' AND response_code IS NULL"),
                1
            );
            assert!(!answers(&conn, "ord-a"), "a stub answers nothing: the key is free");
            assert_eq!(entries(&conn, "ord-a"), vec![("r1".into(), 2), ("r2".into(), 3)]);
            assert_eq!(super::super::super::ops::purge_idempotency(&conn, 1_000, 100).expect("purge"), 0, "stubs stay");

            // A new order takes the key (and the order id) again.
            let w = batch(&[("ord-a", "ord-a", "req_c", &[("r1", 4)])], 2_000);
            run_now(SqlitePort::new(&conn).write_batch(&w)).expect("the second batch");
            assert!(answers(&conn, "ord-a"));
            assert_eq!(
                count(&conn, "SELECT COUNT(*) FROM ledger WHERE order_id = 'ord-a' AND by_key IS NULL"),
                2,
                "the first order's entries are back in ledger_by_order"
            );
            assert_eq!(count(&conn, "SELECT COUNT(*) FROM ledger WHERE order_id = 'ord-a' AND by_key = 1"), 1);
            assert_eq!(entries(&conn, "ord-a"), vec![("r1".into(), 6), ("r2".into(), 3)]);
        }

        /// The purge takes the oldest records first whether they become stubs or go, `limit` of
        /// them a call, and reports each.
        #[test]
        fn the_purge_takes_the_oldest_records_whether_stubbed_or_deleted() {
            let (_dir, conn) = migrated();
            for (i, (key, order)) in [("a", "a"), ("x", "b"), ("c", "c"), ("y", "d"), ("e", "e")].iter().enumerate() {
                let request = format!("req_{i}");
                let w = batch(&[(key, order, request.as_str(), &[("r1", 1)])], 100 + i as i64);
                run_now(SqlitePort::new(&conn).write_batch(&w)).expect("a batch");
            }
            let purge = |limit| super::super::super::ops::purge_idempotency(&conn, 103, limit).expect("purge");
            assert_eq!(purge(2), 2);
            assert_eq!(count(&conn, "SELECT COUNT(*) FROM idempotency WHERE key IN ('a', 'x')"), 1, "a stub, x gone");
            assert_eq!(purge(2), 1, "only c is older than 103 and left");
            assert_eq!(count(&conn, "SELECT COUNT(*) FROM idempotency WHERE response_code IS NULL"), 2);
            assert_eq!(count(&conn, "SELECT COUNT(*) FROM idempotency WHERE response_code IS NOT NULL"), 2);
            for order in ["a", "b", "c", "d", "e"] {
                assert_eq!(entries(&conn, order), vec![("r1".into(), 1)], "{order}");
            }
        }

        /// Reading an order's entries searches both ways by key and scans no table.
        #[test]
        fn an_orders_entries_are_read_by_key_both_ways() {
            let (_dir, conn) = migrated();
            let mut explain = conn.prepare(&format!("EXPLAIN QUERY PLAN {ORDER_ENTRIES}")).expect("explain");
            let plan: Vec<String> = explain
                .query_map(params!["shop", "ord-a", 10], |row| row.get::<_, String>(3))
                .expect("plan rows")
                .collect::<rusqlite::Result<_>>()
                .expect("plan");
            let has = |what: &str| plan.iter().any(|step| step.starts_with("SEARCH") && step.contains(what));
            assert!(has("ledger_by_order (tenant_id=? AND order_id=?)"), "{plan:?}");
            assert!(has("ledger_identity (tenant_id=? AND request_id=?)"), "{plan:?}");
            assert!(has("i USING PRIMARY KEY (tenant_id=? AND key=?)"), "{plan:?}");
            assert!(has("f USING INTEGER PRIMARY KEY (rowid=?)"), "{plan:?}");
            let tables = ["ledger", "l", "f", "i", "idempotency"];
            let whole = plan.iter().find(|step| {
                step.strip_prefix("SCAN ").is_some_and(|t| tables.contains(&t.split(' ').next().unwrap_or("")))
            });
            assert!(whole.is_none(), "scans a whole table: {plan:?}");
        }

        /// The purge walks `idempotency_by_age`, where stubs are not, from its oldest entry.
        #[test]
        fn the_purge_walks_the_records_by_age() {
            let (_dir, conn) = migrated();
            let sql = super::super::super::ops::OLDEST_RECORDS;
            let mut explain = conn.prepare(&format!("EXPLAIN QUERY PLAN {sql}")).expect("explain");
            let plan: Vec<String> = explain
                .query_map(params![1_000, 10], |row| row.get::<_, String>(3))
                .expect("plan rows")
                .collect::<rusqlite::Result<_>>()
                .expect("plan");
            // One step: no temporary b-tree for the ORDER BY, no scan.
            assert_eq!(plan.len(), 1, "{plan:?}");
            assert!(plan[0].starts_with("SEARCH idempotency USING"), "{plan:?}");
            assert!(plan[0].contains("INDEX idempotency_by_age (created_at<?)"), "{plan:?}");
        }

        /// Settlement's records (stored if absent) take a stub's key as any other record does.
        #[test]
        fn a_record_stored_if_absent_takes_a_stubs_key() {
            let (_dir, conn) = migrated();
            let w = batch(&[("ord-a", "ord-a", "req_a", &[("r1", 2)])], 100);
            run_now(SqlitePort::new(&conn).write_batch(&w)).expect("the batch");
            super::super::super::ops::purge_idempotency(&conn, 1_000, 100).expect("purge");
            let response = StoredResponse { status: 201, content_type: ContentType::Json, body: "{}".into() };
            let mut port = SqlitePort::new(&conn);
            let hash = "cd".repeat(32);
            assert!(
                run_now(port.store_outcome_if_absent("shop", "ord-a", &hash, &response, None, 3_000)).expect("store")
            );
            assert!(
                !run_now(port.store_outcome_if_absent("shop", "ord-a", &hash, &response, None, 3_000)).expect("again")
            );
            assert_eq!(entries(&conn, "ord-a"), vec![("r1".into(), 2)]);
        }
    }

    /// The steps of SQLite's plan for `sql` with the tenant bound to `?1`.
    fn plan_of(conn: &Connection, sql: &str) -> Vec<String> {
        let mut explain = conn.prepare(&format!("EXPLAIN QUERY PLAN {sql}")).expect("explain");
        explain
            .query_map(params!["shop"], |row| row.get::<_, String>(3))
            .expect("plan rows")
            .collect::<rusqlite::Result<_>>()
            .expect("plan")
    }

    /// Proves an incremental pass reads each resource's (bucket's) ledger from its checkpoint
    /// on: SQLite searches the ledger (for the sums and for the newest entry) only as a range of
    /// `ledger_by_resource` after the watermark, `seq>?`, never the whole ledger of a resource or
    /// of the tenant.
    #[test]
    fn an_incremental_pass_reads_the_ledger_after_each_watermark_only() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let mut conn = Connection::open(dir.path().join("plan.db")).expect("a database");
        super::super::migrate::run(&mut conn).expect("migrations");
        let [_, _, sums, newest, _] = ledger_rows_sql(true, Pass::Incremental);
        for sql in [sums, newest] {
            let plan = plan_of(&conn, &sql);
            // `SEARCH l ...`, `SCAN x ...`: the steps that read the ledger (aliased `l` and `x`).
            let ledger: Vec<&String> =
                plan.iter().filter(|step| matches!(step.split(' ').nth(1), Some("l" | "x"))).collect();
            assert!(!ledger.is_empty(), "{sql}\nreads no ledger: {plan:?}");
            for step in &ledger {
                let ranged =
                    step.starts_with("SEARCH") && step.contains("ledger_by_resource") && step.contains("seq>?");
                let by_seq = step.contains("INTEGER PRIMARY KEY (rowid=?)");
                assert!(ranged || by_seq, "{sql}\nreads the ledger otherwise than after the watermark: {plan:?}");
            }
        }
    }
}

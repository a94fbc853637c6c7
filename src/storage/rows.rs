//! Row mapping, written once for both backends: [`Columns`] reads a result row of either driver
//! (sqlx's PostgreSQL rows, rusqlite's SQLite rows) by column name, and every mapper below is
//! written against it. Anything unexpected in a stored value is `Internal`, never a panic.

use std::collections::HashMap;

use crate::apply::port::Counts;
use crate::engine::{
    BucketCounts, Checkpoint, Counters, Kind, LedgerEntry, LedgerOp, LedgerSum, Mode, NewestEntry, Pass, Reservation,
    ReservationState, ResourceState, ResourceStatus, TenantId,
};
use crate::ratelimit::RateLimit;
use crate::storage::redis_store::{DeadLetter, SettlementFailure};
use crate::storage::{ApiKeyRecord, PluginVersion, StorageError, TenantRecord};
use crate::time::Timestamp;

/// A result row, read by column name.
pub trait Columns {
    fn int(&self, col: &str) -> Result<i64, StorageError>;
    fn opt_int(&self, col: &str) -> Result<Option<i64>, StorageError>;
    fn text(&self, col: &str) -> Result<String, StorageError>;
    fn opt_text(&self, col: &str) -> Result<Option<String>, StorageError>;
    fn flag(&self, col: &str) -> Result<bool, StorageError>;
}

impl Columns for sqlx::postgres::PgRow {
    fn int(&self, col: &str) -> Result<i64, StorageError> {
        Ok(sqlx::Row::try_get(self, col)?)
    }
    fn opt_int(&self, col: &str) -> Result<Option<i64>, StorageError> {
        Ok(sqlx::Row::try_get(self, col)?)
    }
    fn text(&self, col: &str) -> Result<String, StorageError> {
        Ok(sqlx::Row::try_get(self, col)?)
    }
    fn opt_text(&self, col: &str) -> Result<Option<String>, StorageError> {
        Ok(sqlx::Row::try_get(self, col)?)
    }
    fn flag(&self, col: &str) -> Result<bool, StorageError> {
        Ok(sqlx::Row::try_get(self, col)?)
    }
}

impl Columns for rusqlite::Row<'_> {
    fn int(&self, col: &str) -> Result<i64, StorageError> {
        Ok(self.get(col)?)
    }
    fn opt_int(&self, col: &str) -> Result<Option<i64>, StorageError> {
        Ok(self.get(col)?)
    }
    fn text(&self, col: &str) -> Result<String, StorageError> {
        Ok(self.get(col)?)
    }
    fn opt_text(&self, col: &str) -> Result<Option<String>, StorageError> {
        Ok(self.get(col)?)
    }
    fn flag(&self, col: &str) -> Result<bool, StorageError> {
        Ok(self.get::<_, i64>(col)? != 0)
    }
}

fn corrupt(what: &str) -> StorageError {
    StorageError::Internal(format!("unexpected stored value in {what}"))
}

/// The resource columns every backend selects, in any order.
pub const RESOURCE_COLUMNS: &str =
    "key, kind, status, available, reserved, consumed, total, buckets, mode, low_stock, mode_epoch, version, updated_at";

/// The event columns every server-database backend selects.
pub const EVENT_COLUMNS: &str = "id, tenant_id, seq, type, ordering_key, at, data";

/// An event selected as [`EVENT_COLUMNS`]; committed events are always numbered.
pub fn event(row: &dyn Columns) -> Result<crate::events::Event, StorageError> {
    Ok(crate::events::Event {
        id: row.text("id")?,
        tenant: row.text("tenant_id")?,
        seq: row.opt_int("seq")?.ok_or_else(|| StorageError::Internal("an unnumbered event was read".into()))?,
        kind: row.text("type")?,
        ordering_key: row.text("ordering_key")?,
        at: row.int("at")?,
        data: super::payload::unpack(row.text("data")?)?,
    })
}

/// A result row read by position, its text borrowed: for the batch's locking read, whose rows
/// (a `multi-line` batch's hundreds) cost ~7,700 instructions each read by name into owned
/// strings (a column's name hashed, its type checked, a `String` allocated), an eighth of the
/// server's instructions per order on PostgreSQL (docs/PERFORMANCE.md, eleventh session).
pub trait ByPosition {
    fn int_at(&self, i: usize) -> Result<i64, StorageError>;
    fn opt_int_at(&self, i: usize) -> Result<Option<i64>, StorageError>;
    /// Text as the row holds it; what it says is checked by whoever parses it.
    fn str_at(&self, i: usize) -> Result<&str, StorageError>;
}

/// sqlx's rows of either server database. Text unchecked: the type check compares the column's
/// type with each text type by name (and MySQL reports binary-collated identifiers as binary
/// strings, see [`Columns::text`]); the bytes are still checked as UTF-8.
macro_rules! by_position {
    ($($row:ty),+) => {$(
        impl ByPosition for $row {
            fn int_at(&self, i: usize) -> Result<i64, StorageError> {
                Ok(sqlx::Row::try_get(self, i)?)
            }
            fn opt_int_at(&self, i: usize) -> Result<Option<i64>, StorageError> {
                Ok(sqlx::Row::try_get(self, i)?)
            }
            fn str_at(&self, i: usize) -> Result<&str, StorageError> {
                Ok(sqlx::Row::try_get_unchecked(self, i)?)
            }
        }
    )+};
}
by_position!(sqlx::postgres::PgRow, sqlx::mysql::MySqlRow);

/// The rows of a batch's locking read, whose columns come in this order: `tenant_id, key, kind,
/// status, mode, buckets, available, reserved, consumed, version, low_stock, stock`; by tenant
/// and key, as admission reads them.
pub fn locked_rows<R: ByPosition>(rows: &[R]) -> Result<crate::apply::port::LockedRows, StorageError> {
    let mut locked = crate::apply::port::LockedRows::new();
    for row in rows {
        let parsed = crate::engine::admission::Row {
            kind: Kind::from_db(row.str_at(2)?).ok_or_else(|| corrupt("resources.kind"))?,
            active: row.str_at(3)? == ResourceStatus::Active.as_str(),
            redis: row.str_at(4)? == Mode::Redis.as_str(),
            buckets: row.int_at(5)?,
            available: row.int_at(6)?,
            reserved: row.int_at(7)?,
            consumed: row.int_at(8)?,
            version: row.int_at(9)?,
            low_stock: row.opt_int_at(10)?,
            stock: crate::events::StockBand::from_db(row.str_at(11)?).ok_or_else(|| corrupt("resources.stock"))?,
            bucket_rows: Vec::new(),
        };
        let tenant = row.str_at(0)?;
        let by_key = match locked.get_mut(tenant) {
            Some(by_key) => by_key,
            // Sized for the whole read: a batch's rows are nearly always one tenant's.
            None => locked.entry(tenant.to_owned()).or_insert_with(|| HashMap::with_capacity(rows.len())),
        };
        by_key.insert(row.str_at(1)?.to_owned(), parsed);
    }
    Ok(locked)
}

/// A resource selected as [`RESOURCE_COLUMNS`] (a bucketed one's buckets not folded in).
pub fn resource(row: &dyn Columns) -> Result<ResourceState, StorageError> {
    let kind = Kind::from_db(&row.text("kind")?).ok_or_else(|| corrupt("resources.kind"))?;
    let status = ResourceStatus::from_db(&row.text("status")?).ok_or_else(|| corrupt("resources.status"))?;
    let mode = Mode::from_db(&row.text("mode")?).ok_or_else(|| corrupt("resources.mode"))?;
    Ok(ResourceState {
        key: row.text("key")?,
        kind,
        status,
        available: row.int("available")?,
        reserved: row.int("reserved")?,
        consumed: row.int("consumed")?,
        total: row.int("total")?,
        buckets: row.int("buckets")?,
        mode,
        low_stock: row.opt_int("low_stock")?,
        mode_epoch: row.int("mode_epoch")?,
        version: row.int("version")?,
        updated_at: Timestamp(row.int("updated_at")?),
        bucket_counts: None,
    })
}

/// A row's `available, reserved, consumed, version`.
pub fn counts(row: &dyn Columns) -> Result<Counts, StorageError> {
    Ok(Counts {
        available: row.int("available")?,
        reserved: row.int("reserved")?,
        consumed: row.int("consumed")?,
        version: row.int("version")?,
    })
}

/// A reservation with `id, order_id, state, lines, expires_at`.
pub fn reservation(row: &dyn Columns) -> Result<Reservation, StorageError> {
    let state = ReservationState::from_db(&row.text("state")?).ok_or_else(|| corrupt("reservations.state"))?;
    let lines = serde_json::from_str(&row.text("lines")?).map_err(|_| corrupt("reservations.lines"))?;
    Ok(Reservation {
        id: row.text("id")?,
        order_id: row.text("order_id")?,
        state,
        lines,
        expires_at: Timestamp(row.int("expires_at")?),
    })
}

/// The ledger columns of [`ledger_entry`].
pub const LEDGER_COLUMNS: &str = "seq, bucket, op, qty, request_id, order_id, reservation_id, available_after,
    reserved_after, consumed_after, plugin_version, at, reverses";

pub fn ledger_entry(row: &dyn Columns) -> Result<LedgerEntry, StorageError> {
    Ok(LedgerEntry {
        seq: row.int("seq")?,
        bucket: row.int("bucket")?,
        op: LedgerOp::from_db(&row.text("op")?).ok_or_else(|| corrupt("ledger.op"))?,
        qty: row.int("qty")?,
        request_id: row.text("request_id")?,
        order_id: row.opt_text("order_id")?,
        reservation_id: row.opt_text("reservation_id")?,
        available_after: row.int("available_after")?,
        reserved_after: row.int("reserved_after")?,
        consumed_after: row.int("consumed_after")?,
        plugin_version: row.opt_int("plugin_version")?,
        at: Timestamp(row.int("at")?),
        reverses: row.opt_text("reverses")?,
    })
}

/// The columns of `resource_buckets` that [`bucket`] maps.
pub const BUCKET_COLUMNS: &str = "tenant_id, resource_key, bucket, available, reserved, consumed, version, updated_at";

/// A bucket row with its `(tenant, resource)`.
pub fn bucket(row: &dyn Columns) -> Result<((String, String), BucketCounts), StorageError> {
    Ok((
        (row.text("tenant_id")?, row.text("resource_key")?),
        BucketCounts {
            bucket: row.int("bucket")?,
            available: row.int("available")?,
            reserved: row.int("reserved")?,
            consumed: row.int("consumed")?,
            version: row.int("version")?,
            updated_at_ms: row.int("updated_at")?,
        },
    ))
}

/// Bucket rows grouped by `(tenant, resource)`, each group in the order the rows came.
pub fn group_buckets(
    rows: impl IntoIterator<Item = ((String, String), BucketCounts)>,
) -> HashMap<(String, String), Vec<BucketCounts>> {
    let mut grouped: HashMap<(String, String), Vec<BucketCounts>> = HashMap::new();
    for (id, counts) in rows {
        grouped.entry(id).or_default().push(counts);
    }
    grouped
}

/// A per-op ledger sum (`tenant_id, resource_key, bucket, op, qty, n`).
pub fn ledger_sum(row: &dyn Columns) -> Result<LedgerSum, StorageError> {
    Ok(LedgerSum {
        tenant: row.text("tenant_id")?,
        key: row.text("resource_key")?,
        bucket: row.int("bucket")?,
        op: LedgerOp::from_db(&row.text("op")?).ok_or_else(|| corrupt("ledger.op"))?,
        qty: row.int("qty")?,
        count: row.int("n")?,
    })
}

/// A resource's (bucket's) newest entry (`tenant_id, resource_key, bucket, *_after`).
pub fn newest_entry(row: &dyn Columns) -> Result<NewestEntry, StorageError> {
    Ok(NewestEntry {
        tenant: row.text("tenant_id")?,
        key: row.text("resource_key")?,
        bucket: row.int("bucket")?,
        seq: row.int("seq")?,
        after: [row.int("available_after")?, row.int("reserved_after")?, row.int("consumed_after")?],
    })
}

/// The rows reconciliation judges the ledger against, as the CTE `w (tenant_id, resource_key,
/// bucket, since)`: every single-bucket resource (as bucket 0) and every bucket row, of the
/// tenant bound to `tenant_param` (`?1`, `$1`) or of all, each with the `seq` its entries are
/// summed after: its checkpoint's in an incremental pass, 0 in a full one. Read through
/// `ledger_by_resource (tenant_id, resource_key, seq)`, a bucket's entries filtered from its
/// resource's range.
pub fn reconciliation_targets(tenant_param: Option<&str>, pass: Pass) -> String {
    let (only, and_only) = match tenant_param {
        Some(p) => (format!("WHERE tenant_id = {p}"), format!("AND tenant_id = {p}")),
        None => (String::new(), String::new()),
    };
    let since = match pass {
        Pass::Incremental => {
            "COALESCE((SELECT c.seq FROM ledger_checkpoints c WHERE c.tenant_id = t.tenant_id
                 AND c.resource_key = t.resource_key AND c.bucket = t.bucket), 0)"
        }
        Pass::Full => "0",
    };
    format!(
        "WITH t AS (
             SELECT tenant_id, key AS resource_key, CAST(0 AS BIGINT) AS bucket FROM resources
             WHERE buckets = 1 {and_only}
             UNION ALL
             SELECT tenant_id, resource_key, bucket FROM resource_buckets {only}
         ), w AS (SELECT t.tenant_id, t.resource_key, t.bucket, {since} AS since FROM t)"
    )
}

/// The checkpoint columns every backend selects.
pub const CHECKPOINT_COLUMNS: &str =
    "tenant_id, resource_key, bucket, seq, version, available, reserved, consumed, total";

/// A reconciliation checkpoint selected as [`CHECKPOINT_COLUMNS`].
pub fn checkpoint(row: &dyn Columns) -> Result<Checkpoint, StorageError> {
    Ok(Checkpoint {
        tenant: row.text("tenant_id")?,
        key: row.text("resource_key")?,
        bucket: row.int("bucket")?,
        seq: row.int("seq")?,
        counters: Counters {
            available: row.int("available")?,
            reserved: row.int("reserved")?,
            consumed: row.int("consumed")?,
            total: row.int("total")?,
            version: row.int("version")?,
        },
    })
}

fn rate_limit(row: &dyn Columns) -> Result<Option<RateLimit>, StorageError> {
    let bad = |_| corrupt("tenants.rate_limit");
    match (row.opt_int("rate_limit_rps")?, row.opt_int("rate_limit_burst")?) {
        (Some(rps), Some(burst)) => Ok(Some(RateLimit {
            requests_per_second: u32::try_from(rps).map_err(bad)?,
            burst: u32::try_from(burst).map_err(bad)?,
        })),
        _ => Ok(None),
    }
}

/// The tenant columns of [`tenant`].
pub const TENANT_COLUMNS: &str = "id, name, created_at, rate_limit_rps, rate_limit_burst";

pub fn tenant(row: &dyn Columns) -> Result<TenantRecord, StorageError> {
    Ok(TenantRecord {
        id: TenantId::parse(row.text("id")?).map_err(|_| corrupt("tenants.id"))?,
        name: row.text("name")?,
        created_at_ms: row.int("created_at")?,
        rate_limit: rate_limit(row)?,
    })
}

/// A tenant's held reservations, the soonest to expire first: `$1` the tenant, `$2` the bound.
/// Written in the `$n` form every backend reads (MySQL through its translator). On PostgreSQL it
/// is served by the partial index `reservations_due` (held ones by deadline).
pub const HELD_RESERVATIONS_SQL: &str = "SELECT id, order_id, state, lines, expires_at FROM reservations
     WHERE state = 'held' AND tenant_id = $1 ORDER BY expires_at, id LIMIT $2";

/// Most keys one tenant's list shows (a tenant rarely has more than a handful).
pub const MAX_API_KEYS_LISTED: i64 = 1000;

/// A tenant's keys for the admin's list: `$1` the tenant, `$2` the bound. Written in the `$n`
/// form every backend reads (MySQL through its translator).
pub const LIST_API_KEYS_SQL: &str = "SELECT id, created_at, revoked_at FROM api_keys
     WHERE tenant_id = $1 ORDER BY created_at, id LIMIT $2";

/// Whether a tenant exists: `$1` the tenant.
pub const TENANT_EXISTS_SQL: &str = "SELECT id FROM tenants WHERE id = $1";

pub fn api_key_info(row: &dyn Columns) -> Result<super::ApiKeyInfo, StorageError> {
    Ok(super::ApiKeyInfo {
        id: row.text("id")?,
        created_at_ms: row.int("created_at")?,
        revoked_at_ms: row.opt_int("revoked_at")?,
    })
}

/// The API key columns (`k`) and its tenant's rate (`t`) of [`api_key`].
pub const API_KEY_COLUMNS: &str = "k.id, k.tenant_id, k.hash, t.rate_limit_rps, t.rate_limit_burst";

pub fn api_key(row: &dyn Columns) -> Result<ApiKeyRecord, StorageError> {
    Ok(ApiKeyRecord {
        id: row.text("id")?,
        tenant_id: TenantId::parse(row.text("tenant_id")?).map_err(|_| corrupt("api_keys.tenant_id"))?,
        hash: row.text("hash")?,
        rate_limit: rate_limit(row)?,
    })
}

/// A tenant's (`$1`) plugin versions as [`plugin_version`] reads them, oldest first.
pub const LIST_PLUGINS_SQL: &str = "SELECT p.version, p.sha256, p.config, p.runtime, p.uploaded_at,
         COALESCE(a.version = p.version, FALSE) AS active
     FROM plugins p LEFT JOIN plugin_active a ON a.tenant_id = p.tenant_id
     WHERE p.tenant_id = $1 ORDER BY p.version LIMIT 10000";

/// A tenant's (`$1`) active plugin version as [`plugin_version`] reads it; no row for the
/// built-in default.
pub const ACTIVE_PLUGIN_SQL: &str = "SELECT p.version, p.sha256, p.config, p.runtime, p.uploaded_at, TRUE AS active
     FROM plugin_active a JOIN plugins p ON p.tenant_id = a.tenant_id AND p.version = a.version
     WHERE a.tenant_id = $1";

/// One stored plugin version (`$1` tenant, `$2` version) as [`plugin_version`] reads it,
/// marked active: the version an activation switches to.
pub const STORED_PLUGIN_VERSION_SQL: &str = "SELECT version, sha256, config, runtime, uploaded_at, TRUE AS active
     FROM plugins WHERE tenant_id = $1 AND version = $2";

/// A plugin version (`version, sha256, config, runtime, uploaded_at, active`).
pub fn plugin_version(row: &dyn Columns) -> Result<PluginVersion, StorageError> {
    Ok(PluginVersion {
        version: row.int("version")?,
        sha256: row.text("sha256")?,
        config: row.text("config")?,
        runtime: row.text("runtime")?,
        uploaded_at_ms: row.int("uploaded_at")?,
        active: row.flag("active")?,
    })
}

/// A dead letter as [`crate::storage::redis_store::DEAD_LETTERS_SQL`] selects it.
pub fn dead_letter(row: &dyn Columns) -> Result<DeadLetter, StorageError> {
    Ok(DeadLetter {
        key: row.text("resource_key")?,
        entry_id: row.text("entry_id")?,
        payload: row.text("payload")?,
        reason: row.text("reason")?,
        at: Timestamp(row.int("at")?),
    })
}

/// A settlement failure as [`crate::storage::redis_store::FAILURES_SQL`] selects it.
pub fn settlement_failure(row: &dyn Columns) -> Result<SettlementFailure, StorageError> {
    Ok(SettlementFailure {
        key: row.text("resource_key")?,
        request_id: row.text("request_id")?,
        order_id: row.text("order_id")?,
        idempotency_key: row.text("idempotency_key")?,
        qty: row.int("qty")?,
        reason: row.text("reason")?,
        available: row.int("available")?,
        reservation_id: row.opt_text("reservation_id")?,
        at: Timestamp(row.int("at")?),
    })
}

/// An order's ledger entries summed per resource, bucket and op, as [`order_entries`] reads them:
/// from `$from` (the ledger, or a subquery with its columns, narrowed to the order's entries),
/// at most `$limit` (the placeholder that binds the limit).
macro_rules! order_entries_sql {
    ($from:literal, $limit:literal) => {
        concat!(
            "SELECT resource_key, bucket, op, CAST(SUM(qty) AS BIGINT) AS qty,
                    MIN(line_key) AS line_key, MIN(limit_key) AS limit_key, MIN(request_id) AS first_request
             FROM ",
            $from,
            " GROUP BY resource_key, bucket, op ORDER BY resource_key, bucket, op LIMIT ",
            $limit
        )
    };
}
pub(crate) use order_entries_sql;

/// An order's entries through `ledger_by_order` keyed by tenant and order id (MySQL; `$n` binds
/// there too): $1 tenant, $2 order id, $3 limit.
pub(crate) const ORDER_ENTRIES_SQL: &str = order_entries_sql!("ledger WHERE tenant_id = $1 AND order_id = $2", "$3");

/// One row of [`ORDER_ENTRIES_SQL`].
pub fn order_entries(row: &dyn Columns) -> Result<crate::engine::reversal::OrderEntries, StorageError> {
    Ok(crate::engine::reversal::OrderEntries {
        resource: row.text("resource_key")?,
        bucket: row.int("bucket")?,
        op: LedgerOp::from_db(&row.text("op")?).ok_or_else(|| corrupt("ledger.op"))?,
        qty: row.int("qty")?,
        line_key: row.opt_text("line_key")?,
        limit_key: row.opt_text("limit_key")?,
        first_request: row.text("first_request")?,
    })
}

/// Counts a reversal of an order line's bucket, guarded (both backends): $1 tenant, $2 order,
/// $3 resource, $4 bucket, $5 taken (as the ledger says now), $6 qty, $7 now. A new row needs
/// `qty <= taken`, which the caller checked; an existing one is raised to `taken` and moves only
/// while `reversed + qty` stays within it. One row changed: counted; none: it would not fit.
pub(crate) const TAKE_REVERSAL_SQL: &str = "INSERT INTO order_reversals AS o
        (tenant_id, order_id, resource_key, bucket, taken, reversed, updated_at)
    VALUES ($1, $2, $3, $4, $5, $6, $7)
    ON CONFLICT (tenant_id, order_id, resource_key, bucket) DO UPDATE
    SET taken = CASE WHEN o.taken >= excluded.taken THEN o.taken ELSE excluded.taken END,
        reversed = o.reversed + excluded.reversed, updated_at = excluded.updated_at
    WHERE o.reversed + excluded.reversed <= CASE WHEN o.taken >= excluded.taken THEN o.taken ELSE excluded.taken END";

impl Columns for sqlx::mysql::MySqlRow {
    fn int(&self, col: &str) -> Result<i64, StorageError> {
        Ok(sqlx::Row::try_get(self, col)?)
    }
    fn opt_int(&self, col: &str) -> Result<Option<i64>, StorageError> {
        Ok(sqlx::Row::try_get(self, col)?)
    }
    /// Unchecked: identifiers are stored with a binary collation (`ascii_bin`, compared byte by
    /// byte), which MySQL reports as binary strings; their bytes are ASCII, checked as UTF-8 here.
    fn text(&self, col: &str) -> Result<String, StorageError> {
        Ok(sqlx::Row::try_get_unchecked(self, col)?)
    }
    fn opt_text(&self, col: &str) -> Result<Option<String>, StorageError> {
        Ok(sqlx::Row::try_get_unchecked(self, col)?)
    }
    /// MySQL has no boolean type: a flag is an integer (a comparison's 0 or 1).
    fn flag(&self, col: &str) -> Result<bool, StorageError> {
        Ok(sqlx::Row::try_get::<i64, _>(self, col)? != 0)
    }
}

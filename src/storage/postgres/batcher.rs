//! PostgreSQL's statements for the shared group-commit batcher ([`crate::storage::batcher`]).

use futures::future::BoxFuture;
use sqlx::postgres::PgRow;
use sqlx::{PgConnection, Postgres};

use super::port::PgPort;
use crate::apply;
use crate::apply::batch::{Decided, MoveJob};
use crate::apply::port::LockedRows;
use crate::engine::Reservation;
use crate::storage::batcher::SqlBackend;
use crate::storage::{OrderExecution, OrderJob, StorageError, Transition};

/// The settings of a session or transaction whose statements join arrays of keys to tables,
/// written once for both forms: `SET LOCAL`s after a `BEGIN`, and a connection's startup
/// options.
macro_rules! by_key_plans {
    ($($name:literal = $value:literal),* $(,)?) => {
        /// Every join of a batch's statements (its arrays to `resources`, `idempotency`,
        /// `reservations`, `resource_buckets`) is a nested loop that looks each row up by its primary
        /// key, and the transaction allows no other plan: no hash or merge join, no sequential or
        /// bitmap scan, nothing materialised or memoised. A batch's arrays are bounded (`max_batch`
        /// jobs), its tables are not, so looking each row up by key is right at any size, while any
        /// other plan reads a part of the table that grows with it. With the plan's shape fixed, it
        /// no longer depends on the tables' statistics, so each statement is planned once per
        /// connection and kept (`force_generic_plan`): planning the batch's statements for every
        /// batch cost PostgreSQL 16-28 % of its CPU an order (docs/PERFORMANCE.md, twenty-third
        /// session).
        ///
        /// Before, each statement was planned for its arguments at every batch, and hash joins were
        /// off: PostgreSQL's plans for the tables as they were when planned (a fresh database's,
        /// nearly empty) joined the arrays to a table by reading it whole, and kept doing so as it
        /// grew (tests/api/query_plans.rs). A statement with no plan but a disabled one still gets
        /// that plan, at a cost the planner inflates; `jit = off` keeps such a cost from compiling
        /// the statement to machine code at every execution.
        const BY_KEY_PLANS_BEGIN: &str = concat!("BEGIN" $(, "; SET LOCAL ", $name, " = ", $value)*);
        /// The same, set for a whole session: the grouped lookups' connections (`LookupConnections`).
        pub(super) const BY_KEY_PLANS_OPTIONS: &[(&str, &str)] = &[$(($name, $value)),*];
    };
}

by_key_plans!(
    "plan_cache_mode" = "force_generic_plan",
    "jit" = "off",
    "enable_hashjoin" = "off",
    "enable_mergejoin" = "off",
    "enable_seqscan" = "off",
    "enable_bitmapscan" = "off",
    "enable_material" = "off",
    "enable_memoize" = "off",
);

/// PostgreSQL as the batcher's backend.
pub(crate) struct Pg;

impl SqlBackend for Pg {
    type Db = Postgres;

    fn run_order<'a>(
        conn: &'a mut PgConnection,
        job: &'a OrderJob,
        now_ms: i64,
    ) -> BoxFuture<'a, Result<OrderExecution, StorageError>> {
        Box::pin(async move { apply::orders::execute(&mut PgPort::new(conn), job, now_ms).await })
    }

    fn run_move<'a>(
        conn: &'a mut PgConnection,
        job: &'a MoveJob,
        now_ms: i64,
    ) -> BoxFuture<'a, Result<Transition, StorageError>> {
        Box::pin(async move { apply::reservations::execute(&mut PgPort::new(conn), job, now_ms).await })
    }

    fn read_moves<'a>(
        conn: &'a mut PgConnection,
        moves: &'a [(&'a MoveJob, i64)],
    ) -> BoxFuture<'a, Result<Vec<Option<Reservation>>, StorageError>> {
        Box::pin(async move { apply::batch::read_moves(&mut PgPort::new(conn), moves).await })
    }

    fn lock_rows<'a>(
        conn: &'a mut PgConnection,
        rows: &'a [(String, String)],
    ) -> BoxFuture<'a, Result<Result<LockedRows, StorageError>, StorageError>> {
        Box::pin(async move { Ok(crate::storage::rows::locked_rows(&lock_declared_rows(conn, rows).await?)) })
    }

    fn admit<'a>(
        conn: &'a mut PgConnection,
        jobs: &'a [(&'a OrderJob, i64)],
        moves: &'a [(&'a MoveJob, i64)],
        found: Vec<Option<Reservation>>,
        rows: LockedRows,
    ) -> BoxFuture<'a, Result<Decided, StorageError>> {
        Box::pin(async move { apply::batch::admit(&mut PgPort::new(conn), jobs, moves, found, rows).await })
    }

    fn seal<'a>(conn: &'a mut PgConnection) -> BoxFuture<'a, Result<Vec<String>, sqlx::Error>> {
        Box::pin(super::events::seal(conn))
    }

    /// See [`BY_KEY_PLANS_BEGIN`].
    const BEGIN: Option<&'static str> = Some(BY_KEY_PLANS_BEGIN);

    /// Kept, the connection saves PostgreSQL a fifth of its CPU an order under `hot-key` (the
    /// pool's two pings a batch; docs/PERFORMANCE.md, twenty-fourth session).
    const KEEP_CONNECTION: bool = true;
}

/// Locks the declared resource rows in one global order and returns them as they are now (for
/// batch admission). Rows that do not exist are simply not locked; the jobs judge them as usual.
async fn lock_declared_rows(conn: &mut PgConnection, rows: &[(String, String)]) -> Result<Vec<PgRow>, sqlx::Error> {
    if rows.is_empty() {
        return Ok(Vec::new());
    }
    let (tenants, keys): (Vec<&str>, Vec<&str>) = rows.iter().map(|(t, k)| (t.as_str(), k.as_str())).unzip();
    // In a locking SELECT the sort runs first and rows are locked as they leave it, so the
    // locks are taken in this order. The columns are read by position (`rows::locked_rows`).
    sqlx::query(
        "SELECT r.tenant_id, r.key, r.kind, r.status, r.mode, r.buckets, r.available, r.reserved, r.consumed, r.version,
                r.low_stock, r.stock
         FROM resources r
         JOIN UNNEST($1::text[], $2::text[]) AS wanted (tenant_id, key)
           ON r.tenant_id = wanted.tenant_id AND r.key = wanted.key
         ORDER BY r.tenant_id COLLATE \"C\", r.key COLLATE \"C\"
         FOR UPDATE OF r",
    )
    .bind(tenants)
    .bind(keys)
    .fetch_all(conn)
    .await
}

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

    /// Every statement of a batch is planned for its arguments (the arrays' real lengths) and
    /// the tables as they are now. PostgreSQL would otherwise settle on a generic plan after five
    /// executions and keep it until the tables' statistics change (ANALYZE): a plan chosen while
    /// a fresh database's tables were nearly empty joins the batch's arrays to `idempotency`,
    /// `resources` and `reservations` by reading them whole, and goes on doing so, every batch,
    /// as they grow (tests/api/query_plans.rs). Planning costs a batch far less than one such
    /// read. Only the batch: the reads outside it are single-row lookups by primary key, whose
    /// generic plans are right at any size and whose planning would double their cost (a sale
    /// in redis mode read its key's outcome by such a lookup: 92 -> 196 us of PostgreSQL CPU per
    /// sale with every connection planning each time; those reads are grouped now, on
    /// connections of their own that plan each group, see `lookup_pool`).
    ///
    /// And every join of a batch is a nested loop: a batch's arrays are bounded (`max_batch`
    /// jobs), its tables are not, so looking each row up by key is right at any size, while a
    /// hash or merge join reads the whole table. The planner costs a page read as if from disk
    /// and picks the whole read once the arrays pass some dozens of keys (on 10,000 resources
    /// at ~60 distinct rows: 4.2 ms against 0.6 by key), as every `multi-line` batch did: its
    /// orders cost PostgreSQL ~40 % less CPU without (docs/PERFORMANCE.md, tenth session).
    /// A disabled join method is still taken where a statement has no other.
    const BEGIN: Option<&'static str> = Some(
        "BEGIN; SET LOCAL plan_cache_mode = force_custom_plan; \
         SET LOCAL enable_hashjoin = off; SET LOCAL enable_mergejoin = off",
    );

    /// Jobs that declared `by_key` (a settlement record settled on its own: about nine
    /// single-row statements) run under PostgreSQL's default plan caching: planning each of
    /// their statements every time cost more than running it.
    fn plans_by_key<'a>(conn: &'a mut PgConnection, on: bool) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        let statement =
            if on { "SET LOCAL plan_cache_mode = auto" } else { "SET LOCAL plan_cache_mode = force_custom_plan" };
        Box::pin(async move { sqlx::query(statement).execute(&mut *conn).await.map(|_| ()) })
    }
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

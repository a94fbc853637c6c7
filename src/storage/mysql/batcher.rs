//! MySQL's statements for the shared group-commit batcher ([`crate::storage::batcher`]).

use futures::future::BoxFuture;
use sqlx::mysql::MySqlRow;
use sqlx::{MySql, MySqlConnection};

use super::port::{self, MyPort};
use crate::apply;
use crate::apply::batch::{Decided, MoveJob};
use crate::apply::port::LockedRows;
use crate::engine::Reservation;
use crate::storage::batcher::SqlBackend;
use crate::storage::{OrderExecution, OrderJob, StorageError, Transition};

/// MySQL as the batcher's backend.
pub(crate) struct My;

impl SqlBackend for My {
    type Db = MySql;

    fn run_order<'a>(
        conn: &'a mut MySqlConnection,
        job: &'a OrderJob,
        now_ms: i64,
    ) -> BoxFuture<'a, Result<OrderExecution, StorageError>> {
        Box::pin(async move { apply::orders::execute(&mut MyPort::new(conn), job, now_ms).await })
    }

    fn run_move<'a>(
        conn: &'a mut MySqlConnection,
        job: &'a MoveJob,
        now_ms: i64,
    ) -> BoxFuture<'a, Result<Transition, StorageError>> {
        Box::pin(async move { apply::reservations::execute(&mut MyPort::new(conn), job, now_ms).await })
    }

    fn read_moves<'a>(
        conn: &'a mut MySqlConnection,
        moves: &'a [(&'a MoveJob, i64)],
    ) -> BoxFuture<'a, Result<Vec<Option<Reservation>>, StorageError>> {
        Box::pin(async move { apply::batch::read_moves(&mut MyPort::new(conn), moves).await })
    }

    fn lock_rows<'a>(
        conn: &'a mut MySqlConnection,
        rows: &'a [(String, String)],
    ) -> BoxFuture<'a, Result<Result<LockedRows, StorageError>, StorageError>> {
        Box::pin(async move { Ok(crate::storage::rows::locked_rows(&lock_declared_rows(conn, rows).await?)) })
    }

    fn admit<'a>(
        conn: &'a mut MySqlConnection,
        jobs: &'a [(&'a OrderJob, i64)],
        moves: &'a [(&'a MoveJob, i64)],
        found: Vec<Option<Reservation>>,
        rows: LockedRows,
    ) -> BoxFuture<'a, Result<Decided, StorageError>> {
        Box::pin(async move { apply::batch::admit(&mut MyPort::new(conn), jobs, moves, found, rows).await })
    }

    fn seal<'a>(conn: &'a mut MySqlConnection) -> BoxFuture<'a, Result<Vec<String>, sqlx::Error>> {
        Box::pin(super::events::seal(conn))
    }

    /// Not kept: on MariaDB a kept connection measured no gain under `hot-key` (1.05x) and a
    /// loss under `uniform` (0.86-0.88x in two A/Bs; docs/PERFORMANCE.md, twenty-fourth
    /// session), so each batch takes its connection from the pool as before.
    const KEEP_CONNECTION: bool = false;
}

/// Locks the declared resource rows in one global order and returns them as they are now (for
/// batch admission). Rows that do not exist are simply not locked; the jobs judge them as usual.
async fn lock_declared_rows(
    conn: &mut MySqlConnection,
    rows: &[(String, String)],
) -> Result<Vec<MySqlRow>, sqlx::Error> {
    port::lock_resources(conn, rows, false).await
}

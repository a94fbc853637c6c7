//! Reads on SQLite: a few read-only rusqlite connections kept beside the writer (under WAL a
//! reader never waits for it), the same driver and row mappers as the writer's. A point read
//! (the idempotency lookup that opens every mutating request) runs in-process on the calling
//! thread and costs microseconds; a read of many rows runs on a blocking thread, inside one
//! read transaction so its queries see one snapshot.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rusqlite::{Connection, OpenFlags};

use crate::storage::StorageError;

/// How long an in-process point read may wait for a lock (a checkpoint resetting the WAL, say)
/// before it goes to a blocking thread, where it may wait the configured busy timeout.
const POINT_BUSY_TIMEOUT: Duration = Duration::from_millis(5);

pub struct Readers {
    path: PathBuf,
    idle: Mutex<Vec<Connection>>,
    /// Most idle connections kept; more are opened under load and closed after use.
    keep: usize,
    busy_timeout: Duration,
}

impl Readers {
    pub fn new(path: &Path, keep: usize, busy_timeout: Duration) -> Self {
        Self { path: path.to_path_buf(), idle: Mutex::new(Vec::new()), keep: keep.max(1), busy_timeout }
    }

    fn take(&self) -> Result<Connection, StorageError> {
        let idle = self.idle.lock().map_err(|_| StorageError::Internal("read connections poisoned".into()))?.pop();
        match idle {
            Some(conn) => Ok(conn),
            None => {
                let flags =
                    OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX | OpenFlags::SQLITE_OPEN_URI;
                let conn = Connection::open_with_flags(&self.path, flags)?;
                conn.set_prepared_statement_cache_capacity(64);
                Ok(conn)
            }
        }
    }

    fn put(&self, conn: Connection) {
        if let Ok(mut idle) = self.idle.lock() {
            if idle.len() < self.keep {
                idle.push(conn);
            }
        }
    }

    /// A point read on this thread; `Unavailable` if the database is locked beyond a few
    /// milliseconds (the caller may retry it with [`Readers::snapshot`]).
    pub fn point<T>(&self, read: impl FnOnce(&Connection) -> Result<T, StorageError>) -> Result<T, StorageError> {
        let conn = self.take()?;
        conn.busy_timeout(POINT_BUSY_TIMEOUT)?;
        let result = read(&conn);
        self.put(conn);
        result
    }

    /// A read on a blocking thread, in one read transaction.
    pub async fn snapshot<T, F>(self: &Arc<Self>, read: F) -> Result<T, StorageError>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> Result<T, StorageError> + Send + 'static,
    {
        let readers = Arc::clone(self);
        tokio::task::spawn_blocking(move || {
            let conn = readers.take()?;
            conn.busy_timeout(readers.busy_timeout)?;
            conn.execute_batch("BEGIN")?;
            let result = read(&conn);
            let ended = conn.execute_batch(if result.is_ok() { "COMMIT" } else { "ROLLBACK" });
            if ended.is_ok() {
                readers.put(conn);
            }
            let value = result?;
            ended?;
            Ok(value)
        })
        .await
        .map_err(|e| StorageError::Internal(format!("read thread: {e}")))?
    }
}

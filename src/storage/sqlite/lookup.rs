//! Idempotency lookups on SQLite. The lookup is the first step of every mutating request, so it
//! must cost microseconds, not a hop to a pool's worker thread and back: it runs in-process, on
//! the calling thread, on one of a few read-only connections kept beside the writer. Under WAL a
//! reader never waits for the writer; should one be refused anyway (a checkpoint resetting the
//! WAL, say), the caller falls back to the read pool.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use rusqlite::{params, Connection, OpenFlags, OptionalExtension};

use crate::storage::redis_store::STORED_OUTCOME_SQL;
use crate::storage::StorageError;

/// How long a lookup may wait for a lock before it gives up (and the caller falls back).
const BUSY_TIMEOUT: Duration = Duration::from_millis(5);

/// A stored record: `(request_hash, response_code, response_type, response_body)`.
pub type Record = (String, i64, String, String);

pub struct Lookups {
    path: PathBuf,
    idle: Mutex<Vec<Connection>>,
    /// Most idle connections kept; more are opened under load and closed after use.
    keep: usize,
}

impl Lookups {
    pub fn new(path: &Path, keep: usize) -> Self {
        Self { path: path.to_path_buf(), idle: Mutex::new(Vec::new()), keep: keep.max(1) }
    }

    fn open(&self) -> Result<Connection, StorageError> {
        let flags = OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX | OpenFlags::SQLITE_OPEN_URI;
        let conn = Connection::open_with_flags(&self.path, flags)?;
        conn.busy_timeout(BUSY_TIMEOUT)?;
        Ok(conn)
    }

    /// The key's finished record, if it has one.
    pub fn stored(&self, tenant: &str, key: &str) -> Result<Option<Record>, StorageError> {
        let idle = self.idle.lock().map_err(|_| StorageError::Internal("lookup connections poisoned".into()))?.pop();
        let conn = match idle {
            Some(conn) => conn,
            None => self.open()?,
        };
        let record = conn
            .prepare_cached(&STORED_OUTCOME_SQL.replace('$', "?"))?
            .query_row(params![tenant, key], |row| Ok((row.get(0)?, row.get(1)?, row.get(2)?, row.get(3)?)))
            .optional()?;
        if let Ok(mut idle) = self.idle.lock() {
            if idle.len() < self.keep {
                idle.push(conn);
            }
        }
        Ok(record)
    }
}

//! What a scenario leaves on disk, when the bench started the server and can reach its database:
//! the database's growth per successful operation, split by table, and the write-ahead log.
//!
//! - SQLite: before and after the load, a connection of the bench's own runs
//!   `PRAGMA wal_checkpoint(RESTART)`, which copies every committed frame into the database file
//!   and makes the next write start the WAL from its beginning; the size is then the database
//!   file's (plus the WAL in use, only if the checkpoint was kept from finishing). Measuring the
//!   file after a checkpoint counts each page once, whichever of the two files it happened to be
//!   in. Tables are sized with the `dbstat` virtual table (pages of each table and its indexes;
//!   the freelist is in no table). A background task samples the WAL every [`WAL_SAMPLE_EVERY`]
//!   during the load: its peak and its length when the load ends. What is sampled is the length
//!   in use (header and frames up to the last committed one, read from the wal-index in the
//!   `-shm` file), not the `-wal` file's size: SQLite writes the WAL again from the start of the
//!   file and shrinks the file at most to a size limit when it does, so the file's size is the
//!   longest the WAL has been since start-up (or since it last exceeded the limit), not this
//!   scenario's. Truncating the file before each scenario instead would make the first commits of
//!   every scenario extend it (a metadata flush with each `fsync`), which the server otherwise
//!   pays only once.
//! - PostgreSQL: the sum of `pg_total_relation_size` (heap, indexes, TOAST, free space and
//!   visibility maps) over every table of the database outside the system catalogs (idempotency,
//!   ledger, events, reservations, the baselines' tables, ...), and the WAL written as the
//!   `pg_current_wal_lsn()` delta. The LSN is the whole cluster's: another database busy on the
//!   same PostgreSQL server during the load counts too.
//! - MySQL (InnoDB): `ANALYZE TABLE` over every table of the database, which recounts the pages
//!   each table's indexes hold, then `data_length + index_length` from
//!   `information_schema.TABLES`. InnoDB reserves a table's pages one at a time for its first 32,
//!   then by extents of 64 (1 MiB with 16 KiB pages), so a growing table grows by steps: measure
//!   enough orders that a few MiB are written. The redo log written is the delta of the
//!   `Innodb_os_log_written` status counter, the whole server's like PostgreSQL's LSN; no figure
//!   when the server does not have that counter.
//!
//! Sizes are taken right after the load (the server answered every request after its commit), or
//! for `redis-hot-key` once the settlement backlog drained (the WAL is sampled until then too).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use anyhow::Context;
use serde::Serialize;
use sqlx::mysql::MySqlConnectOptions;
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection, Row};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use super::server::DbAccess;

/// How often the WAL in use is sampled during a load.
pub const WAL_SAMPLE_EVERY: Duration = Duration::from_millis(100);
/// Attempts at a complete RESTART checkpoint (the server's own checkpointer or a background
/// job may hold it off for a moment).
const CHECKPOINT_ATTEMPTS: u32 = 20;

/// The database's size at one moment.
#[derive(Debug, Clone, Default)]
struct Footprint {
    /// Bytes on disk: SQLite's file + WAL after a checkpoint, or PostgreSQL's tables.
    total_bytes: u64,
    /// Bytes of each table, its indexes included.
    by_table: BTreeMap<String, u64>,
    /// PostgreSQL's WAL position, in bytes since `0/0`; MySQL's redo bytes written since start.
    wal_lsn: Option<u64>,
}

/// What one scenario wrote, per successful operation.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Usage {
    /// Growth of the database's size over the scenario / successful operations.
    pub bytes_per_order: Option<f64>,
    /// The same by table (indexes included), for the tables that changed size.
    pub bytes_per_order_by_table: BTreeMap<String, f64>,
    /// SQLite: longest the WAL in use was during the load (header and frames).
    pub wal_peak_bytes: Option<u64>,
    /// SQLite: length of the WAL in use when the load ended.
    pub wal_end_bytes: Option<u64>,
    /// PostgreSQL: WAL written over the scenario (the cluster's) / successful operations;
    /// MySQL: InnoDB redo log written (the server's) / successful operations.
    pub wal_bytes_per_order: Option<f64>,
}

/// A measurement in progress: the size before the load and, on SQLite, the WAL sampler.
pub struct Probe {
    db: DbAccess,
    before: Footprint,
    sampler: Option<WalSampler>,
}

impl Probe {
    /// Takes the size before the load and starts sampling the WAL. `None` (with a warning) when
    /// the size cannot be read: the scenario still runs, without these figures.
    pub async fn start(db: &DbAccess) -> Option<Self> {
        let before = match footprint(db).await {
            Ok(f) => f,
            Err(err) => {
                eprintln!("bench: not measuring storage: {err:#}");
                return None;
            }
        };
        let sampler = match db {
            DbAccess::Sqlite(path) => Some(WalSampler::start(shm_path(path))),
            DbAccess::Postgres(_) | DbAccess::Mysql(_) => None,
        };
        Some(Self { db: db.clone(), before, sampler })
    }

    /// Stops sampling, takes the size after the scenario and divides the growth by `ok`
    /// operations.
    pub async fn finish(self, ok: u64) -> Usage {
        let wal = match self.sampler {
            Some(sampler) => Some(sampler.stop().await),
            None => None,
        };
        let after = match footprint(&self.db).await {
            Ok(f) => f,
            Err(err) => {
                eprintln!("bench: not measuring storage: {err:#}");
                return Usage::default();
            }
        };
        usage(&self.before, &after, wal, ok)
    }
}

/// The growth from `before` to `after` per operation; `wal` is the sampled (peak, end).
fn usage(before: &Footprint, after: &Footprint, wal: Option<(u64, u64)>, ok: u64) -> Usage {
    let per_op = |bytes: i128| (ok > 0).then(|| bytes as f64 / ok as f64);
    let delta = |a: u64, b: u64| i128::from(a) - i128::from(b);
    let mut by_table = BTreeMap::new();
    for (name, size) in &after.by_table {
        let grown = delta(*size, before.by_table.get(name).copied().unwrap_or(0));
        if let Some(v) = per_op(grown).filter(|_| grown != 0) {
            by_table.insert(name.clone(), v);
        }
    }
    for (name, size) in before.by_table.iter().filter(|(n, _)| !after.by_table.contains_key(*n)) {
        if let Some(v) = per_op(-i128::from(*size)) {
            by_table.insert(name.clone(), v);
        }
    }
    Usage {
        bytes_per_order: per_op(delta(after.total_bytes, before.total_bytes)),
        bytes_per_order_by_table: by_table,
        wal_peak_bytes: wal.map(|(peak, _)| peak),
        wal_end_bytes: wal.map(|(_, end)| end),
        wal_bytes_per_order: match (before.wal_lsn, after.wal_lsn) {
            (Some(b), Some(a)) => per_op(delta(a, b)),
            _ => None,
        },
    }
}

/// The wal-index (`-shm`) file of a SQLite database.
fn shm_path(db: &Path) -> PathBuf {
    let mut name = db.as_os_str().to_owned();
    name.push("-shm");
    PathBuf::from(name)
}

/// The wal-index (`-shm`) file, open for as long as the WAL's size is read from it. Opened once
/// and closed only when dropped: closing any descriptor of a file drops every POSIX lock this
/// process holds on that file, and SQLite's WAL locks (a reader's read mark, a writer's lock) are
/// such locks on the `-shm` file. A baseline's connections in this process would lose them to
/// every reading, and the server's checkpoint could then reset the WAL under a commit in progress
/// (a committed sale went missing that way). So a reading must not open and close the file while
/// this process has SQLite connections open: hold one `ShmFile` across them.
struct ShmFile(Option<std::fs::File>);

impl ShmFile {
    /// Opens the file (none yet: every reading is 0).
    fn open(shm: &Path) -> Self {
        Self(std::fs::File::open(shm).ok())
    }

    /// The length of the WAL in use, from the wal-index header at the start of the `-shm` file
    /// (<https://www.sqlite.org/walformat.html>; native byte order): the page size at offset 14
    /// (1 meaning 65,536) and `mxFrame`, the last valid frame, at offset 16. The WAL is a 32-byte
    /// header then frames of a 24-byte header and one page. 0 when nothing is in use (or no
    /// index yet).
    fn wal_in_use_bytes(&self) -> u64 {
        use std::os::unix::fs::FileExt;
        let mut header = [0u8; 20];
        let Some(file) = &self.0 else { return 0 };
        if file.read_exact_at(&mut header, 0).is_err() {
            return 0;
        }
        let page = match u16::from_ne_bytes([header[14], header[15]]) {
            1 => 65_536,
            n => u64::from(n),
        };
        let frames = u64::from(u32::from_ne_bytes([header[16], header[17], header[18], header[19]]));
        if frames == 0 {
            return 0;
        }
        32 + frames * (24 + page)
    }
}

async fn footprint(db: &DbAccess) -> anyhow::Result<Footprint> {
    match db {
        DbAccess::Sqlite(path) => {
            let path = path.clone();
            tokio::task::spawn_blocking(move || sqlite_footprint(&path)).await.context("SQLite size task")?
        }
        DbAccess::Postgres(url) => postgres_footprint(url).await,
        DbAccess::Mysql(url) => mysql_footprint(url).await,
    }
}

/// Checkpoints the WAL into the database file, then sizes the file and each table.
fn sqlite_footprint(path: &Path) -> anyhow::Result<Footprint> {
    // Opened before the connection and so closed after it (see `ShmFile`).
    let shm = ShmFile::open(&shm_path(path));
    let conn = rusqlite::Connection::open_with_flags(path, rusqlite::OpenFlags::SQLITE_OPEN_READ_WRITE)
        .with_context(|| format!("opening {}", path.display()))?;
    conn.busy_timeout(Duration::from_secs(10))?;
    let mut complete = false;
    for _ in 0..CHECKPOINT_ATTEMPTS {
        // (busy, frames in the WAL, frames checkpointed); busy = 1 when it could not finish.
        let busy: i64 = conn.query_row("PRAGMA wal_checkpoint(RESTART)", [], |r| r.get(0))?;
        if busy == 0 {
            complete = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let file_bytes = std::fs::metadata(path).with_context(|| format!("sizing {}", path.display()))?.len();
    let total_bytes = if complete {
        file_bytes
    } else {
        eprintln!("bench: the WAL could not be checkpointed completely; the part in use is counted too");
        file_bytes + shm.wal_in_use_bytes()
    };
    // Each b-tree under the table it belongs to (an index under its table; the schema table
    // itself is not listed in itself).
    let by_table = conn
        .prepare(
            "SELECT COALESCE(s.tbl_name, d.name), SUM(d.pgsize)
             FROM dbstat AS d LEFT JOIN sqlite_schema AS s ON s.name = d.name
             WHERE d.aggregate = TRUE GROUP BY 1",
        )
        .and_then(|mut stmt| {
            stmt.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)))?.collect::<Result<Vec<_>, _>>()
        });
    let by_table = match by_table {
        Ok(rows) => rows.into_iter().map(|(name, bytes)| (name, u64::try_from(bytes).unwrap_or(0))).collect(),
        // A SQLite built without the dbstat table: the total only.
        Err(_) => BTreeMap::new(),
    };
    Ok(Footprint { total_bytes, by_table, wal_lsn: None })
}

/// Sizes every table outside the system catalogs, and reads the WAL position.
async fn postgres_footprint(url: &str) -> anyhow::Result<Footprint> {
    let mut conn = PgConnectOptions::from_str(url)
        .context("parsing the bench database URL")?
        .connect()
        .await
        .context("connecting to measure the database")?;
    let rows = sqlx::query(
        "SELECT CASE WHEN n.nspname = 'public' THEN c.relname ELSE n.nspname || '.' || c.relname END,
                pg_total_relation_size(c.oid)
         FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE c.relkind IN ('r', 'p', 'm')
           AND n.nspname NOT IN ('pg_catalog', 'information_schema') AND n.nspname NOT LIKE 'pg_toast%'",
    )
    .fetch_all(&mut conn)
    .await
    .context("sizing the tables")?;
    let mut by_table = BTreeMap::new();
    for row in rows {
        let (name, bytes): (String, i64) = (row.try_get(0)?, row.try_get(1)?);
        by_table.insert(name, u64::try_from(bytes).unwrap_or(0));
    }
    let lsn: i64 = sqlx::query_scalar("SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::BIGINT")
        .fetch_one(&mut conn)
        .await
        .context("reading the WAL position")?;
    conn.close().await.ok();
    Ok(Footprint { total_bytes: by_table.values().sum(), by_table, wal_lsn: u64::try_from(lsn).ok() })
}

/// Recounts and sizes every table of the database, and reads the redo bytes written so far.
async fn mysql_footprint(url: &str) -> anyhow::Result<Footprint> {
    let mut conn = MySqlConnectOptions::from_str(url)
        .context("parsing the bench database URL")?
        .connect()
        .await
        .context("connecting to measure the database")?;
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT CAST(table_name AS CHAR) FROM information_schema.TABLES
         WHERE table_schema = DATABASE() AND table_type = 'BASE TABLE'",
    )
    .fetch_all(&mut conn)
    .await
    .context("listing the tables")?;
    if !tables.is_empty() {
        // The statistics information_schema reports are refreshed by this, not by the writes.
        let list = tables.iter().map(|t| format!("`{}`", t.replace('`', "``"))).collect::<Vec<_>>().join(", ");
        sqlx::query(&format!("ANALYZE TABLE {list}")).fetch_all(&mut conn).await.context("analyzing the tables")?;
    }
    let rows = sqlx::query(
        "SELECT CAST(table_name AS CHAR), CAST(COALESCE(data_length, 0) + COALESCE(index_length, 0) AS UNSIGNED)
         FROM information_schema.TABLES WHERE table_schema = DATABASE() AND table_type = 'BASE TABLE'",
    )
    .fetch_all(&mut conn)
    .await
    .context("sizing the tables")?;
    let mut by_table = BTreeMap::new();
    for row in rows {
        let (name, bytes): (String, u64) = (row.try_get(0)?, row.try_get(1)?);
        by_table.insert(name, bytes);
    }
    let redo = sqlx::query("SHOW GLOBAL STATUS LIKE 'Innodb_os_log_written'")
        .fetch_optional(&mut conn)
        .await
        .context("reading the redo log counter")?;
    let redo_bytes = match redo {
        Some(row) => row.try_get::<String, _>(1).ok().and_then(|v| v.parse::<u64>().ok()),
        None => None,
    };
    conn.close().await.ok();
    Ok(Footprint { total_bytes: by_table.values().sum(), by_table, wal_lsn: redo_bytes })
}

/// Samples the WAL in use (through the `-shm` file) in the background until stopped.
struct WalSampler {
    stop: oneshot::Sender<()>,
    task: JoinHandle<(u64, u64)>,
}

impl WalSampler {
    fn start(shm: PathBuf) -> Self {
        let (stop, mut stopped) = oneshot::channel();
        // One descriptor for the whole run (see `ShmFile`).
        let shm = ShmFile::open(&shm);
        let task = tokio::spawn(async move {
            let size = || shm.wal_in_use_bytes();
            let mut peak = size();
            let mut tick = tokio::time::interval(WAL_SAMPLE_EVERY);
            loop {
                tokio::select! {
                    _ = &mut stopped => break,
                    _ = tick.tick() => peak = peak.max(size()),
                }
            }
            let end = size();
            (peak.max(end), end)
        });
        Self { stop, task }
    }

    /// (peak, size now).
    async fn stop(self) -> (u64, u64) {
        let _ = self.stop.send(());
        self.task.await.unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::{shm_path, usage, Footprint, ShmFile};
    use std::path::PathBuf;

    #[test]
    fn the_wal_in_use_is_read_from_the_wal_index_and_matches_a_fresh_wal_file() {
        let dir = tempfile::tempdir().expect("temp dir");
        let db = dir.path().join("t.db");
        let conn = rusqlite::Connection::open(&db).expect("open");
        conn.pragma_update(None, "journal_mode", "WAL").expect("WAL");
        conn.pragma_update(None, "wal_autocheckpoint", 0).expect("no checkpoints");
        conn.execute_batch("CREATE TABLE t (x TEXT); INSERT INTO t VALUES (hex(randomblob(20000)));").expect("write");
        let mut wal = db.as_os_str().to_owned();
        wal.push("-wal");
        let file = std::fs::metadata(PathBuf::from(wal)).expect("wal file").len();
        assert!(file > 40_000);
        assert_eq!(ShmFile::open(&shm_path(&db)).wal_in_use_bytes(), file);
        let busy: i64 = conn.query_row("PRAGMA wal_checkpoint(RESTART)", [], |r| r.get(0)).expect("checkpoint");
        assert_eq!(busy, 0);
        conn.execute("INSERT INTO t VALUES ('a')", []).expect("write after the restart");
        assert_eq!(ShmFile::open(&shm_path(&db)).wal_in_use_bytes(), 32 + 24 + 4096);
        assert_eq!(ShmFile::open(&dir.path().join("missing-shm")).wal_in_use_bytes(), 0);
    }

    /// Reading the WAL's size keeps SQLite's locks: with a read transaction of this process
    /// open on the WAL, another process's TRUNCATE checkpoint must stay blocked (busy) after
    /// readings, as before them. Closing a descriptor of the `-shm` file would drop every POSIX lock
    /// this process holds on it (SQLite's read marks included), and the other process would then
    /// reset the WAL under this one's feet: a baseline's committed sale went missing that way.
    #[test]
    fn reading_the_wal_size_keeps_this_process_sqlite_locks() {
        let dir = tempfile::tempdir().expect("temp dir");
        let db = dir.path().join("t.db");
        let conn = rusqlite::Connection::open(&db).expect("open");
        conn.pragma_update(None, "journal_mode", "WAL").expect("WAL");
        conn.pragma_update(None, "wal_autocheckpoint", 0).expect("no checkpoints");
        conn.execute_batch("CREATE TABLE t (x TEXT); INSERT INTO t VALUES ('a'); INSERT INTO t VALUES ('b');")
            .expect("write");
        // A read transaction pins the WAL: no other connection may reset it.
        conn.execute_batch("BEGIN").expect("begin");
        let rows: i64 = conn.query_row("SELECT COUNT(*) FROM t", [], |r| r.get(0)).expect("read");
        assert_eq!(rows, 2);
        let truncate_elsewhere = || {
            let script = "import sqlite3,sys; c=sqlite3.connect(sys.argv[1], timeout=0); \
                          print(c.execute('PRAGMA wal_checkpoint(TRUNCATE)').fetchone()[0])";
            let out =
                std::process::Command::new("python3").args(["-c", script]).arg(&db).output().expect("python3 runs");
            String::from_utf8_lossy(&out.stdout).trim().to_owned()
        };
        assert_eq!(truncate_elsewhere(), "1", "busy while this process reads");
        // As the sampler does: one descriptor, opened before and closed after the connections.
        let shm = ShmFile::open(&shm_path(&db));
        assert!(shm.wal_in_use_bytes() > 0);
        assert!(shm.wal_in_use_bytes() > 0);
        assert_eq!(truncate_elsewhere(), "1", "still busy after the WAL's size was read");
        conn.execute_batch("COMMIT").expect("end the read");
        drop(conn);
        drop(shm);
    }

    #[test]
    fn growth_is_divided_by_the_successful_operations_and_split_by_table() {
        let before = Footprint {
            total_bytes: 1_000,
            by_table: [("ledger".to_string(), 400), ("gone".to_string(), 100)].into(),
            wal_lsn: Some(50),
        };
        let after = Footprint {
            total_bytes: 5_000,
            by_table: [("ledger".to_string(), 2_400), ("idempotency".to_string(), 2_000)].into(),
            wal_lsn: Some(10_050),
        };
        let u = usage(&before, &after, Some((300, 200)), 100);
        assert_eq!(u.bytes_per_order, Some(40.0));
        assert_eq!(
            u.bytes_per_order_by_table,
            [("gone".to_string(), -1.0), ("idempotency".to_string(), 20.0), ("ledger".to_string(), 20.0)].into()
        );
        assert_eq!((u.wal_peak_bytes, u.wal_end_bytes), (Some(300), Some(200)));
        assert_eq!(u.wal_bytes_per_order, Some(100.0));
        assert_eq!(usage(&before, &after, None, 0).bytes_per_order, None);
    }
}

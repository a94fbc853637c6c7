//! The baselines a user would otherwise write, run by the bench process directly against the
//! server's database with the same number of concurrent clients, one transaction per request:
//!
//! - `row-lock`: read the row under a lock (`SELECT ... FOR UPDATE` on PostgreSQL and MySQL,
//!   `BEGIN IMMEDIATE` on SQLite), check in the application, then `UPDATE` and insert a ledger
//!   row.
//! - `guarded-per-request`: the guarded `UPDATE ... WHERE available >= qty` and a ledger insert,
//!   no batching.
//! - `segmented`: the classic answer to a hot row. The SKU's stock is split over [`SEGMENTS`]
//!   rows of [`UNITS_PER_SEGMENT`] units each; every request picks one segment at random and
//!   takes a unit from it with the guarded `UPDATE` (which locks only that row) and a ledger
//!   insert. When that segment is empty the order is refused although other segments may still
//!   hold stock: a *false sold-out*, counted apart from the true ones (refused with the whole
//!   stock gone) by reading the sum of the segments in the refusing transaction.
//!
//! A segment's units are few on purpose: the segments drain within a fraction of a second to a
//! few seconds, so false sold-outs show at the end of every sale. When a client finds the whole
//! stock gone it starts the next sale, in a transaction of its own: the sale counter moves on
//! only if nobody moved it since the refusal read it, and every segment gets its units again. The
//! clients keep going until the duration is over, as in the other scenarios, so the run has as
//! many sales as fit in it. `row-lock` and `guarded-per-request` are the same model with one
//! segment that holds [`TOTAL`] units and never runs out.
//!
//! They use their own tables (`bench_naive`: the segments, `bench_naive_sale`: the sale counter
//! and the units stocked so far, `bench_naive_ledger`) and the hot-key shape (one SKU, qty 1),
//! so their numbers compare with `hot-key` most directly. After each run the invariants are
//! checked on the tables: no segment negative, the segments' `available + consumed` equals the
//! units stocked (sales × units per sale: nothing oversold), the ledger sums to `consumed`, and
//! `consumed` equals the acknowledged sales.

use std::future::Future;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use rusqlite::{params, OptionalExtension};
use serde::Serialize;
use sqlx::pool::PoolOptions;
use sqlx::{ColumnIndex, Database, Decode, Encode, Executor, IntoArguments, MySql, Pool, Postgres, Row, Type};

use super::load::TOTAL;
use super::server::DbAccess;
use super::Stats;

/// The naive strategies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Naive {
    /// Lock, read, check, write.
    RowLock,
    /// Guarded UPDATE + ledger insert per request.
    Guarded,
    /// Guarded UPDATE of one of [`SEGMENTS`] rows picked at random + ledger insert per request.
    Segmented,
}

/// Rows the `segmented` baseline splits the SKU's stock over.
pub const SEGMENTS: i64 = 100;
/// Units each segment holds at the start of a sale: 1,000 units per sale, sold out in well
/// under a second on SQLite and in one to two seconds on PostgreSQL with 64 clients here, so a
/// run of a few seconds holds several sales and their ends.
pub const UNITS_PER_SEGMENT: i64 = 10;
/// The reason a request refused while the other segments still held stock is counted under.
pub const FALSE_SOLD_OUT: &str = "false_sold_out";
/// The reason a request refused with the whole stock gone is counted under.
pub const SOLD_OUT: &str = "insufficient";
/// Connections the baseline's pool may wait for before a request fails.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a SQLite connection waits for the write lock.
const SQLITE_BUSY_TIMEOUT: Duration = Duration::from_secs(10);

impl Naive {
    /// The scenario name.
    pub fn name(self) -> &'static str {
        match self {
            Self::RowLock => "row-lock",
            Self::Guarded => "guarded-per-request",
            Self::Segmented => "segmented",
        }
    }

    /// Rows the stock is split over.
    pub fn segments(self) -> i64 {
        match self {
            Self::RowLock | Self::Guarded => 1,
            Self::Segmented => SEGMENTS,
        }
    }

    /// Units each segment gets at the start of a sale.
    pub fn units_per_segment(self) -> i64 {
        match self {
            Self::RowLock | Self::Guarded => TOTAL,
            Self::Segmented => UNITS_PER_SEGMENT,
        }
    }

    /// How the unit is taken from the segment.
    fn take(self) -> Take {
        match self {
            Self::RowLock => Take::LockThenCheck,
            Self::Guarded | Self::Segmented => Take::Guarded,
        }
    }
}

/// How a request takes its unit from its segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Take {
    /// Read the segment under a lock, check in the application, then `UPDATE` it.
    LockThenCheck,
    /// `UPDATE ... WHERE available >= 1`, decided by the rows it changed.
    Guarded,
}

/// What one request came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Outcome {
    /// A unit was taken and its ledger row written.
    Sold,
    /// Refused: the whole stock was gone (the next sale was then started).
    SoldOut,
    /// Refused: the picked segment was empty but others still held stock.
    FalseSoldOut,
}

/// The model one baseline ran, and how its stock went, for the report.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Rows the stock was split over.
    pub segments: i64,
    /// Units each segment got at the start of each sale.
    pub units_per_segment: i64,
    /// Sales run: the first, plus one for each time the stock sold out completely.
    pub sales: i64,
    /// Units put in over all sales.
    pub units_stocked: i64,
    /// Requests refused while other segments still held stock.
    pub false_sold_outs: u64,
    /// Requests refused with the whole stock gone.
    pub sold_outs: u64,
}

/// One baseline's run: its stats, the invariant violations found and its stock report.
#[derive(Debug)]
pub struct Run {
    pub stats: Stats,
    pub violations: Vec<String>,
    pub report: Report,
}

const KEY: &str = "hot";

/// Creates the baselines' tables afresh (dropping a previous baseline's) with `which`'s
/// segments and its first sale.
pub async fn setup(db: &DbAccess, which: Naive) -> anyhow::Result<()> {
    match db {
        DbAccess::Sqlite(path) => {
            let p = path.to_path_buf();
            tokio::task::spawn_blocking(move || sqlite_setup(&p, which)).await.context("setup task")?
        }
        DbAccess::Postgres(url) => sqlx_setup::<Postgres>(url, &POSTGRES, which).await,
        DbAccess::Mysql(url) => sqlx_setup::<MySql>(url, &MYSQL, which).await,
    }
}

/// Runs one baseline on the tables [`setup`] created for it and checks its invariants.
pub async fn run(db: &DbAccess, which: Naive, clients: usize, duration: Duration) -> anyhow::Result<Run> {
    let (stats, tally) = match db {
        DbAccess::Sqlite(path) => sqlite(path, which, clients, duration).await?,
        DbAccess::Postgres(url) => sqlx_run::<Postgres>(url, &POSTGRES, which, clients, duration).await?,
        DbAccess::Mysql(url) => sqlx_run::<MySql>(url, &MYSQL, which, clients, duration).await?,
    };
    if stats.requests == 0 {
        bail!("the {} baseline made no requests", which.name());
    }
    let violations = invariants(which, &tally, &stats);
    let count = |reason: &str| stats.rejections.get(reason).copied().unwrap_or(0);
    let report = Report {
        segments: which.segments(),
        units_per_segment: which.units_per_segment(),
        sales: tally.sales,
        units_stocked: tally.stocked,
        false_sold_outs: count(FALSE_SOLD_OUT),
        sold_outs: count(SOLD_OUT),
    };
    Ok(Run { stats, violations, report })
}

fn elapsed_us(started: Instant) -> u32 {
    u32::try_from(started.elapsed().as_micros()).unwrap_or(u32::MAX)
}

/// Counts one request's answer and latency: a sale consumes its unit; a refusal is counted
/// under its reason ([`SOLD_OUT`], [`FALSE_SOLD_OUT`] or the error).
pub(super) fn note(stats: &mut Stats, started: Instant, result: Result<Outcome, String>) {
    stats.latencies_us.push(elapsed_us(started));
    stats.requests += 1;
    let reason = match result {
        Ok(Outcome::Sold) => {
            stats.ok += 1;
            stats.consumed_expected += 1;
            return;
        }
        Ok(Outcome::SoldOut) => SOLD_OUT.to_string(),
        Ok(Outcome::FalseSoldOut) => FALSE_SOLD_OUT.to_string(),
        Err(reason) => reason,
    };
    *stats.rejections.entry(reason).or_insert(0) += 1;
}

/// The baseline's tables after its run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Tally {
    /// Segment rows of the SKU.
    segments: i64,
    /// Segments with a negative `available` or `consumed`.
    negative_segments: i64,
    /// Sums over the segments.
    available: i64,
    consumed: i64,
    /// Sale counter and units stocked over all sales.
    sales: i64,
    stocked: i64,
    /// Sum of the ledger's quantities.
    ledger: i64,
}

/// Columns of each backend's tally query.
const TALLY_COLUMNS: usize = 7;

impl Tally {
    /// From the tally query's columns, in the order of the fields.
    fn from_columns(columns: [i64; TALLY_COLUMNS]) -> Self {
        let [segments, negative_segments, available, consumed, sales, stocked, ledger] = columns;
        Self { segments, negative_segments, available, consumed, sales, stocked, ledger }
    }
}

fn invariants(which: Naive, t: &Tally, stats: &Stats) -> Vec<String> {
    let mut problems = Vec::new();
    if t.segments != which.segments() {
        problems.push(format!("{} segments, {} expected", t.segments, which.segments()));
    }
    if t.negative_segments != 0 {
        problems.push(format!("{} segments with a negative counter", t.negative_segments));
    }
    if t.available + t.consumed != t.stocked {
        problems.push(format!("available {} + consumed {} != stocked {}", t.available, t.consumed, t.stocked));
    }
    if t.sales < 1 || t.stocked != t.sales * which.segments() * which.units_per_segment() {
        problems.push(format!("stocked {} is not {} sales of the segments", t.stocked, t.sales));
    }
    let sold_outs = i64::try_from(stats.rejections.get(SOLD_OUT).copied().unwrap_or(0)).unwrap_or(i64::MAX);
    if t.sales - 1 > sold_outs {
        problems.push(format!("{} sales started after only {sold_outs} sold-outs", t.sales - 1));
    }
    if t.ledger != t.consumed {
        problems.push(format!("ledger sum {} != consumed {}", t.ledger, t.consumed));
    }
    if t.consumed != stats.consumed_expected {
        problems.push(format!("consumed {} != successes {}", t.consumed, stats.consumed_expected));
    }
    problems
}

/// Runs `once(request_id, segment)` of the baseline `name` in `clients` closed loops until
/// `duration` has passed, each with a segment picked at random among `segments`.
pub(super) async fn drive<F, Fut>(
    name: &'static str,
    segments: i64,
    clients: usize,
    duration: Duration,
    once: F,
) -> anyhow::Result<Stats>
where
    F: Fn(String, i64) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = Result<Outcome, String>> + Send,
{
    let started = Instant::now();
    let deadline = started + duration;
    let handles: Vec<_> = (0..clients)
        .map(|task| {
            let once = once.clone();
            tokio::spawn(async move {
                let mut stats = Stats::default();
                let mut i = 0u64;
                while Instant::now() < deadline {
                    i += 1;
                    let segment = rand::random_range(0..segments);
                    let t0 = Instant::now();
                    let result = once(format!("{name}-{task}-{i}"), segment).await;
                    note(&mut stats, t0, result);
                }
                stats
            })
        })
        .collect();
    Stats::joined(handles, started).await
}

// ---- SQLite -------------------------------------------------------------------------------

fn sqlite_open(path: &Path) -> rusqlite::Result<rusqlite::Connection> {
    let conn = rusqlite::Connection::open(path)?;
    conn.busy_timeout(SQLITE_BUSY_TIMEOUT)?;
    conn.pragma_update(None, "journal_mode", "WAL")?;
    conn.pragma_update(None, "synchronous", "FULL")?;
    Ok(conn)
}

fn sqlite_setup(path: &Path, which: Naive) -> anyhow::Result<()> {
    let mut conn = sqlite_open(path).context("opening the SQLite file for the baselines")?;
    let tx = conn.transaction()?;
    tx.execute_batch(
        "DROP TABLE IF EXISTS bench_naive;
         DROP TABLE IF EXISTS bench_naive_sale;
         DROP TABLE IF EXISTS bench_naive_ledger;
         CREATE TABLE bench_naive (key TEXT NOT NULL, segment INTEGER NOT NULL, available INTEGER NOT NULL,
             consumed INTEGER NOT NULL, PRIMARY KEY (key, segment));
         CREATE TABLE bench_naive_sale (key TEXT PRIMARY KEY, sale INTEGER NOT NULL, stocked INTEGER NOT NULL);
         CREATE TABLE bench_naive_ledger (id INTEGER PRIMARY KEY AUTOINCREMENT, key TEXT NOT NULL,
             qty INTEGER NOT NULL, request_id TEXT NOT NULL, at INTEGER NOT NULL);",
    )?;
    for segment in 0..which.segments() {
        tx.execute(
            "INSERT INTO bench_naive (key, segment, available, consumed) VALUES (?1, ?2, ?3, 0)",
            params![KEY, segment, which.units_per_segment()],
        )?;
    }
    tx.execute(
        "INSERT INTO bench_naive_sale (key, sale, stocked) VALUES (?1, 1, ?2)",
        params![KEY, which.segments() * which.units_per_segment()],
    )?;
    tx.commit()?;
    Ok(())
}

fn sqlite_once(
    conn: &mut rusqlite::Connection,
    which: Naive,
    request_id: &str,
    segment: i64,
) -> rusqlite::Result<Outcome> {
    let now = i64::try_from(std::time::UNIX_EPOCH.elapsed().map(|d| d.as_millis()).unwrap_or(0)).unwrap_or(0);
    let taken = match which.take() {
        Take::LockThenCheck => {
            // IMMEDIATE takes the database's write lock up front: SQLite's row lock.
            let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
            let available: Option<i64> = tx
                .query_row(
                    "SELECT available FROM bench_naive WHERE key = ?1 AND segment = ?2",
                    params![KEY, segment],
                    |r| r.get(0),
                )
                .optional()?;
            if available.unwrap_or(0) >= 1 {
                tx.execute(
                    "UPDATE bench_naive SET available = available - 1, consumed = consumed + 1
                     WHERE key = ?1 AND segment = ?2",
                    params![KEY, segment],
                )?;
            }
            sqlite_finish(tx, available.unwrap_or(0) >= 1, request_id, now)?
        }
        Take::Guarded => {
            let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Deferred)?;
            let changed = tx.execute(
                "UPDATE bench_naive SET available = available - 1, consumed = consumed + 1
                 WHERE key = ?1 AND segment = ?2 AND available >= 1",
                params![KEY, segment],
            )?;
            sqlite_finish(tx, changed == 1, request_id, now)?
        }
    };
    match taken {
        Taken::Sold => Ok(Outcome::Sold),
        Taken::Refused { left, .. } if left > 0 => Ok(Outcome::FalseSoldOut),
        Taken::Refused { sale, .. } => {
            sqlite_next_sale(conn, which, sale)?;
            Ok(Outcome::SoldOut)
        }
    }
}

/// Whether the request's transaction took its unit, or, refused, what it saw of the stock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Taken {
    Sold,
    /// The sale under way and the units left in all segments, read in one statement.
    Refused {
        sale: i64,
        left: i64,
    },
}

/// Writes the ledger row and commits when the unit was taken; otherwise reads the sale and the
/// stock left in the same transaction and rolls back.
fn sqlite_finish(tx: rusqlite::Transaction<'_>, taken: bool, request_id: &str, now: i64) -> rusqlite::Result<Taken> {
    if taken {
        tx.execute(
            "INSERT INTO bench_naive_ledger (key, qty, request_id, at) VALUES (?1, 1, ?2, ?3)",
            params![KEY, request_id, now],
        )?;
        tx.commit()?;
        return Ok(Taken::Sold);
    }
    let (sale, left) = tx.query_row(
        "SELECT sale, (SELECT COALESCE(SUM(available), 0) FROM bench_naive WHERE key = ?1)
         FROM bench_naive_sale WHERE key = ?1",
        params![KEY],
        |r| Ok((r.get(0)?, r.get(1)?)),
    )?;
    Ok(Taken::Refused { sale, left })
}

/// Starts sale `seen + 1` unless another client already did: the counter moves on only from
/// the sale the refusal saw sold out, so the segments are refilled once per sale.
fn sqlite_next_sale(conn: &mut rusqlite::Connection, which: Naive, seen: i64) -> rusqlite::Result<()> {
    let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
    let moved = tx.execute(
        "UPDATE bench_naive_sale SET sale = sale + 1, stocked = stocked + ?2 WHERE key = ?1 AND sale = ?3",
        params![KEY, which.segments() * which.units_per_segment(), seen],
    )?;
    if moved == 1 {
        tx.execute(
            "UPDATE bench_naive SET available = available + ?2 WHERE key = ?1",
            params![KEY, which.units_per_segment()],
        )?;
    }
    tx.commit()
}

async fn sqlite(path: &Path, which: Naive, clients: usize, duration: Duration) -> anyhow::Result<(Stats, Tally)> {
    let started = Instant::now();
    let deadline = started + duration;
    // rusqlite blocks: each client is a blocking task with its own connection.
    let handles: Vec<_> = (0..clients)
        .map(|task| {
            let p = path.to_path_buf();
            tokio::task::spawn_blocking(move || -> anyhow::Result<Stats> {
                let mut conn = sqlite_open(&p).context("opening a baseline connection")?;
                let mut stats = Stats::default();
                let mut i = 0u64;
                while Instant::now() < deadline {
                    i += 1;
                    let segment = rand::random_range(0..which.segments());
                    let t0 = Instant::now();
                    let result = sqlite_once(&mut conn, which, &format!("{}-{task}-{i}", which.name()), segment);
                    note(&mut stats, t0, result.map_err(|e| sqlite_reason(&e)));
                }
                Ok(stats)
            })
        })
        .collect();
    let mut total = Stats::default();
    for h in handles {
        total.merge(h.await.context("baseline task")??);
    }
    total.elapsed = started.elapsed();
    let p = path.to_path_buf();
    let tally = tokio::task::spawn_blocking(move || -> anyhow::Result<Tally> {
        let conn = sqlite_open(&p)?;
        let tally = conn.query_row(
            "SELECT COUNT(*), COALESCE(SUM(available < 0 OR consumed < 0), 0),
                    COALESCE(SUM(available), 0), COALESCE(SUM(consumed), 0),
                    (SELECT sale FROM bench_naive_sale WHERE key = ?1),
                    (SELECT stocked FROM bench_naive_sale WHERE key = ?1),
                    (SELECT COALESCE(SUM(qty), 0) FROM bench_naive_ledger)
             FROM bench_naive WHERE key = ?1",
            params![KEY],
            |r| {
                let mut columns = [0i64; TALLY_COLUMNS];
                for (i, c) in columns.iter_mut().enumerate() {
                    *c = r.get(i)?;
                }
                Ok(Tally::from_columns(columns))
            },
        )?;
        Ok(tally)
    })
    .await
    .context("check task")??;
    Ok((total, tally))
}

fn sqlite_reason(err: &rusqlite::Error) -> String {
    match err.sqlite_error_code() {
        Some(rusqlite::ErrorCode::DatabaseBusy) | Some(rusqlite::ErrorCode::DatabaseLocked) => "busy".into(),
        _ => "db_error".into(),
    }
}

/// A failed request's reason: the database's SQLSTATE under the backend's prefix.
fn sqlx_reason(prefix: &str, err: &sqlx::Error) -> String {
    match err {
        sqlx::Error::Database(db) => format!("{prefix}_{}", db.code().unwrap_or_default()),
        sqlx::Error::PoolTimedOut => "pool_timeout".into(),
        _ => "db_error".into(),
    }
}

// ---- PostgreSQL and MySQL ----------------------------------------------------------------

/// The SQL text of one server for the request flow both share ([`sqlx_once`]). Each statement
/// binds its values in the order its comment gives, every placeholder once, so one sequence of
/// binds serves PostgreSQL's `$n` and MySQL's `?`.
struct Dialect {
    /// Prefix of a failed request's reason (then the SQLSTATE).
    name: &'static str,
    /// Drops and creates the baselines' tables.
    create: &'static [&'static str],
    /// key, segment, units.
    insert_segment: &'static str,
    /// key, units stocked.
    insert_sale: &'static str,
    /// key, segment; returns `available`, the row locked until the end of the transaction.
    lock: &'static str,
    /// key, segment: takes a unit unchecked (after `lock`).
    take: &'static str,
    /// key, segment: takes a unit if there is one.
    take_guarded: &'static str,
    /// key, request id.
    ledger: &'static str,
    /// key, key; returns the sale and the units left in all segments, from one snapshot.
    sale_and_left: &'static str,
    /// units of a sale, key, the sale seen sold out.
    next_sale: &'static str,
    /// units per segment, key.
    refill: &'static str,
    /// key, key, key; returns the [`Tally`] columns in order.
    tally: &'static str,
}

const POSTGRES: Dialect = Dialect {
    name: "pg",
    create: &[
        "DROP TABLE IF EXISTS bench_naive",
        "DROP TABLE IF EXISTS bench_naive_sale",
        "DROP TABLE IF EXISTS bench_naive_ledger",
        "CREATE TABLE bench_naive (key TEXT NOT NULL, segment BIGINT NOT NULL, available BIGINT NOT NULL,
             consumed BIGINT NOT NULL, PRIMARY KEY (key, segment))",
        "CREATE TABLE bench_naive_sale (key TEXT PRIMARY KEY, sale BIGINT NOT NULL, stocked BIGINT NOT NULL)",
        "CREATE TABLE bench_naive_ledger (id BIGSERIAL PRIMARY KEY, key TEXT NOT NULL, qty BIGINT NOT NULL,
             request_id TEXT NOT NULL, at TIMESTAMPTZ NOT NULL DEFAULT now())",
    ],
    insert_segment: "INSERT INTO bench_naive (key, segment, available, consumed) VALUES ($1, $2, $3, 0)",
    insert_sale: "INSERT INTO bench_naive_sale (key, sale, stocked) VALUES ($1, 1, $2)",
    lock: "SELECT available FROM bench_naive WHERE key = $1 AND segment = $2 FOR UPDATE",
    take: "UPDATE bench_naive SET available = available - 1, consumed = consumed + 1 WHERE key = $1 AND segment = $2",
    take_guarded: "UPDATE bench_naive SET available = available - 1, consumed = consumed + 1
                   WHERE key = $1 AND segment = $2 AND available >= 1",
    ledger: "INSERT INTO bench_naive_ledger (key, qty, request_id) VALUES ($1, 1, $2)",
    sale_and_left: "SELECT sale, (SELECT COALESCE(SUM(available), 0)::BIGINT FROM bench_naive WHERE key = $1)
                    FROM bench_naive_sale WHERE key = $2",
    next_sale: "UPDATE bench_naive_sale SET sale = sale + 1, stocked = stocked + $1 WHERE key = $2 AND sale = $3",
    refill: "UPDATE bench_naive SET available = available + $1 WHERE key = $2",
    tally: "SELECT COUNT(*), COUNT(*) FILTER (WHERE available < 0 OR consumed < 0),
                   COALESCE(SUM(available), 0)::BIGINT, COALESCE(SUM(consumed), 0)::BIGINT,
                   (SELECT sale FROM bench_naive_sale WHERE key = $1),
                   (SELECT stocked FROM bench_naive_sale WHERE key = $2),
                   (SELECT COALESCE(SUM(qty), 0)::BIGINT FROM bench_naive_ledger)
            FROM bench_naive WHERE key = $3",
};

/// InnoDB at the server's isolation (REPEATABLE READ by default). `key` is a reserved word, so it
/// is quoted; keys are ASCII compared bytewise. A plain SELECT is a consistent read, so
/// `sale_and_left` sees one snapshot.
const MYSQL: Dialect = Dialect {
    name: "mysql",
    create: &[
        "DROP TABLE IF EXISTS bench_naive",
        "DROP TABLE IF EXISTS bench_naive_sale",
        "DROP TABLE IF EXISTS bench_naive_ledger",
        "CREATE TABLE bench_naive (`key` VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
             segment BIGINT NOT NULL, available BIGINT NOT NULL, consumed BIGINT NOT NULL,
             PRIMARY KEY (`key`, segment)) ENGINE = InnoDB",
        "CREATE TABLE bench_naive_sale (`key` VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL PRIMARY KEY,
             sale BIGINT NOT NULL, stocked BIGINT NOT NULL) ENGINE = InnoDB",
        "CREATE TABLE bench_naive_ledger (id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
             `key` VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL, qty BIGINT NOT NULL,
             request_id VARCHAR(128) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
             at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)) ENGINE = InnoDB",
    ],
    insert_segment: "INSERT INTO bench_naive (`key`, segment, available, consumed) VALUES (?, ?, ?, 0)",
    insert_sale: "INSERT INTO bench_naive_sale (`key`, sale, stocked) VALUES (?, 1, ?)",
    lock: "SELECT available FROM bench_naive WHERE `key` = ? AND segment = ? FOR UPDATE",
    take: "UPDATE bench_naive SET available = available - 1, consumed = consumed + 1 WHERE `key` = ? AND segment = ?",
    take_guarded: "UPDATE bench_naive SET available = available - 1, consumed = consumed + 1
                   WHERE `key` = ? AND segment = ? AND available >= 1",
    ledger: "INSERT INTO bench_naive_ledger (`key`, qty, request_id) VALUES (?, 1, ?)",
    sale_and_left: "SELECT sale, (SELECT CAST(COALESCE(SUM(available), 0) AS SIGNED) FROM bench_naive WHERE `key` = ?)
                    FROM bench_naive_sale WHERE `key` = ?",
    next_sale: "UPDATE bench_naive_sale SET sale = sale + 1, stocked = stocked + ? WHERE `key` = ? AND sale = ?",
    refill: "UPDATE bench_naive SET available = available + ? WHERE `key` = ?",
    tally: "SELECT COUNT(*), CAST(COALESCE(SUM(available < 0 OR consumed < 0), 0) AS SIGNED),
                   CAST(COALESCE(SUM(available), 0) AS SIGNED), CAST(COALESCE(SUM(consumed), 0) AS SIGNED),
                   (SELECT sale FROM bench_naive_sale WHERE `key` = ?),
                   (SELECT stocked FROM bench_naive_sale WHERE `key` = ?),
                   (SELECT CAST(COALESCE(SUM(qty), 0) AS SIGNED) FROM bench_naive_ledger)
            FROM bench_naive WHERE `key` = ?",
};

/// The rows a statement changed, whichever server ran it.
trait RowsAffected {
    fn rows(&self) -> u64;
}

impl RowsAffected for sqlx::postgres::PgQueryResult {
    fn rows(&self) -> u64 {
        self.rows_affected()
    }
}

impl RowsAffected for sqlx::mysql::MySqlQueryResult {
    fn rows(&self) -> u64 {
        self.rows_affected()
    }
}

/// Creates the tables of `d` on `url` with `which`'s segments and its first sale.
async fn sqlx_setup<DB: Database>(url: &str, d: &Dialect, which: Naive) -> anyhow::Result<()>
where
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: IntoArguments<'q, DB>,
    i64: Type<DB> + for<'q> Encode<'q, DB>,
    String: Type<DB> + for<'q> Encode<'q, DB>,
{
    let pool = connect::<DB>(url, 1).await?;
    for stmt in d.create {
        sqlx::query(stmt).execute(&pool).await.with_context(|| format!("baseline setup: {stmt}"))?;
    }
    let mut tx = pool.begin().await?;
    for segment in 0..which.segments() {
        sqlx::query(d.insert_segment)
            .bind(KEY.to_string())
            .bind(segment)
            .bind(which.units_per_segment())
            .execute(&mut *tx)
            .await
            .context("baseline segments")?;
    }
    sqlx::query(d.insert_sale)
        .bind(KEY.to_string())
        .bind(which.segments() * which.units_per_segment())
        .execute(&mut *tx)
        .await
        .context("baseline sale")?;
    tx.commit().await?;
    pool.close().await;
    Ok(())
}

/// One request: take a unit from `segment` and write its ledger row in one transaction;
/// refused, read the sale and the stock left, and start the next sale when nothing was left.
async fn sqlx_once<DB: Database>(
    pool: &Pool<DB>,
    d: &Dialect,
    which: Naive,
    request_id: String,
    segment: i64,
) -> Result<Outcome, sqlx::Error>
where
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: IntoArguments<'q, DB>,
    i64: Type<DB> + for<'q> Encode<'q, DB> + for<'r> Decode<'r, DB>,
    String: Type<DB> + for<'q> Encode<'q, DB>,
    usize: ColumnIndex<DB::Row>,
    DB::QueryResult: RowsAffected,
{
    let key = || KEY.to_string();
    let mut tx = pool.begin().await?;
    let taken = match which.take() {
        Take::LockThenCheck => {
            let available: Option<i64> =
                sqlx::query_scalar(d.lock).bind(key()).bind(segment).fetch_optional(&mut *tx).await?;
            let taken = available.unwrap_or(0) >= 1;
            if taken {
                sqlx::query(d.take).bind(key()).bind(segment).execute(&mut *tx).await?;
            }
            taken
        }
        Take::Guarded => sqlx::query(d.take_guarded).bind(key()).bind(segment).execute(&mut *tx).await?.rows() == 1,
    };
    if taken {
        sqlx::query(d.ledger).bind(key()).bind(request_id).execute(&mut *tx).await?;
        tx.commit().await?;
        return Ok(Outcome::Sold);
    }
    let row = sqlx::query(d.sale_and_left).bind(key()).bind(key()).fetch_one(&mut *tx).await?;
    let (sale, left): (i64, i64) = (row.try_get(0)?, row.try_get(1)?);
    // Rolled back before the next sale starts: MySQL keeps the refused UPDATE's segment locked
    // until then, and the refill needs every segment.
    tx.rollback().await?;
    if left > 0 {
        return Ok(Outcome::FalseSoldOut);
    }
    let mut tx = pool.begin().await?;
    let sale_units = which.segments() * which.units_per_segment();
    let moved = sqlx::query(d.next_sale).bind(sale_units).bind(key()).bind(sale).execute(&mut *tx).await?.rows();
    if moved == 1 {
        sqlx::query(d.refill).bind(which.units_per_segment()).bind(key()).execute(&mut *tx).await?;
    }
    tx.commit().await?;
    Ok(Outcome::SoldOut)
}

/// Runs `which` on the tables of `d` at `url` with `clients` connections for `duration`, then
/// reads them.
async fn sqlx_run<DB: Database>(
    url: &str,
    d: &'static Dialect,
    which: Naive,
    clients: usize,
    duration: Duration,
) -> anyhow::Result<(Stats, Tally)>
where
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: IntoArguments<'q, DB>,
    i64: Type<DB> + for<'q> Encode<'q, DB> + for<'r> Decode<'r, DB>,
    String: Type<DB> + for<'q> Encode<'q, DB>,
    usize: ColumnIndex<DB::Row>,
    DB::QueryResult: RowsAffected,
{
    let pool = connect::<DB>(url, clients).await?;
    let shared = pool.clone();
    let stats = drive(which.name(), which.segments(), clients, duration, move |request_id, segment| {
        let pool = shared.clone();
        async move { sqlx_once(&pool, d, which, request_id, segment).await.map_err(|e| sqlx_reason(d.name, &e)) }
    })
    .await?;
    let key = || KEY.to_string();
    let row = sqlx::query(d.tally).bind(key()).bind(key()).bind(key()).fetch_one(&pool).await;
    pool.close().await;
    let row = row.context("reading the baseline's tables")?;
    let mut columns = [0i64; TALLY_COLUMNS];
    for (i, c) in columns.iter_mut().enumerate() {
        *c = row.try_get(i)?;
    }
    Ok((stats, Tally::from_columns(columns)))
}

/// A pool of up to `connections` connections to `url`.
async fn connect<DB: Database>(url: &str, connections: usize) -> anyhow::Result<Pool<DB>> {
    PoolOptions::<DB>::new()
        .max_connections(u32::try_from(connections.max(1)).unwrap_or(u32::MAX))
        .acquire_timeout(ACQUIRE_TIMEOUT)
        .connect(url)
        .await
        .context("connecting to the bench database")
}

#[cfg(test)]
mod tests {
    //! The baselines on every backend: SQLite, PostgreSQL at `STOCKD_TEST_PG_URL` and MySQL at
    //! `STOCKD_TEST_MYSQL_URL` (any database of the server, as an administrator; by default the
    //! local servers the test command starts), on which a fresh database is created and dropped.
    //! A server that does not answer fails the test: nothing is skipped.

    use std::time::Duration;

    use sqlx::{MySqlPool, PgPool};

    use super::{
        run, setup, sqlite_once, sqlite_open, sqlx_once, Naive, Outcome, FALSE_SOLD_OUT, MYSQL, POSTGRES, SEGMENTS,
        SOLD_OUT, UNITS_PER_SEGMENT,
    };
    use crate::bench::server::{DbAccess, FreshDatabase};
    use crate::bench::{storage, Backend};

    /// A connection that takes one request at a time, on the backend under test.
    enum Client {
        Sqlite(rusqlite::Connection),
        Postgres(PgPool),
        Mysql(MySqlPool),
    }

    impl Client {
        async fn open(db: &DbAccess) -> Client {
            match db {
                DbAccess::Sqlite(path) => Client::Sqlite(sqlite_open(path).expect("the SQLite file opens")),
                DbAccess::Postgres(url) => Client::Postgres(PgPool::connect(url).await.expect("PostgreSQL answers")),
                DbAccess::Mysql(url) => Client::Mysql(MySqlPool::connect(url).await.expect("MySQL answers")),
            }
        }

        async fn order(&mut self, which: Naive, request_id: &str, segment: i64) -> Outcome {
            match self {
                Client::Sqlite(conn) => sqlite_once(conn, which, request_id, segment).expect("SQLite takes the order"),
                Client::Postgres(pool) => sqlx_once(pool, &POSTGRES, which, request_id.to_string(), segment)
                    .await
                    .expect("PostgreSQL takes it"),
                Client::Mysql(pool) => {
                    sqlx_once(pool, &MYSQL, which, request_id.to_string(), segment).await.expect("MySQL takes it")
                }
            }
        }
    }

    /// Sells one sale of `segmented` out by hand on `db`: an empty segment refuses while the
    /// others hold stock (false sold-out), the order after the last unit is a true sold-out and
    /// starts the next sale; then 8 clients for half a second, after which every baseline's
    /// invariants hold and what it wrote is measured.
    async fn baselines_on(db: &DbAccess) {
        setup(db, Naive::Segmented).await.expect("segmented tables are created");
        let mut client = Client::open(db).await;
        let mut id = 0u32;
        let mut order = async |client: &mut Client, segment: i64| {
            id += 1;
            client.order(Naive::Segmented, &format!("t-{id}"), segment).await
        };
        for _ in 0..UNITS_PER_SEGMENT {
            assert_eq!(order(&mut client, 7).await, Outcome::Sold);
        }
        assert_eq!(order(&mut client, 7).await, Outcome::FalseSoldOut, "segment 7 is empty, the others are not");
        for segment in (0..SEGMENTS).filter(|s| *s != 7) {
            for _ in 0..UNITS_PER_SEGMENT {
                assert_eq!(order(&mut client, segment).await, Outcome::Sold, "segment {segment}");
            }
        }
        assert_eq!(order(&mut client, 42).await, Outcome::SoldOut, "every segment is empty");
        assert_eq!(order(&mut client, 7).await, Outcome::Sold, "the next sale refilled segment 7");
        drop(client);

        for which in [Naive::RowLock, Naive::Guarded, Naive::Segmented] {
            setup(db, which).await.expect("the baseline's tables are created");
            let probe = storage::Probe::start(db).await.expect("the database can be sized");
            let outcome = run(db, which, 8, Duration::from_millis(500)).await.expect("the baseline runs");
            let usage = probe.finish(outcome.stats.ok).await;
            assert!(usage.bytes_per_order.is_some(), "{}: {usage:?}", which.name());
            if !matches!(db, DbAccess::Sqlite(_)) {
                assert!(usage.wal_bytes_per_order.is_some_and(|b| b > 0.0), "{}: {usage:?}", which.name());
            }
            assert_eq!(outcome.violations, Vec::<String>::new(), "{}: {:?}", which.name(), outcome.report);
            assert!(outcome.stats.ok > 0, "{}", which.name());
            let count = |reason: &str| outcome.stats.rejections.get(reason).copied().unwrap_or(0);
            assert_eq!(outcome.report.false_sold_outs, count(FALSE_SOLD_OUT));
            assert_eq!(outcome.report.sold_outs, count(SOLD_OUT));
            if which != Naive::Segmented {
                assert_eq!((outcome.report.false_sold_outs, outcome.report.sales), (0, 1), "{}", which.name());
            } else if outcome.report.sales > 1 {
                assert!(outcome.report.false_sold_outs > 0, "a sale ended: {:?}", outcome.report);
            }
        }
    }

    /// Creates a fresh database on the server `env` names (else `default`), runs
    /// [`baselines_on`] and drops it.
    async fn on_server(backend: Backend, env: &str, default: &str) {
        let admin_url = std::env::var(env).unwrap_or_else(|_| default.to_string());
        let fresh = FreshDatabase::create(backend, &admin_url)
            .await
            .unwrap_or_else(|e| panic!("{admin_url} must answer for this test ({env}): {e:#}"));
        baselines_on(&fresh.access()).await;
        fresh.drop_database().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn baselines_refuse_falsely_only_when_segmented_and_keep_their_invariants_on_sqlite() {
        let dir = tempfile::tempdir().expect("temp dir");
        baselines_on(&DbAccess::Sqlite(dir.path().join("bench.db"))).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn baselines_refuse_falsely_only_when_segmented_and_keep_their_invariants_on_postgres() {
        on_server(Backend::Postgres, "STOCKD_TEST_PG_URL", "postgres://postgres@127.0.0.1:5432/postgres").await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn baselines_refuse_falsely_only_when_segmented_and_keep_their_invariants_on_mysql() {
        on_server(Backend::Mysql, "STOCKD_TEST_MYSQL_URL", "mysql://root@127.0.0.1:3306/mysql").await;
    }
}

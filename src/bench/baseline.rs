//! The baselines a user would otherwise write, run by the bench process directly against the
//! server's database with the same number of concurrent clients, one transaction per request:
//!
//! - `row-lock`: read the row under a lock (`SELECT ... FOR UPDATE` on PostgreSQL, `BEGIN
//!   IMMEDIATE` on SQLite), check in the application, then `UPDATE` and insert a ledger row.
//! - `guarded-per-request`: the guarded `UPDATE ... WHERE available >= qty` and a ledger insert,
//!   no batching.
//!
//! They use their own tables (`bench_naive`, `bench_naive_ledger`) and the hot-key shape (one
//! row, qty 1), so their numbers compare with `hot-key` most directly.

use std::path::Path;
use std::str::FromStr;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use rusqlite::{params, OptionalExtension};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgPool, Row};

use super::load::TOTAL;
use super::server::DbAccess;
use super::Stats;

/// The two naive strategies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Naive {
    /// Lock, read, check, write.
    RowLock,
    /// Guarded UPDATE + ledger insert per request.
    Guarded,
}

impl Naive {
    /// The scenario name.
    pub fn name(self) -> &'static str {
        match self {
            Self::RowLock => "row-lock",
            Self::Guarded => "guarded-per-request",
        }
    }
}

const KEY: &str = "hot";

/// Creates the baselines' tables afresh (dropping a previous baseline's) with the one row.
pub async fn setup(db: &DbAccess) -> anyhow::Result<()> {
    match db {
        DbAccess::Sqlite(path) => {
            let p = path.to_path_buf();
            tokio::task::spawn_blocking(move || sqlite_setup(&p)).await.context("setup task")?
        }
        DbAccess::Postgres(url) => postgres_setup(url).await,
    }
}

/// Runs one baseline on the tables [`setup`] created and checks its invariants; returns the
/// stats and the violations found.
pub async fn run(
    db: &DbAccess,
    which: Naive,
    clients: usize,
    duration: Duration,
) -> anyhow::Result<(Stats, Vec<String>)> {
    match db {
        DbAccess::Sqlite(path) => sqlite(path, which, clients, duration).await,
        DbAccess::Postgres(url) => postgres(url, which, clients, duration).await,
    }
}

fn elapsed_us(started: Instant) -> u32 {
    u32::try_from(started.elapsed().as_micros()).unwrap_or(u32::MAX)
}

fn note(stats: &mut Stats, started: Instant, result: Result<bool, String>) {
    stats.latencies_us.push(elapsed_us(started));
    stats.requests += 1;
    match result {
        Ok(true) => {
            stats.ok += 1;
            stats.consumed_expected += 1;
        }
        Ok(false) => *stats.rejections.entry("insufficient".into()).or_insert(0) += 1,
        Err(reason) => *stats.rejections.entry(reason).or_insert(0) += 1,
    }
}

fn invariants(available: i64, consumed: i64, ledger: i64, stats: &Stats) -> Vec<String> {
    let mut problems = Vec::new();
    if available < 0 || consumed < 0 || available + consumed != TOTAL {
        problems.push(format!("available {available} consumed {consumed} total {TOTAL}"));
    }
    if ledger != consumed {
        problems.push(format!("ledger sum {ledger} != consumed {consumed}"));
    }
    if consumed != stats.consumed_expected {
        problems.push(format!("consumed {consumed} != successes {}", stats.consumed_expected));
    }
    problems
}

// ---- SQLite -------------------------------------------------------------------------------

fn sqlite_open(path: &Path) -> rusqlite::Result<rusqlite::Connection> {
    let conn = rusqlite::Connection::open(path)?;
    conn.busy_timeout(Duration::from_secs(10))?;
    conn.pragma_update(None, "journal_mode", "WAL")?;
    conn.pragma_update(None, "synchronous", "FULL")?;
    Ok(conn)
}

fn sqlite_setup(path: &Path) -> anyhow::Result<()> {
    let conn = sqlite_open(path).context("opening the SQLite file for the baselines")?;
    conn.execute_batch(
        "DROP TABLE IF EXISTS bench_naive;
         DROP TABLE IF EXISTS bench_naive_ledger;
         CREATE TABLE bench_naive (key TEXT PRIMARY KEY, available INTEGER NOT NULL, consumed INTEGER NOT NULL);
         CREATE TABLE bench_naive_ledger (id INTEGER PRIMARY KEY AUTOINCREMENT, key TEXT NOT NULL,
             qty INTEGER NOT NULL, request_id TEXT NOT NULL, at INTEGER NOT NULL);",
    )?;
    conn.execute("INSERT INTO bench_naive (key, available, consumed) VALUES (?1, ?2, 0)", params![KEY, TOTAL])?;
    Ok(())
}

fn sqlite_once(conn: &mut rusqlite::Connection, which: Naive, request_id: &str) -> rusqlite::Result<bool> {
    let now = i64::try_from(std::time::UNIX_EPOCH.elapsed().map(|d| d.as_millis()).unwrap_or(0)).unwrap_or(0);
    match which {
        Naive::RowLock => {
            let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
            let available: Option<i64> = tx
                .query_row("SELECT available FROM bench_naive WHERE key = ?1", params![KEY], |r| r.get(0))
                .optional()?;
            if available.unwrap_or(0) < 1 {
                return Ok(false);
            }
            tx.execute(
                "UPDATE bench_naive SET available = available - 1, consumed = consumed + 1 WHERE key = ?1",
                params![KEY],
            )?;
            tx.execute(
                "INSERT INTO bench_naive_ledger (key, qty, request_id, at) VALUES (?1, 1, ?2, ?3)",
                params![KEY, request_id, now],
            )?;
            tx.commit()?;
            Ok(true)
        }
        Naive::Guarded => {
            let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Deferred)?;
            let changed = tx.execute(
                "UPDATE bench_naive SET available = available - 1, consumed = consumed + 1 WHERE key = ?1 AND available >= 1",
                params![KEY],
            )?;
            if changed == 0 {
                return Ok(false);
            }
            tx.execute(
                "INSERT INTO bench_naive_ledger (key, qty, request_id, at) VALUES (?1, 1, ?2, ?3)",
                params![KEY, request_id, now],
            )?;
            tx.commit()?;
            Ok(true)
        }
    }
}

async fn sqlite(path: &Path, which: Naive, clients: usize, duration: Duration) -> anyhow::Result<(Stats, Vec<String>)> {
    let started = Instant::now();
    let deadline = started + duration;
    let handles: Vec<_> = (0..clients)
        .map(|task| {
            let p = path.to_path_buf();
            tokio::task::spawn_blocking(move || -> anyhow::Result<Stats> {
                let mut conn = sqlite_open(&p).context("opening a baseline connection")?;
                let mut stats = Stats::default();
                let mut i = 0u64;
                while Instant::now() < deadline {
                    i += 1;
                    let t0 = Instant::now();
                    let result = sqlite_once(&mut conn, which, &format!("{}-{task}-{i}", which.name()));
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
    let (available, consumed, ledger) = tokio::task::spawn_blocking(move || -> anyhow::Result<(i64, i64, i64)> {
        let conn = sqlite_open(&p)?;
        let (a, c) =
            conn.query_row("SELECT available, consumed FROM bench_naive WHERE key = ?1", params![KEY], |r| {
                Ok((r.get(0)?, r.get(1)?))
            })?;
        let l = conn.query_row("SELECT COALESCE(SUM(qty), 0) FROM bench_naive_ledger", [], |r| r.get(0))?;
        Ok((a, c, l))
    })
    .await
    .context("check task")??;
    let problems = invariants(available, consumed, ledger, &total);
    Ok((total, problems))
}

fn sqlite_reason(err: &rusqlite::Error) -> String {
    match err.sqlite_error_code() {
        Some(rusqlite::ErrorCode::DatabaseBusy) | Some(rusqlite::ErrorCode::DatabaseLocked) => "busy".into(),
        _ => "db_error".into(),
    }
}

// ---- PostgreSQL ---------------------------------------------------------------------------

async fn pg_once(pool: &PgPool, which: Naive, request_id: &str) -> Result<bool, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let applied = match which {
        Naive::RowLock => {
            let available: Option<i64> = sqlx::query_scalar("SELECT available FROM bench_naive WHERE key = $1 FOR UPDATE")
                .bind(KEY)
                .fetch_optional(&mut *tx)
                .await?;
            if available.unwrap_or(0) >= 1 {
                sqlx::query("UPDATE bench_naive SET available = available - 1, consumed = consumed + 1 WHERE key = $1")
                    .bind(KEY)
                    .execute(&mut *tx)
                    .await?;
                true
            } else {
                false
            }
        }
        Naive::Guarded => {
            sqlx::query(
                "UPDATE bench_naive SET available = available - 1, consumed = consumed + 1 WHERE key = $1 AND available >= 1",
            )
            .bind(KEY)
            .execute(&mut *tx)
            .await?
            .rows_affected()
                == 1
        }
    };
    if !applied {
        tx.rollback().await?;
        return Ok(false);
    }
    sqlx::query("INSERT INTO bench_naive_ledger (key, qty, request_id) VALUES ($1, 1, $2)")
        .bind(KEY)
        .bind(request_id)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(true)
}

async fn postgres_setup(url: &str) -> anyhow::Result<()> {
    let opts = PgConnectOptions::from_str(url).context("parsing the bench database URL")?;
    let mut conn = opts.connect().await.context("connecting to set up the baselines")?;
    for stmt in [
        "DROP TABLE IF EXISTS bench_naive",
        "DROP TABLE IF EXISTS bench_naive_ledger",
        "CREATE TABLE bench_naive (key TEXT PRIMARY KEY, available BIGINT NOT NULL, consumed BIGINT NOT NULL)",
        "CREATE TABLE bench_naive_ledger (id BIGSERIAL PRIMARY KEY, key TEXT NOT NULL, qty BIGINT NOT NULL,
             request_id TEXT NOT NULL, at TIMESTAMPTZ NOT NULL DEFAULT now())",
    ] {
        sqlx::query(stmt).execute(&mut conn).await.with_context(|| format!("baseline setup: {stmt}"))?;
    }
    sqlx::query("INSERT INTO bench_naive (key, available, consumed) VALUES ($1, $2, 0)")
        .bind(KEY)
        .bind(TOTAL)
        .execute(&mut conn)
        .await
        .context("baseline seed row")?;
    conn.close().await.ok();
    Ok(())
}

async fn postgres(url: &str, which: Naive, clients: usize, duration: Duration) -> anyhow::Result<(Stats, Vec<String>)> {
    let opts = PgConnectOptions::from_str(url).context("parsing the bench database URL")?;
    let max = u32::try_from(clients).unwrap_or(u32::MAX);
    let pool = PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(opts)
        .await
        .context("connecting the baseline pool")?;
    let started = Instant::now();
    let deadline = started + duration;
    let handles: Vec<_> = (0..clients)
        .map(|task| {
            let pool = pool.clone();
            tokio::spawn(async move {
                let mut stats = Stats::default();
                let mut i = 0u64;
                while Instant::now() < deadline {
                    i += 1;
                    let t0 = Instant::now();
                    let result = pg_once(&pool, which, &format!("{}-{task}-{i}", which.name())).await;
                    note(&mut stats, t0, result.map_err(|e| pg_reason(&e)));
                }
                stats
            })
        })
        .collect();
    let mut total = Stats::default();
    for h in handles {
        total.merge(h.await.context("baseline task")?);
    }
    total.elapsed = started.elapsed();
    let row =
        sqlx::query("SELECT available, consumed FROM bench_naive WHERE key = $1").bind(KEY).fetch_one(&pool).await?;
    let (available, consumed): (i64, i64) = (row.try_get(0)?, row.try_get(1)?);
    let ledger: i64 =
        sqlx::query_scalar("SELECT COALESCE(SUM(qty), 0)::BIGINT FROM bench_naive_ledger").fetch_one(&pool).await?;
    pool.close().await;
    if total.requests == 0 {
        bail!("the {} baseline made no requests", which.name());
    }
    let problems = invariants(available, consumed, ledger, &total);
    Ok((total, problems))
}

fn pg_reason(err: &sqlx::Error) -> String {
    match err {
        sqlx::Error::Database(db) => format!("pg_{}", db.code().unwrap_or_default()),
        sqlx::Error::PoolTimedOut => "pool_timeout".into(),
        _ => "db_error".into(),
    }
}

//! Group commit for SQLite, which admits one writer at a time. Every write is a job sent to one
//! writer thread that owns the only write connection. The thread takes every job waiting in its
//! queue (up to `max_batch`), runs each inside its own SAVEPOINT within one transaction, commits
//! once, and only then answers each job. So many requests share one durable fsync, each keeps
//! its own effects, ledger rows and idempotency record, and none is acknowledged before its
//! commit. A job that fails is rolled back to its savepoint alone; a failed commit fails them all.
//!
//! The writer is a plain OS thread running SQLite in-process: a statement costs microseconds,
//! with no hop to another thread per statement.
//!
//! The WAL is made to start over between batches, by the checkpoint thread and the writer
//! together, not inside a batch's COMMIT as SQLite's autocheckpoint would ([`Wal`]).
//!
//! Supervision: the thread owns the only write connection, so it is not restarted; a panic while
//! a batch runs is caught instead (`catch_unwind` around the batch), counted in
//! `stockd_job_panics_total{job="sqlite_writer"}` and logged. The batch's transaction is rolled
//! back (nothing of it was committed) and every request of the batch is answered 503
//! `unavailable` (its reply channel is dropped), so each may be retried with its key; the writer
//! then takes the next batch. Only if that rollback itself fails does the thread stop, and
//! `/readyz` then answers 503.

use crate::events;
use std::os::raw::{c_char, c_int, c_void};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rusqlite::{ffi, Connection};
use tokio::sync::{mpsc, oneshot};

use super::port::SqlitePort;
use crate::apply;
use crate::apply::batch::MoveJob;
use crate::apply::port::run_now;
use crate::jobs::supervisor::faults;
use crate::storage::{OrderExecution, OrderJob, StorageError, Transition};

/// The writer's name in metrics and fault hooks.
const WRITER_JOB: &str = "sqlite_writer";

/// WAL frames after which the WAL is made to start over; bounds it at ~40 MiB plus what is
/// committed during one pass of the checkpoint thread. Only a checkpoint that completes between
/// two of the writer's transactions lets the next one start the WAL over, so the writer runs the
/// last one itself ([`Wal`]).
pub const CHECKPOINT_PAGES: i64 = 10_000;

/// Asks the checkpoint thread for a pass now.
pub type Wake = Box<dyn Fn() + Send>;

/// The WAL as the writer and the checkpoint thread (`Checkpointer` in `mod.rs`) see it.
///
/// The checkpoint thread copies committed frames into the database file every 200 ms; the WAL
/// starts over only after a checkpoint that the writer runs between two of its transactions.
/// That used to be SQLite's autocheckpoint inside COMMIT, copying everything committed since the
/// thread's last pass (up to 200 ms of commits) and syncing the database file while every client
/// waited: 1-2 % of commits took 10-25 ms against a mean of 2.4 ms, and they set every
/// scenario's p99. Now, once the WAL holds [`CHECKPOINT_PAGES`], the writer asks the thread for
/// a pass at once and goes on committing; after that pass it checkpoints the little committed
/// during it.
#[derive(Default)]
pub struct Wal {
    /// Frames in the WAL after the writer's last commit (SQLite's WAL hook; 0 when it started over).
    frames: AtomicI64,
    /// The number of the writer's latest request for a pass (they count up from 1).
    asked: AtomicU64,
    /// The highest request number a finished pass had begun after.
    passed: AtomicU64,
}

impl Wal {
    /// Called by the checkpoint thread before a pass; hand the answer to [`Wal::pass_ended`].
    pub fn pass_starts(&self) -> u64 {
        self.asked.load(Ordering::SeqCst)
    }

    /// Called by the checkpoint thread after a pass, with what [`Wal::pass_starts`] said: the
    /// writer's requests up to that one are served (a pass that began before a request is not).
    pub fn pass_ended(&self, asked: u64) {
        self.passed.fetch_max(asked, Ordering::SeqCst);
    }
}

/// Called once the batch's fate is known: `Ok` after a durable commit, `Err` if it failed.
type Completion = Box<dyn FnOnce(Result<(), StorageError>) + Send>;
/// A unit of work: runs its statements, then says whether it succeeded (kept) or not (rolled
/// back to its savepoint), and how to answer its caller once the commit is known.
type Work = Box<dyn FnOnce(&Connection) -> (bool, Completion) + Send>;

/// What the writer is asked to do.
enum Job {
    Work(Work),
    /// An order, which the writer may decide together with the batch's other orders by
    /// in-memory admission (one read and one write per hot row per batch).
    Order(Box<OrderWork>),
    /// A reservation's confirm or release, decided with the batch's orders where it can be.
    Move(Box<MoveWork>),
}

struct MoveWork {
    job: MoveJob,
    now_ms: i64,
    reply: oneshot::Sender<Result<Transition, StorageError>>,
}

impl MoveWork {
    /// The move as a plain job, decided on its own in its own savepoint.
    fn into_work(self) -> Work {
        let MoveWork { job, now_ms, reply } = self;
        Box::new(move |conn| {
            let result = run_now(apply::reservations::execute(&mut SqlitePort::new(conn), &job, now_ms));
            let ok = result.is_ok();
            (ok, answer(reply, result))
        })
    }
}

struct OrderWork {
    job: Arc<OrderJob>,
    now_ms: i64,
    reply: oneshot::Sender<Result<OrderExecution, StorageError>>,
}

impl OrderWork {
    /// The order as a plain job, decided on its own in its own savepoint.
    fn into_work(self) -> Work {
        let OrderWork { job, now_ms, reply } = self;
        Box::new(move |conn| {
            let result = run_now(apply::orders::execute(&mut SqlitePort::new(conn), &job, now_ms));
            let ok = result.is_ok();
            (ok, answer(reply, result))
        })
    }
}

fn answer<T: Send + 'static>(
    reply: oneshot::Sender<Result<T, StorageError>>,
    result: Result<T, StorageError>,
) -> Completion {
    Box::new(move |commit| {
        // The caller may have gone away (client disconnected); its effects stand.
        let _ = reply.send(commit.and(result));
    })
}

/// The handle requests use to submit writes.
#[derive(Clone)]
pub struct Writer {
    queue: mpsc::Sender<Job>,
}

/// Bounds of the writer; each a setting in `[batch]`.
#[derive(Debug, Clone, Copy)]
pub struct WriterLimits {
    /// Most jobs committed in one transaction.
    pub max_batch: usize,
    /// Jobs that may wait in the queue; beyond this, submitters wait (back-pressure).
    pub queue_depth: usize,
    /// How long the writer lingers for more jobs when the first arrives alone. Zero: never
    /// (jobs that arrive during a commit form the next batch by themselves).
    pub max_wait: Duration,
    /// WAL frames after which the writer checkpoints ([`CHECKPOINT_PAGES`]).
    pub checkpoint_pages: i64,
}

impl Writer {
    /// Starts the writer thread on `conn`. It ends once every `Writer` handle is dropped and the
    /// queue is drained; the returned handle joins it.
    /// `wal` is shared with the checkpoint thread, which `wake` asks for a pass (`None`: the
    /// writer checkpoints on its own).
    pub fn start(
        conn: Connection,
        limits: WriterLimits,
        wal: &'static Wal,
        wake: Option<Wake>,
    ) -> std::io::Result<(Self, std::thread::JoinHandle<()>)> {
        let (tx, rx) = mpsc::channel(limits.queue_depth.max(1));
        let thread =
            std::thread::Builder::new().name("stockd-writer".into()).spawn(move || run(conn, rx, limits, wal, wake))?;
        Ok((Self { queue: tx }, thread))
    }

    /// Whether the writer thread is still taking jobs (it stops only on shutdown, or if it died).
    pub fn is_running(&self) -> bool {
        !self.queue.is_closed()
    }

    /// Runs `work` in the next batch and returns its result once that batch is durable.
    pub async fn submit<T, F>(&self, work: F) -> Result<T, StorageError>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> Result<T, StorageError> + Send + 'static,
    {
        let (tx, rx) = oneshot::channel();
        let job: Work = Box::new(move |conn| {
            let result = work(conn);
            let ok = result.is_ok();
            (ok, answer(tx, result))
        });
        self.queue.send(Job::Work(job)).await.map_err(|_| StorageError::Unavailable("writer stopped".into()))?;
        rx.await.map_err(|_| StorageError::Unavailable("write was not committed".into()))?
    }

    /// Applies an order in the next batch and returns its outcome once that batch is durable.
    pub async fn submit_order(&self, job: Arc<OrderJob>, now_ms: i64) -> Result<OrderExecution, StorageError> {
        let (reply, rx) = oneshot::channel();
        let order = Job::Order(Box::new(OrderWork { job, now_ms, reply }));
        self.queue.send(order).await.map_err(|_| StorageError::Unavailable("writer stopped".into()))?;
        rx.await.map_err(|_| StorageError::Unavailable("write was not committed".into()))?
    }

    /// Queues a reservation's confirm or release (see [`Job::Move`]).
    pub async fn submit_move(&self, job: MoveJob, now_ms: i64) -> Result<Transition, StorageError> {
        let (reply, rx) = oneshot::channel();
        let queued = Job::Move(Box::new(MoveWork { job, now_ms, reply }));
        self.queue.send(queued).await.map_err(|_| StorageError::Unavailable("writer stopped".into()))?;
        rx.await.map_err(|_| StorageError::Unavailable("write was not committed".into()))?
    }
}

fn run(conn: Connection, mut rx: mpsc::Receiver<Job>, limits: WriterLimits, wal: &'static Wal, wake: Option<Wake>) {
    watch_wal(&conn, wal);
    // The request for a pass the writer waits for (0: none).
    let mut waiting_for = 0;
    let mut batch: Vec<Job> = Vec::with_capacity(limits.max_batch);
    while let Some(first) = rx.blocking_recv() {
        batch.push(first);
        fill(&mut rx, &mut batch, limits);
        metrics::histogram!("stockd_batch_size").record(batch.len() as f64);
        let started = Instant::now();
        let ran = std::panic::catch_unwind(AssertUnwindSafe(|| commit_batch(&conn, &mut batch)));
        metrics::histogram!("stockd_batch_commit_seconds").record(started.elapsed().as_secs_f64());
        if ran.is_err() && !recover(&conn, &mut batch) {
            break;
        }
        let frames = wal.frames.load(Ordering::SeqCst);
        if frames >= limits.checkpoint_pages {
            let overdue = frames >= 2 * limits.checkpoint_pages;
            start_over(&conn, wal, wake.as_ref(), overdue, &mut waiting_for);
        }
    }
    if let Err((_, err)) = conn.close() {
        tracing::warn!(error = %err, "closing the write connection");
    }
}

/// Replaces SQLite's autocheckpoint on the writer's connection by a count: after each commit,
/// the number of frames in the WAL goes to `wal`, which [`run`] reads to decide when to
/// checkpoint.
fn watch_wal(conn: &Connection, wal: &'static Wal) {
    // SAFETY: the handle is the writer's open connection, used on this thread only; the hook
    // takes no lock and touches nothing but `wal.frames`, which lives as long as the process.
    unsafe {
        ffi::sqlite3_wal_hook(
            conn.handle(),
            Some(wal_committed),
            std::ptr::from_ref::<AtomicI64>(&wal.frames).cast_mut().cast::<c_void>(),
        );
    }
}

/// SQLite's WAL hook: called after each commit with the WAL's size in frames.
unsafe extern "C" fn wal_committed(
    frames: *mut c_void,
    _db: *mut ffi::sqlite3,
    _name: *const c_char,
    n: c_int,
) -> c_int {
    // SAFETY: `frames` is the `&'static AtomicI64` registered in `watch_wal`.
    let frames = unsafe { &*frames.cast::<AtomicI64>() };
    frames.store(i64::from(n), Ordering::SeqCst);
    ffi::SQLITE_OK
}

/// With the WAL past [`CHECKPOINT_PAGES`]: asks the checkpoint thread for a pass, or, once that
/// pass ended, checkpoints what was committed during it so that the next transaction starts the
/// WAL over. Without a checkpoint thread, or with the WAL twice that size (the thread cannot keep
/// up), the writer checkpoints everything itself.
fn start_over(conn: &Connection, wal: &Wal, wake: Option<&Wake>, overdue: bool, waiting_for: &mut u64) {
    if let (Some(wake), false) = (wake, overdue) {
        if *waiting_for == 0 {
            *waiting_for = wal.asked.load(Ordering::SeqCst) + 1;
            wal.asked.store(*waiting_for, Ordering::SeqCst);
            // A thread that stopped (shutdown) leaves the writer to the overdue case.
            wake();
            return;
        }
        if wal.passed.load(Ordering::SeqCst) < *waiting_for {
            return;
        }
    }
    checkpoint(conn);
    *waiting_for = 0;
}

/// Copies the WAL frames no reader still needs into the database file (PASSIVE, as SQLite's
/// autocheckpoint: never waits for readers).
fn checkpoint(conn: &Connection) {
    let started = Instant::now();
    if let Err(err) = conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(())) {
        tracing::warn!(error = %err, "the writer's WAL checkpoint failed; the next commit tries again");
    }
    metrics::histogram!("stockd_sqlite_checkpoint_seconds").record(started.elapsed().as_secs_f64());
}

/// After a panic in a batch (already reported by the panic hook): answers the batch's jobs not
/// yet started (dropping them fails their callers with `Unavailable`; the started ones were
/// dropped by the unwinding) and rolls the open transaction back. `false`: the connection is
/// unusable and the writer must stop.
fn recover(conn: &Connection, batch: &mut Vec<Job>) -> bool {
    batch.clear();
    metrics::counter!("stockd_job_panics_total", "job" => WRITER_JOB).increment(1);
    tracing::error!(job = WRITER_JOB, "the SQLite writer panicked in a batch; its requests get 503, it goes on");
    if conn.is_autocommit() {
        return true;
    }
    match conn.execute_batch("ROLLBACK") {
        Ok(()) => true,
        Err(err) => {
            tracing::error!(error = %err, "the SQLite writer cannot roll back after a panic; it stops");
            false
        }
    }
}

/// Takes every job already queued, lingering up to `max_wait` if configured.
fn fill(rx: &mut mpsc::Receiver<Job>, batch: &mut Vec<Job>, limits: WriterLimits) {
    let deadline = Instant::now() + limits.max_wait;
    while batch.len() < limits.max_batch {
        match rx.try_recv() {
            Ok(job) => batch.push(job),
            Err(_) if Instant::now() >= deadline => return,
            // Lingering is rare (off by default) and short; a brief sleep keeps it simple.
            Err(_) => std::thread::sleep(Duration::from_micros(50)),
        }
    }
}

fn commit_batch(conn: &Connection, batch: &mut Vec<Job>) {
    // Nothing of an earlier transaction is left to count (a panic may have ended one).
    events::writer_finished(false);
    if let Err(err) = conn.execute_batch("BEGIN IMMEDIATE") {
        tracing::error!(error = %err, "writer could not begin a transaction");
        // Dropping the jobs drops their reply channels: callers get `Unavailable`.
        batch.clear();
        return;
    }
    let mut completions = Vec::with_capacity(batch.len());
    let mut works = Vec::with_capacity(batch.len());
    let mut orders = Vec::new();
    let mut moves = Vec::new();
    for job in std::mem::take(batch) {
        match job {
            Job::Work(work) => works.push(work),
            Job::Order(order) => orders.push(*order),
            Job::Move(queued) => moves.push(*queued),
        }
    }
    // The orders and moves first, together (nothing may be written before them in the
    // transaction: see `admit`); those admission leaves alone run on their own below.
    match admit(conn, orders, moves, &mut completions) {
        Some(rest) => works.extend(rest),
        // No transaction is open: the other jobs are dropped (their callers get `Unavailable`).
        None => return fail_all(conn, completions, "transaction lost"),
    }
    // Jobs left over after a savepoint failure are dropped: their callers get Unavailable.
    for job in works {
        if let Err(err) = exec(conn, "SAVEPOINT job") {
            tracing::error!(error = %err, "writer could not open a savepoint");
            break;
        }
        let mark = events::writer_mark();
        let (ok, completion) = job(conn);
        completions.push(completion);
        let end = if ok {
            exec(conn, "RELEASE job")
        } else {
            events::writer_rollback_to(mark);
            exec(conn, "ROLLBACK TO job").and_then(|_| exec(conn, "RELEASE job"))
        };
        if let Err(err) = end {
            tracing::error!(error = %err, "writer could not close a savepoint");
            fail_all(conn, completions, "savepoint failed");
            return;
        }
    }
    // Test hook (`STOCKD_FAULT_PANIC_JOB=sqlite_writer:N`): a panic with the batch's writes done
    // and not yet committed, the worst place for one.
    faults::maybe_panic(WRITER_JOB);
    match conn.execute_batch("COMMIT") {
        Ok(()) => {
            events::writer_finished(true);
            events::committed();
            completions.into_iter().for_each(|c| c(Ok(())));
        }
        Err(err) => {
            tracing::error!(error = %err, "group commit failed");
            fail_all(conn, completions, "commit failed");
        }
    }
}

/// Decides the batch's orders and reservation moves together by admission (see
/// [`apply::batch`]), queueing the answers of those it decided; returns the rest as jobs of
/// their own. If admission fails as a whole, every one of them runs on its own instead.
///
/// It runs first in the batch's transaction, with no savepoint of its own: while a savepoint is
/// open SQLite copies every page a write first touches into a sub-journal (about 5 % of an
/// order's instructions), and with nothing written before it, undoing admission is rolling the
/// transaction back and beginning it again. `None`: it could not begin again; the caller drops
/// every job of the batch (their callers get `Unavailable`).
fn admit(
    conn: &Connection,
    orders: Vec<OrderWork>,
    moves: Vec<MoveWork>,
    completions: &mut Vec<Completion>,
) -> Option<Vec<Work>> {
    let alone = |orders: Vec<OrderWork>, moves: Vec<MoveWork>| -> Vec<Work> {
        orders.into_iter().map(OrderWork::into_work).chain(moves.into_iter().map(MoveWork::into_work)).collect()
    };
    if orders.len() + moves.len() < 2 {
        return Some(alone(orders, moves));
    }
    let jobs: Vec<(&OrderJob, i64)> = orders.iter().map(|o| (&*o.job, o.now_ms)).collect();
    let moving: Vec<(&MoveJob, i64)> = moves.iter().map(|m| (&m.job, m.now_ms)).collect();
    let mut port = SqlitePort::new(conn);
    let mark = events::writer_mark();
    let decided = run_now(apply::batch::read_moves(&mut port, &moving)).and_then(|found| {
        let wanted = jobs
            .iter()
            .flat_map(|(job, _)| job.plan.resources().map(|key| (job.tenant.as_str(), key.as_str())))
            .chain(apply::batch::move_resources(&moving, &found));
        let rows = port.admission_rows(wanted)?;
        run_now(apply::batch::admit(&mut port, &jobs, &moving, found, rows))
    });
    let decided = match decided {
        Ok(decided) => decided,
        Err(err) => {
            tracing::warn!(error = %err, "batch admission failed; deciding its writes one by one");
            events::writer_rollback_to(mark);
            if let Err(err) = conn.execute_batch("ROLLBACK").and_then(|_| conn.execute_batch("BEGIN IMMEDIATE")) {
                tracing::error!(error = %err, "writer could not begin its transaction again after admission failed");
                return None;
            }
            apply::batch::Decided::default()
        }
    };
    let mut rest = Vec::new();
    let mut outcomes = decided.orders.into_iter();
    for order in orders {
        match outcomes.next().flatten() {
            Some(execution) => {
                metrics::counter!("stockd_orders_admitted_in_batch_total").increment(1);
                completions.push(answer(order.reply, Ok(execution)));
            }
            None => rest.push(order.into_work()),
        }
    }
    let mut transitions = decided.moves.into_iter();
    for queued in moves {
        match transitions.next().flatten() {
            Some(transition) => completions.push(answer(queued.reply, Ok(transition))),
            None => rest.push(queued.into_work()),
        }
    }
    Some(rest)
}

/// Runs a statement prepared once per connection: the savepoint statements run twice per
/// request, so parsing them each time would be measurable.
fn exec(conn: &Connection, sql: &str) -> rusqlite::Result<usize> {
    conn.prepare_cached(sql)?.execute([])
}

fn fail_all(conn: &Connection, completions: Vec<Completion>, why: &str) {
    events::writer_finished(false);
    let _ = conn.execute_batch("ROLLBACK");
    for c in completions {
        c(Err(StorageError::Unavailable(why.to_string())));
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// Frames of a WAL file of `bytes` (a 32-byte header, then 24-byte frame headers and pages).
    pub(in crate::storage::sqlite) fn frames(bytes: u64, page_size: u64) -> u64 {
        bytes.saturating_sub(32) / (24 + page_size)
    }

    /// Without SQLite's autocheckpoint, only the writer's own checkpoint keeps the WAL from
    /// growing with every commit: it must still start over once it holds `checkpoint_pages`.
    #[tokio::test]
    async fn the_writer_checkpoints_after_its_commits_so_the_wal_starts_over() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let path = dir.path().join("wal.sqlite");
        let conn = Connection::open(&path).expect("a database");
        conn.pragma_update(None, "journal_mode", "WAL").expect("WAL mode");
        conn.execute_batch("CREATE TABLE t (x BLOB)").expect("a table");
        let page_size: u64 = conn.query_row("PRAGMA page_size", [], |r| r.get(0)).expect("the page size");
        let limits = WriterLimits { max_batch: 4, queue_depth: 16, max_wait: Duration::ZERO, checkpoint_pages: 50 };
        let wal: &'static Wal = Box::leak(Box::default());
        let (writer, thread) = Writer::start(conn, limits, wal, None).expect("the writer starts");

        // A row of 3,000 bytes a commit: a new leaf page each, ~2 frames a commit.
        let mut largest = 0;
        for _ in 0..400 {
            writer
                .submit(|c| Ok(c.execute("INSERT INTO t VALUES (randomblob(3000))", [])?))
                .await
                .expect("the insert commits");
            let wal = std::fs::metadata(dir.path().join("wal.sqlite-wal")).expect("the WAL exists").len();
            largest = largest.max(frames(wal, page_size));
        }
        assert!(largest <= 50 + 10, "the WAL grew to {largest} frames; it must start over past 50");

        // Every row is there, committed and readable by another connection.
        let reader = Connection::open(&path).expect("a reader");
        let rows: i64 = reader.query_row("SELECT count(*) FROM t", [], |r| r.get(0)).expect("a count");
        assert_eq!(rows, 400);
        drop(writer);
        thread.join().expect("the writer ends");
    }
}

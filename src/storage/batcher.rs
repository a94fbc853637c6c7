//! The group-commit batcher of the server-database backends (PostgreSQL, MySQL): one task per
//! process takes every queued
//! write (up to `max_batch`), locks the resource rows they declared in one global order, decides
//! the batch's orders together by admission ([`crate::apply::batch`]), runs every other write in
//! its own savepoint, commits once, and only then answers each. A write's own failure (or retry
//! answer) rolls back its savepoint alone; a transient failure of the batch (deadlock,
//! serialization failure, lost connection) reruns the whole batch, which is why a write is a
//! closure that can run again, up to `max_retries` times before everyone in it is answered
//! `Unavailable`.
//!
//! Written once for both: a backend says how to run an order or a reservation move on its own,
//! how to lock and read the batch's rows, and how to number its events ([`SqlBackend`]); the
//! batching, admission, savepoints, retries and answers are the same.

use std::time::Duration;

use futures::future::BoxFuture;
use rand::Rng;
use sqlx::pool::PoolConnection;
use sqlx::{Connection, Database, Pool};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use crate::apply;
use crate::apply::batch::{Decided, MoveJob};
use crate::apply::port::LockedRows;
use crate::engine::Reservation;
use crate::storage::sqlite::writer::WriterLimits;
use crate::storage::{held_events, OrderExecution, OrderJob, StorageError, Transition};

/// A backend's connection.
pub(crate) type Conn<B> = <<B as SqlBackend>::Db as Database>::Connection;

/// What the batcher needs of a backend: its statements over its connection.
pub(crate) trait SqlBackend: Send + Sync + 'static {
    type Db: Database;

    /// An order decided on its own ([`apply::orders::execute`]).
    fn run_order<'a>(
        conn: &'a mut Conn<Self>,
        job: &'a OrderJob,
        now_ms: i64,
    ) -> BoxFuture<'a, Result<OrderExecution, StorageError>>;

    /// A confirm or release decided on its own ([`apply::reservations::execute`]).
    fn run_move<'a>(
        conn: &'a mut Conn<Self>,
        job: &'a MoveJob,
        now_ms: i64,
    ) -> BoxFuture<'a, Result<Transition, StorageError>>;

    /// [`apply::batch::read_moves`]: the moves' reservations, locked in the global order.
    fn read_moves<'a>(
        conn: &'a mut Conn<Self>,
        moves: &'a [(&'a MoveJob, i64)],
    ) -> BoxFuture<'a, Result<Vec<Option<Reservation>>, StorageError>>;

    /// Locks the resource rows `(tenant, key)` (sorted, once each) in the global order and
    /// returns them as they are now; rows that do not exist are not locked. The outer error is
    /// the locking read's own; the inner one, rows it read and locked but could not parse (a
    /// value this server does not know): the batch can still go on without admission.
    fn lock_rows<'a>(
        conn: &'a mut Conn<Self>,
        rows: &'a [(String, String)],
    ) -> BoxFuture<'a, Result<Result<LockedRows, StorageError>, StorageError>>;

    /// [`apply::batch::admit`] over the backend's port.
    fn admit<'a>(
        conn: &'a mut Conn<Self>,
        jobs: &'a [(&'a OrderJob, i64)],
        moves: &'a [(&'a MoveJob, i64)],
        found: Vec<Option<Reservation>>,
        rows: LockedRows,
    ) -> BoxFuture<'a, Result<Decided, StorageError>>;

    /// Inserts the attempt's held events numbered ([`held_events`]); last before COMMIT.
    fn seal<'a>(conn: &'a mut Conn<Self>) -> BoxFuture<'a, Result<Vec<String>, sqlx::Error>>;

    /// The statement that opens a batch's transaction, when not a plain `BEGIN`: it may set
    /// what holds for the transaction alone, in the same round trip.
    const BEGIN: Option<&'static str> = None;

    /// Whether the batcher keeps its connection from one batch to the next while jobs are
    /// waiting (see [`run_batcher`]), rather than giving it back to the pool after each.
    const KEEP_CONNECTION: bool = false;
}

/// Longest a batch attempt may take once it has its connection. A healthy batch takes
/// milliseconds, or a few seconds queued behind other processes' batches on a hot row; a
/// partition that swallows packets mid-statement would otherwise hold the batcher (and every
/// write of this process) until TCP gives up, which takes many minutes. Kept under the default
/// request timeout (30 s) so clients hear `503 unavailable` rather than time out.
pub(crate) const ATTEMPT_DEADLINE: Duration = Duration::from_secs(10);

/// Backoff before the first rerun of a failed batch; it doubles per attempt up to the cap.
const RETRY_BASE_MS: u64 = 5;
const RETRY_CAP_MS: u64 = 200;

/// A write: runs its statements on the batch's connection. It may run more than once (the batch
/// is retried after a transient failure), so it clones its inputs on every run; the caller gets
/// the result of the run that committed.
pub(crate) type Work<B, T> =
    Box<dyn for<'c> Fn(&'c mut Conn<B>) -> BoxFuture<'c, Result<T, StorageError>> + Send + Sync>;

/// The resource rows `(tenant, key)` a write will update, as far as it knows them beforehand.
///
/// Why: a batch holds every lock it takes until its commit, and its jobs run one after another,
/// so two processes' batches would lock the same hot rows in different orders (A then B here, B
/// then A there) and deadlock, costing a `deadlock_timeout` (1 s by default) before the retry.
/// Locking the declared rows of the whole batch first, in one global order, makes every process
/// take them in that order, and before any idempotency row, so those cycles cannot form.
pub(crate) type LockSet = Vec<(String, String)>;

/// How one run of a job went, as the batch sees it.
pub(crate) enum Ran {
    /// Succeeded: keep its effects.
    Kept,
    /// Failed for its own reason: roll back its savepoint, answer its error, commit the rest.
    Failed,
    /// Failed for a passing reason; the database may have aborted the transaction, so the whole batch
    /// is rolled back and run again.
    Transient(String),
}

impl Ran {
    /// How a run that ended with `result` went.
    fn of<T>(result: &Result<T, StorageError>) -> Self {
        match result {
            Ok(_) => Ran::Kept,
            Err(StorageError::Unavailable(why)) => Ran::Transient(why.clone()),
            // Its own refusal or retry answer: it alone is rolled back, the batch goes on.
            Err(StorageError::Internal(_) | StorageError::PlanRefused(_) | StorageError::RetryLater(_)) => Ran::Failed,
        }
    }
}

/// What a job's caller hears once its batch's fate is known: the committed run's result.
fn committed<T>(result: Option<Result<T, StorageError>>, batch: Result<(), StorageError>) -> Result<T, StorageError> {
    match batch {
        Ok(()) => result.unwrap_or_else(|| Err(StorageError::Internal("a committed job never ran".into()))),
        Err(err) => Err(err),
    }
}

/// A queued job with its result type erased, so one batch can hold writes of every kind.
pub(crate) trait Queued<B: SqlBackend>: Send {
    fn locks(&self) -> &[(String, String)];
    fn run<'a>(&'a mut self, conn: &'a mut Conn<B>) -> BoxFuture<'a, Ran>;
    /// Answers the caller once the batch's fate is known: `Ok` after a commit.
    fn answer(self: Box<Self>, batch: Result<(), StorageError>);
    /// An order or a reservation move the batch may decide by admission together with its other
    /// orders and moves.
    fn admissible(&mut self) -> Option<Admissible<'_, B>> {
        None
    }
    /// Decided by admission in the current run: it runs no statement of its own.
    fn admitted(&self) -> bool {
        false
    }
}

/// A job batch admission may decide.
pub(crate) enum Admissible<'a, B: SqlBackend> {
    Order(&'a mut PendingOrder<B>),
    Move(&'a mut PendingMove<B>),
}

/// A queued order or reservation move. In each run of its batch it is either decided by
/// admission with the batch's other orders and moves (`admitted`) or on its own in its
/// savepoint, like any job.
pub(crate) struct Decidable<B: SqlBackend, J: Alone<B>> {
    pub(crate) job: J,
    pub(crate) now_ms: i64,
    pub(crate) admitted: bool,
    pub(crate) result: Option<Result<J::Out, StorageError>>,
    pub(crate) reply: oneshot::Sender<Result<J::Out, StorageError>>,
    pub(crate) backend: std::marker::PhantomData<fn() -> B>,
}

impl<B: SqlBackend, J: Alone<B>> Decidable<B, J> {
    /// A job queued at `now_ms`, answered on `reply`.
    pub(crate) fn new(job: J, now_ms: i64, reply: oneshot::Sender<Result<J::Out, StorageError>>) -> Self {
        Self { job, now_ms, admitted: false, result: None, reply, backend: std::marker::PhantomData }
    }
}

pub(crate) type PendingOrder<B> = Decidable<B, std::sync::Arc<OrderJob>>;
pub(crate) type PendingMove<B> = Decidable<B, MoveJob>;

/// What a [`Decidable`] job is and does on its own.
pub(crate) trait Alone<B: SqlBackend>: Sized + Send + Sync + 'static {
    type Out: Send + 'static;
    fn admissible(queued: &mut Decidable<B, Self>) -> Admissible<'_, B>;
}

impl<B: SqlBackend> Alone<B> for std::sync::Arc<OrderJob> {
    type Out = OrderExecution;

    fn admissible(queued: &mut PendingOrder<B>) -> Admissible<'_, B> {
        Admissible::Order(queued)
    }
}

impl<B: SqlBackend> Alone<B> for MoveJob {
    type Out = Transition;

    fn admissible(queued: &mut PendingMove<B>) -> Admissible<'_, B> {
        Admissible::Move(queued)
    }
}

/// Runs a decidable job on its own: an order or a move.
trait RunAlone<B: SqlBackend>: Alone<B> {
    fn run_alone<'a>(&'a self, conn: &'a mut Conn<B>, now_ms: i64) -> BoxFuture<'a, Result<Self::Out, StorageError>>;
}

impl<B: SqlBackend> RunAlone<B> for std::sync::Arc<OrderJob> {
    fn run_alone<'a>(
        &'a self,
        conn: &'a mut Conn<B>,
        now_ms: i64,
    ) -> BoxFuture<'a, Result<OrderExecution, StorageError>> {
        B::run_order(conn, self, now_ms)
    }
}

impl<B: SqlBackend> RunAlone<B> for MoveJob {
    fn run_alone<'a>(&'a self, conn: &'a mut Conn<B>, now_ms: i64) -> BoxFuture<'a, Result<Transition, StorageError>> {
        B::run_move(conn, self, now_ms)
    }
}

impl<B: SqlBackend, J: RunAlone<B>> Queued<B> for Decidable<B, J> {
    fn locks(&self) -> &[(String, String)] {
        &[]
    }

    fn run<'a>(&'a mut self, conn: &'a mut Conn<B>) -> BoxFuture<'a, Ran> {
        Box::pin(async move {
            let result = self.job.run_alone(conn, self.now_ms).await;
            let ran = Ran::of(&result);
            self.result = Some(result);
            ran
        })
    }

    fn answer(self: Box<Self>, batch: Result<(), StorageError>) {
        let _ = self.reply.send(committed(self.result, batch));
    }

    fn admissible(&mut self) -> Option<Admissible<'_, B>> {
        Some(J::admissible(self))
    }

    fn admitted(&self) -> bool {
        self.admitted
    }
}

pub(crate) struct Pending<B: SqlBackend, T> {
    pub(crate) locks: LockSet,
    pub(crate) work: Work<B, T>,
    /// The latest run's result; only a committed one is ever handed out.
    pub(crate) result: Option<Result<T, StorageError>>,
    pub(crate) reply: oneshot::Sender<Result<T, StorageError>>,
}

impl<B: SqlBackend, T: Send + 'static> Queued<B> for Pending<B, T> {
    fn locks(&self) -> &[(String, String)] {
        &self.locks
    }

    fn run<'a>(&'a mut self, conn: &'a mut Conn<B>) -> BoxFuture<'a, Ran> {
        Box::pin(async move {
            let result = (self.work)(conn).await;
            let ran = Ran::of(&result);
            self.result = Some(result);
            ran
        })
    }

    fn answer(self: Box<Self>, batch: Result<(), StorageError>) {
        // The caller may have gone away (client disconnected); its effects stand.
        let _ = self.reply.send(committed(self.result, batch));
    }
}

/// Why a batch did not commit.
enum BatchFailure {
    /// Certainly not committed, for a passing reason: run it again.
    Retry(String),
    /// Batch admission failed for a reason that is not passing (a bug): run the batch again
    /// at once with every order decided on its own.
    WithoutAdmission(String),
    /// Give up now (no connection within the timeout, a commit whose outcome is unknown, or a
    /// failure that is not transient).
    Final(StorageError),
}

impl BatchFailure {
    /// Sorts an error of batch admission: a passing one reruns the batch, any other reruns it
    /// without admission.
    fn of_admission(err: StorageError) -> Self {
        match err {
            StorageError::Unavailable(why) => BatchFailure::Retry(why),
            other => BatchFailure::WithoutAdmission(other.to_string()),
        }
    }

    /// Sorts an error of the locking read: a passing one reruns the batch; any other (rows the
    /// backend could not parse, say) reruns it without admission, which still locks the rows
    /// but does not look at them (a locking read that fails as such fails that rerun too).
    fn of_locking(err: StorageError) -> Self {
        match err {
            StorageError::Unavailable(why) => BatchFailure::Retry(why),
            other => BatchFailure::WithoutAdmission(other.to_string()),
        }
    }

    /// Sorts an error of a statement the batcher itself runs (BEGIN, SAVEPOINT, RELEASE, ...).
    fn of(err: sqlx::Error) -> Self {
        match StorageError::from(err) {
            StorageError::Unavailable(why) => BatchFailure::Retry(why),
            internal => BatchFailure::Final(internal),
        }
    }
}

/// The batcher: one task per process, ending when every sender is gone and the queue is empty.
///
/// With [`SqlBackend::KEEP_CONNECTION`], while jobs are waiting when a batch ends, the next
/// batch runs on the same connection: a pool tests a connection with a round trip when it lends
/// it and again when it is given back, two round trips a batch, one of them before the batch's
/// first statement. Once the queue is empty the connection goes back to the pool, which keeps
/// it alive and within its lifetime; and always, if the pool has only that one connection for
/// everything else too.
pub(crate) async fn run_batcher<B: SqlBackend>(
    pool: Pool<B::Db>,
    mut rx: mpsc::Receiver<Box<dyn Queued<B>>>,
    limits: WriterLimits,
    max_retries: u32,
) {
    let max_batch = limits.max_batch.max(1);
    let mut batch: Vec<Box<dyn Queued<B>>> = Vec::with_capacity(max_batch);
    let mut kept: Option<PoolConnection<B::Db>> = None;
    let keep = B::KEEP_CONNECTION && pool.options().get_max_connections() > 1;
    loop {
        if !keep || rx.is_empty() {
            kept = None;
        }
        let Some(first) = rx.recv().await else { break };
        batch.push(first);
        fill(&mut rx, &mut batch, max_batch, limits.max_wait).await;
        metrics::histogram!("stockd_batch_size").record(batch.len() as f64);
        let started = Instant::now();
        commit_batch(&pool, &mut kept, &mut batch, max_retries).await;
        metrics::histogram!("stockd_batch_commit_seconds").record(started.elapsed().as_secs_f64());
    }
}

/// Takes every job already queued, lingering up to `max_wait` for more if configured.
async fn fill<B: SqlBackend>(
    rx: &mut mpsc::Receiver<Box<dyn Queued<B>>>,
    batch: &mut Vec<Box<dyn Queued<B>>>,
    max: usize,
    wait: Duration,
) {
    let deadline = Instant::now() + wait;
    while batch.len() < max {
        match rx.try_recv() {
            Ok(job) => batch.push(job),
            Err(mpsc::error::TryRecvError::Disconnected) => return,
            Err(mpsc::error::TryRecvError::Empty) if Instant::now() >= deadline => return,
            Err(mpsc::error::TryRecvError::Empty) => match tokio::time::timeout_at(deadline, rx.recv()).await {
                Ok(Some(job)) => batch.push(job),
                Ok(None) | Err(_) => return,
            },
        }
    }
}

/// Runs the batch until it commits or may not be retried any more, then answers every job.
async fn commit_batch<B: SqlBackend>(
    pool: &Pool<B::Db>,
    kept: &mut Option<PoolConnection<B::Db>>,
    batch: &mut Vec<Box<dyn Queued<B>>>,
    max_retries: u32,
) {
    let rows = declared_rows(batch);
    let mut attempt = 0;
    let mut admission = true;
    let outcome = loop {
        match run_batch(pool, kept, batch, &rows, admission).await {
            Ok(()) => {
                crate::events::committed();
                break Ok(());
            }
            Err(BatchFailure::WithoutAdmission(why)) if admission => {
                tracing::error!(reason = %why, "batch admission failed; deciding the batch's orders one by one");
                admission = false;
            }
            Err(BatchFailure::WithoutAdmission(why)) => break Err(StorageError::Internal(why)),
            Err(BatchFailure::Retry(why)) if attempt < max_retries => {
                tracing::debug!(attempt, reason = %why, "batch failed for a passing reason; running it again");
                metrics::counter!("stockd_batch_retries_total").increment(1);
                tokio::time::sleep(backoff(attempt)).await;
                attempt += 1;
            }
            Err(BatchFailure::Retry(why)) => {
                tracing::warn!(attempts = attempt + 1, reason = %why, "batch kept failing; giving up");
                break Err(StorageError::Unavailable(why));
            }
            Err(BatchFailure::Final(err)) => {
                tracing::error!(error = %err, "batch failed");
                break Err(err);
            }
        }
    };
    for job in batch.drain(..) {
        job.answer(outcome.as_ref().map(|_| ()).map_err(duplicate));
    }
}

/// `StorageError` is not `Clone` (neither is `sqlx::Error`); every job of a failed batch gets
/// the same error.
fn duplicate(err: &StorageError) -> StorageError {
    match err {
        StorageError::Unavailable(why) => StorageError::Unavailable(why.clone()),
        StorageError::Internal(why) => StorageError::Internal(why.clone()),
        StorageError::PlanRefused(why) => StorageError::PlanRefused(why.clone()),
        StorageError::RetryLater(why) => StorageError::RetryLater(why.clone()),
    }
}

/// Jittered exponential backoff: 5 ms, 10 ms, 20 ms, ... capped at 200 ms, each drawn from its
/// upper half so that processes whose batches collided do not collide again in step.
fn backoff(attempt: u32) -> Duration {
    let ceiling = RETRY_BASE_MS.saturating_mul(1u64 << attempt.min(16)).min(RETRY_CAP_MS);
    Duration::from_millis(rand::rng().random_range(ceiling / 2..=ceiling))
}

/// One attempt on one pooled connection, bounded by [`ATTEMPT_DEADLINE`]: the connection in
/// `kept` if there is one, and it stays there if the attempt commits ([`run_batcher`] decides
/// whether it is kept for the next batch). After any failure it goes back to the pool (which tests
/// it, and rolls back what is left open) or is closed, and the next attempt takes one from the
/// pool: a kept connection the database ended while the batcher was between batches fails the
/// attempt as passing, and the batch runs again.
async fn run_batch<B: SqlBackend>(
    pool: &Pool<B::Db>,
    kept: &mut Option<PoolConnection<B::Db>>,
    batch: &mut [Box<dyn Queued<B>>],
    rows: &[(String, String)],
    admission: bool,
) -> Result<(), BatchFailure> {
    let mut conn = match kept.take() {
        Some(conn) => conn,
        // No retry when no connection comes within `acquire_timeout`: the pool has already
        // waited (and retried connecting) that long, and callers should hear `Unavailable`
        // promptly.
        None => pool
            .acquire()
            .await
            .map_err(|e| BatchFailure::Final(StorageError::Unavailable(format!("no database connection: {e}"))))?,
    };
    let attempt = held_events::scope(attempt::<B>(&mut conn, batch, rows, admission));
    match tokio::time::timeout(ATTEMPT_DEADLINE, attempt).await {
        Ok(Ok(())) => {
            *kept = Some(conn);
            Ok(())
        }
        Ok(Err(failure)) => Err(failure),
        Err(_) => {
            // The connection stopped answering mid-statement. It must never serve anyone else,
            // so it is closed here rather than returned to the pool.
            drop(conn.detach());
            Err(BatchFailure::Final(StorageError::Unavailable(format!(
                "the database did not answer within {ATTEMPT_DEADLINE:?}; outcome unknown"
            ))))
        }
    }
}

/// BEGIN, the batch's reservation and resource row locks with admission, each other job in its
/// savepoint, COMMIT.
async fn attempt<B: SqlBackend>(
    conn: &mut Conn<B>,
    batch: &mut [Box<dyn Queued<B>>],
    rows: &[(String, String)],
    admission: bool,
) -> Result<(), BatchFailure> {
    // sqlx's transaction guards roll back whatever is left open if this returns early (or is
    // dropped), before the connection can serve anyone else.
    let mut tx = match B::BEGIN {
        Some(statement) => conn.begin_with(statement).await,
        None => conn.begin().await,
    }
    .map_err(BatchFailure::of)?;
    if let Err(why) = lock_and_admit::<B>(&mut tx, batch, rows, admission).await {
        // Best effort: if the connection is gone, the server has rolled back already.
        let _ = tx.rollback().await;
        return Err(why);
    }
    for job in batch.iter_mut() {
        if job.admitted() {
            continue;
        }
        let mut savepoint = Connection::begin(&mut *tx).await.map_err(BatchFailure::of)?;
        let mark = held_events::mark();
        match job.run(&mut savepoint).await {
            Ran::Kept => savepoint.commit().await.map_err(BatchFailure::of)?,
            Ran::Failed => {
                held_events::rollback_to(mark);
                savepoint.rollback().await.map_err(BatchFailure::of)?
            }
            Ran::Transient(why) => {
                drop(savepoint);
                // Best effort: if the connection is gone, the server has rolled back already.
                let _ = tx.rollback().await;
                return Err(BatchFailure::Retry(why));
            }
        }
    }
    // Last before COMMIT, after every row lock the jobs took (see `events`).
    let sealed = B::seal(&mut tx).await.map_err(BatchFailure::of)?;
    tx.commit().await.map_err(|e| match e {
        // The server answered the COMMIT with an error: the transaction did not commit.
        sqlx::Error::Database(_) => BatchFailure::of(e),
        // No answer (connection lost): it may or may not have committed. Running the batch
        // again could apply a non-idempotent write twice, so its callers hear `Unavailable`
        // and find out by reading (idempotent requests replay on retry).
        other => BatchFailure::Final(StorageError::Unavailable(format!("commit outcome unknown: {other}"))),
    })?;
    crate::events::count_written(sealed.iter().map(String::as_str));
    Ok(())
}

/// Locks what the batch will write and decides its orders and reservation moves together (see
/// [`apply::batch`]), marking those it decided; the rest run on their own. The locks come in one
/// global order in every process: the moves' reservations first (their lines name more resource
/// rows), then every resource row, each kind sorted. It runs first in the transaction, so a
/// failure of it needs no savepoint: the batch is run again, without admission if the failure
/// was not passing.
async fn lock_and_admit<B: SqlBackend>(
    tx: &mut Conn<B>,
    batch: &mut [Box<dyn Queued<B>>],
    declared: &[(String, String)],
    admission: bool,
) -> Result<(), BatchFailure> {
    let mut orders: Vec<&mut PendingOrder<B>> = Vec::new();
    let mut moves: Vec<&mut PendingMove<B>> = Vec::new();
    for job in batch.iter_mut() {
        match job.admissible() {
            Some(Admissible::Order(order)) => {
                order.admitted = false;
                orders.push(order);
            }
            Some(Admissible::Move(queued)) => {
                queued.admitted = false;
                moves.push(queued);
            }
            None => {}
        }
    }
    let decide = admission && orders.len() + moves.len() >= 2;
    let moving: Vec<(&MoveJob, i64)> = moves.iter().map(|m| (&m.job, m.now_ms)).collect();
    let found = if decide { B::read_moves(tx, &moving).await.map_err(BatchFailure::of_admission)? } else { Vec::new() };
    let more: Vec<(String, String)> =
        apply::batch::move_resources(&moving, &found).map(|(t, k)| (t.to_string(), k.to_string())).collect();
    let rows = if more.is_empty() {
        std::borrow::Cow::Borrowed(declared)
    } else {
        let mut all = declared.to_vec();
        all.extend(more);
        all.sort_unstable();
        all.dedup();
        std::borrow::Cow::Owned(all)
    };
    let locked = B::lock_rows(tx, &rows).await.map_err(BatchFailure::of_locking)?;
    if !decide {
        // Locked in the global order all the same; rows that could not be parsed concern only
        // the jobs that name them, which find out on their own.
        return Ok(());
    }
    let rows = locked.map_err(BatchFailure::of_locking)?;
    let jobs: Vec<(&OrderJob, i64)> = orders.iter().map(|o| (&*o.job, o.now_ms)).collect();
    let decided = B::admit(tx, &jobs, &moving, found, rows).await.map_err(BatchFailure::of_admission)?;
    for (order, outcome) in orders.into_iter().zip(decided.orders) {
        if let Some(execution) = outcome {
            metrics::counter!("stockd_orders_admitted_in_batch_total").increment(1);
            order.result = Some(Ok(execution));
            order.admitted = true;
        }
    }
    for (queued, outcome) in moves.into_iter().zip(decided.moves) {
        if let Some(transition) = outcome {
            queued.result = Some(Ok(transition));
            queued.admitted = true;
        }
    }
    Ok(())
}

/// The resource rows a batch's jobs declared (see [`LockSet`]) and its orders' plans name,
/// sorted and once each; computed once per batch, not per attempt.
fn declared_rows<B: SqlBackend>(batch: &mut [Box<dyn Queued<B>>]) -> Vec<(String, String)> {
    let mut rows: Vec<(String, String)> = batch.iter().flat_map(|job| job.locks()).cloned().collect();
    for job in batch.iter_mut() {
        if let Some(Admissible::Order(order)) = job.admissible() {
            let tenant = order.job.tenant.as_str().to_owned();
            rows.extend(order.job.plan.resources().map(|key| (tenant.clone(), key.as_str().to_owned())));
        }
    }
    rows.sort_unstable();
    rows.dedup();
    rows
}

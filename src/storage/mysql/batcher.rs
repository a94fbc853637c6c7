//! The group-commit batcher of the MySQL backend (the same design as PostgreSQL's): one task per process takes every queued
//! write (up to `max_batch`), locks the resource rows they declared in one global order, decides
//! the batch's orders together by admission ([`crate::apply::batch`]), runs every other write in
//! its own savepoint, commits once, and only then answers each. A write's own failure (or retry
//! answer) rolls back its savepoint alone; a transient failure of the batch (deadlock,
//! serialization failure, lost connection) reruns the whole batch, which is why a write is a
//! closure that can run again, up to `max_retries` times before everyone in it is answered
//! `Unavailable`.

use std::time::Duration;

use futures::future::BoxFuture;
use rand::Rng;
use sqlx::mysql::{MySqlPool, MySqlRow};
use sqlx::{Connection, MySqlConnection};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use super::acquire;
use super::port::{self, MyPort};
use crate::apply;
use crate::apply::batch::MoveJob;
use crate::storage::sqlite::writer::WriterLimits;
use crate::storage::{OrderExecution, OrderJob, StorageError, Transition};

/// Longest a batch attempt may take once it has its connection. A healthy batch takes
/// milliseconds, or a few seconds queued behind other processes' batches on a hot row; a
/// partition that swallows packets mid-statement would otherwise hold the batcher (and every
/// write of this process) until TCP gives up, which takes many minutes. Kept under the default
/// request timeout (30 s) so clients hear `503 unavailable` rather than time out.
pub(super) const ATTEMPT_DEADLINE: Duration = Duration::from_secs(10);

/// Backoff before the first rerun of a failed batch; it doubles per attempt up to the cap.
const RETRY_BASE_MS: u64 = 5;
const RETRY_CAP_MS: u64 = 200;

/// A write: runs its statements on the batch's connection. It may run more than once (the batch
/// is retried after a transient failure), so it clones its inputs on every run; the caller gets
/// the result of the run that committed.
pub(super) type Work<T> =
    Box<dyn for<'c> Fn(&'c mut MySqlConnection) -> BoxFuture<'c, Result<T, StorageError>> + Send + Sync>;

/// The resource rows `(tenant, key)` a write will update, as far as it knows them beforehand.
///
/// Why: a batch holds every lock it takes until its commit, and its jobs run one after another,
/// so two processes' batches would lock the same hot rows in different orders (A then B here, B
/// then A there) and deadlock, costing a `deadlock_timeout` (1 s by default) before the retry.
/// Locking the declared rows of the whole batch first, in one global order, makes every process
/// take them in that order, and before any idempotency row, so those cycles cannot form.
pub(super) type LockSet = Vec<(String, String)>;

/// Helps type inference see a closure as a [`Work`] (the higher-ranked lifetime needs a hint).
pub(super) fn work<T, F>(f: F) -> Work<T>
where
    F: for<'c> Fn(&'c mut MySqlConnection) -> BoxFuture<'c, Result<T, StorageError>> + Send + Sync + 'static,
{
    Box::new(f)
}

/// How one run of a job went, as the batch sees it.
pub(super) enum Ran {
    /// Succeeded: keep its effects.
    Kept,
    /// Failed for its own reason: roll back its savepoint, answer its error, commit the rest.
    Failed,
    /// Failed for a passing reason; MySQL has aborted the transaction, so the whole batch
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
pub(super) trait Queued: Send {
    fn locks(&self) -> &[(String, String)];
    fn run<'a>(&'a mut self, conn: &'a mut MySqlConnection) -> BoxFuture<'a, Ran>;
    /// Answers the caller once the batch's fate is known: `Ok` after a commit.
    fn answer(self: Box<Self>, batch: Result<(), StorageError>);
    /// An order or a reservation move the batch may decide by admission together with its other
    /// orders and moves.
    fn admissible(&mut self) -> Option<Admissible<'_>> {
        None
    }
    /// Decided by admission in the current run: it runs no statement of its own.
    fn admitted(&self) -> bool {
        false
    }
}

/// A job batch admission may decide.
pub(super) enum Admissible<'a> {
    Order(&'a mut PendingOrder),
    Move(&'a mut PendingMove),
}

/// A queued order or reservation move. In each run of its batch it is either decided by
/// admission with the batch's other orders and moves (`admitted`) or on its own in its
/// savepoint, like any job.
pub(super) struct Decidable<J: Alone> {
    pub(super) job: J,
    pub(super) now_ms: i64,
    pub(super) admitted: bool,
    pub(super) result: Option<Result<J::Out, StorageError>>,
    pub(super) reply: oneshot::Sender<Result<J::Out, StorageError>>,
}

pub(super) type PendingOrder = Decidable<std::sync::Arc<OrderJob>>;
pub(super) type PendingMove = Decidable<MoveJob>;

/// What a [`Decidable`] job is and does on its own.
pub(super) trait Alone: Sized + Send + Sync + 'static {
    type Out: Send + 'static;
    fn run<'a>(&'a self, conn: &'a mut MySqlConnection, now_ms: i64) -> BoxFuture<'a, Result<Self::Out, StorageError>>;
    fn admissible(queued: &mut Decidable<Self>) -> Admissible<'_>;
}

impl Alone for std::sync::Arc<OrderJob> {
    type Out = OrderExecution;

    fn run<'a>(
        &'a self,
        conn: &'a mut MySqlConnection,
        now_ms: i64,
    ) -> BoxFuture<'a, Result<OrderExecution, StorageError>> {
        Box::pin(async move { apply::orders::execute(&mut MyPort::new(conn), self, now_ms).await })
    }

    fn admissible(queued: &mut PendingOrder) -> Admissible<'_> {
        Admissible::Order(queued)
    }
}

impl Alone for MoveJob {
    type Out = Transition;

    fn run<'a>(&'a self, conn: &'a mut MySqlConnection, now_ms: i64) -> BoxFuture<'a, Result<Transition, StorageError>> {
        Box::pin(async move { apply::reservations::execute(&mut MyPort::new(conn), self, now_ms).await })
    }

    fn admissible(queued: &mut PendingMove) -> Admissible<'_> {
        Admissible::Move(queued)
    }
}

impl<J: Alone> Queued for Decidable<J> {
    fn locks(&self) -> &[(String, String)] {
        &[]
    }

    fn run<'a>(&'a mut self, conn: &'a mut MySqlConnection) -> BoxFuture<'a, Ran> {
        Box::pin(async move {
            let result = self.job.run(conn, self.now_ms).await;
            let ran = Ran::of(&result);
            self.result = Some(result);
            ran
        })
    }

    fn answer(self: Box<Self>, batch: Result<(), StorageError>) {
        let _ = self.reply.send(committed(self.result, batch));
    }

    fn admissible(&mut self) -> Option<Admissible<'_>> {
        Some(J::admissible(self))
    }

    fn admitted(&self) -> bool {
        self.admitted
    }
}

pub(super) struct Pending<T> {
    pub(super) locks: LockSet,
    pub(super) work: Work<T>,
    /// The latest run's result; only a committed one is ever handed out.
    pub(super) result: Option<Result<T, StorageError>>,
    pub(super) reply: oneshot::Sender<Result<T, StorageError>>,
}

impl<T: Send + 'static> Queued for Pending<T> {
    fn locks(&self) -> &[(String, String)] {
        &self.locks
    }

    fn run<'a>(&'a mut self, conn: &'a mut MySqlConnection) -> BoxFuture<'a, Ran> {
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

    /// Sorts an error of a statement the batcher itself runs (BEGIN, SAVEPOINT, RELEASE, ...).
    fn of(err: sqlx::Error) -> Self {
        match StorageError::from(err) {
            StorageError::Unavailable(why) => BatchFailure::Retry(why),
            internal => BatchFailure::Final(internal),
        }
    }
}

/// The batcher: one task per process, ending when every sender is gone and the queue is empty.
pub(super) async fn run_batcher(
    pool: MySqlPool,
    mut rx: mpsc::Receiver<Box<dyn Queued>>,
    limits: WriterLimits,
    max_retries: u32,
) {
    let max_batch = limits.max_batch.max(1);
    let mut batch: Vec<Box<dyn Queued>> = Vec::with_capacity(max_batch);
    while let Some(first) = rx.recv().await {
        batch.push(first);
        fill(&mut rx, &mut batch, max_batch, limits.max_wait).await;
        metrics::histogram!("stockd_batch_size").record(batch.len() as f64);
        let started = Instant::now();
        commit_batch(&pool, &mut batch, max_retries).await;
        metrics::histogram!("stockd_batch_commit_seconds").record(started.elapsed().as_secs_f64());
    }
}

/// Takes every job already queued, lingering up to `max_wait` for more if configured.
async fn fill(rx: &mut mpsc::Receiver<Box<dyn Queued>>, batch: &mut Vec<Box<dyn Queued>>, max: usize, wait: Duration) {
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
async fn commit_batch(pool: &MySqlPool, batch: &mut Vec<Box<dyn Queued>>, max_retries: u32) {
    let rows = declared_rows(batch);
    let mut attempt = 0;
    let mut admission = true;
    let outcome = loop {
        match run_batch(pool, batch, &rows, admission).await {
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

/// One attempt on one pooled connection, bounded by [`ATTEMPT_DEADLINE`].
async fn run_batch(
    pool: &MySqlPool,
    batch: &mut [Box<dyn Queued>],
    rows: &[(String, String)],
    admission: bool,
) -> Result<(), BatchFailure> {
    // No retry when no connection comes within `acquire_timeout`: the pool has already waited
    // (and retried connecting) that long, and callers should hear `Unavailable` promptly.
    let mut conn = acquire(pool).await.map_err(BatchFailure::Final)?;
    let attempt = super::events::WRITTEN.scope(Default::default(), attempt(&mut conn, batch, rows, admission));
    match tokio::time::timeout(ATTEMPT_DEADLINE, attempt).await {
        Ok(result) => result,
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
async fn attempt(
    conn: &mut MySqlConnection,
    batch: &mut [Box<dyn Queued>],
    rows: &[(String, String)],
    admission: bool,
) -> Result<(), BatchFailure> {
    // sqlx's transaction guards roll back whatever is left open if this returns early (or is
    // dropped), before the connection can serve anyone else.
    let mut tx = conn.begin().await.map_err(BatchFailure::of)?;
    if let Err(why) = lock_and_admit(&mut tx, batch, rows, admission).await {
        // Best effort: if the connection is gone, the server has rolled back already.
        let _ = tx.rollback().await;
        return Err(why);
    }
    for job in batch.iter_mut() {
        if job.admitted() {
            continue;
        }
        let mut savepoint = Connection::begin(&mut *tx).await.map_err(BatchFailure::of)?;
        let mark = super::events::mark();
        match job.run(&mut savepoint).await {
            Ran::Kept => savepoint.commit().await.map_err(BatchFailure::of)?,
            Ran::Failed => {
                super::events::rollback_to(mark);
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
    let sealed = super::events::seal(&mut tx).await.map_err(BatchFailure::of)?;
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
async fn lock_and_admit(
    tx: &mut MySqlConnection,
    batch: &mut [Box<dyn Queued>],
    declared: &[(String, String)],
    admission: bool,
) -> Result<(), BatchFailure> {
    let mut orders: Vec<&mut PendingOrder> = Vec::new();
    let mut moves: Vec<&mut PendingMove> = Vec::new();
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
    let found = if decide {
        apply::batch::read_moves(&mut MyPort::new(tx), &moving).await.map_err(BatchFailure::of_admission)?
    } else {
        Vec::new()
    };
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
    let locked = lock_declared_rows(tx, &rows).await.map_err(BatchFailure::of)?;
    if !decide {
        return Ok(());
    }
    let rows = port::locked_rows(&locked).map_err(|e| BatchFailure::WithoutAdmission(e.to_string()))?;
    let jobs: Vec<(&OrderJob, i64)> = orders.iter().map(|o| (&*o.job, o.now_ms)).collect();
    let decided = apply::batch::admit(&mut MyPort::new(tx), &jobs, &moving, found, rows)
        .await
        .map_err(BatchFailure::of_admission)?;
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
fn declared_rows(batch: &mut [Box<dyn Queued>]) -> Vec<(String, String)> {
    let mut rows: Vec<(String, String)> = batch.iter().flat_map(|job| job.locks()).cloned().collect();
    for job in batch.iter_mut() {
        if let Some(Admissible::Order(order)) = job.admissible() {
            let tenant = order.job.tenant.to_string();
            rows.extend(order.job.plan.resources().map(|key| (tenant.clone(), key.to_string())));
        }
    }
    rows.sort_unstable();
    rows.dedup();
    rows
}

/// Locks the declared resource rows in one global order and returns them as they are now (for
/// batch admission). Rows that do not exist are simply not locked; the jobs judge them as usual.
async fn lock_declared_rows(conn: &mut MySqlConnection, rows: &[(String, String)]) -> Result<Vec<MySqlRow>, sqlx::Error> {
    port::lock_resources(conn, rows, false).await
}

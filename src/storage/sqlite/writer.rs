//! Group commit for SQLite, which admits one writer at a time. Every write is a job sent to one
//! writer task that owns the only write connection. The task takes every job waiting in its
//! queue (up to `max_batch`), runs each inside its own SAVEPOINT within one transaction, commits
//! once, and only then answers each job. So many requests share one durable fsync, each keeps
//! its own effects, ledger rows and idempotency record, and none is acknowledged before its
//! commit. A job that fails is rolled back to its savepoint alone; a failed commit fails them all.

use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use sqlx::{Connection, Executor, SqliteConnection};
use tokio::sync::{mpsc, oneshot};

use crate::storage::StorageError;

/// Called once the batch's fate is known: `Ok` after a durable commit, `Err` if it failed.
type Completion = Box<dyn FnOnce(Result<(), StorageError>) + Send>;
/// A unit of work: runs its statements, then says whether it succeeded (kept) or not (rolled
/// back to its savepoint), and how to answer its caller once the commit is known.
type Job = Box<dyn for<'c> FnOnce(&'c mut SqliteConnection) -> BoxFuture<'c, (bool, Completion)> + Send>;

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
}

impl Writer {
    /// Starts the writer task on `conn`. It ends once every `Writer` handle is dropped and the
    /// queue is drained; the returned handle resolves then.
    pub fn start(conn: SqliteConnection, limits: WriterLimits) -> (Self, tokio::task::JoinHandle<()>) {
        let (tx, rx) = mpsc::channel(limits.queue_depth.max(1));
        let task = tokio::spawn(run(conn, rx, limits));
        (Self { queue: tx }, task)
    }

    /// Runs `work` in the next batch and returns its result once that batch is durable.
    pub async fn submit<T, F>(&self, work: F) -> Result<T, StorageError>
    where
        T: Send + 'static,
        F: for<'c> FnOnce(&'c mut SqliteConnection) -> BoxFuture<'c, Result<T, StorageError>> + Send + 'static,
    {
        let (tx, rx) = oneshot::channel();
        let job: Job = Box::new(move |conn| {
            Box::pin(async move {
                let result = work(conn).await;
                let ok = result.is_ok();
                let completion: Completion = Box::new(move |commit| {
                    // The caller may have gone away (client disconnected); its effects stand.
                    let _ = tx.send(commit.and(result));
                });
                (ok, completion)
            })
        });
        self.queue.send(job).await.map_err(|_| StorageError::Unavailable("writer stopped".into()))?;
        rx.await.map_err(|_| StorageError::Unavailable("write was not committed".into()))?
    }
}

async fn run(mut conn: SqliteConnection, mut rx: mpsc::Receiver<Job>, limits: WriterLimits) {
    let mut batch: Vec<Job> = Vec::with_capacity(limits.max_batch);
    while let Some(first) = rx.recv().await {
        batch.push(first);
        fill(&mut rx, &mut batch, limits).await;
        metrics::histogram!("stockd_batch_size").record(batch.len() as f64);
        let started = Instant::now();
        commit_batch(&mut conn, &mut batch).await;
        metrics::histogram!("stockd_batch_commit_seconds").record(started.elapsed().as_secs_f64());
    }
    let _ = conn.close().await;
}

/// Takes every job already queued, lingering up to `max_wait` if configured.
async fn fill(rx: &mut mpsc::Receiver<Job>, batch: &mut Vec<Job>, limits: WriterLimits) {
    let deadline = Instant::now() + limits.max_wait;
    while batch.len() < limits.max_batch {
        match rx.try_recv() {
            Ok(job) => batch.push(job),
            Err(_) if limits.max_wait.is_zero() => return,
            Err(_) => match tokio::time::timeout_at(deadline.into(), rx.recv()).await {
                Ok(Some(job)) => batch.push(job),
                _ => return,
            },
        }
    }
}

async fn commit_batch(conn: &mut SqliteConnection, batch: &mut Vec<Job>) {
    if let Err(err) = conn.execute("BEGIN IMMEDIATE").await {
        tracing::error!(error = %err, "writer could not begin a transaction");
        // Dropping the jobs drops their reply channels: callers get `Unavailable`.
        batch.clear();
        return;
    }
    let mut completions = Vec::with_capacity(batch.len());
    for job in batch.drain(..) {
        if let Err(err) = conn.execute("SAVEPOINT job").await {
            tracing::error!(error = %err, "writer could not open a savepoint");
            break;
        }
        let (ok, completion) = job(conn).await;
        let end = if ok { "RELEASE job" } else { "ROLLBACK TO job; RELEASE job" };
        if let Err(err) = conn.execute(end).await {
            tracing::error!(error = %err, "writer could not close a savepoint");
            completions.push(completion);
            fail_all(conn, completions, "savepoint failed").await;
            return;
        }
        completions.push(completion);
    }
    // Any job still in `batch` (after a savepoint failure) is dropped: its caller gets Unavailable.
    batch.clear();
    match conn.execute("COMMIT").await {
        Ok(_) => completions.into_iter().for_each(|c| c(Ok(()))),
        Err(err) => {
            tracing::error!(error = %err, "group commit failed");
            fail_all(conn, completions, "commit failed").await;
        }
    }
}

async fn fail_all(conn: &mut SqliteConnection, completions: Vec<Completion>, why: &str) {
    let _ = conn.execute("ROLLBACK").await;
    for c in completions {
        c(Err(StorageError::Unavailable(why.to_string())));
    }
}

//! Background jobs: reservation expiry, reconciliation, idempotency-record purge. Each is a loop
//! with a fixed interval that stops when the shutdown signal fires; each does bounded work per
//! tick and never panics the process on a storage error (it logs and tries again next tick).

pub mod settlement;

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::engine::Pass;
use crate::storage::Storage;
use crate::time::now_ms;

/// Intervals and bounds of the jobs.
#[derive(Debug, Clone)]
pub struct JobSettings {
    pub sweep_interval: Duration,
    pub sweep_batch: u32,
    /// `None` disables the periodic reconciliation.
    pub reconcile_interval: Option<Duration>,
    /// Every this many reconciliation passes one is full; 0: never.
    pub reconcile_full_every: u64,
    pub purge_interval: Duration,
    pub idempotency_retention: Duration,
    /// `None` disables the bucket rebalancer.
    pub rebalance_interval: Option<Duration>,
    pub rebalance_batch: u32,
}

/// Most idempotency records deleted per purge transaction, so a purge never holds the writer long.
const PURGE_BATCH: u32 = 5_000;

/// Starts every job; they stop when `shutdown` becomes true.
pub fn spawn(storage: Arc<dyn Storage>, settings: JobSettings, shutdown: watch::Receiver<bool>) -> Vec<JoinHandle<()>> {
    let mut jobs = vec![
        spawn_loop(settings.sweep_interval, shutdown.clone(), {
            let storage = storage.clone();
            move || expire(storage.clone(), settings.sweep_batch)
        }),
        spawn_loop(settings.purge_interval, shutdown.clone(), {
            let storage = storage.clone();
            let retention_ms = i64::try_from(settings.idempotency_retention.as_millis()).unwrap_or(i64::MAX);
            move || purge(storage.clone(), retention_ms)
        }),
    ];
    if let Some(interval) = settings.rebalance_interval {
        let storage = storage.clone();
        let batch = settings.rebalance_batch;
        jobs.push(spawn_loop(interval, shutdown.clone(), move || rebalance(storage.clone(), batch)));
    }
    if let Some(interval) = settings.reconcile_interval {
        let (full_every, mut passes) = (settings.reconcile_full_every, 0u64);
        jobs.push(spawn_loop(interval, shutdown, move || {
            passes = passes.wrapping_add(1);
            let pass = if full_every > 0 && passes % full_every == 0 { Pass::Full } else { Pass::Incremental };
            reconcile(storage.clone(), pass)
        }));
    }
    jobs
}

fn spawn_loop<F, Fut>(interval: Duration, mut shutdown: watch::Receiver<bool>, mut tick: F) -> JoinHandle<()>
where
    F: FnMut() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    tokio::spawn(async move {
        let mut timer = tokio::time::interval(interval);
        timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = timer.tick() => tick().await,
                _ = shutdown.changed() => return,
            }
            if *shutdown.borrow() {
                return;
            }
        }
    })
}

/// Expires held reservations past their deadline, a bounded batch per transaction, until none
/// is due (so a backlog clears within one tick rather than one batch per tick).
async fn expire(storage: Arc<dyn Storage>, batch: u32) {
    loop {
        match storage.expire_due(now_ms(), batch).await {
            Ok(n) => {
                if n > 0 {
                    metrics::counter!("stockd_reservations_expired_total").increment(n);
                    tracing::debug!(expired = n, "reservations expired");
                }
                if n < u64::from(batch) {
                    return;
                }
            }
            Err(err) => {
                tracing::warn!(error = %err, "reservation expiry failed; will retry");
                return;
            }
        }
    }
}

/// Evens out bucketed resources whose buckets drifted apart, a bounded batch per transaction.
async fn rebalance(storage: Arc<dyn Storage>, batch: u32) {
    match storage.rebalance_buckets(now_ms(), batch).await {
        Ok(0) => {}
        Ok(n) => {
            metrics::counter!("stockd_bucket_rebalances_total").increment(n);
            tracing::debug!(resources = n, "buckets rebalanced");
        }
        Err(err) => tracing::warn!(error = %err, "bucket rebalance failed; will retry"),
    }
}

async fn reconcile(storage: Arc<dyn Storage>, pass: Pass) {
    match storage.reconcile(None, pass).await {
        Ok(report) => {
            tracing::debug!(pass = ?report.pass, ledger_rows = report.ledger_rows_read, "reconciliation pass");
            metrics::counter!("stockd_reconciliation_ledger_rows_read_total").increment(report.ledger_rows_read);
            metrics::gauge!("stockd_reconciliation_checked_resources").set(report.checked as f64);
            metrics::gauge!("stockd_reconciliation_drift_resources").set(report.drift.len() as f64);
            for d in &report.drift {
                tracing::error!(key = %d.key, expected = ?d.expected, actual = ?d.actual, "reconciliation drift");
            }
        }
        Err(err) => tracing::warn!(error = %err, "reconciliation failed; will retry"),
    }
}

async fn purge(storage: Arc<dyn Storage>, retention_ms: i64) {
    let before = now_ms().saturating_sub(retention_ms);
    loop {
        match storage.purge_idempotency(before, PURGE_BATCH).await {
            Ok(n) if n < u64::from(PURGE_BATCH) => return,
            Ok(_) => continue,
            Err(err) => {
                tracing::warn!(error = %err, "idempotency purge failed; will retry");
                return;
            }
        }
    }
}

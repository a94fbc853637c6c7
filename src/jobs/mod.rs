//! Background jobs: reservation expiry, reconciliation, purges, the event sink. Each is a
//! periodic run under the [`supervisor`] (restarted after a panic, reported by `/readyz`), does
//! bounded work per run, and never panics the process on a storage error: it logs, and the
//! supervisor tries again after a short backoff.

pub mod nats_sink;
pub mod settlement;
pub mod supervisor;

use std::sync::Arc;
use std::time::Duration;

use self::supervisor::{Supervisor, Tick};
use crate::engine::Pass;
use crate::storage::redis_store::SettlementTable;
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
    /// How often old rows of the redis-mode tables are purged.
    pub settlement_purge_interval: Duration,
    /// How long `redis_settled` rows are kept.
    pub settled_retention: Duration,
    /// How long `settlement_failures` rows are kept.
    pub failure_retention: Duration,
    /// How often events past their retention are deleted.
    pub events_purge_interval: Duration,
    pub events_retention: Duration,
    /// The NATS JetStream sink of the events (`[events.nats]`); `None`: none.
    pub nats: Option<crate::config::NatsSinkConfig>,
}

/// Most idempotency records deleted per purge transaction, so a purge never holds the writer long.
const PURGE_BATCH: u32 = 5_000;

/// Starts every job under `supervisor`; they stop when its shutdown signal turns true.
pub fn spawn(supervisor: &mut Supervisor, storage: Arc<dyn Storage>, settings: JobSettings) {
    supervisor.every("expiry", settings.sweep_interval, {
        let storage = storage.clone();
        move || expire(storage.clone(), settings.sweep_batch)
    });
    supervisor.every("idempotency_purge", settings.purge_interval, {
        let storage = storage.clone();
        let retention_ms = millis(settings.idempotency_retention);
        move || purge(storage.clone(), retention_ms)
    });
    // Always, Redis configured or not: a deployment that left redis mode still has the rows.
    supervisor.every("events_purge", settings.events_purge_interval, {
        let storage = storage.clone();
        let retention_ms = millis(settings.events_retention);
        move || purge_events(storage.clone(), retention_ms)
    });
    supervisor.every("settlement_purge", settings.settlement_purge_interval, {
        let storage = storage.clone();
        let settled_ms = millis(settings.settled_retention);
        let failures_ms = millis(settings.failure_retention);
        move || purge_settlement(storage.clone(), settled_ms, failures_ms)
    });
    if let Some(nats) = settings.nats {
        let interval = Duration::from_millis(nats.poll_interval_ms);
        let sink = Arc::new(nats_sink::NatsSink::new(nats));
        let storage = storage.clone();
        supervisor.every("nats_sink", interval, move || nats_sink::run(sink.clone(), storage.clone()));
    }
    if let Some(interval) = settings.rebalance_interval {
        let storage = storage.clone();
        let batch = settings.rebalance_batch;
        supervisor.every("rebalance", interval, move || rebalance(storage.clone(), batch));
    }
    if let Some(interval) = settings.reconcile_interval {
        // Counted across restarts of the job, so a panicking pass does not postpone the full one.
        let (full_every, passes) = (settings.reconcile_full_every, Arc::new(std::sync::atomic::AtomicU64::new(0)));
        supervisor.every("reconciliation", interval, move || {
            let n = passes.fetch_add(1, std::sync::atomic::Ordering::Relaxed).wrapping_add(1);
            let pass = if full_every > 0 && n % full_every == 0 { Pass::Full } else { Pass::Incremental };
            reconcile(storage.clone(), pass)
        });
    }
}

/// Expires held reservations past their deadline, a bounded batch per transaction, until none
/// is due (so a backlog clears within one tick rather than one batch per tick).
async fn expire(storage: Arc<dyn Storage>, batch: u32) -> Tick {
    loop {
        match storage.expire_due(now_ms(), batch).await {
            Ok(n) => {
                if n > 0 {
                    metrics::counter!("stockd_reservations_expired_total").increment(n);
                    tracing::debug!(expired = n, "reservations expired");
                }
                if n < u64::from(batch) {
                    return Tick::Done;
                }
            }
            Err(err) => {
                tracing::warn!(error = %err, "reservation expiry failed; will retry");
                return Tick::Failed;
            }
        }
    }
}

/// Evens out bucketed resources whose buckets drifted apart, a bounded batch per transaction.
async fn rebalance(storage: Arc<dyn Storage>, batch: u32) -> Tick {
    match storage.rebalance_buckets(now_ms(), batch).await {
        Ok(0) => Tick::Done,
        Ok(n) => {
            metrics::counter!("stockd_bucket_rebalances_total").increment(n);
            tracing::debug!(resources = n, "buckets rebalanced");
            Tick::Done
        }
        Err(err) => {
            tracing::warn!(error = %err, "bucket rebalance failed; will retry");
            Tick::Failed
        }
    }
}

async fn reconcile(storage: Arc<dyn Storage>, pass: Pass) -> Tick {
    match storage.reconcile(None, pass).await {
        Ok(report) => {
            tracing::debug!(pass = ?report.pass, ledger_rows = report.ledger_rows_read, "reconciliation pass");
            metrics::counter!("stockd_reconciliation_ledger_rows_read_total").increment(report.ledger_rows_read);
            metrics::gauge!("stockd_reconciliation_checked_resources").set(report.checked as f64);
            metrics::gauge!("stockd_reconciliation_drift_resources").set(report.drift.len() as f64);
            for d in &report.drift {
                tracing::error!(key = %d.key, expected = ?d.expected, actual = ?d.actual, "reconciliation drift");
            }
            Tick::Done
        }
        Err(err) => {
            tracing::warn!(error = %err, "reconciliation failed; will retry");
            Tick::Failed
        }
    }
}

async fn purge(storage: Arc<dyn Storage>, retention_ms: i64) -> Tick {
    let before = now_ms().saturating_sub(retention_ms);
    loop {
        match storage.purge_idempotency(before, PURGE_BATCH).await {
            Ok(n) => {
                metrics::counter!("stockd_purged_rows_total", "table" => "idempotency").increment(n);
                if n < u64::from(PURGE_BATCH) {
                    return Tick::Done;
                }
            }
            Err(err) => {
                tracing::warn!(error = %err, "idempotency purge failed; will retry");
                return Tick::Failed;
            }
        }
    }
}

/// Deletes events past their retention, a bounded batch per transaction, until none is left.
async fn purge_events(storage: Arc<dyn Storage>, retention_ms: i64) -> Tick {
    let before = now_ms().saturating_sub(retention_ms);
    loop {
        match storage.purge_events(before, PURGE_BATCH).await {
            Ok(n) => {
                metrics::counter!("stockd_purged_rows_total", "table" => "events").increment(n);
                if n < u64::from(PURGE_BATCH) {
                    return Tick::Done;
                }
            }
            Err(err) => {
                tracing::warn!(error = %err, "events purge failed; will retry");
                return Tick::Failed;
            }
        }
    }
}

/// Deletes the rows of the redis-mode tables older than their retention, a bounded batch per
/// transaction, until none is left.
async fn purge_settlement(storage: Arc<dyn Storage>, settled_ms: i64, failures_ms: i64) -> Tick {
    let mut tick = Tick::Done;
    let tables = [
        (SettlementTable::Settled, settled_ms),
        (SettlementTable::Failures, failures_ms),
        (SettlementTable::DeadLetters, failures_ms),
    ];
    for (table, retention_ms) in tables {
        let before = now_ms().saturating_sub(retention_ms);
        loop {
            match storage.purge_settlement(table, before, PURGE_BATCH).await {
                Ok(n) => {
                    metrics::counter!("stockd_purged_rows_total", "table" => table.name()).increment(n);
                    if n < u64::from(PURGE_BATCH) {
                        break;
                    }
                }
                Err(err) => {
                    tracing::warn!(error = %err, table = table.name(), "retention purge failed; will retry");
                    tick = Tick::Failed;
                    break;
                }
            }
        }
    }
    tick
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

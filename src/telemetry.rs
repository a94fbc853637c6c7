//! Logs (tracing, to stderr, filtered by `RUST_LOG`) and metrics (a Prometheus recorder).
//! Secrets never reach either: handlers log tenant ids and key ids, never tokens.

use std::time::Duration;

use anyhow::Context;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tracing_subscriber::EnvFilter;

/// Latency buckets in seconds: 100 µs to 10 s.
const LATENCY_BUCKETS: &[f64] =
    &[0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0];
/// Batch-size buckets: how many writes shared one commit.
const BATCH_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0];

pub fn init_tracing() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,sqlx=warn"));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
}

/// Installs the process-wide recorder and keeps its histograms drained.
pub fn init_metrics() -> anyhow::Result<PrometheusHandle> {
    let handle = PrometheusBuilder::new()
        .set_buckets(LATENCY_BUCKETS)
        .context("metric buckets")?
        .set_buckets_for_metric(Matcher::Full("stockd_batch_size".into()), BATCH_BUCKETS)
        .context("batch buckets")?
        .install_recorder()
        .context("installing the metrics recorder")?;
    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut timer = tokio::time::interval(Duration::from_secs(5));
        loop {
            timer.tick().await;
            upkeep.run_upkeep();
        }
    });
    Ok(handle)
}

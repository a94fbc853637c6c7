//! The delivery job, run supervised in every process. Each pass: queue the new events of the
//! endpoints behind on their tenant's feed, claim due deliveries (as many as free places), and
//! send each on a task of its own; the task records the attempt and what follows (delivered,
//! retry at a later time, or the endpoint failing). A receiver that fails or hangs costs one
//! place for at most the request timeout, never the job's health: `/readyz` sees only whether
//! the job's storage work succeeds.
//!
//! At least once: a delivery leaves the queue only after a 2xx, so a process killed between
//! commit and delivery, or mid-request, leaves it queued; its claim runs out
//! ([`DeliverySettings::lease`]) and any process sends it again. Receivers deduplicate on
//! `webhook-id` (the event id).

use std::sync::Arc;
use std::time::{Duration, Instant};

use reqwest::header::{HeaderMap, HeaderValue, CONTENT_TYPE, USER_AGENT};
use tokio::sync::{Notify, Semaphore};

use super::retry::RetryPolicy;
use super::signing::signature_header;
use super::target::{self, TargetRefused};
use super::{Attempt, AttemptOutcome, Claimed, Finished, Next, QueueLimits};
use crate::jobs::supervisor::{JobCtx, Supervisor};
use crate::storage::{Storage, StorageError};
use crate::time::now_ms;

/// The job's name in `/readyz`, metrics and fault hooks.
pub const JOB: &str = "webhooks";
/// Pages of endpoints one queueing pass looks at (each `QueueLimits::endpoints` long).
const MAX_QUEUE_PAGES: usize = 100;
/// Attempts deleted per purge statement.
const PURGE_BATCH: u32 = 5_000;
/// How often the deliveries log is purged.
const PURGE_EVERY: Duration = Duration::from_secs(300);
/// Shortest gap between two passes woken by commits, so a busy server does not spin the job.
const MIN_PASS_GAP: Duration = Duration::from_millis(20);

/// `[events.webhooks]` as the job uses it.
#[derive(Debug, Clone)]
pub struct DeliverySettings {
    pub poll_interval: Duration,
    pub request_timeout: Duration,
    pub max_concurrency: usize,
    pub batch: u32,
    pub max_pending_per_endpoint: u32,
    pub retry: RetryPolicy,
    pub allow_private_targets: bool,
    pub attempts_retention: Duration,
}

impl DeliverySettings {
    /// The settings of `[events.webhooks]`; the retry window is kept within `[events]
    /// retention_hours`, so an event is still in the feed when its last retry is due.
    pub fn from_config(events: &crate::config::EventsConfig) -> Self {
        let c = &events.webhooks;
        let ms = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        let retention_seconds = events.retention_hours.saturating_mul(3600);
        if c.retry_window_seconds > retention_seconds {
            tracing::warn!(
                retry_window_seconds = c.retry_window_seconds,
                retention_seconds,
                "[events.webhooks] retry_window_seconds exceeds the events' retention; using the retention"
            );
        }
        Self {
            poll_interval: Duration::from_millis(c.poll_interval_ms),
            request_timeout: Duration::from_millis(c.request_timeout_ms),
            max_concurrency: c.max_concurrency.max(1),
            batch: c.batch.max(1),
            max_pending_per_endpoint: c.max_pending_per_endpoint.max(1),
            retry: RetryPolicy {
                initial_ms: ms(c.retry_initial_ms),
                max_ms: ms(c.retry_max_ms),
                window_ms: ms(c.retry_window_seconds.min(retention_seconds).saturating_mul(1000)),
            },
            allow_private_targets: c.allow_private_targets,
            attempts_retention: Duration::from_secs(c.attempts_retention_hours.saturating_mul(3600)),
        }
    }

    /// How long a claim holds: past the request timeout with a margin for recording the
    /// outcome, so a live process's claim never runs out under it.
    pub fn lease(&self) -> Duration {
        self.request_timeout.saturating_mul(2) + Duration::from_secs(30)
    }
}

/// The HTTP client deliveries use: no redirects (a 3xx is a failure, and a redirect could lead
/// into the operator's network), no proxy from the environment (the target checked is the one
/// reached), the guarded resolver, the request timeout.
pub fn client(settings: &DeliverySettings) -> reqwest::Result<reqwest::Client> {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .no_proxy()
        .dns_resolver(Arc::new(target::GuardedResolver { allow_private: settings.allow_private_targets }))
        .timeout(settings.request_timeout)
        .connect_timeout(settings.request_timeout)
        .pool_max_idle_per_host(4)
        .build()
}

/// Starts the delivery job under `supervisor`.
pub fn spawn(supervisor: &mut Supervisor, storage: Arc<dyn Storage>, settings: DeliverySettings) {
    let interval = settings.poll_interval;
    supervisor.run(JOB, Some(interval), move |ctx| run(storage.clone(), settings.clone(), ctx));
}

/// The job's loop: a pass, then a wait for the poll interval, a commit of this process or a
/// finished delivery (whose successor may be due), until shutdown.
async fn run(storage: Arc<dyn Storage>, settings: DeliverySettings, ctx: JobCtx) {
    let client = match client(&settings) {
        Ok(client) => client,
        Err(err) => {
            // Only a broken TLS setup fails here; the supervisor restarts the job after a backoff.
            panic!("the webhook HTTP client cannot be built: {err}");
        }
    };
    let places = Arc::new(Semaphore::new(settings.max_concurrency));
    let finished = Arc::new(Notify::new());
    let mut shutdown = ctx.shutdown();
    let mut last_purge: Option<Instant> = None;
    let mut backoff = Duration::from_secs(1);
    loop {
        if *shutdown.borrow() {
            return;
        }
        ctx.fault_point().await;
        let purge_due = last_purge.is_none_or(|at| at.elapsed() >= PURGE_EVERY);
        let wait = match pass(&storage, &settings, &client, &places, &finished, purge_due).await {
            Ok(()) => {
                ctx.ok();
                if purge_due {
                    last_purge = Some(Instant::now());
                }
                backoff = Duration::from_secs(1);
                settings.poll_interval
            }
            Err(err) => {
                tracing::warn!(error = %err, "webhook delivery pass failed; will retry");
                let wait = backoff.max(settings.poll_interval);
                backoff = backoff.saturating_mul(2).min(Duration::from_secs(30));
                wait
            }
        };
        let woken = async {
            tokio::select! {
                _ = crate::events::next_commit() => {}
                _ = finished.notified() => {}
            }
            tokio::time::sleep(MIN_PASS_GAP).await;
        };
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = woken => {}
            _ = shutdown.changed() => return,
        }
    }
}

/// One pass; fails only when storage does.
async fn pass(
    storage: &Arc<dyn Storage>,
    settings: &DeliverySettings,
    client: &reqwest::Client,
    places: &Arc<Semaphore>,
    finished: &Arc<Notify>,
    purge: bool,
) -> Result<(), StorageError> {
    let limits = QueueLimits { endpoints: 100, events: settings.batch, max_pending: settings.max_pending_per_endpoint };
    let mut after = String::new();
    for _ in 0..MAX_QUEUE_PAGES {
        let page = storage.queue_webhook_deliveries(now_ms(), &after, limits).await?;
        metrics::counter!("stockd_webhook_queued_total").increment(page.queued);
        match page.last_endpoint {
            Some(last) => after = last,
            None => break,
        }
    }

    let free = u32::try_from(places.available_permits()).unwrap_or(u32::MAX).min(settings.batch);
    if free > 0 {
        let now = now_ms();
        let lease_until = now.saturating_add(i64::try_from(settings.lease().as_millis()).unwrap_or(i64::MAX));
        for claimed in storage.claim_webhook_deliveries(now, lease_until, free).await? {
            // Only this loop takes places, and it claimed no more than were free.
            let Ok(place) = places.clone().try_acquire_owned() else { break };
            let (storage, client, settings, finished) =
                (storage.clone(), client.clone(), settings.clone(), finished.clone());
            tokio::spawn(async move {
                deliver(storage.as_ref(), &client, &settings, claimed).await;
                drop(place);
                finished.notify_one();
            });
        }
    }

    let age = match storage.webhook_oldest_pending().await? {
        Some(at) => (now_ms().saturating_sub(at)).max(0) as f64 / 1000.0,
        None => 0.0,
    };
    metrics::gauge!("stockd_webhook_pending_age_seconds").set(age);

    if purge {
        let before =
            now_ms().saturating_sub(i64::try_from(settings.attempts_retention.as_millis()).unwrap_or(i64::MAX));
        loop {
            let n = storage.purge_webhook_attempts(before, PURGE_BATCH).await?;
            metrics::counter!("stockd_purged_rows_total", "table" => "webhook_attempts").increment(n);
            if n < u64::from(PURGE_BATCH) {
                break;
            }
        }
    }
    Ok(())
}

/// How one request ended.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Sent {
    Ok(u16),
    Status(u16),
    Failed(&'static str),
}

/// Sends one claimed delivery and records the outcome. Never fails: a storage error recording
/// it is logged, and the claim running out makes the delivery due again (at least once).
async fn deliver(storage: &dyn Storage, client: &reqwest::Client, settings: &DeliverySettings, claimed: Claimed) {
    let started = Instant::now();
    let at = now_ms();
    let Some(event) = &claimed.event else {
        // Purged past its retention before it could be delivered: nothing left to send.
        let attempt = Attempt {
            id: 0,
            event_id: String::new(),
            seq: claimed.seq,
            kind: String::new(),
            attempt: claimed.attempts + 1,
            at,
            outcome: AttemptOutcome::Dropped,
            http_status: None,
            error: Some("event_purged".into()),
            latency_ms: 0,
        };
        metrics::counter!("stockd_webhook_deliveries_total", "result" => "dropped").increment(1);
        record(storage, &claimed, attempt, Next::Done, at).await;
        return;
    };
    let body = event.envelope();
    let sent = send(client, settings, &claimed, &event.id, body, at).await;
    let latency_ms = i64::try_from(started.elapsed().as_millis()).unwrap_or(i64::MAX);
    metrics::histogram!("stockd_webhook_delivery_duration_seconds").record(started.elapsed().as_secs_f64());
    let now = now_ms();
    let (outcome, http_status, error, next) = match sent {
        Sent::Ok(status) => (AttemptOutcome::Delivered, Some(i64::from(status)), None, Next::Done),
        Sent::Status(status) => {
            let next = settings.retry.after_failure(now, claimed.window_start, claimed.attempts + 1, rand::random());
            (AttemptOutcome::Failed, Some(i64::from(status)), Some("http_status".to_string()), next)
        }
        Sent::Failed(kind) => {
            let next = settings.retry.after_failure(now, claimed.window_start, claimed.attempts + 1, rand::random());
            (AttemptOutcome::Failed, None, Some(kind.to_string()), next)
        }
    };
    let result = if outcome == AttemptOutcome::Delivered { "delivered" } else { "failed" };
    metrics::counter!("stockd_webhook_deliveries_total", "result" => result).increment(1);
    if matches!(next, Next::EndpointFailing { .. }) {
        metrics::counter!("stockd_webhook_endpoints_failed_total").increment(1);
        tracing::warn!(endpoint = %claimed.endpoint_id, tenant = %claimed.tenant, "webhook endpoint failing: retries exhausted");
    }
    let attempt = Attempt {
        id: 0,
        event_id: event.id.clone(),
        seq: claimed.seq,
        kind: event.kind.clone(),
        attempt: claimed.attempts + 1,
        at,
        outcome,
        http_status,
        error,
        latency_ms,
    };
    record(storage, &claimed, attempt, next, now).await;
}

async fn record(storage: &dyn Storage, claimed: &Claimed, attempt: Attempt, next: Next, now: i64) {
    let finished = Finished {
        endpoint_id: claimed.endpoint_id.clone(),
        seq: claimed.seq,
        lease_until: claimed.lease_until,
        now_ms: now,
        attempt,
        next,
    };
    if let Err(err) = storage.finish_webhook_delivery(&finished).await {
        tracing::warn!(error = %err, endpoint = %claimed.endpoint_id, seq = claimed.seq,
            "recording a webhook attempt failed; the delivery is due again when its claim runs out");
    }
}

/// POSTs the signed envelope (Standard Webhooks headers).
async fn send(
    client: &reqwest::Client,
    settings: &DeliverySettings,
    claimed: &Claimed,
    event_id: &str,
    body: String,
    now: i64,
) -> Sent {
    let Ok(url) = target::parse_url(&claimed.url) else { return Sent::Failed("invalid_url") };
    if !target::literal_allowed(&url, settings.allow_private_targets) {
        return Sent::Failed("target_refused");
    }
    let timestamp = now.div_euclid(1000);
    let signature =
        signature_header(&claimed.secret, claimed.previous.as_ref(), now, event_id, timestamp, body.as_bytes());
    let mut headers = HeaderMap::new();
    let (Ok(id), Ok(signature)) = (HeaderValue::from_str(event_id), HeaderValue::from_str(&signature)) else {
        return Sent::Failed("invalid_header");
    };
    headers.insert("webhook-id", id);
    headers.insert("webhook-timestamp", HeaderValue::from(timestamp));
    headers.insert("webhook-signature", signature);
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    headers.insert(USER_AGENT, HeaderValue::from_static(concat!("stockd-webhooks/", env!("CARGO_PKG_VERSION"))));
    match client.post(url).headers(headers).body(body).send().await {
        Ok(response) if response.status().is_success() => Sent::Ok(response.status().as_u16()),
        Ok(response) => Sent::Status(response.status().as_u16()),
        Err(err) => Sent::Failed(error_kind(&err)),
    }
}

/// The kind of a failed request, as the deliveries log shows it (never the error text, which
/// may carry addresses of the operator's network).
fn error_kind(err: &reqwest::Error) -> &'static str {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = source {
        if e.downcast_ref::<TargetRefused>().is_some() {
            return "target_refused";
        }
        source = e.source();
    }
    if err.is_timeout() {
        "timeout"
    } else if err.is_connect() {
        "connect"
    } else {
        "request"
    }
}

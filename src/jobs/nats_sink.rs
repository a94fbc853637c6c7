//! The NATS JetStream sink of the outbox (docs/NATS.md): a periodic job that publishes every
//! committed event to `<subject_prefix>.<tenant>.<type>` with the event id as `Nats-Msg-Id`.
//!
//! Per tenant with undelivered events, a run claims the tenant's cursor
//! ([`Storage::claim_sink_cursor`]), reads a page after it, publishes the page (pipelined: all
//! sent, then the acknowledgements awaited in order, the whole page within
//! `publish_timeout_ms`), and stores as the new cursor the last event of the acknowledged
//! prefix. Delivery is at least once: a crash between the acknowledgements and the stored
//! cursor publishes the page again, and JetStream drops each event it already holds by its
//! `Nats-Msg-Id` within the stream's duplicate window, so the stream keeps each event once.
//! Those republished events are counted in `stockd_events_duplicates_total{sink="nats"}`.
//!
//! A broker that is down or slow fails the run with [`Tick::ReceiverDown`]: it is tried again,
//! the failure is counted (`stockd_events_publish_failures_total`) and the backlog shows in
//! `stockd_event_sink_lag` and `stockd_event_sink_pending_age_seconds`, but `/readyz` is not
//! affected (every process shares the broker; none would serve requests better).

use std::future::IntoFuture;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, message::PublishMessage};
use tokio::sync::Mutex;
use tokio::time::Instant;

use super::supervisor::{faults, Tick};
use crate::config::NatsSinkConfig;
use crate::engine::TenantId;
use crate::events::Event;
use crate::storage::{Storage, StorageError};
use crate::time::now_ms;

/// The sink's name in `event_sink_cursors` and in the metrics' `sink` label.
pub const SINK: &str = "nats";
/// Most tenants served per run (in id order); the rest wait for the next run.
const MAX_TENANTS_PER_RUN: u32 = 10_000;
/// Most pages published per tenant per run, so one busy tenant cannot hold a run for long.
const MAX_PAGES_PER_TENANT: usize = 10;

/// The sink's settings and its connection, shared by every run (and kept across a panic of the
/// job: a connection holds nothing a panic could leave half-done).
pub struct NatsSink {
    settings: NatsSinkConfig,
    publish_timeout: Duration,
    /// The connection, once made; the client reconnects on its own after that.
    connection: Mutex<Option<Connection>>,
    /// The broker failed the last run: logged once as a warning, then quietly until it is back.
    down: AtomicBool,
}

/// Why delivering a tenant's events stopped.
#[derive(Debug)]
enum SinkError {
    Storage(StorageError),
    /// The broker refused, failed or did not acknowledge in time; `reason` labels the metric.
    Broker {
        reason: &'static str,
        detail: String,
    },
}

impl From<StorageError> for SinkError {
    fn from(err: StorageError) -> Self {
        SinkError::Storage(err)
    }
}

impl NatsSink {
    pub fn new(settings: NatsSinkConfig) -> Self {
        let publish_timeout = Duration::from_millis(settings.publish_timeout_ms);
        Self { settings, publish_timeout, connection: Mutex::new(None), down: AtomicBool::new(false) }
    }

    /// The connected JetStream context, connecting if this process never did, and creating
    /// the stream (when configured) if missing after a start or a failure.
    async fn jetstream(&self) -> Result<jetstream::Context, SinkError> {
        let mut slot = self.connection.lock().await;
        let mut connection = match slot.take() {
            Some(connection) => connection,
            None => Connection { context: self.connect().await?, stream_ensured: false },
        };
        let ensured = if connection.stream_ensured { Ok(()) } else { self.ensure_stream(&connection.context).await };
        connection.stream_ensured = ensured.is_ok();
        let context = connection.context.clone();
        *slot = Some(connection);
        ensured.map(|()| context)
    }

    async fn connect(&self) -> Result<jetstream::Context, SinkError> {
        let client = async_nats::ConnectOptions::new()
            .name("stockd")
            .connection_timeout(self.publish_timeout)
            .connect(self.settings.servers().as_slice())
            .await
            .map_err(|e| SinkError::Broker { reason: "connect", detail: e.to_string() })?;
        let mut context = jetstream::new(client);
        // Bounds API requests (the stream's creation) and each acknowledgement.
        context.set_timeout(self.publish_timeout);
        Ok(context)
    }

    /// Creates the configured stream if it does not exist (an existing one is left as it is).
    async fn ensure_stream(&self, context: &jetstream::Context) -> Result<(), SinkError> {
        let Some(name) = &self.settings.stream else { return Ok(()) };
        let config = jetstream::stream::Config {
            name: name.clone(),
            subjects: vec![format!("{}.>", self.settings.subject_prefix)],
            duplicate_window: Duration::from_secs(self.settings.duplicate_window_seconds),
            ..Default::default()
        };
        context
            .get_or_create_stream(config)
            .await
            .map_err(|e| SinkError::Broker { reason: "stream", detail: e.to_string() })?;
        Ok(())
    }

    /// After a broker failure the stream is looked for again (it may have been deleted).
    async fn failed(&self) {
        if let Some(connection) = self.connection.lock().await.as_mut() {
            connection.stream_ensured = false;
        }
    }
}

/// A connection to NATS: the client reconnects by itself, so one is made per process.
struct Connection {
    context: jetstream::Context,
    stream_ensured: bool,
}

/// The subject of an event: `<prefix>.<tenant>.<type>`. A tenant id (`[a-z0-9-]`) is one token
/// and an event type (`order.applied`) one or more, so neither needs escaping; anything else
/// (never written by stockd) is refused rather than published where no consumer looks.
pub fn subject(prefix: &str, tenant: &str, kind: &str) -> Option<String> {
    let token = |t: &str| !t.is_empty() && t.bytes().all(|b| b.is_ascii_alphanumeric() || b"_-".contains(&b));
    (token(tenant) && kind.split('.').all(token)).then(|| format!("{prefix}.{tenant}.{kind}"))
}

/// One run: every tenant with undelivered events, until done or the first failure.
pub async fn run(sink: Arc<NatsSink>, storage: Arc<dyn Storage>) -> Tick {
    let backlog = match storage.sink_backlog(SINK, MAX_TENANTS_PER_RUN).await {
        Ok(backlog) => backlog,
        Err(err) => {
            tracing::warn!(error = %err, "event sink: reading the backlog failed; will retry");
            return Tick::Failed;
        }
    };
    let mut run = Progress { lag: backlog.lag, oldest_pending_at: None };
    if backlog.tenants.is_empty() {
        run.report();
        return Tick::Done;
    }
    // Connected before any cursor is claimed: a PostgreSQL claim's transaction must not wait
    // for a connection on top of a page's acknowledgements.
    let mut ended = sink.jetstream().await.map(|_| ());
    if ended.is_ok() {
        for tenant in &backlog.tenants {
            ended = deliver(&sink, storage.as_ref(), tenant, &mut run).await;
            if ended.is_err() {
                break;
            }
        }
    }
    run.report();
    match ended {
        Ok(()) => {
            if sink.down.swap(false, Ordering::Relaxed) {
                tracing::info!("event sink: NATS is delivering again");
            }
            Tick::Done
        }
        Err(SinkError::Storage(err)) => {
            tracing::warn!(error = %err, "event sink: storage failed; will retry");
            Tick::Failed
        }
        Err(SinkError::Broker { reason, detail }) => {
            metrics::counter!("stockd_events_publish_failures_total", "sink" => SINK, "reason" => reason).increment(1);
            if sink.down.swap(true, Ordering::Relaxed) {
                tracing::debug!(reason, error = %detail, "event sink: NATS still failing");
            } else {
                tracing::warn!(reason, error = %detail, "event sink: NATS failed; retrying until it answers");
            }
            sink.failed().await;
            Tick::ReceiverDown
        }
    }
}

/// What a run saw, for the gauges.
struct Progress {
    /// Events not yet delivered, across every tenant.
    lag: i64,
    /// Unix ms of the oldest undelivered event the run found (each tenant's first pending one,
    /// before it was published).
    oldest_pending_at: Option<i64>,
}

impl Progress {
    fn report(&self) {
        metrics::gauge!("stockd_event_sink_lag", "sink" => SINK).set(self.lag.max(0) as f64);
        let age_ms = self.oldest_pending_at.map_or(0, |at| now_ms().saturating_sub(at).max(0));
        metrics::gauge!("stockd_event_sink_pending_age_seconds", "sink" => SINK).set(age_ms as f64 / 1000.0);
    }
}

/// Publishes the tenant's undelivered events, a page per claim of its cursor.
async fn deliver(
    sink: &NatsSink,
    storage: &dyn Storage,
    tenant: &TenantId,
    run: &mut Progress,
) -> Result<(), SinkError> {
    for _ in 0..MAX_PAGES_PER_TENANT {
        // Another process holds the cursor: it is delivering this tenant's events.
        let Some(mut claim) = storage.claim_sink_cursor(SINK, tenant).await? else { return Ok(()) };
        let page = claim.page(sink.settings.batch_size).await?;
        let Some(first) = page.first() else { return Ok(()) };
        if run.oldest_pending_at.is_none_or(|at| first.at < at) {
            run.oldest_pending_at = Some(first.at);
        }
        let context = sink.jetstream().await?;
        let published = publish_page(sink, &context, &page).await;
        if published.acked > 0 {
            faults::hang_at("nats_sink.before_cursor").await;
            claim.advance(page[published.acked - 1].seq).await?;
            let fresh = (published.acked - published.duplicates) as u64;
            metrics::counter!("stockd_events_published_total", "sink" => SINK).increment(fresh);
            metrics::counter!("stockd_events_duplicates_total", "sink" => SINK).increment(published.duplicates as u64);
            run.lag -= published.acked as i64;
        }
        if let Some(err) = published.failed {
            return Err(err);
        }
        if page.len() < sink.settings.batch_size as usize {
            return Ok(());
        }
    }
    Ok(())
}

/// How a page's publication ended.
struct Published {
    /// Length of the acknowledged prefix of the page.
    acked: usize,
    /// Of those, the ones JetStream already held (a republished page).
    duplicates: usize,
    /// Why the rest was not acknowledged.
    failed: Option<SinkError>,
}

/// Sends every event of the page, then awaits the acknowledgements in order, all within the
/// publish timeout; stops at the first failure, so only a contiguous prefix counts as
/// delivered (a later event JetStream did store is published again next time, and dropped).
async fn publish_page(sink: &NatsSink, context: &jetstream::Context, page: &[Event]) -> Published {
    let deadline = Instant::now() + sink.publish_timeout;
    let mut published = Published { acked: 0, duplicates: 0, failed: None };
    let broker = |reason, detail: String| Some(SinkError::Broker { reason, detail });
    let mut pending = Vec::with_capacity(page.len());
    for event in page {
        let Some(subject) = subject(&sink.settings.subject_prefix, &event.tenant, &event.kind) else {
            // Unreachable while tenant ids and type names keep their grammar: a bug, and the
            // tenant's delivery waits for its fix rather than skip the event.
            tracing::error!(event = %event.id, kind = %event.kind, "event sink: no valid subject for this event");
            published.failed = broker("subject", format!("no valid subject for event {}", event.id));
            break;
        };
        let message = PublishMessage::build().message_id(&event.id).payload(event.envelope().into());
        // Sending waits only while the client's buffer is full (a broker gone quiet).
        match tokio::time::timeout_at(deadline, context.send_publish(subject, message)).await {
            Ok(Ok(ack)) => pending.push(ack),
            Ok(Err(err)) => {
                published.failed = broker("publish", err.to_string());
                break;
            }
            Err(_) => {
                published.failed = broker("timeout", "sending the page took longer than publish_timeout_ms".into());
                break;
            }
        }
    }
    for ack in pending {
        match tokio::time::timeout_at(deadline, ack.into_future()).await {
            Ok(Ok(ack)) => {
                published.acked += 1;
                published.duplicates += usize::from(ack.duplicate);
            }
            Ok(Err(err)) => {
                published.failed = broker("publish", err.to_string());
                break;
            }
            Err(_) => {
                published.failed = broker("timeout", "acknowledgements took longer than publish_timeout_ms".into());
                break;
            }
        }
    }
    published
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::EventType;

    #[test]
    fn every_event_type_makes_a_valid_subject_after_the_tenant() {
        for kind in EventType::ALL {
            let subject = subject("stockd", "shop-1", kind.as_str()).expect("every type name is subject-safe");
            assert_eq!(subject, format!("stockd.shop-1.{}", kind.as_str()));
        }
        assert_eq!(subject("a.b", "t", "order.applied").as_deref(), Some("a.b.t.order.applied"));
    }

    #[test]
    fn tokens_nats_forbids_are_refused() {
        for tenant in ["", "a.b", "a b", "a*", "a>", "a\tb"] {
            assert_eq!(subject("p", tenant, "order.applied"), None, "tenant {tenant:?}");
        }
        for kind in ["", "order..applied", "order.*", "order.>", ".order"] {
            assert_eq!(subject("p", "t", kind), None, "type {kind:?}");
        }
    }

    #[test]
    fn every_tenant_id_is_one_subject_token() {
        // The tenant grammar is [a-z0-9-]{1,64} (engine::TenantId): all of it is subject-safe.
        let id = TenantId::parse("abcdefghijklmnopqrstuvwxyz-0123456789").expect("a valid tenant id");
        assert!(subject("p", id.as_str(), "order.applied").is_some());
    }
}

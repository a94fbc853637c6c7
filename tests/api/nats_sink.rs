//! The NATS JetStream sink of the outbox (`[events.nats]`, docs/NATS.md), seen from outside:
//! the server's events arrive in a JetStream stream on `<prefix>.<tenant>.<type>`, each with its
//! feed envelope as the body and its event id as `Nats-Msg-Id`; a crash between the broker's
//! acknowledgement and the stored cursor publishes again and the stream still holds each event
//! once; a broker that is down is counted and retried without making `/readyz` fail.
//!
//! Needs a NATS server with JetStream at `STOCKD_TEST_NATS_URL` (default
//! `nats://127.0.0.1:4222`; `scripts/test.sh` starts one). Every test has its own subject prefix
//! and stream, deleted at its end.

use std::collections::HashSet;
use std::time::Duration;

use async_nats::jetstream;
use serde_json::{json, Value};

use crate::helpers::{deduct, metric, spawn_app_with, unique, AppOptions, Backend, TenantClient, TestApp};

/// Bound on every wait for the server or the broker to reach a state.
const DEADLINE: Duration = Duration::from_secs(30);
/// How often the tests look again while waiting.
const POLL: Duration = Duration::from_millis(50);
/// The point where the sink has its page acknowledged and has not stored its cursor yet.
const BEFORE_CURSOR: &str = "nats_sink.before_cursor";

fn nats_url() -> String {
    std::env::var("STOCKD_TEST_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned())
}

/// One test's subject prefix and stream on the shared NATS server.
struct Bus {
    js: jetstream::Context,
    prefix: String,
    stream: String,
}

impl Bus {
    async fn new() -> Bus {
        let client = async_nats::connect(nats_url())
            .await
            .unwrap_or_else(|e| panic!("NATS at {} must be reachable for this suite: {e}", nats_url()));
        let id = unique("t").replace('-', "");
        Bus { js: jetstream::new(client), prefix: format!("stockdtest.{id}"), stream: format!("STOCKDTEST_{id}") }
    }

    /// `[events.nats]` for this bus: the server creates the stream.
    fn toml(&self, url: &str) -> String {
        format!(
            "[events.nats]\nurl = {url:?}\nsubject_prefix = {:?}\nstream = {:?}\npoll_interval_ms = 50\n",
            self.prefix, self.stream
        )
    }

    /// Every message of the stream, in stream order; none while the stream does not exist.
    async fn messages(&self) -> Vec<jetstream::message::StreamMessage> {
        let Ok(mut stream) = self.js.get_stream(&self.stream).await else { return Vec::new() };
        let state = stream.info().await.expect("the stream answers").state.clone();
        let mut messages = Vec::new();
        if state.messages == 0 {
            return messages;
        }
        for seq in state.first_sequence..=state.last_sequence {
            messages.push(stream.get_raw_message(seq).await.expect("every message of the stream is kept"));
        }
        messages
    }

    /// Waits until the stream holds `n` messages and returns them.
    async fn wait_for(&self, n: usize, app: &TestApp) -> Vec<jetstream::message::StreamMessage> {
        let deadline = tokio::time::Instant::now() + DEADLINE;
        loop {
            let messages = self.messages().await;
            if messages.len() >= n {
                return messages;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the stream holds {} messages, not {n}; server output:\n{}",
                messages.len(),
                app.logs()
            );
            tokio::time::sleep(POLL).await;
        }
    }

    async fn delete(self) {
        let _ = self.js.delete_stream(&self.stream).await;
    }
}

/// The tenant's events as the feed gives them, oldest first.
async fn feed(tenant: &TenantClient) -> Vec<Value> {
    let page = tenant.get("/v1/events?limit=1000").await.expect_json(200);
    page["items"].as_array().expect("a page has items").clone()
}

/// Waits until `name{labels}` satisfies `done`; returns its value.
async fn wait_metric(app: &TestApp, name: &str, labels: &[&str], done: impl Fn(f64) -> bool) -> f64 {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let value = metric(app, name, labels).await;
        if done(value) {
            return value;
        }
        assert!(tokio::time::Instant::now() < deadline, "{name}{labels:?} stayed at {value}; output:\n{}", app.logs());
        tokio::time::sleep(POLL).await;
    }
}

/// Two deductions selling out a resource of 2: `order.applied` twice, and the stock events.
async fn sell_out(tenant: &TenantClient, key: &str) {
    tenant.create_resource(key, 2).await;
    for _ in 0..2 {
        let idem = unique("order");
        tenant.order(&idem, &deduct(&idem, &[(key, 1)])).await.expect_json(201);
    }
}

/// A message's `Nats-Msg-Id` header.
fn msg_id(message: &jetstream::message::StreamMessage) -> String {
    message.headers.get("Nats-Msg-Id").map(|v| v.as_str().to_owned()).unwrap_or_default()
}

/// Orders of two tenants produce events that arrive once each on `<prefix>.<tenant>.<type>`,
/// in each tenant's sequence order, with the feed's envelope as the body and the event id as
/// `Nats-Msg-Id`; the sink counts them all as published and ends with no lag.
#[tokio::test]
async fn events_arrive_once_on_their_tenant_subject_with_the_envelope_and_id() {
    let bus = Bus::new().await;
    let app = spawn_app_with(AppOptions::default().toml(&bus.toml(&nats_url()))).await;
    let shop = app.create_tenant("shop").await;
    let other = app.create_tenant("other-shop").await;
    sell_out(&shop, "sku-1").await;
    sell_out(&other, "sku-2").await;
    let mut expected: Vec<(String, Value)> = Vec::new();
    for tenant in [&shop, &other] {
        expected.extend(feed(tenant).await.into_iter().map(|e| (tenant.id.clone(), e)));
    }
    let applied = expected.iter().filter(|(_, e)| e["type"] == "order.applied").count();
    assert_eq!(applied, 4, "two order.applied per tenant: {expected:?}");

    let messages = bus.wait_for(expected.len(), &app).await;
    assert_eq!(messages.len(), expected.len(), "each event once");
    let mut last_seq: std::collections::HashMap<String, i64> = Default::default();
    for message in &messages {
        let (tenant, event) = expected
            .iter()
            .find(|(_, e)| e["id"] == msg_id(message).as_str())
            .unwrap_or_else(|| panic!("message {:?} is one of the feed's events", message.subject));
        let kind = event["type"].as_str().expect("a type");
        assert_eq!(message.subject.as_str(), format!("{}.{tenant}.{kind}", bus.prefix));
        let body: Value = serde_json::from_slice(&message.payload).expect("the body is JSON");
        assert_eq!(&body, event, "the body is the feed's envelope");
        let seq = event["seq"].as_i64().expect("a seq");
        let previous = last_seq.insert(tenant.clone(), seq).unwrap_or(0);
        assert!(seq > previous, "tenant {tenant}: seq {seq} after {previous}, in sequence order");
    }

    wait_metric(&app, "stockd_event_sink_lag", &["sink=\"nats\""], |v| v == 0.0).await;
    assert_eq!(metric(&app, "stockd_events_published_total", &["sink=\"nats\""]).await, expected.len() as f64);
    assert_eq!(metric(&app, "stockd_events_duplicates_total", &["sink=\"nats\""]).await, 0.0);
    bus.delete().await;
}

/// JetStream receives each event once across a redelivery: the sink publishes a page, JetStream
/// acknowledges it, and the process is killed (-9) before the cursor is stored. The restarted
/// process publishes the page again (counted as duplicates: JetStream dropped every one by its
/// `Nats-Msg-Id`), the stream holds each event exactly once, and later events arrive once too.
#[tokio::test]
async fn jetstream_receives_each_event_once_across_a_redelivery() {
    let bus = Bus::new().await;
    // Events first, without the sink, so its first run finds them all in one page.
    let mut app = spawn_app_with(AppOptions::default()).await;
    let shop = app.create_tenant("shop").await;
    sell_out(&shop, "sku-1").await;
    let events = feed(&shop).await;
    let ids: HashSet<String> = events.iter().map(|e| e["id"].as_str().expect("an id").to_owned()).collect();
    assert!(events.len() >= 3, "two orders and a sell-out: {events:?}");

    app.rewrite_config(&bus.toml(&nats_url()));
    app.set_env("STOCKD_FAULT_HANG_AT", Some(BEFORE_CURSOR));
    app.restart().await;
    // Acknowledged by JetStream: the sink now hangs before storing its cursor.
    let before = bus.wait_for(events.len(), &app).await;
    assert_eq!(before.len(), events.len());
    app.kill9().await;

    app.set_env("STOCKD_FAULT_HANG_AT", None);
    app.restart().await;
    let n = events.len() as f64;
    let republished = wait_metric(&app, "stockd_events_duplicates_total", &["sink=\"nats\""], |v| v >= n).await;
    assert_eq!(republished, n, "the whole page was published again and dropped as duplicates");
    wait_metric(&app, "stockd_event_sink_lag", &["sink=\"nats\""], |v| v == 0.0).await;
    assert_eq!(metric(&app, "stockd_events_published_total", &["sink=\"nats\""]).await, 0.0);
    let after = bus.messages().await;
    assert_eq!(after.len(), events.len(), "the stream holds each event once");
    let stored: HashSet<String> = after.iter().map(msg_id).collect();
    assert_eq!(stored, ids, "no duplicate ids, none missing");

    // The cursor was stored this time: a new event is published once, nothing again.
    shop.adjust("sku-1", &unique("restock"), 5).await.expect_json(200);
    let total = feed(&shop).await.len();
    assert!(total > events.len(), "the restock emitted events");
    let messages = bus.wait_for(total, &app).await;
    wait_metric(&app, "stockd_event_sink_lag", &["sink=\"nats\""], |v| v == 0.0).await;
    assert_eq!(bus.messages().await.len(), total, "each event once: {messages:?}");
    assert_eq!(metric(&app, "stockd_events_duplicates_total", &["sink=\"nats\""]).await, n);
    // Counted once JetStream's acknowledgement is back, a moment after the message is in the
    // stream: waited for, not read at once.
    let fresh = (total - events.len()) as f64;
    assert_eq!(wait_metric(&app, "stockd_events_published_total", &["sink=\"nats\""], |v| v >= fresh).await, fresh);
    bus.delete().await;
}

/// A broker that refuses connections fails the sink's runs, each counted, with the events
/// waiting in `stockd_event_sink_lag`, while `/readyz` stays 200 with the sink not stuck long
/// past its stuck threshold; once the broker is there, the waiting events arrive once.
#[tokio::test]
async fn a_broker_that_is_down_is_counted_and_retried_while_the_server_stays_ready() {
    let bus = Bus::new().await;
    // A port nothing listens on: bound, then let go.
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
        listener.local_addr().expect("a bound address").port()
    };
    let jobs = "[jobs]\nstuck_after_intervals = 2\nstuck_min_ms = 300\n";
    let down = format!("{}{jobs}", bus.toml(&format!("nats://127.0.0.1:{closed}")));
    let mut app = spawn_app_with(AppOptions::default().toml(&down)).await;
    let shop = app.create_tenant("shop").await;
    sell_out(&shop, "sku-1").await;
    let events = feed(&shop).await;

    // At least 20 failed runs 50 ms apart: over three times the 300 ms stuck threshold.
    let failures = ["sink=\"nats\"", "reason=\"connect\""];
    wait_metric(&app, "stockd_events_publish_failures_total", &failures, |v| v >= 20.0).await;
    wait_metric(&app, "stockd_event_sink_lag", &["sink=\"nats\""], |v| v == events.len() as f64).await;
    let ready = app.get_anonymous("/readyz").await;
    assert_eq!(ready.status(), 200, "a broker outage does not make the server unready: {}", ready.text);
    assert_eq!(ready.json()["jobs"]["nats_sink"]["stuck"], json!(false), "{}", ready.text);
    assert!(bus.messages().await.is_empty());

    app.rewrite_config(&format!("{}{jobs}", bus.toml(&nats_url())));
    app.restart().await;
    let messages = bus.wait_for(events.len(), &app).await;
    wait_metric(&app, "stockd_event_sink_lag", &["sink=\"nats\""], |v| v == 0.0).await;
    assert_eq!(bus.messages().await.len(), events.len(), "each waiting event once: {messages:?}");
    bus.delete().await;
}

/// Two processes on one database, both with the sink, orders sent to both: the stream holds
/// each event of every tenant exactly once, and every event was published by one of them. On
/// PostgreSQL and MySQL the cursor claim (`SKIP LOCKED`) also keeps them from publishing any
/// page twice: no duplicates at all. (A SQLite database has one process by design; two still end with each
/// event once, JetStream dropping what both published.)
#[tokio::test]
async fn two_processes_on_one_database_deliver_each_event_once() {
    let bus = Bus::new().await;
    let app = spawn_app_with(AppOptions::default().toml(&bus.toml(&nats_url()))).await;
    let sibling = app.spawn_sibling().await;
    let mut expected: HashSet<String> = HashSet::new();
    for n in 0..4 {
        let tenant = app.create_tenant(&format!("shop-{n}")).await;
        // Half of the orders through each process.
        let via_sibling = sibling.tenant_with_key(&tenant.id, &tenant.api_key);
        tenant.create_resource("sku", 4).await;
        for client in [&tenant, &via_sibling, &tenant, &via_sibling] {
            let idem = unique("order");
            client.order(&idem, &deduct(&idem, &[("sku", 1)])).await.expect_json(201);
        }
        expected.extend(feed(&tenant).await.iter().map(|e| e["id"].as_str().expect("an id").to_owned()));
    }

    let messages = bus.wait_for(expected.len(), &app).await;
    for process in [&app, &sibling] {
        wait_metric(process, "stockd_event_sink_lag", &["sink=\"nats\""], |v| v == 0.0).await;
    }
    let stored: Vec<String> = bus.messages().await.iter().map(msg_id).collect();
    assert_eq!(stored.len(), expected.len(), "each event once: {messages:?}");
    assert_eq!(stored.into_iter().collect::<HashSet<_>>(), expected);
    let mut published = 0.0;
    let mut duplicates = 0.0;
    for process in [&app, &sibling] {
        published += metric(process, "stockd_events_published_total", &["sink=\"nats\""]).await;
        duplicates += metric(process, "stockd_events_duplicates_total", &["sink=\"nats\""]).await;
    }
    assert_eq!(published, expected.len() as f64, "every event was published as new by one process");
    if Backend::from_env().is_server() {
        assert_eq!(duplicates, 0.0, "no page was published by both processes");
    }
    bus.delete().await;
}

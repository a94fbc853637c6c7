//! Webhooks (docs/WEBHOOKS.md): endpoints per tenant, Standard Webhooks signatures checked by an
//! independent verifier (itself checked against the specification's published vectors), at
//! least once in sequence order per ordering key, retries, a process killed between commit and
//! delivery, a receiver down for the whole retry window, rotation, redelivery, and the SSRF
//! guard. Every delivery goes to a real HTTP receiver inside the test, on 127.0.0.1.

use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use hmac::{Hmac, Mac};
use serde_json::{json, Value};
use sha2::Sha256;

use reqwest::Method;

use crate::helpers::{
    assert_problem, deduct, reserve, send, spawn_app, spawn_app_with, tamper, AppOptions, TenantClient, TestApp,
};
use crate::redis_support::{create_redis_resource, deduct_one, order_through_503, redis_app, shared_redis_url};

/// How long a test waits for deliveries before it fails.
const DEADLINE: Duration = Duration::from_secs(60);
/// How often it looks.
const POLL: Duration = Duration::from_millis(50);
/// The replay tolerance of the verifier, as the specification's libraries have it.
const TOLERANCE_S: i64 = 5 * 60;

// ---------------------------------------------------------------------------------------------
// A Standard Webhooks verifier written from the specification, independent of the server's code
// ---------------------------------------------------------------------------------------------

/// `v1,` + base64(HMAC-SHA256(key, "{id}.{timestamp}.{body}")), the key being the base64 after
/// `whsec_`.
fn sign(secret: &str, id: &str, timestamp: &str, body: &str) -> String {
    let key = STANDARD.decode(secret.strip_prefix("whsec_").expect("a whsec_ secret")).expect("base64 key");
    let mut mac = Hmac::<Sha256>::new_from_slice(&key).expect("HMAC takes any key length");
    mac.update(format!("{id}.{timestamp}.{body}").as_bytes());
    format!("v1,{}", STANDARD.encode(mac.finalize().into_bytes()))
}

/// Verifies a delivery the way the specification's libraries do: the timestamp within the
/// tolerance, and one of the space-separated `v1` signatures matching.
fn verify(secret: &str, id: &str, timestamp: &str, body: &str, header: &str, now_s: i64) -> Result<(), String> {
    let ts: i64 = timestamp.parse().map_err(|_| format!("bad timestamp {timestamp:?}"))?;
    if (now_s - ts).abs() > TOLERANCE_S {
        return Err(format!("timestamp {ts} is outside the tolerance"));
    }
    let expected = sign(secret, id, timestamp, body);
    if header.split(' ').any(|s| s.starts_with("v1,") && s == expected) {
        Ok(())
    } else {
        Err(format!("no signature matches in {header:?}"))
    }
}

fn now_s() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0)
}

/// The test verifier agrees with the specification's published example vectors (the Go and
/// Python libraries' sign tests and the Rust library's `test_sign`, standard-webhooks
/// repository), and refuses what it must.
#[test]
fn the_verifier_agrees_with_the_published_vectors() {
    let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    let body = r#"{"test": 2432232314}"#;
    let expected = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=";
    assert_eq!(sign(secret, "msg_p5jXN8AQM9LWM0D4loKWxJek", "1614265330", body), expected);
    let rust_secret = "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD";
    let rust_body = r#"{"email":"test@example.com","username":"test_user"}"#;
    assert_eq!(
        sign(rust_secret, "msg_27UH4WbU6Z5A5EzD8u03UvzRbpk", "1649367553", rust_body),
        "v1,tZ1I4/hDygAJgO5TYxiSd6Sd0kDW6hPenDe+bTa3Kkw="
    );
    let at = 1614265330;
    assert_eq!(verify(secret, "msg_p5jXN8AQM9LWM0D4loKWxJek", "1614265330", body, expected, at), Ok(()));
    let two = format!("v1,Ceo5qEr07ixe2NLpvHk3FH9bwy/WavXrAFQ/9tdO6mc= {expected}");
    assert_eq!(verify(secret, "msg_p5jXN8AQM9LWM0D4loKWxJek", "1614265330", body, &two, at), Ok(()));
    assert!(
        verify(secret, "msg_p5jXN8AQM9LWM0D4loKWxJek", "1614265330", r#"{"test": 2432232315}"#, expected, at).is_err()
    );
    assert!(verify(rust_secret, "msg_p5jXN8AQM9LWM0D4loKWxJek", "1614265330", body, expected, at).is_err());
    assert!(verify(secret, "msg_p5jXN8AQM9LWM0D4loKWxJek", "1614265330", body, expected, at + 3600).is_err());
}

// ---------------------------------------------------------------------------------------------
// A receiving HTTP server
// ---------------------------------------------------------------------------------------------

/// One request the receiver got.
#[derive(Debug, Clone)]
struct Received {
    id: String,
    timestamp: String,
    signature: String,
    body: String,
    /// The status it answered.
    answered: u16,
}

impl Received {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("a delivery body is JSON ({e}): {}", self.body))
    }
}

#[derive(Default)]
struct ReceiverState {
    received: Mutex<Vec<Received>>,
    /// Requests still to answer 503.
    fail_next: AtomicUsize,
    /// Answer 503 to everything.
    down: AtomicBool,
    /// Record each request, then hold it open for a minute before answering.
    hang: AtomicBool,
}

/// An HTTP server on 127.0.0.1 that records every request and answers 200, or 503 while told to.
struct Receiver {
    addr: SocketAddr,
    state: Arc<ReceiverState>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn receive(State(state): State<Arc<ReceiverState>>, headers: HeaderMap, body: Bytes) -> StatusCode {
    let failing = state.down.load(Ordering::SeqCst)
        || state.fail_next.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok();
    let status = if failing { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::OK };
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or_default().to_string();
    state.received.lock().expect("no panics while locked").push(Received {
        id: header("webhook-id"),
        timestamp: header("webhook-timestamp"),
        signature: header("webhook-signature"),
        body: String::from_utf8_lossy(&body).into_owned(),
        answered: status.as_u16(),
    });
    if state.hang.load(Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_secs(60)).await;
    }
    status
}

impl Receiver {
    async fn start() -> Receiver {
        let state = Arc::new(ReceiverState::default());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("a local port");
        let addr = listener.local_addr().expect("a bound address");
        let app = axum::Router::new().route("/hook", axum::routing::post(receive)).with_state(state.clone());
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Receiver { addr, state, task }
    }

    fn url(&self) -> String {
        format!("http://{}/hook", self.addr)
    }

    fn all(&self) -> Vec<Received> {
        self.state.received.lock().expect("no panics while locked").clone()
    }

    /// The requests answered 200, in arrival order.
    fn delivered(&self) -> Vec<Received> {
        self.all().into_iter().filter(|r| r.answered == 200).collect()
    }
}

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// Private targets allowed (the receiver is on 127.0.0.1), fast retries and polls.
fn webhook_options(extra: &str) -> AppOptions {
    AppOptions::default().toml(&webhook_toml(extra))
}

fn webhook_toml(extra: &str) -> String {
    format!(
        "[events.webhooks]\nallow_private_targets = true\nretry_initial_ms = 50\nretry_max_ms = 200\npoll_interval_ms = 50\n{extra}"
    )
}

/// Registers an endpoint for every type; returns its JSON (with the secret).
async fn register(shop: &TenantClient, url: &str) -> Value {
    shop.post("/v1/webhooks", &json!({"url": url, "description": "test receiver"})).await.expect_json(201)
}

/// The tenant's whole feed, oldest first.
async fn feed(shop: &TenantClient) -> Vec<Value> {
    let page = shop.get("/v1/events?limit=1000").await.expect_json(200);
    page["items"].as_array().expect("items").clone()
}

/// Polls `done` until it holds or the deadline passes.
async fn eventually<F: FnMut() -> bool>(what: &str, app: &TestApp, mut done: F) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while !done() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what} did not happen in time; server output:\n{}",
            app.logs()
        );
        tokio::time::sleep(POLL).await;
    }
}

/// Waits until the `webhooks` job of `app` has finished two passes that began after this call
/// (as `/readyz` reports its last successful run): whatever those passes would send is sent.
async fn two_delivery_passes(app: &TestApp) {
    for _ in 0..2 {
        let since = tokio::time::Instant::now();
        loop {
            let ready = app.get_anonymous("/readyz").await.json();
            let ago = ready["jobs"]["webhooks"]["last_ok_ms_ago"].as_u64();
            // A millisecond's margin: the server counts in whole milliseconds.
            if ago.is_some_and(|ago| u128::from(ago) + 2 < since.elapsed().as_millis()) {
                break;
            }
            assert!(since.elapsed() < DEADLINE, "the webhook job runs a pass: {ready}");
            tokio::time::sleep(POLL).await;
        }
    }
}

/// Waits until the receiver has a 2xx delivery of every event in the feed; returns the feed.
/// The endpoint's deliveries log once it holds `attempts` entries. The receiver has every body
/// before the last attempts are recorded (a success is logged after its answer), so the log is
/// waited for, not read at once.
async fn logged_attempts(shop: &TenantClient, endpoint_id: &str, attempts: usize) -> Value {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let log = shop.get(&format!("/v1/webhooks/{endpoint_id}/deliveries?limit=1000")).await.expect_json(200);
        if log["items"].as_array().map(Vec::len) == Some(attempts) {
            return log;
        }
        assert!(tokio::time::Instant::now() < deadline, "every attempt is logged: {log}");
        tokio::time::sleep(POLL).await;
    }
}

async fn until_all_delivered(app: &TestApp, shop: &TenantClient, receiver: &Receiver) -> Vec<Value> {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let events = feed(shop).await;
        let delivered: BTreeSet<String> = receiver.delivered().into_iter().map(|r| r.id).collect();
        if !events.is_empty() && events.iter().all(|e| delivered.contains(e["id"].as_str().unwrap_or_default())) {
            return events;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "not every event was delivered: feed {events:#?}\nreceived {:#?}\nserver output:\n{}",
            receiver.all(),
            app.logs()
        );
        tokio::time::sleep(POLL).await;
    }
}

/// The ordering key an event is delivered in order within (as the server derives it).
fn ordering_key(event: &Value) -> String {
    let kind = event["type"].as_str().unwrap_or_default();
    if kind.starts_with("order.") || kind.starts_with("reservation.") {
        format!("order:{}", event["data"]["order_id"].as_str().unwrap_or_default())
    } else {
        format!("resource:{}", event["data"]["key"].as_str().unwrap_or_default())
    }
}

/// Asserts that, in arrival order, each ordering key's successful deliveries have increasing
/// sequence numbers.
fn assert_in_order_per_key(delivered: &[Received]) {
    let mut last: HashMap<String, i64> = HashMap::new();
    for r in delivered {
        let event = r.json();
        let seq = event["seq"].as_i64().expect("seq");
        let key = ordering_key(&event);
        if let Some(&before) = last.get(&key) {
            assert!(seq > before, "{key}: seq {seq} delivered after {before}");
        }
        last.insert(key, seq);
    }
}

/// Makes one event of each type a database-mode server emits without Redis (not
/// `settlement.failed`, which needs redis mode, nor `order.reversed`, which nothing emits yet).
/// Returns the types made.
async fn one_event_of_each_type(app: &TestApp, shop: &TenantClient) -> BTreeSet<&'static str> {
    shop.post("/v1/resources", &json!({"key": "sku-a", "kind": "inventory", "total": 10, "low_stock": 3}))
        .await
        .expect_json(201);
    shop.create_resource("sku-b", 10).await;
    shop.create_resource("sku-d", 10).await;
    // 10 → 2: low stock; → 0: sold out; +5: restocked.
    shop.order("ord-1", &deduct("ORD-1", &[("sku-a", 8)])).await.expect_json(201);
    shop.order("ord-2", &deduct("ORD-2", &[("sku-a", 2)])).await.expect_json(201);
    shop.adjust("sku-a", "adj-1", 5).await.expect_json(200);
    // Held, then confirmed / released / expired.
    let held = shop.order("ord-3", &reserve("ORD-3", &[("sku-b", 1)], None)).await.expect_json(201);
    shop.confirm(held["reservation_id"].as_str().expect("a reservation")).await.expect_json(200);
    let held = shop.order("ord-4", &reserve("ORD-4", &[("sku-b", 1)], None)).await.expect_json(201);
    shop.release(held["reservation_id"].as_str().expect("a reservation")).await.expect_json(200);
    shop.order("ord-5", &reserve("ORD-5", &[("sku-b", 1)], Some(1))).await.expect_json(201);
    // Drift in history a pass proved clean: reconciliation.drift.
    shop.get("/v1/reconciliation").await.expect_json(200);
    tamper(
        app.database_url(),
        &["UPDATE resources SET available = available + 1, total = total + 1 WHERE tenant_id = 'shop' AND \"key\" = 'sku-d'"],
    )
    .await;
    shop.get("/v1/reconciliation").await.expect_json(200);
    // A return of one unit of the first order: order.reversed.
    let returned = json!({"lines": [{"key": "sku-a", "qty": 1}], "reason": "returned"});
    shop.post_with_key("/v1/orders/ORD-1/reversals", "rev-1", &returned).await.expect_json(201);
    // A sale Redis made that the database copy cannot take: settlement.failed.
    create_redis_resource(shop, "flash", 3).await;
    tamper(
        app.database_url(),
        &["UPDATE resources SET available = 0, total = reserved + consumed WHERE tenant_id = 'shop' AND \"key\" = 'flash'"],
    )
    .await;
    order_through_503(shop, "ord-6", &deduct_one("ORD-6", "flash", 1, None)).await.expect_json(201);
    BTreeSet::from([
        "order.applied",
        "order.reversed",
        "settlement.failed",
        "reservation.held",
        "reservation.confirmed",
        "reservation.released",
        "reservation.expired",
        "resource.low_stock",
        "resource.sold_out",
        "resource.restocked",
        "reconciliation.drift",
    ])
}

// ---------------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------------

/// Endpoints are created (the secret answered once), listed and read without the secret, and
/// deleted; bad input is refused; another tenant's endpoint answers exactly like a missing one.
#[tokio::test]
async fn webhooks_are_created_listed_and_deleted_and_the_secret_is_shown_once() {
    let app = spawn_app_with(webhook_options("max_endpoints_per_tenant = 2")).await;
    let shop = app.create_tenant("shop").await;
    let other = app.create_tenant("other").await;
    let receiver = Receiver::start().await;

    let created = shop
        .post(
            "/v1/webhooks",
            &json!({"url": receiver.url(), "types": ["order.applied", "resource.sold_out"], "description": "erp"}),
        )
        .await
        .expect_json(201);
    let id = created["id"].as_str().expect("an id").to_string();
    assert!(id.starts_with("wh_") && id.len() == 29, "{id}");
    assert!(created["secret"].as_str().expect("the secret").starts_with("whsec_"));
    assert_eq!(created["types"], json!(["order.applied", "resource.sold_out"]));
    assert_eq!((&created["state"], &created["description"]), (&json!("active"), &json!("erp")));

    let listed = shop.get("/v1/webhooks").await.expect_json(200);
    assert_eq!(listed["items"].as_array().map(Vec::len), Some(1));
    assert_eq!(listed["items"][0]["id"], id.as_str());
    let one = shop.get(&format!("/v1/webhooks/{id}")).await.expect_json(200);
    assert_eq!(one["pending"], 0);
    for body in [&listed.to_string(), &one.to_string()] {
        assert!(!body.contains("whsec_") && !body.contains("\"secret\""), "no secret after creation: {body}");
    }

    // Tenant isolation: another tenant's endpoint is not found, whatever the operation.
    assert_eq!(other.get("/v1/webhooks").await.expect_json(200)["items"], json!([]));
    for reply in [
        other.get(&format!("/v1/webhooks/{id}")).await,
        other.get(&format!("/v1/webhooks/{id}/deliveries")).await,
        other.post(&format!("/v1/webhooks/{id}/rotate"), &json!({})).await,
        other.post(&format!("/v1/webhooks/{id}/redeliver"), &json!({})).await,
        send(other.request(Method::DELETE, &format!("/v1/webhooks/{id}"))).await,
    ] {
        assert_problem(&reply, 404, "webhook_not_found");
    }
    assert_problem(&shop.get("/v1/webhooks/wh_nope").await, 404, "webhook_not_found");

    // Bad input.
    assert_problem(&shop.post("/v1/webhooks", &json!({"url": "ftp://example.com/"})).await, 400, "validation_failed");
    assert_problem(
        &shop.post("/v1/webhooks", &json!({"url": "https://u:p@example.com/"})).await,
        400,
        "validation_failed",
    );
    let long = format!("http://example.com/{}", "a".repeat(2100));
    assert_problem(&shop.post("/v1/webhooks", &json!({"url": long})).await, 400, "validation_failed");
    let typo = json!({"url": receiver.url(), "types": ["order.nope"]});
    assert_problem(&shop.post("/v1/webhooks", &typo).await, 400, "validation_failed");
    let chatty = json!({"url": receiver.url(), "description": "x".repeat(501)});
    assert_problem(&shop.post("/v1/webhooks", &chatty).await, 400, "validation_failed");
    assert_problem(
        &shop.post("/v1/webhooks", &json!({"url": receiver.url(), "extra": 1})).await,
        400,
        "validation_failed",
    );

    // The per-tenant limit.
    register(&shop, &receiver.url()).await;
    assert_problem(&shop.post("/v1/webhooks", &json!({"url": receiver.url()})).await, 409, "webhook_limit");

    assert_eq!(send(shop.request(Method::DELETE, &format!("/v1/webhooks/{id}"))).await.status(), 204);
    assert_problem(&shop.get(&format!("/v1/webhooks/{id}")).await, 404, "webhook_not_found");
}

/// Without `allow_private_targets`, targets in loopback, private, link-local or other
/// non-public ranges are refused (literal or by name); nothing is stored.
#[tokio::test]
async fn private_targets_are_refused_without_the_setting() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    for url in [
        "http://127.0.0.1:9/hook",
        "http://localhost:9/hook",
        "http://[::1]:9/hook",
        "http://10.0.0.1/hook",
        "http://192.168.1.10/hook",
        "http://169.254.169.254/latest/meta-data",
        "http://100.64.0.1/hook",
        "http://[::ffff:127.0.0.1]/hook",
        "http://[fd00::1]/hook",
        "http://0.0.0.0/hook",
    ] {
        let reply = shop.post("/v1/webhooks", &json!({"url": url})).await;
        assert_problem(&reply, 422, "webhook_target_refused");
    }
    assert_eq!(shop.get("/v1/webhooks").await.expect_json(200)["items"], json!([]));
}

/// Every event type the server emits here reaches the receiver once, with Standard Webhooks
/// headers that verify with the endpoint's secret, as the feed has it (same id, body), and in
/// sequence order per ordering key.
#[tokio::test]
async fn every_event_type_is_delivered_signed_and_in_order() {
    let (app, _prefix) = redis_app(&shared_redis_url(), &webhook_toml("")).await;
    let shop = app.create_tenant("shop").await;
    let receiver = Receiver::start().await;
    let endpoint = register(&shop, &receiver.url()).await;
    let secret = endpoint["secret"].as_str().expect("the secret").to_string();

    let types = one_event_of_each_type(&app, &shop).await;
    assert_eq!(types.len(), 11, "every type stockd emits: {types:?}");
    // The expiry comes from the sweeper and the failure from settlement: wait for both in the
    // feed, then for every delivery.
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let events = feed(&shop).await;
        if ["reservation.expired", "settlement.failed"].iter().all(|t| events.iter().any(|e| e["type"] == *t)) {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the expiry and the settlement failure: {events:#?}");
        tokio::time::sleep(POLL).await;
    }
    let events = until_all_delivered(&app, &shop, &receiver).await;

    let delivered = receiver.delivered();
    let seen: BTreeSet<&str> = events.iter().filter_map(|e| e["type"].as_str()).collect();
    for t in &types {
        assert!(seen.contains(t), "{t} is in the feed: {seen:?}");
    }
    let by_id: HashMap<&str, &Received> = delivered.iter().map(|r| (r.id.as_str(), r)).collect();
    assert_eq!(by_id.len(), delivered.len(), "each event is delivered once to a receiver that answers 200");
    assert_eq!(delivered.len(), events.len());
    for event in &events {
        let id = event["id"].as_str().expect("an id");
        let r = by_id[id];
        verify(&secret, &r.id, &r.timestamp, &r.body, &r.signature, now_s())
            .unwrap_or_else(|e| panic!("delivery of {id} does not verify: {e}"));
        assert_eq!(&r.json(), event, "the body is the feed's envelope");
        assert!(!r.signature.contains(' '), "one signature outside a rotation: {}", r.signature);
    }
    assert_in_order_per_key(&delivered);

    // The deliveries log shows each attempt with its status and latency.
    let id = endpoint["id"].as_str().expect("an id");
    let log = logged_attempts(&shop, id, events.len()).await;
    let items = log["items"].as_array().expect("items");
    for item in items {
        assert_eq!(
            (&item["outcome"], &item["http_status"], &item["attempt"]),
            (&json!("delivered"), &json!(200), &json!(1))
        );
        assert!(item["latency_ms"].as_i64().is_some_and(|ms| ms >= 0), "{item}");
    }
}

/// A receiver that answers 503 to its first three requests gets every event after the retries,
/// each exactly once answered 200; the log shows the three failures with their status.
#[tokio::test]
async fn a_receiver_that_fails_three_times_gets_each_event_once_after_the_retries() {
    let app = spawn_app_with(webhook_options("")).await;
    let shop = app.create_tenant("shop").await;
    let receiver = Receiver::start().await;
    receiver.state.fail_next.store(3, Ordering::SeqCst);
    let endpoint = register(&shop, &receiver.url()).await;

    shop.create_resource("sku-1", 10).await;
    for n in 0..3 {
        shop.order(&format!("o-{n}"), &deduct(&format!("ORD-{n}"), &[("sku-1", 1)])).await.expect_json(201);
    }
    let events = until_all_delivered(&app, &shop, &receiver).await;
    assert_eq!(events.len(), 3, "three order.applied events: {events:#?}");

    let delivered = receiver.delivered();
    let ids: BTreeSet<&str> = delivered.iter().map(|r| r.id.as_str()).collect();
    assert_eq!(ids.len(), delivered.len(), "no event is delivered twice after a success: {delivered:#?}");
    assert_eq!(receiver.all().iter().filter(|r| r.answered == 503).count(), 3);

    let id = endpoint["id"].as_str().expect("an id");
    let log = logged_attempts(&shop, id, 6).await;
    let items = log["items"].as_array().expect("items");
    let failed: Vec<&Value> = items.iter().filter(|i| i["outcome"] == "failed").collect();
    assert_eq!(failed.len(), 3, "{log}");
    for f in failed {
        assert_eq!((&f["http_status"], &f["error"]), (&json!(503), &json!("http_status")), "{f}");
    }
    assert_eq!(items.iter().filter(|i| i["outcome"] == "delivered").count(), 3, "{log}");
    let state = shop.get(&format!("/v1/webhooks/{id}")).await.expect_json(200);
    assert_eq!((&state["state"], &state["pending"]), (&json!("active"), &json!(0)), "{state}");
}

/// Events committed by a process that is killed (-9) before it delivered them reach the
/// receiver after a restart on the same database.
#[tokio::test]
async fn events_committed_before_a_kill_are_delivered_after_the_restart() {
    // The first process delivers nothing: whatever it commits is committed and undelivered.
    let app_options = webhook_options("enabled = false");
    let mut app = spawn_app_with(app_options).await;
    let shop = app.create_tenant("shop").await;
    let receiver = Receiver::start().await;
    register(&shop, &receiver.url()).await;
    shop.create_resource("sku-1", 2).await;
    shop.order("o-1", &deduct("ORD-1", &[("sku-1", 2)])).await.expect_json(201);
    let before = feed(&shop).await;
    assert_eq!(before.len(), 2, "order.applied, resource.sold_out: {before:#?}");

    app.kill9().await;
    app.rewrite_config(
        "[events.webhooks]\nallow_private_targets = true\nretry_initial_ms = 50\nretry_max_ms = 200\npoll_interval_ms = 50\n",
    );
    app.restart().await;
    let events = until_all_delivered(&app, &shop, &receiver).await;
    assert_eq!(events, before, "the feed is what was committed before the kill");
    assert_eq!(receiver.delivered().len(), before.len());
    assert_in_order_per_key(&receiver.delivered());
}

/// A receiver down for the whole (short) retry window leaves the endpoint `failing`, nothing
/// more is sent to it, and the feed still has every event; a redeliver call makes it active
/// again and the events arrive.
#[tokio::test]
async fn a_receiver_down_for_the_whole_window_leaves_the_endpoint_failing_and_the_feed_complete() {
    let app = spawn_app_with(webhook_options("retry_window_seconds = 2")).await;
    let shop = app.create_tenant("shop").await;
    let receiver = Receiver::start().await;
    receiver.state.down.store(true, Ordering::SeqCst);
    let endpoint = register(&shop, &receiver.url()).await;
    let id = endpoint["id"].as_str().expect("an id").to_string();

    shop.create_resource("sku-1", 10).await;
    for n in 0..4 {
        shop.order(&format!("o-{n}"), &deduct(&format!("ORD-{n}"), &[("sku-1", 1)])).await.expect_json(201);
    }
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let failing = loop {
        let state = shop.get(&format!("/v1/webhooks/{id}")).await.expect_json(200);
        if state["state"] == "failing" {
            break state;
        }
        assert!(tokio::time::Instant::now() < deadline, "the endpoint never failed: {state}\n{}", app.logs());
        tokio::time::sleep(POLL).await;
    };
    assert!(failing["failing_since"].is_string(), "{failing}");
    assert_eq!(failing["pending"], 4, "the undelivered events stay queued: {failing}");
    assert!(receiver.all().len() >= 2, "it was retried: {}", receiver.all().len());
    assert!(receiver.delivered().is_empty());

    // Nothing more is sent to a failing endpoint.
    let attempts = receiver.all().len();
    let log = shop.get(&format!("/v1/webhooks/{id}/deliveries?limit=1000")).await.expect_json(200);
    assert!(
        log["items"].as_array().is_some_and(|i| !i.is_empty() && i.iter().all(|a| a["outcome"] == "failed")),
        "{log}"
    );
    two_delivery_passes(&app).await;
    assert_eq!(receiver.all().len(), attempts, "a failing endpoint gets nothing");

    // A failing receiver is not the server's health.
    assert_eq!(app.get_anonymous("/readyz").await.status(), 200, "/readyz ignores receivers");

    // The feed is complete: every event is there.
    let events = feed(&shop).await;
    assert_eq!(events.iter().filter(|e| e["type"] == "order.applied").count(), 4, "{events:#?}");

    // Back up, redeliver: active again, everything arrives, in order.
    receiver.state.down.store(false, Ordering::SeqCst);
    let again = shop.post(&format!("/v1/webhooks/{id}/redeliver"), &json!({})).await.expect_json(202);
    assert_eq!(again["state"], "active");
    until_all_delivered(&app, &shop, &receiver).await;
    assert_in_order_per_key(&receiver.delivered());
    assert_eq!(shop.get(&format!("/v1/webhooks/{id}")).await.expect_json(200)["state"], "active");
}

/// After a rotation, deliveries carry two signatures during the grace period: one verifies
/// with the new secret, one with the old. A redeliver of one event sends it again with the
/// same `webhook-id`.
#[tokio::test]
async fn rotation_signs_with_both_secrets_and_redeliver_sends_an_event_again() {
    let app = spawn_app_with(webhook_options("")).await;
    let shop = app.create_tenant("shop").await;
    let receiver = Receiver::start().await;
    let endpoint = register(&shop, &receiver.url()).await;
    let id = endpoint["id"].as_str().expect("an id").to_string();
    let old = endpoint["secret"].as_str().expect("the secret").to_string();

    let rotated =
        shop.post(&format!("/v1/webhooks/{id}/rotate"), &json!({"grace_seconds": 3600})).await.expect_json(200);
    let new = rotated["secret"].as_str().expect("the new secret").to_string();
    assert_ne!(new, old);
    assert!(rotated["previous_secret_expires_at"].is_string(), "{rotated}");
    assert_problem(
        &shop.post(&format!("/v1/webhooks/{id}/rotate"), &json!({"grace_seconds": 10_000_000})).await,
        400,
        "validation_failed",
    );

    shop.create_resource("sku-1", 10).await;
    shop.order("o-1", &deduct("ORD-1", &[("sku-1", 1)])).await.expect_json(201);
    let events = until_all_delivered(&app, &shop, &receiver).await;
    let r = receiver.delivered()[0].clone();
    assert_eq!(r.signature.split(' ').count(), 2, "two signatures during the grace: {}", r.signature);
    verify(&new, &r.id, &r.timestamp, &r.body, &r.signature, now_s()).expect("the new secret verifies");
    verify(&old, &r.id, &r.timestamp, &r.body, &r.signature, now_s()).expect("the old secret verifies");

    // Redeliver the event: the receiver gets it again, same id.
    let event_id = events[0]["id"].as_str().expect("an id").to_string();
    let again =
        shop.post(&format!("/v1/webhooks/{id}/redeliver"), &json!({"event_id": event_id})).await.expect_json(202);
    assert_eq!(again["queued"], 1);
    eventually("the redelivery", &app, || receiver.delivered().iter().filter(|r| r.id == event_id).count() == 2).await;
    let unknown = shop.post(&format!("/v1/webhooks/{id}/redeliver"), &json!({"event_id": "evt_nope"})).await;
    assert_problem(&unknown, 404, "event_not_found");
}

/// Two processes on one database both run the delivery job: every event is sent once, by one
/// of them (claims skip what the other holds), and in order per ordering key.
#[tokio::test]
async fn two_processes_deliver_each_event_once() {
    let app = spawn_app_with(webhook_options("")).await;
    let shop = app.create_tenant("shop").await;
    let sibling = app.spawn_sibling().await;
    let shop2 = sibling.tenant_with_key(&shop.id, &shop.api_key);
    let receiver = Receiver::start().await;
    register(&shop, &receiver.url()).await;

    shop.create_resource("sku-1", 1_000).await;
    shop.create_resource("sku-2", 1_000).await;
    for n in 0..20 {
        let (client, key) = if n % 2 == 0 { (&shop, "sku-1") } else { (&shop2, "sku-2") };
        client.order(&format!("o-{n}"), &deduct(&format!("ORD-{n}"), &[(key, 1)])).await.expect_json(201);
    }
    let events = until_all_delivered(&app, &shop, &receiver).await;
    assert_eq!(events.len(), 20);
    // Both processes' jobs pass twice more: a second sender, if there were one, would show.
    two_delivery_passes(&app).await;
    two_delivery_passes(&sibling).await;
    let all = receiver.all();
    let ids: BTreeSet<&str> = all.iter().map(|r| r.id.as_str()).collect();
    assert_eq!((ids.len(), all.len()), (20, 20), "each event sent once: {all:#?}");
    assert_in_order_per_key(&receiver.delivered());
}

/// Proves a tenant whose receiver hangs holds at most its share of the delivery places
/// (`max_in_flight_per_tenant`): another tenant's event is delivered while the first tenant's
/// deliveries are still hanging, long before they time out.
#[tokio::test]
async fn a_tenant_whose_receiver_hangs_does_not_hold_up_another_tenants_deliveries() {
    let app = spawn_app_with(webhook_options(
        "max_concurrency = 4\nmax_in_flight_per_tenant = 2\nrequest_timeout_ms = 30000",
    ))
    .await;
    let slow = app.create_tenant("slow").await;
    let fast = app.create_tenant("fast").await;
    let hanging = Receiver::start().await;
    hanging.state.hang.store(true, Ordering::SeqCst);
    let healthy = Receiver::start().await;
    register(&slow, &hanging.url()).await;
    register(&fast, &healthy.url()).await;

    // Eight events of the slow tenant, each of its own order: all could go at once.
    slow.create_resource("sku-1", 100).await;
    for i in 0..8 {
        slow.order(&format!("k{i}"), &deduct(&format!("ORD-{i}"), &[("sku-1", 1)])).await.expect_json(201);
    }
    eventually("the hanging receiver holds its share", &app, || hanging.all().len() >= 2).await;

    fast.create_resource("sku-1", 100).await;
    fast.order("k1", &deduct("ORD-1", &[("sku-1", 1)])).await.expect_json(201);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while healthy.delivered().is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the other tenant's event waits behind {} hanging deliveries",
            hanging.all().len()
        );
        tokio::time::sleep(POLL).await;
    }
    assert_eq!(hanging.all().len(), 2, "the hanging tenant never holds more than its share");
}

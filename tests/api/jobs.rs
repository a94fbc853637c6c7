//! Supervision of the background jobs, seen from outside: a job that panics is restarted and
//! keeps doing its work, `/readyz` lists every job with its restarts, answers 503 `job_stuck`
//! while one makes no progress, and a panic in the SQLite writer fails only its own batch.
//! Faults are injected with the server's test hooks `STOCKD_FAULT_PANIC_JOB` and
//! `STOCKD_FAULT_HANG_JOB` (src/jobs/supervisor.rs).

use std::time::Duration;

use serde_json::{json, Value};

use crate::helpers::{assert_problem, reserve, spawn_app_with, unique, AppOptions, Backend, TestApp};
use crate::redis_support::{create_redis_resource, deduct_one, order_through_503, shared_redis_url, wait_settled};

/// Bound on every wait for the server to reach a state.
const DEADLINE: Duration = Duration::from_secs(30);

/// Polls `/readyz` until `done` accepts an answer; fails after `DEADLINE`.
async fn poll_readyz(app: &TestApp, what: &str, done: impl Fn(u16, &Value) -> bool) -> (u16, Value) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let reply = app.get_anonymous("/readyz").await;
        let body = reply.json();
        if done(reply.status(), &body) {
            return (reply.status(), body);
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "/readyz never {what}; last: {} {}",
            reply.status(),
            reply.text
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The value of a metric line starting with `series` (e.g. `name{label="x"}`), if present.
async fn metric(app: &TestApp, series: &str) -> Option<f64> {
    let text = app.get_anonymous("/metrics").await.text;
    text.lines().find_map(|line| line.strip_prefix(series).and_then(|rest| rest.trim().parse().ok()))
}

/// The reservation sweeper panics on its first three runs; it is restarted each time, a held
/// reservation past its deadline still expires, and `/readyz` (200) lists every job with the
/// sweeper's three restarts, as does `stockd_job_panics_total`.
#[tokio::test]
async fn a_sweeper_that_panicked_is_restarted_and_reservations_still_expire() {
    let app = spawn_app_with(
        AppOptions::default().toml("[reservations]\nsweep_interval_ms = 100").env("STOCKD_FAULT_PANIC_JOB", "expiry:3"),
    )
    .await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 10).await;
    let idem = unique("rsv");
    let doc = shop.order(&idem, &reserve(&idem, &[("sku-1", 4)], Some(1))).await.expect_json(201);
    let id = doc["reservation_id"].as_str().expect("a reserve has a reservation_id").to_owned();

    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let current = shop.reservation(&id).await.expect_json(200);
        if current["state"] == "expired" {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the reservation never expired: {current}\n{}", app.logs());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(shop.state("sku-1").await["available"], 10, "the expired hold returned its stock");

    let (_, ready) = poll_readyz(&app, "showed the sweeper's restarts", |status, body| {
        status == 200 && body["jobs"]["expiry"]["restarts"] == 3
    })
    .await;
    for job in ["expiry", "idempotency_purge", "rebalance", "reconciliation"] {
        assert_eq!(ready["jobs"][job]["stuck"], false, "{job} is listed and not stuck: {ready}");
    }
    assert!(ready["jobs"]["expiry"]["last_ok_ms_ago"].is_u64(), "{ready}");
    assert_eq!(ready["jobs"]["reconciliation"]["restarts"], 0, "{ready}");
    assert_eq!(metric(&app, "stockd_job_panics_total{job=\"expiry\"}").await, Some(3.0));
}

/// The sweeper's first run hangs for 4 s while its stuck threshold is 0.5 s: `/readyz` answers
/// 503 `job_stuck` (problem+json, `Retry-After`) during the hang and 200 again once the sweeper
/// has run.
#[tokio::test]
async fn readyz_is_503_while_a_job_is_stuck_and_200_after() {
    let app = spawn_app_with(
        AppOptions::default()
            .toml("[reservations]\nsweep_interval_ms = 50\n[jobs]\nstuck_after_intervals = 10\nstuck_min_ms = 500")
            .env("STOCKD_FAULT_HANG_JOB", "expiry:4000"),
    )
    .await;
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let stuck = loop {
        let reply = app.get_anonymous("/readyz").await;
        if reply.status() == 503 {
            break reply;
        }
        // The hang began at start-up; it cannot be over before the threshold passed.
        assert_eq!(reply.json()["jobs"]["expiry"]["last_ok_ms_ago"], Value::Null, "{}", reply.text);
        assert!(tokio::time::Instant::now() < deadline, "/readyz never answered 503: {}", reply.text);
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let problem = assert_problem(&stuck, 503, "job_stuck");
    assert!(problem["detail"].as_str().is_some_and(|d| d.contains("expiry")), "{problem}");
    assert!(stuck.header("retry-after").is_some(), "a stuck job's 503 says when to come back");

    let (_, ready) = poll_readyz(&app, "came back to 200", |status, _| status == 200).await;
    assert_eq!(ready["jobs"]["expiry"]["stuck"], false, "{ready}");
    assert_eq!(ready["jobs"]["expiry"]["restarts"], 0, "a hang is no panic: {ready}");
}

/// SQLite only (the writer thread is that backend's): the writer panics in its first 20 batches,
/// after their writes and before their commit. Each request in such a batch is answered 503
/// `unavailable` (never a hang, never a 500) and nothing of it is committed (a retried tenant
/// creation is never 409); the writer goes on, so a retry soon gets 201, and the panics are
/// counted.
#[tokio::test]
async fn a_panic_in_the_sqlite_writer_fails_its_batch_with_503_and_the_writer_goes_on() {
    if Backend::from_env() != Backend::Sqlite {
        return;
    }
    const PANICS: u64 = 20;
    let app =
        spawn_app_with(AppOptions::default().env("STOCKD_FAULT_PANIC_JOB", &format!("sqlite_writer:{PANICS}"))).await;
    let body = json!({"id": "shop", "name": "Shop"});
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let mut refused = 0;
    let created = loop {
        let reply = app.admin_post("/v1/admin/tenants", &body).await;
        if reply.status() == 201 {
            break reply.json();
        }
        assert_problem(&reply, 503, "unavailable");
        assert!(reply.header("retry-after").is_some(), "{}", reply.text);
        refused += 1;
        assert!(tokio::time::Instant::now() < deadline, "the writer never came back: {}\n{}", reply.text, app.logs());
        // The jobs' writes use up the panics too; pace the retries a little.
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(refused >= 1, "the first attempts met the injected panics");

    let key = created["api_key"].as_str().expect("api_key is a string");
    let shop = app.tenant_with_key("shop", key);
    shop.create_resource("sku-1", 5).await;
    let (status, _) = poll_readyz(&app, "answered 200", |status, _| status == 200).await;
    assert_eq!(status, 200);
    assert_eq!(metric(&app, "stockd_job_panics_total{job=\"sqlite_writer\"}").await, Some(PANICS as f64));
}

/// The Redis settlement consumer panics on its first three passes: it is restarted, sales
/// still settle into the database, and `/readyz` shows its three restarts.
#[tokio::test]
async fn a_settlement_consumer_that_panicked_is_restarted_and_sales_still_settle() {
    let prefix = unique("t");
    let app = spawn_app_with(
        AppOptions::default()
            .env("STOCKD_REDIS_URL", &shared_redis_url())
            .env("STOCKD_REDIS_PREFIX", &prefix)
            .env("STOCKD_FAULT_PANIC_JOB", "settlement:3"),
    )
    .await;
    let shop = app.create_tenant("shop").await;
    create_redis_resource(&shop, "sku-1", 10).await;
    for n in 0..3 {
        let key = format!("o{n}");
        assert_eq!(order_through_503(&shop, &key, &deduct_one(&key, "sku-1", 1, None)).await.status(), 201);
    }
    wait_settled(&shop, "sku-1", 3).await;
    let (_, ready) = poll_readyz(&app, "showed the consumer's restarts", |status, body| {
        status == 200 && body["jobs"]["settlement"]["restarts"] == 3
    })
    .await;
    assert_eq!(ready["jobs"]["soldout_listener"]["stuck"], false, "{ready}");
    assert_eq!(ready["jobs"]["soldout_listener"]["stuck_after_ms"], Value::Null, "{ready}");
}

/// A job hung in a run does not hold up shutdown: with the sweeper's first run hanging for ten
/// minutes, SIGTERM still stops the server promptly and cleanly (exit status 0).
#[tokio::test]
async fn a_hung_job_does_not_hold_up_shutdown() {
    let mut app = spawn_app_with(AppOptions::default().env("STOCKD_FAULT_HANG_JOB", "expiry:600000")).await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 5).await;
    let status = app.terminate_within(Duration::from_secs(20)).await;
    let status = status.unwrap_or_else(|| panic!("stockd did not stop within 20 s of SIGTERM:\n{}", app.logs()));
    assert!(status.success(), "exit status {status:?}\n{}", app.logs());
}

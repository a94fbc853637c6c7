//! `redis-hot-key`: the hot-key scenario on a resource in redis mode (docs/REDIS.md). The
//! server must have Redis configured: `stockd bench` passes its environment on to the server it
//! starts, so run it with `STOCKD_REDIS_URL=redis://127.0.0.1:6379`.
//!
//! After the run it waits (bounded) until every sale is settled into the database, then checks
//! what the database path's scenarios check plus the Redis side: consumed == acknowledged
//! successes, Redis agreeing with the database, no settlement failure.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::bail;
use serde::Serialize;
use serde_json::{json, Value};

use super::load::{self, get_json, Limit, Target, TOTAL};
use super::Stats;

/// The scenario's name and its resource key.
pub const NAME: &str = "redis-hot-key";
const KEY: &str = "redis-hot-key:k0";
/// How long the check waits for the settlement backlog to drain.
const SETTLE_WAIT: Duration = Duration::from_secs(120);

/// Creates the redis-mode resource (warmed by the server on creation).
pub async fn create_resource(t: &Target) -> anyhow::Result<()> {
    let resp = t
        .client
        .post(format!("{}/v1/resources", t.base))
        .bearer_auth(&t.api_key)
        .json(&json!({"key": KEY, "kind": "inventory", "total": TOTAL, "mode": "redis"}))
        .send()
        .await?;
    let status = resp.status();
    if !status.is_success() {
        bail!(
            "creating {KEY} in redis mode: {status} {} (is STOCKD_REDIS_URL set for the server?)",
            resp.text().await.unwrap_or_default()
        );
    }
    Ok(())
}

/// `clients` closed loops of one-piece deductions of the redis-mode key until `limit`.
pub async fn run(t: &Arc<Target>, clients: usize, limit: Limit) -> anyhow::Result<Stats> {
    load::run_one_piece_orders(
        t,
        clients,
        limit,
        NAME,
        |idem| json!({"order_id": idem, "action": "deduct", "lines": [{"key": KEY, "qty": 1}]}),
    )
    .await
}

/// How settlement kept up with the sales: what was left to settle when the load ended, and how
/// long it took to settle it. Sales are acknowledged from Redis, so `ok/s` is the rate Redis took
/// them at; `settled_per_sec` is the rate they reached the database at, the one a sale that
/// goes on for long can hold (the backlog grows by the difference meanwhile).
#[derive(Debug, Clone, Serialize)]
pub struct Settlement {
    /// Sales in Redis not yet in the database when the load ended (the first reading after it).
    pub backlog_at_load_end: i64,
    /// From the load's end until the backlog read 0 (read every [`SETTLE_POLL`]).
    pub drain_secs: f64,
    /// Acknowledged sales over the load's time plus `drain_secs`.
    pub settled_per_sec: f64,
}

/// How often the check reads the backlog.
const SETTLE_POLL: Duration = Duration::from_millis(20);

/// Waits for the backlog to settle, then checks the invariants; returns the violations and how
/// settlement kept up. Call it as soon as the load ended.
pub async fn check(t: &Target, stats: &Stats) -> anyhow::Result<(Vec<String>, Settlement)> {
    let started = Instant::now();
    let deadline = started + SETTLE_WAIT;
    let mut at_end: Option<i64> = None;
    let rec = loop {
        let rec = get_json(t, "/v1/reconciliation").await?;
        let backlog =
            rec["redis"].as_array().and_then(|r| r.iter().find(|e| e["key"] == KEY)).map(|e| e["backlog"].clone());
        at_end = at_end.or(backlog.as_ref().and_then(Value::as_i64));
        if backlog == Some(json!(0)) || Instant::now() >= deadline {
            break rec;
        }
        tokio::time::sleep(SETTLE_POLL).await;
    };
    let drain = started.elapsed();
    let settlement = Settlement {
        backlog_at_load_end: at_end.unwrap_or(-1),
        drain_secs: drain.as_secs_f64(),
        settled_per_sec: stats.ok as f64 / (stats.elapsed + drain).as_secs_f64().max(1e-9),
    };
    let mut problems = Vec::new();
    let state = get_json(t, &format!("/v1/resources/{KEY}")).await?;
    let get = |f: &str| state[f].as_i64().unwrap_or(-1);
    let (a, r, c, total) = (get("available"), get("reserved"), get("consumed"), get("total"));
    if a < 0 || r < 0 || c < 0 || a + r + c != total {
        problems.push(format!("{KEY}: available {a} reserved {r} consumed {c} total {total}"));
    }
    if c != stats.consumed_expected {
        problems.push(format!("consumed {c} != acknowledged successes {}", stats.consumed_expected));
    }
    if let Some(drift) = rec["drift"].as_array().filter(|d| !d.is_empty()) {
        problems.push(format!("reconciliation drift: {}", Value::Array(drift.clone())));
    }
    for entry in rec["redis"].as_array().into_iter().flatten().filter(|e| e["drift"] != 0 || e["backlog"] != 0) {
        problems.push(format!("redis against the database: {entry}"));
    }
    if let Some(failures) = rec["settlement_failures"].as_array().filter(|f| !f.is_empty()) {
        problems.push(format!("{} settlement failures", failures.len()));
    }
    Ok((problems, settlement))
}

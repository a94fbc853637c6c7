//! The closed-loop HTTP scenarios: N tokio tasks share one client and send the next request as
//! soon as the previous one is answered, until the deadline or until a fixed number of orders
//! has been sent.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use futures::StreamExt;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use reqwest::{Client, StatusCode};
use serde_json::{json, Value};

use super::server::random_hex;
use super::Stats;

/// The named workloads run against stockd over HTTP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Workload {
    /// One key, qty 1.
    HotKey,
    /// The hot key's shape on a resource split over [`HOT_KEY_BUCKETS`] bucket rows.
    HotKeyBuckets,
    /// 10,000 keys, qty 1.
    Uniform,
    /// 5 lines over 1,000 keys.
    MultiLine,
    /// Half the requests replay an earlier idempotency key (1,000 keys).
    ReplayStorm,
    /// Reserve one line, then confirm or release it (1,000 keys).
    ReserveConfirm,
    /// The same on one key split over [`HOT_KEY_BUCKETS`] bucket rows: a flash sale that holds
    /// before it charges.
    ReserveConfirmBuckets,
    /// Deduct 2 of one line, then reverse 1 of that order (1,000 keys).
    DeductReverse,
    /// `GET /healthz`: the same server and clients without storage.
    Ceiling,
}

impl Workload {
    /// How many resources the workload spreads over.
    pub fn keys(self) -> usize {
        match self {
            Self::HotKey | Self::HotKeyBuckets | Self::ReserveConfirmBuckets => 1,
            Self::Uniform => 10_000,
            Self::MultiLine | Self::ReplayStorm | Self::ReserveConfirm | Self::DeductReverse => 1_000,
            Self::Ceiling => 0,
        }
    }

    /// The scenario's name, also its resource key prefix.
    pub fn name(self) -> &'static str {
        match self {
            Self::HotKey => "hot-key",
            Self::HotKeyBuckets => "hot-key-buckets",
            Self::Uniform => "uniform",
            Self::MultiLine => "multi-line",
            Self::ReplayStorm => "replay-storm",
            Self::ReserveConfirm => "reserve-confirm",
            Self::ReserveConfirmBuckets => "reserve-confirm-buckets",
            Self::DeductReverse => "deduct-reverse",
            Self::Ceiling => "ceiling",
        }
    }

    /// The `buckets` each resource is created with; `None`: the server's default (one row).
    pub fn buckets(self) -> Option<i64> {
        match self {
            Self::HotKeyBuckets | Self::ReserveConfirmBuckets => Some(HOT_KEY_BUCKETS),
            _ => None,
        }
    }
}

/// Bucket rows of `hot-key-buckets`' resource: the counters split so that concurrent orders of
/// one SKU lock different rows.
pub const HOT_KEY_BUCKETS: i64 = 16;

/// Opening total of each resource: large enough never to run out in a bench run.
pub const TOTAL: i64 = 1_000_000_000_000;

/// How long a scenario's load lasts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    /// Until this much time has passed.
    Time(Duration),
    /// Until exactly this many orders (loop iterations) have been sent, between all clients,
    /// however long that takes: a fixed amount of work, to count what it costs.
    Orders(u64),
}

/// When a running scenario's clients stop, shared by them.
#[derive(Debug, Clone)]
pub enum Stop {
    /// At this instant.
    At(Instant),
    /// When these orders, left to send, are taken.
    After(Arc<AtomicU64>),
}

impl Stop {
    /// Starts counting `limit` now.
    pub fn start(limit: Limit) -> Self {
        match limit {
            Limit::Time(d) => Self::At(Instant::now() + d),
            Limit::Orders(n) => Self::After(Arc::new(AtomicU64::new(n))),
        }
    }

    /// Whether a client may send its next order; takes it from the count.
    pub fn next(&self) -> bool {
        match self {
            Self::At(deadline) => Instant::now() < *deadline,
            Self::After(left) => left.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1)).is_ok(),
        }
    }
}

/// The HTTP side shared by all tasks.
pub struct Target {
    pub client: Client,
    pub base: String,
    pub api_key: String,
}

pub(super) fn key_of(w: Workload, i: usize) -> String {
    format!("{}:k{i}", w.name())
}

/// Creates a tenant with the admin token and returns its API key.
pub async fn create_tenant(client: &Client, base: &str, admin_token: &str) -> anyhow::Result<String> {
    let id = format!("bench-{}", random_hex(4));
    let resp = client
        .post(format!("{base}/v1/admin/tenants"))
        .bearer_auth(admin_token)
        .json(&json!({"id": id, "name": "stockd bench"}))
        .send()
        .await
        .context("creating the bench tenant")?;
    let status = resp.status();
    let body: Value = resp.json().await.context("tenant response")?;
    if status != StatusCode::CREATED {
        bail!("creating the tenant: {status} {body}");
    }
    body["api_key"].as_str().map(str::to_string).context("tenant response without api_key")
}

/// Creates the workload's resources (64 at a time).
pub async fn create_resources(t: &Target, w: Workload) -> anyhow::Result<()> {
    let results: Vec<anyhow::Result<()>> = futures::stream::iter(0..w.keys())
        .map(|i| async move { create_resource(t, &key_of(w, i), w.buckets()).await })
        .buffer_unordered(64)
        .collect()
        .await;
    results.into_iter().collect::<anyhow::Result<Vec<()>>>().map(|_| ())
}

/// Creates one inventory resource of [`TOTAL`] units over `buckets` bucket rows (`None`: the
/// server's default); an existing one is left as it is.
pub async fn create_resource(t: &Target, key: &str, buckets: Option<i64>) -> anyhow::Result<()> {
    let mut body = json!({"key": key, "kind": "inventory", "total": TOTAL});
    if let Some(n) = buckets {
        body["buckets"] = json!(n);
    }
    let resp = t.client.post(format!("{}/v1/resources", t.base)).bearer_auth(&t.api_key).json(&body).send().await?;
    let status = resp.status();
    if status != StatusCode::CREATED && status != StatusCode::CONFLICT {
        bail!("creating {key}: {status} {}", resp.text().await.unwrap_or_default());
    }
    Ok(())
}

/// What one answer says.
#[derive(Debug, Clone)]
pub(super) struct Answer {
    /// A 2xx answer.
    pub ok: bool,
    /// Marked `Idempotent-Replayed: true`.
    pub replayed: bool,
    /// The HTTP status; `None` when no answer came (timeout, transport error).
    pub status: Option<StatusCode>,
    /// Why it was refused: the problem's `code`, the first failing line's reason, `http_NNN`,
    /// `timeout` or `transport`; `None` for a success.
    pub reason: Option<String>,
}

/// Reads one answer: ok, or the rejection reason.
async fn classify(resp: Result<reqwest::Response, reqwest::Error>) -> Answer {
    let resp = match resp {
        Ok(r) => r,
        Err(err) => {
            let reason = if err.is_timeout() { "timeout" } else { "transport" };
            return Answer { ok: false, replayed: false, status: None, reason: Some(reason.into()) };
        }
    };
    let status = resp.status();
    let replayed = resp.headers().get("idempotent-replayed").is_some_and(|v| v.as_bytes() == b"true");
    if status.is_success() {
        // Drain the body so the connection is reused.
        let _ = resp.bytes().await;
        return Answer { ok: true, replayed, status: Some(status), reason: None };
    }
    let body: Value = resp.json().await.unwrap_or(Value::Null);
    let reason = body["code"].as_str().map(str::to_string).or_else(|| {
        body["lines"].as_array().and_then(|lines| {
            lines.iter().filter_map(|l| l["reason"].as_str()).find(|r| *r != "skipped").map(str::to_string)
        })
    });
    let reason = reason.unwrap_or_else(|| format!("http_{}", status.as_u16()));
    Answer { ok: false, replayed, status: Some(status), reason: Some(reason) }
}

pub(super) fn record(stats: &mut Stats, started: Instant, answer: &Answer) {
    stats.latencies_us.push(u32::try_from(started.elapsed().as_micros()).unwrap_or(u32::MAX));
    stats.requests += 1;
    if answer.ok {
        stats.ok += 1;
    }
    if answer.replayed {
        stats.replayed += 1;
    }
    if let Some(reason) = &answer.reason {
        *stats.rejections.entry(reason.clone()).or_insert(0) += 1;
    }
}

pub(super) async fn order(t: &Target, idem: &str, body: &Value) -> Answer {
    let resp = t
        .client
        .post(format!("{}/v1/orders", t.base))
        .bearer_auth(&t.api_key)
        .header("Idempotency-Key", idem)
        .json(body)
        .send()
        .await;
    classify(resp).await
}

pub(super) fn order_body(idem: &str, action: &str, keys: &[String]) -> Value {
    let lines: Vec<Value> = keys.iter().map(|k| json!({"key": k, "qty": 1})).collect();
    json!({"order_id": idem, "action": action, "lines": lines})
}

/// One client's closed loop until `stop`. In reserve-confirm and deduct-reverse an order's
/// confirm, release or reversal goes with it.
async fn client_loop(t: Arc<Target>, w: Workload, task: usize, stop: Stop) -> Stats {
    let mut stats = Stats::default();
    let mut rng = StdRng::seed_from_u64(task as u64 ^ 0x5eed);
    let run = random_hex(3);
    let mut last: Option<(String, Value)> = None;
    let mut i: u64 = 0;
    while stop.next() {
        i += 1;
        let idem = format!("{}-{run}-{task}-{i}", w.name());
        let started = Instant::now();
        match w {
            Workload::Ceiling => {
                let resp = t.client.get(format!("{}/healthz", t.base)).send().await;
                let outcome = classify(resp).await;
                record(&mut stats, started, &outcome);
            }
            Workload::HotKey | Workload::HotKeyBuckets | Workload::Uniform => {
                let key = key_of(w, rng.random_range(0..w.keys()));
                let outcome = order(&t, &idem, &order_body(&idem, "deduct", &[key])).await;
                if outcome.ok {
                    stats.consumed_expected += 1;
                }
                record(&mut stats, started, &outcome);
            }
            Workload::MultiLine => {
                let keys = pick_keys(&mut rng, w, 5);
                let outcome = order(&t, &idem, &order_body(&idem, "deduct", &keys)).await;
                if outcome.ok {
                    stats.consumed_expected += 5;
                }
                record(&mut stats, started, &outcome);
            }
            Workload::ReplayStorm => {
                let (idem, body) = match last.take() {
                    Some(prev) if rng.random_bool(0.5) => prev,
                    _ => {
                        let key = key_of(w, rng.random_range(0..w.keys()));
                        let body = order_body(&idem, "deduct", &[key]);
                        (idem, body)
                    }
                };
                let outcome = order(&t, &idem, &body).await;
                if outcome.ok && !outcome.replayed {
                    stats.consumed_expected += 1;
                }
                record(&mut stats, started, &outcome);
                last = Some((idem, body));
            }
            Workload::ReserveConfirm | Workload::ReserveConfirmBuckets => {
                let key = key_of(w, rng.random_range(0..w.keys()));
                let resp = t
                    .client
                    .post(format!("{}/v1/orders", t.base))
                    .bearer_auth(&t.api_key)
                    .header("Idempotency-Key", &idem)
                    .json(&order_body(&idem, "reserve", &[key]))
                    .send()
                    .await;
                let reservation = match resp {
                    Ok(r) if r.status() == StatusCode::CREATED => {
                        let doc: Value = r.json().await.unwrap_or(Value::Null);
                        doc["reservation_id"].as_str().map(str::to_string)
                    }
                    other => {
                        let outcome = classify(other).await;
                        record(&mut stats, started, &outcome);
                        continue;
                    }
                };
                let answer = Answer {
                    ok: reservation.is_some(),
                    replayed: false,
                    status: Some(StatusCode::CREATED),
                    reason: None,
                };
                record(&mut stats, started, &answer);
                let Some(id) = reservation else { continue };
                let confirm = rng.random_bool(0.5);
                let action = if confirm { "confirm" } else { "release" };
                let started = Instant::now();
                let resp = t
                    .client
                    .post(format!("{}/v1/reservations/{id}/{action}", t.base))
                    .bearer_auth(&t.api_key)
                    .send()
                    .await;
                let outcome = classify(resp).await;
                if outcome.ok && confirm {
                    stats.consumed_expected += 1;
                }
                record(&mut stats, started, &outcome);
            }
            Workload::DeductReverse => {
                let key = key_of(w, rng.random_range(0..w.keys()));
                let mut body = order_body(&idem, "deduct", std::slice::from_ref(&key));
                body["lines"][0]["qty"] = json!(2);
                let outcome = order(&t, &idem, &body).await;
                record(&mut stats, started, &outcome);
                if !outcome.ok {
                    continue;
                }
                stats.consumed_expected += 2;
                let started = Instant::now();
                let outcome = reverse(&t, &format!("{idem}-r"), &idem, &key, 1).await;
                if outcome.ok {
                    stats.consumed_expected -= 1;
                }
                record(&mut stats, started, &outcome);
            }
        }
    }
    stats
}

/// `POST /v1/orders/{order_id}/reversals` of `qty` of the order's one line `key`.
async fn reverse(t: &Target, idem: &str, order_id: &str, key: &str, qty: i64) -> Answer {
    let resp = t
        .client
        .post(format!("{}/v1/orders/{order_id}/reversals", t.base))
        .bearer_auth(&t.api_key)
        .header("Idempotency-Key", idem)
        .json(&json!({"lines": [{"key": key, "qty": qty}], "reason": "bench"}))
        .send()
        .await;
    classify(resp).await
}

/// Runs the workload with `clients` tasks until `limit` and merges their stats.
pub async fn run(t: &Arc<Target>, w: Workload, clients: usize, limit: Limit) -> anyhow::Result<Stats> {
    let started = Instant::now();
    let stop = Stop::start(limit);
    let handles: Vec<_> =
        (0..clients).map(|task| tokio::spawn(client_loop(t.clone(), w, task, stop.clone()))).collect();
    Stats::joined(handles, started).await
}

/// `clients` closed loops of orders until `limit`, each order the body `body(idem)` makes for its
/// idempotency key (`{prefix}-{run}-{task}-{i}`, `run` random per call); a success counts as one
/// unit consumed.
pub async fn run_one_piece_orders(
    t: &Arc<Target>,
    clients: usize,
    limit: Limit,
    prefix: &'static str,
    body: fn(&str) -> Value,
) -> anyhow::Result<Stats> {
    let started = Instant::now();
    let stop = Stop::start(limit);
    let run = random_hex(3);
    let handles: Vec<_> = (0..clients)
        .map(|task| {
            let (t, stop, run) = (Arc::clone(t), stop.clone(), run.clone());
            tokio::spawn(async move {
                let mut stats = Stats::default();
                let mut i: u64 = 0;
                while stop.next() {
                    i += 1;
                    let idem = format!("{prefix}-{run}-{task}-{i}");
                    let sent = Instant::now();
                    let answer = order(&t, &idem, &body(&idem)).await;
                    record(&mut stats, sent, &answer);
                    if answer.ok {
                        stats.consumed_expected += 1;
                    }
                }
                stats
            })
        })
        .collect();
    Stats::joined(handles, started).await
}

/// Checks the workload's resources and the tenant's reconciliation over HTTP; returns the
/// violations found (empty: all invariants hold).
pub async fn check(t: &Target, w: Workload, stats: &Stats) -> anyhow::Result<Vec<String>> {
    if w == Workload::Ceiling {
        return Ok(Vec::new());
    }
    let (mut problems, reserved) = check_keys(t, &format!("{}:", w.name()), w.keys(), stats.consumed_expected).await?;
    if matches!(w, Workload::ReserveConfirm | Workload::ReserveConfirmBuckets) && reserved != 0 {
        problems.push(format!("{reserved} still reserved after every reservation was confirmed or released"));
    }
    if let Some(expected) = w.buckets() {
        for i in 0..w.keys() {
            let key = key_of(w, i);
            let state = get_json(t, &format!("/v1/resources/{key}")).await?;
            if state["buckets"].as_i64() != Some(expected) {
                problems.push(format!("{key}: buckets {} != {expected}", state["buckets"]));
            }
        }
    }
    Ok(problems)
}

/// Checks that the tenant has exactly `keys` resources under `prefix`, none negative and each
/// summing to its total, that together they consumed `consumed_expected` units, and that
/// reconciliation finds no drift. Returns the violations and the units still reserved.
pub async fn check_keys(
    t: &Target,
    prefix: &str,
    keys: usize,
    consumed_expected: i64,
) -> anyhow::Result<(Vec<String>, i64)> {
    let mut tally = Tally::default();
    let mut after: Option<String> = None;
    loop {
        let mut req = t
            .client
            .get(format!("{}/v1/resources", t.base))
            .bearer_auth(&t.api_key)
            .query(&[("prefix", prefix), ("limit", "1000")]);
        if let Some(a) = &after {
            req = req.query(&[("after", a)]);
        }
        let page: Value = req.send().await?.error_for_status()?.json().await.context("resource page")?;
        for item in page["items"].as_array().map(Vec::as_slice).unwrap_or_default() {
            let get = |f: &str| item[f].as_i64().unwrap_or(-1);
            tally.add(&item["key"], get("available"), get("reserved"), get("consumed"), get("total"));
        }
        match page["next_after"].as_str() {
            Some(next) => after = Some(next.to_string()),
            None => break,
        }
    }
    let reserved = tally.reserved;
    let mut problems = tally.finish(keys, consumed_expected);
    let rec = get_json(t, "/v1/reconciliation").await?;
    if let Some(drift) = rec["drift"].as_array().filter(|d| !d.is_empty()) {
        problems.push(format!("reconciliation drift: {}", Value::Array(drift.clone())));
    }
    Ok((problems, reserved))
}

/// The counters of a workload's resources, added up resource by resource: none negative, each
/// summing to its total, and together having consumed what the acknowledged orders took.
#[derive(Debug, Default)]
pub(super) struct Tally {
    problems: Vec<String>,
    seen: usize,
    consumed: i64,
    /// Units still reserved, over every resource seen.
    pub(super) reserved: i64,
}

impl Tally {
    /// One resource's counters.
    pub(super) fn add(&mut self, key: impl std::fmt::Display, a: i64, r: i64, c: i64, total: i64) {
        self.seen += 1;
        if a < 0 || r < 0 || c < 0 || a + r + c != total {
            self.problems.push(format!("{key}: available {a} reserved {r} consumed {c} total {total}"));
        }
        self.consumed += c;
        self.reserved += r;
    }

    /// The violations, with `keys` resources expected and `consumed_expected` units consumed.
    pub(super) fn finish(mut self, keys: usize, consumed_expected: i64) -> Vec<String> {
        if self.seen != keys {
            self.problems.push(format!("{} resources found, {keys} expected", self.seen));
        }
        if self.consumed != consumed_expected {
            self.problems.push(format!("consumed {} != acknowledged successes {consumed_expected}", self.consumed));
        }
        self.problems
    }
}

/// `n` distinct keys of the workload, picked at random.
pub(super) fn pick_keys(rng: &mut StdRng, w: Workload, n: usize) -> Vec<String> {
    let mut picked: Vec<usize> = Vec::with_capacity(n);
    while picked.len() < n {
        let k = rng.random_range(0..w.keys());
        if !picked.contains(&k) {
            picked.push(k);
        }
    }
    picked.into_iter().map(|k| key_of(w, k)).collect()
}

/// GETs a path of the tenant's API as JSON.
pub(super) async fn get_json(t: &Target, path: &str) -> anyhow::Result<Value> {
    let resp = t.client.get(format!("{}{path}", t.base)).bearer_auth(&t.api_key).send().await?;
    resp.error_for_status()?.json().await.with_context(|| format!("GET {path}"))
}

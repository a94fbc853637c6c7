//! The database stops under the servers' feet and starts again. The contract: requests in the
//! gap get `503 unavailable` with `Retry-After`, none is half-applied, and the processes recover
//! on their own, without a restart, once the database is back.

use std::collections::HashSet;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::join_all;
use futures::stream::{self, StreamExt};
use serde_json::{json, Value};
use tokio::time::Instant;

use crate::harness::{order_ids_with_op, random_hex_32, send, try_send, Api, Reply, Stockd};
use crate::throwaway::ThrowawayDb;

/// Short pool and retry settings, so requests in the gap are answered quickly.
const CONFIG: &str = "[database]\nacquire_timeout_ms = 1000\nmax_retries = 2";
/// The two resources every load order deducts one unit from (two lines: a half-applied order
/// would show up as an order in one ledger and not the other).
const SKUS: [&str; 2] = ["sku-a", "sku-b"];
/// Far more than the load can consume, so no order is ever rejected for stock.
const STOCK: i64 = 10_000_000;
const LOAD_CLIENTS: usize = 8;
/// Bounds on the load loops (they normally stop much earlier, when told to).
const MAX_ORDERS_PER_CLIENT: usize = 20_000;
const MAX_ATTEMPTS_PER_KEY: usize = 200;
/// The load runs at least this long, with at least this many acknowledged orders, before the
/// database is stopped.
const LOAD_BEFORE_FAULT: Duration = Duration::from_secs(1);
const ACKS_BEFORE_FAULT: usize = 100;
/// How long the load keeps running against the stopped database.
const OUTAGE: Duration = Duration::from_secs(2);
/// How long the load keeps running after both processes have recovered.
const LOAD_AFTER_RECOVERY: Duration = Duration::from_millis(500);
/// Generous bounds: reaching a phase of the load, and recovering once the database is back.
const PHASE_DEADLINE: Duration = Duration::from_secs(60);
const RECOVERY_DEADLINE: Duration = Duration::from_secs(30);
/// A request while the database is down must be answered within the acquire timeout (1 s)
/// plus the batch retries plus plenty of slack: a 503, not a hang.
const UNAVAILABLE_DEADLINE: Duration = Duration::from_secs(15);
/// A careful client waits `Retry-After`, but the test caps it to keep the load dense.
const RETRY_WAIT_MIN: Duration = Duration::from_millis(50);
const RETRY_WAIT_MAX: Duration = Duration::from_secs(1);
const POLL_INTERVAL: Duration = Duration::from_millis(100);
/// How much of each process's output goes into a failure message.
const LOG_TAIL_BYTES: usize = 16 * 1024;

/// A throwaway database, `stockd` processes on it, and one tenant as seen through each process.
struct Setup {
    /// Declared first: the processes are killed before the database is stopped.
    procs: Vec<Stockd>,
    shops: Vec<Api>,
    db: ThrowawayDb,
}

async fn setup(processes: usize) -> Setup {
    let db = ThrowawayDb::start_new().await;
    let admin_token = random_hex_32();
    let mut procs = Vec::new();
    for _ in 0..processes {
        procs.push(Stockd::start(&db.url(), &admin_token, CONFIG).await);
    }
    let api_key = procs[0].client(&admin_token).create_tenant("shop").await;
    let shops = procs.iter().map(|p| p.client(&api_key)).collect();
    Setup { procs, shops, db }
}

impl Setup {
    /// The servers' and the database's output, for failure messages.
    fn diagnostics(&self) -> String {
        let mut out = String::new();
        for (i, proc) in self.procs.iter().enumerate() {
            out.push_str(&format!("--- stockd process {i} ({}) ---\n{}\n", proc.addr, tail(&proc.logs())));
        }
        out.push_str(&format!("--- {} log ---\n{}", self.db.name(), tail(&self.db.server_log())));
        out
    }

    /// Asserts no process exited: recovering must not need a restart.
    fn assert_processes_running(&mut self) {
        let diagnostics = self.diagnostics();
        for (i, proc) in self.procs.iter_mut().enumerate() {
            assert!(proc.is_running(), "stockd process {i} exited\n{diagnostics}");
        }
    }

    /// Polls `GET /readyz` on every process until it answers `status`; returns the answers.
    async fn await_readyz(&self, status: u16, deadline: Duration) -> Vec<Reply> {
        let until = Instant::now() + deadline;
        let mut answers = Vec::new();
        for (i, shop) in self.shops.iter().enumerate() {
            loop {
                let last = match shop.readyz().await {
                    Ok(reply) if reply.status() == status => {
                        answers.push(reply);
                        break;
                    }
                    Ok(reply) => format!("{} {}", reply.status, reply.text),
                    Err(e) => format!("transport error: {e}"),
                };
                assert!(
                    Instant::now() < until,
                    "/readyz of process {i} did not answer {status} within {deadline:?}; last: {last}\n{}",
                    self.diagnostics()
                );
                tokio::time::sleep(POLL_INTERVAL).await;
            }
        }
        answers
    }
}

fn tail(text: &str) -> &str {
    let mut start = text.len().saturating_sub(LOG_TAIL_BYTES);
    while !text.is_char_boundary(start) {
        start += 1;
    }
    &text[start..]
}

/// A deduct of one unit from each of `SKUS`; the order id is the idempotency key.
fn two_line_order(key: &str) -> Value {
    json!({"order_id": key, "action": "deduct", "lines": SKUS.map(|sku| json!({"key": sku, "qty": 1}))})
}

/// What happened to one idempotency key.
#[derive(Debug)]
struct KeyOutcome {
    key: String,
    process: usize,
    /// Every status received for it, in order (0: transport error), with how long it took.
    attempts: Vec<u16>,
    latencies: Vec<Duration>,
    /// The body of its 201, if it got one.
    acked: Option<Value>,
}

/// What the load clients saw, shared between them.
#[derive(Default)]
struct Load {
    outcomes: Mutex<Vec<KeyOutcome>>,
    /// Answers the contract does not allow here (any other status, a malformed 503).
    violations: Mutex<Vec<String>>,
    /// The processes are never restarted, so a transport error means one misbehaved.
    transport_errors: Mutex<Vec<String>>,
    /// Well-formed `503 unavailable` answers.
    unavailable: AtomicUsize,
    /// 201s per process.
    acks: [AtomicUsize; 2],
    stop: AtomicBool,
}

impl Load {
    fn acks(&self) -> usize {
        self.acks.iter().map(|a| a.load(Ordering::SeqCst)).sum()
    }

    fn record(&self, list: &Mutex<Vec<String>>, line: String) {
        list.lock().expect("no panics while locked").push(line);
    }
}

/// A careful client's order: the same key is retried after a `503` (waiting `Retry-After`), a
/// `409 idempotency_in_progress` or a transport error, until it gets a 201 or the load stops
/// (the key is then left to the final checks). Every answer is recorded.
async fn order_until_answered(load: &Load, shop: &Api, process: usize, key: &str) -> KeyOutcome {
    let body = two_line_order(key);
    let mut outcome =
        KeyOutcome { key: key.to_owned(), process, attempts: Vec::new(), latencies: Vec::new(), acked: None };
    for _ in 0..MAX_ATTEMPTS_PER_KEY {
        if !outcome.attempts.is_empty() && load.stop.load(Ordering::SeqCst) {
            break;
        }
        let sent = Instant::now();
        let reply = try_send(shop.order(key, &body)).await;
        outcome.latencies.push(sent.elapsed());
        let reply = match reply {
            Ok(reply) => reply,
            Err(e) => {
                outcome.attempts.push(0);
                load.record(&load.transport_errors, format!("{key} on process {process}: {e:?}"));
                tokio::time::sleep(POLL_INTERVAL).await;
                continue;
            }
        };
        outcome.attempts.push(reply.status());
        match reply.status() {
            201 => {
                load.acks[process].fetch_add(1, Ordering::SeqCst);
                outcome.acked = Some(reply.json());
                break;
            }
            503 => {
                match reply.unavailable_violation() {
                    None => load.unavailable.fetch_add(1, Ordering::SeqCst),
                    Some(why) => {
                        load.record(&load.violations, format!("{key} on process {process}: {why}"));
                        0
                    }
                };
                let wait = Duration::from_secs(reply.retry_after_seconds().unwrap_or(1));
                tokio::time::sleep(wait.clamp(RETRY_WAIT_MIN, RETRY_WAIT_MAX)).await;
            }
            409 if reply.problem_code().as_deref() == Some("idempotency_in_progress") => {
                tokio::time::sleep(POLL_INTERVAL).await;
            }
            _ => {
                let line = format!("{key} on process {process}: {} {:?} {}", reply.status, reply.headers, reply.text);
                load.record(&load.violations, line);
                break;
            }
        }
    }
    outcome
}

/// One load client: new keys one after another, each until answered, until the load stops.
async fn load_client(load: Arc<Load>, shop: Api, process: usize, client: usize) {
    for n in 0..MAX_ORDERS_PER_CLIENT {
        if load.stop.load(Ordering::SeqCst) {
            return;
        }
        let outcome = order_until_answered(&load, &shop, process, &format!("c{client}-n{n}")).await;
        load.outcomes.lock().expect("no panics while locked").push(outcome);
    }
}

/// Polls `check` until it holds; fails with `what` and the diagnostics after `deadline`.
async fn wait_until<F, Fut>(setup: &Setup, deadline: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let until = Instant::now() + deadline;
    while !check().await {
        assert!(Instant::now() < until, "{what}: not within {deadline:?}\n{}", setup.diagnostics());
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

/// Proves: with two processes under load from 8 careful clients, stopping the database makes
/// requests answer `503 unavailable` (problem+json, `Retry-After`) and `/readyz` answer 503,
/// never any other 5xx or a dropped connection; once the database is started again both
/// processes, never restarted, answer 201 and are ready again; and afterwards every
/// acknowledged order is in both resources' ledgers exactly once (none half-applied), replays
/// its 201, keys that were never acknowledged are either absent or present once, and
/// reconciliation finds no drift.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_stopped_under_load_answers_503_and_recovers_without_restart() {
    let mut setup = setup(2).await;
    for sku in SKUS {
        setup.shops[0].create_resource(sku, STOCK).await;
    }

    let load = Arc::new(Load::default());
    let clients: Vec<_> = (0..LOAD_CLIENTS)
        .map(|c| {
            let process = c % setup.shops.len();
            tokio::spawn(load_client(load.clone(), setup.shops[process].clone(), process, c))
        })
        .collect();

    // The load runs against a healthy database first.
    let started = Instant::now();
    wait_until(&setup, PHASE_DEADLINE, "orders acknowledged before the fault", || async {
        load.acks() >= ACKS_BEFORE_FAULT && started.elapsed() >= LOAD_BEFORE_FAULT
    })
    .await;
    let acks_before_stop = load.acks();

    // The database goes away; the load goes on.
    setup.db.stop().await;
    let stopped = Instant::now();
    for (i, reply) in setup.await_readyz(503, UNAVAILABLE_DEADLINE).await.iter().enumerate() {
        assert_eq!(reply.unavailable_violation(), None, "/readyz of process {i} while the database is down");
    }
    wait_until(&setup, PHASE_DEADLINE, "a 503 unavailable answered to the load", || async {
        load.unavailable.load(Ordering::SeqCst) >= 1 && stopped.elapsed() >= OUTAGE
    })
    .await;
    let unavailable_in_gap = load.unavailable.load(Ordering::SeqCst);

    // The database comes back: each process answers a new order with 201, on its own.
    setup.db.start().await;
    for (process, shop) in setup.shops.iter().enumerate() {
        let probe = tokio::time::timeout(
            RECOVERY_DEADLINE,
            order_until_answered(&load, shop, process, &format!("probe-p{process}")),
        )
        .await
        .unwrap_or_else(|_| {
            panic!(
                "process {process} did not answer 201 within {RECOVERY_DEADLINE:?} of the database being back\n{}",
                setup.diagnostics()
            )
        });
        assert!(probe.acked.is_some(), "process {process} recovers: {probe:?}\n{}", setup.diagnostics());
        load.outcomes.lock().expect("no panics while locked").push(probe);
    }
    setup.await_readyz(200, RECOVERY_DEADLINE).await;
    setup.assert_processes_running();

    tokio::time::sleep(LOAD_AFTER_RECOVERY).await;
    load.stop.store(true, Ordering::SeqCst);
    tokio::time::timeout(PHASE_DEADLINE, join_all(clients))
        .await
        .unwrap_or_else(|_| panic!("load clients did not stop within {PHASE_DEADLINE:?}\n{}", setup.diagnostics()))
        .into_iter()
        .for_each(|r| r.expect("load client does not panic"));
    setup.assert_processes_running();

    let violations = std::mem::take(&mut *load.violations.lock().expect("no panics while locked"));
    assert!(violations.is_empty(), "answers the contract does not allow: {violations:#?}\n{}", setup.diagnostics());
    let transport = std::mem::take(&mut *load.transport_errors.lock().expect("no panics while locked"));
    assert!(transport.is_empty(), "transport errors from live processes: {transport:#?}\n{}", setup.diagnostics());
    assert!(unavailable_in_gap >= 1, "the load saw a 503 unavailable while the database was down");

    let outcomes = std::mem::take(&mut *load.outcomes.lock().expect("no panics while locked"));
    let retried = outcomes.iter().filter(|o| o.attempts.len() > 1).count();
    let slowest = outcomes.iter().flat_map(|o| o.latencies.iter()).max().copied().unwrap_or_default();
    println!(
        "load: {} keys, {} acknowledged ({acks_before_stop} before the stop), {} well-formed 503s, {retried} keys \
         retried, slowest answer {slowest:?}",
        outcomes.len(),
        load.acks(),
        load.unavailable.load(Ordering::SeqCst),
    );
    for o in outcomes.iter().filter(|o| o.attempts != [201]).take(20) {
        println!("  {} p{}: {:?} {:?} acked={}", o.key, o.process, o.attempts, o.latencies, o.acked.is_some());
    }
    assert_exactly_once(&setup, &outcomes).await;
}

/// Every acknowledged order is in each resource's ledger exactly once and replays its 201;
/// unacknowledged keys are absent or present once, and resending them now applies them at most
/// once; no order is in one resource's ledger but not the other's; no drift.
async fn assert_exactly_once(setup: &Setup, outcomes: &[KeyOutcome]) {
    let shops = &setup.shops;
    let sent: HashSet<&str> = outcomes.iter().map(|o| o.key.as_str()).collect();
    assert_eq!(sent.len(), outcomes.len(), "each key is recorded once");
    let in_ledger = ledger_orders(shops).await;
    for id in &in_ledger {
        assert!(sent.contains(id.as_str()), "the ledger holds an order nobody sent: {id}");
    }
    for outcome in outcomes.iter().filter(|o| o.acked.is_some()) {
        assert!(in_ledger.contains(&outcome.key), "acknowledged order missing from the ledger: {outcome:?}");
    }

    // Every acknowledged key replays its first 201, through either process.
    let replays = stream::iter(outcomes.iter().filter(|o| o.acked.is_some()).enumerate())
        .map(|(i, outcome)| async move {
            let shop = &shops[i % shops.len()];
            let reply = send(shop.order(&outcome.key, &two_line_order(&outcome.key))).await;
            (outcome, reply)
        })
        .buffer_unordered(LOAD_CLIENTS);
    let replays: Vec<(&KeyOutcome, Reply)> = replays.collect().await;
    for (outcome, reply) in &replays {
        assert_eq!(reply.status(), 201, "acknowledged {} replays 201: {}", outcome.key, reply.text);
        assert!(reply.replayed(), "acknowledged {} is answered as a replay: {:?}", outcome.key, reply.headers);
        assert_eq!(Some(&reply.json()), outcome.acked.as_ref(), "acknowledged {} replays the same body", outcome.key);
    }

    // Keys never acknowledged: applied once (then they replay) or not at all (then the key is
    // free and applies now), never stuck in progress.
    let mut applied_now = 0;
    for outcome in outcomes.iter().filter(|o| o.acked.is_none()) {
        let reply = send(shops[outcome.process].order(&outcome.key, &two_line_order(&outcome.key))).await;
        assert_eq!(reply.status(), 201, "unacknowledged {outcome:?} answers 201 now: {}", reply.text);
        let was_applied = in_ledger.contains(&outcome.key);
        assert_eq!(reply.replayed(), was_applied, "unacknowledged {outcome:?} replays iff it is in the ledger");
        applied_now += usize::from(!was_applied);
    }

    let after = ledger_orders(shops).await;
    assert_eq!(after.len(), in_ledger.len() + applied_now, "resending unacknowledged keys applied each at most once");
    assert_eq!(after, sent.iter().map(|k| k.to_string()).collect::<HashSet<_>>(), "every key sent is applied once");
    shops[1 % shops.len()].assert_reconciliation_clean(SKUS.len() as u64).await;
    assert_one_event_per_order(&shops[0], &after).await;
}

/// The outbox through the faults: exactly one `order.applied` per applied order (none for a
/// batch that rolled back, none lost for one that committed), numbered 1, 2, 3, ... in the feed.
async fn assert_one_event_per_order(shop: &Api, applied: &HashSet<String>) {
    let (mut seqs, mut orders, mut after) = (Vec::new(), Vec::new(), 0);
    loop {
        let page = shop.get(&format!("/v1/events?after={after}&limit=1000")).await.expect_json(200);
        let items = page["items"].as_array().cloned().unwrap_or_default();
        if items.is_empty() {
            break;
        }
        after = page["next_after"].as_i64().unwrap_or_else(|| panic!("next_after is a number: {page}"));
        for e in items {
            seqs.push(e["seq"].as_i64().unwrap_or(-1));
            if e["type"] == "order.applied" {
                orders.push(e["data"]["order_id"].as_str().unwrap_or_default().to_owned());
            }
        }
    }
    assert_eq!(seqs, (1..=seqs.len() as i64).collect::<Vec<_>>(), "the feed is numbered without gaps");
    let distinct: HashSet<String> = orders.iter().cloned().collect();
    assert_eq!(distinct.len(), orders.len(), "no order.applied twice");
    assert_eq!(&distinct, applied, "one order.applied per applied order");
}

/// The order ids deducted from `SKUS`, asserting each ledger replays to its state, no order is
/// in a ledger twice, `consumed` equals the number of deduct entries, and both resources hold
/// the same orders (an order in one and not the other would be half-applied).
async fn ledger_orders(shops: &[Api]) -> HashSet<String> {
    let mut per_sku = Vec::new();
    for (i, sku) in SKUS.iter().enumerate() {
        let shop = &shops[i % shops.len()];
        let entries = shop.assert_ledger_replays_to_state(sku).await;
        let deducts = order_ids_with_op(&entries, "deduct");
        let distinct: HashSet<String> = deducts.iter().cloned().collect();
        assert_eq!(distinct.len(), deducts.len(), "{sku}: no order is deducted twice");
        let consumed = shop.state(sku).await["consumed"].as_u64();
        assert_eq!(consumed, Some(deducts.len() as u64), "{sku}: consumed == number of deduct entries");
        assert_eq!(entries.len(), deducts.len() + 1, "{sku}: only its create entry and deducts");
        per_sku.push(distinct);
    }
    let (first, second) = (&per_sku[0], &per_sku[1]);
    let half: Vec<&String> = first.symmetric_difference(second).collect();
    assert!(half.is_empty(), "orders applied to one of {SKUS:?} but not the other (half-applied): {half:?}");
    per_sku.swap_remove(0)
}

/// Proves: with the database already down, an order, an adjustment and a reservation confirm
/// each answer `503 unavailable` with `Retry-After` promptly (no hang), twice in a row (no key
/// left stuck in progress), while `/healthz` stays 200 and `/readyz` is 503; after the database
/// is back, the same requests apply exactly once as fresh requests (nothing was stored in the
/// gap), then replay, and the ledger holds each exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_down_at_request_time_applies_nothing() {
    let mut setup = setup(1).await;
    let shop = setup.shops[0].clone();
    shop.create_resource("sku-1", 100).await;
    let reserve = json!({"order_id": "rsv-1", "action": "reserve", "ttl_seconds": 3600,
                         "lines": [{"key": "sku-1", "qty": 4}]});
    let held = send(shop.order("rsv-1", &reserve)).await.expect_json(201);
    let reservation = held["reservation_id"].as_str().expect("a reserve order has a reservation id").to_owned();
    let deduct = json!({"order_id": "ord-1", "action": "deduct", "lines": [{"key": "sku-1", "qty": 3}]});
    let requests = || {
        [
            ("order", shop.order("ord-1", &deduct)),
            ("adjustment", shop.adjust("sku-1", "adj-1", 50)),
            ("confirm", shop.confirm(&reservation)),
        ]
    };

    setup.db.stop().await;
    setup.await_readyz(503, UNAVAILABLE_DEADLINE).await;
    assert_eq!(send(shop.request(reqwest::Method::GET, "/healthz")).await.status(), 200, "the process stays alive");
    for round in 1..=2 {
        for (what, request) in requests() {
            let sent = Instant::now();
            let reply = tokio::time::timeout(UNAVAILABLE_DEADLINE, try_send(request))
                .await
                .unwrap_or_else(|_| {
                    panic!(
                        "{what} (round {round}) got no answer within {UNAVAILABLE_DEADLINE:?}\n{}",
                        setup.diagnostics()
                    )
                })
                .unwrap_or_else(|e| panic!("{what} (round {round}): transport error {e:?}\n{}", setup.diagnostics()));
            assert_eq!(
                reply.unavailable_violation(),
                None,
                "{what} (round {round}) while the database is down, answered after {:?}\n{}",
                sent.elapsed(),
                setup.diagnostics()
            );
        }
    }

    setup.db.start().await;
    setup.await_readyz(200, RECOVERY_DEADLINE).await;
    setup.assert_processes_running();

    // Nothing was stored in the gap: the same keys apply now, as first answers.
    let [order, adjustment, confirm] = requests().map(|(_, request)| request);
    let order = send(order).await;
    let order_body = order.expect_json(201);
    assert!(!order.replayed(), "the order was not stored during the outage: {:?}", order.headers);
    assert_eq!(order_body["status"], "succeeded", "{order_body}");
    let adjustment = send(adjustment).await;
    adjustment.expect_json(200);
    assert!(!adjustment.replayed(), "the adjustment was not stored during the outage: {:?}", adjustment.headers);
    assert_eq!(send(confirm).await.expect_json(200)["state"], "confirmed");
    let expected = json!({"available": 143, "reserved": 0, "consumed": 7, "total": 150});
    let counts = |state: &Value| {
        json!({"available": state["available"], "reserved": state["reserved"],
                                        "consumed": state["consumed"], "total": state["total"]})
    };
    assert_eq!(counts(&shop.state("sku-1").await), expected);

    // And once more: replays (or the same confirmed state), nothing applied twice.
    let [order, adjustment, confirm] = requests().map(|(_, request)| request);
    let order = send(order).await;
    assert_eq!(order.expect_json(201), order_body);
    assert!(order.replayed(), "the order replays: {:?}", order.headers);
    let adjustment = send(adjustment).await;
    adjustment.expect_json(200);
    assert!(adjustment.replayed(), "the adjustment replays: {:?}", adjustment.headers);
    assert_eq!(send(confirm).await.expect_json(200)["state"], "confirmed");
    assert_eq!(counts(&shop.state("sku-1").await), expected);

    let entries = shop.assert_ledger_replays_to_state("sku-1").await;
    let ops: Vec<&str> = entries.iter().map(|e| e["op"].as_str().unwrap_or_default()).collect();
    assert_eq!(ops, ["create", "reserve", "deduct", "adjust", "confirm"], "each request applied exactly once");
    shop.assert_reconciliation_clean(1).await;
}

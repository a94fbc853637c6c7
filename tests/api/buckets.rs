//! Bucketed resources: a resource split into N bucket rows (`"buckets": N` at creation) keeps
//! exact totals, is never refused while its total available covers a line (whatever the
//! per-bucket split), records every change per bucket in the ledger, gives held stock back to
//! the buckets it came from, spreads restocks evenly, is evened out by the background
//! rebalancer, honours (and bounds) a plugin's bucket order, and stays consistent under races.
//!
//! Per-bucket expectations are checked from the outside: `bucket_counts` in the state document
//! against a bucket-by-bucket replay of the ledger (whose `*_after` values are the bucket's own
//! counters for a bucketed resource). One test steps behind the server's back on purpose: it
//! edits a bucket row in the database to prove reconciliation judges every bucket.
//!
//! The rebalancer moves available stock between buckets on its own. Tests asserting exact
//! per-bucket numbers therefore run with it effectively off (`quiet()`: one run an hour, and a
//! fresh server has nothing to rebalance at start-up); the rebalancer test and the races run
//! it fast on purpose.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use serde_json::{json, Value};
use tokio::sync::Barrier;

use crate::helpers::{
    assert_counts, assert_problem, deduct, entries_with_op, metric, plugin_wasm, reserve, spawn_app_with, tamper,
    try_send, unique, AppOptions, Counts, Reply, TenantClient,
};

/// A rebalance interval no test outlives: per-bucket numbers only change by the test's requests.
const QUIET_REBALANCE_MS: &str = "3600000";
/// Sweeping every 200 ms keeps reservation expiry quick in tests.
const FAST_SWEEP: &str = "[reservations]\nsweep_interval_ms = 200";
/// Bound for waiting on background jobs (expiry sweeper, rebalancer).
const BACKGROUND_DEADLINE: Duration = Duration::from_secs(20);
/// Attempts at reading state and ledger at one moment while a background job may write.
const STABLE_READ_ATTEMPTS: usize = 20;

/// (available, reserved, consumed) of one bucket.
type Triple = (i64, i64, i64);

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// A server whose rebalancer never runs during the test (config and env both say so).
fn quiet() -> AppOptions {
    AppOptions::default().toml(&format!("[buckets]\nrebalance_interval_ms = {QUIET_REBALANCE_MS}"))
}

#[track_caller]
fn int(value: &Value, field: &str) -> i64 {
    value[field].as_i64().unwrap_or_else(|| panic!("{field} is an integer: {value}"))
}

/// The even split of `total` over `n` buckets: bucket i gets `total / n`, plus one for
/// `i < total % n`.
fn shares(total: i64, n: i64) -> Vec<i64> {
    (0..n).map(|i| total / n + i64::from(i < total % n)).collect()
}

/// `(share, 0, 0)` per bucket: a freshly created resource's bucket counts.
fn fresh(total: i64, n: i64) -> Vec<Triple> {
    shares(total, n).into_iter().map(|s| (s, 0, 0)).collect()
}

fn availables(counts: &[Triple]) -> Vec<i64> {
    counts.iter().map(|c| c.0).collect()
}

/// FNV-1a, as the plugin SDK's `stable_hash`: predicts the flash sale's first bucket for a user.
fn fnv1a(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// `POST /v1/resources` with `buckets`; asserts the 201 and returns the state.
async fn create_bucketed(shop: &TenantClient, key: &str, total: i64, buckets: i64) -> Value {
    let body = json!({"key": key, "kind": "inventory", "total": total, "buckets": buckets});
    shop.post("/v1/resources", &body).await.expect_json(201)
}

/// The `bucket_counts` of a bucketed state, asserting their shape: exactly `buckets` items,
/// ordered by bucket 0..N, none negative, summing to the state's totals.
#[track_caller]
fn bucket_counts(state: &Value) -> Vec<Triple> {
    let n = int(state, "buckets");
    assert!(n > 1, "bucket_counts only exist for buckets > 1: {state}");
    let items =
        state["bucket_counts"].as_array().unwrap_or_else(|| panic!("a bucketed state has bucket_counts: {state}"));
    assert_eq!(items.len() as i64, n, "one bucket_counts item per bucket: {state}");
    let mut counts = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        assert_eq!(item["bucket"], json!(i), "bucket_counts are ordered by bucket: {state}");
        let triple = (int(item, "available"), int(item, "reserved"), int(item, "consumed"));
        assert!(triple.0 >= 0 && triple.1 >= 0 && triple.2 >= 0, "no bucket is negative: {state}");
        counts.push(triple);
    }
    let sum = counts.iter().fold((0, 0, 0), |s, c| (s.0 + c.0, s.1 + c.1, s.2 + c.2));
    let totals = Counts::of(state);
    assert_eq!(sum, (totals.available, totals.reserved, totals.consumed), "bucket_counts sum to the totals: {state}");
    counts
}

/// Replays a resource's ledger bucket by bucket with the contract's op semantics: every entry
/// names a bucket below `n`; the ledger opens with exactly one `create` per bucket (qty = that
/// bucket's opening share) before anything else; each entry's `*_after` values equal its
/// bucket's counters after it; no bucket ever goes negative. Returns each bucket's counters.
#[track_caller]
fn replay_buckets(entries: &[Value], n: usize) -> Vec<Triple> {
    assert!(entries.len() >= n, "at least one create entry per bucket: {} entries, {n} buckets", entries.len());
    let mut counts: Vec<Option<Triple>> = vec![None; n];
    let mut last_seq: Option<i64> = None;
    for (index, entry) in entries.iter().enumerate() {
        let seq = int(entry, "seq");
        if let Some(last) = last_seq {
            assert!(seq > last, "ledger seqs increase: {last} then {seq}");
        }
        last_seq = Some(seq);
        let bucket =
            entry["bucket"].as_u64().unwrap_or_else(|| panic!("every entry names its bucket: {entry}")) as usize;
        assert!(bucket < n, "entry's bucket is one of the resource's {n}: {entry}");
        let op = entry["op"].as_str().unwrap_or_else(|| panic!("op is a string: {entry}"));
        assert_eq!(op == "create", index < n, "the first {n} entries, and only they, are `create`: {entry}");
        let qty = int(entry, "qty");
        let slot = &mut counts[bucket];
        if op == "create" {
            assert!(slot.is_none(), "one create entry per bucket: {entry}");
            assert!(qty >= 0, "create qty is the bucket's share: {entry}");
            *slot = Some((qty, 0, 0));
        } else {
            if op != "adjust" {
                assert!(qty > 0, "{op} qty is positive: {entry}");
            }
            let c = slot.as_mut().unwrap_or_else(|| panic!("bucket {bucket} was created before use: {entry}"));
            match op {
                "adjust" => c.0 += qty,
                "deduct" => (c.0, c.2) = (c.0 - qty, c.2 + qty),
                "reserve" => (c.0, c.1) = (c.0 - qty, c.1 + qty),
                "confirm" => (c.1, c.2) = (c.1 - qty, c.2 + qty),
                "release" | "expire" => (c.1, c.0) = (c.1 - qty, c.0 + qty),
                "reverse" => (c.2, c.0) = (c.2 - qty, c.0 + qty),
                other => panic!("unknown ledger op {other:?}: {entry}"),
            }
        }
        let c = slot.expect("set above");
        assert!(c.0 >= 0 && c.1 >= 0 && c.2 >= 0, "bucket {bucket} went negative at {entry}");
        let after = (int(entry, "available_after"), int(entry, "reserved_after"), int(entry, "consumed_after"));
        assert_eq!(after, c, "entry's *_after values are its bucket's counters after it: {entry}");
    }
    counts.into_iter().map(|c| c.expect("every bucket was created")).collect()
}

/// Reads state and ledger at one moment (re-reading while a background job moves stock in
/// between) and asserts they agree: the bucket-by-bucket replay gives `bucket_counts` (or, with
/// one bucket, no `bucket_counts` field), its sums give the state's totals, `total` is
/// `available + reserved + consumed`, and `version` is the number of entries. Returns the state,
/// the entries and the per-bucket counters.
async fn assert_buckets_consistent(shop: &TenantClient, key: &str) -> (Value, Vec<Value>, Vec<Triple>) {
    for _ in 0..STABLE_READ_ATTEMPTS {
        let state = shop.state(key).await;
        let entries = shop.ledger(key).await;
        if shop.state(key).await != state {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        }
        let n = int(&state, "buckets");
        let replayed = replay_buckets(&entries, n as usize);
        let sum = replayed.iter().fold((0, 0, 0), |s, c| (s.0 + c.0, s.1 + c.1, s.2 + c.2));
        let totals = Counts::of(&state);
        assert_eq!(sum, (totals.available, totals.reserved, totals.consumed), "ledger replay != state {state}");
        assert_eq!(totals.available + totals.reserved + totals.consumed, totals.total, "invariant: {state}");
        if n > 1 {
            assert_eq!(bucket_counts(&state), replayed, "ledger replay per bucket != bucket_counts; state {state}");
        } else {
            assert!(state.get("bucket_counts").is_none(), "no bucket_counts with one bucket: {state}");
        }
        assert_eq!(int(&state, "version"), entries.len() as i64, "version == number of ledger entries: {state}");
        return (state, entries, replayed);
    }
    panic!("state of {key} kept changing while its ledger was read");
}

/// bucket → summed qty of the entries with this op that `pick` selects.
fn per_bucket(entries: &[Value], op: &str, pick: impl Fn(&Value) -> bool) -> BTreeMap<u64, i64> {
    let mut sums = BTreeMap::new();
    for entry in entries.iter().filter(|e| e["op"] == op && pick(e)) {
        let bucket = entry["bucket"].as_u64().unwrap_or_else(|| panic!("bucket is an integer: {entry}"));
        *sums.entry(bucket).or_insert(0) += int(entry, "qty");
    }
    sums
}

/// The entries written for one order (by its order id) with this op.
fn of_order<'a>(entries: &'a [Value], op: &str, order_id: &str) -> Vec<&'a Value> {
    entries.iter().filter(|e| e["op"] == op && e["order_id"] == order_id).collect()
}

/// Sends an order under a fresh idempotency key.
async fn place(shop: &TenantClient, body: &Value) -> Reply {
    shop.order(&unique("idem"), body).await
}

/// Asserts a rejected (409) order document whose lines are only `rejected/insufficient` (at
/// least one) or `skipped/skipped`, nothing applied. Returns the document.
#[track_caller]
fn assert_rejected_insufficient(reply: &Reply) -> Value {
    let doc = reply.expect_json(409);
    assert!(reply.content_type().starts_with("application/json"), "a rejected order is an order document: {doc}");
    assert_eq!(doc["status"], "rejected", "{doc}");
    let mut insufficient = 0;
    for line in doc["lines"].as_array().unwrap_or_else(|| panic!("lines is an array: {doc}")) {
        assert_eq!(line["applied"], 0, "{doc}");
        match (line["status"].as_str(), line["reason"].as_str()) {
            (Some("rejected"), Some("insufficient")) => insufficient += 1,
            (Some("skipped"), Some("skipped")) => {}
            other => panic!("unexpected line outcome {other:?} in {doc}"),
        }
    }
    assert!(insufficient >= 1, "at least one line is insufficient: {doc}");
    doc
}

/// Reserves and returns (reservation id, order id); asserts the 201.
async fn reserve_ok(shop: &TenantClient, key: &str, qty: i64, ttl: u64) -> (String, String) {
    let order_id = unique("R");
    let doc = place(shop, &reserve(&order_id, &[(key, qty)], Some(ttl))).await.expect_json(201);
    assert_eq!(doc["lines"][0]["applied"], qty, "{doc}");
    let id = doc["reservation_id"].as_str().unwrap_or_else(|| panic!("reservation_id: {doc}")).to_owned();
    (id, order_id)
}

/// Uploads `plugins/dist/<name>.wasm` with configuration text; asserts the 201.
async fn upload(shop: &TenantClient, name: &str, config: &str) -> i64 {
    let body = shop.put_plugin_config(plugin_wasm(name), config).await.expect_json(201);
    assert_eq!(body["active"], true, "{body}");
    int(&body, "version")
}

/// A one-line order by `user` (the flash sale requires one).
fn user_order(order_id: &str, user: &str, action: &str, key: &str, qty: i64) -> Value {
    json!({"order_id": order_id, "user_id": user, "action": action, "lines": [{"key": key, "qty": qty}]})
}

/// `GET /v1/reconciliation` found no drift (plugin limit counters may or may not be among the
/// checked resources, so this one asserts only the drift).
async fn assert_no_drift(shop: &TenantClient) {
    let report = shop.get("/v1/reconciliation").await.expect_json(200);
    assert_eq!(report["drift"], json!([]), "reconciliation report: {report}");
}

/// Polls the reservation until it reaches `state`.
async fn wait_for_reservation(shop: &TenantClient, id: &str, state: &str) {
    let deadline = tokio::time::Instant::now() + BACKGROUND_DEADLINE;
    loop {
        let current = shop.reservation(id).await.expect_json(200);
        if current["state"] == state {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "reservation {id} did not become {state}: {current}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

// ---------------------------------------------------------------------------------------------
// Creation and validation
// ---------------------------------------------------------------------------------------------

/// Proves creation splits the total evenly: 10 in 4 buckets is 3,3,2,2 (remainder to the lowest
/// buckets), shown in `bucket_counts` ordered by bucket, with exact totals, `buckets: 4`,
/// `version` 4 and one `create` entry per bucket carrying that bucket's share; the list shows
/// the totals too. `buckets: 1` is a plain resource (no `bucket_counts`, its entry in bucket 0),
/// the upper bound 1024 works (2050 = 3,3,2,...; 1024 create entries over two ledger pages), and
/// 3 in 4 buckets opens 1,1,1,0.
#[tokio::test]
async fn creation_splits_the_total_evenly_over_the_buckets() {
    let app = spawn_app_with(quiet()).await;
    let shop = app.create_tenant("shop").await;

    let created = create_bucketed(&shop, "b-ten", 10, 4).await;
    assert_counts(&created, 10, 0, 0, 10);
    assert_eq!(created["key"], "b-ten");
    assert_eq!(created["buckets"], 4);
    assert_eq!(created["version"], 4, "one create entry per bucket: {created}");
    assert_eq!(bucket_counts(&created), vec![(3, 0, 0), (3, 0, 0), (2, 0, 0), (2, 0, 0)]);
    assert_eq!(shop.state("b-ten").await, created, "GET shows what POST answered");

    let (_, entries, _) = assert_buckets_consistent(&shop, "b-ten").await;
    assert_eq!(entries.len(), 4);
    let opening: BTreeMap<u64, i64> = per_bucket(&entries, "create", |_| true);
    assert_eq!(opening, BTreeMap::from([(0, 3), (1, 3), (2, 2), (3, 2)]));

    let single = create_bucketed(&shop, "b-one", 7, 1).await;
    assert_counts(&single, 7, 0, 0, 7);
    assert_eq!(single["buckets"], 1);
    assert!(single.get("bucket_counts").is_none(), "no bucket_counts with one bucket: {single}");
    let (_, entries, _) = assert_buckets_consistent(&shop, "b-one").await;
    assert_eq!(entries.len(), 1);
    assert_eq!(entries[0]["bucket"], 0, "{}", entries[0]);

    let wide = create_bucketed(&shop, "b-wide", 2050, 1024).await;
    assert_counts(&wide, 2050, 0, 0, 2050);
    assert_eq!(wide["version"], 1024);
    assert_eq!(bucket_counts(&wide), fresh(2050, 1024));
    assert_eq!(shares(2050, 1024)[..3], [3, 3, 2]);
    let (_, entries, _) = assert_buckets_consistent(&shop, "b-wide").await;
    assert_eq!(entries.len(), 1024, "the ledger walk crossed a page boundary and saw every create");

    // Fewer units than buckets: the last bucket opens empty, with its own (zero) create entry.
    let small = create_bucketed(&shop, "b-small", 3, 4).await;
    assert_eq!(bucket_counts(&small), vec![(1, 0, 0), (1, 0, 0), (1, 0, 0), (0, 0, 0)]);
    let (_, entries, _) = assert_buckets_consistent(&shop, "b-small").await;
    assert_eq!(per_bucket(&entries, "create", |_| true), BTreeMap::from([(0, 1), (1, 1), (2, 1), (3, 0)]));

    // The list shows the same totals and bucket count.
    let page = shop.get("/v1/resources?prefix=b-").await.expect_json(200);
    let items = page["items"].as_array().unwrap_or_else(|| panic!("items: {page}"));
    let listed: Vec<(&str, i64, Counts)> =
        items.iter().map(|i| (i["key"].as_str().unwrap_or_default(), int(i, "buckets"), Counts::of(i))).collect();
    assert_eq!(
        listed,
        vec![
            ("b-one", 1, Counts::new(7, 0, 0, 7)),
            ("b-small", 4, Counts::new(3, 0, 0, 3)),
            ("b-ten", 4, Counts::new(10, 0, 0, 10)),
            ("b-wide", 1024, Counts::new(2050, 0, 0, 2050)),
        ]
    );
    shop.assert_reconciliation_clean(4).await;
}

/// Proves the bucket count is validated: 0, 1025, -1, a float and a string are each
/// `400 validation_failed` naming `buckets`, and nothing is created.
#[tokio::test]
async fn bucket_count_outside_one_to_1024_is_refused() {
    let app = spawn_app_with(quiet()).await;
    let shop = app.create_tenant("shop").await;
    for buckets in [json!(0), json!(1025), json!(-1), json!(2.5), json!("4")] {
        let body = json!({"key": "sku-v", "kind": "inventory", "total": 10, "buckets": buckets});
        let reply = shop.post("/v1/resources", &body).await;
        let problem = assert_problem(&reply, 400, "validation_failed");
        let detail = problem["detail"].as_str().unwrap_or_default();
        assert!(detail.contains("buckets"), "detail names buckets for {buckets}: {problem}");
    }
    assert_problem(&shop.get("/v1/resources/sku-v").await, 404, "resource_not_found");
    let page = shop.get("/v1/resources").await.expect_json(200);
    assert_eq!(page["items"], json!([]));
}

/// Proves re-splitting is not supported yet: PATCH with `buckets` (fewer, more, 1, and together
/// with a valid status change) is `400 validation_failed` naming `buckets`, and changes nothing,
/// not even the status sent alongside; a 1-bucket resource cannot be split either. The status
/// alone still patches: inactive, the bucketed resource refuses deducts and reserves with
/// `resource_inactive`; active again, it takes an order spanning its buckets.
#[tokio::test]
async fn patch_cannot_resplit_buckets() {
    let app = spawn_app_with(quiet()).await;
    let shop = app.create_tenant("shop").await;
    let before = create_bucketed(&shop, "sku-p", 10, 4).await;
    let plain = create_bucketed(&shop, "sku-plain", 10, 1).await;

    let bodies = [
        ("sku-p", json!({"buckets": 2})),
        ("sku-p", json!({"buckets": 8})),
        ("sku-p", json!({"buckets": 1})),
        ("sku-p", json!({"status": "inactive", "buckets": 2})),
        ("sku-plain", json!({"buckets": 4})),
    ];
    for (key, body) in bodies {
        let reply = shop.patch(&format!("/v1/resources/{key}"), &body).await;
        let problem = assert_problem(&reply, 400, "validation_failed");
        assert!(problem["detail"].as_str().unwrap_or_default().contains("buckets"), "{body}: {problem}");
    }
    assert_eq!(shop.state("sku-p").await, before);
    assert_eq!(shop.state("sku-plain").await, plain);
    // The status alone still patches a bucketed resource.
    let patched = shop.patch("/v1/resources/sku-p", &json!({"status": "inactive"})).await.expect_json(200);
    assert_eq!(patched["status"], "inactive");
    assert_eq!(patched["buckets"], 4);
    assert_eq!(bucket_counts(&patched), fresh(10, 4));
    // Inactive, it refuses orders in every bucket; active again, it takes them.
    for action in ["deduct", "reserve"] {
        let body = json!({"order_id": "O-1", "action": action, "lines": [{"key": "sku-p", "qty": 1}]});
        let doc = place(&shop, &body).await.expect_json(409);
        assert_eq!(doc["lines"][0]["reason"], "resource_inactive", "{doc}");
    }
    assert_eq!(shop.state("sku-p").await, patched, "refused orders change nothing");
    shop.patch("/v1/resources/sku-p", &json!({"status": "active"})).await.expect_json(200);
    place(&shop, &deduct("O-2", &[("sku-p", 9)])).await.expect_json(201);
    let (state, _, _) = assert_buckets_consistent(&shop, "sku-p").await;
    assert_counts(&state, 1, 0, 9, 10);
}

/// The schema a `$ref` (or an inline schema) stands for in an OpenAPI document.
fn resolve<'a>(doc: &'a Value, schema: &'a Value) -> &'a Value {
    match schema["$ref"].as_str() {
        Some(reference) => {
            let name = reference.rsplit('/').next().unwrap_or_default();
            let found = &doc["components"]["schemas"][name];
            assert!(found.is_object(), "{reference} is defined in components.schemas");
            found
        }
        None => schema,
    }
}

/// The property names of the JSON body schema of one operation's request or response.
fn body_properties<'a>(doc: &'a Value, body: &'a Value) -> Vec<&'a str> {
    let schema = resolve(doc, &body["content"]["application/json"]["schema"]);
    schema["properties"].as_object().map(|p| p.keys().map(String::as_str).collect()).unwrap_or_default()
}

/// Proves the OpenAPI document describes buckets (the contract asks for what it leaves open to
/// be documented there): creation takes `buckets`, the state has `buckets` and `bucket_counts`
/// (items with `bucket`, `available`, `reserved`, `consumed`), and ledger entries have `bucket`.
#[tokio::test]
async fn openapi_documents_buckets() {
    let app = spawn_app_with(quiet()).await;
    let doc = app.get_anonymous("/openapi.json").await.expect_json(200);
    let paths = &doc["paths"];

    let create = body_properties(&doc, &paths["/v1/resources"]["post"]["requestBody"]);
    assert!(create.contains(&"buckets"), "create body: {create:?}");

    let state = resolve(
        &doc,
        &paths["/v1/resources/{key}"]["get"]["responses"]["200"]["content"]["application/json"]["schema"],
    );
    let props = &state["properties"];
    assert!(props["buckets"].is_object(), "state documents buckets: {state}");
    let counts = resolve(&doc, &props["bucket_counts"]["items"]);
    for field in ["bucket", "available", "reserved", "consumed"] {
        assert!(counts["properties"][field].is_object(), "bucket_counts items document {field}: {counts}");
    }

    let page = resolve(
        &doc,
        &paths["/v1/resources/{key}/ledger"]["get"]["responses"]["200"]["content"]["application/json"]["schema"],
    );
    let entry = resolve(&doc, &page["properties"]["items"]["items"]);
    assert!(entry["properties"]["bucket"].is_object(), "ledger entries document bucket: {entry}");
}

// ---------------------------------------------------------------------------------------------
// Orders
// ---------------------------------------------------------------------------------------------

/// Proves a line is never refused while the total covers it: 10 in 4 buckets (3,3,2,2), an order
/// for 9 succeeds although no bucket holds more than 3 (dry-run says so first); it writes one
/// `deduct` entry in each of the 4 buckets (any 3 hold at most 8), all with the order's one
/// request id, summing to 9. Then 2 (> the 1 left) is `409 insufficient` with nothing applied,
/// and 1 succeeds, leaving every bucket empty. A replay of the 9 applies nothing.
#[tokio::test]
async fn a_line_is_taken_across_buckets_when_no_single_bucket_covers_it() {
    let app = spawn_app_with(quiet()).await;
    let shop = app.create_tenant("shop").await;
    create_bucketed(&shop, "sku-x", 10, 4).await;

    let big = deduct("ORD-9", &[("sku-x", 9)]);
    let dry = shop.post("/v1/orders/dry-run", &big).await.expect_json(200);
    assert_eq!(dry["outcome"]["status"], "succeeded", "{dry}");
    assert_eq!(int(&shop.state("sku-x").await, "version"), 4, "dry-run applied nothing");

    let reply = shop.order("idem-9", &big).await;
    let doc = reply.expect_json(201);
    assert_eq!(
        doc,
        json!({
            "order_id": "ORD-9", "status": "succeeded", "action": "deduct",
            "reservation_id": null, "expires_at": null,
            "lines": [{"key": "sku-x", "resource": "sku-x", "qty": 9, "applied": 9, "status": "applied", "reason": null}],
            "plugin": {"name": "default", "version": 0}
        })
    );
    let (state, entries, counts) = assert_buckets_consistent(&shop, "sku-x").await;
    assert_counts(&state, 1, 0, 9, 10);
    let taken = of_order(&entries, "deduct", "ORD-9");
    assert_eq!(taken.len(), 4, "one deduct entry per bucket touched, all four touched: {taken:?}");
    let buckets: HashSet<u64> = taken.iter().filter_map(|e| e["bucket"].as_u64()).collect();
    assert_eq!(buckets.len(), 4, "each bucket once: {taken:?}");
    assert!(taken[0]["request_id"].is_string(), "{}", taken[0]);
    for entry in &taken {
        assert_eq!(entry["request_id"], taken[0]["request_id"], "one request id for the whole line: {taken:?}");
    }
    assert_eq!(taken.iter().map(|e| int(e, "qty")).sum::<i64>(), 9);
    // Each bucket lost exactly what its entry says.
    let opening = shares(10, 4);
    for entry in &taken {
        let b = int(entry, "bucket") as usize;
        assert_eq!(counts[b], (opening[b] - int(entry, "qty"), 0, int(entry, "qty")), "bucket {b}: {state}");
    }

    let short = deduct("ORD-2", &[("sku-x", 2)]);
    let dry = shop.post("/v1/orders/dry-run", &short).await.expect_json(200);
    assert_eq!(dry["outcome"]["lines"][0]["reason"], "insufficient", "{dry}");
    assert_rejected_insufficient(&shop.order("idem-2", &short).await);
    assert_eq!(shop.state("sku-x").await, state, "a rejected order changes nothing");

    let replay = shop.order("idem-9", &big).await;
    assert_eq!(replay.status(), 201, "{}", replay.text);
    assert!(replay.replayed(), "same key, same body: a replay");
    assert_eq!(replay.json(), doc);
    assert_eq!(shop.state("sku-x").await, state, "a replay applies nothing");

    let last = shop.order("idem-1", &deduct("ORD-1", &[("sku-x", 1)])).await.expect_json(201);
    assert_eq!(last["status"], "succeeded");
    let (state, entries, counts) = assert_buckets_consistent(&shop, "sku-x").await;
    assert_counts(&state, 0, 0, 10, 10);
    assert_eq!(counts, shares(10, 4).into_iter().map(|s| (0, 0, s)).collect::<Vec<_>>());
    let one = of_order(&entries, "deduct", "ORD-1");
    assert_eq!(one.len(), 1, "{one:?}");
    assert_ne!(one[0]["request_id"], taken[0]["request_id"], "another request, another request id");
    shop.assert_reconciliation_clean(1).await;
}

/// Proves the default bucket choice: a line one bucket can cover is taken from exactly one
/// bucket, and the first bucket depends on the request (its Idempotency-Key), so 64 single-unit
/// orders under random keys land in all 4 buckets (all in 3 or fewer has odds below 1 in 10^7
/// for any reasonable hash), and each bucket's `consumed` is exactly its share of the entries.
#[tokio::test]
async fn a_line_one_bucket_covers_takes_from_one_bucket_chosen_by_the_request() {
    let app = spawn_app_with(quiet()).await;
    let shop = app.create_tenant("shop").await;
    create_bucketed(&shop, "sku-s", 400, 4).await;

    for n in 0..64 {
        place(&shop, &deduct(&format!("S-{n}"), &[("sku-s", 1)])).await.expect_json(201);
    }
    let (state, entries, counts) = assert_buckets_consistent(&shop, "sku-s").await;
    assert_counts(&state, 336, 0, 64, 400);
    let mut used = BTreeMap::new();
    for n in 0..64 {
        let taken = of_order(&entries, "deduct", &format!("S-{n}"));
        assert_eq!(taken.len(), 1, "a line one bucket covers touches one bucket: {taken:?}");
        assert_eq!(taken[0]["qty"], 1);
        *used.entry(int(taken[0], "bucket")).or_insert(0i64) += 1;
    }
    assert_eq!(used.len(), 4, "requests spread over all buckets: {used:?}");
    for (bucket, n) in &used {
        assert_eq!(counts[*bucket as usize], (100 - n, 0, *n), "bucket {bucket}: {state}");
    }
    shop.assert_reconciliation_clean(1).await;
}

/// Proves all-or-nothing holds when a line spans buckets: an order taking 9 of a 10-in-4
/// resource (every bucket) plus 2 of a plain resource holding 1 is rejected, and no bucket
/// moved; with 1 of the plain resource the same order succeeds.
#[tokio::test]
async fn an_order_spanning_buckets_is_all_or_nothing() {
    let app = spawn_app_with(quiet()).await;
    let shop = app.create_tenant("shop").await;
    let before = create_bucketed(&shop, "sku-b", 10, 4).await;
    shop.create_resource("sku-plain", 1).await;

    let doc = assert_rejected_insufficient(&place(&shop, &deduct("O-1", &[("sku-b", 9), ("sku-plain", 2)])).await);
    assert_eq!(doc["lines"][0]["status"], "skipped", "{doc}");
    assert_eq!(doc["lines"][1]["reason"], "insufficient", "{doc}");
    assert_eq!(shop.state("sku-b").await, before, "no bucket moved");
    assert_counts(&shop.state("sku-plain").await, 1, 0, 0, 1);

    let reserve_doc = place(&shop, &reserve("O-2", &[("sku-b", 9), ("sku-plain", 2)], Some(600))).await;
    assert_rejected_insufficient(&reserve_doc);
    assert_eq!(shop.state("sku-b").await, before, "no bucket moved for a rejected reserve either");

    place(&shop, &deduct("O-3", &[("sku-b", 9), ("sku-plain", 1)])).await.expect_json(201);
    let (state, entries, _) = assert_buckets_consistent(&shop, "sku-b").await;
    assert_counts(&state, 1, 0, 9, 10);
    assert!(of_order(&entries, "deduct", "O-1").is_empty() && of_order(&entries, "reserve", "O-2").is_empty());
    assert_counts(&shop.state("sku-plain").await, 0, 0, 1, 1);
    shop.assert_reconciliation_clean(2).await;
}

// ---------------------------------------------------------------------------------------------
// Reservations
// ---------------------------------------------------------------------------------------------

/// Proves held stock goes back where it came from: on 10 in 4 buckets after one unit is
/// deducted, a hold of 8 spans buckets; while held only 1 is available (2 is refused); release
/// writes per bucket exactly the quantities the reserve took, and `bucket_counts` are again what
/// they were before the reserve. A second hold of 8, confirmed, moves per bucket exactly its
/// reserved quantities to consumed.
#[tokio::test]
async fn release_and_confirm_move_the_quantities_in_the_buckets_they_were_taken_from() {
    let app = spawn_app_with(quiet()).await;
    let shop = app.create_tenant("shop").await;
    create_bucketed(&shop, "sku-h", 10, 4).await;
    place(&shop, &deduct("D-1", &[("sku-h", 1)])).await.expect_json(201);
    let (_, _, before) = assert_buckets_consistent(&shop, "sku-h").await;

    let (id, order_id) = reserve_ok(&shop, "sku-h", 8, 600).await;
    let (state, entries, held) = assert_buckets_consistent(&shop, "sku-h").await;
    assert_counts(&state, 1, 8, 1, 10);
    let reserved = per_bucket(&entries, "reserve", |e| e["reservation_id"] == id.as_str());
    assert!(reserved.len() >= 3, "8 of 9 spread as (3,3,2,2) minus 1 needs 3 buckets or more: {reserved:?}");
    assert_eq!(reserved.values().sum::<i64>(), 8);
    assert_eq!(of_order(&entries, "reserve", &order_id).len(), reserved.len(), "one entry per bucket touched");
    for (b, q) in &reserved {
        let (a0, r0, c0) = before[*b as usize];
        assert_eq!(held[*b as usize], (a0 - q, r0 + q, c0), "bucket {b} holds what its entry says: {state}");
    }
    assert_rejected_insufficient(&place(&shop, &deduct("D-2", &[("sku-h", 2)])).await);

    assert_eq!(shop.release(&id).await.expect_json(200)["state"], "released");
    let (state, entries, after) = assert_buckets_consistent(&shop, "sku-h").await;
    assert_counts(&state, 9, 0, 1, 10);
    assert_eq!(per_bucket(&entries, "release", |e| e["reservation_id"] == id.as_str()), reserved);
    assert_eq!(after, before, "after the release every bucket is as before the reserve");
    // Releasing again moves nothing.
    shop.release(&id).await.expect_json(200);
    assert_eq!(assert_buckets_consistent(&shop, "sku-h").await.0, state);

    let (id2, _) = reserve_ok(&shop, "sku-h", 8, 600).await;
    let (_, _, held2) = assert_buckets_consistent(&shop, "sku-h").await;
    assert_eq!(shop.confirm(&id2).await.expect_json(200)["state"], "confirmed");
    let (state, entries, confirmed) = assert_buckets_consistent(&shop, "sku-h").await;
    assert_counts(&state, 1, 0, 9, 10);
    let reserved2 = per_bucket(&entries, "reserve", |e| e["reservation_id"] == id2.as_str());
    assert_eq!(reserved2.values().sum::<i64>(), 8);
    assert_eq!(per_bucket(&entries, "confirm", |e| e["reservation_id"] == id2.as_str()), reserved2);
    for (b, q) in &reserved2 {
        let (a, r, c) = held2[*b as usize];
        assert_eq!(r, *q, "bucket {b} held exactly its reserve entry");
        assert_eq!(confirmed[*b as usize], (a, 0, c + q), "bucket {b}: its hold became consumed: {state}");
    }
    shop.assert_reconciliation_clean(1).await;
}

/// Proves expiry gives each bucket back its own hold: a 1-second hold of 8 spanning buckets
/// expires (sweeper every 200 ms), its `expire` entries equal its `reserve` entries bucket by
/// bucket, and `bucket_counts` are what they were before the reserve.
#[tokio::test]
async fn expiry_returns_each_bucket_its_own_hold() {
    let app = spawn_app_with(quiet().toml(FAST_SWEEP)).await;
    let shop = app.create_tenant("shop").await;
    create_bucketed(&shop, "sku-e", 10, 4).await;
    place(&shop, &deduct("D-1", &[("sku-e", 1)])).await.expect_json(201);
    let (_, _, before) = assert_buckets_consistent(&shop, "sku-e").await;

    let (id, _) = reserve_ok(&shop, "sku-e", 8, 1).await;
    wait_for_reservation(&shop, &id, "expired").await;

    let (state, entries, after) = assert_buckets_consistent(&shop, "sku-e").await;
    assert_counts(&state, 9, 0, 1, 10);
    let reserved = per_bucket(&entries, "reserve", |e| e["reservation_id"] == id.as_str());
    assert!(reserved.len() >= 3, "{reserved:?}");
    assert_eq!(reserved.values().sum::<i64>(), 8);
    assert_eq!(per_bucket(&entries, "expire", |e| e["reservation_id"] == id.as_str()), reserved);
    assert_eq!(entries_with_op(&entries, "expire").len(), reserved.len(), "one expire entry per bucket held");
    assert_eq!(after, before);
    shop.assert_reconciliation_clean(1).await;
}

// ---------------------------------------------------------------------------------------------
// Adjustments and rebalancing
// ---------------------------------------------------------------------------------------------

/// Proves adjustments per bucket: on 4 in 4 buckets (1,1,1,1) a restock of 7 is spread like a
/// creation (+2,+2,+2,+1 → 3,3,3,2, one adjust entry each); a restock of 1 goes to bucket 0
/// (twice → 5,3,3,2); a write-off of 2 takes from the fullest bucket (→ 3,3,3,2); a write-off of
/// 12 with 11 available is `409 insufficient` changing nothing; a write-off of 10 spread over
/// several buckets succeeds (never refused while the total covers it), and so does the last 1.
/// A replayed adjustment applies nothing.
#[tokio::test]
async fn restock_spreads_evenly_and_write_off_takes_from_the_fullest_bucket() {
    let app = spawn_app_with(quiet()).await;
    let shop = app.create_tenant("shop").await;
    create_bucketed(&shop, "sku-a", 4, 4).await;

    let restocked = shop.adjust("sku-a", "adj-7", 7).await.expect_json(200);
    assert_counts(&restocked, 11, 0, 0, 11);
    assert_eq!(bucket_counts(&restocked), vec![(3, 0, 0), (3, 0, 0), (3, 0, 0), (2, 0, 0)]);
    let (_, entries, _) = assert_buckets_consistent(&shop, "sku-a").await;
    assert_eq!(per_bucket(&entries, "adjust", |_| true), BTreeMap::from([(0, 2), (1, 2), (2, 2), (3, 1)]));
    assert_eq!(entries_with_op(&entries, "adjust").len(), 4, "one adjust entry per bucket");

    // Same key, same body: the first answer again, nothing applied twice.
    let replay = shop.adjust("sku-a", "adj-7", 7).await;
    assert!(replay.replayed(), "{:?}", replay.headers);
    assert_eq!(replay.expect_json(200), restocked);

    shop.adjust("sku-a", "adj-1a", 1).await.expect_json(200);
    let state = shop.adjust("sku-a", "adj-1b", 1).await.expect_json(200);
    assert_eq!(availables(&bucket_counts(&state)), [5, 3, 3, 2], "a restock of 1 goes to bucket 0");

    let state = shop.adjust("sku-a", "adj-w2", -2).await.expect_json(200);
    assert_counts(&state, 11, 0, 0, 11);
    assert_eq!(availables(&bucket_counts(&state)), [3, 3, 3, 2], "the write-off came from the fullest bucket");
    let (_, entries, _) = assert_buckets_consistent(&shop, "sku-a").await;
    let last = entries.last().expect("entries");
    assert_eq!((int(last, "bucket"), int(last, "qty")), (0, -2), "{last}");

    let problem = assert_problem(&shop.adjust("sku-a", "adj-w12", -12).await, 409, "insufficient");
    assert!(problem["detail"].is_string(), "{problem}");
    let (unchanged, _, _) = assert_buckets_consistent(&shop, "sku-a").await;
    assert_eq!(unchanged, state, "a refused write-off changes nothing");

    let state = shop.adjust("sku-a", "adj-w10", -10).await.expect_json(200);
    assert_counts(&state, 1, 0, 0, 1);
    let state = shop.adjust("sku-a", "adj-w1", -1).await.expect_json(200);
    assert_counts(&state, 0, 0, 0, 0);
    assert_eq!(bucket_counts(&state), vec![(0, 0, 0); 4]);
    assert_buckets_consistent(&shop, "sku-a").await;
    shop.assert_reconciliation_clean(1).await;
}

/// Polls until no two buckets' `available` differ by more than one, asserting at every poll
/// that the totals are `totals` (rebalancing never changes them); returns the bucket counts.
async fn wait_until_even(shop: &TenantClient, key: &str, totals: Counts) -> Vec<Triple> {
    let deadline = tokio::time::Instant::now() + BACKGROUND_DEADLINE;
    loop {
        let state = shop.state(key).await;
        assert_eq!(Counts::of(&state), totals, "the totals never change while rebalancing: {state}");
        let counts = bucket_counts(&state);
        let available = availables(&counts);
        let spread = available.iter().max().unwrap_or(&0) - available.iter().min().unwrap_or(&0);
        if spread <= 1 {
            return counts;
        }
        assert!(tokio::time::Instant::now() < deadline, "not rebalanced within {BACKGROUND_DEADLINE:?}: {state}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Proves the rebalancer (every 200 ms via `[buckets] rebalance_interval_ms`): 100 in 4
/// buckets, one deduct of 25 empties exactly one bucket (its single entry shows the bucket at 0
/// after it); then, without any request, `available` is evened out to 19,19,19,18 (in some
/// order) by `adjust` entries that add up to zero, every poll showing the same totals (75
/// available, 100 in total), consumption staying in the bucket it happened in. Then a hold of
/// 18 (every bucket holds 18 or more, so it comes from one bucket) stays in its bucket while
/// the rest is evened out to 15,14,14,14, and its release returns the 18 to that bucket, after
/// which the rebalancer evens out 75 again. Reconciliation is clean throughout.
#[tokio::test]
async fn rebalancer_evens_out_available_across_buckets() {
    let app = spawn_app_with(AppOptions::default().toml("[buckets]\nrebalance_interval_ms = 200")).await;
    let shop = app.create_tenant("shop").await;
    create_bucketed(&shop, "sku-r", 100, 4).await;

    place(&shop, &deduct("R-25", &[("sku-r", 25)])).await.expect_json(201);
    let entries = shop.ledger("sku-r").await;
    let taken = of_order(&entries, "deduct", "R-25");
    assert_eq!(taken.len(), 1, "one bucket of 25 covers the line: {taken:?}");
    let drained = int(taken[0], "bucket") as usize;
    assert_eq!(
        (int(taken[0], "available_after"), int(taken[0], "reserved_after"), int(taken[0], "consumed_after")),
        (0, 0, 25),
        "the bucket was emptied: {}",
        taken[0]
    );

    wait_until_even(&shop, "sku-r", Counts::new(75, 0, 25, 100)).await;
    let (state, entries, counts) = assert_buckets_consistent(&shop, "sku-r").await;
    let mut available = availables(&counts);
    available.sort_unstable();
    assert_eq!(available, [18, 19, 19, 19]);
    for (b, c) in counts.iter().enumerate() {
        assert_eq!((c.1, c.2), (0, if b == drained { 25 } else { 0 }), "bucket {b}: {state}");
    }
    let adjusts = entries_with_op(&entries, "adjust");
    assert_eq!(adjusts.iter().map(|e| int(e, "qty")).sum::<i64>(), 0, "rebalancing moves, never adds: {adjusts:?}");
    assert!(adjusts.iter().any(|e| int(e, "qty") < 0) && adjusts.iter().any(|e| int(e, "qty") > 0), "{adjusts:?}");
    let into_drained: i64 =
        adjusts.iter().filter(|e| int(e, "bucket") as usize == drained).map(|e| int(e, "qty")).sum();
    assert_eq!(into_drained, counts[drained].0, "the emptied bucket was refilled by adjust entries only");
    shop.assert_reconciliation_clean(1).await;

    // A hold stays where it was taken while the rebalancer moves the available stock around it.
    let (id, _) = reserve_ok(&shop, "sku-r", 18, 600).await;
    let held_in = {
        let entries = shop.ledger("sku-r").await;
        let reserved = per_bucket(&entries, "reserve", |e| e["reservation_id"] == id.as_str());
        assert_eq!(reserved.len(), 1, "the first bucket tried covers the hold: {reserved:?}");
        *reserved.keys().next().expect("one bucket") as usize
    };
    let counts = wait_until_even(&shop, "sku-r", Counts::new(57, 18, 25, 100)).await;
    let mut available = availables(&counts);
    available.sort_unstable();
    assert_eq!(available, [14, 14, 14, 15]);
    for (b, c) in counts.iter().enumerate() {
        assert_eq!(c.1, if b == held_in { 18 } else { 0 }, "the hold stays in bucket {held_in}: {counts:?}");
    }

    assert_eq!(shop.release(&id).await.expect_json(200)["state"], "released");
    let entries = shop.ledger("sku-r").await;
    let released = per_bucket(&entries, "release", |e| e["reservation_id"] == id.as_str());
    assert_eq!(released, BTreeMap::from([(held_in as u64, 18)]), "released into the bucket it was held in");
    let counts = wait_until_even(&shop, "sku-r", Counts::new(75, 0, 25, 100)).await;
    assert!(counts.iter().all(|c| c.1 == 0), "{counts:?}");
    assert_buckets_consistent(&shop, "sku-r").await;
    shop.assert_reconciliation_clean(1).await;
}

// ---------------------------------------------------------------------------------------------
// Plugins
// ---------------------------------------------------------------------------------------------

/// Proves a plugin's bucket order is honoured and its limit holds on a bucketed resource: with
/// the flash sale configured `buckets = 4` on 40 in 4 buckets, each of 6 users' one piece comes
/// from exactly the bucket the plugin lists first for that user (FNV-1a of the user id mod 4);
/// the same user again, or 2 pieces at once, is `limit_exceeded` with nothing applied.
#[tokio::test]
async fn flash_sale_bucket_order_is_honoured_and_its_limit_holds() {
    let app = spawn_app_with(quiet()).await;
    let shop = app.create_tenant("shop").await;
    create_bucketed(&shop, "sku-f", 40, 4).await;
    upload(&shop, "flash-sale", "buckets = 4").await;

    let users: Vec<String> = (1..=6).map(|i| format!("u-{i}")).collect();
    for user in &users {
        let doc = place(&shop, &user_order(&format!("F-{user}"), user, "deduct", "sku-f", 1)).await.expect_json(201);
        assert_eq!(doc["lines"][0]["applied"], 1, "{doc}");
    }
    let (state, entries, counts) = assert_buckets_consistent(&shop, "sku-f").await;
    assert_counts(&state, 34, 0, 6, 40);
    let mut expected = [0i64; 4];
    for user in &users {
        let taken = of_order(&entries, "deduct", &format!("F-{user}"));
        assert_eq!(taken.len(), 1, "{taken:?}");
        let first = (fnv1a(user) % 4) as i64;
        assert_eq!(int(taken[0], "bucket"), first, "{user}'s piece comes from the plugin's first bucket");
        expected[first as usize] += 1;
    }
    for (b, n) in expected.iter().enumerate() {
        assert_eq!(counts[b], (10 - n, 0, *n), "bucket {b}: {state}");
    }

    for (order_id, qty) in [("again", 1), ("two", 2)] {
        let doc = place(&shop, &user_order(order_id, "u-1", "deduct", "sku-f", qty)).await.expect_json(409);
        assert_eq!(doc["lines"][0]["reason"], "limit_exceeded", "{doc}");
        assert_eq!(doc["lines"][0]["applied"], 0, "{doc}");
    }
    assert_eq!(shop.state("sku-f").await, state, "limit refusals change nothing");
    assert_no_drift(&shop).await;
}

/// Proves a plan naming a bucket the resource does not have fails the request: the flash sale
/// configured `buckets = 8` lists buckets 0..8 for a 4-bucket resource, so every order (deduct,
/// reserve, dry-run; users whose first bucket exists included) is `422 plugin_failed` and the
/// state and ledger stay exactly as they were; re-uploaded with `buckets = 4` the same order
/// succeeds.
#[tokio::test]
async fn a_plan_naming_a_missing_bucket_fails_the_order_and_applies_nothing() {
    let app = spawn_app_with(quiet()).await;
    let shop = app.create_tenant("shop").await;
    let before = create_bucketed(&shop, "sku-o", 40, 4).await;
    upload(&shop, "flash-sale", "buckets = 8").await;

    let users = ["u-1", "u-2", "u-3", "u-4", "u-5", "u-6"];
    assert!(users.iter().any(|u| fnv1a(u) % 8 < 4), "some user starts at a bucket that exists");
    assert!(users.iter().any(|u| fnv1a(u) % 8 >= 4), "some user starts at a bucket that does not");
    for user in users {
        for action in ["deduct", "reserve"] {
            let body = user_order(&format!("O-{user}-{action}"), user, action, "sku-o", 1);
            let problem = assert_problem(&place(&shop, &body).await, 422, "plugin_failed");
            assert!(problem["detail"].as_str().is_some_and(|d| !d.trim().is_empty()), "{problem}");
            assert_problem(&shop.post("/v1/orders/dry-run", &body).await, 422, "plugin_failed");
        }
    }
    assert_eq!(shop.state("sku-o").await, before, "nothing applied");
    assert_eq!(shop.ledger("sku-o").await.len(), 4, "nothing recorded");

    upload(&shop, "flash-sale", "buckets = 4").await;
    place(&shop, &user_order("O-ok", "u-1", "deduct", "sku-o", 1)).await.expect_json(201);
    let (state, _, _) = assert_buckets_consistent(&shop, "sku-o").await;
    assert_counts(&state, 39, 0, 1, 40);
    assert_no_drift(&shop).await;
}

// ---------------------------------------------------------------------------------------------
// Concurrency
// ---------------------------------------------------------------------------------------------

/// Proves exact arithmetic under a race (default rebalancer running): 64 clients x 10 single-unit
/// deducts on 500 in 16 buckets: exactly 500 succeed, the other 140 are `409 insufficient`, no
/// bucket is negative, every bucket is empty, 500 deduct entries of one bucket each from 500
/// distinct orders, the per-bucket replay equals `bucket_counts`, and reconciliation is clean.
/// The orders that met in one group commit were decided together by batch admission, buckets
/// and all, rather than one after another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_clients_racing_on_sixteen_buckets_get_exactly_the_total() {
    let app = spawn_app_with(AppOptions::default()).await;
    let shop = app.create_tenant("shop").await;
    create_bucketed(&shop, "sku-hot", 500, 16).await;

    let barrier = Arc::new(Barrier::new(64));
    let clients = (0..64).map(|client| {
        let shop = shop.clone();
        let barrier = barrier.clone();
        tokio::spawn(async move {
            barrier.wait().await;
            let mut replies = Vec::new();
            for n in 0..10 {
                let key = format!("c{client}-o{n}");
                replies.push(shop.order(&key, &deduct(&key, &[("sku-hot", 1)])).await);
            }
            replies
        })
    });
    let replies: Vec<Reply> =
        join_all(clients).await.into_iter().flat_map(|r| r.expect("client task does not panic")).collect();

    let mut created = 0;
    let mut rejected = 0;
    for reply in &replies {
        match reply.status() {
            201 => created += 1,
            409 => {
                assert_rejected_insufficient(reply);
                rejected += 1;
            }
            _ => panic!("unexpected answer {} {}", reply.status, reply.text),
        }
    }
    assert_eq!((created, rejected), (500, 140));

    let (state, entries, counts) = assert_buckets_consistent(&shop, "sku-hot").await;
    assert_counts(&state, 0, 0, 500, 500);
    assert!(counts.iter().all(|c| c.0 == 0 && c.1 == 0), "every bucket is sold out: {state}");
    let deducts = entries_with_op(&entries, "deduct");
    assert_eq!(deducts.len(), 500, "a single unit always comes from one bucket");
    let orders: HashSet<&str> = deducts.iter().filter_map(|e| e["order_id"].as_str()).collect();
    assert_eq!(orders.len(), 500);
    shop.assert_reconciliation_clean(1).await;
    let admitted = metric(&app, "stockd_orders_admitted_in_batch_total", &[]).await;
    assert!(admitted > 0.0, "no order of 640 on a bucketed resource was decided by batch admission");
    let logs = app.logs();
    assert!(!logs.contains("batch admission failed"), "batch admission failed:\n{logs}");
}

/// Proves "never refused while the total covers it" under a race, with the rebalancer running
/// every 50 ms alongside: 48 clients x 6 orders of 2 or 3 units on 300 in 16 buckets. The
/// successes' quantities sum to exactly the consumed total, every refusal is `insufficient`,
/// and once all orders are done the available left is below the smallest refused quantity (a
/// refused order saw less than its quantity available, and available only shrinks here). No
/// order is for 1 unit: single units would mop up the odd units a server refusing to combine
/// buckets leaves behind, and hide its wrongful refusals. No bucket negative, per-bucket
/// replay equals `bucket_counts`, reconciliation clean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_quantity_race_is_never_refused_while_the_total_covers_it() {
    let app = spawn_app_with(AppOptions::default().toml("[buckets]\nrebalance_interval_ms = 50")).await;
    let shop = app.create_tenant("shop").await;
    create_bucketed(&shop, "sku-mix", 300, 16).await;

    let barrier = Arc::new(Barrier::new(48));
    let clients = (0..48).map(|client| {
        let shop = shop.clone();
        let barrier = barrier.clone();
        tokio::spawn(async move {
            barrier.wait().await;
            let mut replies = Vec::new();
            for n in 0..6 {
                let qty = 2 + ((client + n) % 2) as i64;
                let key = format!("c{client}-o{n}");
                replies.push((qty, shop.order(&key, &deduct(&key, &[("sku-mix", qty)])).await));
            }
            replies
        })
    });
    let replies: Vec<(i64, Reply)> =
        join_all(clients).await.into_iter().flat_map(|r| r.expect("client task does not panic")).collect();

    let mut sold = 0;
    let mut refused: Vec<i64> = Vec::new();
    for (qty, reply) in &replies {
        match reply.status() {
            201 => {
                assert_eq!(reply.json()["lines"][0]["applied"], *qty, "{}", reply.text);
                sold += qty;
            }
            409 => {
                assert_rejected_insufficient(reply);
                refused.push(*qty);
            }
            _ => panic!("unexpected answer {} {}", reply.status, reply.text),
        }
    }
    assert!(!refused.is_empty(), "demand (720) exceeds the stock (300)");

    let (state, entries, _) = assert_buckets_consistent(&shop, "sku-mix").await;
    let totals = Counts::of(&state);
    assert_eq!((totals.reserved, totals.consumed, totals.total), (0, sold, 300), "{state}");
    assert_eq!(totals.available, 300 - sold);
    let smallest_refused = *refused.iter().min().expect("non-empty");
    assert!(
        totals.available < smallest_refused,
        "an order of {smallest_refused} was refused but {} are available after the race: {state}",
        totals.available
    );
    assert_eq!(entries_with_op(&entries, "deduct").iter().map(|e| int(e, "qty")).sum::<i64>(), sold);
    shop.assert_reconciliation_clean(1).await;
}

/// Proves all-or-nothing and exact sums when orders over a bucketed and a plain resource race
/// with orders over the plain one alone (on SQLite the latter may be decided together in a
/// batch while the former take the per-order path): 40 clients x 5 orders, even clients
/// `[sku-b 3, sku-p 1]`, odd clients `[sku-p 2]`, on 100 of `sku-b` in 8 buckets and 100 of
/// `sku-p`. Every answer is 201 or `409 insufficient`; each resource's consumed total is what
/// the successful orders asked of it; a successful two-line order has exactly its 3 and its 1
/// in the ledgers, a rejected one nothing; and at the end no rejected order could be applied
/// (both resources only shrink, so what refused an order then still refuses it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orders_over_bucketed_and_plain_resources_race_all_or_nothing() {
    let app = spawn_app_with(AppOptions::default()).await;
    let shop = app.create_tenant("shop").await;
    create_bucketed(&shop, "sku-b", 100, 8).await;
    shop.create_resource("sku-p", 100).await;

    let barrier = Arc::new(Barrier::new(40));
    let clients = (0..40).map(|client| {
        let shop = shop.clone();
        let barrier = barrier.clone();
        tokio::spawn(async move {
            barrier.wait().await;
            let mut replies = Vec::new();
            for n in 0..5 {
                let order_id = format!("c{client}-o{n}");
                let lines: &[(&str, i64)] =
                    if client % 2 == 0 { &[("sku-b", 3), ("sku-p", 1)] } else { &[("sku-p", 2)] };
                let reply = shop.order(&order_id, &deduct(&order_id, lines)).await;
                replies.push((order_id, client % 2 == 0, reply));
            }
            replies
        })
    });
    let replies: Vec<(String, bool, Reply)> =
        join_all(clients).await.into_iter().flat_map(|r| r.expect("client task does not panic")).collect();

    let b = assert_buckets_consistent(&shop, "sku-b").await;
    let p_entries = shop.assert_ledger_replays_to_state("sku-p").await;
    let p = shop.state("sku-p").await;
    let (b_available, p_available) = (int(&b.0, "available"), int(&p, "available"));
    let (mut b_sold, mut p_sold) = (0, 0);
    for (order_id, two_lines, reply) in &replies {
        let b_taken: i64 = of_order(&b.1, "deduct", order_id).iter().map(|e| int(e, "qty")).sum();
        let p_taken: i64 = of_order(&p_entries, "deduct", order_id).iter().map(|e| int(e, "qty")).sum();
        match (reply.status(), two_lines) {
            (201, true) => assert_eq!((b_taken, p_taken), (3, 1), "{order_id}"),
            (201, false) => assert_eq!((b_taken, p_taken), (0, 2), "{order_id}"),
            (409, true) => {
                assert_rejected_insufficient(reply);
                assert_eq!((b_taken, p_taken), (0, 0), "{order_id}: a rejected order leaves nothing");
                assert!(b_available < 3 || p_available < 1, "{order_id} refused, yet both lines fit now");
            }
            (409, false) => {
                assert_rejected_insufficient(reply);
                assert_eq!((b_taken, p_taken), (0, 0), "{order_id}: a rejected order leaves nothing");
                assert!(p_available < 2, "{order_id} refused, yet 2 of sku-p are available now");
            }
            _ => panic!("unexpected answer {} {}", reply.status, reply.text),
        }
        b_sold += b_taken;
        p_sold += p_taken;
    }
    assert_counts(&b.0, 100 - b_sold, 0, b_sold, 100);
    assert_counts(&p, 100 - p_sold, 0, p_sold, 100);
    shop.assert_reconciliation_clean(2).await;
}

/// Proves the same across processes (the database decides, not in-process locks): three
/// servers on one database, each with its rebalancer running every 50 ms, 48 clients spread
/// over them with 6 orders of 2 or 3 units each on 200 in 8 buckets. Every answer is 201 or
/// `409 insufficient` (no 5xx from buckets moving under another process), the successes sum
/// to the consumed total, the available left is below the smallest refused quantity, every
/// process reads the same state, and per-bucket replay and reconciliation agree.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_processes_racing_on_buckets_sell_exactly_the_total() {
    let first = spawn_app_with(AppOptions::default().toml("[buckets]\nrebalance_interval_ms = 50")).await;
    let shop = first.create_tenant("shop").await;
    let apps = [first.spawn_sibling().await, first.spawn_sibling().await, first];
    let shops: Vec<TenantClient> = apps.iter().map(|app| app.tenant_with_key(&shop.id, &shop.api_key)).collect();
    create_bucketed(&shops[0], "sku-mp", 200, 8).await;

    let barrier = Arc::new(Barrier::new(48));
    let clients = (0..48).map(|client| {
        let shop = shops[client % shops.len()].clone();
        let barrier = barrier.clone();
        tokio::spawn(async move {
            barrier.wait().await;
            let mut replies = Vec::new();
            for n in 0..6 {
                let qty = 2 + ((client / 3 + n) % 2) as i64;
                let key = format!("c{client}-o{n}");
                replies.push((qty, shop.order(&key, &deduct(&key, &[("sku-mp", qty)])).await));
            }
            replies
        })
    });
    let replies: Vec<(i64, Reply)> =
        join_all(clients).await.into_iter().flat_map(|r| r.expect("client task does not panic")).collect();

    let mut sold = 0;
    let mut refused: Vec<i64> = Vec::new();
    for (qty, reply) in &replies {
        match reply.status() {
            201 => sold += qty,
            409 => {
                assert_rejected_insufficient(reply);
                refused.push(*qty);
            }
            _ => panic!("unexpected answer {} {}", reply.status, reply.text),
        }
    }
    let smallest_refused = *refused.iter().min().expect("demand (720) exceeds the stock (200)");

    let (state, entries, _) = assert_buckets_consistent(&shops[1], "sku-mp").await;
    assert_counts(&state, 200 - sold, 0, sold, 200);
    assert!(int(&state, "available") < smallest_refused, "an order of {smallest_refused} was refused: {state}");
    assert_eq!(entries_with_op(&entries, "deduct").iter().map(|e| int(e, "qty")).sum::<i64>(), sold);
    for shop in &shops {
        assert_eq!(Counts::of(&shop.state("sku-mp").await), Counts::of(&state), "every process reads the same");
    }
    shops[2].assert_reconciliation_clean(1).await;
}

/// Proves concurrent holds take across buckets and settle per bucket: 60 in 8 buckets
/// (8,8,8,8,7,7,7,7), 20 clients race to hold 3 each. Holds of 3 leave 2 or 1 behind in every
/// bucket, so the last holds must combine buckets; all 20 succeed (the demand equals the total)
/// and, with all of them held, the resource is 0 available, 60 reserved. Then half confirm and
/// half release, concurrently: each reservation's confirm or release entries equal its reserve
/// entries bucket by bucket, and the end is 30 consumed, 30 available, per-bucket replay equal
/// to `bucket_counts`, reconciliation clean. Settles that met in one group commit were decided
/// together by batch admission.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_holds_take_across_buckets_and_settle_where_they_came_from() {
    const CLIENTS: usize = 20;
    let app = spawn_app_with(quiet()).await;
    let shop = app.create_tenant("shop").await;
    create_bucketed(&shop, "sku-c", 60, 8).await;

    // Clients reserve together, wait (with the test) until all have answered, then settle.
    let start = Arc::new(Barrier::new(CLIENTS));
    let all_held = Arc::new(Barrier::new(CLIENTS + 1));
    let settle = Arc::new(Barrier::new(CLIENTS + 1));
    let clients = (0..CLIENTS).map(|client| {
        let shop = shop.clone();
        let (start, all_held, settle) = (start.clone(), all_held.clone(), settle.clone());
        tokio::spawn(async move {
            start.wait().await;
            let order_id = format!("H-{client}");
            let body = reserve(&order_id, &[("sku-c", 3)], Some(600));
            // Never panic before the barriers (not even on a transport error): the others
            // would wait forever.
            let reply = try_send(shop.keyed("/v1/orders", &order_id, &body)).await;
            all_held.wait().await;
            settle.wait().await;
            let reply = reply.unwrap_or_else(|e| panic!("{order_id}: request failed: {e}"));
            let id = reply.json()["reservation_id"].as_str().map(str::to_owned);
            let confirm = client % 2 == 0;
            let settled = match &id {
                Some(id) if confirm => Some(shop.confirm(id).await),
                Some(id) => Some(shop.release(id).await),
                None => None,
            };
            (reply, id, confirm, settled)
        })
    });
    let clients: Vec<_> = clients.collect();
    all_held.wait().await;
    let held = shop.state("sku-c").await;
    settle.wait().await;
    let results = join_all(clients).await;

    let mut settled_ids = Vec::new();
    for result in results {
        let (reply, id, confirm, settled) = result.expect("client task does not panic");
        let doc = reply.expect_json(201);
        assert_eq!(doc["lines"][0]["applied"], 3, "{doc}");
        let id = id.unwrap_or_else(|| panic!("a held reservation has an id: {doc}"));
        let expected = if confirm { "confirmed" } else { "released" };
        assert_eq!(settled.expect("settled").expect_json(200)["state"], expected);
        settled_ids.push((id, confirm));
    }
    assert_counts(&held, 0, 60, 0, 60);
    assert_eq!(bucket_counts(&held), fresh(60, 8).into_iter().map(|(s, _, _)| (0, s, 0)).collect::<Vec<_>>());

    let (state, entries, _) = assert_buckets_consistent(&shop, "sku-c").await;
    assert_counts(&state, 30, 0, 30, 60);
    let mut spanning = 0;
    for (id, confirm) in &settled_ids {
        let reserved = per_bucket(&entries, "reserve", |e| e["reservation_id"] == id.as_str());
        assert_eq!(reserved.values().sum::<i64>(), 3, "{id}");
        spanning += usize::from(reserved.len() > 1);
        let (op, other) = if *confirm { ("confirm", "release") } else { ("release", "confirm") };
        assert_eq!(per_bucket(&entries, op, |e| e["reservation_id"] == id.as_str()), reserved, "{id}");
        assert!(per_bucket(&entries, other, |e| e["reservation_id"] == id.as_str()).is_empty(), "{id}");
    }
    assert!(spanning >= 1, "the leftovers (2 or 1 per bucket) can only be held by combining buckets");
    shop.assert_reconciliation_clean(1).await;
    let moved = metric(&app, "stockd_moves_admitted_in_batch_total", &[]).await;
    assert!(moved > 0.0, "no confirm or release of 20 on a bucketed resource was decided by batch admission");
    let logs = app.logs();
    assert!(!logs.contains("batch admission failed"), "batch admission failed:\n{logs}");
}

// ---------------------------------------------------------------------------------------------
// Reconciliation
// ---------------------------------------------------------------------------------------------

/// Proves reconciliation judges each bucket against its own ledger. The one white-box step:
/// a unit is moved from bucket 1's row to bucket 0's row directly in the database (table
/// `resource_buckets` of the migrations), so the resource's totals, and the sum of its ledger,
/// still agree: only a per-bucket check can see it. Reconciliation then reports drift for
/// exactly buckets 0 and 1 of that resource, and none for an untouched bucketed resource.
#[tokio::test]
async fn reconciliation_notices_a_bucket_row_that_disagrees_with_its_ledger() {
    let app = spawn_app_with(quiet()).await;
    let shop = app.create_tenant("shop").await;
    create_bucketed(&shop, "sku-d", 40, 4).await;
    create_bucketed(&shop, "sku-ok", 40, 4).await;
    place(&shop, &deduct("D-1", &[("sku-d", 5), ("sku-ok", 5)])).await.expect_json(201);
    shop.assert_reconciliation_clean(2).await;
    let before = shop.state("sku-d").await;

    tamper(
        app.database_url(),
        &[
            "UPDATE resource_buckets SET available = available + 1, total = total + 1
             WHERE resource_key = 'sku-d' AND bucket = 0",
            "UPDATE resource_buckets SET available = available - 1, total = total - 1
             WHERE resource_key = 'sku-d' AND bucket = 1",
        ],
    )
    .await;
    let after = shop.state("sku-d").await;
    assert_eq!(Counts::of(&after), Counts::of(&before), "the totals still agree");
    let (was, now) = (bucket_counts(&before), bucket_counts(&after));
    assert_eq!((now[0].0 - was[0].0, now[1].0 - was[1].0), (1, -1), "the tampering took effect: {after}");

    let report = shop.get("/v1/reconciliation").await.expect_json(200);
    assert_eq!(report["checked"], 2, "{report}");
    let drift = report["drift"].as_array().unwrap_or_else(|| panic!("drift is an array: {report}"));
    assert!(drift.iter().all(|d| d["key"] == "sku-d"), "only the tampered resource drifted: {report}");
    let buckets: BTreeSet<i64> = drift.iter().filter_map(|d| d["bucket"].as_i64()).collect();
    assert_eq!(buckets, BTreeSet::from([0, 1]), "the report names the two tampered buckets: {report}");
}

// ---------------------------------------------------------------------------------------------
// Tenant isolation
// ---------------------------------------------------------------------------------------------

/// What a status and body look like for comparison (headers such as dates may differ).
fn shape(reply: &Reply) -> (u16, String, String) {
    (reply.status(), reply.content_type().to_owned(), reply.text.clone())
}

/// Proves another tenant's bucketed resource answers exactly like a missing one: GET, ledger,
/// PATCH (status and buckets) and a write-off give tenant B the same status and body before and
/// after A created `sku-1` with 4 buckets; B's orders naming it are `resource_not_found`; A's
/// resource is untouched.
#[tokio::test]
async fn another_tenants_bucketed_resource_looks_missing() {
    let app = spawn_app_with(quiet()).await;
    let a = app.create_tenant("tenant-a").await;
    let b = app.create_tenant("tenant-b").await;

    async fn probe(b: &TenantClient, round: &str) -> Vec<(u16, String, String)> {
        vec![
            shape(&b.get("/v1/resources/sku-1").await),
            shape(&b.get("/v1/resources/sku-1/ledger").await),
            shape(&b.patch("/v1/resources/sku-1", &json!({"status": "inactive"})).await),
            shape(&b.patch("/v1/resources/sku-1", &json!({"buckets": 2})).await),
            shape(&b.adjust("sku-1", &format!("adj-{round}"), -5).await),
        ]
    }
    let missing = probe(&b, "before").await;
    assert_problem(&b.get("/v1/resources/sku-1").await, 404, "resource_not_found");
    let created = create_bucketed(&a, "sku-1", 10, 4).await;
    assert_eq!(probe(&b, "after").await, missing);

    for action in ["deduct", "reserve"] {
        let body = json!({"order_id": "B-1", "action": action, "lines": [{"key": "sku-1", "qty": 1}]});
        let doc = place(&b, &body).await.expect_json(409);
        assert_eq!(doc["lines"][0]["reason"], "resource_not_found", "{doc}");
    }
    assert_eq!(a.state("sku-1").await, created, "B changed nothing");
    assert_eq!(b.get("/v1/resources").await.expect_json(200)["items"], json!([]));
    a.assert_reconciliation_clean(1).await;
    b.assert_reconciliation_clean(0).await;
}

//! A run of settlements leaves every backend as its records settled one by one leave it: the
//! same answers, resource, ledger, events, stored answers and settlement failures. The property
//! test `apply::settlement_tests` covers the decisions on SQLite; this covers each backend's
//! statements for a run (PostgreSQL claims the run's request ids and stores its answers in one
//! statement each, where a request id or key twice, or one settled before, must come out as the
//! per-record path has it).

use std::sync::Arc;

use crate::bench::server::FreshDatabase;
use crate::bench::Backend;
use crate::config::Config;
use crate::engine::{IdempotencyKey, Kind, ResourceKey, TenantId};
use crate::storage::redis_store::{SettleRecord, Settled};
use crate::storage::{IdempotencyRequest, Idempotent, NewApiKey, NewResource, PageFrom, Storage};

const START_MS: i64 = 1_700_000_000_000;

/// A deduction record of `order` (its idempotency key `k<order>`) for `qty`, request id `rid`.
fn record(tenant: &str, rid: &str, order: u32, qty: i64, limit: Option<&str>) -> SettleRecord {
    SettleRecord {
        t: tenant.into(),
        k: "a".into(),
        q: qty,
        rid: rid.into(),
        oid: format!("o{order}"),
        idem: format!("k{order}"),
        h: format!("h{order}"),
        body: format!(r#"{{"order_id":"o{order}","status":"succeeded"}}"#),
        lim: limit.map(str::to_string),
        lk: Some("a".into()),
        pv: 1,
        at: START_MS,
        ..SettleRecord::default()
    }
}

/// The reads of the scenario, in stream order. Stock 10, low-stock threshold 3.
fn reads(tenant: &str) -> Vec<Vec<SettleRecord>> {
    let r = |rid, order, qty, limit| record(tenant, rid, order, qty, limit);
    vec![
        // Another line of order 2 settles first: its answer is stored before the run.
        vec![r("r6", 2, 1, None)],
        vec![
            r("r1", 1, 3, None),
            r("r2", 2, 2, Some("user0")), // answer stored before: no event of its own
            r("r1", 1, 3, None),          // redelivered within the read
            r("r6", 2, 1, None),          // settled in the read before
            r("r3", 1, 2, Some("user0")), // a second line of order 1: its answer is the first's
            r("r4", 3, 3, None),          // 2 left: refused
            r("r5", 4, 2, None),          // sold out, passing low stock
        ],
        vec![r("r4", 3, 3, None), r("r7", 5, 1, None)],
    ]
}

/// What a storage holds after the scenario, as text to compare.
async fn dump(storage: &dyn Storage, tenant: &TenantId) -> Vec<String> {
    let key = ResourceKey::parse("a".to_string()).expect("a valid key");
    let mut out = Vec::new();
    let resource = storage.get_resource(tenant, &key).await.expect("the resource").expect("a resource");
    out.push(format!(
        "resource {} {} {} {} v{}",
        resource.available, resource.reserved, resource.consumed, resource.total, resource.version
    ));
    for e in storage.ledger_page(tenant, &key, PageFrom::After(0), 100).await.expect("the ledger").unwrap_or_default() {
        out.push(format!(
            "ledger {} {} {} {:?} {} {} {} {:?}",
            e.op.as_str(),
            e.qty,
            e.request_id,
            e.order_id,
            e.available_after,
            e.reserved_after,
            e.consumed_after,
            e.plugin_version
        ));
    }
    for e in storage.events_page(tenant, PageFrom::After(0), &[], 100).await.expect("the events") {
        out.push(format!("event {} {} {} {}", e.seq, e.kind, e.ordering_key, e.data));
    }
    for order in 1..=5 {
        let idem = IdempotencyRequest {
            key: IdempotencyKey::parse(format!("k{order}")).expect("a valid key"),
            request_hash: format!("h{order}"),
        };
        let stored = match storage.stored_outcome(tenant, &idem).await.expect("a stored outcome") {
            Some(Idempotent::Replayed(r)) => format!("{} {}", r.status, r.body),
            other => format!("{other:?}"),
        };
        out.push(format!("answer k{order}: {stored}"));
    }
    for f in storage.settlement_failures(tenant, 100).await.expect("the failures") {
        out.push(format!("failure {} {} {} {} {}", f.request_id, f.order_id, f.qty, f.reason, f.available));
    }
    out
}

/// The storage at `url`, with tenant `t-<name>` and its resource `a` of 10 created.
async fn open_with_resource(url: &str, name: &str, low_stock: Option<i64>) -> (Arc<dyn Storage>, TenantId) {
    let mut config = Config::default();
    config.database.url = url.to_string();
    let storage: Arc<dyn Storage> = crate::startup::open_storage(&config).await.expect("the storage opens");
    let tenant = TenantId::parse(format!("t-{name}")).expect("a valid tenant");
    let key = NewApiKey { id: format!("key_{name}"), hash: "00".repeat(32) };
    storage.create_tenant(&tenant, name, None, &key, START_MS).await.expect("a tenant");
    let resource = NewResource {
        key: ResourceKey::parse("a".to_string()).expect("a valid key"),
        kind: Kind::Inventory,
        total: 10,
        buckets: 1,
        low_stock,
    };
    storage.create_resource(&tenant, &resource, START_MS).await.expect("a resource").expect("created");
    (storage, tenant)
}

/// Runs `test` on a fresh database of `backend` (a SQLite file named `name` in `dir`), against
/// the servers the test environment names.
async fn on_fresh<T, F, Fut>(backend: Backend, dir: &std::path::Path, name: &str, test: F) -> T
where
    F: FnOnce(String) -> Fut,
    Fut: std::future::Future<Output = T>,
{
    if backend == Backend::Sqlite {
        return test(format!("sqlite://{}", dir.join(format!("{name}.sqlite")).display())).await;
    }
    let admin = if backend == Backend::Postgres {
        std::env::var("STOCKD_TEST_PG_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
    } else {
        std::env::var("STOCKD_TEST_MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/mysql".into())
    };
    let fresh = FreshDatabase::create(backend, &admin)
        .await
        .unwrap_or_else(|e| panic!("{admin} must answer for this test: {e:#}"));
    let outcome = test(fresh.url.clone()).await;
    fresh.drop_database().await;
    outcome
}

/// Runs the scenario on a fresh storage at `url`: each record on its own (`alone`), or each
/// read as one run. Returns every answer and the dump.
async fn scenario(url: &str, alone: bool) -> (Vec<Settled>, Vec<String>) {
    let (storage, tenant) = open_with_resource(url, "settle", Some(3)).await;
    let mut answers = Vec::new();
    for (i, read) in reads(tenant.as_str()).into_iter().enumerate() {
        let now = START_MS + 1_000 * (i as i64 + 1);
        if alone {
            for r in &read {
                answers.push(storage.settle(r, now).await.expect("a record settles"));
            }
        } else {
            answers.extend(storage.settle_run(read, now).await.expect("a run settles"));
        }
    }
    let dumped = dump(storage.as_ref(), &tenant).await;
    storage.close().await;
    (answers, dumped)
}

/// Every backend, against the databases the test environment names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_settles_on_every_backend_as_its_records_do_one_by_one() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    for backend in [Backend::Sqlite, Backend::Postgres, Backend::Mysql] {
        let mut results = Vec::new();
        for alone in [true, false] {
            let name = format!("settle-{alone}");
            results.push(on_fresh(backend, dir.path(), &name, |url| async move { scenario(&url, alone).await }).await);
        }
        let (one_by_one, run) = (&results[0], &results[1]);
        assert_eq!(one_by_one.0, run.0, "{backend:?}: the answers differ");
        assert_eq!(one_by_one.1, run.1, "{backend:?}: what the database holds differs");
        use Settled::{Applied, Duplicate, Refused};
        let expected = [Applied, Applied, Applied, Duplicate, Duplicate, Applied, Refused, Applied, Duplicate, Refused];
        assert_eq!(run.0, expected, "{backend:?}: the answers");
    }
}

/// A reservation made in Redis: its reserve settled, then its row expired by the database's
/// sweeper, then the release Redis made just before the deadline settles. Both gave the same
/// stock back: the release is a duplicate of the expiry, not a settlement failure (there is
/// nothing to compensate). A confirm that late is refused (Redis consumed stock the database
/// gave back). Returns the two answers and what the database holds.
async fn late_moves(url: &str) -> (Vec<Settled>, Vec<String>) {
    let (storage, tenant) = open_with_resource(url, "late", None).await;
    let deadline = START_MS + 1_000;
    let reserve = |order: u32, rsv: &str, qty: i64| SettleRecord {
        op: Some("reserve".into()),
        rsv: Some(rsv.into()),
        exp: Some(deadline),
        lines: Some(format!(r#"[{{"key":"a","resource":"a","qty":{qty}}}]"#)),
        ..record(tenant.as_str(), &format!("take-{rsv}"), order, qty, None)
    };
    let moved = |rsv: &str, op: &str| SettleRecord {
        q: 0,
        rid: format!("{rsv}:{op}"),
        idem: String::new(),
        h: String::new(),
        body: String::new(),
        op: Some(op.into()),
        rsv: Some(rsv.into()),
        ..record(tenant.as_str(), "", 1, 0, None)
    };
    for (order, rsv, qty) in [(1, "rsv_1", 2), (2, "rsv_2", 3)] {
        let settled = storage.settle(&reserve(order, rsv, qty), START_MS + 10).await.expect("a reserve settles");
        assert_eq!(settled, Settled::Applied);
    }
    assert_eq!(storage.expire_due(deadline + 5, 10).await.expect("the sweep"), 2);
    let mut answers = Vec::new();
    for (rsv, op) in [("rsv_1", "release"), ("rsv_2", "confirm")] {
        answers.push(storage.settle(&moved(rsv, op), deadline + 10).await.expect("a move settles"));
    }
    let mut held = dump(storage.as_ref(), &tenant).await;
    held.retain(|line| !line.starts_with("event") && !line.starts_with("answer"));
    storage.close().await;
    (answers, held)
}

/// [`late_moves`] on every backend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_settled_after_the_sweeper_expired_its_reservation_is_the_expirys_duplicate() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    for backend in [Backend::Sqlite, Backend::Postgres, Backend::Mysql] {
        let (answers, held) = on_fresh(backend, dir.path(), "late", |url| async move { late_moves(&url).await }).await;
        assert_eq!(answers, [Settled::Duplicate, Settled::Refused], "{backend:?}: {held:#?}");
        let failures: Vec<&String> = held.iter().filter(|l| l.starts_with("failure")).collect();
        assert_eq!(failures.len(), 1, "{backend:?}: only the confirm failed: {held:#?}");
        assert!(failures[0].contains("reservation_expired"), "{backend:?}: {held:#?}");
        assert!(held[0].starts_with("resource 10 0 0 10 "), "{backend:?}: the stock is all back, once: {held:#?}");
        let moves = held.iter().filter(|l| l.starts_with("ledger expire")).count();
        assert_eq!(moves, 2, "{backend:?}: one expire each, nothing else moved: {held:#?}");
        assert!(!held.iter().any(|l| l.starts_with("ledger release") || l.starts_with("ledger confirm")), "{held:#?}");
    }
}

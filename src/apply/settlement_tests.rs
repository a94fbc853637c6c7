//! Settling a run of deductions as one write and settling each record on its own agree: a
//! property test over real SQLite.
//!
//! Two fresh databases, migrated with every `migrations/sqlite/*.sql`, get the same tenant and
//! (or not) the same resource, single-row or bucketed, with or without a low-stock threshold.
//! Then the same random reads of a stream arrive: records drawn from small pools of request ids
//! (a request id seen again is a redelivery), orders and idempotency keys (a key seen again is
//! another line of an order whose answer is stored), per-user limits and quantities (enough to
//! run the stock out, so some are refused). On database A each record is settled on its own by
//! [`settlement::settle`], each in its own savepoint; on database B each read is settled by
//! [`settlement::settle_run`] in one savepoint, as the writer runs one submitted job.
//!
//! Each record must settle alike on both (applied, duplicate, refused), and after every read both
//! must hold the same resource row (stock band included); at the end, the same ledger (in `seq`
//! order), events (in sequence order), idempotency records (the answer as a replay reads it, and
//! where it is kept), per-user limits, settlement claims and settlement failures.

use std::cell::Cell;

use proptest::prelude::*;
use proptest::test_runner::{TestCaseError, TestRunner};
use rusqlite::params;

use super::port::run_now;
use super::resources;
use super::settlement;
use super::tests::{in_savepoint, property_config, same_rows, Db, EVENTS, IDEMPOTENCY, LEDGER, RESOURCES, USER_LIMITS};
use crate::engine::{Kind, ResourceKey, TenantId};
use crate::storage::redis_store::{SettleRecord, Settled};
use crate::storage::NewResource;

const TENANT: &str = "t0";
const KEY: &str = "a";
const START_MS: i64 = 1_700_000_000_000;
const SETTLED: &str = "SELECT tenant_id, resource_key, request_id, at FROM redis_settled ORDER BY 1, 2, 3";
const FAILURES: &str = "SELECT tenant_id, resource_key, request_id, order_id, idempotency_key, qty, reason, available,
        at, reservation_id FROM settlement_failures ORDER BY 1, 2, 3";

#[derive(Debug, Clone)]
struct Resource {
    total: i64,
    buckets: i64,
    low_stock: Option<i64>,
}

#[derive(Debug, Clone)]
struct RecordSpec {
    rid: usize,
    order: usize,
    qty: i64,
    limit: Option<usize>,
}

#[derive(Debug, Clone)]
struct Scenario {
    resource: Option<Resource>,
    reads: Vec<Vec<RecordSpec>>,
}

fn scenario() -> impl Strategy<Value = Scenario> {
    let resource = (0i64..40, prop_oneof![9 => Just(1i64), 1 => Just(2i64)], proptest::option::of(0i64..12))
        .prop_map(|(total, buckets, low_stock)| Resource { total, buckets, low_stock });
    let record = (0usize..24, 0usize..8, 1i64..6, proptest::option::of(0usize..2))
        .prop_map(|(rid, order, qty, limit)| RecordSpec { rid, order, qty, limit });
    let reads = proptest::collection::vec(proptest::collection::vec(record, 1..10), 1..8);
    (proptest::option::weighted(0.9, resource), reads).prop_map(|(resource, reads)| Scenario { resource, reads })
}

/// The record Redis would have written for this spec, the `n`th of the scenario.
fn record(spec: &RecordSpec, n: usize) -> SettleRecord {
    let order = format!("o{}", spec.order);
    SettleRecord {
        t: TENANT.into(),
        k: KEY.into(),
        q: spec.qty,
        rid: format!("r{}", spec.rid),
        oid: order.clone(),
        idem: format!("k{}", spec.order),
        h: format!("h{}", spec.order),
        body: format!(r#"{{"order_id":"{order}","status":"succeeded","n":{n}}}"#),
        lim: spec.limit.map(|l| format!("user{l}")),
        lk: Some(format!("line{}", spec.rid % 3)),
        pv: 3,
        at: START_MS + n as i64,
        ..SettleRecord::default()
    }
}

fn setup(db: &Db, resource: Option<&Resource>) {
    db.commit(|conn| {
        conn.execute("INSERT INTO tenants (id, name, created_at) VALUES (?1, ?1, ?2)", params![TENANT, START_MS])
            .expect("insert a tenant");
        let Some(resource) = resource else { return };
        let new = NewResource {
            key: ResourceKey::parse(KEY.to_string()).expect("a valid key"),
            kind: Kind::Inventory,
            total: resource.total,
            buckets: resource.buckets,
            low_stock: resource.low_stock,
        };
        let tenant = TenantId::parse(TENANT.to_string()).expect("a valid tenant");
        let mut port = crate::storage::sqlite::port::SqlitePort::new(conn);
        let created = run_now(resources::create(&mut port, &tenant, &new, None, START_MS));
        assert!(matches!(created, Ok(Some(_))), "creating the resource: {created:?}");
    });
}

/// How often each outcome came up over every case; the test fails if one never did.
#[derive(Default)]
struct Stats {
    applied: Cell<usize>,
    duplicate: Cell<usize>,
    refused: Cell<usize>,
    /// Runs of two or more records on a single-row resource (the batched path proper).
    runs: Cell<usize>,
}

fn bump(cell: &Cell<usize>) {
    cell.set(cell.get() + 1);
}

fn run(scenario: &Scenario, stats: &Stats) -> Result<(), TestCaseError> {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let (mut a, mut b) = (Db::open(&dir.path().join("a.db")), Db::open(&dir.path().join("b.db")));
    setup(&a, scenario.resource.as_ref());
    setup(&b, scenario.resource.as_ref());
    let mut n = 0;
    for (r, read) in scenario.reads.iter().enumerate() {
        let now_ms = START_MS + 1_000 * (r as i64 + 1);
        let records: Vec<SettleRecord> = read
            .iter()
            .map(|spec| {
                n += 1;
                record(spec, n)
            })
            .collect();
        let alone: Vec<Settled> = a.commit(|conn| {
            records
                .iter()
                .map(|rec| {
                    in_savepoint(conn, |conn| {
                        let mut port = crate::storage::sqlite::port::SqlitePort::new(conn);
                        run_now(settlement::settle(&mut port, rec, now_ms))
                    })
                    .expect("settling a record on its own")
                })
                .collect()
        });
        let together = b
            .work(|conn| {
                let mut port = crate::storage::sqlite::port::SqlitePort::new(conn);
                run_now(settlement::settle_run(&mut port, &records, now_ms))
            })
            .expect("settling the read as one run");
        prop_assert_eq!(&alone, &together, "read {} settled differently", r);
        for s in &alone {
            match s {
                Settled::Applied => bump(&stats.applied),
                Settled::Duplicate => bump(&stats.duplicate),
                Settled::Refused => bump(&stats.refused),
                Settled::Answered => {}
            }
        }
        if records.len() > 1 && scenario.resource.as_ref().is_some_and(|r| r.buckets == 1) {
            bump(&stats.runs);
        }
        same_rows(&format!("resources after read {r}"), &a.rows(RESOURCES), &b.rows(RESOURCES))?;
    }
    same_rows("ledger rows", &a.rows(LEDGER), &b.rows(LEDGER))?;
    same_rows("events", &a.rows(EVENTS), &b.rows(EVENTS))?;
    same_rows("idempotency records", &a.rows(IDEMPOTENCY), &b.rows(IDEMPOTENCY))?;
    same_rows("user limits", &a.rows(USER_LIMITS), &b.rows(USER_LIMITS))?;
    same_rows("settlement claims", &a.rows(SETTLED), &b.rows(SETTLED))?;
    same_rows("settlement failures", &a.rows(FAILURES), &b.rows(FAILURES))
}

/// Proves that settling a read's deductions as one run ([`settlement::settle_run`]) and each on
/// its own ([`settlement::settle`]) give the same answers and the same rows, for random reads
/// with redeliveries, several lines of one order, per-user limits, stock running out, stock
/// bands crossed, a bucketed resource and a missing one. `PROPTEST_CASES` sets the number of
/// cases (default 64).
#[test]
fn a_run_settles_as_its_records_settle_one_by_one() {
    let config = property_config(file!(), "apply::settlement_tests::a_run_settles_as_its_records_settle_one_by_one");
    let cases = config.cases;
    let stats = Stats::default();
    let mut runner = TestRunner::new(config);
    if let Err(failure) = runner.run(&scenario(), |scenario| run(&scenario, &stats)) {
        panic!("{failure}");
    }
    eprintln!(
        "{cases} cases: {} applied, {} duplicates, {} refused; {} runs of two or more",
        stats.applied.get(),
        stats.duplicate.get(),
        stats.refused.get(),
        stats.runs.get()
    );
    assert!(
        stats.applied.get() > 0 && stats.duplicate.get() > 0 && stats.refused.get() > 0 && stats.runs.get() > 0,
        "the scenarios did not exercise every outcome of a run"
    );
}

//! PostgreSQL's plans for the batch's statements as the tables grow.
//!
//! PostgreSQL plans a prepared statement for its arguments five times, then may settle on a
//! generic plan, which it keeps until the table's statistics change (ANALYZE: autovacuum, when
//! it runs, and only once enough rows changed). A generic plan chosen while a fresh database's
//! tables are nearly empty joins the batch's arrays to the table by reading it whole, cheap
//! then; as the table grows every batch goes on reading it whole. Such a server got slower the
//! longer it ran: after 30,000 orders, each batch read all of `idempotency` and `resources`.
//! These tests run on PostgreSQL whatever the suite's backend: the behaviour is its own.

use std::time::Duration;

use sqlx::{Connection, PgConnection};

use crate::helpers::{deduct, reserve, spawn_app_on, AppOptions, Backend, TenantClient, TestApp};

const DEADLINE: Duration = Duration::from_secs(60);

/// Rows each table gets behind the server's back: one whole read of it is this many tuples.
const GROWN: i64 = 20_000;

/// The counters of `table` in `pg_stat_user_tables`: (rows read by sequential scans, rows
/// inserted, rows updated).
async fn counters(conn: &mut PgConnection, table: &str) -> (i64, i64, i64) {
    sqlx::query_as("SELECT COALESCE(seq_tup_read, 0), n_tup_ins, n_tup_upd FROM pg_stat_user_tables WHERE relname = $1")
        .bind(table)
        .fetch_one(conn)
        .await
        .unwrap_or_else(|e| panic!("pg_stat_user_tables of {table}: {e}"))
}

/// Waits until every backend's statistics of the tables are in `pg_stat_user_tables` (backends
/// report them at most once a second, when idle): every row of `idempotency` and `reservations`
/// counted as inserted, and `resources` updated at least `updates` times. Returns each table's
/// rows read by sequential scans.
async fn settled_scans(app: &TestApp, updates: i64) -> [(&'static str, i64); 3] {
    let mut conn = PgConnection::connect(app.database_url()).await.expect("PostgreSQL answers");
    // This connection counts rows by the primary keys, so its own reads are no sequential scans.
    sqlx::query("SET enable_seqscan = off").execute(&mut conn).await.expect("a session setting");
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let (idem_read, idem_ins, _) = counters(&mut conn, "idempotency").await;
        let (res_read, _, res_upd) = counters(&mut conn, "resources").await;
        let (rsv_read, rsv_ins, _) = counters(&mut conn, "reservations").await;
        let (idem_rows, rsv_rows): (i64, i64) =
            sqlx::query_as("SELECT (SELECT COUNT(*) FROM idempotency), (SELECT COUNT(*) FROM reservations)")
                .fetch_one(&mut conn)
                .await
                .expect("counting rows");
        if idem_ins >= idem_rows && rsv_ins >= rsv_rows && res_upd >= updates {
            let _ = conn.close().await;
            return [("idempotency", idem_read), ("resources", res_read), ("reservations", rsv_read)];
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "PostgreSQL's statistics never caught up: idempotency {idem_ins}/{idem_rows} inserts, \
             reservations {rsv_ins}/{rsv_rows}, resources {res_upd}/{updates} updates"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `n` rounds, one after another (so each is a batch of its own): a deduct, and a reservation
/// that is then confirmed. Returns how many resource updates they made.
async fn rounds(shop: &TenantClient, tag: &str, n: usize) -> i64 {
    for i in 0..n {
        let key = format!("sku-{}", i % 4);
        let reply = shop.order(&format!("{tag}-d-{i}"), &deduct(&format!("{tag}-D{i}"), &[(&key, 1)])).await;
        assert_eq!(reply.status(), 201, "{}", reply.text);
        let reply = shop.order(&format!("{tag}-r-{i}"), &reserve(&format!("{tag}-R{i}"), &[(&key, 1)], None)).await;
        assert_eq!(reply.status(), 201, "{}", reply.text);
        let id = reply.json()["reservation_id"].as_str().expect("a reservation id").to_owned();
        let reply = shop.confirm(&id).await;
        assert_eq!(reply.status(), 200, "{}", reply.text);
    }
    3 * n as i64
}

/// Orders and confirms on nearly empty tables, then the tables grow (as a busy shop's do between
/// two runs of autovacuum, or forever where it is off), then more of them: the later batches,
/// and the jobs that ran meanwhile (the idempotency purge, the buckets' rebalance, reservation
/// expiry), look rows up by key rather than read the grown tables.
#[tokio::test]
async fn batches_look_rows_up_by_key_however_the_tables_grew_since_they_were_planned() {
    let app = spawn_app_on(Backend::Postgres, AppOptions::default()).await;
    let shop = app.create_tenant("shop").await;
    for i in 0..4 {
        shop.create_resource(&format!("sku-{i}"), 1_000_000).await;
    }
    let mut updates = rounds(&shop, "early", 20).await;

    // Copies of the shop's own rows under new keys, written by a connection of the test's.
    let mut conn = PgConnection::connect(app.database_url()).await.expect("PostgreSQL answers");
    for sql in [
        format!(
            "INSERT INTO resources SELECT (jsonb_populate_record(NULL::resources,
                 to_jsonb(r) || jsonb_build_object('key', 'grown-' || g))).*
             FROM resources r, generate_series(1, {GROWN}) g WHERE r.tenant_id = 'shop' AND r.key = 'sku-0'"
        ),
        format!(
            "INSERT INTO idempotency SELECT (jsonb_populate_record(NULL::idempotency,
                 to_jsonb(i) || jsonb_build_object('key', 'grown-' || g))).*
             FROM (SELECT * FROM idempotency WHERE tenant_id = 'shop' LIMIT 1) i, generate_series(1, {GROWN}) g"
        ),
        format!(
            "INSERT INTO reservations SELECT (jsonb_populate_record(NULL::reservations,
                 to_jsonb(r) || jsonb_build_object('id', 'rsv_grown' || g))).*
             FROM (SELECT * FROM reservations WHERE tenant_id = 'shop' LIMIT 1) r, generate_series(1, {GROWN}) g"
        ),
    ] {
        sqlx::query(&sql).execute(&mut conn).await.unwrap_or_else(|e| panic!("{sql}: {e}"));
    }
    // A backend reports its statistics when it ends.
    conn.close().await.expect("the test's connection closes");

    let before = settled_scans(&app, updates).await;
    updates += rounds(&shop, "late", 20).await;
    let after = settled_scans(&app, updates).await;

    for ((table, was), (_, now)) in before.iter().zip(after.iter()) {
        assert!(
            now - was < GROWN,
            "20 rounds read {} rows of {table} by sequential scans: at least one batch read the whole table",
            now - was
        );
    }
    for i in 0..4 {
        shop.assert_ledger_replays_to_state(&format!("sku-{i}")).await;
    }
}

/// Distinct rows in one burst: batches of a few dozen of them, far past the ~16 distinct keys
/// at which PostgreSQL, costing a page read as if from disk, would join the batch's arrays to
/// the grown `resources` (`SPREAD` rows) by reading it whole.
const BURST: usize = 48;
const SPREAD: i64 = 2_000;

/// Bursts of concurrent orders, each on a key of its own among 2,000: batches of dozens of
/// distinct resources, every one of which is locked, read and written by key. Before, a batch
/// past a dozen or so keys was joined to `resources` by a hash join over a read of the whole
/// table, which the planner judged cheaper on a table of this size and which costs ~7x the
/// lookups (on 10,000 rows, 4.2 ms against 0.6 for a batch of 61): these 288 orders read
/// 28,014 rows of it.
#[tokio::test]
async fn a_batch_of_many_resources_looks_each_up_by_key() {
    let app = spawn_app_on(Backend::Postgres, AppOptions::default()).await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-0", 1_000_000).await;
    let mut conn = PgConnection::connect(app.database_url()).await.expect("PostgreSQL answers");
    let sql = format!(
        "INSERT INTO resources SELECT (jsonb_populate_record(NULL::resources,
             to_jsonb(r) || jsonb_build_object('key', 'spread-' || g))).*
         FROM resources r, generate_series(1, {SPREAD}) g WHERE r.tenant_id = 'shop' AND r.key = 'sku-0'"
    );
    sqlx::query(&sql).execute(&mut conn).await.unwrap_or_else(|e| panic!("{sql}: {e}"));
    conn.close().await.expect("the test's connection closes");

    let before = settled_scans(&app, 0).await;
    let mut updates = 0;
    for burst in 0..6 {
        let orders = (0..BURST).map(|i| {
            let shop = shop.clone();
            let key = format!("spread-{}", 1 + (burst * BURST + i) as i64 % SPREAD);
            tokio::spawn(async move {
                shop.order(&format!("b{burst}-{i}"), &deduct(&format!("B{burst}-{i}"), &[(&key, 1)])).await
            })
        });
        for reply in futures::future::join_all(orders).await {
            let reply = reply.expect("a client task does not panic");
            assert_eq!(reply.status(), 201, "{}", reply.text);
        }
        updates += BURST as i64;
    }
    let after = settled_scans(&app, updates).await;

    let (_, was) = before[1];
    let (table, now) = after[1];
    assert_eq!(table, "resources");
    assert!(
        now - was < SPREAD,
        "{} orders read {} rows of resources by sequential scans: a batch read the whole table",
        updates,
        now - was
    );
    let spent: i64 = sqlx::query_scalar("SELECT SUM(consumed)::bigint FROM resources WHERE key LIKE 'spread-%'")
        .fetch_one(&mut PgConnection::connect(app.database_url()).await.expect("PostgreSQL answers"))
        .await
        .expect("summing what was consumed");
    assert_eq!(spent, updates, "each order consumed its one unit once");
}

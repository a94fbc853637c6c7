//! PostgreSQL's plans for the batch's statements, and for an order's lookup, as the tables grow.
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

use crate::ended_sessions::{end_sessions, LOOKUPS};
use crate::helpers::{deduct, reserve, spawn_app_on, AppOptions, Backend, TenantClient, TestApp};
use crate::redis_support::{create_redis_resource, deduct_one, redis_app_on};

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

/// The ledger's counters in `pg_stat_user_tables`: (index and sequential scans begun, rows read by
/// sequential scans plus rows fetched by index scans).
async fn ledger_reads(conn: &mut PgConnection) -> (i64, i64) {
    sqlx::query_as(
        "SELECT COALESCE(seq_scan, 0) + COALESCE(idx_scan, 0), COALESCE(seq_tup_read, 0) + COALESCE(idx_tup_fetch, 0)
         FROM pg_stat_user_tables WHERE relname = 'ledger'",
    )
    .fetch_one(conn)
    .await
    .expect("pg_stat_user_tables of ledger")
}

/// An order is read through `ledger_by_order` however far the ledger grew, and whatever plan the
/// lookup settled on: since migrations/postgres/0022 the index is keyed by a hash of the tenant
/// and the order id, which only a condition naming that expression can use; any other reads the
/// tenant's whole ledger (its primary key starts with the tenant). The same order id at two
/// tenants, and one order id for three orders, read as their own entries.
#[tokio::test]
async fn an_order_lookup_reads_its_own_entries_by_index_however_the_ledger_grew() {
    // No reconciliation pass reads the ledger meanwhile: the reads counted are the lookups'.
    let app =
        spawn_app_on(Backend::Postgres, AppOptions::default().toml("[reconciliation]\ninterval_seconds = 0")).await;
    let shop = app.create_tenant("shop").await;
    let other = app.create_tenant("other").await;
    shop.create_resource("sku-1", 1_000).await;
    other.create_resource("sku-1", 1_000).await;
    shop.order("s-1", &deduct("ORD-1", &[("sku-1", 2)])).await.expect_json(201);
    other.order("o-1", &deduct("ORD-1", &[("sku-1", 5)])).await.expect_json(201);
    for i in 0..3 {
        shop.order(&format!("s-again-{i}"), &deduct("ORD-AGAIN", &[("sku-1", 1)])).await.expect_json(201);
    }

    // Entries of the shop's under other order ids, written behind the server's back.
    let mut conn = PgConnection::connect(app.database_url()).await.expect("PostgreSQL answers");
    let sql = format!(
        "INSERT INTO ledger OVERRIDING SYSTEM VALUE SELECT (jsonb_populate_record(NULL::ledger, to_jsonb(l) || jsonb_build_object(
             'resource_key', 'grown', 'seq', 1000000 + g, 'request_id', 'req_grown' || g, 'order_id', 'grown-' || g))).*
         FROM (SELECT * FROM ledger WHERE tenant_id = 'shop' AND order_id = 'ORD-1') l, generate_series(1, {GROWN}) g"
    );
    sqlx::query(&sql).execute(&mut conn).await.unwrap_or_else(|e| panic!("{sql}: {e}"));
    sqlx::query("ANALYZE ledger").execute(&mut conn).await.expect("statistics of the grown ledger");
    let (scans, read) = ledger_reads(&mut conn).await;

    // More lookups than PostgreSQL plans for their arguments before it may keep a generic plan.
    let lookups = 12;
    for round in 0..lookups / 3 {
        let deducted = |order: &serde_json::Value| order["lines"][0]["deducted"].clone();
        let mine = shop.get("/v1/orders/ORD-1").await.expect_json(200);
        assert_eq!(deducted(&mine), 2, "round {round}: {mine}");
        let theirs = other.get("/v1/orders/ORD-1").await.expect_json(200);
        assert_eq!(deducted(&theirs), 5, "round {round}: {theirs}");
        let again = shop.get("/v1/orders/ORD-AGAIN").await.expect_json(200);
        assert_eq!(deducted(&again), 3, "round {round}: {again}");
    }

    // Backends report their statistics when idle, at most once a second: wait for the lookups.
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let (scanned, fetched) = loop {
        let (now_scans, now_read) = ledger_reads(&mut conn).await;
        if now_scans - scans >= lookups {
            break (now_scans - scans, now_read - read);
        }
        assert!(tokio::time::Instant::now() < deadline, "the lookups' statistics never arrived");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(
        fetched < GROWN,
        "{scanned} scans of the ledger for {lookups} lookups read {fetched} rows: a lookup read the tenant's whole ledger"
    );
}

/// Rows of `table` read by sequential scans plus fetched by index and bitmap scans, once
/// `pg_stat_user_tables` counts at least `rows` inserted and `updates` updated (`conn` reads the
/// counters alone, never the table).
async fn reads_once_counted(conn: &mut PgConnection, table: &str, rows: i64, updates: i64) -> i64 {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let (read, inserted, updated): (i64, i64, i64) = sqlx::query_as(
            "SELECT COALESCE(seq_tup_read, 0) + COALESCE(idx_tup_fetch, 0), n_tup_ins, n_tup_upd
             FROM pg_stat_user_tables WHERE relname = $1",
        )
        .bind(table)
        .fetch_one(&mut *conn)
        .await
        .unwrap_or_else(|e| panic!("pg_stat_user_tables of {table}: {e}"));
        if inserted >= rows && updated >= updates {
            return read;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "PostgreSQL's statistics never caught up: {table} {inserted}/{rows} inserts, {updated}/{updates} updates"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Rows of `reservations` read, once `rows` are counted inserted and `updates` updated.
async fn reservation_reads(app: &TestApp, rows: i64, updates: i64) -> i64 {
    let mut conn = PgConnection::connect(app.database_url()).await.expect("PostgreSQL answers");
    let read = reads_once_counted(&mut conn, "reservations", rows, updates).await;
    let _ = conn.close().await;
    read
}

/// `n` bursts of `BURST / 4` concurrent reservations, then their confirms, all at once: most of
/// the confirms are decided together by batch admission. Returns how many were confirmed.
async fn confirm_bursts(shop: &TenantClient, tag: &str, n: usize) -> i64 {
    let per = BURST / 4;
    for burst in 0..n {
        let holds = (0..per).map(|i| {
            let shop = shop.clone();
            let key = format!("sku-{}", i % 4);
            let (idempotency_key, order) = (format!("{tag}-{burst}-{i}"), format!("{tag}-R{burst}-{i}"));
            tokio::spawn(async move { shop.order(&idempotency_key, &reserve(&order, &[(&key, 1)], None)).await })
        });
        let mut ids = Vec::new();
        for reply in futures::future::join_all(holds).await {
            let reply = reply.expect("a client task does not panic");
            assert_eq!(reply.status(), 201, "{}", reply.text);
            ids.push(reply.json()["reservation_id"].as_str().expect("a reservation id").to_owned());
        }
        let confirms = ids.into_iter().map(|id| {
            let shop = shop.clone();
            tokio::spawn(async move { shop.confirm(&id).await })
        });
        for reply in futures::future::join_all(confirms).await {
            let reply = reply.expect("a client task does not panic");
            assert_eq!(reply.status(), 200, "{}", reply.text);
        }
    }
    (n * per) as i64
}

/// Confirms decided together move each reservation by its key, however many others are held.
/// The batch's plan is made once per connection and kept (the batcher's BEGIN), here while
/// `reservations` is nearly empty; a plan that checked `state = 'held'` against a constant could
/// read every held reservation through their partial index (`reservations_due`), cheap on the
/// empty table and a whole read of the held ones at every batch later. With the state a
/// constant in the batch's statement, the 48 confirms after the growth read 100,108 rows of it.
#[tokio::test]
async fn a_batch_of_confirms_moves_its_own_reservations_however_many_are_held() {
    let app = spawn_app_on(Backend::Postgres, AppOptions::default()).await;
    let shop = app.create_tenant("shop").await;
    for i in 0..4 {
        shop.create_resource(&format!("sku-{i}"), 1_000_000).await;
    }
    let mut updates = confirm_bursts(&shop, "early", 4).await;

    // Held reservations, far from expiring, copied from one of the shop's behind the server's back.
    let mut conn = PgConnection::connect(app.database_url()).await.expect("PostgreSQL answers");
    let sql = format!(
        "INSERT INTO reservations SELECT (jsonb_populate_record(NULL::reservations,
             to_jsonb(r) || jsonb_build_object('id', 'rsv_held' || g, 'state', 'held',
                                               'expires_at', 9000000000000::bigint))).*
         FROM (SELECT * FROM reservations WHERE tenant_id = 'shop' LIMIT 1) r, generate_series(1, {GROWN}) g"
    );
    sqlx::query(&sql).execute(&mut conn).await.unwrap_or_else(|e| panic!("{sql}: {e}"));
    conn.close().await.expect("the test's connection closes");

    let before = reservation_reads(&app, updates + GROWN, updates).await;
    updates += confirm_bursts(&shop, "late", 4).await;
    let after = reservation_reads(&app, updates + GROWN, updates).await;
    assert!(
        after - before < GROWN,
        "48 reservations and their confirms read {} rows of reservations: a batch read the held ones",
        after - before
    );
}

/// Rows of `idempotency` read, once `rows` are counted inserted. With `end_lookups`, first
/// ends the server's lookup connections: they insert nothing, and a backend that is not idle
/// for long reports its counters only when it ends, before it leaves `pg_stat_activity`.
async fn record_reads(app: &TestApp, rows: i64, end_lookups: bool) -> i64 {
    if end_lookups {
        let ended = end_sessions(app, LOOKUPS).await;
        assert!(ended > 0, "no connection of the server ran the grouped lookup");
    }
    let mut conn = PgConnection::connect(app.database_url()).await.expect("PostgreSQL answers");
    let read = reads_once_counted(&mut conn, "idempotency", rows, 0).await;
    let _ = conn.close().await;
    read
}

/// `n` bursts of `BURST` concurrent sales of `sku-1`, each under a key of its own. Returns how
/// many were sold.
async fn sale_bursts(shop: &TenantClient, tag: &str, n: usize) -> i64 {
    for burst in 0..n {
        let sales = (0..BURST).map(|i| {
            let shop = shop.clone();
            let (key, order) = (format!("{tag}-{burst}-{i}"), format!("{tag}-S{burst}-{i}"));
            tokio::spawn(async move { shop.order(&key, &deduct_one(&order, "sku-1", 1, None)).await })
        });
        for reply in futures::future::join_all(sales).await {
            let reply = reply.expect("a client task does not panic");
            assert_eq!(reply.status(), 201, "{}", reply.text);
        }
    }
    (n * BURST) as i64
}

/// A sale in redis mode first reads its key's stored outcome in the database, in groups of the
/// sales waiting together, on connections of their own that keep the group statement's plan
/// (`LookupConnections`). Made on a nearly empty `idempotency`, that plan must still look each key up
/// by the primary key once the table has grown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grouped_lookups_of_redis_sales_read_their_own_keys_however_the_records_grew() {
    let app = redis_app_on(Backend::Postgres).await;
    let shop = app.create_tenant("shop").await;
    create_redis_resource(&shop, "sku-1", 1_000_000).await;
    let mut sold = sale_bursts(&shop, "early", 3).await;

    // Records of the shop copied under new keys, once settlement has stored the early sales'.
    let mut conn = PgConnection::connect(app.database_url()).await.expect("PostgreSQL answers");
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let stored: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM idempotency WHERE tenant_id = 'shop'")
            .fetch_one(&mut conn)
            .await
            .expect("counting the shop's records");
        if stored >= sold {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "settlement stored {stored} of {sold} sales' records");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let sql = format!(
        "INSERT INTO idempotency SELECT (jsonb_populate_record(NULL::idempotency,
             to_jsonb(i) || jsonb_build_object('key', 'grown-' || g))).*
         FROM (SELECT * FROM idempotency WHERE tenant_id = 'shop' LIMIT 1) i, generate_series(1, {GROWN}) g"
    );
    sqlx::query(&sql).execute(&mut conn).await.unwrap_or_else(|e| panic!("{sql}: {e}"));
    conn.close().await.expect("the test's connection closes");

    let before = record_reads(&app, sold + GROWN, false).await;
    sold += sale_bursts(&shop, "late", 3).await;
    let after = record_reads(&app, sold + GROWN, true).await;
    assert!(
        after - before < GROWN,
        "{} sales read {} rows of idempotency: a group's lookup read the grown table",
        3 * BURST,
        after - before
    );
}

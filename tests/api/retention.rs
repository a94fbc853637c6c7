//! Bounded growth: the tables that grow with every Redis sale are purged past their retention
//! by the background job, in bounded batches, and the purges are counted. The rows are written
//! straight into the test's own database with chosen ages (waiting for real rows to age would
//! take hours), then the test polls the database until the job has run. And the consumers that
//! dead processes leave in Redis's settlement groups are removed.

use std::time::Duration;

use sqlx::Connection;

use crate::helpers::{
    assert_problem, deduct, mysql_connect_ansi, spawn_app_with, AppOptions, Backend, TenantClient, TestApp,
};
use crate::redis_support::{
    create_redis_resource, deduct_one, order_through_503, redis_app, redis_conn, shared_redis_url, stream_key,
    wait_settled,
};

/// Bound on waiting for the purge job.
const DEADLINE: Duration = Duration::from_secs(30);
const HOUR_MS: i64 = 3_600_000;

/// How many rows one generated `INSERT ... VALUES` writes on MySQL.
const MYSQL_ROWS_PER_INSERT: i64 = 1000;

/// A connection to the test's database, on any backend.
pub(crate) enum Db {
    Sqlite(sqlx::SqliteConnection),
    Postgres(sqlx::PgConnection),
    Mysql(sqlx::MySqlConnection),
}

impl Db {
    pub(crate) async fn connect(app: &TestApp) -> Db {
        match Backend::from_env() {
            Backend::Sqlite => {
                Db::Sqlite(sqlx::SqliteConnection::connect(app.database_url()).await.expect("SQLite opens"))
            }
            Backend::Postgres => {
                Db::Postgres(sqlx::PgConnection::connect(app.database_url()).await.expect("PostgreSQL answers"))
            }
            Backend::Mysql => Db::Mysql(mysql_connect_ansi(app.database_url()).await),
        }
    }

    /// Inserts `n` settled ids `old-1` ... `old-<n>` of `shop`/`sku-1` settled at `at`.
    async fn insert_settled_ids(&mut self, n: i64, at: i64) {
        if let Db::Mysql(_) = self {
            // MariaDB stops a recursive CTE after 1,000 rounds (`max_recursive_iterations`) and
            // neither it nor MySQL takes `WITH` before `INSERT`: the rows are spelt out.
            for first in (1..=n).step_by(MYSQL_ROWS_PER_INSERT as usize) {
                let last = (first + MYSQL_ROWS_PER_INSERT - 1).min(n);
                let rows: Vec<String> = (first..=last).map(|i| format!("('shop', 'sku-1', 'old-{i}', {at})")).collect();
                self.execute(&format!(
                    "INSERT INTO redis_settled (tenant_id, resource_key, request_id, at) VALUES {}",
                    rows.join(", ")
                ))
                .await;
            }
            return;
        }
        self.execute(&format!(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < {n})
             INSERT INTO redis_settled (tenant_id, resource_key, request_id, at)
             SELECT 'shop', 'sku-1', 'old-' || i, {at} FROM n"
        ))
        .await;
    }

    /// Makes the events `filter` selects (a condition on `events`) `age_ms` older, as if they
    /// had been written that long ago: their `at`, and their id, whose ULID carries the time it
    /// was made (the purge goes by both); the idempotency records that point at them follow.
    pub(crate) async fn age_events(&mut self, filter: &str, age_ms: i64) {
        for id in self.texts(&format!("SELECT id FROM events WHERE {filter}")).await {
            let ulid: ulid::Ulid = id.trim_start_matches("evt_").parse().unwrap_or_else(|e| panic!("{id}: {e}"));
            let aged = ulid::Ulid::from_parts(ulid.timestamp_ms() - age_ms as u64, ulid.random());
            let aged = format!("evt_{aged}");
            self.execute(&format!("UPDATE events SET id = '{aged}', at = at - {age_ms} WHERE id = '{id}'")).await;
            self.execute(&format!("UPDATE idempotency SET response_event = '{aged}' WHERE response_event = '{id}'"))
                .await;
        }
    }

    async fn texts(&mut self, sql: &str) -> Vec<String> {
        let t: Result<Vec<(String,)>, _> = match self {
            Db::Sqlite(conn) => sqlx::query_as(sql).fetch_all(conn).await,
            Db::Postgres(conn) => sqlx::query_as(sql).fetch_all(conn).await,
            // A binary-collated text column reads as bytes.
            Db::Mysql(conn) => sqlx::query_as(sql).fetch_all(conn).await.map(|rows: Vec<(Vec<u8>,)>| {
                rows.into_iter().map(|(b,)| (String::from_utf8(b).expect("UTF-8 text"),)).collect()
            }),
        };
        t.unwrap_or_else(|e| panic!("{sql}: {e}")).into_iter().map(|(t,)| t).collect()
    }

    async fn execute(&mut self, sql: &str) {
        let done = match self {
            Db::Sqlite(conn) => sqlx::query(sql).execute(conn).await.map(|_| ()),
            Db::Postgres(conn) => sqlx::query(sql).execute(conn).await.map(|_| ()),
            Db::Mysql(conn) => sqlx::query(sql).execute(conn).await.map(|_| ()),
        };
        done.unwrap_or_else(|e| panic!("{sql}: {e}"));
    }

    async fn count(&mut self, sql: &str) -> i64 {
        let n: Result<(i64,), _> = match self {
            Db::Sqlite(conn) => sqlx::query_as(sql).fetch_one(conn).await,
            Db::Postgres(conn) => sqlx::query_as(sql).fetch_one(conn).await,
            Db::Mysql(conn) => sqlx::query_as(sql).fetch_one(conn).await,
        };
        n.unwrap_or_else(|e| panic!("{sql}: {e}")).0
    }

    async fn text(&mut self, sql: &str) -> String {
        self.texts(sql).await.into_iter().next().unwrap_or_else(|| panic!("{sql}: no row"))
    }
}

fn now_ms() -> i64 {
    let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("the clock is after 1970");
    i64::try_from(since.as_millis()).expect("milliseconds fit in i64")
}

/// The value of a metric line starting with `series`, if present.
async fn metric(app: &TestApp, series: &str) -> Option<f64> {
    let text = app.get_anonymous("/metrics").await.text;
    text.lines().find_map(|line| line.strip_prefix(series).and_then(|rest| rest.trim().parse().ok()))
}

/// `redis_settled` keeps a settled record's id for `[redis] settled_retention_seconds` (1 h
/// here) and `settlement_failures` a refused sale for `failure_retention_seconds` (2 h here):
/// 12,000 settled ids 2 h old (more than two purge batches) and a failure 3 h old are deleted by
/// the job, a settled id 10 min old and a failure 1 h old are kept, and
/// `stockd_purged_rows_total` counts exactly what went, by table.
#[tokio::test]
async fn settled_ids_and_settlement_failures_past_their_retention_are_purged() {
    let app = spawn_app_with(AppOptions::default().toml(
        "[redis]\nsettled_retention_seconds = 3600\nfailure_retention_seconds = 7200\npurge_interval_seconds = 1",
    ))
    .await;
    let mut db = Db::connect(&app).await;
    let now = now_ms();
    db.insert_settled_ids(12_000, now - 2 * HOUR_MS).await;
    db.execute(&format!(
        "INSERT INTO redis_settled (tenant_id, resource_key, request_id, at) VALUES ('shop', 'sku-1', 'young', {})",
        now - HOUR_MS / 6
    ))
    .await;
    for (id, age_ms) in [("old", 3 * HOUR_MS), ("young", HOUR_MS)] {
        db.execute(&format!(
            "INSERT INTO settlement_failures (tenant_id, resource_key, request_id, order_id, idempotency_key, qty,
                                              reason, available, at)
             VALUES ('shop', 'sku-1', '{id}', 'ORD-{id}', 'idem-{id}', 1, 'insufficient', 0, {})",
            now - age_ms
        ))
        .await;
        db.execute(&format!(
            "INSERT INTO settlement_dead_letters (tenant_id, resource_key, entry_id, payload, reason, at)
             VALUES ('shop', 'sku-1', '{id}', '{{}}', 'no record field', {})",
            now - age_ms
        ))
        .await;
    }

    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let left = (
            db.count("SELECT COUNT(*) FROM redis_settled").await,
            db.count("SELECT COUNT(*) FROM settlement_failures").await,
            db.count("SELECT COUNT(*) FROM settlement_dead_letters").await,
        );
        // Counted after each batch commits: the count may trail the rows by a moment.
        let counted = (
            metric(&app, "stockd_purged_rows_total{table=\"redis_settled\"}").await,
            metric(&app, "stockd_purged_rows_total{table=\"settlement_failures\"}").await,
            metric(&app, "stockd_purged_rows_total{table=\"settlement_dead_letters\"}").await,
        );
        if left == (1, 1, 1) && counted == (Some(12_000.0), Some(1.0), Some(1.0)) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "old rows were not purged: (settled ids, failures, dead letters) left {left:?}, counted {counted:?}\n{}",
            app.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(db.count("SELECT COUNT(*) FROM redis_settled WHERE request_id = 'young'").await, 1);
    assert_eq!(db.count("SELECT COUNT(*) FROM settlement_failures WHERE request_id = 'young'").await, 1);
    assert_eq!(db.count("SELECT COUNT(*) FROM settlement_dead_letters WHERE entry_id = 'young'").await, 1);
}

/// The names of the consumers in the settlement group of `stream`.
async fn consumers(conn: &mut redis::aio::MultiplexedConnection, stream: &str) -> Vec<String> {
    let reply: redis::RedisResult<redis::streams::StreamInfoConsumersReply> =
        redis::cmd("XINFO").arg("CONSUMERS").arg(stream).arg("settle").query_async(conn).await;
    reply.map(|r| r.consumers.into_iter().map(|c| c.name).collect()).unwrap_or_default()
}

/// Polls the group of `stream` until it holds `n` consumers; returns their names.
async fn wait_for_consumers(conn: &mut redis::aio::MultiplexedConnection, stream: &str, n: usize) -> Vec<String> {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let names = consumers(conn, stream).await;
        if names.len() == n {
            return names;
        }
        assert!(tokio::time::Instant::now() < deadline, "{stream}: {names:?}, not {n} consumers");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A process killed with -9 leaves its consumer in the settlement group of every redis-mode
/// stream (and each restart would add one more). Here the killed process is the one settling
/// the stream (one process settles a stream at a time): the live one takes the stream over
/// once the dead one's lease runs out, and once the dead consumer has been idle past `[redis]
/// dead_consumer_idle_ms` (2 s here) with no pending entry, removes it and counts the removal in
/// `stockd_redis_consumers_removed_total`; sales still settle, and the live process's consumer
/// is the one left in the group.
#[tokio::test]
async fn the_consumer_of_a_killed_process_leaves_the_settlement_group() {
    let redis_url = shared_redis_url();
    let (mut app, prefix) = redis_app(&redis_url, "dead_consumer_idle_ms = 2000").await;
    let shop = app.create_tenant("shop").await;
    create_redis_resource(&shop, "sku-1", 1000).await;
    assert_eq!(order_through_503(&shop, "o1", &deduct_one("o1", "sku-1", 1, None)).await.status(), 201);
    wait_settled(&shop, "sku-1", 1).await;
    let stream = stream_key(&prefix, "shop", "sku-1");
    let mut conn = redis_conn(&redis_url).await;
    let dead = wait_for_consumers(&mut conn, &stream, 1).await;

    let sibling = app.spawn_sibling().await;
    let shop_there = sibling.tenant_with_key("shop", &shop.api_key);
    app.kill9().await;
    // The sibling takes the stream over (and joins the group) once the dead owner's lease ran
    // out: sell through it until it has.
    let mut sold = 1;
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let ours = loop {
        let names = consumers(&mut conn, &stream).await;
        if let Some(name) = names.iter().find(|name| **name != dead[0]) {
            break vec![name.clone()];
        }
        assert!(tokio::time::Instant::now() < deadline, "the sibling never took the stream over: {names:?}");
        sold += 1;
        let key = format!("o{sold}");
        assert_eq!(order_through_503(&shop_there, &key, &deduct_one(&key, "sku-1", 1, None)).await.status(), 201);
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    wait_settled(&shop_there, "sku-1", sold).await;

    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let names = consumers(&mut conn, &stream).await;
        if !names.contains(&dead[0]) {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the dead consumer {} stayed: {names:?}", dead[0]);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while metric(&sibling, "stockd_redis_consumers_removed_total").await != Some(1.0) {
        assert!(tokio::time::Instant::now() < deadline, "the removal was not counted");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Selling and settling go on.
    assert_eq!(order_through_503(&shop_there, "last", &deduct_one("last", "sku-1", 1, None)).await.status(), 201);
    wait_settled(&shop_there, "sku-1", sold + 1).await;
    assert_eq!(consumers(&mut conn, &stream).await, ours, "the live process's consumer is the one left");
}

/// Proves an event is indexed once besides the feed, on every backend: the purge finds old
/// events by their ids (a ULID carries the time it was made), so no index by age is kept, and
/// SQLite keeps the table itself in the order of the feed. Then an event past its retention by
/// both its id and its time is purged, and one whose id is young though its `at` is old is kept.
#[tokio::test]
async fn events_are_indexed_by_id_and_feed_only_and_purged_by_id() {
    let app = spawn_app_with(
        AppOptions::default()
            .toml("[idempotency]\nretention_hours = 1\n[events]\nretention_hours = 1\npurge_interval_seconds = 1"),
    )
    .await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 5).await;
    for order in ["ORD-1", "ORD-2"] {
        shop.order(order, &deduct(order, &[("sku-1", 1)])).await.expect_json(201);
    }
    let mut db = Db::connect(&app).await;
    let catalog = match Backend::from_env() {
        // The table (its key the feed's, tenant and seq: no rowid b-tree) and the index by id.
        Backend::Sqlite => "SELECT COUNT(*) FROM sqlite_schema WHERE tbl_name = 'events'",
        Backend::Postgres => {
            "SELECT COUNT(*) FROM pg_indexes WHERE schemaname = current_schema() AND tablename = 'events'"
        }
        Backend::Mysql => {
            "SELECT COUNT(DISTINCT index_name) FROM information_schema.statistics
             WHERE table_schema = DATABASE() AND table_name = 'events'"
        }
    };
    assert_eq!(db.count(catalog).await, 2, "the table's key (id) and the feed, nothing by age");

    // The young id first: a purge that deletes the other event ran after it too.
    db.execute(&format!(
        "UPDATE events SET at = at - {} WHERE tenant_id = 'shop' AND ordering_key = 'order:ORD-2'",
        3 * HOUR_MS
    ))
    .await;
    db.age_events("tenant_id = 'shop' AND ordering_key = 'order:ORD-1'", 3 * HOUR_MS).await;
    let gone = "SELECT COUNT(*) FROM events WHERE tenant_id = 'shop' AND ordering_key = 'order:ORD-1'";
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while db.count(gone).await > 0 {
        assert!(tokio::time::Instant::now() < deadline, "the event 3 hours old was never purged");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let kept = "SELECT COUNT(*) FROM events WHERE tenant_id = 'shop' AND ordering_key = 'order:ORD-2'";
    assert_eq!(db.count(kept).await, 1, "an event whose id is young is kept");
}

/// An applied order's answer is stored once, as its `order.applied` event's payload: its
/// idempotency record keeps the event's id and no body, and a replay answers from the event,
/// byte for byte. Events outlive records by an hour whatever `[events] retention_hours` says:
/// with records kept 2 h and events 1 h, an order answered 90 minutes ago still replays after a
/// purge pass that deleted a 4-hour-old order's record and event. A rejected order (no event)
/// keeps its answer in its record.
#[tokio::test]
async fn a_replayed_order_answers_from_its_event_which_outlives_the_record() {
    let app = spawn_app_with(AppOptions::default().toml(
        "[idempotency]\nretention_hours = 2\npurge_interval_seconds = 1\n\
         [events]\nretention_hours = 1\npurge_interval_seconds = 1",
    ))
    .await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 5).await;
    let young = deduct("ORD-young", &[("sku-1", 1)]);
    let first = shop.order("young", &young).await;
    assert_eq!(first.status(), 201, "{}", first.text);
    shop.order("old", &deduct("ORD-old", &[("sku-1", 1)])).await.expect_json(201);
    let rejected = deduct("ORD-rejected", &[("sku-1", 100)]);
    let refusal = shop.order("rejected", &rejected).await;
    assert_eq!(refusal.status(), 409, "{}", refusal.text);

    let mut db = Db::connect(&app).await;
    let in_event = "SELECT COUNT(*) FROM idempotency WHERE tenant_id = 'shop' AND \"key\" IN ('young', 'old')
                    AND response_body IS NULL AND response_event IS NOT NULL";
    assert_eq!(db.count(in_event).await, 2, "an applied order's record keeps its event's id, not the body");
    let inline = "SELECT COUNT(*) FROM idempotency WHERE tenant_id = 'shop' AND \"key\" = 'rejected'
                  AND response_body IS NOT NULL AND response_event IS NULL";
    assert_eq!(db.count(inline).await, 1, "a rejected order keeps its answer in its record");

    for (key, order, age_ms) in [("young", "ORD-young", 3 * HOUR_MS / 2), ("old", "ORD-old", 4 * HOUR_MS)] {
        db.execute(&format!(
            "UPDATE idempotency SET created_at = created_at - {age_ms} WHERE tenant_id = 'shop' AND \"key\" = '{key}'"
        ))
        .await;
        db.age_events(&format!("tenant_id = 'shop' AND ordering_key = 'order:{order}'"), age_ms).await;
    }
    // Both purges ran over the aged rows: the old order's record and event are gone.
    let old_left = "SELECT (SELECT COUNT(*) FROM idempotency WHERE tenant_id = 'shop' AND \"key\" = 'old')
                         + (SELECT COUNT(*) FROM events WHERE tenant_id = 'shop' AND ordering_key = 'order:ORD-old')";
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while db.count(old_left).await > 0 {
        assert!(tokio::time::Instant::now() < deadline, "the 4-hour-old record and event were never purged");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let again = shop.order("young", &young).await;
    assert_eq!(again.status(), 201, "the young order's event is kept for its record: {}", again.text);
    assert_eq!(again.text, first.text, "same bytes");
    assert!(again.replayed(), "marked Idempotent-Replayed: true");
    let refused_again = shop.order("rejected", &rejected).await;
    assert_eq!((refused_again.status(), refused_again.text.as_str()), (409, refusal.text.as_str()));
}

/// Proves an idempotency record keeps the first 32 hex digits of the request's SHA-256 (half
/// its bytes) and still tells a replay from another request under the key, and that a record an
/// earlier version wrote, with all 64 digits, is judged by them the same way.
#[tokio::test]
async fn a_record_keeps_half_the_request_hash_and_earlier_whole_ones_still_judge() {
    use sha2::Digest;
    let app = spawn_app_with(AppOptions::default()).await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 5).await;
    let body = deduct("ORD-1", &[("sku-1", 1)]);
    let first = shop.order("k1", &body).await;
    assert_eq!(first.status(), 201, "{}", first.text);
    // The request's identity: method, path and the body with its keys sorted, compact.
    let whole = hex::encode(sha2::Sha256::digest(format!("POST\n/v1/orders\n{body}")));

    let mut db = Db::connect(&app).await;
    let stored = "SELECT request_hash FROM idempotency WHERE tenant_id = 'shop' AND \"key\" = 'k1'";
    assert_eq!(db.text(stored).await, whole[..32], "the record keeps the hash's first 32 digits");
    let other = deduct("ORD-2", &[("sku-1", 1)]);
    for _ in 0..2 {
        let again = shop.order("k1", &body).await;
        assert_eq!((again.status(), again.text.as_str()), (201, first.text.as_str()));
        assert!(again.replayed(), "a replay");
        assert_problem(&shop.order("k1", &other).await, 422, "idempotency_key_mismatch");
        // Then as an earlier version stored it.
        db.execute(&format!(
            "UPDATE idempotency SET request_hash = '{whole}' WHERE tenant_id = 'shop' AND \"key\" = 'k1'"
        ))
        .await;
    }
    let sku = shop.get("/v1/resources/sku-1").await.expect_json(200);
    assert_eq!(sku["available"], 4, "one deduction: {sku}");
}

/// Answers and events are stored deflated against a dictionary (src/storage/payload.rs): an
/// applied order's `order.applied` payload and a rejected order's record in under a third of
/// their bytes, and read back byte for byte: a replay answers the same bytes, the feed carries
/// the document as answered. Values a server stored before, plain JSON, read as they were.
#[tokio::test]
async fn answers_are_stored_deflated_and_read_back_byte_for_byte() {
    let app = spawn_app_with(AppOptions::default()).await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 5).await;
    shop.create_resource("sku-2", 5).await;
    let applied = deduct("ORD-applied", &[("sku-1", 1), ("sku-2", 2)]);
    let first = shop.order("applied", &applied).await;
    assert_eq!(first.status(), 201, "{}", first.text);
    let rejected = deduct("ORD-rejected", &[("sku-1", 100)]);
    let refusal = shop.order("rejected", &rejected).await;
    assert_eq!(refusal.status(), 409, "{}", refusal.text);

    let mut db = Db::connect(&app).await;
    let event_data =
        "SELECT data FROM events WHERE tenant_id = 'shop' AND ordering_key = 'order:ORD-applied' AND type = 'order.applied'";
    let record_body = "SELECT response_body FROM idempotency WHERE tenant_id = 'shop' AND \"key\" = 'rejected'";
    for (what, sql, answer) in [("the event", event_data, &first.text), ("the record", record_body, &refusal.text)] {
        let stored = db.text(sql).await;
        assert!(stored.starts_with("~1"), "{what} is stored deflated: {stored}");
        assert!(stored.len() * 3 < answer.len(), "{what}: {} bytes stored for {}", stored.len(), answer.len());
    }

    read_back(&shop, [(&applied, &first.text), (&rejected, &refusal.text)]).await;

    // As a server before this format stored them: plain JSON, read as it is.
    let plain = |text: &str| text.replace('\'', "''");
    db.execute(&format!(
        "UPDATE events SET data = '{}' WHERE tenant_id = 'shop' AND ordering_key = 'order:ORD-applied'
         AND type = 'order.applied'",
        plain(&first.text)
    ))
    .await;
    db.execute(&format!(
        "UPDATE idempotency SET response_body = '{}' WHERE tenant_id = 'shop' AND \"key\" = 'rejected'",
        plain(&refusal.text)
    ))
    .await;
    assert!(db.text(event_data).await.starts_with('{'));
    read_back(&shop, [(&applied, &first.text), (&rejected, &refusal.text)]).await;
}

/// Each order replayed (keys `applied`, `rejected`) answers exactly its first answer, and the
/// feed's `order.applied` event carries the applied one's document.
async fn read_back(shop: &TenantClient, orders: [(&serde_json::Value, &String); 2]) {
    for ((body, answer), key) in orders.iter().zip(["applied", "rejected"]) {
        let again = shop.order(key, body).await;
        assert_eq!(&again.text, *answer, "{key}: same bytes");
        assert!(again.replayed(), "{key}");
    }
    let page = shop.get("/v1/events?types=order.applied").await.expect_json(200);
    let answered: serde_json::Value = serde_json::from_str(orders[0].1).expect("the answer is JSON");
    assert_eq!(page["items"][0]["data"], answered, "the feed carries the document as answered");
}

/// An order sent with its own id as its idempotency key (SQLite finds its ledger entries
/// through that key's record, not an index by order id: migrations/sqlite/0022) is read and
/// reversed the same on every backend: before its record's retention, after it (the key
/// answers nothing and is free again), and after a new order takes the key and the order id
/// again, when both orders' entries count. Never more is given back than was taken.
#[tokio::test]
async fn an_order_keyed_by_its_own_id_is_found_past_its_records_retention_and_after_the_key_is_reused() {
    let app =
        spawn_app_with(AppOptions::default().toml("[idempotency]\nretention_hours = 1\npurge_interval_seconds = 1"))
            .await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 10).await;
    shop.create_resource("sku-2", 10).await;
    let placed = shop.order("ORD-K", &deduct("ORD-K", &[("sku-1", 3), ("sku-2", 1)])).await;
    assert_eq!(placed.status(), 201, "{}", placed.text);
    let reverse = |key: &'static str, qty: i64| {
        let body = serde_json::json!({"lines": [{"key": "sku-1", "qty": qty}], "reason": "returned"});
        let shop = &shop;
        async move { shop.post_with_key("/v1/orders/ORD-K/reversals", key, &body).await }
    };
    let sku1 = |order: &serde_json::Value| {
        let lines = order["lines"].as_array().cloned().unwrap_or_default();
        let line = lines.into_iter().find(|l| l["key"] == "sku-1").unwrap_or_else(|| panic!("a line sku-1: {order}"));
        (line["deducted"].as_i64(), line["reversed"].as_i64(), line["reversible"].as_i64())
    };
    assert_eq!(reverse("r-1", 1).await.status(), 201);
    assert_eq!(sku1(&shop.get("/v1/orders/ORD-K").await.expect_json(200)), (Some(3), Some(1), Some(2)));

    // Past the retention: the order's record and the reversal's are purged.
    let mut db = Db::connect(&app).await;
    db.execute(&format!(
        "UPDATE idempotency SET created_at = created_at - {} WHERE tenant_id = 'shop' AND \"key\" IN ('ORD-K', 'r-1')",
        2 * HOUR_MS
    ))
    .await;
    let answering = "SELECT COUNT(*) FROM idempotency WHERE tenant_id = 'shop' AND \"key\" IN ('ORD-K', 'r-1')
                     AND response_code IS NOT NULL";
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while db.count(answering).await > 0 {
        assert!(tokio::time::Instant::now() < deadline, "the 2-hour-old records were never purged");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let order = shop.get("/v1/orders/ORD-K").await.expect_json(200);
    assert_eq!(sku1(&order), (Some(3), Some(1), Some(2)), "the order is found past its record: {order}");
    assert_eq!(reverse("r-2", 2).await.status(), 201);
    assert_problem(&reverse("r-3", 1).await, 409, "exceeds_reversible");

    // The key is free: the same request is a new order now, under the same order id.
    let again = shop.order("ORD-K", &deduct("ORD-K", &[("sku-1", 2)])).await;
    assert_eq!(again.status(), 201, "{}", again.text);
    assert!(!again.replayed(), "past the retention the key is free");
    let order = shop.get("/v1/orders/ORD-K").await.expect_json(200);
    assert_eq!(sku1(&order), (Some(5), Some(3), Some(2)), "both orders' entries: {order}");
    assert_problem(&reverse("r-4", 3).await, 409, "exceeds_reversible");
    assert_eq!(reverse("r-5", 2).await.status(), 201);
    crate::helpers::assert_counts(&shop.state("sku-1").await, 10, 0, 0, 10);
    crate::helpers::assert_counts(&shop.state("sku-2").await, 9, 0, 1, 10);
}

/// The same under concurrency, where orders are decided together in batches: 40 orders at once,
/// half sent with their own id as their key; past the records' retention, a reversal of each at
/// once; then the keyed half placed again at once under the same keys and ids; each order then
/// reads both placements, and reversing everything that is left gives the resource back whole.
#[tokio::test]
async fn orders_keyed_by_their_own_ids_in_batches_are_found_past_their_records_and_after_reuse() {
    use futures::future::join_all;
    let app =
        spawn_app_with(AppOptions::default().toml("[idempotency]\nretention_hours = 1\npurge_interval_seconds = 1"))
            .await;
    let shop = &app.create_tenant("shop").await;
    shop.create_resource("sku-1", 1000).await;
    let orders: Vec<(String, String)> = (0..40)
        .map(|i| {
            let id = format!("O-{i}");
            let key = if i % 2 == 0 { id.clone() } else { format!("k-{i}") };
            (id, key)
        })
        .collect();
    let place = |id: &str, key: &str, qty: i64| {
        let (body, key) = (deduct(id, &[("sku-1", qty)]), key.to_owned());
        async move { shop.order(&key, &body).await }
    };
    let reverse = |id: &str, key: String, body: serde_json::Value| {
        let path = format!("/v1/orders/{id}/reversals");
        async move { shop.post_with_key(&path, &key, &body).await }
    };
    for reply in join_all(orders.iter().map(|(id, key)| place(id, key, 2))).await {
        assert_eq!(reply.status(), 201, "{}", reply.text);
    }
    let mut db = Db::connect(&app).await;
    if Backend::from_env() == Backend::Sqlite {
        let by_key = db.count("SELECT COUNT(*) FROM ledger WHERE by_key = 1").await;
        assert_eq!(by_key, 20, "every order sent with its own id as its key is found through its record");
    }

    db.execute(&format!("UPDATE idempotency SET created_at = created_at - {} WHERE tenant_id = 'shop'", 2 * HOUR_MS))
        .await;
    let answering = "SELECT COUNT(*) FROM idempotency WHERE tenant_id = 'shop' AND response_code IS NOT NULL";
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while db.count(answering).await > 0 {
        assert!(tokio::time::Instant::now() < deadline, "the records were never purged");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let one = serde_json::json!({"lines": [{"key": "sku-1", "qty": 1}], "reason": "returned"});
    for reply in join_all(orders.iter().map(|(id, _)| reverse(id, format!("r1-{id}"), one.clone()))).await {
        assert_eq!(reply.status(), 201, "{}", reply.text);
    }
    for reply in join_all(orders.iter().step_by(2).map(|(id, key)| place(id, key, 3))).await {
        assert_eq!(reply.status(), 201, "{}", reply.text);
        assert!(!reply.replayed(), "past the retention the key is free");
    }
    for (i, (id, _)) in orders.iter().enumerate() {
        let order = shop.get(&format!("/v1/orders/{id}")).await.expect_json(200);
        let line = &order["lines"][0];
        let deducted = if i % 2 == 0 { 5 } else { 2 };
        assert_eq!(
            (line["deducted"].as_i64(), line["reversed"].as_i64(), line["reversible"].as_i64()),
            (Some(deducted), Some(1), Some(deducted - 1)),
            "{order}"
        );
    }
    let everything = serde_json::json!({});
    for reply in join_all(orders.iter().map(|(id, _)| reverse(id, format!("r2-{id}"), everything.clone()))).await {
        assert_eq!(reply.status(), 201, "{}", reply.text);
    }
    crate::helpers::assert_counts(&shop.state("sku-1").await, 1000, 0, 0, 1000);
}

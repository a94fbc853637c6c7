//! The database ends the server's sessions (a restart, a failover, an operator's
//! `pg_terminate_backend`, `idle_session_timeout`): connections the server keeps between uses
//! (the batcher's while jobs wait, the grouped lookups' always) must not turn that into errors
//! for requests that came after it, nor lose or double an order that came during it. These
//! tests run on PostgreSQL whatever the suite's backend.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use sqlx::{Connection, PgConnection};

use crate::helpers::{deduct, spawn_app_on, AppOptions, Backend, TenantClient, TestApp};
use crate::redis_support::{create_redis_resource, deduct_one, redis_app_on};

const DEADLINE: Duration = Duration::from_secs(60);

/// The grouped lookup's statement, as `pg_stat_activity` shows a session's last one.
pub const LOOKUPS: &str = "%WITH ORDINALITY AS k (tenant_id, key, n)%";

/// Ends the server's sessions on its database whose last statement contains `like` (a
/// `LIKE` pattern), then waits until they are gone. Returns how many it ended.
pub async fn end_sessions(app: &TestApp, like: &str) -> usize {
    let mut conn = PgConnection::connect(app.database_url()).await.expect("PostgreSQL answers");
    let ended: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
         WHERE datname = current_database() AND pid <> pg_backend_pid() AND query LIKE $1",
    )
    .bind(like)
    .fetch_all(&mut conn)
    .await
    .expect("ending sessions");
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let left: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM pg_stat_activity
             WHERE datname = current_database() AND pid <> pg_backend_pid() AND query LIKE $1",
        )
        .bind(like)
        .fetch_one(&mut conn)
        .await
        .expect("counting sessions");
        if left == 0 {
            let _ = conn.close().await;
            return ended.len();
        }
        assert!(tokio::time::Instant::now() < deadline, "{left} sessions never ended");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A redis-mode sale reads its key's stored outcome on a connection kept between groups. Once
/// the database has ended those sessions, the next sale and a replay are answered as if
/// nothing happened: the lookup is read again on a new connection, not answered 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_sales_after_the_database_ended_the_lookup_sessions_are_answered() {
    let app = redis_app_on(Backend::Postgres).await;
    let shop = app.create_tenant("shop").await;
    create_redis_resource(&shop, "sku-1", 100).await;
    let first = shop.order("k-1", &deduct_one("o-1", "sku-1", 1, None)).await;
    assert_eq!(first.status(), 201, "{}", first.text);

    let ended = end_sessions(&app, LOOKUPS).await;
    assert!(ended > 0, "no session of the server ran the grouped lookup");

    let second = shop.order("k-2", &deduct_one("o-2", "sku-1", 1, None)).await;
    assert_eq!(second.status(), 201, "a sale after the lookup sessions ended: {}", second.text);
    end_sessions(&app, LOOKUPS).await;
    let replay = shop.order("k-1", &deduct_one("o-1", "sku-1", 1, None)).await;
    assert_eq!((replay.status(), replay.text.as_str()), (201, first.text.as_str()), "the replay");
}

/// Orders from many clients while the database ends every session of the server, again and
/// again (each time once it has connected again): an order is applied or answered 503 (never another error) while sessions are being
/// ended, and every order begun after the last of them is gone is applied (the batcher's kept
/// connection, ended between two batches, costs a rerun of the batch, not its orders). Once
/// every 503 is retried under its key, the resource has lost exactly one unit an order and its
/// ledger replays to its state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orders_while_the_database_ends_the_servers_sessions_are_applied_once() {
    const CLIENTS: usize = 48;
    /// Orders each client makes once the last ended session is gone.
    const AFTER: usize = 10;
    const ENDINGS: usize = 8;
    const TOTAL: i64 = 1_000_000;
    let app = spawn_app_on(Backend::Postgres, AppOptions::default()).await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", TOTAL).await;

    let quiet = Arc::new(AtomicBool::new(false));
    let ender = {
        let (url, quiet) = (app.database_url().to_owned(), quiet.clone());
        tokio::spawn(async move {
            let mut conn = PgConnection::connect(&url).await.expect("PostgreSQL answers");
            let mut ended: Vec<i32> = Vec::new();
            for _ in 0..ENDINGS {
                // Each time once the server has a session again (it reconnected under load).
                let deadline = tokio::time::Instant::now() + DEADLINE;
                loop {
                    let live: i64 = sqlx::query_scalar(
                        "SELECT COUNT(*) FROM pg_stat_activity
                         WHERE datname = current_database() AND application_name = 'stockd' AND pid <> ALL($1)",
                    )
                    .bind(&ended)
                    .fetch_one(&mut conn)
                    .await
                    .expect("counting the server's sessions");
                    if live > 0 {
                        break;
                    }
                    assert!(tokio::time::Instant::now() < deadline, "the server never connected again");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                // In the select list, so that it runs only for the rows the filter keeps.
                let pids: Vec<(i32, bool)> = sqlx::query_as(
                    "SELECT pid, pg_terminate_backend(pid) FROM pg_stat_activity
                     WHERE datname = current_database() AND pid <> pg_backend_pid() AND application_name = 'stockd'",
                )
                .fetch_all(&mut conn)
                .await
                .expect("ending the server's sessions");
                ended.extend(pids.into_iter().map(|(pid, _)| pid));
            }
            let deadline = tokio::time::Instant::now() + DEADLINE;
            loop {
                let left: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM pg_stat_activity WHERE pid = ANY($1)")
                    .bind(&ended)
                    .fetch_one(&mut conn)
                    .await
                    .expect("counting the ended sessions");
                if left == 0 {
                    break;
                }
                assert!(tokio::time::Instant::now() < deadline, "{left} ended sessions never left");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            quiet.store(true, Ordering::SeqCst);
            ended.len()
        })
    };
    let clients = (0..CLIENTS).map(|c| {
        let (shop, quiet) = (shop.clone(), quiet.clone());
        tokio::spawn(async move {
            let (mut made, mut after, mut unanswered) = (0usize, 0usize, Vec::new());
            while after < AFTER {
                assert!(made < 5_000, "the server's sessions were still being ended after {made} orders");
                let begun_quiet = quiet.load(Ordering::SeqCst);
                let (key, order) = (format!("k-{c}-{made}"), format!("o-{c}-{made}"));
                let reply = shop.order(&key, &deduct(&order, &[("sku-1", 1)])).await;
                match reply.status() {
                    201 => {}
                    503 if !begun_quiet => unanswered.push((key, order)),
                    other => {
                        panic!("order {order}, begun after the last ended session was gone: {other} {}", reply.text)
                    }
                }
                made += 1;
                after += usize::from(begun_quiet);
            }
            (made, unanswered)
        })
    });
    let mut orders = 0;
    let mut unanswered: Vec<(String, String)> = Vec::new();
    for client in futures::future::join_all(clients).await {
        let (made, mut left) = client.expect("a client task does not panic");
        orders += made;
        unanswered.append(&mut left);
    }
    let ended = ender.await.expect("the ending task does not panic");
    assert!(ended > 0, "no session of the server was ended");

    retry_until_applied(&shop, &unanswered).await;
    let state = shop.state("sku-1").await;
    assert_eq!(
        state["available"].as_i64(),
        Some(TOTAL - orders as i64),
        "one unit an order, {orders} orders, {} of them answered 503 first: {state}",
        unanswered.len()
    );
    shop.assert_ledger_replays_to_state("sku-1").await;
}

/// Retries each order under its key until it is answered 201 (applied then, or before).
async fn retry_until_applied(shop: &TenantClient, orders: &[(String, String)]) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    for (key, order) in orders {
        loop {
            let reply = shop.order(key, &deduct(order, &[("sku-1", 1)])).await;
            match reply.status() {
                201 => break,
                503 if tokio::time::Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(50)).await,
                other => panic!("retry of {order}: {other} {}", reply.text),
            }
        }
    }
}

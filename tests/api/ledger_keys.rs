//! The ledger's keys on PostgreSQL, whose indexes later migrations rebuilt for speed (0018: the
//! uniqueness ordered by request first; 0019: the primary key by resource instead of by `seq`
//! alone; 0022: the order index by a hash of tenant and order id, see `query_plans`): the same
//! rules hold, and nothing else is indexed. On PostgreSQL whatever the suite's backend.

use sqlx::{Connection, PgConnection};

use crate::helpers::{deduct, spawn_app_on, AppOptions, Backend};

/// An INSERT copying the shop's one deduction, its request id from the SQL expression
/// `request_id`, and its `seq` too when `same_seq` (else the ledger numbers the copy).
fn copy_of_the_deduction(same_seq: bool, request_id: &str) -> String {
    let (seq, overriding) = if same_seq { ("seq, ", "OVERRIDING SYSTEM VALUE") } else { ("", "") };
    format!(
        "INSERT INTO ledger ({seq}tenant_id, resource_key, bucket, op, qty, request_id, available_after, reserved_after,
                             consumed_after, version_after, at) {overriding}
         SELECT {seq}tenant_id, resource_key, bucket, op, qty, {request_id}, available_after, reserved_after,
                consumed_after, version_after, at
         FROM ledger WHERE tenant_id = 'shop' AND op = 'deduct'"
    )
}

#[tokio::test]
async fn the_ledger_refuses_an_action_twice_and_a_resources_entry_number_twice() {
    let app = spawn_app_on(Backend::Postgres, AppOptions::default()).await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 10).await;
    let reply = shop.order("k-1", &deduct("O1", &[("sku-1", 3)])).await;
    assert_eq!(reply.status(), 201, "{}", reply.text);

    let mut conn = PgConnection::connect(app.database_url()).await.expect("PostgreSQL answers");
    let indexes: Vec<(String, bool, bool)> = sqlx::query_as(
        "SELECT c.relname::text, i.indisprimary, i.indisunique FROM pg_index i
         JOIN pg_class c ON c.oid = i.indexrelid WHERE i.indrelid = 'ledger'::regclass ORDER BY 1",
    )
    .fetch_all(&mut conn)
    .await
    .expect("the ledger's indexes");
    let expected =
        [("ledger_by_order", false, false), ("ledger_by_resource", true, true), ("ledger_identity", false, true)];
    assert_eq!(
        indexes,
        expected.map(|(n, p, u)| (n.to_owned(), p, u)).to_vec(),
        "the ledger's indexes: (name, primary, unique)"
    );

    // The same action on the same resource again, under a number of its own.
    let twice = sqlx::query(&copy_of_the_deduction(false, "request_id")).execute(&mut conn).await;
    let refused = twice.expect_err("a second entry of one action is refused").to_string();
    assert!(refused.contains("ledger_identity"), "{refused}");
    // Another action under the number the resource's entry already has.
    let renumbered = sqlx::query(&copy_of_the_deduction(true, "'req_other'")).execute(&mut conn).await;
    let refused = renumbered.expect_err("a resource's entry number is its own").to_string();
    assert!(refused.contains("ledger_by_resource"), "{refused}");
    // A new action is an entry like any other.
    let added = sqlx::query(&copy_of_the_deduction(false, "'req_other'")).execute(&mut conn).await;
    assert_eq!(added.expect("a new action is written").rows_affected(), 1);
    let _ = conn.close().await;
}

//! Applies the SQLite migrations (`migrations/sqlite/*.sql`, embedded at build time) with
//! rusqlite, keeping sqlx's record of them (`_sqlx_migrations`, same columns and checksums), so
//! a database migrated by an earlier version carries on where it stopped. Each migration runs in
//! its own transaction with its record; a half-applied one (`success = false`) or one changed
//! after it was applied stops the start.

use std::collections::HashMap;
use std::time::Instant;

use rusqlite::{params, Connection};

use crate::storage::StorageError;

static MIGRATIONS: sqlx::migrate::Migrator = sqlx::migrate!("./migrations/sqlite");

/// Applies every migration not yet recorded.
pub fn run(conn: &mut Connection) -> Result<(), StorageError> {
    run_through(conn, i64::MAX)
}

/// Applies every migration not yet recorded up to version `last`.
fn run_through(conn: &mut Connection, last: i64) -> Result<(), StorageError> {
    let failed = |why: String| StorageError::Internal(format!("migration failed: {why}"));
    conn.execute_batch(
        "CREATE TABLE IF NOT EXISTS _sqlx_migrations (
            version BIGINT PRIMARY KEY,
            description TEXT NOT NULL,
            installed_on TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP,
            success BOOLEAN NOT NULL,
            checksum BLOB NOT NULL,
            execution_time BIGINT NOT NULL
        )",
    )?;
    let mut applied: HashMap<i64, (bool, Vec<u8>)> = HashMap::new();
    {
        let mut statement = conn.prepare("SELECT version, success, checksum FROM _sqlx_migrations")?;
        let rows = statement.query_map([], |row| Ok((row.get(0)?, (row.get(1)?, row.get(2)?))))?;
        for row in rows {
            let (version, record) = row?;
            applied.insert(version, record);
        }
    }
    // A database a newer version migrated may hold what this version cannot read (answers
    // stored in a newer format): refuse to start on it, as sqlx does on the other backends.
    if let Some(unknown) = applied.keys().filter(|v| !MIGRATIONS.iter().any(|m| m.version == **v)).min() {
        return Err(failed(format!(
            "the database was migrated by a newer version of stockd (migration {unknown} is unknown to this one)"
        )));
    }
    for migration in MIGRATIONS.iter().filter(|m| !m.migration_type.is_down_migration() && m.version <= last) {
        match applied.get(&migration.version) {
            Some((false, _)) => {
                return Err(failed(format!("migration {} was left half-applied", migration.version)));
            }
            Some((true, checksum)) if checksum.as_slice() != &*migration.checksum => {
                return Err(failed(format!("migration {} changed after it was applied", migration.version)));
            }
            Some(_) => continue,
            None => {}
        }
        let started = Instant::now();
        let tx = conn.transaction()?;
        tx.execute_batch(&migration.sql).map_err(|e| failed(format!("{}: {e}", migration.version)))?;
        let nanos = i64::try_from(started.elapsed().as_nanos()).unwrap_or(i64::MAX);
        tx.execute(
            "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
             VALUES (?1, ?2, TRUE, ?3, ?4)",
            params![migration.version, &*migration.description, &*migration.checksum, nanos],
        )?;
        tx.commit()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fresh() -> (tempfile::TempDir, Connection) {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let conn = Connection::open(dir.path().join("m.db")).expect("a database");
        (dir, conn)
    }

    #[test]
    fn migrations_apply_once_and_are_recorded_as_sqlx_records_them() {
        let (_dir, mut conn) = fresh();
        run(&mut conn).expect("first run");
        run(&mut conn).expect("second run applies nothing");
        let recorded: i64 =
            conn.query_row("SELECT COUNT(*) FROM _sqlx_migrations WHERE success", [], |r| r.get(0)).expect("count");
        assert_eq!(recorded as usize, MIGRATIONS.iter().count());
        conn.query_row("SELECT COUNT(*) FROM resources", [], |r| r.get::<_, i64>(0)).expect("the schema exists");
    }

    #[test]
    fn a_database_a_newer_version_migrated_is_refused() {
        let (_dir, mut conn) = fresh();
        run(&mut conn).expect("first run");
        conn.execute(
            "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
             VALUES (99999, 'from the future', TRUE, x'00', 0)",
            [],
        )
        .expect("a record");
        let refused = run(&mut conn).expect_err("a newer database is refused").to_string();
        assert!(refused.contains("migration 99999 is unknown"), "{refused}");
    }

    /// Proves the move of reconciliation's watermark from versions to `seq` (0017) keeps each
    /// checkpoint where it was: at the newest entry of its row (bucket) up to its version,
    /// whatever other rows' entries lie between.
    #[test]
    fn checkpoints_move_to_the_seq_of_the_newest_entry_they_folded() {
        let (_dir, mut conn) = fresh();
        run_through(&mut conn, 16).expect("migrations up to 0016");
        let entry = |seq: i64, key: &str, bucket: i64, version: i64| {
            format!(
                "INSERT INTO ledger (seq, tenant_id, resource_key, bucket, op, qty, request_id, available_after,
                                     reserved_after, consumed_after, version_after, at)
                 VALUES ({seq}, 'shop', '{key}', {bucket}, 'deduct', 1, 'req_{seq}', 0, 0, 0, {version}, 0);"
            )
        };
        let mut sql = String::new();
        // Two rows' entries interleaved; `a` bucket 0 checkpointed at version 2, bucket 1 at 1,
        // `b` at 3 (its newest), `c` at a version with no entry yet written.
        for (seq, key, bucket, version) in [
            (10, "a", 0, 1),
            (11, "b", 0, 1),
            (12, "a", 0, 2),
            (13, "a", 1, 1),
            (14, "b", 0, 2),
            (15, "a", 0, 3),
            (16, "b", 0, 3),
        ] {
            sql.push_str(&entry(seq, key, bucket, version));
        }
        sql.push_str(
            "INSERT INTO ledger_checkpoints (tenant_id, resource_key, bucket, version, available, reserved, consumed, total)
             VALUES ('shop', 'a', 0, 2, 0, 0, 0, 0), ('shop', 'a', 1, 1, 0, 0, 0, 0), ('shop', 'b', 0, 3, 0, 0, 0, 0),
                    ('shop', 'c', 0, 1, 0, 0, 0, 0);",
        );
        conn.execute_batch(&sql).expect("ledger and checkpoints");
        run(&mut conn).expect("the rest");
        let mut statement = conn
            .prepare("SELECT resource_key, bucket, seq FROM ledger_checkpoints ORDER BY resource_key, bucket")
            .expect("select");
        let seqs: Vec<(String, i64, i64)> = statement
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
            .expect("rows")
            .collect::<rusqlite::Result<_>>()
            .expect("checkpoints");
        let want = [("a", 0, 12), ("a", 1, 13), ("b", 0, 16), ("c", 0, 0)];
        assert_eq!(seqs, want.map(|(k, b, s)| (k.to_string(), b, s)).to_vec());
        let index: i64 = conn
            .query_row("SELECT COUNT(*) FROM sqlite_schema WHERE name = 'ledger_by_version'", [], |r| r.get(0))
            .expect("schema");
        assert_eq!(index, 0, "the version index is gone");
    }

    /// The opcodes SQLite compiles `sql` to.
    fn opcodes(conn: &Connection, sql: &str) -> Vec<String> {
        let mut statement = conn.prepare(&format!("EXPLAIN {sql}")).expect("explain");
        let unbound =
            rusqlite::params_from_iter(std::iter::repeat_n(rusqlite::types::Null, statement.parameter_count()));
        statement
            .query_map(unbound, |r| r.get::<_, String>(1))
            .expect("program")
            .collect::<rusqlite::Result<_>>()
            .expect("opcodes")
    }

    /// What an order writes compiles to plain comparisons: a CHECK over a list of three or more
    /// values is evaluated through a temporary b-tree filled on every execution (0019).
    #[test]
    fn the_statements_every_order_writes_with_build_no_temporary_table() {
        use super::super::port::{INSERT_EVENT, INSERT_LEDGER, INSERT_OUTCOME, INSERT_RESERVATION, MOVE_RESERVATION};
        let (_dir, mut conn) = fresh();
        run(&mut conn).expect("migrations");
        for sql in [INSERT_LEDGER, INSERT_OUTCOME, INSERT_RESERVATION, MOVE_RESERVATION, INSERT_EVENT] {
            let program = opcodes(&conn, sql);
            assert!(!program.iter().any(|op| op == "OpenEphemeral"), "{sql} opens a temporary table: {program:?}");
        }
    }

    /// 0019 rebuilds the ledger and the reservations: every row is kept as it was (the ledger's
    /// `seq` included), the indexes are back, and the CHECKs still refuse what they refused.
    #[test]
    fn the_rebuilt_tables_keep_their_rows_and_refuse_what_they_refused() {
        let (_dir, mut conn) = fresh();
        run_through(&mut conn, 18).expect("migrations up to 0018");
        conn.execute_batch(
            "INSERT INTO ledger (seq, tenant_id, resource_key, bucket, op, qty, request_id, order_id, reservation_id,
                                 available_after, reserved_after, consumed_after, version_after, plugin_version, at,
                                 line_key, limit_key, reverses)
             VALUES (7, 'shop', 'a', 0, 'deduct', 2, 'req_1', 'ord_1', NULL, 8, 0, 2, 2, 3, 100, 'A', 'lim', NULL),
                    (40, 'shop', 'a', 0, 'reverse', 2, 'req_2', 'ord_1', NULL, 10, 0, 0, 3, NULL, 101, 'A', 'lim',
                     'req_1'),
                    (41, 'shop', 'b', 1, 'reserve', 1, 'req_3', 'ord_2', 'rsv_1', 4, 1, 0, 5, NULL, 102, NULL, NULL,
                     NULL);
             INSERT INTO reservations (tenant_id, id, order_id, state, lines, expires_at, created_at, updated_at)
             VALUES ('shop', 'rsv_1', 'ord_2', 'held', '[]', 500, 102, 102),
                    ('shop', 'rsv_0', 'ord_0', 'expired', '[]', 90, 80, 95);",
        )
        .expect("rows");
        let dump = |conn: &Connection| -> Vec<String> {
            let mut rows = Vec::new();
            for sql in [
                "SELECT json_array(seq, tenant_id, resource_key, bucket, op, qty, request_id, order_id,
                                   reservation_id, available_after, reserved_after, consumed_after,
                                   version_after, plugin_version, at, line_key, limit_key, reverses)
                 FROM ledger ORDER BY seq",
                "SELECT json_array(tenant_id, id, order_id, state, lines, expires_at, created_at, updated_at)
                 FROM reservations ORDER BY id",
                "SELECT name || ' ' || tbl_name FROM sqlite_schema WHERE type = 'index' AND sql IS NOT NULL
                 AND tbl_name IN ('ledger', 'reservations') ORDER BY name",
            ] {
                let mut statement = conn.prepare(sql).expect("select");
                let found = statement.query_map([], |r| r.get::<_, String>(0)).expect("rows");
                rows.extend(found.map(|r| r.expect("row")));
            }
            rows
        };
        let before = dump(&conn);
        run(&mut conn).expect("the rest");
        assert_eq!(dump(&conn), before);
        let next: i64 = conn
            .query_row(
                "INSERT INTO ledger (tenant_id, resource_key, op, qty, request_id, available_after, reserved_after,
                                     consumed_after, version_after, at)
                 VALUES ('shop', 'a', 'adjust', 1, 'req_4', 11, 0, 0, 4, 103) RETURNING seq",
                [],
                |r| r.get(0),
            )
            .expect("a new entry");
        assert_eq!(next, 42, "numbering carries on after the copied entries");
        let refused = conn.execute(
            "INSERT INTO ledger (tenant_id, resource_key, op, qty, request_id, available_after, reserved_after,
                                 consumed_after, version_after, at)
             VALUES ('shop', 'a', 'steal', 1, 'req_5', 11, 0, 0, 5, 104)",
            [],
        );
        assert!(refused.is_err_and(|e| e.to_string().contains("CHECK")), "an unknown op is refused");
        let refused = conn.execute("UPDATE reservations SET state = 'lost' WHERE id = 'rsv_1'", []);
        assert!(refused.is_err_and(|e| e.to_string().contains("CHECK")), "an unknown state is refused");
        let duplicate = conn.execute(
            "INSERT INTO ledger (tenant_id, resource_key, bucket, op, qty, request_id, available_after, reserved_after,
                                 consumed_after, version_after, at)
             VALUES ('shop', 'a', 0, 'deduct', 2, 'req_1', 6, 0, 4, 6, 105)",
            [],
        );
        assert!(duplicate.is_err_and(|e| e.to_string().contains("UNIQUE")), "the ledger's identity still holds");
    }

    #[test]
    fn a_changed_or_half_applied_migration_stops_the_start() {
        let (_dir, mut conn) = fresh();
        run(&mut conn).expect("first run");
        conn.execute("UPDATE _sqlx_migrations SET checksum = x'00' WHERE version = 1", []).expect("tamper");
        let changed = run(&mut conn).expect_err("a changed migration is refused");
        assert!(changed.to_string().contains("changed after it was applied"), "{changed}");
        conn.execute("UPDATE _sqlx_migrations SET success = FALSE WHERE version = 1", []).expect("tamper");
        let dirty = run(&mut conn).expect_err("a half-applied migration is refused");
        assert!(dirty.to_string().contains("half-applied"), "{dirty}");
    }

    /// An event is written to two b-trees: the table, kept in the order of the feed, and its
    /// index by id (0021; there were four: the rowid table, its index by id, the feed's and one
    /// by age).
    #[test]
    fn an_event_is_written_to_two_btrees() {
        use super::super::port::INSERT_EVENT;
        let (_dir, mut conn) = fresh();
        run(&mut conn).expect("migrations");
        let program = opcodes(&conn, INSERT_EVENT);
        let opened = program.iter().filter(|op| *op == "OpenWrite").count();
        assert_eq!(opened, 2, "{program:?}");
    }

    /// 0021 rebuilds `events` with its rows, and the purge then deletes the events whose id
    /// and time are both past the cut, walking the ids from the oldest rather than the table.
    #[test]
    fn the_rebuilt_events_keep_their_rows_and_are_purged_by_id() {
        let (_dir, mut conn) = fresh();
        run_through(&mut conn, 20).expect("migrations up to 0020");
        let cut = 1_800_000_000_000_i64;
        let old = crate::events::first_event_id_at(cut - 1);
        let young = crate::events::first_event_id_at(cut);
        // An old id whose `at` is young (its change is younger than its id) is kept too.
        let old_young_at = crate::events::first_event_id_at(cut - 2);
        conn.execute_batch(&format!(
            "INSERT INTO events (id, tenant_id, seq, type, ordering_key, at, data)
             VALUES ('{old}', 'shop', 1, 'order.applied', 'order:a', {}, '{{\"a\":1}}'),
                    ('{old_young_at}', 'shop', 2, 'order.applied', 'order:b', {cut}, '{{}}'),
                    ('{young}', 'shop', 3, 'order.applied', 'order:c', {cut}, '{{}}');",
            cut - 1
        ))
        .expect("events");
        run(&mut conn).expect("0021");
        let rows: Vec<(String, i64, String)> = conn
            .prepare("SELECT id, seq, data FROM events ORDER BY seq")
            .and_then(|mut s| s.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?.collect())
            .expect("the events");
        assert_eq!(
            rows,
            [
                (old.clone(), 1, "{\"a\":1}".to_string()),
                (old_young_at.clone(), 2, "{}".into()),
                (young.clone(), 3, "{}".into())
            ]
        );
        let by_id = conn
            .query_row("SELECT COUNT(*) FROM sqlite_schema WHERE name = 'events_by_id'", [], |r| r.get::<_, i64>(0))
            .expect("schema");
        assert_eq!(by_id, 1, "the index by id is there");
        let duplicate = conn.execute(
            "INSERT INTO events (id, tenant_id, seq, type, ordering_key, at, data) VALUES ('evt_x', 'shop', 3, 't', 'k', 1, '')",
            [],
        );
        assert!(duplicate.is_err_and(|e| e.to_string().contains("UNIQUE")), "a tenant's seq is still unique");
        let twice = conn.execute(
            &format!("INSERT INTO events (id, tenant_id, seq, type, ordering_key, at, data) VALUES ('{young}', 'shop', 4, 't', 'k', 1, '')"),
            [],
        );
        assert!(twice.is_err_and(|e| e.to_string().contains("UNIQUE")), "an id is still unique");

        let plan: Vec<String> = conn
            .prepare("EXPLAIN QUERY PLAN SELECT id FROM events WHERE id < ?1 AND at < ?2 ORDER BY id LIMIT ?3")
            .and_then(|mut s| s.query_map([&old, "0", "1"], |r| r.get::<_, String>(3))?.collect())
            .expect("a plan");
        assert!(plan.iter().any(|step| step.starts_with("SEARCH events USING INDEX events_by_id (id<?)")), "{plan:?}");
        assert_eq!(super::super::ops::purge_events(&conn, cut, 10).expect("a purge"), 1);
        let left: Vec<String> = conn
            .prepare("SELECT id FROM events ORDER BY id")
            .and_then(|mut s| s.query_map([], |r| r.get(0))?.collect())
            .expect("the events");
        assert_eq!(left, [old_young_at, young], "only the event old by its id and its time is gone");
    }

    /// 0022 keeps every record as it was (none finds an order: `ledger_seq` NULL) and every
    /// entry in `ledger_by_order`, through which its order is still found; its CHECK takes a
    /// record that answers or a stub that finds an order, and nothing in between.
    #[test]
    fn records_and_entries_from_before_0022_are_kept_and_still_found() {
        let (_dir, mut conn) = fresh();
        run_through(&mut conn, 21).expect("migrations up to 0021");
        conn.execute_batch(
            "INSERT INTO ledger (tenant_id, resource_key, bucket, op, qty, request_id, order_id, available_after,
                                 reserved_after, consumed_after, version_after, at)
             VALUES ('shop', 'a', 0, 'deduct', 2, 'req_1', 'ord-1', 8, 0, 2, 2, 100);
             INSERT INTO idempotency (tenant_id, key, request_hash, response_code, response_type, response_body,
                                      response_event, created_at)
             VALUES ('shop', 'ord-1', 'ab', 201, 'application/json', NULL, 'evt_1', 100),
                    ('shop', 'k-2', 'cd', 409, 'application/problem+json', '{}', NULL, 101);",
        )
        .expect("rows");
        run(&mut conn).expect("0022");
        // key, request hash, response code, ledger_seq
        type Record = (String, Option<String>, Option<i64>, Option<i64>);
        let records: Vec<Record> = conn
            .prepare("SELECT key, request_hash, response_code, ledger_seq FROM idempotency ORDER BY key")
            .and_then(|mut s| s.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))?.collect())
            .expect("the records");
        assert_eq!(
            records,
            [("k-2".into(), Some("cd".into()), Some(409), None), ("ord-1".into(), Some("ab".into()), Some(201), None)]
        );
        let indexed = conn
            .query_row(
                "SELECT COUNT(*) FROM ledger INDEXED BY ledger_by_order
                 WHERE tenant_id = 'shop' AND order_id = 'ord-1' AND by_key IS NULL",
                [],
                |r| r.get::<_, i64>(0),
            )
            .expect("the index");
        assert_eq!(indexed, 1, "the entry is still in ledger_by_order");
        let found = crate::apply::port::run_now(crate::apply::port::Port::order_entries(
            &mut super::super::port::SqlitePort::new(&conn),
            "shop",
            "ord-1",
            10,
        ))
        .expect("the order's entries");
        assert_eq!(found.iter().map(|e| (e.resource.as_str(), e.qty)).collect::<Vec<_>>(), [("a", 2)]);

        let half = conn.execute(
            "INSERT INTO idempotency (tenant_id, key, request_hash, response_code, response_type, created_at)
             VALUES ('shop', 'k-3', NULL, 201, 'application/json', 102)",
            [],
        );
        assert!(half.is_err_and(|e| e.to_string().contains("CHECK")), "a record that answers has its hash");
        let lost = conn.execute("INSERT INTO idempotency (tenant_id, key, created_at) VALUES ('shop', 'k-4', 102)", []);
        assert!(lost.is_err_and(|e| e.to_string().contains("CHECK")), "a stub finds an order");
        conn.execute(
            "INSERT INTO idempotency (tenant_id, key, created_at, ledger_seq) VALUES ('shop', 'k-5', 102, 1)",
            [],
        )
        .expect("a stub");
    }
}

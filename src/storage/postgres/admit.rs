//! Batch admission on PostgreSQL: the orders of one batch decided together against the resource
//! rows the batch locked (and read) up front, written back with one statement per kind of write
//! instead of several round trips per order. See [`crate::engine::admission`] for the rules and
//! `sqlite::ops::execute_orders_fast` for the SQLite twin.
//!
//! Across processes nothing changes: the rows are locked (`FOR UPDATE`, in the global order)
//! before they are read, each idempotency key is claimed by inserting its row before any
//! business write (a duplicate in another process waits on it and replays), and each changed
//! row is written guarded by the version it was read at.

use std::collections::{HashMap, HashSet};

use sqlx::{PgConnection, Row};
use ulid::Ulid;

use crate::engine::admission::{self, Row as AdmissionRow};
use crate::engine::{Action, Kind, OrderDocument, OrderStatus};
use crate::storage::rules::{new_request_id, reservation_lines_json};
use crate::storage::{Idempotent, OrderExecution, OrderJob, StorageError, StoredResponse};
use crate::time::Timestamp;

/// Resource rows by tenant, then key, as the batch read them under its locks.
pub type LockedRows = HashMap<String, HashMap<String, AdmissionRow>>;

/// Maps the rows of the batch's locking read (`tenant_id, key, kind, status, buckets, available,
/// reserved, consumed, version`).
pub fn locked_rows(rows: &[sqlx::postgres::PgRow]) -> Result<LockedRows, StorageError> {
    let mut locked = LockedRows::new();
    for row in rows {
        let kind: &str = row.try_get("kind")?;
        let status: &str = row.try_get("status")?;
        let parsed = AdmissionRow {
            kind: Kind::from_db(kind).ok_or_else(|| StorageError::Internal("unexpected resource kind".into()))?,
            active: status == "active",
            buckets: row.try_get("buckets")?,
            available: row.try_get("available")?,
            reserved: row.try_get("reserved")?,
            consumed: row.try_get("consumed")?,
            version: row.try_get("version")?,
        };
        locked.entry(row.try_get("tenant_id")?).or_default().insert(row.try_get("key")?, parsed);
    }
    Ok(locked)
}

/// Whether admission may decide this order: no limits or creation, and every target it names
/// that exists is a single-bucket row the batch locked.
fn eligible(job: &OrderJob, rows: &LockedRows) -> bool {
    let tenant_rows = rows.get(job.tenant.as_str());
    admission::admissible(&job.plan)
        && job.plan.resources().all(|key| tenant_rows.and_then(|r| r.get(key.as_str())).is_none_or(|r| r.buckets == 1))
}

/// The column arrays of one multi-row statement.
#[derive(Default)]
struct Ledger {
    tenant: Vec<String>,
    key: Vec<String>,
    op: Vec<&'static str>,
    qty: Vec<i64>,
    request_id: Vec<String>,
    order_id: Vec<String>,
    reservation_id: Vec<Option<String>>,
    available: Vec<i64>,
    reserved: Vec<i64>,
    consumed: Vec<i64>,
    version: Vec<i64>,
    plugin_version: Vec<i64>,
    at: Vec<i64>,
}

#[derive(Default)]
struct Reservations {
    tenant: Vec<String>,
    id: Vec<String>,
    order_id: Vec<String>,
    lines: Vec<String>,
    expires_at: Vec<i64>,
    created_at: Vec<i64>,
}

#[derive(Default)]
struct Responses {
    tenant: Vec<String>,
    key: Vec<String>,
    code: Vec<i32>,
    kind: Vec<&'static str>,
    body: Vec<String>,
}

/// Decides the batch's orders together (see the module docs). `None` for an order left to the
/// per-order path. Runs inside the caller's savepoint: on any error nothing of it stands, and an
/// `Unavailable` error means the batch should run again.
pub async fn execute_orders_fast(
    conn: &mut PgConnection,
    jobs: &[(&OrderJob, i64)],
    mut rows: LockedRows,
) -> Result<Vec<Option<OrderExecution>>, StorageError> {
    let read_at: HashMap<(String, String), i64> =
        rows.iter().flat_map(|(t, keys)| keys.iter().map(move |(k, r)| ((t.clone(), k.clone()), r.version))).collect();
    // Claim every candidate's key in one statement; a key used before (or twice in this batch)
    // is left to the per-order path, which replays or refuses it.
    let mut seen = HashSet::new();
    let candidates: Vec<usize> = (0..jobs.len())
        .filter(|&i| {
            let (job, _) = jobs[i];
            eligible(job, &rows) && seen.insert((job.tenant.as_str(), job.idempotency.key.as_str()))
        })
        .collect();
    let claimed = claim(conn, jobs, &candidates).await?;

    let mut out: Vec<Option<OrderExecution>> = vec![None; jobs.len()];
    let (mut ledger, mut reservations, mut responses) =
        (Ledger::default(), Reservations::default(), Responses::default());
    let mut last_ms = 0;
    for i in candidates {
        let (job, now_ms) = jobs[i];
        if !claimed.contains(&(job.tenant.to_string(), job.idempotency.key.to_string())) {
            continue;
        }
        let tenant_rows = rows.entry(job.tenant.to_string()).or_default();
        let Some(admitted) = admission::admit(tenant_rows, &job.plan, job.order.action) else {
            return Err(StorageError::Internal("an eligible order was not admissible".into()));
        };
        last_ms = last_ms.max(now_ms);
        let request_id = new_request_id();
        let reservation = (job.order.action == Action::Reserve)
            .then(|| (format!("rsv_{}", Ulid::new()), Timestamp(now_ms.saturating_add(job.ttl_ms))));
        for change in &admitted.changes {
            ledger.tenant.push(job.tenant.to_string());
            ledger.key.push(change.resource.clone());
            ledger.op.push(change.op.as_str());
            ledger.qty.push(change.qty);
            ledger.request_id.push(request_id.clone());
            ledger.order_id.push(job.order.order_id.to_string());
            ledger.reservation_id.push(reservation.as_ref().map(|(id, _)| id.clone()));
            ledger.available.push(change.after[0]);
            ledger.reserved.push(change.after[1]);
            ledger.consumed.push(change.after[2]);
            ledger.version.push(change.version_after);
            ledger.plugin_version.push(job.plan.planner.version);
            ledger.at.push(now_ms);
        }
        if admitted.status != OrderStatus::Rejected {
            if let Some((id, expires_at)) = &reservation {
                reservations.tenant.push(job.tenant.to_string());
                reservations.id.push(id.clone());
                reservations.order_id.push(job.order.order_id.to_string());
                reservations.lines.push(reservation_lines_json(job, &admitted.results, &[])?);
                reservations.expires_at.push(expires_at.0);
                reservations.created_at.push(now_ms);
            }
        }
        let document = OrderDocument::build(&job.order, &job.plan, &admitted.results, reservation);
        let code = if admitted.status == OrderStatus::Rejected { 409 } else { 201 };
        let response = StoredResponse::json(code, &document)?;
        responses.tenant.push(job.tenant.to_string());
        responses.key.push(job.idempotency.key.to_string());
        responses.code.push(i32::from(response.status));
        responses.kind.push(response.content_type.as_str());
        responses.body.push(response.body.clone());
        out[i] = Some(OrderExecution {
            response: Idempotent::Fresh(response),
            outcome: Some((admitted.status, admitted.results)),
        });
    }
    write_rows(conn, &rows, &read_at, last_ms).await?;
    write_ledger(conn, &ledger).await?;
    write_reservations(conn, &reservations).await?;
    write_responses(conn, &responses).await?;
    Ok(out)
}

/// Inserts the candidates' idempotency rows; returns the keys this transaction now holds.
async fn claim(
    conn: &mut PgConnection,
    jobs: &[(&OrderJob, i64)],
    candidates: &[usize],
) -> Result<HashSet<(String, String)>, StorageError> {
    if candidates.is_empty() {
        return Ok(HashSet::new());
    }
    let pick = |f: &dyn Fn(&OrderJob, i64) -> String| -> Vec<String> {
        candidates.iter().map(|&i| f(jobs[i].0, jobs[i].1)).collect()
    };
    let tenants = pick(&|j, _| j.tenant.to_string());
    let keys = pick(&|j, _| j.idempotency.key.to_string());
    let hashes = pick(&|j, _| j.idempotency.request_hash.clone());
    let created: Vec<i64> = candidates.iter().map(|&i| jobs[i].1).collect();
    let rows = sqlx::query(
        "INSERT INTO idempotency (tenant_id, key, request_hash, created_at)
         SELECT * FROM UNNEST($1::text[], $2::text[], $3::text[], $4::bigint[])
         ON CONFLICT (tenant_id, key) DO NOTHING
         RETURNING tenant_id, key",
    )
    .bind(&tenants)
    .bind(&keys)
    .bind(&hashes)
    .bind(&created)
    .fetch_all(&mut *conn)
    .await?;
    rows.iter().map(|r| Ok((r.try_get("tenant_id")?, r.try_get("key")?))).collect()
}

/// Writes each changed row once, guarded by the version it was read at.
async fn write_rows(
    conn: &mut PgConnection,
    rows: &LockedRows,
    read_at: &HashMap<(String, String), i64>,
    now_ms: i64,
) -> Result<(), StorageError> {
    let (mut tenant, mut key, mut available, mut reserved, mut consumed, mut version, mut was) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (t, keys) in rows {
        for (k, row) in keys {
            let Some(&read) = read_at.get(&(t.clone(), k.clone())) else { continue };
            if row.version == read {
                continue;
            }
            tenant.push(t.clone());
            key.push(k.clone());
            available.push(row.available);
            reserved.push(row.reserved);
            consumed.push(row.consumed);
            version.push(row.version);
            was.push(read);
        }
    }
    if tenant.is_empty() {
        return Ok(());
    }
    let written = sqlx::query(
        "UPDATE resources r SET available = u.available, reserved = u.reserved, consumed = u.consumed,
                version = u.version, updated_at = $8
         FROM UNNEST($1::text[], $2::text[], $3::bigint[], $4::bigint[], $5::bigint[], $6::bigint[], $7::bigint[])
              AS u (tenant_id, key, available, reserved, consumed, version, was)
         WHERE r.tenant_id = u.tenant_id AND r.key = u.key AND r.version = u.was",
    )
    .bind(&tenant)
    .bind(&key)
    .bind(&available)
    .bind(&reserved)
    .bind(&consumed)
    .bind(&version)
    .bind(&was)
    .bind(now_ms)
    .execute(&mut *conn)
    .await?
    .rows_affected();
    if written != tenant.len() as u64 {
        // The rows are locked by this transaction: another writer cannot have moved them.
        return Err(StorageError::Internal("a locked resource row changed under its batch".into()));
    }
    Ok(())
}

async fn write_ledger(conn: &mut PgConnection, l: &Ledger) -> Result<(), StorageError> {
    if l.tenant.is_empty() {
        return Ok(());
    }
    sqlx::query(
        "INSERT INTO ledger (tenant_id, resource_key, bucket, op, qty, request_id, order_id, reservation_id,
                             available_after, reserved_after, consumed_after, version_after, plugin_version, at)
         SELECT t, k, 0, o, q, rq, oi, ri, a, r, c, v, pv, at
         FROM UNNEST($1::text[], $2::text[], $3::text[], $4::bigint[], $5::text[], $6::text[], $7::text[],
                     $8::bigint[], $9::bigint[], $10::bigint[], $11::bigint[], $12::bigint[], $13::bigint[])
              WITH ORDINALITY AS u (t, k, o, q, rq, oi, ri, a, r, c, v, pv, at, n)
         ORDER BY n",
    )
    .bind(&l.tenant)
    .bind(&l.key)
    .bind(&l.op)
    .bind(&l.qty)
    .bind(&l.request_id)
    .bind(&l.order_id)
    .bind(&l.reservation_id)
    .bind(&l.available)
    .bind(&l.reserved)
    .bind(&l.consumed)
    .bind(&l.version)
    .bind(&l.plugin_version)
    .bind(&l.at)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

async fn write_reservations(conn: &mut PgConnection, r: &Reservations) -> Result<(), StorageError> {
    if r.tenant.is_empty() {
        return Ok(());
    }
    sqlx::query(
        "INSERT INTO reservations (tenant_id, id, order_id, state, lines, expires_at, created_at, updated_at)
         SELECT t, i, o, 'held', l, e, c, c
         FROM UNNEST($1::text[], $2::text[], $3::text[], $4::text[], $5::bigint[], $6::bigint[]) AS u (t, i, o, l, e, c)",
    )
    .bind(&r.tenant)
    .bind(&r.id)
    .bind(&r.order_id)
    .bind(&r.lines)
    .bind(&r.expires_at)
    .bind(&r.created_at)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

async fn write_responses(conn: &mut PgConnection, r: &Responses) -> Result<(), StorageError> {
    if r.tenant.is_empty() {
        return Ok(());
    }
    let updated = sqlx::query(
        "UPDATE idempotency i SET response_code = u.code, response_type = u.kind, response_body = u.body
         FROM UNNEST($1::text[], $2::text[], $3::int[], $4::text[], $5::text[]) AS u (tenant_id, key, code, kind, body)
         WHERE i.tenant_id = u.tenant_id AND i.key = u.key",
    )
    .bind(&r.tenant)
    .bind(&r.key)
    .bind(&r.code)
    .bind(&r.kind)
    .bind(&r.body)
    .execute(&mut *conn)
    .await?
    .rows_affected();
    if updated != r.tenant.len() as u64 {
        return Err(StorageError::Internal("an idempotency key of the batch was not claimed".into()));
    }
    Ok(())
}

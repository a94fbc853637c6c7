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

/// Maps the rows of the batch's locking read (`tenant_id, key, kind, status, mode, buckets, available,
/// reserved, consumed, version`).
pub fn locked_rows(rows: &[sqlx::postgres::PgRow]) -> Result<LockedRows, StorageError> {
    let mut locked = LockedRows::new();
    for row in rows {
        let kind: &str = row.try_get("kind")?;
        let status: &str = row.try_get("status")?;
        let parsed = AdmissionRow {
            kind: Kind::from_db(kind).ok_or_else(|| StorageError::Internal("unexpected resource kind".into()))?,
            active: status == "active",
            redis: row.try_get::<&str, _>("mode")? == "redis",
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
/// that exists is a single-bucket, database-mode row the batch locked.
fn eligible(job: &OrderJob, rows: &LockedRows) -> bool {
    let tenant_rows = rows.get(job.tenant.as_str());
    admission::admissible(&job.plan)
        && job
            .plan
            .resources()
            .all(|key| tenant_rows.and_then(|r| r.get(key.as_str())).is_none_or(AdmissionRow::admissible))
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
/// per-order path. Runs first in the batch's transaction: on any error the batch is rolled back
/// and run again (an `Unavailable` error as a retry, any other without admission).
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
    let holds = |i: &usize| {
        let job = jobs[*i].0;
        claimed.contains(&(job.tenant.to_string(), job.idempotency.key.to_string()))
    };
    let (candidates, used_before): (Vec<usize>, Vec<usize>) = candidates.into_iter().partition(holds);

    let mut out: Vec<Option<OrderExecution>> = vec![None; jobs.len()];
    // Keys used before (committed: the claim waited for any transaction holding them) are
    // answered from their stored outcomes, read in one statement.
    let mut stored = stored_outcomes(conn, jobs, &used_before).await?;
    for i in used_before {
        let job = jobs[i].0;
        let id = (job.tenant.to_string(), job.idempotency.key.to_string());
        out[i] = stored.remove(&id).map(|(hash, response)| OrderExecution {
            response: if hash == job.idempotency.request_hash {
                Idempotent::Replayed(response)
            } else {
                Idempotent::Mismatch
            },
            outcome: None,
        });
    }
    let (mut ledger, mut reservations, mut responses) =
        (Ledger::default(), Reservations::default(), Responses::default());
    let mut last_ms = 0;
    for i in candidates {
        let (job, now_ms) = jobs[i];
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
    write(conn, &changed_rows(&rows, &read_at), &ledger, &reservations, &responses, last_ms).await?;
    Ok(out)
}

/// The request hash and stored response of each of these jobs' keys that has one; a key
/// without (purged meanwhile) is left to the per-order path.
async fn stored_outcomes(
    conn: &mut PgConnection,
    jobs: &[(&OrderJob, i64)],
    which: &[usize],
) -> Result<HashMap<(String, String), (String, StoredResponse)>, StorageError> {
    if which.is_empty() {
        return Ok(HashMap::new());
    }
    let tenants: Vec<String> = which.iter().map(|&i| jobs[i].0.tenant.to_string()).collect();
    let keys: Vec<String> = which.iter().map(|&i| jobs[i].0.idempotency.key.to_string()).collect();
    let rows = sqlx::query(
        "SELECT i.tenant_id, i.key, i.request_hash, i.response_code, i.response_type, i.response_body
         FROM idempotency i JOIN UNNEST($1::text[], $2::text[]) AS u (tenant_id, key)
           ON i.tenant_id = u.tenant_id AND i.key = u.key",
    )
    .bind(&tenants)
    .bind(&keys)
    .fetch_all(&mut *conn)
    .await?;
    let mut found = HashMap::with_capacity(rows.len());
    for row in rows {
        if let Some(response) = super::ops::stored_response(&row)? {
            found.insert((row.try_get("tenant_id")?, row.try_get("key")?), (row.try_get("request_hash")?, response));
        }
    }
    Ok(found)
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

/// The rows admission changed, as the column arrays of their guarded UPDATE.
#[derive(Default)]
struct Changed {
    tenant: Vec<String>,
    key: Vec<String>,
    available: Vec<i64>,
    reserved: Vec<i64>,
    consumed: Vec<i64>,
    version: Vec<i64>,
    /// The version each was read at: the guard.
    was: Vec<i64>,
}

fn changed_rows(rows: &LockedRows, read_at: &HashMap<(String, String), i64>) -> Changed {
    let mut c = Changed::default();
    for (t, keys) in rows {
        for (k, row) in keys {
            let Some(&read) = read_at.get(&(t.clone(), k.clone())) else { continue };
            if row.version == read {
                continue;
            }
            c.tenant.push(t.clone());
            c.key.push(k.clone());
            c.available.push(row.available);
            c.reserved.push(row.reserved);
            c.consumed.push(row.consumed);
            c.version.push(row.version);
            c.was.push(read);
        }
    }
    c
}

/// Every write of the batch's admitted orders in one statement (one round trip): the changed
/// rows (guarded by the version read), the ledger rows in order, the reservations, the stored
/// responses. Data-modifying CTEs all run to completion; the counts prove the guards held.
async fn write(
    conn: &mut PgConnection,
    c: &Changed,
    l: &Ledger,
    r: &Reservations,
    i: &Responses,
    now_ms: i64,
) -> Result<(), StorageError> {
    let counts = sqlx::query(
        "WITH written AS (
            UPDATE resources r SET available = u.available, reserved = u.reserved, consumed = u.consumed,
                   version = u.version, updated_at = $8
            FROM UNNEST($1::text[], $2::text[], $3::bigint[], $4::bigint[], $5::bigint[], $6::bigint[], $7::bigint[])
                 AS u (tenant_id, key, available, reserved, consumed, version, was)
            WHERE r.tenant_id = u.tenant_id AND r.key = u.key AND r.version = u.was
            RETURNING 1),
         ledgered AS (
            INSERT INTO ledger (tenant_id, resource_key, bucket, op, qty, request_id, order_id, reservation_id,
                                available_after, reserved_after, consumed_after, version_after, plugin_version, at)
            SELECT t, k, 0, o, q, rq, oi, ri, a, rs, cs, v, pv, at
            FROM UNNEST($9::text[], $10::text[], $11::text[], $12::bigint[], $13::text[], $14::text[], $15::text[],
                        $16::bigint[], $17::bigint[], $18::bigint[], $19::bigint[], $20::bigint[], $21::bigint[])
                 WITH ORDINALITY AS u (t, k, o, q, rq, oi, ri, a, rs, cs, v, pv, at, n)
            ORDER BY n
            RETURNING 1),
         held AS (
            INSERT INTO reservations (tenant_id, id, order_id, state, lines, expires_at, created_at, updated_at)
            SELECT t, id, o, 'held', ls, e, cr, cr
            FROM UNNEST($22::text[], $23::text[], $24::text[], $25::text[], $26::bigint[], $27::bigint[])
                 AS u (t, id, o, ls, e, cr)
            RETURNING 1),
         answered AS (
            UPDATE idempotency i SET response_code = u.code, response_type = u.kind, response_body = u.body
            FROM UNNEST($28::text[], $29::text[], $30::int[], $31::text[], $32::text[]) AS u (tenant_id, key, code, kind, body)
            WHERE i.tenant_id = u.tenant_id AND i.key = u.key
            RETURNING 1)
         SELECT (SELECT COUNT(*) FROM written) AS written, (SELECT COUNT(*) FROM ledgered) AS ledgered,
                (SELECT COUNT(*) FROM held) AS held, (SELECT COUNT(*) FROM answered) AS answered",
    )
    .bind(&c.tenant)
    .bind(&c.key)
    .bind(&c.available)
    .bind(&c.reserved)
    .bind(&c.consumed)
    .bind(&c.version)
    .bind(&c.was)
    .bind(now_ms)
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
    .bind(&r.tenant)
    .bind(&r.id)
    .bind(&r.order_id)
    .bind(&r.lines)
    .bind(&r.expires_at)
    .bind(&r.created_at)
    .bind(&i.tenant)
    .bind(&i.key)
    .bind(&i.code)
    .bind(&i.kind)
    .bind(&i.body)
    .fetch_one(&mut *conn)
    .await?;
    let count = |name: &str| -> Result<u64, StorageError> { Ok(counts.try_get::<i64, _>(name)?.max(0) as u64) };
    let expected = [
        ("written", c.tenant.len()),
        ("ledgered", l.tenant.len()),
        ("held", r.tenant.len()),
        ("answered", i.tenant.len()),
    ];
    for (name, want) in expected {
        if count(name)? != want as u64 {
            // The rows are locked and the keys claimed by this transaction: nothing else can
            // have moved them. A mismatch is a bug; the batch is decided again order by order.
            return Err(StorageError::Internal(format!(
                "batch admission wrote {name} {} times, not {want}",
                count(name)?
            )));
        }
    }
    Ok(())
}

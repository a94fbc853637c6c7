//! The outbox on MySQL: numbering a transaction's events at its end, and reading the feed.
//!
//! A job's events are held by its batch attempt ([`WRITTEN`]), in the order emitted; a job rolled
//! back to its savepoint takes its own back. Just before COMMIT the batcher inserts what is left,
//! numbered, in one statement: it bumps each tenant's `event_seqs` row by its count and holds that
//! row until the commit. A tenant's next transaction waits there, so its events commit in
//! sequence order and a reader paging `seq > after` never misses one that commits later with a
//! lower number. The row is taken after every resource row the transaction locks, so no lock
//! cycle runs through it.
//!
//! Held rather than inserted unnumbered and numbered at the end, as on PostgreSQL: one write of
//! each event row.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};

use sqlx::{MySqlConnection, Row};

use crate::events::{new_event_id, Event, NewEvent};
use crate::storage::rows::Columns;
use crate::storage::StorageError;

/// An event of the batch attempt, its id made when it was emitted (ids sort in the order made).
#[derive(Debug)]
pub(super) struct Held {
    id: String,
    event: NewEvent,
}

tokio::task_local! {
    /// The events a batch attempt emitted so far, in the order emitted: what [`seal`] inserts.
    /// A job rolled back to its savepoint takes its own back ([`rollback_to`]).
    pub(super) static WRITTEN: RefCell<Vec<Held>>;
}

/// Holds events the current batch attempt emitted (in its transaction) until [`seal`].
pub(super) fn hold(events: &[NewEvent]) -> Result<(), StorageError> {
    WRITTEN
        .try_with(|w| w.borrow_mut().extend(events.iter().map(|e| Held { id: new_event_id(), event: e.clone() })))
        .map_err(|_| StorageError::Internal("an event was written outside a batch".into()))
}

/// Where the attempt's events stand (before a job's savepoint).
pub(super) fn mark() -> usize {
    WRITTEN.try_with(|w| w.borrow().len()).unwrap_or(0)
}

/// Forgets the events written since `mark` (their savepoint rolled back).
pub(super) fn rollback_to(mark: usize) {
    let _ = WRITTEN.try_with(|w| w.borrow_mut().truncate(mark));
}

/// Inserts the events the attempt emitted, numbered in the order emitted, and returns their
/// types: each tenant's sequence is bumped by its count (tenants in one order, so two sealing
/// transactions never wait on each other in a cycle).
pub(super) async fn seal(conn: &mut MySqlConnection) -> Result<Vec<String>, sqlx::Error> {
    // Taken: a seal that fails fails its attempt, and a rerun starts from an empty list.
    let held = WRITTEN.try_with(|w| std::mem::take(&mut *w.borrow_mut())).unwrap_or_default();
    if held.is_empty() {
        return Ok(Vec::new());
    }
    let mut counts: BTreeMap<&str, i64> = BTreeMap::new();
    for h in &held {
        *counts.entry(h.event.tenant.as_str()).or_default() += 1;
    }
    // One upsert in tenant order: the rows are locked (and held to COMMIT) in that order.
    let sql = format!(
        "INSERT INTO event_seqs (tenant_id, last) VALUES {} ON DUPLICATE KEY UPDATE last = last + VALUES(last)",
        vec!["(?, ?)"; counts.len()].join(", ")
    );
    let mut bump = sqlx::query(&sql);
    for (tenant, count) in &counts {
        bump = bump.bind(*tenant).bind(*count);
    }
    bump.execute(&mut *conn).await?;
    // READ COMMITTED: this reads the rows as this transaction left them, locked by it.
    let sql = format!("SELECT tenant_id, last FROM event_seqs WHERE tenant_id IN ({})", vec!["?"; counts.len()].join(", "));
    let mut read = sqlx::query(&sql);
    for tenant in counts.keys() {
        read = read.bind(*tenant);
    }
    let mut lasts: HashMap<String, i64> = HashMap::with_capacity(counts.len());
    for row in read.fetch_all(&mut *conn).await? {
        lasts.insert(row.try_get_unchecked("tenant_id")?, row.try_get("last")?);
    }
    // The next number of each tenant: its new last minus its count, plus one.
    let mut next: HashMap<&str, i64> = HashMap::with_capacity(counts.len());
    for (tenant, count) in &counts {
        let last = lasts.get(*tenant).copied().ok_or_else(|| sqlx::Error::RowNotFound)?;
        next.insert(tenant, last - count + 1);
    }
    let sql = format!(
        "INSERT INTO events (id, tenant_id, seq, type, ordering_key, at, data) VALUES {}",
        vec!["(?, ?, ?, ?, ?, ?, ?)"; held.len()].join(", ")
    );
    let mut insert = sqlx::query(&sql);
    for h in &held {
        let seq = next.get_mut(h.event.tenant.as_str()).map(|n| {
            *n += 1;
            *n - 1
        });
        insert = insert
            .bind(&h.id)
            .bind(&h.event.tenant)
            .bind(seq)
            .bind(h.event.kind.as_str())
            .bind(&h.event.ordering_key)
            .bind(h.event.at)
            .bind(&h.event.data);
    }
    insert.execute(&mut *conn).await?;
    Ok(held.iter().map(|h| h.event.kind.as_str().to_string()).collect())
}

/// The columns [`event`] reads.
pub(super) const EVENT_COLUMNS: &str = "id, tenant_id, seq, type, ordering_key, at, data";

pub(super) fn event(row: &sqlx::mysql::MySqlRow) -> Result<Event, StorageError> {
    let seq: Option<i64> = row.opt_int("seq")?;
    Ok(Event {
        id: row.text("id")?,
        tenant: row.text("tenant_id")?,
        seq: seq.ok_or_else(|| StorageError::Internal("an unnumbered event was read".into()))?,
        kind: row.text("type")?,
        ordering_key: row.text("ordering_key")?,
        at: row.int("at")?,
        data: row.text("data")?,
    })
}

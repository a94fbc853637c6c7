//! The outbox on MySQL: numbering a batch attempt's held events at its end
//! ([`crate::storage::held_events`]) in three statements, and reading the feed.

use std::collections::{BTreeMap, HashMap};

use sqlx::{MySqlConnection, Row};

use crate::storage::held_events;

/// Inserts the events the attempt emitted, numbered in the order emitted, and returns their
/// types: each tenant's sequence is bumped by its count (tenants in one order, so two sealing
/// transactions never wait on each other in a cycle).
pub(crate) async fn seal(conn: &mut MySqlConnection) -> Result<Vec<String>, sqlx::Error> {
    let held = held_events::take();
    if held.is_empty() {
        return Ok(Vec::new());
    }
    let mut counts: BTreeMap<&str, i64> = BTreeMap::new();
    for h in &held {
        *counts.entry(h.tenant.as_str()).or_default() += 1;
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
    let sql =
        format!("SELECT tenant_id, last FROM event_seqs WHERE tenant_id IN ({})", vec!["?"; counts.len()].join(", "));
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
        let seq = next.get_mut(h.tenant.as_str()).map(|n| {
            *n += 1;
            *n - 1
        });
        insert = insert
            .bind(&h.id)
            .bind(&h.tenant)
            .bind(seq)
            .bind(h.kind.as_str())
            .bind(&h.ordering_key)
            .bind(h.at)
            .bind(crate::storage::payload::pack(&h.data));
    }
    insert.execute(&mut *conn).await?;
    Ok(held.iter().map(|h| h.kind.as_str().to_string()).collect())
}

//! The settlement consumer every process runs: for each redis-mode resource it reads new
//! entries of the resource's stream as a member of the consumer group, applies them to the
//! database (a run of deductions as one write, any other record as one of its own, all sharing
//! group commits), and acknowledges them after the commit. Entries a consumer took and never
//! acknowledged (it died) are reclaimed with `XAUTOCLAIM` once idle for `claim_idle_ms`. A
//! record the database refuses is recorded as a settlement failure (and acknowledged: it is
//! kept in the database, not lost). A record that could not be settled at all (database down)
//! stays pending and is reclaimed.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::join_all;
use redis::streams::{StreamAutoClaimReply, StreamId, StreamReadReply};

use super::supervisor::JobCtx;
use crate::apply::settlement::runs_together;
use crate::engine::{ResourceKey, TenantId};
use crate::redis_mode::{RedisMode, RedisModeError, StreamOwner, GROUP};
use crate::storage::redis_store::{DeadLetter, SettleRecord, Settled};
use crate::storage::{Storage, StorageError};
use crate::time::{now_ms, Timestamp};
/// How often each stream is searched for entries of dead consumers.
const CLAIM_EVERY: Duration = Duration::from_millis(500);
/// How soon the modes are read again after a new connection to Redis (at most this often while
/// the database cannot answer).
const CATCH_UP_EVERY: Duration = Duration::from_millis(100);
/// Longest time between two searches for consumers of dead processes (half the idle time
/// after which one is removed, at least `CLAIM_EVERY`).
const SWEEP_CONSUMERS_MAX_EVERY: Duration = Duration::from_secs(60);

/// Removes from the group every consumer but this process's own (ARGV[2]) idle at least
/// ARGV[3] ms with no pending entry (its entries were reclaimed by others first), and returns
/// how many. One script, so no consumer can take an entry between the check and the removal.
/// KEYS[1]: the stream; ARGV[1]: the group.
const REMOVE_DEAD_CONSUMERS: &str = r#"
local removed = 0
for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local f = {}
  for i = 1, #c, 2 do f[c[i]] = c[i + 1] end
  if f['name'] ~= ARGV[2] and tonumber(f['pending']) == 0 and tonumber(f['idle']) >= tonumber(ARGV[3]) then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], f['name'])
    removed = removed + 1
  end
end
return removed
"#;

/// The consumer's loop, run by the supervisor; it returns when the shutdown signal turns true.
/// Every completed pass over the streams counts as a successful run (Redis errors of one
/// stream are logged and retried at the next pass; `/readyz` reports Redis itself).
/// Consumers of dead processes idle longer than `dead_consumer_idle` are removed from the group.
pub async fn run(hot: Arc<RedisMode>, storage: Arc<dyn Storage>, dead_consumer_idle: Duration, ctx: JobCtx) {
    let mut shutdown = ctx.shutdown();
    let poll = Duration::from_millis(hot.settings.settle_poll_ms.max(1));
    let refresh_every = Duration::from_millis(hot.settings.mode_refresh_ms.max(1));
    let rewarming: Arc<Mutex<HashSet<(String, String)>>> = Arc::default();
    let mut refreshed: Option<Instant> = None;
    let mut claimed = Instant::now();
    let sweep_every = (dead_consumer_idle / 2).clamp(CLAIM_EVERY, SWEEP_CONSUMERS_MAX_EVERY);
    let mut swept = Instant::now();
    loop {
        ctx.fault_point().await;
        // Also at once after a new connection to Redis (it may hold another past: restarted,
        // restored from a snapshot, failed over).
        let due = refreshed.is_none_or(|at| at.elapsed() >= refresh_every)
            || (hot.behind_link() && refreshed.is_none_or(|at| at.elapsed() >= CATCH_UP_EVERY));
        if due {
            if let Err(err) = hot.refresh_modes(storage.as_ref()).await {
                tracing::warn!(error = %err, "listing redis-mode resources failed; will retry");
            }
            refreshed = Some(Instant::now());
            for (tenant, key) in hot.redis_resources() {
                rewarm_if_abandoned(&hot, &storage, &rewarming, tenant, key).await;
            }
        }
        let claim = claimed.elapsed() >= CLAIM_EVERY;
        if claim {
            claimed = Instant::now();
        }
        let mut busy = false;
        if claim {
            for (tenant, key) in hot.redis_resources() {
                expire_due(&hot, &tenant, &key).await;
            }
        }
        if swept.elapsed() >= sweep_every {
            swept = Instant::now();
            for (tenant, key) in hot.redis_resources() {
                remove_dead_consumers(&hot, &tenant, &key, dead_consumer_idle).await;
            }
        }
        for (tenant, key) in hot.redis_resources() {
            match settle_stream(&hot, storage.as_ref(), &tenant, &key, claim).await {
                Ok(n) => busy |= n > 0,
                Err(err) => tracing::debug!(error = %err, tenant = %tenant, key = %key, "settlement pass failed"),
            }
        }
        ctx.ok();
        if !busy {
            tokio::select! {
                _ = tokio::time::sleep(poll) => {}
                _ = shutdown.changed() => return,
            }
        }
        if *shutdown.borrow() {
            return;
        }
    }
}

/// One pass over one resource's stream: reclaimed entries (if `claim`), then new ones.
/// Returns how many entries it settled.
async fn settle_stream(
    hot: &RedisMode,
    storage: &dyn Storage,
    tenant: &str,
    key: &str,
    claim: bool,
) -> Result<usize, RedisModeError> {
    // One process at a time settles a stream, in stream order (a sale of stock a release
    // returned must not reach the database before that release).
    let owner = hot.own_stream(tenant, key).await?;
    if owner == StreamOwner::Other {
        return Ok(0);
    }
    let stream = hot.stream_key(tenant, key);
    let batch = hot.settings.settle_batch;
    let mut settled = 0;
    if claim || owner == StreamOwner::Taken {
        // Taken over: every entry another consumer still holds comes first, however recent
        // (that consumer no longer owns the stream). Else: those of dead consumers.
        let min_idle = if owner == StreamOwner::Taken { 0 } else { hot.settings.claim_idle_ms };
        let mut cmd = redis::cmd("XAUTOCLAIM");
        cmd.arg(&stream).arg(GROUP).arg(&hot.consumer).arg(min_idle).arg("0-0").arg("COUNT").arg(batch);
        let reply: StreamAutoClaimReply = match hot.link().query(&cmd).await {
            Ok(reply) => reply,
            Err(err) if err.code() == Some("NOGROUP") => StreamAutoClaimReply::default(),
            Err(err) => return Err(err.into()),
        };
        if !reply.claimed.is_empty() {
            metrics::counter!("stockd_settlement_reclaimed_total").increment(reply.claimed.len() as u64);
            tracing::info!(entries = reply.claimed.len(), tenant, key, "took over entries of another consumer");
        }
        let acked = apply(hot, storage, tenant, key, &reply.claimed).await;
        settled += acked;
        if acked < reply.claimed.len() {
            return Ok(settled);
        }
    }
    // This consumer's own entries delivered before and not acknowledged (their settlement
    // failed) go before any new one.
    for id in ["0", ">"] {
        // New entries only while this process still owns the stream: the pass may have
        // outlived its lease (a slow commit), and another process may be settling older
        // entries now.
        if id == ">" && hot.own_stream(tenant, key).await? != StreamOwner::Kept {
            return Ok(settled);
        }
        let mut cmd = redis::cmd("XREADGROUP");
        cmd.arg("GROUP").arg(GROUP).arg(&hot.consumer).arg("COUNT").arg(batch).arg("STREAMS").arg(&stream).arg(id);
        let reply: Result<Option<StreamReadReply>, _> = hot.link().query(&cmd).await;
        let reply = match reply {
            Ok(reply) => reply,
            // No group: the stream is gone (Redis lost its data; the next warm recreates both)
            // or was created by a sale before its group. Create the group on an existing stream
            // only, from its first entry, so a resource that left redis mode gets no stream back.
            Err(err) if err.code() == Some("NOGROUP") => {
                let mut create = redis::cmd("XGROUP");
                create.arg("CREATE").arg(&stream).arg(GROUP).arg("0");
                let _: Result<String, _> = hot.link().query(&create).await;
                return Ok(settled);
            }
            Err(err) => return Err(err.into()),
        };
        let entries: Vec<StreamId> =
            reply.map(|r| r.keys).unwrap_or_default().into_iter().flat_map(|k| k.ids).collect();
        let acked = apply(hot, storage, tenant, key, &entries).await;
        settled += acked;
        if acked < entries.len() {
            return Ok(settled);
        }
    }
    Ok(settled)
}

/// Settles entries (their database writes share group commits) and acknowledges each one
/// whose outcome is committed. Returns how many were acknowledged.
async fn apply(hot: &RedisMode, storage: &dyn Storage, tenant: &str, key: &str, entries: &[StreamId]) -> usize {
    let now = now_ms();
    let records: Vec<(String, Option<SettleRecord>, Option<i64>)> = entries
        .iter()
        .map(|e| {
            let mut record = e.get::<String>("r").and_then(|r| serde_json::from_str::<SettleRecord>(&r).ok());
            if let Some(r) = record.as_mut().filter(|r| r.op() == "refuse") {
                // A refusal's answer travels beside its record; without it, it is unreadable.
                match (e.get::<u16>("c"), e.get::<String>("b")) {
                    (Some(code), Some(body)) => (r.c, r.body) = (Some(code), body),
                    _ => record = None,
                }
            }
            (e.id.clone(), record, e.get::<i64>("d"))
        })
        .collect();
    let outcomes = settle_all(storage, tenant, key, &records, now).await;
    let mut settled = Vec::with_capacity(records.len());
    for ((id, record, delta), outcome) in records.iter().zip(outcomes) {
        let qty = record.as_ref().map(|r| r.q).unwrap_or(0);
        // What the entry changed in Redis's available (the script wrote it beside the record).
        let delta = delta.unwrap_or(qty);
        match outcome {
            Some(Ok(settled)) => {
                let label = match settled {
                    Settled::Applied => "applied",
                    Settled::Duplicate => "duplicate",
                    Settled::Answered => "refusal",
                    Settled::Refused => {
                        metrics::counter!("stockd_settlement_failures_total").increment(1);
                        tracing::error!(
                            tenant,
                            key,
                            qty,
                            "settlement refused by the database: recorded for compensation"
                        );
                        "refused"
                    }
                };
                metrics::counter!("stockd_settlements_total", "result" => label).increment(1);
            }
            Some(Err(err)) => {
                // Left pending: reclaimed and tried again once idle.
                tracing::warn!(error = %err, tenant, key, "settlement failed; the entry stays pending");
                continue;
            }
            None => {
                // Not a record this version wrote: never applied, and acknowledged only once
                // kept with its raw fields (else it stays pending and is tried again).
                let letter = dead_letter(key, entries, id, record.as_ref(), now);
                if let Err(err) = storage.record_dead_letter(&letter, tenant).await {
                    tracing::warn!(error = %err, tenant, key, entry = %id, "keeping an unreadable entry failed; it stays pending");
                    continue;
                }
                tracing::error!(tenant, key, entry = %id, reason = %letter.reason, "unreadable settlement entry: kept as a dead letter");
                metrics::counter!("stockd_settlement_unreadable_total").increment(1);
            }
        }
        // A settled move ended its reservation: Redis forgets it (the database has it).
        let ended = record
            .as_ref()
            .filter(|r| crate::storage::redis_store::move_target(r.op()).is_some())
            .and_then(|r| r.rsv.as_deref());
        settled.push((id, delta, ended));
    }
    // Every committed entry's acknowledgement in one script call: one after another, a read of
    // 256 entries took most of a second under load behind the sales' scripts, and each call
    // costs Redis, which the sales share, more than the acknowledgement itself.
    let entries: Vec<(&str, i64, Option<&str>)> =
        settled.iter().map(|(id, delta, ended)| (id.as_str(), *delta, *ended)).collect();
    match hot.ack(tenant, key, &entries).await {
        Ok(()) => entries.len(),
        Err(err) => {
            tracing::warn!(error = %err, tenant, key, "acknowledging settled entries failed");
            0
        }
    }
}

/// Settles the records of one read, in stream order, one answer per record (`None`: not a
/// record of this stream, never applied). Consecutive deductions go as one run
/// ([`crate::storage::redis_store::RedisStore::settle_run`]: their claims, row change, ledger
/// rows, answers and events written together); any other record is settled on its own. The
/// writes are submitted in stream order and run concurrently, sharing group commits.
async fn settle_all(
    storage: &dyn Storage,
    tenant: &str,
    key: &str,
    records: &[(String, Option<SettleRecord>, Option<i64>)],
    now: i64,
) -> Vec<Option<Result<Settled, StorageError>>> {
    fn of<'r>(record: &'r Option<SettleRecord>, tenant: &str, key: &str) -> Option<&'r SettleRecord> {
        record.as_ref().filter(|r| r.t == tenant && r.k == key)
    }
    let ours = |record| of(record, tenant, key);
    // Runs of consecutive deductions, and every other record alone: (first index, length, run).
    let mut units: Vec<(usize, usize, bool)> = Vec::new();
    for (i, (_, record, _)) in records.iter().enumerate() {
        let together = ours(record).is_some_and(runs_together);
        match units.last_mut() {
            Some((_, len, true)) if together => *len += 1,
            _ => units.push((i, 1, together)),
        }
    }
    let settled = join_all(units.iter().map(|&(start, len, run)| async move {
        let unit = &records[start..start + len];
        if !run {
            return match unit.first().and_then(|(_, record, _)| ours(record)) {
                Some(r) => vec![Some(storage.settle(r, now).await)],
                None => vec![None],
            };
        }
        let run: Vec<SettleRecord> = unit.iter().filter_map(|(_, r, _)| r.clone()).collect();
        match storage.settle_run(run, now).await {
            Ok(settled) if settled.len() == len => settled.into_iter().map(|s| Some(Ok(s))).collect(),
            Ok(_) => vec![Some(Err(StorageError::Internal("a run settled a different number".into()))); len],
            Err(err) => vec![Some(Err(err)); len],
        }
    }))
    .await;
    settled.into_iter().flatten().collect()
}

/// Forgets the consumers that processes now gone left in the resource's group (every process
/// has a consumer of its own name, so each restart adds one). A stream without a group
/// (`NOGROUP`) has none to forget.
async fn remove_dead_consumers(hot: &RedisMode, tenant: &str, key: &str, idle: Duration) {
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(REMOVE_DEAD_CONSUMERS)
        .arg(1)
        .arg(hot.stream_key(tenant, key))
        .arg(GROUP)
        .arg(&hot.consumer)
        .arg(u64::try_from(idle.as_millis()).unwrap_or(u64::MAX));
    match hot.link().query::<u64>(&cmd).await {
        Ok(0) => {}
        Ok(n) => {
            metrics::counter!("stockd_redis_consumers_removed_total").increment(n);
            tracing::info!(consumers = n, tenant, key, "removed the consumers of dead processes");
        }
        Err(err) => tracing::debug!(error = %err, tenant, key, "removing dead consumers failed"),
    }
}

/// Warms a resource again when the operation that closed it stopped half-way (its process died)
/// and its lease ran out. In a task of its own: the warm waits for this loop to settle the
/// resource's backlog.
async fn rewarm_if_abandoned(
    hot: &Arc<RedisMode>,
    storage: &Arc<dyn Storage>,
    rewarming: &Arc<Mutex<HashSet<(String, String)>>>,
    tenant: String,
    key: String,
) {
    match hot.abandoned(&tenant, &key).await {
        Ok(true) => {}
        Ok(false) => return,
        Err(err) => {
            tracing::debug!(error = %err, tenant, key, "checking a redis lease failed");
            return;
        }
    }
    let (Ok(t), Ok(k)) = (TenantId::parse(tenant.clone()), ResourceKey::parse(key.clone())) else { return };
    let id = (tenant, key);
    if !rewarming.lock().map(|mut set| set.insert(id.clone())).unwrap_or(false) {
        return;
    }
    tracing::warn!(tenant = %t, key = %k, "a warm, switch or adjustment left the resource closed; warming it again");
    metrics::counter!("stockd_redis_lease_recoveries_total").increment(1);
    let (hot, storage, rewarming) = (hot.clone(), storage.clone(), rewarming.clone());
    tokio::spawn(async move {
        if let Err(err) = hot.warm(storage.as_ref(), &t, &k).await {
            tracing::warn!(error = %err, tenant = %t, key = %k, "warming an abandoned resource failed; will retry");
        }
        if let Ok(mut set) = rewarming.lock() {
            set.remove(&id);
        }
    });
}

/// Most bytes of an unreadable entry kept as its dead letter's payload.
const DEAD_LETTER_MAX_BYTES: usize = 64 * 1024;

/// An unreadable entry as a dead letter: its fields as a JSON object of strings (bytes that are
/// not UTF-8 replaced), cut at [`DEAD_LETTER_MAX_BYTES`].
fn dead_letter(key: &str, entries: &[StreamId], id: &str, record: Option<&SettleRecord>, now: i64) -> DeadLetter {
    let entry = entries.iter().find(|e| e.id == id);
    let fields: std::collections::BTreeMap<&str, String> = entry
        .map(|e| {
            e.map
                .iter()
                .map(|(field, value)| {
                    let text = match value {
                        redis::Value::BulkString(bytes) => String::from_utf8_lossy(bytes).into_owned(),
                        redis::Value::SimpleString(s) => s.clone(),
                        other => format!("{other:?}"),
                    };
                    (field.as_str(), text)
                })
                .collect()
        })
        .unwrap_or_default();
    let mut payload = serde_json::to_string(&fields).unwrap_or_default();
    if payload.len() > DEAD_LETTER_MAX_BYTES {
        let mut cut = DEAD_LETTER_MAX_BYTES;
        while !payload.is_char_boundary(cut) {
            cut -= 1;
        }
        payload.truncate(cut);
        payload.push_str("...(cut)");
    }
    let reason = match record {
        Some(_) => "the record names another resource",
        None if fields.contains_key("r") => "the record does not parse",
        None => "no record field",
    };
    DeadLetter {
        key: key.to_string(),
        entry_id: id.to_string(),
        payload,
        reason: reason.to_string(),
        at: Timestamp(now),
    }
}

/// Most reservations one pass expires per resource.
const EXPIRE_BATCH: usize = 100;

/// Expires the resource's reservations made in Redis that are past their deadline (each
/// exactly once: the script moves only a held one), which returns their stock to Redis and
/// queues the expiry for settlement.
async fn expire_due(hot: &RedisMode, tenant: &str, key: &str) {
    let now = now_ms();
    let due = match hot.due_reservations(tenant, key, now, EXPIRE_BATCH).await {
        Ok(due) => due,
        Err(err) => {
            tracing::debug!(error = %err, tenant, key, "listing due reservations failed");
            return;
        }
    };
    for id in due {
        match hot.transition_reservation(tenant, key, &id, "expired", now).await {
            Ok(Some(r)) if r.state == crate::engine::ReservationState::Expired => {
                metrics::counter!("stockd_reservations_expired_total").increment(1);
            }
            Ok(_) => {}
            // Being warmed or switched: expired on a later pass (or on the database path).
            Err(RedisModeError::Closed) => return,
            Err(err) => tracing::warn!(error = %err, tenant, key, "expiring a reservation in redis failed"),
        }
    }
}

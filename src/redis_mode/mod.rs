//! Redis mode (flash sales): resources whose sales are decided by an atomic Lua script in Redis
//! and settled into the database afterwards (write-behind), the database staying the source of
//! truth. `docs/REDIS.md` is the operator's guide; in short:
//!
//! - [`scripts::DEDUCT`] checks the per-user limit and the stock, records the request's outcome
//!   under its idempotency key, decrements, and appends the settlement record to the resource's
//!   stream, all in one script: no success exists in Redis without its queue entry.
//! - [`crate::jobs::settle`] is the consumer-group loop every process runs: it applies each record with the
//!   database's guarded UPDATE + ledger row (idempotent by request id), acknowledges after the
//!   commit, reclaims entries of dead consumers, and records what the database refuses.
//! - Warm ([`RedisMode::warm`]) closes the resource, waits until its backlog is settled, and loads
//!   Redis from the database. Reconciliation compares Redis, the database and the backlog.
//! - [`soldout`] keeps, per process, the resources Redis announced sold out, answered from
//!   memory until a warm announces stock again.
//!
//! Keys: `<prefix>:{<tenant>:<key>}:<part>`; the hash tag makes every key of one resource live
//! in one Redis Cluster slot, so each script touches one slot.

pub mod control;
pub mod link;
pub mod orders;
pub mod reversals;
pub mod scripts;
pub mod soldout;

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::RwLock;
use std::time::{Duration, Instant};

use redis::{RedisError, Script};

use self::link::{Link, Topology};
use crate::config::RedisConfig;
use crate::engine::{Kind, ResourceKey, ResourceState, TenantId};
use crate::storage::redis_store::SettleRecord;
use crate::storage::{Storage, StorageError};

/// The consumer group every process's settlement consumer belongs to.
pub const GROUP: &str = "settle";
/// Most redis-mode resources one process tracks (and polls the streams of).
pub const MAX_RESOURCES: u32 = 10_000;
/// How long Redis keeps the closed marker of a resource that left redis mode.
const FORGOTTEN_MARKER_S: u64 = 86_400;
/// Most reservations held in Redis a load looks up in the database (those due soonest): the
/// ones the database's sweeper may have expired first. A resource holding more has the later
/// ones kept as they are.
const LOAD_CHECKED: usize = 10_000;

/// Why redis mode could not answer; nothing of the request was applied unless said otherwise.
#[derive(Debug, thiserror::Error)]
pub enum RedisModeError {
    /// Redis could not be reached or did not answer in time; nothing is known to have applied.
    #[error("redis unavailable: {0}")]
    Redis(#[from] RedisError),
    #[error(transparent)]
    Storage(#[from] StorageError),
    /// The backlog did not settle within the drain timeout; the resource was reopened.
    #[error("the settlement backlog did not drain in time ({0} still unsettled)")]
    DrainTimeout(i64),
    #[error("unexpected reply from redis: {0}")]
    Reply(String),
    /// An order on a redis-mode resource planned to more than one line or target.
    #[error("an order that touches a redis-mode resource must have one line planned to that one resource")]
    OrderUnsupported,
    /// Redis does not hold the resource (never warmed, or its data was lost).
    #[error("{0} is in redis mode but Redis does not hold it")]
    NotWarmed(String),
    /// The resource is closed while a warm or a mode switch drains its backlog.
    #[error("the resource is being warmed or switched")]
    Closed,
    /// Settlement is `[redis] max_backlog` entries behind on the resource: its sales wait.
    #[error("the resource's sales wait for settlement to catch up")]
    Backlog,
    /// `"mode": "redis"` on a server without `[redis]`.
    #[error("redis mode needs [redis] to be configured on this server")]
    NotConfigured,
    /// Redis mode takes single-bucket resources only.
    #[error("redis mode takes one bucket")]
    Bucketed,
    /// A warm of a resource in db mode.
    #[error("{0} is in db mode")]
    NotRedis(String),
    /// Another process took a later fencing epoch of the resource while this warm, switch or
    /// adjustment ran (or the resource left redis mode): this one stopped without opening Redis.
    #[error("another warm or switch of the resource took over")]
    Superseded,
}

/// What Redis answered for one deduction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Deducted {
    /// A fresh outcome (applied or refused), stored in Redis under the request's key.
    Fresh {
        outcome: String,
        status: u16,
        body: String,
        available: i64,
    },
    /// The key's first outcome.
    Replay {
        status: u16,
        body: String,
    },
    Mismatch,
    /// Not warmed: Redis knows nothing of this resource (never loaded, or its data was lost).
    Cold,
    /// Closed while a warm or a mode switch drains its backlog.
    Closed,
    /// The resource's stream holds `max_backlog` entries not yet settled: nothing written.
    Backlog,
    /// A refusal decided on a call without [`Bodies::refusals`]: nothing written; run again
    /// with them.
    Refuse,
    /// The limit key's count must be read from the database first (see [`scripts::DEDUCT`]).
    Seed,
}

/// The bodies the script stores, one per possible outcome. A sale's first call carries only
/// `applied`; the refusals are built once Redis answers [`Deducted::Refuse`].
pub struct Bodies {
    pub applied: String,
    pub refusals: Option<Refusals>,
}

/// What the deduct script needs to store a refusal it may decide: the answers, and the
/// settlement record (its status and body travel beside it).
pub struct Refusals {
    pub insufficient: String,
    pub limit: String,
    pub inactive: String,
    /// A resource of another kind than the plan requires (answered as on the database path).
    pub not_found: String,
    pub record: SettleRecord,
}

/// One deduction to run.
pub struct Deduction<'a> {
    /// `Some` for a reservation: its id, deadline and document.
    pub reserve: Option<Reserve>,
    pub tenant: &'a TenantId,
    pub key: &'a ResourceKey,
    pub qty: i64,
    pub limit: Option<(&'a str, i64)>,
    /// The kind the plan requires of the resource, if any.
    pub kind: Option<Kind>,
    pub request_hash: &'a str,
    pub idempotency_key: &'a str,
    pub bodies: Bodies,
    pub record: SettleRecord,
    /// The limit key's count in the database and the resource's epoch then, once asked for.
    pub seed: Option<LimitSeed>,
}

/// A per-user limit key's count in the database, read together with the resource's epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitSeed {
    pub used: i64,
    pub epoch: i64,
}

/// What a reservation made in Redis carries.
pub struct Reserve {
    pub id: String,
    pub expires_at_ms: i64,
    /// The reservation as `GET /v1/reservations/{id}` shows it (state `held`).
    pub document: String,
}

/// Redis's view of one resource, for reconciliation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RedisView {
    pub available: i64,
    pub backlog: i64,
    /// Stream entries not yet settled.
    pub pending: i64,
    pub open: bool,
}

/// Who settles a resource's stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamOwner {
    /// This process, as before.
    Kept,
    /// This process, from now: it takes over every entry still pending first.
    Taken,
    /// Another process.
    Other,
}

/// A resource's fencing state in Redis: the epoch it was last closed or loaded under (0: none)
/// and its unsettled stream entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FenceState {
    epoch: i64,
    pending: i64,
}

/// What a warm announces: loaded with nothing available, after its backlog drained, the
/// resource is sold out with every sale settled.
fn stock_mark(available: i64) -> soldout::Mark {
    if available == 0 {
        soldout::Mark::Settled
    } else {
        soldout::Mark::InStock
    }
}

/// The hot path of one process.
pub struct RedisMode {
    link: Link,
    prefix: String,
    pub settings: RedisConfig,
    /// Idempotency retention: how long Redis keeps each request's outcome.
    request_ttl_s: u64,
    deduct: Script,
    transition: Script,
    ack: Script,
    fence: Script,
    stream_owner: Script,
    reopen: Script,
    abandoned: Script,
    load: Script,
    forget: Script,
    reverse: Script,
    /// The redis-mode resources, as last read from the database (and changed by this process).
    modes: RwLock<HashSet<(String, String)>>,
    /// The link's connection count when `modes` was last read (see [`RedisMode::catch_up`]).
    modes_read_at: AtomicU64,
    /// One reading of the modes at a time after a new connection, not one per request.
    catching_up: tokio::sync::Mutex<()>,
    pub sold_out: soldout::SoldOut,
    /// This process's consumer name in the settlement group.
    pub consumer: String,
}

fn topology(config: &RedisConfig) -> Option<Topology> {
    if !config.cluster_nodes.is_empty() {
        Some(Topology::Cluster(config.cluster_nodes.clone()))
    } else if !config.sentinels.is_empty() {
        Some(Topology::Sentinel { sentinels: config.sentinels.clone(), master: config.sentinel_master.clone() })
    } else {
        config.url.clone().map(Topology::Single)
    }
}

impl RedisMode {
    /// The hot path if Redis is configured; it connects lazily.
    pub fn from_config(config: &RedisConfig, idempotency_retention_s: u64) -> anyhow::Result<Option<Self>> {
        let Some(topology) = topology(config) else { return Ok(None) };
        let link = Link::new(topology, Duration::from_millis(config.timeout_ms))?;
        Ok(Some(Self {
            link,
            prefix: config.prefix.clone(),
            settings: config.clone(),
            request_ttl_s: idempotency_retention_s.max(1),
            deduct: Script::new(scripts::DEDUCT),
            transition: Script::new(scripts::TRANSITION),
            ack: Script::new(scripts::ACK),
            fence: Script::new(scripts::FENCE),
            stream_owner: Script::new(scripts::STREAM_OWNER),
            reopen: Script::new(scripts::REOPEN),
            abandoned: Script::new(scripts::ABANDONED),
            load: Script::new(scripts::LOAD),
            forget: Script::new(scripts::FORGET),
            reverse: Script::new(scripts::REVERSE),
            modes: RwLock::new(HashSet::new()),
            modes_read_at: AtomicU64::new(0),
            catching_up: tokio::sync::Mutex::new(()),
            sold_out: soldout::SoldOut::default(),
            consumer: format!("stockd-{}", ulid::Ulid::new()),
        }))
    }

    pub fn link(&self) -> &Link {
        &self.link
    }

    fn base(&self, tenant: &str, key: &str) -> String {
        format!("{}:{{{tenant}:{key}}}", self.prefix)
    }

    pub fn resource_key(&self, tenant: &str, key: &str) -> String {
        format!("{}:r", self.base(tenant, key))
    }

    pub fn stream_key(&self, tenant: &str, key: &str) -> String {
        format!("{}:x", self.base(tenant, key))
    }

    fn limits_key(&self, tenant: &str, key: &str) -> String {
        format!("{}:l", self.base(tenant, key))
    }

    fn request_key(&self, tenant: &str, key: &str, idempotency_key: &str) -> String {
        format!("{}:q:{idempotency_key}", self.base(tenant, key))
    }

    fn reservations_key(&self, tenant: &str, key: &str) -> String {
        format!("{}:v", self.base(tenant, key))
    }

    fn deadlines_key(&self, tenant: &str, key: &str) -> String {
        format!("{}:e", self.base(tenant, key))
    }

    /// What each order has had reversed here (see [`scripts::REVERSE`]).
    fn reversals_key(&self, tenant: &str, key: &str) -> String {
        format!("{}:rv", self.base(tenant, key))
    }

    /// Which resource a reservation made in Redis belongs to (its own slot: written after the
    /// reserve script, read by confirm, release and GET).
    fn reservation_map_key(&self, tenant: &str, id: &str) -> String {
        format!("{}:{{rsv:{tenant}:{id}}}", self.prefix)
    }

    /// The pub/sub channel of sold-out and restock announcements.
    pub fn channel(&self) -> String {
        format!("{}:soldout", self.prefix)
    }

    /// Redis answers.
    pub async fn ready(&self) -> Result<(), RedisModeError> {
        let pong: String = self.link.query(&redis::cmd("PING")).await?;
        if pong == "PONG" {
            Ok(())
        } else {
            Err(RedisModeError::Reply(pong))
        }
    }

    /// Whether this resource is in redis mode, as far as this process knows.
    pub fn is_redis(&self, tenant: &str, key: &str) -> bool {
        self.modes.read().map(|m| m.contains(&(tenant.to_string(), key.to_string()))).unwrap_or(false)
    }

    /// Every redis-mode resource this process knows of.
    pub fn redis_resources(&self) -> Vec<(String, String)> {
        self.modes.read().map(|m| m.iter().cloned().collect()).unwrap_or_default()
    }

    /// Records a mode this process just changed, before the next refresh reads it back.
    pub fn mark(&self, tenant: &str, key: &str, redis: bool) {
        if let Ok(mut modes) = self.modes.write() {
            let id = (tenant.to_string(), key.to_string());
            if redis {
                modes.insert(id);
            } else {
                modes.remove(&id);
            }
        }
    }

    /// Re-reads which resources are in redis mode (every process, every second).
    pub async fn refresh_modes(&self, storage: &dyn Storage) -> Result<(), StorageError> {
        // Taken before the read: the read then follows every connection counted.
        let generation = self.link.generation();
        let found = storage.redis_resources(MAX_RESOURCES).await?;
        let set = found.into_iter().map(|(t, k)| (t.to_string(), k.to_string())).collect();
        if let Ok(mut modes) = self.modes.write() {
            *modes = set;
        }
        self.modes_read_at.fetch_max(generation, Ordering::AcqRel);
        Ok(())
    }

    /// Whether a connection to Redis was made since the modes were last read.
    pub fn behind_link(&self) -> bool {
        self.modes_read_at.load(Ordering::Acquire) < self.link.generation()
    }

    /// Connects to Redis if need be, and reads the modes again if the connection is newer than
    /// them. Redis on a new connection may have restarted from a snapshot older than a switch
    /// out of redis mode: the resource's keys are back, open, and a process still counting it
    /// in redis mode would sell there, in a stream nobody settles once every view is current.
    /// Called before an order or a reservation's move uses Redis; costs one database read per
    /// new connection, and only an atomic load otherwise.
    pub async fn catch_up(&self, storage: &dyn Storage) -> Result<(), RedisModeError> {
        self.link.conn().await?;
        if !self.behind_link() {
            return Ok(());
        }
        let _one = self.catching_up.lock().await;
        if self.behind_link() {
            self.refresh_modes(storage).await?;
        }
        Ok(())
    }

    /// The connection to sell on or move a reservation on, or `None` when it was made after the
    /// mode view was last read: another request replaced a broken connection since this one's
    /// [`RedisMode::catch_up`], and Redis may have restarted from an older snapshot in between.
    /// The caller answers as closed (the database is asked, and a retry catches up).
    async fn selling_conn(&self) -> Result<Option<link::Conn>, RedisModeError> {
        let conn = self.link.conn().await?;
        Ok((!self.behind_link()).then_some(conn))
    }

    /// Runs the deduct script for one order line.
    pub async fn deduct(&self, d: &Deduction<'_>) -> Result<Deducted, RedisModeError> {
        let (tenant, key) = (d.tenant.as_str(), d.key.as_str());
        let record = serde_json::to_string(&d.record).map_err(|e| RedisModeError::Reply(e.to_string()))?;
        let refusals = d.bodies.refusals.as_ref();
        let refusal = refusals.map(|r| serde_json::to_string(&r.record)).transpose();
        let refusal = refusal.map_err(|e| RedisModeError::Reply(e.to_string()))?.unwrap_or_default();
        let refusal_body = |pick: fn(&Refusals) -> &str| refusals.map_or("", pick);
        let mut invocation = self.deduct.key(self.resource_key(tenant, key));
        invocation
            .key(self.limits_key(tenant, key))
            .key(self.request_key(tenant, key, d.idempotency_key))
            .key(self.stream_key(tenant, key))
            .arg(d.qty)
            .arg(d.limit.map(|(k, _)| k).unwrap_or(""))
            .arg(d.limit.map(|(_, max)| max).unwrap_or(0))
            .arg(d.request_hash)
            .arg(self.request_ttl_s)
            .arg(&d.bodies.applied)
            .arg(refusal_body(|r| &r.insufficient))
            .arg(refusal_body(|r| &r.limit))
            .arg(refusal_body(|r| &r.inactive))
            .arg(record)
            .arg(self.channel())
            .arg(soldout::message(soldout::Mark::SoldOut, tenant, key))
            .key(self.reservations_key(tenant, key))
            .key(self.deadlines_key(tenant, key));
        match &d.reserve {
            Some(r) => invocation.arg("reserve").arg(&r.id).arg(r.expires_at_ms).arg(&r.document),
            None => invocation.arg("deduct").arg("").arg(0).arg(""),
        };
        match d.seed {
            Some(seed) => invocation.arg(seed.used).arg(seed.epoch),
            None => invocation.arg("").arg(""),
        };
        invocation
            .arg(refusal)
            .arg(self.settings.max_backlog)
            .arg(d.kind.map_or("", Kind::as_str))
            .arg(refusal_body(|r| &r.not_found));
        let Some(mut conn) = self.selling_conn().await? else { return Ok(Deducted::Closed) };
        let reply: Result<(String, String, String, i64), RedisError> = invocation.invoke_async(&mut conn).await;
        let (outcome, code, body, available) = reply.inspect_err(|e| self.link.judge(e))?;
        let status = code.parse::<u16>().map_err(|_| RedisModeError::Reply(format!("status {code}")))?;
        Ok(match outcome.as_str() {
            "replay" => Deducted::Replay { status, body },
            "mismatch" => Deducted::Mismatch,
            "cold" => Deducted::Cold,
            "closed" => Deducted::Closed,
            "backlog" => Deducted::Backlog,
            "seed" => Deducted::Seed,
            "refuse" => Deducted::Refuse,
            // The script sends a sale's body back empty: it is the one this call sent.
            "applied" => Deducted::Fresh { outcome, status, body: d.bodies.applied.clone(), available },
            _ => Deducted::Fresh { outcome, status, body, available },
        })
    }

    /// The outcome Redis recorded for this request's key on this resource, if any: what the
    /// deduct script would answer first, read without running it (one round trip, for the
    /// sold-out answer, which must not hide a replay). Marks the resource settled when Redis
    /// says every sale of it is in the database.
    pub async fn recorded(&self, d: &Deduction<'_>) -> Result<Option<Deducted>, RedisModeError> {
        let (tenant, key) = (d.tenant.as_str(), d.key.as_str());
        let mut pipe = redis::pipe();
        pipe.cmd("HMGET").arg(self.request_key(tenant, key, d.idempotency_key)).arg("h").arg("c").arg("b");
        pipe.cmd("HMGET").arg(self.resource_key(tenant, key)).arg("avail").arg("pending");
        type Reply = ((Option<String>, Option<String>, Option<String>), (Option<i64>, Option<i64>));
        let mut conn = self.link.conn().await?;
        let ((hash, code, body), (avail, pending)): Reply =
            pipe.query_async(&mut conn).await.inspect_err(|e| self.link.judge(e))?;
        if avail == Some(0) && pending.unwrap_or(0) <= 0 {
            self.sold_out.mark(tenant, key, soldout::Mark::Settled);
        }
        let Some(hash) = hash else { return Ok(None) };
        if hash != d.request_hash {
            return Ok(Some(Deducted::Mismatch));
        }
        let code = code.unwrap_or_default();
        let status = code.parse::<u16>().map_err(|_| RedisModeError::Reply(format!("status {code}")))?;
        Ok(Some(Deducted::Replay { status, body: body.unwrap_or_default() }))
    }

    /// Remembers which resource a reservation made in Redis belongs to, for `ttl_s`.
    pub async fn map_reservation(&self, tenant: &str, id: &str, key: &str, ttl_s: i64) -> Result<(), RedisModeError> {
        let mut cmd = redis::cmd("SET");
        cmd.arg(self.reservation_map_key(tenant, id)).arg(key).arg("EX").arg(ttl_s.max(1));
        let _: () = self.link.query(&cmd).await?;
        Ok(())
    }

    /// The resource of a reservation made in Redis, if Redis knows it.
    pub async fn reservation_resource(&self, tenant: &str, id: &str) -> Result<Option<String>, RedisModeError> {
        let mut cmd = redis::cmd("GET");
        cmd.arg(self.reservation_map_key(tenant, id));
        Ok(self.link.query(&cmd).await?)
    }

    /// A reservation's state and document as Redis holds them.
    pub async fn reservation(
        &self,
        tenant: &str,
        key: &str,
        id: &str,
    ) -> Result<Option<(String, String)>, RedisModeError> {
        let mut cmd = redis::cmd("HMGET");
        cmd.arg(self.reservations_key(tenant, key)).arg(format!("{id}:s")).arg(id);
        let (state, doc): (Option<String>, Option<String>) = self.link.query(&cmd).await?;
        Ok(state.zip(doc))
    }

    /// Moves a reservation held in Redis (see [`scripts::TRANSITION`]). `records`: the
    /// settlement records of a confirm, a release and an expiry. Returns its state now and its
    /// document, or `None` when Redis does not hold it; `Closed` while a warm or a switch holds
    /// the resource.
    pub async fn transition(
        &self,
        tenant: &str,
        key: &str,
        id: &str,
        to: &str,
        now_ms: i64,
        records: [String; 3],
    ) -> Result<Option<(String, String)>, RedisModeError> {
        let mut invocation = self.transition.key(self.resource_key(tenant, key));
        invocation
            .key(self.limits_key(tenant, key))
            .key(self.stream_key(tenant, key))
            .key(self.reservations_key(tenant, key))
            .key(self.deadlines_key(tenant, key))
            .arg(id)
            .arg(to)
            .arg(now_ms);
        for record in &records {
            invocation.arg(record);
        }
        invocation.arg(self.channel()).arg(soldout::message(soldout::Mark::InStock, tenant, key));
        let Some(mut conn) = self.selling_conn().await? else { return Err(RedisModeError::Closed) };
        let (state, doc): (String, String) =
            invocation.invoke_async(&mut conn).await.inspect_err(|e| self.link.judge(e))?;
        match state.as_str() {
            "unknown" => Ok(None),
            "closed" => Err(RedisModeError::Closed),
            _ => Ok(Some((state, doc))),
        }
    }

    /// Reservations of the resource past their deadline, at most `limit`.
    pub async fn due_reservations(
        &self,
        tenant: &str,
        key: &str,
        now_ms: i64,
        limit: usize,
    ) -> Result<Vec<String>, RedisModeError> {
        let mut cmd = redis::cmd("ZRANGEBYSCORE");
        cmd.arg(self.deadlines_key(tenant, key)).arg("-inf").arg(now_ms).arg("LIMIT").arg(0).arg(limit);
        Ok(self.link.query(&cmd).await?)
    }

    /// Acknowledges settled entries of one resource in one call (see [`scripts::ACK`]): each
    /// its id, its `d` and the reservation a move in it ended.
    pub async fn ack(
        &self,
        tenant: &str,
        key: &str,
        entries: &[(&str, i64, Option<&str>)],
    ) -> Result<(), RedisModeError> {
        if entries.is_empty() {
            return Ok(());
        }
        let mut invocation = self.ack.key(self.stream_key(tenant, key));
        invocation
            .key(self.resource_key(tenant, key))
            .key(self.reservations_key(tenant, key))
            .arg(GROUP)
            .arg(self.channel())
            .arg(soldout::message(soldout::Mark::Settled, tenant, key));
        for (id, delta, ended) in entries {
            invocation.arg(*id).arg(*delta).arg(ended.unwrap_or(""));
        }
        let mut conn = self.link.conn().await?;
        let _: i64 = invocation.invoke_async(&mut conn).await.inspect_err(|e| self.link.judge(e))?;
        Ok(())
    }

    /// Whether this process settles the resource's stream now (see [`scripts::STREAM_OWNER`]).
    pub async fn own_stream(&self, tenant: &str, key: &str) -> Result<StreamOwner, RedisModeError> {
        let mut invocation = self.stream_owner.key(format!("{}:o", self.base(tenant, key)));
        invocation.arg(&self.consumer).arg(self.settings.claim_idle_ms.max(1));
        let mut conn = self.link.conn().await?;
        let owner: i64 = invocation.invoke_async(&mut conn).await.inspect_err(|e| self.link.judge(e))?;
        Ok(match owner {
            1 => StreamOwner::Kept,
            2 => StreamOwner::Taken,
            _ => StreamOwner::Other,
        })
    }

    /// Closes the resource under `epoch` (see [`scripts::FENCE`]); returns its unsettled entries.
    async fn fence(&self, tenant: &str, key: &str, epoch: i64) -> Result<i64, RedisModeError> {
        let mut invocation = self.fence.key(self.resource_key(tenant, key));
        invocation.arg(epoch).arg(&self.consumer).arg(self.settings.lease_ms());
        let mut conn = self.link.conn().await?;
        let (fenced, pending): (i64, i64) =
            invocation.invoke_async(&mut conn).await.inspect_err(|e| self.link.judge(e))?;
        if fenced != 1 {
            return Err(RedisModeError::Superseded);
        }
        Ok(pending)
    }

    /// Reopens a resource this process closed under `epoch` and did not change.
    async fn reopen(&self, tenant: &str, key: &str, epoch: i64) -> Result<(), RedisModeError> {
        let mut invocation = self.reopen.key(self.resource_key(tenant, key));
        invocation.arg(epoch);
        let mut conn = self.link.conn().await?;
        let _: i64 = invocation.invoke_async(&mut conn).await.inspect_err(|e| self.link.judge(e))?;
        Ok(())
    }

    /// Whether an operation that closed the resource stopped half-way and its lease ran out
    /// (see [`scripts::ABANDONED`]).
    pub async fn abandoned(&self, tenant: &str, key: &str) -> Result<bool, RedisModeError> {
        let invocation = self.abandoned.key(self.resource_key(tenant, key));
        let mut conn = self.link.conn().await?;
        let abandoned: i64 = invocation.invoke_async(&mut conn).await.inspect_err(|e| self.link.judge(e))?;
        Ok(abandoned == 1)
    }

    async fn fence_state(&self, tenant: &str, key: &str) -> Result<FenceState, RedisModeError> {
        let mut cmd = redis::cmd("HMGET");
        cmd.arg(self.resource_key(tenant, key)).arg("epoch").arg("pending");
        let (epoch, pending): (Option<i64>, Option<i64>) = self.link.query(&cmd).await?;
        Ok(FenceState { epoch: epoch.unwrap_or(0), pending: pending.unwrap_or(0) })
    }

    /// Waits until every entry of the resource, closed under `epoch`, is settled. On timeout
    /// the resource is reopened (nothing changed it yet) and the caller hears `DrainTimeout`.
    async fn drain(&self, tenant: &str, key: &str, epoch: i64, mut pending: i64) -> Result<(), RedisModeError> {
        let deadline = Instant::now() + Duration::from_millis(self.settings.drain_timeout_ms);
        while pending != 0 {
            if Instant::now() >= deadline {
                self.reopen(tenant, key, epoch).await?;
                return Err(RedisModeError::DrainTimeout(pending));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
            let now = self.fence_state(tenant, key).await?;
            if now.epoch != epoch {
                return Err(RedisModeError::Superseded);
            }
            pending = now.pending;
        }
        Ok(())
    }

    /// Takes the resource's next epoch in the database (into redis mode first when
    /// `into_redis`), closes Redis under it and waits until its backlog is settled. `None`: no
    /// such resource, or (without `into_redis`) it is not in redis mode.
    pub(crate) async fn close(
        &self,
        storage: &dyn Storage,
        tenant: &TenantId,
        key: &ResourceKey,
        into_redis: bool,
    ) -> Result<Option<i64>, RedisModeError> {
        let Some(epoch) = storage.take_epoch(tenant, key, into_redis, crate::time::now_ms()).await? else {
            return Ok(None);
        };
        let (t, k) = (tenant.as_str(), key.as_str());
        let pending = self.fence(t, k, epoch).await?;
        self.drain(t, k, epoch, pending).await?;
        Ok(Some(epoch))
    }

    /// Loads Redis from the database under `epoch` and opens it. The database is read after
    /// Redis was closed under `epoch` and must still be in redis mode at `epoch`: whoever moved
    /// it on since closed Redis under a later epoch first, so this load is refused or their
    /// close follows it. Announces the stock to every process (a sold-out mark is cleared, or
    /// set if the stock is zero).
    ///
    /// The reservations Redis holds (the [`LOAD_CHECKED`] due soonest) are looked up in the same
    /// read as the counters: one the database no longer holds, because its sweeper expired it
    /// before Redis's own pass did, has its stock in the database's available already, and Redis
    /// forgets it instead of giving that stock back again later (see [`scripts::LOAD`]).
    pub(crate) async fn load(
        &self,
        storage: &dyn Storage,
        tenant: &TenantId,
        key: &ResourceKey,
        epoch: i64,
    ) -> Result<(), RedisModeError> {
        let (t, k) = (tenant.as_str(), key.as_str());
        let deadline = Instant::now() + Duration::from_millis(self.settings.drain_timeout_ms);
        loop {
            // Closed under `epoch`, Redis moves none of them until it is loaded.
            let mut cmd = redis::cmd("ZRANGE");
            cmd.arg(self.deadlines_key(t, k)).arg(0).arg(LOAD_CHECKED - 1);
            let in_redis: Vec<String> = self.link.query(&cmd).await?;
            let Some((state, held)) = storage.resource_holding(tenant, key, &in_redis).await? else {
                return Ok(());
            };
            if state.mode != crate::engine::Mode::Redis || state.mode_epoch != epoch {
                return Err(RedisModeError::Superseded);
            }
            let inactive = state.status != crate::engine::ResourceStatus::Active;
            let mut invocation = self.load.key(self.resource_key(t, k));
            invocation
                .key(self.stream_key(t, k))
                .key(self.limits_key(t, k))
                .key(self.reservations_key(t, k))
                .key(self.deadlines_key(t, k))
                .arg(state.available)
                .arg(if inactive { "1" } else { "0" })
                .arg(GROUP)
                .arg(self.channel())
                .arg(soldout::message(stock_mark(state.available), t, k))
                .arg(state.reserved)
                .arg(epoch)
                .arg(if state.consumed > 0 || state.reserved > 0 { "1" } else { "0" })
                .arg(state.kind.as_str());
            for id in in_redis.iter().filter(|id| !held.contains(*id)) {
                invocation.arg(id);
            }
            let mut conn = self.link.conn().await?;
            let (loaded, count): (i64, i64) =
                invocation.invoke_async(&mut conn).await.inspect_err(|e| self.link.judge(e))?;
            match loaded {
                1 => {
                    if count > 0 {
                        tracing::info!(
                            tenant = t,
                            key = k,
                            forgotten = count,
                            "redis forgot reservations the database expired first"
                        );
                    }
                    self.sold_out.mark(t, k, stock_mark(state.available));
                    return Ok(());
                }
                -1 => return Err(RedisModeError::Superseded),
                // Still closed: its lease runs out and the settlement loop warms it again.
                _ if Instant::now() >= deadline => return Err(RedisModeError::DrainTimeout(count)),
                _ => tokio::time::sleep(Duration::from_millis(10)).await,
            }
        }
    }

    /// Deletes a resource's Redis keys once it left redis mode at `epoch` (see
    /// [`scripts::FORGET`]). A later epoch holding it is left alone.
    pub(crate) async fn forget(&self, tenant: &str, key: &str, epoch: i64) -> Result<(), RedisModeError> {
        let mut invocation = self.forget.key(self.resource_key(tenant, key));
        invocation
            .key(self.stream_key(tenant, key))
            .key(self.limits_key(tenant, key))
            .key(self.reservations_key(tenant, key))
            .key(self.deadlines_key(tenant, key))
            .key(self.reversals_key(tenant, key))
            .arg(epoch)
            .arg(FORGOTTEN_MARKER_S);
        let mut conn = self.link.conn().await?;
        let left: i64 = invocation.invoke_async(&mut conn).await.inspect_err(|e| self.link.judge(e))?;
        if left > 0 {
            return Err(RedisModeError::DrainTimeout(left));
        }
        self.sold_out.mark(tenant, key, soldout::Mark::InStock);
        Ok(())
    }

    /// Marks the resource active or inactive in Redis as well (a no-op while it is cold).
    pub async fn set_inactive(&self, tenant: &str, key: &str, inactive: bool) -> Result<(), RedisModeError> {
        let mut cmd = redis::cmd("HSET");
        cmd.arg(self.resource_key(tenant, key)).arg("inactive").arg(if inactive { "1" } else { "0" });
        let _: i64 = self.link.query(&cmd).await?;
        Ok(())
    }

    /// Redis's counters of a resource; `None` when Redis does not know it (cold).
    pub async fn view(&self, tenant: &str, key: &str) -> Result<Option<RedisView>, RedisModeError> {
        let mut cmd = redis::cmd("HMGET");
        cmd.arg(self.resource_key(tenant, key)).arg("avail").arg("backlog").arg("open").arg("pending");
        let (available, backlog, open, pending): (Option<i64>, Option<i64>, Option<String>, Option<i64>) =
            self.link.query(&cmd).await?;
        Ok(available.map(|available| RedisView {
            available,
            backlog: backlog.unwrap_or(0),
            pending: pending.unwrap_or(0),
            open: open.as_deref() == Some("1"),
        }))
    }

    /// Whether a sale of `order_id` may still wait in one of the tenant's settlement streams,
    /// so that the database's ledger does not know the order yet. A stream holds only unsettled
    /// entries (each is deleted once settled); one longer than can be looked through counts as
    /// yes. Reads only.
    pub async fn order_unsettled(
        &self,
        storage: &dyn crate::storage::Storage,
        tenant: &TenantId,
        order_id: &str,
    ) -> Result<bool, RedisModeError> {
        /// Most unsettled entries looked through per stream.
        const SCAN: usize = 10_000;
        let needle = format!("\"oid\":{}", serde_json::Value::from(order_id));
        for (t, key) in storage.redis_resources(MAX_RESOURCES).await? {
            if &t != tenant {
                continue;
            }
            let mut cmd = redis::cmd("XRANGE");
            cmd.arg(self.stream_key(t.as_str(), key.as_str())).arg("-").arg("+").arg("COUNT").arg(SCAN);
            let reply: redis::streams::StreamRangeReply = self.link.query(&cmd).await?;
            if reply.ids.len() >= SCAN {
                return Ok(true);
            }
            let mentions = |entry: &redis::streams::StreamId| {
                entry.get::<String>("r").is_some_and(|record| record.contains(&needle))
            };
            if reply.ids.iter().any(mentions) {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Compares Redis with the database for one redis-mode resource.
    pub async fn compare(&self, tenant: &TenantId, state: &ResourceState) -> Result<RedisDrift, RedisModeError> {
        let view = self.view(tenant.as_str(), &state.key).await?;
        Ok(RedisDrift::judge(state, view))
    }
}

/// Redis against the database for one redis-mode resource. `drift` is what Redis would sell
/// beyond (positive) or short of (negative) the database once its backlog is settled:
/// `redis_available + backlog - database_available`. Zero when they agree.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
pub struct RedisDrift {
    pub key: String,
    /// `false` when Redis does not know the resource (never warmed, or its data was lost).
    pub warmed: bool,
    pub redis_available: i64,
    /// Available quantity sold (or, negative, returned) in Redis and not yet settled into the
    /// database.
    pub backlog: i64,
    /// Stream entries not yet settled.
    pub unsettled: i64,
    pub database_available: i64,
    pub drift: i64,
}

impl RedisDrift {
    pub fn judge(state: &ResourceState, view: Option<RedisView>) -> Self {
        let (warmed, redis_available, backlog, unsettled) = match view {
            Some(v) => (true, v.available, v.backlog, v.pending),
            None => (false, 0, 0, 0),
        };
        let drift = redis_available.saturating_add(backlog).saturating_sub(state.available);
        RedisDrift {
            key: state.key.clone(),
            warmed,
            redis_available,
            backlog,
            unsettled,
            database_available: state.available,
            drift,
        }
    }
}

impl RedisMode {
    /// Moves a reservation made in Redis to `to` (`confirmed`, `released`, `expired`; past its
    /// deadline it expires whatever was asked). Returns its state now and the reservation, or
    /// `None` when Redis does not hold it.
    pub async fn transition_reservation(
        &self,
        tenant: &str,
        key: &str,
        id: &str,
        to: &str,
        now_ms: i64,
    ) -> Result<Option<crate::engine::Reservation>, RedisModeError> {
        let Some(held) = self.get_reservation(tenant, key, id).await? else { return Ok(None) };
        let limit = held.lines.first().and_then(|l| l.limit_key.clone());
        let record = |op: &str| {
            serde_json::to_string(&SettleRecord {
                t: tenant.to_string(),
                k: key.to_string(),
                q: 0,
                rid: format!("{id}:{op}"),
                oid: held.order_id.clone(),
                idem: String::new(),
                h: String::new(),
                body: String::new(),
                lim: limit.clone(),
                lk: held.lines.first().map(|l| l.key.clone()),
                pv: 0,
                at: now_ms,
                op: Some(op.to_string()),
                rsv: Some(id.to_string()),
                exp: None,
                lines: None,
                tk: None,
                rv: None,
                c: None,
            })
            .map_err(|e| RedisModeError::Reply(e.to_string()))
        };
        let records = [record("confirm")?, record("release")?, record("expire")?];
        let Some((state, _)) = self.transition(tenant, key, id, to, now_ms, records).await? else { return Ok(None) };
        let state = crate::engine::ReservationState::from_db(&state)
            .ok_or_else(|| RedisModeError::Reply(format!("reservation state {state}")))?;
        Ok(Some(crate::engine::Reservation { state, ..held }))
    }

    /// A reservation made in Redis, with its current state.
    pub async fn get_reservation(
        &self,
        tenant: &str,
        key: &str,
        id: &str,
    ) -> Result<Option<crate::engine::Reservation>, RedisModeError> {
        let Some((state, doc)) = self.reservation(tenant, key, id).await? else { return Ok(None) };
        let held: crate::engine::Reservation =
            serde_json::from_str(&doc).map_err(|e| RedisModeError::Reply(format!("reservation document: {e}")))?;
        let state = crate::engine::ReservationState::from_db(&state)
            .ok_or_else(|| RedisModeError::Reply(format!("reservation state {state}")))?;
        Ok(Some(crate::engine::Reservation { state, ..held }))
    }
}

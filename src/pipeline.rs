//! One path for every mutating request, each step in one place and in this order (the HTTP
//! layer has authenticated the caller and parsed the body under its limits before):
//!
//! 1. **Validate, then plan** (the tenant's plugin or the built-in plan).
//! 2. **Route**: redis mode ([`crate::redis_mode`], which owns mode state) or the database path.
//! 3. **Execute**: the database path's orchestration ([`crate::apply`]) writes the outcome,
//!    ledger rows and idempotency record in one commit; redis mode, one Lua script plus its
//!    settlement.
//!
//! **The key's first answer wins.** A key already answered gets its stored response, byte for
//! byte (or a mismatch), whatever changed since (another plugin version or verdict, a lower
//! `orders.max_lines`, the resource's mode, a sold-out mark). The lookup comes before every
//! answer that is not the commit's own:
//! - every answer given before a commit (a validation refusal, a plugin's failure or refusal, a
//!   busy plan pool, a refusal of the route) is given only after the stored outcome was looked
//!   up, and loses to it;
//! - an order routed to Redis is looked up before Redis decides (Redis's record of a key is per
//!   resource, and knows nothing of a key first used on the database path); on PostgreSQL the
//!   lookups waiting together share one statement ([`crate::storage::lookups`]);
//! - an order that reaches the database commit is judged by the claim of its key inside that
//!   commit, before any business write; the claim also settles races between concurrent first
//!   uses. A separate read before it would find nothing more and cost a read per order: a
//!   same-binary A/B measured +25 % CPU per order on SQLite's hot key and +40 % on PostgreSQL.
//!
//! Reservation moves and adjustments take the same route. Nothing here speaks HTTP: outcomes
//! are stored responses or [`Refusal`]s, which the API maps to status codes.

use std::sync::Arc;

use crate::apply::reversals::{ReversalJob, Reversed};
use crate::engine::order::OrderBody;
use crate::engine::reversal::{OrderLedger, ReversalBody};
use crate::engine::{
    InvalidValue, LineResult, Mode, OrderDocument, OrderId, OrderStatus, Plan, ReservationState, ResourceKey, TenantId,
    MAX_LINE_QTY,
};
use crate::plugin::{PlanFailure, Registry};
use crate::redis_mode::{RedisMode, RedisModeError};
use crate::storage::{
    AdjustRefusal, IdempotencyRequest, Idempotent, ModeFence, OrderJob, Storage, StorageError, Transition,
};
use crate::time::now_ms;

/// The limits and defaults of orders (`[orders]`).
#[derive(Debug, Clone, Copy)]
pub struct OrderSettings {
    pub max_lines: usize,
    pub default_ttl_seconds: i64,
}

/// Why a request was refused. Nothing of it was applied, and nothing is stored under its key.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    /// The request breaks a rule (`field`: the offending field).
    #[error("{field}: {reason}")]
    Invalid { field: String, reason: InvalidValue },
    #[error(transparent)]
    Plan(#[from] PlanFailure),
    #[error(transparent)]
    Storage(#[from] StorageError),
    #[error(transparent)]
    Redis(#[from] RedisModeError),
    /// The resource the request names does not exist (for this tenant).
    #[error("no such resource")]
    ResourceNotFound,
    /// The order the request names was never applied (by this tenant).
    #[error("no such order")]
    OrderNotFound,
}

impl Refusal {
    fn invalid(field: &str, reason: impl Into<String>) -> Self {
        Refusal::Invalid { field: field.to_string(), reason: InvalidValue(reason.into()) }
    }
}

/// An order's answer: the response (fresh, replayed or a mismatch) and, when decided now on the
/// database path, how each planned line fared (for metrics).
#[derive(Debug)]
pub struct OrderAnswer {
    pub response: Idempotent,
    pub outcome: Option<(OrderStatus, Vec<LineResult>)>,
}

/// How often an adjustment decides again when the resource's mode moved under it.
const MODE_ATTEMPTS: usize = 3;

/// The pipeline of one process.
pub struct Pipeline {
    storage: Arc<dyn Storage>,
    plugins: Arc<Registry>,
    redis: Option<Arc<RedisMode>>,
    orders: OrderSettings,
}

impl Pipeline {
    pub fn new(
        storage: Arc<dyn Storage>,
        plugins: Arc<Registry>,
        redis: Option<Arc<RedisMode>>,
        orders: OrderSettings,
    ) -> Self {
        Self { storage, plugins, redis, orders }
    }

    /// The stored response of an answered key.
    async fn answered(&self, tenant: &TenantId, idem: &IdempotencyRequest) -> Result<Option<Idempotent>, Refusal> {
        Ok(self.storage.stored_outcome(tenant, idem).await?)
    }

    /// The key's stored response if it was answered, else `refusal`: nothing that refuses a
    /// request now may hide the first answer to its key. Storage that cannot be asked leaves the
    /// refusal standing (nothing was applied either way).
    async fn replayed_or(
        &self,
        tenant: &TenantId,
        idem: &IdempotencyRequest,
        refusal: Refusal,
    ) -> Result<Idempotent, Refusal> {
        match self.storage.stored_outcome(tenant, idem).await {
            Ok(Some(previous)) => Ok(previous),
            Ok(None) | Err(_) => Err(refusal),
        }
    }

    /// Applies an order: every line, or (when the plan allows) those that can.
    pub async fn order(
        &self,
        tenant: &TenantId,
        idempotency: IdempotencyRequest,
        body: OrderBody,
    ) -> Result<OrderAnswer, Refusal> {
        let answer = |response| OrderAnswer { response, outcome: None };
        let order = match body.validate(self.orders.max_lines) {
            Ok(order) => order,
            Err((field, reason)) => {
                return self.replayed_or(tenant, &idempotency, Refusal::Invalid { field, reason }).await.map(answer)
            }
        };
        let now = now_ms();
        let plan = match self.plugins.plan(tenant, &order, now).await {
            Ok(plan) => plan,
            Err(failure) => return self.replayed_or(tenant, &idempotency, failure.into()).await.map(answer),
        };
        let ttl_seconds = order.ttl_seconds.unwrap_or(self.orders.default_ttl_seconds);
        let job = Arc::new(OrderJob {
            tenant: tenant.clone(),
            idempotency,
            order,
            plan,
            ttl_ms: ttl_seconds.saturating_mul(1000),
        });
        if let Some(redis) = self.redis.as_deref().filter(|r| r.routes(&job)) {
            return self.order_in_redis(redis, job, now).await;
        }
        match self.storage.execute_order(job.clone(), now).await {
            Ok(executed) => Ok(OrderAnswer { response: executed.response, outcome: executed.outcome }),
            // Planned before this process learnt that a resource entered redis mode (its
            // database copy refused the line): this process's view is corrected by `routes_now`,
            // and the order goes to Redis, its key still free.
            Err(StorageError::RetryLater(why)) => match self.redis.as_deref() {
                Some(redis) if redis.routes_now(self.storage.as_ref(), &job).await? => {
                    self.order_in_redis(redis, job, now).await
                }
                _ => Err(StorageError::RetryLater(why).into()),
            },
            Err(err) => Err(err.into()),
        }
    }

    /// An order whose plan touches a redis-mode resource. Redis holding nothing to sell (cold or
    /// closed) may mean the resource left redis mode without this process knowing yet: the
    /// database is asked, and the order takes the database path if so.
    async fn order_in_redis(&self, redis: &RedisMode, job: Arc<OrderJob>, now: i64) -> Result<OrderAnswer, Refusal> {
        let answer = |response| OrderAnswer { response, outcome: None };
        let tenant = &job.tenant;
        // A new connection to Redis: the modes are read again first, and an order whose
        // resource left redis mode meanwhile takes the database path.
        redis.catch_up(self.storage.as_ref()).await?;
        if !redis.routes(&job) {
            return self.in_database(job, now).await;
        }
        if let Some(previous) = self.answered(tenant, &job.idempotency).await? {
            return Ok(answer(previous));
        }
        match redis.order(self.storage.as_ref(), &job, now).await {
            Ok(response) => Ok(answer(response)),
            Err(RedisModeError::NotWarmed(_) | RedisModeError::Closed)
                if !redis.routes_now(self.storage.as_ref(), &job).await? =>
            {
                self.in_database(job, now).await
            }
            Err(refused) => self.replayed_or(tenant, &job.idempotency, refused.into()).await.map(answer),
        }
    }

    /// An order sent to Redis whose resources are not (any more) in redis mode.
    async fn in_database(&self, job: Arc<OrderJob>, now: i64) -> Result<OrderAnswer, Refusal> {
        let executed = self.storage.execute_order(job, now).await?;
        Ok(OrderAnswer { response: executed.response, outcome: executed.outcome })
    }

    /// The plan and the outcome the order would have now; applies and records nothing.
    pub async fn dry_run(&self, tenant: &TenantId, body: OrderBody) -> Result<(Plan, OrderDocument), Refusal> {
        let order =
            body.validate(self.orders.max_lines).map_err(|(field, reason)| Refusal::Invalid { field, reason })?;
        let plan = self.plugins.plan(tenant, &order, now_ms()).await?;
        let outcome = self.storage.preview_order(tenant, &order, &plan).await?;
        Ok((plan, outcome))
    }

    /// Restock (+) or write-off (−). The mode is read from the database, not this process's
    /// view, and the adjustment applies only if the resource is still in it: a redis-mode
    /// resource is adjusted with its sales closed and settled under a new epoch, then loaded
    /// again whether or not the adjustment applied (docs/REDIS.md, "Fencing").
    pub async fn adjust(
        &self,
        tenant: &TenantId,
        idempotency: IdempotencyRequest,
        key: &ResourceKey,
        delta: i64,
        reason: Option<&str>,
    ) -> Result<Idempotent, Refusal> {
        if delta == 0 || delta.unsigned_abs() > MAX_LINE_QTY.unsigned_abs() {
            let refusal = Refusal::invalid("delta", format!("must be non-zero and at most {MAX_LINE_QTY} in size"));
            return self.replayed_or(tenant, &idempotency, refusal).await;
        }
        if reason.is_some_and(|r| r.chars().count() > 200) {
            let refusal = Refusal::invalid("reason", "must be at most 200 characters");
            return self.replayed_or(tenant, &idempotency, refusal).await;
        }
        // From here the adjustment's key is claimed inside its commit, which replays an answered one.
        for _ in 0..MODE_ATTEMPTS {
            let current = self.storage.get_resource(tenant, key).await?;
            let adjusted = match (current.map(|c| c.mode), &self.redis) {
                (Some(Mode::Redis), Some(redis)) => {
                    let (redis, storage) = (redis.clone(), self.storage.clone());
                    let (t, k, idem) = (tenant.clone(), key.clone(), idempotency.clone());
                    crate::redis_mode::control::detached(async move {
                        redis.adjust(storage.as_ref(), &t, &idem, &k, delta).await
                    })
                    .await?
                }
                _ => self.storage.adjust(tenant, &idempotency, key, delta, ModeFence::Db, now_ms()).await?,
            };
            match adjusted {
                Ok(outcome) => return Ok(outcome),
                Err(AdjustRefusal::ResourceNotFound) => return Err(Refusal::ResourceNotFound),
                // Its mode moved between the read and the change: decide again.
                Err(AdjustRefusal::ModeChanged) => continue,
            }
        }
        let refusal = match self.redis {
            Some(_) => RedisModeError::Superseded,
            // A redis-mode resource on a server without [redis]: only a server with Redis may
            // change its stock.
            None => RedisModeError::NotConfigured,
        };
        self.replayed_or(tenant, &idempotency, refusal.into()).await
    }

    /// Reverses (part of) an order: consumed back to available on the resources and buckets it
    /// took from (docs/API.md, "Order lookup and reversals"). Decided on the database path,
    /// which reads the order from its ledger; a line sold in redis mode is given back through
    /// Redis. A resource whose mode moves meanwhile makes the reversal decide again.
    pub async fn reverse(
        &self,
        tenant: &TenantId,
        idempotency: IdempotencyRequest,
        order_id: OrderId,
        body: ReversalBody,
    ) -> Result<Idempotent, Refusal> {
        if let Err((field, reason)) = body.validate(self.orders.max_lines) {
            return self.replayed_or(tenant, &idempotency, Refusal::Invalid { field, reason }).await;
        }
        let job = Arc::new(ReversalJob {
            tenant: tenant.clone(),
            idempotency,
            order_id,
            lines: body.lines,
            reason: body.reason,
        });
        for _ in 0..MODE_ATTEMPTS {
            match self.storage.reverse_order(job.clone(), now_ms()).await {
                Ok(Reversed::Answered(response)) => return Ok(response),
                Ok(Reversed::NotFound) => return Err(self.not_found_or_settling(tenant, &job.order_id).await),
                Ok(Reversed::InRedis { order, resource }) => {
                    let Some(redis) = self.redis.as_deref() else {
                        return self.replayed_or(tenant, &job.idempotency, RedisModeError::NotConfigured.into()).await;
                    };
                    return match redis.reverse(&job, &order, &resource, now_ms()).await {
                        Ok(response) => Ok(response),
                        // Redis holds nothing to give back to: the resource may have left redis
                        // mode without this process knowing; the database is asked.
                        Err(RedisModeError::NotWarmed(_) | RedisModeError::Closed)
                            if !redis.still_redis(self.storage.as_ref(), tenant, &resource).await? =>
                        {
                            continue
                        }
                        Err(refused) => self.replayed_or(tenant, &job.idempotency, refused.into()).await,
                    };
                }
                // A resource entered redis mode between the read and the change: decide again.
                Err(StorageError::RetryLater(_)) => continue,
                Err(err) => return Err(err.into()),
            }
        }
        self.replayed_or(tenant, &job.idempotency, RedisModeError::Superseded.into()).await
    }

    /// The order as the database's ledger knows it; `None`: never applied (by this tenant).
    /// A sale of it Redis made and has not settled yet is answered `503` (retry), not `404`.
    pub async fn lookup_order(&self, tenant: &TenantId, order_id: &OrderId) -> Result<Option<OrderLedger>, Refusal> {
        match self.storage.get_order(tenant, order_id).await? {
            Some(order) => Ok(Some(order)),
            None => match self.not_found_or_settling(tenant, order_id).await {
                Refusal::OrderNotFound => Ok(None),
                transient => Err(transient),
            },
        }
    }

    /// Why the database's ledger does not know an order: never applied (`OrderNotFound`), or
    /// sold in redis mode and still waiting in a settlement stream (transient: the ledger will
    /// know it within moments, so the client retries).
    async fn not_found_or_settling(&self, tenant: &TenantId, order_id: &OrderId) -> Refusal {
        let Some(redis) = self.redis.as_deref() else { return Refusal::OrderNotFound };
        match redis.order_unsettled(self.storage.as_ref(), tenant, order_id.as_str()).await {
            Ok(false) => Refusal::OrderNotFound,
            Ok(true) => StorageError::RetryLater(format!("order {order_id} is not settled yet")).into(),
            Err(err) => err.into(),
        }
    }

    /// Confirms or releases a reservation (made in Redis or on the database path).
    pub async fn move_reservation(
        &self,
        tenant: &TenantId,
        id: &str,
        to: ReservationState,
    ) -> Result<Transition, Refusal> {
        if let Some(redis) = self.redis.as_deref() {
            if let Some(moved) = redis.move_reservation(self.storage.as_ref(), tenant, id, to).await? {
                return Ok(moved);
            }
        }
        let now = now_ms();
        Ok(match to {
            ReservationState::Confirmed => self.storage.confirm_reservation(tenant, id, now).await?,
            _ => self.storage.release_reservation(tenant, id, now).await?,
        })
    }
}

//! An order on a redis-mode resource: one line to one resource, decided by the deduct script
//! (or, once Redis announced the resource sold out, answered from memory after Redis is asked
//! whether this request's key was answered before).

use super::{Bodies, Deducted, Deduction, LimitSeed, RedisMode, RedisModeError, Refusals, Reserve};
use crate::engine::{
    Action, LineResult, OrderDocument, Reason, Reservation, ReservationLine, ReservationState, TenantId,
};
use crate::storage::redis_store::SettleRecord;
use crate::storage::rules::new_request_id;
use crate::storage::{ContentType, Idempotent, OrderJob, Storage, StoredResponse};
use crate::time::Timestamp;

/// How often an order reads a limit key's count for Redis before it answers 503.
const SEED_ATTEMPTS: usize = 3;
/// How long past its deadline Redis remembers which resource a reservation belongs to.
const RESERVATION_MAP_EXTRA_S: i64 = 86_400;

fn internal(err: serde_json::Error) -> RedisModeError {
    RedisModeError::Reply(format!("encoding a document: {err}"))
}

impl RedisMode {
    /// Whether this order goes to Redis: its plan touches a redis-mode resource.
    pub fn routes(&self, job: &OrderJob) -> bool {
        job.plan.resources().any(|r| self.is_redis(job.tenant.as_str(), r.as_str()))
    }

    /// Whether this order goes to Redis, asking the database rather than this process's view
    /// (and correcting the view): after Redis had nothing to sell, or the database path found a
    /// resource in redis mode.
    pub async fn routes_now(&self, storage: &dyn Storage, job: &OrderJob) -> Result<bool, RedisModeError> {
        let mut redis = false;
        for resource in job.plan.resources() {
            redis |= self.still_redis(storage, &job.tenant, resource.as_str()).await?;
        }
        Ok(redis)
    }

    /// Decides an order whose plan touches a redis-mode resource (see [`RedisMode::routes`]).
    /// `Fresh` is this request's outcome (applied or refused); a key Redis answered before gets
    /// its first outcome.
    pub async fn order(&self, storage: &dyn Storage, job: &OrderJob, now: i64) -> Result<Idempotent, RedisModeError> {
        let tenant: &TenantId = &job.tenant;
        let line = match job.plan.lines.as_slice() {
            [line] if line.targets.len() == 1 && line.targets[0].create_if_missing.is_none() => line,
            _ => return Err(RedisModeError::OrderUnsupported),
        };
        let target = &line.targets[0].resource;
        let reservation = (job.order.action == Action::Reserve)
            .then(|| (format!("rsv_{}", ulid::Ulid::new()), Timestamp(now.saturating_add(job.ttl_ms))));
        let document = |result: LineResult| OrderDocument::build(&job.order, &job.plan, &[result], reservation.clone());
        let body = |result: LineResult| serde_json::to_string(&document(result)).map_err(internal);
        let applied = body(LineResult::Applied(0))?;
        let held = reservation.as_ref().map(|(id, expires_at)| Reservation {
            id: id.clone(),
            order_id: job.order.order_id.to_string(),
            state: ReservationState::Held,
            lines: vec![ReservationLine {
                key: job.order.lines.get(line.line).map(|l| l.key.to_string()).unwrap_or_default(),
                resource: target.to_string(),
                qty: line.qty,
                limit_key: line.limit.as_ref().map(|l| l.key.to_string()),
                buckets: Vec::new(),
            }],
            expires_at: *expires_at,
        });
        let lines = held.as_ref().map(|r| serde_json::to_string(&r.lines)).transpose().map_err(internal)?;
        let record = SettleRecord {
            t: tenant.to_string(),
            k: target.to_string(),
            q: line.qty,
            rid: new_request_id(),
            oid: job.order.order_id.to_string(),
            idem: job.idempotency.key.to_string(),
            h: job.idempotency.request_hash.clone(),
            body: applied.clone(),
            lim: line.limit.as_ref().map(|l| l.key.to_string()),
            lk: job.order.lines.get(line.line).map(|l| l.key.to_string()),
            pv: job.plan.planner.version,
            at: now,
            op: held.as_ref().map(|_| "reserve".to_string()),
            rsv: held.as_ref().map(|r| r.id.clone()),
            exp: held.as_ref().map(|r| r.expires_at.0),
            lines,
            tk: None,
            rv: None,
            c: None,
        };
        // Only the identity travels: the status and body the script chose go beside it. Built
        // and sent only once Redis decided a refusal (see `scripts::DEDUCT`).
        let refusal = |record: &SettleRecord| SettleRecord {
            q: 0,
            rid: new_request_id(),
            body: String::new(),
            lim: None,
            op: Some("refuse".to_string()),
            rsv: None,
            exp: None,
            lines: None,
            ..record.clone()
        };
        let reserve = match &held {
            Some(r) => Some(Reserve {
                id: r.id.clone(),
                expires_at_ms: r.expires_at.0,
                document: serde_json::to_string(r).map_err(internal)?,
            }),
            None => None,
        };
        let deduction = Deduction {
            reserve,
            tenant,
            key: target,
            qty: line.qty,
            limit: line.limit.as_ref().map(|l| (l.key.as_str(), l.max)),
            kind: line.targets[0].kind,
            request_hash: &job.idempotency.request_hash,
            idempotency_key: job.idempotency.key.as_str(),
            bodies: Bodies { applied, refusals: None },
            record,
            seed: None,
        };
        let sold_out = || -> Result<Idempotent, RedisModeError> {
            // Not stored: a retry after a restock may apply.
            metrics::counter!("stockd_redis_orders_total", "outcome" => "sold_out").increment(1);
            let body = body(LineResult::Rejected(Reason::SoldOut))?;
            Ok(Idempotent::Fresh(StoredResponse { status: 409, content_type: ContentType::Json, body }))
        };
        let mut deduction = deduction;
        let answer = match self.sold_out.state(tenant.as_str(), target.as_str()) {
            // Every sale is in the database, whose record of this key the pipeline read first.
            Some(true) => return sold_out(),
            // Some sale may be in Redis alone: a key Redis answered keeps its first answer.
            Some(false) => match self.recorded(&deduction).await? {
                Some(previous) => previous,
                None => return sold_out(),
            },
            None => match self.deduct_seeded(storage, &mut deduction).await? {
                // A refusal: run again with every refusal's body (the state may have moved on
                // meanwhile, so the second call can decide another outcome, a sale too).
                Deducted::Refuse => {
                    deduction.bodies.refusals = Some(Refusals {
                        insufficient: body(LineResult::Rejected(Reason::Insufficient))?,
                        limit: body(LineResult::Rejected(Reason::LimitExceeded))?,
                        inactive: body(LineResult::Rejected(Reason::ResourceInactive))?,
                        // The plan names a resource of another kind: as on the database path.
                        not_found: body(LineResult::Rejected(Reason::ResourceNotFound))?,
                        record: refusal(&deduction.record),
                    });
                    self.deduct_seeded(storage, &mut deduction).await?
                }
                answer => answer,
            },
        };
        match answer {
            Deducted::Fresh { outcome, status, body, available } => {
                if available == 0 {
                    self.sold_out.mark(tenant.as_str(), target.as_str(), super::soldout::Mark::SoldOut);
                }
                if let (Some(r), "applied") = (&held, outcome.as_str()) {
                    // Until settled (milliseconds), confirm, release and GET find it through this.
                    let ttl_s = job.ttl_ms / 1000 + RESERVATION_MAP_EXTRA_S;
                    if let Err(err) = self.map_reservation(tenant.as_str(), &r.id, target.as_str(), ttl_s).await {
                        tracing::warn!(error = %err, "recording a reservation's resource in redis failed");
                    }
                }
                metrics::counter!("stockd_redis_orders_total", "outcome" => outcome).increment(1);
                Ok(Idempotent::Fresh(StoredResponse { status, content_type: ContentType::Json, body }))
            }
            Deducted::Replay { status, body } => {
                Ok(Idempotent::Replayed(StoredResponse { status, content_type: ContentType::Json, body }))
            }
            Deducted::Mismatch => Ok(Idempotent::Mismatch),
            Deducted::Cold => Err(RedisModeError::NotWarmed(target.to_string())),
            Deducted::Closed | Deducted::Seed => Err(RedisModeError::Closed),
            Deducted::Refuse => Err(RedisModeError::Reply("a refusal without its body".into())),
            Deducted::Backlog => {
                metrics::counter!("stockd_redis_backlog_refusals_total").increment(1);
                Err(RedisModeError::Backlog)
            }
        }
    }

    /// Runs the deduct script, reading the limit key's count from the database when Redis asks
    /// for it (a limit key's first use since the resource entered redis mode). `Seed` again
    /// after a few reads: the resource's epoch keeps moving (being warmed).
    async fn deduct_seeded(&self, storage: &dyn Storage, d: &mut Deduction<'_>) -> Result<Deducted, RedisModeError> {
        for _ in 0..SEED_ATTEMPTS {
            let answer = self.deduct(d).await?;
            let (Deducted::Seed, Some((limit, _))) = (&answer, d.limit) else { return Ok(answer) };
            let (used, epoch) = storage.limit_seed(d.tenant, limit, d.key).await?;
            d.seed = Some(LimitSeed { used, epoch });
        }
        Ok(Deducted::Seed)
    }
}

//! A reversal of an order sold in redis mode: decided from the database's ledger (what the
//! order took, what is settled as reversed of it) and by one [`super::scripts::REVERSE`] in Redis,
//! which keeps the order's own count of reversed units (settled or not) and refuses beyond the
//! take, gives the stock and the per-user limit back to Redis, records the outcome under the
//! key, and appends the `reverse` record that settlement writes into the database like a sale.
//!
//! A refusal decided here (beyond the take, a held line) is not an outcome: nothing is written,
//! and the same key may be decided again (like a `sold_out` answer). An applied reversal is
//! replayed from Redis's record until settled, from the database after.

use redis::RedisError;

use super::{soldout, RedisMode, RedisModeError};
use crate::apply::reversals::{new_reversal_id, ReversalJob};
use crate::engine::reversal::{OrderLedger, ReversalDocument, ReversalRefusal};
use crate::problem::Problem;
use crate::storage::redis_store::SettleRecord;
use crate::storage::{ContentType, Idempotent, StoredResponse};

fn encoding(err: serde_json::Error) -> RedisModeError {
    RedisModeError::Reply(format!("encoding a document: {err}"))
}

fn refused(problem: &Problem) -> Result<Idempotent, RedisModeError> {
    metrics::counter!("stockd_redis_reversals_total", "outcome" => "refused").increment(1);
    StoredResponse::problem(problem).map(Idempotent::Fresh).map_err(RedisModeError::Storage)
}

impl RedisMode {
    /// Reverses a line of `order` on `resource`, a redis-mode resource (see the module docs).
    /// A reversal that names anything else, or more than that one line, is
    /// [`RedisModeError::OrderUnsupported`].
    pub async fn reverse(
        &self,
        job: &ReversalJob,
        order: &OrderLedger,
        resource: &str,
        now_ms: i64,
    ) -> Result<Idempotent, RedisModeError> {
        let tenant = job.tenant.as_str();
        let lines = match order.plan(job.lines.as_deref()) {
            Ok(lines) => lines,
            Err(refusal) => return self.recorded_or(job, resource, &refusal).await,
        };
        let line = match lines.as_slice() {
            [line] if line.resource == resource && line.takes.len() == 1 => line,
            _ => return Err(RedisModeError::OrderUnsupported),
        };
        let take = line.takes[0];
        let settled = order.lines.iter().find(|l| l.resource == resource).map_or(0, |l| l.reversed);
        let reversal_id = new_reversal_id();
        let document = ReversalDocument::build(job.order_id.as_str(), &reversal_id, job.reason.as_deref(), &lines);
        let body = serde_json::to_string(&document).map_err(encoding)?;
        let record = SettleRecord {
            t: tenant.to_string(),
            k: resource.to_string(),
            q: line.qty,
            rid: reversal_id,
            oid: job.order_id.to_string(),
            idem: job.idempotency.key.to_string(),
            h: job.idempotency.request_hash.clone(),
            body: body.clone(),
            lim: line.limit_key.clone(),
            lk: Some(line.key.clone()),
            pv: 0,
            at: now_ms,
            op: Some("reverse".to_string()),
            rsv: None,
            exp: None,
            lines: None,
            tk: Some(take.taken),
            rv: Some(line.reverses.clone()),
            c: None,
        };
        let record = serde_json::to_string(&record).map_err(encoding)?;
        let mut invocation = self.reverse.key(self.resource_key(tenant, resource));
        invocation
            .key(self.limits_key(tenant, resource))
            .key(self.request_key(tenant, resource, job.idempotency.key.as_str()))
            .key(self.stream_key(tenant, resource))
            .key(self.reversals_key(tenant, resource))
            .arg(line.qty)
            .arg(job.order_id.as_str())
            .arg(take.taken)
            .arg(settled)
            .arg(line.limit_key.as_deref().unwrap_or(""))
            .arg(&job.idempotency.request_hash)
            .arg(self.request_ttl_s)
            .arg(&body)
            .arg(record)
            .arg(self.channel())
            .arg(soldout::message(soldout::Mark::InStock, tenant, resource));
        let mut conn = self.link.conn().await?;
        let reply: Result<(String, String, String, i64), RedisError> = invocation.invoke_async(&mut conn).await;
        let (outcome, code, body, reversible) = reply.inspect_err(|e| self.link.judge(e))?;
        let status = code.parse::<u16>().map_err(|_| RedisModeError::Reply(format!("status {code}")))?;
        match outcome.as_str() {
            "applied" => {
                self.sold_out.mark(tenant, resource, soldout::Mark::InStock);
                metrics::counter!("stockd_redis_reversals_total", "outcome" => "applied").increment(1);
                Ok(Idempotent::Fresh(StoredResponse { status, content_type: ContentType::Json, body }))
            }
            "replay" => Ok(Idempotent::Replayed(StoredResponse { status, content_type: ContentType::Json, body })),
            "mismatch" => Ok(Idempotent::Mismatch),
            "exceeds" => {
                let detail = format!("{} has {reversible} reversible, {} requested", line.key, line.qty);
                refused(&ReversalRefusal::Exceeds(detail).problem())
            }
            "cold" => Err(RedisModeError::NotWarmed(resource.to_string())),
            "closed" => Err(RedisModeError::Closed),
            other => Err(RedisModeError::Reply(format!("reverse: {other}"))),
        }
    }

    /// A refusal decided from the ledger, unless Redis answered this key before (an applied
    /// reversal not yet settled keeps its first answer).
    async fn recorded_or(
        &self,
        job: &ReversalJob,
        resource: &str,
        refusal: &ReversalRefusal,
    ) -> Result<Idempotent, RedisModeError> {
        let mut cmd = redis::cmd("HMGET");
        cmd.arg(self.request_key(job.tenant.as_str(), resource, job.idempotency.key.as_str()))
            .arg("h")
            .arg("c")
            .arg("b");
        let (hash, code, body): (Option<String>, Option<String>, Option<String>) = self.link.query(&cmd).await?;
        let Some(hash) = hash else { return refused(&refusal.problem()) };
        if hash != job.idempotency.request_hash {
            return Ok(Idempotent::Mismatch);
        }
        let code = code.unwrap_or_default();
        let status = code.parse::<u16>().map_err(|_| RedisModeError::Reply(format!("status {code}")))?;
        Ok(Idempotent::Replayed(StoredResponse {
            status,
            content_type: ContentType::Json,
            body: body.unwrap_or_default(),
        }))
    }
}

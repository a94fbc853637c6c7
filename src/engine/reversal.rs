//! Orders as the ledger knows them, and reversals: what an order took, per line and bucket,
//! folded from its ledger entries; which quantities a reversal gives back from which buckets;
//! and the documents clients receive. Pure, so every backend and redis mode judge alike.
//!
//! An order is its `order_id` (per tenant): every ledger entry written under it, by however
//! many requests. A line is the order line's key as sent (entries written before the key was
//! recorded use their resource's key) with the resource it applied to. Per bucket:
//! `taken = deduct + confirm` (consumed by the order), `held = reserve - confirm - release -
//! expire`, `reversed = reverse`; a reversal may give back at most `taken - reversed`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::types::{InvalidValue, LedgerOp, Quantity, ResourceKey};
use crate::problem::Problem;

/// Longest `reason` a reversal may carry, in characters.
pub const MAX_REASON_CHARS: usize = 500;

/// One `(resource, bucket, op)` of an order's ledger entries, summed (as storage reads them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OrderEntries {
    pub resource: String,
    pub bucket: i64,
    pub op: LedgerOp,
    pub qty: i64,
    /// The order line's key, where the entries recorded it.
    pub line_key: Option<String>,
    /// The per-user limit the line counted against, where recorded.
    pub limit_key: Option<String>,
    /// The first request id among these entries (request ids sort by creation).
    pub first_request: String,
}

/// One bucket of an order line.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, ToSchema)]
pub struct BucketLedger {
    pub bucket: i64,
    /// Deducted or confirmed: consumed by the order.
    pub taken: i64,
    pub held: i64,
    pub released: i64,
    pub reversed: i64,
}

/// One line of an order as the ledger knows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct OrderLine {
    /// The order line's key as sent.
    pub key: String,
    /// The resource it applied to.
    pub resource: String,
    /// Consumed now (`available → consumed`).
    pub deducted: i64,
    /// Confirmed from a reservation (`reserved → consumed`).
    pub confirmed: i64,
    /// Still reserved by a held reservation.
    pub held: i64,
    /// Released or expired reservations: given back already, nothing to reverse.
    pub released: i64,
    pub reversed: i64,
    /// `deducted + confirmed - reversed`: what a reversal may still give back.
    pub reversible: i64,
    /// Per bucket, for a bucketed resource.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub buckets: Option<Vec<BucketLedger>>,
    #[serde(skip)]
    pub limit_key: Option<String>,
    /// The first request that took from it (what a reversal's ledger entries name).
    #[serde(skip)]
    pub first_request: String,
    #[serde(skip)]
    bucket_rows: Vec<BucketLedger>,
}

/// `GET /v1/orders/{order_id}`: the order as its ledger entries tell it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct OrderLedger {
    pub order_id: String,
    pub lines: Vec<OrderLine>,
}

impl OrderLedger {
    /// Folds an order's summed entries into lines (by key, then resource); `None` when it has
    /// none (the tenant never applied it). `bucketed`: whether each resource has buckets.
    pub fn fold(order_id: &str, entries: &[OrderEntries], bucketed: impl Fn(&str) -> bool) -> Option<Self> {
        if entries.is_empty() {
            return None;
        }
        // A resource's line key: whichever entry recorded one (a line maps to one resource).
        let mut keys: BTreeMap<&str, &str> = BTreeMap::new();
        for e in entries {
            if let Some(k) = &e.line_key {
                keys.entry(e.resource.as_str()).or_insert(k.as_str());
            }
        }
        let mut lines: BTreeMap<(String, String), OrderLine> = BTreeMap::new();
        for e in entries {
            let key = keys.get(e.resource.as_str()).copied().unwrap_or(e.resource.as_str()).to_string();
            let line = lines.entry((key.clone(), e.resource.clone())).or_insert_with(|| OrderLine {
                key,
                resource: e.resource.clone(),
                deducted: 0,
                confirmed: 0,
                held: 0,
                released: 0,
                reversed: 0,
                reversible: 0,
                buckets: None,
                limit_key: None,
                first_request: String::new(),
                bucket_rows: Vec::new(),
            });
            if line.limit_key.is_none() {
                line.limit_key = e.limit_key.clone();
            }
            let taking = matches!(e.op, LedgerOp::Deduct | LedgerOp::Confirm);
            if taking && (line.first_request.is_empty() || e.first_request < line.first_request) {
                line.first_request = e.first_request.clone();
            }
            let at = match line.bucket_rows.iter().position(|b| b.bucket == e.bucket) {
                Some(at) => at,
                None => {
                    line.bucket_rows.push(BucketLedger { bucket: e.bucket, ..BucketLedger::default() });
                    line.bucket_rows.len() - 1
                }
            };
            let b = &mut line.bucket_rows[at];
            let q = e.qty;
            match e.op {
                LedgerOp::Deduct => {
                    line.deducted = line.deducted.saturating_add(q);
                    b.taken = b.taken.saturating_add(q);
                }
                LedgerOp::Confirm => {
                    line.confirmed = line.confirmed.saturating_add(q);
                    b.taken = b.taken.saturating_add(q);
                    b.held = b.held.saturating_sub(q);
                }
                LedgerOp::Reserve => b.held = b.held.saturating_add(q),
                LedgerOp::Release | LedgerOp::Expire => {
                    b.held = b.held.saturating_sub(q);
                    b.released = b.released.saturating_add(q);
                }
                LedgerOp::Reverse => b.reversed = b.reversed.saturating_add(q),
                LedgerOp::Create | LedgerOp::Adjust => {}
            }
        }
        let lines = lines
            .into_values()
            .map(|mut line| {
                line.bucket_rows.sort_by_key(|b| b.bucket);
                let sum = |f: fn(&BucketLedger) -> i64| line.bucket_rows.iter().map(f).fold(0i64, i64::saturating_add);
                line.held = sum(|b| b.held);
                line.released = sum(|b| b.released);
                line.reversed = sum(|b| b.reversed);
                line.reversible = sum(|b| b.taken.saturating_sub(b.reversed).max(0));
                if bucketed(&line.resource) {
                    line.buckets = Some(line.bucket_rows.clone());
                }
                line
            })
            .collect();
        Some(OrderLedger { order_id: order_id.to_string(), lines })
    }

    /// Decides what a reversal gives back (see the module docs): the requested lines, or with
    /// `None` every line's whole reversible quantity. All or nothing: one line that cannot be
    /// reversed refuses the whole reversal.
    pub fn plan(&self, requested: Option<&[ReversalLineBody]>) -> Result<Vec<LineReversal>, ReversalRefusal> {
        let wanted: Vec<(&OrderLine, i64)> = match requested {
            Some(lines) => {
                let mut wanted = Vec::with_capacity(lines.len());
                for asked in lines {
                    let key = asked.key.as_str();
                    let line = self
                        .lines
                        .iter()
                        .find(|l| l.key == key)
                        .or_else(|| self.lines.iter().find(|l| l.resource == key))
                        .ok_or_else(|| ReversalRefusal::exceeds(format!("the order took nothing of {key}")))?;
                    wanted.push((line, asked.qty.get()));
                }
                wanted
            }
            None => {
                let wanted: Vec<_> =
                    self.lines.iter().filter(|l| l.reversible > 0).map(|l| (l, l.reversible)).collect();
                if wanted.is_empty() {
                    return Err(match self.lines.iter().find(|l| l.held > 0) {
                        Some(held) => ReversalRefusal::held(&held.key),
                        None => ReversalRefusal::exceeds("nothing of the order is left to reverse".into()),
                    });
                }
                wanted
            }
        };
        wanted
            .into_iter()
            .map(|(line, qty)| {
                if qty > line.reversible {
                    return Err(if line.reversible == 0 && line.held > 0 {
                        ReversalRefusal::held(&line.key)
                    } else {
                        ReversalRefusal::exceeds(format!(
                            "{} has {} reversible, {qty} requested",
                            line.key, line.reversible
                        ))
                    });
                }
                let mut left = qty;
                let mut takes = Vec::new();
                for b in &line.bucket_rows {
                    let can = b.taken.saturating_sub(b.reversed).max(0).min(left);
                    if can > 0 {
                        takes.push(BucketReversal { bucket: b.bucket, qty: can, taken: b.taken });
                        left -= can;
                    }
                }
                Ok(LineReversal {
                    key: line.key.clone(),
                    resource: line.resource.clone(),
                    qty,
                    limit_key: line.limit_key.clone(),
                    reverses: line.first_request.clone(),
                    bucketed: line.buckets.is_some(),
                    takes,
                })
            })
            .collect()
    }
}

/// What a reversal gives back from one bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketReversal {
    pub bucket: i64,
    pub qty: i64,
    /// What the order took from the bucket, as the ledger said: the bound of the guarded
    /// counter every reversal of it updates.
    pub taken: i64,
}

/// What a reversal gives back on one line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LineReversal {
    pub key: String,
    pub resource: String,
    pub qty: i64,
    pub limit_key: Option<String>,
    /// The request whose take it gives back.
    pub reverses: String,
    pub bucketed: bool,
    /// In bucket order.
    pub takes: Vec<BucketReversal>,
}

/// Why a reversal was refused: a stored outcome (problem+json, `409`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReversalRefusal {
    /// More than the order took minus earlier reversals, or a line the order never took.
    Exceeds(String),
    /// The line is only held by a reservation: release it instead.
    Held(String),
}

impl ReversalRefusal {
    fn exceeds(detail: String) -> Self {
        ReversalRefusal::Exceeds(detail)
    }

    fn held(key: &str) -> Self {
        ReversalRefusal::Held(format!("{key} is held by a reservation; release it instead"))
    }

    pub fn problem(&self) -> Problem {
        match self {
            ReversalRefusal::Exceeds(detail) => Problem::new(409, "exceeds_reversible", "Exceeds reversible", detail),
            ReversalRefusal::Held(detail) => Problem::new(409, "reservation_held", "Reservation held", detail),
        }
    }
}

/// The body of `POST /v1/orders/{order_id}/reversals`. Unknown fields are refused.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReversalBody {
    /// What to give back; absent: everything still reversible.
    #[serde(default)]
    #[schema(max_items = 1000)]
    pub lines: Option<Vec<ReversalLineBody>>,
    /// Why (at most 500 characters), carried in the response and the `order.reversed` event.
    #[serde(default)]
    #[schema(max_length = 500)]
    pub reason: Option<String>,
}

/// One line to reverse: the order line's key (or its resource's) and the quantity.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReversalLineBody {
    pub key: ResourceKey,
    pub qty: Quantity,
}

impl ReversalBody {
    /// The rules serde cannot express; the error names the offending field.
    pub fn validate(&self, max_lines: usize) -> Result<(), (String, InvalidValue)> {
        let invalid = |field: &str, msg: String| Err((field.to_string(), InvalidValue(msg)));
        if self.reason.as_ref().is_some_and(|r| r.chars().count() > MAX_REASON_CHARS) {
            return invalid("reason", format!("must be at most {MAX_REASON_CHARS} characters"));
        }
        if let Some(lines) = &self.lines {
            if lines.is_empty() || lines.len() > max_lines {
                return invalid("lines", format!("must hold 1 to {max_lines} lines (or be absent: everything)"));
            }
            let mut seen = std::collections::HashSet::with_capacity(lines.len());
            for (i, line) in lines.iter().enumerate() {
                if !seen.insert(line.key.as_str()) {
                    return invalid(&format!("lines[{i}].key"), format!("{} appears more than once", line.key));
                }
            }
        }
        Ok(())
    }
}

/// One bucket of a reversal's line, in its document.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ReversedBucket {
    pub bucket: i64,
    pub qty: i64,
}

/// One line of a reversal's document.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ReversedLine {
    pub key: String,
    pub resource: String,
    pub qty: i64,
    /// For a bucketed resource: what went back to each bucket.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub buckets: Option<Vec<ReversedBucket>>,
}

/// The response to a reversal (`201`), stored verbatim under its key; also the data of its
/// `order.reversed` event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ReversalDocument {
    pub order_id: String,
    pub reversal_id: String,
    pub reason: Option<String>,
    pub lines: Vec<ReversedLine>,
}

impl ReversalDocument {
    pub fn build(order_id: &str, reversal_id: &str, reason: Option<&str>, lines: &[LineReversal]) -> Self {
        ReversalDocument {
            order_id: order_id.to_string(),
            reversal_id: reversal_id.to_string(),
            reason: reason.map(str::to_string),
            lines: lines
                .iter()
                .map(|l| ReversedLine {
                    key: l.key.clone(),
                    resource: l.resource.clone(),
                    qty: l.qty,
                    buckets: l
                        .bucketed
                        .then(|| l.takes.iter().map(|t| ReversedBucket { bucket: t.bucket, qty: t.qty }).collect()),
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(resource: &str, bucket: i64, op: LedgerOp, qty: i64) -> OrderEntries {
        OrderEntries {
            resource: resource.into(),
            bucket,
            op,
            qty,
            line_key: Some(format!("line-{resource}")),
            limit_key: None,
            first_request: "req_1".into(),
        }
    }

    fn line(key: &str, qty: i64) -> ReversalLineBody {
        ReversalLineBody { key: ResourceKey::parse(key).unwrap(), qty: Quantity::new(qty).unwrap() }
    }

    /// Proves the fold counts takes, holds and reversals per bucket, and that a reversal is
    /// bounded by what was taken minus earlier reversals, bucket by bucket.
    #[test]
    fn a_reversal_gives_back_at_most_what_the_order_took_minus_earlier_reversals() {
        let entries = vec![
            entry("a", 0, LedgerOp::Deduct, 3),
            entry("a", 1, LedgerOp::Deduct, 2),
            entry("a", 0, LedgerOp::Reverse, 1),
            entry("b", 0, LedgerOp::Reserve, 4),
        ];
        let order = OrderLedger::fold("o", &entries, |r| r == "a").unwrap();
        assert_eq!(order.lines.len(), 2);
        let a = &order.lines[0];
        assert_eq!((a.key.as_str(), a.deducted, a.reversed, a.reversible), ("line-a", 5, 1, 4));
        assert_eq!(order.lines[1].held, 4);
        let plan = order.plan(Some(&[line("line-a", 4)])).unwrap();
        assert_eq!(
            plan[0].takes,
            vec![BucketReversal { bucket: 0, qty: 2, taken: 3 }, BucketReversal { bucket: 1, qty: 2, taken: 2 }]
        );
        assert!(matches!(order.plan(Some(&[line("line-a", 5)])), Err(ReversalRefusal::Exceeds(_))));
        assert!(matches!(order.plan(Some(&[line("line-b", 1)])), Err(ReversalRefusal::Held(_))));
        assert!(matches!(order.plan(Some(&[line("zzz", 1)])), Err(ReversalRefusal::Exceeds(_))));
        // By resource key too; and "everything" skips the held line.
        assert_eq!(order.plan(Some(&[line("a", 1)])).unwrap()[0].qty, 1);
        let all = order.plan(None).unwrap();
        assert_eq!(all.iter().map(|l| (l.key.as_str(), l.qty)).collect::<Vec<_>>(), vec![("line-a", 4)]);
        // A multi-line reversal with one line over its bound is refused whole.
        assert!(order.plan(Some(&[line("line-a", 1), line("line-b", 1)])).is_err());
    }

    /// Proves a confirmed reservation is reversible and a released one is not.
    #[test]
    fn confirmed_is_reversible_and_released_is_not() {
        let confirmed = [entry("a", 0, LedgerOp::Reserve, 2), entry("a", 0, LedgerOp::Confirm, 2)];
        let order = OrderLedger::fold("o", &confirmed, |_| false).unwrap();
        assert_eq!((order.lines[0].held, order.lines[0].reversible), (0, 2));
        let released = [entry("a", 0, LedgerOp::Reserve, 2), entry("a", 0, LedgerOp::Release, 2)];
        let order = OrderLedger::fold("o", &released, |_| false).unwrap();
        assert_eq!((order.lines[0].held, order.lines[0].released, order.lines[0].reversible), (0, 2, 0));
        assert!(matches!(order.plan(None), Err(ReversalRefusal::Exceeds(_))));
        assert!(OrderLedger::fold("o", &[], |_| false).is_none());
    }
}

//! In-memory admission: how a batch decides many orders against resource rows it has locked
//! and read once, so that a hot row takes one UPDATE per batch instead of one per order.
//!
//! The rules are exactly those of the per-order guarded UPDATEs (see `storage::rules::
//! line_refusal`): a target applies when its row exists with the plan's kind, is active and has
//! enough available; a line takes its first target that applies; the plan's policy decides the
//! order; a rejected order leaves nothing behind. Orders are admitted one after another against
//! the rows as the earlier ones left them, so the batch's outcome is the outcome of running them
//! in sequence. The storage backends write what this decides (the rows' new counters guarded by
//! their version, one ledger row per change) and the CHECK constraints still stand behind it.
//!
//! A bucketed resource is decided here too once the batch has read every one of its bucket
//! rows: a line tries its buckets in the per-order path's order ([`super::buckets::bucket_order`])
//! and takes from them as it does ([`super::buckets::bucket_takes`]), one change per bucket row.
//!
//! Only plans without per-user limits and without create-if-missing targets are admitted here;
//! everything else takes the per-order path.

use std::collections::HashMap;

use super::buckets::{bucket_order, bucket_takes};
use super::order::{decide, LineResult, OrderStatus, Reason};
use super::plan::Plan;
use super::resource::{BucketCounts, BucketTake, ReservationLine};
use super::types::{Action, Kind, LedgerOp};

/// A resource row as the batch read it under its lock, and as admission leaves it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    pub kind: Kind,
    pub active: bool,
    /// Sold by Redis: the database path must not take from it.
    pub redis: bool,
    pub buckets: i64,
    pub available: i64,
    pub reserved: i64,
    pub consumed: i64,
    pub version: i64,
    /// The low-stock threshold and the stock band last stored (for the stock events of the
    /// batch's changes, judged without reading the row again).
    pub low_stock: Option<i64>,
    pub stock: crate::events::StockBand,
    /// A bucketed resource's bucket rows in bucket order, once the batch has read them (empty
    /// until then). The counters above are then the resource row's own, which its buckets leave
    /// alone.
    pub bucket_rows: Vec<BucketCounts>,
}

impl Row {
    /// Whether admission may decide against this row: sold by the database, and either one
    /// bucket or every bucket read.
    pub fn admissible(&self) -> bool {
        !self.redis && (self.buckets == 1 || self.has_buckets())
    }

    /// Whether this is a bucketed resource whose every bucket row was read.
    pub fn has_buckets(&self) -> bool {
        self.buckets > 1
            && usize::try_from(self.buckets).is_ok_and(|n| n == self.bucket_rows.len())
            && self.bucket_rows.iter().enumerate().all(|(i, b)| usize::try_from(b.bucket).is_ok_and(|b| b == i))
    }

    /// What is available to sell: a bucketed resource's is its buckets' sum.
    pub fn sellable(&self) -> i64 {
        if self.buckets > 1 {
            self.bucket_rows.iter().fold(0i64, |sum, b| sum.saturating_add(b.available))
        } else {
            self.available
        }
    }
}

/// One change admission made: a ledger row to write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    /// The plan line (index into `plan.lines`) it applied.
    pub line: usize,
    pub resource: String,
    /// The bucket row it changed; `None`: the resource row.
    pub bucket: Option<i64>,
    pub op: LedgerOp,
    pub qty: i64,
    /// The row's `available, reserved, consumed` after the change.
    pub after: [i64; 3],
    pub version_after: i64,
}

/// How one order fared.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admitted {
    pub results: Vec<LineResult>,
    pub status: OrderStatus,
    /// Its changes, in the order made; empty when the order was rejected.
    pub changes: Vec<Change>,
    /// Per plan line, what each bucket gave (empty for a single-bucket resource or a line not
    /// applied), as a reservation keeps it.
    pub takes: Vec<Vec<BucketTake>>,
}

/// Whether admission can decide this plan alone (no per-user limits, no resource creation).
pub fn admissible(plan: &Plan) -> bool {
    plan.lines.iter().all(|l| l.limit.is_none() && l.targets.iter().all(|t| t.create_if_missing.is_none()))
}

/// Decides one order against `rows` (keyed by resource key; a key that is absent is a resource
/// that does not exist) and applies its changes to them; `seed` picks the first bucket a line
/// tries when its plan names none ([`super::buckets::bucket_seed`]). `None`: a target is one
/// admission may not decide (in redis mode, or bucketed with its buckets unread), or a line
/// reached a bucketed target its plan names a bucket of that it does not have (the per-order
/// path refuses the plan); the order must take the per-order path, and `rows` is untouched.
pub fn admit(rows: &mut HashMap<String, Row>, plan: &Plan, action: Action, seed: u64) -> Option<Admitted> {
    let elsewhere = |key: &str| rows.get(key).is_some_and(|r| !r.admissible());
    if plan.lines.iter().flat_map(|l| &l.targets).any(|t| elsewhere(t.resource.as_str())) {
        return None;
    }
    let op = match action {
        Action::Deduct => LedgerOp::Deduct,
        Action::Reserve => LedgerOp::Reserve,
    };
    let mut results = vec![LineResult::Rejected(Reason::Skipped); plan.lines.len()];
    let mut takes = vec![Vec::new(); plan.lines.len()];
    let mut changes = Vec::new();
    // The counters each change found (a bucket's, or the resource row's), to put back.
    let mut undo: Vec<(String, Option<usize>, [i64; 4])> = Vec::new();
    let restore = |rows: &mut HashMap<String, Row>, undo: Vec<(String, Option<usize>, [i64; 4])>| {
        for (key, bucket, [available, reserved, consumed, version]) in undo.into_iter().rev() {
            let Some(row) = rows.get_mut(&key) else { continue };
            match bucket {
                None => {
                    (row.available, row.reserved, row.consumed, row.version) = (available, reserved, consumed, version)
                }
                Some(b) => {
                    if let Some(b) = row.bucket_rows.get_mut(b) {
                        (b.available, b.reserved, b.consumed, b.version) = (available, reserved, consumed, version);
                    }
                }
            }
        }
    };
    for i in plan.lock_sequence() {
        let line = &plan.lines[i];
        let mut first_refusal = None;
        results[i] = LineResult::Rejected(Reason::ResourceNotFound);
        for (t, target) in line.targets.iter().enumerate() {
            let key = target.resource.as_str();
            let refusal = match rows.get(key) {
                None => Some(Reason::ResourceNotFound),
                Some(row) if target.kind.is_some_and(|k| k != row.kind) => Some(Reason::ResourceNotFound),
                Some(row) if !row.active => Some(Reason::ResourceInactive),
                Some(row) if row.sellable() < line.qty => Some(Reason::Insufficient),
                Some(_) => None,
            };
            if let Some(reason) = refusal {
                first_refusal.get_or_insert(reason);
                continue;
            }
            let Some(row) = rows.get_mut(key) else { continue };
            // What each row gives: the resource row all of it, a bucketed one per bucket.
            let whole = [(None, line.qty)];
            let bucketed: Vec<(Option<i64>, i64)>;
            let taken: &[(Option<i64>, i64)] = if row.buckets > 1 {
                let Ok(order) = bucket_order(&target.buckets, row.buckets, seed) else {
                    restore(rows, undo);
                    return None;
                };
                let available: Vec<i64> = row.bucket_rows.iter().map(|b| b.available).collect();
                let Some(taken) = bucket_takes(&order, &available, line.qty) else {
                    first_refusal.get_or_insert(Reason::Insufficient);
                    continue;
                };
                bucketed = taken.into_iter().map(|(bucket, qty)| (Some(bucket), qty)).collect();
                &bucketed
            } else {
                &whole
            };
            for &(bucket, qty) in taken {
                let counters = match bucket {
                    None => Some((None, (&mut row.available, &mut row.reserved, &mut row.consumed, &mut row.version))),
                    Some(bucket) => usize::try_from(bucket).ok().and_then(|index| {
                        let b = row.bucket_rows.get_mut(index)?;
                        Some((Some(index), (&mut b.available, &mut b.reserved, &mut b.consumed, &mut b.version)))
                    }),
                };
                let Some((index, (available, reserved, consumed, version))) = counters else {
                    restore(rows, undo);
                    return None;
                };
                undo.push((key.to_string(), index, [*available, *reserved, *consumed, *version]));
                move_out(action, qty, available, [reserved, consumed], version);
                changes.push(Change {
                    line: i,
                    resource: key.to_string(),
                    bucket,
                    op,
                    qty,
                    after: [*available, *reserved, *consumed],
                    version_after: *version,
                });
            }
            if row.buckets > 1 {
                takes[i] = taken.iter().filter_map(|&(b, qty)| Some(BucketTake { bucket: b?, qty })).collect();
            }
            results[i] = LineResult::Applied(t);
            first_refusal = None;
            break;
        }
        if let Some(reason) = first_refusal {
            results[i] = LineResult::Rejected(reason);
        }
    }
    let status = decide(plan, &results);
    if status == OrderStatus::Rejected {
        restore(rows, undo);
        changes.clear();
        takes.iter_mut().for_each(Vec::clear);
    }
    Some(Admitted { results, status, changes, takes })
}

/// Moves `qty` out of `available`: into `reserved` for a reservation, `consumed` for a deduction.
fn move_out(action: Action, qty: i64, available: &mut i64, [reserved, consumed]: [&mut i64; 2], version: &mut i64) {
    *available -= qty;
    match action {
        Action::Deduct => *consumed += qty,
        Action::Reserve => *reserved += qty,
    }
    *version += 1;
}

/// Moves a held reservation's `lines` out of `reserved` against `rows`, as its confirm (`op`
/// [`LedgerOp::Confirm`]: into `consumed`) or its release or expiry (back to `available`) does
/// on the per-request path: in resource order, one change per line, or per bucket a line took
/// from (in the order it took them). `None` when admission cannot decide it (a line on a row the
/// batch did not read or may not decide, bucket takes that do not match the row's buckets, two
/// lines on one resource, a per-user limit to give back, a row or bucket holding less than
/// reserved); `rows` is then untouched, and the move takes the per-request path, which judges it
/// the same way.
pub fn move_held(rows: &mut HashMap<String, Row>, lines: &[ReservationLine], op: LedgerOp) -> Option<Vec<Change>> {
    let confirming = match op {
        LedgerOp::Confirm => true,
        LedgerOp::Release | LedgerOp::Expire => false,
        _ => return None,
    };
    let mut order: Vec<usize> = (0..lines.len()).collect();
    order.sort_by(|&a, &b| lines[a].resource.cmp(&lines[b].resource));
    let holds = |l: &ReservationLine, r: &Row| {
        if l.buckets.is_empty() {
            return r.buckets == 1 && r.reserved >= l.qty && l.qty >= 0;
        }
        let mut taken: Vec<i64> = l.buckets.iter().map(|t| t.bucket).collect();
        taken.sort_unstable();
        taken.dedup();
        r.has_buckets()
            && taken.len() == l.buckets.len()
            && l.buckets.iter().all(|t| {
                let bucket = usize::try_from(t.bucket).ok().and_then(|b| r.bucket_rows.get(b));
                t.qty >= 0 && bucket.is_some_and(|b| b.reserved >= t.qty)
            })
    };
    let decidable = order.windows(2).all(|w| lines[w[0]].resource != lines[w[1]].resource)
        && lines.iter().all(|l| {
            (confirming || l.limit_key.is_none())
                && rows.get(&l.resource).is_some_and(|r| r.admissible() && holds(l, r))
        });
    if !decidable {
        return None;
    }
    let mut changes = Vec::with_capacity(lines.len());
    for i in order {
        let line = &lines[i];
        let row = rows.get_mut(&line.resource)?;
        let whole = [BucketTake { bucket: 0, qty: line.qty }];
        let parts = if line.buckets.is_empty() { &whole[..] } else { &line.buckets[..] };
        for take in parts {
            let (counters, bucket) = if line.buckets.is_empty() {
                ((&mut row.available, &mut row.reserved, &mut row.consumed, &mut row.version), None)
            } else {
                let b = row.bucket_rows.get_mut(usize::try_from(take.bucket).ok()?)?;
                ((&mut b.available, &mut b.reserved, &mut b.consumed, &mut b.version), Some(take.bucket))
            };
            let (available, reserved, consumed, version) = counters;
            *reserved -= take.qty;
            if confirming {
                *consumed += take.qty;
            } else {
                *available += take.qty;
            }
            *version += 1;
            changes.push(Change {
                line: i,
                resource: line.resource.clone(),
                bucket,
                op,
                qty: take.qty,
                after: [*available, *reserved, *consumed],
                version_after: *version,
            });
        }
    }
    Some(changes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::plan::{PartialPolicy, PlannedLine, PlannerRef, Target};
    use crate::engine::ResourceKey;

    fn row(available: i64) -> Row {
        Row {
            kind: Kind::Inventory,
            active: true,
            redis: false,
            buckets: 1,
            available,
            reserved: 0,
            consumed: 0,
            version: 1,
            low_stock: None,
            stock: crate::events::StockBand::Ok,
            bucket_rows: Vec::new(),
        }
    }

    fn plan(policy: PartialPolicy, lines: &[(&[&str], i64)]) -> Plan {
        Plan {
            planner: PlannerRef::builtin(),
            policy,
            lines: lines
                .iter()
                .enumerate()
                .map(|(i, (targets, qty))| PlannedLine {
                    line: i,
                    qty: *qty,
                    mandatory: false,
                    targets: targets
                        .iter()
                        .map(|k| Target::plain(ResourceKey::parse((*k).to_string()).expect("key")))
                        .collect(),
                    limit: None,
                })
                .collect(),
        }
    }

    #[test]
    fn orders_are_admitted_in_sequence_against_the_rows_as_left() {
        let mut rows = HashMap::from([("a".to_string(), row(3))]);
        let one = plan(PartialPolicy::AllOrNothing, &[(&["a"], 2)]);
        let first = admit(&mut rows, &one, Action::Deduct, 0).expect("admissible");
        assert_eq!(first.status, OrderStatus::Succeeded);
        assert_eq!(first.changes[0].after, [1, 0, 2]);
        assert_eq!(first.changes[0].version_after, 2);
        let second = admit(&mut rows, &one, Action::Deduct, 0).expect("admissible");
        assert_eq!(second.status, OrderStatus::Rejected);
        assert_eq!(second.results, vec![LineResult::Rejected(Reason::Insufficient)]);
        assert!(second.changes.is_empty());
        assert_eq!(rows["a"].available, 1);
    }

    #[test]
    fn a_rejected_all_or_nothing_order_leaves_every_row_as_it_was() {
        let mut rows = HashMap::from([("a".to_string(), row(5)), ("b".to_string(), row(0))]);
        let before = rows.clone();
        let both = plan(PartialPolicy::AllOrNothing, &[(&["a"], 2), (&["b"], 1)]);
        let admitted = admit(&mut rows, &both, Action::Reserve, 0).expect("admissible");
        assert_eq!(admitted.status, OrderStatus::Rejected);
        assert_eq!(rows, before);
        let partial = plan(PartialPolicy::AllowPartial, &[(&["a"], 2), (&["b"], 1), (&["zz"], 1)]);
        let admitted = admit(&mut rows, &partial, Action::Reserve, 0).expect("admissible");
        assert_eq!(admitted.status, OrderStatus::Partial);
        assert_eq!(
            admitted.results,
            vec![
                LineResult::Applied(0),
                LineResult::Rejected(Reason::Insufficient),
                LineResult::Rejected(Reason::ResourceNotFound)
            ]
        );
        assert_eq!((rows["a"].available, rows["a"].reserved), (3, 2));
    }

    fn bucketed(availables: &[i64]) -> Row {
        let bucket_rows = availables
            .iter()
            .enumerate()
            .map(|(i, &available)| BucketCounts {
                bucket: i as i64,
                available,
                reserved: 0,
                consumed: 0,
                version: 1,
                updated_at_ms: 0,
            })
            .collect();
        Row { buckets: availables.len() as i64, available: 0, bucket_rows, ..row(0) }
    }

    #[test]
    fn a_bucketed_line_takes_from_the_buckets_in_order_and_a_rejection_puts_them_back() {
        let mut rows = HashMap::from([("a".to_string(), bucketed(&[2, 3, 1])), ("b".to_string(), row(0))]);
        let mut preferring = plan(PartialPolicy::AllOrNothing, &[(&["a"], 4)]);
        preferring.lines[0].targets[0].buckets = vec![2, 0];
        // No bucket holds 4: bucket 2 (1), then 0 (2), then 1 (1 of its 3).
        let admitted = admit(&mut rows, &preferring, Action::Reserve, 0).expect("admissible");
        assert_eq!(admitted.status, OrderStatus::Succeeded);
        let took: Vec<(Option<i64>, i64, [i64; 3], i64)> =
            admitted.changes.iter().map(|c| (c.bucket, c.qty, c.after, c.version_after)).collect();
        assert_eq!(took, vec![(Some(2), 1, [0, 1, 0], 2), (Some(0), 2, [0, 2, 0], 2), (Some(1), 1, [2, 1, 0], 2)]);
        assert_eq!(
            admitted.takes,
            vec![vec![
                BucketTake { bucket: 2, qty: 1 },
                BucketTake { bucket: 0, qty: 2 },
                BucketTake { bucket: 1, qty: 1 }
            ]]
        );
        assert_eq!((rows["a"].sellable(), rows["a"].available, rows["a"].version), (2, 0, 1));

        let before = rows.clone();
        let both = plan(PartialPolicy::AllOrNothing, &[(&["a"], 2), (&["b"], 1)]);
        let rejected = admit(&mut rows, &both, Action::Deduct, 0).expect("admissible");
        assert_eq!(rejected.status, OrderStatus::Rejected);
        assert!(rejected.changes.is_empty() && rejected.takes.iter().all(Vec::is_empty));
        assert_eq!(rows, before);

        // A bucket the resource does not have: the per-order path refuses the plan.
        let mut beyond = plan(PartialPolicy::AllOrNothing, &[(&["a"], 1)]);
        beyond.lines[0].targets[0].buckets = vec![3];
        assert!(admit(&mut rows, &beyond, Action::Deduct, 0).is_none());
        assert_eq!(rows, before);
        // Buckets not all read: left to the per-order path.
        rows.get_mut("a").map(|r| r.bucket_rows.pop());
        let one = plan(PartialPolicy::AllOrNothing, &[(&["a"], 1)]);
        assert!(admit(&mut rows, &one, Action::Deduct, 0).is_none());
    }

    #[test]
    fn a_hold_across_buckets_moves_back_out_of_each_bucket_it_took_from() {
        let mut rows = HashMap::from([("a".to_string(), bucketed(&[2, 3]))]);
        let four = plan(PartialPolicy::AllOrNothing, &[(&["a"], 4)]);
        let held = admit(&mut rows, &four, Action::Reserve, 0).expect("admissible");
        let line = ReservationLine {
            key: "line0".into(),
            resource: "a".into(),
            qty: 4,
            limit_key: None,
            buckets: held.takes[0].clone(),
        };
        let before = rows.clone();
        let mut beyond = line.clone();
        beyond.buckets[0].bucket = 2;
        assert!(move_held(&mut rows, &[beyond], LedgerOp::Confirm).is_none());
        let mut twice = line.clone();
        twice.buckets[1].bucket = twice.buckets[0].bucket;
        assert!(move_held(&mut rows, &[twice], LedgerOp::Release).is_none());
        assert_eq!(rows, before);

        let released = move_held(&mut rows, &[line], LedgerOp::Release).expect("decidable");
        let moved: Vec<(Option<i64>, i64, [i64; 3])> = released.iter().map(|c| (c.bucket, c.qty, c.after)).collect();
        assert_eq!(moved, vec![(Some(0), 2, [2, 0, 0]), (Some(1), 2, [3, 0, 0])]);
        assert_eq!(rows["a"].bucket_rows.iter().map(|b| b.version).collect::<Vec<_>>(), vec![3, 3]);
    }

    #[test]
    fn a_line_falls_back_to_its_next_target_and_bucketed_rows_are_left_to_the_slow_path() {
        let mut rows = HashMap::from([("a".to_string(), row(0)), ("b".to_string(), row(4))]);
        if let Some(r) = rows.get_mut("a") {
            r.active = false;
        }
        let fallback = plan(PartialPolicy::AllOrNothing, &[(&["a", "b"], 3)]);
        let admitted = admit(&mut rows, &fallback, Action::Deduct, 0).expect("admissible");
        assert_eq!(admitted.results, vec![LineResult::Applied(1)]);
        assert_eq!(admitted.changes[0].resource, "b");
        if let Some(r) = rows.get_mut("b") {
            r.buckets = 4;
        }
        let before = rows.clone();
        assert!(admit(&mut rows, &fallback, Action::Deduct, 0).is_none());
        assert_eq!(rows, before);
    }
}

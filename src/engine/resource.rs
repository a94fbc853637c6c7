//! Resource state, ledger entries and reservations as clients see them, and the ledger's
//! arithmetic: replaying a resource's entries from the first must give exactly its state.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::types::{Kind, LedgerOp, Mode, ReservationState, ResourceStatus};
use crate::time::Timestamp;

/// A resource's state; every response that shows a resource uses this shape.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ResourceState {
    pub key: String,
    pub kind: Kind,
    pub status: ResourceStatus,
    pub available: i64,
    pub reserved: i64,
    pub consumed: i64,
    pub total: i64,
    pub buckets: i64,
    pub mode: Mode,
    /// The low-stock threshold: `resource.low_stock` is emitted when available falls to it or
    /// under (docs/EVENTS.md). Absent: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub low_stock: Option<i64>,
    /// Redis mode's fencing epoch: raised by every warm, switch and adjustment of a redis-mode
    /// resource (docs/REDIS.md). Internal: not part of the API.
    #[serde(skip)]
    pub mode_epoch: i64,
    pub version: i64,
    #[schema(value_type = String, format = DateTime)]
    pub updated_at: Timestamp,
    /// Each bucket's counters, when the resource has more than one (single-resource reads only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bucket_counts: Option<Vec<BucketCounts>>,
}

/// One bucket's counters; a bucketed resource's totals are their sums.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct BucketCounts {
    pub bucket: i64,
    pub available: i64,
    pub reserved: i64,
    pub consumed: i64,
    /// Number of ledger entries of this bucket.
    #[serde(skip)]
    pub version: i64,
    #[serde(skip)]
    pub updated_at_ms: i64,
}

impl ResourceState {
    /// A bucketed resource's state from its row (which holds no counters) and its buckets' rows.
    pub fn fold_buckets(&mut self, buckets: Vec<BucketCounts>) {
        let sum = |f: fn(&BucketCounts) -> i64| buckets.iter().map(f).fold(0i64, i64::saturating_add);
        self.available = sum(|b| b.available);
        self.reserved = sum(|b| b.reserved);
        self.consumed = sum(|b| b.consumed);
        self.total = self.available.saturating_add(self.reserved).saturating_add(self.consumed);
        self.version = sum(|b| b.version);
        self.updated_at = Timestamp(buckets.iter().map(|b| b.updated_at_ms).max().unwrap_or(self.updated_at.0));
        self.bucket_counts = Some(buckets);
    }

    pub fn counters(&self) -> Counters {
        Counters {
            available: self.available,
            reserved: self.reserved,
            consumed: self.consumed,
            total: self.total,
            version: self.version,
        }
    }
}

/// One fact in a resource's history.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct LedgerEntry {
    pub seq: i64,
    /// The bucket the entry changed (0 for a resource with one bucket); `*_after` are its counters.
    pub bucket: i64,
    pub op: LedgerOp,
    /// Positive, except for `adjust` where the sign says restock (+) or write-off (−).
    pub qty: i64,
    pub request_id: String,
    pub order_id: Option<String>,
    pub reservation_id: Option<String>,
    pub available_after: i64,
    pub reserved_after: i64,
    pub consumed_after: i64,
    pub plugin_version: Option<i64>,
    #[schema(value_type = String, format = DateTime)]
    pub at: Timestamp,
    /// On a `reverse` entry: the request whose take it gives back (absent otherwise).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reverses: Option<String>,
}

/// The counters reconciliation compares.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Counters {
    pub available: i64,
    pub reserved: i64,
    pub consumed: i64,
    pub total: i64,
    /// Number of ledger entries; equals the resource's `version`.
    pub version: i64,
}

impl Counters {
    /// Applies `count` ledger entries of one `op` whose quantities sum to `qty_sum`.
    /// Saturating: a corrupt ledger must show up as drift, never as a panic.
    pub fn apply(&mut self, op: LedgerOp, qty_sum: i64, count: i64) {
        let (da, dr, dc, dt) = match op {
            LedgerOp::Create | LedgerOp::Adjust => (qty_sum, 0, 0, qty_sum),
            LedgerOp::Deduct => (-qty_sum, 0, qty_sum, 0),
            LedgerOp::Reserve => (-qty_sum, qty_sum, 0, 0),
            LedgerOp::Confirm => (0, -qty_sum, qty_sum, 0),
            LedgerOp::Release | LedgerOp::Expire => (qty_sum, -qty_sum, 0, 0),
            LedgerOp::Reverse => (qty_sum, 0, -qty_sum, 0),
        };
        self.available = self.available.saturating_add(da);
        self.reserved = self.reserved.saturating_add(dr);
        self.consumed = self.consumed.saturating_add(dc);
        self.total = self.total.saturating_add(dt);
        self.version = self.version.saturating_add(count);
    }
}

/// A resource whose state does not equal its opening balance plus its ledger.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct Drift {
    #[serde(skip)]
    pub tenant: String,
    /// Found now in history proven clean before (its checkpoint is forgotten): the pass that
    /// finds it emits `reconciliation.drift` (docs/EVENTS.md).
    #[serde(skip)]
    pub new: bool,
    pub key: String,
    /// The bucket that drifted, for a bucketed resource.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bucket: Option<i64>,
    /// What the ledger says.
    pub expected: Counters,
    /// What the resource row says.
    pub actual: Counters,
}

/// Which history a reconciliation pass replays.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Pass {
    /// Each resource (bucket) from its checkpoint: only the ledger rows written since the last
    /// pass that found it clean. Cannot see a ledger row changed, deleted or inserted below the
    /// checkpoint.
    Incremental,
    /// Every resource (bucket) from its whole ledger, checkpoints ignored: also finds history
    /// changed below a checkpoint.
    Full,
}

/// The result of a reconciliation pass over one tenant (or all tenants, for the job).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct Reconciliation {
    pub checked: u64,
    pub drift: Vec<Drift>,
    /// Which history this pass replayed.
    pub pass: Pass,
    /// How many ledger rows this pass summed: those after the checkpoints (incremental), or the
    /// whole ledger of the resources checked (full).
    pub ledger_rows_read: u64,
}

/// The ledger's totals of one op on one resource, as storage aggregates them.
#[derive(Debug, Clone)]
pub struct LedgerSum {
    pub tenant: String,
    pub key: String,
    pub bucket: i64,
    pub op: LedgerOp,
    pub qty: i64,
    pub count: i64,
}

/// The `*_after` counters (available, reserved, consumed) of a resource's newest ledger entry.
#[derive(Debug, Clone)]
pub struct NewestEntry {
    pub tenant: String,
    pub key: String,
    pub bucket: i64,
    /// Its `seq`: where the next pass starts once this entry is folded into a checkpoint.
    pub seq: i64,
    pub after: [i64; 3],
}

/// What a resource (bucket) was proven to be at `counters.version`: its ledger entries up to
/// that version replay to `counters`, and the newest of them (`seq`, 0: none) records them. A
/// pass replays only the entries after `seq`: every entry of one row (bucket) is written under
/// that row's lock, after its change, so its entries take their `seq`s in the order they commit
/// and none can land below a checkpoint later.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checkpoint {
    pub tenant: String,
    pub key: String,
    pub bucket: i64,
    pub seq: i64,
    pub counters: Counters,
}

/// What a pass learnt for the next one: checkpoints to move forward (resources found clean at a
/// newer version than their checkpoint's) and checkpoints to forget (resources that drifted:
/// the next pass replays their whole ledger, so the drift is reported again until it is fixed).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CheckpointUpdate {
    pub advance: Vec<Checkpoint>,
    /// `(tenant, resource, bucket)`.
    pub forget: Vec<(String, String, i64)>,
}

impl CheckpointUpdate {
    pub fn is_empty(&self) -> bool {
        self.advance.is_empty() && self.forget.is_empty()
    }

    /// This update in parts of at most `max` (at least 1) checkpoints each, forgotten ones
    /// first, so that no one write holds the writer long (the first pass over a large database
    /// stores a checkpoint for every resource and bucket).
    pub fn into_parts(self, max: usize) -> Vec<CheckpointUpdate> {
        let max = max.max(1);
        let mut parts: Vec<CheckpointUpdate> = self
            .forget
            .chunks(max)
            .map(|forget| CheckpointUpdate { advance: Vec::new(), forget: forget.to_vec() })
            .collect();
        parts.extend(
            self.advance.chunks(max).map(|advance| CheckpointUpdate { advance: advance.to_vec(), forget: Vec::new() }),
        );
        parts
    }
}

/// Compares each resource (with its tenant) against its ledger: the replayed sums and the
/// newest entry's counters must both equal the state. A bucketed resource is judged bucket by
/// bucket (each bucket's entries against its row; the totals are their sums by construction).
/// `checkpoints` are the stored ones; in an incremental pass `sums` and `newest` cover the
/// entries after each resource's checkpoint (all of them where it has none) and the replay
/// starts from its counters; in a full pass they cover every entry and the replay starts from
/// zero. Pure, so every backend judges alike.
pub fn reconcile(
    resources: &[(String, ResourceState)],
    checkpoints: &[Checkpoint],
    sums: &[LedgerSum],
    newest: &[NewestEntry],
    pass: Pass,
) -> (Reconciliation, CheckpointUpdate) {
    use std::collections::HashMap;
    let known: HashMap<(&str, &str, i64), Counters> =
        checkpoints.iter().map(|c| ((c.tenant.as_str(), c.key.as_str(), c.bucket), c.counters)).collect();
    let mut expected = match pass {
        Pass::Incremental => known.clone(),
        Pass::Full => HashMap::new(),
    };
    let mut ledger_rows_read = 0u64;
    for s in sums {
        ledger_rows_read = ledger_rows_read.saturating_add(u64::try_from(s.count).unwrap_or(0));
        expected.entry((s.tenant.as_str(), s.key.as_str(), s.bucket)).or_default().apply(s.op, s.qty, s.count);
    }
    // The newest entry replayed so far, `(seq, counters after it)`: this pass's newest, else
    // (nothing new) the one its checkpoint folded last. Its seq is where the next pass starts.
    let mut last: HashMap<(&str, &str, i64), (i64, [i64; 3])> = match pass {
        Pass::Incremental => checkpoints
            .iter()
            .map(|c| {
                let n = &c.counters;
                ((c.tenant.as_str(), c.key.as_str(), c.bucket), (c.seq, [n.available, n.reserved, n.consumed]))
            })
            .collect(),
        Pass::Full => HashMap::new(),
    };
    last.extend(newest.iter().map(|n| ((n.tenant.as_str(), n.key.as_str(), n.bucket), (n.seq, n.after))));
    let mut update = CheckpointUpdate::default();
    let mut judge = |tenant: &str, key: &str, bucket: i64, have: Counters| {
        let id = (tenant, key, bucket);
        let want = expected.get(&id).copied().unwrap_or_default();
        let last = last.get(&id);
        let last_matches = last.map(|(_, after)| after) == Some(&[have.available, have.reserved, have.consumed]);
        let clean = want == have && last_matches;
        let known = known.get(&id);
        if clean && known != Some(&have) {
            let seq = last.map_or(0, |(seq, _)| *seq);
            update.advance.push(Checkpoint { tenant: tenant.into(), key: key.into(), bucket, seq, counters: have });
        } else if !clean && known.is_some() {
            update.forget.push((tenant.into(), key.into(), bucket));
        }
        (!clean).then(|| Drift {
            tenant: tenant.to_string(),
            new: known.is_some(),
            key: key.to_string(),
            bucket: None,
            expected: want,
            actual: have,
        })
    };
    let mut drift = Vec::new();
    for (tenant, state) in resources {
        match &state.bucket_counts {
            None => drift.extend(judge(tenant, &state.key, 0, state.counters())),
            Some(buckets) => {
                for b in buckets {
                    let have = Counters {
                        available: b.available,
                        reserved: b.reserved,
                        consumed: b.consumed,
                        total: b.available.saturating_add(b.reserved).saturating_add(b.consumed),
                        version: b.version,
                    };
                    drift.extend(
                        judge(tenant, &state.key, b.bucket, have).map(|d| Drift { bucket: Some(b.bucket), ..d }),
                    );
                }
                if buckets.len() as i64 != state.buckets {
                    drift.push(Drift {
                        tenant: tenant.to_string(),
                        new: false,
                        key: state.key.clone(),
                        bucket: None,
                        expected: Counters::default(),
                        actual: state.counters(),
                    });
                }
            }
        }
    }
    (Reconciliation { checked: resources.len() as u64, drift, pass, ledger_rows_read }, update)
}

/// One line held by a reservation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ReservationLine {
    pub key: String,
    pub resource: String,
    pub qty: i64,
    /// The per-user limit the line counted against; given back on release or expiry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit_key: Option<String>,
    /// For a bucketed resource, what the line took from each bucket; release, expiry and confirm
    /// move exactly these.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub buckets: Vec<BucketTake>,
}

/// A quantity taken from one bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct BucketTake {
    pub bucket: i64,
    pub qty: i64,
}

/// A reservation as clients see it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Reservation {
    pub id: String,
    pub order_id: String,
    pub state: ReservationState,
    pub lines: Vec<ReservationLine>,
    #[schema(value_type = String, format = DateTime)]
    pub expires_at: Timestamp,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Proves a checkpoint update is stored in bounded parts, forgotten checkpoints first, and
    /// that no checkpoint is lost or repeated on the way.
    #[test]
    fn a_checkpoint_update_splits_into_bounded_parts_forgetting_first() {
        let checkpoint = |n: i64| Checkpoint {
            tenant: "t".into(),
            key: format!("k{n}"),
            bucket: 0,
            seq: n,
            counters: Counters { version: n + 1, ..Counters::default() },
        };
        let update = CheckpointUpdate {
            advance: (0..5).map(checkpoint).collect(),
            forget: vec![("t".into(), "x".into(), 0), ("t".into(), "y".into(), 1)],
        };
        let parts = update.clone().into_parts(2);
        let sizes: Vec<(usize, usize)> = parts.iter().map(|p| (p.forget.len(), p.advance.len())).collect();
        assert_eq!(sizes, vec![(2, 0), (0, 2), (0, 2), (0, 1)]);
        let advanced: Vec<Checkpoint> = parts.iter().flat_map(|p| p.advance.clone()).collect();
        assert_eq!(advanced, update.advance);
        assert_eq!(CheckpointUpdate::default().into_parts(0), Vec::<CheckpointUpdate>::new());
    }

    #[test]
    fn replaying_every_op_keeps_the_sum_equal_to_total() {
        let mut c = Counters::default();
        c.apply(LedgerOp::Create, 100, 1);
        c.apply(LedgerOp::Deduct, 7, 2);
        c.apply(LedgerOp::Reserve, 10, 1);
        c.apply(LedgerOp::Confirm, 4, 1);
        c.apply(LedgerOp::Release, 3, 1);
        c.apply(LedgerOp::Expire, 3, 1);
        c.apply(LedgerOp::Adjust, -5, 1);
        c.apply(LedgerOp::Reverse, 2, 1);
        assert_eq!(c, Counters { available: 86, reserved: 0, consumed: 9, total: 95, version: 9 });
        assert_eq!(c.available + c.reserved + c.consumed, c.total);
    }
}

//! Rules every backend applies the same way, as pure functions and shared constants: why a
//! line is refused, what a dry run predicts, how business actions are named.

use ulid::Ulid;

use crate::apply::orders::refusal;
use crate::apply::port::View;
use crate::engine::{ResourceKey, MAX_TOTAL};
use crate::problem::Problem;

use crate::engine::{
    BucketCounts, BucketTake, LineResult, PlannedLine, Reason, ReservationLine, ResourceState, Target,
};
use crate::ratelimit::RateLimit;
use crate::storage::{OrderJob, StorageError};

/// The bucket rules, kept with the engine (batch admission applies them too).
pub use crate::engine::buckets::{bucket_order, bucket_seed, bucket_takes, MAX_BUCKETS};

/// A tenant's own rate as its two nullable columns (rate per second, burst).
pub fn rate_limit_columns(limit: Option<RateLimit>) -> (Option<i64>, Option<i64>) {
    (limit.map(|l| i64::from(l.requests_per_second)), limit.map(|l| i64::from(l.burst)))
}

/// A new identity for one business action; the ledger's unique key includes it.
pub fn new_request_id() -> String {
    format!("req_{}", Ulid::new())
}

/// Why an adjustment was refused: a write-off beyond what is available, or a restock past the
/// largest total.
pub fn adjust_refusal(key: &ResourceKey, available: i64, delta: i64) -> Problem {
    if delta < 0 {
        Problem::new(
            409,
            "insufficient",
            "Insufficient stock",
            format!("{key} has {available} available, write-off of {} requested", delta.saturating_neg()),
        )
    } else {
        Problem::new(
            422,
            "total_out_of_range",
            "Total out of range",
            format!("{key} would exceed the largest total, {MAX_TOTAL}"),
        )
    }
}

/// What a line would do now, for the dry run: `used` is its limit key's count so far, `views`
/// the current rows of its targets (in order). Ignores interactions between lines of one order.
pub fn preview_line(line: &PlannedLine, used: i64, views: Vec<Option<View>>) -> LineResult {
    if line.limit.as_ref().is_some_and(|l| used.saturating_add(line.qty) > l.max) {
        return LineResult::Rejected(Reason::LimitExceeded);
    }
    let mut first_refusal = None;
    for (i, (target, view)) in line.targets.iter().zip(views).enumerate() {
        let refusal = match (&view, target.create_if_missing) {
            (None, Some(allowance)) if allowance >= line.qty => None,
            (None, Some(_)) => Some(Reason::Insufficient),
            _ => refusal(view.as_ref(), target, line.qty),
        };
        match refusal {
            None => return LineResult::Applied(i),
            Some(reason) => {
                first_refusal.get_or_insert(reason);
            }
        }
    }
    LineResult::Rejected(first_refusal.unwrap_or(Reason::ResourceNotFound))
}

/// A target's view as a dry run judges it, refusing a plan that names a bucket the resource
/// does not have (as the order itself would be refused).
pub fn previewed(target: &Target, view: Option<View>) -> Result<Option<View>, StorageError> {
    if let Some(v) = &view {
        if v.buckets > 1 {
            bucket_order(&target.buckets, v.buckets, 0).map_err(StorageError::PlanRefused)?;
        }
    }
    Ok(view)
}

/// The lines a reservation holds, as stored (JSON): each applied line with the resource it took
/// from and the per-user limit it counted against, so release and expiry can give both back.
pub fn reservation_lines(job: &OrderJob, results: &[LineResult], takes: &[Vec<BucketTake>]) -> Vec<ReservationLine> {
    job.plan
        .lines
        .iter()
        .zip(results)
        .zip(takes.iter().chain(std::iter::repeat(&Vec::new())))
        .filter_map(|((p, r), takes)| match r {
            LineResult::Applied(target) => Some(ReservationLine {
                key: job.order.lines.get(p.line).map(|l| l.key.to_string()).unwrap_or_default(),
                resource: p.targets.get(*target).map(|t| t.resource.to_string()).unwrap_or_default(),
                qty: p.qty,
                limit_key: p.limit.as_ref().map(|l| l.key.to_string()),
                buckets: takes.clone(),
            }),
            LineResult::Rejected(_) => None,
        })
        .collect()
}

/// `total` split over `n` buckets as evenly as integers allow: bucket `i` gets `total / n`,
/// plus one for the first `total % n` buckets.
pub fn split_evenly(total: i64, n: i64) -> Vec<i64> {
    let n = n.max(1);
    (0..n).map(|i| total / n + i64::from(i < total % n)).collect()
}

/// A write-off of `qty` over buckets with `available[b]`: from the fullest bucket first.
pub fn write_off_takes(available: &[i64], qty: i64) -> Option<Vec<(i64, i64)>> {
    let mut order: Vec<i64> = (0..available.len() as i64).collect();
    order.sort_by_key(|&b| std::cmp::Reverse(available[b as usize]));
    let mut left = qty;
    let mut takes = Vec::new();
    for b in order {
        let take = available[b as usize].min(left);
        if take > 0 {
            takes.push((b, take));
            left -= take;
        }
    }
    (left == 0).then_some(takes)
}

/// The moves that even out `available` across buckets (each bucket's signed change; they sum to
/// zero), or nothing when no two buckets differ by more than one.
pub fn rebalance_moves(available: &[i64]) -> Vec<(i64, i64)> {
    let (Some(&min), Some(&max)) = (available.iter().min(), available.iter().max()) else { return Vec::new() };
    if max - min <= 1 {
        return Vec::new();
    }
    let sum = available.iter().fold(0i64, |a, &b| a.saturating_add(b));
    let target = split_evenly(sum, available.len() as i64);
    // Hand the remainder to the buckets that hold the most already, so fewer rows move.
    let mut by_fullness: Vec<usize> = (0..available.len()).collect();
    by_fullness.sort_by_key(|&i| std::cmp::Reverse(available[i]));
    let mut goal = vec![0; available.len()];
    for (rank, i) in by_fullness.into_iter().enumerate() {
        goal[i] = target[rank];
    }
    (0..available.len()).filter(|&i| goal[i] != available[i]).map(|i| (i as i64, goal[i] - available[i])).collect()
}

/// Folds bucketed resources' totals in from their grouped bucket rows; `keep_counts`: whether
/// the state keeps each bucket's counters (single-resource reads and reconciliation) or only the
/// totals (pages).
pub fn fold_all(
    states: &mut [(String, ResourceState)],
    mut grouped: std::collections::HashMap<(String, String), Vec<BucketCounts>>,
    keep_counts: bool,
) {
    for (tenant, state) in states.iter_mut().filter(|(_, s)| s.buckets > 1) {
        let buckets = grouped.remove(&(tenant.clone(), state.key.clone())).unwrap_or_default();
        state.fold_buckets(buckets);
        if !keep_counts {
            state.bucket_counts = None;
        }
    }
}

#[cfg(test)]
mod bucket_tests {
    use super::*;

    #[test]
    fn split_evenly_spreads_the_remainder_over_the_first_buckets() {
        assert_eq!(split_evenly(10, 4), vec![3, 3, 2, 2]);
        assert_eq!(split_evenly(3, 4), vec![1, 1, 1, 0]);
        assert_eq!(split_evenly(0, 2), vec![0, 0]);
        assert_eq!(split_evenly(7, 1), vec![7]);
    }

    #[test]
    fn bucket_order_puts_preferred_first_and_never_leaves_a_bucket_out() {
        assert_eq!(bucket_order(&[2, 2, 0], 4, 5).unwrap(), vec![2, 0, 1, 3]);
        assert_eq!(bucket_order(&[], 4, 6).unwrap(), vec![2, 3, 0, 1]);
        assert!(bucket_order(&[4], 4, 0).unwrap_err().contains("bucket 4"));
        for seed in 0..50 {
            let mut order = bucket_order(&[], 7, seed).unwrap();
            order.sort();
            assert_eq!(order, (0..7).collect::<Vec<_>>());
        }
    }

    #[test]
    fn takes_prefer_one_bucket_and_fall_back_across_buckets_while_the_total_covers() {
        let available = [3, 3, 2, 2];
        assert_eq!(bucket_takes(&[2, 3, 0, 1], &available, 2), Some(vec![(2, 2)]));
        assert_eq!(bucket_takes(&[2, 3, 0, 1], &available, 3), Some(vec![(0, 3)]));
        assert_eq!(bucket_takes(&[2, 3, 0, 1], &available, 9), Some(vec![(2, 2), (3, 2), (0, 3), (1, 2)]));
        assert_eq!(bucket_takes(&[2, 3, 0, 1], &available, 10).map(|t| t.len()), Some(4));
        assert_eq!(bucket_takes(&[2, 3, 0, 1], &available, 11), None);
        assert_eq!(write_off_takes(&available, 5), Some(vec![(0, 3), (1, 2)]));
        assert_eq!(write_off_takes(&available, 11), None);
    }

    #[test]
    fn rebalance_evens_out_and_moves_nothing_in_total() {
        let moves = rebalance_moves(&[0, 25, 25, 25]);
        assert_eq!(moves.iter().map(|m| m.1).sum::<i64>(), 0);
        let mut after = [0, 25, 25, 25];
        for (b, d) in &moves {
            after[*b as usize] += d;
        }
        assert!(after.iter().max().unwrap() - after.iter().min().unwrap() <= 1, "{after:?}");
        assert!(rebalance_moves(&[3, 2, 3]).is_empty());
        assert!(rebalance_moves(&[]).is_empty());
    }
}

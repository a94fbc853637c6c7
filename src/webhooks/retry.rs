//! The retry schedule of a failed delivery: exponential backoff with jitter, over a window that
//! starts at the delivery's first failure. Pure: `now` and the random draw are arguments.

use super::Next;

/// `[events.webhooks]` retry settings, in milliseconds.
#[derive(Debug, Clone, Copy)]
pub struct RetryPolicy {
    /// Delay before the first retry (before jitter).
    pub initial_ms: i64,
    /// Longest delay between two attempts (before jitter).
    pub max_ms: i64,
    /// How long after its first failure a delivery is retried; past it the endpoint is failing.
    pub window_ms: i64,
}

impl RetryPolicy {
    /// The delay after the `failures`-th failed attempt (1: the first): `initial × 2^(n-1)`
    /// capped at `max`, then drawn in its upper half (`jitter` in `[0, 1)`), so receivers
    /// failing together are not retried in lockstep.
    pub fn delay_ms(&self, failures: i64, jitter: f64) -> i64 {
        let doublings = u32::try_from(failures.saturating_sub(1).clamp(0, 62)).unwrap_or(62);
        let full = self.initial_ms.max(1).saturating_mul(1_i64 << doublings.min(40)).min(self.max_ms.max(1));
        let half = full / 2;
        half + ((full - half) as f64 * jitter.clamp(0.0, 1.0)) as i64
    }

    /// What follows the `failures`-th failed attempt of a delivery whose first failure was at
    /// `window_start` (`None`: this one).
    pub fn after_failure(&self, now_ms: i64, window_start: Option<i64>, failures: i64, jitter: f64) -> Next {
        let window_start = window_start.unwrap_or(now_ms);
        if now_ms.saturating_sub(window_start) >= self.window_ms {
            return Next::EndpointFailing { window_start };
        }
        // The last retry lands within the window: none is scheduled past its end only to fail
        // the endpoint later than the setting says.
        let due_at = now_ms.saturating_add(self.delay_ms(failures, jitter)).min(window_start + self.window_ms);
        Next::Retry { due_at, window_start }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: RetryPolicy = RetryPolicy { initial_ms: 5_000, max_ms: 3_600_000, window_ms: 86_400_000 };

    #[test]
    fn delays_double_up_to_the_cap_with_jitter_in_the_upper_half() {
        assert_eq!(DAY.delay_ms(1, 0.0), 2_500);
        assert_eq!(DAY.delay_ms(1, 0.999_999), 4_999);
        assert_eq!(DAY.delay_ms(2, 0.0), 5_000);
        assert_eq!(DAY.delay_ms(3, 0.5), 15_000);
        assert_eq!(DAY.delay_ms(30, 0.0), 1_800_000);
        assert_eq!(DAY.delay_ms(i64::MAX, 1.0), 3_600_000);
    }

    #[test]
    fn a_delivery_is_retried_until_its_window_ends_then_the_endpoint_fails() {
        assert_eq!(DAY.after_failure(1_000, None, 1, 0.0), Next::Retry { due_at: 3_500, window_start: 1_000 });
        let near_end = 1_000 + 86_400_000 - 10;
        assert_eq!(
            DAY.after_failure(near_end, Some(1_000), 40, 1.0),
            Next::Retry { due_at: 1_000 + 86_400_000, window_start: 1_000 }
        );
        assert_eq!(
            DAY.after_failure(1_000 + 86_400_000, Some(1_000), 41, 0.3),
            Next::EndpointFailing { window_start: 1_000 }
        );
    }

    /// Over a day, the default schedule makes a few dozen attempts, not thousands.
    #[test]
    fn the_default_schedule_makes_a_bounded_number_of_attempts() {
        let (mut now, mut failures, start) = (0_i64, 0_i64, 0_i64);
        loop {
            failures += 1;
            match DAY.after_failure(now, Some(start), failures, 0.5) {
                Next::Retry { due_at, .. } => now = due_at,
                Next::EndpointFailing { .. } => break,
                Next::Done => unreachable!(),
            }
        }
        assert!((20..=60).contains(&failures), "{failures} attempts in a day");
    }
}

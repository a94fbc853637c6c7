//! Per-tenant request rate limits: one token bucket per tenant (`governor`'s GCRA, which
//! behaves as a token bucket refilled at `requests_per_second` and holding at most `burst`), so
//! one tenant's flood is refused at the HTTP layer before it reaches storage or plugins, and
//! never costs another tenant a request.
//!
//! A tenant's rate is its own (config entry or admin API, stored with the tenant and read with
//! its API key) or else the server default (`[rate_limits]`). Buckets live in this process:
//! with several processes behind a load balancer, each allows the rate on its own. Memory is
//! bounded by `max_tenants`; see [`TenantLimiter::check`] for what is forgotten first.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::RwLock;
use std::time::Instant;

use governor::clock::Clock as _;
use governor::middleware::StateInformationMiddleware;
use governor::{DefaultDirectRateLimiter, Quota};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::engine::TenantId;

/// Largest rate or burst accepted, far above what one process serves; it keeps the
/// arithmetic of windows and waits in range.
pub const MAX_RATE: u32 = 10_000_000;

/// The shape of a tenant's token bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RateLimit {
    /// Tokens added per second, at most 10^7; 0: no limit at all.
    #[schema(maximum = 10_000_000)]
    pub requests_per_second: u32,
    /// Most tokens the bucket holds: how many requests may arrive at once after a quiet spell
    /// (1..=10^7; not checked when `requests_per_second` is 0).
    #[schema(maximum = 4_294_967_295_i64)]
    pub burst: u32,
}

impl RateLimit {
    /// Checks the bounds; the message names the offending field.
    pub fn validate(&self) -> Result<(), String> {
        if self.requests_per_second > MAX_RATE {
            return Err(format!("requests_per_second: must be at most {MAX_RATE} (0: no limit)"));
        }
        if self.requests_per_second > 0 && !(1..=MAX_RATE).contains(&self.burst) {
            return Err(format!("burst: must be between 1 and {MAX_RATE}"));
        }
        Ok(())
    }

    /// The `governor` quota, or `None` for no limit (or a shape `validate` refuses).
    fn quota(&self) -> Option<Quota> {
        let rate = std::num::NonZeroU32::new(self.requests_per_second)?;
        let burst = std::num::NonZeroU32::new(self.burst)?;
        Some(Quota::per_second(rate).allow_burst(burst))
    }

    /// Seconds an empty bucket takes to fill (the policy's window), at least 1.
    pub fn window_s(&self) -> u32 {
        seconds_for(self.burst, self.requests_per_second)
    }

    /// `RateLimit-Policy` (IETF httpapi draft, structured field): quota and window.
    pub fn policy_field(&self) -> String {
        format!("\"tenant\";q={};w={}", self.burst, self.window_s())
    }
}

/// Whole seconds (rounded up) that `tokens` take to come back at `per_second`; 0 for none.
fn seconds_for(tokens: u32, per_second: u32) -> u32 {
    if per_second == 0 {
        return 0;
    }
    tokens.div_ceil(per_second)
}

/// `RateLimit` (IETF httpapi draft, structured field): tokens left and seconds until full.
pub fn remaining_field(remaining: u32, reset_s: u32) -> String {
    format!("\"tenant\";r={remaining};t={reset_s}")
}

/// What the limiter decided for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// The tenant's rate is 0: nothing is counted.
    Unlimited,
    /// Served; `remaining` tokens are left, the bucket is full again in `reset_s`.
    Allowed { limit: RateLimit, remaining: u32, reset_s: u32 },
    /// Refused; a token is back in `retry_after_s` (at least 1).
    Limited { limit: RateLimit, retry_after_s: u32 },
}

type Bucket = DefaultDirectRateLimiter<StateInformationMiddleware>;

/// One tenant's bucket, the rate it was built for, and when it was last asked (ms since the
/// limiter started), for eviction.
struct Entry {
    limit: RateLimit,
    bucket: Bucket,
    last_used_ms: AtomicU64,
}

impl Entry {
    fn new(limit: RateLimit, quota: Quota, now_ms: u64) -> Self {
        let bucket = governor::RateLimiter::direct(quota).with_middleware::<StateInformationMiddleware>();
        Self { limit, bucket, last_used_ms: AtomicU64::new(now_ms) }
    }

    fn decide(&self, now_ms: u64) -> Decision {
        self.last_used_ms.fetch_max(now_ms, Ordering::Relaxed);
        let limit = self.limit;
        match self.bucket.check() {
            Ok(state) => {
                let remaining = state.remaining_burst_capacity();
                let reset_s = seconds_for(limit.burst.saturating_sub(remaining), limit.requests_per_second);
                Decision::Allowed { limit, remaining, reset_s }
            }
            Err(not_until) => {
                let wait = not_until.wait_time_from(self.bucket.clock().now());
                // Rounded up: a client that waits Retry-After finds a token.
                let wait_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX);
                let retry_after_s = u32::try_from(wait_ms.div_ceil(1000)).unwrap_or(u32::MAX).max(1);
                Decision::Limited { limit, retry_after_s }
            }
        }
    }

    /// Idle long enough for the bucket to be full again: forgetting it changes nothing.
    fn is_full_again(&self, now_ms: u64) -> bool {
        let idle_ms = now_ms.saturating_sub(self.last_used_ms.load(Ordering::Relaxed));
        idle_ms >= u64::from(self.limit.window_s()) * 1000
    }
}

/// The buckets of the tenants seen recently, at most `max_tenants` of them.
pub struct TenantLimiter {
    default: RateLimit,
    max_tenants: usize,
    started: Instant,
    entries: RwLock<HashMap<TenantId, Entry>>,
}

impl TenantLimiter {
    /// `default` applies to tenants without a rate of their own; `max_tenants` (at least 1)
    /// bounds the buckets kept.
    pub fn new(default: RateLimit, max_tenants: usize) -> Self {
        Self { default, max_tenants: max_tenants.max(1), started: Instant::now(), entries: RwLock::new(HashMap::new()) }
    }

    /// Takes one token from the tenant's bucket. `own` is the tenant's rate, if it has one; a
    /// changed rate starts a fresh bucket. When `max_tenants` buckets exist and a new tenant
    /// arrives, buckets idle long enough to be full are forgotten (nothing is lost); if none
    /// is, the least recently used one is, and that tenant later starts with a full burst.
    pub fn check(&self, tenant: &TenantId, own: Option<RateLimit>) -> Decision {
        let limit = own.unwrap_or(self.default);
        let Some(quota) = limit.quota() else { return Decision::Unlimited };
        let now_ms = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        // A poisoned lock only means a panic elsewhere mid-insert; the map is still usable.
        {
            let entries = self.entries.read().unwrap_or_else(|e| e.into_inner());
            if let Some(entry) = entries.get(tenant).filter(|e| e.limit == limit) {
                return entry.decide(now_ms);
            }
        }
        let mut entries = self.entries.write().unwrap_or_else(|e| e.into_inner());
        // Another request of the tenant may have made the bucket while this one waited.
        if let Some(entry) = entries.get(tenant).filter(|e| e.limit == limit) {
            return entry.decide(now_ms);
        }
        if !entries.contains_key(tenant) && entries.len() >= self.max_tenants {
            evict(&mut entries, now_ms);
        }
        let entry = Entry::new(limit, quota, now_ms);
        let decision = entry.decide(now_ms);
        entries.insert(tenant.clone(), entry);
        decision
    }

    /// How many buckets are kept now.
    pub fn len(&self) -> usize {
        self.entries.read().unwrap_or_else(|e| e.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Frees room for one more bucket: every full-again bucket, else the least recently used.
fn evict(entries: &mut HashMap<TenantId, Entry>, now_ms: u64) {
    let before = entries.len();
    entries.retain(|_, entry| !entry.is_full_again(now_ms));
    if entries.len() < before {
        return;
    }
    let oldest = entries.iter().min_by_key(|(_, e)| e.last_used_ms.load(Ordering::Relaxed)).map(|(t, _)| t.clone());
    if let Some(tenant) = oldest {
        entries.remove(&tenant);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tenant(id: &str) -> TenantId {
        TenantId::parse(id.to_string()).unwrap_or_else(|e| panic!("{id} is a valid tenant id: {e}"))
    }

    const FIVE: RateLimit = RateLimit { requests_per_second: 5, burst: 5 };

    #[test]
    fn a_tenant_past_its_burst_is_limited_and_another_is_not() {
        let limiter = TenantLimiter::new(RateLimit { requests_per_second: 1000, burst: 1000 }, 10);
        let (a, b) = (tenant("a"), tenant("b"));
        let allowed = (0..5).filter(|_| matches!(limiter.check(&a, Some(FIVE)), Decision::Allowed { .. })).count();
        assert_eq!(allowed, 5);
        assert!(matches!(limiter.check(&a, Some(FIVE)), Decision::Limited { retry_after_s: 1, .. }));
        assert!(matches!(limiter.check(&b, None), Decision::Allowed { remaining: 999, .. }));
    }

    #[test]
    fn a_changed_rate_starts_a_fresh_bucket() {
        let limiter = TenantLimiter::new(FIVE, 10);
        let a = tenant("a");
        for _ in 0..5 {
            limiter.check(&a, None);
        }
        assert!(matches!(limiter.check(&a, None), Decision::Limited { .. }));
        let wider = RateLimit { requests_per_second: 10, burst: 10 };
        assert!(matches!(limiter.check(&a, Some(wider)), Decision::Allowed { remaining: 9, .. }));
    }

    #[test]
    fn rate_zero_means_no_limit() {
        let limiter = TenantLimiter::new(RateLimit { requests_per_second: 0, burst: 0 }, 10);
        assert_eq!(limiter.check(&tenant("a"), None), Decision::Unlimited);
        assert!(limiter.is_empty(), "an unlimited tenant keeps no bucket");
    }

    #[test]
    fn buckets_are_bounded() {
        let limiter = TenantLimiter::new(FIVE, 2);
        for id in ["a", "b", "c", "d"] {
            assert!(matches!(limiter.check(&tenant(id), None), Decision::Allowed { remaining: 4, .. }));
            assert!(limiter.len() <= 2, "at most max_tenants buckets");
        }
    }

    #[test]
    fn headers_follow_the_structured_field_form() {
        assert_eq!(FIVE.policy_field(), "\"tenant\";q=5;w=1");
        assert_eq!(RateLimit { requests_per_second: 1, burst: 2 }.policy_field(), "\"tenant\";q=2;w=2");
        assert_eq!(remaining_field(0, 1), "\"tenant\";r=0;t=1");
    }

    #[test]
    fn shapes_out_of_bounds_are_refused() {
        assert!(RateLimit { requests_per_second: 1, burst: 0 }.validate().is_err());
        assert!(RateLimit { requests_per_second: MAX_RATE + 1, burst: 1 }.validate().is_err());
        assert!(RateLimit { requests_per_second: 0, burst: 0 }.validate().is_ok());
        assert!(FIVE.validate().is_ok());
    }
}

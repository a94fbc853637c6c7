//! Flash sales: every line deducts its SKU's inventory, each user may take at most one piece
//! of each SKU (the limit `flash:{sku}:{user}`, max 1, enforced by stockd atomically with the
//! deduction), and the SKU's buckets are tried starting from one picked by the user id, so
//! concurrent buyers spread over the buckets instead of queueing on the first one.
//!
//! Configuration: `buckets = N` (1..=1024, default 8), the number of buckets the flash-sale
//! SKUs were created with. Orders without a `user_id` are refused.
#![no_std]

use stockd_plugin_sdk::*;

/// Buckets a flash-sale SKU is split into unless the configuration says otherwise.
const DEFAULT_BUCKETS: i64 = 8;

struct FlashSale;

impl Guest for FlashSale {
    fn plan(order: Order, ctx: Context) -> Result<Plan, String> {
        let user = require_user(&order, "a flash sale allows one piece per user and SKU")?;
        let buckets = config_number(&ctx.config, "buckets", DEFAULT_BUCKETS, 1, 1024)? as u32;
        let bucket_order = bucket_order(user, buckets);
        let mut lines = Vec::with_capacity(order.lines.len());
        for (index, line) in order.lines.iter().enumerate() {
            let limit = UserLimit { key: checked_key(format!("flash:{}:{user}", line.key), "limit key")?, max: 1 };
            let target =
                Target { kind: Some(Kind::Inventory), buckets: bucket_order.clone(), ..target(line.key.clone()) };
            lines.push(PlannedLine { limit: Some(limit), ..planned(index, line, vec![target]) });
        }
        Ok(Plan { policy: Policy::AllOrNothing, lines })
    }
}

/// All `count` buckets, starting at the user's own (a stable hash of the id) and wrapping
/// around, so a full bucket falls back to the next one.
fn bucket_order(user: &str, count: u32) -> Vec<u32> {
    let start = (stable_hash(user) % u64::from(count)) as u32;
    (0..count).map(|i| (start + i) % count).collect()
}

export_planner!(FlashSale);

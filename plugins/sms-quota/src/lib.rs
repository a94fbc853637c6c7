//! Monthly SMS quotas: the line key is an account, and each calendar month (UTC) has its own
//! quota resource `{account}:{YYYY-MM}` of kind `quota`. The month comes from the core's
//! clock (`ctx.now-ms`); a month's resource is created on first use with the allowance.
//!
//! Configuration: `allowance = N` (0..=10^15, default 1000), the messages per month.
#![no_std]

use stockd_plugin_sdk::*;

/// Messages per account and month unless the configuration says otherwise.
const DEFAULT_ALLOWANCE: i64 = 1000;
/// The largest allowance stockd accepts for a created resource.
const MAX_ALLOWANCE: i64 = 1_000_000_000_000_000;

struct SmsQuota;

impl Guest for SmsQuota {
    fn plan(order: Order, ctx: Context) -> Result<Plan, String> {
        let allowance = config_number(&ctx.config, "allowance", DEFAULT_ALLOWANCE, 0, MAX_ALLOWANCE)?;
        let (year, month) = utc_year_month(ctx.now_ms);
        let mut lines = Vec::with_capacity(order.lines.len());
        for (index, line) in order.lines.iter().enumerate() {
            let resource = checked_key(format!("{}:{year:04}-{month:02}", line.key), "quota key")?;
            let target = Target { kind: Some(Kind::Quota), create_if_missing: Some(allowance), ..target(resource) };
            lines.push(planned(index, line, vec![target]));
        }
        Ok(Plan { policy: Policy::AllOrNothing, lines })
    }
}

export_planner!(SmsQuota);

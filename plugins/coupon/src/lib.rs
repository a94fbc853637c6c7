//! Coupons: the line key is a campaign; claiming takes from the campaign's stock (the resource
//! `campaign:{key}` of kind `coupon`) and each user may claim once per campaign (the limit
//! `coupon:{campaign}:{user}`, max 1). Orders without a `user_id` are refused.
#![no_std]

use stockd_plugin_sdk::*;

struct Coupon;

impl Guest for Coupon {
    fn plan(order: Order, _ctx: Context) -> Result<Plan, String> {
        let user = require_user(&order, "a coupon can be claimed once per user")?;
        let mut lines = Vec::with_capacity(order.lines.len());
        for (index, line) in order.lines.iter().enumerate() {
            let campaign = &line.key;
            let resource = checked_key(format!("campaign:{campaign}"), "campaign key")?;
            let limit = UserLimit { key: checked_key(format!("coupon:{campaign}:{user}"), "limit key")?, max: 1 };
            let target = Target { kind: Some(Kind::Coupon), ..target(resource) };
            lines.push(PlannedLine { limit: Some(limit), ..planned(index, line, vec![target]) });
        }
        Ok(Plan { policy: Policy::AllOrNothing, lines })
    }
}

export_planner!(Coupon);

//! Test fixture: returns a negative number where stockd requires a positive one. With the
//! configuration `field = limit` the per-user limit's maximum is negative, otherwise the
//! line's quantity is.
#![no_std]

use stockd_plugin_sdk::*;

struct Negative;

impl Guest for Negative {
    fn plan(order: Order, ctx: Context) -> Result<Plan, String> {
        let line = &order.lines[0];
        let mut planned = planned(0, line, vec![target(line.key.clone())]);
        if config_value(&ctx.config, "field") == Some("limit") {
            planned.limit = Some(UserLimit { key: format!("limit:{}", line.key), max: -1 });
        } else {
            planned.qty = -line.qty;
        }
        Ok(Plan { policy: Policy::AllOrNothing, lines: vec![planned] })
    }
}

export_planner!(Negative);

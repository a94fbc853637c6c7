//! Test fixture: panics on every call, which traps the instance.
#![no_std]

use stockd_plugin_sdk::*;

struct Panicker;

impl Guest for Panicker {
    fn plan(order: Order, _ctx: Context) -> Result<Plan, String> {
        panic!("refusing order {}", order.order_id)
    }
}

export_planner!(Panicker);

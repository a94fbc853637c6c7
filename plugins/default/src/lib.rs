//! The built-in default as a plugin: each line deducts its own key, with the quantity asked,
//! all-or-nothing, no kind check, no per-user limit, no creation, default bucket order.
//! Uploading it changes nothing but the `plugin` recorded in order documents, which makes it
//! the reference for measuring what a plugin call costs.
#![no_std]

use stockd_plugin_sdk::*;

struct DefaultPlanner;

impl Guest for DefaultPlanner {
    fn plan(order: Order, _ctx: Context) -> Result<Plan, String> {
        Ok(default_plan(&order))
    }
}

export_planner!(DefaultPlanner);

//! Test fixture: a correct planner linked as a core module instead of a component (see
//! `build.rs`). stockd must refuse it at upload and say why.
#![no_std]

use stockd_plugin_sdk::*;

struct Default;

impl Guest for Default {
    fn plan(order: Order, _ctx: Context) -> Result<Plan, String> {
        Ok(default_plan(&order))
    }
}

export_planner!(Default);

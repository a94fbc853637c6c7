//! Test fixture: plans a line one past the end of the order.
#![no_std]

use stockd_plugin_sdk::*;

struct BadIndex;

impl Guest for BadIndex {
    fn plan(order: Order, _ctx: Context) -> Result<Plan, String> {
        let last = &order.lines[order.lines.len() - 1];
        let line = planned(order.lines.len(), last, vec![target(last.key.clone())]);
        Ok(Plan { policy: Policy::AllOrNothing, lines: vec![line] })
    }
}

export_planner!(BadIndex);

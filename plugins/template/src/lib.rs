//! {{name}}: a stockd planning plugin.
//!
//! stockd calls `plan` once for every order of your tenant, with the order (its lines, each a
//! `key`, a `qty` and `attributes`) and a context (`tenant`, `now_ms`, `seed`, and `config`,
//! the configuration text uploaded with the plugin). The plan says, for each line, which
//! resource it takes from (then which fallbacks), under which per-user limit, and whether the
//! order may partly succeed; stockd does the deductions, atomically and exactly once.
//!
//! This starting point plans like stockd's built-in default, but insists on inventory: each
//! line takes its own quantity from the resource named by its key, which must be an
//! `inventory` resource, and either every line applies or none does. The comments show where
//! the other decisions go; `cases.toml` holds sample orders and the plans they must produce.
//!
//! A plugin imports nothing (no clock, randomness, files, network or printing), so it is
//! `#![no_std]`: `String`, `Vec`, `vec!` and `format!` come from the SDK. A panic fails only
//! the order being planned; prefer returning `Err(reason)`, which the client sees.
#![no_std]

use stockd_plugin_sdk::*;

struct Planner;

impl Guest for Planner {
    // Rename `_ctx` to `ctx` when you use it, e.g. for configuration:
    //     let buckets = config_number(&ctx.config, "buckets", 8, 1, 1024)?;
    // (`name = value` lines; a bad value refuses the order with a readable reason.)
    fn plan(order: Order, _ctx: Context) -> Result<Plan, String> {
        // Per-user limits need a user; refuse orders without one:
        //     let user = require_user(&order, "purchases are limited per user")?;
        let mut lines = Vec::with_capacity(order.lines.len());
        for (index, line) in order.lines.iter().enumerate() {
            // The resource this line takes from. Keys you build from client input (attributes,
            // the user id) must be checked, so a bad one refuses the order readably:
            //     let warehouse = attribute(line, "warehouse").unwrap_or("main");
            //     let resource = checked_key(format!("{}:{warehouse}", line.key), "stock key")?;
            let primary = Target {
                // The kind the resource must be: a line whose resource is of another kind
                // fails as `resource_not_found`. `None` accepts any kind.
                kind: Some(Kind::Inventory),
                // A missing resource (a new quota period, say) created on first use with this
                // allowance, instead of failing the line:
                //     create_if_missing: Some(1000),
                // For a bucketed resource, the order its buckets are tried in (empty: stockd's
                // default), e.g. starting from the user's own to spread a hot SKU:
                //     buckets: (0..8).map(|i| ((stable_hash(user) % 8) as u32 + i) % 8).collect(),
                ..target(line.key.clone())
            };
            // Fallbacks: up to 7 more targets, tried in order when the ones before run short:
            //     let fallback = target(checked_key(format!("{}:central", line.key), "fallback key")?);
            //     vec![primary, fallback]
            let targets = vec![primary];
            lines.push(PlannedLine {
                // A per-user limit, enforced by stockd atomically with the deduction: the line
                // applies only if what the user took under this key, plus `qty`, stays <= max.
                //     limit: Some(UserLimit { key: checked_key(format!("max5:{}:{user}", line.key), "limit key")?, max: 5 }),
                // With `Policy::MandatoryLines`, the lines the order cannot do without:
                //     mandatory: true,
                ..planned(index, line, targets)
            });
        }
        // Every line applies or none does. `Policy::AllowPartial` applies the lines that can
        // (the order is then `partial`); `Policy::MandatoryLines` does too, but rejects the
        // order unless every line marked `mandatory` applied.
        Ok(Plan { policy: Policy::AllOrNothing, lines })
    }
}

export_planner!(Planner);

//! Wallets: each line is a payment from an account's balance in minor units (cents). The line
//! key is the account, the line's `currency` attribute picks the balance, so the resource is
//! `{account}:{currency}` of kind `balance`. Paying with several balances is all-or-nothing.
//!
//! Configuration: `currency = XXX`, the currency of lines without the attribute (default EUR).
#![no_std]

use stockd_plugin_sdk::*;

/// The currency of lines that name none, unless the configuration says otherwise.
const DEFAULT_CURRENCY: &str = "EUR";

struct Wallet;

impl Guest for Wallet {
    fn plan(order: Order, ctx: Context) -> Result<Plan, String> {
        let default_currency = config_value(&ctx.config, "currency").unwrap_or(DEFAULT_CURRENCY);
        let mut lines = Vec::with_capacity(order.lines.len());
        for (index, line) in order.lines.iter().enumerate() {
            let currency = attribute(line, "currency").unwrap_or(default_currency);
            let resource = checked_key(format!("{}:{currency}", line.key), "balance key")?;
            lines.push(planned(index, line, vec![Target { kind: Some(Kind::Balance), ..target(resource) }]));
        }
        Ok(Plan { policy: Policy::AllOrNothing, lines })
    }
}

export_planner!(Wallet);

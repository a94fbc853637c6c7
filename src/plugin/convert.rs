//! Crossing the boundary: the core's order becomes the WIT records a plugin reads, and the
//! plan a plugin returns becomes a [`PluginPlan`] only after every index, key and number in
//! it has been checked. Nothing a plugin returns reaches the core unchecked.

use super::bindings as wit;
use super::limits::{MAX_BUCKETS, MAX_CREATE_ALLOWANCE, MAX_REASON_CHARS, MAX_TARGETS_PER_LINE};
use super::model::{PlanInput, PluginLine, PluginPlan, PluginPolicy, PluginTarget, UserLimit};
use crate::engine::{Action, Kind, Quantity, ResourceKey};

/// Characters of a plugin-supplied value quoted back in an error message.
const MAX_QUOTED_CHARS: usize = 64;

/// The WIT records for one call.
pub(crate) fn to_wit(input: &PlanInput<'_>) -> (wit::Order, wit::Context) {
    let order = input.order;
    let lines = order
        .lines
        .iter()
        .map(|line| wit::OrderLine {
            key: line.key.to_string(),
            qty: line.qty.get(),
            // A BTreeMap: already sorted by name, as the contract promises.
            attributes: line.attributes.iter().flatten().map(|(name, value)| (name.clone(), value.clone())).collect(),
        })
        .collect();
    let action = match order.action {
        Action::Deduct => wit::Action::Deduct,
        Action::Reserve => wit::Action::Reserve,
    };
    let wit_order = wit::Order {
        order_id: order.order_id.to_string(),
        user_id: order.user_id.as_ref().map(ToString::to_string),
        action,
        lines,
    };
    let context = wit::Context {
        tenant: input.tenant.to_string(),
        now_ms: input.now_ms,
        seed: input.seed,
        config: input.config.to_string(),
    };
    (wit_order, context)
}

/// Checks a plugin's plan against the contract for an order of `order_lines` lines. Error
/// messages name the offending field (`lines[1].targets[0].resource`) and are only built on
/// the error path: this runs on every order.
pub(crate) fn from_wit(plan: wit::Plan, order_lines: usize) -> Result<PluginPlan, String> {
    if plan.lines.is_empty() {
        return Err("the plan has no lines (refuse the order with an error instead)".into());
    }
    let mut planned = vec![false; order_lines];
    let mut lines = Vec::with_capacity(plan.lines.len());
    for (i, line) in plan.lines.into_iter().enumerate() {
        let Some(seen) = usize::try_from(line.line).ok().and_then(|index| planned.get_mut(index)) else {
            return Err(format!("lines[{i}].line {} is out of range: the order has {order_lines} lines", line.line));
        };
        if std::mem::replace(seen, true) {
            return Err(format!("lines[{i}].line {}: order line {} is planned twice", line.line, line.line));
        }
        lines.push(planned_line(i, line)?);
    }
    let policy = match plan.policy {
        wit::Policy::AllOrNothing => PluginPolicy::AllOrNothing,
        wit::Policy::AllowPartial => PluginPolicy::AllowPartial,
        wit::Policy::MandatoryLines => PluginPolicy::MandatoryLines,
    };
    Ok(PluginPlan { policy, lines })
}

/// Checks planned line `i`, whose `line` index has been checked already.
fn planned_line(i: usize, line: wit::PlannedLine) -> Result<PluginLine, String> {
    let qty = Quantity::new(line.qty).map_err(|e| format!("lines[{i}].qty {}: {e}", line.qty))?;
    if line.targets.is_empty() || line.targets.len() > MAX_TARGETS_PER_LINE {
        return Err(format!(
            "lines[{i}].targets: {} targets; a line needs 1 to {MAX_TARGETS_PER_LINE}",
            line.targets.len()
        ));
    }
    let mut targets = Vec::with_capacity(line.targets.len());
    for (t, target) in line.targets.into_iter().enumerate() {
        targets.push(self::target(target).map_err(|(field, e)| format!("lines[{i}].targets[{t}].{field}{e}"))?);
    }
    let limit = match line.limit {
        None => None,
        Some(limit) => {
            let key = key(&limit.key).map_err(|e| format!("lines[{i}].limit.key{e}"))?;
            if limit.max < 0 {
                return Err(format!("lines[{i}].limit.max {} is negative", limit.max));
            }
            Some(UserLimit { key, max: limit.max })
        }
    };
    let index = line.line as usize;
    Ok(PluginLine { line: index, qty, mandatory: line.mandatory, targets, limit })
}

/// Checks one target; an error names the field and (after it) what is wrong.
fn target(target: wit::Target) -> Result<PluginTarget, (&'static str, String)> {
    let resource = key(&target.resource).map_err(|e| ("resource", e))?;
    if let Some(allowance) = target.create_if_missing {
        if !(0..=MAX_CREATE_ALLOWANCE).contains(&allowance) {
            return Err(("create_if_missing", format!(" {allowance} is not between 0 and {MAX_CREATE_ALLOWANCE}")));
        }
    }
    if target.buckets.len() > MAX_BUCKETS {
        return Err(("buckets", format!(" lists {} buckets; at most {MAX_BUCKETS}", target.buckets.len())));
    }
    let mut buckets = Vec::with_capacity(target.buckets.len());
    for bucket in target.buckets {
        match u16::try_from(bucket) {
            Ok(b) if usize::from(b) < MAX_BUCKETS => buckets.push(b),
            _ => return Err(("buckets", format!(": bucket {bucket} is out of range (0 to {})", MAX_BUCKETS - 1))),
        }
    }
    let kind = target.kind.map(|kind| match kind {
        wit::Kind::Inventory => Kind::Inventory,
        wit::Kind::Balance => Kind::Balance,
        wit::Kind::Coupon => Kind::Coupon,
        wit::Kind::Quota => Kind::Quota,
    });
    Ok(PluginTarget { resource, kind, create_if_missing: target.create_if_missing, buckets })
}

/// A resource or limit key; the error starts with the quoted value.
fn key(value: &str) -> Result<ResourceKey, String> {
    ResourceKey::parse(value).map_err(|e| format!(" {}: {e}", quoted(value)))
}

/// A plugin-supplied value, safe to put in an error message: shortened and escaped.
fn quoted(value: &str) -> String {
    let mut short: String = value.chars().take(MAX_QUOTED_CHARS).collect();
    if short.len() < value.len() {
        short.push('…');
    }
    format!("{short:?}")
}

/// A plugin's own reason for refusing an order: at most 500 characters, control characters
/// replaced, so it can go into a problem+json `detail` as it is.
pub(crate) fn bounded_reason(reason: &str) -> String {
    let mut bounded: String =
        reason.chars().take(MAX_REASON_CHARS).map(|c| if c.is_control() { ' ' } else { c }).collect();
    if reason.chars().nth(MAX_REASON_CHARS).is_some() {
        bounded.push('…');
    }
    let trimmed = bounded.trim();
    if trimmed.is_empty() {
        "(no reason given)".to_string()
    } else {
        trimmed.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(resource: &str) -> wit::Target {
        wit::Target { resource: resource.into(), kind: None, create_if_missing: None, buckets: vec![] }
    }

    fn line(index: u32, qty: i64) -> wit::PlannedLine {
        wit::PlannedLine { line: index, qty, mandatory: false, targets: vec![target("sku-1")], limit: None }
    }

    fn plan(lines: Vec<wit::PlannedLine>) -> wit::Plan {
        wit::Plan { policy: wit::Policy::AllOrNothing, lines }
    }

    fn refused(plan: wit::Plan, order_lines: usize) -> String {
        match from_wit(plan, order_lines) {
            Ok(plan) => panic!("accepted {plan:?}"),
            Err(reason) => reason,
        }
    }

    #[test]
    fn a_plan_within_the_contract_is_accepted_as_is() {
        // Proves the happy path keeps every field: index, qty, kind, allowance, buckets, limit.
        let mut planned = line(1, 5);
        planned.mandatory = true;
        planned.targets = vec![
            wit::Target {
                resource: "acct-9:2026-11".into(),
                kind: Some(wit::Kind::Quota),
                create_if_missing: Some(1000),
                buckets: vec![3, 0, 1023],
            },
            target("acct-9:fallback"),
        ];
        planned.limit = Some(wit::UserLimit { key: "flash:sku:u-1".into(), max: 0 });
        let plan = from_wit(wit::Plan { policy: wit::Policy::MandatoryLines, lines: vec![planned, line(0, 1)] }, 2);
        let plan = plan.unwrap_or_else(|e| panic!("refused: {e}"));
        assert_eq!(plan.policy, PluginPolicy::MandatoryLines);
        assert_eq!(plan.lines.len(), 2);
        let first = &plan.lines[0];
        assert_eq!((first.line, first.qty.get(), first.mandatory), (1, 5, true));
        assert_eq!(first.targets[0].resource.as_str(), "acct-9:2026-11");
        assert_eq!(first.targets[0].kind, Some(Kind::Quota));
        assert_eq!(first.targets[0].create_if_missing, Some(1000));
        assert_eq!(first.targets[0].buckets, vec![3, 0, 1023]);
        assert_eq!(first.targets[1].resource.as_str(), "acct-9:fallback");
        assert_eq!(first.limit.as_ref().map(|l| (l.key.as_str(), l.max)), Some(("flash:sku:u-1", 0)));
    }

    #[test]
    fn line_indexes_must_be_in_range_and_unique() {
        assert!(refused(plan(vec![line(2, 1)]), 2).contains("out of range"));
        assert!(refused(plan(vec![line(u32::MAX, 1)]), 2).contains("out of range"));
        assert!(refused(plan(vec![line(0, 1), line(0, 1)]), 2).contains("planned twice"));
        assert!(refused(plan(vec![]), 2).contains("no lines"));
    }

    #[test]
    fn quantities_must_be_between_one_and_ten_to_the_twelve() {
        for qty in [0, -5, 1_000_000_000_001, i64::MIN] {
            assert!(refused(plan(vec![line(0, qty)]), 1).starts_with("lines[0].qty"), "qty {qty}");
        }
        assert!(from_wit(plan(vec![line(0, 1_000_000_000_000)]), 1).is_ok());
    }

    #[test]
    fn targets_are_bounded_and_their_keys_checked() {
        let mut none = line(0, 1);
        none.targets.clear();
        assert!(refused(plan(vec![none]), 1).contains("0 targets"));
        let mut nine = line(0, 1);
        nine.targets = (0..9).map(|i| target(&format!("wh-{i}"))).collect();
        assert!(refused(plan(vec![nine]), 1).contains("9 targets"));
        for bad in ["", "a b", "../etc", "é", &"k".repeat(201)] {
            let mut hostile = line(0, 1);
            hostile.targets = vec![target(bad)];
            assert!(refused(plan(vec![hostile]), 1).starts_with("lines[0].targets[0].resource"), "{bad:?}");
        }
    }

    #[test]
    fn buckets_and_allowances_are_bounded() {
        let with = |buckets: Vec<u32>, create: Option<i64>| {
            let mut planned = line(0, 1);
            planned.targets =
                vec![wit::Target { resource: "sku".into(), kind: None, create_if_missing: create, buckets }];
            plan(vec![planned])
        };
        assert!(refused(with(vec![1024], None), 1).contains("bucket 1024 is out of range"));
        assert!(refused(with(vec![0; 1025], None), 1).contains("1025 buckets"));
        assert!(from_wit(with(vec![0; 1024], None), 1).is_ok());
        assert!(refused(with(vec![], Some(-1)), 1).contains("create_if_missing -1"));
        assert!(refused(with(vec![], Some(MAX_CREATE_ALLOWANCE + 1)), 1).contains("create_if_missing"));
        assert!(from_wit(with(vec![], Some(MAX_CREATE_ALLOWANCE)), 1).is_ok());
    }

    #[test]
    fn limits_need_a_valid_key_and_a_non_negative_maximum() {
        let with = |key: &str, max: i64| {
            let mut planned = line(0, 1);
            planned.limit = Some(wit::UserLimit { key: key.into(), max });
            plan(vec![planned])
        };
        assert!(refused(with("u:1", -1), 1).contains("limit.max -1 is negative"));
        assert!(refused(with("u 1", 1), 1).starts_with("lines[0].limit.key"));
        assert!(refused(with("", 1), 1).starts_with("lines[0].limit.key"));
    }

    #[test]
    fn hostile_values_are_quoted_short_and_escaped() {
        let mut hostile = line(0, 1);
        hostile.targets = vec![target(&format!("\u{1b}[31m{}", "x".repeat(10_000)))];
        let reason = refused(plan(vec![hostile]), 1);
        assert!(reason.len() < 250, "{reason}");
        assert!(!reason.contains('\u{1b}'));
    }

    #[test]
    fn refusal_reasons_are_bounded_and_printable() {
        assert_eq!(bounded_reason("  no user id\n"), "no user id");
        assert_eq!(bounded_reason(""), "(no reason given)");
        let long = bounded_reason(&"é".repeat(2000));
        assert_eq!(long.chars().count(), MAX_REASON_CHARS + 1);
        assert!(!bounded_reason("a\u{0}b\u{1b}c").chars().any(char::is_control));
    }
}

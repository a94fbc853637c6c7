//! What a case of a `stockd plugin check` cases file expects of its plan, and the comparison.
//!
//! A case's `expect` table either holds `refused = "text"` (the plugin must refuse the order,
//! with a reason containing that text; `""` accepts any reason) or parts of the plan, named as
//! `check` prints plans: `policy`, and `lines` with each line's `line`, `qty`, `mandatory`,
//! `targets` (`resource`, `kind`, `create_if_missing`, `buckets`) and `limit` (`key`, `max`).
//! A field left out is not checked; a list must have the same length as the plan's, and is
//! compared entry by entry in order. A field the plan does not have is a mismatch, so a typo
//! cannot make a case pass silently.

use serde_json::Value;

use super::model::PluginPlan;

/// What one case expects.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Expectation {
    /// The plugin refuses the order with a reason containing this text.
    Refused(String),
    /// A plan containing these fields (a JSON object shaped like the printed plan).
    Plan(Value),
}

/// What the plugin answered, as far as expectations are concerned.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Answer<'a> {
    Planned(&'a PluginPlan),
    Refused(&'a str),
}

impl Expectation {
    /// Reads a case's `expect` value; the error says what is wrong with it.
    pub(crate) fn from_toml(value: toml::Value) -> Result<Self, String> {
        let toml::Value::Table(table) = value else {
            return Err("must be a table (`[orders.expect]`, or `expect = { ... }`)".to_owned());
        };
        match table.get("refused") {
            None => serde_json::to_value(&table).map(Expectation::Plan).map_err(|e| e.to_string()),
            Some(toml::Value::String(_)) if table.len() > 1 => {
                Err("`refused` stands alone: a refused order has no plan to compare".to_owned())
            }
            Some(toml::Value::String(text)) => Ok(Expectation::Refused(text.clone())),
            Some(_) => Err("`refused` is the text the reason must contain (\"\" for any reason)".to_owned()),
        }
    }

    /// `Ok` when `answer` is what this expects; otherwise what differs, first difference only.
    pub(crate) fn compare(&self, answer: Answer<'_>) -> Result<(), String> {
        match (self, answer) {
            (Expectation::Refused(text), Answer::Refused(reason)) if reason.contains(text.as_str()) => Ok(()),
            (Expectation::Refused(text), Answer::Refused(reason)) => {
                Err(format!("expected a refusal containing {text:?}, the reason is {reason:?}"))
            }
            (Expectation::Refused(text), Answer::Planned(_)) => {
                Err(format!("expected a refusal containing {text:?}, the plugin planned the order"))
            }
            (Expectation::Plan(_), Answer::Refused(reason)) => {
                Err(format!("expected a plan, the plugin refused the order: {reason}"))
            }
            (Expectation::Plan(expected), Answer::Planned(plan)) => {
                let actual = serde_json::to_value(plan).map_err(|e| e.to_string())?;
                contains(expected, &actual, "plan")
            }
        }
    }
}

/// Whether `actual` has every field of `expected` with the same value (objects: the given
/// fields; lists: same length, entry by entry; anything else: equal). The error names the
/// first difference by its path, e.g. `plan.lines[0].targets[1].resource`.
fn contains(expected: &Value, actual: &Value, path: &str) -> Result<(), String> {
    match (expected, actual) {
        (Value::Object(fields), Value::Object(have)) => {
            fields.iter().try_for_each(|(name, want)| match have.get(name) {
                Some(got) => contains(want, got, &format!("{path}.{name}")),
                None => {
                    let known: Vec<&str> = have.keys().map(String::as_str).collect();
                    Err(format!("{path} has no field `{name}` (it has {})", known.join(", ")))
                }
            })
        }
        (Value::Array(want), Value::Array(got)) if want.len() != got.len() => {
            Err(format!("{path}: expected {} entries, the plan has {}: {actual}", want.len(), got.len()))
        }
        (Value::Array(want), Value::Array(got)) => want
            .iter()
            .zip(got)
            .enumerate()
            .try_for_each(|(i, (want, got))| contains(want, got, &format!("{path}[{i}]"))),
        _ if expected == actual => Ok(()),
        _ => Err(format!("{path}: expected {expected}, the plan has {actual}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{Kind, Quantity, ResourceKey};
    use crate::plugin::model::{PluginLine, PluginPolicy, PluginTarget, UserLimit};

    fn key(text: &str) -> ResourceKey {
        ResourceKey::parse(text).unwrap_or_else(|e| panic!("{text}: {e}"))
    }

    /// Two lines: sku-1 (inventory, then sku-1:central) limited by `max1:sku-1:u`, and sku-2.
    fn plan() -> PluginPlan {
        let target = |resource: &str, kind| PluginTarget {
            resource: key(resource),
            kind,
            create_if_missing: None,
            buckets: Vec::new(),
        };
        let qty = |n: i64| Quantity::new(n).unwrap_or_else(|e| panic!("{n}: {e}"));
        PluginPlan {
            policy: PluginPolicy::AllOrNothing,
            lines: vec![
                PluginLine {
                    line: 0,
                    qty: qty(2),
                    mandatory: false,
                    targets: vec![target("sku-1", Some(Kind::Inventory)), target("sku-1:central", None)],
                    limit: Some(UserLimit { key: key("max1:sku-1:u"), max: 1 }),
                },
                PluginLine {
                    line: 1,
                    qty: qty(1),
                    mandatory: false,
                    targets: vec![target("sku-2", None)],
                    limit: None,
                },
            ],
        }
    }

    fn expectation(text: &str) -> Result<Expectation, String> {
        Expectation::from_toml(toml::Value::Table(toml::from_str(text).unwrap_or_else(|e| panic!("{e}"))))
    }

    fn compare(text: &str, answer: Answer<'_>) -> Result<(), String> {
        expectation(text).and_then(|expected| expected.compare(answer))
    }

    #[test]
    fn a_plan_matches_when_every_given_field_is_equal() {
        // Proves partial matching: left-out fields are not checked, given ones must be equal,
        // lists are compared entry by entry, an empty expectation accepts any plan.
        let plan = plan();
        let planned = Answer::Planned(&plan);
        assert_eq!(compare("", planned), Ok(()));
        assert_eq!(compare("policy = \"all_or_nothing\"", planned), Ok(()));
        let full = r#"
            policy = "all_or_nothing"
            lines = [
              { line = 0, qty = 2, mandatory = false, limit = { key = "max1:sku-1:u", max = 1 }, targets = [{ resource = "sku-1", kind = "inventory", buckets = [] }, { resource = "sku-1:central" }] },
              { line = 1, targets = [{ resource = "sku-2" }] },
            ]"#;
        assert_eq!(compare(full, planned), Ok(()));
    }

    #[test]
    fn a_difference_is_named_by_its_path() {
        // Proves each kind of mismatch fails with the first difference's path and both values.
        let plan = plan();
        let planned = Answer::Planned(&plan);
        assert_eq!(
            compare("policy = \"allow_partial\"", planned),
            Err("plan.policy: expected \"allow_partial\", the plan has \"all_or_nothing\"".to_owned())
        );
        let wrong_fallback = "lines = [{ targets = [{}, { resource = \"sku-1:east\" }] }, {}]";
        assert_eq!(
            compare(wrong_fallback, planned),
            Err("plan.lines[0].targets[1].resource: expected \"sku-1:east\", the plan has \"sku-1:central\"".to_owned())
        );
        let one_line = compare("lines = [{ line = 0 }]", planned).err().unwrap_or_default();
        assert!(one_line.starts_with("plan.lines: expected 1 entries, the plan has 2: "), "{one_line}");
        let typo = compare("lines = [{ qyt = 2 }, {}]", planned).err().unwrap_or_default();
        assert!(typo.starts_with("plan.lines[0] has no field `qyt` (it has "), "{typo}");
        assert_eq!(
            compare("lines = [{}, { limit = { max = 1 } }]", planned),
            Err("plan.lines[1].limit: expected {\"max\":1}, the plan has null".to_owned())
        );
    }

    #[test]
    fn refusals_are_expected_by_their_reason() {
        // Proves `refused`: a reason containing the text matches, another reason or a plan does
        // not, a plan expectation does not accept a refusal, and `refused` cannot carry plan
        // fields.
        let plan = plan();
        let refused = Answer::Refused("order \"o\" has no user_id; limited per user");
        assert_eq!(compare("refused = \"has no user_id\"", refused), Ok(()));
        assert_eq!(compare("refused = \"\"", refused), Ok(()));
        assert!(compare("refused = \"out of stock\"", refused).is_err_and(|e| e.contains("the reason is")));
        assert!(compare("refused = \"\"", Answer::Planned(&plan)).is_err_and(|e| e.contains("planned the order")));
        assert!(compare("policy = \"all_or_nothing\"", refused).is_err_and(|e| e.contains("expected a plan")));
        assert!(expectation("refused = \"x\"\npolicy = \"all_or_nothing\"").is_err_and(|e| e.contains("stands alone")));
        assert!(expectation("refused = true").is_err_and(|e| e.contains("is the text")));
        assert!(Expectation::from_toml(toml::Value::Integer(1)).is_err_and(|e| e.contains("must be a table")));
    }
}

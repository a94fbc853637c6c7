//! Newtypes at the edge: every identifier and number that arrives from a client is parsed and
//! validated once, here. Inside the server an invalid `ResourceKey` or a negative `Quantity`
//! cannot exist, so no layer below re-checks them.

use std::fmt;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// Largest quantity a single order line may ask for (10^12 smallest units).
pub const MAX_LINE_QTY: i64 = 1_000_000_000_000;
/// Largest total a resource may hold (10^15): far below `i64::MAX`, so sums of totals and
/// adjustments cannot overflow.
pub const MAX_TOTAL: i64 = 1_000_000_000_000_000;

/// Why a value from a client was refused; the message names the rule, never echoes secrets.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidValue(pub String);

fn is_visible_ascii(s: &str) -> bool {
    s.bytes().all(|b| (0x21..=0x7e).contains(&b))
}

macro_rules! string_newtype {
    ($(#[$doc:meta])* $name:ident, pattern = $pattern:literal, $check:expr) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, ToSchema)]
        #[serde(try_from = "String", into = "String")]
        #[schema(value_type = String, pattern = $pattern)]
        pub struct $name(String);

        impl $name {
            /// Parses and validates a client-supplied value.
            pub fn parse(value: impl Into<String>) -> Result<Self, InvalidValue> {
                let value = value.into();
                let check: fn(&str) -> Result<(), String> = $check;
                check(&value).map_err(InvalidValue)?;
                Ok(Self(value))
            }

            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl TryFrom<String> for $name {
            type Error = InvalidValue;
            fn try_from(value: String) -> Result<Self, Self::Error> {
                Self::parse(value)
            }
        }

        impl From<$name> for String {
            fn from(value: $name) -> String {
                value.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }
    };
}

string_newtype!(
    /// A tenant id: `[a-z0-9-]{1,64}`.
    TenantId,
    pattern = r"^[a-z0-9-]{1,64}$",
    |s| {
        let ok = (1..=64).contains(&s.len())
            && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
        if ok { Ok(()) } else { Err("must be 1-64 characters of [a-z0-9-]".into()) }
    }
);

string_newtype!(
    /// A resource key: 1-200 characters of `[A-Za-z0-9._:@-]`.
    ResourceKey,
    pattern = r"^[A-Za-z0-9._:@-]{1,200}$",
    |s| {
        let ok = (1..=200).contains(&s.len())
            && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"._:@-".contains(&b));
        if ok { Ok(()) } else { Err("must be 1-200 characters of [A-Za-z0-9._:@-]".into()) }
    }
);

string_newtype!(
    /// An idempotency key: 1-255 visible ASCII characters.
    IdempotencyKey,
    pattern = r"^[\x21-\x7e]{1,255}$",
    |s| {
        if (1..=255).contains(&s.len()) && is_visible_ascii(s) {
            Ok(())
        } else {
            Err("must be 1-255 visible ASCII characters".into())
        }
    }
);

string_newtype!(
    /// A client's order id: 1-128 visible ASCII characters (not required to be unique).
    OrderId,
    pattern = r"^[\x21-\x7e]{1,128}$",
    |s| {
        if (1..=128).contains(&s.len()) && is_visible_ascii(s) {
            Ok(())
        } else {
            Err("must be 1-128 visible ASCII characters".into())
        }
    }
);

string_newtype!(
    /// A client's user id, used by plans for per-user limits: 1-128 visible ASCII characters.
    UserId,
    pattern = r"^[\x21-\x7e]{1,128}$",
    |s| {
        if (1..=128).contains(&s.len()) && is_visible_ascii(s) {
            Ok(())
        } else {
            Err("must be 1-128 visible ASCII characters".into())
        }
    }
);

/// A positive quantity of one order line, in the resource's smallest unit: 1..=10^12.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "i64", into = "i64")]
pub struct Quantity(i64);

/// Written out because the derive cannot give a newtype its bounds.
impl utoipa::PartialSchema for Quantity {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::schema::{KnownFormat, ObjectBuilder, SchemaFormat, Type};
        ObjectBuilder::new()
            .schema_type(Type::Integer)
            .format(Some(SchemaFormat::KnownFormat(KnownFormat::Int64)))
            .minimum(Some(1))
            .maximum(Some(MAX_LINE_QTY))
            .description(Some("1..=10^12"))
            .into()
    }
}

impl ToSchema for Quantity {}

impl Quantity {
    pub fn new(value: i64) -> Result<Self, InvalidValue> {
        if (1..=MAX_LINE_QTY).contains(&value) {
            Ok(Self(value))
        } else {
            Err(InvalidValue(format!("must be between 1 and {MAX_LINE_QTY}")))
        }
    }

    pub fn get(self) -> i64 {
        self.0
    }
}

impl TryFrom<i64> for Quantity {
    type Error = InvalidValue;
    fn try_from(value: i64) -> Result<Self, Self::Error> {
        Self::new(value)
    }
}

impl From<Quantity> for i64 {
    fn from(value: Quantity) -> i64 {
        value.0
    }
}

macro_rules! str_enum {
    ($(#[$doc:meta])* $name:ident { $($variant:ident => $text:literal),+ $(,)? }) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
        #[serde(rename_all = "snake_case")]
        pub enum $name { $($variant),+ }

        impl $name {
            pub fn as_str(self) -> &'static str {
                match self { $(Self::$variant => $text),+ }
            }

            /// Parses the stored form; `None` for anything else.
            pub fn from_db(value: &str) -> Option<Self> {
                match value { $($text => Some(Self::$variant),)+ _ => None }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

str_enum!(
    /// What a resource counts.
    Kind { Inventory => "inventory", Balance => "balance", Coupon => "coupon", Quota => "quota" }
);
str_enum!(
    /// Whether a resource accepts new deductions and reservations.
    ResourceStatus { Active => "active", Inactive => "inactive" }
);
str_enum!(
    /// Which path deducts a resource: the database, or Redis pre-deduction.
    Mode { Db => "db", Redis => "redis" }
);
str_enum!(
    /// What an order does to its lines.
    Action { Deduct => "deduct", Reserve => "reserve" }
);
str_enum!(
    /// A reservation's state. Legal moves: `held → confirmed | released | expired`.
    ReservationState { Held => "held", Confirmed => "confirmed", Released => "released", Expired => "expired" }
);
str_enum!(
    /// A ledger entry's operation.
    LedgerOp {
        Create => "create", Adjust => "adjust", Deduct => "deduct", Reserve => "reserve",
        Confirm => "confirm", Release => "release", Expire => "expire", Reverse => "reverse",
    }
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resource_keys_allow_composites_and_refuse_hostile_text() {
        assert!(ResourceKey::parse("sku-1:wh-east:owner-7").is_ok());
        assert!(ResourceKey::parse("a@b.c_d").is_ok());
        for bad in ["", "../x", "a b", "é", "a/b", &"k".repeat(201)] {
            assert!(ResourceKey::parse(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn quantities_are_bounded() {
        assert!(Quantity::new(0).is_err());
        assert!(Quantity::new(-1).is_err());
        assert!(Quantity::new(MAX_LINE_QTY + 1).is_err());
        assert_eq!(Quantity::new(MAX_LINE_QTY).map(Quantity::get), Ok(MAX_LINE_QTY));
    }

    #[test]
    fn idempotency_keys_are_visible_ascii() {
        assert!(IdempotencyKey::parse("k-1").is_ok());
        assert!(IdempotencyKey::parse("a b").is_err());
        assert!(IdempotencyKey::parse("x".repeat(256)).is_err());
        assert!(IdempotencyKey::parse("x".repeat(255)).is_ok());
    }
}

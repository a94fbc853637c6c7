//! Time as the server sees it: integer milliseconds since the Unix epoch inside (stored as
//! such in every backend), RFC 3339 UTC on the wire. Logic takes `now_ms` as an argument so it
//! stays deterministic; only the edges read the clock.

use std::time::{SystemTime, UNIX_EPOCH};

use chrono::{DateTime, SecondsFormat, Utc};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The current wall-clock time in milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX)).unwrap_or(0)
}

/// A point in time, serialized as RFC 3339 UTC with millisecond precision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp(pub i64);

impl Timestamp {
    pub fn to_rfc3339(self) -> String {
        DateTime::<Utc>::from_timestamp_millis(self.0).unwrap_or_default().to_rfc3339_opts(SecondsFormat::Millis, true)
    }
}

impl Serialize for Timestamp {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_rfc3339())
    }
}

impl<'de> Deserialize<'de> for Timestamp {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        DateTime::parse_from_rfc3339(&text).map(|t| Timestamp(t.timestamp_millis())).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_round_trip_through_rfc3339() {
        let t = Timestamp(1_796_040_000_123);
        let text = serde_json::to_string(&t).unwrap_or_default();
        assert_eq!(text, "\"2026-11-30T12:00:00.123Z\"");
        let back: Timestamp = serde_json::from_str(&text).unwrap_or(Timestamp(0));
        assert_eq!(back, t);
    }
}

//! What both backends share of [`crate::webhooks::WebhookStore`]: row mappers (over
//! [`Columns`]) and the rule that decides what a queueing pass takes from the feed. Each backend
//! supplies only SQL text and its transactions.

use super::rows::Columns;
use super::StorageError;
use crate::events::{Event, EventType};
use crate::webhooks::{wants, Attempt, AttemptOutcome, Claimed, Endpoint, EndpointState, SigningSecret};

/// The columns [`endpoint`] reads.
pub const ENDPOINT_COLUMNS: &str = "id, tenant_id, url, types, description, secret, previous_secret, \
     previous_valid_until, state, failing_since, cursor, created_at";

/// The columns [`attempt`] reads.
pub const ATTEMPT_COLUMNS: &str = "id, event_id, seq, type, attempt, at, outcome, http_status, error, latency_ms";

fn secret(text: String) -> Result<SigningSecret, StorageError> {
    SigningSecret::parse(&text).ok_or_else(|| StorageError::Internal("a stored webhook secret is malformed".into()))
}

fn previous(row: &dyn Columns) -> Result<Option<(SigningSecret, i64)>, StorageError> {
    match (row.opt_text("previous_secret")?, row.opt_int("previous_valid_until")?) {
        (Some(s), Some(until)) => Ok(Some((secret(s)?, until))),
        _ => Ok(None),
    }
}

pub fn endpoint(row: &dyn Columns) -> Result<Endpoint, StorageError> {
    Ok(Endpoint {
        id: row.text("id")?,
        tenant: row.text("tenant_id")?,
        url: row.text("url")?,
        types: crate::webhooks::types_from_db(&row.text("types")?)?,
        description: row.text("description")?,
        secret: secret(row.text("secret")?)?,
        previous: previous(row)?,
        state: EndpointState::from_db(&row.text("state")?)?,
        failing_since: row.opt_int("failing_since")?,
        cursor: row.int("cursor")?,
        created_at: row.int("created_at")?,
    })
}

pub fn attempt(row: &dyn Columns) -> Result<Attempt, StorageError> {
    Ok(Attempt {
        id: row.int("id")?,
        event_id: row.text("event_id")?,
        seq: row.int("seq")?,
        kind: row.text("type")?,
        attempt: row.int("attempt")?,
        at: row.int("at")?,
        outcome: AttemptOutcome::from_db(&row.text("outcome")?)?,
        http_status: row.opt_int("http_status")?,
        error: row.opt_text("error")?,
        latency_ms: row.int("latency_ms")?,
    })
}

/// A claimed delivery joined with its endpoint and (if still kept) its event: columns
/// `endpoint_id, tenant_id, seq, attempts, window_start, lease_until, url, secret,
/// previous_secret, previous_valid_until, event_id, type, ordering_key, at, data`.
pub fn claimed(row: &dyn Columns) -> Result<Claimed, StorageError> {
    let tenant = row.text("tenant_id")?;
    let seq = row.int("seq")?;
    let event = match row.opt_text("event_id")? {
        Some(id) => Some(Event {
            id,
            tenant: tenant.clone(),
            seq,
            kind: row.text("type")?,
            ordering_key: row.text("ordering_key")?,
            at: row.int("at")?,
            data: super::payload::unpack(row.text("data")?)?,
        }),
        None => None,
    };
    Ok(Claimed {
        endpoint_id: row.text("endpoint_id")?,
        tenant,
        seq,
        attempts: row.int("attempts")?,
        window_start: row.opt_int("window_start")?,
        lease_until: row.int("lease_until")?,
        url: row.text("url")?,
        secret: secret(row.text("secret")?)?,
        previous: previous(row)?,
        event,
    })
}

/// An endpoint behind on its tenant's feed, as a queueing pass reads it.
#[derive(Debug, Clone)]
pub struct Behind {
    pub id: String,
    pub tenant: String,
    pub types: Vec<EventType>,
    pub cursor: i64,
}

pub fn behind(row: &dyn Columns) -> Result<Behind, StorageError> {
    Ok(Behind {
        id: row.text("id")?,
        tenant: row.text("tenant_id")?,
        types: crate::webhooks::types_from_db(&row.text("types")?)?,
        cursor: row.int("cursor")?,
    })
}

/// An event after an endpoint's cursor (columns `seq, type, ordering_key, at`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scanned {
    pub seq: i64,
    pub kind: String,
    pub ordering_key: String,
    pub at: i64,
}

pub fn scanned(row: &dyn Columns) -> Result<Scanned, StorageError> {
    Ok(Scanned {
        seq: row.int("seq")?,
        kind: row.text("type")?,
        ordering_key: row.text("ordering_key")?,
        at: row.int("at")?,
    })
}

/// What one endpoint's queueing takes from the events after its cursor (in seq order): the
/// ones of its types, at most `room` of them, and the cursor after the last event it is done
/// with (one it does not want counts as done). `None`: the cursor stays.
pub fn plan_queue<'a>(types: &[EventType], scanned: &'a [Scanned], mut room: u64) -> (Vec<&'a Scanned>, Option<i64>) {
    let mut take = Vec::new();
    let mut cursor = None;
    for event in scanned {
        if wants(types, &event.kind) {
            if room == 0 {
                break;
            }
            room -= 1;
            take.push(event);
        }
        cursor = Some(event.seq);
    }
    (take, cursor)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(seq: i64, kind: &str) -> Scanned {
        Scanned { seq, kind: kind.into(), ordering_key: "resource:a".into(), at: seq }
    }

    #[test]
    fn queueing_takes_wanted_events_up_to_the_room_and_moves_the_cursor_past_the_rest() {
        let events =
            [ev(4, "order.applied"), ev(5, "resource.sold_out"), ev(6, "order.applied"), ev(7, "order.applied")];
        let (take, cursor) = plan_queue(&[EventType::OrderApplied], &events, 2);
        assert_eq!(take.iter().map(|e| e.seq).collect::<Vec<_>>(), [4, 6]);
        assert_eq!(cursor, Some(6), "7 waits for room");
        let (take, cursor) = plan_queue(&[], &events, 0);
        assert!(take.is_empty());
        assert_eq!(cursor, None, "no room: the cursor stays before the first wanted event");
        let (take, cursor) = plan_queue(&[EventType::ResourceSoldOut], &events, 0);
        assert!(take.is_empty());
        assert_eq!(cursor, Some(4), "an unwanted event is done with even without room");
    }
}

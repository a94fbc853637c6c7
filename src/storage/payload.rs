//! Stored JSON kept compact: an event's `data` and an idempotency record's `response_body` are
//! written deflated against a fixed dictionary of their skeleton (field names and common values,
//! no keys or ids), as text, since the columns are text on every backend. A one-line order's
//! answer of ~240 bytes is stored in ~30, a five-line one of ~640 in ~125
//! (docs/PERFORMANCE.md, "Answers and events stored deflated"). The encoder is
//! [`super::deflate_fixed`]; any inflater reads it, here zlib-rs's.
//!
//! The stored form is `~1` followed by the raw deflate stream in unpadded URL-safe base64. JSON
//! never starts with `~`, so every value written before, plain JSON, still reads as itself, and
//! a value deflate would not shrink is stored plain. Reading inflates the exact bytes that were
//! written: a replay stays byte-identical.
//!
//! The dictionary of version 1 is fixed for as long as a value written with it may be stored;
//! a better one is version 2, beside it.

use std::borrow::Cow;
use std::cell::RefCell;

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use flate2::{Decompress, FlushDecompress, Status};

use super::deflate_fixed::{self, Dictionary};
use super::StorageError;

/// The prefix of a value stored deflated with [`DICTIONARY_V1`].
const MARK_V1: &str = "~1";

/// The largest value inflated (a `MEDIUMTEXT`'s 16 MiB): a stored value that claims more is
/// corrupt, not an answer.
const MAX_INFLATED: usize = 16 << 20;

/// Version 1's dictionary: the skeletons of what is stored, the most frequent last (deflate
/// codes nearer matches in fewer bits). Never edit it (see the module's documentation); the test
/// `the_dictionary_of_version_1_never_changes` holds its checksum.
pub const DICTIONARY_V1: &str = concat!(
    r#"{"type":"https://stockd.dev/errors/","title":"","status":409,"code":"","detail":""}"#,
    r#"{"key":"","bucket":0,"expected":0,"actual":0}"#,
    r#"{"key":"","request_id":"","order_id":"","idempotency_key":"","qty":1,"reason":"insufficient","available":0}"#,
    r#"{"key":"","available":0,"low_stock":10}"#,
    r#"{"reversal_id":"rev_01K","order_id":"","reason":null,"lines":[{"key":"","resource":"","qty":1,"reversed":1}]}"#,
    r#"{"reservation_id":"rsv_01K","order_id":"","state":"held","expires_at":"2026-12-01T00:00:00.000Z","lines":[{"key":"","resource":"","qty":1,"buckets":[0]}]}"#,
    r#"{"state":"confirmed","state":"released","state":"expired","#,
    r#""status":"rejected","reason":"insufficient"},"status":"rejected","reason":"resource_not_found"},"#,
    r#""status":"skipped","reason":"skipped"},"status":"rejected","reason":"limit_exceeded"},"#,
    r#"{"order_id":"","status":"partial","action":"reserve","reservation_id":"rsv_01K","expires_at":"2026-12-01T00:00:00Z","#,
    r#""plugin":{"name":"wasm","version":1}}"#,
    r#"{"order_id":"ORD-","status":"succeeded","action":"deduct","reservation_id":null,"expires_at":null,"lines":["#,
    r#"{"key":"sku-","resource":"sku-","qty":1,"applied":1,"status":"applied","reason":null},"#,
    r#"{"key":"sku-","resource":"sku-","qty":1,"applied":1,"status":"applied","reason":null}],"#,
    r#""plugin":{"name":"default","version":0}}"#,
);

static DICTIONARY: Dictionary = Dictionary::new(DICTIONARY_V1.as_bytes());

thread_local! {
    static INFLATE: RefCell<Decompress> = RefCell::new(Decompress::new(false));
}

/// The stored form of `json`: deflated, or `json` itself where that is not shorter. A value that
/// starts with `~` (never JSON, but the columns take any text) is always stored deflated, so that
/// it never reads back as a mark.
pub fn pack(json: &str) -> Cow<'_, str> {
    let deflated = deflate_fixed::deflate(&DICTIONARY, json.as_bytes());
    let encoded = MARK_V1.len() + (deflated.len() * 4).div_ceil(3);
    if encoded >= json.len() && !json.starts_with('~') {
        return Cow::Borrowed(json);
    }
    let mut stored = String::with_capacity(encoded);
    stored.push_str(MARK_V1);
    URL_SAFE_NO_PAD.encode_string(&deflated, &mut stored);
    Cow::Owned(stored)
}

/// The JSON a stored value holds: inflated if it was stored deflated, else the value itself.
pub fn unpack(stored: String) -> Result<String, StorageError> {
    let Some(encoded) = stored.strip_prefix(MARK_V1) else {
        return Ok(stored);
    };
    let deflated = URL_SAFE_NO_PAD.decode(encoded).map_err(|_| corrupt())?;
    let inflated = INFLATE
        .try_with(|i| inflate(&mut i.borrow_mut(), &deflated))
        .map_err(|_| StorageError::Internal("no inflater on this thread".into()))??;
    String::from_utf8(inflated).map_err(|_| corrupt())
}

fn inflate(i: &mut Decompress, deflated: &[u8]) -> Result<Vec<u8>, StorageError> {
    i.reset(false);
    i.set_dictionary(DICTIONARY_V1.as_bytes()).map_err(|_| corrupt())?;
    let mut out = Vec::with_capacity(deflated.len() * 8);
    loop {
        let read = usize::try_from(i.total_in()).map_err(|_| corrupt())?;
        let input = deflated.get(read..).ok_or_else(corrupt)?;
        match i.decompress_vec(input, &mut out, FlushDecompress::Finish).map_err(|_| corrupt())? {
            Status::StreamEnd => return Ok(out),
            // Out of room: grow, unless the value is past any stored one. With room left and
            // no end, the input ran out: a truncated stream.
            Status::Ok | Status::BufError if out.len() == out.capacity() && out.len() < MAX_INFLATED => {
                out.reserve(out.capacity().max(1024))
            }
            _ => return Err(corrupt()),
        }
    }
}

fn corrupt() -> StorageError {
    StorageError::Internal("unexpected stored value: a deflated payload that does not inflate".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one_line(n: u32) -> String {
        format!(
            r#"{{"order_id":"ORD-{n}","status":"succeeded","action":"deduct","reservation_id":null,"expires_at":null,"lines":[{{"key":"sku-{n}","resource":"sku-{n}","qty":1,"applied":1,"status":"applied","reason":null}}],"plugin":{{"name":"default","version":0}}}}"#
        )
    }

    #[test]
    fn a_packed_value_unpacks_to_its_exact_bytes() {
        for json in [one_line(7), one_line(123_456), r#"{"key":"sku-1","available":0}"#.to_string(), "{}".into()] {
            let packed = pack(&json).into_owned();
            assert_eq!(unpack(packed).unwrap(), json);
        }
    }

    #[test]
    fn an_answer_is_stored_in_a_fraction_of_its_size() {
        let json = one_line(42);
        let packed = pack(&json);
        assert!(packed.starts_with(MARK_V1), "{packed}");
        assert!(packed.len() * 3 < json.len(), "{} -> {} bytes", json.len(), packed.len());
    }

    #[test]
    fn plain_json_stored_before_reads_as_itself() {
        for plain in ["{}", r#"{"a":1}"#, "[1]", "", "~"] {
            assert_eq!(unpack(plain.to_string()).unwrap(), plain);
        }
        // Not shorter deflated: stored plain.
        assert!(matches!(pack("{}"), Cow::Borrowed("{}")));
    }

    #[test]
    fn a_value_that_starts_like_a_mark_round_trips() {
        // Stored plain, "~1" read back as an empty deflated stream: an error, not the value.
        for text in ["~1", "~", "~1AAAA", "~2{}"] {
            assert_eq!(unpack(pack(text).into_owned()).unwrap(), text);
        }
    }

    #[test]
    fn a_damaged_value_is_an_error_not_an_answer() {
        let mut packed = pack(&one_line(1)).into_owned();
        packed.truncate(packed.len() - 6);
        assert!(unpack(packed).is_err());
        assert!(unpack("~1!!!".into()).is_err());
        assert!(unpack("~1AAAA".into()).is_err());
    }

    #[test]
    fn a_large_value_round_trips() {
        let lines: Vec<String> = (0..1000)
            .map(|i| {
                format!(
                    r#"{{"key":"k-{i}","resource":"r-{i}","qty":{i},"applied":{i},"status":"applied","reason":null}}"#
                )
            })
            .collect();
        let json = format!(r#"{{"lines":[{}]}}"#, lines.join(","));
        let packed = pack(&json).into_owned();
        assert!(packed.len() < json.len() / 3);
        assert!(unpack(packed).unwrap() == json, "{} bytes round trip", json.len());
    }

    #[test]
    fn a_value_longer_than_the_window_round_trips() {
        // Matches may not reach past 32 KiB back, into the dictionary or the value.
        let filler: String = (0..40_000u32).map(|i| char::from(b'a' + ((i * 7919) % 26) as u8)).collect();
        for json in [format!(r#"{{"key":"{filler}","status":"applied"}}"#), format!("{filler}{filler}")] {
            assert!(unpack(pack(&json).into_owned()).unwrap() == json, "{} bytes round trip", json.len());
        }
    }

    proptest::proptest! {
        #[test]
        fn any_text_round_trips(text in "\\PC{0,600}") {
            proptest::prop_assert_eq!(unpack(pack(&text).into_owned()).unwrap(), text);
        }

        #[test]
        fn answers_round_trip(lines in proptest::collection::vec(("[a-z0-9-]{1,12}", 0i64..1_000_000, 0usize..4), 0..40)) {
            let statuses = ["applied", "rejected", "skipped", "\u{e9}\"\\"];
            let lines: Vec<String> = lines
                .iter()
                .map(|(key, qty, s)| format!(
                    r#"{{"key":"{key}","resource":"{key}","qty":{qty},"applied":{qty},"status":"{}","reason":null}}"#,
                    statuses[*s]
                ))
                .collect();
            let json = format!(r#"{{"order_id":"ORD-1","lines":[{}],"plugin":{{"name":"default","version":0}}}}"#, lines.join(","));
            proptest::prop_assert_eq!(unpack(pack(&json).into_owned()).unwrap(), json);
        }
    }

    #[test]
    fn the_dictionary_of_version_1_never_changes() {
        // Values stored deflated with it inflate only with these exact bytes.
        use sha2::Digest as _;
        let digest = hex::encode(sha2::Sha256::digest(DICTIONARY_V1.as_bytes()));
        assert_eq!((DICTIONARY_V1.len(), &digest[..16]), (1250, "6db6b50e30b99248"));
    }
}

-- From this version on an event's `data` and an idempotency record's `response_body` are stored
-- packed (src/storage/payload.rs): plain JSON as before, or `~1` and the JSON deflated against a
-- fixed dictionary, in URL-safe base64. Nothing is rewritten: both forms read back. This
-- migration only records the format, so that a binary of an older version, which would serve
-- a packed answer as it is, refuses to start on this database (an unknown migration).
COMMENT ON COLUMN events.data IS 'JSON, or ~1 and the JSON deflated against dictionary 1 in URL-safe base64 (src/storage/payload.rs)';
COMMENT ON COLUMN idempotency.response_body IS 'JSON, or ~1 and the JSON deflated against dictionary 1 in URL-safe base64 (src/storage/payload.rs)';

-- An applied order's answer is stored once: it is the `order.applied` event's `data`, byte for
-- byte, so its idempotency record keeps only the event's id (`response_event`) and a replay reads
-- the body from there. Every other record (refusals, reversals, adjustments, ...) still keeps its
-- body inline; a claimed record not yet answered has neither. The events purge keeps an event as
-- long as a record may still point at it (docs/EVENTS.md, "Retention").
ALTER TABLE idempotency ADD COLUMN response_event TEXT;
ALTER TABLE idempotency ADD CONSTRAINT idempotency_one_body CHECK (response_body IS NULL OR response_event IS NULL);

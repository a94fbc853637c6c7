-- The transactional outbox (docs/EVENTS.md). Every committed change that matters writes its
-- event here in the same transaction as the change, so nothing committed is lost and nothing
-- rolled back is ever seen. Delivery (the feed, webhooks, the broker sink) reads from here.
--
-- `seq` is the tenant's own monotonic sequence. A transaction inserts its events with seq NULL
-- and numbers them (found by id) just before COMMIT (src/storage/postgres/events.rs), holding the tenant's
-- `event_seqs` row until then: tenants' transactions commit their events in sequence order, so a
-- reader paging `seq > after` never skips one that commits later with a lower number. Committed
-- rows always have a seq; only the writing transaction ever sees a NULL.
CREATE TABLE events (
    id            TEXT PRIMARY KEY,            -- evt_<ULID>, globally unique
    tenant_id     TEXT NOT NULL,
    seq           BIGINT,
    type          TEXT NOT NULL,
    ordering_key  TEXT NOT NULL,               -- deliveries keep seq order per ordering key
    at            BIGINT NOT NULL,             -- Unix ms of the change
    data          TEXT NOT NULL                -- the payload, a JSON object
);
CREATE UNIQUE INDEX events_feed ON events (tenant_id, seq);
CREATE INDEX events_by_age ON events (at);

CREATE TABLE event_seqs (
    tenant_id  TEXT PRIMARY KEY,
    last       BIGINT NOT NULL CHECK (last >= 0)
);

-- Stock signals: `low_stock` is the threshold set on create or PATCH (NULL: none); `stock` is
-- the band the resource was last seen in ('out': available 0, 'low': at or under the threshold,
-- 'ok': above it). A write that moves a resource to another band emits resource.sold_out,
-- resource.restocked or resource.low_stock and stores the new band with it.
ALTER TABLE resources ADD COLUMN low_stock BIGINT CHECK (low_stock IS NULL OR low_stock >= 0);
ALTER TABLE resources ADD COLUMN stock TEXT NOT NULL DEFAULT 'ok' CHECK (stock IN ('ok', 'low', 'out'));
UPDATE resources r SET stock = 'out'
 WHERE (r.buckets = 1 AND r.available = 0)
    OR (r.buckets > 1 AND NOT EXISTS (SELECT 1 FROM resource_buckets b
          WHERE b.tenant_id = r.tenant_id AND b.resource_key = r.key AND b.available > 0));

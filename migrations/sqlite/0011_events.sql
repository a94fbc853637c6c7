-- The transactional outbox (docs/EVENTS.md). Every committed change that matters writes its
-- event here in the same transaction as the change, so nothing committed is lost and nothing
-- rolled back is ever seen. Delivery (the feed, webhooks, the broker sink) reads from here.
--
-- `seq` is the tenant's own monotonic sequence. SQLite has a single writer, so each event is
-- numbered as it is written (from `event_seqs`, in the same savepoint as the change): committed
-- rows always have a seq, in commit order. The column may be NULL only to share the schema of the
-- PostgreSQL backend, which numbers a transaction's events just before its COMMIT.
CREATE TABLE events (
    id            TEXT PRIMARY KEY,            -- evt_<ULID>, globally unique
    tenant_id     TEXT NOT NULL,
    seq           INTEGER,
    type          TEXT NOT NULL,
    ordering_key  TEXT NOT NULL,               -- deliveries keep seq order per ordering key
    at            INTEGER NOT NULL,             -- Unix ms of the change
    data          TEXT NOT NULL                -- the payload, a JSON object
);
CREATE UNIQUE INDEX events_feed ON events (tenant_id, seq);
CREATE INDEX events_by_age ON events (at);

CREATE TABLE event_seqs (
    tenant_id  TEXT PRIMARY KEY,
    last       INTEGER NOT NULL CHECK (last >= 0)
);

-- Stock signals: `low_stock` is the threshold set on create or PATCH (NULL: none); `stock` is
-- the band the resource was last seen in ('out': available 0, 'low': at or under the threshold,
-- 'ok': above it). A write that moves a resource to another band emits resource.sold_out,
-- resource.restocked or resource.low_stock and stores the new band with it.
ALTER TABLE resources ADD COLUMN low_stock INTEGER CHECK (low_stock IS NULL OR low_stock >= 0);
ALTER TABLE resources ADD COLUMN stock TEXT NOT NULL DEFAULT 'ok' CHECK (stock IN ('ok', 'low', 'out'));
UPDATE resources AS r SET stock = 'out'
 WHERE (r.buckets = 1 AND r.available = 0)
    OR (r.buckets > 1 AND NOT EXISTS (SELECT 1 FROM resource_buckets b
          WHERE b.tenant_id = r.tenant_id AND b.resource_key = r.key AND b.available > 0));

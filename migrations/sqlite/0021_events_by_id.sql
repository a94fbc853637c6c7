-- Events are kept in the order of the feed and purged by their ids. An event's id is `evt_` and
-- a ULID, whose text sorts by the millisecond it was made; the purge deletes events whose id and
-- `at` are both older than the retention, walking the ids from the oldest
-- (src/storage/sqlite/ops.rs, `purge_events`). So `events_by_age` goes, and the table becomes the
-- feed's index, `(tenant_id, seq)` (WITHOUT ROWID; the writer numbers every event as it inserts
-- it): two b-trees an event where there were four (the rowid table, its index by id, the feed's,
-- the one by age), for every event written and in bytes on disk, and the feed is read from the
-- table itself.
--
-- The table is rebuilt with its rows (on a large database this migration takes as long as
-- copying `events` once).
CREATE TABLE events_new (
    id            TEXT NOT NULL,               -- evt_<ULID>, globally unique, sorts by the time it was made
    tenant_id     TEXT NOT NULL,
    seq           INTEGER NOT NULL,            -- the tenant's own sequence
    type          TEXT NOT NULL,
    ordering_key  TEXT NOT NULL,               -- deliveries keep seq order per ordering key
    at            INTEGER NOT NULL,            -- Unix ms of the change
    data          TEXT NOT NULL,               -- the payload (src/storage/payload.rs)
    PRIMARY KEY (tenant_id, seq)
) WITHOUT ROWID;
INSERT INTO events_new (id, tenant_id, seq, type, ordering_key, at, data)
SELECT id, tenant_id, seq, type, ordering_key, at, data FROM events;
DROP TABLE events;
ALTER TABLE events_new RENAME TO events;
CREATE UNIQUE INDEX events_by_id ON events (id);

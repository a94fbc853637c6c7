-- Where each broker sink of the outbox stands with each tenant (docs/NATS.md): the last
-- sequence number it delivered. A sink publishes a tenant's events after `last_seq`, waits for
-- the broker's acknowledgements, then moves `last_seq` forward over the acknowledged prefix, so
-- a crash between the two republishes (the broker drops the duplicates by event id). The row is
-- created at the sink's first visit; a tenant without one is at 0.
CREATE TABLE event_sink_cursors (
    sink       TEXT NOT NULL,              -- the sink's name ('nats')
    tenant_id  TEXT NOT NULL,
    last_seq   INTEGER NOT NULL CHECK (last_seq >= 0),
    PRIMARY KEY (sink, tenant_id)
);

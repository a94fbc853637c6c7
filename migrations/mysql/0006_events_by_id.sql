-- Events are purged in the order of their ids, not by `at`: an event's id is `evt_` and a
-- ULID, whose text sorts by the millisecond it was made, and the purge deletes events whose id
-- and `at` are both older than the retention, walking the primary key (the table itself in
-- InnoDB) from the oldest id (src/storage/mysql/mod.rs, `purge_events`). `events_by_age` goes:
-- one index fewer on every event written.
DROP INDEX events_by_age ON events;

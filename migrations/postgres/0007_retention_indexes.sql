-- The retention purges (src/jobs/mod.rs) delete the oldest rows of these tables in bounded
-- batches; without an index on the time each batch would scan the whole table.
CREATE INDEX redis_settled_by_at ON redis_settled (at);
CREATE INDEX settlement_failures_by_at ON settlement_failures (at);

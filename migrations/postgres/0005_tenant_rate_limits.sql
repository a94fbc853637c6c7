-- A tenant's own request rate (src/ratelimit.rs): tokens per second (0: no limit) and the
-- bucket's size. Both NULL: the server's [rate_limits] default. Read with each API key, so a
-- change reaches every process within [auth] cache_ttl_ms.
ALTER TABLE tenants ADD COLUMN rate_limit_rps BIGINT CHECK (rate_limit_rps >= 0);
ALTER TABLE tenants ADD COLUMN rate_limit_burst BIGINT CHECK (rate_limit_burst >= 0);
ALTER TABLE tenants ADD CONSTRAINT tenants_rate_limit_pair
    CHECK ((rate_limit_burst IS NULL) = (rate_limit_rps IS NULL));

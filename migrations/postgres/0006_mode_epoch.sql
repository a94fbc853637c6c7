-- Redis mode is fenced by epochs (docs/REDIS.md, "Fencing"): every warm, switch and adjustment
-- of a redis-mode resource first takes a new epoch here, then closes Redis under it; Redis
-- refuses to load or forget under an older one, and a load opens sales only after the database
-- was read again at the same epoch. So a process with a stale view can never put stock back
-- into Redis for a resource the database has moved on from.
ALTER TABLE resources ADD COLUMN mode_epoch BIGINT NOT NULL DEFAULT 0 CHECK (mode_epoch >= 0);

-- The naive hot-key design, as a pgbench script: one transaction per request that reads the
-- row under a lock, checks in the application, then writes it and a ledger row. Run against a
-- database prepared by pg-row-lock-setup.sql:
--   pgbench -n -c 64 -j 2 -T 10 -f scripts/bench/pg-row-lock.sql postgres://...
BEGIN;
SELECT available FROM naive_stock WHERE key = 'hot' FOR UPDATE;
UPDATE naive_stock SET available = available - 1, consumed = consumed + 1 WHERE key = 'hot';
INSERT INTO naive_ledger (key, qty, at) VALUES ('hot', 1, now());
COMMIT;

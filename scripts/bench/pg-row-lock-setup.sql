-- Tables for pg-row-lock.sql (the naive SELECT ... FOR UPDATE baseline).
DROP TABLE IF EXISTS naive_stock, naive_ledger;
CREATE TABLE naive_stock (key TEXT PRIMARY KEY, available BIGINT NOT NULL CHECK (available >= 0), consumed BIGINT NOT NULL);
CREATE TABLE naive_ledger (seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, key TEXT NOT NULL, qty BIGINT NOT NULL, at TIMESTAMPTZ NOT NULL);
INSERT INTO naive_stock VALUES ('hot', 1000000000, 0);

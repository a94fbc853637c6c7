#!/usr/bin/env python3
"""Bytes and write work per order of the stored layout against two proposed ones and a floor,
measured on the rows a real bench run wrote (docs/PERFORMANCE.md, "Toward 300 bytes an order:
layouts measured on a bench run's rows").

Usage: schema-trial.py SOURCE_DB [BATCH] [--rounds R] [--synchronous off|full] [--postgres URL]
                       [--mysql mysql://USER@HOST:PORT]

SOURCE_DB: a SQLite database a `stockd bench` scenario wrote (`storage-breakdown.py BIN sqlite
SCENARIO 5 --keep DIR` keeps it as DIR/stockd.db). Its applied orders (an `order.applied` event,
the idempotency record that points at it, the ledger entries of its order) are copied, in the
order they were committed, BATCH orders a transaction (default 26, a `hot-key` batch), into a
fresh database for each layout:

- `stored`: the tables and indexes as migrations 0001-0021 left them (their CHECK constraints
  left out; SQLite's 0022, which finds an order whose id is its key through its record instead
  of `ledger_by_order`, and PostgreSQL's 0022, which keys that index by a 64-bit hash of tenant
  and order id, came after these figures and are not in it);
- `compact`: the same rows and indexes, with compact columns: a tenant number instead of its
  text id, ids and the request hash as bytes instead of text, types and ops as numbers, the
  answer's deflate stream as bytes instead of base64, and a column that only repeats another
  left NULL (the event's ordering key `order:<order id>`, a line's key when it is its resource's);
- `actions`: one record an action. The idempotency record and the event become one row keyed by
  the tenant's event sequence (its feed, in the order the purge walks: no age index; the event's
  id derived from it: no id index), found by its idempotency key through an index. Its order id
  is stored, and indexed, only where it differs from that key: an order is found by its id as
  `(key = id AND order_id IS NULL) OR order_id = id`, through the two indexes. A ledger entry
  keeps its row, clustered by (tenant, resource, seq), and the design's identity as (tenant,
  action, op, resource, bucket): the action's sequence number stands for the request id and the
  order id, and its time for the entry's;
- `floor`: the `actions` row alone, with its lines packed into it (each line's resource key and
  numbers as varints) and its two indexes, and nothing a line (no ledger row, no identity, no
  b-tree by resource): not a design, but the least a store that finds an order by its
  idempotency key writes.

For each it prints the bytes per order of every b-tree (`dbstat`, pages in use), the WAL bytes
written per order, and the CPU time per order of the loading process: SQLite in this process,
`synchronous = OFF`, the WAL checkpointed whenever it passes 10,000 pages as the server's writer
does (checkpoints included), each table's rows one `INSERT ... SELECT` a batch; and the wall
time of a commit's transaction (BEGIN to COMMIT, checkpoints not included). With `--synchronous
full` each commit waits for its fsync, as the server's default does (the commit's time is then
the writer's cycle without HTTP: its statements and its sync). With --rounds R each layout is loaded R times, the
layouts in turn, forward then backward, and every round's CPU time is printed. With --postgres
URL the same layouts are loaded into a scratch PostgreSQL database on that server (one
transaction a batch, from a procedure; `synchronous_commit = off`) and their relations sized
with `pg_relation_size`. With --mysql the same on a MySQL/MariaDB server (a scratch database a
layout, one transaction a batch from a procedure, each commit flushed as the server's default
says), sized by InnoDB's leaf pages (`n_leaf_pages` after `ANALYZE TABLE`). Needs the `sqlite3`
command-line client, and `psql` or `mariadb`/`mysql` for those."""
import base64, collections, os, re, shutil, sqlite3, subprocess, sys, tempfile, time

LAYOUTS = ("stored", "compact", "actions", "floor")
CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
TYPES = {"order.applied": 1}
OPS = {"create": 1, "adjust": 2, "deduct": 3, "reserve": 4, "confirm": 5, "release": 6, "expire": 7, "reverse": 8}


def ulid_bytes(text):
    """`evt_...`/`req_...` ULID text as its 16 bytes."""
    body = text.split("_", 1)[1]
    n = 0
    for c in body:
        n = n * 32 + CROCKFORD.index(c)
    return n.to_bytes(16, "big")


def payload_bytes(text):
    """A stored payload's deflate stream as bytes (`~1` + unpadded URL-safe base64), else its JSON."""
    if text.startswith("~1"):
        b64 = text[2:]
        return base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4))
    return text.encode()


STAGE = """
CREATE TABLE orders (n INTEGER PRIMARY KEY, tenant_id TEXT, tenant_no INTEGER, seq INTEGER, evt_id TEXT,
    evt_blob BLOB, type TEXT, type_no INTEGER, ordering_key TEXT, ordering_compact TEXT, at INTEGER,
    data TEXT, data_blob BLOB, key TEXT, request_hash TEXT, hash_blob BLOB, code INTEGER, rtype TEXT,
    rtype_no INTEGER, created_at INTEGER, order_id TEXT, order_compact TEXT, lines_blob BLOB);
CREATE TABLE lines (n INTEGER, lseq INTEGER PRIMARY KEY, tenant_id TEXT, tenant_no INTEGER, resource_key TEXT,
    bucket INTEGER, op TEXT, op_no INTEGER, qty INTEGER, request_id TEXT, req_blob BLOB, order_id TEXT,
    reservation_id TEXT, available_after INTEGER, reserved_after INTEGER, consumed_after INTEGER,
    version_after INTEGER, plugin_version INTEGER, at INTEGER, line_key TEXT, line_compact TEXT,
    limit_key TEXT, reverses TEXT, action_seq INTEGER);
CREATE INDEX lines_by_n ON lines (n);
"""

SQLITE_LAYOUTS = {
    "stored": """
CREATE TABLE ledger (seq INTEGER PRIMARY KEY, tenant_id TEXT NOT NULL, resource_key TEXT NOT NULL,
    bucket INTEGER NOT NULL DEFAULT 0, op TEXT NOT NULL, qty INTEGER NOT NULL, request_id TEXT NOT NULL,
    order_id TEXT, reservation_id TEXT, available_after INTEGER NOT NULL, reserved_after INTEGER NOT NULL,
    consumed_after INTEGER NOT NULL, version_after INTEGER NOT NULL, plugin_version INTEGER,
    at INTEGER NOT NULL, line_key TEXT, limit_key TEXT, reverses TEXT);
CREATE UNIQUE INDEX ledger_identity ON ledger (tenant_id, request_id, op, resource_key, bucket);
CREATE INDEX ledger_by_resource ON ledger (tenant_id, resource_key, seq);
CREATE INDEX ledger_by_order ON ledger (tenant_id, order_id) WHERE order_id IS NOT NULL;
CREATE TABLE idempotency (tenant_id TEXT NOT NULL, key TEXT NOT NULL, request_hash TEXT NOT NULL,
    response_code INTEGER NOT NULL, response_type TEXT NOT NULL, response_body TEXT, response_event TEXT,
    created_at INTEGER NOT NULL, PRIMARY KEY (tenant_id, key)) WITHOUT ROWID;
CREATE INDEX idempotency_by_age ON idempotency (created_at);
CREATE TABLE events (id TEXT NOT NULL, tenant_id TEXT NOT NULL, seq INTEGER NOT NULL, type TEXT NOT NULL,
    ordering_key TEXT NOT NULL, at INTEGER NOT NULL, data TEXT NOT NULL,
    PRIMARY KEY (tenant_id, seq)) WITHOUT ROWID;
CREATE UNIQUE INDEX events_by_id ON events (id);
""",
    "compact": """
CREATE TABLE ledger (seq INTEGER PRIMARY KEY, tenant_no INTEGER NOT NULL, resource_key TEXT NOT NULL,
    bucket INTEGER NOT NULL DEFAULT 0, op INTEGER NOT NULL, qty INTEGER NOT NULL, request_id BLOB NOT NULL,
    order_id TEXT, reservation_id BLOB, available_after INTEGER NOT NULL, reserved_after INTEGER NOT NULL,
    consumed_after INTEGER NOT NULL, version_after INTEGER NOT NULL, plugin_version INTEGER,
    at INTEGER NOT NULL, line_key TEXT, limit_key TEXT, reverses BLOB);
CREATE UNIQUE INDEX ledger_identity ON ledger (tenant_no, request_id, op, resource_key, bucket);
CREATE INDEX ledger_by_resource ON ledger (tenant_no, resource_key, seq);
CREATE INDEX ledger_by_order ON ledger (tenant_no, order_id) WHERE order_id IS NOT NULL;
CREATE TABLE idempotency (tenant_no INTEGER NOT NULL, key TEXT NOT NULL, request_hash BLOB NOT NULL,
    response_code INTEGER NOT NULL, response_type INTEGER, response_body BLOB, response_event INTEGER,
    created_at INTEGER NOT NULL, PRIMARY KEY (tenant_no, key)) WITHOUT ROWID;
CREATE INDEX idempotency_by_age ON idempotency (created_at);
CREATE TABLE events (id BLOB NOT NULL, tenant_no INTEGER NOT NULL, seq INTEGER NOT NULL, type INTEGER NOT NULL,
    ordering_key TEXT, at INTEGER NOT NULL, data BLOB NOT NULL, PRIMARY KEY (tenant_no, seq)) WITHOUT ROWID;
CREATE UNIQUE INDEX events_by_id ON events (id);
""",
    "actions": """
CREATE TABLE actions (tenant_no INTEGER NOT NULL, seq INTEGER NOT NULL, key TEXT, request_hash BLOB,
    order_id TEXT, type INTEGER NOT NULL, code INTEGER NOT NULL, at INTEGER NOT NULL, data BLOB NOT NULL,
    PRIMARY KEY (tenant_no, seq)) WITHOUT ROWID;
CREATE UNIQUE INDEX actions_by_key ON actions (tenant_no, key) WHERE key IS NOT NULL;
CREATE INDEX actions_by_order ON actions (tenant_no, order_id) WHERE order_id IS NOT NULL;
CREATE TABLE ledger (tenant_no INTEGER NOT NULL, resource_key TEXT NOT NULL, seq INTEGER NOT NULL,
    bucket INTEGER NOT NULL DEFAULT 0, op INTEGER NOT NULL, qty INTEGER NOT NULL, action_seq INTEGER NOT NULL,
    reservation_id BLOB, available_after INTEGER NOT NULL, reserved_after INTEGER NOT NULL,
    consumed_after INTEGER NOT NULL, version_after INTEGER NOT NULL, plugin_version INTEGER,
    line_key TEXT, limit_key TEXT, reverses BLOB, PRIMARY KEY (tenant_no, resource_key, seq)) WITHOUT ROWID;
CREATE UNIQUE INDEX ledger_identity ON ledger (tenant_no, action_seq, op, resource_key, bucket);
""",
    "floor": """
CREATE TABLE actions (tenant_no INTEGER NOT NULL, seq INTEGER NOT NULL, key TEXT, request_hash BLOB,
    order_id TEXT, type INTEGER NOT NULL, code INTEGER NOT NULL, at INTEGER NOT NULL, data BLOB NOT NULL,
    lines BLOB, PRIMARY KEY (tenant_no, seq)) WITHOUT ROWID;
CREATE UNIQUE INDEX actions_by_key ON actions (tenant_no, key) WHERE key IS NOT NULL;
CREATE INDEX actions_by_order ON actions (tenant_no, order_id) WHERE order_id IS NOT NULL;
""",
}

# One batch's statements per layout; ?1 and ?2 bound to the batch's first and last `n`.
SQLITE_LOADS = {
    "stored": [
        """INSERT INTO events SELECT evt_id, tenant_id, seq, type, ordering_key, at, data
           FROM s.orders WHERE n BETWEEN ?1 AND ?2""",
        """INSERT INTO idempotency SELECT tenant_id, key, request_hash, code, rtype, NULL, evt_id, created_at
           FROM s.orders WHERE n BETWEEN ?1 AND ?2""",
        """INSERT INTO ledger SELECT lseq, tenant_id, resource_key, bucket, op, qty, request_id, order_id,
           reservation_id, available_after, reserved_after, consumed_after, version_after, plugin_version, at,
           line_key, limit_key, reverses FROM s.lines WHERE n BETWEEN ?1 AND ?2 ORDER BY lseq""",
    ],
    "compact": [
        """INSERT INTO events SELECT evt_blob, tenant_no, seq, type_no, ordering_compact, at, data_blob
           FROM s.orders WHERE n BETWEEN ?1 AND ?2""",
        """INSERT INTO idempotency SELECT tenant_no, key, hash_blob, code, rtype_no, NULL, seq, created_at
           FROM s.orders WHERE n BETWEEN ?1 AND ?2""",
        """INSERT INTO ledger SELECT lseq, tenant_no, resource_key, bucket, op_no, qty, req_blob, order_id,
           reservation_id, available_after, reserved_after, consumed_after, version_after, plugin_version, at,
           line_compact, limit_key, reverses FROM s.lines WHERE n BETWEEN ?1 AND ?2 ORDER BY lseq""",
    ],
    "actions": [
        """INSERT INTO actions SELECT tenant_no, seq, key, hash_blob, order_compact, type_no, code, at, data_blob
           FROM s.orders WHERE n BETWEEN ?1 AND ?2""",
        """INSERT INTO ledger SELECT tenant_no, resource_key, lseq, bucket, op_no, qty, action_seq,
           reservation_id, available_after, reserved_after, consumed_after, version_after, plugin_version,
           line_compact, limit_key, reverses FROM s.lines WHERE n BETWEEN ?1 AND ?2 ORDER BY lseq""",
    ],
    "floor": [
        """INSERT INTO actions SELECT tenant_no, seq, key, hash_blob, order_compact, type_no, code, at, data_blob,
           lines_blob FROM s.orders WHERE n BETWEEN ?1 AND ?2""",
    ],
}


def varint(v):
    """LEB128, for the `floor` layout's packed lines."""
    out = bytearray()
    while True:
        out.append((v & 0x7F) | (0x80 if v > 0x7F else 0))
        v >>= 7
        if not v:
            return bytes(out)


def stage(source, path):
    """Copies the source's applied orders, with every compact form computed, into `path`."""
    src = sqlite3.connect(f"file:{source}?mode=ro", uri=True)
    dst = sqlite3.connect(path)
    dst.executescript(STAGE)
    tenants = {}
    records = {(tenant, evt): rest for tenant, evt, *rest in src.execute(
        """SELECT tenant_id, response_event, key, request_hash, response_code, response_type, created_at
           FROM idempotency WHERE response_event IS NOT NULL""")}
    orders = [(tenant, seq, evt, typ, okey, at, data, *records[(tenant, evt)])
              for tenant, seq, evt, typ, okey, at, data in src.execute(
                  """SELECT tenant_id, seq, id, type, ordering_key, at, data FROM events
                     WHERE type = 'order.applied' ORDER BY tenant_id, seq""")
              if (tenant, evt) in records]
    by_key = {}
    for n, (tenant, seq, evt, typ, okey, at, data, key, rhash, code, rtype, created) in enumerate(orders, 1):
        tno = tenants.setdefault(tenant, len(tenants) + 1)
        # The bench's order id is its idempotency key; an order id is read from its event's
        # ordering key (`order:<order id>`) so that the trial does not depend on it.
        order_id = okey.split(":", 1)[1] if okey.startswith("order:") else None
        by_key[(tenant, order_id)] = (n, seq)
        dst.execute("INSERT INTO orders VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,NULL)",
                    (n, tenant, tno, seq, evt, ulid_bytes(evt), typ, TYPES.get(typ, 99), okey,
                     None if okey == f"order:{order_id}" else okey, at, data, payload_bytes(data), key, rhash,
                     bytes.fromhex(rhash), code, rtype, None if rtype == "json" else 1, created, order_id,
                     None if order_id == key else order_id))
    for row in src.execute(
            """SELECT seq, tenant_id, resource_key, bucket, op, qty, request_id, order_id, reservation_id,
                      available_after, reserved_after, consumed_after, version_after, plugin_version, at,
                      line_key, limit_key, reverses FROM ledger WHERE order_id IS NOT NULL ORDER BY seq"""):
        (lseq, tenant, rkey, bucket, op, qty, req, order_id, rsv, av, rs, co, ver, pv, at, lkey, limk, rev) = row
        if (tenant, order_id) not in by_key:
            continue
        n, aseq = by_key[(tenant, order_id)]
        dst.execute("INSERT INTO lines VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    (n, lseq, tenant, tenants[tenant], rkey, bucket, op, OPS[op], qty, req, ulid_bytes(req),
                     order_id, rsv, av, rs, co, ver, pv, at, lkey, None if lkey == rkey else lkey, limk, rev,
                     aseq))
    packed = collections.defaultdict(bytearray)
    for n, rkey, bucket, op_no, qty, av, rs, co, ver, pv in dst.execute(
            """SELECT n, resource_key, bucket, op_no, qty, available_after, reserved_after, consumed_after,
                      version_after, plugin_version FROM lines ORDER BY lseq""").fetchall():
        key = rkey.encode()
        packed[n] += varint(len(key)) + key
        for v in (bucket, op_no, qty, av, rs, co, ver, pv or 0):
            packed[n] += varint((v << 1) ^ (v >> 63))
    dst.executemany("UPDATE orders SET lines_blob = ? WHERE n = ?", [(bytes(b), n) for n, b in packed.items()])
    dst.commit()
    lines = dst.execute("SELECT count(*) FROM lines").fetchone()[0]
    return len(orders), lines


def dbstat(path):
    out = subprocess.run(["sqlite3", path, "SELECT name, SUM(pgsize) FROM dbstat GROUP BY name"],
                         capture_output=True, text=True, check=True).stdout
    return {name: int(size) for name, size in (line.split("|") for line in out.splitlines())}


# As the server's writer (`writer::CHECKPOINT_PAGES`, 10,000 pages): a WAL let grow without
# bound makes every page lookup slower, the more so for the layout writing more frames.
CHECKPOINT_BYTES = 10_000 * 4096


def load_sqlite(layout, stage_path, work, orders, batch, synchronous):
    path = f"{work}/{layout}.db"
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode = WAL")
    db.execute(f"PRAGMA synchronous = {synchronous}")
    db.execute("PRAGMA wal_autocheckpoint = 0")
    db.executescript(SQLITE_LAYOUTS[layout])
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.execute(f"ATTACH 'file:{stage_path}?mode=ro' AS s")
    statements = SQLITE_LOADS[layout]
    wal, commit_secs = 0, 0.0
    cpu = time.process_time()
    for first in range(1, orders + 1, batch):
        start = time.perf_counter()
        db.execute("BEGIN IMMEDIATE")
        for sql in statements:
            db.execute(sql, (first, first + batch - 1))
        db.execute("COMMIT")
        commit_secs += time.perf_counter() - start
        size = os.path.getsize(f"{path}-wal")
        if size >= CHECKPOINT_BYTES:
            wal += size
            db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    cpu = time.process_time() - cpu
    wal += os.path.getsize(f"{path}-wal")
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()
    return dbstat(path), wal, cpu, commit_secs / -(-orders // batch)


PG_LAYOUTS = {
    "stored": """
CREATE TABLE ledger (seq BIGINT GENERATED BY DEFAULT AS IDENTITY, tenant_id TEXT NOT NULL,
    resource_key TEXT NOT NULL, bucket BIGINT NOT NULL DEFAULT 0, op TEXT NOT NULL, qty BIGINT NOT NULL,
    request_id TEXT NOT NULL, order_id TEXT, reservation_id TEXT, available_after BIGINT NOT NULL,
    reserved_after BIGINT NOT NULL, consumed_after BIGINT NOT NULL, version_after BIGINT NOT NULL,
    plugin_version BIGINT, at BIGINT NOT NULL, line_key TEXT, limit_key TEXT, reverses TEXT,
    CONSTRAINT ledger_by_resource PRIMARY KEY (tenant_id, resource_key, seq));
CREATE UNIQUE INDEX ledger_identity ON ledger (tenant_id, request_id, op, resource_key, bucket);
CREATE INDEX ledger_by_order ON ledger (tenant_id, order_id) WHERE order_id IS NOT NULL;
CREATE TABLE idempotency (tenant_id TEXT NOT NULL, key TEXT NOT NULL, request_hash TEXT NOT NULL,
    response_code INTEGER NOT NULL, response_type TEXT NOT NULL, response_body TEXT, response_event TEXT,
    created_at BIGINT NOT NULL, PRIMARY KEY (tenant_id, key));
CREATE INDEX idempotency_by_age ON idempotency (created_at);
CREATE TABLE events (id TEXT PRIMARY KEY, tenant_id TEXT NOT NULL, seq BIGINT NOT NULL, type TEXT NOT NULL,
    ordering_key TEXT NOT NULL, at BIGINT NOT NULL, data TEXT NOT NULL);
CREATE UNIQUE INDEX events_feed ON events (tenant_id, seq);
""",
    "compact": """
CREATE TABLE ledger (seq BIGINT GENERATED BY DEFAULT AS IDENTITY, tenant_no INTEGER NOT NULL,
    resource_key TEXT NOT NULL, bucket INTEGER NOT NULL DEFAULT 0, op SMALLINT NOT NULL, qty BIGINT NOT NULL,
    request_id BYTEA NOT NULL, order_id TEXT, reservation_id BYTEA, available_after BIGINT NOT NULL,
    reserved_after BIGINT NOT NULL, consumed_after BIGINT NOT NULL, version_after BIGINT NOT NULL,
    plugin_version BIGINT, at BIGINT NOT NULL, line_key TEXT, limit_key TEXT, reverses BYTEA,
    CONSTRAINT ledger_by_resource PRIMARY KEY (tenant_no, resource_key, seq));
CREATE UNIQUE INDEX ledger_identity ON ledger (tenant_no, request_id, op, resource_key, bucket);
CREATE INDEX ledger_by_order ON ledger (tenant_no, order_id) WHERE order_id IS NOT NULL;
CREATE TABLE idempotency (tenant_no INTEGER NOT NULL, key TEXT NOT NULL, request_hash BYTEA NOT NULL,
    response_code SMALLINT NOT NULL, response_type SMALLINT, response_body BYTEA, response_event BIGINT,
    created_at BIGINT NOT NULL, PRIMARY KEY (tenant_no, key));
CREATE INDEX idempotency_by_age ON idempotency (created_at);
CREATE TABLE events (id BYTEA PRIMARY KEY, tenant_no INTEGER NOT NULL, seq BIGINT NOT NULL,
    type SMALLINT NOT NULL, ordering_key TEXT, at BIGINT NOT NULL, data BYTEA NOT NULL);
CREATE UNIQUE INDEX events_feed ON events (tenant_no, seq);
""",
    "actions": """
CREATE TABLE actions (tenant_no INTEGER NOT NULL, seq BIGINT NOT NULL, at BIGINT NOT NULL,
    type SMALLINT NOT NULL, code SMALLINT NOT NULL, key TEXT, request_hash BYTEA, order_id TEXT,
    data BYTEA NOT NULL, PRIMARY KEY (tenant_no, seq));
CREATE UNIQUE INDEX actions_by_key ON actions (tenant_no, key) WHERE key IS NOT NULL;
CREATE INDEX actions_by_order ON actions (tenant_no, order_id) WHERE order_id IS NOT NULL;
CREATE TABLE ledger (tenant_no INTEGER NOT NULL, resource_key TEXT NOT NULL, seq BIGINT NOT NULL,
    action_seq BIGINT NOT NULL, qty BIGINT NOT NULL, available_after BIGINT NOT NULL,
    reserved_after BIGINT NOT NULL, consumed_after BIGINT NOT NULL, version_after BIGINT NOT NULL,
    plugin_version BIGINT, bucket INTEGER NOT NULL DEFAULT 0, op SMALLINT NOT NULL,
    reservation_id BYTEA, line_key TEXT, limit_key TEXT, reverses BYTEA,
    CONSTRAINT ledger_by_resource PRIMARY KEY (tenant_no, resource_key, seq));
CREATE UNIQUE INDEX ledger_identity ON ledger (tenant_no, action_seq, op, resource_key, bucket);
""",
    "floor": """
CREATE TABLE actions (tenant_no INTEGER NOT NULL, seq BIGINT NOT NULL, at BIGINT NOT NULL,
    type SMALLINT NOT NULL, code SMALLINT NOT NULL, key TEXT, request_hash BYTEA, order_id TEXT,
    data BYTEA NOT NULL, lines BYTEA, PRIMARY KEY (tenant_no, seq));
CREATE UNIQUE INDEX actions_by_key ON actions (tenant_no, key) WHERE key IS NOT NULL;
CREATE INDEX actions_by_order ON actions (tenant_no, order_id) WHERE order_id IS NOT NULL;
""",
}

PG_LOADS = {
    "stored": [
        """INSERT INTO events SELECT evt_id, tenant_id, seq, type, ordering_key, at, data
           FROM s_orders WHERE n BETWEEN lo AND hi""",
        """INSERT INTO idempotency SELECT tenant_id, key, request_hash, code, rtype, NULL, evt_id, created_at
           FROM s_orders WHERE n BETWEEN lo AND hi""",
        """INSERT INTO ledger SELECT lseq, tenant_id, resource_key, bucket, op, qty, request_id, order_id,
           reservation_id, available_after, reserved_after, consumed_after, version_after, plugin_version, at,
           line_key, limit_key, reverses FROM s_lines WHERE n BETWEEN lo AND hi ORDER BY lseq""",
    ],
    "compact": [
        """INSERT INTO events SELECT decode(evt_hex, 'hex'), tenant_no, seq, type_no, ordering_compact, at,
           decode(data_hex, 'hex') FROM s_orders WHERE n BETWEEN lo AND hi""",
        """INSERT INTO idempotency SELECT tenant_no, key, decode(request_hash, 'hex'), code, rtype_no, NULL, seq,
           created_at FROM s_orders WHERE n BETWEEN lo AND hi""",
        """INSERT INTO ledger SELECT lseq, tenant_no, resource_key, bucket, op_no, qty, decode(req_hex, 'hex'),
           order_id, NULL, available_after, reserved_after, consumed_after, version_after, plugin_version, at,
           line_compact, limit_key, NULL FROM s_lines WHERE n BETWEEN lo AND hi ORDER BY lseq""",
    ],
    "actions": [
        """INSERT INTO actions SELECT tenant_no, seq, at, type_no, code, key, decode(request_hash, 'hex'),
           order_compact, decode(data_hex, 'hex') FROM s_orders WHERE n BETWEEN lo AND hi""",
        """INSERT INTO ledger SELECT tenant_no, resource_key, lseq, action_seq, qty, available_after,
           reserved_after, consumed_after, version_after, plugin_version, bucket, op_no, NULL, line_compact,
           limit_key, NULL FROM s_lines WHERE n BETWEEN lo AND hi ORDER BY lseq""",
    ],
    "floor": [
        """INSERT INTO actions SELECT tenant_no, seq, at, type_no, code, key, decode(request_hash, 'hex'),
           order_compact, decode(data_hex, 'hex'), decode(lines_hex, 'hex') FROM s_orders
           WHERE n BETWEEN lo AND hi""",
    ],
}

PG_SIZES = """SELECT c.relname, pg_relation_size(c.oid) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
  WHERE n.nspname = current_schema() AND c.relkind IN ('r', 'i') AND c.relname NOT LIKE 's\\_%'"""


def load_postgres(url, stage_path, work, orders, batch):
    """Each layout in a schema of its own in one scratch database; returns {layout: (sizes, secs)}."""
    csv_orders, csv_lines = f"{work}/orders.csv", f"{work}/lines.csv"
    st = sqlite3.connect(stage_path)
    with open(csv_orders, "w") as f:
        subprocess.run(["sqlite3", "-csv", stage_path,
                        "SELECT n, tenant_id, tenant_no, seq, evt_id, hex(evt_blob), type, type_no, ordering_key, "
                        "ordering_compact, at, data, hex(data_blob), key, request_hash, code, rtype, rtype_no, "
                        "created_at, order_id, order_compact, hex(lines_blob) FROM orders ORDER BY n"], stdout=f, check=True)
    with open(csv_lines, "w") as f:
        subprocess.run(["sqlite3", "-csv", stage_path,
                        "SELECT n, lseq, tenant_id, tenant_no, resource_key, bucket, op, op_no, qty, request_id, "
                        "hex(req_blob), order_id, reservation_id, available_after, reserved_after, consumed_after, "
                        "version_after, plugin_version, at, line_key, line_compact, limit_key, reverses, action_seq "
                        "FROM lines ORDER BY lseq"], stdout=f, check=True)
    st.close()
    db = "stockd_schema_trial_" + os.urandom(4).hex()
    subprocess.run(["psql", url, "-qAtc", f"CREATE DATABASE {db}"], check=True)
    target = url.rsplit("/", 1)[0] + "/" + db
    results = {}
    try:
        for layout in LAYOUTS:
            statements = ";\n".join(PG_LOADS[layout])
            script = f"""
CREATE SCHEMA {layout}; SET search_path = {layout};
CREATE TABLE s_orders (n INT, tenant_id TEXT, tenant_no INT, seq BIGINT, evt_id TEXT, evt_hex TEXT, type TEXT,
  type_no SMALLINT, ordering_key TEXT, ordering_compact TEXT, at BIGINT, data TEXT, data_hex TEXT, key TEXT,
  request_hash TEXT, code SMALLINT, rtype TEXT, rtype_no SMALLINT, created_at BIGINT, order_id TEXT,
  order_compact TEXT, lines_hex TEXT);
CREATE TABLE s_lines (n INT, lseq BIGINT, tenant_id TEXT, tenant_no INT, resource_key TEXT, bucket INT, op TEXT,
  op_no SMALLINT, qty BIGINT, request_id TEXT, req_hex TEXT, order_id TEXT, reservation_id TEXT,
  available_after BIGINT, reserved_after BIGINT, consumed_after BIGINT, version_after BIGINT,
  plugin_version BIGINT, at BIGINT, line_key TEXT, line_compact TEXT, limit_key TEXT, reverses TEXT,
  action_seq BIGINT);
\\copy s_orders FROM '{csv_orders}' CSV
\\copy s_lines FROM '{csv_lines}' CSV
CREATE INDEX ON s_orders (n); CREATE INDEX ON s_lines (n); ANALYZE s_orders; ANALYZE s_lines;
{PG_LAYOUTS[layout]}
CREATE PROCEDURE load() LANGUAGE plpgsql AS $$
DECLARE lo INT := 1; hi INT;
BEGIN
  WHILE lo <= {orders} LOOP
    hi := lo + {batch} - 1;
    {statements};
    COMMIT;
    lo := hi + 1;
  END LOOP;
END $$;
SET synchronous_commit = off;
\\timing on
CALL load();
"""
            out = subprocess.run(["psql", target, "-v", "ON_ERROR_STOP=1", "-qAt"], input=script,
                                 capture_output=True, text=True)
            if out.returncode != 0:
                sys.exit(f"PostgreSQL load of {layout} failed:\n{out.stderr}")
            secs = float(out.stdout.strip().splitlines()[-1].split()[1]) / 1000
            sizes = subprocess.run(["psql", target, "-qAtc", f"SET search_path = {layout}; {PG_SIZES}"],
                                   capture_output=True, text=True, check=True).stdout
            results[layout] = ({n: int(s) for n, s in (l.split("|") for l in sizes.splitlines() if l)}, secs)
    finally:
        subprocess.run(["psql", url, "-qAtc", f"DROP DATABASE IF EXISTS {db} WITH (FORCE)"])
    return results

# MySQL/MariaDB: the tables as migrations/mysql leave them (ascii ids, the ledger's identity in
# its own column order), and the same three alternatives.
ASCII = "CHARACTER SET ascii COLLATE ascii_bin"
MYSQL_LAYOUTS = {
    "stored": f"""
CREATE TABLE ledger (seq BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY, tenant_id VARCHAR(64) {ASCII} NOT NULL,
    resource_key VARCHAR(200) {ASCII} NOT NULL, bucket BIGINT NOT NULL DEFAULT 0, op VARCHAR(16) {ASCII} NOT NULL,
    qty BIGINT NOT NULL, request_id VARCHAR(400) {ASCII} NOT NULL, order_id VARCHAR(200) {ASCII},
    reservation_id VARCHAR(200) {ASCII}, available_after BIGINT NOT NULL, reserved_after BIGINT NOT NULL,
    consumed_after BIGINT NOT NULL, version_after BIGINT NOT NULL, plugin_version BIGINT, at BIGINT NOT NULL,
    line_key VARCHAR(400) {ASCII}, limit_key VARCHAR(400) {ASCII}, reverses VARCHAR(400) {ASCII}) ENGINE = InnoDB;
CREATE UNIQUE INDEX ledger_identity ON ledger (tenant_id, resource_key, bucket, request_id, op);
CREATE INDEX ledger_by_resource ON ledger (tenant_id, resource_key, seq);
CREATE INDEX ledger_by_order ON ledger (tenant_id, order_id);
CREATE TABLE idempotency (tenant_id VARCHAR(64) {ASCII} NOT NULL, `key` VARCHAR(255) {ASCII} NOT NULL,
    request_hash VARCHAR(128) {ASCII} NOT NULL, response_code INTEGER, response_type VARCHAR(16) {ASCII},
    response_body MEDIUMTEXT, response_event VARCHAR(64) {ASCII}, created_at BIGINT NOT NULL,
    PRIMARY KEY (tenant_id, `key`)) ENGINE = InnoDB;
CREATE INDEX idempotency_by_age ON idempotency (created_at);
CREATE TABLE events (id VARCHAR(64) {ASCII} NOT NULL PRIMARY KEY, tenant_id VARCHAR(64) {ASCII} NOT NULL, seq BIGINT,
    type VARCHAR(64) {ASCII} NOT NULL, ordering_key VARCHAR(400) {ASCII} NOT NULL, at BIGINT NOT NULL,
    data MEDIUMTEXT NOT NULL) ENGINE = InnoDB;
CREATE UNIQUE INDEX events_feed ON events (tenant_id, seq);
""",
    "compact": f"""
CREATE TABLE ledger (seq BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY, tenant_no INT NOT NULL,
    resource_key VARCHAR(200) {ASCII} NOT NULL, bucket INT NOT NULL DEFAULT 0, op TINYINT NOT NULL,
    qty BIGINT NOT NULL, request_id BINARY(16) NOT NULL, order_id VARCHAR(200) {ASCII},
    reservation_id VARBINARY(16), available_after BIGINT NOT NULL, reserved_after BIGINT NOT NULL,
    consumed_after BIGINT NOT NULL, version_after BIGINT NOT NULL, plugin_version BIGINT, at BIGINT NOT NULL,
    line_key VARCHAR(400) {ASCII}, limit_key VARCHAR(400) {ASCII}, reverses VARBINARY(16)) ENGINE = InnoDB;
CREATE UNIQUE INDEX ledger_identity ON ledger (tenant_no, resource_key, bucket, request_id, op);
CREATE INDEX ledger_by_resource ON ledger (tenant_no, resource_key, seq);
CREATE INDEX ledger_by_order ON ledger (tenant_no, order_id);
CREATE TABLE idempotency (tenant_no INT NOT NULL, `key` VARCHAR(255) {ASCII} NOT NULL,
    request_hash BINARY(16) NOT NULL, response_code SMALLINT, response_type TINYINT,
    response_body MEDIUMBLOB, created_at BIGINT NOT NULL, response_event BIGINT,
    PRIMARY KEY (tenant_no, `key`)) ENGINE = InnoDB;
CREATE INDEX idempotency_by_age ON idempotency (created_at);
CREATE TABLE events (id BINARY(16) NOT NULL PRIMARY KEY, tenant_no INT NOT NULL, seq BIGINT,
    type SMALLINT NOT NULL, ordering_key VARCHAR(400) {ASCII}, at BIGINT NOT NULL, data MEDIUMBLOB NOT NULL)
    ENGINE = InnoDB;
CREATE UNIQUE INDEX events_feed ON events (tenant_no, seq);
""",
    "actions": f"""
CREATE TABLE actions (tenant_no INT NOT NULL, seq BIGINT NOT NULL, `key` VARCHAR(255) {ASCII},
    request_hash BINARY(16), order_id VARCHAR(200) {ASCII}, type SMALLINT NOT NULL, code SMALLINT NOT NULL,
    at BIGINT NOT NULL, data MEDIUMBLOB NOT NULL, PRIMARY KEY (tenant_no, seq)) ENGINE = InnoDB;
CREATE UNIQUE INDEX actions_by_key ON actions (tenant_no, `key`);
CREATE INDEX actions_by_order ON actions (tenant_no, order_id);
CREATE TABLE ledger (tenant_no INT NOT NULL, resource_key VARCHAR(200) {ASCII} NOT NULL, seq BIGINT NOT NULL,
    bucket INT NOT NULL DEFAULT 0, op TINYINT NOT NULL, qty BIGINT NOT NULL, action_seq BIGINT NOT NULL,
    reservation_id VARBINARY(16), available_after BIGINT NOT NULL, reserved_after BIGINT NOT NULL,
    consumed_after BIGINT NOT NULL, version_after BIGINT NOT NULL, plugin_version BIGINT,
    line_key VARCHAR(400) {ASCII}, limit_key VARCHAR(400) {ASCII}, reverses VARBINARY(16),
    PRIMARY KEY (tenant_no, resource_key, seq)) ENGINE = InnoDB;
CREATE UNIQUE INDEX ledger_identity ON ledger (tenant_no, action_seq, op, resource_key, bucket);
""",
    "floor": f"""
CREATE TABLE actions (tenant_no INT NOT NULL, seq BIGINT NOT NULL, `key` VARCHAR(255) {ASCII},
    request_hash BINARY(16), order_id VARCHAR(200) {ASCII}, type SMALLINT NOT NULL, code SMALLINT NOT NULL,
    at BIGINT NOT NULL, data MEDIUMBLOB NOT NULL, `lines` MEDIUMBLOB, PRIMARY KEY (tenant_no, seq)) ENGINE = InnoDB;
CREATE UNIQUE INDEX actions_by_key ON actions (tenant_no, `key`);
CREATE INDEX actions_by_order ON actions (tenant_no, order_id);
""",
}

MYSQL_LOADS = {
    # PostgreSQL's, with MySQL's quoting of the column `key`.
    "stored": [sql.replace(" key,", " `key`,") for sql in PG_LOADS["stored"]],
    "compact": [
        """INSERT INTO events SELECT UNHEX(evt_hex), tenant_no, seq, type_no, ordering_compact, at,
           UNHEX(data_hex) FROM s_orders WHERE n BETWEEN lo AND hi""",
        """INSERT INTO idempotency SELECT tenant_no, `key`, UNHEX(request_hash), code, rtype_no, NULL, created_at,
           seq FROM s_orders WHERE n BETWEEN lo AND hi""",
        """INSERT INTO ledger SELECT lseq, tenant_no, resource_key, bucket, op_no, qty, UNHEX(req_hex), order_id,
           NULL, available_after, reserved_after, consumed_after, version_after, plugin_version, at,
           line_compact, limit_key, NULL FROM s_lines WHERE n BETWEEN lo AND hi ORDER BY lseq""",
    ],
    "actions": [
        """INSERT INTO actions SELECT tenant_no, seq, `key`, UNHEX(request_hash), order_compact, type_no, code, at,
           UNHEX(data_hex) FROM s_orders WHERE n BETWEEN lo AND hi""",
        """INSERT INTO ledger SELECT tenant_no, resource_key, lseq, bucket, op_no, qty, action_seq, NULL,
           available_after, reserved_after, consumed_after, version_after, plugin_version, line_compact,
           limit_key, NULL FROM s_lines WHERE n BETWEEN lo AND hi ORDER BY lseq""",
    ],
    "floor": [
        """INSERT INTO actions SELECT tenant_no, seq, `key`, UNHEX(request_hash), order_compact, type_no, code, at,
           UNHEX(data_hex), UNHEX(lines_hex) FROM s_orders WHERE n BETWEEN lo AND hi""",
    ],
}

MYSQL_STAGE_ORDERS = (
    "n, tenant_id, tenant_no, seq, evt_id, hex(evt_blob), type, type_no, ordering_key, ordering_compact, at, "
    "data, hex(data_blob), key, request_hash, code, rtype, rtype_no, created_at, order_id, order_compact, "
    "hex(lines_blob)")
MYSQL_STAGE_LINES = (
    "n, lseq, tenant_id, tenant_no, resource_key, bucket, op, op_no, qty, request_id, hex(req_blob), order_id, "
    "reservation_id, available_after, reserved_after, consumed_after, version_after, plugin_version, at, "
    "line_key, line_compact, limit_key, reverses, action_seq")


def tsv(stage_path, columns, table, out):
    """A stage table as tab-separated values for LOAD DATA, NULL as \\N."""
    st = sqlite3.connect(stage_path)
    with open(out, "w") as f:
        for row in st.execute(f"SELECT {columns} FROM {table} ORDER BY {'n' if table == 'orders' else 'lseq'}"):
            f.write("\t".join("\\N" if v is None else str(v) for v in row) + "\n")
    st.close()


def load_mysql(url, stage_path, work, orders, batch):
    """Each layout in a scratch database of its own on a MySQL/MariaDB server (mysql://USER@HOST:PORT);
    returns {layout: ({index: bytes of its leaf pages}, secs)}."""
    rest = url.split("://", 1)[1]
    user, hostport = rest.split("@", 1) if "@" in rest else ("root", rest)
    host, port = hostport.rsplit(":", 1) if ":" in hostport else (hostport, "3306")
    cli = ["mariadb" if shutil.which("mariadb") else "mysql", "-u", user, "-h", host, "-P", port,
           "--local-infile=1", "-N", "-B"]
    tsv(stage_path, MYSQL_STAGE_ORDERS, "orders", f"{work}/orders.tsv")
    tsv(stage_path, MYSQL_STAGE_LINES, "lines", f"{work}/lines.tsv")
    results = {}
    for layout in LAYOUTS:
        db = f"stockd_schema_trial_{layout}_{os.urandom(4).hex()}"
        statements = ";\n".join(MYSQL_LOADS[layout])
        script = f"""
CREATE DATABASE {db}; USE {db};
CREATE TABLE s_orders (n INT PRIMARY KEY, tenant_id VARCHAR(64), tenant_no INT, seq BIGINT, evt_id VARCHAR(64),
  evt_hex VARCHAR(64), type VARCHAR(64), type_no SMALLINT, ordering_key VARCHAR(400), ordering_compact VARCHAR(400),
  at BIGINT, data MEDIUMTEXT, data_hex MEDIUMTEXT, `key` VARCHAR(255), request_hash VARCHAR(128), code SMALLINT,
  rtype VARCHAR(16), rtype_no SMALLINT, created_at BIGINT, order_id VARCHAR(200), order_compact VARCHAR(200),
  lines_hex MEDIUMTEXT) ENGINE = InnoDB;
CREATE TABLE s_lines (n INT, lseq BIGINT PRIMARY KEY, tenant_id VARCHAR(64), tenant_no INT,
  resource_key VARCHAR(200), bucket INT, op VARCHAR(16), op_no TINYINT, qty BIGINT, request_id VARCHAR(400),
  req_hex VARCHAR(64), order_id VARCHAR(200), reservation_id VARCHAR(200), available_after BIGINT,
  reserved_after BIGINT, consumed_after BIGINT, version_after BIGINT, plugin_version BIGINT, at BIGINT,
  line_key VARCHAR(400), line_compact VARCHAR(400), limit_key VARCHAR(400), reverses VARCHAR(400),
  action_seq BIGINT, KEY (n)) ENGINE = InnoDB;
LOAD DATA LOCAL INFILE '{work}/orders.tsv' INTO TABLE s_orders;
LOAD DATA LOCAL INFILE '{work}/lines.tsv' INTO TABLE s_lines;
{MYSQL_LAYOUTS[layout]}
DELIMITER //
CREATE PROCEDURE load_all() BEGIN
  DECLARE lo INT DEFAULT 1; DECLARE hi INT;
  WHILE lo <= {orders} DO
    SET hi = lo + {batch} - 1;
    START TRANSACTION;
    {statements};
    COMMIT;
    SET lo = hi + 1;
  END WHILE;
END //
DELIMITER ;
SELECT UNIX_TIMESTAMP(NOW(6));
CALL load_all();
SELECT UNIX_TIMESTAMP(NOW(6));
"""
        try:
            out = subprocess.run(cli, input=script, capture_output=True, text=True)
            if out.returncode != 0:
                sys.exit(f"MySQL load of {layout} failed:\n{out.stderr}")
            start, end = (float(x) for x in out.stdout.split()[-2:])
            tables = re.findall(r"CREATE TABLE (\w+)", MYSQL_LAYOUTS[layout])
            subprocess.run(cli + [db, "-e", "ANALYZE TABLE " + ", ".join(tables)],
                           capture_output=True, text=True, check=True)
            quoted = ", ".join(f"'{t}'" for t in tables)
            sizes = subprocess.run(cli + ["-e", f"""SELECT CONCAT(table_name, '.', index_name), stat_value * @@innodb_page_size
                FROM mysql.innodb_index_stats WHERE database_name = '{db}' AND table_name IN ({quoted})
                AND stat_name = 'n_leaf_pages'"""], capture_output=True, text=True, check=True).stdout
            results[layout] = ({n: int(v) for n, v in (l.split("\t") for l in sizes.splitlines() if l)},
                               end - start)
        finally:
            subprocess.run(cli + ["-e", f"DROP DATABASE IF EXISTS {db}"], capture_output=True)
    return results



def take_option(args, name):
    """The value after `name` in `args`, both taken out of it; None without `name`."""
    if name not in args:
        return None
    i = args.index(name)
    value = args[i + 1]
    del args[i:i + 2]
    return value


def main():
    args = sys.argv[1:]
    pg = take_option(args, "--postgres")
    my = take_option(args, "--mysql")
    rounds = int(take_option(args, "--rounds") or 1)
    synchronous = (take_option(args, "--synchronous") or "off").upper()
    if synchronous not in ("OFF", "NORMAL", "FULL"):
        sys.exit("schema-trial: --synchronous is off, normal or full")
    source = args[0]
    batch = int(args[1]) if len(args) > 1 else 26
    work = tempfile.mkdtemp(prefix="stockd-schema-trial-")
    try:
        stage_path = f"{work}/stage.db"
        orders, lines = stage(source, stage_path)
        print(f"{orders} orders, {lines} ledger entries ({lines / orders:.2f} a order), {batch} orders a commit")
        layouts = LAYOUTS
        cpus = {layout: [] for layout in layouts}
        cycles = {layout: [] for layout in layouts}
        for r in range(rounds):
            for layout in layouts if r % 2 == 0 else layouts[::-1]:
                sizes, wal, cpu, cycle = load_sqlite(layout, stage_path, work, orders, batch, synchronous)
                cpus[layout].append(cpu / orders * 1e6)
                cycles[layout].append(cycle * 1e3)
                os.remove(f"{work}/{layout}.db")
                if r == rounds - 1 or rounds == 1:
                    total = sum(sizes.values())
                    parts = ", ".join(f"{n} {s / orders:.0f}" for n, s in sorted(sizes.items()) if s > 4096 * 2)
                    print(f"sqlite   {layout:8s} {total / orders:7.1f} B/order  WAL {wal / orders:7.0f} B/order  "
                          f"load CPU {' / '.join(f'{c:.1f}' for c in cpus[layout])} us/order  "
                          f"commit {' / '.join(f'{c:.2f}' for c in cycles[layout])} ms   {parts}")
        if pg:
            for layout, (sizes, secs) in load_postgres(pg, stage_path, work, orders, batch).items():
                total = sum(sizes.values())
                parts = ", ".join(f"{n} {s / orders:.0f}" for n, s in sorted(sizes.items()) if s > 8192 * 2)
                print(f"postgres {layout:8s} {total / orders:7.1f} B/order  load {secs / orders * 1e6:6.1f} us/order"
                      f"   {parts}")
        if my:
            for layout, (sizes, secs) in load_mysql(my, stage_path, work, orders, batch).items():
                total = sum(sizes.values())
                parts = ", ".join(f"{n} {s / orders:.0f}" for n, s in sorted(sizes.items()))
                print(f"mysql    {layout:8s} {total / orders:7.1f} B/order  load {secs / orders * 1e6:6.1f} us/order"
                      f"   {parts}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

//! The Lua scripts of redis mode. Each runs atomically in Redis, is sent once and then called
//! by its SHA (`EVALSHA`, reloaded by the client on `NOSCRIPT`), and touches only keys of one
//! resource, which all share the hash tag `{tenant:key}` and so one Redis Cluster slot.
//!
//! Numbers: quantities are at most 10^12 and totals 10^15, below 2^53, so Lua's doubles hold
//! them exactly.

/// Deducts or reserves one order line, or answers its first outcome again.
///
/// KEYS[1] the resource hash: `avail` (stock Redis may sell), `reserved`, `backlog` (available
///         quantity sold or returned here and not yet settled into the database, signed),
///         `pending` (stream entries not yet settled), `open` ("1" sells; "0" while a warm or a
///         mode switch drains the stream), `inactive` ("1" refuses as the resource is inactive),
///         `kind` (the resource's kind, set by the load)
/// KEYS[2] the resource's per-user limit counters (hash: limit key -> used)
/// KEYS[3] this request's record (hash: `h` request hash, `c` status code, `b` body)
/// KEYS[4] the resource's settlement stream
/// KEYS[5] the resource's reservations (hash: `<id>` document, `<id>:s` state, `<id>:q` qty,
///         `<id>:l` limit key, `<id>:e` deadline in Unix ms)
/// KEYS[6] the resource's reservation deadlines (sorted set, score = deadline)
///
/// ARGV[1] qty; ARGV[2] limit key or ""; ARGV[3] limit max; ARGV[4] request hash;
/// ARGV[5] request record TTL (s); ARGV[6] body if applied; ARGV[7] body if insufficient;
/// ARGV[8] body if over the limit; ARGV[9] body if inactive (ARGV[7..9], ARGV[19] and ARGV[22]
/// all "" on a first call: see `refuse` below); ARGV[10] the settlement record;
/// ARGV[11] the sold-out channel; ARGV[12] the sold-out message; ARGV[13] "deduct" or
/// "reserve"; reserve only: ARGV[14] reservation id, ARGV[15] deadline (Unix ms), ARGV[16] the
/// reservation document; ARGV[17] the limit key's count in the database or "" (not read), and
/// ARGV[18] the resource's epoch when it was read; ARGV[19] the settlement record of a refusal;
/// ARGV[20] the most entries the resource's stream may hold unsettled (`backlog`); ARGV[21]
/// the kind the plan requires of the resource or ""; ARGV[22] the body if the resource is of
/// another kind.
///
/// A sale's first call carries only what a sale needs: the refusal bodies and the refusal's
/// record are "" (building and sending them cost every sale ~1.3 KB of arguments, which Redis
/// copies into Lua strings, and four JSON documents in the process). A refusal decided on a call
/// without them (ARGV[19] "") answers `refuse` with nothing written, and the caller runs the
/// script again with every refusal's body and record: a refusal costs two calls, a sale one.
///
/// A refusal (another kind, answered as on the database path: resource not found;
/// insufficient, over the limit, inactive) joins the stream too, with its status and
/// body beside the record (`c`, `b`): settled, it becomes the key's stored outcome in the
/// database, so its replay answers the same after a sold-out mark, a switch to db mode or a
/// Redis data loss.
///
/// A limit key Redis does not count yet starts from zero, unless the resource had sales before
/// Redis started counting (`seed` = "1": it entered redis mode, or Redis lost its data, after
/// something was sold): then it starts from the database's count, and the script answers `seed`
/// until the caller passes one read at the epoch Redis holds (read after that epoch was taken,
/// when the database path no longer sold the resource and every earlier Redis sale was
/// settled). A flash sale on a resource created in redis mode never reads a count.
///
/// Returns `{outcome, code, body, avail}` (body "" when `applied`: the caller sent it); outcome
/// is `applied`, `insufficient`, `limit`, `inactive`, `not_found`, `refuse` (a refusal without its
/// body: nothing written), `replay`, `mismatch`, `cold` (not warmed: nothing known),
/// `closed` (draining),
/// `backlog` (settlement is that far behind: nothing written, a replay still answered) or
/// `seed` (read the limit key's count from the database and run again; nothing written).
/// A success exists only together with its stream entry: both are written by this one script.
pub const DEDUCT: &str = r#"
local prev = redis.call('HMGET', KEYS[3], 'h', 'c', 'b')
if prev[1] then
  if prev[1] ~= ARGV[4] then return {'mismatch', '422', '', -1} end
  return {'replay', prev[2], prev[3], -1}
end
local st = redis.call('HMGET', KEYS[1], 'avail', 'open', 'inactive', 'seed', 'pending', 'kind', 'backlog')
if not st[1] then return {'cold', '503', '', -1} end
if st[2] ~= '1' then return {'closed', '503', '', -1} end
if tonumber(st[5] or '0') >= tonumber(ARGV[20]) then return {'backlog', '503', '', -1} end
local other_kind = ARGV[21] ~= '' and st[6] and st[6] ~= ARGV[21]
local qty = tonumber(ARGV[1])
local avail = tonumber(st[1])
local used = 0
if ARGV[2] ~= '' and not other_kind then
  local counted = redis.call('HGET', KEYS[2], ARGV[2])
  if counted then
    used = tonumber(counted)
  elseif st[4] ~= '1' then
    used = 0
  elseif ARGV[17] == '' or (redis.call('HGET', KEYS[1], 'epoch') or '0') ~= ARGV[18] then
    return {'seed', '0', '', -1}
  else
    used = tonumber(ARGV[17])
    redis.call('HSET', KEYS[2], ARGV[2], used)
  end
end
local outcome, code, body
if other_kind then
  outcome, code, body = 'not_found', '409', ARGV[22]
elseif st[3] == '1' then
  outcome, code, body = 'inactive', '409', ARGV[9]
elseif ARGV[2] ~= '' and used + qty > tonumber(ARGV[3]) then
  outcome, code, body = 'limit', '409', ARGV[8]
elseif avail < qty then
  outcome, code, body = 'insufficient', '409', ARGV[7]
else
  outcome, code, body = 'applied', '201', ARGV[6]
  avail = avail - qty
  -- One write for the three counters (a command fewer from Lua is ~2 us of Redis a sale; the
  -- numbers are integers below 2^53, written as integers, so HINCRBY elsewhere still applies).
  redis.call('HSET', KEYS[1], 'avail', avail, 'backlog', tonumber(st[7] or '0') + qty,
    'pending', tonumber(st[5] or '0') + 1)
  if ARGV[2] ~= '' then redis.call('HINCRBY', KEYS[2], ARGV[2], qty) end
  if ARGV[13] == 'reserve' then
    local id = ARGV[14]
    redis.call('HINCRBY', KEYS[1], 'reserved', qty)
    redis.call('HSET', KEYS[5], id, ARGV[16], id .. ':s', 'held', id .. ':q', qty, id .. ':l', ARGV[2], id .. ':e', ARGV[15])
    redis.call('ZADD', KEYS[6], ARGV[15], id)
  end
  redis.call('XADD', KEYS[4], '*', 'r', ARGV[10], 'd', qty)
  if avail == 0 then redis.call('PUBLISH', ARGV[11], ARGV[12]) end
end
if outcome ~= 'applied' then
  if ARGV[19] == '' then return {'refuse', code, '', -1} end
  redis.call('HINCRBY', KEYS[1], 'pending', 1)
  redis.call('XADD', KEYS[4], '*', 'r', ARGV[19], 'd', 0, 'c', code, 'b', body)
end
redis.call('HSET', KEYS[3], 'h', ARGV[4], 'c', code, 'b', body)
redis.call('EXPIRE', KEYS[3], ARGV[5])
if outcome == 'applied' then return {outcome, code, '', avail} end
return {outcome, code, body, avail}
"#;

/// Moves a held reservation to `confirmed`, `released` or `expired`, once: a confirm or release
/// past the deadline expires it instead (the same `expire` the database's sweeper records when
/// it is first). Its quantity leaves `reserved` (back to `avail` unless
/// confirmed, with the per-user limit given back), and the move is appended to the stream.
///
/// KEYS[1] the resource hash; KEYS[2] the limit counters; KEYS[3] the stream; KEYS[4] the
/// reservations; KEYS[5] the deadlines. ARGV[1] id; ARGV[2] target state; ARGV[3] now (Unix ms);
/// ARGV[4..6] the settlement record of a confirm, a release, an expiry; ARGV[7] the channel;
/// ARGV[8] the message announcing stock again.
///
/// Returns `{state, document}`: the state it is in now (`unknown` if Redis does not hold it,
/// `closed` while a warm or a switch holds the resource: nothing may join a stream being
/// drained) and its document (as reserved; the caller sets the state).
pub const TRANSITION: &str = r#"
local id = ARGV[1]
local st = redis.call('HGET', KEYS[4], id .. ':s')
if not st then return {'unknown', ''} end
local doc = redis.call('HGET', KEYS[4], id)
if st ~= 'held' then return {st, doc} end
if redis.call('HGET', KEYS[1], 'open') ~= '1' then return {'closed', ''} end
local to = ARGV[2]
local deadline = tonumber(redis.call('HGET', KEYS[4], id .. ':e'))
if deadline <= tonumber(ARGV[3]) then to = 'expired' end
local qty = tonumber(redis.call('HGET', KEYS[4], id .. ':q'))
local limit = redis.call('HGET', KEYS[4], id .. ':l')
redis.call('HINCRBY', KEYS[1], 'reserved', -qty)
local delta, record = 0, ARGV[4]
if to ~= 'confirmed' then
  local before = tonumber(redis.call('HGET', KEYS[1], 'avail') or '0')
  redis.call('HINCRBY', KEYS[1], 'avail', qty)
  if limit and limit ~= '' then redis.call('HINCRBY', KEYS[2], limit, -qty) end
  delta = -qty
  if to == 'released' then record = ARGV[5] else record = ARGV[6] end
  if before == 0 then redis.call('PUBLISH', ARGV[7], ARGV[8]) end
end
redis.call('HSET', KEYS[4], id .. ':s', to)
redis.call('ZREM', KEYS[5], id)
redis.call('HINCRBY', KEYS[1], 'backlog', delta)
redis.call('HINCRBY', KEYS[1], 'pending', 1)
redis.call('XADD', KEYS[3], '*', 'r', record, 'd', delta)
return {to, doc}
"#;

/// Reverses (part of) one order line Redis sold: gives `qty` back to `avail`, and the per-user
/// limit units with it, at most what the order took minus what it has had reversed; or answers
/// the request key's first outcome again. The order's count of reversed units is kept in the
/// resource's slot (`:rv`, order id -> reversed), starting from the database's settled count
/// when Redis has none (a fresh Redis, or one that entered redis mode after db-path reversals),
/// so concurrent reversals, settled or not, never give back more than the order took.
///
/// KEYS[1] the resource hash; KEYS[2] the limit counters; KEYS[3] this request's record;
/// KEYS[4] the stream; KEYS[5] the order reversal counts (hash: order id -> reversed).
///
/// ARGV[1] qty; ARGV[2] order id; ARGV[3] what the order took (the database's ledger);
/// ARGV[4] what the database has settled as reversed of it; ARGV[5] limit key or ""; ARGV[6]
/// request hash; ARGV[7] request record TTL (s); ARGV[8] body if applied; ARGV[9] the
/// settlement record; ARGV[10] the channel; ARGV[11] the message announcing stock again.
///
/// Returns `{outcome, code, body, reversible}`: outcome `applied`, `exceeds` (nothing written:
/// not an outcome, `reversible` says what is left), `replay`, `mismatch`, `cold` or `closed`.
/// The entry's `d` is `-qty`: Redis's available grew before the database's did.
pub const REVERSE: &str = r#"
local prev = redis.call('HMGET', KEYS[3], 'h', 'c', 'b')
if prev[1] then
  if prev[1] ~= ARGV[6] then return {'mismatch', '422', '', 0} end
  return {'replay', prev[2], prev[3], 0}
end
local st = redis.call('HMGET', KEYS[1], 'avail', 'open')
if not st[1] then return {'cold', '503', '', 0} end
if st[2] ~= '1' then return {'closed', '503', '', 0} end
local qty = tonumber(ARGV[1])
local reversed = tonumber(redis.call('HGET', KEYS[5], ARGV[2]) or '0')
local settled = tonumber(ARGV[4])
if settled > reversed then reversed = settled end
local taken = tonumber(ARGV[3])
if reversed + qty > taken then return {'exceeds', '409', '', taken - reversed} end
redis.call('HSET', KEYS[5], ARGV[2], reversed + qty)
local before = tonumber(st[1])
redis.call('HINCRBY', KEYS[1], 'avail', qty)
redis.call('HINCRBY', KEYS[1], 'backlog', 0 - qty)
redis.call('HINCRBY', KEYS[1], 'pending', 1)
if ARGV[5] ~= '' then
  local used = tonumber(redis.call('HGET', KEYS[2], ARGV[5]) or '0')
  if used >= qty then redis.call('HINCRBY', KEYS[2], ARGV[5], 0 - qty) end
end
redis.call('XADD', KEYS[4], '*', 'r', ARGV[9], 'd', 0 - qty)
if before == 0 then redis.call('PUBLISH', ARGV[10], ARGV[11]) end
redis.call('HSET', KEYS[3], 'h', ARGV[6], 'c', '201', 'b', ARGV[8])
redis.call('EXPIRE', KEYS[3], ARGV[7])
return {'applied', '201', ARGV[8], taken - reversed - qty}
"#;

/// Acknowledges settled stream entries of one resource: the first acknowledgement of an entry
/// (only) removes it and takes it off the backlog, so a redelivered entry is never subtracted
/// twice. One call for a read's entries: each would otherwise be a script call of its own.
///
/// KEYS[1] the stream; KEYS[2] the resource hash; KEYS[3] the reservations. ARGV[1] group;
/// ARGV[2] the sold-out channel; ARGV[3] the message that the resource is sold out and
/// settled, published when no entry is left unsettled and nothing is available (every sale of
/// it is then in the database); then per entry, from ARGV[4], three arguments: its id, its
/// change of available (`d`), and the reservation a settled move (confirm, release, expiry)
/// ended, or "" (its fields are deleted, the database holding its final state from now on).
/// Returns how many entries were acknowledged now.
///
/// A script that fails half-way keeps its earlier writes, so every argument is checked before
/// the first write, and the arithmetic is written so that a zero delta stays `0` (Lua's `-0`
/// reaches Redis as "-0", which HINCRBY refuses).
pub const ACK: &str = r#"
if (#ARGV - 3) % 3 ~= 0 then return redis.error_reply('ack: arguments come in threes') end
for i = 4, #ARGV, 3 do
  if not tonumber(ARGV[i + 1]) then return redis.error_reply('ack: delta is not a number') end
end
local acked, delta = 0, 0
for i = 4, #ARGV, 3 do
  if redis.call('XACK', KEYS[1], ARGV[1], ARGV[i]) == 1 then
    redis.call('XDEL', KEYS[1], ARGV[i])
    delta = delta + tonumber(ARGV[i + 1])
    local id = ARGV[i + 2]
    if id ~= '' then
      redis.call('HDEL', KEYS[3], id, id .. ':s', id .. ':q', id .. ':l', id .. ':e')
    end
    acked = acked + 1
  end
end
if acked == 0 then return 0 end
if delta ~= 0 then redis.call('HINCRBY', KEYS[2], 'backlog', 0 - delta) end
local pending = redis.call('HINCRBY', KEYS[2], 'pending', 0 - acked)
if pending <= 0 and tonumber(redis.call('HGET', KEYS[2], 'avail') or '1') == 0 then
  redis.call('PUBLISH', ARGV[2], ARGV[3])
end
return acked
"#;

/// Closes the resource for sales under a new fencing epoch (docs/REDIS.md, "Fencing"): the
/// first step of every warm, switch and adjustment, taken right after the database gave this
/// process the epoch. Refused when Redis already holds a later epoch (another process took over).
/// The close is a lease: past `lease`, the settlement loop warms the resource again.
///
/// KEYS[1] the resource hash. ARGV[1] epoch; ARGV[2] owner (a process's name); ARGV[3] lease
/// (ms). Returns `{1, pending}` once closed, `{0, epoch held}` when refused.
pub const FENCE: &str = r#"
local held = tonumber(redis.call('HGET', KEYS[1], 'epoch') or '0')
if held > tonumber(ARGV[1]) then return {0, held} end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', KEYS[1], 'epoch', ARGV[1], 'open', '0', 'owner', ARGV[2], 'lease', now + tonumber(ARGV[3]))
redis.call('PERSIST', KEYS[1])
return {1, tonumber(redis.call('HGET', KEYS[1], 'pending') or '0')}
"#;

/// Makes the calling process the one settlement consumer of a resource's stream for `ARGV[2]`
/// ms, or keeps it so: one process settles a stream at a time, in stream order, so a sale of
/// stock a release returned never reaches the database before that release.
///
/// KEYS[1] the stream's owner key. ARGV[1] this process's consumer name; ARGV[2] the lease
/// (ms). Returns 1 when renewed, 2 when taken now (the caller first takes over every pending
/// entry of the stream), 0 when another process holds it.
pub const STREAM_OWNER: &str = r#"
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if holder then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 2
"#;

/// Reopens a resource closed under `epoch` that nothing changed meanwhile (a drain that timed
/// out before the database was touched); refused once another epoch took over.
///
/// KEYS[1] the resource hash. ARGV[1] epoch. Returns 1 if reopened.
pub const REOPEN: &str = r#"
local st = redis.call('HMGET', KEYS[1], 'epoch', 'avail')
if st[1] ~= ARGV[1] or not st[2] then return 0 end
redis.call('HSET', KEYS[1], 'open', '1')
redis.call('HDEL', KEYS[1], 'owner', 'lease')
return 1
"#;

/// Whether a resource was left closed by an operation that stopped half-way: closed, holding
/// stock, and its lease ran out (or it has none). The settlement loop then warms it again.
///
/// KEYS[1] the resource hash. Returns 1 when abandoned.
pub const ABANDONED: &str = r#"
local st = redis.call('HMGET', KEYS[1], 'open', 'lease', 'avail')
if st[1] == '1' or not st[3] then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if st[2] and tonumber(st[2]) > now then return 0 end
return 1
"#;

/// Loads the resource from the database once its backlog is settled, and opens it; only under
/// the epoch that closed it, which the caller read back from the database together with the
/// stock (so the database was still in redis mode at that epoch after Redis was closed).
///
/// KEYS[1] the resource hash; KEYS[2] the stream; KEYS[3] the limit counters; KEYS[4] the
/// reservations; KEYS[5] the deadlines. ARGV[1] database available; ARGV[2] "1" if
/// inactive; ARGV[3] group; ARGV[4] the channel; ARGV[5] the message announcing the new stock;
/// ARGV[6] database reserved; ARGV[7] epoch; ARGV[8] "1" if anything of it was ever sold (its
/// per-user limit counts may be non-zero), which, when Redis starts counting afresh (it held no
/// stock: a new redis-mode period, or data lost), makes new limit keys start from the
/// database's counts; ARGV[9] the resource's kind; from ARGV[10], reservations Redis holds that
/// the database read does not (its sweeper expired them first, or their reserve was refused).
///
/// Held reservations stay as they are, but for those: once everything is settled the
/// database's reserved counts exactly the reservations it holds, and the stock of one it no
/// longer holds is already in its available. Redis forgets such a reservation (its limit units
/// given back, as its expiry would) instead of returning its stock a second time later.
/// Returns `{1, forgotten}` when loaded, `{0, pending}` when something is still unsettled (the
/// caller waits and tries again), `{-1, 0}` when another epoch took over.
pub const LOAD: &str = r#"
local st = redis.call('HMGET', KEYS[1], 'epoch', 'pending')
if st[1] ~= ARGV[7] then return {-1, 0} end
local pending = tonumber(st[2] or '0')
if pending ~= 0 then return {0, pending} end
local forgotten = 0
for i = 10, #ARGV do
  local id = ARGV[i]
  if redis.call('HGET', KEYS[4], id .. ':s') == 'held' then
    local qty = tonumber(redis.call('HGET', KEYS[4], id .. ':q') or '0')
    local limit = redis.call('HGET', KEYS[4], id .. ':l')
    if limit and limit ~= '' and qty > 0 then redis.call('HINCRBY', KEYS[3], limit, -qty) end
    redis.call('HDEL', KEYS[4], id, id .. ':s', id .. ':q', id .. ':l', id .. ':e')
    redis.call('ZREM', KEYS[5], id)
    forgotten = forgotten + 1
  end
end
if redis.call('HEXISTS', KEYS[1], 'avail') == 0 then redis.call('HSET', KEYS[1], 'seed', ARGV[8]) end
redis.call('HSET', KEYS[1], 'avail', ARGV[1], 'reserved', ARGV[6], 'backlog', 0, 'pending', 0, 'open', '1',
  'inactive', ARGV[2], 'kind', ARGV[9])
redis.call('HDEL', KEYS[1], 'owner', 'lease')
local ok, err = pcall(redis.call, 'XGROUP', 'CREATE', KEYS[2], ARGV[3], '0', 'MKSTREAM')
redis.call('PUBLISH', ARGV[4], ARGV[5])
return {1, forgotten}
"#;

/// Forgets a resource that left redis mode at `epoch` (drained first): deletes its stock,
/// stream, counters and reservations, and leaves a closed marker holding the epoch for
/// `ARGV[2]` seconds, so a process with a stale view finds nothing to sell and cannot fence
/// under an older epoch.
///
/// KEYS[1] the resource hash; KEYS[2] the stream; KEYS[3] the limit counters; KEYS[4] the
/// reservations; KEYS[5] the deadlines; KEYS[6] the order reversal counts. ARGV[1] epoch; ARGV[2] the marker's life (s). Held
/// reservations continue on the database path. Returns 0 when forgotten, the entries still
/// unsettled otherwise, or -1 when another epoch holds the resource.
pub const FORGET: &str = r#"
local st = redis.call('HMGET', KEYS[1], 'epoch', 'pending')
if st[1] ~= ARGV[1] then return -1 end
local pending = tonumber(st[2] or '0')
if pending ~= 0 then return pending end
redis.call('UNLINK', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6])
redis.call('HSET', KEYS[1], 'epoch', ARGV[1], 'open', '0')
redis.call('EXPIRE', KEYS[1], ARGV[2])
return 0
"#;

//! The Lua scripts of redis mode. Each runs atomically in Redis, is sent once and then called
//! by its SHA (`EVALSHA`, reloaded by the client on `NOSCRIPT`), and touches only keys of one
//! resource, which all share the hash tag `{tenant:key}` and so one Redis Cluster slot.
//!
//! Numbers: quantities are at most 10^12 and totals 10^15, below 2^53, so Lua's doubles hold
//! them exactly.

/// Deducts one order line, or answers its first outcome again.
///
/// KEYS[1] the resource hash: `avail` (stock Redis may sell), `backlog` (quantity sold here and
///         not yet settled into the database), `open` ("1" sells; "0" while a warm or a mode
///         switch drains the stream), `inactive` ("1" refuses as the resource is inactive)
/// KEYS[2] the resource's per-user limit counters (hash: limit key -> used)
/// KEYS[3] this request's record (hash: `h` request hash, `c` status code, `b` body)
/// KEYS[4] the resource's settlement stream
///
/// ARGV[1] qty; ARGV[2] limit key or ""; ARGV[3] limit max; ARGV[4] request hash;
/// ARGV[5] request record TTL (s); ARGV[6] body if applied; ARGV[7] body if insufficient;
/// ARGV[8] body if over the limit; ARGV[9] body if inactive; ARGV[10] the settlement record;
/// ARGV[11] the sold-out channel; ARGV[12] the sold-out message.
///
/// Returns `{outcome, code, body, avail}`; outcome is `applied`, `insufficient`, `limit`,
/// `inactive`, `replay`, `mismatch`, `cold` (not warmed: nothing known) or `closed` (draining).
/// A success exists only together with its stream entry: both are written by this one script.
pub const DEDUCT: &str = r#"
local prev = redis.call('HMGET', KEYS[3], 'h', 'c', 'b')
if prev[1] then
  if prev[1] ~= ARGV[4] then return {'mismatch', '422', '', -1} end
  return {'replay', prev[2], prev[3], -1}
end
local st = redis.call('HMGET', KEYS[1], 'avail', 'open', 'inactive')
if not st[1] then return {'cold', '503', '', -1} end
if st[2] ~= '1' then return {'closed', '503', '', -1} end
local qty = tonumber(ARGV[1])
local avail = tonumber(st[1])
local outcome, code, body
if st[3] == '1' then
  outcome, code, body = 'inactive', '409', ARGV[9]
elseif ARGV[2] ~= '' and tonumber(redis.call('HGET', KEYS[2], ARGV[2]) or '0') + qty > tonumber(ARGV[3]) then
  outcome, code, body = 'limit', '409', ARGV[8]
elseif avail < qty then
  outcome, code, body = 'insufficient', '409', ARGV[7]
else
  outcome, code, body = 'applied', '201', ARGV[6]
  avail = avail - qty
  redis.call('HSET', KEYS[1], 'avail', avail)
  redis.call('HINCRBY', KEYS[1], 'backlog', qty)
  if ARGV[2] ~= '' then redis.call('HINCRBY', KEYS[2], ARGV[2], qty) end
  redis.call('XADD', KEYS[4], '*', 'r', ARGV[10])
  if avail == 0 then redis.call('PUBLISH', ARGV[11], ARGV[12]) end
end
redis.call('HSET', KEYS[3], 'h', ARGV[4], 'c', code, 'b', body)
redis.call('EXPIRE', KEYS[3], ARGV[5])
return {outcome, code, body, avail}
"#;

/// Acknowledges one settled stream entry: the first acknowledgement (only) removes the entry
/// and takes its quantity off the backlog, so a redelivered entry is never subtracted twice.
///
/// KEYS[1] the stream; KEYS[2] the resource hash. ARGV[1] group; ARGV[2] entry id; ARGV[3] qty.
pub const ACK: &str = r#"
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  redis.call('XDEL', KEYS[1], ARGV[2])
  redis.call('HINCRBY', KEYS[2], 'backlog', -tonumber(ARGV[3]))
  return 1
end
return 0
"#;

/// Opens or closes the resource for sales. Closing returns the backlog still to settle.
///
/// KEYS[1] the resource hash. ARGV[1] "1" open, "0" closed. Returns `{exists, backlog}`.
pub const GATE: &str = r#"
if redis.call('EXISTS', KEYS[1]) == 0 then return {0, 0} end
redis.call('HSET', KEYS[1], 'open', ARGV[1])
return {1, tonumber(redis.call('HGET', KEYS[1], 'backlog') or '0')}
"#;

/// Loads the resource from the database once its backlog is settled, and opens it.
///
/// KEYS[1] the resource hash; KEYS[2] the stream. ARGV[1] database available; ARGV[2] "1" if
/// inactive; ARGV[3] group; ARGV[4] the channel; ARGV[5] the message announcing the new stock.
/// Returns `{1, 0}` when loaded, `{0, backlog}` when something is still unsettled (a sale that
/// slipped in before the close, or a warm racing another): the caller waits and tries again.
pub const LOAD: &str = r#"
local backlog = tonumber(redis.call('HGET', KEYS[1], 'backlog') or '0')
if backlog ~= 0 then return {0, backlog} end
redis.call('HSET', KEYS[1], 'avail', ARGV[1], 'backlog', 0, 'open', '1', 'inactive', ARGV[2])
local ok, err = pcall(redis.call, 'XGROUP', 'CREATE', KEYS[2], ARGV[3], '0', 'MKSTREAM')
redis.call('PUBLISH', ARGV[4], ARGV[5])
return {1, 0}
"#;

/// Forgets a resource that left redis mode (drained first), so a process that has not yet
/// seen the switch finds it cold and refuses rather than selling from stale stock.
///
/// KEYS[1] the resource hash; KEYS[2] the stream; KEYS[3] the limit counters.
pub const FORGET: &str = r#"
local backlog = tonumber(redis.call('HGET', KEYS[1], 'backlog') or '0')
if backlog ~= 0 then return backlog end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
return 0
"#;

"""The ledger's steps on Redis: one Lua script each, run by EVALSHA.

Each script is what the SQL statement of the same name decides
(storage/statements.py), as one atomic server-side step over the keys of one
hash slot (keys.py): the row, and its bucket's indexes, which every step
keeps in step with the row. Timestamps, generations and tokens travel as
decimal strings and are stored as they came: Lua's numbers are doubles, so
a 63-bit token is only ever compared as a string; timestamps are compared
as numbers (exact below 2^53 ms). A row's expiry is its retention from the
write (PEXPIRE: counted on the server's clock, whatever clock the ledger's
timestamps come from; replicas and the AOF get it as PEXPIREAT)."""

from __future__ import annotations

from collections.abc import Mapping

ROW = "'p', 'k', 'f', 's', 'g', 'rs', 'rb', 'rh', 'c', 'u'"

# KEYS: row, rows by time, pending. ARGV: member, principal, key,
# fingerprint, token, now, ttl_ms. CLAIM_OR_READ: {1} when claimed, else
# {0, the row in the way}.
CLAIM = f"""
if redis.call('EXISTS', KEYS[1]) == 1 then
  return {{0, redis.call('HMGET', KEYS[1], {ROW})}}
end
redis.call('HSET', KEYS[1], 'p', ARGV[2], 'k', ARGV[3], 'f', ARGV[4], 's', 'pending',
           'g', '1', 't', ARGV[5], 'c', ARGV[6], 'u', ARGV[6])
redis.call('PEXPIRE', KEYS[1], ARGV[7])
redis.call('ZADD', KEYS[2], ARGV[6], ARGV[1])
redis.call('ZADD', KEYS[3], ARGV[6], ARGV[1])
return {{1}}
"""

# TAKEOVER's two kinds. ARGV: member, fingerprint, token, now, stale_before,
# expired_before, ttl_ms. The new generation, or nil.
TAKEOVER = """
local r = redis.call('HMGET', KEYS[1], 's', 'f', 'u', 'g')
if not r[1] then return false end
local u = tonumber(r[3])
local expired = u < tonumber(ARGV[6])
if not (expired or (r[1] == 'pending' and r[2] == ARGV[2] and u < tonumber(ARGV[5]))) then
  return false
end
local g = tonumber(r[4]) + 1
redis.call('HDEL', KEYS[1], 'rs', 'rb', 'rh')
redis.call('HSET', KEYS[1], 'g', tostring(g), 't', ARGV[3], 'u', ARGV[4], 'f', ARGV[2], 's', 'pending')
if expired then redis.call('HSET', KEYS[1], 'c', ARGV[4]) end
redis.call('PEXPIRE', KEYS[1], ARGV[7])
redis.call('ZADD', KEYS[2], ARGV[4], ARGV[1])
redis.call('ZADD', KEYS[3], ARGV[4], ARGV[1])
return g
"""

# COMPLETE, fenced by generation and token. ARGV: member, generation,
# token, status, headers, now, ttl_ms, has_body ('1'/'0'), body.
COMPLETE = """
local r = redis.call('HMGET', KEYS[1], 's', 'g', 't')
if r[1] ~= 'pending' or r[2] ~= ARGV[2] or r[3] ~= ARGV[3] then return false end
redis.call('HSET', KEYS[1], 's', 'completed', 'rs', ARGV[4], 'rh', ARGV[5], 'u', ARGV[6])
if ARGV[8] == '1' then
  redis.call('HSET', KEYS[1], 'rb', ARGV[9])
else
  redis.call('HDEL', KEYS[1], 'rb')
end
redis.call('PEXPIRE', KEYS[1], ARGV[7])
redis.call('ZADD', KEYS[2], ARGV[6], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
return 1
"""

# COMPLETED_AS (a read). KEYS: row. ARGV: generation, token, status,
# headers, has_body, body.
COMPLETED_AS = """
local r = redis.call('HMGET', KEYS[1], 's', 'g', 't', 'rs', 'rh', 'rb')
if r[1] == 'completed' and r[2] == ARGV[1] and r[3] == ARGV[2] and r[4] == ARGV[3] and r[5] == ARGV[4] then
  if (ARGV[5] == '1' and r[6] == ARGV[6]) or (ARGV[5] == '0' and not r[6]) then return 1 end
end
return false
"""

# RELEASE. ARGV: member, generation, token.
RELEASE = """
local r = redis.call('HMGET', KEYS[1], 's', 'g', 't')
if r[1] ~= 'pending' or r[2] ~= ARGV[2] or r[3] ~= ARGV[3] then return false end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
return 1
"""

# RENEW_ONE. ARGV: member, generation, token, now, ttl_ms.
RENEW = """
local r = redis.call('HMGET', KEYS[1], 's', 'g', 't')
if r[1] ~= 'pending' or r[2] ~= ARGV[2] or r[3] ~= ARGV[3] then return 0 end
redis.call('HSET', KEYS[1], 'u', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
redis.call('ZADD', KEYS[2], ARGV[4], ARGV[1])
redis.call('ZADD', KEYS[3], ARGV[4], ARGV[1])
return 1
"""

# RECORD_FENCED: the event and the generation the row holds now, together.
# An event is stored as its fields, each `<length>:<bytes>` (rows.encode_event).
# KEYS: row, events, events by time, sequence. ARGV: principal, key,
# superseded generation, computed status, now. {sequence number, current generation or nil}.
RECORD_FENCED = """
local function field(s) return string.len(s) .. ':' .. s end
local current = redis.call('HGET', KEYS[1], 'g')
local seq = redis.call('INCR', KEYS[4])
redis.call('HSET', KEYS[2], seq, field(ARGV[1]) .. field(ARGV[2]) .. field(ARGV[3]) .. field(current or '')
           .. field(ARGV[4]) .. field(ARGV[5]))
redis.call('ZADD', KEYS[3], ARGV[5], seq)
return {seq, current}
"""

# PURGE, refusing a fresh pending row in the script itself. ARGV: member,
# stale_before ('' with --force). {0} none, {1, row} purged, {2, row} refused.
PURGE = f"""
local row = redis.call('HMGET', KEYS[1], {ROW})
if not row[1] then
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('ZREM', KEYS[3], ARGV[1])
  return {{0}}
end
if row[4] == 'pending' and ARGV[2] ~= '' and not (tonumber(row[10]) < tonumber(ARGV[2])) then
  return {{2, row}}
end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
return {{1, row}}
"""

# One bucket's sweep of rows. KEYS: rows by time, pending, then one row
# per member. ARGV: cutoff, then the members the index named below it. A
# row is deleted only if it is still past the cutoff (a takeover may have
# refreshed it since the index was read); the index entries of a row Redis
# already expired go too. How many entries went.
SWEEP_ROWS = """
local cutoff = tonumber(ARGV[1])
local n = 0
for i = 2, #ARGV do
  local row = KEYS[i + 1]
  local u = redis.call('HGET', row, 'u')
  if (not u) or tonumber(u) < cutoff then
    if u then redis.call('DEL', row) end
    redis.call('ZREM', KEYS[1], ARGV[i])
    redis.call('ZREM', KEYS[2], ARGV[i])
    n = n + 1
  end
end
return n
"""

# One bucket's fenced-out events past their retention. KEYS: events,
# events by time. ARGV: cutoff, limit. How many went.
SWEEP_FENCED = """
local ids = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', '(' .. ARGV[1], 'LIMIT', 0, ARGV[2])
if #ids > 0 then
  redis.call('HDEL', KEYS[1], unpack(ids))
  redis.call('ZREM', KEYS[2], unpack(ids))
end
return #ids
"""

# COPY_INSERT for one row: only where the key is absent. ARGV: member,
# ttl_ms, then field, value pairs. 1 when inserted.
COPY_INSERT = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
local s, u = unpack(redis.call('HMGET', KEYS[1], 's', 'u'))
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('ZADD', KEYS[2], u, ARGV[1])
if s == 'pending' then redis.call('ZADD', KEYS[3], u, ARGV[1]) end
return 1
"""

# COPY_UPDATE for one row: only an older version of the same request,
# stored under the same key (not its other form: "k" and k).
# ARGV: member, ttl_ms, fingerprint, generation, status, updated_at, key,
# then field, value pairs (rs, rb, rh absent when NULL).
COPY_UPDATE = """
local r = redis.call('HMGET', KEYS[1], 'f', 'g', 's', 'u', 'k')
if not r[1] or r[1] ~= ARGV[3] or r[5] ~= ARGV[7] then return 0 end
local g, ng = tonumber(r[2]), tonumber(ARGV[4])
if not (g < ng or (g == ng and r[3] == 'pending' and ARGV[5] == 'completed')
        or (g == ng and r[3] == ARGV[5] and tonumber(r[4]) < tonumber(ARGV[6]))) then
  return 0
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], unpack(ARGV, 8))
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[6], ARGV[1])
if ARGV[5] == 'pending' then
  redis.call('ZADD', KEYS[3], ARGV[6], ARGV[1])
else
  redis.call('ZREM', KEYS[3], ARGV[1])
end
return 1
"""

# COPY_FENCED: an event, unless an equal one is there. KEYS: events,
# events by time, sequence. ARGV: the event as stored, fenced_at.
COPY_FENCED = """
for _, value in ipairs(redis.call('HVALS', KEYS[1])) do
  if value == ARGV[1] then return 0 end
end
local seq = redis.call('INCR', KEYS[3])
redis.call('HSET', KEYS[1], seq, ARGV[1])
redis.call('ZADD', KEYS[2], ARGV[2], seq)
return 1
"""

# `init`'s version marker. KEYS: marker. ARGV: version, now, buckets. The
# version found before (nil: none), or an error when the buckets differ.
INIT = """
local found = redis.call('HMGET', KEYS[1], 'version', 'buckets')
if found[2] and found[2] ~= ARGV[3] then
  return redis.error_reply('this ledger was written with ' .. found[2] .. ' buckets, not ' .. ARGV[3])
end
if (not found[1]) or tonumber(found[1]) < tonumber(ARGV[1]) then
  redis.call('HSET', KEYS[1], 'version', ARGV[1], 'applied_at', ARGV[2], 'buckets', ARGV[3])
end
return found[1]
"""

SCRIPTS: Mapping[str, str] = {
    "claim": CLAIM,
    "takeover": TAKEOVER,
    "complete": COMPLETE,
    "completed_as": COMPLETED_AS,
    "release": RELEASE,
    "renew": RENEW,
    "record_fenced": RECORD_FENCED,
    "purge": PURGE,
    "sweep_rows": SWEEP_ROWS,
    "sweep_fenced": SWEEP_FENCED,
    "copy_insert": COPY_INSERT,
    "copy_update": COPY_UPDATE,
    "copy_fenced": COPY_FENCED,
    "init": INIT,
}

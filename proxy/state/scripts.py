"""The Lua scripts shared state runs in Redis: each one a read-decide-write that must be atomic.

Redis runs a script without interleaving other commands, so two instances writing the same
record or leasing from the same bucket see one consistent order. The scripts that need the
time take it from the Redis server (``TIME``), so the instances' clocks never decide between
them.
"""

# Write one replica record. ARGV: field, proposed record (JSON), mode, channel.
# mode 'write': a transition; 'fill': only if Redis has no record (re-sync after data loss).
# Returns the record that stands afterwards (the proposed one, or the one that won).
# Which one wins: a standing ejection over a second ejection (counted once), unless the second
# is an operator's and the first a detector's; otherwise the newer transition (``changed_at``;
# missing = 0, the oldest; a tie goes to the later write). A refused write changes nothing.
MERGE_RECORD = """
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local new = cjson.decode(ARGV[2])
-- A writer whose clock runs ahead must not outrank every later transition for the skew's
-- length: its transition counts as made now.
local changed = tonumber(new.changed_at) or 0
if changed * 1000 > now_ms then changed = now_ms / 1000 end
new.changed_at = changed
local raw = redis.call('HGET', KEYS[1], ARGV[1])
local cur = nil
if raw then cur = cjson.decode(raw) end
local last_ms = 0
if cur then
  if ARGV[3] == 'fill' then return raw end
  local cur_changed = tonumber(cur.changed_at) or 0
  local overrides = false
  if new.state == 'ejected' and cur.state == 'ejected' then
    local untl = cur['until']
    if untl == cjson.null or untl * 1000 > now_ms then  -- the stored ejection stands
      if new.reason ~= 'operator' or cur.reason == 'operator' then return raw end
      overrides = true
    end
  end
  if overrides then
    -- taken whatever the times; the stored transition time never goes back, so a stale
    -- write between the two cannot slip in after it
    new.changed_at = math.max(changed, cur_changed)
  elseif changed < cur_changed then
    return raw
  end
  local n = tonumber(cur.ejections) or 0
  if new.state == 'ejected' then n = n + 1 end
  new.ejections = n
  if type(cur.updated_at) == 'number' then last_ms = math.floor(cur.updated_at * 1000 + 0.5) end
end
new.updated_at = math.max(now_ms, last_ms + 1) / 1000
local out = cjson.encode(new)
redis.call('HSET', KEYS[1], ARGV[1], out)
redis.call('PUBLISH', ARGV[4], out)
return out
"""

# Drop a dead instance from the registry, unless it came back meanwhile.
PRUNE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return redis.call('SREM', KEYS[2], ARGV[1]) end
return 0
"""


# Take up to ARGV[2] units from the per-minute bucket of limit ARGV[1] (refilled continuously at
# limit/60 per second, by the server's clock). Returns {granted, level after}.
LEASE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local limit = tonumber(ARGV[1])
local want = tonumber(ARGV[2])
local v = redis.call('HMGET', KEYS[1], 'level', 'at')
local level = tonumber(v[1]) or limit
local at = tonumber(v[2]) or now
level = math.min(limit, level + math.max(0, now - at) * limit / 60)
local grant = math.max(0, math.min(want, level))
level = level - grant
redis.call('HSET', KEYS[1], 'level', tostring(level), 'at', tostring(now))
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return {tostring(grant), tostring(level)}
"""

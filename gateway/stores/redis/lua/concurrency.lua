-- Concurrency (requests in flight per key): mirrors gateway/algorithms/concurrency.py.
-- Parameters: limit, retry_after_us (-1: never said), slot_ttl_us, then the replica's id (the
-- rest of the string): a key's slots are held by replicas, each under its own id.
-- Storage (not a string like the others'): a hash, one field per replica holding slots of the
-- key, whose value is the slots held and the instant (Redis TIME, us) they expire unless the
-- replica renews them. The state the algorithm decides on is the sum of the live fields: a
-- replica that died or was cut off stops renewing, and its slots stop counting once expired.
-- Reply: allowed, 0, retry_after_us (-1: never), remaining, 0.
local SLOTS = {}

-- The replica's id in the parameters.
function SLOTS.owner(p)
  return string.sub(p, 26)
end

function SLOTS.ttl_us(p)
  return select(3, unpack_state('<ddd', p, 2))
end

-- Every replica's live slots of the key, and this replica's; expired fields removed when
-- ``purge`` (a call that writes).
function SLOTS.load(key, p, purge)
  local owner = SLOTS.owner(p)
  local fields = redis.call('HGETALL', key)
  local total, own = 0, 0
  for k = 1, #fields, 2 do
    local held, expires_us = unpack_state('<dd', fields[k + 1])
    if expires_us > now_us then
      total = total + held
      if fields[k] == owner then own = held end
    elseif purge then
      redis.call('HDEL', key, fields[k])
    end
  end
  return total, own
end

-- This replica's field: ``held`` slots, expiring a slot_ttl from now (none: removed); the
-- key lives as long as its longest-lived field could.
function SLOTS.put(key, p, held, min_ttl_ms)
  local owner = SLOTS.owner(p)
  local ttl_us = SLOTS.ttl_us(p)
  if held <= 0 then
    redis.call('HDEL', key, owner)
    return
  end
  redis.call('HSET', key, owner, pack_state('<dd', held, now_us + ttl_us))
  local ttl_ms = ceil_div(ttl_us, 1000) + 1
  if ttl_ms < min_ttl_ms then ttl_ms = min_ttl_ms end
  if redis.call('PTTL', key) < ttl_ms then redis.call('PEXPIRE', key, ttl_ms) end
end

MAKE['N'] = function()
  return {
    -- raw: the slots every replica holds (nil: none).
    decide = function(p, raw, now_us, cost)
      local limit, retry_us = unpack_state('<ddd', p, 2)
      local held = raw or 0
      if held + cost > limit then
        if cost > limit then retry_us = -1 end
        return 0, nil, 0, 0, retry_us, limit - held, 0
      end
      return 1, held + cost, 0, 0, 0, limit - held - cost, 0
    end,
  }
end

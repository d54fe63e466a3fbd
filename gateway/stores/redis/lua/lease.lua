-- Quota leasing: a replica takes a batch of a limit's quota (a lease) and decides from it
-- locally; this script grants leases and takes back what was left unused, atomically.
-- A script of its own (gateway/stores/redis/lease.py loads it after prelude.lua, which parses
-- ARGV[1] and ARGV[2]), not part of decide.lua: the state it keeps is a count of what was
-- handed out, not an algorithm's per-request state.
--
-- KEYS[1]   the limit key's lease state
-- KEYS[2]   the replicas that asked recently (a sorted set: replica -> last ask, in us)
-- ARGV[1]   'g' grant (after taking back ARGV[8]), 'r' take back only, 'q' take back and
--           leave (graceful shutdown), 'c' charge ARGV[7] units, as many as remain (what the
--           local fallback admitted while Redis was away); then the call's number, echoed
--           last in the reply
-- ARGV[2]   now in microseconds; '' reads Redis TIME, the one clock all replicas share
-- ARGV[3]   'F' fixed window, 'S' sliding window, 'T' token bucket
-- ARGV[4]   the quota: the window's limit, or the bucket's capacity
-- ARGV[5]   F, S: the window in us; T: microseconds per token, a decimal
-- ARGV[6]   this replica's name
-- ARGV[7]   units wanted (0: no history: the quota's units over ARGV[13], split evenly)
-- ARGV[8]   units taken back (unused of an earlier lease), ARGV[9] the window number that
--           lease was granted in (F, S; '' none)
-- ARGV[10]  share, ARGV[11] low water, in permille (lease_grant.py is the Python mirror)
-- ARGV[12]  how long an ask counts as recent, in us; T: also how long a lease lasts
-- ARGV[13]  the interval ARGV[7] is sized for, in us: a window ending sooner scales it down
-- Reply     granted (charged), window number (T: 0), lease lasts us, remaining after, retry in us
--           (nothing granted: when to ask again), call's number
-- prelude.lua has read ARGV[1] and ARGV[2] into mode, call_id and now_us.
local kind = ARGV[3]
local quota = tonumber(ARGV[4])
local span = tonumber(ARGV[5])
local replica = ARGV[6]
local want = tonumber(ARGV[7])
local back = tonumber(ARGV[8]) or 0
local back_index = tonumber(ARGV[9])
local share_pm = tonumber(ARGV[10])
local low_water_pm = tonumber(ARGV[11])
local recent_us = tonumber(ARGV[12])
local interval_us = tonumber(ARGV[13]) or 0

-- lease_grant.want_within: what the replica would spend before its lease ends
local function want_within(lasts)
  if want > 0 and lasts < interval_us then
    want = ceil_div(want * lasts, interval_us)
  end
end

-- lease_grant.first_ask: the quota's units over ``lasts`` (at most an interval) at its own
-- rate, the size of a grant to a replica with no history
local function first_ask(lasts)
  local over = interval_us
  if lasts and lasts < over then over = lasts end
  if kind == 'T' then return ceil_div(over, span) end
  return ceil_div(quota * over, span)
end

-- lease_grant.grant_size
local function grant_size(remaining, asking, fresh)
  if remaining <= 0 then return 0 end
  if asking < 1 then asking = 1 end
  local cap = ceil_div(remaining * share_pm, 1000)
  local even = ceil_div(remaining, asking)
  if want <= 0 or remaining * 1000 <= quota * low_water_pm then
    even = ceil_div(cap, asking)
  end
  if even < cap then cap = even end
  if want <= 0 then
    local first = ceil_div(fresh, asking)
    if first < cap then return first end
    return cap
  end
  if want > cap then return cap end
  return want
end

local asking = 1

-- What this call takes of what remains: a grant, sized ('g'; want_within first, for a lease
-- that lasts until ``lasts``), or a charge of the units wanted, as many as remain ('c').
local function take(remaining, lasts)
  if mode == 'c' then
    if remaining <= 0 then return 0 end
    if want < remaining then return want end
    return remaining
  end
  local fresh = first_ask(lasts)
  if lasts then want_within(lasts) end
  return grant_size(remaining, asking, fresh)
end

if mode == 'g' then
  redis.call('ZADD', KEYS[2], now_us, replica)
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now_us - recent_us)
  asking = redis.call('ZCARD', KEYS[2])
  redis.call('PEXPIRE', KEYS[2], ceil_div(recent_us, 1000) + 1)
elseif mode == 'q' then
  redis.call('ZREM', KEYS[2], replica)
end

local raw = redis.call('GET', KEYS[1])
local granted, index, lasts_us, remaining, retry_us = 0, 0, 0, 0, 0

if kind == 'F' then
  -- State: window number, units handed out in it.
  index = floor(now_us / span)
  local given = 0
  if raw then
    local state_index, state_given = struct.unpack('<dd', raw)
    if state_index == index then given = state_given end
  end
  if back > 0 and back_index == index then
    given = given - back
    if given < 0 then given = 0 end
  end
  lasts_us = (index + 1) * span - now_us
  if mode == 'g' or mode == 'c' then
    granted = take(quota - given, lasts_us)
    given = given + granted
  end
  remaining = quota - given
  if remaining < 0 then remaining = 0 end
  if granted == 0 then retry_us = lasts_us end
  redis.call('SET', KEYS[1], struct.pack('<dd', index, given), 'PX', ceil_div(lasts_us, 1000) + 1)
elseif kind == 'S' then
  -- State: window number, units handed out in the previous window and in this one; what
  -- remains is the sliding window's: the previous count weighted by its overlap.
  index = floor(now_us / span)
  local previous, current = 0, 0
  if raw then
    local state_index, state_previous, state_current = struct.unpack('<ddd', raw)
    if state_index == index then
      previous, current = state_previous, state_current
    elseif state_index == index - 1 then
      previous = state_current
    end
  end
  if back > 0 and back_index == index then
    current = current - back
    if current < 0 then current = 0 end
  elseif back > 0 and back_index == index - 1 then
    previous = previous - back
    if previous < 0 then previous = 0 end
  end
  local start_us = index * span
  local weighted = floor(previous * (span - (now_us - start_us)) / span)
  lasts_us = start_us + span - now_us
  if mode == 'g' or mode == 'c' then
    granted = take(quota - weighted - current, lasts_us)
    current = current + granted
  end
  remaining = quota - weighted - current
  if remaining < 0 then remaining = 0 end
  if granted == 0 then
    -- When a batch worth asking for is free again: the previous window's weight fades.
    local need = ceil_div(ceil_div(quota * low_water_pm, 1000), asking)
    if need < 1 then need = 1 end
    local room = quota - need - current
    if room >= 0 and previous > 0 then
      retry_us = start_us + span - floor(((room + 1) * span - 1) / previous) - now_us
    else
      retry_us = lasts_us
    end
    if retry_us < 1000 then retry_us = 1000 end
  end
  redis.call('SET', KEYS[1], struct.pack('<ddd', index, previous, current),
    'PX', ceil_div(start_us + 2 * span - now_us, 1000) + 1)
else
  -- Token bucket. State: the instant the bucket was empty, in us (a decimal); the tokens in
  -- it now are the time since, over the microseconds a token takes, up to the capacity.
  local full_span = quota * span
  local empty_at = now_us - full_span
  if raw then
    empty_at = struct.unpack('<d', raw)
    if empty_at < now_us - full_span then empty_at = now_us - full_span end
  end
  if back > 0 then empty_at = empty_at - back * span end
  if empty_at < now_us - full_span then empty_at = now_us - full_span end
  lasts_us = recent_us
  if mode == 'g' or mode == 'c' then
    granted = take(floor((now_us - empty_at) / span), nil)
    empty_at = empty_at + granted * span
  end
  remaining = floor((now_us - empty_at) / span)
  if granted == 0 then
    local need = ceil_div(ceil_div(quota * low_water_pm, 1000), asking)
    if need < 1 then need = 1 end
    retry_us = ceil_div(empty_at + need * span - now_us, 1)
    if retry_us < 1000 then retry_us = 1000 end
  end
  local full_in_us = empty_at + full_span - now_us
  if full_in_us > 0 then
    redis.call('SET', KEYS[1], struct.pack('<d', empty_at), 'PX', ceil_div(full_in_us, 1000) + 1)
  else
    redis.call('DEL', KEYS[1])
  end
end

return {granted, index, lasts_us, remaining, retry_us, call_id}

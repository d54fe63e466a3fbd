-- Token buckets: mirror gateway/algorithms/token_bucket.py (Guava SmoothBursty and
-- SmoothWarmingUp). Times there are ticks of 1 / ticks_per_us microseconds; now_us *
-- ticks_per_us can pass 2^53, so here every time is kept relative to now (small, exact) and
-- stored as whole microseconds plus leftover ticks.

-- ticks from now to the stored time (us, frac); nil when it is more than `floor_ticks` ago.
local function tb_relative(us, frac, now_us, tpu, floor_ticks)
  if us - now_us < -ceil_div(floor_ticks, tpu) - 1 then return nil end
  return (us - now_us) * tpu + frac
end

-- now + rel ticks, as (whole microseconds, leftover ticks).
local function tb_absolute(now_us, rel, tpu)
  local whole = floor(rel / tpu)
  return now_us + whole, rel - whole * tpu
end

-- Token bucket (SmoothBursty), theoretical arrival time (TAT) state.
-- Parameters: ticks_per_us, interval_ticks, max_credit_ticks, queue (1) or reject (0),
-- capacity, max_delay_ticks (inf: unbounded).
-- State: TAT as (us, frac).
-- Reply: allowed, delay_ticks, retry_ticks (-1: never), remaining, reset_ticks.
MAKE['T'] = function()
  local function tb_tat(raw, now_us, tpu, max_credit)
    local tat = -max_credit -- resync: credit beyond a full bucket is lost
    if raw then
      local us, frac = unpack_state('<dd', raw)
      local rel = tb_relative(us, frac, now_us, tpu, max_credit)
      if rel and rel > tat then tat = rel end
    end
    return tat
  end

  local function tb_remaining(tat, interval)
    if tat < 0 then return floor(-tat / interval) end
    return 0
  end

  return {
    decide = function(p, raw, now_us, cost)
      local tpu, interval, max_credit, queue, capacity, max_delay =
        unpack_state('<dddddd', p, 2)
      local tat = tb_tat(raw, now_us, tpu, max_credit)
      local tat_new = tat + cost * interval
      local delay = 0
      if queue == 1 then
        if tat > max_delay then
          return 0, nil, 0, 0, tat - max_delay, tb_remaining(tat, interval), tat + max_credit
        end
        if tat > 0 then delay = tat end
      elseif tat_new > 0 then
        local retry = tat_new
        if cost > capacity then retry = -1 end
        return 0, nil, 0, 0, retry, tb_remaining(tat, interval), tat + max_credit
      end
      return 1, pack_state('<dd', tb_absolute(now_us, tat_new, tpu)), (tat_new + max_credit) / tpu,
        delay, 0, tb_remaining(tat_new, interval), tat_new + max_credit, delay / (tpu * 1000000)
    end,

    refund = function(p, raw, now_us, cost)
      local tpu, interval, max_credit = unpack_state('<ddd', p, 2)
      local tat = tb_tat(raw, now_us, tpu, max_credit) - cost * interval
      if tat < -max_credit then tat = -max_credit end
      return pack_state('<dd', tb_absolute(now_us, tat, tpu)), (tat + max_credit) / tpu
    end,

    -- As full relative to the capacity (rounded down); a debt (queue mode) keeps its length
    -- in time, rounded up to a microsecond.
    rescale = function(p, old_p, raw, now_us)
      local tpu, _, max_credit = unpack_state('<ddd', p, 2)
      local old_tpu, _, old_max_credit = unpack_state('<ddd', old_p, 2)
      local tat = tb_tat(raw, now_us, old_tpu, old_max_credit)
      if tat > 0 then
        local debt = ceil_div(tat, old_tpu) * tpu
        return pack_state('<dd', now_us + debt / tpu, 0), (debt + max_credit) / tpu
      end
      local credit = muldiv(-tat, max_credit, old_max_credit)
      if credit >= max_credit then return nil, 0 end
      return pack_state('<dd', tb_absolute(now_us, -credit, tpu)), (max_credit - credit) / tpu
    end,
  }
end

-- Token bucket with warm-up (SmoothWarmingUp, coldFactor 3), starting cold.
-- Parameters: ticks_per_us, interval_ticks, warmup_ticks, max_delay_ticks (inf: unbounded),
-- then Guava's doubles: stable_interval_us, threshold_permits, slope.
-- State: next free time as (us, frac), credit ticks (stored permits * interval).
-- Reply: allowed, delay_ticks, retry_ticks, remaining, reset_ticks.
MAKE['W'] = function()
  local function wu_permits_to_time(permits, stable, slope)
    return stable + permits * slope
  end

  -- Guava's storedPermitsToWaitTime, in the same double operations and order as the Python.
  local function wu_wait_us(stored, take, stable, threshold, slope)
    local above = stored - threshold
    local micros = 0
    if above > 0.0 then
      local above_take = math.min(above, take)
      local length = wu_permits_to_time(above, stable, slope)
        + wu_permits_to_time(above - above_take, stable, slope)
      micros = floor(above_take * length / 2.0)
      take = take - above_take
    end
    return micros + floor(stable * take)
  end

  -- Guava's resync: idle time becomes stored permits, up to cold. Returns next free (relative
  -- to now) and credit.
  local function wu_resync(raw, now_us, tpu, warmup)
    if not raw then return 0, warmup end
    local us, frac, credit = unpack_state('<ddd', raw)
    local next_free = tb_relative(us, frac, now_us, tpu, warmup)
    if not next_free then return 0, warmup end
    if next_free < 0 then
      credit = credit - next_free
      if credit > warmup then credit = warmup end
      next_free = 0
    end
    return next_free, credit
  end

  return {
    decide = function(p, raw, now_us, cost)
      local tpu, interval, warmup, max_delay, stable, threshold, slope =
        unpack_state('<ddddddd', p, 2)
      local next_free, credit = wu_resync(raw, now_us, tpu, warmup)
      local wait = next_free
      if wait > max_delay then
        return 0, nil, 0, 0, wait - max_delay, 0, next_free + warmup - credit
      end
      -- reserveEarliestAvailable: stored permits first, at their warm-up price, then fresh ones.
      local required = cost * interval
      local spend = credit
      if credit >= required then spend = required end
      next_free = next_free
        + wu_wait_us(credit / interval, spend / interval, stable, threshold, slope) * tpu
        + required - spend
      credit = credit - spend
      local delay = 0
      if wait > 0 then delay = wait end
      local remaining = 0
      if next_free <= 0 then remaining = 1 end
      local nf_us, nf_frac = tb_absolute(now_us, next_free, tpu)
      local reset = next_free + warmup - credit
      return 1, pack_state('<ddd', nf_us, nf_frac, credit), reset / tpu,
        delay, 0, remaining, reset, delay / (tpu * 1000000)
    end,

    -- Pull the next free time back by cost intervals, never before now; coldness stays.
    refund = function(p, raw, now_us, cost)
      local tpu, interval, warmup = unpack_state('<ddd', p, 2)
      local us, frac, credit = unpack_state('<ddd', raw)
      local next_free = tb_relative(us, frac, now_us, tpu, warmup)
      if not next_free or next_free <= 0 then return nil, 0 end
      next_free = next_free - cost * interval
      if next_free < 0 then next_free = 0 end
      local nf_us, nf_frac = tb_absolute(now_us, next_free, tpu)
      return pack_state('<ddd', nf_us, nf_frac, credit), (next_free + warmup - credit) / tpu
    end,

    -- The same share of coldness (rounded up: colder is stricter) and the same next free time
    -- (rounded up to a microsecond).
    rescale = function(p, old_p, raw, now_us)
      local tpu, _, warmup = unpack_state('<ddd', p, 2)
      local old_tpu, _, old_warmup = unpack_state('<ddd', old_p, 2)
      local next_free, credit = wu_resync(raw, now_us, old_tpu, old_warmup)
      credit = muldiv(credit, warmup, old_warmup, true)
      local wait_us = ceil_div(next_free, old_tpu)
      if credit >= warmup and wait_us <= 0 then return nil, 0 end
      local idle = wait_us * tpu + warmup - credit
      return pack_state('<ddd', now_us + wait_us, 0, credit), idle / tpu
    end,
  }
end

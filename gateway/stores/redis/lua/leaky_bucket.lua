-- Leaky bucket, nginx limit_req: mirrors gateway/algorithms/leaky_bucket.py.
-- Parameters: rate_milli, burst_milli, delay_milli (inf: nodelay).
-- State: excess_milli, last_ms.
-- Reply: allowed, delay_ms, retry_after_us (-1: never), remaining, reset_us.
MAKE['L'] = function()
  local function lb_recovered_ms(last_ms, excess, rate)
    -- Full recovery (what a new key would see) once excess + 1000 has drained.
    return last_ms + ceil_div((excess + 1000) * 1000, rate)
  end

  return {
    decide = function(p, raw, now_us, cost)
      local rate, burst, delay = unpack_state('<ddd', p, 2)
      local now_ms = floor(now_us / 1000)
      local excess, last_ms
      local prev_excess, prev_last
      if raw then
        prev_excess, prev_last = unpack_state('<dd', raw)
        last_ms = prev_last
        local ms = now_ms - last_ms
        if ms < 0 then
          if ms < -60000 then ms = 1 else ms = 0 end
        end
        -- rate * ms may pass 2^53 (a high rate, a long idle time), rounded; but then the drain
        -- is over 2^53 / 1000, more than any excess the codec allows (burst_milli + 2000 below
        -- 2^53 / 1000), and the excess is 0 either way.
        excess = prev_excess - floor(rate * ms / 1000) + 1000
        if excess < 0 then excess = 0 end
        if ms ~= 0 then last_ms = now_ms end
      else
        excess = 0
        last_ms = now_ms
      end
      excess = excess + (cost - 1) * 1000
      if excess > burst then
        if not raw or (cost - 1) * 1000 > burst then
          return 0, nil, 0, 0, -1, 0, 0
        end
        local needed = prev_excess + cost * 1000 - burst
        local admit_us = (prev_last + ceil_div(needed * 1000, rate)) * 1000
        local recovered_us = lb_recovered_ms(prev_last, prev_excess, rate) * 1000
        local retry_us = admit_us - now_us
        if retry_us < 0 then retry_us = 0 end
        local reset_us = recovered_us - now_us
        if reset_us < 0 then reset_us = 0 end
        return 0, nil, 0, 0, retry_us, 0, reset_us
      end
      local delay_ms = 0
      if excess > delay then
        delay_ms = floor((excess - delay) * 1000 / rate)
      end
      local recovered_ms = lb_recovered_ms(last_ms, excess, rate)
      local reset_us = recovered_ms * 1000 - now_us
      return 1, pack_state('<dd', excess, last_ms), recovered_ms * 1000 - now_us,
        delay_ms, 0, floor((burst - excess) / 1000), reset_us, delay_ms / 1000
    end,

    refund = function(p, raw, now_us, cost)
      local rate = unpack_state('<d', p, 2)
      local excess, last_ms = unpack_state('<dd', raw)
      excess = excess - cost * 1000
      if excess < 0 then excess = 0 end
      local recovered_us = lb_recovered_ms(last_ms, excess, rate) * 1000
      return pack_state('<dd', excess, last_ms), recovered_us - now_us
    end,

    -- As full, relative to burst + 1, under the new parameters.
    rescale = function(p, old_p, raw, now_us)
      local rate, burst = unpack_state('<dd', p, 2)
      local old_rate, old_burst = unpack_state('<dd', old_p, 2)
      local now_ms = floor(now_us / 1000)
      -- In use: the excess a one-unit request would leave, 0 when as good as new.
      local excess, last_ms = unpack_state('<dd', raw)
      local ms = now_ms - last_ms
      if ms < 0 then
        if ms < -60000 then ms = 1 else ms = 0 end
      end
      local used = excess - floor(old_rate * ms / 1000) + 1000
      if used <= 0 then return nil, 0 end
      used = muldiv(used, burst + 1000, old_burst + 1000, true)
      excess, last_ms = 0, now_ms
      if used >= 1000 then
        excess = used - 1000
      else
        -- Partly drained below one request: an empty bucket last touched a little while ago.
        last_ms = now_ms - floor((1000 - used) * 1000 / rate)
        if last_ms < 0 then last_ms = 0 end
      end
      local recovered_us = lb_recovered_ms(last_ms, excess, rate) * 1000
      return pack_state('<dd', excess, last_ms), recovered_us - now_us
    end,
  }
end

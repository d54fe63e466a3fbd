-- Sliding log: mirrors gateway/algorithms/sliding_log.py.
-- Parameters: limit, window_us.
-- State: the admission time of every unit admitted in the last window, oldest first, one
-- little-endian double each (exact: times are integers below 2^53).
-- Reply: allowed, 0, retry_after_us (-1: never), remaining, reset_us.
MAKE['G'] = function()
  local function sl_time(raw, i) -- entry i, counting from 0
    return (unpack_state('<d', raw, i * 8 + 1))
  end

  local function sl_bisect_right(raw, count, x) -- how many entries are <= x
    local lo, hi = 0, count
    while lo < hi do
      local mid = floor((lo + hi) / 2)
      if x < sl_time(raw, mid) then hi = mid else lo = mid + 1 end
    end
    return lo
  end

  return {
    decide = function(p, raw, now_us, cost)
      local limit, window_us = unpack_state('<dd', p, 2)
      local horizon_us = now_us - window_us -- entries at or before this have left the window
      if not raw or #raw == 0 then
        if cost > limit then
          return 0, nil, 0, 0, -1, limit, 0
        end
        return 1, string.rep(pack_state('<d', now_us), cost), window_us,
          0, 0, limit - cost, window_us
      end
      local count = #raw / 8
      local newest_us = sl_time(raw, count - 1)
      -- The entry that must have left the window for `cost` more units to fit.
      local blocking = count - (limit - cost) - 1
      if cost > limit or (blocking >= 0 and sl_time(raw, blocking) > horizon_us) then
        local in_window = count - sl_bisect_right(raw, count, horizon_us)
        local retry_us = -1
        if cost <= limit then retry_us = sl_time(raw, blocking) - horizon_us end
        local reset_us = newest_us + window_us - now_us
        if reset_us < 0 then reset_us = 0 end
        return 0, nil, 0, 0, retry_us, limit - in_window, reset_us
      end
      local keep_from = sl_bisect_right(raw, count, horizon_us)
      if blocking >= keep_from then keep_from = blocking + 1 end
      local stamp_us = newest_us
      if now_us > newest_us then stamp_us = now_us end
      local kept = count - keep_from
      local reset_us = stamp_us + window_us - now_us
      return 1, string.sub(raw, keep_from * 8 + 1) .. string.rep(pack_state('<d', stamp_us), cost),
        reset_us, 0, 0, limit - kept - cost, reset_us
    end,

    -- Exact given the instant the request was charged: `cost` entries stamped then are
    -- removed (none if the clock had stepped back and they were stamped later, or if they have
    -- expired). Without it nothing comes back: which entries are the request's is unknown.
    refund = function(p, raw, now_us, cost, charged_us)
      if not charged_us or #raw == 0 then return nil, 0 end
      local window_us = select(2, unpack_state('<dd', p, 2))
      local count = #raw / 8
      local first = sl_bisect_right(raw, count, charged_us - 1)
      local last = sl_bisect_right(raw, count, charged_us)
      if first + cost < last then last = first + cost end
      if first == last then return nil, 0 end
      local log = string.sub(raw, 1, first * 8) .. string.sub(raw, last * 8 + 1)
      if #log == 0 then return log, 0 end
      return log, sl_time(log, #log / 8 - 1) + window_us - now_us
    end,

    -- The same share of the limit used: the entries in the window resampled to
    -- ceil(n * limit / old_limit) entries, spread evenly and ending at the newest.
    rescale = function(p, old_p, raw, now_us)
      local limit, window_us = unpack_state('<dd', p, 2)
      local old_limit, old_window_us = unpack_state('<dd', old_p, 2)
      if #raw == 0 then return nil, 0 end
      local total = #raw / 8
      local first = sl_bisect_right(raw, total, now_us - old_window_us)
      local count = total - first
      if count == 0 then return nil, 0 end
      local count_new = muldiv(count, limit, old_limit, true)
      if count_new > limit then count_new = limit end
      local entries = {}
      for j = 1, count_new do
        -- entry j of the new log stands for entry ceil(j * count / count_new) of the old one
        local taken = first + muldiv(j, count, count_new, true)
        entries[j] = string.sub(raw, taken * 8 - 7, taken * 8)
      end
      return table.concat(entries), sl_time(raw, total - 1) + window_us - now_us
    end,
  }
end

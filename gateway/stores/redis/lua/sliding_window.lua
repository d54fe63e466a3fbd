-- Sliding window counter: mirrors gateway/algorithms/sliding_window.py.
-- Parameters: limit, window_us.
-- State: window_index, previous, current.
-- Reply: allowed, 0, retry_after_us (-1: never), remaining, reset_us.
MAKE['S'] = function()
  local function sw_counts_at(raw, index)
    if not raw then return index, 0, 0 end
    local state_index, previous, current = unpack_state('<ddd', raw)
    if state_index >= index then -- this window, or a newer one the clock stepped back from
      return state_index, previous, current
    end
    if state_index == index - 1 then return index, current, 0 end
    return index, 0, 0
  end

  return {
    decide = function(p, raw, now_us, cost)
      local limit, window_us = unpack_state('<dd', p, 2)
      local index, previous, current = sw_counts_at(raw, floor(now_us / window_us))
      local start_us = index * window_us
      local elapsed_us = now_us - start_us
      if elapsed_us < 0 then elapsed_us = 0 end
      -- The previous window's count, weighted by the share of it still inside the sliding
      -- window, rounded down (a product that can pass 2^53: a large limit, a long window).
      local weighted = muldiv(previous, window_us - elapsed_us, window_us)
      local used = weighted + current + cost
      if used > limit then
        local remaining = limit - weighted - current
        if remaining < 0 then remaining = 0 end
        local recovered_us = start_us + window_us
        if current > 0 then recovered_us = recovered_us + window_us end
        local reset_us = recovered_us - now_us
        if reset_us < 0 then reset_us = 0 end
        if cost > limit then
          return 0, nil, 0, 0, -1, remaining, reset_us
        end
        local admit_us
        local room = limit - cost - current
        if room >= 0 then
          -- Later in this window, once previous * weight_us // window_us <= room:
          -- ((room + 1) * window_us - 1) // previous, which is the ceiling less one.
          admit_us = start_us + window_us - (muldiv(room + 1, window_us, previous, true) - 1)
        else
          -- Next window, where the current count becomes the previous one.
          local weight_max_us = muldiv(limit - cost + 1, window_us, current, true) - 1
          if weight_max_us > window_us then weight_max_us = window_us end
          admit_us = start_us + 2 * window_us - weight_max_us
        end
        local retry_us = admit_us - now_us
        if retry_us < 1 then retry_us = 1 end
        return 0, nil, 0, 0, retry_us, remaining, reset_us
      end
      current = current + cost
      local reset_us = start_us + 2 * window_us - now_us
      return 1, pack_state('<ddd', index, previous, current), reset_us,
        0, 0, limit - used, reset_us
    end,

    -- Exact given the instant the request was charged: the cost comes off the window it was
    -- counted in. Without it nothing comes back (it could forgive a previous window's charge
    -- counted at full weight).
    refund = function(p, raw, now_us, cost, charged_us)
      if not charged_us then return nil, 0 end
      local window_us = select(2, unpack_state('<dd', p, 2))
      local index, previous, current = unpack_state('<ddd', raw)
      local charged_index = floor(charged_us / window_us)
      if charged_index == index then
        if current > cost then current = current - cost else current = 0 end
      elseif charged_index == index - 1 then
        if previous > cost then previous = previous - cost else previous = 0 end
      else
        return nil, 0
      end
      return pack_state('<ddd', index, previous, current), (index + 2) * window_us - now_us
    end,

    -- Same window length: both counters scaled to the new limit, rounded up. A new length:
    -- the weighted count becomes the same share of the new limit in the new current window.
    rescale = function(p, old_p, raw, now_us)
      local limit, window_us = unpack_state('<dd', p, 2)
      local old_limit, old_window_us = unpack_state('<dd', old_p, 2)
      local index, previous, current = sw_counts_at(raw, floor(now_us / old_window_us))
      if previous == 0 and current == 0 then return nil, 0 end
      if window_us == old_window_us then
        previous = muldiv(previous, limit, old_limit, true)
        if previous > limit then previous = limit end
        current = muldiv(current, limit, old_limit, true)
        if current > limit then current = limit end
        return pack_state('<ddd', index, previous, current), (index + 2) * window_us - now_us
      end
      local elapsed_us = now_us - index * old_window_us
      if elapsed_us < 0 then elapsed_us = 0 end
      -- ceil((previous * (old_window_us - elapsed_us) + current * old_window_us) * limit
      -- / (old_limit * old_window_us)), in limbs when a product passes 2^53.
      local used = previous * (old_window_us - elapsed_us) + current * old_window_us
      local count
      if used < 9007199254740992 and old_limit * old_window_us < 9007199254740992 then
        count = muldiv(used, limit, old_limit * old_window_us, true)
      else
        local w = wide()
        local wide_used = w.add(w.mul(w.of(previous), w.of(old_window_us - elapsed_us)),
          w.mul(w.of(current), w.of(old_window_us)))
        count = w.div(w.mul(wide_used, w.of(limit)),
          w.mul(w.of(old_limit), w.of(old_window_us)), true)
      end
      if count > limit then count = limit end
      if count == 0 then return nil, 0 end
      index = floor(now_us / window_us)
      return pack_state('<ddd', index, 0, count), (index + 2) * window_us - now_us
    end,
  }
end

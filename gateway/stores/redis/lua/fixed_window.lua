-- Fixed window counter: mirrors gateway/algorithms/fixed_window.py.
-- Parameters: limit, window_us.
-- State: window_index, count.
-- Reply: allowed, 0, retry_after_us (-1: never), remaining, reset_us.
MAKE['F'] = function()
  return {
    decide = function(p, raw, now_us, cost)
      local limit, window_us = unpack_state('<dd', p, 2)
      local index = floor(now_us / window_us)
      local count = 0
      if raw then
        local state_index, state_count = unpack_state('<dd', raw)
        if state_index >= index then -- this window, or a newer one the clock stepped back from
          index = state_index
          count = state_count
        end
      end
      local reset_us = (index + 1) * window_us - now_us
      count = count + cost
      if count > limit then
        local retry_us = reset_us
        if cost > limit then retry_us = -1 end
        return 0, nil, 0, 0, retry_us, limit - count + cost, reset_us
      end
      return 1, pack_state('<dd', index, count), reset_us, 0, 0, limit - count, reset_us
    end,

    -- Exact given the instant the request was charged; without it nothing comes back, since
    -- a charge counted in an earlier window would come off the current one.
    refund = function(p, raw, now_us, cost, charged_us)
      if not charged_us then return nil, 0 end
      local window_us = select(2, unpack_state('<dd', p, 2))
      local index, count = unpack_state('<dd', raw)
      if floor(charged_us / window_us) ~= index then return nil, 0 end -- that window is over
      if count > cost then count = count - cost else count = 0 end
      return pack_state('<dd', index, count), (index + 1) * window_us - now_us
    end,

    -- The same share of the window's quota used, rounded up; with a new window length the
    -- count moves to the new window holding now.
    rescale = function(p, old_p, raw, now_us)
      local limit, window_us = unpack_state('<dd', p, 2)
      local old_limit, old_window_us = unpack_state('<dd', old_p, 2)
      local index, count = unpack_state('<dd', raw)
      if index < floor(now_us / old_window_us) then return nil, 0 end -- idle
      count = muldiv(count, limit, old_limit, true)
      if count > limit then count = limit end
      if count == 0 then return nil, 0 end
      if window_us ~= old_window_us then index = floor(now_us / window_us) end
      return pack_state('<dd', index, count), (index + 1) * window_us - now_us
    end,
  }
end

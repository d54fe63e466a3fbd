-- Calendar window: mirrors gateway/algorithms/calendar_window.py.
-- Parameters: limit, and a number naming the period and time zone (a change of either starts
-- the keys afresh).
-- State: period (the ordinal of its first day), count.
-- Per call: 'o0 s0 o1 s1 e1 o2 e2', read off the calendar by the gateway: the period holding
-- its calendar time (ordinal of its first day, start, end), the one before it (ordinal, start;
-- it ends at s1) and the one after (ordinal, end; it starts at e1). Redis TIME picks among
-- them, so replicas whose clocks disagree (by less than a period) count a request in the same
-- period; a state already in a newer period keeps counting there.
-- Reply: allowed, 0, retry_after_us (-1: never), remaining, reset_us.
MAKE['C'] = function()
  local function periods(extra)
    local o0, s0, o1, s1, e1, o2, e2 = string.match(
      extra, '^(%d+) (%-?%d+) (%d+) (%-?%d+) (%-?%d+) (%d+) (%-?%d+)$'
    )
    return tonumber(o0), tonumber(s0), tonumber(o1), tonumber(s1), tonumber(e1),
      tonumber(o2), tonumber(e2)
  end

  -- The period now_us is in, by Redis TIME: its ordinal and end.
  local function now_period(extra, now_us)
    local o0, _, o1, s1, e1, o2, e2 = periods(extra)
    if now_us < s1 then return o0, s1 end
    if now_us >= e1 then return o2, e2 end
    return o1, e1
  end

  -- The end of the period numbered index, if the call names it (else the latest it names).
  local function end_of(extra, index)
    local o0, _, o1, s1, e1, _, e2 = periods(extra)
    if index == o0 then return s1 end
    if index == o1 then return e1 end
    return e2
  end

  -- The period a request at now_us counts in, its end, and the count already there.
  local function current(extra, raw, now_us)
    local index, end_us = now_period(extra, now_us)
    if not raw then return index, end_us, 0 end
    local state_index, count = unpack_state('<dd', raw)
    if state_index == index then return index, end_us, count end
    if state_index > index then -- a newer period the clock stepped back from
      return state_index, end_of(extra, state_index), count
    end
    return index, end_us, 0
  end

  return {
    decide = function(p, raw, now_us, cost, extra)
      local limit = unpack_state('<d', p, 2)
      local index, end_us, count = current(extra, raw, now_us)
      local reset_us = end_us - now_us
      count = count + cost
      if count > limit then
        local retry_us = reset_us
        if cost > limit then retry_us = -1 end
        return 0, nil, 0, 0, retry_us, limit - count + cost, reset_us
      end
      return 1, pack_state('<dd', index, count), reset_us, 0, 0, limit - count, reset_us
    end,

    -- Exact given the instant the request was charged, if that is in one of the periods the
    -- call names (a charge to an older period has nothing left to give back).
    refund = function(p, raw, now_us, cost, charged_us, extra)
      if not charged_us then return nil, 0 end
      local o0, s0, o1, s1, e1, o2, e2 = periods(extra)
      local index, count = unpack_state('<dd', raw)
      local charged_index = nil
      if charged_us >= s0 and charged_us < s1 then
        charged_index = o0
      elseif charged_us >= s1 and charged_us < e1 then
        charged_index = o1
      elseif charged_us >= e1 and charged_us < e2 then
        charged_index = o2
      end
      if charged_index ~= index then return nil, 0 end
      if count > cost then count = count - cost else count = 0 end
      return pack_state('<dd', index, count), end_of(extra, index) - now_us
    end,

    -- The same share of the quota used, rounded up, in the same period; another period or
    -- time zone starts afresh.
    rescale = function(p, old_p, raw, now_us, extra)
      local limit, calendar = unpack_state('<dd', p, 2)
      local old_limit, old_calendar = unpack_state('<dd', old_p, 2)
      if calendar ~= old_calendar then return nil, 0 end
      local index, count = unpack_state('<dd', raw)
      local now_index, now_end = now_period(extra, now_us)
      if index < now_index then return nil, 0 end -- idle
      count = muldiv(count, limit, old_limit, true)
      if count > limit then count = limit end
      if count == 0 then return nil, 0 end
      local end_us = now_end
      if index > now_index then end_us = end_of(extra, index) end
      return pack_state('<dd', index, count), end_us - now_us
    end,
  }
end

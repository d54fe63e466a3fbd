-- One request's limits, checked then committed in one atomic step (nginx's multi-zone rule):
-- every limit decides at one instant; the new states are written only if all admit the
-- request, so a request rejected by any limit is charged to none.
--
-- KEYS[i]    the state key of limit i (one hash tag for all: one slot in a cluster)
-- ARGV[1]    'd' decide and commit, 'p' decide and commit nothing (explain), 'r' refund,
--            'c' charge (what the local fallback admitted while Redis was away: as much of
--            the cost as each limit still has room for, however long it delays),
--            then the call's number, echoed last in the reply: the client checks each reply
--            is its own call's, so no reply can ever be taken for another call's verdict
-- ARGV[2]    now in microseconds; '' reads Redis TIME, the one clock all replicas share
-- ARGV[3]    cost of the request: one number for every limit, or one per limit separated
--            by spaces (limits may weigh a request differently)
-- ARGV[4]    least time to live in ms for written keys (0: expire as soon as idle)
-- ARGV[4+i]  limit i's parameters: algorithm letter, then its numbers. A key holds the
--            parameters it was written under, then the state: a state written under other
--            parameters (a reload, here or on another replica) is rescaled to these as the
--            Python algorithm's rescale does, and in modes 'd' and 'r' written back rescaled
--            even when the request is rejected (a rescale is not a charge)
-- ARGV[4+n+i] the longest limit i may delay this request, in seconds ('': no bound); a
--            request that would wait longer is refused, and charged nothing. 'a': the limit
--            is charged after the response (mode 'c'), so 'd' decides it and writes nothing
-- ARGV[5+2n] refund: the now_us of the decision that charged the request ('': unknown),
--            which lets the windows give back exactly that charge
-- ARGV[5+2n+i] when a limit of the call needs it: what limit i's algorithm takes beside its
--            parameters (a calendar window's periods, read off the calendar by the gateway;
--            '' for the others), after ARGV[5+2n] ('' then, but for a refund)
--            'k' keep a replica's concurrency slots alive (each limit's cost: the slots the
--            replica knows it holds, written when Redis has none of its slots of the key left,
--            after it was cut off longer than their time to live)
-- Reply      now_us, then 5 integers per limit: allowed, then the algorithm's four, then
--            the call's number; for 'c', now_us, what each limit took, the call's number;
--            for 'r' and 'k', now_us and the call's number.
-- A concurrency limit ('N', in flight) keeps its key's slots in a hash, one field per replica
-- (concurrency.lua): a decision counts every replica's live slots, a commit or a refund
-- changes this replica's only; nothing of it is rescaled or charged after the response.
-- Modes 'D' and 'P' are 'd' and 'p' with penalty boxes (a limit's ``penalty:``, and the
-- blocks an operator puts on a key of any limit: every decision and look of the gateway's):
-- KEYS[n+i] is then limit i's penalty box for the key (same hash tag), ARGV[5+2n] and the
-- ARGV[5+2n+i] are all present ('' where unused), and ARGV[5+3n+i] is limit i's penalty,
-- 'after within_us block_us' ('': none). A key in a box is refused before any limit decides,
-- nothing written ('P', a look, decides all the same: what the key would meet once its block
-- ends); a rejection in 'D' strikes the rejecting limits' boxes. The reply has two more
-- integers before the call's number: the limit (1-based) whose box refuses the request (0:
-- none), and until when.
-- prelude.lua has read ARGV[1] and ARGV[2] into mode, call_id and now_us.
-- One cost (nearly every call) without the pattern matching and table that a list takes.
local one_cost = tonumber(ARGV[3])
local costs
if not one_cost then
  costs = {}
  for c in string.gmatch(ARGV[3], '%d+') do costs[#costs + 1] = tonumber(c) end
end
local function cost_of(i) return one_cost or costs[i] or costs[1] end
local min_ttl_ms = tonumber(ARGV[4])
local n = #KEYS
local boxes = mode == 'D' or mode == 'P'
if boxes then
  n = n / 2
  mode = string.lower(mode)
end
local function extra(i) return ARGV[5 + 2 * n + i] end
local function after(i) return ARGV[4 + n + i] == 'a' end
local function holds_slots(p) return string.byte(p, 1) == 78 end -- 'N'

if mode == 'k' then
  for i = 1, n do
    local p = ARGV[4 + i]
    -- What Redis has is kept: a call taking or giving back slots may be on its way, and an
    -- increment or a decrement is right whenever it lands.
    local held = select(2, SLOTS.load(KEYS[i], p, true))
    if held == 0 then held = cost_of(i) end
    SLOTS.put(KEYS[i], p, held, min_ttl_ms)
  end
  return {now_us, call_id}
end

-- An idle state is what an absent key means, so a key lives until its state is idle.
local function store(key, p, state, idle_in_us)
  if not state then
    redis.call('DEL', key)
    return
  end
  local ttl_ms = ceil_div(idle_in_us, 1000) + 1
  if ttl_ms < min_ttl_ms then ttl_ms = min_ttl_ms end
  if idle_in_us <= 0 and min_ttl_ms == 0 then
    redis.call('DEL', key)
  else
    -- As a string: Redis 7.0 writes a number argument with printf's %.17g, several times
    -- the work of an integer's %d.
    redis.call('SET', key, p .. state, 'PX', string.format('%d', ttl_ms))
  end
end

-- Limit i's state under its parameters p (nil: none), and when it was written under others,
-- true and the rescaled state's idle time.
local function load(i, p)
  local raw = redis.call('GET', KEYS[i])
  if not raw then return nil end
  local np = #p
  if string.find(raw, p, 1, true) == 1 then return string.sub(raw, np + 1) end
  local written = string.sub(raw, 1, np)
  if string.byte(raw, 1) ~= string.byte(p, 1) or #raw < np then
    return nil, true, 0 -- another algorithm's (the key's fingerprint makes this unreachable)
  end
  local state, idle_in_us =
    ALG[string.sub(p, 1, 1)].rescale(p, written, string.sub(raw, np + 1), now_us, extra(i))
  return state, true, idle_in_us
end

if mode == 'r' then
  local charged_us = tonumber(ARGV[5 + 2 * n])
  for i = 1, n do
    local p = ARGV[4 + i]
    if holds_slots(p) then
      local own = select(2, SLOTS.load(KEYS[i], p, true))
      SLOTS.put(KEYS[i], p, own - cost_of(i), min_ttl_ms)
    else
      local raw, rescaled, rescaled_idle_us = load(i, p)
      local state, idle_in_us = nil, 0
      if raw then
        state, idle_in_us =
          ALG[string.sub(p, 1, 1)].refund(p, raw, now_us, cost_of(i), charged_us, extra(i))
      end
      if state then
        store(KEYS[i], p, state, idle_in_us)
      elseif rescaled then
        store(KEYS[i], p, raw, rescaled_idle_us)
      end
    end
  end
  return {now_us, call_id}
end

if mode == 'c' then
  local reply = {now_us}
  for i = 1, n do
    local p = ARGV[4 + i]
    if holds_slots(p) then -- slots are taken by admissions only
      reply[i + 1] = 0
    else
      local raw, rescaled, rescaled_idle_us = load(i, p)
      local algorithm = ALG[string.sub(p, 1, 1)]
      local cost = cost_of(i)
      local taken = 0
      local ok, state, idle_in_us = 0, nil, 0
      if cost > 0 then ok, state, idle_in_us = algorithm.decide(p, raw, now_us, cost, extra(i)) end
      if ok == 1 then
        taken = cost
      else
        -- Every algorithm admits any smaller cost than one it admits: the largest cost that
        -- fits, by bisection (at most 53 decisions, no Redis calls).
        state = nil
        local lo, hi = 0, cost - 1
        while lo < hi do
          local mid = hi - floor((hi - lo) / 2)
          local fits, mid_state, mid_idle_us = algorithm.decide(p, raw, now_us, mid, extra(i))
          if fits == 1 then
            lo, state, idle_in_us = mid, mid_state, mid_idle_us
          else
            hi = mid - 1
          end
        end
        taken = lo
      end
      if state then
        store(KEYS[i], p, state, idle_in_us)
      elseif rescaled then
        store(KEYS[i], p, raw, rescaled_idle_us)
      end
      reply[i + 1] = taken
    end
  end
  reply[n + 2] = call_id
  return reply
end

-- Limit i's penalty (after, within_us, block_us), or nil.
local function penalty_of(i)
  if not boxes then return nil end
  local spec = ARGV[5 + 3 * n + i]
  if not spec or spec == '' then return nil end
  local after, within_us, block_us = string.match(spec, '^(%d+) (%d+) (%d+)$')
  return tonumber(after), tonumber(within_us), tonumber(block_us)
end

-- A box's state: first strike, strikes, blocked until (penalty_box.py's PenaltyState).
local function box_state(i)
  local raw = redis.call('GET', KEYS[n + i])
  if not raw then return 0, 0, 0 end
  local first, strikes, until_us = string.match(raw, '^(%d+) (%d+) (%d+)$')
  return tonumber(first) or 0, tonumber(strikes) or 0, tonumber(until_us) or 0
end

-- One more rejection of the key by limit i, as PenaltyBox.strike counts it.
local function strike(i)
  local after, within_us, block_us = penalty_of(i)
  if not after then return end
  local first, strikes, until_us = box_state(i)
  if strikes == 0 or now_us - first >= within_us then first, strikes = now_us, 0 end
  strikes = strikes + 1
  if strikes >= after then first, strikes, until_us = now_us, 0, now_us + block_us end
  local live_until = until_us
  if strikes > 0 and first + within_us > live_until then live_until = first + within_us end
  local ttl_ms = ceil_div(live_until - now_us, 1000) + 1
  redis.call('SET', KEYS[n + i], string.format('%d %d %d', first, strikes, until_us),
    'PX', ttl_ms)
end

-- Every limit's box is looked at, a penalty's or not: an operator blocks a key of any limit
-- (the keys' API), in the box its requests' calls read.
local blocked_by, blocked_until = 0, 0
if boxes then
  for i = 1, n do
    local until_us = select(3, box_state(i))
    if until_us > now_us then
      if mode == 'd' then
        local reply = {now_us}
        for j = 2, 5 * n + 1 do reply[j] = 0 end
        reply[5 * n + 2] = i
        reply[5 * n + 3] = until_us
        reply[5 * n + 4] = call_id
        return reply
      end
      blocked_by, blocked_until = i, until_us
      break
    end
  end
end

local reply = sized_table(5 * n + 2)
reply[1] = now_us
local states = sized_table(n)
local over = {}
local idle = sized_table(n)
local rescaled = {}
local own_slots = {}
local allowed = true
local too_long = false
for i = 1, n do
  local p = ARGV[4 + i]
  local raw, was_rescaled, rescaled_idle_us
  if holds_slots(p) then
    raw, own_slots[i] = SLOTS.load(KEYS[i], p, mode == 'd')
  else
    raw, was_rescaled, rescaled_idle_us = load(i, p)
  end
  if was_rescaled then rescaled[i] = {raw, rescaled_idle_us} end
  local ok, state, idle_in_us, a, b, c, d, delay_s =
    ALG[string.sub(p, 1, 1)].decide(p, raw, now_us, cost_of(i), extra(i))
  if ok == 0 then allowed = false end
  local bound = tonumber(ARGV[4 + n + i])
  if delay_s and bound and delay_s > bound then
    too_long = true
    over[i] = true
  end
  states[i] = state
  idle[i] = idle_in_us
  local base = 5 * i - 3
  reply[base] = ok
  reply[base + 1] = a
  reply[base + 2] = b
  reply[base + 3] = c
  reply[base + 4] = d
end
if mode == 'd' then
  if allowed and not too_long then
    for i = 1, n do
      local p = ARGV[4 + i]
      if own_slots[i] then -- this replica's slots: what it held, and the ones taken now
        SLOTS.put(KEYS[i], p, own_slots[i] + cost_of(i), min_ttl_ms)
      elseif states[i] and not after(i) then
        store(KEYS[i], p, states[i], idle[i])
      elseif rescaled[i] then
        store(KEYS[i], ARGV[4 + i], rescaled[i][1], rescaled[i][2])
      end
    end
  else
    for i = 1, n do
      if rescaled[i] then store(KEYS[i], ARGV[4 + i], rescaled[i][1], rescaled[i][2]) end
    end
    -- The limits that refused (combine's rejected_by): those over their limit, else those
    -- whose delay is over its bound.
    if boxes then
      for i = 1, n do
        if (not allowed and reply[5 * i - 3] == 0) or (allowed and over[i]) then strike(i) end
      end
    end
  end
end
if boxes then
  reply[5 * n + 2] = blocked_by
  reply[5 * n + 3] = blocked_until
  reply[5 * n + 4] = call_id
  return reply
end
reply[5 * n + 2] = call_id
return reply

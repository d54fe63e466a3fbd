-- One request's limits, checked then committed in one atomic step (nginx's multi-zone rule):
-- every limit decides at one instant; the new states are written only if all admit the
-- request, so a request rejected by any limit is charged to none.
--
-- KEYS[i]    the state key of limit i (one hash tag for all: one slot in a cluster)
-- ARGV[1]    'd' decide and commit, 'p' decide and commit nothing (explain), 'r' refund
-- ARGV[2]    now in microseconds; '' reads Redis TIME, the one clock all replicas share
-- ARGV[3]    cost of the request
-- ARGV[4]    least time to live in ms for written keys (0: expire as soon as idle)
-- ARGV[4+i]  limit i's parameters: algorithm letter, then its numbers
-- ARGV[4+n+i] the longest limit i may delay this request, in seconds ('': no bound); a
--            request that would wait longer is refused, and charged nothing
-- ARGV[5+2n] refund only: the now_us of the decision that charged the request ('': unknown),
--            which lets the windows give back exactly that charge
-- Reply      now_us, then 5 integers per limit: allowed, then the algorithm's four.
local mode = ARGV[1]
local now_us = tonumber(ARGV[2])
if not now_us then
  local t = redis.call('TIME')
  now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local cost = tonumber(ARGV[3])
local min_ttl_ms = tonumber(ARGV[4])
local n = #KEYS

-- An idle state is what an absent key means, so a key lives until its state is idle.
local function store(key, state, idle_in_us)
  local ttl_ms = ceil_div(idle_in_us, 1000) + 1
  if ttl_ms < min_ttl_ms then ttl_ms = min_ttl_ms end
  if idle_in_us <= 0 and min_ttl_ms == 0 then
    redis.call('DEL', key)
  else
    redis.call('SET', key, state, 'PX', ttl_ms)
  end
end

if mode == 'r' then
  local charged_us = tonumber(ARGV[5 + 2 * n])
  for i = 1, n do
    local raw = redis.call('GET', KEYS[i])
    if raw then
      local p = ARGV[4 + i]
      local state, idle_in_us = ALG[string.sub(p, 1, 1)].refund(p, raw, now_us, cost, charged_us)
      if state then store(KEYS[i], state, idle_in_us) end
    end
  end
  return {now_us}
end

local reply = {now_us}
local states = {}
local idle = {}
local allowed = true
local too_long = false
for i = 1, n do
  local raw = redis.call('GET', KEYS[i])
  local p = ARGV[4 + i]
  local ok, state, idle_in_us, a, b, c, d, delay_s =
    ALG[string.sub(p, 1, 1)].decide(p, raw or nil, now_us, cost)
  if ok == 0 then allowed = false end
  local bound = tonumber(ARGV[4 + n + i])
  if delay_s and bound and delay_s > bound then too_long = true end
  states[i] = state
  idle[i] = idle_in_us
  local base = 5 * i - 3
  reply[base] = ok
  reply[base + 1] = a
  reply[base + 2] = b
  reply[base + 3] = c
  reply[base + 4] = d
end
if allowed and not too_long and mode == 'd' then
  for i = 1, n do
    if states[i] then store(KEYS[i], states[i], idle[i]) end
  end
end
return reply

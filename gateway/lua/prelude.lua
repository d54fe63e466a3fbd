-- Shared by every algorithm below: the whole file set is sent to Redis as ONE script
-- (gateway/redis_store.py joins prelude, the algorithms and decide.lua, in that order).
--
-- Lua numbers are IEEE doubles: every integer here stays below 2^53 (the Python side refuses
-- parameters that could leave that range), so the arithmetic is the Python algorithms'
-- integer arithmetic, exactly. Python's a // b is floor(a / b) for such integers.
local floor = math.floor
local INF = math.huge
local unpack_state = struct.unpack
local pack_state = struct.pack

-- Python's -(-a // b): a / b rounded up.
local function ceil_div(a, b)
  return -floor(-a / b)
end

-- Each algorithm file sets MAKE[code] to a function returning
-- {decide = f(p, raw, now_us, cost), refund = f(p, raw, now_us, cost, charged_us)}.
-- p is the limit's parameter string (its code letter, then little-endian doubles); raw is the
-- key's stored state (nil for a key never seen or expired).
-- decide returns: allowed (1/0), new state (nil: nothing to write), microseconds until the
-- new state is idle, four integers the Python side turns into a Decision, and the delay in
-- seconds as the Python computes it (nil: the algorithm never delays).
-- refund returns: new state (nil: unchanged), microseconds until it is idle; charged_us is
-- the instant of the decision that charged the request (nil: unknown), which the windows need.
-- Redis runs this whole file on every call: ALG builds an algorithm's functions only when a
-- limit of the request uses it (building all of them cost 4 us a call, measured).
local MAKE = {}
local ALG = setmetatable({}, {
  __index = function(built, code)
    local algorithm = MAKE[code]()
    built[code] = algorithm
    return algorithm
  end,
})

-- Shared by both scripts: the decision script (gateway/stores/redis/store.py joins prelude, the
-- algorithms, call_header.lua and decide.lua, in that order, into ONE script) and the lease
-- script (prelude, call_header.lua, then lease.lua: gateway/stores/redis/lease.py). Loaded as
-- a Redis function library (gateway/stores/redis/library.py), everything before
-- call_header.lua runs once per loaded library (at its first call), each call the rest.
--
-- Lua numbers are IEEE doubles: every integer here stays below 2^53 (the Python side refuses
-- parameters that could leave that range), so the arithmetic is the Python algorithms'
-- integer arithmetic, exactly. Python's a // b is floor(a / b) for such integers.
local floor = math.floor
local INF = math.huge
local unpack_state = struct.unpack
local pack_state = struct.pack

-- A table of k slots made at once, where one filled a slot at a time is copied as it grows
-- (at 2, 3, 5, 9, 17 slots...). The k nils are unpack's results, which must fit Lua's C stack
-- (8000): a larger table grows as it is filled.
local NO_VALUES = {}
local function sized_table(k)
  if k > 4000 then return {} end
  return {unpack(NO_VALUES, 1, k)}
end

-- Python's -(-a // b): a / b rounded up.
local function ceil_div(a, b)
  return -floor(-a / b)
end

-- Every call's header, set by call_header.lua at the start of each call (the algorithms'
-- helpers read now_us): the mode, the call's number, now in microseconds.
local mode, call_id, now_us

-- Some products pass 2^53 where the results do not: a rescale (a reload changed a limit's
-- parameters) multiplies a count by a ratio of two parameters, a sliding window weighs a count
-- of up to 2^53 by a span of microseconds. Then exact integers in base 2^24 limbs (least
-- significant first) check the quotient the doubles estimate. The limb functions are made
-- only on that path (a script run by EVALSHA makes every function in it on every call).
local WIDE
local function wide()
  if WIDE then return WIDE end
  local LIMB = 16777216
  local w = {}
  function w.of(x) -- an integer 0 <= x < 2^72: three limbs
    local l0 = x % LIMB
    x = (x - l0) / LIMB
    local l1 = x % LIMB
    return {l0, l1, (x - l1) / LIMB}
  end
  local function carry(r)
    for k = 1, #r - 1 do
      local c = floor(r[k] / LIMB)
      r[k] = r[k] - c * LIMB
      r[k + 1] = r[k + 1] + c
    end
    return r
  end
  function w.mul(x, y) -- each term < 2^48, at most 6 per limb for numbers of up to 6 limbs
    local r = {}
    for k = 1, #x + #y do r[k] = 0 end
    for i = 1, #x do
      for j = 1, #y do
        r[i + j - 1] = r[i + j - 1] + x[i] * y[j]
      end
    end
    return carry(r)
  end
  function w.add(x, y)
    local r = {}
    for k = 1, math.max(#x, #y) + 1 do r[k] = (x[k] or 0) + (y[k] or 0) end
    return carry(r)
  end
  function w.cmp(x, y)
    for k = math.max(#x, #y), 1, -1 do
      local a, b = x[k] or 0, y[k] or 0
      if a ~= b then
        if a < b then return -1 end
        return 1
      end
    end
    return 0
  end
  function w.value(x) -- the nearest double, about
    local v = 0
    for k = #x, 1, -1 do v = v * LIMB + x[k] end
    return v
  end
  -- num / den rounded down (up: rounded up), for wide integers, the quotient below 2^53.
  function w.div(num, den, up)
    local q = floor(w.value(num) / w.value(den)) -- within a few units of the quotient
    while q > 0 and w.cmp(w.mul(w.of(q), den), num) > 0 do q = q - 1 end
    while w.cmp(w.mul(w.of(q + 1), den), num) <= 0 do q = q + 1 end
    if up and w.cmp(w.mul(w.of(q), den), num) ~= 0 then return q + 1 end
    return q
  end
  WIDE = w
  return w
end

-- a * b / c rounded down (up: rounded up, Python's -(-a * b // c)), for integers
-- 0 <= a, b < 2^53, 0 < c < 2^53, the quotient below 2^53.
local function muldiv(a, b, c, up)
  local product = a * b
  if product < 9007199254740992 then
    local q = floor(product / c)
    if up and q * c ~= product then return q + 1 end
    return q
  end
  local w = wide()
  return w.div(w.mul(w.of(a), w.of(b)), w.of(c), up)
end

-- Each algorithm file sets MAKE[code] to a function returning
-- {decide = f(p, raw, now_us, cost, extra), refund = f(p, raw, now_us, cost, charged_us, extra),
--  rescale = f(p, old_p, raw, now_us, extra)}; extra is what the call passes the limit beside
-- its parameters (a calendar window's periods), nil for the others.
-- p is the limit's parameter string (its code letter, then little-endian doubles); raw is the
-- key's stored state (nil for a key never seen or expired).
-- decide returns: allowed (1/0), new state (nil: nothing to write), microseconds until the
-- new state is idle, four integers the Python side turns into a Decision, and the delay in
-- seconds as the Python computes it (nil: the algorithm never delays).
-- refund returns: new state (nil: unchanged), microseconds until it is idle; charged_us is
-- the instant of the decision that charged the request (nil: unknown), which the windows need.
-- rescale carries a state written under the parameters old_p (same algorithm) over to p, as the
-- Python algorithm's rescale does; it returns the new state (nil: start afresh) and
-- microseconds until it is idle.
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

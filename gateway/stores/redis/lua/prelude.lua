-- Shared by every algorithm below: the whole file set is sent to Redis as ONE script
-- (gateway/stores/redis/store.py joins prelude, the algorithms and decide.lua, in that order).
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

-- Rescaling (a reload changed a limit's parameters) multiplies a count by a ratio of two
-- parameters: a * b can pass 2^53 where the result does not. Then exact integers in base 2^24
-- limbs check the quotient the doubles estimate. (Their functions are made only on that path:
-- Redis runs this whole file, making every function in it, on every call.)
--
-- a * b / c rounded down (up: rounded up, Python's -(-a * b // c)), for integers
-- 0 <= a, b < 2^53, 0 < c < 2^53, the quotient below 2^53.
local function muldiv(a, b, c, up)
  local product = a * b
  local q = floor(product / c)
  if product < 9007199254740992 then
    if up and q * c ~= product then return q + 1 end
    return q
  end
  local LIMB = 16777216
  local function limbs_of(x) -- x < 2^72: three limbs, least significant first
    local l0 = x % LIMB
    x = (x - l0) / LIMB
    local l1 = x % LIMB
    return {l0, l1, (x - l1) / LIMB}
  end
  local function big_mul(x, y) -- x, y < 2^53: x * y in six limbs
    local xl, yl = limbs_of(x), limbs_of(y)
    local r = {0, 0, 0, 0, 0, 0}
    for i = 1, 3 do
      for j = 1, 3 do
        r[i + j - 1] = r[i + j - 1] + xl[i] * yl[j] -- each term < 2^48, at most 3 per limb
      end
    end
    for k = 1, 5 do
      local carry = floor(r[k] / LIMB)
      r[k] = r[k] - carry * LIMB
      r[k + 1] = r[k + 1] + carry
    end
    return r
  end
  local function big_cmp(x, y)
    for k = 6, 1, -1 do
      if x[k] ~= y[k] then
        if x[k] < y[k] then return -1 end
        return 1
      end
    end
    return 0
  end
  local exact = big_mul(a, b) -- q is within a few units of the quotient
  while big_cmp(big_mul(q, c), exact) > 0 do q = q - 1 end
  while big_cmp(big_mul(q + 1, c), exact) <= 0 do q = q + 1 end
  if up and big_cmp(big_mul(q, c), exact) ~= 0 then return q + 1 end
  return q
end

-- Each algorithm file sets MAKE[code] to a function returning
-- {decide = f(p, raw, now_us, cost), refund = f(p, raw, now_us, cost, charged_us),
--  rescale = f(p, old_p, raw, now_us)}.
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

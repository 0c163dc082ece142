-- sluice: one atomic rate-limit decision for every limit of one hash-tag group.
--
-- KEYS[i]   counter key of limit i. All keys share one hash tag, hence one Cluster slot.
-- ARGV[1]   time override in microseconds since the Unix epoch, or "" to use the Redis server
--           clock (TIME). Only tests set it; production always decides on the server clock, so
--           replicas with skewed clocks agree.
-- ARGV[2 + 6*(i-1) .. 7 + 6*(i-1)], for limit i:
--   limit      requests admitted per period (0 blocks everything)
--   period_us  period in microseconds (> 0); windows are aligned to the Unix epoch
--   hits       hits to charge (0 = check only: allowed while one more request would fit)
--   flags      bit 0 (1): shadow, decided like an enforced limit but never denies the request
--              bit 1 (2): refund, gives `hits` back (never below zero) instead of charging
--   algorithm  0 fixed_window, 1 sliding_window, 2 sliding_log, 3 token_bucket
--   burst      token_bucket: requests allowed at once above the steady rate
--
-- Returns {admitted, allowed_1, remaining_1, reset_us_1, retry_us_1, allowed_2, ...}:
--   admitted    1 if every non-shadow limit allowed the request; only then is anything written
--   allowed_i   1 if limit i alone allows it
--   remaining_i hits left after this request if admitted, else as stored (nothing was charged)
--   reset_us_i  microseconds until the counter is back to its full quota
--   retry_us_i  for a denial, microseconds until the request would be admitted (-1: never)
--
-- Stored state (each write sets a TTL until the state stops mattering, so no key outlives it):
--   fixed_window    string "<window start us>:<count>"
--   sliding_window  string "<window start us>:<previous count>:<current count>"
--   sliding_log     sorted set, score = hit time (us), member "<time>:<seq>" (unique)
--   token_bucket    string "<TAT us>"
-- The math mirrors src/algorithm/mod.rs operation for operation (the parity test checks it);
-- keep the two in step.

local now
-- With a time override the script's clock and Redis's expiry clock differ, so TTLs get an
-- hour of slack: a test's key must not expire in real time while its manual clock stands still.
local ttl_slack_ms = 0
if ARGV[1] ~= '' then
  now = tonumber(ARGV[1])
  ttl_slack_ms = 3600000
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end

local function fits(used, hits, limit)
  if hits == 0 then return used < limit end
  return used + hits <= limit
end

local function split(raw)
  local out = {}
  for part in string.gmatch(raw, '[^:]+') do out[#out + 1] = tonumber(part) end
  return out
end

-- Loads the stored state of `key` for `alg`.
local function load(key, alg, period)
  if alg == 2 then
    local log = {}
    local raw = redis.call('ZRANGE', key, 0, -1, 'WITHSCORES')
    for j = 2, #raw, 2 do log[#log + 1] = tonumber(raw[j]) end
    return {log = log, added = 0, popped = 0}
  end
  local raw = redis.call('GET', key)
  if not raw then return {} end
  local v = split(raw)
  if alg == 0 then return {ws = v[1], count = v[2]} end
  if alg == 1 then return {ws = v[1], prev = v[2], cur = v[3]} end
  return {tat = v[1]}
end

-- Each decide function returns allowed, remaining, reset, retry (-1 = never), new state; it
-- never modifies `s`.

local function fixed(s, limit, period, hits, refund)
  local start = now - (now % period)
  local current = 0
  if s.ws == start then current = s.count end
  local reset = start + period - now
  local allowed, after
  if refund then
    allowed, after = true, math.max(current - hits, 0)
  elseif fits(current, hits, limit) then
    allowed, after = true, current + hits
  else
    allowed, after = false, current
  end
  local retry = 0
  if not allowed then
    if math.max(hits, 1) > limit then retry = -1 else retry = reset end
  end
  return allowed, math.max(limit - after, 0), reset, retry, {ws = start, count = after}
end

local function estimate(prev, cur, elapsed, period)
  local w = (period - elapsed) / period
  return prev * w + cur
end

local function sliding(s, limit, period, hits, refund)
  local start = now - (now % period)
  local elapsed = now - start
  local prev, cur = 0, 0
  if s.ws == start then
    prev, cur = s.prev, s.cur
  elseif s.ws ~= nil and s.ws + period == start then
    prev, cur = s.cur, 0
  end
  local est = estimate(prev, cur, elapsed, period)
  local allowed, after
  if refund then
    allowed, after = true, math.max(cur - hits, 0)
  else
    if hits == 0 then allowed = est < limit else allowed = est + hits <= limit end
    if allowed then after = cur + hits else after = cur end
  end
  local used = estimate(prev, after, elapsed, period)
  local remaining = math.max(math.floor(limit - used), 0)
  local retry = 0
  if not allowed then
    local h = math.max(hits, 1)
    if h > limit then
      retry = -1
    elseif prev > 0 and cur + h <= limit then
      local need = est + h - limit
      retry = math.min(math.ceil(need / prev * period), period - elapsed)
    elseif cur + h <= limit then
      retry = period - elapsed
    else
      -- This window's hits slide out of the next one: cur * (period - x) / period + h <= limit.
      retry = period - elapsed + math.ceil((cur + h - limit) / cur * period)
    end
  end
  return allowed, remaining, period - elapsed, retry, {ws = start, prev = prev, cur = after}
end

local function sliding_log(s, limit, period, hits, refund)
  local horizon = now - period
  local log = {}
  for _, t in ipairs(s.log) do
    if t > horizon then log[#log + 1] = t end
  end
  local added, popped = s.added, s.popped
  local count = #log
  local allowed
  if refund then
    local n = math.min(hits, count)
    for _ = 1, n do
      log[#log] = nil
      if added > 0 then added = added - 1 else popped = popped + 1 end
    end
    allowed = true
  elseif fits(count, hits, limit) then
    for _ = 1, hits do log[#log + 1] = now end
    added = added + hits
    allowed = true
  else
    allowed = false
  end
  local retry = 0
  if not allowed then
    local h = math.max(hits, 1)
    if h > limit then
      retry = -1
    else
      local t = log[count + h - limit]
      if t then retry = t + period - now end
    end
  end
  local reset = 0
  if #log > 0 then reset = log[#log] + period - now end
  return allowed, math.max(limit - #log, 0), reset, retry,
    {log = log, added = added, popped = popped}
end

local function token_bucket(s, limit, period, hits, refund, burst)
  local stored = s.tat or now
  if limit == 0 then
    local retry = -1
    if refund then retry = 0 end
    return refund, 0, 0, retry, {tat = stored}
  end
  local t = math.max(math.floor(period / limit), 1)
  local tau = t * (burst + 1)
  local tat = math.max(stored, now)
  local allowed, new_tat
  if refund then
    allowed, new_tat = true, math.max(tat - t * hits, now)
  else
    local cost = t * math.max(hits, 1)
    local candidate = tat + cost
    allowed = candidate <= now + tau
    local charged = candidate
    if hits == 0 then charged = tat end
    if allowed then new_tat = charged else new_tat = tat end
  end
  local ttl = new_tat - now
  local retry = 0
  if not allowed then
    local cost = t * math.max(hits, 1)
    if cost > tau then retry = -1 else retry = tat + cost - tau - now end
  end
  return allowed, math.floor(math.max(tau - ttl, 0) / t), ttl, retry, {tat = new_tat}
end

local function decide(s, alg, limit, period, hits, refund, burst)
  if alg == 0 then return fixed(s, limit, period, hits, refund) end
  if alg == 1 then return sliding(s, limit, period, hits, refund) end
  if alg == 2 then return sliding_log(s, limit, period, hits, refund) end
  return token_bucket(s, limit, period, hits, refund, burst)
end

-- Whole milliseconds, rounded up, at least 1: a TTL for PEXPIRE / SET PX.
local function ttl_ms(us)
  return math.max(math.floor((us + 999) / 1000), 1) + ttl_slack_ms
end

local n = #KEYS
local original = {}
local pending = {}
local out = {0}
local admitted = 1
local args = {}

for i = 1, n do
  local key = KEYS[i]
  local b = 2 + 6 * (i - 1)
  local a = {
    limit = tonumber(ARGV[b]), period = tonumber(ARGV[b + 1]), hits = tonumber(ARGV[b + 2]),
    flags = tonumber(ARGV[b + 3]), alg = tonumber(ARGV[b + 4]), burst = tonumber(ARGV[b + 5]),
  }
  a.shadow = a.flags % 2 == 1
  a.refund = math.floor(a.flags / 2) % 2 == 1
  args[i] = a
  if original[key] == nil then original[key] = load(key, a.alg, a.period) end
  local s = pending[key] or original[key]
  local allowed, remaining, reset, retry, new =
    decide(s, a.alg, a.limit, a.period, a.hits, a.refund, a.burst)
  if not allowed and not a.shadow then admitted = 0 end
  -- A denial (shadow or not) leaves the state as it was: `new` equals `s` then.
  pending[key] = new
  if allowed then out[#out + 1] = 1 else out[#out + 1] = 0 end
  out[#out + 1] = remaining
  out[#out + 1] = reset
  out[#out + 1] = retry
end

out[1] = admitted
if admitted == 1 then
  local written = {}
  for i = 1, n do
    local key, a = KEYS[i], args[i]
    if a.hits > 0 and not written[key] then
      written[key] = true
      local s = pending[key]
      if a.alg == 0 then
        local ttl = s.ws + a.period - now
        redis.call('SET', key, string.format('%d:%d', s.ws, s.count), 'PX', ttl_ms(ttl))
      elseif a.alg == 1 then
        local ttl = s.ws + 2 * a.period - now
        redis.call('SET', key, string.format('%d:%d:%d', s.ws, s.prev, s.cur), 'PX', ttl_ms(ttl))
      elseif a.alg == 2 then
        redis.call('ZREMRANGEBYSCORE', key, '-inf', string.format('%d', now - a.period))
        if s.popped > 0 then redis.call('ZPOPMAX', key, s.popped) end
        if s.added > 0 then
          -- Members are unique: the sequence continues from the entries left in the set
          -- (zero-padded, so ZPOPMAX of equal scores removes the highest sequence first).
          local base = redis.call('ZCARD', key)
          local zargs = {}
          for j = 1, s.added do
            zargs[#zargs + 1] = string.format('%d', now)
            zargs[#zargs + 1] = string.format('%d:%010d', now, base + j - 1)
          end
          redis.call('ZADD', key, unpack(zargs))
        end
        if #s.log > 0 then
          redis.call('PEXPIRE', key, ttl_ms(s.log[#s.log] + a.period - now))
        else
          redis.call('DEL', key)
        end
      else
        redis.call('SET', key, string.format('%d', s.tat), 'PX', ttl_ms(s.tat - now))
      end
    end
  end
else
  -- Nothing is charged: report what each counter really has left.
  for i = 1, n do
    local a = args[i]
    local _, remaining = decide(original[KEYS[i]], a.alg, a.limit, a.period, 0, false, a.burst)
    out[3 + 4 * (i - 1)] = remaining
  end
end
return out

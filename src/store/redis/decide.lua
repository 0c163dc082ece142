-- sluice: one atomic rate-limit decision for every limit of one hash-tag group.
--
-- KEYS[i]   counter key of limit i. All keys share one hash tag, hence one Cluster slot.
-- ARGV[1]   time override in milliseconds since the Unix epoch, or "" to use the Redis server
--           clock (TIME). Only tests set it; production always decides on the server clock, so
--           replicas with skewed clocks agree.
-- ARGV[2 + 4*(i-1) .. 5 + 4*(i-1)], for limit i:
--   limit      requests admitted per window (0 blocks everything)
--   period_ms  window length in milliseconds; windows are aligned to the Unix epoch
--   hits       hits to charge (0 = check only: allowed while one more request would fit)
--   flags      bit 0 (1): shadow, decided and counted but never denies
--              bit 1 (2): refund, gives `hits` back (never below zero) instead of charging
--
-- Returns {admitted, allowed_1, remaining_1, reset_ms_1, allowed_2, ...}:
--   admitted   1 if every non-shadow limit allowed the request; only then is anything written
--   allowed_i  1 if limit i alone allows it
--   remaining_i hits left after this request if admitted, else as stored (nothing was charged)
--   reset_ms_i milliseconds until limit i's window ends
--
-- A counter is the string "<window start ms>:<count>": a value from an earlier window counts as
-- zero, and every write sets a TTL to the end of its window (relative PX, so a test's time
-- override never yields an expiry in the server's past), so no key outlives its window. This
-- mirrors `algorithm::fixed_window` exactly; keep the two in step.

local now
if ARGV[1] ~= '' then
  now = tonumber(ARGV[1])
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local n = #KEYS
local stored = {}
local pending = {}
local window_end = {}
local out = {0}
local admitted = 1

for i = 1, n do
  local key = KEYS[i]
  local base = 2 + 4 * (i - 1)
  local limit = tonumber(ARGV[base])
  local period = tonumber(ARGV[base + 1])
  local hits = tonumber(ARGV[base + 2])
  local flags = tonumber(ARGV[base + 3])
  local shadow = flags % 2 == 1
  local refund = math.floor(flags / 2) % 2 == 1

  local window_start = now - (now % period)
  window_end[i] = window_start + period
  if stored[key] == nil then
    stored[key] = 0
    local raw = redis.call('GET', key)
    if raw then
      local sep = string.find(raw, ':', 1, true)
      if sep and tonumber(string.sub(raw, 1, sep - 1)) == window_start then
        stored[key] = tonumber(string.sub(raw, sep + 1)) or 0
      end
    end
  end
  local cur = pending[key] or stored[key]

  local allowed, counted, charged
  if refund then
    allowed = true
    counted = math.max(cur - hits, 0)
    charged = counted
  else
    if hits == 0 then
      allowed = cur < limit
    else
      allowed = cur + hits <= limit
    end
    if allowed then counted = cur + hits else counted = cur end
    -- A shadow limit over its quota still counts the request it lets through.
    if allowed or not shadow then charged = counted else charged = cur + hits end
  end
  if not allowed and not shadow then admitted = 0 end
  pending[key] = charged
  out[#out + 1] = allowed and 1 or 0
  out[#out + 1] = math.max(limit - counted, 0)
  out[#out + 1] = window_end[i] - now
end

out[1] = admitted
if admitted == 1 then
  for i = 1, n do
    local base = 2 + 4 * (i - 1)
    if tonumber(ARGV[base + 2]) > 0 then
      local start = window_end[i] - tonumber(ARGV[base + 1])
      redis.call('SET', KEYS[i], string.format('%d:%d', start, pending[KEYS[i]]), 'PX', window_end[i] - now)
    end
  end
else
  -- Nothing is charged: report what each counter really has left.
  for i = 1, n do
    local limit = tonumber(ARGV[2 + 4 * (i - 1)])
    out[3 * i] = math.max(limit - stored[KEYS[i]], 0)
  end
end
return out

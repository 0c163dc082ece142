-- A counter's demand board for the quota service (see src/store/demand.rs): a hash beside the
-- counter, in the same Cluster slot (same hash tag), one field per stream.
--
-- KEYS[1]  the board: a hash, field = stream id, value = "<expires ms> <rate> <reserved>"
--          (rate "-" while unmeasured)
-- ARGV[1]  the posting stream's id
-- ARGV[2]  its rate (requests per second, or "-")
-- ARGV[3]  the tokens reserved for it (a whole number)
-- ARGV[4]  now, in milliseconds on the poster's clock
-- ARGV[5]  when the posting expires, in milliseconds on the same clock
-- ARGV[6]  how long the board outlives its last posting, in milliseconds (PEXPIRE)
-- ARGV[7]  most postings one board holds
--
-- Reply: a flat array stream, rate, reserved for every live posting, the poster's last (absent
-- when the board had no room for it). Expired postings are deleted on the way.

local board = KEYS[1]
local me = ARGV[1]
local now = tonumber(ARGV[4])
local max = tonumber(ARGV[7])
local all = redis.call('HGETALL', board)
local out = {}
local others = 0
local known = false
for i = 1, #all, 2 do
  local stream, line = all[i], all[i + 1]
  local expires, rate, reserved = string.match(line, '^(%d+) (%S+) (%d+)$')
  if expires == nil or tonumber(expires) <= now then
    redis.call('HDEL', board, stream)
  elseif stream == me then
    known = true
  else
    others = others + 1
    out[#out + 1] = stream
    out[#out + 1] = rate
    out[#out + 1] = reserved
  end
end
if known or others < max then
  redis.call('HSET', board, me, ARGV[5] .. ' ' .. ARGV[2] .. ' ' .. ARGV[3])
  redis.call('PEXPIRE', board, ARGV[6])
  out[#out + 1] = me
  out[#out + 1] = ARGV[2]
  out[#out + 1] = ARGV[3]
end
return out

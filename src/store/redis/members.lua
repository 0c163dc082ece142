-- sluice: one replica's heartbeat. FAILURE_MODE=local splits every limit among the replicas
-- that share this Redis; each learns here how many there are and its place among them.
--
-- KEYS[1]  the replicas' hash: field = replica id, value = when its lease ends (ms, Redis
--          server time)
-- ARGV[1]  this replica's id (at most 64 bytes; the caller checks)
-- ARGV[2]  its lease in milliseconds (it beats again well before)
-- ARGV[3]  most replicas kept: a heartbeat past it is not recorded (the hash stays bounded)
-- Returns {replicas alive, this replica's rank among their ids (0-based, byte order), 1 if it
-- is one of them (0: the hash is full)}. The
-- work is O(replicas), which ARGV[3] caps.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease, cap = tonumber(ARGV[2]), tonumber(ARGV[3])
local all = redis.call('HGETALL', KEYS[1])
local live, mine = {}, false
for i = 1, #all, 2 do
  if tonumber(all[i + 1]) <= now then
    redis.call('HDEL', KEYS[1], all[i])
  else
    live[#live + 1] = all[i]
    if all[i] == ARGV[1] then mine = true end
  end
end
if not mine and #live < cap then
  live[#live + 1] = ARGV[1]
  mine = true
end
if mine then
  redis.call('HSET', KEYS[1], ARGV[1], now + lease)
  redis.call('PEXPIRE', KEYS[1], lease * 2)
end
local rank = 0
for _, id in ipairs(live) do
  if id < ARGV[1] then rank = rank + 1 end
end
if mine then return {#live, rank, 1} end
return {#live, rank, 0}

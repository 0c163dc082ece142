-- A region's pool of one global limit (see src/store/global/mod.rs): the units this region
-- holds of the limit's current window in the home store, in a hash beside the limit's regional
-- key (same hash tag, same Cluster slot). Replicas take their slices from it; one replica at a
-- time refills it from home (the `lock` field, a lease that expires if its holder dies).
--
-- KEYS[1]  the pool: a hash {w, have, taken, last, lock, lock_until, dry_until, fill}
-- ARGV[1]  the operation: take | give | lock | fill | drain | read
-- ARGV[2]  the window's start in milliseconds (0: a token bucket's, which never ends)
-- ARGV[3]  units (take, give, fill)
-- ARGV[4]  the refiller's token (lock, fill)
-- ARGV[5]  lock: the lease in ms; fill: ms the home store is dry for (0: not dry);
--          drain: ms without a take that make the pool idle
-- ARGV[6]  how long the pool outlives this call, in ms (PEXPIRE)
--
-- Reply: {ok, have, taken, dry_until, stranded, now, locked, fill}: ok is 1/0 (drain: the units drained;
-- -1 for a window older than the pool's: that window has passed, nothing is done); stranded
-- is what the pool held unspent of the window it had before this call moved it on.
-- locked is 1 while a refill's lease runs; fill is the last refill's size. Times are the Redis server's (TIME), in ms.

local h = KEYS[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local w = tonumber(ARGV[2])
local cur = redis.call('HMGET', h, 'w', 'have', 'taken', 'lock', 'lock_until', 'dry_until', 'last')
local cw = tonumber(cur[1])
local have, taken = tonumber(cur[2]) or 0, tonumber(cur[3]) or 0
local lock, lock_until = cur[4] or '', tonumber(cur[5]) or 0
local dry, last = tonumber(cur[6]) or 0, tonumber(cur[7]) or 0
local stranded = 0
if cw ~= nil and cw > w then
  return {-1, 0, 0, 0, 0, now}
end
if cw == nil or cw < w then
  if cw ~= nil then stranded = have - taken end
  have, taken, lock, lock_until, dry, last = 0, 0, '', 0, 0, now
  redis.call('DEL', h)
  redis.call('HSET', h, 'w', ARGV[2], 'have', 0, 'taken', 0, 'last', now)
end
local op = ARGV[1]
local n = tonumber(ARGV[3])
local ok = 1
if op == 'take' then
  if n == 0 then
    -- a look at the pool: not a take (the pool's idleness is not reset)
  elseif have - taken >= n then
    taken = taken + n
    redis.call('HSET', h, 'taken', taken, 'last', now)
  else
    ok = 0
  end
elseif op == 'give' then
  local g = math.min(n, taken)
  taken = taken - g
  redis.call('HSET', h, 'taken', taken)
elseif op == 'lock' then
  if lock ~= '' and lock ~= ARGV[4] and lock_until > now then
    ok = 0
  else
    redis.call('HSET', h, 'lock', ARGV[4], 'lock_until', now + tonumber(ARGV[5]))
  end
elseif op == 'fill' then
  -- Units the home store granted are added whoever holds the lock now (they were taken from
  -- home: never lost); the lock is released if it is still the filler's.
  have = have + n
  redis.call('HSET', h, 'have', have)
  if n > 0 then
    redis.call('HSET', h, 'fill', n)
  end
  local dry_for = tonumber(ARGV[5])
  if dry_for > 0 then
    dry = now + dry_for
    redis.call('HSET', h, 'dry_until', dry)
  end
  if lock == ARGV[4] then
    redis.call('HDEL', h, 'lock', 'lock_until')
  end
elseif op == 'drain' then
  -- Every unit not taken leaves the pool (the caller returns them home), if no replica took
  -- any for ARGV[5] ms and no refill runs.
  if now - last >= tonumber(ARGV[5]) and (lock == '' or lock_until <= now) then
    ok = have - taken
    have = taken
    redis.call('HSET', h, 'have', have)
  else
    ok = 0
  end
end
redis.call('PEXPIRE', h, ARGV[6])
local locked = 0
local l = redis.call('HMGET', h, 'lock', 'lock_until', 'fill')
if l[1] and tonumber(l[2]) and tonumber(l[2]) > now then
  locked = 1
end
return {ok, have, taken, dry, stranded, now, locked, tonumber(l[3]) or 0}

-- A region's pool of one global limit for one window (see src/store/global/mod.rs): the units
-- this region holds of the window in the home store, in a hash beside the limit's regional key
-- (same hash tag, same Cluster slot), one hash per window: the next window's, filled 2 s
-- ahead, and a replica whose clock is ahead leave the current window's pool whole. Replicas take
-- their slices from it; one replica at a time refills it from home (the `lock` field, a lease
-- that expires if its holder dies).
--
-- KEYS[1]  the pool of one window: a hash {have, taken, last, lock, lock_until, dry_until, fill}
-- ARGV[1]  the operation: take | give | lock | fill | drain
-- ARGV[2]  units (take, give, fill)
-- ARGV[3]  the refiller's token (lock, fill)
-- ARGV[4]  lock: the lease in ms; fill: ms the home store is dry for (0: not dry);
--          drain: ms without a take that make the pool idle
-- ARGV[5]  how long the pool outlives this call, in ms (PEXPIRE)
--
-- Reply: {ok, have, taken, dry_until, now, locked, fill}: ok is 1/0 (drain: the units
-- drained); locked is 1 while a refill's lease runs; fill is the last refill's size. Times are
-- the Redis server's (TIME), in ms.

local h = KEYS[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local cur = redis.call('HMGET', h, 'have', 'taken', 'lock', 'lock_until', 'dry_until', 'last')
local have, taken = tonumber(cur[1]), tonumber(cur[2]) or 0
local lock, lock_until = cur[3] or '', tonumber(cur[4]) or 0
local dry, last = tonumber(cur[5]) or 0, tonumber(cur[6]) or now
if have == nil then
  have = 0
  redis.call('HSET', h, 'have', 0, 'taken', 0, 'last', now)
end
local op = ARGV[1]
local n = tonumber(ARGV[2])
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
  if lock ~= '' and lock ~= ARGV[3] and lock_until > now then
    ok = 0
  else
    redis.call('HSET', h, 'lock', ARGV[3], 'lock_until', now + tonumber(ARGV[4]))
  end
elseif op == 'fill' then
  -- Units the home store granted are added whoever holds the lock now (they were taken from
  -- home: never lost); the lock is released if it is still the filler's.
  have = have + n
  redis.call('HSET', h, 'have', have)
  if n > 0 then
    redis.call('HSET', h, 'fill', n)
  end
  local dry_for = tonumber(ARGV[4])
  if dry_for > 0 then
    dry = now + dry_for
    redis.call('HSET', h, 'dry_until', dry)
  end
  if lock == ARGV[3] then
    redis.call('HDEL', h, 'lock', 'lock_until')
  end
elseif op == 'drain' then
  -- Every unit not taken leaves the pool (the caller returns them home), if no replica took
  -- any for ARGV[4] ms and no refill runs.
  if now - last >= tonumber(ARGV[4]) and (lock == '' or lock_until <= now) then
    ok = have - taken
    have = taken
    redis.call('HSET', h, 'have', have)
  else
    ok = 0
  end
end
redis.call('PEXPIRE', h, ARGV[5])
local locked = 0
local l = redis.call('HMGET', h, 'lock', 'lock_until', 'fill')
if l[1] and tonumber(l[2]) and tonumber(l[2]) > now then
  locked = 1
end
return {ok, have, taken, dry, now, locked, tonumber(l[3]) or 0}

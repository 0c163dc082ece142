-- A region's pool of one global limit for one window (see src/store/global/mod.rs): the units
-- this region holds of the window in the home store, in a hash beside the limit's regional key
-- (same hash tag, same Cluster slot), one hash per window: the next window's, filled 2 s
-- ahead, and a replica whose clock is ahead leave the current window's pool whole. Replicas take
-- their slices from it; one replica at a time refills it from home (the `lock` field, a lease
-- that expires if its holder dies).
--
-- KEYS[1]  the pool of one window: a hash {have, taken, last, lock, lock_until, dry_until, fill,
--          owed, credited, cleared}
-- ARGV[1]  the operation: take | give | lock | fill | drain | trim | credit | settle | clear
-- ARGV[2]  units (take, give, fill, settle); credit: the window's share; clear: the record;
--          trim: the units not taken the pool keeps
-- ARGV[3]  the refiller's token (lock, fill, credit)
-- ARGV[4]  lock: the lease in ms; fill, credit: ms the home store is dry for (0: not dry);
--          clear: the record from which a pool cleared for it is kept (0: the record itself);
--          drain: ms without a take that make the pool idle; trim: the units granted the pool
--          as the caller saw them (a refill landed since: no trim)
-- ARGV[5]  how long the pool outlives this call, in ms (PEXPIRE)
-- ARGV[6]  the last reset record the calling replica applied: a pool this call creates starts
--          cleared for it (its units are all granted after those resets)
-- ARGV[7]  give: the reset the units were taken after (the pool's `cleared` then: refused if
--          the pool was cleared for a later one since); fill: the fence home's counter had when
--          the units were charged (0: none; a pool not cleared for it is cleared first, and
--          units charged before a fence the pool has seen, `fenced`, are dropped)
--
-- Reply: {ok, have, taken, dry_until, now, locked, fill, owed, last, cleared}: ok is 1/0 (drain, trim,
-- credit, clear: the units drained, added, dropped); locked is 1 while a refill's lease runs; fill is
-- the last refill's size; owed the units added on credit not yet charged at home; last the
-- last take's time; cleared the last reset record the pool was cleared for. Times are the Redis server's
-- (TIME), in ms.

local h = KEYS[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local cur = redis.call('HMGET', h, 'have', 'taken', 'lock', 'lock_until', 'dry_until', 'last')
local have, taken = tonumber(cur[1]), tonumber(cur[2]) or 0
local lock, lock_until = cur[3] or '', tonumber(cur[4]) or 0
local dry, last = tonumber(cur[5]) or 0, tonumber(cur[6]) or now
local debt = redis.call('HMGET', h, 'owed', 'credited')
local owed, credited = tonumber(debt[1]) or 0, tonumber(debt[2]) or 0
if have == nil then
  have = 0
  redis.call('HSET', h, 'have', 0, 'taken', 0, 'last', now, 'cleared', ARGV[6] or 0)
end
local op = ARGV[1]
local n = tonumber(ARGV[2])
local ok = 1
if op == 'take' then
  if n == 0 then
    -- a look at the pool: not a take (the pool's idleness is not reset)
  elseif have - taken >= n then
    taken, last = taken + n, now
    redis.call('HSET', h, 'taken', taken, 'last', now)
  else
    ok = 0
  end
elseif op == 'give' then
  if tonumber(ARGV[7] or 0) >= (tonumber(redis.call('HGET', h, 'cleared')) or 0) then
    local g = math.min(n, taken)
    taken = taken - g
    redis.call('HSET', h, 'taken', taken)
  else
    ok = 0
  end
elseif op == 'lock' then
  if lock ~= '' and lock ~= ARGV[3] and lock_until > now then
    ok = 0
  else
    redis.call('HSET', h, 'lock', ARGV[3], 'lock_until', now + tonumber(ARGV[4]))
  end
elseif op == 'fill' then
  -- Units the home store granted are added whoever holds the lock now (they were taken from
  -- home: never lost); the lock is released if it is still the filler's. Charged after a
  -- reset's fence the pool was not cleared for: cleared first; before one it has seen:
  -- dropped (on the count that reset forgot).
  local fence = tonumber(ARGV[7] or 0)
  local marks = redis.call('HMGET', h, 'fenced', 'cleared')
  local fenced, cleared = tonumber(marks[1]) or 0, tonumber(marks[2]) or 0
  if fence < fenced then
    if n > 0 then ok = 0 end
    n = 0
  end
  if fence > fenced and fence > cleared then
    have, taken, owed = 0, 0, 0
    redis.call('HSET', h, 'taken', 0, 'owed', 0, 'cleared', fence)
  end
  if fence > fenced then redis.call('HSET', h, 'fenced', fence) end
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
elseif op == 'credit' then
  -- Cut off from home (GLOBAL_UNREACHABLE=share): what is left of the window's share, on
  -- credit (owed home until settled); at most the share per window, whoever asks.
  local add = math.max(n - credited, 0)
  have, owed, credited = have + add, owed + add, credited + add
  dry = now + tonumber(ARGV[4])
  redis.call('HSET', h, 'have', have, 'owed', owed, 'credited', credited, 'dry_until', dry)
  if lock == ARGV[3] then
    redis.call('HDEL', h, 'lock', 'lock_until')
  end
  ok = add
elseif op == 'settle' then
  owed = owed - math.min(n, owed)
  redis.call('HSET', h, 'owed', owed)
elseif op == 'drain' then
  -- Every unit not taken leaves the pool (the caller returns them home), if no replica took
  -- any for ARGV[4] ms, no refill runs and nothing is owed home (settled first: units on
  -- credit refunded home before they were charged there would leave home short).
  if now - last >= tonumber(ARGV[4]) and (lock == '' or lock_until <= now) and owed == 0 then
    ok = have - taken
    have = taken
    redis.call('HSET', h, 'have', have)
  else
    ok = 0
  end
elseif op == 'trim' then
  -- The region's demand fell while home is nearly dry: what the pool holds beyond n units not
  -- taken leaves it (the caller returns them home), taken from lately or not, if no refill
  -- runs, nothing is owed home and no refill landed since the caller looked (ARGV[4], the
  -- units granted then). The pool's idleness is not reset.
  if (lock == '' or lock_until <= now) and owed == 0 and have == tonumber(ARGV[4])
      and have - taken > n then
    ok = have - taken - n
    have = taken + n
    redis.call('HSET', h, 'have', have)
  else
    ok = 0
  end
elseif op == 'clear' then
  -- The reset of home record n: the pool counts afresh (its units, what was taken and what is
  -- owed were on the count home forgot); a refill under way still lands, its lease kept. Only
  -- if the pool was not cleared for ARGV[4] (at most n; 0: n) or later: once per record (a
  -- second clear would drop what a refill brought from the fresh count), and a reset's closing
  -- record keeps a pool a refill charged after home's reset cleared for its fence.
  local keep = tonumber(ARGV[4])
  if keep == 0 then keep = n end
  if keep > (tonumber(redis.call('HGET', h, 'cleared')) or 0) then
    ok = have - taken
    have, taken, owed = 0, 0, 0
    redis.call('HSET', h, 'have', 0, 'taken', 0, 'owed', 0, 'cleared', n)
  else
    ok = 0
  end
end
redis.call('PEXPIRE', h, ARGV[5])
local locked = 0
local l = redis.call('HMGET', h, 'lock', 'lock_until', 'fill', 'cleared')
if l[1] and tonumber(l[2]) and tonumber(l[2]) > now then
  locked = 1
end
return {ok, have, taken, dry, now, locked, tonumber(l[3]) or 0, owed, last, tonumber(l[4]) or 0}

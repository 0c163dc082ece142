-- sluice: atomic rate-limit decisions for one or more requests (standalone Redis: concurrent
-- requests are sent together, in one call), or for one request's keys of one slot (Redis
-- Cluster). Each request is decided in order, seeing the writes of the ones before it, by the
-- charging rule of src/store/mod.rs (`charged`: all or nothing, except limits flagged record,
-- charged whatever the verdict); the whole call is atomic.
--
-- KEYS      the counter keys of every request, request after request. On Cluster all keys of
--           one call share a slot.
-- ARGV[1]   time override in microseconds since the Unix epoch, or "" to use the Redis server
--           clock (TIME). Only tests set it, and only `test-util` builds keep the line that reads
--           it; production always decides on the server clock, so replicas with skewed clocks
--           agree.
-- ARGV[2]   what the call returns: "0" each limit's answer; "1" (one slot of a Cluster request
--           spanning slots) besides it each charge's undo token and what the counter had left
--           before the request; "d" the same, deciding without writing (a slot whose refund
--           waits for the request's verdict); "x<a><o>" as "1", with the whole request's
--           verdict folded in (a = 0: it is denied; o = 1: a record limit of it is over, so the
--           stop rule holds); "p" the packed layout of plain requests (below, before the
--           general path)
-- ARGV[3]   the number of requests R; then, per request, its number of limits n followed by
--           K arguments per limit (K = 4, or 5 in an undo call):
--   limit      requests admitted per period (0 blocks everything)
--   period_us  period in microseconds (> 0); windows are aligned to the Unix epoch
--   hits       hits to charge (0 = check only: allowed while one more request would fit;
--              with the record flag, while the count is not above the limit); at most 2^40
--   meta       algorithm + 4 * flags + 256 * burst, where
--              algorithm  0 fixed_window, 1 sliding_window, 2 sliding_log, 3 token_bucket
--              flags      bit 0 (1): shadow, decided like an enforced limit, never denies
--                         bit 1 (2): refund, gives `hits` back (Envoy's is_negative_hits)
--                         bit 2 (4): undo, takes back exactly the charge `token` names (a
--                                    Cluster request denied in another slot); set on every
--                                    limit of an undo call, which decides nothing
--                         bit 3 (8): quota mode: its denial alone does not deny the request;
--                                    the request is denied if every quota limit of it denies
--                                    (a Cluster request spanning slots sends its quota limits
--                                    as shadow and applies that rule itself)
--                         bit 4 (16): record: charged whatever the verdict, also on a denied
--                                    request; allowed while the count after it is not above
--                                    the limit (envoyproxy counting, `record_usage`). Counts
--                                    saturate at 2^50.
--                         bit 5 (32): stop (envoyproxy's STOP_CACHE_KEY_INCREMENT_WHEN_
--                                    OVERLIMIT, on every limit of the request): if a record
--                                    limit would exceed, only those are charged
--              burst      token_bucket: requests allowed at once above the steady rate
--   token      undo calls only: what the charge returned as its token
-- (One number for algorithm, flags and burst: every argument is a Lua string to convert, and
-- this script's cost is measured against a minimal one; see docs/performance.md.)
--
-- Returns, request after request, {admitted, state_1, reset_us_1, retry_us_1, [token_1,
-- before_1,] state_2, ...}:
--   admitted    1 if every enforced limit allowed the request and, if it has quota limits, one
--               of them did; only then is anything written (a shadow or quota limit that
--               denies is never written), record limits aside (see the flags)
--   state_i     allowed_i + 2 * remaining_i: allowed_i is 1 if limit i alone allows it;
--               remaining_i what the limit saw (the hits left after it, with the request's
--               earlier limits on the same counter) when every limit that changed its counter
--               is charged; otherwise a limit not charged reports its counter as it stood
--   reset_us_i  microseconds until the counter is back to its full quota
--   retry_us_i  for a denial, microseconds until the request would be admitted (-1: never)
--   token_i     (ARGV[2] "1", "d", "x..") for a charge that was written, what an undo needs:
--               the window start (fixed and sliding window), the entry's id (sliding_log), 1
--               for token_bucket (its undo is exact arithmetic); 0 when nothing was written
--   before_i    (the same calls) what the counter had left before the request
-- An undo call returns {1, done_1, done_2, ...}: done 0 when the charge could not be taken back
-- within the bounded work below (the caller counts it).
--
-- Stored state (each write sets a TTL until the state stops mattering, plus the jitter below):
--   fixed_window    one key per window, "<KEYS[i]>:<window start / period>", holding the count
--                   (a plain integer, so a charge is one INCRBY). It shares KEYS[i]'s hash tag,
--                   hence its slot; it is the only key a call builds itself. A call whose clock
--                   is behind a newer window (a failover to a node with a slower clock) counts
--                   in its own, older window's key: the newer window's count is never touched.
--   sliding_window  string "<window start us>:<previous count>:<current count>"
--   sliding_log     sorted set, one entry per admitted charge: score = its time (us), member
--                   "<C>:<hits>:<id>" with C the running total of hits up to and including it
--                   (15 digits, zero-padded, so equal scores sort by C) and id its number in
--                   the set (unique, never rewritten: what an undo finds it by). The hits inside the
--                   window are C(newest) - C(newest expired entry), found in O(log n); expired
--                   entries are trimmed at most 64 per call.
--   token_bucket    string "<TAT us>:<frac>", the TAT being us + frac / limit microseconds, so
--                   the emission interval period / limit is exact
-- The math mirrors src/algorithm/mod.rs operation for operation (the parity test checks it);
-- keep the two in step. Every call does O(keys x log n) work: no loop runs over hits or over a
-- whole sorted set.

local now
-- With a time override the script's clock and Redis's expiry clock differ, so TTLs get an
-- hour of slack: a test's key must not expire in real time while its manual clock stands still.
-- The override is one line, which builds without the `test-util` feature remove.
local slack = 0
if ARGV[1] ~= '' then now = tonumber(ARGV[1]); slack = 3600000 end -- test-util
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end

local call, find, sub, floor, max, min, fmt =
  redis.call, string.find, string.sub, math.floor, math.max, math.min, string.format
-- Where a recorded count saturates (2^50; hits are at most 2^40): every sum stays exact.
local MAXC = 1125899906842624

-- EXPIRATION_JITTER_MAX_SECONDS in milliseconds: the store rewrites this line when it loads the
-- script (0: no jitter). Every TTL gets up to that much more, and never more than doubles, so
-- keys written at one window edge do not all expire at once, and a per-second key does not
-- live five minutes. The spread comes from the call's microseconds (math.random is seeded the
-- same on every script call).
local JITTER_MS = 0
local spread = (now % 1000003) * 7919
local function jittered(ms)
  local j = min(JITTER_MS, ms)
  if j <= 0 then return ms + slack end
  return ms + spread % (j + 1) + slack
end

-- fixed_window's rule, the one both layouts use: whether `hits` on a window holding `count`
-- fit under `limit` (a check, hits 0, asks for room for one more; a recorded charge is taken
-- whatever, and fits while the count after it is not above the limit), and the count after
-- the charge if it is made.
local function window_charge(count, hits, limit, record)
  local after = min(count + hits, MAXC)
  if record then return after <= limit, after end
  if hits == 0 then return count < limit, count end
  return after <= limit, after
end

-- The packed layout (ARGV[2] = "p"): plain requests only, every distinct counter once.
--   KEYS      the U distinct counter keys of the call
--   ARGV[3]   U; then per key: limit, period_us
--   then R, the number of requests; then per request 4n + m (m its counting, as for a plain
--             request) followed by n codes, one per limit:
--             hits * 64 + (index of its key in KEYS, from 0); U <= 64, and no request names a
--             key twice
-- Returns {now, then per request: admitted, then per limit allowed + 2 * remaining}: the same
-- answers as the general layout, less what follows from `now` alone (each fixed window's reset
-- is the end of its window, and a denial retries then, or never when the hits exceed the
-- limit). The requests are decided in order, each by the charging rule. Per request the script
-- only adds and compares: a counter shared by every request (a resource limit) is read, keyed
-- and written once per call.
if ARGV[2] == 'p' then
  local fmt, floor, max = string.format, math.floor, math.max
  local U = tonumber(ARGV[3])
  local limit, count, base, wk = {}, {}, {}, {}
  local ttl = {}
  for u = 1, U do
    local period = tonumber(ARGV[3 + 2 * u])
    limit[u] = tonumber(ARGV[2 + 2 * u])
    local start = now - now % period
    wk[u] = KEYS[u] .. fmt(':%d', start / period)
    ttl[u] = jittered(max(floor((start + period - now + 999) / 1000), 1))
  end
  local stored = redis.call('MGET', unpack(wk))
  for u = 1, U do
    local c = tonumber(stored[u] or -1)
    base[u] = c
    if c < 0 then c = 0 end
    count[u] = c
  end
  local out, o = {now}, 1
  local p = 4 + 2 * U
  for _ = 1, tonumber(ARGV[p]) do
    local hdr = tonumber(ARGV[p + 1])
    local m = hdr % 4
    local n = (hdr - m) / 4
    -- The verdict: all or nothing (m = 0) admits if every limit fits; a recording request
    -- (m = 1, or 3 with stop) is denied if a limit is over once charged.
    local ok, over = true, false
    for i = p + 2, p + 1 + n do
      local code = tonumber(ARGV[i])
      local u = code % 64 + 1
      if not window_charge(count[u], (code - u + 1) / 64, limit[u], m > 0) then
        if m > 0 then over = true else ok = false end
      end
    end
    o = o + 1
    if ok and not over then out[o] = 1 else out[o] = 0 end
    -- What is charged: all or nothing (m = 0); every limit (record), or with stop only the
    -- limits that exceed if any does. A limit reports what it leaves if charged, else what
    -- its counter has.
    for i = p + 2, p + 1 + n do
      local code = tonumber(ARGV[i])
      local u = code % 64 + 1
      local hits = (code - u + 1) / 64
      local c, lim = count[u], limit[u]
      local allowed, after = window_charge(c, hits, lim, m > 0)
      if (m == 0 and ok) or (m > 0 and (m < 2 or not over or not allowed)) then
        count[u], c = after, after
      end
      o = o + 1
      if allowed then out[o] = 1 + 2 * max(lim - c, 0) else out[o] = 2 * max(lim - c, 0) end
    end
    p = p + 1 + n
  end
  for u = 1, U do
    local c, was = count[u], base[u]
    if c > was and c > 0 then
      if was < 0 then
        redis.call('SET', wk[u], c, 'PX', ttl[u])
      else
        redis.call('INCRBY', wk[u], c - was)
      end
    end
  end
  return out
end

-- ARGV[2]: see the top.
local mode = ARGV[2]
local tokens_wanted = mode == '1' or mode == 'd' or string.sub(mode, 1, 1) == 'x'
local dry = mode == 'd'
local ext_admitted, ext_over = 1, false
if string.sub(mode, 1, 1) == 'x' then
  ext_admitted = tonumber(string.sub(mode, 2, 2))
  ext_over = string.sub(mode, 3, 3) == '1'
end
local R = tonumber(ARGV[3])
-- An undo call is one request whose limits all carry the undo flag.
local undo = #KEYS > 0 and tonumber(ARGV[4]) > 0 and math.floor(tonumber(ARGV[8]) / 16) % 2 == 1
local K = 4
if undo then K = 5 end
local W = 3
if tokens_wanted then W = 5 end
-- Which algorithms this call needs: only their helpers are built (each `function` below is a
-- closure created on every call, which costs as much as a Redis command).
local has = {}
do
  local p = 4
  for _ = 1, R do
    local n = tonumber(ARGV[p])
    for i = 1, n do has[tonumber(ARGV[p + 4 + K * (i - 1)]) % 4] = true end
    p = p + 1 + K * n
  end
end

local TRIM = 64
local REFUND_ENTRIES = 64
local UNDO_REWRITE = 256

-- Whole milliseconds, rounded up, at least 1, jittered: a TTL for PEXPIRE / SET PX.
local function ttl_ms(us)
  return jittered(max(floor((us + 999) / 1000), 1))
end

-- "a:b" -> a, b (numbers); "a" -> a, 0
local function pair(raw)
  local p = find(raw, ':', 1, true)
  if not p then return tonumber(raw), 0 end
  return tonumber(sub(raw, 1, p - 1)), tonumber(sub(raw, p + 1))
end

local function fits(used, hits, limit)
  if hits == 0 then return used < limit end
  return used + hits <= limit
end

---------------------------------------------------------------------------- fixed / sliding window

local window_key, load_counter, fixed, estimate, sliding
if has[0] or has[1] then
  -- fixed_window keeps one key per window, `<key>:<window index>`, holding the count.
  window_key = function(key, start, period)
    return key .. fmt(':%d', start / period)
  end

  load_counter = function(key, alg, period)
    if alg == 0 then
      local start = now - now % period
      return {ws = start, a = tonumber(call('GET', window_key(key, start, period)) or 0), b = 0}
    end
    local raw = call('GET', key)
    if not raw then return {ws = -1, a = 0, b = 0} end
    local p1 = find(raw, ':', 1, true)
    local p2 = find(raw, ':', p1 + 1, true)
    return {ws = tonumber(sub(raw, 1, p1 - 1)), a = tonumber(sub(raw, p1 + 1, p2 - 1)),
      b = tonumber(sub(raw, p2 + 1))}
  end

  -- fixed_window; s = {ws, a = count}
  fixed = function(s, limit, period, hits, refund, record)
    local start = now - (now % period)
    local current = 0
    if s.ws == start then current = s.a end
    local reset = start + period - now
    local allowed, after = true, current
    if refund then
      after = max(current - hits, 0)
    else
      allowed, after = window_charge(current, hits, limit, record)
      if not allowed and not record then after = current end
    end
    local retry = 0
    if not allowed then
      if max(hits, 1) > limit then retry = -1 else retry = reset end
    end
    if allowed or record then
      s.ws, s.a = start, after
      if hits > 0 then s.dirty = true end
    end
    return allowed, max(limit - after, 0), reset, retry, start
  end

  estimate = function(prev, cur, elapsed, period)
    local w = (period - elapsed) / period
    return prev * w + cur
  end

  -- sliding_window; s = {ws, a = previous, b = current}
  sliding = function(s, limit, period, hits, refund, record)
    local start = now - (now % period)
    local prev, cur = 0, 0
    if s.ws >= start then
      -- A stored window newer than `now` (a clock stepped back on a failover) is the current
      -- one: an older window never overwrites it.
      start = s.ws
      prev, cur = s.a, s.b
    elseif s.ws + period == start then
      prev = s.b
    end
    local elapsed = max(now - start, 0)
    local est = estimate(prev, cur, elapsed, period)
    local allowed, after
    if refund then
      allowed, after = true, max(cur - hits, 0)
    elseif record then
      allowed, after = est + hits <= limit, min(cur + hits, MAXC)
    else
      if hits == 0 then allowed = est < limit else allowed = est + hits <= limit end
      if allowed then after = cur + hits else after = cur end
    end
    local used = estimate(prev, after, elapsed, period)
    local remaining = max(floor(limit - used), 0)
    local retry = 0
    if not allowed then
      local h = max(hits, 1)
      if h > limit then
        retry = -1
      elseif prev > 0 and cur + h <= limit then
        local need = est + h - limit
        retry = min(math.ceil(need / prev * period), period - elapsed)
      elseif cur + h <= limit then
        retry = period - elapsed
      else
        -- This window's hits slide out of the next one: cur * (period - x) / period + h <= limit.
        retry = period - elapsed + math.ceil((cur + h - limit) / cur * period)
      end
    end
    if allowed or record then
      s.ws, s.a, s.b = start, prev, after
      if hits > 0 then s.dirty = true end
    end
    return allowed, remaining, period - elapsed, retry, start
  end

  --
end

-------------------------------------------------------------------------------- sliding_log
-- A log view: what is stored (read with O(log n) commands) plus what this call changes at the
-- newest end: stored entries popped or shrunk by refunds, and entries added.

local parse_member, entry, load_log, cached, newest_stored, log_count, log_retry, sliding_log, member, commit_log, undo_log
if has[2] then
  -- "C:h:id" -> C, h, id
  parse_member = function(m)
    local p1 = find(m, ':', 1, true)
    local p2 = find(m, ':', p1 + 1, true)
    return tonumber(sub(m, 1, p1 - 1)), tonumber(sub(m, p1 + 1, p2 - 1)), tonumber(sub(m, p2 + 1))
  end

  entry = function(key, rank)
    local r = call('ZRANGE', key, rank, rank, 'WITHSCORES')
    local c, h, id = parse_member(r[1])
    return {m = r[1], c = c, h = h, id = id, t = tonumber(r[2])}
  end

  load_log = function(key, period)
    local v = {size = call('ZCARD', key), adds = {}, addsum = 0, sp = 0, spsum = 0, sr = 0,
      cache = {}}
    v.e = 0
    v.base, v.top = 0, 0
    if v.size > 0 then
      v.e = call('ZCOUNT', key, '-inf', fmt('%d', now - period))
      local last = entry(key, v.size - 1)
      v.cache[v.size - 1] = last
      v.top = last.c
      if v.e > 0 then
        v.base = entry(key, v.e - 1).c
      elseif v.size > 0 then
        local first = entry(key, 0)
        v.base = first.c - first.h
      end
    end
    return v
  end

  cached = function(key, v, rank)
    local en = v.cache[rank]
    if not en then
      en = entry(key, rank)
      v.cache[rank] = en
    end
    return en
  end

  -- Index of the newest stored entry still in the view (in the window, not popped), or nil.
  newest_stored = function(v)
    local r = v.size - 1 - v.sp
    if r >= v.e then return r end
    return nil
  end

  log_count = function(v)
    local stored = 0
    if v.size > v.e then stored = v.top - v.base - v.spsum - v.sr end
    return stored + v.addsum
  end

  -- When a denied charge of `hits` on a view holding `count` would fit (-1: never).
  log_retry = function(key, v, count, limit, period, hits)
    local retry = 0
    local h = max(hits, 1)
    if h > limit then
      retry = -1
    else
      -- The entry whose hits bring the total that left the window to count + h - limit.
      local need = count + h - limit
      local hi = newest_stored(v)
      local stored = 0
      if hi then stored = v.top - v.base - v.spsum - v.sr end
      local t = nil
      if hi and stored >= need then
        -- The first rank whose running total (above base) reaches need. Interpolation
        -- first (with one hit per entry the totals are linear in the rank: two or three
        -- probes), then bisection, so it is O(log n) ZRANGE probes at worst.
        local lo, vlo, vhi, steps = v.e, 0, v.top - v.spsum - v.base, 0
        while lo < hi do
          local mid
          if steps < 3 and vhi > vlo then
            mid = lo + floor((need - vlo - 1) * (hi - lo) / (vhi - vlo))
            if mid < lo then mid = lo elseif mid >= hi then mid = hi - 1 end
          else
            mid = floor((lo + hi) / 2)
          end
          steps = steps + 1
          local cm = cached(key, v, mid).c - v.base
          if cm >= need then hi, vhi = mid, cm else lo, vlo = mid + 1, cm end
        end
        t = cached(key, v, lo).t
      else
        local acc = stored
        for _, a in ipairs(v.adds) do
          acc = acc + a.h
          if acc >= need then t = a.t break end
        end
      end
      if t then retry = max(t + period - now, 0) end
    end
    return retry
  end

  sliding_log = function(key, v, limit, period, hits, refund, no_retry, record)
    local count = log_count(v)
    local allowed = true
    local token = 0
    local pre_retry = nil
    if refund then
      local left, touched = hits, 0
      while left > 0 and touched < REFUND_ENTRIES do
        local na = #v.adds
        if na > 0 then
          local a = v.adds[na]
          if a.h <= left then
            left = left - a.h
            v.addsum = v.addsum - a.h
            v.adds[na] = nil
          else
            a.h = a.h - left
            v.addsum = v.addsum - left
            left = 0
          end
        else
          local r = newest_stored(v)
          if not r then break end
          local en = cached(key, v, r)
          local h = en.h - v.sr
          if h <= left then
            left = left - h
            v.sp, v.spsum, v.sr = v.sp + 1, v.spsum + en.h, 0
          else
            v.sr = v.sr + left
            left = 0
          end
        end
        touched = touched + 1
      end
      v.dirty = true
    elseif record then
      -- Charged whatever the verdict; once the log holds `limit` entries (at least one) a
      -- charge joins the newest entry, restamped, so the set never grows past the limit.
      allowed = count + hits <= limit
      if not allowed and not no_retry then
        -- Read off the log as it was, before this charge joins it (as src/algorithm does).
        pre_retry = log_retry(key, v, count, limit, period, hits)
      end
      hits = min(hits, max(MAXC - count, 0))
      if hits > 0 then
        local t = now
        local na = #v.adds
        local r = newest_stored(v)
        if na > 0 then
          t = max(v.adds[na].t, now)
        elseif r then
          t = max(cached(key, v, r).t, now)
        end
        local entries = na
        if r then entries = entries + r - v.e + 1 end
        if entries >= max(limit, 1) then
          if na > 0 then
            v.adds[na].t, v.adds[na].h = t, v.adds[na].h + hits
            v.addsum = v.addsum + hits
          else
            local en = cached(key, v, r)
            local h = en.h - v.sr
            v.sp, v.spsum, v.sr = v.sp + 1, v.spsum + en.h, 0
            v.adds[1] = {t = t, h = h + hits}
            v.addsum = v.addsum + h + hits
          end
        else
          v.adds[na + 1] = {t = t, h = hits}
          v.addsum = v.addsum + hits
        end
        v.dirty = true
      end
    elseif fits(count, hits, limit) then
      if hits > 0 then
        local t = now
        local na = #v.adds
        if na > 0 then
          t = max(v.adds[na].t, now)
        else
          local r = newest_stored(v)
          if r then t = max(cached(key, v, r).t, now) end
        end
        v.adds[na + 1] = {t = t, h = hits}
        v.addsum = v.addsum + hits
        v.dirty = true
      end
    else
      allowed = false
    end
    local after = log_count(v)
    local retry = pre_retry or 0
    if not allowed and not no_retry and not pre_retry then
      retry = log_retry(key, v, count, limit, period, hits)
    end
    local reset = 0
    local na = #v.adds
    if na > 0 then
      reset = v.adds[na].t + period - now
    else
      local r = newest_stored(v)
      if r then reset = cached(key, v, r).t + period - now end
    end
    return allowed, max(limit - after, 0), max(reset, 0), retry, token
  end

  member = function(c, h, id)
    return fmt('%015d:%d:%d', c, h, id)
  end

  commit_log = function(key, v, period)
    -- Pops and shrinks first (newest end), then the new entries, then a bounded trim of expired
    -- ones from the oldest end; C keeps running from the newest entry left in the set.
    if v.sp > 0 then call('ZREMRANGEBYRANK', key, v.size - v.sp, v.size - 1) end
    -- New entries' ids continue from the newest one left, so ids are unique within the set
    -- and never change (C does, when an undo removes an older entry).
    local cprev, idprev, newest_t = 0, 0, nil
    local r = v.size - 1 - v.sp
    if r >= 0 then
      local en = cached(key, v, r)
      cprev, idprev = en.c, en.id
      if v.sr > 0 then
        cprev = en.c - v.sr
        call('ZREM', key, en.m)
        call('ZADD', key, fmt('%d', en.t), member(cprev, en.h - v.sr, en.id))
      end
      newest_t = en.t
    end
    local tokens = {}
    if #v.adds > 0 then
      local z = {}
      for i, a in ipairs(v.adds) do
        cprev, idprev = cprev + a.h, idprev + 1
        z[#z + 1] = fmt('%d', a.t)
        z[#z + 1] = member(cprev, a.h, idprev)
        tokens[i] = idprev
        newest_t = a.t
      end
      call('ZADD', key, unpack(z))
    end
    if v.e > 0 then call('ZREMRANGEBYRANK', key, 0, min(v.e, TRIM) - 1) end
    if newest_t and call('EXISTS', key) == 1 then
      call('PEXPIRE', key, ttl_ms(newest_t + period - now))
    end
    return tokens
  end

  -- Takes back exactly the entry a charge added (found by its id among the newest entries):
  -- removes it and lowers C of the entries after it by its hits.
  undo_log = function(key, id)
    local newest = call('ZREVRANGE', key, 0, UNDO_REWRITE, 'WITHSCORES')
    local at = nil
    for j = 1, #newest, 2 do
      local _, _, eid = parse_member(newest[j])
      if eid == id then at = j break end
    end
    if not at then
      -- Gone (expired and trimmed) unless the set is too long to have been searched whole.
      if #newest / 2 > UNDO_REWRITE then return 0 end
      return 1
    end
    local _, h = parse_member(newest[at])
    call('ZREM', key, newest[at])
    if at > 1 then
      local rem, add = {}, {}
      for j = 1, at - 1, 2 do
        local lc, lh, lid = parse_member(newest[j])
        rem[#rem + 1] = newest[j]
        add[#add + 1] = newest[j + 1]
        add[#add + 1] = member(lc - h, lh, lid)
      end
      call('ZREM', key, unpack(rem))
      call('ZADD', key, unpack(add))
    end
    return 1
  end
end

--------------------------------------------------------------------------------- token_bucket
-- Times are pairs (us, frac): us + frac / limit microseconds.

local intervals, le, fadd, fsub, load_bucket, token_bucket
if has[3] then
  intervals = function(h, period, limit)
    local q, r = floor(period / limit), period % limit
    local rh = r * h
    return q * h + floor(rh / limit), rh % limit
  end

  le = function(au, af, bu, bf)
    return au < bu or (au == bu and af <= bf)
  end

  fadd = function(u, f, du, df, limit)
    local s = f + df
    return u + du + floor(s / limit), s % limit
  end

  -- u.f - du.df, never below (now, 0)
  fsub = function(u, f, du, df, limit)
    local borrow, nf = 0, f - df
    if f < df then borrow, nf = 1, f + limit - df end
    local nu = u - du - borrow
    if nu < now then return now, 0 end
    return nu, nf
  end

  load_bucket = function(key)
    local raw = call('GET', key)
    if not raw then return {u = now, f = 0} end
    local u, f = pair(raw)
    return {u = u, f = f}
  end

  token_bucket = function(s, limit, period, hits, refund, burst, record)
    if limit == 0 then
      local retry = -1
      if refund then retry = 0 end
      return refund, 0, 0, retry, 0
    end
    local slots = burst + 1
    local tau_u, tau_f = intervals(slots, period, limit)
    local hz_u, hz_f = fadd(now, 0, tau_u, tau_f, limit)
    local tu, tf = s.u, s.f
    if tu < now then tu, tf = now, 0 end
    local h = max(hits, 1)
    local allowed = true
    local nu, nf = tu, tf
    local cu, cf = nil, nil
    if refund then
      local du, df = intervals(min(hits, slots), period, limit)
      nu, nf = fsub(tu, tf, du, df, limit)
    elseif record then
      -- Charged whatever the verdict, at most one bucket into debt (see src/algorithm).
      local du, df = intervals(min(h, slots), period, limit)
      local xu, xf = fadd(tu, tf, du, df, limit)
      if hits == 0 then
        allowed = le(tu, tf, hz_u, hz_f)
      else
        allowed = h <= slots and le(xu, xf, hz_u, hz_f)
        local du2, df2 = xu, xf
        if h > slots then du2, df2 = fadd(xu, xf, tau_u, tau_f, limit) end
        local cap_u, cap_f = fadd(hz_u, hz_f, tau_u, tau_f, limit)
        if le(du2, df2, cap_u, cap_f) then nu, nf = du2, df2 else nu, nf = cap_u, cap_f end
      end
      if h <= slots then cu, cf = xu, xf end
    elseif h > slots then
      allowed = false
    else
      local du, df = intervals(h, period, limit)
      cu, cf = fadd(tu, tf, du, df, limit)
      allowed = le(cu, cf, hz_u, hz_f)
      if allowed and hits > 0 then nu, nf = cu, cf end
    end
    local ceil_new = nu
    if nf > 0 then ceil_new = nu + 1 end
    local ttl = ceil_new - now
    local retry = 0
    if not allowed then
      if not cu then
        retry = -1
      else
        local wu, wf = fsub(cu, cf, tau_u, tau_f, limit)
        if wf > 0 then wu = wu + 1 end
        retry = wu - now
      end
    end
    local used = (nu - now) * limit + nf
    local room = tau_u * limit + tau_f - used
    local remaining = max(floor(room / period), 0)
    if allowed or record then
      s.u, s.f = nu, nf
      if hits > 0 then s.dirty = true end
    end
    return allowed, remaining, ttl, retry, 0
  end
end

------------------------------------------------------------------------------------- the call

if undo then
  local out, n = {1}, tonumber(ARGV[4])
  for i = 1, n do
    local key, b = KEYS[i], 5 + K * (i - 1)
    local limit, period, hits = tonumber(ARGV[b]), tonumber(ARGV[b + 1]), tonumber(ARGV[b + 2])
    local meta, token = tonumber(ARGV[b + 3]), tonumber(ARGV[b + 4])
    local alg, burst = meta % 4, floor(meta / 256)
    local done = 1
    if alg == 2 then
      done = undo_log(key, token)
    elseif alg == 3 then
      -- Exact subtraction, not clamped at now: a TAT in the past means a full bucket either
      -- way, and the stored value goes back to exactly what it was before the charge.
      if limit > 0 and call('EXISTS', key) == 1 then
        local s = load_bucket(key)
        local du, df = intervals(min(hits, burst + 1), period, limit)
        local nu, nf = s.u - du, s.f - df
        if nf < 0 then nu, nf = nu - 1, nf + limit end
        call('SET', key, fmt('%d:%d', nu, nf), 'KEEPTTL')
      end
    elseif alg == 0 then
      -- The charged window's own key, whether or not a window edge passed since.
      local wk = window_key(key, token, period)
      local c = tonumber(call('GET', wk) or 0)
      if c > hits then
        call('DECRBY', wk, hits)
      elseif c > 0 then
        call('DEL', wk)
      end
    else
      local s = load_counter(key, alg, period)
      local changed = false
      if s.ws == token then
        s.b, changed = max(s.b - hits, 0), true
      elseif s.ws == token + period then
        s.a, changed = max(s.a - hits, 0), true
      end
      if changed then
        if s.a == 0 and s.b == 0 then
          call('DEL', key)
        else
          call('SET', key, fmt('%d:%d:%d', s.ws, s.a, s.b), 'KEEPTTL')
        end
      end
    end
    out[i + 1] = done
  end
  return out
end

-- Runs the algorithm of check i (0-based offset b into ARGV) on view v, as a recording charge
-- (the re-run of a request of which only some checks are charged).
local function record_on(key, v, b, meta)
  local limit, period, hits = tonumber(ARGV[b]), tonumber(ARGV[b + 1]), tonumber(ARGV[b + 2])
  local alg, refund = meta % 4, floor(meta / 8) % 2 == 1
  if alg == 0 then
    fixed(v, limit, period, hits, refund, not refund)
  elseif alg == 1 then
    sliding(v, limit, period, hits, refund, not refund)
  elseif alg == 2 then
    sliding_log(key, v, limit, period, hits, refund, true, not refund)
  else
    token_bucket(v, limit, period, hits, refund, floor(meta / 256), not refund)
  end
end

local function load_view(key, alg, period)
  if alg == 2 then return load_log(key, period) end
  if alg == 3 then return load_bucket(key) end
  return load_counter(key, alg, period)
end

-- Writes every view a check changed; returns the sliding logs' new entry ids by key.
local function write_views(KB, AB, n, views)
  local written = {}
  for i = 1, n do
    local key = KEYS[KB + i]
    local v = views[key]
    if v and v.dirty then
      v.dirty = false
      local b = AB + 1 + K * (i - 1)
      local period, alg = tonumber(ARGV[b + 1]), tonumber(ARGV[b + 3]) % 4
      if alg == 0 then
        call('SET', window_key(key, v.ws, period), v.a, 'PX', ttl_ms(v.ws + period - now))
      elseif alg == 1 then
        call('SET', key, fmt('%d:%d:%d', v.ws, v.a, v.b), 'PX', ttl_ms(v.ws + 2 * period - now))
      elseif alg == 2 then
        written[key] = commit_log(key, v, period)
      else
        local ceil_tat = v.u
        if v.f > 0 then ceil_tat = v.u + 1 end
        call('SET', key, fmt('%d:%d', v.u, v.f), 'PX', ttl_ms(ceil_tat - now))
      end
    end
  end
  return written
end

-- What a counter has left as it stands on view v (a check of 0 hits; it changes nothing).
local function left_on(key, v, alg, limit, period, meta)
  local _, remaining
  if alg == 2 then
    _, remaining = sliding_log(key, v, limit, period, 0, false, true)
  elseif alg == 3 then
    _, remaining = token_bucket(v, limit, period, 0, false, floor(meta / 256))
  elseif alg == 0 then
    _, remaining = fixed(v, limit, period, 0, false)
  else
    _, remaining = sliding(v, limit, period, 0, false)
  end
  return remaining
end

local function general(KB, AB, n)
  local out = {1}
  local views = {}
  local recs, oks, refs, touched, stop, over = {}, {}, {}, {}, false, false
  local admitted = 1
  local quotas, quotas_allowed = 0, 0
  local logslot = {} -- check index -> position of its entry among its key's adds
  local before = {} -- key -> what it had left before this request (tokens_wanted)
  local tokens = {} -- check index -> its undo token, if its charge is written

  for i = 1, n do
    local key, b = KEYS[KB + i], AB + 1 + K * (i - 1)
    local limit, period, hits = tonumber(ARGV[b]), tonumber(ARGV[b + 1]), tonumber(ARGV[b + 2])
    local meta = tonumber(ARGV[b + 3])
    local alg, flags = meta % 4, floor(meta / 4) % 64
    local refund = floor(flags / 2) % 2 == 1
    -- As the Rust `Admission`: a shadow limit or a refund never takes part in the quota rule.
    local quota = floor(flags / 8) % 2 == 1 and flags % 2 == 0 and not refund
    local record = floor(flags / 16) % 2 == 1
    if flags >= 32 then stop = true end
    local v = views[key]
    if not v then
      v = load_view(key, alg, period)
      views[key] = v
      if tokens_wanted then before[key] = left_on(key, v, alg, limit, period, meta) end
    end
    local allowed, remaining, reset, retry, token
    if alg == 0 then
      allowed, remaining, reset, retry, token = fixed(v, limit, period, hits, refund, record)
    elseif alg == 1 then
      allowed, remaining, reset, retry, token = sliding(v, limit, period, hits, refund, record)
    elseif alg == 2 then
      local before_adds = #v.adds
      allowed, remaining, reset, retry, token =
        sliding_log(key, v, limit, period, hits, refund, false, record)
      if #v.adds > before_adds then logslot[i] = #v.adds end
    else
      allowed, remaining, reset, retry, token =
        token_bucket(v, limit, period, hits, refund, floor(meta / 256), record)
    end
    recs[i], oks[i], refs[i] = record, allowed, refund
    -- What this check did to its view: a charge or refund that changes the counter.
    touched[i] = (hits > 0) and (allowed or record)
    if record and not allowed then over = true end
    if quota then quotas = quotas + 1 end
    local o = 2 + W * (i - 1)
    if allowed then
      out[o] = 1 + 2 * remaining
      if quota then quotas_allowed = quotas_allowed + 1 end
    else
      out[o] = 2 * remaining
      if flags % 2 == 0 and not quota then admitted = 0 end
    end
    out[o + 1] = reset
    out[o + 2] = retry
    if tokens_wanted then
      -- Only a written charge has something to undo (set below, once it is written).
      out[o + 3] = 0
      out[o + 4] = before[key]
      if not (allowed and hits > 0 and not refund) then
        token = 0
      elseif alg >= 2 then
        token = 1 -- a token bucket's undo is arithmetic; a log entry's id is known once written
      end
      tokens[i] = token
    end
  end

  if quotas > 0 and quotas_allowed == 0 then admitted = 0 end
  -- The other slots' verdict (a Cluster request spanning slots).
  if ext_admitted == 0 then admitted = 0 end
  if ext_over then stop, over = true, true end
  out[1] = admitted
  if dry then return out end
  -- The charging rule (src/store/mod.rs `charged`): a record check is always charged; any other
  -- only on an admitted request that it allowed; with stop, if a record check exceeds, only
  -- those. When that is exactly what the views hold, they are written as they are.
  local charged, exact = {}, true
  for i = 1, n do
    if stop and over then
      charged[i] = recs[i] and (refs[i] or not oks[i])
    else
      charged[i] = recs[i] or (admitted == 1 and oks[i])
    end
    if touched[i] and not charged[i] then exact = false end
  end
  local views_written, slots = views, logslot
  if not exact then
    -- Some changes are not to be written: report what the counters that are not charged
    -- really have left (a view no check changed is what Redis holds; a changed one is read
    -- again; a denial is the path an attacker drives, so it stays O(log n) too), then charge
    -- only the checks that are, on fresh views.
    for i = 1, n do
      if not charged[i] then
        local key, b = KEYS[KB + i], AB + 1 + K * (i - 1)
        local limit, period = tonumber(ARGV[b]), tonumber(ARGV[b + 1])
        local meta = tonumber(ARGV[b + 3])
        local v = views[key]
        if v.dirty then v = load_view(key, meta % 4, period) end
        local o = 2 + W * (i - 1)
        out[o] = out[o] % 2 + 2 * left_on(key, v, meta % 4, limit, period, meta)
      end
    end
    views_written, slots = {}, {}
    for i = 1, n do
      if charged[i] and touched[i] then
        local key, b = KEYS[KB + i], AB + 1 + K * (i - 1)
        local meta = tonumber(ARGV[b + 3])
        local v = views_written[key]
        if not v then
          v = load_view(key, meta % 4, tonumber(ARGV[b + 1]))
          views_written[key] = v
        end
        local adds = v.adds and #v.adds
        record_on(key, v, b, meta)
        if adds and #v.adds > adds then slots[i] = #v.adds end
      end
    end
  end
  local written = write_views(KB, AB, n, views_written)
  if tokens_wanted then
    -- The undo token of each charge written: its window (fixed, sliding), its entry's id
    -- (sliding_log), 1 for a token bucket (whose undo is arithmetic); 0 for nothing to undo.
    for i = 1, n do
      if charged[i] and touched[i] and tokens[i] ~= 0 then
        local o = 5 + W * (i - 1)
        local pos = slots[i]
        if pos then
          local t = written[KEYS[KB + i]]
          if t and t[pos] then out[o] = t[pos] end
        else
          out[o] = tokens[i]
        end
      end
    end
  end
  return out
end

-- Decides every request of the call in turn (each by the charging rule, each seeing the
-- writes of the ones before it) and returns their answers one after the other.
local result, p, kb = {}, 4, 0
for _ = 1, R do
  local n = tonumber(ARGV[p])
  local o = general(kb, p, n)
  for j = 1, #o do result[#result + 1] = o[j] end
  p, kb = p + 1 + K * n, kb + n
end
return result

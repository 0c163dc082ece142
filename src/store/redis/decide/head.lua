-- sluice: atomic rate-limit decisions for one or more requests (standalone Redis: concurrent
-- requests are sent together, in one call), or for one request's keys of one slot (Redis
-- Cluster). Each request is decided in order, seeing the writes of the ones before it, by the
-- charging rule of src/store/mod.rs (`charged`: all or nothing, except limits flagged record,
-- charged whatever the verdict); the whole call is atomic.
--
-- One script, kept in six files of src/store/redis/decide/ that codec.rs joins in this order
-- (each under 600 lines): head.lua (this: arguments, clock, the packed layout), window.lua,
-- log.lua, bucket.lua (one algorithm each), lease.lua (in_flight slots, reservations), call.lua
-- (undo, the charging rule, the loop).
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
--           general path); "g<ttl ms>" as "0", applied at most once: a write-back
--           (FAILURE_MODE=local: usage a replica decided while the store could not answer,
--           retried after a lost reply). The LAST key of KEYS is then its guard, not a limit:
--           the call sets it for <ttl ms> and, if it was set already, changes nothing and
--           returns {-1}; "f<cleared>" as "0", for a home store's refund of units a region's
--           pool drained (one request, one limit): if the charged window's counter (its key,
--           "#reset") was fenced by a reset past <cleared>, the pool's last clear, nothing
--           changes and the call returns {-1} (store/global/admin.rs); "s<...>" as "0",
--           for a home store's grant of a global limit's refill (one request, one limit), its
--           hits capped at the region's max-min share from the regions' reports (the LAST key
--           of KEYS, not a limit), the reply followed by the hits charged (below, and
--           store/redis/fair.rs)
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
--              burst      token_bucket: requests allowed at once above the steady rate;
--                         a pinned fixed_window (a calendar's, config/calendar.rs, or a
--                         leased limit's): 2 * its start in Unix milliseconds, + 1 for a
--                         calendar window, `period_us` then being its length (the window is
--                         the caller's, not `now`'s multiple of the period: see `pinned_of`)
--   token      undo calls only: what the charge returned as its token
--   A request with a lease limit (`in_flight`, or a rate limit with `reservations` whose
--   descriptor names a request) sends -n instead of n, and K = 8: after meta, per limit,
--   op         0 none; 1 take a slot for `id`; 2 free `id`'s slot; 3 check for a free slot (no
--              id); 4 reserve `hits` for `id`; 5 settle `id`'s reservation at `hits`
--   id         the request id ("" for op 0 and 3)
--   lease      ops 4 and 5: a reservation's lease in us (else 0)
--   cap        ops 4 and 5: the reservations one counter holds at most (else 0)
--   Slots are a sorted set at the limit's key: member = request id, score = when its lease ends
--   (us); `limit` slots, `period_us` the lease. Expired members are dropped by the next call on
--   the counter (ZREMRANGEBYSCORE; at most `limit` of them plus those a lease ended), and the
--   key expires a lease after its last take: no sweeper walks the keys.
--   Reservations ride beside the counter's own state (which is the algorithm's, unchanged):
--   "<KEYS[i]>:e", a sorted set, member = request id, score = when its lease ends (us), and
--   "<KEYS[i]>:r", a hash, field = request id, value "<hits>:<until us>" (until when a settle
--   may give hits back: the end of the window that took them). Both share KEYS[i]'s hash tag;
--   each call drops at most 64 ended entries and both keys expire a lease after the last
--   reservation. src/algorithm/reserve.rs has the rules.
-- (One number for algorithm, flags and burst: every argument is a Lua string to convert, and
-- this script's cost is measured against a minimal one; see docs/performance.md.)
--
-- Returns, request after request, {admitted, state_1, reset_us_1, retry_us_1, [token_1,
-- before_1,] [effect_1, left_us_1,] state_2, ...}:
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
--   effect_i, left_us_i  (a request in the lease layout, K = 8, on each of its limits) what
--               the call did to the limit's lease entries: effect = code + 4 * the ended
--               entries it dropped, code 0 nothing, 1 an entry added (a slot taken, a
--               reservation made), 2 one released before its lease ended (a free, a settle),
--               3 a release that found none; left_us the added or released entry's lease left
--               (src/store/lease_effect.rs)
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

local kind = sub(ARGV[2], 1, 1)
if kind == 'g' then
  if not call('SET', KEYS[#KEYS], '1', 'NX', 'PX', tonumber(sub(ARGV[2], 2))) then
    return {-1}
  end
  ARGV[2] = '0'
end
-- "f<cleared>" (a home store's refund of a region's pool, one request of one limit): as "0",
-- unless a reset fenced the charged window's counter past <cleared> (call.lua): then {-1}.
local fence = nil
if kind == 'f' then
  fence = tonumber(sub(ARGV[2], 2))
  ARGV[2] = '0'
end
-- "s<mine>:<end ms>:<fresh ms>:<ahead ms>:<max regions>:<region>" (a home store's grant of a
-- global limit's refill, one request of one limit; store/global/ask.rs): its hits are capped
-- at the region's max-min share of the window as the regions' reports have them now (their
-- hash is the LAST key, not a limit), computed as store/global/fair.rs's `share_left` computes
-- it, on reports read as `RegionReport::decode` reads them (keep the three in step:
-- tests/cases/global_fair_home.rs checks them on the same boards). The call goes on as "0"
-- (a share of 0: a check of 0 hits, nothing charged, what home has left answered), its reply
-- followed by the hits it charged (or, denied, asked; 0: the share was spent) and the charged
-- window's reset fence (call.lua). Reports are
-- stamped with their regions' clocks and judged on this server's.
local fair_hits = nil
if kind == 's' then
  local f, rest = {}, sub(ARGV[2], 2)
  for i = 1, 5 do
    local c = find(rest, ':', 1, true)
    f[i] = tonumber(sub(rest, 1, c - 1))
    rest = sub(rest, c + 1)
  end
  local mine, end_ms, fresh_ms, ahead_ms, max_regions = f[1], f[2], f[3], f[4], f[5]
  local limit, now_ms = tonumber(ARGV[5]), floor(now / 1000)
  -- A report's field as Rust's u64 parse reads it (digits only, at most u64::MAX), else nil.
  local function u64(t)
    local d = t and string.match(t, '^%+?(%d+)$')
    if not d then return nil end
    d = string.match(d, '^0*(%d.*)$')
    if #d > 20 or (#d == 20 and d > '18446744073709551615') then return nil end
    return tonumber(d)
  end
  -- Every other region's claim (fair.rs, `Claim::from_report`): what it was granted, and its
  -- demand (nil: more than any share). A value that is not a report is skipped, as there.
  local granted, demand, seen = {}, {}, 0
  local all = call('HGETALL', KEYS[#KEYS])
  for i = 1, #all - 1, 2 do
    -- Split on every single space, as Rust's `split(' ')` (two spaces make an empty field).
    local t, from, value = {}, 1, all[i + 1]
    while true do
      local c = find(value, ' ', from, true)
      if not c then t[#t + 1] = sub(value, from); break end
      t[#t + 1] = sub(value, from, c - 1)
      from = c + 1
    end
    local pool, taken, owed, at = u64(t[1]), u64(t[2]), u64(t[3]), u64(t[4])
    local ok = pool and taken and owed and at
    -- A fifth field that reads is a rate, and then the sixth must read too; one that does not
    -- (or none: a release before fairness) leaves the report idle.
    local per_ks, short = 0, false
    if ok and u64(t[5]) then
      per_ks = u64(t[5])
      local sh = u64(t[6])
      if sh then short = sh == 1 else ok = false end
    end
    if ok and seen < max_regions then
      seen = seen + 1
      if all[i] ~= rest then
        local g, d = pool + taken, nil
        local lasts = 0
        if per_ks > 0 then lasts = floor(pool * 2000000 / per_ks) end
        local fresh = fresh_ms
        if not short then fresh = max(fresh_ms, lasts) end
        if now_ms - at > fresh then
          d = g
        elseif not (short or (per_ks == 0 and pool > 0)) then
          d = g + floor(per_ks * (max(end_ms - min(at, now_ms), 0) + 2 * ahead_ms) / 1000000)
        end
        granted[#granted + 1], demand[#granted + 1] = g, d
      end
    end
  end
  local function held(level)
    local sum = max(mine, level)
    for j = 1, #granted do
      local wants = level
      if demand[j] then wants = min(demand[j], level) end
      sum = sum + max(granted[j], wants)
    end
    return sum
  end
  local share = 0
  if held(0) <= limit then
    local lo, hi = 0, limit
    while lo < hi do
      local mid = lo + math.ceil((hi - lo) / 2)
      if held(mid) <= limit then lo = mid else hi = mid - 1 end
    end
    share = max(lo - mine, 0)
  end
  fair_hits = min(tonumber(ARGV[7]), share)
  ARGV[7] = fmt('%d', fair_hits)
  ARGV[2] = '0'
end
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

-- The packed layout (ARGV[2] = "p"): plain requests only, every distinct counter once.
--   KEYS      the U distinct counter keys of the call
--   ARGV[3]   U; then per key: limit, period_us
--   then R, the number of requests; then per request 4n + m (m its counting, as for a plain
--             request) followed by n codes, one per limit:
--             hits * 64 + (index of its key in KEYS, from 0); U <= 64, and no request names a
--             key twice
-- Returns {now, then per request, per limit: allowed + 2 * remaining}: the same answers as the
-- general layout, less what follows from them and from `now` alone (a request is admitted when
-- every limit of it is allowed, under either counting; each fixed window's reset is the end of
-- its window, and a denial retries then, or never when the hits exceed the limit). The requests
-- are decided in order, each by the charging rule. Per request the script only adds and
-- compares: a counter shared by every request (a resource limit) is read, keyed and written
-- once per call. (Each reply value and each argument converted costs: the script is measured
-- against 9ee8b71's, docs/performance.md.)
if ARGV[2] == 'p' then
  local fmt, floor, max = string.format, math.floor, math.max
  local U = tonumber(ARGV[3])
  local limit, count, base, wk = {}, {}, {}, {}
  for u = 1, U do
    limit[u] = tonumber(ARGV[2 + 2 * u])
    wk[u] = KEYS[u] .. fmt(':%d', floor(now / tonumber(ARGV[3 + 2 * u])))
  end
  local stored = redis.call('MGET', unpack(wk))
  for u = 1, U do
    local c = tonumber(stored[u] or -1)
    base[u] = c
    if c < 0 then c = 0 end
    count[u] = c
  end
  local out, o = {now}, 1
  local su, sa, sl = {}, {}, {}
  local p = 4 + 2 * U
  for _ = 1, tonumber(ARGV[p]) do
    local hdr = tonumber(ARGV[p + 1])
    local m = hdr % 4
    local n = (hdr - m) / 4
    local rec = m > 0
    -- Each limit by window_charge's rule, written out (no function call per limit: this loop
    -- is the script's per-request work); kept for the charge below, ARGV read once. The
    -- verdict: every limit allowed, under either counting (a recording request, m = 1 or 3
    -- with stop, is denied if a limit is over once charged).
    local ok = true
    for j = 1, n do
      local code = tonumber(ARGV[p + 1 + j])
      local u = code % 64 + 1
      local hits = (code - u + 1) / 64
      local c, lim = count[u], limit[u]
      local after, allowed = min(c + hits, MAXC)
      if hits == 0 and not rec then
        allowed, after = c < lim, c
      else
        allowed = after <= lim
      end
      if not allowed then ok = false end
      su[j], sa[j], sl[j] = u, allowed, after
    end
    -- What is charged: all or nothing (m = 0); every limit (record), or with stop only the
    -- limits that exceed if any does. A limit reports what it leaves if charged, else what its
    -- counter has.
    for j = 1, n do
      local u, allowed = su[j], sa[j]
      local c, lim = count[u], limit[u]
      if ok or (rec and (m < 2 or not allowed)) then
        c = sl[j]
        count[u] = c
      end
      o = o + 1
      if c < lim then c = lim - c else c = 0 end
      if allowed then out[o] = 1 + 2 * c else out[o] = 2 * c end
    end
    p = p + 1 + n
  end
  for u = 1, U do
    local c, was = count[u], base[u]
    if c > was and c > 0 then
      if was < 0 then
        local period = tonumber(ARGV[3 + 2 * u])
        local start = now - now % period
        -- Kept its grace (window.lua) past its end: a leased replica may still name this window.
        redis.call('SET', wk[u], c, 'PX',
          jittered(max(floor((start + period + min(period, 60000000) - now + 999) / 1000), 1)))
      else
        redis.call('INCRBY', wk[u], c - was)
      end
    end
  end
  return out
end

-- fixed_window's rule, the one the general layout uses (the packed one writes it out):
-- whether `hits` on a window holding `count` fit under `limit` (a check, hits 0, asks for room
-- for one more; a recorded charge is taken whatever, and fits while the count after it is not
-- above the limit), and the count after the charge if it is made.
local function window_charge(count, hits, limit, record)
  local after = min(count + hits, MAXC)
  if record then return after <= limit, after end
  if hits == 0 then return count < limit, count end
  return after <= limit, after
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
    local n, k = tonumber(ARGV[p]), K
    if n < 0 then n, k, has.lease = -n, 8, true end
    for i = 1, n do has[tonumber(ARGV[p + 4 + k * (i - 1)]) % 4] = true end
    p = p + 1 + k * n
  end
end

local TRIM = 64
local REFUND_ENTRIES = 64
local UNDO_REWRITE = 256
local GIVE_BACK = 256 -- src/algorithm/mod.rs LOG_GIVE_BACK_ENTRIES
-- A reservation: "<k>,<hits>,<until>,<end>" and, since its sliding_log entry is kept, ",<entry>".
local RES_ENTRY = '^(%d+),(%d+),(%d+),(%d+),?(%d*)$'

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

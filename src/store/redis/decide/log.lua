-- decide.lua, part 3 of 5: sliding_log (see head.lua for KEYS and ARGV).
-------------------------------------------------------------------------------- sliding_log
-- A log view: what is stored (read with O(log n) commands) plus what this call changes at the
-- newest end: stored entries popped or shrunk by refunds, and entries added. Every entry has an
-- id (src/algorithm/log.rs): a new entry's is one past the newest entry's in the view (`now`
-- when none is in the period), a recorded charge that joins the newest entry keeps its id, so
-- both stores give a reservation back on the same entry.

local parse_member, entry, load_log, cached, newest_stored, log_count, log_retry, sliding_log, member, commit_log, undo_log
local next_id, log_give_back
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

  -- The id a new entry of the view gets.
  next_id = function(key, v)
    local na = #v.adds
    if na > 0 then return v.adds[na].id + 1 end
    local r = newest_stored(v)
    if r then return cached(key, v, r).id + 1 end
    return max(now, 1)
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
            v.adds[1] = {t = t, h = h + hits, id = en.id}
            v.addsum = v.addsum + h + hits
          end
        else
          v.adds[na + 1] = {t = t, h = hits, id = next_id(key, v)}
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
        v.adds[na + 1] = {t = t, h = hits, id = next_id(key, v)}
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
    -- C continues from the newest entry left (expired or not), so C rises strictly along the
    -- set and no two members are equal; ids are the view's (see `next_id`) and never change
    -- (C does, when an older entry goes).
    local cprev, newest_t = 0, nil
    local r = v.size - 1 - v.sp
    if r >= 0 then
      local en = cached(key, v, r)
      cprev = en.c
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
        cprev = cprev + a.h
        z[#z + 1] = fmt('%d', a.t)
        z[#z + 1] = member(cprev, a.h, a.id)
        tokens[i] = a.id
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
  -- removes it and lowers C of the entries after it by its hits. (Ids start at the time of
  -- the first entry in a period and rise by one per entry, so an id an entry had is not given
  -- to a later one unless a log takes more than one entry per microsecond, or the clock steps
  -- back.)
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

  -- A reservation's give-back (src/algorithm/log.rs `give_back`): up to `hits` taken off the
  -- entry `id`, searched newest first among the view's newest GIVE_BACK entries (this call's
  -- adds, then stored ones in the period); nothing if it is not there. Stored entries from it
  -- to the newest become this call's adds (popped and added again with their ids), so their C
  -- is rewritten when the view is committed: the view stays the log's exact content.
  log_give_back = function(key, v, id, hits)
    local na = #v.adds
    for j = na, 1, -1 do
      local a = v.adds[j]
      if a.id == id then
        local g = min(hits, a.h)
        a.h, v.addsum, v.dirty = a.h - g, v.addsum - g, true
        if a.h == 0 then table.remove(v.adds, j) end
        return g
      end
    end
    local r = newest_stored(v)
    if not r or na >= GIVE_BACK then return 0 end
    local lo = max(v.e, r - (GIVE_BACK - na) + 1)
    local got = call('ZRANGE', key, lo, r, 'WITHSCORES')
    local at = nil
    for j = #got - 1, 1, -2 do
      local _, _, eid = parse_member(got[j])
      if eid == id then at = j break end
    end
    if not at then return 0 end
    local moved, sum = {}, 0
    for j = at, #got - 1, 2 do
      local _, h, eid = parse_member(got[j])
      moved[#moved + 1] = {t = tonumber(got[j + 1]), h = h, id = eid}
      sum = sum + h
    end
    -- The newest stored entry may already be shrunk by this call (sr).
    moved[#moved].h = moved[#moved].h - v.sr
    local added = sum - v.sr
    v.sp, v.spsum, v.sr = v.sp + #moved, v.spsum + sum, 0
    local g = min(hits, moved[1].h)
    moved[1].h = moved[1].h - g
    if moved[1].h == 0 then table.remove(moved, 1) end
    for _, a in ipairs(v.adds) do moved[#moved + 1] = a end
    v.adds, v.addsum, v.dirty = moved, v.addsum + added - g, true
    return g
  end
end

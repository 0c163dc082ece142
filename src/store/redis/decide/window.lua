-- decide.lua, part 2 of 5: fixed_window and sliding_window (see head.lua for KEYS and ARGV).
---------------------------------------------------------------------------- fixed / sliding window

local window_key, load_counter, fixed, estimate, sliding
-- Pinned fixed windows (a calendar's, a leased limit's): key -> the window's start (us), set
-- from `meta` before the key is loaded (`pinned_of`). Such a window is `[start, start +
-- period)`: the caller's (its replica's clock chose it), not `now`'s multiple of the period.
-- A calendar window is keyed by its start (CAL); a leased epoch-aligned one by its index, the
-- key a plain fixed window of the limit uses (PIN), so turning `leased:` on or off keeps the
-- counter. Its key lives GRACE past the window's end (the store's clock): a replica whose
-- clock lags the store by less still finds the window's whole count; a window that ended
-- longer ago is never charged again (never a grant on a key that expired: see `fixed`).
local CAL, PIN = {}, {}
local function pinned_of(key, meta)
  local h = floor(meta / 256)
  if meta % 4 == 0 and h > 0 then
    local start = floor(h / 2) * 1000
    if h % 2 == 1 then CAL[key] = start else PIN[key] = start end
  end
end
-- How long (us) past its end a pinned window's key is kept, and still charged: its period, at
-- most a minute (docs/semantics.md, "Clocks").
local function grace(period) return min(period, 60000000) end
if has[0] or has[1] then
  -- fixed_window keeps one key per window, `<key>:<window index>` (a calendar window:
  -- `<key>:c<start in seconds>`, calendar boundaries being whole seconds), holding the count.
  window_key = function(key, start, period)
    if CAL[key] then return key .. fmt(':c%d', start / 1000000) end
    return key .. fmt(':%d', start / period)
  end

  load_counter = function(key, alg, period)
    if alg == 0 then
      local pin = CAL[key] or PIN[key]
      local start = pin or (now - now % period)
      return {ws = start, a = tonumber(call('GET', window_key(key, start, period)) or 0), b = 0,
        pin = pin, cal = CAL[key] ~= nil, key = key}
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
    local start = s.pin or (now - (now % period))
    if s.pin and now >= start + period + grace(period) then
      -- A pinned window that ended on the store's clock longer than GRACE ago (its caller's
      -- clock lags the store's, or the caller waited): its key may be gone, so it is never
      -- charged or written again. A give-back has nothing left to return to; a charge on a
      -- leased epoch-aligned window is decided in the store's current window instead (the
      -- caller's slice spends it: never over either window); a calendar window's next one is
      -- the caller's to name, so the charge is denied (retry at once, in the caller's next).
      if refund then return true, 0, 0, 0, start end
      if s.cal then return false, 0, 0, 0, start end
      start = now - now % period
      s.pin, s.ws, s.a = start, start, tonumber(call('GET', window_key(s.key, start, period)) or 0)
    end
    local current = 0
    if s.ws == start then current = s.a end
    local reset = max(start + period - now, 0)
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

-- decide.lua, part 2 of 5: fixed_window and sliding_window (see head.lua for KEYS and ARGV).
---------------------------------------------------------------------------- fixed / sliding window

local window_key, load_counter, fixed, estimate, sliding
-- Calendar fixed windows: key -> the window's start (us), set from `meta` before the key is
-- loaded (`calendar_of`). Such a window is `[start, start + period)`, keyed by its start.
local CAL = {}
local function calendar_of(key, meta)
  local start = floor(meta / 256)
  if meta % 4 == 0 and start > 0 then CAL[key] = start * 1000000 end
end
if has[0] or has[1] then
  -- fixed_window keeps one key per window, `<key>:<window index>` (a calendar window:
  -- `<key>:c<start in seconds>`), holding the count.
  window_key = function(key, start, period)
    if CAL[key] then return key .. fmt(':c%d', start / 1000000) end
    return key .. fmt(':%d', start / period)
  end

  load_counter = function(key, alg, period)
    if alg == 0 then
      local start = CAL[key] or (now - now % period)
      return {ws = start, a = tonumber(call('GET', window_key(key, start, period)) or 0), b = 0,
        cal = CAL[key]}
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
    local start = s.cal or (now - (now % period))
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

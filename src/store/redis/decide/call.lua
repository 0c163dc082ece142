-- decide.lua, part 6 of 6: an undo call, and one request decided by the charging rule, for
-- every request of the call (see head.lua for KEYS and ARGV).
------------------------------------------------------------------------------------- the call

if undo then
  local out, n = {1}, tonumber(ARGV[4])
  for i = 1, n do
    local key, b = KEYS[i], 5 + K * (i - 1)
    local limit, period, hits = tonumber(ARGV[b]), tonumber(ARGV[b + 1]), tonumber(ARGV[b + 2])
    local meta, token = tonumber(ARGV[b + 3]), tonumber(ARGV[b + 4])
    local alg, burst = meta % 4, floor(meta / 256)
    pinned_of(key, meta)
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

-- The reset fence of the one limit a home store's refund or fair grant charges: beside the
-- charged window's key (a token bucket's own key), where a reset left it (store/redis/admin.rs;
-- 0: none).
local function charged_fence()
  local key, period, meta = KEYS[1], tonumber(ARGV[6]), tonumber(ARGV[8])
  local at = key
  if meta % 4 == 0 then
    pinned_of(key, meta)
    at = window_key(key, CAL[key] or PIN[key] or (now - now % period), period)
  end
  return tonumber(call('GET', at .. '#reset')) or 0
end

if fence then
  -- A home store's refund (head.lua): refused past the fence.
  if charged_fence() > fence then
    return {-1}
  end
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
        -- Every window's key lives its grace past its end (pinned or not: a plain charge on a
        -- leased window's key, a write-back or a replica mid-reload, never cuts it short).
        call('SET', window_key(key, v.ws, period), v.a, 'PX', ttl_ms(v.ws + period + grace(period) - now))
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
  -- A lease request's limits return two more values each: the lease effect (head.lua).
  local w = W
  if K == 8 then w = W + 2 end
  local views = {}
  local recs, oks, refs, touched, stop, over = {}, {}, {}, {}, false, false
  local admitted = 1
  local quotas, quotas_allowed = 0, 0
  local logslot = {} -- check index -> position of its entry among its key's adds
  local before = {} -- key -> what it had left before this request (tokens_wanted)
  local tokens = {} -- check index -> its undo token, if its charge is written
  local ops, free = {}, {} -- in_flight: check index -> op (0: not in_flight), slots free
  local slots = {} -- in_flight: key -> its view for this request
  local changes = {} -- in_flight: check index -> whether it changes the slots
  local resv = {} -- reservations: key -> its view for this request
  local held = {} -- reservations: check index -> the change to write if charged

  for i = 1, n do
    local key, b = KEYS[KB + i], AB + 1 + K * (i - 1)
    local limit, period, hits = tonumber(ARGV[b]), tonumber(ARGV[b + 1]), tonumber(ARGV[b + 2])
    local meta = tonumber(ARGV[b + 3])
    local alg, flags = meta % 4, floor(meta / 4) % 64
    pinned_of(key, meta)
    local refund = floor(flags / 2) % 2 == 1
    -- As the Rust `Admission`: a shadow limit or a refund never takes part in the quota rule.
    local quota = floor(flags / 8) % 2 == 1 and flags % 2 == 0 and not refund
    local record = floor(flags / 16) % 2 == 1
    if flags >= 32 then stop = true end
    local op, touched_slot = 0, false
    if K == 8 then op = tonumber(ARGV[b + 4]) end
    ops[i] = op
    local v = views[key]
    if not v and (op == 0 or op >= 4) then
      v = load_view(key, alg, period)
      views[key] = v
      if tokens_wanted then before[key] = left_on(key, v, alg, limit, period, meta) end
    end
    local allowed, remaining, reset, retry, token
    local gone, left = 0, 0 -- the lease effect's: ended entries dropped, the lease left
    if op >= 4 then
      local rv = resv[key]
      if not rv then
        rv = res_view(key)
        resv[key], gone = rv, rv.gone
      end
      local changed
      allowed, remaining, reset, retry, changed, held[i] = reserve(key, v, rv, alg, limit, period,
        meta, hits, op, ARGV[b + 5], tonumber(ARGV[b + 6]), tonumber(ARGV[b + 7]))
      token, touched_slot = 0, changed
    elseif op > 0 then
      local sv = slots[key]
      if not sv then
        sv = slot_view(key, limit)
        slots[key], gone = sv, sv.gone
      end
      free[i] = sv.free
      allowed, remaining, retry, touched_slot, left =
        in_flight(key, sv, limit, period, op, ARGV[b + 5])
      reset, token = period, 0
      before[key] = sv.free
    elseif alg == 0 then
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
    -- (An in_flight take or free counts as a change here whether or not it changes the slots,
    -- as for the memory store; what it writes is `changes`.)
    touched[i] = (hits > 0) and (allowed or record)
    if op >= 4 then
      -- A reservation or its settle changes what is held even at 0 hits (the memory store's
      -- rule); `touched_slot` is whether it changed the counter.
      touched[i] = allowed or record
    end
    changes[i] = touched_slot
    if record and not allowed then over = true end
    if quota then quotas = quotas + 1 end
    local o = 2 + w * (i - 1)
    if allowed then
      out[o] = 1 + 2 * remaining
      if quota then quotas_allowed = quotas_allowed + 1 end
    else
      out[o] = 2 * remaining
      if flags % 2 == 0 and not quota then admitted = 0 end
    end
    out[o + 1] = reset
    out[o + 2] = retry
    if K == 8 then
      out[o + W], out[o + W + 1] = 4 * gone, left
    end
    if tokens_wanted then
      -- Only a written charge has something to undo (set below, once it is written).
      out[o + 3] = 0
      out[o + 4] = before[key]
      if op > 0 or not (allowed and hits > 0 and not refund) then
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
      charged[i] = (recs[i] and (refs[i] or not oks[i])) or ops[i] == 2 or ops[i] == 5
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
      if not charged[i] and ops[i] > 0 and ops[i] < 4 then
        local o = 2 + w * (i - 1)
        out[o] = out[o] % 2 + 2 * free[i]
      elseif not charged[i] then
        local key, b = KEYS[KB + i], AB + 1 + K * (i - 1)
        local limit, period = tonumber(ARGV[b]), tonumber(ARGV[b + 1])
        local meta = tonumber(ARGV[b + 3])
        local v = views[key]
        if v.dirty then v = load_view(key, meta % 4, period) end
        local o = 2 + w * (i - 1)
        out[o] = out[o] % 2 + 2 * left_on(key, v, meta % 4, limit, period, meta)
      end
    end
    views_written, slots = {}, {}
    local resv2, slots2 = {}, {}
    for i = 1, n do
      if charged[i] and ops[i] >= 4 then
        -- A reservation or settle charged: decided again on fresh views (of the counter and of
        -- the reservations), as the memory store replays it on fresh copies.
        local key, b = KEYS[KB + i], AB + 1 + K * (i - 1)
        local limit, period = tonumber(ARGV[b]), tonumber(ARGV[b + 1])
        local meta = tonumber(ARGV[b + 3])
        local v = views_written[key]
        if not v then
          v = load_view(key, meta % 4, period)
          views_written[key] = v
        end
        local rv = resv2[key]
        if not rv then
          rv = res_view(key)
          resv2[key] = rv
          local o = 2 + w * (i - 1) + W
          out[o] = out[o] + 4 * rv.gone
        end
        local _
        _, _, _, _, _, held[i] = reserve(key, v, rv, meta % 4, limit, period, meta,
          tonumber(ARGV[b + 2]), ops[i], ARGV[b + 5], tonumber(ARGV[b + 6]),
          tonumber(ARGV[b + 7]))
      elseif charged[i] and ops[i] > 0 then
        -- An in_flight take or free charged: decided again on a fresh view of the slots (a
        -- free of a slot only an uncharged take of this request held frees nothing).
        local key, b = KEYS[KB + i], AB + 1 + K * (i - 1)
        local limit, period, id = tonumber(ARGV[b]), tonumber(ARGV[b + 1]), ARGV[b + 5]
        local sv = slots2[key]
        if not sv then
          sv = slot_view(key, limit)
          slots2[key] = sv
        end
        local _
        _, _, _, changes[i], out[2 + w * (i - 1) + W + 1] =
          in_flight(key, sv, limit, period, ops[i], id)
      elseif charged[i] and touched[i] and ops[i] == 0 then
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
  for i = 1, n do
    local b = AB + 1 + K * (i - 1)
    -- What is written, as a lease effect: 1 an entry added, 2 one released (with the lease
    -- it had left, set by the first pass for a slot), 3 a release that found none.
    local code, left = 0, nil
    if charged[i] and ops[i] >= 4 then
      local c = held[i]
      if c ~= nil then
        res_write(KEYS[KB + i], ARGV[b + 5], c, tonumber(ARGV[b + 6]))
        if c.released then
          code, left = 2, c.released - now
        else
          code, left = 1, tonumber(ARGV[b + 6])
        end
      elseif ops[i] == 5 then
        code = 3
      end
    elseif charged[i] and changes[i] and ops[i] > 0 then
      local what = changes[i]
      slot_write(KEYS[KB + i], tonumber(ARGV[b + 1]), what, ARGV[b + 5], tonumber(ARGV[b]))
      if what == 'take' then code = 1 elseif what == 'free' then code = 2 end
    elseif charged[i] and ops[i] == 2 then
      code = 3
    end
    if code > 0 then
      local o = 2 + w * (i - 1) + W
      out[o] = out[o] + code
      if left then out[o + 1] = left end
    end
  end
  -- A take not charged is remembered as a denial of its id (src/algorithm/in_flight.rs), on
  -- what the request left written.
  for i = 1, n do
    if not charged[i] and ops[i] == 1 then
      local b = AB + 1 + K * (i - 1)
      slot_write(KEYS[KB + i], tonumber(ARGV[b + 1]), 'deny', ARGV[b + 5], tonumber(ARGV[b]))
    end
  end
  if tokens_wanted then
    -- The undo token of each charge written: its window (fixed, sliding), its entry's id
    -- (sliding_log), 1 for a token bucket (whose undo is arithmetic); 0 for nothing to undo.
    for i = 1, n do
      if charged[i] and touched[i] and tokens[i] ~= 0 then
        local o = 5 + w * (i - 1)
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

-- ARGV[2] 'u': takes back the lease changes a Cluster slot committed for a request that a later
-- slot then denied (one request in the lease layout; each limit's op says what its commit did:
-- 1 took a slot, 4 made a reservation of `hits`). A slot taken becomes a remembered denial of
-- its id, as if the take had been denied; the id's newest reservation of `hits` goes, its hits
-- given back while the window that took them lasts (as its settle at 0 would).
if mode == 'u' then
  K = 8
  local out, n, views = {1}, -tonumber(ARGV[4]), {}
  for i = 1, n do
    local key, b = KEYS[i], 5 + 8 * (i - 1)
    local limit, period, hits = tonumber(ARGV[b]), tonumber(ARGV[b + 1]), tonumber(ARGV[b + 2])
    local meta, op, id = tonumber(ARGV[b + 3]), tonumber(ARGV[b + 4]), ARGV[b + 5]
    local done = 0
    if op == 1 and holds(key, slot_view(key, limit), id) > 0 then
      slot_write(key, period, 'free', id, limit)
      slot_write(key, period, 'deny', id, limit)
      done = 1
    elseif op == 4 then
      local rk, kept, at = key .. ':r', {}, nil
      for e in string.gmatch(call('HGET', rk, id) or '', '[^;]+') do
        local k, h, u, ends, lid = string.match(e, RES_ENTRY)
        if ends and tonumber(ends) > now then
          kept[#kept + 1] = e
          if tonumber(h) == hits then at = {#kept, k, tonumber(u), tonumber(lid) or 0} end
        end
      end
      if at then
        table.remove(kept, at[1])
        call('ZREM', key .. ':e', id .. ':' .. at[2])
        if #kept > 0 then call('HSET', rk, id, table.concat(kept, ';')) else call('HDEL', rk, id) end
        if hits > 0 and now < at[3] then
          local v = views[key] or load_view(key, meta % 4, period)
          views[key] = v
          if meta % 4 == 2 and at[4] > 0 then
            log_give_back(key, v, at[4], hits)
          else
            run_alg(key, v, meta % 4, limit, period, meta, hits, true, false)
          end
        end
        done = 1
      end
    end
    out[i + 1] = done
  end
  write_views(0, 4, n, views)
  return out
end

-- Decides every request of the call in turn (each by the charging rule, each seeing the
-- writes of the ones before it) and returns their answers one after the other.
local result, p, kb = {}, 4, 0
for _ = 1, R do
  local n = tonumber(ARGV[p])
  K = 4
  if n < 0 then n, K = -n, 8 end
  local o = general(kb, p, n)
  for j = 1, #o do result[#result + 1] = o[j] end
  p, kb = p + 1 + K * n, kb + n
end
if fair_hits then
  -- A home store's fair grant (head.lua): the hits, then the charged window's reset fence
  -- (where a reset left it, store/redis/admin.rs; 0: none), which the region's pool the units
  -- land in is cleared for first (store/global/mod.rs, `land`).
  result[#result + 1] = fair_hits
  result[#result + 1] = charged_fence()
end
return result

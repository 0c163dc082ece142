-- decide.lua, part 5 of 6: the lease limits, `in_flight` slots and reservations on a rate
-- limit (see head.lua for KEYS, ARGV and where they are stored).
------------------------------------------------------------------------------------ the leases

local slot_view, holds, first_end, in_flight, slot_write
local res_view, res_get, run_alg, reserve, res_write
-- Built only for a call that has a lease limit (see `has` in head.lua).
if has.lease then
  -- in_flight on the slots at `key` (see head.lua), as this request's earlier checks left them
  -- (`sv`, the key's view for this request: a take or free is seen by the checks after it, as the
  -- memory store decides on copies). src/algorithm/in_flight.rs has the rules: an id may hold
  -- several slots (`key`'s member is the id, scored by when its slots end; `<key>:c` field
  -- "s<id>" its slots past the first, "n" their total), and a take not charged is remembered as
  -- a denial (`<key>:d` member ".<id>" scored by its end, `<key>:c` field "d<id>" how many; past
  -- the cap, member "!" and field "o"), which the id's stream-done call consumes before it frees
  -- a slot. Drops the slots whose lease ended; `gone`: how many.
  slot_view = function(key, limit)
    local ck = key .. ':c'
    local x = tonumber(call('HGET', ck, 'n') or 0)
    local ended = call('ZRANGEBYSCORE', key, '-inf', now)
    local gone = #ended
    if gone > 0 then
      if x > 0 then
        for j = 1, #ended do
          local e = call('HGET', ck, 's' .. ended[j])
          if e then
            gone, x = gone + tonumber(e), x - tonumber(e)
            call('HDEL', ck, 's' .. ended[j])
          end
        end
        call('HSET', ck, 'n', x)
      end
      call('ZREMRANGEBYSCORE', key, '-inf', now)
    end
    local n = call('ZCARD', key) + x
    local free = 0
    if n < limit then free = limit - n end
    return {n = n, free = free, x = x, held = {}, ends = {}, den = {}, frees = 0, gone = gone}
  end

  -- How many slots `id` holds on the view, and when its stored ones end.
  holds = function(key, sv, id)
    local h = sv.held[id]
    if h ~= nil then return h, sv.ends[id] end
    local e = call('ZSCORE', key, id)
    h = 0
    if e then
      h = 1
      if sv.x > 0 then h = 1 + tonumber(call('HGET', key .. ':c', 's' .. id) or 0) end
      e = tonumber(e)
    end
    sv.held[id], sv.ends[id] = h, e
    return h, e
  end

  -- A live remembered count: field `f` of `<key>:c`, if member `m` of `<key>:d` has not ended.
  local function remembered(key, m, f)
    local e = call('ZSCORE', key .. ':d', m)
    if e and tonumber(e) > now then return tonumber(call('HGET', key .. ':c', f) or 0) end
    return 0
  end

  -- When the first slot of the view ends: the earliest stored one this request has not freed,
  -- or a slot it took (a lease from now).
  first_end = function(key, sv, period)
    local got = call('ZRANGE', key, 0, sv.frees, 'WITHSCORES')
    for j = 1, #got, 2 do
      if sv.held[got[j]] ~= 0 then return tonumber(got[j + 1]) end
    end
    return now + period
  end

  -- Returns allowed, remaining, retry_us, what it changes if charged ('take', 'free', 'deny':
  -- a denial remembered, 'undeny' / 'unovf': a remembered denial consumed, or nil) and, for a
  -- take or a free, the lease left of the slot (a take's: a whole lease).
  in_flight = function(key, sv, limit, period, op, id)
    local n = sv.n
    local function left(m) if m < limit then return limit - m end return 0 end
    if op == 2 then
      local d = sv.den[id]
      if d == nil then d = remembered(key, '.' .. id, 'd' .. id) end
      if d > 0 then
        sv.den[id] = d - 1
        return true, left(n), 0, 'undeny', 0
      end
      sv.den[id] = 0
      if sv.ovf == nil then sv.ovf = remembered(key, '!', 'o') end
      if sv.ovf > 0 then
        sv.ovf = sv.ovf - 1
        return true, left(n), 0, 'unovf', 0
      end
      local h, ends = holds(key, sv, id)
      if h > 0 then
        sv.held[id], sv.n, sv.frees = h - 1, n - 1, sv.frees + 1
        return true, left(n - 1), 0, 'free', (ends or now + period) - now
      end
      return true, left(n), 0, nil, 0
    end
    if n < limit then
      if op == 3 then return true, left(n), 0, nil, 0 end
      local h = holds(key, sv, id)
      sv.held[id], sv.ends[id], sv.n = h + 1, now + period, n + 1
      return true, left(n + 1), 0, 'take', period
    end
    local what = nil
    if op == 1 then what = 'deny' end
    return false, 0, first_end(key, sv, period) - now, what, 0
  end

  -- Writes a charged in_flight change (see `in_flight`).
  slot_write = function(key, period, what, id, limit)
    local ck, dk = key .. ':c', key .. ':d'
    if what == 'take' then
      local had = call('ZSCORE', key, id)
      call('ZADD', key, now + period, id)
      call('PEXPIRE', key, ttl_ms(period))
      if had then
        call('HINCRBY', ck, 's' .. id, 1)
        call('HINCRBY', ck, 'n', 1)
        call('PEXPIRE', ck, ttl_ms(period))
      end
    elseif what == 'free' then
      local e = tonumber(call('HGET', ck, 's' .. id) or 0)
      if e > 0 then
        if e == 1 then call('HDEL', ck, 's' .. id) else call('HINCRBY', ck, 's' .. id, -1) end
        call('HINCRBY', ck, 'n', -1)
      else
        call('ZREM', key, id)
      end
    elseif what == 'undeny' or what == 'unovf' then
      local m, f = '.' .. id, 'd' .. id
      if what == 'unovf' then m, f = '!', 'o' end
      if call('HINCRBY', ck, f, -1) <= 0 then
        call('HDEL', ck, f)
        call('ZREM', dk, m)
      end
    elseif what == 'deny' then
      local m, f = '.' .. id, 'd' .. id
      local e = call('ZSCORE', dk, m)
      if not (e and tonumber(e) > now) then
        local c = call('ZCARD', dk)
        local cap = max(limit, 64)
        if c >= cap then
          -- Only records still live count against the cap (the memory store keeps no others).
          local ended = call('ZRANGEBYSCORE', dk, '-inf', now)
          for j = 1, #ended do
            local em = ended[j]
            if em == '!' then call('HDEL', ck, 'o') else call('HDEL', ck, 'd' .. sub(em, 2)) end
          end
          call('ZREMRANGEBYSCORE', dk, '-inf', now)
          c = call('ZCARD', dk)
        end
        if c >= cap then
          m, f = '!', 'o'
          local oe = call('ZSCORE', dk, m)
          if not (oe and tonumber(oe) > now) then call('HDEL', ck, f) end
        else
          call('HDEL', ck, f)
        end
      end
      call('HINCRBY', ck, f, 1)
      call('ZADD', dk, now + period, m)
      call('PEXPIRE', dk, ttl_ms(period))
      call('PEXPIRE', ck, ttl_ms(period))
    end
  end

  -- Reservations on the counter at `key` as this request's earlier checks left them (`rv`, the
  -- key's view for this request, as for slots). An id may hold several (the id grants nothing:
  -- each reserve is its own): "<key>:e" has one member per reservation, "<id>:<k>", scored by
  -- its lease end; "<key>:r" field <id> lists the id's reservations oldest first,
  -- "<k>,<hits>,<until>,<end>,<entry>;..." (entry: on a sliding_log, the id of the log entry
  -- the estimate made, which its settle gives back on; 0 or absent: none). Drops at most TRIM entries whose lease ended; `dn` is what
  -- this request's checks changed the live count by (the count itself is read only when a
  -- reservation needs it for the cap: a settle never does).
  res_view = function(key)
    local ek, rk = key .. ':e', key .. ':r'
    local old = call('ZRANGEBYSCORE', ek, '-inf', now, 'LIMIT', 0, TRIM)
    if #old > 0 then
      call('ZREM', ek, unpack(old))
      local ids = {}
      for j = 1, #old do
        local m = old[j]
        local at = #m
        while at > 0 and sub(m, at, at) ~= ':' do at = at - 1 end
        ids[sub(m, 1, at - 1)] = true
      end
      -- Each touched id keeps only its live reservations.
      for id in pairs(ids) do
        local kept = {}
        for e in string.gmatch(call('HGET', rk, id) or '', '[^;]+') do
          local _, _, _, ends = string.match(e, RES_ENTRY)
          if ends and tonumber(ends) > now then kept[#kept + 1] = e end
        end
        if #kept > 0 then call('HSET', rk, id, table.concat(kept, ';')) else call('HDEL', rk, id) end
      end
    end
    return {dn = 0, ids = {}, gone = #old}
  end

  -- The live reservations on the view.
  local function res_count(key, rv)
    if not rv.stored then rv.stored = call('ZCOUNT', key .. ':e', fmt('(%d', now), '+inf') end
    return rv.stored + rv.dn
  end

  -- The id's live reservations on the view, oldest first: a list of {hits, until, lease end, k,
  -- log entry}.
  local function res_list(key, rv, id)
    local t = rv.ids[id]
    if t ~= nil then return t end
    t = {}
    for e in string.gmatch(call('HGET', key .. ':r', id) or '', '[^;]+') do
      local k, h, u, ends, lid = string.match(e, RES_ENTRY)
      if ends and tonumber(ends) > now then
        t[#t + 1] = {tonumber(h), tonumber(u), tonumber(ends), tonumber(k), tonumber(lid) or 0}
      end
    end
    rv.ids[id] = t
    return t
  end

  -- The reservation a settle of `id` releases on the view (src/algorithm/reserve.rs): the id's
  -- smallest live one, the oldest of equals. Returns it ({hits, until, lease end, k}) and its
  -- place in the id's list, or false.
  local function res_pick(list)
    local at = nil
    for j = 1, #list do
      if not at or list[j][1] < list[at][1] then at = j end
    end
    return at
  end

  res_get = function(key, rv, id)
    local list = res_list(key, rv, id)
    local at = res_pick(list)
    if at then return list[at], at end
    return false
  end

  -- Runs the limit's algorithm on view v: `hits` charged (or given back, or recorded).
  run_alg = function(key, v, alg, limit, period, meta, hits, refund, record)
    if alg == 0 then return fixed(v, limit, period, hits, refund, record) end
    if alg == 1 then return sliding(v, limit, period, hits, refund, record) end
    if alg == 2 then return sliding_log(key, v, limit, period, hits, refund, false, record) end
    return token_bucket(v, limit, period, hits, refund, floor(meta / 256), record)
  end

  -- A reservation (op 4) or its settle (op 5) of `hits` for `id` on the counter at `key`
  -- (src/algorithm/reserve.rs, operation for operation). Returns allowed, remaining, reset_us,
  -- retry_us, whether the counter's view changed, and the change to the reservations if the
  -- request is charged: {hits, until, lease end} a reservation made, {released = its lease
  -- end} one settled, nil none.
  reserve = function(key, v, rv, alg, limit, period, meta, hits, op, id, lease, cap)
    local function as_is()
      local _, remaining, reset = run_alg(key, v, alg, limit, period, meta, 0, false, false)
      return remaining, reset
    end
    if op == 4 then
      if res_count(key, rv) >= cap then
        local remaining, reset = as_is()
        return false, remaining, reset, lease, false, nil
      end
      local ok, remaining, reset, retry, token =
        run_alg(key, v, alg, limit, period, meta, hits, false, false)
      if not ok then return false, remaining, reset, retry, false, nil end
      -- Until when a settle may give hits back: the end of the window that took them.
      local ends = now + lease
      local until_ = ends
      if alg <= 1 then until_ = token + period elseif alg == 2 then until_ = now + period end
      local lid = 0
      if alg == 2 and hits > 0 then lid = v.adds[#v.adds].id end
      local entry = {hits, until_, ends, lid = lid}
      local list = res_list(key, rv, id)
      list[#list + 1] = entry
      rv.dn = rv.dn + 1
      return true, remaining, reset, 0, hits > 0, entry
    end
    local held, at = res_get(key, rv, id)
    local reserved, until_, lid = 0, 0, 0
    if held then
      reserved, until_, lid = held[1], held[2], held[5] or held.lid or 0
      table.remove(res_list(key, rv, id), at)
      rv.dn = rv.dn - 1
    end
    local _, remaining, reset, changed
    if hits > reserved then
      _, remaining, reset = run_alg(key, v, alg, limit, period, meta, hits - reserved, false, true)
      changed = true
    elseif hits < reserved and now < until_ and alg == 2 and lid > 0 then
      -- A sliding_log gives back on the reservation's own entry.
      log_give_back(key, v, lid, reserved - hits)
      remaining, reset = as_is()
      changed = true
    elseif hits < reserved and now < until_ then
      _, remaining, reset = run_alg(key, v, alg, limit, period, meta, reserved - hits, true, false)
      changed = true
    else
      remaining, reset = as_is()
      changed = false
    end
    local settled = nil
    if held then settled = {released = held[3]} end
    return true, remaining, reset, 0, changed, settled
  end

  -- Writes a charged reservation change: made (kept until its lease ends, as the id's newest)
  -- or settled (the id's smallest live one goes, the oldest of equals, as `res_get` chose). The
  -- id's list keeps only live entries.
  res_write = function(key, id, change, lease)
    local ek, rk = key .. ':e', key .. ':r'
    local kept, hits, top = {}, {}, 0
    for e in string.gmatch(call('HGET', rk, id) or '', '[^;]+') do
      local k, h, _, ends = string.match(e, RES_ENTRY)
      if ends then
        k = tonumber(k)
        if k > top then top = k end
        if tonumber(ends) > now then
          hits[#kept + 1] = {tonumber(h)}
          kept[#kept + 1] = e
        else
          call('ZREM', ek, id .. ':' .. k)
        end
      end
    end
    if change.released then
      local at = res_pick(hits)
      if at then
        local gone = table.remove(kept, at)
        call('ZREM', ek, id .. ':' .. string.match(gone, '^(%d+),'))
      end
    else
      local k = top + 1
      kept[#kept + 1] = fmt('%d,%d,%d,%d,%d', k, change[1], change[2], now + lease, change.lid)
      call('ZADD', ek, now + lease, id .. ':' .. k)
      call('PEXPIRE', ek, ttl_ms(lease))
      call('PEXPIRE', rk, ttl_ms(lease))
    end
    if #kept > 0 then call('HSET', rk, id, table.concat(kept, ';')) else call('HDEL', rk, id) end
  end
end

-- decide.lua, part 5 of 6: the lease limits, `in_flight` slots and reservations on a rate
-- limit (see head.lua for KEYS, ARGV and where they are stored).
------------------------------------------------------------------------------------ the leases

local slot_view, holds, first_end, in_flight, slot_write
local res_view, res_get, run_alg, reserve, res_write
-- Built only for a call that has a lease limit (see `has` in head.lua).
if has.lease then
  -- in_flight on the slots at `key` (see head.lua), as this request's earlier checks left them
  -- (`sv`, the key's view for this request: a take or free is seen by the checks after it, as the
  -- memory store decides on copies). Returns allowed, remaining, retry_us, whether the request
  -- changes the slots if charged, and the slots free as stored. `gone`: the ended slots it
  -- dropped.
  slot_view = function(key, limit)
    local gone = call('ZREMRANGEBYSCORE', key, '-inf', now)
    local n = call('ZCARD', key)
    local free = 0
    if n < limit then free = limit - n end
    return {n = n, free = free, ids = {}, frees = 0, gone = gone}
  end

  -- Whether `id` holds a slot on the view, and when a stored one ends.
  holds = function(key, sv, id)
    local t = sv.ids[id]
    if t ~= nil then return t end
    local e = call('ZSCORE', key, id)
    return e ~= false, e and tonumber(e)
  end

  -- When the first slot of the view ends: the earliest stored one this request has not freed,
  -- or a slot it took (a lease from now).
  first_end = function(key, sv, period)
    local got = call('ZRANGE', key, 0, sv.frees, 'WITHSCORES')
    for j = 1, #got, 2 do
      if sv.ids[got[j]] ~= false then return tonumber(got[j + 1]) end
    end
    return now + period
  end

  -- Returns allowed, remaining, retry_us, whether it changes the slots and, if it does, the
  -- lease left of the slot it takes or frees (one this request took itself: a whole lease).
  in_flight = function(key, sv, limit, period, op, id)
    local n = sv.n
    local function left(m) if m < limit then return limit - m end return 0 end
    if op == 2 then
      local held, ends = holds(key, sv, id)
      if held then
        sv.ids[id], sv.n, sv.frees = false, n - 1, sv.frees + 1
        return true, left(n - 1), 0, true, (ends or now + period) - now
      end
      return true, left(n), 0, false, 0
    end
    if op == 1 and holds(key, sv, id) then return true, left(n), 0, false, 0 end
    if n < limit then
      if op == 3 then return true, left(n), 0, false, 0 end
      sv.ids[id], sv.n = true, n + 1
      return true, left(n + 1), 0, true, period
    end
    return false, 0, first_end(key, sv, period) - now, false, 0
  end

  -- Writes a charged in_flight change: the slot taken (until its lease ends) or freed.
  slot_write = function(key, period, op, id)
    if op == 1 then
      call('ZADD', key, now + period, id)
      call('PEXPIRE', key, ttl_ms(period))
    else
      call('ZREM', key, id)
    end
  end

  -- Reservations on the counter at `key` as this request's earlier checks left them (`rv`, the
  -- key's view for this request, as for slots). Drops at most TRIM entries whose lease ended;
  -- `dn` is what this request's checks changed the live count by (the count itself is read
  -- only when a reservation needs it for the cap: a settle never does).
  res_view = function(key)
    local ek = key .. ':e'
    local old = call('ZRANGEBYSCORE', ek, '-inf', now, 'LIMIT', 0, TRIM)
    if #old > 0 then
      call('ZREM', ek, unpack(old))
      call('HDEL', key .. ':r', unpack(old))
    end
    return {dn = 0, ids = {}, gone = #old}
  end

  -- The live reservations on the view.
  local function res_count(key, rv)
    if not rv.stored then rv.stored = call('ZCOUNT', key .. ':e', fmt('(%d', now), '+inf') end
    return rv.stored + rv.dn
  end

  -- The id's live reservation on the view: {hits, until, lease end} or false.
  res_get = function(key, rv, id)
    local t = rv.ids[id]
    if t ~= nil then return t end
    local e = call('ZSCORE', key .. ':e', id)
    local h = e and tonumber(e) > now and call('HGET', key .. ':r', id)
    if h then
      local a, b = pair(h)
      t = {a, b, tonumber(e)}
    else
      t = false
    end
    rv.ids[id] = t
    return t
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
    local held = res_get(key, rv, id)
    local function as_is()
      local _, remaining, reset = run_alg(key, v, alg, limit, period, meta, 0, false, false)
      return remaining, reset
    end
    if op == 4 then
      if held then
        local remaining, reset = as_is()
        return true, remaining, reset, 0, false, nil
      end
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
      local entry = {hits, until_, ends}
      rv.ids[id], rv.dn = entry, rv.dn + 1
      return true, remaining, reset, 0, hits > 0, entry
    end
    local reserved, until_ = 0, 0
    if held then
      reserved, until_ = held[1], held[2]
      rv.ids[id], rv.dn = false, rv.dn - 1
    end
    local _, remaining, reset, changed
    if hits > reserved then
      _, remaining, reset = run_alg(key, v, alg, limit, period, meta, hits - reserved, false, true)
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

  -- Writes a charged reservation change: made (kept until its lease ends) or settled.
  res_write = function(key, id, change, lease)
    local ek, rk = key .. ':e', key .. ':r'
    if change.released then
      call('ZREM', ek, id)
      call('HDEL', rk, id)
    else
      call('ZADD', ek, now + lease, id)
      call('HSET', rk, id, fmt('%d:%d', change[1], change[2]))
      call('PEXPIRE', ek, ttl_ms(lease))
      call('PEXPIRE', rk, ttl_ms(lease))
    end
  end
end


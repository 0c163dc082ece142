-- decide.lua, part 4 of 5: token_bucket (see head.lua for KEYS and ARGV).
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

-- A home store's reset of one page of keys (one slot): KEYS the keys it removes; ARGV[1] the
-- fence, ARGV[1 + i] '1' if KEYS[i] counts (a window's count, a bucket's state). Beside each
-- counting key, '<key>#reset' is raised to the fence (never lowered), for as long as the key
-- had to live and a minute more (a month without a TTL; none for a key gone since the scan): a pool's refund of that window is
-- refused there (decide.lua, 'f'). Then every key is unlinked.
local fence = tonumber(ARGV[1])
for i, k in ipairs(KEYS) do
  if ARGV[i + 1] == '1' then
    local ttl = redis.call('PTTL', k)
    -- -2: gone since the scan (nothing left to refund onto); -1: no expiry.
    if ttl == -1 then ttl = 2678400000 end
    local f = k .. '#reset'
    if ttl >= 0 and (tonumber(redis.call('GET', f)) or 0) < fence then
      redis.call('SET', f, fence, 'PX', ttl + 60000)
    end
  end
end
return redis.call('UNLINK', unpack(KEYS))

#!/usr/bin/env bash
# Redis CPU per decision of decide.lua (src/store/redis/decide/) against a minimal check-and-charge script
# on the same keys, and of sliding_log at 100 000 entries against a fixed window, measured with
# redis-benchmark on a fresh redis-server in one run (docs/performance.md).
#   scripts/script_cost.sh            (needs redis-server, redis-cli, redis-benchmark, bc)
# Prints, per case: requests/s, Redis's own time per call (INFO commandstats) and the
# redis-server process CPU (utime + stime from /proc) per decision. Not part of the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
port=${PORT:-16999}
n=${N:-300000}
dir=$(mktemp -d)
redis-server --port "$port" --save '' --appendonly no --dir "$dir" --daemonize yes \
  --pidfile "$dir/redis.pid" >/dev/null
trap 'redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || true; rm -rf "$dir"' EXIT
for _ in $(seq 50); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done
pid=$(cat "$dir/redis.pid")
tick=$(getconf CLK_TCK)
cpu() { awk '{print $14 + $15}' "/proc/$pid/stat"; }

# The minimal script: the same atomic check of every key, then the charge (GET, INCRBY, and
# PEXPIRE on a new window key), returning only admitted / denied.
minimal=$(cat <<'LUA'
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
for i = 1, #KEYS do
  local c = tonumber(redis.call('GET', KEYS[i]) or '0')
  if c + 1 > tonumber(ARGV[i]) then return 0 end
end
for i = 1, #KEYS do
  if redis.call('INCRBY', KEYS[i], 1) == 1 then redis.call('PEXPIRE', KEYS[i], 60000) end
end
return 1
LUA
)
decide_sha=$(redis-cli -p "$port" SCRIPT LOAD "$(cat src/store/redis/decide/{head,window,log,bucket,call}.lua)")
minimal_sha=$(redis-cli -p "$port" SCRIPT LOAD "$minimal")

# run LABEL DECISIONS_PER_CALL PIPELINE ARGS...: one redis-benchmark run of N calls.
run() {
  local label=$1 per=$2 pipe=$3; shift 3
  redis-cli -p "$port" CONFIG RESETSTAT >/dev/null
  local c0; c0=$(cpu)
  local rps
  rps=$(redis-benchmark -p "$port" -c 64 -n "$n" -r 10000 -P "$pipe" -q "$@" 2>&1 |
    tr '\r' '\n' | grep -o '[0-9.]* requests per second' | tail -1 | cut -d' ' -f1)
  local c1; c1=$(cpu)
  local usec
  usec=$(redis-cli -p "$port" INFO commandstats | tr -d '\r' |
    grep '^cmdstat_evalsha:' | sed 's/.*usec_per_call=\([0-9.]*\).*/\1/')
  printf '%-58s P=%-2s %9.0f calls/s  %7.2f us/call in Lua  %6.2f us Redis CPU/decision\n' \
    "$label" "$pipe" "$rps" "$usec" "$(echo "($c1 - $c0) * 1000000 / $tick / ($n * $per)" | bc -l)"
}

k1='{bench|resource=api}:fw:1000000000:minute'
k2='{bench|resource=api}|consumer=__rand_int__:fw:1000000000:minute'
m1='{min|resource=api}:fw:1000000000:minute'
m2='{min|resource=api}|consumer=__rand_int__:fw:1000000000:minute'
echo "== [resource=api, consumer=<id>], 2 fixed-window limits, 10 000 consumers"
for pipe in 1 16; do
  run "minimal check-and-charge script" 1 "$pipe" evalsha "$minimal_sha" 2 "$m1" "$m2" 1000000000 1000000000
  run "decide.lua, one request per call (packed)" 1 "$pipe" evalsha "$decide_sha" 2 "$k1" "$k2" \
    "" p 2 1000000000 60000000 1000000000 60000000 1 8 64 65
done
# sluice batches concurrent requests on standalone Redis: 16 requests in one call, packed (every
# distinct counter once; a code per limit is hits * 64 + its counter's index), as sluice sends
# them; and, for comparison, the same call in the general layout (4 arguments per limit).
keys=("$k1"); args=("" p 17 1000000000 60000000)
for r in $(seq 16); do
  keys+=("{bench|resource=api}|consumer=__rand_int__$r:fw:1000000000:minute")
  args+=(1000000000 60000000)
done
args+=(16)
for r in $(seq 16); do args+=(8 64 $((64 + r))); done
run "decide.lua, 16 requests per call, packed (as sluice batches)" 16 1 evalsha "$decide_sha" 17 "${keys[@]}" "${args[@]}"
keys=(); args=("" 0 16)
for r in $(seq 16); do
  keys+=("$k1" "{bench|resource=api}|consumer=__rand_int__$r:fw:1000000000:minute")
  args+=(2 1000000000 60000000 1 0 1000000000 60000000 1 0)
done
run "decide.lua, 16 requests per call, general layout" 16 1 evalsha "$decide_sha" 32 "${keys[@]}" "${args[@]}"

echo "== sliding_log holding 100 000 entries (one hour) against a fixed window, one key"
log='{bench|log=full}:slw:1000000:hour'
fill=$(cat <<'LUA'
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
for i = 1, 100000, 1000 do
  local z = {}
  for j = i, math.min(i + 999, 100000) do
    z[#z + 1] = string.format('%d', now - 1800000000 + j)
    z[#z + 1] = string.format('%015d:1:%d', j, j)
  end
  redis.call('ZADD', KEYS[1], unpack(z))
end
redis.call('PEXPIRE', KEYS[1], 7200000)
return redis.call('ZCARD', KEYS[1])
LUA
)
echo "entries: $(redis-cli -p "$port" EVAL "$fill" 1 "$log")"
redis-cli -p "$port" CONFIG SET slowlog-log-slower-than 1000 >/dev/null
redis-cli -p "$port" SLOWLOG RESET >/dev/null
run "fixed_window, admitted (packed)" 1 1 evalsha "$decide_sha" 1 '{bench|one=x}:fw:1000000000:hour' \
  "" p 1 1000000000 3600000000 1 4 64
run "fixed_window, admitted (general path)" 1 1 evalsha "$decide_sha" 1 '{bench|one=y}:fw:1000000000:hour' \
  "" 0 1 1 1000000000 3600000000 1 0
n=$((n / 3))
run "sliding_log at 100 000 entries, admitted (limit 10^9)" 1 1 evalsha "$decide_sha" 1 \
  "$log" "" 0 1 1 1000000000 3600000000 1 2
run "sliding_log at 100 000 entries, denied (limit 100 000)" 1 1 evalsha "$decide_sha" 1 \
  "$log" "" 0 1 1 100000 3600000000 1 2
echo "entries now: $(redis-cli -p "$port" ZCARD "$log"); calls over 1 ms since the fill (SLOWLOG): $(redis-cli -p "$port" SLOWLOG LEN)"

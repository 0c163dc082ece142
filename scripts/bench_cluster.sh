#!/usr/bin/env bash
# The hash-tag trade-off on a real 3-master Redis Cluster (docs/redis.md, "Hash tags on Cluster"): the
# two-descriptor workload with the default hash tag (domain + first entry: two slots, two
# concurrent script calls per request) against `hash_tag: domain` (one slot: one call), same
# `sluice bench` load. Prints decisions/s, p99, sluice CPU and the CPU of each Redis node per
# decision. Not part of the test suite.
#   cargo build --release && scripts/bench_cluster.sh [seconds]
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-15}
dir=$(mktemp -d)
ports=(17101 17102 17103)
pids=()
cleanup() {
  [ -n "${sluice:-}" ] && kill "$sluice" 2>/dev/null || true
  for p in "${ports[@]}"; do redis-cli -p "$p" shutdown nosave >/dev/null 2>&1 || true; done
  rm -rf "$dir"
}
trap cleanup EXIT
for p in "${ports[@]}"; do
  mkdir -p "$dir/$p"
  redis-server --port "$p" --cluster-enabled yes --cluster-config-file "$dir/$p/nodes.conf" \
    --save '' --appendonly no --dir "$dir/$p" --daemonize yes --pidfile "$dir/$p/pid" >/dev/null
done
sleep 0.5
redis-cli --cluster create 127.0.0.1:17101 127.0.0.1:17102 127.0.0.1:17103 --cluster-yes \
  --cluster-replicas 0 >/dev/null
for _ in $(seq 100); do
  [[ "$(redis-cli -p 17101 cluster info)" == *cluster_state:ok* ]] && break; sleep 0.1
done
for p in "${ports[@]}"; do pids+=("$(cat "$dir/$p/pid")"); done
tick=$(getconf CLK_TCK)
cpu() { awk '{print $14 + $15}' "/proc/$1/stat"; }

GRPC_HOST=127.0.0.1 GRPC_PORT=17181 HOST=127.0.0.1 PORT=17180 LOG_LEVEL=warn REDIS_TYPE=cluster \
  REDIS_URL=127.0.0.1:17101,127.0.0.1:17102,127.0.0.1:17103 \
  target/release/sluice serve --config config/bench/sluice &
sluice=$!
sleep 1
for domain in bench2 bench3 bench2 bench3; do
  args=(--target http://127.0.0.1:17181 --domain "$domain" --descriptor 'remote_address={id}'
        --descriptor path=/api)
  target/release/sluice bench "${args[@]}" --duration 3s --json >/dev/null
  s0=$(cpu "$sluice"); r0=0; for p in "${pids[@]}"; do r0=$(echo "$r0 + $(cpu "$p")" | bc); done
  out=$(target/release/sluice bench "${args[@]}" --duration "${secs}s" --json)
  s1=$(cpu "$sluice"); r1=0; for p in "${pids[@]}"; do r1=$(echo "$r1 + $(cpu "$p")" | bc); done
  python3 - "$domain" "$out" "$s0" "$s1" "$r0" "$r1" "$tick" <<'PY'
import json, sys
d, out, s0, s1, r0, r1, tick = sys.argv[1], json.loads(sys.argv[2]), *map(float, sys.argv[3:])
n = max(out["decisions"], 1)
label = {"bench2": "hash tag per descriptor (2 slots)", "bench3": "hash_tag: domain (1 slot)"}[d]
print(f"{label:36} {out['decisions_per_s']:8.0f}/s  p99 {out['p99_us']/1000:5.2f} ms  "
      f"sluice {(s1-s0)/tick/n*1e6:5.1f} us  Redis (3 nodes) {(r1-r0)/tick/n*1e6:5.1f} us  "
      f"errors {out['errors']}")
PY
done

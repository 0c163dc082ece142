#!/usr/bin/env python3
"""What the rate-limit filter costs a request: the same HTTP load (wrk, closed loop) through
Envoy with no rate-limit filter, then with `envoy.filters.http.ratelimit` calling sluice, then
calling Kuadrant Limitador, on the memory store and on Redis, alternated, in one run.

Reports requests/s and wrk's p50/p99 per setup, the latency the filter adds over plain Envoy
(p50/p99 difference), Envoy's `ratelimit.error` and `failure_mode_allowed` counts (decisions
that missed Envoy's timeout), and the ratios sluice / Limitador.

    cargo build --release
    python3 scripts/bench_envoy.py --duration 10 --rounds 2              # Envoy's 20 ms timeout
    python3 scripts/bench_envoy.py --duration 10 --rounds 2 --timeout 1s

Needs: Envoy (ENVOY_BIN, or scripts/test.sh's pinned install), wrk (Debian `wrk`), redis-server,
../shared/peers/limitador-server.gz. Not part of the test suite: it times things.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import cpu_seconds, free_port, limitador_binary, wait_port  # noqa: E402  (shared with bench.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLUICE = os.path.join(ROOT, "target", "release", "sluice")
DEFAULT_ENVOY = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                             "sluice", "envoy-1.40.0", "envoy", "_bin", "envoy")

# Envoy: the front listener (rate-limited route /api: [resource=api, consumer=<x-consumer>]) and
# the backend on a second listener answering 200 directly, so the backend costs next to nothing.
ENVOY = """
admin: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {admin} }} }} }}
static_resources:
  listeners:
    - name: front
      address: {{ socket_address: {{ address: 127.0.0.1, port_value: {front} }} }}
      filter_chains:
        - filters:
            - name: envoy.filters.network.http_connection_manager
              typed_config:
                "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
                stat_prefix: front
                route_config:
                  virtual_hosts:
                    - name: all
                      domains: ["*"]
                      routes:
                        - match: {{ prefix: / }}
                          route:
                            cluster: backend
                            rate_limits:
                              - actions:
                                  - generic_key: {{ descriptor_key: resource, descriptor_value: api }}
                                  - request_headers: {{ header_name: x-consumer, descriptor_key: consumer }}
                http_filters:
{filters}
                  - name: envoy.filters.http.router
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
    - name: backend
      address: {{ socket_address: {{ address: 127.0.0.1, port_value: {backend} }} }}
      filter_chains:
        - filters:
            - name: envoy.filters.network.http_connection_manager
              typed_config:
                "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
                stat_prefix: backend
                route_config:
                  virtual_hosts:
                    - name: all
                      domains: ["*"]
                      routes:
                        - match: {{ prefix: / }}
                          direct_response: {{ status: 200, body: {{ inline_string: ok }} }}
                http_filters:
                  - name: envoy.filters.http.router
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
    - name: backend
      type: STATIC
      load_assignment:
        cluster_name: backend
        endpoints: [{{ lb_endpoints: [{{ endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {backend} }} }} }} }}] }}]
    - name: rls
      type: STATIC
      typed_extension_protocol_options:
        envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
          "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
          explicit_http_config: {{ http2_protocol_options: {{}} }}
      load_assignment:
        cluster_name: rls
        endpoints: [{{ lb_endpoints: [{{ endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {rls} }} }} }} }}] }}]
"""

FILTER = """                  - name: envoy.filters.http.ratelimit
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit
                      domain: bench
                      failure_mode_deny: false
                      timeout: {timeout}
                      rate_limit_service:
                        transport_api_version: V3
                        grpc_service: {{ envoy_grpc: {{ cluster_name: rls }} }}"""


def start_rls(system, store, tmp):
    """The RLS under test (and its redis-server): returns (processes, gRPC port)."""
    procs = []
    redis_url = None
    if store == "redis":
        rport = free_port()
        procs.append(subprocess.Popen(
            ["redis-server", "--port", str(rport), "--save", "", "--appendonly", "no", "--dir", tmp],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        wait_port(rport, procs[-1], "redis-server")
        redis_url = f"127.0.0.1:{rport}"
    port, http = free_port(), free_port()
    if system == "sluice":
        env = dict(os.environ, GRPC_HOST="127.0.0.1", GRPC_PORT=str(port), HOST="127.0.0.1",
                   PORT=str(http), DEBUG_PORT=str(free_port()), LOG_LEVEL="warn")
        if redis_url:
            env["REDIS_URL"] = redis_url
        cmd = [SLUICE, "serve", "--config", os.path.join(ROOT, "config", "bench", "sluice", "bench.yaml")]
    else:
        env = dict(os.environ)
        cmd = [limitador_binary(), "-b", "127.0.0.1", "-p", str(port), "-B", "127.0.0.1", "-P", str(http),
               os.path.join(ROOT, "config", "bench", "limitador.yaml")]
        cmd += ["redis", f"redis://{redis_url}"] if redis_url else ["memory"]
    procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    wait_port(port, procs[-1], system)
    return procs, port


def envoy_stats(admin):
    text = urllib.request.urlopen(f"http://127.0.0.1:{admin}/stats", timeout=5).read().decode()
    stats = {}
    for line in text.splitlines():
        k, _, v = line.partition(": ")
        if v.strip().isdigit():
            stats[k] = int(v)
    return stats


def to_ms(value):
    m = re.match(r"([\d.]+)(us|ms|s|m)$", value)
    if m is None:
        sys.exit(f"cannot read wrk's latency {value!r}")
    if m.group(2) == "m":
        return float(m.group(1)) * 60000
    n, unit = float(m.group(1)), m.group(2)
    return n / 1000 if unit == "us" else n * 1000 if unit == "s" else n


def run(envoy_bin, setup, args, tmp):
    system, store = setup
    procs, rls = ([], free_port()) if system == "none" else start_rls(system, store, tmp)
    admin, front, backend = free_port(), free_port(), free_port()
    filters = "" if system == "none" else FILTER.format(timeout=args.timeout)
    path = os.path.join(tmp, "envoy.yaml")
    with open(path, "w") as f:
        f.write(ENVOY.format(admin=admin, front=front, backend=backend, rls=rls, filters=filters))
    envoy = subprocess.Popen([envoy_bin, "-c", path, "--disable-hot-restart", "--concurrency",
                              str(args.envoy_threads), "-l", "error"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(front, envoy, "envoy")
        url = f"http://127.0.0.1:{front}/api"
        hdr = ["-H", "x-consumer: c1"]
        subprocess.run(["wrk", "-t1", "-c4", "-d1s", *hdr, url], capture_output=True)  # warm up
        watched = [envoy] + procs  # Envoy, then (redis-server,) the RLS
        before = [cpu_seconds(p.pid) for p in watched]
        ok_before = envoy_stats(admin).get("cluster.backend.ratelimit.ok", 0)
        out = subprocess.run(["wrk", "-t2", f"-c{args.connections}", f"-d{args.duration}s",
                              "--latency", *hdr, url], capture_output=True, text=True).stdout
        if "Requests/sec" not in out:
            sys.exit(f"wrk failed for {setup}:\n{out}")
        rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
        p50 = to_ms(re.search(r"^\s+50%\s+(\S+)", out, re.M).group(1))
        p99 = to_ms(re.search(r"^\s+99%\s+(\S+)", out, re.M).group(1))
        after = [cpu_seconds(p.pid) for p in watched]
        stats = envoy_stats(admin)
        requests = rps * args.duration
        cpu = [(a - b) * 1e6 / max(requests, 1) for a, b in zip(after, before)]
        rls_cpu = cpu[-1] if len(cpu) > 1 else 0.0
        decisions = stats.get("cluster.backend.ratelimit.ok", 0) - ok_before
        return {"rps": rps, "p50": p50, "p99": p99, "envoy_cpu": cpu[0], "rls_cpu": rls_cpu,
                "rls_cpu_per_decision": (after[-1] - before[-1]) * 1e6 / max(decisions, 1) if procs else 0.0,
                "error": stats.get("cluster.backend.ratelimit.error", 0),
                "allowed": stats.get("cluster.backend.ratelimit.failure_mode_allowed", 0),
                "ok": stats.get("cluster.backend.ratelimit.ok", 0)}
    finally:
        for p in [envoy, *procs]:
            p.terminate()
        for p in [envoy, *procs]:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--connections", type=int, default=16)
    p.add_argument("--envoy-threads", type=int, default=1)
    p.add_argument("--timeout", default="0.02s", help="the filter's timeout (Envoy's default: 20 ms)")
    args = p.parse_args()
    envoy_bin = os.environ.get("ENVOY_BIN", DEFAULT_ENVOY)
    for need in (envoy_bin, SLUICE):
        if not os.path.exists(need):
            sys.exit(f"missing {need} (scripts/test.sh installs Envoy; cargo build --release)")
    setups = [("none", "-"), ("sluice", "memory"), ("limitador", "memory"),
              ("sluice", "redis"), ("limitador", "redis")]
    results = {s: [] for s in setups}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = setups if r % 2 == 0 else [setups[0]] + setups[:0:-1]
            for s in order:
                res = run(envoy_bin, s, args, tmp)
                results[s].append(res)
                print(f"round {r + 1} {s[0]:>9}/{s[1]:<6} {res['rps']:9.0f} req/s  p50 {res['p50']:.3f} ms"
                      f"  p99 {res['p99']:.3f} ms  Envoy CPU {res['envoy_cpu']:.1f} us/req"
                      f"  RLS CPU {res['rls_cpu_per_decision']:.1f} us/decision"
                      f"  ratelimit ok={res['ok']} error={res['error']}"
                      f" failure_mode_allowed={res['allowed']}", flush=True)
    mean = {s: {k: sum(x[k] for x in v) / len(v) for k in v[0]} for s, v in results.items()}
    base = mean[("none", "-")]
    print(f"\nEnvoy {args.envoy_threads} worker(s), wrk -c{args.connections}, {args.duration} s x "
          f"{args.rounds} rounds, rate-limit timeout {args.timeout}; mean of rounds")
    print("| setup | req/s | p50 ms | p99 ms | p50 added | p99 added | Envoy CPU us/req | RLS CPU us/decision | ratelimit.error | failure_mode_allowed |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for s in setups:
        m = mean[s]
        name = "Envoy, no rate-limit filter" if s[0] == "none" else f"Envoy + {s[0]} ({s[1]})"
        print(f"| {name} | {m['rps']:.0f} | {m['p50']:.3f} | {m['p99']:.3f} | "
              f"{m['p50'] - base['p50']:+.3f} | {m['p99'] - base['p99']:+.3f} | "
              f"{m['envoy_cpu']:.1f} | {m['rls_cpu_per_decision']:.1f} | "
              f"{m['error']:.0f} | {m['allowed']:.0f} |")
    for store in ("memory", "redis"):
        sl, li = mean[("sluice", store)], mean[("limitador", store)]
        print(f"sluice / Limitador ({store}): req/s {sl['rps'] / li['rps']:.2f}x, RLS CPU per decision "
              f"{sl['rls_cpu_per_decision'] / max(li['rls_cpu_per_decision'], 1e-9):.2f}x, "
              f"p50 added {(sl['p50'] - base['p50']):.3f} vs {(li['p50'] - base['p50']):.3f} ms, "
              f"p99 added {(sl['p99'] - base['p99']):.3f} vs {(li['p99'] - base['p99']):.3f} ms")


if __name__ == "__main__":
    main()

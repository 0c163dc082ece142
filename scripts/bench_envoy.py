#!/usr/bin/env python3
"""What the rate-limit filter costs a request: the same HTTP load (wrk, closed loop) through
Envoy with no rate-limit filter, then with `envoy.filters.http.ratelimit` calling sluice, then
calling Kuadrant Limitador, on the memory store and on Redis, alternated, in one run.

With --rlqs: no filter vs sluice through the RLS filter vs sluice through the Rate Limit Quota
Service filter (`envoy.filters.http.rate_limit_quota`, the same limits: the bucket
{resource: api, consumer: <x-consumer>} is the RLS descriptor), memory store, and the CPU each
costs per request, Envoy's and sluice's.

Reports requests/s and wrk's p50/p99 per setup, the latency the filter adds over plain Envoy
(p50/p99 difference), Envoy's `ratelimit.error` and `failure_mode_allowed` counts (decisions
that missed Envoy's timeout), and the ratios sluice / Limitador.

    cargo build --release
    python3 scripts/bench_envoy.py --duration 10 --rounds 2              # Envoy's 20 ms timeout
    python3 scripts/bench_envoy.py --duration 10 --rounds 2 --timeout 1s
    python3 scripts/bench_envoy.py --duration 10 --rounds 3 --rlqs

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

# The same limits over RLQS: one bucket per consumer, {resource: api, consumer: <x-consumer>},
# which sluice resolves to the RLS descriptor [resource=api, consumer=<x-consumer>].
RLQS_FILTER = """                  - name: envoy.filters.http.rate_limit_quota
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.rate_limit_quota.v3.RateLimitQuotaFilterConfig
                      domain: bench
                      rlqs_server: {{ envoy_grpc: {{ cluster_name: rls }} }}
                      bucket_matchers:
                        matcher_list:
                          matchers:
                            - predicate:
                                single_predicate:
                                  input:
                                    name: x-consumer
                                    typed_config:
                                      "@type": type.googleapis.com/envoy.type.matcher.v3.HttpRequestHeaderMatchInput
                                      header_name: x-consumer
                                  value_match: {{ safe_regex: {{ google_re2: {{}}, regex: ".+" }} }}
                              on_match:
                                action:
                                  name: rate_limit_quota
                                  typed_config:
                                    "@type": type.googleapis.com/envoy.extensions.filters.http.rate_limit_quota.v3.RateLimitQuotaBucketSettings
                                    bucket_id_builder:
                                      bucket_id_builder:
                                        resource: {{ string_value: api }}
                                        consumer:
                                          custom_value:
                                            name: x-consumer
                                            typed_config:
                                              "@type": type.googleapis.com/envoy.type.matcher.v3.HttpRequestHeaderMatchInput
                                              header_name: x-consumer
                                    reporting_interval: 5s
                                    no_assignment_behavior: {{ fallback_rate_limit: {{ blanket_rule: ALLOW_ALL }} }}
                                    expired_assignment_behavior: {{ fallback_rate_limit: {{ blanket_rule: ALLOW_ALL }} }}
                                    deny_response_settings: {{ http_status: {{ code: 429 }} }}"""


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
    if system in ("sluice", "sluice-rlqs"):
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


def cpu_ns_seconds(pid):
    """CPU time of every thread of `pid` from /proc/PID/task/*/schedstat (nanoseconds, where
    /proc/PID/stat counts 10 ms ticks: an RLQS server spends too little for ticks to see)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # a thread that ended meanwhile
    return total / 1e9


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


def h2load(url, args, tmp):
    """HTTP/2 load with h2load (one thread, `--connections` connections, 4 streams each);
    req/s from its summary, p50/p99 from its per-request log."""
    log = os.path.join(tmp, "h2load.log")
    out = subprocess.run(["h2load", "-t1", f"-c{args.connections}", "-m4", f"-D{args.duration}",
                          "-H", "x-consumer: c1", f"--log-file={log}", url],
                         capture_output=True, text=True).stdout
    m = re.search(r"finished in [\d.]+\w+, ([\d.]+) req/s", out)
    if m is None:
        sys.exit(f"h2load failed:\n{out}")
    with open(log) as f:
        lat = sorted(int(line.split()[2]) for line in f if line.strip())
    pct = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] / 1000.0 if lat else 0.0
    return float(m.group(1)), pct(0.5), pct(0.99)


def run(envoy_bin, setup, args, tmp):
    system, store = setup
    procs, rls = ([], free_port()) if system == "none" else start_rls(system, store, tmp)
    admin, front, backend = free_port(), free_port(), free_port()
    filters = ("" if system == "none" else RLQS_FILTER.format() if system == "sluice-rlqs"
               else FILTER.format(timeout=args.timeout))
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
        cpu_of = cpu_ns_seconds if args.rlqs else cpu_seconds
        before = [cpu_of(p.pid) for p in watched]
        ok_before = envoy_stats(admin).get("cluster.backend.ratelimit.ok", 0)
        if args.client == "h2load":
            rps, p50, p99 = h2load(url, args, tmp)
        else:
            out = subprocess.run(["wrk", "-t2", f"-c{args.connections}", f"-d{args.duration}s",
                                  "--latency", *hdr, url], capture_output=True, text=True).stdout
            if "Requests/sec" not in out:
                sys.exit(f"wrk failed for {setup}:\n{out}")
            rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
            p50 = to_ms(re.search(r"^\s+50%\s+(\S+)", out, re.M).group(1))
            p99 = to_ms(re.search(r"^\s+99%\s+(\S+)", out, re.M).group(1))
        after = [cpu_of(p.pid) for p in watched]
        stats = envoy_stats(admin)
        requests = rps * args.duration
        cpu = [(a - b) * 1e6 / max(requests, 1) for a, b in zip(after, before)]
        rls_cpu = cpu[-1] if len(cpu) > 1 else 0.0
        decisions = stats.get("cluster.backend.ratelimit.ok", 0) - ok_before
        served = stats.get("http.front.downstream_rq_2xx", 0)
        return {"rps": rps, "p50": p50, "p99": p99, "envoy_cpu": cpu[0], "rls_cpu": rls_cpu,
                "served_2xx": served, "requests": requests,
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
    p.add_argument("--client", choices=["wrk", "h2load"], default="wrk",
                   help="the load: wrk (HTTP/1.1) or h2load (HTTP/2, 4 streams per connection)")
    p.add_argument("--rlqs", action="store_true",
                   help="no filter vs sluice over the RLS vs sluice over RLQS (memory store)")
    args = p.parse_args()
    if args.rlqs:
        return main_rlqs(args)
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


def main_rlqs(args):
    envoy_bin = os.environ.get("ENVOY_BIN", DEFAULT_ENVOY)
    for need in (envoy_bin, SLUICE):
        if not os.path.exists(need):
            sys.exit(f"missing {need} (scripts/test.sh installs Envoy; cargo build --release)")
    setups = [("none", "-"), ("sluice", "memory"), ("sluice-rlqs", "memory")]
    results = {s: [] for s in setups}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = setups if r % 2 == 0 else setups[::-1]
            for s in order:
                res = run(envoy_bin, s, args, tmp)
                results[s].append(res)
                print(f"round {r + 1} {s[0]:>11} {res['rps']:9.0f} req/s  p50 {res['p50']:.3f} ms"
                      f"  p99 {res['p99']:.3f} ms  Envoy CPU {res['envoy_cpu']:.1f} us/req"
                      f"  sluice CPU {res['rls_cpu']:.2f} us/req  2xx {res['served_2xx']}",
                      flush=True)
    mean = {s: {k: sum(x[k] for x in v) / len(v) for k in v[0]} for s, v in results.items()}
    print(f"\nEnvoy {args.envoy_threads} worker(s), {args.client} -c{args.connections}, {args.duration} s x "
          f"{args.rounds} rounds alternated, memory store; mean of rounds")
    print("| setup | req/s | p50 ms | p99 ms | Envoy CPU us/req | sluice CPU us/req |")
    print("| --- | --- | --- | --- | --- | --- |")
    names = {"none": "Envoy, no rate-limit filter", "sluice": "Envoy + RLS filter -> sluice",
             "sluice-rlqs": "Envoy + RLQS filter -> sluice"}
    for s in setups:
        m = mean[s]
        print(f"| {names[s[0]]} | {m['rps']:.0f} | {m['p50']:.3f} | {m['p99']:.3f} | "
              f"{m['envoy_cpu']:.1f} | {m['rls_cpu']:.2f} |")
    rls, q = mean[("sluice", "memory")], mean[("sluice-rlqs", "memory")]
    print(f"RLQS / RLS: sluice CPU per request {q['rls_cpu'] / max(rls['rls_cpu'], 1e-9):.4f}x, "
          f"Envoy CPU per request {q['envoy_cpu'] / max(rls['envoy_cpu'], 1e-9):.2f}x, "
          f"req/s {q['rps'] / max(rls['rps'], 1e-9):.2f}x")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Side-by-side load runs: sluice against Kuadrant Limitador (and the tonic gRPC floor), the same
`sluice bench` load for each, each server on its own fresh redis-server, alternated, in one run.

Reports decisions/s, p99 and CPU per decision of the server and of redis-server (utime + stime
from /proc/PID/stat before and after the load, divided by the decisions answered), and the ratios
sluice / Limitador. Absolute figures drift on shared machines; ratios from one run hold.

    cargo build --release
    python3 scripts/bench.py --store redis --duration 20 --rounds 2
    python3 scripts/bench.py --store memory --duration 20 --rounds 2

Needs redis-server on PATH (for --store redis) and ../shared/peers/limitador-server.gz (the
README of ../shared/peers says what it is). Not part of the test suite: it times things.
"""
import argparse
import gzip
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLUICE = os.path.join(ROOT, "target", "release", "sluice")
PEERS = os.path.join(ROOT, "..", "shared", "peers")
TICK = os.sysconf("SC_CLK_TCK")

# The sluice rules every sluice variant serves (`--config` changes it, e.g. for an older build
# that does not know a newer key).
CONFIG_DIR = [os.path.join(ROOT, "config", "bench", "sluice")]
# `--workers`: WORKER_THREADS of every sluice variant (0: sluice's default, one per CPU).
WORKERS = [0]

WORKLOADS = {
    # name: (domain, descriptor templates)
    "resource+consumer": ("bench", ["resource=api,consumer={id}"]),
    "two-descriptors": ("bench2", ["remote_address={id}", "path=/api"]),
    # An in_flight slot taken and freed by one request (the two calls of a request in one):
    # what each in_flight call costs, beside the plain limits above. Not run by default.
    "in-flight": ("ai", ["tenant={id},request_id={req}", "tenant={id},request_done={req}"]),
    # A reservation of 1 and its settle at 1 on a fixed-window budget (both calls of a request
    # in one, as above). Not run by default.
    "reservation": ("ai", ["user={id},request_id={req}", "user={id},request_done={req}"]),
    # Issue 40: the resource+consumer load on a leased resource (hot.yaml), and one API-wide
    # limit without and with `leased` (api.yaml, api_leased.yaml). Not run by default; with
    # `--replicas 1,2,4` against one Redis.
    "hot-resource": ("hot", ["resource=api,consumer={id}"]),
    "api-wide": ("api", ["resource=api"]),
    "api-wide-leased": ("api_leased", ["resource=api"]),
}
DEFAULT_WORKLOADS = ["resource+consumer", "two-descriptors"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # fields[11], [12] are utime, stime (fields 14 and 15 of proc(5), counted after the name)
    return (int(fields[11]) + int(fields[12])) / TICK


def wait_port(port, proc, what):
    for _ in range(200):
        if proc.poll() is not None:
            sys.exit(f"{what} exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    sys.exit(f"{what} did not listen on {port}")


def start_redis(tmp):
    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no",
         "--dir", tmp, "--slowlog-log-slower-than", "1000"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port, proc, "redis-server")
    return proc, port


def limitador_binary():
    out = os.path.join(ROOT, "target", "peers", "limitador-server")
    if not os.path.exists(out):
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with gzip.open(os.path.join(PEERS, "limitador-server.gz")) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.chmod(out, 0o755)
    return out


def start_server(system, store, redis_port, variants, envs=None):
    port, http = free_port(), free_port()
    env = dict(os.environ)
    if system == "sluice" or system in variants:
        env.update({"GRPC_HOST": "127.0.0.1", "GRPC_PORT": str(port), "HOST": "127.0.0.1",
                    "PORT": str(http), "LOG_LEVEL": "warn"})
        if store == "redis":
            env["REDIS_URL"] = f"127.0.0.1:{redis_port}"
        if WORKERS[0]:
            env["WORKER_THREADS"] = str(WORKERS[0])
        env.update((envs or {}).get(system, {}))
        binary = variants.get(system, SLUICE)
        cmd = [binary, "serve", "--config", CONFIG_DIR[0]]
    elif system == "limitador":
        cmd = [limitador_binary(), "-b", "127.0.0.1", "-p", str(port), "-B", "127.0.0.1",
               "-P", str(http), os.path.join(ROOT, "config", "bench", "limitador.yaml")]
        cmd += ["redis", f"redis://127.0.0.1:{redis_port}"] if store == "redis" else ["memory"]
        env["RUST_LOG"] = "error"
    else:  # the gRPC floor answers OK without deciding
        cmd = [os.path.join(PEERS, "rls-floor"), f"127.0.0.1:{port}"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port, proc, system)
    return proc, port


def bench_cmd(port, workload, args, duration):
    domain, descriptors = WORKLOADS[workload]
    cmd = [SLUICE, "bench", "--target", f"http://127.0.0.1:{port}", "--domain", domain,
           "--consumers", str(args.consumers), "--concurrency", str(args.concurrency),
           "--connections", str(args.connections), "--duration", f"{duration}s",
           "--rate", str(args.rate), "--json"]
    for d in descriptors:
        cmd += ["--descriptor", d]
    return cmd


def redis_calls(port):
    """Script calls (EVALSHA and EVAL) redis-server answered so far, and the microseconds
    INFO commandstats accounts to them (the scripts' own time, without the event loop's)."""
    out = subprocess.run(["redis-cli", "-p", str(port), "INFO", "commandstats"],
                         capture_output=True, text=True).stdout
    calls, usec = 0, 0
    for line in out.splitlines():
        if line.startswith(("cmdstat_evalsha:", "cmdstat_eval:")):
            calls += int(line.split("calls=", 1)[1].split(",", 1)[0])
            usec += int(line.split("usec=", 1)[1].split(",", 1)[0])
    return calls, usec


def run_one(system, workload, args, tmp, replicas=1):
    """One measured run: `replicas` servers of `system` on one redis-server, each loaded by a
    `sluice bench` of its own (the concurrency split among them), CPU summed over the servers."""
    redis = None
    redis_port = 0
    if args.store == "redis" and system != "floor":
        redis, redis_port = start_redis(tmp)
    servers = [start_server(system, args.store, redis_port, args.variant_map, args.env_map)
               for _ in range(replicas)]
    share = argparse.Namespace(**vars(args))
    share.concurrency = max(args.concurrency // replicas, 1)
    share.connections = max(args.connections // replicas, 1)
    share.rate = args.rate // replicas

    def load(duration):
        procs = [subprocess.Popen(bench_cmd(port, workload, share, duration),
                                  stdout=subprocess.PIPE, text=True) for _, port in servers]
        return [json.loads(p.communicate()[0]) for p in procs]

    try:
        load(args.warmup)  # connections, scripts, allocator warm
        s0 = sum(cpu_seconds(p.pid) for p, _ in servers)
        r0 = cpu_seconds(redis.pid) if redis else 0.0
        c0, u0 = redis_calls(redis_port) if redis else (0, 0)
        parts = load(args.duration)
        s1 = sum(cpu_seconds(p.pid) for p, _ in servers)
        r1 = cpu_seconds(redis.pid) if redis else 0.0
        c1, u1 = redis_calls(redis_port) if redis else (0, 0)
        result = dict(parts[0])
        for k in ("decisions", "ok", "over_limit", "errors"):
            result[k] = sum(r[k] for r in parts)
        result["decisions_per_s"] = sum(r["decisions_per_s"] for r in parts)
        result["p99_us"] = max(r["p99_us"] for r in parts)
        if redis:
            slow = subprocess.run(["redis-cli", "-p", str(redis_port), "SLOWLOG", "LEN"],
                                  capture_output=True, text=True).stdout.strip()
            result["redis_slowlog"] = int(slow or 0)
    finally:
        for server, _ in servers:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=15)
        if redis:
            redis.terminate()
            redis.wait(timeout=15)
    n = max(result["decisions"], 1)
    result["server_cpu_us"] = (s1 - s0) / n * 1e6
    result["redis_cpu_us"] = (r1 - r0) / n * 1e6
    result["redis_calls"] = (c1 - c0) / n
    result["script_us"] = (u1 - u0) / n
    result["replicas"] = replicas
    return result


def summarise(values, stat):
    if stat == "median":
        v = sorted(values)
        n = len(v)
        return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2
    return sum(values) / len(values)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--store", choices=["redis", "memory"], default="redis")
    p.add_argument("--systems", default="sluice,limitador", help="comma list: sluice,limitador,floor")
    p.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS),
                   help="comma list of " + ", ".join(WORKLOADS))
    p.add_argument("--duration", type=int, default=20, help="seconds per measured run")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2, help="alternations of the systems")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--connections", type=int, default=4)
    p.add_argument("--consumers", type=int, default=10000)
    p.add_argument("--rate", type=int, default=0,
                   help="open loop: requests per second on a fixed schedule, the same work for "
                        "every system (0: closed loop, as fast as each answers)")
    p.add_argument("--workers", type=int, default=0,
                   help="WORKER_THREADS of every sluice variant. With 2 threads, how the "
                        "connections happen to fall on them changes CPU per decision by up to "
                        "30 %% from run to run; 1 removes that from an A/B of two builds")
    p.add_argument("--replicas", default="1",
                   help="comma list: servers of each system sharing one redis-server, each "
                        "loaded by its own bench (the concurrency split among them), e.g. 1,2,4")
    p.add_argument("--json", help="also write every run to this file")
    p.add_argument("--stat", choices=["mean", "median"], default="mean",
                   help="how the rounds of one system are summarised")
    p.add_argument("--config", help="sluice rules directory for every sluice variant")
    p.add_argument("--variant", action="append", default=[],
                   help="NAME=PATH: another sluice binary to run as system NAME (list it in --systems)")
    p.add_argument("--env", action="append", default=[],
                   help="NAME:KEY=VALUE: an environment variable for variant NAME, e.g. "
                        "local:FAILURE_MODE=local, down:REDIS_URL=127.0.0.1:9 (nothing listens: "
                        "every decision local), mem:REDIS_URL= (the memory store)")
    args = p.parse_args()
    args.variant_map = dict(v.split("=", 1) for v in args.variant)
    args.env_map = {}
    for e in args.env:
        name, kv = e.split(":", 1)
        key, value = kv.split("=", 1)
        args.env_map.setdefault(name, {})[key] = value
    WORKERS[0] = args.workers
    if args.config:
        CONFIG_DIR[0] = args.config
    systems = args.systems.split(",")
    replicas = [int(n) for n in args.replicas.split(",")]
    workloads = [(w, n) for w in args.workloads.split(",") for n in replicas]

    def label(w):
        return w[0] if w[1] == 1 and replicas == [1] else f"{w[0]} x{w[1]}"

    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for workload in workloads:
            for rnd in range(args.rounds):
                order = systems if rnd % 2 == 0 else list(reversed(systems))
                for system in order:
                    r = run_one(system, workload[0], args, tmp, workload[1])
                    r.update(system=system, workload=label(workload), round=rnd)
                    runs.append(r)
                    print(f"{label(workload):18} {system:9} {r['decisions_per_s']:8.0f}/s "
                          f"p99 {r['p99_us'] / 1000:6.2f}ms server {r['server_cpu_us']:6.1f}us "
                          f"redis {r['redis_cpu_us']:5.1f}us calls {r['redis_calls']:.4f} "
                          f"errors {r['errors']} slowlog {r.get('redis_slowlog', '-')}", flush=True)
    print()
    print(f"store={args.store}  concurrency={args.concurrency}  connections={args.connections}  "
          f"consumers={args.consumers}  rate={args.rate or 'closed loop'}  {args.duration}s x {args.rounds} rounds ({args.stat}s)")
    keys = [("decisions_per_s", "decisions/s"), ("p99_us", "p99 us"),
            ("server_cpu_us", "server CPU us/decision"), ("redis_cpu_us", "Redis CPU us/decision"),
            ("redis_calls", "script calls/decision"),
            ("script_us", "script us/decision (INFO)")]
    for workload in (label(w) for w in workloads):
        mean = {}
        for system in systems:
            rs = [r for r in runs if r["system"] == system and r["workload"] == workload]
            mean[system] = {k: summarise([r[k] for r in rs], args.stat) for k, _ in keys}
        # The ratio sluice / the second system named (Limitador by default, or a variant).
        other = next((s for s in systems if s != "sluice"), None)
        ratio = "sluice" in systems and other is not None
        print(f"\n{workload}")
        print(f"  {'figure':24}" + "".join(f"{s:>12}" for s in systems) +
              (f"   sluice/{other}" if ratio else ""))
        for k, name in keys:
            line = f"  {name:24}" + "".join(f"{mean[s][k]:12.4g}" for s in systems)
            if ratio and mean[other][k]:
                line += f"   {mean['sluice'][k] / mean[other][k]:.3f}x"
            print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()

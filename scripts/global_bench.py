#!/usr/bin/env python3
"""The request path of a global limit (issue 51): p99 and home calls per decision, beside the
same limit on the regional store alone, at the same open-loop load, in one run, alternated.

One regional redis-server, one home redis-server behind a TCP proxy that delays every byte
DELAY ms each way (a round trip of 2 x DELAY), one sluice per variant:
  - plain:  `rate_limit` on the regional store (REDIS_URL), no home store;
  - leased: the same with `leased: {}` (slices from the regional store);
  - global: the same with `global: {}` (slices from the region's pool, refilled from home).
Each round runs `sluice bench --rate RATE --duration D` against each variant in turn; reported
per variant: decisions, p50/p99 (µs), and for global the home store's script calls per
decision (INFO commandstats on the home Redis, which only the global variant reaches). Each
measured run follows one second of the same load (the steady state: a pool idle for 2 s goes
back home, and the first requests after that wait one round trip).

    cargo build --release
    python3 scripts/global_bench.py --delay-ms 75 --rate 2000 --duration 10 --rounds 3

Not part of the test suite: it times things.
"""
import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLUICE = os.path.join(ROOT, "target", "release", "sluice")

CONFIG = """domain: g
descriptors:
  - key: resource
    value: api
{extra}    rate_limit: {{unit: minute, requests_per_unit: 1000000000}}
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(tmp, name):
    port = free_port()
    d = os.path.join(tmp, name)
    os.makedirs(d)
    p = subprocess.Popen(["redis-server", "--port", str(port), "--save", "", "--appendonly", "no",
                          "--dir", d], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(100):
        if subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True).stdout.strip() == b"PONG":
            return p, port
        time.sleep(0.05)
    sys.exit(f"redis {name} did not start")


def delay_proxy(upstream_port, delay_s):
    """A TCP proxy on a free port delaying every chunk `delay_s` each way, in its own thread."""
    port = free_port()

    async def pipe(reader, writer):
        q = asyncio.Queue()

        async def send():
            while True:
                due, data = await q.get()
                if data is None:
                    break
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                writer.write(data)
                await writer.drain()
            writer.close()

        task = asyncio.ensure_future(send())
        while True:
            data = await reader.read(65536)
            if not data:
                break
            q.put_nowait((time.monotonic() + delay_s, data))
        q.put_nowait((0, None))
        await task

    async def handle(cr, cw):
        sr, sw = await asyncio.open_connection("127.0.0.1", upstream_port)
        await asyncio.gather(pipe(cr, sw), pipe(sr, cw), return_exceptions=True)

    def run():
        loop = asyncio.new_event_loop()
        server = loop.run_until_complete(asyncio.start_server(handle, "127.0.0.1", port))
        loop.run_until_complete(server.serve_forever())

    threading.Thread(target=run, daemon=True).start()
    time.sleep(0.2)
    return port


def start_sluice(tmp, name, extra, env_extra):
    d = os.path.join(tmp, f"cfg-{name}")
    os.makedirs(d)
    with open(os.path.join(d, "g.yaml"), "w") as f:
        f.write(CONFIG.format(extra=extra))
    grpc, http = free_port(), free_port()
    env = dict(os.environ, GRPC_HOST="127.0.0.1", GRPC_PORT=str(grpc), HOST="127.0.0.1",
               PORT=str(http), ADMIN_ENABLED="false", LOG_LEVEL="warn", **env_extra)
    p = subprocess.Popen([SLUICE, "serve", "--config", d], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(100):
        try:
            with socket.create_connection(("127.0.0.1", grpc), timeout=0.2):
                return p, grpc
        except OSError:
            time.sleep(0.05)
    sys.exit(f"sluice {name} did not listen")


def home_calls(port):
    out = subprocess.run(["redis-cli", "-p", str(port), "INFO", "commandstats"],
                         capture_output=True, text=True).stdout
    calls = 0
    for line in out.splitlines():
        if line.startswith(("cmdstat_evalsha:", "cmdstat_eval:")):
            calls += int(line.split("calls=")[1].split(",")[0])
    return calls


def bench(grpc, rate, duration):
    out = subprocess.run([SLUICE, "bench", "--json", "--target", f"http://127.0.0.1:{grpc}",
                          "--domain", "g", "--descriptor", "resource=api", "--rate", str(rate),
                          "--duration", f"{duration}s", "--concurrency", "64", "--connections", "4"],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--delay-ms", type=int, default=75, help="one way, home link")
    ap.add_argument("--rate", type=int, default=2000)
    ap.add_argument("--duration", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        try:
            region, region_port = start_redis(tmp, "region")
            home, home_port = start_redis(tmp, "home")
            procs += [region, home]
            link = delay_proxy(home_port, args.delay_ms / 1000)
            store = {"REDIS_URL": f"127.0.0.1:{region_port}"}
            variants = {
                "plain": start_sluice(tmp, "plain", "", store),
                "leased": start_sluice(tmp, "leased", "    leased: {}\n", store),
                "global": start_sluice(tmp, "global", "    global: {}\n",
                                       dict(store, GLOBAL_REDIS_URL=f"127.0.0.1:{link}", REGION="a")),
            }
            procs += [p for p, _ in variants.values()]
            results = {v: [] for v in variants}
            for r in range(args.rounds):
                for name, (_, grpc) in variants.items():
                    # A second of the same load first: an idle pool went home meanwhile (by
                    # design), and its first requests wait one round trip to home; the
                    # measured part is the steady state.
                    bench(grpc, args.rate, 1)
                    before = home_calls(home_port)
                    s = bench(grpc, args.rate, args.duration)
                    s["home_calls"] = home_calls(home_port) - before
                    results[name].append(s)
                    print(f"round {r + 1} {name:6}: {s['decisions']} decisions, ok {s['ok']}, "
                          f"p50 {s['p50_us']} µs, p99 {s['p99_us']} µs, home calls {s['home_calls']}",
                          flush=True)
            print()
            med = lambda xs: sorted(xs)[len(xs) // 2]
            for name, rs in results.items():
                p99 = med([s["p99_us"] for s in rs])
                dec = sum(s["decisions"] for s in rs)
                calls = sum(s["home_calls"] for s in rs)
                print(f"{name:6}: median p99 {p99} µs ({p99 / med([s['p99_us'] for s in results['plain']]):.2f}x plain, "
                      f"{p99 / med([s['p99_us'] for s in results['leased']]):.2f}x leased); "
                      f"home calls per decision {calls / max(dec, 1):.6f}")
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait()


if __name__ == "__main__":
    main()

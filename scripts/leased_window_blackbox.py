#!/usr/bin/env python3
"""Black box check of issue 50's first finding: a leased 20 per 1500 ms limit on one Redis,
three sluice replicas (the optimized binary given as the first argument), six counters each
offered ~30x the limit for 10 s from 18 gRPC clients (Envoy's Python stubs, xds-protos).
Each OK is charged to the epoch-aligned 1500 ms window in which its request was sent and
answered; an answer whose send and receive straddle a boundary is counted as ambiguous and, for
the worst case, charged to both windows. Prints the admitted count per counter and window.

    python3 scripts/leased_window_blackbox.py target/release/sluice

Needs redis-server on PATH and `pip install grpcio xds-protos` (scripts/test.sh installs both).
Not part of the test command: it runs on the wall clock (docs/testing.md).
"""
import collections, os, socket, subprocess, sys, tempfile, threading, time
import grpc
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2 as common

BIN = sys.argv[1]
RULES = os.path.join(tempfile.mkdtemp(), "rules.yaml")
with open(RULES, "w") as f:
    f.write("domain: bb\ndescriptors:\n  - key: tenant\n    leased: {}\n"
            "    rate_limit: {requests_per_unit: 20, period: 1500ms}\n")
def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p
rport = free_port()
redis = subprocess.Popen(["redis-server", "--port", str(rport), "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
time.sleep(0.5)
procs, ports = [], []
for i in range(3):
    gp = free_port()
    env = dict(os.environ, REDIS_URL=f"redis://127.0.0.1:{rport}", GRPC_HOST="127.0.0.1", GRPC_PORT=str(gp),
               HOST="127.0.0.1", PORT=str(free_port()), ADMIN_PORT=str(free_port()), LOG_LEVEL="warn", BACKEND_TYPE="redis")
    procs.append(subprocess.Popen([BIN, "serve", "--config", RULES], env=env, stderr=subprocess.DEVNULL))
    ports.append(gp)
time.sleep(2)
W = 1.5
stop = time.time() + 10
lock = threading.Lock()
certain = collections.Counter()   # (tenant, window) -> admitted
ambiguous = collections.Counter()
sent = collections.Counter()
def worker(tenant, port):
    ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = rls_pb2_grpc.RateLimitServiceStub(ch)
    req = rls_pb2.RateLimitRequest(domain="bb", descriptors=[common.RateLimitDescriptor(entries=[common.RateLimitDescriptor.Entry(key="tenant", value=tenant)])])
    while time.time() < stop:
        t0 = time.time()
        r = stub.ShouldRateLimit(req, timeout=2)
        t1 = time.time()
        w0, w1 = int(t0 // W), int(t1 // W)
        with lock:
            sent[tenant] += 1
            if r.overall_code == 1:
                if w0 == w1: certain[(tenant, w0)] += 1
                else: ambiguous[(tenant, w0)] += 1
threads = [threading.Thread(target=worker, args=(f"t{t}", ports[(t + k) % 3])) for t in range(6) for k in range(3)]
[t.start() for t in threads]; [t.join() for t in threads]
for p in procs: p.terminate()
redis.terminate()
windows = sorted({w for (_, w) in certain} | {w for (_, w) in ambiguous})
full = windows[1:-1]  # windows wholly inside the run
worst = max(certain[(f"t{t}", w)] + ambiguous[(f"t{t}", w)] + ambiguous[(f"t{t}", w - 1)] for t in range(6) for w in full)
over = [(f"t{t}", w, certain[(f"t{t}", w)]) for t in range(6) for w in full if certain[(f"t{t}", w)] > 20]
print(f"offered per counter: {dict(sent)}")
print(f"windows wholly inside: {len(full)} per counter; admitted per counter-window (certain): "
      f"max {max(certain[(f't{t}', w)] for t in range(6) for w in full)}, min {min(certain[(f't{t}', w)] for t in range(6) for w in full)}; "
      f"with every ambiguous answer charged to it: max {worst}; windows over 20: {len(over)} {over[:5]}")

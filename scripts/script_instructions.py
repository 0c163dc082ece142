#!/usr/bin/env python3
"""Instructions redis-server spends per decision in decide.lua, for several revisions of the
script on the SAME calls: a figure that does not drift with the machine.

Why: on these shared 2-core machines Redis CPU per decision (scripts/bench.py) moves by 20-30 %
from round to round, more than the 5 % an A/B of two builds has to resolve. Here the calls are
captured once (MONITOR) from a real `sluice bench` load of the given binary, then replayed with
one fixed clock into a redis-server running under valgrind's callgrind, once per revision's
script, and the server's instructions between the first and the last call are divided by the
decisions the calls carry. The calls differ by nothing but the script text, so the ratio is the
script's cost alone (argument parsing, Lua, the commands it runs, its reply's encoding).

    cargo build --release
    python3 scripts/script_instructions.py --binary target/release/sluice \\
        --workload resource+consumer --revs 9ee8b71,HEAD

What differs from production, the same for every revision: the script's source keeps the
test-only clock line (the fixed clock replaces the TIME call and adds an hour to every TTL),
and the first replay after FLUSHALL creates each counter (SET) where a steady load mostly adds
(INCRBY), so fixed costs weigh more and ratios lean towards 1. Keys are replayed as MONITOR
prints them (printable keys only: the bench's are).

Needs redis-server, valgrind (`apt-get install valgrind`) and git. Not part of the test suite.
Only the packed layout's arguments are the same across revisions since 9ee8b71 (the general
layout's changed), so the captured calls must be packed ones: the bench workloads are.
"""
import argparse
import os
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKLOADS = {
    "resource+consumer": ("bench", ["resource=api,consumer={id}"]),
    "two-descriptors": ("bench2", ["remote_address={id}", "path=/api"]),
}
PARTS = ["head", "window", "log", "bucket", "lease", "call"]


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Resp:
    """A minimal RESP2 client: enough for SCRIPT LOAD, EVALSHA pipelines and MONITOR."""

    def __init__(self, port):
        for _ in range(600):
            try:
                self.sock = socket.create_connection(("127.0.0.1", port))
                break
            except OSError:
                time.sleep(0.1)
        else:
            sys.exit(f"redis-server on {port} did not start")
        self.buf = b""

    def send(self, *args):
        out = [b"*%d\r\n" % len(args)]
        for a in args:
            a = a if isinstance(a, bytes) else str(a).encode()
            out.append(b"$%d\r\n%s\r\n" % (len(a), a))
        self.sock.sendall(b"".join(out))

    def line(self):
        while b"\r\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise EOFError
            self.buf += chunk
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def read(self):
        line = self.line()
        kind, rest = line[:1], line[1:]
        if kind in (b"+", b":"):
            return rest.decode()
        if kind == b"-":
            raise RuntimeError(rest.decode())
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            while len(self.buf) < n + 2:
                chunk = self.sock.recv(65536)
                if not chunk:
                    raise EOFError
                self.buf += chunk
            data, self.buf = self.buf[:n], self.buf[n + 2:]
            return data.decode()
        if kind == b"*":
            return [self.read() for _ in range(int(rest))]
        raise RuntimeError(f"unexpected reply {line!r}")

    def call(self, *args):
        self.send(*args)
        return self.read()


def script_of(rev):
    """decide.lua as revision `rev` loads it (one file before the split, six after), with
    production's default TTL jitter (REDIS_EXPIRATION_JITTER, 300 s: codec.rs sets the
    script's JITTER_MS line the same way in every revision since 9ee8b71)."""
    def show(path):
        return subprocess.run(["git", "-C", ROOT, "show", f"{rev}:{path}"], capture_output=True,
                              text=True)
    one = show("src/store/redis/decide.lua")
    if one.returncode == 0:
        text = one.stdout
    else:
        parts = [show(f"src/store/redis/decide/{p}.lua") for p in PARTS]
        if any(p.returncode for p in parts):
            sys.exit(f"no decide.lua at {rev}")
        text = "".join(p.stdout for p in parts)
    if "local JITTER_MS = 0\n" not in text:
        sys.exit(f"{rev}: no JITTER_MS line to set")
    return text.replace("local JITTER_MS = 0\n", "local JITTER_MS = 300000\n", 1)


def capture(binary, workload, calls):
    """EVALSHA calls of a `sluice bench` load of `binary`, as argument lists after the sha."""
    domain, descriptors = WORKLOADS[workload]
    port, grpc, http = free_port(), free_port(), free_port()
    redis = subprocess.Popen(["redis-server", "--port", str(port), "--save", "", "--appendonly",
                              "no"], stdout=subprocess.DEVNULL)
    env = dict(os.environ, GRPC_HOST="127.0.0.1", GRPC_PORT=str(grpc), HOST="127.0.0.1",
               PORT=str(http), LOG_LEVEL="warn", REDIS_URL=f"127.0.0.1:{port}",
               WORKER_THREADS="1")
    mon = Resp(port)
    server = subprocess.Popen([binary, "serve", "--config",
                               os.path.join(ROOT, "config", "bench", "sluice")], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(1.5)
        mon.sock.settimeout(20)
        mon.call("MONITOR")
        cmd = [binary, "bench", "--target", f"http://127.0.0.1:{grpc}", "--domain", domain,
               "--consumers", "10000", "--concurrency", "64", "--connections", "4",
               "--duration", "2s"]
        for d in descriptors:
            cmd += ["--descriptor", d]
        load = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        out = []
        while len(out) < calls:
            try:
                line = mon.line().decode()
            except OSError:
                sys.exit(f"captured {len(out)} packed calls of {calls}: is the binary serving?")
            i = line.find('"EVALSHA"')
            if i >= 0:
                args = shlex.split(line[i:])[2:]
                if args[2 + int(args[0])] == "p":  # ARGV[2]: the packed layout
                    out.append(args)
        load.wait()
        return out
    finally:
        server.terminate()
        redis.terminate()
        server.wait()
        redis.wait()


def decisions(args):
    """Requests one packed call decides: R follows U's limit and period pairs."""
    argv = args[1 + int(args[0]):]
    return int(argv[3 + 2 * int(argv[2])])


def instructions(script, calls, reps):
    """Instructions of a redis-server under callgrind over `reps` replays of `calls`."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "cg.%p")
        srv = subprocess.Popen(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                                "redis-server", "--port", str(port), "--save", "",
                                "--appendonly", "no"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            r = Resp(port)
            sha = r.call("SCRIPT", "LOAD", script)
            r.call("EVALSHA", sha, *calls[0])
            r.call("FLUSHALL")
            subprocess.run(["callgrind_control", "-z", str(srv.pid)], capture_output=True,
                           check=True)
            for _ in range(reps):
                for k in range(0, len(calls), 64):
                    batch = calls[k:k + 64]
                    for c in batch:
                        r.send("EVALSHA", sha, *c)
                    for _ in batch:
                        r.read()
            subprocess.run(["callgrind_control", "-d", str(srv.pid)], capture_output=True,
                           check=True)
            dumps = [f for f in os.listdir(tmp) if re.fullmatch(r"cg\.\d+\.1", f)]
            if not dumps:
                sys.exit("callgrind wrote no dump")
            for line in open(os.path.join(tmp, dumps[0])):
                if line.startswith(("summary:", "totals:")):
                    return int(line.split()[1])
            sys.exit("no totals in the callgrind dump")
        finally:
            srv.terminate()
            srv.wait()


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--binary", default=os.path.join(ROOT, "target", "release", "sluice"))
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="resource+consumer")
    p.add_argument("--revs", default="9ee8b71,HEAD",
                   help="comma list of git revisions; the first is the baseline of the ratios")
    p.add_argument("--calls", type=int, default=200, help="calls captured and replayed")
    p.add_argument("--reps", type=int, default=2, help="replays of the calls per revision")
    args = p.parse_args()
    calls = capture(args.binary, args.workload, args.calls)
    # One clock for every call (ARGV[1], the override the script's source keeps): no window
    # boundary falls inside one revision's replay and not another's.
    now = str((int(time.time()) // 60 * 60 + 30) * 1_000_000)
    for c in calls:
        c[1 + int(c[0])] = now
    n = sum(decisions(c) for c in calls) * args.reps
    base = None
    print(f"{args.workload}: {len(calls)} packed calls, {n // args.reps} decisions "
          f"({n / args.reps / len(calls):.1f} per call), replayed {args.reps}x")
    for rev in args.revs.split(","):
        per = instructions(script_of(rev), calls, args.reps) / n
        base = base or per
        print(f"  {rev:12} {per:9.0f} instructions/decision  {per / base:.3f}x", flush=True)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""How fast `sluice replay` goes: a decision log of N requests over a simulated day, replayed
against two configs side by side (`--compare`), on the release binary.

The log is generated, not recorded (a day cannot be recorded in a benchmark): requests spread
over 24 h with a daily curve (busy afternoons, quiet nights), consumers drawn from a skewed
distribution (a few heavy, many light), one descriptor `resource=api,consumer=<id>` under
the domain `bench`, answers all marked OK (the replay compares them, whatever they are).

    python3 scripts/replay_bench.py --lines 1000000

prints the seconds the replay took, lines per second, and the replay's own totals.
"""
import argparse
import json
import math
import os
import random
import subprocess
import tempfile
import time

CONFIG = """domain: bench
descriptors:
  - key: resource
    value: api
    descriptors:
      - key: consumer
        rate_limits:
          - {{name: per-consumer, requests_per_unit: {per_minute}, unit: minute}}
          - {{name: sliding, requests_per_unit: {per_hour}, period: 1h, algorithm: sliding_window}}
"""


def generate(path, lines, consumers, seed):
    rng = random.Random(seed)
    day_us = 86_400 * 1_000_000
    start = 1_796_515_200 * 1_000_000  # a midnight, UTC
    # Times: a daily curve, sorted (a log is written in decision order).
    times = []
    while len(times) < lines:
        t = rng.random()
        if rng.random() < 0.35 + 0.65 * math.sin(math.pi * t) ** 2:
            times.append(start + int(t * day_us))
    times.sort()
    weights = [1.0 / (i + 1) ** 1.1 for i in range(consumers)]
    ids = rng.choices(range(consumers), weights=weights, k=lines)
    with open(path, "w") as f:
        for t, c in zip(times, ids):
            f.write(json.dumps({
                "t": t, "domain": "bench",
                "descriptors": [{"entries": [["resource", "api"], ["consumer", f"c{c}"]]}],
                "ok": True,
            }, separators=(",", ":")) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=1_000_000)
    ap.add_argument("--consumers", type=int, default=20_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--bin", default="target/release/sluice")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        log = os.path.join(d, "day.log")
        generate(log, a.lines, a.consumers, a.seed)
        size = os.path.getsize(log)
        cfg_a, cfg_b = os.path.join(d, "a.yaml"), os.path.join(d, "b.yaml")
        with open(cfg_a, "w") as f:
            f.write(CONFIG.format(per_minute=100, per_hour=2000))
        with open(cfg_b, "w") as f:
            f.write(CONFIG.format(per_minute=50, per_hour=1000))
        began = time.monotonic()
        out = subprocess.run(
            [a.bin, "replay", "--log", log, "--compare", cfg_a, cfg_b, "--json",
             "--plot", os.path.join(d, "p.svg")],
            check=True, capture_output=True, text=True)
        took = time.monotonic() - began
        report = json.loads(out.stdout)
        print(f"log: {a.lines} lines over a day, {size / 1e6:.0f} MB, {a.consumers} consumers")
        print(f"replay --compare (2 configs): {took:.1f} s, "
              f"{2 * a.lines / took:,.0f} decisions/s")
        for c in report["configs"]:
            name = os.path.basename(c["config"])
            print(f"  {name}: admitted {c['requests']['admitted']}, "
                  f"denied {c['requests']['denied']}")


if __name__ == "__main__":
    main()

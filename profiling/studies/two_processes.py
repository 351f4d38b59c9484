"""Two gpt2numba processes decoding at once on the same CPUs, with claims on CPUs and without (pool._claim).

    python profiling/studies/two_processes.py [--context 128] [--steps 48] [--rounds 3] [--threads 2]

Each process loads seeded random GPT-2 small, prefills --context tokens, and waits; then both
decode --steps tokens at the same moment, each step timed. Three conditions take turns, each
round after the machine is idle: one process alone; two with claims off
(GPT2NUMBA_CLAIM_DIR=off: both pin their threads to the same CPUs, as every process did before
claims); two with claims on (a directory of their own: the first to run a pass pins, the second
runs unpinned). Printed: each condition's median ms/token over every step of its processes, the
ratio to alone, and where each process's regions ran (pool.describe()).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

from gpt2numba.bench.core import wait_for_idle

WORKER = """
import json, sys, time
import numpy as np
import gpt2numba as g
from gpt2numba import pool
w = g.random_weights(g.GPT2Config(), seed=0)
mc = g.ModelCache(w.config)
g.prefill(np.random.default_rng(0).integers(0, 50257, {context}), w, mc)
g.decode_step(1, w, mc)
print("ready", flush=True)
sys.stdin.readline()
times = []
for i in range({steps}):
    t = time.perf_counter()
    g.decode_step(i, w, mc)
    times.append(time.perf_counter() - t)
print(json.dumps({{"ms": [1e3 * t for t in times], "where": pool.describe()}}), flush=True)
"""


def run(n: int, claims: str, args) -> list[dict]:
    """n processes started together, decoding at the same moment; their step times and describe()."""
    env = {**os.environ, "GPT2NUMBA_CLAIM_DIR": claims, "GPT2NUMBA_THREADS": str(args.threads)}
    script = WORKER.format(context=args.context, steps=args.steps)
    procs = [subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=env) for _ in range(n)]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    out = [json.loads(p.communicate(timeout=600)[0].splitlines()[-1]) for p in procs]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    steps = {"alone": [], "two, claims off": [], "two, claims on": []}
    where = {}
    with tempfile.TemporaryDirectory() as claims:
        conditions = [("alone", 1, "off"), ("two, claims off", 2, "off"), ("two, claims on", 2, claims)]
        for r in range(args.rounds):
            for name, n, directory in (conditions if r % 2 == 0 else conditions[::-1]):
                wait_for_idle()
                results = run(n, directory, args)
                for res in results:
                    steps[name] += res["ms"]
                where[name] = [res["where"] for res in results]
                print(f"round {r + 1} {name}: " + ", ".join(f"{np.median(res['ms']):.1f}" for res in results)
                      + " ms/token", file=sys.stderr, flush=True)
    alone = float(np.median(steps["alone"]))
    print(f"\nGPT-2 small, decode at context {args.context}, {args.threads} threads a process, "
          f"{args.rounds} rounds of {args.steps} steps, medians over every step of every process:")
    for name, times in steps.items():
        med = float(np.median(times))
        print(f"  {name:<16} {med:7.2f} ms/token  {med / alone:5.2f}x alone")
        for w in where[name]:
            print(f"      {w}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

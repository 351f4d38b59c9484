"""Two gpt2numba processes decoding at once on the same CPUs, with claims on CPUs and without (pool._claim).

    python profiling/studies/two_processes.py [--context 128] [--steps 48] [--rounds 3] [--threads 2]
    python profiling/studies/two_processes.py --jobs 6 [--prompt 256] [--steps 16]

Each process loads seeded random GPT-2 small, prefills --context tokens, and waits; then both
decode --steps tokens at the same moment, each step timed. Three conditions take turns, each
round after the machine is idle: one process alone; two with claims off
(GPT2NUMBA_CLAIM_DIR=off: both pin their threads to the same CPUs, as every process did before
claims); two with claims on (a directory of their own: the first to run a pass pins, the second
runs unpinned). Printed: each condition's median ms/token over every step of its processes, the
ratio to alone, and where each process's regions ran (pool.describe()).

With --jobs J, each process instead runs J jobs of a fresh prefill of --prompt tokens and --steps
greedy decode steps (issue 40's workload), and two more conditions join: two processes on Numba's own
threading layer (GPT2NUMBA_POOL=0), and one alone on it. Printed: each condition's throughput, the
jobs per second of its processes summed (each process's J jobs over its wall time), and the ratio to
one alone on the pool.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

from gpt2numba.bench.core import in_turns

WORKER = """
import json, sys, time
import numpy as np
import gpt2numba as g
from gpt2numba.cpu import pool
w = g.random_weights(g.GPT2Config(), seed=0)
mc = g.ModelCache(w.config)
g.prefill(np.random.default_rng(0).integers(0, 50257, {context}), w, mc)
g.decode_step(1, w, mc)
print("ready", flush=True)
sys.stdin.readline()
if {jobs}:
    prompt = np.random.default_rng(1).integers(0, 50257, {prompt})
    t0 = time.perf_counter()
    for _ in range({jobs}):
        mc.reset()
        token = int(np.argmax(g.prefill(prompt, w, mc)))
        for _ in range({steps}):
            token = int(np.argmax(g.decode_step(token, w, mc)))
    print(json.dumps({{"jobs_per_s": {jobs} / (time.perf_counter() - t0), "where": pool.describe()}}), flush=True)
    sys.exit()
times = []
for i in range({steps}):
    t = time.perf_counter()
    g.decode_step(i, w, mc)
    times.append(time.perf_counter() - t)
print(json.dumps({{"ms": [1e3 * t for t in times], "where": pool.describe()}}), flush=True)
"""


def run(n: int, claims: str, args, numba_layer: bool = False) -> list[dict]:
    """n processes started together, working at the same moment; their step times or job rates, and describe()."""
    env = {**os.environ, "GPT2NUMBA_CLAIM_DIR": claims, "GPT2NUMBA_THREADS": str(args.threads)}
    if numba_layer:
        env["GPT2NUMBA_POOL"] = "0"
    script = WORKER.format(context=args.context, steps=args.steps, jobs=args.jobs, prompt=args.prompt)
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
    p.add_argument("--jobs", type=int, default=0, help="run jobs of a prefill and --steps decode steps instead")
    p.add_argument("--prompt", type=int, default=256, help="the jobs' prompt length")
    args = p.parse_args()
    if args.jobs:
        return jobs(args)
    steps = {"alone": [], "two, claims off": [], "two, claims on": []}
    where = {}
    with tempfile.TemporaryDirectory() as claims:
        conditions = [("alone", 1, "off"), ("two, claims off", 2, "off"), ("two, claims on", 2, claims)]
        for r, (name, n, directory) in in_turns(conditions, args.rounds):
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


def jobs(args) -> int:
    """Throughput of --jobs jobs (prefill --prompt, --steps decode steps) per process, per condition."""
    args.context = args.prompt  # the warm-up before the clock: a prefill of the jobs' length
    rates = {"alone": [], "alone, Numba's layer": [], "two, claims off": [], "two, claims on": [],
             "two, Numba's layer": []}
    where = {}
    with tempfile.TemporaryDirectory() as claims:
        conditions = [("alone", 1, "off", False), ("alone, Numba's layer", 1, "off", True),
                      ("two, claims off", 2, "off", False), ("two, claims on", 2, claims, False),
                      ("two, Numba's layer", 2, "off", True)]
        for r, (name, n, directory, numba_layer) in in_turns(conditions, args.rounds):
            results = run(n, directory, args, numba_layer)
            rates[name].append(sum(res["jobs_per_s"] for res in results))
            where[name] = [res["where"] for res in results]
            print(f"round {r + 1} {name}: {rates[name][-1]:.3f} jobs/s", file=sys.stderr, flush=True)
    alone = float(np.median(rates["alone"]))
    print(f"\nGPT-2 small, jobs of a prefill of {args.prompt} tokens and {args.steps} decode steps, "
          f"{args.jobs} a process, {args.threads} threads a process, {args.rounds} rounds, medians:")
    for name, values in rates.items():
        med = float(np.median(values))
        print(f"  {name:<22} {med:6.3f} jobs/s  {med / alone:5.2f}x alone   "
              f"(rounds {', '.join(f'{v:.3f}' for v in values)})")
        for w in where[name]:
            print(f"      {w}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Decode under a cgroup quota of one CPU, beside one thread without a quota (issue 40).

    sudo python profiling/studies/quota.py [--context 128] [--steps 48] [--rounds 5]

Makes a cgroup with a quota of one CPU (v2: cpu.max "100000 100000"; v1: cpu.cfs_quota_us over
cpu.cfs_period_us), so it needs root and a writable cgroup file system, and removes it at the end.
Three conditions take turns, each round after the machine is idle, each a fresh process that
prefills --context tokens of seeded random GPT-2 small and times --steps greedy decode steps:
in the quota, sized as the pool sizes itself (one thread, from the quota); in the quota with two
threads (GPT2NUMBA_THREADS=2: what a pool that did not read the quota would run); and one thread
without a quota. Printed: each condition's mean ms/token over every step (its steps' total time: a
quota throttles a process in whole periods, so a median would hide the steps it stopped), the ratio
to one thread without a quota, the median step, and what pool.describe() said.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

from gpt2numba.bench.core import in_turns

WORKER = """
import json, time
import numpy as np
import gpt2numba as g
from gpt2numba.cpu import pool
w = g.random_weights(g.GPT2Config(), seed=0)
mc = g.ModelCache(w.config)
token = int(np.argmax(g.prefill(np.random.default_rng(0).integers(0, 50257, {context}), w, mc)))
times = []
for _ in range({steps}):
    t = time.perf_counter()
    token = int(np.argmax(g.decode_step(token, w, mc)))
    times.append(time.perf_counter() - t)
print(json.dumps({{"ms": [1e3 * t for t in times], "where": pool.describe()}}), flush=True)
"""


def make_cgroup(name: str) -> tuple[str, str]:
    """A cgroup of one CPU's quota; its directory and the file a pid is written to, to join it."""
    v2 = os.path.exists("/sys/fs/cgroup/cgroup.controllers")
    base = "/sys/fs/cgroup" if v2 else "/sys/fs/cgroup/cpu"
    d = os.path.join(base, name)
    os.makedirs(d, exist_ok=True)
    if v2:
        with open(os.path.join(d, "cpu.max"), "w") as f:
            f.write("100000 100000")
        return d, os.path.join(d, "cgroup.procs")
    with open(os.path.join(d, "cpu.cfs_period_us"), "w") as f:
        f.write("100000")
    with open(os.path.join(d, "cpu.cfs_quota_us"), "w") as f:
        f.write("100000")
    return d, os.path.join(d, "tasks")


def run(args, threads: str | None, join: str | None) -> dict:
    env = {**os.environ, "GPT2NUMBA_CLAIM_DIR": "off"}
    env.pop("GPT2NUMBA_THREADS", None)
    if threads:
        env["GPT2NUMBA_THREADS"] = threads

    def enter():  # in the child, before Python starts: join the cgroup
        if join:
            with open(join, "w") as f:
                f.write(str(os.getpid()))
    out = subprocess.run([sys.executable, "-c", WORKER.format(context=args.context, steps=args.steps)],
                         env=env, preexec_fn=enter, capture_output=True, text=True, timeout=900, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    directory, join = make_cgroup(f"gpt2numba-quota-{os.getpid()}")
    conditions = [("quota 1 CPU, pool's own size", None, join), ("quota 1 CPU, 2 threads", "2", join),
                  ("1 thread, no quota", "1", None)]
    steps = {name: [] for name, _, _ in conditions}
    where = {}
    try:
        for r, (name, threads, into) in in_turns(conditions, args.rounds):
            res = run(args, threads, into)
            steps[name] += res["ms"]
            where[name] = res["where"]
            print(f"round {r + 1} {name}: {np.mean(res['ms']):.2f} ms/token", file=sys.stderr, flush=True)
    finally:
        os.rmdir(directory)
    base = float(np.mean(steps["1 thread, no quota"]))
    print(f"\nGPT-2 small, decode at context {args.context}, {args.rounds} rounds of {args.steps} steps, "
          f"means over every step (quota: {directory}):")
    for name, times in steps.items():
        mean = float(np.mean(times))
        print(f"  {name:<30} {mean:7.2f} ms/token  {mean / base:5.2f}x one thread without quota  "
              f"(median step {np.median(times):.2f} ms)")
        print(f"      {where[name]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

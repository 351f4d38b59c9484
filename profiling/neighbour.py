"""gpt2numba beside a busy process: each workload alone and with a neighbour, alternating.

    python profiling/neighbour.py [--dtypes float32,int8] [--new-tokens 64] [--docs 200] [--repeat 3]

The neighbour is a plain Python busy loop (one core's worth of work), at nice 0 and at
nice 10. For every workload and format, the runs alternate: alone, then beside each
neighbour, --repeat times over, in a rotating order, each after waiting for the machine
to be idle. Printed per row: the median alone, the median beside each neighbour, and the
slowdown (neighbour / alone); and the CPU share that processes other than ours and the
neighbour's took during the runs (a share above a few % means the figures are noisy).

Workloads (GPT-2 small, seeded random weights, 128-token prompts where there are prompts):
  decode     one sequence, --decode-steps decode steps at context 128 (per-token time)
  gen8/gen32 generate_batch of 8 / 32 prompts, --new-tokens greedy tokens, no end-of-text stop
  prefill    prefill of 512 tokens
  score      score_batch of --docs documents of 100-300 tokens
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

import numpy as np

import gpt2numba as g
from gpt2numba.bench import _Load, wait_for_idle

NEIGHBOURS = {"nice 0": 0, "nice 10": 10}
BUSY_LOOP = "while True: pass"


def workloads(w, args):
    """name -> (function that runs it once, what the time is per)."""
    rng = np.random.default_rng(0)
    V = w.config.vocab_size
    prompts = [rng.integers(0, V, 128) for _ in range(32)]
    long_prompt = rng.integers(0, V, 512)
    docs = [rng.integers(0, V, n) for n in rng.integers(100, 301, args.docs)]
    mc = g.ModelCache(w.config, max_len=128 + args.decode_steps)
    long_mc = g.ModelCache(w.config, max_len=512)

    def decode():
        mc.reset()
        g.prefill(prompts[0], w, mc)
        t = time.perf_counter()
        for _ in range(args.decode_steps):
            g.decode_step(1, w, mc)
        return (time.perf_counter() - t) / args.decode_steps

    def generate(n):
        def run():
            list(g.generate_batch(prompts[:n], w, max_new_tokens=args.new_tokens, temperature=0.0,
                                  stop_at_eos=False))
        return run

    def prefill():
        long_mc.reset()
        g.prefill(long_prompt, w, long_mc)

    def score():
        g.score_batch(docs, w)

    return {"decode": (decode, "token"), "gen8": (generate(8), "run"), "gen32": (generate(32), "run"),
            "prefill": (prefill, "run"), "score": (score, "run")}


class Neighbour:
    """A busy loop in its own process at the given nice level, for the duration of a block."""

    def __init__(self, nice):
        self.nice = nice

    def __enter__(self):
        self.proc = None if self.nice is None else subprocess.Popen(
            [sys.executable, "-c", BUSY_LOOP], preexec_fn=lambda: os.nice(self.nice))
        time.sleep(0.2)  # let it reach its loop
        return self

    def __exit__(self, *exc):
        if self.proc:
            self.proc.kill()
            self.proc.wait()


def timed(run):
    """Seconds for one run (or what the run itself returns, e.g. per token)."""
    t = time.perf_counter()
    inner = run()
    return inner if inner is not None else time.perf_counter() - t


def measure(run, repeat):
    """{condition: [seconds]}, alone and beside each neighbour, alternating in a rotating order;
    and the CPU share others took (max over the runs)."""
    conditions = [("alone", None)] + list(NEIGHBOURS.items())
    times = {name: [] for name, _ in conditions}
    others = 0.0
    run()  # warm up: compile or load the kernels, touch the buffers
    for r in range(repeat):
        for name, nice in conditions[r % len(conditions):] + conditions[: r % len(conditions)]:
            wait_for_idle()
            with Neighbour(nice) as n, _Load(*([n.proc.pid] if n.proc else [])) as load:
                times[name].append(timed(run))
            others = max(others, load.share or 0.0)
    return {name: statistics.median(s) for name, s in times.items()}, others


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", default="float32,int8")
    p.add_argument("--workloads", default="decode,gen8,gen32,prefill,score")
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--docs", type=int, default=200)
    p.add_argument("--decode-steps", type=int, default=32)
    args = p.parse_args(argv)
    g.set_threads(args.threads)
    print(f"GPT-2 small (random weights), {args.threads} threads; neighbour: `python -c '{BUSY_LOOP}'`")
    header = f"{'workload':<9} {'dtype':<8} {'per':<6} {'alone':>9}" + "".join(
        f" {name:>9} {'slowdown':>8}" for name in NEIGHBOURS) + f" {'others':>7}"
    print(header)
    for dtype in args.dtypes.split(","):
        w = g.random_weights(g.GPT2Config.small(), seed=0, dtype=dtype)
        table = workloads(w, args)
        for name in args.workloads.split(","):
            run, per = table[name]
            med, others = measure(run, args.repeat)
            unit, scale = ("ms", 1e3) if med["alone"] < 1 else ("s", 1.0)
            cells = "".join(f" {scale * med[n]:>7.2f}{unit:<2} {med[n] / med['alone']:>7.2f}x" for n in NEIGHBOURS)
            print(f"{name:<9} {dtype:<8} {per:<6} {scale * med['alone']:>7.2f}{unit:<2}{cells} {100 * others:>6.1f}%",
                  flush=True)
    print(f"threading layer: {_layer()}")
    return 0


def _layer():
    import numba
    try:
        return numba.threading_layer()
    except ValueError:  # no parallel region has run yet
        return numba.config.THREADING_LAYER


if __name__ == "__main__":
    sys.exit(main())

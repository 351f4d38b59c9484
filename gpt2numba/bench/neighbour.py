"""gpt2numba bench --neighbour: each workload alone and beside a busy process, alternating.

The neighbour is a plain Python busy loop (one core's worth of work) in its own process,
at nice 0 and at nice 10. For every workload and format the runs alternate (alone, then
beside each neighbour, --neighbour-repeat times, in a rotating order), each after waiting
for the machine to be idle. The table gives the median alone, the median beside each
neighbour and the slowdown (neighbour / alone), and the largest CPU share that processes
other than ours and the neighbour's took during a run (above a few %, the figures are noisy).

Workloads (128-token prompts where there are prompts):
  decode   one sequence at context 128: ms per decode step
  gen8     generate_batch of 8 prompts, --neighbour-tokens greedy tokens, no end-of-text stop
  gen32    the same with 32 prompts
  prefill  prefill of 512 tokens
  score    score_batch of --neighbour-docs documents of 100-300 tokens
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

import numpy as np

from .core import Load, wait_for_idle

NEIGHBOURS = {"nice 0": 0, "nice 10": 10}
BUSY_LOOP = "while True: pass"
WORKLOADS = ("decode", "gen8", "gen32", "prefill", "score")


def add_arguments(p) -> None:
    group = p.add_argument_group("neighbour", "gpt2numba bench --neighbour runs this section alone")
    group.add_argument("--neighbour", action="store_true", help="each workload alone and beside a busy loop")
    group.add_argument("--neighbour-workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    group.add_argument("--neighbour-tokens", type=int, default=64, help="new tokens per prompt in gen8 and gen32")
    group.add_argument("--neighbour-docs", type=int, default=200, help="documents in score")
    group.add_argument("--neighbour-steps", type=int, default=32, help="decode steps per run in decode")
    group.add_argument("--neighbour-repeat", type=int, default=3, help="runs per condition (median)")


def run(args, model_dir, w) -> dict:
    import gpt2numba as g

    rows = []
    for dtype in args.dtypes:
        w = g.load_weights(model_dir, dtype=dtype)
        jobs = _workloads(w, args)
        for name in args.neighbour_workloads:
            medians, others = _measure(jobs[name], args.neighbour_repeat)
            rows.append({"workload": name, "dtype": dtype, "seconds": medians, "others": others})
            print(f"  {name} {dtype}: " + ", ".join(f"{k} {v:.4g} s" for k, v in medians.items()),
                  file=sys.stderr, flush=True)
    import numba
    return {"neighbour": rows, "threading_layer": numba.threading_layer(), "busy_loop": BUSY_LOOP}


def print_report(r) -> None:
    print(f"\n{r['model']}, {r['threads']} threads, Numba's {r['threading_layer']} threading layer; "
          f"the neighbour: `python -c '{r['busy_loop']}'`")
    print(f"{'workload':<9} {'dtype':<9} {'alone':>10}" + "".join(f" {n:>10} {'slowdown':>8}" for n in NEIGHBOURS)
          + f" {'others':>7}")
    for row in r["neighbour"]:
        s = row["seconds"]
        unit, scale = ("ms", 1e3) if s["alone"] < 1 else ("s", 1.0)
        cells = "".join(f" {scale * s[n]:>8.2f}{unit:<2} {s[n] / s['alone']:>7.2f}x" for n in NEIGHBOURS)
        print(f"{row['workload']:<9} {row['dtype']:<9} {scale * s['alone']:>8.2f}{unit:<2}{cells} "
              f"{100 * row['others']:>6.1f}%")


def _workloads(w, args) -> dict:
    """name -> a function that runs the workload once and returns its seconds."""
    import gpt2numba as g

    rng = np.random.default_rng(0)
    V, P = w.config.vocab_size, w.config.n_positions  # the lengths shrink to fit a small test model
    context, steps = min(128, P // 2), min(args.neighbour_steps, P // 2)
    tokens = min(args.neighbour_tokens, P - context)
    prompts = [rng.integers(0, V, context) for _ in range(32)]
    long_prompt = rng.integers(0, V, min(512, P))
    docs = [rng.integers(0, V, n) for n in rng.integers(min(100, P), min(300, P) + 1, args.neighbour_docs)]
    short, long = g.ModelCache(w.config, max_len=context + steps), g.ModelCache(w.config, max_len=len(long_prompt))

    def decode():
        short.reset()
        g.prefill(prompts[0], w, short)
        return _seconds(lambda: [g.decode_step(1, w, short) for _ in range(steps)]) / steps

    def generate(n):
        return lambda: _seconds(lambda: list(g.generate_batch(
            prompts[:n], w, max_new_tokens=tokens, temperature=0.0, stop_at_eos=False)))

    def prefill():
        long.reset()
        return _seconds(lambda: g.prefill(long_prompt, w, long))

    return {"decode": decode, "gen8": generate(8), "gen32": generate(32), "prefill": prefill,
            "score": lambda: _seconds(lambda: g.score_batch(docs, w))}


def _seconds(work) -> float:
    t = time.perf_counter()
    work()
    return time.perf_counter() - t


class _Neighbour:
    """A busy loop in its own process at nice ``nice`` (None: no neighbour) for a block."""

    def __init__(self, nice):
        self.nice, self.proc = nice, None

    def __enter__(self):
        if self.nice is not None:
            self.proc = subprocess.Popen([sys.executable, "-c", BUSY_LOOP], preexec_fn=lambda: os.nice(self.nice))
            time.sleep(0.2)  # let it reach its loop
        return self

    def __exit__(self, *exc):
        if self.proc:
            self.proc.kill()
            self.proc.wait()


def _measure(run, repeat: int) -> tuple[dict, float]:
    """Median seconds alone and beside each neighbour, alternating in a rotating order; and the
    largest CPU share that others took during a run."""
    conditions = [("alone", None), *NEIGHBOURS.items()]
    times = {name: [] for name, _ in conditions}
    others = 0.0
    run()  # warm up: load the kernels, touch the buffers
    for r in range(repeat):
        for name, nice in conditions[r % 3:] + conditions[:r % 3]:
            wait_for_idle()
            with _Neighbour(nice) as n, Load(*([n.proc.pid] if n.proc else [])) as load:
                times[name].append(run())
            others = max(others, load.share or 0.0)
    return {name: statistics.median(s) for name, s in times.items()}, others

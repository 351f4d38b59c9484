"""Prefill tokens/s, decode ms/token, and first-call (compile) time against warm time.

    python profiling/speed.py [--model DIR] [--lengths 16 128 512] [--repeat 5] [--steps 32]

GPT-2 small with seeded random weights unless --model is given. Medians over
--repeat runs (prefill) and --steps steps (decode), after one warm-up call.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

import gpt2numba as g

FIRST_CALL = """
import time, numpy as np
t0 = time.perf_counter()
import gpt2numba as g
w = g.random_weights(g.GPT2Config(n_layer=1, n_head=1, n_embd=64, n_positions=16, vocab_size=64))
t1 = time.perf_counter()
mc = g.ModelCache(w.config)
g.prefill([1, 2, 3], w, mc)
g.decode_step(4, w, mc)
print(t1 - t0, time.perf_counter() - t1)
"""


def first_call(cache_dir):
    """(import + tiny weights, first prefill + decode) seconds in a new process."""
    env = {**os.environ, "NUMBA_CACHE_DIR": cache_dir}
    out = subprocess.run([sys.executable, "-c", FIRST_CALL], env=env, capture_output=True, text=True, check=True)
    return [float(s) for s in out.stdout.split()]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model")
    p.add_argument("--lengths", type=int, nargs="+", default=[16, 128, 512])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--context", type=int, default=128, help="prompt length before the decode steps")
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as cache_dir:
        _, cold = first_call(cache_dir)
        _, warm_disk = first_call(cache_dir)
    print(f"first prefill+decode in a new process: {cold:.2f} s compiling, "
          f"{warm_disk:.3f} s with Numba's on-disk cache warm")

    w = g.load_weights(args.model) if args.model else g.random_weights(g.GPT2Config.small(), seed=0)
    rng = np.random.default_rng(0)
    mc = g.ModelCache(w.config)
    g.prefill(rng.integers(0, w.config.vocab_size, 8), w, mc)  # warm-up in this process

    print(f"{'prefill tokens':>15} {'median ms':>10} {'tokens/s':>9}  (min-max ms, {args.repeat} runs)")
    for length in args.lengths:
        ids = rng.integers(0, w.config.vocab_size, length)
        times = []
        for _ in range(args.repeat):
            mc.reset()
            t = time.perf_counter()
            g.prefill(ids, w, mc)
            times.append(time.perf_counter() - t)
        med = np.median(times)
        print(f"{length:>15} {1e3 * med:>10.1f} {length / med:>9.0f}  ({1e3 * min(times):.1f}-{1e3 * max(times):.1f})")

    mc.reset()
    g.prefill(rng.integers(0, w.config.vocab_size, args.context), w, mc)
    token, times = 0, []
    for _ in range(args.steps):
        t = time.perf_counter()
        token = int(np.argmax(g.decode_step(token, w, mc)))
        times.append(time.perf_counter() - t)
    print(f"decode after {args.context} tokens: median {1e3 * np.median(times):.1f} ms/token "
          f"(min {1e3 * min(times):.1f}, max {1e3 * max(times):.1f}, {args.steps} steps)")


if __name__ == "__main__":
    main()

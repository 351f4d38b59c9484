"""Decoding over a history read in place (a fork) beside the same history held in the cache's own arrays.

    python profiling/studies/shared_decode.py [--contexts 128 900] [--batch 8 32] [--steps 32] [--repeat 5]
                                      [--dtype float32] [--kv-dtype float32] [--threads N] [--json out.json]

Seeded random GPT-2 small. For each --contexts C: decode_step on a cache that prefilled C tokens itself
("own") and on a fork of such a cache ("shared": its C rows read in place), --steps steps a run; for each
--batch B: decode_batch of B own caches and of B forks of one cache, at the first context. Then a fork of a
1,000-position cache (the mean of 100 in a row), and a 64-token prefill after a 512-token fork (its rows gathered for BLAS) against the
same on an own cache. Runs alternate own and shared, --repeat times each; before each timed run the script
waits for a quiet machine (bench's wait_for_idle) and reports the other processes' CPU share. Printed: median
ms per step (per prefill, per fork) and shared / own. Run it on two checkouts to compare their own rows.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

import gpt2numba as g
from gpt2numba.model import compact
from gpt2numba.bench.core import Load, set_idle_patience, summary, wait_for_idle


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 900])
    p.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--dtype", default="float32", choices=compact.DTYPES)
    p.add_argument("--kv-dtype", default="float32", choices=g.KV_DTYPES)
    p.add_argument("--threads", type=int)
    p.add_argument("--idle-patience", type=float, default=30.0, help="seconds to wait for a quiet machine a run")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.threads:
        g.set_threads(args.threads)
    set_idle_patience(args.idle_patience)
    cfg = g.GPT2Config.small()
    w = g.random_weights(cfg, seed=0, dtype=args.dtype)
    rng = np.random.default_rng(0)
    report = {"dtype": args.dtype, "kv_dtype": args.kv_dtype, "threads": g.get_threads()}

    def cache(ids, max_len):
        mc = g.ModelCache(cfg, max_len, args.kv_dtype)
        g.prefill(ids, w, mc)
        return mc

    def timed(make, run):
        """Median seconds of run(made) over --repeat runs, each on a fresh make(), after one untimed (compiling)."""
        run(make())
        times = []
        for _ in range(args.repeat):
            made = make()
            wait_for_idle()
            t = time.perf_counter()
            run(made)
            times.append(time.perf_counter() - t)
        return summary(times)["median_ms"]

    def steps(mc):
        for t in range(args.steps):
            g.decode_step(t, w, mc)

    def batch_steps(caches):
        for t in range(args.steps):
            g.decode_batch([t] * len(caches), w, caches)

    with Load() as load:
        for C in args.contexts:
            source = cache(rng.integers(0, cfg.vocab_size, C).tolist(), C + args.steps)
            report[f"decode_{C}"] = _pair(timed(lambda: _owned(source), steps), timed(source.fork, steps), args.steps)
        C = args.contexts[0]
        source = cache(rng.integers(0, cfg.vocab_size, C).tolist(), C + args.steps)
        for B in args.batch:
            report[f"batch_{B}_{C}"] = _pair(timed(lambda: [_owned(source) for _ in range(B)], batch_steps),
                                             timed(lambda: [source.fork() for _ in range(B)], batch_steps), args.steps)
        prompt = cache(rng.integers(0, cfg.vocab_size, 512).tolist(), 576)
        suffix = rng.integers(0, cfg.vocab_size, 64).tolist()
        report["prefill_64_after_512"] = _pair(timed(lambda: _owned(prompt), lambda mc: g.prefill(suffix, w, mc)),
                                               timed(prompt.fork, lambda mc: g.prefill(suffix, w, mc)), 1)
        long = cache(rng.integers(0, cfg.vocab_size, 1000).tolist(), 1024)
        # a fork's time, as the mean of 100 kept in a row: one alone right after wait_for_idle's sleep measured
        # the virtual CPU waking up (0.5-2.7 ms for the same 20 us of work)
        report["fork_1000_ms"] = timed(lambda: None, lambda _: [long.fork() for _ in range(100)]) / 100
    report["others_cpu_share"] = load.share
    _print(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def _owned(source):
    """A cache holding source's rows as copies in its own arrays."""
    mc = g.ModelCache(source.config, source.max_len, source.dtype)
    mc.extend(source.k[:, :, : source.length].copy(), source.v[:, :, : source.length].copy())
    return mc


def _pair(own_ms, shared_ms, steps):
    return {"own_ms": own_ms / steps, "shared_ms": shared_ms / steps, "ratio": shared_ms / own_ms}


def _print(r) -> None:
    print(f"GPT-2 small, {r['dtype']} weights, {r['kv_dtype']} cache, {r['threads']} threads; medians; "
          f"other processes' CPU share {100 * r['others_cpu_share']:.0f}%")
    print(f"{'':<26} {'own':>9} {'shared':>9} {'shared/own':>11}")
    for name, row in r.items():
        if isinstance(row, dict):
            print(f"{name:<26} {row['own_ms']:>7.2f}ms {row['shared_ms']:>7.2f}ms {row['ratio']:>10.2f}x")
    print(f"a fork of a 1000-position cache: {r['fork_1000_ms']:.3f} ms")


if __name__ == "__main__":
    raise SystemExit(main())

"""Decode at one context with each cache dtype, and the memory of many caches (issue 19, "Half the cache memory").

    python profiling/studies/kv_dtype.py [--model DIR] [--dtype int4] [--context 900] [--steps 20] [--repeat 7]
                                 [--kv-dtypes float32 float16 bfloat16] [--caches 64] [--cache-len 1024]
                                 [--threads N] [--json out.json]

Prefills one seeded random prompt of --context tokens into a cache of each kv dtype (seeded random GPT-2
small with its matrices in --dtype, int4 by default, or --model), then times decode steps at that context:
a step feeds one token at position --context, and the cache is cut back to --context positions after it
(copy_prefix onto itself), so every step attends over the same context. The kv dtypes take turns, --steps
steps each a round, for --repeat rounds; printed: each one's median ms/token over every step, and its
ratio to float32's. Then the bytes of --caches caches of --cache-len positions each (ModelCache.nbytes of
one, times --caches: 64 float32 caches of GPT-2 small are 4.8 GB, more than is worth allocating to count).
The machine's load average is printed before and after: the figures mean little on a busy machine.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

import gpt2numba as g
from gpt2numba.model import compact


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a checkpoint (default: seeded random GPT-2 small)")
    p.add_argument("--dtype", default="int4", choices=compact.DTYPES, help="the weights' (default int4)")
    p.add_argument("--context", type=int, default=900, help="positions in the cache at each step (default 900)")
    p.add_argument("--steps", type=int, default=20, help="decode steps per kv dtype per round (default 20)")
    p.add_argument("--repeat", type=int, default=7, help="rounds, the kv dtypes alternating (default 7)")
    p.add_argument("--kv-dtypes", nargs="+", default=list(g.KV_DTYPES), choices=g.KV_DTYPES)
    p.add_argument("--caches", type=int, default=64, help="caches counted for the memory figure (default 64)")
    p.add_argument("--cache-len", type=int, help="their max_len (default n_positions)")
    p.add_argument("--threads", type=int, help="default: the cores")
    p.add_argument("--json", help="write the figures here too")
    args = p.parse_args(argv)
    if args.threads:
        g.set_threads(args.threads)
    w = (g.load_weights(args.model, dtype=args.dtype) if args.model
         else g.random_weights(g.GPT2Config.small(), seed=0, dtype=args.dtype))
    cfg = w.config
    if not 1 <= args.context < cfg.n_positions:
        p.error(f"--context must be in [1, {cfg.n_positions - 1}] (a step needs one more position)")
    load_before = os.getloadavg()
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, cfg.vocab_size, args.context)
    token = int(rng.integers(0, cfg.vocab_size))
    caches, logits = {}, {}
    for kv in args.kv_dtypes:  # prefill each, and one step to compile (or load) its kernels
        caches[kv] = mc = g.ModelCache(cfg, max_len=args.context + 1, dtype=kv)
        g.prefill(prompt, w, mc)
        logits[kv] = g.decode_step(token, w, mc)
        mc.copy_prefix(mc, args.context)

    times = {kv: [] for kv in args.kv_dtypes}  # seconds per step
    for _ in range(args.repeat):
        for kv in args.kv_dtypes:
            mc = caches[kv]
            for _ in range(args.steps):
                t = time.perf_counter()
                g.decode_step(token, w, mc)
                times[kv].append(time.perf_counter() - t)
                mc.copy_prefix(mc, args.context)  # back to the same context
    load_after = os.getloadavg()

    cache_len = args.cache_len or cfg.n_positions
    report = {"weights": w.dtype, "context": args.context, "threads": g.get_threads(),
              "steps": args.steps * args.repeat, "load_before": load_before, "load_after": load_after,
              "decode_ms": {}, "ratio_to_float32": {}, "max_abs_logit_diff_vs_float32": {},
              "caches": args.caches, "cache_len": cache_len, "bytes": {}}
    print(f"GPT-2 {cfg.n_layer} layers, {w.dtype} weights, {g.get_threads()} threads; decode at context "
          f"{args.context}, {args.repeat} rounds x {args.steps} steps per kv dtype, alternating")
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} (1 min)")
    base = np.median(times["float32"]) if "float32" in times else None
    for kv in args.kv_dtypes:
        ms = 1e3 * float(np.median(times[kv]))
        report["decode_ms"][kv] = ms
        line = f"  {kv:<9} decode {ms:7.2f} ms/token (median)"
        if base is not None:
            report["ratio_to_float32"][kv] = ratio = float(np.median(times[kv]) / base)
            diff = float(np.abs(logits[kv] - logits["float32"]).max())
            report["max_abs_logit_diff_vs_float32"][kv] = diff
            line += f", {ratio:.3f}x float32's; max |logits - float32 cache's| {diff:.2e}"
        print(line)
    print(f"{args.caches} caches of {cache_len} positions:")
    for kv in args.kv_dtypes:
        report["bytes"][kv] = n = args.caches * g.ModelCache(cfg, max_len=cache_len, dtype=kv).nbytes
        print(f"  {kv:<9} {n / 2**20:9.1f} MiB" + (f" ({n / report['bytes']['float32']:.2f}x float32's)"
                                                 if "float32" in report["bytes"] else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

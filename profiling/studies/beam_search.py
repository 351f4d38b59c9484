"""Beam search's time, its copying of cache rows and its memory, beside greedy generation of as many rows.

    python profiling/studies/beam_search.py [--prompts 8] [--prompt 128] [--tokens 64] [--beams 4] [--repeat 3]
                                    [--dtype float32] [--threads N] [--idle-patience 120] [--json out.json]

Seeded random GPT-2 small (or --model), seeded prompts of --prompt ids. Alternating, --repeat times each:
beam_search_batch of the --prompts prompts with --beams beams and --tokens new tokens (min_new_tokens =
--tokens: no end-of-text stop), and greedy generate_batch of prompts x beams prompts (the same rows a step)
with stop_at_eos=False. Before each timed run the script waits for a quiet machine (bench's wait_for_idle) and
reports the other processes' CPU share during the runs. Printed: each one's median seconds, their ratio, and
for beam search the time inside ModelCache.copy_prefix (its calls counted and timed by wrapping it), the
rows it gave a beam (read in place, not copied), the bytes of the caches it allocates (prompts x beams caches of prompt + tokens positions),
and the process's peak resident memory after the runs (ru_maxrss, which includes the weights).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import time

import numpy as np

import gpt2numba as g
from gpt2numba.model import compact
from gpt2numba.bench.core import Load, summary, wait_for_idle


class CopyClock:
    """ModelCache.copy_prefix wrapped: its calls, seconds and the rows it gave (read in place since the cache
    shares history; copied before), while installed."""

    def __init__(self):
        self.calls, self.seconds, self.rows = 0, 0.0, 0
        self.original = g.ModelCache.copy_prefix

    def __enter__(self):
        clock = self

        def copy_prefix(mc, src, length=None, *, start=0):
            t = time.perf_counter()
            clock.original(mc, src, length, start=start)
            clock.seconds += time.perf_counter() - t
            clock.calls += 1
            clock.rows += mc.length

        g.ModelCache.copy_prefix = copy_prefix
        return self

    def __exit__(self, *exc):
        g.ModelCache.copy_prefix = self.original


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a checkpoint (default: seeded random GPT-2 small)")
    p.add_argument("--dtype", default="float32", choices=compact.DTYPES)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt", type=int, default=128, help="ids per prompt")
    p.add_argument("--tokens", type=int, default=64, help="new tokens per prompt")
    p.add_argument("--beams", type=int, default=4)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, help="default: the cores")
    p.add_argument("--idle-patience", type=float, default=120, help="seconds to wait for a quiet machine")
    p.add_argument("--json", help="write the figures here too")
    args = p.parse_args(argv)
    if args.threads:
        g.set_threads(args.threads)
    w = (g.load_weights(args.model, dtype=args.dtype) if args.model
         else g.random_weights(g.GPT2Config.small(), seed=0, dtype=args.dtype))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, w.config.vocab_size, args.prompt).tolist() for _ in range(args.prompts)]
    rows = prompts * args.beams

    def beam():
        g.beam_search_batch(prompts, w, num_beams=args.beams, max_new_tokens=args.tokens,
                            min_new_tokens=args.tokens)

    def greedy():
        for _ in g.generate_batch(rows, w, max_new_tokens=args.tokens, temperature=0, stop_at_eos=False):
            pass

    g.beam_search_batch(prompts[:1], w, num_beams=args.beams, max_new_tokens=2)  # compile or load the kernels
    times = {"beam": [], "greedy": []}
    clock = CopyClock()
    with Load() as load:
        for _ in range(args.repeat):
            for name, run in (("beam", beam), ("greedy", greedy)):
                wait_for_idle(patience_s=args.idle_patience)
                with clock if name == "beam" else contextlib.nullcontext():
                    t = time.perf_counter()
                    run()
                    times[name].append(time.perf_counter() - t)
    cache_bytes = args.prompts * args.beams * g.ModelCache(w.config, args.prompt + args.tokens).nbytes
    beam_s, greedy_s = (np.median(times[k]) for k in ("beam", "greedy"))
    report = {"prompts": args.prompts, "prompt": args.prompt, "tokens": args.tokens, "beams": args.beams,
              "weights": w.dtype, "threads": g.get_threads(), "others_cpu": load.share,
              "beam": summary(times["beam"]), "greedy": summary(times["greedy"]),
              "copy": {"calls": clock.calls / args.repeat, "seconds": clock.seconds / args.repeat,
                       "rows": clock.rows / args.repeat, "share": clock.seconds / sum(times["beam"])},
              "cache_bytes": cache_bytes, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    print(f"GPT-2 {w.config.n_layer} layers, {w.dtype} weights, {g.get_threads()} threads; {args.prompts} prompts of "
          f"{args.prompt} ids, {args.tokens} new tokens; medians of {args.repeat} runs, alternating; others' CPU "
          f"{100 * load.share:.1f}%")
    c = report["copy"]
    print(f"{f'beam search, {args.beams} beams':<24} {beam_s:8.2f} s")
    print(f"{f'greedy, {len(rows)} rows':<24} {greedy_s:8.2f} s    beam / greedy {beam_s / greedy_s:.2f}x")
    print(f"{'copy_prefix (shares rows)':<24} {c['seconds']:8.2f} s    {100 * c['share']:.1f}% of the search; "
          f"{c['calls']:.0f} calls, {c['rows']:.0f} rows given a search")
    print(f"{'the search caches':<24} {cache_bytes / 2**20:8.0f} MiB  (the process's peak resident set "
          f"{report['peak_rss_bytes'] / 2**20:.0f} MiB, weights included)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

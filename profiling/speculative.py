"""Speculative decoding's figures: tokens/s against plain greedy decoding, the same tokens, the acceptance rate, and
where a speculative pass's time goes.

    python profiling/speculative.py [--size large | --model DIR] [--prompt 64] [--new 128] [--rounds 3] [--k 4]
                                    [--sections draft,lookup,batch] [--batch 1 2 4 8 16] [--batch-new 48]

On seeded random GPT-2 weights of --size (float32), a --prompt-token random prompt, --new tokens greedy, 2 threads:
- draft: plain greedy decoding against draft="int4" and "int8" with k = --k, and int4 with k adapted;
- lookup: prompt lookup (--k tokens, n-grams up to 2) on a prompt of a --prompt / 2-token passage said twice;
- batch: generate_batch of random prompts of --prompt tokens, --batch-new tokens each, at each size in --batch:
  plain against int4 drafts with k = 2 and --k and prompt lookup (each sequence drafts on its own, the drafts of
  all in one pass of the draft), decoding alone.
The conditions take turns (A B C, C B A, ...), each run after waiting for a quiet machine; medians over --rounds,
with the share of the CPU other processes took. tok/s counts the new tokens over the time from the call to the last
token (prefill included, the same for every condition); then decoding alone, from the first token to the last.
Every run's tokens are checked against plain decoding's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="large", choices=["small", "medium", "large", "xl"])
    parser.add_argument("--model", help="a checkpoint instead of random weights of --size")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sections", default="draft,lookup,batch")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="batch sizes")
    parser.add_argument("--batch-new", type=int, default=48)
    args = parser.parse_args()

    import gpt2numba
    from gpt2numba.bench.core import Load, in_turns, machine
    from gpt2numba.decoding import speculative
    from gpt2numba.decoding.sample import _settings

    gpt2numba.set_threads(args.threads)
    print(machine())
    started = time.perf_counter()
    if args.model:
        w, what = gpt2numba.load_weights(args.model), args.model
    else:
        w, what = gpt2numba.random_weights(getattr(gpt2numba.GPT2Config, args.size)(), seed=0), \
            f"GPT-2 {args.size} random weights (seed 0)"
    cfg = w.config
    print(f"{what}, float32, {w.nbytes / 1e9:.2f} GB, made in {time.perf_counter() - started:.0f} s; "
          f"{args.threads} threads; {args.new} new tokens, greedy")
    rng = np.random.default_rng(1)
    prompts = {"draft": rng.integers(0, cfg.vocab_size, args.prompt).tolist()}
    passage = rng.integers(0, cfg.vocab_size, args.prompt // 2).tolist()
    prompts["lookup"] = passage + passage
    conditions = {"draft": [("plain", {}), ("int4 k=%d" % args.k, {"draft": "int4", "num_speculative_tokens": args.k}),
                            ("int8 k=%d" % args.k, {"draft": "int8", "num_speculative_tokens": args.k}),
                            ("int4 adaptive", {"draft": "int4"})],
                  "lookup": [("plain", {}), ("lookup k=%d" % args.k, {"prompt_lookup_num_tokens": args.k})]}
    conditions["batch"] = [("plain", {}), ("int4 k=2", {"draft": "int4", "num_speculative_tokens": 2}),
                           (f"int4 k={args.k}", {"draft": "int4", "num_speculative_tokens": args.k}),
                           (f"lookup k={args.k}", {"prompt_lookup_num_tokens": args.k})]
    prompts["batch"] = [rng.integers(0, cfg.vocab_size, args.prompt).tolist() for _ in range(max(args.batch))]
    sampler = _settings({"temperature": 0}, cfg.vocab_size, args.new, None)
    for section in args.sections.split(","):
        if section == "batch":
            _batch_section(w, prompts["batch"], conditions["batch"], args, in_turns, Load)
            continue
        ids, runs = prompts[section], conditions[section]
        for _, kw in runs:  # the drafts made (weights' int4 and int8 are kept), every kernel compiled: not timed
            _run(w, ids, 2, sampler, kw, speculative)
        results = {name: [] for name, _ in runs}
        for _, (name, kw) in in_turns(runs, args.rounds):
            with Load() as load:
                results[name].append(_run(w, ids, args.new, sampler, kw, speculative) + (load.share,))
        reference = results["plain"][0][1]
        print(f"\n{section}: prompt {len(ids)} tokens, medians of {args.rounds}")
        _table([(name, statistics.median(r[0] for r in results[name]), results[name][0][2],
                 all(r[1] == reference for r in results[name]), max(r[4] or 0 for r in results[name]))
                for name, _ in runs], statistics.median(r[0] for r in results["plain"]), args.new)
        decode = {name: statistics.median(r[3] for r in results[name]) for name, _ in runs}
        print("decoding alone (after the first token, the prompt's prefill left out): " + ", ".join(
            f"{name} {(args.new - 1) / decode[name]:.2f} tok/s ({decode['plain'] / decode[name]:.2f}x)"
            for name, _ in runs))


def _table(rows, plain, tokens):
    """One line a condition: (name, median seconds, Stats of a run (None: plain), same tokens, others' CPU).
    tokens/pass: a sequence's tokens from a pass that checked its drafts; ms/pass: per pass of the model."""
    print("| condition | tok/s | vs plain | acceptance | tokens/pass | draft ms/pass | verify ms/pass | "
          "choose ms/pass | same tokens | others' CPU |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, seconds, stats, same, others in rows:
        figures = ["-"] * 5
        if stats is not None and stats.rounds:
            per = lambda s: f"{1000 * s / stats.passes:.1f}"  # noqa: E731
            figures = [f"{stats.acceptance:.0%}", f"{(stats.accepted + stats.rounds) / stats.rounds:.2f}",
                       per(stats.draft_seconds), per(stats.verify_seconds), per(stats.choose_seconds)]
        print(f"| {name} | {tokens / seconds:.2f} | {plain / seconds:.2f}x | {' | '.join(figures)} | "
              f"{'yes' if same else 'NO'} | {others:.0%} |")


def _batch_section(w, prompts, runs, args, in_turns, Load):
    """generate_batch's decoding tokens/s, plain and with drafts, at each batch size in --batch, the same tokens
    checked. The drafts run at every size (speculative's max_batch lifted), to show where they stop paying."""
    from gpt2numba.decoding import speculative
    from gpt2numba.decoding.sample import _batch_steps

    def run(some, new, kw):
        started, stats = time.perf_counter(), speculative.Stats()
        steps = _batch_steps(some, w, max_new_tokens=new, temperature=0, stop_at_eos=False, stats=stats, **kw)
        tokens = [[] for _ in some]
        for i, token, *_ in steps:
            tokens[i].append(token)
        return time.perf_counter() - started, tokens, stats

    limits = speculative.DRAFT_MAX_BATCH, speculative.LOOKUP_MAX_BATCH
    speculative.DRAFT_MAX_BATCH = speculative.LOOKUP_MAX_BATCH = max(args.batch)
    try:
        for _, kw in runs:
            run(prompts[:1], 2, kw)
        print(f"\nbatch: prompts of {args.prompt} tokens, {args.batch_new} new tokens each, decoding alone (a run of one "
              f"token each, the prefill, taken off), medians of {args.rounds}; in use today: drafts while at most "
              f"{limits[0]} sequences decode, prompt lookup {limits[1]}")
        print("| sequences | " + " | ".join(name for name, _ in runs) + " | same tokens | others' CPU |")
        print("|---" * (len(runs) + 3) + "|")
        for size in args.batch:
            some, results = prompts[:size], {name: [] for name, _ in runs}
            for _, (name, kw) in in_turns(runs, args.rounds):
                with Load() as load:
                    prefill = run(some, 1, kw)[0]
                    seconds, tokens, stats = run(some, args.batch_new, kw)
                results[name].append((seconds - prefill, tokens, stats, load.share))
            plain = statistics.median(r[0] for r in results["plain"])
            cells = []
            for name, _ in runs:
                seconds = statistics.median(r[0] for r in results[name])
                stats = results[name][0][2]
                kept = f", {stats.acceptance:.0%} kept" if stats.drafted else ""
                cells.append(f"{size * (args.batch_new - 1) / seconds:.1f} ({plain / seconds:.2f}x{kept})")
            same = all(r[1] == results["plain"][0][1] for rows in results.values() for r in rows)
            print(f"| {size} | {' | '.join(cells)} | {'yes' if same else 'NO'} | "
                  f"{max(r[3] or 0 for rows in results.values() for r in rows):.0%} |")
    finally:
        speculative.DRAFT_MAX_BATCH, speculative.LOOKUP_MAX_BATCH = limits


def _run(w, ids, new, sampler, kw, speculative):
    """(seconds, tokens, Stats or None, seconds after the first token) of one greedy generation of ``new`` tokens."""
    from gpt2numba.decoding.sample import _generate

    cache = _cache(w)
    rng = np.random.default_rng(0)
    started = time.perf_counter()
    if kw:
        spec, stats = speculative.plan(w, **kw), speculative.Stats()
        steps = speculative.generate(list(ids), w, cache, sampler, new, rng, False, spec, stats)
    else:
        stats, steps = None, _generate(list(ids), w, cache, sampler, new, rng, False, None)
    tokens, first = [], None
    for token in steps:
        tokens.append(token)
        first = first or time.perf_counter()
    end = time.perf_counter()
    return end - started, tokens, stats, end - first


def _cache(w, kept={}):
    from gpt2numba import ModelCache

    if id(w) not in kept:
        kept[id(w)] = ModelCache(w.config)
    return kept[id(w)]


if __name__ == "__main__":
    main()

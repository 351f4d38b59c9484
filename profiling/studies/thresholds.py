"""The row thresholds in a whole pass: decode_batch's tokens/s at B sequences with this process's thresholds
against other values, in one process, the two taking turns.

    python profiling/studies/thresholds.py --against rows_max=3 bf16_rows_max=7 head_rows_max=10 \
        int_rows_max=10 int4_rows_max=7 [--model DIR] [--dtypes float32 int8] [--batch 1 2 4 8 16 32] [--context 128]

GPT-2 small's seeded random weights (or --model's), 2 threads. For each format and B: B caches filled to --context
positions once; a step under each condition; then --steps decode_batch steps from there under each condition in
turns (A B, B A, ...), each after waiting for a quiet machine. Printed: the median step as tokens/s, and each B's
tokens/s over one sequence's under the same condition. A pass reads the thresholds (cpu/dispatch.py) at call
time, so the conditions differ in them alone; both give the oracle's logits within the tests' tolerance, not the
same bits (a product of a few rows has its tile's order, BLAS its own).
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", nargs="+", required=True, metavar="NAME=ROWS",
                        help="thresholds of the other condition (cpu/tuning.py's TUNABLE names)")
    parser.add_argument("--model", help="a checkpoint (default: seeded random GPT-2 small)")
    parser.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16", "int8", "int4"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--rounds", type=int, default=4, help="(even: each condition first as often)")
    args = parser.parse_args()

    import numpy as np

    import gpt2numba
    from gpt2numba.bench.core import Load, in_turns, machine
    from gpt2numba.cpu import dispatch, tuning

    other = {}
    for item in args.against:
        name, _, rows = item.partition("=")
        other[name] = int(rows)
    tuning.checked(other, "--against")
    names = {name: name.upper() for name in other}  # (dispatch's module constant a pass reads)
    ours = {name: getattr(dispatch, constant) for name, constant in names.items()}

    def use(thresholds):
        for name, rows in thresholds.items():
            setattr(dispatch, names[name], rows)

    conditions = {"these": ours, "against": other}
    gpt2numba.set_threads(2)
    print(machine())
    print(f"these: {ours}\nagainst: {other}\n{args.model or 'GPT-2 small'}, context {args.context}, "
          f"medians of {args.steps} steps and {args.rounds} rounds; tokens/s, and over B = {args.batch[0]}'s under the "
          "same thresholds")
    rng = np.random.default_rng(0)
    for dtype in args.dtypes:
        w = (gpt2numba.load_weights(args.model, dtype=dtype) if args.model
             else gpt2numba.random_weights(gpt2numba.GPT2Config.small(), seed=0, dtype=dtype))
        cfg = w.config
        rates = {c: {} for c in conditions}
        for B in args.batch:
            base = [gpt2numba.ModelCache(cfg, args.context + args.steps) for _ in range(B)]
            gpt2numba.prefill_batch([rng.integers(0, cfg.vocab_size, args.context).tolist() for _ in range(B)],
                                    w, base)
            tokens = rng.integers(0, cfg.vocab_size, B)
            caches = [mc.fork() for mc in base]

            def step():
                """One decode_batch step's seconds, the caches then back at --context positions."""
                t = time.perf_counter()
                gpt2numba.decode_batch(tokens, w, caches)
                seconds = time.perf_counter() - t
                for mc, filled in zip(caches, base):
                    mc.copy_prefix(filled)
                return seconds

            steps = {c: [] for c in conditions}
            shares = []
            for c in conditions:  # (compiled or loaded, buffers touched)
                use(conditions[c])
                step()
            for _, c in in_turns(list(conditions), args.rounds):
                use(conditions[c])
                with Load() as load:
                    times = [step() for _ in range(args.steps)]
                shares.append(load.share or 0.0)
                steps[c].append(statistics.median(times))
            for c in conditions:
                rates[c][B] = B / statistics.median(steps[c])
            ratio = rates["these"][B] / rates["against"][B]
            print(f"{dtype} B={B:2d}: " + "  ".join(
                f"{c} {rates[c][B]:7.1f} tok/s ({rates[c][B] / rates[c][args.batch[0]]:.2f}x)" for c in conditions)
                + f"  these/against {ratio:.2f}; others' CPU {100 * max(shares):.0f}%")


if __name__ == "__main__":
    main()

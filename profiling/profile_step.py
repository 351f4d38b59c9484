"""Where the time of one prefill and one decode step goes, per kernel kind.

    python profiling/profile_step.py [--prompt 512] [--context 128] [--repeat 5] [--dtype int8] [--batch 16]

Wraps each kernel the forward pass calls with a timer (the calls are synchronous,
so wall time per call is the kernel's time), runs the step --repeat times after a
warm-up, and prints the median total per kind in ms and its share. With --batch B, also one
decode_batch step of B sequences, all at --context and then a ragged mix of
contexts 16..900 (seeded): the difference between the two is the extra attention.
"""

import argparse
import collections
import time

import numpy as np

import gpt2numba as g
from gpt2numba import compact, forward


MATRIX_KINDS = {"c_attn_w": "qkv (c_attn)", "attn_c_proj_w": "attn c_proj",
                "c_fc_w": "mlp c_fc", "mlp_c_proj_w": "mlp c_proj"}


def instrument(totals, cfg):
    """Replace forward's kernels with timed wrappers; return a function that undoes it."""
    kinds = {"_layernorm": lambda *a, **k: "layernorm", "_write_kv": lambda *a, **k: "cache write",
             "_attend": lambda *a, **k: "attention", "_gelu": lambda *a, **k: "gelu",
             "_head_logits": lambda *a, **k: "head (wte)",
             "_matmul": lambda x, field, *a, **k: MATRIX_KINDS[field]}
    saved = {name: getattr(forward, name) for name in kinds}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            totals[kinds[name](*args, **kwargs)] += time.perf_counter() - t
            return out
        return wrapper

    for name, fn in saved.items():
        setattr(forward, name, timed(name, fn))
    return lambda: [setattr(forward, name, fn) for name, fn in saved.items()]


def profile(label, step, repeat, cfg):
    runs, walls = [], []
    for i in range(repeat + 1):
        totals = collections.defaultdict(float)
        undo = instrument(totals, cfg)
        t = time.perf_counter()
        try:
            step()
        finally:
            undo()
        if i:  # the first run warms up
            walls.append(time.perf_counter() - t)
            runs.append(totals)
    wall = np.median(walls)
    print(f"\n{label}: median {1e3 * wall:.2f} ms over {repeat} runs")
    rows = {k: np.median([r[k] for r in runs]) for k in runs[0]}
    for kind, sec in sorted(rows.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:<14} {1e3 * sec:8.2f} ms  {100 * sec / wall:5.1f}%")
    rest = wall - sum(rows.values())
    print(f"  {'(python, embed)':<14} {1e3 * rest:8.2f} ms  {100 * rest / wall:5.1f}%")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model")
    p.add_argument("--dtype", default="float32", choices=compact.DTYPES)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--batch", type=int, default=0, help="also a decode step of this many sequences")
    args = p.parse_args()
    w = (g.load_weights(args.model, dtype=args.dtype) if args.model
         else g.random_weights(g.GPT2Config.small(), seed=0, dtype=args.dtype))
    rng = np.random.default_rng(0)
    mc = g.ModelCache(w.config)
    g.prefill(rng.integers(0, w.config.vocab_size, 4), w, mc)  # compile or load the kernels

    prompt = rng.integers(0, w.config.vocab_size, args.prompt)

    def one_prefill():
        mc.reset()
        g.prefill(prompt, w, mc)
    profile(f"prefill of {args.prompt} tokens", one_prefill, args.repeat, w.config)

    mc.reset()
    g.prefill(prompt[: args.context], w, mc)

    def one_decode():
        g.decode_step(1, w, mc)
        mc._length -= 1  # decode the same position again (test-only rewind)
        mc._lengths[:] -= 1
    profile(f"decode step after {args.context} tokens", one_decode, args.repeat, w.config)

    if args.batch:
        top = min(900, w.config.n_positions - 1)
        for label, contexts in [(f"at context {args.context} each", [args.context] * args.batch),
                                (f"at contexts {min(16, top)}..{top} (ragged)",
                                 rng.integers(min(16, top), top + 1, args.batch))]:
            caches = [g.ModelCache(w.config, max_len=int(n) + 1) for n in contexts]
            g.prefill_batch([rng.integers(0, w.config.vocab_size, n) for n in contexts], w, caches)
            print(f"\n(attention over {sum(contexts)} cached positions in all)", end="")

            def one_batch_step():
                g.decode_batch([1] * len(caches), w, caches)
                for mc in caches:  # decode the same positions again (test-only rewind)
                    mc._length -= 1
                    mc._lengths[:] -= 1
            profile(f"decode step of {args.batch} sequences {label}", one_batch_step, args.repeat, w.config)


if __name__ == "__main__":
    main()

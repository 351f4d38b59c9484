"""The decode floor (gpt2numba bench --floor): each format's decode step against the time to read its bytes once.

One decode step of one sequence reads every weight once (the head included, but only one row of wpe), the
integer formats' scales, and every key and value row of the context. Read at this machine's streaming
bandwidth (bench/stream.py over --bandwidth-mib, the best of five passes), those bytes take the floor's
time; no kernel can step faster. The section measures the bandwidth, then, per format in --dtypes, each in its
own worker process and in turns (A B C D A B ...), --floor-repeat runs of a prefill of --floor-context tokens
and --floor-steps greedy decode steps after it; a run's figure is its mean step (the prefill untimed), the
table's the median of the runs. The K/V rows counted are the runs' mean: a step at position p reads p + 1.

Then per kernel: the same steps again in runs of their own, a timer around every kernel a pass calls
(kernels.py), and each kind's bytes (its matrices over the layers, the head's wte, attention's K and V rows)
at the same read rate: the kernel whose /floor stands out is the one off its floor on this CPU.
"""

from __future__ import annotations

import numpy as np

from ..argtypes import COUNT
from .core import (Load, Remote, gpt2numba_system, percent, progress, read_bandwidth, wait_for_idle,
                   weights_format)
from .kernels import decode_bytes


def add_arguments(p) -> None:
    group = p.add_argument_group("floor", "gpt2numba bench --floor runs this section alone")
    group.add_argument("--floor", action="store_true",
                       help="each format's decode step against the time to read its bytes once")
    group.add_argument("--floor-context", type=COUNT, default=128, help="decode after a prompt of this many tokens")
    group.add_argument("--floor-steps", type=COUNT, default=16, help="decode steps per run (their mean)")
    group.add_argument("--floor-repeat", type=COUNT, default=5, help="runs per format (median)")


def run(args, model_dir, w) -> dict:
    """The floor section's figures: {"read_gb_s", "context", "steps", "repeat", "others_cpu" (during the steps),
    "others_cpu_bandwidth" (during the read), "formats": [a row per dtype]}, each row {"dtype",
    "weight_bytes", "kv_bytes", "bytes", "floor_ms", "measured_ms", "ratio", "runs_ms"}."""
    import gpt2numba as g

    cfg = w.config
    if args.floor_context + args.floor_steps > cfg.n_positions:
        raise SystemExit(f"--floor-context {args.floor_context} + --floor-steps {args.floor_steps} exceeds the "
                         f"model's {cfg.n_positions} positions")
    with Load() as bandwidth_load:
        bandwidth = read_bandwidth(args.bandwidth_mib)
    kv_rows = args.floor_context + (args.floor_steps + 1) / 2  # mean over the steps: p + 1 rows at position p
    kv_bytes = kv_rows * g.ModelCache(cfg, max_len=1).position_bytes
    weight_bytes, kind_bytes = {}, {}
    for dtype in args.dtypes:  # one format at a time
        wd = w.astype(*weights_format(dtype))
        weight_bytes[dtype], kind_bytes[dtype] = _weight_bytes(wd), decode_bytes(wd, kv_bytes)
    seconds, kernel_seconds, others = _measure(model_dir, cfg, args)
    rows = []
    for dtype in args.dtypes:
        total = weight_bytes[dtype] + kv_bytes
        floor_ms, measured_ms = 1e3 * total / bandwidth, 1e3 * float(np.median(seconds[dtype]))
        kernels = {kind: float(np.median([run.get(kind, 0.0) for run in kernel_seconds[dtype]]))
                   for kind in kernel_seconds[dtype][0]}
        per_kernel = {kind: {"bytes": b, "floor_ms": 1e3 * b / bandwidth, "measured_ms": 1e3 * kernels[kind],
                             "ratio": kernels[kind] * bandwidth / b} for kind, b in kind_bytes[dtype].items()}
        rows.append({"dtype": dtype, "weight_bytes": weight_bytes[dtype], "kv_bytes": kv_bytes, "bytes": total,
                     "floor_ms": floor_ms, "measured_ms": measured_ms, "ratio": measured_ms / floor_ms,
                     "runs_ms": [1e3 * s for s in seconds[dtype]], "kernels": per_kernel,
                     "other_kernels_ms": {k: 1e3 * v for k, v in kernels.items() if k not in per_kernel}})
    return {"floor": {"read_gb_s": bandwidth / 1e9, "context": args.floor_context, "steps": args.floor_steps,
                      "repeat": args.floor_repeat, "others_cpu": others,
                      "others_cpu_bandwidth": bandwidth_load.share, "formats": rows}}


def _weight_bytes(wd) -> int:
    """Bytes a decode step reads of weights ``wd``: every array and scale but wpe, of which it reads one row."""
    return wd.nbytes - wd.wpe.nbytes + wd.wpe[0].nbytes


def _measure(model_dir, cfg, args):
    """({dtype: [seconds per step of each run]}, {dtype: [{kernel kind: seconds per step} of each run]}, the CPU
    share other processes took during the timed runs)."""
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, args.floor_context)
    job = (ids, args.floor_steps)
    systems = {dtype: Remote(gpt2numba_system, dtype, model_dir, args.threads) for dtype in args.dtypes}
    try:
        for s in systems.values():  # warm-up: compiled, weights paged in
            s.call("decode_steps", job)
        seconds, kernels = {dtype: [] for dtype in systems}, {dtype: [] for dtype in systems}
        wait_for_idle()
        with Load(*(s.process.pid for s in systems.values())) as load:
            for _ in progress(range(args.floor_repeat), "floor"):
                for dtype, s in systems.items():
                    seconds[dtype].append(s.call("decode_steps", job)[1])  # (its mean step: the prefill untimed)
                for dtype, s in systems.items():  # the timers apart, so that the steps above run without them
                    kernels[dtype].append(s.call("decode_kernels", job)[1])
    finally:
        for s in systems.values():
            s.close()
    return seconds, kernels, load.share


def print_report(r):
    f = r["floor"]
    print(f"\ngpt2numba bench --floor: {r['model']}, {r['threads']} threads; read {f['read_gb_s']:.1f} GB/s "
          f"(others took {percent(f['others_cpu_bandwidth'])} of the CPU meanwhile)")
    print(f"decode at context {f['context']}: {f['steps']} steps a run, median of {f['repeat']} runs; floor = bytes "
          "read per step / read rate (weights but wpe, the integer formats' scales, the K/V rows)")
    print(f"\n{'format':<10} {'MB/step':>8} {'floor ms':>9} {'measured ms':>12} {'/floor':>7} {'min-max ms':>15}")
    for row in f["formats"]:
        runs = row["runs_ms"]
        print(f"{row['dtype']:<10} {row['bytes'] / 1e6:>8.1f} {row['floor_ms']:>9.2f} {row['measured_ms']:>12.2f} "
              f"{row['ratio']:>6.2f}x {min(runs):>7.2f}-{max(runs):<7.2f}")
    print(f"(the K/V rows: {f['formats'][0]['kv_bytes'] / 1e6:.1f} MB of each step; other processes took "
          f"{percent(f['others_cpu'])} of the CPU meanwhile)")
    print("\nper kernel: a timer around each kernel of the steps, in runs of their own (medians); floor = the bytes "
          "that kind reads a step / the read rate")
    print(f"{'format':<10} {'kernel':<14} {'MB/step':>8} {'floor ms':>9} {'measured ms':>12} {'/floor':>7}")
    for row in f["formats"]:
        for n, (kind, k) in enumerate(sorted(row["kernels"].items(), key=lambda kv: -kv[1]["ratio"])):
            print(f"{row['dtype'] if n == 0 else '':<10} {kind:<14} {k['bytes'] / 1e6:>8.1f} {k['floor_ms']:>9.2f} "
                  f"{k['measured_ms']:>12.2f} {k['ratio']:>6.2f}x")
        rest = ", ".join(f"{kind} {ms:.2f}" for kind, ms in sorted(row["other_kernels_ms"].items()))
        print(f"{'':<10} (no floor of their own, ms: {rest})")

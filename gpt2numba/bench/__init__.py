"""Benchmark: gpt2numba and Hugging Face transformers on the same weights, beside this machine's floors.

    gpt2numba bench [--model DIR] [--threads 2] [--dtypes float32 bfloat16 int8 int4] [--json bench.json]
    (or python profiling/bench.py)

Prefill time at several prompt lengths, decode ms/token at several contexts, cold
start (a new process from import to the first logits) and peak resident memory
(prefill 512, decode 128); throughput: tokens/s of B sequences decoding together
(decode_batch, against transformers' batched generate), a ragged mix of contexts,
and prefill_batch against one prefill after another. The two systems alternate
run by run (A B A B ...) so drift on a shared machine hits both. The floors come
from this machine in the same run: streaming read bandwidth (decode reads every
weight once per token) and float32 GEMM rate at a GPT-2 shape (prefill is matrix
products; so is a decode step of many sequences). transformers and torch are
optional (pip install -e \".[bench]\"); without them only our figures and the
floors are printed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

from ..argtypes import COUNT, in_range
from ..model.compact import ACTIVATIONS, DTYPES
from . import ct2, floor, llama, neighbour, scoring, standard, throughput
from .core import BF16_ACTIVATIONS, machine, set_idle_patience, wait_for_idle

__all__ = ["main", "wait_for_idle"]


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.activations == "bfloat16":
        args.dtypes = [*args.dtypes, BF16_ACTIVATIONS]
    section = (scoring if args.score else llama if args.llama else ct2 if args.ct2
               else neighbour if args.neighbour else floor if args.floor else standard)
    if args.plot and (section is not standard or args.no_throughput):
        parser.error("--plot draws the throughput section: not with --no-throughput or another section")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot needs matplotlib: pip install -e \".[bench]\"")
    args.lengths = args.lengths or ([128, 512] if args.llama else [16, 128, 512, 1024])
    args.contexts = args.contexts or ([128, 900] if args.llama else [16, 128, 900])

    import gpt2numba as g

    g.set_threads(args.threads)
    set_idle_patience(args.idle_patience)
    report = {"threads": args.threads, "machine": machine()}
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            model_dir = Path(args.model)
        else:
            model_dir = Path(tmp, "gpt2-small-random")
            g.save_weights(g.random_weights(g.GPT2Config.small(), seed=0), model_dir)
        try:
            w = g.load_weights(args.model or model_dir)  # (--model as typed: an error names it so)
        except (g.GPT2NumbaError, OSError) as e:  # on one line, as gpt2numba's other commands say it
            print(f"gpt2numba: error: {e}", file=sys.stderr)
            return 1
        report["model"] = str(args.model or "random GPT-2 small (seed 0)")
        report.update(section.run(args, model_dir, w))
    section.print_report(report)
    if args.plot:
        throughput.plot(report["throughput"], args.plot)
        print(f"\ndrew {args.plot}")
    m = report["machine"]
    print(f"\nmachine: {m['cpu']}, {m['cpus']} CPUs; the integer tiles multiply with {m['integer_tiles']}; "
          f"gpt2numba's use of Intel's matrix tiles (AMX): {m['amx']}\nrow thresholds: {m['thresholds']}")
    return _write(report, args.json)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpt2numba bench", description=__doc__, allow_abbrev=False,  # (as gpt2numba's)
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint directory (default: seeded random GPT-2 small, written to a temp dir)")
    p.add_argument("--threads", type=COUNT, default=2, help="threads each system runs on (default 2)")
    p.add_argument("--idle-patience", type=in_range(float, 0), default=30.0, metavar="SECONDS",
                   help="before each timed block, wait up to this long for a quiet machine (0: do not wait)")
    p.add_argument("--lengths", type=COUNT, nargs="+", help="prompt lengths (default 16 128 512 1024; --llama: 128 512)")
    p.add_argument("--contexts", type=COUNT, nargs="+", help="decode after these (default 16 128 900; --llama: 128 900)")
    p.add_argument("--repeat", type=COUNT, default=5, help="prefill runs per length (median)")
    p.add_argument("--steps", type=COUNT, default=64, help="decode steps per context (median)")
    p.add_argument("--bandwidth-mib", type=COUNT, default=1024, help="array size for the read-bandwidth floor")
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES, help="gpt2numba's weight formats to run")
    p.add_argument("--activations", default="float32", choices=ACTIVATIONS,
                   help="bfloat16: bfloat16 weights run with bfloat16 activations too, as the format "
                   f"{BF16_ACTIVATIONS!r} (beside bfloat16 in --dtypes; docs/formats.md)")
    p.add_argument("--accuracy-prompts", type=COUNT, default=16,
                   help="random prompts for the compact formats' accuracy figures")
    p.add_argument("--batch-sizes", type=COUNT, nargs="+", default=[1, 4, 8, 16, 32, 64],
                   help="sequences decoding together (throughput)")
    p.add_argument("--batch-context", type=COUNT, default=128, help="context of every sequence (throughput)")
    p.add_argument("--batch-steps", type=COUNT, default=16, help="decode_batch steps per batch size (median)")
    p.add_argument("--transformers-max-s", type=in_range(float, 0, low_open=True), default=120.0,
                   help="skip transformers' generate at a batch predicted (from the last one) to take longer")
    p.add_argument("--no-throughput", action="store_true", help="skip the batched (throughput) section")
    p.add_argument("--no-transformers", action="store_true", help="only gpt2numba and the floors")
    p.add_argument("--transformers-dtypes", nargs="+", default=["float32", "bfloat16"], choices=("float32", "bfloat16"),
                   help="transformers' dtypes (default both; bfloat16 multiplies on AVX512_BF16 or Intel's matrix "
                   "tiles where the CPU has them): prefill, decode and --score; throughput, cold start and memory "
                   "run float32")
    p.add_argument("--no-processes", action="store_true", help="skip cold start and peak memory")
    p.add_argument("--json", type=Path, help="write every figure here")
    p.add_argument("--plot", type=Path, metavar="PNG",
                   help="draw the throughput section, tokens/s against sequences per step, here (matplotlib)")
    scoring = p.add_argument_group("scoring", "gpt2numba bench --score runs this section alone (float32)")
    scoring.add_argument("--score", action="store_true", help="the scoring benchmark instead of the above")
    scoring.add_argument("--score-long", type=COUNT, default=4096, metavar="TOKENS", help="the long document")
    scoring.add_argument("--score-stride", type=COUNT, default=512, help="its sliding windows' stride")
    scoring.add_argument("--score-docs", type=COUNT, default=200, metavar="N", help="short documents")
    scoring.add_argument("--score-doc-tokens", type=COUNT, nargs=2, default=[100, 300], metavar=("LOW", "HIGH"),
                         help="their lengths, uniform in [LOW, HIGH]")
    scoring.add_argument("--score-batch", type=COUNT, default=16, help="transformers' documents per padded batch")
    scoring.add_argument("--score-repeat", type=COUNT, default=3, help="runs per workload (median)")
    scoring.add_argument("--ray", action="store_true",
                         help="also the short documents through Ray Data on a local cluster (the [ray] extra)")
    p.add_argument("--llama", action="store_true",
                   help="llama.cpp on GGUF files of the same weights instead of the above (the [peers] extra)")
    ct2.add_arguments(p)
    neighbour.add_arguments(p)
    floor.add_arguments(p)
    return p


def _write(report, path):
    if path:
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {path}")
    return 0


"""Command line: ``gpt2numba check`` (also ``python -m gpt2numba``)."""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from . import kvcache
from .errors import GPT2NumbaError
from .kvcache import ModelCache, decode_step, prefill
from .oracle import recompute_logits
from .weights import load_weights

ATOL, RTOL = 1e-3, 1e-2  # the tolerance the test suite holds cached logits to


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpt2numba", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    check = commands.add_parser(
        "check",
        help="prefill random prompts, decode greedily, compare every logit with the float64 oracle",
        description="Prefill random prompts, decode greedily, and compare every step's logits with "
        "the float64 oracle. Exits 1 on a mismatch.",
    )
    check.add_argument("--model", help="checkpoint directory or .safetensors file "
                       "(default: $GPT2NUMBA_WEIGHTS, else seeded random GPT-2 small)")
    check.add_argument("--prompts", type=_positive, default=3, help="random prompts to try (default 3)")
    check.add_argument("--prompt-len", type=_positive, default=64, help="tokens per prompt (default 64)")
    check.add_argument("--decode", type=_non_negative, default=8, help="greedy steps after each prefill (default 8)")
    check.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    args = parser.parse_args(argv)
    try:
        return _check(args)
    except (GPT2NumbaError, OSError) as e:
        print(f"gpt2numba: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _check(args) -> int:
    t0 = time.perf_counter()
    if args.model:
        w, source = load_weights(args.model), args.model
    else:
        w = kvcache.default_weights()
        source = os.environ.get("GPT2NUMBA_WEIGHTS") or "random GPT-2 small weights (seed 0)"
    cfg = w.config
    print(f"weights: {source}: {cfg.n_layer} layers, {cfg.n_head} heads, n_embd {cfg.n_embd}, "
          f"vocab {cfg.vocab_size}; loaded in {time.perf_counter() - t0:.2f} s")
    if args.prompt_len + args.decode > cfg.n_positions:
        print(f"gpt2numba: error: --prompt-len + --decode = {args.prompt_len + args.decode} "
              f"exceeds n_positions {cfg.n_positions}", file=sys.stderr)
        return 2
    print("(the first prefill and decode include Numba's compilation, or loading it from its cache)")
    rng = np.random.default_rng(args.seed)
    mc = ModelCache(cfg, max_len=args.prompt_len + args.decode)
    worst, failures = 0.0, 0
    for n in range(args.prompts):
        ids = [int(t) for t in rng.integers(0, cfg.vocab_size, args.prompt_len)]
        mc.reset()
        t = time.perf_counter()
        logits = prefill(ids, w, mc)
        prefill_s = time.perf_counter() - t
        diffs, decode_s = [_compare(logits, ids, w)], []
        for _ in range(args.decode):
            ids.append(int(np.argmax(logits)))
            t = time.perf_counter()
            logits = decode_step(ids[-1], w, mc)
            decode_s.append(time.perf_counter() - t)
            diffs.append(_compare(logits, ids, w))
        ok = all(d[1] for d in diffs)
        failures += not ok
        worst = max(worst, *(d[0] for d in diffs))
        decode_ms = f"{1e3 * np.median(decode_s):.1f} ms/token" if decode_s else "-"
        print(f"prompt {n + 1}: {args.prompt_len} tokens + {args.decode} decoded, "
              f"max |cached - oracle| {max(d[0] for d in diffs):.2e} {'ok' if ok else 'MISMATCH'}; "
              f"prefill {args.prompt_len / prefill_s:.0f} tokens/s, decode {decode_ms}")
    print(f"{'all' if not failures else failures} of {args.prompts} prompts "
          f"{'match' if not failures else 'do NOT match'} the oracle "
          f"(allclose atol={ATOL}, rtol={RTOL}, same argmax); worst |diff| {worst:.2e}")
    return 1 if failures else 0


def _compare(logits, ids, w) -> tuple[float, bool]:
    ref = recompute_logits(ids, w)
    ok = np.allclose(logits, ref, atol=ATOL, rtol=RTOL) and logits.argmax() == ref.argmax()
    return float(np.abs(logits - ref).max()), bool(ok)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value

"""llama.cpp beside gpt2numba (gpt2numba bench --llama): the same weights as GGUF files, side by side.

Each of gpt2numba's formats runs against the llama.cpp format of the same size:
float32 / F32, bfloat16 / F16, int8 / Q8_0 and int4 / Q4_0 (llama.cpp's default
Q4_0, which keeps the tied embedding and head in Q6_K; our int4 keeps them in int8). llama.cpp runs in
its own worker process through llama-cpp-python (the optional extra [peers]; it
compiles llama.cpp at install, several minutes on two cores), alternating run by
run with ours. Before any timing, its F32 logits must match ours to 2e-3 (its
GELU is a float16 table, about 1e-3). Accuracy: for each format, max |logit -
our float32 logits| and the share of positions with the same argmax.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from .core import (Remote, decode_runs, dtype_name, gpt2numba_system, peer_settings, prefill_runs,
                   print_peer_settings, system_rows, versus_float32)
from .peers.llama import system

PAIRS = (("float32", "F32"), ("bfloat16", "F16"), ("int8", "Q8_0"), ("int4", "Q4_0"))
SAME_MODEL_ATOL = 2e-3


def run(args, model_dir, w) -> dict:
    """The llama.cpp section's figures: {"same_model", "accuracy", "prefill", "decode"}."""
    from ..integrations.gguf_export import write_gguf

    report = {"notes": []}
    with tempfile.TemporaryDirectory() as tmp:
        files = {fmt: write_gguf(w, Path(tmp, f"gpt2-{fmt}.gguf"), fmt) for _, fmt in PAIRS}
        mine = [Remote(gpt2numba_system, dtype, model_dir, args.threads) for dtype, _ in PAIRS]
        theirs = [Remote(system, f"llama.cpp {fmt}", files[fmt], args.threads) for _, fmt in PAIRS]
        systems = [*mine, *theirs]
        try:
            if theirs[0].version is None:
                raise SystemExit("llama-cpp-python is not installed: pip install -e \".[peers]\"")
            report["llama_cpp"] = theirs[0].version
            report["peers"] = peer_settings(theirs)
            report["same_model"], report["accuracy"] = _accuracy(systems, w, args)
            if report["same_model"] > SAME_MODEL_ATOL:
                raise SystemExit(f"llama.cpp's F32 logits differ from ours by {report['same_model']:.1e} > "
                                 f"{SAME_MODEL_ATOL}: the GGUF is not the same model")
            report["prefill"] = prefill_runs(systems, w, args)
            report["decode"] = decode_runs(systems, w, args)
        finally:
            for remote in systems:
                remote.close()
    return report


def _accuracy(systems, w, args):
    """(max |llama.cpp F32 - our float32| logits, and per system: max |logit - our float32|, same argmax share)."""
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, w.config.vocab_size, 32) for _ in range(args.accuracy_prompts)]
    logits = {s.name: [s.call("prefill", ids, logits=True)[2] for ids in prompts] for s in systems}
    reference = logits[dtype_name("float32")]
    accuracy = {name: versus_float32(rows, reference) for name, rows in logits.items()}
    return accuracy["llama.cpp F32"]["max_abs_diff_vs_float32"], accuracy


def print_report(r):
    print(f"\ngpt2numba bench --llama: {r['model']}, {r['threads']} threads; against {r['llama_cpp']}")
    print(f"same model: max |llama.cpp F32 - gpt2numba float32| logits {r['same_model']:.1e} "
          f"(<= {SAME_MODEL_ATOL}; llama.cpp's GELU is a float16 table)")
    columns = [("prefill", T, f"prefill {T}") for T in r["prefill"]] + [("decode", c, f"decode@{c}")
                                                                         for c in r["decode"]]
    print(f"\n{'pair':<18} {'system':<20} " + " ".join(f"{label:>12}" for *_, label in columns)
          + f" {'max|d logit|':>12} {'argmax':>7}")
    for dtype, fmt in PAIRS:
        for name in (dtype_name(dtype), f"llama.cpp {fmt}"):
            a = r["accuracy"][name]
            print(f"{dtype + ' / ' + fmt:<18} {name:<20} "
                  + " ".join(f"{_ms(r[kind], key, name):>12}" for kind, key, _ in columns)
                  + f" {a['max_abs_diff_vs_float32']:>12.2e} {100 * a['argmax_agreement_with_float32']:>6.0f}%")
    print("(ms, medians; prefill: the whole prompt; decode: per token after that many; accuracy against "
          "gpt2numba float32 on the same weights and prompts)")
    print_peer_settings(r.get("peers", {}))


def _ms(rows, key, name):
    stats = dict(system_rows(rows[key])).get(name)
    return f"{stats['median_ms']:.1f}" if stats else "-"

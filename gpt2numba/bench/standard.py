"""The standard run (gpt2numba bench): each of gpt2numba's formats against transformers on the same weights,
beside this machine's floors. Prefill at several prompt lengths, decode ms/token at several contexts, the
compact formats' accuracy, throughput (throughput.py), cold start and peak resident memory."""

from __future__ import annotations

import os
import sys
import tempfile

import numpy as np

from . import throughput
from .core import (GEMM_SHAPE, PEAK_RSS, WORKER, Remote, decode_runs, dtype_name, gpt2numba_system, make_spec,
                   measure_floors, peer_settings, percent, prefill_runs, print_peer_settings, run_script, start_peer,
                   system_rows, versus, versus_float32, wait_for_idle, weights_format)
from .peers import transformers

BF16_PEER = transformers.BF16


def run(args, model_dir, w) -> dict:
    """The standard run's figures: floors, accuracy, transformers, prefill, decode, throughput, cold_start,
    peak_rss_mb (as the options leave them)."""
    import gpt2numba as g

    report = {}
    stored = {dtype: w.astype(*weights_format(dtype)) for dtype in dict.fromkeys(("float32", *args.dtypes))}
    report["floors"] = floors = measure_floors(stored, args)
    if not args.no_throughput:
        floors.update(throughput.gemm_floors(w.config, args))
    if set(args.dtypes) - {"float32"}:
        report["accuracy"] = _accuracy(g, stored, args)
    # Each system in its own process: two thread pools in one process fight for the
    # cores (each spins while the other works) and slow both several-fold.
    mine = [Remote(gpt2numba_system, dtype, model_dir, args.threads) for dtype in args.dtypes]
    peers = start_transformers(model_dir, args)
    theirs = next((r for r in peers if r.name == "transformers"), None)  # float32: throughput, cold start, memory
    report["transformers"] = peers[0].version if peers else None
    report["transformers_kinds"] = [r.name for r in peers]
    systems = [*mine, *peers]
    try:
        if peers:
            report["peers"] = peer_settings(peers)
        report["prefill"] = prefill_runs(systems, w, args)
        report["decode"] = decode_runs(systems, w, args)
        if not args.no_throughput:
            report["throughput"] = throughput.run(mine, theirs, w, floors, args)
    finally:
        for remote in systems:
            remote.close()
    if theirs and report["prefill"]:
        report["plain_process"] = _plain_process(model_dir, report["prefill"], args)
    if not args.no_processes:
        report["cold_start"] = _cold_start(model_dir, theirs is not None)
        report["peak_rss_mb"] = _peak_rss(model_dir, theirs is not None, w.config, args.dtypes)
    return report


def start_transformers(model_dir, args) -> list:
    """transformers in each of args.transformers_dtypes (torch's float32 and bfloat16), each a Remote of its
    own; none when --no-transformers or when torch or transformers is not installed (which it says)."""
    kinds = [] if args.no_transformers else [kind for kind, dtype in transformers.KINDS.items()
                                             if dtype in args.transformers_dtypes]
    peers = [r for r in (start_peer(transformers.system, kind, model_dir, args.threads) for kind in kinds) if r]
    if kinds and not peers:
        print("transformers or torch is not installed: printing gpt2numba and the floors only "
              "(pip install -e \".[bench]\")", file=sys.stderr)
    return peers


def _accuracy(g, stored, args):
    """Compact formats against the oracle on their own values, and against the float32 model."""
    w = stored["float32"]
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, w.config.vocab_size, 32) for _ in range(args.accuracy_prompts)]
    f32 = [g.prefill(ids, w, g.ModelCache(w.config, max_len=32)) for ids in prompts]
    result = {}
    for dtype in args.dtypes:
        if dtype == "float32":
            continue
        wc = stored[dtype]
        logits = [g.prefill(ids, wc, g.ModelCache(w.config, max_len=32)) for ids in prompts]
        values = wc.dequantized() if wc.activations == "float32" else wc  # once, not in every oracle call (the
        # oracle rounds bfloat16 activations' inputs: it needs them as they are)
        oracle = [g.recompute_logits(ids, values) for ids in prompts[:4]]  # float64 is slow: four
        result[dtype] = {
            "max_abs_diff_vs_oracle": max(float(np.abs(a - b).max()) for a, b in zip(logits, oracle)),
            **versus_float32(logits, f32), "prompts": len(prompts),
        }
    return result


# --- new processes: the self-check, cold start and peak memory ------------------------------------

PLAIN_LENGTH = 128  # the prompt length the self-check measures transformers at in a plain process
PLAIN_PROCESSES = 3  # plain processes, the median of theirs: one process's median moves by about 10% (GPT-2 small)
TRUSTED = 1.2  # the bench's figure for a peer may be at most this many times its plain processes'

_THEIRS_PLAIN = """
import runpy, sys, time
import numpy as np
model_dir, worker, spec, threads, T, repeat = sys.argv[1:7]
system, _, _ = runpy.run_path(worker)["load"](spec)("transformers", model_dir, int(threads))
ids = np.random.default_rng(0).integers(0, system.model.config.vocab_size, int(T))
system.prefill(ids)
times = []
for _ in range(int(repeat)):
    t = time.perf_counter()
    system.prefill(ids)
    times.append(time.perf_counter() - t)
print(1e3 * float(np.median(times)))
"""


def _plain_process(model_dir, prefill, args) -> dict:
    """transformers' prefill in processes that only run it (no worker, no pipe, no gpt2numba), against the
    bench's figure at the same length: the bench's own measurement, checked once."""
    T = PLAIN_LENGTH if PLAIN_LENGTH in prefill else min(prefill)
    spec, _ = make_spec(transformers.system)
    runs = []
    for _ in range(PLAIN_PROCESSES):
        wait_for_idle()
        runs.append(run_script(_THEIRS_PLAIN, model_dir, WORKER, spec, str(args.threads), str(T), str(args.repeat),
                               peer=True))
    plain = float(np.median(runs))
    bench = prefill[T]["transformers"]["median_ms"]
    return {"tokens": T, "plain_ms": plain, "bench_ms": bench, "ratio": bench / plain}


_OURS_FIRST = """
import time; t0 = time.perf_counter()
import sys, gpt2numba as g
w = g.load_weights(sys.argv[1])
g.prefill([1, 2, 3], w, g.ModelCache(w.config))
print(time.perf_counter() - t0)
"""

_THEIRS_FIRST = """
import time; t0 = time.perf_counter()
import sys, torch, transformers
transformers.logging.set_verbosity_error()
torch.set_num_threads(2)
m = transformers.GPT2LMHeadModel.from_pretrained(sys.argv[1]).eval()
with torch.inference_mode():
    m(torch.tensor([[1, 2, 3]]))
print(time.perf_counter() - t0)
"""

_OURS_RSS = """
import sys, numpy as np, gpt2numba as g
w = g.load_weights(sys.argv[1], dtype=sys.argv[2], activations=sys.argv[3]); mc = g.ModelCache(w.config)
ids = np.random.default_rng(0).integers(0, w.config.vocab_size, 512)
token = int(g.prefill(ids, w, mc).argmax())
for _ in range(128):
    token = int(g.decode_step(token, w, mc).argmax())
print(peak_rss_mb())
"""

_THEIRS_RSS = """
import sys, numpy as np, torch, transformers
transformers.logging.set_verbosity_error()
torch.set_num_threads(2)
m = transformers.GPT2LMHeadModel.from_pretrained(sys.argv[1]).eval()
ids = torch.as_tensor(np.random.default_rng(0).integers(0, m.config.vocab_size, 512)[None])
with torch.inference_mode():
    out = m(ids, use_cache=True)
    for _ in range(128):
        out = m(out.logits[:, -1:].argmax(-1), past_key_values=out.past_key_values, use_cache=True)
print(peak_rss_mb())
"""


def _cold_start(model_dir, with_theirs):
    wait_for_idle()
    result = {}
    with tempfile.TemporaryDirectory() as numba_cache:
        empty = {"NUMBA_CACHE_DIR": numba_cache}
        result["gpt2numba_compiling_s"] = run_script(_OURS_FIRST, model_dir, env=empty)
        result["gpt2numba_warm_cache_s"] = run_script(_OURS_FIRST, model_dir, env=empty)
    if with_theirs:
        run_script(_THEIRS_FIRST, model_dir, peer=True)  # let the OS cache torch's libraries, as ours are
        result["transformers_s"] = run_script(_THEIRS_FIRST, model_dir, peer=True)
    return result


def _peak_rss(model_dir, with_theirs, cfg, dtypes):
    if cfg.n_positions < 640 or not os.path.exists("/proc/self/status"):
        return {}
    result = {dtype_name(d): run_script(PEAK_RSS + _OURS_RSS, model_dir, *weights_format(d)) for d in dtypes}
    if with_theirs:
        result["transformers"] = run_script(PEAK_RSS + _THEIRS_RSS, model_dir, peer=True)
    return result


# --- the table ----------------------------------------------------------------------------------------

def print_report(r):
    floors = r["floors"]
    theirs = r["transformers"]
    print(f"\ngpt2numba bench: {r['model']}, {r['threads']} threads"
          + (f"; against {theirs}: {', '.join(r.get('transformers_kinds', ['transformers']))}" if theirs else ""))
    print(f"floors: read {floors['read_gb_s']:.1f} GB/s, GEMM {floors['gemm_gflop_s']:.0f} GFLOP/s at "
          f"{'x'.join(map(str, GEMM_SHAPE))}; decode floor = weight bytes / read rate")
    print(f"\n{'prefill':>7}  {'system':<22} {'median ms':>9} {'tok/s':>6} {'/floor':>7} {'vs transformers':>15}"
          f"{'vs tf-bf16':>13}  {'min-max ms':>15} {'others':>6}")
    for T, row in r["prefill"].items():
        for name, o in system_rows(row):
            print(f"{T:>7}  {name:<22} {o['median_ms']:>9.1f} {1e3 * T / o['median_ms']:>6.0f} "
                  f"{o['median_ms'] / floors['prefill_floor_ms'][T]:>6.2f}x {versus(row, name):>15}"
                  f"{versus(row, name, BF16_PEER):>13}  {o['min_ms']:>7.1f}-{o['max_ms']:<7.1f} "
                  f"{percent(row['others_cpu']):>6}")
        if "max_abs_logit_diff" in row:
            print(f"{'':>9}|gpt2numba - transformers| logits: {row['max_abs_logit_diff']:.1e}")
    print(f"\n{'decode':>7}  {'system':<22} {'ms/token':>9} {'floor':>6} {'/floor':>7} {'vs transformers':>15}"
          f"{'vs tf-bf16':>13}  {'min-max ms':>15} {'others':>6}")
    for context, row in r["decode"].items():
        for name, o in system_rows(row):
            floor = floors["decode_floor_ms"][name]
            print(f"{context:>7}  {name:<22} {o['median_ms']:>9.2f} {floor:>6.1f} {o['median_ms'] / floor:>6.2f}x "
                  f"{versus(row, name):>15}{versus(row, name, BF16_PEER):>13}  {o['min_ms']:>7.2f}-{o['max_ms']:<7.2f} "
                  f"{percent(row['others_cpu']):>6}")
        if "same_greedy_tokens" in row:
            print(f"{'':>9}same greedy tokens as transformers: {row['same_greedy_tokens']}")
    if "plain_process" in r:
        p = r["plain_process"]
        verdict = "within" if p["ratio"] <= TRUSTED else "OUTSIDE"
        print(f"{'':>9}self-check: transformers' prefill {p['tokens']} in plain processes {p['plain_ms']:.1f} ms, "
              f"in the bench {p['bench_ms']:.1f} ms ({p['ratio']:.2f}x, {verdict} {TRUSTED}x)")
    print_peer_settings(r.get("peers", {}))
    if "throughput" in r:
        throughput.print_report(r["throughput"], floors)
    if r.get("accuracy"):
        print()
    for dtype, a in r.get("accuracy", {}).items():
        print(f"accuracy {dtype} ({a['prompts']} prompts of 32 tokens): max |logit - oracle on the same "
              f"values| {a['max_abs_diff_vs_oracle']:.1e}; max |logit - float32 model| "
              f"{a['max_abs_diff_vs_float32']:.2e}, same argmax as float32 {100 * a['argmax_agreement_with_float32']:.0f}%")
    if "cold_start" in r:
        c = r["cold_start"]
        print(f"\ncold start, new process to first logits: gpt2numba {c['gpt2numba_warm_cache_s']:.2f} s with "
              f"Numba's cache warm, {c['gpt2numba_compiling_s']:.2f} s compiling"
              + (f"; transformers {c['transformers_s']:.2f} s" if "transformers_s" in c else ""))
    if r.get("peak_rss_mb"):
        m = r["peak_rss_mb"]
        print("peak RSS, prefill 512 + decode 128: " + ", ".join(f"{k} {v:.0f} MB" for k, v in m.items()))


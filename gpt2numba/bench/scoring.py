"""The scoring benchmark (gpt2numba bench --score): tokens/s of score and score_batch against transformers.

Two workloads on the same random weights, float32 both sides: one long document in
sliding windows (Hugging Face's guide, model(input_ids, labels=...) per window) and
many short documents (transformers: padded batches with an attention mask). The
systems alternate run by run in their own processes, as in the rest of the
benchmark. Also: what the head costs against the blocks, peak memory, and with
--ray the overhead of the same short documents through Ray Data on a local cluster.
"""

from __future__ import annotations

import pickle
import tempfile
import time
from pathlib import Path

import numpy as np

from .core import (PEAK_RSS, WORKER, Remote, alternate, dtype_name, gpt2numba_system, make_spec, peer_settings,
                   percent, prefill_flops, print_peer_settings, progress, run_script, summary,
                   wait_for_idle)
from .peers import transformers
from .standard import start_transformers


def run(args, model_dir, w) -> dict:
    """The scoring section's figures: {"long", "docs", "head", "peak_rss_mb", "ray"} (some may be absent)."""
    cfg = w.config
    low, high = args.score_doc_tokens
    if not 2 <= low <= high <= cfg.n_positions:
        raise SystemExit(f"--score-doc-tokens must be 2 <= LOW <= HIGH <= {cfg.n_positions} (n_positions): "
                         "transformers scores a short document in one window")
    if not 1 <= args.score_stride <= cfg.n_positions:
        raise SystemExit(f"--score-stride must be in [1, {cfg.n_positions}] (n_positions)")
    long_ids, docs = _workload(cfg.vocab_size, args)
    report = {"long": {"tokens": args.score_long, "stride": args.score_stride},
              "docs": {"documents": len(docs), "doc_tokens": [low, high], "transformers_batch": args.score_batch}}

    mine = Remote(gpt2numba_system, "float32", model_dir, args.threads)
    peers = start_transformers(model_dir, args)
    report["transformers"] = peers[0].version if peers else None
    report["transformers_kinds"] = [r.name for r in peers]
    systems = [mine, *peers]
    try:
        report["peers"] = peer_settings(peers)
        jobs = {s.name: _jobs(s.name, long_ids, docs, args) for s in systems}
        for section, method in progress((("long", "score_long"), ("docs", "score_docs")), "scoring"):
            job = {name: jobs[name][method] for name in jobs}
            report[section].update(_alternate(systems, method, job, args.score_repeat))
        report["head"] = _head_cost(mine, w, args)
    finally:
        for remote in systems:
            remote.close()
    if not args.no_processes:
        with_theirs = "transformers" in report["transformers_kinds"]  # (float32's)
        report["peak_rss_mb"] = _peak_rss(model_dir, args, long_ids, docs, with_theirs)
    if args.ray:
        report["ray"] = _ray_overhead(model_dir, w, docs, args)
    return report


def _workload(vocab_size: int, args):
    """(the long document's ids, the short documents' ids): seeded, the same in every process."""
    rng = np.random.default_rng(6)
    low, high = args.score_doc_tokens
    long_ids = rng.integers(0, vocab_size, args.score_long)
    return long_ids, [rng.integers(0, vocab_size, n) for n in rng.integers(low, high + 1, args.score_docs)]


def _jobs(name, long_ids, docs, args) -> dict:
    """What each scoring method of the system ``name`` takes: transformers batches the short documents."""
    return {"score_long": (long_ids, args.score_stride),
            "score_docs": (docs, args.score_batch) if name.startswith("transformers") else docs}


def _alternate(systems, method, job, repeat):
    """Each system's tokens/s at method(job), runs alternating; and how far their NLLs are apart."""
    first, times, others = alternate(systems, method, job, repeat)  # first: (tokens, nlls) by name
    result = {"others_cpu": others}
    for s in systems:
        tokens, nlls = first[s.name]
        result[s.name] = {**summary(times[s.name]), "scored": tokens, "nll": float(sum(nlls))}
        result[s.name]["tok_s"] = 1e3 * tokens / result[s.name]["median_ms"]
    if "transformers" in first:
        ours, theirs = (np.array(first[name][1]) for name in (dtype_name("float32"), "transformers"))
        result["same_tokens_scored"] = first["transformers"][0] == first[dtype_name("float32")][0]
        result["max_rel_nll_diff"] = float(np.max(np.abs(ours - theirs) / np.abs(theirs)))
    return result


def _head_cost(ours, w, args):
    """One full window: prefill (the head on the last row only) against score (the fused log-softmax on every
    row). The difference is what the head costs; beside it, the head's share of the multiply-adds."""
    cfg = w.config
    T = cfg.n_positions
    ids = np.random.default_rng(8).integers(0, cfg.vocab_size, T)
    ours.call("score_long", (ids, T))
    times = {"blocks": [], "scoring": []}
    wait_for_idle()
    for _ in range(args.score_repeat):
        times["blocks"].append(ours.call("prefill", ids)[0])
        times["scoring"].append(ours.call("score_long", (ids, T))[0])
    head_flops = 2 * T * cfg.n_embd * cfg.vocab_size
    blocks_flops = prefill_flops(cfg, T) - 2 * cfg.n_embd * cfg.vocab_size  # without prefill's one head row
    blocks, scoring = (float(np.median(t)) for t in times.values())
    return {"window": T, "blocks_ms": 1e3 * blocks, "head_ms": 1e3 * (scoring - blocks),
            "head_gflop": head_flops / 1e9, "blocks_gflop": blocks_flops / 1e9}


_SCORE_RSS = """
import pickle, runpy, sys
model_dir, worker, spec, kind, threads, jobs = sys.argv[1:7]
make = runpy.run_path(worker)["load"](spec)  # (worker.py's loader: a peer's file by its path)
system, _, _ = make(kind, model_dir, int(threads))
with open(jobs, "rb") as f:
    jobs = pickle.load(f)
system.score_long(jobs["score_long"])
system.score_docs(jobs["score_docs"])
print(peak_rss_mb())
"""


def _peak_rss(model_dir, args, long_ids, docs, with_theirs):
    """Peak RSS (MB) of a new process that scores both workloads, for each system (transformers' a process
    that never imports gpt2numba)."""
    systems = {dtype_name("float32"): (gpt2numba_system, "float32")}
    if with_theirs:
        systems["transformers"] = (transformers.system, "transformers")
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (make, kind) in systems.items():
            jobs = Path(tmp, "jobs.pickle")
            jobs.write_bytes(pickle.dumps(_jobs(name, long_ids, docs, args)))
            spec, peer = make_spec(make)
            result[name] = run_script(PEAK_RSS + _SCORE_RSS, model_dir, WORKER, spec, kind, str(args.threads),
                                      str(jobs), peer=peer)
    return result


def _ray_overhead(model_dir, w, docs, args):
    """The short documents as text, scored in this process and through Ray Data on a new local cluster of
    --threads CPUs (one worker of --threads threads: the same cores), the cluster's start apart."""
    import ray

    from ..integrations.distributed import score_dataset
    from ..text.scoring import score_batch
    from ..text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    texts = [tokenizer.decode(ids) for ids in docs]
    score_batch([tokenizer.encode(texts[0])], w)  # warm-up: Numba's cache loads on the first call
    wait_for_idle()
    t = time.perf_counter()
    in_process = score_batch([tokenizer.encode(text) for text in texts], w)
    in_process_s = time.perf_counter() - t

    t = time.perf_counter()
    ray.init(num_cpus=args.threads, include_dashboard=False, log_to_driver=False)
    try:
        start_s = time.perf_counter() - t
        ray.data.DataContext.get_current().enable_progress_bars = False
        runs = {}
        # all documents twice (the first starts Ray's worker processes), then one document: what a job
        # pays whatever its size (scheduling, and a worker that imports gpt2numba and loads the weights)
        for label, items in (("first", texts), ("all", texts), ("one", texts[:1])):
            ds = ray.data.from_items([{"text": text} for text in items])
            t = time.perf_counter()
            rows = score_dataset(ds, str(model_dir), threads_per_worker=args.threads, concurrency=1).take_all()
            runs[label] = time.perf_counter() - t
            if label == "all":
                nll = {row["text"]: row["nll"] for row in rows}
    finally:
        ray.shutdown()
    return {"documents": len(texts), "tokens": sum(s.n_tokens for s in in_process), "in_process_s": in_process_s,
            "cluster_start_s": start_s, "first_run_s": runs["first"], "one_document_s": runs["one"],
            "ray_s": runs["all"],
            "max_rel_nll_diff": max(abs(nll[text] - s.nll) / abs(s.nll) for text, s in zip(texts, in_process))}


def print_report(r):
    theirs = r["transformers"]
    print(f"\ngpt2numba bench --score: {r['model']}, {r['threads']} threads, float32"
          + (f"; against {theirs}: {', '.join(r.get('transformers_kinds', ['transformers']))}" if theirs else ""))
    long, docs = r["long"], r["docs"]
    print(f"\n{'workload':<34} {'system':<17} {'median s':>8} {'tok/s':>7} {'vs transformers':>15} "
          f"{'min-max s':>13} {'others':>6}")
    for label, row in ((f"1 x {long['tokens']} tokens, stride {long['stride']}", long),
                       (f"{docs['documents']} docs of {docs['doc_tokens'][0]}-{docs['doc_tokens'][1]} tokens", docs)):
        ours = row[dtype_name("float32")]
        for name, o in ((name, o) for name, o in row.items() if isinstance(o, dict)):
            versus = f"{o['tok_s'] / row['transformers']['tok_s']:.2f}x" if "transformers" in row else ""
            print(f"{label:<34} {name:<17} {o['median_ms'] / 1e3:>8.2f} {o['tok_s']:>7.0f} "
                  f"{versus if o is ours else '':>15} {o['min_ms'] / 1e3:>6.2f}-{o['max_ms'] / 1e3:<6.2f} "
                  f"{percent(row['others_cpu']):>6}")
            label = ""
        if "max_rel_nll_diff" in row:
            print(f"{'':<35}tokens scored: {ours['scored']} both"
                  if row["same_tokens_scored"] else f"{'':<35}tokens scored DIFFER", end="; ")
            print(f"max relative |NLL difference| {row['max_rel_nll_diff']:.1e}")
    print(f"(transformers batches {docs['transformers_batch']} documents, sorted by length, right-padded)")
    h = r["head"]
    share = h["head_gflop"] / (h["head_gflop"] + h["blocks_gflop"])
    print(f"\nhead, one window of {h['window']} tokens: {h['head_ms']:.0f} ms of {h['head_ms'] + h['blocks_ms']:.0f} "
          f"({h['head_ms'] / (h['head_ms'] + h['blocks_ms']):.0%}); {h['head_gflop']:.0f} of "
          f"{h['head_gflop'] + h['blocks_gflop']:.0f} GFLOP ({share:.0%}); blocks {h['blocks_ms']:.0f} ms")
    print_peer_settings(r.get("peers", {}))
    if r.get("peak_rss_mb"):
        print("peak RSS, both workloads in a new process: "
              + ", ".join(f"{k} {v:.0f} MB" for k, v in r["peak_rss_mb"].items()))
    if "ray" in r:
        y = r["ray"]
        print(f"\nRay Data, local cluster of {r['threads']} CPUs, one worker of {r['threads']} threads, "
              f"{y['documents']} documents as text ({y['tokens']} tokens): in-process {y['in_process_s']:.2f} s, "
              f"Ray {y['ray_s']:.2f} s ({y['ray_s'] / y['in_process_s']:.2f}x; "
              f"the first job {y['first_run_s']:.2f} s); "
              f"a job of one document takes {y['one_document_s']:.2f} s (the worker's start); the cluster's start "
              f"{y['cluster_start_s']:.1f} s; max relative |NLL difference| {y['max_rel_nll_diff']:.1e}")

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
optional (pip install 'gpt2numba[bench]'); without them only our figures and the
floors are printed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from .compact import DTYPES

GEMM_SHAPE = (512, 768, 3072)  # (tokens, n_embd, 4 n_embd): GPT-2 small's c_fc at 512 tokens
RAGGED_BATCH, RAGGED_CONTEXTS = 16, (16, 900)  # the ragged mix: 16 sequences, contexts uniform in [16, 900]
PREFILL_BATCH = 8  # prompts of --batch-context tokens: one prefill_batch against one prefill after another


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpt2numba bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint directory (default: seeded random GPT-2 small, written to a temp dir)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lengths", type=int, nargs="+", help="prompt lengths (default 16 128 512 1024; --llama: 128 512)")
    p.add_argument("--contexts", type=int, nargs="+", help="decode after these (default 16 128 900; --llama: 128 900)")
    p.add_argument("--repeat", type=int, default=5, help="prefill runs per length (median)")
    p.add_argument("--steps", type=int, default=64, help="decode steps per context (median)")
    p.add_argument("--bandwidth-mib", type=int, default=1024, help="array size for the read-bandwidth floor")
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES, help="gpt2numba's weight formats to run")
    p.add_argument("--accuracy-prompts", type=int, default=16,
                   help="random prompts for the compact formats' accuracy figures")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64],
                   help="sequences decoding together (throughput)")
    p.add_argument("--batch-context", type=int, default=128, help="context of every sequence (throughput)")
    p.add_argument("--batch-steps", type=int, default=16, help="decode_batch steps per batch size (median)")
    p.add_argument("--transformers-max-s", type=float, default=120.0,
                   help="skip transformers' generate at a batch predicted (from the last one) to take longer")
    p.add_argument("--no-throughput", action="store_true", help="skip the batched (throughput) section")
    p.add_argument("--no-transformers", action="store_true", help="only gpt2numba and the floors")
    p.add_argument("--no-processes", action="store_true", help="skip cold start and peak memory")
    p.add_argument("--json", type=Path, help="write every figure here")
    scoring = p.add_argument_group("scoring", "gpt2numba bench --score runs this section alone (float32)")
    scoring.add_argument("--score", action="store_true", help="the scoring benchmark instead of the above")
    scoring.add_argument("--score-long", type=int, default=4096, metavar="TOKENS", help="the long document")
    scoring.add_argument("--score-stride", type=int, default=512, help="its sliding windows' stride")
    scoring.add_argument("--score-docs", type=int, default=200, metavar="N", help="short documents")
    scoring.add_argument("--score-doc-tokens", type=int, nargs=2, default=[100, 300], metavar=("LOW", "HIGH"),
                         help="their lengths, uniform in [LOW, HIGH]")
    scoring.add_argument("--score-batch", type=int, default=16, help="transformers' documents per padded batch")
    scoring.add_argument("--score-repeat", type=int, default=3, help="runs per workload (median)")
    scoring.add_argument("--ray", action="store_true",
                         help="also the short documents through Ray Data on a local cluster (the [ray] extra)")
    p.add_argument("--llama", action="store_true",
                   help="llama.cpp on GGUF files of the same weights instead of the above (the [peers] extra)")
    args = p.parse_args(argv)
    args.lengths = args.lengths or ([128, 512] if args.llama else [16, 128, 512, 1024])
    args.contexts = args.contexts or ([128, 900] if args.llama else [16, 128, 900])

    import gpt2numba as g

    g.set_threads(args.threads)
    report = {"threads": args.threads, "machine": _machine()}
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            model_dir = Path(args.model)
        else:
            model_dir = Path(tmp, "gpt2-small-random")
            g.save_weights(g.random_weights(g.GPT2Config.small(), seed=0), model_dir)
        w = g.load_weights(model_dir)
        report["model"] = str(args.model or "random GPT-2 small (seed 0)")
        for flag, section in (("score", "bench_score"), ("llama", "bench_llama")):
            if getattr(args, flag):
                module = importlib.import_module(f".{section}", __package__)
                report.update(module.run(args, model_dir, w))
                module.print_report(report)
                return _write(report, args.json)
        stored = {dtype: w.astype(dtype) for dtype in dict.fromkeys(("float32", *args.dtypes))}
        report["floors"] = floors = _floors(stored, args)
        if set(args.dtypes) - {"float32"}:
            report["accuracy"] = _accuracy(g, stored, args)
        # Each system in its own process: two thread pools in one process fight for the
        # cores (each spins while the other works) and slow both several-fold.
        ours = [_Remote(dtype, model_dir, args.threads) for dtype in args.dtypes]
        theirs = None if args.no_transformers else _Remote("transformers", model_dir, args.threads)
        if theirs and theirs.version is None:
            print("transformers or torch is not installed: printing gpt2numba and the floors only "
                  "(pip install 'gpt2numba[bench]')", file=sys.stderr)
            theirs.close()
            theirs = None
        report["transformers"] = theirs.version if theirs else None
        systems = [*ours, *([theirs] if theirs else [])]
        try:
            report["prefill"] = _prefill_runs(systems, w, args)
            report["decode"] = _decode_runs(systems, w, args)
            if not args.no_throughput:
                report["throughput"] = _throughput_runs(ours, theirs, w, floors, args)
        finally:
            for remote in systems:
                remote.close()
        if not args.no_processes:
            report["cold_start"] = _cold_start(model_dir, theirs is not None)
            report["peak_rss_mb"] = _peak_rss(model_dir, theirs is not None, w.config, args.dtypes)
    _print(report, floors)
    return _write(report, args.json)


def _write(report, path):
    if path:
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {path}")
    return 0


# --- the two systems, behind the same three calls -------------------------------------------------

class _Ours:
    def __init__(self, g, w):
        self.g, self.w = g, w
        self.name = _name(w.dtype)
        self.mc = g.ModelCache(w.config)
        self.caches = []  # the batch's, one per sequence

    def prefill(self, ids):
        self.mc.reset()
        return self.g.prefill(ids, self.w, self.mc)

    def decode(self, token):
        return self.g.decode_step(token, self.w, self.mc)

    def batch_caches(self, max_lens):
        """New caches for a batch, each just long enough: 64 of 1024 positions would be 4.8 GB."""
        self.caches = []  # the old ones go first
        self.caches = [self.g.ModelCache(self.w.config, max_len=n) for n in max_lens]

    def prefill_batch(self, prompts):
        for mc in self.caches:
            mc.reset()
        return self.g.prefill_batch(prompts, self.w, self.caches)  # (B, vocab)

    def prefill_each(self, prompts):
        """The same prompts one prefill after another: what prefill_batch saves."""
        for mc in self.caches:
            mc.reset()
        return np.stack([self.g.prefill(ids, self.w, mc) for ids, mc in zip(prompts, self.caches)])

    def decode_batch(self, tokens):
        return self.g.decode_batch(tokens, self.w, self.caches)  # (B, vocab)

    def score_long(self, job):
        """One long document in sliding windows: (tokens scored, [nll])."""
        ids, stride = job
        s = self.g.score(ids, self.w, stride=stride)
        return s.n_tokens, [s.nll]

    def score_docs(self, docs):
        """Many short documents: (tokens scored, nll per document)."""
        scores = self.g.score_batch(docs, self.w)
        return sum(s.n_tokens for s in scores), [s.nll for s in scores]


class _Theirs:
    name = "transformers"

    def __init__(self, torch, model, version):
        self.torch, self.model, self.version = torch, model, version
        self.past = None

    def prefill(self, ids):
        with self.torch.inference_mode():
            out = self.model(self.torch.as_tensor(np.asarray(ids)[None]), use_cache=True)
        self.past = out.past_key_values
        return out.logits[0, -1].numpy()

    def decode(self, token):
        with self.torch.inference_mode():
            out = self.model(self.torch.tensor([[token]]), past_key_values=self.past, use_cache=True)
        self.past = out.past_key_values
        return out.logits[0, -1].numpy()

    def generate(self, batch):
        """Batched greedy generate, as its users run it: {"tokens": (B, new) ids, "put_s": when each came}."""
        ids, mask, new_tokens = batch  # (B, T) int64 left-padded, (B, T) 1 where a prompt is, int
        clock = _Clock()
        out = self.model.generate(self.torch.as_tensor(ids), attention_mask=self.torch.as_tensor(mask),
                                  do_sample=False, use_cache=True, max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, pad_token_id=0, streamer=clock)
        return {"tokens": out[:, ids.shape[1]:].tolist(), "put_s": clock.times}

    def score_long(self, job):
        """Hugging Face's guide "Perplexity of fixed-length models": model(input_ids, labels=...) per window,
        labels -100 on the tokens an earlier window scored. Returns (tokens scored, [nll])."""
        torch = self.torch
        ids, stride = job
        ids = torch.as_tensor(np.asarray(ids))[None]  # (1, L)
        L, n = ids.shape[1], self.model.config.n_positions
        nll, count, prev_end = 0.0, 0, 0
        with torch.inference_mode():
            for begin in range(0, L, stride):
                end = min(begin + n, L)
                input_ids = ids[:, begin:end]
                labels = input_ids.clone()
                labels[:, :-(end - prev_end)] = -100
                loss = self.model(input_ids, labels=labels).loss  # the mean over the shifted valid labels
                scored = int((labels[:, 1:] != -100).sum())
                nll, count, prev_end = nll + float(loss) * scored, count + scored, end
                if end == L:
                    break
        return count, [nll]

    def score_docs(self, job):
        """Short documents in padded batches with an attention mask, sorted by length (less padding), as
        evaluation code does. Per-document NLLs need per-token losses, so the logits are scored with
        cross_entropy(reduction="none"), the same work as labels=. Returns (tokens scored, nll per document)."""
        torch = self.torch
        docs, batch = job
        order = sorted(range(len(docs)), key=lambda i: len(docs[i]))
        nlls = [0.0] * len(docs)
        with torch.inference_mode():
            for start in range(0, len(docs), batch):
                group = order[start:start + batch]
                T = max(len(docs[i]) for i in group)
                ids = torch.zeros((len(group), T), dtype=torch.long)  # (B, T), right-padded: positions stay 0..
                labels = torch.full((len(group), T), -100, dtype=torch.long)  # (B, T), -100 on padding
                for b, i in enumerate(group):
                    ids[b, :len(docs[i])] = labels[b, :len(docs[i])] = torch.as_tensor(docs[i])
                logits = self.model(ids, attention_mask=(labels != -100).long()).logits  # (B, T, vocab)
                losses = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:],
                                                           reduction="none")  # (B, T - 1), 0 on padding
                for b, i in enumerate(group):
                    nlls[i] = float(losses[b].sum())
        return sum(len(d) - 1 for d in docs), nlls


class _Clock:
    """A streamer for generate (put/end, as transformers' BaseStreamer) that notes when each put comes:
    the first with the prompt, then one per new token, so the gaps after the second are decode steps."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def _transformers(model_dir, threads):
    try:
        import torch
        import transformers
    except ImportError:
        return None
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(threads)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    model = transformers.GPT2LMHeadModel.from_pretrained(str(model_dir)).eval()
    return _Theirs(torch, model, f"transformers {transformers.__version__}, torch {torch.__version__}")


class _Remote:
    """One system in a worker process; call() runs one prefill or decode there and times it."""

    def __init__(self, kind, model_dir, threads):
        """kind: a gpt2numba dtype, or "transformers"."""
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(kind, str(model_dir), threads, child), daemon=True)
        self.process.start()
        self.name, self.version = self.conn.recv()

    def call(self, method, arg, logits=False):
        """(seconds, greedy, logits or None) of system.method(arg), timed in the worker.

        greedy: the argmax of each row of logits, an int for (vocab,) and a list for (B, vocab);
        a method that returns no logits has its result here instead.
        """
        time.sleep(0.02)  # let the other process's threads stop spinning
        self.conn.send((method, arg, logits))
        reply = self.conn.recv()
        if isinstance(reply, str):
            raise RuntimeError(f"{self.name} failed: {reply}")
        return reply

    def close(self):
        self.conn.send(None)
        self.process.join(timeout=30)


def _system(kind, model_dir, threads):
    """(system, name, version) for kind: a gpt2numba dtype, "transformers", or "llama.cpp FMT" (model_dir:
    a GGUF file); system and version are None when that peer is not installed."""
    if kind == "transformers":
        system = _transformers(model_dir, threads)
        return system, "transformers", system.version if system else None
    if kind.startswith("llama.cpp "):
        from .bench_llama import _llama

        system = _llama(kind, model_dir, threads)
        return system, kind, system.version if system else None
    import gpt2numba as g

    g.set_threads(threads)
    system = _Ours(g, g.load_weights(model_dir, dtype=kind))
    return system, system.name, "gpt2numba"


def _serve(kind, model_dir, threads, conn):
    system, name, version = _system(kind, model_dir, threads)
    conn.send((name, version))
    while (msg := conn.recv()) is not None:
        method, arg, want_logits = msg
        try:
            t = time.perf_counter()
            out = getattr(system, method)(arg)
            seconds = time.perf_counter() - t
            greedy = out.argmax(-1).tolist() if isinstance(out, np.ndarray) else out
            conn.send((seconds, greedy, out if want_logits else None))
        except Exception as e:  # reported to the parent, which stops the run
            conn.send(f"{type(e).__name__}: {e}")


# --- the machine's floors ---------------------------------------------------------------------------

def _floors(stored, args):
    """stored: dtype -> the weights in that format."""
    from .kernels import _stream_sum

    wait_for_idle()
    a = np.ones(args.bandwidth_mib * 2**20 // 4, np.float32)
    _stream_sum(a)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        _stream_sum(a)
        times.append(time.perf_counter() - t)
    bandwidth = a.nbytes / min(times)  # the best pass: what the memory can do
    del a
    gemm = _gemm_rate(*GEMM_SHAPE, args.threads)
    cfg = stored["float32"].config
    # decode reads every matrix once, the output head included, but only one row of wpe
    decode_bytes = {_name(d): wd.nbytes - wd.wpe.nbytes for d, wd in stored.items()}
    decode_bytes["transformers"] = decode_bytes[_name("float32")]
    floors = {"read_gb_s": bandwidth / 1e9, "gemm_gflop_s": gemm / 1e9, "decode_bytes": decode_bytes,
              "decode_floor_ms": {k: 1e3 * b / bandwidth for k, b in decode_bytes.items()},
              "prefill_floor_ms": {T: 1e3 * _prefill_flops(cfg, T) / gemm for T in args.lengths}}
    if not args.no_throughput:
        # B rows through c_fc's shape: small M is a skinny product, far below the 512-row rate. Two
        # BLAS threads on two busy cores run a skinny product tens of times slower: wait for quiet.
        wait_for_idle()
        floors["batch_gemm_shape"] = (cfg.n_embd, 4 * cfg.n_embd)
        floors["batch_gemm_gflop_s"] = {B: _gemm_rate(B, cfg.n_embd, 4 * cfg.n_embd, args.threads) / 1e9
                                        for B in sorted({*args.batch_sizes, RAGGED_BATCH})}
    return floors


def _gemm_rate(M, K, N, threads):
    """FLOP/s of the best of ten float32 (M, K) @ (K, N) products, BLAS on ``threads`` threads."""
    from threadpoolctl import threadpool_limits

    x, b, out = np.ones((M, K), np.float32), np.ones((K, N), np.float32), np.empty((M, N), np.float32)
    with threadpool_limits(threads, user_api="blas"):
        np.matmul(x, b, out=out)
        times = []
        for _ in range(10):
            t = time.perf_counter()
            np.matmul(x, b, out=out)
            times.append(time.perf_counter() - t)
    return 2 * M * K * N / min(times)


def _name(dtype):
    return "gpt2numba" if dtype == "float32" else f"gpt2numba {dtype}"


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
        values = wc.dequantized()  # once, not in every oracle call
        oracle = [g.recompute_logits(ids, values) for ids in prompts[:4]]  # float64 is slow: four
        result[dtype] = {
            "max_abs_diff_vs_oracle": max(float(np.abs(a - b).max()) for a, b in zip(logits, oracle)),
            **_versus_float32(logits, f32), "prompts": len(prompts),
        }
    return result


def _versus_float32(logits, f32) -> dict:
    """How far each row of logits is from the float32 model's for the same prompt: the largest |difference|,
    and the share of prompts with the same argmax."""
    return {"max_abs_diff_vs_float32": max(float(np.abs(a - b).max()) for a, b in zip(logits, f32)),
            "argmax_agreement_with_float32": float(np.mean([a.argmax() == b.argmax() for a, b in zip(logits, f32)]))}


def _prefill_flops(cfg, T):
    """Multiply-adds x 2 of a T-token prefill: the blocks' matrices, attention, one row of the head."""
    C, L = cfg.n_embd, cfg.n_layer
    matrices = 2 * T * L * (C * 3 * C + C * C + 2 * C * 4 * C)
    attention = 2 * 2 * L * C * T * (T + 1) / 2  # scores and weighted values over the causal triangle
    return matrices + attention + 2 * cfg.vocab_size * C


# --- alternating runs --------------------------------------------------------------------------------

def _progress(items, what):
    """A progress bar on stderr over ``items`` (the benchmark takes minutes)."""
    from tqdm import tqdm

    return tqdm(items, desc=what, unit="block", file=sys.stderr, leave=False)


def _prefill_runs(systems, w, args):
    rng = np.random.default_rng(0)
    results = {}
    for T in _progress(args.lengths, "prefill"):
        if T > w.config.n_positions:
            continue
        ids = rng.integers(0, w.config.vocab_size, T)
        logits = {s.name: s.call("prefill", ids, logits=True)[2] for s in systems}  # warm-up; must agree
        times = {s.name: [] for s in systems}
        wait_for_idle()
        with _Load(*(s.process.pid for s in systems)) as load:
            for _ in range(args.repeat):
                for s in systems:
                    times[s.name].append(s.call("prefill", ids)[0])
        results[T] = {name: _stats(ts) for name, ts in times.items()}
        results[T]["others_cpu"] = load.share
        if "transformers" in logits and "gpt2numba" in logits:
            results[T]["max_abs_logit_diff"] = float(np.abs(logits["gpt2numba"] - logits["transformers"]).max())
    return results


def _decode_runs(systems, w, args):
    rng = np.random.default_rng(1)
    results = {}
    for context in _progress(args.contexts, "decode"):
        if context + args.steps + 1 > w.config.n_positions:
            continue
        ids = rng.integers(0, w.config.vocab_size, context)
        tokens = {s.name: s.call("prefill", ids)[1] for s in systems}
        for s in systems:  # one untimed step each: warm-up
            tokens[s.name] = s.call("decode", tokens[s.name])[1]
        times = {s.name: [] for s in systems}
        wait_for_idle()
        with _Load(*(s.process.pid for s in systems)) as load:
            for _ in range(args.steps):
                for s in systems:
                    seconds, tokens[s.name], _ = s.call("decode", tokens[s.name])
                    times[s.name].append(seconds)
        results[context] = {name: _stats(ts) for name, ts in times.items()}
        results[context]["others_cpu"] = load.share
        if "transformers" in tokens and "gpt2numba" in tokens:
            results[context]["same_greedy_tokens"] = tokens["gpt2numba"] == tokens["transformers"]
    return results


# --- throughput: many sequences at once -----------------------------------------------------------

def _throughput_runs(ours, theirs, w, floors, args):
    """Tokens/s of B sequences decoding together, a ragged mix of contexts, prefill_batch against prefills.

    ours: the gpt2numba workers; theirs: transformers' worker, or None.
    """
    cfg, steps = w.config, args.batch_steps
    result = {"context": args.batch_context, "steps": steps, "batches": {}, "notes": []}
    sizes = args.batch_sizes
    if args.batch_context + steps + 2 > cfg.n_positions:
        result["notes"].append(f"batch sizes skipped: context {args.batch_context} + {steps} steps + 2 "
                               f"> n_positions {cfg.n_positions}")
        sizes = []
    rng = np.random.default_rng(3)
    pace = {}  # transformers' seconds per prompt token, padding included, in its last generate
    blocks = [*((B, "uniform") for B in sizes), (RAGGED_BATCH, "ragged"), (PREFILL_BATCH, "prefill")]
    for B, kind in _progress(blocks, "throughput"):
        if kind == "prefill":
            result["prefill"] = _batch_prefill(ours, w, args, result["notes"])
            continue
        if kind == "uniform":
            contexts = np.full(B, args.batch_context)
        else:  # as many of 16..900 as fit beside the steps: n_positions 64 gives 16..60
            high = min(RAGGED_CONTEXTS[1], cfg.n_positions - steps - 2)
            if high < 1:
                result["notes"].append(f"ragged mix skipped: n_positions {cfg.n_positions} leaves no context "
                                       f"for {steps} steps")
                continue
            contexts = np.random.default_rng(4).integers(min(RAGGED_CONTEXTS[0], high), high + 1, B)
        prompts = [rng.integers(0, cfg.vocab_size, n) for n in contexts]
        row = _batch_decode(ours, theirs, prompts, args, pace, result["notes"], f"B={B} {kind}")
        entry = {"decode": row, "floor_ms": {name: _batch_floor(floors, cfg, name, B, int(contexts.sum()))
                                             for name, _ in _systems(row)}}
        if kind == "uniform":
            result["batches"][B] = entry
        else:
            result["ragged"] = {"contexts": contexts.tolist(),
                                "attention_ratio": float(contexts.sum() / (B * args.batch_context)), **entry}
    return result


def _batch_decode(ours, theirs, prompts, args, pace, notes, label):
    """B sequences decoding together: the gpt2numba formats step by step in turn, then transformers' generate.

    prompts: B id arrays, lengths may differ. Returns the table's row: step-time stats with tok_s per
    system, others' CPU share, and how many sequences' greedy tokens transformers matched (float32).
    """
    B, steps = len(prompts), args.batch_steps
    for s in ours:  # the prefill's token, a warm-up step's, then the timed steps', and one row spare
        s.call("batch_caches", [len(ids) + steps + 2 for ids in prompts])
    chosen = {s.name: [s.call("prefill_batch", prompts)[1]] for s in ours}  # per step: B greedy tokens
    for s in ours:  # one untimed step each: warm-up
        chosen[s.name].append(s.call("decode_batch", chosen[s.name][-1])[1])
    times = {s.name: [] for s in ours}
    theirs_tokens = None
    padded = B * max(map(len, prompts))  # transformers computes the left padding too
    wait_for_idle()
    with _Load(*(s.process.pid for s in [*ours, *([theirs] if theirs else [])])) as load:
        for _ in range(steps):
            for s in ours:
                seconds, greedy, _ = s.call("decode_batch", chosen[s.name][-1])
                chosen[s.name].append(greedy)
                times[s.name].append(seconds)
        predicted = pace.get("s_per_token", 0.0) * padded
        if theirs and predicted > args.transformers_max_s:
            notes.append(f"transformers skipped at {label}: about {predicted:.0f} s predicted from the last "
                         f"batch > --transformers-max-s {args.transformers_max_s:g}")
        elif theirs:
            seconds, out, _ = theirs.call("generate", _left_padded(prompts, steps + 2))
            pace["s_per_token"] = seconds / padded
            times["transformers"] = np.diff(out["put_s"])[2:]  # after the prefill's gap and a warm-up step's
            theirs_tokens = out["tokens"]
    row = {"sequences": B}
    for name, ts in times.items():
        row[name] = _stats(ts)
        row[name]["tok_s"] = 1e3 * B / row[name]["median_ms"]
    row["others_cpu"] = load.share
    if theirs_tokens is not None and "gpt2numba" in chosen:
        same = np.array(chosen["gpt2numba"]).T == np.array(theirs_tokens)  # (B, steps + 2)
        row["same_greedy_sequences"] = int(same.all(axis=1).sum())
    return row


def _left_padded(prompts, new_tokens):
    """generate's arguments for a batch: every prompt ends in the last column, masked padding before it."""
    T = max(map(len, prompts))
    ids = np.zeros((len(prompts), T), np.int64)  # (B, T)
    mask = np.zeros((len(prompts), T), np.int64)  # (B, T): 1 on a prompt, 0 on padding
    for b, p in enumerate(prompts):
        ids[b, T - len(p):], mask[b, T - len(p):] = p, 1
    return ids, mask, new_tokens


def _batch_floor(floors, cfg, name, B, context_sum):
    """Floors of one decode step of B sequences, ms: reading the weights and the K/V rows of the contexts
    (over 600 MB at B = 64 x 128, more than GPT-2 small's weights), and the matrix products of B rows."""
    kv_bytes = context_sum * 2 * cfg.n_layer * cfg.n_embd * 4  # float32 K and V, every layer
    matrix_params = cfg.n_layer * 12 * cfg.n_embd**2 + cfg.vocab_size * cfg.n_embd  # 4 per block, wte
    read_b_s = 1e9 * floors["read_gb_s"]
    return {"read": 1e3 * (floors["decode_bytes"][name] + kv_bytes) / read_b_s, "kv_read": 1e3 * kv_bytes / read_b_s,
            "gemm": 1e3 * 2 * B * matrix_params / (1e9 * floors["batch_gemm_gflop_s"][B])}


def _batch_prefill(ours, w, args, notes):
    """PREFILL_BATCH prompts as one prefill_batch against one prefill after another, in each format."""
    T = args.batch_context
    if T > w.config.n_positions:
        notes.append(f"prefill_batch skipped: {T} tokens > n_positions {w.config.n_positions}")
        return None
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, w.config.vocab_size, T) for _ in range(PREFILL_BATCH)]
    diffs = {}
    for s in ours:  # warm-up; both ways must give the same logits
        s.call("batch_caches", [T] * PREFILL_BATCH)
        batch = s.call("prefill_batch", prompts, logits=True)[2]
        diffs[s.name] = float(np.abs(batch - s.call("prefill_each", prompts, logits=True)[2]).max())
    times = {s.name: {"batch": [], "sequential": []} for s in ours}
    wait_for_idle()
    with _Load(*(s.process.pid for s in ours)) as load:
        for _ in range(args.repeat):
            for s in ours:
                times[s.name]["batch"].append(s.call("prefill_batch", prompts)[0])
                times[s.name]["sequential"].append(s.call("prefill_each", prompts)[0])
    result = {"prompts": PREFILL_BATCH, "length": T, "runs": args.repeat, "others_cpu": load.share}
    for name, t in times.items():
        result[name] = {"batch": _stats(t["batch"]), "sequential": _stats(t["sequential"]),
                        "max_abs_logit_diff": diffs[name]}
    return result


def _stats(seconds):
    ms = 1e3 * np.asarray(seconds)
    return {"median_ms": float(np.median(ms)), "min_ms": float(ms.min()), "max_ms": float(ms.max()), "n": len(ms)}


# --- new processes: cold start and peak memory ----------------------------------------------------

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
w = g.load_weights(sys.argv[1], dtype=sys.argv[2]); mc = g.ModelCache(w.config)
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
# ru_maxrss survives execve on Linux (a child reports its parent's peak); VmHWM does not.
_PEAK_RSS = """
def peak_rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
"""


def _run(script, model_dir, env=None, *extra):
    out = subprocess.run([sys.executable, "-c", script, str(model_dir), *extra], capture_output=True, text=True,
                         env={**os.environ, **(env or {})}, timeout=900)
    if out.returncode:
        raise RuntimeError(f"benchmark subprocess failed: {out.stderr.strip().splitlines()[-1:]}")
    return float(out.stdout.split()[-1])


def _cold_start(model_dir, with_theirs):
    wait_for_idle()
    result = {}
    with tempfile.TemporaryDirectory() as numba_cache:
        empty = {"NUMBA_CACHE_DIR": numba_cache}
        result["gpt2numba_compiling_s"] = _run(_OURS_FIRST, model_dir, empty)
        result["gpt2numba_warm_cache_s"] = _run(_OURS_FIRST, model_dir, empty)
    if with_theirs:
        _run(_THEIRS_FIRST, model_dir)  # let the OS cache torch's libraries, as ours are
        result["transformers_s"] = _run(_THEIRS_FIRST, model_dir)
    return result


def _peak_rss(model_dir, with_theirs, cfg, dtypes):
    if cfg.n_positions < 640 or not os.path.exists("/proc/self/status"):
        return {}
    result = {_name(d): _run(_PEAK_RSS + _OURS_RSS, model_dir, None, d) for d in dtypes}
    if with_theirs:
        result["transformers"] = _run(_PEAK_RSS + _THEIRS_RSS, model_dir)
    return result


# --- a shared machine: wait for quiet, and say how loud it was -----------------------------------

def _busy_jiffies():
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return sum(fields) - fields[3] - fields[4], sum(fields)  # (busy, total): idle and iowait excluded


class _Load:
    """Share of the machine's CPU that processes other than the benchmark's used during a block."""

    def __init__(self, *pids):
        self.pids = pids

    def __enter__(self):
        self.share = None
        if os.path.exists("/proc/stat"):
            self._start = (_busy_jiffies(), self._ours())
        return self

    def __exit__(self, *exc):
        if os.path.exists("/proc/stat"):
            (busy0, total0), ours0 = self._start
            busy1, total1 = _busy_jiffies()
            ours = self._ours() - ours0
            self.share = max(0.0, (busy1 - busy0 - ours) / max(1, total1 - total0))

    def _ours(self):
        """Jiffies of CPU used by this process and its worker processes."""
        total = 0
        for pid in ("self", *self.pids):
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
        return total


def wait_for_idle(threshold=0.1, patience_s=30.0):
    """Wait (up to patience_s) until others use under ``threshold`` of the CPU over half a second."""
    if not os.path.exists("/proc/stat"):
        return
    deadline = time.monotonic() + patience_s
    while time.monotonic() < deadline:
        (b0, t0) = _busy_jiffies()
        time.sleep(0.5)
        (b1, t1) = _busy_jiffies()
        if (b1 - b0) / max(1, t1 - t0) < threshold:
            return


def _machine():
    return {"cpus": os.cpu_count(), "python": sys.version.split()[0]}


# --- the table ----------------------------------------------------------------------------------------

def _print(r, floors):
    theirs = r["transformers"]
    print(f"\ngpt2numba bench: {r['model']}, {r['threads']} threads"
          + (f"; against {theirs}, float32" if theirs else ""))
    print(f"floors: read {floors['read_gb_s']:.1f} GB/s, GEMM {floors['gemm_gflop_s']:.0f} GFLOP/s at "
          f"{'x'.join(map(str, GEMM_SHAPE))}; decode floor = weight bytes / read rate")
    print(f"\n{'prefill':>7}  {'system':<22} {'median ms':>9} {'tok/s':>6} {'/floor':>7} {'vs transformers':>15}"
          f"  {'min-max ms':>15} {'others':>6}")
    for T, row in r["prefill"].items():
        for name, o in _systems(row):
            print(f"{T:>7}  {name:<22} {o['median_ms']:>9.1f} {1e3 * T / o['median_ms']:>6.0f} "
                  f"{o['median_ms'] / floors['prefill_floor_ms'][T]:>6.2f}x {_versus(row, name):>15}"
                  f"  {o['min_ms']:>7.1f}-{o['max_ms']:<7.1f} {_pct(row['others_cpu']):>6}")
        if "max_abs_logit_diff" in row:
            print(f"{'':>9}|gpt2numba - transformers| logits: {row['max_abs_logit_diff']:.1e}")
    print(f"\n{'decode':>7}  {'system':<22} {'ms/token':>9} {'floor':>6} {'/floor':>7} {'vs transformers':>15}"
          f"  {'min-max ms':>15} {'others':>6}")
    for context, row in r["decode"].items():
        for name, o in _systems(row):
            floor = floors["decode_floor_ms"][name]
            print(f"{context:>7}  {name:<22} {o['median_ms']:>9.2f} {floor:>6.1f} {o['median_ms'] / floor:>6.2f}x "
                  f"{_versus(row, name):>15}  {o['min_ms']:>7.2f}-{o['max_ms']:<7.2f} {_pct(row['others_cpu']):>6}")
        if "same_greedy_tokens" in row:
            print(f"{'':>9}same greedy tokens as transformers: {row['same_greedy_tokens']}")
    if "throughput" in r:
        _print_throughput(r["throughput"], floors)
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


def _print_throughput(t, floors):
    shape = "x".join(map(str, floors["batch_gemm_shape"]))
    print(f"\nthroughput: B sequences decoding together at context {t['context']} each, median of {t['steps']} "
          f"decode_batch steps; transformers: batched greedy generate")
    print(f"floors per step: read = (weight bytes + the contexts' K/V rows) / read rate; GEMM = 2 B x matrix "
          f"parameters / BLAS rate at Bx{shape}: "
          + ", ".join(f"B={B} {rate:.0f}" for B, rate in floors["batch_gemm_gflop_s"].items()) + " GFLOP/s")
    first = min(t["batches"], default=None)
    base = {name: o["tok_s"] for name, o in _systems(t["batches"][first]["decode"])} if first else {}
    print(f"\n{'batch':>6}  {'system':<22} {'step ms':>8} {'tok/s':>6} {f'vs B={first or 1}':>7} {'read ms':>8} "
          f"{'GEMM ms':>8} {'/floor':>7} {'vs transformers':>15} {'others':>6}")
    ragged = t.get("ragged")
    for B, entry in t["batches"].items():
        _print_batch(str(B), entry, base)
        if B == RAGGED_BATCH and ragged:
            _print_ragged(ragged, t, base)
            ragged = None
    if ragged:
        _print_ragged(ragged, t, base)
    p = t.get("prefill")
    if p:
        print(f"\nprefill {p['prompts']} x {p['length']} tokens: one prefill_batch against {p['prompts']} "
              f"prefills one after another (median of {p['runs']}), "
              f"others {_pct(p['others_cpu'])}")
        for name, o in _systems(p):
            batch, each = o["batch"]["median_ms"], o["sequential"]["median_ms"]
            print(f"{'':>8}{name:<22} {batch:>8.1f} ms against {each:>8.1f} ms: {each / batch:.2f}x; "
                  f"max |batch - one by one| logits {o['max_abs_logit_diff']:.1e}")
    for note in t["notes"]:
        print(f"throughput: {note}")


def _print_batch(label, entry, base):
    row = entry["decode"]
    for name, o in _systems(row):
        f = entry["floor_ms"][name]
        vs_base = f"{o['tok_s'] / base[name]:.2f}x" if name in base else ""
        print(f"{label:>6}  {name:<22} {o['median_ms']:>8.2f} {o['tok_s']:>6.0f} {vs_base:>7} {f['read']:>8.1f} "
              f"{f['gemm']:>8.1f} {o['median_ms'] / max(f['read'], f['gemm']):>6.2f}x {_versus(row, name):>15} "
              f"{_pct(row['others_cpu']):>6}")
    if "same_greedy_sequences" in row:
        print(f"{'':>8}same greedy tokens as transformers: {row['same_greedy_sequences']} of "
              f"{row['sequences']} sequences")


def _print_ragged(r, t, base):
    contexts = r["contexts"]
    print(f"{'':>8}ragged: {len(contexts)} sequences at contexts {min(contexts)} to {max(contexts)}, "
          f"{r['attention_ratio']:.2f}x the attention work of {len(contexts)} x {t['context']}"
          + (f"; transformers pads each to {max(contexts)}" if "transformers" in r["decode"] else ""))
    _print_batch("ragged", r, base)


def _systems(row):
    return [(name, stats) for name, stats in row.items() if isinstance(stats, dict)]


def _versus(row, name):
    """How many times faster than transformers (its median over ours)."""
    if "transformers" not in row or name == "transformers":
        return ""
    return f"{row['transformers']['median_ms'] / row[name]['median_ms']:.2f}x faster"


def _pct(share):
    return "-" if share is None else f"{100 * share:.0f}%"


if __name__ == "__main__":
    sys.exit(main())

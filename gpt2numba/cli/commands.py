"""Command line: gpt2numba generate | check | score | serve | tune | bench (also python -m gpt2numba). The commands
but generate are here; every command's flags are in options.py, generate's work in generate.py, bench's in the
bench package."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import itertools
import json
import math
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

from ..errors import ConfigError, GPT2NumbaError
from ..model import forward
from ..model.forward import decode_batch, decode_step, prefill, prefill_batch
from ..model.kvcache import ModelCache
from ..model.mapped import is_mapped
from ..model.models import RANDOM_NAME, RANDOM_NOTE, resolve_model  # resolve_model re-exported: gpt2numba.cli's
from ..model.oracle import RTOL, agreement, recompute_logits, rounds_inputs, tolerance
from ..text.documents import field_of, read, split, utf8
from ..serve.config import ServeConfig, flags as serve_flags  # (no web framework)
from . import generate
from .options import build_parser, unswallowed
from .summary import count, rate, since_start, start


def console() -> None:
    """The `gpt2numba` command (and python -m gpt2numba): main(), then the process ends once its output is out.

    After a command that ran the kernels, Python's own teardown (Numba's compiled code freed piece by piece)
    takes 0.3 s more (docs/performance-history.md, "Start"); the command's process skips it once the exit
    handlers (the pool's, other libraries') have run and every stream is flushed (Python's and C's), unless a
    thread of its own is still at work, which Python would wait for, or a profiler, a tracer or `python -i`
    waits for the end. main(), called from Python, returns as any function does.
    """
    code = main()
    if (any(not t.daemon for t in threading.enumerate() if t is not threading.main_thread())
            or sys.flags.inspect or sys.getprofile() is not None or sys.gettrace() is not None):
        sys.exit(code)
    atexit._run_exitfuncs()  # (CPython's own call at exit, not in the documented API)
    try:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
    except (OSError, ValueError):  # (a closed pipe, a closed stream: Python's own exit says so)
        sys.exit(code)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).fflush(None)  # (C's buffers too: what native libraries wrote)
    os._exit(code or 0)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # bench has a parser of its own (gpt2numba.bench): the rest goes to it untouched
        from ..bench import main as bench_main

        return bench_main(argv[1:])

    args = parser.parse_args(unswallowed(argv))
    if getattr(args, "activations", "float32") == "bfloat16" and args.dtype != "bfloat16":
        parser.error(f"--activations bfloat16 needs --dtype bfloat16, got --dtype {args.dtype}")
    try:
        if getattr(args, "threads", None):
            forward.set_threads(args.threads)
        return {"generate": generate.run, "check": _check, "score": _score, "serve": _serve,
                "tune": _tune}[args.command](args)
    except (GPT2NumbaError, OSError) as e:
        print(f"gpt2numba: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _documents(args):
    """(source, index, text) of every document, in order (documents.split: the errors name file and line)."""
    for name in args.files:
        yield from split(read(name), "<stdin>" if name == "-" else name, args.lines, field_of(name, args.field))


def _serve(args) -> int:
    try:
        import prometheus_client  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"serve needs the [serve] extra (pip install -e \".[serve]\"): {e}") from None
    from ..serve import run
    from ..text.tokenizer import load_tokenizer

    w, path, _ = resolve_model(args.model, args.dtype, args.activations)
    settings = {name: getattr(args, name) for name, *_ in serve_flags()}
    config = ServeConfig(**settings | {"api_key": _api_key(args), "kv_dtype": args.kv_dtype,
                                       "model_name": args.model_name or (RANDOM_NAME if path is None else None)})
    if path is None:
        print(f"gpt2numba: {RANDOM_NOTE}; /v1/models lists them as {config.model_name}", file=sys.stderr)
    run(w, load_tokenizer(path), config.named(args.model))
    return 0


def _api_key(args) -> str | None:
    """--api-key, else --api-key-file's first line, else $GPT2NUMBA_API_KEY, else None; an empty key is
    an error (it would turn authentication off without a word)."""
    if args.api_key is not None:
        key, where = args.api_key, "--api-key"
    elif args.api_key_file is not None:
        where = f"--api-key-file {args.api_key_file}"
        key = utf8(read(args.api_key_file), where, 1).strip()
    elif "GPT2NUMBA_API_KEY" in os.environ:
        key, where = os.environ["GPT2NUMBA_API_KEY"], "$GPT2NUMBA_API_KEY"
    else:
        return None
    if not key.strip():
        raise ConfigError(f"the API key from {where} is empty: give a key, or none for no authentication")
    return key


def _score(args) -> int:
    """One JSON line per document, a progress bar in tokens, corpus totals; on a bad document,
    the ones before it are still scored and written."""
    from tqdm import tqdm

    from ..text.scoring import score_batch
    from ..text.tokenizer import load_tokenizer

    if args.html and (args.ray or args.output):
        raise GPT2NumbaError("--html goes without --ray and --output")
    if args.ray or args.output:  # (Ray reads the files, on its nodes: folders and remote paths too)
        return _score_ray(args)
    for name in args.files:  # before any model loads
        if name != "-" and not Path(name).is_file():
            raise ConfigError(f"FILE {name!r}: {'a directory' if Path(name).is_dir() else 'no such file'}")
    if args.html:
        return _score_html(args)
    w, path, _ = resolve_model(args.model, args.dtype, args.activations)
    if path is None:
        print(f"gpt2numba: {RANDOM_NOTE}", file=sys.stderr)
    tokenizer = load_tokenizer(path)
    docs, failure = [], None
    try:
        for source, index, text in _documents(args):
            docs.append((source, index, text, tokenizer.encode(text)))
    except (GPT2NumbaError, OSError) as e:
        failure = e
    t0 = time.perf_counter()
    nll = tokens = n_bytes = 0
    with tqdm(total=sum(len(ids) for *_, ids in docs), unit="tok", unit_scale=True, file=sys.stderr,
              desc="score") as bar:
        for lo in range(0, len(docs), args.batch_size):
            group = docs[lo: lo + args.batch_size]
            for (source, index, text, ids), s in zip(group, score_batch([d[3] for d in group], w,
                                                                         stride=args.stride, kv_dtype=args.kv_dtype)):
                size = len(text.encode("utf-8"))
                print(json.dumps({"source": source, "index": index, "tokens": s.n_tokens, "nll": s.nll,
                                  "perplexity": _finite(s.perplexity),  # (null with no token scored)
                                  "bits_per_byte": s.nll / math.log(2) / size if size and s.n_tokens else None}),
                      flush=True)
                nll, tokens, n_bytes = nll + s.nll, tokens + s.n_tokens, n_bytes + size
                bar.update(len(ids))
    seconds = time.perf_counter() - t0
    speed = rate(tokens, seconds)
    print(f"gpt2numba: {count(len(docs), 'document')}, {count(tokens, 'token')} scored{_totals(nll, tokens, n_bytes)}; "
          f"{seconds:.1f} s" + (f", {speed}" if speed else ""), file=sys.stderr)
    if failure is not None:
        raise failure
    return 0


def _score_html(args) -> int:
    """score --html: the first --html-documents documents, each inspected (tokenview.py) in one pass of its first
    n_positions - 1 tokens, written as one HTML file (report.py)."""
    from ..text.report import Document, html_report
    from ..text.tokenizer import load_tokenizer
    from ..text.tokenview import inspect_ids

    w, path, source = resolve_model(args.model, args.dtype, args.activations)
    tokenizer, limit = load_tokenizer(path), w.config.n_positions - 1
    documents = []
    for name, index, text in itertools.islice(_documents(args), args.html_documents):
        ids = tokenizer.encode(text)
        note = f"The first {limit} of its {len(ids)} tokens: one pass of the context." if len(ids) > limit else ""
        inspection = inspect_ids(ids[:limit], w, tokenizer, kv_dtype=args.kv_dtype) if ids else None
        documents.append(Document(f"{name}, document {index}", inspection, note))
    with open(args.html, "w", encoding="utf-8") as f:  # (an error names the file as typed)
        f.write(html_report(documents, source))
    tokens = sum(len(d.inspection.ids) for d in documents if d.inspection is not None)
    print(f"gpt2numba: wrote {args.html}: {count(len(documents), 'document')}, {count(tokens, 'token')}",
          file=sys.stderr)
    return 0


def _score_ray(args) -> int:
    """gpt2numba score --ray: Ray Data reads and splits the files, a pool of workers scores them (distributed.py);
    the same documents and output fields as in-process."""
    if not args.ray:
        raise GPT2NumbaError("--output goes with --ray")
    if "-" in args.files or not args.files:
        raise GPT2NumbaError("--ray reads files (on every node), not stdin")
    if args.kv_dtype != "float32":
        raise GPT2NumbaError("--kv-dtype goes without --ray: the Ray workers keep float32 caches")
    from ..integrations.distributed import cluster, read_documents, score_dataset, write

    t0 = time.perf_counter()
    with cluster(args.ray):
        ds = read_documents(args.files, lines=args.lines, field=args.field)
        scored = score_dataset(ds, args.model, dtype=args.dtype, activations=args.activations, stride=args.stride,
                               threads_per_worker=args.threads, batch_size=args.batch_size).materialize()
        if args.output:
            write(scored, args.output, args.format)
        else:
            for row in sorted(scored.iter_rows(), key=_order(args.files)):
                print(json.dumps({"source": row["source"], "index": int(row["index"]), "tokens": int(row["tokens"]),
                                  "nll": float(row["nll"]), "perplexity": _finite(float(row["perplexity"])),
                                  "bits_per_byte": _finite(float(row["bits_per_byte"]))}), flush=True)
        docs, tokens, nll = 0, 0, 0.0  # from the blocks in hand: Ray's own sum() would run a job for each
        for batch in scored.iter_batches(batch_size=None, batch_format="numpy"):
            docs += len(batch["tokens"])
            tokens += int(batch["tokens"].sum())
            nll += float(batch["nll"].sum())
    seconds = time.perf_counter() - t0
    speed = rate(tokens, seconds)
    print(f"gpt2numba: {count(docs, 'document')} on Ray, {count(tokens, 'token')} scored{_totals(nll, tokens)}; "
          f"{seconds:.1f} s with "
          f"the cluster's start" + (f", {speed}" if speed else "") + (f"; written to {args.output}" if args.output
                                                                     else ""), file=sys.stderr)
    return 0


def _order(names: list[str]):
    """Sort key of a scored row: the files in the order given (a directory's in path order), then the index."""
    def key(row):
        source = row["source"]
        rank = next((i for i, name in enumerate(names) if source == name or source.startswith(name.rstrip("/") + "/")),
                    len(names))
        return rank, source, int(row["index"])
    return key


def _totals(nll: float, tokens: int, n_bytes: int | None = None) -> str:
    """", nll N nats, perplexity P" of a corpus (and its bits per byte, given its bytes); "" with no token scored,
    whose perplexity is no number."""
    if not tokens:
        return ""
    return (f", nll {nll:.1f} nats, perplexity {math.exp(nll / tokens):.2f}"
            + (f", {nll / math.log(2) / n_bytes:.3f} bits/byte" if n_bytes else ""))


def _finite(x: float):
    return x if math.isfinite(x) else None  # JSON has no nan


def _tune(args) -> int:
    from ..bench import tune

    return tune.run(args)


def _check(args) -> int:
    t0, before_run = time.perf_counter(), since_start()
    w, _, source = resolve_model(args.model, args.dtype, args.activations)
    cfg, load_s = w.config, time.perf_counter() - t0
    print(f"weights: {source}: {cfg.n_layer} layers, {cfg.n_head} heads, n_embd {cfg.n_embd}, "
          f"vocab {cfg.vocab_size}, {w.dtype}{', bfloat16 activations' * (w.activations == 'bfloat16')}; "
          f"{'mapped' if is_mapped(w) else 'in memory'}")
    if w.dtype != "float32":
        print(f"(compared with the oracle run on the float32 values the {w.dtype} weights stand for"
              f"{', rounding every product input as they do' if rounds_inputs(w) else ''})")
    if args.kv_dtype != "float32":
        print(f"(a {args.kv_dtype} cache: the engine reads K and V rounded, the oracle does not round them)")
    if args.prompt_len + args.decode > cfg.n_positions:
        print(f"gpt2numba: error: --prompt-len + --decode = {args.prompt_len + args.decode} "
              f"exceeds n_positions {cfg.n_positions}", file=sys.stderr)
        return 2
    print("(the first prefill and decode include Numba's compilation, or loading it from its cache;\n"
          " the engine is timed first, the float64 oracle checks every logit afterwards)")
    rng = np.random.default_rng(args.seed)
    prompts = [[int(t) for t in rng.integers(0, cfg.vocab_size, args.prompt_len)] for _ in range(args.prompts)]
    max_len = args.prompt_len + args.decode
    runs = []  # per prompt: (ids, logits after each step, prefill s, decode s per step)
    for ids in prompts:
        ids, mc = list(ids), ModelCache(cfg, max_len=max_len, dtype=args.kv_dtype)
        t = time.perf_counter()
        steps = [prefill(ids, w, mc)]
        prefill_s, decode_s = time.perf_counter() - t, []
        for _ in range(args.decode):
            ids.append(int(np.argmax(steps[-1])))
            t = time.perf_counter()
            steps.append(decode_step(ids[-1], w, mc))
            decode_s.append(time.perf_counter() - t)
        runs.append((ids, steps, prefill_s, decode_s))
    print(f"start: {start(before_run, weights=load_s, first_token=runs[0][2])} (the first token: the first "
          "prefill, with the compiled kernels' loading)")
    from ..cpu import amx, dispatch, pool, threadlayer
    amx.request()  # (this command's own process: whether Linux lends Intel's tiles here is worth knowing)
    print(f"parallel regions: {pool.describe()}")  # the threads, their pinning, what failed; the tiles
    if pool.enabled():  # (off, the regions' own line names the layer)
        print(f"beneath the pool: {threadlayer.describe()}")
    print(f"row thresholds: {dispatch.describe_tuning()}")
    if w.activations == "bfloat16":
        print(f"bfloat16 products: {dispatch.describe_bf16()}")
    # the same prompts again as one batch: one prefill_batch, then decode_batch steps
    caches = [ModelCache(cfg, max_len=max_len, dtype=args.kv_dtype) for _ in prompts]
    t = time.perf_counter()
    batch_steps = [prefill_batch(prompts, w, caches)]
    batch_prefill_s, batch_decode_s = time.perf_counter() - t, []
    for n in range(args.decode):
        tokens = [ids[args.prompt_len + n] for ids, *_ in runs]  # the tokens decoded alone
        t = time.perf_counter()
        batch_steps.append(decode_batch(tokens, w, caches))
        batch_decode_s.append(time.perf_counter() - t)

    worst, failures = 0.0, 0
    for n, (ids, steps, prefill_s, decode_s) in enumerate(runs):
        diffs = [_compare(logits, ids[: args.prompt_len + i], w) for i, logits in enumerate(steps)]
        ok = all(d[1] for d in diffs)
        failures += not ok
        worst = max(worst, *(d[0] for d in diffs))
        decode_ms = f"{1e3 * np.median(decode_s):.1f} ms/token" if decode_s else "-"
        print(f"prompt {n + 1}: {count(args.prompt_len, 'token')} + {args.decode} decoded, "
              f"max |cached - oracle| {max(d[0] for d in diffs):.2e} {'ok' if ok else 'MISMATCH'}; "
              f"prefill {args.prompt_len / prefill_s:.0f} tokens/s, decode {decode_ms}")
    # batched rows against the rows each prompt got alone (the oracle already vouched for those)
    alone = [np.stack([steps[i] for _, steps, *_ in runs]) for i in range(len(batch_steps))]  # (B, V) per step
    gap = max(float(np.abs(batch - ref).max()) for batch, ref in zip(batch_steps, alone))
    ok = all(agreement(b, r, w)[0] for batch, ref in zip(batch_steps, alone) for b, r in zip(batch, ref)) and (
        gap <= 1e-4 or rounds_inputs(w))  # rounded inputs: a batch may round a tie the other way
    failures += not ok
    B = len(prompts)
    decode_rate = f"{B / np.median(batch_decode_s):.0f} tokens/s" if batch_decode_s else "-"
    print(f"batch of {B}: the same prompts in one pass, max |batched - alone| {gap:.2e} {'ok' if ok else 'MISMATCH'}; "
          f"prefill {B * args.prompt_len / batch_prefill_s:.0f} tokens/s, decode {decode_rate}")
    print(f"{'all' if not failures else failures} of {count(args.prompts, 'prompt')} and the batch "
          f"{'match' if not failures else 'do NOT match'} the oracle "
          f"(allclose atol={tolerance(w)}, rtol={RTOL}, same argmax); "
          f"worst |diff| {worst:.2e}")
    return 1 if failures else 0


def _compare(logits, ids, w) -> tuple[float, bool]:
    ref = recompute_logits(ids, w)
    return float(np.abs(logits - ref).max()), agreement(logits, ref, w)[0]

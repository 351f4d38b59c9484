"""Command line: gpt2numba generate | check | score | serve | tune | bench (also python -m gpt2numba). Every command's flags
are defined here; generate's work is in generate.py, bench's in the bench package."""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import sys
import time
from pathlib import Path

import numpy as np

from .. import __version__
from ..argtypes import in_range
from ..cpu.tuning import TUNABLE
from ..errors import ConfigError, GPT2NumbaError
from ..model import forward
from ..model.compact import ACTIVATIONS, DTYPES
from ..model.forward import decode_batch, decode_step, prefill, prefill_batch
from ..model.kvcache import KV_DTYPES, ModelCache
from ..model.models import RANDOM_NAME, RANDOM_NOTE, resolve_model  # resolve_model re-exported: gpt2numba.cli's
from ..model.oracle import RTOL, agreement, recompute_logits, rounds_inputs, tolerance
from ..text.documents import field_of, read, split, utf8
from ..text.report import REPORT_DOCUMENTS
from ..serve.config import ServeConfig, flags as serve_flags  # (no web framework)
from . import generate
from .summary import rate


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # bench has a parser of its own (gpt2numba.bench): the rest goes to it untouched
        from ..bench import main as bench_main

        return bench_main(argv[1:])

    args = parser.parse_args(_unswallowed(argv))
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


# The options whose values are optional (--ray [ADDRESS]) or many (--eos-token-id ID [ID ...]): the form of a value,
# and how many it takes at most. argparse gives such an option every word that follows it, so that
# `score --ray corpus.txt` scored stdin on a cluster named corpus.txt; _unswallowed leaves it only words of that form.
_VALUE_FORMS = {"--ray": (re.compile(r"auto|local|ray://\S+|[^/\s]+:\d+"), 1),  # ray.init's addresses
               "--eos-token-id": (re.compile(r"-?\d+"), math.inf)}
_RAY_ADDRESS_HELP = ("the address of an existing cluster (auto, HOST:PORT or ray://HOST:PORT; any other as "
                     "--ray=ADDRESS: a word of another form after --ray is not taken for an address), or none to start "
                     "a local one")


def _unswallowed(argv: list[str]) -> list[str]:
    """argv with each option of _VALUE_FORMS that is followed by a word it would swallow (a word not of its values'
    form, such as FILE or PROMPT) moved to the end, with the values it has, before any "--": the word stays where
    it was, for the command's positional. --ray=VALUE still takes any value."""
    end = argv.index("--") if "--" in argv else len(argv)
    kept, moved, i = [], [], 0
    while i < end:
        form, most = _VALUE_FORMS.get(argv[i], (None, 0))
        j = i + 1
        while form and j < end and j - i <= most and form.fullmatch(argv[j]):
            j += 1
        swallows = form and j < end and j - i <= most and (argv[j] == "-" or not argv[j].startswith("-"))
        (moved if swallows else kept).extend(argv[i:j])
        i = j
    return kept + moved + argv[end:]


def build_parser() -> argparse.ArgumentParser:
    """Every command's flags, each number checked against its range as it is parsed (argtypes.in_range)."""
    parser = argparse.ArgumentParser(prog="gpt2numba", description="GPT-2 inference on the CPU with Numba.")
    parser.add_argument("--version", action="version", version=f"gpt2numba {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    model_help = ("checkpoint directory, .safetensors file, or a Hugging Face name such as gpt2 or "
                  "openai-community/gpt2 (needs the [hub] extra and network; a local path of that name wins: "
                  "docs/api.md, 'A real checkpoint'); default: $GPT2NUMBA_WEIGHTS, else seeded random GPT-2 small")
    dtype_help = ("how the matrices are kept: float32 (default), bfloat16 (half the bytes), int8 "
                  "(a quarter, one scale per 32 weights) or int4 (an eighth, the same scales); a decode step "
                  "reads that much less (its measured time: docs/performance.md, 'The decode floor')")

    weights = argparse.ArgumentParser(add_help=False)  # what every command that runs the model takes
    weights.add_argument("--model", help=model_help)
    weights.add_argument("--dtype", default="float32", choices=DTYPES, help=dtype_help)
    weights.add_argument("--activations", default="float32", choices=ACTIVATIONS,
                         help="how the matrix products take their inputs: float32 (default), or bfloat16 (with "
                         "--dtype bfloat16): rounded once, multiplied by the CPU's bfloat16 instructions where it has "
                         "them, faster over many rows (docs/formats.md)")
    weights.add_argument("--threads", type=in_range(int, 1), help="threads to use (default: the cores)")
    weights.add_argument("--kv-dtype", default="float32", choices=KV_DTYPES,
                         help="how the key/value cache keeps its values: float32 (default), or float16 or "
                         "bfloat16 in half the memory (each rounded when written; llama.cpp's default is f16)")

    gen = commands.add_parser("generate", parents=[weights],
                              help="continue a prompt, streaming text as it is produced",
                              description="Continue PROMPT, printing text as it is produced (several texts or "
                              "beam search: each text once done); a one-line summary goes to stderr.")
    gen.add_argument("prompt", metavar="PROMPT", nargs="?", help="the text to continue (or --prompts-file)")
    gen.add_argument("--prompts-file", metavar="FILE",
                     help="many prompts, generated as a batch: one per line, or JSON lines with a \"prompt\" "
                     "field ('-' reads stdin); writes a JSON line per text as it finishes (beam search: per prompt)")
    gen.add_argument("--batch-size", type=in_range(int, 1), metavar="N",
                     help="with --prompts-file: sequences in flight at once (default: all)")
    gen.add_argument("--max-new-tokens", type=in_range(int, 0), default=50, metavar="N", help="default 50")
    gen.add_argument("--temperature", type=in_range(float, 0), metavar="T", help="0 is greedy (default 1.0)")
    gen.add_argument("--top-k", type=in_range(int, 1), metavar="K", help="sample from the K most likely tokens")
    gen.add_argument("--top-p", type=in_range(float, 0, 1, low_open=True), metavar="P",
                     help="sample from the smallest set of mass P")
    gen.add_argument("--min-p", type=in_range(float, 0, 1), metavar="P",
                     help="drop tokens less than P times as likely as the first")
    gen.add_argument("--typical-p", type=in_range(float, 0, 1, low_open=True), metavar="P",
                     help="sample from the locally typical set of mass P")
    gen.add_argument("--repetition-penalty", type=in_range(float, 0, low_open=True), metavar="R",
                     help="default 1.0 (off)")
    gen.add_argument("--presence-penalty", type=in_range(float, -2, 2), metavar="X",
                     help="lower a generated token's logit by X, -2 to 2 (default 0)")
    gen.add_argument("--frequency-penalty", type=in_range(float, -2, 2), metavar="X",
                     help="lower it by X for each time it was generated, -2 to 2 (default 0)")
    gen.add_argument("--no-repeat-ngram-size", type=in_range(int, 0), metavar="N",
                     help="never repeat an N-gram (default 0, off)")
    gen.add_argument("--min-new-tokens", type=in_range(int, 0), metavar="N",
                     help="no end of text before N new tokens (default 0)")
    gen.add_argument("--eos-token-id", type=in_range(int, 0), nargs="+", action="extend", metavar="ID",
                     help="the ids that end a text (default 50256, <|endoftext|>); the first word after them that "
                     "is not a number is PROMPT")
    gen.add_argument("--bad-words", type=_word, action="append", metavar="WORD",
                     help="never write the word WORD after a space (tokenized as ' WORD', as transformers advises); repeatable")
    gen.add_argument("--seed", type=in_range(int, 0), help="make the output reproducible")
    gen.add_argument("--no-stop", action="store_true", help="go on past <|endoftext|> (or --eos-token-id)")
    gen.add_argument("--slide", action="store_true",
                     help="at the end of the context, drop the oldest tokens and go on")
    gen.add_argument("--num-beams", type=in_range(int, 1), default=1, metavar="N",
                     help="beam search with N beams when N > 1 (default 1: sampling)")
    gen.add_argument("--num-return-sequences", type=in_range(int, 1), metavar="N",
                     help="texts per prompt: the N best beams, or N samples (default 1)")
    gen.add_argument("--length-penalty", type=in_range(float), metavar="L",
                     help="beam search: a score is divided by length ** L (default 1.0; above 0 favours long)")
    gen.add_argument("--early-stopping", choices=list(generate.EARLY_STOPPING),
                     help="beam search: stop once N beams ended (true), once none can do better (false, the "
                     "default), or that judged at --max-new-tokens (never)")
    structured = gen.add_argument_group(
        "structured output", "at most one; every token keeps the text inside it, and a text ends when complete "
        "(the [structured] extra: llguidance)")
    structured.add_argument("--json-schema", metavar="FILE", help="a JSON schema (a file of JSON)")
    structured.add_argument("--regex", metavar="RE", help="a regular expression the whole text matches")
    structured.add_argument("--choice", action="append", metavar="TEXT",
                            help="the text is one of these exactly; repeatable (--choice yes --choice no)")
    structured.add_argument("--grammar", metavar="FILE",
                            help="a grammar: Lark (rule start) or GBNF (rule root, as llama.cpp's)")
    speculative = gen.add_argument_group(
        "speculative decoding", "a cheap draft proposes tokens, the model checks them in one pass: the same tokens "
        "greedy, the same distribution sampled (docs/speculative.md)")
    speculative.add_argument("--draft", metavar="DRAFT",
                             help="int4, int8 or bfloat16 (the model's own weights in that format), or a checkpoint "
                             "of a GPT-2 with the same vocabulary (a smaller one)")
    speculative.add_argument("--num-speculative-tokens", type=in_range(int, 1, 64), metavar="N",
                             help="with --draft: tokens drafted a pass (default: adapted to how many are kept)")
    speculative.add_argument("--prompt-lookup", type=in_range(int, 1, 64), metavar="N",
                             help="draft N tokens by copying what followed the last words where they occurred before "
                             "(transformers' prompt_lookup_num_tokens)")
    speculative.add_argument("--max-matching-ngram-size", type=in_range(int, 1, 64), metavar="N",
                             help="with --prompt-lookup: the longest run of last tokens looked up (default 2)")
    gen.add_argument("--ray", nargs="?", const="local", metavar="ADDRESS",
                     help="with --prompts-file: generate on a Ray cluster with Ray Data, the same records in the "
                     f"prompts' order: {_RAY_ADDRESS_HELP} (the [ray] extra); --threads is each worker's, --batch-size "
                     "the prompts a worker runs at once (default 64)")
    gen.add_argument("--output", metavar="DIR", help="with --ray: write the records to DIR instead of stdout")
    gen.add_argument("--format", choices=["jsonl", "parquet"], help="with --output (default jsonl)")

    check = commands.add_parser(
        "check", parents=[weights],
        help="prefill random prompts, decode greedily, compare every logit with the float64 oracle",
        description="Prefill random prompts, decode greedily, and compare every step's logits with "
        "the float64 oracle. Exits 1 on a mismatch.")
    check.add_argument("--prompts", type=in_range(int, 1), default=3, help="random prompts to try (default 3)")
    check.add_argument("--prompt-len", type=in_range(int, 1), default=64, help="tokens per prompt (default 64)")
    check.add_argument("--decode", type=in_range(int, 0), default=8,
                       help="greedy steps after each prefill (default 8)")
    check.add_argument("--seed", type=in_range(int, 0), default=0, help="seed of the random prompts")

    score = commands.add_parser(
        "score", parents=[weights], help="log-likelihood and perplexity of documents, one JSON line each",
        description="Score documents: every token's log-probability given those before it (sliding windows "
        "past the context). Writes one JSON line per document: source, index, tokens (scored), nll (nats), "
        "perplexity, bits_per_byte; corpus totals and a progress bar go to stderr.")
    score.add_argument("files", nargs="*", metavar="FILE", default=["-"],
                       help="plain text (one document per file) or JSON lines; - or nothing reads stdin")
    score.add_argument("--lines", action="store_true", help="plain text: one document per line")
    score.add_argument("--field", metavar="NAME",
                       help="the files are JSON lines with the text in NAME (default for .jsonl files: text)")
    score.add_argument("--stride", type=in_range(int, 1), help="sliding-window stride (default n_positions // 2)")
    score.add_argument("--batch-size", type=in_range(int, 1), default=16, metavar="N",
                       help="documents scored together in one pass (default 16)")
    score.add_argument("--ray", nargs="?", const="local", metavar="ADDRESS",
                       help=f"score on a Ray cluster with Ray Data: {_RAY_ADDRESS_HELP} (needs the [ray] extra; "
                       "files, not stdin)")
    score.add_argument("--output", metavar="DIR", help="with --ray: write the scored dataset to DIR")
    score.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl", help="with --output (default jsonl)")
    score.add_argument("--html", metavar="REPORT",
                       help="instead of the JSON lines, write the tokens of the first documents (--html-documents, "
                       f"default {REPORT_DOCUMENTS}) coloured by probability or rank into one self-contained HTML "
                       "file (no server, nothing fetched); each document's first n_positions - 1 tokens")
    score.add_argument("--html-documents", type=in_range(int, 1), default=REPORT_DOCUMENTS, metavar="N",
                       help=f"with --html: how many documents, from the first (default {REPORT_DOCUMENTS})")

    serve = commands.add_parser(
        "serve", parents=[weights],
        help="an OpenAI-compatible HTTP server with continuous batching (the [serve] extra)",
        description="Serve the model over HTTP, speaking OpenAI's completions API (/v1/completions, "
        "/v1/models) plus /health, /tokenize, /detokenize and /v1/inspect (every token's probability and rank); "
        "GET / is a playground page. Requests share decode steps.")
    key = serve.add_mutually_exclusive_group()  # --api-key or --api-key-file
    for name, default, flag in serve_flags():  # each setting's default and help are ServeConfig's
        parse = (in_range(int, flag.at_least, flag.at_most) if flag.at_least is not None
                 else in_range(float, 0, low_open=True) if flag.positive else str)
        (key if name == "api_key" else serve).add_argument(
            "--" + name.replace("_", "-"), type=parse, default=default, metavar=flag.metavar, help=flag.help)
        if name == "api_key":
            key.add_argument("--api-key-file", metavar="PATH",
                             help="the same, the key read from a file (not visible in ps)")

    tune = commands.add_parser(
        "tune", help="measure this CPU's row thresholds and keep them for every later run here",
        description="Measure, on this machine, from how many rows each format's products leave the few-rows "
        "kernel for BLAS or the integer tiles, and write the thresholds to the tuning file (GPT2NUMBA_TUNING: "
        "off, or a path; default ~/.cache/gpt2numba/tuning.json), which every later process on this CPU reads "
        "at import. A minute or two; `gpt2numba check` says which values were measured.")
    tune.add_argument("--threads", type=in_range(int, 1), help="threads to use (default: the cores)")
    tune.add_argument("--repeat", type=in_range(int, 1), default=5,
                      help="runs of each kernel at each row count (their median; default 5)")
    tune.add_argument("--layers", type=in_range(int, 1, 12), default=4,
                      help="layers of GPT-2 small's matrices a run multiplies, 1 to 12 (default 4: 113 MB in float32)")
    tune.add_argument("--only", choices=list(TUNABLE), action="append", metavar="THRESHOLD",
                      help=f"tune only this threshold (repeatable; one of {', '.join(TUNABLE)}); the others keep "
                      "their current values")
    tune.add_argument("--dry-run", action="store_true", help="measure and print, write nothing")
    tune.add_argument("--idle-patience", type=in_range(float, 0), default=10.0, metavar="SECONDS",
                      help="wait up to this long for a quiet machine before each row count (0: do not wait; "
                      "default 10)")

    commands.add_parser("bench", help="the benchmark against transformers (gpt2numba bench --help)")
    return parser


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
    print(f"gpt2numba: {len(docs)} documents, {tokens} tokens scored{_totals(nll, tokens, n_bytes)}; "
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
    print(f"gpt2numba: wrote {args.html}: {len(documents)} documents, {tokens} tokens", file=sys.stderr)
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
    print(f"gpt2numba: {docs} documents on Ray, {tokens} tokens scored{_totals(nll, tokens)}; {seconds:.1f} s with "
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
    t0 = time.perf_counter()
    w, _, source = resolve_model(args.model, args.dtype, args.activations)
    cfg = w.config
    print(f"weights: {source}: {cfg.n_layer} layers, {cfg.n_head} heads, n_embd {cfg.n_embd}, "
          f"vocab {cfg.vocab_size}, {w.dtype}{', bfloat16 activations' * (w.activations == 'bfloat16')}; "
          f"loaded in {time.perf_counter() - t0:.2f} s")
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
        print(f"prompt {n + 1}: {args.prompt_len} tokens + {args.decode} decoded, "
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
    print(f"{'all' if not failures else failures} of {args.prompts} prompts and the batch "
          f"{'match' if not failures else 'do NOT match'} the oracle "
          f"(allclose atol={tolerance(w)}, rtol={RTOL}, same argmax); "
          f"worst |diff| {worst:.2e}")
    return 1 if failures else 0


def _compare(logits, ids, w) -> tuple[float, bool]:
    ref = recompute_logits(ids, w)
    return float(np.abs(logits - ref).max()), agreement(logits, ref, w)[0]


def _word(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return text



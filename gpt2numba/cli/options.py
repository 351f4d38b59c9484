"""Every command's flags (build_parser), each number checked against its range as it is parsed
(argtypes.in_range) and each known only by its full name, and the words before argparse reads them (unswallowed):
an option whose values are optional or many takes only words of its values' form. commands.py runs the commands,
generate.py generate's work."""

from __future__ import annotations

import argparse
import math
import re

from .. import __version__
from ..argtypes import in_range
from ..cpu.tuning import TUNABLE
from ..model.compact import ACTIVATIONS, DTYPES
from ..model.kvcache import KV_DTYPES
from ..serve.config import flags as serve_flags  # (no web framework)
from ..text.report import REPORT_DOCUMENTS
from . import generate


# The options whose values are optional (--ray [ADDRESS]) or many (--eos-token-id ID [ID ...]): the form of a value,
# and how many it takes at most. argparse gives such an option every word that follows it, so that
# `score --ray corpus.txt` scored stdin on a cluster named corpus.txt; unswallowed leaves it only words of that form.
_VALUE_FORMS = {"--ray": (re.compile(r"auto|local|ray://\S+|[^/\s]+:\d+"), 1),  # ray.init's addresses
               "--eos-token-id": (re.compile(r"-?\d+"), math.inf)}
_RAY_ADDRESS_HELP = ("the address of an existing cluster (auto, HOST:PORT or ray://HOST:PORT; any other as "
                     "--ray=ADDRESS: a word of another form after --ray is not taken for an address), or none to start "
                     "a local one")


def unswallowed(argv: list[str]) -> list[str]:
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
    model_help = ("checkpoint directory, .safetensors or .gguf file (llama.cpp's; the [gguf] extra), or a Hugging "
                  "Face name such as gpt2 or openai-community/gpt2 (needs the [hub] extra and network; a local path of that name wins: "
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
    for command in (parser, *commands.choices.values()):  # flags in full only: an abbreviation (--ra for --ray)
        command.allow_abbrev = False  # would get past unswallowed and swallow the FILE or PROMPT after it
    return parser


def _word(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return text

"""gpt2numba generate: which flags go together, then sampling (streamed, or several samples) or beam search, for one
PROMPT or a prompts file (one JSON line per prompt, or per sample). The flags themselves are defined in options.py
with the other commands'; their names here are argparse's (``--top-k`` is ``top_k``)."""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

from ..decoding.constraints import KINDS
from ..errors import CacheFullError, GPT2NumbaError, PartialBatchError
from ..model.models import RANDOM_NOTE, resolve_model
from ..text.documents import read, utf8
from .summary import count, rate, since_start, start


# The library's settings by the flag that sets them: Sampler's alone, beam_search's alone, and both's
# (bad_words_ids comes from --bad-words, through the tokenizer). A flag left out takes the library's default.
SAMPLER = ("temperature", "top_k", "top_p", "min_p", "typical_p", "presence_penalty", "frequency_penalty")
BEAM = ("length_penalty", "early_stopping")
BOTH = ("repetition_penalty", "no_repeat_ngram_size", "min_new_tokens", "eos_token_id")
SPECULATION = ("draft", "num_speculative_tokens", "prompt_lookup", "max_matching_ngram_size")
SAMPLING_ONLY = SAMPLER + ("seed", "batch_size", "no_stop", "slide") + SPECULATION  # what beam search has no use for
EARLY_STOPPING = {"true": True, "false": False, "never": "never"}


def conflict(args) -> str | None:
    """What is wrong with the flags given together, naming them; None when they go together."""
    if args.prompt is None and args.prompts_file is None:
        return "give a PROMPT to continue, or --prompts-file"
    if args.prompt is not None and args.prompts_file is not None:
        return "give a PROMPT or --prompts-file, not both"
    if args.prompts_file is None and args.batch_size is not None:
        return "--batch-size goes with --prompts-file"
    if args.prompts_file is not None and args.slide:
        return "--slide goes with a single PROMPT, not --prompts-file"
    if args.ray is not None and args.prompts_file is None:
        return "--ray goes with --prompts-file"
    if args.ray is None and (given := _given(args, ("output", "format"))):
        return f"{_flags(given)} {_go(given)} with --ray"
    if len(given := _given(args, KINDS)) > 1:  # (each flag is named as the library's argument)
        return f"give at most one of {_flags(KINDS)}; got {_flags(given)}"
    if given and args.ray is not None:
        return f"{_flags(given)} goes without --ray: the Ray workers generate without a constraint"
    if problem := _speculation_conflict(args, given):
        return problem
    n = args.num_return_sequences or 1
    if args.num_beams > 1:
        if given := _given(args, SAMPLING_ONLY):
            return f"{_flags(given)} {_go(given)} with sampling, not beam search (--num-beams {args.num_beams})"
        if n > args.num_beams:
            return (f"--num-return-sequences {n} is more than --num-beams {args.num_beams}: beam search returns "
                    "at most one text per beam")
        if args.max_new_tokens == 0:  # (beam_search's own message would name its argument, not the flag)
            return (f"--max-new-tokens 0 goes with sampling, not beam search (--num-beams {args.num_beams}): a "
                    "search chooses one new token or more")
        return None
    if given := _given(args, BEAM):
        return f"{_flags(given)} {_go(given)} with beam search: add --num-beams N (N > 1)"
    if n > 1 and args.temperature == 0:
        return (f"--num-return-sequences {n} with --temperature 0 prints one greedy text {n} times: sample "
                f"(--temperature above 0) or search (--num-beams {n})")
    if n > 1 and args.slide:
        return "--slide goes with one text, not --num-return-sequences > 1"
    return None


def _speculation_conflict(args, constraint: list[str]) -> str | None:
    """What is wrong with the speculative decoding flags given together (``constraint``: the structured
    output flag given, if any)."""
    if args.draft is not None and args.prompt_lookup is not None:
        return "give --draft or --prompt-lookup, not both"
    if args.num_speculative_tokens is not None and args.draft is None:
        return "--num-speculative-tokens goes with --draft"
    if args.max_matching_ngram_size is not None and args.prompt_lookup is None:
        return "--max-matching-ngram-size goes with --prompt-lookup"
    speculating = _given(args, ("draft", "prompt_lookup"))
    if speculating and args.num_beams == 1 and (others := constraint + _given(args, ("slide",))):
        return f"{_flags(speculating)} goes without {_flags(others)}: speculative decoding does not take them yet"
    return None


def _given(args, names) -> list[str]:
    return [name for name in names if getattr(args, name) is not None and getattr(args, name) is not False]


def _flags(names) -> str:
    return ", ".join("--" + name.replace("_", "-") for name in names)


def _go(names) -> str:
    return "goes" if len(names) == 1 else "go"


def run(args) -> int:
    """The generate command; 2 for flags that do not go together (before anything is loaded), else 0. Raises
    what the library raises for a value out of range (cli.main prints it on one line)."""
    from ..text.tokenizer import load_tokenizer

    if problem := conflict(args):
        print(f"gpt2numba: error: {problem}", file=sys.stderr)
        return 2
    t0, before_run = time.perf_counter(), since_start()
    prompts = None if args.prompts_file is None else read_prompts(args.prompts_file)
    if args.ray is not None:  # the weights are the workers' to load; the tokenizer here reads --bad-words
        w, path = None, args.model or os.environ.get("GPT2NUMBA_WEIGHTS") or None
        tokenizer = load_tokenizer(path if path is not None and Path(path).exists() else None)
    else:
        t_weights = time.perf_counter()
        w, path, _ = resolve_model(args.model, args.dtype, args.activations)
        t_tokenizer = time.perf_counter()
        tokenizer = load_tokenizer(path)
        started = start(before_run, weights=t_tokenizer - t_weights, tokenizer=time.perf_counter() - t_tokenizer)
    if path is None:
        print(f"gpt2numba: {RANDOM_NOTE}", file=sys.stderr)
    vocab = w.config.vocab_size if w is not None else math.inf  # (on Ray the workers hold the weights, and check)
    if past := [t for t in args.eos_token_id or [] if t >= vocab]:
        raise GPT2NumbaError(f"--eos-token-id {' '.join(map(str, past))}: past the model's vocabulary of {vocab} "
                             f"ids (0 to {vocab - 1})")
    n = args.num_return_sequences or 1
    beam = args.num_beams > 1
    options = {name: getattr(args, name) for name in (BEAM if beam else SAMPLER) + BOTH
               if getattr(args, name) is not None}
    if args.bad_words:
        options["bad_words_ids"] = bad_words_ids(args.bad_words, tokenizer)
    options.update(max_new_tokens=args.max_new_tokens, kv_dtype=args.kv_dtype)
    options.update(structured(args, tokenizer, vocab))
    if beam:
        options.update(num_beams=args.num_beams, num_return_sequences=n,
                       early_stopping=EARLY_STOPPING[args.early_stopping or "false"])
        if args.ray is not None:
            return _on_ray(prompts, args, options, n, beam)
        if prompts is not None:
            return _beams_batch(prompts, w, tokenizer, options)
        return _beams(args.prompt, w, tokenizer, options, t0)
    options.update(seed=args.seed, stop_at_eos=not args.no_stop)
    options.update(speculation(args, w))
    if args.ray is not None:
        return _on_ray(prompts, args, dict(options, num_return_sequences=n), n, beam)
    if prompts is not None:
        return _batch(prompts, w, tokenizer, args.batch_size, n, options)
    if n > 1:
        return _samples(args.prompt, w, tokenizer, n, options, t0)
    return _stream(args.prompt, w, tokenizer, args.slide, options, t0, started)


def structured(args, tokenizer, vocab) -> dict:
    """The structured-output flag given as the library's argument ({} for none), with the tokenizer; compiled
    here first so that an error names the flag (the library's cache makes the second compile free)."""
    from ..decoding.constraints import constraint
    from ..errors import GrammarError

    given = _given(args, KINDS)
    if not given:
        return {}
    name = given[0]
    flag = "--" + name.replace("_", "-")
    value = getattr(args, name)
    if name in ("json_schema", "grammar"):
        flag += f" {value}"
        value = utf8(read(value), value, 1) if Path(value).is_file() else None
        if value is None:
            raise GPT2NumbaError(f"{flag}: no such file")
    try:
        constraint(**{name: value}, tokenizer=tokenizer, vocab_size=None if vocab == math.inf else vocab)
    except GrammarError as e:  # (named as the flag, not as the library's argument)
        raise GPT2NumbaError(f"{flag}: {e.detail if e.argument else e}") from None
    return {name: value, "tokenizer": tokenizer}


def speculation(args, w) -> dict:
    """The speculative decoding flags given, as the library's arguments; --draft's weights made or loaded here
    first (not on Ray, whose workers hold the weights), so that an error names the flag; the library keeps them
    for the call that follows, by the name or path given (a compact format's name: its draft reads the model's
    cache)."""
    from ..decoding import speculative

    options = {"num_speculative_tokens": args.num_speculative_tokens, "prompt_lookup_num_tokens": args.prompt_lookup,
               "max_matching_ngram_size": args.max_matching_ngram_size}
    options = {name: value for name, value in options.items() if value is not None}
    if args.draft is not None:
        if w is not None:
            speculative.draft_weights(w, args.draft, f"--draft {args.draft}")
        options["draft"] = args.draft
    return options


def bad_words_ids(words: list[str], tokenizer) -> list[list[int]]:
    """The ids of each word with a space before it, as transformers' NoBadWordsLogitsProcessor recommends
    (a tokenizer with add_prefix_space=True): GPT-2 writes a word inside a text with its space."""
    return [tokenizer.encode(" " + word) for word in words]


def _stream(prompt, w, tokenizer, slide, options, t0, started: str) -> int:
    """One text, written as its tokens arrive; on stderr, when the first token came, a decode step's time and
    where the start went (``started``: summary.start's)."""
    from ..decoding.sample import generate, prompt_ids, text_stream

    ids = prompt_ids(prompt, tokenizer)
    context, wanted = w.config.n_positions, len(ids) + options["max_new_tokens"]
    if not slide and wanted > context:  # (generate says so too, naming its parameters: here, the flags)
        raise CacheFullError(f"the prompt's {count(len(ids), 'token')} and --max-new-tokens "
                             f"{options['max_new_tokens']} make {wanted}, past the model's context of {context} "
                             "positions: ask for fewer new tokens, or give --slide")
    tokens = generate(ids, w, slide=slide, **options)
    sys.stdout.write(prompt)
    sys.stdout.flush()
    t_start = time.perf_counter()
    stamps = []
    for token, text in text_stream(tokens, tokenizer):
        if token is not None:
            stamps.append(time.perf_counter())
        sys.stdout.write(text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    summary = f"{count(len(ids), 'prompt token')}, {count(len(stamps), 'new token')}"
    if stamps:  # (no prefill rate: the first call's time is mostly the compiled kernels' loading)
        summary += (f"; first token after {stamps[0] - t_start:.2f} s (the first call: prefill and loading the "
                    "compiled kernels)")
    if len(stamps) > 1:
        gaps = np.diff(stamps)  # a speculative step's tokens come in a burst (their median gap is 0): the mean
        speculating = "draft" in options or "prompt_lookup_num_tokens" in options
        summary += f", decode {1e3 * (gaps.mean() if speculating else np.median(gaps)):.1f} ms/token"
    elif stamps:
        summary += ", no decode step"
    before_run = since_start()  # (the whole process where it is known; else from the command's start)
    print(f"gpt2numba: {summary}; {before_run or time.perf_counter() - t0:.1f} s in all ({started})", file=sys.stderr)
    return 0


def _samples(prompt, w, tokenizer, n, options, t0) -> int:
    """n samples of one prompt in one batch (generate_batch's n), each written whole once all are done."""
    from ..decoding.sample import generate_batch, prompt_ids

    ids = prompt_ids(prompt, tokenizer)
    texts = [[] for _ in range(n)]
    for j, token in generate_batch([ids], w, n=n, **options):
        texts[j].append(token)
    _write_texts(prompt, texts, tokenizer)
    print(f"gpt2numba: {count(len(ids), 'prompt token')}, {n} samples of {', '.join(str(len(t)) for t in texts)} new "
          f"tokens; {time.perf_counter() - t0:.1f} s in all", file=sys.stderr)
    return 0


def _beams(prompt, w, tokenizer, options, t0) -> int:
    """beam_search's hypotheses of one prompt, best first, each written whole; their scores on stderr."""
    from ..decoding.beams import beam_search
    from ..decoding.sample import prompt_ids

    ids = prompt_ids(prompt, tokenizer)
    found = beam_search(ids, w, **options)
    _write_texts(prompt, [h.ids for h in found], tokenizer)
    lengths = (count(len(found[0].ids), "new token") if len(found) == 1
               else f"{', '.join(str(len(h.ids)) for h in found)} new tokens")
    print(f"gpt2numba: {count(len(ids), 'prompt token')}, beam search of {options['num_beams']} beams: "
          f"{count(len(found), 'hypothesis', 'hypotheses')} of {lengths}, "
          f"scores {', '.join(f'{h.score:.4f}' for h in found)}; "
          f"{time.perf_counter() - t0:.1f} s in all", file=sys.stderr)
    return 0


def _write_texts(prompt, texts, tokenizer) -> None:
    """Each text as the prompt and its continuation (without <|endoftext|>) on a line of its own."""
    for ids in texts:
        sys.stdout.write(prompt + _text(ids, tokenizer) + "\n")
    sys.stdout.flush()


def _text(ids, tokenizer) -> str:
    return tokenizer.decode([t for t in ids if t != tokenizer.eot_id])


def read_prompts(path: str) -> list[str]:
    """Prompts from a file ("-": stdin): JSON lines with a "prompt" field, or else one prompt per line (blank lines
    skipped)."""
    text = utf8(read(path), "<stdin>" if path == "-" else path, 1)
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise GPT2NumbaError(f"{path}: no prompts in the file")
    if not lines[0][1].lstrip().startswith("{"):
        return [line for _, line in lines]
    prompts = []
    for n, line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise GPT2NumbaError(f"{path}, line {n}: not a JSON object ({e.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise GPT2NumbaError(f'{path}, line {n}: expected an object with a string "prompt" field')
        prompts.append(record["prompt"])
    return prompts


def _batch(prompts, w, tokenizer, batch_size, n, options) -> int:
    """One JSON line per text as it finishes (with n > 1, its "sample" j of the prompt "index"); a progress bar
    and the aggregate tokens/s on stderr. A sequence that fails (generate_batch's PartialBatchError) gets its
    error in place of its text once the others are done, and the command fails naming its prompt (_failed)."""
    from tqdm import tqdm

    from ..decoding.sample import _batch_steps, prompt_ids

    ids = [prompt_ids(p, tokenizer) for p in prompts]
    tokens = {i: [] for i in range(len(prompts) * n)}  # by sequence: prompt i // n, its sample i % n
    t0 = time.perf_counter()

    def write(i, error=None):
        record = {"index": i // n, "sample": i % n} if n > 1 else {"index": i}
        record["prompt"] = prompts[i // n]
        if error is None:
            record.update(text=_text(tokens[i], tokenizer), tokens=tokens[i])
        else:  # (its tokens so far are no text of its)
            record["error"] = _said(error)
        print(json.dumps(record), flush=True)
        bar.update()
    errors = {}  # sequence -> what failed it
    with tqdm(total=len(tokens), unit="prompt" if n == 1 else "sample", file=sys.stderr, desc="generate") as bar:
        pending = set(tokens)
        try:
            for i, token, done, _ in _batch_steps(ids, w, batch_size=batch_size, n=n, **options):
                tokens[i].append(token)
                if done:
                    write(i)
                    pending.discard(i)
        except PartialBatchError as e:  # (every other sequence finished)
            errors = e.errors
        for i in sorted(pending):  # a failed one's error; max_new_tokens 0: nothing was generated, still a record
            write(i, errors.get(i))
    seconds = time.perf_counter() - t0
    total = sum(map(len, tokens.values()))
    speed = rate(total, seconds)
    print(f"gpt2numba: {count(len(prompts), 'prompt')}{f' x {n} samples' if n > 1 else ''}, "
          f"{count(total, 'new token')} in "
          f"{seconds:.1f} s" + (f": {speed} (batch size {min(batch_size or len(tokens), len(tokens))}, prefills "
                                "included)" if speed else ""), file=sys.stderr)
    if errors:
        by_prompt = {}
        for i in sorted(errors):  # (a prompt's first failed sample speaks for it)
            by_prompt.setdefault(i // n, _said(errors[i]))
        raise _failed(by_prompt, len(prompts))
    return 0


def _beams_batch(prompts, w, tokenizer, options) -> int:
    """beam_search_batch over every prompt, then one JSON line per prompt with its hypotheses, best first, or the
    error that failed its search (PartialBatchError), and then the command fails naming it (_failed)."""
    from ..decoding.beams import beam_search_batch
    from ..decoding.sample import prompt_ids

    t0 = time.perf_counter()
    try:
        found, errors = beam_search_batch([prompt_ids(p, tokenizer) for p in prompts], w, **options), {}
    except PartialBatchError as e:  # (every other search finished)
        found = [hypotheses or [] for hypotheses in e.results]
        errors = {i: _said(error) for i, error in e.errors.items()}
    for i, (prompt, hypotheses) in enumerate(zip(prompts, found)):
        print(json.dumps({"index": i, "prompt": prompt, "error": errors[i]} if i in errors else {
            "index": i, "prompt": prompt, "hypotheses": [
                {"text": _text(h.ids, tokenizer), "tokens": h.ids, "score": h.score if math.isfinite(h.score) else None}
                for h in hypotheses]}), flush=True)
    seconds = time.perf_counter() - t0
    total = sum(len(h.ids) for hypotheses in found for h in hypotheses)
    print(f"gpt2numba: {count(len(prompts), 'prompt')}, beam search of {options['num_beams']} beams: "
          f"{count(sum(map(len, found)), 'hypothesis', 'hypotheses')}, {count(total, 'new token')} in "
          f"{seconds:.1f} s", file=sys.stderr)
    if errors:
        raise _failed(errors, len(prompts))
    return 0


def _on_ray(prompts, args, options, n, beam) -> int:
    """generate --ray: the prompts as a Ray dataset (index, prompt), generated by a pool of workers
    (distributed.generate_dataset, each row on its index's random streams); the records the in-process paths
    write, to stdout in the prompts' order, or to --output as JSON lines or Parquet; a row that failed (its error
    column) gets its error in place of the text, and the command fails naming it (_failed)."""
    from ..integrations.distributed import cluster, generate_dataset, write

    t0 = time.perf_counter()
    with cluster(args.ray) as ray:
        import pyarrow.compute as pc  # (Ray Data's; installed with it)

        ds = ray.data.from_items([{"index": i, "prompt": p} for i, p in enumerate(prompts)])
        generated = generate_dataset(ds, args.model, dtype=args.dtype, activations=args.activations,
                                     threads_per_worker=args.threads, index_column="index",
                                     batch_size=args.batch_size or 64, **options).materialize()
        to_records = functools.partial(records, n=n, beam=beam)
        if args.output:
            written = generated.flat_map(to_records)
            write(written, args.output, args.format)
        else:
            found = [record for row in generated.iter_rows() for record in to_records(row)]
            for record in sorted(found, key=lambda r: (r["index"], r.get("sample", 0))):
                print(json.dumps(record), flush=True)
        tokens, errors = 0, {}  # from the blocks in hand, as score --ray counts
        for batch in generated.iter_batches(batch_size=None, batch_format="pyarrow"):
            tokens += len(pc.list_flatten(batch.column("completion_ids"), recursive=True))
            failed = zip(batch.column("index").to_pylist(), batch.column("error").to_pylist())
            errors.update((index, error) for index, error in failed if error is not None)
    print(f"gpt2numba: {count(len(prompts), 'prompt')}{f' x {n}' if n > 1 else ''} on Ray, "
          f"{count(tokens, 'new token')}; "
          f"{time.perf_counter() - t0:.1f} s" + (" with the cluster's start" if args.ray == "local" else "")
          + (f"; written to {args.output}" if args.output else ""), file=sys.stderr)
    if errors:
        raise _failed(errors, len(prompts))
    return 0


def records(row: dict, n: int, beam: bool) -> list[dict]:
    """The JSON records of a row of distributed.generate_dataset (index, prompt and the completions), as
    _batch and _beams_batch write them: one per sample, or one per prompt with its hypotheses; a row that failed
    (its completions null) has its error in their place, in each of its samples' records."""
    index, prompt = int(row["index"]), row["prompt"]
    if row.get("error") is not None:
        if n == 1 or beam:
            return [{"index": index, "prompt": prompt, "error": row["error"]}]
        return [{"index": index, "sample": j, "prompt": prompt, "error": row["error"]} for j in range(n)]
    texts, ids = ([row[name]] if n == 1 else list(row[name]) for name in ("completion", "completion_ids"))
    ids = [[int(t) for t in tokens] for tokens in ids]
    if beam:
        scores = [row["score"]] if n == 1 else list(row["score"])
        return [{"index": index, "prompt": prompt, "hypotheses": [
            {"text": text, "tokens": tokens, "score": score if score is not None and math.isfinite(score) else None}
            for text, tokens, score in zip(texts, ids, scores)]}]
    if n == 1:
        return [{"index": index, "prompt": prompt, "text": texts[0], "tokens": ids[0]}]
    return [{"index": index, "sample": j, "prompt": prompt, "text": text, "tokens": tokens}
            for j, (text, tokens) in enumerate(zip(texts, ids))]


def _said(error: Exception) -> str:
    """An error as a record says it, and as distributed.generate_dataset's error column does: "Type: message"."""
    return f"{type(error).__name__}: {error}"


def _failed(errors: dict[int, str], total: int) -> GPT2NumbaError:
    """What the command ends with once every record is written, when prompts failed: how many of ``total``,
    which (``errors``: each one's index -> its error, as its record says it; the first ten named) and the first
    one's error."""
    failed = sorted(errors)
    named = ", ".join(map(str, failed[:10])) + (", ..." if len(failed) > 10 else "")
    return GPT2NumbaError(f"{len(failed)} of {count(total, 'prompt')} failed ({named}; their records say why), the "
                          f"others finished; {failed[0]}: {errors[failed[0]]}")

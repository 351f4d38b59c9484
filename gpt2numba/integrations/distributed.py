"""Scoring a corpus, and generating from many prompts, on a Ray cluster with Ray Data (the optional extra [ray]).

    import ray
    ray.init(address="auto")                         # an existing cluster; without it, a local one
    ds = ray.data.read_json("s3://bucket/corpus/")   # any Ray Data source with a text column
    score_dataset(ds, "/models/gpt2").write_json("s3://bucket/scored/")
    docs = read_documents(["essays/"], lines=False)  # source, index, text: as gpt2numba score splits files
    prompts = ray.data.read_json("s3://bucket/prompts/")   # a "prompt" column: text, or lists of token ids
    generate_dataset(prompts, "/models/gpt2", max_new_tokens=32, seed=0, top_p=0.9).write_json("s3://bucket/out/")

Ray Data reads, batches and schedules; each worker of an actor pool loads the weights
once (the callable class's __init__) and scores its batches with score_batch, or generates
from them with generate_batch (continuous batching) or beam_search_batch (__call__). Nothing
here computes: the arithmetic is scoring.py's, sample.py's and beams.py's. The model path
must exist on every node.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..decoding import speculative
from ..errors import CacheFullError, ConfigError, GPT2NumbaError, PartialBatchError, SamplingError, TokenTypeError
from ..model import checks
from ..text.documents import field_of, split


class _Scorer:
    """One Ray worker: the weights, loaded once; a batch of texts in, the batch with its scores out."""

    def __init__(self, model, dtype, activations, text_column, stride, threads):
        from ..model.forward import set_threads
        from ..model.models import resolve_model
        from ..text.tokenizer import load_tokenizer

        set_threads(threads)
        self.w, path, _ = resolve_model(model, dtype, activations)
        self.tokenizer = load_tokenizer(path)
        self.text_column, self.stride = text_column, stride

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from ..text.scoring import score_batch

        if self.text_column not in batch:
            raise ConfigError(f"no column {self.text_column!r} in the dataset; it has {sorted(batch)}")
        texts = [str(t) for t in batch[self.text_column]]
        scores = score_batch([self.tokenizer.encode(t) for t in texts], self.w, stride=self.stride)
        batch["tokens"] = np.array([s.n_tokens for s in scores], np.int64)
        batch["nll"] = np.array([s.nll for s in scores])
        batch["perplexity"] = np.array([s.perplexity for s in scores])
        batch["bits_per_byte"] = np.array([s.nll / math.log(2) / n if (n := len(t.encode("utf-8"))) and s.n_tokens
                                           else math.nan for s, t in zip(scores, texts)])  # (NaN: none scored)
        return batch


@contextlib.contextmanager
def cluster(address: str):
    """Ray joined at ``address`` ("local": a new cluster here) for the block, shut down after it: the command
    line's --ray. GPT2NumbaError naming the extra when Ray is not installed."""
    try:
        import ray
    except ImportError:
        raise GPT2NumbaError("--ray needs Ray Data: pip install -e \".[ray]\"") from None
    ray.init(address=address, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def write(ds, output, format: str) -> None:
    """Write a dataset's rows under the directory ``output`` as Parquet or JSON lines (--output, --format)."""
    (ds.write_parquet if format == "parquet" else ds.write_json)(str(output))


def score_dataset(ds, model: str | None, *, dtype: str = "float32", activations: str = "float32",
                  text_column: str = "text", stride: int | None = None, threads_per_worker: int | None = None,
                  concurrency: int | None = None, batch_size: int = 64):
    """``ds`` (a ray.data.Dataset with a text column) plus tokens, nll, perplexity and bits_per_byte columns.

    model: a checkpoint path on every node (or None: $GPT2NUMBA_WEIGHTS, else random GPT-2 small), kept as
    ``dtype``, its products taking ``activations`` (docs/formats.md); each worker takes threads_per_worker
    CPUs (default 1) and ``concurrency`` workers run (default: as many as the cluster's CPUs allow, less one
    for reading). Lazy, as Ray Data is: nothing runs until the result is
    read or written. Raises ConfigError for settings out of range; a missing column is reported by
    the workers when the data is read.
    """
    import ray

    from ..model.weights import check_dtype

    if stride is not None and (not checks.is_integer(stride) or stride < 1):
        raise ConfigError(f"stride must be an integer >= 1, got {stride!r}")
    check_dtype(dtype, activations=activations)
    threads, concurrency = _pool(threads_per_worker, concurrency, batch_size)
    return ds.map_batches(_Scorer, fn_constructor_args=(model, dtype, activations, text_column, stride, threads),
                          batch_size=batch_size, batch_format="numpy", num_cpus=threads,
                          compute=ray.data.ActorPoolStrategy(size=concurrency))


def _pool(threads_per_worker: int | None, concurrency: int | None, batch_size: int) -> tuple[int, int]:
    """(threads per worker, workers) of an actor pool, checked: threads_per_worker default 1; concurrency
    default as many workers as the cluster's CPUs allow, less one CPU for Ray Data's reading (a full pool
    starves its read tasks). ConfigError naming a value out of range (batch_size too: an integer >= 1)."""
    import ray

    threads = 1 if threads_per_worker is None else threads_per_worker
    if not checks.is_integer(threads) or threads < 1:
        raise ConfigError(f"threads_per_worker must be an integer >= 1, got {threads_per_worker!r}")
    if not checks.is_integer(batch_size) or batch_size < 1:
        raise ConfigError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    if concurrency is None:
        concurrency = max(1, (int(ray.cluster_resources().get("CPU", 1)) - 1) // threads)
    elif not checks.is_integer(concurrency) or concurrency < 1:
        raise ConfigError(f"concurrency must be an integer >= 1, got {concurrency!r}")
    return threads, concurrency


def read_documents(paths, *, lines: bool = False, field: str | None = None):
    """A ray.data.Dataset of the documents in ``paths`` (files or directories, read by Ray on its nodes):
    columns source, index and text, split as ``gpt2numba score`` splits files (documents.split): each file
    whole, one document a line with ``lines``, or JSON lines with the text in ``field`` (.jsonl files:
    "text"). source is the path as given (a file under a given directory: joined to it)."""
    import ray

    names = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    names = [str(name) for name in names]
    files = ray.data.read_binary_files(names, include_paths=True)
    return files.flat_map(functools.partial(_split_file, names=names, lines=lines, field=field))


def _split_file(row: dict, names: list[str], lines: bool, field: str | None) -> list[dict]:
    path = str(row["path"])
    source = _source(path, names)
    return [{"source": s, "index": n, "text": text}
            for s, n, text in split(row["bytes"], source, lines, field_of(path, field))]


def _source(path: str, names: list[str]) -> str:
    """The name a file was given by: Ray reports paths absolute, or without their scheme (s3://)."""
    for name in names:
        for given in {name, os.path.abspath(name), name.split("://", 1)[-1]}:
            given = given.rstrip("/")
            if path == given:
                return name
            if path.startswith(given + "/"):
                return os.path.join(name, path[len(given) + 1:])
    return path


# The columns generate_dataset adds: the completion's text (<|endoftext|> left out) and token ids, why it
# ended ("stop": an end-of-text id; "length": max_new_tokens), and when asked each token's log-probability;
# with beam search, each hypothesis's score too. With num_return_sequences > 1, each holds a list of them.
# "error": null, or what failed the row during the work ("SamplingError: ..."), its other columns then null.
GENERATED = ("completion", "completion_ids", "finish_reason", "logprobs", "score", "error")
_ROW = "__gpt2numba_row"  # the rows' numbers generate_dataset adds for seeded sampling (not in the output)


@dataclass(frozen=True)
class _Generation:
    """What every worker of generate_dataset runs, checked once in the driver."""

    column: str
    index_column: str | None  # the column of each row's number (its random streams), or None
    max_new_tokens: int
    n: int  # completions per prompt: samples, or the best hypotheses
    logprobs: bool
    beams: bool  # beam_search_batch, else _batch_steps (generate_batch's)
    options: dict  # their settings but the prompts, the weights and the streams
    eos: tuple[int, ...]  # the ids that end a completion ("stop"); none when it does not stop at them


def generate_dataset(ds, model: str | None, *, column: str = "prompt", max_new_tokens: int,
                     seed: int | None = None, num_beams: int = 1, num_return_sequences: int = 1,
                     logprobs: bool = False, stop_at_eos: bool = True, index_column: str | None = None,
                     dtype: str = "float32", activations: str = "float32", kv_dtype: str = "float32",
                     threads_per_worker: int | None = None,
                     concurrency: int | None = None, batch_size: int = 64, **settings):
    """``ds`` (a ray.data.Dataset with a prompt column) plus the columns of GENERATED: completion,
    completion_ids, finish_reason ("stop" or "length"), logprobs (with ``logprobs``: the model's
    log-probability of each token, float64), score (beam search's) and error: null, or for a row whose
    generation failed during the work (a sample of it: generate_batch's PartialBatchError) the type and
    message of its error, its other columns then null; the other rows are as without it.

    A prompt is text (an empty one starts from <|endoftext|>, as elsewhere) or a list of token ids (an
    empty list too). Each worker generates for batch_size rows at a time, all in flight together: with
    num_beams 1, generate_batch's sampling with ``settings`` (Sampler's: temperature, top_k, top_p, min_p,
    typical_p, repetition_penalty, no_repeat_ngram_size, min_new_tokens, eos_token_id, bad_words_ids,
    presence_penalty, frequency_penalty, logit_bias), ``seed`` and stop_at_eos; with num_beams > 1,
    beam_search_batch with its ``settings`` (length_penalty, early_stopping, and the processors it shares).
    num_return_sequences > 1: that many samples (generate_batch's n) or best hypotheses per prompt, each
    column a list of them. kv_dtype: the caches' (kvcache.KV_DTYPES).

    With a seed, row r's sample j draws from the stream (seed, r * n + j), as sequence r * n + j of one
    generate_batch over every prompt in order would: the same tokens whatever the workers and blocks. r is
    the row's value in ``index_column`` (distinct integers >= 0), or else its place in the dataset, which is
    then numbered here first (its blocks materialised, in the order Ray Data gives them: the source's
    when it keeps it). model, dtype, activations, threads_per_worker, concurrency and batch_size as
    score_dataset's.

    Lazy, as Ray Data is, but for that numbering. Every setting is checked before any of it, with the
    library's own checks (ids against the model's vocabulary when its config.json or safetensors header is
    at hand here): SamplingError, ConfigError, TokenError, CacheFullError. A prompt that is not text or
    ids, or too long for max_new_tokens, is reported by the workers when the data is read, naming its row.
    """
    import ray

    job = _generation(model, column, max_new_tokens, seed, num_beams, num_return_sequences, logprobs,
                      stop_at_eos, index_column, dtype, activations, kv_dtype, settings)
    threads, concurrency = _pool(threads_per_worker, concurrency, batch_size)
    if seed is not None and not job.beams and index_column is None:
        ds, job = _numbered(ds), dataclasses.replace(job, index_column=_ROW)
    return ds.map_batches(_Generator, fn_constructor_args=(model, dtype, activations, threads, job),
                          batch_size=batch_size, batch_format="pyarrow", num_cpus=threads,
                          compute=ray.data.ActorPoolStrategy(size=concurrency))


def _generation(model, column, max_new_tokens, seed, num_beams, n, logprobs, stop_at_eos, index_column,
                dtype, activations, kv_dtype, settings) -> _Generation:
    """generate_dataset's settings checked (by sample.py's and beams.py's checks) and gathered for its workers."""
    from ..decoding.beams import _Settings
    from ..decoding.sample import _settings
    from ..model.kvcache import check_kv_dtype
    from ..model.weights import check_dtype

    for name, value in (("column", column), ("index_column", index_column)):
        if not isinstance(value, str) and (value is not None or name == "column"):
            raise ConfigError(f"{name} must be a column's name, got {value!r}")
    check_dtype(dtype, activations=activations)
    checks.labelled("kv_dtype: ", check_kv_dtype, kv_dtype)
    if not isinstance(logprobs, bool):
        raise ConfigError(f"logprobs must be True or False, got {logprobs!r}")
    speculation = {name: settings.pop(name) for name in speculative.SETTINGS if name in settings}
    sizes = _model_sizes(model)
    vocab_size = sizes[0] if sizes else 2**62  # unknown here: the ids' upper bound is the workers' to check
    if sizes and checks.is_integer(max_new_tokens) and max_new_tokens >= sizes[1]:
        raise CacheFullError(f"max_new_tokens ({max_new_tokens}) leaves no room for a prompt in the model's "
                             f"context of {sizes[1]} positions")
    if not checks.is_integer(num_beams) or num_beams < 1:
        raise SamplingError(f"num_beams must be an integer >= 1, got {num_beams!r}")
    if num_beams > 1:
        if seed is not None or stop_at_eos is not True:
            raise SamplingError("seed and stop_at_eos go with sampling, not beam search (num_beams > 1)")
        if speculation:
            raise SamplingError(f"{', '.join(speculation)}: speculative decoding goes with sampling, not beam search "
                                "(num_beams > 1)")
        own = ("num_beams", "max_new_tokens", "num_return_sequences")  # generate_dataset's arguments
        checks.known_settings(settings, [f.name for f in dataclasses.fields(_Settings) if f.init and f.name not in own])
        search = _Settings(num_beams=num_beams, max_new_tokens=max_new_tokens, num_return_sequences=n, **settings)
        search.processors.check_vocab(vocab_size, default_eos=settings.get("eos_token_id") is None)
        options = dict(settings, num_beams=num_beams, max_new_tokens=max_new_tokens, num_return_sequences=n,
                       kv_dtype=kv_dtype)
        return _Generation(column, index_column, max_new_tokens, n, logprobs, True, options,
                           search.processors.eos_token_id)
    sampler = _settings(settings, vocab_size, max_new_tokens, seed)
    speculative.check(**speculation)  # (the draft itself is made or loaded by each worker, beside its weights)
    if not checks.is_integer(n) or n < 1:
        raise SamplingError(f"num_return_sequences must be an integer >= 1, got {n!r}")
    if not isinstance(stop_at_eos, bool):
        raise SamplingError(f"stop_at_eos must be True or False, got {stop_at_eos!r}")
    options = dict(settings, max_new_tokens=max_new_tokens, seed=seed, stop_at_eos=stop_at_eos, n=n,
                   kv_dtype=kv_dtype, **speculation)
    return _Generation(column, index_column, max_new_tokens, n, logprobs, False, options,
                       sampler.processors.eos_token_id if stop_at_eos else ())


def _model_sizes(model: str | None) -> tuple[int, int] | None:
    """(vocab_size, n_positions) of ``model`` from its config.json or its safetensors header, without reading
    the weights; None where it is not at hand here (a hub name, a path on the workers' nodes only)."""
    from ..model.config import GPT2Config

    model = model if model is not None else os.environ.get("GPT2NUMBA_WEIGHTS") or None
    if model is None:
        return GPT2Config.small().vocab_size, GPT2Config.small().n_positions
    path = Path(model)
    if (path / "config.json").is_file():
        cfg = GPT2Config.from_json(path / "config.json")
        return cfg.vocab_size, cfg.n_positions
    file = path / "model.safetensors" if path.is_dir() else path
    if not file.is_file():
        return None
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="numpy") as f:
            shapes = {name.removeprefix("transformer."): f.get_slice(name).get_shape() for name in f.keys()}
        return shapes["wte.weight"][0], shapes["wpe.weight"][0]
    except (SafetensorError, KeyError, IndexError):  # not a checkpoint: the workers' load_weights says why
        return None


def _numbered(ds):
    """``ds`` with a column _ROW: each row's number from 0, in the order of the dataset's blocks. The
    blocks are materialised (once) to count their rows."""
    import ray

    refs = ds.to_arrow_refs()
    sizes = ray.get([ray.remote(_num_rows).remote(ref) for ref in refs])
    starts = np.cumsum([0, *sizes[:-1]], dtype=np.int64)
    number = ray.remote(_with_rows)
    return ray.data.from_arrow_refs([number.remote(ref, int(start)) for ref, start in zip(refs, starts)])


def _num_rows(table) -> int:
    return table.num_rows


def _with_rows(table, start: int):
    import pyarrow as pa

    return table.append_column(_ROW, pa.array(np.arange(start, start + table.num_rows, dtype=np.int64)))


class _Generator:
    """One Ray worker: the weights, loaded once; a block of prompts in, the block with its completions out."""

    def __init__(self, model, dtype, activations, threads, job: _Generation):
        from ..model.forward import set_threads
        from ..model.models import resolve_model
        from ..text.tokenizer import load_tokenizer

        set_threads(threads)
        self.w, path, _ = resolve_model(model, dtype, activations)
        self.tokenizer = load_tokenizer(path)
        self.job = job

    def __call__(self, table):
        """A pyarrow.Table of rows in, the same rows plus the GENERATED columns out."""
        job = self.job
        for name in (job.column, job.index_column):
            if name is not None and name not in table.column_names:
                raise ConfigError(f"no column {name!r} in the dataset; it has {sorted(table.column_names)}")
        if taken := [name for name in GENERATED if name in table.column_names]:
            raise ConfigError(f"the dataset has a column {taken[0]!r}, which generate_dataset writes: rename it")
        rows = table.column(job.index_column).to_pylist() if job.index_column else None
        prompts = [self._ids(value, None if rows is None else rows[k])
                   for k, value in enumerate(table.column(job.column).to_pylist())]
        found = [] if not prompts else self._beams(prompts) if job.beams else self._sample(prompts, rows)
        for name, values in _columns(found, job, self.tokenizer).items():
            table = table.append_column(name, values)
        return table.drop_columns([_ROW]) if _ROW in table.column_names else table

    def _ids(self, value, row) -> list[int]:
        """A row's prompt as checked ids; errors name the row (its number, or the start of its prompt)."""
        from ..decoding.sample import prompt_ids

        cfg, job = self.w.config, self.job
        label = f"row {row}: " if row is not None else f"the prompt {str(value)[:40]!r}: "
        if row is not None and (not checks.is_integer(row) or row < 0):
            raise ConfigError(f"{job.index_column!r} must hold integers >= 0 (the rows' numbers), got {row!r}")
        if isinstance(value, str):
            ids = prompt_ids(value, self.tokenizer)
        elif value is None or isinstance(value, (bytes, dict)):
            raise TokenTypeError(f"{label}a prompt is text or a list of token ids, got {type(value).__name__}")
        else:  # an empty list starts from <|endoftext|>, as an empty text does
            ids = checks.labelled(label, checks.token_ids, value, cfg.vocab_size).tolist() if len(value) else [
                self.tokenizer.eot_id]
        if len(ids) + job.max_new_tokens > cfg.n_positions:
            raise CacheFullError(f"{label}{len(ids)} prompt tokens + max_new_tokens ({job.max_new_tokens}) pass "
                                 f"the model's context of {cfg.n_positions} positions")
        return ids

    def _sample(self, prompts, rows) -> list[list[tuple]]:
        """generate_batch over the block, each sequence on its row's streams: per prompt, n (ids, logprobs)."""
        from ..decoding.sample import _batch_steps
        from ..text.scoring import log_softmax

        n = self.job.n
        tokens = [[] for _ in range(len(prompts) * n)]
        logprobs = [[] for _ in tokens] if self.job.logprobs else None
        errors = {}  # prompt -> the error of its first sample that failed
        try:
            for i, token, _, row in _batch_steps(prompts, self.w, streams=rows, **self.job.options):
                tokens[i].append(token)
                if logprobs is not None:
                    logprobs[i].append(float(log_softmax(row[None])[0, token]))
        except PartialBatchError as e:  # (the other rows finished)
            for i in sorted(e.errors):
                errors.setdefault(i // n, e.errors[i])
        return [errors[k] if k in errors else
                [(tokens[i], None if logprobs is None else logprobs[i], None) for i in range(k * n, k * n + n)]
                for k in range(len(prompts))]

    def _beams(self, prompts) -> list[list[tuple] | Exception]:
        """beam_search_batch over the block: per prompt, its best hypotheses as (ids, logprobs, score), or the
        error that failed its search; the log-probabilities, when asked, from score_batch over the prompt and
        the hypothesis."""
        from ..decoding.beams import beam_search_batch
        from ..text.scoring import score_batch

        try:
            found, errors = beam_search_batch(prompts, self.w, **self.job.options), {}
        except PartialBatchError as e:  # (the other rows finished)
            found, errors = [hypotheses or [] for hypotheses in e.results], e.errors
        logprobs = None
        if self.job.logprobs:
            pairs = [ids + h.ids for ids, hypotheses in zip(prompts, found) for h in hypotheses]
            scores = iter(score_batch(pairs, self.w, kv_dtype=self.job.options["kv_dtype"]) if pairs else [])
            logprobs = [[next(scores).logprobs[len(ids) - 1:].tolist() for h in hs] for ids, hs in zip(prompts, found)]
        return [errors[k] if k in errors else
                [(h.ids, None if logprobs is None else logprobs[k][j], h.score) for j, h in enumerate(hypotheses)]
                for k, hypotheses in enumerate(found)]


def _columns(found: list[list[tuple] | Exception], job: _Generation, tokenizer) -> dict:
    """The GENERATED columns (pyarrow arrays) of the completions found: per prompt, n (ids, logprobs, score), or
    the exception that failed it (its columns null but its error)."""
    import pyarrow as pa

    eot = tokenizer.eot_id
    kinds = {"completion": (pa.string(), lambda ids, lp, score: tokenizer.decode([t for t in ids if t != eot])),
             "completion_ids": (pa.list_(pa.int64()), lambda ids, lp, score: ids),
             "finish_reason": (pa.string(), lambda ids, lp, score: "stop" if ids and ids[-1] in job.eos else "length")}
    if job.logprobs:
        kinds["logprobs"] = (pa.list_(pa.float64()), lambda ids, lp, score: lp)
    if job.beams:
        kinds["score"] = (pa.float64(), lambda ids, lp, score: score)
    columns = {}
    failed = [isinstance(completions, Exception) for completions in found]
    for name, (kind, value) in kinds.items():
        per_prompt = [None if bad else [value(*completion) for completion in completions]
                      for completions, bad in zip(found, failed)]
        columns[name] = (pa.array([None if bad else values[0] for values, bad in zip(per_prompt, failed)], kind)
                         if job.n == 1 else pa.array(per_prompt, pa.list_(kind)))
    columns["error"] = pa.array([f"{type(e).__name__}: {e}" if bad else None for e, bad in zip(found, failed)],
                                pa.string())
    return columns

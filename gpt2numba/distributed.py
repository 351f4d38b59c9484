"""Scoring a corpus on a Ray cluster, with Ray Data (the optional extra [ray]).

    import ray
    ray.init(address="auto")                         # an existing cluster; without it, a local one
    ds = ray.data.read_json("s3://bucket/corpus/")   # any Ray Data source with a text column
    score_dataset(ds, "/models/gpt2").write_json("s3://bucket/scored/")
    docs = read_documents(["essays/"], lines=False)  # source, index, text: as gpt2numba score splits files

Ray Data reads, batches and schedules; each worker of an actor pool loads the weights
once (the callable class's __init__) and scores its batches with score_batch
(__call__). Nothing here computes: the arithmetic is scoring.py's. The model path
must exist on every node.
"""

from __future__ import annotations

import functools
import math
import os

import numpy as np

from . import checks
from .documents import field_of, split
from .errors import ConfigError


class _Scorer:
    """One Ray worker: the weights, loaded once; a batch of texts in, the batch with its scores out."""

    def __init__(self, model, dtype, text_column, stride, threads):
        from .models import resolve_model
        from .forward import set_threads
        from .tokenizer import load_tokenizer

        set_threads(threads)
        self.w, path, _ = resolve_model(model, dtype)
        self.tokenizer = load_tokenizer(path)
        self.text_column, self.stride = text_column, stride

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from .scoring import score_batch

        if self.text_column not in batch:
            raise ConfigError(f"no column {self.text_column!r} in the dataset; it has {sorted(batch)}")
        texts = [str(t) for t in batch[self.text_column]]
        scores = score_batch([self.tokenizer.encode(t) for t in texts], self.w, stride=self.stride)
        batch["tokens"] = np.array([s.n_tokens for s in scores], np.int64)
        batch["nll"] = np.array([s.nll for s in scores])
        batch["perplexity"] = np.array([s.perplexity for s in scores])
        batch["bits_per_byte"] = np.array([s.nll / math.log(2) / n if (n := len(t.encode("utf-8"))) else math.nan
                                           for s, t in zip(scores, texts)])
        return batch


def score_dataset(ds, model: str | None, *, dtype: str = "float32", text_column: str = "text",
                  stride: int | None = None, threads_per_worker: int | None = None,
                  concurrency: int | None = None, batch_size: int = 64):
    """``ds`` (a ray.data.Dataset with a text column) plus tokens, nll, perplexity and bits_per_byte columns.

    model: a checkpoint path on every node (or None: $GPT2NUMBA_WEIGHTS, else random GPT-2 small);
    each worker takes threads_per_worker CPUs (default 1) and ``concurrency`` workers run (default:
    as many as the cluster's CPUs allow, less one for reading). Lazy, as Ray Data is: nothing runs until the result is
    read or written. Raises ConfigError for settings out of range; a missing column is reported by
    the workers when the data is read.
    """
    import ray

    threads = 1 if threads_per_worker is None else threads_per_worker
    if not checks.is_integer(threads) or threads < 1:
        raise ConfigError(f"threads_per_worker must be an integer >= 1, got {threads_per_worker!r}")
    if stride is not None and (not checks.is_integer(stride) or stride < 1):
        raise ConfigError(f"stride must be an integer >= 1, got {stride!r}")
    if not checks.is_integer(batch_size) or batch_size < 1:
        raise ConfigError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    if concurrency is None:  # one CPU is left to Ray Data's read tasks, or a full pool starves them
        concurrency = max(1, (int(ray.cluster_resources().get("CPU", 1)) - 1) // threads)
    elif not checks.is_integer(concurrency) or concurrency < 1:
        raise ConfigError(f"concurrency must be an integer >= 1, got {concurrency!r}")
    return ds.map_batches(_Scorer, fn_constructor_args=(model, dtype, text_column, stride, threads),
                          batch_size=batch_size, batch_format="numpy", num_cpus=threads,
                          compute=ray.data.ActorPoolStrategy(size=concurrency))


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

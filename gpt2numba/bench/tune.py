"""gpt2numba tune: the row thresholds of this machine's products, measured, and written where dispatch reads them.

Each threshold splits the products into a kernel for a few rows (it streams the matrix once, every
row's sums in registers) and one for many (BLAS, the integer tiles). For each, at 2, 3, 4, 6, ... 64
rows, both kernels run the same products in turns (--repeat times each, medians): GPT-2 small's four
block matrices of --layers layers in each format (random weights; more bytes than the caches hold, as a
pass reads them), and its head (wte, float32) for head_rows_max. The threshold is the largest row count
at which the few-rows kernel was as fast, before the many-rows kernel won twice in a row. They go to
cpu/tuning.py's file under this machine's key, and every later process here takes them at import
(`gpt2numba check` says which values were measured). A choice off by a step costs little: at the
crossing both kernels take about the same time. head_rows_max, measured on a float32 head, holds for
bfloat16's too, whose few-rows kernel gains more over BLAS (docs/performance.md, "Thresholds").
"""

from __future__ import annotations

import dataclasses
import datetime
import time

import numpy as np

from ..cpu import dispatch, pool, tuning
from ..errors import ConfigError
from ..model import compact, forward, products
from ..model.config import GPT2Config
from ..model.weights import random_weights
from .core import Load, machine, set_idle_patience, wait_for_idle

ROWS = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # the row counts tried (within tuning.TUNABLE's ranges)
FORMATS = {"rows_max": "float32", "bf16_rows_max": "bfloat16", "int_rows_max": "int8", "int4_rows_max": "int4",
           "head_rows_max": "head", "bf16_dot_rows_max": "bfloat16 activations"}
# (each of tuning.TUNABLE -> the products it is measured on: the head's wte in float32; bfloat16 activations:
# bfloat16 matrices and rounded inputs, rowtiles' tiles against paneltiles' panels, or BLAS without AVX512_BF16)


def run(args) -> int:
    if not args.dry_run and tuning.path() is None:  # (before a minute of measuring, not after)
        raise ConfigError("GPT2NUMBA_TUNING is off: nowhere to write the thresholds (unset it, set it to a path, "
                          "or add --dry-run)")
    set_idle_patience(args.idle_patience)
    threads = forward.get_threads()
    names = args.only or list(FORMATS)
    about = machine()
    print(f"gpt2numba tune: {about['cpu']}, {threads} threads; tuning file: {tuning.path() or 'none (GPT2NUMBA_TUNING=off)'}")
    print("rows: ms of the few-rows kernel / the many-rows kernel (medians), others' CPU share meanwhile")
    values = {k: v for k, v in dispatch.TUNING.values.items() if k not in names}
    measured = dict(dispatch.TUNING.entry.get("measured", {}))
    for name in names:
        runs = _products(FORMATS[name], args.layers, threads)
        value, figures = _threshold(runs, args.repeat)
        values[name], measured[name] = value, figures
        default = getattr(dispatch.DEFAULTS, name)
        print(f"{name}: {value} (default {default})  " + "  ".join(
            f"{rows}: {few:.2f}/{many:.2f}{'' if share is None else f' {100 * share:.0f}%'}"
            for rows, (few, many, share) in figures.items()))
    if args.dry_run:
        print("(--dry-run: nothing written)")
        return 0
    when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    file = tuning.save(dispatch.TUNING.key, values, {**measured, "threads": threads}, when)
    print(f"written to {file}: {', '.join(f'{k} {v}' for k, v in values.items())}; processes started from now on "
          "use them (GPT2NUMBA_TUNING=off: the defaults)")
    return 0


def _threshold(runs, repeat) -> tuple[int, dict]:
    """(the threshold, {rows: (few ms, many ms, others' share)}) for runs(rows) -> (few, many) callables."""
    figures = {}
    for rows in ROWS:
        few, many = runs(rows)
        times = ([], [])
        wait_for_idle()
        with pool.pinned(), products.one_blas_thread(), Load() as load:
            few(), many()  # compiled or loaded, buffers touched
            for r in range(repeat):
                for kernel, into in ((few, times[0]), (many, times[1]))[:: 1 if r % 2 == 0 else -1]:
                    t = time.perf_counter()
                    kernel()
                    into.append(time.perf_counter() - t)
        few_ms, many_ms = (1e3 * float(np.median(t)) for t in times)
        figures[rows] = (few_ms, many_ms, load.share)
        value, past = crossing(figures)
        if past:  # more rows only cost time
            break
    return value, figures


def crossing(figures: dict) -> tuple[int, bool]:
    """(the largest row count at which the few-rows kernel was as fast as the many-rows one, before the
    many-rows one won at two row counts in a row (1 if it won from the start); whether it did win twice in a
    row). figures: {rows: (few ms, many ms, ...)}, rows ascending."""
    value, losses = 1, 0
    for rows, (few, many, *_) in figures.items():
        if few <= many:
            value, losses = rows, 0
        else:
            losses += 1
            if losses == 2:
                return value, True
    return value, False


def _products(fmt: str, layers: int, threads: int):
    """runs(rows) -> (the few-rows kernel's run, the many-rows kernel's run) over the products of ``fmt``: a
    block format's matrices, or "head" (wte, float32)."""
    cfg = dataclasses.replace(GPT2Config.small(), n_layer=layers)
    rng = np.random.default_rng(0)
    n_chunks = dispatch.n_chunks(threads)
    if fmt == "head":
        wte = (0.02 * rng.standard_normal((cfg.vocab_size, cfg.n_embd), dtype=np.float32))
        jobs = [(wte, None, None)]
        w = None
    else:
        w = random_weights(cfg, seed=0, dtype="bfloat16" if fmt == "bfloat16 activations" else fmt)
        jobs = []
        for layer in range(layers):
            for field in compact.BLOCK_MATRICES:
                matrix = getattr(w, field)[layer]
                if fmt == "float32":
                    matrix = compact.to_rows(field, matrix)
                jobs.append((matrix, w.scales[field][layer] if w.scales else None,
                             getattr(w, field.replace("_w", "_b"))[layer]))

    def runs(rows):
        work = products.workspace(w, rows, threads) if w is not None else None
        data = [(m, s, b, rng.standard_normal((rows, _inputs(m, fmt)), dtype=np.float32),
                 np.empty((rows, m.shape[0]), np.float32)) for m, s, b in jobs]
        runs_of = {few: data for few in (True, False)}
        if fmt == "bfloat16 activations":  # the inputs rounded as a pass rounds them: bits or values (as_bits)
            runs_of = {few: [(m, s, b, work.rounded(x, products.as_bits(few)).copy(), out)
                             for m, s, b, x, out in data] for few in (True, False)}

        def kernel(few):
            def go():
                for m, s, b, x, out in runs_of[few]:
                    if fmt == "head":
                        products.head(m, x, out, n_chunks, few=few)
                    else:
                        products.product(x, m, s, b, out, False, work, n_chunks, few=few)
            return go
        return kernel(True), kernel(False)
    return runs


def _inputs(matrix, fmt) -> int:
    return matrix.shape[1] * 2 if fmt == "int4" else matrix.shape[1]  # (int4: two weights a byte)

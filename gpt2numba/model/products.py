"""The matrix products of a pass: which kernel multiplies, by the weights' format and the rows, and the
buffers a pass works in (kept per thread and weights, only ever grown).

Every product reads its matrix as stored, [out, in]: float32 as is and bfloat16 widened in registers for a
few rows (matkernels, rowtiles), or through BLAS for many (bfloat16 widened once into a dense buffer); int8 and
int4 in integers (intkernels for a few rows, inttiles' tiles for more), the inputs rounded to int8
per group. The thresholds between them are dispatch.py's, read at every call (a tuning's, if any).
With bfloat16 activations every product's inputs are rounded to bfloat16: a few rows in rowtiles' tiles
(vdpbf16ps along K where the CPU has it, else widened; one row, whose time the read of the matrix bounds, in
tiles of one row), more in paneltiles' panels (vdpbf16ps across outputs) or, on a CPU
without AVX512_BF16, through BLAS as bfloat16 weights' many rows go, on the rounded values (as_bits).
"""

from __future__ import annotations

import contextlib
import threading
import weakref

import numba
import numpy as np

from ..cpu import blas, dispatch, inttiles, paneltiles
from ..cpu.intkernels import _int_matmul
from ..cpu.attention import attend_width, pairs_width
from ..cpu.matkernels import _expand_bf16, _head, _linear, _round_bf16, _rows_product
from . import compact
from .config import GPT2Config
from .weights import GPT2Weights


def matmul(x, field, layer, b, out, accumulate, w, work, n_chunks):
    """out (+)= x @ (layer's matrix ``field``) + b, whatever the matrix's storage."""
    matrix = getattr(w, field)[layer]
    few = x.shape[0] <= rows_max(w.dtype, w.activations)
    if w.activations == "bfloat16":
        x = work.rounded(x, as_bits(few))
    elif w.dtype == "float32":
        matrix = compact.to_rows(field, matrix)  # [out, in] as kept (float32's field is a view [in, out] of it)
    scale = w.scales[field][layer] if w.scales else None
    product(x, matrix, scale, b, out, accumulate, work, n_chunks, few)


def as_bits(few: bool) -> bool:
    """Whether bfloat16 activations' rounded inputs go to a product as bits (a few rows: rowtiles; many with
    AVX512_BF16: paneltiles) or as their float32 values (many rows without it: BLAS)."""
    return few or dispatch.BF16_DOT


def rows_max(dtype: str, activations: str = "float32") -> int:
    """Rows up to which a product with a block matrix of weights ``dtype`` taking ``activations`` takes the
    few-rows kernel."""
    if activations == "bfloat16":
        return dispatch.BF16_DOT_ROWS_MAX
    return {"float32": dispatch.ROWS_MAX, "bfloat16": dispatch.BF16_ROWS_MAX,
            "int8": dispatch.INT_ROWS_MAX, "int4": dispatch.INT4_ROWS_MAX}[dtype]


def product(x, matrix, scale, b, out, accumulate, work, n_chunks, few: bool):
    """out (+)= x @ matrix.T (+ b) for a matrix [out, in] as stored (its scales for int8 and int4; else None),
    by the kernel for a few rows or the one for many (the choice matmul makes from rows_max; gpt2numba tune
    times both).

    A few rows read the matrix itself: float32 as is and bfloat16 widened in registers (_rows_product), the
    integer formats one dot product at a time (_int_matmul). Many rows: bfloat16 widened once, then BLAS;
    the integer formats in tiles of rows and outputs (inttiles). The integers' inputs are rounded to int8 per
    group either way. x as bfloat16 bits (bfloat16 activations, as_bits): _rows_product for a few rows,
    paneltiles for many.
    """
    T, K = x.shape
    if x.dtype == np.uint16:  # bfloat16 activations' rounded inputs as bits (as_bits), the matrix bfloat16
        if few:
            _rows_product(matrix, x, b, out, accumulate, n_chunks)
        else:
            paneltiles._panel_product(matrix, x, b, out, accumulate, n_chunks)
        return
    if scale is not None:
        if few:
            xq, xs = work.quantized(T, K)
            _int_matmul(x, xq, xs, matrix, scale, b, out, accumulate, n_chunks)
        else:
            inttiles._tiles_matmul(x, *work.widened(T, K), matrix, scale, b, out, accumulate, n_chunks)
        return
    if few:
        _rows_product(matrix, x, b, out, accumulate, n_chunks)
        return
    if matrix.dtype != np.float32:  # bfloat16: widen the matrix once
        dense = work.dense(matrix.shape)
        _expand_bf16(matrix, dense)
        matrix = dense
    # BLAS reads the matrix transposed, a span of x's rows a thread (a GEMM is fastest as large as it can be:
    # at 512 rows, 2 of 256 rows took 59 ms where 8 of 64 took 79)
    _linear(x, matrix, b, work.scratch(T), out, accumulate, n_chunks // dispatch.CHUNKS_PER_THREAD)


def head_logits(w: GPT2Weights, h: np.ndarray, logits: np.ndarray, n_chunks: int) -> None:
    """logits = h @ wte.T, by the kernel that suits wte's format and the rows. The integer
    formats multiply in integers, as the block matrices (product)."""
    R, C = h.shape
    if w.activations == "bfloat16":
        few = R <= rows_max(w.dtype, w.activations)
        head(w.wte, workspace(w, R, numba.get_num_threads()).rounded(h, as_bits(few)), logits, n_chunks, few)
    elif w.scales:
        work = workspace(w, R, numba.get_num_threads())
        fmt = compact.format_of("wte", w.dtype)
        product(h, w.wte, w.scales["wte"], None, logits, False, work, n_chunks, few=R <= rows_max(fmt))
    else:
        head(w.wte, h, logits, n_chunks, few=R <= dispatch.HEAD_ROWS_MAX)


def head(wte, h, logits, n_chunks, few: bool) -> None:
    """logits = h @ wte.T for wte float32 or bfloat16: the few-rows kernel, or _head's (BLAS, a span of the
    vocabulary a chunk); h bfloat16 bits (bfloat16 activations): as product."""
    if h.dtype == np.uint16:
        product(h, wte, None, None, logits, False, None, n_chunks, few)
    elif few:
        _rows_product(wte, h, None, logits, False, n_chunks)
    else:
        _head(wte, h, logits, n_chunks)


def head_inputs(w: GPT2Weights, h: np.ndarray):
    """The rows as the scoring head takes them (matkernels._head_log_softmax): h itself, or for the
    integer formats h quantised and laid out for the integer tiles (inttiles.laid_out), as every
    integer product multiplies them; with bfloat16 activations h rounded to bfloat16 (as_bits: bits for
    paneltiles, else their values for BLAS)."""
    if w.activations == "bfloat16":
        rounded = np.empty(h.shape, np.uint16 if as_bits(False) else np.float32)
        _round_bf16(np.ascontiguousarray(h, np.float32), rounded)  # (as Workspace.rounded rounds the products')
        return rounded
    return inttiles.laid_out(h) if w.scales else h


# --- work buffers: sized by the rows of a pass, kept for the next one ------------------------------

class Workspace:
    """Activation buffers for up to ``rows`` rows of one model's pass.

    Kept between calls and only ever grown: fresh memory is slow to touch, so a
    decode loop over a batch of fixed size allocates nothing per step.
    """

    def __init__(self, cfg: GPT2Config, rows: int, threads: int):
        C = cfg.n_embd
        self.rows, self.threads, self.width = rows, threads, 4 * C
        self.x = np.empty((rows, C), np.float32)        # residual stream
        self.h = np.empty((rows, C), np.float32)        # layernorm out
        self.qkv = np.empty((rows, 3 * C), np.float32)  # [q | k | v]
        self.a = np.empty((rows, C), np.float32)        # attention out, heads side by side
        self.f = np.empty((rows, 4 * C), np.float32)    # MLP hidden
        # per thread: a tile of queries and its scores over every visible key, and a compact cache's
        # rows widened (one head's keys or values: 256 KB for GPT-2)
        self.attend = np.empty((threads, attend_width(cfg.head_dim, cfg.n_positions)), np.float32)
        self._pairs_width = pairs_width(cfg.head_dim, cfg.n_positions)
        self._pairs = None
        self._scratch = np.empty(0, np.float32)
        self._dense = np.empty(0, np.float32)
        # the integer formats' inputs: int8 rows and their scales, and laid out for the tiles (inttiles.WIDE)
        self._int8 = np.empty(0, np.int8)
        self._int8_scales = np.empty(0, np.float32)
        self._wide = np.empty(0, np.int16)
        self._bf16 = {np.uint16: np.empty(0, np.uint16), np.float32: np.empty(0, np.float32)}  # (rounded)
        self._views = {}  # (T, K): quantized's views of _int8 and _int8_scales

    def scratch(self, T: int) -> np.ndarray:
        """Where BLAS's products of T rows land first (flat)."""
        need = T * self.width
        if self._scratch.size < need:  # grows with the rows
            self._scratch = np.empty(need, np.float32)
        return self._scratch

    def quantized(self, T: int, K: int) -> tuple[np.ndarray, np.ndarray]:
        """int8 (T, K) and float32 (T, K // GROUP) for T rows of inputs quantised per group."""
        views = self._views.get((T, K))  # (a decode step asks for the same views 49 times)
        if views is None:
            if self._int8.size < T * K:
                self._int8 = np.empty(T * self.width, np.int8)
                self._int8_scales = np.empty(T * self.width // compact.GROUP, np.float32)
                self._views.clear()
            views = self._views[T, K] = (self._int8[: T * K].reshape(T, K),
                                         self._int8_scales[: T * K // compact.GROUP].reshape(T, -1))
        return views

    def widened(self, T: int, K: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """int8 (rows, K), float32 (rows, K // GROUP) and inttiles.WIDE (rows, K) for T rows of inputs
        quantised and laid out for the tiles, rows = inttiles.padded_rows(T) (whole tiles)."""
        n = inttiles.padded_rows(T)
        if self._wide.size < n * K:
            self._wide = np.empty(n * self.width, inttiles.WIDE)
        q, s = self.quantized(n, K)
        return q, s, self._wide[: n * K].reshape(n, K)

    def attend_pairs(self, w: GPT2Weights) -> np.ndarray | None:
        """Attention's bfloat16 scratch per thread (attention.pairs_width: 336 KB for GPT-2), for bfloat16
        activations on vdpbf16ps (as_bits; a head_dim of pairs); None, and attention multiplies float32."""
        if w.activations != "bfloat16" or not as_bits(False) or w.config.head_dim % 2:
            return None
        if self._pairs is None:
            self._pairs = np.empty((self.threads, self._pairs_width), np.uint16)
        return self._pairs

    def rounded(self, x: np.ndarray, bits: bool) -> np.ndarray:
        """x's rows rounded to bfloat16, in this workspace: a product's inputs with bfloat16 activations, as
        their bits (uint16) or their values (float32)."""
        T, K = x.shape
        kind = np.uint16 if bits else np.float32
        if self._bf16[kind].size < T * K:
            self._bf16[kind] = np.empty(T * self.width, kind)
        out = self._bf16[kind][: T * K].reshape(T, K)
        _round_bf16(x, out)
        return out

    def dense(self, shape: tuple) -> np.ndarray:
        """A float32 buffer of ``shape`` for one widened compact matrix (many rows only)."""
        size = shape[0] * shape[1]
        if self._dense.size < size:
            self._dense = np.empty(self.width * self.width // 4, np.float32)  # C x 4C, the largest
        return self._dense[:size].reshape(shape)


_local = threading.local()  # workspaces per thread: two threads may run passes at once


def workspace(w: GPT2Weights, rows: int, threads: int) -> Workspace:
    """This thread's workspace for the weights ``w``, with room for ``rows`` rows."""
    spaces = getattr(_local, "spaces", None)
    if spaces is None:
        spaces = _local.spaces = weakref.WeakKeyDictionary()  # freed with the weights
    work = spaces.get(w)
    if work is None or work.rows < rows or work.threads < threads:
        spaces[w] = work = Workspace(w.config, max(rows, work.rows if work else 0), threads)
    return work


_blas_lock = threading.Lock()
_blas_limit: list = []  # [the function that lifts the limit, passes inside it] while any pass runs


@contextlib.contextmanager
def one_blas_thread():
    """Every BLAS library limited to one thread while any pass runs: our Numba threads are the parallelism.

    One limit for all passes at once, set by the first to enter and lifted by the last to leave: each pass
    limiting and restoring on its own would, with two threads' passes overlapping, put back the first's
    limit of 1 as the original."""
    with _blas_lock:
        if not _blas_limit:
            _blas_limit[:] = [blas.one_thread(), 0]
        _blas_limit[1] += 1
    try:
        yield
    finally:
        with _blas_lock:
            _blas_limit[1] -= 1
            if not _blas_limit[1]:
                restore = _blas_limit[0]
                _blas_limit.clear()  # (first: a failed restore must not leave the count behind)
                restore()

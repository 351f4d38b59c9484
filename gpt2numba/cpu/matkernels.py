"""Numba kernels of the matrix products: the blocks' linear layers and the tied output head.

Private and unchecked, as kernels.py (whose shapes and conventions these share). Matrices are
kept [out, in]: float32, or bfloat16 bits as uint16 (compact.py); read directly (bfloat16 widened in
registers) by one row and a few (rowtiles.py); by many through BLAS, bfloat16 widened one matrix at a
time. The integer formats' own
products are in intkernels.py; their heads over many rows are here, beside bfloat16's.
Every parallel kernel hands out its chunks from an atomic counter (chunks.py).
"""

import math

import numpy as np
from numba import njit, prange, types
from numba.core.errors import TypingError
from numba.extending import overload

from . import inttiles, numbacache, paneltiles
from .rowtiles import SUMS, _tiles, _widen
from .blas import _gemm
from .chunks import _claimed, _span
from .dispatch import BF16_DOT, ROW_CHUNKS, SERIAL_ROWS
from .kernels import FASTMATH, _exp_inplace, _from_bfloat16, _rounded, _sum, _to_bfloat16


@njit(cache=True, nogil=True, parallel=True, fastmath=False)
def _linear(x, w, b, scratch, out, accumulate, n_chunks):
    """out = x @ W.T + b, or out += x @ W.T + b when ``accumulate`` (a residual add): many rows, through BLAS.

    x: (T, K); w: W (N, K), as every format keeps its matrices (float32 as stored, bfloat16 widened), which
    BLAS reads transposed; b: (N,); out: (T, N); scratch: flat float32 of at least T * N. Each chunk is a
    span of x's rows, one single-threaded BLAS product (the flops are the cost; a few rows, where reading W
    is, go to _rows_product).
    """
    T = x.shape[0]
    N = w.shape[0]
    product = scratch[: T * N].reshape(T, N)
    nxt = np.zeros(1, np.int64)  # the next chunk (chunks.py)
    for _ in prange(n_chunks):
        for c in _claimed(nxt, n_chunks):
            start, end = _span(c, n_chunks, T, 1)
            _gemm(x[start:end], w, product[start:end], True)
            for i in range(start, end):
                for j in range(N):
                    s = product[i, j] + b[j]
                    out[i, j] = out[i, j] + s if accumulate else s


@njit(cache=True, nogil=True, parallel=True, fastmath=False)
def _rows_product(w, x, b, out, accumulate, n_chunks):
    """out (+)= x @ W.T (+ b) for a few rows, W = widen(w) read as stored: a matrix kept [out, in] (bfloat16's
    in a block, or the tied head's wte, float32 or bfloat16 bits).

    w: (N, K); x: (R, K) float32, or bfloat16 bits with w's (bfloat16 activations); b: (N,) or None; out:
    (R, N). A chunk is a span of W's rows (outputs), taken by rowtiles._tiles: a lone row ROW_OUTPUTS outputs
    at a time, more in tiles of rows x outputs, the sums in registers; a row's sums have the same bits either way.
    """
    N = w.shape[0]
    nxt = np.zeros(1, np.int64)  # the next chunk (chunks.py)
    for _ in prange(n_chunks):
        sums = np.empty(SUMS, np.float32)
        for c in _claimed(nxt, n_chunks):
            start, end = _span(c, n_chunks, N, 16)
            _tiles(w, x, b, out, accumulate, start, end, sums)


@njit(cache=True, nogil=True, parallel=True, fastmath=False)
def _round_bf16(x, out):
    """out = x rounded to bfloat16 (to nearest, ties to even): bfloat16 activations' inputs to a product. x:
    float32 (T, K); out: (T, K) uint16, the bits, or float32, their values (for BLAS)."""
    T = x.shape[0]
    if T <= SERIAL_ROWS:  # (a parallel region's barrier costs more than these rows)
        for t in range(T):
            _round_row(x[t], out[t])
        return
    for t in prange(T):
        _round_row(x[t], out[t])


@njit(cache=True, nogil=True, inline="always", fastmath=False)
def _round_row(x, out):
    for k in range(x.shape[0]):
        out[k] = _rounded_as(x[k], out)


def _rounded_as(x, out):
    """float32 x rounded to bfloat16 as an element of ``out``: its bits (uint16), or its value (float32)."""


@overload(_rounded_as, inline="always")
def _rounded_as_typed(x, out):
    if out.dtype == types.uint16:
        return lambda x, out: _to_bfloat16(x)
    return lambda x, out: _rounded(x)


# Vocabulary rows per step of the head over several rows: a (HEAD_CHUNK, C) slice
# of wte (and its float32 widening, for compact weights) stays in cache while
# every row's scores are taken from it.
HEAD_CHUNK = 512


@njit(cache=True, nogil=True, parallel=True, fastmath=False)
def _head(wte, h, out, n_chunks):
    """Tied output head over many rows: out = h @ W.T, W = widen(wte). (A few rows: _rows_product.)

    wte: (V, C) float32 or bfloat16 bits; h: (R, C); out: (R, V). A chunk is a span of vocabulary
    rows, HEAD_CHUNK at a time one BLAS product: float32 as stored, bfloat16 widened first.
    """
    V = wte.shape[0]
    nxt = np.zeros(1, np.int64)  # the next chunk (chunks.py)
    for _ in prange(n_chunks):
        for c in _claimed(nxt, n_chunks):
            start, end = _span(c, n_chunks, V, 1)
            _head_span(wte, h, start, end, out)


def _head_span(wte, h, lo, hi, out):
    """out[:, lo:hi] = h @ W[lo:hi].T, HEAD_CHUNK vocabulary rows at a time."""


@overload(_head_span, inline="always")
def _head_span_typed(wte, h, lo, hi, out):
    if wte.dtype == types.float32:
        def as_stored(wte, h, lo, hi, out):
            for c0 in range(lo, hi, HEAD_CHUNK):
                c1 = min(hi, c0 + HEAD_CHUNK)
                _gemm(h, wte[c0:c1], out[:, c0:c1], True)
        return as_stored
    return lambda wte, h, lo, hi, out: _head_widened(wte, h, lo, hi, out)


@njit(cache=True, nogil=True, fastmath=False)
def _head_widened(wte, h, lo, hi, out):
    """out[:, lo:hi] = h @ W[lo:hi].T for bfloat16 bits wte: HEAD_CHUNK rows at a time widened, then BLAS."""
    dense = np.empty((HEAD_CHUNK, h.shape[1]), np.float32)
    for c0 in range(lo, hi, HEAD_CHUNK):
        c1 = min(hi, c0 + HEAD_CHUNK)
        _widen_rows(wte, c0, c1, dense)
        _gemm(h, dense[: c1 - c0], out[:, c0:c1], True)


@njit(cache=True, nogil=True, fastmath=FASTMATH, inline="always")
def _widen_rows(wte, c0, c1, dense):
    """dense[:c1 - c0] = float32 values of wte rows c0..c1-1; wte: float32 or bfloat16 bits (V, C),
    dense: (>= c1 - c0, C)."""
    for v in range(c0, c1):
        for c in range(wte.shape[1]):
            dense[v - c0, c] = _widen(wte[v, c])


def _head_work(inputs):
    """One thread's buffers for _head_scores: a chunk of wte's rows widened (float formats), the panels
    (bfloat16 activations: inputs bfloat16 bits), or the integer tiles' buffers (inputs (xw, xs))."""


@overload(_head_work, inline="always")
def _head_work_typed(inputs):
    if isinstance(inputs, types.BaseTuple):
        return lambda inputs: inttiles._chunk_buffers(inputs[0], inputs[1].shape[1])
    if inputs.dtype == types.uint16:
        _needs_panels()
        return lambda inputs: paneltiles._panel_buffers(inputs.shape[1])
    return lambda inputs: np.empty((HEAD_CHUNK, inputs.shape[1]), np.float32)


def _head_scores(wte, scale, inputs, c0, c1, work, chunk):
    """chunk (R, c1 - c0) = the logits of vocabulary rows c0..c1-1: inputs @ W[c0:c1].T, W = wte
    widened to float32 and one BLAS product; for bfloat16 activations (inputs bfloat16 bits, with AVX512_BF16)
    paneltiles' panels; or for the integer formats (inputs = (xw, xs), as inttiles.laid_out) the integer tiles,
    W read as stored."""


@overload(_head_scores, inline="always")
def _head_scores_typed(wte, scale, inputs, c0, c1, work, chunk):
    if isinstance(inputs, types.BaseTuple):
        def tiles(wte, scale, inputs, c0, c1, work, chunk):
            for n0 in range(0, c1 - c0, inttiles.CHUNK):
                inttiles._chunk(inputs[0], inputs[1], chunk.shape[0], wte[c0:c1], scale[c0:c1], None, chunk,
                                False, n0, work)
        return tiles
    if inputs.dtype == types.uint16:
        _needs_panels()
        return lambda wte, scale, inputs, c0, c1, work, chunk: paneltiles._panels(wte[c0:c1], inputs, None, chunk,
                                                                                  False, 0, c1 - c0, work)

    def dense(wte, scale, inputs, c0, c1, work, chunk):
        _widen_rows(wte, c0, c1, work)
        _gemm(inputs, work[: c1 - c0], chunk, True)
    return dense


def _needs_panels():
    """bfloat16 bits reach the scoring head only with AVX512_BF16 (products.head_inputs): else a typing error,
    never the instruction on a CPU without it."""
    if not BF16_DOT:
        raise TypingError("bfloat16 inputs to the head need AVX512_BF16 (products.head_inputs)")


@njit(cache=True, nogil=True, parallel=True, fastmath=FASTMATH)
def _head_log_softmax(wte, scale, inputs, targets, logprob, best, n_chunks):
    """log softmax(h @ W.T) at each row's target, and each row's argmax, with no (R, V) array.

    wte: float32 or bfloat16 bits (V, C), or int8 / packed int4 with scale (V, C // GROUP); inputs:
    h (R, C), bfloat16 bits with bfloat16 activations, or for the integer formats h quantised for the
    tiles, (xw, xs) (inttiles.laid_out);
    targets: int64 (R,), ids in [0, V) or -1 for a row with none (its logprob is nan); logprob:
    float64 (R,); best: int64 (R,), the lowest id of the largest logit.
    A chunk is a span of the vocabulary, taken HEAD_CHUNK rows at a time (_head_scores:
    one product for every row); per chunk and row it keeps a running max, the sum of
    exp(logit - max) and the argmax, and the chunks are merged at the end: memory is
    O(R x chunks + HEAD_CHUNK).
    """
    V = wte.shape[0]
    R = targets.shape[0]
    peak = np.full((n_chunks, R), -np.inf)  # float64: running max per chunk and row
    total = np.zeros((n_chunks, R))          # sum of exp(logit - peak)
    arg = np.zeros((n_chunks, R), np.int64)
    hit = np.full(R, np.nan)                 # the target's logit, from the chunk that holds it
    nxt = np.zeros(1, np.int64)  # the next chunk (chunks.py)
    for _ in prange(n_chunks):
        work = _head_work(inputs)
        scores = np.empty(R * HEAD_CHUNK, np.float32)
        bits = np.empty(HEAD_CHUNK, np.int32)
        for c in _claimed(nxt, n_chunks):
            start, end = _span(c, n_chunks, V, 1)
            for c0 in range(start, end, HEAD_CHUNK):
                c1 = min(end, c0 + HEAD_CHUNK)
                chunk = scores[: R * (c1 - c0)].reshape(R, c1 - c0)
                _head_scores(wte, scale, inputs, c0, c1, work, chunk)
                for r in range(R):
                    row = chunk[r]
                    t = targets[r]
                    if c0 <= t < c1:
                        hit[r] = row[t - c0]
                    j = row.argmax()
                    if row[j] > peak[c, r]:  # a new max: rescale what was summed so far
                        total[c, r] *= math.exp(peak[c, r] - row[j])
                        peak[c, r], arg[c, r] = row[j], c0 + j
                    m = np.float32(peak[c, r])
                    for k in range(c1 - c0):
                        row[k] -= m
                    _exp_inplace(row, bits)
                    total[c, r] += _sum(row, np.float32(0.0), np.float32(0.0), False)
    for r in range(R):
        top = 0
        for c in range(1, n_chunks):
            if peak[c, r] > peak[top, r]:
                top = c
        m = peak[top, r]
        s = 0.0
        for c in range(n_chunks):
            if total[c, r] > 0.0:
                s += total[c, r] * math.exp(peak[c, r] - m)
        logprob[r] = hit[r] - (m + math.log(s))
        best[r] = arg[top, r]


@njit(cache=True, nogil=True, parallel=True, fastmath=False)
def _expand_bf16(w, out):
    """out = float32 values of bfloat16 w. w: uint16 (N, K); out: (N, K)."""
    N, K = w.shape
    nxt = np.zeros(1, np.int64)  # the next chunk of rows (chunks.py)
    for _ in prange(ROW_CHUNKS):
        for c in _claimed(nxt, ROW_CHUNKS):
            start, end = _span(c, ROW_CHUNKS, N, 1)
            for n in range(start, end):
                for k in range(K):
                    out[n, k] = _from_bfloat16(w[n, k])


numbacache.guard(__name__)  # this module's cached kernels load and save under a lock (numbacache.py)

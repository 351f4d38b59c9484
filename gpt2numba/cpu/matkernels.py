"""Numba kernels of the matrix products: the blocks' linear layers and the tied output head.

Private and unchecked, as kernels.py (whose shapes and conventions these share). Weights
are float32 in the model's layout, or bfloat16 bits as uint16 kept [out, in] (compact.py): read
directly, widened in registers, by one row and a few; widened one matrix at a time for BLAS
by many. The integer formats' own
products are in intkernels.py; their heads over many rows are here, beside bfloat16's.
Every parallel kernel hands out its chunks from an atomic counter (chunks.py).
"""

import math

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from . import inttiles
from .rowtiles import TILE_OUTPUTS, TILE_ROWS, _tiles, _widen
from .blas import _gemm
from .chunks import _claimed, _span
from .dispatch import ROW_CHUNKS, SERIAL_ROWS
from .kernels import FASTMATH, _as_float32, _exp_inplace


@njit(cache=True, nogil=True, parallel=True)
def _linear(x, w, b, scratch, out, accumulate, n_chunks, split_k, out_in):
    """out = x @ W + b, or out += x @ W + b when ``accumulate`` (a residual add).

    x: (T, K); w: W (K, N), or W.T (N, K) when ``out_in`` (bfloat16's layout, widened; not with
    split_k), which BLAS reads transposed; b: (N,); out: (T, N); scratch: flat float32, at least
    n_chunks * T * N elements when ``split_k``, else T * N. Each chunk is a
    single-threaded BLAS product: with split_k, a span of w's rows into partial
    sums, so each thread streams its own part of the weights (few tokens, where
    reading w is the cost); otherwise a span of x's rows (many tokens, where the
    flops are).
    """
    T, K = x.shape
    N = w.shape[0] if out_in else w.shape[1]
    nxt = np.zeros(1, np.int64)  # the next chunk (chunks.py)
    if not split_k:
        product = scratch[: T * N].reshape(T, N)
        for _ in prange(n_chunks):
            for c in _claimed(nxt, n_chunks):
                start, end = _span(c, n_chunks, T, 1)
                _gemm(x[start:end], w, product[start:end], out_in)
                for i in range(start, end):
                    for j in range(N):
                        s = product[i, j] + b[j]
                        out[i, j] = out[i, j] + s if accumulate else s
        return
    partial = scratch[: n_chunks * T * N].reshape(n_chunks, T, N)
    for _ in prange(n_chunks):
        for c in _claimed(nxt, n_chunks):
            start, end = _span(c, n_chunks, K, 1)
            if start < end:
                _gemm(x[:, start:end], w[start:end], partial[c], False)
            else:
                partial[c] = 0.0
    if T <= SERIAL_ROWS:
        _sum_partials(partial, b, out, accumulate, 0, T)
        return
    rows = np.zeros(1, np.int64)  # the next chunk of rows
    for _ in prange(ROW_CHUNKS):
        for c in _claimed(rows, ROW_CHUNKS):
            start, end = _span(c, ROW_CHUNKS, T, 1)
            _sum_partials(partial, b, out, accumulate, start, end)


@njit(cache=True, nogil=True)
def _sum_partials(partial, b, out, accumulate, start, end):
    """out[i] (+)= b + the sum over chunks of partial[:, i], for rows start..end-1. partial: (n_chunks, T, N)."""
    for i in range(start, end):
        for j in range(out.shape[1]):
            s = b[j]
            for c in range(partial.shape[0]):
                s += partial[c, i, j]
            out[i, j] = out[i, j] + s if accumulate else s


@njit(cache=True, nogil=True, parallel=True, fastmath=FASTMATH)
def _rows_product(w, x, b, out, accumulate, n_chunks):
    """out (+)= x @ W.T (+ b) for a few rows, W = widen(w) read as stored: a matrix kept [out, in] (bfloat16's
    in a block, or the tied head's wte, float32 or bfloat16 bits).

    w: (N, K); x: (R, K); b: (N,) or None; out: (R, N). A chunk is a span of W's rows (outputs). One row of
    x takes a dot product per row of W (_dot_rows); more go in tiles of rows x outputs whose sums stay in
    registers (rowtiles._tiles).
    """
    N = w.shape[0]
    R = x.shape[0]
    nxt = np.zeros(1, np.int64)  # the next chunk (chunks.py)
    for _ in prange(n_chunks):
        sums = np.empty(TILE_ROWS * TILE_OUTPUTS, np.float32)
        for c in _claimed(nxt, n_chunks):
            start, end = _span(c, n_chunks, N, 16)
            if R == 1:
                _dot_rows(w, x, b, out, accumulate, start, end)
            else:
                _tiles(w, x, b, out, accumulate, start, end, sums)


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def _dot_rows(w, x, b, out, accumulate, start, end):
    """out[0, v] (+)= W[v] . x[0] (+ b[v]) for v in start..end-1, W = widen(w). For float32 it streamed GPT-2
    small's wte in 4.34 ms where BLAS's matrix-vector product per chunk took 5.59 (2 threads, AMD EPYC Zen 4,
    alternating, medians of 15)."""
    K = x.shape[1]
    for v in range(start, end):
        row = w[v]
        s = np.float32(0.0)
        for k in range(K):
            s += _widen(row[k]) * x[0, k]
        _put(out, 0, v, s, b, accumulate)


@njit(cache=True, nogil=True)
def _put(out, r, v, s, b, accumulate):
    """out[r, v] (+)= s (+ b[v]); b: (N,) or None."""
    if b is not None:
        s += b[v]
    out[r, v] = out[r, v] + s if accumulate else s


# Vocabulary rows per step of the head over several rows: a (HEAD_CHUNK, C) slice
# of wte (and its float32 widening, for compact weights) stays in cache while
# every row's scores are taken from it.
HEAD_CHUNK = 512


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def _rows_update(x, t, u, k, w, lo, hi, a, b):
    """a += x[t, k:k+8] @ W[k:k+8, lo:hi] and b += x[u, k:k+8] @ W[k:k+8, lo:hi], W = widen(w).

    The eight weight rows are read once for both rows of x.
    """
    x0, x1, x2, x3, x4, x5, x6, x7 = x[t, k], x[t, k + 1], x[t, k + 2], x[t, k + 3], \
        x[t, k + 4], x[t, k + 5], x[t, k + 6], x[t, k + 7]
    y0, y1, y2, y3, y4, y5, y6, y7 = x[u, k], x[u, k + 1], x[u, k + 2], x[u, k + 3], \
        x[u, k + 4], x[u, k + 5], x[u, k + 6], x[u, k + 7]
    r0, r1, r2, r3, r4, r5, r6, r7 = w[k, lo:hi], w[k + 1, lo:hi], w[k + 2, lo:hi], w[k + 3, lo:hi], \
        w[k + 4, lo:hi], w[k + 5, lo:hi], w[k + 6, lo:hi], w[k + 7, lo:hi]
    for j in range(hi - lo):
        v0, v1, v2, v3 = _widen(r0[j]), _widen(r1[j]), _widen(r2[j]), _widen(r3[j])
        v4, v5, v6, v7 = _widen(r4[j]), _widen(r5[j]), _widen(r6[j]), _widen(r7[j])
        a[j] += ((x0 * v0 + x1 * v1) + (x2 * v2 + x3 * v3)) + ((x4 * v4 + x5 * v5) + (x6 * v6 + x7 * v7))
        b[j] += ((y0 * v0 + y1 * v1) + (y2 * v2 + y3 * v3)) + ((y4 * v4 + y5 * v5) + (y6 * v6 + y7 * v7))


@njit(cache=True, nogil=True, parallel=True, fastmath=FASTMATH)
def _linear_rows(x, w, b, scratch, out, accumulate, n_chunks):
    """out (+)= x @ W + b for a few rows, reading float32 W as stored.

    x: (T, K), K a multiple of 8; w: (K, N); b: (N,); out: (T, N); scratch: flat float32 of at
    least (T + 1) * N. A chunk is a span of columns (whole cache lines), its part of w streamed
    eight rows at a time, updating two rows of accumulators per pass: every weight read serves
    two rows of x (an odd last row is paired with itself, its twin's sums going to a spare row).
    """
    T, K = x.shape
    N = w.shape[1]
    rows = T + T % 2
    nxt = np.zeros(1, np.int64)  # the next chunk (chunks.py)
    for _ in prange(n_chunks):
        for c in _claimed(nxt, n_chunks):
            start, end = _span(c, n_chunks, N, 16)
            acc = scratch[rows * start: rows * end].reshape(rows, end - start)
            acc[:] = 0.0
            for k in range(0, K, 8):
                for t in range(0, T, 2):
                    _rows_update(x, t, min(t + 1, T - 1), k, w, start, end, acc[t], acc[t + 1])
            for t in range(T):
                for j in range(end - start):
                    v = acc[t, j] + b[start + j]
                    out[t, start + j] = out[t, start + j] + v if accumulate else v


@njit(cache=True, nogil=True, parallel=True)
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


@njit(cache=True, nogil=True)
def _head_widened(wte, h, lo, hi, out):
    """out[:, lo:hi] = h @ W[lo:hi].T for bfloat16 bits wte: HEAD_CHUNK rows at a time widened, then BLAS."""
    dense = np.empty((HEAD_CHUNK, h.shape[1]), np.float32)
    for c0 in range(lo, hi, HEAD_CHUNK):
        c1 = min(hi, c0 + HEAD_CHUNK)
        _widen_rows(wte, c0, c1, dense)
        _gemm(h, dense[: c1 - c0], out[:, c0:c1], True)


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def _widen_rows(wte, c0, c1, dense):
    """dense[:c1 - c0] = float32 values of wte rows c0..c1-1; wte: float32 or bfloat16 bits (V, C),
    dense: (>= c1 - c0, C)."""
    for v in range(c0, c1):
        for c in range(wte.shape[1]):
            dense[v - c0, c] = _widen(wte[v, c])


def _head_work(inputs):
    """One thread's buffers for _head_scores: a chunk of wte's rows widened (float formats), or the
    integer tiles' buffers (inputs (xw, xs))."""


@overload(_head_work, inline="always")
def _head_work_typed(inputs):
    if isinstance(inputs, types.BaseTuple):
        return lambda inputs: inttiles._chunk_buffers(inputs[0], inputs[1].shape[1])
    return lambda inputs: np.empty((HEAD_CHUNK, inputs.shape[1]), np.float32)


def _head_scores(wte, scale, inputs, c0, c1, work, chunk):
    """chunk (R, c1 - c0) = the logits of vocabulary rows c0..c1-1: inputs @ W[c0:c1].T, W = wte
    widened to float32 and one BLAS product; or for the integer formats (inputs = (xw, xs), as
    inttiles.laid_out) the integer tiles, W read as stored."""


@overload(_head_scores, inline="always")
def _head_scores_typed(wte, scale, inputs, c0, c1, work, chunk):
    if isinstance(inputs, types.BaseTuple):
        def tiles(wte, scale, inputs, c0, c1, work, chunk):
            for n0 in range(0, c1 - c0, inttiles.CHUNK):
                inttiles._chunk(inputs[0], inputs[1], chunk.shape[0], wte[c0:c1], scale[c0:c1], None, chunk,
                                False, n0, work)
        return tiles

    def dense(wte, scale, inputs, c0, c1, work, chunk):
        _widen_rows(wte, c0, c1, work)
        _gemm(inputs, work[: c1 - c0], chunk, True)
    return dense


@njit(cache=True, nogil=True, parallel=True, fastmath=FASTMATH)
def _head_log_softmax(wte, scale, inputs, targets, logprob, best, n_chunks):
    """log softmax(h @ W.T) at each row's target, and each row's argmax, with no (R, V) array.

    wte: float32 or bfloat16 bits (V, C), or int8 / packed int4 with scale (V, C // GROUP); inputs:
    h (R, C), or for the integer formats h quantised for the tiles, (xw, xs) (inttiles.laid_out);
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
                    total[c, r] += row.sum()
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


@njit(cache=True, nogil=True, parallel=True)
def _expand_bf16(w, out):
    """out = float32 values of bfloat16 w. w: uint16 (N, K); out: (N, K)."""
    N, K = w.shape
    nxt = np.zeros(1, np.int64)  # the next chunk of rows (chunks.py)
    for _ in prange(ROW_CHUNKS):
        for c in _claimed(nxt, ROW_CHUNKS):
            start, end = _span(c, ROW_CHUNKS, N, 1)
            for n in range(start, end):
                for k in range(K):
                    out[n, k] = _as_float32(np.uint32(w[n, k]) << 16)

"""Numba kernels: everything of GPT-2's forward pass but the Python loop over layers.

Private and unchecked: callers in forward.py validate shapes, dtypes and ranges.
Arrays are float32 and C-contiguous; N = rows in the pass (the new tokens of
every sequence, stacked), C = n_embd, H = n_head, D = head_dim, P = n_positions.
Numba's threads do all the parallel work; the matrix products inside run on one
BLAS thread each (forward.py pins BLAS to one thread while it computes), so the
two thread pools never compete for the cores.

A batch is ragged: sequence b's rows are row0[b]..row0[b+1]-1 of the stacked
rows, and its first row sits at position pos0[b] (the length its cache held).
Its keys and values live in its own cache, ks[b] and vs[b] (typed lists of
(n_layer, H, max_len, D) arrays, one per sequence).
Masking is by loop bounds (a query at position pos reads positions 0..pos): no
-inf enters the arithmetic, so fastmath stays safe.
"""

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from .chunks import _claim
from .intkernels import _widen_group

# LLVM fast-math minus nnan/ninf: reassociation lets reductions vectorise, while
# comparisons with inf or nan keep their meaning.
FASTMATH = {"nsz", "arcp", "contract", "afn", "reassoc"}

# float32 constants keep the elementwise kernels in float32 (a float64 literal would promote)
_ONE = np.float32(1.0)
_HALF = np.float32(0.5)
_LOG2E = np.float32(1.0 / math.log(2.0))
# ln 2 in two parts (the first exact in few bits), so that z - r ln 2 loses nothing
_LN2_HI, _LN2_LO = np.float32(0.693359375), np.float32(math.log(2.0) - 0.693359375)
# clamp to float32's normal exponents: 2^-126 .. 2^127
_EXP_MIN, _EXP_MAX = np.float32(-126 * math.log(2.0)), np.float32(127 * math.log(2.0))
# exp(g) = sum g^k / k!, to k = 7: relative error under 1e-8 for |g| <= ln(2) / 2
_EXP_C = tuple(np.float32(1.0 / math.factorial(k)) for k in range(8))
_GELU_2C = np.float32(2.0 * math.sqrt(2.0 / math.pi))
_GELU_A = np.float32(0.044715)


@intrinsic
def _as_float32(typingctx, bits):
    """The float32 whose bits are the uint32 ``bits`` (a register move, so loops stay vectorised)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def _exp_inplace(z, bits):
    """z = exp(z) for float32 z (n,), in loops the compiler vectorises.

    Libm's exp is one scalar call per element; here exp(z) = 2^r exp(g), with
    r = round(z / ln 2) placed straight into a float's exponent bits and exp(g),
    |g| <= ln(2) / 2, a polynomial. Results below 2^-126 come out as about 2^-126,
    never 0: harmless beside the values of order one they are added to.
    bits: int32 (n,) scratch.
    """
    c0, c1, c2, c3, c4, c5, c6, c7 = _EXP_C
    for j in range(z.size):
        x = min(max(z[j], _EXP_MIN), _EXP_MAX)
        r = np.floor(x * _LOG2E + _HALF)
        g = (x - r * _LN2_HI) - r * _LN2_LO
        z[j] = c0 + g * (c1 + g * (c2 + g * (c3 + g * (c4 + g * (c5 + g * (c6 + g * c7))))))
        bits[j] = (np.int32(r) + 127) << 23  # the float 2^r
    scale = bits.view(np.float32)
    for j in range(z.size):
        z[j] *= scale[j]


# Up to this many rows, the elementwise kernels (layernorm, GELU, split-k sums) run on the
# calling thread: a parallel region costs a wake-up and a barrier, and on a busy machine the
# barrier waits for whichever thread the OS took away. Decode steps then open one region per
# matrix product and one for attention, not three more per layer.
SERIAL_ROWS = 8
# Chunks of rows in a parallel elementwise kernel, claimed as threads are free (chunks.py).
ROW_CHUNKS = 32


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def _layernorm_row(x, g, b, eps, out):
    """out = (x - mean) / sqrt(var + eps) * g + b, biased variance. x, out, g, b: (C,)."""
    C = x.size
    mean = 0.0
    for j in range(C):
        mean += x[j]
    mean /= C
    var = 0.0
    for j in range(C):
        d = x[j] - mean
        var += d * d
    var /= C
    rstd = 1.0 / math.sqrt(var + eps)
    for j in range(C):
        out[j] = (x[j] - mean) * rstd * g[j] + b[j]


@njit(cache=True, nogil=True, parallel=True, fastmath=FASTMATH)
def _layernorm(x, g, b, eps, out):
    """out[i] = layernorm(x[i]) * g + b for every row. x, out: (T, C); g, b: (C,); eps: float."""
    T = x.shape[0]
    if T <= SERIAL_ROWS:
        for i in range(T):
            _layernorm_row(x[i], g, b, eps, out[i])
        return
    n_chunks = min(T, ROW_CHUNKS)
    nxt = np.zeros(1, np.int64)  # the next chunk of rows (chunks.py)
    for _ in prange(n_chunks):
        c = _claim(nxt)
        while c < n_chunks:
            for i in range(c * T // n_chunks, (c + 1) * T // n_chunks):
                _layernorm_row(x[i], g, b, eps, out[i])
            c = _claim(nxt)


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def _gelu_row(row):
    """In place: row = gelu(row), GPT-2's tanh form, 0.5 x (1 + tanh(c (x + 0.044715 x^3))).

    row: (F,). Computed as x / (1 + exp(-2 c (x + 0.044715 x^3))), the same function
    (0.5 (1 + tanh z) = 1 / (1 + exp(-2z))), with a vectorised exp.
    """
    F = row.size
    e = np.empty(F, np.float32)
    bits = np.empty(F, np.int32)
    for j in range(F):
        y = row[j]
        e[j] = -_GELU_2C * (y + _GELU_A * y * y * y)
    _exp_inplace(e, bits)
    for j in range(F):
        row[j] = row[j] / (_ONE + e[j])


@njit(cache=True, nogil=True, parallel=True, fastmath=FASTMATH)
def _gelu(x):
    """In place: x = gelu(x) for every row (_gelu_row). x: (T, F)."""
    T = x.shape[0]
    if T <= SERIAL_ROWS:
        for i in range(T):
            _gelu_row(x[i])
        return
    n_chunks = min(T, ROW_CHUNKS)
    nxt = np.zeros(1, np.int64)  # the next chunk of rows (chunks.py)
    for _ in prange(n_chunks):
        c = _claim(nxt)
        while c < n_chunks:
            for i in range(c * T // n_chunks, (c + 1) * T // n_chunks):
                _gelu_row(x[i])
            c = _claim(nxt)


@njit(cache=True, nogil=True, parallel=True)
def _linear(x, w, b, scratch, out, accumulate, n_blocks, split_k):
    """out = x @ w + b, or out += x @ w + b when ``accumulate`` (a residual add).

    x: (T, K); w: (K, N); b: (N,); out: (T, N); scratch: flat float32, at least
    n_blocks * T * N elements when ``split_k``, else T * N. Work splits into
    n_blocks (one per thread), each a single-threaded BLAS product:
    split_k: blocks of w's rows into partial sums, so each thread streams its
    own part of the weights (few tokens, where reading w is the cost);
    otherwise blocks of x's rows (many tokens, where the flops are).
    """
    T, K = x.shape
    N = w.shape[1]
    if split_k:
        partial = scratch[: n_blocks * T * N].reshape(n_blocks, T, N)
        step = (K + n_blocks - 1) // n_blocks
        nxt = np.zeros(1, np.int64)  # the next chunk (chunks.py)
        for _ in prange(n_blocks):
            blk = _claim(nxt)
            while blk < n_blocks:
                lo = min(K, blk * step)
                hi = min(K, lo + step)
                if lo < hi:
                    np.dot(x[:, lo:hi].copy(), w[lo:hi], partial[blk])
                else:
                    partial[blk] = 0.0
                blk = _claim(nxt)
        if T <= SERIAL_ROWS:
            for i in range(T):
                _sum_partials(partial, i, b, out, accumulate)
            return
        n_chunks = min(T, ROW_CHUNKS)
        nxt = np.zeros(1, np.int64)
        for _ in prange(n_chunks):
            c = _claim(nxt)
            while c < n_chunks:
                for i in range(c * T // n_chunks, (c + 1) * T // n_chunks):
                    _sum_partials(partial, i, b, out, accumulate)
                c = _claim(nxt)
    else:
        product = scratch[: T * N].reshape(T, N)
        step = (T + n_blocks - 1) // n_blocks
        nxt = np.zeros(1, np.int64)  # the next chunk (chunks.py)
        for _ in prange(n_blocks):
            blk = _claim(nxt)
            while blk < n_blocks:
                lo = min(T, blk * step)
                hi = min(T, lo + step)
                if lo < hi:
                    np.dot(x[lo:hi], w, product[lo:hi])
                    for i in range(lo, hi):
                        for j in range(N):
                            s = product[i, j] + b[j]
                            out[i, j] = out[i, j] + s if accumulate else s
                blk = _claim(nxt)


@njit(cache=True, nogil=True)
def _sum_partials(partial, i, b, out, accumulate):
    """out[i] (+)= b + the sum over blocks of partial[:, i]. partial: (n_blocks, T, N)."""
    for j in range(out.shape[1]):
        s = b[j]
        for blk in range(partial.shape[0]):
            s += partial[blk, i, j]
        out[i, j] = out[i, j] + s if accumulate else s


@njit(cache=True, nogil=True, parallel=True)
def _linear_t(x, wt, b, scratch, out, accumulate, n_blocks):
    """out (+)= x @ wt.T + b for weights stored [out, in] (the integer formats' widened matrices).

    x: (T, K); wt: (N, K); b: (N,); out: (T, N); scratch: flat float32 of at least T * N.
    Each thread takes a block of wt's rows: one single-threaded BLAS product.
    """
    T = x.shape[0]
    N = wt.shape[0]
    step = ((N + n_blocks - 1) // n_blocks + 15) // 16 * 16
    nxt = np.zeros(1, np.int64)  # the next chunk (chunks.py)
    for _ in prange(n_blocks):
        blk = _claim(nxt)
        while blk < n_blocks:
            lo, hi = min(N, blk * step), min(N, (blk + 1) * step)
            if lo < hi:
                part = scratch[T * lo: T * hi].reshape(T, hi - lo)
                np.dot(x, wt[lo:hi].T, part)
                for i in range(T):
                    for j in range(hi - lo):
                        v = part[i, j] + b[lo + j]
                        out[i, lo + j] = out[i, lo + j] + v if accumulate else v
            blk = _claim(nxt)


# Up to this many rows, _head_rows beats the head's BLAS products and the compact
# heads' widened chunks (measured on 2 cores, GPT-2 small: 1.6x at 8 rows in float32,
# 2.2x in bfloat16).
HEAD_ROWS_MAX = 16


@njit(cache=True, nogil=True, parallel=True, fastmath=FASTMATH)
def _head_rows(wte, h, out, n_blocks):
    """Tied output head for a few rows: out = h @ W.T, W = widen(wte), read as stored.

    wte: (V, C) float32 or bfloat16 bits; h: (R, C); out: (R, V). Each thread streams a block
    of vocabulary rows, four at a time, and takes every row's dot products with them while
    they are in cache.
    """
    V = wte.shape[0]
    step = ((V + n_blocks - 1) // n_blocks + 3) // 4 * 4
    nxt = np.zeros(1, np.int64)  # the next chunk (chunks.py)
    for _ in prange(n_blocks):
        blk = _claim(nxt)
        while blk < n_blocks:
            lo, hi = min(V, blk * step), min(V, (blk + 1) * step)
            for v in range(lo, hi - 3, 4):
                _head_dots(h, wte, v, 4, out)
            for v in range(hi - (hi - lo) % 4, hi):
                _head_dots(h, wte, v, 1, out)
            blk = _claim(nxt)


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def _head_dots(h, wte, v, n, out):
    """out[:, v:v+n] = h @ W[v:v+n].T for n = 4 vocabulary rows, or 1 (the last ones)."""
    R, C = h.shape
    w0, w1, w2, w3 = wte[v], wte[v + n // 4], wte[v + 2 * (n // 4)], wte[v + 3 * (n // 4)]
    for r in range(R):
        x = h[r]
        s0 = s1 = s2 = s3 = np.float32(0.0)
        for c in range(C):
            s0 += x[c] * _widen(w0[c])
            s1 += x[c] * _widen(w1[c])
            s2 += x[c] * _widen(w2[c])
            s3 += x[c] * _widen(w3[c])
        out[r, v] = s0
        if n == 4:
            out[r, v + 1], out[r, v + 2], out[r, v + 3] = s1, s2, s3


# Vocabulary rows per step of the head over several rows: a (HEAD_CHUNK, C) slice
# of wte (and its float32 widening, for compact weights) stays in cache while
# every row's scores are taken from it.
HEAD_CHUNK = 512


def _widen(v):
    """A stored weight as float32: itself, or bfloat16 bits (uint16)."""


@overload(_widen, inline="always")
def _widen_typed(v):
    if v == types.uint16:
        return lambda v: _as_float32(np.uint32(v) << 16)
    return lambda v: np.float32(v)


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


# Up to this many rows, _linear_rows beats single-threaded BLAS blocks (measured on 2 cores,
# GPT-2 small's matrices): BLAS repacks the weights for so few rows.
ROWS_MAX = 64


@njit(cache=True, nogil=True, parallel=True, fastmath=FASTMATH)
def _linear_rows(x, w, b, scratch, out, accumulate, n_blocks):
    """out (+)= x @ W + b for a few rows, reading W as stored: float32 or bfloat16 bits.

    x: (T, K), K a multiple of 8; w: (K, N); b: (N,); out: (T, N); scratch: flat float32 of at least (T + 1) * N. Each thread
    takes a block of columns and streams its part of w eight rows at a time, updating
    two rows of accumulators per pass: every weight read serves two rows of x (an odd
    last row is paired with itself, its twin's sums going to a spare row).
    """
    T, K = x.shape
    N = w.shape[1]
    step = ((N + n_blocks - 1) // n_blocks + 15) // 16 * 16  # whole cache lines per thread
    rows = T + T % 2
    nxt = np.zeros(1, np.int64)  # the next chunk (chunks.py)
    for _ in prange(n_blocks):
        blk = _claim(nxt)
        while blk < n_blocks:
            lo, hi = min(N, blk * step), min(N, (blk + 1) * step)
            acc = scratch[rows * lo: rows * hi].reshape(rows, hi - lo)
            acc[:] = 0.0
            for k in range(0, K, 8):
                for t in range(0, T, 2):
                    _rows_update(x, t, min(t + 1, T - 1), k, w, lo, hi, acc[t], acc[t + 1])
            for t in range(T):
                for j in range(hi - lo):
                    v = acc[t, j] + b[lo + j]
                    out[t, lo + j] = out[t, lo + j] + v if accumulate else v
            blk = _claim(nxt)


@njit(cache=True, nogil=True, parallel=True)
def _head(wte, h, out, n_blocks):
    """Tied output head: out = h @ wte.T.

    wte: (V, C); h: (R, C); out: (R, V). Each of n_blocks threads streams a block
    of vocabulary rows: one matrix-vector product for one row, else a product
    per HEAD_CHUNK of them.
    """
    V = wte.shape[0]
    R = h.shape[0]
    step = (V + n_blocks - 1) // n_blocks
    nxt = np.zeros(1, np.int64)  # the next chunk (chunks.py)
    for _ in prange(n_blocks):
        scores = np.empty(R * HEAD_CHUNK, np.float32)
        blk = _claim(nxt)
        while blk < n_blocks:
            lo, hi = min(V, blk * step), min(V, (blk + 1) * step)
            if R == 1 and lo < hi:
                np.dot(wte[lo:hi], h[0], out[0, lo:hi])
            elif R > 1:
                for c0 in range(lo, hi, HEAD_CHUNK):
                    _chunk_scores(h, wte[c0:], c0, min(hi, c0 + HEAD_CHUNK), scores, out)
            blk = _claim(nxt)


@njit(cache=True, nogil=True)
def _write_kv(qkv, ks, vs, row0, pos0, layer, written):
    """Copy the keys and values of every new row into one layer of its sequence's cache.

    qkv: (N, 3C) rows [q | k | v]; ks, vs: B caches' (n_layer, H, max_len, D);
    row0: (B + 1,); pos0: (B,); written: (B, n_layer) int64, where
    written[b, layer] becomes the positions this layer now holds for sequence b.
    """
    H, D = ks[0].shape[1], ks[0].shape[3]
    C = H * D
    for b in range(pos0.size):
        k, v = ks[b], vs[b]
        for i in range(row0[b], row0[b + 1]):
            pos = pos0[b] + i - row0[b]
            for h in range(H):
                for d in range(D):
                    k[layer, h, pos, d] = qkv[i, C + h * D + d]
                    v[layer, h, pos, d] = qkv[i, 2 * C + h * D + d]
        written[b, layer] = pos0[b] + row0[b + 1] - row0[b]


# Queries per attention tile: a tile's scores are one BLAS product against the keys it may see.
ATTEND_TILE = 64


@njit(cache=True, nogil=True)
def _attention_plan(row0, pos0, n_head, n_blocks):
    """Attention's work as tiles, cut into n_blocks runs of about equal cost.

    A tile is (sequence b, head h, first query i0): up to ATTEND_TILE queries of
    one head over the keys they may see; its cost is queries x keys. Returns
    tiles: (n_tiles, 3) int64 and bounds: (n_blocks + 1,), run j being tiles
    bounds[j]..bounds[j+1]-1. Cutting by cost, not by sequence, keeps every
    thread busy when a long sequence sits beside short ones.
    """
    B = pos0.size
    n_tiles = 0
    for b in range(B):
        n_tiles += n_head * ((row0[b + 1] - row0[b] + ATTEND_TILE - 1) // ATTEND_TILE)
    tiles = np.empty((n_tiles, 3), np.int64)
    cost = np.empty(n_tiles + 1, np.float64)  # cost[j]: the tiles before j
    cost[0] = 0.0
    j = 0
    for b in range(B):
        T = row0[b + 1] - row0[b]
        for h in range(n_head):
            for i0 in range(0, T, ATTEND_TILE):
                m = min(T, i0 + ATTEND_TILE) - i0
                tiles[j, 0], tiles[j, 1], tiles[j, 2] = b, h, i0
                cost[j + 1] = cost[j] + m * (pos0[b] + i0 + m + ATTEND_TILE)  # + a tile's fixed cost
                j += 1
    bounds = np.searchsorted(cost[1:], cost[n_tiles] * np.arange(n_blocks + 1) / n_blocks)
    bounds[0], bounds[n_blocks] = 0, n_tiles
    return tiles, bounds


@njit(cache=True, nogil=True, parallel=True, fastmath=FASTMATH)
def _attend(qkv, ks, vs, layer, row0, pos0, tiles, bounds, out, scratch):
    """Causal attention of every new row over its own sequence's cache.

    qkv: (N, 3C), queries in columns [0, C); ks, vs: B caches' (n_layer, H,
    max_len, D), rows 0..pos0[b] + T_b - 1 of ``layer`` already written; row0:
    (B + 1,); pos0: (B,); tiles, bounds: from _attention_plan, its runs claimed by the
    threads as they are free; out: (N, C), heads side by side; scratch: (threads,
    ATTEND_TILE * (D + P)), a row per thread. For a tile of
    queries i0..i1-1 of sequence b, BLAS computes the scores against its keys
    0..pos0[b]+i1-1; the softmax of the query at pos reads keys 0..pos only and
    zeroes the rest, so the mask is exact and by loop bounds.
    """
    D = ks[0].shape[3]
    P = scratch.shape[1] // ATTEND_TILE - D
    scale = np.float32(1.0 / math.sqrt(D))
    n_runs = bounds.size - 1
    nxt = np.zeros(1, np.int64)  # the next run of tiles (chunks.py)
    for part in prange(min(n_runs, scratch.shape[0])):
        bits = np.empty(P, np.int32)
        run = _claim(nxt)
        while run < n_runs:
            for j in range(bounds[run], bounds[run + 1]):
                b, h, i0 = tiles[j, 0], tiles[j, 1], tiles[j, 2]
                first, start = row0[b] + i0, pos0[b] + i0  # the tile's first row, and its position
                m = min(row0[b + 1] - first, ATTEND_TILE)
                n = start + m  # keys 0..n-1 are visible to the tile's last query
                q = scratch[part, : m * D].reshape(m, D)  # (m, D), then the tile's output
                s = scratch[part, m * D : m * D + m * n].reshape(m, n)  # (m, n) scores, then weights
                for i in range(m):
                    for d in range(D):
                        q[i, d] = qkv[first + i, h * D + d] * scale
                np.dot(q, ks[b][layer, h, :n].T, s)
                for i in range(m):
                    pos = start + i
                    row = s[i, : pos + 1]  # the keys the query at pos may see
                    peak = row.max()
                    for t in range(pos + 1):
                        row[t] -= peak
                    _exp_inplace(row, bits)
                    inv = _ONE / row.sum()
                    for t in range(pos + 1):
                        row[t] *= inv
                    s[i, pos + 1:] = 0.0
                np.dot(s, vs[b][layer, h, :n], q)
                for i in range(m):
                    for d in range(D):
                        out[first + i, h * D + d] = q[i, d]
            run = _claim(nxt)


@njit(cache=True, nogil=True, parallel=True, fastmath=FASTMATH)
def _stream_sum(a):
    """Sum of a 1-D float32 array, one contiguous block per thread: a read-bandwidth probe."""
    n = a.size
    total = 0.0
    for i in prange(n):
        total += a[i]
    return total


# --- compact weights (see compact.py): bfloat16 bits as uint16 -----------------------------------
# One row (a decode step) and a few (_linear_rows, _head_rows) read them directly,
# widening in registers; a long prefill widens one matrix at a time into a float32
# buffer and multiplies with BLAS. The integer formats' own kernels are in intkernels.py;
# their heads over many rows are here, beside bfloat16's.


@njit(cache=True, nogil=True, parallel=True, fastmath=FASTMATH)
def _gemv_bf16(x, w, b, scratch, out, accumulate, n_blocks):
    """out (+)= x @ w + b for one token, w bfloat16.

    x: (1, K); w: uint16 (K, N); b: (N,); out: (1, N); scratch: flat float32 of
    at least n_blocks * N. Each thread streams a block of w's rows.
    """
    K, N = w.shape
    partial = scratch[: n_blocks * N].reshape(n_blocks, N)
    step = (K + n_blocks - 1) // n_blocks
    nxt = np.zeros(1, np.int64)  # the next chunk (chunks.py)
    for _ in prange(n_blocks):
        blk = _claim(nxt)
        while blk < n_blocks:
            acc = partial[blk]
            acc[:] = 0.0
            for k in range(min(K, blk * step), min(K, (blk + 1) * step)):
                row = w[k]
                xk = x[0, k]
                for j in range(N):
                    acc[j] += xk * _as_float32(np.uint32(row[j]) << 16)
            blk = _claim(nxt)
    _reduce(partial, b, out, accumulate)


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def _reduce(partial, b, out, accumulate):
    """out[0] (+)= b + the sum of partial's rows. partial: (n_blocks, N)."""
    for j in range(out.shape[1]):
        s = b[j]
        for blk in range(partial.shape[0]):
            s += partial[blk, j]
        out[0, j] = out[0, j] + s if accumulate else s


@njit(cache=True, nogil=True, parallel=True, fastmath=FASTMATH)
def _head_compact(wte, scale, h, out, n_blocks):
    """out = h @ W.T for a compact wte (V, C): bfloat16 bits with scale None, or int8 / packed int4
    with scales (V, C // GROUP) and h already rounded as the integer formats' inputs are
    (intkernels._round_rows); h: (R, C); out: (R, V).

    One row of bfloat16: a dot product per vocabulary row, widened in registers. Otherwise
    each thread widens HEAD_CHUNK vocabulary rows of its block at a time, then BLAS.
    """
    V = wte.shape[0]
    R, C = h.shape
    step = (V + n_blocks - 1) // n_blocks
    nxt = np.zeros(1, np.int64)  # the next chunk (chunks.py)
    for _ in prange(n_blocks):
        blk = _claim(nxt)
        while blk < n_blocks:
            lo, hi = min(V, blk * step), min(V, (blk + 1) * step)
            if R == 1 and scale is None:
                for v in range(lo, hi):
                    row = wte[v]
                    s = np.float32(0.0)
                    for c in range(C):
                        s += _widen(row[c]) * h[0, c]
                    out[0, v] = s
            else:
                _head_widened(wte, scale, h, lo, hi, out)
            blk = _claim(nxt)


@njit(cache=True, nogil=True)
def _head_widened(wte, scale, h, lo, hi, out):
    """out[:, lo:hi] = h @ W[lo:hi].T for compact wte: HEAD_CHUNK rows at a time widened, then BLAS."""
    dense = np.empty((HEAD_CHUNK, h.shape[1]), np.float32)
    scores = np.empty(h.shape[0] * HEAD_CHUNK, np.float32)
    for c0 in range(lo, hi, HEAD_CHUNK):
        c1 = min(hi, c0 + HEAD_CHUNK)
        _widen_rows(wte, scale, c0, c1, dense)
        _chunk_scores(h, dense, c0, c1, scores, out)


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def _widen_rows(wte, scale, c0, c1, dense):
    """dense[:c1 - c0] = float32 values of wte rows c0..c1-1 (times their scales if ``scale``).

    wte: float32 or bfloat16 bits (V, C), or int8 (V, C) or packed int4 (V, C // 2) with
    scale: (V, C // GROUP), else None; dense: (>= c1 - c0, C).
    """
    for v in range(c0, c1):
        if scale is None:
            for c in range(wte.shape[1]):
                dense[v - c0, c] = _widen(wte[v, c])
        else:
            for g in range(scale.shape[1]):
                _widen_group(wte[v], g, scale[v, g], dense[v - c0])


@njit(cache=True, nogil=True, parallel=True, fastmath=FASTMATH)
def _head_log_softmax(wte, scale, h, targets, logprob, best, n_blocks):
    """log softmax(h @ W.T) at each row's target, and each row's argmax, with no (R, V) array.

    wte, scale: as _widen_rows takes them; h: (R, C), rounded first for the integer formats;
    targets: int64 (R,), ids in [0, V) or -1 for a row with none (its logprob is nan); logprob: float64 (R,); best: int64 (R,), the lowest id of the largest logit.
    Each thread takes a block of the vocabulary in chunks of HEAD_CHUNK rows (widened
    to float32, then one BLAS product for every row) and keeps, per row, a running max,
    the sum of exp(logit - max) and the argmax; the blocks are merged at the end:
    memory is O(R x threads + chunk).
    """
    V = wte.shape[0]
    R, C = h.shape
    step = (V + n_blocks - 1) // n_blocks
    peak = np.full((n_blocks, R), -np.inf)  # float64: running max per block and row
    total = np.zeros((n_blocks, R))          # sum of exp(logit - peak)
    arg = np.zeros((n_blocks, R), np.int64)
    hit = np.full(R, np.nan)                 # the target's logit, from the block that holds it
    nxt = np.zeros(1, np.int64)  # the next chunk (chunks.py)
    for _ in prange(n_blocks):
        dense = np.empty((HEAD_CHUNK, C), np.float32)
        scores = np.empty(R * HEAD_CHUNK, np.float32)
        bits = np.empty(HEAD_CHUNK, np.int32)
        blk = _claim(nxt)
        while blk < n_blocks:
            lo, hi = min(V, blk * step), min(V, (blk + 1) * step)
            for c0 in range(lo, hi, HEAD_CHUNK):
                c1 = min(hi, c0 + HEAD_CHUNK)
                _widen_rows(wte, scale, c0, c1, dense)
                chunk = scores[: R * (c1 - c0)].reshape(R, c1 - c0)
                np.dot(h, dense[: c1 - c0].T, chunk)
                for r in range(R):
                    row = chunk[r]
                    t = targets[r]
                    if c0 <= t < c1:
                        hit[r] = row[t - c0]
                    j = row.argmax()
                    if row[j] > peak[blk, r]:  # a new max: rescale what was summed so far
                        total[blk, r] *= math.exp(peak[blk, r] - row[j])
                        peak[blk, r], arg[blk, r] = row[j], c0 + j
                    m = np.float32(peak[blk, r])
                    for c in range(c1 - c0):
                        row[c] -= m
                    _exp_inplace(row, bits)
                    total[blk, r] += row.sum()
            blk = _claim(nxt)
    for r in range(R):
        top = 0
        for blk in range(1, n_blocks):
            if peak[blk, r] > peak[top, r]:
                top = blk
        m = peak[top, r]
        s = 0.0
        for blk in range(n_blocks):
            if total[blk, r] > 0.0:
                s += total[blk, r] * math.exp(peak[blk, r] - m)
        logprob[r] = hit[r] - (m + math.log(s))
        best[r] = arg[top, r]


@njit(cache=True, nogil=True)
def _chunk_scores(h, dense, c0, c1, scores, out):
    """out[:, c0:c1] = h @ dense[:c1 - c0].T: one chunk of the head over several rows.
    h: (R, C); dense: (HEAD_CHUNK, C) widened wte rows; scores: flat scratch of R * HEAD_CHUNK."""
    chunk = scores[: h.shape[0] * (c1 - c0)].reshape(h.shape[0], c1 - c0)
    np.dot(h, dense[: c1 - c0].T, chunk)
    out[:, c0:c1] = chunk


@njit(cache=True, nogil=True, parallel=True)
def _expand_bf16(w, out):
    """out = float32 values of bfloat16 w. w: uint16 (K, N); out: (K, N)."""
    K, N = w.shape
    n_chunks = min(K, ROW_CHUNKS)
    nxt = np.zeros(1, np.int64)  # the next chunk of rows (chunks.py)
    for _ in prange(n_chunks):
        c = _claim(nxt)
        while c < n_chunks:
            for k in range(c * K // n_chunks, (c + 1) * K // n_chunks):
                for j in range(N):
                    out[k, j] = _as_float32(np.uint32(w[k, j]) << 16)
            c = _claim(nxt)

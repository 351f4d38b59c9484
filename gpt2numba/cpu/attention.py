"""Causal attention of the new rows over their sequences' cached keys and values (kernels.py's module
docstring says how a batch's rows and runs are laid out).

With bfloat16 activations (model/products.py) attention's two products take bfloat16 inputs too: the keys
and values as the cache write rounded them (kernels._write_kv), the queries and the softmax's weights
rounded here. A tile of several queries runs on vdpbf16ps on AVX512_BF16 (paneltiles.py: the keys packed
as a matrix's rows, the values by pairs of positions), the scores scaled inside the softmax; without the
instruction the queries are scaled after rounding and BLAS multiplies the same values in float32; one query
(a decode step) takes the float32 loops over the rounded values. (The paths differ by float32's order of
summation, by the scale's rounding where 1/sqrt(head_dim) is not a power of two, and where either moves a
weight across a bfloat16 rounding tie.)

Private and unchecked, as kernels.py: callers in forward.py validate shapes, dtypes and ranges.
"""

import math

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from . import numbacache, paneltiles
from .blas import _gemm
from .chunks import _claimed
from .kernels import (_ONE, FASTMATH, _cache_of, _exp_inplace, _from_bfloat16, _rounded, _row_max, _sum, _to_bfloat16,
                      _to_float32_f16)


def _times_cache(a, ks, runs, lo, hi, layer, h, n, dense, out, half, keys):
    """out = a @ K.T when ``keys`` (a: queries (m, D); out: their scores (m, n)), else out = a @ V (a: weights
    (m, n); out: (m, D)); K or V: positions 0..n-1 of one head of one layer, kept in runs[lo:hi] of the stores
    ks (the module's docstring), read as float32; dense: (P, D) float32 scratch for rows gathered from several
    runs or widened from a compact cache. The result is the same, to the bit, however the rows are split
    into runs: one query's sums run over the positions in order, and BLAS sees them in one (n, D) block."""


@overload(_times_cache, inline="always")
def _times_cache_typed(a, ks, runs, lo, hi, layer, h, n, dense, out, half, keys):
    array = ks if isinstance(ks, types.Array) else ks.item_type
    if array.dtype != types.float32:
        def from_bits(a, ks, runs, lo, hi, layer, h, n, dense, out, half, keys):
            _gemm(a, _gathered(ks, runs, lo, hi, layer, h, n, dense, half), out, keys)
        return from_bits

    def blas(a, ks, runs, lo, hi, layer, h, n, dense, out, half, keys):
        if a.shape[0] > 1:
            if runs[lo, 2] >= n:  # one run holds them all: BLAS reads them in place
                row = runs[lo, 3]
                _gemm(a, _cache_of(ks, runs[lo, 0])[layer, h, row : row + n], out, keys)
            else:
                _gemm(a, _gathered(ks, runs, lo, hi, layer, h, n, dense, half), out, keys)
            return
        for j in range(lo, hi):  # one query (a decode step): a loop costs less than a BLAS call
            first, end, row = runs[j, 1], min(runs[j, 2], n), runs[j, 3]
            if first >= n:
                break
            rows = _cache_of(ks, runs[j, 0])[layer, h]  # position t is rows[t + row - first]
            if keys:
                _query_scores(a, rows, first, end, row - first, out)
            else:
                _query_values(a, rows, first, end, row - first, out, j == lo)
    return blas


@njit(cache=True, nogil=True, fastmath=False)
def _query_scores(q, keys, first, end, shift, s):
    """s[0, t] = q[0] . keys[t + shift] for first <= t < end: one query's scores, each summed in kernels._sum's
    order (eight running sums along the head's width, added pairwise, then the rest), not fast-math, for its
    reasons. q: (1, D); keys: (rows, D); s: (1, n)."""
    D = q.shape[1]
    whole = D - D % 8
    for t in range(first, end):
        k = keys[t + shift]
        s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = np.float32(0.0)
        for d in range(0, whole, 8):
            s0 += q[0, d] * k[d]
            s1 += q[0, d + 1] * k[d + 1]
            s2 += q[0, d + 2] * k[d + 2]
            s3 += q[0, d + 3] * k[d + 3]
            s4 += q[0, d + 4] * k[d + 4]
            s5 += q[0, d + 5] * k[d + 5]
            s6 += q[0, d + 6] * k[d + 6]
            s7 += q[0, d + 7] * k[d + 7]
        total = ((s0 + s4) + (s2 + s6)) + ((s1 + s5) + (s3 + s7))
        for d in range(whole, D):
            total += q[0, d] * k[d]
        s[0, t] = total


@njit(cache=True, nogil=True, fastmath=FASTMATH, inline="always")
def _query_values(s, values, first, end, shift, out, zero):
    """out[0] (+)= the sum over first <= t < end of s[0, t] values[t + shift], from zero when ``zero``: one
    query's values. s: (1, n); values: (rows, D); out: (1, D)."""
    if zero:
        out[0, :] = 0.0
    for t in range(first, end):
        p = s[0, t]
        for d in range(out.shape[1]):
            out[0, d] += p * values[t + shift, d]


@njit(cache=True, nogil=True, fastmath=FASTMATH, inline="always")
def _gathered(ks, runs, lo, hi, layer, h, n, dense, half):
    """Positions 0..n-1 of one head of one layer, from runs[lo:hi] of ks, as rows of dense (>= n, D) in its
    format (_recast): float32 values, a compact cache's bits widened, or bfloat16 bits; a view of them."""
    D = dense.shape[1]
    for j in range(lo, hi):
        first, end, row = runs[j, 1], min(runs[j, 2], n), runs[j, 3]
        if first >= n:
            break
        bits = _cache_of(ks, runs[j, 0])[layer, h, row : row + end - first].reshape((end - first) * D)
        out = dense[first:end].reshape((end - first) * D)
        _recast(bits, out, half)
    return dense[:n]


def _recast(bits, out, half):
    """out[:] = a cache's values ``bits`` in out's format. Into float32: a copy of float32, or float16
    (``half``) or bfloat16 bits (uint16) widened. Into bfloat16 bits (uint16; bfloat16 activations, whose
    cache holds bfloat16 values): float32 or float16 values' bits, or a copy of bfloat16 bits."""


@overload(_recast, inline="always")
def _recast_typed(bits, out, half):
    if bits.dtype == out.dtype and bits.dtype == types.float32:
        def copy(bits, out, half):
            out[:] = bits
        return copy
    if out.dtype == types.float32:
        def widened(bits, out, half):
            if half:
                for j in range(bits.size):
                    out[j] = _to_float32_f16(bits[j])
            else:
                for j in range(bits.size):
                    out[j] = _from_bfloat16(bits[j])
        return widened
    if bits.dtype == types.float32:
        def rounded(bits, out, half):
            for j in range(bits.size):
                out[j] = _to_bfloat16(bits[j])
        return rounded

    def as_bfloat16(bits, out, half):
        if half:
            for j in range(bits.size):
                out[j] = _to_bfloat16(_to_float32_f16(bits[j]))
        else:
            out[:] = bits
    return as_bfloat16


@njit(cache=True, nogil=True, fastmath=FASTMATH, inline="always")
def _softmax_exp(row, scale, bits):
    """row = exp((row - max(row)) * scale) in place; returns 1 / its sum. bits: int32 scratch (_exp_inplace)."""
    peak = _row_max(row)
    for t in range(row.size):
        row[t] = (row[t] - peak) * scale
    _exp_inplace(row, bits[: row.size])
    return _ONE / _sum(row, np.float32(0.0), np.float32(0.0), False)


@njit(cache=True, nogil=True, fastmath=FASTMATH, inline="always")
def _bits_tile(qkv, first, start, h, m, ks, vs, runs, lo, hi, layer, half, scale, s, out, P, pairs, sums, bits):
    """_attend's tile on vdpbf16ps: queries first..first+m-1 of head h, at positions start.., over keys and
    values 0..n-1, n = start + m, all as bfloat16 (queries and weights rounded here, keys and values as
    written), the scores scaled inside the softmax; into out (m, D). qkv: (N, 3C); ks, vs, runs[lo:hi]: the
    sequence's stores and runs; half: a float16 cache's; scale: 1 / sqrt(D); s: float32 (m, n) scratch; P:
    n_positions; pairs: a thread's row of uint16 scratch (pairs_width); sums: float32 (TILE_ROWS * OUTPUTS,),
    a tile of paneltiles' sums; bits: int32 (P,) scratch."""
    n, D = start + m, out.shape[1]
    q, rows, p, panels = _pairs_views(pairs, D, P, m, n)
    for i in range(m):
        for d in range(D):
            q[i, d] = _to_bfloat16(qkv[first + i, h * D + d])
    _gathered(ks, runs, lo, hi, layer, h, n, rows, half)
    paneltiles._panels(rows, q, None, s, False, 0, n, (panels, sums))
    for i in range(m):
        pos = start + i
        inv = _softmax_exp(s[i, : pos + 1], scale, bits)
        for t in range(pos + 1):
            p[i, t] = _to_bfloat16(s[i, t] * inv)
        p[i, pos + 1:] = 0  # (and a last column of zeros, n being odd)
    _gathered(vs, runs, lo, hi, layer, h, n, rows, half)  # the values (n, D), now that the keys are done
    paneltiles._panels(rows, p, None, out, False, 0, D, (panels, sums), True)


# Queries per attention tile: a tile's scores are one BLAS product against the keys it may see.
ATTEND_TILE = 64


def attend_width(head_dim: int, n_positions: int) -> int:
    """float32 elements of _attend's scratch per thread: a tile's queries and scores, and a (P, D) block
    for a compact cache's rows widened."""
    return ATTEND_TILE * (head_dim + n_positions) + n_positions * head_dim


def pairs_width(head_dim: int, n_positions: int) -> int:
    """uint16 elements of _attend's bfloat16 scratch per thread (_bits_tile): a tile's queries (ATTEND_TILE, D),
    the keys and then the values (P, D), the weights (ATTEND_TILE, P + 1), and paneltiles' panels for the longer
    K of the two products."""
    D, P = head_dim, n_positions
    return (ATTEND_TILE + P) * D + ATTEND_TILE * (P + 1) + paneltiles.PANELS * paneltiles.LANES * max(D, P + 1)


@njit(cache=True, nogil=True, inline="always", fastmath=False)
def _pairs_views(pairs, D, P, m, n):
    """Views of a row of pairs_width(D, P) elements: queries (m, D), keys or values (n, D), weights (m, n2), n2
    = n rounded up to even; and the panels."""
    n2 = n + n % 2
    rows = ATTEND_TILE * D
    weights = rows + P * D
    panels = weights + ATTEND_TILE * (P + 1)
    return (pairs[: m * D].reshape(m, D), pairs[rows: rows + n * D].reshape(n, D),
            pairs[weights: weights + m * n2].reshape(m, n2), pairs[panels:])


@njit(cache=True, nogil=True, fastmath=False)
def _attention_plan(row0, pos0, n_head, n_chunks):
    """Attention's work as tiles, cut into n_chunks runs of about equal cost.

    A tile is (sequence b, head h, first query i0): up to ATTEND_TILE queries of
    one head over the keys they may see; its cost is queries x keys. Returns
    tiles: (n_tiles, 3) int64 and bounds: (n_chunks + 1,), run j being tiles
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
    bounds = np.searchsorted(cost[1:], cost[n_tiles] * np.arange(n_chunks + 1) / n_chunks)
    bounds[0], bounds[n_chunks] = 0, n_tiles
    return tiles, bounds


@njit(cache=True, nogil=True, parallel=True, fastmath=FASTMATH)
def _attend(qkv, ks, vs, runs, run0, layer, row0, pos0, tiles, bounds, out, scratch, half, rounds, pairs):
    """Causal attention of every new row over its own sequence's history.

    qkv: (N, 3C), queries in columns [0, C); ks, vs, runs, run0: the stores and each
    sequence's runs (the module's docstring), positions 0..pos0[b] + T_b - 1 of ``layer``
    already written; row0:
    (B + 1,); pos0: (B,); tiles, bounds: from _attention_plan, its runs claimed by the
    threads as they are free; out: (N, C), heads side by side; scratch: (threads,
    attend_width(D, P)), a row per thread. For a tile of
    queries i0..i1-1 of sequence b, BLAS (or vdpbf16ps, below) computes the scores against its keys
    0..pos0[b]+i1-1; the softmax of the query at pos reads keys 0..pos only and
    zeroes the rest, so the mask is exact and by loop bounds. A compact cache (uint16
    bits: float16 when ``half``, else bfloat16) has the tile's visible keys, then its
    values, widened into the thread's (P, D) float32 block first (_gathered): memory
    is read at 2 bytes a value, BLAS still multiplies float32. (For one query, a hand
    loop over the 2-byte rows, no widened block, measured the same: decode at context
    900 with int4 weights, 0.88-0.90x the float32 cache's time against 0.87-0.88x.)
    One query over a float32 cache (a decode step) is two loops instead of two BLAS calls:
    a decode_batch step of 32 sequences at context 128 makes 9216 such calls, whose overhead
    cost its attention 17.5 ms against the loops' 12.3 (int8 weights, AMD EPYC Zen 4), where
    reading the 302 MB of K and V rows sets the pace.
    With ``rounds`` (bfloat16 activations) the queries and the softmax's weights are rounded to bfloat16
    (the keys and values were, when written); pairs: None, or (threads, pairs_width(D, P)) uint16 scratch,
    with which a tile of several queries multiplies bfloat16 pairs on vdpbf16ps (_bits_tile; only with
    AVX512_BF16: with pairs None, Numba prunes the branch and compiles none of it).
    """
    D = _cache_of(ks, 0).shape[3]
    P = (scratch.shape[1] - ATTEND_TILE * D) // (ATTEND_TILE + D)
    scale = np.float32(1.0 / math.sqrt(D))
    n_chunks = bounds.size - 1  # the runs of tiles
    nxt = np.zeros(1, np.int64)  # the next run (chunks.py)
    for part in prange(min(n_chunks, scratch.shape[0])):  # part: the iteration's row of scratch
        bits = np.empty(P, np.int32)
        sums = np.empty(0 if pairs is None else paneltiles.TILE_ROWS * paneltiles.OUTPUTS, np.float32)
        for run in _claimed(nxt, n_chunks):
            for j in range(bounds[run], bounds[run + 1]):
                b, h, i0 = tiles[j, 0], tiles[j, 1], tiles[j, 2]
                first, start = row0[b] + i0, pos0[b] + i0  # the tile's first row, and its position
                m = min(row0[b + 1] - first, ATTEND_TILE)
                n = start + m  # keys 0..n-1 are visible to the tile's last query
                q = scratch[part, : m * D].reshape(m, D)  # (m, D), then the tile's output
                s = scratch[part, m * D : m * D + m * n].reshape(m, n)  # (m, n) scores, then weights
                dense = scratch[part, ATTEND_TILE * (D + P):].reshape(P, D)  # a compact cache's rows widened
                if pairs is not None and m > 1:  # (a test of the argument: without pairs, nothing of it compiles)
                    _bits_tile(qkv, first, start, h, m, ks, vs, runs, run0[b], run0[b + 1], layer, half, scale, s, q,
                               P, pairs[part], sums, bits)
                else:
                    for i in range(m):
                        for d in range(D):
                            x = qkv[first + i, h * D + d]
                            q[i, d] = (_rounded(x) if rounds else x) * scale
                    _times_cache(q, ks, runs, run0[b], run0[b + 1], layer, h, n, dense, s, half, True)
                    for i in range(m):
                        pos = start + i
                        row = s[i, : pos + 1]  # the keys the query at pos may see
                        inv = _softmax_exp(row, _ONE, bits)
                        for t in range(pos + 1):
                            row[t] *= inv
                        if rounds:
                            for t in range(pos + 1):
                                row[t] = _rounded(row[t])
                        s[i, pos + 1:] = 0.0
                    _times_cache(s, vs, runs, run0[b], run0[b + 1], layer, h, n, dense, q, half, False)
                for i in range(m):
                    for d in range(D):
                        out[first + i, h * D + d] = q[i, d]


numbacache.guard(__name__)  # this module's cached kernels load and save under a lock (numbacache.py)

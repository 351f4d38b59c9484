"""Numba kernels of the forward pass but its matrix products (matkernels.py, intkernels.py):
layernorm, GELU, the cache write and causal attention.

Private and unchecked: callers in forward.py validate shapes, dtypes and ranges.
Arrays are float32 and C-contiguous, but a compact cache's keys and values: float16 or
bfloat16 bits as uint16, rounded when written, widened when read. N = rows in the pass
(the new tokens of every sequence, stacked), C = n_embd, H = n_head, D = head_dim,
P = n_positions.
Numba's threads do all the parallel work; the matrix products inside run on one
BLAS thread each (forward.py pins BLAS to one thread while it computes), so the
two thread pools never compete for the cores.

A batch is ragged: sequence b's rows are row0[b]..row0[b+1]-1 of the stacked
rows, and its first row sits at position pos0[b] (the length its cache held).
Its keys and values are kept in runs of positions, runs[run0[b]:run0[b+1]], each
(store, first, end, row): positions first..end-1 are rows row.. of ks[store] and
vs[store], (n_layer, H, rows, D) arrays (typed lists; for one sequence in one run,
its arrays themselves: _cache_of). Runs of several sequences may name the same
store (a shared history read in place); a sequence's last run is its own cache,
row == first, where its new rows are written.
Masking is by loop bounds (a query at position pos reads positions 0..pos): no
-inf enters the arithmetic, so fastmath stays safe.
"""

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from .blas import _gemm
from .chunks import _claimed, _span
from .dispatch import F16C, ROW_CHUNKS, SERIAL_ROWS

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


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def _layernorm_rows(x, g, b, eps, out, start, end):
    """out[i] = (x[i] - mean) / sqrt(var + eps) * g + b for rows start..end-1, biased variance.
    x, out: (T, C); g, b: (C,)."""
    C = x.shape[1]
    for i in range(start, end):
        row, dest = x[i], out[i]
        mean = 0.0
        for j in range(C):
            mean += row[j]
        mean /= C
        var = 0.0
        for j in range(C):
            d = row[j] - mean
            var += d * d
        var /= C
        rstd = 1.0 / math.sqrt(var + eps)
        for j in range(C):
            dest[j] = (row[j] - mean) * rstd * g[j] + b[j]


@njit(cache=True, nogil=True, parallel=True, fastmath=FASTMATH)
def _layernorm(x, g, b, eps, out):
    """out[i] = layernorm(x[i]) * g + b for every row. x, out: (T, C); g, b: (C,); eps: float."""
    T = x.shape[0]
    if T <= SERIAL_ROWS:
        _layernorm_rows(x, g, b, eps, out, 0, T)
        return
    nxt = np.zeros(1, np.int64)  # the next chunk of rows (chunks.py)
    for _ in prange(ROW_CHUNKS):
        for c in _claimed(nxt, ROW_CHUNKS):
            start, end = _span(c, ROW_CHUNKS, T, 1)
            _layernorm_rows(x, g, b, eps, out, start, end)


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def _gelu_rows(x, start, end):
    """In place: x[i] = gelu(x[i]) for rows start..end-1, GPT-2's tanh form, 0.5 x (1 + tanh(c (x + 0.044715 x^3))).

    x: (T, F). Computed as x / (1 + exp(-2 c (x + 0.044715 x^3))), the same function
    (0.5 (1 + tanh z) = 1 / (1 + exp(-2z))), with a vectorised exp.
    """
    F = x.shape[1]
    e = np.empty(F, np.float32)
    bits = np.empty(F, np.int32)
    for i in range(start, end):
        row = x[i]
        for j in range(F):
            y = row[j]
            e[j] = -_GELU_2C * (y + _GELU_A * y * y * y)
        _exp_inplace(e, bits)
        for j in range(F):
            row[j] = row[j] / (_ONE + e[j])


@njit(cache=True, nogil=True, parallel=True, fastmath=FASTMATH)
def _gelu(x):
    """In place: x = gelu(x) for every row (_gelu_rows). x: (T, F)."""
    T = x.shape[0]
    if T <= SERIAL_ROWS:
        _gelu_rows(x, 0, T)
        return
    nxt = np.zeros(1, np.int64)  # the next chunk of rows (chunks.py)
    for _ in prange(ROW_CHUNKS):
        for c in _claimed(nxt, ROW_CHUNKS):
            start, end = _span(c, ROW_CHUNKS, T, 1)
            _gelu_rows(x, start, end)


def _cache_of(caches, b):
    """Store b's (n_layer, H, rows, D) array, from ``caches``: a typed list of the stores' arrays, or for one
    store its array itself (a typed list costs a decode step about 80 µs to build and 4 µs in every call
    that takes two)."""


@overload(_cache_of, inline="always")
def _cache_of_typed(caches, b):
    if isinstance(caches, types.Array):
        return lambda caches, b: caches
    return lambda caches, b: caches[b]


@njit(cache=True, nogil=True, parallel=True)
def _write_kv(qkv, ks, vs, runs, run0, row0, pos0, layer, written, half):
    """Copy the keys and values of every new row into one layer of its sequence's own cache.

    qkv: (N, 3C) rows [q | k | v]; ks, vs, runs, run0: the stores and each sequence's runs (the module's
    docstring), float32, or uint16 bits of float16 (``half``) or bfloat16 (not ``half``), rounded to nearest
    even; row0: (B + 1,); pos0: (B,); written: (B, n_layer) int64, where
    written[b, layer] becomes the positions this layer now holds for sequence b. Past SERIAL_ROWS rows the
    heads are copied in parallel (each head's rows are a region of their own in every cache).
    """
    H = _cache_of(ks, 0).shape[1]
    if row0[-1] <= SERIAL_ROWS:
        for h in range(H):
            _write_head(qkv, ks, vs, runs, run0, row0, pos0, layer, h, half)
    else:
        for h in prange(H):
            _write_head(qkv, ks, vs, runs, run0, row0, pos0, layer, h, half)
    for b in range(pos0.size):
        written[b, layer] = pos0[b] + row0[b + 1] - row0[b]


@njit(cache=True, nogil=True, inline="always")
def _write_head(qkv, ks, vs, runs, run0, row0, pos0, layer, h, half):
    """_write_kv's copy of head h's keys and values."""
    D = _cache_of(ks, 0).shape[3]
    C = _cache_of(ks, 0).shape[1] * D
    for b in range(pos0.size):
        own = runs[run0[b + 1] - 1, 0]  # the last run: the sequence's own cache, rows at their positions
        k, v = _cache_of(ks, own), _cache_of(vs, own)
        for i in range(row0[b], row0[b + 1]):
            pos = pos0[b] + i - row0[b]
            _store_row(qkv[i, C + h * D: C + (h + 1) * D], k[layer, h, pos], half)
            _store_row(qkv[i, 2 * C + h * D: 2 * C + (h + 1) * D], v[layer, h, pos], half)


# --- a compact cache's formats: float16 and bfloat16, stored as their uint16 bits -------------------


@njit(cache=True, nogil=True)
def _put(out, r, v, s, b, accumulate):
    """out[r, v] (+)= s (+ b[v]), the store that ends every product kernel; b: (N,) or None."""
    if b is not None:
        s += b[v]
    out[r, v] = out[r, v] + s if accumulate else s


@intrinsic
def _as_float32(typingctx, bits):
    """The float32 whose bits are the uint32 ``bits`` (a register move, so loops stay vectorised)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


@intrinsic
def _as_uint32(typingctx, x):
    """The bits of the float32 ``x``, as uint32."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


@intrinsic
def _half_to_float32(typingctx, bits):
    """float16 bits (uint16) -> float32, exactly: LLVM's fpext from half (vcvtph2ps with x86's F16C)."""
    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.uint16), codegen


@intrinsic
def _float32_to_half(typingctx, x):
    """float32 -> float16 bits (uint16), to nearest, ties to even: LLVM's fptrunc (vcvtps2ph with F16C)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return types.uint16(types.float32), codegen


@njit(cache=True, nogil=True, inline="always")
def _half_to_float32_soft(bits):
    """_half_to_float32 in integer and float32 arithmetic, for an x86 without F16C (where LLVM would call a
    runtime helper that Numba does not link). The magnitude's bits moved to float32's places, times 2^112,
    are the value for normal and subnormal halves alike; inf and nan keep a full exponent."""
    magnitude = np.uint32(bits & 0x7FFF) << 13
    x = _as_float32(magnitude) * np.float32(2.0 ** 112)
    if magnitude >= np.uint32(0x7C00 << 13):  # inf, nan
        x = _as_float32(magnitude | np.uint32(0x7F800000))
    return _as_float32(_as_uint32(x) | (np.uint32(bits & 0x8000) << 16))


@njit(cache=True, nogil=True, inline="always")
def _float32_to_half_soft(x):
    """_float32_to_half in integer arithmetic, for an x86 without F16C (F. Giesen's float_to_half_fast3_rtne):
    normal halves round their 13 dropped bits to nearest even by an integer add; subnormals by a float add
    that leaves the rounded value in the low bits; 65520 and above overflow to inf; nan stays nan."""
    bits = _as_uint32(x)
    sign = bits & np.uint32(0x80000000)
    a = bits ^ sign
    if a >= np.uint32((127 + 16) << 23):  # 2^16 or more, inf or nan
        out = np.uint32(0x7E00) if a > np.uint32(0x7F800000) else np.uint32(0x7C00)
    elif a < np.uint32(113 << 23):  # below 2^-14: a subnormal half, or zero
        magic = np.uint32((127 - 15 + 23 - 10 + 1) << 23)
        out = _as_uint32(_as_float32(a) + _as_float32(magic)) - magic
    else:
        odd = (a >> 13) & np.uint32(1)
        out = (a - np.uint32(112 << 23) + np.uint32(0xFFF) + odd) >> 13  # the exponent rebased: 127 - 15
    return np.uint16((sign >> 16) | out)


# LLVM converts half floats in instructions off x86 (ARM has them) and on an x86 with F16C (every x86 with
# AVX2); elsewhere it would call a runtime helper that Numba does not link
_to_float32_f16 = _half_to_float32 if F16C else _half_to_float32_soft
_to_half = _float32_to_half if F16C else _float32_to_half_soft


@njit(cache=True, nogil=True, inline="always")
def _to_bfloat16(x):
    """float32 -> bfloat16 bits (uint16), to nearest, ties to even: compact.to_bfloat16's rounding."""
    bits = _as_uint32(x)
    return np.uint16((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16)


def _store_row(src, dst, half):
    """dst[:] = src, rounded to the cache's format. src: float32 (D,); dst: float32 (D,), or uint16 (D,)
    bits of float16 (``half``) or bfloat16."""


@overload(_store_row, inline="always")
def _store_row_typed(src, dst, half):
    if dst.dtype == types.float32:
        def store(src, dst, half):
            dst[:] = src
        return store

    def store_bits(src, dst, half):
        if half:
            for d in range(src.size):
                dst[d] = _to_half(src[d])
        else:
            for d in range(src.size):
                dst[d] = _to_bfloat16(src[d])
    return store_bits


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


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def _query_scores(q, keys, first, end, shift, s):
    """s[0, t] = q[0] . keys[t + shift] for first <= t < end: one query's scores. q: (1, D); keys: (rows, D);
    s: (1, n)."""
    for t in range(first, end):
        acc = np.float32(0.0)
        for d in range(q.shape[1]):
            acc += q[0, d] * keys[t + shift, d]
        s[0, t] = acc


@njit(cache=True, nogil=True, fastmath=FASTMATH)
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
    """Positions 0..n-1 of one head of one layer, from runs[lo:hi] of ks, as float32 rows of dense (P, D),
    widened from a compact cache's bits; a view of them."""
    D = dense.shape[1]
    for j in range(lo, hi):
        first, end, row = runs[j, 1], min(runs[j, 2], n), runs[j, 3]
        if first >= n:
            break
        bits = _cache_of(ks, runs[j, 0])[layer, h, row : row + end - first].reshape((end - first) * D)
        out = dense[first:end].reshape((end - first) * D)
        _widen(bits, out, half)
    return dense[:n]


def _widen(bits, out, half):
    """out[:] = bits as float32: a copy of float32, or float16 (``half``) or bfloat16 bits (uint16) widened."""


@overload(_widen, inline="always")
def _widen_typed(bits, out, half):
    if bits.dtype == types.float32:
        def copy(bits, out, half):
            out[:] = bits
        return copy

    def from_bits(bits, out, half):
        if half:
            for j in range(bits.size):
                out[j] = _to_float32_f16(bits[j])
        else:
            for j in range(bits.size):
                out[j] = _as_float32(np.uint32(bits[j]) << 16)
    return from_bits


# Queries per attention tile: a tile's scores are one BLAS product against the keys it may see.
ATTEND_TILE = 64


def attend_width(head_dim: int, n_positions: int) -> int:
    """float32 elements of _attend's scratch per thread: a tile's queries and scores, and a (P, D) block
    for a compact cache's rows widened."""
    return ATTEND_TILE * (head_dim + n_positions) + n_positions * head_dim



@njit(cache=True, nogil=True)
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
def _attend(qkv, ks, vs, runs, run0, layer, row0, pos0, tiles, bounds, out, scratch, half):
    """Causal attention of every new row over its own sequence's history.

    qkv: (N, 3C), queries in columns [0, C); ks, vs, runs, run0: the stores and each
    sequence's runs (the module's docstring), positions 0..pos0[b] + T_b - 1 of ``layer``
    already written; row0:
    (B + 1,); pos0: (B,); tiles, bounds: from _attention_plan, its runs claimed by the
    threads as they are free; out: (N, C), heads side by side; scratch: (threads,
    attend_width(D, P)), a row per thread. For a tile of
    queries i0..i1-1 of sequence b, BLAS computes the scores against its keys
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
    """
    D = _cache_of(ks, 0).shape[3]
    P = (scratch.shape[1] - ATTEND_TILE * D) // (ATTEND_TILE + D)
    scale = np.float32(1.0 / math.sqrt(D))
    n_chunks = bounds.size - 1  # the runs of tiles
    nxt = np.zeros(1, np.int64)  # the next run (chunks.py)
    for part in prange(min(n_chunks, scratch.shape[0])):  # part: the iteration's row of scratch
        bits = np.empty(P, np.int32)
        for run in _claimed(nxt, n_chunks):
            for j in range(bounds[run], bounds[run + 1]):
                b, h, i0 = tiles[j, 0], tiles[j, 1], tiles[j, 2]
                first, start = row0[b] + i0, pos0[b] + i0  # the tile's first row, and its position
                m = min(row0[b + 1] - first, ATTEND_TILE)
                n = start + m  # keys 0..n-1 are visible to the tile's last query
                q = scratch[part, : m * D].reshape(m, D)  # (m, D), then the tile's output
                s = scratch[part, m * D : m * D + m * n].reshape(m, n)  # (m, n) scores, then weights
                dense = scratch[part, ATTEND_TILE * (D + P):].reshape(P, D)  # a compact cache's rows widened
                for i in range(m):
                    for d in range(D):
                        q[i, d] = qkv[first + i, h * D + d] * scale
                _times_cache(q, ks, runs, run0[b], run0[b + 1], layer, h, n, dense, s, half, True)
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
                _times_cache(s, vs, runs, run0[b], run0[b + 1], layer, h, n, dense, q, half, False)
                for i in range(m):
                    for d in range(D):
                        out[first + i, h * D + d] = q[i, d]

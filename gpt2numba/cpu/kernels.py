"""Numba kernels of the forward pass but its matrix products (matkernels.py, intkernels.py) and attention
(attention.py): layernorm, GELU, the cache write, and a compact cache's formats.

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

from . import numbacache
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


@njit(cache=True, nogil=True, fastmath=FASTMATH, inline="always")
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


@njit(cache=True, nogil=True, fastmath=FASTMATH, inline="always")
def _row_max(x):
    """max(x) of float32 x (n,), n >= 1, as np.max gives it (a NaN too, unless its sign bit is set; +0.0 for a
    max of zeros of both signs, which np.max may give as -0.0), in a loop the compiler vectorises: each float's
    bits mapped to an int32 that orders as the floats do (a negative's magnitude bits flipped), an integer
    max, its bits mapped back. (LLVM does not vectorise a float max without no-nans: docs/performance-history.md,
    "bfloat16 activations".)"""
    peak = np.int32(-(2**31))
    for t in range(x.size):
        b = np.int32(_as_uint32(x[t]))
        peak = max(peak, b ^ ((b >> 31) & np.int32(0x7FFFFFFF)))
    return _as_float32(np.uint32(peak ^ ((peak >> 31) & np.int32(0x7FFFFFFF))))


# Not inline and not fast-math, either of which would hand its order to the caller's optimizer
@njit(cache=True, nogil=True, fastmath=False)
def _sum(x, zero, shift, square):
    """The sum of x[j] - shift, or of its squares when ``square``, over float x (n,), in zero's type (a float32
    or a float64 0): eight running sums, the k-th over j = k, k + 8, ..., added pairwise, then the last n % 8
    in turn, an order written out, which the eight sums' vectors keep. Fast-math would let the optimizer choose
    the order, and Numba 0.59 optimizes a callee twice (alone, and again inside each kernel that calls it) and
    runs one or the other as the kernel was compiled or loaded from the cache: a reduction's bits then followed
    the process."""
    n = x.size
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = zero
    whole = n - n % 8
    for i in range(0, whole, 8):
        s0 += _term(x[i], shift, square)
        s1 += _term(x[i + 1], shift, square)
        s2 += _term(x[i + 2], shift, square)
        s3 += _term(x[i + 3], shift, square)
        s4 += _term(x[i + 4], shift, square)
        s5 += _term(x[i + 5], shift, square)
        s6 += _term(x[i + 6], shift, square)
        s7 += _term(x[i + 7], shift, square)
    total = ((s0 + s4) + (s2 + s6)) + ((s1 + s5) + (s3 + s7))
    for i in range(whole, n):
        total += _term(x[i], shift, square)
    return total


@njit(nogil=True, fastmath=False, inline="always")
def _term(v, shift, square):
    d = v - shift
    return d * d if square else d


@njit(cache=True, nogil=True, fastmath=False)
def _layernorm_rows(x, g, b, eps, out, start, end):
    """out[i] = (x[i] - mean) / sqrt(var + eps) * g + b for rows start..end-1, biased variance, the mean and the
    variance summed in float64 in _sum's order. x, out: (T, C); g, b: (C,)."""
    C = x.shape[1]
    for i in range(start, end):
        row, dest = x[i], out[i]
        mean = _sum(row, 0.0, 0.0, False) / C
        rstd = 1.0 / math.sqrt(_sum(row, 0.0, mean, True) / C + eps)
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


@njit(cache=True, nogil=True, fastmath=FASTMATH, inline="always")
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


@njit(cache=True, nogil=True, parallel=True, fastmath=False)
def _write_kv(qkv, ks, vs, runs, run0, row0, pos0, layer, written, half, rounds):
    """Copy the keys and values of every new row into one layer of its sequence's own cache.

    qkv: (N, 3C) rows [q | k | v]; ks, vs, runs, run0: the stores and each sequence's runs (the module's
    docstring), float32, or uint16 bits of float16 (``half``) or bfloat16 (not ``half``), rounded to nearest
    even; with ``rounds`` (bfloat16 activations) every value rounded to bfloat16 first, whatever the store,
    as attention multiplies it (attention.py); row0: (B + 1,); pos0: (B,); written: (B, n_layer) int64, where
    written[b, layer] becomes the positions this layer now holds for sequence b. Past SERIAL_ROWS rows the
    heads are copied in parallel (each head's rows are a region of their own in every cache).
    """
    H = _cache_of(ks, 0).shape[1]
    if row0[-1] <= SERIAL_ROWS:
        for h in range(H):
            _write_head(qkv, ks, vs, runs, run0, row0, pos0, layer, h, half, rounds)
    else:
        for h in prange(H):
            _write_head(qkv, ks, vs, runs, run0, row0, pos0, layer, h, half, rounds)
    for b in range(pos0.size):
        written[b, layer] = pos0[b] + row0[b + 1] - row0[b]


@njit(cache=True, nogil=True, inline="always", fastmath=False)
def _write_head(qkv, ks, vs, runs, run0, row0, pos0, layer, h, half, rounds):
    """_write_kv's copy of head h's keys and values."""
    D = _cache_of(ks, 0).shape[3]
    C = _cache_of(ks, 0).shape[1] * D
    for b in range(pos0.size):
        own = runs[run0[b + 1] - 1, 0]  # the last run: the sequence's own cache, rows at their positions
        k, v = _cache_of(ks, own), _cache_of(vs, own)
        for i in range(row0[b], row0[b + 1]):
            pos = pos0[b] + i - row0[b]
            _store_row(qkv[i, C + h * D: C + (h + 1) * D], k[layer, h, pos], half, rounds)
            _store_row(qkv[i, 2 * C + h * D: 2 * C + (h + 1) * D], v[layer, h, pos], half, rounds)


# --- a compact cache's formats: float16 and bfloat16, stored as their uint16 bits -------------------


@njit(cache=True, nogil=True, fastmath=False)
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


@njit(cache=True, nogil=True, inline="always", fastmath=False)
def _half_to_float32_soft(bits):
    """_half_to_float32 in integer and float32 arithmetic, for an x86 without F16C (where LLVM would call a
    runtime helper that Numba does not link). The magnitude's bits moved to float32's places, times 2^112,
    are the value for normal and subnormal halves alike; inf and nan keep a full exponent."""
    magnitude = np.uint32(bits & 0x7FFF) << 13
    x = _as_float32(magnitude) * np.float32(2.0 ** 112)
    if magnitude >= np.uint32(0x7C00 << 13):  # inf, nan
        x = _as_float32(magnitude | np.uint32(0x7F800000))
    return _as_float32(_as_uint32(x) | (np.uint32(bits & 0x8000) << 16))


@njit(cache=True, nogil=True, inline="always", fastmath=False)
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


@njit(cache=True, nogil=True, inline="always", fastmath=False)
def _to_bfloat16(x):
    """float32 -> bfloat16 bits (uint16), to nearest, ties to even: compact.to_bfloat16's rounding."""
    bits = _as_uint32(x)
    return np.uint16((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16)


@njit(cache=True, nogil=True, inline="always", fastmath=False)
def _from_bfloat16(bits):
    """bfloat16 bits (uint16) -> their float32 value, exactly."""
    return _as_float32(np.uint32(bits) << 16)


@njit(cache=True, nogil=True, inline="always", fastmath=False)
def _rounded(x):
    """float32 x to the nearest bfloat16, ties to even, as a float32."""
    return _from_bfloat16(_to_bfloat16(x))


def _store_row(src, dst, half, rounds):
    """dst[:] = src, rounded to bfloat16 first if ``rounds``, then to the cache's format. src: float32 (D,);
    dst: float32 (D,), or uint16 (D,) bits of float16 (``half``) or bfloat16."""


@overload(_store_row, inline="always")
def _store_row_typed(src, dst, half, rounds):
    if dst.dtype == types.float32:
        def store(src, dst, half, rounds):
            if rounds:
                for d in range(src.size):
                    dst[d] = _rounded(src[d])
            else:
                dst[:] = src
        return store

    def store_bits(src, dst, half, rounds):
        if half and rounds:
            for d in range(src.size):
                dst[d] = _to_half(_rounded(src[d]))
        elif half:
            for d in range(src.size):
                dst[d] = _to_half(src[d])
        else:
            for d in range(src.size):
                dst[d] = _to_bfloat16(src[d])
    return store_bits


numbacache.guard(__name__)  # this module's cached kernels load and save under a lock (numbacache.py)

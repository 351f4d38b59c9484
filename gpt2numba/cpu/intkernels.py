"""Numba kernels of the integer formats (int8, int4; see compact.py).

A product with an integer matrix takes its input rows quantised to int8 per group
of GROUP (_quantize_rows). Up to dispatch.INT_ROWS_MAX rows, _int_rows multiplies int8 by
int8 (int4 unpacked in registers) into int32, one group at a time, and scales once
per group, four input rows (_dot_four_rows) to a row of W loaded once, the rest one at a time
(_dot_row), each row's float the same either way. The dot products are written in LLVM's
vector IR (_dot_sums) so that every x86 gets the CPU's 8-bit multiply-add: with VNNI,
vpdpbusd, the weights as unsigned bytes (int4's nibbles as stored, w + 8; int8's w + 128)
from sums that start at the inputs' fours times -8 or -128; else vpmaddubsw with AVX2, or
pmaddwd. They fetch the matrix PREFETCH_BYTES ahead of their reads. More rows go to
inttiles.py, in tiles of rows and outputs.

Private and unchecked, as kernels.py: callers in forward.py validate.
"""

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from . import numbacache
from .chunks import _claimed, _span
from .dispatch import GROUP as _GROUP, BYTE_MADD, MADD_WIDTH, NIBBLE_VNNI, PREFETCH_BYTES
from .kernels import _as_float32, _as_uint32, _put

_HALF_GROUP = _GROUP // 2


def _madd_pairs(builder, a, b):
    """(GROUP/2,) int32: a[2i] * b[2i] + a[2i+1] * b[2i+1] for (GROUP,) int16 vectors a, b.

    x86's pmaddwd does exactly this. LLVM lowers the generic form to it only when it cannot
    see that the operands are 8-bit values (it then multiplies in 16 bits and widens), so
    on x86 the instruction is called by name, at the widest width the CPU has.
    """
    i32 = ir.IntType(32)
    width = MADD_WIDTH
    if width:
        return _concat(builder, [_llvm(builder, _PMADDWD[width], ir.VectorType(i32, width // 2),
                                      _lanes(builder, a, range(k, k + width)), _lanes(builder, b, range(k, k + width)))
                                 for k in range(0, _GROUP, width)])
    half = ir.VectorType(i32, _HALF_GROUP)
    even, odd = range(0, _GROUP, 2), range(1, _GROUP, 2)
    return builder.add(
        builder.mul(builder.sext(_lanes(builder, a, even), half), builder.sext(_lanes(builder, b, even), half)),
        builder.mul(builder.sext(_lanes(builder, a, odd), half), builder.sext(_lanes(builder, b, odd), half)))


def _madd_bytes(builder, u, s):
    """(n/4,) int32: sums of four adjacent products u_j * s_j for (n,) int8 vectors, n a multiple of 32, u read as
    unsigned, exactly while no two adjacent products sum beyond int16 (_madd_signed_bytes's operands, and
    int4's nibbles as stored, at most 15, by inputs in [-127, 127]).

    AVX2's vpmaddubsw multiplies unsigned bytes by signed ones and adds adjacent pairs into int16;
    vpmaddwd with ones then adds adjacent int16 into int32.
    """
    b32, h16, q8 = ir.VectorType(ir.IntType(8), 32), ir.VectorType(ir.IntType(16), 16), ir.VectorType(ir.IntType(32), 8)
    ones = ir.Constant(h16, [1] * 16)
    parts = []
    for k in range(0, u.type.count, 32):
        uk, sk = _lanes(builder, u, range(k, k + 32)), _lanes(builder, s, range(k, k + 32))
        parts.append(_llvm(builder, _PMADDWD[16], q8, _llvm(builder, "llvm.x86.avx2.pmadd.ub.sw", h16, uk, sk), ones))
    return _concat(builder, parts)


def _madd_signed_bytes(builder, w, x):
    """(n/4,) int32: sums of four adjacent products w_j * x_j for (n,) int8 vectors w, x, exactly,
    for x in [-127, 127] (as _quantize_rows makes it; w may be any int8).

    _madd_bytes on |w| (a byte's sign taken off: -128 becomes the unsigned 128) and x with w's sign
    (vpsignb; x is in [-127, 127], so negating it is exact). A pair is at most 2 x 128 x 127 = 32512
    and never saturates. Four instructions for GROUP products where _madd_pairs needs six (it widens
    both operands first).
    """
    b32 = ir.VectorType(ir.IntType(8), 32)

    def sign(v, by):
        return _concat(builder, [_llvm(builder, "llvm.x86.avx2.psign.b", b32, _lanes(builder, v, range(k, k + 32)),
                                      _lanes(builder, by, range(k, k + 32))) for k in range(0, v.type.count, 32)])
    return _madd_bytes(builder, sign(w, w), sign(x, w))


_PMADDWD = {32: "llvm.x86.avx512.pmaddw.d.512", 16: "llvm.x86.avx2.pmadd.wd", 8: "llvm.x86.sse2.pmadd.wd"}  # by int16 lanes


def _llvm(builder, name, ret, *args):
    """A call of LLVM's intrinsic ``name``: an x86 instruction by its name, or llvm.prefetch (declared in the
    module at its first use)."""
    fn = builder.module.globals.get(name) or ir.Function(builder.module,
                                                         ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, list(args))


def _prefetch(builder, pointer, locality=3):
    """Ask the CPU to start reading the cache line at ``pointer`` (a byte's address) for a read soon:
    llvm.prefetch, which never faults, whatever the address. locality 3 brings it to L1 (prefetcht0),
    2 to L2 (prefetcht1)."""
    i32 = ir.IntType(32)
    name = "llvm.prefetch.p0" if str(pointer.type) == "ptr" else "llvm.prefetch.p0i8"  # (opaque pointers or typed)
    _llvm(builder, name, ir.VoidType(), pointer, ir.Constant(i32, 0), ir.Constant(i32, locality),
          ir.Constant(i32, 1))  # read, keep, data


def _concat(builder, parts):
    """The vectors ``parts`` (a power of two of them, of one type) end to end, as one vector."""
    while len(parts) > 1:
        parts = [builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(ir.IntType(32), 2 * a.type.count),
                                                          list(range(2 * a.type.count))))
                 for a, b in zip(parts[::2], parts[1::2])]
    return parts[0]


def _lanes(builder, v, lanes):
    lanes = list(lanes)
    if lanes == list(range(v.type.count)):
        return v
    return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(ir.IntType(32), len(lanes)), lanes))


# LLVM's names of VNNI's vpdpbusd, with which _dot_row multiplies int4's nibbles (and int8's bytes, at 512 bits),
# by groups a step (one group's 32 bytes in 256 bits, or two groups' 64 in 512), where the CPU has it; else None
_NIBBLE_DPBUSD = {bits // 256: f"llvm.x86.avx512.vpdpbusd.{bits}" for bits in NIBBLE_VNNI} or None
# int4's nibbles multiplied as stored (w + 8, unsigned), from sums that start at -8 times the inputs' fours: with
# VNNI's vpdpbusd, or AVX2's vpmaddubsw, which then needs neither the 8 taken off nor the signs moved
_NIBBLES_AS_STORED = _NIBBLE_DPBUSD is not None or BYTE_MADD


def _unsigned_weights(packed: bool) -> bool:
    """Whether _dot_row multiplies the weights as unsigned bytes (int4's nibbles as stored, w + 8; int8's w + 128,
    by a 512-bit vpdpbusd, two groups at once: measured on AVX-512 only) from sums that start at the inputs'
    fours times -8 or -128 (_nibble_starts), not as signed ones."""
    return _NIBBLES_AS_STORED if packed else _NIBBLE_DPBUSD is not None and 2 in _NIBBLE_DPBUSD


def _is_rows(a, ndim, *dtypes):
    return isinstance(a, types.Array) and a.dtype in dtypes and a.ndim == ndim and a.layout == "C"


@intrinsic
def _dot_row(typingctx, w, ws, x, xs, xc):
    """One integer row's dot product with one quantised input row, as float32:
    sum over groups g of (sum over j < GROUP of w_gj * x_gj, in int32) * ws[g] * xs[g].

    w: 1-D int8 (K,) or uint8 packed int4 (K // 2,: byte j of a group holds w_j + 8 in
    its low nibble, w_{j+GROUP/2} + 8 in its high one); ws: float32 (K // GROUP,), w's
    scales; x: int8 (K,) in [-127, 127]; xs: float32 (K // GROUP,); xc: int32 (K // 4,), x's
    sums of four times -8 or -128 (_nibble_starts). Written as LLVM vector IR (_dot_sums).
    Unchecked: K is a multiple of GROUP, at least GROUP.
    """
    if not (_is_rows(w, 1, types.int8, types.uint8) and _is_rows(x, 1, types.int8)
            and _is_rows(ws, 1, types.float32) and _is_rows(xs, 1, types.float32) and _is_rows(xc, 1, types.int32)):
        return None

    def codegen(context, builder, sig, args):
        wa, wsa, xa, xsa, xca = (context.make_array(ty)(context, builder, v) for ty, v in zip(sig.args, args))
        return _dot_sums(builder, wa, wsa, [(xa.data, xsa.data, xca.data)], w.dtype == types.uint8)[0]

    return types.float32(w, ws, x, xs, xc), codegen


DOT_ROWS = 4  # input rows _dot_four_rows multiplies by one integer row at once


@intrinsic
def _dot_four_rows(typingctx, w, ws, x, xs, xc, t):
    """_dot_row of the integer row w with the DOT_ROWS input rows t, t + 1, ... of x: int8 (T, K), xs: (T, K // GROUP),
    xc: (T, K // 4) or (T, 0); a tuple of DOT_ROWS float32, each the bits _dot_row gives for its row alone. The
    weights are loaded (int4's nibbles unpacked) once for all the rows, and each row's sums are a chain of their
    own. Unchecked: t + DOT_ROWS <= T."""
    if not (_is_rows(w, 1, types.int8, types.uint8) and _is_rows(x, 2, types.int8)
            and _is_rows(ws, 1, types.float32) and _is_rows(xs, 2, types.float32) and _is_rows(xc, 2, types.int32)
            and isinstance(t, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        wa, wsa, xa, xsa, xca = (context.make_array(ty)(context, builder, v) for ty, v in zip(sig.args[:5], args[:5]))
        i64 = ir.IntType(64)
        t0 = context.cast(builder, args[5], sig.args[5], types.int64)
        rows = []
        for i in range(DOT_ROWS):
            row = builder.add(t0, ir.Constant(i64, i))
            rows.append(tuple(builder.gep(a.data, [builder.mul(row, builder.extract_value(a.shape, 1))])
                              for a in (xa, xsa, xca)))
        sums = _dot_sums(builder, wa, wsa, rows, w.dtype == types.uint8)
        return context.make_tuple(builder, sig.return_type, sums)

    return types.UniTuple(types.float32, DOT_ROWS)(w, ws, x, xs, xc, t), codegen


def _dot_sums(builder, wa, wsa, rows, packed):
    """The dot products of the integer row (wa: w, wsa: its scales) with each input row in ``rows`` (pointers
    to its int8 values, its scales, its sums of fours xc), as float32 scalars.

    Per group, the 8-bit operands are multiplied and summed in fours (_madd_signed_bytes, with AVX2), or
    in pairs once sign-extended (_madd_pairs: pmaddwd on x86); with VNNI (vpdpbusd) the weights are
    multiplied as unsigned bytes, int4's nibbles as stored (w + 8) and int8's bytes + 128, into sums that
    start at xc, which takes the 8 or 128 off (int4 with AVX2 alike, by _madd_bytes). The int32 sums are
    converted to float and scaled into vector accumulators, a group's lanes or (AVX2, VNNI) two groups';
    lanes are summed once per row.
    """
    vnni = _NIBBLE_DPBUSD is not None
    as_stored = _unsigned_weights(packed)
    i8, i16, i32, f32, i64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType(), ir.IntType(64)
    half = _HALF_GROUP
    lanes_n = _GROUP // 4 if BYTE_MADD or as_stored else half  # int32 sums of a group

    def vec(ty, n):
        return ir.VectorType(ty, n)

    def load(ptr, at, ty):
        return builder.load(builder.bitcast(builder.gep(ptr, [at]), ty.as_pointer()), align=1)

    def const(ty, n, value):
        return ir.Constant(vec(ty, n), [value] * n)

    def groups_at(g, per):
        """The scaled sums of groups g .. g + per - 1 of every row, as float32 <per * lanes_n> each."""
        n = per * _GROUP
        at = builder.mul(g, ir.Constant(i64, half if packed else _GROUP))  # the groups' first byte
        _prefetch(builder, builder.gep(wa.data, [builder.add(at, ir.Constant(i64, PREFETCH_BYTES))]))
        if packed:  # each group's low nibbles, then its high ones
            raw = load(wa.data, at, vec(i8, n // 2))
            low, high = builder.and_(raw, const(i8, n // 2, 15)), builder.lshr(raw, const(i8, n // 2, 4))
            order = [k + j + (n // 2 if j >= half else 0) - (half if j >= half else 0)
                     for k in range(0, n // 2, half) for j in range(_GROUP)]
            wv = builder.shuffle_vector(low, high, ir.Constant(vec(i32, n), order))
        else:
            wv = load(wa.data, at, vec(i8, n))
            if as_stored:  # w + 128 as unsigned bytes (flipping the sign bit), for vpdpbusd
                wv = builder.xor(wv, const(i8, n, -128))
        if packed and not as_stored:
            wv = builder.sub(wv, const(i8, n, 8))
        wide = None if as_stored or BYTE_MADD else builder.sext(wv, vec(i16, n))
        wscale = load(wsa.data, g, vec(f32, per))
        out = []
        for x, xs, xc in rows:
            xv = load(x, builder.mul(g, ir.Constant(i64, _GROUP)), vec(i8, n))
            if as_stored:
                quads = vec(i32, per * lanes_n)
                start = load(xc, builder.mul(g, ir.Constant(i64, lanes_n)), quads)
                sums = (_llvm(builder, _NIBBLE_DPBUSD[per], quads, start, builder.bitcast(wv, quads),
                              builder.bitcast(xv, quads))
                        if vnni else builder.add(start, _madd_bytes(builder, wv, xv)))
            else:
                sums = (_madd_signed_bytes(builder, wv, xv) if BYTE_MADD
                        else _madd_pairs(builder, wide, builder.sext(xv, vec(i16, n))))
            scales = builder.fmul(wscale, load(xs, g, vec(f32, per)))
            splat = builder.shuffle_vector(scales, scales, ir.Constant(vec(i32, per * lanes_n),
                                                                       [k for k in range(per) for _ in range(lanes_n)]))
            out.append(builder.fmul(builder.sitofp(sums, vec(f32, per * lanes_n)), splat, flags=("contract",)))
        return out

    def steps(first, count, per, accs):
        """accs + the scaled sums of groups first .. first + per * count - 1, per groups a step."""
        before = builder.block
        loop, after = builder.append_basic_block("dot_row"), builder.append_basic_block("dot_row_done")
        builder.cbranch(builder.icmp_signed(">", count, ir.Constant(i64, 0)), loop, after)
        builder.position_at_end(loop)
        i = builder.phi(i64)
        i.add_incoming(ir.Constant(i64, 0), before)
        phis = []
        for acc in accs:
            phis.append(builder.phi(acc.type))
            phis[-1].add_incoming(acc, before)
        g = builder.add(first, builder.mul(i, ir.Constant(i64, per)))
        stepped = [builder.fadd(a, s, flags=("contract",)) for a, s in zip(phis, groups_at(g, per))]
        nxt = builder.add(i, ir.Constant(i64, 1))
        i.add_incoming(nxt, loop)
        for a, step in zip(phis, stepped):
            a.add_incoming(step, loop)
        builder.cbranch(builder.icmp_signed("<", nxt, count), loop, after)
        builder.position_at_end(after)
        outs = []
        for acc, step in zip(accs, stepped):
            outs.append(builder.phi(acc.type))
            outs[-1].add_incoming(acc, before)
            outs[-1].add_incoming(step, loop)
        return outs

    def halved(v):
        n = v.type.count // 2
        return builder.fadd(_lanes(builder, v, range(n)), _lanes(builder, v, range(n, 2 * n)))

    groups = builder.extract_value(wsa.shape, 0)
    # groups a step: two, in one 512-bit vpdpbusd, or with AVX2 in two 256-bit sums, each its own chain of
    # additions (one chain made every group wait for the last one's)
    per = 2 if (2 in _NIBBLE_DPBUSD if vnni and as_stored else BYTE_MADD) else 1
    zero = ir.Constant(i64, 0)
    accs = steps(zero, builder.sdiv(groups, ir.Constant(i64, per)), per, [const(f32, per * lanes_n, 0.0)] * len(rows))
    if per == 2:  # and the last group if their count is odd
        accs = steps(builder.sub(groups, ir.Constant(i64, 1)), builder.srem(groups, ir.Constant(i64, 2)), 1,
                     [halved(a) for a in accs])
    sums = []
    for lanes in accs:
        while lanes.type.count > 1:  # halve the lanes until one is left
            lanes = halved(lanes)
        sums.append(builder.extract_element(lanes, ir.Constant(i32, 0)))
    return sums


def _nibble_starts(xq, w):
    """xc (T, K // 4) int32: -8 (int4) or -128 (int8) times the sums of each row's fours of inputs, where
    _dot_row starts the sums of the weights as unsigned bytes (int4's nibbles w + 8, int8's w + 128) by x with
    VNNI, so that they come out as the sums of w by x; (T, 0) where _dot_row does not read it."""


@overload(_nibble_starts, inline="always")
def _nibble_starts_typed(xq, w):
    packed = w.dtype == types.uint8
    if not _unsigned_weights(packed):
        return lambda xq, w: np.empty((xq.shape[0], 0), np.int32)
    offset = np.int32(-8 if packed else -128)

    def starts(xq, w):
        T, K = xq.shape
        xc = np.empty((T, K // 4), np.int32)
        for t in range(T):
            for j in range(K // 4):
                xc[t, j] = offset * (np.int32(xq[t, 4 * j]) + np.int32(xq[t, 4 * j + 1])
                                     + np.int32(xq[t, 4 * j + 2]) + np.int32(xq[t, 4 * j + 3]))
        return xc
    return starts


def _widen_group(row, g, s, out):
    """out[g*GROUP : (g+1)*GROUP] = float32 values of group g of an integer matrix's row, times s."""


@overload(_widen_group, inline="always")
def _widen_group_typed(row, g, s, out):
    if row.dtype == types.uint8:
        def widen_packed(row, g, s, out):
            for j in range(_HALF_GROUP):
                byte = np.int32(row[g * _HALF_GROUP + j])
                out[g * _GROUP + j] = np.float32((byte & 15) - 8) * s
                out[g * _GROUP + _HALF_GROUP + j] = np.float32((byte >> 4) - 8) * s
        return widen_packed

    def widen(row, g, s, out):
        for j in range(_GROUP):
            out[g * _GROUP + j] = np.float32(row[g * _GROUP + j]) * s
    return widen


@njit(cache=True, nogil=True, error_model="numpy", fastmath=False)
def _quantize_rows(x, xq, xs):
    """xq, xs = int8 x per group of GROUP: scale = max|x| / 127, q = rint(x / scale), 0 for an all-zero group.

    x: float32 (T, K); xq: int8 (>= T, K); xs: float32 (>= T, K // GROUP).
    No fastmath: the division must round as NumPy's does. Written so that LLVM vectorises
    it: max|x| is taken on the bits with the sign cleared (non-negative floats order as
    their bits do), and the division is one loop over the row, each value by its group's
    scale (infinity for an all-zero group, whose values divide to 0), with NumPy's error
    model (Python's checks every division for a zero divisor, a branch that stops it).
    """
    T, K = x.shape
    divisor = np.empty(K, np.float32)
    for t in range(T):
        row, q = x[t], xq[t]
        for g in range(K // _GROUP):
            top = np.uint32(0)
            for j in range(g * _GROUP, (g + 1) * _GROUP):
                top = max(top, _as_uint32(row[j]) & np.uint32(0x7FFFFFFF))
            d = _as_float32(top) / np.float32(127.0)
            xs[t, g] = d
            divisor[g * _GROUP:(g + 1) * _GROUP] = d if d > 0 else np.float32(np.inf)
        for j in range(K):
            q[j] = np.int8(np.rint(row[j] / divisor[j]))


@njit(cache=True, nogil=True, parallel=True, fastmath=False)
def _int_rows(xq, xs, w, scale, b, out, accumulate, n_chunks):
    """out (+)= x @ W.T (+ b) for a few rows, W an integer matrix read as stored.

    xq: int8 (T, K) in [-127, 127], xs: (T, K // GROUP), the quantised input rows; w: int8 (N, K) or
    packed int4 uint8 (N, K // 2); scale: (N, K // GROUP); b: (N,) or None; out: (T, N).
    A chunk is a span of W's rows (whole cache lines of out); while a row is in
    cache, its dot product with every input row: per group, an int32 sum of
    products, scaled by the two groups' scales.
    """
    T = xq.shape[0]
    N = w.shape[0]
    xc = _nibble_starts(xq, w)
    nxt = np.zeros(1, np.int64)  # the next chunk (chunks.py)
    for _ in prange(n_chunks):
        for c in _claimed(nxt, n_chunks):
            start, end = _span(c, n_chunks, N, 16)
            for n in range(start, end):
                row, srow = w[n], scale[n]
                t = 0
                while t + DOT_ROWS <= T:  # rows DOT_ROWS at a time, the row of W loaded once for them
                    sums = _dot_four_rows(row, srow, xq, xs, xc, t)
                    for i in range(DOT_ROWS):
                        _put(out, t + i, n, sums[i], b, accumulate)
                    t += DOT_ROWS
                for t in range(t, T):
                    _put(out, t, n, _dot_row(row, srow, xq[t], xs[t], xc[t]), b, accumulate)


@njit(cache=True, nogil=True, fastmath=False)
def _int_matmul(x, xq, xs, w, scale, b, out, accumulate, n_chunks):
    """out (+)= x @ W.T (+ b): x quantised into xq, xs (_quantize_rows), then _int_rows; one call from Python."""
    _quantize_rows(x, xq, xs)
    _int_rows(xq, xs, w, scale, b, out, accumulate, n_chunks)


numbacache.guard(__name__)  # this module's cached kernels load and save under a lock (numbacache.py)

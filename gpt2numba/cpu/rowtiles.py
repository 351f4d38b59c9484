"""Products over a few rows with a matrix kept [out, in]: tiles of rows x outputs, their sums in registers.

out (+)= x @ W.T (+ b) for 1 to a few dozen rows of x, W float32 or bfloat16 bits (uint16), each of
its rows an output's weights, contiguous (bfloat16's block matrices, the tied head's wte). A tile
takes TILE_ROWS rows of x and TILE_OUTPUTS rows of W and keeps their TILE_ROWS x TILE_OUTPUTS dot
products as vectors of partial sums in registers along K: per step of LANES inputs it loads each W
row's step once (bfloat16 widened in registers) and each x row's once, and multiply-adds every pair,
so that a weight loaded from memory serves TILE_ROWS rows and an input TILE_OUTPUTS outputs. The
sums are reduced across their lanes once, at the end. A thread walks its span of W's rows a tile of
outputs at a time and, for each, every tile of rows: W's rows stream from memory once, in order (the
next tile's fetched while this one's are multiplied), and x's rows stay in cache. Measured in
docs/performance-history.md, "A few rows in tiles". A lone row of x takes ROW_OUTPUTS outputs at a time,
each sum added in the order a tile adds it: a row's products have the same bits alone and among others.

x may be bfloat16 bits too (bfloat16 activations, with W's bfloat16): with AVX512_BF16 a step is then
2 x LANES inputs, one vdpbf16ps a pair of rows (it multiplies 32 pairs of bfloat16 into 16 float32
sums); without it both operands are widened in registers.

Written in LLVM's vector IR, as intkernels.py, so that the sums stay in registers: the tile's
geometry follows the vector width dispatch.py found (16 lanes and 4 x 4 sums with AVX-512, 8 lanes and
4 x 2 with AVX2, 4 lanes and 4 x 2 with SSE2, 8 lanes and 4 x 2 off x86). Private and unchecked, as
the other kernels.
"""

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

from . import numbacache
from .dispatch import BF16_DOT, MADD_WIDTH
from .intkernels import _llvm, _prefetch
from .kernels import _from_bfloat16, _put

LANES = MADD_WIDTH // 2 if MADD_WIDTH else 8  # float32 lanes of the widest vector (int16 lanes / 2)
TILE_ROWS = 4  # rows of x per tile
TILE_OUTPUTS = 4 if LANES >= 16 else 2  # rows of W per tile: 16 sums in 32 zmm registers; 8 in 16 ymm


def _widen(v):
    """A stored weight or input as float32: itself, or bfloat16 bits (uint16)."""


@overload(_widen, inline="always")
def _widen_typed(v):
    if v == types.uint16:
        return lambda v: _from_bfloat16(v)
    return lambda v: np.float32(v)


def _step(x):
    """Inputs per step of _tile_sums for rows x: 2 LANES for bfloat16 bits by vdpbf16ps, else LANES."""


@overload(_step, inline="always")
def _step_typed(x):
    step = 2 * LANES if x.dtype == types.uint16 and BF16_DOT else LANES
    return lambda x: step


def _sums_of(R, O):
    """The intrinsic that takes the dot products of R rows of x with O rows of W, as _sums_typed says."""
    def sums_of(typingctx, w, x, v0, v1, t0, T, sums):
        return _sums_typed(R, O, w, x, sums)
    sums_of.__name__ = sums_of.__qualname__ = f"_sums_{R}x{O}"
    return intrinsic(sums_of)


def _sums_typed(R, O, w, x, sums):
    """The typing and code of _sums_of(R, O)(w, x, v0, v1, t0, T, sums): sums[r * O + n] = x[min(t0 + r, T - 1),
    :Kv] . W[min(v0 + n, v1 - 1), :Kv] (float32, partial sums per lane reduced at the end), Kv = K rounded down
    to _step(x), for r < R, n < O.

    w: float32 or uint16 (bfloat16 bits) (N, K), C order; x: float32 (T, K), or bfloat16 bits with w's
    bfloat16 (bfloat16 activations: with BF16_DOT, vdpbf16ps multiplies pairs, 2 LANES products into LANES
    sums; else both widened), C order;
    sums: float32 (R * O rounded up to LANES,). Rows past T or v1 repeat the last (their sums are for the caller
    to drop). Every sum is taken in one order, lane by lane along K and then across the lanes (_lane_sums),
    whatever R and O, with no reassociation (only `contract`, which every copy fuses alike): a row's sums have the
    same bits in any tile, and no optimizer may reorder them (a fast-math loop's order is the optimizer's, and Numba 0.59 runs a kernel's callee as compiled
    alone in the process that compiled it, as optimized again inside the kernel in those that load it).
    """
    def is_c(a, dtypes, ndim):
        return isinstance(a, types.Array) and a.dtype in dtypes and a.ndim == ndim and a.layout == "C"

    if not (is_c(w, (types.float32, types.uint16), 2) and is_c(x, (types.float32, w.dtype), 2)
            and is_c(sums, (types.float32,), 1)):
        return None
    bits, x_bits = w.dtype == types.uint16, x.dtype == types.uint16
    dot = x_bits and BF16_DOT

    def codegen(context, builder, sig, args):
        wa, xa, sa = (context.make_array(ty)(context, builder, v)
                      for ty, v in (zip((sig.args[0], sig.args[1], sig.args[6]), (args[0], args[1], args[6]))))
        v0v, v1v, t0v, Tv = args[2:6]
        i16, i32, i64, f32 = ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
        L = LANES
        S = 2 * L if dot else L  # inputs a step
        vf = ir.VectorType(f32, L)

        def const(n):
            return ir.Constant(i64, n)

        def clamped(first, r, end):  # min(first + r, end - 1)
            at = builder.add(first, const(r))
            return builder.select(builder.icmp_signed("<", at, end), at, builder.sub(end, const(1)))

        def vector_at(ptr, index, ty, align):  # the vector of ty at ptr[index]
            return builder.load(builder.bitcast(builder.gep(ptr, [index]), ty.as_pointer()), align=align)

        def widened(ptr, index):  # L bfloat16 values at ptr[index] as float32: the high half of each
            return builder.bitcast(builder.shl(builder.zext(vector_at(ptr, index, ir.VectorType(i16, L), 2),
                                                            ir.VectorType(i32, L)),
                                               ir.Constant(ir.VectorType(i32, L), [16] * L)), vf)

        def pairs(ptr, index):  # 2L bfloat16 values at ptr[index], as vdpbf16ps takes them
            return vector_at(ptr, index, ir.VectorType(i32, L), 2)

        K = builder.extract_value(xa.shape, 1)
        Kv = builder.mul(builder.sdiv(K, const(S)), const(S))
        w_row = [builder.mul(clamped(v0v, n, v1v), K) for n in range(O)]
        ahead = builder.mul(K, const(O))
        x_row = [builder.mul(clamped(t0v, r, Tv), K) for r in range(R)]
        zero = ir.Constant(vf, [0.0] * L)
        entry = builder.block
        loop = builder.append_basic_block("tile_k")
        done = builder.append_basic_block("tile_done")
        builder.cbranch(builder.icmp_signed(">", Kv, const(0)), loop, done)

        builder.position_at_end(loop)
        k = builder.phi(i64)
        k.add_incoming(const(0), entry)
        acc = [[builder.phi(vf) for _ in range(O)] for _ in range(R)]
        for r in range(R):
            for n in range(O):
                acc[r][n].add_incoming(zero, entry)
        for n in range(O):  # the next tile's row n, as far ahead as this tile reads its own
            _prefetch(builder, builder.bitcast(builder.gep(wa.data, [builder.add(builder.add(w_row[n], ahead), k)]),
                                               ir.IntType(8).as_pointer()))
        load = pairs if dot else widened if bits else lambda ptr, index: vector_at(ptr, index, vf, 4)
        wv = [load(wa.data, builder.add(w_row[n], k)) for n in range(O)]
        if not dot:
            load = widened if x_bits else lambda ptr, index: vector_at(ptr, index, vf, 4)
        nxt = []
        for r in range(R):
            xv = load(xa.data, builder.add(x_row[r], k))
            if dot:
                nxt.append([_llvm(builder, "llvm.x86.avx512bf16.dpbf16ps.512", vf, acc[r][n], wv[n], xv)
                            for n in range(O)])
            else:
                nxt.append([builder.fadd(acc[r][n], builder.fmul(xv, wv[n], flags=("contract",)),
                                         flags=("contract",)) for n in range(O)])
            for n in range(O):
                acc[r][n].add_incoming(nxt[r][n], loop)
        k_next = builder.add(k, const(S))
        k.add_incoming(k_next, loop)
        builder.cbranch(builder.icmp_signed("<", k_next, Kv), loop, done)

        builder.position_at_end(done)
        totals = [[builder.phi(vf) for _ in range(O)] for _ in range(R)]
        for r in range(R):
            for n in range(O):
                totals[r][n].add_incoming(zero, entry)
                totals[r][n].add_incoming(nxt[r][n], loop)
        for j, v in enumerate(_lane_sums(builder, [s for row in totals for s in row])):
            builder.store(v, builder.bitcast(builder.gep(sa.data, [const(j * L)]), vf.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.void(w, x, types.int64, types.int64, types.int64, types.int64, sums), codegen


def _lane_sums(builder, vectors):
    """The sums of the lanes of n float vectors of L lanes each, as ceil(n / L) vectors: sum i in lane i % L of
    vector i // L (n padded with zeros to a multiple of L, which touch no other sum). Pairs of vectors are folded
    into one, each half of a lane block added to the other, until every block is one lane wide: log2(L) rounds
    of two shuffles and an add per pair, not log2(L) of them per vector. Every sum's lanes are added in a tree
    of one shape, whichever vector holds them."""
    i32 = ir.IntType(32)
    L = vectors[0].type.count
    vectors = vectors + [ir.Constant(vectors[0].type, [0.0] * L)] * (-len(vectors) % L)
    width = L  # lanes per block; vector j holds blocks for the sums j * (L // width) ...
    while width > 1:
        half, blocks = width // 2, L // width
        firsts = [b * width + i for b in range(blocks) for i in range(half)]
        mask_a = ir.Constant(ir.VectorType(i32, L), firsts + [L + k for k in firsts])
        mask_b = ir.Constant(ir.VectorType(i32, L), [k + half for k in firsts] + [L + k + half for k in firsts])
        vectors = [builder.fadd(builder.shuffle_vector(a, b, mask_a), builder.shuffle_vector(a, b, mask_b))
                   for a, b in zip(vectors[::2], vectors[1::2])]
        width = half
    return vectors


ROW_OUTPUTS = 4  # rows of W a lone row of x takes at once
SUMS = max(TILE_ROWS * TILE_OUTPUTS, -(-ROW_OUTPUTS // LANES) * LANES)  # a thread's sums (_tiles)
_tile_sums = _sums_of(TILE_ROWS, TILE_OUTPUTS)
_row_sums = _sums_of(1, ROW_OUTPUTS)


@njit(cache=True, nogil=True, fastmath=False)
def _tiles(w, x, b, out, accumulate, start, end, sums):
    """out[:, v] (+)= X @ W[v].T (+ b[v]) for v in start..end-1, W = widen(w), X = widen(x), in tiles: every tile
    of rows for each tile of outputs; one row ROW_OUTPUTS outputs at a time. w: (N, K); x: (T, K); b: (N,) or
    None; out: (T, N); sums: float32 (SUMS,), the thread's."""
    T, K = x.shape
    Kv = K - K % _step(x)
    if T == 1:
        for v0 in range(start, end, ROW_OUTPUTS):
            _row_sums(w, x, v0, end, 0, 1, sums)
            for n in range(min(ROW_OUTPUTS, end - v0)):
                _put_sum(w, x, 0, v0 + n, sums[n], Kv, b, out, accumulate)
        return
    for v0 in range(start, end, TILE_OUTPUTS):
        for t0 in range(0, T, TILE_ROWS):
            _tile_sums(w, x, v0, end, t0, T, sums)
            for r in range(min(TILE_ROWS, T - t0)):
                for n in range(min(TILE_OUTPUTS, end - v0)):
                    _put_sum(w, x, t0 + r, v0 + n, sums[r * TILE_OUTPUTS + n], Kv, b, out, accumulate)


@njit(nogil=True, inline="always", fastmath=False)
def _put_sum(w, x, t, v, s, Kv, b, out, accumulate):
    """out[t, v] (+)= s + the products of the inputs past the last whole step, Kv.. (+ b[v])."""
    for k in range(Kv, x.shape[1]):
        s += _widen(x[t, k]) * _widen(w[v, k])
    _put(out, t, v, s, b, accumulate)


numbacache.guard(__name__)  # this module's cached kernels load and save under a lock (numbacache.py)

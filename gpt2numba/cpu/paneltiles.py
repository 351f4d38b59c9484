"""bfloat16 products over many rows on AVX512_BF16: out (+)= X @ W.T (+ b), X and W bfloat16 bits.

For bfloat16 activations (model/products.py): the inputs X rounded to bfloat16 once, W bfloat16 as stored
[out, in]. vdpbf16ps multiplies 16 pairs of bfloat16 by 16 pairs and adds each pair's two products into
one of 16 float32 sums. rowtiles.py's tiles use it along K (dot products, reduced across lanes at the
end); here, as a GEMM's micro-kernel does, the lanes are outputs: a thread packs PANELS x 16 of W's rows
into panels, for each pair of inputs the 16 outputs' pairs side by side (_pack), then runs every tile of
TILE_ROWS rows of X against them (_panel_sums): per pair of inputs, one load of each panel and one
broadcast of each row's pair, TILE_ROWS x PANELS multiply-adds, every sum in a register of its own and
none reduced across lanes. The panels (PANELS x 16 rows of W, 48 KB at K = 768) stay in L2 while
every row of X streams past them; X's rows are read 4 bytes at a time, in order. A W given by its transpose
(attention's values, positions by head_dim) packs the same panels by interleaving pairs of its rows
(_pack_columns).

A row's sums are taken in the same order whatever the tile and the thread: the same bits for a row
however many come with it. Only with AVX512_BF16 (BF16_DOT; model/products.py decides); private and
unchecked, as the other kernels.
"""

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from . import numbacache
from .chunks import _claimed, _span
from .intkernels import _llvm
from .kernels import _put

LANES = 16  # float32 sums of a 512-bit vdpbf16ps: the outputs of a panel
PANELS = 2  # panels a tile multiplies: 16 x PANELS outputs
TILE_ROWS = 12  # rows of X a tile multiplies: TILE_ROWS x PANELS sums in 24 of the 32 zmm registers
OUTPUTS = LANES * PANELS  # W's rows packed at a time


@njit(cache=True, nogil=True, fastmath=False)
def _pack(w, n0, panels):
    """panels = W's rows n0..n0+OUTPUTS-1 as _panel_sums reads them: panels[((p * H + h) * LANES + i) * 2 + j]
    = w[n0 + p * LANES + i, 2h + j], H = K / 2; rows past W's end are zeros. w: uint16 (N, K), K even;
    panels: uint16 (>= PANELS * K * LANES,). A pair is one uint32: 16 rows' 16 pairs at a time are a 16 x 16
    transpose in registers (_transpose_block); what is left over (rows past W's end, pairs past the last 16)
    moves one pair at a time."""
    N, K = w.shape
    H = K // 2
    pairs = panels.view(np.uint32)
    for p in range(PANELS):
        first = n0 + p * LANES
        count = max(0, min(LANES, N - first))
        base = p * H * LANES
        h0 = 0
        if count == LANES:
            while h0 + LANES <= H:
                _transpose_block(w, first, h0, pairs, base + h0 * LANES)
                h0 += LANES
        for h in range(h0, H):
            for i in range(LANES):
                n = first + i
                pairs[base + h * LANES + i] = (np.uint32(w[n, 2 * h]) | (np.uint32(w[n, 2 * h + 1]) << 16)
                                               if i < count else 0)


@njit(cache=True, nogil=True, fastmath=False)
def _pack_columns(w, n0, panels):
    """_pack's panels of W = w.T, w: uint16 (K, N) (K may be odd: a last pair's second input is 0). A pair is
    two of w's rows side by side, so this interleaves rows 2h and 2h + 1 and transposes nothing."""
    K, N = w.shape
    H = (K + 1) // 2
    pairs = panels.view(np.uint32)
    for p in range(PANELS):
        first = n0 + p * LANES
        count = max(0, min(LANES, N - first))
        base = p * H * LANES
        if count < LANES:
            pairs[base: base + H * LANES] = 0
        for h in range(K // 2):
            if count == LANES:
                _pair_rows(w, 2 * h, first, pairs, base + h * LANES)
            else:
                for i in range(count):
                    pairs[base + h * LANES + i] = np.uint32(w[2 * h, first + i]) | (np.uint32(w[2 * h + 1, first + i])
                                                                                   << 16)
        if K % 2:
            for i in range(LANES):
                pairs[base + (H - 1) * LANES + i] = np.uint32(w[K - 1, first + i]) if i < count else 0


@intrinsic
def _transpose_block(typingctx, w, first, h0, pairs, at):
    """pairs[at + j * LANES + i] = the pair h0 + j of w's row first + i (as a uint32, little-endian), for i, j <
    LANES: 16 loads, log2(16) rounds of 16 two-vector shuffles, 16 stores. w: uint16 (N, K), C order, rows
    first..first+15 and pairs h0..h0+15 inside it; pairs: uint32, C order."""
    if not (isinstance(w, types.Array) and w.dtype == types.uint16 and w.ndim == 2 and w.layout == "C"
            and isinstance(pairs, types.Array) and pairs.dtype == types.uint32 and pairs.layout == "C"):
        return None

    def codegen(context, builder, sig, args):
        wa, pa = context.make_array(sig.args[0])(context, builder, args[0]), \
            context.make_array(sig.args[3])(context, builder, args[3])
        first, h0, at = args[1], args[2], args[4]
        i32, i64 = ir.IntType(32), ir.IntType(64)
        vi = ir.VectorType(i32, LANES)
        H = builder.sdiv(builder.extract_value(wa.shape, 1), ir.Constant(i64, 2))
        src = builder.bitcast(wa.data, i32.as_pointer())
        rows = [builder.load(builder.bitcast(builder.gep(src, [builder.add(builder.mul(
            builder.add(first, ir.Constant(i64, i)), H), h0)]), vi.as_pointer()), align=4) for i in range(LANES)]
        width = LANES // 2
        while width:  # rows i and i + width swap their blocks of width lanes: a transpose in log2(16) rounds
            nxt = list(rows)
            for i in range(LANES):
                if i & width:
                    continue
                a, b = rows[i], rows[i + width]
                low = [k if k & width == 0 else k - width + LANES for k in range(LANES)]
                high = [k + width if k & width == 0 else k + LANES for k in range(LANES)]
                nxt[i] = builder.shuffle_vector(a, b, ir.Constant(vi, low))
                nxt[i + width] = builder.shuffle_vector(a, b, ir.Constant(vi, high))
            rows, width = nxt, width // 2
        dst = builder.bitcast(pa.data, i32.as_pointer())
        for j in range(LANES):
            ptr = builder.gep(dst, [builder.add(at, ir.Constant(i64, j * LANES))])
            builder.store(rows[j], builder.bitcast(ptr, vi.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.void(w, types.int64, types.int64, pairs, types.int64), codegen


@intrinsic
def _pair_rows(typingctx, w, r, first, pairs, at):
    """pairs[at + i] = w[r, first + i] | w[r + 1, first + i] << 16 for i < LANES: two loads, two widenings, a
    shift, an or and a store. (The same as a loop in Numba is several times slower, docs/performance-history.md: the
    compiler cannot tell pairs and w apart.) w: uint16 (K, N), C order; pairs: uint32, C order."""
    if not (_is_c(w, types.uint16, 2) and _is_c(pairs, types.uint32, 1)):
        return None

    def codegen(context, builder, sig, args):
        wa, pa = context.make_array(sig.args[0])(context, builder, args[0]), \
            context.make_array(sig.args[3])(context, builder, args[3])
        r, first, at = args[1], args[2], args[4]
        vh, vi = ir.VectorType(ir.IntType(16), LANES), ir.VectorType(ir.IntType(32), LANES)
        N = builder.extract_value(wa.shape, 1)
        lo = builder.add(builder.mul(r, N), first)
        halves = [builder.zext(builder.load(builder.bitcast(builder.gep(wa.data, [at_]), vh.as_pointer()), align=2), vi)
                  for at_ in (lo, builder.add(lo, N))]
        pair = builder.or_(halves[0], builder.shl(halves[1], ir.Constant(vi, [16] * LANES)))
        builder.store(pair, builder.bitcast(builder.gep(pa.data, [at]), vi.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.void(w, types.int64, types.int64, pairs, types.int64), codegen


def _is_c(a, dtype, ndim):
    return isinstance(a, types.Array) and a.dtype == dtype and a.ndim == ndim and a.layout == "C"


def _tile_totals(context, builder, panels_ty, x_ty, panels, x, t0, T):
    """The code of a tile: TILE_ROWS x PANELS vectors of LANES float32 sums, [r][p] = X[min(t0 + r, T - 1)] .
    W_packed[p, :, i] in lane i, for the panels (as _pack) and x, bfloat16 bits (T, K), K even, C order."""
    pa, xa = context.make_array(panels_ty)(context, builder, panels), context.make_array(x_ty)(context, builder, x)
    i32, i64, f32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
    vf, vi = ir.VectorType(f32, LANES), ir.VectorType(i32, LANES)

    def const(n):
        return ir.Constant(i64, n)

    H = builder.sdiv(builder.extract_value(xa.shape, 1), const(2))  # pairs of inputs a row
    pairs = builder.bitcast(xa.data, i32.as_pointer())  # X's pairs, one int32 each
    vectors = builder.bitcast(pa.data, vi.as_pointer())  # a panel's 16 outputs' pairs, one vector each
    rows = []
    for r in range(TILE_ROWS):  # min(t0 + r, T - 1), as an offset in pairs
        at = builder.add(t0, const(r))
        at = builder.select(builder.icmp_signed("<", at, T), at, builder.sub(T, const(1)))
        rows.append(builder.mul(at, H))
    panel = [builder.mul(H, const(p)) for p in range(PANELS)]
    zero = ir.Constant(vf, [0.0] * LANES)
    entry = builder.block
    loop = builder.append_basic_block("panel_k")
    done = builder.append_basic_block("panel_done")
    builder.cbranch(builder.icmp_signed(">", H, const(0)), loop, done)

    builder.position_at_end(loop)
    h = builder.phi(i64)
    h.add_incoming(const(0), entry)
    acc = [[builder.phi(vf) for _ in range(PANELS)] for _ in range(TILE_ROWS)]
    for row in acc:
        for a in row:
            a.add_incoming(zero, entry)
    wv = [builder.load(builder.gep(vectors, [builder.add(panel[p], h)]), align=2) for p in range(PANELS)]
    nxt = []
    for r in range(TILE_ROWS):
        pair = builder.load(builder.gep(pairs, [builder.add(rows[r], h)]), align=2)
        splat = builder.shuffle_vector(builder.insert_element(ir.Constant(vi, ir.Undefined), pair, const(0)),
                                       ir.Constant(vi, ir.Undefined), ir.Constant(vi, [0] * LANES))
        nxt.append([_llvm(builder, "llvm.x86.avx512bf16.dpbf16ps.512", vf, acc[r][p], wv[p], splat)
                    for p in range(PANELS)])
        for p in range(PANELS):
            acc[r][p].add_incoming(nxt[r][p], loop)
    h_next = builder.add(h, const(1))
    h.add_incoming(h_next, loop)
    builder.cbranch(builder.icmp_signed("<", h_next, H), loop, done)

    builder.position_at_end(done)
    totals = [[builder.phi(vf) for _ in range(PANELS)] for _ in range(TILE_ROWS)]  # (a block's phis come first)
    for r in range(TILE_ROWS):
        for p in range(PANELS):
            totals[r][p].add_incoming(zero, entry)
            totals[r][p].add_incoming(nxt[r][p], loop)
    return totals


@intrinsic
def _panel_sums(typingctx, panels, x, t0, T, sums):
    """sums[(r * PANELS + p) * LANES + i] = X[min(t0 + r, T - 1)] . W_packed[p, :, i] (float32), for r <
    TILE_ROWS, p < PANELS, i < LANES (_tile_totals). sums: float32 (TILE_ROWS * OUTPUTS,)."""
    if not (_is_c(panels, types.uint16, 1) and _is_c(x, types.uint16, 2) and _is_c(sums, types.float32, 1)):
        return None

    def codegen(context, builder, sig, args):
        totals = _tile_totals(context, builder, sig.args[0], sig.args[1], *args[:4])
        out = builder.bitcast(context.make_array(sig.args[4])(context, builder, args[4]).data,
                              totals[0][0].type.as_pointer())
        for r in range(TILE_ROWS):
            for p in range(PANELS):
                builder.store(totals[r][p], builder.gep(out, [ir.Constant(ir.IntType(64), r * PANELS + p)]), align=4)
        return context.get_dummy_value()

    return types.void(panels, x, types.int64, types.int64, sums), codegen


@intrinsic
def _panel_out(typingctx, panels, x, t0, out, n0, b, accumulate):
    """out[t0 + r, n0 + p * LANES + i] (+)= X[t0 + r] . W_packed[p, :, i] (+ b[n0 + p * LANES + i]) for a whole
    tile: rows t0..t0+TILE_ROWS-1 of x and OUTPUTS outputs from n0, all inside out (T, N) float32, C order;
    b: float32 (N,) or None; accumulate: bool."""
    if not (_is_c(panels, types.uint16, 1) and _is_c(x, types.uint16, 2) and _is_c(out, types.float32, 2)
            and (b is types.none or _is_c(b, types.float32, 1))):
        return None

    def codegen(context, builder, sig, args):
        panels_v, x_v, t0_v, out_v, n0_v, b_v, acc_v = args
        xa = context.make_array(sig.args[1])(context, builder, x_v)
        totals = _tile_totals(context, builder, sig.args[0], sig.args[1], panels_v, x_v, t0_v,
                              builder.extract_value(xa.shape, 0))
        i64, vf = ir.IntType(64), totals[0][0].type
        oa = context.make_array(sig.args[3])(context, builder, out_v)
        N = builder.extract_value(oa.shape, 1)
        zero = ir.Constant(vf, [0.0] * LANES)
        for p in range(PANELS):
            n = builder.add(n0_v, ir.Constant(i64, p * LANES))
            bias = zero
            if sig.args[5] is not types.none:
                ba = context.make_array(sig.args[5])(context, builder, b_v)
                bias = builder.load(builder.bitcast(builder.gep(ba.data, [n]), vf.as_pointer()), align=4)
            for r in range(TILE_ROWS):
                at = builder.bitcast(builder.gep(oa.data, [builder.add(builder.mul(builder.add(t0_v, ir.Constant(
                    i64, r)), N), n)]), vf.as_pointer())
                old = builder.select(builder.trunc(acc_v, ir.IntType(1)), builder.load(at, align=4), zero)
                builder.store(builder.fadd(old, builder.fadd(totals[r][p], bias)), at, align=4)
        return context.get_dummy_value()

    return types.void(panels, x, types.int64, out, types.int64, b, types.boolean), codegen


@njit(cache=True, nogil=True, parallel=True, fastmath=False)
def _panel_product(w, x, b, out, accumulate, n_chunks):
    """out (+)= X @ W.T (+ b) for many rows: X = x, W = w, bfloat16 bits. w: (N, K); x: (T, K), K even;
    b: (N,) float32 or None; out: float32 (T, N). A chunk is a span of W's rows (outputs): _panels."""
    N, K = w.shape
    nxt = np.zeros(1, np.int64)  # the next chunk (chunks.py)
    for _ in prange(n_chunks):
        buffers = _panel_buffers(K)
        for c in _claimed(nxt, n_chunks):
            start, end = _span(c, n_chunks, N, LANES)
            _panels(w, x, b, out, accumulate, start, end, buffers)


@njit(cache=True, nogil=True, fastmath=False)
def _panel_buffers(K):
    """One thread's buffers for _panels over K inputs: its panels and a tile's sums."""
    return np.empty(PANELS * K * LANES, np.uint16), np.empty(TILE_ROWS * OUTPUTS, np.float32)


@njit(cache=True, nogil=True, fastmath=False)
def _panels(w, x, b, out, accumulate, start, end, buffers, columns=False):
    """out[:, v] (+)= X @ W[v].T (+ b[v]) for v in start..end-1: OUTPUTS of W's rows at a time packed, then every
    tile of X's rows against them; whole tiles straight into out, the others through the sums. Arguments as
    _panel_product; buffers: _panel_buffers(K), the thread's; with ``columns`` w is W.T (K, N) (_pack_columns),
    and x's K may be w's rounded up to even (its last input then 0)."""
    panels, sums = buffers
    T = x.shape[0]
    for n0 in range(start, end, OUTPUTS):
        if columns:
            _pack_columns(w, n0, panels)
        else:
            _pack(w, n0, panels)
        for t0 in range(0, T, TILE_ROWS):
            if t0 + TILE_ROWS <= T and n0 + OUTPUTS <= end:
                _panel_out(panels, x, t0, out, n0, b, accumulate)
                continue
            _panel_sums(panels, x, t0, T, sums)
            for r in range(min(TILE_ROWS, T - t0)):
                for n in range(min(OUTPUTS, end - n0)):
                    _put(out, t0 + r, n0 + n, sums[r * OUTPUTS + n], b, accumulate)


numbacache.guard(__name__)  # this module's cached kernels load and save under a lock (numbacache.py)

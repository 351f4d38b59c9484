"""Integer matrix products over many rows: out (+)= x @ W.T (+ b), W int8 or int4 as stored.

The inputs are quantised per group of GROUP as for every integer product
(intkernels._quantize_rows) and laid out once for the CPU's multiply-add (_lay_out_rows).
W is read as stored: each thread takes a panel of PANEL of W's rows (outputs) at a
time and, one block of K_BLOCK inputs after another, repacks that block into a small
buffer, in the order the tile reads it (_pack_panel), then runs the tile over every
block of TILE_ROWS input rows (_tile). The tile keeps TILE_ROWS x PANEL int32 sums in
registers: per step of inputs it broadcasts each row's inputs of the step and
multiplies them with PANEL outputs' weights in one multiply-add, so that no horizontal
sum is ever needed. A step is one of two kinds, as dispatch.py chose for the CPU:

- pairs (QUADS false): inputs widened to int16, two a step, x86's pmaddwd at the widest
  width the CPU has;
- quads (QUADS, on CPUs with VNNI: AVX-512 VNNI or AVX-VNNI): four inputs a step as bytes
  in one vpdpbusd, which multiplies unsigned bytes by signed ones and adds the four
  products into each int32 sum. The inputs are stored as x + 128 (unsigned), so the
  sum is off by 128 x (the sum of the group's weights), which the panel carries per
  group and output and the tile subtracts.

After each group the sums, exact in int32 (at most 32 x 255 x 128), become float32 and
are scaled: acc += float(sum) * (x's scale * W's scale), group after group in order, so
the result of an output depends neither on the tiling, nor on the threads, nor on the
kind of step. The kind follows the inputs' type (int16 pairs, uint8 quads), so either
runs on any CPU: where the CPU lacks VNNI, a quad's multiply-add is written out in
generic vector code (slow; for the tests).

Private and unchecked, as the other kernels: callers in forward.py validate.
"""

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from . import numbacache
from .chunks import _claimed, _span
from .dispatch import GROUP as _GROUP, MADD_WIDTH, ROW_CHUNKS, TILE_VNNI
from .intkernels import _PMADDWD, _quantize_rows, _llvm
from .kernels import _put

_HALF_GROUP = _GROUP // 2
_LANES = (MADD_WIDTH or 16) // 2  # int32 sums in one multiply-add: outputs per vector
_VECTORS = 2  # vectors of outputs per tile
PANEL = _LANES * _VECTORS  # W's rows per panel: outputs of one tile
TILE_ROWS = 4  # input rows per tile
K_BLOCK = 256  # inputs per repacked block of a panel (PANEL x K_BLOCK int16: in L1)
CHUNK_PANELS = 4  # panels per chunk of work: each block of rows is read once for all of them
CHUNK = CHUNK_PANELS * PANEL  # outputs per chunk
_BLOCK_WEIGHTS = K_BLOCK * PANEL  # weights of one panel's repacked block
_OFFSET = 128  # added to a quad's inputs, which vpdpbusd takes unsigned


_DPBUSD = f"llvm.x86.avx512.vpdpbusd.{TILE_VNNI}" if TILE_VNNI else None  # LLVM's name of VNNI's vpdpbusd
QUADS = _DPBUSD is not None  # the steps forward.py lays the inputs out for
WIDE = np.uint8 if QUADS else np.int16  # the dtype of _lay_out_rows's xw, which chooses the step


def _madd(builder, a, b):
    """<n/2 x i32>: a[2i] * b[2i] + a[2i+1] * b[2i+1] for <n x i16> vectors a, b (pmaddwd on x86)."""
    i32 = ir.IntType(32)
    n = a.type.count
    if MADD_WIDTH == n:
        return _llvm(builder, _PMADDWD[n], ir.VectorType(i32, n // 2), a, b)
    half = ir.VectorType(i32, n // 2)

    def lanes(v, first):
        return builder.sext(builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, n // 2),
                                                                     list(range(first, n, 2)))), half)
    return builder.add(builder.mul(lanes(a, 0), lanes(b, 0)), builder.mul(lanes(a, 1), lanes(b, 1)))


def _dpbusd(builder, acc, a, b):
    """<n x i32>: acc + the sums of four adjacent products of a's bytes, unsigned, by b's, signed
    (a, b: <n x i32>, four bytes a lane): VNNI's vpdpbusd, or the same written out."""
    if _DPBUSD:
        return _llvm(builder, _DPBUSD, acc.type, acc, a, b)
    i8, i32 = ir.IntType(8), ir.IntType(32)
    n = acc.type.count
    wide = ir.VectorType(i32, 4 * n)
    prod = builder.mul(builder.zext(builder.bitcast(a, ir.VectorType(i8, 4 * n)), wide),
                       builder.sext(builder.bitcast(b, ir.VectorType(i8, 4 * n)), wide))
    for k in range(4):
        part = builder.shuffle_vector(prod, prod, ir.Constant(ir.VectorType(i32, n), list(range(k, 4 * n, 4))))
        acc = builder.add(acc, part)
    return acc


def _hold_in_registers(builder, values):
    """values, all held in vector registers at one point of the program that no memory access
    crosses (an empty inline assembly on x86).

    Without it LLVM orders the tile's work row after row (integer sums may be done in any
    order), which keeps every loaded weight alive at once and spills them to the stack. Held
    after each pair of inputs, the tile does one pair after another, with only its sums, a
    pair's weights and one broadcast live.
    """
    if not MADD_WIDTH:
        return values
    n = len(values)
    ty = values[0].type
    held = builder.asm(ir.FunctionType(ir.LiteralStructType([ty] * n), [ty] * n), "",
                       ",".join(["=x"] * n + [str(i) for i in range(n)] + ["~{memory}"]), values, side_effect=True)
    return [builder.extract_value(held, i) for i in range(n)]


def _step(xw):
    """Inputs per step of the tile for inputs laid out as ``xw`` (a Numba array type): 4 for uint8 (quads), 2 for
    int16 (pairs). The compiled kernels ask _layout."""
    return 4 if xw.dtype == types.uint8 else 2


@intrinsic
def _tile(typingctx, xw, xs, panel, pscale, pcorr, acc, t0, g0, g1):
    """acc[t0:t0+TILE_ROWS] += the products of groups g0..g1-1 of TILE_ROWS input rows with a panel.

    xw: the quantised inputs as _lay_out_rows lays them out, int16 (pairs) or uint8 (quads: x + 128)
    (rows, K); xs: float32 (rows, K // GROUP), their scales; panel: int16 or int8 flat (as xw),
    the panel's groups g0..g1-1 as _pack_panel writes them; pscale: float32 (K // GROUP, PANEL),
    the panel's scales; pcorr: int32 (K // GROUP, PANEL), for quads the offset's share of each sum
    (unread for pairs); acc: float32 (rows, PANEL).
    For each group: per step s, every row's inputs of the step broadcast and multiplied-added
    with the panel's weights of the step for PANEL outputs, into int32 sums (minus pcorr for
    quads); then acc += float(sum) * (xs * pscale). Unchecked: g0 < g1, rows t0..t0+TILE_ROWS-1 exist.
    """
    def is_c(a, dtype, ndim):
        return isinstance(a, types.Array) and a.dtype == dtype and a.ndim == ndim and a.layout == "C"

    if not (isinstance(xw, types.Array) and xw.dtype in (types.int16, types.uint8)):
        return None
    S = _step(xw)
    quads = S == 4
    if not (is_c(xw, xw.dtype, 2) and is_c(xs, types.float32, 2)
            and is_c(panel, types.int8 if quads else types.int16, 1) and is_c(pscale, types.float32, 2)
            and is_c(pcorr, types.int32, 2) and is_c(acc, types.float32, 2)):
        return None

    def codegen(context, builder, sig, args):
        xa, xsa, pa, psa, pca, aa = (context.make_array(ty)(context, builder, v)
                                     for ty, v in zip(sig.args[:6], args[:6]))
        t0v, g0v, g1v = args[6:]
        i16, i32, i64, f32 = ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
        L, V, R = _LANES, _VECTORS, TILE_ROWS
        vf, vi = ir.VectorType(f32, L), ir.VectorType(i32, L)
        vw = vi if quads else ir.VectorType(i16, 2 * L)  # one vector of a step's weights
        align = 1 if quads else 2  # of the int8 / int16 arrays

        def const(n):
            return ir.Constant(i64, n)

        def at(ptr, index, ty):  # ty* at ptr[index]
            return builder.bitcast(builder.gep(ptr, [index]), ty.as_pointer())

        def splat(value, ty):
            one = builder.insert_element(ir.Constant(ty, None), value, ir.Constant(i32, 0))
            return builder.shuffle_vector(one, ir.Constant(ty, None), ir.Constant(ir.VectorType(i32, L), [0] * L))

        K = builder.extract_value(xa.shape, 1)
        G = builder.extract_value(xsa.shape, 1)
        rows = [builder.add(t0v, const(r)) for r in range(R)]
        x_row = [builder.mul(t, K) for t in rows]
        acc_at = [[at(aa.data, builder.add(builder.mul(t, const(PANEL)), const(v * L)), vf) for v in range(V)]
                  for t in rows]
        entry = builder.block
        loop = builder.append_basic_block("tile_group")
        done = builder.append_basic_block("tile_done")
        start = [[builder.load(p, align=4) for p in row] for row in acc_at]
        builder.branch(loop)
        builder.position_at_end(loop)
        g = builder.phi(i64)
        g.add_incoming(g0v, entry)
        facc = [[builder.phi(vf) for _ in range(V)] for _ in range(R)]
        for r in range(R):
            for v in range(V):
                facc[r][v].add_incoming(start[r][v], entry)
        base = builder.mul(builder.sub(g, g0v), const(_GROUP * PANEL))  # the group's place in the panel
        k0 = builder.mul(g, const(_GROUP))
        sums = [[ir.Constant(vi, [0] * L) for _ in range(V)] for _ in range(R)]
        for p in range(_GROUP // S):
            w = [builder.load(at(pa.data, builder.add(base, const((p * V + v) * S * L)), vw), align=align)
                 for v in range(V)]
            for r in range(R):
                step = builder.load(at(xa.data, builder.add(x_row[r], builder.add(k0, const(S * p))), i32),
                                    align=align)
                x = builder.bitcast(splat(step, vi), vw)
                for v in range(V):
                    if quads:
                        sums[r][v] = _dpbusd(builder, sums[r][v], x, w[v])
                    else:
                        prod = _madd(builder, x, w[v])
                        sums[r][v] = prod if p == 0 else builder.add(sums[r][v], prod)
            flat = _hold_in_registers(builder, [s for row in sums for s in row])
            sums = [flat[r * V:(r + 1) * V] for r in range(R)]
        if quads:
            corr = [builder.load(at(pca.data, builder.add(builder.mul(g, const(PANEL)), const(v * L)), vi), align=4)
                    for v in range(V)]
            sums = [[builder.sub(sums[r][v], corr[v]) for v in range(V)] for r in range(R)]
        nxt = []
        for r in range(R):
            xscale = splat(builder.load(builder.gep(xsa.data, [builder.add(builder.mul(rows[r], G), g)])), vf)
            row_next = []
            for v in range(V):
                wscale = builder.load(at(psa.data, builder.add(builder.mul(g, const(PANEL)), const(v * L)), vf), align=4)
                scale = builder.fmul(xscale, wscale)
                step = builder.fadd(facc[r][v], builder.fmul(builder.sitofp(sums[r][v], vf), scale, flags=("contract",)),
                                    flags=("contract",))
                facc[r][v].add_incoming(step, loop)
                row_next.append(step)
            nxt.append(row_next)
        g_next = builder.add(g, const(1))
        g.add_incoming(g_next, loop)
        builder.cbranch(builder.icmp_signed("<", g_next, g1v), loop, done)
        builder.position_at_end(done)
        for r in range(R):
            for v in range(V):
                builder.store(nxt[r][v], acc_at[r][v], align=4)
        return context.get_dummy_value()

    return types.void(xw, xs, panel, pscale, pcorr, acc, types.int64, types.int64, types.int64), codegen


def _transpose(builder, vectors):
    """The n vectors of n lanes that are the columns of these n (a power of two): column k first.

    log2(n) rounds of pairing vector i with vector i + n/2 and interleaving their halves."""
    n = len(vectors)
    i32 = ir.IntType(32)
    for _ in range(n.bit_length() - 1):
        low = ir.Constant(ir.VectorType(i32, n), [k for j in range(n // 2) for k in (j, n + j)])
        high = ir.Constant(ir.VectorType(i32, n), [k for j in range(n // 2, n) for k in (j, n + j)])
        pairs = [(vectors[i], vectors[i + n // 2]) for i in range(n // 2)]
        vectors = [builder.shuffle_vector(a, b, mask) for a, b in pairs for mask in (low, high)]
    return vectors


@intrinsic
def _pack_group(typingctx, w, n0, g, panel, at):
    """panel[at : at + GROUP * PANEL] = group g of W's rows n0..n0+PANEL-1, as _tile reads it.

    w: int8 (N, K) or packed int4 uint8 (N, K // 2), C-contiguous, with n0 + PANEL <= N;
    panel: int16 (pairs) or int8 (quads) flat. Each row's group is loaded whole (an int4
    row unpacked first: low nibbles, then high ones, minus 8), widened to int16 for pairs,
    its steps of inputs taken as int32, and each block of rows transposed: for step s, the
    block's steps side by side. The same layout as _pack_panel's, vectorised.
    """
    if not (isinstance(w, types.Array) and w.dtype in (types.int8, types.uint8) and w.ndim == 2
            and w.layout == "C" and isinstance(panel, types.Array) and panel.dtype in (types.int16, types.int8)
            and panel.layout == "C"):
        return None
    packed = w.dtype == types.uint8
    S = 4 if panel.dtype == types.int8 else 2
    steps = _GROUP // S  # int32 steps of a row's group
    square = min(_LANES, steps)  # rows and steps of one transposed block

    def codegen(context, builder, sig, args):
        wa = context.make_array(sig.args[0])(context, builder, args[0])
        pa = context.make_array(sig.args[3])(context, builder, args[3])
        n0v, gv, atv = args[1], args[2], args[4]
        i8, i16, i32, i64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
        L, V = _LANES, _VECTORS
        width = builder.extract_value(wa.shape, 1)
        stored = _HALF_GROUP if packed else _GROUP  # bytes of one group in a row
        rows = []
        for j in range(PANEL):
            start = builder.add(builder.mul(builder.add(n0v, ir.Constant(i64, j)), width),
                                builder.mul(gv, ir.Constant(i64, stored)))
            ptr = builder.bitcast(builder.gep(wa.data, [start]), ir.VectorType(i8, stored).as_pointer())
            raw = builder.load(ptr, align=1)
            if packed:
                low = builder.and_(raw, ir.Constant(raw.type, [15] * stored))
                high = builder.lshr(raw, ir.Constant(raw.type, [4] * stored))
                both = builder.shuffle_vector(low, high, ir.Constant(ir.VectorType(i32, _GROUP), list(range(_GROUP))))
                raw = builder.sub(both, ir.Constant(both.type, [8] * _GROUP))
            if S == 2:
                raw = builder.sext(raw, ir.VectorType(i16, _GROUP))
            rows.append(builder.bitcast(raw, ir.VectorType(i32, steps)))  # the group's steps
        for j0 in range(0, PANEL, square):  # rows j0..j0+square-1: lanes of vector j0 // L
            v, lane = divmod(j0, L)
            for s0 in range(0, steps, square):  # their steps s0..s0+square-1
                part = [builder.shuffle_vector(r, r, ir.Constant(ir.VectorType(i32, square), list(range(s0, s0 + square))))
                        for r in rows[j0:j0 + square]]
                for k, column in enumerate(_transpose(builder, part)):
                    index = builder.add(atv, ir.Constant(i64, (((s0 + k) * V + v) * L + lane) * S))
                    ptr = builder.bitcast(builder.gep(pa.data, [index]), column.type.as_pointer())
                    builder.store(column, ptr, align=1)
        return context.get_dummy_value()

    return types.void(w, types.int64, types.int64, panel, types.int64), codegen


def _weight(row, k):
    """The int16 value of input k of an integer matrix's row (int8, or packed int4)."""


@overload(_weight, inline="always")
def _weight_typed(row, k):
    if row.dtype == types.uint8:
        def nibble(row, k):
            g, j = k // _GROUP, k % _GROUP
            byte = np.int16(row[g * _HALF_GROUP + j % _HALF_GROUP])
            return ((byte >> 4) if j >= _HALF_GROUP else (byte & 15)) - np.int16(8)
        return nibble

    def value(row, k):
        return np.int16(row[k])
    return value


def _layout(a):
    """(inputs per step, offset of the inputs) of the tiles' layout that ``a`` holds: (4, 128) for quads
    (uint8 inputs, int8 panels), (2, 0) for pairs (int16 inputs and panels)."""


@overload(_layout, inline="always")
def _layout_typed(a):
    quads = a.dtype in (types.uint8, types.int8)
    return lambda a: (4, _OFFSET) if quads else (2, 0)


def _new_panel(xw, n):
    """A flat panel buffer of n weights for inputs laid out as xw: int8 for quads, int16 for pairs."""


@overload(_new_panel, inline="always")
def _new_panel_typed(xw, n):
    if xw.dtype == types.uint8:
        return lambda xw, n: np.empty(n, np.int8)
    return lambda xw, n: np.empty(n, np.int16)


@njit(cache=True, nogil=True, fastmath=False)
def _group_sum(row, g):
    """The sum of group g's weights in an integer matrix's row."""
    total = 0
    for k in range(g * _GROUP, (g + 1) * _GROUP):
        total += _weight(row, k)
    return total


@njit(cache=True, nogil=True, fastmath=False)
def _pack_panel(w, scale, n0, g0, g1, panel, pscale, pcorr):
    """panel = W's rows n0..n0+PANEL-1, groups g0..g1-1, as _tile reads them: for each group, for each
    step s of S inputs (S = 2 for an int16 panel, 4 for int8), PANEL outputs' S weights
    w[n, S*s : S*(s+1)]; rows past W's end are zeros. For the groups g0..g1-1: pscale[g, j] =
    scale[n0 + j, g] and, for quads, pcorr[g, j] = 128 x the sum of the group's weights (0 past the end).

    w: int8 (N, K) or packed int4 uint8 (N, K // 2); scale: float32 (N, K // GROUP);
    panel: int16 or int8 (>= (g1 - g0) * GROUP * PANEL,); pscale: float32 and pcorr: int32 (K // GROUP, PANEL).
    """
    N = w.shape[0]
    S, offset = _layout(panel)
    for g in range(g0, g1):
        for j in range(min(PANEL, N - n0)):
            pscale[g, j] = scale[n0 + j, g]
            if offset:
                pcorr[g, j] = offset * _group_sum(w[n0 + j], g)
        pscale[g, N - n0:] = 0.0
        pcorr[g, N - n0:] = 0
    if n0 + PANEL <= N:
        for g in range(g0, g1):
            _pack_group(w, n0, g, panel, (g - g0) * _GROUP * PANEL)
        return
    for j in range(PANEL):
        n = n0 + j
        for g in range(g0, g1):
            base = (g - g0) * _GROUP * PANEL + S * j
            if n < N:
                row = w[n]
                for k in range(_GROUP):
                    panel[base + (k // S) * S * PANEL + k % S] = _weight(row, g * _GROUP + k)
            else:
                for k in range(_GROUP):
                    panel[base + (k // S) * S * PANEL + k % S] = 0


@njit(cache=True, nogil=True, parallel=True, fastmath=False)
def _lay_out_rows(x, xq, xs, xw):
    """xw = the int8 values of x quantised per group (_quantize_rows), laid out for the tiles; xs their scales.

    x: float32 (T, K); xq: int8 (>= T, K), scratch; xs: float32 (>= T, K // GROUP);
    xw: int16 (>= T, K) for pairs, the values; or uint8 for quads, the values + 128. Rows of xw
    past T are set to the layout's 0, and of xs to 0 (tiles read whole blocks of rows).
    """
    T, K = x.shape
    offset = _layout(xw)[1]
    nxt = np.zeros(1, np.int64)  # the next chunk of rows (chunks.py)
    for _ in prange(ROW_CHUNKS):
        for c in _claimed(nxt, ROW_CHUNKS):
            start, end = _span(c, ROW_CHUNKS, T, 1)
            _quantize_rows(x[start:end], xq[start:end], xs[start:end])
            for t in range(start, end):
                for k in range(K):
                    xw[t, k] = xq[t, k] + offset
    xw[T:] = offset
    xs[T:] = 0.0


def _chunk_buffers(xw, G):
    """One thread's buffers for _chunk over inputs laid out as xw, with G groups: the chunk's
    panels (as _new_panel), their scales and corrections, and its float32 sums."""


@overload(_chunk_buffers, inline="always")
def _chunk_buffers_typed(xw, G):
    def buffers(xw, G):
        return (_new_panel(xw, CHUNK_PANELS * _BLOCK_WEIGHTS), np.empty((CHUNK_PANELS, G, PANEL), np.float32),
                np.empty((CHUNK_PANELS, G, PANEL), np.int32), np.empty((CHUNK_PANELS, xw.shape[0], PANEL), np.float32))
    return buffers


@njit(cache=True, nogil=True, fastmath=False)
def _chunk(xw, xs, T, w, scale, b, out, accumulate, n0, buffers):
    """out[:T, n0 : n0 + CHUNK] (+)= x @ W[n0 : n0 + CHUNK].T (+ b), CHUNK = CHUNK_PANELS x PANEL
    outputs (fewer at W's end), with one thread's buffers (_chunk_buffers).

    For each block of K_BLOCK inputs it repacks the chunk's panels, then runs every block of
    TILE_ROWS rows against each panel while the rows are in L1. Arguments as _int_tiles.
    """
    panels, pscale, pcorr, acc = buffers
    rows, K = xw.shape
    N, G = scale.shape[0], K // _GROUP
    block, size = K_BLOCK // _GROUP, _BLOCK_WEIGHTS  # groups and weights of a panel's repacked block
    count = min(CHUNK_PANELS, (N - n0 + PANEL - 1) // PANEL)  # panels in this chunk
    acc[:] = 0.0
    for g0 in range(0, G, block):
        g1 = min(G, g0 + block)
        for i in range(count):
            _pack_panel(w, scale, n0 + i * PANEL, g0, g1, panels[i * size:(i + 1) * size], pscale[i], pcorr[i])
        for t0 in range(0, rows, TILE_ROWS):
            for i in range(count):
                _tile(xw, xs, panels[i * size:(i + 1) * size], pscale[i], pcorr[i], acc[i], t0, g0, g1)
    for t in range(T):  # row by row: a panel's outputs are one cache line of out's row
        for i in range(count):
            for j in range(min(PANEL, N - n0 - i * PANEL)):
                _put(out, t, n0 + i * PANEL + j, acc[i, t, j], b, accumulate)


@njit(cache=True, nogil=True, parallel=True, fastmath=False)
def _int_tiles(xw, xs, T, w, scale, b, out, accumulate, n_workers):
    """out (+)= x @ W.T (+ b) for many rows, W an integer matrix read as stored.

    xw: int16 or uint8 (rows, K), the T input rows quantised and laid out for pairs or quads
    (_lay_out_rows), rows a multiple of TILE_ROWS; xs: float32 (rows, K // GROUP), 0 past T;
    w: int8 (N, K) or packed int4 uint8 (N, K // 2); scale: (N, K // GROUP); b: (N,) or None;
    out: (T, N). A chunk is CHUNK outputs (_chunk); n_workers iterations, each with buffers
    of its own, claim them. An output's result does not depend on its chunk, nor on the
    thread that computes it, nor on the layout.
    """
    n_chunks = (scale.shape[0] + CHUNK - 1) // CHUNK
    nxt = np.zeros(1, np.int64)  # the next chunk (chunks.py)
    for _ in prange(n_workers):
        buffers = _chunk_buffers(xw, scale.shape[1])
        for c in _claimed(nxt, n_chunks):
            _chunk(xw, xs, T, w, scale, b, out, accumulate, c * CHUNK, buffers)


@njit(cache=True, nogil=True, fastmath=False)
def _tiles_matmul(x, xq, xs, xw, w, scale, b, out, accumulate, n_workers):
    """out (+)= x @ W.T (+ b): x quantised and laid out into xq, xs, xw (_lay_out_rows), then
    _int_tiles; one call from Python. x: float32 (T, K); xq: int8, xs: float32 and xw: WIDE
    (or either layout's type) with padded_rows(T) rows; the rest as _int_tiles."""
    _lay_out_rows(x, xq, xs, xw)
    _int_tiles(xw, xs, x.shape[0], w, scale, b, out, accumulate, n_workers)


def laid_out(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(xw, xs): float32 rows x (T, K) quantised and laid out for the tiles (_lay_out_rows), in new arrays."""
    n, K = padded_rows(len(x)), x.shape[1]
    xw, xs = np.empty((n, K), WIDE), np.empty((n, K // _GROUP), np.float32)
    _lay_out_rows(x, np.empty((n, K), np.int8), xs, xw)
    return xw, xs


def padded_rows(T: int) -> int:
    """Rows of the widened inputs for T rows: whole tiles."""
    return (T + TILE_ROWS - 1) // TILE_ROWS * TILE_ROWS


numbacache.guard(__name__)  # this module's cached kernels load and save under a lock (numbacache.py)

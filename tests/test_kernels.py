"""Each Numba kernel against a slow, plain NumPy reference on random shapes."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from numba import njit, prange, typed
from threadpoolctl import threadpool_limits

from gpt2numba.cpu import attention, chunks, dispatch, kernels, matkernels
from gpt2numba.model import compact, oracle
from helpers import randn

dims = st.integers(1, 40)


@given(n=dims, C=dims, seed=st.integers(0, 2**32 - 1))
def test_layernorm(n, C, seed):
    rng = np.random.default_rng(seed)
    x, g, b = randn(rng, n, C, scale=3.0), randn(rng, C), randn(rng, C)
    out = np.empty_like(x)
    kernels._layernorm(x, g, b, 1e-5, out)
    ref = oracle.layer_norm(x.astype(np.float64), g, b, 1e-5)
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-4)


@given(n=dims, F=dims, seed=st.integers(0, 2**32 - 1))
def test_gelu(n, F, seed):
    rng = np.random.default_rng(seed)
    x = randn(rng, n, F, scale=4.0)
    ref = oracle.gelu(x.astype(np.float64))
    kernels._gelu(x)
    np.testing.assert_allclose(x, ref, atol=1e-6, rtol=1e-5)


def _dispatchers():
    """{name: dispatcher} of every @njit function the package defines."""
    import importlib
    import pkgutil

    import gpt2numba
    from numba.core.registry import CPUDispatcher

    found = {}
    for info in pkgutil.walk_packages(gpt2numba.__path__, "gpt2numba."):
        if not info.name.endswith("__main__"):
            module = importlib.import_module(info.name)
            found.update({f"{module.__name__}.{name}": f for name, f in vars(module).items()
                          if isinstance(f, CPUDispatcher) and f.py_func.__module__ == module.__name__})
    return found


def test_every_kernel_sets_its_fast_math():
    """Numba compiles a function that leaves fastmath unset, when a kernel first calls it, with that caller's
    fast-math flags, and its cache then serves that code to every process: the function's bits would follow
    which kernel compiled first (the cold-cache test in test_threads.py found it). Every @njit function in the
    package sets its own."""
    found = _dispatchers()
    assert len(found) > 50 and not [name for name, f in found.items() if "fastmath" not in f.targetoptions]


# The fast-math kernels that Python calls (none is called by another kernel)
FAST_ROOTS = {"_attend", "_layernorm", "_gelu", "_head_log_softmax", "_log_softmax", "_rows", "stream_sum"}


def test_fast_math_callees_are_inlined():
    """Numba 0.59 runs a kernel's callee as compiled alone in the process that compiled the kernel, and as
    optimized again inside the kernel in the processes that load it from the cache; fast-math lets the optimizer
    reorder the callee's sums there, and the two gave other bits (test_threads.py's cold-cache test). So every
    function with fast-math flags but the kernels Python calls is inlined into its callers (inline="always":
    one piece of code, the caller's, compiled and cached as one)."""
    fast = {name: f for name, f in _dispatchers().items() if f.targetoptions["fastmath"]}
    assert {name.rsplit(".", 1)[1] for name in fast} >= FAST_ROOTS
    assert not [name for name, f in fast.items()
                if name.rsplit(".", 1)[1] not in FAST_ROOTS and f.targetoptions.get("inline") != "always"]


@given(n=st.integers(0, 300), wide=st.booleans(), square=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_sum_adds_in_the_order_it_says(n, wide, square, seed):
    """kernels._sum's order, to the bit, as its docstring gives it (eight running sums, added pairwise, then the
    rest), in float32 or float64, of x - shift or its squares: an order no compiler may choose (test_threads'
    cold-cache test is why)."""
    x = randn(np.random.default_rng(seed), n, scale=10.0)
    kind = np.float64 if wide else np.float32
    shift = kind(0.25)

    def term(v):
        d = kind(kind(v) - shift)
        return kind(d * d) if square else d
    whole = n - n % 8
    s = [kind(0.0)] * 8
    for i in range(0, whole, 8):
        s = [kind(s[j] + term(x[i + j])) for j in range(8)]
    total = kind(kind(kind(s[0] + s[4]) + kind(s[2] + s[6])) + kind(kind(s[1] + s[5]) + kind(s[3] + s[7])))
    for i in range(whole, n):
        total = kind(total + term(x[i]))
    got = kind(kernels._sum(x, kind(0.0), shift, square))  # (returned as a Python float, exactly)
    assert got.tobytes() == total.tobytes()
    exact = ((x.astype(np.float64) - 0.25) ** (2 if square else 1)).sum()
    np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-4 * (1 + n))


@given(values=st.lists(st.floats(width=32, allow_nan=False), min_size=1, max_size=300))
def test_row_max(values):
    """The integer-keyed max is np.max: negatives, zeros of either sign, infinities, subnormals."""
    x = np.array(values, np.float32)
    assert kernels._row_max(x) == x.max()


# A ragged batch: B sequences of one model (n_layer, H, D), each with its own cache
# (max_len), the positions it already holds (start) and its new rows (T).
models = st.tuples(st.integers(1, 3), st.integers(1, 4), st.sampled_from([1, 8, 64]))
sequence = st.sampled_from([1, 2, 24, 71, 150]).flatmap(  # (71: an odd n_positions, n + 1 keys' room in pairs)
    lambda max_len: st.integers(0, max_len - 1).flatmap(
        lambda start: st.tuples(st.just(max_len), st.just(start), st.integers(1, max_len - start))))
batches = st.tuples(models, st.lists(sequence, min_size=1, max_size=4))
kv_dtypes = st.sampled_from(["float32", "float16", "bfloat16"])


def _stored(a, kv_dtype):
    """float32 values as a cache of kv_dtype keeps them: themselves, or float16 / bfloat16 bits (uint16)."""
    if kv_dtype == "float16":
        return a.astype(np.float16).view(np.uint16)
    return compact.to_bfloat16(a) if kv_dtype == "bfloat16" else a


def _widened(stored, kv_dtype):
    """A cache's stored array as float32 values."""
    if kv_dtype == "float16":
        return stored.view(np.float16).astype(np.float32)
    return compact.from_bfloat16(stored) if kv_dtype == "bfloat16" else stored


def _batch_case(rng, model, seqs, kv_dtype="float32", cuts=None):
    """qkv (N, 3C) stacked rows; ks, vs, runs, run0: each sequence's history in runs of random stores (stored
    as kv_dtype): positions [0, cuts[b][0]), [cuts[b][0], cuts[b][1]), ... each at a random row of a store of
    its own (a shared history), the rest in the sequence's own cache; row0, pos0."""
    n_layer, H, D = model
    ks, vs, runs, run0 = typed.List(), typed.List(), [], [0]

    def store(rows):
        ks.append(_stored(randn(rng, n_layer, H, rows, D), kv_dtype))
        vs.append(_stored(randn(rng, n_layer, H, rows, D), kv_dtype))
        return len(ks) - 1

    for b, (max_len, start, _) in enumerate(seqs):
        first = 0
        for end in (cuts[b] if cuts else []):
            row = int(rng.integers(0, 3))
            runs.append((store(row + end - first + int(rng.integers(0, 3))), first, end, row))
            first = end
        runs.append((store(max_len), first, max_len, first))
        run0.append(len(runs))
    row0 = np.cumsum([0] + [T for _, _, T in seqs]).astype(np.int64)
    pos0 = np.array([start for _, start, _ in seqs], np.int64)
    return (randn(rng, row0[-1], 3 * H * D), ks, vs, np.array(runs, np.int64), np.array(run0, np.int64),
            row0, pos0)


def _history(stores, runs, run0, b, n):
    """Sequence b's positions 0..n-1, gathered from its runs: (n_layer, H, n, D) as stored."""
    parts = []
    for s, first, end, row in runs[run0[b]:run0[b + 1]]:
        end = min(end, n)
        if first < end:
            parts.append(stores[s][:, :, row:row + end - first])
    return np.concatenate(parts, axis=2)


def _cuts(seqs):
    """Each sequence's history cut into runs below its start (none to three cuts)."""
    return st.tuples(*[st.lists(st.integers(1, max(start, 1)), max_size=3, unique=True)
                       .map(lambda c, start=start: sorted(x for x in c if x <= start)) for _, start, _ in seqs])


@given(batch=batches, kv_dtype=kv_dtypes, rounds=st.booleans(), seed=st.integers(0, 2**32 - 1), data=st.data())
def test_write_kv(batch, kv_dtype, rounds, seed, data):
    """Each sequence's rows land in its own cache at its own positions, one layer, nothing else (no other
    run's store); a compact cache holds them rounded to nearest even (as NumPy's float16 and compact's
    bfloat16); with ``rounds`` (bfloat16 activations) rounded to bfloat16 first, whatever the cache."""
    model, seqs = batch
    (n_layer, H, D), C = model, model[1] * model[2]
    layer = data.draw(st.integers(0, n_layer - 1))
    qkv, ks, vs, runs, run0, row0, pos0 = _batch_case(np.random.default_rng(seed), model, seqs, kv_dtype,
                                                      data.draw(_cuts(seqs)))
    k_ref, v_ref = [k.copy() for k in ks], [v.copy() for v in vs]
    kept = compact.from_bfloat16(compact.to_bfloat16(qkv)).reshape(qkv.shape) if rounds else qkv
    for b, (_, start, T) in enumerate(seqs):
        rows, own = kept[row0[b]:row0[b + 1]], runs[run0[b + 1] - 1, 0]
        # (T, C) -> (H, T, D)
        k_ref[own][layer, :, start:start + T] = _stored(rows[:, C:2 * C].reshape(T, H, D).transpose(1, 0, 2), kv_dtype)
        v_ref[own][layer, :, start:start + T] = _stored(rows[:, 2 * C:].reshape(T, H, D).transpose(1, 0, 2), kv_dtype)
    written = np.full((len(seqs), n_layer), -1, np.int64)
    kernels._write_kv(qkv, ks, vs, runs, run0, row0, pos0, layer, written, kv_dtype == "float16", rounds)
    for s in range(len(ks)):
        np.testing.assert_array_equal(ks[s], k_ref[s])
        np.testing.assert_array_equal(vs[s], v_ref[s])
    assert (written[:, layer] == pos0 + np.diff(row0)).all() and (np.delete(written, layer, axis=1) == -1).all()


def _attend(qkv, ks, vs, runs, run0, layer, row0, pos0, n_chunks, kv_dtype, max_len, rounds=False, paired=False):
    """attention._attend's output; with ``rounds`` bfloat16 inputs, on vdpbf16ps if ``paired``."""
    D = ks[0].shape[3]
    out = np.empty((row0[-1], qkv.shape[1] // 3), np.float32)
    scratch = np.empty((n_chunks, attention.attend_width(D, max_len)), np.float32)
    pairs = np.empty((n_chunks, attention.pairs_width(D, max_len)), np.uint16) if paired else None
    tiles, bounds = attention._attention_plan(row0, pos0, ks[0].shape[1], n_chunks)
    with threadpool_limits(1, user_api="blas"):
        attention._attend(qkv, ks, vs, runs, run0, layer, row0, pos0, tiles, bounds, out, scratch,
                          kv_dtype == "float16", rounds, pairs)
    return out


@given(batch=batches, n_chunks=st.integers(1, 3), kv_dtype=kv_dtypes, seed=st.integers(0, 2**32 - 1),
       data=st.data())
def test_attend(batch, n_chunks, kv_dtype, seed, data):
    """Sequence b's T queries at positions start..start+T-1 over its own history, positions 0..start+T-1 (a
    compact cache's values widened exactly: float16 bits read as bfloat16 would be far off); a history in
    runs of several stores gives the same bits as the same rows in one array."""
    model, seqs = batch
    n_layer, H, D = model
    layer = data.draw(st.integers(0, n_layer - 1))
    qkv, ks, vs, runs, run0, row0, pos0 = _batch_case(np.random.default_rng(seed), model, seqs, kv_dtype,
                                                      data.draw(_cuts(seqs)))
    max_len = max(m for m, _, _ in seqs)
    out = _attend(qkv, ks, vs, runs, run0, layer, row0, pos0, n_chunks, kv_dtype, max_len)

    whole = [(_history(ks, runs, run0, b, m), _history(vs, runs, run0, b, m)) for b, (m, _, _) in enumerate(seqs)]
    alone = _attend(qkv, typed.List([k for k, _ in whole]), typed.List([v for _, v in whole]),
                    np.array([(b, 0, m, 0) for b, (m, _, _) in enumerate(seqs)], np.int64),
                    np.arange(len(seqs) + 1, dtype=np.int64), layer, row0, pos0, n_chunks, kv_dtype, max_len)
    np.testing.assert_array_equal(out, alone)
    for b, (_, start, T) in enumerate(seqs):
        rows = slice(row0[b], row0[b + 1])
        for h in range(H):
            q = qkv[rows, h * D:(h + 1) * D].astype(np.float64)         # (T, D)
            kk = _widened(whole[b][0], kv_dtype)[layer, h, :start + T].astype(np.float64)  # (start+T, D)
            vv = _widened(whole[b][1], kv_dtype)[layer, h, :start + T].astype(np.float64)
            scores = q @ kk.T / np.sqrt(D)                               # (T, start+T)
            visible = np.arange(start + T)[None, :] <= (start + np.arange(T))[:, None]
            ref = oracle.softmax(np.where(visible, scores, -np.inf)) @ vv
            np.testing.assert_allclose(out[rows, h * D:(h + 1) * D], ref, atol=1e-5, rtol=1e-4)


@given(batch=batches, n_chunks=st.integers(1, 3), kv_dtype=kv_dtypes, seed=st.integers(0, 2**32 - 1),
       data=st.data())
def test_attend_with_bfloat16_inputs(batch, n_chunks, kv_dtype, seed, data):
    """With bfloat16 activations attention multiplies bfloat16 queries and softmax weights by the keys and values
    as the cache write rounded them: against float64 of those rounded values, through BLAS and (an even
    head_dim, AVX512_BF16) on vdpbf16ps, every output but a rare one within float32's error of it."""
    model, seqs = batch
    n_layer, H, D = model
    layer = data.draw(st.integers(0, n_layer - 1))
    qkv, ks, vs, runs, run0, row0, pos0 = _batch_case(np.random.default_rng(seed), model, seqs, kv_dtype,
                                                      data.draw(_cuts(seqs)))
    for a in (*ks, *vs):  # the history as _write_kv keeps it with bfloat16 activations
        a[...] = _stored(oracle.bfloat16_inputs(_widened(a, kv_dtype)).astype(np.float32), kv_dtype)
    max_len = max(m for m, _, _ in seqs)
    ref = np.empty((row0[-1], H * D))
    for b, (m, start, T) in enumerate(seqs):
        rows = slice(row0[b], row0[b + 1])
        for h in range(H):
            q = qkv[rows, h * D:(h + 1) * D]
            kk, vv = (oracle.bfloat16_inputs(_widened(_history(a, runs, run0, b, m), kv_dtype)[layer, h, :start + T])
                      for a in (ks, vs))
            visible = np.arange(start + T)[None, :] <= (start + np.arange(T))[:, None]
            scores = oracle.bfloat16_inputs(q) @ kk.T / np.sqrt(D)
            ref[rows, h * D:(h + 1) * D] = oracle.bfloat16_inputs(oracle.softmax(np.where(visible, scores, -np.inf))) @ vv
    args = (qkv, ks, vs, runs, run0, layer, row0, pos0, n_chunks, kv_dtype, max_len)
    for paired in [False] + ([True] if dispatch.BF16_DOT and D % 2 == 0 else []):
        out = _attend(*args, rounds=True, paired=paired)
        # a softmax weight on a bfloat16 rounding tie may round either way in float32 and float64: one of 5000
        # values or so, which moves its query's outputs in that head (up to D of them) by up to a bfloat16 step of
        # the weight times a value; so a rare (query, head) may be off, not a rare output
        np.testing.assert_allclose(out, ref, atol=1e-2, err_msg=f"paired={paired}")
        off = (np.abs(out - ref) > 1e-5 + 1e-4 * np.abs(ref)).reshape(len(out), H, D).any(axis=2)
        assert off.sum() <= max(1, off.size // 100), (paired, off.sum(), off.size)


@given(counts=st.lists(st.integers(1, 300), min_size=1, max_size=8), n_head=st.integers(1, 12),
       n_chunks=st.integers(1, 4), seed=st.integers(0, 2**32 - 1))
def test_attention_plan(counts, n_head, n_chunks, seed):
    """Every (sequence, head, tile of queries) once, in n_chunks runs of which none is far above the mean."""
    row0 = np.cumsum([0, *counts]).astype(np.int64)
    pos0 = np.random.default_rng(seed).integers(0, 700, len(counts))
    tiles, bounds = attention._attention_plan(row0, pos0, n_head, n_chunks)
    expected = {(b, h, i0) for b, T in enumerate(counts) for h in range(n_head)
                for i0 in range(0, T, attention.ATTEND_TILE)}
    assert sorted(map(tuple, tiles.tolist())) == sorted(expected)
    assert bounds[0] == 0 and bounds[-1] == len(tiles) and (np.diff(bounds) >= 0).all()
    m = [min(counts[b] - i0, attention.ATTEND_TILE) for b, _, i0 in tiles]  # queries per tile
    cost = [q * (pos0[b] + i0 + q + attention.ATTEND_TILE) for q, (b, _, i0) in zip(m, tiles)]  # the plan's model
    runs = [sum(cost[lo:hi]) for lo, hi in zip(bounds, bounds[1:])]
    assert max(runs) <= sum(cost) / n_chunks + max(cost)


@given(T=st.integers(1, 12), K=dims, N=dims, n_chunks=st.integers(1, 3), accumulate=st.booleans(),
       seed=st.integers(0, 2**32 - 1))
def test_linear(T, K, N, n_chunks, accumulate, seed):
    """out (+)= x @ W.T + b through BLAS, W kept [out, in], even in more chunks than rows, and with one row,
    one input or one output (BLAS's leading dimensions, which NumPy leaves free for a single row)."""
    rng = np.random.default_rng(seed)
    x, w, b, out = randn(rng, T, K), randn(rng, K, N), randn(rng, N), randn(rng, T, N)
    ref = (out.astype(np.float64) if accumulate else 0) + x.astype(np.float64) @ w + b
    scratch = np.empty(T * N, np.float32)
    with threadpool_limits(1, user_api="blas"):
        matkernels._linear(x, np.ascontiguousarray(w.T), b, scratch, out, accumulate, n_chunks)
    np.testing.assert_allclose(out, ref, atol=1e-4, rtol=1e-4)


@given(V=st.integers(1, 60), C=dims, R=st.integers(1, 70), bias=st.booleans(), accumulate=st.booleans(),
       n_chunks=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_rows_product(V, C, R, bias, accumulate, n_chunks, seed):
    """The few-rows product against a matrix [out, in] (the head's wte): tiles of one row x ROW_OUTPUTS outputs
    for one row, of rows x outputs for more (rowtiles.py), rows, outputs and inputs that end inside a
    tile or a vector; with a bias or none, added or not."""
    rng = np.random.default_rng(seed)
    wte, h, out, b = randn(rng, V, C), randn(rng, R, C), randn(rng, R, V), randn(rng, V)
    ref = (out.astype(np.float64) if accumulate else 0) + h.astype(np.float64) @ wte.T + (b if bias else 0)
    matkernels._rows_product(wte, h, b if bias else None, out, accumulate, n_chunks)
    np.testing.assert_allclose(out, ref, atol=1e-4, rtol=1e-4)


@given(V=st.integers(1, 40), C=st.integers(1, 80), R=st.integers(2, 9), bits=st.sampled_from(["", "w", "wx"]),
       n_chunks=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_a_row_alone_gives_the_bits_it_gives_among_others(V, C, R, bits, n_chunks, seed):
    """A row's products alone (a decode step) and in tiles with other rows (a batch, a prompt): the same bits,
    W float32 or bfloat16 bits, x float32 or bfloat16 bits too (bfloat16 activations: vdpbf16ps where the CPU has
    it), their sums taken in an order no optimizer may change (rowtiles._sums_typed)."""
    rng = np.random.default_rng(seed)
    w, h = randn(rng, V, C), randn(rng, R, C)
    if "w" in bits:
        w = (w.view(np.uint32) >> 16).astype(np.uint16)
    if "x" in bits:
        h = (h.view(np.uint32) >> 16).astype(np.uint16)
    together = np.empty((R, V), np.float32)
    matkernels._rows_product(w, h, None, together, False, n_chunks)
    for r in range(R):
        alone = np.empty((1, V), np.float32)
        matkernels._rows_product(w, h[r:r + 1], None, alone, False, n_chunks)
        np.testing.assert_array_equal(alone[0], together[r])


@given(V=st.integers(1, 1300), C=dims, R=st.integers(1, 5), n_chunks=st.integers(1, 3),
       seed=st.integers(0, 2**32 - 1))
def test_head(V, C, R, n_chunks, seed):
    """out = h @ wte.T for one row and for several (in chunks of HEAD_CHUNK vocabulary rows)."""
    rng = np.random.default_rng(seed)
    wte, h, out = randn(rng, V, C), randn(rng, R, C), np.empty((R, V), np.float32)
    with threadpool_limits(1, user_api="blas"):
        matkernels._head(wte, h, out, n_chunks)
    np.testing.assert_allclose(out, h.astype(np.float64) @ wte.T, atol=1e-4, rtol=1e-4)


@given(z=st.lists(st.floats(-200, 100, width=32), min_size=1, max_size=70).map(lambda v: np.array(v, np.float32)))
def test_exp(z):
    """The vectorised exp: float32-accurate from 2^-126 to 2^127, clamped beyond, never 0, nan or inf."""
    ref = np.exp(z.astype(np.float64))
    out = z.copy()
    kernels._exp_inplace(out, np.empty(z.size, np.int32))
    assert np.isfinite(out).all() and (out > 0).all()
    normal = (ref >= 2.0**-126) & (ref <= 2.0**127)
    np.testing.assert_allclose(out[normal], ref[normal], rtol=3e-7)
    assert (out[ref < 2.0**-126] <= 2.0**-125).all() and (out[ref > 2.0**127] >= 2.0**127).all()


@given(total=st.integers(0, 3000), n_chunks=st.integers(1, 70), align=st.sampled_from([1, 4, 16]))
def test_spans_cover_the_total_once(total, n_chunks, align):
    """chunks._span: chunk c's [start, end) follows chunk c - 1's, starts at a multiple of align (or at the
    total), and the spans cover range(total), in equal steps but the last ones. Catches an off-by-one at a
    chunk's end (a row done twice, or by none) and a misaligned cut."""
    spans = [chunks._span(c, n_chunks, total, align) for c in range(n_chunks)]
    assert spans[0][0] == 0 and spans[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert all(start <= end and (start % align == 0 or start == total) for start, end in spans)
    assert len({end - start for start, end in spans if end < total}) <= 1


@njit(parallel=True)
def _claims(n_chunks, iterations):
    taken = np.zeros(n_chunks, np.int64)  # how many times each chunk was claimed
    nxt = np.zeros(1, np.int64)
    for _ in prange(iterations):
        for c in chunks._claimed(nxt, n_chunks):
            taken[c] += 1
    return taken


def test_every_chunk_is_claimed_once():
    """chunks._claimed: however many iterations a region runs, each chunk is done exactly once."""
    for n_chunks, iterations in ((1, 1), (8, 8), (8, 2), (3, 8), (200, 8), (0, 4)):
        assert (_claims(n_chunks, iterations) == 1).all(), (n_chunks, iterations)

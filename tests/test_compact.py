"""bfloat16, int8 and int4 weights: formats, kernels against NumPy on the widened values, the engine against the oracle."""

import dataclasses
import json
import os
import platform
import subprocess
import sys

import numba
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from threadpoolctl import threadpool_limits

import gpt2numba as g
from checkpoints import write_dir
from conftest import TINY
from gpt2numba.cpu import dispatch, intkernels, inttiles, matkernels
from gpt2numba.cpu.dispatch import INT_ROWS_MAX
from gpt2numba.model import compact, oracle
from helpers import check_chunks, check_generate_batch, check_prefill, randn

COMPACT = ["bfloat16", "int8", "int4"]
INTEGER = list(compact.INTEGER)


# --- the formats -----------------------------------------------------------------------------

def test_bfloat16_rounds_to_nearest_even():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    a = np.random.default_rng(0).standard_normal(10_000).astype(np.float32) * 100
    a[:4] = [1 + 2**-8, 1 + 3 * 2**-8, -0.0, 3.0e38]  # ties go to even; signs and range survive
    np.testing.assert_array_equal(compact.to_bfloat16(a), a.astype(ml_dtypes.bfloat16).view(np.uint16))
    np.testing.assert_array_equal(compact.from_bfloat16(compact.to_bfloat16(a)),
                                  a.astype(ml_dtypes.bfloat16).astype(np.float32))


@pytest.mark.parametrize("dtype", INTEGER)
@pytest.mark.parametrize("field, shape", [("c_fc_w", (3, 64, 40)), ("wte", (50, 96))])
def test_integer_groups_along_the_input(field, shape, dtype):
    a = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    stored, scale = compact.compress(field, a, dtype)
    assert stored.shape == compact.stored_shape(field, shape, dtype) and scale.shape == compact.scale_shape(field, shape)
    back = compact.expand(field, stored, scale)
    assert back.shape == shape
    kept = compact.format_of(field, dtype)  # int4 keeps wte in int8
    # each value within half a step of its group's scale (groups run along the input axis), but
    # int4's +8, clipped to +7, a whole step
    step = np.abs(compact.from_rows(field, np.repeat(scale, compact.GROUP, axis=-1)))
    assert (np.abs(back - a) <= (0.5 if kept == "int8" else 1.0) * step * (1 + 1e-6)).all()
    q = compact.unpack(stored) if kept == "int4" else stored
    levels = compact.LEVELS[kept]
    assert (np.abs(q) <= levels).all() and (np.abs(q).max(axis=-1) == levels).all()
    if kept == "int4":  # the value of largest magnitude is exactly -8 steps
        grouped = compact.to_rows(field, a).reshape(*scale.shape, compact.GROUP)
        at = np.abs(grouped).argmax(-1)[..., None]
        np.testing.assert_array_equal(np.take_along_axis(q.reshape(grouped.shape), at, -1), -8)


def test_int4_nibble_order():
    """Byte j of a group: value j + 8 in the low nibble, value j + 16 + 8 in the high one."""
    q = np.arange(64, dtype=np.int64).reshape(1, 64) % 15 - 7
    packed = compact.pack(q.astype(np.int8))
    assert packed.shape == (1, 32) and packed.dtype == np.uint8
    for g in range(2):
        for j in range(16):
            assert packed[0, 16 * g + j] == (q[0, 32 * g + j] + 8) | (q[0, 32 * g + 16 + j] + 8) << 4
    np.testing.assert_array_equal(compact.unpack(packed), q)


# --- kernels against NumPy on the widened weights ----------------------------------------------

groups = st.integers(1, 4).map(lambda n: n * compact.GROUP)


@given(T=st.integers(1, 70), K=st.integers(1, 300), N=st.integers(1, 70), n_chunks=st.integers(1, 3),
       accumulate=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_rows_product_bfloat16(T, K, N, n_chunks, accumulate, seed):
    """One row and up to 70 against a block's bfloat16 matrix read as stored, [out, in]: a tile of one row, or
    tiles of rows x outputs, widened in registers (rowtiles.py), with rows, outputs and inputs
    that end inside a tile or a vector, more chunks than outputs."""
    rng = np.random.default_rng(seed)
    stored, _ = compact.compress("c_fc_w", randn(rng, K, N), "bfloat16")
    assert stored.shape == (N, K)
    x, b, out = randn(rng, T, K), randn(rng, N), randn(rng, T, N)
    ref = (out.astype(np.float64) if accumulate else 0) + x @ compact.expand("c_fc_w", stored, None) + b
    matkernels._rows_product(stored, x, b, out, accumulate, n_chunks)
    np.testing.assert_allclose(out, ref, atol=1e-4, rtol=1e-4)


def quantize_rows(x):
    """NumPy's twin of intkernels._quantize_rows, the integer formats' inputs: int8 per group of 32,
    scale = max|x| / 127 in float32, q = rint(x / scale), 0 where a group is all zeros."""
    grouped = x.reshape(*x.shape[:-1], -1, compact.GROUP)
    scale = (np.abs(grouped).max(axis=-1, keepdims=True) / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(scale > 0, np.rint(grouped / scale), 0).astype(np.int8)
    return q.reshape(x.shape), scale[..., 0]


rows = st.integers(1, 9).flatmap(  # (rows: up to two of _dot_four_rows' blocks and a rest)
    lambda T: st.integers(1, 4).map(lambda n: (T, n * compact.GROUP)))


@given(shape=rows, zero_group=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_quantize_rows(shape, zero_group, seed):
    """The kernel quantises the inputs exactly as NumPy does (int8 values and scales)."""
    x = randn(np.random.default_rng(seed), *shape)
    if zero_group:
        x[0, : compact.GROUP] = 0.0
    q, s = np.empty(shape, np.int8), np.empty((shape[0], shape[1] // compact.GROUP), np.float32)
    intkernels._quantize_rows(x, q, s)
    ref_q, ref_s = quantize_rows(x)
    np.testing.assert_array_equal(q, ref_q)
    np.testing.assert_array_equal(s, ref_s)
    assert (np.abs(q) <= 127).all() and (np.abs(compact.dequantize(q, s) - x) <= 0.5 * np.repeat(s, 32, -1) + 1e-7).all()


@given(shape=rows, N=st.integers(1, 70), n_chunks=st.integers(1, 3), accumulate=st.booleans(), bias=st.booleans(),
       dtype=st.sampled_from(INTEGER), seed=st.integers(0, 2**32 - 1))
def test_int_rows(shape, N, n_chunks, accumulate, bias, dtype, seed):
    """Integer products against NumPy on the values both sides stand for (sizes off the vector width too)."""
    rng = np.random.default_rng(seed)
    T, K = shape
    stored, scale = compact.quantize(randn(rng, N, K), dtype)
    x = randn(rng, T, K)
    xq, xs = quantize_rows(x)
    b, out = randn(rng, N) if bias else None, randn(rng, T, N)
    ref = (out.astype(np.float64) if accumulate else 0) + compact.dequantize(xq, xs) @ compact.dequantize(stored, scale).T
    ref += b if bias else 0
    fused = out.copy()
    intkernels._int_rows(xq, xs, stored, scale, b, out, accumulate, n_chunks)
    np.testing.assert_allclose(out, ref, atol=1e-4, rtol=1e-4)
    # the same from x, quantised on the way (_int_matmul, what forward calls)
    intkernels._int_matmul(x, np.empty_like(xq), np.empty_like(xs), stored, scale, b, fused, accumulate, n_chunks)
    np.testing.assert_array_equal(fused, out)
    # rows go DOT_ROWS at a time (_dot_four_rows), the rest one by one: each row's bits as it gets them alone
    start = randn(np.random.default_rng(seed + 1), T, N)
    together, alone = start.copy(), start.copy()
    intkernels._int_rows(xq, xs, stored, scale, b, together, accumulate, n_chunks)
    for t in range(T):
        intkernels._int_rows(xq[t:t + 1], xs[t:t + 1], stored, scale, b, alone[t:t + 1], accumulate, n_chunks)
    np.testing.assert_array_equal(together, alone)


@given(seed=st.integers(0, 2**32 - 1), dtype=st.sampled_from(INTEGER))
def test_int_rows_exact_at_the_extremes(seed, dtype):
    """Every byte product and sum exact at the extremes of int8 (-128 included, as a file may hold it) and of
    int4 (-8 and 7): with unit scales the sums are whole numbers below 2^24 that float32 holds, so no
    tolerance. A product that saturates int16 in pairs, takes -128's sign wrongly, or a nibble's 8 off
    wrongly (int4 with VNNI or AVX2 multiplies w + 8; int8 with AVX-512 VNNI w + 128), fails."""
    rng = np.random.default_rng(seed)
    K, N = 4 * compact.GROUP, 6
    low, high = (-128, 127) if dtype == "int8" else (-8, 7)
    w = rng.choice(np.array([low, low + 1, high, 0, 1], np.int8), (N, K))
    w[0], w[1] = low, high  # a row of each extreme: every pair at its largest
    T = 5  # four rows at once (_dot_four_rows), and one alone
    xq = rng.choice(np.array([-127, 127, 0, -1], np.int8), (T, K))
    xq[0], xq[3] = -127, 127
    scale, xs = np.ones((N, K // compact.GROUP), np.float32), np.ones((T, K // compact.GROUP), np.float32)
    out = np.empty((T, N), np.float32)
    intkernels._int_rows(xq, xs, w if dtype == "int8" else compact.pack(w), scale, None, out, False, 1)
    np.testing.assert_array_equal(out, xq.astype(np.int64) @ w.astype(np.int64).T)


def int64_products(xq, xs, stored, scale):
    """The integer products' function, plainly: per group an exact int64 sum of int8 products, times
    the two scales, summed over the groups in float64. xq (T, K) int8, xs (T, K // GROUP); stored, scale: W's."""
    q = compact.unpack(stored) if stored.dtype == np.uint8 else stored
    T, N = xq.shape[0], q.shape[0]
    sums = np.einsum("tgk,ngk->tng", xq.reshape(T, -1, compact.GROUP).astype(np.int64),
                     q.reshape(N, -1, compact.GROUP).astype(np.int64))
    return (sums * xs[:, None, :].astype(np.float64) * scale[None].astype(np.float64)).sum(-1)


tile_shapes = st.integers(1, 70).flatmap(lambda T: st.integers(1, 12).map(lambda n: (T, n * compact.GROUP)))


@given(shape=tile_shapes, N=st.integers(1, 70), n_workers=st.integers(1, 3), accumulate=st.booleans(),
       bias=st.booleans(), dtype=st.sampled_from(INTEGER), seed=st.integers(0, 2**32 - 1))
def test_int_tiles(shape, N, n_workers, accumulate, bias, dtype, seed):
    """The tiles against an int64 NumPy reference, on sizes off every tile (rows, outputs, K blocks),
    and each row against the same row computed alone by _int_rows; in both layouts of the inputs
    (pairs of int16, quads of bytes + 128: with VNNI's vpdpbusd where the CPU has it, written out
    where not), which give the same bits."""
    rng = np.random.default_rng(seed)
    T, K = shape
    stored, scale = compact.quantize(randn(rng, N, K), dtype)
    x = randn(rng, T, K)
    rows = inttiles.padded_rows(T)
    ref_q, ref_s = quantize_rows(x)
    b, start = randn(rng, N) if bias else None, randn(rng, T, N)
    ref = (start.astype(np.float64) if accumulate else 0) + int64_products(ref_q, ref_s, stored, scale) + (b if bias else 0)
    results = {}
    for wide, offset in [(np.int16, 0), (np.uint8, 128)]:
        xq, xs, xw = np.empty((rows, K), np.int8), np.empty((rows, K // compact.GROUP), np.float32), np.empty((rows, K), wide)
        xw[:] = 99  # rows past T must be the layout's zero
        inttiles._lay_out_rows(x, xq, xs, xw)
        np.testing.assert_array_equal(xw[:T].astype(np.int64) - offset, ref_q)
        np.testing.assert_array_equal(xs[:T], ref_s)
        assert (xw[T:] == offset).all() and not xs[T:].any()
        out = start.copy()
        inttiles._int_tiles(xw, xs, T, stored, scale, b, out, accumulate, n_workers)
        np.testing.assert_allclose(out, ref, atol=1e-4, rtol=1e-5)
        results[wide] = out
    np.testing.assert_array_equal(results[np.uint8], results[np.int16])
    alone = start.copy()
    for t in range(T):  # the same rows one at a time, by the few-rows kernel
        intkernels._int_rows(ref_q[t:t + 1], ref_s[t:t + 1], stored, scale, b, alone[t:t + 1], accumulate, 1)
    np.testing.assert_allclose(results[np.int16], alone, atol=1e-4, rtol=1e-5)


def tile_loop_report(asm: str) -> dict:
    """What the tiles' hot loop does, from their assembly: multiply-adds, whether the inputs are
    broadcast, and moves to or from the stack between the first multiply-add and the last."""
    lines = [line.split() for line in asm.lower().splitlines() if line.strip() and not line.strip().startswith((".", "#"))]
    lines = [op[1:] if op[0] == "{vex}" else op for op in lines]
    madds = [i for i, op in enumerate(lines) if op[0].endswith(("pmaddwd", "dpwssd", "dpbusd"))]
    stack = [op for op in lines[madds[0]:madds[-1]] if "rsp" in " ".join(op[1:]) and op[0].startswith("vmov")] if madds else []
    return {"madds": len(madds), "dpbusd": sum(op[0] == "vpdpbusd" for op in lines),
            "broadcast": any(op[0].endswith("pbroadcastd") for op in lines), "stack": len(stack)}


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86's multiply-add instructions")
@pytest.mark.parametrize("dtype", INTEGER)
@pytest.mark.parametrize("kernel", ["_int_rows", "_int_tiles"])
def test_integer_kernels_use_the_integer_multiply_add(dtype, kernel):
    """The hot loops multiply with the CPU's integer multiply-add (pmaddwd or VNNI's; one row's dot products
    vpmaddubsw on bytes with AVX2), not scalar code; the tiles take each row's pair of inputs by one broadcast,
    and keep their sums in registers."""
    stored, scale = compact.quantize(np.ones((4, 64), np.float32), dtype)
    xq, xs = quantize_rows(np.ones((1, 64), np.float32))
    out = np.empty((1, 4), np.float32)
    if kernel == "_int_rows":
        fresh = numba.njit(intkernels._int_rows.py_func, parallel=True)  # not from the cache, which keeps no assembly
        fresh(xq, xs, stored, scale, None, out, False, 1)
    else:
        fresh = numba.njit(inttiles._int_tiles.py_func, parallel=True)
        rows = inttiles.padded_rows(1)
        fresh(np.zeros((rows, 64), inttiles.WIDE), np.zeros((rows, 2), np.float32), 1, stored, scale, None, out, False, 1)
    asm = "\n".join(fresh.inspect_asm().values()).lower()
    assert any(op in asm for op in ("pmaddwd", "vpdpwssd", "vpdpbusd")), f"no 8-bit multiply-add in {kernel}"
    if kernel == "_int_rows" and dispatch.BYTE_MADD:
        assert "vpmaddubsw" in asm, "one row's dot products do not multiply bytes (AVX2's vpmaddubsw)"
    if kernel == "_int_rows" and dtype == "int4" and intkernels._NIBBLE_DPBUSD:
        assert "vpdpbusd" in asm, "one row's int4 dot products do not multiply the nibbles with VNNI's vpdpbusd"
    if kernel == "_int_rows" and dtype == "int4" and intkernels._NIBBLES_AS_STORED:
        assert "vpsignb" not in asm, "one row's int4 dot products move signs rather than multiply the nibbles as stored"
    if kernel == "_int_tiles":
        check_tile_loop(tile_loop_report(asm), quads=inttiles.QUADS)


def check_tile_loop(report: dict, quads: bool) -> None:
    assert report["broadcast"], "the tile's inputs are not broadcast"
    assert (report["dpbusd"] > 0) == quads, f"vpdpbusd {'missing' if quads else 'used'} in the tiles"
    # few: not the sums' or the weights' (a tile left to LLVM's ordering moves about two vectors to the stack
    # per multiply-add)
    assert report["stack"] <= report["madds"] // 8, f"{report['stack']} stack moves among {report['madds']} multiply-adds"


# CPUs with VNNI for LLVM to compile for (nothing compiled for them runs here): AVX-512 VNNI, and AVX-VNNI without AVX-512
_BASE = "+64bit,+sse,+sse2,+sse3,+ssse3,+sse4.1,+sse4.2,+popcnt,+avx,+avx2,+fma,+f16c,+bmi,+bmi2,+lzcnt,+movbe,+cx16"
VNNI_CPUS = {"icelake-server": _BASE + ",+avx512f,+avx512cd,+avx512bw,+avx512dq,+avx512vl,+avx512vnni",
             "alderlake": _BASE + ",+avxvnni"}
_COMPILE_FOR_VNNI = """
import json, numba
from numba import types
from gpt2numba.cpu import intkernels, inttiles
fresh = numba.njit(inttiles._int_tiles.py_func, parallel=True)
c2 = lambda dtype: types.Array(dtype, 2, "C")
fresh.compile((c2(numba.from_dtype(inttiles.WIDE)), c2(types.float32), types.int64, c2(types.int8), c2(types.float32), types.none,
               c2(types.float32), types.boolean, types.int64))
rows = numba.njit(intkernels._int_rows.py_func, parallel=True)
rows.compile((c2(types.int8), c2(types.float32), c2(types.uint8), c2(types.float32), types.none, c2(types.float32),
              types.boolean, types.int64))
print(json.dumps({"quads": inttiles.QUADS, "lanes": inttiles._LANES, "asm": "\\n".join(fresh.inspect_asm().values()),
                  "int4_rows": "\\n".join(rows.inspect_asm().values())}))
"""


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="compiles for x86 CPUs")
@pytest.mark.skipif(bool(os.environ.get("NUMBA_DISABLE_JIT")), reason="compiles")
@pytest.mark.parametrize("cpu", VNNI_CPUS)
def test_integer_kernels_use_vnni_where_the_cpu_has_it(cpu, tmp_path):
    """Compiled for a CPU with VNNI (Numba told to target it; nothing runs), the tiles take their inputs as
    quads of bytes and multiply with vpdpbusd at the CPU's width, with their sums in registers. The same
    code with the instruction written out is checked against the reference on every CPU (test_int_tiles).
    One row's int4 dot products multiply their nibbles with vpdpbusd too (checked against the reference
    where the CPU running the tests has VNNI: test_int_rows)."""
    env = dict(os.environ, NUMBA_CPU_NAME=cpu, NUMBA_CPU_FEATURES=VNNI_CPUS[cpu], NUMBA_CACHE_DIR=str(tmp_path))
    run = subprocess.run([sys.executable, "-c", _COMPILE_FOR_VNNI], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.splitlines()[-1])
    assert result["quads"] and result["lanes"] == (16 if "avx512vnni" in VNNI_CPUS[cpu] else 8)
    check_tile_loop(tile_loop_report(result["asm"]), quads=True)
    assert "vpdpbusd" in result["int4_rows"].lower(), "one row's int4 dot products do not use vpdpbusd"


@given(V=st.integers(1, 1100), C=groups, R=st.integers(1, 4), n_chunks=st.integers(1, 3),
       seed=st.integers(0, 2**32 - 1))
def test_head_bfloat16(V, C, R, n_chunks, seed):
    def head(stored, scale, h, out):
        with threadpool_limits(1, user_api="blas"):
            matkernels._head(stored, h, out, n_chunks)
    check_head(head, V, C, R, "bfloat16", seed)


@given(V=st.integers(1, 60), C=groups, R=st.integers(1, 5), n_chunks=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_head_rows_bfloat16(V, C, R, n_chunks, seed):
    check_head(lambda stored, scale, h, out: matkernels._rows_product(stored, h, None, out, False, n_chunks),
               V, C, R, "bfloat16", seed)


def check_head(head, V, C, R, dtype, seed):
    """head(stored, scale, h (R, C), out (R, V)) against h @ the compact wte's values, transposed."""
    rng = np.random.default_rng(seed)
    stored, scale = compact.compress("wte", randn(rng, V, C), dtype)
    h, out = randn(rng, R, C), np.empty((R, V), np.float32)
    head(stored, scale, h, out)
    np.testing.assert_allclose(out, h @ compact.expand("wte", stored, scale).T, atol=1e-4, rtol=1e-4)


@given(K=st.integers(1, 150), N=st.integers(1, 70), seed=st.integers(0, 2**32 - 1))
def test_expand_bfloat16(K, N, seed):
    """A block's bfloat16 matrix, kept [out, in], widened as it is."""
    stored, _ = compact.compress("c_fc_w", randn(np.random.default_rng(seed), K, N), "bfloat16")
    out = np.empty((N, K), np.float32)
    matkernels._expand_bf16(stored, out)
    np.testing.assert_array_equal(out, compact.expand("c_fc_w", stored, None).T)


# --- the engine on compact weights ---------------------------------------------------------------

@pytest.fixture(scope="module", params=COMPACT)
def tiny_compact(request):
    return g.random_weights(TINY, seed=1, dtype=request.param)


@given(ids=st.lists(st.integers(0, TINY.vocab_size - 1), min_size=1, max_size=TINY.n_positions)
       .map(lambda x: np.array(x, np.int64)))
def test_prefill_compact(tiny_compact, ids):
    """Cache invariants unchanged, logits equal the oracle on the widened weights."""
    check_prefill(ids, tiny_compact, tiny_compact.dtype)


@given(data=st.data())
def test_chunks_and_decode_compact(tiny_compact, data):
    ids = np.array(data.draw(st.lists(st.integers(0, TINY.vocab_size - 1), min_size=2, max_size=40)))
    cuts = data.draw(st.lists(st.integers(1, len(ids) - 1), unique=True, max_size=5).map(sorted))
    check_chunks(ids, cuts, tiny_compact, f"{tiny_compact.dtype} chunks")


@pytest.mark.parametrize("dtype", COMPACT)
def test_gpt2_small_compact_decode(small, dtype, rng):
    """GPT-2 small's shapes: decode reads the compact matrices directly, and agrees with the oracle."""
    w = small.astype(dtype)
    ids = rng.integers(0, 50257, 24)
    check_chunks(ids, [20, 21, 22, 23], w, f"small {dtype}")


@pytest.mark.parametrize("dtype", COMPACT)
def test_generation_compact(tiny, dtype):
    """Greedy generation on compact weights: batched (prompts joining and leaving) as one at a time."""
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, TINY.vocab_size, n).tolist() for n in (1, 3, 40, 7, 20)]
    check_generate_batch(prompts, tiny.astype(dtype), batch_size=2)


@pytest.mark.parametrize("dtype", INTEGER)
@pytest.mark.parametrize("wide", [np.int16, np.uint8], ids=["pairs", "quads"])
def test_integer_tiles_prefill(dtype, wide, monkeypatch):
    """Past INT_ROWS_MAX rows the integer formats multiply in tiles (inttiles.py): the function the
    oracle rounds, for a prefill, chunks and the decode after them, and every row's logits; with the
    inputs laid out for either kind of step (the CPU's features choose one)."""
    monkeypatch.setattr(inttiles, "WIDE", wide)
    cfg = dataclasses.replace(TINY, n_positions=80)
    w = g.random_weights(cfg, seed=3, dtype=dtype)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, 75)
    check_chunks(ids, [INT_ROWS_MAX + 10, INT_ROWS_MAX + 11, 60, 61], w, f"{dtype}, past INT_ROWS_MAX")
    rows = g.prefill(ids, w, g.ModelCache(cfg), logits="all")
    for T in (1, INT_ROWS_MAX + 1, len(ids)):
        assert oracle.agreement(rows[T - 1], g.recompute_logits(ids[:T], w), w)[0]


def test_compact_is_smaller(small):
    f32 = small.nbytes
    assert small.astype("bfloat16").nbytes < 0.51 * f32
    assert small.astype("int8").nbytes < 0.29 * f32  # a quarter, plus one float32 scale per 32
    assert small.astype("int4").nbytes < 0.21 * f32  # an eighth, plus the scales, and wte in int8


# --- loading and saving ---------------------------------------------------------------------------

@pytest.mark.parametrize("file_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("dtype", COMPACT)
def test_load_as_compact(tmp_path, file_dtype, dtype):
    w = g.random_weights(TINY, seed=2)
    loaded = g.load_weights(write_dir(w, tmp_path, file_dtype), dtype=dtype)
    from_file = g.load_weights(tmp_path)  # float32 values of the file
    expected = from_file.astype(dtype)
    assert loaded.dtype == dtype
    for field in compact.MATRICES:
        np.testing.assert_array_equal(getattr(loaded, field), getattr(expected, field), err_msg=field)
    np.testing.assert_array_equal(loaded.c_attn_b, from_file.c_attn_b)


def test_bfloat16_file_loads_as_it_is(tmp_path):
    """A bfloat16 file in the model's layout, as any GPT-2 loader writes it: its bits, turned [out, in];
    and save_weights writes bfloat16 in that layout again."""
    import ml_dtypes
    from safetensors.numpy import load_file

    w = g.random_weights(TINY, seed=3)
    loaded = g.load_weights(write_dir(w, tmp_path / "in", "bfloat16"), dtype="bfloat16")
    bits = w.c_fc_w.astype(ml_dtypes.bfloat16).view(np.uint16)
    np.testing.assert_array_equal(loaded.c_fc_w, np.swapaxes(bits, 1, 2))
    g.save_weights(loaded, tmp_path / "out")
    saved = load_file(str(tmp_path / "out" / "model.safetensors"))["transformer.h.1.mlp.c_fc.weight"]
    np.testing.assert_array_equal(saved.view(np.uint16), bits[1])


@pytest.mark.parametrize("dtype", COMPACT)
def test_saved_compact_round_trip_is_bit_exact(tmp_path, dtype):
    w = g.random_weights(TINY, seed=4, dtype=dtype)
    g.save_weights(w, tmp_path)
    back = g.load_weights(tmp_path, dtype=dtype)
    for field in compact.MATRICES:
        np.testing.assert_array_equal(getattr(back, field), getattr(w, field), err_msg=field)
        if dtype in INTEGER:
            np.testing.assert_array_equal(back.scales[field], w.scales[field], err_msg=field)
    np.testing.assert_array_equal(g.load_weights(tmp_path).c_fc_w, w.dequantized().c_fc_w)


def test_bad_dtype(tmp_path):
    with pytest.raises(g.ConfigError, match="dtype must be one of"):
        g.random_weights(TINY, dtype="float8")
    with pytest.raises(g.ConfigError, match="dtype must be one of"):
        g.load_weights(tmp_path, dtype="int2")


@pytest.mark.parametrize("dtype", INTEGER)
def test_integer_file_missing_scales(tmp_path, dtype):
    w = g.random_weights(TINY, seed=5, dtype=dtype)
    g.save_weights(w, tmp_path)
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["transformer.h.1.mlp.c_fc.weight_scale"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(g.CheckpointError, match=f"{dtype} tensor .*h.1.mlp.c_fc.weight_scale"):
        g.load_weights(tmp_path, dtype=dtype)

"""cpu/amx.py on every CPU: the tiles' weight layouts and the hi/lo split against a NumPy model of the tile
instructions, as Intel's manual defines them; whether the tiles are asked for, and why not."""

import ctypes
import errno
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, strategies as st

from gpt2numba.cpu import amx, dispatch, pool
from gpt2numba.errors import ConfigError
from gpt2numba.model import compact
from gpt2numba.model.compact import GROUP
from gpt2numba.model.config import GPT2Config
from gpt2numba.model.products import Workspace, product

ROWS, PAIRS = amx.TILE_ROWS, amx.PAIR_INPUTS
FUSED = dispatch.FEATURES is None or "fma" in dispatch.FEATURES  # inttiles' scaling may contract to an FMA


# --- a model of the tiles: each instruction as Intel's SDM writes it ---------------------------------------

def tdpbf16ps(c, a, b):
    """c (m, 16) float32 += a (m, 32) bfloat16 bits times b (16 pair rows, 16 outputs x 2) bfloat16 bits: for
    each pair k, in order, c[m, n] += a[m, 2k] * b[k, 2n], then += a[m, 2k + 1] * b[k, 2n + 1], in float32
    (a product of two bfloat16 values is exact in float32). Inputs and sums stay normal here: no flushing."""
    a = compact.from_bfloat16(a).reshape(len(a), ROWS, 2)  # (m, k, j)
    b = compact.from_bfloat16(b).reshape(ROWS, ROWS, 2)  # (k, n, j)
    for k in range(ROWS):
        for j in range(2):
            c += a[:, k, j, None] * b[None, k, :, j]
    return c


def tdpbssd(a, b):
    """(m, 16) int32: a (m, 4 q) int8 times b (q quad rows, 16 outputs x 4) int8, each quad's four products
    summed into every output (a half-height tile for one group of 32 inputs: q = 8)."""
    a = a.astype(np.int32).reshape(len(a), -1, 4)  # (m, k, j)
    b = b.astype(np.int32).reshape(len(b), ROWS, 4)  # (k, n, j)
    return np.einsum("mkj,knj->mn", a, b)


def tiled_bf16(x, bits):
    """x (T, K) float32 @ bf16 bits (N, K).T through amx's layout and split, tile by tile, as the tile kernel
    would run it: two passes (hi, then lo) into one float32 tile of sums per 16 rows and 16 outputs."""
    T, K = x.shape
    N = bits.shape[0]
    tiles = amx.bf16_pairs(bits)  # (n, k, 16, 32)
    hi, lo = np.zeros((2, -(-T // ROWS) * ROWS, tiles.shape[1] * PAIRS), np.uint16)
    amx.split_hi_lo(x, hi[:T, :K], lo[:T, :K])
    out = np.zeros((hi.shape[0], tiles.shape[0] * ROWS), np.float32)
    for m in range(0, T, ROWS):
        for n in range(tiles.shape[0]):
            c = np.zeros((ROWS, ROWS), np.float32)
            for k in range(tiles.shape[1]):
                for part in (hi, lo):
                    tdpbf16ps(c, part[m:m + ROWS, k * PAIRS:(k + 1) * PAIRS], tiles[n, k])
            out[m:m + ROWS, n * ROWS:(n + 1) * ROWS] = c
    return out[:T, :N]


def tiled_int8(xq, xs, q, scale):
    """The integer product through amx's quads: per group of GROUP inputs, the tile's exact int32 sums, then
    acc += sums * (x's scale * W's scale) in float32, group after group, as inttiles scales its sums (fused
    where the CPU has FMA: LLVM contracts it)."""
    tiles = amx.int8_quads(q)  # (n, g, 8, 64)
    T, N = len(xq), len(q)
    out = np.zeros((T, tiles.shape[0] * ROWS), np.float32)
    for n in range(tiles.shape[0]):
        ws = np.zeros(ROWS, np.float32)
        for g in range(tiles.shape[1]):
            outputs = slice(n * ROWS, min(N, (n + 1) * ROWS))
            ws[:] = 0
            ws[:outputs.stop - outputs.start] = scale[outputs, g]
            sums = tdpbssd(xq[:, g * GROUP:(g + 1) * GROUP], tiles[n, g]).astype(np.float32)  # (T, 16)
            acc = out[:, n * ROWS:(n + 1) * ROWS]
            if FUSED:  # one rounding: the product of two float32 is exact in float64 (an odd double rounding aside)
                acc[:] = (sums.astype(np.float64) * (xs[:, g, None] * ws[None, :]) + acc).astype(np.float32)
            else:
                acc += sums * (xs[:, g, None] * ws[None, :])
    return out[:, :N]


# --- the layouts -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("out, k", [(16, 32), (37, 70), (5, 3), (50, 96)])
def test_pairs_place_every_weight(out, k):
    m = np.arange(1, out * k + 1, dtype=np.uint16).reshape(out, k)  # every weight its own value
    tiles = amx.bf16_pairs(m)
    assert tiles.shape == (-(-out // 16), -(-k // 32), 16, 32) and tiles.dtype == np.uint16
    for n, kb, r, col in np.ndindex(tiles.shape):
        c, j = divmod(col, 2)
        o, i = 16 * n + c, 32 * kb + 2 * r + j
        assert tiles[n, kb, r, col] == (m[o, i] if o < out and i < k else 0)


@pytest.mark.parametrize("out", [16, 37, 3])
def test_quads_place_every_weight(out):
    k = 3 * GROUP
    m = (np.arange(out * k) % 251 - 125).astype(np.int8).reshape(out, k)
    tiles = amx.int8_quads(m)
    assert tiles.shape == (-(-out // 16), 3, GROUP // 4, 64)
    for n, g, r, col in np.ndindex(tiles.shape):
        c, j = divmod(col, 4)
        o = 16 * n + c
        assert tiles[n, g, r, col] == (m[o, GROUP * g + 4 * r + j] if o < out else 0)
    with pytest.raises(ConfigError, match="whole groups of 32"):
        amx.int8_quads(m[:, :40])


# --- the split and the products through the layouts --------------------------------------------------------

@given(st.integers(0, 2**32 - 1), st.integers(-30, 30))
def test_split_keeps_16_bits_of_each_input(seed, exponent):
    x = (np.random.default_rng(seed).standard_normal((3, 50)) * 2.0**exponent).astype(np.float32)
    hi, lo = np.zeros((2, 3, 50), np.uint16)
    amx.split_hi_lo(x, hi, lo)
    assert np.array_equal(hi, compact.to_bfloat16(x))  # hi: x to nearest, ties to even
    h, l = compact.from_bfloat16(hi).astype(np.float64), compact.from_bfloat16(lo).astype(np.float64)
    assert np.array_equal(lo, compact.to_bfloat16((x - compact.from_bfloat16(hi)).astype(np.float32)))
    assert np.all(np.abs(x - (h + l)) <= 2.0**-16 * np.abs(x))
    assert np.abs(x - h).max() > 2.0**-12 * np.abs(x).max()  # (hi alone is bfloat16's error: lo is needed)


@pytest.mark.parametrize("T, N, K", [(1, 16, 32), (19, 37, 70), (70, 50, 96), (33, 16, 768)])
def test_tiled_bf16_product_is_float32_level(T, N, K):
    rng = np.random.default_rng(T * N + K)
    x = rng.standard_normal((T, K)).astype(np.float32)
    bits = compact.to_bfloat16(rng.standard_normal((N, K)).astype(np.float32) * 0.05)
    exact = x.astype(np.float64) @ compact.from_bfloat16(bits).astype(np.float64).T
    bound = (2.0**-16 + K * 2.0**-24) * (np.abs(x) @ np.abs(compact.from_bfloat16(bits)).T)
    got = tiled_bf16(x, bits)
    assert np.all(np.abs(got - exact) <= bound), np.abs(got - exact).max()
    # what the split buys: hi alone is off by bfloat16's rounding of the inputs, far past the bound
    hi_only = compact.from_bfloat16(compact.to_bfloat16(x)).astype(np.float64) @ compact.from_bfloat16(bits).T
    assert np.any(np.abs(hi_only - exact) > bound)


@pytest.mark.parametrize("T, N, groups", [(1, 16, 1), (19, 37, 3), (70, 50, 4)])
def test_tiled_int8_product_is_the_integer_tiles(T, N, groups):
    """Through the quads, the model gives the bits gpt2numba's integer product gives today (inttiles)."""
    rng = np.random.default_rng(T + N)
    K = groups * GROUP
    x = rng.standard_normal((T, K)).astype(np.float32)
    q, scale = compact.quantize(rng.standard_normal((N, K)).astype(np.float32), "int8")
    xq, xs = compact.quantize(x, "int8")
    work = Workspace(GPT2Config(n_layer=1, n_head=1, n_embd=max(K, N), n_positions=8, vocab_size=8), T, 1)
    ours = np.zeros((T, N), np.float32)
    product(x, q, scale, None, ours, False, work, dispatch.n_chunks(1), few=False)
    assert np.array_equal(work.quantized(T, K)[0], xq)  # the inputs as the tiles take them
    np.testing.assert_array_equal(tiled_int8(xq, xs, q, scale), ours)


# --- asking for the tiles ----------------------------------------------------------------------------------

def _fresh(monkeypatch):
    monkeypatch.setattr(amx, "_granted", [])


def test_the_tiles_are_off_without_the_features(monkeypatch):
    _fresh(monkeypatch)
    monkeypatch.setattr(dispatch, "FEATURES", frozenset({"avx512f", "amx-tile", "amx-bf16"}))
    monkeypatch.setattr(dispatch, "AMX", dispatch.choose(dispatch.FEATURES).amx)
    assert amx.available() == "this CPU has no amx-int8"
    assert amx.request() == amx.available()
    assert amx.describe() == f"off: {amx.available()}"
    monkeypatch.setattr(dispatch, "FEATURES", None)
    assert amx.available() == "not an x86 CPU"
    monkeypatch.setattr(dispatch, "AMX", True)
    assert amx.available() is None


def test_a_refused_request_falls_back_and_says_why(monkeypatch):
    _fresh(monkeypatch)
    monkeypatch.setattr(dispatch, "FEATURES", frozenset({*dispatch.AMX_FEATURES, "avx512f"}))
    monkeypatch.setattr(dispatch, "AMX", True)
    calls = []

    def refusing(number, code, arg):
        calls.append(code)
        if code == amx._ARCH_GET_XCOMP_SUPP:
            ctypes.cast(arg, ctypes.POINTER(ctypes.c_uint64))[0] = 1 << amx._XFEATURE_XTILEDATA
            return 0
        ctypes.set_errno(errno.EPERM)
        return -1

    assert amx.describe().endswith("not asked of Linux yet), but no tile kernel is built")
    why = amx.request(refusing)
    assert why == "Linux refused the tiles' state (arch_prctl ARCH_REQ_XCOMP_PERM: Operation not permitted)"
    assert calls == [amx._ARCH_GET_XCOMP_SUPP, amx._ARCH_REQ_XCOMP_PERM]
    assert amx.request() == why and len(calls) == 2  # asked once a process
    assert amx.describe() == f"off: {why}"
    assert f"AMX tiles {amx.describe()}" in pool.describe()


def test_a_kernel_without_the_tiles_state(monkeypatch):
    _fresh(monkeypatch)
    monkeypatch.setattr(dispatch, "FEATURES", frozenset(dispatch.AMX_FEATURES))
    monkeypatch.setattr(dispatch, "AMX", True)

    def unsupported(number, code, arg):
        ctypes.cast(arg, ctypes.POINTER(ctypes.c_uint64))[0] = 0b11100111  # x87, SSE, AVX, AVX-512's three
        return 0

    assert "lacks XTILEDATA" in amx.request(unsupported)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="asks Linux")
def test_linux_answers_as_the_cpu_has_tiles(monkeypatch):
    """The real system call: granted where /proc/cpuinfo lists amx_tile, refused elsewhere, even when the
    features are forced (NUMBA_CPU_FEATURES could)."""
    _fresh(monkeypatch)
    monkeypatch.setattr(dispatch, "FEATURES", frozenset(dispatch.AMX_FEATURES))
    monkeypatch.setattr(dispatch, "AMX", True)
    has_tiles = "amx_tile" in open("/proc/cpuinfo").read()
    assert (amx.request() is None) == has_tiles, amx.request()


def test_gpt2numba_amx_0_turns_them_off():
    code = "from gpt2numba.cpu import amx; print(amx.describe()); print(amx.request())"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "GPT2NUMBA_AMX": "0"},
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out == ["off: GPT2NUMBA_AMX=0 in the environment", "GPT2NUMBA_AMX=0 in the environment"]

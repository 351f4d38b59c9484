"""blas._gemm, the float32 product the kernels hand to BLAS, and its fallback, against float64 NumPy."""

import ctypes

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpt2numba import blas
from helpers import randn

dims = st.integers(1, 40)


@given(M=dims, K=dims, N=dims, pad=st.integers(0, 3), b_transposed=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_gemm(M, K, N, pad, b_transposed, seed):
    """Slices of columns (leading dimensions wider than the rows), either orientation of b."""
    rng = np.random.default_rng(seed)
    a = randn(rng, M, K + pad)[:, pad:]
    b = randn(rng, N, K + pad)[:, :K] if b_transposed else randn(rng, K, N + pad)[:, :N]
    out = randn(rng, M, N + pad)
    before = out[:, N:].copy()
    blas._gemm(a, b, out[:, :N], b_transposed)
    ref = a.astype(np.float64) @ (b.T if b_transposed else b)
    np.testing.assert_allclose(out[:, :N], ref, atol=1e-4, rtol=1e-4)
    np.testing.assert_array_equal(out[:, N:], before)  # the columns beside out's are not written


def test_gemm_empty_inner_dimension():
    out = np.ones((3, 4), np.float32)
    blas._gemm(np.empty((3, 0), np.float32), np.empty((0, 4), np.float32), out, False)
    np.testing.assert_array_equal(out, 0.0)


@pytest.mark.parametrize("trans_b", [111, 112])
def test_fallback(trans_b):
    """The shim that stands in for NumPy's OpenBLAS where there is none, called as cblas_sgemm would be."""
    rng = np.random.default_rng(trans_b)
    M, K, N = 5, 7, 6
    a = randn(rng, M, K + 2)
    b = randn(rng, N, K + 1) if trans_b == 112 else randn(rng, K, N + 1)
    c = randn(rng, M, N + 3)
    beside = c[:, N:].copy()

    def p(x):
        return x.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
    blas._fallback.ctypes(101, 111, trans_b, M, N, K, 1.0, p(a), K + 2, p(b), b.shape[1], 0.0, p(c), N + 3)
    ref = a[:, :K].astype(np.float64) @ (b[:, :K].T if trans_b == 112 else b[:, :N])
    np.testing.assert_allclose(c[:, :N], ref, atol=1e-4, rtol=1e-4)
    np.testing.assert_array_equal(c[:, N:], beside)

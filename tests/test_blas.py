"""blas._gemm, the float32 product the kernels hand to BLAS, and its fallback, against float64 NumPy."""

import ctypes

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpt2numba.cpu import blas
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


@pytest.mark.parametrize("b_transposed", [False, True])
def test_gemm_one_row(b_transposed):
    """One row is a matrix-vector product (sgemv); from a row of a wider matrix, into a slice of columns."""
    rng = np.random.default_rng(int(b_transposed))
    K, N = 37, 29
    a = randn(rng, 3, K + 4)[1:2, 2:2 + K]
    b = randn(rng, N, K + 3)[:, 1:1 + K] if b_transposed else randn(rng, K, N + 3)[:, 1:1 + N]
    out = randn(rng, 2, N + 5)
    before = out.copy()
    blas._gemm(a, b, out[:1, 2:2 + N], b_transposed)
    ref = a.astype(np.float64) @ (b.T if b_transposed else b)
    np.testing.assert_allclose(out[:1, 2:2 + N], ref, atol=1e-4, rtol=1e-4)
    out[:1, 2:2 + N] = before[:1, 2:2 + N]
    np.testing.assert_array_equal(out, before)  # nothing beside the slice is written


def test_gemm_empty_inner_dimension():
    out = np.ones((3, 4), np.float32)
    blas._gemm(np.empty((3, 0), np.float32), np.empty((0, 4), np.float32), out, False)
    np.testing.assert_array_equal(out, 0.0)


def p(x):
    return x.ctypes.data_as(ctypes.POINTER(ctypes.c_float))


@pytest.mark.parametrize("trans_b", [111, 112])
def test_fallback_gemm(trans_b):
    """The shim that stands in for NumPy's OpenBLAS where there is none, called as cblas_sgemm would be."""
    rng = np.random.default_rng(trans_b)
    M, K, N = 5, 7, 6
    a = randn(rng, M, K + 2)
    b = randn(rng, N, K + 1) if trans_b == 112 else randn(rng, K, N + 1)
    c = randn(rng, M, N + 3)
    beside = c[:, N:].copy()
    blas._fallback_gemm.ctypes(101, 111, trans_b, M, N, K, 1.0, p(a), K + 2, p(b), b.shape[1], 0.0, p(c), N + 3)
    ref = a[:, :K].astype(np.float64) @ (b[:, :K].T if trans_b == 112 else b[:, :N])
    np.testing.assert_allclose(c[:, :N], ref, atol=1e-4, rtol=1e-4)
    np.testing.assert_array_equal(c[:, N:], beside)


@pytest.mark.parametrize("trans", [111, 112])
def test_fallback_gemv(trans):
    """The sgemv shim, called as cblas_sgemv would be: y = A x or A.T x, A (M, N) with lda > N."""
    rng = np.random.default_rng(trans)
    M, N = 6, 9
    a = randn(rng, M, N + 2)
    x = randn(rng, M if trans == 112 else N)
    y = np.zeros(N if trans == 112 else M, np.float32)
    blas._fallback_gemv.ctypes(101, trans, M, N, 1.0, p(a), N + 2, p(x), 1, 0.0, p(y), 1)
    ref = (a[:, :N].T if trans == 112 else a[:, :N]).astype(np.float64) @ x
    np.testing.assert_allclose(y, ref, atol=1e-4, rtol=1e-4)

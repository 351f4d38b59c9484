"""Each Numba kernel against a slow, plain NumPy reference on random shapes."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from threadpoolctl import threadpool_limits

from gpt2numba import kernels, oracle
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


def _cache_case(rng, n_layer, H, D, max_len, start, T):
    k = randn(rng, n_layer, H, max_len, D)
    v = randn(rng, n_layer, H, max_len, D)
    qkv = randn(rng, T, 3 * H * D)
    return qkv, k, v


cache_shapes = st.tuples(
    st.integers(1, 3), st.integers(1, 4), st.sampled_from([1, 8, 64]), st.sampled_from([1, 2, 24, 70, 150])
).flatmap(lambda s: st.tuples(st.just(s), st.integers(0, s[3] - 1)).flatmap(
    lambda p: st.tuples(st.just(p[0]), st.just(p[1]), st.integers(1, p[0][3] - p[1]))))


@given(shape=cache_shapes, seed=st.integers(0, 2**32 - 1), data=st.data())
def test_write_kv(shape, seed, data):
    (n_layer, H, D, max_len), start, T = shape
    layer = data.draw(st.integers(0, n_layer - 1))
    qkv, k, v = _cache_case(np.random.default_rng(seed), n_layer, H, D, max_len, start, T)
    k_ref, v_ref = k.copy(), v.copy()
    C = H * D
    # (T, C) -> (H, T, D)
    k_ref[layer, :, start:start + T] = qkv[:, C:2 * C].reshape(T, H, D).transpose(1, 0, 2)
    v_ref[layer, :, start:start + T] = qkv[:, 2 * C:].reshape(T, H, D).transpose(1, 0, 2)
    lengths = np.full(n_layer, -1, np.int64)
    kernels._write_kv(qkv, k, v, lengths, layer, start)
    np.testing.assert_array_equal(k, k_ref)
    np.testing.assert_array_equal(v, v_ref)
    assert lengths[layer] == start + T and (np.delete(lengths, layer) == -1).all()


@given(shape=cache_shapes, seed=st.integers(0, 2**32 - 1), data=st.data())
def test_attend(shape, seed, data):
    """T queries at positions start..start+T-1 over cache rows 0..start+T-1."""
    (n_layer, H, D, max_len), start, T = shape
    layer = data.draw(st.integers(0, n_layer - 1))
    qkv, k, v = _cache_case(np.random.default_rng(seed), n_layer, H, D, max_len, start, T)
    out = np.empty((T, H * D), np.float32)
    scratch = np.empty((H, kernels.ATTEND_TILE * (D + max_len)), np.float32)
    with threadpool_limits(1, user_api="blas"):
        kernels._attend(qkv, k, v, layer, start, out, scratch)

    ref = np.empty((T, H * D))
    for h in range(H):
        q = qkv[:, h * D:(h + 1) * D].astype(np.float64)           # (T, D)
        kk = k[layer, h, :start + T].astype(np.float64)               # (start+T, D)
        vv = v[layer, h, :start + T].astype(np.float64)
        scores = q @ kk.T / np.sqrt(D)                                # (T, start+T)
        visible = np.arange(start + T)[None, :] <= (start + np.arange(T))[:, None]
        scores = np.where(visible, scores, -np.inf)
        ref[:, h * D:(h + 1) * D] = oracle.softmax(scores) @ vv
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-4)


@given(T=st.integers(1, 12), K=dims, N=dims, n_blocks=st.integers(1, 3), split_k=st.booleans(),
       accumulate=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_linear(T, K, N, n_blocks, split_k, accumulate, seed):
    """out (+)= x @ w + b, whichever way the work is split, even into more blocks than rows."""
    rng = np.random.default_rng(seed)
    x, w, b, out = randn(rng, T, K), randn(rng, K, N), randn(rng, N), randn(rng, T, N)
    ref = (out.astype(np.float64) if accumulate else 0) + x.astype(np.float64) @ w + b
    scratch = np.empty(n_blocks * T * N, np.float32)
    with threadpool_limits(1, user_api="blas"):
        kernels._linear(x, w, b, scratch, out, accumulate, n_blocks, split_k)
    np.testing.assert_allclose(out, ref, atol=1e-4, rtol=1e-4)


@given(V=st.integers(1, 300), C=dims, n_blocks=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_head(V, C, n_blocks, seed):
    rng = np.random.default_rng(seed)
    wte, h, out = randn(rng, V, C), randn(rng, C), np.empty(V, np.float32)
    with threadpool_limits(1, user_api="blas"):
        kernels._head(wte, h, out, n_blocks)
    np.testing.assert_allclose(out, wte.astype(np.float64) @ h, atol=1e-4, rtol=1e-4)


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

"""bfloat16 and int8 weights: formats, kernels against NumPy on the widened values, the engine against the oracle."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from threadpoolctl import threadpool_limits

import gpt2numba as g
from checkpoints import write_dir
from conftest import TINY
from gpt2numba import compact, kernels
from helpers import check_chunks, check_prefill, randn

COMPACT = ["bfloat16", "int8"]


# --- the formats -----------------------------------------------------------------------------

def test_bfloat16_rounds_to_nearest_even():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    a = np.random.default_rng(0).standard_normal(10_000).astype(np.float32) * 100
    a[:4] = [1 + 2**-8, 1 + 3 * 2**-8, -0.0, 3.0e38]  # ties go to even; signs and range survive
    np.testing.assert_array_equal(compact.to_bfloat16(a), a.astype(ml_dtypes.bfloat16).view(np.uint16))
    np.testing.assert_array_equal(compact.from_bfloat16(compact.to_bfloat16(a)),
                                  a.astype(ml_dtypes.bfloat16).astype(np.float32))


@pytest.mark.parametrize("field, shape", [("c_fc_w", (3, 64, 40)), ("wte", (50, 96))])
def test_int8_groups_along_the_input(field, shape):
    a = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    q, scale = compact.quantize(field, a)
    assert q.dtype == np.int8 and scale.shape == compact.scale_shape(field, shape)
    back = compact.dequantize(field, q, scale)
    # each value within half a step of its group's scale, and each group's largest exactly +-127
    step = np.repeat(scale, compact.GROUP, axis=-2 if field != "wte" else -1)
    assert (np.abs(back - a) <= 0.5 * step * (1 + 1e-6)).all()
    assert (np.abs(q).max(axis=-2 if field != "wte" else -1) <= 127).all()


# --- kernels against NumPy on the widened weights ----------------------------------------------

groups = st.integers(1, 4).map(lambda n: n * compact.GROUP)


@given(K=groups, N=st.integers(1, 70), n_blocks=st.integers(1, 3), accumulate=st.booleans(),
       dtype=st.sampled_from(COMPACT), seed=st.integers(0, 2**32 - 1))
def test_gemv(K, N, n_blocks, accumulate, dtype, seed):
    rng = np.random.default_rng(seed)
    stored, scale = compact.compress("c_fc_w", randn(rng, K, N), dtype)
    x, b, out = randn(rng, 1, K), randn(rng, N), randn(rng, 1, N)
    ref = (out.astype(np.float64) if accumulate else 0) + x @ compact.expand("c_fc_w", stored, scale) + b
    scratch = np.empty(2 * n_blocks * N, np.float32)
    if dtype == "bfloat16":
        kernels._gemv_bf16(x, stored, b, scratch, out, accumulate, n_blocks)
    else:
        kernels._gemv_int8(x, stored, scale, b, scratch, out, accumulate, n_blocks)
    np.testing.assert_allclose(out, ref, atol=1e-4, rtol=1e-4)


@given(V=st.integers(1, 1100), C=groups, R=st.integers(1, 4), n_blocks=st.integers(1, 3),
       dtype=st.sampled_from(COMPACT), seed=st.integers(0, 2**32 - 1))
def test_head(V, C, R, n_blocks, dtype, seed):
    def head(stored, scale, h, out):
        with threadpool_limits(1, user_api="blas"):
            if dtype == "bfloat16":
                kernels._head_bf16(stored, h, out, n_blocks)
            else:
                kernels._head_int8(stored, scale, h, out, n_blocks)
    check_head(head, V, C, R, dtype, seed)


@given(T=st.integers(2, 7), K=groups, N=st.integers(1, 70), n_blocks=st.integers(1, 3),
       dtype=st.sampled_from(COMPACT), accumulate=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_linear_rows(T, K, N, n_blocks, dtype, accumulate, seed):
    """A few rows against the compact matrix read as stored."""
    rng = np.random.default_rng(seed)
    stored, scale = compact.compress("c_fc_w", randn(rng, K, N), dtype)
    x, b, out = randn(rng, T, K), randn(rng, N), randn(rng, T, N)
    ref = (out.astype(np.float64) if accumulate else 0) + x @ compact.expand("c_fc_w", stored, scale) + b
    kernels._linear_rows(x, stored, scale, b, np.empty((T + 1) * N, np.float32), out, accumulate, n_blocks)
    np.testing.assert_allclose(out, ref, atol=1e-4, rtol=1e-4)


@given(V=st.integers(1, 60), C=groups, R=st.integers(2, 5), n_blocks=st.integers(1, 3),
       dtype=st.sampled_from(COMPACT), seed=st.integers(0, 2**32 - 1))
def test_head_rows(V, C, R, n_blocks, dtype, seed):
    check_head(lambda stored, scale, h, out: kernels._head_rows(stored, scale, h, out, n_blocks), V, C, R, dtype, seed)


def check_head(head, V, C, R, dtype, seed):
    """head(stored, scale, h (R, C), out (R, V)) against h @ the compact wte's values, transposed."""
    rng = np.random.default_rng(seed)
    stored, scale = compact.compress("wte", randn(rng, V, C), dtype)
    h, out = randn(rng, R, C), np.empty((R, V), np.float32)
    head(stored, scale, h, out)
    np.testing.assert_allclose(out, h @ compact.expand("wte", stored, scale).T, atol=1e-4, rtol=1e-4)


@given(K=groups, N=st.integers(1, 70), dtype=st.sampled_from(COMPACT), seed=st.integers(0, 2**32 - 1))
def test_expand(K, N, dtype, seed):
    stored, scale = compact.compress("c_fc_w", randn(np.random.default_rng(seed), K, N), dtype)
    out = np.empty((K, N), np.float32)
    with threadpool_limits(1, user_api="blas"):
        if dtype == "bfloat16":
            kernels._expand_bf16(stored, out)
        else:
            kernels._expand_int8(stored, scale, out)
    np.testing.assert_array_equal(out, compact.expand("c_fc_w", stored, scale))


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


def test_compact_is_smaller(small):
    f32 = small.nbytes
    assert small.astype("bfloat16").nbytes < 0.51 * f32
    assert small.astype("int8").nbytes < 0.29 * f32  # a quarter, plus one float32 scale per 32


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
    w = g.random_weights(TINY, seed=3)
    loaded = g.load_weights(write_dir(w, tmp_path, "bfloat16"), dtype="bfloat16")
    import ml_dtypes

    np.testing.assert_array_equal(loaded.c_fc_w, w.c_fc_w.astype(ml_dtypes.bfloat16).view(np.uint16))


@pytest.mark.parametrize("dtype", COMPACT)
def test_saved_compact_round_trip_is_bit_exact(tmp_path, dtype):
    w = g.random_weights(TINY, seed=4, dtype=dtype)
    g.save_weights(w, tmp_path)
    back = g.load_weights(tmp_path, dtype=dtype)
    for field in compact.MATRICES:
        np.testing.assert_array_equal(getattr(back, field), getattr(w, field), err_msg=field)
        if dtype == "int8":
            np.testing.assert_array_equal(back.scales[field], w.scales[field], err_msg=field)
    np.testing.assert_array_equal(g.load_weights(tmp_path).c_fc_w, w.dequantized().c_fc_w)


def test_bad_dtype(tmp_path):
    with pytest.raises(g.ConfigError, match="dtype must be one of"):
        g.random_weights(TINY, dtype="float8")
    with pytest.raises(g.ConfigError, match="dtype must be one of"):
        g.load_weights(tmp_path, dtype="int4")


def test_int8_file_missing_scales(tmp_path):
    w = g.random_weights(TINY, seed=5, dtype="int8")
    g.save_weights(w, tmp_path)
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["transformer.h.1.mlp.c_fc.weight_scale"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(g.CheckpointError, match="h.1.mlp.c_fc.weight_scale"):
        g.load_weights(tmp_path, dtype="int8")

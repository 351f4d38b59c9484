"""bfloat16 activations: every matrix product's inputs rounded to bfloat16 once, multiplied by vdpbf16ps where the
CPU has it (rowtiles), else widened; the rounding against ml_dtypes', the kernel against float64 products of the
rounded values, the model against the oracle that rounds the same inputs, and the paths the CPU does not take."""

import json
import os
import pickle
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import gpt2numba as g
import helpers
from checkpoints import write_dir
from conftest import TINY
from gpt2numba.cpu import dispatch, matkernels, paneltiles
from gpt2numba.errors import ConfigError
from gpt2numba.model import compact, oracle

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bf16(tiny_or_w):
    return tiny_or_w.astype("bfloat16", activations="bfloat16")


def rounded(a):
    """float32 -> bfloat16 bits by the engine's kernel."""
    out = np.empty(a.shape, np.uint16)
    matkernels._round_bf16(np.ascontiguousarray(a, np.float32), out)
    return out


def test_rounding_is_ml_dtypes_bfloat16():
    """To nearest, ties to even, as ml_dtypes rounds: random values over every exponent, exact ties (the bit
    below bfloat16's last one set, none under it) on even and odd values, subnormals, zeros, and the largest
    floats, which round to infinity."""
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32)
    finite = bits[(bits & 0x7F800000) != 0x7F800000]
    ties = (rng.integers(0, 2**16, 2000, dtype=np.uint32) << 16) | 0x8000
    ties = ties[(ties & 0x7F800000) != 0x7F800000]
    special = np.array([0, 0x80000000, 1, 0x807FFFFF, 0x00808000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x3F808000,
                        0x3F818000], np.uint32)
    x = np.concatenate([finite, ties, special]).view(np.float32).reshape(1, -1)
    with np.errstate(over="ignore"):
        expected = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    np.testing.assert_array_equal(rounded(x), expected)
    np.testing.assert_array_equal(compact.to_bfloat16(x), expected)  # the weights' rounding, the same
    normal = (np.abs(x) >= np.finfo(np.float32).tiny) & (np.abs(x) < 2.0**127)  # the oracle's: activations' range
    np.testing.assert_array_equal(oracle.bfloat16_inputs(x[normal].astype(np.float64)),
                                  compact.from_bfloat16(expected[normal]))


@given(V=st.integers(1, 60), C=st.integers(1, 100), R=st.integers(1, 70), bias=st.booleans(),
       accumulate=st.booleans(), n_chunks=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_products_of_rounded_rows(V, C, R, bias, accumulate, n_chunks, seed):
    """out (+)= X @ W.T (+ b) for bfloat16 rows X and matrix W: one row, tiles of rows x outputs, and inputs
    past the last whole step of 32 (vdpbf16ps's pairs), against float64."""
    check_product(matkernels._rows_product, V, C, R, bias, accumulate, n_chunks, seed)


@pytest.mark.skipif(not dispatch.BF16_DOT, reason="this CPU has no AVX512_BF16: no panels")
@given(V=st.integers(1, 100), H=st.integers(1, 60), R=st.integers(1, 70), bias=st.booleans(),
       accumulate=st.booleans(), n_chunks=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_products_in_panels(V, H, R, bias, accumulate, n_chunks, seed):
    """The same through paneltiles: outputs past a panel's 16 and a pack's 32 (zeros packed), rows past a tile's
    12 (through the sums) and whole tiles (straight into out), pairs of inputs past the 16 of a transposed block."""
    check_product(paneltiles._panel_product, V, 2 * H, R, bias, accumulate, n_chunks, seed)


def check_product(kernel, V, C, R, bias, accumulate, n_chunks, seed):
    """kernel(W, X, b or None, out, accumulate, n_chunks) for rounded W (V, C) and X (R, C) against float64."""
    rng = np.random.default_rng(seed)
    w, x = rounded(helpers.randn(rng, V, C)), rounded(helpers.randn(rng, R, C))
    out, b = helpers.randn(rng, R, V), helpers.randn(rng, V)
    wide = lambda a: compact.from_bfloat16(a).astype(np.float64)  # noqa: E731
    ref = (out.astype(np.float64) if accumulate else 0) + wide(x) @ wide(w).T + (b if bias else 0)
    kernel(w, x, b if bias else None, out, accumulate, n_chunks)
    np.testing.assert_allclose(out, ref, atol=1e-4, rtol=1e-4)


def test_the_model_matches_the_oracle(tiny):
    """Prefill over a few rows and past the tiles' 32 (panels, or BLAS without AVX512_BF16), chunks, decode
    steps, every position's logits and ragged batches, each against the oracle that rounds every product's
    inputs as the engine does."""
    w = bf16(tiny)
    ids = np.random.default_rng(0).integers(0, TINY.vocab_size, TINY.n_positions)
    helpers.check_chunks(ids, [5, 6, 7, 40], w, "bfloat16 activations")
    helpers.check_chunks(ids, [TINY.n_positions - 1], w, "bfloat16 activations, 63 rows")
    rows = g.prefill(ids, w, g.ModelCache(TINY), logits="all")
    refs = oracle.recompute_all_logits(ids, w)
    assert all(oracle.agreement(row, ref, w)[0] for row, ref in zip(rows, refs))
    caches = [g.ModelCache(TINY) for _ in range(3)]
    batch = g.prefill_batch([ids[:3], ids[:30], ids[:1]], w, caches)
    for logits, n in zip(batch, (3, 30, 1)):
        helpers.assert_matches_oracle(logits, ids[:n], w, "bfloat16 activations, batch", ref=refs[n - 1])
    steps = g.decode_batch([int(ids[3]), int(ids[30]), int(ids[1])], w, caches)
    for logits, n in zip(steps, (4, 31, 2)):
        helpers.assert_matches_oracle(logits, ids[:n], w, "bfloat16 activations, decode_batch", ref=refs[n - 1])


def test_rounded_inputs_are_what_the_oracle_models(tiny):
    """The oracle without the rounding is further from the engine than the tolerance on GPT-2 small's width
    scaled down: the rounding is there, and not twice (bfloat16 weights' own logits differ too)."""
    w = bf16(tiny)
    ids = np.random.default_rng(1).integers(0, TINY.vocab_size, 30)
    logits = g.prefill(ids, w, g.ModelCache(TINY))
    modelled = oracle.recompute_logits(ids, w)
    unrounded = oracle.recompute_logits(ids, w.astype("bfloat16", activations="float32"))
    assert np.abs(logits - modelled).max() < np.abs(logits - unrounded).max() / 3


def test_scores_match_the_oracle(tiny):
    w = bf16(tiny)
    ids = np.random.default_rng(2).integers(0, TINY.vocab_size, 50)
    s = g.score(ids, w)
    logp = oracle.recompute_all_logits(ids, w)
    logp = logp - logp.max(axis=1, keepdims=True)
    logp = (logp - np.log(np.exp(logp).sum(axis=1, keepdims=True)))[np.arange(len(ids) - 1), ids[1:]]
    np.testing.assert_allclose(s.logprobs, logp, atol=oracle.ATOL_BFLOAT16_INPUTS)


def test_float32_activations_are_the_default_and_unchanged(tiny):
    """bfloat16 weights take float32 inputs unless asked: the same object, the same logits as before."""
    wb = tiny.astype("bfloat16")
    assert wb.activations == "float32" and wb.astype("bfloat16", activations="float32") is wb
    ids = [5, 9, 100, 3]
    helpers.assert_matches_oracle(g.prefill(ids, wb, g.ModelCache(TINY)), ids, wb, "bfloat16")
    assert oracle.tolerance(wb) == oracle.ATOL


def test_weights_carry_their_activations(tiny, tmp_path):
    w = bf16(tiny)
    assert (w.dtype, w.activations) == ("bfloat16", "bfloat16")
    assert w.astype("bfloat16") is w  # kept while the storage allows it
    assert w.astype("int8").activations == "float32" and w.dequantized().activations == "float32"
    assert pickle.loads(pickle.dumps(w)).activations == "bfloat16"
    write_dir(tiny, tmp_path)
    loaded = g.load_weights(tmp_path, dtype="bfloat16", activations="bfloat16")
    assert loaded.activations == "bfloat16"
    np.testing.assert_array_equal(loaded.c_fc_w, w.c_fc_w)


@pytest.mark.parametrize("dtype", ["float32", "int8", "int4"])
def test_bfloat16_activations_need_bfloat16_weights(tiny, tmp_path, dtype):
    with pytest.raises(ConfigError, match=f"activations='bfloat16' needs bfloat16 weights.*{dtype}"):
        tiny.astype(dtype, activations="bfloat16")
    with pytest.raises(ConfigError, match="needs bfloat16 weights"):
        g.load_weights(tmp_path, dtype=dtype, activations="bfloat16")  # before the file is looked for
    with pytest.raises(ConfigError, match="activations must be one of float32, bfloat16, got 'float16'"):
        tiny.astype("bfloat16", activations="float16")


# The widened path on a CPU that has vdpbf16ps: the kernels compiled without AVX512_BF16 in a process of their own
# (Numba caches them apart, by the features), the same products to float32's rounding.
_WIDENED = """
import json, sys
import numpy as np
from gpt2numba.cpu import dispatch, matkernels, paneltiles
x, w, b = (np.load(sys.argv[1])[k] for k in ("x", "w", "b"))
out = np.zeros((x.shape[0], w.shape[0]), np.float32)
matkernels._rows_product(w, x, b, out, False, 3)
np.save(sys.argv[2], out)
json.dump({"bf16_dot": dispatch.BF16_DOT}, sys.stdout)
"""


@pytest.mark.skipif(not dispatch.BF16_DOT, reason="this CPU has no AVX512_BF16: the widened path is the one that runs")
def test_the_widened_path_gives_the_same_products(tmp_path):
    rng = np.random.default_rng(3)
    x, w, b = rounded(helpers.randn(rng, 9, 200)), rounded(helpers.randn(rng, 70, 200)), helpers.randn(rng, 70)
    np.savez(tmp_path / "in.npz", x=x, w=w, b=b)
    features = ",".join(f"+{f}" if f != "avx512bf16" else "-avx512bf16" for f in sorted(dispatch.FEATURES))
    done = subprocess.run([sys.executable, "-c", _WIDENED, str(tmp_path / "in.npz"), str(tmp_path / "out.npy")],
                          capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT, "NUMBA_CPU_FEATURES": features})
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout) == {"bf16_dot": False}
    out = np.zeros((9, 70), np.float32)
    matkernels._rows_product(w, x, b, out, False, 3)
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), out, rtol=2e-6, atol=2e-6)

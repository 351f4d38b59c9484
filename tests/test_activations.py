"""bfloat16 activations: every matrix product's inputs rounded to bfloat16 once (attention's too), multiplied by
vdpbf16ps where the CPU has it (rowtiles, paneltiles), else widened; the rounding against ml_dtypes', the kernels
against float64 products of the rounded values, the model against the oracle that rounds the same inputs, and the
paths the CPU does not take."""

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


@pytest.mark.skipif(not dispatch.BF16_DOT, reason="this CPU has no AVX512_BF16: no panels")
@given(V=st.integers(1, 100), C=st.integers(1, 120), R=st.integers(1, 70), seed=st.integers(0, 2**32 - 1))
def test_panels_of_a_matrix_given_by_columns(V, C, R, seed):
    """paneltiles._panels with W given as W.T (C, V) (attention's values): rows 2h and 2h + 1 interleaved, whole
    panels and the last one's zeros; C odd too, X's input past it then multiplied by the zero packed there."""
    rng = np.random.default_rng(seed)
    w, x = rounded(helpers.randn(rng, V, C)), rounded(helpers.randn(rng, R, C + C % 2))
    wide = lambda a: compact.from_bfloat16(a).astype(np.float64)  # noqa: E731
    out = np.zeros((R, V), np.float32)
    paneltiles._panels(np.ascontiguousarray(w.T), x, None, out, False, 0, V, paneltiles._panel_buffers(x.shape[1]),
                       True)
    np.testing.assert_allclose(out, wide(x[:, :C]) @ wide(w).T, atol=1e-4, rtol=1e-4)


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


def assert_modelled(logits, modelled, other):
    """The engine's logits agree with the oracle that models them better than with ``other`` by far: the medians
    over the cases of the largest differences, 10x apart. (A value the engine rounds on one side of a bfloat16
    tie and the oracle on the other moves a case's logits by up to 7e-4 on TINY, against 5e-8 without one; a
    median over five or more cases is a typical case.)"""
    worst = lambda refs: np.median([np.abs(a - b).max() for a, b in zip(logits, refs)])  # noqa: E731
    assert worst(modelled) < worst(other) / 10, (worst(modelled), worst(other))


def test_rounded_inputs_are_what_the_oracle_models(tiny):
    """The oracle without the rounding is further from the engine than the tolerance on GPT-2 small's width
    scaled down: the rounding is there, and not twice (bfloat16 weights' own logits differ too)."""
    w = bf16(tiny)
    prompts = [np.random.default_rng(seed).integers(0, TINY.vocab_size, 30) for seed in range(5)]
    logits = [g.prefill(ids, w, g.ModelCache(TINY)) for ids in prompts]
    unrounded = w.astype("bfloat16", activations="float32")
    assert_modelled(logits, [oracle.recompute_logits(ids, w) for ids in prompts],
                    [oracle.recompute_logits(ids, unrounded) for ids in prompts])


def test_attention_rounds_as_the_oracle_models(tiny, monkeypatch):
    """Attention's inputs (queries, keys, values, softmax weights) are rounded too: the oracle that rounds only
    the blocks' products is further from the engine. Over a prefill (tiles of queries: vdpbf16ps on
    AVX512_BF16) and a decode step (one query: float32 loops), on seven prompts."""
    w = bf16(tiny)
    prompts = [np.random.default_rng(seed).integers(0, TINY.vocab_size, 31) for seed in range(7)]
    logits = []
    for ids in prompts:
        mc = g.ModelCache(TINY)
        g.prefill(ids[:30], w, mc)
        logits.append(g.decode_step(int(ids[30]), w, mc))
    modelled = [oracle.recompute_logits(ids, w) for ids in prompts]
    real = oracle.attention
    monkeypatch.setattr(oracle, "attention", lambda q, k, v, inputs=None: real(q, k, v))
    assert_modelled(logits, modelled, [oracle.recompute_logits(ids, w) for ids in prompts])


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


# The paths of a CPU without AVX512_BF16, on one that has vdpbf16ps: the kernels compiled without it in a process of
# their own (Numba caches them apart, by the features); the same products to float32's rounding.
_WIDENED = """
import json, sys
import numpy as np
from gpt2numba.cpu import dispatch, matkernels
x, w, b = (np.load(sys.argv[1])[k] for k in ("x", "w", "b"))
out = np.zeros((x.shape[0], w.shape[0]), np.float32)
matkernels._rows_product(w, x, b, out, False, 3)
np.save(sys.argv[2], out)
json.dump({"bf16_dot": dispatch.BF16_DOT}, sys.stdout)
"""

_MODEL = """
import json, sys
import numpy as np
import gpt2numba as g
from gpt2numba.cpu import dispatch
w = g.load_weights(sys.argv[1], dtype="bfloat16", activations="bfloat16")
logits = []
for ids in np.load(sys.argv[2]):  # a prefill of all but the last id, then a decode step of it
    mc = g.ModelCache(w.config)
    logits += [g.prefill(ids[:-1], w, mc), g.decode_step(int(ids[-1]), w, mc)]
np.save(sys.argv[3], np.stack(logits))
json.dump({"bf16_dot": dispatch.BF16_DOT}, sys.stdout)
"""


def without_bf16(script, *args):
    """Run ``script`` with ``args`` in a process whose kernels Numba compiles for this CPU less AVX512_BF16."""
    features = ",".join(f"+{f}" if f != "avx512bf16" else "-avx512bf16" for f in sorted(dispatch.FEATURES))
    done = subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True,
                          timeout=600, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT, "NUMBA_CPU_FEATURES": features})
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout) == {"bf16_dot": False}


@pytest.mark.skipif(not dispatch.BF16_DOT, reason="this CPU has no AVX512_BF16: the widened path is the one that runs")
def test_the_widened_path_gives_the_same_products(tmp_path):
    rng = np.random.default_rng(3)
    x, w, b = rounded(helpers.randn(rng, 9, 200)), rounded(helpers.randn(rng, 70, 200)), helpers.randn(rng, 70)
    np.savez(tmp_path / "in.npz", x=x, w=w, b=b)
    without_bf16(_WIDENED, tmp_path / "in.npz", tmp_path / "out.npy")
    out = np.zeros((9, 70), np.float32)
    matkernels._rows_product(w, x, b, out, False, 3)
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), out, rtol=2e-6, atol=2e-6)


@pytest.mark.skipif(not dispatch.BF16_DOT, reason="this CPU has no AVX512_BF16: the widened path is the one that runs")
def test_the_model_without_avx512bf16(tiny, tmp_path, monkeypatch):
    """Prefills (BLAS over the rounded values for the blocks' products and attention's tiles; no vdpbf16ps
    compiled at all) and decode steps on seven prompts: within the oracle's tolerance, and the oracle that
    rounds attention's inputs far closer than the one that does not (assert_modelled), as in this process."""
    write_dir(tiny, tmp_path)
    prompts = np.random.default_rng(0).integers(0, TINY.vocab_size, (7, 31))
    np.save(tmp_path / "ids.npy", prompts)
    without_bf16(_MODEL, tmp_path, tmp_path / "ids.npy", tmp_path / "logits.npy")
    w, there = bf16(tiny), np.load(tmp_path / "logits.npy")
    modelled = [oracle.recompute_logits(ids[:n], w) for ids in prompts for n in (30, 31)]
    assert all(oracle.agreement(logits, ref, w)[0] for logits, ref in zip(there, modelled))
    real = oracle.attention
    monkeypatch.setattr(oracle, "attention", lambda q, k, v, inputs=None: real(q, k, v))
    assert_modelled(there[1::2], modelled[1::2], [oracle.recompute_logits(ids, w) for ids in prompts])

"""Checks shared by the property tests and the mutant tests that prove they can fail."""

import numpy as np

import gpt2numba as g
from conftest import record_diff

ATOL, RTOL = 1e-3, 1e-2


def randn(rng, *shape, scale=1.0):
    """A float32 array of ``shape``, normal with standard deviation ``scale``."""
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def assert_matches_oracle(logits, ids, w, label):
    """Cached logits against recompute_logits over the whole sequence ``ids``."""
    ref = g.recompute_logits(ids, w)
    assert logits.dtype == np.float32 and logits.shape == (w.config.vocab_size,)
    diff = float(np.abs(logits - ref).max())
    record_diff(f"{label}, {len(ids)} tokens", diff)
    assert np.allclose(logits, ref, atol=ATOL, rtol=RTOL), f"max |diff| {diff:.3g} at {len(ids)} tokens"
    assert logits.argmax() == ref.argmax(), f"argmax {logits.argmax()} != oracle's {ref.argmax()}"


def check_prefill(ids, w, label):
    """Fresh cache, prefill ``ids``: exactly len(ids) rows per layer, logits equal the oracle."""
    T = len(ids)
    mc = g.ModelCache(w.config, max_len=min(w.config.n_positions, T + 8))
    mc.k[...] = 7.0  # a sentinel: any row written past T shows
    mc.v[...] = 7.0
    logits = g.prefill(ids, w, mc)
    cfg = w.config
    assert mc.length == T
    assert (mc.lengths == T).all(), f"per-layer lengths {mc.lengths}, expected {T}"
    assert mc.keys().shape == mc.values().shape == (cfg.n_layer, cfg.n_head, T, cfg.head_dim)
    assert (mc.k[:, :, T:] == 7.0).all() and (mc.v[:, :, T:] == 7.0).all(), "rows beyond T were written"
    assert not (mc.keys() == 7.0).all(axis=-1).any(), "a row below T was not written"
    assert_matches_oracle(logits, ids, w, label)


def check_chunks(ids, cuts, w, label):
    """Prefill ids[:cuts[0]], then chunks (decode_step for one-token chunks): oracle at every step."""
    mc = g.ModelCache(w.config)
    bounds = [0, *cuts, len(ids)]
    for lo, hi in zip(bounds, bounds[1:]):
        assert mc.length == lo
        if hi - lo == 1 and lo > 0:
            logits = g.decode_step(int(ids[lo]), w, mc)
        else:
            logits = g.prefill(ids[lo:hi], w, mc)
        assert mc.length == hi and (mc.lengths == hi).all()
        assert_matches_oracle(logits, ids[:hi], w, label)

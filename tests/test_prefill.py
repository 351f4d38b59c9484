"""Properties of prefill and decode_step against the float64 oracle.

Each property names the bug it catches; tests/test_mutants.py plants those bugs
and checks that these very checks fail on them.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpt2numba as g
from conftest import TINY
from helpers import assert_matches_oracle, check_chunks, check_prefill


def prompts(vocab_size, max_len):
    """Token ids across the whole vocabulary, always able to hit 0 and vocab-1."""
    ids = st.one_of(st.integers(0, vocab_size - 1), st.sampled_from([0, vocab_size - 1]))
    return st.lists(ids, min_size=1, max_size=max_len).map(lambda x: np.array(x, np.int64))


@given(ids=prompts(TINY.vocab_size, TINY.n_positions))
def test_prefill_tiny(tiny, ids):
    """Fills exactly T rows per layer and matches the oracle.

    Catches: an off-by-one in wpe, a mask that leaks the next position, a
    transposed Conv1D weight, a layer that skips its cache write, a write past T.
    """
    check_prefill(ids, tiny, "tiny")


@given(ids=prompts(50257, 96))
@settings(max_examples=4)
def test_prefill_gpt2_small_shapes(small, ids):
    """The same property on GPT-2 small's real shapes (vocab 50257, 12 x 12 x 768)."""
    check_prefill(ids, small, "small")


@given(data=st.data())
def test_chunked_prefill_and_decode_tiny(tiny, data):
    """Prefix prefill, then chunks and decode steps: the oracle's logits at every step.

    Catches: chunks that restart positions at 0, a decode step that reads one
    position too few or writes its row at the wrong place.
    """
    ids = data.draw(prompts(TINY.vocab_size, TINY.n_positions).filter(lambda x: len(x) >= 2))
    cuts = data.draw(st.lists(st.integers(1, len(ids) - 1), unique=True, max_size=6).map(sorted))
    check_chunks(ids, cuts, tiny, "tiny chunks")


@given(data=st.data())
@settings(max_examples=3)
def test_chunked_prefill_and_decode_gpt2_small(small, data):
    ids = data.draw(prompts(50257, 48).filter(lambda x: len(x) >= 2))
    cuts = data.draw(st.lists(st.integers(1, len(ids) - 1), unique=True, max_size=4).map(sorted))
    check_chunks(ids, cuts, small, "small chunks")


def test_decode_after_prefill_uses_position_T(tiny, rng):
    """After prefill of T tokens the next decode step is position T: its row and its logits."""
    ids = rng.integers(0, TINY.vocab_size, 10)
    mc = g.ModelCache(TINY)
    g.prefill(ids, tiny, mc)
    before = mc.k.copy()
    logits = g.decode_step(42, tiny, mc)
    assert mc.length == 11 and (mc.lengths == 11).all()
    changed_rows = np.flatnonzero((mc.k.view(np.uint32) != before.view(np.uint32)).any(axis=(0, 1, 3)))  # (bits: unwritten rows may hold nan)
    assert changed_rows.tolist() == [10]
    assert_matches_oracle(logits, [*ids, 42], tiny, "tiny decode")


@pytest.mark.slow
def test_full_context_gpt2_small(small, rng):
    """A prompt that fills all 1024 positions, then the cache refuses one more token."""
    ids = rng.integers(0, 50257, 1024)
    exact = check_prefill(ids, small, "small full context")
    mc = g.ModelCache(small.config, max_len=1024)
    g.prefill(ids[:1000], small, mc)
    for t in ids[1000:]:
        logits = g.decode_step(int(t), small, mc)
    assert mc.length == 1024
    assert_matches_oracle(logits, ids, small, "small full context, decoded tail", ref=exact)
    with pytest.raises(g.CacheFullError):
        g.decode_step(0, small, mc)


@pytest.mark.slow
def test_gpt2_medium(rng):
    """GPT-2 medium's shapes (24 layers, 16 heads, 1024 wide): prefill then decode."""
    w = g.random_weights(g.GPT2Config.medium(), seed=3)
    ids = rng.integers(0, 50257, 40)
    check_chunks(ids, [32, 33, 36], w, "medium")


def test_embed_token(tiny):
    x = g.embed_token(5, 3, tiny)
    assert x.dtype == np.float32 and x.shape == (TINY.n_embd,)
    np.testing.assert_array_equal(x, tiny.wte[5] + tiny.wpe[3])


def test_run_prefill_uses_default_weights(monkeypatch, tmp_path):
    """run_prefill: GPT-2 small random weights by default, $GPT2NUMBA_WEIGHTS when set."""
    monkeypatch.delenv("GPT2NUMBA_WEIGHTS", raising=False)
    w = g.default_weights()
    assert w.config == g.GPT2Config.small() and g.default_weights() is w  # built once
    ids = [46, 206, 75]  # valid in both vocabularies
    np.testing.assert_array_equal(g.run_prefill(ids), g.prefill(ids, w, g.ModelCache(w.config)))

    other = g.random_weights(TINY, seed=9)
    g.save_weights(other, tmp_path)
    monkeypatch.setenv("GPT2NUMBA_WEIGHTS", str(tmp_path))
    assert_matches_oracle(g.run_prefill(ids), ids, other, "run_prefill from $GPT2NUMBA_WEIGHTS")

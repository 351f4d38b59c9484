"""Scoring: every position's log-probability against the float64 oracle, sliding windows against the HF loop.

Each property names the bug it catches; tests/test_mutants.py plants those bugs
and checks that these very checks fail on them.
"""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings

import gpt2numba as g
import helpers
from conftest import TINY, TINY_GPT2
from gpt2numba.model import compact, oracle
from test_prefill import prompts


def log_softmax(z):
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def check_score(ids, w, label, record=True):
    """score() of a sequence within the context equals the oracle's log-softmax at every position.

    Catches: scoring ids[i] from the logits after ids[i] (an off-by-one), a log-softmax that loses
    its maximum (overflow on large logits), a wrong argmax.
    """
    s = g.score(ids, w)
    ref = log_softmax(g.recompute_all_logits(ids, w))[:-1]  # (T - 1, V): position i predicts ids[i + 1]
    expected = ref[np.arange(len(ids) - 1), ids[1:]]
    assert s.logprobs.dtype == np.float64 and s.logprobs.shape == (len(ids) - 1,)
    diff = float(np.abs(s.logprobs - expected).max()) if len(ids) > 1 else 0.0
    if record:  # (logits in the hundreds differ from float64 in absolute terms, as float32 does)
        helpers.record_diff(f"{label} log-probabilities, {len(ids)} tokens", diff)
    atol = oracle.tolerance(w) if oracle.rounds_inputs(w) else 1e-4  # rounded inputs: see oracle.tolerance
    np.testing.assert_allclose(s.logprobs, expected, atol=atol, rtol=1e-6)  # rtol: float32 logits in the hundreds
    np.testing.assert_array_equal(s.greedy, ref.argmax(axis=1) == ids[1:])
    assert s.n_tokens == len(ids) - 1 and s.nll == pytest.approx(-expected.sum(), abs=1e-3)
    return s


def hf_guide_reference(ids, w, stride):
    """Hugging Face's "Perplexity of fixed-length models" loop, on the oracle: log p per token, nan if unscored."""
    n, L = w.config.n_positions, len(ids)
    logprobs, prev_end = np.full(L - 1, np.nan), 0
    for begin in range(0, L, stride):
        end = min(begin + n, L)
        trg_len = end - prev_end  # the labels before end - trg_len are -100
        window = log_softmax(g.recompute_all_logits(ids[begin:end], w))
        for j in range(end - trg_len, end):
            if j == begin:
                continue  # the shift: a window's first token has no logits before it
            assert np.isnan(logprobs[j - 1]), f"token {j} scored twice"
            logprobs[j - 1] = window[j - begin - 1, ids[j]]
        prev_end = end
        if end == L:
            break
    return logprobs


def check_windows(ids, w, stride):
    s = g.score(ids, w, stride=stride)
    ref = hf_guide_reference(ids, w, stride)
    np.testing.assert_array_equal(np.isnan(s.logprobs), np.isnan(ref))
    np.testing.assert_allclose(s.logprobs, ref, atol=1e-4, rtol=0)
    assert s.n_tokens == np.isfinite(ref).sum()
    return s


@given(ids=prompts(TINY.vocab_size, TINY.n_positions))
def test_score_tiny(tiny, ids):
    check_score(ids, tiny, "tiny")


@given(ids=prompts(50257, 24))
@settings(max_examples=2)
def test_score_gpt2_small_shapes(small, ids):
    check_score(ids, small, "small")


@pytest.mark.parametrize("dtype", ["bfloat16", "int8", "int4"])
def test_score_compact(tiny, rng, dtype):
    check_score(rng.integers(0, TINY.vocab_size, 30), tiny.astype(dtype), dtype)


@pytest.mark.parametrize("dtype", compact.INTEGER)
def test_integer_scores_are_the_logits_heads(rng, dtype):
    """The integer formats' scoring head multiplies as their logits head does (the integer tiles, wte as
    stored): each log-probability is the log-softmax of prefill's own logits, to float32's rounding.

    Catches: a vocabulary chunk of the head read at the wrong rows or cut short (GPT-2's 50257 ids end
    in a part chunk), a chunk's outputs written to the wrong columns."""
    w = g.random_weights(TINY_GPT2, seed=4).astype(dtype)
    ids = rng.integers(0, TINY_GPT2.vocab_size, 40)
    logits = g.prefill(ids, w, g.ModelCache(TINY_GPT2), logits="all").astype(np.float64)
    ref = log_softmax(logits)[np.arange(len(ids) - 1), ids[1:]]
    s = g.score(ids, w)
    np.testing.assert_allclose(s.logprobs, ref, atol=1e-6, rtol=0)
    np.testing.assert_array_equal(s.greedy, logits[:-1].argmax(axis=1) == ids[1:])


def test_score_large_logits(tiny, rng):
    """Logits in the hundreds: exp overflows float32 unless the running maximum is taken out."""
    w = dataclasses.replace(tiny, ln_f_g=tiny.ln_f_g * 500)  # the head's input, and so every logit, x 500
    s = check_score(rng.integers(0, TINY.vocab_size, 20), w, "large logits", record=False)
    assert np.isfinite(s.logprobs).all() and s.logprobs.min() < -100


@pytest.mark.parametrize("stride", [1, 7, 32, 63, 64])
def test_sliding_windows_follow_the_hf_guide(tiny, rng, stride):
    """3 x n_positions tokens: the same log-probabilities and the same tokens scored as the guide's loop.
    Every token but the first is scored once, except, with stride == n_positions, the windows' first tokens."""
    ids = rng.integers(0, TINY.vocab_size, 3 * TINY.n_positions)
    s = check_windows(ids, tiny, stride)
    unscored = 0 if stride < TINY.n_positions else 2  # tokens 64 and 128 start a window
    assert s.n_tokens == len(ids) - 1 - unscored


def test_perplexity_averages_over_the_scored_tokens_only(tiny, rng):
    """stride == n_positions: tokens 64 and 128 start a window and are not scored (nan). nll sums the 189
    scored tokens' -log p and perplexity is exp(nll / 189), against the guide's loop. Catches: dividing
    by every position (191), nan summed into nll, n_tokens counting the nan."""
    ids = rng.integers(0, TINY.vocab_size, 3 * TINY.n_positions)
    s = g.score(ids, tiny, stride=TINY.n_positions)
    scored = hf_guide_reference(ids, tiny, TINY.n_positions)
    scored = scored[np.isfinite(scored)]
    assert len(scored) == len(ids) - 3 and s.n_tokens == len(scored)
    assert s.nll == pytest.approx(-scored.sum(), abs=1e-3)
    assert s.perplexity == pytest.approx(np.exp(-scored.mean()), rel=1e-5)
    by_hand = g.Score(np.array([-1.0, np.nan, -2.0, -3.0, np.nan]), np.zeros(5, bool))  # 3 scored: 6 nats
    assert (by_hand.n_tokens, by_hand.nll, by_hand.perplexity) == (3, 6.0, pytest.approx(np.exp(2.0)))


def test_windows_end_where_the_sequence_ends(tiny, rng):
    """A length that no stride divides: the last window is shorter."""
    check_windows(rng.integers(0, TINY.vocab_size, 2 * TINY.n_positions + 5), tiny, 24)


@given(ids=prompts(TINY.vocab_size, TINY.n_positions))
def test_prefill_all_logits(tiny, ids):
    """logits="all": the oracle's logits after every position; the last row is what "last" returns."""
    mc = g.ModelCache(TINY)
    rows = g.prefill(ids, tiny, mc, logits="all")
    ref = g.recompute_all_logits(ids, tiny)
    assert rows.shape == ref.shape == (len(ids), TINY.vocab_size) and rows.dtype == np.float32
    np.testing.assert_allclose(rows, ref, atol=1e-3, rtol=1e-2)
    assert (rows.argmax(axis=1) == ref.argmax(axis=1)).all()
    np.testing.assert_allclose(rows[-1], g.prefill(ids, tiny, g.ModelCache(TINY)), atol=1e-5, rtol=0)  # other kernels: rounding
    assert mc.length == len(ids)


def test_score_batch_equals_score_one_by_one(tiny, rng):
    docs = [rng.integers(0, TINY.vocab_size, n) for n in (1, 0, 5, 64, 30, 150, 2)]
    batch = g.score_batch(docs, tiny, batch_rows=70)  # several passes, each of a few documents
    for ids, s in zip(docs, batch):
        alone = g.score(ids, tiny)
        np.testing.assert_allclose(s.logprobs, alone.logprobs, atol=1e-5, rtol=0)
        np.testing.assert_array_equal(s.greedy, alone.greedy)


def test_score_text_and_perplexity():
    w = g.default_weights()
    tok = g.load_tokenizer()
    text = "The quick brown fox jumps over the lazy dog."
    s = g.score_text(text, w)
    assert s.n_tokens == len(tok.encode(text)) - 1
    assert g.perplexity(text, w) == pytest.approx(np.exp(s.nll / s.n_tokens))


def test_empty_and_one_token_scores(tiny):
    for ids in ([], [5], np.zeros(0, np.int64)):
        s = g.score(ids, tiny)
        assert s.n_tokens == 0 and s.nll == 0.0 and np.isnan(s.perplexity) and s.logprobs.shape == (0,)


@pytest.mark.parametrize("call, error, match", [
    (lambda w: g.score([1, 2], w, stride=0), g.ConfigError, r"stride must be an integer in \[1, 64\]"),
    (lambda w: g.score([1, 2], w, stride=65), g.ConfigError, "got 65"),
    (lambda w: g.score([1, 2], w, stride=2.0), g.ConfigError, "stride"),
    (lambda w: g.score([1, 512], w), g.TokenError, "sequence 0: .*512 is outside"),
    (lambda w: g.score([1, 2.5], w), g.TokenTypeError, "sequence 0: "),
    (lambda w: g.score_batch([[1], [-1]], w), g.TokenError, "sequence 1: "),
    (lambda w: g.score_batch("text", w), g.BatchError, "sequences must be"),
    (lambda w: g.score_text(b"bytes", w), g.TokenTypeError, "str"),
    (lambda w: g.score_text("text", w, tokenizer="gpt2"), g.ConfigError, "tokenizer must be a Tokenizer"),
    (lambda w: g.score_batch([np.zeros((0, 3), np.int64)], w), g.TokenError, "sequence 0: .*1-D"),
    (lambda w: g.score_batch(5, w), g.BatchError, "sequences must be a sequence"),
    (lambda w: g.score([1], None), g.ConfigError, "GPT2Weights"),
])
def test_bad_score_arguments(tiny, call, error, match):
    with pytest.raises(error, match=match):
        call(tiny)

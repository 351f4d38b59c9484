"""Sampling and generation: greedy equals the oracle, top-k/top-p stay in their sets, seeds repeat."""

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import gpt2numba as g
from conftest import TINY, TINY_GPT2

logit_vectors = st.lists(st.floats(-20, 20, width=32), min_size=2, max_size=60, unique_by=lambda v: v + 0.0).map(  # distinct float32 logits (0.0 == -0.0)
    lambda x: np.array(x, np.float32))


def test_greedy_follows_the_oracle(tiny):
    """Temperature 0: every token is the argmax of the oracle's logits for the sequence so far."""
    prompt = [5, 77, 300]
    tokens = list(g.generate(prompt, tiny, max_new_tokens=12, temperature=0, stop_at_eos=False))
    assert len(tokens) == 12
    seq = list(prompt)
    for token in tokens:
        assert token == int(np.argmax(g.recompute_logits(seq, tiny)))
        seq.append(token)


# float32 logits with many ties (a few distinct values), and values that the temperature's rounding merges
tied_logit_vectors = st.lists(st.sampled_from([-2.0, 0.0, 1e-45, 0.5, 1.0, 1.0 + 2**-23, 3.0]), min_size=2,
                              max_size=30).map(lambda x: np.array(x, np.float32))


def k_best(z, k):
    """top_k's set: the k largest logits as given, equal ones ranked by id (the lower first)."""
    return set(np.argsort(-z.astype(np.float64), kind="stable")[:k].tolist())


@given(z=logit_vectors | tied_logit_vectors, k=st.integers(1, 10), seed=st.integers(0, 2**32 - 1))
@example(z=np.array([0, 1, 1e-45], np.float32), k=2, seed=0)  # (0 - 1) / 1.5 == (1e-45 - 1) / 1.5 in float64
def test_top_k_stays_in_the_k_best(z, k, seed):
    """Catches ranking after the temperature: its rounding ties 0 and 1e-45, and then id 0 wins. (A tie at
    the k-th place kept by np.argpartition's whim is left to the next test: examples here seldom show it.)"""
    best = k_best(z, k)
    sampler = g.Sampler(temperature=1.5, top_k=k)
    rng = np.random.default_rng(seed)
    assert all(sampler(z, [], rng) in best for _ in range(20))


def test_top_k_ties_keep_the_lower_ids():
    """One best logit and 18 equal ones, k = 3: ids 18, 0 and 1 (np.argpartition alone would keep 0 and 2)."""
    z = np.zeros(19, np.float32)
    z[18] = 1.0
    rng = np.random.default_rng(0)
    counts = np.bincount([g.Sampler(top_k=3)(z, [], rng) for _ in range(500)], minlength=19)
    assert set(np.flatnonzero(counts).tolist()) == {0, 1, 18}, counts


@given(z=logit_vectors, p=st.floats(0.01, 1.0), seed=st.integers(0, 2**32 - 1))
def test_top_p_stays_in_the_smallest_set_reaching_p(z, p, seed):
    probs = np.exp(z.astype(np.float64) - z.max())
    probs /= probs.sum()
    order = np.argsort(-probs)
    mass = np.cumsum(probs[order])
    n = int(np.argmax(mass >= p * (1 - 1e-9))) + 1  # smallest prefix reaching p
    # a token tied (to rounding) with the last one kept may stand in for it
    allowed = set(np.flatnonzero(probs >= probs[order[n - 1]] * (1 - 1e-9)).tolist())
    sampler = g.Sampler(top_p=p)
    rng = np.random.default_rng(seed)
    assert all(sampler(z, [], rng) in allowed for _ in range(20))


def test_sampling_follows_the_distribution():
    z = np.log(np.array([0.5, 0.3, 0.2], np.float32))
    rng = np.random.default_rng(0)
    counts = np.bincount([g.Sampler()(z, [], rng) for _ in range(4000)], minlength=3) / 4000
    np.testing.assert_allclose(counts, [0.5, 0.3, 0.2], atol=0.03)


# Empirical sampling: DRAWS tokens from a small logits vector against the distribution worked out by hand.
# With 8,000 draws a chi-square test tells apart distributions about 0.03 apart in total variation; the
# mistakes below (a temperature ignored, applied twice, or before the cut it should follow) are 0.05 to 0.3 apart.
DRAWS = 8_000
Z = np.log(np.array([0.4, 0.3, 0.2, 0.1], np.float32))


def draw(sampler, z, previous=(), n=DRAWS, seed=0):
    """How often each id comes out in n draws with one seeded stream."""
    rng = np.random.default_rng(seed)
    return np.bincount([sampler(z, list(previous), rng) for _ in range(n)], minlength=len(z))


def assert_follows(counts, expected):
    """No draw where the expected probability is 0; elsewhere a chi-square test's p-value above 1e-4."""
    from scipy.stats import chisquare

    expected = np.asarray(expected, np.float64)
    assert counts[expected == 0].sum() == 0, (counts, expected)
    support = expected > 0
    if support.sum() > 1:
        pvalue = chisquare(counts[support], counts.sum() * expected[support] / expected[support].sum()).pvalue
        assert pvalue > 1e-4, (counts / counts.sum(), expected)


def softmax(z):
    e = np.exp(np.asarray(z, np.float64) - np.max(z))
    return e / e.sum()


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_sampling_at_a_temperature_follows_softmax_of_z_over_t(temperature):
    """Catches: the temperature ignored, applied twice (z / T**2), or multiplied (z * T)."""
    assert_follows(draw(g.Sampler(temperature=temperature), Z), softmax(Z / temperature))


@pytest.mark.parametrize("temperature, top_p, kept", [
    (2.0, 0.65, 3),  # tempered: 0.325, 0.282, 0.230, 0.163 (sums 0.607, 0.837); untempered 0.4 + 0.3 reach 0.65
    (0.5, 0.5, 1),  # tempered: 0.533, 0.300, ...; untempered 0.4 alone does not reach 0.5
])
def test_top_p_cuts_the_tempered_distribution(temperature, top_p, kept):
    """The nucleus is taken from softmax(z / T), and what is kept follows softmax(z / T) renormalised.
    Catches: the nucleus taken before the temperature, the temperature applied twice."""
    probs = softmax(Z / temperature)
    assert (np.cumsum(probs)[kept - 1] >= top_p) and (kept == 1 or np.cumsum(probs)[kept - 2] < top_p)
    expected = np.where(np.arange(len(Z)) < kept, probs, 0.0)
    assert_follows(draw(g.Sampler(temperature=temperature, top_p=top_p), Z), expected)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_repetition_penalty_follows_the_penalised_distribution(temperature):
    """Ids 0 (logit 2) and 2 (logit -1) were seen, id 2 twice: 2 / 1.5 and -1 x 1.5, once each, then the
    temperature. Catches: a negative logit divided (made likelier), the penalty on every token, the penalty
    judged after the logits are shifted by their maximum (all <= 0, all multiplied)."""
    z = np.array([2.0, 1.0, -1.0, 0.5, -0.5], np.float32)
    penalised = np.array([2.0 / 1.5, 1.0, -1.5, 0.5, -0.5])
    sampler = g.Sampler(temperature=temperature, repetition_penalty=1.5)
    assert_follows(draw(sampler, z, previous=[2, 0, 2]), softmax(penalised / temperature))


def test_repetition_penalty():
    z = np.array([2.0, 1.9, -1.0, -1.1], np.float32)
    greedy = g.Sampler(temperature=0, repetition_penalty=1.2)
    assert greedy(z, [0], None) == 1  # 2.0 / 1.2 < 1.9
    assert greedy(z, [], None) == 0


@given(seed=st.integers(0, 2**32 - 1))
def test_same_seed_same_tokens(tiny, seed):
    run = lambda: list(g.generate([1, 2, 3], tiny, max_new_tokens=8, top_k=50, top_p=0.9, seed=seed))  # noqa: E731
    assert run() == run()


def test_stops_at_eos(tiny):
    """A bias that makes <|endoftext|> (id 50256 in GPT-2; the last id here) certain."""
    import dataclasses

    cfg = TINY_GPT2
    w = g.random_weights(cfg, seed=0)
    wte = w.wte.copy()
    wte[50256] = 10.0  # with ln_f's output all ones, its logit is 10 n_embd, the rest near 0
    w = dataclasses.replace(w, wte=wte, ln_f_g=np.zeros_like(w.ln_f_g), ln_f_b=np.ones_like(w.ln_f_b))
    assert list(g.generate([1], w, max_new_tokens=5, temperature=0)) == [50256]
    assert list(g.generate([1], w, max_new_tokens=5, temperature=0, stop_at_eos=False)) == [50256] * 5


def test_context_limit(tiny):
    n = TINY.n_positions
    with pytest.raises(g.CacheFullError, match=f"passes the model's context of {n}"):
        g.generate(list(range(n - 2)), tiny, max_new_tokens=3)
    tokens = list(g.generate(list(range(n - 2)), tiny, max_new_tokens=10, temperature=0, stop_at_eos=False,
                             slide=True))
    assert len(tokens) == 10
    # The cache fills after 3 new tokens (n + 1 ids, the last not yet fed); the slide keeps
    # the newest n // 2 of them at positions 0.., so every later token is greedy on that window.
    seq = list(range(n - 2)) + tokens
    kept_from = n + 1 - n // 2
    for end in range(n + 1, len(seq)):
        assert seq[end] == int(np.argmax(g.recompute_logits(seq[kept_from:end], tiny)))


@pytest.mark.parametrize("options, match", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=0), "top_k"), (dict(top_k=2.5), "top_k"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(max_new_tokens=-1), "max_new_tokens"), (dict(seed="x"), "seed"),
])
def test_bad_settings(tiny, options, match):
    options = {"max_new_tokens": 3, **options}
    with pytest.raises(g.SamplingError, match=match):
        g.generate([1, 2], tiny, **options)


def test_generate_text_streams_pieces(tiny):
    w = g.default_weights()
    pieces = list(g.generate_text("Hello world", w, max_new_tokens=10, seed=0, stop_at_eos=False))
    tok = g.load_tokenizer()
    tokens = list(g.generate(tok.encode("Hello world"), w, max_new_tokens=10, seed=0, stop_at_eos=False))
    assert "".join(pieces) == tok.decode(tokens)


def test_more_bad_generate_arguments(tiny):
    with pytest.raises(g.SamplingError, match="seed"):
        g.generate([1], tiny, max_new_tokens=2, seed=-1)
    with pytest.raises(g.ConfigError, match="cache"):
        g.generate([1], tiny, max_new_tokens=2, cache=5)
    with pytest.raises(g.TokenError, match="outside"):
        g.Sampler(repetition_penalty=1.2)(np.zeros(4), [7], None)


def test_tiny_temperature_is_still_the_argmax():
    z = np.array([5.0, 1.0, 4.0])
    rng = np.random.default_rng(0)
    assert all(g.Sampler(temperature=1e-310)(z, [], rng) == 0 for _ in range(10))


def test_slide_with_a_one_position_model():
    import dataclasses

    w = g.random_weights(dataclasses.replace(TINY, n_positions=1), seed=0)
    assert len(list(g.generate([1], w, max_new_tokens=3, temperature=0, stop_at_eos=False, slide=True))) == 3


def test_stream_decoder_flushes_a_cut_character():
    tok = g.load_tokenizer()
    decode = tok.stream_decoder()
    ids = tok.encode("🙂")
    assert len(ids) > 1 and decode(ids[0]) == "" and decode(None) == "\ufffd"

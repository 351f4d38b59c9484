"""Decoding strategies: the logits processors against plain loops, min_p and typical_p against their
distributions, and beam search against the float64 oracle (every hypothesis's score recomputed without a
cache) and against greedy generation. transformers' own generate on the same weights: test_decoding_hf.py."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import gpt2numba as g
from conftest import TINY
from gpt2numba.decoding.processors import Processors
from test_generate import assert_follows, draw, softmax

VOCAB = 12
ids_lists = st.lists(st.integers(0, VOCAB - 1), min_size=0, max_size=14)


def naive_bans(ids, n):
    """The tokens t for which ids + [t] ends with an n-gram found earlier in ids: a loop over every t."""
    return {t for t in range(VOCAB) for start in range(len(ids) - n + 1)
            if n and len(ids) + 1 >= n and ids[start:start + n] == (ids + [t])[len(ids) + 1 - n:]}


@given(ids=ids_lists, n=st.integers(1, 4))
def test_no_repeat_ngram_bans_what_a_loop_over_the_vocabulary_bans(ids, n):
    """Catches: the n-gram's tail taken one token off, the window one short, n = 1 left to the general case."""
    z = Processors(no_repeat_ngram_size=n)(np.zeros(VOCAB), ids, 0)
    assert set(np.flatnonzero(z == -np.inf).tolist()) == naive_bans(ids, n)


@given(ids=ids_lists, prompt_len=st.integers(0, 14), presence=st.floats(-2, 2), frequency=st.floats(-2, 2),
       repetition=st.floats(0.5, 2), seed=st.integers(0, 2**32 - 1))
def test_penalties_are_those_of_a_plain_loop(ids, prompt_len, presence, frequency, repetition, seed):
    """Repetition over the whole sequence (a negative score multiplied, a positive divided), then presence and
    frequency over the generated tokens only. Catches: the prompt counted by presence/frequency, a count
    replaced by 1, the repetition penalty applied once per occurrence."""
    prompt_len = min(prompt_len, len(ids))
    z = np.random.default_rng(seed).normal(size=VOCAB)
    expected = z.copy()
    for t in set(ids):
        expected[t] = expected[t] * repetition if expected[t] < 0 else expected[t] / repetition
    for t in set(ids[prompt_len:]):
        expected[t] -= ids[prompt_len:].count(t) * frequency + presence
    got = Processors(repetition_penalty=repetition, presence_penalty=presence,
                     frequency_penalty=frequency)(z.copy(), ids, prompt_len)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


@given(ids=ids_lists, words=st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=3), min_size=1,
                                     max_size=4), new=st.integers(0, 5), least=st.integers(0, 5))
def test_bad_words_and_min_new_tokens_ban_what_a_loop_bans(ids, words, new, least):
    """A word's last token is banned where its other tokens end the ids; a lone eos is never banned by
    bad_words_ids (transformers); eos is banned while fewer than min_new_tokens are new.
    Catches: a word matched anywhere in the ids, its last token banned always, min_new_tokens off by one."""
    eos = 3
    prompt_len = max(0, len(ids) - new)
    banned = {w[-1] for w in words if w != [eos] and (len(w) == 1 or ids[len(ids) - len(w) + 1:] == w[:-1])}
    if len(ids) - prompt_len < least:
        banned.add(eos)
    z = Processors(bad_words_ids=words, min_new_tokens=least, eos_token_id=eos)(np.zeros(VOCAB), ids, prompt_len)
    assert set(np.flatnonzero(z == -np.inf).tolist()) == banned


Z = np.log(np.array([0.35, 0.25, 0.2, 0.1, 0.06, 0.04], np.float32))


@pytest.mark.parametrize("min_p", [0.3, 0.5, 0.9])
def test_min_p_keeps_the_tokens_at_least_min_p_times_the_most_likely(min_p):
    """Catches: min_p taken as an absolute probability, or against the sum instead of the most likely."""
    probs = softmax(Z)
    assert_follows(draw(g.Sampler(min_p=min_p), Z), np.where(probs >= min_p * probs.max(), probs, 0.0))


@pytest.mark.parametrize("typical_p", [0.3, 0.6, 0.95])
def test_typical_p_keeps_the_tokens_nearest_the_entropy(typical_p):
    """transformers' locally typical set: by |surprise - entropy|, until the mass reaches typical_p, plus the
    one that crosses it. Catches: the set taken by probability (top_p), the crossing token left out."""
    probs = softmax(Z)
    entropy = -(probs * np.log(probs)).sum()
    order = np.argsort(np.abs(-np.log(probs) - entropy), kind="stable")
    last = min(int((np.cumsum(probs[order]) < typical_p).sum()), len(Z) - 1)
    kept = order[: last + 1]
    expected = np.zeros(len(Z))
    expected[kept] = probs[kept]
    assert_follows(draw(g.Sampler(typical_p=typical_p), Z), expected)


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_logit_bias_forces_and_bans(tiny, temperature):
    """+100 forces a token however unlikely; -100 on the greedy token moves greedy to the second best."""
    prompt = [5, 77, 300]
    logits = g.recompute_logits(prompt, tiny)
    rare, best, second = int(np.argmin(logits)), *np.argsort(-logits)[:2].tolist()
    forced = list(g.generate(prompt, tiny, max_new_tokens=6, temperature=temperature, seed=1,
                             logit_bias={rare: 100}, stop_at_eos=False))
    assert forced == [rare] * 6
    banned = next(g.generate(prompt, tiny, max_new_tokens=1, temperature=0, logit_bias={best: -100}))
    assert banned == second


def test_generation_never_repeats_an_ngram_nor_says_a_bad_word(tiny):
    """Sampling at a high temperature over 40 tokens, and beam search. Catches any processor skipped on a
    path (generate_batch's steps, beam search's rows)."""
    prompt, bad = [5, 77, 300, 5], [[9, 10], [11]]
    settings = dict(no_repeat_ngram_size=2, bad_words_ids=bad)
    runs = [prompt + [t for _, t in g.generate_batch([prompt], tiny, max_new_tokens=40, temperature=3.0, seed=s,
                                                      stop_at_eos=False, **settings)] for s in range(4)]
    runs += [prompt + h.ids for h in g.beam_search(prompt, tiny, num_beams=3, max_new_tokens=30,
                                                   num_return_sequences=3, **settings)]
    for ids in runs:
        bigrams = list(zip(ids, ids[1:]))
        assert len(bigrams) == len(set(bigrams)), ids
        generated = ids[len(prompt) - 1:]  # (a bad word may not end on the first new token either)
        assert 11 not in generated[1:] and (9, 10) not in set(zip(generated, generated[1:])), ids


@pytest.mark.parametrize("setting, value", [
    ("no_repeat_ngram_size", -1), ("min_new_tokens", 1.5), ("presence_penalty", 2.5), ("frequency_penalty", -3),
    ("logit_bias", {"7": 1}), ("logit_bias", {7: 101}), ("logit_bias", {TINY.vocab_size: 1}), ("min_p", 1.5),
    ("typical_p", 0), ("bad_words_ids", [[]]), ("bad_words_ids", [[TINY.vocab_size]]), ("bad_words_ids", [3]),
    ("eos_token_id", []), ("eos_token_id", [TINY.vocab_size]), ("eos_token_id", -1), ("no_such_setting", 1),
])
def test_a_bad_setting_is_refused_before_any_work(tiny, setting, value):
    """The project's error naming the setting, from generate's and generate_batch's first call, before a
    token; the cache given to generate keeps what it held."""
    cache = g.ModelCache(tiny.config)
    g.prefill([1, 2, 3], tiny, cache)
    with pytest.raises(g.GPT2NumbaError, match=setting):
        g.generate([1, 2], tiny, max_new_tokens=2, cache=cache, **{setting: value})
    with pytest.raises(g.GPT2NumbaError, match=setting):
        g.generate_batch([[1, 2]], tiny, max_new_tokens=2, **{setting: value})
    assert cache.length == 3


# --- beam search ---------------------------------------------------------------------------------------------


def recomputed_score(prompt, ids, w, length_penalty, processors):
    """A hypothesis's score from the float64 oracle: the processed log-softmax of each new token's logits,
    summed, over len ** length_penalty."""
    logits = g.recompute_all_logits(prompt + ids, w)[len(prompt) - 1: -1]  # (len(ids), vocab): before each
    total = 0.0
    for i, (row, token) in enumerate(zip(logits, ids)):
        logp = row - row.max() - np.log(np.exp(row - row.max()).sum())
        total += processors(logp, prompt + ids[:i], len(prompt))[token]
    return total / len(ids) ** length_penalty


beam_settings = st.fixed_dictionaries({
    "num_beams": st.integers(1, 4), "max_new_tokens": st.integers(1, 9),
    "length_penalty": st.sampled_from([1.0, 0.0, 2.0, -0.5]), "early_stopping": st.sampled_from([True, False, "never"]),
    "no_repeat_ngram_size": st.integers(0, 3), "repetition_penalty": st.sampled_from([1.0, 1.5]),
    "min_new_tokens": st.integers(0, 3), "eos_token_id": st.integers(0, TINY.vocab_size - 1),
})


@given(prompt=st.lists(st.integers(0, TINY.vocab_size - 1), min_size=1, max_size=12), settings=beam_settings)
def test_every_hypothesis_scores_what_the_oracle_says(tiny, prompt, settings):
    """Each returned hypothesis: its score is its oracle-recomputed log-probability sum over its length
    penalty (1e-4), it ends at an eos or at max_new_tokens, and the list is best first. Catches: a beam fed
    another beam's cache (a second child not copied, a copy from the wrong parent), the score not normalised
    or normalised by the wrong length, processors skipped on the log-softmax."""
    hypotheses = g.beam_search(prompt, tiny, num_return_sequences=settings["num_beams"], **settings)
    processors = Processors(no_repeat_ngram_size=settings["no_repeat_ngram_size"],
                            repetition_penalty=settings["repetition_penalty"],
                            min_new_tokens=settings["min_new_tokens"], eos_token_id=settings["eos_token_id"])
    assert len(hypotheses) == settings["num_beams"]
    scores = [h.score for h in hypotheses]
    assert scores == sorted(scores, reverse=True)
    for h in hypotheses:
        assert h.ids[-1] == settings["eos_token_id"] or len(h.ids) == settings["max_new_tokens"]
        assert settings["eos_token_id"] not in h.ids[:-1]
        expected = recomputed_score(prompt, h.ids, tiny, settings["length_penalty"], processors)
        assert h.score == pytest.approx(expected, abs=1e-4, rel=1e-5), (h, expected)


@given(prompt=st.lists(st.integers(0, TINY.vocab_size - 1), min_size=1, max_size=12),
       eos_at=st.integers(0, 8), no_repeat=st.integers(0, 3))
def test_one_beam_with_early_stopping_is_greedy(tiny, prompt, eos_at, no_repeat):
    """num_beams = 1 with early_stopping: greedy generation, stopping where greedy stops. The eos is greedy's
    own token at step eos_at, so the stop is reached. Catches: a finished hypothesis that does not stop a
    one-beam search, the first step scored from the wrong row."""
    greedy = list(g.generate(prompt, tiny, max_new_tokens=10, temperature=0, stop_at_eos=False,
                             no_repeat_ngram_size=no_repeat))
    eos = greedy[eos_at]
    expected = greedy[: greedy.index(eos) + 1]
    (beam,) = g.beam_search(prompt, tiny, num_beams=1, max_new_tokens=10, early_stopping=True, eos_token_id=eos,
                            no_repeat_ngram_size=no_repeat)
    assert beam.ids == expected


def test_the_batch_gives_each_prompt_what_it_gets_alone(tiny):
    """beam_search_batch: prompts of different lengths that finish at different steps; each list equals
    beam_search's for that prompt alone (ids; scores within the batched rows' float32 difference)."""
    prompts = [[5, 77, 300], [1], list(range(40, 60))]
    settings = dict(num_beams=3, max_new_tokens=12, num_return_sequences=2, eos_token_id=7, length_penalty=0.5)
    together = g.beam_search_batch(prompts, tiny, **settings)
    for prompt, hypotheses in zip(prompts, together):
        alone = g.beam_search(prompt, tiny, **settings)
        assert [h.ids for h in hypotheses] == [h.ids for h in alone]
        np.testing.assert_allclose([h.score for h in hypotheses], [h.score for h in alone], atol=1e-5)


@pytest.mark.parametrize("setting, value", [
    ("num_beams", 0), ("max_new_tokens", 0), ("length_penalty", float("nan")), ("early_stopping", "always"),
    ("num_return_sequences", 4), ("repetition_penalty", 0), ("eos_token_id", [TINY.vocab_size]),
    ("kv_dtype", "int8"), ("max_new_tokens", TINY.n_positions), ("temperature", 0.5),
])
def test_beam_search_refuses_a_bad_setting(tiny, setting, value):
    settings = {"num_beams": 3, "max_new_tokens": 4, setting: value}
    with pytest.raises(g.GPT2NumbaError, match=setting if setting != "max_new_tokens" or value == 0 else "context"):
        g.beam_search_batch([[1, 2, 3]], tiny, **settings)  # (beam_search's own keywords are Python's to check)


def test_copy_prefix_checks_its_start(tiny):
    """A start past what this cache holds, or past the length taken, is refused with nothing changed; a good
    one takes src's rows (the caller vouches that the first ``start`` are alike)."""
    a, b = g.ModelCache(tiny.config), g.ModelCache(tiny.config)
    g.prefill([1, 2, 3, 4], tiny, a)
    g.prefill([1, 2, 9], tiny, b)
    before = b.keys().copy()
    for start in (4, -1, 1.0):
        with pytest.raises(g.CacheError, match="start"):
            b.copy_prefix(a, start=start)
        np.testing.assert_array_equal(b.keys(), before)
    b.copy_prefix(a, start=2)
    np.testing.assert_array_equal(b.keys(), a.keys())  # every row a's, read in place
    np.testing.assert_array_equal(b.values(), a.values())
    assert b.length == 4 and b.shared == 4

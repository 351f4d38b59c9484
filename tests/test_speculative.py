"""Speculative decoding: greedy gives plain greedy's tokens for every draft, sampling has plain sampling's
distribution, the cache holds exactly what was kept, bad settings are refused before any work."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy import stats as scipy_stats

import gpt2numba as g
from conftest import TINY
from gpt2numba.decoding import speculative
from gpt2numba.decoding.sample import _batch_steps, _settings

SETTINGS = [{}, {"repetition_penalty": 1.3}, {"no_repeat_ngram_size": 2}, {"min_new_tokens": 4, "eos_token_id": 7},
            {"bad_words_ids": [[3], [9, 10]], "frequency_penalty": 0.5}, {"logit_bias": {5: 2.0, 6: -100.0}}]


@pytest.fixture(scope="module")
def other():
    """Another model of TINY's vocabulary: a draft that often disagrees."""
    return g.random_weights(TINY, seed=7)


def drafts(other):
    return ["int4", "int8", "bfloat16", other]


@given(prompt=st.lists(st.integers(0, TINY.vocab_size - 1), min_size=1, max_size=20),
       new=st.integers(1, 30), kind=st.integers(0, 4), k=st.none() | st.integers(1, 6),
       setting=st.sampled_from(SETTINGS), stop_at_eos=st.booleans())
def test_greedy_gives_plain_greedys_tokens(tiny, other, prompt, new, kind, k, setting, stop_at_eos):
    """Every draft kind (the model's own int4, int8, bfloat16, another model, prompt lookup), k fixed or adapted,
    with the processors: the tokens of plain greedy decoding."""
    plain = list(g.generate(prompt, tiny, max_new_tokens=new, temperature=0, stop_at_eos=stop_at_eos, **setting))
    ask = ({"prompt_lookup_num_tokens": k or 3, "max_matching_ngram_size": 1 + len(prompt) % 3} if kind == 4
           else {"draft": drafts(other)[kind], "num_speculative_tokens": k})
    fast = list(g.generate(prompt, tiny, max_new_tokens=new, temperature=0, stop_at_eos=stop_at_eos, **setting, **ask))
    assert fast == plain


@given(prompts=st.lists(st.lists(st.integers(0, TINY.vocab_size - 1), min_size=1, max_size=12), min_size=1,
                        max_size=5),
       new=st.integers(1, 16), kind=st.integers(0, 4), k=st.none() | st.integers(1, 4),
       batch_size=st.integers(1, 5), setting=st.sampled_from(SETTINGS[:3]))
def test_a_batch_gives_plain_greedys_tokens(tiny, other, prompts, new, kind, k, batch_size, setting):
    """generate_batch with drafts (each sequence its own, drafted together, checked in the step's pass beside
    other sequences' prompts): every sequence's tokens are plain generate_batch's."""
    def run(**ask):
        out = [[] for _ in prompts]
        for i, token in g.generate_batch(prompts, tiny, max_new_tokens=new, temperature=0, batch_size=batch_size,
                                         **setting, **ask):
            out[i].append(token)
        return out

    ask = ({"prompt_lookup_num_tokens": k or 2} if kind == 4
           else {"draft": drafts(other)[kind], "num_speculative_tokens": k})
    assert run(**ask) == run()


def test_a_full_batch_does_not_draft(tiny, monkeypatch):
    """Past max_batch sequences decoding at once, a step checks no greedy drafts (they would cost more than they
    give); at or under it, every step drafts. The tokens are plain generate_batch's either way."""
    monkeypatch.setattr(speculative, "DRAFT_MAX_BATCH", 2)
    prompts = [[1, 2], [3, 4, 5], [6]]
    for batch_size, drafts in ((3, False), (2, True)):
        counts, out = speculative.Stats(), [[] for _ in prompts]
        for i, token, *_ in _batch_steps(prompts, tiny, max_new_tokens=10, temperature=0, stop_at_eos=False,
                                         batch_size=batch_size, draft="int8", stats=counts):
            out[i].append(token)
        assert (counts.drafted > 0) == drafts
        assert out == [list(g.generate(p, tiny, max_new_tokens=10, temperature=0, stop_at_eos=False)) for p in prompts]
    # sampled sequences draft whatever runs beside them: a seed gives each the same tokens in any batch
    runs = []
    for batch_size in (3, 1):
        counts, out = speculative.Stats(), [[] for _ in prompts]
        for i, token, *_ in _batch_steps(prompts, tiny, max_new_tokens=10, seed=4, stop_at_eos=False,
                                         batch_size=batch_size, draft="int8", stats=counts):
            out[i].append(token)
        assert counts.drafted > 0
        runs.append(out)
    assert runs[0] == runs[1]


class Oracle:
    """A drafter that knows the plain output: always right, or always wrong (the right token + 1)."""

    def __init__(self, plain, prompt_len, wrong):
        self.plain, self.prompt_len, self.wrong = plain, prompt_len, wrong

    def propose(self, ids, k, sampler, rng, prompt_len):
        n = len(ids) - self.prompt_len
        return [(t + self.wrong) % TINY.vocab_size for t in self.plain[n:n + k]], None


@pytest.mark.parametrize("wrong", [0, 1])
def test_a_draft_always_right_or_always_wrong(tiny, wrong):
    prompt, new, k = [5, 77, 300], 25, 4
    plain = list(g.generate(prompt, tiny, max_new_tokens=new, temperature=0, stop_at_eos=False))
    spec, counts = speculative.Speculation(None, k), speculative.Stats()
    spec.drafter = lambda target: Oracle(plain, len(prompt), wrong)
    sampler = _settings({"temperature": 0}, TINY.vocab_size, new, None)
    mc = g.ModelCache(TINY)
    fast = list(speculative.generate(list(prompt), tiny, mc, sampler, new, np.random.default_rng(0), False, spec,
                                     counts))
    assert fast == plain
    assert counts.accepted == (0 if wrong else counts.drafted) and counts.drafted > 0
    assert counts.rounds == (new if wrong else 5)  # right: 4 drafts + 1 of its own a pass, 25 = 5 x 5
    _assert_cache_holds(mc, tiny, prompt + fast[:-1])


def _assert_cache_holds(mc, w, ids):
    """The seed's invariant: every layer holds exactly these tokens' rows, as a fresh prefill writes them."""
    assert mc.length == len(ids) and (mc.lengths == len(ids)).all()
    fresh = g.ModelCache(w.config)
    g.prefill(ids, w, fresh)
    np.testing.assert_allclose(mc.keys(), fresh.keys(), atol=1e-5)
    np.testing.assert_allclose(mc.values(), fresh.values(), atol=1e-5)


@pytest.mark.parametrize("draft", ["other", "lookup"])
def test_the_cache_holds_what_was_kept(tiny, other, draft):
    """After passes that rejected drafts, the model's cache holds every token but the last, no more, in every
    layer: the rows written for rejected drafts are cut off (and the rows kept are a fresh prefill's)."""
    prompt, new = [1, 2, 3, 4, 1, 2, 3], 30
    plan = speculative.plan(tiny, prompt_lookup_num_tokens=4) if draft == "lookup" else \
        speculative.plan(tiny, other, 5)
    sampler = _settings({"temperature": 1.0}, TINY.vocab_size, new, 0)
    mc, counts = g.ModelCache(TINY), speculative.Stats()
    tokens = list(speculative.generate(list(prompt), tiny, mc, sampler, new, np.random.default_rng(3), False, plan,
                                       counts))
    assert len(tokens) == new and counts.accepted < counts.drafted  # some rejected
    assert draft == "lookup" or counts.accepted > 0  # (lookup's single guesses are seldom p's samples)
    _assert_cache_holds(mc, tiny, prompt + tokens[:-1])


def _joint(sample, n):
    """Counts (V, V) of the first two tokens of sample(j), j < n."""
    counts = np.zeros((8, 8))
    for j in range(n):
        first, second = sample(j)[:2]
        counts[first, second] += 1
    return counts


SAMPLINGS = [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 5},
             {"temperature": 1.3, "repetition_penalty": 1.5, "presence_penalty": 0.4}]


@pytest.mark.parametrize("setting", SAMPLINGS)
@pytest.mark.parametrize("draft", ["other", "lookup"])
def test_sampling_has_plain_samplings_distribution(setting, draft):
    """On an 8-token model, the first two tokens' joint distribution over 4000 samples is the model's own, p(t1)
    p(t2 | t1), exactly computed (chi-square): with a draft that often disagrees (another model, or prompt
    lookup's single guesses). Keeping every draft, or drawing the rejected one from p instead of max(0, p - q),
    fails it."""
    cfg = dataclasses.replace(TINY, n_layer=1, vocab_size=8)
    w, draft_w = g.random_weights(cfg, seed=2), g.random_weights(cfg, seed=3)
    prompt = [1, 2, 3, 1, 2]
    sampler = g.Sampler(**setting)
    mc = g.ModelCache(cfg)
    first = sampler.probabilities(g.prefill(prompt, w, mc), prompt, len(prompt))
    exact = np.zeros((8, 8))
    for t in range(8):
        if first[t] > 0:
            fork = mc.fork()
            exact[t] = first[t] * sampler.probabilities(g.decode_step(t, w, fork), prompt + [t], len(prompt))
    ask = {"prompt_lookup_num_tokens": 2} if draft == "lookup" else {"draft": draft_w, "num_speculative_tokens": 2}
    texts, stats = [[] for _ in range(4000)], speculative.Stats()  # 4000 samples as one batch: (0, j) sample j's
    for j, token, *_ in _batch_steps([prompt], w, n=4000, max_new_tokens=3, seed=0, stop_at_eos=False,
                                     batch_size=1000, stats=stats, **setting, **ask):
        texts[j].append(token)
    assert stats.drafted > 1000  # (sampled sequences draft in a batch of any size)
    counts = _joint(lambda j: texts[j], 4000)
    seen = exact > 0
    assert counts[~seen].sum() == 0, "a token the model's settings rule out was drawn"
    _, p_value = scipy_stats.chisquare(counts[seen], 4000 * exact[seen] / exact[seen].sum())
    assert p_value > 1e-3, (p_value, counts, exact * 4000)


@pytest.mark.parametrize("setting", SAMPLINGS)
def test_a_rejected_draft_is_resampled_from_what_p_has_beyond_q(setting):
    """One checked position, a draft q far from the model's p (q puts its mass where p puts little): the token
    that comes out, drafted and kept or drawn after a rejection, is distributed as p (20000 draws). Drawing the
    rejected one from p instead of max(0, p - q) fails it; so does keeping every draft."""
    rng = np.random.default_rng(5)
    logits = rng.normal(0, 1.5, (2, 8)).astype(np.float32)  # after the last token, and after the draft
    sampler, previous = g.Sampler(**setting), [3, 3, 1]
    p = sampler.probabilities(logits[0], previous, 1)
    q = np.roll(p[::-1], 1)  # the same numbers on other tokens
    counts = np.zeros(8)
    for _ in range(20000):
        drafted = [int(rng.choice(8, p=q))]
        kept, token = speculative._verify(logits, drafted, [q], previous, sampler, rng, 1)
        counts[drafted[0] if kept else token] += 1
    assert counts[p == 0].sum() == 0
    _, p_value = scipy_stats.chisquare(counts[p > 0], 20000 * p[p > 0])
    assert p_value > 1e-3, (p_value, counts / 20000, p)


def test_probabilities_are_what_the_sampler_draws_from():
    """Sampler.probabilities against 20000 of the Sampler's own draws, with every cut: the p and q of speculation
    are plain sampling's."""
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 1.5, 12).astype(np.float32)
    previous = [3, 3, 4]
    for setting in [{}, {"temperature": 0.5, "top_k": 6}, {"top_p": 0.8, "repetition_penalty": 1.4},
                    {"min_p": 0.1, "frequency_penalty": 0.3}, {"typical_p": 0.7}]:
        sampler = g.Sampler(**setting)
        p = sampler.probabilities(logits, previous, 1)
        draws = np.bincount([sampler(logits, previous, rng, 1) for _ in range(20000)], minlength=12)
        assert draws[p == 0].sum() == 0 and p.sum() == pytest.approx(1)
        _, p_value = scipy_stats.chisquare(draws[p > 0], 20000 * p[p > 0])
        assert p_value > 1e-3, (setting, p_value)
    assert g.Sampler(temperature=0).probabilities(logits, [], 0).tolist() == np.eye(12)[np.argmax(logits)].tolist()


@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16"])
def test_a_compact_cache(tiny, kv_dtype):
    """The model's cache in half precision: its own int4 draft reads those rows (a cache of the same dtype), and
    the tokens are plain greedy decoding's with that cache."""
    prompt = [7, 8, 9, 10]
    plain = list(g.generate(prompt, tiny, max_new_tokens=30, temperature=0, kv_dtype=kv_dtype))
    assert list(g.generate(prompt, tiny, max_new_tokens=30, temperature=0, kv_dtype=kv_dtype, draft="int4")) == plain


def test_seeds_reproduce(tiny):
    runs = [list(g.generate([4, 5, 6], tiny, max_new_tokens=20, seed=11, draft="int4", top_k=50)) for _ in range(2)]
    assert runs[0] == runs[1]


def test_prompt_lookup_copies_the_latest_match():
    lookup = speculative.PromptLookup(2)
    propose = lambda ids, k: lookup.propose(ids, k, None, None, 0)[0]  # noqa: E731
    assert propose([1, 2, 7, 1, 2, 8, 1, 2], 3) == [8, 1, 2]  # the latest [1, 2], not the first
    assert propose([5, 5, 5], 4) == [5, 5, 5, 5]  # a loop goes round again
    assert propose([1, 2, 3, 9, 3], 2) == [9, 3]  # no [9, 3] before: the 1-gram [3]
    assert propose([1, 2, 3], 2) == []  # nothing repeats


def test_drafts_past_the_caches_room(tiny):
    """A draft model with fewer positions stops drafting where its cache ends; the model near its own end drafts
    only what fits. Both give plain greedy's tokens."""
    short = g.random_weights(dataclasses.replace(TINY, n_positions=16), seed=1)
    for prompt, new in [([3, 4, 5], 40), (list(range(58)), 6)]:
        plain = list(g.generate(prompt, tiny, max_new_tokens=new, temperature=0, stop_at_eos=False))
        for draft in (short, "int8"):
            assert list(g.generate(prompt, tiny, max_new_tokens=new, temperature=0, stop_at_eos=False, draft=draft,
                                   num_speculative_tokens=12)) == plain


@pytest.mark.parametrize("ask, message", [
    ({"draft": "int4", "prompt_lookup_num_tokens": 3}, "not both"),
    ({"num_speculative_tokens": 3}, "num_speculative_tokens=3 needs a draft"),
    ({"max_matching_ngram_size": 2}, "max_matching_ngram_size=2 needs a draft"),
    ({"draft": "int4", "num_speculative_tokens": 0}, r"num_speculative_tokens must be an integer in \[1, 64\]"),
    ({"draft": "int4", "num_speculative_tokens": 65}, r"in \[1, 64\], got 65"),
    ({"draft": "int4", "num_speculative_tokens": 2.0}, "got 2.0"),
    ({"prompt_lookup_num_tokens": 0}, r"prompt_lookup_num_tokens must be an integer in \[1, 64\]"),
    ({"prompt_lookup_num_tokens": 3, "max_matching_ngram_size": 0}, "max_matching_ngram_size must be"),
    ({"prompt_lookup_num_tokens": 3, "num_speculative_tokens": 2}, "num_speculative_tokens is for a draft model"),
    ({"draft": "int4", "max_matching_ngram_size": 2}, "max_matching_ngram_size is for prompt lookup"),
    ({"draft": 4}, "got int"),
    ({"draft": "int4", "slide": True}, "does not take slide"),
    ({"draft": "int4", "regex": "a+"}, "does not take a constraint"),
])
def test_bad_settings_are_refused_before_any_work(tiny, ask, message):
    mc = g.ModelCache(TINY)
    g.prefill([1, 2, 3], tiny, mc)
    keys = mc.keys().copy()
    with pytest.raises(g.ConfigError, match=message):
        g.generate([1, 2], tiny, max_new_tokens=3, cache=mc, **ask)
    assert mc.length == 3 and np.array_equal(mc.keys(), keys)


def test_a_draft_of_another_vocabulary_or_the_same_format(tiny):
    with pytest.raises(g.ConfigError, match="draft=.*: the draft's vocabulary has 8 tokens, the model's 512"):
        g.generate([1], tiny, max_new_tokens=2, draft=g.random_weights(dataclasses.replace(TINY, vocab_size=8)))
    for model, draft in (("int8", "int8"), ("int4", "int8"), ("bfloat16", "bfloat16")):
        with pytest.raises(g.ConfigError, match=f"draft='{draft}' is no smaller than the model's own {model}"):
            g.generate([1], tiny.astype(model), max_new_tokens=2, draft=draft)
    for path in ("int2", "/no/such/checkpoint"):
        with pytest.raises(g.CheckpointNotFoundError, match=f"draft='{path}' is neither int4, int8, bfloat16 nor a "
                                                            "checkpoint: checkpoint .* does not exist"):
            g.generate([1], tiny, max_new_tokens=2, draft=path)


def test_a_draft_from_a_checkpoint(tmp_path, tiny, other):
    g.save_weights(other, tmp_path / "draft")
    plain = list(g.generate([9, 8, 7], tiny, max_new_tokens=12, temperature=0))
    assert list(g.generate([9, 8, 7], tiny, max_new_tokens=12, temperature=0, draft=tmp_path / "draft")) == plain
    assert list(g.generate([9, 8, 7], tiny, max_new_tokens=12, temperature=0, draft=str(tmp_path / "draft"))) == plain


def test_generate_text_takes_a_draft():
    w = g.random_weights(dataclasses.replace(TINY, vocab_size=50257), seed=1)
    plain = "".join(g.generate_text("Hello there", w, max_new_tokens=10, temperature=0))
    assert "".join(g.generate_text("Hello there", w, max_new_tokens=10, temperature=0, draft="int4")) == plain

"""Many sequences in one pass: prefill_batch, decode_batch and generate_batch against the oracle.

Each property names the bug it catches; tests/test_mutants.py plants those bugs
and checks that these very checks fail on them.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpt2numba as g
from conftest import TINY, TINY_GPT2
from gpt2numba.model import oracle
from helpers import LENGTHS, check_batch_rounds, check_generate_batch
from test_prefill import prompts


@st.composite
def ragged_plans(draw, vocab_size, n_positions, max_batch=6):
    """B sequences, each with the length of the prefix already in its cache and its later chunk cuts."""
    seqs = draw(st.lists(prompts(vocab_size, n_positions), min_size=1, max_size=max_batch))
    plans = []
    for ids in seqs:
        cuts = draw(st.lists(st.integers(1, len(ids) - 1), unique=True, max_size=4).map(sorted)) if len(ids) > 1 else []
        prefix = draw(st.sampled_from([0, *cuts[:1]]))  # some caches start non-empty
        plans.append((ids, prefix, [c for c in cuts if c > prefix]))
    return plans


@given(plans=ragged_plans(TINY.vocab_size, TINY.n_positions), data=st.data())
def test_ragged_batches_tiny(tiny, plans, data):
    """Rounds of prefill_batch / decode_batch over ragged sequences, some caches non-empty at the start.

    Every row matches the oracle of its own sequence; every cache holds exactly its own length in every
    layer, and no rows past it. Catches: attention that reads another sequence's cache, positions taken
    from the batch index, writes into another sequence's cache.
    """
    check_batch_rounds(plans, tiny, "tiny batch", data.draw(st.randoms(use_true_random=False)))


@given(plans=ragged_plans(50257, 40, max_batch=4), data=st.data())
@settings(max_examples=3)
def test_ragged_batches_gpt2_small(small, plans, data):
    check_batch_rounds(plans, small, "small batch", data.draw(st.randoms(use_true_random=False)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "int4", "bfloat16 activations"])
def test_batch_rows_equal_single_sequence_rows(tiny, rng, dtype):
    """prefill_batch and decode_batch rows equal prefill and decode_step on their own, to 1e-5.

    The integer formats' 63-row batch goes through BLAS and the sequences alone through the
    integer kernels, and bfloat16 activations' through the panels against the tiles and one row's
    dot products: equal up to inputs on a rounding tie (see oracle.tolerance).
    """
    w = tiny.astype("bfloat16", "bfloat16") if dtype == "bfloat16 activations" else tiny.astype(dtype)
    atol = oracle.tolerance(w) if oracle.rounds_inputs(w) else 1e-5
    seqs = [rng.integers(0, TINY.vocab_size, n) for n in (1, 5, 40, 17)]
    batch = [g.ModelCache(TINY) for _ in seqs]
    alone = [g.ModelCache(TINY) for _ in seqs]
    rows = g.prefill_batch(seqs, w, batch)
    assert rows.shape == (len(seqs), TINY.vocab_size) and rows.dtype == np.float32
    for row, ids, mc in zip(rows, seqs, alone):
        np.testing.assert_allclose(row, g.prefill(ids, w, mc), atol=atol, rtol=0)
    for step in range(3):
        tokens = rng.integers(0, TINY.vocab_size, len(seqs))
        rows = g.decode_batch(tokens, w, batch)
        for row, token, mc in zip(rows, tokens, alone):
            np.testing.assert_allclose(row, g.decode_step(int(token), w, mc), atol=atol, rtol=0)
    for a, b in zip(batch, alone):
        assert a.length == b.length
        np.testing.assert_allclose(a.keys(), b.keys(), atol=atol, rtol=0)


def test_out_receives_the_logits(tiny):
    caches = [g.ModelCache(TINY, max_len=8) for _ in range(2)]
    out = np.zeros((2, TINY.vocab_size), np.float32)
    rows = g.prefill_batch([[1, 2], [3]], tiny, caches, out=out)
    assert rows is out
    for row, ids in zip(out, [[1, 2], [3]]):
        np.testing.assert_allclose(row, g.prefill(ids, tiny, g.ModelCache(TINY)), atol=1e-5, rtol=0)
    with pytest.raises(g.ConfigError, match="out must be"):
        g.decode_batch([1, 2], tiny, caches, out=np.zeros((3, TINY.vocab_size), np.float32))
    out.flags.writeable = False
    with pytest.raises(g.ConfigError, match="writeable"):
        g.decode_batch([1, 2], tiny, caches, out=out)
    assert [mc.length for mc in caches] == [2, 1]


def test_every_row_of_the_sequences_marked(tiny):
    """prefill_batch(every_row=...): the marked prompts' logits after every token, the others' after their last,
    in order (speculative decoding's pass: drafts checked beside other sequences' rows); a wrong count is refused
    before any cache changes."""
    prompts = [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10]]
    caches = [g.ModelCache(TINY, max_len=8) for _ in prompts]
    rows = g.prefill_batch(prompts, tiny, caches, every_row=[True, False, False, True])
    alone = [g.prefill(ids, tiny, g.ModelCache(TINY), logits="all") for ids in prompts]
    expected = np.concatenate([alone[0], alone[1][-1:], alone[2][-1:], alone[3]])
    np.testing.assert_allclose(rows, expected, atol=1e-5, rtol=0)
    fresh = [g.ModelCache(TINY, max_len=8) for _ in prompts]
    with pytest.raises(g.BatchError, match="every_row has 3 entries for 4 prompts"):
        g.prefill_batch(prompts, tiny, fresh, every_row=[True, False, True])
    assert [mc.length for mc in fresh] == [0, 0, 0, 0]


# --- generation ------------------------------------------------------------------------------------

def tokens_by_prompt(pairs):
    out = {}
    for i, token in pairs:
        out.setdefault(i, []).append(token)
    return out




@pytest.mark.parametrize("batch_size", [1, 3, None])
def test_greedy_batch_equals_greedy_alone(tiny, rng, batch_size):
    """Continuous refill with batch_size below the number of prompts: each prompt's greedy tokens
    equal generate's for that prompt alone."""
    check_generate_batch([rng.integers(0, TINY.vocab_size, n).tolist() for n in LENGTHS], tiny, batch_size)


def test_seeded_sampling_ignores_the_rest_of_the_batch(tiny, rng):
    """With a seed, prompt i's tokens depend on (seed, i) only: not on batch_size nor on other prompts."""
    prompts = [rng.integers(0, TINY.vocab_size, n).tolist() for n in LENGTHS]
    options = dict(max_new_tokens=6, top_k=50, top_p=0.95, seed=11, stop_at_eos=False)
    everything = tokens_by_prompt(g.generate_batch(prompts, tiny, **options))
    assert everything == tokens_by_prompt(g.generate_batch(prompts, tiny, batch_size=2, **options))
    fewer = tokens_by_prompt(g.generate_batch(prompts[:3], tiny, batch_size=1, **options))
    assert all(fewer[i] == everything[i] for i in range(3))
    assert everything != tokens_by_prompt(g.generate_batch(prompts, tiny, **{**options, "seed": 12}))


def test_each_prompts_stream_is_seeded_with_seed_and_index(tiny, rng):
    """The documented derivation: prompt i samples from np.random.default_rng([seed, i]). Replayed here
    one prompt at a time with prefill, decode_step and that stream. Catches: seed + i, one stream for
    every prompt, a stream from the seed alone (as generate's)."""
    prompts = [rng.integers(0, TINY.vocab_size, n).tolist() for n in (3, 9, 1)]
    sampler = g.Sampler(temperature=2.0, top_k=100)
    got = tokens_by_prompt(g.generate_batch(prompts, tiny, max_new_tokens=6, temperature=2.0, top_k=100,
                                            seed=7, stop_at_eos=False))
    for i, prompt in enumerate(prompts):
        stream, ids, mc = np.random.default_rng([7, i]), list(prompt), g.ModelCache(TINY)
        logits = g.prefill(ids, tiny, mc)
        for _ in range(6):
            ids.append(sampler(logits, ids, stream))
            logits = g.decode_step(ids[-1], tiny, mc)
        assert got[i] == ids[len(prompt):], i


@given(seed=st.integers(0, 2**32 - 2))
@settings(max_examples=4)
def test_streams_of_neighbouring_seeds_do_not_collide(tiny, seed):
    """Prompt 1 under seed s and prompt 0 under seed s + 1, the same prompt: different tokens (a derivation
    from seed + i would give them one stream)."""
    options = dict(max_new_tokens=8, temperature=2.0, stop_at_eos=False)
    second = tokens_by_prompt(g.generate_batch([[5, 6], [5, 6]], tiny, seed=seed, **options))[1]
    first_of_next = tokens_by_prompt(g.generate_batch([[5, 6]], tiny, seed=seed + 1, **options))[0]
    assert second != first_of_next


def test_each_sequence_stops_on_its_own(tiny):
    """The stop rule: <|endoftext|> ends its own sequence only, the others go on to max_new_tokens, and
    every prompt is served (the logits here do not depend on the input: refills are tested above)."""
    import dataclasses

    w = g.random_weights(TINY_GPT2, seed=0)
    wte = w.wte.copy()
    wte[50256] = 10.0 / TINY.n_embd  # ln_f's output is all ones below: p(<|endoftext|>) is about 0.3 each step
    w = dataclasses.replace(w, wte=wte, ln_f_g=np.zeros_like(w.ln_f_g), ln_f_b=np.ones_like(w.ln_f_b))
    prompts = [[i + 1] for i in range(8)]
    got = tokens_by_prompt(g.generate_batch(prompts, w, max_new_tokens=4, seed=0, batch_size=3))
    assert sorted(got) == list(range(8))
    for tokens in got.values():
        assert 50256 not in tokens[:-1] and (tokens[-1] == 50256 or len(tokens) == 4)
    assert {len(t) for t in got.values() if t[-1] == 50256} - {4} and any(50256 not in t for t in got.values())
    assert got == tokens_by_prompt(g.generate_batch(prompts, w, max_new_tokens=4, seed=0))


def test_generate_text_batch():
    w = g.default_weights()
    texts = ["Hello world", "", "The quick brown fox"]
    out = g.generate_text_batch(texts, w, max_new_tokens=6, temperature=0, stop_at_eos=False, batch_size=2)
    for text, got in zip(texts, out):
        assert got == "".join(g.generate_text(text, w, max_new_tokens=6, temperature=0, stop_at_eos=False))
    assert g.generate_text_batch(iter(["a", "b"]), w, max_new_tokens=0) == ["", ""]


@pytest.mark.parametrize("texts, options, error, match", [
    (5, {}, g.BatchError, "texts must be a sequence, got int"),
    (["a", 1], {}, g.TokenTypeError, "text 1 must be a str"),
    (["a"], {"tokenizer": "gpt2"}, g.ConfigError, "tokenizer must be a Tokenizer"),
])
def test_bad_generate_text_batch(tiny, texts, options, error, match):
    with pytest.raises(error, match=match):
        g.generate_text_batch(texts, tiny, max_new_tokens=2, **options)


# --- bad input: the project's error, and every cache as it was ------------------------------------

@pytest.fixture
def two(tiny):
    """Two caches, one holding 3 positions, and a snapshot of both."""
    caches = [g.ModelCache(TINY, max_len=8), g.ModelCache(TINY, max_len=8)]
    g.prefill([1, 2, 3], tiny, caches[0])
    return caches, [(mc.length, mc.lengths, mc.k.copy(), mc.v.copy()) for mc in caches]


def assert_all_unchanged(caches, snapshots):
    for mc, (length, lengths, k, v) in zip(caches, snapshots):
        assert mc.length == length
        np.testing.assert_array_equal(mc.lengths, lengths)
        np.testing.assert_array_equal(mc.k, k)
        np.testing.assert_array_equal(mc.v, v)


OTHER = g.GPT2Config(n_layer=3, n_head=2, n_embd=128, n_positions=64, vocab_size=512)


@pytest.mark.parametrize("prompts, caches, error, match", [
    ([], [], g.BatchError, "empty"),
    ([[1]], [0, 1], g.BatchError, "1 prompts but 2 caches"),
    ([[1], [2]], [0, 0], g.BatchError, "caches 0 and 1 are the same"),
    ([[1], [2]], "one", g.BatchError, "one ModelCache"),
    ([[1], []], [0, 1], g.TokenError, "prompt 1: the prompt is empty"),
    ([[1], [512]], [0, 1], g.TokenError, r"prompt 1: token id at index 0: 512 is outside \[0, 512\)"),
    ([[1], [1.5]], [0, 1], g.TokenTypeError, "prompt 1: .*must be an integer"),
    ([1, 2], [0, 1], g.TokenTypeError, "prompt 0: token ids must be a sequence"),
    ("ab", [0, 1], g.BatchError, "prompts must be a sequence"),
    ([[1], [1] * 9], [0, 1], g.CacheFullError, "prompt 1: a prompt of 9 tokens does not fit.*room for 8"),
    ([[1] * 6, [1]], [0, 1], g.CacheFullError, "prompt 0: a prompt of 6 tokens does not fit.*room for 5"),
    ([[1], [2]], [0, "other"], g.ConfigError, "prompt 1: the cache was built for"),
    ([[1], [2]], [0, None], g.ConfigError, "prompt 1: expected a ModelCache, got NoneType"),
])
def test_bad_prefill_batch(tiny, two, prompts, caches, error, match):
    mcs, snapshots = two
    pick = {0: mcs[0], 1: mcs[1], "other": g.ModelCache(OTHER), None: None}
    caches = mcs[0] if caches == "one" else [pick[c] for c in caches]
    with pytest.raises(error, match=match):
        g.prefill_batch(prompts, tiny, caches)
    assert_all_unchanged(mcs, snapshots)


@pytest.mark.parametrize("tokens, caches, error, match", [
    ([], [], g.BatchError, "empty"),
    ([1, 2], [0], g.BatchError, "2 token_ids but 1 caches"),
    ([1, 2], [1, 1], g.BatchError, "caches 0 and 1 are the same"),
    ([1, 512], [0, 1], g.TokenError, r"token 1: token id 512 is outside"),
    ([1, True], [0, 1], g.TokenTypeError, "token 1: .*True"),
    (np.array([[1, 2]]), [0, 1], g.BatchError, "1-D"),
    (5, [0], g.BatchError, "token_ids must be a sequence"),
    ([1, 2], [0, "full"], g.CacheFullError, "token 1: the cache is full"),
])
def test_bad_decode_batch(tiny, two, tokens, caches, error, match):
    mcs, snapshots = two
    full = g.ModelCache(TINY, max_len=1)
    g.prefill([4], tiny, full)
    pick = {0: mcs[0], 1: mcs[1], "full": full}
    with pytest.raises(error, match=match):
        g.decode_batch(tokens, tiny, [pick[c] for c in caches])
    assert_all_unchanged(mcs, snapshots)


@pytest.mark.parametrize("module, step", [("model.forward", "_attend"), ("model.forward", "head_logits")])
def test_interrupted_batch_leaves_every_cache(tiny, two, monkeypatch, module, step):
    """An exception inside the layer loop, or in the output head once every layer wrote its rows."""
    import importlib

    mcs, snapshots = two

    def broken(*args):
        raise KeyboardInterrupt
    monkeypatch.setattr(importlib.import_module(f"gpt2numba.{module}"), step, broken)
    with pytest.raises(KeyboardInterrupt):
        g.prefill_batch([[1, 2], [3]], tiny, mcs)
    for mc, (length, lengths, _, _) in zip(mcs, snapshots):
        assert mc.length == length and (mc.lengths == lengths).all()


@pytest.mark.parametrize("prompts, options, error, match", [
    ([], {}, g.BatchError, "no prompts"),
    ("text", {}, g.BatchError, "prompts must be a sequence"),
    ([[1], [600]], {}, g.TokenError, "prompt 1: .*600"),
    ([[1], [1] * 60], {}, g.CacheFullError, "prompt 1: 60 tokens \\+ max_new_tokens \\(5\\)"),
    ([[1]], {"batch_size": 0}, g.SamplingError, "batch_size"),
    ([[1]], {"temperature": -1}, g.SamplingError, "temperature"),
    ([[1]], {"seed": -2}, g.SamplingError, "seed"),
])
def test_bad_generate_batch(tiny, prompts, options, error, match):
    with pytest.raises(error, match=match):
        g.generate_batch(prompts, tiny, **{"max_new_tokens": 5, **options})


def test_a_sequence_that_leaves_drops_its_cache(tiny):
    """Done or removed, a sequence holds no cache, whoever still holds the sequence (the server's requests
    may outlive their sequences). Catches a batch that keeps the cache with the sequence."""
    from gpt2numba.decoding.batching import Batch

    batch = Batch(tiny, 2)
    done = batch.add([1, 2], max_new_tokens=1, sampler=g.Sampler(0.0), rng=np.random.default_rng(0))
    removed = batch.add([3], max_new_tokens=5, sampler=g.Sampler(0.0), rng=np.random.default_rng(0))
    assert done.cache is not None and removed.cache is not None
    batch.step()
    assert done not in batch.sequences and done.cache is None
    batch.remove(removed)
    assert removed.cache is None and not batch.sequences

"""A shared prefix computed once: forked caches, n samples from one prefill, scoring by shared contexts.

Each property names the bug it catches; each was seen to fail once with that bug planted by hand.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpt2numba as g
from conftest import TINY
from gpt2numba.text import scoring
from gpt2numba.decoding import batching


def ids(min_size, max_size):
    return st.lists(st.integers(0, TINY.vocab_size - 1), min_size=min_size, max_size=max_size)


def state(mc):
    return mc.k.copy(), mc.v.copy(), mc.lengths, mc.length, mc.max_len


def assert_unchanged(mc, before):
    k, v, lengths, length, max_len = before
    np.testing.assert_array_equal(mc.k, k)
    np.testing.assert_array_equal(mc.v, v)
    np.testing.assert_array_equal(mc.lengths, lengths)
    assert (mc.length, mc.max_len) == (length, max_len)


def go_on(tokens, w, mc, split):
    """Continue a cache: the first ``split`` tokens in one prefill (every row's logits), then decode steps."""
    return [g.prefill(tokens[:split], w, mc, logits="all")] + [g.decode_step(t, w, mc) for t in tokens[split:]]


# --- forking a cache ---------------------------------------------------------------------------------

@given(data=st.data())
def test_a_fork_goes_on_as_its_source_would(tiny, data):
    """Two caches filled by the same calls hold the same bits. Fork one at n (and copy it at n into a
    cache that held other tokens), go on in the fork: the logits and rows are those of going on in
    the other from n, to the bit; the source is unchanged and goes on as if never forked.

    Catches: values not copied (keys only), a layer left out, a length off by one, a fork that shares
    (or views) the source's arrays, lengths per layer left behind.
    """
    head, tail, more = data.draw(ids(1, 20)), data.draw(ids(0, 20)), data.draw(ids(1, 12))
    n = len(head)
    source, twin = g.ModelCache(TINY), g.ModelCache(TINY)
    for mc in (source, twin):
        g.prefill(head, tiny, mc)
    if tail:
        g.prefill(tail, tiny, source)
    before = state(source)
    fork = source.fork(n, max_len=data.draw(st.integers(n + len(more), TINY.n_positions)))
    reused = g.ModelCache(TINY, max_len=n + len(more))
    g.prefill(data.draw(ids(1, n + len(more))), tiny, reused)  # rows of other tokens, to be overwritten
    reused.copy_prefix(source, n)
    assert fork.length == reused.length == n and (fork.lengths == n).all() and (reused.lengths == n).all()
    assert_unchanged(source, before)

    split = data.draw(st.integers(1, len(more)))
    want = go_on(more, tiny, twin, split)
    for mc in (fork, reused):
        for got, expected in zip(go_on(more, tiny, mc, split), want):
            np.testing.assert_array_equal(got, expected)
        np.testing.assert_array_equal(mc.keys(), twin.keys())
        np.testing.assert_array_equal(mc.values(), twin.values())
    assert_unchanged(source, before)  # the forks' rows went to their own arrays
    again = g.ModelCache(TINY)  # the source goes on as a cache filled by the same calls, never forked
    for chunk in (head, tail):
        if chunk:
            g.prefill(chunk, tiny, again)
    np.testing.assert_array_equal(g.decode_step(more[0], tiny, source), g.decode_step(more[0], tiny, again))


def test_a_whole_fork_by_default(tiny):
    source = g.ModelCache(TINY, max_len=10)
    g.prefill([3, 1, 4, 1, 5], tiny, source)
    fork = source.fork()
    assert (fork.length, fork.max_len) == (5, 10)
    np.testing.assert_array_equal(g.decode_step(9, tiny, fork), g.decode_step(9, tiny, source))
    source.copy_prefix(source, 2)  # a cache's own prefix: it keeps its first positions
    assert source.length == 2 and (source.lengths == 2).all()


OTHER = g.GPT2Config(n_layer=1, n_head=2, n_embd=128, n_positions=64, vocab_size=512)
BAD_CALLS = [
    (lambda src, dst: src.fork(6), g.CacheError, r"length must be an integer in \[0, 5\].*got 6"),
    (lambda src, dst: src.fork(-1), g.CacheError, "got -1"),
    (lambda src, dst: src.fork(2.0), g.CacheError, "got 2.0"),
    (lambda src, dst: src.fork(True), g.CacheError, "got True"),
    (lambda src, dst: src.fork("3"), g.CacheError, "got '3'"),
    (lambda src, dst: src.fork(max_len=4), g.CacheFullError, "5 positions do not fit .* max_len=4"),
    (lambda src, dst: src.fork(2, max_len=0), g.ConfigError, r"max_len=0 is outside \[1, 64\]"),
    (lambda src, dst: src.fork(2, max_len=65), g.ConfigError, "max_len=65"),
    (lambda src, dst: src.fork(2, max_len=7.0), g.ConfigError, "max_len must be an integer"),
    (lambda src, dst: dst.copy_prefix(src, 6), g.CacheError, r"\[0, 5\]"),
    (lambda src, dst: dst.copy_prefix("cache"), g.CacheError, "needs a ModelCache.*got str"),
    (lambda src, dst: dst.copy_prefix(g.ModelCache(OTHER)), g.CacheError, "different configs"),
    (lambda src, dst: dst.copy_prefix(src), g.CacheFullError, "5 positions do not fit .* max_len=3"),
    (lambda src, dst: dst.copy_prefix(src, 4), g.CacheFullError, "max_len=3"),
]


@pytest.mark.parametrize("call, error, match", BAD_CALLS)
def test_bad_fork_calls_change_nothing(tiny, call, error, match):
    """Refused with the project's error naming the value, before anything changes.

    Catches: a check after the copy (or after the length moved), a message without the value."""
    src, dst = g.ModelCache(TINY, max_len=8), g.ModelCache(TINY, max_len=3)
    g.prefill([1, 2, 3, 4, 5], tiny, src)
    g.prefill([7, 8], tiny, dst)
    before = state(src), state(dst)
    with pytest.raises(error, match=match):
        call(src, dst)
    assert_unchanged(src, before[0])
    assert_unchanged(dst, before[1])


@given(length=st.one_of(st.none(), st.integers(0, 6), st.integers(-50, 100), st.floats(allow_nan=False),
                        st.text(max_size=2)),
       max_len=st.one_of(st.none(), st.integers(-5, 100)))
def test_every_bad_fork_leaves_the_source(tiny, length, max_len):
    """Any length and max_len: a fork never changes its source; a copy_prefix that is refused (a bad
    length, or one that does not fit the 3 positions of the cache copied into) changes neither cache,
    and one that is not refused fills exactly those positions."""
    src, dst = g.ModelCache(TINY, max_len=8), g.ModelCache(TINY, max_len=3)
    g.prefill([1, 2, 3, 4, 5], tiny, src)
    g.prefill([7, 8], tiny, dst)
    before = state(src), state(dst)
    try:
        fork = src.fork(length, max_len=max_len)
        assert fork.length == (5 if length is None else length)
    except g.GPT2NumbaError:
        pass
    assert_unchanged(src, before[0])
    try:
        dst.copy_prefix(src, length)
    except g.GPT2NumbaError:
        assert_unchanged(dst, before[1])
    else:
        assert dst.length == length and (dst.lengths == length).all()
        np.testing.assert_array_equal(dst.keys(), src.k[:, :, :length])
    assert_unchanged(src, before[0])


# --- n samples, one prefill --------------------------------------------------------------------------

@pytest.fixture
def rows_fed(monkeypatch):
    """The rows of every forward pass generate_batch runs."""
    fed = []
    real = batching.prefill_batch

    def counting(prompts, *args, **kwargs):
        fed.append(sum(map(len, prompts)))
        return real(prompts, *args, **kwargs)
    monkeypatch.setattr(batching, "prefill_batch", counting)
    return fed


@pytest.mark.parametrize("batch_size", [None, 1, 2, 5])
def test_n_samples_prefill_each_prompt_once(tiny, rows_fed, batch_size):
    """n samples of a prompt (or a prompt repeated) run its rows once, whether its samples start together
    or as slots free up; then one row a token each. Catches: a prefill per sample, samples that join later
    prefilling again (the prompt's rows not kept), a repeated prompt prefilled twice."""
    prompts = [[5, 6, 7, 8, 9], [1, 2, 3], [5, 6, 7, 8, 9]]
    got = list(g.generate_batch(prompts, tiny, max_new_tokens=4, n=3, seed=0, stop_at_eos=False,
                                batch_size=batch_size))
    assert sorted({i for i, _ in got}) == list(range(9)) and len(got) == 9 * 4
    assert sum(rows_fed) == 5 + 3 + 9 * 3  # each distinct prompt once; three decode rows per sample


@pytest.mark.parametrize("batch_size", [None, 1, 4])
def test_each_sample_is_its_own_seeded_stream(tiny, batch_size):
    """Sample j of prompt p is sequence p * n + j, sampled from default_rng([seed, p * n + j]): replayed
    alone with prefill, decode_step and that stream. Catches: samples that copy the first one's token or
    stream, a sample whose cache misses the prompt's rows, indices that do not follow p * n + j."""
    prompts, n = [[3, 1, 4, 1, 5, 9, 2], [6], [2, 7, 1, 8]], 3
    sampler = g.Sampler(temperature=2.0, top_k=100)
    got = {}
    for i, token in g.generate_batch(prompts, tiny, max_new_tokens=5, temperature=2.0, top_k=100, seed=7, n=n,
                                     stop_at_eos=False, batch_size=batch_size):
        got.setdefault(i, []).append(token)
    assert sorted(got) == list(range(len(prompts) * n))
    for i, tokens in got.items():
        prompt = prompts[i // n]
        stream, seq, mc = np.random.default_rng([7, i]), list(prompt), g.ModelCache(TINY)
        logits = g.prefill(seq, tiny, mc)
        for _ in range(5):
            seq.append(sampler(logits, seq, stream))
            logits = g.decode_step(seq[-1], tiny, mc)
        assert tokens == seq[len(prompt):], i
    assert len({tuple(t) for t in got.values()}) > len(prompts)  # the samples of a prompt differ


def test_greedy_samples_equal_generate_alone(tiny):
    prompt = [11, 12, 13, 14, 15, 16]
    alone = list(g.generate(prompt, tiny, max_new_tokens=6, temperature=0, stop_at_eos=False))
    got = {}
    for i, token in g.generate_batch([prompt], tiny, max_new_tokens=6, temperature=0, n=4, stop_at_eos=False):
        got.setdefault(i, []).append(token)
    assert got == {j: alone for j in range(4)}


def test_a_leader_removed_before_it_runs_hands_its_prompt_on(tiny):
    """The server may cancel the sequence that was to prefill a shared prompt before it runs: another
    takes its place. Catches: followers left waiting for rows that never come."""
    prompt = [4, 8, 15, 16, 23, 42]
    expected = int(np.argmax(g.prefill(prompt, tiny, g.ModelCache(TINY))))
    batch, shared = batching.Batch(tiny, 4), batching.SharedPrompt(3)
    seqs = [batch.add(prompt, max_new_tokens=3, sampler=g.Sampler(0.0), rng=np.random.default_rng(0),
                      shared=shared) for _ in range(3)]
    batch.remove(seqs[0])
    steps = batch.step()
    assert [(s, t) for s, t, _, _ in steps] == [(seqs[1], expected), (seqs[2], expected)]
    assert seqs[1].cache.length == seqs[2].cache.length == len(prompt)


@pytest.mark.parametrize("n", [0, -1, 1.0, True, "2"])
def test_bad_n(tiny, n):
    with pytest.raises(g.SamplingError, match=f"n must be an integer >= 1, got {n!r}"):
        g.generate_batch([[1, 2]], tiny, max_new_tokens=2, n=n)


# --- scoring by shared contexts ----------------------------------------------------------------------

@st.composite
def shared_requests(draw):
    """Contexts, each with a few continuations (some of which begin alike), and a few loose sequences.
    The first context is long enough to be shared (SHARED_MIN) and has at least two continuations."""
    seqs, counts = [], []
    for n in range(draw(st.integers(1, 3))):
        context = draw(ids(scoring.SHARED_MIN + 1 if n == 0 else 1, 40))
        lead = draw(st.sampled_from([[], [7], [7, 9, 9]]))
        for _ in range(draw(st.integers(2 if n == 0 else 1, 5))):
            ending = lead + draw(ids(1, 12))
            seq = (context + ending)[-TINY.n_positions:]
            seqs.append(np.array(seq, np.int64))
            # the ending, as the harness scores it; or any count, so that scores begin inside the shared rows
            counts.append(draw(st.one_of(st.just(min(len(ending), len(seq) - 1)), st.integers(1, len(seq) - 1))))
    for loose in draw(st.lists(ids(2, 30), max_size=3)):
        seqs.append(np.array(loose, np.int64))
        counts.append(draw(st.integers(1, len(loose) - 1)))
    order = draw(st.permutations(range(len(seqs))))
    return [seqs[i] for i in order], [counts[i] for i in order]


def whole(seq, count, w):
    """The last ``count`` tokens' log-probabilities, the sequence scored whole and alone."""
    s = g.score(seq, w)
    return s.logprobs[len(seq) - 1 - count:], s.greedy[len(seq) - 1 - count:]


@given(requests=shared_requests(), batch_rows=st.sampled_from([16, 50, 1024]))
def test_grouped_scoring_equals_whole_pairs(tiny, requests, batch_rows):
    """Continuations scored in forks of their prefilled context (the harness's loglikelihood) equal each
    (context, continuation) scored whole, within 1e-5, greedy flags alike; in passes of many sizes.

    Catches: a context one row too long (its last target differs by member), a fork at the wrong length,
    the last member's cache taken before the others forked it, context scores cut at the wrong row."""
    seqs, counts = requests
    grouped = scoring._score_ends(seqs, counts, tiny, batch_rows=batch_rows)
    assert any(len(members) > 1 for _, members in scoring._groups(seqs))  # (what this test is about)
    for seq, count, (logprobs, greedy) in zip(seqs, counts, grouped):
        want_logprobs, want_greedy = whole(seq, count, tiny)
        assert logprobs.shape == (count,)
        np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-5, rtol=0)
        np.testing.assert_array_equal(greedy, want_greedy)


@given(requests=shared_requests())
@settings(max_examples=6)
def test_score_batch_shared_equals_not_shared(tiny, requests):
    seqs, _ = requests
    shared, alone = g.score_batch(seqs, tiny, batch_rows=40), g.score_batch(seqs, tiny, share=False)
    for a, b in zip(shared, alone):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
        np.testing.assert_array_equal(a.greedy, b.greedy)


def test_groups_follow_the_contexts():
    """A context's continuations form one group, c = its length - 1 (+ the tokens they all begin with);
    a sequence that only begins one of them does not cut that group short; short shares run apart."""
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 500, 30).tolist(), rng.integers(0, 500, 25).tolist()
    seqs = [a + [1, 2], b + [3], a + [4, 5, 6], b + [4, 4], a + [1, 7], a[:12], a[:3] + [9, 9], [1, 2]]
    groups = {tuple(sorted(members)): c for c, members in scoring._groups([np.array(s) for s in seqs])}
    assert groups == {(0, 2, 4): 29, (1, 3): 24, (5,): 0, (6,): 0, (7,): 0}

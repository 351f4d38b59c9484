"""How a batch's prompts reach their caches: in chunks (a budget of prompt rows per step, a long prompt
spread over several steps), and from the prefix cache (blocks of earlier prompts, found by their tokens).

Each property names the bug it catches; each was seen to fail once with that bug planted by hand.
"""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import gpt2numba as g
from conftest import TINY, TINY_GPT2
from helpers import counted_step
from gpt2numba.decoding import batching
from gpt2numba.decoding.prefixes import BLOCK, PrefixCache

NEW_TOKENS = 3


def run(w, plan, budget, prefixes=None):
    """Step a batch over ``plan`` (prompt, copies, the step it joins at, its new tokens), every copy of a
    prompt sharing its prefill; returns each copy's [(token, logits row)] and, per step, the prompt rows it
    fed, the prompt rows there were to feed, and whether it decoded a token.
    The sampler ignores the logits and takes the planned tokens, so both runs feed the same tokens and their
    logits compare row for row however the prompts were cut."""
    batch = batching.Batch(w, sum(copies for _, copies, _, _ in plan), prefixes)
    out, fed, step, key = {}, [], 0, {}
    while batch.sequences or any(start >= step for _, _, start, _ in plan):
        for p, (prompt, copies, start, tokens) in enumerate(plan):
            if start == step:
                shared = batching.SharedPrompt(copies) if copies > 1 else None
                for c in range(copies):
                    seq = batch.add(prompt, max_new_tokens=NEW_TOKENS, rng=np.random.default_rng(0), shared=shared,
                                    sampler=lambda row, ids, rng, prompt_len, tokens=tokens: tokens[len(ids) - prompt_len])
                    key[seq] = (p, c)
                    out[p, c] = []
        results, counts = counted_step(batching.Batch.step, batch, budget)
        for seq, token, _, row in results:
            out[key[seq]].append((token, row.copy()))
        fed.append(counts)
        step += 1
    return out, fed


@st.composite
def plans(draw):
    """1-4 prompts of 1-40 ids, some beginning alike, some sampled 2-3 times, joining the batch at steps 0-3."""
    plan = []
    common = draw(st.lists(st.integers(0, TINY.vocab_size - 1), min_size=0, max_size=36))
    for _ in range(draw(st.integers(1, 4))):
        prompt = draw(st.lists(st.integers(0, TINY.vocab_size - 1), min_size=1, max_size=40))
        if draw(st.booleans()):
            prompt = (common + prompt)[:40]
        tokens = draw(st.lists(st.integers(0, TINY.vocab_size - 1), min_size=NEW_TOKENS, max_size=NEW_TOKENS))
        plan.append((prompt, draw(st.integers(1, 3)), draw(st.integers(0, 3)), tokens))
    return plan


@given(plan=plans(), budget=st.integers(1, 48))
def test_chunked_prompts_give_the_logits_of_whole_ones(tiny, plan, budget):
    """With any budget, every sequence sees the logits it sees with its prompt in one step (to 1e-5), takes
    the same tokens; no step that decodes a token feeds more prompt rows than the budget, and a step that
    decodes none feeds its prompts up to the larger idle budget (the shared copies none). Catches: a chunk
    written at the wrong positions, a token sampled from the logits of a chunk that is not the last, a copy
    that takes its leader's rows before its prompt has run, a budget spent twice or not at all, or spent in
    small chunks with no token to keep pace with."""
    whole, _ = run(tiny, plan, None)
    chunked, fed = run(tiny, plan, budget)
    for rows, pending, decoding in fed:
        assert rows <= budget if decoding else rows == min(pending, max(budget, batching.IDLE_PROMPT_ROWS))
    assert sum(rows for rows, *_ in fed) == sum(len(prompt) for prompt, *_ in plan)  # each prompt once
    assert chunked.keys() == whole.keys()
    for key, steps in whole.items():
        assert [t for t, _ in chunked[key]] == [t for t, _ in steps]
        for (_, a), (_, b) in zip(chunked[key], steps):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_a_lone_prompt_runs_in_large_chunks(tiny, monkeypatch):
    """With nothing decoding, prompts run up to IDLE_PROMPT_ROWS rows a step whatever the budget: a 60-id
    prompt and a 37-id one in one step at 100; once a sequence decodes, the budget holds again. Catches: a
    budget spent in small chunks with no token to keep pace with (a lone long prompt's first token many
    steps late), or no bound at all on an idle step."""
    monkeypatch.setattr(batching, "IDLE_PROMPT_ROWS", 100)
    batch, greedy = batching.Batch(tiny, 3), g.Sampler(0.0)
    first = batch.add(list(range(60)), max_new_tokens=3, sampler=greedy, rng=np.random.default_rng(0))
    second = batch.add(list(range(3, 40)), max_new_tokens=5, sampler=greedy, rng=np.random.default_rng(0))
    assert [seq for seq, *_ in batch.step(16)] == [first, second]
    assert first.cache.length == 60 and second.cache.length == 37
    third = batch.add(list(range(40)), max_new_tokens=2, sampler=greedy, rng=np.random.default_rng(0))
    batch.step(16)
    assert third.cache.length == 16
    lone = batching.Batch(tiny, 1)
    long = lone.add(list(range(62)), max_new_tokens=2, sampler=greedy, rng=np.random.default_rng(0))
    monkeypatch.setattr(batching, "IDLE_PROMPT_ROWS", 50)
    assert lone.step(16) == [] and long.cache.length == 50


def test_a_long_prompt_runs_beside_the_tokens_of_others(tiny):
    """A sequence in flight takes a token every step while a 60-id prompt is prefilled 16 rows a step; the
    prompt's first token comes after ceil(60 / 16) steps. Catches: a budget that holds up decode rows."""
    batch = batching.Batch(tiny, 2)
    greedy = g.Sampler(0.0)
    running = batch.add([1, 2, 3], max_new_tokens=10, sampler=greedy, rng=np.random.default_rng(0))
    batch.step(16)
    long = batch.add(list(range(60)), max_new_tokens=2, sampler=greedy, rng=np.random.default_rng(0))
    steps = [[seq for seq, *_ in batch.step(16)] for _ in range(4)]
    assert steps == [[running]] * 3 + [[running, long]]
    expected = int(np.argmax(g.prefill(list(range(60)), tiny, g.ModelCache(TINY))))
    assert long.ids[60] == expected and long.cache.length == 60


def test_a_leader_removed_mid_prompt_hands_it_on(tiny):
    """The sequence prefilling a shared prompt in chunks (beside a sequence decoding) is cancelled half-way:
    the next copy prefills it from the start, and both copies left get the prompt's logits. Catches: a
    hand-over only for leaders that had not started (copies left waiting, or copying half a prompt)."""
    prompt = list(range(5, 35))
    expected = int(np.argmax(g.prefill(prompt, tiny, g.ModelCache(TINY))))
    batch, shared = batching.Batch(tiny, 4), batching.SharedPrompt(3)
    running = batch.add([1, 2, 3], max_new_tokens=10, sampler=g.Sampler(0.0), rng=np.random.default_rng(0))
    batch.step(8)
    seqs = [batch.add(prompt, max_new_tokens=2, sampler=g.Sampler(0.0), rng=np.random.default_rng(0),
                      shared=shared) for _ in range(3)]
    assert [s for s, *_ in batch.step(8)] == [running]
    batch.remove(seqs[0])
    steps = [[(s, t) for s, t, _, _ in batch.step(8) if s is not running] for _ in range(4)]  # from the start
    assert steps[:3] == [[], [], []]  # 30 ids, 8 a step
    assert steps[3] == [(seqs[1], expected), (seqs[2], expected)]
    assert seqs[1].cache.length == seqs[2].cache.length == len(prompt)


# --- the prefix cache ------------------------------------------------------------------------------

BLOCK_BYTES = PrefixCache(TINY, 0).block_bytes


def test_a_prompt_starts_from_its_longest_cached_prefix(tiny):
    """A prompt that shares 37 ids with a stored one takes its first two blocks, row for row, and feeds the
    rest; a prompt equal to a stored one still feeds its last id; a block's ids after another block match
    nothing. Catches: blocks found by their own ids only, rows off by a block, no logits left to sample."""
    a = list(range(1, 41))
    b = a[:37] + [7, 8, 9]
    prefixes = PrefixCache(TINY, 10 * BLOCK_BYTES)
    mc_a = g.ModelCache(TINY)
    g.prefill(a, tiny, mc_a)
    prefixes.store(a, mc_a)
    assert len(prefixes) == 2 and prefixes.nbytes == 2 * BLOCK_BYTES
    mc_b = g.ModelCache(TINY)
    assert prefixes.load(b, mc_b) == 2 * BLOCK
    np.testing.assert_array_equal(mc_b.keys(), mc_a.k[:, :, : 2 * BLOCK])
    np.testing.assert_array_equal(mc_b.values(), mc_a.v[:, :, : 2 * BLOCK])
    np.testing.assert_allclose(g.prefill(b[2 * BLOCK:], tiny, mc_b), g.prefill(b, tiny, g.ModelCache(TINY)),
                               atol=1e-5, rtol=0)
    assert prefixes.load(a[: 2 * BLOCK], g.ModelCache(TINY)) == BLOCK
    c = [0] * BLOCK + [5]
    mc_c = g.ModelCache(TINY)
    g.prefill(c, tiny, mc_c)
    prefixes.store(c, mc_c)
    assert prefixes.load([0] * BLOCK + a[BLOCK : 2 * BLOCK] + [9], g.ModelCache(TINY)) == BLOCK  # not a's 2nd block
    assert (prefixes.lookups, prefixes.hits, prefixes.hit_tokens) == (3, 3, 4 * BLOCK)


@given(plan=plans(), budget=st.one_of(st.none(), st.integers(1, 48)), blocks=st.integers(0, 5))
def test_prompts_from_cached_prefixes_give_the_logits_of_whole_ones(tiny, plan, budget, blocks):
    """The plan run twice over one prefix cache of 0-5 blocks (evicting as it fills), any budget: every
    sequence sees the logits it sees with no cache (to 1e-5); the cache never holds more than its bound,
    and each block it keeps follows a block it keeps; the rows fed are the prompts' less those found.
    Catches: a block's rows off by one block, eviction past the bound or of a block others follow, rows
    counted as found but not copied."""
    whole, _ = run(tiny, plan, None)
    prefixes = PrefixCache(TINY, blocks * BLOCK_BYTES)
    for _ in range(2):
        found = prefixes.hit_tokens
        cached, fed = run(tiny, plan, budget, prefixes)
        fed_rows = sum(rows for rows, *_ in fed)
        assert fed_rows == sum(len(prompt) for prompt, *_ in plan) - (prefixes.hit_tokens - found)
        assert len(prefixes) <= blocks
        assert all(block.key[0] is None or block.key[0] in prefixes._recent for block in prefixes._recent)
        for key, steps in whole.items():
            assert [t for t, _ in cached[key]] == [t for t, _ in steps]
            for (_, a), (_, b) in zip(cached[key], steps):
                np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_the_server_answers_the_same_with_chunks_and_cached_prefixes():
    """Concurrent requests sharing a 40-id beginning, greedy and seeded, n = 2: the same choices from a
    server with a prefix cache and 8-row chunks as from one with neither; the cache was used. Catches: a
    request's rows mixed with another's, a chunk or a cached prefix that changes what is sampled."""
    pytest.importorskip("starlette", reason="the server needs the [serve] extra")
    pytest.importorskip("prometheus_client", reason="the server needs the [serve] extra")
    from prometheus_client.parser import text_string_to_metric_families
    from starlette.testclient import TestClient

    from gpt2numba import serve

    w, tok = g.random_weights(TINY_GPT2, seed=3), g.load_tokenizer()
    rng = np.random.default_rng(0)
    common = rng.integers(0, TINY_GPT2.vocab_size, 40).tolist()
    bodies = [{"prompt": common + rng.integers(0, TINY_GPT2.vocab_size, 3 + i).tolist(), "max_tokens": 5,
               "ignore_eos": True, "n": 2, **({"temperature": 0} if i % 2 else {"temperature": 0.8, "seed": i})}
              for i in range(6)]

    def answers(**options):
        with TestClient(serve.create_app(w, tok, max_batch=4, **options)) as client:
            with ThreadPoolExecutor(len(bodies)) as pool:
                out = list(pool.map(lambda body: client.post("/v1/completions", json=body).json(), bodies))
            metrics = {s.name: s.value for family in text_string_to_metric_families(client.get("/metrics").text)
                       for s in family.samples}
            return [[c["text"] for c in r["choices"]] for r in out], client.app.state.engine.prefixes, metrics

    plain, none, _ = answers(prefix_cache_mb=0, max_step_tokens=1024)
    reused, prefixes, metrics = answers(prefix_cache_mb=1, max_step_tokens=8)
    assert none is None and reused == plain
    assert prefixes.hits >= 2  # (at least the requests that start once the first ones have finished)
    assert metrics["gpt2numba_prefix_cache_hits_total"] == prefixes.hits
    assert metrics["gpt2numba_prefix_cache_bytes"] == prefixes.nbytes > 0

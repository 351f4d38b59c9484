"""Caches that share history read each other's rows in place: the same bits as caches that copy, no row
written under another cache, nothing kept alive once every cache has gone.

Each cache here has a twin that never shares: it takes the same calls, but where the cache forks or copies a
prefix (by reference), the twin gets copies of the rows (ModelCache.extend). After every operation each
cache holds its twin's rows and gives its twin's logits, to the bit.
"""

import gc
import weakref

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import gpt2numba as g
from conftest import TINY
from gpt2numba.decoding import batching, prefixes

MAX_LEN = 40


def copied(twin, n, max_len):
    """A cache that holds twin's first n rows as copies of its own."""
    mc = g.ModelCache(TINY, max_len, twin.dtype)
    if n:
        mc.extend(*(twin._public(rows).copy() for rows in twin._rows(0, n)))
    return mc


def assert_same(mc, twin):
    assert (mc.length, mc.max_len) == (twin.length, twin.max_len) and (mc.lengths == twin.lengths).all()
    np.testing.assert_array_equal(mc.keys(), twin.keys())
    np.testing.assert_array_equal(mc.values(), twin.values())


operations = st.lists(st.tuples(st.sampled_from(["fork", "copy", "cut", "write", "decode", "drop"]),
                                st.integers(0, 3), st.integers(0, 3), st.integers(0, MAX_LEN),
                                st.lists(st.integers(0, TINY.vocab_size - 1), min_size=1, max_size=9)),
                      min_size=1, max_size=14)


@given(ops=operations, kv_dtype=st.sampled_from(["float32", "float16", "bfloat16"]), data=st.data())
def test_shared_caches_hold_and_give_what_copies_would(tiny, ops, kv_dtype, data):
    """Forks, prefix copies (of another cache, or of itself: a cut), prefills, decode steps and caches
    dropped, in any order: every cache equals its twin after each step, and its logits are the twin's.

    Catches: a write landing in rows another cache reads (the source changed by its fork's prefill, or a
    fork changed by its source cut and refilled), runs off by one at their ends, the wrong store read for a
    run, logits of a history in runs that differ from one in a single array (a gather out of order)."""
    first = data.draw(st.lists(st.integers(0, TINY.vocab_size - 1), min_size=1, max_size=20))
    caches = [g.ModelCache(TINY, MAX_LEN, kv_dtype)]
    twins = [g.ModelCache(TINY, MAX_LEN, kv_dtype)]
    for mc in (caches[0], twins[0]):
        g.prefill(first, tiny, mc)
    for op, i, j, n, tokens in ops:
        i, j = i % len(caches), j % len(caches)
        mc, twin = caches[i], twins[i]
        n = min(n, mc.length)
        if op == "fork":
            caches.append(mc.fork(n))
            twins.append(copied(twin, n, twin.max_len))
        elif op == "copy":
            caches[j].copy_prefix(mc, n)
            twins[j] = copied(twin, n, twin.max_len) if i != j else twin
            if i == j:
                twin.copy_prefix(twin, n)
        elif op == "cut":
            mc.copy_prefix(mc, n)
            twin.copy_prefix(twin, n)
        elif op in ("write", "decode") and mc.room:
            tokens = tokens[: mc.room]
            if op == "decode":
                out, ref = g.decode_step(tokens[0], tiny, mc), g.decode_step(tokens[0], tiny, twin)
            else:
                out, ref = g.prefill(tokens, tiny, mc, logits="all"), g.prefill(tokens, tiny, twin, logits="all")
            np.testing.assert_array_equal(out, ref)
        elif op == "drop" and len(caches) > 1:
            del caches[i], twins[i]
        for mc, twin in zip(caches, twins):
            assert_same(mc, twin)


@given(ops=operations)
def test_rows_live_only_while_a_cache_reads_them(tiny, ops):
    """Once every cache that reads an array has gone, the array goes too (nothing keeps rows alive: no
    leak however forks, copies and cuts mix); while one cache reads it, it stays."""
    caches = [g.ModelCache(TINY, MAX_LEN)]
    g.prefill([1, 2, 3, 4, 5], tiny, caches[0])
    arrays = weakref.WeakValueDictionary()

    def track():
        for mc in caches:
            for k, v, *_ in mc.segments() + [(mc._k, mc._v)]:
                arrays[id(k)], arrays[id(v)] = k, v

    for op, i, j, n, tokens in ops:
        i, j = i % len(caches), j % len(caches)
        mc = caches[i]
        n = min(n, mc.length)
        if op == "fork":
            caches.append(mc.fork(n))
        elif op == "copy":
            caches[j].copy_prefix(mc, n)
        elif op == "cut":
            mc.copy_prefix(mc, n)
        elif op in ("write", "decode") and mc.room:
            g.prefill(tokens[: mc.room], tiny, mc)
        elif op == "drop" and len(caches) > 1:
            del caches[i]
        track()
    read = {id(a) for mc in caches for k, v, *_ in mc.segments() for a in (k, v)}
    del mc
    gc.collect()
    assert read <= set(arrays.keys())  # (all still alive)
    caches.clear()
    gc.collect()
    assert not list(arrays.keys())


def test_a_fork_reads_its_source_in_place_and_copies_on_write(tiny):
    """A fork holds no rows of its own until it writes; the source cut below what it lent and refilled
    writes elsewhere, and the fork keeps reading the rows it forked."""
    source = g.ModelCache(TINY, MAX_LEN)
    g.prefill(list(range(1, 21)), tiny, source)
    fork = source.fork()
    assert fork.shared == 20 and fork.segments()[0][0] is source._k
    before = fork.keys().copy()
    source.reset()
    g.prefill([7, 7, 7], tiny, source)
    assert source._k is not fork.segments()[0][0]  # new arrays: the lent rows stay as they were
    np.testing.assert_array_equal(fork.keys(), before)
    g.decode_step(3, tiny, fork)
    assert fork.shared == 20 and fork.length == 21
    assert np.shares_memory(fork.k, fork._k) and fork.shared == 0  # .k gives the whole history as its own arrays
    np.testing.assert_array_equal(fork.keys()[:, :, :20], before)


def test_a_prefix_cache_hit_reads_the_blocks_in_place(tiny):
    """A prompt whose blocks are cached reads them where the prefix cache keeps them, and gives the logits
    of the prompt prefilled whole (the same rows); the blocks are never written."""
    cache = prefixes.PrefixCache(TINY, max_bytes=2**22)
    prompt = list(range(1, 2 * prefixes.BLOCK + 5))
    first = g.ModelCache(TINY, MAX_LEN)
    g.prefill(prompt, tiny, first)
    cache.store(prompt, first)
    mc = g.ModelCache(TINY, MAX_LEN)
    assert cache.load(prompt, mc) == 2 * prefixes.BLOCK and mc.shared == 2 * prefixes.BLOCK
    blocks = [(k.copy(), v.copy()) for k, v, *_ in mc.segments()]
    ref = g.ModelCache(TINY, MAX_LEN)
    ref.extend(*(first._public(rows) for rows in first._rows(0, 2 * prefixes.BLOCK)))
    np.testing.assert_array_equal(g.prefill(prompt[2 * prefixes.BLOCK:], tiny, mc, logits="all"),
                                  g.prefill(prompt[2 * prefixes.BLOCK:], tiny, ref, logits="all"))
    for (k, v, *_), (k0, v0) in zip(mc.segments(), blocks):
        np.testing.assert_array_equal(k, k0)
        np.testing.assert_array_equal(v, v0)


@given(blocks=st.integers(1, 3), extra=st.integers(0, prefixes.BLOCK - 1), prompts=st.integers(1, 4))
def test_a_prefix_cache_never_holds_more_than_its_bound(tiny, blocks, extra, prompts):
    """Stores that land exactly on the bound, and past it, keep the prefix cache within max_bytes."""
    block_bytes = prefixes.PrefixCache(TINY, 0).block_bytes
    cache = prefixes.PrefixCache(TINY, max_bytes=blocks * block_bytes + extra)
    for p in range(prompts):
        prompt = [p + 1] + list(range(1, min(blocks + p, 4) * prefixes.BLOCK))  # blocks, or past them
        mc = g.ModelCache(TINY)
        g.prefill(prompt, tiny, mc)
        cache.store(prompt, mc)
        assert len(cache) <= blocks and cache.nbytes <= blocks * block_bytes + extra
    assert len(cache) == blocks


def test_n_choices_of_a_prompt_read_its_rows_in_place(tiny):
    """A batch's sequences of one prompt hold the prompt once: the first prefills it, the others read its rows
    (Batch.positions counts them), and each goes on as it would alone."""
    prompt = list(range(1, 12))
    greedy = lambda logits, ids, rng, prompt_len: int(np.argmax(logits))  # noqa: E731
    batch, shared = batching.Batch(tiny, 4), batching.SharedPrompt(3)
    seqs = [batch.add(prompt, max_new_tokens=3, sampler=greedy, rng=np.random.default_rng(0), shared=shared)
            for _ in range(3)]
    batch.step()
    assert batch.positions() == (len(prompt), 2 * len(prompt))
    while batch.sequences:
        batch.step()
    alone = g.ModelCache(TINY)
    ids = prompt + [int(np.argmax(g.prefill(prompt, tiny, alone)))]
    for _ in range(2):
        ids.append(int(np.argmax(g.decode_step(ids[-1], tiny, alone))))
    assert all(s.ids == ids for s in seqs)

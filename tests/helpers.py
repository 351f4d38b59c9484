"""Checks shared by the property tests and the mutant tests that prove they can fail."""

import numpy as np

import gpt2numba as g
from gpt2numba.model import oracle
from conftest import record_diff



def randn(rng, *shape, scale=1.0):
    """A float32 array of ``shape``, normal with standard deviation ``scale``."""
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def assert_matches_oracle(logits, ids, w, label, ref=None):
    """Cached logits against recompute_logits over the whole sequence ``ids`` (or ``ref``, the oracle's logits
    after ``ids``, already computed). Returns the oracle's logits."""
    ref = g.recompute_logits(ids, w) if ref is None else ref
    assert logits.dtype == np.float32 and logits.shape == (w.config.vocab_size,)
    record_diff(f"{label}, {len(ids)} tokens", float(np.abs(logits - ref).max()))
    ok, why = oracle.agreement(logits, ref, w)
    assert ok, f"{why} at {len(ids)} tokens"
    return ref


def check_prefill(ids, w, label):
    """Fresh cache, prefill ``ids``: exactly len(ids) rows per layer, logits equal the oracle's (returned)."""
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
    return assert_matches_oracle(logits, ids, w, label)


def check_chunks(ids, cuts, w, label):
    """Prefill ids[:cuts[0]], then chunks (decode_step for one-token chunks): oracle at every step."""
    mc = g.ModelCache(w.config)
    refs = oracle.recompute_all_logits(ids, w)  # one pass: the logits after a position depend on none after it
    bounds = [0, *cuts, len(ids)]
    for lo, hi in zip(bounds, bounds[1:]):
        assert mc.length == lo
        if hi - lo == 1 and lo > 0:
            logits = g.decode_step(int(ids[lo]), w, mc)
        else:
            logits = g.prefill(ids[lo:hi], w, mc)
        assert mc.length == hi and (mc.lengths == hi).all()
        assert_matches_oracle(logits, ids[:hi], w, label, ref=refs[hi - 1])


LENGTHS = (1, 3, 40, 7, 55, 2, 20)  # prompts of very different lengths, more of them than a batch
SENTINEL = 7.0  # fills every cache first: a row written past a sequence's length shows


def check_batch_rounds(plans, w, label, random, max_len=None):
    """Feed ragged sequences through rounds of prefill_batch / decode_batch; check everything after each.

    plans: (ids, prefix, cuts) per sequence: ids[:prefix] is prefilled alone first (a cache that
    starts non-empty), then the pieces between the cuts are fed, one per round, to a random subset
    of the sequences that have pieces left. A round of one-token pieces goes through decode_batch
    half the time. Caches have a little room to spare, or ``max_len`` each. After every round: each fed row equals the oracle of its own sequence so far,
    every cache holds exactly its own length in every layer, and nothing past it.
    """
    cfg = w.config
    caches = [g.ModelCache(cfg, max_len=max_len or min(cfg.n_positions, len(ids) + random.randint(0, 3)))
              for ids, _, _ in plans]
    for mc in caches:
        mc.k[...] = SENTINEL
        mc.v[...] = SENTINEL
    pieces = []
    for (ids, prefix, cuts), mc in zip(plans, caches):
        if prefix:
            g.prefill(ids[:prefix], w, mc)
        bounds = [prefix, *cuts, len(ids)]
        pieces.append(list(zip(bounds, bounds[1:])))
    while any(pieces):
        open_ = [b for b, p in enumerate(pieces) if p]
        chosen = sorted(random.sample(open_, random.randint(1, len(open_))))
        fed = [pieces[b].pop(0) for b in chosen]
        if all(hi - lo == 1 for lo, hi in fed) and random.random() < 0.5:
            rows = g.decode_batch([int(plans[b][0][lo]) for b, (lo, _) in zip(chosen, fed)], w,
                                  [caches[b] for b in chosen])
        else:
            rows = g.prefill_batch([plans[b][0][lo:hi] for b, (lo, hi) in zip(chosen, fed)], w,
                                   [caches[b] for b in chosen])
        assert rows.shape == (len(chosen), cfg.vocab_size)
        for row, b, (_, hi) in zip(rows, chosen, fed):
            assert_matches_oracle(row, plans[b][0][:hi], w, label)
        for (ids, _, _), mc, left in zip(plans, caches, pieces):
            length = left[0][0] if left else len(ids)
            assert mc.length == length and (mc.lengths == length).all(), f"{mc.lengths} != {length}"
            assert (mc.k[:, :, length:] == SENTINEL).all() and (mc.v[:, :, length:] == SENTINEL).all(), \
                "a row past a sequence's length was written"
            assert not (mc.keys() == SENTINEL).all(axis=-1).any(), "a row below a sequence's length is missing"


def check_generate_batch(prompts, w, batch_size, max_new_tokens=8):
    """Greedy generate_batch gives each prompt the tokens greedy generate gives it alone."""
    got = {}
    for i, token in g.generate_batch(prompts, w, max_new_tokens=max_new_tokens, temperature=0,
                                     stop_at_eos=False, batch_size=batch_size):
        got.setdefault(i, []).append(token)
    for i, ids in enumerate(prompts):
        alone = list(g.generate(ids, w, max_new_tokens=max_new_tokens, temperature=0, stop_at_eos=False))
        assert got[i] == alone, f"prompt {i}: {got[i]} != {alone} alone"


def hold_after_first_step(monkeypatch):
    """Batch.step patched: once ``armed`` is set, the first step to end sets ``stepped`` and waits there (on
    the engine thread, its events not yet out) until ``go`` is set. Returns (armed, stepped, go)."""
    import threading

    from gpt2numba.decoding.batching import Batch

    armed, stepped, go = threading.Event(), threading.Event(), threading.Event()
    step = Batch.step

    def held_step(self, max_prompt_rows=None):
        out = step(self, max_prompt_rows)
        if armed.is_set() and not go.is_set():
            stepped.set()
            go.wait(600)
        return out

    monkeypatch.setattr(Batch, "step", held_step)
    return armed, stepped, go


def counted_step(step, batch, budget):
    """Run ``step`` (Batch.step, or the original under a patch) on ``batch`` with ``budget``; return its
    result and (the prompt rows it fed, the prompt rows there were to feed, whether a sequence decoded)."""
    before = {s: s.cache.length for s in batch.sequences if s.new_tokens == 0 and s.feed}  # prompts to feed
    caches, pending = {s: s.cache for s in before}, sum(len(s.feed) for s in before)
    decoding = any(s.new_tokens > 0 and s.feed for s in batch.sequences)
    out = step(batch, budget)
    return out, (sum(caches[s].length - n for s, n in before.items()), pending, decoding)

"""The property checks can fail: plant each bug they claim to catch and watch them fail.

Every test swaps one piece of the engine for a broken copy (monkeypatch undoes it)
and runs the same checks test_prefill.py uses.
"""

import dataclasses
import random

import numpy as np
import pytest

import gpt2numba as g
import helpers
import test_score
from conftest import TINY
from gpt2numba.cpu import attention, intkernels, inttiles
from gpt2numba.model import compact, forward, products

CAUGHT = (AssertionError, g.GPT2NumbaError)
PROMPTS = [np.random.default_rng(7).integers(0, TINY.vocab_size, n).tolist() for n in helpers.LENGTHS]


@pytest.fixture(autouse=True)
def quiet(monkeypatch):
    monkeypatch.setattr(helpers, "record_diff", lambda *a: None)  # keep mutants out of the summary


@pytest.fixture
def ids():
    return np.random.default_rng(5).integers(0, TINY.vocab_size, 20)


@pytest.fixture
def plans():
    """Three ragged sequences, one starting from a cache that holds a prefix (see helpers.check_batch_rounds)."""
    rng = np.random.default_rng(6)
    return [(rng.integers(0, TINY.vocab_size, 12), 0, [5, 6]),
            (rng.integers(0, TINY.vocab_size, 20), 4, [9, 10]),
            (rng.integers(0, TINY.vocab_size, 3), 0, [])]


def check_batch(plans, w):
    helpers.check_batch_rounds(plans, w, "mutant", random.Random(0), max_len=TINY.n_positions)


def test_sound_engine_passes(tiny, ids, plans):
    helpers.check_prefill(ids, tiny, "control")
    helpers.check_chunks(ids, [8, 9, 15], tiny, "control")
    check_batch(plans, tiny)
    helpers.check_generate_batch(PROMPTS, tiny, batch_size=3)


def test_catches_wpe_off_by_one(tiny, ids, monkeypatch):
    real = forward._embed
    monkeypatch.setattr(forward, "_embed", lambda ids, positions, w: real(ids, positions + 1, w))
    with pytest.raises(CAUGHT):
        helpers.check_prefill(ids, tiny, "mutant")


def test_catches_positions_restarting_per_chunk(tiny, ids, monkeypatch):
    real = forward._embed
    monkeypatch.setattr(forward, "_embed", lambda ids, positions, w: real(ids, positions - positions[0], w))
    helpers.check_prefill(ids, tiny, "mutant")  # a fresh cache starts at 0 anyway
    with pytest.raises(CAUGHT):
        helpers.check_chunks(ids, [8, 9, 15], tiny, "mutant")


def test_catches_mask_leaking_the_next_position(tiny, ids, monkeypatch):
    def leaky(qkv, ks, vs, runs, run0, layer, row0, pos0, tiles, bounds, out, scratch, *flags):
        # one sequence: query j sits at pos0 + j but is handed positions up to pos0 + j + 1
        T = qkv.shape[0]
        for rows, start in ((slice(0, T - 1), pos0 + 1), (slice(T - 1, T), pos0 + T - 1)):  # no row past the last
            sub_row0 = np.array([0, len(range(T)[rows])])
            plan = attention._attention_plan(sub_row0, start, TINY.n_head, scratch.shape[0])
            attention._attend(qkv[rows], ks, vs, runs, run0, layer, sub_row0, start, *plan, out[rows], scratch, *flags)
    monkeypatch.setattr(forward, "_attend", leaky)
    with pytest.raises(CAUGHT):
        helpers.check_prefill(ids, tiny, "mutant")


def test_catches_transposed_conv1d_weight(tiny, ids, monkeypatch):
    real = forward.forward_pass
    flipped = dataclasses.replace(tiny, attn_c_proj_w=tiny.attn_c_proj_w.transpose(0, 2, 1).copy())
    monkeypatch.setattr(forward, "forward_pass",
                        lambda seqs, w, caches, *rest, **kw: real(seqs, flipped, caches, *rest, **kw))
    with pytest.raises(CAUGHT):
        helpers.check_prefill(ids, tiny, "mutant")


def test_catches_a_layer_skipping_its_cache_write(tiny, ids, monkeypatch):
    real = forward._write_kv
    monkeypatch.setattr(forward, "_write_kv", lambda qkv, ks, vs, runs, run0, row0, pos0, layer, *rest:
                        None if layer == 1 else real(qkv, ks, vs, runs, run0, row0, pos0, layer, *rest))
    with pytest.raises(CAUGHT):
        helpers.check_prefill(ids, tiny, "mutant")


def test_catches_a_write_past_the_prompt(tiny, ids, monkeypatch):
    real = forward._write_kv

    def one_row_too_many(qkv, ks, vs, runs, run0, row0, pos0, layer, written, *flags):  # one sequence
        real(np.vstack([qkv, qkv[-1:]]), ks, vs, runs, run0, row0 + [0, 1], pos0, layer, written, *flags)
        written[:, layer] -= 1
    monkeypatch.setattr(forward, "_write_kv", one_row_too_many)
    with pytest.raises(CAUGHT):
        helpers.check_prefill(ids, tiny, "mutant")


# --- the batch path ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kernel", ["_attend", "_write_kv"])
def test_catches_a_sequence_using_another_sequences_cache(tiny, plans, monkeypatch, kernel):
    """Attention that reads, or a cache write that lands in, sequence b + 1's cache instead of b's."""
    real = getattr(forward, kernel)

    def neighbours(qkv, ks, vs, runs, run0, *rest):
        # each sequence's runs become the next one's (one sequence's cache comes as its array: kernels._cache_of)
        if not isinstance(ks, np.ndarray):
            runs = runs.copy()
            runs[:, 0] = (runs[:, 0] + 1) % len(ks)
        real(qkv, ks, vs, runs, run0, *rest)
    monkeypatch.setattr(forward, kernel, neighbours)
    helpers.check_prefill(np.arange(9), tiny, "mutant")  # one sequence uses its own cache anyway
    with pytest.raises(CAUGHT):
        check_batch(plans, tiny)


def test_catches_positions_taken_from_the_batch_index(tiny, plans, monkeypatch):
    real = forward._embed
    monkeypatch.setattr(forward, "_embed", lambda ids, positions, w: real(ids, np.arange(len(ids)), w))
    helpers.check_prefill(np.arange(9), tiny, "mutant")  # the same positions for one fresh sequence
    with pytest.raises(CAUGHT):
        check_batch(plans, tiny)


def test_catches_a_joining_sequence_fed_only_its_last_token(tiny, monkeypatch):
    from gpt2numba.decoding import batching

    def last_token_only(seq):  # the prompt's other tokens never reach the cache
        seq.prompt_len, seq.feed = len(seq.ids), seq.ids[-1:]
    helpers.check_generate_batch(PROMPTS[:1], tiny, batch_size=3)
    monkeypatch.setattr(batching.Sequence, "__post_init__", last_token_only)
    helpers.check_generate_batch([p[-1:] for p in PROMPTS], tiny, batch_size=3)  # one-token prompts: no difference
    with pytest.raises(CAUGHT):
        helpers.check_generate_batch(PROMPTS, tiny, batch_size=3)


# --- scoring ------------------------------------------------------------------------------------------

def test_catches_a_log_softmax_without_the_maximum(tiny, monkeypatch):
    from gpt2numba.text import scoring as score

    def no_max(wte, scale, h, targets, logprob, best, n_chunks):  # exp(logit) summed as it comes
        logits = h @ wte.T  # float32, as the kernel's
        with np.errstate(over="ignore", invalid="ignore"):
            lse = np.log(np.exp(logits).sum(axis=1))
        logprob[:] = np.where(targets >= 0, logits[np.arange(len(h)), targets] - lse, np.nan)
        best[:] = logits.argmax(axis=1)
    test_score.check_score(np.arange(20), tiny, "control")
    monkeypatch.setattr(score, "_head_log_softmax", no_max)
    test_score.check_score(np.arange(20), tiny, "mutant")  # small logits: no overflow, no difference
    with pytest.raises(CAUGHT):
        test_score.test_score_large_logits(tiny, np.random.default_rng(1234))


def test_catches_windows_that_score_the_overlap_twice(tiny, monkeypatch):
    from gpt2numba.text import scoring as score

    def overlapping(ids, w, stride, kv_dtype):  # each window scores all its tokens, the overlap again
        logprobs, greedy = np.full(len(ids) - 1, np.nan), np.zeros(len(ids) - 1, bool)
        for begin in range(0, len(ids), stride):
            end = min(begin + w.config.n_positions, len(ids))
            lp, gr = score._score_windows([ids[begin:end]], w, kv_dtype)[0]
            logprobs[begin:end - 1], greedy[begin:end - 1] = lp, gr
            if end == len(ids):
                break
        return score.Score(logprobs, greedy)
    monkeypatch.setattr(score, "_windows", overlapping)
    ids = np.random.default_rng(3).integers(0, TINY.vocab_size, 2 * TINY.n_positions)
    test_score.check_windows(ids, tiny, TINY.n_positions)  # no overlap, no difference
    with pytest.raises(CAUGHT):
        test_score.check_windows(ids, tiny, 16)


def test_catches_scoring_a_token_from_its_own_logits(tiny, monkeypatch):
    from gpt2numba.text import scoring as score

    monkeypatch.setattr(score, "_targets", lambda ids: ids.copy())  # position i "predicts" ids[i]
    with pytest.raises(CAUGHT):
        test_score.check_score(np.arange(20), tiny, "mutant")


# --- the integer formats ------------------------------------------------------------------------------

def _int_rows_mutant(monkeypatch, change):
    """The integer products (products.py) with (quantised x, x scales, w, w scales) changed by ``change`` first."""
    def int_matmul(x, xq, xs, w, scale, *rest):
        intkernels._quantize_rows(x, xq, xs)
        intkernels._int_rows(*change(xq, xs, w, scale), *rest)
    monkeypatch.setattr(products, "_int_matmul", int_matmul)

    def tiles_matmul(x, xq, xs, xw, w, scale, *rest):  # and past INT_ROWS_MAX rows
        inttiles._lay_out_rows(x, xq, xs, xw)
        xw, xs, w, scale = change(xw, xs, w, scale)
        inttiles._int_tiles(xw, xs, x.shape[0], w, scale, *rest)
    monkeypatch.setattr(inttiles, "_tiles_matmul", tiles_matmul)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_sound_integer_engine_passes(tiny, ids, dtype):
    w = tiny.astype(dtype)
    helpers.check_prefill(ids, w, "control")
    helpers.check_chunks(ids, [8, 9, 15], w, "control")


def test_catches_int4_nibbles_read_in_the_other_order(tiny, ids, monkeypatch):
    _int_rows_mutant(monkeypatch, lambda xq, xs, w, scale: (xq, xs, (w >> 4) | (w << 4) if w.dtype == np.uint8 else w,
                                                             scale))
    with pytest.raises(CAUGHT):
        helpers.check_prefill(ids, tiny.astype("int4"), "mutant")


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_catches_a_scale_taken_from_the_next_group(tiny, ids, dtype, monkeypatch):
    _int_rows_mutant(monkeypatch, lambda xq, xs, w, scale: (xq, xs, w, np.roll(scale, -1, axis=1)))
    with pytest.raises(CAUGHT):
        helpers.check_prefill(ids, tiny.astype(dtype), "mutant")


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_catches_the_activation_scale_dropped(tiny, ids, dtype, monkeypatch):
    _int_rows_mutant(monkeypatch, lambda xq, xs, w, scale: (xq, np.ones_like(xs), w, scale))
    with pytest.raises(CAUGHT):
        helpers.check_prefill(ids, tiny.astype(dtype), "mutant")


# --- compact caches (tests/test_kv_dtype.py) ------------------------------------------------------------

@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16"])
def test_catches_a_compact_cache_read_in_the_other_format(tiny, ids, monkeypatch, kv_dtype):
    """Attention that widens float16 bits as bfloat16 (or the reverse), the writes right."""
    import test_kv_dtype

    monkeypatch.setattr(test_kv_dtype, "record_diff", lambda *a: None)
    real = forward._attend
    mc = g.ModelCache(TINY, dtype=kv_dtype)
    test_kv_dtype.check_logits(g.prefill(ids, tiny, mc), ids, tiny, kv_dtype, "control")
    monkeypatch.setattr(forward, "_attend", lambda *args: real(*args[:-3], not args[-3], *args[-2:]))  # half
    mc = g.ModelCache(TINY, dtype=kv_dtype)
    with pytest.raises(CAUGHT):
        test_kv_dtype.check_logits(g.prefill(ids, tiny, mc), ids, tiny, kv_dtype, "mutant")


def test_catches_a_float16_cache_that_rounds_to_bfloat16(tiny, ids, monkeypatch):
    """Writes that keep 8 significant bits instead of 11, read back in the right format: a value off by
    up to 2^-8 rather than 2^-11 (the rounded reference tells them apart)."""
    import test_kv_dtype

    monkeypatch.setattr(test_kv_dtype, "record_diff", lambda *a: None)
    real = forward._write_kv

    def coarse(qkv, *rest):
        real(compact.from_bfloat16(compact.to_bfloat16(qkv)).reshape(qkv.shape), *rest)
    monkeypatch.setattr(forward, "_write_kv", coarse)
    mc = g.ModelCache(TINY, dtype="float16")
    with pytest.raises(CAUGHT):
        test_kv_dtype.check_logits(g.prefill(ids, tiny, mc), ids, tiny, "float16", "mutant")

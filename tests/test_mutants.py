"""The property checks can fail: plant each bug they claim to catch and watch them fail.

Every test swaps one piece of the engine for a broken copy (monkeypatch undoes it)
and runs the same checks test_prefill.py uses.
"""

import dataclasses

import numpy as np
import pytest

import gpt2numba as g
import helpers
from conftest import TINY
from gpt2numba import kernels, kvcache

CAUGHT = (AssertionError, g.GPT2NumbaError)


@pytest.fixture(autouse=True)
def quiet(monkeypatch):
    monkeypatch.setattr(helpers, "record_diff", lambda *a: None)  # keep mutants out of the summary


@pytest.fixture
def ids():
    return np.random.default_rng(5).integers(0, TINY.vocab_size, 20)


def test_sound_engine_passes(tiny, ids):
    helpers.check_prefill(ids, tiny, "control")
    helpers.check_chunks(ids, [8, 9, 15], tiny, "control")


def test_catches_wpe_off_by_one(tiny, ids, monkeypatch):
    monkeypatch.setattr(kvcache, "_embed", lambda ids, start, w: w.wte[ids] + w.wpe[start + 1:start + 1 + len(ids)])
    with pytest.raises(CAUGHT):
        helpers.check_prefill(ids, tiny, "mutant")


def test_catches_positions_restarting_per_chunk(tiny, ids, monkeypatch):
    real = kvcache._embed
    monkeypatch.setattr(kvcache, "_embed", lambda ids, start, w: real(ids, 0, w))
    helpers.check_prefill(ids, tiny, "mutant")  # a fresh cache starts at 0 anyway
    with pytest.raises(CAUGHT):
        helpers.check_chunks(ids, [8, 9, 15], tiny, "mutant")


def test_catches_mask_leaking_the_next_position(tiny, ids, monkeypatch):
    def leaky(qkv, k, v, layer, start, out, scratch):
        # query j sits at start + j but is handed positions up to start + j + 1
        T = qkv.shape[0]
        kernels._attend(qkv[:-1], k, v, layer, start + 1, out[:-1], scratch)
        kernels._attend(qkv[-1:], k, v, layer, start + T - 1, out[-1:], scratch)  # no row past the last
    monkeypatch.setattr(kvcache, "_attend", leaky)
    with pytest.raises(CAUGHT):
        helpers.check_prefill(ids, tiny, "mutant")


def test_catches_transposed_conv1d_weight(tiny, ids, monkeypatch):
    real = kvcache._forward
    flipped = dataclasses.replace(tiny, attn_c_proj_w=tiny.attn_c_proj_w.transpose(0, 2, 1).copy())
    monkeypatch.setattr(kvcache, "_forward", lambda ids, w, mc: real(ids, flipped, mc))
    with pytest.raises(CAUGHT):
        helpers.check_prefill(ids, tiny, "mutant")


def test_catches_a_layer_skipping_its_cache_write(tiny, ids, monkeypatch):
    real = kvcache._write_kv
    monkeypatch.setattr(kvcache, "_write_kv", lambda qkv, k, v, lengths, layer, start:
                        None if layer == 1 else real(qkv, k, v, lengths, layer, start))
    with pytest.raises(CAUGHT):
        helpers.check_prefill(ids, tiny, "mutant")


def test_catches_a_write_past_the_prompt(tiny, ids, monkeypatch):
    real = kvcache._write_kv

    def one_row_too_many(qkv, k, v, lengths, layer, start):
        real(np.vstack([qkv, qkv[-1:]]), k, v, lengths, layer, start)
        lengths[layer] -= 1
    monkeypatch.setattr(kvcache, "_write_kv", one_row_too_many)
    with pytest.raises(CAUGHT):
        helpers.check_prefill(ids, tiny, "mutant")

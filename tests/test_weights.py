"""Loading checkpoints written in real GPT-2 layouts, and every way a checkpoint can be wrong."""

import dataclasses
import json

import ml_dtypes
import numpy as np
import pytest

import gpt2numba as g
from checkpoints import BLOCK_KEYS, DTYPES, TOP_KEYS, config_json, write_dir, write_file
from conftest import TINY
from gpt2numba.model import compact
from helpers import assert_matches_oracle


def assert_same_weights(loaded, w, dtype="float32"):
    assert loaded.config == w.config
    for field in [*TOP_KEYS, *BLOCK_KEYS]:
        want = getattr(w, field).astype(DTYPES[dtype]).astype(np.float32)
        got = getattr(loaded, field)
        assert got.dtype == np.float32 and kept(field, got).flags.c_contiguous, field
        np.testing.assert_array_equal(got, want, err_msg=field)


def kept(field, a):
    """How float32 weights keep an array: the blocks' matrices [out, in], the rest as they are."""
    return compact.to_rows(field, a) if field in compact.BLOCK_MATRICES else a


def test_float32_block_matrices_are_kept_as_rows(tiny):
    """float32 keeps each block matrix [out, in] (an output's weights contiguous, as the few-row products read
    them) behind a read-only [in, out] view: from the constructor, astype, dequantized and a pickle alike."""
    import pickle

    C = tiny.config.n_embd
    assert tiny.c_fc_w.shape == (tiny.config.n_layer, C, 4 * C)  # the model's layout, as ever
    given = np.ascontiguousarray(tiny.c_fc_w)  # [in, out], C-contiguous: copied into rows
    built = dataclasses.replace(tiny, c_fc_w=given)
    for w in (tiny, built, tiny.astype("int8").dequantized(), pickle.loads(pickle.dumps(tiny))):
        for field in compact.BLOCK_MATRICES:
            assert kept(field, getattr(w, field)).flags.c_contiguous, field
            assert not getattr(w, field).flags.writeable
    np.testing.assert_array_equal(built.c_fc_w, given)
    assert given.flags.writeable  # the caller's array is its own
    again = dataclasses.replace(tiny)  # already kept so: no copy
    assert np.shares_memory(again.c_fc_w, tiny.c_fc_w)
    np.testing.assert_array_equal(pickle.loads(pickle.dumps(tiny)).c_attn_w, tiny.c_attn_w)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("layout", ["transformers", "openai"])
def test_directory_round_trip(tiny, tmp_path, layout, dtype):
    loaded = g.load_weights(write_dir(tiny, tmp_path, dtype, layout))
    assert_same_weights(loaded, tiny, dtype)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("layout", ["transformers", "openai"])
def test_bare_file_infers_config(tiny, tmp_path, layout, dtype):
    loaded = g.load_weights(write_file(tiny, tmp_path / "model.safetensors", dtype, layout))
    assert_same_weights(loaded, tiny, dtype)


def test_loaded_weights_run(tiny, tmp_path):
    """A loaded checkpoint gives the oracle's logits of the weights it was written from."""
    w = g.load_weights(write_dir(tiny, tmp_path, "float32", "openai"))
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    assert_matches_oracle(g.prefill(ids, w, g.ModelCache(w.config)), ids, tiny, "loaded tiny")


def test_gpt2_small_checkpoint(small, tmp_path):
    loaded = g.load_weights(write_dir(small, tmp_path))
    assert loaded.config == g.GPT2Config.small()
    assert_same_weights(loaded, small)


@pytest.mark.parametrize("size", ["small", "medium", "large", "xl"])
def test_every_gpt2_width_infers_its_heads(tmp_path, size):
    """Each size's width and head count, on two layers and a short vocabulary to stay cheap."""
    full = getattr(g.GPT2Config, size)()
    cfg = dataclasses.replace(full, n_layer=2, vocab_size=64, n_positions=32)
    w = g.random_weights(cfg, seed=0)
    assert g.load_weights(write_file(w, tmp_path / "m.safetensors")).config == cfg
    assert g.load_weights(write_dir(w, tmp_path / "dir")).config == cfg


@pytest.mark.parametrize("size, dims", [
    ("small", (12, 12, 768)), ("medium", (24, 16, 1024)), ("large", (36, 20, 1280)), ("xl", (48, 25, 1600))])
def test_size_table_and_config_json(tmp_path, size, dims):
    cfg = getattr(g.GPT2Config, size)()
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.head_dim) == (*dims, 64)
    assert (cfg.n_positions, cfg.vocab_size, cfg.layer_norm_epsilon) == (1024, 50257, 1e-5)
    (tmp_path / "config.json").write_text(json.dumps(config_json(cfg)))
    assert g.GPT2Config.from_json(tmp_path / "config.json") == cfg


def test_tied_lm_head_is_accepted(tiny, tmp_path):
    def add_head(t):
        t["lm_head.weight"] = t["transformer.wte.weight"].copy()
    assert_same_weights(g.load_weights(write_dir(tiny, tmp_path, edit=add_head)), tiny)


def test_weights_are_read_only(tiny):
    with pytest.raises(ValueError):
        tiny.c_attn_w[0, 0, 0] = 1.0


# --- bad checkpoints: the project's error, naming the problem --------------------------------

def bad(tmp_path, tiny, edit=None, config=None):
    return write_dir(tiny, tmp_path, edit=edit, config=config)


@pytest.mark.parametrize("edit, match", [
    (lambda t: t.pop("transformer.h.1.mlp.c_fc.bias"), "transformer.h.1.mlp.c_fc.bias"),
    (lambda t: t.pop("transformer.wpe.weight"), "transformer.wpe.weight"),
    (lambda t: t.update({"transformer.h.0.attn.c_attn.weight": t["transformer.h.0.attn.c_attn.weight"].T.copy()}),
     r"transformer.h.0.attn.c_attn.weight.*shape \[384, 128\], expected \[128, 384\]"),
    (lambda t: t.update({"lm_head.weight": t["transformer.wte.weight"] + 1}), "lm_head.weight"),
    (lambda t: t.update({"transformer.h.1.ln_2.weight": np.full(128, np.nan, np.float32)}),
     "transformer.h.1.ln_2.weight.*non-finite"),
    (lambda t: t.update({"transformer.ln_f.bias": np.full(128, np.inf, np.float32)}), "ln_f.bias.*non-finite"),
    (lambda t: t.update({"transformer.ln_f.bias": np.zeros(128, np.int32)}), "ln_f.bias.*I32"),
    (lambda t: t.update({"transformer.h.0.mlp.gate.weight": np.zeros(2, np.float32)}), "mlp.gate.weight"),
])
def test_bad_tensors(tiny, tmp_path, edit, match):
    with pytest.raises(g.CheckpointError, match=match):
        g.load_weights(bad(tmp_path, tiny, edit=edit))


def test_config_json_disagrees_with_tensors(tiny, tmp_path):
    cfg = config_json(dataclasses.replace(TINY, n_layer=3))
    with pytest.raises(g.CheckpointError, match="n_layer=3.*n_layer=2"):
        g.load_weights(bad(tmp_path, tiny, config=cfg))


def test_config_json_broken(tiny, tmp_path):
    bad(tmp_path, tiny)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(g.CheckpointError, match="config.json"):
        g.load_weights(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"n_layer": 2}))
    with pytest.raises(g.CheckpointError, match="n_head, n_embd"):
        g.load_weights(tmp_path)


def test_missing_paths(tmp_path):
    with pytest.raises(g.CheckpointNotFoundError, match="nowhere"):
        g.load_weights(tmp_path / "nowhere")
    with pytest.raises(g.CheckpointNotFoundError, match="model.safetensors"):
        g.load_weights(tmp_path)  # a directory without the file
    assert issubclass(g.CheckpointNotFoundError, FileNotFoundError)


def test_not_safetensors(tmp_path):
    (tmp_path / "model.safetensors").write_text("this is a text file, not a checkpoint\n")
    with pytest.raises(g.CheckpointError, match="not a readable safetensors file"):
        g.load_weights(tmp_path / "model.safetensors")


def test_truncated_file(tiny, tmp_path):
    file = write_file(tiny, tmp_path / "m.safetensors")
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 1000])
    with pytest.raises(g.CheckpointError, match="not a readable safetensors file"):
        g.load_weights(file)
    file.write_bytes(data[:100])  # cut inside the header
    with pytest.raises(g.CheckpointError, match="not a readable safetensors file"):
        g.load_weights(file)


def test_bfloat16_widens_exactly(tmp_path):
    """bfloat16 tensors become the float32 values they stand for, bit for bit."""
    w = g.random_weights(TINY, seed=4)
    loaded = g.load_weights(write_file(w, tmp_path / "m.safetensors", "bfloat16"))
    rounded = w.wte.astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(loaded.wte.view(np.uint32), rounded.view(np.uint16).astype(np.uint32) << 16)

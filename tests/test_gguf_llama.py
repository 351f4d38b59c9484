"""GGUF files written by llama.cpp's own converter (convert_hf_to_gguf.py) from a checkpoint of ours: read by
load_weights as the values they hold, and by load_tokenizer as GPT-2's tokenizer. tox's hf env fetches the
converter (tests/llama_converter.py) and has what it imports (torch, transformers)."""

import os
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest

import gpt2numba as g
from conftest import TINY_GPT2
from gpt2numba.model import oracle
from gpt2numba.model.mapped import is_mapped
from helpers import assert_matches_oracle

CONVERTER = os.environ.get("GPT2NUMBA_LLAMA_CONVERTER")
pytestmark = pytest.mark.skipif(not CONVERTER, reason="llama.cpp's converter is not here: tox -e hf fetches it "
                                                      "(tests/llama_converter.py, GPT2NUMBA_LLAMA_CONVERTER)")
IDS = [464, 2068, 7586, 21831, 18045, 625, 262, 16931, 3290, 13]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A Hugging Face GPT-2 directory of random weights, with GPT-2's vocabulary files."""
    from gpt2numba.text.tokenizer import gpt2_vocabulary_files

    folder = tmp_path_factory.mktemp("hf")
    g.save_weights(g.random_weights(TINY_GPT2, seed=3), folder)
    encoder_json, vocab_bpe = gpt2_vocabulary_files()
    shutil.copy(encoder_json, folder / "vocab.json")
    shutil.copy(vocab_bpe, folder / "merges.txt")
    return folder


def converted(checkpoint, outtype):
    out = checkpoint.parent / f"{checkpoint.name}-{outtype}.gguf"
    if not out.exists():
        done = subprocess.run([sys.executable, CONVERTER, str(checkpoint), "--outtype", outtype, "--outfile", str(out)],
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"the converter failed ({done.returncode}):\n{done.stderr[-3000:]}"
    return out


@pytest.mark.parametrize("outtype, dtype", [("f32", "float32"), ("f16", "float32"), ("bf16", "bfloat16"),
                                            ("q8_0", "int8")])
def test_llama_cpps_converter_output_loads_as_the_checkpoints_values(checkpoint, outtype, dtype, tmp_path,
                                                                      monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (each of these formats holds its file as stored: nothing rounded again)
        w = g.load_weights(converted(checkpoint, outtype), dtype=dtype)
    ref = g.load_weights(checkpoint, dtype="bfloat16" if dtype == "bfloat16" else "float32", mapped=False)
    assert is_mapped(w) and w.config == ref.config
    for field in ("wte", "c_attn_w", "attn_c_proj_w", "c_fc_w", "mlp_c_proj_w"):
        got, want = w.matrix(field), ref.matrix(field)
        if outtype == "f16":  # float16, rounded to nearest by torch
            want = want.astype(np.float16).astype(np.float32)
        if outtype == "q8_0":  # within half a step of its block (max |x| / 127; ggml keeps it in float16)
            rows = (lambda a: a) if field == "wte" else (lambda a: np.swapaxes(a, -1, -2))
            blocks = rows(want).reshape(*rows(want).shape[:-1], -1, 32)
            step = np.abs(blocks).max(axis=-1, keepdims=True) / 127
            assert (np.abs(rows(got).reshape(blocks.shape) - blocks) <= step * (0.5 + 127 / 2048) + 1e-12).all()
        else:
            np.testing.assert_array_equal(got, want, err_msg=field)
    for field in ("wpe", "ln_1_g", "c_attn_b", "mlp_c_proj_b", "ln_f_b"):  # float32 in every outtype
        np.testing.assert_array_equal(getattr(w, field), getattr(ref, field), err_msg=field)
    logits = g.prefill(IDS, w, g.ModelCache(w.config, max_len=16))
    assert_matches_oracle(logits, IDS, w, f"llama.cpp's {outtype} as {dtype}")
    # against the checkpoint itself loaded in the same format: the same weights give the same logits, and
    # rounded ones (f16, q8_0 by ggml's quantiser) agree within that format's tolerance
    from_checkpoint = g.load_weights(checkpoint, dtype=dtype, mapped=False)
    expected = g.prefill(IDS, from_checkpoint, g.ModelCache(w.config, max_len=16))
    if outtype in ("f32", "bf16"):
        np.testing.assert_array_equal(logits, expected)
    else:
        ok, why = oracle.agreement(logits, expected, w)
        assert ok, why


def test_llama_cpps_converter_output_carries_gpt2s_tokenizer(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    text = "Hello, world! It's GPT-2's own <|endoftext|> tokenizer: 12345 ünïcødé\n\n  spaces"
    tokenizer, gpt2 = g.load_tokenizer(converted(checkpoint, "f32")), g.load_tokenizer()
    assert [tokenizer.token_bytes(i) for i in range(50257)] == [gpt2.token_bytes(i) for i in range(50257)]
    assert tokenizer.encode(text) == gpt2.encode(text)
    assert tokenizer.decode(tokenizer.encode(text)) == text

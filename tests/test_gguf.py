"""GGUF files of our weights (for llama.cpp in the benchmark): read back with the gguf package's reader."""

import numpy as np
import pytest

import gpt2numba as g
from conftest import TINY_GPT2

gguf = pytest.importorskip("gguf", reason="the GGUF writer needs the gguf package (the test and peers extras)")

CONFIG = TINY_GPT2


@pytest.fixture(scope="module")
def weights():
    return g.random_weights(CONFIG, seed=1)


@pytest.mark.parametrize("fmt, atol", [("F32", 0), ("F16", 1e-3), ("Q8_0", 2e-3)])
def test_tensors_read_back_as_the_weights(weights, tmp_path, fmt, atol):
    from gpt2numba.integrations.gguf_export import write_gguf

    reader = gguf.GGUFReader(write_gguf(weights, tmp_path / f"m-{fmt}.gguf", fmt))
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == 4 + 12 * CONFIG.n_layer

    def values(name):  # [out, in] as llama.cpp holds it
        t = tensors[name]
        return gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed([int(n) for n in t.shape])))

    np.testing.assert_allclose(values("token_embd.weight"), weights.wte, atol=atol)
    np.testing.assert_array_equal(values("position_embd.weight"), weights.wpe)  # float32 in every format
    np.testing.assert_allclose(values("blk.1.attn_qkv.weight"), weights.c_attn_w[1].T, atol=atol)  # transposed
    np.testing.assert_allclose(values("blk.0.ffn_down.weight"), weights.mlp_c_proj_w[0].T, atol=atol)
    np.testing.assert_array_equal(values("blk.1.ffn_up.bias"), weights.c_fc_b[1])
    fields = reader.fields
    assert bytes(fields["general.architecture"].parts[-1]).decode() == "gpt2"
    assert int(fields["gpt2.block_count"].parts[-1][0]) == CONFIG.n_layer
    assert len(fields["tokenizer.ggml.tokens"].data) == CONFIG.vocab_size


def test_compact_weights_export_the_values_they_stand_for(weights, tmp_path):
    from gpt2numba.integrations.gguf_export import write_gguf

    w8 = weights.astype("int8")
    reader = gguf.GGUFReader(write_gguf(w8, tmp_path / "m.gguf", "F32"))
    t = next(t for t in reader.tensors if t.name == "blk.0.attn_output.weight")
    np.testing.assert_array_equal(t.data.reshape(CONFIG.n_embd, CONFIG.n_embd), w8.dequantized().attn_c_proj_w[0].T)


def test_a_vocabulary_other_than_gpt2s_is_refused(tmp_path):
    from gpt2numba.integrations.gguf_export import write_gguf

    with pytest.raises(ValueError, match="GPT-2's vocabulary"):
        write_gguf(g.random_weights(g.GPT2Config(n_layer=1, n_head=2, n_embd=64, n_positions=16, vocab_size=512)),
                   tmp_path / "m.gguf")
    with pytest.raises(ValueError, match="fmt must be one of"):
        write_gguf(g.random_weights(CONFIG), tmp_path / "m.gguf", "Q5_K")

"""GGUF files of gpt2numba's weights, for llama.cpp (the optional extra [peers]): the benchmark's peer.

Written with the gguf package (its GGUFWriter and its quantisers) in llama.cpp's
"gpt2" layout: matrices are [out, in] (the model's layout is [in, out]), one fused
attn_qkv per block, and GPT-2's own vocabulary and merges so llama.cpp can load it.
Q4_0 comes from llama.cpp's own quantiser (llama_model_quantize) over the F32
file, so it is llama.cpp's default Q4_0: the tied embedding and head in Q6_K;
or, with quantizer="gguf", from the gguf package's, with the embedding in Q8_0:
the shape of gpt2numba's int4, which loads such a file as it is stored.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..model.weights import GPT2Weights

FORMATS = ("F32", "F16", "Q8_0", "Q4_0")
# llama.cpp's tensor of each block -> our fields (weight, bias)
_LAYER = (("attn_norm", "ln_1_g", "ln_1_b"), ("attn_qkv", "c_attn_w", "c_attn_b"),
          ("attn_output", "attn_c_proj_w", "attn_c_proj_b"), ("ffn_norm", "ln_2_g", "ln_2_b"),
          ("ffn_up", "c_fc_w", "c_fc_b"), ("ffn_down", "mlp_c_proj_w", "mlp_c_proj_b"))


def write_gguf(w: GPT2Weights, path: str | Path, fmt: str = "F32", quantizer: str = "llama.cpp") -> Path:
    """The weights' float32 values as a GGUF file in ``fmt`` (F32, F16, Q8_0, or Q4_0 by ``quantizer``: see above)."""
    import gguf

    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    if quantizer not in ("llama.cpp", "gguf"):
        raise ValueError(f"quantizer must be 'llama.cpp' or 'gguf', got {quantizer!r}")
    path = Path(path)
    if fmt == "Q4_0" and quantizer == "llama.cpp":
        f32 = write_gguf(w, path.with_suffix(".f32.gguf"), "F32")
        _llama_quantize(f32, path, "Q4_0")
        f32.unlink()
        return path
    qtype = getattr(gguf.GGMLQuantizationType, fmt)
    v, cfg = w.dequantized(), w.config
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_context_length(cfg.n_positions)
    writer.add_embedding_length(cfg.n_embd)
    writer.add_feed_forward_length(4 * cfg.n_embd)
    writer.add_block_count(cfg.n_layer)
    writer.add_head_count(cfg.n_head)
    writer.add_layer_norm_eps(cfg.layer_norm_epsilon)
    writer.add_file_type({"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
                          "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[fmt])
    _vocabulary(writer, gguf, cfg.vocab_size)

    def stored(name, a):  # a matrix [out, in], in fmt (Q4_0's embedding in Q8_0)
        a = np.ascontiguousarray(a, np.float32)
        kind = gguf.GGMLQuantizationType.Q8_0 if fmt == "Q4_0" and name == "token_embd.weight" else qtype
        if fmt == "F32":
            writer.add_tensor(name, a)
        else:
            writer.add_tensor(name, gguf.quants.quantize(a, kind), raw_dtype=kind)

    def plain(name, a):  # float32 in every format
        writer.add_tensor(name, np.ascontiguousarray(a, np.float32))

    stored("token_embd.weight", v.wte)  # tied: llama.cpp's head reads it when there is no output.weight
    plain("position_embd.weight", v.wpe)  # decode reads one row of it
    plain("output_norm.weight", v.ln_f_g)
    plain("output_norm.bias", v.ln_f_b)
    for i in range(cfg.n_layer):
        for name, weight, bias in _LAYER:
            a = getattr(v, weight)[i]
            if a.ndim == 2:
                stored(f"blk.{i}.{name}.weight", a.T)  # ours are [in, out]
            else:
                plain(f"blk.{i}.{name}.weight", a)  # a layernorm's gain
            plain(f"blk.{i}.{name}.bias", getattr(v, bias)[i])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _vocabulary(writer, gguf, vocab_size: int) -> None:
    """GPT-2's tokens (byte-level strings, by id) and merges; <|endoftext|> begins and ends a text."""
    from ..text.tokenizer import EOT_ID, gpt2_vocabulary_files

    encoder_json, vocab_bpe = gpt2_vocabulary_files()
    by_id = {i: token for token, i in json.loads(encoder_json.read_text(encoding="utf-8")).items()}
    if vocab_size != len(by_id):
        raise ValueError(f"a GGUF carries GPT-2's vocabulary of {len(by_id)} tokens; these weights have {vocab_size}")
    tokens = [by_id[i] for i in range(vocab_size)]
    merges = [line for line in vocab_bpe.read_text(encoding="utf-8").splitlines()[1:] if line]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if i == EOT_ID else gguf.TokenType.NORMAL
                            for i in range(vocab_size)])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(EOT_ID)
    writer.add_eos_token_id(EOT_ID)


def _llama_quantize(source: Path, target: Path, fmt: str) -> None:
    """llama.cpp's own quantiser, with its default choices for each tensor."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{fmt}")
    if llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not quantise {source} to {fmt}")

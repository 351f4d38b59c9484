"""Write GPT-2 checkpoints in the layouts real ones use, with the safetensors library.

Written from the published key names, not from gpt2numba's loader, so that a
loader that misreads a real file fails here too.
"""

import json

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

# GPT2Weights field -> key inside block h.N (Conv1D weights are [in, out]).
BLOCK_KEYS = {
    "ln_1_g": "ln_1.weight", "ln_1_b": "ln_1.bias",
    "c_attn_w": "attn.c_attn.weight", "c_attn_b": "attn.c_attn.bias",
    "attn_c_proj_w": "attn.c_proj.weight", "attn_c_proj_b": "attn.c_proj.bias",
    "ln_2_g": "ln_2.weight", "ln_2_b": "ln_2.bias",
    "c_fc_w": "mlp.c_fc.weight", "c_fc_b": "mlp.c_fc.bias",
    "mlp_c_proj_w": "mlp.c_proj.weight", "mlp_c_proj_b": "mlp.c_proj.bias",
}
TOP_KEYS = {"wte": "wte.weight", "wpe": "wpe.weight", "ln_f_g": "ln_f.weight", "ln_f_b": "ln_f.bias"}
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def tensors(w, layout="transformers", dtype="float32"):
    """{key: array} as a checkpoint of ``layout`` stores ``w``.

    "transformers": save_pretrained's keys, prefixed "transformer.", head tied and absent.
    "openai": the bare keys of openai-community/gpt2's model.safetensors, with each
    block's causal-mask buffer h.N.attn.bias [1, 1, P, P] and attn.masked_bias.
    """
    cast = DTYPES[dtype]
    prefix = "transformer." if layout == "transformers" else ""
    out = {prefix + key: getattr(w, field).astype(cast) for field, key in TOP_KEYS.items()}
    P = w.config.n_positions
    for layer in range(w.config.n_layer):
        for field, key in BLOCK_KEYS.items():
            # (safetensors writes an array's memory as it lies: float32's block matrices are views of rows)
            out[f"{prefix}h.{layer}.{key}"] = getattr(w, field)[layer].astype(cast, order="C")
        if layout == "openai":
            out[f"h.{layer}.attn.bias"] = np.tril(np.ones((P, P), np.float32))[None, None].astype(cast)
            out[f"h.{layer}.attn.masked_bias"] = np.array(-1e4, np.float32).astype(cast)
    return out


def config_json(cfg):
    """The config.json save_pretrained writes for GPT2LMHeadModel (the fields we read, and others)."""
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "activation_function": "gelu_new",
        "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_embd": cfg.n_embd,
        "n_positions": cfg.n_positions, "n_ctx": cfg.n_positions, "vocab_size": cfg.vocab_size,
        "layer_norm_epsilon": cfg.layer_norm_epsilon, "bos_token_id": 50256, "eos_token_id": 50256,
    }


def write_dir(w, path, dtype="float32", layout="transformers", edit=None, config=None):
    """A checkpoint directory: config.json + model.safetensors. ``edit`` may change the tensors."""
    path.mkdir(parents=True, exist_ok=True)
    t = tensors(w, layout, dtype)
    if edit:
        edit(t)
    save_file(t, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config or config_json(w.config)))
    return path


def write_file(w, path, dtype="float32", layout="openai", edit=None):
    """A bare .safetensors file, no config beside it."""
    t = tensors(w, layout, dtype)
    if edit:
        edit(t)
    save_file(t, str(path))
    return path

"""llama.cpp's GPT-2 files (GGUF) read into GPT2Weights, with the gguf package (an optional extra).

A GGUF keeps each block's tensors apart, so load_weights converts one once into a stacked copy and maps
that (mapped.py), as it does a safetensors checkpoint. llama.cpp's "gpt2" layout: matrices [out, in]
(each row's inputs contiguous: ggml's ne0), one fused attn_qkv a block, the head tied to token_embd.

In float32 a tensor of any type the gguf package dequantizes holds the values it gives: for F16, BF16,
Q8_0, Q4_0 and Q6_K the file's values exactly (a float16; d x q; Q6_K's d x scale x q: products of at most
24 significant bits); types with an added minimum (Q4_1, Q4_K, ...) as float32 rounds d x q + m. The
compact formats take a file's tensors as stored where their blocks agree: Q8_0 is our int8 (32 inputs a
block, one scale, values in [-127, 127]; ggml's f16 scale widened to float32), Q4_0 our int4 (the same
nibbles: value + 8, input j of a block in byte j's low nibble, input j + 16 in its high one), BF16 our
bfloat16. Any other pairing is rounded again from the float32 values, and said with a GGUFWarning:
llama.cpp's own Q4_0 files keep the tied embedding in Q6_K, which int4 (whose wte is int8) cannot hold.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np

from ..errors import CheckpointError, ConfigError
from . import compact
from .checks import check_finite
from .compact import BLOCK_MATRICES, INTEGER, MATRICES, storage
from .config import GPT2Config
from .weights import GPT2Weights, _field_shapes, check_dtype

MAGIC = b"GGUF"
# llama.cpp's tensors of a block -> our fields
_LAYER = {"attn_norm.weight": "ln_1_g", "attn_norm.bias": "ln_1_b", "attn_qkv.weight": "c_attn_w",
          "attn_qkv.bias": "c_attn_b", "attn_output.weight": "attn_c_proj_w", "attn_output.bias": "attn_c_proj_b",
          "ffn_norm.weight": "ln_2_g", "ffn_norm.bias": "ln_2_b", "ffn_up.weight": "c_fc_w", "ffn_up.bias": "c_fc_b",
          "ffn_down.weight": "mlp_c_proj_w", "ffn_down.bias": "mlp_c_proj_b"}
_MODEL = {"token_embd.weight": "wte", "position_embd.weight": "wpe", "output_norm.weight": "ln_f_g",
          "output_norm.bias": "ln_f_b"}
_AS_STORED = {"int8": "Q8_0", "int4": "Q4_0", "bfloat16": "BF16"}  # our format -> the GGUF type it is, bit for bit
_BLOCK = 32  # inputs a Q8_0 or Q4_0 block scales (ggml's QK8_0, QK4_0): our GROUP, or they are not ours


class GGUFWarning(UserWarning):
    """A GGUF's tensor the asked-for format cannot hold exactly, rounded again from its values."""


def is_gguf(file: Path) -> bool:
    with open(file, "rb") as f:
        return f.read(4) == MAGIC


def _reader(file: Path, source: str):
    try:
        import gguf
    except ImportError as e:
        raise CheckpointError(f"{source!r} is a GGUF file; reading one needs the gguf package ({e}): "
                              "pip install 'gpt2numba[gguf]'") from None
    try:
        reader = gguf.GGUFReader(file, "r")
    except Exception as e:  # (an untrusted file: whatever its parser raises)
        raise CheckpointError(f"{source!r} is not a readable GGUF file: {e!r}") from None
    if reader.byte_order != "I" or sys.byteorder != "little":  # ("S": swapped against this machine's order)
        raise CheckpointError(f"{source!r}: gpt2numba reads little-endian GGUF files on little-endian machines")
    return gguf, reader


def _value(reader, key: str, source: str):
    """A GGUF metadata value: a string or a number (CheckpointError where it is missing)."""
    field = reader.fields.get(key)
    if field is None or not field.data:
        raise CheckpointError(f"{source!r} has no {key!r}")
    if field.types[0].name == "ARRAY":
        raise CheckpointError(f"{source!r}: {key!r} is an array; gpt2numba reads one value (every layer alike)")
    part = field.parts[field.data[0]]
    if field.types[0].name == "STRING":
        return bytes(part).decode("utf-8", "replace")
    # (a float32, such as GPT-2's epsilon, as the number it was written as: 1e-05, not 9.99999974738e-06)
    return float(str(part[0])) if part.dtype == np.float32 else part[0].item()


def _strings(reader, key: str, source: str) -> list[str]:
    field = reader.fields.get(key)
    if field is None:
        raise CheckpointError(f"{source!r} has no {key!r}")
    try:
        return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{source!r}: {key!r} holds a string that is not UTF-8 ({e})") from None


def _check_architecture(reader, source: str) -> None:
    if (arch := _value(reader, "general.architecture", source)) != "gpt2":
        raise CheckpointError(f"{source!r} holds a {arch!r} model; gpt2numba runs GPT-2 ('gpt2')")


def _config(reader, tensors, source: str) -> GPT2Config:
    _check_architecture(reader, source)
    if "token_embd.weight" not in tensors or len(tensors["token_embd.weight"].shape) != 2:
        raise CheckpointError(f"{source!r} has no tensor 'token_embd.weight' of two axes")
    n_embd = _value(reader, "gpt2.embedding_length", source)
    if (ff := _value(reader, "gpt2.feed_forward_length", source)) != 4 * n_embd:
        raise CheckpointError(f"{source!r}: feed_forward_length {ff} is not 4 x embedding_length {n_embd}")
    try:
        return GPT2Config(n_layer=_value(reader, "gpt2.block_count", source),
                          n_head=_value(reader, "gpt2.attention.head_count", source), n_embd=n_embd,
                          n_positions=_value(reader, "gpt2.context_length", source),
                          vocab_size=int(tensors["token_embd.weight"].shape[1]),
                          layer_norm_epsilon=_value(reader, "gpt2.attention.layer_norm_epsilon", source))
    except ConfigError as e:
        raise CheckpointError(f"{source!r}: {e}") from None


def read(file: Path, source: str, dtype: str) -> GPT2Weights:
    """The weights of GGUF ``file`` in memory, stored as ``dtype`` (exactly where the module's docstring says)."""
    gguf, reader = _reader(file, source)
    tensors = {t.name: t for t in reader.tensors}
    config = _config(reader, tensors, source)
    check_dtype(dtype, config)
    expected = {name: (field, None) for name, field in _MODEL.items()}
    expected |= {f"blk.{i}.{name}": (field, i) for i in range(config.n_layer) for name, field in _LAYER.items()}
    if missing := [name for name in expected if name not in tensors]:
        raise CheckpointError(f"{source!r} lacks tensor {missing[0]!r} ({len(missing)} missing in all)")
    if unknown := sorted(set(tensors) - set(expected) - {"output.weight"}):
        raise CheckpointError(f"{source!r} has unexpected tensor {unknown[0]!r}; is this GPT-2?")

    shapes = dict(_field_shapes(config))
    arrays = {field: np.empty(compact.stored_shape(field, shape, dtype) if field in MATRICES else shape,
                              storage(field, dtype) if field in MATRICES else np.float32)
              for field, shape in shapes.items()}
    if dtype == "float32":  # the blocks' matrices kept [out, in] (GPT2Weights)
        arrays |= {field: compact.from_rows(field, np.empty(compact.to_rows(field, arrays[field]).shape, np.float32))
                   for field in BLOCK_MATRICES}
    scales = {field: np.empty(compact.scale_shape(field, shape), np.float32)
              for field, shape in shapes.items() if field in MATRICES} if dtype in INTEGER else None
    rounded = []
    for name, (field, layer) in expected.items():
        t, at = tensors[name], ... if layer is None else layer
        shape = shapes[field][1:] if layer is not None else shapes[field]
        rows = shape[::-1] if field in BLOCK_MATRICES else shape  # [out, in]
        if tuple(reversed(t.shape.tolist())) != rows:  # (ggml's ne lists the fastest axis first)
            raise CheckpointError(f"tensor {name!r} has shape {list(reversed(t.shape.tolist()))}, "
                                  f"expected {list(rows)}")
        kind = t.tensor_type.name
        fmt = compact.format_of(field, dtype) if field in MATRICES else "float32"
        stored = _as_stored(t.data, kind, rows) if _AS_STORED.get(fmt) == kind and compact.GROUP == _BLOCK else None
        if stored is not None:
            q, scale = stored
            check_finite(name, scale if scale is not None else compact.from_bfloat16(q))
            arrays[field][at] = q
            if scale is not None:
                scales[field][at] = scale
            continue
        values = _values(gguf, t, rows)
        check_finite(name, values)
        if fmt == "float32":
            (compact.to_rows(field, arrays[field][at]) if field in MATRICES else arrays[field][at])[...] = values
            continue
        if kind != "F32":
            rounded.append(f"{name} ({kind})")
        q, scale = compact.compress(field, compact.from_rows(field, values), dtype)
        arrays[field][at] = q
        if scales is not None:
            scales[field][at] = scale
    if "output.weight" in tensors:
        _check_tied(gguf, tensors["output.weight"], tensors["token_embd.weight"], shapes["wte"], source)
    if rounded:
        warnings.warn(f"gpt2numba: {source!r}: {dtype} cannot hold {', '.join(rounded[:3])}"
                      f"{f' and {len(rounded) - 3} more' if len(rounded) > 3 else ''} as the file stores "
                      f"{'it' if len(rounded) == 1 else 'them'}, so they were rounded again from their values; "
                      "dtype='float32' keeps every value exactly", GGUFWarning, stacklevel=3)
    return GPT2Weights(config=config, **arrays, dtype=dtype, scales=scales)


def _check_tied(gguf, head, embedding, rows, source: str) -> None:
    """CheckpointError unless the file's output.weight is its token_embd.weight: GPT-2's head is tied.

    llama.cpp's converters once wrote the head as a copy of the embedding, and its quantiser then gives the head a
    type of its own (Q6_K or Q5_K, or Q8_0 where n_embd is not a multiple of 256): the same matrix rounded apart.
    So a head of the embedding's type must equal it, byte for byte; one of another type must lie within half of
    its size (the root mean square of their difference against the embedding's: llama.cpp's Q2_K rounding errs
    by 0.30-0.35, two matrices drawn apart by about 1.4), and is set aside with a GGUFWarning: the head is
    token_embd, as GPT-2's is. Compared 4096 rows at a time (xl's wte in float32 is 320 MB)."""
    untied = CheckpointError(f"{source!r} has an output.weight that differs from token_embd.weight; "
                             "gpt2numba supports only GPT-2's tied output head")
    if list(head.shape) != list(embedding.shape):
        raise untied
    if head.tensor_type == embedding.tensor_type:
        if not np.array_equal(head.data, embedding.data):
            raise untied
        return
    apart = size = 0.0
    for at in range(0, rows[0], 4096):
        part = (at, min(at + 4096, rows[0]))
        h, e = (_values(gguf, t, (part[1] - part[0], rows[1]), part) for t in (head, embedding))
        apart += float(np.square(h - e, dtype=np.float64).sum())
        size += float(np.square(e, dtype=np.float64).sum())
    if not apart <= 0.25 * size:  # (squares: within half; a NaN fails too)
        raise untied
    warnings.warn(f"gpt2numba: {source!r}: output.weight ({head.tensor_type.name}) is token_embd.weight "
                  f"({embedding.tensor_type.name}) rounded apart; the head is token_embd.weight, as GPT-2's is tied, "
                  "so logits differ from llama.cpp's, which reads output.weight", GGUFWarning, stacklevel=4)


def _values(gguf, t, rows, part: tuple[int, int] | None = None) -> np.ndarray:
    """A tensor's values [out, in] (or rows ``part`` of them) as the gguf package dequantizes them to float32."""
    data = t.data if part is None else t.data[part[0]:part[1]]
    try:
        return np.asarray(gguf.quants.dequantize(data, t.tensor_type), np.float32).reshape(rows)
    except (NotImplementedError, ValueError, TypeError) as e:
        raise CheckpointError(f"tensor {t.name!r} is of type {t.tensor_type.name}, which gpt2numba cannot read as "
                              f"float32 ({e!r})") from None


def _as_stored(data: np.ndarray, kind: str, rows: tuple):
    """(values as our format stores them, float32 scales or None) of a tensor whose type is our format's own,
    or None where it is not held exactly after all (a Q8_0 value of -128, outside int8's [-127, 127])."""
    if kind == "BF16":
        return np.ascontiguousarray(data).view("<u2").reshape(rows), None
    out, n_in = rows
    half = 2 if kind == "Q4_0" else 1  # bytes per input: a half for nibbles
    blocks = np.ascontiguousarray(data).reshape(out, n_in // _BLOCK, 2 + _BLOCK // half)
    scale = blocks[..., :2].copy().view("<f2")[..., 0].astype(np.float32)
    q = blocks[..., 2:].reshape(out, n_in // half)
    if kind == "Q8_0":
        q = q.view(np.int8)
        if (q == -128).any():
            return None
    return q, scale


def vocabulary(file: Path, source: str) -> tuple[list[str], list[str]]:
    """A GGUF's tokens (byte-level strings, by id) and BPE merges ("a b"): CheckpointError unless it carries
    GPT-2's kind of tokenizer (a byte-level BPE split as GPT-2 splits)."""
    _, reader = _reader(file, source)
    _check_architecture(reader, source)
    if (model := _value(reader, "tokenizer.ggml.model", source)) != "gpt2":
        raise CheckpointError(f"{source!r} carries a {model!r} tokenizer; gpt2numba reads byte-level BPE ('gpt2')")
    # (older files have no pre: GPT-2's, whose architecture was checked)
    pre = _value(reader, "tokenizer.ggml.pre", source) if "tokenizer.ggml.pre" in reader.fields else "gpt-2"
    if pre != "gpt-2":
        raise CheckpointError(f"{source!r}'s tokenizer splits text as {pre!r}; gpt2numba splits as GPT-2 ('gpt-2')")
    return _strings(reader, "tokenizer.ggml.tokens", source), _strings(reader, "tokenizer.ggml.merges", source)

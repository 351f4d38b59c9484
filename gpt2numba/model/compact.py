"""Compact weights: bfloat16; int8 and int4 with one float32 scale per group of 32 inputs.

Only the matrices are compacted (the blocks' four and the tied wte); biases,
layernorm parameters and wpe stay float32, as does the cache.

Every format keeps every matrix [out, in] (the blocks' are [in, out] in the model,
and float32's fields are [in, out] views; wte is [out, in] already), so that an output is one dot
product along a row, read at the speed of memory by one row: bfloat16's four matrices
of a layer streamed at 34-42 GB/s so, against 23-30 along the columns (2 threads,
AMD EPYC Zen 4); and for the integer formats a group of GROUP inputs is
contiguous. bfloat16 files keep the model's layout, as every GPT-2 loader reads
them (checkpoints.py turns them on the way). The integer formats: each group has a float32 scale, and
values are symmetric about zero: int8 in [-127, 127] (scale = max|x| / 127);
int4 in [-8, 7], as llama.cpp's Q4_0: the group's value of largest magnitude
becomes -8 (scale = that value / -8, so a negative scale when it is positive), and
the other 15 levels take the rest, an eighth finer than [-7, 7]. An int4 value is
stored as value + 8 in a nibble, two per byte: byte j of a group holds input j in
its low nibble and input j + GROUP/2 in its high one, so the two halves unpack with
one mask and one shift each.

The integer formats quantise the inputs of their matrix products too, as
llama.cpp's Q8_0 and Q4_0 do: each row of activations becomes int8 per group
of GROUP, with one float32 scale, so that products are int8 x int8 in int32.
Every path that multiplies by an integer matrix (one row, a few, a long
prefill through BLAS) uses the same rounded inputs, so the paths agree.

int4 keeps the tied embedding and head, wte, in int8 (see format_of): its errors
reach every logit directly, and llama.cpp's Q4_0 likewise keeps it in Q6_K.
"""

from __future__ import annotations

import numpy as np

from ..cpu.dispatch import GROUP  # inputs per scale: the integer kernels are written for it

DTYPES = ("float32", "bfloat16", "int8", "int4")
ACTIVATIONS = ("float32", "bfloat16")  # the matrix products' inputs: as computed, or rounded to bfloat16
INTEGER = ("int8", "int4")
STORAGE = {"float32": np.float32, "bfloat16": np.uint16, "int8": np.int8, "int4": np.uint8}  # bfloat16 as its bits
LEVELS = {"int8": 127, "int4": 8}  # the largest |value| of each integer format
MATRICES = ("wte", "c_attn_w", "attn_c_proj_w", "c_fc_w", "mlp_c_proj_w")
BLOCK_MATRICES = MATRICES[1:]  # the blocks' four: [in, out] in the model
_CHUNK_ROWS = 4096  # quantize() takes a longer matrix (wte) this many rows at a time: small temporaries


def format_of(field: str, dtype: str) -> str:
    """The format in which weights of ``dtype`` keep the matrix ``field``: their own, but int8 for int4's wte."""
    return "int8" if dtype == "int4" and field == "wte" else dtype


def storage(field: str, dtype: str):
    """The NumPy dtype of the matrix ``field`` in weights of ``dtype``."""
    return STORAGE[format_of(field, dtype)]


def to_rows(field: str, a: np.ndarray) -> np.ndarray:
    """A matrix (any leading axes) in the model's layout as [out, in] (a view); wte already is."""
    return a if field == "wte" else np.swapaxes(a, -1, -2)


from_rows = to_rows  # [out, in] back to the model's layout: the same swap


def stored_shape(field: str, shape: tuple, dtype: str) -> tuple:
    """Shape in which weights of ``dtype`` store the matrix ``field`` of the model's ``shape``."""
    dtype = format_of(field, dtype)
    if dtype == "float32":
        return shape
    rows = _rows_shape(field, shape)
    return rows[:-1] + (rows[-1] // 2,) if dtype == "int4" else rows


def scale_shape(field: str, shape: tuple) -> tuple:
    """Shape of the integer formats' scales of a matrix of the model's ``shape``: [out, in // GROUP]."""
    rows = _rows_shape(field, shape)
    return rows[:-1] + (rows[-1] // GROUP,)


def _rows_shape(field, shape):
    return tuple(shape) if field == "wte" else tuple(shape[:-2]) + (shape[-1], shape[-2])


def to_bfloat16(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), rounding to nearest, ties to even."""
    bits = np.ascontiguousarray(a, np.float32).view(np.uint32)
    return ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)


def from_bfloat16(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) -> float32, exactly (a bfloat16 is float32's top half)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def quantize(a: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """``dtype`` per group of GROUP along the last axis (see above): a ~= q * scale.

    a: float32 [..., in] -> (int8 [..., in], or packed uint8 [..., in // 2] for int4;
    float32 scales [..., in // GROUP]).
    """
    if a.ndim > 1 and a.shape[0] > _CHUNK_ROWS:
        parts = [quantize(a[i:i + _CHUNK_ROWS], dtype) for i in range(0, a.shape[0], _CHUNK_ROWS)]
        return np.concatenate([q for q, _ in parts]), np.concatenate([s for _, s in parts])
    grouped, levels = _grouped(a), LEVELS[dtype]
    if dtype == "int8":
        extreme, low, high = np.abs(grouped).max(axis=-1, keepdims=True) / np.float32(levels), -levels, levels
    else:  # the signed value of largest magnitude goes to -levels
        at = np.abs(grouped).argmax(axis=-1)[..., None]
        extreme, low, high = np.take_along_axis(grouped, at, axis=-1) / np.float32(-levels), -levels, levels - 1
    scale = np.where(extreme != 0, extreme, np.float32(1)).astype(np.float32)
    q = np.clip(np.rint(grouped / scale), low, high).astype(np.int8).reshape(a.shape)
    return (pack(q) if dtype == "int4" else q), scale[..., 0]



def dequantize(stored: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """float32 [..., in] values of int8 ``stored`` [..., in], or int4 packed as uint8 [..., in // 2]."""
    q = unpack(stored) if stored.dtype == np.uint8 else stored
    return (_grouped(q) * scale[..., None]).astype(np.float32).reshape(q.shape)


def pack(q: np.ndarray) -> np.ndarray:
    """int8 values in [-8, 7], [..., in] -> uint8 [..., in // 2], two nibbles a byte (see above)."""
    halves = _grouped(q.astype(np.int16) + 8).reshape(*q.shape[:-1], -1, 2, GROUP // 2)
    return (halves[..., 0, :] | halves[..., 1, :] << 4).astype(np.uint8).reshape(*q.shape[:-1], -1)


def unpack(p: np.ndarray) -> np.ndarray:
    """uint8 [..., in // 2] -> int8 [..., in], the values pack() packed."""
    p = p.reshape(*p.shape[:-1], -1, GROUP // 2)
    q = np.stack([p & 15, p >> 4], axis=-2).astype(np.int8) - np.int8(8)
    return q.reshape(*p.shape[:-2], -1)


def compress(field: str, a: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray | None]:
    """(stored matrix, scales or None) of float32 ``a`` (the model's layout) in weights of ``dtype``."""
    dtype = format_of(field, dtype)
    if dtype == "bfloat16":
        return to_bfloat16(to_rows(field, a)), None
    if dtype in INTEGER:
        return quantize(np.ascontiguousarray(to_rows(field, a), np.float32), dtype)
    return np.asarray(a, np.float32), None  # (GPT2Weights lays it out)


def expand(field: str, stored: np.ndarray, scale: np.ndarray | None) -> np.ndarray:
    """float32 values of a stored matrix in the model's layout, whatever its format: for the blocks' matrices a
    view [in, out] of values [out, in], as float32 weights keep them."""
    if stored.dtype == np.uint16:
        return from_rows(field, from_bfloat16(stored))
    if scale is not None:
        return from_rows(field, dequantize(stored, scale))
    return stored


def _grouped(a):
    """``a`` with its last axis split into (groups, GROUP)."""
    return a.reshape(*a.shape[:-1], a.shape[-1] // GROUP, GROUP)
